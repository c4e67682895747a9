"""The overlapped row-parallel GEMM + all-reduce + (residual add) RMSNorm for prefill sizes.

At TP=2 a prefill all-reduce costs as much as it moves; it can only leave the critical path by
running under the GEMM that produces it. OverlapEngine.run splits the GEMM along the tokens into
chunks (torch.mm on row slices, cuBLAS). After each chunk, a side stream that waited for that
chunk's GEMM has the copy engine push its partial sums into the peer's receive slot and then
stores the chunk's flag in the peer's buffer (csrc/core/yali/overlap.h); the copies use no SM,
so the next chunk's GEMM runs at full speed meanwhile. One consumer kernel on the main stream
then waits per chunk for the peer's flag and computes, row by row, the all-reduce sum, the
residual add and the RMSNorm, exactly as the fused op does. Everything is stream-ordered and
the device keeps every counter, so a CUDA graph captures it (the side stream forks from and
joins back into the capturing stream with events) and replays it with new inputs.

Calls larger than one receive slot (SLOT_BYTES) run in windows of rows, each its own call.
"""
from __future__ import annotations

import torch

from . import ops

SLOT_BYTES = 32 << 20  # per receive slot; two slots per GPU (overlap.h says why two suffice)
MAX_CHUNKS = 16  # csrc/core/yali/overlap.h: kOverlapMaxChunks
DEFAULT_CHUNKS = 4
# Token counts from which the vLLM pass routes a row-parallel GEMM + all-reduce + RMSNorm to the
# overlapped op (below it the GEMM is too short to hide the exchange, and the fused op wins).
MIN_TOKENS = 512


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """The GEMM chunks of `rows` rows: up to `chunks` row ranges of ceil(rows / chunks) rows
    (the last one shorter), as the consumer kernel counts them (chunk_rows)."""
    if rows <= 0:
        return []
    per = -(-rows // max(1, chunks))
    return [(b, min(rows, b + per)) for b in range(0, rows, per)]


def windows(rows: int, row_bytes: int, slot_bytes: int = SLOT_BYTES) -> list[tuple[int, int]]:
    """Row ranges of at most one receive slot each."""
    per = max(1, slot_bytes // row_bytes)
    return [(b, min(rows, b + per)) for b in range(0, rows, per)]


class OverlapEngine:
    """One communicator's overlap: its buffer handle, side stream and events, and the host's
    slot alternation (both ranks make the same calls, so they agree on it)."""

    def __init__(self, handle: int, device: torch.device, slot_bytes: int = SLOT_BYTES):
        self.handle = handle
        self.device = device
        self.slot_bytes = slot_bytes
        self.side = torch.cuda.Stream(device)
        self._fork = torch.cuda.Event()
        self._join = torch.cuda.Event()
        self._chunk_done = [torch.cuda.Event() for _ in range(MAX_CHUNKS)]
        self._calls = 0

    def run(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
            eps: float, chunks: int, norm_out: torch.Tensor, residual_out: torch.Tensor) -> None:
        """norm_out, residual_out = RMSNorm(all_reduce(x @ weight.T) [+ residual]) on both ranks.

        x: [tokens, k] (this rank's slice of the row-parallel input), weight: [hidden, k] (the
        linear layer's weight); the other tensors are [tokens, hidden] / [hidden], contiguous and
        16-byte aligned. On the current stream; the side stream forks from it and joins it again
        before this returns (in eager mode and inside a CUDA graph capture alike)."""
        rows, hidden = x.shape[0], weight.shape[0]
        chunks = max(1, min(int(chunks), MAX_CHUNKS))
        main = torch.cuda.current_stream(self.device)
        partial = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
        self._fork.record(main)
        self.side.wait_event(self._fork)
        for w0, w1 in windows(rows, hidden * x.element_size(), self.slot_bytes):
            slot = self._calls & 1
            self._calls += 1
            mine = partial[w0:w1]
            bounds = chunk_bounds(w1 - w0, chunks)
            for c, (b, e) in enumerate(bounds):
                torch.mm(x[w0 + b:w0 + e], weight.t(), out=mine[b:e])
                done = self._chunk_done[c]
                done.record(main)
                self.side.wait_event(done)
                with torch.cuda.stream(self.side):
                    ops.overlap_send(self.handle, mine, b, e, slot, c)
            res = residual[w0:w1] if residual is not None else None
            ops.overlap_consume(self.handle, mine, res, norm_weight, eps, norm_out[w0:w1], residual_out[w0:w1],
                                bounds[0][1] - bounds[0][0], slot)
        # Join: the side stream's work is part of this call (and of a capture: every forked stream
        # must rejoin the capturing one before the capture ends). `partial` is freed on `main`
        # only after the side stream's copies read it.
        self._join.record(self.side)
        main.wait_event(self._join)


_engines: dict[int, OverlapEngine] = {}


def register(e: OverlapEngine) -> None:
    _engines[e.handle] = e


def unregister(handle: int) -> None:
    _engines.pop(handle, None)


def engine(handle: int) -> OverlapEngine:
    """The engine of an open overlap buffer handle (ops.gemm_allreduce_rmsnorm runs it)."""
    e = _engines.get(handle)
    if e is None:
        raise RuntimeError(f"yali: overlap handle {handle} is not open (closed communicator?)")
    return e
