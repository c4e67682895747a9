#!/usr/bin/env python3
"""All-reduce microbenchmark on N GPUs (--world-size, 2, 4, 6 or 8; default 2): YALI against
NCCL, vLLM's custom all-reduce and pynccl (when vLLM is importable) and torch symmetric
memory's one-shot and two-shot all-reduce (multicast off), in the same N rank processes on
the same machine.

For every backend x dtype x size it records
  * graph: per-op time inside a CUDA graph of many back-to-back ops; one sample
    per replay (graph time / ops), median and p99 over the replays;
  * eager: per-call time of individually launched ops, bracketed by CUDA events
    and queued behind a GPU sleep; p50/p95/p99 over >= --samples ops. Below
    EAGER_MIN_BYTES this is host launch pacing, not GPU time (every backend sits
    on the same 35-75 us floor there), so the report shows eager times only from
    that size on; the graph time is the per-op time;
and busBW in NCCL's convention (bytes / time x 2(N-1)/N: bytes / time at 2 ranks), with the
peer-copy bandwidth GPU0->GPU1 measured in the same run as the link ceiling. Every backend's
output is checked against the fp32 sum of every rank's input once per size before it is timed.
YALI's flash and stream modes (yali-flash, yali-stream) are its 2-rank kernels; at N > 2 ranks
the backend yali runs the N-rank kernels. (Result files of 2026-11-22 also hold yali-prev, the
first kernels flash-ll and one-shot, since removed.)

Writes <out>/<name>.json (kind allreduce-microbench), a markdown
table and PNG plots, each naming the world size.

  python -m benchmarks.allreduce_bench                 # full run, 2 ranks
  python -m benchmarks.allreduce_bench --quick         # a few sizes, bf16
  python -m benchmarks.allreduce_bench --world-size 8  # 8 ranks, one GPU each
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
import traceback

from benchmarks.common.cli_args import (
    add_graph_bench_args,
    choice_list,
    place_ranks,
    positive_int,
    rank_device,
    shared_gpu_note,
    sorted_unique,
)
from benchmarks.common.gpu_env import MULTICAST_OFF_ENV
from benchmarks.common.processes import run_ranks
from benchmarks.common.results import (output_dir, rebuild_report, results_header, world_size_of,
                                       write_bench_report)
from benchmarks.common.sizes import GiB, MiB, fmt_size, parse_size
from benchmarks.common.timing import pct, sleep_cycles_per_us, time_graph

os.environ.update(MULTICAST_OFF_ENV)

ALL_BACKENDS = ["yali", "yali-flash", "yali-stream", "nccl", "vllm-custom", "vllm-pynccl", "symm-one-shot",
                "symm-two-shot"]
# YALI's 2-rank kernel modes: at N > 2 ranks the backend yali runs the N-rank kernels.
TWO_RANK_BACKENDS = ("yali-flash", "yali-stream")
DTYPE_NAMES = ["bf16", "fp16", "fp32"]
DEFAULT_SIZES = "2K,16K,64K,256K,1M,4M,16M,64M,256M,1G"
QUICK_SIZES = "2K,64K,1M,4M,64M"


def size_list(text: str) -> list[int]:
    """"2K,1M" -> [2048, 1048576]: byte counts with an optional K/M/G suffix, each a positive
    multiple of 4 (whole elements of every dtype), sorted, duplicates dropped."""
    def one(part: str) -> int:
        try:
            n = parse_size(part)
        except (ValueError, OverflowError):
            n = 0
        if n <= 0 or n % 4:
            raise argparse.ArgumentTypeError(f"{part!r} is not a size: bytes (K/M/G suffix allowed), a positive "
                                             "multiple of 4")
        return n

    return sorted_unique(text, one, f"empty list of sizes: {text!r}")


# ----------------------------------------------------------------------------- backends
def backend_refusal(name: str, world_size: int, shared: bool) -> str | None:
    """Why backend `name` is not measured in a run of `world_size` ranks (all on GPU 0 when
    `shared`), or None."""
    if name in TWO_RANK_BACKENDS and world_size != 2:
        return f"a 2-rank kernel mode of YALI; at {world_size} ranks the backend yali runs the N-rank kernels"
    if shared and not name.startswith("yali"):
        return "the ranks share GPU 0: only YALI runs there (NCCL, vLLM and symmetric memory need a GPU per rank)"
    return None


class Backends:
    """Creates each backend once per rank; .ops[name](x) launches one all-reduce
    of x on the current stream and returns the output tensor."""

    def __init__(self, rank, dev, gloo, names, max_bytes, shared=False):
        import torch
        import torch.distributed as dist

        self.ops, self.capture_ctx, self.skipped = {}, {}, {}
        self.max_bytes = {}
        for name in names:
            refusal = backend_refusal(name, dist.get_world_size(gloo), shared)
            if refusal:
                self.skipped[name] = refusal
                continue
            try:
                self._make(name, rank, dev, gloo, max_bytes, torch, dist)
            except Exception as e:  # record why a comparison backend is missing
                self.skipped[name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                if os.environ.get("BENCH_DEBUG"):
                    traceback.print_exc()

    def _make(self, name, rank, dev, gloo, max_bytes, torch, dist):
        if name.startswith("yali"):
            from yali_vllm.communicator import YaliCommunicator

            if not hasattr(self, "_yali"):
                self._yali = YaliCommunicator(gloo, dev)
            comm = self._yali
            mode = {"yali": "config", "yali-flash": "flash", "yali-stream": "stream"}[name]
            outs = {}

            def op(x, comm=comm, mode=mode, outs=outs):
                o = outs.get((x.data_ptr(), x.numel(), x.dtype))
                if o is None:
                    o = outs[(x.data_ptr(), x.numel(), x.dtype)] = torch.empty_like(x)
                return comm.all_reduce(x, out=o, mode=mode)

            self.ops[name] = op
            self.max_bytes[name] = comm.config["flash_bytes"] if name == "yali-flash" else comm.max_bytes
        elif name == "nccl":
            def op(x):
                dist.all_reduce(x)  # default group: NCCL, in place
                return x

            self.ops[name] = op
            self.max_bytes[name] = 1 << 62
        elif name == "vllm-custom":
            from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce

            ca = CustomAllreduce(group=gloo, device=dev)
            if ca.disabled:
                raise RuntimeError("vLLM CustomAllreduce disabled itself (see its log)")
            self._ca = ca
            self.ops[name] = lambda x: ca.custom_all_reduce(x)
            self.capture_ctx[name] = ca.capture
            self.max_bytes[name] = ca.max_size - 16  # it serves inputs strictly below max_size
        elif name == "vllm-pynccl":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

            pn = PyNcclCommunicator(group=gloo, device=dev)
            self.ops[name] = lambda x: pn.all_reduce(x)
            self.max_bytes[name] = 1 << 62
        elif name.startswith("symm-"):
            import torch.distributed._symmetric_memory as symm_mem

            gname = dist.group.WORLD.group_name
            bufs = {}

            def buf_for(x):
                b = bufs.get(x.dtype)
                if b is None:
                    b = symm_mem.empty(max_bytes // x.element_size(), dtype=x.dtype, device=dev)
                    symm_mem.rendezvous(b, gname)
                    bufs[x.dtype] = b
                return b[: x.numel()]

            if name == "symm-one-shot":
                def op(x):
                    b = buf_for(x)
                    b.copy_(x)
                    return torch.ops.symm_mem.one_shot_all_reduce(b, "sum", gname)
            else:
                def op(x):
                    b = buf_for(x)
                    b.copy_(x)
                    torch.ops.symm_mem.two_shot_all_reduce_(b, "sum", gname)
                    return b
            self.ops[name] = op
            self.max_bytes[name] = max_bytes
            self.capture_ctx[name] = contextlib.nullcontext
        else:
            raise ValueError(f"unknown backend {name}")


# ----------------------------------------------------------------------------- timing
# Smallest message whose eager per-call time is the GPU's time: below it every backend measured
# the same 35-75 us host-pacing floor (lab/results/current/allreduce/20261122-pdl/allreduce.md, eager table).
EAGER_MIN_BYTES = 8 << 20


def time_eager(torch, op, x, samples, cyc_per_us, host_us_per_op):
    # Queue the samples behind a GPU sleep long enough for the host to enqueue them all,
    # so each sample is the GPU time of one op, not host launch gaps.
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples + 1)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples + 1)]
    torch.cuda._sleep(int(cyc_per_us * host_us_per_op * (samples + 1) * 1.5 + 2000 * cyc_per_us))
    for s, e in zip(starts, ends):
        s.record()
        op(x)
        e.record()
    ends[-1].synchronize()
    return [s.elapsed_time(e) * 1000.0 for s, e in zip(starts[1:], ends[1:])]


def host_cost_us(torch, op, x):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        op(x)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / 20 * 1e6


def link_bandwidth_gbps(torch):
    """Copy-engine bandwidth GPU0 -> GPU1 (1 GiB, median of 5): the link ceiling."""
    a = torch.empty(GiB, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(GiB, dtype=torch.uint8, device="cuda:1")
    b.copy_(a)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    ts = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a, non_blocking=True)
        e.record()
        e.synchronize()
        torch.cuda.synchronize(1)
        ts.append(s.elapsed_time(e) / 1000.0)
    del a, b
    torch.cuda.empty_cache()
    return GiB / statistics.median(ts) / 1e9


# ----------------------------------------------------------------------------- checks
def bus_bandwidth_gbps(nbytes: int, us: float, world_size: int) -> float:
    """NCCL's busBW of an all-reduce of `nbytes` in `us` µs over `world_size` ranks:
    bytes / time x 2(N-1)/N (bytes / time at 2 ranks)."""
    return nbytes / us / 1e3 * 2 * (world_size - 1) / world_size


def max_error(backend: str, dtype_name: str, world_size: int) -> float:
    """The largest |output - reference| a backend's result may have (reference: the fp32 sum of
    every rank's input in rank order, rounded once). YALI adds exactly so at every world size:
    bitwise. Otherwise each of the N-1 additions may round in the dtype (NCCL's ring, the chunked
    sums of two-shot algorithms): per addition 0.07 for 16-bit inputs of this benchmark's
    magnitude (standard normal per rank: a few bf16 ulps), 1e-5 for fp32."""
    if backend.startswith("yali"):
        return 0.0
    return (1e-5 if dtype_name == "fp32" else 0.07) * (world_size - 1)


def rank_input(torch, n, rank, dtype, dev):
    """Rank `rank`'s input of `n` elements (standard normal, seeded by the rank)."""
    g = torch.Generator(device=dev).manual_seed(1000 + rank)
    return torch.randn(n, generator=g, device=dev, dtype=torch.float32).to(dtype)


