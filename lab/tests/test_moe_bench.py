"""CPU tests of benchmarks/moe_bench.py: its arguments and its report (the GPU run is
lab/results; the kernels' own tests are tests/gpu/test_ep.py)."""
import argparse

import pytest

from benchmarks import moe_bench


def test_shapes_parse_and_bad_ones_are_named():
    assert moe_bench.shape_list("2048x8, 4096X2") == [(2048, 8), (4096, 2)]
    for bad in ("2048", "2048x", "x8", "2050x8", "0x8", "2048x0"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad.split(",")[0] if bad else ""):
            moe_bench.shape_list(bad)


def test_defaults_cover_the_studied_models_and_quick_is_smaller():
    args = moe_bench.build_parser().parse_args([])
    assert (2048, 8) in args.shapes and (4096, 2) in args.shapes and (7168, 8) in args.shapes
    assert args.tokens[0] == 1 and args.tokens[-1] == 512 and args.world_size == 2
    assert args.backends == moe_bench.BACKENDS
    with pytest.raises(SystemExit):
        moe_bench.build_parser().parse_args(["--world-size", "3"])


def _row(backend, dispatch, combine, total, tokens=8, exact=True):
    times = {"dispatch": [dispatch] * 20, "combine": [combine] * 20, "layer": [total] * 20}
    return moe_bench.schema_row(backend, 2048, 8, tokens, times, exact, 0.0)


def test_rows_follow_the_schema():
    row = _row("yali", 2.5, 2.6, 5.0)
    for key in ("backend", "dtype", "hidden", "topk", "tokens", "dispatch_us_p50", "combine_us_p50", "total_us_p50",
                "exact"):
        assert key in row, key
    assert row["total_us_p50"] == 5.0 and row["dtype"] == "bf16" and row["samples"] == 20


def test_report_gives_the_ratio_per_layer_and_flags_a_wrong_result():
    doc = {"world_size": 2, "shared_gpu": False, "skipped_backends": {},
           "records": [_row("yali", 2.5, 2.6, 5.0), _row("vllm-agrs", 9.0, 10.0, 20.0, exact=False)]}
    md = moe_bench.markdown_table(doc)
    assert "| 2048 | 8 | 8 | 2.50 | 2.60 | 5.00 | 20.00 | 0.25 | NO |" in md
    doc["shared_gpu"] = True
    assert "timings are not valid" in moe_bench.markdown_table(doc)


def test_the_slot_serves_every_point_of_the_sweep():
    args = moe_bench.build_parser().parse_args([])
    slot = moe_bench.slot_bytes_for(args.shapes, args.tokens)
    assert slot % 4096 == 0 and slot >= 512 * (7168 * 2 + 2 * 8 * 4)  # 512 tokens of H 7168, top-8
    assert moe_bench.slot_bytes_for([(2048, 8)], [1]) == 2 << 20  # never below the serving default
