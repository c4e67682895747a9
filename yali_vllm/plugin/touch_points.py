"""Every place where YALI changes vLLM, one row each: the vLLM class or module, the symbol, the
vLLM releases that have it, the technique, and what YALI does there.

The patching code takes its targets from these rows (patch.py, ep_manager.py, fusion_patch.py,
and register() for yali_vllm/vllm_log.py), so no patch exists without its row;
tests/plugin/test_touch_points.py holds every row against the installed vLLM and against what the
patching code changes. The table in docs/VLLM_INTEGRATION.md is :func:`markdown_table` (the test
prints it when the page differs).

What YALI only calls or reads in vLLM (``get_tp_group``, ``direct_register_custom_op``, the
``VllmInductorPass`` base of its fusion pass, ...) is vLLM's API as it is, not a touch point.
"""

from __future__ import annotations

from dataclasses import dataclass

from yali_vllm._version import OLDEST_VLLM_VERSION, TESTED_VLLM_VERSION

# The four techniques.
METHOD = "method"  # the class's own function is replaced in place by a wrapper that calls it
MODULE_SYMBOL = "module symbol"  # a module-level name is rebound to YALI's callable, which calls vLLM's
CLASS_SWAP = "class swap"  # a live object's __class__ becomes YALI's subclass, which overrides the method
CACHE_FACTOR = "compile-cache factor"  # YALI adds an entry to a table vLLM hashes into its compile-cache key
TECHNIQUES = (METHOD, MODULE_SYMBOL, CLASS_SWAP, CACHE_FACTOR)

# The owners: "module" or "module:Class".
COMMUNICATOR = "vllm.distributed.device_communicators.cuda_communicator:CudaCommunicator"
ALL2ALL_MANAGER = "vllm.distributed.device_communicators.all2all:AgRsAll2AllManager"
PASS_MANAGER = "vllm.compilation.passes.pass_manager"
ENVS = "vllm.envs"
VLLM_LOGGER = "vllm.logger"


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "0.33.0", "0.31.1.dev3+g..." or "0.30"; (0, 0) if
    unreadable."""
    try:
        major, minor = version.split(".")[:2]
        return int(major), int("".join(ch for ch in minor if ch.isdigit()) or "x")
    except ValueError:
        return (0, 0)


@dataclass(frozen=True)
class TouchPoint:
    owner: str  # "module" or "module:Class"
    symbol: str  # the method, module-level name or table
    versions: str  # the vLLM release series that have the symbol: "0.26-0.33", or one: "0.33"
    technique: str  # one of TECHNIQUES
    does: str  # what YALI does there

    @property
    def module(self) -> str:
        return self.owner.partition(":")[0]

    @property
    def class_name(self) -> str | None:
        return self.owner.partition(":")[2] or None

    @property
    def span(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The first and the last release series (major, minor) that have the symbol."""
        first, _, last = self.versions.partition("-")
        return release(first), release(last or first)

    @property
    def optional(self) -> bool:
        """Whether some supported vLLM lacks the symbol: the patch then applies where it exists;
        a symbol every supported vLLM has is a hook point, and the patch is refused without it."""
        first, last = self.span
        return first > release(OLDEST_VLLM_VERSION) or last < release(TESTED_VLLM_VERSION)

    def exists_in(self, version: str) -> bool:
        """Whether vLLM `version` has the symbol, by this row."""
        first, last = self.span
        return first <= release(version) <= last


TOUCH_POINTS = (
    TouchPoint(COMMUNICATOR, "__init__", "0.26-0.33", METHOD,
               "runs vLLM's, then builds the group's YaliCommunicator (`yali_comm`) or logs why not; in a CUDA "
               "TP group it installs the fusion pass hooks, in the EP group YALI's all-to-all manager"),
    TouchPoint(COMMUNICATOR, "all_reduce", "0.26-0.33", METHOD,
               "YALI first for every tensor `yali_comm.should_use` takes; every other tensor goes down "
               "vLLM's chain"),
    TouchPoint(COMMUNICATOR, "destroy", "0.26-0.33", METHOD, "closes YALI's communicator, then runs vLLM's"),
    TouchPoint(COMMUNICATOR, "checkpoint_prepare", "0.27-0.33", METHOD,
               "releases YALI's buffers unless a CUDA graph captured its kernels, then runs vLLM's"),
    TouchPoint(COMMUNICATOR, "suspend", "0.30-0.33", METHOD,
               "logs that YALI's buffers stay resident and mapped, then runs vLLM's"),
    TouchPoint(ALL2ALL_MANAGER, "dispatch", "0.26-0.33", CLASS_SWAP,
               "YALI's all-gather of the hidden states, top-k weights and ids where YALI serves the call, "
               "else vLLM's"),
    TouchPoint(ALL2ALL_MANAGER, "dispatch_router_logits", "0.26-0.33", CLASS_SWAP,
               "YALI's all-gather of the hidden states and router logits where YALI serves the call, else vLLM's"),
    TouchPoint(ALL2ALL_MANAGER, "combine", "0.26-0.33", CLASS_SWAP,
               "YALI's reduce-scatter of the expert outputs where YALI serves the call, else vLLM's"),
    TouchPoint(ALL2ALL_MANAGER, "allocate_combine_input", "0.33", CLASS_SWAP,
               "no buffer (a plain tensor) where YALI serves the combine, else vLLM's (NCCL symmetric memory)"),
    TouchPoint(ALL2ALL_MANAGER, "combine_into_output", "0.33", CLASS_SWAP,
               "YALI's reduce-scatter into the layer's output where YALI serves the call, else vLLM's"),
    TouchPoint(ALL2ALL_MANAGER, "destroy", "0.26-0.33", CLASS_SWAP,
               "closes YALI's EP communicator, then runs vLLM's"),
    TouchPoint(PASS_MANAGER, "AllReduceFusionPass", "0.26-0.33", MODULE_SYMBOL,
               "a factory: YALI's fusion pass where YALI serves the TP group and YALI_FUSION is on (vLLM's "
               "pass inside it for a quantised model), else vLLM's pass (the name exists on CUDA platforms)"),
    TouchPoint(ENVS, "environment_variables", "0.26-0.33", CACHE_FACTOR,
               "the entry `YALI_FUSION_PASS`: `vllm`, or `yali@` and the hash of YALI's pass sources, so no "
               "run loads a graph that another choice compiled"),
    TouchPoint(VLLM_LOGGER, "_configure_vllm_root_logger", "0.26-0.33", MODULE_SYMBOL,
               "wrapped while the plugin's log lines wait for vLLM's logging (0.31+ load plugins before it "
               "is configured): hands them to vLLM's handlers right after"),
)


def on(owner: str) -> tuple[TouchPoint, ...]:
    """The rows of `owner`, in table order; ValueError naming `owner` when it has none."""
    rows = tuple(t for t in TOUCH_POINTS if t.owner == owner)
    if not rows:
        raise ValueError(f"no touch point of vLLM's {owner!r} is listed in yali_vllm/plugin/touch_points.py")
    return rows


def markdown_table() -> str:
    """The rows as the Markdown table of docs/VLLM_INTEGRATION.md."""
    lines = ["| vLLM class or module | symbol | vLLM | technique | what YALI does there |",
             "| --- | --- | --- | --- | --- |"]
    for t in TOUCH_POINTS:
        where = t.class_name or t.module
        lines.append(f"| `{where}` | `{t.symbol}` | {t.versions.replace('-', '–')} | {t.technique} | {t.does} |")
    return "\n".join(lines) + "\n"

