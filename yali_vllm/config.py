"""The YALI_* settings (environment variables) and the resolved kernel configuration.

Every setting is declared once, in settings.def (csrc/core/yali/common/settings.def, shipped in the
package as yali_vllm/settings.def): name, type, default and bounds, one line each. The C++ core
reads the kernel configuration from it (YALI_KERNEL_MODE, YALI_MAX_BYTES, YALI_TIMEOUT_S,
YALI_DEV_*: csrc/core/yali/common/config.cpp), so the C++ API and Python agree; this module reads the
plugin's settings from it (setting) and refuses every YALI_* name it does not declare
(check_environment). A bad value raises ValueError naming the variable and what it accepts.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import _ext

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}

# Kernel ids as returned by plan() (csrc/core/yali/common/config.h: enum class Kernel).
KERNEL_NAMES = {0: None, 3: "stream", 5: "flash-push", 6: "push-oneshot", 7: "push-twoshot", 8: "ep-gather",
                9: "ep-reduce-scatter"}
# The world sizes (ranks of a tensor-parallel group) YALI serves: 2 with the two-rank kernels
# (flash-push, stream), 4, 6 and 8 with the N-rank push one-shot and two-shot (csrc/core/yali/all_reduce/n_rank.cuh).
WORLD_SIZES = (2, 4, 6, 8)
# The world sizes the vLLM plugin serves when YALI_WORLD_SIZES is unset, each with the committed
# serving run on real GPUs that shows YALI at parity with vLLM's defaults or better (c=1 TPOT, c=32
# output tokens/s, TTFT). A plugin that makes a server slower is not on by default.
ON_BY_DEFAULT = {
    2: "8B TP=2 on 2xH200, two alternated starts each: TTFT 0.79x at concurrency 1, concurrency-32 tokens/s "
       "1.041x, c=1 TPOT no different (lab/results/current/serving/20261128-8b-tp2-h200-alternated)",
    4: "70B TP=4 on 4xH200, two alternated starts each: not slower (TPOT 0.994x at concurrency 1 and 0.987x "
       "at 8; concurrency-32 tokens/s and TTFT within the spread between starts, c=32 TTFT p50 1216 against "
       "1077 ms with a 198 ms spread) (lab/results/current/serving/20261128-70b-tp4-h200-alternated)",
}
# Why each other world size the kernels serve is off by default (its result file, where one exists).
OFF_BY_DEFAULT = {
    6: "no serving run at TP=6 yet",
    8: "no serving run at TP=8 yet",
}
WORLD_SIZES_VAR = "YALI_WORLD_SIZES"
# Kernel modes accepted by all_reduce(mode=...) (enum class KernelMode); -1 = the configured one.
MODES = {"config": -1, "auto": 0, "flash": 1, "stream": 2}


def parse_bytes(text: str) -> int | None:
    """A byte count as the C++ core reads it ("123", "64K", "16M", "2G": binary), or None."""
    m = re.fullmatch(r"\s*(\d+)([KkMmGg]?)", text)
    return int(m.group(1)) * _UNITS[m.group(2).lower()] if m else None


def parse_int(text: str) -> int | None:
    m = re.fullmatch(r"\s*([+-]?\d+)", text)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Setting:
    """One line of settings.def: a YALI_* variable, its type, default and bounds (as a user writes
    them), and what it does. `field` is the C++ Config member; None for a setting this package
    reads."""
    name: str
    field: str | None
    type: str
    default: str
    low: str
    high: str
    step: str
    help: str

    def accepted(self) -> str:
        """What a value must be, as the error for a bad one says it."""
        if self.type == "bytes":
            step = parse_bytes(self.step) if self.step else 1
            multiple = f" and a multiple of {step}" if step > 1 else ""
            return (f"a byte count in [{parse_bytes(self.low)}, {parse_bytes(self.high)}]{multiple} "
                    f"(suffixes K, M, G allowed)")
        if self.type == "int":
            return f"an integer in [{self.low}, {self.high}]"
        if self.type == "flag":
            return "one of 1/0, true/false, yes/no, on/off"
        if self.type == "seconds":
            return f"0 (none) or seconds in [{self.low}, {self.high}]"
        if self.type == "mode":
            return "one of auto, flash, stream"
        return f"a comma-separated list of {', '.join(str(n) for n in WORLD_SIZES)}, or all"  # sizes

    def parse(self, raw: str):
        """The value `raw` stands for; ValueError naming the variable and what it accepts."""
        try:
            value = _parsers[self.type](self, raw)
        except ValueError as e:  # the parser names the part that is wrong
            raise ValueError(f"invalid {self.name}={raw!r}: {e}; expected {self.accepted()}") from None
        if value is None:
            raise ValueError(f"invalid {self.name}={raw!r}: expected {self.accepted()}")
        return value

    def value(self, environ=None):
        """This setting's value in `environ` (default os.environ); its default when unset or empty."""
        raw = (os.environ if environ is None else environ).get(self.name, "")
        return self.parse(raw if raw.strip() else self.default)


