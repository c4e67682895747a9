"""The quantising fused op (all-reduce + residual add + RMSNorm + FP8 e4m3: static, per-token and
per-token-group scales) at N = 2, 4, 6 and 8 ranks: one process per rank, each on its own GPU, or
all on GPU 0 with YALI_ALLOW_SHARED_GPU=1 (pair.run_ranks). Per N, one process group runs the sweep
(every scheme at every token count, each of the launch bands: one launch, a row spread over a
cluster, whole rows, two launches), the CUDA graph and the argument refusals
(quant_scenarios.quant_suite); the mismatched schemes run in their own group, since their kernels
trap. The checks are in quant_scenarios' docstring. The tests marked cpu check the reference
quantisation and the plan on CPU torch."""
import pytest
import torch

from . import quant_scenarios as qs
from . import reliability
from .pair import MISMATCH_BOUND_S, MISMATCH_MARGIN_S, MISMATCH_TIMEOUT_S, SUITE_BOUND_S, SUITE_TIMEOUT_S, run_ranks
from .scenarios import checked_parts

WORLD_SIZES = (2, 4, 6, 8)
HIDDEN = (2048, 5120, 8192, 16384)
# Odd row counts and every launch band: clusters of rows (1-7), spread rows (N ranks, up to 16),
# whole rows, the two-rank bands up to 8 MiB, and two launches (above 512 KiB at N ranks, 8 MiB at two).
TOKENS = (1, 7, 16, 33, 127, 513, 2048)
GRAPH_REPLAYS = 20
SEED = 7373


def run_suite(n: int):
    return run_ranks(qs.quant_suite, HIDDEN, TOKENS, GRAPH_REPLAYS, SEED, world_size=n, timeout=SUITE_BOUND_S[n],
                     env={"YALI_TIMEOUT_S": SUITE_TIMEOUT_S})


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def suite(request):
    return request.param, run_suite(request.param)


def assert_ranks_agree(parts):
    for rank, r in enumerate(parts):
        assert not r["differing"], f"rank {rank}: outputs differ between ranks in {r['differing'][:10]}"


@pytest.mark.gpu
@pytest.mark.timeout(max(SUITE_BOUND_S.values()) + 30)
def test_quant_sweep_matches_vllm_quantisation_of_yalis_norm(suite):
    n, res = suite
    parts = checked_parts(res, "sweep")
    for r in parts:
        assert r["calls"] > 0 and r["device_fused_calls"] == 2 * r["calls"], r["device_fused_calls"]
    assert_ranks_agree(parts)
    launches = parts[0]["launches"]
    for case in qs.CASES:  # every scheme ran in one launch and in two
        mine = [l for l in launches if l["case"] == case[0]]
        assert {l["one_launch"] for l in mine} == {0, 1}, (case[0], mine)
        if n > 2:  # and a row spread over a cluster, and whole rows in one launch
            assert any(l["one_launch"] and l["spread"] > 1 for l in mine), (case[0], mine)
            assert any(l["one_launch"] and l["spread"] == 1 for l in mine), (case[0], mine)
    if n == 2:  # the two-rank bands (bytes per CTA): 4 KiB, 1 KiB
        assert {l["cta_bytes"] for l in launches if l["one_launch"]} >= {4096, 1024}


@pytest.mark.gpu
@pytest.mark.timeout(max(SUITE_BOUND_S.values()) + 30)
def test_quant_cuda_graph_replays_with_fresh_inputs(suite):
    _, res = suite
    parts = checked_parts(res, "graph")
    for r in parts:
        assert r["device_fused_calls"] == r["expected_fused_calls"], r
    assert_ranks_agree(parts)


@pytest.mark.gpu
@pytest.mark.timeout(max(SUITE_BOUND_S.values()) + 30)
def test_quant_refusals_name_the_argument_before_any_launch(suite):
    _, res = suite
    for rank, r in enumerate(checked_parts(res, "refusals")):
        assert all(v == "ok" for v in r["seen"].values()), (rank, r["seen"])
        assert r["launched"] == 0, (rank, r)


