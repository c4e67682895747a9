#!/usr/bin/env python3
"""MoE dispatch / combine microbenchmark on N GPUs (--world-size 2, 4, 6 or 8): YALI's expert-parallel
kernels (csrc/core/yali/ep/ep.cuh) against vLLM's default all-to-all manager (AgRsAll2AllManager), in
the same N rank processes on the same machine.

One MoE layer's communication at data + expert parallelism, T tokens per rank:
  * dispatch: every rank's hidden states [T, H] (bf16), top-k weights [T, k] (fp32) and ids [T, k]
    (int32) gathered on every rank;
  * combine: the expert outputs [N T, H] (bf16) reduce-scattered back to the tokens' ranks.
Backends:
  * yali: YaliCommunicator.ep_dispatch / ep_combine;
  * vllm-agrs: what vLLM's CudaCommunicator.all_gatherv / reduce_scatterv run for that manager on
    pynccl (NCCL symmetric memory off, vLLM's default): the three gathers in one NCCL group
    (all_gather when the counts are equal, all_gatherv otherwise), then reduce_scatter.
Every backend's outputs are checked before they are timed: the dispatch bitwise against the
inputs, the combine against the fp32 sum (YALI bitwise against the rank-order sum). Times are per
op inside a CUDA graph of many back-to-back layers (median and p99 over replays) for the
dispatch alone, the combine alone and the layer (dispatch + combine).

Writes <out>/<name>.json (kind moe-dispatch-combine: one row per backend, shape and token count
with dispatch_us_p50, combine_us_p50 and total_us_p50, the layer), a markdown table and a PNG plot.

  python -m benchmarks.moe_bench                     # 2 ranks, Qwen3-30B-A3B's shape and more
  python -m benchmarks.moe_bench --quick             # H 2048, top-8, 1-128 tokens
  python -m benchmarks.moe_bench --world-size 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback

from benchmarks.common.cli_args import add_graph_bench_args, choice_list, place_ranks, positive_int_list, rank_device
from benchmarks.common.gpu_env import MULTICAST_OFF_ENV
from benchmarks.common.processes import run_ranks
from benchmarks.common.results import (output_dir, rebuild_report, results_header, world_size_of,
                                       write_bench_report)
from benchmarks.common.timing import pct, time_graph

os.environ.update(MULTICAST_OFF_ENV)

BACKENDS = ["yali", "vllm-agrs"]
# (hidden, top-k): Qwen3-30B-A3B / DeepSeek-V2-Lite, gpt-oss, Mixtral, DeepSeek-V3.
DEFAULT_SHAPES = "2048x8,2880x4,4096x2,7168x8"
DEFAULT_TOKENS = "1,2,4,8,16,32,64,128,256,512"
QUICK_SHAPES, QUICK_TOKENS = "2048x8", "1,8,64,128"
OPS = ("dispatch", "combine", "layer")


def shape_list(text: str) -> list[tuple[int, int]]:
    """'2048x8,4096x2' -> [(2048, 8), (4096, 2)]: hidden sizes and top-k."""
    out = []
    for item in text.split(","):
        try:
            h, k = (int(v) for v in item.strip().lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not HIDDENxTOPK (e.g. 2048x8)") from None
        if h <= 0 or k <= 0 or h % 8:
            raise argparse.ArgumentTypeError(f"{item!r}: hidden must be a positive multiple of 8, top-k positive")
        out.append((h, k))
    return out


class Layer:
    """One MoE layer's inputs on this rank and the two backends' ops on them."""

    def __init__(self, torch, rank, world, tokens, hidden, topk, dev):
        g = torch.Generator(device=dev).manual_seed(1000 * tokens + 10 * rank + topk)
        self.counts = [tokens] * world
        self.h = torch.randn(tokens, hidden, generator=g, device=dev).to(torch.bfloat16)
        self.w = torch.rand(tokens, topk, generator=g, device=dev)
        self.ids = torch.randint(0, 128, (tokens, topk), generator=g, device=dev, dtype=torch.int32)
        self.x = torch.randn(world * tokens, hidden, generator=g, device=dev).to(torch.bfloat16)


def make_ops(name, torch, gloo, dev, world):
    """{op name: f(layer) -> outputs} for backend `name`, and a close()."""
    if name == "yali":
        from yali_vllm import config
        from yali_vllm.communicator import YaliCommunicator

        yc = YaliCommunicator(gloo, dev, ep_slot_bytes=config.ep_slot_bytes())

        def dispatch(L):
            return yc.ep_dispatch([L.h, L.w, L.ids], L.counts)

        def combine(L):
            return [yc.ep_combine(L.x, L.counts)]

        def serves(L):
            return yc.ep_serves_dispatch([L.h, L.w, L.ids], L.counts) and yc.ep_serves_combine(L.x, L.counts)

        return {"dispatch": dispatch, "combine": combine, "serves": serves}, yc.close
    if name == "vllm-agrs":
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        pn = PyNcclCommunicator(group=gloo, device=dev)

        def dispatch(L):
            outs = [torch.empty((sum(L.counts), *t.shape[1:]), dtype=t.dtype, device=dev) for t in (L.h, L.w, L.ids)]
            pn.group_start()
            for o, t in zip(outs, (L.h, L.w, L.ids)):
                pn.all_gather(o, t)  # equal counts: vLLM's all_gatherv passes sizes=None
            pn.group_end()
            return outs

        def combine(L):
            out = torch.empty((L.counts[0], L.x.shape[1]), dtype=L.x.dtype, device=dev)
            pn.reduce_scatter(out, L.x)
            return [out]

        return {"dispatch": dispatch, "combine": combine, "serves": lambda L: True}, lambda: None
    raise ValueError(f"unknown backend {name}")


def check(torch, L, got_dispatch, got_combine, rank, world, tokens, hidden, topk, dev, exact_combine):
    """(ok, max combine error) of one backend's outputs for layer L."""
    mine = [Layer(torch, r, world, tokens, hidden, topk, dev) for r in range(world)]
    ok = all(torch.equal(o, torch.cat(parts)) for o, parts in
             zip(got_dispatch, ([m.h for m in mine], [m.w for m in mine], [m.ids for m in mine])))
    acc = None
    for m in mine:
        part = m.x[rank * tokens:(rank + 1) * tokens].float()
        acc = part if acc is None else acc + part
    want = acc.to(torch.bfloat16)
    err = float((got_combine[0].float() - acc).abs().max()) if tokens else 0.0
    if exact_combine:
        ok = ok and torch.equal(got_combine[0], want)
    else:  # NCCL's ring rounds to bf16 at each of its N - 1 steps
        ok = ok and err <= (world - 1) * 2 ** -8 * float(acc.abs().max()) + 1e-6
    return ok, err


