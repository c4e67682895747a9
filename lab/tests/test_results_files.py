"""Every committed result file follows the project's results schema (common keys, the row fields
of its kind, the ranks and GPUs it ran on, the commit it measured), so scripts can check every
quoted figure."""
import fnmatch
import glob
import json
import os
import re

import pytest

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
COMMON = ["kind", "date", "command", "host", "versions", "records", "shared_gpu"]
# The schema's kinds; the others in ROW_KEYS are described in lab/results/README.md.
SCHEMA_KINDS = {"allreduce-microbench", "serving-benchmark", "load-test", "fused-allreduce-rmsnorm",
                "overlap-model", "overlap-compute", "gpu-test-run", "moe-dispatch-combine"}
ROW_KEYS = {
    "allreduce-microbench": ["backend", "dtype", "bytes", "timing", "us_p50", "us_p99", "busbw_gbps"],
    "serving-benchmark": ["config", "concurrency", "repeat", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
                          "tpot_ms_p99", "itl_ms_p50", "itl_ms_p99", "output_tok_s", "req_s", "failed"],
    "load-test": ["config", "users", "duration_s", "requests", "failures", "ttft_ms_p50", "ttft_ms_p99",
                  "itl_ms_p50", "itl_ms_p99"],
    "fused-allreduce-rmsnorm": ["backend", "dtype", "hidden", "tokens", "us_p50"],
    "gpu-test-run": ["test", "outcome", "duration_s"],
    "overlap-model": ["model_shape", "tp", "tokens", "phase", "compute_us", "allreduce_us", "overlap_cost_us",
                      "step_us_now", "step_us_overlap", "predicted_speedup"],
    "overlap-compute": ["model_shape", "tp", "phase", "tokens", "op", "us_p50"],  # removed once decided: research/overlap/measure_compute.py (2cc9bbc)
    "allreduce-tuning": ["variant", "bytes"],  # the project's own kinds: lab/tune.py,
    "decode-profile": ["config", "rank", "kernel_class", "count", "mean_us"],  # lab/decode_profile.py
    "decode-gemm": ["setup", "graph", "name", "tokens", "us_per_call"],  # archived: research/decode_gemm_bench.py (618a435)
    "decode-prefetch": ["shape", "tokens", "correct", "ours_vs_cublas", "pass"],  # archived: research/decode_prefetch/bench.py (ddf7ac1)
    "moe-dispatch-combine": ["backend", "dtype", "hidden", "topk", "tokens", "dispatch_us_p50", "combine_us_p50",
                             "total_us_p50", "exact"],
    "layer-overlap-bench": ["model", "layer", "tokens", "us_p50"],  # the layer benchmark of the removed prefill overlap
    "serving-step-times": ["config", "tokens", "steps", "elapsed_ms_mean", "elapsed_ms_p90"],  # serving_bench --step-times
}
# Every run's JSON: current/ (the quoted runs) and archive/ (the rest), each <kind>/<date>-<topic>/.
FILES = sorted(glob.glob(os.path.join(RESULTS, "current", "**", "*.json"), recursive=True)
               + glob.glob(os.path.join(RESULTS, "archive", "**", "*.json"), recursive=True))
# Files from this date on name each GPU (`gpus`, or `gpus_used` per rank); before it `host` alone does.
GPU_IDS_SINCE = "2026-11-23"
HOST = re.compile(r"^\d+x\S")  # "2xNVIDIA H200 NV18, driver ...": GPU count and model
CLEAN_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
CURRENT = [f for f in FILES if f.startswith(os.path.join(RESULTS, "current", ""))]


def test_there_are_result_files():
    assert len(CURRENT) >= 10


@pytest.mark.parametrize("path", FILES, ids=[os.path.relpath(f, RESULTS) for f in FILES])
def test_result_file_follows_schema(path):
    with open(path) as f:
        doc = json.load(f)
    assert [k for k in COMMON if k not in doc] == [], "missing common keys"
    assert doc["kind"] in ROW_KEYS, f"unknown kind {doc['kind']!r}"
    assert set(doc["versions"]) >= {"torch", "cuda", "nccl", "vllm", "yali_vllm", "git"}
    # a run that measured nothing is kept only as the record of why (its errors)
    assert doc["records"] or doc.get("errors"), "no rows and no errors"
    need = ROW_KEYS[doc["kind"]]
    bad = [i for i, r in enumerate(doc["records"]) if any(k not in r for k in need)]
    assert bad == [], f"rows without {need}: {bad[:5]}"
    if doc["kind"] == "allreduce-microbench":
        assert doc["link_gbps"] > 0
    if doc["kind"] == "gpu-test-run":
        counts = {o: sum(r["outcome"] == o for r in doc["records"]) for o in ("passed", "failed", "skipped")}
        assert counts == {o: doc[o] for o in counts}
    assert isinstance(doc["shared_gpu"], bool), "shared_gpu is not true/false"
    sizes = doc.get("world_sizes") if doc["kind"] == "gpu-test-run" else [doc.get("world_size")]
    assert sizes and all(isinstance(n, int) and n >= 1 for n in sizes), "no world_size (world_sizes)"
    if doc.get("cpu_only"):  # CPU tests alone (the mutation run): no GPU to name, and it says so
        assert doc["host"].startswith("no GPU") and not doc["gpus"], "a CPU-only run that names a GPU"
    else:
        assert HOST.match(doc["host"]), f"host {doc['host']!r} does not name the GPUs"
        if doc["date"][:10] >= GPU_IDS_SINCE:  # a merge names its sources, and they their GPUs
            assert doc.get("gpus") or doc.get("gpus_used") or doc.get("merged_from"), "no gpus"
    assert ("git_checkout" in doc) == ("git_note" in doc), "git_checkout without git_note, or the reverse"


