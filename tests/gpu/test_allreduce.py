"""Correctness of the YALI kernels on 2 GPUs (skipped without them)."""
import os
import shutil
import subprocess

import pytest
import torch

from . import scenarios
from .pair import run_pair

pytestmark = pytest.mark.gpu

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [2 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB]
ODD = [1, 3, 7, 1001, 12345, 65537, 1000003]


@pytest.mark.timeout(900)
def test_sweep_all_dtypes_sizes_modes():
    res = run_pair(scenarios.sweep, SIZES, ODD, ["fp32", "fp16", "bf16"], ["auto", "flash", "stream"], 1234,
                   timeout=840)
    for r in res:
        assert r["checked"] > 250
        assert not r["failures"], "\n".join(r["failures"][:20])


@pytest.mark.timeout(600)
def test_cuda_graph_10k_replays():
    res = run_pair(scenarios.graph_replays, 10_000, 1000, 99, timeout=540)
    for r in res:
        assert not r["failures"], r["failures"][:10]
        assert r["checks"] >= 10
        # the device-side counter proves the replays ran YALI's kernels
        assert r["device_calls"] == r["expected_calls"]


@pytest.mark.timeout(600)
def test_stress_100k_random_calls_bounded():
    res = run_pair(scenarios.stress, 100_000, 4321, 8 * MiB, timeout=540)
    for r in res:
        assert not r["failures"], r["failures"][:10]
        assert r["checked"] >= 100
        assert r["elapsed_s"] < 300, f"100k calls took {r['elapsed_s']:.0f}s"


@pytest.mark.timeout(300)
def test_torch_compile_fullgraph():
    for r in run_pair(scenarios.compiled, timeout=280):
        assert r["mismatches"] == 0


@pytest.mark.timeout(200)
def test_unaligned_inputs_route_alike_and_stay_exact():
    r0, r1 = run_pair(scenarios.unaligned_inputs, 77, timeout=180)
    for r in (r0, r1):
        assert not r["failures"], r["failures"]
    assert r0["digest"] == r1["digest"]
    assert r0["device_calls"] == r1["device_calls"]


@pytest.mark.timeout(120)
def test_missing_peer_aborts_instead_of_hanging():
    r0, _ = run_pair(scenarios.missing_peer, 8.0, timeout=100, env={"YALI_TIMEOUT_S": "2"})
    assert r0["error"] is not None, "rank 0 finished although its peer never joined"
    assert "gave up" in r0["abort"] and "flash" in r0["abort"], r0
    assert r0["elapsed_s"] < 60


@pytest.mark.two_gpus
def test_single_process_pair():
    from yali_vllm.communicator import YaliPair

    pair = YaliPair(0, 1)
    try:
        for dtype, n in [(torch.bfloat16, 1), (torch.float16, 77777), (torch.float32, (3 << 20) + 1),
                         (torch.bfloat16, 48 << 20)]:
            for mode in ("auto", "stream"):
                a, b = scenarios.inputs(n, n, dtype, torch.device("cuda", 0))
                b = b.to("cuda:1")
                outs = pair.all_reduce([a.clone(), b.clone()], mode=mode)
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                ref = scenarios.reference(a, b.to("cuda:0"))
                assert scenarios.mismatches(outs[0], ref) == 0
                assert scenarios.mismatches(outs[1].to("cuda:0"), ref) == 0
    finally:
        pair.close()


@pytest.mark.two_gpus
def test_single_process_pair_checks_both_calls_before_launching():
    from yali_vllm.communicator import YaliPair

    pair = YaliPair(0, 1)
    try:
        before = pair.device_calls()
        a = torch.ones(1000, dtype=torch.bfloat16, device="cuda:0")
        for bad in (torch.ones(997, dtype=torch.bfloat16, device="cuda:1"),   # other size
                    torch.ones(1000, dtype=torch.float16, device="cuda:1"),   # other dtype
                    torch.ones(1000, dtype=torch.int32, device="cuda:1")):    # not served
            with pytest.raises(ValueError, match="YaliPair"):
                pair.all_reduce([a, bad])
        assert pair.device_calls() == before  # nothing was launched on either GPU
        outs = pair.all_reduce([a[1:], torch.ones(999, dtype=torch.bfloat16, device="cuda:1")])  # unaligned
        assert all(bool((o == 2).all()) for o in outs)
    finally:
        pair.close()


@pytest.mark.two_gpus
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cpp_example(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    exe = tmp_path / "allreduce_example"
    core = [f"{root}/csrc/core/yali/{f}"
            for f in ("communicator.cu", "common/config.cpp", "common/plan.cpp", "common/abort_text.cpp")]
    subprocess.run(["nvcc", "-std=c++17", "-O2", "-gencode=arch=compute_90a,code=sm_90a", "-I", f"{root}/csrc/core",
                    f"{root}/examples/allreduce_example.cu", *core, "-o", str(exe)], check=True, timeout=300)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 mismatches" in out.stdout


@pytest.mark.timeout(120)
def test_bad_or_different_settings_fail_both_ranks():
    for r in run_pair(scenarios.mismatched_settings, timeout=100):
        assert "YALI_DEV_PUSH_CTA_BYTES=999" in r["bad"], r
        assert "settings differ" in r["different"], r


# Kernel paths the default table does not pick, or only lightly: a small stream ring
# (4 KiB slots: a 16 MiB message is 32 chunks per lane cycling its 8 slots, so slot
# reuses wait on credits), push CTAs of 272 bytes (chunks that do not line up with
# 16-byte vectors of a CTA's threads) with 8 KiB stream slots, launches without
# programmatic dependent launch.
NONDEFAULT = {
    "small-ring": {"YALI_DEV_SLOT_BYTES": "4K"},
    "odd-grids": {"YALI_DEV_PUSH_CTA_BYTES": "272", "YALI_DEV_SLOT_BYTES": "8K"},
    "no-pdl": {"YALI_DEV_PDL": "0"},  # plain launches (PDL is the default)
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(NONDEFAULT))
def test_sweep_nondefault_configs(name):
    res = run_pair(scenarios.sweep, [2 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB], [1, 3, 1001, 65537, 1000003],
                   ["fp32", "bf16"], ["auto", "flash", "stream"], 777, timeout=280, env=NONDEFAULT[name])
    for r in res:
        assert r["checked"] > 60
        assert not r["failures"], "\n".join(r["failures"][:20])
