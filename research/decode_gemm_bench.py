#!/usr/bin/env python3
"""The decode GEMMs of the 70B-class model at TP=2 with every layer's weights resident, in fresh
process pairs with and without YALI's buffers mapped before the weights.

Why: in the concurrency-1 serving profiles (benchmarks/results/current/serving/20261122-70b-c1, current/serving/20261122-70b-c1-size-table) the
gate_up GEMM (the same cuBLAS kernel in both servers) takes ~118 us per call in the yali server
and ~108 us in vllm-default's, which is the whole end-to-end loss, while the same GEMM on one
weight in a microbenchmark runs at ~107 us with or without YALI's fused op before it. The serving
model differs from that microbenchmark in what this script puts back: all 80 layers' weights
(64 GiB per GPU) and a KV-cache-sized allocation are resident, each GEMM reads a different weight,
the process's memory is laid out after the communicators mapped their buffers, and the kernels
between the GEMMs are a decoder layer's. Each setup is a fresh pair of
processes (rank r on GPU r), so each lays its memory out from scratch:

  plain        no communicator at all
  yali-first   YaliCommunicator created before the weights (the order vLLM's plugin uses)
  yali-after   created after the weights and the KV-cache filler
  vllm         vLLM's distributed state, YALI's communicator, FlashInfer's fusion workspace and
               vLLM's custom all-reduce created before the weights (as in a vLLM server)

Graphs measured in every setup (CUDA graphs, per-call time = replay time / layers, p50 and p99
over --replays replays, CUDA events):

  <gemm>             one GEMM kind (qkv, o, gate_up, down) once per layer, each layer's own weight
  gate_up-one        gate_up on layer 0's weight --layers times: the same bytes with the TLB warm
  layers/<norm>      a decoder layer per layer: norm -> qkv -> o -> norm -> gate_up -> down
  gate_up-after/<norm>  norm -> gate_up per layer: the pair the serving profiles differ in
where <norm> is each kernel set a layer can run between its GEMMs in that setup: `torch` (residual
add + torch's rms_norm, no communication: every setup), `yali` (YALI's fused all-reduce + add +
RMSNorm), `flashinfer` (FlashInfer's fused kernel as vLLM's fusion calls it) and `unfused` (vLLM's
custom all-reduce + its fused_add_rms_norm). The graphs with a norm are also profiled (torch
profiler, median us per call of each kernel name). nvidia-smi samples both GPUs while the setups
run (--monitor-ms; <name>-smi.csv), and each timed graph gets GPU 0's mean SM clock and power and
its throttle reasons during its replays.

Writes <out>/<name>.json (kind decode-gemm), <name>.md.

  python -m research.decode_gemm_bench --setups vllm           # every norm in one vLLM-like process
  python -m research.decode_gemm_bench                         # 70B TP=2 shapes, all setups
  python -m research.decode_gemm_bench --layers 8 --fill-gib 0  # a quick look
  python -m research.decode_gemm_bench --report-only benchmarks/results/current/decode-gemm/20261122-gate-up/decode-gemm-20261122-s9.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.common.gpu_env import MULTICAST_OFF_ENV
from benchmarks.common.processes import run_two_ranks
from benchmarks.common.results import output_dir, REPO_ROOT, results_header, run_probe, write_json_and_markdown
from benchmarks.common.timing import capture_graph, pct, replay_per_op

os.environ.update(MULTICAST_OFF_ENV)

KIND = "decode-gemm"
SETUPS = ("plain", "yali-first", "yali-after", "vllm")
GiB = 1 << 30


def gemm_shapes(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, tp: int) -> dict:
    """(out_features, in_features) of each linear layer on one rank: column-parallel QKV and
    gate_up split their outputs, row-parallel o and down split their inputs."""
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim // tp, hidden),
        "o": (hidden, heads * head_dim // tp),
        "gate_up": (2 * intermediate // tp, hidden),
        "down": (hidden, intermediate // tp),
    }


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The model and batch whose decode GEMMs are run: the 70B model at TP=2, 1 token, by default."""
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=28672)
    ap.add_argument("--tokens", type=int, default=1, help="rows of every GEMM's input (decode batch)")


