"""The all-reduce and the fused all-reduce + residual add + RMSNorm at N = 2, 4, 6 and 8 ranks: one
process per rank, each on its own GPU, or all on GPU 0 with YALI_ALLOW_SHARED_GPU=1 (correctness
only: the processes take turns on the GPU). Skipped without a GPU or the extension (conftest.py),
and for N ranks on fewer than N GPUs unless they share GPU 0 (pair.run_ranks).

Per N, one process group runs the all-reduce sweep, the fused sweep, the CUDA graph and the
interleaved stress on one communicator (ranks_scenarios.ranks_suite: the start-up of N processes
importing torch is paid once) and each test asserts on its part; the mismatched call runs in its
own group, since its kernels trap. On one shared GPU (an H100) the suite of N ranks takes 18 s
(N = 2, 4) to 32 s (N = 8) and the mismatched call 16-18 s; the suite runs twice more at each N
above two (the fused op spread over clusters of 8, the two-shot in rounds).

The tests marked cpu check the references, seeds and size selection on CPU torch."""
import os

import pytest
import torch

from . import ranks_scenarios as rs
from . import reliability
from . import scenarios
from .pair import (MISMATCH_BOUND_S, MISMATCH_MARGIN_S, MISMATCH_TIMEOUT_S, SUITE_BOUND_S, SUITE_TIMEOUT_S,
                   missing_gpus, run_ranks)
from .scenarios import checked_parts, suite_part

WORLD_SIZES = (2, 4, 6, 8)  # every world size YALI serves (config.WORLD_SIZES)
DTYPES = ("fp32", "fp16", "bf16")
FUSED_DTYPES = ("bf16", "fp16")
FUSED_HIDDEN = (2048, 4096, 8192)
FUSED_TOKENS = (1, 2, 7, 32)
EPS = (1e-5, 1e-6)
GRAPH_REPLAYS = 50
STRESS_ROUNDS = 150  # x (kernels of the table + 2) eager calls, the kernels alternating
SEED = 5151


def fused_ranks_plan() -> list[dict]:
    """Every fused dtype x hidden x tokens, with and without a residual; eps alternates and every
    other call with a residual updates it in place."""
    plan = []
    for dname in FUSED_DTYPES:
        for hidden in FUSED_HIDDEN:
            for tokens in FUSED_TOKENS:
                j = len(plan) // 2
                for with_res in (True, False):
                    plan.append({"dtype": dname, "tokens": tokens, "hidden": hidden, "residual": with_res,
                                 "eps": EPS[(j + with_res) % 2], "inplace": with_res and j % 2 == 0})
    return plan


def run_suite(n: int, **knobs: str):
    """The suite (ranks_scenarios.ranks_suite) at `n` ranks, `knobs` (YALI_* settings) in their environment."""
    return run_ranks(rs.ranks_suite, DTYPES, fused_ranks_plan(), GRAPH_REPLAYS, SEED, STRESS_ROUNDS, world_size=n,
                     timeout=SUITE_BOUND_S[n], env={"YALI_TIMEOUT_S": SUITE_TIMEOUT_S, **knobs})


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def suite(request):
    return request.param, run_suite(request.param)


def assert_ranks_agree(parts):
    for rank, r in enumerate(parts):
        assert not r["differing"], f"rank {rank}: outputs differ between ranks in {r['differing'][:10]}"


@pytest.mark.gpu
@pytest.mark.timeout(max(SUITE_BOUND_S.values()) + 30)
def test_all_reduce_sweep_every_kernel_and_dtype(suite):
    n, res = suite
    parts = checked_parts(res, "sweep")
    for rank, r in enumerate(parts):
        assert r["checks"] == parts[0]["checks"] >= 20 * len(DTYPES)
        assert set(r["kernels"]) == set(DTYPES)
        for dname, hit in r["kernels"].items():
            assert hit == r["table_kernels"], f"{dname} hit {hit} of the table's {r['table']}"
        # the N inputs added in fp32 in rank order 0, 1, ..., N - 1, rounded once (n_rank_exchange.cuh)
        assert r["order_mismatches"] == 0, f"rank {rank}: {r['order_mismatches']} elements differ from that sum"
    assert_ranks_agree(parts)
    if n > 2:  # a message above the N-rank limit is refused, naming that limit and where it comes from
        top = rs.serve_top(n)
        want = (f"YALI_DEV_RANKS_MAX={top} at {n} ranks" if os.environ.get("YALI_DEV_RANKS_MAX")
                else f"the N-rank limit {top} at {n} ranks (YALI_DEV_RANKS_MAX unset)")
        assert all(want in r["refusal"] for r in parts), [r["refusal"] for r in parts]
    p = parts[0]
    print(f"\n{n} ranks: {p['checks']} all-reduce checks in {p['wall_s']:.1f}s over {p['table']}")


