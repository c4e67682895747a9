"""The quantising fused op's pure C++ rules (csrc/core/yali/common/quant.h) through the host-built
query program (core_rules.py): which outputs may lie over which inputs, the scheme's bits of the
call descriptor, and an abort record that names the schemes of two mismatched calls."""
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
