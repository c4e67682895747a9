"""The gate: whether YALI serves a vLLM device communicator's group, and why not.

Pure functions of values that are equal on every rank of the group (group_setup.py gathers
the per-rank ones), so all ranks reach the same answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ENABLE_VAR = "YALI_ENABLE"


def parse_enable(environ: Any = None) -> bool:
    """Value of YALI_ENABLE (default on); ValueError naming it when invalid, or naming an
    unknown YALI_* variable (a misspelt setting)."""
    from yali_vllm.config import check_environment, env_flag

    check_environment(environ)
    return env_flag(ENABLE_VAR, environ=environ)


def _platform_refusal(platform_is_cuda: bool) -> str:
    """Why a group on a platform that is not CUDA, or a stateless group, stays off."""
    return "vLLM platform is not CUDA" if not platform_is_cuda else "stateless (elastic) process groups are not supported"


def _node_refusal(world_size: int, hostnames: Sequence[str], p2p: bool | None) -> tuple[bool, str]:
    """The gates' last checks: every rank on one host, CUDA peer access between every pair."""
    if len(hostnames) != world_size or len(set(hostnames)) != 1:
        return False, f"ranks are not on one host: {list(hostnames)}"
    if p2p is False:
        return False, f"no CUDA peer-to-peer access between every pair of the group's {world_size} GPUs"
    return True, "ok"


def is_tp_group(unique_name: str) -> bool:
    """Whether a group's unique name ("tp:0") names vLLM's tensor-parallel group: the exact
    prefix "tp", as vLLM's CudaCommunicator matches it (0.30+) before enabling its TP-only
    backends. Other groups are left alone, including "etp" (expert/Engram tensor parallelism,
    0.30+), whose all-reduces are not the dense layers' TP all-reduces the plugin serves."""
    return unique_name.split(":")[0] == "tp"


def yali_gate(
    unique_name: str,
    world_size: int,
    hostnames: Sequence[str],
    platform_is_cuda: bool,
    enabled: bool,
    *,
    custom_ar_enabled: bool = True,
    p2p: bool | None = None,
    stateless: bool = False,
    batch_invariant: bool = False,
) -> tuple[bool, str]:
    """Decide whether a vLLM device communicator gets YALI.

    Pure function of values that are equal on every rank of the group (the
    caller gathers the per-rank ones), so all ranks reach the same answer and
    either all of them or none enter YaliCommunicator's collective set-up.

    hostnames: one per rank.  custom_ar_enabled: vLLM's own custom
    all-reduce switch for the group; YALI is a custom all-reduce and follows
    it (off under --disable-custom-all-reduce, multi-node, batch-invariant
    mode; from vLLM 0.32 batch-invariant mode keeps vLLM's custom all-reduce
    on, so ``batch_invariant`` is checked on its own).  p2p: CUDA peer
    access between every pair of the group's GPUs (both directions), None
    when it cannot be told here (YaliCommunicator checks it again).
    stateless: vLLM's stateless (elastic) process groups, not supported.
    world_size: the group's ranks; the plugin serves the sizes of
    ``yali_vllm.config.plugin_world_sizes()`` (YALI_WORLD_SIZES, default 2).

    Returns (ok, reason); reason says why YALI stays off (or "ok").
    """
    if not is_tp_group(unique_name):
        return False, "not a tensor-parallel group"
    if not enabled:
        return False, f"disabled by {ENABLE_VAR}"
    # Imported here, as in parse_enable: importing this module needs no torch.
    from yali_vllm.config import plugin_world_size_refusal

    try:
        refusal = plugin_world_size_refusal(world_size)
    except ValueError as e:  # a bad YALI_WORLD_SIZES: every rank inherits the same one
        return False, f"invalid YALI_* setting: {e}"
    if refusal is not None:
        return False, refusal
    if not platform_is_cuda or stateless:
        return False, _platform_refusal(platform_is_cuda)
    if batch_invariant:
        return False, (
            "vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1): YALI's fused op changes its "
            "launch shape with the token count, so it is left to vLLM's batch-invariant path"
        )
    if not custom_ar_enabled:
        return False, (
            "vLLM's custom all-reduce is disabled for this group "
            "(--disable-custom-all-reduce, multi-node or batch-invariant mode)"
        )
    return _node_refusal(world_size, hostnames, p2p)


def is_ep_group(unique_name: str) -> bool:
    """Whether a group's unique name ("ep:0") names vLLM's expert-parallel group, the only group
    whose communicator builds an all-to-all manager."""
    return unique_name.split(":")[0] == "ep"


def ep_gate(
    unique_name: str,
    manager_class: str,
    world_size: int,
    dp_world_size: int,
    same_ranks: bool,
    hostnames: Sequence[str],
    platform_is_cuda: bool,
    enabled: bool,
    *,
    stateless: bool = False,
    p2p: bool | None = None,
    hook_problem: str | None = None,
) -> tuple[bool, str]:
    """Decide whether YALI serves the dispatch and combine of vLLM's expert-parallel group.

    Pure function of values equal on every rank (the caller gathers the per-rank ones).
    manager_class: the class name of the group's all-to-all manager; YALI takes over only vLLM's
    default ``AgRsAll2AllManager`` (all2all backend ``allgather_reducescatter``). dp_world_size,
    same_ranks: the manager gathers over the DP group; YALI serves it when that group is the EP
    group itself (the same ranks in the same order: no TP or PCP inside the EP group).
    enabled: YALI_ENABLE and YALI_EP (default off: no GPU run has measured it yet) on every rank. hook_problem: what differs in the manager's
    methods from those YALI overrides (ep_manager.agrs_hook_problem), None when they match.

    Returns (ok, reason); reason says why YALI stays off (or "ok").
    """
    if not is_ep_group(unique_name):
        return False, "not an expert-parallel group"
    if manager_class != "AgRsAll2AllManager":
        return False, (f"vLLM's all-to-all manager is {manager_class}; YALI serves the default "
                       f"allgather_reducescatter backend (AgRsAll2AllManager)")
    if hook_problem is not None:
        return False, f"vLLM internals not recognised: {hook_problem}"
    if not enabled:
        return False, "off: YALI_EP=1 turns it on (off by default until GPU runs have measured it; YALI_ENABLE=0 keeps it off)"
    from yali_vllm.config import world_size_refusal

    refusal = world_size_refusal(world_size)
    if refusal is not None:
        return False, refusal
    if not platform_is_cuda or stateless:
        return False, _platform_refusal(platform_is_cuda)
    if dp_world_size != world_size or not same_ranks:
        return False, (f"the MoE layers gather over the data-parallel group ({dp_world_size} ranks), which is not "
                       f"this {world_size}-rank expert-parallel group (tensor or context parallelism inside it)")
    return _node_refusal(world_size, hostnames, p2p)