@pytest.mark.gpu
@pytest.mark.timeout(max(SUITE_BOUND_S.values()) + 30)
def test_fused_sweep_matches_vllm_reference(suite):
    n, res = suite
    parts = checked_parts(res, "fused")
    for rank, r in enumerate(parts):
        assert r["launched"] == r["specs"] >= len(fused_ranks_plan())
        assert r["device_fused_calls"] == r["launched"]  # every check ran a fused operation
        assert r["one_launch"] > 0
        assert r["two_launch"] > 0 or not r["two_launch_served"], r
    assert_ranks_agree(parts)
    print(f"\n{n} ranks: {parts[0]['launched']} fused checks in {parts[0]['wall_s']:.1f}s, "
          f"{parts[0]['two_launch']} in two launches")


@pytest.mark.gpu
@pytest.mark.timeout(max(SUITE_BOUND_S.values()) + 30)
def test_cuda_graph_replays_with_fresh_inputs(suite):
    n, res = suite
    parts = checked_parts(res, "graph")
    for rank, r in enumerate(parts):
        assert r["replays"] == GRAPH_REPLAYS
        # the device-side counters prove the replays ran YALI's kernels
        assert r["device_fused_calls"] == r["expected_fused_calls"], r
        assert r["device_calls"] == r["expected_calls"], r
    assert_ranks_agree(parts)


@pytest.mark.gpu
@pytest.mark.timeout(max(SUITE_BOUND_S.values()) + 30)
def test_interleaved_stress_every_kernel_call_after_call(suite):
    n, res = suite
    parts = suite_part(res, "stress")
    for rank, r in enumerate(parts):
        assert r["bad"] == 0, f"rank {rank}: {r['bad']} wrong elements in {r['rounds']} rounds of {r['counts']}"
        # one exchange launch per call (the fused calls run in one launch at this size)
        assert r["calls"] == r["rounds"] * (len(r["counts"]) + 1), r
    assert len(parts[0]["counts"]) >= 3  # 1000 elements and every kernel of the table
    assert_ranks_agree(parts)


# The fused op with every row spread over a cluster of 8 CTAs instead of the default 4
# (YALI_DEV_RANKS_FUSED_SPREAD): the same suite, run at the world sizes above two, where it applies.
SPREAD = "8"


@pytest.fixture(scope="module", params=[n for n in WORLD_SIZES if n > 2], ids=lambda n: f"{n}-ranks")
def spread_suite(request):
    return request.param, run_suite(request.param, YALI_DEV_RANKS_FUSED_SPREAD=SPREAD)


@pytest.mark.gpu
@pytest.mark.timeout(max(SUITE_BOUND_S.values()) + 30)
def test_fused_spread_over_a_cluster_matches_vllm_reference(spread_suite):
    n, res = spread_suite
    for name in ("fused", "graph"):
        parts = checked_parts(res, name)
        assert_ranks_agree(parts)
    fused = suite_part(res, "fused")
    assert all(r["spread"] > 0 for r in fused), fused[0]  # some calls ran the spread kernel
    for r in suite_part(res, "graph"):
        assert r["device_fused_calls"] == r["expected_fused_calls"], r


# The push two-shot run round by round (YALI_DEV_RANKS_TWO_SHOT_ROUND): 8 KiB of each CTA's share of
# a segment per round (its smallest), so the sweep's two-shot calls above 4 MiB at 4 ranks and
# above 6 MiB at 6 run several rounds, odd sizes a short last one (at 8 ranks, whose limit is 8 MiB,
# one round); the same suite at the world sizes above two.
TWO_SHOT_ROUND = "8K"


@pytest.fixture(scope="module", params=[n for n in WORLD_SIZES if n > 2], ids=lambda n: f"{n}-ranks")
def rounds_suite(request):
    return request.param, run_suite(request.param, YALI_DEV_RANKS_TWO_SHOT_ROUND=TWO_SHOT_ROUND)


