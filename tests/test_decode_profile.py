"""CPU tests of benchmarks/decode_profile.py: kernel classification, the per-stream
gap analysis on a synthetic torch-profiler trace, rows per config/rank, and the
server command it would run."""
import gzip
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import decode_profile as dp  # noqa: E402


def k(name, ts, dur, tid=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


TRACE = {"traceEvents": [
    k("nvjet_tst_128x256_gemm", 0, 10),
    k("void yali::fused_allreduce_rmsnorm_kernel<__nv_bfloat16, 2>(yali::FusedArgs)", 12, 5),   # gap 2 before
    k("nvjet_tst_128x256_gemm", 20, 10),                                                        # gap 3 after yali
    k("void allreduce_fusion_kernel_oneshot_lamport<...>", 31, 4),
    k("flash_fwd_splitkv_kernel", 40, 6),
    k("elementwise_kernel", 0, 1, tid=9),                                                       # other stream
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},                      # not a kernel
]}


def test_kernel_classes():
    assert dp.kernel_class("void yali::flash_push_kernel<float>(yali::FlashArgs)") == "yali"
    assert dp.kernel_class("allreduce_fusion_kernel_twoshot") == "flashinfer-allreduce"
    assert dp.kernel_class("void vllm::cross_device_reduce_1stage<...>") == "vllm-custom-allreduce"
    assert dp.kernel_class("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "nccl"
    assert dp.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert dp.kernel_class("flash_fwd_splitkv_kernel") == "attention"
    assert dp.kernel_class("triton_poi_fused_add_0") == "other"


def test_analyze_counts_durations_and_gaps_per_stream():
    res = dp.analyze(TRACE)
    assert res["kernels"] == 6 and res["span_us"] == 46.0
    c = res["classes"]
    assert c["yali"] == {"count": 1, "total_us": 5.0, "mean_us": 5.0, "gap_before_us": 2.0, "gap_after_us": 3.0}
    assert c["gemm"]["count"] == 2 and c["gemm"]["gap_before_us"] == 3.0  # the first GEMM has no predecessor
    assert c["flashinfer-allreduce"]["gap_before_us"] == 1.0 and c["flashinfer-allreduce"]["gap_after_us"] == 5.0
    assert c["other"] == {"count": 1, "total_us": 1.0, "mean_us": 1.0, "gap_before_us": None, "gap_after_us": None}


def test_rows_from_traces_per_config_and_rank(tmp_path):
    for cfg in ("yali", "vllm-default"):
        d = tmp_path / cfg
        d.mkdir()
        with gzip.open(d / "rank0.1234.pt.trace.json.gz", "wt") as f:
            json.dump(TRACE, f)
        (d / "frontend.json").write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x",
                                                                      "ts": 0, "dur": 1}]}))
    rows = dp.rows_from_traces(tmp_path, tokens=2)
    assert {r["config"] for r in rows} == {"yali", "vllm-default"}
    assert all(r["rank"] == 0 for r in rows)  # rank from the file name; the CPU-only trace gives no rows
    gemm = [r for r in rows if r["config"] == "yali" and r["kernel_class"] == "gemm"][0]
    assert gemm["per_token_count"] == 1.0 and gemm["per_token_us"] == 10.0
    md = dp.markdown({"host": "h", "date": "d", "command": "c", "records": rows})
    assert "| yali | yali | 0.5 | 2.5 | 5.0 | 2.0 | 3.0 |" in md


def test_dry_run_adds_the_torch_profiler(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "decode_profile.py"), "--dry-run",
                          "--model-size", "8b", "--model-dir", str(tmp_path / "m"), "--out", str(tmp_path / "o"),
                          "--configs", "yali"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("$ ")][0]
    assert "--tensor-parallel-size 2" in line and '"profiler": "torch"' in line
    assert str((tmp_path / "o" / "traces" / "yali").resolve()) in line
