"""How long each configuration's engine steps take, by the tokens they carry.

With ``--enable-logging-iteration-details`` (vLLM 0.33) the engine core logs one line a step:

    Iteration(812): 1 context requests, 1024 context tokens, 31 generation requests,
    31 generation tokens, iteration elapsed time: 61.20 ms, GPU KV cache usage: 3.1%

(the elapsed time is the engine core's wall time around the step). serving_bench's ``--step-times``
turns it on for every server; this module reads the servers' logs (``server-logs/<config>-r<N>.log``)
and tables the step times per configuration in token buckets, so a difference in ITL p99 between two
servers can be put on the steps that carry a prefill chunk or on the pure-decode ones. A second table
gives, per server start, the steps that prefill one prompt and carry nothing else: at concurrency 1
such a step is most of a request's TTFT, so a TTFT difference between servers shows there or not.

  python -m benchmarks.serving.step_times DIR [DIR ...] [--plot PNG]   # serving_bench outputs (their server-logs/)
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ITERATION_RE = re.compile(
    r"Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, (\d+) generation requests, "
    r"(\d+) generation tokens, iteration elapsed time: ([\d.]+) ms(?!\s*\(dummy\))"
)
LOG_NAME_RE = re.compile(r"^(?P<config>.+)-r(?P<repeat>\d+)\.log$")
# Token buckets (total tokens of a step, inclusive upper ends): decode batches, vLLM's CUDA-graph
# limit (128 at the default capture sizes), YALI's earlier 4-rank message limit at hidden 8192 (512 rows),
# one 1024-token prompt with its decodes, and the larger chunks up to max_num_batched_tokens.
BUCKETS = (8, 32, 64, 128, 512, 1152, 2048, 4096, 8192, 1 << 30)
SERVER_FLAG = "--enable-logging-iteration-details"
LONE_PLOT = "lone-prefill.png"  # beside step-times.md: the lone prefill steps per server start


def parse_steps(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The logged engine steps (dummy steps of data parallelism left out)."""
    steps = []
    for line in lines:
        m = ITERATION_RE.search(line)
        if m:
            it, ctx_req, ctx_tok, gen_req, gen_tok = (int(m.group(i)) for i in range(1, 6))
            steps.append({"iteration": it, "context_requests": ctx_req, "context_tokens": ctx_tok,
                          "generation_requests": gen_req, "generation_tokens": gen_tok,
                          "tokens": ctx_tok + gen_tok, "elapsed_ms": float(m.group(6))})
    return steps


def bucket_of(tokens: int) -> str:
    lo = 1
    for hi in BUCKETS:
        if tokens <= hi:
            return f"{lo}-{hi}" if hi < BUCKETS[-1] else f">{lo - 1}"
        lo = hi + 1
    raise AssertionError(tokens)


