"""Set-up of YALI for one vLLM device communicator: gather the group's gating inputs, ask
the gate (gate.py), build the YaliCommunicator on every rank or on none, and log the
decision; and its release before a process checkpoint.

Nothing here raises into vLLM: a communicator that cannot be built leaves YALI off.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, NamedTuple

from yali_vllm.vllm_log import LOGGER

from .collective import all_gather, close_quietly, p2p_from_info, release_everywhere
from .ep_manager import setup_ep
from .fusion_patch import fusion_note, install_fusion_hooks, yali_fusion_wanted
from .gate import is_tp_group, parse_enable, yali_gate
from .stats import describe

logger = logging.getLogger(LOGGER)


def _local_info(comm: Any) -> dict[str, Any]:
    try:
        enabled, enable_error = parse_enable(), None
    except ValueError as e:
        enabled, enable_error = False, str(e)
    device = getattr(comm, "device", None)
    is_cuda = device is not None and getattr(device, "type", None) == "cuda"
    return {
        "host": socket.gethostname(),
        "enabled": enabled,
        "enable_error": enable_error,
        "custom_ar": bool(getattr(comm, "use_custom_allreduce", False)),
        "batch_invariant": _batch_invariant(),
        "fusion": _fusion_setting(),
        "device": device.index if is_cuda else None,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _fusion_setting() -> str:
    """This rank's YALI_FUSION and YALI_FUSE_QUANT as they are understood ("on"/"off" and
    "quant on"/"quant off", or the error), for comparison: the ranks must build the same compile
    passes."""
    try:
        from yali_vllm.config import fuse_quant_enabled
        from yali_vllm.vllm_fusion import fusion_enabled

        return ("on" if fusion_enabled() else "off") + (", quant on" if fuse_quant_enabled() else "")
    except Exception as e:
        return f"invalid ({e})"


def _batch_invariant() -> bool:
    try:
        import vllm.envs as envs

        return bool(getattr(envs, "VLLM_BATCH_INVARIANT", False))
    except Exception:
        return False


def gather_group_info(comm: Any) -> list[dict[str, Any]]:
    """Each rank's gating inputs, identical on every rank (collective over the
    group's CPU/gloo group)."""
    return all_gather(_local_info(comm), comm.cpu_group)


def _create_communicator(comm: Any) -> tuple[Any, str]:
    """(YaliCommunicator, "") or (None, why not).  Never raises."""
    try:
        from yali_vllm.communicator import YaliCommunicator, YaliUnavailable
    except Exception as e:  # missing extension, broken install, ...
        return None, f"YALI communicator cannot be imported ({type(e).__name__}: {e})"
    try:
        return YaliCommunicator(group=comm.cpu_group, device=comm.device), ""
    except YaliUnavailable as e:
        return None, f"YALI unavailable: {e}"
    except Exception as e:
        logger.debug("YaliCommunicator set-up failed", exc_info=True)
        return None, f"YALI set-up failed ({type(e).__name__}: {e})"


class Decision(NamedTuple):
    """Outcome of setup_yali: the communicator (None when off), why, and
    whether the reason deserves a warning (YALI could have run here but
    something is broken or misconfigured) rather than an info line."""

    comm: Any
    reason: str
    warn: bool = False


# Instance attributes of vLLM's CudaCommunicator the set-up reads.
_COMM_ATTRS = ("unique_name", "world_size", "rank_in_group", "cpu_group", "device")


def setup_yali(comm: Any, *, platform_is_cuda: bool, stateless: bool = False) -> Decision:
    """Decide and, if on, build YALI for one CudaCommunicator.

    Collective over ``comm.cpu_group`` whenever the rank-uniform checks pass,
    so every rank of the group must call it (vLLM constructs the
    communicator on all of them).
    """
    missing = [a for a in _COMM_ATTRS if not hasattr(comm, a)]
    if missing:
        return Decision(None, f"vLLM internals not recognised: no attribute(s) {missing}", True)
    name, world_size = str(comm.unique_name), int(comm.world_size)
    # Rank-uniform checks first: a group that fails them never talks to its
    # peers, so non-TP groups cost nothing.
    ok, reason = yali_gate(
        name,
        world_size,
        [socket.gethostname()] * world_size,
        platform_is_cuda,
        True,
        stateless=stateless,
    )
    if not ok:  # a bad setting deserves a warning; every other rank-uniform refusal is plain
        return Decision(None, reason, reason.startswith("invalid YALI_* setting"))

    infos = gather_group_info(comm)
    ok, reason = yali_gate(
        name,
        world_size,
        [i["host"] for i in infos],
        platform_is_cuda,
        all(i["enabled"] for i in infos),
        custom_ar_enabled=all(i["custom_ar"] for i in infos),
        p2p=p2p_from_info(infos),
        batch_invariant=any(i.get("batch_invariant") for i in infos),
    )
    if not ok:
        errors = [i["enable_error"] for i in infos if i["enable_error"]]
        if errors:
            return Decision(None, f"invalid YALI_* setting: {errors[0]}", True)
        return Decision(None, reason, reason.startswith("no CUDA peer"))
    # Settings every rank must share beyond the kernels' own (YaliCommunicator compares those):
    # the fusion pass each rank builds, so that no rank runs YALI's fused kernel against a peer
    # in FlashInfer's.
    fusion = [i["fusion"] for i in infos]
    if len(set(fusion)) > 1:
        return Decision(None, f"the ranks' YALI_FUSION / YALI_FUSE_QUANT settings differ: {fusion}", True)

    yc, why = _create_communicator(comm)
    # Agree: YALI is used only if every rank has it, otherwise a rank would
    # wait in a YALI kernel for a peer that went to NCCL.
    results = all_gather((yc is not None, why), comm.cpu_group)
    failed = [(r, w) for r, (good, w) in enumerate(results) if not good]
    if failed:
        release_everywhere(yc, results, comm.cpu_group)
        return Decision(None, _agreed_failure(failed, len(results)), True)
    return Decision(yc, "ok")


