"""vLLM plugin: serve the tensor-parallel all-reduces of a 2-, 4-, 6- or 8-GPU group with YALI.

vLLM loads :func:`register` through the ``vllm.general_plugins`` entry point in
every process it starts (API server, engine core, GPU workers), possibly more
than once.  ``register()`` patches vLLM's ``CudaCommunicator`` class in place
(the class vLLM's CUDA platform names for every group's device communicator)
and registers YALI's fused all-reduce+RMSNorm op (yali_vllm/vllm_fusion.py).

* hook.py: what the patched methods do.  ``all_reduce`` tries YALI first when
  ``yali_comm.should_use(x)``; ``__init__`` builds the group's YaliCommunicator
  as ``self.yali_comm`` (or None); ``destroy`` closes it.
* gate.py: whether YALI serves a group, and why not.
* group_setup.py: building YaliCommunicator for vLLM's TP group, and the one log
  line per group and rank that says whether YALI serves it, and why.
* fusion_patch.py: YALI's fusion pass in place of vLLM's FlashInfer one.
* ep_manager.py: YALI's dispatch and combine in front of vLLM's all-to-all manager of the
  expert-parallel group (``--data-parallel-size N --enable-expert-parallel``).
* patch.py: applying the hook to the class, once.
* stats.py: the dispatch log line and :func:`yali_tp_stats`.
* touch_points.py: every place where YALI changes vLLM, as data the patching code reads.
* collective.py: the helpers over a group's CPU group that group_setup.py and ep_manager.py share.

Nothing here may take the server down: unknown vLLM internals, a missing
extension, or a communicator that refuses (``YaliUnavailable``) only leave
YALI off and vLLM exactly as it was (an invalid ``YALI_FUSION`` is the one
start-up error, naming the variable).  See docs/VLLM_INTEGRATION.md.
"""

from __future__ import annotations

import logging

from yali_vllm.vllm_log import LOGGER

from .fusion_patch import register_fusion_op
from .patch import is_patched, patch_class
from .stats import yali_tp_stats
from .touch_points import COMMUNICATOR, VLLM_LOGGER, on, release

__all__ = ["register", "yali_tp_stats"]

# A child of vLLM's "vllm" logger, so the lines carry vLLM's format and
# per-process prefix (e.g. "(Worker_TP0 pid=...)") in server logs.
logger = logging.getLogger(LOGGER)

_COMM_MODULE, _, _COMM_CLASS = COMMUNICATOR.partition(":")


def in_supported_range(version: str) -> bool:
    """Whether `version` is a vLLM release series yali-vllm is tested against (0.26 through 0.33)."""
    from yali_vllm._version import OLDEST_VLLM_VERSION, TESTED_VLLM_VERSION

    return release(OLDEST_VLLM_VERSION) <= release(version) <= release(TESTED_VLLM_VERSION)


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:
        return "unknown"


def register() -> None:
    """``vllm.general_plugins`` entry point.  Idempotent; never raises."""
    try:
        from yali_vllm import vllm_log

        # The lines below reach vLLM's log on 0.31+ too.
        (configure,) = on(VLLM_LOGGER)
        vllm_log.hold_until_configured(configure.module, configure.symbol)
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
        register_fusion_op()
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