@pytest.mark.gpu
@pytest.mark.timeout(max(SUITE_BOUND_S.values()) + 30)
def test_two_shot_in_rounds_matches_the_rank_order_sum(rounds_suite):
    n, res = rounds_suite
    sweep = checked_parts(res, "sweep")
    for rank, r in enumerate(sweep):
        assert r["order_mismatches"] == 0, f"rank {rank}: {r['order_mismatches']} elements differ from that sum"
        assert all("push-twoshot" in hit for hit in r["kernels"].values()), r["kernels"]
    assert_ranks_agree(sweep)
    for name in ("fused", "graph"):
        assert_ranks_agree(checked_parts(res, name))
    stress = suite_part(res, "stress")
    assert all(r["bad"] == 0 for r in stress), [r["bad"] for r in stress]
    assert_ranks_agree(stress)


@pytest.mark.gpu
@pytest.mark.timeout(max(MISMATCH_BOUND_S.values()) + 30)
@pytest.mark.parametrize("case", rs.MISMATCH_CASES)
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_mismatched_call_ends_in_yali_error(world_size, case):
    res = run_ranks(rs.mismatched_call, SEED, MISMATCH_TIMEOUT_S + MISMATCH_MARGIN_S, case, world_size=world_size,
                    timeout=MISMATCH_BOUND_S[world_size], env={"YALI_TIMEOUT_S": str(MISMATCH_TIMEOUT_S)})
    for rank, r in enumerate(res):
        assert not r["good_call_problems"], (rank, r)
        # every rank checks every other rank's call descriptor: the difference, not the watchdog
        assert "different calls" in r["abort"], f"rank {rank}: {r}"
        if world_size > 2:  # the record names the rank it disagrees with: rank 0 differs from all
            assert f"; rank {1 if rank == 0 else 0}: " in r["abort"], f"rank {rank}: {r}"
        assert r["recorded_s"] < MISMATCH_TIMEOUT_S + MISMATCH_MARGIN_S, (rank, r)
    reliability.assert_every_rank_raised(res, world_size)


# ------------------------------------------------------------------------ on CPU torch
CPU = torch.device("cpu")


@pytest.mark.cpu
def test_rank_seeds_are_distinct_and_spare_the_shared_slot():
    seeds = {rs.rank_seed(call, rank) for call in range(50) for rank in range(max(WORLD_SIZES))}
    assert len(seeds) == 50 * max(WORLD_SIZES)
    assert not any(s % rs.SEED_STRIDE == rs.SHARED_SLOT for s in seeds)
    with pytest.raises(ValueError, match="rank must be in"):
        rs.rank_seed(3, rs.SHARED_SLOT)


@pytest.mark.cpu
@pytest.mark.parametrize("dname", DTYPES)
def test_sum_references_regenerate_every_rank(dname):
    dtype, n = scenarios.DTYPES[dname], 1001
    xs = [rs.rank_input(7, r, n, dtype, CPU) for r in range(8)]
    assert not torch.equal(xs[0], xs[1])
    refs = rs.sum_references(7, 8, n, dtype, CPU)
    assert torch.equal(refs["fp64"], sum(x.double() for x in xs))
    assert torch.equal(refs["abs"], sum(x.double().abs() for x in xs))
    # at two ranks the rank-order fp32 sum is the two-rank reference, bit for bit
    pair = rs.sum_references(7, 2, n, dtype, CPU)["fp32"]
    assert scenarios.mismatches(pair, scenarios.reference(xs[0], xs[1])) == 0


@pytest.mark.cpu
@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tolerance_takes_fp32_sums_in_any_order_and_nothing_more(dname, world_size):
    dtype, n = scenarios.DTYPES[dname], 4099
    refs = rs.sum_references(11, world_size, n, dtype, CPU)
    xs = [rs.rank_input(11, r, n, dtype, CPU).float() for r in range(world_size)]
    backwards = xs[-1]
    for x in reversed(xs[:-1]):
        backwards = backwards + x
    for out in (refs["fp32"], refs["fp64"].to(dtype), backwards.to(dtype)):
        assert rs.out_of_tolerance(out, refs, world_size) == 0
    off = refs["fp32"].clone()
    off[9] = off[9] * 1.01 + 0.5
    off[17] = float("nan")
    if dtype != torch.float32:  # fp16 / bf16: two units in the last place off is too far
        off.view(torch.int16)[5] += 2
    assert rs.out_of_tolerance(off, refs, world_size) == 2 + (dtype != torch.float32)