@pytest.mark.gpu
@pytest.mark.timeout(max(MISMATCH_BOUND_S.values()) + 30)
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_mismatched_schemes_end_in_yali_error(world_size):
    res = run_ranks(qs.mismatched_scheme, SEED, MISMATCH_TIMEOUT_S + MISMATCH_MARGIN_S, world_size=world_size,
                    timeout=MISMATCH_BOUND_S[world_size], env={"YALI_TIMEOUT_S": str(MISMATCH_TIMEOUT_S)})
    for rank, r in enumerate(res):
        assert not r["good_call_problems"], (rank, r)
        assert "different calls" in r["abort"], f"rank {rank}: {r}"
        assert "FP8 per-token quant" in r["abort"] and "FP8 static quant" in r["abort"], f"rank {rank}: {r}"
        assert r["recorded_s"] < MISMATCH_TIMEOUT_S + MISMATCH_MARGIN_S, (rank, r)
    reliability.assert_every_rank_raised(res, world_size)


# ------------------------------------------------------------------------ on CPU torch
@pytest.mark.cpu
def test_reference_quantisation_follows_vllms_arithmetic():
    y = torch.tensor([[448.0, -1000.0, 1.0, 0.0], [0.001, -0.0015, 0.0, 0.0]])
    q, s = qs.vllm_quant(y, qs.SCHEME_PER_TOKEN)
    assert s[0, 0] == torch.tensor(1000.0) / torch.tensor(448.0)
    assert s[1, 0] == torch.tensor(qs.PER_TOKEN_MIN_SCALE, dtype=torch.float32)  # the floor
    assert q[0, 1].float() == -448.0  # the row's absmax lands on the largest code
    q, s = qs.vllm_quant(y, qs.SCHEME_STATIC, torch.tensor([0.5]))
    assert q[0, 0].float() == 448.0 and q[0, 2].float() == 2.0  # clamped; 1 * (1 / 0.5)
    q, s = qs.vllm_quant(torch.zeros(1, 128), qs.SCHEME_GROUP, group_size=128)
    assert s[0, 0] == torch.tensor(1e-10, dtype=torch.float32) / torch.tensor(448.0)  # eps floor
    u = qs.ue8m0(torch.tensor([0.25, 0.3, 1e-12]))
    assert u.tolist() == [0.25, 0.5, 2.0 ** -33]  # powers of two stay, others round up; 1e-10 floor


@pytest.mark.cpu
def test_e4m3_steps_count_codes_across_zero():
    a = torch.tensor([0.0, 1.0, -0.001953125, 448.0]).to(torch.float8_e4m3fn)
    b = torch.tensor([-0.0, 1.125, 0.001953125, 416.0]).to(torch.float8_e4m3fn)
    assert qs.e4m3_steps(a, b).tolist() == [0, 1, 2, 1]


def launch_band(world: int, tokens: int, hidden: int) -> str:
    """The band of a bf16 call at the default settings (plan.cpp: fused_launch_for)."""
    nbytes = tokens * hidden * 2
    if world == 2:
        return "one" if nbytes <= 8 << 20 else "two"
    if nbytes > 512 << 10:
        return "two"
    return "spread" if tokens * 4 <= 64 else "whole"


@pytest.mark.cpu
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_plan_meets_every_band_with_every_case(world):
    serve = 2 << 30 if world == 2 else (16 << 20 if world == 4 else 8 << 20)
    plan = qs.quant_plan(world, HIDDEN, TOKENS, serve)
    need = {"one", "two"} if world == 2 else {"spread", "whole", "two"}
    for case in qs.CASES:
        bands = {launch_band(world, p["tokens"], p["hidden"]) for p in plan if p["case"] == case[0]}
        assert need <= bands, (world, case[0], bands)


@pytest.mark.cpu
def test_plan_covers_every_case_and_residual_form():
    plan = qs.quant_plan(2, HIDDEN, TOKENS, 1 << 40)
    for case in qs.CASES:
        mine = [p for p in plan if p["case"] == case[0]]
        assert {p["tokens"] for p in mine} == set(TOKENS), case
    assert {(p["residual"], p["inplace"], p["res_out"]) for p in plan} >= {
        (True, True, "tensor"), (True, False, "tensor"), (False, False, "tensor"), (False, False, "none")}
    assert {p["dtype"] for p in plan} == {"bf16", "fp16"}
    assert all(p["tokens"] * p["hidden"] * 2 <= 8 << 20 for p in qs.quant_plan(8, HIDDEN, TOKENS, 8 << 20))
