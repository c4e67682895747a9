"""CPU tests of lab/decode_profile.py: kernel classification, the per-stream
gap analysis on a synthetic torch-profiler trace, rows per config/rank, and the
server command it would run."""
import gzip
import json
import os
import subprocess
import sys

from benchmarks.serving import bench_run, profile_analysis

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    assert profile_analysis.kernel_class("void yali::flash_push_kernel<float>(yali::ExchangeArgs)") == "yali"
    assert profile_analysis.kernel_class("allreduce_fusion_kernel_twoshot") == "flashinfer-allreduce"
    assert profile_analysis.kernel_class("void vllm::cross_device_reduce_1stage<...>") == "vllm-custom-allreduce"
    assert profile_analysis.kernel_class("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "nccl"
    assert profile_analysis.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert profile_analysis.kernel_class("flash_fwd_splitkv_kernel") == "attention"
    assert profile_analysis.kernel_class("triton_poi_fused_add_0") == "other"


def test_analyze_counts_durations_and_gaps_per_stream():
    res = profile_analysis.analyze(TRACE)
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
    rows = profile_analysis.rows_from_traces(tmp_path, tokens=2)
    assert {r["config"] for r in rows} == {"yali", "vllm-default"}
    assert all(r["rank"] == 0 for r in rows)  # rank from the file name; the CPU-only trace gives no rows
    gemm = [r for r in rows if r["config"] == "yali" and r["kernel_class"] == "gemm"][0]
    assert gemm["per_token_count"] == 1.0 and gemm["per_token_us"] == 10.0
    md = profile_analysis.markdown({"host": "h", "date": "d", "command": "c", "records": rows})
    assert "| yali | yali | 0.5 | 2.5 | 5.0 | 2.0 | 3.0 |" in md


def test_dry_run_adds_the_torch_profiler(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lab.decode_profile", "--dry-run",
                          "--model-size", "8b", "--model-dir", str(tmp_path / "m"), "--out", str(tmp_path / "o"),
                          "--configs", "yali"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("$ ")][0]
    assert "--tensor-parallel-size 2" in line and '"profiler": "torch"' in line
    assert str((tmp_path / "o" / "traces" / "yali").resolve()) in line


def test_markdown_sums_per_token_kernel_time_and_span(tmp_path):
    d = tmp_path / "yali"
    d.mkdir()
    with gzip.open(d / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz", "wt") as f:
        json.dump(TRACE, f)
    rows = profile_analysis.rows_from_traces(tmp_path, tokens=2)
    md = profile_analysis.markdown({"host": "h", "date": "d", "command": "c", "records": rows})
    # kernels 10+5+10+4+6+1 = 36 us over 2 tokens; span 46 us / 2
    assert "| yali | 18.0 | 23.0 |" in md


def test_serving_bench_profiles_into_its_out_dir(tmp_path):
    """--profile-tokens: every server gets vLLM's torch profiler (traces under OUT/traces/<config>),
    and the analysis of such traces lands in OUT/decode-profile.json (kind decode-profile)."""

    out = subprocess.run([sys.executable, "-m", "benchmarks.serving_bench", "--dry-run",
                          "--profile-tokens", "16", "--repeats", "1", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    serve_lines = [ln for ln in out.stdout.splitlines() if "--tensor-parallel-size 2" in ln]
    assert len(serve_lines) == 3
    for cfg, line in zip(("yali", "vllm-default", "nccl"), serve_lines):
        # The server writes into OUT/profiler/<config>; each profile's files move to OUT/traces/<config>.
        assert '"profiler": "torch"' in line and str(tmp_path / "profiler" / cfg) in line
    d = tmp_path / "traces" / "nccl"
    d.mkdir(parents=True)
    with gzip.open(d / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz", "wt") as f:
        json.dump(TRACE, f)
    path = bench_run.write_decode_profile(tmp_path, 2, "70b")
    doc = json.loads(path.read_text())
    assert doc["kind"] == "decode-profile" and {r["config"] for r in doc["records"]} == {"nccl"}
    assert (tmp_path / "decode-profile.md").exists()
    (tmp_path / "empty" / "traces" / "yali").mkdir(parents=True)  # a server that wrote no trace
    assert bench_run.write_decode_profile(tmp_path / "empty", 2, "70b") is None


def test_serving_bench_rejects_negative_profile_tokens():
    out = subprocess.run([sys.executable, "-m", "benchmarks.serving_bench", "--dry-run",
                          "--profile-tokens", "-1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--profile-tokens" in out.stderr


def test_top_kernels_per_config(tmp_path):
    d = tmp_path / "yali"
    d.mkdir()
    with gzip.open(d / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz", "wt") as f:
        json.dump(TRACE, f)
    with gzip.open(d / "dp0_pp0_tp1_dcp0_ep0_rank1.1.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": [k("only_on_rank1", 0, 99)]}, f)
    top = profile_analysis.top_kernels(tmp_path, tokens=2)["yali"]
    assert top[0] == {"name": "nvjet_tst_128x256_gemm", "class": "gemm", "count": 2, "total_us": 20.0,
                      "per_token_count": 1.0, "per_token_us": 10.0}
    assert all(t["name"] != "only_on_rank1" for t in top)
    md = profile_analysis.markdown({"host": "h", "date": "d", "command": "c", "records": profile_analysis.rows_from_traces(tmp_path, 2),
                      "top_kernels": {"yali": top}})
    assert "Top kernels of yali" in md and "| `nvjet_tst_128x256_gemm` | gemm | 1.0 | 10.0 |" in md


def test_merge_keeps_every_record_and_lists_sources(tmp_path):

    paths = []
    for cfg in ("yali", "vllm-default"):
        run = tmp_path / f"run-{cfg}"
        d = run / "traces" / cfg
        d.mkdir(parents=True)
        with gzip.open(d / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz", "wt") as f:
            json.dump(TRACE, f)
        paths.append(bench_run.write_decode_profile(run, 2, "70b"))
    out = subprocess.run([sys.executable, "-m", "lab.decode_profile", "--merge",
                          *map(str, paths), "--out", str(tmp_path / "merged")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "merged" / "decode-profile.json").read_text())
    assert {r["config"] for r in doc["records"]} == {"yali", "vllm-default"}
    assert set(doc["top_kernels"]) == {"yali", "vllm-default"} and len(doc["merged_from"]) == 2
    assert "| vllm-default | 18.0 | 23.0 |" in (tmp_path / "merged" / "decode-profile.md").read_text()


PROFILER_OUT = """\
-------------------------------------------------------  ------------  ------------
                                                   Name    Self CPU %      Self CPU   CPU total %     CPU total  CPU time avg     Self CUDA   Self CUDA %    CUDA total  CUDA time avg    # of Calls
                   execute_context_0(0)_generation_1(1)         0.00%       0.000us         0.00%       0.000us       0.000us     625.482ms        97.56%     625.482ms      20.177ms            31
                  execute_context_1(66)_generation_0(0)         0.00%       0.000us         0.00%       0.000us       0.000us      36.628ms         5.71%      36.628ms      36.628ms             1
"""


def test_step_times_reads_decode_steps_from_vllm_key_averages(tmp_path):
    d = tmp_path / "yali"
    d.mkdir()
    (d / "profiler_out_0.txt").write_text(PROFILER_OUT)
    (d / "profiler_out_1.txt").write_text(PROFILER_OUT.replace("20.177ms", "850.000us"))
    st = profile_analysis.step_times(tmp_path)
    prefill = {"prefill_steps": 1, "prefill_tokens": 66, "prefill_step_us": 36628.0}
    assert st == {"yali": {"0": {"decode_steps": 31, "decode_step_us": 20177.0, **prefill},
                           "1": {"decode_steps": 31, "decode_step_us": 850.0, **prefill}}}
    md = profile_analysis.markdown({"host": "h", "date": "d", "command": "c", "records": [], "step_times": st})
    assert "| yali | 0 | 31 | 20177.0 |" in md and "36628" not in md
    md = profile_analysis.markdown({"host": "h", "date": "d", "command": "c", "records": [], "step_times": st,
                                    "phase": "prefill", "prompt_tokens": 66})
    assert md.startswith("# Prefill profile") and "| yali | 0 | 1 | 36628.0 |" in md and "20177" not in md


def test_step_times_reads_vllm_033_table_names(tmp_path):
    """vLLM 0.33 names the key-averages table <trace name>.profiler_out.txt, the rank last."""
    d = tmp_path / "yali"
    d.mkdir()
    (d / "dp0_pp0_tp1_dcp0_ep0_rank1.profiler_out.txt").write_text(PROFILER_OUT)
    assert profile_analysis.step_times(tmp_path)["yali"]["1"]["decode_step_us"] == 20177.0


def test_prefill_prompt_is_fresh_and_sized():
    from benchmarks.serving.profiler import prefill_prompt

    a, b = prefill_prompt(1024, 0), prefill_prompt(1024, 1)
    assert len(a) == 1024 and a == prefill_prompt(1024, 0) and a != b
    assert min(a) >= 1000 and max(a) < 100_000


def test_move_traces_empties_the_server_dir(tmp_path):
    from benchmarks.serving.profiler import move_traces

    server = tmp_path / "profiler" / "yali"
    (server / "sub").mkdir(parents=True)
    (server / "rank0.pt.trace.json.gz").write_text("a")
    (server / "sub" / "rank0.profiler_out.txt").write_text("b")
    assert move_traces(server, tmp_path / "prefill-traces" / "yali") == 2
    assert not [p for p in server.rglob("*") if p.is_file()]
    assert (tmp_path / "prefill-traces" / "yali" / "sub" / "rank0.profiler_out.txt").read_text() == "b"
    assert move_traces(tmp_path / "missing", tmp_path / "x") == 0


def test_write_prefill_profile(tmp_path):
    d = tmp_path / "prefill-traces" / "yali"
    d.mkdir(parents=True)
    with gzip.open(d / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz", "wt") as f:
        json.dump(TRACE, f)
    (d / "dp0_pp0_tp0_dcp0_ep0_rank0.profiler_out.txt").write_text(PROFILER_OUT)
    path = bench_run.write_prefill_profile(tmp_path, 1024, "70b")
    assert path == tmp_path / "prefill-profile.json"
    doc = json.loads(path.read_text())
    assert doc["phase"] == "prefill" and doc["prompt_tokens"] == 1024
    assert {r["kernel_class"]: r["per_token_us"] for r in doc["records"]}["gemm"] == 20.0  # per step: all of it
    md = (tmp_path / "prefill-profile.md").read_text()
    assert "kernels / step" in md and "1024-token prompt" in md and "| yali | 0 | 1 | 36628.0 |" in md
    assert not (tmp_path / "decode-profile.json").exists()
    assert bench_run.write_prefill_profile(tmp_path / "none", 1024, "70b") is None


def test_collectives_net_of_the_ranks_arrival_skew(tmp_path):
    """The k-th all-reduce is one collective on every rank; the rank that arrived last waited
    least, so the shortest time over the ranks, summed over the calls, is what the collective
    itself took. Rank 0 arrives late at the first call, rank 1 at the second."""
    d = tmp_path / "yali"
    d.mkdir()
    rank_calls = {0: (10, 300), 1: (250, 12), 2: (200, 100)}
    for r, (a, b) in rank_calls.items():
        with gzip.open(d / f"dp0_pp0_tp{r}_dcp0_ep0_rank{r}.1.pt.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": [k("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 0, a),
                                       k("nvjet_tst_gemm", 400, 50),
                                       k("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 500, b)]}, f)
    rows, top, nets = profile_analysis.summarize_traces(tmp_path, tokens=2)
    assert nets == {"yali": {"nccl": {"count": 2, "ranks": 3, "net_us": 22.0, "per_token_net_us": 11.0,
                                      "per_token_rank_us": {"0": 155.0, "1": 131.0, "2": 150.0}}}}
    md = profile_analysis.markdown({"host": "h", "date": "d", "command": "c", "records": rows, "collective_net": nets})
    assert "| yali | nccl | 2 | 11.0 | 0: 155.0, 1: 131.0, 2: 150.0 |" in md
    # A rank that made another number of calls of the class: no pairing, no net figure.
    with gzip.open(d / "dp0_pp0_tp3_dcp0_ep0_rank3.1.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": [k("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 0, 5)]}, f)
    assert profile_analysis.summarize_traces(tmp_path, tokens=2)[2] == {}
