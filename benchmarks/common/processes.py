"""Starting and stopping the processes of a benchmark or test: a free TCP port, N ranks in
spawned processes (NVLink multicast off) with a hard time bound, and the stop of a whole process
group."""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common.gpu_env import MULTICAST_OFF_ENV


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(target: Callable[..., Any], rank: int, port: int, args: tuple, q: Any) -> None:
    os.environ.update(MULTICAST_OFF_ENV)  # before the rank imports anything that reads it
    target(rank, port, *args, q)


def launch_ranks(target: Callable[..., Any], args: tuple, timeout: float, lost: tuple = (),
                 world_size: int = 2) -> tuple[dict[int, Any], bool]:
    """Runs ``target(rank, port, *args, queue)`` in ``world_size`` spawned processes (one TCP port
    for their process group, one queue for their results; NVLink multicast off in all), bounded
    by ``timeout`` seconds.

    Each rank puts ``(rank, value)`` on the queue. Collecting stops when every rank has reported,
    when a rank exits with an error, or at the bound; every process still alive after a short join
    is killed. Ranks in ``lost`` are expected to die (a test kills them): collecting waits for the
    others only. Returns ``({rank: value}, timed_out)``."""
    import multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(target, r, port, args, q)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    stopped: set[int] = set()  # ranks the launcher killed itself (bound reached, or another rank failed)
    wanted = world_size - len(lost)
    deadline = time.monotonic() + timeout
    try:
        while len(results) < wanted and time.monotonic() < deadline:
            try:
                rank, value = q.get(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for r, p in enumerate(procs) if r not in lost):
                    break
                continue
            results[rank] = value
    finally:
        for r, p in enumerate(procs):
            p.join(timeout=10 if len(results) == wanted else 2)
            if p.is_alive():
                p.kill()
                p.join()
                stopped.add(r)
    for r, p in enumerate(procs):  # a rank that died by itself without a word: say how it ended
        if r not in results and r not in lost and r not in stopped and p.exitcode not in (None, 0):
            how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
            print(f"launch_ranks: rank {r} of {world_size} ended ({how}) before it reported a result",
                  file=sys.stderr, flush=True)
    return results, len(results) < wanted and time.monotonic() >= deadline


def launch_two_ranks(target: Callable[..., Any], args: tuple, timeout: float,
                     lost: tuple = ()) -> tuple[dict[int, Any], bool]:
    """launch_ranks with two ranks."""
    return launch_ranks(target, args, timeout, lost, world_size=2)


def run_ranks(worker: Callable[..., Any], args: Any, timeout: float, what: str, world_size: int = 2) -> Any:
    """A benchmark's ranks: ``worker(rank, port, args, queue)`` on GPU ``rank`` each, ``world_size``
    of them; returns what rank 0 put on the queue, or exits naming ``what`` when it failed or timed
    out."""
    results, _ = launch_ranks(worker, (args,), timeout, world_size=world_size)
    if 0 not in results:
        raise SystemExit(f"{what} failed or timed out (see worker output above)")
    return results[0]


def run_two_ranks(worker: Callable[..., Any], args: Any, timeout: float, what: str) -> Any:
    """run_ranks with two ranks."""
    return run_ranks(worker, args, timeout, what, world_size=2)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    end = time.monotonic() + max(0.0, timeout_s)
    while time.monotonic() < end:
        if not group_alive(pgid):
            return True
        time.sleep(0.2)
    return not group_alive(pgid)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop a child started with ``start_new_session=True`` and everything in its group.

    SIGTERM to the leader (graceful shutdown), then SIGTERM to the group, then
    SIGKILL to the group; every step bounded.
    """
    pgid = proc.pid  # start_new_session=True: the child leads its own group
    half = max(grace_s / 2.0, 1.0)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=half)
    if group_alive(pgid):
        signal_group(pgid, signal.SIGTERM)
        wait_group_gone(pgid, half)
    if group_alive(pgid):
        signal_group(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    wait_group_gone(pgid, 10)