def slot_bytes_for(shapes, tokens) -> int:
    """The EP slot that serves every point of the sweep: the largest rank message (bf16 hidden, fp32
    weights and int32 ids, each padded to 16 bytes), rounded up to 4 KiB, at least the default."""
    from yali_vllm import config

    def pad(n):
        return (n + 15) // 16 * 16

    largest = max(pad(t * h * 2) + 2 * pad(t * k * 4) for h, k in shapes for t in tokens)
    return min(max(config.EP_SLOT_DEFAULT, (largest + 4095) // 4096 * 4096), config.EP_SLOT_RANGE[1])


def worker(rank, port, args, q):
    os.environ.update(MULTICAST_OFF_ENV)
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", rank_device(rank, args.shared_gpu))
    torch.cuda.set_device(dev)
    world = args.world_size
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    backends, skipped, closers = {}, {}, []
    for name in args.backends:
        if name == "vllm-agrs" and args.shared_gpu:
            skipped[name] = "NCCL refuses two ranks on one GPU"
            continue
        try:
            ops, close = make_ops(name, torch, gloo, dev, world)
            backends[name] = ops
            closers.append(close)
        except Exception as e:
            skipped[name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            if os.environ.get("BENCH_DEBUG"):
                traceback.print_exc()
    rows, t0 = [], time.time()
    plan = len(args.shapes) * len(args.tokens) * len(backends)
    done = 0
    for hidden, topk in args.shapes:
        for tokens in args.tokens:
            L = Layer(torch, rank, world, tokens, hidden, topk, dev)
            for name, ops in backends.items():
                done += 1
                if not ops["serves"](L):  # the same answer on every rank (counts, shapes, slot size)
                    if rank == 0:
                        print(f"[moe] {name} H={hidden} k={topk} T={tokens}: not served (YALI_EP_SLOT_BYTES)", flush=True)
                    continue
                try:
                    d, c = ops["dispatch"](L), ops["combine"](L)
                    torch.cuda.synchronize()
                    ok, err = check(torch, L, d, c, rank, world, tokens, hidden, topk, dev, name == "yali")
                    failed = None
                except Exception as e:  # noqa: BLE001 - every rank learns of it below
                    ok, err, failed = False, None, f"{type(e).__name__}: {e}"
                # Time only where every rank computed its outputs: a rank that failed alone would
                # leave the others in an NCCL collective that has no watchdog.
                everyone: list = [None] * world
                dist.all_gather_object(everyone, failed, group=gloo)
                if any(everyone):
                    if rank == 0:
                        print(f"[moe] {name} H={hidden} k={topk} T={tokens} failed: {everyone}", flush=True)
                    continue
                try:
                    layer = (lambda _x, ops=ops: (ops["dispatch"](L), ops["combine"](L)))
                    times = {
                        "dispatch": time_graph(torch, lambda _x, ops=ops: ops["dispatch"](L), None, args.graph_ops,
                                               args.replays, None),
                        "combine": time_graph(torch, lambda _x, ops=ops: ops["combine"](L), None, args.graph_ops,
                                              args.replays, None),
                        "layer": time_graph(torch, layer, None, args.graph_ops, args.replays, None),
                    }
                except Exception as e:
                    if rank == 0:
                        print(f"[moe] {name} H={hidden} k={topk} T={tokens} failed: {e}", flush=True)
                    ok, err, times = False, None, {}
                dist.barrier(group=gloo)
                if times:
                    rows.append(schema_row(name, hidden, topk, tokens, times, ok, err))
                if rank == 0 and times:
                    print(f"[moe {done}/{plan} {time.time() - t0:5.0f}s] {name:10s} H={hidden} k={topk} T={tokens:4d}: "
                          + "  ".join(f"{op} {statistics.median(times[op]):8.2f} us" for op in OPS)
                          + ("" if ok else "  WRONG RESULT"), flush=True)
    q.put((rank, {"rows": rows, "skipped": skipped}))
    for close in closers:
        close()
    dist.barrier(group=gloo)
    dist.destroy_process_group()


# The schema's field of each timed op (results-schema.md, moe-dispatch-combine): the layer is the total.
FIELDS = {"dispatch": "dispatch", "combine": "combine", "layer": "total"}


def schema_row(backend: str, hidden: int, topk: int, tokens: int, times: dict, exact: bool, err) -> dict:
    """One moe-dispatch-combine row: every op's median and p99 (µs) over the replays."""
    row = {"backend": backend, "dtype": "bf16", "hidden": hidden, "topk": topk, "tokens": tokens}
    for op, xs in times.items():
        row[f"{FIELDS[op]}_us_p50"] = round(statistics.median(xs), 3)
        row[f"{FIELDS[op]}_us_p99"] = round(pct(xs, 99), 3)
    row.update(samples=min(len(xs) for xs in times.values()), exact=bool(exact), combine_max_abs_err=err)
    return row


def markdown_table(res) -> str:
    world = world_size_of(res)
    get = {(r["backend"], r["hidden"], r["topk"], r["tokens"]): r for r in res["records"]}
    keys = sorted({(r["hidden"], r["topk"], r["tokens"]) for r in res["records"]})
    lines = [f"# MoE dispatch + combine, {world} ranks (bf16 hidden, per op in a CUDA graph, median µs)", ""]
    if res.get("shared_gpu"):
        lines += ["**The ranks shared one GPU: the outputs were checked, the timings are not valid.**", ""]
    lines += ["| H | top-k | tokens/rank | yali dispatch | yali combine | yali layer | vLLM AgRs layer | yali / AgRs | "
              "correct |", "|---|---|---|---|---|---|---|---|---|"]
    for h, k, t in keys:
        y, a = get.get(("yali", h, k, t)), get.get(("vllm-agrs", h, k, t))
        ratio = f"{y['total_us_p50'] / a['total_us_p50']:.2f}" if y and a else "–"
        ok = all(r["exact"] for r in (y, a) if r)
        cell = lambda r, f: f"{r[f]:.2f}" if r else "–"  # noqa: E731
        lines.append(f"| {h} | {k} | {t} | {cell(y, 'dispatch_us_p50')} | {cell(y, 'combine_us_p50')} | "
                     f"{cell(y, 'total_us_p50')} | {cell(a, 'total_us_p50')} | {ratio} | {'yes' if ok else 'NO'} |")
    if res.get("skipped_backends"):
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in res["skipped_backends"].items())]
    return "\n".join(lines) + "\n"


def plot(res, out_dir, name):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    shapes = sorted({(r["hidden"], r["topk"]) for r in res["records"]})
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, (h, k) in zip(axes[0], shapes):
        for b in BACKENDS:
            pts = sorted((r["tokens"], r["total_us_p50"]) for r in res["records"]
                         if r["backend"] == b and (r["hidden"], r["topk"]) == (h, k))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{b} dispatch + combine")
        ax.set(title=f"H={h}, top-{k}, {world_size_of(res)} ranks", xlabel="tokens per rank", ylabel="µs per layer")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def write_outputs(args, res):
    hdr = results_header("moe-dispatch-combine", {
        "skipped_backends": res["skipped"],
        "method": "per op = CUDA graph replay time / ops per graph, median and p99 over replays; dispatch = "
                  "hidden bf16 [T,H] + top-k weights fp32 [T,k] + ids int32 [T,k] gathered, combine = bf16 "
                  "[N T,H] reduce-scattered, layer = both; equal token counts per rank",
        "yali_ep_slot_bytes": _slot_bytes(),
        "model_shapes": [{"hidden": h, "topk": k} for h, k in args.shapes],
    }, world_size=args.world_size, shared_gpu=args.shared_gpu)
    write_bench_report(args.out, args.name, hdr, res["rows"], markdown_table, plot)


def _slot_bytes():
    from yali_vllm import config

    return config.ep_slot_bytes()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, type=shape_list,
                    help="HIDDENxTOPK list (default %(default)s)")
    ap.add_argument("--tokens", default=DEFAULT_TOKENS, type=lambda s: positive_int_list(s, "--tokens"),
                    help="tokens per rank (default %(default)s)")
    ap.add_argument("--backends", default=",".join(BACKENDS), type=lambda s: choice_list(s, BACKENDS, "--backends"))
    add_graph_bench_args(ap, "moe", "layers (or ops)", str(output_dir()))
    ap.add_argument("--quick", action="store_true", help=f"--shapes {QUICK_SHAPES} --tokens {QUICK_TOKENS}")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.report_only:
        rebuild_report(args.report_only, markdown_table, plot)
        return
    if args.quick:
        args.shapes, args.tokens = shape_list(QUICK_SHAPES), positive_int_list(QUICK_TOKENS, "--tokens")
    args.name = args.name or "moe-" + time.strftime("%Y%m%d-%H%M%S")
    args.shared_gpu = place_ranks(args.world_size)
    # Every point of the sweep is served (the serving default, 2 MiB, leaves the largest to vLLM);
    # YALI_EP_SLOT_BYTES set by the caller wins. The ranks inherit the environment.
    os.environ.setdefault("YALI_EP_SLOT_BYTES", str(slot_bytes_for(args.shapes, args.tokens)))
    res = run_ranks(worker, args, args.timeout, "benchmark", world_size=args.world_size)
    write_outputs(args, res)


if __name__ == "__main__":
    main()
