"""Expert parallelism: YALI's dispatch and combine (csrc/core/yali/ep/ep.cuh) behind vLLM's default
all-to-all manager.

With ``--data-parallel-size N --enable-expert-parallel`` (and vLLM's default all2all backend,
``allgather_reducescatter``), every MoE layer dispatches with an all-gather of the DP ranks'
hidden states, top-k weights and ids (and any extra tensors: quantisation scales, LoRA
mappings) and combines with a reduce-scatter of the expert outputs, through vLLM's
``AgRsAll2AllManager`` on NCCL. YALI's kernels have exactly those semantics: the gather is
bitwise the inputs, and the combine adds the ranks' rows in rank order in fp32 and rounds once.

When the expert-parallel group's communicator is built, :func:`setup_ep` asks
:func:`yali_vllm.plugin.gate.ep_gate`, builds a YaliCommunicator with an EP area over the
group, and turns vLLM's manager into :class:`YaliAgRsAll2AllManager` (its subclass, made once
per vLLM class by :func:`manager_class`). Each call is served by YALI when every rank would
serve it, decided from values all ranks share (the DP token counts, row shapes and dtypes);
every other call, sequence-parallel MoE and every size above YALI_EP_SLOT_BYTES included, goes
to vLLM's own method unchanged. One log line per group says whether YALI serves it, and why.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from yali_vllm.vllm_log import LOGGER, log_first_call

from .collective import all_gather, close_quietly, p2p_from_info, release_everywhere
from .gate import ep_gate
from .touch_points import ALL2ALL_MANAGER, on

logger = logging.getLogger(LOGGER)

# vLLM's manager class YALI takes over (vllm.distributed.device_communicators.all2all).
AGRS_CLASS = ALL2ALL_MANAGER.partition(":")[2]
_classes: dict[type, type] = {}


def manager_class(base: type) -> type:
    """The subclass of vLLM's ``base`` (AgRsAll2AllManager) that serves dispatch and combine with
    YALI where it can, made once per base class."""
    if base in _classes:
        return _classes[base]

    class YaliAgRsAll2AllManager(base):  # type: ignore[misc, valid-type]
        """vLLM's all-gather / reduce-scatter manager, with YALI first (module docstring)."""

        yali_comm: Any = None
        yali_ranks: list[int] = []
        yali_group = ""

        def _yali_log_first(self, what: str, served: bool, tokens: list[int] | None) -> None:
            """One line per process and group the first time `what` ("dispatch", "combine") is served
            by YALI and the first time it goes to vLLM's manager (CUDA graph replays run no Python:
            these are captures and eager calls)."""
            if served:
                log_first_call(f"ep {what}", (self.yali_group, True),
                               "YALI EP: first %s on group '%s' served by YALI (tokens per rank %s)", what,
                               self.yali_group, tokens)
            else:
                log_first_call(f"ep {what}", (self.yali_group, False),
                               "YALI EP: first %s on group '%s' that YALI does not serve (sequence-parallel, "
                               "another group, or above YALI_EP_SLOT_BYTES): vLLM's %s", what, self.yali_group,
                               type(self).__mro__[1].__name__)

        def _yali_counts(self, local_tokens: int, is_sequence_parallel: bool) -> list[int] | None:
            """Every rank's token count when YALI's group is the one vLLM would use, else None."""
            if self.yali_comm is None or is_sequence_parallel:
                return None
            group = self._get_comm_group(False)
            if list(getattr(group, "ranks", [])) != self.yali_ranks:
                return None
            return [int(n) for n in self._get_sizes(local_tokens, group)]

        def _yali_gather(self, tensors: list[Any], is_sequence_parallel: bool) -> list[Any] | None:
            counts = self._yali_counts(tensors[0].shape[0], is_sequence_parallel)
            served = counts is not None and self.yali_comm.ep_serves_dispatch(tensors, counts)
            if self.yali_comm is not None:
                self._yali_log_first("dispatch", served, counts)
            return self.yali_comm.ep_dispatch(tensors, counts) if served else None

        def dispatch(self, hidden_states: Any, topk_weights: Any, topk_ids: Any,
                     is_sequence_parallel: bool = False, extra_tensors: list[Any] | None = None) -> Any:
            got = self._yali_gather([hidden_states, topk_weights, topk_ids, *(extra_tensors or [])],
                                    is_sequence_parallel)
            if got is None:
                return super().dispatch(hidden_states, topk_weights, topk_ids, is_sequence_parallel, extra_tensors)
            if extra_tensors is None:
                return got[0], got[1], got[2]
            return got[0], got[1], got[2], got[3:]

        def dispatch_router_logits(self, hidden_states: Any, router_logits: Any, is_sequence_parallel: bool = False,
                                   extra_tensors: list[Any] | None = None) -> Any:
            got = self._yali_gather([hidden_states, router_logits, *(extra_tensors or [])], is_sequence_parallel)
            if got is None:
                return super().dispatch_router_logits(hidden_states, router_logits, is_sequence_parallel,
                                                      extra_tensors)
            if extra_tensors is None:
                return got[0], got[1]
            return got[0], got[1], got[2:]

        def _yali_combine_counts(self, hidden_states: Any, is_sequence_parallel: bool) -> list[int] | None:
            world = self.yali_comm.world_size if self.yali_comm is not None else 1
            counts = self._yali_counts(hidden_states.shape[0] // world, is_sequence_parallel)
            served = counts is not None and self.yali_comm.ep_serves_combine(hidden_states, counts)
            if self.yali_comm is not None:
                self._yali_log_first("combine", served, counts)
            return counts if served else None

        def combine(self, hidden_states: Any, is_sequence_parallel: bool = False) -> Any:
            counts = self._yali_combine_counts(hidden_states, is_sequence_parallel)
            if counts is None:
                return super().combine(hidden_states, is_sequence_parallel)
            return self.yali_comm.ep_combine(hidden_states, counts)

        # vLLM 0.33+: the combine writes into the MoE layer's output, its input in a buffer the
        # manager may provide (vLLM's: NCCL symmetric memory). YALI's combine reads a plain tensor.
        def allocate_combine_input(self, shape: tuple[int, ...], dtype: Any, device: Any,
                                   is_sequence_parallel: bool = False) -> Any:
            if self._yali_serves_shape(shape, dtype, is_sequence_parallel):
                return None
            return super().allocate_combine_input(shape, dtype, device, is_sequence_parallel)

        def _yali_serves_shape(self, shape: tuple[int, ...], dtype: Any, is_sequence_parallel: bool) -> bool:
            if self.yali_comm is None or len(shape) != 2:
                return False
            counts = self._yali_counts(shape[0] // self.yali_comm.world_size, is_sequence_parallel)
            return (counts is not None and sum(counts) == shape[0]
                    and self.yali_comm.ep_serves_rows(shape[1], dtype, counts))

        def combine_into_output(self, hidden_states: Any, output: Any, is_sequence_parallel: bool = False) -> Any:
            counts = self._yali_combine_counts(hidden_states, is_sequence_parallel)
            if counts is None:
                return super().combine_into_output(hidden_states, output, is_sequence_parallel)
            return self.yali_comm.ep_combine(hidden_states, counts, out=output)

        def destroy(self) -> None:
            yc, self.yali_comm = self.yali_comm, None
            if yc is not None:
                close_quietly(yc)
            super().destroy()

    YaliAgRsAll2AllManager.__qualname__ = f"YaliAgRsAll2AllManager[{base.__qualname__}]"
    _classes[base] = YaliAgRsAll2AllManager
    return YaliAgRsAll2AllManager


# The parameters (after self) YALI relies on, of the methods it overrides (the class's rows in
# touch_points.py) and of those the overrides call, which every supported vLLM has.
_PARAMS = {
    "dispatch": ("hidden_states", "topk_weights", "topk_ids", "is_sequence_parallel", "extra_tensors"),
    "dispatch_router_logits": ("hidden_states", "router_logits", "is_sequence_parallel", "extra_tensors"),
    "combine": ("hidden_states", "is_sequence_parallel"),
    "allocate_combine_input": ("shape", "dtype", "device", "is_sequence_parallel"),
    "combine_into_output": ("hidden_states", "output", "is_sequence_parallel"),
    "destroy": (),
    "_get_comm_group": ("is_sequence_parallel",),
    "_get_sizes": ("num_local_tokens", "comm_group"),
}
CALLED = ("_get_comm_group", "_get_sizes")


def agrs_hook_problem(cls: type) -> str | None:
    """None if ``cls`` (vLLM's AgRsAll2AllManager) has the methods YALI overrides (an optional one
    only where the class has it) and calls, with the parameters it passes, else what differs."""
    import inspect

    overridden = [p.symbol for p in on(ALL2ALL_MANAGER) if not p.optional or hasattr(cls, p.symbol)]
    for name in (*overridden, *CALLED):
        fn = getattr(cls, name, None)
        if not callable(fn):
            return f"{cls.__name__}.{name} is missing"
        try:
            have = list(inspect.signature(fn).parameters)[1:]
        except (TypeError, ValueError) as e:
            return f"cannot read {cls.__name__}.{name}'s signature: {e}"
        if have != list(_PARAMS[name]):
            return f"{cls.__name__}.{name}{tuple(have)} is not {name}{_PARAMS[name]}"
    return None


def _ep_info(comm: Any, manager: Any) -> dict[str, Any]:
    """This rank's inputs to the EP gate (gathered: every rank must decide alike)."""
    from yali_vllm import config

    from .gate import parse_enable

    info: dict[str, Any] = {"host": socket.gethostname(), "error": None}
    try:
        # Off by default: the EP kernels turn on by default once GPU runs show them correct and faster.
        info["enabled"] = parse_enable() and config.env_flag(config.EP_VAR)
        info["slot_bytes"] = config.ep_slot_bytes()
    except ValueError as e:
        info["enabled"], info["slot_bytes"], info["error"] = False, 0, str(e)
    dp = getattr(manager, "dp_group", None)
    info["same_ranks"] = dp is not None and list(getattr(dp, "ranks", [])) == list(comm.ranks)
    info["dp_world_size"] = int(getattr(manager, "dp_world_size", 0))
    device = getattr(comm, "device", None)
    info["device"] = device.index if getattr(device, "type", None) == "cuda" else None
    info["visible"] = os.environ.get("CUDA_VISIBLE_DEVICES")  # collective.p2p_from_info compares them
    return info


def setup_ep(comm: Any, *, platform_is_cuda: bool, stateless: bool = False) -> str:
    """In the patched CudaCommunicator.__init__ of every group: when the group's all-to-all
    manager is vLLM's AgRsAll2AllManager and the gate agrees, build the EP YaliCommunicator and
    put YALI in front of the manager. Collective over ``comm.cpu_group`` once the rank-uniform
    checks pass. Returns the line it logged ("" for a group without a manager). Never raises."""
    manager = getattr(comm, "all2all_manager", None)
    if manager is None:
        return ""
    name = str(getattr(comm, "unique_name", "") or "<unnamed>")
    try:
        ok, reason, yc = _decide_and_build(comm, manager, platform_is_cuda, stateless)
    except Exception as e:  # noqa: BLE001 - the plugin never takes the server down
        ok, reason, yc = False, f"unexpected error ({type(e).__name__}: {e})", None
    if ok:
        manager.__class__ = manager_class(type(manager))
        manager.yali_comm = yc
        manager.yali_ranks = list(comm.ranks)
        manager.yali_group = name
        from .stats import buffer_size

        line = (f"YALI EP ON for group '{name}' (rank {comm.rank_in_group} of {comm.world_size}, buffers "
                f"{buffer_size(yc)} per GPU): dispatch and combine by YALI up to {yc.ep_slot_bytes} bytes per rank "
                f"(YALI_EP_SLOT_BYTES); other calls use vLLM's {type(manager).__mro__[1].__name__}")
        logger.info(line)
    else:
        line = f"YALI EP OFF for group '{name}': {reason}"
        (logger.warning if reason.startswith(("invalid", "unexpected", "rank ")) else logger.info)(line)
    return line


def _decide_and_build(comm: Any, manager: Any, platform_is_cuda: bool, stateless: bool) -> tuple[bool, str, Any]:
    cls = type(manager).__name__
    world = int(comm.world_size)
    # Rank-uniform checks first: they need no exchange.
    problem = agrs_hook_problem(type(manager)) if cls == AGRS_CLASS else None
    ok, reason = ep_gate(str(comm.unique_name), cls, world, world, True, [socket.gethostname()] * world,
                         platform_is_cuda, True, stateless=stateless, hook_problem=problem)
    if not ok:
        return False, reason, None
    infos = all_gather(_ep_info(comm, manager), comm.cpu_group)
    errors = [i["error"] for i in infos if i["error"]]
    if errors:
        return False, f"invalid YALI_* setting: {errors[0]}", None
    if len({i["slot_bytes"] for i in infos}) > 1:
        return False, f"invalid YALI_* setting: the ranks' YALI_EP_SLOT_BYTES differ: {[i['slot_bytes'] for i in infos]}", None
    ok, reason = ep_gate(str(comm.unique_name), cls, world, infos[0]["dp_world_size"],
                         all(i["same_ranks"] for i in infos), [i["host"] for i in infos], platform_is_cuda,
                         all(i["enabled"] for i in infos), stateless=stateless, p2p=p2p_from_info(infos),
                         hook_problem=problem)
    if not ok:
        return False, reason, None
    yc, why = None, ""
    try:
        from yali_vllm.communicator import YaliCommunicator

        yc = YaliCommunicator(group=comm.cpu_group, device=comm.device, ep_slot_bytes=infos[0]["slot_bytes"])
    except Exception as e:  # noqa: BLE001 - YaliUnavailable and every set-up failure alike
        why = f"{type(e).__name__}: {e}"
    results = all_gather((yc is not None, why), comm.cpu_group)
    failed = [(r, w) for r, (good, w) in enumerate(results) if not good]
    if failed:
        release_everywhere(yc, results, comm.cpu_group)
        return False, f"rank {failed[0][0]} of the group: {failed[0][1]}", None
    return True, "ok", yc
