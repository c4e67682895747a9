"""Forward progress with few free SMs, over the whole launch table (CPU; the compiled table).

The CTAs of a launch reach the SMs in index order (with thread block clusters, cluster after
cluster, the CTAs of one cluster together), and another kernel may hold every other SM. A CTA that
waits for data that only a CTA of a later cluster sends, on any rank, can then wait forever: the
sender never gets an SM. The rule: every CTA waits only for work of CTAs of its own cluster or an
earlier one (without clusters: of an index up to its own), on every rank. Then the earliest
unfinished CTAs are always running and have what they wait for, and every call completes with one
free SM (one cluster) per rank.

The model maps, per kernel, what each CTA sends and what it waits for, as the kernels compute it
(csrc/core/yali: fused.cuh fused_work, n_rank.cuh, n_rank_fused.cuh, push.cuh, stream.cuh, call_check.cuh's checker)
from the launch the library plans for the shape (config.fused_plan, config.plan), and checks the
rule for every world size, every fused row count 1..2048 at hidden 2048..16384 in bf16, fp16 and
fp32 (one launch and two), and the all-reduce kernels of every message size those calls use."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from yali_vllm import _ext, config

pytestmark = pytest.mark.skipif(_ext.library_error() is not None, reason=f"extension not built: {_ext.library_error()}")

WORLD_SIZES = (2, 4, 6, 8)
ROWS = range(1, 2049)
HIDDENS = tuple(range(2048, 16385, 512))
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MODES = ("auto", "flash", "stream")  # two ranks: every kernel of the table


def chunk_starts(vecs: int, parts: int, count: int) -> np.ndarray:
    """Where chunk i of kernel_common.cuh's split_range(0, vecs, parts, i) starts, i = 0..count."""
    per = -(-vecs // parts)
    return np.minimum(vecs, per * np.arange(count + 1, dtype=np.int64))


def whole_row_work(rows: int, row_vecs: int, grid: int, cluster: int):
    """fused.cuh fused_work for every CTA: (send_start[b], send_end[b]) and the rows it owns
    [row_begin[b], row_end[b]) (empty when row_begin >= row_end)."""
    senders = grid - 1 if cluster == 1 and rows < grid else grid
    at = chunk_starts(rows * row_vecs, senders, grid)
    b = np.arange(grid)
    first = b - b % cluster
    row_begin = np.where(b == first, at[first] // row_vecs, -(-at[b] // row_vecs))
    row_end = np.minimum(-(-at[b + 1] // row_vecs), at[first + cluster] // row_vecs)
    return at[:-1], at[1:], row_begin, row_end


def whole_row_waits(rows: int, row_vecs: int, grid: int, cluster: int) -> np.ndarray:
    """The latest CTA each CTA of a whole-row fused launch waits for (-1: none), after checking that
    the sends cut the message and the owned rows cut the rows, each exactly once."""
    send_start, send_end, row_begin, row_end = whole_row_work(rows, row_vecs, grid, cluster)
    assert send_start[0] == 0 and send_end[-1] == rows * row_vecs and (send_start[1:] == send_end[:-1]).all()
    owned = np.maximum(row_end - row_begin, 0)
    assert owned.sum() == rows
    starts = row_begin[owned > 0]
    assert starts[0] == 0 and (starts[1:] == np.cumsum(owned[owned > 0])[:-1]).all()
    # The sender of vector v is the CTA whose chunk holds it; a row range's latest is its last vector's.
    last_vec = row_end * row_vecs - 1
    latest = np.searchsorted(send_end, last_vec, side="right")
    return np.where(owned > 0, latest, -1)


def same_cta_waits(blocks: int) -> np.ndarray:
    """Kernels whose CTA b sends and waits for the same part of the message on every rank
    (push.cuh flash-push, n_rank.cuh push one-shot and two-shot: split_range(b) of the message or of
    every segment; stream.cuh: lane b's chunks and credits; n_rank_fused.cuh's spread kernel: slice b;
    ep.cuh): CTA b waits for CTA b."""
    return np.arange(blocks)


def violations(waits: np.ndarray, grid: int, cluster: int, checker: int) -> list[tuple[int, int]]:
    """(CTA, the later CTA it waits for) for every CTA that breaks the rule, the call checker's wait
    for the peers' checker (the same CTA index) included."""
    waits = waits.copy()
    waits[checker] = max(waits[checker], checker)
    later = waits // cluster > np.arange(grid) // cluster
    return [(int(b), int(waits[b])) for b in np.nonzero(later)[0]]


def all_reduce_violations(nbytes: int, mode: str, world: int):
    """The rule for the all-reduce of `nbytes` bytes as the table serves it: (kernel, violations),
    kernel None when YALI does not serve it."""
    kernel, blocks, _ = config.plan(nbytes, mode, world)
    if kernel is None:
        return None, []
    assert kernel in ("flash-push", "stream", "push-oneshot", "push-twoshot"), kernel
    checker = 0 if kernel == "stream" else blocks - 1  # stream: lane 0 checks the call
    return kernel, violations(same_cta_waits(blocks), blocks, 1, checker)


@functools.lru_cache(maxsize=None)
def one_launch_violations(rows: int, row_vecs: int, grid: int, cluster: int, spread: int):
    waits = same_cta_waits(grid) if spread > 1 else whole_row_waits(rows, row_vecs, grid, cluster)
    return violations(waits, grid, cluster, grid - 1)


def fused_violations(rows: int, hidden: int, dtype, world: int):
    """The rule for one fused call: (its launch, violations of the one-launch kernel, the bytes of
    the two-launch path's all-reduce or 0)."""
    launch = config.fused_plan(rows, hidden, dtype, world)
    if not launch["one_launch"]:  # the all-reduce, then the epilogue: a CTA per row, no waits
        return launch, [], rows * hidden * dtype.itemsize
    row_vecs = hidden * dtype.itemsize // 16
    return launch, one_launch_violations(rows, row_vecs, launch["grid"], launch["cluster"], launch["spread"]), 0


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_every_fused_cta_waits_only_for_earlier_ctas(world):
    bad, all_reduce_bytes, one_launch = [], set(), 0
    for dtype in DTYPES:
        for hidden in HIDDENS:
            for rows in ROWS:
                launch, wrong, nbytes = fused_violations(rows, hidden, dtype, world)
                one_launch += bool(launch["one_launch"])
                if wrong:
                    bad.append((rows, hidden, str(dtype), launch, wrong[:3]))
                if nbytes:
                    all_reduce_bytes.add(nbytes)
    assert one_launch > 1000  # the table has one-launch shapes at every world size
    assert not bad, f"{len(bad)} fused shapes at {world} ranks wait for later CTAs, e.g. {bad[:5]}"
    served = 0
    for nbytes in sorted(all_reduce_bytes):
        kernel, wrong = all_reduce_violations(nbytes, "config", world)
        assert not wrong, (nbytes, kernel, wrong[:3])
        served += kernel is not None
    assert served > 0


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_every_all_reduce_cta_waits_only_for_earlier_ctas(world):
    sizes = sorted({n + d for k in range(4, 31) for n in (1 << k, 3 << k) for d in (-16, -2, 0, 2, 16)} - {0})
    kernels = set()
    for mode in MODES if world == 2 else ("config",):
        for nbytes in sizes:
            kernel, wrong = all_reduce_violations(nbytes, mode, world)
            assert not wrong, (nbytes, mode, kernel, wrong[:3])
            kernels.add(kernel)
    assert kernels - {None} == ({"flash-push", "stream"} if world == 2 else {"push-oneshot", "push-twoshot"})


@pytest.mark.parametrize("rows, hidden", [(256, 8192), (512, 8192), (1024, 4096), (2048, 2048)])
def test_round_robin_rows_break_the_rule(rows, hidden):
    """The rule finds the waits of rows owned round-robin (CTA b: rows b, b + grid, ...) while the
    message is cut into one chunk per CTA: at these shapes CTA 0 waits for chunks of CTA 64 or later."""
    launch = config.fused_plan(rows, hidden, torch.bfloat16, 2)
    grid, row_vecs = launch["grid"], hidden * 2 // 16
    assert launch["one_launch"] and launch["cluster"] == 1, launch
    send_end = chunk_starts(rows * row_vecs, grid, grid)[1:]
    last_row = np.array([rows - 1 - (rows - 1 - b) % grid for b in range(grid)])  # CTA b's last row
    waits = np.searchsorted(send_end, (last_row + 1) * row_vecs - 1, side="right")
    wrong = violations(waits, grid, 1, grid - 1)
    assert wrong and wrong[0][0] == 0 and wrong[0][1] >= grid // 2, wrong[:3]
