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
# Beyond the schema's row: the mean TPOT over a point's requests. Under mixed prefill/decode
# (concurrency 32) the per-request TPOTs spread and their median can move more than their mean.
EXTRA_RESULT_KEYS: dict[str, tuple[str, ...]] = {"tpot_ms_mean": ("mean_tpot_ms",)}


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f else None  # NaN -> None


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
    row["failed"] = int(result.get("failed") or 0)
    row["completed"] = int(result.get("completed") or 0)
    row["duration_s"] = _num(result.get("duration"))
    row["num_prompts"] = result.get("num_prompts")
    return row


def make_record(config: str, concurrency: int, repeat: int, parsed: dict[str, Any], **extra: Any) -> dict[str, Any]:
    rec = {"config": config, "concurrency": int(concurrency), "repeat": int(repeat)}
    for k in ROW_KEYS[3:]:
        rec[k] = parsed.get(k)
    for k in ("completed", "duration_s", "num_prompts", *EXTRA_RESULT_KEYS):
        if k in parsed:
            rec[k] = parsed[k]
    rec.update(extra)
    return rec


# =================================================================== reporting
