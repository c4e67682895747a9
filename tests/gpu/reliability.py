"""Never wrong, never hung: checks that run inside both ranks of a pair (pair.py) and feed the
two ranks calls that must fail loudly (different calls on the two ranks, a peer that never comes
or dies mid-call) or must stay safe (close() with and without captured CUDA graphs).

Each scenario returns what a test asserts on: the error each rank saw, the YALI abort record,
how long the failure took. A failing kernel traps, which loses the process's CUDA context: a
scenario that expects it does nothing on the GPU afterwards but read the host-mapped record."""
from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from yali_vllm.communicator import YaliCommunicator, YaliError, shared_gpu_allowed

from .scenarios import _device, inputs, mismatches, reference

# The calls of each rank for one mismatch case: (elements, dtype, mode) of a plain all-reduce, or
# (rows, hidden, dtype) of the fused op. Both ranks' calls fill the same number of 16-byte
# vectors or chunks, so nothing but the call descriptor can tell them apart.
MISMATCH_CASES = {
    "bf16-1000-vs-997": [(1000, torch.bfloat16, "config"), (997, torch.bfloat16, "config")],
    "bf16-vs-fp16": [(4096, torch.bfloat16, "config"), (4096, torch.float16, "config")],
    "stream-16-bytes-shorter": [((16 << 20) // 2, torch.bfloat16, "stream"),
                                ((16 << 20) // 2 - 8, torch.bfloat16, "stream")],
    "flash-vs-stream": [(1 << 20, torch.bfloat16, "flash"), (1 << 20, torch.bfloat16, "stream")],
    "fused-hidden": [("fused", 2, 4096, torch.bfloat16), ("fused", 1, 8192, torch.bfloat16)],
    "fused-vs-plain": [("fused", 1, 8192, torch.bfloat16), (8192, torch.bfloat16, "config")],
}


def _call(comm: YaliCommunicator, spec, dev):
    if spec[0] == "fused":
        _, rows, hidden, dtype = spec
        x = torch.randn(rows, hidden, device=dev, dtype=dtype)
        w = torch.randn(hidden, device=dev, dtype=dtype)
        return comm.fused_allreduce_rmsnorm(x, torch.randn_like(x), w, 1e-6)
    n, dtype, mode = spec
    return comm.all_reduce(torch.randn(n, device=dev, dtype=torch.float32).to(dtype), mode=mode)


def _failure(comm: YaliCommunicator, t0: float) -> dict:
    """Waits for this rank's GPU; returns what failed and how (no CUDA call after a trap)."""
    try:
        comm.synchronize()
        error = None
    except YaliError as e:
        error = f"YaliError: {e}"
    except Exception as e:  # noqa: BLE001 - a lost context without a record is a finding too
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "abort": comm.abort_message(), "elapsed_s": time.time() - t0}


def _record_then_error(comm: YaliCommunicator, t0: float, wait_s: float = 30.0) -> dict:
    """Waits (host only) until the abort record appears, then for the CUDA error, each bounded.

    With both ranks' processes on one GPU, the two kernels trap at the same moment, and the
    driver was seen to leave one of the two contexts' synchronize waiting after both records were
    written; on two GPUs each trap is its own GPU's. So the record is awaited first, and the
    synchronize runs in a thread that may be left behind (the launcher ends the process)."""
    import threading

    while not comm.abort_message() and time.time() - t0 < wait_s:
        time.sleep(0.01)
    recorded_s = time.time() - t0
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(_failure(comm, t0)), daemon=True)
    thread.start()
    thread.join(timeout=10)
    return {"abort": comm.abort_message(), "recorded_s": recorded_s, "error": box.get("error"),
            "elapsed_s": box.get("elapsed_s")}


def assert_every_rank_raised(res: list[dict], world_size: int) -> None:
    """Every error the ranks saw is a YaliError, and on one GPU per rank every rank saw one. Kernels
    of several processes trap at once: on one shared GPU a synchronize may be left waiting
    (_record_then_error), so there at least one rank must have raised."""
    raised = [r["error"] for r in res if r["error"]]
    assert all(e.startswith("YaliError") for e in raised), raised
    assert len(raised) >= (1 if shared_gpu_allowed() else world_size), res


def mismatched_calls(rank, group, case):
    """Each rank issues its side of MISMATCH_CASES[case] after one good call: both must record a
    YALI abort naming both calls at once (not after the watchdog's YALI_TIMEOUT_S), and raise it."""
    dev = _device()
    comm = YaliCommunicator(group, dev)
    a, b = inputs(5, 4099, torch.bfloat16, dev)
    out = comm.all_reduce(a if rank == 0 else b)
    comm.synchronize()
    good = mismatches(out, reference(a, b))
    dist.barrier(group)
    t0 = time.time()
    _call(comm, MISMATCH_CASES[case][rank], dev)
    return {"good_call_mismatches": good, **_record_then_error(comm, t0)}


def peer_never_calls(rank, group, kind, wait_s):
    """Rank 1 stays alive but never issues the call: rank 0's kernel (flash-push, stream or the
    fused op) gives up after YALI_TIMEOUT_S with a reason naming the kernel and the wait."""
    dev = _device()
    comm = YaliCommunicator(group, dev)
    spec = {"flash": (1 << 10, torch.float32, "flash"), "stream": (16 << 20, torch.bfloat16, "stream"),
            "fused": ("fused", 4, 4096, torch.bfloat16)}[kind]
    if rank == 1:
        time.sleep(wait_s)  # alive: rank 0's mapping of our buffer stays valid while it times out
        return {"rank": 1}
    t0 = time.time()
    _call(comm, spec, dev)
    return _failure(comm, t0)


def peer_killed_mid_call(rank, group, wait_s):
    """Both ranks run good calls; rank 1 then starts a 256 MiB stream call, four times the ring (so
    it cannot send the whole message before rank 0 gives credits back), and is killed (SIGKILL)
    while it waits. Rank 0's same call must end with a reason within YALI_TIMEOUT_S plus a margin."""
    dev = _device()
    comm = YaliCommunicator(group, dev)
    x = torch.ones(128 << 20, device=dev, dtype=torch.bfloat16)
    for _ in range(2):
        comm.all_reduce(x, out=x, mode="stream")
    comm.synchronize()
    dist.barrier(group)
    if rank == 1:
        comm.all_reduce(x, out=x, mode="stream")
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)
    t0 = time.time()
    comm.all_reduce(x, out=x, mode="stream")
    return _failure(comm, t0)


