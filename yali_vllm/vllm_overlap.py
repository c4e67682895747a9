"""YALI's overlapped GEMM + all-reduce + RMSNorm inside vLLM's compiled graphs (prefill).

A row-parallel linear layer (o_proj, down_proj) is a GEMM whose output is all-reduced and then
normalised. YALI's fusion pass (vllm_fusion.py) already turns "all-reduce -> (fused-add)
RMSNorm" into ``torch.ops.vllm.yali_fused_allreduce_rmsnorm``; this pass, run after it, finds
that op fed by the layer's GEMM (``aten.mm(x, weight.T)`` with no other user) and rewrites the
pair into one op,

    torch.ops.vllm.yali_gemm_allreduce_rmsnorm(x, weight_t, residual, norm_weight, eps, group_name)
        -> (norm_out, residual_out)

which routes by the token count at run time, so one compiled graph serves vLLM's dynamic
shapes: from MIN_TOKENS tokens on, the overlapped op (the GEMM in chunks, each chunk's partial
sums sent by the copy engine while the next one computes: yali_vllm/overlap.py); below, or when
the communicator refuses the tensors, the GEMM and then exactly the fused op's path
(vllm_fusion.run_on_group). Both ranks see the same token count and shapes, so they always take
the same path. Logs once which layers (module paths where the graph records them, else the
GEMM's shape) it serves.

The overlap serves TP groups of WORLD_SIZE (2) ranks: the copy engine pushes each chunk's
partial sums into the one peer's receive slot (overlap.py). At 4, 6 or 8 ranks the plugin builds
the fusion pass alone (overlap_refusal), and the communicator keeps the overlap off.

Nothing here imports CUDA-only modules: the pass loads and runs on a CPU machine.
"""

# No "from __future__ import annotations": torch's schema inference reads the op's annotations.

import logging

import torch
from torch import fx
from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass

from yali_vllm import overlap, vllm_fusion
from yali_vllm.vllm_log import log_first_call

logger = logging.getLogger("vllm.yali")

OP_NAME = "yali_gemm_allreduce_rmsnorm"
MIN_TOKENS = overlap.MIN_TOKENS
# The TP world size the overlap serves (one peer per rank).
WORLD_SIZE = 2


def overlap_refusal(world_size: int) -> str | None:
    """Why the overlap pass is not built for a TP group of `world_size` ranks, or None when it is."""
    if world_size == WORLD_SIZE:
        return None
    return f"TP world size is {world_size}; the overlap serves {WORLD_SIZE} ranks"


def run_on_group(group, x: torch.Tensor, weight_t: torch.Tensor, residual, norm_weight: torch.Tensor, eps: float):
    """The overlapped op from MIN_TOKENS tokens when the group's YaliCommunicator takes the
    tensors, else the GEMM followed by the fused op's path (YALI fused, or vLLM's sequence)."""
    yc = getattr(getattr(group, "device_communicator", None), "yali_comm", None)
    weight = weight_t.t()  # the linear layer's [hidden, k] weight (a view)
    if yc is not None and x.shape[0] >= MIN_TOKENS and yc.can_overlap(x, weight, residual, norm_weight):
        _log_first_call(group, True, x.shape[0])
        return yc.gemm_allreduce_rmsnorm(x, weight, residual, norm_weight, eps)
    _log_first_call(group, False, x.shape[0])
    return vllm_fusion.run_on_group(group, torch.mm(x, weight_t), residual, norm_weight, eps)


def _log_first_call(group, overlapped: bool, tokens: int) -> None:
    """The overlap op's first call per group and path (vllm_log.log_first_call)."""
    name = str(getattr(group, "unique_name", "?"))
    log_first_call("overlap", (name, overlapped), "YALI overlap op: first call on group '%s' (%d tokens) runs %s", name,
                   tokens, "the overlapped GEMM + all-reduce + RMSNorm" if overlapped
                   else "the GEMM, then the fused all-reduce + RMSNorm path")


