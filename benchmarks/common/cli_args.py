"""Argument types shared by the benchmark command lines.

Each function is an argparse ``type=``: it returns the parsed value or raises
``argparse.ArgumentTypeError`` naming the bad value and what is accepted, so a
command refuses a bad argument (argparse prints ``argument --port: ...`` and
exits 2) before it starts a server, a process or GPU work.

``--world-size`` (the ranks of a benchmark, the tensor-parallel size of a server) is
added by :func:`add_world_size_arg`; :func:`place_ranks` then checks, before any
rank starts, that the machine has a GPU per rank (or that the ranks may share GPU 0).
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _int_in(text: str, low: int, high: int | None = None) -> int:
    accepted = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"
    try:
        value = int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {accepted}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{text!r} is not {accepted}")
    return value


def positive_int(text: str) -> int:
    """A count, size or number of rounds: an integer >= 1."""
    return _int_in(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0 (0 = off where a command says so)."""
    return _int_in(text, 0)


def tcp_port(text: str) -> int:
    """A TCP port: 1..65535."""
    return _int_in(text, 1, 65535)


def int_range(low: int, high: int) -> Callable[[str], int]:
    """The type of an integer in low..high."""
    def parse(text: str) -> int:
        return _int_in(text, low, high)

    parse.__name__ = f"int_range({low}, {high})"
    return parse


def _number(text: str) -> float:
    """`text` as a float, nan when it is not a number (every range check below refuses nan)."""
    try:
        return float(str(text).strip())
    except ValueError:
        return math.nan


def sorted_unique(text: str, parse_one: Callable[[str], Any], empty: str) -> list:
    """Comma-separated items, each parsed by `parse_one` (which raises ArgumentTypeError naming a
    bad one), sorted, duplicates dropped; `empty` is the error when there is no item."""
    out = {parse_one(part.strip()) for part in str(text).split(",") if part.strip()}
    if not out:
        raise argparse.ArgumentTypeError(empty)
    return sorted(out)


def float_range(low: float, high: float) -> Callable[[str], float]:
    """The type of a number in [low, high] (nan and inf are refused)."""
    def parse(text: str) -> float:
        value = _number(text)
        if not (low <= value <= high):  # false for nan
            raise argparse.ArgumentTypeError(f"{text!r} is not a number in [{low:g}, {high:g}]")
        return value

    parse.__name__ = f"float_range({low:g}, {high:g})"
    return parse


