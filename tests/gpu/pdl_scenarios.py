"""Programmatic dependent launch across a foreign kernel (DESIGN_LOG section 7), checked on the
device. Per step, on every rank: call n's output poisoned with all-ones words, then (on the last
rank only) a GPU sleep, so that call n waits for that rank in its exchange; call n; a foreign
kernel F launched with programmatic stream serialization that triggers its dependents at once,
never waits for the grid before it, samples call n's output for poison and spins; then call n + 1
(a 2 KiB all-reduce). F starts as soon as every thread of call n let it: if that were before call
n's last store, F would see poison, and call n + 1, which waits for F alone, could start while call
n still runs. Every sum is exact (small integers) and checked on the device."""
from __future__ import annotations

import torch

from yali_vllm.communicator import YaliCommunicator

from . import testing_ops
from .scenarios import _device

SLOW_RANK_CYCLES = 200_000  # the last rank's sleep before call n: about 100 us at the H200's clock
FOREIGN_SPIN_NS = 50_000  # F's spin after its sample

# Call n per case: (op, elements or (rows, hidden), dtype, mode). "flash" is a 1 MiB all-reduce
# (flash-push at two ranks, an N-rank push kernel above), "stream" a 4 MiB stream call (two ranks),
# "fused" the fused op of 64 rows (one launch) and of 1024 rows of 4096 (two launches: the norm
# kernel is the call before F).
CASES = {
    "flash": ("all_reduce", 1 << 18, torch.float32, "config"),
    "stream": ("all_reduce", 1 << 21, torch.bfloat16, "stream"),
    "fused-one-launch": ("fused", (64, 4096), torch.bfloat16, None),
    "fused-two-launches": ("fused", (1024, 4096), torch.bfloat16, None),
}


def _ints(shape, rank: int, dtype, dev) -> torch.Tensor:
    """(e % 7) + rank + 1 at element e: every sum over up to 8 ranks is an exact small integer."""
    n = 1
    for s in shape:
        n *= s
    return ((torch.arange(n, device=dev) % 7) + rank + 1).to(dtype).view(shape)


def _expected(shape, world: int, dtype, dev) -> torch.Tensor:
    return sum(_ints(shape, r, torch.float32, dev) for r in range(world)).to(dtype)


def foreign_kernel_after_a_slow_call(rank, group, case, steps):
    """`steps` steps of the module's sequence. Returns the poisoned words F saw (must be 0), the
    wrong elements of calls n and n + 1, the error and abort record if any."""
    op, size, dtype, mode = CASES[case]
    dev = _device()
    comm = YaliCommunicator(group, dev)
    world = comm.world_size
    testing = testing_ops.ops()
    shape = (size,) if op == "all_reduce" else size
    x = _ints(shape, rank, dtype, dev)
    want = _expected(shape, world, dtype, dev)
    small = _ints((512,), rank, torch.float32, dev)
    small_want = _expected((512,), world, torch.float32, dev)
    out = torch.empty_like(x)
    weight = torch.ones(shape[-1], device=dev, dtype=dtype)
    residual_out = torch.empty_like(x) if op == "fused" else None
    incomplete = torch.zeros(1, dtype=torch.int32, device=dev)
    wrong = torch.zeros((), dtype=torch.int64, device=dev)
    error = None
    try:
        for _ in range(steps):
            out.view(torch.int32).fill_(-1)  # all-ones words: no sum of the inputs has this pattern
            if rank == world - 1:
                torch.cuda._sleep(SLOW_RANK_CYCLES)
            if op == "all_reduce":
                comm.all_reduce(x, out=out, mode=mode)
                got = out
            else:  # F watches the norm output (the last kernel's), the sum is checked in residual_out
                comm.fused_allreduce_rmsnorm(x, None, weight, 1e-6, norm_out=out, residual_out=residual_out)
                got = residual_out
            testing.early_trigger(dev.index, FOREIGN_SPIN_NS, out, incomplete)
            nxt = comm.all_reduce(small)
            wrong.add_((got != want).sum() + (nxt != small_want).sum())
        comm.synchronize()
    except Exception as e:  # noqa: BLE001 - a trap: the record says why
        error = f"{type(e).__name__}: {e}"
    done = error is None
    return {"incomplete": int(incomplete.item()) if done else None, "wrong": int(wrong.item()) if done else None,
            "error": error, "abort": comm.abort_message(), "world": world, "steps": steps}
