"""The plugin's lines in vLLM's log, on every supported vLLM.

The plugin logs to "vllm.yali", a child of vLLM's "vllm" logger, so its lines carry
vLLM's format and per-process prefix. vLLM 0.26-0.30 attach the "vllm" handler when
``vllm.logger`` is imported. From 0.31 vLLM attaches it only when a process applies
its logging configuration (``vllm.logger._configure_vllm_root_logger``), and the API
server and ``LLM(...)`` load plugins before that: INFO lines logged then would be
dropped (an unconfigured logger passes only warnings).

``hold_until_configured(module, name)``, given that function's row of
yali_vllm/plugin/touch_points.py, keeps the plugin's records in that window and hands them to
vLLM's handlers right after vLLM configures logging; where vLLM's handler is already attached
(0.26-0.30, and 0.31+ engine cores and workers) it does nothing.
"""
from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Hashable
from typing import Any

LOGGER = "vllm.yali"
# Records kept at most while vLLM's logging is not configured (the plugin logs a few).
MAX_HELD = 200
_WRAPPED = "_yali_release"


class _Held(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < MAX_HELD:
            self.records.append(record)


_held: _Held | None = None


def holding() -> bool:
    """True while the plugin's records wait for vLLM's logging configuration."""
    return _held is not None


def release() -> None:
    """Stop holding and pass the held records to the "vllm" logger's handlers (or, if vLLM attached
    none, e.g. VLLM_CONFIGURE_LOGGING=0, to whatever the application configured above it)."""
    global _held
    held, _held = _held, None
    if held is None:
        return
    log = logging.getLogger(LOGGER)
    log.removeHandler(held)
    log.setLevel(logging.NOTSET)
    log.propagate = True
    parent = logging.getLogger("vllm")
    for r in held.records:
        if r.levelno >= log.getEffectiveLevel():
            # Made again through the record factory vLLM has installed by now (it adds fields
            # its format needs, such as the process name), with the original time.
            again = log.makeRecord(r.name, r.levelno, r.pathname, r.lineno, r.msg, r.args, r.exc_info,
                                   r.funcName, None, r.stack_info)
            again.created, again.msecs = r.created, r.msecs
            parent.handle(again)


def hold_until_configured(module: str, name: str) -> bool:
    """Hold "vllm.yali" records until vLLM configures logging in this process, when it has not yet:
    `module`.`name` is vLLM's function that configures it (vllm.logger._configure_vllm_root_logger),
    wrapped to release them. Returns True when holding. Idempotent; never raises."""
    global _held
    if _held is not None:
        return True
    if logging.getLogger("vllm").handlers:
        return False  # vLLM's handler is attached: lines go straight to it
    try:
        vllm_logger = importlib.import_module(module)
    except Exception:
        return False
    configure = getattr(vllm_logger, name, None)
    if configure is None:
        return False  # not a hook point this module knows: lines go where the logger sends them
    if logging.getLogger("vllm").handlers:  # importing vllm.logger configured it (0.26-0.30)
        return False
    if not getattr(configure, _WRAPPED, False):

        @functools.wraps(configure)
        def configure_then_release(*args, **kwargs):
            try:
                return configure(*args, **kwargs)
            finally:
                release()

        setattr(configure_then_release, _WRAPPED, True)
        setattr(vllm_logger, name, configure_then_release)
    _held = _Held()
    log = logging.getLogger(LOGGER)
    log.addHandler(_held)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    return True


# The keys of the lines log_once has logged in this process.
_logged: set[Hashable] = set()


def log_once(logger: logging.Logger, level: int, msg: str, *args: Any, key: Hashable = None) -> None:
    """`logger`.log(`level`, `msg`, *`args`) the first time this process logs the line: a line is
    known by `key`, or when that is None by its text (``msg % args``), so one with other text is a
    new line. The line counts as logged also when `level` is below the logger's level."""
    seen = (msg % args if args else msg) if key is None else key
    if seen in _logged:
        return
    _logged.add(seen)
    logger.log(level, msg, *args)


def forget_logged() -> None:
    """Forget every line log_once has logged in this process (tests use it to see lines again)."""
    _logged.clear()


def log_first_call(op: str, key: tuple, msg: str, *args) -> None:
    """One INFO line per process, op and key (its group and path) the first time `op` runs: the
    sign that the op is in the compiled graph also when vLLM loaded that graph from its compile
    cache, where the pass that put it there is never built and its line never appears."""
    log_once(logging.getLogger(LOGGER), logging.INFO, msg, *args, key=("first call", op, key))
