"""CPU tests of the layer-level overlap benchmark (benchmarks/layer_overlap_bench.py): its shapes,
arguments, the refusal to time anything without two GPUs, and the report."""
from __future__ import annotations

import pytest

from benchmarks import layer_overlap_bench as lob


def test_shapes_are_the_tp2_row_parallel_layers():
    assert lob.SHAPES[("8b", "o_proj")] == (4096, 2048)
    assert lob.SHAPES[("8b", "down_proj")] == (4096, 7168)
    assert lob.SHAPES[("70b", "o_proj")] == (8192, 4096)
    assert lob.SHAPES[("70b", "down_proj")] == (8192, 14336)


def test_arguments():
    a = lob.build_parser().parse_args([])
    assert a.tokens == [512, 1024, 2048, 4096, 8192] and a.chunks == [2, 4, 8] and a.models == ["8b", "70b"]
    a = lob.build_parser().parse_args(["--tokens", "4096,512,512", "--models", "70b", "--chunks", "4"])
    assert a.tokens == [512, 4096] and a.models == ["70b"] and a.chunks == [4]
    with pytest.raises(SystemExit):
        lob.build_parser().parse_args(["--models", "405b"])


def test_no_timings_without_two_gpus(monkeypatch):
    monkeypatch.delenv("YALI_ALLOW_SHARED_GPU", raising=False)
    with pytest.raises(SystemExit, match="needs two GPUs"):
        lob.main(["--quick"])  # this machine has none
    monkeypatch.setenv("YALI_ALLOW_SHARED_GPU", "1")
    with pytest.raises(SystemExit, match="correctness tests only"):
        lob.main(["--quick"])


def test_report():
    p50 = {"gemm": 100.0, "unfused": 160.0, "fused": 140.0, "overlap-2": 120.0, "overlap-4": 110.0}
    res = {"date": "2026-11-24", "rounds": 4, "replays": 20, "ops": 8, "norm": "vllm fused_add_rms_norm",
           "records": [{"model": "8b", "layer": "down_proj", "tokens": 4096, "us_p50": p50,
                        "checks": {2: {"residual_bitwise": True}, 4: {"residual_bitwise": True}}}]}
    md = lob.markdown(res)
    row = [line for line in md.splitlines() if line.startswith("| 8b")][0]
    assert "| 110.0 | 1.45x | 1.27x | 60.0 / 40.0 / 10.0 |" in row, row
    assert "bitwise equal everywhere" in md
    res["records"][0]["checks"][4]["residual_bitwise"] = False
    assert "MISMATCHES: 8b down_proj 4096 chunks=4" in lob.markdown(res)
