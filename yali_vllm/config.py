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
KERNEL_NAMES = {0: None, 3: "stream", 5: "flash-push", 6: "push-oneshot", 7: "push-twoshot", 8: "ep-gather",
                9: "ep-reduce-scatter"}
# The world sizes (ranks of a tensor-parallel group) YALI serves: 2 with the two-rank kernels
# (flash-push, stream), 4, 6 and 8 with the N-rank push one-shot and two-shot (csrc/core/yali/ranks.cuh).
WORLD_SIZES = (2, 4, 6, 8)
# The world sizes the vLLM plugin serves when YALI_WORLD_SIZES is unset, each with the committed
# serving run on real GPUs that shows YALI at parity with vLLM's defaults or better (c=1 TPOT, c=32
# output tokens/s, TTFT). A plugin that makes a server slower is not on by default.
ON_BY_DEFAULT = {
    2: "8B TP=2 on 2xH200, two alternated starts each: TTFT 0.79x at concurrency 1, concurrency-32 tokens/s "
       "1.041x, c=1 TPOT no different (benchmarks/results/current/serving/20261128-8b-tp2-h200-alternated)",
    4: "70B TP=4 on 4xH200, two alternated starts each: TPOT 0.994x at concurrency 1 and 0.987x at 8, "
       "concurrency-32 tokens/s and every TTFT no different "
       "(benchmarks/results/current/serving/20261128-70b-tp4-h200-alternated)",
}
DEFAULT_WORLD_SIZES = tuple(sorted(ON_BY_DEFAULT))
# Why each other world size the kernels serve is off by default (its result file, where one exists).
OFF_BY_DEFAULT = {
    6: "no serving run at TP=6 yet",
    8: "no serving run at TP=8 yet",
}
WORLD_SIZES_VAR = "YALI_WORLD_SIZES"
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


# Every YALI_* variable yali-vllm reads. Any other YALI_* name in the environment is refused
# (check_environment), so a typo such as YALI_MAX_BYTE or YALI_TIMEOUT cannot be ignored silently.
SETTINGS = {
    "YALI_ENABLE": "the vLLM plugin on (1) or off (0)",
    "YALI_WORLD_SIZES": "the TP world sizes the vLLM plugin serves (default 2,4; e.g. 2,4,8)",
    "YALI_FUSION": "YALI's all-reduce + RMSNorm fusion pass instead of vLLM's FlashInfer one (default on; "
                   "a quantised norm output keeps vLLM's quant fusion: yali_vllm/fusion_routing.py)",
    "YALI_MAX_BYTES": "largest message YALI serves",
    "YALI_KERNEL_MODE": "auto, flash or stream",
    "YALI_TIMEOUT_S": "the kernels' watchdog",
    "YALI_ABORT_EXIT": "1 (default): a process whose YALI kernel gave up ends 10 s after the abort record unless "
                       "YaliError reached the caller; 0 keeps it, e.g. for tests that inspect the state",
    "YALI_ALLOW_SHARED_GPU": "both ranks on one GPU, for testing",
    "YALI_EP": "1: YALI's expert-parallel dispatch / combine in vLLM's DP + EP MoE serving (default off)",
    "YALI_EP_SLOT_BYTES": "largest EP message of one rank (dispatch: all its tensors; default 2 MiB)",
}
ABORT_EXIT_VAR = "YALI_ABORT_EXIT"
EP_VAR = "YALI_EP"
EP_SLOT_VAR = "YALI_EP_SLOT_BYTES"
# 2 MiB holds 500 tokens of a 2048-wide bf16 model with top-8 ids and weights (4160 bytes a token)
# and 256 of a 4096-wide one: every decode batch and small prefill chunks; larger ones go to vLLM.
EP_SLOT_DEFAULT = 2 << 20
EP_SLOT_RANGE = (4096, 256 << 20)
# Tuning knobs: validated, with the list of known names, by the C++ core (csrc/core/yali/config.cpp).
DEV_PREFIX = "YALI_DEV_"