def _graph_of(comm, x, out):
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        comm.all_reduce(x, out=out)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        comm.all_reduce(x, out=out)
    return g


def replay_after_close(rank, group, seed):
    """A graph captured YALI's kernels; both ranks close() and then replay it with fresh inputs:
    the buffers stayed (close() saw the capture), so the replays compute the exact all-reduce.
    A new eager call on the closed communicator is refused by name."""
    dev = _device()
    comm = YaliCommunicator(group, dev)
    n = 3 * 1024 + 5
    x = torch.empty(n, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    g = _graph_of(comm, x, out)
    comm.close()
    bad = 0
    for i in range(5):
        a, b = inputs(seed + i, n, torch.bfloat16, dev)
        x.copy_(a if rank == 0 else b)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        bad += mismatches(out, reference(a, b))
    try:
        comm.all_reduce(x)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    return {"mismatches": bad, "refused": refused, "abort": comm.abort_message()}


def close_and_reopen(rank, group, seed):
    """close() without captures frees the buffers on both ranks after both unmapped (the handle is
    gone afterwards); a second close() does nothing; a new communicator on the same GPUs then
    serves exact results."""
    from yali_vllm import _ext

    dev = _device()
    first = YaliCommunicator(group, dev)
    handle = first._handle
    first.all_reduce(torch.ones(4096, device=dev))
    first.close()
    first.close()
    try:
        _ext.ops().buffer_bytes(handle)
        freed = "the handle is still open"
    except RuntimeError as e:
        freed = str(e)
    second = YaliCommunicator(group, dev)
    a, b = inputs(seed, 12345, torch.float16, dev)
    out = second.all_reduce(a if rank == 0 else b)
    second.synchronize()
    bad = mismatches(out, reference(a, b))
    second.close()
    return {"mismatches": bad, "freed": freed, "kept": first._kept}


# Calls per CUDA graph of the PDL case: (a 1 MiB all-reduce, the foreign kernel, a 2 KiB one).
PDL_CALLS_PER_GRAPH = 64


def foreign_pdl_kernel_between_calls(rank, group, iterations, seed):
    """YALI call A (1 MiB fp32, after a random GPU sleep on one rank, so that A waits in its
    exchange), then a foreign kernel launched with programmatic stream serialization that triggers
    its dependents at once and never waits (the test kernel early_trigger), then YALI call B (2 KiB), each
    checked on the device against the two ranks' sum; captured PDL_CALLS_PER_GRAPH times per CUDA
    graph and replayed until `iterations` triples ran. If B could start before A completed (PDL is
    not transitive: DESIGN_LOG §7), the two calls would share a parity: wrong sums or a hang that
    YALI_TIMEOUT_S turns into a YaliError. Returns the wrong elements, the abort record and the
    triples run."""
    from . import testing_ops

    dev = _device()
    comm = YaliCommunicator(group, dev)
    foreign = testing_ops.ops()
    a0, a1 = inputs(seed, 1 << 18, torch.float32, dev)
    b0, b1 = inputs(seed + 1, 512, torch.float32, dev)
    ref_a, ref_b = reference(a0, a1), reference(b0, b1)
    mine_a, mine_b = (a0, b0) if rank == 0 else (a1, b1)
    g = torch.Generator().manual_seed(seed * 2 + rank)
    sleeps = torch.randint(0, 20_000, (PDL_CALLS_PER_GRAPH,), generator=g).tolist()  # cycles, this rank's
    spins = torch.randint(0, 3_000, (PDL_CALLS_PER_GRAPH,), generator=g).tolist()  # ns
    wrong = torch.zeros((), dtype=torch.int64, device=dev)

    def body():
        for j in range(PDL_CALLS_PER_GRAPH):
            torch.cuda._sleep(sleeps[j])
            out_a = comm.all_reduce(mine_a)
            foreign.early_trigger(dev.index, spins[j])
            out_b = comm.all_reduce(mine_b)
            wrong.add_((out_a != ref_a).sum() + (out_b != ref_b).sum())

    from .scenarios import capture_after_warmup

    graph = capture_after_warmup(body, dev)
    wrong.zero_()
    replays = max(1, iterations // PDL_CALLS_PER_GRAPH)
    error = None
    try:
        for _ in range(replays):
            graph.replay()
        comm.synchronize()
    except Exception as e:  # noqa: BLE001 - a trap: the record says why
        error = f"{type(e).__name__}: {e}"
    return {"wrong": None if error else int(wrong.item()), "error": error, "abort": comm.abort_message(),
            "triples": replays * PDL_CALLS_PER_GRAPH}
