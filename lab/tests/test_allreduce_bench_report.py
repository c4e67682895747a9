"""CPU tests of benchmarks/allreduce_bench.py: the report (the target rows are computed from the
yali rows of a 2-rank result, worst size deciding, missing sizes named; every report names its
world size), NCCL's busBW at N ranks, the N-rank reference and tolerance, which backends run at
N ranks, and the result file's header."""
import pytest

from benchmarks import allreduce_bench as ab

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def rec(nbytes, timing, p50, p99=None, backend="yali", dtype="bf16"):
    return {"backend": backend, "dtype": dtype, "bytes": nbytes, "timing": timing, "us_p50": p50,
            "us_p99": p99 if p99 is not None else p50, "busbw_gbps": nbytes / p50 / 1e3}


def test_target_rows_worst_size_decides_and_missing_targets_are_named():
    res = {"records": [
        rec(2 * KiB, "graph", 2.3), rec(64 * KiB, "graph", 2.5),       # 64 KiB misses 2.4 by 0.10
        rec(64 * KiB, "graph", 2.0, backend="nccl"),                     # faster than yali at 64 KiB
        rec(2 * KiB, "graph", 4.6, backend="vllm-custom"),
        rec(1 * MiB, "graph", 4.9), rec(4 * MiB, "graph", 14.0),
        rec(64 * MiB, "graph", 64 * MiB / 337e3),                         # 337 GB/s: misses 350 by 13
        rec(16 * MiB, "eager", 60.0, 61.0), rec(64 * MiB, "eager", 200.0, 240.0),  # p99/p50 1.20 misses 1.15
    ]}
    rows = {label: (measured, verdict) for label, measured, verdict in ab.target_rows(res)}
    assert rows["≤ 64 KiB: per-op ≤ 2.4 µs"] == ("2K: 2.30, 64K: 2.50", "missed by 0.10")
    assert rows["1 MiB: per-op ≤ 5.0 µs"][1] == "met" and rows["4 MiB: per-op ≤ 13 µs"][1] == "missed by 1.00"
    assert rows["≥ 64 MiB: busBW ≥ 350 GB/s"] == ("64M: 337.00", "missed by 13.00")
    # yali / best other: 2.3 / 4.6 = 0.50 at 2 KiB, 2.5 / 2.0 = 1.25 at 64 KiB; sizes with no other backend left out
    assert rows["every size: no other backend faster (yali / best other ≤ 1)"] == (
        "2K: 0.50, 64K: 1.25", "missed by 0.25")
    assert rows["16–256 MiB eager: p99/p50 ≤ 1.15"][1] == "missed by 0.05"
    md = ab.markdown_table({"records": res["records"], "host": "h", "date": "d", "command": "c"})
    assert "## Targets (yali, bf16)" in md and "| 4 MiB: per-op ≤ 13 µs | 4M: 14.00 | missed by 1.00 |" in md
    del res["records"][-2:]
    rows = {label: (measured, verdict) for label, measured, verdict in ab.target_rows(res)}
    assert rows["16–256 MiB eager: p99/p50 ≤ 1.15"] == ("not measured in this run", "–")


def test_eager_table_starts_where_eager_is_a_device_time():
    recs = [rec(s, t, p) for s, t, p in [(2 * KiB, "graph", 2.5), (2 * KiB, "eager", 40.0),
                                          (8 * MiB, "graph", 29.0), (8 * MiB, "eager", 31.0)]]
    md = ab.markdown_table({"records": recs, "host": "h", "date": "d", "command": "c"})
    eager = md.split("## Eager per-call time from 8M")[1].split("##")[0]
    assert "host launch pacing" in eager
    assert "| 8M |" in eager and "| 2K |" not in eager and "40.0" not in eager


def test_report_names_the_world_size_and_keeps_the_targets_for_two_ranks():
    recs = [rec(2 * KiB, "graph", 2.5), rec(2 * KiB, "graph", 9.0, backend="nccl")]
    two = ab.markdown_table({"records": recs, "host": "h", "date": "d", "command": "c"})  # written before the key
    assert two.startswith("# All-reduce microbenchmark, 2 ranks (bf16") and "## Targets (yali, bf16)" in two
    eight = ab.markdown_table({"records": recs, "host": "h", "date": "d", "command": "c", "world_size": 8})
    assert eight.startswith("# All-reduce microbenchmark, 8 ranks (bf16") and "at 8 ranks" in eight
    assert "## Targets" not in eight and "Not a timing" not in eight
    shared = ab.markdown_table({"records": recs, "host": "h", "date": "d", "command": "c", "world_size": 4,
                                "shared_gpu": True})
    assert "**Not a timing: the 4 ranks shared GPU 0 (YALI_ALLOW_SHARED_GPU=1)" in shared


