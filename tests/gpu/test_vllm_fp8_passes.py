"""Where an FP8 model's all-reduce + RMSNorm pairs go under vLLM's real compilation passes, with the
plugin in a real TP group (tests/gpu/fp8_pass_scenarios.py builds and runs each case).

For each FP8 scheme of the embedded models (static per-tensor and dynamic per-token in
compressed-tensors form, block FP8 with per-group-of-128 activation scales) and each world size,
the same decoder stretch is compiled through Inductor with vLLM's pass manager, once as vLLM's
defaults build it (YALI_FUSION=0: vLLM's FlashInfer pass) and once with YALI's pass, in each
compile range; the kernels each graph holds after the passes are compared:
  * vLLM's defaults, within FlashInfer's range: each of the three pairs is one FlashInfer fused
    all-reduce + RMSNorm (+ static FP8) node; the premise of the comparisons below.
  * YALI's pass, within FlashInfer's range: a static FP8 pair stays with FlashInfer's fused
    all-reduce + RMSNorm + FP8 node and only the final, unquantised pair becomes YALI's op; for the
    dynamic and block schemes (vLLM fuses only the all-reduce and the norm there) every pair becomes
    YALI's op, and vLLM's quantisation stays after it. Nothing else in the graph differs.
  * Above FlashInfer's range (four ranks): a quantised pair keeps YALI's plain all-reduce and
    vLLM's RMSNorm + quant fusion, exactly as vLLM's defaults; the final pair becomes YALI's op.
  * YALI_FUSE_QUANT=1: every quantised pair becomes YALI's all-reduce + RMSNorm + FP8 quant op
    (vLLM's quant node gone), the final pair YALI's op.
Each compiled graph also runs: its outputs lie within 2 % (relative L2) of the eager stretch
(YALI's all-reduce, vLLM's norm and quant kernels apart), every rank's bits equal, and YALI's
fused kernel ran once per YALI node.

One GPU per rank, or every rank on GPU 0 with YALI_ALLOW_SHARED_GPU=1 (FlashInfer's workspace is
CUDA IPC memory, which processes on one GPU open too). Needs vLLM's CUDA build and FlashInfer.
"""
from __future__ import annotations

import importlib.util
import json
from collections import Counter

import pytest

from . import fp8_pass_scenarios as fs
from .pair import run_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

BOUND_S = {2: 240, 4: 300}  # a group's processes, start-up and every compile included: a hang fails
MAX_REL_ERR = 0.02
STATIC, DYNAMIC = "static FP8", "dynamic FP8"
# The quantisation of each norm's output in the graph vLLM 0.33 traces, per scheme: the MLPs' FP8
# GEMMs quantise the first two, the final norm feeds the (unquantised) LM head. Block FP8 as vLLM
# picks its kernel on an H200: the GEMM op takes BF16 and quantises inside, so no node follows.
NORM_QUANT = {
    "fp8-static": [STATIC, STATIC, None],
    "fp8-dynamic": [DYNAMIC, DYNAMIC, None],
    "fp8-block": [None, None, None],
    "fp8-block-separate-quant": [DYNAMIC, DYNAMIC, None],
}
BLOCK_GEMM_QUANTISING_INSIDE = "vllm::dynamic_flashinfer_deepgemm_blockscale_gemm"
GROUPS = [(2, s) for s in fs.SCHEMES] + [(4, s) for s in fs.SCHEMES]


@pytest.fixture(scope="module", params=GROUPS, ids=lambda p: f"{p[0]}-ranks-{p[1]}")
def group(request, tmp_path_factory):
    """(world size, scheme, every rank's result of fp8_pass_scenarios.fp8_passes_rank)."""
    world, scheme = request.param
    got = run_ranks(fs.fp8_passes_rank, world, scheme, str(tmp_path_factory.mktemp(f"fp8-{world}-{scheme}")),
                    world_size=world, timeout=BOUND_S[world])
    for res in got:
        assert "error" not in res, res["error"] + "\n" + "\n".join(res.get("log", []))
        assert res["yali"], f"YALI does not serve the TP group: {res.get('log')}"
    return world, scheme, got


def _case(res: dict, name: str) -> dict:
    case = res["cases"][name]
    assert "error" not in case, f"{name}: {case['error']}"
    return case


def _diff(got: dict, ref: dict) -> tuple[Counter, Counter]:
    """(the ops `got` holds beyond `ref`, the ops `ref` holds beyond `got`)."""
    a, b = Counter(got["after"]), Counter(ref["after"])
    return a - b, b - a


def _quantised(scheme: str) -> int:
    return sum(q is not None for q in NORM_QUANT[scheme])


def test_every_case_runs_close_to_eager_with_ranks_bitwise_equal(group, record_property):
    world, scheme, got = group
    first = got[0]
    # What the result file keeps of the group: vLLM's settings, the ranges, and per case rank 0's
    # kernels after the passes, YALI's routes and calls, and the worst error over the ranks.
    record_property("config", json.dumps(first["config"]))
    record_property("ranges", json.dumps(first["ranges"]))
    for name, case in first["cases"].items():
        if "error" not in case:
            record_property(name, json.dumps({
                "after": dict(Counter(case["after"])), "routes": case["routes"], "norm_quant": case["norm_quant"],
                "quant_before": sorted(set(op for op in case["before"] if "quant" in op)),
                "yali_fused_calls": case["yali_fused_calls"],
                "flashinfer_max_tokens": case["flashinfer_max_tokens"],
                "max_rel_err": max(max(r["cases"][name].get("err_norm", 1.0), r["cases"][name].get("err_residual", 1.0))
                                   for r in got)}))
    for name in fs.CASES_BY_WORLD[world]:
        cases = [_case(res, name) for res in got]
        for rank, case in enumerate(cases):
            assert case["finite"], (name, rank)
            assert case["err_norm"] < MAX_REL_ERR and case["err_residual"] < MAX_REL_ERR, (name, rank, case)
        assert len({tuple(c["digest"]) for c in cases}) == 1, (name, [c["digest"] for c in cases])


