"""User switches (environment variables) and the resolved kernel configuration.

The kernel configuration itself (YALI_KERNEL_MODE, YALI_MAX_BYTES, YALI_DEV_*,
YALI_TIMEOUT_S) is parsed and validated in one place, the C++ core
(csrc/core/yali/config.cpp), so the C++ API and Python agree; a bad value raises
ValueError naming the variable and the accepted range.
"""
from __future__ import annotations

import os

from . import _ext

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

# Kernel ids as returned by plan() (csrc/core/yali/config.h: enum class Kernel).
KERNEL_NAMES = {0: None, 1: "flash-oneshot", 2: "flash-twoshot", 3: "stream", 4: "flash-ll", 5: "flash-push"}
# Kernel modes accepted by all_reduce(mode=...) (enum class KernelMode); -1 = the configured one.
MODES = {"config": -1, "auto": 0, "flash": 1, "stream": 2}


def env_flag(name: str, default: bool, environ=None) -> bool:
    """Reads a boolean switch such as YALI_ENABLE from `environ` (default os.environ);
    raises ValueError naming it on bad input."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"invalid {name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def kernel_config() -> dict:
    """The configuration the C++ core resolves from the environment, as a dict of numbers/strings."""
    return parse_config_string(_ext.ops().config_string())


def parse_config_string(s: str) -> dict:
    out: dict = {}
    for item in s.split():
        k, v = item.split("=", 1)
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    return out


def plan(nbytes: int, mode: str = "config") -> tuple[str | None, int, int]:
    """The size -> kernel table: (kernel name or None, CTAs or lanes, stream chunk bytes)."""
    k, blocks, chunk = _ext.ops().plan(int(nbytes), MODES[mode])
    return KERNEL_NAMES[int(k)], int(blocks), int(chunk)
