#!/usr/bin/env python3
"""The main job: write the embedded Llama-shaped dummy model (no download), serve
it with `vllm serve --tensor-parallel-size 2` and the YALI plugin, send one real
completion request, print the answer and the YALI lines of the server log, stop
the server.

It needs the installed packages only (yali-vllm, vLLM), nothing else of this repository.
Without 2 GPUs (or without vLLM) it says so and exits 0 after writing the model.
  python examples/serve_demo.py [--size 8b|70b] [--dir DIR [--force]]

The model goes to a directory of this user's own (<temp dir>/yali-model-<uid>), rewritten on
every run; another --dir that is not empty (and holds no copy of the same model) needs --force.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_DIR = os.path.join(tempfile.gettempdir(), f"yali-model-{os.getuid()}")


# 127.0.0.1 only, never through a proxy.
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def positive_float(text: str) -> float:
    """A finite number > 0 (nan and inf are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number > 0") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number > 0")
    return value


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def wait_healthy(proc: subprocess.Popen, base_url: str, log: Path, timeout_s: float) -> float:
    """Seconds until GET /health answered 200; RuntimeError with the log's tail when the server
    exits first or is still starting after timeout_s."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {proc.returncode} before it was healthy; "
                               f"the end of {log}:\n{log_tail(log)}")
        with contextlib.suppress(OSError):
            with _LOCAL.open(base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"vllm serve still starting after --startup-timeout {timeout_s:g} s; "
                               f"the end of {log}:\n{log_tail(log)}")
        time.sleep(1)


def post_json(url: str, payload: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with _LOCAL.open(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM to the server's process group (its workers too), SIGKILL after grace_s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8b", choices=["8b", "70b"])
    ap.add_argument("--dir", default=DEFAULT_DIR, help="model directory (default %(default)s)")
    ap.add_argument("--force", action="store_true",
                    help="write the model into a --dir that is not empty (config.json and tekken.json are replaced)")
    ap.add_argument("--startup-timeout", type=positive_float, default=900)
    ap.add_argument("--prompt", default="The fastest way to add two tensors across two GPUs is")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)

    import torch

    import yali_vllm
    from yali_vllm.models import serve_command, write_model_dir

    try:
        # Its own default directory is rewritten on every run.
        model = write_model_dir(args.dir, args.size, force=args.force or args.dir == DEFAULT_DIR)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    print(f"[demo] wrote the embedded {args.size} model to {model}")
    print(f"[demo] YALI extension: {'available' if yali_vllm.available() else yali_vllm.unavailable_reason()}")
    vllm_bin = shutil.which("vllm")
    if torch.cuda.device_count() < 2 or not vllm_bin:
        print(f"[demo] serving needs 2 NVLink GPUs and vLLM ({torch.cuda.device_count()} GPUs, vllm "
              f"{'found' if vllm_bin else 'not installed'}): stopping after the set-up")
        return 0

    port = free_port()
    log = Path(args.dir) / "serve.log"
    cmd = serve_command(model, 2, vllm=(vllm_bin,), max_model_len=2048)
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", "0.85"]
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
    print(f"[demo] starting: {' '.join(cmd)}  (log: {log})", flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}"
        waited = wait_healthy(proc, base_url, log, args.startup_timeout)
        print(f"[demo] server healthy after {waited:.0f}s", flush=True)
        resp = post_json(base_url + "/v1/completions",
                         {"model": str(model), "prompt": args.prompt, "max_tokens": 32, "temperature": 0}, 120)
    finally:
        stop(proc)
    text = resp["choices"][0]["text"]
    print(f"[demo] completion ({resp['usage']['completion_tokens']} tokens, random weights): {text!r}")
    yali_lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if "YALI" in ln]
    print("[demo] YALI lines in the server log:\n  " + "\n  ".join(yali_lines[-6:]))
    return 0 if any("YALI all-reduce ON" in ln for ln in yali_lines) else 1


if __name__ == "__main__":
    sys.exit(main())
