"""What a decode profile says: the GPU kernels of vLLM's torch-profiler traces grouped by class,
with their time and the idle gaps around them per stream, per generated token; the report and
merging several profiles."""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from collections import defaultdict
from pathlib import Path

from benchmarks.common.results import load_results_of_kind, results_header, write_json_and_markdown


KIND = "decode-profile"
# The same analysis of a profile that holds one prefill step (serving_bench --profile-prefill-tokens):
# its result file's name; its header says "phase": "prefill" and the records are per step.
PREFILL_NAME = "prefill-profile"
# First match wins; names are CUDA kernel names as the profiler records them.
KERNEL_CLASSES = [
    ("yali", re.compile(r"yali", re.I)),
    ("flashinfer-allreduce", re.compile(r"allreduce_fusion|allreduce.*lamport|lamport|trtllm.*allreduce", re.I)),
    ("vllm-custom-allreduce", re.compile(r"cross_device_reduce", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash_fwd|fmha|attn|attention", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|sm90_xmma|cutlass|cublas", re.I)),
]


TOP_KERNELS = 25  # kernel names kept per trace, by total time
# The classes whose kernels wait for the other ranks: their time on one rank includes that rank's
# wait for the last one to arrive (collective_net).
COLLECTIVE_CLASSES = ("yali", "flashinfer-allreduce", "vllm-custom-allreduce", "nccl")


def kernel_class(name: str) -> str:
    for cls, rx in KERNEL_CLASSES:
        if rx.search(name):
            return cls
    return "other"


def load_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def analyze(trace: dict) -> dict:
    """Per kernel class: count, total and mean duration, and the mean idle gap on
    the same stream before and after (µs). Plus the span of all kernels."""
    kernels = [e for e in trace.get("traceEvents", [])
               if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e]
    by_stream = defaultdict(list)
    for e in kernels:
        by_stream[(e.get("pid"), e.get("tid"))].append(e)
    stats: dict = defaultdict(lambda: {"count": 0, "total_us": 0.0, "gap_before": [], "gap_after": []})
    for evs in by_stream.values():
        evs.sort(key=lambda e: e["ts"])
        for i, e in enumerate(evs):
            s = stats[kernel_class(e["name"])]
            s["count"] += 1
            s["total_us"] += float(e["dur"])
            if i > 0:
                s["gap_before"].append(float(e["ts"]) - (float(evs[i - 1]["ts"]) + float(evs[i - 1]["dur"])))
            if i + 1 < len(evs):
                s["gap_after"].append(float(evs[i + 1]["ts"]) - (float(e["ts"]) + float(e["dur"])))
    out = {}
    for cls, s in stats.items():
        mean = lambda xs: round(sum(xs) / len(xs), 3) if xs else None  # noqa: E731
        out[cls] = {"count": s["count"], "total_us": round(s["total_us"], 1),
                    "mean_us": round(s["total_us"] / s["count"], 3), "gap_before_us": mean(s["gap_before"]),
                    "gap_after_us": mean(s["gap_after"])}
    by_name: dict = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += float(e["dur"])
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    span = 0.0
    if kernels:
        span = max(float(e["ts"]) + float(e["dur"]) for e in kernels) - min(float(e["ts"]) for e in kernels)
    calls = {cls: [float(e["dur"]) for e in sorted((e for e in kernels if kernel_class(e["name"]) == cls),
                                                   key=lambda e: e["ts"])] for cls in COLLECTIVE_CLASSES}
    return {"classes": out, "kernels": len(kernels), "span_us": round(span, 1),
            "top": [{"name": n[:160], "class": kernel_class(n), "count": c, "total_us": round(t, 1)} for n, (c, t) in top],
            "collective_calls": {cls: d for cls, d in calls.items() if d}}


def collective_net(calls_by_rank: dict[int, dict[str, list[float]]], tokens: int) -> dict:
    """Per collective class: the time of its calls net of the ranks' arrival skew. The k-th call of a
    class is one collective on every rank, and the rank that arrived last waited least: its time
    (the shortest over the ranks) is the collective's own. Summed over the calls, per token; only
    where every rank made the same number of calls of the class."""
    out = {}
    classes = {cls for calls in calls_by_rank.values() for cls in calls}
    for cls in sorted(classes):
        per_rank = [calls.get(cls, []) for calls in calls_by_rank.values()]
        if len(per_rank) < 2 or len({len(d) for d in per_rank}) != 1:
            continue
        net = sum(min(ds) for ds in zip(*per_rank))
        out[cls] = {"count": len(per_rank[0]), "ranks": len(per_rank), "net_us": round(net, 1),
                    "per_token_net_us": round(net / tokens, 1),
                    "per_token_rank_us": {str(r): round(sum(calls.get(cls, [])) / tokens, 1)
                                          for r, calls in sorted(calls_by_rank.items())}}
    return out


def rank_of(path: str) -> int | None:
    m = re.search(r"rank[_-]?(\d+)", os.path.basename(path))
    return int(m.group(1)) if m else None