@pytest.mark.parametrize("path", CURRENT, ids=[os.path.relpath(f, RESULTS) for f in CURRENT])
def test_current_result_names_a_clean_commit(path):
    # A quoted figure names the code it measured; a run whose code no commit names is archived.
    with open(path) as f:
        git = json.load(f)["versions"]["git"]
    assert isinstance(git, str) and CLEAN_COMMIT.match(git), f"versions.git {git!r} is not a commit"


def test_kinds_beyond_the_schema_are_described():
    with open(os.path.join(RESULTS, "README.md")) as f:
        readme = f.read()
    assert [k for k in sorted(set(ROW_KEYS) - SCHEMA_KINDS) if f"| `{k}` |" not in readme] == []


def test_schema_keys_are_derived_from_the_run():
    from benchmarks.common.results import with_schema_keys

    serving = with_schema_keys({"kind": "serving-benchmark", "command": "serving_bench.py --world-size 4 --x",
                                "yali_env": {}, "records": []})
    assert serving["world_size"] == 4 and serving["shared_gpu"] is False
    assert with_schema_keys({"kind": "fused-allreduce-rmsnorm", "command": "x", "records": []})["world_size"] == 2
    tests = with_schema_keys({"kind": "gpu-test-run", "command": "x", "yali_env": {"YALI_ALLOW_SHARED_GPU": "1"},
                              "records": [{"test": "tests/gpu/test_ranks.py::t[4-ranks]", "outcome": "passed"},
                                          {"test": "tests/gpu/test_ranks.py::t[8-ranks]", "outcome": "skipped"},
                                          {"test": "tests/gpu/test_fused.py::t", "outcome": "passed"}]})
    assert tests["world_sizes"] == [2, 4] and tests["shared_gpu"] is True
    more = with_schema_keys({"kind": "gpu-test-run", "command": "x", "records": [
        {"test": "tests/gpu/test_delays.py::t[4-ranks-random-pdl1]", "outcome": "passed"},
        {"test": "tests/gpu/test_delays.py::t[8-ranks-last-rank-pdl0]", "outcome": "passed"}]})
    assert more["world_sizes"] == [4, 8]  # ids that go on after the ranks
    kept = {"kind": "serving-benchmark", "world_size": 8, "shared_gpu": True, "command": "--world-size 4", "records": []}
    assert with_schema_keys(kept) == kept


def test_current_holds_exactly_the_runs_readme_and_docs_quote():
    # README.md quotes runs under current/ only; docs/ (DESIGN_LOG.md, the history, aside) may also
    # name an archived run (one whose code no commit names); every run they name exists, and every
    # run under current/ is quoted (a glob such as current/tune/* counts).
    repo = os.path.dirname(os.path.dirname(RESULTS))
    docs = [os.path.join(repo, "README.md")] + sorted(
        f for f in glob.glob(os.path.join(repo, "docs", "*.md")) if not f.endswith("DESIGN_LOG.md"))
    cited = set()
    for doc in docs:
        with open(doc) as f:
            text = f.read()
        cited |= {(os.path.basename(doc), m) for m in re.findall(
            r"(?:lab/results/|(?<![\w/.-]))((?:current|archive)/[\w-]+/[\w./*-]+)", text)}
    assert len(cited) >= 20, "the result citations of README.md and docs/ were not found"
    bad = sorted((doc, path) for doc, path in cited
                 if not glob.glob(os.path.join(RESULTS, path.rstrip(".")))
                 or (doc == "README.md" and not path.startswith("current/")))
    assert bad == []
    quoted = {"/".join(path.split("/")[:3]).rstrip(".") for _, path in cited if path.startswith("current/")}
    runs = [os.path.relpath(d, RESULTS).replace(os.sep, "/")
            for d in glob.glob(os.path.join(RESULTS, "current", "*", "*"))]
    assert [r for r in runs if not any(fnmatch.fnmatch(r, q) for q in quoted)] == []
