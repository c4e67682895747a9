"""The hook: what runs inside vLLM's CudaCommunicator once patch.py has patched it.

``all_reduce`` tries YALI first when the group's YaliCommunicator takes the tensor; every
other tensor goes down vLLM's original chain (custom all-reduce, symmetric memory,
PyNCCL, ...) untouched.  ``__init__`` builds the YaliCommunicator (group_setup.py),
``destroy``, ``suspend`` and ``checkpoint_prepare`` keep it in step with vLLM's own.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

from yali_vllm.vllm_log import LOGGER

from .collective import close_quietly
from .group_setup import after_init, checkpoint_release, log_off
from .stats import buffer_size, log_dispatch

logger = logging.getLogger(LOGGER)


def wrap_all_reduce(orig_all_reduce: Any) -> Any:
    @functools.wraps(orig_all_reduce)
    def all_reduce(self: Any, input_: Any) -> Any:
        yc = getattr(self, "yali_comm", None)
        if yc is None:
            return orig_all_reduce(self, input_)
        # YALI first for every size it serves: it measured faster than vLLM's custom
        # all-reduce and NCCL at every size and dtype (lab/results/current/allreduce/20261122-before-pdl).
        yali = yc.should_use(input_)
        if logger.isEnabledFor(logging.INFO):
            # One line the first time each (dtype, power-of-two size class, backend) is
            # dispatched by this communicator; a repeat costs this set lookup. (Replays of
            # captured CUDA graphs run no Python at all.)
            nbytes = input_.nbytes
            key = (input_.dtype, (nbytes or 1).bit_length(), yali)
            if key not in self._yali_dispatch_seen:
                self._yali_dispatch_seen.add(key)
                log_dispatch(self, key, nbytes)
        return yc.all_reduce(input_) if yali else orig_all_reduce(self, input_)

    return all_reduce


def wrap_init(orig_init: Any) -> Any:
    sig = inspect.signature(orig_init)

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        self.yali_comm = None
        self._yali_dispatch_seen = set()  # all_reduce's dispatch classes already logged
        try:
            bound = sig.bind(self, *args, **kwargs)
            stateless = bound.arguments.get("tcp_store_group") is not None
            after_init(self, stateless)
        except Exception as e:
            self.yali_comm = None
            log_off(self, f"unexpected error ({type(e).__name__}: {e})", True, exc_info=True)

    return __init__


def wrap_destroy(orig_destroy: Any) -> Any:
    @functools.wraps(orig_destroy)
    def destroy(self: Any) -> Any:
        yc = getattr(self, "yali_comm", None)
        self.yali_comm = None
        if yc is not None:
            close_quietly(yc)
        return orig_destroy(self)

    return destroy


def wrap_suspend(orig_suspend: Any) -> Any:
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
                        buffer_size(yc))
        return orig_suspend(self)

    return suspend


def wrap_checkpoint_prepare(orig: Any) -> Any:
    """vLLM 0.27+: before a process checkpoint, release YALI where no CUDA graph captured it
    (group_setup.checkpoint_release)."""

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
