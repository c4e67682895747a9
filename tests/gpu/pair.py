"""Runs one function in two processes (rank 0 on GPU 0, rank 1 on GPU 1) joined
by a gloo group, with a hard time bound, and returns both results.

With YALI_ALLOW_SHARED_GPU=1 both processes use GPU 0 (a machine with one GPU):
the same IPC exchange and kernels, with local memory where NVLink would be."""
from __future__ import annotations

import os
import sys
import traceback

from benchmarks.common.processes import launch_two_ranks


def rank_device(rank: int) -> int:
    """The GPU of `rank`: its own, or GPU 0 for both when YALI_ALLOW_SHARED_GPU=1."""
    from yali_vllm.communicator import shared_gpu_allowed

    return 0 if shared_gpu_allowed() else rank


def _entry(rank, port, fn, args, env, q):
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank_device(rank))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        try:
            q.put((rank, ("ok", fn(rank, dist.group.WORLD, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        q.put((rank, ("error", traceback.format_exc())))
        sys.exit(1)  # the launcher stops waiting for the peer


def run_pair(fn, *args, timeout: float = 300.0, env: dict | None = None, lost: tuple = ()):
    """fn(rank, group, *args) runs in both ranks; returns [result0, result1].

    Raises AssertionError with the worker's traceback if either rank fails, and
    kills both if they are not done within `timeout` seconds (a hang is a failure).
    Ranks in `lost` are expected to die (a scenario kills them): their result is None.
    """
    got, _ = launch_two_ranks(_entry, (fn, args, dict(env or {})), timeout, lost=lost)
    errors = [f"rank {rank}:\n{value}" for rank, (status, value) in sorted(got.items()) if status == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    if len(got) < 2 - len(lost):
        raise AssertionError(f"{fn.__name__}: no result within {timeout}s (hang?)")
    return [got[r][1] if r in got else None for r in range(2)]
