"""Two spawned CPU ranks for tests that need a real 2-rank torch.distributed (gloo)
group with real vLLM objects: each rank runs `worker(rank, port, *args, outdir)` and writes
its result to OUTDIR/rank<r>.json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.common.processes import launch_two_ranks

TIMEOUT_S = 300


def _rank(rank: int, port: int, worker, args: tuple, outdir: str, q) -> None:
    worker(rank, port, *args, outdir)
    q.put((rank, "done"))


def run_two_cpu_ranks(worker, *args, outdir: Path) -> list[dict]:
    """Runs `worker(rank, port, *args, str(outdir))` on 2 spawned processes, bounded
    (300 s, then both are killed); returns both ranks' JSON results and fails on an
    "error" key in either."""
    done, timed_out = launch_two_ranks(_rank, (worker, args, str(outdir)), TIMEOUT_S)
    if timed_out:
        pytest.fail(f"two-rank CPU workers did not finish in {TIMEOUT_S} s")
    missing = [r for r in range(2) if not (outdir / f"rank{r}.json").exists()]
    if missing:
        pytest.fail(f"rank(s) {missing} wrote no result (finished: {sorted(done)}; see their output above)")
    results = [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert "error" not in r, r["error"]
    return results
