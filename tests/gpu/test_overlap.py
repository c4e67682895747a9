"""Outputs over inputs are refused on the GPU, before any launch, naming the argument; in-place
calls stay served and exact (overlap_scenarios.py). Runs with the ranks sharing one GPU
(YALI_ALLOW_SHARED_GPU=1) or each on its own."""
import pytest

from . import overlap_scenarios as os_
from .pair import run_ranks

# What each overlapping call must be refused with (ValueError, the argument named).
REFUSALS = {
    "comm.all_reduce out 16 bytes on": "out must be x itself or not overlap it",
    "comm.all_reduce out 2 bytes on": "out must be x itself or not overlap it",
    "op all_reduce out 16 bytes on": "out must be input itself or not overlap it",
    "op all_reduce out 16 bytes before": "out must be input itself or not overlap it",
    "fused norm_out = residual": "norm_out must not overlap residual",
    "fused residual_out one row on": "residual_out must be residual itself or not overlap it",
    "fused norm_out over weight": "norm_out must not overlap weight",
    "ep_combine out over input": "out must not overlap input",
    "ep_dispatch output over input": "outputs[0] must not overlap inputs[0]",
    "ep_dispatch outputs over each other": "outputs[1] must not overlap outputs[0]",
}


@pytest.mark.gpu
@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda n: f"{n}-ranks")
def test_overlapping_views_are_refused_by_name_and_in_place_stays_exact(world_size):
    res = run_ranks(os_.overlapping_views, world_size=world_size, timeout=170, env={"YALI_TIMEOUT_S": "20"})
    for rank, r in enumerate(res):
        assert set(r["refusals"]) == set(REFUSALS), r
        for name, text in REFUSALS.items():
            got = r["refusals"][name]
            assert got is not None, (rank, name, "served: an overlapping view ran")
            assert got["type"] == "ValueError" and text in got["message"], (rank, name, got)
        assert r["launched"] == 0, (rank, r)  # refused before any launch
        assert r["wrong_in_place"] == 0 and r["wrong_fused_in_place"] == 0 and r["same_storage"], (rank, r)
        assert r["abort"] == "", (rank, r)
