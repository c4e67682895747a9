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

    _registered = True


def all_reduce(comm: int, x: torch.Tensor, out: torch.Tensor | None = None, mode: int = -1) -> torch.Tensor:
    """Sum of `x` over the two ranks of communicator handle `comm`, into `out` (new tensor by default)."""
    if out is None:
        out = torch.empty_like(x)
    _ext.ops().all_reduce(comm, x, out, mode)
    return out
