"""The GPU-host scripts (lab/gpu_host/) run only on the GPU host, where a mistake costs device
time: check here that they parse, keep NVLink multicast off, and name only kernel knobs that exist."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common.gpu_env import MULTICAST_OFF_ENV

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "lab" / "gpu_host").glob("*.sh"))


def known_dev_knobs() -> set[str]:
    """The YALI_DEV_* names the C++ core accepts: those settings.def declares."""
    from yali_vllm import config

    names = {n for n in config.SETTINGS if n.startswith(config.DEV_PREFIX)}
    assert len(names) >= 10, f"found only {sorted(names)} in settings.def"
    return names


def test_there_are_scripts():
    assert len(SCRIPTS) >= 5 and (REPO / "lab" / "gpu_host" / "env.sh") in SCRIPTS


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_env_sh_turns_multicast_off(tmp_path):
    """Sourced from the checkout's root with a stack environment that turns multicast on
    (as a stand-in for /opt/gpu-stack/env.sh), env.sh still exports gpu_env's settings."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "OUT": str(tmp_path / "out"), "NCCL_NVLS_ENABLE": "1"}
    r = subprocess.run(["bash", "-c", ". lab/gpu_host/env.sh && env"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    exported = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    for name, value in MULTICAST_OFF_ENV.items():
        assert exported.get(name) == value, (name, exported.get(name))
    assert str(REPO) in exported["PYTHONPATH"].split(":")


def test_quickstart_turns_multicast_off_from_gpu_env():
    text = (REPO / "scripts" / "quickstart.sh").read_text()
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    takes = next(i for i, line in enumerate(lines) if "-m benchmarks.common.gpu_env" in line)
    evals = next(i for i, line in enumerate(lines) if line.startswith('eval "$MULTICAST_OFF"'))
    first_python = next(i for i, line in enumerate(lines)  # a module or script run, not pip or venv
                        if re.search(r"\bpython\S* (-m (?!pip|venv)|\S+\.py)", line) and "gpu_env" not in line)
    assert takes < evals < first_python


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.name != "env.sh"], ids=lambda p: p.name)
def test_script_sources_env_before_running_python(script):
    text = script.read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    first_python = next((i for i, line in enumerate(lines) if "python3 " in line), None)
    if first_python is None:
        pytest.skip("runs no python")
    sources = [i for i, line in enumerate(lines) if re.search(r"(^|;|\s)(\.|source) lab/gpu_host/env\.sh", line)]
    # install_and_bench.sh installs the stack first and sources env.sh after; the others at the top
    assert sources and sources[0] < first_python, f"{script.name} runs python before sourcing env.sh"


def test_only_existing_kernel_knobs_are_named():
    known = known_dev_knobs()
    assert "YALI_DEV_FUSED_BATCH_POLL_MIN" in known and "YALI_DEV_BATCH_POLL" not in known
    files = [*SCRIPTS, REPO / "lab" / "tune.py", *sorted((REPO / "tests" / "gpu").glob("*.py"))]
    for f in files:
        # names in settings, not in comments that record what was removed
        code = "\n".join(line.split("#", 1)[0] for line in f.read_text().splitlines())
        unknown = set(re.findall(r"YALI_DEV_\w+", code)) - known
        assert not unknown, f"{f.relative_to(REPO)} names knobs the core refuses: {sorted(unknown)}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_test_files_named_exist(script):
    named = set(re.findall(r"\btests/[\w/]+\.py\b", script.read_text()))
    missing = sorted(p for p in named if not (REPO / p).is_file())
    assert not missing, f"{script.name} runs test files that do not exist: {missing}"


SHARED_GPU = REPO / "lab" / "gpu_host" / "shared_gpu.sh"


def shared_gpu_parts() -> dict[str, str]:
    """The parts of shared_gpu.sh (its case arms, `*` left out), name -> the arm's commands."""
    arms = re.findall(r"^  (\w+)\)(.*?);;", SHARED_GPU.read_text(), re.M | re.S)
    assert arms, "no case arms found in shared_gpu.sh"
    return dict(arms)


