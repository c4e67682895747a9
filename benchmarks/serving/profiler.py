"""vLLM's torch profiler on a running server: its configuration and one profiled request."""

from __future__ import annotations

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


def profile_request(base_url: str, model: str, tokens: int, deadline: Deadline, reserve_s: float) -> float:
    """One completion of `tokens` tokens between /start_profile and /stop_profile; returns its seconds."""
    http_post(base_url + "/start_profile", {}, deadline.clip(60.0, reserve_s))
    t0 = time.monotonic()
    request = {"model": model, "prompt": "Profile this decode: " * 16, "max_tokens": tokens, "ignore_eos": True}
    try:
        http_post(base_url + "/v1/completions", request, deadline.clip(120.0, reserve_s))
    finally:
        http_post(base_url + "/stop_profile", {}, deadline.clip(300.0, reserve_s))  # writes the traces
    return time.monotonic() - t0
