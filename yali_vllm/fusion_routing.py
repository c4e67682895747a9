"""Where each all-reduce + RMSNorm pair of a quantised model goes: YALI's fused op, vLLM's
FlashInfer all-reduce + RMSNorm + quant kernel, or vLLM's own passes.

vLLM 0.33's fusion passes treat an all-reduce + RMSNorm pair by what follows the norm:
- ``AllReduceFusionPass`` (FlashInfer, up to its size limit) fuses all-reduce + RMSNorm, and for
  a static per-tensor FP8 (or, from Blackwell on, NVFP4) quantisation of the norm output the
  quantisation too: one kernel.
- Above FlashInfer's limit, ``RMSNormQuantFusionPass`` fuses RMSNorm + quantisation (static,
  dynamic per-token, per-token-group) into one kernel after the plain all-reduce.
With YALI_FUSE_QUANT=1, YALI's pass first rewrites the pairs whose norm output is quantised by a
scheme YALI's quantising op serves (static, per-token, group-128 FP8) into that op (YALI_QUANT,
yali_vllm/vllm_fusion.py); route decides for the pairs left, and for every pair with the setting
off. There a pair whose norm output is quantised goes to YALI's plain fused op only where vLLM's defaults also fuse just the all-reduce and the norm and leave the
quantisation apart: dynamic and per-group schemes within FlashInfer's ranges. Everywhere else it
stays exactly as vLLM's defaults run it (:func:`route`). Pairs whose norm output is not quantised
(every pair of a bf16 model, the final norm of a quantised one) go to YALI's op.

What follows a norm is read off the graph (:func:`norm_output_quant`): vLLM's quantisation is
either its custom op (``_C.static_scaled_fp8_quant``, ``dynamic_per_token_scaled_fp8_quant``,
``per_token_group_fp8_quant``, ``scaled_fp4_quant``, under ``auto_functionalized``) or, with
vLLM's custom ops off (the default under Inductor), QuantFP8's native torch code: an FP8 cast a
few elementwise steps after the norm, with an amax / max reduction when the scale is dynamic.
"""
from __future__ import annotations

import operator
from collections import deque

import torch
from torch import fx

# Schemes (norm_output_quant's answers).
STATIC_FP8 = "static FP8"
DYNAMIC_FP8 = "dynamic FP8"  # per tensor, per token or per group of columns: the scale comes from the data
NVFP4 = "NVFP4"
# The schemes FlashInfer's all-reduce fusion quantises inside its kernel (vLLM 0.33's
# AllReduceFusedRMSNormStaticQuantFP8Pattern, ...NVFP4Pattern and their fused-add forms).
FLASHINFER_QUANTISES = (STATIC_FP8, NVFP4)

# Routes (route's answers).
YALI = "yali"              # YALI's fused all-reduce + RMSNorm op (then vLLM's quantisation, if any)
YALI_QUANT = "yali-quant"  # YALI's fused all-reduce + RMSNorm + FP8 quant op (YALI_FUSE_QUANT=1)
FLASHINFER = "flashinfer"  # left to vLLM's FlashInfer pass: all-reduce + RMSNorm + quant in one kernel
VLLM = "vllm"              # left unfused: YALI's all-reduce, then vLLM's RMSNorm + quant fusion
ROUTE_TEXT = {
    YALI: "YALI's fused all-reduce + RMSNorm op",
    YALI_QUANT: "YALI's fused all-reduce + RMSNorm + FP8 quant op",
    FLASHINFER: "vLLM's FlashInfer all-reduce + RMSNorm + quant kernel",
    VLLM: "YALI's all-reduce, then vLLM's RMSNorm + quant",
}

