"""The benchmarks' one graph capture and timed replay loop (benchmarks/common/timing.py:
capture_graph / replay_per_op, composed by time_graph; every graph-timing benchmark uses them) on a real
GPU: the graph holds n_ops calls, time_graph replays it once untimed and replays + 1 times timed,
and hands back one per-op time per kept replay. One GPU is enough; it runs with the GPU tests."""
import pytest
import torch

from benchmarks.common import timing

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(120)
def test_time_graph_replays_what_it_captured_and_times_each_replay():
    n_ops, replays, warmups = 7, 9, 3  # capture_graph's default warm-up calls
    x = torch.zeros(1 << 16, dtype=torch.float32, device="cuda")
    entered = []

    class Ctx:  # the capture context (vLLM's custom all-reduce registration in the benchmark)
        def __enter__(self):
            entered.append(torch.cuda.is_current_stream_capturing())

        def __exit__(self, *exc):
            return False

    per_op = timing.time_graph(torch, lambda t: t.add_(1.0), x, n_ops, replays, Ctx)
    torch.cuda.synchronize()
    # warm-ups run eagerly, the capture itself runs nothing, then 1 untimed + replays + 1 timed replays
    assert x.eq(warmups + n_ops * (replays + 2)).all(), x[:4]
    assert entered == [False], "the capture context must be entered once, before the capture starts"
    assert len(per_op) == replays  # the first timed replay is dropped
    assert all(0.0 < t < 1000.0 for t in per_op), per_op
