"""CPU tests of the rank launcher (benchmarks/common/processes.py) and of the GPU suites' rank
entry (tests/gpu/pair.py): a result a rank sent survives the rank's death right after, and a rank
that dies without a result is named with how it ended."""
from __future__ import annotations

import os

from benchmarks.common.processes import launch_ranks
from tests.gpu.pair import _send


def _sends_then_dies(rank, port, q):
    _send(q, (rank, rank * 10))
    os._exit(3)  # as a trapped rank's teardown may: no clean interpreter exit


def _second_dies_silently(rank, port, q):
    if rank == 1:
        os._exit(5)
    _send(q, (rank, "ok"))


def test_a_result_sent_before_the_rank_dies_is_kept():
    results, timed_out = launch_ranks(_sends_then_dies, (), timeout=60, world_size=3)
    assert results == {0: 0, 1: 10, 2: 20} and not timed_out


def test_a_rank_that_dies_without_a_result_is_named(capsys):
    results, timed_out = launch_ranks(_second_dies_silently, (), timeout=60, world_size=2)
    assert 1 not in results and not timed_out
    err = capsys.readouterr().err
    assert "rank 1 of 2 ended (exit code 5) before it reported a result" in err, err
    assert "rank 0" not in err, err  # it reported, or the launcher stopped it: neither is a silent death
