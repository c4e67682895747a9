#!/usr/bin/env python3
"""Fused all-reduce + residual add + RMSNorm on N GPUs (--world-size, 2, 4, 6 or 8; default 2):
YALI's fused op against vLLM's FlashInfer fusion (trtllm backend) and the unfused sequence vLLM
runs without the fusion, in the same N rank processes on the same machine.

Backends (each op: x [tokens, hidden] summed over the N ranks, + residual, RMSNorm):
  yali-fused         YaliCommunicator.fused_allreduce_rmsnorm (residual updated in place)
  flashinfer-trtllm  torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm, called exactly as
                     vLLM's AllReduceFusionPass does at TP=N (kARResidualRMSNorm, FlashInfer
                     workspace for world size N from get_fi_ar_workspace on the TP group's CPU
                     group, sized by vLLM's PassConfig.flashinfer_max_size(N); backend trtllm
                     only, never mnnvl). Where vLLM has no FlashInfer fusion for N ranks on the
                     GPU (e.g. 6), it is skipped
  unfused            get_tp_group().device_communicator.all_reduce(x) (vLLM's own dispatch, e.g.
                     FlashInfer's all-reduce or its custom all-reduce for small inputs, PyNCCL
                     above) + torch.ops._C.fused_add_rms_norm

Every backend's output is checked against the fp32 reference (vLLM's native fused_add_rms_norm
of the fp32 all-reduce sum) once per size before it is timed, the unfused sequence with the
slack of an all-reduce that rounds every partial sum (rounded_sum_slack); then per-op time inside
a CUDA graph of --graph-ops back-to-back ops, p50/p99 over --replays replays. The target
"YALI <= 0.8 x FlashInfer at <= 32 tokens, never slower" is evaluated per row.

Per dtype and hidden size, YALI and the unfused sequence are measured first and FlashInfer after
them: on a fresh host FlashInfer JIT-builds its kernels (minutes of CPU), in a background thread
started at set-up. --budget-s bounds the run: no measurement starts after it (counted from the
ranks' start); rank 0 checkpoints its rows, so ranks that hang or are killed still leave a
result file (marked incomplete).

Writes <out>/<name>.json (kind fused-allreduce-rmsnorm), <name>.md and <name>.png, each naming
the world size.

  python -m benchmarks.fused_bench                          # hidden 8192, bf16, 1..512 tokens
  python -m benchmarks.fused_bench --world-size 8           # 8 ranks, one GPU each
  python -m benchmarks.fused_bench --hidden 4096,8192 --dtypes bf16,fp16 --budget-s 300
  python -m benchmarks.fused_bench --report-only lab/results/archive/fused/20261122-first-kernel/fused.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
import traceback

from benchmarks.common.cli_args import add_world_size_arg, place_ranks, positive_float, positive_int, rank_device
from benchmarks.common.cli_args import choice_list as parse_choice_list
from benchmarks.common.cli_args import positive_int_list as parse_int_list
from benchmarks.common.cli_args import shared_gpu_note
from benchmarks.common.gpu_env import MULTICAST_OFF_ENV
from benchmarks.common.processes import run_ranks
from benchmarks.common.results import output_dir, results_header, world_size_of, write_json_and_markdown, write_results
from benchmarks.common.timing import pct, time_graph

os.environ.update(MULTICAST_OFF_ENV)

KIND = "fused-allreduce-rmsnorm"
BACKENDS = ["yali-fused", "flashinfer-trtllm", "unfused"]
DTYPE_NAMES = ["bf16", "fp16", "fp32"]
ELEMENT_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
DEFAULT_TOKENS = "1,2,4,8,16,32,64,128,256,512"
# Output tolerances for `correct` (norm_out and residual_out against the fp32 reference) at 2
# ranks: |out - ref| <= atol + rtol * |ref|. They admit the roundings the three implementations
# place differently (vLLM's CUDA kernel normalises the rounded residual, FlashInfer adds in
# another order), i.e. a couple of ulps of the dtype; a wrong sum or a missing residual is far
# outside. At N ranks each of the N-1 additions of the all-reduce may round (tolerance()).
TOLERANCE = {"bf16": (2 ** -6, 2 ** -6), "fp16": (2 ** -9, 2 ** -8), "fp32": (1e-5, 1e-4)}
# Unit roundoff u: rounding a value to the dtype moves it by at most u x its magnitude.
UNIT_ROUNDOFF = {"bf16": 2 ** -8, "fp16": 2 ** -11, "fp32": 2 ** -24}
# Backends whose all-reduce may round every partial sum to the dtype: vLLM's dispatch picks
# FlashInfer's standalone all-reduce (it adds in the dtype: fp32_acc off) or NCCL (partial sums
# travel between ranks in the dtype). YALI and FlashInfer's fusion (fp32_acc on) add in fp32 and
# round the sum once, as the reference does: they get no slack.
ROUNDS_PARTIAL_SUMS = {"unfused"}


def tolerance(dname: str, world_size: int = 2) -> tuple[float, float]:
    """(atol, rtol) of `dname` at `world_size` ranks: TOLERANCE x (N - 1)."""
    atol, rtol = TOLERANCE[dname]
    return atol * (world_size - 1), rtol * (world_size - 1)


# ----------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", default="8192", type=lambda s: parse_int_list(s, "--hidden"),
                    help="hidden sizes, comma list (default %(default)s)")
    ap.add_argument("--tokens", default=DEFAULT_TOKENS, type=lambda s: parse_int_list(s, "--tokens"),
                    help="token counts, comma list (default %(default)s)")
    ap.add_argument("--dtypes", default="bf16", type=lambda s: parse_choice_list(s, DTYPE_NAMES, "--dtypes"),
                    help="comma list of bf16, fp16, fp32 (default %(default)s)")
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    type=lambda s: parse_choice_list(s, BACKENDS, "--backends"))
    ap.add_argument("--eps", type=positive_float, default=1e-5, help="RMSNorm epsilon (default %(default)s)")
    ap.add_argument("--fi-max-tokens", type=positive_int, default=2048,
                    help="FlashInfer workspace max_token_num at least this (vLLM: min(flashinfer_max_size(N) / "
                         "row bytes, max_num_batched_tokens); flashinfer_max_size is 64 MiB at TP=2 on Hopper); "
                         "default %(default)s")
    ap.add_argument("--graph-ops", type=positive_int, default=50, help="fused ops per CUDA graph (default %(default)s)")
    ap.add_argument("--replays", type=positive_int, default=200, help="timed graph replays = samples (default %(default)s)")
    ap.add_argument("--budget-s", type=positive_float, default=420.0,
                    help="stop starting measurements after this many seconds (default %(default)s)")
    ap.add_argument("--timeout", type=positive_float, default=None,
                    help="kill the ranks after this many seconds (default budget + 150)")
    ap.add_argument("--target-ratio", type=positive_float, default=0.8, help="YALI / FlashInfer target (default %(default)s)")
    ap.add_argument("--target-tokens", type=positive_int, default=32,
                    help="the target ratio applies up to this many tokens; above, YALI must not be slower")
    add_world_size_arg(ap)
    ap.add_argument("--out", default=str(output_dir()))
    ap.add_argument("--name", default=None, help="result file stem (default fused-<date>)")
    ap.add_argument("--quick", action="store_true", help="tokens 1,8,32,128, 50 replays")
    ap.add_argument("--report-only", metavar="JSON", help="rebuild the table and plot from a result file")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.replays = [1, 8, 32, 128], min(args.replays, 50)
    if args.timeout is None:
        args.timeout = args.budget_s + 150.0
    args.name = args.name or "fused-" + time.strftime("%Y%m%d-%H%M%S")
    return args


def flashinfer_max_tokens(hidden: int, dname: str, tokens_list, max_bytes: int, at_least: int = 2048) -> int:
    """max_token_num of the FlashInfer workspace: like vLLM's AllReduceFusionPass,
    min(max_bytes / row bytes, a max_num_batched_tokens-like bound), and at least the largest
    token count measured when that fits in max_bytes (vLLM's flashinfer_max_size(N): 64 MiB at
    TP=2 on Hopper, 2 MiB at TP=4, 0.5 MiB at TP=8)."""
    cap = max_bytes // (hidden * ELEMENT_SIZE[dname])
    return max(1, min(max(max(tokens_list), at_least), cap))


# ----------------------------------------------------------------------------- reference and checks
def reference(inputs, residual, weight, eps: float):
    """(norm_out, residual_out) of all_reduce -> vLLM's native fused_add_rms_norm, all-reduce
    sum of every rank's input (`inputs`, in rank order) in fp32, rounded once
    (vllm/ir/ops/layernorm.py)."""
    import torch

    dtype = inputs[0].dtype
    s = sum(x.float() for x in inputs).to(dtype)
    z = s.float() + residual.float() if residual is not None else s.float()
    residual_out = z.to(dtype)
    variance = z.pow(2).mean(dim=-1, keepdim=True)
    norm_out = ((z * torch.rsqrt(variance + eps)).to(weight.dtype) * weight).to(dtype)
    return norm_out, residual_out


def rounded_sum_slack(inputs, ref_residual, weight, eps: float, dname: str):
    """Per-element slack (norm, residual) of a backend whose all-reduce rounds every partial sum to
    the dtype, on top of tolerance(): how far such a sum can be from the reference's, carried
    through the residual add and the norm. None at 2 ranks.

    With A = sum over the ranks of |x| and u = UNIT_ROUNDOFF[dname]: an all-reduce of N ranks
    makes N - 1 additions in some order (rank order, a ring, a tree); each partial sum is a sum of
    some of the inputs, so at most A in magnitude, and rounding it moves it by at most u A. The
    backend's sum is within (N - 1) u A of the exact sum, the reference's too (it rounds once,
    or, in fp32, as often), so the two are within S = 2 (N - 1) u A. The residual output
    (sum + residual) moves by S; the norm output (residual x weight / rms of the row) by
    |weight| (S + |residual| rms(S) / rms) / rms, as the row's rms moves by at most rms(S).
    The bound is relative to the inputs, not to the output: where the residual cancels the sum,
    one ulp of the sum is many ulps of the output. At 2 ranks the one addition rounds the exact
    sum once, as the reference does."""
    n = len(inputs)
    if n <= 2:
        return None
    z = ref_residual.double()
    slack = 2 * (n - 1) * UNIT_ROUNDOFF[dname] * sum(x.double().abs() for x in inputs)
    rms = (z.pow(2).mean(dim=-1, keepdim=True) + eps).sqrt()
    rms_slack = slack.pow(2).mean(dim=-1, keepdim=True).sqrt()
    norm_slack = weight.double().abs() * (slack + z.abs() * rms_slack / rms) / rms
    return norm_slack, slack


def check_result(norm, residual_out, ref_norm, ref_residual, dname: str, world_size: int = 2,
                 slack=None) -> dict:
    """Compares one backend's outputs with the reference under tolerance(dname, world_size),
    widened per element by `slack` (norm, residual) where given (rounded_sum_slack)."""
    atol, rtol = tolerance(dname, world_size)
    out = {}
    ok = True
    for i, (key, got, ref) in enumerate((("norm", norm, ref_norm), ("residual", residual_out, ref_residual))):
        got64, ref64 = got.double(), ref.double()
        finite = bool(got64.isfinite().all().item())
        diff = (got64 - ref64).abs()
        err = float(diff.max().item()) if diff.numel() else 0.0
        bound = atol + rtol * ref64.abs() + (slack[i] if slack is not None else 0.0)
        within = finite and bool((diff <= bound).all().item())
        out[f"max_abs_err_{key}"] = err if finite else None  # None: NaN/inf in the output
        ok = ok and within
    out["residual_bitwise"] = bool(torch_equal_bits(residual_out, ref_residual))
    out["correct"] = ok
    return out


def torch_equal_bits(a, b) -> bool:
    import torch

    iv = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    return a.shape == b.shape and bool((a.contiguous().view(iv) == b.contiguous().view(iv)).all().item())


# ----------------------------------------------------------------------------- report
def target_verdict(tokens: int, yali: dict | None, flashinfer: dict | None, target_ratio: float = 0.8,
                   target_tokens: int = 32) -> tuple[str, float]:
    """("pass" | "FAIL" | "FAIL (wrong result)" | "n/a ...", the ratio limit of this row).

    The limit is target_ratio up to target_tokens and 1.0 (never slower) above."""
    limit = target_ratio if tokens <= target_tokens else 1.0
    if yali is None or flashinfer is None:
        return "n/a (missing)", limit
    if not yali.get("correct", False):
        return "FAIL (wrong result)", limit
    if not flashinfer.get("correct", False):
        return "n/a (FlashInfer wrong)", limit
    ratio = yali["us_p50"] / flashinfer["us_p50"]
    return ("pass" if ratio <= limit else "FAIL"), limit


def summarize(records: list[dict], target_ratio: float = 0.8, target_tokens: int = 32) -> list[dict]:
    """One row per (dtype, hidden, tokens): each backend's record, the ratios and the verdict."""
    cells: dict[tuple, dict] = {}
    for r in records:
        cells.setdefault((r["dtype"], int(r["hidden"]), int(r["tokens"])), {})[r["backend"]] = r
    order = {d: i for i, d in enumerate(DTYPE_NAMES)}
    rows = []
    for key in sorted(cells, key=lambda k: (order.get(k[0], 99), k[1], k[2])):
        dname, hidden, tokens = key
        c = cells[key]
        y, f, u = c.get("yali-fused"), c.get("flashinfer-trtllm"), c.get("unfused")
        verdict, limit = target_verdict(tokens, y, f, target_ratio, target_tokens)
        rows.append({
            "dtype": dname, "hidden": hidden, "tokens": tokens, "backends": c,
            "yali_vs_flashinfer": y["us_p50"] / f["us_p50"] if y and f else None,
            "yali_vs_unfused": y["us_p50"] / u["us_p50"] if y and u else None,
            "limit": limit, "verdict": verdict,
        })
    return rows


