#!/usr/bin/env python3
"""Can a decode GEMM stream its weights while the all-reduce in front of it runs? (ONE GPU)

In a TP=2 decoder layer the GEMM after an all-reduce (qkv, gate_up) needs the all-reduce's result
only for its activations, not for its weights. prefetch_gemm.cu (beside this file, built here with
nvcc) starts the weight stream before `griddepcontrol.wait`; launched with programmatic dependent
launch (PDL) behind a kernel that triggers `griddepcontrol.launch_dependents` at its start, it loads
weights while that kernel runs. This measures, per shape and token count M:

  alone   cuBLAS (torch.mm(x, W.t(), out=y), what F.linear runs) and the kernel, each alone, and
          the stand-in alone (a kernel that spins --standin-us and then writes x, as an all-reduce
          would);
  behind  stand-in -> cuBLAS, stand-in (triggering) -> kernel with PDL, and stand-in -> kernel
          plainly launched (the control: no overlap possible);

each as a CUDA graph of --steps layers (weights cycling over enough copies that L2 holds none of
them), timed with CUDA events over --replays replays, in --rounds rounds (reverse order on every
other round). Per-layer time = replay time / steps, median over replays, then over rounds. The
share of the stand-in a GEMM hides is (t(stand-in) + t(GEMM alone) - t(stand-in + GEMM)) / t(stand-in).

Decision rule (printed at the end, PASS/FAIL per shape): build the decode path only if the kernel
is within 1 % of cuBLAS alone and hides at least half of the stand-in's time, at every M.

  python3 -m research.decode_prefetch.bench --out "$OUT"                 # from the repo root
  python3 -m research.decode_prefetch.bench --out /tmp/dp --shapes 8b-qkv --tokens 1,8

Writes <out>/<name>.json (kind decode-prefetch, world_size 1) and <name>.md.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common.gpu_env import MULTICAST_OFF_ENV
from benchmarks.common.results import results_header, write_json_and_markdown

os.environ.update(MULTICAST_OFF_ENV)

HERE = Path(__file__).resolve().parent
KERNEL_SRC = HERE / "prefetch_gemm.cu"
KIND = "decode-prefetch"

# TP=2 decode GEMMs after the all-reduce: name -> (N, K) of W[N, K].
SHAPES = {
    "8b-qkv": ((32 + 2 * 8) * 128 // 2, 4096),
    "8b-gate_up": (2 * 14336 // 2, 4096),
    "70b-qkv": ((64 + 2 * 8) * 128 // 2, 8192),
    "70b-gate_up": (2 * 28672 // 2, 8192),
}
TOKENS = (1, 2, 4, 8, 16, 32, 64)
MAX_TOKENS = 64

MAX_SLOWDOWN = 0.01  # the kernel alone at most 1 % slower than cuBLAS alone
MIN_HIDDEN = 0.5  # and hides at least half of the stand-in
RULE = ("build the decode path only if the kernel is within 1 % of cuBLAS alone and hides at least half "
        "of the stand-in's time")

# Graph names: what each layer of the graph launches.
VARIANTS = ("cublas", "ours", "standin", "cublas_after", "ours_after_pdl", "ours_after_plain")
WEIGHT_BYTES_PER_SHAPE = 1 << 30  # distinct weight copies per shape: several times any L2
MAX_LAYERS = 32


# ------------------------------------------------------------------------------------ arguments
def _choices(text: str, allowed, what: str) -> list[str]:
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if not items or bad:
        raise argparse.ArgumentTypeError(f"{what}: {', '.join(bad) or 'none given'}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(items))


def shape_list(text: str) -> list[str]:
    return _choices(text, SHAPES, "shapes")


def token_list(text: str) -> list[int]:
    try:
        toks = sorted({int(s) for s in str(text).split(",") if s.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"tokens: {text!r} is not a comma-separated list of integers") from None
    if not toks or toks[0] < 1 or toks[-1] > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"tokens: each between 1 and {MAX_TOKENS}")
    return toks


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not positive")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for <name>.json and <name>.md")
    ap.add_argument("--name", default=None, help="result file stem (default decode-prefetch-<date>)")
    ap.add_argument("--shapes", type=shape_list, default=list(SHAPES), help=f"default {','.join(SHAPES)}")
    ap.add_argument("--tokens", type=token_list, default=list(TOKENS), help="M values, default 1,2,4,...,64")
    ap.add_argument("--rounds", type=positive(int), default=5)
    ap.add_argument("--replays", type=positive(int), default=20, help="timed replays per graph and round")
    ap.add_argument("--steps", type=positive(int), default=64, help="layers per graph")
    ap.add_argument("--standin-us", type=positive(float), default=4.0, help="the stand-in's spin")
    ap.add_argument("--standin-ctas", type=positive(int), default=16, help="the stand-in's CTAs (512 threads)")
    ap.add_argument("--grid", type=positive(int), default=None, help="the kernel's CTAs (default: one per SM)")
    ap.add_argument("--budget-s", type=positive(float), default=200.0,
                    help="measure no new shape and M after this many seconds")
    return ap


# --------------------------------------------------------------------------------- summarizing
def hidden_share(standin_us: float, gemm_us: float, pair_us: float) -> float:
    """The share of the stand-in's time a GEMM behind it hides."""
    return (standin_us + gemm_us - pair_us) / standin_us