@pytest.mark.cpu
@pytest.mark.parametrize("dname", FUSED_DTYPES)
@pytest.mark.parametrize("with_residual", (True, False))
def test_fused_reference_of_the_sum_is_the_two_rank_reference(dname, with_residual):
    dtype = scenarios.DTYPES[dname]
    x0, residual, weight, summed = rs.fused_rank_inputs(3, 0, 2, 5, 2048, dtype, CPU, with_residual)
    x1, residual1, weight1, _ = rs.fused_rank_inputs(3, 1, 2, 5, 2048, dtype, CPU, with_residual)
    assert not torch.equal(x0, x1) and torch.equal(weight, weight1)
    assert (residual is None and residual1 is None) or torch.equal(residual, residual1)
    got = rs.fused_sum_reference(summed, residual, weight, 1e-6)
    want = scenarios.fused_reference(x0, x1, residual, weight, 1e-6)
    for g, w in zip(got, want):
        assert scenarios.mismatches(g, w) == 0
    # -0.0 added to the sum keeps its sign bits: a sum of -0.0 stays -0.0
    zero = torch.full((4,), -0.0, dtype=dtype)
    assert torch.equal(scenarios.reference(*rs.as_pair(zero)).view(torch.int16), zero.view(torch.int16))


# A table of the shape N > 2 ranks use: one-shot up to 256 KiB, two-shot up to 8 MiB, then none.
def _n_rank_table(nbytes):
    return "push-oneshot" if nbytes <= 256 << 10 else "push-twoshot" if nbytes <= 8 << 20 else None


# The two-rank shape: flash-push up to 8 MiB, stream up to 2 GiB.
def _two_rank_table(nbytes):
    return "flash-push" if nbytes <= 8 << 20 else "stream" if nbytes <= 2 << 30 else None


@pytest.mark.cpu
def test_kernel_spans_find_the_table():
    assert rs.kernel_spans(_n_rank_table) == [("push-oneshot", 1, 256 << 10), ("push-twoshot", (256 << 10) + 1, 8 << 20)]
    assert rs.kernel_spans(_two_rank_table) == [("flash-push", 1, 8 << 20), ("stream", (8 << 20) + 1, 2 << 30)]
    assert rs.kernel_spans(lambda nbytes: "odd" if 1000 < nbytes <= 5000 else None) == [("odd", 1001, 5000)]


@pytest.mark.cpu
@pytest.mark.parametrize("table", (_n_rank_table, _two_rank_table))
@pytest.mark.parametrize("dname", DTYPES)
def test_sweep_counts_cover_every_kernel_boundary_and_tail(table, dname):
    esize = torch.empty(0, dtype=scenarios.DTYPES[dname]).element_size()
    spans = rs.kernel_spans(table)
    counts = rs.sweep_counts(spans, esize)
    nbytes = [c * esize for c in counts]
    assert {table(b) for b in nbytes} == {k for k, _, _ in spans}
    assert {1, 7, rs.LARGE_ODD_COUNT} <= set(counts)
    assert any(b % 16 for b in nbytes if table(b) == spans[-1][0])  # a tail in the last span
    boundary = spans[0][2]
    assert boundary // esize in counts and boundary // esize + 1 in counts
    largest = min(spans[-1][2], rs.SWEEP_CAP_BYTES) // esize
    assert max(counts) == largest
    assert len(counts) <= 14  # one shared GPU takes N = 8 processes' turns per call


@pytest.mark.cpu
def test_fused_plan_covers_dtypes_shapes_and_residuals():
    plan = fused_ranks_plan()
    assert len(plan) == len(FUSED_DTYPES) * len(FUSED_HIDDEN) * len(FUSED_TOKENS) * 2
    assert {(p["dtype"], p["hidden"], p["tokens"], p["residual"]) for p in plan} == {
        (d, h, t, r) for d in FUSED_DTYPES for h in FUSED_HIDDEN for t in FUSED_TOKENS for r in (True, False)}
    assert {p["eps"] for p in plan} == set(EPS)
    assert any(p["inplace"] for p in plan) and not any(p["inplace"] and not p["residual"] for p in plan)


@pytest.mark.cpu
def test_ranks_need_their_gpus_unless_shared(monkeypatch):
    from yali_vllm.communicator import SHARED_GPU_VAR

    monkeypatch.setenv(SHARED_GPU_VAR, "1")
    assert missing_gpus(8) is None
    monkeypatch.setenv(SHARED_GPU_VAR, "0")
    visible = torch.cuda.device_count()
    reason = missing_gpus(visible + 1)
    assert reason and f"{visible + 1} ranks need {visible + 1} GPUs, {visible} visible" in reason
    assert SHARED_GPU_VAR in reason