def shapes_of(args: argparse.Namespace) -> dict:
    """gemm_shapes of the model add_shape_args describes, at TP=2."""
    return gemm_shapes(args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate, 2)


def parse_setups(text: str) -> list[str]:
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if part not in SETUPS:
            raise argparse.ArgumentTypeError(f"--setups: unknown setup {part!r} (choose from {', '.join(SETUPS)})")
        if part not in out:
            out.append(part)
    if not out:
        raise argparse.ArgumentTypeError("--setups: empty list")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", type=parse_setups, default=list(SETUPS),
                    help="comma list of " + ", ".join(SETUPS) + " (default: all, in that order)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the setup list this many times (fresh processes each time)")
    ap.add_argument("--layers", type=int, default=80)
    add_shape_args(ap)
    ap.add_argument("--fill-gib", type=float, default=None,
                    help="KV-cache-like allocation after the weights, GiB per GPU in --layers pieces "
                         "(default: all but --leave-gib of what is free)")
    ap.add_argument("--leave-gib", type=float, default=10.0)
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument("--replays", type=int, default=30, help="timed graph replays = samples")
    ap.add_argument("--monitor-ms", type=int, default=100,
                    help="sample both GPUs' SM clock, power, temperatures and throttle reasons with nvidia-smi "
                         "this often while measuring (0 = off; default %(default)s)")
    ap.add_argument("--setup-timeout", type=float, default=240.0, help="kill a setup's pair after this")
    ap.add_argument("--out", default=str(output_dir()))
    ap.add_argument("--name", default=None, help="result file stem (default decode-gemm-<date>)")
    ap.add_argument("--report-only", metavar="JSON", help="rebuild the table from a result file")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.name is None:
        args.name = "decode-gemm-" + time.strftime("%Y%m%d")
    for key in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "tokens", "replays", "repeats"):
        if getattr(args, key) <= 0:
            raise SystemExit(f"--{key.replace('_', '-')} {getattr(args, key)}: must be positive")
    if args.hidden % 8:
        raise SystemExit(f"--hidden {args.hidden}: must be a multiple of 8 (16-byte rows)")
    if args.heads % 2 or args.kv_heads % 2 or args.intermediate % 2:
        raise SystemExit("--heads, --kv-heads and --intermediate must split over 2 ranks")
    return args


# ----------------------------------------------------------------------------- report
def summarize(records: list[dict]) -> list[dict]:
    """Per graph (GEMM kind or `layers`): the median over repeats of each setup's per-call p50
    and its ratio to `plain`."""
    by = {}
    for r in records:
        if r.get("source") != "events":
            continue
        by.setdefault(r["graph"], {}).setdefault(r["setup"], []).append(r["us_per_call"])
    rows = []
    for graph, per in by.items():
        row = {"graph": graph, "us": {s: round(statistics.median(v), 2) for s, v in per.items()},
               "samples": {s: len(v) for s, v in per.items()}}
        base = row["us"].get("plain")
        row["vs_plain"] = {s: round(u / base, 3) for s, u in row["us"].items() if base and s != "plain"}
        rows.append(row)
    return rows


