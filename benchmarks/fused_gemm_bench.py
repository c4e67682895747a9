#!/usr/bin/env python3
"""The fused all-reduce + RMSNorm followed by the GEMM that reads its output, as in a decoder
layer: YALI's fused op (with and without prefetching that GEMM's weight into L2) against vLLM's
FlashInfer fusion (trtllm backend), in the same process pair on the same machine.

Why: in decode the fused op is latency-bound (one NVLink trip) and leaves HBM idle, while the
GEMM after it (QKV after the input norm, gate_up after the post-attention norm) is HBM-bound.
YALI's kernel can ask L2 for the first bytes of that GEMM's weight before it waits for the peer
(YALI_FUSED_PREFETCH_BYTES; vLLM's fusion pass hands it the weight), so the GEMM finds them
there. What matters is the pair's time, so that is what is measured.

One op = fused op (x [tokens, hidden] summed over both ranks, + residual, RMSNorm) then
norm_out @ W.t() with W [gemm_n, hidden] (bf16), as F.linear runs it (cuBLAS). W rotates over
enough distinct weights (--weights-mib in all) that none is still in L2 from its last use.
--gemm-n 0 measures the fused op alone while it prefetches a weight no GEMM reads (the cost of
issuing the prefetch). Rows:
  gemm-only           the GEMM alone (no communication): the floor
  flashinfer-trtllm   FlashInfer's fused op + GEMM (vLLM's default at TP=2)
  yali-fused          YALI's fused op + GEMM, prefetch_bytes = each of --prefetch-mib
Every fused output is checked against the fp32 reference once per size (with its prefetch) before
timing; then per-op time inside a CUDA graph of --graph-ops ops, p50/p99 over --replays replays.

Writes <out>/<name>.json (kind fused-allreduce-rmsnorm, rows with gemm_n and prefetch_bytes),
<name>.md and <name>.png.

  python benchmarks/fused_gemm_bench.py                      # 70B TP=2 shapes: QKV 5120, gate_up 28672
  python benchmarks/fused_gemm_bench.py --gemm-n 5120 --tokens 1,8 --prefetch-mib 0,16
  python benchmarks/fused_gemm_bench.py --report-only benchmarks/results/fused-gemm-20261122.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import MULTICAST_OFF_ENV, results_header, write_json_and_markdown  # noqa: E402
from allreduce_bench import pct, run_two_ranks, time_graph  # noqa: E402
from fused_bench import (  # noqa: E402
    Backends,
    _fmt_err,
    _init_dist,
    _rand,
    check_result,
    parse_int_list,
    reference,
)

os.environ.update(MULTICAST_OFF_ENV)

KIND = "fused-allreduce-rmsnorm"
MiB = 1 << 20
# Llama-3-70B at TP=2: QKV (64 + 2 x 8 heads x 128) / 2 = 5120 rows, gate_up 2 x 28672 / 2 = 28672.
DEFAULT_GEMM_N = "5120,28672"
DEFAULT_TOKENS = "1,2,4,8,16,32,64,128"


def parse_nonneg_list(text: str, what: str) -> list[int]:
    """"0,4,16" -> [0, 4, 16]: non-negative integers, sorted, duplicates dropped."""
    out = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: {part!r} is not an integer") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{what}: {v} is negative")
        out.add(v)
    if not out:
        raise argparse.ArgumentTypeError(f"{what}: empty list")
    return sorted(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=8192, help="hidden size = GEMM K (default %(default)s)")
    ap.add_argument("--gemm-n", default=DEFAULT_GEMM_N, type=lambda s: parse_nonneg_list(s, "--gemm-n"),
                    help="GEMM output features after the norm, comma list; 0 = no GEMM (default %(default)s)")
    ap.add_argument("--tokens", default=DEFAULT_TOKENS, type=lambda s: parse_int_list(s, "--tokens"),
                    help="token counts, comma list (default %(default)s)")
    ap.add_argument("--prefetch-mib", default="0,8,16,32", type=lambda s: parse_nonneg_list(s, "--prefetch-mib"),
                    help="YALI prefetch sizes to compare, MiB, comma list; 0 = off (default %(default)s)")
    ap.add_argument("--weights-mib", type=int, default=320,
                    help="distinct GEMM weights of at least this many MiB in all, rotated (default %(default)s)")
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument("--graph-ops", type=int, default=20, help="fused op + GEMM pairs per CUDA graph")
    ap.add_argument("--replays", type=int, default=100, help="timed graph replays = samples")
    ap.add_argument("--no-flashinfer", action="store_true", help="YALI and the GEMM alone")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="stop starting measurements after this many seconds (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=None, help="kill the ranks after this (default budget + 150)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--name", default=None, help="result file stem (default fused-gemm-<date>)")
    ap.add_argument("--report-only", metavar="JSON", help="rebuild the table and plot from a result file")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.name is None:
        args.name = "fused-gemm-" + time.strftime("%Y%m%d")
    if args.timeout is None:
        args.timeout = args.budget_s + 150
    if args.hidden <= 0 or args.hidden % 8:
        raise SystemExit(f"--hidden {args.hidden}: must be a positive multiple of 8")
    return args


# ----------------------------------------------------------------------------- report
def _key(r: dict) -> tuple:
    return (r["gemm_n"], r["tokens"])


def summarize(records: list[dict]) -> list[dict]:
    """Per (gemm_n, tokens): the GEMM alone, FlashInfer + GEMM, YALI + GEMM per prefetch size,
    YALI's best prefetch and its ratio to FlashInfer and to YALI without prefetch."""
    by = {}
    for r in records:
        if r.get("correct") is False:
            continue
        by.setdefault(_key(r), []).append(r)
    rows = []
    for (n, t), rs in sorted(by.items()):
        row = {"gemm_n": n, "tokens": t, "gemm_only_us": None, "flashinfer_us": None, "yali_us": {}}
        for r in rs:
            if r["backend"] == "gemm-only":
                row["gemm_only_us"] = r["us_p50"]
            elif r["backend"] == "flashinfer-trtllm":
                row["flashinfer_us"] = r["us_p50"]
            elif r["backend"] == "yali-fused":
                row["yali_us"][r["prefetch_bytes"]] = r["us_p50"]
        if row["yali_us"]:
            best = min(row["yali_us"], key=row["yali_us"].get)
            row["best_prefetch_bytes"] = best
            row["best_yali_us"] = row["yali_us"][best]
            off = row["yali_us"].get(0)
            row["best_vs_no_prefetch"] = round(row["best_yali_us"] / off, 3) if off else None
            fi = row["flashinfer_us"]
            row["best_vs_flashinfer"] = round(row["best_yali_us"] / fi, 3) if fi else None
            row["no_prefetch_vs_flashinfer"] = round(off / fi, 3) if (off and fi) else None
        rows.append(row)
    return rows


