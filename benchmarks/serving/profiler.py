"""vLLM's torch profiler on a running server: its configuration, one profiled decode request,
one profiled prefill, and where their traces go."""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

from benchmarks.serving.budget import Deadline
from benchmarks.serving.http import http_post


def profiler_config(trace_dir: Path) -> dict[str, Any]:
    """vLLM --profiler-config for a decode profile into trace_dir: torch profiler,
    no Python stacks (smaller traces), workers only (no front-end trace)."""
    return {"profiler": "torch", "torch_profiler_dir": str(trace_dir.resolve()), "torch_profiler_with_stack": False,
            "ignore_frontend": True}


def _profiled(base_url: str, request: dict, deadline: Deadline, reserve_s: float) -> float:
    """One completion between /start_profile and /stop_profile; returns its seconds."""
    http_post(base_url + "/start_profile", {}, deadline.clip(60.0, reserve_s))
    t0 = time.monotonic()
    try:
        http_post(base_url + "/v1/completions", request, deadline.clip(120.0, reserve_s))
    finally:
        http_post(base_url + "/stop_profile", {}, deadline.clip(300.0, reserve_s))  # writes the traces
    return time.monotonic() - t0


def profile_request(base_url: str, model: str, tokens: int, deadline: Deadline, reserve_s: float) -> float:
    """One completion of `tokens` tokens after a short prompt, profiled; returns its seconds."""
    request = {"model": model, "prompt": "Profile this decode: " * 16, "max_tokens": tokens, "ignore_eos": True}
    return _profiled(base_url, request, deadline, reserve_s)


def prefill_prompt(prompt_tokens: int, seed: int) -> list[int]:
    """`prompt_tokens` random token ids (above the tokenizers' special ids): a prompt no earlier
    request shares, so the prefix cache cannot shorten its prefill."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 100_000) for _ in range(prompt_tokens)]


def profile_prefill(base_url: str, model: str, prompt_tokens: int, seed: int, deadline: Deadline,
                    reserve_s: float) -> float:
    """One request of `prompt_tokens` fresh prompt tokens and one output token, profiled: the trace
    holds the step that prefills it (and samples its first token). Returns its seconds."""
    request = {"model": model, "prompt": prefill_prompt(prompt_tokens, seed), "max_tokens": 1}
    return _profiled(base_url, request, deadline, reserve_s)


def move_traces(server_dir: Path, dest: Path) -> int:
    """Moves every file the profiler wrote into `server_dir` to `dest` (created), so that the next
    profile of the same server starts from an empty directory; returns how many moved."""
    dest.mkdir(parents=True, exist_ok=True)
    moved = 0
    for path in sorted(p for p in server_dir.rglob("*") if p.is_file()) if server_dir.is_dir() else []:
        target = dest / path.relative_to(server_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(path), str(target))
        moved += 1
    return moved
