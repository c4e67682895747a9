"""YALI's fused all-reduce + RMSNorm inside vLLM's compiled graphs.

vLLM's ``AllReduceFusionPass`` (compilation/passes/fusion/allreduce_rms_fusion.py)
rewrites "``tensor_model_parallel_all_reduce`` followed by (fused-add-)RMSNorm"
into FlashInfer's fused kernel, so those all-reduces never reach the device
communicator and YALI.  When YALI serves the TP group, the plugin builds
:class:`YaliAllReduceFusionPass` instead (see ``plugin.fusion_patch.fusion_pass_factory``):
the same patterns, rewritten into one op of ours,

    torch.ops.vllm.yali_fused_allreduce_rmsnorm(input, residual, weight, eps, group_name)
        -> (norm_out, residual_out)

which runs YALI's fused kernel when ``YaliCommunicator.can_fuse`` accepts the
tensors and otherwise exactly vLLM's unfused sequence (the group's all-reduce,
then ``vllm.ir.ops.fused_add_rms_norm`` / ``rms_norm``).  The op is functional
(no mutation), so Inductor needs no auto-functionalisation for it.

A pair whose norm output is quantised (an FP8 model) goes where yali_vllm/fusion_routing.py
says: a static FP8 one to vLLM's FlashInfer all-reduce + RMSNorm + quant kernel within
FlashInfer's compile ranges (the pass then runs vLLM's FlashInfer pass, built beside it for a
quantised model), every quantised one above those ranges to vLLM's RMSNorm + quant fusion after
YALI's all-reduce. With YALI_FUSE_QUANT=1 the pass first rewrites each pair whose norm output is
quantised by static, per-token or group-128 FP8 into YALI's quantising op,

    torch.ops.vllm.yali_fused_allreduce_rmsnorm_quant(input, residual, weight, eps, scale, group_name,
        scheme, group_size, scale_ue8m0, scale_layout, custom_quant) -> (quant_out, residual_out, scale)

which runs the communicator's quantising kernel when ``can_fuse_quant`` accepts, else the unfused
sequence followed by the graph's own quantisation.
Not covered: the Gemma "(1 + weight)" variants (fp32 weight; left to YALI's all-reduce +
vLLM's norm, or to FlashInfer's pass where it runs).
Nothing here imports CUDA-only modules (vLLM's allreduce_rms_fusion module
needs vLLM's CUDA ops), so it loads, and the pass runs, on a CPU machine.
"""

# No "from __future__ import annotations": torch's schema inference reads the
# op function's annotations, which must be real types.

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._inductor.pattern_matcher as pm
from torch import fx
from torch._inductor.pattern_matcher import PatternMatcherPass
from vllm.compilation.passes.inductor_pass import enable_fake_mode
from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass, VllmPatternMatcherPass

from yali_vllm import fusion_routing
from yali_vllm.quant_schemes import SCHEME_GROUP, SCHEME_PER_TOKEN, SCHEME_STATIC
from yali_vllm.vllm_log import LOGGER, log_first_call, log_once

logger = logging.getLogger(LOGGER)

FUSION_VAR = "YALI_FUSION"
OP_NAME = "yali_fused_allreduce_rmsnorm"
# The epsilons vLLM's AllReduceFusionPass registers patterns for (the match is
# on the literal value, so a model with another eps stays unfused).
EPSILONS = (1e-5, 1e-6)


def fusion_enabled(environ=None) -> bool:
    """Value of YALI_FUSION (default on); ValueError naming it when invalid."""
    from yali_vllm.config import env_flag

    return env_flag(FUSION_VAR, True, environ)


def fusion_decision(environ=None) -> tuple[bool, str]:
    """Whether this process builds YALI's fusion pass, and why (not). Every rank reaches the same
    answer (the YALI decision is agreed over the group, the ranks compare their YALI_FUSION at
    set-up), which matters: one rank in YALI's fused kernel and another in FlashInfer's would wait
    for each other. ValueError naming YALI_FUSION when it is invalid."""
    group, why = _yali_group(environ)
    return group is not None, why


def _yali_group(environ=None):
    """(the TP group, why) when YALI's fusion pass may serve this process's TP group: YALI_FUSION
    is on, the group has a world size YALI serves (yali_vllm.config.WORLD_SIZES: 2, 4, 6 or 8
    ranks) and the plugin attached a YaliCommunicator to its device communicator; else (None, why
    not). ValueError naming YALI_FUSION for an invalid value."""
    from yali_vllm.config import world_size_refusal

    if not fusion_enabled(environ):
        return None, f"disabled by {FUSION_VAR}"
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
    except Exception as e:  # no TP group in this process (not a worker)
        return None, f"no tensor-parallel group in this process ({type(e).__name__})"
    name = getattr(group, "unique_name", "?")
    refusal = world_size_refusal(getattr(group, "world_size", None))
    if refusal is not None:
        return None, f"TP group '{name}': {refusal}"
    if getattr(getattr(group, "device_communicator", None), "yali_comm", None) is None:
        return None, f"YALI all-reduce is OFF for group '{name}'"
    return group, f"YALI serves TP group '{name}' ({group.world_size} ranks)"


