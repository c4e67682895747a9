"""What the overlap model measures and reads: the model shapes, the token counts, the committed
all-reduce and fused-op results and the power-law interpolation between their sizes.

Everything here runs on the CPU; `measure_compute.py` (one GPU) and `model.py` (CPU) share it.
"""
from __future__ import annotations

import bisect
import json
import math
import os
import statistics
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "lab", "results")


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int

    def check_tp(self, tp: int) -> None:
        for what, n in (("heads", self.heads), ("kv_heads", self.kv_heads), ("intermediate", self.intermediate)):
            if n % tp:
                raise ValueError(f"shape {self.name}: {what}={n} does not split over tp={tp}")


SHAPES = {
    "8b": Shape("8b", 4096, 14336, 32, 8, 128, 32, 128256),
    "70b": Shape("70b", 8192, 28672, 64, 8, 128, 80, 128256),
    # --dry-run only: small enough for a CPU
    "tiny": Shape("tiny", 256, 512, 8, 4, 32, 2, 1000),
}
TPS = (2, 4)
DECODE_TOKENS = (1, 8, 16, 32, 64)
PREFILL_TOKENS = (512, 1024, 2048, 4096, 8192)
# The committed serving runs: 1024-token prompts, 128 output tokens (lab/results/current/serving/
# 20261128-8b-tp2-h200-alternated and 20261128-70b-tp4-h200-alternated, `--random-input-len 1024
# --random-output-len 128 --max-model-len 2048`). A decode sequence attends over 1024 + 64 tokens
# (the middle of its output); a prefill step carries whole 1024-token prompts (a step of T tokens:
# ceil(T / 1024) prompts of min(T, 1024) tokens, causal).
PROMPT_TOKENS = 1024
DECODE_KV_LEN = 1024 + 64


