"""The abort record of a stalled call names this rank's call (stall_scenarios.py), with the ranks
sharing one GPU (YALI_ALLOW_SHARED_GPU=1) or each on its own: another kernel holds all but two SMs
while rank 0 alone issues a call of 128 CTAs, so the CTA that checks the call never runs."""
import pytest

from . import stall_scenarios as st
from .pair import run_ranks
from .testing_ops import needs_testing_ops

STALL_TIMEOUT_S = 3.0  # YALI_TIMEOUT_S of the stalled call
STALL_WAIT_S = STALL_TIMEOUT_S + 30.0  # how long the busy kernel holds the SMs and rank 0 waits for its record
RECORD_MARGIN_S = 20.0  # trap and, with the processes sharing one GPU, their turns on it


@pytest.mark.gpu
@needs_testing_ops
@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["all_reduce", "fused"])
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda n: f"{n}-ranks")
def test_a_stalled_call_records_this_ranks_call(world_size, kind):
    res = run_ranks(st.stalled_call_record, kind, STALL_WAIT_S, world_size=world_size, timeout=170,
                    env={"YALI_TIMEOUT_S": str(STALL_TIMEOUT_S)})
    r = res[0]
    assert r["ctas"] >= st.MIN_CTAS, r
    assert "gave up after YALI_TIMEOUT_S=3s" in r["abort"], r
    assert f"this rank: {r['expected']};" in r["abort"], r
    assert "(still empty;" in r["abort"] or "(partly arrived;" in r["abort"], r
    assert STALL_TIMEOUT_S * 0.9 <= r["recorded_s"] < STALL_TIMEOUT_S + RECORD_MARGIN_S, r
