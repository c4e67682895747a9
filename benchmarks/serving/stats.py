"""Statistics over the repeats of a point and the verdict of yali against another config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.serving.schema import DEFAULT_CONFIGS


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    lower_is_better: bool
    fmt: str = "{:.2f}"


METRICS: tuple[Metric, ...] = (
    Metric("tpot_ms_p50", "TPOT p50 (ms)", True, "{:.3f}"),
    Metric("tpot_ms_p99", "TPOT p99 (ms)", True, "{:.3f}"),
    Metric("tpot_ms_mean", "TPOT mean (ms)", True, "{:.3f}"),
    Metric("itl_ms_p50", "ITL p50 (ms)", True, "{:.3f}"),
    Metric("itl_ms_p99", "ITL p99 (ms)", True, "{:.3f}"),
    Metric("ttft_ms_p50", "TTFT p50 (ms)", True, "{:.1f}"),
    Metric("ttft_ms_mean", "TTFT mean (ms)", True, "{:.1f}"),
    Metric("ttft_ms_p99", "TTFT p99 (ms)", True, "{:.1f}"),
    Metric("output_tok_s", "output tok/s", False, "{:.1f}"),
)
METRIC_BY_KEY = {m.key: m for m in METRICS}


@dataclass(frozen=True)
class Stat:
    n: int
    mean: float
    lo: float
    hi: float

    @property
    def spread(self) -> float:
        """The spread between repeats: max - min."""
        return self.hi - self.lo


def summarize(values: Sequence[float | None]) -> Stat | None:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    return Stat(len(vals), sum(vals) / len(vals), min(vals), max(vals))


def ordered_configs(records: Sequence[dict[str, Any]]) -> list[str]:
    seen = {r["config"] for r in records}
    out = [c for c in DEFAULT_CONFIGS if c in seen]
    out += sorted(seen - set(out))
    return out


def aggregate(records: Sequence[dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
    """``{(concurrency, config): {metric_key: Stat|None, ..., "failed": int, "repeats": int}}``."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((int(r["concurrency"]), r["config"]), []).append(r)
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for key, rows in groups.items():
        agg: dict[str, Any] = {m.key: summarize([r.get(m.key) for r in rows]) for m in METRICS}
        agg["req_s"] = summarize([r.get("req_s") for r in rows])
        agg["failed"] = sum(int(r.get("failed") or 0) for r in rows)
        agg["repeats"] = len(rows)
        out[key] = agg
    return out


def verdict(yali: Stat | None, other: Stat | None, lower_is_better: bool) -> tuple[str, str]:
    """Compare yali against another config for one metric.

    Returns ``(code, text)`` where code is ``"no difference"``, ``"better"``,
    ``"worse"`` (from yali's point of view) or ``"n/a"``.  A difference of the
    means that is not larger than the spread between repeats (max - min over
    repeats; the larger of the two configs') is reported as no difference.
    """
    if yali is None or other is None:
        return "n/a", "n/a (missing)"
    if yali.n < 2 or other.n < 2:
        return "n/a", "n/a (needs >= 2 repeats)"
    diff = yali.mean - other.mean
    noise = max(yali.spread, other.spread)
    if abs(diff) <= noise:
        return "no difference", f"no difference (|Δ| {abs(diff):.3g} ≤ spread {noise:.3g})"
    rel = (diff / other.mean * 100.0) if other.mean else float("inf")
    better = diff < 0 if lower_is_better else diff > 0
    code = "better" if better else "worse"
    return code, f"yali {rel:+.1f}% ({code})"