def markdown_table(res: dict) -> str:
    setups = [s for s in SETUPS if any(r["setup"] == s for r in res["records"])]
    lines = [
        ("Per-call time (us, p50 over replays, median over repeats) of each GEMM kind over all layers' "
         "weights, rank 0; ratio to `plain` in brackets."), "",
        "| graph | " + " | ".join(setups) + " |",
        "|---|" + "---:|" * len(setups),
    ]
    for row in res["summary"]:
        cells = []
        for s in setups:
            u = row["us"].get(s)
            if u is None:
                cells.append("-")
                continue
            ratio = row["vs_plain"].get(s)
            cells.append(f"{u:.2f}" + (f" ({ratio:.3f})" if ratio else ""))
        lines.append(f"| {row['graph']} | " + " | ".join(cells) + " |")
    prof = [r for r in res["records"] if r.get("source") == "profiler"]
    if prof:
        lines += ["", ("Kernels of the graphs with a norm (torch profiler, rank 0, first repeat, the top four by "
                       "time): median us per call."), "",
                  "| setup | graph | kernel | calls per replay | median us |", "|---|---|---|---:|---:|"]
        shown = {}
        for r in prof:
            key = (r["setup"], r["graph"])
            shown[key] = shown.get(key, 0) + 1
            if shown[key] > 4:
                continue
            lines.append(f"| {r['setup']} | {r['graph']} | `{r['name'][:80]}` | {r['calls']:.1f} | "
                         f"{r['us_per_call']:.2f} |")
    state = [r for r in res["records"] if r.get("source") == "events" and "gpu0" in r]
    if state:
        lines += ["", ("GPU 0 while each graph was timed (nvidia-smi samples inside the timed replays): mean SM clock "
                       "and power, hottest memory temperature, throttle reasons (0x4 power cap, 0x20/0x40 thermal)."), "",
                  "| setup | repeat | graph | us | SM MHz | power W | mem C | reasons | samples |",
                  "|---|---:|---|---:|---:|---:|---:|---|---:|"]
        for r in state:
            g = r["gpu0"]
            lines.append(f"| {r['setup']} | {r['repeat']} | {r['graph']} | {r['us_per_call']:.2f} | {g['sm_mhz']} | "
                         f"{g['power_w']} | {g['temp_mem_c']} | {g['reasons']} | {g['samples']} |")
    meta = res.get("setup_info", [])
    if meta:
        lines += ["", "| setup | repeat | free GiB after weights | filler GiB | gate_up weights 2-MiB aligned |",
                  "|---|---:|---:|---:|---:|"]
        for m in meta:
            lines.append(f"| {m['setup']} | {m['repeat']} | {m['free_gib_after_weights']:.1f} | "
                         f"{m['fill_gib']:.1f} | {m['gate_up_aligned_2mib']}/{m['layers']} |")
    return "\n".join(lines) + "\n"


def write_outputs(args, res: dict) -> str:
    res["summary"] = summarize(res["records"])
    hdr = results_header(KIND, {
        "method": "fresh process pair per setup; CUDA graph per GEMM kind over all layers' weights, per-call time = "
                  "replay time / calls (CUDA events), p50/p99 over replays; the layers graph's kernels by the torch "
                  "profiler",
        "shapes": res["shapes"],
        "tokens": args.tokens,
        "layers": args.layers,
        "summary": res["summary"],
        "setup_info": res["setup_info"],
        "errors": res["errors"],
    })
    hdr["records"] = res["records"]
    md = f"# Decode GEMMs with all weights resident ({hdr['host']})\n\n" + markdown_table(res)
    return str(write_json_and_markdown(args.out, args.name, hdr, md))


def report_only(path: str) -> str:
    with open(path) as f:
        doc = json.load(f)
    res = {"records": doc["records"], "setup_info": doc.get("setup_info", [])}
    res["summary"] = summarize(res["records"])
    md = markdown_table(res)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(f"# Decode GEMMs with all weights resident ({doc.get('host')})\n\n" + md)
    return md


# ----------------------------------------------------------------------------- GPU clocks and power
SMI_FIELDS = ["index", "timestamp", "clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "temperature.memory"]
# clocks_event_reasons.active (driver >= 535; older: clocks_throttle_reasons.active), a bit mask:
# 0x1 idle, 0x4 software power cap, 0x8 hardware slowdown, 0x20 software thermal, 0x40 hardware
# thermal, 0x80 hardware power brake.
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


class GpuMonitor:
    """nvidia-smi sampling both GPUs every `interval_ms` into `path` while the setups run, so that
    each timed graph can be given the SM clock, power and throttle reasons it ran under."""

    def __init__(self, path: str, interval_ms: int):
        import shutil
        import subprocess

        self.proc, self.path, self.fields = None, path, None
        if shutil.which("nvidia-smi") is None:
            print("[decode-gemm] no nvidia-smi: clocks and power are not recorded", flush=True)
            return
        # the throttle-reason field this driver knows (run_probe: None when nvidia-smi refuses it)
        reason = next((f for f in REASON_FIELDS if run_probe(["nvidia-smi", f"--query-gpu={f}", "--format=csv,noheader"])
                       is not None), None)
        self.fields = [*SMI_FIELDS, reason] if reason else list(SMI_FIELDS)
        self.out = open(path, "w")
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=" + ",".join(self.fields),
                                      "--format=csv,noheader,nounits", "--loop-ms", str(interval_ms)],
                                     stdout=self.out, stderr=subprocess.DEVNULL)

    def stop(self) -> list[dict]:
        if self.proc is None:
            return []
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.out.close()
        with open(self.path) as f:
            return parse_smi(f.read(), self.fields)


