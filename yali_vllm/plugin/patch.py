"""Patching vLLM's CudaCommunicator class in place with the hook (hook.py), once, and only
when its hook points look as expected. The methods patched are the class's rows in
touch_points.py: those every supported vLLM has are required, the others wrapped where the class
defines them.

The patch is applied to the class rather than by subclassing because vLLM resolves the
class by its qualified name and checks ``isinstance`` against it in
``GroupCoordinator.graph_capture``.
"""

from __future__ import annotations

import inspect
import logging

from yali_vllm.vllm_log import LOGGER

from .hook import wrap_all_reduce, wrap_checkpoint_prepare, wrap_destroy, wrap_init, wrap_suspend
from .touch_points import COMMUNICATOR, on

logger = logging.getLogger(LOGGER)

# Class attributes the patch leaves behind: the mark makes register()
# idempotent (also across re-imports of the plugin), the originals allow
# unpatch_class().
_MARK = "_yali_vllm_patched"
_ORIGINALS = "_yali_vllm_originals"
# Parameters of CudaCommunicator.__init__ (after self) the hook relies on.
_INIT_PARAMS = ("cpu_group", "device", "unique_name")
# The wrapper of each method of CudaCommunicator that touch_points.py lists, by name.
WRAPPERS = {
    "__init__": wrap_init,
    "all_reduce": wrap_all_reduce,
    "destroy": wrap_destroy,
    "checkpoint_prepare": wrap_checkpoint_prepare,
    "suspend": wrap_suspend,
}


def check_hook_points(cls: type) -> str | None:
    """None if ``cls`` looks like the CudaCommunicator this hook was written
    for, else a description of what differs."""
    for point in on(COMMUNICATOR):
        if not point.optional and not callable(cls.__dict__.get(point.symbol)):
            return f"{cls.__qualname__}.{point.symbol} is not defined by the class"
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


def is_patched(cls: type) -> bool:
    """Whether ``cls`` carries the hook."""
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
    # check_hook_points found every required method; an optional one is wrapped where defined.
    originals = {p.symbol: cls.__dict__[p.symbol] for p in on(COMMUNICATOR) if callable(cls.__dict__.get(p.symbol))}
    for name, fn in originals.items():
        setattr(cls, name, WRAPPERS[name](fn))
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
