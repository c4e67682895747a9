"""Ranks that arrive at different times, call after call, at 2, 4 and 8 ranks, each on its own GPU
(or all on GPU 0 with YALI_ALLOW_SHARED_GPU=1: correctness only): a CUDA graph of 64 calls
cycling through every kernel's size boundaries and the fused op's one- and two-launch sizes, each
call delayed on each rank by a sleep of its own ("random") or on the last rank only ("last-rank",
so rank 0 is always a call ahead), replayed with programmatic dependent launch on and off; every
sum checked on the device, exactly; and one rank killed in the middle (delay_scenarios.py)."""
import pytest

from yali_vllm import _ext
from yali_vllm.communicator import shared_gpu_allowed

from . import delay_scenarios as ds
from . import reliability
from .pair import run_ranks

WORLD_SIZES = (2, 4, 8)
# 2000 replays x 64 calls on real GPUs (seconds); ranks sharing one GPU take turns per call pair,
# milliseconds each, so they run fewer.
REPLAYS = 40 if shared_gpu_allowed() else 2000
# Replays the killed rank runs before it dies: on one GPU eight ranks take ~1.6 s a replay, so 200
# would end the survivors' deadline (TIMEOUT_S + MARGIN_S) before the rank is even killed.
KILL_AFTER = 3 if shared_gpu_allowed() else 200
BOUND_S = {2: 200, 4: 240, 8: 300}  # start-up, capture and replays of N processes
TIMEOUT_S = 10.0  # YALI_TIMEOUT_S of the killed-rank case
MARGIN_S = 30.0  # trap, error propagation and (shared GPU) the other processes' time slices
SEED = 4242


@pytest.mark.gpu
@pytest.mark.timeout(max(BOUND_S.values()) + 30)
@pytest.mark.parametrize("pdl", ["1", "0"], ids=lambda p: f"pdl{p}")
@pytest.mark.parametrize("mode", ["random", "last-rank"])
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_delayed_calls_stay_exact(world_size, mode, pdl):
    res = run_ranks(ds.delayed_calls, mode, REPLAYS, SEED, world_size=world_size, timeout=BOUND_S[world_size],
                    env={"YALI_TIMEOUT_S": "30", "YALI_DEV_PDL": pdl})
    for rank, r in enumerate(res):
        assert r["error"] is None and r["abort"] == "", (rank, r)
        assert r["wrong"] == 0, f"rank {rank}: {r['wrong']} wrong elements over {r['replays']} replays of {r['specs']}"
        assert r["device_calls"] == r["replays"] * r["calls_per_graph"], (rank, r)
        assert not r["differing"], f"rank {rank}: fused outputs differ between ranks: {r['differing']}"
    kinds = {k for k, _ in res[0]["specs"]}
    assert kinds == {"all_reduce", "fused"} and len(res[0]["specs"]) >= 4, res[0]["specs"]


@pytest.mark.gpu
@pytest.mark.timeout(max(BOUND_S.values()) + 60)
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_a_rank_killed_among_delayed_calls_ends_in_named_errors(world_size):
    victim = world_size - 1
    res = run_ranks(ds.delayed_calls_rank_killed, KILL_AFTER, TIMEOUT_S + MARGIN_S, SEED, world_size=world_size,
                    timeout=BOUND_S[world_size] + TIMEOUT_S, lost=(victim,), env={"YALI_TIMEOUT_S": str(TIMEOUT_S)})
    assert res[victim] is None  # killed
    survivors = [r for r in res if r is not None]
    reliability.assert_every_rank_raised(survivors, world_size - 1)
    for rank, r in enumerate(res):
        if rank == victim:
            continue
        who = f"yali: rank {rank}" + (f" of {world_size}" if world_size > 2 else " ")  # two ranks: "rank 0 flash-push ..."
        assert "gave up" in r["abort"] and who in r["abort"], (rank, r)
        assert r["recorded_s"] < TIMEOUT_S + MARGIN_S, (rank, r)
    # a survivor waits for the dead rank (at two ranks: the peer), or for a survivor that waits for it
    waited = ("peer", f"rank {victim}") if world_size == 2 else (f"rank {victim}",)
    assert any(w in r["abort"].split("; this rank")[0] for r in survivors for w in waited), survivors


@pytest.mark.cpu
@pytest.mark.skipif(_ext.library_error() is not None, reason=f"extension not built: {_ext.library_error()}")
def test_boundary_counts_straddle_every_kernel_switch():
    assert [ds.serve_top(n) for n in WORLD_SIZES] == [8 << 20, 16 << 20, 8 << 20]
    for n in WORLD_SIZES:
        counts = ds.boundary_counts(n)
        assert counts[0] == 512 and counts[-1] == ds.serve_top(n) // 2 - 1
        # flash-push / stream at two ranks, one-shot / two-shot at N: 16 bytes either side
        assert len(counts) >= 4 and counts[2] - counts[1] == 16, (n, counts)
    assert ds.boundary_counts(2)[1:3] == [(8 << 20) // 2 - 8, (8 << 20) // 2 + 8]


@pytest.mark.cpu
def test_sleeps_are_per_rank_and_the_late_rank_is_the_last():
    a, b = ds.sleeps_of("random", 0, 4, 1), ds.sleeps_of("random", 1, 4, 1)
    assert len(a) == ds.CALLS_PER_GRAPH and a != b and max(a) < ds.MAX_SLEEP_CYCLES
    assert ds.sleeps_of("random", 0, 4, 1) == a  # deterministic
    late = [ds.sleeps_of("last-rank", r, 4, 1) for r in range(4)]
    assert late[3] == [ds.LATE_RANK_CYCLES] * ds.CALLS_PER_GRAPH and all(set(s) == {0} for s in late[:3])
    with pytest.raises(ValueError, match="mode"):
        ds.sleeps_of("sometimes", 0, 2, 1)