def _num(text: str):
    try:
        return float(text)
    except ValueError:
        return None


def parse_smi(text: str, fields: list[str]) -> list[dict]:
    """nvidia-smi CSV lines (no header, no units) -> [{"gpu", "t" (epoch s), "sm_mhz", ...}]."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(fields):
            continue
        row = dict(zip(fields, cells))
        try:
            t = time.mktime(time.strptime(row["timestamp"].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            t += float("0." + row["timestamp"].split(".")[1]) if "." in row["timestamp"] else 0.0
            gpu = int(row["index"])
        except (ValueError, IndexError):
            continue
        reasons = next((row[f] for f in REASON_FIELDS if f in row), None)
        out.append({"gpu": gpu, "t": t, "sm_mhz": _num(row["clocks.sm"]), "mem_mhz": _num(row["clocks.mem"]),
                    "power_w": _num(row["power.draw"]), "temp_c": _num(row["temperature.gpu"]),
                    "temp_mem_c": _num(row["temperature.memory"]),
                    "reasons": int(reasons, 16) if reasons and reasons.startswith("0x") else None})
    return out


def attach_gpu_state(records: list[dict], samples: list[dict], gpu: int = 0) -> None:
    """Gives each timed record (t_start/t_end) the mean SM clock and power, the hottest memory
    temperature and the union of throttle reasons of `gpu`'s samples inside its window."""
    for r in records:
        if "t_start" not in r:
            continue
        inside = [s for s in samples if s["gpu"] == gpu and r["t_start"] <= s["t"] <= r["t_end"]]
        if not inside:
            continue

        def mean(key, inside=inside):
            vals = [s[key] for s in inside if s[key] is not None]
            return round(sum(vals) / len(vals), 1) if vals else None

        reasons = 0
        for s in inside:
            reasons |= s["reasons"] or 0
        r["gpu0"] = {"samples": len(inside), "sm_mhz": mean("sm_mhz"), "power_w": mean("power_w"),
                     "temp_mem_c": max((s["temp_mem_c"] for s in inside if s["temp_mem_c"] is not None), default=None),
                     "reasons": hex(reasons)}


# ----------------------------------------------------------------------------- GPU side
def _kernel_rows(prof, replays: int) -> list[dict]:
    """Per kernel name: calls per replay and the median duration (a median, so that the first
    calls of a rank that started its profiler before its peer do not count)."""
    from torch.autograd import DeviceType

    by = {}
    for evt in prof.events():
        if getattr(evt, "device_type", None) != DeviceType.CUDA:
            continue
        by.setdefault(evt.name, []).append((evt.time_range.start, evt.time_range.elapsed_us()))
    by = {name: [d for _, d in sorted(ds)] for name, ds in by.items()}  # in the order they ran
    out = [{"name": name, "calls": len(ds) / replays, "us_per_call": statistics.median(ds),
            "us_per_replay": sum(ds) / replays} for name, ds in by.items()]
    out.sort(key=lambda r: -r["us_per_replay"])
    if out:  # the heaviest kernel call by call, in launch order: is a slow GEMM slow on every layer?
        out[0]["durations_us"] = [round(d, 2) for d in by[out[0]["name"]]]
    return out[:10]


class Norms:
    """The kernels a decoder layer runs between its GEMMs, by name; each run() returns the tensor
    the next GEMM reads (FlashInfer writes the norm into its input, vLLM's all-reduce into a new
    tensor).
      torch       residual add + torch's rms_norm, no communication
      yali        YALI's fused all-reduce + add + RMSNorm
      flashinfer  FlashInfer's fused kernel as vLLM's fusion pass calls it (trtllm backend)
      unfused     vLLM's all-reduce (custom all-reduce) + vLLM's fused_add_rms_norm kernel"""

    BACKENDS = (("yali", "yali-fused"), ("flashinfer", "flashinfer-trtllm"), ("unfused", "unfused"))

    def __init__(self, be, x, resid, weight, eps):
        import torch

        self.ops, self.capture_ctx = {}, {}
        normed = torch.empty_like(x)

        def torch_norm():
            resid.add_(x)
            normed.copy_(torch.nn.functional.rms_norm(resid, (x.shape[-1],), weight, eps))
            return normed

        self.ops["torch"] = torch_norm
        for short, name in self.BACKENDS:
            if be is None or name not in be.names:
                continue
            made, why = be.make(name, x, resid, weight, eps)
            if made is None:
                print(f"[decode-gemm] {short}: {why}", flush=True)
                continue
            op, outputs = made

            def run(op=op, outputs=outputs):
                op()
                return outputs()[0]

            self.ops[short] = run
            self.capture_ctx[short] = be.capture_ctx.get(name)


