"""Busy SMs, at 2, 4 and 8 ranks, each on its own GPU (progress_scenarios.py): another kernel holds
all but one SM of every GPU (or of rank 0's only) for 2 ms while the plain all-reduce (every kernel
of the size table) and the fused op at 16 x 8192 and 1 x 8192 run; with YALI_TIMEOUT_S=5 each must
complete, exactly, without the watchdog. With the ranks sharing one GPU (YALI_ALLOW_SHARED_GPU=1)
the processes take turns on it, so this checks the results, not the scheduling.

The whole-row fused kernels beside a busy kernel that holds all but 60 SMs (16 at four ranks) of
every rank's GPU for longer than YALI_TIMEOUT_S: each call must complete, exactly, while that
kernel still runs. With the ranks sharing one GPU each process's busy kernel holds the SMs in its
own time slices, in which that rank's kernels run, so this checks the scheduling too."""
import pytest

from yali_vllm import _ext

from . import progress_scenarios as ps
from .pair import run_ranks
from .testing_ops import needs_testing_ops

WORLD_SIZES = (2, 4, 8)
BOUND_S = {2: 120, 4: 150, 8: 200}


@pytest.mark.gpu
@needs_testing_ops
@pytest.mark.timeout(max(BOUND_S.values()) + 30)
@pytest.mark.parametrize("busy", ["all", "rank0"])
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_calls_complete_beside_busy_sms(world_size, busy):
    res = run_ranks(ps.calls_beside_busy_sms, busy, world_size=world_size, timeout=BOUND_S[world_size],
                    env={"YALI_TIMEOUT_S": "5"})
    for rank, r in enumerate(res):
        assert r["error"] is None and r["abort"] == "", (rank, r)
        assert r["wrong"] == 0, (rank, r)
        assert len(r["times_ms"]) == len(ps.span_counts(world_size)) + len(ps.FUSED_SHAPES), r
    print({rank: r["times_ms"] for rank, r in enumerate(res)})


LONG_BOUND_S = {2: 150, 4: 200}


@pytest.mark.gpu
@needs_testing_ops
@pytest.mark.timeout(max(LONG_BOUND_S.values()) + 30)
@pytest.mark.parametrize("world_size", sorted(ps.LONG_SHAPES), ids=lambda n: f"{n}-ranks")
def test_whole_row_fused_calls_complete_while_other_kernels_hold_most_sms(world_size):
    """ps.fused_beside_long_occupier: each call completes, exactly, while the busy kernel (longer
    than YALI_TIMEOUT_S) still holds all but ps.FREE_SMS SMs of every rank's GPU."""
    res = run_ranks(ps.fused_beside_long_occupier, world_size=world_size, timeout=LONG_BOUND_S[world_size],
                    env={"YALI_TIMEOUT_S": str(ps.LONG_TIMEOUT_S)})
    for rank, r in enumerate(res):
        assert r["error"] is None and r["abort"] == "", (rank, r)
        assert r["wrong"] == 0, (rank, r)
        assert r["busy_after_calls"] is True, (rank, r)
    print({rank: (r["calls_ms"], r["calls_s"]) for rank, r in enumerate(res)})


@pytest.mark.cpu
@pytest.mark.skipif(_ext.library_error() is not None, reason=f"extension not built: {_ext.library_error()}")
def test_span_counts_fall_inside_every_kernel_span():
    for n in WORLD_SIZES:
        counts = ps.span_counts(n)
        spans = ps.kernel_spans(ps.table_of(n), top=ps.probe_top(n))
        assert len(counts) == len(spans) >= 1
        assert all(lo <= 2 * c <= hi for c, (_, lo, hi) in zip(counts, spans)), (n, counts, spans)
