"""The quantising fused op's pure C++ rules (csrc/core/yali/common/quant.h) through the host-built
query program (core_rules.py): which outputs may lie over which inputs, which schemes and scale
layouts are served (no two scales at one address), the scheme's bits of the call descriptor, and an
abort record that names the schemes of two mismatched calls."""
import pytest

from .core_rules import query

N, ROW = 4 * 8192, 8192  # input bytes: 4 rows of 4096 bf16
QB = N // 2               # quant_out bytes
IN, RES, W, Q, ROUT, S = 1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20, 6 << 20


def refusal(inp=IN, res=RES, w=W, q=Q, rout=ROUT, s=S, scale_bytes=64, scale_is_output=1):
    return query(f"fused_quant {inp} {res} {w} {q} {rout} {s} {N} {ROW} {QB} {scale_bytes} {scale_is_output}")[0]


def test_apart_outputs_are_served_and_residual_out_may_be_residual():
    assert refusal() == "ok"
    assert refusal(rout=RES) == "ok"  # in place
    assert refusal(rout=0) == "ok"    # residual_out not stored
    assert refusal(res=0, rout=0) == "ok"


@pytest.mark.parametrize("kwargs,arg", [
    ({"q": IN}, "quant_out must not overlap input"),
    ({"q": IN + N - 16}, "quant_out must not overlap input"),
    ({"q": RES + 8}, "quant_out must not overlap residual"),
    ({"q": ROUT}, "quant_out must not overlap residual_out"),
    ({"q": W - 16}, "quant_out must not overlap weight"),
    ({"s": Q + 64}, "quant_out must not overlap scale"),
    ({"rout": IN + ROW}, "residual_out must not overlap input"),
    ({"rout": RES + ROW}, "residual_out must be residual itself or not overlap it"),
    ({"rout": W - 16}, "residual_out must not overlap weight"),
    ({"s": ROUT + 4}, "residual_out must not overlap scale"),
    ({"s": IN + 4}, "scale must not overlap input"),
    ({"s": RES + 4}, "scale must not overlap residual"),
    ({"s": W + 4}, "scale must not overlap weight"),
])
def test_each_overlap_is_refused_naming_the_output(kwargs, arg):
    assert refusal(**kwargs).startswith(arg), refusal(**kwargs)


def test_a_static_scale_is_an_input_the_outputs_must_not_cover():
    assert refusal(s=IN + 4, scale_bytes=4, scale_is_output=0) == "ok"  # an input may lie in an input
    assert refusal(s=ROUT + 4, scale_bytes=4, scale_is_output=0).startswith("residual_out must not overlap scale")


def test_scheme_bits_differ_for_every_scheme_and_group_option():
    bits = {query(f"quant_bits {s} {g} {u}")[0] for s, g, u in
            ((0, 128, 0), (1, 128, 0), (2, 128, 0), (2, 128, 1), (2, 64, 0), (2, 64, 1))}
    assert len(bits) == 6 and "0" not in bits
    assert query("quant_bits -1 128 0") == ["0"]  # the plain fused op's descriptor is unchanged


def test_abort_names_the_schemes_of_both_calls():
    per_token, static = (int(query(f"quant_bits {s} 128 0")[0]) for s in (1, 0))
    w2 = 2 | 5 << 2 | 2 << 6 | 8 << 8  # fused, flash-push, bf16, 8 CTAs
    mine = f"16384 0 {w2} {4096 | per_token << 16}"
    theirs = f"16384 0 {w2} {4096 | static << 16}"
    text = query(f"abort 0 2 10 5 7 9 0 0 -1 {mine} {theirs}")[0]
    assert "different calls" in text
    assert "fused all-reduce + RMSNorm + FP8 per-token quant of hidden 4096" in text, text
    assert "fused all-reduce + RMSNorm + FP8 static quant of hidden 4096" in text, text
    group = int(query("quant_bits 2 128 1")[0])
    text = query(f"abort 0 2 10 5 7 9 0 0 -1 {mine} 16384 0 {w2} {4096 | group << 16}")[0]
    assert "FP8 group-128 quant (ue8m0) of hidden 4096" in text, text


def _scheme(scheme, rows, hidden, group, row_stride, group_stride) -> str:
    return query(f"quant_scheme {scheme} {rows} {hidden} {group} {row_stride} {group_stride}")[0]


SHARED = "scale's strides must give every (row, group) its own element (two scales would share an address)"


@pytest.mark.parametrize("rows,hidden,group,strides", [
    (5, 1024, 128, (8, 1)),     # row-major [rows, groups]
    (5, 1024, 128, (1, 5)),     # column-major (vLLM's column_major_scales)
    (5, 1024, 128, (1, 8)),     # column-major, rows padded to a multiple of 4 (TMA-aligned)
    (5, 1024, 64, (16, 1)),     # group of 64
    (1, 1024, 128, (0, 1)),     # one row: its stride is never used
    (7, 128, 128, (1, 0)),      # one group per row
    (3, 1024, 128, (100, 2)),   # sparse but distinct
], ids=["row-major", "column-major", "tma-aligned", "group-64", "one-row", "one-group", "sparse"])
def test_group_scale_layouts_whose_scales_are_distinct_are_served(rows, hidden, group, strides):
    assert _scheme(2, rows, hidden, group, *strides) == "ok"


@pytest.mark.parametrize("rows,hidden,group,strides", [
    (4, 512, 128, (1, 1)),      # (0, 1) and (1, 0) share an element
    (4, 512, 128, (1, 3)),      # column-major with a row too few: (3, 0) and (0, 1)
    (4, 512, 128, (3, 1)),      # row-major with a group too few: (0, 3) and (1, 0)
    (2, 1024, 128, (4, 1)),     # the second row starts inside the first
], ids=["equal-strides", "columns-too-close", "rows-too-close", "rows-interleaved"])
def test_group_scale_layouts_that_share_an_address_are_refused(rows, hidden, group, strides):
    assert _scheme(2, rows, hidden, group, *strides) == SHARED


def test_scheme_refusals_name_what_is_wrong():
    assert _scheme(2, 4, 512, 128, 0, 1).startswith("scale's strides must be positive")
    assert _scheme(2, 4, 512, 128, -4, 1).startswith("scale's strides must be positive")
    assert _scheme(2, 4, 512, 96, 4, 1) == "group_size must be 64 or 128"
    assert _scheme(2, 4, 576, 128, 5, 1) == "group_size must divide the hidden size"
    assert _scheme(1, 4, 512, 0, 0, 0) == "scale must give every row its own element (stride(0) > 0)"
    assert _scheme(1, 4, 512, 0, 1, 0) == "ok"
    assert _scheme(0, 4, 512, 0, 0, 0) == "ok"  # static: one input scale
    assert _scheme(3, 4, 512, 128, 4, 1).startswith("scheme must be 0")