def test_each_norm_output_is_quantised_as_the_scheme_says(group):
    world, scheme, got = group
    for res in got:
        case = _case(res, "vllm-flashinfer")
        assert case["norm_quant"] == NORM_QUANT[scheme], (case["norm_quant"], case["before"])
        if scheme == "fp8-block":
            assert BLOCK_GEMM_QUANTISING_INSIDE in case["before"], case["before"]


def test_vllms_defaults_fuse_every_pair_with_flashinfer_in_its_range(group):
    world, scheme, got = group
    for res in got:
        case = _case(res, "vllm-flashinfer")
        assert case["flashinfer_max_tokens"] == res["ranges"]["flashinfer"][1], (case, res["ranges"])
        ops = Counter(case["after"])
        assert ops[fs.FLASHINFER_OP] == 3 and ops[fs.ALL_REDUCE_OP] == 0, (case["after"], res["log"])
        assert ops[fs.YALI_OP] == ops[fs.YALI_QUANT_OP] == 0, case["after"]
        if scheme == "fp8-static":
            assert case["flashinfer_quant"], "FlashInfer's all-reduce + RMSNorm + FP8 workspace did not open"


def test_yali_takes_only_the_pairs_vllm_leaves_unquantised_in_flashinfers_range(group):
    """Item 0 of the routing: a pair whose quantisation vLLM fuses stays exactly as vLLM runs it."""
    world, scheme, got = group
    taken = 3 - _quantised(scheme) if scheme == "fp8-static" else 3  # FlashInfer keeps static FP8 pairs
    for res in got:
        yali, vllm = _case(res, "yali-flashinfer"), _case(res, "vllm-flashinfer")
        extra, missing = _diff(yali, vllm)
        assert extra == Counter({fs.YALI_OP: taken}), (extra, yali["after"])
        assert missing == Counter({fs.FLASHINFER_OP: taken}), (missing, vllm["after"])
        assert yali["yali_fused_calls"] >= taken, yali
        assert any("the model is quantised" in ln for ln in res["log"]), res["log"]


def test_above_flashinfers_range_quantised_pairs_keep_vllms_own_path(group):
    """Above FlashInfer's range vLLM's defaults leave every pair unfused; YALI's pass takes the
    unquantised ones and leaves the quantised ones exactly so (YALI's all-reduce, then vLLM's norm
    and quantisation, fused by vLLM's RMSNorm + quant pass or by Inductor)."""
    world, scheme, got = group
    if "vllm-above" not in fs.CASES_BY_WORLD[world]:
        pytest.skip(f"FlashInfer serves every batch at {world} ranks")
    taken = 3 - _quantised(scheme)
    for res in got:
        yali, vllm = _case(res, "yali-above"), _case(res, "vllm-above")
        assert Counter(vllm["after"])[fs.ALL_REDUCE_OP] == 3, vllm["after"]
        extra, missing = _diff(yali, vllm)
        assert extra == Counter({fs.YALI_OP: taken}), (extra, yali["after"])
        # YALI's op replaces the taken pairs' all-reduces and their norms (vLLM IR ops lowered to
        # vLLM's kernel, or to aten ops, which are not listed), nothing else.
        norms = missing - Counter({fs.ALL_REDUCE_OP: taken})
        assert missing[fs.ALL_REDUCE_OP] == taken, missing
        assert sum(norms.values()) <= taken and all("rms_norm" in op and "quant" not in op for op in norms), missing
        assert yali["yali_fused_calls"] >= taken, yali


def test_fuse_quant_setting_sends_every_quantised_pair_to_yalis_quant_op(group):
    world, scheme, got = group
    quantised = _quantised(scheme)
    for res in got:
        yq, vllm = _case(res, "yali-quant-flashinfer"), _case(res, "vllm-flashinfer")
        extra, missing = _diff(yq, vllm)
        assert extra == +Counter({fs.YALI_QUANT_OP: quantised, fs.YALI_OP: 3 - quantised}), (extra, yq["after"])
        quant_nodes = missing - Counter({fs.FLASHINFER_OP: 3})
        assert missing[fs.FLASHINFER_OP] == 3, missing
        # Static: FlashInfer's node quantised the pair. Dynamic: vLLM's quantisation after
        # FlashInfer's node is gone too; a node of its own where vLLM runs QuantFP8 as its custom op
        # (+quant_fp8, block FP8), else QuantFP8's torch code (aten ops, not listed).
        custom = "+quant_fp8" in res["config"]["custom_ops"]
        assert sum(quant_nodes.values()) == (quantised if custom and scheme != "fp8-static" else 0), missing
        assert all("quant" in op for op in quant_nodes), missing
        assert yq["yali_fused_calls"] >= 3, yq
