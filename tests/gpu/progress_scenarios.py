"""YALI's kernels while another kernel holds all but one SM of a GPU for a bounded time
(testing_occupy, csrc/core/yali/testing.cu): their CTAs reach the SMs late, one at a time and in
another order on each rank; every call must still complete, exactly (small-integer inputs, as in
delay_scenarios), without the watchdog. Because the SMs come back after OCCUPY_NS, a kernel whose
CTAs wait for peer CTAs that cannot run beside them completes too, only later: the call times
(reported) show which waited for the SMs."""
from __future__ import annotations

import time

import torch

from yali_vllm import _ext
from yali_vllm.communicator import YaliCommunicator

from .ranks_scenarios import kernel_spans, probe_top, small_ints, table_of
from .scenarios import _device

OCCUPY_NS = 2_000_000  # the busy SMs come back after 2 ms
FUSED_SHAPES = ((16, 8192), (1, 8192))  # (rows, hidden) bf16: several CTAs per row's senders, and one row
REPEATS = 5


def span_counts(world_size: int) -> list[int]:
    """One bf16 element count in the middle of every kernel span of the size table (flash-push and
    the first stream sizes at two ranks; push one-shot and two-shot at N)."""
    return [((lo + hi) // 4) | 1 for _, lo, hi in kernel_spans(table_of(world_size), top=probe_top(world_size))]


def calls_beside_busy_sms(rank, group, busy: str) -> dict:
    """Each all-reduce of span_counts and each fused shape, REPEATS times, launched while
    testing_occupy holds all but one SM of this GPU for OCCUPY_NS on another stream ("all": on every
    rank; "rank0": on rank 0 only, whose CTAs then trail the others'). Returns the wrong elements,
    any error, and the calls' times (milliseconds, CUDA events: about OCCUPY_NS when a call had to
    wait for the SMs)."""
    dev = _device()
    comm = YaliCommunicator(group, dev)
    y = _ext.ops()
    n_ranks, bf16 = comm.world_size, torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    side = torch.cuda.Stream(dev)
    base = float(n_ranks * (n_ranks + 1) // 2)
    calls = [("all_reduce", (n,)) for n in span_counts(n_ranks)] + [("fused", s) for s in FUSED_SHAPES]
    weight = torch.ones(8192, dtype=bf16, device=dev)
    wrong = torch.zeros((), dtype=torch.int64, device=dev)
    times: dict[str, list[float]] = {}
    error = None
    t0 = time.time()
    try:
        for kind, shape in calls:
            pattern = small_ints(shape, dev)
            x, out, norm = torch.empty_like(pattern), torch.empty_like(pattern), torch.empty_like(pattern)
            for _ in range(REPEATS):
                x.copy_(pattern).add_(float(rank + 1))
                torch.cuda.synchronize(dev)
                if busy == "all" or rank == 0:
                    with torch.cuda.stream(side):
                        y.testing_occupy(dev.index, sms - 1, OCCUPY_NS)
                    torch.cuda._sleep(2000)  # the busy kernel's CTAs reach the SMs first
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                if kind == "all_reduce":
                    comm.all_reduce(x, out=out)
                else:
                    comm.fused_allreduce_rmsnorm(x, None, weight[: shape[1]], 1e-6, norm_out=norm, residual_out=out)
                end.record()
                wrong.add_((out != pattern * n_ranks + base).sum())
                torch.cuda.synchronize(dev)
                times.setdefault(f"{kind} {shape}", []).append(round(start.elapsed_time(end), 3))
    except Exception as e:  # noqa: BLE001 - a trap after YALI_TIMEOUT_S: the record says why
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "abort": comm.abort_message(), "wrong": None if error else int(wrong.item()),
            "times_ms": times, "sms": sms, "elapsed_s": time.time() - t0}
