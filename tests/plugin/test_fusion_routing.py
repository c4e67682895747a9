"""CPU tests of yali_vllm/fusion_routing.py: which quantisation follows an RMSNorm in a traced
graph, and where each all-reduce + RMSNorm pair goes.

The quantisations are vLLM's own: QuantFP8's native torch code (what vLLM's compiled graphs hold
with its custom ops off, the default under Inductor) for static per-tensor, dynamic per-tensor,
dynamic per-token and per-group-of-128 scales. vLLM's CUDA quant ops (``torch.ops._C``) do not
exist on a CPU build, so their form, the op under ``auto_functionalized``, is built by hand with
stand-in ops of the same names in a test namespace (the routing reads the op's name).
The whole pass with these graphs, over a real TP group: tests/plugin/test_vllm_fusion.py.
"""
from __future__ import annotations

import operator

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm.ir.ops  # noqa: E402
from torch import fx  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from yali_vllm import fusion_routing as fr  # noqa: E402

EPS = 1e-5
TOKENS, HIDDEN = 4, 256


def quantisers() -> dict:
    """vLLM's QuantFP8 of each scheme (built under a vLLM config, as vLLM builds its layers)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        return {
            "static": QuantFP8(True, GroupShape.PER_TENSOR, compile_native=False),
            "per-tensor": QuantFP8(False, GroupShape.PER_TENSOR, compile_native=False),
            "per-token": QuantFP8(False, GroupShape.PER_TOKEN, compile_native=False),
            "group-128": QuantFP8(False, GroupShape(1, 128), compile_native=False),
        }


QUANT = quantisers()
SCHEME = {"static": fr.STATIC_FP8, "per-tensor": fr.DYNAMIC_FP8, "per-token": fr.DYNAMIC_FP8,
          "group-128": fr.DYNAMIC_FP8}


def _quantise(kind: str, h: torch.Tensor, scale: torch.Tensor):
    q = QUANT[kind]
    return q.forward_native(h, scale) if kind == "static" else q.forward_native(h)


def _trace(fn, *args) -> fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*args)


def _norms(gm: fx.GraphModule) -> list[fx.Node]:
    names = ("vllm_ir::rms_norm", "vllm_ir::fused_add_rms_norm")
    return [n for n in gm.graph.nodes if n.op == "call_function" and fr._op_name(n.target) in names]


def _inputs():
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(TOKENS, HIDDEN, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(HIDDEN, generator=g).bfloat16()
    proj = torch.randn(HIDDEN, HIDDEN, generator=g).bfloat16()
    return x, res, w, proj, torch.tensor([0.05])


@pytest.mark.parametrize("kind", sorted(QUANT))
@pytest.mark.parametrize("fused_add", [False, True], ids=["rms_norm", "fused_add_rms_norm"])
def test_quantisation_after_the_norm_is_named(kind, fused_add):
    def model(x, res, w, proj, scale):
        h = vllm.ir.ops.fused_add_rms_norm(x, res, w, EPS)[0] if fused_add else vllm.ir.ops.rms_norm(x, w, EPS)
        q, s = _quantise(kind, h, scale)
        return q, s

    (norm,) = _norms(_trace(model, *_inputs()))
    assert fr.norm_output_quant(norm) == SCHEME[kind]


@pytest.mark.parametrize("after", ["matmul", "add-then-matmul", "nothing"])
def test_unquantised_norm_output_is_none(after):
    """A bf16 model's norm output feeds a GEMM (maybe after elementwise ops): no quantisation."""
    def model(x, res, w, proj, scale):
        h = vllm.ir.ops.rms_norm(x, w, EPS)
        if after == "matmul":
            return h @ proj
        if after == "add-then-matmul":
            return (h + 1) @ proj
        return h

    (norm,) = _norms(_trace(model, *_inputs()))
    assert fr.norm_output_quant(norm) is None


def test_quantisation_past_a_matmul_is_not_the_norms():
    """An FP8 cast of a GEMM's output (another layer's input) does not make the norm quantised."""
    def model(x, res, w, proj, scale):
        h = vllm.ir.ops.rms_norm(x, w, EPS)
        return _quantise("static", h @ proj, scale)[0]

    (norm,) = _norms(_trace(model, *_inputs()))
    assert fr.norm_output_quant(norm) is None


