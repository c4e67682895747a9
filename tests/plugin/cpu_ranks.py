"""Spawned CPU ranks for tests that need a real torch.distributed (gloo) group of N ranks with
real vLLM objects: each rank runs `worker(rank, port, *args, outdir)` and writes its result to
OUTDIR/rank<r>.json."""
from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.common.processes import launch_ranks

TIMEOUT_S = 300


class ListHandler(logging.Handler):
    """Keeps every message logged to it (a rank's plugin lines, for its JSON result)."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def cpu_rank(rank: int, port: int, world_size: int, outdir: str) -> Iterator[tuple[dict, ListHandler]]:
    """Inside a spawned worker: joins the gloo group (no NCCL: VLLM_DISABLE_PYNCCL=1), collects the
    plugin's log lines (INFO and up) and yields (result dict, handler). On leaving, an exception
    is recorded as the result's "error", the result is written to OUTDIR/rank<r>.json and the
    group is destroyed."""
    import torch.distributed as dist

    os.environ["VLLM_DISABLE_PYNCCL"] = "1"  # no NCCL library on a CPU box
    handler = ListHandler()
    log = logging.getLogger("vllm.yali")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    res: dict = {}
    try:
        yield res, handler
    except Exception as e:  # reported to the parent
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(res))
        dist.destroy_process_group()


def _rank(rank: int, port: int, worker, args: tuple, outdir: str, q) -> None:
    worker(rank, port, *args, outdir)
    q.put((rank, "done"))


def run_cpu_ranks(worker, *args, outdir: Path, world_size: int = 2) -> list[dict]:
    """Runs `worker(rank, port, *args, str(outdir))` on `world_size` spawned processes, bounded
    (300 s, then all are killed); returns every rank's JSON result, in rank order, and fails on
    an "error" key in any of them."""
    done, timed_out = launch_ranks(_rank, (worker, args, str(outdir)), TIMEOUT_S, world_size=world_size)
    if timed_out:
        pytest.fail(f"{world_size}-rank CPU workers did not finish in {TIMEOUT_S} s")
    missing = [r for r in range(world_size) if not (outdir / f"rank{r}.json").exists()]
    if missing:
        pytest.fail(f"rank(s) {missing} wrote no result (finished: {sorted(done)}; see their output above)")
    results = [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(world_size)]
    for r in results:
        assert "error" not in r, r["error"]
    return results


def run_two_cpu_ranks(worker, *args, outdir: Path) -> list[dict]:
    """run_cpu_ranks with two ranks."""
    return run_cpu_ranks(worker, *args, outdir=outdir, world_size=2)


def same_on_every_rank(results: list[dict], key: str):
    """The value of `key` on rank 0, after checking every rank has the same."""
    values = [res[key] for res in results]
    assert all(v == values[0] for v in values), f"{key} differs between ranks: {values}"
    return values[0]
