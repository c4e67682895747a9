"""The run's time budget (every wait is clipped to what is left), its progress lines, the
signals that stop it through every ``finally``, and the order of its benchmark points."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Sequence
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
