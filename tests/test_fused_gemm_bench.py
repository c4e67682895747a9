"""CPU tests of benchmarks/fused_gemm_bench.py: arguments, the summary, the table and the plot
(the measurement itself runs on the GPU host: scripts/gpu_host/fused.sh gemm)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import fused_gemm_bench as fgb  # noqa: E402

MiB = 1 << 20


def _rec(backend, n, t, us, pf=None, correct=True):
    r = {"backend": backend, "dtype": "bf16", "hidden": 8192, "tokens": t, "gemm_n": n, "us_p50": us,
         "us_p99": us + 1, "correct": correct}
    if pf is not None:
        r["prefetch_bytes"] = pf
    return r


RECORDS = [
    _rec("gemm-only", 5120, 1, 20.0),
    _rec("flashinfer-trtllm", 5120, 1, 27.0),
    _rec("yali-fused", 5120, 1, 25.0, 0),
    _rec("yali-fused", 5120, 1, 22.0, 16 * MiB),
    _rec("yali-fused", 5120, 1, 23.0, 32 * MiB),
    _rec("yali-fused", 5120, 1, 10.0, 8 * MiB, correct=False),  # a wrong result never counts
]


def test_args_defaults_and_bad_lists():
    a = fgb.parse_args([])
    assert a.gemm_n == [5120, 28672] and a.prefetch_mib == [0, 8, 16, 32] and a.name.startswith("fused-gemm-")
    assert fgb.parse_args(["--gemm-n", "0,5120"]).gemm_n == [0, 5120]
    with pytest.raises(SystemExit):
        fgb.parse_args(["--prefetch-mib", "-1"])
    with pytest.raises(SystemExit):
        fgb.parse_args(["--hidden", "100"])


def test_summary_picks_the_best_correct_prefetch():
    (row,) = fgb.summarize(RECORDS)
    assert row["gemm_only_us"] == 20.0 and row["flashinfer_us"] == 27.0
    assert row["best_prefetch_bytes"] == 16 * MiB and row["best_yali_us"] == 22.0
    assert row["best_vs_no_prefetch"] == round(22 / 25, 3)
    assert row["best_vs_flashinfer"] == round(22 / 27, 3)
    assert row["no_prefetch_vs_flashinfer"] == round(25 / 27, 3)


def test_table_and_report_only(tmp_path):
    pytest.importorskip("matplotlib")
    res = {"kind": fgb.KIND, "weights_mib": 320, "hidden": 8192, "records": RECORDS,
           "skipped": [{"backend": "flashinfer-trtllm", "gemm_n": 0, "tokens": 1, "reason": "no workspace"}]}
    md = fgb.markdown_table(res)
    # columns pf 0, 8 (its only row is wrong: "–"), 16, 32 MiB
    assert "| 5120 | 1 | 20.00 | 27.00 | 25.00 | – | 22.00 | 23.00 | 0.81 | 0.88 |" in md, md
    assert "1 rows with a WRONG result" in md and "no workspace" in md
    path = tmp_path / "fused-gemm-x.json"
    path.write_text(json.dumps(res))
    md_path, png = fgb.report_only(str(path))
    assert Path(md_path).read_text() == md and png and Path(png).stat().st_size > 0
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"kind": fgb.KIND, "records": []}))
    with pytest.raises(SystemExit):
        fgb.report_only(str(other))
