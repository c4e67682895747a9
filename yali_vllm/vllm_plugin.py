"""vLLM plugin: serve the tensor-parallel all-reduces of a 2-GPU group with YALI.

vLLM loads ``register()`` through the ``vllm.general_plugins`` entry point in
every process it starts (API server, engine core, GPU workers), possibly more
than once.  ``register()`` patches vLLM's ``CudaCommunicator`` class in place
(the class vLLM's CUDA platform names for every group's device communicator):

* ``__init__``: after vLLM's own set-up, decide whether this group gets YALI
  (see :func:`yali_gate`) and, if so, build a
  :class:`yali_vllm.communicator.YaliCommunicator` as ``self.yali_comm``;
  otherwise ``self.yali_comm = None``.  One log line per group and rank says
  which, and why.
* ``all_reduce``: try YALI first when ``yali_comm.should_use(x)``; every other
  tensor goes down vLLM's original chain (custom all-reduce, symmetric
  memory, PyNCCL, ...) untouched.
* ``destroy``: close the YALI communicator, then vLLM's own clean-up.

``register()`` also registers YALI's fused all-reduce+RMSNorm op
(yali_vllm/vllm_fusion.py).  In a worker, once a CUDA TP group exists, the
``AllReduceFusionPass`` name in vLLM's pass manager module is replaced by a
factory (:func:`fusion_pass_factory`) that builds YALI's fusion pass instead
of vLLM's FlashInfer one when YALI serves the group and ``YALI_FUSION`` is on.

The patch is applied to the class rather than by subclassing because vLLM
resolves the class by its qualified name and checks ``isinstance`` against it
in ``GroupCoordinator.graph_capture``.

Nothing here may take the server down: unknown vLLM internals, a missing
extension, or a communicator that refuses (``YaliUnavailable``) only leave
YALI off and vLLM exactly as it was (an invalid ``YALI_FUSION`` is the one
start-up error, naming the variable).  See docs/VLLM_INTEGRATION.md.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any, NamedTuple

# A child of vLLM's "vllm" logger, so the lines carry vLLM's format and
# per-process prefix (e.g. "(Worker_TP0 pid=...)") in server logs.
logger = logging.getLogger("vllm.yali")

ENABLE_VAR = "YALI_ENABLE"


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "0.33.0" or "0.31.1.dev3+g..."; (0, 0) if unreadable."""
    try:
        major, minor = version.split(".")[:2]
        return int(major), int("".join(ch for ch in minor if ch.isdigit()) or "x")
    except ValueError:
        return (0, 0)


def in_supported_range(version: str) -> bool:
    """Whether `version` is a vLLM release series yali-vllm is tested against (0.26 through 0.33)."""
    from yali_vllm._version import OLDEST_VLLM_VERSION, TESTED_VLLM_VERSION

    return _release(OLDEST_VLLM_VERSION) <= _release(version) <= _release(TESTED_VLLM_VERSION)


_COMM_MODULE = "vllm.distributed.device_communicators.cuda_communicator"
_COMM_CLASS = "CudaCommunicator"
# Class attributes the patch leaves behind: the mark makes register()
# idempotent (also across re-imports of this module), the originals allow
# unpatch().
_MARK = "_yali_vllm_patched"
_ORIGINALS = "_yali_vllm_originals"
# Parameters of CudaCommunicator.__init__ (after self) the hook relies on.
_INIT_PARAMS = ("cpu_group", "device", "unique_name")


