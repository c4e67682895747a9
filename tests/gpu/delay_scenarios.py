"""Calls whose ranks arrive at different times (the buffer-reuse and parity arguments under stress):
one CUDA graph of CALLS_PER_GRAPH calls cycling through the size boundaries of every kernel, each
preceded on each rank by a GPU sleep of its own, replayed many times, every result checked on the
device; and the same graph with one rank killed in the middle.

Inputs change with every run of the graph and every call (a stale word of any of the SHIFTS - 1
calls before would be a wrong value, not a lucky equal one) and stay small integers, so every sum
is exact in bf16: rank r's input to call j of the graph's run i is (e % 7) + r + 1 + (i + j) % SHIFTS
at element e, whose sum over N ranks is N * (e % 7) + N (N + 1) / 2 + N * ((i + j) % SHIFTS), at
most 164 at 8 ranks (bf16 holds every integer up to 256)."""
from __future__ import annotations

import os
import signal
import time

import torch

from yali_vllm.communicator import YaliCommunicator

from .ranks_scenarios import differing, first_two_launch_rows, kernel_spans, probe_top, serve_top, small_ints, table_of
from .reliability import _record_then_error
from .scenarios import _device, capture_after_warmup, digest

CALLS_PER_GRAPH = 64
MAX_SLEEP_CYCLES = 20_000  # about 10 us at the H100's clock: longer than most calls it delays
LATE_RANK_CYCLES = 20_000  # "last-rank": the last rank sleeps this long before every call
FUSED_HIDDEN = 8192
SHIFTS = 11  # the period of the per-call shift of the inputs
_TRAPPED: list = []  # what a trapped rank keeps until its process ends (delayed_calls_rank_killed)
IN_FLIGHT = 2  # replays a survivor of delayed_calls_rank_killed has queued at most


