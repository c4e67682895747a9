"""YALI's kernels while another kernel holds all but one SM of a GPU for a bounded time
(occupy, csrc/testing/testing.cu): their CTAs reach the SMs late, one at a time and in
another order on each rank; every call must still complete, exactly (small-integer inputs, as in
delay_scenarios), without the watchdog. Because the SMs come back after OCCUPY_NS, a kernel whose
CTAs wait for peer CTAs that cannot run beside them completes too, only later: the call times
(reported) show which waited for the SMs.

fused_beside_long_occupier holds the SMs longer than YALI_TIMEOUT_S instead: a call whose CTAs wait
for CTAs that cannot get an SM then hangs into the watchdog, so completing shows forward progress
(tests/core/test_progress_order_cpu.py checks the rule behind it over the whole launch table).

Every kernel is launched once before any SM is held: with CUDA's lazy module loading, the first
launch of a kernel waits for every kernel the process runs, the busy one included."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from yali_vllm.communicator import YaliCommunicator

from . import testing_ops
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
    the test kernel occupy holds all but one SM of this GPU for OCCUPY_NS on another stream ("all": on every
    rank; "rank0": on rank 0 only, whose CTAs then trail the others'). Returns the wrong elements,
    any error, and the calls' times (milliseconds, CUDA events: about OCCUPY_NS when a call had to
    wait for the SMs)."""
    dev = _device()
    comm = YaliCommunicator(group, dev)
    busy_kernel = testing_ops.ops()
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
        for kind, shape in calls:  # warm-up: every kernel instance and the busy kernel load here
            x = small_ints(shape, dev)
            if kind == "all_reduce":
                comm.all_reduce(x)
            else:
                comm.fused_allreduce_rmsnorm(x, None, weight[: shape[1]], 1e-6)
        load_busy_kernel(dev)
        for kind, shape in calls:
            pattern = small_ints(shape, dev)
            x, out, norm = torch.empty_like(pattern), torch.empty_like(pattern), torch.empty_like(pattern)
            for _ in range(REPEATS):
                x.copy_(pattern).add_(float(rank + 1))
                torch.cuda.synchronize(dev)
                if busy == "all" or rank == 0:
                    with torch.cuda.stream(side):
                        busy_kernel.occupy(dev.index, sms - 1, OCCUPY_NS)
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


def load_busy_kernel(dev) -> None:
    """Launches the test kernel occupy once on one SM for 1 us, and torch's sleep kernel (which the scenarios
    run behind the busy kernel), and waits: their modules are loaded after this. (With CUDA's lazy
    loading the first launch of torch.cuda._sleep beside the busy kernel waited for it to end, so
    the calls behind it ran on an idle GPU.)"""
    testing_ops.ops().occupy(dev.index, 1, 1000)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize(dev)


# fused_beside_long_occupier: every rank keeps FREE_SMS[world] SMs (other kernels hold the rest) for
# LONG_OCCUPY_NS, longer than LONG_TIMEOUT_S (the test's YALI_TIMEOUT_S). The shapes, bf16, one launch
# each: at two ranks the whole-row fused kernel at 256, 512, 1024 and 2048 rows; at four the N-rank
# whole-row kernel at 64 x 4096 (grid 128 for 64 rows). A CTA that owned row b, b + grid, ... there
# waited for chunks that CTA 64, 96, 112, 120 (two ranks) and 32 (four) of the peers send, so these
# calls needed 65, 97, 113, 121 and 33 free SMs per rank.
LONG_TIMEOUT_S = 4
LONG_OCCUPY_NS = 12_000_000_000
FREE_SMS = {2: 60, 4: 16}
LONG_SHAPES = {2: ((256, 8192), (512, 8192), (1024, 4096), (2048, 2048)), 4: ((64, 4096),)}


def fused_beside_long_occupier(rank, group) -> dict:
    """Every shape of LONG_SHAPES once without and then once beside the test kernel occupy, which holds all
    but FREE_SMS SMs of this rank's GPU for LONG_OCCUPY_NS on another stream. Returns any error (a
    trap after YALI_TIMEOUT_S: a call waited for CTAs that had no SM), the wrong elements of the
    residual output (the exact sum) and of the normalised output (bitwise the call without the busy
    SMs), whether the busy kernel still ran when the calls had completed, and the calls' time."""
    dev = _device()
    comm = YaliCommunicator(group, dev)
    n_ranks, bf16 = comm.world_size, torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    base = float(n_ranks * (n_ranks + 1) // 2)
    weight = torch.ones(8192, dtype=bf16, device=dev)
    cases = []
    for rows, hidden in LONG_SHAPES[n_ranks]:
        pattern = small_ints((rows, hidden), dev)
        x = pattern + float(rank + 1)
        ref_norm, _ = comm.fused_allreduce_rmsnorm(x, None, weight[:hidden], 1e-6)  # warm-up and reference
        cases.append((x, pattern * n_ranks + base, ref_norm.clone(), torch.empty_like(x), torch.empty_like(x)))
    load_busy_kernel(dev)
    dist.barrier(group)  # every rank is warm: the busy SMs and the calls start together
    side = torch.cuda.Stream(dev)
    busy_done = torch.cuda.Event()
    with torch.cuda.stream(side):
        testing_ops.ops().occupy(dev.index, sms - FREE_SMS[n_ranks], LONG_OCCUPY_NS)
        busy_done.record(side)
    torch.cuda._sleep(100_000)  # the busy kernel's CTAs reach the SMs first
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    error, busy_after_calls, wrong = None, None, None
    t0 = time.time()
    try:
        start.record()
        for x, _, ref_norm, norm, res in cases:
            comm.fused_allreduce_rmsnorm(x, None, weight[: x.shape[1]], 1e-6, norm_out=norm, residual_out=res)
        end.record()
        end.synchronize()
        busy_after_calls = not busy_done.query()
        calls_s = time.time() - t0
        wrong = sum(int((res != want).sum()) + int((norm.view(torch.int16) != ref_norm.view(torch.int16)).sum())
                    for x, want, ref_norm, norm, res in cases)
        torch.cuda.synchronize(dev)  # the busy kernel ends by itself after LONG_OCCUPY_NS
    except Exception as e:  # noqa: BLE001 - a trap after YALI_TIMEOUT_S: the record says why
        error, calls_s = f"{type(e).__name__}: {e}", time.time() - t0
    return {"error": error, "abort": comm.abort_message(), "wrong": wrong, "busy_after_calls": busy_after_calls,
            "calls_s": round(calls_s, 3), "calls_ms": None if error else round(start.elapsed_time(end), 3),
            "sms": sms, "free_sms": FREE_SMS[n_ranks]}