def target_summary(rows: list[dict]) -> dict:
    judged = [r for r in rows if r["verdict"] in ("pass", "FAIL", "FAIL (wrong result)")]
    failed = [r for r in judged if r["verdict"] != "pass"]
    return {"rows": len(rows), "judged": len(judged), "passed": len(judged) - len(failed),
            "met": bool(judged) and not failed,
            "failed": [f"{r['dtype']} hidden {r['hidden']} tokens {r['tokens']}: {r['verdict']}" for r in failed]}


def _us(r: dict | None) -> str:
    if r is None:
        return "–"
    mark = "" if r.get("correct", False) else " ✗"
    p99 = r.get("us_p99")
    return f"{r['us_p50']:.2f} ({p99:.2f}){mark}" if p99 is not None else f"{r['us_p50']:.2f}{mark}"


def _ratio(v) -> str:
    return f"{v:.3f}×" if v is not None else "–"


def markdown_table(res: dict) -> str:
    target = res.get("target", {"ratio": 0.8, "tokens": 32})
    rows = summarize(res["records"], target["ratio"], target["tokens"])
    summary = target_summary(rows)
    world = world_size_of(res)
    out = [f"# Fused all-reduce + residual add + RMSNorm, {world} ranks ({res.get('host')})\n",
           f"{res.get('date')} · `{res.get('command')}`\n"]
    if res.get("shared_gpu"):
        out.append(f"**Not a timing: {shared_gpu_note(world)}.**\n")
    out += ["Per-op time inside CUDA graphs, µs: p50 (p99) over replays; ✗ = output outside the tolerance.\n",
           f"**Target: YALI ≤ {target['ratio']} × FlashInfer at ≤ {target['tokens']} tokens, never slower above: "
           f"{'met' if summary['met'] else 'NOT met'}** ({summary['passed']} of {summary['judged']} judged rows pass"
           f"{'; failing: ' + '; '.join(summary['failed']) if summary['failed'] else ''}).\n"]
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["hidden"]), []).append(r)
    for (dname, hidden), grows in groups.items():
        out += [f"\n## {dname}, hidden {hidden}\n",
                "| tokens | bytes | yali-fused | flashinfer-trtllm | unfused | yali / FlashInfer | yali / unfused "
                "| target | verdict |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|:---|"]
        for r in grows:
            b = r["backends"]
            nbytes = r["tokens"] * hidden * ELEMENT_SIZE.get(dname, 2)
            out.append(f"| {r['tokens']} | {nbytes} | {_us(b.get('yali-fused'))} | {_us(b.get('flashinfer-trtllm'))} "
                       f"| {_us(b.get('unfused'))} | {_ratio(r['yali_vs_flashinfer'])} | {_ratio(r['yali_vs_unfused'])} "
                       f"| ≤ {r['limit']:.2f}× | {r['verdict']} |")
    paths = sorted({(r["dtype"], r["hidden"], r["tokens"], r.get("ar_path")) for r in res["records"]
                    if r["backend"] == "unfused" and r.get("ar_path")})
    if paths:
        by = {}
        for d, h, t, p in paths:
            by.setdefault(p, []).append(t)
        out.append("\nUnfused all-reduce path (vLLM's dispatch): "
                   + "; ".join(f"{p} at {', '.join(str(t) for t in sorted(set(ts)))} tokens" for p, ts in by.items()))
    if res.get("skipped_backends"):
        out.append("\nSkipped backends: " + "; ".join(f"{k}: {v}" for k, v in res["skipped_backends"].items()))
    if res.get("skipped"):
        out.append("\nSkipped measurements: " + "; ".join(
            f"{s['backend']} {s['dtype']} hidden {s['hidden']} tokens {s['tokens']}: {s['reason']}"
            for s in res["skipped"]))
    return "\n".join(out) + "\n"