def _parse_enable(environ: Any = None) -> bool:
    """Value of YALI_ENABLE (default on); ValueError naming it when invalid, or naming an
    unknown YALI_* variable (a misspelt setting)."""
    from yali_vllm.config import check_environment, env_flag

    check_environment(environ)
    return env_flag(ENABLE_VAR, True, environ)


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
    on, so ``batch_invariant`` is checked on its own).  p2p: CUDA peer access between the two GPUs, None when it cannot
    be told here (YaliCommunicator checks it again).  stateless: vLLM's
    stateless (elastic) process groups, not supported.

    Returns (ok, reason); reason says why YALI stays off (or "ok").
    """
    if not is_tp_group(unique_name):
        return False, "not a tensor-parallel group"
    if not enabled:
        return False, f"disabled by {ENABLE_VAR}"
    if world_size != 2:
        return False, f"world size is {world_size}, YALI serves exactly 2 ranks"
    if not platform_is_cuda:
        return False, "vLLM platform is not CUDA"
    if stateless:
        return False, "stateless (elastic) process groups are not supported"
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
    if len(hostnames) != world_size or len(set(hostnames)) != 1:
        return False, f"ranks are not on one host: {list(hostnames)}"
    if p2p is False:
        return False, "no CUDA peer-to-peer access between the two GPUs"
    return True, "ok"


def check_hook_points(cls: type) -> str | None:
    """None if ``cls`` looks like the CudaCommunicator this hook was written
    for, else a description of what differs."""
    for name in ("__init__", "all_reduce", "destroy"):
        if not callable(cls.__dict__.get(name)):
            return f"{cls.__qualname__}.{name} is not defined by the class"
    try:
        init = inspect.signature(cls.__init__)
        ar = inspect.signature(cls.all_reduce)
        destroy = inspect.signature(cls.destroy)
    except (TypeError, ValueError) as e:
        return f"cannot read method signatures: {e}"
    missing = [p for p in _INIT_PARAMS if p not in init.parameters]
    if missing:
        return f"{cls.__qualname__}.__init__ lacks parameters {missing}"
    if len(ar.parameters) != 2:
        return f"{cls.__qualname__}.all_reduce{ar} is not (self, input_)"
    if len(destroy.parameters) != 1:
        return f"{cls.__qualname__}.destroy{destroy} is not (self)"
    return None


# --------------------------------------------------------------------------
# Per-group set-up, run inside the patched CudaCommunicator.__init__
# --------------------------------------------------------------------------


def _all_gather(obj: Any, group: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _local_info(comm: Any) -> dict[str, Any]:
    try:
        enabled, enable_error = _parse_enable(), None
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
    """This rank's YALI_FUSION as it is understood ("on", "off", or the error), for comparison."""
    try:
        from yali_vllm.vllm_fusion import fusion_enabled

        return "on" if fusion_enabled() else "off"
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
    return _all_gather(_local_info(comm), comm.cpu_group)


def _p2p_from_info(infos: list[dict[str, Any]]) -> bool | None:
    devices = [i["device"] for i in infos]
    if None in devices or len({i["visible"] for i in infos}) != 1:
        return None  # the ranks see different device sets: cannot tell here
    import torch

    if max(devices) >= torch.cuda.device_count():
        return None
    a, b = devices
    if a == b:
        return None  # one GPU for both ranks: YaliCommunicator refuses it unless YALI_ALLOW_SHARED_GPU=1
    return bool(torch.cuda.can_device_access_peer(a, b) and torch.cuda.can_device_access_peer(b, a))


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


def _close_quietly(yc: Any) -> None:
    try:
        yc.close()
    except Exception:
        logger.warning("YALI: closing the communicator failed", exc_info=True)