def worker(rank, port, args, q):
    os.environ.update(MULTICAST_OFF_ENV)
    os.environ["YALI_ENABLE"] = "0"  # vLLM's own all-reduce stays vLLM's (the `unfused` norm)
    import torch
    import torch.distributed as dist

    setup, repeat = args.current_setup, args.current_repeat
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    tag = f"[decode-gemm {setup} r{repeat}]"
    from benchmarks.fused_bench import Backends, _init_dist

    be, stack = None, None
    if setup == "vllm":
        group, vllm_ok, stack = _init_dist(rank, port)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        group, vllm_ok = dist.group.WORLD, False

    def agree(flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return bool(t.item())

    def make_backends():
        names = ["yali-fused"] + (["flashinfer-trtllm", "unfused"] if setup == "vllm" else [])
        return Backends(rank, dev, group, names, vllm_ok, agree)

    if setup in ("yali-first", "vllm"):  # communicators before the weights, as in vLLM
        be = make_backends()
    shapes = shapes_of(args)
    dtype = torch.bfloat16
    t0 = time.time()
    # Weights in vLLM's order (layer by layer), dummy values as vLLM's dummy loader draws them.
    layers = []
    for _ in range(args.layers):
        layers.append({kind: torch.empty((n, k), dtype=dtype, device=dev).uniform_(-1e-3, 1e-3)
                       for kind, (n, k) in shapes.items()})
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info(dev)[0] / GiB
    fill_gib = args.fill_gib if args.fill_gib is not None else max(0.0, free_after - args.leave_gib)
    per = int(fill_gib * GiB / args.layers) // 2 * 2
    filler = [torch.empty(per // 2, dtype=dtype, device=dev) for _ in range(args.layers)] if per > 0 else []
    if setup == "yali-after":
        be = make_backends()
    T, H = args.tokens, args.hidden
    if be is not None and "flashinfer-trtllm" in be.names:
        reason = be.flashinfer_ready(args.setup_timeout - 60) or \
            be.flashinfer_workspace(dtype, "bf16", H, [T])
        if rank == 0:
            print(f"{tag} FlashInfer: {reason or 'ready'}", flush=True)
    aligned = sum(int(layer["gate_up"].data_ptr() % (2 << 20) == 0) for layer in layers)
    info = {"setup": setup, "repeat": repeat, "layers": args.layers, "free_gib_after_weights": round(free_after, 2),
            "fill_gib": round(per * len(filler) / GiB, 2), "gate_up_aligned_2mib": aligned,
            "alloc_s": round(time.time() - t0, 1)}

    x_h = torch.randn((T, H), dtype=dtype, device=dev) * 1e-2   # norm input / row-parallel GEMM output
    resid = torch.randn((T, H), dtype=dtype, device=dev)
    norm_w = torch.ones(H, dtype=dtype, device=dev)
    attn = torch.randn((T, shapes["o"][1]), dtype=dtype, device=dev) * 1e-2
    act = torch.randn((T, shapes["down"][1]), dtype=dtype, device=dev) * 1e-2
    outs = {k: torch.empty((T, n), dtype=dtype, device=dev) for k, (n, _) in shapes.items()}
    norms = Norms(be, x_h, resid, norm_w, args.eps)
    info["norms"] = list(norms.ops)
    if rank == 0:
        print(f"{tag} weights {args.layers} layers, {free_after:.1f} GiB free after them, filler "
              f"{info['fill_gib']:.1f} GiB; norms {info['norms']}", flush=True)

    def gemm(kind, a, w):
        torch.matmul(a, w.t(), out=outs[kind])

    def layer_seq(norm):
        for layer in layers:
            src = norm()
            gemm("qkv", src, layer["qkv"])
            torch.matmul(attn, layer["o"].t(), out=x_h)
            src = norm()
            gemm("gate_up", src, layer["gate_up"])
            torch.matmul(act, layer["down"].t(), out=x_h)

    def after_norm(norm):  # the norm, then gate_up: the pair the serving profiles differ in
        for layer in layers:
            src = norm()
            gemm("gate_up", src, layer["gate_up"])

    inputs = {"qkv": x_h, "o": attn, "gate_up": x_h, "down": act}
    graphs = {k: (lambda k=k: [gemm(k, inputs[k], layer[k]) for layer in layers], None) for k in shapes}
    graphs["gate_up-one"] = (lambda: [gemm("gate_up", x_h, layers[0]["gate_up"]) for _ in layers], None)
    for nname, nop in norms.ops.items():
        graphs[f"layers/{nname}"] = (lambda nop=nop: layer_seq(nop), norms.capture_ctx.get(nname))
        graphs[f"gate_up-after/{nname}"] = (lambda nop=nop: after_norm(nop), norms.capture_ctx.get(nname))

    records = []
    for name, (body, ctx) in graphs.items():
        g = capture_graph(torch, lambda _: body(), None, 1, ctx, warmups=1)  # one graph = every layer
        dist.barrier(group)
        t_start = time.time()
        per_call = [us / args.layers for us in replay_per_op(torch, g, 1, args.replays)]
        t_end = time.time()
        records.append({"setup": setup, "repeat": repeat, "graph": name, "source": "events", "name": name,
                        "tokens": T, "calls": args.layers, "us_per_call": round(pct(per_call, 50), 3),
                        "us_p99": round(pct(per_call, 99), 3), "t_start": round(t_start, 3),
                        "t_end": round(t_end, 3)})
        if rank == 0:
            print(f"{tag} {name}: {pct(per_call, 50):.2f} us per layer (p99 {pct(per_call, 99):.2f})", flush=True)
        if "/" in name and repeat == 0:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                dist.barrier(group)
                for _ in range(3):
                    g.replay()
                torch.cuda.synchronize()
            for k in _kernel_rows(prof, 3):
                records.append({"setup": setup, "repeat": repeat, "graph": name, "source": "profiler", "tokens": T,
                                **{kk: round(v, 3) if isinstance(v, float) else v for kk, v in k.items()}})
        del g
    dist.barrier(group)
    q.put((rank, {"records": records, "info": info, "shapes": {k: list(v) for k, v in shapes.items()}}))
    if be is not None:
        be.close()
    if stack is not None:
        stack.close()


def main(argv=None):
    args = parse_args(argv)
    if args.report_only:
        print(report_only(args.report_only))
        return 0
    os.makedirs(args.out, exist_ok=True)
    res = {"records": [], "setup_info": [], "errors": [], "shapes": None}
    plan = [(r, s) for r in range(args.repeats) for s in args.setups]
    monitor = GpuMonitor(os.path.join(args.out, args.name + "-smi.csv"), args.monitor_ms) if args.monitor_ms else None
    try:
        run_plan(args, plan, res)
    finally:
        samples = monitor.stop() if monitor else []
    attach_gpu_state(res["records"], samples)
    path = write_outputs(args, res)
    print(markdown_table(res))
    print(f"[decode-gemm] wrote {path}", flush=True)
    return 0 if res["records"] else 1


def run_plan(args, plan, res) -> None:
    for i, (repeat, setup) in enumerate(plan, 1):
        print(f"[decode-gemm {i}/{len(plan)}] setup {setup}, repeat {repeat}", flush=True)
        args.current_setup, args.current_repeat = setup, repeat
        try:
            out = run_two_ranks(worker, args, args.setup_timeout, f"setup {setup}")
        except SystemExit as e:
            res["errors"].append({"setup": setup, "repeat": repeat, "error": str(e)})
            print(f"[decode-gemm] {setup} r{repeat}: {e}", flush=True)
            continue
        res["records"] += out["records"]
        res["setup_info"].append(out["info"])
        res["shapes"] = out["shapes"]


if __name__ == "__main__":
    sys.exit(main())