def _agreed_failure(failed: list[tuple[int, str]], world_size: int) -> str:
    """The one reason every rank gives when the communicator failed on the ranks ``failed``
    ((rank, why) pairs, gathered from all of them): the shared reason when every rank failed
    alike, else the first failing rank's, naming it."""
    if len(failed) == world_size and len({why for _, why in failed}) == 1:
        return failed[0][1]
    rank, why = failed[0]
    return f"rank {rank} of the group: {why}"


def after_init(comm: Any, stateless: bool) -> None:
    """Inside the patched CudaCommunicator.__init__: decide, build and log YALI for ``comm``
    (``comm.yali_comm``); in a CUDA TP group, install the fusion pass hooks."""
    from vllm.platforms import current_platform

    yc, reason, warn = setup_yali(
        comm, platform_is_cuda=current_platform.is_cuda(), stateless=stateless
    )
    comm.yali_comm = yc
    if yc is None:
        log_off(comm, reason, warn)
    else:
        _log_on(comm, yc)
    if current_platform.is_cuda() and is_tp_group(str(getattr(comm, "unique_name", ""))):
        # In the worker, before its model is compiled; which fusion pass is
        # built is decided when vLLM's pass manager asks for it.
        install_fusion_hooks()
    # The expert-parallel group's all-to-all manager (DP + EP MoE serving): ep_manager.py.
    setup_ep(comm, platform_is_cuda=current_platform.is_cuda(), stateless=stateless)


def _group_name(comm: Any) -> str:
    return getattr(comm, "unique_name", "") or "<unnamed>"


def log_off(comm: Any, reason: str, warn: bool, exc_info: bool = False) -> None:
    """The line that says vLLM's chain serves ``comm``'s group, why, and the group's world size;
    a warning when ``warn`` (YALI could run here but something is broken or misconfigured)."""
    log = logger.warning if warn else logger.info
    log("YALI all-reduce OFF for group '%s': %s (world size %s)", _group_name(comm), reason,
        getattr(comm, "world_size", "?"), exc_info=exc_info)


def _log_on(comm: Any, yc: Any) -> None:
    logger.info(
        "YALI all-reduce ON for group '%s' (rank %s of %s, %s): %s; "
        "tried first, other tensors use vLLM's all-reduce chain",
        _group_name(comm),
        getattr(comm, "rank_in_group", "?"),
        getattr(comm, "world_size", "?"),
        getattr(comm, "device", "?"),
        describe(yc),
    )
    note = fusion_note()
    if note and not yali_fusion_wanted():
        logger.info("YALI: %s", note)


def checkpoint_release(comm: Any) -> str:
    """Before a process checkpoint (vLLM 0.27+ ``checkpoint_prepare``): release YALI's CUDA IPC
    mappings and buffers, and leave the group to vLLM's chain from then on, unless a CUDA graph
    captured YALI's kernels (then they hold the buffers' addresses, and the buffers stay, as
    vLLM's custom all-reduce's do). Collective over the group's CPU group; every rank decides
    alike. Returns what was done, for the log line."""
    yc = getattr(comm, "yali_comm", None)
    if yc is None:
        return "YALI is off for this group"
    yc.synchronize()  # no YALI kernel of this rank in flight
    # All ranks have synchronised once this returns: no peer kernel still writes into my buffer.
    captured = any(all_gather(bool(yc.captured), comm.cpu_group))
    if captured:
        return ("CUDA graphs captured YALI's kernels, so its buffers and peer mapping stay "
                "(a checkpoint tool that cannot save CUDA IPC mappings refuses this process)")
    comm.yali_comm = None
    close_quietly(yc)
    return "YALI's buffers and peer mapping are released; vLLM's all-reduce chain serves this group from now on"