def half(tokens: int) -> int:
    return max(1, tokens // 2)


def token_set(phase: str, tokens: tuple[int, ...]) -> list[int]:
    """The token counts measured for `phase`: each count and its half (the two halves of a split)."""
    if phase not in ("decode", "prefill"):
        raise ValueError(f"phase must be decode or prefill, got {phase!r}")
    return sorted({t for n in tokens for t in (n, half(n))})


def prefill_prompts(tokens: int) -> tuple[int, int]:
    """(prompts, tokens per prompt) of a prefill step of `tokens` tokens."""
    if tokens <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")
    per = min(tokens, PROMPT_TOKENS)
    return math.ceil(tokens / per), per


def message_bytes(shape: Shape, tokens: int) -> int:
    """The all-reduce message of one layer's row-parallel GEMM: tokens x hidden in bf16."""
    return tokens * shape.hidden * 2


# The committed results the model reads (paths under lab/results/). All are bf16, CUDA-graph
# timings (p50 per op), YALI's default tables, NV18.
FUSED_FILES = {
    # 2xH200: hidden 4096 and 8192, 1-2048 tokens
    2: ["current/fused/20261128-tp2-h200/fused-tp2-h200.json"],
    # 4xH200, hidden 8192 only: 4-48 tokens (the default 512 KiB one-launch limit) and 16-256
    # tokens (the 524288 files: the same default); two rounds each
    4: ["current/fused/20261128-tp4-h200-one-launch-small/fused-tp4-below512k-0-r1.json",
        "current/fused/20261128-tp4-h200-one-launch-small/fused-tp4-below512k-0-r2.json",
        "current/fused/20261128-tp4-h200-one-launch/fused-tp4-onelaunch-524288-r1.json",
        "current/fused/20261128-tp4-h200-one-launch/fused-tp4-onelaunch-524288-r2.json"],
}
# 4xH100 (one-barrier spread kernel, the current one), 1-32 tokens of hidden 8192: the only
# four-rank timing of 1-2 tokens; scaled to H200 by the ratio of the two at their smallest common size.
FUSED_SMALL_H100 = {4: ["current/fused/20261127-tp4-h100-spread-one-barrier/fused-tp4-new.json"]}
ALLREDUCE_FILES = {
    2: "current/allreduce/20261128-tp2-h200/allreduce-20261128.json",  # 2xH200, 2 KiB-1 GiB
    4: "current/allreduce/20261128-tp4-h200-last-cta/allreduce-20261128-tp4.json",  # 4xH200, YALI to 16 MiB, NCCL to 1 GiB
}


def load_json(rel: str, results_dir: str = RESULTS) -> dict:
    path = os.path.join(results_dir, rel)
    if not os.path.exists(path):
        raise FileNotFoundError(f"committed result {rel} not found under {results_dir}")
    with open(path) as f:
        return json.load(f)


def interp_log_size(points: dict[int, float], nbytes: float) -> float:
    """Time at `nbytes` from {bytes: us}: a power law between the two nearest sizes (log time linear
    in log bytes), so a time that grows with the bytes (bandwidth-bound) is not overstated between
    sizes four times apart, and a flat one (latency-bound) stays flat. Raises ValueError outside
    the measured range (no extrapolation)."""
    if not points:
        raise ValueError("no measured sizes to interpolate")
    xs = sorted(points)
    if not xs[0] <= nbytes <= xs[-1]:
        raise ValueError(f"{nbytes} bytes is outside the measured sizes {xs[0]}-{xs[-1]}")
    i = bisect.bisect_left(xs, nbytes)
    if xs[i] == nbytes:
        return points[xs[i]]
    lo, hi = xs[i - 1], xs[i]
    w = (math.log2(nbytes) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return points[lo] * (points[hi] / points[lo]) ** w


def median_points(docs: list[dict], keep) -> dict[int, float]:
    """{bytes: median us_p50} over the rows of `docs` that `keep(row)` accepts."""
    acc: dict[int, list[float]] = {}
    for doc in docs:
        for r in doc["records"]:
            if keep(r):
                acc.setdefault(int(r["bytes"]), []).append(float(r["us_p50"]))
    return {b: statistics.median(v) for b, v in acc.items()}


class CommTimes:
    """The committed all-reduce and fused-op timings of one world size, by message size."""

    def __init__(self, tp: int, results_dir: str = RESULTS):
        if tp not in FUSED_FILES:
            raise ValueError(f"no committed fused results for tp={tp} (have {sorted(FUSED_FILES)})")
        self.tp = tp
        self.files = list(FUSED_FILES[tp]) + FUSED_SMALL_H100.get(tp, []) + [ALLREDUCE_FILES[tp]]
        fused = [load_json(f, results_dir) for f in FUSED_FILES[tp]]
        self.fused_by_hidden: dict[int, dict[int, float]] = {}
        for h in sorted({r["hidden"] for d in fused for r in d["records"]}):
            self.fused_by_hidden[h] = median_points(fused, lambda r, h=h: _fused_row(r) and r["hidden"] == h)
        small = [load_json(f, results_dir) for f in FUSED_SMALL_H100.get(tp, [])]
        self.small = self._scaled_small(small)
        ar = load_json(ALLREDUCE_FILES[tp], results_dir)
        self.allreduce = {b: median_points([ar], lambda r, b=b: _ar_row(r, b)) for b in ("yali", "nccl")}

    def _scaled_small(self, docs: list[dict]) -> dict[int, dict[int, float]]:
        """H100 fused points below the H200 range, per hidden, times H200/H100 at the smallest H200 size."""
        out = {}
        for h, h200 in self.fused_by_hidden.items():
            h100 = median_points(docs, lambda r, h=h: _fused_row(r) and r["hidden"] == h)
            join = min(h200)
            if not h100 or join not in h100:
                continue
            scale = h200[join] / h100[join]
            out[h] = {b: us * scale for b, us in h100.items() if b < join}
        return out

    def allreduce_us(self, nbytes: int, backend: str = "yali") -> float:
        """The plain all-reduce (no norm) of `nbytes`; `backend` yali or nccl."""
        return interp_log_size(self.allreduce[backend], nbytes)

    def ar_floor_us(self) -> float:
        """The smallest all-reduce measured (2 KiB, YALI): one launch, one NVLink trip, the flags."""
        pts = self.allreduce["yali"]
        return pts[min(pts)]

    def fused_us(self, hidden: int, tokens: int, norm_us: float, yali_serves) -> tuple[float, str]:
        """(us, source) of one fused all-reduce + residual add + RMSNorm of tokens x hidden bf16.
        Inside the measured fused sizes of this hidden (or, when this hidden was not measured, of
        the measured hidden at the same bytes): interpolated in log-size. Below them: the H100
        points scaled to H200; below those, the smallest measured call (an upper bound). Above them: the all-reduce of the backend that serves the size
        (`yali_serves(nbytes)`, else NCCL) plus `norm_us`, the add + RMSNorm measured on one GPU."""
        nbytes = tokens * hidden * 2
        pts = self.fused_by_hidden.get(hidden)
        how = f"fused h{hidden}"
        if pts is None:  # the same bytes of the measured hidden
            other = max(self.fused_by_hidden)
            pts, how = self.fused_by_hidden[other], f"fused h{other} at equal bytes"
        small = self.small.get(hidden) or self.small.get(max(self.fused_by_hidden), {})
        if nbytes < min(pts) and small:
            pts, how = {**small, **pts}, "fused (H100 scaled to H200 below the H200 sizes)"
        if min(pts) <= nbytes <= max(pts):
            return interp_log_size(pts, nbytes), how
        if nbytes < min(pts):  # smaller than any call measured at this world size
            return pts[min(pts)], "fused, clamped to the smallest measured size (an upper bound)"
        backend = "yali" if yali_serves(nbytes) else "nccl"
        return self.allreduce_us(nbytes, backend) + norm_us, f"allreduce {backend} + measured norm"


def _fused_row(r: dict) -> bool:
    return (r.get("backend") == "yali-fused" and r.get("dtype") == "bf16" and r.get("quant", "none") == "none"
            and r.get("timing", "graph") == "graph")


def _ar_row(r: dict, backend: str) -> bool:
    return r.get("backend") == backend and r.get("dtype") == "bf16" and r.get("timing") == "graph"


def yali_serves(tp: int):
    """nbytes -> whether YALI's size table (plan.cpp, through yali_vllm.config.plan) serves an
    all-reduce of that size at `tp` ranks; above it vLLM's chain runs NCCL."""
    from yali_vllm import config

    return lambda nbytes: config.plan(int(nbytes), "config", tp)[0] is not None


def yali_ctas(hidden: int, tokens: int, tp: int) -> tuple[int, str]:
    """(CTAs, kernel) of YALI's fused call of tokens x hidden bf16 at `tp` ranks, from the library's
    plan (yali_vllm.config.fused_plan / plan, no GPU needed): the one-launch grid, or in the
    two-launch path the all-reduce kernel's CTAs; None as kernel where NCCL serves the size."""
    import torch
    from yali_vllm import config

    launch = config.fused_plan(tokens, hidden, torch.bfloat16, tp)
    if launch["one_launch"]:
        return launch["grid"], "fused-one-launch"
    kernel, blocks, _ = config.plan(tokens * hidden * 2, "config", tp)
    if kernel is None:
        return NCCL_CTAS, "nccl"
    return blocks, kernel


# NCCL's CTAs (channels) for the sizes YALI does not serve: assumed, not read from NCCL (its ring on
# NVLink-connected Hopper uses up to 32 channels).
NCCL_CTAS = 32
