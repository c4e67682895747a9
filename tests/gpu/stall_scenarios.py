"""The abort record of a stalled call, on the GPU (the ranks may share one: YALI_ALLOW_SHARED_GPU=1):
it names this rank's call even when the CTA that checks the call (the last one) never ran. Another
kernel holds all but FREE_SMS SMs while rank 0 alone issues a call of more CTAs than fit on them."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from yali_vllm import config
from yali_vllm.communicator import YaliCommunicator

from . import testing_ops
from .scenarios import _device

FREE_SMS = 2  # SMs the busy kernel leaves: at most 4 CTAs of 512 threads fit on one
MIN_CTAS = 32  # a stalled call has at least this many CTAs: its last CTA cannot run beside the busy kernel
STALLED_BYTES = 256 << 10  # the plain all-reduce's message: flash-push on 128 CTAs at two ranks
FUSED_SHAPES = ((64, 4096), (128, 4096), (32, 8192))  # bf16 (rows, hidden): the first one-launch, cluster-free
# shape of at least MIN_CTAS CTAs is the stalled fused call


def _fused_shape(comm: YaliCommunicator) -> tuple[int, int, dict]:
    for rows, hidden in FUSED_SHAPES:
        launch = comm.fused_launch(rows, hidden, torch.bfloat16)
        if launch["one_launch"] and launch["cluster"] == 1 and launch["spread"] == 1 and launch["grid"] >= MIN_CTAS:
            return rows, hidden, launch
    raise AssertionError(f"no fused shape of {FUSED_SHAPES} is one cluster-free launch of >= {MIN_CTAS} CTAs")


def _stalled_call(comm: YaliCommunicator, kind: str, dev):
    """(call, the record's text of it as this rank's call, its CTAs) of the stalled call `kind`."""
    bf16, world = torch.bfloat16, comm.world_size
    if kind == "all_reduce":
        x = torch.ones(STALLED_BYTES // 2, dtype=bf16, device=dev)
        kernel, ctas, _ = config.plan(STALLED_BYTES, world_size=world)
        return (lambda: comm.all_reduce(x)), f"all_reduce of {STALLED_BYTES} bytes bf16 by {kernel} on {ctas} CTAs", ctas
    rows, hidden, launch = _fused_shape(comm)
    x = torch.ones(rows, hidden, dtype=bf16, device=dev)
    w = torch.ones(hidden, dtype=bf16, device=dev)
    kernel = "flash-push" if world == 2 else "push-oneshot"
    text = (f"fused all-reduce + RMSNorm of hidden {hidden}, {rows * hidden * 2} bytes bf16 by {kernel} on "
            f"{launch['grid']} CTAs")
    return (lambda: comm.fused_allreduce_rmsnorm(x, None, w, 1e-6)), text, launch["grid"]


def stalled_call_record(rank, group, kind: str, wait_s: float) -> dict:
    """Every rank runs the call once (its kernel loaded: with CUDA's lazy loading a kernel's first
    launch waits for every running kernel of the process), then a different small call, so that
    the last call the GPU ran is not the stalled one. Rank 0 then starts the test kernel occupy on all but
    FREE_SMS SMs for `wait_s` seconds and issues the call alone; the other ranks stay alive without
    it. Rank 0's CTAs that run wait for the peers' data and give up after YALI_TIMEOUT_S; its last
    CTA, which checks the call, never runs. Returns rank 0's record (read from host memory; no CUDA
    call after the trap), the text it must name as this rank's call, and when it appeared."""
    dev = _device()
    comm = YaliCommunicator(group, dev)
    busy_kernel = testing_ops.ops()
    call, expected, ctas = _stalled_call(comm, kind, dev)
    call()
    comm.all_reduce(torch.ones(1024, dtype=torch.float32, device=dev))  # the last call before: another one
    busy_kernel.occupy(dev.index, 1, 1000)
    torch.cuda._sleep(1000)
    comm.synchronize()
    dist.barrier(group)
    if rank != 0:
        time.sleep(wait_s)  # alive: rank 0's mapping of this rank's buffer stays valid while it waits
        return {"rank": rank}
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        busy_kernel.occupy(dev.index, sms - FREE_SMS, int(wait_s * 1e9))
    torch.cuda._sleep(2_000_000)  # the busy kernel's CTAs reach the SMs first
    t0 = time.time()
    call()
    while not comm.abort_message() and time.time() - t0 < wait_s:
        time.sleep(0.05)
    return {"abort": comm.abort_message(), "expected": expected, "ctas": ctas, "recorded_s": time.time() - t0}
