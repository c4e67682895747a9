"""The serving-benchmark report: markdown tables, plots, and merging several runs into one."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.results import under, world_size_of
from benchmarks.serving.schema import EXTRA_RESULT_KEYS, LONG_PROMPT_RECORDS, SLOW_GAP_BINS, parse_bench_result
from benchmarks.serving.stats import METRICS, Metric, Stat, aggregate, ordered_configs, verdict


def _fmt_stat(stat: Stat | None, fmt: str) -> str:
    if stat is None:
        return "—"
    if stat.n < 2:
        return fmt.format(stat.mean)
    return f"{fmt.format(stat.mean)} ± {fmt.format(stat.spread / 2.0)}"


def _point_tables(L: list[str], agg: dict[tuple[int, str], dict[str, Any]], configs: Sequence[str], c: int,
                  where: str, head_metric: Metric = METRICS[0]) -> None:
    """One point's table (a row per config, its last column yali against that config on
    `head_metric`), then yali's verdict against each other config on every metric."""
    others = [o for o in configs if o != "yali" and (c, o) in agg]
    cols = ["config", "runs", *[m.label for m in METRICS], "failed", f"yali vs this ({head_metric.label})"]
    L.append("| " + " | ".join(cols) + " |")
    L.append("|" + "|".join(["---"] * len(cols)) + "|")
    y = agg.get((c, "yali"))
    for cfg in configs:
        a = agg.get((c, cfg))
        if a is None:
            continue
        cells = [cfg, str(a["repeats"])]
        cells += [_fmt_stat(a[m.key], m.fmt) for m in METRICS]
        cells.append(str(a["failed"]))
        cells.append("—" if cfg == "yali" else
                     verdict(y[head_metric.key] if y else None, a[head_metric.key], head_metric.lower_is_better)[1])
        L.append("| " + " | ".join(cells) + " |")
    L.append("")
    if y and others:
        L.append(f"Verdicts at {where}, yali vs each config:")
        L.append("")
        L.append("| metric | " + " | ".join(f"vs {o}" for o in others) + " |")
        L.append("|---|" + "|".join(["---"] * len(others)) + "|")
        for m in METRICS:
            cells = [verdict(y[m.key], agg[(c, o)][m.key], m.lower_is_better)[1] for o in others]
            L.append(f"| {m.label} | " + " | ".join(cells) + " |")
        L.append("")


def _slow_gap_table(L: list[str], records: Sequence[dict[str, Any]], configs: Sequence[str], c: int) -> None:
    """Where the gaps longer than each point's ITL p99 fall in a request, per config (summed over repeats)."""
    rows = []
    for cfg in configs:
        slow = [r["slow_gaps"] for r in records if r["config"] == cfg and int(r["concurrency"]) == c and r.get("slow_gaps")]
        if slow:
            counts = {name: sum(s["above_p99"].get(name, 0) for s in slow) for name, _, _ in SLOW_GAP_BINS}
            rows.append((cfg, sum(s["gaps"] for s in slow), counts))
    if not rows:
        return
    L.append("Gaps longer than the point's ITL p99 (about the slowest 1 %), by their place in a request (gap 1 follows the first token):")
    L.append("")
    L.append("| config | gaps | " + " | ".join(f"gap {name}" for name, _, _ in SLOW_GAP_BINS) + " |")
    L.append("|---|---|" + "|".join(["---"] * len(SLOW_GAP_BINS)) + "|")
    for cfg, n, counts in rows:
        L.append(f"| {cfg} | {n} | " + " | ".join(str(counts[name]) for name, _, _ in SLOW_GAP_BINS) + " |")
    L.append("")