# --------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------


def unfused(group, input: torch.Tensor, residual, weight: torch.Tensor, eps: float):
    """vLLM's own sequence: the group's all-reduce, then vLLM's (fused-add) RMSNorm kernel."""
    ar = group.all_reduce(input)
    if ar is input:  # a 1-rank group returns its input; op outputs must not alias inputs
        ar = ar.clone()
    return norm_after_all_reduce(ar, residual, weight, eps)


def norm_after_all_reduce(ar: torch.Tensor, residual, weight: torch.Tensor, eps: float):
    """(norm_out, residual_out) of RMSNorm(ar [+ residual]), `ar` a fresh tensor this call owns.

    Runs vLLM's CUDA kernels (torch.ops._C.rms_norm / fused_add_rms_norm, one launch) where they
    apply. Not vLLM IR's op: called eagerly, outside a compiled graph, it dispatches to its
    "native" implementation under torch.compile (vLLM's default IR priority when Inductor
    compiles), about ten elementwise launches over fp32 copies of the rows."""
    import vllm.ir.ops

    c_ops = getattr(torch.ops, "_C", None)
    cuda_kernel = (
        ar.is_cuda and ar.is_contiguous() and weight.dtype == ar.dtype and weight.is_contiguous()
        and (residual is None or (residual.dtype == ar.dtype and residual.shape == ar.shape))
    )
    if residual is None:
        if cuda_kernel and hasattr(c_ops, "rms_norm"):
            out = torch.empty_like(ar)
            c_ops.rms_norm(out, ar, weight, eps)
            return out, ar
        return vllm.ir.ops.rms_norm(ar, weight, eps), ar
    if cuda_kernel and hasattr(c_ops, "fused_add_rms_norm"):
        res = residual.contiguous().clone()
        c_ops.fused_add_rms_norm(ar, res, weight, eps)  # in place: ar <- norm, res <- ar + residual
        return ar, res
    out, res = vllm.ir.ops.fused_add_rms_norm(ar, residual, weight, eps)
    return out, res


def _log_first_call(group, yali: bool) -> None:
    """The fused op's first call per group and path (vllm_log.log_first_call)."""
    name = str(getattr(group, "unique_name", "?"))
    log_first_call("fused", (name, yali), "YALI fused all-reduce + RMSNorm op: first call on group '%s' runs %s", name,
                   "YALI's fused kernel" if yali else "the group's all-reduce, then vLLM's RMSNorm")


def run_on_group(group, input: torch.Tensor, residual, weight: torch.Tensor, eps: float):
    """YALI's fused kernel when the group's YaliCommunicator takes the tensors,
    else the unfused sequence.  Every rank decides alike (same shapes, dtypes
    and layouts), so all run the same collective."""
    yc = getattr(getattr(group, "device_communicator", None), "yali_comm", None)
    if yc is not None and yc.can_fuse(input, residual, weight):
        _log_first_call(group, True)
        return yc.fused_allreduce_rmsnorm(input, residual, weight, eps)
    _log_first_call(group, False)
    return unfused(group, input, residual, weight, eps)


def _group(group_name: str):
    # The lookup vLLM's own torch.ops.vllm.all_reduce does (parallel_state.all_reduce).
    from vllm.distributed.parallel_state import _groups

    ref = _groups.get(group_name)
    group = ref() if ref is not None else None
    if group is None:
        raise ValueError(f"yali: group {group_name!r} is not found or destroyed")
    return group