def yali_gemm_allreduce_rmsnorm(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm_out, residual_out) of RMSNorm(all_reduce(x @ weight_t) [+ residual]) over group
    `group_name`, with vLLM's fused_add_rms_norm / rms_norm semantics (residual_out is the
    all-reduce output when there is no residual)."""
    return run_on_group(vllm_fusion._group(group_name), x, weight_t, residual, norm_weight, eps)


def _fake(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (x.shape[0], weight_t.shape[1])
    return x.new_empty(shape), x.new_empty(shape)


def overlap_op():
    """torch.ops.vllm.yali_gemm_allreduce_rmsnorm.default, registered once."""
    if not hasattr(torch.ops.vllm, OP_NAME):
        from vllm.utils.torch_utils import direct_register_custom_op

        direct_register_custom_op(op_name=OP_NAME, op_func=yali_gemm_allreduce_rmsnorm, fake_impl=_fake)
    return getattr(torch.ops.vllm, OP_NAME).default


def _layer_name(node: fx.Node) -> str:
    """The module path of the GEMM's layer where the graph records it, else its shape."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(list(stack.values())[-1][0])
    x, w = (a.meta.get("val") for a in node.args[:2])
    return f"mm[{tuple(x.shape)} x {tuple(w.shape)}]" if x is not None and w is not None else "mm"


def rewrite(graph: fx.Graph) -> list[str]:
    """Rewrites every mm -> yali_fused_allreduce_rmsnorm pair (the mm's output used by that op
    alone) into the overlap op; returns the rewritten layers."""
    fused = vllm_fusion.fused_op()
    op = overlap_op()
    served = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != fused:
            continue
        mm = node.args[0]
        if not (isinstance(mm, fx.Node) and mm.target == torch.ops.aten.mm.default and len(mm.users) == 1):
            continue
        x, weight_t = mm.args
        _, residual, norm_weight, eps, group_name = node.args
        with graph.inserting_before(node):
            new = graph.call_function(op, (x, weight_t, residual, norm_weight, eps, group_name))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        served.append(_layer_name(mm))
        graph.erase_node(mm)
    return served


_logged: set = set()


class YaliOverlapPass(VllmInductorPass):
    """Rewrites a row-parallel GEMM followed by YALI's fused all-reduce + RMSNorm into the
    overlap op. Runs after YaliAllReduceFusionPass; applies to compile ranges that reach
    MIN_TOKENS (the op itself routes each call by its token count)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.pass_name = "yali_overlap_pass"

    def is_applicable_for_range(self, compile_range) -> bool:
        return compile_range.end >= MIN_TOKENS

    def uuid(self) -> str:
        return VllmInductorPass.hash_source(type(self), rewrite, run_on_group)

    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        served = rewrite(graph)
        key = tuple(served)
        if served and key not in _logged:
            _logged.add(key)
            logger.info("YALI overlap pass: GEMM + all-reduce + RMSNorm overlapped from %d tokens for %d "
                        "layer(s): %s", MIN_TOKENS, len(served), ", ".join(served))


class YaliFusionWithOverlap(VllmInductorPass):
    """YALI's fusion pass, then the overlap pass on the same graph (it rewrites what the fusion
    pass produced): what the plugin builds in place of vLLM's AllReduceFusionPass when YALI
    serves the TP group (with_overlap)."""

    def __init__(self, fusion, config) -> None:
        super().__init__(config)
        self.pass_name = "yali_fusion_with_overlap_pass"
        self.fusion = fusion
        self.overlap = YaliOverlapPass(config)
        self._range = None

    def is_applicable_for_range(self, compile_range) -> bool:
        self._range = compile_range
        return self.fusion.is_applicable_for_range(compile_range)

    def uuid(self) -> str:
        return self.fusion.uuid() + self.overlap.uuid()

    def __call__(self, graph: fx.Graph) -> None:
        self.fusion(graph)
        if self._range is None or self.overlap.is_applicable_for_range(self._range):
            self.overlap(graph)


def with_overlap(fusion, config) -> VllmInductorPass:
    """The plugin's fusion pass followed by the overlap pass (see YaliFusionWithOverlap)."""
    return YaliFusionWithOverlap(fusion, config)
