#!/usr/bin/env python3
"""End-to-end serving benchmark: yali vs vLLM's own all-reduce paths.

For each configuration (``yali``, ``vllm-default``, ``nccl``) x ``--repeats``
(interleaved: yali, vllm-default, nccl, yali, ...) this starts
``vllm serve`` on the embedded dummy model with tensor parallelism 2, drives it
with vLLM's own ``vllm bench serve`` (random dataset) at each ``--concurrency``,
and writes under ``--out``:

* ``serving-benchmark.json``  -- the result file (schema in docs/BENCHMARKS.md)
* ``serving-benchmark.md``    -- comparison tables with a "no difference" verdict
* ``tpot_p50.png``, ``itl_p99.png`` -- plots (if matplotlib is installed)
* ``server-logs/<config>-r<repeat>.log`` -- every server's full log
* ``raw/`` -- every ``vllm bench serve`` result JSON and client log

The whole run is bounded by ``--budget-s``: every wait has a timeout clipped to
what is left, and every server is stopped (its whole process group) in a
``finally``.  ``--report-only RESULT.json`` regenerates table + plots;
``--report-only A.json B.json ... --out DIR`` merges runs (e.g. one repeat per
run) into one result, renumbering the repeats.
``--dry-run`` prints the commands without running anything.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime as _dt
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import (  # noqa: E402
    MULTICAST_OFF_ENV,
    REPO_ROOT,
    child_env,
    load_results_of_kind,
    merge_sources,
    output_dir,
    results_header,
    under,
    write_json_and_markdown,
    write_results,
)
from cli_args import fraction, non_negative_int, positive_float, positive_int, tcp_port  # noqa: E402

# yali_vllm from this checkout when it is not installed (an installed one comes first).
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

KIND = "serving-benchmark"
RESULT_NAME = "serving-benchmark.json"
DEFAULT_CONFIGS = ("yali", "vllm-default", "nccl")
NCCL_COMPILATION_CONFIG = {"pass_config": {"fuse_allreduce_rms": False}}

ROW_KEYS = (
    "config",
    "concurrency",
    "repeat",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
    "output_tok_s",
    "req_s",
    "failed",
)

# Row key -> keys of the JSON that vLLM 0.26's `vllm bench serve --save-result`
# writes (vllm/benchmarks/serve.py: process_one_metric() writes
# f"p{p}_{metric}_ms" for every --metric-percentiles entry, plus median_*).
VLLM_RESULT_KEYS: dict[str, tuple[str, ...]] = {
    "ttft_ms_p50": ("p50_ttft_ms", "median_ttft_ms"),
    "ttft_ms_p99": ("p99_ttft_ms",),
    "tpot_ms_p50": ("p50_tpot_ms", "median_tpot_ms"),
    "tpot_ms_p99": ("p99_tpot_ms",),
    "itl_ms_p50": ("p50_itl_ms", "median_itl_ms"),
    "itl_ms_p99": ("p99_itl_ms",),
    "output_tok_s": ("output_throughput",),
    "req_s": ("request_throughput",),
}
# Beyond the schema's row: the mean TPOT over a point's requests. Under mixed prefill/decode
# (concurrency 32) the per-request TPOTs spread and their median can move more than their mean.
EXTRA_RESULT_KEYS: dict[str, tuple[str, ...]] = {"tpot_ms_mean": ("mean_tpot_ms",)}


# ============================================================== configurations
@dataclass(frozen=True)
class ServerConfig:
    name: str
    env: dict[str, str]
    args: tuple[str, ...]
    description: str


SERVER_CONFIGS: dict[str, ServerConfig] = {
    "yali": ServerConfig(
        "yali",
        {"YALI_ENABLE": "1"},
        (),
        "yali plugin on (YALI_ENABLE=1); vLLM defaults otherwise",
    ),
    "vllm-default": ServerConfig(
        "vllm-default",
        {"YALI_ENABLE": "0"},
        (),
        "YALI_ENABLE=0: vLLM's custom all-reduce + FlashInfer all-reduce+RMSNorm "
        "fusion as vLLM configures it (backend trtllm)",
    ),
    # The control for a yali vs vllm-default difference outside the all-reduce: YALI's plugin, its
    # buffers and its all-reduce hook exactly as in "yali", but YALI_FUSION=0 makes vLLM build its
    # FlashInfer fusion, so every decode all-reduce (all fused with an RMSNorm) runs FlashInfer's
    # kernel, as in vllm-default.
    "yali-flashinfer-fusion": ServerConfig(
        "yali-flashinfer-fusion",
        {"YALI_ENABLE": "1", "YALI_FUSION": "0"},
        (),
        "yali plugin on, YALI_FUSION=0: vLLM's FlashInfer all-reduce+RMSNorm fusion serves the "
        "fused pairs (the control for effects of the plugin outside its fused kernel)",
    ),
    "nccl": ServerConfig(
        "nccl",
        {"YALI_ENABLE": "0"},
        (
            "--disable-custom-all-reduce",
            "--compilation-config",
            json.dumps(NCCL_COMPILATION_CONFIG),
        ),
        "YALI_ENABLE=0, --disable-custom-all-reduce, fuse_allreduce_rms off: NCCL only",
    ),
}


def parse_csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_int_list(text: str) -> list[int]:
    """"1,8,32" -> [1, 8, 32]: positive integers in the given order."""
    vals = [positive_int(t) for t in parse_csv_list(text)]
    if not vals:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def num_prompts_for(concurrency: int, per_concurrency: int, minimum: int) -> int:
    """Prompts for one benchmark point: scaled by concurrency, never below ``minimum``."""
    return max(int(minimum), int(per_concurrency) * int(concurrency))


def interleaved_schedule(configs: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """``[(1, yali), (1, vllm-default), (1, nccl), (2, yali), ...]`` (repeats are 1-based)."""
    return [(r, c) for r in range(1, repeats + 1) for c in configs]


# ================================================================== deadline
class Deadline:
    """A global time budget; every wait is clipped to what is left of it."""

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic):
        self.budget_s = float(budget_s)
        self._clock = clock
        self._t0 = clock()

    def elapsed(self) -> float:
        return self._clock() - self._t0

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def clip(self, timeout_s: float, reserve_s: float = 0.0) -> float:
        return max(0.0, min(float(timeout_s), self.remaining() - reserve_s))


class Progress:
    def __init__(self, tag: str, deadline: Deadline):
        self.tag = tag
        self.deadline = deadline

    def __call__(self, msg: str) -> None:
        d = self.deadline
        print(
            f"[{self.tag} +{d.elapsed():7.1f}s | {max(d.remaining(), 0.0):6.1f}s left] {msg}",
            flush=True,
        )


class Terminated(BaseException):
    """Raised from SIGTERM/SIGHUP so that every ``finally`` (server stops) runs."""


def install_signal_handlers() -> None:
    def _handler(signum: int, _frame: Any) -> None:
        raise Terminated(f"received signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):  # not main thread / unsupported
            signal.signal(sig, _handler)


# ========================================================= process management
class ServerError(RuntimeError):
    pass


def tail_lines(path: Path, n: int = 50, max_bytes: int = 256 * 1024) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-n:]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    end = time.monotonic() + max(0.0, timeout_s)
    while time.monotonic() < end:
        if not _group_alive(pgid):
            return True
        time.sleep(0.2)
    return not _group_alive(pgid)


def kill_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop a child started with ``start_new_session=True`` and everything in its group.

    SIGTERM to the leader (graceful shutdown), then SIGTERM to the group, then
    SIGKILL to the group; every step bounded.
    """
    pgid = proc.pid  # start_new_session=True: the child leads its own group
    half = max(grace_s / 2.0, 1.0)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=half)
    if _group_alive(pgid):
        _signal_group(pgid, signal.SIGTERM)
        _wait_group_gone(pgid, half)
    if _group_alive(pgid):
        _signal_group(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    _wait_group_gone(pgid, 10)


def popen_logged(cmd: Sequence[str], env: dict[str, str], log_path: Path, *, cwd: Path | None = None,
                 env_line: bool = False) -> subprocess.Popen:
    """Starts ``cmd`` in its own process group (so the whole group can be killed),
    stdout+stderr appended to ``log_path`` after a ``$ cmd`` header line (and, with
    ``env_line``, the multicast and YALI variables it runs with)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        if env_line:
            shown = " ".join(f"{k}={env[k]}" for k in sorted(env) if k in MULTICAST_OFF_ENV or k.startswith("YALI_"))
            log.write(f"# env: {shown}\n".encode())
        log.flush()
        return subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd, start_new_session=True)


def run_bounded(
    cmd: Sequence[str],
    *,
    env: dict[str, str],
    timeout_s: float,
    log_path: Path,
    cwd: Path | None = None,
) -> int | None:
    """Run ``cmd`` in its own process group with output to ``log_path``.

    Returns the exit code, or ``None`` if it ran past ``timeout_s`` (then its
    whole group is killed).
    """
    proc = popen_logged(cmd, env, log_path, cwd=cwd)
    try:
        return proc.wait(timeout=max(timeout_s, 0.1))
    except subprocess.TimeoutExpired:
        kill_process_group(proc, grace_s=10)
        return None
    finally:
        if proc.poll() is None:
            kill_process_group(proc, grace_s=5)


def split_command(cmd: str) -> list[str]:
    """A program path as is (even with spaces), or a shell-quoted command line split."""
    return [cmd] if os.path.exists(cmd) else shlex.split(cmd)


def pick_port(start: int, host: str = "127.0.0.1", tries: int = 200) -> int:
    for port in range(start, start + tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise ServerError(f"no free port in {start}..{start + tries - 1}")


_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    try:
        with _NO_PROXY_OPENER.open(url, timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, ValueError):
        return None


def http_post(url: str, payload: dict[str, Any], timeout_s: float) -> bytes:
    """POSTs `payload` as JSON (no proxy); returns the response body."""
    req = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with _NO_PROXY_OPENER.open(req, timeout=timeout_s) as r:
        return r.read()


def http_post_json(url: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    return json.loads(http_post(url, payload, timeout_s).decode("utf-8", "replace"))


# ================================================================== servers
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

    cmd = serve_command(model_dir, tensor_parallel_size, vllm=split_command(vllm_bin), max_model_len=max_model_len)
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


def stop_server(server: Server, grace_s: float = 30.0, gpu_free_timeout_s: float = 30.0) -> None:
    """Stop the server's process group, then wait (bounded) for the GPUs' memory to be released."""
    kill_process_group(server.proc, grace_s=grace_s)
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
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
KEY_LINE_PATTERNS = [
    re.compile(r"YALI", re.IGNORECASE),
    re.compile(r"all-reduce backends"),
    re.compile(r"flashinfer allreduce backend", re.IGNORECASE),
    re.compile(r"custom allreduce is disabled", re.IGNORECASE),
    re.compile(r"AllReduceFusion|fuse_allreduce_rms|allreduce_rms", re.IGNORECASE),
    re.compile(r"plugins for group|Loading plugin|Failed to load plugin"),
]
ERROR_PATTERNS = [re.compile(r"\bERROR\b"), re.compile(r"Traceback")]
# What yali_vllm/vllm_plugin.py logs once it has hooked a TP group.
YALI_ON_RE = re.compile(r"YALI all-reduce ON")
YALI_OFF_RE = re.compile(r"YALI all-reduce OFF")
YALI_FUSION_ON_RE = re.compile(r"YALI fusion pass ON")
_OWN_HEADER_PREFIXES = ("$ ", "# env: ")  # lines start_server()/run_bounded() write themselves


def yali_log_warnings(config: str, key_lines: Sequence[str]) -> list[str]:
    """Sanity checks on one server's key log lines: YALI's all-reduce and fusion pass on exactly
    where the configuration's environment (SERVER_CONFIGS) asks for them."""
    env = SERVER_CONFIGS[config].env if config in SERVER_CONFIGS else {}
    wants_yali = env.get("YALI_ENABLE") == "1"
    wants_fusion = wants_yali and env.get("YALI_FUSION") != "0"
    on = any(YALI_ON_RE.search(ln) for ln in key_lines)
    off = [ln for ln in key_lines if YALI_OFF_RE.search(ln)]
    fused = any(YALI_FUSION_ON_RE.search(ln) for ln in key_lines)
    warnings: list[str] = []
    if not wants_yali:
        if on:
            warnings.append(f"'YALI all-reduce ON' in the {config} server's log: YALI_ENABLE=0 did not keep it off")
        return warnings
    if not on:
        warnings.append(f"no 'YALI all-reduce ON' line in the {config} server's log: is the plugin installed "
                        "and active?")
    if off:
        warnings.append(f"the {config} server logged 'YALI all-reduce OFF': " + off[0][-200:])
    if wants_fusion and on and not fused:
        warnings.append(f"no 'YALI fusion pass ON' line in the {config} server's log: the all-reduce + RMSNorm "
                        "pairs ran through vLLM's FlashInfer fusion or unfused")
    if not wants_fusion and fused:
        warnings.append(f"'YALI fusion pass ON' in the {config} server's log: YALI_FUSION=0 did "
                        "not hand the fused pairs to FlashInfer")
    return warnings


def scan_server_log(
    path: Path,
    start: int = 0,
    end: int | None = None,
    *,
    max_key_lines: int = 40,
    max_error_lines: int = 20,
) -> dict[str, Any]:
    """Key lines (all-reduce backend / YALI / plugin lines) and ERROR/Traceback lines.

    ``start``/``end`` are byte offsets, so the error check can stop at the moment
    the server was asked to shut down (teardown noise is not a serving error).
    """
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(max(0, end - start))
    except OSError:
        data = b""
    key_lines: list[str] = []
    seen: set[str] = set()
    errors: list[str] = []
    n_errors = 0
    for raw in data.decode("utf-8", "replace").splitlines():
        line = _ANSI_RE.sub("", raw).strip()
        if not line or line.startswith(_OWN_HEADER_PREFIXES):
            continue
        if any(p.search(line) for p in ERROR_PATTERNS):
            n_errors += 1
            if len(errors) < max_error_lines:
                errors.append(line[:400])
        if any(p.search(line) for p in KEY_LINE_PATTERNS):
            # de-duplicate across TP ranks: strip the "(Worker_TP1 pid=..)" and timestamp prefixes
            norm = re.sub(r"^\(.*?\)\s*", "", line)
            norm = re.sub(r"^(INFO|WARNING|DEBUG|ERROR)\s+\S+\s+\S+\s+", r"\1 ", norm)
            if norm not in seen and len(key_lines) < max_key_lines:
                seen.add(norm)
                key_lines.append(line[:400])
    return {"key_lines": key_lines, "error_count": n_errors, "error_lines": errors}


# ============================================================ bench + parsing
def bench_command(vllm_bin: str, base_url: str, model_dir: str | Path, **kw: Any) -> list[str]:
    """The full ``vllm bench serve ...`` command line (see :func:`bench_args`)."""
    return [*split_command(vllm_bin), "bench", "serve", *bench_args(base_url, model_dir, **kw)]


def bench_args(
    base_url: str,
    model_dir: str | Path,
    *,
    concurrency: int,
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int,
    result_dir: str | Path,
    result_filename: str,
    num_warmups: int = 0,
) -> list[str]:
    """The arguments after ``vllm bench serve`` for one benchmark point."""
    return [
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--model",
        str(model_dir),
        "--tokenizer",
        str(model_dir),
        "--tokenizer-mode",
        "mistral",
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--max-concurrency",
        str(concurrency),
        "--num-prompts",
        str(num_prompts),
        "--num-warmups",
        str(num_warmups),
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_filename,
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
    ]


# A long-lived client process that runs vLLM's `vllm bench serve` code
# (vllm.benchmarks.serve: add_cli_args + main, exactly what the CLI subcommand
# calls) for one argv per stdin line, so that importing vLLM (seconds) is paid
# once per run instead of once per benchmark point.  Each job's stdout/stderr go
# to the job's log file; completion is signalled by writing job["done"].
BENCH_WORKER_CODE = r"""
import json, os, sys, traceback
module = sys.argv[1] if len(sys.argv) > 1 else "vllm.benchmarks.serve"
import importlib
bench = importlib.import_module(module)
Parser = getattr(bench, "make_parser", None)  # a test double may bring its own
if Parser is None:
    from vllm.utils.argparse_utils import FlexibleArgumentParser as Parser
print("bench worker ready", flush=True)
for line in sys.stdin:
    if not line.strip():
        continue
    job = json.loads(line)
    rc, err = 0, None
    sys.stdout.flush(); sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    with open(job["log"], "ab") as log:
        os.dup2(log.fileno(), 1); os.dup2(log.fileno(), 2)
        try:
            print("$ vllm bench serve " + " ".join(job["argv"]), flush=True)
            parser = Parser()
            bench.add_cli_args(parser)
            bench.main(parser.parse_args(job["argv"]))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
            err = None if rc == 0 else str(e)
        except BaseException:
            rc, err = 1, traceback.format_exc()
            print(err, flush=True)
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
    for fd in saved:
        os.close(fd)
    tmp = job["done"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"rc": rc, "error": err}, f)
    os.replace(tmp, job["done"])
"""


class CliBenchRunner:
    """One ``vllm bench serve`` process per benchmark point."""

    name = "cli"

    def __init__(self, vllm_bin: str, env: dict[str, str]):
        self.vllm_bin = vllm_bin
        self.env = env

    def run(self, argv: Sequence[str], log_path: Path, timeout_s: float) -> int | None:
        cmd = [*split_command(self.vllm_bin), "bench", "serve", *argv]
        return run_bounded(cmd, env=self.env, timeout_s=timeout_s, log_path=log_path)

    def close(self) -> None:
        pass


class WorkerBenchRunner:
    """vLLM's bench-serve code in one long-lived process (see BENCH_WORKER_CODE).

    The worker is started eagerly (its imports overlap with model writing and
    the first server's startup), killed with its process group on a timeout or at
    ``close()``, and restarted lazily if needed.
    """

    name = "worker"

    def __init__(self, python: str, env: dict[str, str], log_path: Path, module: str = "vllm.benchmarks.serve"):
        self.python = python
        self.env = env
        self.log_path = log_path
        self.module = module
        self.proc: subprocess.Popen | None = None
        self._jobs = 0

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*split_command(self.python), "-u", "-c", BENCH_WORKER_CODE, self.module],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    def run(self, argv: Sequence[str], log_path: Path, timeout_s: float) -> int | None:
        self.start()
        assert self.proc is not None and self.proc.stdin is not None
        self._jobs += 1
        log_path.parent.mkdir(parents=True, exist_ok=True)
        done = log_path.with_name(f"{log_path.name}.done-{os.getpid()}-{self._jobs}")
        with contextlib.suppress(FileNotFoundError):
            done.unlink()
        job = {"argv": list(argv), "log": str(log_path), "done": str(done)}
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._kill()
            return 1
        end = time.monotonic() + max(timeout_s, 0.1)
        while True:
            if done.exists():
                try:
                    rc = int(json.loads(done.read_text()).get("rc") or 0)
                finally:
                    with contextlib.suppress(OSError):
                        done.unlink()
                return rc
            if self.proc.poll() is not None:
                with open(log_path, "ab") as f:
                    f.write(f"bench worker exited with code {self.proc.returncode}; see {self.log_path}\n".encode())
                self.proc = None
                return 1
            if time.monotonic() >= end:
                self._kill()
                return None
            time.sleep(0.1)

    def _kill(self) -> None:
        if self.proc is not None:
            kill_process_group(self.proc, grace_s=4)
            self.proc = None

    def close(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._kill()


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f else None  # NaN -> None


def parse_bench_result(result: dict[str, Any] | str | Path) -> dict[str, Any]:
    """Row metrics from one ``vllm bench serve --save-result`` JSON (vLLM 0.26 keys)."""
    if not isinstance(result, dict):
        with open(result, encoding="utf-8") as f:
            result = json.load(f)
    row: dict[str, Any] = {}
    for key, candidates in {**VLLM_RESULT_KEYS, **EXTRA_RESULT_KEYS}.items():
        val = None
        for c in candidates:
            if c in result:
                val = _num(result[c])
                if val is not None:
                    break
        row[key] = val
    row["failed"] = int(result.get("failed") or 0)
    row["completed"] = int(result.get("completed") or 0)
    row["duration_s"] = _num(result.get("duration"))
    row["num_prompts"] = result.get("num_prompts")
    return row


def _g(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def make_record(config: str, concurrency: int, repeat: int, parsed: dict[str, Any], **extra: Any) -> dict[str, Any]:
    rec = {"config": config, "concurrency": int(concurrency), "repeat": int(repeat)}
    for k in ROW_KEYS[3:]:
        rec[k] = parsed.get(k)
    for k in ("completed", "duration_s", "num_prompts", *EXTRA_RESULT_KEYS):
        if k in parsed:
            rec[k] = parsed[k]
    rec.update(extra)
    return rec


# =================================================================== reporting
@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    lower_is_better: bool
    fmt: str = "{:.2f}"


METRICS: tuple[Metric, ...] = (
    Metric("tpot_ms_p50", "TPOT p50 (ms)", True, "{:.3f}"),
    Metric("tpot_ms_p99", "TPOT p99 (ms)", True, "{:.3f}"),
    Metric("tpot_ms_mean", "TPOT mean (ms)", True, "{:.3f}"),
    Metric("itl_ms_p50", "ITL p50 (ms)", True, "{:.3f}"),
    Metric("itl_ms_p99", "ITL p99 (ms)", True, "{:.3f}"),
    Metric("ttft_ms_p50", "TTFT p50 (ms)", True, "{:.1f}"),
    Metric("ttft_ms_p99", "TTFT p99 (ms)", True, "{:.1f}"),
    Metric("output_tok_s", "output tok/s", False, "{:.1f}"),
)
METRIC_BY_KEY = {m.key: m for m in METRICS}


@dataclass(frozen=True)
class Stat:
    n: int
    mean: float
    lo: float
    hi: float

    @property
    def spread(self) -> float:
        """The spread between repeats: max - min."""
        return self.hi - self.lo


def summarize(values: Sequence[float | None]) -> Stat | None:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    return Stat(len(vals), sum(vals) / len(vals), min(vals), max(vals))


def ordered_configs(records: Sequence[dict[str, Any]]) -> list[str]:
    seen = {r["config"] for r in records}
    out = [c for c in DEFAULT_CONFIGS if c in seen]
    out += sorted(seen - set(out))
    return out


def aggregate(records: Sequence[dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
    """``{(concurrency, config): {metric_key: Stat|None, ..., "failed": int, "repeats": int}}``."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((int(r["concurrency"]), r["config"]), []).append(r)
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for key, rows in groups.items():
        agg: dict[str, Any] = {m.key: summarize([r.get(m.key) for r in rows]) for m in METRICS}
        agg["req_s"] = summarize([r.get("req_s") for r in rows])
        agg["failed"] = sum(int(r.get("failed") or 0) for r in rows)
        agg["repeats"] = len(rows)
        out[key] = agg
    return out


def verdict(yali: Stat | None, other: Stat | None, lower_is_better: bool) -> tuple[str, str]:
    """Compare yali against another config for one metric.

    Returns ``(code, text)`` where code is ``"no difference"``, ``"better"``,
    ``"worse"`` (from yali's point of view) or ``"n/a"``.  A difference of the
    means that is not larger than the spread between repeats (max - min over
    repeats; the larger of the two configs') is reported as no difference.
    """
    if yali is None or other is None:
        return "n/a", "n/a (missing)"
    if yali.n < 2 or other.n < 2:
        return "n/a", "n/a (needs >= 2 repeats)"
    diff = yali.mean - other.mean
    noise = max(yali.spread, other.spread)
    if abs(diff) <= noise:
        return "no difference", f"no difference (|Δ| {abs(diff):.3g} ≤ spread {noise:.3g})"
    rel = (diff / other.mean * 100.0) if other.mean else float("inf")
    better = diff < 0 if lower_is_better else diff > 0
    code = "better" if better else "worse"
    return code, f"yali {rel:+.1f}% ({code})"


def _fmt_stat(stat: Stat | None, fmt: str) -> str:
    if stat is None:
        return "—"
    if stat.n < 2:
        return fmt.format(stat.mean)
    return f"{fmt.format(stat.mean)} ± {fmt.format(stat.spread / 2.0)}"


def render_markdown(doc: dict[str, Any], plot_files: Sequence[str] = ()) -> str:
    records = doc.get("records") or []
    agg = aggregate(records)
    configs = ordered_configs(records)
    concs = sorted({int(r["concurrency"]) for r in records})
    others = [c for c in configs if c != "yali"]
    L: list[str] = []
    L.append("# Serving benchmark: yali vs vLLM all-reduce paths")
    L.append("")
    L.append(f"- date: {doc.get('date')}")
    L.append(f"- host: {doc.get('host')}")
    v = doc.get("versions") or {}
    L.append("- versions: " + ", ".join(f"{k} {v.get(k)}" for k in ("torch", "cuda", "nccl", "vllm", "yali_vllm", "git")))
    model = doc.get("model") or {}
    if model:
        L.append("- model: " + ", ".join(f"{k}={model[k]}" for k in model if not isinstance(model[k], (dict, list))))
    wl = doc.get("workload") or {}
    if wl:
        L.append("- workload: " + ", ".join(f"{k}={wl[k]}" for k in wl if not isinstance(wl[k], (dict, list))))
    L.append(f"- command: `{doc.get('command')}`")
    L.append("")
    for s in doc.get("server_logs") or []:
        for w in s.get("warnings") or []:
            L.append(f"> **WARNING** ({s.get('config')} r{s.get('repeat')}): {w}")
            L.append("")
    L.append(
        "Values are mean ± half the spread over repeats (so the ± interval spans the "
        "min..max of the repeats). Verdict: a difference of the means that is not larger "
        "than the spread between repeats (max − min, the larger of the two configs') is "
        "reported as **no difference**; otherwise the relative difference of yali's mean "
        "(negative = lower) and whether that is better or worse for yali."
    )
    L.append("")
    if not records:
        L.append("**No benchmark point completed.**")
        L.append("")
    head_metric = METRICS[0]
    for c in concs:
        L.append(f"## Concurrency {c}")
        L.append("")
        cols = ["config", "runs", *[m.label for m in METRICS], "failed", f"yali vs this ({head_metric.label})"]
        L.append("| " + " | ".join(cols) + " |")
        L.append("|" + "|".join(["---"] * len(cols)) + "|")
        y = agg.get((c, "yali"))
        for cfg in configs:
            a = agg.get((c, cfg))
            if a is None:
                continue
            cells = [cfg, str(a["repeats"])]
            cells += [_fmt_stat(a[m.key], m.fmt) for m in METRICS]
            cells.append(str(a["failed"]))
            if cfg == "yali":
                cells.append("—")
            else:
                cells.append(verdict(y[head_metric.key] if y else None, a[head_metric.key], True)[1])
            L.append("| " + " | ".join(cells) + " |")
        L.append("")
        if y and others:
            present = [o for o in others if (c, o) in agg]
            if present:
                L.append(f"Verdicts at concurrency {c}, yali vs each config:")
                L.append("")
                L.append("| metric | " + " | ".join(f"vs {o}" for o in present) + " |")
                L.append("|---|" + "|".join(["---"] * len(present)) + "|")
                for m in METRICS:
                    cells = [verdict(y[m.key], agg[(c, o)][m.key], m.lower_is_better)[1] for o in present]
                    L.append(f"| {m.label} | " + " | ".join(cells) + " |")
                L.append("")
    logs = doc.get("server_logs") or []
    if logs:
        L.append("## All-reduce backends the servers logged")
        L.append("")
        for s in logs:
            L.append(
                f"**{s.get('config')} r{s.get('repeat')}** (`{s.get('log_file')}`, YALI on: {s.get('yali_on')}, "
                f"ERROR/Traceback lines: {s.get('error_count', 0)})"
            )
            L.append("")
            lines = s.get("key_lines") or []
            if lines:
                L.append("```")
                L.extend(lines)
                L.append("```")
            else:
                L.append("_no all-reduce backend / YALI line found_")
            L.append("")
    errs = doc.get("errors") or []
    skipped = doc.get("skipped") or []
    if errs or skipped:
        L.append("## Errors and skipped points")
        L.append("")
        for e in errs:
            src = f" (`{e['source']}`)" if e.get("source") else ""
            L.append(f"- error: {e.get('config')} r{e.get('repeat')} c={e.get('concurrency')}{src}: {str(e.get('error'))[:300]}")
        for s in skipped:
            src = f" (`{s['source']}`)" if s.get("source") else ""
            L.append(f"- skipped: {s.get('config')} r{s.get('repeat')} c={s.get('concurrency')}{src}: {s.get('reason')}")
        L.append("")
    if plot_files:
        L.append("## Plots")
        L.append("")
        for p in plot_files:
            L.append(f"![{Path(p).stem}]({Path(p).name})")
        L.append("")
    return "\n".join(L)


PLOTS = (
    ("tpot_ms_p50", "TPOT p50 (ms)", "tpot_p50.png"),
    ("itl_ms_p99", "ITL p99 (ms)", "itl_p99.png"),
)


def write_plots(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """TPOT p50 and ITL p99 by concurrency, one line per config, error bars = repeat min..max."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots", file=sys.stderr)
        return []
    records = doc.get("records") or []
    if not records:
        return []
    agg = aggregate(records)
    configs = ordered_configs(records)
    concs = sorted({int(r["concurrency"]) for r in records})
    title_bits = [str((doc.get("model") or {}).get("size", "")), str(doc.get("host", ""))]
    written: list[Path] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for key, label, fname in PLOTS:
        fig, ax = plt.subplots(figsize=(7.0, 4.4))
        for cfg in configs:
            xs, ys, lo, hi = [], [], [], []
            for c in concs:
                st = (agg.get((c, cfg)) or {}).get(key)
                if st is None:
                    continue
                xs.append(c)
                ys.append(st.mean)
                lo.append(st.mean - st.lo)
                hi.append(st.hi - st.mean)
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=4, label=cfg)
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs)
        ax.set_xticklabels([str(c) for c in concs])
        ax.set_xlabel("concurrency (max in-flight requests)")
        ax.set_ylabel(label)
        ax.set_title(f"{label} by concurrency — " + " · ".join(b for b in title_bits if b), fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def write_report(doc: dict[str, Any], json_path: Path, out_dir: Path | None = None) -> tuple[Path, list[Path]]:
    out_dir = out_dir or json_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(doc, out_dir)
    md_path = out_dir / (json_path.stem + ".md")
    md_path.write_text(render_markdown(doc, [p.name for p in plots]), encoding="utf-8")
    return md_path, plots


# ===================================================================== model
MODEL_SUMMARY_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "torch_dtype",
    "dtype",
    "max_position_embeddings",
)


def default_model_dir(size: str) -> Path:
    """The benchmarks' scratch model directory: per user, under the system temp dir (another user's
    directory of the same name is never written into)."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"yali-serving-model-{size}-{os.getuid()}"


def prepare_model(size: str, model_dir: Path) -> Path:
    from yali_vllm.models import write_model_dir

    # The benchmark's model directory is rewritten on every run: force replaces config.json and
    # tekken.json there (never through a symbolic link) and keeps every other file.
    return Path(write_model_dir(model_dir, size=size, force=True)).resolve()


def model_summary(model_dir: Path, size: str) -> dict[str, Any]:
    out: dict[str, Any] = {"size": size, "dir": str(model_dir)}
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    for k in MODEL_SUMMARY_KEYS:
        if k in cfg:
            val = cfg[k]
            out[k] = ",".join(map(str, val)) if isinstance(val, list) else val
    return out


# ===================================================================== run
def resolve_command(cmd: str, module: str) -> str:
    """``cmd`` if its program is on PATH, else ``<this python> -m module``."""
    import shutil

    parts = split_command(cmd)
    if parts and (shutil.which(parts[0]) or os.sep in parts[0]):
        return cmd
    return shlex.join([sys.executable, "-m", module])


def default_out(prefix: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return output_dir() / f"{prefix}-{stamp}"


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Server/model/budget options shared with load_test.py."""
    p.add_argument("--model-size", choices=("70b", "8b"), default="70b", help="embedded dummy model (default 70b)")
    p.add_argument("--model-dir", type=Path, default=None, help="where to write the model; its config.json and tekken.json are replaced (default: a per-user directory under the system temp dir, see default_model_dir)")
    p.add_argument("--vllm-bin", default="vllm", help="vllm command, shell-split (default: vllm on PATH)")
    p.add_argument("--port", type=tcp_port, default=8100, help="first port to try; each server gets its own")
    p.add_argument("--max-model-len", type=positive_int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.90)
    p.add_argument("--max-num-seqs", type=positive_int, default=None, help="vllm serve --max-num-seqs (default: vLLM's); smaller = faster CUDA-graph capture at startup")
    p.add_argument("--extra-server-args", default="", help="extra vllm serve arguments for every config (one shell-quoted string)")
    p.add_argument("--budget-s", type=positive_float, default=540.0, help="global deadline for the whole run, seconds (default 540)")
    p.add_argument("--startup-timeout-s", type=positive_float, default=420.0, help="max wait for one server's /health (clipped to the budget)")
    p.add_argument("--stop-grace-s", type=positive_float, default=30.0, help="SIGTERM grace before SIGKILL when stopping a server")
    p.add_argument("--startup-estimate-s", type=positive_float, default=60.0, help="assumed server startup time until one is observed (budget planning)")
    p.add_argument("--warmup-requests", type=non_negative_int, default=4, help="short warm-up completions per server before measuring")
    p.add_argument("--dry-run", action="store_true", help="print the commands and environments, run nothing")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma list of {list(SERVER_CONFIGS)}")
    p.add_argument("--repeats", type=positive_int, default=2, help="repeats per config, interleaved")
    p.add_argument("--concurrency", type=parse_int_list, default=[1, 8, 32], help="comma list of --max-concurrency values")
    p.add_argument("--prompts-per-concurrency", type=positive_int, default=4, help="num-prompts = max(min-prompts, this x concurrency)")
    p.add_argument("--min-prompts", type=positive_int, default=8)
    p.add_argument("--random-input-len", type=positive_int, default=1024)
    p.add_argument("--random-output-len", type=positive_int, default=256)
    p.add_argument("--seed", type=non_negative_int, default=0, help="dataset seed; concurrency point i uses seed+i (no prefix-cache reuse between points)")
    p.add_argument("--bench-timeout-s", type=positive_float, default=300.0, help="max time for one vllm bench serve run (clipped to the budget)")
    p.add_argument("--bench-estimate-s", type=positive_float, default=25.0, help="assumed bench time until one is observed (budget planning)")
    p.add_argument(
        "--bench-runner",
        choices=("worker", "cli"),
        default="worker",
        help="cli: one `vllm bench serve` process per point; worker: the same vLLM bench code and argv in one "
        "long-lived client process (vLLM imported once, saves seconds per point)",
    )
    p.add_argument("--bench-python", default=sys.executable, help="python (shell-split) for --bench-runner worker")
    p.add_argument("--bench-module", default="vllm.benchmarks.serve", help=argparse.SUPPRESS)
    p.add_argument(
        "--profile-tokens",
        type=non_negative_int,
        default=0,
        help="after the measured points of each config's first repeat, profile one streamed request of this many "
        "tokens with vLLM's torch profiler and write decode-profile.json/.md (kernel time per class and the gaps "
        "around them, see decode_profile.py) under --out; 0 = no profile. The profiler is configured on the server "
        "but only runs for that request, after the measurements",
    )
    p.add_argument("--locust-users", type=non_negative_int, default=0,
                   help="after each config's first-repeat points, a locust load test (benchmarks/locustfile.py) "
                        "with this many users on the same server; rows in --out/load-test.json (kind load-test). 0 = none")
    p.add_argument("--locust-duration-s", type=positive_int, default=60, help="duration of each locust comparison run")
    p.add_argument("--soak-s", type=non_negative_int, default=0,
                   help="after the yali server's first-repeat points (and locust run), a soak of this many seconds "
                        "with --soak-users users on the same server; PASS needs zero failed requests and no "
                        "ERROR/Traceback line in the server log up to its stop (--out/soak.json). 0 = none")
    p.add_argument("--soak-users", type=positive_int, default=64)
    p.add_argument("--locust-bin", default="locust", help="locust command, shell-split (default: locust on PATH, else this python -m locust)")
    add_server_args(p)
    p.add_argument("--out", type=Path, default=None, help="output dir (default <temp dir>/yali-results-<uid>/serving-DATE)")
    p.add_argument(
        "--report-only",
        type=Path,
        nargs="+",
        default=None,
        metavar="RESULT.json",
        help="regenerate table + plots from a result file and exit; with several files, merge them into --out",
    )
    return p


def validate_args(args: argparse.Namespace) -> list[str]:
    configs = parse_csv_list(args.configs)
    unknown = [c for c in configs if c not in SERVER_CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; known: {list(SERVER_CONFIGS)}")
    if args.soak_s and "yali" not in configs:
        raise SystemExit("--soak-s soaks the yali server: add yali to --configs")
    need = args.random_input_len + args.random_output_len
    if args.max_model_len < need:
        raise SystemExit(f"--max-model-len {args.max_model_len} < input+output {need}")
    return configs


def profiler_config(trace_dir: Path) -> dict[str, Any]:
    """vLLM --profiler-config for a decode profile into trace_dir: torch profiler,
    no Python stacks (smaller traces), workers only (no front-end trace)."""
    return {"profiler": "torch", "torch_profiler_dir": str(trace_dir.resolve()), "torch_profiler_with_stack": False,
            "ignore_frontend": True}


def profile_request(base_url: str, model: str, tokens: int, deadline: Deadline, reserve_s: float) -> float:
    """One completion of `tokens` tokens between /start_profile and /stop_profile; returns its seconds."""
    http_post(base_url + "/start_profile", {}, deadline.clip(60.0, reserve_s))
    t0 = time.monotonic()
    request = {"model": model, "prompt": "Profile this decode: " * 16, "max_tokens": tokens, "ignore_eos": True}
    try:
        http_post(base_url + "/v1/completions", request, deadline.clip(120.0, reserve_s))
    finally:
        http_post(base_url + "/stop_profile", {}, deadline.clip(300.0, reserve_s))  # writes the traces
    return time.monotonic() - t0


class LoadTests:
    """Locust runs on servers serving_bench already started (comparison rows and the yali
    soak), written as load_test.py writes them: load-test.json (mode comparison) and
    soak.json (mode soak, with its verdict), locust's CSV/HTML beside them."""

    def __init__(self, args: argparse.Namespace, out: Path, model_dir: Path):
        import load_test

        self.lt, self.args, self.out, self.model_dir = load_test, args, out, model_dir
        self.settings = argparse.Namespace(max_tokens=64, prompt_words=128, chat_weight=1, completions_weight=1,
                                           request_timeout_s=120.0)
        self.docs: dict[str, dict[str, Any]] = {}
        self.locust_bin = resolve_command(args.locust_bin, "locust")

    def doc(self, mode: str) -> dict[str, Any]:
        if mode not in self.docs:
            users = self.args.soak_users if mode == "soak" else self.args.locust_users
            dur = self.args.soak_s if mode == "soak" else self.args.locust_duration_s
            self.docs[mode] = results_header(self.lt.KIND, {
                "mode": mode, "model": model_summary(self.model_dir, self.args.model_size),
                "locust": {"users": users, "spawn_rate": max(1.0, users / 4.0), "duration_s": dur,
                           **vars(self.settings)},
                "source": "serving_bench (locust on the benchmark's own servers, after their measurements)",
                "records": [], "server_logs": [], "errors": []})
        return self.docs[mode]

    def run(self, server: Server, cfg: str, mode: str, deadline: Deadline, reserve_s: float,
            say: Callable[[str], None]) -> None:
        doc = self.doc(mode)
        users, wanted = doc["locust"]["users"], int(doc["locust"]["duration_s"])
        duration = int(min(wanted, deadline.remaining() - reserve_s - self.lt.LOCUST_OVERHEAD_S))
        if duration < min(5, wanted):
            doc["errors"].append({"config": cfg, "error": "skipped: not enough budget left"})
            say(f"{cfg}: locust {mode} skipped, not enough budget left")
            return
        say(f"{cfg}: locust {mode}, {users} users for {duration}s"
            + (f" (shortened from {wanted}s by the budget)" if duration < wanted else ""))
        row, rc, error = self.lt.run_locust(
            self.locust_bin, self.settings, str(self.model_dir), self.out, f"locust-{mode}-{cfg}", cfg,
            server.base_url, users=users, spawn_rate=doc["locust"]["spawn_rate"], duration_s=duration,
            deadline=deadline, reserve_s=reserve_s)
        if row is None:
            doc["errors"].append(error)
            say(f"{cfg}: locust {mode} wrote no stats (rc {rc})")
            return
        doc["records"].append(row)
        say(f"{cfg}: locust {mode}: {row['requests']} requests, {row['failures']} failures, TTFT p50 "
            f"{row['ttft_ms_p50']} ms, ITL p50 {row['itl_ms_p50']} ms (rc {rc})")

    def server_stopped(self, cfg: str, entry: dict[str, Any]) -> None:
        """Records the stopped server's log scan with every mode that ran on it."""
        for doc in self.docs.values():
            if any(r["config"] == cfg for r in doc["records"]) or any(e["config"] == cfg for e in doc["errors"]):
                doc["server_logs"].append({"config": cfg, **entry})
                for r in doc["records"]:
                    if r["config"] == cfg:
                        r["server_log_errors"] = entry["error_count"]

    def write(self, say: Callable[[str], None]) -> None:
        for mode, doc in self.docs.items():
            if mode == "soak":
                row = doc["records"][0] if doc["records"] else None
                scan = doc["server_logs"][0] if doc["server_logs"] else None
                rc = row.get("locust_rc") if row else None
                doc["verdict"] = self.lt.soak_verdict(row, scan, rc, bool(scan and scan.get("yali_on")))
                say(f"soak verdict: {'PASS' if doc['verdict']['pass'] else 'FAIL'} {doc['verdict']['reasons']}")
            write_json_and_markdown(self.out, "soak" if mode == "soak" else "load-test", doc,
                                    self.lt.render_markdown(doc))


def write_decode_profile(out: Path, tokens: int, model_size: str) -> Path | None:
    """decode-profile.json/.md from out/traces/<config>/ (decode_profile.py's analysis)."""
    import decode_profile

    doc = decode_profile.profile_doc(out / "traces", tokens,
                                     {"model_size": model_size, "source": "serving_bench --profile-tokens"})
    if not doc["records"]:
        return None
    decode_profile.write_doc(out, doc)
    return out / "decode-profile.json"


def run(args: argparse.Namespace) -> int:
    configs = validate_args(args)
    deadline = Deadline(args.budget_s)
    say = Progress("serving-bench", deadline)
    model_dir = (args.model_dir or default_model_dir(args.model_size)).resolve()
    out = (args.out or default_out("serving")).resolve()
    schedule = interleaved_schedule(configs, args.repeats)
    concs: list[int] = list(args.concurrency)

    def srv_cmd(cfg: str, port: int) -> list[str]:
        cmd = server_command_for(args, model_dir, cfg, port)
        if args.profile_tokens:
            cmd += ["--profiler-config", json.dumps(profiler_config(out / "traces" / cfg))]
        return cmd

    def b_args(base_url: str, c: int, j: int, result_dir: Path, name: str) -> list[str]:
        return bench_args(
            base_url,
            model_dir,
            concurrency=c,
            num_prompts=num_prompts_for(c, args.prompts_per_concurrency, args.min_prompts),
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            seed=args.seed + j,
            result_dir=result_dir,
            result_filename=name,
        )

    if args.dry_run:
        print(f"# model: yali_vllm.models.write_model_dir({str(model_dir)!r}, size={args.model_size!r})")
        print(f"# out: {out}")
        for rep, cfg in schedule:
            env = server_env(SERVER_CONFIGS[cfg])
            shown = {k: env[k] for k in sorted(env) if k in MULTICAST_OFF_ENV or k.startswith("YALI_")}
            print(f"# {cfg} r{rep}")
            print(" ".join(f"{k}={v}" for k, v in shown.items()) + " " + shlex.join(srv_cmd(cfg, args.port)))
            for j, c in enumerate(concs):
                bargs = b_args(f"http://127.0.0.1:{args.port}", c, j, out / "raw", f"{cfg}-r{rep}-c{c}.json")
                print("  " + shlex.join([*split_command(args.vllm_bin), "bench", "serve", *bargs]))
        print(f"# bench runner: {args.bench_runner}")
        if args.locust_users:
            print(f"# then, on each config's first server: locust {args.locust_users} users for {args.locust_duration_s}s "
                  f"-> {out / 'load-test.json'}")
        if args.soak_s:
            print(f"# then, on the yali server: soak, locust {args.soak_users} users for {args.soak_s}s -> {out / 'soak.json'}")
        return 0

    args.vllm_bin = resolve_command(args.vllm_bin, "vllm.entrypoints.cli.main")
    install_signal_handlers()
    raw_dir = out / "raw"
    log_dir = out / "server-logs"
    raw_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    json_path = out / RESULT_NAME

    args.load_tests = LoadTests(args, out, model_dir) if (args.locust_users or args.soak_s) else None
    runner: CliBenchRunner | WorkerBenchRunner
    if args.bench_runner == "cli":
        runner = CliBenchRunner(args.vllm_bin, child_env())
    else:
        runner = WorkerBenchRunner(args.bench_python, child_env(), raw_dir / "bench-worker.log", args.bench_module)
        runner.start()  # imports vLLM while the model is written and the first server starts
    try:
        return _run_all(args, configs, deadline, say, model_dir, out, raw_dir, log_dir, json_path, schedule, concs, srv_cmd, b_args, runner)
    finally:
        runner.close()


def _run_all(
    args: argparse.Namespace,
    configs: list[str],
    deadline: Deadline,
    say: Progress,
    model_dir: Path,
    out: Path,
    raw_dir: Path,
    log_dir: Path,
    json_path: Path,
    schedule: list[tuple[int, str]],
    concs: list[int],
    srv_cmd: Callable[[str, int], list[str]],
    b_args: Callable[[str, int, int, Path, str], list[str]],
    runner: CliBenchRunner | WorkerBenchRunner,
) -> int:
    say(f"writing {args.model_size} model to {model_dir}")
    model_dir = prepare_model(args.model_size, model_dir)
    model = model_summary(model_dir, args.model_size)
    model.update(
        {
            "tensor_parallel_size": 2,
            "load_format": "dummy",
            "tokenizer_mode": "mistral",
            "max_model_len": args.max_model_len,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "max_num_seqs": args.max_num_seqs,
            "extra_server_args": args.extra_server_args,
        }
    )
    workload = {
        "tool": "vllm bench serve",
        "dataset": "random",
        "backend": "vllm",
        "endpoint": "/v1/completions",
        "input_len": args.random_input_len,
        "output_len": args.random_output_len,
        "ignore_eos": True,
        "concurrency": concs,
        "num_prompts": {str(c): num_prompts_for(c, args.prompts_per_concurrency, args.min_prompts) for c in concs},
        "seeds": {str(c): args.seed + j for j, c in enumerate(concs)},
        "repeats": args.repeats,
        "configs": configs,
        "warmup_requests": args.warmup_requests,
        "bench_runner": args.bench_runner,
    }
    say("collecting host and version info")
    doc = results_header(
        KIND,
        {
            "model": model,
            "workload": workload,
            "server_configs": {
                c: {"env": SERVER_CONFIGS[c].env, "args": list(SERVER_CONFIGS[c].args), "description": SERVER_CONFIGS[c].description}
                for c in configs
            },
            "multicast_off_env": dict(MULTICAST_OFF_ENV),
            "records": [],
            "server_logs": [],
            "errors": [],
            "skipped": [],
            "budget_s": args.budget_s,
        },
    )
    say(f"host: {doc['host']}; versions: {doc['versions']}")
    write_results(json_path, doc)

    est_startup: float | None = None
    est_bench: dict[int, float] = {}
    dead_configs: set[str] = set()
    port = args.port
    stop_reserve = args.stop_grace_s + 15.0
    interrupted: BaseException | None = None

    def skip(rep: int, cfg: str, c: int | None, reason: str) -> None:
        doc["skipped"].append({"config": cfg, "repeat": rep, "concurrency": c, "reason": reason})

    try:
        for idx, (rep, cfg) in enumerate(schedule):
            tag = f"{cfg} r{rep}/{args.repeats} ({idx + 1}/{len(schedule)})"
            if cfg in dead_configs:
                skip(rep, cfg, None, "server failed earlier in this run")
                say(f"{tag}: skipped (server failed earlier)")
                continue
            first_bench = min(est_bench.values()) if est_bench else args.bench_estimate_s
            need = (est_startup or args.startup_estimate_s) + first_bench + stop_reserve
            if deadline.remaining() < need:
                skip(rep, cfg, None, f"budget: {deadline.remaining():.0f}s left < ~{need:.0f}s needed")
                say(f"{tag}: skipped, not enough budget left (~{need:.0f}s needed)")
                continue
            port = pick_port(port)
            log_path = log_dir / f"{cfg}-r{rep}.log"
            cmd = srv_cmd(cfg, port)
            say(f"{tag}: starting server on port {port}: {shlex.join(cmd)}")
            server = start_server(cmd, server_env(SERVER_CONFIGS[cfg]), log_path, port, cfg)
            try:
                wait_s, bound = startup_wait(deadline, args.startup_timeout_s, stop_reserve)
                waited = wait_healthy(server, wait_s, bound=bound)
                est_startup = max(est_startup or 0.0, waited)
                say(f"{tag}: healthy after {waited:.1f}s")
                ok, bad = warmup_server(
                    server.base_url, str(model_dir), args.warmup_requests, timeout_s=deadline.clip(60.0, stop_reserve)
                )
                if args.warmup_requests:
                    say(f"{tag}: warm-up {ok} ok, {bad} failed")
                for j, c in enumerate(concs):
                    est = est_bench.get(c, args.bench_estimate_s)
                    if deadline.remaining() < est + stop_reserve:
                        skip(rep, cfg, c, f"budget: {deadline.remaining():.0f}s left < ~{est + stop_reserve:.0f}s needed")
                        say(f"{tag} c={c}: skipped, not enough budget left")
                        continue
                    if not server.alive():
                        raise ServerError(
                            f"server {cfg} exited (code {server.proc.returncode}); last 50 log lines:\n"
                            + "\n".join(tail_lines(log_path, 50))
                        )
                    name = f"{cfg}-r{rep}-c{c}"
                    bargs = b_args(server.base_url, c, j, raw_dir, name + ".json")
                    n_prompts = num_prompts_for(c, args.prompts_per_concurrency, args.min_prompts)
                    say(f"{tag} c={c}: vllm bench serve ({runner.name}), {n_prompts} prompts")
                    t0 = time.monotonic()
                    rc = runner.run(bargs, raw_dir / f"{name}.log", deadline.clip(args.bench_timeout_s, stop_reserve))
                    dur = time.monotonic() - t0
                    result_file = raw_dir / f"{name}.json"
                    if rc == 0 and result_file.exists():
                        parsed = parse_bench_result(result_file)
                        rec = make_record(cfg, c, rep, parsed, result_file=str(result_file.relative_to(out)), wall_s=round(dur, 1))
                        doc["records"].append(rec)
                        est_bench[c] = max(est_bench.get(c, 0.0), dur)
                        say(
                            f"{tag} c={c}: done in {dur:.1f}s: TPOT p50 {_g(rec['tpot_ms_p50'])} ms, "
                            f"ITL p99 {_g(rec['itl_ms_p99'])} ms, TTFT p50 {_g(rec['ttft_ms_p50'])} ms, "
                            f"{_g(rec['output_tok_s'])} tok/s, failed {rec['failed']}"
                        )
                    else:
                        why = "timed out" if rc is None else f"exit code {rc}"
                        tail = tail_lines(raw_dir / f"{name}.log", 20)
                        doc["errors"].append(
                            {"config": cfg, "repeat": rep, "concurrency": c, "error": f"vllm bench serve {why}", "log_tail": tail}
                        )
                        say(f"{tag} c={c}: FAILED ({why}); see {raw_dir / (name + '.log')}")
                    write_results(json_path, doc)
                if args.profile_tokens and rep == 1:
                    if deadline.remaining() < 90.0 + stop_reserve:
                        say(f"{tag}: profile skipped, not enough budget left")
                    else:
                        try:
                            dur = profile_request(server.base_url, str(model_dir), args.profile_tokens, deadline,
                                                  stop_reserve)
                            say(f"{tag}: profiled a {args.profile_tokens}-token request ({dur:.1f}s with the trace)")
                        except Exception as e:  # the measurements stand without it
                            doc["errors"].append({"config": cfg, "repeat": rep, "concurrency": None,
                                                  "error": f"profile: {type(e).__name__}: {e}"})
                            say(f"{tag}: profile FAILED: {type(e).__name__}: {e}")
                if args.load_tests is not None and rep == 1:
                    if args.locust_users:
                        args.load_tests.run(server, cfg, "comparison", deadline, stop_reserve, say)
                    if args.soak_s and cfg == "yali":
                        args.load_tests.run(server, cfg, "soak", deadline, stop_reserve, say)
            except ServerError as e:
                dead_configs.add(cfg)
                doc["errors"].append({"config": cfg, "repeat": rep, "concurrency": None, "error": str(e)})
                say(f"{tag}: SERVER FAILED: {str(e).splitlines()[0]}")
                print(str(e), flush=True)
            finally:
                say(f"{tag}: stopping server (pid {server.proc.pid}, process group)")
                entry = {"config": cfg, "repeat": rep, **stop_and_scan(server, out, args.stop_grace_s)}
                for w in entry["warnings"]:
                    say(f"{tag}: WARNING: {w}")
                doc["server_logs"].append(entry)
                if args.load_tests is not None and rep == 1:
                    args.load_tests.server_stopped(cfg, entry)
                write_results(json_path, doc)
                port += 1
    except (KeyboardInterrupt, Terminated) as e:
        interrupted = e
        say(f"interrupted ({e!r}); writing partial results")
    finally:
        doc["elapsed_s"] = round(deadline.elapsed(), 1)
        write_results(json_path, doc)
        if args.load_tests is not None:
            args.load_tests.write(say)
        if args.profile_tokens and (out / "traces").is_dir():
            try:
                prof = write_decode_profile(out, args.profile_tokens, args.model_size)
                say(f"decode profile: {prof or 'no GPU kernels in the traces'}")
            except Exception as e:
                say(f"decode profile analysis FAILED: {type(e).__name__}: {e}")
        md, plots = write_report(doc, json_path, out)
        say(f"wrote {json_path}, {md}" + (", " + ", ".join(str(p) for p in plots) if plots else ""))
    if interrupted is not None:
        return 130
    return 0 if doc["records"] and not doc["errors"] else 1


def merge_results(docs: Sequence[dict[str, Any]], sources: Sequence[str],
                  prefixes: Sequence[str] | None = None) -> dict[str, Any]:
    """Merge several serving-benchmark results (same workload) into one.

    Header, model and workload come from the first; records, server logs, errors
    and skipped points are concatenated, with each config's repeats renumbered
    1, 2, ... in file order so that the verdict sees them as repeats. prefixes[i]
    (the directory of source i relative to the merged result's) is put in front of
    the files source i names, so that result files and server logs stay findable;
    errors and skipped points say which source they came from.
    """
    if not docs:
        raise ValueError("nothing to merge")
    merged = dict(docs[0])
    merged["merged_from"] = list(sources)
    merged["commands"] = [d.get("command") for d in docs]
    for key in ("records", "server_logs", "errors", "skipped"):
        merged[key] = []
    next_rep: dict[str, int] = {}
    for i, d in enumerate(docs):
        prefix = prefixes[i] if prefixes else ""
        renum: dict[tuple[str, int], int] = {}
        for cfg, rep in sorted({(r["config"], int(r["repeat"])) for r in d.get("records") or []} |
                               {(s["config"], int(s["repeat"])) for s in d.get("server_logs") or [] if s.get("repeat") is not None}):
            next_rep[cfg] = next_rep.get(cfg, 0) + 1
            renum[(cfg, rep)] = next_rep[cfg]
        def repeat_of(e: dict[str, Any]) -> Any:
            rep = e.get("repeat")
            return renum.get((e.get("config"), int(rep)), rep) if rep is not None else rep

        for r in d.get("records") or []:
            merged["records"].append({**r, "repeat": repeat_of(r), "result_file": under(prefix, r.get("result_file"))})
        for e in d.get("server_logs") or []:
            merged["server_logs"].append({**e, "repeat": repeat_of(e), "log_file": under(prefix, e.get("log_file"))})
        for key in ("errors", "skipped"):
            merged[key] += [{**e, "repeat": repeat_of(e), "source": sources[i]} for e in d.get(key) or []]
    return merged


def backfill_extra_keys(doc: dict[str, Any], base: Path) -> None:
    """Fills the EXTRA_RESULT_KEYS a record lacks (written before they existed) from its
    ``result_file`` (relative to ``base``, the result's directory) where that file is kept."""
    for r in doc.get("records") or []:
        missing = [k for k in EXTRA_RESULT_KEYS if r.get(k) is None]
        path = base / r["result_file"] if missing and r.get("result_file") else None
        if path is None or not path.is_file():
            continue
        parsed = parse_bench_result(path)
        for k in missing:
            if parsed.get(k) is not None:
                r[k] = parsed[k]


def report_only(paths: Sequence[Path], out: Path | None) -> int:
    docs = load_results_of_kind(paths, KIND)
    if len(docs) == 1:
        doc, json_path = docs[0], paths[0]
    else:
        for doc, path in zip(docs, paths):  # the merged file gets what its sources' raw files hold
            backfill_extra_keys(doc, Path(path).parent)
        out = out or default_out("serving-merged")
        doc = merge_results(docs, *merge_sources(paths, out))
        json_path = write_results(out / RESULT_NAME, doc)
        print(f"merged {len(paths)} results into {json_path}")
    md, plots = write_report(doc, json_path, out)
    print(f"wrote {md}" + (", " + ", ".join(str(p) for p in plots) if plots else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report_only:
        return report_only([p.resolve() for p in args.report_only], args.out.resolve() if args.out else None)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
