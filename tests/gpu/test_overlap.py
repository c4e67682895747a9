"""The overlapped row-parallel GEMM + all-reduce + RMSNorm on 2 GPUs (skipped without them; both
ranks on one GPU with YALI_ALLOW_SHARED_GPU=1).

All scenarios run in one process pair on one YaliCommunicator (overlap_scenarios.overlap_suite);
each test asserts on its own part of that run. The missing-peer test runs its own pair (the
watchdog's trap ends the CUDA context)."""
import pytest

from yali_vllm import overlap

from . import overlap_scenarios
from .pair import run_pair
from .scenarios import suite_part

pytestmark = pytest.mark.gpu

HIDDEN = (2048, 4096, 8192, 16384)
# Odd counts and chunk tails; 1025 and 2049 rows of hidden 16384 (32 KiB rows) take two and
# three windows of one 32 MiB slot each.
TOKENS = (1, 7, 512, 513, 1025, 2049)
CHUNKS = (1, 3, 4, 16)
FP32 = ((2048, 513), (8192, 7))
STRESS_CALLS = 240
GRAPH_REPLAYS = 300


def overlap_plan():
    """Every bf16/fp16 hidden x tokens, with and without a residual (in place every other time),
    the chunk count cycling through CHUNKS; a few fp32 shapes."""
    plan = []
    for dname in ("bf16", "fp16"):
        for hidden in HIDDEN:
            for t in TOKENS:
                for with_res in (True, False):
                    j = len(plan)
                    plan.append({"dtype": dname, "tokens": t, "hidden": hidden, "chunks": CHUNKS[j % len(CHUNKS)],
                                 "residual": with_res, "inplace": with_res and (j // 2) % 2 == 0,
                                 "eps": (1e-5, 1e-6)[j % 2]})
    for hidden, t in FP32:
        plan.append({"dtype": "fp32", "tokens": t, "hidden": hidden, "chunks": 3, "residual": True, "eps": 1e-6})
    return plan


def test_plan_covers_windows_chunk_tails_and_both_dtypes():
    plan = overlap_plan()
    assert {p["dtype"] for p in plan} == {"bf16", "fp16", "fp32"}
    assert any(len(overlap.windows(p["tokens"], p["hidden"] * 2)) == 3 for p in plan if p["dtype"] != "fp32")
    tails = [p for p in plan if p["tokens"] % p["chunks"] and p["tokens"] > p["chunks"]]
    assert tails, "no call has a shorter last chunk"
    assert any(p["chunks"] > p["tokens"] for p in plan), "no call has more chunks than rows"


@pytest.fixture(scope="module")
def suite():
    # A consumer waiting for a peer that never comes gives up after 60 s (and says why).
    return run_pair(overlap_scenarios.overlap_suite, overlap_plan(), STRESS_CALLS, GRAPH_REPLAYS, 77, timeout=280,
                    env={"YALI_TIMEOUT_S": "60", "YALI_OVERLAP": "1"})


@pytest.mark.timeout(300)
def test_overlap_matches_the_unfused_sequence(suite):
    parts = suite_part(suite, "sweep")
    plan = overlap_plan()
    for rank, r in enumerate(parts):
        assert not r["failures"], f"rank {rank}: {len(r['failures'])} failed:\n" + "\n".join(r["failures"][:20])
        assert r["launched"] == len(plan)
        # every window ran a consumer kernel (device counter, so nothing was skipped)
        assert r["device_overlap_calls"] == r["expected_windows"]
        # the exact-epilogue comparison applied to most calls (those the fused op serves too)
        assert r["bitwise_checked"] > len(plan) // 2, r["bitwise_checked"]
    assert parts[0]["digests"] == parts[1]["digests"], "the ranks' outputs differ"
    assert "2 x 32 MiB" in suite[0]["describe"]


@pytest.mark.timeout(300)
def test_overlap_copy_then_flag_stress(suite):
    parts = suite_part(suite, "stress")
    for rank, r in enumerate(parts):
        assert not r["failures"], f"rank {rank}:\n" + "\n".join(r["failures"][:20])
        assert r["checked"] == STRESS_CALLS
        assert r["device_overlap_calls"] == r["expected_windows"]
    assert parts[0]["digests"] == parts[1]["digests"], "the ranks' outputs differ"


@pytest.mark.timeout(300)
def test_overlap_cuda_graph_replays_with_changing_inputs(suite):
    parts = suite_part(suite, "graph")
    for rank, r in enumerate(parts):
        assert not r["first_problems"], f"rank {rank}: {r['first_problems']}"
        assert not r["eager_failures"], f"rank {rank}: {r['eager_failures']}"
        assert r["bad_vs_first"] == [0] * len(overlap_scenarios.GRAPH_SPECS), f"rank {rank}: {r}"
        eager = sum(1 for i in range(GRAPH_REPLAYS) if i % 50 == 25)
        assert r["device_overlap_calls"] == 3 * GRAPH_REPLAYS + eager  # three windows per replay
    assert parts[0]["digests"] == parts[1]["digests"], "the ranks' outputs differ"


@pytest.mark.timeout(300)
def test_overlap_torch_compile_dynamic_tokens(suite):
    for rank, r in enumerate(suite_part(suite, "compiled")):
        assert not r["failures"], f"rank {rank}: {r['failures']}"


@pytest.mark.timeout(120)
def test_overlap_missing_peer_aborts_instead_of_hanging():
    r0, _ = run_pair(overlap_scenarios.overlap_missing_peer, 8.0, timeout=100, env={"YALI_TIMEOUT_S": "2", "YALI_OVERLAP": "1"})
    assert r0["error"] is not None, "rank 0 finished although its peer never called"
    assert "overlapped GEMM" in r0["abort"] and "chunk 0" in r0["abort"], r0
    assert r0["elapsed_s"] < 60
