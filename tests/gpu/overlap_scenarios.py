"""Outputs over inputs, on the GPU (both ranks may share one: YALI_ALLOW_SHARED_GPU=1): each entry
refuses a view that overlaps what the call still reads, naming the argument, before anything is
launched; exact aliasing stays served where it is safe (the all-reduce in place, the fused op's
residual_out = residual). The rules themselves: csrc/core/yali/common/overlap.h, checked at their
boundaries by tests/core/test_overlap_cpu.py."""
from __future__ import annotations

import torch

from yali_vllm import ops
from yali_vllm.communicator import YaliCommunicator

from .ep_scenarios import SLOT_BYTES
from .ranks_scenarios import small_ints
from .scenarios import _device


def _refusal(call) -> dict | None:
    """How `call()` was refused ({"type", "message"}), or None when it was served."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test checks the type and the message
        return {"type": type(e).__name__, "message": str(e)}
    return None


def overlapping_views(rank, group) -> dict:
    """Every rank passes the same overlapping views to the all-reduce (the communicator and the op),
    the fused op and the EP dispatch and combine; each must be refused with the argument named and
    no kernel launched. Then the all-reduce in place and the fused op with residual_out = residual
    run and must be exact (small integers: every sum is exact in bf16). Returns the refusals, the
    launches counted on the device across the refused calls, and the wrong elements."""
    dev = _device()
    comm = YaliCommunicator(group, dev, ep_slot_bytes=SLOT_BYTES)
    h, world, bf16 = comm._handle, comm.world_size, torch.bfloat16
    n = 4096  # bf16 elements: 8 KiB, flash-push at two ranks, push one-shot above
    buf = torch.zeros(n + 64, dtype=bf16, device=dev)
    x = buf[:n]
    rows, hidden = 4, 4096
    fx = torch.ones(rows, hidden, dtype=bf16, device=dev)
    w = torch.ones(hidden, dtype=bf16, device=dev)
    res_buf = torch.zeros((rows + 1) * hidden, dtype=bf16, device=dev)
    residual = res_buf[: rows * hidden].view(rows, hidden)
    counts = [4] * world
    total = sum(counts)
    ep_in = torch.zeros(total, 2048, dtype=bf16, device=dev)
    ep_buf = torch.zeros(total + 4, 2048, dtype=bf16, device=dev)
    calls = {
        "comm.all_reduce out 16 bytes on": lambda: comm.all_reduce(x, out=buf[8:n + 8]),
        "comm.all_reduce out 2 bytes on": lambda: comm.all_reduce(x, out=buf[1:n + 1]),
        "op all_reduce out 16 bytes on": lambda: ops.all_reduce(h, x, buf[8:n + 8]),
        "op all_reduce out 16 bytes before": lambda: ops.all_reduce(h, buf[8:n + 8], x),
        "fused norm_out = residual": lambda: ops.fused_allreduce_rmsnorm(h, fx, residual, w, 1e-6, norm_out=residual),
        "fused residual_out one row on": lambda: ops.fused_allreduce_rmsnorm(
            h, fx, residual, w, 1e-6, residual_out=res_buf[hidden:].view(rows, hidden)),
        "fused norm_out over weight": lambda: ops.fused_allreduce_rmsnorm(
            h, fx, None, res_buf[:hidden], 1e-6, norm_out=res_buf[: rows * hidden].view(rows, hidden)),
        "ep_combine out over input": lambda: ops.ep_combine(h, ep_in, ep_in[4:8], counts),
        "ep_dispatch output over input": lambda: ops.ep_dispatch(h, [ep_buf[:4]], [ep_buf[:total]], counts),
        "ep_dispatch outputs over each other": lambda: ops.ep_dispatch(
            h, [ep_in[:4], ep_in[4:8]], [ep_buf[:total], ep_buf[4:total + 4]], counts),
    }
    before = comm.device_calls()
    refusals = {name: _refusal(call) for name, call in calls.items()}
    launched = comm.device_calls() - before

    # Exact aliasing stays served.
    base = float(world * (world + 1) // 2)
    pattern = small_ints((n,), dev)
    x.copy_(pattern).add_(float(rank + 1))
    comm.all_reduce(x, out=x)
    wrong = int((x != pattern * world + base).sum().item())
    fused_in = small_ints((rows, hidden), dev) + float(rank + 1)
    res0 = small_ints((rows, hidden), dev)
    norm_ref, res_ref = comm.fused_allreduce_rmsnorm(fused_in, res0.clone(), w, 1e-6)
    in_place = res0.clone()
    norm, res = comm.fused_allreduce_rmsnorm(fused_in, in_place, w, 1e-6, residual_out=in_place)
    torch.cuda.synchronize(dev)
    wrong_fused = int((norm != norm_ref).sum().item() + (res != res_ref).sum().item())
    return {"refusals": refusals, "launched": launched, "wrong_in_place": wrong, "wrong_fused_in_place": wrong_fused,
            "same_storage": res.data_ptr() == in_place.data_ptr(), "abort": comm.abort_message()}
