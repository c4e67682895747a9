"""A TP worker killed under `vllm serve` with YALI on (GPU host only: TP=2, and TP=4 on a host with
four GPUs).

16 clients stream long completions from a TP=2 or TP=4 server of the embedded 8B model (with
YALI_WORLD_SIZES=all, as the benchmarks' yali configurations run); one worker (the one on the last
GPU of the server) gets SIGKILL mid-run. Within KILL_BOUND_S of the kill every stream has
ended (an error, or the connection closed), the server has exited or answers errors, no process
of the server still holds a GPU, and the server's log says why. The surviving rank is either
stopped by vLLM's executor or, if it is left inside a YALI kernel waiting for the dead peer, ends
there after YALI_TIMEOUT_S (20 s here) with a `YALI error` line: the bound is that timeout plus
vLLM's own shutdown.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from benchmarks.common.processes import free_port, stop_process_group

from . import vllm_serve
from .test_vllm_e2e import _SKIP, _timeout


CLIENTS = 16
TIMEOUT_S = 20  # YALI_TIMEOUT_S of the server
KILL_BOUND_S = TIMEOUT_S + 100  # from the kill: every stream ended, the server gone or failing, GPUs free
START_TIMEOUT_S = 600
# What the server's log says when a worker dies (vLLM's executor or engine) or YALI's watchdog fires.
REASONS = ("YALI error", "died", "EngineDeadError", "Engine core", "terminated", "SIGKILL")


def gpu_processes() -> dict[int, int]:
    """PID -> GPU index of every process with a context on a GPU (nvidia-smi)."""
    q = ["nvidia-smi", "--format=csv,noheader"]
    gpus = subprocess.run(q[:1] + ["--query-gpu=index,uuid"] + q[1:], capture_output=True, text=True,
                          timeout=30, check=True).stdout
    apps = subprocess.run(q[:1] + ["--query-compute-apps=pid,gpu_uuid"] + q[1:], capture_output=True, text=True,
                          timeout=30, check=True).stdout
    return parse_gpu_processes(gpus, apps)


def parse_gpu_processes(gpus_csv: str, apps_csv: str) -> dict[int, int]:
    index = {uuid.strip(): int(i) for i, uuid in (ln.split(",") for ln in gpus_csv.splitlines() if "," in ln)}
    out = {}
    for ln in apps_csv.splitlines():
        if "," in ln:
            pid, uuid = ln.split(",", 1)
            if uuid.strip() in index:
                out[int(pid)] = index[uuid.strip()]
    return out


def in_group(pid: int, pgid: int) -> bool:
    try:
        return os.getpgid(pid) == pgid
    except ProcessLookupError:
        return False


def stream(base: str, model: str, i: int, out: dict) -> None:
    """One streamed completion: how many chunks arrived and how it ended ("done", "error" in the
    stream, or the exception that closed it), and when."""
    body = {"model": model, "prompt": f"Client {i} counts: " + " ".join(str(k) for k in range(40)),
            "max_tokens": 1500, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out["chunks"], out["end"] = 0, None
    try:
        with urllib.request.urlopen(req, timeout=KILL_BOUND_S) as r:
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    out["end"] = out["end"] or "done"
                    break
                if b'"error"' in line:
                    out["end"] = "error"
                else:
                    out["chunks"] += 1
            out["end"] = out["end"] or "closed"
    except Exception as e:  # the connection reset or refused, an HTTP error: the stream ended
        out["end"] = f"{type(e).__name__}"
    out["ended_at"] = time.monotonic()


@pytest.mark.cpu
def test_gpu_processes_are_read_from_nvidia_smi():
    gpus = "0, GPU-aaa\n1, GPU-bbb\n"
    apps = "4242, GPU-bbb\n4243, GPU-aaa\nNo running processes found\n"
    assert parse_gpu_processes(gpus, apps) == {4242: 1, 4243: 0}
    assert parse_gpu_processes(gpus, "") == {}


@pytest.mark.gpu
@pytest.mark.two_gpus
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
@pytest.mark.parametrize("tp", [2, 4], ids=lambda n: f"tp{n}")
@_timeout(START_TIMEOUT_S + KILL_BOUND_S + 180)
def test_a_killed_tp_worker_ends_the_server_within_a_bound(tmp_path, tp):
    import torch

    from yali_vllm.models import write_model_dir

    if torch.cuda.device_count() < tp:  # torch and two GPUs are there (_SKIP)
        pytest.skip(f"TP={tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
    model = write_model_dir(tmp_path / "model", "8b")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    env = vllm_serve.serve_env(vllm_serve.plugin_path(tmp_path / "site"), True, str(tmp_path / "cache"),
                               YALI_TIMEOUT_S=str(TIMEOUT_S), YALI_WORLD_SIZES="all")
    proc = vllm_serve.start_healthy(vllm_serve.serve_argv(model, port, max_num_seqs=CLIENTS, tp=tp), env, log, port,
                                    START_TIMEOUT_S)
    try:
        assert "YALI all-reduce ON" in log.read_text(errors="replace"), f"YALI is not on in the TP={tp} server"
        results = [{} for _ in range(CLIENTS)]
        threads = [threading.Thread(target=stream, args=(base, str(model), i, results[i]), daemon=True)
                   for i in range(CLIENTS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while not all(r.get("chunks") for r in results) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert all(r.get("chunks") for r in results), f"not every client was streaming: {results}"
        workers = {pid: gpu for pid, gpu in gpu_processes().items() if in_group(pid, proc.pid)}
        victims = [pid for pid, gpu in workers.items() if gpu == tp - 1]
        assert len(victims) == 1, f"the server's processes on the GPUs: {workers}"
        t_kill = time.monotonic()
        os.kill(victims[0], signal.SIGKILL)

        for t in threads:
            t.join(timeout=max(0.0, t_kill + KILL_BOUND_S - time.monotonic()))
        late = [r for r in results if r.get("ended_at") is None or r["ended_at"] - t_kill > KILL_BOUND_S]
        assert not late, f"streams still open {KILL_BOUND_S} s after the kill: {results}"
        assert any(r["end"] != "done" for r in results), f"every stream completed despite the kill: {results}"

        def server_failing() -> bool:
            if proc.poll() is not None:
                return True
            try:
                vllm_serve.post_json(base + "/v1/completions", {"model": str(model), "prompt": "x", "max_tokens": 4},
                                     timeout=10)
                return False
            except (urllib.error.URLError, ConnectionError, TimeoutError, AssertionError, OSError):
                return True

        while not server_failing() and time.monotonic() - t_kill < KILL_BOUND_S:
            time.sleep(2)
        assert server_failing(), f"the server still answers {KILL_BOUND_S} s after a worker was killed"
        while True:
            held = {pid: gpu for pid, gpu in gpu_processes().items() if in_group(pid, proc.pid)}
            if not held or time.monotonic() - t_kill >= KILL_BOUND_S:
                break
            time.sleep(2)
        assert not held, f"the server's processes still hold GPUs {KILL_BOUND_S} s after the kill: {held}"
        print(f"kill -> streams ended in {max(r['ended_at'] for r in results) - t_kill:.1f} s; "
              f"ends: {sorted({r['end'] for r in results})}; server exited: {proc.poll()}")
    finally:
        stop_process_group(proc, grace_s=30)
    text = log.read_text(errors="replace")
    assert any(reason in text for reason in REASONS), "no reason in the server's log:\n" + text[-6000:]
