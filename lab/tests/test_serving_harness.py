"""CPU tests of the serving benchmark / load-test harness (benchmarks/).

Everything runs without a GPU or vLLM: vLLM's result JSON and locust's stats CSV
are written here in the exact shapes vLLM 0.26 / locust 2.x produce; servers are
small fake HTTP servers on 127.0.0.1 started by the tests.
"""

from __future__ import annotations

import csv
import datetime as dt
import importlib.util
import json
import os
import shlex
import tempfile
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from benchmarks import load_test
from benchmarks import serving_bench as sb
from benchmarks.common import gpu_env, results
from benchmarks.common.gpu_env import MULTICAST_OFF_ENV as MULTICAST_OFF
from benchmarks.common.processes import free_port
from benchmarks.serving import bench_run, budget, commands, configs, http, locust, logs, model, report, runners, schema, server, stats
from yali_vllm.models import QUANT_CHOICES, QUANT_CONFIGS

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


# ----------------------------------------------------------------------------- fixtures
def vllm_bench_result(
    *,
    concurrency: int = 8,
    num_prompts: int = 32,
    tpot: float = 5.1,
    itl_p99: float = 7.9,
    ttft: float = 60.0,
    tok_s: float = 1400.0,
    failed: int = 0,
) -> dict:
    """A result dict in the exact key set/order ``vllm bench serve --save-result`` writes
    (vLLM 0.26, vllm/benchmarks/serve.py main_async + benchmark(), without
    --save-detailed, --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99)."""
    completed = num_prompts - failed
    return {
        "date": "20260509-120000",
        "endpoint_type": "vllm",
        "backend": "vllm",
        "label": None,
        "model_id": "/tmp/serving-bench-model-8b",
        "tokenizer_id": "/tmp/serving-bench-model-8b",
        "num_prompts": num_prompts,
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": concurrency,
        "duration": 12.5,
        "completed": completed,
        "failed": failed,
        "total_input_tokens": completed * 1024,
        "total_output_tokens": completed * 256,
        "request_throughput": completed / 12.5,
        "request_goodput": None,
        "output_throughput": tok_s,
        "total_token_throughput": tok_s * 5,
        "max_output_tokens_per_s": tok_s * 1.1,
        "max_concurrent_requests": concurrency,
        "rtfx": 0.0,
        "mean_ttft_ms": ttft * 1.1,
        "median_ttft_ms": ttft,
        "std_ttft_ms": 3.0,
        "p50_ttft_ms": ttft,
        "p99_ttft_ms": ttft * 2,
        "mean_tpot_ms": tpot * 1.01,
        "median_tpot_ms": tpot,
        "std_tpot_ms": 0.05,
        "p50_tpot_ms": tpot,
        "p99_tpot_ms": tpot * 1.2,
        "mean_itl_ms": tpot * 1.01,
        "median_itl_ms": tpot,
        "std_itl_ms": 0.4,
        "p50_itl_ms": tpot,
        "p99_itl_ms": itl_p99,
    }


def make_records(spec: dict[tuple[str, int], list[float]]) -> list[dict]:
    """Records whose tpot_ms_p50 per (config, concurrency) are the given repeat values."""
    recs = []
    for (cfg, c), tpots in spec.items():
        for rep, t in enumerate(tpots, start=1):
            parsed = schema.parse_bench_result(
                vllm_bench_result(concurrency=c, tpot=t, itl_p99=t * 1.5, ttft=50.0 + t, tok_s=1000.0 / t * c)
            )
            recs.append(schema.make_record(cfg, c, rep, parsed))
    return recs


# ----------------------------------------------------------- vLLM result JSON parsing
def test_parse_vllm_result_maps_every_row_key(tmp_path):
    path = tmp_path / "yali-r1-c8.json"
    path.write_text(json.dumps(vllm_bench_result(tpot=5.25, itl_p99=8.5, ttft=61.0, tok_s=1234.5, failed=2)))
    row = schema.parse_bench_result(path)
    assert row["tpot_ms_p50"] == 5.25
    assert row["tpot_ms_p99"] == pytest.approx(5.25 * 1.2)
    assert row["itl_ms_p50"] == 5.25
    assert row["itl_ms_p99"] == 8.5
    assert row["ttft_ms_p50"] == 61.0
    assert row["ttft_ms_p99"] == 122.0
    assert row["output_tok_s"] == 1234.5
    assert row["req_s"] == pytest.approx(30 / 12.5)
    assert row["failed"] == 2 and row["completed"] == 30
    rec = schema.make_record("yali", 8, 1, row)
    assert tuple(rec)[: len(schema.ROW_KEYS)] == schema.ROW_KEYS


def test_parse_vllm_result_falls_back_to_median_and_tolerates_missing():
    res = vllm_bench_result()
    for k in ("p50_ttft_ms", "p50_tpot_ms", "p50_itl_ms", "p99_itl_ms"):
        del res[k]
    res["median_tpot_ms"] = 4.5
    row = schema.parse_bench_result(res)
    assert row["tpot_ms_p50"] == 4.5  # median == p50
    assert row["itl_ms_p99"] is None  # never invented