def _all_records(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The concurrency points' records and the long-prompt point's."""
    return [*(doc.get("records") or []), *(doc.get(LONG_PROMPT_RECORDS) or [])]


def _point_name(entry: dict[str, Any]) -> str:
    """c=N for a concurrency point (c=None: the whole server), "long prompts" for the long-prompt point."""
    return "long prompts" if entry.get("point") == "long" else f"c={entry.get('concurrency')}"


def render_markdown(doc: dict[str, Any], plot_files: Sequence[str] = ()) -> str:
    records = doc.get("records") or []
    agg = aggregate(records)
    configs = ordered_configs(records)
    concs = sorted({int(r["concurrency"]) for r in records})
    L: list[str] = []
    quant = (doc.get("model") or {}).get("quantization", "none")
    model_bits = "" if quant == "none" else f", {quant}"
    L.append(f"# Serving benchmark, TP={world_size_of(doc)}{model_bits}: yali vs vLLM all-reduce paths")
    L.append("")
    L.append(f"- date: {doc.get('date')}")
    L.append(f"- host: {doc.get('host')}")
    v = doc.get("versions") or {}
    L.append("- versions: " + ", ".join(f"{k} {v.get(k)}" for k in ("torch", "cuda", "nccl", "vllm", "yali_vllm", "git")))
    model = doc.get("model") or {}
    if model:
        L.append("- model: " + ", ".join(f"{k}={model[k]}" for k in model if not isinstance(model[k], (dict, list))))
    wl = doc.get("workload") or {}
    if wl:
        L.append("- workload: " + ", ".join(f"{k}={wl[k]}" for k in wl if not isinstance(wl[k], (dict, list))))
    L.append(f"- command: `{doc.get('command')}`")
    L.append("")
    for s in doc.get("server_logs") or []:
        for w in s.get("warnings") or []:
            L.append(f"> **WARNING** ({s.get('config')} r{s.get('repeat')}): {w}")
            L.append("")
    L.append(
        "Values are mean ± half the spread over repeats (so the ± interval spans the "
        "min..max of the repeats). Verdict: a difference of the means that is not larger "
        "than the spread between repeats (max − min, the larger of the two configs') is "
        "reported as **no difference**; otherwise the relative difference of yali's mean "
        "(negative = lower) and whether that is better or worse for yali."
    )
    L.append("")
    long_records = doc.get(LONG_PROMPT_RECORDS) or []
    if not records and not long_records:
        L.append("**No benchmark point completed.**")
        L.append("")
    for c in concs:
        L.append(f"## Concurrency {c}")
        L.append("")
        _point_tables(L, agg, configs, c, f"concurrency {c}")
        _slow_gap_table(L, records, configs, c)
    ttft = next(m for m in METRICS if m.key == "ttft_ms_p50")
    for n in sorted({int(r.get("input_len") or 0) for r in long_records}):
        recs = [r for r in long_records if int(r.get("input_len") or 0) == n]
        L.append(f"## Long prompts: input {n} tokens, concurrency 1")
        L.append("")
        L.append("The time to first token of a long prompt (its prefill), each server after its concurrency points.")
        L.append("")
        _point_tables(L, aggregate(recs), ordered_configs(recs), 1, f"the {n}-token prompts", ttft)
    logs = doc.get("server_logs") or []
    if logs:
        L.append("## All-reduce backends the servers logged")
        L.append("")
        for s in logs:
            L.append(
                f"**{s.get('config')} r{s.get('repeat')}** (`{s.get('log_file')}`, YALI on: {s.get('yali_on')}, "
                f"ERROR/Traceback lines: {s.get('error_count', 0)})"
            )
            L.append("")
            lines = s.get("key_lines") or []
            if lines:
                L.append("```")
                L.extend(lines)
                L.append("```")
            else:
                L.append("_no all-reduce backend / YALI line found_")
            L.append("")
    errs = doc.get("errors") or []
    skipped = doc.get("skipped") or []
    if errs or skipped:
        L.append("## Errors and skipped points")
        L.append("")
        for e in errs:
            src = f" (`{e['source']}`)" if e.get("source") else ""
            L.append(f"- error: {e.get('config')} r{e.get('repeat')} {_point_name(e)}{src}: {str(e.get('error'))[:300]}")
        for s in skipped:
            src = f" (`{s['source']}`)" if s.get("source") else ""
            L.append(f"- skipped: {s.get('config')} r{s.get('repeat')} {_point_name(s)}{src}: {s.get('reason')}")
        L.append("")
    if plot_files:
        L.append("## Plots")
        L.append("")
        for p in plot_files:
            L.append(f"![{Path(p).stem}]({Path(p).name})")
        L.append("")
    return "\n".join(L)


PLOTS = (
    ("tpot_ms_p50", "TPOT p50 (ms)", "tpot_p50.png"),
    ("itl_ms_p99", "ITL p99 (ms)", "itl_p99.png"),
)


def write_plots(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """TPOT p50 and ITL p99 by concurrency, one line per config, error bars = repeat min..max."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots", file=sys.stderr)
        return []
    records = doc.get("records") or []
    if not records:
        return []
    agg = aggregate(records)
    configs = ordered_configs(records)
    concs = sorted({int(r["concurrency"]) for r in records})
    model = doc.get("model") or {}
    title_bits = [" ".join(str(model[k]) for k in ("size", "quantization") if model.get(k) not in (None, "none")),
                  f"TP={world_size_of(doc)}",
                  str(doc.get("host", ""))]
    written: list[Path] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for key, label, fname in PLOTS:
        fig, ax = plt.subplots(figsize=(7.0, 4.4))
        for cfg in configs:
            xs, ys, lo, hi = [], [], [], []
            for c in concs:
                st = (agg.get((c, cfg)) or {}).get(key)
                if st is None:
                    continue
                xs.append(c)
                ys.append(st.mean)
                lo.append(st.mean - st.lo)
                hi.append(st.hi - st.mean)
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=4, label=cfg)
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs)
        ax.set_xticklabels([str(c) for c in concs])
        ax.set_xlabel("concurrency (max in-flight requests)")
        ax.set_ylabel(label)
        ax.set_title(f"{label} by concurrency — " + " · ".join(b for b in title_bits if b), fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def write_report(doc: dict[str, Any], json_path: Path, out_dir: Path | None = None) -> tuple[Path, list[Path]]:
    out_dir = out_dir or json_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(doc, out_dir)
    md_path = out_dir / (json_path.stem + ".md")
    md_path.write_text(render_markdown(doc, [p.name for p in plots]), encoding="utf-8")
    return md_path, plots


def merge_results(docs: Sequence[dict[str, Any]], sources: Sequence[str],
                  prefixes: Sequence[str] | None = None) -> dict[str, Any]:
    """Merge several serving-benchmark results (same workload) into one.

    Header, model and workload come from the first; records, server logs, errors
    and skipped points are concatenated, with each config's repeats renumbered
    1, 2, ... in file order so that the verdict sees them as repeats. prefixes[i]
    (the directory of source i relative to the merged result's) is put in front of
    the files source i names, so that result files and server logs stay findable;
    errors and skipped points say which source they came from.
    """
    if not docs:
        raise ValueError("nothing to merge")
    sizes = [world_size_of(d) for d in docs]
    if len(set(sizes)) > 1:
        raise SystemExit("the results to merge ran at different tensor-parallel sizes: "
                         + ", ".join(f"{s} TP={n}" for s, n in zip(sources, sizes)))
    quants = [(d.get("model") or {}).get("quantization", "none") for d in docs]
    if len(set(quants)) > 1:
        raise SystemExit("the results to merge served differently quantised models: "
                         + ", ".join(f"{s} {q}" for s, q in zip(sources, quants)))
    merged = dict(docs[0])
    merged["merged_from"] = list(sources)
    merged["commands"] = [d.get("command") for d in docs]
    for key in ("records", LONG_PROMPT_RECORDS, "server_logs", "errors", "skipped"):
        merged[key] = []
    next_rep: dict[str, int] = {}
    for i, d in enumerate(docs):
        prefix = prefixes[i] if prefixes else ""
        renum: dict[tuple[str, int], int] = {}
        for cfg, rep in sorted({(r["config"], int(r["repeat"])) for r in _all_records(d)} |
                               {(s["config"], int(s["repeat"])) for s in d.get("server_logs") or [] if s.get("repeat") is not None}):
            next_rep[cfg] = next_rep.get(cfg, 0) + 1
            renum[(cfg, rep)] = next_rep[cfg]
        def repeat_of(e: dict[str, Any]) -> Any:
            rep = e.get("repeat")
            return renum.get((e.get("config"), int(rep)), rep) if rep is not None else rep

        for key in ("records", LONG_PROMPT_RECORDS):
            for r in d.get(key) or []:
                merged[key].append({**r, "repeat": repeat_of(r), "result_file": under(prefix, r.get("result_file"))})
        for e in d.get("server_logs") or []:
            merged["server_logs"].append({**e, "repeat": repeat_of(e), "log_file": under(prefix, e.get("log_file"))})
        for key in ("errors", "skipped"):
            merged[key] += [{**e, "repeat": repeat_of(e), "source": sources[i]} for e in d.get(key) or []]
    return merged


def backfill_extra_keys(doc: dict[str, Any], base: Path) -> None:
    """Fills the EXTRA_RESULT_KEYS a record lacks (written before they existed) from its
    ``result_file`` (relative to ``base``, the result's directory) where that file is kept."""
    for r in _all_records(doc):
        missing = [k for k in EXTRA_RESULT_KEYS if r.get(k) is None]
        path = base / r["result_file"] if missing and r.get("result_file") else None
        if path is None or not path.is_file():
            continue
        parsed = parse_bench_result(path)
        for k in missing:
            if parsed.get(k) is not None:
                r[k] = parsed[k]