BUCKET_ORDER = {bucket_of(hi): i for i, hi in enumerate(BUCKETS)}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(steps_by_config: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (config, token bucket): steps, mean, p50, p90 and max elapsed ms, and the
    bucket's mean tokens and mean context (prefill) tokens."""
    rows = []
    for config, steps in steps_by_config.items():
        groups: dict[str, list[dict[str, Any]]] = {}
        for s in steps:
            groups.setdefault(bucket_of(s["tokens"]), []).append(s)
        for bucket in sorted(groups, key=BUCKET_ORDER.__getitem__):
            g = groups[bucket]
            ms = [s["elapsed_ms"] for s in g]
            rows.append({"config": config, "tokens": bucket, "steps": len(g),
                         "mean_tokens": round(statistics.fmean(s["tokens"] for s in g), 1),
                         "mean_context_tokens": round(statistics.fmean(s["context_tokens"] for s in g), 1),
                         "elapsed_ms_mean": round(statistics.fmean(ms), 3), "elapsed_ms_p50": round(_pct(ms, 50), 3),
                         "elapsed_ms_p90": round(_pct(ms, 90), 3), "elapsed_ms_max": round(max(ms), 3)})
    return rows


def lone_groups(starts: dict[tuple[str, str], list[dict[str, Any]]]) -> dict[tuple[str, str], dict[str, list[float]]]:
    """Per server start with any, the elapsed ms of its steps that prefill exactly one prompt and
    carry no decode, by token bucket (in bucket order)."""
    out: dict[tuple[str, str], dict[str, list[float]]] = {}
    for key, steps in starts.items():
        groups: dict[str, list[float]] = {}
        for s in steps:
            if s["context_requests"] == 1 and s["generation_requests"] == 0:
                groups.setdefault(bucket_of(s["tokens"]), []).append(s["elapsed_ms"])
        if groups:
            out[key] = {b: groups[b] for b in sorted(groups, key=BUCKET_ORDER.__getitem__)}
    return out


def lone_prefills(starts: dict[tuple[str, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (server start, token bucket) of the steps that prefill exactly one prompt and
    carry no decode: steps, p50, mean, min and max elapsed ms. `starts`: {(start, config): steps}."""
    return [{"start": start, "config": config, "tokens": bucket, "steps": len(ms),
             "elapsed_ms_p50": round(statistics.median(ms), 3), "elapsed_ms_mean": round(statistics.fmean(ms), 3),
             "elapsed_ms_min": round(min(ms), 3), "elapsed_ms_max": round(max(ms), 3)}
            for (start, config), groups in lone_groups(starts).items() for bucket, ms in groups.items()]


def read_starts(out: Path, prefix: str = "") -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Every server log's steps, by server start: {(prefix + log name without .log, config): steps}."""
    starts: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for log in sorted((out / "server-logs").glob("*.log")):
        m = LOG_NAME_RE.match(log.name)
        if not m:
            continue
        steps = parse_steps(log.read_text(errors="replace").splitlines())
        if steps:
            starts[(prefix + log.stem, m.group("config"))] = steps
    return starts


def by_config(starts: dict[tuple[str, str], list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """The starts' steps by configuration (the repeats of a configuration together)."""
    merged: dict[str, list[dict[str, Any]]] = {}
    for (_, config), steps in starts.items():
        merged.setdefault(config, []).extend(steps)
    return merged


def markdown(rows: list[dict[str, Any]]) -> str:
    configs = list(dict.fromkeys(r["config"] for r in rows))
    buckets = sorted({r["tokens"] for r in rows}, key=BUCKET_ORDER.__getitem__)
    get = {(r["config"], r["tokens"]): r for r in rows}
    out = ["# Engine step times by tokens a step carries (vLLM's iteration details)", "",
           "Mean (p90) of the engine core's time per step, ms; steps counted per configuration (all its "
           "repeats, warm-up included).", "",
           "| tokens a step | " + " | ".join(f"{c} steps | {c} ms" for c in configs) + " |",
           "|---|" + "---:|---:|" * len(configs)]
    for b in buckets:
        cells = []
        for c in configs:
            r = get.get((c, b))
            cells += [str(r["steps"]), f"{r['elapsed_ms_mean']:.2f} ({r['elapsed_ms_p90']:.2f})"] if r else ["0", "–"]
        out.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def lone_markdown(rows: list[dict[str, Any]]) -> str:
    out = ["## Steps that prefill one prompt and carry nothing else, per server start", "",
           "At concurrency 1 such a step is most of a request's TTFT. Elapsed ms of the engine core's step.", "",
           "| server start | tokens a step | steps | p50 | mean | min | max |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['start']} | {r['tokens']} | {r['steps']} | {r['elapsed_ms_p50']:.2f} | "
                   f"{r['elapsed_ms_mean']:.2f} | {r['elapsed_ms_min']:.2f} | {r['elapsed_ms_max']:.2f} |")
    return "\n".join(out) + "\n"


def plot_lone_prefills(starts: dict[tuple[str, str], list[dict[str, Any]]], path: Path) -> Path | None:
    """`path` (PNG): the lone prefill steps' times of the token bucket with the most of them, one box
    with its steps per server start, coloured by configuration; None without such steps or matplotlib."""
    groups = lone_groups(starts)
    if not groups:
        return None
    counts: dict[str, int] = {}
    for by_bucket in groups.values():
        for b, times in by_bucket.items():
            counts[b] = counts.get(b, 0) + len(times)
    bucket = max(counts, key=counts.__getitem__)
    ms = {key: by_bucket[bucket] for key, by_bucket in groups.items() if bucket in by_bucket}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    keys = list(ms)
    colours = {c: f"C{i}" for i, c in enumerate(dict.fromkeys(c for _, c in keys))}
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(keys) + 2), 4.4))
    ax.boxplot([ms[k] for k in keys], showfliers=False)
    for i, k in enumerate(keys, start=1):
        ax.plot([i] * len(ms[k]), ms[k], "o", alpha=0.6, color=colours[k[1]])
    ax.set_xticks(range(1, len(keys) + 1))
    ax.set_xticklabels([start for start, _ in keys], rotation=30, ha="right", fontsize=8)
    for label, (_, config) in zip(ax.get_xticklabels(), keys):
        label.set_color(colours[config])
    ax.set_ylabel("engine step, ms")
    ax.set_title(f"Steps that prefill one prompt alone ({bucket} tokens), per server start", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(starts: dict[tuple[str, str], list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """(bucket rows, lone-prefill rows, markdown of both) of the starts' steps."""
    rows, lone = summarize(by_config(starts)), lone_prefills(starts)
    return rows, lone, markdown(rows) + ("\n" + lone_markdown(lone) if lone else "")


def write_step_times(out: Path, header: dict[str, Any]) -> Path | None:
    """step-times.json / .md in `out` from its server logs; None when no log has iteration details.
    `header`: the run's result header (command, date, host, versions, world size)."""
    from benchmarks.common.results import write_results

    starts = read_starts(out)
    rows, lone, text = report(starts)
    if not rows:
        return None
    plot_lone_prefills(starts, out / LONE_PLOT)
    doc = {k: v for k, v in header.items() if k != "records"}
    doc["kind"] = "serving-step-times"
    doc["records"] = rows
    doc["lone_prefill_steps"] = lone
    write_results(out / "step-times.json", doc)
    md = out / "step-times.md"
    md.write_text(text)
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, nargs="+", help="serving_bench output directories (with server-logs/); "
                    "with several, each start is named DIR/<config>-r<N>")
    ap.add_argument("--plot", type=Path, help="also draw the lone prefill steps per server start into this PNG")
    args = ap.parse_args(argv)
    names = [out.name for out in args.out]
    if len(set(names)) < len(names):  # runs of the same name: each start named by its run's path
        names = [str(out) for out in args.out]
    starts: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for out, name in zip(args.out, names):
        starts.update(read_starts(out, f"{name}/" if len(args.out) > 1 else ""))
    rows, _, text = report(starts)
    if not rows:
        print(f"no iteration details in {', '.join(str(o / 'server-logs') for o in args.out)} "
              "(was the run made with --step-times?)", file=sys.stderr)
        return 1
    print(text, end="")
    if args.plot and plot_lone_prefills(starts, args.plot):
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