def summarize(times: dict[str, float]) -> dict[str, float]:
    """Per-layer µs of every variant -> the figures the decision reads."""
    return {
        "ours_vs_cublas": times["ours"] / times["cublas"] - 1.0,
        "cublas_hidden": hidden_share(times["standin"], times["cublas"], times["cublas_after"]),
        "ours_hidden": hidden_share(times["standin"], times["ours"], times["ours_after_pdl"]),
        "ours_plain_hidden": hidden_share(times["standin"], times["ours"], times["ours_after_plain"]),
    }


def passes(record: dict) -> bool:
    return bool(record["correct"] and record["ours_vs_cublas"] <= MAX_SLOWDOWN
                and record["ours_hidden"] >= MIN_HIDDEN)


def decide(records: list[dict], shapes: list[str], tokens: list[int]) -> dict[str, str]:
    """shape -> PASS (every M asked for measured and passing), FAIL, or INCOMPLETE (some M not
    measured, none failing)."""
    out = {}
    for shape in shapes:
        rows = [r for r in records if r["shape"] == shape]
        if any(not r["pass"] for r in rows):
            out[shape] = "FAIL"
        elif sorted(r["tokens"] for r in rows) != sorted(tokens):
            out[shape] = "INCOMPLETE"
        else:
            out[shape] = "PASS"
    return out


def markdown(res: dict) -> str:
    v = res["versions"]
    lines = [
        "# Decode GEMM with weight prefetch under PDL (one GPU)",
        "",
        f"- command: `{res['command']}`",
        f"- date: {res['date']}; GPU: {res['gpu']} ({res['host']}); torch {v.get('torch')}, CUDA {v.get('cuda')}, "
        f"nvcc {res['nvcc']}; git {v.get('git')}",
        f"- stand-in: {res['standin']['ctas']} CTAs x 512 threads spinning {res['standin']['us']} us, then "
        f"writing x; graphs of {res['steps']} layers, {res['rounds']} rounds x {res['replays']} replays",
        "- us: per-layer time, median over replays then rounds; hidden: share of the stand-in's time the "
        "GEMM behind it hides; TB/s: weight bytes / time alone",
        "",
        "| shape | M | cuBLAS us | ours us | ours vs cuBLAS | stand-in us | cuBLAS behind | ours behind (PDL) "
        "| ours behind (plain) | hidden cuBLAS | hidden ours | hidden ours plain | TB/s cuBLAS | TB/s ours "
        "| correct | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in res["records"]:
        t = r["us"]
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {t['cublas']:.2f} | {t['ours']:.2f} | {100 * r['ours_vs_cublas']:+.1f} % "
            f"| {t['standin']:.2f} | {t['cublas_after']:.2f} | {t['ours_after_pdl']:.2f} | {t['ours_after_plain']:.2f} "
            f"| {100 * r['cublas_hidden']:.0f} % | {100 * r['ours_hidden']:.0f} % | {100 * r['ours_plain_hidden']:.0f} % "
            f"| {r['cublas_tbps']:.2f} | {r['ours_tbps']:.2f} | {'yes' if r['correct'] else 'NO'} "
            f"| {'PASS' if r['pass'] else 'FAIL'} |")
    lines += ["", f"Rule: {res['rule']}.", ""]
    lines += [f"- {shape}: **{verdict}**" for shape, verdict in res["decision"].items()]
    if res.get("skipped"):
        lines += ["", f"Not measured (time budget): {', '.join(res['skipped'])}"]
    return "\n".join(lines) + "\n"


