"""CPU tests of research/decode_prefetch/bench.py: its arguments, the decision on fake timings, the
result files."""
import argparse
import json

import pytest

from research.decode_prefetch import bench


def test_shapes_are_the_tp2_decode_gemms():
    assert bench.SHAPES == {"8b-qkv": (3072, 4096), "8b-gate_up": (14336, 4096), "70b-qkv": (5120, 8192),
                            "70b-gate_up": (28672, 8192)}


def test_arguments():
    args = bench.build_parser().parse_args(["--out", "/tmp/o"])
    assert args.shapes == list(bench.SHAPES) and args.tokens == [1, 2, 4, 8, 16, 32, 64]
    args = bench.build_parser().parse_args(["--out", "o", "--shapes", "70b-qkv,8b-qkv", "--tokens", "8,1,8"])
    assert args.shapes == ["70b-qkv", "8b-qkv"] and args.tokens == [1, 8]


@pytest.mark.parametrize("argv", [["--shapes", "8b-qkv,405b"], ["--tokens", "0"], ["--tokens", "65"],
                                  ["--tokens", "a"], ["--rounds", "0"], ["--standin-us", "-1"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--out", "o", *argv])
    assert "error" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError):
        bench.shape_list("")


def _record(shape, tokens, ours, ours_after_pdl, correct=True):
    times = {"cublas": 100.0, "ours": ours, "standin": 4.0, "cublas_after": 104.0, "ours_after_pdl": ours_after_pdl,
             "ours_after_plain": ours + 4.0}
    rec = {"shape": shape, "tokens": tokens, "us": times, **bench.summarize(times), "correct": correct,
           "cublas_tbps": 3.0, "ours_tbps": 3.0}
    rec["pass"] = bench.passes(rec)
    return rec


def test_summary_and_decision_on_fake_timings():
    fast = _record("8b-qkv", 1, ours=100.5, ours_after_pdl=102.0)  # +0.5 %, hides 2.5 of 4 us
    assert fast["ours_vs_cublas"] == pytest.approx(0.005) and fast["ours_hidden"] == pytest.approx(0.625)
    assert fast["cublas_hidden"] == pytest.approx(0.0) and fast["ours_plain_hidden"] == pytest.approx(0.0)
    assert fast["pass"]
    slow = _record("8b-qkv", 8, ours=102.0, ours_after_pdl=102.0)  # hides all, 2 % slower
    hides_little = _record("70b-qkv", 1, ours=99.0, ours_after_pdl=102.5)  # hides 0.5 of 4 us
    wrong = _record("70b-gate_up", 1, ours=99.0, ours_after_pdl=99.0, correct=False)
    assert not slow["pass"] and not hides_little["pass"] and not wrong["pass"]
    shapes = list(bench.SHAPES)
    records = [fast, slow, hides_little, wrong, _record("8b-gate_up", 1, 100.0, 101.0)]
    assert bench.decide(records, shapes, [1]) == {"8b-qkv": "FAIL", "8b-gate_up": "PASS", "70b-qkv": "FAIL",
                                                  "70b-gate_up": "FAIL"}
    assert bench.decide([fast], ["8b-qkv", "70b-qkv"], [1, 8]) == {"8b-qkv": "INCOMPLETE", "70b-qkv": "INCOMPLETE"}


def test_result_files(tmp_path):
    records = [_record("8b-qkv", 1, 100.5, 102.0), _record("8b-qkv", 8, 102.0, 102.0)]
    res = bench.results_header(bench.KIND, {
        "world_size": 1, "gpu": "fake GPU", "nvcc": "13.0", "rule": bench.RULE,
        "standin": {"us": 4.0, "ctas": 16, "threads": 512}, "grid": 132, "steps": 64, "rounds": 5, "replays": 20,
        "plans": {}, "skipped": ["70b-qkv/M=1"], "decision": bench.decide(records, ["8b-qkv"], [1, 8]),
        "records": records})
    path = bench.write_result(str(tmp_path), "dp", res)
    doc = json.loads(path.read_text())
    assert doc["kind"] == "decode-prefetch" and doc["decision"] == {"8b-qkv": "FAIL"}
    assert {"date", "command", "host", "versions", "records"} <= set(doc) and "git" in doc["versions"]
    md = (tmp_path / "dp.md").read_text()
    assert "| 8b-qkv | 8 |" in md and "+2.0 %" in md and "8b-qkv: **FAIL**" in md and bench.RULE in md
    assert "70b-qkv/M=1" in md
