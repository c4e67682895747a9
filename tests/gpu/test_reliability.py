"""Never wrong, never hung, on the GPU (both ranks may share one: YALI_ALLOW_SHARED_GPU=1):
different calls on the two ranks are detected by the per-call descriptor and fail both ranks at
once; a peer that never calls or dies mid-call ends in a YaliError naming the kernel and the wait
within YALI_TIMEOUT_S plus a margin; close() is safe with and without captured graphs."""
import pytest

from . import pdl_scenarios, reliability
from yali_vllm.communicator import shared_gpu_allowed

from .pair import run_pair, run_ranks
from .testing_ops import needs_testing_ops

TIMEOUT_S = 4.0  # YALI_TIMEOUT_S of the watchdog cases
MARGIN_S = 20.0  # trap, error propagation and (shared GPU) the other process's time slices


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", sorted(reliability.MISMATCH_CASES))
def test_mismatched_calls_fail_both_ranks_at_once(case):
    # YALI_TIMEOUT_S is long: a failure that waited for the watchdog would show in recorded_s.
    res = run_pair(reliability.mismatched_calls, case, timeout=120, env={"YALI_TIMEOUT_S": "60"})
    for rank, r in enumerate(res):
        assert r["good_call_mismatches"] == 0, r
        assert "different calls" in r["abort"], (rank, r)
        assert "this rank: " in r["abort"] and "peer: " in r["abort"] and "not seen" not in r["abort"], (rank, r)
        assert r["recorded_s"] < 10, (rank, r)
    reliability.assert_every_rank_raised(res, 2)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind,kernel", [("flash", "flash-push"), ("stream", "stream"), ("fused", "fused")])
def test_peer_that_never_calls_ends_in_a_named_error(kind, kernel):
    r0, _ = run_pair(reliability.peer_never_calls, kind, TIMEOUT_S + MARGIN_S, timeout=120,
                     env={"YALI_TIMEOUT_S": str(TIMEOUT_S)})
    assert r0["error"] and r0["error"].startswith("YaliError"), r0
    assert "gave up" in r0["abort"] and kernel in r0["abort"], r0
    assert "peer: not seen (it has not issued this call)" in r0["abort"], r0
    assert TIMEOUT_S * 0.9 <= r0["elapsed_s"] < TIMEOUT_S + MARGIN_S, r0


@pytest.mark.timeout(150)
def test_peer_killed_mid_call_ends_in_a_named_error():
    r0, r1 = run_pair(reliability.peer_killed_mid_call, TIMEOUT_S, timeout=120, lost=(1,),
                      env={"YALI_TIMEOUT_S": str(TIMEOUT_S)})
    assert r1 is None  # killed
    assert r0["error"] and r0["error"].startswith("YaliError"), r0
    assert "gave up" in r0["abort"] and "stream" in r0["abort"], r0
    assert r0["elapsed_s"] < TIMEOUT_S + MARGIN_S, r0


@pytest.mark.timeout(150)
def test_graph_replays_after_close_stay_exact():
    res = run_pair(reliability.replay_after_close, 41, timeout=120)
    for r in res:
        assert r["mismatches"] == 0, r
        assert r["refused"] and "closed" in r["refused"], r
        assert r["abort"] == "", r


@pytest.mark.timeout(150)
def test_close_frees_after_both_unmapped_and_reopens():
    res = run_pair(reliability.close_and_reopen, 43, timeout=120)
    for r in res:
        assert r["mismatches"] == 0, r
        assert "is not open" in r["freed"], r
        assert r["kept"] is None, r


# 10^5 triples on two GPUs (~3 s); with both ranks on one GPU every call pair costs milliseconds of
# turn-taking, and that mode cannot show a race that needs two GPUs' timing anyway.
PDL_ITERATIONS = 2_000 if shared_gpu_allowed() else 100_000


@needs_testing_ops
@pytest.mark.timeout(300)
def test_a_foreign_pdl_kernel_that_never_waits_cannot_overlap_two_calls():
    """DESIGN_LOG §7: PDL orders a kernel only after the grid just before it. A foreign kernel that
    triggers at once and never waits, between two YALI calls: every sum exact, no abort."""
    res = run_pair(reliability.foreign_pdl_kernel_between_calls, PDL_ITERATIONS, 77, timeout=270,
                   env={"YALI_TIMEOUT_S": "10"})
    for rank, r in enumerate(res):
        assert r["error"] is None and r["abort"] == "", (rank, r)
        assert r["wrong"] == 0, (rank, r)
        assert r["triples"] >= PDL_ITERATIONS - reliability.PDL_CALLS_PER_GRAPH, (rank, r)


# Steps per case: each waits ~100 us for the slow rank and 50 us in the foreign kernel (with ranks
# sharing one GPU, plus their turns).
PDL_STEPS = 100


# Every case at two and four ranks, but the stream kernel (two ranks only).
PDL_CASES = [(c, n) for c in sorted(pdl_scenarios.CASES) for n in (2, 4) if c != "stream" or n == 2]


@needs_testing_ops
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case,world_size", PDL_CASES, ids=[f"{n}-ranks-{c}" for c, n in PDL_CASES])
def test_a_foreign_pdl_kernel_starts_only_after_the_call_before_ended(case, world_size):
    """DESIGN_LOG §7: a foreign kernel that triggers at once and never waits, after a call that
    waits for a slow rank, must find that call's output complete when it starts (so the YALI call
    after it cannot overlap the one before); every sum exact, no abort."""
    res = run_ranks(pdl_scenarios.foreign_kernel_after_a_slow_call, case, PDL_STEPS, world_size=world_size,
                    timeout=180, env={"YALI_TIMEOUT_S": "20"})
    for rank, r in enumerate(res):
        assert r["error"] is None and r["abort"] == "", (rank, r)
        assert r["incomplete"] == 0, f"rank {rank}: the foreign kernel saw {r['incomplete']} unwritten words ({r})"
        assert r["wrong"] == 0, (rank, r)
        assert r["world"] == world_size and r["steps"] == PDL_STEPS, (rank, r)