def write_result(out_dir: str, name: str, res: dict) -> Path:
    return write_json_and_markdown(out_dir, name, res, markdown(res))


# ----------------------------------------------------------------------------------------- GPU
def nvcc_path() -> str:
    return shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")


def nvcc_version() -> str | None:
    try:
        out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((ln.split("release")[-1].strip() for ln in out.splitlines() if "release" in ln), None)


def build_library(build_dir: str) -> ctypes.CDLL:
    """Compiles prefetch_gemm.cu for sm_90a with nvcc and loads it."""
    so = os.path.join(build_dir, "prefetch_gemm.so")
    cmd = [nvcc_path(), "-O3", "-shared", "-Xcompiler", "-fPIC", "-gencode=arch=compute_90a,code=sm_90a",
           "-o", so, str(KERNEL_SRC)]
    subprocess.run(cmd, check=True, timeout=300)
    lib = ctypes.CDLL(so)
    lib.pg_plan.argtypes = [ctypes.c_int] * 4 + [ctypes.POINTER(ctypes.c_int)]
    lib.pg_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.pg_standin.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_longlong]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with cudaError {rc}")


def plan_of(lib, m: int, n: int, k: int, grid: int) -> dict:
    out = (ctypes.c_int * 7)()
    _check(lib.pg_plan(m, n, k, grid, out), f"plan M={m} N={n} K={k} grid={grid}")
    return dict(zip(("grid", "kc", "stages", "row_alloc", "tok_alloc", "stride", "smem"), out))


class Layer:
    """One shape's buffers on the GPU and the launches a graph's layer makes."""

    def __init__(self, torch, lib, args, n: int, k: int, grid: int, layers: int):
        self.torch, self.lib, self.n, self.k, self.grid = torch, lib, n, k, grid
        self.standin_ns = int(args.standin_us * 1000)
        self.standin_ctas = args.standin_ctas
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
                        for _ in range(layers)]
        self.src = torch.randn(MAX_TOKENS, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.x = torch.empty_like(self.src)  # written by the stand-in
        self.y = torch.empty(MAX_TOKENS, n, device="cuda", dtype=torch.bfloat16)
        self.m = 1

    def _stream(self) -> int:
        return self.torch.cuda.current_stream().cuda_stream

    def standin(self, trigger: bool) -> None:
        _check(self.lib.pg_standin(self._stream(), self.standin_ctas, self.standin_ns, int(trigger),
                                   self.src.data_ptr(), self.x.data_ptr(), self.m * self.k * 2), "stand-in")

    def ours(self, i: int, pdl: bool) -> None:
        _check(self.lib.pg_gemm(self._stream(), int(pdl), self.weights[i].data_ptr(), self.x.data_ptr(),
                                self.y.data_ptr(), self.m, self.n, self.k, self.grid), "prefetch_gemm")

    def cublas(self, i: int) -> None:
        self.torch.mm(self.x[: self.m], self.weights[i].t(), out=self.y[: self.m])

    def launch(self, variant: str, i: int) -> None:
        if variant == "cublas":
            self.cublas(i)
        elif variant == "ours":
            self.ours(i, pdl=False)
        elif variant == "standin":
            self.standin(trigger=True)
        elif variant == "cublas_after":
            self.standin(trigger=True)
            self.cublas(i)
        elif variant == "ours_after_pdl":
            self.standin(trigger=True)
            self.ours(i, pdl=True)
        elif variant == "ours_after_plain":
            self.standin(trigger=False)
            self.ours(i, pdl=False)
        else:
            raise ValueError(variant)

    def check(self) -> dict:
        """Both GEMMs against an fp32 reference, the kernel behind the stand-in that writes its x."""
        torch, m = self.torch, self.m
        w = self.weights[0]
        ref = self.src[:m].float() @ w.float().t()
        self.x.fill_(float("nan"))
        self.launch("ours_after_pdl", 0)
        ours = self.y[:m].float()
        torch.cuda.synchronize()
        self.launch("cublas_after", 0)
        cublas = self.y[:m].float()
        torch.cuda.synchronize()
        # bf16 output: half an ulp is 2^-8 relative; allow 2^-7 plus a small absolute term.
        tol = 2.0 ** -7 * ref.abs() + 1e-3 * ref.abs().max()
        ours_err = (ours - ref).abs()
        return {"correct": bool(torch.isfinite(ours).all() and (ours_err <= tol).all()),
                "max_err_ours": float(ours_err.max()), "max_err_cublas": float((cublas - ref).abs().max()),
                "max_ref": float(ref.abs().max())}


def capture(torch, layer: Layer, variant: str, steps: int):
    for i in range(2):  # eager warm-up (cuBLAS picks its kernel, attributes are set) outside capture
        layer.launch(variant, i % len(layer.weights))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(steps):
            layer.launch(variant, i % len(layer.weights))
    torch.cuda.synchronize()
    return g


def replay_us(torch, g, steps: int, replays: int) -> float:
    """Median per-layer µs over `replays` back-to-back replays (after one untimed)."""
    g.replay()
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(replays + 1)]
    evs[0].record()
    for i in range(replays):
        g.replay()
        evs[i + 1].record()
    evs[-1].synchronize()
    return statistics.median(evs[i].elapsed_time(evs[i + 1]) * 1000.0 / steps for i in range(replays))


