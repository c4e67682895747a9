"""Python side of the torch ops: fake (meta) implementations for torch.compile and
thin wrappers. The CUDA implementation lives in csrc/bindings/torch_ops.cpp."""
from __future__ import annotations

import torch

from . import _ext
from .quant_schemes import SCHEME_GROUP, SCHEME_PER_TOKEN, SCHEME_STATIC

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

    @torch.library.register_fake("yali::fused_allreduce_rmsnorm_quant")
    def _(comm: int, input: torch.Tensor, residual, weight: torch.Tensor, eps: float, quant_out: torch.Tensor,
          residual_out, scale: torch.Tensor, scheme: int, group_size: int, scale_ue8m0: bool) -> None:
        torch._check(quant_out.shape == input.shape, lambda: "yali: quant_out must have input's shape")
        torch._check(quant_out.dtype == torch.float8_e4m3fn, lambda: "yali: quant_out must be float8_e4m3fn")
        if residual_out is not None:
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


QUANT_GROUP_SIZES = (64, 128)
QUANT_DTYPES = (torch.bfloat16, torch.float16)


def quant_call_refusal(x: torch.Tensor, quant_out: torch.Tensor | None, scale: torch.Tensor, scheme: int,
                       group_size: int) -> str | None:
    """Why a quantising fused call cannot run with these arguments (the argument named), or None:
    the checks that need no GPU (the op checks devices, layouts and overlaps again)."""
    if scheme not in (SCHEME_STATIC, SCHEME_PER_TOKEN, SCHEME_GROUP):
        return f"yali: scheme must be 0 (static), 1 (per-token) or 2 (per-token-group), got {scheme!r}"
    if x.dtype not in QUANT_DTYPES:
        return f"yali: input must be bfloat16 or float16 for the quantising fused op, got {x.dtype}"
    if x.dim() < 1 or x.shape[-1] == 0:
        return "yali: input must be [..., hidden] with hidden > 0"
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    if quant_out is not None and (quant_out.dtype != torch.float8_e4m3fn or quant_out.shape != x.shape):
        return f"yali: quant_out must be a float8_e4m3fn tensor of input's shape {tuple(x.shape)}, got " \
               f"{tuple(quant_out.shape)} {quant_out.dtype}"
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        return "yali: scale must be a float32 tensor"
    if scheme == SCHEME_STATIC and scale.numel() != 1:
        return f"yali: scale must hold one element for the static scheme, got {tuple(scale.shape)}"
    if scheme == SCHEME_PER_TOKEN and scale.numel() != rows:
        return f"yali: scale must be [{rows}, 1] for the per-token scheme, got {tuple(scale.shape)}"
    if scheme == SCHEME_GROUP:
        if group_size not in QUANT_GROUP_SIZES:
            return f"yali: group_size must be 64 or 128, got {group_size!r}"
        if hidden % group_size:
            return f"yali: group_size {group_size} must divide the hidden size {hidden}"
        if scale.shape != (rows, hidden // group_size):
            return f"yali: scale must be [{rows}, {hidden // group_size}] for the group scheme, got {tuple(scale.shape)}"
    return None


def quant_scale_out(x: torch.Tensor, scheme: int, group_size: int = 128) -> torch.Tensor:
    """A new scale output for a dynamic scheme: [rows, 1] (per-token) or row-major
    [rows, hidden / group_size] (group)."""
    rows = x.numel() // x.shape[-1]
    cols = 1 if scheme == SCHEME_PER_TOKEN else x.shape[-1] // group_size
    return torch.empty((rows, cols), dtype=torch.float32, device=x.device)


def fused_allreduce_rmsnorm_quant(comm: int, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                                  eps: float, quant_out: torch.Tensor | None, residual_out: torch.Tensor | None,
                                  scale: torch.Tensor, scheme: int, group_size: int = 128,
                                  scale_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """All-reduce + residual add + RMSNorm as fused_allreduce_rmsnorm, the normalised rows (rounded to
    x.dtype, as norm_out holds them) quantised to FP8 e4m3 with vLLM's arithmetic (csrc/core/yali/
    fused/quant.cuh) into quant_out (new when None):
      scheme 0 (static): `scale` is the one-element input scale, q = e4m3(clamp(y * (1 / scale)));
      scheme 1 (dynamic per-token): `scale` [rows, 1] receives max(row absmax / 448, 1 / (448 * 512));
      scheme 2 (dynamic per-token-group of group_size 64 or 128): `scale` [rows, hidden / group_size],
        any strides, receives max(group absmax, 1e-10) / 448, rounded up to a power of two with
        scale_ue8m0.
    residual_out (may be residual itself, or None: not stored) as in fused_allreduce_rmsnorm.
    Returns (quant_out, residual_out, scale). Raises ValueError naming the argument it refuses."""
    why = quant_call_refusal(x, quant_out, scale, scheme, group_size)
    if why:
        raise ValueError(why)
    if quant_out is None:
        quant_out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    _launch(torch.ops.yali.fused_allreduce_rmsnorm_quant, comm, x, residual, weight, float(eps), quant_out,
            residual_out, scale, int(scheme), int(group_size), bool(scale_ue8m0))
    return quant_out, residual_out, scale


def ep_dispatch(comm: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor], counts: list[int]) -> None:
    """outputs[i] = inputs[i] of every rank of communicator `comm`, in rank order (ep.cuh)."""
    _launch(torch.ops.yali.ep_dispatch, comm, inputs, outputs, counts)


def ep_combine(comm: int, x: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
    """out = this rank's rows of x summed over the ranks of communicator `comm`, in rank order (ep.cuh)."""
    _launch(torch.ops.yali.ep_combine, comm, x, out, counts)
