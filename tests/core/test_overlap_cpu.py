"""Which outputs may lie over which inputs, at the rules' boundaries: the core's C++ rules
(csrc/core/yali/common/overlap.h, which Rank, the torch ops and the C++ API apply before a launch) through
a small program built with the host compiler, and the Python layer's copy of the all-reduce rule
(yali_vllm.communicator.partly_overlap). No GPU: tests/gpu/test_overlap.py has the ops refuse real
views on the GPU."""
import pytest

from yali_vllm.communicator import partly_overlap, ranges_overlap

from .core_rules import query

N = 4096  # bytes of the message
ROW = 1024  # bytes of a fused row
OK = "ok"


def test_ranges_overlap_at_the_boundaries():
    a = 1 << 20
    cases = [  # (b, nb): against [a, a + 16)
        (a + 16, 16, False), (a + 15, 16, True),  # b right after a's end / one byte into it
        (a - 16, 16, False), (a - 15, 16, True),  # b right before a / its last byte a's first
        (a, 1, True), (a + 4, 4, True),  # inside
        (a, 0, False),  # empty
    ]
    for b, nb, want in cases:
        assert ranges_overlap(a, 16, b, nb) is want, (b - a, nb)
        assert query(f"overlap {a} 16 {b} {nb}") == [str(int(want))], (b - a, nb)
    assert not ranges_overlap(a, 0, a, 16) and query(f"overlap {a} 0 {a} 16") == ["0"]


@pytest.mark.parametrize("shift,refused", [(0, False), (16, True), (N - 16, True), (N, False), (-16, True),
                                           (-N, False), (1, True), (-(N - 1), True)])
def test_all_reduce_out_is_the_input_or_apart_from_it(shift, refused):
    x = 1 << 20
    assert partly_overlap(x, N, x + shift, N) is refused, shift
    (got,) = query(f"all_reduce {x} {x + shift} {N}")
    if refused:
        assert got.startswith("out must be input itself or not overlap it"), (shift, got)
    else:
        assert got == OK, (shift, got)


def test_python_rule_refuses_the_same_start_with_another_size():
    x = 1 << 20
    assert partly_overlap(x, N, x, N - 16) and partly_overlap(x, N - 16, x, N)
    assert not partly_overlap(x, 0, x + 16, N)


# The fused op's buffers, each apart from the others (N bytes; the weight one row).
BASE = {"in": 1 << 20, "residual": 2 << 20, "weight": 3 << 20, "norm_out": 4 << 20, "residual_out": 5 << 20}


def fused(**moved) -> str:
    b = {**BASE, **moved}
    (got,) = query(f"fused {b['in']} {b['residual']} {b['weight']} {b['norm_out']} {b['residual_out']} {N} {ROW}")
    return got


def test_fused_buffers_apart_and_residual_in_place_are_served():
    assert fused() == OK
    assert fused(residual_out=BASE["residual"]) == OK  # in place, row by row
    assert fused(residual=0) == OK  # no residual
    assert fused(norm_out=BASE["in"] + N, residual_out=BASE["in"] - N) == OK  # right after / before the input
    assert fused(norm_out=BASE["weight"] - N, residual_out=BASE["weight"] + ROW) == OK  # around the weight
    assert fused(residual_out=BASE["residual"] + N) == OK  # right after the residual


@pytest.mark.parametrize("moved,refusal", [
    ({"norm_out": BASE["in"]}, "norm_out must not overlap input"),
    ({"norm_out": BASE["in"] + N - 16}, "norm_out must not overlap input"),
    ({"residual_out": BASE["in"] - N + 16}, "residual_out must not overlap input"),
    ({"norm_out": BASE["residual_out"]}, "norm_out must not overlap residual_out"),
    ({"norm_out": BASE["residual_out"] + ROW}, "norm_out must not overlap residual_out"),
    ({"norm_out": BASE["residual"]}, "norm_out must not overlap residual"),
    ({"norm_out": BASE["residual"] - N + 16}, "norm_out must not overlap residual"),
    ({"residual_out": BASE["residual"] + ROW}, "residual_out must be residual itself or not overlap it"),
    ({"residual_out": BASE["residual"] - 16}, "residual_out must be residual itself or not overlap it"),
    ({"norm_out": BASE["weight"] - N + 16}, "norm_out must not overlap weight"),
    ({"residual_out": BASE["weight"] + ROW - 16}, "residual_out must not overlap weight"),
])
def test_fused_outputs_over_an_input_or_each_other_are_refused_by_name(moved, refusal):
    got = fused(**moved)
    assert got.startswith(refusal), (moved, got)
