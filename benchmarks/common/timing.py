"""CUDA-graph capture and timing shared by the benchmarks: one graph of many back-to-back calls,
per-call time from timed replays, percentiles. ``torch`` is passed in (imported by the GPU worker)."""
from __future__ import annotations

import contextlib
import math


def pct(xs, q):
    """The q-th percentile (0-100) of xs, linearly interpolated."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def sleep_cycles_per_us(torch):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    s.record()
    torch.cuda._sleep(20_000_000)
    e.record()
    e.synchronize()
    return 20_000_000 / (s.elapsed_time(e) * 1000.0)


def capture_graph(torch, op, x, n_ops, capture_ctx, warmups=3):
    """A CUDA graph of op(x) n_ops times, captured after `warmups` eager calls on a side stream
    (inside capture_ctx, e.g. vLLM's custom all-reduce registration)."""
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for _ in range(warmups):
            op(x)
    cur.wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with (capture_ctx or contextlib.nullcontext)(), torch.cuda.graph(g):
        for _ in range(n_ops):
            op(x)
    torch.cuda.synchronize()
    return g


def replay_per_op(torch, g, n_ops, replays):
    """Per-op µs of `replays` back-to-back replays of g (n_ops ops each), after one untimed replay;
    the first timed replay is dropped."""
    g.replay()
    torch.cuda.synchronize()
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(replays + 2)]
    evs[0].record()
    for i in range(replays + 1):  # back-to-back replays keep both GPUs in step
        g.replay()
        evs[i + 1].record()
    evs[-1].synchronize()
    return [evs[i].elapsed_time(evs[i + 1]) * 1000.0 / n_ops for i in range(1, replays + 1)]  # drop the first


def time_graph(torch, op, x, n_ops, replays, capture_ctx):
    g = capture_graph(torch, op, x, n_ops, capture_ctx)
    per_op = replay_per_op(torch, g, n_ops, replays)
    del g
    return per_op