def _fusion_configured() -> bool | None:
    """Whether vLLM will build its all-reduce+RMSNorm fusion pass: the pass
    config asks for it and vLLM compiles (eager runs, mode NONE, and stock
    torch.compile never apply it).  None when no vLLM config is current."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
        if cfg is None:
            return None
        cc = cfg.compilation_config
        if not cc.pass_config.fuse_allreduce_rms:
            return False
        return getattr(getattr(cc, "mode", None), "name", "VLLM_COMPILE") == "VLLM_COMPILE"
    except Exception:
        return None


def _fusion_note() -> str | None:
    """A note when vLLM's FlashInfer all-reduce+RMSNorm fusion is configured,
    since the all-reduces it fuses never reach the device communicator.
    Logged only when YALI's own fusion pass is turned off (YALI_FUSION=0)."""
    if not _fusion_configured():
        return None
    return (
        "vLLM's all-reduce+RMSNorm fusion (compilation_config.pass_config."
        "fuse_allreduce_rms) is on and YALI_FUSION=0 keeps vLLM's FlashInfer fusion: "
        "the all-reduces it fuses run in FlashInfer's fused kernel, not YALI; YALI serves "
        "the remaining ones (YALI_FUSION=1 fuses them with YALI's kernel instead, "
        "-cc.pass_config.fuse_allreduce_rms=false routes all of them to YALI's all-reduce)"
    )


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
    if not ok:
        return Decision(None, reason)

    infos = gather_group_info(comm)
    ok, reason = yali_gate(
        name,
        world_size,
        [i["host"] for i in infos],
        platform_is_cuda,
        all(i["enabled"] for i in infos),
        custom_ar_enabled=all(i["custom_ar"] for i in infos),
        p2p=_p2p_from_info(infos),
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
        return Decision(None, f"the ranks' YALI_FUSION settings differ: {fusion}", True)

    yc, why = _create_communicator(comm)
    # Agree: YALI is used only if every rank has it, otherwise a rank would
    # wait in a YALI kernel for a peer that went to NCCL.
    results = _all_gather((yc is not None, why), comm.cpu_group)
    failed = [(r, w) for r, (good, w) in enumerate(results) if not good]
    if failed:
        if yc is not None:
            _close_quietly(yc)
        rank, why = failed[0]
        if rank != comm.rank_in_group:
            why = f"rank {rank} of the group: {why}"
        return Decision(None, why, True)
    return Decision(yc, "ok")


def _describe(yc: Any) -> str:
    try:
        return str(yc.describe())
    except Exception as e:
        return f"(describe() failed: {e})"


def _after_init(comm: Any, stateless: bool) -> None:
    from vllm.platforms import current_platform

    yc, reason, warn = setup_yali(
        comm, platform_is_cuda=current_platform.is_cuda(), stateless=stateless
    )
    comm.yali_comm = yc
    _log_decision(comm, yc, reason, warn)
    if current_platform.is_cuda() and is_tp_group(str(getattr(comm, "unique_name", ""))):
        # In the worker, before its model is compiled; which fusion pass is
        # built is decided when vLLM's pass manager asks for it.
        _install_fusion_hooks()


def _log_decision(comm: Any, yc: Any, reason: str, warn: bool) -> None:
    name = getattr(comm, "unique_name", "") or "<unnamed>"
    if yc is None:
        log = logger.warning if warn else logger.info
        log("YALI all-reduce OFF for group '%s': %s", name, reason)
        return
    logger.info(
        "YALI all-reduce ON for group '%s' (rank %s of %s, %s): %s; "
        "tried first, other tensors use vLLM's all-reduce chain",
        name,
        getattr(comm, "rank_in_group", "?"),
        getattr(comm, "world_size", "?"),
        getattr(comm, "device", "?"),
        _describe(yc),
    )
    note = _fusion_note()
    if note and not _yali_fusion_wanted():
        logger.info("YALI: %s", note)


def _yali_fusion_wanted() -> bool:
    try:
        from yali_vllm.vllm_fusion import fusion_enabled

        return fusion_enabled()
    except ValueError:
        return True  # invalid YALI_FUSION: the fusion pass factory raises, naming it
    except Exception:
        return False


# --------------------------------------------------------------------------
# Fusion: YALI's all-reduce+RMSNorm pass instead of vLLM's FlashInfer one
# --------------------------------------------------------------------------

_PM_MODULE = "vllm.compilation.passes.pass_manager"
_PM_SYMBOL = "AllReduceFusionPass"
# Attribute of the factory holding the class it stands in for (marks the patch).
_FACTORY_ORIGINAL = "_yali_original"
# Compile-cache factor (see _register_cache_factor).
CACHE_FACTOR = "YALI_FUSION_PASS"
_fusion_logged: set[str] = set()


def _log_fusion_once(level: int, msg: str, *args: Any) -> None:
    text = msg % args
    if text not in _fusion_logged:
        _fusion_logged.add(text)
        logger.log(level, "%s", text)


def fusion_pass_factory(original: Any) -> Any:
    """What PostGradPassManager.configure calls instead of vLLM's
    AllReduceFusionPass(config): YALI's pass when YALI serves the TP group
    and YALI_FUSION is on, else vLLM's pass (``original``).  Exactly one of
    the two is built, so vLLM's pass never runs alongside ours.  A bad
    YALI_FUSION raises ValueError naming it."""

    def AllReduceFusionPass(config: Any) -> Any:
        from yali_vllm import vllm_fusion

        use, why = vllm_fusion.fusion_decision()
        if use:
            try:
                pass_ = vllm_fusion.YaliAllReduceFusionPass(config)
            except Exception as e:  # deterministic, so every rank falls back alike
                logger.warning(
                    "YALI fusion pass OFF: building it failed (%s: %s); using vLLM's FlashInfer fusion",
                    type(e).__name__, e, exc_info=True,
                )
                return original(config)
            _log_fusion_once(
                logging.INFO,
                "YALI fusion pass ON (replaces vLLM's FlashInfer all-reduce+RMSNorm fusion): %s", why,
            )
            return pass_
        _log_fusion_once(
            logging.INFO, "YALI fusion pass OFF: %s; using vLLM's FlashInfer all-reduce+RMSNorm fusion", why
        )
        return original(config)

    setattr(AllReduceFusionPass, _FACTORY_ORIGINAL, original)
    return AllReduceFusionPass


def patch_fusion_pass() -> bool:
    """Replace ``AllReduceFusionPass`` in vLLM's pass_manager module (the name
    ``PostGradPassManager.configure`` instantiates) by fusion_pass_factory,
    once.  False, with a log line, when the module or the name is missing."""
    import importlib

    try:
        module = importlib.import_module(_PM_MODULE)
    except Exception as e:
        logger.warning(
            "YALI: vLLM's %s cannot be loaded (%s: %s); YALI fusion pass not installed",
            _PM_MODULE, type(e).__name__, e,
        )
        return False
    current = module.__dict__.get(_PM_SYMBOL)
    if current is None:
        logger.warning(
            "YALI: vLLM internals not recognised (%s.%s is missing); YALI fusion pass not "
            "installed, vLLM's compilation passes are left unchanged", _PM_MODULE, _PM_SYMBOL,
        )
        return False
    if getattr(current, _FACTORY_ORIGINAL, None) is None:
        setattr(module, _PM_SYMBOL, fusion_pass_factory(current))
    return True


def unpatch_fusion_pass() -> None:
    """Undo patch_fusion_pass (tests and debugging)."""
    import sys

    module = sys.modules.get(_PM_MODULE)
    current = module.__dict__.get(_PM_SYMBOL) if module is not None else None
    original = getattr(current, _FACTORY_ORIGINAL, None)
    if original is not None:
        setattr(module, _PM_SYMBOL, original)


def fusion_cache_factor() -> str:
    """Which fusion pass this process builds: "yali" or "vllm" (or "invalid")."""
    try:
        from yali_vllm.vllm_fusion import fusion_decision

        return "yali" if fusion_decision()[0] else "vllm"
    except Exception as e:
        return f"invalid ({type(e).__name__})"


def _register_cache_factor() -> None:
    """Make vLLM's compile cache key depend on the fusion pass chosen.

    vLLM keys its torch.compile caches (VllmBackend's cache directory and the
    AOT-compiled artifact) on its config and on ``vllm.envs.compile_factors()``,
    which hashes every entry of ``vllm.envs.environment_variables``; the
    plugin's choice is in neither.  Without this entry a run with YALI's pass
    would load a graph compiled with FlashInfer's fusion by an earlier run
    without YALI (or the reverse).  The entry's getter is evaluated when vLLM
    computes the key, in the worker, after the TP group is set up."""
    import vllm.envs as envs

    envs.environment_variables.setdefault(CACHE_FACTOR, fusion_cache_factor)


def _install_fusion_hooks() -> None:
    """Worker side, once a CUDA TP group exists: the pass factory and the cache
    factor.  Skipped when vLLM will not build its fusion pass (eager, or
    fuse_allreduce_rms off), which also spares the import of vLLM's
    compilation passes (FlashInfer's comm module among them) in eager runs."""
    if _fusion_configured() is False:
        return
    try:
        if patch_fusion_pass():
            _register_cache_factor()
    except Exception:
        logger.warning("YALI: installing the fusion pass failed; vLLM's passes unchanged", exc_info=True)


# --------------------------------------------------------------------------
# Patching
# --------------------------------------------------------------------------


def _wrap_init(orig_init: Any) -> Any:
    sig = inspect.signature(orig_init)

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        self.yali_comm = None
        try:
            bound = sig.bind(self, *args, **kwargs)
            stateless = bound.arguments.get("tcp_store_group") is not None
            _after_init(self, stateless)
        except Exception as e:
            self.yali_comm = None
            logger.warning(
                "YALI all-reduce OFF for group '%s': unexpected error (%s: %s)",
                getattr(self, "unique_name", "") or "<unnamed>",
                type(e).__name__,
                e,
                exc_info=True,
            )

    return __init__


def _log_first_dispatch(comm: Any, input_: Any, yali: bool) -> None:
    """One INFO line the first time each (dtype, power-of-two size class, backend)
    is dispatched by this communicator: which backend serves which sizes, without
    a line per call. (Replays of captured CUDA graphs run no Python at all.) A repeat
    costs a set lookup: the kernel's name is asked of the library only for a new line."""
    nbytes = input_.numel() * input_.element_size()
    key = (str(input_.dtype), max(nbytes, 1).bit_length(), yali)
    seen = comm.__dict__.setdefault("_yali_dispatch_seen", set())
    if key in seen:
        return
    seen.add(key)
    lo = 1 << (key[1] - 1)
    backend = _yali_kernel(nbytes) if yali else "vLLM's all-reduce chain"
    logger.info("YALI dispatch on '%s': %s all-reduces of %d..%d bytes -> %s",
                getattr(comm, "unique_name", "?"), key[0], lo, 2 * lo - 1, backend)


def _yali_kernel(nbytes: int) -> str:
    try:
        from yali_vllm.config import plan

        return f"yali {plan(nbytes)[0]}"
    except Exception:
        return "yali"


def _wrap_all_reduce(orig_all_reduce: Any) -> Any:
    @functools.wraps(orig_all_reduce)
    def all_reduce(self: Any, input_: Any) -> Any:
        yc = getattr(self, "yali_comm", None)
        if yc is None:
            return orig_all_reduce(self, input_)
        # YALI first for every size it serves: it measured faster than vLLM's custom
        # all-reduce and NCCL at every size and dtype (benchmarks/results/allreduce-20261122-r2.md).
        if yc.should_use(input_):
            if logger.isEnabledFor(logging.INFO):
                _log_first_dispatch(self, input_, True)
            return yc.all_reduce(input_)
        if logger.isEnabledFor(logging.INFO):
            _log_first_dispatch(self, input_, False)
        return orig_all_reduce(self, input_)

    return all_reduce


def _wrap_destroy(orig_destroy: Any) -> Any:
    @functools.wraps(orig_destroy)
    def destroy(self: Any) -> Any:
        yc = getattr(self, "yali_comm", None)
        self.yali_comm = None
        if yc is not None:
            _close_quietly(yc)
        return orig_destroy(self)

    return destroy


def _wrap_suspend(orig_suspend: Any) -> Any:
    """vLLM 0.30+ (sleep with enable_nccl_comm_suspend): YALI keeps serving. Its buffers are its own
    cudaMalloc memory, outside torch's caching allocator and vLLM's cuMem pools, so sleep mode never
    offloads them and the peer mapping stays valid, as vLLM's custom all-reduce's buffers do."""

    @functools.wraps(orig_suspend)
    def suspend(self: Any) -> Any:
        yc = getattr(self, "yali_comm", None)
        if yc is not None and not getattr(self, "_yali_suspend_logged", False):
            self._yali_suspend_logged = True
            logger.info("YALI: group '%s' suspended: YALI's buffers (%s) stay resident and mapped; "
                        "YALI serves again after resume", getattr(self, "unique_name", "?"),
                        _buffer_size(yc))
        return orig_suspend(self)

    return suspend


def _buffer_size(yc: Any) -> str:
    try:
        return f"{int(yc.buffer_bytes) / 2**20:.0f} MiB"
    except Exception:
        return "size unknown"


def checkpoint_release(comm: Any) -> str:
    """Before a process checkpoint (vLLM 0.27+ ``checkpoint_prepare``): release YALI's CUDA IPC
    mappings and buffers, and leave the group to vLLM's chain from then on, unless a CUDA graph
    captured YALI's kernels (then they hold the buffers' addresses, and the buffers stay, as
    vLLM's custom all-reduce's do). Collective over the group's CPU group; both ranks decide
    alike. Returns what was done, for the log line."""
    yc = getattr(comm, "yali_comm", None)
    if yc is None:
        return "YALI is off for this group"
    yc.synchronize()  # no YALI kernel of this rank in flight
    # All ranks have synchronised once this returns: no peer kernel still writes into my buffer.
    captured = any(_all_gather(bool(yc.captured), comm.cpu_group))
    if captured:
        return ("CUDA graphs captured YALI's kernels, so its buffers and peer mapping stay "
                "(a checkpoint tool that cannot save CUDA IPC mappings refuses this process)")
    comm.yali_comm = None
    _close_quietly(yc)
    return "YALI's buffers and peer mapping are released; vLLM's all-reduce chain serves this group from now on"


def _wrap_checkpoint_prepare(orig: Any) -> Any:
    @functools.wraps(orig)
    def checkpoint_prepare(self: Any) -> Any:
        if getattr(self, "yali_comm", None) is not None:
            try:
                what = checkpoint_release(self)
                logger.info("YALI: checkpoint_prepare on group '%s': %s", getattr(self, "unique_name", "?"), what)
            except Exception:
                logger.warning("YALI: checkpoint_prepare hook failed", exc_info=True)
        return orig(self)

    return checkpoint_prepare


# Methods patched when the class defines them (vLLM 0.27+ / 0.30+), with their wrappers.
_OPTIONAL_HOOKS = {"suspend": _wrap_suspend, "checkpoint_prepare": _wrap_checkpoint_prepare}


def is_patched(cls: type) -> bool:
    return bool(cls.__dict__.get(_MARK))


def patch_class(cls: type) -> bool:
    """Patch ``cls`` (vLLM's CudaCommunicator) in place, once.

    Returns True when the class carries the hook afterwards, False when its
    shape is not recognised (then it is left untouched).
    """
    if is_patched(cls):
        return True
    problem = check_hook_points(cls)
    if problem is not None:
        logger.warning(
            "YALI: vLLM internals not recognised (%s); YALI stays off and vLLM is left unchanged",
            problem,
        )
        return False
    originals = {n: cls.__dict__[n] for n in ("__init__", "all_reduce", "destroy")}
    cls.__init__ = _wrap_init(originals["__init__"])
    cls.all_reduce = _wrap_all_reduce(originals["all_reduce"])
    cls.destroy = _wrap_destroy(originals["destroy"])
    for name, wrap in _OPTIONAL_HOOKS.items():
        if callable(cls.__dict__.get(name)):
            originals[name] = cls.__dict__[name]
            setattr(cls, name, wrap(originals[name]))
    setattr(cls, _ORIGINALS, originals)
    setattr(cls, _MARK, True)
    return True


def unpatch_class(cls: type) -> None:
    """Undo patch_class (tests and debugging)."""
    originals = cls.__dict__.get(_ORIGINALS)
    if not originals:
        return
    for name, fn in originals.items():
        setattr(cls, name, fn)
    delattr(cls, _ORIGINALS)
    delattr(cls, _MARK)


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:
        return "unknown"


def _register_fusion_op() -> None:
    """torch.ops.vllm.yali_fused_allreduce_rmsnorm, in every vLLM process (the
    op YALI's fusion pass puts into compiled graphs).  Never raises."""
    try:
        from yali_vllm.vllm_fusion import register_op

        register_op()
    except Exception as e:
        logger.warning(
            "YALI: the fused all-reduce+RMSNorm op cannot be registered (%s: %s); "
            "YALI's fusion pass stays off",
            type(e).__name__,
            e,
        )


def register() -> None:
    """``vllm.general_plugins`` entry point.  Idempotent; never raises."""
    try:
        from yali_vllm import vllm_log

        vllm_log.hold_until_configured()  # the lines below reach vLLM's log on 0.31+ too
    except Exception:
        pass
    try:
        import importlib

        module = importlib.import_module(_COMM_MODULE)
        cls = getattr(module, _COMM_CLASS)
    except Exception as e:
        logger.warning(
            "YALI: vLLM's %s.%s cannot be loaded (%s: %s); YALI stays off",
            _COMM_MODULE,
            _COMM_CLASS,
            type(e).__name__,
            e,
        )
        return
    try:
        already = is_patched(cls)
        if not patch_class(cls) or already:
            return
        _register_fusion_op()
        version = _vllm_version()
        if not in_supported_range(version):
            from yali_vllm._version import OLDEST_VLLM_VERSION, TESTED_VLLM_VERSION

            logger.warning(
                "YALI: vLLM %s is outside the tested range %s to %s; its hook points "
                "match, so YALI is enabled (YALI_ENABLE=0 turns it off)",
                version, OLDEST_VLLM_VERSION, TESTED_VLLM_VERSION,
            )
        logger.info("YALI: plugin loaded for vLLM %s (hook points of %s.%s found)", version, _COMM_MODULE,
                    _COMM_CLASS)
    except Exception:
        logger.warning("YALI: plugin registration failed; YALI stays off", exc_info=True)


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
        "describe": _describe(yc) if yc is not None else None,
    }
