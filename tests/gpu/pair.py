"""Runs one function in N processes (rank r on GPU r) joined by a gloo group, with a hard time
bound, and returns every rank's result; run_pair is the two-rank case.

With YALI_ALLOW_SHARED_GPU=1 all N processes use GPU 0 (a machine with one GPU): the same IPC
exchange and kernels, with local memory where NVLink would be, the processes taking turns."""
from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import traceback

import pytest

from benchmarks.common.processes import launch_ranks

# The N-rank suites' limits (test_ranks.py, test_ep.py). Hard bounds of a group's processes, start-up
# included, per N: a hang is a failure.
SUITE_BOUND_S = {2: 150, 4: 180, 6: 220, 8: 260}
MISMATCH_BOUND_S = {2: 90, 4: 110, 6: 125, 8: 140}
SUITE_TIMEOUT_S = "30"  # YALI_TIMEOUT_S of a suite: a kernel left waiting gives up and says why
MISMATCH_TIMEOUT_S = 10.0  # YALI_TIMEOUT_S of a mismatched or skipped call
MISMATCH_MARGIN_S = 20.0  # trap, error propagation and (shared GPU) the other processes' time slices


def rank_device(rank: int) -> int:
    """The GPU of `rank`: its own, or GPU 0 for every rank when YALI_ALLOW_SHARED_GPU=1."""
    from yali_vllm.communicator import shared_gpu_allowed

    return 0 if shared_gpu_allowed() else rank


def missing_gpus(world_size: int) -> str | None:
    """Why `world_size` ranks cannot each have their own GPU here, or None (also when
    YALI_ALLOW_SHARED_GPU=1 puts them all on GPU 0)."""
    import torch

    from yali_vllm.communicator import SHARED_GPU_VAR, shared_gpu_allowed

    if shared_gpu_allowed():
        return None
    visible = torch.cuda.device_count()
    if visible < world_size:
        return (f"{world_size} ranks need {world_size} GPUs, {visible} visible "
                f"({SHARED_GPU_VAR}=1 runs them all on GPU 0)")
    return None


def _entry(rank, port, fn, args, env, world_size, q):
    # A rank that dies by a signal (a fault after a kernel trapped) prints every thread's stack.
    faulthandler.enable(all_threads=True)
    os.environ.update(env)
    sent = False
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank_device(rank))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        try:
            _send(q, (rank, ("ok", fn(rank, dist.group.WORLD, *args))))
            sent = True
        finally:
            dist.destroy_process_group()
    except BaseException:
        if not sent:  # a teardown that fails after the result left changes nothing
            with contextlib.suppress(Exception):  # a queue that broke: the launcher names the exit
                _send(q, (rank, ("error", traceback.format_exc())))
        sys.exit(1)  # the launcher stops waiting for the other ranks


def _send(q, item) -> None:
    """Puts `item` on the launcher's queue and waits until it has left this process: what follows
    (the group's teardown beside a dead rank, the exit of a process whose CUDA context trapped) may
    end the process, and a result still in the queue's feeder thread would be lost with it."""
    q.put(item)
    q.close()
    q.join_thread()


def run_ranks(fn, *args, world_size: int = 2, timeout: float = 300.0, env: dict | None = None, lost: tuple = ()):
    """fn(rank, group, *args) runs in `world_size` ranks; returns [result of rank 0, ...].

    Skips the calling test when the ranks need more GPUs than are visible (missing_gpus).
    Raises AssertionError with the worker's traceback if any rank fails, and kills every rank
    if they are not done within `timeout` seconds (a hang is a failure). Ranks in `lost` are
    expected to die (a scenario kills them): their result is None. The ranks run with
    YALI_ABORT_EXIT=0 unless `env` sets it.
    """
    reason = missing_gpus(world_size)
    if reason:
        pytest.skip(reason)
    # The scenarios inspect the state after an abort themselves: the abort watcher keeps their
    # processes (YALI_ABORT_EXIT=0) unless a test's env asks for it (tests/gpu/test_abort_exit.py).
    env = {"YALI_ABORT_EXIT": "0", **(env or {})}
    got, timed_out = launch_ranks(_entry, (fn, args, env, world_size), timeout, lost=lost,
                                  world_size=world_size)
    errors = [f"rank {rank}:\n{value}" for rank, (status, value) in sorted(got.items()) if status == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    if len(got) < world_size - len(lost):
        missing = sorted(set(range(world_size)) - set(got) - set(lost))
        how = (f"not done within {timeout}s (a hang)" if timed_out
               else "ended or was stopped before reporting (a rank that died by itself is named on stderr with its exit)")
        raise AssertionError(f"{fn.__name__}: no result from rank(s) {missing} of {world_size}: {how}")
    return [got[r][1] if r in got else None for r in range(world_size)]


def run_pair(fn, *args, timeout: float = 300.0, env: dict | None = None, lost: tuple = ()):
    """run_ranks with two ranks: fn(rank, group, *args) in both; returns [result0, result1]."""
    return run_ranks(fn, *args, world_size=2, timeout=timeout, env=env, lost=lost)
