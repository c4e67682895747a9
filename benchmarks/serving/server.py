"""``vllm serve`` per configuration: its command and environment, start, health, stop (the whole
process group, then the GPUs' memory), warm-up."""

from __future__ import annotations

import concurrent.futures
import contextlib
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common.gpu_env import child_env
from benchmarks.common.processes import stop_process_group
from benchmarks.serving.budget import Deadline
from benchmarks.serving.commands import ServerError, popen_logged, split_command, tail_lines
from benchmarks.serving.configs import SERVER_CONFIGS, ServerConfig
from benchmarks.serving.http import http_post_json, http_status
from benchmarks.serving.logs import YALI_ON_RE, scan_server_log, yali_log_warnings


def server_command(
    vllm_bin: str,
    model_dir: str | Path,
    cfg: ServerConfig,
    port: int,
    *,
    tensor_parallel_size: int = 2,
    max_model_len: int = 2048,
    gpu_memory_utilization: float = 0.90,
    max_num_seqs: int | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    from yali_vllm.models import serve_command  # how the embedded model must be served

    dp = tensor_parallel_size if cfg.parallel == "dp-ep" else 0  # the same N GPUs, data + expert parallel
    cmd = serve_command(model_dir, tensor_parallel_size, vllm=split_command(vllm_bin), max_model_len=max_model_len,
                        data_parallel_size=dp)
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", str(gpu_memory_utilization)]
    if max_num_seqs:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    cmd += list(cfg.args)
    cmd += list(extra_args)
    return cmd


def server_command_for(args: Any, model_dir: str | Path, cfg: str, port: int) -> list[str]:
    """server_command() from a parsed command line (serving_bench's and load_test's share the flags)."""
    return server_command(
        args.vllm_bin,
        model_dir,
        SERVER_CONFIGS[cfg],
        port,
        tensor_parallel_size=args.world_size,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        extra_args=shlex.split(args.extra_server_args),
    )


def server_env(cfg: ServerConfig) -> dict[str, str]:
    return child_env(cfg.env)


@dataclass
class Server:
    config: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    cmd: list[str]
    started: float = field(default_factory=time.monotonic)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0


def start_server(cmd: Sequence[str], env: dict[str, str], log_path: Path, port: int, config: str) -> Server:
    proc = popen_logged(cmd, env, log_path, env_line=True)
    return Server(config=config, port=port, proc=proc, log_path=log_path, cmd=list(cmd))


def wait_healthy(server: Server, timeout_s: float, poll_s: float = 0.5, bound: str = "--startup-timeout-s") -> float:
    """Poll ``/health`` until 200; fail fast (with the log tail) if the server dies. ``bound``
    names what set timeout_s, for the message of a server still starting when it runs out."""
    t0 = time.monotonic()
    end = t0 + max(0.0, timeout_s)
    url = server.base_url + "/health"
    while True:
        if not server.alive():
            tail = "\n".join(tail_lines(server.log_path, 50))
            raise ServerError(
                f"server {server.config} (pid {server.proc.pid}) exited with code "
                f"{server.proc.returncode} before becoming healthy; last 50 log lines:\n{tail}"
            )
        if http_status(url, timeout_s=2.0) == 200:
            return time.monotonic() - t0
        if time.monotonic() >= end:
            tail = "\n".join(tail_lines(server.log_path, 50))
            raise ServerError(
                f"server {server.config} still starting (alive, not healthy) after {timeout_s:.0f}s, when "
                f"{bound} ended the wait; last 50 log lines:\n{tail}"
            )
        time.sleep(poll_s)


def startup_wait(deadline: Deadline, startup_timeout_s: float, reserve_s: float) -> tuple[float, str]:
    """wait_healthy's timeout_s and bound for a server start inside a budgeted run."""
    wait_s = deadline.clip(startup_timeout_s, reserve_s)
    return wait_s, "--startup-timeout-s" if wait_s >= startup_timeout_s else "the run's budget (--budget-s)"


def wait_ready(server: Server, deadline: Deadline, startup_timeout_s: float, reserve_s: float, model: str,
               warmup_requests: int) -> tuple[float, int, int]:
    """A server started inside a budgeted run: healthy within ``startup_timeout_s`` or what the budget
    leaves, then warmed up. Returns (seconds until healthy, warm-up requests that succeeded, failed)."""
    wait_s, bound = startup_wait(deadline, startup_timeout_s, reserve_s)
    waited = wait_healthy(server, wait_s, bound=bound)
    ok, bad = warmup_server(server.base_url, model, warmup_requests, timeout_s=deadline.clip(60.0, reserve_s))
    return waited, ok, bad


def stop_server(server: Server, grace_s: float = 30.0, gpu_free_timeout_s: float = 30.0) -> None:
    """Stop the server's process group, then wait (bounded) for the GPUs' memory to be released."""
    stop_process_group(server.proc, grace_s=grace_s)
    wait_gpu_memory_released(timeout_s=gpu_free_timeout_s)


def stop_and_scan(server: Server, out: Path, grace_s: float) -> dict[str, Any]:
    """Stops the server, then scans its log up to the stop (shutdown noise excluded):
    log file (relative to ``out``), key lines, errors, whether YALI was on, and the
    warnings of yali_log_warnings() for the server's configuration."""
    stop_offset = server.log_size()
    stop_server(server, grace_s=grace_s)
    scan = scan_server_log(server.log_path, 0, stop_offset)
    entry = {"log_file": str(server.log_path.relative_to(out)), **scan}
    entry["yali_on"] = any(YALI_ON_RE.search(ln) for ln in scan["key_lines"])
    entry["warnings"] = yali_log_warnings(server.config, scan["key_lines"])
    return entry


def stop_and_record(server: Server, out: Path, grace_s: float, doc: dict[str, Any], tag: str, say,
                    **keys: Any) -> dict[str, Any]:
    """stop_and_scan, told through ``say`` under ``tag`` (the stop and each warning), its entry
    (``keys`` first) appended to ``doc["server_logs"]`` and returned."""
    say(f"{tag}: stopping server (pid {server.proc.pid}, process group)")
    entry = {**keys, **stop_and_scan(server, out, grace_s)}
    for w in entry["warnings"]:
        say(f"{tag}: WARNING: {w}")
    doc["server_logs"].append(entry)
    return entry


def gpu_memory_used_mib() -> list[int] | None:
    """Used memory per GPU from nvidia-smi, or None without nvidia-smi."""
    import shutil

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        cp = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=15,
            env=child_env(),
            check=False,
        )
        return [int(float(x)) for x in cp.stdout.split()] if cp.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def wait_gpu_memory_released(timeout_s: float = 30.0, max_used_mib: int = 4096) -> bool:
    """So that the next server's memory profiling sees free GPUs."""
    end = time.monotonic() + max(0.0, timeout_s)
    while True:
        used = gpu_memory_used_mib()
        if used is None or all(u <= max_used_mib for u in used):
            return True
        if time.monotonic() >= end:
            print(f"warning: GPU memory still in use after the server stopped: {used} MiB", flush=True)
            return False
        time.sleep(1.0)


