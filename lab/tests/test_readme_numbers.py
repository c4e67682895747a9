"""The result tables of README.md and docs/BENCHMARKS.md, rebuilt from the result files they cite:
a number that does not come from its file fails here. Each table is found by its header; the file
is the last lab/results/*.md link before it, read as the .json beside it (the results
schema), and the paragraph that cites it names that run's GPUs, date, vLLM and code."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
BENCHMARKS = (REPO / "docs" / "BENCHMARKS.md").read_text()
DOCS = {"README.md": README, "docs/BENCHMARKS.md": BENCHMARKS}
LINK = re.compile(r"\((?:\.\./)?(lab/results/[\w./-]+)\.md\)")
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


def run_names(data: dict) -> list[str]:
    """What a caption must say of the run behind its table: its GPUs ("2×H200"), its date, its vLLM
    ("vLLM 0.33.0", or "no vLLM") and its code (the first 7 digits of the commit)."""
    gpus = re.match(r"(\d+)xNVIDIA (H\d+)", data["host"])
    assert gpus, f"no GPU count and kind in the host {data['host']!r}"
    vllm = data["versions"].get("vllm")
    return [f"{gpus[1]}×{gpus[2]}", data["date"][:10], f"vLLM {vllm}" if vllm else "no vLLM",
            f"code {data['versions']['git'][:7]}"]


def check_caption(caption: str, data: dict, where: str) -> None:
    missing = [name for name in run_names(data) if name not in caption]
    assert missing == [], f"{where}: the caption does not name {missing} of its run: {caption!r}"


def _table(doc: str, header_start: str) -> tuple[list[str], list[list[str]], dict]:
    """(header cells, body rows, the cited result file's JSON) of the table of `doc` starting so;
    the paragraph citing the file names its run."""
    text = DOCS[doc]
    start = text.index(header_start)
    links = list(LINK.finditer(text[:start]))
    assert links, f"no result file is cited before the table {header_start!r} of {doc}"
    cited = links[-1][1]
    path = cited
    assert path.startswith("lab/results/current/"), f"{doc} quotes {path}, outside results/current/"
    data = json.loads((REPO / f"{path}.json").read_text())
    check_caption(text[text.rfind("\n\n", 0, links[-1].start()):start], data, f"{doc} {header_start!r}")
    lines = text[start:].split("\n\n", 1)[0].splitlines()
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    return cells[0], [row for row in cells[2:]], data


def _number(cell: str) -> float | None:
    cell = cell.replace("*", "").strip()
    return None if cell in ("–", "-", "") else float(cell)


def _bytes(label: str) -> int:
    n, unit = label.split()
    return int(n) * UNITS[unit]


@pytest.mark.parametrize("doc, header_start, world_size, min_checked", [
    ("README.md", "| size | YALI |", 2, 25), ("docs/BENCHMARKS.md", "| size | YALI |", 2, 50),
    ("docs/BENCHMARKS.md", "| size, 4 ranks | YALI |", 4, 30)])
def test_allreduce_table_matches_its_result_file(doc, header_start, world_size, min_checked):
    header, rows, data = _table(doc, header_start)
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


@pytest.mark.parametrize("doc, header_start, world_size", [
    ("README.md", "| tokens |", 2), ("docs/BENCHMARKS.md", "| tokens |", 2),
    ("docs/BENCHMARKS.md", "| tokens, 4 ranks |", 4)])
def test_fused_table_matches_its_result_file(doc, header_start, world_size):
    header, rows, data = _table(doc, header_start)
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


# The serving tables: column -> (concurrency, record field); a cell shows as many digits as its
# mean has.
SERVING_COLUMNS = {
    "c=1 TPOT p50": (1, "tpot_ms_p50"), "c=1 TTFT p50": (1, "ttft_ms_p50"), "c=1 TTFT mean": (1, "ttft_ms_mean"),
    "c=1 TTFT p99": (1, "ttft_ms_p99"),
    "c=1 ITL p99": (1, "itl_ms_p99"), "c=8 TPOT p50": (8, "tpot_ms_p50"), "c=8 output tok/s": (8, "output_tok_s"),
    "c=32 output tok/s": (32, "output_tok_s"), "c=32 TPOT p50": (32, "tpot_ms_p50"),
    "c=32 ITL p50": (32, "itl_ms_p50"), "c=32 ITL p99": (32, "itl_ms_p99"), "c=32 TTFT p50": (32, "ttft_ms_p50"),
}
SERVING_ROWS = {"YALI (`YALI_WORLD_SIZES=all`)": "yali", "YALI": "yali", "YALI (`yali-fusion`)": "yali-fusion",
                "vLLM's defaults": "vllm-default"}


SERVING_LINK = re.compile(r"\((?:\.\./)?(lab/results/current/serving/[\w.-]+)/README\.md\)")


def serving_data(link: str, world_size: int) -> dict:
    data = json.loads((REPO / link / "serving-benchmark.json").read_text())
    assert data["world_size"] == world_size and data["shared_gpu"] is False, link
    return data


@pytest.mark.parametrize("first, last, world_size, tables", [
    ("### Two GPUs: serving", "### Four GPUs: serving", 2, 1),
    ("### Four GPUs: serving", "### Four GPUs: kernels", 4, 1)])
def test_serving_tables_match_their_result_files(first, last, world_size, tables):
    """Each cell is the mean ± half the spread of the starts in the merged serving result linked
    last before its table (a configuration of one start: its value, no ±); the bold cell of a column
    is the better configuration (lower, or more tokens/s)."""
    section = BENCHMARKS[BENCHMARKS.index(first):BENCHMARKS.index(last)]
    starts = [m.start() for m in re.finditer(r"^\| \| c=", section, re.M)]
    assert len(starts) >= tables
    for start in starts:
        link = SERVING_LINK.findall(section[:start])[-1]
        data = serving_data(link, world_size)
        check_caption(section[:start], data, f"docs/BENCHMARKS.md {first!r}")
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


def start_ratio(data: dict, conc: int, field: str) -> tuple[float, bool]:
    """YALI's mean over vLLM's defaults' mean of the starts, and whether the difference is within
    the spread of the starts (the larger of the two configurations' max - min)."""
    values = {cfg: [r[field] for r in data["records"] if r["config"] == cfg and r["concurrency"] == conc]
              for cfg in ("yali", "vllm-default")}
    assert all(values.values()), (conc, field, values)
    mean = {cfg: sum(v) / len(v) for cfg, v in values.items()}
    spread = max(max(v) - min(v) for v in values.values())
    return mean["yali"] / mean["vllm-default"], abs(mean["yali"] - mean["vllm-default"]) <= spread


def test_readme_serving_ratios_match_their_result_files():
    """README's serving table: one row per server, each cell YALI's mean over vLLM's defaults' to
    three digits, marked ≈ exactly where the difference is within the spread of the starts; the row
    names its TP size, GPUs and code, the caption the date and vLLM of every run."""
    start = README.index("| server |")
    caption = README[README.rfind("\n\n", 0, start - 2):start]
    lines = README[start:].split("\n\n", 1)[0].splitlines()
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    header, rows = cells[0], cells[2:]
    assert header[-1] == "result" and len(rows) >= 2
    for row in rows:
        (link,) = SERVING_LINK.findall(row[-1])
        tp = re.search(r"TP=(\d+)", row[0])
        assert tp, row[0]
        data = serving_data(link, int(tp[1]))
        gpus, date, vllm, code = run_names(data)
        assert gpus in row[0] and code in row[0], (row[0], gpus, code)
        assert date in caption and vllm in caption, (caption, date, vllm)
        for name, cell in zip(header[1:-1], row[1:-1]):
            ratio, within = start_ratio(data, *SERVING_COLUMNS[name])
            assert cell.endswith(" ≈") == within, (row[0], name, cell, ratio)
            assert float(cell.removesuffix(" ≈")) == pytest.approx(round(ratio, 3), abs=0.0006), (row[0], name, cell)


def test_readme_number_tables_are_the_checked_ones():
    """Every table of README.md is the install table, the settings or one of the number tables the
    tests above rebuild, so a new table of numbers needs a check here."""
    lines = README.splitlines()
    firsts = [ln.strip("|").split("|")[0].strip() for before, ln in zip([""] + lines, lines)
              if ln.startswith("|") and not before.startswith("|")]
    assert sorted(firsts) == ["server", "size", "tokens", "vLLM", "variable"], firsts