def summarize_traces(trace_root: Path, tokens: int) -> tuple[list[dict], dict, dict]:
    """Each trace under trace_root/<config>/ loaded and analysed once: one row per config x rank x
    kernel class, per config rank 0's kernels with the most time, per token (names cut to
    160 chars), and per config the collectives net of the ranks' arrival skew (collective_net).
    Traces without GPU kernels (the API server's CPU-only one) give nothing."""
    rows: list[dict] = []
    top: dict = {}
    nets: dict = {}
    for cfg_dir in sorted(p for p in trace_root.iterdir() if p.is_dir()):
        files = sorted(glob.glob(str(cfg_dir / "**" / "*.json*"), recursive=True))
        calls_by_rank: dict = {}
        for i, path in enumerate(files):
            res = analyze(load_trace(path))
            if not res["kernels"]:
                continue
            rank = rank_of(path)
            calls_by_rank[i if rank is None else rank] = res["collective_calls"]
            for cls, st in sorted(res["classes"].items()):
                rows.append({"config": cfg_dir.name, "rank": i if rank is None else rank, "kernel_class": cls,
                             "trace": os.path.relpath(path, trace_root), "tokens": tokens,
                             "per_token_count": round(st["count"] / tokens, 2),
                             "per_token_us": round(st["total_us"] / tokens, 1), **st,
                             "span_us": res["span_us"]})
            if rank in (0, None) and cfg_dir.name not in top:
                top[cfg_dir.name] = [{**k, "per_token_count": round(k["count"] / tokens, 2),
                                      "per_token_us": round(k["total_us"] / tokens, 1)} for k in res["top"]]
        net = collective_net(calls_by_rank, tokens)
        if net:
            nets[cfg_dir.name] = net
    return rows, top, nets


def rows_from_traces(trace_root: Path, tokens: int) -> list[dict]:
    """One row per config (the trace sub-directory) x rank x kernel class."""
    return summarize_traces(trace_root, tokens)[0]


def top_kernels(trace_root: Path, tokens: int) -> dict:
    """Per config: rank 0's kernels with the most time, per token."""
    return summarize_traces(trace_root, tokens)[1]


# vLLM's worker profiler annotates each engine step as execute_context_<n>(<tokens>)_generation_<n>(<tokens>);
# its key-averages table (profiler_out_<rank>.txt) gives the GPU time under each annotation.
# The row's last two columns are the mean CUDA time and the number of calls (groups 3-5).
STEP_ROW = re.compile(r"^\s*execute_context_(\d+)\((\d+)\)_generation_(\d+)\(\d+\)\s.*?([\d.]+)(us|ms|s)\s+(\d+)\s*$")


def _us(value: str, unit: str) -> float:
    return float(value) * {"us": 1.0, "ms": 1e3, "s": 1e6}[unit]


def _table_rank(name: str) -> int:
    """The rank of a key-averages table file: profiler_out_<rank>.txt (vLLM 0.26) or
    <...>rank<rank>.profiler_out.txt (vLLM 0.33)."""
    m = re.search(r"rank[_-]?(\d+)", name) or re.search(r"(\d+)", name)
    return int(m.group(1)) if m else 0


def step_times(trace_root: Path) -> dict:
    """Per config and rank, from vLLM's key-averages table (profiler_out): the mean GPU time of a
    pure decode step (no prefill in the batch) and how many there were, and of a step that
    prefills one request alone (its prompt tokens in the row). This is the number to compare
    between configurations: it excludes the host's time between steps."""
    out: dict = {}
    for cfg_dir in sorted(p for p in trace_root.iterdir() if p.is_dir()):
        for path in sorted({*cfg_dir.glob("profiler_out_*.txt"), *cfg_dir.glob("*.profiler_out.txt")}):
            rank = _table_rank(path.name)
            for line in path.read_text(errors="replace").splitlines():
                m = STEP_ROW.match(line)
                if not m:
                    continue
                contexts, context_tokens, generations = int(m.group(1)), int(m.group(2)), int(m.group(3))
                steps, step_us = int(m.group(6)), round(_us(m.group(4), m.group(5)), 1)
                entry = out.setdefault(cfg_dir.name, {}).setdefault(str(rank), {})
                if contexts == 0:  # no context (prefill) requests in the step
                    entry.update({"decode_steps": steps, "decode_step_us": step_us})
                elif contexts == 1 and generations == 0:
                    entry.update({"prefill_steps": steps, "prefill_tokens": context_tokens, "prefill_step_us": step_us})
    return out


def profile_doc(trace_root: Path, tokens: int, extra: dict) -> dict:
    """The decode-profile result document of the traces under trace_root/<config>/."""
    doc = results_header(KIND, {"tokens": tokens, **extra})
    doc["records"], doc["top_kernels"], doc["collective_net"] = summarize_traces(trace_root, tokens)
    doc["step_times"] = step_times(trace_root)
    return doc


