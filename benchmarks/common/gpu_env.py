"""The environment every GPU process of this repository runs with: NVLink multicast off.

The shared GPU hosts must never use NVLink multicast (NVLS). This module is the one place the
settings are written down: the benchmarks, the tests that start GPU processes and, through
``python3 -m benchmarks.common.gpu_env`` (which prints them as ``export`` lines), the shell
scripts take them from here.
"""
from __future__ import annotations

import os
import shlex

MULTICAST_OFF_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm",
}


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child process: ours + multicast off (explicitly) + ``extra``."""
    env = dict(os.environ)
    env.update(MULTICAST_OFF_ENV)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    # Benchmark traffic goes to 127.0.0.1 only: never through a proxy.
    for key in ("NO_PROXY", "no_proxy"):
        have = [h for h in env.get(key, "").split(",") if h]
        env[key] = ",".join(dict.fromkeys([*have, "127.0.0.1", "localhost"]))
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    # Re-assert last so ``extra`` can never switch multicast back on by accident.
    env.update(MULTICAST_OFF_ENV)
    return env


def shell_exports() -> str:
    """The settings as one ``export K=V ...`` line for a shell to evaluate."""
    return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in MULTICAST_OFF_ENV.items())


if __name__ == "__main__":
    print(shell_exports())
