"""What the plugin reports: the dispatch log line, the communicator's description, and
``yali_tp_stats`` for ``LLM.collective_rpc``."""

from __future__ import annotations

import logging
from typing import Any

from yali_vllm.vllm_log import LOGGER

logger = logging.getLogger(LOGGER)


def log_dispatch(comm: Any, key: tuple[Any, int, bool], nbytes: int) -> None:
    """The INFO line for a new dispatch class ``key`` = (dtype, power-of-two size class,
    served by YALI) of ``comm``, first seen with an ``nbytes`` tensor (hook.py keeps the
    set of classes seen). The kernel's name is asked of the library only here, for the
    group's world size."""
    dtype, size_class, yali = key
    lo = 1 << (size_class - 1)
    backend = _yali_kernel(nbytes, comm.world_size) if yali else "vLLM's all-reduce chain"
    logger.info("YALI dispatch on '%s': %s all-reduces of %d..%d bytes -> %s",
                getattr(comm, "unique_name", "?"), dtype, lo, 2 * lo - 1, backend)


def _yali_kernel(nbytes: int, world_size: int) -> str:
    """The dispatch line's backend: "yali <kernel>", the kernel that serves an ``nbytes``
    all-reduce of ``world_size`` ranks, or "yali" when the library cannot tell."""
    try:
        from yali_vllm.config import plan

        return f"yali {plan(nbytes, world_size=world_size)[0]}"
    except Exception:
        return "yali"


def describe(yc: Any) -> str:
    """The YaliCommunicator's own description, or why it cannot give one."""
    try:
        return str(yc.describe())
    except Exception as e:
        return f"(describe() failed: {e})"


def buffer_size(yc: Any) -> str:
    """The YaliCommunicator's buffers per GPU, in MiB."""
    try:
        return f"{int(yc.buffer_bytes) / 2**20:.0f} MiB"
    except Exception:
        return "size unknown"


def _fused_calls(yc: Any) -> int | None:
    # None also when the built extension predates the fused kernel's counter.
    try:
        return int(yc.device_fused_calls()) if yc is not None else None
    except (AttributeError, RuntimeError):
        return None


def yali_tp_stats(_worker: Any = None) -> dict[str, Any]:
    """State of YALI on this worker's TP group, for ``LLM.collective_rpc``.

    ``device_calls`` is YALI's device-side launch counter and
    ``device_fused_calls`` that of its fused all-reduce+RMSNorm kernel (both
    synchronise the device); None when the TP group has no YALI communicator.
    """
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    comm = getattr(group, "device_communicator", None)
    yc = getattr(comm, "yali_comm", None)
    return {
        "rank": getattr(group, "rank_in_group", None),
        "group": getattr(group, "unique_name", None),
        "yali": yc is not None,
        "device_calls": int(yc.device_calls()) if yc is not None else None,
        "device_fused_calls": _fused_calls(yc),
        "describe": describe(yc) if yc is not None else None,
    }
