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
YALI's all-reduce; YALI has no quantising kernel yet.
Not covered: the Gemma "(1 + weight)" variants (fp32 weight; left to YALI's all-reduce +
vLLM's norm, or to FlashInfer's pass where it runs).
Nothing here imports CUDA-only modules (vLLM's allreduce_rms_fusion module
needs vLLM's CUDA ops), so it loads, and the pass runs, on a CPU machine.
"""

# No "from __future__ import annotations": torch's schema inference reads the
# op function's annotations, which must be real types.

import logging
from pathlib import Path

import torch
import torch._inductor.pattern_matcher as pm
from torch import fx
from torch._inductor.pattern_matcher import PatternMatcherPass
from vllm.compilation.passes.inductor_pass import enable_fake_mode
from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass, VllmPatternMatcherPass

from yali_vllm import fusion_routing
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


_logged_patterns = False
_logged_routes: set[str] = set()


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
            names = _register_patterns(self.patterns, eps, self.model_dtype, self.device, group_name,
                                       extra_check=self._takes)
            # As in vLLM: the pattern matcher dedups patterns by their traced
            # graph, which does not show eps; clearing its cache lets the
            # second epsilon register.
            torch._inductor.pattern_matcher._seen_patterns.clear()
        return names

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
        self.matched_count = 0
        if yali and not self.disabled:
            self.matched_count = self.patterns.apply(graph)
            VllmPatternMatcherPass.match_table[self.pass_name] += self.matched_count
        if self._flashinfer_range:
            self.flashinfer(graph)
        counts: dict[str, int] = {}
        for route in self._routes.values():
            counts[route] = counts.get(route, 0) + 1
        counts[fusion_routing.YALI] = self.matched_count
        self.route_counts = counts
        if self.flashinfer is not None:
            where = "" if compile_range is None else f" in compile range {compile_range}"
            line = f"YALI fusion pass{where}: all-reduce + RMSNorm pairs {fusion_routing.summary(counts)}"
            if line not in _logged_routes:
                _logged_routes.add(line)
                logger.info("%s", line)
        logger.debug("YaliAllReduceFusionPass replaced %s patterns", self.matched_count)
