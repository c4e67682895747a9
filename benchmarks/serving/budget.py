"""The run's time budget (every wait is clipped to what is left), its progress lines, the
signals that stop it through every ``finally``, and the order of its benchmark points."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def num_prompts_for(concurrency: int, per_concurrency: int, minimum: int) -> int:
    """Prompts for one benchmark point: scaled by concurrency, never below ``minimum``."""
    return max(int(minimum), int(per_concurrency) * int(concurrency))


def interleaved_schedule(configs: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """``[(1, yali), (1, vllm-default), (1, nccl), (2, yali), ...]`` (repeats are 1-based)."""
    return [(r, c) for r in range(1, repeats + 1) for c in configs]


def startup_estimate(config: str, observed: dict[str, float], default_s: float) -> float:
    """The start-up time to plan for before a server of ``config`` starts: its own last start in
    this run (a configuration's first start compiles, its later ones come from vLLM's compile
    cache), else the slowest start seen of any configuration, else ``default_s``."""
    if config in observed:
        return observed[config]
    return max(observed.values()) if observed else float(default_s)


class Estimates:
    """The times the budget plans with: a configuration's server start-up and a point's benchmark.
    This run's own observations come first, then those an earlier run saved in ``path`` under the
    same workload ``key`` (on the machine whose vLLM compile cache that run filled), then the
    defaults. Every observation is saved at once, so the next run of the key plans with it.
    ``path`` None keeps everything in memory."""

    def __init__(self, path: Path | None, key: str, startup_default_s: float, bench_default_s: float):
        self.path, self.key = path, key
        self.startup_default_s, self.bench_default_s = float(startup_default_s), float(bench_default_s)
        saved = self._load().get(key, {})
        self.startup_saved: dict[str, float] = dict(saved.get("startup", {}))
        self.bench_saved: dict[str, float] = dict(saved.get("bench", {}))
        self.startup_seen: dict[str, float] = {}
        self.bench_seen: dict[str, float] = {}

    def _load(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: plan with the defaults
            return {}
        return data if isinstance(data, dict) else {}

    def startup(self, config: str) -> float:
        """``config``'s last start (this run's, else the saved one), else the slowest known start."""
        return startup_estimate(config, {**self.startup_saved, **self.startup_seen}, self.startup_default_s)

    def bench(self, label: str) -> float:
        """The longest run of point ``label`` (``c1``, ``c32``, ``long``) known, else the default."""
        return self.bench_seen.get(label, self.bench_saved.get(label, self.bench_default_s))

    def first_bench(self) -> float:
        """The shortest point known: what a server start must leave room for at least."""
        known = {**self.bench_saved, **self.bench_seen}
        return min(known.values()) if known else self.bench_default_s

    def saw_startup(self, config: str, seconds: float) -> None:
        self.startup_seen[config] = float(seconds)
        self._save()

    def saw_bench(self, label: str, seconds: float) -> None:
        self.bench_seen[label] = max(self.bench_seen.get(label, 0.0), float(seconds))
        self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        data = self._load()
        data[self.key] = {"startup": {**self.startup_saved, **self.startup_seen},
                          "bench": {**self.bench_saved, **self.bench_seen}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(self.path)


class Deadline:
    """A global time budget; every wait is clipped to what is left of it."""

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic):
        self.budget_s = float(budget_s)
        self._clock = clock
        self._t0 = clock()

    def elapsed(self) -> float:
        return self._clock() - self._t0

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def clip(self, timeout_s: float, reserve_s: float = 0.0) -> float:
        return max(0.0, min(float(timeout_s), self.remaining() - reserve_s))


class Progress:
    def __init__(self, tag: str, deadline: Deadline):
        self.tag = tag
        self.deadline = deadline

    def __call__(self, msg: str) -> None:
        d = self.deadline
        print(
            f"[{self.tag} +{d.elapsed():7.1f}s | {max(d.remaining(), 0.0):6.1f}s left] {msg}",
            flush=True,
        )


class Terminated(BaseException):
    """Raised from SIGTERM/SIGHUP so that every ``finally`` (server stops) runs."""


def install_signal_handlers() -> None:
    def _handler(signum: int, _frame: Any) -> None:
        raise Terminated(f"received signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):  # not main thread / unsupported
            signal.signal(sig, _handler)
