"""What the set-up of the TP group (group_setup.py) and of the EP group (ep_manager.py) both do
over a vLLM device communicator's group: gather a Python object from every rank over the group's
CPU (gloo) group, tell CUDA peer access between the gathered ranks' GPUs, close a
YaliCommunicator without raising, and release a build that failed on some ranks on all of them."""

from __future__ import annotations

import itertools
import logging
from typing import Any

from yali_vllm.vllm_log import LOGGER

logger = logging.getLogger(LOGGER)


def all_gather(obj: Any, group: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (collective over `group`, a CPU process group)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def p2p_from_info(infos: list[dict[str, Any]]) -> bool | None:
    """CUDA peer access between every pair of the ranks' GPUs, in both directions, from the
    gathered "device" (CUDA index or None) and "visible" (CUDA_VISIBLE_DEVICES) of each rank;
    None when it cannot be told here (YaliCommunicator checks it again)."""
    devices = [i["device"] for i in infos]
    if None in devices or len({i["visible"] for i in infos}) != 1:
        return None  # the ranks see different device sets: cannot tell here
    import torch

    if max(devices) >= torch.cuda.device_count():
        return None
    if len(set(devices)) != len(devices):
        return None  # ranks share a GPU: YaliCommunicator refuses it unless YALI_ALLOW_SHARED_GPU=1
    return all(torch.cuda.can_device_access_peer(a, b) for a, b in itertools.permutations(devices, 2))


def close_quietly(yc: Any) -> None:
    """Close a YaliCommunicator; a failure is logged, never raised."""
    try:
        yc.close()
    except Exception:
        logger.warning("YALI: closing the communicator failed", exc_info=True)


def release_everywhere(yc: Any, results: list[tuple[bool, str]], group: Any) -> None:
    """After a build that failed on some ranks (``results``: every rank's (built, why)): the ranks
    that built a YaliCommunicator close it, and the others take part in that close, so that no rank
    waits in it and the group's next collective is every rank's."""
    if yc is not None:
        close_quietly(yc)
    elif any(good for good, _ in results):
        from yali_vllm.communicator import join_close

        join_close(group, len(results))
