"""The expert-parallel dispatch and combine (csrc/core/yali/ep/ep.cuh) at N = 2, 4, 6 and 8 ranks: one
process per rank, each on its own GPU, or all on GPU 0 with YALI_ALLOW_SHARED_GPU=1 (correctness
only). Skipped without a GPU or the extension (conftest.py), and for N ranks on fewer than N GPUs
unless they share GPU 0 (pair.run_ranks).

Per N, one process group runs the dispatch sweep (every part set of vLLM's MoE layers x equal,
uneven and empty token counts), the combine sweep (3 dtypes x 3 hidden sizes x the same counts),
the slot limits and a CUDA graph of 3 MoE layers' dispatch + combine replayed with fresh inputs
(ep_scenarios.ep_suite); the mismatched call runs in its own group, since its kernels trap.

The tests marked cpu check the references on CPU torch."""
import pytest
import torch

from . import ep_scenarios as es
from . import reliability
from .pair import (MISMATCH_BOUND_S, MISMATCH_MARGIN_S, MISMATCH_TIMEOUT_S, SUITE_BOUND_S, SUITE_TIMEOUT_S,
                   run_ranks)
from .scenarios import checked_parts, suite_part

WORLD_SIZES = (2, 4, 6, 8)
GRAPH_REPLAYS = 40
SEED = 7070


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def suite(request):
    n = request.param
    return n, run_ranks(es.ep_suite, GRAPH_REPLAYS, SEED, world_size=n, timeout=SUITE_BOUND_S[n],
                        env={"YALI_TIMEOUT_S": SUITE_TIMEOUT_S})


@pytest.mark.gpu
@pytest.mark.timeout(max(SUITE_BOUND_S.values()) + 30)
def test_dispatch_returns_every_ranks_tensors_bit_for_bit(suite):
    n, res = suite
    parts = checked_parts(res, "dispatch")
    cases = len(es.PART_SETS) * len(es.count_cases(n))
    for rank, r in enumerate(parts):
        assert r["served"] == cases, (rank, r["served"], cases)
        assert not r["differing"], f"rank {rank}: outputs differ between ranks in {r['differing'][:10]}"


@pytest.mark.gpu
@pytest.mark.timeout(max(SUITE_BOUND_S.values()) + 30)
def test_combine_is_the_rank_order_fp32_sum(suite):
    n, res = suite
    parts = checked_parts(res, "combine")
    cases = len(es.COMBINE_DTYPES) * len(es.COMBINE_HIDDEN) * len(es.count_cases(n))
    for rank, r in enumerate(parts):
        assert r["served"] == cases, (rank, r["served"], cases)


@pytest.mark.gpu
@pytest.mark.timeout(max(SUITE_BOUND_S.values()) + 30)
def test_slot_limit_is_the_same_on_every_rank_and_named_when_hit(suite):
    n, res = suite
    parts = suite_part(res, "limits")
    for rank, r in enumerate(parts):
        assert r["cap"] == es.SLOT_BYTES // 4160
        assert r["at_cap"] and not r["above"], (rank, r)
        assert "YALI_EP_SLOT_BYTES" in r["refusal"], (rank, r)
        assert r["combine_at_cap"] and not r["combine_above"] and not r["combine_odd_row"], (rank, r)
        assert not any(r["byte_dtypes"].values()), r["byte_dtypes"]  # their 0x80008000 words have other meanings
        assert "needs [2, ...]" in r["wrong_rows"], (rank, r)


@pytest.mark.gpu
@pytest.mark.timeout(max(SUITE_BOUND_S.values()) + 30)
def test_cuda_graph_of_moe_layers_replays_with_fresh_inputs(suite):
    n, res = suite
    parts = checked_parts(res, "graph")
    for r in parts:
        assert r["replays"] == GRAPH_REPLAYS


@pytest.mark.gpu
@pytest.mark.timeout(max(SUITE_BOUND_S.values()) + 30)
def test_moe_layer_matches_vllms_manager_bitwise_and_one_process_within_rounding(suite):
    n, res = suite
    checked_parts(res, "moe")


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", (2, 4), ids=lambda n: f"{n}-ranks")
@pytest.mark.timeout(max(MISMATCH_BOUND_S.values()) + 30)
def test_a_skipped_call_ends_in_yali_error_after_the_watchdog(world_size):
    res = run_ranks(es.skipped_call, MISMATCH_TIMEOUT_S + MISMATCH_MARGIN_S, world_size=world_size,
                    timeout=MISMATCH_BOUND_S[world_size], env={"YALI_TIMEOUT_S": str(MISMATCH_TIMEOUT_S)})
    r = res[0]
    assert all(other["skipped"] for other in res[1:]) and not r["skipped"]
    assert "gave up after YALI_TIMEOUT_S" in r["abort"] and "ep-reduce-scatter" in r["abort"], r
    assert MISMATCH_TIMEOUT_S <= r["recorded_s"] < MISMATCH_TIMEOUT_S + MISMATCH_MARGIN_S, r
    assert r["error"] is None or r["error"].startswith("YaliError"), r


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
@pytest.mark.timeout(max(MISMATCH_BOUND_S.values()) + 30)
def test_mismatched_counts_end_in_yali_error_on_every_rank(world_size):
    res = run_ranks(es.mismatched_counts, MISMATCH_TIMEOUT_S + MISMATCH_MARGIN_S, world_size=world_size,
                    timeout=MISMATCH_BOUND_S[world_size], env={"YALI_TIMEOUT_S": str(MISMATCH_TIMEOUT_S)})
    for rank, r in enumerate(res):
        assert r["good_call_ok"], (rank, r)
        assert "different calls" in r["abort"] and "EP combine" in r["abort"], f"rank {rank}: {r}"
        assert r["recorded_s"] < MISMATCH_TIMEOUT_S + MISMATCH_MARGIN_S, (rank, r)
    reliability.assert_every_rank_raised(res, world_size)


# ------------------------------------------------------------------------ on CPU torch
CPU = torch.device("cpu")


@pytest.mark.cpu
def test_gathered_reference_is_the_ranks_inputs_in_order_with_the_sentinel_replaced():
    parts = es.PART_SETS["odd-rows"]
    counts = [2, 0, 3]
    ref = es.gathered_reference(11, counts, parts, CPU)
    for i, (dtype, shape) in enumerate(parts):
        ins = [es.part_input(11, r, i, n, dtype, shape, CPU) for r, n in enumerate(counts)]
        words = torch.cat([t.contiguous().view(torch.int32).reshape(-1) for t in ins])
        planted = words == es.SENTINEL
        assert planted.any()  # every input carries sentinel words
        assert torch.equal(ref[i][~planted], words[~planted])
        assert bool((ref[i][planted] == es.SENT_AS).all())
        assert ref[i].numel() * 4 == sum(counts) * torch.Size(shape).numel() * ins[0].element_size()


@pytest.mark.cpu
def test_combine_reference_adds_in_rank_order_then_rounds_once():
    counts = [1, 2]
    ref = es.combine_reference(5, counts, 1, 16, torch.bfloat16, CPU)
    x0 = es.combine_input(5, 0, 3, 16, torch.bfloat16, CPU)[1:3].float()
    x1 = es.combine_input(5, 1, 3, 16, torch.bfloat16, CPU)[1:3].float()
    assert torch.equal(ref, (x0 + x1).to(torch.bfloat16))
    assert ref.shape == (2, 16)
