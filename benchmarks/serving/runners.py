"""The two ways to run ``vllm bench serve`` for one point: one process per point (cli) or one
long-lived client process (worker)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.processes import stop_process_group
from benchmarks.serving.commands import run_bounded, split_command


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
        "--save-detailed",  # per-request gaps: where the slowest fall (schema.slow_gap_positions)
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
            stop_process_group(self.proc, grace_s=4)
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