def yali_fused_allreduce_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm_out, residual_out): all-reduce of `input` over group `group_name`,
    plus `residual` when given, then RMSNorm(weight, eps); vLLM's
    fused_add_rms_norm / rms_norm semantics (residual_out is the all-reduce
    output when there is no residual)."""
    return run_on_group(_group(group_name), input, residual, weight, eps)


def _yali_fused_allreduce_rmsnorm_fake(
    input: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(input), torch.empty_like(input)


def _register_once(name: str, func, fake) -> None:
    """Registers torch.ops.vllm.<name> unless it is there (idempotent, also across re-imports of
    this module)."""
    if hasattr(torch.ops.vllm, name):
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(op_name=name, op_func=func, fake_impl=fake)


def register_op() -> None:
    """Registers torch.ops.vllm.yali_fused_allreduce_rmsnorm and its quantising sibling."""
    register_quant_op()
    _register_once(OP_NAME, yali_fused_allreduce_rmsnorm, _yali_fused_allreduce_rmsnorm_fake)


def fused_op():
    register_op()
    return getattr(torch.ops.vllm, OP_NAME).default


# --------------------------------------------------------------------------
# The quantising op (YALI_FUSE_QUANT)
# --------------------------------------------------------------------------
QUANT_OP_NAME = "yali_fused_allreduce_rmsnorm_quant"
GROUP_SIZE = 128  # the per-token-group size the pass rewrites (block-FP8 models: weight_block_size [128, 128])

# Layouts of a per-token-group scale [rows, hidden / group_size] (the op's `scale_layout`), each
# allocated as vLLM's per_token_group_quant_fp8 allocates it (quantization/utils/fp8_utils.py):
SCALE_ROW_MAJOR = 0  # strides (groups, 1)
SCALE_COLUMN_MAJOR = 1  # strides (1, rows): column_major_scales=True (QuantFP8's native code too)
SCALE_TMA_ALIGNED = 2  # strides (1, rows rounded up to a multiple of 4): and tma_aligned_scales=True
# What vLLM 0.33 requests for a block-FP8 linear on Hopper (Fp8LinearMethod's block kernel,
# model_executor/kernels/linear/scaled_mm/): with DeepGEMM installed, DeepGemmFp8BlockScaledMMKernel's
# QuantFP8(group 128, column_major_scales=True, tma_aligned_scales=VLLM_USE_DEEP_GEMM_TMA_ALIGNED_SCALES
# (default 1), use_ue8m0=VLLM_USE_DEEP_GEMM_E8M0 (default 1; on Hopper fp32 scales rounded up to
# powers of two, DeepGemmQuantScaleFMT.FLOAT32_CEIL_UE8M0)): SCALE_TMA_ALIGNED with ue8m0. Without
# DeepGEMM, CutlassFp8BlockScaledMMKernel's QuantFP8(column_major_scales=True, use_ue8m0=False):
# SCALE_COLUMN_MAJOR. A block-FP8 model turns vLLM's quant_fp8 custom op on (VllmConfig,
# has_blocked_weights), so its graphs hold _C.per_token_group_fp8_quant, not QuantFP8's native code.


@dataclass(frozen=True)
class QuantSpec:
    """The quantisation of a pair's norm output, as the graph had it: the scheme (quant_schemes),
    its group size and ue8m0 rounding and scale layout (per-token-group), and whether the graph held
    vLLM's quant custom op (`custom`) or QuantFP8's native code; the op's fallback runs the same."""

    scheme: int
    group_size: int = 0
    ue8m0: bool = False
    layout: int = SCALE_ROW_MAJOR
    custom: bool = False

    def name(self) -> str:
        """'static', 'per-token', 'group-128[column-major,ue8m0]' (+ ' (custom op)'), for the log."""
        base = {SCHEME_STATIC: "static", SCHEME_PER_TOKEN: "per-token"}.get(self.scheme)
        if base is None:
            tags = [("row-major", "column-major", "TMA-aligned")[self.layout]] + (["ue8m0"] if self.ue8m0 else [])
            base = f"group-{self.group_size}[{','.join(tags)}]"
        return base + (" (custom op)" if self.custom else "")


def tma_aligned_rows(rows):
    """`rows` rounded up to a multiple of 4, by vLLM's own get_tma_aligned_size (fp32 scales): the
    same expression as the graph's allocation, also for a symbolic row count."""
    from vllm.utils.deep_gemm import get_tma_aligned_size

    return get_tma_aligned_size(rows, 4)


def group_scale_strides(rows, groups, layout: int) -> tuple:
    """The strides of a [rows, groups] scale in `layout`."""
    if layout == SCALE_ROW_MAJOR:
        return (groups, 1)
    if layout == SCALE_COLUMN_MAJOR:
        return (1, rows)
    if layout == SCALE_TMA_ALIGNED:
        return (1, tma_aligned_rows(rows))
    raise ValueError(f"yali: scale_layout {layout} is not one of {SCALE_ROW_MAJOR}, {SCALE_COLUMN_MAJOR}, "
                     f"{SCALE_TMA_ALIGNED}")


