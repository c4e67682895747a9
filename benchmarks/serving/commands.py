"""Commands in their own process groups, output to a log file, every wait bounded; free ports."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common.gpu_env import MULTICAST_OFF_ENV
from benchmarks.common.processes import stop_process_group


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
        stop_process_group(proc, grace_s=10)
        return None
    finally:
        if proc.poll() is None:
            stop_process_group(proc, grace_s=5)


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


def resolve_command(cmd: str, module: str, option: str) -> str:
    """``cmd`` if its program is on PATH, else ``<this python> -m module``. When neither exists it
    stops with a message naming the tool and ``option`` (the flag that names another command),
    before a run starts a server it could not use."""
    import importlib.util
    import shutil

    parts = split_command(cmd)
    if parts and (shutil.which(parts[0]) or os.sep in parts[0]):
        return cmd
    package = module.split(".")[0]
    if importlib.util.find_spec(package) is None:
        raise SystemExit(f"{cmd!r} is not on PATH and {sys.executable} cannot import {package!r}: install "
                         f"{package} into this environment (pip install {package}) or name its command with {option}")
    return shlex.join([sys.executable, "-m", module])