def test_busbw_follows_nccls_convention_for_n_ranks():
    assert ab.bus_bandwidth_gbps(64 * MiB, 200.0, 2) == 64 * MiB / 200.0 / 1e3  # bytes / time at 2 ranks
    assert ab.bus_bandwidth_gbps(64 * MiB, 200.0, 4) == 64 * MiB / 200.0 / 1e3 * 1.5
    assert ab.bus_bandwidth_gbps(64 * MiB, 200.0, 8) == 64 * MiB / 200.0 / 1e3 * 1.75


def test_the_two_rank_kernel_modes_and_the_shared_gpu_limit_which_backends_run():
    assert all(ab.backend_refusal(b, 2, False) is None for b in ab.ALL_BACKENDS)
    at8 = {b: ab.backend_refusal(b, 8, False) for b in ab.ALL_BACKENDS}
    assert [b for b, why in at8.items() if why] == list(ab.TWO_RANK_BACKENDS)
    assert "2-rank kernel mode" in at8["yali-flash"] and "at 8 ranks" in at8["yali-flash"]
    shared = {b: ab.backend_refusal(b, 4, True) for b in ab.ALL_BACKENDS}
    assert [b for b, why in shared.items() if not why] == ["yali"]
    assert "share GPU 0" in shared["nccl"] and "share GPU 0" in shared["symm-two-shot"]


def test_reference_is_the_fp32_sum_of_every_ranks_input():
    import torch

    dev = torch.device("cpu")
    for dtype, dname in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        ref = ab.reference_sum(torch, 4096, 4, dtype, dev)
        inputs = [ab.rank_input(torch, 4096, r, dtype, dev) for r in range(4)]
        assert torch.equal(ref, (inputs[0].float() + inputs[1].float() + inputs[2].float() + inputs[3].float())
                           .to(dtype))
        # one rank's contribution missing is far outside the tolerance at 4 ranks
        partial = (ref.float() - inputs[3].float()).abs().max().item()
        assert partial > 10 * ab.max_error("nccl", dname, 4)
    # two ranks: the same values as rank_input's pair (the reference of the 2-rank runs)
    assert torch.equal(ab.reference_sum(torch, 64, 2, torch.float16, dev),
                       (ab.rank_input(torch, 64, 0, torch.float16, dev).float()
                        + ab.rank_input(torch, 64, 1, torch.float16, dev).float()).to(torch.float16))


def test_max_error_is_bitwise_for_yali_and_grows_with_the_additions_elsewhere():
    assert ab.max_error("yali", "bf16", 2) == 0.0 and ab.max_error("yali-stream", "fp32", 2) == 0.0
    assert ab.max_error("yali", "bf16", 8) == 0.0  # the N-rank kernels add in rank order in fp32, as the reference
    assert ab.max_error("nccl", "bf16", 2) == 0.07 and ab.max_error("nccl", "fp32", 2) == 1e-5
    assert ab.max_error("nccl", "bf16", 8) == pytest.approx(0.49) and ab.max_error("vllm-custom", "fp32", 4) == \
        pytest.approx(3e-5)


def test_write_outputs_names_the_ranks_in_a_schema_valid_result(tmp_path, capsys):
    import argparse
    import json

    from lab.tests.test_results_files import ROW_KEYS

    args = argparse.Namespace(out=str(tmp_path), name="ar", world_size=4, shared_gpu=False)
    res = {"rows": [rec(2 * KiB, "graph", 2.5), rec(2 * KiB, "graph", 9.0, backend="nccl")], "link_gbps": 390.0,
           "skipped": {"yali-flash": ab.backend_refusal("yali-flash", 4, False)}}
    ab.write_outputs(args, res)
    doc = json.loads((tmp_path / "ar.json").read_text())
    assert doc["kind"] == "allreduce-microbench" and doc["world_size"] == 4 and doc["shared_gpu"] is False
    assert [g["rank"] for g in doc["gpus_used"]] == [0, 1, 2, 3]
    assert [g["cuda_device"] for g in doc["gpus_used"]] == [0, 1, 2, 3]
    assert all(k in r for r in doc["records"] for k in ROW_KEYS["allreduce-microbench"])
    assert "2(N-1)/N" in doc["method"]
    assert (tmp_path / "ar.md").read_text().startswith("# All-reduce microbenchmark, 4 ranks")
