"""research/decode_gemm_bench.py on the CPU: shapes, argument checks and the report (the GPU part
runs on the GPU host)."""
import json

import pytest

from research import decode_gemm_bench as dg


def test_70b_tp2_shapes_match_the_serving_model():
    # Llama-3-70B at TP=2: 64 heads, 8 KV heads of 128, hidden 8192, intermediate 28672
    s = dg.gemm_shapes(8192, 64, 8, 128, 28672, 2)
    assert s == {"qkv": (5120, 8192), "o": (8192, 4096), "gate_up": (28672, 8192), "down": (8192, 14336)}
    per_layer = sum(n * k for n, k in s.values()) * 2
    assert 80 * per_layer / 2**30 == pytest.approx(63.75, abs=0.01)  # vLLM logged 65.75 GiB with the embeddings


def test_setups_are_checked_by_name():
    assert dg.parse_args(["--setups", "yali-first,plain,plain"]).setups == ["yali-first", "plain"]
    with pytest.raises(SystemExit):
        dg.parse_args(["--setups", "yali-frist"])
    with pytest.raises(SystemExit, match="--layers"):
        dg.parse_args(["--layers", "0"])
    with pytest.raises(SystemExit, match="--hidden"):
        dg.parse_args(["--hidden", "8190"])


def _rec(setup, graph, us, repeat=0):
    return {"setup": setup, "repeat": repeat, "graph": graph, "source": "events", "name": graph, "tokens": 1,
            "calls": 80, "us_per_call": us, "us_p99": us + 1}


def test_summary_takes_the_median_over_repeats_and_compares_with_plain():
    recs = [_rec("plain", "gate_up", 107.0), _rec("plain", "gate_up", 109.0, 1), _rec("plain", "gate_up", 100.0, 2),
            _rec("yali-first", "gate_up", 118.0), _rec("yali-first", "gate_up", 117.0, 1),
            _rec("yali-first", "gate_up", 130.0, 2),
            {"setup": "plain", "repeat": 0, "graph": "layers", "source": "profiler", "name": "nvjet_x", "tokens": 1,
             "calls": 80.0, "us_per_call": 50.0, "us_per_replay": 4000.0}]
    (row,) = dg.summarize(recs)
    assert row["graph"] == "gate_up"
    assert row["us"] == {"plain": 107.0, "yali-first": 118.0}
    assert row["vs_plain"] == {"yali-first": round(118 / 107, 3)}
    md = dg.markdown_table({"records": recs, "summary": dg.summarize(recs), "setup_info": []})
    assert "| gate_up | 107.00 | 118.00 (1.103) |" in md
    assert "`nvjet_x`" in md


def test_report_only_rebuilds_the_table(tmp_path):
    doc = {"kind": dg.KIND, "host": "2xH200", "records": [_rec("plain", "qkv", 20.0), _rec("yali-after", "qkv", 22.0)],
           "setup_info": [{"setup": "plain", "repeat": 0, "layers": 80, "free_gib_after_weights": 70.0,
                           "fill_gib": 60.0, "gate_up_aligned_2mib": 80}]}
    p = tmp_path / "decode-gemm-x.json"
    p.write_text(json.dumps(doc))
    md = dg.report_only(str(p))
    assert "| qkv | 20.00 | 22.00 (1.100) |" in md
    assert "| plain | 0 | 70.0 | 60.0 | 80/80 |" in md
    assert (tmp_path / "decode-gemm-x.md").read_text().endswith(md)


def test_gpu_state_is_attached_to_the_graph_it_ran_under():
    fields = [*dg.SMI_FIELDS, dg.REASON_FIELDS[0]]
    text = "\n".join([
        "0, 2026/11/22 23:28:15.100, 1980, 3201, 650.5, 60, 70, 0x0000000000000000",
        "1, 2026/11/22 23:28:15.100, 1980, 3201, 640.0, 59, 69, 0x0000000000000000",
        "0, 2026/11/22 23:28:15.200, 1700, 3201, 699.5, 61, 75, 0x0000000000000004",
        "0, 2026/11/22 23:28:16.500, 1980, 3201, 100.0, 50, 60, 0x0000000000000001",
        "garbage line",
    ])
    samples = dg.parse_smi(text, fields)
    assert len(samples) == 4 and {s["gpu"] for s in samples} == {0, 1}
    t0 = samples[0]["t"]
    assert samples[2]["t"] - t0 == pytest.approx(0.1, abs=1e-6)
    recs = [{**_rec("plain", "gate_up", 110.0), "t_start": t0 - 0.01, "t_end": t0 + 0.15},
            {**_rec("plain", "o", 18.0), "t_start": t0 + 5, "t_end": t0 + 6}]
    dg.attach_gpu_state(recs, samples)
    assert recs[0]["gpu0"] == {"samples": 2, "sm_mhz": 1840.0, "power_w": 675.0, "temp_mem_c": 75.0, "reasons": "0x4"}
    assert "gpu0" not in recs[1]  # no sample inside its window
    md = dg.markdown_table({"records": recs, "summary": dg.summarize(recs), "setup_info": []})
    assert "| plain | 0 | gate_up | 110.00 | 1840.0 | 675.0 | 75.0 | 0x4 | 2 |" in md
