"""YaliCommunicator.close() is coordinated between the ranks, over two real gloo ranks.

No GPU here: the library calls close() makes (unmap the peer's buffer, free my own) go to a
recorder in place of the CUDA library, so the test sees their order. What is under test is the
coordination: neither rank frees before both unmapped, nothing is freed when a graph on either
rank captured the kernels, and a peer that never reaches close() costs a bounded wait, not a
hang, and leaves this rank's buffer allocated. tests/gpu/test_reliability.py runs the real
library."""
import json
import time
from pathlib import Path

import pytest

from tests.plugin.cpu_ranks import run_two_cpu_ranks

CLOSE_TIMEOUT_S = 3.0


def _worker(rank, port, scenario, outdir):
    try:
        import torch
        import torch.distributed as dist

        from yali_vllm import communicator as c

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        calls: list[str] = []

        class Recorder:
            def close_peer(self, handle):
                calls.append("close_peer")

            def destroy(self, handle):
                calls.append("destroy")

        c._ext.ops = Recorder  # this spawned process only
        comm = c.YaliCommunicator.__new__(c.YaliCommunicator)
        comm._handle, comm._watcher = 7, None
        comm.group, comm.rank, comm.world_size, comm.device = dist.group.WORLD, rank, 2, torch.device("cpu")
        comm.captured = scenario == "captured" and rank == 0
        result: dict = {}
        if scenario == "absent" and rank == 1:
            time.sleep(CLOSE_TIMEOUT_S + 4)  # alive, but never reaches close()
        else:
            t0 = time.time()
            comm.close(timeout_s=CLOSE_TIMEOUT_S)
            comm.close()  # a second call does nothing
            result = {"calls": calls, "kept": comm._kept, "elapsed_s": time.time() - t0}
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))
        if scenario != "absent":
            dist.barrier()  # neither rank exits (closing its gloo pairs) while the other still talks
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        Path(outdir, f"rank{rank}.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))


@pytest.mark.timeout(120)
def test_both_ranks_unmap_before_either_frees(tmp_path):
    for r in run_two_cpu_ranks(_worker, "both", outdir=tmp_path):
        assert r["calls"] == ["close_peer", "destroy"], r
        assert r["kept"] is None


@pytest.mark.timeout(120)
def test_a_capture_on_either_rank_keeps_both_ranks_buffers(tmp_path):
    for r in run_two_cpu_ranks(_worker, "captured", outdir=tmp_path):
        assert r["calls"] == [], r  # nothing unmapped or freed: a graph may replay
        assert r["kept"] == 7


@pytest.mark.timeout(120)
def test_a_peer_that_never_closes_costs_a_bounded_wait(tmp_path):
    r0, r1 = run_two_cpu_ranks(_worker, "absent", outdir=tmp_path)
    assert r0["calls"] == ["close_peer"], r0  # unmapped the peer's buffer, kept its own
    assert r0["kept"] == 7
    assert r0["elapsed_s"] < CLOSE_TIMEOUT_S + 10, r0
    assert r1 == {}