# The norm ops of vLLM's patterns, and which output of each is the normalised row.
_NORM_OUTPUT_INDEX = {"vllm_ir::rms_norm": None, "vllm_ir::fused_add_rms_norm": 0}
# Custom quantisation ops by name (the _C namespace of vLLM's CUDA build).
_QUANT_OPS = {
    "static_scaled_fp8_quant": STATIC_FP8,
    "dynamic_scaled_fp8_quant": DYNAMIC_FP8,
    "dynamic_per_token_scaled_fp8_quant": DYNAMIC_FP8,
    "per_token_group_fp8_quant": DYNAMIC_FP8,
    "scaled_fp4_quant": NVFP4,
}
# Reductions QuantFP8's native code takes the dynamic scale with.
_REDUCTIONS = {"aten::amax", "aten::max"}
# Ops past which the search does not go: what they produce is no longer the norm's row.
_BOUNDARIES = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_scaled_mm"}
# How many ops after the norm output the quantisation may sit (QuantFP8's native per-group code
# casts to FP8 six ops after its input).
MAX_DEPTH = 10


def route(quant: str | None, flashinfer_range: bool) -> str:
    """Where a pair goes, given the quantisation of its norm output (None: not quantised) and
    whether vLLM's FlashInfer pass serves the compile range (built, workspace open, range within
    its limit)."""
    if quant is None:
        return YALI
    if flashinfer_range:
        return FLASHINFER if quant in FLASHINFER_QUANTISES else YALI
    return VLLM


def _op_name(target) -> str | None:
    """'namespace::name' of an OpOverload / OpOverloadPacket target, else None."""
    name = getattr(target, "_schema", None)
    if name is not None:
        return name.name
    qualified = getattr(target, "_qualified_op_name", None)
    return qualified if isinstance(qualified, str) else None


def _is_fp8(node: fx.Node) -> bool:
    vals = node.meta.get("val")
    for v in vals if isinstance(vals, (tuple, list)) else (vals,):
        if isinstance(v, torch.Tensor) and v.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz,
                                                       torch.float8_e5m2):
            return True
    return False


def _custom_quant(node: fx.Node) -> str | None:
    """The scheme of a vLLM quantisation custom op at `node` (called directly or through
    auto_functionalized), else None."""
    target = node.target
    if target is torch.ops.higher_order.auto_functionalized and node.args:
        target = node.args[0]
    name = _op_name(target)
    return _QUANT_OPS.get(name.split("::")[-1]) if name else None


def norm_node(match) -> fx.Node | None:
    """The RMSNorm node of a pattern match of an all-reduce + (fused-add) RMSNorm pair."""
    for node in match.nodes:
        if _op_name(node.target) in _NORM_OUTPUT_INDEX:
            return node
    return None


def norm_outputs(norm: fx.Node) -> list[fx.Node]:
    """The nodes holding the normalised rows of `norm` (the node itself, or its getitem 0)."""
    index = _NORM_OUTPUT_INDEX.get(_op_name(norm.target))
    if index is None:
        return [norm]
    return [u for u in norm.users if u.target is operator.getitem and u.args[1] == index]


def norm_output_quant(norm: fx.Node) -> str | None:
    """The quantisation applied to the output of RMSNorm node `norm` in its graph (STATIC_FP8,
    DYNAMIC_FP8, NVFP4), or None when nothing quantises it: a breadth-first walk over the ops
    that consume the normalised rows, up to MAX_DEPTH ops deep, not past a matrix product or
    another collective / attention op of vLLM's."""
    seen: set[fx.Node] = set()
    todo = deque((n, 0) for n in norm_outputs(norm))
    reduced = fp8 = False
    while todo:
        node, depth = todo.popleft()
        if node in seen:
            continue
        seen.add(node)
        custom = _custom_quant(node)
        if custom is not None:
            return custom
        name = _op_name(node.target) or ""
        reduced |= name in _REDUCTIONS
        fp8 |= depth > 0 and _is_fp8(node)
        if depth >= MAX_DEPTH or name in _BOUNDARIES or name.startswith("vllm::"):
            continue
        todo.extend((u, depth + 1) for u in node.users)
    if not fp8:
        return None
    return DYNAMIC_FP8 if reduced else STATIC_FP8


def summary(counts: dict[str, int]) -> str:
    """'63 to YALI's fused ..., 64 to vLLM's FlashInfer ...' for the routes with pairs."""
    parts = [f"{counts[r]} to {ROUTE_TEXT[r]}" for r in (YALI, YALI_QUANT, FLASHINFER, VLLM) if counts.get(r)]
    return ", ".join(parts) if parts else "no all-reduce + RMSNorm pair"