def positive_float(text: str) -> float:
    """A duration, ratio or epsilon: a finite number > 0 (nan and inf are refused)."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number > 0")
    return value


def fraction(text: str) -> float:
    """A share of something, e.g. of GPU memory: a number in (0, 1]."""
    value = _number(text)
    if not (0 < value <= 1):  # false for nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in (0, 1]")
    return value


def positive_int_list(text: str, what: str = "value") -> list[int]:
    """"1,2,4" -> [1, 2, 4]: positive integers, sorted, duplicates dropped."""
    def one(part: str) -> int:
        try:
            v = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: {part!r} is not an integer") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{what}: {v} is not positive")
        return v

    return sorted_unique(text, one, f"{what}: empty list")


def choice_list(text: str, choices: Sequence[str], what: str) -> list[str]:
    """"bf16,fp16" -> ["bf16", "fp16"] in the order of `choices`; unknown names are an error."""
    names = [p.strip() for p in str(text).split(",") if p.strip()]
    bad = [n for n in names if n not in choices]
    if bad:
        raise argparse.ArgumentTypeError(f"{what}: unknown {', '.join(map(repr, bad))} (choose from {', '.join(choices)})")
    if not names:
        raise argparse.ArgumentTypeError(f"{what}: empty list")
    return [c for c in choices if c in names]


def parse_csv_list(text: str) -> list[str]:
    """"a, b,,c" -> ["a", "b", "c"]: the non-empty comma-separated items, in order."""
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_int_list(text: str) -> list[int]:
    """"1,8,32" -> [1, 8, 32]: positive integers in the given order."""
    vals = [positive_int(t) for t in parse_csv_list(text)]
    if not vals:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


# ----------------------------------------------------------------------------- world size
WORLD_SIZE_OPTION = "--world-size"


def world_size(text: str) -> int:
    """A world size YALI serves (yali_vllm.config.WORLD_SIZES: 2, 4, 6 or 8)."""
    from yali_vllm.config import world_size_refusal

    n = _int_in(text, 1)
    refusal = world_size_refusal(n)
    if refusal:
        raise argparse.ArgumentTypeError(f"{text!r} is refused: {refusal}")
    return n


def add_world_size_arg(parser: argparse.ArgumentParser, what: str = "ranks, one GPU each") -> None:
    """``--world-size N`` (default 2) on `parser`; `what` says what N counts."""
    parser.add_argument(WORLD_SIZE_OPTION, type=world_size, default=2,
                        help=f"{what}: 2, 4, 6 or 8 (default %(default)s)")


def too_few_gpus(n_ranks: int, visible_gpus: int) -> str | None:
    """Why `n_ranks` ranks, one GPU each, do not fit a machine with `visible_gpus` GPUs, or None."""
    if n_ranks <= visible_gpus:
        return None
    return (f"{WORLD_SIZE_OPTION} {n_ranks} needs {n_ranks} GPUs, and {visible_gpus} are visible "
            "(torch.cuda.device_count())")


def shared_gpu_note(n_ranks: int) -> str:
    """What a report says when the ranks shared GPU 0."""
    from yali_vllm.communicator import SHARED_GPU_VAR

    return (f"the {n_ranks} ranks shared GPU 0 ({SHARED_GPU_VAR}=1): the outputs are checked, the timings "
            "are not valid (the ranks' processes take turns on one GPU)")


def place_ranks(n_ranks: int) -> bool:
    """Before a benchmark starts its `n_ranks` rank processes: False when the machine has a GPU
    per rank; True when it has fewer and YALI_ALLOW_SHARED_GPU=1 puts every rank on GPU 0 (then
    it says on stderr that the timings are not valid); else SystemExit naming --world-size."""
    import torch

    from yali_vllm.communicator import SHARED_GPU_VAR, shared_gpu_allowed

    shortage = too_few_gpus(n_ranks, torch.cuda.device_count())
    if shortage is None:
        return False
    if not shared_gpu_allowed():
        raise SystemExit(f"{shortage}; {SHARED_GPU_VAR}=1 runs every rank on GPU 0 for a correctness check "
                         "(no valid timing)")
    print(f"WARNING: {shared_gpu_note(n_ranks)}", file=sys.stderr, flush=True)
    return True


def rank_device(rank: int, shared: bool) -> int:
    """The CUDA device of `rank`: its own, or 0 when the ranks share GPU 0."""
    return 0 if shared else rank


def add_graph_bench_args(parser: argparse.ArgumentParser, stem: str, per_graph: str, out: str) -> None:
    """The options every N-rank CUDA-graph microbenchmark takes (allreduce_bench, moe_bench): ops per
    graph (`per_graph` says what one is), timed replays, output folder (default `out`) and file stem
    (default STEM-<date>), the run's time limit, --world-size and --report-only."""
    parser.add_argument("--graph-ops", type=positive_int, default=50, help=f"{per_graph} per CUDA graph")
    parser.add_argument("--replays", type=positive_int, default=20, help="timed graph replays")
    parser.add_argument("--out", default=out)
    parser.add_argument("--name", default=None, help=f"result file stem (default {stem}-<date>)")
    parser.add_argument("--timeout", type=positive_float, default=1500, help="give up after this many seconds")
    add_world_size_arg(parser)
    parser.add_argument("--report-only", metavar="JSON", help="rebuild the table and plots from a result file")