def plot(res: dict, out_dir: str, name: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    target = res.get("target", {"ratio": 0.8, "tokens": 32})
    rows = summarize(res["records"], target["ratio"], target["tokens"])
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["hidden"]), []).append(r)
    if not groups:
        return None
    fig, axes = plt.subplots(len(groups), 2, figsize=(14, 4.5 * len(groups)), squeeze=False)
    for (ax_t, ax_r), ((dname, hidden), grows) in zip(axes, groups.items()):
        for b in BACKENDS:
            pts = [(r["tokens"], r["backends"][b]) for r in grows if b in r["backends"]]
            if pts:
                ax_t.plot([p[0] for p in pts], [p[1]["us_p50"] for p in pts], marker="o", label=b)
                bad = [p for p in pts if not p[1].get("correct", False)]
                if bad:
                    ax_t.scatter([p[0] for p in bad], [p[1]["us_p50"] for p in bad], marker="x", color="r", s=80,
                                 zorder=5, label=f"{b}: wrong result")
        ax_t.set(title=f"fused all-reduce + RMSNorm, {world_size_of(res)} ranks, {dname}, hidden {hidden} "
                       "(CUDA graph p50)",
                 xlabel="tokens", ylabel="µs per op")
        for key, label in (("yali_vs_flashinfer", "yali / flashinfer-trtllm"), ("yali_vs_unfused", "yali / unfused")):
            pts = [(r["tokens"], r[key]) for r in grows if r[key] is not None]
            if pts:
                ax_r.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ts = [r["tokens"] for r in grows]
        ax_r.step(ts, [r["limit"] for r in grows], where="mid", color="k", ls="--", lw=1, label="target (vs FlashInfer)")
        ax_r.set(title="time ratio (lower is better for YALI)", xlabel="tokens", ylabel="×")
        for ax in (ax_t, ax_r):
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def write_outputs(args, res: dict) -> str:
    """Result JSON + markdown + PNG under args.out."""
    hdr = results_header(KIND, {
        "target": {"ratio": args.target_ratio, "tokens": args.target_tokens,
                   "text": f"YALI <= {args.target_ratio} x FlashInfer at <= {args.target_tokens} tokens, "
                           f"never slower"},
        "eps": args.eps, "graph_ops": args.graph_ops, "replays": args.replays,
        "method": "per-op time = CUDA graph replay time / ops per graph (back-to-back fused ops on the same "
                  "buffers), p50/p99 over replays; each backend checked once per size against the fp32 "
                  "reference before timing (correct: within tolerance of the dtype)",
        "tolerance": {d: dict(zip(("atol", "rtol"), tolerance(d, args.world_size))) for d in TOLERANCE},
        "tolerance_slack": {"backends": sorted(ROUNDS_PARTIAL_SUMS),
                            "residual": "2 (N-1) u sum|x| above 2 ranks (rounded_sum_slack)",
                            "unit_roundoff": UNIT_ROUNDOFF},
        "skipped_backends": res.get("skipped_backends", {}),
        "skipped": res.get("skipped", []),
        "budget_exhausted": res.get("budget_exhausted", False),
        "incomplete": res.get("incomplete"),
        "setup": res.get("setup", {}),
        "yali_config": res.get("yali_config"),
    }, world_size=args.world_size, shared_gpu=args.shared_gpu)
    hdr["records"] = res["rows"]
    hdr["summary"] = target_summary(summarize(res["rows"], args.target_ratio, args.target_tokens))
    md = markdown_table(hdr)
    path = str(write_json_and_markdown(args.out, args.name, hdr, md))
    plot(hdr, args.out, args.name)
    print(md)
    print(f"wrote {path}")
    return path