def markdown_table(res: dict) -> str:
    rows = summarize(res["records"])
    sizes = sorted({r["prefetch_bytes"] for r in res["records"] if r["backend"] == "yali-fused"})
    lines = [
        f"# Fused all-reduce + RMSNorm followed by its GEMM ({res.get('host', '?')})",
        "",
        f"{res.get('date', '')} · `{res.get('command', '')}`",
        "",
        "Per-op µs (p50; one op = the fused op then `norm_out @ W.t()`, W [gemm_n, hidden] bf16, rotating "
        "over weights that are not in L2), hidden " + str(res.get("hidden")) + ", bf16. `pf` = bytes of the "
        "GEMM's weight YALI's kernel asks L2 for. gemm_n 0: the fused op alone, prefetching a weight no GEMM "
        "reads.",
        "",
        "| gemm_n | tokens | GEMM alone | FlashInfer + GEMM | " + " | ".join(
            f"YALI pf {s // MiB} MiB" for s in sizes) + " | best YALI / FlashInfer | best / YALI pf 0 |",
        "|---:|---:|---:|---:|" + "---:|" * len(sizes) + "---:|---:|",
    ]

    def f(v):
        return "–" if v is None else f"{v:.2f}"

    for r in rows:
        lines.append(
            f"| {r['gemm_n']} | {r['tokens']} | {f(r['gemm_only_us'])} | {f(r['flashinfer_us'])} | "
            + " | ".join(f(r["yali_us"].get(s)) for s in sizes)
            + f" | {f(r.get('best_vs_flashinfer'))} | {f(r.get('best_vs_no_prefetch'))} |")
    wrong = [r for r in res["records"] if r.get("correct") is False]
    if wrong:
        lines += ["", f"**{len(wrong)} rows with a WRONG result** (left out of the table): "
                  + ", ".join(f"{r['backend']} n{r['gemm_n']} t{r['tokens']} pf{r.get('prefetch_bytes')}"
                              for r in wrong)]
    for s in res.get("skipped", [])[:20]:
        lines.append(f"- skipped {s.get('backend')} n{s.get('gemm_n')} t{s.get('tokens')}: {s.get('reason')}")
    return "\n".join(lines) + "\n"


