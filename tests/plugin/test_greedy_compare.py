"""The rule by which the GPU end-to-end tests compare two vLLM runs' greedy tokens
(tests/greedy_compare.py), on runs shaped like real ones: it accepts the tie at which vLLM's own
custom all-reduce and NCCL choose differently on 2xH200 (each run's top two tokens share the top
logprob bit for bit)
(lab/results/current/gpu-tests/20261128-tp2-h200-compiled-ties) and refuses what a wrong
all-reduce would give."""

from __future__ import annotations

import copy

import pytest

from ..greedy_compare import LOGPROB_TOL, TIE_GAP, check_same_greedy, first_divergence

TOP = -11.630762100219727  # the tied top logprob of that run
STEP = -0.0078125  # one bf16 step of a logit near 2: the next distinct logprob


def _run(tokens: list[list[int]], logprobs: list[list[dict[str, float]]]) -> dict:
    return {"token_ids": tokens, "logprobs": logprobs}


def _steady(token: int, n: int, lp: float = TOP) -> tuple[list[int], list[dict[str, float]]]:
    return [token] * n, [{str(token): lp, "7": lp - 1.0} for _ in range(n)]


def _tied_pair() -> tuple[dict, dict]:
    """Prompt 0 equal; prompt 1 repeats 39448, then the custom all-reduce run keeps it one step
    longer while NCCL's switches to 28713, the two (with 104984) sharing the top logprob."""
    t0, l0 = _steady(60892, 8)
    head, lhead = _steady(39448, 4)
    custom_tail = [39448, 28713, 28713]
    nccl_tail = [28713, 28713, 28713]
    custom_pos = {"39448": TOP, "104984": TOP, "28713": TOP + STEP}
    nccl_pos = {"28713": TOP, "39448": TOP, "104984": TOP}
    after = {"28713": TOP, "39448": TOP + STEP}
    custom = _run([t0, head + custom_tail], [l0, lhead + [custom_pos, after, after]])
    nccl = _run([t0, head + nccl_tail], [l0, lhead + [nccl_pos, after, after]])
    return custom, nccl


def test_equal_runs_have_no_divergence():
    custom, _ = _tied_pair()
    assert check_same_greedy("same", custom, copy.deepcopy(custom)) == []


def test_the_measured_tie_is_a_near_tie_both_ways():
    custom, nccl = _tied_pair()
    for got, ref in ((custom, nccl), (nccl, custom)):
        (divergence,) = check_same_greedy("custom vs nccl", got, ref)
        prompt, position, gap = divergence
        assert (prompt, position) == (1, 4)
        assert gap == pytest.approx(-STEP) and gap <= TIE_GAP
    assert first_divergence("custom vs nccl", custom, nccl).startswith(
        "custom vs nccl: prompt 1 first differs at token 4 (39448 against 28713)")


def test_a_choice_the_other_run_does_not_rank_is_refused():
    custom, nccl = _tied_pair()
    del custom["logprobs"][1][4]["28713"]  # NCCL's choice is not in the custom run's top tokens
    for got, ref in ((custom, nccl), (nccl, custom)):
        with pytest.raises(AssertionError, match="not a near tie"):
            check_same_greedy("custom vs nccl", got, ref)


def test_a_divergence_with_a_real_gap_is_refused():
    custom, nccl = _tied_pair()
    custom["logprobs"][1][4]["28713"] = TOP - 4 * TIE_GAP
    with pytest.raises(AssertionError, match="not a near tie"):
        check_same_greedy("custom vs nccl", custom, nccl)


def test_logprobs_that_drift_before_any_divergence_are_refused():
    custom, _ = _tied_pair()
    drifted = copy.deepcopy(custom)
    drifted["logprobs"][0][3]["60892"] += 2 * LOGPROB_TOL
    with pytest.raises(AssertionError, match="prompt 0 token 3: logprob differs"):
        check_same_greedy("drift", drifted, custom)