def _bytes_value(s: Setting, raw: str) -> int | None:
    n = parse_bytes(raw)
    ok = n is not None and parse_bytes(s.low) <= n <= parse_bytes(s.high) and n % (parse_bytes(s.step or "1")) == 0
    return n if ok else None


def _int_value(s: Setting, raw: str) -> int | None:
    n = parse_int(raw)
    return n if n is not None and int(s.low) <= n <= int(s.high) else None


def _flag_value(s: Setting, raw: str) -> bool | None:
    v = raw.strip().lower()
    return True if v in _TRUE else False if v in _FALSE else None


def _seconds_value(s: Setting, raw: str) -> float | None:
    try:
        v = float(raw)
    except ValueError:
        return None
    return v if v == 0 or float(s.low) <= v <= float(s.high) else None


def _mode_value(s: Setting, raw: str) -> str | None:
    return raw if raw in ("auto", "flash", "stream") else None


def _sizes_value(s: Setting, raw: str) -> tuple[int, ...] | None:
    if raw.strip().lower() == "all":
        return WORLD_SIZES
    items = [item.strip() for item in raw.split(",")]
    for item in items:
        if not item.isdigit() or int(item) not in WORLD_SIZES:
            raise ValueError(f"{item!r} is not a world size YALI serves")
    return tuple(sorted({int(item) for item in items}))


_parsers = {"bytes": _bytes_value, "int": _int_value, "flag": _flag_value, "seconds": _seconds_value,
            "mode": _mode_value, "sizes": _sizes_value}
SETTINGS_FILE = Path(__file__).with_name("settings.def")
_CORE_LINE = re.compile(r'YALI_SETTING\((\w+), (\w+), (\w+), "([^"]*)", "([^"]*)", "([^"]*)", "([^"]*)", "([^"]*)"\)')
_PLUGIN_LINE = re.compile(r'YALI_PLUGIN_SETTING\((\w+), (\w+), "([^"]*)", "([^"]*)", "([^"]*)", "([^"]*)", "([^"]*)"\)')


def read_settings(path: Path = SETTINGS_FILE) -> dict[str, Setting]:
    """Every setting settings.def declares, by name, in its order."""
    out: dict[str, Setting] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("//"):
            continue
        if m := _CORE_LINE.fullmatch(line):
            s = Setting(*m.groups())
        elif m := _PLUGIN_LINE.fullmatch(line):
            name, *rest = m.groups()
            s = Setting(name, None, *rest)
        else:
            raise ValueError(f"{path}:{number}: not a settings line: {line!r}")
        if s.type not in _parsers:
            raise ValueError(f"{path}:{number}: {s.name} has the unknown type {s.type!r}")
        out[s.name] = s
    return out


# Every YALI_* variable yali-vllm reads. Any other YALI_* name in the environment is refused
# (check_environment), so a typo such as YALI_MAX_BYTE or YALI_TIMEOUT cannot be ignored silently.
SETTINGS = read_settings()


def setting(name: str, environ=None):
    """The value of the setting `name` in `environ` (default os.environ), or its default."""
    return SETTINGS[name].value(environ)


# The world sizes the plugin serves when YALI_WORLD_SIZES is unset: ON_BY_DEFAULT's (a test checks).
DEFAULT_WORLD_SIZES = setting(WORLD_SIZES_VAR, {})


def env_flag(name: str, default: bool | None = None, environ=None) -> bool:
    """Reads a flag such as YALI_ENABLE from `environ` (default os.environ); unset or empty: `default`,
    or else the one settings.def gives. ValueError naming it on bad input."""
    raw = (os.environ if environ is None else environ).get(name, "")
    if not raw.strip():
        return SETTINGS[name].parse(SETTINGS[name].default) if default is None else default
    return SETTINGS[name].parse(raw)


FUSE_QUANT_VAR = "YALI_FUSE_QUANT"


