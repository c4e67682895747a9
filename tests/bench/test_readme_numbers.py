"""README's result tables, rebuilt from the result files they cite: a number in README that does
not come from its file fails here. Each table is found by its header; the file is the last
benchmarks/results/*.md link before it, read as the .json beside it (the results schema)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
LINK = re.compile(r"\(((?:benchmarks/)?results/[\w./-]+)\.md\)")

# README column / row label -> backend key of the result file.
ALLREDUCE_COLUMNS = {
    "YALI": "yali", "YALI first kernels": "yali-prev", "vLLM custom AR": "vllm-custom",
    "vLLM pynccl": "vllm-pynccl", "NCCL (torch)": "nccl", "symm-mem one-shot": "symm-one-shot",
    "symm-mem two-shot": "symm-two-shot",
}
FUSED_ROWS = {
    "YALI fused": "yali-fused", "vLLM FlashInfer fusion (trtllm)": "flashinfer-trtllm",
    "unfused (custom AR + `fused_add_rms_norm`)": "unfused",
    "unfused (vLLM's all-reduce + `fused_add_rms_norm`)": "unfused",
}
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _table(header_start: str) -> tuple[list[str], list[list[str]], dict]:
    """(header cells, body rows, the cited result file's JSON) of the README table starting so."""
    start = README.index(header_start)
    links = LINK.findall(README[:start])
    assert links, f"no result file is cited before the table {header_start!r}"
    path = links[-1] if links[-1].startswith("benchmarks/") else "benchmarks/" + links[-1]
    assert path.startswith("benchmarks/results/current/"), f"README quotes {path}, outside results/current/"
    data = json.loads((REPO / f"{path}.json").read_text())
    lines = README[start:].split("\n\n", 1)[0].splitlines()
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    return cells[0], [row for row in cells[2:]], data


def _number(cell: str) -> float | None:
    cell = cell.replace("*", "").strip()
    return None if cell in ("–", "-", "") else float(cell)


def _bytes(label: str) -> int:
    n, unit = label.split()
    return int(n) * UNITS[unit]


@pytest.mark.parametrize("header_start, world_size, min_checked", [
    ("| size | YALI |", 2, 50), ("| size, 4 ranks | YALI |", 4, 30)])
def test_allreduce_table_matches_its_result_file(header_start, world_size, min_checked):
    header, rows, data = _table(header_start)
    assert data.get("world_size", 2) == world_size and not data.get("shared_gpu")
    p50 = {(r["backend"], r["bytes"]): r["us_p50"] for r in data["records"]
           if r["dtype"] == "bf16" and r["timing"] == "graph"}
    checked = 0
    for row in rows:
        nbytes = _bytes(row[0])
        for name, cell in zip(header[1:], row[1:]):
            if name == "YALI busBW":
                assert cell == f"{nbytes / p50[('yali', nbytes)] / 1e3:.0f} GB/s", (row[0], name, cell)
                continue
            want = p50.get((ALLREDUCE_COLUMNS[name], nbytes))
            got = _number(cell)
            assert (got is None) == (want is None), (row[0], name, cell, want)
            if want is not None:
                assert got == pytest.approx(round(want, 2), abs=0.006), (row[0], name, cell, want)
                checked += 1
        # The bold cell is the fastest backend of the row ("YALI first kernels" is YALI's own older
        # table, shown beside it, not a competitor).
        others = [_number(c) for c, n in zip(row[1:], header[1:])
                  if n in ALLREDUCE_COLUMNS and n != "YALI first kernels" and _number(c) is not None]
        bold = [_number(c) for c in row[1:] if c.startswith("**")]
        assert bold == [min(others)], (row[0], bold, others)
    assert checked >= min_checked


@pytest.mark.parametrize("header_start, world_size", [("| tokens |", 2), ("| tokens, 4 ranks |", 4)])
def test_fused_table_matches_its_result_file(header_start, world_size):
    header, rows, data = _table(header_start)
    assert data.get("world_size", 2) == world_size and not data.get("shared_gpu")
    tokens = [int(t) for t in header[1:]]
    p50 = {(r["backend"], r["tokens"]): r["us_p50"] for r in data["records"]
           if r["dtype"] == "bf16" and r["hidden"] == 8192}
    for row in rows:
        if row[0] == "YALI / FlashInfer":
            for t, cell in zip(tokens, row[1:]):
                fi = p50.get(("flashinfer-trtllm", t))
                assert (_number(cell) is None) == (fi is None), (t, cell)
                if fi is not None:
                    ratio = p50[("yali-fused", t)] / fi
                    assert float(cell) == pytest.approx(round(ratio, 2), abs=0.006), (t, cell, ratio)
            continue
        backend = FUSED_ROWS[row[0]]
        for t, cell in zip(tokens, row[1:]):
            want = p50.get((backend, t))  # "–": not measured (FlashInfer above its workspace)
            assert (_number(cell) is None) == (want is None), (row[0], t, cell)
            if want is not None:
                assert _number(cell) == pytest.approx(round(want, 2), abs=0.006), (row[0], t, cell)


# README's serving tables: column -> (concurrency, record field); a cell shows as many digits as
# its mean has.
SERVING_COLUMNS = {
    "c=1 TPOT p50": (1, "tpot_ms_p50"), "c=1 TTFT p50": (1, "ttft_ms_p50"), "c=1 TTFT mean": (1, "ttft_ms_mean"),
    "c=1 TTFT p99": (1, "ttft_ms_p99"),
    "c=1 ITL p99": (1, "itl_ms_p99"), "c=8 TPOT p50": (8, "tpot_ms_p50"), "c=8 output tok/s": (8, "output_tok_s"),
    "c=32 output tok/s": (32, "output_tok_s"), "c=32 TPOT p50": (32, "tpot_ms_p50"),
    "c=32 ITL p50": (32, "itl_ms_p50"), "c=32 ITL p99": (32, "itl_ms_p99"), "c=32 TTFT p50": (32, "ttft_ms_p50"),
}
SERVING_ROWS = {"YALI (`YALI_WORLD_SIZES=all`)": "yali", "YALI": "yali", "YALI (`yali-fusion`)": "yali-fusion",
                "vLLM's defaults": "vllm-default"}


@pytest.mark.parametrize("first, last, world_size, tables", [
    ("### Two GPUs", "### Serving at TP=4", 2, 1), ("### Serving at TP=4", "## Limits", 4, 1)])
def test_serving_tables_match_their_result_files(first, last, world_size, tables):
    """Each cell is the mean ± half the spread of the starts in the merged serving result linked
    last before its table (a configuration of one start: its value, no ±); the bold cell of a column
    is the better configuration (lower, or more tokens/s)."""
    section = README[README.index(first):README.index(last)]
    starts = [m.start() for m in re.finditer(r"^\| \| c=", section, re.M)]
    assert len(starts) >= tables
    for start in starts:
        link = re.findall(r"\((benchmarks/results/current/serving/[\w.-]+)/README\.md\)", section[:start])[-1]
        data = json.loads((REPO / link / "serving-benchmark.json").read_text())
        assert data["world_size"] == world_size and data["shared_gpu"] is False
        lines = section[start:].split("\n\n", 1)[0].splitlines()
        cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
        header, rows = cells[0][1:], cells[2:]
        configs = sorted(SERVING_ROWS[r[0]] for r in rows)
        assert len(configs) == 2 and configs[0] == "vllm-default" and configs[1].startswith("yali"), configs
        shown: dict = {}
        for row in rows:
            cfg = SERVING_ROWS[row[0]]
            for name, cell in zip(header, row[1:]):
                conc, field = SERVING_COLUMNS[name]
                values = [r[field] for r in data["records"] if r["config"] == cfg and r["concurrency"] == conc]
                assert values, (link, cfg, name)
                mean, half = sum(values) / len(values), (max(values) - min(values)) / 2
                text = cell.replace("*", "").replace(" ms", "")
                digits = len(text.split("±")[0].strip().partition(".")[2])
                assert ("±" in text) == (len(values) > 1), (cfg, name, cell, values)
                got_mean, got_half = (float(v) for v in text.split("±")) if len(values) > 1 else (float(text), 0.0)
                assert got_mean == pytest.approx(round(mean, digits), abs=0.6 * 10 ** -digits), (cfg, name, cell, mean)
                assert got_half == pytest.approx(round(half, digits), abs=0.6 * 10 ** -digits), (cfg, name, cell, half)
                shown.setdefault(name, []).append((cell.startswith("**"), mean))
        for name, col in shown.items():
            bold = [m for b, m in col if b]
            if bold:  # a bold cell: the better mean of the column
                best = max(m for _, m in col) if "tok/s" in name else min(m for _, m in col)
                assert bold == [best], (name, col)
