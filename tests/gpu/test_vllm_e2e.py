"""End-to-end vLLM tests of the YALI plugin on 2 NVLink GPUs (GPU host only).

Model: the embedded Llama-3-8B-shaped config (yali_vllm.models) with vLLM's
dummy (random, seeded) weights and the Tekken tokenizer; TP=2.

* Greedy token ids with YALI equal those with YALI_ENABLE=0 (vLLM's custom
  all-reduce) and with NCCL only (disable_custom_all_reduce=True), in eager
  mode and in CUDA-graph mode.  With 2 ranks every backend computes a+b
  exactly once per element, so the results are bit-identical and so are the
  tokens.
* YALI's device-side kernel counter grows during generation by at least
  2 x layers per decode step: in CUDA-graph mode decode steps are graph
  replays (no Python runs), so this proves the captured graphs hold YALI's
  kernels rather than a fallback.  The CUDA-graph runs turn vLLM's FlashInfer
  all-reduce+RMSNorm fusion off, otherwise it would take those all-reduces
  (see docs/VLLM_INTEGRATION.md); one more pair of runs keeps vLLM's default
  configuration and checks tokens only.
* `vllm serve` starts with the plugin from its entry point, logs the YALI
  selection line, and answers /v1/completions and /v1/chat/completions.

Every configuration runs in a fresh subprocess (tests/gpu/vllm_generate.py),
bounded by a timeout, with NVLink multicast off.  About 8 vLLM start-ups in
all; each is kept small (max_model_len 2048, 4 prompts x 32 tokens,
gpu_memory_utilization 0.5, 4 CUDA-graph sizes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "vllm_generate.py"
REPO = HERE.parents[1]

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm",
}
RUN_TIMEOUT_S = 900  # one vLLM start-up + generation (compile included)
SERVE_TIMEOUT_S = 900


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.cuda.device_count() < 2:
        return "needs 2 GPUs"
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    try:
        import yali_vllm
    except Exception as e:  # pragma: no cover
        return f"yali_vllm cannot be imported: {e}"
    reason = yali_vllm.unavailable_reason()
    if reason:
        return f"YALI extension unavailable: {reason}"
    return None


def _timeout(seconds: int):
    """pytest-timeout's mark when that plugin is installed (no unknown-mark
    warning otherwise); the subprocess timeouts below bound the runs anyway."""
    if importlib.util.find_spec("pytest_timeout") is None:
        return lambda f: f
    return pytest.mark.timeout(seconds)


_SKIP = _skip_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_SKIP is not None, reason=_SKIP or ""),
]


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(
        ep.value == "yali_vllm.vllm_plugin:register"
        for ep in entry_points(group="vllm.general_plugins")
    )


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> str:
    """Extra PYTHONPATH so vLLM's processes load the plugin.

    vLLM finds general plugins through package metadata.  When yali-vllm is
    not pip-installed (tests run from the checkout), a minimal .dist-info
    declaring the same entry point is written next to the checkout's path.
    """
    paths = [str(REPO)]
    if not _entry_point_installed():
        site = tmp_path_factory.mktemp("plugin-site")
        info = site / "yali_vllm_checkout-0.0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: yali-vllm-checkout\nVersion: 0.0.0\n"
        )
        (info / "entry_points.txt").write_text(
            "[vllm.general_plugins]\nyali = yali_vllm.vllm_plugin:register\n"
        )
        paths.append(str(site))
    return os.pathsep.join(paths)


def _env(plugin_path: str, yali: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MULTICAST_OFF)
    env["YALI_ENABLE"] = "1" if yali else "0"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (plugin_path, env.get("PYTHONPATH", "")) if p)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    return env


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the process we started and everything it spawned (its own
    session/process group): SIGTERM, a grace period, then SIGKILL."""
    for sig, grace_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        proc.poll()  # reap the leader so an exited one does not linger
        if not _group_alive(proc.pid):
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()
            if not _group_alive(proc.pid):
                return
            time.sleep(0.5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from yali_vllm.models import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("llama8b") / "model", "8b")


_RESULTS: dict[tuple, dict] = {}


def _generate(
    model_dir: Path,
    plugin_path: str,
    tmp: Path,
    *,
    yali: bool,
    eager: bool,
    nccl: bool = False,
    fuse: str = "default",
) -> dict:
    """Run (or reuse) one configuration; returns the runner's JSON."""
    key = (yali, eager, nccl, fuse)
    if key in _RESULTS:
        return _RESULTS[key]
    name = (
        f"{'yali' if yali else 'noyali'}-{'eager' if eager else 'graph'}-"
        f"{'nccl' if nccl else 'ca'}-fuse_{fuse}"
    )
    out = tmp / f"{name}.json"
    log = tmp / f"{name}.log"
    cmd = [
        sys.executable,
        str(RUNNER),
        "--model-dir",
        str(model_dir),
        "--out",
        str(out),
        "--fuse",
        fuse,
    ]
    if eager:
        cmd.append("--eager")
    if nccl:
        cmd.append("--nccl")
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            cmd,
            env=_env(plugin_path, yali),
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _kill_group(proc)  # also reaps workers a clean exit left behind
    tail = log.read_text(errors="replace")[-6000:]
    assert rc == 0 and out.is_file(), f"{name} failed (rc={rc}); log tail:\n{tail}"
    result = json.loads(out.read_text())
    result["log"] = log.read_text(errors="replace")
    print(
        f"{name}: startup {result['startup_s']} s, generate {result['generate_s']} s, "
        f"YALI calls {_yali_calls(result)}"
    )
    _RESULTS[key] = result
    return result