def fuse_quant_enabled(environ=None) -> bool:
    """YALI_FUSE_QUANT (settings.def, default off): whether YALI's fusion pass rewrites an all-reduce +
    RMSNorm pair whose output is FP8-quantised into YALI's quantising op. ValueError naming it on bad
    input."""
    return env_flag(FUSE_QUANT_VAR, environ=environ)


ABORT_EXIT_VAR = "YALI_ABORT_EXIT"
EP_VAR = "YALI_EP"
EP_SLOT_VAR = "YALI_EP_SLOT_BYTES"
# 2 MiB holds 500 tokens of a 2048-wide bf16 model with top-8 ids and weights (4160 bytes a token)
# and 256 of a 4096-wide one: every decode batch and small prefill chunks; larger ones go to vLLM.
EP_SLOT_DEFAULT = SETTINGS[EP_SLOT_VAR].parse(SETTINGS[EP_SLOT_VAR].default)
EP_SLOT_RANGE = (parse_bytes(SETTINGS[EP_SLOT_VAR].low), parse_bytes(SETTINGS[EP_SLOT_VAR].high))
# Tuning knobs (docs/TUNING.md); the C++ core refuses an undeclared one too, for the C++ API.
DEV_PREFIX = "YALI_DEV_"


def unknown_variables(environ=None) -> list[str]:
    """The YALI_* names of `environ` (default os.environ) that settings.def does not declare."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith("YALI_") and k not in SETTINGS)


def check_environment(environ=None) -> None:
    """ValueError naming every unknown YALI_* variable and listing the known settings and knobs."""
    env = os.environ if environ is None else environ
    unknown = unknown_variables(environ)
    if unknown:
        given = ", ".join(f"{k}={env[k]!r}" for k in unknown)
        settings = ", ".join(n for n in SETTINGS if not n.startswith(DEV_PREFIX))
        knobs = ", ".join(n for n in SETTINGS if n.startswith(DEV_PREFIX))
        raise ValueError(f"unknown YALI_* variable(s) {given}: yali-vllm's settings are {settings}, and its "
                         f"{DEV_PREFIX}* tuning knobs {knobs}")


def ep_slot_bytes(environ=None) -> int:
    """YALI_EP_SLOT_BYTES (settings.def: default 2 MiB, a multiple of 4 KiB in EP_SLOT_RANGE); ValueError
    naming the variable otherwise."""
    return setting(EP_SLOT_VAR, environ)


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
    return setting(WORLD_SIZES_VAR, environ)


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
    settings (plan_table.h, through plan.cpp fused_launch_for), without a communicator or a GPU."""
    return launch_dict(_ext.ops().fused_plan(int(rows), int(hidden), dtype, int(world_size)))


def plan_table(world_size: int = 2) -> dict:
    """The library's size table (csrc/core/yali/common/plan_table.h) as `world_size` ranks use it under
    the current settings: "allreduce", the all-reduce bands in increasing order ({"kernel", "up_to"}:
    the kernel serves the messages above the previous band's up_to and up to its own; none above
    the last); "fused_band", the one-launch fused op's bands ({"up_to", "row_bytes_max", "cta_bytes",
    "row_loads_early", "cluster_max"}, the first that holds a call's message and row bytes applies;
    0 = unbounded); "limits", a dict: serve_max (the largest message served), oneshot_max and
    slot_bytes (N ranks), fused_one_launch_max, fused_max_row_bytes, max_ctas, epilogue_max_ctas,
    spread_max_ctas, stream_lanes, stream_slots, max_ranks, ep_max_parts. ValueError names a bad
    YALI_* variable."""
    out: dict = {"allreduce": [], "fused_band": []}
    for line in _ext.ops().plan_table(int(world_size)).splitlines():
        name, _, values = line.partition(" ")
        row = parse_config_string(values)
        if name == "limits":
            out["limits"] = row
        else:
            out[name].append(row)
    return out


def limits(world_size: int = 2) -> dict:
    """The size table's limits at `world_size` ranks under the current settings (plan_table)."""
    return plan_table(world_size)["limits"]


def plan(nbytes: int, mode: str = "config", world_size: int = 2) -> tuple[str | None, int, int]:
    """The size -> kernel table of `world_size` ranks: (kernel name or None, CTAs or lanes, stream
    chunk bytes). None: YALI does not serve the message (vLLM's chain does)."""
    k, blocks, chunk = _ext.ops().plan(int(nbytes), MODES[mode], int(world_size))
    return KERNEL_NAMES[int(k)], int(blocks), int(chunk)