def test_quantised_residual_is_not_the_norm_output():
    """fused_add_rms_norm returns (norm, residual): only the norm output's consumers count."""
    def model(x, res, w, proj, scale):
        h, r = vllm.ir.ops.fused_add_rms_norm(x, res, w, EPS)
        return h @ proj, _quantise("static", r, scale)[0]

    (norm,) = _norms(_trace(model, *_inputs()))
    assert [n.target for n in fr.norm_outputs(norm)] == [operator.getitem]
    assert fr.norm_output_quant(norm) is None


def test_quantisation_too_far_after_the_norm_is_not_seen():
    """Past MAX_DEPTH elementwise ops the cast is not the norm's quantisation."""
    def model(x, res, w, proj, scale):
        h = vllm.ir.ops.rms_norm(x, w, EPS)
        for _ in range(fr.MAX_DEPTH):
            h = h + 1
        return _quantise("static", h, scale)[0]

    (norm,) = _norms(_trace(model, *_inputs()))
    assert fr.norm_output_quant(norm) is None


# vLLM's CUDA quant ops, as its graphs hold them with custom ops on: auto_functionalized(op, ...).
# Stand-ins of the same names in a test namespace (the routing reads the name; the CPU build of
# vLLM has no torch.ops._C).
_LIB = torch.library.Library("yali_routing_test", "DEF")
for _name in ("static_scaled_fp8_quant", "dynamic_per_token_scaled_fp8_quant", "per_token_group_fp8_quant",
              "scaled_fp4_quant", "gelu_and_mul"):
    _LIB.define(f"{_name}(Tensor(a!) out, Tensor input) -> ()")


@pytest.mark.parametrize("op, scheme", [("static_scaled_fp8_quant", fr.STATIC_FP8),
                                        ("dynamic_per_token_scaled_fp8_quant", fr.DYNAMIC_FP8),
                                        ("per_token_group_fp8_quant", fr.DYNAMIC_FP8),
                                        ("scaled_fp4_quant", fr.NVFP4),
                                        ("gelu_and_mul", None)])
def test_custom_quant_ops_are_named_by_their_op(op, scheme):
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    norm = g.call_function(torch.ops.vllm_ir.rms_norm.default, (x, w, EPS))
    out = g.placeholder("out")
    q = g.call_function(torch.ops.higher_order.auto_functionalized,
                        (getattr(torch.ops.yali_routing_test, op).default,), {"out": out, "input": norm})
    g.output((q,))
    assert fr.norm_output_quant(norm) == scheme


@pytest.mark.parametrize("quant, flashinfer_range, want", [
    (None, True, fr.YALI), (None, False, fr.YALI),
    (fr.STATIC_FP8, True, fr.FLASHINFER), (fr.NVFP4, True, fr.FLASHINFER),
    (fr.DYNAMIC_FP8, True, fr.YALI),
    (fr.STATIC_FP8, False, fr.VLLM), (fr.DYNAMIC_FP8, False, fr.VLLM), (fr.NVFP4, False, fr.VLLM),
])
def test_route(quant, flashinfer_range, want):
    """Within FlashInfer's ranges vLLM fuses a static FP8 (NVFP4) quantisation into its all-reduce
    kernel and leaves a dynamic one apart; above them it fuses every scheme into its RMSNorm."""
    assert fr.route(quant, flashinfer_range) == want


def test_summary_names_each_route_with_pairs():
    assert fr.summary({}) == "no all-reduce + RMSNorm pair"
    assert fr.summary({fr.YALI: 3, fr.FLASHINFER: 0, fr.VLLM: 2}) == (
        "3 to YALI's fused all-reduce + RMSNorm op, 2 to YALI's all-reduce, then vLLM's RMSNorm + quant")


def test_summary_counts_yalis_quantising_op():
    """With YALI_FUSE_QUANT=1 the line per compile range counts the pairs rewritten into YALI's
    quantising op, after YALI's plain op."""
    assert fr.summary({fr.YALI: 1, fr.YALI_QUANT: 5, fr.FLASHINFER: 0}) == (
        "1 to YALI's fused all-reduce + RMSNorm op, 5 to YALI's fused all-reduce + RMSNorm + FP8 quant op")
