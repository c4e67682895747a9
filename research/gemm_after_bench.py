#!/usr/bin/env python3
"""The decode gate_up GEMM after the kernel in front of it, on ONE GPU.

decode_gemm_bench.py (benchmarks/results/current/decode-gemm/20261122-gate-up) finds the cuBLAS gate_up GEMM
of the 70B model at TP=2 about 10 % slower after a plain launch of a small kernel (YALI's fused
op, torch's norm, vLLM's custom all-reduce) than after a thread block cluster launch (FlashInfer's
fused kernel, YALI's op launched as one cluster of 4 CTAs) or another GEMM, on most 2xH200
machines and the reverse on one. The effect needs no communication, so one GPU can look at it:
in front of each layer's gate_up GEMM this runs either nothing (GEMM after GEMM), torch's residual
add + rms_norm, or a probe kernel with the shape of YALI's fused op and no communication (research/
probe_kernels.cu, built here with nvcc) launched with a chosen grid, cluster size and programmatic
dependent launch (PDL). It also records how many clusters of 1/2/4/8/16 SM-filling CTAs the GPU
runs at once (cudaOccupancyMaxActiveClusters), which depends on how its SMs are spread over GPCs
and may be what tells machines apart.

Each predecessor P gets two CUDA graphs (--graphs), each over `--layers` layers with their own
weights:
  pair     P -> gate_up                                  (decode_gemm_bench's gate_up-after/<norm>)
  layers   P -> qkv -> o -> P -> gate_up -> down          (a decoder layer: decode_gemm_bench's layers/<norm>)
The 2-GPU host of current/decode-gemm/20261122-gate-up ran gate_up fast in the pair graph even after torch's
plain norm (109.5 us) and slow only in the decoder layer (118.4 us), so the layer graph is the one
to compare with it.
Per-layer time = replay time / layers (CUDA events, p50 over --replays); the torch profiler gives
each kernel's median duration, and the gate_up GEMM's (the largest) is the figure that matters.
The predecessors are measured in --rounds rounds, in reverse order on every other round, so a
drift shows as a difference between rounds.

  python -m research.gemm_after_bench                       # default predecessors, 32 layers
  python -m research.gemm_after_bench --preds none,torch,probe-4x4-pdl --rounds 5
  python -m research.gemm_after_bench --hidden 4096 --heads 32 --intermediate 14336   # the 8B model

Predecessor names: none, torch, probe-<grid>x<cluster>[-pdl]. Writes <out>/<name>.json (kind
decode-gemm, setup `one-gpu`) and <name>.md.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common.gpu_env import MULTICAST_OFF_ENV
from benchmarks.common.results import output_dir, REPO_ROOT, results_header, write_json_and_markdown
from benchmarks.common.timing import capture_graph, pct, replay_per_op
from research.decode_gemm_bench import _kernel_rows, add_shape_args, shapes_of

os.environ.update(MULTICAST_OFF_ENV)

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE_SRC = os.path.join(HERE, "probe_kernels.cu")
# YALI's fused op at 1 token of hidden 8192 bf16 runs 4 CTAs (4 KiB each), as one cluster of 4 since
# ed79736 and plainly before; FlashInfer's kernel runs clusters of 8; 128 CTAs is the op's widest grid.
DEFAULT_PREDS = ("none", "torch", "probe-4x1-pdl", "probe-4x4-pdl", "probe-4x1", "probe-4x4", "probe-4x2-pdl",
                 "probe-8x8-pdl", "probe-1x1-pdl", "probe-128x1-pdl", "probe-128x8-pdl")
GRAPHS = ("pair", "layers")
PRED_RE = re.compile(r"^(none|torch|probe-(\d+)x(\d+)(-pdl)?)$")
CLUSTER_SIZES = (1, 2, 4, 8, 16)


def parse_pred(name: str) -> dict:
    """'probe-4x4-pdl' -> {'name', 'kind': 'probe', 'grid': 4, 'cluster': 4, 'pdl': True}; none / torch."""
    m = PRED_RE.match(name.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"predecessor {name!r}: expected none, torch or probe-<grid>x<cluster>[-pdl]")
    if m.group(2) is None:
        return {"name": m.group(1), "kind": m.group(1)}
    grid, cluster = int(m.group(2)), int(m.group(3))
    if not (1 <= grid <= 1024 and cluster in (1, 2, 4, 8) and grid % cluster == 0):
        raise argparse.ArgumentTypeError(f"predecessor {name!r}: grid 1..1024, cluster 1/2/4/8 dividing the grid")
    return {"name": m.group(1), "kind": "probe", "grid": grid, "cluster": cluster, "pdl": m.group(4) is not None}


def parse_preds(text: str) -> list[dict]:
    preds = [parse_pred(p) for p in str(text).split(",") if p.strip()]
    if not preds:
        raise argparse.ArgumentTypeError("no predecessor named")
    return preds


def parse_graphs(text: str) -> list[str]:
    graphs = [g.strip() for g in str(text).split(",") if g.strip()]
    bad = [g for g in graphs if g not in GRAPHS]
    if bad or not graphs:
        raise argparse.ArgumentTypeError(f"graphs {bad or text!r}: expected a list of {', '.join(GRAPHS)}")
    return graphs


def graph_name(graph: str, pred: str) -> str:
    return f"gate_up-after/{pred}" if graph == "pair" else f"layers/{pred}"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preds", type=parse_preds, default=[parse_pred(p) for p in DEFAULT_PREDS],
                    help=f"comma-separated predecessors (default: {','.join(DEFAULT_PREDS)})")
    ap.add_argument("--graphs", type=parse_graphs, default=list(GRAPHS), help="pair, layers or both (default)")
    ap.add_argument("--layers", type=int, default=32, help="layers per graph, each with its own weights")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replays", type=int, default=20, help="timed graph replays per graph and round")
    add_shape_args(ap)
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no new round after this many seconds")
    ap.add_argument("--out", default=str(output_dir()))
    ap.add_argument("--name", default=None, help="result file stem (default gemm-after-<date>)")
    return ap


def build_probe(out_dir: str) -> ctypes.CDLL:
    """Compiles probe_kernels.cu for sm_90a with nvcc (a second or two) and loads it."""
    so = os.path.join(out_dir, "probe_kernels.so")
    cmd = ["nvcc", "-O3", "-shared", "-Xcompiler", "-fPIC", "-arch=sm_90a", "-o", so, PROBE_SRC]
    subprocess.run(cmd, check=True, timeout=300)
    lib = ctypes.CDLL(so)
    lib.probe_rmsnorm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_float]
    lib.probe_max_active_clusters.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    return lib


def max_active_clusters(lib) -> dict:
    """cluster size -> clusters of SM-filling CTAs the GPU runs at once (None where refused)."""
    out = {}
    for c in CLUSTER_SIZES:
        n = ctypes.c_int(0)
        out[str(c)] = n.value if lib.probe_max_active_clusters(c, ctypes.byref(n)) == 0 else None
    return out


def summarize(records: list[dict]) -> list[dict]:
    """Per graph and predecessor: median over rounds of the per-layer time and of the gate_up GEMM's
    and the predecessor's median kernel durations, and the GEMM's ratio to its time in the same
    kind of graph with `none` in front."""
    by = {}
    for r in records:
        by.setdefault((r["graph_kind"], r["pred"]), []).append(r)
    rows = []
    for (graph, pred), rs in by.items():
        row = {"graph": graph_name(graph, pred), "graph_kind": graph, "pred": pred, "rounds": len(rs),
               "layer_us": round(statistics.median(r["us_per_call"] for r in rs), 2),
               "gemm_us": round(statistics.median(r["gemm_us"] for r in rs), 2),
               "gemm_us_by_round": [r["gemm_us"] for r in rs]}
        pre = [r["pred_us"] for r in rs if r.get("pred_us") is not None]
        row["pred_us"] = round(statistics.median(pre), 2) if pre else None
        rows.append(row)
    base = {r["graph_kind"]: r["gemm_us"] for r in rows if r["pred"] == "none"}
    for r in rows:
        b = base.get(r["graph_kind"])
        r["gemm_vs_none"] = round(r["gemm_us"] / b, 3) if b else None
    return rows


def markdown(res: dict) -> str:
    lines = [f"# The gate_up GEMM after the kernel in front of it, one GPU ({res['host']})", "",
             (f"{res['layers']} layers, {res['tokens']} token(s), gate_up {res['shape'][0]}x{res['shape'][1]} bf16 "
              f"per layer (each layer its own weights). Per-layer time: CUDA events, p50 over replays, median over "
              f"rounds. Kernel times: torch profiler, median per call, median over rounds."), "",
             "`gate_up-after/P`: P -> gate_up per layer; `layers/P`: P -> qkv -> o -> P -> gate_up -> down per layer "
             "(`none`: no kernel in front; `in front us`: the kernels in front of one gate_up, pair graphs only).", "",
             "| graph | layer us | gate_up us | vs none | in front us | gate_up us by round |",
             "|---|---:|---:|---:|---:|---|"]
    for r in res["summary"]:
        lines.append(f"| {r['graph']} | {r['layer_us']:.2f} | {r['gemm_us']:.2f} | "
                     f"{r['gemm_vs_none'] if r['gemm_vs_none'] is not None else '-'} | "
                     f"{r['pred_us'] if r['pred_us'] is not None else '-'} | "
                     + ", ".join(f"{x:.2f}" for x in r["gemm_us_by_round"]) + " |")
    lines += ["", "Clusters of SM-filling CTAs the GPU runs at once (cudaOccupancyMaxActiveClusters), "
              f"{res['sm_count']} SMs: " + ", ".join(f"{k}: {v}" for k, v in res["max_active_clusters"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.name = args.name or "gemm-after-" + time.strftime("%Y%m%d")
    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    lib = build_probe(tempfile.mkdtemp(prefix="probe-"))
    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
    clusters = max_active_clusters(lib)
    print(f"[gemm-after] {torch.cuda.get_device_name(dev)}, {sm_count} SMs; max active clusters {clusters}", flush=True)

    shapes = shapes_of(args)
    n, k = shapes["gate_up"]
    kinds = ("gate_up", "qkv", "o", "down") if "layers" in args.graphs else ("gate_up",)
    dtype, T, H = torch.bfloat16, args.tokens, args.hidden
    layers = [{kind: torch.empty(shapes[kind], dtype=dtype, device=dev).uniform_(-1e-3, 1e-3) for kind in kinds}
              for _ in range(args.layers)]
    x = torch.randn((T, H), dtype=dtype, device=dev) * 1e-2
    resid = torch.randn((T, H), dtype=dtype, device=dev)
    norm_w = torch.ones(H, dtype=dtype, device=dev)
    normed = torch.empty_like(x)
    outs = {kind: torch.empty((T, shapes[kind][0]), dtype=dtype, device=dev) for kind in kinds}
    attn = torch.randn((T, shapes["o"][1]), dtype=dtype, device=dev) * 1e-2
    act = torch.randn((T, shapes["down"][1]), dtype=dtype, device=dev) * 1e-2

    def in_front(pred):
        if pred["kind"] == "torch":
            resid.add_(x)
            normed.copy_(torch.nn.functional.rms_norm(resid, (H,), norm_w, 1e-5))
        elif pred["kind"] == "probe":
            stream = torch.cuda.current_stream(dev).cuda_stream
            err = lib.probe_rmsnorm(stream, pred["grid"], pred["cluster"], int(pred["pdl"]), x.data_ptr(),
                                    norm_w.data_ptr(), normed.data_ptr(), T, H, 1e-5)
            if err:
                raise RuntimeError(f"probe_rmsnorm {pred['name']}: cudaError {err}")
        return x if pred["kind"] == "none" else normed

    def pair(pred):
        for layer in layers:
            torch.matmul(in_front(pred), layer["gate_up"].t(), out=outs["gate_up"])

    def decoder_layers(pred):  # o and down write x, which the next predecessor reads, as in a model
        for layer in layers:
            torch.matmul(in_front(pred), layer["qkv"].t(), out=outs["qkv"])
            torch.matmul(attn, layer["o"].t(), out=x)
            torch.matmul(in_front(pred), layer["gate_up"].t(), out=outs["gate_up"])
            torch.matmul(act, layer["down"].t(), out=x)

    bodies = {"pair": pair, "layers": decoder_layers}

    # The probe computes what torch's rms_norm computes (no residual): check it once.
    in_front(parse_pred("probe-4x4-pdl"))
    ref = torch.nn.functional.rms_norm(x.float(), (H,), norm_w.float(), 1e-5).to(dtype)
    torch.cuda.synchronize()
    if not torch.allclose(normed.float(), ref.float(), rtol=1e-2, atol=1e-3):
        raise SystemExit("[gemm-after] the probe kernel's output differs from torch's rms_norm")

    from torch.profiler import ProfilerActivity, profile

    records, t0 = [], time.time()
    for rnd in range(args.rounds):
        if rnd and time.time() - t0 > args.budget_s:
            print(f"[gemm-after] budget of {args.budget_s:.0f}s spent: stopping after {rnd} rounds", flush=True)
            break
        plan = [(graph, pred) for graph in args.graphs for pred in args.preds]
        order = plan if rnd % 2 == 0 else list(reversed(plan))
        for i, (graph, pred) in enumerate(order, 1):
            body = bodies[graph]
            g = capture_graph(torch, lambda _, pred=pred, body=body: body(pred), None, 1, None, warmups=1)
            per_layer = [us / args.layers for us in replay_per_op(torch, g, 1, args.replays)]
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    g.replay()
                torch.cuda.synchronize()
            kernels = _kernel_rows(prof, 3)
            gemm = max(kernels, key=lambda r: r["us_per_call"])  # gate_up: the largest weight by far
            others = [r for r in kernels if r is not gemm and r["calls"] >= 1] if graph == "pair" else []
            rec = {"setup": "one-gpu", "graph": graph_name(graph, pred["name"]), "graph_kind": graph,
                   "name": pred["name"], "pred": pred["name"], "round": rnd, "tokens": T,
                   "us_per_call": round(pct(per_layer, 50), 3),
                   "us_p99": round(pct(per_layer, 99), 3), "gemm_kernel": gemm["name"],
                   "gemm_us": round(gemm["us_per_call"], 3),
                   # the kernels in front of one GEMM: calls per replay / layers of each
                   "pred_us": round(sum(r["us_per_call"] * r["calls"] for r in others) / args.layers, 3)
                   if others else None,
                   "kernels": [{kk: (round(v, 3) if isinstance(v, float) else v) for kk, v in r.items()
                                if kk != "durations_us"} for r in kernels]}
            records.append(rec)
            print(f"[gemm-after] round {rnd + 1}/{args.rounds} {i}/{len(order)} {rec['graph']}: layer "
                  f"{rec['us_per_call']:.2f} us, gate_up {rec['gemm_us']:.2f} us", flush=True)
            del g

    res = {"records": records, "layers": args.layers, "tokens": T, "shape": [n, k], "sm_count": sm_count,
           "max_active_clusters": clusters, "summary": summarize(records)}
    hdr = results_header("decode-gemm", {
        "method": "one GPU, one process; CUDA graphs over layers, each with its own weights: predecessor -> gate_up "
                  "(pair) and predecessor -> qkv -> o -> predecessor -> gate_up -> down (layers); per-layer time by "
                  "CUDA events (p50 over replays), kernel durations by the torch profiler; rounds alternate the order",
        "graphs": args.graphs,
        "layers": args.layers, "tokens": T, "shape": [n, k], "sm_count": sm_count,
        "max_active_clusters": clusters, "summary": res["summary"]})
    hdr["records"] = records
    res["host"] = hdr["host"]
    md = markdown(res)
    path = write_json_and_markdown(args.out, args.name, hdr, md)
    print(md)
    print(f"[gemm-after] wrote {path}", flush=True)
    return 0 if records else 1


if __name__ == "__main__":
    sys.exit(main())