def test_vllm_result_keys_match_vllm_source_when_available():
    """The key names we read are the ones vLLM's serve.py writes (checked against its source)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm not installed")
    src = Path(list(spec.submodule_search_locations)[0]) / "benchmarks" / "serve.py"
    if not src.exists():
        pytest.skip("vllm/benchmarks/serve.py not found")
    text = src.read_text()
    assert 'result[f"p{p_word}_{metric_attribute_name}_ms"]' in text
    for key in ('"output_throughput"', '"request_throughput"', '"failed"', '"completed"'):
        assert key in text


# ------------------------------------------------------------ aggregation and verdicts
def test_slow_gap_positions_bins_the_gaps_above_p99():
    assert schema.slow_gap_positions(None) is None and schema.slow_gap_positions([[], []]) is None
    # 1000 gaps of 1 ms but five: 9 ms (gap 1), 8 ms (gap 5), 7 ms (gap 12), 6 and 5 ms (gap 3 of
    # two requests). vLLM's p99 (numpy's linear percentile) lies at position 989.01 of the sorted
    # gaps, among the 1 ms ones: exactly the five slow gaps lie above it.
    itls = [[0.009] + [0.001] * 199, [0.001] * 4 + [0.008] + [0.001] * 195, [0.001] * 11 + [0.007] + [0.001] * 188,
            [0.001] * 2 + [0.006] + [0.001] * 197, [0.001] * 2 + [0.005] + [0.001] * 197]
    slow = schema.slow_gap_positions(itls)
    assert slow == {"p99_ms": 1.0, "gaps": 1000, "above_p99": {"1": 1, "2-8": 3, "9+": 1}}
    # 100 gaps of 1..100 ms: the p99 is 99.01 ms (numpy), so only the 100 ms gap (gap 100) is above
    slow = schema.slow_gap_positions([[i / 1e3 for i in range(1, 101)]])
    assert slow == {"p99_ms": 99.01, "gaps": 100, "above_p99": {"1": 0, "2-8": 0, "9+": 1}}


def test_summarize_mean_and_spread():
    st = stats.summarize([5.0, 5.2, None])
    assert st.n == 2 and st.mean == pytest.approx(5.1) and st.spread == pytest.approx(0.2)
    assert stats.summarize([None]) is None


def test_verdict_no_difference_when_within_spread():
    yali = stats.summarize([5.00, 5.20])  # spread 0.2
    other = stats.summarize([5.15, 5.25])  # spread 0.1; |Δ mean| = 0.1 <= 0.2
    code, text = stats.verdict(yali, other, lower_is_better=True)
    assert code == "no difference" and "no difference" in text


def test_verdict_better_and_worse_beyond_spread():
    yali = stats.summarize([5.00, 5.02])
    other = stats.summarize([5.50, 5.52])
    code, text = stats.verdict(yali, other, lower_is_better=True)
    assert code == "better" and "-9.1%" in text
    code, _ = stats.verdict(other, yali, lower_is_better=True)
    assert code == "worse"
    # throughput: higher is better
    code, _ = stats.verdict(stats.summarize([1100, 1102]), stats.summarize([1000, 1001]), lower_is_better=False)
    assert code == "better"


def test_verdict_needs_two_repeats():
    code, text = stats.verdict(stats.summarize([5.0]), stats.summarize([6.0, 6.1]), True)
    assert code == "n/a" and "repeats" in text


def test_aggregate_groups_by_concurrency_and_config():
    recs = make_records({("yali", 1): [5.0, 5.1], ("nccl", 1): [6.0, 6.2], ("yali", 8): [7.0, 7.1]})
    recs[0]["failed"] = 3
    agg = stats.aggregate(recs)
    assert set(agg) == {(1, "yali"), (1, "nccl"), (8, "yali")}
    assert agg[(1, "yali")]["repeats"] == 2 and agg[(1, "yali")]["failed"] == 3
    assert agg[(1, "nccl")]["tpot_ms_p50"].mean == pytest.approx(6.1)


def test_markdown_table_has_verdict_columns():
    recs = make_records(
        {
            ("yali", 1): [5.00, 5.02],
            ("vllm-default", 1): [5.01, 5.03],  # within spread -> no difference
            ("nccl", 1): [6.00, 6.02],  # far -> yali better
            ("yali", 32): [9.0, 9.1],
            ("nccl", 32): [9.05, 9.2],
        }
    )
    doc = {"kind": schema.KIND, "date": "2026-05-09T12:00:00+00:00", "command": "x", "host": "2xNVIDIA H200 NV18, driver 580.1",
           "versions": {}, "model": {"size": "8b"}, "workload": {"input_len": 1024}, "records": recs}
    md = report.render_markdown(doc, ["tpot_p50.png"])
    assert "## Concurrency 1" in md and "## Concurrency 32" in md
    assert "| yali | 2 | 5.010 ± 0.010 |" in md
    c1 = md.split("## Concurrency 1")[1].split("## Concurrency 32")[0]
    vd_row = next(line for line in c1.splitlines() if line.startswith("| vllm-default |"))
    assert "no difference" in vd_row
    nccl_row = next(line for line in c1.splitlines() if line.startswith("| nccl |"))
    assert "(better)" in nccl_row
    assert "| TPOT p50 (ms) | no difference" in c1
    assert "output tok/s" in md and "![tpot_p50](tpot_p50.png)" in md
    assert "reported as **no difference**" in md


# ------------------------------------------------------------------------ JSON schema
def test_results_header_has_common_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("YALI_DEV_FUSED_BATCH_POLL_MIN", "0")
    monkeypatch.setenv("NOT_YALI_X", "1")
    hdr = results.results_header("serving-benchmark", {"records": []})
    assert hdr["yali_env"]["YALI_DEV_FUSED_BATCH_POLL_MIN"] == "0"  # a non-default knob is on record
    assert all(k.startswith("YALI_") for k in hdr["yali_env"])
    assert hdr["kind"] == "serving-benchmark"
    for k in ("kind", "date", "command", "host", "versions", "records"):
        assert k in hdr
    assert set(hdr["versions"]) == {"torch", "cuda", "nccl", "vllm", "yali_vllm", "git"}
    assert dt.datetime.fromisoformat(hdr["date"]).tzinfo is not None
    assert isinstance(hdr["host"], str) and hdr["host"]
    assert isinstance(hdr["gpus"], list)  # [] without nvidia-smi
    ids = results.parse_gpu_ids("0, GPU-1a2b, 1653023012345, 00000000:18:00.0, 96.00.AF.00.01\n"
                                 "1, GPU-3c4d, [N/A], 00000000:2A:00.0, 96.00.AF.00.01\nNo devices were found\n")
    assert ids == [{"index": "0", "uuid": "GPU-1a2b", "serial": "1653023012345", "pci_bus_id": "00000000:18:00.0",
                    "vbios_version": "96.00.AF.00.01"},
                   {"index": "1", "uuid": "GPU-3c4d", "serial": "[N/A]", "pci_bus_id": "00000000:2A:00.0",
                    "vbios_version": "96.00.AF.00.01"}]
    with pytest.raises(ValueError):
        results.results_header("x", {"date": "overridden"})
    path = results.write_results(tmp_path / "sub" / "r.json", hdr)
    # The file adds the schema's two keys: 2 ranks unless the command says otherwise, GPUs not shared.
    assert json.loads(path.read_text()) == {**json.loads(json.dumps(hdr)), "world_size": 2, "shared_gpu": False}
    assert not list(path.parent.glob("*.tmp"))
    assert "world_size" not in hdr and "gpus_used" not in hdr  # only a run of ranks names them


def test_results_header_names_the_ranks_and_their_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    hdr = results.results_header("allreduce-microbench", {"records": []}, world_size=4)
    assert hdr["world_size"] == 4 and hdr["shared_gpu"] is False
    assert [(g["rank"], g["cuda_device"]) for g in hdr["gpus_used"]] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert [g.get("uuid") for g in hdr["gpus_used"]] == [g.get("uuid") for g in (hdr["gpus"] + [{}] * 4)[:4]]
    shared = results.results_header("allreduce-microbench", {"records": []}, world_size=8, shared_gpu=True)
    assert shared["shared_gpu"] is True and {g["cuda_device"] for g in shared["gpus_used"]} == {0}
    with pytest.raises(ValueError, match="world_size"):
        results.results_header("x", {"world_size": 2}, world_size=4)


def test_gpus_used_follow_cuda_visible_devices():
    ids = [{"index": str(i), "uuid": f"GPU-{c}{c}{c}", "pci_bus_id": f"00000000:{i}0:00.0"}
           for i, c in enumerate("abcd")]
    assert results.cuda_order(ids, None) == ids
    assert [g["index"] for g in results.cuda_order(ids, "3,1")] == ["3", "1"]
    assert [g["index"] for g in results.cuda_order(ids, "GPU-ccc, 0")] == ["2", "0"]
    assert [g["index"] for g in results.cuda_order(ids, "GPU-b,9,0")] == ["1"]  # CUDA stops at a bad entry
    assert results.cuda_order(ids, "") == []
    used = results.gpus_used(2, ids=ids, cuda_visible="2,3")
    assert used == [{"rank": 0, "cuda_device": 0, **ids[2]}, {"rank": 1, "cuda_device": 1, **ids[3]}]
    assert results.gpus_used(2, ids=[], cuda_visible=None) == [{"rank": 0, "cuda_device": 0},
                                                              {"rank": 1, "cuda_device": 1}]
    assert [g["index"] for g in results.gpus_used(3, True, ids, "1,2")] == ["1", "1", "1"]


def test_host_summary_from_nvidia_smi_output():
    gpus = "name, driver_version\nNVIDIA H200, 580.65.06\nNVIDIA H200, 580.65.06\n"
    topo = textwrap.dedent(
        """\
        \t\x1b[4mGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
        GPU0\t X \tNV18\tSYS\t0-47\t0\t\tN/A
        GPU1\tNV18\t X \tSYS\t0-47\t0\t\tN/A
        NIC0\tSYS\tSYS\t X \t\t\t\t

        Legend:

          X    = Self
          NV#  = Connection traversing a bonded set of # NVLinks
        """
    )
    assert results.parse_topo_links(topo) == ["NV18"]
    assert results.summarize_host(gpus, topo) == "2xNVIDIA H200 NV18, driver 580.65.06"
    assert results.summarize_host(None, None).startswith("unknown")


def test_child_env_forces_multicast_off():
    env = gpu_env.child_env({"NCCL_NVLS_ENABLE": "1", "YALI_ENABLE": "1"})
    for k, v in MULTICAST_OFF.items():
        assert env[k] == v
    assert env["YALI_ENABLE"] == "1"
    assert "127.0.0.1" in env["NO_PROXY"].split(",")


def serving_doc_schema_check(doc: dict) -> None:
    assert doc["kind"] == "serving-benchmark"
    for k in ("kind", "date", "command", "host", "versions", "model", "workload", "records"):
        assert k in doc, k
    assert set(doc["versions"]) >= {"torch", "cuda", "nccl", "vllm", "yali_vllm", "git"}
    for rec in doc["records"]:
        for k in schema.ROW_KEYS:
            assert k in rec, k
        assert rec["config"] in ("yali", "vllm-default", "nccl")


# ---------------------------------------------------------------- server configuration
def test_server_commands_and_env_per_config():
    cmds = {name: server.server_command("vllm", "/m", cfg, 8123, max_num_seqs=64) for name, cfg in configs.SERVER_CONFIGS.items()}
    for name, cmd in cmds.items():
        assert cmd[:3] == ["vllm", "serve", "/m"]
        joined = " ".join(cmd)
        parallel = ("--data-parallel-size 2 --enable-expert-parallel" if configs.SERVER_CONFIGS[name].parallel == "dp-ep"
                    else "--tensor-parallel-size 2")
        for frag in (parallel, "--load-format dummy", "--tokenizer-mode mistral", "--port 8123",
                     "--max-model-len 2048", "--gpu-memory-utilization 0.9", "--max-num-seqs 64", "--host 127.0.0.1"):
            assert frag in joined
    assert "--disable-custom-all-reduce" not in cmds["yali"] and "--compilation-config" not in cmds["vllm-default"]
    nccl = cmds["nccl"]
    assert "--disable-custom-all-reduce" in nccl
    cc = json.loads(nccl[nccl.index("--compilation-config") + 1])
    assert cc == {"pass_config": {"fuse_allreduce_rms": False}}
    assert server.server_env(configs.SERVER_CONFIGS["yali"])["YALI_ENABLE"] == "1"
    assert server.server_env(configs.SERVER_CONFIGS["vllm-default"])["YALI_ENABLE"] == "0"
    assert server.server_env(configs.SERVER_CONFIGS["nccl"])["YALI_ENABLE"] == "0"
    for cfg in configs.SERVER_CONFIGS.values():
        env = server.server_env(cfg)
        assert all(env[k] == v for k, v in MULTICAST_OFF.items())


def test_a_variant_is_its_base_with_yali_settings(monkeypatch):
    """`BASE+VAR=VALUE...` serves BASE's command with those YALI_* settings on top of BASE's
    environment, multicast still off; add_variants registers it for the run."""
    monkeypatch.setattr(configs, "SERVER_CONFIGS", dict(configs.SERVER_CONFIGS))
    name = "yali+YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX=131072+YALI_TIMEOUT_S=30"
    configs.add_variants(["yali", "vllm-default", name])
    cfg = configs.SERVER_CONFIGS[name]
    base = configs.SERVER_CONFIGS["yali"]
    assert cfg.name == name and cfg.args == base.args and cfg.parallel == base.parallel
    assert cfg.env == {**base.env, "YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX": "131072", "YALI_TIMEOUT_S": "30"}
    assert base.env == configs.YALI_ON  # the base is unchanged
    env = server.server_env(cfg)
    assert env["YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX"] == "131072" and env["YALI_ENABLE"] == "1"
    assert all(env[k] == v for k, v in MULTICAST_OFF.items())
    assert server.server_command("vllm", "/m", cfg, 8123, max_num_seqs=64) == \
        server.server_command("vllm", "/m", base, 8123, max_num_seqs=64)
    nccl = configs.variant("nccl+YALI_ENABLE=1")
    assert "--disable-custom-all-reduce" in nccl.args and nccl.env["YALI_ENABLE"] == "1"


@pytest.mark.parametrize("name, says", [
    ("yali2", "unknown config 'yali2'"),
    ("mine+YALI_TIMEOUT_S=3", "unknown base 'mine'"),
    ("yali+", "'' is not VAR=VALUE"),
    ("yali+YALI_TIMEOUT_S", "'YALI_TIMEOUT_S' is not VAR=VALUE"),
    ("yali+YALI_TIMEOUT_S=", "'YALI_TIMEOUT_S=' is not VAR=VALUE"),
    ("yali+NCCL_NVLS_ENABLE=1", "'NCCL_NVLS_ENABLE' is not a YALI_* setting"),
    ("yali+YALI_MAX_BYTE=1M", "'YALI_MAX_BYTE' is not a YALI_* setting"),
])
def test_a_bad_variant_is_refused_naming_the_part(name, says, monkeypatch):
    monkeypatch.setattr(configs, "SERVER_CONFIGS", dict(configs.SERVER_CONFIGS))
    known = set(configs.SERVER_CONFIGS)
    with pytest.raises(SystemExit) as e:
        configs.add_variants(["yali", name])
    assert says in str(e.value)
    assert set(configs.SERVER_CONFIGS) == known


def test_bench_command_flags():
    cmd = runners.bench_command("vllm", "http://127.0.0.1:9", "/m", concurrency=8, num_prompts=32, input_len=1024,
                           output_len=256, seed=1, result_dir="/r", result_filename="a.json")
    j = " ".join(cmd)
    assert cmd[:3] == ["vllm", "bench", "serve"]
    for frag in ("--backend vllm", "--base-url http://127.0.0.1:9", "--model /m", "--tokenizer /m", "--tokenizer-mode mistral",
                 "--dataset-name random", "--random-input-len 1024", "--random-output-len 256", "--ignore-eos", "--seed 1",
                 "--max-concurrency 8", "--num-prompts 32", "--save-result", "--result-dir /r", "--result-filename a.json",
                 "--percentile-metrics ttft,tpot,itl", "--metric-percentiles 50,99"):
        assert frag in j


def test_schedule_is_interleaved_and_prompts_scale():
    assert budget.interleaved_schedule(["yali", "vllm-default", "nccl"], 2) == [
        (1, "yali"), (1, "vllm-default"), (1, "nccl"), (2, "yali"), (2, "vllm-default"), (2, "nccl")]
    assert [budget.num_prompts_for(c, 4, 8) for c in (1, 8, 32)] == [8, 32, 128]


def test_startup_estimate_is_the_configs_own_last_start_else_the_slowest_seen():
    from benchmarks.serving.budget import startup_estimate
    assert startup_estimate("yali", {}, 60.0) == 60.0
    # a first (compiling) start of vllm-default after a warm yali start: plan for the slowest seen
    assert startup_estimate("vllm-default", {"yali": 130.0}, 60.0) == 130.0
    observed = {"yali": 130.0, "vllm-default": 240.0}
    assert startup_estimate("yali", observed, 60.0) == 130.0  # not the other's compiling start
    assert startup_estimate("nccl", observed, 60.0) == 240.0


def test_estimates_plan_with_an_earlier_runs_times_of_the_same_workload(tmp_path):
    path = tmp_path / "cache" / "estimates.json"
    first = budget.Estimates(path, "8b tp2", 60.0, 25.0)
    assert (first.startup("yali"), first.bench("c1"), first.first_bench()) == (60.0, 25.0, 25.0)  # nothing saved
    first.saw_startup("yali", 171.0)
    first.saw_startup("vllm-default", 145.0)
    first.saw_bench("c1", 18.0)
    first.saw_bench("c1", 17.0)  # a point keeps its longest run
    first.saw_bench("c32", 6.5)
    nxt = budget.Estimates(path, "8b tp2", 60.0, 25.0)  # the next run on the same machine
    assert (nxt.startup("yali"), nxt.startup("vllm-default"), nxt.startup("nccl")) == (171.0, 145.0, 171.0)
    assert (nxt.bench("c1"), nxt.bench("c8"), nxt.first_bench()) == (18.0, 25.0, 6.5)
    nxt.saw_startup("yali", 106.0)  # its own start (from vLLM's compile cache) beats the saved one
    assert nxt.startup("yali") == 106.0 and nxt.startup("vllm-default") == 145.0
    other = budget.Estimates(path, "70b tp4", 60.0, 25.0)  # another workload plans with the defaults
    assert (other.startup("yali"), other.bench("c1")) == (60.0, 25.0)
    other.saw_startup("yali", 243.0)
    assert set(json.loads(path.read_text())) == {"8b tp2", "70b tp4"}  # both kept
    assert budget.Estimates(path, "8b tp2", 60.0, 25.0).startup("yali") == 106.0
    path.write_text("{not json")
    assert budget.Estimates(path, "8b tp2", 60.0, 25.0).startup("yali") == 60.0  # unreadable: the defaults
    mem = budget.Estimates(None, "8b tp2", 60.0, 25.0)  # no file: this run's observations only
    mem.saw_startup("yali", 100.0)
    assert mem.startup("nccl") == 100.0 and budget.Estimates(None, "8b tp2", 60.0, 25.0).startup("yali") == 60.0


def test_deadline_clips_timeouts():
    t = [100.0]
    d = budget.Deadline(60, clock=lambda: t[0])
    assert d.clip(300) == 60
    t[0] = 130.0
    assert d.remaining() == 30 and d.clip(300, reserve_s=10) == 20 and d.clip(5) == 5
    t[0] = 200.0
    assert d.clip(300) == 0


def test_scan_server_log_key_lines_and_errors(tmp_path):
    log = tmp_path / "s.log"
    lines = [
        "INFO 05-09 12:00:00 [__init__.py:52] Available plugins for group vllm.general_plugins:",
        "INFO 05-09 12:00:00 [__init__.py:54] - yali -> yali_vllm.vllm_plugin:register",
        "(Worker_TP0 pid=11) INFO 05-09 12:00:01 [cuda_communicator.py:265] Using ['CUSTOM', 'PYNCCL'] all-reduce backends (in dispatch order) for group 'tp:0' out of potential backends: [...]",
        "(Worker_TP1 pid=12) INFO 05-09 12:00:01 [cuda_communicator.py:265] Using ['CUSTOM', 'PYNCCL'] all-reduce backends (in dispatch order) for group 'tp:0' out of potential backends: [...]",
        "INFO 05-09 12:00:02 [flashinfer_all_reduce.py:108] Using flashinfer allreduce backend: trtllm",
        "INFO 05-09 12:00:03 [api_server.py:1] Starting vLLM API server",
    ]
    tail = ["ERROR 05-09 12:01:00 [core.py:1] EngineCore failed", "Traceback (most recent call last):"]
    log.write_text("\n".join(lines) + "\n")
    cut = log.stat().st_size
    with open(log, "a") as f:
        f.write("\n".join(tail) + "\n")
    full = logs.scan_server_log(log)
    assert full["error_count"] == 2
    assert any("all-reduce backends" in ln for ln in full["key_lines"])
    assert sum("all-reduce backends" in ln for ln in full["key_lines"]) == 1  # TP ranks de-duplicated
    assert any("yali_vllm" in ln for ln in full["key_lines"])
    assert any("flashinfer allreduce backend: trtllm" in ln for ln in full["key_lines"])
    assert not any("Starting vLLM API server" in ln for ln in full["key_lines"])
    before_stop = logs.scan_server_log(log, 0, cut)
    assert before_stop["error_count"] == 0


def test_scan_ignores_own_header_lines_and_checks_yali_state(tmp_path):
    log = tmp_path / "s.log"
    log.write_text(
        "$ vllm serve /m --compilation-config '{\"pass_config\": {\"fuse_allreduce_rms\": false}}'\n"
        "# env: NCCL_NVLS_ENABLE=0 YALI_ENABLE=1\n"
        "INFO 05-09 12:00:01 [vllm_plugin.py:327] YALI all-reduce OFF for group 'tp:0': kernels not built\n"
    )
    scan = logs.scan_server_log(log)
    assert len(scan["key_lines"]) == 1 and "OFF" in scan["key_lines"][0]  # our own "$ ..." / "# env:" lines skipped
    warns = logs.yali_log_warnings("yali", scan["key_lines"])
    assert len(warns) == 2 and "no 'YALI all-reduce ON'" in warns[0] and "kernels not built" in warns[1]
    on = ["INFO [vllm_plugin.py:329] YALI all-reduce ON for group 'tp:0' (rank 0 of 2, cuda:0): x",
          "INFO [vllm_plugin.py:420] YALI fusion pass ON (replaces vLLM's FlashInfer all-reduce+RMSNorm fusion): x"]
    assert logs.yali_log_warnings("yali", on) == []
    assert "no 'YALI fusion pass ON'" in logs.yali_log_warnings("yali", on[:1])[0]
    # A graph loaded from vLLM's compile cache: no pass is built, the op's first call says it runs.
    cached = [on[0], "INFO [vllm_fusion.py:101] YALI fused all-reduce + RMSNorm op: first call on group 'tp:0' "
                     "runs YALI's fused kernel"]
    assert logs.yali_log_warnings("yali", cached) == []
    unfused_first = [on[0], "INFO [vllm_fusion.py:101] YALI fused all-reduce + RMSNorm op: first call on group "
                            "'tp:0' runs the group's all-reduce, then vLLM's RMSNorm"]
    assert "no 'YALI fusion pass ON'" in logs.yali_log_warnings("yali", unfused_first)[0]
    assert logs.yali_log_warnings("nccl", scan["key_lines"]) == []
    assert "kernels not built" in logs.yali_off_line("yali", log)
    assert logs.yali_off_line("vllm-default", log) is None and logs.yali_off_line("yali-ep", log) is None
    assert "did not keep it off" in logs.yali_log_warnings("vllm-default", on)[0]
    # the control: YALI on, its fusion pass off (FlashInfer's fusion serves the fused pairs)
    control = [on[0], "INFO [vllm_plugin.py:420] YALI fusion pass OFF: disabled by YALI_FUSION; using vLLM's x"]
    assert logs.yali_log_warnings("yali-flashinfer-fusion", control) == []
    assert "YALI_FUSION=0 did not hand" in logs.yali_log_warnings("yali-flashinfer-fusion", on)[0]
    assert "no 'YALI all-reduce ON'" in logs.yali_log_warnings("yali-flashinfer-fusion", control[1:])[0]
    # Four ranks: YALI's pass serves the fused pairs, as at two
    on4 = ["INFO [group_setup.py:237] YALI all-reduce ON for group 'tp:0' (rank 2 of 4, cuda:2): x"]
    first4 = on4 + [cached[1]]  # the graph from vLLM's compile cache: YALI's op's first call
    assert "no 'YALI fusion pass ON'" in logs.yali_log_warnings("yali", on4)[0]
    assert logs.yali_log_warnings("yali", on4 + on[1:]) == logs.yali_log_warnings("yali", first4) == []
    assert "no 'YALI fusion pass ON'" in logs.yali_log_warnings("yali-fusion", on4)[0]
    assert logs.yali_log_warnings("yali-fusion", on4 + on[1:]) == []
    assert "YALI_FUSION=0 did not hand" in logs.yali_log_warnings("yali-flashinfer-fusion", on4 + on[1:])[0]
    assert configs.SERVER_CONFIGS["yali-fusion"].env["YALI_FUSION"] == "1"
    cfg = configs.SERVER_CONFIGS["yali-flashinfer-fusion"]
    assert cfg.env == {"YALI_ENABLE": "1", "YALI_WORLD_SIZES": "all", "YALI_FUSION": "0"} and cfg.args == ()
    # Every yali configuration serves every world size the kernels serve, also those off by default.
    assert all(c.env.get("YALI_WORLD_SIZES") == "all" for name, c in configs.SERVER_CONFIGS.items()
               if c.env.get("YALI_ENABLE") == "1")


# ----------------------------------------------------------- processes (fake servers)
FAKE_VLLM = r'''
import argparse, json, os, signal, subprocess, sys, time, urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# -- `vllm bench serve` double: add_cli_args/main, usable as the bench worker's module too
def make_parser():
    return argparse.ArgumentParser()


def add_cli_args(p):
    for a in ("--backend", "--base-url", "--model", "--tokenizer", "--tokenizer-mode", "--dataset-name",
              "--random-input-len", "--random-output-len", "--seed", "--max-concurrency", "--num-prompts",
              "--num-warmups", "--result-dir", "--result-filename", "--percentile-metrics", "--metric-percentiles"):
        p.add_argument(a, required=a in ("--base-url", "--max-concurrency", "--num-prompts", "--result-dir"))
    for a in ("--ignore-eos", "--save-result", "--save-detailed", "--disable-tqdm"):
        p.add_argument(a, action="store_true")


def make_parser_with_args():
    p = make_parser()
    add_cli_args(p)
    return p


def main(args):
    bench_main(args)


def bench_main(args):
    assert args.save_result and args.ignore_eos and args.percentile_metrics == "ttft,tpot,itl"
    base = args.base_url
    c = int(args.max_concurrency)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    tag = json.load(opener.open(base + "/v1/models"))["data"][0]["owned_by"]
    factor = {"yali": 1.0, "vllm-default": 1.1, "nccl": 1.3}[tag]
    noise = 0.01 * (int(base.rsplit(":", 1)[1]) % 2)
    tpot = (5.0 + 0.05 * c) * factor + noise
    n = int(args.num_prompts)
    res = {"date": "20260509-120000", "endpoint_type": "vllm", "backend": "vllm", "label": None,
           "model_id": args.model, "tokenizer_id": args.tokenizer, "num_prompts": n,
           "request_rate": "inf", "burstiness": 1.0, "max_concurrency": c, "duration": 1.0,
           "completed": n, "failed": 0, "total_input_tokens": n * 1024, "total_output_tokens": n * 256,
           "request_throughput": n / 1.0, "request_goodput": None, "output_throughput": 1000.0 * c / tpot,
           "total_token_throughput": 1.0, "max_output_tokens_per_s": 1.0, "max_concurrent_requests": c,
           "rtfx": 0.0}
    ttft = 40.0 * factor * int(args.random_input_len) / 1024  # a prefill grows with the prompt
    for m, v in (("ttft", ttft), ("tpot", tpot), ("itl", tpot)):
        res.update({f"mean_{m}_ms": v, f"median_{m}_ms": v, f"std_{m}_ms": 0.0, f"p50_{m}_ms": v, f"p99_{m}_ms": v * 1.5})
    if args.save_detailed:  # per-request gaps (s): the first decode gap of every request the slowest
        out = int(args.random_output_len or 4)
        res["itls"] = [[3 * tpot / 1e3] + [tpot / 1e3] * (out - 2) for _ in range(n)]
    os.makedirs(args.result_dir, exist_ok=True)
    with open(os.path.join(args.result_dir, args.result_filename), "w") as f:
        json.dump(res, f)
    print("fake bench done", flush=True)


argv = sys.argv[1:] if __name__ == "__main__" else []

def opt(name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default

if not argv:
    pass  # imported as a module
elif argv[:1] == ["serve"]:
    model = argv[1]
    port = int(opt("--port"))
    if os.environ.get("FAKE_VLLM_DIE"):
        print("fatal: fake startup failure", flush=True)
        sys.exit(3)
    if os.environ.get("FAKE_VLLM_SLOW_START_S"):  # e.g. a JIT build during start-up
        print("INFO building kernels", flush=True)
        time.sleep(float(os.environ["FAKE_VLLM_SLOW_START_S"]))
    tag = ("yali" if os.environ.get("YALI_ENABLE") == "1"
           else "nccl" if "--disable-custom-all-reduce" in argv else "vllm-default")
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"INFO fake worker pid={worker.pid}", flush=True)
    print("INFO 05-09 12:00:01 [cuda_communicator.py:265] Using ['CUSTOM', 'PYNCCL'] all-reduce backends "
          "(in dispatch order) for group 'tp:0'", flush=True)
    if tag == "yali" and os.environ.get("FAKE_VLLM_YALI_OFF"):  # e.g. the extension missing from the tree
        print("INFO 05-09 12:00:01 [vllm_plugin.py:327] YALI all-reduce OFF for group 'tp:0': rank 0: the "
              "compiled extension yali_vllm/_C*.so is missing", flush=True)
    elif tag == "yali":
        print("INFO 05-09 12:00:01 [vllm_plugin.py:329] YALI all-reduce ON for group 'tp:0' (rank 0 of 2, "
              "cuda:0): flash+stream; tried first, other tensors use vLLM's all-reduce chain", flush=True)
        print("INFO 05-09 12:00:01 [vllm_plugin.py:420] YALI fusion pass ON (replaces vLLM's FlashInfer "
              "all-reduce+RMSNorm fusion): TP group served by YALI", flush=True)
    env = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                          "NVSHMEM_DISABLE_NVLS", "VLLM_FLASHINFER_ALLREDUCE_BACKEND")}
    print("INFO fake env " + json.dumps(env, sort_keys=True), flush=True)
    time.sleep(0.3)

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _json(self, obj, code=200):
            b = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(b)))
            self.end_headers()
            self.wfile.write(b)

        def do_GET(self):
            if self.path == "/health":
                self._json({})
            elif self.path == "/v1/models":
                self._json({"data": [{"id": model, "root": model, "owned_by": tag}]})
            else:
                self._json({"error": "not found"}, 404)

        protocol_version = "HTTP/1.1"

        def _chunk(self, obj):
            payload = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
            self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            self.wfile.flush()

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n))
            ok = body.get("model") == model
            if not ok or not body.get("stream"):
                self._json({"choices": [{"text": "x"}]} if ok else {"error": "bad model"}, 200 if ok else 404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chat = self.path == "/v1/chat/completions"
            if chat:
                self._chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i in range(int(body["max_tokens"])):
                time.sleep(0.005)
                self._chunk({"choices": [{"index": 0, "delta": {"content": "t"}} if chat else {"index": 0, "text": "t"}]})
            self._chunk({"choices": [], "usage": {"completion_tokens": int(body["max_tokens"])}})
            self._chunk("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    class Srv(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request, client_address):
            if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that went away is no server error
                super().handle_error(request, client_address)

    srv = Srv(("127.0.0.1", port), H)

    def stop(*_):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    srv.serve_forever()

elif argv[:2] == ["bench", "serve"]:
    bench_main(make_parser_with_args().parse_args(argv[2:]))
else:
    sys.exit(f"fake vllm: unsupported {argv}")
'''


@pytest.fixture()
def fake_vllm(tmp_path):
    path = tmp_path / "fake_vllm.py"
    path.write_text(FAKE_VLLM)
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); treat it as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _worker_pid(log: Path) -> int:
    for line in log.read_text().splitlines():
        if "fake worker pid=" in line:
            return int(line.rsplit("=", 1)[1])
    raise AssertionError("no worker pid in log")


def test_server_lifecycle_kills_whole_process_group(tmp_path, fake_vllm):
    port = commands.pick_port(free_port())
    cmd = [sys.executable, str(fake_vllm), "serve", "/m", "--port", str(port)]
    log = tmp_path / "srv.log"
    with server.running_server(cmd, server.server_env(configs.SERVER_CONFIGS["yali"]), log, port, "yali", startup_timeout_s=30, stop_grace_s=4) as srv:
        assert srv.alive()
        assert http.http_status(srv.base_url + "/health") == 200
        assert server.warmup_server(srv.base_url, "/m", 3, timeout_s=10) == (3, 0)
        worker = _worker_pid(log)
        assert _pid_alive(worker)
    assert not srv.alive()
    deadline = time.monotonic() + 10
    while _pid_alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pid_alive(worker), "the server's child process outlived stop_server"
    text = log.read_text()
    assert '"NCCL_NVLS_ENABLE": "0"' in text and '"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm"' in text


def test_wait_healthy_fails_fast_with_log_tail(tmp_path, fake_vllm):
    port = commands.pick_port(free_port())
    env = server.server_env(configs.SERVER_CONFIGS["yali"])
    env["FAKE_VLLM_DIE"] = "1"
    srv = server.start_server([sys.executable, str(fake_vllm), "serve", "/m", "--port", str(port)], env, tmp_path / "s.log", port, "yali")
    t0 = time.monotonic()
    try:
        with pytest.raises(commands.ServerError) as ei:
            server.wait_healthy(srv, timeout_s=60)
    finally:
        server.stop_server(srv, grace_s=2)
    assert time.monotonic() - t0 < 20
    assert "fake startup failure" in str(ei.value) and "exited with code 3" in str(ei.value)


def test_wait_healthy_says_what_ended_the_wait(tmp_path, fake_vllm):
    """A server still starting when the wait ends is reported as alive and still starting, with the
    bound that ended the wait (e.g. the run's budget), not as a crash."""
    port = commands.pick_port(free_port())
    env = server.server_env(configs.SERVER_CONFIGS["vllm-default"])
    env["FAKE_VLLM_SLOW_START_S"] = "60"
    srv = server.start_server([sys.executable, str(fake_vllm), "serve", "/m", "--port", str(port)], env, tmp_path / "s.log", port,
                          "vllm-default")
    try:
        with pytest.raises(commands.ServerError) as ei:
            server.wait_healthy(srv, timeout_s=1.5, bound="the run's budget (--budget-s)")
        assert srv.alive()
    finally:
        server.stop_server(srv, grace_s=2)
    msg = str(ei.value)
    assert "still starting (alive, not healthy) after 2s" in msg and "the run's budget (--budget-s)" in msg
    assert "building kernels" in msg  # the log tail shows what it was doing


def test_run_bounded_times_out_and_kills(tmp_path):
    t0 = time.monotonic()
    rc = commands.run_bounded([sys.executable, "-c", "import time; print('hi', flush=True); time.sleep(60)"],
                        env=gpu_env.child_env(), timeout_s=1.5, log_path=tmp_path / "x.log")
    assert rc is None and time.monotonic() - t0 < 20
    assert "hi" in (tmp_path / "x.log").read_text()
    assert commands.run_bounded([sys.executable, "-c", "raise SystemExit(4)"], env=gpu_env.child_env(), timeout_s=20,
                          log_path=tmp_path / "y.log") == 4


def _tiny_model(size, model_dir, quant="none"):
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 131072}
    if quant != "none":
        cfg["quantization_config"] = QUANT_CONFIGS[quant]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return model_dir.resolve()


def test_full_run_with_fake_vllm(tmp_path, fake_vllm, monkeypatch):
    """The whole serving_bench flow (servers, benches, JSON, markdown, plots) against a fake vllm."""
    monkeypatch.setattr(bench_run, "prepare_model", _tiny_model)
    monkeypatch.setattr(bench_run, "install_signal_handlers", lambda: None)
    out = tmp_path / "out"
    monkeypatch.setenv("PYTHONPATH", str(fake_vllm.parent))  # the bench worker imports fake_vllm as its module
    rc = sb.main([
        "--vllm-bin", f"{sys.executable} {fake_vllm}", "--bench-runner", "worker", "--bench-module", "fake_vllm",
        "--model-size", "8b", "--model-dir", str(tmp_path / "model"), "--repeats", "2", "--concurrency", "1,8",
        "--budget-s", "300", "--stop-grace-s", "4", "--startup-timeout-s", "30", "--bench-timeout-s", "30",
        "--port", str(free_port()), "--out", str(out), "--warmup-requests", "2",
        "--estimates-file", str(tmp_path / "estimates.json"),
    ])
    assert rc == 0
    doc = json.loads((out / "serving-benchmark.json").read_text())
    serving_doc_schema_check(doc)
    saved = json.loads((tmp_path / "estimates.json").read_text())  # what the next run plans with
    (times,) = saved.values()
    assert set(times["startup"]) == {"yali", "vllm-default", "nccl"} and set(times["bench"]) == {"c1", "c8"}
    assert all(0 < t < 60 for t in [*times["startup"].values(), *times["bench"].values()])
    assert doc["world_size"] == doc["model"]["tensor_parallel_size"] == len(doc["gpus_used"]) == 2
    assert len(doc["records"]) == 3 * 2 * 2
    assert {r["config"] for r in doc["records"]} == {"yali", "vllm-default", "nccl"}
    assert doc["errors"] == [] and doc["skipped"] == []
    assert doc["workload"]["num_prompts"] == {"1": 8, "8": 32}
    assert len(doc["server_logs"]) == 6
    yali_logs = [s for s in doc["server_logs"] if s["config"] == "yali"]
    assert all(s["yali_on"] for s in yali_logs)
    assert not any(s["yali_on"] for s in doc["server_logs"] if s["config"] != "yali")
    assert all(s["warnings"] == [] for s in doc["server_logs"])
    assert all(any("all-reduce backends" in ln for ln in s["key_lines"]) for s in doc["server_logs"])
    for s in doc["server_logs"]:
        assert (out / s["log_file"]).exists()
        assert not _pid_alive(_worker_pid(out / s["log_file"]))
    point_log = (out / "raw" / "yali-r2-c8.log").read_text()
    assert "$ vllm bench serve --backend vllm" in point_log and "fake bench done" in point_log
    assert "bench worker ready" in (out / "raw" / "bench-worker.log").read_text()
    assert not list((out / "raw").glob("*.done-*"))
    # --save-detailed: where the slowest gaps fall (the fake's first decode gap of every request)
    slow = next(r for r in doc["records"] if r["config"] == "yali" and r["concurrency"] == 8)["slow_gaps"]
    assert slow["gaps"] == 32 * 255 and slow["above_p99"] == {"1": 32, "2-8": 0, "9+": 0}
    md = (out / "serving-benchmark.md").read_text()
    c8 = md.split("## Concurrency 8")[1]
    assert "| yali | 16320 | 64 | 0 | 0 |" in c8  # two repeats
    nccl_row = next(line for line in c8.splitlines() if line.startswith("| nccl |"))
    assert "(better)" in nccl_row  # fake nccl is 30% slower than fake yali
    if importlib.util.find_spec("matplotlib"):
        assert (out / "tpot_p50.png").stat().st_size > 1000 and (out / "itl_p99.png").exists()


def test_a_yali_server_that_logs_off_is_stopped_not_measured(tmp_path, fake_vllm, monkeypatch):
    """A yali configuration whose server says 'YALI all-reduce OFF' would measure vLLM's own
    all-reduce under YALI's name: its server is stopped, its points are not run, and the error names
    the OFF line; the other configurations are measured as usual."""
    monkeypatch.setattr(bench_run, "prepare_model", _tiny_model)
    monkeypatch.setattr(bench_run, "install_signal_handlers", lambda: None)
    monkeypatch.setenv("FAKE_VLLM_YALI_OFF", "1")
    out = tmp_path / "out"
    monkeypatch.setenv("PYTHONPATH", str(fake_vllm.parent))
    rc = sb.main([
        "--vllm-bin", f"{sys.executable} {fake_vllm}", "--bench-runner", "worker", "--bench-module", "fake_vllm",
        "--model-size", "8b", "--model-dir", str(tmp_path / "model"), "--repeats", "2", "--concurrency", "1",
        "--configs", "yali,vllm-default", "--budget-s", "300", "--stop-grace-s", "4", "--startup-timeout-s", "30",
        "--bench-timeout-s", "30", "--port", str(free_port()), "--out", str(out),
    ])
    doc = json.loads((out / "serving-benchmark.json").read_text())
    assert rc != 0 or doc["errors"]
    assert {r["config"] for r in doc["records"]} == {"vllm-default"} and len(doc["records"]) == 2
    errors = [e for e in doc["errors"] if e["config"] == "yali"]
    assert len(errors) == 1 and "YALI all-reduce OFF" in errors[0]["error"] and "_C*.so is missing" in errors[0]["error"]
    assert any(s["config"] == "yali" and s["reason"] == "server failed earlier in this run" for s in doc["skipped"])
    for s in doc["server_logs"]:
        assert not _pid_alive(_worker_pid(out / s["log_file"]))


def test_long_prompt_point_has_its_own_records_table_and_merge(tmp_path, fake_vllm, monkeypatch):
    """--long-prompt-len adds one concurrency-1 point of longer prompts to every server, recorded apart
    from the concurrency points (their tables stay as they are), tabled on its own, kept by a merge."""
    monkeypatch.setattr(bench_run, "prepare_model", _tiny_model)
    monkeypatch.setattr(bench_run, "install_signal_handlers", lambda: None)
    out = tmp_path / "out"
    monkeypatch.setenv("PYTHONPATH", str(fake_vllm.parent))
    common = ["--vllm-bin", f"{sys.executable} {fake_vllm}", "--bench-runner", "worker", "--bench-module", "fake_vllm",
              "--model-size", "8b", "--model-dir", str(tmp_path / "model"), "--concurrency", "1", "--configs", "yali,nccl",
              "--budget-s", "300", "--stop-grace-s", "4", "--startup-timeout-s", "30", "--bench-timeout-s", "30",
              "--warmup-requests", "0", "--random-output-len", "16"]
    with pytest.raises(SystemExit, match="--max-model-len 2048 < input\\+output 4112"):
        sb.main([*common, "--long-prompt-len", "4096", "--out", str(out)])
    rc = sb.main([*common, "--repeats", "2", "--long-prompt-len", "4096", "--long-prompt-count", "3",
                  "--max-model-len", "8192", "--port", str(free_port()), "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "serving-benchmark.json").read_text())
    serving_doc_schema_check(doc)
    assert doc["workload"]["long_prompt"] == {"input_len": 4096, "concurrency": 1, "num_prompts": 3, "seed": 1}
    assert len(doc["records"]) == 4 and all("input_len" not in r for r in doc["records"])
    long_recs = doc[schema.LONG_PROMPT_RECORDS]
    assert sorted((r["config"], r["repeat"]) for r in long_recs) == [("nccl", 1), ("nccl", 2), ("yali", 1), ("yali", 2)]
    assert all(r["input_len"] == 4096 and r["concurrency"] == 1 and r["num_prompts"] == 3 for r in long_recs)
    short_ttft = {r["config"]: r["ttft_ms_p50"] for r in doc["records"]}
    assert all(r["ttft_ms_p50"] == pytest.approx(4 * short_ttft[r["config"]], rel=0.01) for r in long_recs)
    md = (out / "serving-benchmark.md").read_text()
    long_md = md.split("## Long prompts: input 4096 tokens, concurrency 1")[1]
    assert "(better)" in next(line for line in long_md.splitlines() if line.startswith("| nccl |"))
    assert "Verdicts at the 4096-token prompts" in long_md and "yali vs this (TTFT p50 (ms))" in long_md
    merged = tmp_path / "merged"
    path = out / "serving-benchmark.json"
    assert sb.main(["--report-only", str(path), str(path), "--out", str(merged)]) == 0
    mdoc = json.loads((merged / "serving-benchmark.json").read_text())
    assert sorted(r["repeat"] for r in mdoc[schema.LONG_PROMPT_RECORDS] if r["config"] == "yali") == [1, 2, 3, 4]
    assert "## Long prompts" in (merged / "serving-benchmark.md").read_text()


def test_long_prompt_report_alone_per_length_and_renumbered_by_a_merge(tmp_path):
    """A result whose only records are long-prompt ones is a result (not "no point completed"); a
    merge of runs with different long-prompt lengths tables each length apart, with TTFT as the
    headline, and renumbers repeats known only from long-prompt records."""
    def long_rec(cfg, rep, n, ttft):
        return {"config": cfg, "concurrency": 1, "repeat": rep, "input_len": n, "ttft_ms_p50": ttft,
                "tpot_ms_p50": 4.0, "failed": 0}

    docs = []
    for n, ttft in ((2048, 40.0), (4096, 70.0)):
        recs = [long_rec("yali", 1, n, ttft), long_rec("nccl", 1, n, ttft * 1.3)]
        docs.append(results.results_header(schema.KIND, {"model": {"size": "8b"}, "workload": {}, "records": [],
                                                         schema.LONG_PROMPT_RECORDS: recs,
                                                         "skipped": [{"config": "yali", "repeat": 1, "concurrency": 1,
                                                                      "point": "long", "reason": "budget"}]}))
    md = report.render_markdown(docs[0])
    assert "No benchmark point completed" not in md and "## Long prompts: input 2048 tokens" in md
    assert "- skipped: yali r1 long prompts: budget" in md
    merged = report.merge_results(docs, ["a.json", "b.json"])
    assert sorted((r["config"], r["repeat"]) for r in merged[schema.LONG_PROMPT_RECORDS]) == [
        ("nccl", 1), ("nccl", 2), ("yali", 1), ("yali", 2)]
    md = report.render_markdown(merged)
    t2048 = md.split("## Long prompts: input 2048 tokens, concurrency 1")[1].split("## ")[0]
    t4096 = md.split("## Long prompts: input 4096 tokens, concurrency 1")[1].split("## ")[0]
    assert "yali vs this (TTFT p50 (ms))" in t2048 and "| 40.0 |" in t2048 and "70.0" not in t2048
    assert "| 70.0 |" in t4096 and "40.0" not in t4096


def test_budget_exhausted_still_writes_results(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setattr(bench_run, "prepare_model", _tiny_model)
    monkeypatch.setattr(bench_run, "install_signal_handlers", lambda: None)
    out = tmp_path / "out"
    rc = sb.main(["--vllm-bin", f"{sys.executable} {fake_vllm}", "--bench-runner", "cli", "--model-dir", str(tmp_path / "m"), "--budget-s", "5",
                  "--out", str(out), "--port", str(free_port())])
    assert rc == 1
    doc = json.loads((out / "serving-benchmark.json").read_text())
    assert doc["records"] == [] and len(doc["skipped"]) == 6
    assert "No benchmark point completed" in (out / "serving-benchmark.md").read_text()


def test_report_only_regenerates_table(tmp_path):
    recs = make_records({("yali", 1): [5.0, 5.1], ("nccl", 1): [6.0, 6.1]})
    doc = results.results_header(schema.KIND, {"model": {"size": "8b"}, "workload": {}, "records": recs})
    path = results.write_results(tmp_path / "serving-benchmark.json", doc)
    assert sb.main(["--report-only", str(path)]) == 0
    md = (tmp_path / "serving-benchmark.md").read_text()
    assert "## Concurrency 1" in md and "| nccl |" in md
    other = tmp_path / "elsewhere"
    assert sb.main(["--report-only", str(path), "--out", str(other)]) == 0
    assert (other / "serving-benchmark.md").exists()


def test_plots_written(tmp_path):
    pytest.importorskip("matplotlib")
    recs = make_records({(c, k): [5.0 + k / 10, 5.1 + k / 10] for c in ("yali", "vllm-default", "nccl") for k in (1, 8, 32)})
    paths = report.write_plots({"records": recs, "model": {"size": "8b"}, "host": "h"}, tmp_path)
    assert [p.name for p in paths] == ["tpot_p50.png", "itl_p99.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("tp", [4, 8])
def test_dry_run_at_tensor_parallel_n_serves_every_config_at_n(tmp_path, tp):
    cp = subprocess.run([sys.executable, "-m", "benchmarks.serving_bench", "--dry-run", "--model-size", "70b",
                         "--world-size", str(tp), "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                        timeout=60)
    assert cp.returncode == 0, cp.stderr
    lines = [ln for ln in cp.stdout.splitlines() if " vllm serve " in ln]
    assert len(lines) == 6 and all(f"--tensor-parallel-size {tp} " in ln for ln in lines)


def test_serving_refuses_a_tensor_parallel_size_the_model_does_not_split():
    for size in ("8b", "70b"):
        for tp in (2, 4, 8):
            assert model.tensor_parallel_refusal(size, tp) is None
        assert "does not split over 6 tensor-parallel ranks" in model.tensor_parallel_refusal(size, 6)
    args = sb.build_parser().parse_args(["--world-size", "6"])
    with pytest.raises(SystemExit, match=r"--world-size 6: the 70b model \(64 attention heads, 8 KV heads"):
        bench_run.validate_args(args)
    with pytest.raises(SystemExit, match="--world-size 6"):
        sb.main(["--dry-run", "--world-size", "6", "--model-size", "8b"])


def test_the_serving_report_names_the_tensor_parallel_size(tmp_path):
    recs = make_records({("yali", 1): [5.0, 5.1], ("nccl", 1): [6.0, 6.1]})
    old = {"model": {"size": "70b"}, "records": recs}  # written before world_size was recorded
    assert report.render_markdown(old).startswith("# Serving benchmark, TP=2: yali vs vLLM all-reduce paths")
    doc = {"model": {"size": "70b", "tensor_parallel_size": 8}, "world_size": 8, "records": recs}
    assert report.render_markdown(doc).startswith("# Serving benchmark, TP=8: ")
    with pytest.raises(SystemExit, match="different tensor-parallel sizes: a.json TP=2, b.json TP=8"):
        report.merge_results([old, doc], ["a.json", "b.json"])


def test_dry_run_prints_commands(tmp_path):
    cp = subprocess.run([sys.executable, "-m", "benchmarks.serving_bench", "--dry-run", "--model-size", "8b",
                         "--repeats", "2", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    lines = [ln for ln in cp.stdout.splitlines() if " vllm serve " in ln]
    assert [ln.split("YALI_ENABLE=")[1][0] for ln in lines] == ["1", "0", "0", "1", "0", "0"]
    assert all("NCCL_NVLS_ENABLE=0" in ln for ln in lines)
    assert cp.stdout.count("vllm bench serve") == 18
    assert not any(tmp_path.iterdir())  # dry run writes nothing


# ------------------------------------------------------------------------ --help
@pytest.mark.parametrize("module", ["serving_bench", "load_test"])
def test_help_runs(module):
    cp = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert "--budget-s" in cp.stdout and "--model-size" in cp.stdout


def test_load_test_dry_run_soak():
    cp = subprocess.run([sys.executable, "-m", "benchmarks.load_test", "--dry-run", "--soak", "--model-size", "8b"],
                        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert "YALI_ENABLE=1" in cp.stdout and "YALI_ENABLE=0" not in cp.stdout
    assert "-u 64" in cp.stdout and "-t 120s" in cp.stdout and "--headless" in cp.stdout and "--only-summary" in cp.stdout


# ------------------------------------------------------------- locust CSV -> row
# locust's requests CSV header (locust.stats.StatsCSV.requests_csv_columns with the
# default PERCENTILES_TO_REPORT), as written by `locust --csv PREFIX` to PREFIX_stats.csv
LOCUST_STATS_COLUMNS = [
    "Type", "Name", "Request Count", "Failure Count", "Median Response Time", "Average Response Time",
    "Min Response Time", "Max Response Time", "Average Content Size", "Requests/s", "Failures/s",
    "50%", "66%", "75%", "80%", "90%", "95%", "98%", "99%", "99.9%", "99.99%", "100%",
]


def write_locust_stats(path: Path, rows: list[list]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(LOCUST_STATS_COLUMNS)
        w.writerows(rows)


def test_locust_csv_to_row(tmp_path):
    p = tmp_path / "locust-yali_stats.csv"
    write_locust_stats(p, [
        ["ITL", "stream", 40000, 0, 7, 7.2, 5, 40, 0, 666.6, 0.0, 7, 7, 8, 8, 8, 9, 11, 13, 25, 38, 40],
        ["POST", "/v1/chat/completions", 310, 1, 600, 610, 400, 1200, 250, 5.17, 0.02, 600, 620, 640, 650, 700, 800, 900, 1000, 1200, 1200, 1200],
        ["POST", "/v1/completions", 320, 2, 590, 600, 400, 1100, 260, 5.33, 0.03, 590, 610, 630, 640, 690, 790, 880, 990, 1100, 1100, 1100],
        ["GET", "/v1/models", 64, 0, 11, 10.2, 8, 20, 120, 0.53, 0.0, 11, 11, 12, 12, 14, 16, 18, 20, 20, 20, 20],
        ["TTFT", "stream", 630, 0, 95, 101, 40, 400, 0, 10.5, 0.0, 95, 100, 110, 120, 150, 200, 260, 310, 400, 400, 400],
        ["", "Aggregated", 41260, 3, 7, 22, 5, 1200, 4, 687.6, 0.05, 7, 7, 8, 8, 9, 11, 95, 600, 990, 1200, 1200],
    ])
    row = locust.locust_csv_to_row(p, "yali", 64, 120)
    assert {k: row[k] for k in locust.ROW_KEYS} == {
        "config": "yali", "users": 64, "duration_s": 120.0, "requests": 630, "failures": 3,
        "ttft_ms_p50": 95.0, "ttft_ms_p99": 310.0, "itl_ms_p50": 7.0, "itl_ms_p99": 13.0,
    }
    assert row["req_s"] == pytest.approx(10.5) and row["itl_events"] == 40000


def test_locust_csv_to_row_no_requests(tmp_path):
    p = tmp_path / "s.csv"
    write_locust_stats(p, [["", "Aggregated", 0, 0, 0, 0, 0, 0, 0, 0, 0, *["N/A"] * 11]])
    row = locust.locust_csv_to_row(p, "yali", 1, 5)
    assert row["requests"] == 0 and row["ttft_ms_p50"] is None and row["itl_ms_p99"] is None


def test_soak_verdict():
    ok = {"requests": 10, "failures": 0}
    assert locust.soak_verdict(ok, {"error_count": 0}, 0) == {"pass": True, "reasons": []}
    v = locust.soak_verdict({"requests": 10, "failures": 2}, {"error_count": 1}, None)
    assert not v["pass"] and len(v["reasons"]) == 3
    assert not locust.soak_verdict({"requests": 0, "failures": 0}, {"error_count": 0}, 0)["pass"]
    v = locust.soak_verdict(ok, {"error_count": 0}, 0, yali_on=False)
    assert not v["pass"] and "YALI" in v["reasons"][0]


def test_load_test_merge(tmp_path):
    """--merge: rows of separate runs in one table, each naming its source; logs stay findable;
    runs with other locust settings are refused."""
    def run_doc(name, cfg, users=32, mode="comparison"):
        row = {"config": cfg, "users": users, "duration_s": 30.0, "requests": 400, "failures": 0, "req_s": 13.3,
               "ttft_ms_p50": 180.0, "ttft_ms_p99": 300.0, "itl_ms_p50": 22.0, "itl_ms_p99": 100.0}
        doc = results.results_header(locust.KIND, {
            "mode": mode, "model": {"size": "70b"},
            "locust": {"users": users, "spawn_rate": users / 4, "duration_s": 30, "max_tokens": 64},
            "records": [row], "errors": [{"config": cfg, "error": "x"}] if cfg == "nccl" else [],
            "server_logs": [{"config": cfg, "log_file": f"server-logs/{cfg}-r1.log", "error_count": 0}]})
        return results.write_results(tmp_path / name / "load-test.json", doc)

    a, b = run_doc("run-a", "nccl"), run_doc("run-b", "yali")
    out = tmp_path / "merged"
    assert load_test.main(["--merge", str(a), str(b), "--out", str(out)]) == 0
    doc = json.loads((out / "load-test.json").read_text())
    assert [(r["config"], r["source"]) for r in doc["records"]] == [
        ("nccl", "../run-a/load-test.json"), ("yali", "../run-b/load-test.json")]
    assert [s["log_file"] for s in doc["server_logs"]] == ["../run-a/server-logs/nccl-r1.log", "../run-b/server-logs/yali-r1.log"]
    assert doc["errors"] == [{"config": "nccl", "error": "x", "source": "../run-a/load-test.json"}]
    md = (out / "load-test.md").read_text()
    assert "| nccl | 32 |" in md and "| yali | 32 |" in md and "merged from:" in md
    other = run_doc("run-c", "vllm-default", users=64)
    with pytest.raises(SystemExit, match="not comparable"):
        load_test.main(["--merge", str(a), str(other), "--out", str(tmp_path / "bad")])
    with pytest.raises(SystemExit):
        load_test.main(["--merge", str(a)])  # --out is required


def test_locust_columns_match_installed_locust():
    if importlib.util.find_spec("locust") is None:
        pytest.skip("locust not installed")
    # in a subprocess: importing locust monkey-patches the interpreter (gevent)
    code = ("import json; from locust.stats import StatsCSV, PERCENTILES_TO_REPORT; "
            "print(json.dumps(StatsCSV(None, PERCENTILES_TO_REPORT).requests_csv_columns))")
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout.strip().splitlines()[-1]) == LOCUST_STATS_COLUMNS


# --------------------------------------------------------------------- locustfile
def test_locustfile_imports():
    if importlib.util.find_spec("locust") is None:
        pytest.skip("locust not installed")
    code = textwrap.dedent(
        f"""
        import importlib.util, json
        spec = importlib.util.spec_from_file_location("lf", {str(BENCH / "locustfile.py")!r})
        m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
        from locust import User
        users = sorted(n for n, v in vars(m).items() if isinstance(v, type) and issubclass(v, User) and not v.abstract)
        print(json.dumps({{"users": users, "max_tokens": m.MAX_TOKENS, "words": m.PROMPT_WORDS}}))
        """
    )
    env = dict(os.environ, LOAD_MAX_TOKENS="100000", LOAD_PROMPT_WORDS="7", LOAD_COMPLETIONS_WEIGHT="0")
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert cp.returncode == 0, cp.stderr
    out = json.loads(cp.stdout.strip().splitlines()[-1])
    assert out == {"users": ["ChatCompletionsUser"], "max_tokens": 4096, "words": 7}


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Streams like vLLM: chunked SSE, a role chunk first for chat, usage, [DONE].
    /v1/completions answers with an empty completion, so every such request must fail."""

    protocol_version = "HTTP/1.1"
    model = "fake-model"
    token_delay_s = 0.02

    def log_message(self, *a):
        pass

    def _send_json(self, obj, code=200):
        b = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send_json({"object": "list", "data": [{"id": self.model, "root": self.model}]})
        else:
            self._send_json({"error": "nf"}, 404)

    def _chunk(self, obj):
        data = obj if isinstance(obj, str) else json.dumps(obj)
        payload = f"data: {data}\n\n".encode()
        self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
        self.wfile.flush()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        if body.get("model") != self.model or not body.get("stream"):
            self._send_json({"error": "bad request"}, 400)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = int(body["max_tokens"])
        if self.path == "/v1/chat/completions":
            time.sleep(self.token_delay_s)
            self._chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i in range(n):
                if i:
                    time.sleep(self.token_delay_s)
                self._chunk({"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]})
            self._chunk({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": n}})
        else:
            self._chunk({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 0}})
        self._chunk("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def test_locust_end_to_end_against_fake_server(tmp_path):
    """locust + locustfile.py against a fake streaming server: TTFT/ITL rows land in the
    CSV stats, the model is discovered from /v1/models, empty completions are failures."""
    if importlib.util.find_spec("locust") is None:
        pytest.skip("locust not installed")
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        port = srv.server_address[1]
        cmd = locust.locust_command(f"{sys.executable} -m locust", users=4, spawn_rate=4, duration_s=4,
                                       host=f"http://127.0.0.1:{port}", csv_prefix=tmp_path / "l", html=tmp_path / "l.html",
                                       stop_timeout_s=5)
        env = gpu_env.child_env({"LOAD_MAX_TOKENS": "6", "LOAD_PROMPT_WORDS": "16"})
        env.pop("LOAD_MODEL", None)
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    finally:
        srv.shutdown()
    assert (tmp_path / "l_stats.csv").exists(), cp.stderr[-2000:]
    assert (tmp_path / "l.html").exists()
    stats = {(r["Type"], r["Name"]): r for r in locust.read_locust_stats(tmp_path / "l_stats.csv")}
    chat = stats[("POST", "/v1/chat/completions")]
    comp = stats[("POST", "/v1/completions")]
    assert int(chat["Request Count"]) > 0 and int(chat["Failure Count"]) == 0
    assert int(comp["Request Count"]) > 0 and int(comp["Failure Count"]) == int(comp["Request Count"])
    row = locust.locust_csv_to_row(tmp_path / "l_stats.csv", "fake", 4, 4)
    assert row["failures"] == int(comp["Request Count"])
    n_chat = int(chat["Request Count"])
    assert row["requests"] == n_chat + int(comp["Request Count"])  # POST rows only (not GET /v1/models)
    # one TTFT per chat stream; a stream still open when locust stops at -t has a TTFT but no POST row
    assert n_chat <= row["ttft_events"] <= n_chat + 4
    assert 5 * n_chat <= row["itl_events"] <= 5 * row["ttft_events"]  # 6 tokens -> 5 gaps
    assert 10 <= row["itl_ms_p50"] <= 80  # the fake server's 20 ms token gap, measured per chunk
    assert 10 <= row["ttft_ms_p50"] <= 200
    failures = locust.locust_failures(tmp_path / "l_failures.csv")
    assert any("empty completion" in f["Error"] for f in failures)


def test_a_missing_tool_stops_the_run_before_any_server_starts(tmp_path, fake_vllm, monkeypatch):
    """A locust that is neither on PATH nor importable by this python ends load_test.py with a
    message naming it and --locust-bin, before the model is written or a server starts (which
    would cost a GPU host minutes for a run that cannot measure anything)."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "locust" else real_find_spec(name, *a))
    monkeypatch.setattr(load_test, "prepare_model", lambda *a: pytest.fail("the model was written"))
    monkeypatch.setattr(load_test, "install_signal_handlers", lambda: None)
    with pytest.raises(SystemExit) as ei:
        load_test.main(["--soak", "--vllm-bin", f"{sys.executable} {fake_vllm}", "--locust-bin", "yali-no-such-locust",
                        "--model-dir", str(tmp_path / "m"), "--out", str(tmp_path / "soak"), "--port", str(free_port())])
    msg = str(ei.value.code)
    assert "'yali-no-such-locust' is not on PATH" in msg and "cannot import 'locust'" in msg and "--locust-bin" in msg
    assert not (tmp_path / "soak").exists()
    assert commands.resolve_command("yali-no-such-locust", "json.tool", "--x") == shlex.join([sys.executable, "-m", "json.tool"])


def test_load_test_soak_with_fake_vllm(tmp_path, fake_vllm, monkeypatch):
    """load_test.py --soak end to end: fake vllm server + real locust, verdict PASS, files kept."""
    if importlib.util.find_spec("locust") is None:
        pytest.skip("locust not installed")
    monkeypatch.setattr(load_test, "prepare_model", _tiny_model)
    monkeypatch.setattr(load_test, "install_signal_handlers", lambda: None)
    out = tmp_path / "soak"
    rc = load_test.main([
        "--soak", "--users", "4", "--duration-s", "3", "--max-tokens", "5", "--prompt-words", "8",
        "--vllm-bin", f"{sys.executable} {fake_vllm}", "--locust-bin", f"{sys.executable} -m locust",
        "--model-dir", str(tmp_path / "m"), "--budget-s", "200", "--stop-grace-s", "4", "--port", str(free_port()),
        "--out", str(out), "--warmup-requests", "1",
    ])
    doc = json.loads((out / "load-test.json").read_text())
    assert rc == 0, doc
    assert doc["kind"] == "load-test" and doc["mode"] == "soak"
    for k in ("kind", "date", "command", "host", "versions", "records"):
        assert k in doc
    assert [r["config"] for r in doc["records"]] == ["yali"]
    row = doc["records"][0]
    assert all(k in row for k in locust.ROW_KEYS)
    assert row["users"] == 4 and row["duration_s"] == 3 and row["requests"] > 0 and row["failures"] == 0
    assert row["itl_ms_p50"] is not None and row["ttft_ms_p50"] is not None
    assert doc["verdict"] == {"pass": True, "reasons": []}
    for f in ("locust-yali_stats.csv", "locust-yali_failures.csv", "locust-yali.html", "load-test.md", "server-logs/yali.log"):
        assert (out / f).exists(), f
    assert "Soak verdict: PASS" in (out / "load-test.md").read_text()


def test_cli_bench_runner_with_fake_vllm(tmp_path, fake_vllm, monkeypatch):
    """--bench-runner cli: one `vllm bench serve` process per point."""
    monkeypatch.setattr(bench_run, "prepare_model", _tiny_model)
    monkeypatch.setattr(bench_run, "install_signal_handlers", lambda: None)
    out = tmp_path / "out"
    rc = sb.main(["--vllm-bin", f"{sys.executable} {fake_vllm}", "--bench-runner", "cli", "--configs", "yali,nccl",
                  "--repeats", "1", "--concurrency", "4", "--model-dir", str(tmp_path / "m"), "--budget-s", "120",
                  "--stop-grace-s", "4", "--out", str(out), "--port", str(free_port()), "--warmup-requests", "0"])
    assert rc == 0
    doc = json.loads((out / "serving-benchmark.json").read_text())
    assert [(r["config"], r["concurrency"]) for r in doc["records"]] == [("yali", 4), ("nccl", 4)]
    assert doc["workload"]["bench_runner"] == "cli"
    assert "fake bench done" in (out / "raw" / "nccl-r1-c4.log").read_text()


def test_worker_bench_runner_timeout_and_restart(tmp_path, monkeypatch):
    """A job that runs past its timeout kills the worker's process group; the next job gets a fresh worker."""
    (tmp_path / "slowbench.py").write_text(textwrap.dedent(
        """
        import argparse, time
        def make_parser():
            return argparse.ArgumentParser()
        def add_cli_args(p):
            p.add_argument("--sleep", type=float)
        def main(args):
            print("sleeping", args.sleep, flush=True)
            time.sleep(args.sleep)
        """
    ))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    runner = runners.WorkerBenchRunner(sys.executable, gpu_env.child_env(), tmp_path / "w.log", "slowbench")
    runner.start()
    try:
        first = runner.proc
        assert runner.run(["--sleep", "0"], tmp_path / "a.log", timeout_s=60) == 0
        assert "sleeping 0.0" in (tmp_path / "a.log").read_text()
        t0 = time.monotonic()
        assert runner.run(["--sleep", "60"], tmp_path / "b.log", timeout_s=1.5) is None
        assert time.monotonic() - t0 < 20 and runner.proc is None and first.poll() is not None
        assert runner.run(["--bogus"], tmp_path / "c.log", timeout_s=60) == 2  # argparse error -> exit code 2
        assert runner.run(["--sleep", "0"], tmp_path / "d.log", timeout_s=60) == 0
    finally:
        runner.close()
    assert runner.proc is None


def test_report_only_merges_runs(tmp_path):
    """Two runs with --repeats 1 each, merged: repeats renumbered, verdicts available."""
    paths = []
    for i, (y, n) in enumerate(((5.00, 6.00), (5.02, 6.03))):
        recs = make_records({("yali", 1): [y], ("nccl", 1): [n]})
        logs = [{"config": "yali", "repeat": 1, "log_file": "server-logs/yali-r1.log", "key_lines": [], "error_count": 0},
                {"config": "nccl", "repeat": 1, "log_file": "server-logs/nccl-r1.log", "key_lines": [], "error_count": 0}]
        for r in recs:
            r["result_file"] = f"raw/{r['config']}-r1-c{r['concurrency']}.json"
        errors = [{"config": "nccl", "repeat": 1, "concurrency": 32, "error": "vllm bench serve timed out"}] if i else []
        doc = results.results_header(schema.KIND, {"model": {"size": "70b"}, "workload": {}, "records": recs, "server_logs": logs,
                                                "errors": errors, "skipped": []})
        paths.append(results.write_results(tmp_path / f"run{i}" / "serving-benchmark.json", doc))
    out = tmp_path / "merged"
    assert sb.main(["--report-only", *map(str, paths), "--out", str(out)]) == 0
    merged = json.loads((out / "serving-benchmark.json").read_text())
    serving_doc_schema_check(merged)
    assert sorted((r["config"], r["repeat"]) for r in merged["records"]) == [("nccl", 1), ("nccl", 2), ("yali", 1), ("yali", 2)]
    assert sorted((s["config"], s["repeat"]) for s in merged["server_logs"]) == [("nccl", 1), ("nccl", 2), ("yali", 1), ("yali", 2)]
    # files the sources name stay findable from the merged result's directory
    assert merged["merged_from"] == ["../run0/serving-benchmark.json", "../run1/serving-benchmark.json"]
    assert {s["log_file"] for s in merged["server_logs"] if s["repeat"] == 2} == {
        "../run1/server-logs/yali-r1.log", "../run1/server-logs/nccl-r1.log"}
    assert all(r["result_file"].startswith(f"../run{r['repeat'] - 1}/raw/") for r in merged["records"])
    assert merged["errors"] == [{"config": "nccl", "repeat": 2, "concurrency": 32, "error": "vllm bench serve timed out",
                                 "source": "../run1/serving-benchmark.json"}]
    md = (out / "serving-benchmark.md").read_text()
    assert "- error: nccl r2 c=32 (`../run1/serving-benchmark.json`)" in md
    nccl_row = next(line for line in md.splitlines() if line.startswith("| nccl |"))
    assert "| 2 |" in nccl_row and "(better)" in nccl_row


def test_merge_backfills_the_mean_tpot_and_ttft_from_kept_result_files(tmp_path):
    """Records written before tpot_ms_mean / ttft_ms_mean existed get them in a merge from their kept
    raw file; a record whose raw file is gone keeps None, and the markdown shows the columns."""
    paths = []
    for i, (mean_y, mean_n) in enumerate(((5.40, 6.40), (5.44, 6.42))):
        recs = make_records({("yali", 32): [5.0 + i / 100], ("nccl", 32): [6.0 + i / 100]})
        for r, mean in zip(recs, (mean_y, mean_n)):
            del r["tpot_ms_mean"], r["ttft_ms_mean"]  # as written before the keys existed
            r["result_file"] = f"raw/{r['config']}-r1-c32.json"
            res = vllm_bench_result(concurrency=32)
            res["mean_tpot_ms"], res["mean_ttft_ms"] = mean, 20 * mean
            if not (i == 1 and r["config"] == "nccl"):  # this one's raw file was not kept
                (tmp_path / f"run{i}" / "raw").mkdir(parents=True, exist_ok=True)
                (tmp_path / f"run{i}" / r["result_file"]).write_text(json.dumps(res))
        doc = results.results_header(schema.KIND, {"model": {"size": "70b"}, "workload": {}, "records": recs,
                                                "server_logs": [], "errors": [], "skipped": []})
        paths.append(results.write_results(tmp_path / f"run{i}" / "serving-benchmark.json", doc))
    out = tmp_path / "merged"
    assert sb.main(["--report-only", *map(str, paths), "--out", str(out)]) == 0
    merged = json.loads((out / "serving-benchmark.json").read_text())
    means = {(r["config"], r["repeat"]): r.get("tpot_ms_mean") for r in merged["records"]}
    assert means == {("yali", 1): 5.40, ("nccl", 1): 6.40, ("yali", 2): 5.44, ("nccl", 2): None}
    ttfts = {(r["config"], r["repeat"]): r.get("ttft_ms_mean") for r in merged["records"]}
    assert ttfts.pop(("nccl", 2)) is None  # its raw file was not kept
    assert ttfts == pytest.approx({("yali", 1): 108.0, ("nccl", 1): 128.0, ("yali", 2): 108.8})
    md = (out / "serving-benchmark.md").read_text()
    assert "TPOT mean (ms)" in md and "TTFT mean (ms)" in md
    yali_row = next(line for line in md.splitlines() if line.startswith("| yali | 2 |"))
    assert "5.420 ± 0.020" in yali_row
    # a fresh parse carries it too
    res = vllm_bench_result()
    res["mean_tpot_ms"], res["mean_ttft_ms"] = 5.33, 101.5
    rec = schema.make_record("yali", 8, 1, schema.parse_bench_result(res))
    assert rec["tpot_ms_mean"] == 5.33 and rec["ttft_ms_mean"] == 101.5


def test_locust_and_soak_on_the_benchmark_servers(tmp_path, fake_vllm, monkeypatch):
    """--locust-users / --soak-s: locust runs on the servers serving_bench started, after their
    points (no extra server start): a load-test row per config, the yali soak with its verdict."""
    if importlib.util.find_spec("locust") is None:
        pytest.skip("locust not installed")
    monkeypatch.setattr(bench_run, "prepare_model", _tiny_model)
    monkeypatch.setattr(bench_run, "install_signal_handlers", lambda: None)
    out = tmp_path / "out"
    rc = sb.main([
        "--vllm-bin", f"{sys.executable} {fake_vllm}", "--bench-runner", "cli", "--configs", "yali,nccl",
        "--repeats", "1", "--concurrency", "1", "--model-size", "8b", "--model-dir", str(tmp_path / "m"),
        "--locust-users", "2", "--locust-duration-s", "3", "--soak-s", "3", "--soak-users", "3",
        "--locust-bin", f"{sys.executable} -m locust", "--budget-s", "300", "--stop-grace-s", "4",
        "--port", str(free_port()), "--out", str(out), "--warmup-requests", "1",
    ])
    assert rc == 0
    load = json.loads((out / "load-test.json").read_text())
    assert load["kind"] == "load-test" and load["mode"] == "comparison"
    assert [r["config"] for r in load["records"]] == ["yali", "nccl"]
    assert all(r["users"] == 2 and r["requests"] > 0 and r["failures"] == 0 for r in load["records"])
    assert {s["config"] for s in load["server_logs"]} == {"yali", "nccl"}
    soak = json.loads((out / "soak.json").read_text())
    assert soak["mode"] == "soak" and [r["config"] for r in soak["records"]] == ["yali"]
    assert soak["records"][0]["users"] == 3 and soak["verdict"] == {"pass": True, "reasons": []}
    for f in ("locust-comparison-yali_stats.csv", "locust-comparison-nccl.html", "locust-soak-yali_stats.csv",
              "load-test.md", "soak.md"):
        assert (out / f).exists(), f
    assert "Soak verdict: PASS" in (out / "soak.md").read_text()
    serving = json.loads((out / "serving-benchmark.json").read_text())
    assert len(serving["records"]) == 2 and serving["errors"] == []


def test_soak_needs_the_yali_config():
    with pytest.raises(SystemExit, match="soak"):
        sb.main(["--dry-run", "--configs", "nccl", "--soak-s", "10"])


def test_default_model_dir_is_per_user():
    d = model.default_model_dir("8b")
    assert d.parent == Path(tempfile.gettempdir()) and d.name == f"yali-serving-model-8b-{os.getuid()}"


# ------------------------------------------- data + expert parallel configurations (MoE)
def test_dp_ep_configs_serve_the_moe_model_data_and_expert_parallel():
    from benchmarks.serving.configs import SERVER_CONFIGS
    from benchmarks.serving.server import server_command

    for name in ("yali-ep", "vllm-ep"):
        cfg = SERVER_CONFIGS[name]
        cmd = server_command("vllm", "/m", cfg, 8100, tensor_parallel_size=4)
        i = cmd.index("--data-parallel-size")
        assert cmd[i + 1] == "4" and "--enable-expert-parallel" in cmd and "--tensor-parallel-size" not in cmd
    assert SERVER_CONFIGS["yali-ep"].env["YALI_EP"] == "1" and SERVER_CONFIGS["vllm-ep"].env["YALI_ENABLE"] == "0"
    assert "--tensor-parallel-size" in server_command("vllm", "/m", SERVER_CONFIGS["yali"], 8100)


def test_dp_ep_configs_need_a_moe_model_size():
    from benchmarks.serving.bench_run import validate_args
    from benchmarks.serving_bench import build_parser

    args = build_parser().parse_args(["--configs", "yali-ep,vllm-ep", "--model-size", "8b"])
    with pytest.raises(SystemExit, match="--model-size must be one of"):
        validate_args(args)
    args = build_parser().parse_args(["--configs", "yali-ep,vllm-ep,yali", "--model-size", "qwen3-30b-a3b"])
    assert validate_args(args) == ["yali-ep", "vllm-ep", "yali"]


def test_ep_log_warnings_follow_the_config():
    from benchmarks.serving.logs import yali_log_warnings

    on = ["YALI EP ON for group 'ep:0' (rank 0 of 2): ...",
          "YALI EP: first dispatch on group 'ep:0' served by YALI (tokens per rank [1, 1])",
          "YALI EP: first combine on group 'ep:0' served by YALI (tokens per rank [1, 1])"]
    assert yali_log_warnings("yali-ep", on) == []
    assert any("no MoE combine served by YALI" in w for w in yali_log_warnings("yali-ep", on[:2]))
    assert any("no 'YALI EP ON'" in w for w in yali_log_warnings("yali-ep", []))
    assert yali_log_warnings("vllm-ep", []) == []
    assert any("did not keep it off" in w for w in yali_log_warnings("vllm-ep", on))


# ------------------------------------------------------------------------ FP8 models (--quant)
def test_an_fp8_run_serves_the_quantised_model_and_names_it(tmp_path, fake_vllm, monkeypatch):
    """--quant fp8-static: the model directory the servers load carries the quantization_config
    (the real yali-vllm-model writer), and the result file's model summary and report name it."""
    pytest.importorskip("mistral_common")
    monkeypatch.setattr(bench_run, "install_signal_handlers", lambda: None)
    out, model_dir = tmp_path / "out", tmp_path / "m"
    rc = sb.main(["--vllm-bin", f"{sys.executable} {fake_vllm}", "--bench-runner", "cli", "--configs", "yali",
                  "--quant", "fp8-static", "--model-size", "8b", "--repeats", "1", "--concurrency", "1",
                  "--model-dir", str(model_dir), "--budget-s", "120", "--stop-grace-s", "4", "--out", str(out),
                  "--port", str(free_port()), "--warmup-requests", "0"])
    assert rc == 0
    assert json.loads((model_dir / "config.json").read_text())["quantization_config"] == QUANT_CONFIGS["fp8-static"]
    doc = json.loads((out / "serving-benchmark.json").read_text())
    serving_doc_schema_check(doc)
    assert doc["model"]["quantization"] == "fp8-static" and doc["model"]["hidden_size"] == 4096
    assert [(r["config"], r["concurrency"]) for r in doc["records"]] == [("yali", 1)]
    md = (out / "serving-benchmark.md").read_text()
    assert md.startswith("# Serving benchmark, TP=2, fp8-static: ") and "quantization=fp8-static" in md


@pytest.mark.parametrize("quant", QUANT_CHOICES)
def test_model_summary_names_the_quantisation_of_the_loaded_config(quant, tmp_path):
    d = _tiny_model("8b", tmp_path / "m", quant)
    assert model.model_summary(d, "8b")["quantization"] == quant


def test_model_summary_of_another_quantization_config_says_other(tmp_path):
    d = _tiny_model("8b", tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {**QUANT_CONFIGS["fp8-block"], "weight_block_size": [64, 64]}
    (d / "config.json").write_text(json.dumps(cfg))
    assert model.model_summary(d, "8b")["quantization"] == "other: fp8"
    assert "quantization" not in model.model_summary(tmp_path / "missing", "8b")  # no config: nothing claimed


def test_each_quantisation_has_its_own_default_model_dir():
    dirs = {q: model.default_model_dir("70b", q) for q in QUANT_CHOICES}
    assert dirs["none"] == model.default_model_dir("70b")
    assert dirs["fp8-block"].name == f"yali-serving-model-70b-fp8-block-{os.getuid()}"
    assert len(set(dirs.values())) == len(QUANT_CHOICES)


def test_quantised_runs_plan_with_their_own_estimates_and_refuse_moe_sizes(capsys):
    keys = {q: bench_run.estimates_key(sb.build_parser().parse_args(["--quant", q])) for q in QUANT_CHOICES}
    assert len(set(keys.values())) == len(QUANT_CHOICES) and " fp8-dynamic " in keys["fp8-dynamic"]
    args = sb.build_parser().parse_args(["--quant", "fp8-block", "--model-size", "mixtral-8x7b", "--configs", "yali-ep"])
    with pytest.raises(SystemExit, match="--quant fp8-block: quantisation 'fp8-block' is for the dense sizes"):
        bench_run.validate_args(args)
    with pytest.raises(SystemExit):
        sb.build_parser().parse_args(["--quant", "fp4"])
    assert "argument --quant: invalid choice: 'fp4'" in capsys.readouterr().err


def test_dry_runs_name_the_quantisation(tmp_path):
    for module in ("serving_bench", "load_test"):
        cp = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--dry-run", "--model-size", "8b",
                             "--quant", "fp8-dynamic"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert cp.returncode == 0, cp.stderr
        assert "size='8b', quant='fp8-dynamic')" in cp.stdout and f"yali-serving-model-8b-fp8-dynamic-{os.getuid()}" in cp.stdout
    cp = subprocess.run([sys.executable, "-m", "benchmarks.load_test", "--dry-run", "--model-size", "qwen3-30b-a3b",
                         "--quant", "fp8-static"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert cp.returncode != 0 and "--quant fp8-static: quantisation 'fp8-static' is for the dense sizes" in cp.stderr


def test_merge_refuses_results_of_differently_quantised_models():
    recs = make_records({("yali", 1): [5.0, 5.1]})
    bf16 = {"model": {"size": "70b"}, "records": recs}  # written before quantization was recorded: none
    fp8 = {"model": {"size": "70b", "quantization": "fp8-block"}, "records": recs}
    assert len(report.merge_results([bf16, {"model": {"quantization": "none"}, "records": recs}], ["a", "b"])["records"]) == 2 * len(recs)
    with pytest.raises(SystemExit, match="differently quantised models: a.json none, b.json fp8-block"):
        report.merge_results([bf16, fp8], ["a.json", "b.json"])