def measure(torch, layer: Layer, args) -> tuple[dict, dict]:
    """Per-layer µs per variant (median over rounds) and each round's figures."""
    graphs = {v: capture(torch, layer, v, args.steps) for v in VARIANTS}
    per_round: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rnd in range(args.rounds):
        for v in VARIANTS if rnd % 2 == 0 else reversed(VARIANTS):
            per_round[v].append(replay_us(torch, graphs[v], args.steps, args.replays))
    del graphs
    return {v: statistics.median(xs) for v, xs in per_round.items()}, per_round


def run(args) -> dict:
    import torch

    start = time.monotonic()
    props = torch.cuda.get_device_properties(0)
    grid = args.grid or props.multi_processor_count
    with tempfile.TemporaryDirectory(prefix="decode-prefetch-") as build_dir:
        print(f"[decode-prefetch] building {KERNEL_SRC.name} with {nvcc_path()}", flush=True)
        lib = build_library(build_dir)
        records, skipped, plans = [], [], {}
        for shape in args.shapes:
            n, k = SHAPES[shape]
            wbytes = n * k * 2
            layers = max(2, min(MAX_LAYERS, math.ceil(WEIGHT_BYTES_PER_SHAPE / wbytes)))
            layer = Layer(torch, lib, args, n, k, grid, layers)
            for m in args.tokens:
                if time.monotonic() - start > args.budget_s:
                    skipped.append(f"{shape}/M={m}")
                    continue
                layer.m = m
                plans[f"{shape}/M={m}"] = plan_of(lib, m, n, k, grid)
                check = layer.check()
                times, rounds = measure(torch, layer, args)
                rec = {"shape": shape, "n": n, "k": k, "tokens": m, "weight_bytes": wbytes, "weight_copies": layers,
                       "us": times, "us_rounds": rounds, **summarize(times), **check,
                       "cublas_tbps": wbytes / times["cublas"] / 1e6, "ours_tbps": wbytes / times["ours"] / 1e6}
                rec["pass"] = passes(rec)
                records.append(rec)
                print(f"[decode-prefetch] {shape:12s} M={m:2d}: cuBLAS {times['cublas']:8.2f} us, ours "
                      f"{times['ours']:8.2f} us ({100 * rec['ours_vs_cublas']:+.1f} %), stand-in {times['standin']:.2f} "
                      f"us hidden: cuBLAS {100 * rec['cublas_hidden']:.0f} %, ours {100 * rec['ours_hidden']:.0f} % "
                      f"(plain {100 * rec['ours_plain_hidden']:.0f} %), correct {rec['correct']} "
                      f"[{time.monotonic() - start:.0f} s]", flush=True)
            del layer
            torch.cuda.empty_cache()
    return results_header(KIND, {
        "world_size": 1,
        "gpu": props.name,
        "nvcc": nvcc_version(),
        "rule": RULE,
        "standin": {"us": args.standin_us, "ctas": args.standin_ctas, "threads": 512},
        "grid": grid,
        "steps": args.steps,
        "rounds": args.rounds,
        "replays": args.replays,
        "plans": plans,
        "skipped": skipped,
        "decision": decide(records, args.shapes, args.tokens),
        "records": records,
    })


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    res = run(args)
    name = args.name or time.strftime("decode-prefetch-%Y%m%d-%H%M%S")
    path = write_result(args.out, name, res)
    print(f"[decode-prefetch] wrote {path} and {path.with_suffix('.md')}")
    print(f"[decode-prefetch] rule: {RULE}")
    for shape, verdict in res["decision"].items():
        print(f"[decode-prefetch] {shape}: {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