def boundary_counts(world_size: int) -> list[int]:
    """bf16 element counts: 1 KiB, 16 bytes below and above every switch between two kernels of
    the size table (flash-push / stream at two ranks, one-shot / two-shot at N), and serve_top - 2
    bytes (an odd tail)."""
    counts = [512]
    spans = kernel_spans(table_of(world_size), top=probe_top(world_size))
    for (_, _, hi), (_, lo_next, _) in zip(spans, spans[1:]):
        if lo_next == hi + 1:  # two served kernels meet here
            counts += [hi // 2 - 8, hi // 2 + 8]
    counts.append(serve_top(world_size) // 2 - 1)
    return counts


def call_specs(comm) -> list[tuple]:
    """("all_reduce", count) and ("fused", rows) calls: the boundary counts, then the fused op at
    one row of FUSED_HIDDEN, at its one-launch limit and one row above it (when the table has a
    two-launch size)."""
    specs = [("all_reduce", n) for n in boundary_counts(comm.world_size)]
    specs.append(("fused", 1))
    two = first_two_launch_rows(comm, FUSED_HIDDEN, torch.bfloat16)
    if two is not None:
        specs += [("fused", two - 1), ("fused", two)]
    return specs


def sleeps_of(mode: str, rank: int, world_size: int, seed: int) -> list[int]:
    """The GPU sleep (cycles) of this rank before each call of the graph: "random", drawn per
    (rank, call); "last-rank", LATE_RANK_CYCLES on the last rank only (rank 0 always a call ahead)."""
    if mode == "random":
        g = torch.Generator().manual_seed(seed * 16 + rank)
        return torch.randint(0, MAX_SLEEP_CYCLES, (CALLS_PER_GRAPH,), generator=g).tolist()
    if mode == "last-rank":
        return [LATE_RANK_CYCLES if rank == world_size - 1 else 0] * CALLS_PER_GRAPH
    raise ValueError(f"mode must be 'random' or 'last-rank', got {mode!r}")


def _graph(comm, rank: int, mode: str, seed: int):
    """The graph, its replay counter and wrong-element count, and the fused outputs (for digests)."""
    dev, n_ranks = _device(), comm.world_size
    bf16 = torch.bfloat16
    specs = call_specs(comm)
    bufs = []
    for kind, size in specs:
        shape = (size,) if kind == "all_reduce" else (size, FUSED_HIDDEN)
        pattern = small_ints(shape, dev)
        bufs.append({"kind": kind, "pattern": pattern, "x": torch.empty_like(pattern), "out": torch.empty_like(pattern),
                     "norm": torch.empty_like(pattern) if kind == "fused" else None})
    weight = torch.ones(FUSED_HIDDEN, dtype=bf16, device=dev)
    step = torch.zeros((), dtype=torch.int64, device=dev)
    wrong = torch.zeros((), dtype=torch.int64, device=dev)
    sleeps = sleeps_of(mode, rank, n_ranks, seed)
    base = float(n_ranks * (n_ranks + 1) // 2)

    def body():
        step.add_(1)
        for j in range(CALLS_PER_GRAPH):
            b = bufs[j % len(bufs)]
            shift = ((step + j) % SHIFTS).to(bf16)
            b["x"].copy_(b["pattern"]).add_(float(rank + 1)).add_(shift)
            expected = b["pattern"] * n_ranks + base + shift * n_ranks
            if sleeps[j]:
                torch.cuda._sleep(sleeps[j])
            if b["kind"] == "all_reduce":
                comm.all_reduce(b["x"], out=b["out"])
            else:  # residual_out is the all-reduce itself
                comm.fused_allreduce_rmsnorm(b["x"], None, weight, 1e-6, norm_out=b["norm"], residual_out=b["out"])
            wrong.add_((b["out"] != expected).sum())

    graph = capture_after_warmup(body, dev)
    torch.cuda.synchronize(dev)
    wrong.zero_()
    return graph, wrong, bufs, specs


def delayed_calls(rank, group, mode: str, replays: int, seed: int) -> dict:
    """`replays` replays of the delayed graph; returns the wrong elements, the calls the GPU ran,
    whether the fused outputs of the last replay differ between ranks, and any error."""
    comm = YaliCommunicator(group, _device())
    graph, wrong, bufs, specs = _graph(comm, rank, mode, seed)
    calls_before = comm.device_calls()
    t0 = time.time()
    error = None
    try:
        for _ in range(replays):
            graph.replay()
        comm.synchronize()
    except Exception as e:  # noqa: BLE001 - a trap: the abort record says why
        error = f"{type(e).__name__}: {e}"
    out = {"error": error, "abort": comm.abort_message(), "elapsed_s": time.time() - t0,
           "calls_per_graph": CALLS_PER_GRAPH, "replays": replays, "specs": specs}
    if error is None:
        fused = {f"fused {i}": digest(b["norm"]) for i, b in enumerate(bufs) if b["kind"] == "fused"}
        out.update(wrong=int(wrong.item()), device_calls=comm.device_calls() - calls_before,
                   differing=differing(group, fused))
    del graph
    return out


def _wait_host_only(event, comm: YaliCommunicator, deadline: float) -> None:
    """Polls `event` until its work is done (query() raises once the context trapped), without
    blocking in the driver; stops at YALI's abort record, which a trapped context may not report
    through its events soon (seen with ranks sharing one GPU: reliability._record_then_error);
    TimeoutError at `deadline` (time.time())."""
    while not event.query():
        if comm.abort_message():
            raise RuntimeError("the abort record appeared with replays queued")
        if time.time() > deadline:
            raise TimeoutError("replays still queued at the deadline")
        time.sleep(0.001)


def delayed_calls_rank_killed(rank, group, replays_before_kill: int, wait_s: float, seed: int) -> dict:
    """The random-delay graph on every rank; the last rank kills itself (SIGKILL) after
    `replays_before_kill` replays, with its GPU work in flight. Every other rank replays on, at most
    IN_FLIGHT replays ahead of its GPU as a server's host runs a step or two ahead, and must end in
    YALI's abort record and a YaliError within YALI_TIMEOUT_S plus a margin, naming a rank it
    waited for. (A host that keeps launching until the launch queue is full is blocked inside
    cuGraphLaunch when the context traps, and driver 580.159.04 was seen to end such a process by
    SIGSEGV inside libcuda, at 2 and 4 ranks: current/gpu-tests/20261128-tp4-killed-native-stack.)"""
    comm = YaliCommunicator(group, _device())
    graph, wrong, bufs, _ = _graph(comm, rank, "random", seed)
    victim = comm.world_size - 1
    t0 = time.time()
    if rank == victim:
        for _ in range(replays_before_kill):
            graph.replay()
        os.kill(os.getpid(), signal.SIGKILL)
    launch_error = None
    in_flight: list = []
    try:
        for _ in range(2 * replays_before_kill):
            if len(in_flight) == IN_FLIGHT:
                _wait_host_only(in_flight.pop(0), comm, t0 + wait_s)
            graph.replay()
            in_flight.append(torch.cuda.Event())
            in_flight[-1].record()
    except Exception as e:  # noqa: BLE001 - the trap ends the replays: the record says why
        launch_error = f"{type(e).__name__}: {e}"
    result = {"victim": victim, "launch_error": launch_error, **_record_then_error(comm, t0, wait_s)}
    # The context trapped: this process ends without tearing the communicator, the graph or its
    # tensors down (YaliError: the process must restart), so nothing frees their memory while the
    # synchronize of _record_then_error may still be waiting in its thread.
    _TRAPPED.extend((comm, graph, wrong, bufs))
    return result
