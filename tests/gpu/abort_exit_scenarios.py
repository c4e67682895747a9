"""A bounded end after an abort, on the GPU (the ranks may share one: YALI_ALLOW_SHARED_GPU=1):
every rank's process ends, or raises YaliError, within a bound after the ranks issue different
calls, with the abort watcher on (YALI_ABORT_EXIT). The launcher keeps every process's exit code and
end time, and each rank logs to its own file, so a process that the watcher ends (exit code
ABORT_EXIT_CODE, one log line) is told from one that hung (killed at the bound)."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from yali_vllm.communicator import YaliCommunicator, YaliError

from .ep_scenarios import SLOT_BYTES
from .scenarios import _device

MISMATCH_CASES = ("all_reduce", "fused", "ep_dispatch")


def _good_and_mismatched(comm: YaliCommunicator, case: str, rank: int, dev):
    """(a call every rank makes alike, this rank's side of the mismatched call) of `case`: rank 0
    differs from every other rank (all-reduce 64 KiB against 128 KiB, the fused op at hidden 4096
    against 8192 of the same bytes, the EP dispatch with other token counts)."""
    bf16, world = torch.bfloat16, comm.world_size
    if case == "all_reduce":
        n = (64 << 10) // 2 if rank == 0 else (128 << 10) // 2
        x = torch.ones(n, dtype=bf16, device=dev)
        return (lambda: comm.all_reduce(torch.ones(4096, dtype=bf16, device=dev))), (lambda: comm.all_reduce(x))
    if case == "fused":
        rows, hidden = (2, 4096) if rank == 0 else (1, 8192)
        x, w = torch.ones(rows, hidden, dtype=bf16, device=dev), torch.ones(hidden, dtype=bf16, device=dev)
        good_x, good_w = torch.ones(4, 4096, dtype=bf16, device=dev), torch.ones(4096, dtype=bf16, device=dev)
        return ((lambda: comm.fused_allreduce_rmsnorm(good_x, None, good_w, 1e-6)),
                (lambda: comm.fused_allreduce_rmsnorm(x, None, w, 1e-6)))
    good = [4] * world
    theirs = good if rank == 0 else [5] + [4] * (world - 2) + [3]
    t_good = torch.ones(good[rank], 2048, dtype=bf16, device=dev)
    t_bad = torch.ones(theirs[rank], 2048, dtype=bf16, device=dev)
    return (lambda: comm.ep_dispatch([t_good], good)), (lambda: comm.ep_dispatch([t_bad], theirs))


def _note(path: Path, **event) -> None:
    """Appends one event to this rank's report, on disk at once (the process may end any moment)."""
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _mismatch_rank(rank: int, world: int, port: int, case: str, outdir: str, env: dict) -> None:
    """One rank's process: a good call, then its side of the mismatched call and a synchronize, as a
    server's step waits for its GPU. Reports "calling", then "raised" (YaliError), "returned" or
    "error"; the abort watcher may end the process first."""
    from benchmarks.common.gpu_env import MULTICAST_OFF_ENV

    from .pair import rank_device

    os.environ.update(MULTICAST_OFF_ENV)
    os.environ.update(env)
    report = Path(outdir, f"rank{rank}.jsonl")
    handler = logging.FileHandler(Path(outdir, f"rank{rank}.log"))
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("yali_vllm").addHandler(handler)
    try:
        torch.cuda.set_device(rank_device(rank))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        dev = _device()
        comm = YaliCommunicator(dist.group.WORLD, dev, ep_slot_bytes=SLOT_BYTES)
        good, mismatched = _good_and_mismatched(comm, case, rank, dev)
        good()
        comm.synchronize()
        dist.barrier()
        _note(report, event="calling", t=time.time())
        mismatched()
        comm.synchronize()
        _note(report, event="returned", t=time.time())
    except YaliError as e:
        _note(report, event="raised", t=time.time(), error=str(e))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        _note(report, event="error", t=time.time(), error=f"{type(e).__name__}: {e}")
    # The rank reported: it ends here (a group teardown beside ranks that are gone could wait).
    logging.shutdown()
    os._exit(0)


def run_mismatch(case: str, world: int, outdir: str, bound_s: float, env: dict) -> list[dict]:
    """Starts `world` rank processes of `case` (spawned, as pair.run_ranks does) and waits up to
    `bound_s` for all of them to end; kills any left. Returns per rank its exit code (None: killed
    at the bound), when it ended (time.time()), its reported events and its log."""
    import multiprocessing as mp

    from benchmarks.common.processes import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_mismatch_rank, args=(r, world, port, case, outdir, env)) for r in range(world)]
    for p in procs:
        p.start()
    ended: dict[int, float] = {}
    deadline = time.monotonic() + bound_s
    while len(ended) < world and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.exitcode is not None:
                ended[r] = time.time()
        time.sleep(0.1)
    out = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
        report, log = Path(outdir, f"rank{r}.jsonl"), Path(outdir, f"rank{r}.log")
        events = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
        out.append({"exitcode": p.exitcode if r in ended else None, "ended": ended.get(r), "events": events,
                    "log": log.read_text() if log.exists() else ""})
    return out