def allocate_scale(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The fp32 scale output of quantising `x` [rows, hidden] by `spec` (a dynamic scheme), laid
    out as vLLM's quant op lays it out: [rows, 1] per token, [rows, hidden / group_size] in
    spec.layout per group."""
    rows, hidden = x.shape
    if spec.scheme == SCHEME_PER_TOKEN:
        return torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if spec.scheme != SCHEME_GROUP:
        raise ValueError(f"yali: scheme {spec.scheme} has no scale output (static: the scale is an input)")
    groups = hidden // spec.group_size
    shape = (rows, groups)
    if spec.layout == SCALE_ROW_MAJOR:
        return torch.empty(shape, dtype=torch.float32, device=x.device)
    if spec.layout == SCALE_COLUMN_MAJOR:
        return torch.empty((groups, rows), dtype=torch.float32, device=x.device).t()
    stride = group_scale_strides(rows, groups, spec.layout)
    return torch.empty_strided(shape, stride, dtype=torch.float32, device=x.device)


@functools.lru_cache(maxsize=None)
def _native_quantiser(spec: QuantSpec):
    """vLLM's QuantFP8 of `spec` (its native code is what the graph held)."""
    from vllm.config import DeviceConfig, VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    shape = {SCHEME_STATIC: GroupShape.PER_TENSOR, SCHEME_PER_TOKEN: GroupShape.PER_TOKEN}.get(
        spec.scheme, GroupShape(1, spec.group_size))
    # A CustomOp is built under a vLLM config (none is current when the op runs a graph loaded from
    # vLLM's compile cache); only forward_native runs here, which no config setting changes.
    config = get_current_vllm_config_or_none() or VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        return QuantFP8(spec.scheme == SCHEME_STATIC, shape, column_major_scales=spec.layout != SCALE_ROW_MAJOR,
                        tma_aligned_scales=spec.layout == SCALE_TMA_ALIGNED, use_ue8m0=spec.ue8m0,
                        compile_native=False)


def quantise(norm: torch.Tensor, scale, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 codes, scale) of `norm` by the quantisation the graph had: QuantFP8's native code, or
    vLLM's quant custom op through the function vLLM's QuantFP8 calls it with."""
    if not spec.custom:
        return _native_quantiser(spec).forward_native(norm, scale)
    from vllm import _custom_ops as ops

    if spec.scheme == SCHEME_STATIC:
        return ops.scaled_fp8_quant(norm, scale)
    if spec.scheme == SCHEME_PER_TOKEN:
        return ops.scaled_fp8_quant(norm, None, use_per_token_if_dynamic=True)
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    return per_token_group_quant_fp8(norm, spec.group_size, column_major_scales=spec.layout != SCALE_ROW_MAJOR,
                                     tma_aligned_scales=spec.layout == SCALE_TMA_ALIGNED, use_ue8m0=spec.ue8m0)


def _log_first_quant_call(group, spec: QuantSpec, yali: bool) -> None:
    name = str(getattr(group, "unique_name", "?"))
    log_first_call("fused_quant", (name, spec, yali),
                   "YALI fused all-reduce + RMSNorm + FP8 quant op (%s): first call on group '%s' runs %s",
                   spec.name(), name, "YALI's quantising kernel" if yali else
                   "the group's all-reduce, then vLLM's RMSNorm, then vLLM's quant")


def run_quant_on_group(group, input: torch.Tensor, residual, weight: torch.Tensor, eps: float, scale,
                       spec: QuantSpec):
    """(fp8 codes, residual_out, scale) of the all-reduce of `input` over `group` (+ `residual`),
    RMSNorm, FP8 quantisation by `spec`: YALI's quantising kernel when the group's YaliCommunicator
    has one and takes the tensors (can_fuse_quant), else the unfused sequence with the graph's own
    quantisation. The scale of a static scheme is `scale` (a copy: op outputs alias no input).
    Every rank decides alike (same shapes, dtypes, layouts and settings)."""
    yc = getattr(getattr(group, "device_communicator", None), "yali_comm", None)
    can_fuse_quant = getattr(yc, "can_fuse_quant", None)
    if can_fuse_quant is not None and can_fuse_quant(input, residual, weight, spec.scheme, spec.group_size):
        _log_first_quant_call(group, spec, True)
        scale_out = None if spec.scheme == SCHEME_STATIC else allocate_scale(input, spec)
        q, res, s = yc.fused_allreduce_rmsnorm_quant(input, residual, weight, eps, spec.scheme, scale,
                                                     group_size=spec.group_size, scale_ue8m0=spec.ue8m0,
                                                     scale_out=scale_out)
        return q, res, (scale.clone() if spec.scheme == SCHEME_STATIC else s)
    _log_first_quant_call(group, spec, False)
    norm, res = unfused(group, input, residual, weight, eps)
    q, s = quantise(norm, scale, spec)
    return q, res, (scale.clone() if spec.scheme == SCHEME_STATIC else s)


def _spec(scheme: int, group_size: int, scale_ue8m0: bool, scale_layout: int, custom_quant: bool) -> QuantSpec:
    """The QuantSpec of the op's arguments; ValueError naming a bad one."""
    if scheme not in (SCHEME_STATIC, SCHEME_PER_TOKEN, SCHEME_GROUP):
        raise ValueError(f"yali: scheme {scheme} is not one of {SCHEME_STATIC}, {SCHEME_PER_TOKEN}, {SCHEME_GROUP}")
    if scheme == SCHEME_GROUP:
        group_scale_strides(1, 1, scale_layout)  # checks scale_layout
        if group_size <= 0:
            raise ValueError(f"yali: group_size {group_size} must be positive")
        return QuantSpec(scheme, int(group_size), bool(scale_ue8m0), int(scale_layout), bool(custom_quant))
    return QuantSpec(scheme, custom=bool(custom_quant))


def yali_fused_allreduce_rmsnorm_quant(
    input: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None,
    group_name: str,
    scheme: int,
    group_size: int,
    scale_ue8m0: bool,
    scale_layout: int,
    custom_quant: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(quant_out, residual_out, scale): all-reduce of `input` over group `group_name`, plus
    `residual` when given, RMSNorm(weight, eps), then FP8 (e4m3) quantisation by `scheme`
    (quant_schemes: static with the input `scale`, dynamic per token, dynamic per group of
    `group_size` with `scale_ue8m0` and the scale in `scale_layout`); `custom_quant` says which
    vLLM quantisation the rewritten graph held (for the fallback)."""
    spec = _spec(scheme, group_size, scale_ue8m0, scale_layout, custom_quant)
    if spec.scheme == SCHEME_STATIC and scale is None:
        raise ValueError("yali: the static FP8 scheme needs its scale")
    return run_quant_on_group(_group(group_name), input, residual, weight, eps, scale, spec)


def _yali_fused_allreduce_rmsnorm_quant_fake(
    input: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None,
    group_name: str,
    scheme: int,
    group_size: int,
    scale_ue8m0: bool,
    scale_layout: int,
    custom_quant: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = _spec(scheme, group_size, scale_ue8m0, scale_layout, custom_quant)
    quant = torch.empty_like(input, dtype=torch.float8_e4m3fn)
    scale_out = torch.empty_like(scale) if spec.scheme == SCHEME_STATIC else allocate_scale(input, spec)
    return quant, torch.empty_like(input), scale_out


def register_quant_op() -> None:
    """Registers torch.ops.vllm.yali_fused_allreduce_rmsnorm_quant (idempotent)."""
    _register_once(QUANT_OP_NAME, yali_fused_allreduce_rmsnorm_quant, _yali_fused_allreduce_rmsnorm_quant_fake)


def fused_quant_op():
    register_quant_op()
    return getattr(torch.ops.vllm, QUANT_OP_NAME).default


# --------------------------------------------------------------------------
# The pass
# --------------------------------------------------------------------------

def _norm_input_weight_dtype_match(match: pm.Match) -> bool:
    """vLLM's extra check (allreduce_rms_fusion._norm_input_weight_dtype_match,
    rms_quant_fusion._rms_input_weight_dtype_match; copied because those modules
    need vLLM's CUDA ops to import): no fusion when the norm's input and weight
    dtypes differ, e.g. Gemma's fp32 ``weight.float() + 1`` gamma."""
    ir_ops = {
        torch.ops.vllm_ir.rms_norm.default: 1,  # rms_norm(x, weight, eps, ...)
        torch.ops.vllm_ir.fused_add_rms_norm.default: 2,  # (x, residual, weight, eps, ...)
    }
    for node in match.nodes:
        widx = ir_ops.get(node.target)
        if widx is None:
            continue
        x, weight = node.args[0], node.args[widx]
        if isinstance(x, fx.Node) and isinstance(weight, fx.Node):
            return x.meta["val"].dtype == weight.meta["val"].dtype
    return True


def _register_patterns(
    pm_pass: PatternMatcherPass, eps: float, dtype: torch.dtype, device, group_name: str, extra_check=None
) -> list[str]:
    """The patterns of vLLM's AllReduceRMSNormPattern and
    AllReduceFusedAddRMSNormPattern (with its first-return-only variant), each
    rewritten into YALI's op, where `extra_check(match)` (default: vLLM's dtype check) accepts.
    Returns their names (for the log)."""
    import vllm.ir.ops
    from vllm.distributed import tensor_model_parallel_all_reduce

    op = fused_op()
    check = extra_check or _norm_input_weight_dtype_match

    def empty(*shape):
        return torch.empty(*shape, dtype=dtype, device=device)

    # all_reduce -> rms_norm (first layer's input norm, after the embedding)
    def ar_rms_pattern(input, weight):
        ar = tensor_model_parallel_all_reduce(input)
        return vllm.ir.ops.rms_norm(ar, weight, eps), ar

    def ar_rms_replacement(input, weight):
        out = op(input, None, weight, eps, group_name)
        return out[0], out[1]

    pm.register_replacement(
        ar_rms_pattern, ar_rms_replacement, [empty(5, 16), empty(16)], pm.fwd_only, pm_pass,
        extra_check=check,
    )

    # all_reduce -> fused_add_rms_norm (after attention and after the MLP)
    def ar_add_rms_pattern(residual, input, weight):
        ar = tensor_model_parallel_all_reduce(input)
        out, res = vllm.ir.ops.fused_add_rms_norm(ar, residual, weight, eps)
        return out, res

    def ar_add_rms_replacement(residual, input, weight):
        out = op(input, residual, weight, eps, group_name)
        return out[0], out[1]

    add_inputs = [empty(5, 16), empty(5, 16), empty(16)]  # residual, input, weight
    pm.register_replacement(
        ar_add_rms_pattern, ar_add_rms_replacement, add_inputs, pm.fwd_only, pm_pass,
        extra_check=check,
    )

    # Same, where only the norm output is used (the final norm: the residual
    # is dead), as vLLM registers it.
    def first_only(fn):
        return lambda a, b, c: fn(a, b, c)[0]

    pm.register_replacement(
        first_only(ar_add_rms_pattern), first_only(ar_add_rms_replacement), add_inputs, pm.fwd_only,
        pm_pass, extra_check=check,
    )
    return ["all_reduce+rms_norm", "all_reduce+fused_add_rms_norm", "all_reduce+fused_add_rms_norm[norm only]"]


def quant_specs(custom: bool) -> list[QuantSpec]:
    """The quantisations the pass rewrites into YALI's quantising op: static per-tensor, dynamic per
    token, and per group of GROUP_SIZE in each scale layout, with and without ue8m0. QuantFP8's native
    code has no TMA-aligned layout (it ignores the flag: column-major). Column-major first: a
    row-major pattern also matches the head of QuantFP8's native column-major code (the transposing
    copy after it left in the graph), and the pattern matcher tries patterns in their order."""
    layouts = ((SCALE_TMA_ALIGNED,) if custom else ()) + (SCALE_COLUMN_MAJOR, SCALE_ROW_MAJOR)
    return [QuantSpec(SCHEME_STATIC, custom=custom), QuantSpec(SCHEME_PER_TOKEN, custom=custom)] + [
        QuantSpec(SCHEME_GROUP, GROUP_SIZE, ue8m0, layout, custom) for layout in layouts for ue8m0 in (False, True)]


def _custom_quant_matcher(spec: QuantSpec):
    """vLLM's own matcher of its quant custom op for `spec` (compilation/passes/fusion/matcher_utils.py,
    the one its RMSNorm + quant fusion matches with), as a (norm_out, scale) -> (q, scale) callable.
    Raises where vLLM's CUDA ops are missing (its module reads them on import)."""
    from vllm.compilation.passes.fusion.matcher_utils import MatcherQuantFP8
    from vllm.model_executor.layers.quantization.utils import quant_utils as qu

    key = {SCHEME_STATIC: qu.kFp8StaticTensorSym, SCHEME_PER_TOKEN: qu.kFp8DynamicTokenSym}.get(
        spec.scheme, qu.kFp8Dynamic128Sym)
    matcher = MatcherQuantFP8(key, enabled=True, has_col_major_scales=spec.layout != SCALE_ROW_MAJOR,
                              is_e8m0=spec.ue8m0, is_tma_aligned=spec.layout == SCALE_TMA_ALIGNED)
    return matcher.forward_custom


def _quant_pattern_scale_input(spec: QuantSpec) -> bool:
    """Whether the pattern of `spec` takes a scale tensor from the graph: the static scale, or the
    TMA-aligned buffer the graph allocates for vLLM's group quant op (its matcher takes it, as
    vLLM's does)."""
    return spec.scheme == SCHEME_STATIC or spec.layout == SCALE_TMA_ALIGNED


def _register_quant_patterns(
    pm_pass: PatternMatcherPass, eps: float, dtype: torch.dtype, device, group_name: str, spec: QuantSpec,
    extra_check,
) -> list[str]:
    """vLLM's all-reduce + (fused-add) RMSNorm patterns followed by the quantisation `spec` of the
    norm output (QuantFP8's native code, or vLLM's quant custom op), each rewritten into YALI's
    quantising op, where `extra_check(match)` accepts. Returns their names (for the log)."""
    import vllm.ir.ops
    from vllm.distributed import tensor_model_parallel_all_reduce

    op = fused_quant_op()
    quantiser = _custom_quant_matcher(spec) if spec.custom else _native_quantiser(spec).forward_native
    static = spec.scheme == SCHEME_STATIC
    takes_scale = _quant_pattern_scale_input(spec)

    def pattern(input, weight, residual, scale):
        ar = tensor_model_parallel_all_reduce(input)
        if residual is None:
            h, res = vllm.ir.ops.rms_norm(ar, weight, eps), ar
        else:
            h, res = vllm.ir.ops.fused_add_rms_norm(ar, residual, weight, eps)
        q, s = quantiser(h, scale)
        return (q, res) if static else (q, s, res)

    def replacement(input, weight, residual, scale):
        out = op(input, residual, weight, eps, scale if static else None, group_name, spec.scheme,
                 spec.group_size, spec.ue8m0, spec.layout, spec.custom)
        return (out[0], out[1]) if static else (out[0], out[2], out[1])

    def empty(*shape, dt=dtype):
        return torch.empty(*shape, dtype=dt, device=device)

    # A hidden size of two groups: QuantFP8's native group code pads a row shorter than a group.
    rows, hidden = 5, 2 * GROUP_SIZE
    scale = empty(1, 1, dt=torch.float32)
    names = []
    for residual in (False, True):
        inputs = [empty(rows, hidden), empty(hidden)] + ([empty(rows, hidden)] if residual else [])
        inputs += [scale] if takes_scale else []
        fns = [_with_signature(f, residual, takes_scale) for f in (pattern, replacement)]
        pm.register_replacement(fns[0], fns[1], inputs, pm.fwd_only, pm_pass,
                                extra_check=functools.partial(extra_check, spec=spec))
        names.append(f"all_reduce+{'fused_add_rms_norm' if residual else 'rms_norm'}+{spec.name()}")
    return names


def _with_signature(fn, residual: bool, scale: bool):
    """fn(input, weight, residual, scale) as a function of the arguments a pattern takes (the pattern
    matcher names a pattern's inputs by its function's parameters): the residual and the scale
    only where it has them."""
    if residual and scale:
        return lambda input, weight, residual, scale: fn(input, weight, residual, scale)
    if residual:
        return lambda input, weight, residual: fn(input, weight, residual, None)
    if scale:
        return lambda input, weight, scale: fn(input, weight, None, scale)
    return lambda input, weight: fn(input, weight, None, None)


def _scale_layout_as_graph(match: pm.Match, spec: QuantSpec) -> bool:
    """Whether the scale output YALI's op allocates for `spec` has the shape and strides of the scale
    the matched quantisation produced (its node's meta), so the GEMMs after it read what they
    expect. The static scale is the graph's own input: always."""
    if spec.scheme == SCHEME_STATIC:
        return True
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    outputs = match.output_nodes()
    q_node, s_node = (outputs[0], outputs[1]) if len(outputs) >= 2 else (None, None)
    q, s = (getattr(n, "meta", {}).get("val") if n is not None else None for n in (q_node, s_node))
    if not isinstance(q, torch.Tensor) or not isinstance(s, torch.Tensor) or q.dim() != 2 or s.dim() != 2:
        return False
    rows, hidden = q.shape
    groups = 1 if spec.scheme == SCHEME_PER_TOKEN else hidden // spec.group_size
    want_strides = (1, 1) if spec.scheme == SCHEME_PER_TOKEN else group_scale_strides(rows, groups, spec.layout)
    same = [a == b for a, b in zip((*s.shape, *s.stride()), (rows, groups, *want_strides))]
    return s.dtype == torch.float32 and all(statically_known_true(x) for x in same)


def fused_max_tokens(group, config) -> int | None:
    """The most tokens for which YALI's communicator on `group` serves the fused op of `config`'s
    model (its message limit over one row of the hidden size and dtype); None when unbounded
    here (no communicator or model config: the op itself still checks every call)."""
    yc = getattr(getattr(group, "device_communicator", None), "yali_comm", None)
    limit = getattr(yc, "serve_limit", None)
    model = getattr(config, "model_config", None)
    if limit is None or model is None:
        return None
    row_bytes = model.get_hidden_size() * model.dtype.itemsize
    return int(limit) // row_bytes


class YaliAllReduceFusionPass(VllmPatternMatcherPass):
    """Rewrites TP all-reduce + (fused-add-)RMSNorm into YALI's fused op.

    Built by the plugin instead of vLLM's AllReduceFusionPass when YALI serves the TP group.
    Like vLLM's pass, it rewrites only the compile ranges whose token counts YALI serves
    (``max_token_num``: the largest message YALI's communicator serves, in rows of the model's
    hidden size; unbounded at two ranks, 1024 rows of hidden 8192 bf16 at four); larger ranges
    keep vLLM's compiled all-reduce + RMSNorm, exactly as vLLM's defaults run them.

    For a quantised model the plugin also builds vLLM's pass and hands it here (`flashinfer`):
    each pair goes where fusion_routing.route says (its norm output's quantisation and whether
    FlashInfer serves the range), and in FlashInfer's ranges vLLM's pass then runs on what YALI
    left, so the pairs it takes are rewritten exactly as vLLM's defaults rewrite them. Without it
    a quantised pair stays unfused (YALI's all-reduce, then vLLM's RMSNorm + quant fusion).
    """

    def __init__(self, config, flashinfer=None) -> None:
        super().__init__(config)
        self.pass_name = "yali_allreduce_fusion_pass"
        self.patterns = PatternMatcherPass(pass_name=self.pass_name)
        self.flashinfer = flashinfer
        from yali_vllm.config import fuse_quant_enabled

        self.fuse_quant = fuse_quant_enabled()
        # YALI_FUSE_QUANT=1: the quantised pairs' patterns, applied before the plain pairs'.
        self.quant_patterns = PatternMatcherPass(pass_name=self.pass_name + "_quant")
        self.quant_matched_count = 0
        self.disabled = True
        self._range = None
        self._flashinfer_range = False
        self._routes: dict[str, str] = {}  # norm node name -> route, of the graph being rewritten
        self.route_counts: dict[str, int] = {}  # of the last graph
        from vllm.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
        if tp.world_size <= 1 or self.model_dtype is None:
            logger.warning(
                "YALI fusion pass disabled: %s",
                "TP world size is 1" if tp.world_size <= 1 else "no model config",
            )
            return
        self.max_token_num = fused_max_tokens(tp, config)
        names = self.register_patterns(tp.unique_name)
        if self.fuse_quant:
            names += self.register_quant_patterns(tp.unique_name)
        self.disabled = False
        self.dump_patterns(config, self.patterns)
        log_once(
            logger, logging.INFO, "YALI fusion pass: patterns %s registered for eps %s, %s, group '%s'; %s",
            ", ".join(names), ", ".join(str(e) for e in EPSILONS), self.model_dtype, tp.unique_name,
            "every token count" if self.max_token_num is None else
            f"compile ranges up to {self.max_token_num} tokens (larger ones keep vLLM's all-reduce + RMSNorm)",
        )

    @enable_fake_mode
    def register_patterns(self, group_name: str) -> list[str]:
        names: list[str] = []
        for eps in EPSILONS:
            names = _register_patterns(self.patterns, eps, self.model_dtype, self.device, group_name,
                                       extra_check=self._takes)
            # As in vLLM: the pattern matcher dedups patterns by their traced
            # graph, which does not show eps; clearing its cache lets the
            # second epsilon register.
            torch._inductor.pattern_matcher._seen_patterns.clear()
        return names

    @enable_fake_mode
    def register_quant_patterns(self, group_name: str) -> list[str]:
        """The quantised pairs' patterns (YALI_FUSE_QUANT=1): QuantFP8's native code of each scheme, and
        vLLM's quant custom ops where vLLM's CUDA ops exist (their matcher needs them)."""
        names: list[str] = []
        custom = True
        try:
            _custom_quant_matcher(QuantSpec(SCHEME_STATIC, custom=True))
        except Exception as e:  # no CUDA ops (a CPU build): the graphs hold no quant custom op either
            logger.debug("YALI fusion pass: no patterns of vLLM's quant custom ops (%s: %s)", type(e).__name__, e)
            custom = False
        for eps in EPSILONS:
            for spec in quant_specs(custom=False) + (quant_specs(custom=True) if custom else []):
                try:
                    names += _register_quant_patterns(self.quant_patterns, eps, self.model_dtype, self.device,
                                                      group_name, spec, self._takes_quant)
                except Exception as e:  # every rank alike: the pairs of that quantisation keep their route
                    if not spec.custom:
                        raise
                    logger.warning("YALI fusion pass: no pattern for vLLM's quant custom op %s (%s: %s); those pairs "
                                   "keep fusion_routing's route", spec.name(), type(e).__name__, e)
            torch._inductor.pattern_matcher._seen_patterns.clear()  # as in register_patterns
        return list(dict.fromkeys(names))

    def _takes_quant(self, match: pm.Match, spec: QuantSpec) -> bool:
        """The quantised patterns' extra check: vLLM's dtype check, and YALI's op allocates the scale
        as the graph did."""
        return _norm_input_weight_dtype_match(match) and _scale_layout_as_graph(match, spec)

    def _takes(self, match: pm.Match) -> bool:
        """The patterns' extra check: vLLM's dtype check, then the pair's route is YALI's op."""
        if not _norm_input_weight_dtype_match(match):
            return False
        norm = fusion_routing.norm_node(match)
        if norm is None:
            return True
        route = fusion_routing.route(fusion_routing.norm_output_quant(norm), self._flashinfer_range)
        self._routes[norm.name] = route
        return route == fusion_routing.YALI

    def uuid(self) -> str:
        # Part of Inductor's cache key: cover the pattern and routing code, and vLLM's pass if built.
        own = VllmInductorPass.hash_source(type(self), _register_patterns, _norm_input_weight_dtype_match,
                                           Path(fusion_routing.__file__).read_text())
        if self.fuse_quant:
            own += VllmInductorPass.hash_source(_register_quant_patterns, _scale_layout_as_graph, quant_specs,
                                                "YALI_FUSE_QUANT=1")
        return own + (self.flashinfer.uuid() if self.flashinfer is not None else "")

    def yali_applies(self, compile_range) -> bool:
        return not self.disabled and (self.max_token_num is None or compile_range.end <= self.max_token_num)

    def flashinfer_applies(self, compile_range) -> bool:
        return self.flashinfer is not None and bool(self.flashinfer.is_applicable_for_range(compile_range))

    def is_applicable_for_range(self, compile_range) -> bool:
        self._range = compile_range
        return self.yali_applies(compile_range) or self.flashinfer_applies(compile_range)

    def _current_range(self):
        """The range of the compilation in progress (vLLM's pass context), else the range of the
        last is_applicable_for_range call (vLLM's pass manager asks just before it runs a pass)."""
        try:
            from vllm.compilation.passes.inductor_pass import get_pass_context

            return get_pass_context().compile_range
        except Exception:
            return self._range

    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        compile_range = self._current_range()
        yali = compile_range is None or self.yali_applies(compile_range)
        self._flashinfer_range = compile_range is not None and self.flashinfer_applies(compile_range)
        self._routes = {}
        self.matched_count = self.quant_matched_count = 0
        if yali and not self.disabled:
            if self.fuse_quant:  # first: a quantised pair left to the plain patterns goes by fusion_routing
                self.quant_matched_count = self.quant_patterns.apply(graph)
            self.matched_count = self.patterns.apply(graph)
            VllmPatternMatcherPass.match_table[self.pass_name] += self.matched_count + self.quant_matched_count
        if self._flashinfer_range:
            self.flashinfer(graph)
        counts: dict[str, int] = {}
        for route in self._routes.values():
            counts[route] = counts.get(route, 0) + 1
        counts[fusion_routing.YALI] = self.matched_count
        if self.quant_matched_count:
            counts[fusion_routing.YALI_QUANT] = self.quant_matched_count
        self.route_counts = counts
        if self.flashinfer is not None or self.fuse_quant:
            where = "" if compile_range is None else f" in compile range {compile_range}"
            log_once(logger, logging.INFO, "YALI fusion pass%s: all-reduce + RMSNorm pairs %s", where,
                     fusion_routing.summary(counts))
        logger.debug("YaliAllReduceFusionPass replaced %s patterns (%s quantised)",
                     self.matched_count + self.quant_matched_count, self.quant_matched_count)