def report_only(path: str) -> tuple[str, str | None]:
    with open(path) as f:
        res = json.load(f)
    if res.get("kind") != KIND:
        raise SystemExit(f"{path}: kind {res.get('kind')!r}, expected {KIND!r}")
    out = os.path.dirname(os.path.abspath(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    md_path = os.path.join(out, stem + ".md")
    with open(md_path, "w") as f:
        f.write(markdown_table(res))
    return md_path, plot(res, out, stem)


# ----------------------------------------------------------------------------- GPU worker
def unfused_path(dc, x) -> str:
    """Which all-reduce vLLM's CudaCommunicator.all_reduce picks for x (its own dispatch order)."""
    fi = getattr(dc, "fi_ar_comm", None)
    if fi is not None and not fi.disabled and fi.should_use_fi_ar(x):
        return "flashinfer-ar"
    ca = getattr(dc, "ca_comm", None)
    if ca is not None and not ca.disabled and ca.should_custom_ar(x):
        return "custom"
    sm = getattr(dc, "symm_mem_comm", None)
    if sm is not None and sm.should_use_symm_mem(x):
        return "symm-mem"
    return "pynccl"


class Backends:
    """Creates each backend once per rank. make(name, x, residual, weight, eps) returns
    (op, outputs): op(_) launches one fused op on the current stream (it may update x and the
    residual in place, as the backend does in vLLM), outputs() gives (norm_out, residual_out)."""

    def __init__(self, rank, dev, gloo, names, vllm_ok, agree, fi_min_tokens=2048):
        import torch.distributed as dist

        self.rank, self.dev, self.gloo = rank, dev, gloo
        self.world_size = dist.get_world_size(gloo)
        self.fi_min_tokens = fi_min_tokens
        self.names, self.skipped, self.capture_ctx = [], {}, {}
        self.setup = {}
        self._agree = agree
        for name in names:
            t0 = time.time()
            reason = None
            try:
                if name != "yali-fused" and vllm_ok is not True:
                    raise RuntimeError(f"vLLM's distributed state is not available ({vllm_ok!r})")
                getattr(self, "_init_" + name.replace("-", "_"))()
            except Exception as e:
                reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                if os.environ.get("BENCH_DEBUG"):
                    traceback.print_exc()
            if not agree(reason is None):  # the ranks keep a backend only if every rank could create it
                self.skipped[name] = reason or "another rank could not create it"
                if rank == 0:
                    print(f"[fused-bench] {name} skipped: {self.skipped[name]}", flush=True)
                continue
            self.names.append(name)
            self.setup[name] = {"init_s": round(time.time() - t0, 1)}

    # yali
    def _init_yali_fused(self):
        from yali_vllm.communicator import YaliCommunicator

        self.yali = YaliCommunicator(self.gloo, self.dev)
        self.yali_config = dict(self.yali.config)

    def _make_yali_fused(self, x, res, w, eps):
        import torch

        if not self.yali.can_fuse(x, res, w):
            return None, "YaliCommunicator.can_fuse() refuses this shape"
        norm = torch.empty_like(x)
        comm = self.yali

        def op(_=None):
            comm.fused_allreduce_rmsnorm(x, res, w, eps, norm_out=norm, residual_out=res)

        return (op, lambda: (norm, res)), None

    # flashinfer (trtllm)
    def _init_flashinfer_trtllm(self):
        if os.environ.get("VLLM_FLASHINFER_ALLREDUCE_BACKEND") != "trtllm":
            raise RuntimeError("VLLM_FLASHINFER_ALLREDUCE_BACKEND must be trtllm (mnnvl is never used here)")
        import vllm.compilation.passes.fusion.allreduce_rms_fusion as arf

        if arf.flashinfer_comm is None:
            raise RuntimeError("flashinfer.comm with allreduce_fusion is not importable")
        self.fi_max_bytes = flashinfer_fusion_max_bytes(self.world_size)
        if self.fi_max_bytes is None:
            raise RuntimeError(f"vLLM has no FlashInfer all-reduce fusion at world size {self.world_size} on this GPU "
                               "(PassConfig.flashinfer_max_size is None)")
        from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

        self.arf = arf
        self.fi_ws_key = None
        self.fi_max_tokens = 0
        self.fi_build = {"error": None, "seconds": None}

        def build():  # JIT-builds FlashInfer's kernels on a fresh host (CPU minutes) while YALI is measured
            t0 = time.time()
            try:
                get_trtllm_comm_module()
            except Exception as e:
                self.fi_build["error"] = f"FlashInfer JIT build failed: {type(e).__name__}: {e}".splitlines()[0][:300]
            self.fi_build["seconds"] = round(time.time() - t0, 1)

        self.fi_thread = threading.Thread(target=build, name="flashinfer-jit", daemon=True)
        self.fi_thread.start()

    def flashinfer_ready(self, wait_s: float) -> str | None:
        """Waits up to wait_s for FlashInfer's JIT build (a collective: the ranks agree);
        returns why FlashInfer cannot be measured, or None. A failure drops the backend."""
        if "flashinfer-trtllm" not in self.names:
            return self.skipped.get("flashinfer-trtllm", "not created")
        self.fi_thread.join(timeout=max(0.0, wait_s))
        if self.fi_thread.is_alive():
            reason = f"FlashInfer JIT build not finished within the budget ({wait_s:.0f}s left)"
        else:
            reason = self.fi_build["error"]
        if not self._agree(reason is None):
            self.names.remove("flashinfer-trtllm")
            self.skipped["flashinfer-trtllm"] = reason or "not ready on another rank"
            return self.skipped["flashinfer-trtllm"]
        self.setup["flashinfer-trtllm"]["jit_build_s"] = self.fi_build["seconds"]
        return None

    def flashinfer_workspace(self, dtype, dname, hidden, tokens_list) -> str | None:
        """(Re)creates FlashInfer's workspace for this dtype and hidden size (a collective);
        returns why it is unavailable, or None.

        As AllReduceFusionPass.__init__: get_fi_ar_workspace with the TP world size and rank and
        the TP group's CPU (gloo) group, never its NCCL device group: get_fi_ar_workspace counts
        the group's nodes (in_the_same_node_as, which refuses an NCCL group), and vLLM's
        standalone FlashInfer all-reduce shares this workspace with the same group."""
        if "flashinfer-trtllm" not in self.names:
            return self.skipped.get("flashinfer-trtllm", "not created")
        key = (dname, hidden)
        if self.fi_ws_key == key:
            return None if self.fi_max_tokens else "workspace unavailable"
        from vllm.distributed.device_communicators.flashinfer_all_reduce import (
            destroy_fi_ar_workspace,
            get_fi_ar_workspace,
        )
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
            get_tp_group,
        )

        destroy_fi_ar_workspace()
        max_tokens = flashinfer_max_tokens(hidden, dname, tokens_list, self.fi_max_bytes, self.fi_min_tokens)
        tp_size = get_tensor_model_parallel_world_size()
        ws, err = None, None
        try:
            ws = get_fi_ar_workspace(world_size=tp_size, rank=get_tensor_model_parallel_rank(),
                                     max_token_num=max_tokens, hidden_dim=hidden, dtype=dtype,
                                     group=get_tp_group().cpu_group)
            if ws is not None and ws.backend != "trtllm":
                err = f"workspace backend is {ws.backend}, not trtllm: refused"
                destroy_fi_ar_workspace()
                ws = None
        except Exception as e:
            err = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        ok = self._agree(ws is not None)
        self.fi_ws_key = key
        self.fi_max_tokens = max_tokens if ok else 0
        if not ok:
            return err or "get_fi_ar_workspace returned None (see vLLM's warning above)"
        self.fi_params = self.arf.FlashInferFusedAllReduceParams(world_size=tp_size, max_token_num=max_tokens)
        return None

    def _make_flashinfer_trtllm(self, x, res, w, eps):
        import torch

        if not self.fi_max_tokens:
            return None, "no FlashInfer workspace"
        if x.shape[0] > self.fi_max_tokens:
            return None, (f"above the FlashInfer workspace's max_token_num {self.fi_max_tokens} "
                          f"({self.fi_max_bytes} bytes at {self.world_size} ranks, as vLLM caps it)")
        kwargs = self.fi_params.get_trtllm_fused_allreduce_kwargs()
        pattern = self.arf.flashinfer_comm.AllReduceFusionPattern.kARResidualRMSNorm

        def op(_=None):
            # As AllReduceFusedAddRMSNormPattern's replacement: norm_out=None, so the norm is
            # written into allreduce_in and residual_out into residual (both in place).
            torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm(
                allreduce_in=x, residual=res, norm_out=None, quant_out=None, scale_out=None,
                rms_gamma=w, rms_eps=eps, pattern_code=pattern, **kwargs)

        return (op, lambda: (x, res)), None

    # unfused: vLLM's all-reduce + vLLM's fused_add_rms_norm kernel
    def _init_unfused(self):
        import importlib

        import torch
        from vllm.distributed.parallel_state import get_tp_group

        importlib.import_module("vllm._custom_ops")  # loads vllm._C: registers torch.ops._C

        self.dc = get_tp_group().device_communicator
        if self.dc is None:
            raise RuntimeError("the TP group has no device communicator")
        if getattr(self.dc, "yali_comm", None) is not None:
            raise RuntimeError("vLLM's all-reduce is patched to YALI here (YALI_ENABLE must be 0)")
        if not hasattr(torch.ops._C, "fused_add_rms_norm"):
            raise RuntimeError("torch.ops._C.fused_add_rms_norm is missing")
        ca = getattr(self.dc, "ca_comm", None)
        self.capture_ctx["unfused"] = ca.capture if ca is not None and not ca.disabled else None

    def _make_unfused(self, x, res, w, eps):
        import torch

        dc, held = self.dc, {}

        def op(_=None):
            out = dc.all_reduce(x)
            torch.ops._C.fused_add_rms_norm(out, res, w, eps)  # out <- norm, res <- out + res
            held["out"] = out

        return (op, lambda: (held["out"], res)), None

    def make(self, name, x, res, w, eps):
        return getattr(self, "_make_" + name.replace("-", "_"))(x, res, w, eps)

    def close(self):
        if hasattr(self, "yali"):
            self.yali.close()
        if hasattr(self, "arf"):
            with contextlib.suppress(Exception):
                from vllm.distributed.device_communicators.flashinfer_all_reduce import destroy_fi_ar_workspace

                destroy_fi_ar_workspace()


def flashinfer_fusion_max_bytes(world_size: int) -> int | None:
    """The largest input vLLM's AllReduceFusionPass fuses with FlashInfer at TP=`world_size` on
    this GPU (the pass sizes its workspace from it), None where vLLM has no such fusion."""
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config().compilation_config.pass_config.flashinfer_max_size(world_size)


def _init_dist(rank, port, world_size=2, shared=False):
    """vLLM's distributed state (world N, TP N) when vLLM is importable, else a plain NCCL world;
    a plain gloo world when the ranks share GPU 0 (`shared`: NCCL and vLLM's communicators need a
    GPU per rank, YALI's communicator needs the gloo group only). Returns (gloo group, vllm_ok or
    the reason it is not, context to keep open)."""
    import torch
    import torch.distributed as dist

    if shared:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        return dist.new_group(backend="gloo"), "the ranks share GPU 0: only YALI runs there", None
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed.parallel_state import (
            get_tp_group,
            init_distributed_environment,
            initialize_model_parallel,
        )
    except Exception as e:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                device_id=torch.device("cuda", rank))
        return dist.new_group(backend="gloo"), f"vLLM not importable: {type(e).__name__}: {e}"[:300], None
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(set_current_vllm_config(VllmConfig()))
    except Exception as e:  # vLLM's parallel state mostly works without a current config
        print(f"[fused-bench] rank {rank}: no VllmConfig ({type(e).__name__}: {e})", flush=True)
    init_distributed_environment(world_size=world_size, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=rank, backend="nccl")
    initialize_model_parallel(tensor_model_parallel_size=world_size)
    return get_tp_group().cpu_group, True, stack