def test_shared_gpu_usage_names_every_part():
    parts = list(shared_gpu_parts())
    text = SHARED_GPU.read_text()
    usage = re.search(r'usage: \$0 \[([\w|]+)\]', text)
    header = re.search(r"^#\s+shared_gpu\.sh \[([\w|]+)\]", text, re.M)
    assert usage and header, "shared_gpu.sh: no usage line or header line"
    assert usage.group(1).split("|") == parts
    assert header.group(1).split("|") == parts


def test_shared_gpu_parts_are_bounded_and_recorded():
    for name, commands in shared_gpu_parts().items():
        calls = re.findall(r'run_part (\w+) "\$\{(SHARED_\w+_S):-(\d+)\}" (tests/gpu/\S+\.py)', commands)
        assert calls, f"part {name} runs no run_part"
        for part, var, bound, _ in calls:
            # one part's result file per run_part, its bound within a 10-minute command
            assert var == f"SHARED_{part.upper()}_S" and int(bound) <= 570, (name, part, var, bound)
    assert re.search(r'run_part ranks "\$\{SHARED_RANKS_S:-\d+\}" tests/gpu/test_ranks\.py',
                     shared_gpu_parts()["ranks"])


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_shared_gpu_refuses_an_unknown_part_with_its_usage(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", str(SHARED_GPU), "no-such-part"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "usage:" in r.stderr and "|ranks|ep|delays|progress|abort]" in r.stderr, r.stderr
    assert not list((tmp_path / "out").glob("gpu-tests-shared-*")), "an unknown part wrote a result"


FLASHINFER_AOT = REPO / "lab" / "gpu_host" / "flashinfer_aot.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_flashinfer_aot_needs_a_verb_and_a_dir(tmp_path):
    for args in ([], ["install"], ["copy", str(tmp_path)]):
        r = subprocess.run(["bash", str(FLASHINFER_AOT), *args], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "usage:" in r.stderr, (args, r.stderr)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_flashinfer_aot_refuses_a_build_for_another_flashinfer(tmp_path):
    flashinfer = pytest.importorskip("flashinfer")
    (tmp_path / "VERSION").write_text("flashinfer 0.0.1\n")
    (tmp_path / "trtllm_comm.so").write_bytes(b"not a library")
    # this interpreter's python3 (the one with flashinfer) first on PATH, as the host's stack is
    env = {**os.environ, "TMPDIR": str(tmp_path), "OUT": str(tmp_path / "out"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", str(FLASHINFER_AOT), "install", str(tmp_path)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "flashinfer 0.0.1" in r.stderr and f"flashinfer {flashinfer.__version__}" in r.stderr, r.stderr
    assert "not installed" in r.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_serving_sh_passes_the_quantisation_and_names_its_results_by_it(tmp_path):
    """QUANT=fp8-block: serving_bench gets --quant fp8-block and the result name carries it (a
    python3 on PATH that records the benchmark's arguments stands in for the run)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    argv_file = tmp_path / "argv"
    stub = bin_dir / "python3"
    stub.write_text(f"""#!/bin/sh
case "$*" in *benchmarks.serving_bench*) printf '%s\\n' "$@" > {argv_file}; exit 0;; esac
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "TMPDIR": str(tmp_path), "OUT": str(out), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "QUANT": "fp8-block", "MODEL_SIZE": "8b"}
    subprocess.run(["bash", str(REPO / "lab" / "gpu_host" / "serving.sh"), "1", "q1"], cwd=REPO, env=env,
                   capture_output=True, text=True, timeout=120)
    argv = argv_file.read_text().splitlines()
    assert argv[argv.index("--quant") + 1] == "fp8-block" and argv[argv.index("--model-size") + 1] == "8b"
    (log,) = out.glob("serving-*.log")
    assert re.fullmatch(r"serving-8b-fp8-block-\d{8}-q1\.log", log.name), log.name
    env["QUANT"] = "none"
    subprocess.run(["bash", str(REPO / "lab" / "gpu_host" / "serving.sh"), "1", "q2"], cwd=REPO, env=env,
                   capture_output=True, text=True, timeout=120)
    assert argv_file.read_text().splitlines()[argv.index("--quant") + 1] == "none"
    assert [p.name for p in out.glob("serving-8b-2*-q2.log")], sorted(p.name for p in out.iterdir())
