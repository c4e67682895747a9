"""Python side of the torch ops: fake (meta) implementations for torch.compile and
thin wrappers. The CUDA implementation lives in csrc/bindings/torch_ops.cpp."""
from __future__ import annotations

import torch

from . import _ext

_registered = False


def register_fakes() -> None:
    """Registers the fake implementation of yali::all_reduce (idempotent).

    The op mutates `out` and returns nothing, so under FakeTensor tracing it only
    has to check shapes; torch.compile functionalises it like any mutating op.
    """
    global _registered
    if _registered or _ext.library_error():
        return

    @torch.library.register_fake("yali::all_reduce")
    def _(comm: int, input: torch.Tensor, out: torch.Tensor, kernel_mode: int = -1) -> None:
        torch._check(out.numel() == input.numel(), lambda: "yali: out must have input's number of elements")
        torch._check(out.dtype == input.dtype, lambda: "yali: out must have input's dtype")

    @torch.library.register_fake("yali::fused_allreduce_rmsnorm")
    def _(comm: int, input: torch.Tensor, residual, weight: torch.Tensor, eps: float, norm_out: torch.Tensor,
          residual_out: torch.Tensor) -> None:
        torch._check(norm_out.shape == input.shape, lambda: "yali: norm_out must have input's shape")
        torch._check(residual_out.shape == input.shape, lambda: "yali: residual_out must have input's shape")

    @torch.library.register_fake("yali::ep_dispatch")
    def _(comm: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor], counts: list[int]) -> None:
        torch._check(len(inputs) == len(outputs), lambda: "yali: ep_dispatch needs one output per input")

    @torch.library.register_fake("yali::ep_combine")
    def _(comm: int, input: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        torch._check(out.dtype == input.dtype, lambda: "yali: out must have input's dtype")

    _registered = True


def _launch(op, *args) -> None:
    """op(*args): torch.ops.yali directly while torch.compile traces (fullgraph traces through this
    wrapper), else through _ext.call, which raises the library's tagged errors as ValueError / TypeError."""
    if torch.compiler.is_compiling():
        op(*args)
    else:
        _ext.call(op, *args)


def all_reduce(comm: int, x: torch.Tensor, out: torch.Tensor | None = None, mode: int = -1) -> torch.Tensor:
    """Sum of `x` over the two ranks of communicator handle `comm`, into `out` (new tensor by default)."""
    if out is None:
        out = torch.empty_like(x)
    _launch(torch.ops.yali.all_reduce, comm, x, out, mode)
    return out


def fused_allreduce_rmsnorm(comm: int, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float, norm_out: torch.Tensor | None = None,
                            residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of all-reduce + residual add + RMSNorm over the last dimension of `x` ([tokens, hidden]).

    s = sum of x over both ranks (rounded to x.dtype, as a plain all-reduce returns it),
    z = s + residual in fp32 (z = s without a residual), residual_out = z rounded,
    norm_out = (z * rsqrt(mean(z^2) + eps)) rounded, times weight, rounded: vLLM's
    fused_add_rms_norm / rms_norm semantics. Returns (norm_out, residual_out). Neither output may
    overlap `x` (ValueError naming it): the other ranks read `x` while the outputs are written.
    """
    if norm_out is None:
        norm_out = torch.empty_like(x)
    if residual_out is None:
        residual_out = torch.empty_like(x)
    _launch(torch.ops.yali.fused_allreduce_rmsnorm, comm, x, residual, weight, float(eps), norm_out, residual_out)
    return norm_out, residual_out


def ep_dispatch(comm: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor], counts: list[int]) -> None:
    """outputs[i] = inputs[i] of every rank of communicator `comm`, in rank order (ep.cuh)."""
    _launch(torch.ops.yali.ep_dispatch, comm, inputs, outputs, counts)


def ep_combine(comm: int, x: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
    """out = this rank's rows of x summed over the ranks of communicator `comm`, in rank order (ep.cuh)."""
    _launch(torch.ops.yali.ep_combine, comm, x, out, counts)
