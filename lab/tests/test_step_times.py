"""benchmarks/serving/step_times.py: vLLM's per-step log lines, tabled per configuration by the
tokens a step carries; the server flag and the line format checked against vLLM's source."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.serving import step_times as st

LINE = ("(EngineCore pid=15115) INFO 11-26 15:12:01 [loggers.py:200] Iteration({it}): {cr} context requests, "
        "{ct} context tokens, {gr} generation requests, {gt} generation tokens, iteration elapsed time: {ms} ms, "
        "GPU KV cache usage: 3.1%")


def line(it, ct, gt, ms, cr=None, gr=None):
    return LINE.format(it=it, cr=1 if cr is None else cr, ct=ct, gr=gt if gr is None else gr, gt=gt, ms=ms)


def test_parse_steps_reads_every_field_and_skips_dummy_steps():
    lines = [line(7, 1024, 31, "61.20"), "unrelated", line(8, 0, 32, "18.45", cr=0),
             line(9, 0, 0, "0.00", cr=0),  # an empty step, not a dummy: kept
             "Iteration(10): 0 context requests, 0 context tokens, 0 generation requests, 0 generation tokens, "
             "iteration elapsed time: 0.00 ms (dummy), GPU KV cache usage: 0.0%"]
    steps = st.parse_steps(lines)
    assert [s["iteration"] for s in steps] == [7, 8, 9]
    assert steps[0] == {"iteration": 7, "context_requests": 1, "context_tokens": 1024, "generation_requests": 31,
                        "generation_tokens": 31, "tokens": 1055, "elapsed_ms": 61.2}
    assert steps[1]["tokens"] == 32 and steps[1]["elapsed_ms"] == 18.45


@pytest.mark.parametrize("tokens, bucket", [(1, "1-8"), (8, "1-8"), (9, "9-32"), (128, "65-128"), (129, "129-512"),
                                            (1055, "513-1152"), (8192, "4097-8192"), (9000, ">8192")])
def test_buckets(tokens, bucket):
    assert st.bucket_of(tokens) == bucket


def test_summary_and_table_per_config_and_bucket(tmp_path):
    logs = tmp_path / "server-logs"
    logs.mkdir()
    (logs / "yali-r1.log").write_text("\n".join([line(1, 0, 32, 18.0, cr=0), line(2, 0, 32, 20.0, cr=0),
                                                 line(3, 1024, 31, 70.0)]))
    (logs / "yali-r2.log").write_text(line(1, 1024, 31, 72.0))
    (logs / "vllm-default-r1.log").write_text("\n".join([line(1, 0, 32, 19.0, cr=0), line(2, 1024, 31, 48.0)]))
    (logs / "notes.txt").write_text(line(1, 1024, 31, 999.0))  # not a server log
    rows = st.summarize(st.by_config(st.read_starts(tmp_path)))
    get = {(r["config"], r["tokens"]): r for r in rows}
    assert set(get) == {("vllm-default", "9-32"), ("vllm-default", "513-1152"), ("yali", "9-32"), ("yali", "513-1152")}
    y = get[("yali", "513-1152")]  # both repeats' prefill steps
    assert y["steps"] == 2 and y["elapsed_ms_mean"] == 71.0 and y["elapsed_ms_max"] == 72.0
    assert y["mean_context_tokens"] == 1024.0 and y["mean_tokens"] == 1055.0
    assert get[("yali", "9-32")]["elapsed_ms_mean"] == 19.0 and get[("vllm-default", "513-1152")]["steps"] == 1
    md = st.markdown(rows)
    assert "| tokens a step | vllm-default steps | vllm-default ms | yali steps | yali ms |" in md  # logs by name
    assert "| 513-1152 | 1 | 48.00 (48.00) | 2 | 71.00 (72.00) |" in md
    # buckets in token order whichever config has them first
    (logs / "zz-r1.log").write_text("\n".join([line(1, 9000, 0, 500.0, gr=0), line(2, 0, 4, 9.0, cr=0)]))
    order = [ln.split("|")[1].strip() for ln in st.markdown(st.summarize(st.by_config(st.read_starts(tmp_path)))).splitlines()
             if ln.startswith("| ") and not ln.startswith("| tokens")]
    assert order == ["1-8", "9-32", "513-1152", ">8192"]
    (logs / "zz-r1.log").unlink()
    header = {"kind": "serving-benchmark", "command": "x", "world_size": 4, "shared_gpu": False, "records": [1]}
    md_path = st.write_step_times(tmp_path, header)
    doc = json.loads((tmp_path / "step-times.json").read_text())
    assert md_path.read_text() == md and doc["kind"] == "serving-step-times" and doc["world_size"] == 4
    assert doc["records"] == rows
    empty = tmp_path / "empty"
    (empty / "server-logs").mkdir(parents=True)
    assert st.write_step_times(empty, header) is None
    cp = subprocess.run([sys.executable, "-m", "benchmarks.serving.step_times", str(empty)], capture_output=True, text=True)
    assert cp.returncode == 1 and "--step-times" in cp.stderr


def _vllm_file(rel: str) -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm not installed")
    return Path(list(spec.submodule_search_locations)[0]) / rel


def test_server_flag_and_line_format_match_vllm_source():
    """The flag serving_bench passes is vLLM's, and the regex reads the line vLLM's logger writes
    (vLLM 0.33; older releases have no iteration details)."""
    args = _vllm_file("engine/arg_utils.py")
    if st.SERVER_FLAG not in args.read_text():
        pytest.skip("this vLLM has no iteration details (added after 0.26)")
    src = _vllm_file("v1/metrics/loggers.py").read_text()
    fmt = ('"%sIteration(%d): %d context requests, %d context tokens, "\n'
           '            "%d generation requests, %d generation tokens, "\n'
           '            "iteration elapsed time: %.2f ms%s, "')
    assert fmt in src
    rendered = ("%sIteration(%d): %d context requests, %d context tokens, %d generation requests, "
                "%d generation tokens, iteration elapsed time: %.2f ms%s, %s KV cache usage: %.1f%%%s"
                % ("", 3, 1, 1024, 31, 31, 61.234, "", "GPU", 3.14, ""))
    assert st.parse_steps([rendered])[0]["elapsed_ms"] == 61.23


def test_serving_bench_passes_the_flag_only_when_asked(tmp_path):
    base = [sys.executable, "-m", "benchmarks.serving_bench", "--dry-run", "--model-size", "8b", "--configs",
            "yali,vllm-default", "--out", str(tmp_path)]
    plain = subprocess.run(base, capture_output=True, text=True, check=True).stdout
    flagged = subprocess.run(base + ["--step-times"], capture_output=True, text=True, check=True).stdout
    assert st.SERVER_FLAG not in plain
    assert sum(ln.count(st.SERVER_FLAG) for ln in flagged.splitlines() if " serve " in ln) >= 2


def test_lone_prefill_steps_per_server_start(tmp_path):
    """The steps that prefill one prompt and carry no decode, per start (the concurrency-1 TTFT's step):
    steps with a decode or two prompts are left out; several output directories name each start."""
    for run, ms in (("run-a", (80.0, 90.0, 130.0)), ("run-b", (76.0, 80.0))):
        logs = tmp_path / run / "server-logs"
        logs.mkdir(parents=True)
        (logs / "yali-r1.log").write_text("\n".join(
            [line(i, 1024, 0, m, gr=0) for i, m in enumerate(ms)]
            + [line(9, 1024, 3, 99.0), line(10, 2048, 0, 200.0, cr=2, gr=0), line(11, 0, 1, 15.0, cr=0)]))
    lone = st.lone_prefills(st.read_starts(tmp_path / "run-a"))
    assert lone == [{"start": "yali-r1", "config": "yali", "tokens": "513-1152", "steps": 3, "elapsed_ms_p50": 90.0,
                     "elapsed_ms_mean": 100.0, "elapsed_ms_min": 80.0, "elapsed_ms_max": 130.0}]
    assert "| yali-r1 | 513-1152 | 3 | 90.00 | 100.00 | 80.00 | 130.00 |" in st.lone_markdown(lone)
    header = {"kind": "serving-benchmark", "command": "x", "world_size": 4, "shared_gpu": False, "records": [1]}
    md = st.write_step_times(tmp_path / "run-a", header).read_text()
    doc = json.loads((tmp_path / "run-a" / "step-times.json").read_text())
    assert doc["lone_prefill_steps"] == lone and "one prompt and carry nothing else" in md
    assert (tmp_path / "run-a" / st.LONE_PLOT).stat().st_size > 1000  # the plot beside the table
    assert st.plot_lone_prefills({("s", "yali"): [st.parse_steps([line(1, 0, 4, 9.0, cr=0)])[0]]},
                                 tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
    cp = subprocess.run([sys.executable, "-m", "benchmarks.serving.step_times", str(tmp_path / "run-a"),
                         str(tmp_path / "run-b"), "--plot", str(tmp_path / "both.png")], capture_output=True, text=True)
    assert cp.returncode == 0, cp.stderr
    assert (tmp_path / "both.png").stat().st_size > 1000
    assert "| run-a/yali-r1 | 513-1152 | 3 |" in cp.stdout
    assert "| run-b/yali-r1 | 513-1152 | 2 | 78.00 | 78.00 | 76.00 | 80.00 |" in cp.stdout  # the median of two
    # two runs of one name (x/run, y/run): each start named by its run's path, none lost
    for parent in ("x", "y"):
        shutil.copytree(tmp_path / "run-a", tmp_path / parent / "run")
    cp = subprocess.run([sys.executable, "-m", "benchmarks.serving.step_times", str(tmp_path / "x" / "run"),
                         str(tmp_path / "y" / "run")], capture_output=True, text=True)
    assert cp.returncode == 0, cp.stderr
    assert f"| {tmp_path / 'x' / 'run'}/yali-r1 | 513-1152 | 3 |" in cp.stdout
    assert f"| {tmp_path / 'y' / 'run'}/yali-r1 | 513-1152 | 3 |" in cp.stdout
