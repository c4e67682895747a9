"""Two spawned CPU ranks for tests that need a real 2-rank torch.distributed (gloo)
group with real vLLM objects: each rank runs `worker(rank, port, *args)` and writes
its result to OUTDIR/rank<r>.json (the worker's last argument is OUTDIR)."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_cpu_ranks(worker, *args, outdir: Path) -> list[dict]:
    """Runs `worker(rank, port, *args, str(outdir))` on 2 spawned processes, bounded
    (300 s, then both are killed); returns both ranks' JSON results and fails on an
    "error" key in either."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=(free_port(), *args, str(outdir)), nprocs=2, join=False,
                             start_method="spawn")
    try:
        for _ in range(60):  # bounded: 60 x 5 s
            if ctx.join(timeout=5):
                break
        else:
            pytest.fail("two-rank CPU workers did not finish in 300 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert "error" not in r, r["error"]
    return results