def unknown_variables(environ=None) -> list[str]:
    """The YALI_* names of `environ` (default os.environ) that yali-vllm does not read."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith("YALI_") and not k.startswith(DEV_PREFIX) and k not in SETTINGS)


def check_environment(environ=None) -> None:
    """ValueError naming every unknown YALI_* variable and listing the known settings."""
    env = os.environ if environ is None else environ
    unknown = unknown_variables(environ)
    if unknown:
        given = ", ".join(f"{k}={env[k]!r}" for k in unknown)
        raise ValueError(f"unknown YALI_* variable(s) {given}: yali-vllm's settings are "
                         f"{', '.join(SETTINGS)} and the {DEV_PREFIX}* tuning knobs")


def ep_slot_bytes(environ=None) -> int:
    """YALI_EP_SLOT_BYTES (default EP_SLOT_DEFAULT): a multiple of 4096 in EP_SLOT_RANGE; ValueError
    naming the variable otherwise."""
    raw = (os.environ if environ is None else environ).get(EP_SLOT_VAR, "").strip()
    if raw == "":
        return EP_SLOT_DEFAULT
    lo, hi = EP_SLOT_RANGE
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if not (lo <= n <= hi and n % 4096 == 0):
        raise ValueError(f"invalid {EP_SLOT_VAR}={raw!r}: expected a byte count in [{lo}, {hi}] and a multiple of 4096")
    return n


def kernel_config() -> dict:
    """The configuration the C++ core resolves from the environment, as a dict of numbers/strings.
    ValueError names a bad or unknown YALI_* variable."""
    check_environment()
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


def world_size_refusal(world_size: int) -> str | None:
    """Why YALI does not serve a group of `world_size` ranks, or None when it does."""
    if world_size in WORLD_SIZES:
        return None
    served = ", ".join(str(n) for n in WORLD_SIZES[:-1]) + f" or {WORLD_SIZES[-1]}"
    return f"world size is {world_size}; YALI serves {served} ranks"


def plugin_world_sizes(environ=None) -> tuple[int, ...]:
    """The TP world sizes the vLLM plugin serves: YALI_WORLD_SIZES (a comma-separated list of sizes
    from WORLD_SIZES, or "all") or DEFAULT_WORLD_SIZES; ValueError naming the variable on bad input."""
    raw = (os.environ if environ is None else environ).get(WORLD_SIZES_VAR, "").strip()
    if not raw:
        return DEFAULT_WORLD_SIZES
    if raw.lower() == "all":
        return WORLD_SIZES
    sizes = []
    for item in raw.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) not in WORLD_SIZES:
            served = ", ".join(str(n) for n in WORLD_SIZES)
            raise ValueError(f"invalid {WORLD_SIZES_VAR}={raw!r}: {item!r} is not a world size YALI "
                             f"serves; expected a comma-separated list of {served}, or all")
        sizes.append(int(item))
    return tuple(sorted(set(sizes)))


def plugin_world_size_refusal(world_size: int, environ=None) -> str | None:
    """Why the vLLM plugin leaves a TP group of `world_size` ranks to vLLM's chain, or None when
    it serves it: a world size the kernels do not serve (world_size_refusal), one that is off by
    default (OFF_BY_DEFAULT) and not listed in YALI_WORLD_SIZES, or one that YALI_WORLD_SIZES leaves out."""
    refusal = world_size_refusal(world_size)
    if refusal is not None:
        return refusal
    enabled = plugin_world_sizes(environ)
    if world_size in enabled:
        return None
    turn_on = ",".join(str(n) for n in sorted({*enabled, world_size}))
    if world_size in ON_BY_DEFAULT:  # on by default, left out by the variable
        listed = ",".join(str(n) for n in enabled)
        return f"world size {world_size} is not in {WORLD_SIZES_VAR}={listed}; {WORLD_SIZES_VAR}={turn_on} turns it on"
    why = OFF_BY_DEFAULT.get(world_size, "not measured in serving")
    return (f"world size {world_size} is off by default: {why}; "
            f"{WORLD_SIZES_VAR}={turn_on} turns it on")


FUSED_LAUNCH_KEYS = ("one_launch", "grid", "batch_poll", "row_loads_early", "cta_bytes", "cluster", "spread")


def launch_dict(values) -> dict:
    """The fused op's launch values (torch op fused_launch / fused_plan) by name."""
    return dict(zip(FUSED_LAUNCH_KEYS, (int(x) for x in values)))


def fused_plan(rows: int, hidden: int, dtype, world_size: int = 2) -> dict:
    """How a fused call of `rows` x `hidden` `dtype` runs at `world_size` ranks under the current
    settings (plan.cpp fused_launch_for), without a communicator or a GPU."""
    return launch_dict(_ext.ops().fused_plan(int(rows), int(hidden), dtype, int(world_size)))


def plan(nbytes: int, mode: str = "config", world_size: int = 2) -> tuple[str | None, int, int]:
    """The size -> kernel table of `world_size` ranks: (kernel name or None, CTAs or lanes, stream
    chunk bytes). None: YALI does not serve the message (vLLM's chain does)."""
    k, blocks, chunk = _ext.ops().plan(int(nbytes), MODES[mode], int(world_size))
    return KERNEL_NAMES[int(k)], int(blocks), int(chunk)