def _yali_calls(result: dict) -> list[int] | None:
    """Per-rank growth of YALI's device counter during generate()."""
    before, after = result["stats_before"], result["stats_after"]
    if not all(s["yali"] for s in after):
        return None
    return [a["device_calls"] - b["device_calls"] for a, b in zip(after, before, strict=True)]


def _check_trio(model_dir: Path, plugin_path: str, tmp: Path, *, eager: bool, fuse: str) -> None:
    yali = _generate(model_dir, plugin_path, tmp, yali=True, eager=eager, fuse=fuse)
    custom = _generate(model_dir, plugin_path, tmp, yali=False, eager=eager, fuse=fuse)
    nccl = _generate(model_dir, plugin_path, tmp, yali=False, eager=eager, nccl=True, fuse=fuse)

    # Which backend served: YALI on both ranks in the YALI run only.
    assert [s["yali"] for s in yali["stats_after"]] == [True, True], yali["stats_after"]
    assert [s["yali"] for s in custom["stats_after"]] == [False, False]
    assert [s["yali"] for s in nccl["stats_after"]] == [False, False]
    assert "YALI all-reduce ON for group 'tp:0'" in yali["log"]
    assert "YALI all-reduce OFF for group 'tp:0': disabled by YALI_ENABLE" in custom["log"]

    # YALI served every all-reduce of every step: >= 2 per layer per decode
    # step (plus the prefill and the embedding's).
    minimum = 2 * yali["num_layers"] * (yali["max_tokens"] - 1)
    calls = _yali_calls(yali)
    assert calls is not None and all(c >= minimum for c in calls), (calls, minimum)

    assert yali["token_ids"] == custom["token_ids"], "YALI vs vLLM custom all-reduce"
    assert yali["token_ids"] == nccl["token_ids"], "YALI vs NCCL"
    assert all(len(t) == yali["max_tokens"] for t in yali["token_ids"])


@_timeout(3 * RUN_TIMEOUT_S + 60)
def test_eager_tokens_match_custom_ar_and_nccl(model_dir, plugin_path, tmp_path_factory):
    _check_trio(
        model_dir, plugin_path, tmp_path_factory.mktemp("eager"), eager=True, fuse="default"
    )


@_timeout(3 * RUN_TIMEOUT_S + 60)
def test_cuda_graph_tokens_match_and_graphs_run_yali(model_dir, plugin_path, tmp_path_factory):
    _check_trio(model_dir, plugin_path, tmp_path_factory.mktemp("graph"), eager=False, fuse="off")


@_timeout(2 * RUN_TIMEOUT_S + 60)
def test_vllm_default_config_tokens_match(model_dir, plugin_path, tmp_path_factory):
    """vLLM's default compile config (FlashInfer AR+RMSNorm fusion as vLLM
    sets it): YALI gets the all-reduces the fusion leaves, possibly none."""
    tmp = tmp_path_factory.mktemp("default")
    yali = _generate(model_dir, plugin_path, tmp, yali=True, eager=False)
    custom = _generate(model_dir, plugin_path, tmp, yali=False, eager=False)
    assert [s["yali"] for s in yali["stats_after"]] == [True, True]
    assert yali["token_ids"] == custom["token_ids"]
    print(
        f"default config: YALI device calls during generate: {_yali_calls(yali)} "
        f"(the rest went through vLLM's fused all-reduce+RMSNorm)"
    )


# ------------------------------------------------------------------ vllm serve
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_cmd() -> list[str]:
    exe = shutil.which("vllm")
    return [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        return json.loads(r.read())


@_timeout(SERVE_TIMEOUT_S + 120)
def test_vllm_serve_selects_yali_and_answers(model_dir, plugin_path, tmp_path):
    port = _free_port()
    log = tmp_path / "serve.log"
    cmd = _vllm_cmd() + [
        "serve",
        str(model_dir),
        "--tensor-parallel-size",
        "2",
        "--load-format",
        "dummy",
        "--tokenizer-mode",
        "mistral",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "8",
        "--gpu-memory-utilization",
        "0.5",
        # Eager keeps start-up short; CUDA graphs are covered above.
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    base = f"http://127.0.0.1:{port}"
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            cmd,
            env=_env(plugin_path, True),
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + SERVE_TIMEOUT_S
            while True:
                assert proc.poll() is None, (
                    f"vllm serve exited with {proc.returncode}:\n"
                    + log.read_text(errors="replace")[-6000:]
                )
                try:
                    with urllib.request.urlopen(base + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                assert time.monotonic() < deadline, (
                    "vllm serve not healthy in time:\n" + log.read_text(errors="replace")[-6000:]
                )
                time.sleep(3)

            comp = _post(
                base + "/v1/completions",
                {
                    "model": str(model_dir),
                    "prompt": "The capital of France is",
                    "max_tokens": 16,
                    "temperature": 0,
                },
            )
            assert comp["choices"] and comp["usage"]["completion_tokens"] > 0
            chat = _post(
                base + "/v1/chat/completions",
                {
                    "model": str(model_dir),
                    "messages": [{"role": "user", "content": "Say hello."}],
                    "max_tokens": 16,
                    "temperature": 0,
                },
            )
            assert chat["choices"] and chat["choices"][0]["message"]["role"] == "assistant"
            assert chat["usage"]["completion_tokens"] > 0
        finally:
            _kill_group(proc)
    text = log.read_text(errors="replace")
    on_lines = [ln for ln in text.splitlines() if "YALI all-reduce ON for group 'tp:0'" in ln]
    assert len(on_lines) == 2, "expected one YALI selection line per TP rank:\n" + text[-6000:]
