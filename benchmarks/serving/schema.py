"""The serving-benchmark result: its kind, row keys, and one row from ``vllm bench serve``'s result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


KIND = "serving-benchmark"
RESULT_NAME = "serving-benchmark.json"
# The records of the long-prompt point (--long-prompt-len: concurrency 1, a longer input, its own table).
LONG_PROMPT_RECORDS = "long_prompt_records"
DEFAULT_CONFIGS = ("yali", "vllm-default", "nccl")

ROW_KEYS = (
    "config",
    "concurrency",
    "repeat",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
    "output_tok_s",
    "req_s",
    "failed",
)

# Row key -> keys of the JSON that vLLM 0.26's `vllm bench serve --save-result`
# writes (vllm/benchmarks/serve.py: process_one_metric() writes
# f"p{p}_{metric}_ms" for every --metric-percentiles entry, plus median_*).
VLLM_RESULT_KEYS: dict[str, tuple[str, ...]] = {
    "ttft_ms_p50": ("p50_ttft_ms", "median_ttft_ms"),
    "ttft_ms_p99": ("p99_ttft_ms",),
    "tpot_ms_p50": ("p50_tpot_ms", "median_tpot_ms"),
    "tpot_ms_p99": ("p99_tpot_ms",),
    "itl_ms_p50": ("p50_itl_ms", "median_itl_ms"),
    "itl_ms_p99": ("p99_itl_ms",),
    "output_tok_s": ("output_throughput",),
    "req_s": ("request_throughput",),
}
# Beyond the schema's row: the mean TPOT and TTFT over a point's requests. Under mixed
# prefill/decode (concurrency 32) the per-request TPOTs spread and their median can move more than
# their mean; a concurrency-1 point's few TTFTs follow their prefill steps, whose time spreads.
EXTRA_RESULT_KEYS: dict[str, tuple[str, ...]] = {"tpot_ms_mean": ("mean_tpot_ms",), "ttft_ms_mean": ("mean_ttft_ms",)}


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f else None  # NaN -> None


# Where in a request the slowest gaps fall: the gap after the first token, the next ones, the rest.
SLOW_GAP_BINS = (("1", 1, 1), ("2-8", 2, 8), ("9+", 9, None))


def slow_gap_positions(itls: Any) -> dict[str, Any] | None:
    """From ``--save-detailed``'s per-request inter-token gaps (seconds): the gaps longer than the
    point's own 99th percentile (vLLM's ITL p99; about the slowest 1 %), counted by their index in the request (gap 1 follows the first
    token), so an ITL p99 difference can be placed (a request's first decode steps, or any step).
    None when the result has no per-request gaps."""
    if not isinstance(itls, list) or not any(isinstance(r, list) and r for r in itls):
        return None
    gaps = sorted(g for r in itls if isinstance(r, list) for g in r)
    pos = 0.99 * (len(gaps) - 1)  # numpy's default percentile (linear), as vLLM's p99_itl_ms
    lo = int(pos)
    p99 = gaps[lo] + (gaps[min(lo + 1, len(gaps) - 1)] - gaps[lo]) * (pos - lo)
    counts = {name: 0 for name, _, _ in SLOW_GAP_BINS}
    for r in itls:
        for i, g in enumerate(r if isinstance(r, list) else [], start=1):
            if g > p99:
                name = next(n for n, lo, hi in SLOW_GAP_BINS if i >= lo and (hi is None or i <= hi))
                counts[name] += 1
    return {"p99_ms": round(p99 * 1e3, 3), "gaps": len(gaps), "above_p99": counts}


def parse_bench_result(result: dict[str, Any] | str | Path) -> dict[str, Any]:
    """Row metrics from one ``vllm bench serve --save-result`` JSON (vLLM 0.26 keys)."""
    if not isinstance(result, dict):
        with open(result, encoding="utf-8") as f:
            result = json.load(f)
    row: dict[str, Any] = {}
    for key, candidates in {**VLLM_RESULT_KEYS, **EXTRA_RESULT_KEYS}.items():
        val = None
        for c in candidates:
            if c in result:
                val = _num(result[c])
                if val is not None:
                    break
        row[key] = val
    slow = slow_gap_positions(result.get("itls"))
    if slow is not None:
        row["slow_gaps"] = slow
    row["failed"] = int(result.get("failed") or 0)
    row["completed"] = int(result.get("completed") or 0)
    row["duration_s"] = _num(result.get("duration"))
    row["num_prompts"] = result.get("num_prompts")
    return row


def make_record(config: str, concurrency: int, repeat: int, parsed: dict[str, Any], **extra: Any) -> dict[str, Any]:
    rec = {"config": config, "concurrency": int(concurrency), "repeat": int(repeat)}
    for k in ROW_KEYS[3:]:
        rec[k] = parsed.get(k)
    for k in ("completed", "duration_s", "num_prompts", "slow_gaps", *EXTRA_RESULT_KEYS):
        if k in parsed:
            rec[k] = parsed[k]
    rec.update(extra)
    return rec


# =================================================================== reporting