@contextlib.contextmanager
def running_server(
    cmd: Sequence[str],
    env: dict[str, str],
    log_path: Path,
    port: int,
    config: str,
    *,
    startup_timeout_s: float,
    stop_grace_s: float = 30.0,
    on_started: Callable[[Server, float], None] | None = None,
) -> Iterator[Server]:
    """Start a server, wait for health, yield it; always stop its process group."""
    server = start_server(cmd, env, log_path, port, config)
    try:
        waited = wait_healthy(server, startup_timeout_s)
        if on_started:
            on_started(server, waited)
        yield server
    finally:
        stop_server(server, grace_s=stop_grace_s)


def warmup_server(base_url: str, model: str, n: int, *, max_tokens: int = 16, timeout_s: float = 60.0) -> tuple[int, int]:
    """A few short completions (prompts unlike the benchmark's, so no prefix-cache hits)."""
    if n <= 0:
        return (0, 0)

    def one(i: int) -> bool:
        prompt = f"Warm-up request {i}: " + " ".join(f"w{(i * 7 + k) % 101}" for k in range(64))
        try:
            out = http_post_json(
                base_url + "/v1/completions",
                {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
                timeout_s,
            )
            return bool(out.get("choices"))
        except Exception:
            return False

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(n, 8)) as ex:
        results = list(ex.map(one, range(n)))
    ok = sum(results)
    return ok, n - ok


# ================================================================ log scanning