def markdown(doc: dict) -> str:
    prefill = doc.get("phase") == "prefill"
    unit = "step" if prefill else "token"
    what = (f"the one step that prefills a {doc.get('prompt_tokens')}-token prompt" if prefill
            else "one streamed request")
    lines = [f"# {'Prefill' if prefill else 'Decode'} profile ({doc['host']})", "",
             f"{doc['date']} · `{doc['command']}`", "",
             f"GPU kernels of {what} (torch profiler, rank 0), grouped by class; gaps are the idle "
             "time on the kernel's stream before / after it, averaged over that class.", "",
             f"| config | class | kernels / {unit} | µs / {unit} | mean µs | gap before µs | gap after µs |",
             "|---|---|---:|---:|---:|---:|---:|"]
    totals: dict = {}
    for r in doc["records"]:
        if r["rank"] != 0:
            continue
        lines.append(f"| {r['config']} | {r['kernel_class']} | {r['per_token_count']} | {r['per_token_us']} | "
                     f"{r['mean_us']} | {r['gap_before_us']} | {r['gap_after_us']} |")
        t = totals.setdefault(r["config"], {"busy": 0.0, "span": r["span_us"]})
        t["busy"] += r["per_token_us"]
    if totals:
        tokens = doc["records"][0]["tokens"]
        span = ("the span of the whole trace (first kernel start to last kernel end)" if prefill else
                "the span of the whole trace (first kernel start to last kernel end, divided by the tokens; "
                "includes the prefill)")
        lines += ["", f"Per {unit}, rank 0: kernel time (sum over classes) and {span}.", "",
                  f"| config | kernel µs / {unit} | span µs / {unit} |", "|---|---:|---:|"]
        for cfg, t in totals.items():
            lines.append(f"| {cfg} | {t['busy']:.1f} | {t['span'] / tokens:.1f} |")
    if doc.get("step_times"):
        kind, key = ("prefill", "prefill") if prefill else ("decode", "decode")
        lines += ["", f"GPU time of one {kind} step (vLLM's step annotation in the profiler's key averages; excludes "
                  "the host's time between steps):", "", f"| config | rank | {kind} steps | µs / step |",
                  "|---|---:|---:|---:|"]
        for cfg, ranks in doc["step_times"].items():
            for rank, st in sorted(ranks.items(), key=lambda kv: int(kv[0])):
                if f"{key}_steps" in st:
                    lines.append(f"| {cfg} | {rank} | {st[f'{key}_steps']} | {st[f'{key}_step_us']} |")
    if doc.get("collective_net"):
        lines += ["", f"Collective kernels net of the ranks' arrival skew, per {unit}: the k-th call's shortest time over "
                  "the ranks (the last rank to arrive waits least), summed; beside it each rank's own total.", "",
                  "| config | class | calls | net µs | µs per rank |", "|---|---|---:|---:|---|"]
        for cfg, classes in doc["collective_net"].items():
            for cls, st in classes.items():
                ranks = ", ".join(f"{r}: {v}" for r, v in st["per_token_rank_us"].items())
                lines.append(f"| {cfg} | {cls} | {st['count']} | {st['per_token_net_us']} | {ranks} |")
    for cfg, top in doc.get("top_kernels", {}).items():
        lines += ["", f"Top kernels of {cfg} (rank 0, per {unit}):", "", "| kernel | class | count | µs |", "|---|---|---:|---:|"]
        for k in top:
            lines.append(f"| `{k['name'][:100]}` | {k['class']} | {k['per_token_count']} | {k['per_token_us']} |")
    return "\n".join(lines) + "\n"


def write_doc(out: Path, doc: dict, name: str = KIND) -> str:
    """OUT/<name>.json (decode-profile, or prefill-profile) and its markdown beside it; returns the markdown."""
    md = markdown(doc)
    write_json_and_markdown(out, name, doc, md)
    return md


def merge(paths: list[Path], out: Path) -> int:
    """One decode-profile document from several: records and top kernels of each, in order
    (a config in two files keeps the later one's top kernels); the sources are listed."""
    docs = load_results_of_kind(paths, KIND)
    phase = {k: docs[0][k] for k in ("phase", "prompt_tokens") if k in docs[0]}  # a prefill profile stays one
    doc = results_header(KIND, {"tokens": docs[0].get("tokens"), "model_size": docs[0].get("model_size"), **phase,
                                "merged_from": [{"file": str(p), "date": d.get("date"), "command": d.get("command")}
                                                for p, d in zip(paths, docs)]})
    doc["records"] = [r for d in docs for r in d["records"]]
    doc["top_kernels"] = {cfg: top for d in docs for cfg, top in d.get("top_kernels", {}).items()}
    doc["collective_net"] = {cfg: net for d in docs for cfg, net in (d.get("collective_net") or {}).items()}
    # The profile's host and versions are those of the runs (the first one), not of this merge.
    doc["host"], doc["versions"] = docs[0].get("host", doc["host"]), docs[0].get("versions", doc["versions"])
    doc["step_times"] = {}
    for p, d in zip(paths, docs):
        traces = Path(p).parent / ("prefill-traces" if phase else "traces")
        doc["step_times"].update(d.get("step_times") or (step_times(traces) if traces.is_dir() else {}))
    print(write_doc(out, doc, PREFILL_NAME if phase.get("phase") == "prefill" else KIND))
    return 0
