"""How two vLLM runs' greedy tokens are compared (tests/gpu/test_vllm_e2e.py), in one place so a
CPU test can check the rule itself (tests/plugin/test_greedy_compare.py).

Each run is the JSON of tests/gpu/vllm_generate.py: token_ids (one list per prompt) and logprobs
(per prompt and position: {token id: logprob} for the top 20 tokens and the chosen one).
"""

from __future__ import annotations


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """The first position where two token sequences differ (over their common length), or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def first_divergence(name: str, got: dict, ref: dict) -> str:
    """Where two runs' greedy tokens first differ: the prompt, the position, both tokens, and each
    run's logprobs of the two at that position (a near tie has both within a few hundredths)."""
    for p, (a, b) in enumerate(zip(got["token_ids"], ref["token_ids"], strict=True)):
        i = first_mismatch(a, b)
        if i is None:
            if len(a) != len(b):
                return f"{name}: prompt {p} has {len(a)} against {len(b)} tokens"
            continue
        return (f"{name}: prompt {p} first differs at token {i} ({a[i]} against {b[i]}); logprobs there "
                f"{got['logprobs'][p][i]} against {ref['logprobs'][p][i]}")
    return f"{name}: no prompt differs"


# Largest logprob gap (nats, the larger of the two runs') between the two tokens
# at the position where two configurations first choose differently, for the
# divergence to count as a near tie that rounding decided.
TIE_GAP = 0.05
# Largest difference of a chosen token's logprob between two configurations
# while their token sequences are still identical.
LOGPROB_TOL = 0.05


def check_same_greedy(name: str, got: dict, ref: dict) -> list[tuple[int, int, float]]:
    """Greedy tokens of two runs, expected equal.

    YALI's fused op computes the same all-reduce sum and residual as the
    unfused sequence, bit for bit (two ranks: a + b once per element), but
    each RMSNorm kernel (YALI's, FlashInfer's, vLLM's) sums the variance in
    its own order (and FlashInfer's adds in fp32 before rounding), so a
    normalised value can round to a neighbouring bf16 number.  That is far
    below what usually moves a greedy choice, so the tokens are expected to
    be equal, and are asserted equal except in one case: at the first position where a
    prompt's tokens differ, the two runs must each rank the other's token in
    their top 20, within TIE_GAP of their own choice (a near tie, which
    rounding may decide either way; after it the contexts differ and the rest
    is not compared).  A wrong fused result changes the logits wholesale and
    fails this at once.  Returns (prompt, position, gap) per divergence, for
    the log.  Before any divergence, the chosen tokens' logprobs agree within
    LOGPROB_TOL.
    """
    divergences = []
    assert len(got["token_ids"]) == len(ref["token_ids"])
    for p, (a, b) in enumerate(zip(got["token_ids"], ref["token_ids"], strict=True)):
        la, lb = got["logprobs"][p], ref["logprobs"][p]
        assert len(a) == len(b) == len(la) == len(lb), (name, p)
        first = first_mismatch(a, b)
        for i in range(len(a) if first is None else first):
            diff = abs(la[i][str(a[i])] - lb[i][str(b[i])])
            assert diff <= LOGPROB_TOL, f"{name}: prompt {p} token {i}: logprob differs by {diff}"
        if first is None:
            continue
        ta, tb = str(a[first]), str(b[first])
        tie = tb in la[first] and ta in lb[first]
        gap = max(lb[first][tb] - lb[first][ta], la[first][ta] - la[first][tb]) if tie else float("inf")
        assert tie and gap <= TIE_GAP, (
            f"{name}: prompt {p} diverges at token {first} ({ta} vs {tb}) and it is not a near "
            f"tie: top logprobs {la[first]} vs {lb[first]}"
        )
        divergences.append((p, first, gap))
    return divergences