def plot(res: dict, out_dir: str, name: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    ns = sorted({r["gemm_n"] for r in res["records"]})
    if not ns:
        return None
    fig, axes = plt.subplots(1, len(ns), figsize=(5.5 * len(ns), 4), squeeze=False)
    for ax, n in zip(axes[0], ns):
        series = {}
        for r in res["records"]:
            if r["gemm_n"] != n or r.get("correct") is False:
                continue
            label = r["backend"] if r["backend"] != "yali-fused" else f"yali pf {r['prefetch_bytes'] // MiB} MiB"
            series.setdefault(label, []).append((r["tokens"], r["us_p50"]))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("µs per fused op + GEMM (p50)")
        ax.set_title(f"gemm_n {n}" if n else "fused op alone (prefetching)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, name + ".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(args, res: dict) -> str:
    hdr = results_header(KIND, {
        "op": "fused all-reduce + RMSNorm, then the GEMM reading its output",
        "hidden": args.hidden, "dtype": "bf16", "eps": args.eps, "graph_ops": args.graph_ops,
        "replays": args.replays, "weights_mib": args.weights_mib,
        "method": "per-op time = CUDA graph replay time / (fused op + GEMM) pairs per graph; the GEMM's weight "
                  "rotates over distinct weights of weights_mib in all; p50/p99 over replays; every fused "
                  "output checked against the fp32 reference once per size before timing",
        "skipped_backends": res.get("skipped_backends", {}),
        "skipped": res.get("skipped", []),
        "incomplete": res.get("incomplete"),
        "setup": res.get("setup", {}),
        "yali_config": res.get("yali_config"),
    })
    hdr["records"] = res["rows"]
    hdr["summary"] = summarize(res["rows"])
    for s in hdr["summary"]:  # JSON keys must be strings
        s["yali_us"] = {str(k): v for k, v in s["yali_us"].items()}
    md = markdown_table(hdr)
    path = str(write_json_and_markdown(args.out, args.name, hdr, md))
    plot(hdr, args.out, args.name)
    print(md)
    print(f"wrote {path}")
    return path


def report_only(path: str) -> tuple[str, str | None]:
    with open(path) as f:
        res = json.load(f)
    if res.get("kind") != KIND or "weights_mib" not in res:
        raise SystemExit(f"{path}: not a fused_gemm_bench result")
    out = os.path.dirname(os.path.abspath(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    md_path = os.path.join(out, stem + ".md")
    with open(md_path, "w") as f:
        f.write(markdown_table(res))
    return md_path, plot(res, out, stem)


# ----------------------------------------------------------------------------- GPU worker
def weight_set(torch, n: int, hidden: int, total_mib: int, dev, seed: int):
    """Distinct [n, hidden] bf16 weights, at least two and total_mib MiB in all (small values:
    the products stay finite)."""
    each = n * hidden * 2
    count = max(2, -(-total_mib * MiB // each))
    g = torch.Generator(device=dev).manual_seed(seed)
    return [(torch.randn(n, hidden, generator=g, device=dev) * 0.01).to(torch.bfloat16) for _ in range(count)]


def worker(rank, port, args, q):
    os.environ.update(MULTICAST_OFF_ENV)
    os.environ["YALI_ENABLE"] = "0"  # vLLM's TP group keeps its own communicator; YALI is created here
    import torch
    import torch.distributed as dist

    t_start = time.time()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    gloo, vllm_ok, stack = _init_dist(rank, port)

    def agree(flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=gloo)
        return bool(t.item())

    names = ["yali-fused"] + ([] if args.no_flashinfer else ["flashinfer-trtllm"])
    be = Backends(rank, dev, gloo, names, vllm_ok, agree, 2048)
    rows, skipped = [], []
    setup = {"backends": be.setup, "vllm": vllm_ok if vllm_ok is not True else "ok",
             "setup_s": round(time.time() - t_start, 1)}
    dtype, dname, hidden = torch.bfloat16, "bf16", args.hidden
    variants = [("gemm-only", None)] + [("yali-fused", p * MiB) for p in args.prefetch_mib] + \
        [("flashinfer-trtllm", None)]
    plan_total = len(args.gemm_n) * len(args.tokens) * len(variants)
    done = {"n": 0}
    weight = _rand((hidden,), 7, 0.5, dtype, dev, offset=1.0)
    w_time = _rand((hidden,), 8, 0.01, dtype, dev)
    fi = {"reason": None if "flashinfer-trtllm" in be.names else be.skipped.get("flashinfer-trtllm", "not requested")}
    if rank == 0:
        print(f"[fused-gemm] set-up {time.time() - t_start:.0f}s; backends {be.names}; {plan_total} measurements",
              flush=True)

    def measure(n, weights, tokens, backend, prefetch_bytes):
        done["n"] += 1
        base = {"backend": backend, "dtype": dname, "hidden": hidden, "tokens": tokens, "gemm_n": n}
        if backend == "yali-fused":
            base["prefetch_bytes"] = prefetch_bytes
        if not agree(time.time() - t_start < args.budget_s):
            skipped.append({**base, "reason": "budget spent"})
            return
        if backend == "flashinfer-trtllm" and fi["reason"]:
            skipped.append({**base, "reason": fi["reason"]})
            return
        if backend == "gemm-only" and n == 0:
            return
        shape = (tokens, hidden)
        seed = 1000 * tokens + n
        x0, x1 = _rand(shape, seed, 2.0, dtype, dev), _rand(shape, seed + 1, 2.0, dtype, dev)
        res = _rand(shape, seed + 2, 4.0, dtype, dev)
        mine = x0 if rank == 0 else x1
        x_time = _rand(shape, seed + 3 + rank, 1e-3, dtype, dev)
        r_time = _rand(shape, seed + 5, 1.0, dtype, dev)
        row, err, chk = None, None, {}
        turn = {"i": 0}

        def next_weight():
            turn["i"] += 1
            return weights[turn["i"] % len(weights)]

        try:
            if backend == "yali-fused":
                comm = be.yali

                def fused(x, r, w, out, pf):
                    comm.fused_allreduce_rmsnorm(x, r, w, args.eps, norm_out=out, residual_out=r, prefetch=pf,
                                                 prefetch_bytes=prefetch_bytes)
                    return out

                norm = torch.empty_like(mine)
                x, r = mine.clone(), res.clone()
                fused(x, r, weight, norm, weights[0])
                torch.cuda.synchronize()
                chk = check_result(norm, r, *reference(x0, x1, res, weight, args.eps), dname)
                xt, rt, nt = x_time.clone(), r_time.clone(), torch.empty_like(x_time)

                def op(_=None):
                    w_next = next_weight()
                    out = fused(xt, rt, w_time, nt, w_next)
                    if n:
                        torch.mm(out, w_next.t())
            elif backend == "flashinfer-trtllm":
                made, why = be.make(backend, mine.clone(), res.clone(), weight, args.eps)
                if made is None:
                    raise RuntimeError(why)
                fop, outputs = made
                fop()
                torch.cuda.synchronize()
                chk = check_result(*outputs(), *reference(x0, x1, res, weight, args.eps), dname)
                made, _ = be.make(backend, x_time.clone(), r_time.clone(), w_time, args.eps)
                fop, outputs = made

                def op(_=None):
                    fop()
                    if n:
                        torch.mm(outputs()[0], next_weight().t())
            else:  # gemm-only
                xt = x_time.clone()

                def op(_=None):
                    torch.mm(xt, next_weight().t())

            per_op = time_graph(torch, op, None, args.graph_ops, args.replays, be.capture_ctx.get(backend))
            row = {**base, "timing": "graph", "us_p50": round(statistics.median(per_op), 3),
                   "us_p99": round(pct(per_op, 99), 3), "samples": len(per_op), **chk}
            if backend == "gemm-only":
                row["correct"] = True
        except Exception as e:
            err = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            if os.environ.get("YALI_BENCH_DEBUG"):
                traceback.print_exc()
        both_ok = agree(row is not None)
        both_correct = agree(row is not None and row.get("correct", False))
        if not both_ok:
            skipped.append({**base, "reason": f"failed: {err or 'on the other rank'}"})
            if rank == 0:
                print(f"[fused-gemm {done['n']}/{plan_total}] {backend} n{n} t{tokens}: FAILED "
                      f"{err or 'on the other rank'}", flush=True)
            return
        row["correct"] = both_correct
        rows.append(row)
        if rank == 0:
            pf = f" pf {prefetch_bytes // MiB:>2d} MiB" if backend == "yali-fused" else " " * 10
            print(f"[fused-gemm {done['n']}/{plan_total} {time.time() - t_start:4.0f}s] {backend:17s}{pf} n{n:<6d} "
                  f"t{tokens:<4d} p50 {row['us_p50']:8.2f} us  p99 {row['us_p99']:8.2f} us"
                  + (f"  err {_fmt_err(row.get('max_abs_err_norm'))}" if "max_abs_err_norm" in row else "")
                  + ("" if row["correct"] else "  WRONG RESULT"), flush=True)

    # The GEMM alone and YALI first, FlashInfer after them: on a fresh host its JIT build (started
    # by fused.sh prebuild, or at set-up) runs meanwhile.
    for phase in ([v for v in variants if v[0] != "flashinfer-trtllm"], [("flashinfer-trtllm", None)]):
        if phase[0][0] == "flashinfer-trtllm" and not fi["reason"]:
            t0 = time.time()
            fi["reason"] = be.flashinfer_ready(max(0.0, args.budget_s - (time.time() - t_start))) or \
                be.flashinfer_workspace(dtype, dname, hidden, args.tokens)
            if rank == 0:
                print(f"[fused-gemm] FlashInfer: {fi['reason'] or 'ready'} ({time.time() - t0:.0f}s)", flush=True)
        for n in args.gemm_n:
            # gemm_n 0: the fused op prefetches a gate_up-sized weight that no GEMM reads
            weights = weight_set(torch, n or 28672, hidden, args.weights_mib, dev, 99 + n)
            for tokens in args.tokens:
                for backend, pf in phase:
                    measure(n, weights, tokens, backend, pf)
            del weights
            torch.cuda.empty_cache()
    q.put((rank, {"rows": rows, "skipped": skipped, "skipped_backends": be.skipped, "setup": setup,
                  "yali_config": getattr(be, "yali_config", None)}))
    be.close()
    dist.barrier(group=gloo)
    with contextlib.suppress(Exception):
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    if stack is not None:
        stack.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    if args.report_only:
        md, png = report_only(args.report_only)
        print(f"wrote {md}" + (f" and {png}" if png else ""))
        return 0
    print(f"[fused-gemm] hidden {args.hidden}, gemm_n {args.gemm_n}, tokens {args.tokens}, prefetch MiB "
          f"{args.prefetch_mib}, budget {args.budget_s:.0f}s", flush=True)
    res = run_two_ranks(worker, args, args.timeout, "fused + GEMM benchmark")
    write_outputs(args, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
