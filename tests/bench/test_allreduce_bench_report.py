"""CPU test of benchmarks/allreduce_bench.py's report: the target rows are computed
from the yali rows of a result (worst size decides; missing sizes say so)."""
from benchmarks import allreduce_bench as ab

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def rec(nbytes, timing, p50, p99=None, backend="yali", dtype="bf16"):
    return {"backend": backend, "dtype": dtype, "bytes": nbytes, "timing": timing, "us_p50": p50,
            "us_p99": p99 if p99 is not None else p50, "busbw_gbps": nbytes / p50 / 1e3}


def test_target_rows_worst_size_decides_and_missing_targets_are_named():
    res = {"records": [
        rec(2 * KiB, "graph", 2.5), rec(64 * KiB, "graph", 3.6),       # 64 KiB misses 3.5 by 0.10
        rec(64 * KiB, "graph", 1.0, backend="nccl"),                     # other backends do not count
        rec(1 * MiB, "graph", 5.6), rec(4 * MiB, "graph", 14.0),
        rec(64 * MiB, "graph", 64 * MiB / 337e3),                         # 337 GB/s: misses 340 by 3
        rec(16 * MiB, "eager", 60.0, 61.0), rec(64 * MiB, "eager", 200.0, 240.0),  # p99/p50 1.20 misses 1.15
    ]}
    rows = {label: (measured, verdict) for label, measured, verdict in ab.target_rows(res)}
    assert rows["≤ 64 KiB: per-op ≤ 3.5 µs"] == ("2K: 2.50, 64K: 3.60", "missed by 0.10")
    assert rows["1 MiB: per-op ≤ 7.0 µs"][1] == "met" and rows["4 MiB: per-op ≤ 15 µs"][1] == "met"
    assert rows["64 MiB: busBW ≥ 340 GB/s"][1] == "missed by 3.00"
    assert rows["1 GiB eager: busBW ≥ 360 GB/s"] == ("not measured in this run", "–")
    assert rows["16–256 MiB eager: p99/p50 ≤ 1.15"][1] == "missed by 0.05"
    md = ab.markdown_table({"records": res["records"], "host": "h", "date": "d", "command": "c"})
    assert "## Targets (yali, bf16)" in md and "| 4 MiB: per-op ≤ 15 µs | 4M: 14.00 | met |" in md


def test_eager_table_starts_where_eager_is_a_device_time():
    recs = [rec(s, t, p) for s, t, p in [(2 * KiB, "graph", 2.5), (2 * KiB, "eager", 40.0),
                                          (8 * MiB, "graph", 29.0), (8 * MiB, "eager", 31.0)]]
    md = ab.markdown_table({"records": recs, "host": "h", "date": "d", "command": "c"})
    eager = md.split("## Eager per-call time from 8M")[1].split("##")[0]
    assert "host launch pacing" in eager
    assert "| 8M |" in eager and "| 2K |" not in eager and "40.0" not in eager
