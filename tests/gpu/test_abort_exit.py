"""A bounded end after an abort (abort_exit_scenarios.py), with the ranks sharing one GPU
(YALI_ALLOW_SHARED_GPU=1) or each on its own: after the ranks issue different calls (all-reduce,
fused op, EP dispatch; 2 and 4 ranks), every rank's process raises YaliError or is ended by the
abort watcher, with ABORT_EXIT_CODE and one log line naming the reason, within MISMATCH_BOUND_S of
the call. With the ranks sharing one GPU the trap does not reach the host, and
torch.cuda.synchronize() would wait forever."""
import pytest

from yali_vllm.communicator import ABORT_EXIT_CODE, ABORT_EXIT_GRACE_S, ABORT_POLL_S

from . import abort_exit_scenarios as ab
from .pair import missing_gpus

# A mismatch is recorded at once (the call check), within seconds even with the processes taking turns
# on one GPU; the watcher then ends the process ABORT_EXIT_GRACE_S later.
RECORD_MARGIN_S = 20.0
MISMATCH_BOUND_S = RECORD_MARGIN_S + ABORT_EXIT_GRACE_S + 2 * ABORT_POLL_S + 5.0


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ab.MISMATCH_CASES)
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda n: f"{n}-ranks")
def test_every_rank_ends_or_raises_within_a_bound_after_an_abort(world_size, case, tmp_path):
    reason = missing_gpus(world_size)
    if reason:
        pytest.skip(reason)
    startup_s = 60.0 + 15.0 * world_size  # spawn, import, the communicator (the processes share a GPU)
    res = ab.run_mismatch(case, world_size, str(tmp_path), startup_s + MISMATCH_BOUND_S,
                          env={"YALI_TIMEOUT_S": "10", "YALI_ABORT_EXIT": "1"})
    for rank, r in enumerate(res):
        events = {e["event"]: e for e in r["events"]}
        assert "calling" in events, (rank, r)
        t_call = events["calling"]["t"]
        assert "returned" not in events and "error" not in events, (rank, r)
        if "raised" in events:  # YaliError reached the caller (each rank on its own GPU)
            assert "different calls" in events["raised"]["error"], (rank, r)
            assert events["raised"]["t"] - t_call < MISMATCH_BOUND_S, (rank, r)
            continue
        assert r["exitcode"] == ABORT_EXIT_CODE, (rank, "not ended by the abort watcher (None: hung)", r)
        assert r["ended"] - t_call < MISMATCH_BOUND_S, (rank, r["ended"] - t_call, r)
        lines = [ln for ln in r["log"].splitlines() if "ends this process" in ln]
        assert len(lines) == 1 and f"(exit code {ABORT_EXIT_CODE})" in lines[0], (rank, r["log"])
        assert "the ranks issued different calls" in lines[0], (rank, lines)
