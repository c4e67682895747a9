"""`vllm serve` for the GPU tests: the plugin on the path of vLLM's processes, the command, and a
start that is healthy within a bound or fails with the log's tail. Shared by test_vllm_e2e.py and
test_vllm_fault.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.common.gpu_env import MULTICAST_OFF_ENV
from benchmarks.common.processes import stop_process_group

REPO = Path(__file__).resolve().parents[2]


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value == "yali_vllm.plugin:register" for ep in entry_points(group="vllm.general_plugins"))


def plugin_path(site: Path) -> str:
    """Extra PYTHONPATH so vLLM's processes load the plugin: the checkout and, when yali-vllm is not
    pip-installed (tests run from the checkout), a minimal .dist-info under ``site`` declaring the
    same entry point (vLLM finds general plugins through package metadata)."""
    paths = [str(REPO)]
    if not _entry_point_installed():
        info = site / "yali_vllm_checkout-0.0.0.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: yali-vllm-checkout\nVersion: 0.0.0\n")
        (info / "entry_points.txt").write_text("[vllm.general_plugins]\nyali = yali_vllm.plugin:register\n")
        paths.append(str(site))
    return os.pathsep.join(paths)


def serve_env(plugin_path_: str, yali: bool, cache_root: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of a vLLM process: multicast off, the plugin on its path, YALI on or off."""
    env = dict(os.environ)
    env.update(MULTICAST_OFF_ENV)
    if cache_root:
        env["VLLM_CACHE_ROOT"] = cache_root
    env["YALI_ENABLE"] = "1" if yali else "0"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (plugin_path_, env.get("PYTHONPATH", "")) if p)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.update(extra)
    return env


def vllm_cmd() -> list[str]:
    exe = shutil.which("vllm")
    return [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def serve_argv(model_dir: Path, port: int, max_num_seqs: int = 8, tp: int = 2) -> list[str]:
    """TP=`tp` of the embedded model with dummy weights, eager (a short start-up), on 127.0.0.1."""
    return vllm_cmd() + [
        "serve", str(model_dir), "--tensor-parallel-size", str(tp), "--load-format", "dummy", "--tokenizer-mode",
        "mistral", "--max-model-len", "2048", "--max-num-seqs", str(max_num_seqs), "--gpu-memory-utilization",
        "0.5", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
    ]


def start_healthy(cmd: list[str], env: dict[str, str], log: Path, port: int, timeout_s: float) -> subprocess.Popen:
    """The server in its own process group, once /health answers 200; stopped, with the log's tail
    in the AssertionError, if it exits or is not healthy within ``timeout_s``."""
    logf = open(log, "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    logf.close()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            assert proc.poll() is None, (f"vllm serve exited with {proc.returncode}:\n"
                                         + log.read_text(errors="replace")[-6000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        return proc
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, "vllm serve not healthy in time:\n" + log.read_text(errors="replace")[-6000:]
            time.sleep(3)
    except BaseException:
        stop_process_group(proc, grace_s=60)
        raise


def post_json(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        return json.loads(r.read())
