"""CPU tests of research/gemm_after_bench.py: predecessor names, the summary over rounds, the table."""
import argparse

import pytest

from research import gemm_after_bench as gab


def test_predecessor_names():
    assert gab.parse_pred("none") == {"name": "none", "kind": "none"}
    assert gab.parse_pred("torch")["kind"] == "torch"
    assert gab.parse_pred("probe-4x4-pdl") == {"name": "probe-4x4-pdl", "kind": "probe", "grid": 4, "cluster": 4,
                                               "pdl": True}
    assert gab.parse_pred("probe-128x1")["pdl"] is False
    assert [p["name"] for p in gab.parse_preds("none, probe-8x8")] == ["none", "probe-8x8"]
    assert all(gab.parse_pred(p) for p in gab.DEFAULT_PREDS)


@pytest.mark.parametrize("bad", ["probe-4x3", "probe-6x4", "probe-0x1", "probe-4x16", "plain", "probe-4x4-PDL", ""])
def test_bad_predecessor_names_are_refused_by_name(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="predecessor|no predecessor"):
        gab.parse_preds(bad)


def _rec(pred, rnd, layer, gemm, pre, graph="pair"):
    return {"graph_kind": graph, "pred": pred, "round": rnd, "us_per_call": layer, "gemm_us": gemm, "pred_us": pre}


def test_graph_names():
    assert gab.parse_graphs("layers") == ["layers"] and gab.parse_graphs("pair,layers") == ["pair", "layers"]
    for bad in ("", "pairs", "pair,layer"):
        with pytest.raises(argparse.ArgumentTypeError, match="graphs"):
            gab.parse_graphs(bad)
    assert gab.graph_name("pair", "torch") == "gate_up-after/torch"
    assert gab.graph_name("layers", "probe-4x4-pdl") == "layers/probe-4x4-pdl"


def test_summary_takes_medians_over_rounds_and_compares_with_none():
    recs = [_rec("none", 0, 108.0, 108.0, None), _rec("none", 1, 110.0, 110.0, None),
            _rec("none", 2, 109.0, 109.0, None),
            _rec("probe-4x1-pdl", 0, 122.0, 118.0, 4.0), _rec("probe-4x1-pdl", 1, 123.0, 119.9, 3.0),
            _rec("probe-4x1-pdl", 2, 121.0, 117.0, 5.0),
            # a decoder-layer graph is compared with the decoder layer without a kernel in front
            _rec("none", 0, 220.0, 100.0, None, "layers"), _rec("torch", 0, 240.0, 110.0, None, "layers")]
    summary = gab.summarize(recs)
    rows = {r["pred"]: r for r in summary if r["graph_kind"] == "pair"}
    layers = {r["pred"]: r for r in summary if r["graph_kind"] == "layers"}
    assert layers["torch"]["gemm_vs_none"] == 1.1 and layers["torch"]["graph"] == "layers/torch"
    assert rows["none"]["gemm_us"] == 109.0 and rows["none"]["gemm_vs_none"] == 1.0
    assert rows["none"]["pred_us"] is None
    p = rows["probe-4x1-pdl"]
    assert (p["layer_us"], p["gemm_us"], p["pred_us"], p["rounds"]) == (122.0, 118.0, 4.0, 3)
    assert p["gemm_vs_none"] == round(118.0 / 109.0, 3)
    assert p["gemm_us_by_round"] == [118.0, 119.9, 117.0]
    md = gab.markdown({"host": "1xH200", "layers": 32, "tokens": 1, "shape": [28672, 8192], "summary": list(rows.values()),
                       "sm_count": 132, "max_active_clusters": {"1": 132, "2": 66, "8": 16}})
    assert "| gate_up-after/probe-4x1-pdl | 122.00 | 118.00 | 1.083 | 4.0 | 118.00, 119.90, 117.00 |" in md
    assert "132 SMs: 1: 132, 2: 66, 8: 16" in md


def test_model_shapes_come_from_the_shared_arguments():
    # decode_gemm_bench's add_shape_args / shapes_of: the 70B model by default, the 8B model on request
    assert gab.shapes_of(gab.build_parser().parse_args([]))["gate_up"] == (28672, 8192)
    eight_b = gab.shapes_of(gab.build_parser().parse_args(
        ["--hidden", "4096", "--heads", "32", "--intermediate", "14336"]))
    assert eight_b == {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168)}
