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

Not covered: the Gemma "(1 + weight)" variants (fp32 weight; left to YALI's
all-reduce + vLLM's norm) and FlashInfer's all-reduce+RMSNorm+FP8/NVFP4-quant
variants (YALI has no quantising kernel: the all-reduce+RMSNorm part of such a
chain is fused by this pass, the quantisation stays a separate op).
Nothing here imports CUDA-only modules (vLLM's allreduce_rms_fusion module
needs vLLM's CUDA ops), so it loads, and the pass runs, on a CPU machine.
"""

# No "from __future__ import annotations": torch's schema inference reads the
# op function's annotations, which must be real types.

import logging

import torch
import torch._inductor.pattern_matcher as pm
from torch import fx
from torch._inductor.pattern_matcher import PatternMatcherPass
from vllm.compilation.passes.inductor_pass import enable_fake_mode
from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass, VllmPatternMatcherPass

from yali_vllm.vllm_log import LOGGER, log_first_call

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


def fusion_forced(environ=None) -> bool:
    """Whether YALI_FUSION is set on explicitly (then YALI's pass serves at every world size,
    FUSION_BY_FLASHINFER's included): the same flag read with "off" for unset."""
    from yali_vllm.config import env_flag

    return env_flag(FUSION_VAR, False, environ)


def flashinfer_fusion_reason(world_size, environ=None) -> str | None:
    """Why the fused pairs of a TP group of `world_size` ranks stay with vLLM's FlashInfer fusion
    although YALI serves the group (yali_vllm.config.FUSION_BY_FLASHINFER), or None."""
    from yali_vllm.config import FUSION_BY_FLASHINFER

    reason = FUSION_BY_FLASHINFER.get(world_size)
    if reason is None or fusion_forced(environ):
        return None
    return f"at {world_size} ranks {reason}; {FUSION_VAR}=1 builds YALI's pass instead"


def fusion_choice(environ=None) -> tuple[str, str]:
    """Which fusion pass this process builds, and why: "yali" (YALI's pass), "vllm" (vLLM's
    FlashInfer pass) or "vllm+yali" (at a FUSION_BY_FLASHINFER world size with YALI_FUSION unset:
    vLLM's pass for the compile ranges it serves, YALI's for the ranges above them that YALI
    serves; see FlashInferThenYaliPass). Every rank reaches the same answer (the YALI decision
    is agreed over the group, the ranks compare their YALI_FUSION at set-up), which matters: one
    rank in YALI's fused kernel and another in FlashInfer's would wait for each other.
    ValueError naming YALI_FUSION when it is invalid."""
    group, why = _yali_group(environ)
    if group is None:
        return "vllm", why
    leave = flashinfer_fusion_reason(group.world_size, environ)
    if leave is not None:
        return "vllm+yali", (f"TP group '{group.unique_name}': {leave}; YALI's pass serves the compile "
                             "ranges above FlashInfer's that YALI serves")
    return "yali", why


def fusion_decision(environ=None) -> tuple[bool, str]:
    """Whether this process builds YALI's fusion pass alone (fusion_choice is "yali"), and why (not)."""
    choice, why = fusion_choice(environ)
    return choice == "yali", why


def _yali_group(environ=None):
    """(the TP group, why) when YALI's fusion pass may serve this process's TP group: YALI_FUSION
    is on, the group has a world size YALI serves (yali_vllm.config.WORLD_SIZES: 2, 4, 6 or 8
    ranks) and the plugin attached a YaliCommunicator to its device communicator; else (None, why
    not). Which compile ranges the pass then takes: fusion_choice. ValueError naming YALI_FUSION
    for an invalid value."""
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


def register_op() -> None:
    """Registers torch.ops.vllm.yali_fused_allreduce_rmsnorm (idempotent, also
    across re-imports of this module)."""
    if hasattr(torch.ops.vllm, OP_NAME):
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(
        op_name=OP_NAME,
        op_func=yali_fused_allreduce_rmsnorm,
        fake_impl=_yali_fused_allreduce_rmsnorm_fake,
    )


def fused_op():
    register_op()
    return getattr(torch.ops.vllm, OP_NAME).default


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
    pm_pass: PatternMatcherPass, eps: float, dtype: torch.dtype, device, group_name: str
) -> list[str]:
    """The patterns of vLLM's AllReduceRMSNormPattern and
    AllReduceFusedAddRMSNormPattern (with its first-return-only variant), each
    rewritten into YALI's op.  Returns their names (for the log)."""
    import vllm.ir.ops
    from vllm.distributed import tensor_model_parallel_all_reduce

    op = fused_op()

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
        extra_check=_norm_input_weight_dtype_match,
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
        extra_check=_norm_input_weight_dtype_match,
    )

    # Same, where only the norm output is used (the final norm: the residual
    # is dead), as vLLM registers it.
    def first_only(fn):
        return lambda a, b, c: fn(a, b, c)[0]

    pm.register_replacement(
        first_only(ar_add_rms_pattern), first_only(ar_add_rms_replacement), add_inputs, pm.fwd_only,
        pm_pass, extra_check=_norm_input_weight_dtype_match,
    )
    return ["all_reduce+rms_norm", "all_reduce+fused_add_rms_norm", "all_reduce+fused_add_rms_norm[norm only]"]


_logged_patterns = False


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

    Built by the plugin instead of vLLM's AllReduceFusionPass when YALI serves
    the TP group (never both).  Like vLLM's pass, it applies only to the compile
    ranges whose token counts it serves (``max_token_num``: the largest message
    YALI's communicator serves, in rows of the model's hidden size; unbounded at
    two ranks, 1024 rows of hidden 8192 bf16 at four).  Larger ranges keep
    vLLM's compiled all-reduce + RMSNorm, exactly as vLLM's defaults run them.
    """

    def __init__(self, config) -> None:
        super().__init__(config)
        self.pass_name = "yali_allreduce_fusion_pass"
        self.patterns = PatternMatcherPass(pass_name=self.pass_name)
        self.disabled = True
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
        self.disabled = False
        self.dump_patterns(config, self.patterns)
        global _logged_patterns
        if not _logged_patterns:
            _logged_patterns = True
            logger.info(
                "YALI fusion pass: patterns %s registered for eps %s, %s, group '%s'; %s",
                ", ".join(names), ", ".join(str(e) for e in EPSILONS), self.model_dtype, tp.unique_name,
                "every token count" if self.max_token_num is None else
                f"compile ranges up to {self.max_token_num} tokens (larger ones keep vLLM's all-reduce + RMSNorm)",
            )

    @enable_fake_mode
    def register_patterns(self, group_name: str) -> list[str]:
        names: list[str] = []
        for eps in EPSILONS:
            names = _register_patterns(self.patterns, eps, self.model_dtype, self.device, group_name)
            # As in vLLM: the pattern matcher dedups patterns by their traced
            # graph, which does not show eps; clearing its cache lets the
            # second epsilon register.
            torch._inductor.pattern_matcher._seen_patterns.clear()
        return names

    def uuid(self) -> str:
        # Part of Inductor's cache key: cover the pattern code, not only the class.
        return VllmInductorPass.hash_source(type(self), _register_patterns, _norm_input_weight_dtype_match)

    def is_applicable_for_range(self, compile_range) -> bool:
        return not self.disabled and (self.max_token_num is None or compile_range.end <= self.max_token_num)

    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        if self.disabled:
            return
        self.matched_count = self.patterns.apply(graph)
        VllmPatternMatcherPass.match_table[self.pass_name] += self.matched_count
        logger.debug("YaliAllReduceFusionPass replaced %s patterns", self.matched_count)


class FlashInferThenYaliPass(VllmInductorPass):
    """vLLM's FlashInfer fusion pass for the compile ranges it serves, YALI's pass for the ranges
    above them that YALI serves: what the plugin builds at a world size of FUSION_BY_FLASHINFER
    (none today), one where FlashInfer's fused kernel measures at least as fast as YALI's over its
    whole range. vLLM compiles one range above FlashInfer's (129-8192 tokens at four ranks), which
    YALI's op (up to 8 MiB) does not cover; with a compile range endpoint at YALI's limit
    (``--compilation-config '{"compile_ranges_endpoints": [512]}'``) the range 129-512 gets YALI's
    op. Each range is rewritten by exactly one of the two passes."""

    def __init__(self, flashinfer, yali, config) -> None:
        super().__init__(config)
        self.pass_name = "flashinfer_then_yali_fusion_pass"
        self.flashinfer, self.yali = flashinfer, yali
        self._range = None

    def pass_for_range(self, compile_range):
        """The pass that rewrites `compile_range`: FlashInfer's where it applies, else YALI's where
        it applies, else None."""
        if self.flashinfer.is_applicable_for_range(compile_range):
            return self.flashinfer
        if self.yali.is_applicable_for_range(compile_range):
            return self.yali
        return None

    def is_applicable_for_range(self, compile_range) -> bool:
        self._range = compile_range
        return self.pass_for_range(compile_range) is not None

    def uuid(self) -> str:
        # Part of Inductor's cache key: both passes and this routing.
        return self.flashinfer.uuid() + self.yali.uuid() + VllmInductorPass.hash_source(type(self))

    def _current_range(self):
        """The range of the compilation in progress (vLLM's pass context), else the range of the
        last is_applicable_for_range call (vLLM's pass manager asks just before it runs a pass)."""
        try:
            from vllm.compilation.passes.inductor_pass import get_pass_context

            return get_pass_context().compile_range
        except Exception:
            return self._range

    def __call__(self, graph: fx.Graph) -> None:
        compile_range = self._current_range()
        chosen = self.pass_for_range(compile_range) if compile_range is not None else None
        if chosen is not None:  # no range known: nothing rewritten, on every rank alike
            chosen(graph)