def reference_sum(torch, n, world_size, dtype, dev):
    """The all-reduce of every rank's rank_input: summed in fp32 in rank order, rounded once."""
    acc = torch.zeros(n, device=dev, dtype=torch.float32)
    for r in range(world_size):
        acc += rank_input(torch, n, r, dtype, dev).float()
    return acc.to(dtype)


# ----------------------------------------------------------------------------- worker
def worker(rank, port, args, q):
    os.environ.update(MULTICAST_OFF_ENV)
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", rank_device(rank, args.shared_gpu))
    torch.cuda.set_device(dev)
    world = args.world_size
    if args.shared_gpu:  # NCCL refuses two ranks on one GPU; YALI's communicator needs gloo only
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    else:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=dev)
    gloo = dist.new_group(backend="gloo")
    link = link_bandwidth_gbps(torch) if rank == 0 and not args.shared_gpu else None
    dist.barrier(group=gloo)
    sizes = args.sizes
    max_bytes = max(sizes)
    be = Backends(rank, dev, gloo, args.backends, max_bytes, args.shared_gpu)
    cyc = sleep_cycles_per_us(torch)
    rows, t_start = [], time.time()
    plan_total = len(args.dtypes) * len(sizes) * len(be.ops)
    done = 0
    for dname in args.dtypes:
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dname]
        esize = torch.empty(0, dtype=dtype).element_size()
        for nbytes in sizes:
            n = nbytes // esize
            base = rank_input(torch, n, rank, dtype, dev)
            ref = reference_sum(torch, n, world, dtype, dev)
            for name, op in be.ops.items():
                done += 1
                if nbytes > be.max_bytes[name]:
                    continue
                x = base.clone()
                ok, err = True, None
                try:
                    out = op(x)
                    torch.cuda.synchronize()
                    err = float((out.float() - ref.float()).abs().max())
                    ok = err <= max_error(name, dname, world)
                    x.copy_(base)
                    n_ops = max(2, min(args.graph_ops, int(64 * MiB // nbytes)))
                    graph = time_graph(torch, op, x, n_ops, args.replays, be.capture_ctx.get(name))
                    samples = args.samples if nbytes <= 256 * MiB else max(100, args.samples // 5)
                    hcost = host_cost_us(torch, op, x)
                    eager = time_eager(torch, op, x, samples, cyc, hcost)
                except Exception as e:
                    if rank == 0:
                        print(f"[bench] {name} {dname} {fmt_size(nbytes)} failed: {e}", flush=True)
                    ok, graph, eager = False, [], []
                dist.barrier(group=gloo)
                if not graph:
                    continue
                for timing, xs in (("graph", graph), ("eager", eager)):
                    p50 = statistics.median(xs)
                    rows.append({
                        "backend": name, "dtype": dname, "bytes": nbytes, "timing": timing,
                        "us_p50": round(p50, 3), "us_p95": round(pct(xs, 95), 3), "us_p99": round(pct(xs, 99), 3),
                        "samples": len(xs), "busbw_gbps": round(bus_bandwidth_gbps(nbytes, p50, world), 2),
                        "correct": ok, "max_abs_err": err,
                    })
                if rank == 0:
                    el = time.time() - t_start
                    print(f"[bench {done}/{plan_total} {el:5.0f}s] {name:14s} {dname} {fmt_size(nbytes):>5s}: "
                          f"graph {statistics.median(graph):9.2f} us  eager p50 {statistics.median(eager):9.2f} "
                          f"p99 {pct(eager, 99):9.2f} us  "
                          f"{bus_bandwidth_gbps(nbytes, statistics.median(graph), world):7.1f} GB/s"
                          f"{'' if ok else '  WRONG RESULT'}", flush=True)
                del x
            del base, ref
            torch.cuda.empty_cache()
    q.put((rank, {"rows": rows, "link_gbps": link, "skipped": be.skipped}))
    if hasattr(be, "_yali"):
        be._yali.close()
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def write_outputs(args, res):
    import torch

    hdr = results_header("allreduce-microbench", {
        "link_gbps": round(res["link_gbps"], 1) if res["link_gbps"] else None,
        "skipped_backends": res["skipped"],
        "method": "graph: per-op = graph replay time / ops per graph, p50/p99 over replays; eager: per-call "
                  "time between CUDA events, ops queued behind a GPU sleep (host-paced below "
                  f"{EAGER_MIN_BYTES >> 20} MiB: not the GPU's time there); busbw = bytes / us_p50 x 2(N-1)/N "
                  "for N ranks (NCCL's convention)",
        "yali_config": _yali_config(),
    }, world_size=args.world_size, shared_gpu=args.shared_gpu)
    write_bench_report(args.out, args.name, hdr, res["rows"], markdown_table, plot)
    del torch


def _yali_config():
    try:
        from yali_vllm import config

        return config.kernel_config()
    except Exception as e:
        return str(e)


# The two-rank all-reduce targets (bf16): (label, timing, sizes, metric, bound, "max" = at most /
# "min" = at least); "vs_best_other" is yali's time over the fastest other backend's at that size.
TARGETS = [
    ("≤ 64 KiB: per-op ≤ 2.4 µs", "graph", [s for s in (2 << 10, 4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10)],
     "us_p50", 2.4, "max"),
    ("1 MiB: per-op ≤ 5.0 µs", "graph", [1 << 20], "us_p50", 5.0, "max"),
    ("4 MiB: per-op ≤ 13 µs", "graph", [4 << 20], "us_p50", 13.0, "max"),
    ("≥ 64 MiB: busBW ≥ 350 GB/s", "graph", [64 << 20, 256 << 20, 1 << 30], "busbw_gbps", 350.0, "min"),
    ("every size: no other backend faster (yali / best other ≤ 1)", "graph",
     [1 << k for k in range(10, 31)], "vs_best_other", 1.0, "max"),
    ("16–256 MiB eager: p99/p50 ≤ 1.15", "eager", [16 << 20, 64 << 20, 256 << 20], "p99_over_p50", 1.15, "max"),
]


def target_rows(res, dtype="bf16"):
    """Each target against this run's yali rows: (label, measured text, verdict) or None when
    the run has no row for it. The worst size of a target decides it."""
    get = {(r["bytes"], r["timing"]): r for r in res["records"] if r["backend"] == "yali" and r["dtype"] == dtype}
    best_other: dict = {}
    for r in res["records"]:
        if r["dtype"] == dtype and not r["backend"].startswith("yali") and r.get("us_p50"):
            key = (r["bytes"], r["timing"])
            best_other[key] = min(best_other.get(key, float("inf")), r["us_p50"])
    out = []
    for label, timing, sizes, metric, bound, kind in TARGETS:
        vals = []
        for s in sizes:
            r = get.get((s, timing))
            if r is None or (metric == "vs_best_other" and (s, timing) not in best_other):
                continue
            if metric == "vs_best_other":
                v = r["us_p50"] / best_other[(s, timing)]
            else:
                v = r["us_p99"] / r["us_p50"] if metric == "p99_over_p50" else r[metric]
            vals.append((s, v))
        if not vals:
            out.append((label, "not measured in this run", "–"))
            continue
        worst = max(vals, key=lambda x: x[1]) if kind == "max" else min(vals, key=lambda x: x[1])
        ok = worst[1] <= bound if kind == "max" else worst[1] >= bound
        text = ", ".join(f"{fmt_size(s)}: {v:.2f}" for s, v in vals)
        verdict = "met" if ok else f"missed by {abs(worst[1] - bound):.2f}"
        out.append((label, text, verdict))
    return out


def markdown_table(res, dtype="bf16"):
    rows = [r for r in res["records"] if r["dtype"] == dtype]
    backends = [b for b in ALL_BACKENDS if any(r["backend"] == b for r in rows)]
    sizes = sorted({r["bytes"] for r in rows})
    get = {(r["backend"], r["bytes"], r["timing"]): r for r in rows}
    world = world_size_of(res)
    out = [f"# All-reduce microbenchmark, {world} ranks ({dtype}, {res['host']}, link {res.get('link_gbps')} GB/s "
           "GPU0->GPU1)\n",
           f"{res['date']} · `{res['command']}`\n"]
    if res.get("shared_gpu"):
        out.append(f"**Not a timing: {shared_gpu_note(world)}.**\n")
    out += ["\n## Per-op time inside CUDA graphs, µs (p50 over replays)\n",
            "| size | " + " | ".join(backends) + " | yali / best other (time) |", "|---:|" + "---:|" * (len(backends) + 1)]
    for s in sizes:
        cells, others = [], []
        for b in backends:
            r = get.get((b, s, "graph"))
            cells.append(f"{r['us_p50']:.2f}" if r else "–")
            if r and not b.startswith("yali"):
                others.append(r["us_p50"])
        y = get.get(("yali", s, "graph"))
        cells.append(f"{y['us_p50'] / min(others):.2f}×" if y and others else "–")
        out.append(f"| {fmt_size(s)} | " + " | ".join(cells) + " |")
    out += [f"\n## busBW (GB/s, graph p50; NCCL's convention at {world} ranks)\n",
            "| size | " + " | ".join(backends) + " |",
            "|---:|" + "---:|" * len(backends)]
    for s in sizes:
        out.append(f"| {fmt_size(s)} | " + " | ".join(
            f"{get[(b, s, 'graph')]['busbw_gbps']:.0f}" if (b, s, "graph") in get else "–" for b in backends) + " |")
    out += [f"\n## Eager per-call time from {fmt_size(EAGER_MIN_BYTES)}, µs: p50 / p99 (p99/p50)\n",
            f"Below {fmt_size(EAGER_MIN_BYTES)} eager calls measure host launch pacing, not the device "
            "(the graph table is the per-op time); those sizes are left out.\n",
            "| size | " + " | ".join(backends) + " |", "|---:|" + "---:|" * len(backends)]
    for s in (s for s in sizes if s >= EAGER_MIN_BYTES):
        cells = []
        for b in backends:
            r = get.get((b, s, "eager"))
            cells.append(f"{r['us_p50']:.1f} / {r['us_p99']:.1f} ({r['us_p99'] / r['us_p50']:.2f})" if r else "–")
        out.append(f"| {fmt_size(s)} | " + " | ".join(cells) + " |")
    if world == 2:  # the all-reduce targets are those of 2 ranks
        out += ["\n## Targets (yali, " + dtype + ")\n", "| target | measured | verdict |", "|---|---|---|"]
        out += [f"| {a} | {b} | {c} |" for a, b, c in target_rows(res, dtype)]
    if res.get("skipped_backends"):
        out.append("\nSkipped backends: " + "; ".join(f"{k}: {v}" for k, v in res["skipped_backends"].items()))
    return "\n".join(out) + "\n"


def plot(res, out_dir, name, dtype="bf16"):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return
    rows = [r for r in res["records"] if r["dtype"] == dtype]
    backends = [b for b in ALL_BACKENDS if any(r["backend"] == b for r in rows)]
    get = {(r["backend"], r["bytes"], r["timing"]): r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for b in backends:
        pts = sorted((s, r) for (bb, s, t), r in get.items() if bb == b and t == "graph")
        if not pts:
            continue
        xs = [p[0] for p in pts]
        axes[0].plot(xs, [p[1]["busbw_gbps"] for p in pts], marker="o", label=b)
        if ("nccl", xs[0], "graph") in get:
            sp = [(s, get[("nccl", s, "graph")]["us_p50"] / r["us_p50"]) for s, r in pts if ("nccl", s, "graph") in get]
            axes[1].plot([p[0] for p in sp], [p[1] for p in sp], marker="o", label=b)
        ep = sorted((s, r) for (bb, s, t), r in get.items() if bb == b and t == "eager")
        axes[2].plot([p[0] for p in ep], [p[1]["us_p99"] / p[1]["us_p50"] for p in ep], marker="o", label=b)
    if res.get("link_gbps"):
        axes[0].axhline(res["link_gbps"], color="k", ls="--", lw=1, label="peer copy GPU0→GPU1")
    world = world_size_of(res)
    axes[0].set(title=f"busBW vs size, {world} ranks ({dtype}, CUDA graph)", ylabel="GB/s")
    axes[1].set(title=f"speedup over NCCL, {world} ranks (graph per-op time)", ylabel="× NCCL")
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[2].set(title=f"eager per-op latency p99 / p50, {world} ranks", ylabel="p99/p50")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=DEFAULT_SIZES, type=size_list,
                    help="comma list, K/M/G suffixes (default %(default)s)")
    ap.add_argument("--dtypes", default=",".join(DTYPE_NAMES),
                    type=lambda s: choice_list(s, DTYPE_NAMES, "--dtypes"))
    ap.add_argument("--backends", default=",".join(ALL_BACKENDS),
                    type=lambda s: choice_list(s, ALL_BACKENDS, "--backends"))
    add_graph_bench_args(ap, "allreduce", "ops (fewer for large sizes)", str(output_dir()))
    ap.add_argument("--samples", type=positive_int, default=1000, help="eager samples per size")
    ap.add_argument("--quick", action="store_true", help="bf16, 5 sizes, fewer samples")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.report_only:
        rebuild_report(args.report_only, markdown_table, plot)
        return
    if args.quick:
        args.sizes, args.dtypes, args.samples, args.replays = size_list(QUICK_SIZES), ["bf16"], 300, 10
    args.name = args.name or "allreduce-" + time.strftime("%Y%m%d-%H%M%S")
    args.shared_gpu = place_ranks(args.world_size)
    res = run_ranks(worker, args, args.timeout, "benchmark", world_size=args.world_size)
    write_outputs(args, res)


if __name__ == "__main__":
    main()