class _BudgetSpent(Exception):
    pass


def _partial_path(args) -> str:
    return os.path.join(args.out, f".{args.name}.partial.json")


def _checkpoint(args, state: dict) -> None:
    with contextlib.suppress(OSError):
        write_results(_partial_path(args), state)


def _fmt_err(v) -> str:
    return "non-finite" if v is None else f"{v:.3g}"


def _rand(shape, seed, scale, dtype, dev, offset=0.0):
    import torch

    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(shape, generator=g, device=dev, dtype=torch.float32).mul_(scale).add_(offset).to(dtype)


def worker(rank, port, args, q):
    os.environ.update(MULTICAST_OFF_ENV)
    os.environ["YALI_ENABLE"] = "0"  # the unfused baseline is vLLM's own all-reduce, never YALI
    import torch
    import torch.distributed as dist

    t_start = time.time()
    dev = torch.device("cuda", rank_device(rank, args.shared_gpu))
    torch.cuda.set_device(dev)
    gloo, vllm_ok, stack = _init_dist(rank, port, args.world_size, args.shared_gpu)

    def agree(flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=gloo)
        return bool(t.item())

    be = Backends(rank, dev, gloo, args.backends, vllm_ok, agree, args.fi_max_tokens)
    rows, skipped, budget_exhausted = [], [], False
    setup = {"backends": be.setup, "vllm": vllm_ok if vllm_ok is not True else "ok",
             "setup_s": round(time.time() - t_start, 1)}
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    plan_total = len(args.dtypes) * len(args.hidden) * len(args.tokens) * len(be.names)
    if rank == 0:
        print(f"[fused-bench] set-up {setup['setup_s']:.0f}s; backends {be.names}; {plan_total} measurements",
              flush=True)
    counter = {"done": 0}

    def measure(name, dname, dtype, hidden, tokens, weight, w_time):
        """One backend at one size: check against the reference, then time it in a CUDA graph.
        Every step that decides between ranks is agreed on, so the ranks stay in step."""
        counter["done"] += 1
        done = counter["done"]
        if not agree(time.time() - t_start < args.budget_s):
            raise _BudgetSpent
        base = {"backend": name, "dtype": dname, "hidden": hidden, "tokens": tokens}
        if rank == 0:  # what is measured so far survives a hang or a kill of the ranks
            _checkpoint(args, {"rows": rows, "skipped": skipped, "skipped_backends": be.skipped, "setup": setup,
                               "yali_config": getattr(be, "yali_config", None)})
        shape = (tokens, hidden)
        seed = 1000 * tokens + hidden  # + 0..7: the ranks' inputs, + 8..: the rest
        inputs = [_rand(shape, seed + r, 2.0, dtype, dev) for r in range(args.world_size)]
        res = _rand(shape, seed + 8, 4.0, dtype, dev)
        mine = inputs[rank]
        ref_norm, ref_res = reference(inputs, res, weight, args.eps)
        slack = None
        if name in ROUNDS_PARTIAL_SUMS:
            slack = rounded_sum_slack(inputs, ref_res, weight, args.eps, dname)
        del inputs
        # timing inputs: small x, so the residual (updated in place by every op) stays bounded
        x_time = _rand(shape, seed + 10 + rank, 1e-3, dtype, dev)
        r_time = _rand(shape, seed + 9, 1.0, dtype, dev)
        row, err = None, None
        try:
            made, why = be.make(name, mine.clone(), res.clone(), weight, args.eps)
            if made is None:  # decided from shapes alone: the same on every rank
                skipped.append({**base, "reason": why})
                if rank == 0:
                    print(f"[fused-bench {done}/{plan_total}] {name} {dname} h{hidden} t{tokens}: skipped: {why}",
                          flush=True)
                return
            op, outputs = made
            op()
            torch.cuda.synchronize()
            chk = check_result(*outputs(), ref_norm, ref_res, dname, args.world_size, slack)
            del made, op, outputs
            made, _ = be.make(name, x_time.clone(), r_time.clone(), w_time, args.eps)
            op, _ = made
            per_op = time_graph(torch, op, None, args.graph_ops, args.replays, be.capture_ctx.get(name))
            row = {**base, "bytes": tokens * hidden * ELEMENT_SIZE[dname], "timing": "graph",
                   "us_p50": round(statistics.median(per_op), 3), "us_p99": round(pct(per_op, 99), 3),
                   "samples": len(per_op), **chk}
            if name == "unfused":
                row["ar_path"] = unfused_path(be.dc, mine)
            if name == "yali-fused":  # the launch YALI chose for this shape (CTAs, CTAs per row, ...)
                row["yali_launch"] = be.yali.fused_launch(tokens, hidden, dtype)
            del made, op
        except Exception as e:
            err = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            if os.environ.get("BENCH_DEBUG"):
                traceback.print_exc()
        all_ok = agree(row is not None)
        all_correct = agree(row is not None and row["correct"])
        if not all_ok:
            skipped.append({**base, "reason": f"failed: {err or 'on another rank'}"})
            if rank == 0:
                print(f"[fused-bench {done}/{plan_total}] {name} {dname} h{hidden} t{tokens}: "
                      f"FAILED {err or 'on another rank'}", flush=True)
            return
        row["correct"] = all_correct  # correct on every rank
        rows.append(row)
        if rank == 0:
            print(f"[fused-bench {done}/{plan_total} {time.time() - t_start:5.0f}s] {name:17s} {dname} h{hidden:<6d} "
                  f"t{tokens:<5d} p50 {row['us_p50']:8.2f} us  p99 {row['us_p99']:8.2f} us  "
                  f"err {_fmt_err(row['max_abs_err_norm'])}{'' if row['correct'] else '  WRONG RESULT'}"
                  f"{'  [' + row['ar_path'] + ']' if 'ar_path' in row else ''}", flush=True)

    try:
        for dname in args.dtypes:
            dtype = dtypes[dname]
            for hidden in args.hidden:
                weight = _rand((hidden,), 7, 0.5, dtype, dev, offset=1.0)
                w_time = _rand((hidden,), 8, 0.01, dtype, dev)  # small: repeated in-place ops stay bounded
                # YALI and the unfused sequence first, FlashInfer after them: its JIT build (on a
                # fresh host) runs in the background meanwhile.
                for phase in (["yali-fused", "unfused"], ["flashinfer-trtllm"]):
                    names = [n for n in phase if n in be.names]
                    if not names:
                        continue
                    if phase == ["flashinfer-trtllm"]:
                        t0 = time.time()
                        reason = be.flashinfer_ready(args.budget_s - (time.time() - t_start)) or \
                            be.flashinfer_workspace(dtype, dname, hidden, args.tokens)
                        if rank == 0:
                            print(f"[fused-bench] FlashInfer {dname} hidden {hidden}: {reason or 'ready'} "
                                  f"({time.time() - t0:.1f}s)", flush=True)
                        if reason:
                            skipped.extend({"backend": "flashinfer-trtllm", "dtype": dname, "hidden": hidden,
                                            "tokens": t, "reason": reason} for t in args.tokens)
                            continue
                    for tokens in args.tokens:
                        for name in names:
                            measure(name, dname, dtype, hidden, tokens, weight, w_time)
                        torch.cuda.empty_cache()
    except _BudgetSpent:
        if rank == 0:
            print(f"[fused-bench] budget of {args.budget_s:.0f}s spent: stopping after {len(rows)} measurements",
                  flush=True)
    q.put((rank, {"rows": rows, "skipped": skipped, "skipped_backends": be.skipped, "setup": setup,
                  "budget_exhausted": budget_exhausted,
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
    args.shared_gpu = place_ranks(args.world_size)
    print(f"[fused-bench] {args.world_size} ranks, hidden {args.hidden}, tokens {args.tokens}, dtypes {args.dtypes}, "
          f"backends {args.backends}, budget {args.budget_s:.0f}s", flush=True)
    partial = _partial_path(args)
    try:
        res = run_ranks(worker, args, args.timeout, "fused benchmark", world_size=args.world_size)
        rc = 0
    except SystemExit as e:  # the ranks failed or hung: keep what rank 0 measured before
        if not os.path.exists(partial):
            raise
        with open(partial) as f:
            res = json.load(f)
        res["incomplete"] = f"{e}; the measurements before it are kept"
        print(f"[fused-bench] {res['incomplete']}", flush=True)
        rc = 1
    write_outputs(args, res)
    with contextlib.suppress(OSError):
        os.remove(partial)
    return rc


if __name__ == "__main__":
    sys.exit(main())
