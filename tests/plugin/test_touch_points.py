"""CPU tests of the list of vLLM touch points (yali_vllm/plugin/touch_points.py) against the real,
installed vLLM: every listed symbol exists where its row says, exactly in the releases the row
names; the patching code changes exactly the listed symbols of vLLM and nothing else; the page
docs/VLLM_INTEGRATION.md shows the list as it is.

One stand-in, as in test_vllm_fusion.py: ``StandInPass`` in place of vLLM's AllReduceFusionPass,
which vLLM's pass manager imports on a CUDA platform only."""
from __future__ import annotations

import ast
import importlib
import inspect
import logging
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllm  # noqa: E402
from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager  # noqa: E402

from yali_vllm import _version, plugin, vllm_log  # noqa: E402
from yali_vllm.plugin import ep_manager, fusion_patch, patch, touch_points  # noqa: E402
from yali_vllm.plugin.touch_points import (  # noqa: E402
    ALL2ALL_MANAGER, CACHE_FACTOR, CLASS_SWAP, COMMUNICATOR, METHOD, MODULE_SYMBOL, TECHNIQUES, TOUCH_POINTS,
    TouchPoint, on, release,
)

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "VLLM_INTEGRATION.md"


class StandInPass:
    """Stand-in for vLLM's AllReduceFusionPass (see the module docstring)."""


# ------------------------------------------------------------------ the rows
def test_rows_are_one_per_symbol_with_a_known_technique_inside_the_supported_releases():
    oldest, tested = release(_version.OLDEST_VLLM_VERSION), release(_version.TESTED_VLLM_VERSION)
    assert len({(t.owner, t.symbol) for t in TOUCH_POINTS}) == len(TOUCH_POINTS)
    for t in TOUCH_POINTS:
        first, last = t.span
        assert t.technique in TECHNIQUES, t
        assert oldest <= first <= last <= tested, t
        assert t.owner.startswith("vllm") and t.symbol and t.does, t
        assert (t.class_name is not None) == (t.technique in (METHOD, CLASS_SWAP)), t
    assert {t.technique for t in TOUCH_POINTS} == set(TECHNIQUES)


def test_a_row_reads_its_releases():
    t = TouchPoint("vllm.x:C", "f", "0.27-0.31", METHOD, "d")
    assert t.module == "vllm.x" and t.class_name == "C" and t.optional
    assert [t.exists_in(v) for v in ("0.26.0", "0.27.0", "0.31.9.dev2+gabc", "0.32.0")] == [False, True, True, False]
    assert not TouchPoint("vllm.x", "f", "0.26-0.33", MODULE_SYMBOL, "d").optional
    assert TouchPoint("vllm.x", "f", "0.33", MODULE_SYMBOL, "d").span == ((0, 33), (0, 33))


def test_an_owner_without_rows_is_named():
    with pytest.raises(ValueError, match="vllm.nowhere"):
        on("vllm.nowhere")


# ------------------------------------------- the rows against the installed vLLM
def _binds(module: object, name: str) -> bool:
    """Whether `module`'s source binds `name` at its top level (also under an if or a try), as
    vLLM's pass manager imports AllReduceFusionPass on a CUDA platform only."""
    tree = ast.parse(inspect.getsource(module))
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.If, ast.Try)):
            body += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return True
        elif isinstance(node, ast.Assign) and any(isinstance(x, ast.Name) and x.id == name for x in node.targets):
            return True
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
    return False


def _exists(t: TouchPoint) -> bool:
    """Whether the installed vLLM has `t`'s symbol where the technique needs it: a method patched in
    place defined by the class itself, a method overridden by a subclass on the class or a base, a
    module's name in the module (or bound by its source where the platform decides)."""
    module = importlib.import_module(t.module)
    if t.class_name is None:
        return t.symbol in vars(module) or _binds(module, t.symbol)
    cls = getattr(module, t.class_name)
    found = vars(cls).get(t.symbol) if t.technique == METHOD else getattr(cls, t.symbol, None)
    return callable(found)


@pytest.mark.parametrize("t", TOUCH_POINTS, ids=lambda t: f"{t.owner.rpartition('.')[2]}.{t.symbol}")
def test_every_symbol_exists_exactly_in_the_releases_its_row_names(t):
    assert _exists(t) == t.exists_in(vllm.__version__), (
        f"vLLM {vllm.__version__} {'has' if _exists(t) else 'lacks'} {t.owner}.{t.symbol}; its row says {t.versions}")


def test_the_cache_factor_is_an_entry_of_the_table_vllm_hashes_into_its_compile_key():
    (t,) = [t for t in TOUCH_POINTS if t.technique == CACHE_FACTOR]
    module = importlib.import_module(t.module)
    assert isinstance(getattr(module, t.symbol), dict)
    assert f"`{fusion_patch.CACHE_FACTOR}`" in t.does
    assert t.symbol in inspect.getsource(module.compile_factors)


# ------------------------------------ what the patching code changes in vLLM
def _callables(namespace: dict) -> dict[str, int]:
    return {k: id(v) for k, v in namespace.items() if callable(v)}


def _snapshot() -> dict[tuple[str, str], object]:
    """Every function and class that vLLM's loaded modules and their classes hold, by (owner, name),
    as its identity; and the keys of the tables that cache-factor rows name."""
    out: dict[tuple[str, str], object] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "vllm" or name.startswith("vllm.")):
            continue
        for k, v in _callables(vars(module)).items():
            out[(name, k)] = v
        for cls_name, cls in list(vars(module).items()):
            if isinstance(cls, type) and cls.__module__ == name:
                for k, v in _callables(vars(cls)).items():
                    out[(f"{name}:{cls_name}", k)] = v
    for t in TOUCH_POINTS:
        if t.technique == CACHE_FACTOR:
            for key in getattr(sys.modules[t.module], t.symbol):
                out[(f"{t.module}.{t.symbol}", key)] = "key"
    return out


@pytest.fixture
def vllm_as_shipped(monkeypatch):
    """vLLM's modules as shipped, with every touch point's module loaded and the pass manager's
    fusion pass name present (StandInPass) as on a CUDA platform; no handler on vLLM's logger, as in
    a 0.31+ API server before vLLM configures logging. Whatever the plugin patches is undone after."""
    for t in TOUCH_POINTS:
        importlib.import_module(t.module)
    vllm_log.release()  # an earlier register() in this process may still hold the plugin's lines
    pm = importlib.import_module(fusion_patch._PM_MODULE)
    monkeypatch.setattr(pm, fusion_patch._PM_SYMBOL, StandInPass, raising=False)
    configure = on(touch_points.VLLM_LOGGER)[0]
    logger_module = sys.modules[configure.module]
    shipped = getattr(logger_module, configure.symbol)
    if getattr(shipped, vllm_log._WRAPPED, False):  # wrapped by an earlier register() in this process
        shipped = shipped.__wrapped__
    monkeypatch.setattr(logger_module, configure.symbol, shipped)
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [])
    cache = sys.modules[fusion_patch._CACHE_KEY.module].environment_variables
    monkeypatch.delitem(cache, fusion_patch.CACHE_FACTOR, raising=False)
    communicator = getattr(sys.modules[COMMUNICATOR.partition(":")[0]], COMMUNICATOR.partition(":")[2])
    patch.unpatch_class(communicator)
    yield
    patch.unpatch_class(communicator)
    fusion_patch.unpatch_fusion_pass()
    cache.pop(fusion_patch.CACHE_FACTOR, None)
    vllm_log.release()


def test_the_plugin_changes_in_vllm_exactly_the_rows_of_the_installed_release(vllm_as_shipped, monkeypatch):
    """register() in every vLLM process and the worker's fusion hooks change the listed functions
    and table of the installed vLLM and nothing else of vLLM's (the class swap changes a live
    manager only: the next test); the hook's own `_yali` marks on the class aside."""
    # pytest attaches its log-capture handlers when the test's call starts (after the fixture):
    # vLLM's logger has none here, as in an API server before vLLM configures logging.
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [])
    before = _snapshot()
    plugin.register()
    fusion_patch.install_fusion_hooks()  # no vLLM config is current: installed, as in a compiling worker
    after = _snapshot()
    owners = {owner for owner, _ in before}  # the modules loaded since are vLLM's own doing
    changed = {(owner, name) for owner, name in before.keys() | after.keys()
               if owner in owners and before.get((owner, name)) != after.get((owner, name))
               and not name.startswith("_yali")}
    expected = {(t.owner, t.symbol) for t in TOUCH_POINTS
                if t.technique in (METHOD, MODULE_SYMBOL) and t.exists_in(vllm.__version__)}
    expected |= {(f"{t.module}.{t.symbol}", fusion_patch.CACHE_FACTOR) for t in TOUCH_POINTS
                 if t.technique == CACHE_FACTOR}
    assert changed == expected
    assert vllm_log.holding()


def test_the_communicator_has_a_wrapper_for_each_of_its_rows_and_no_other():
    rows = on(COMMUNICATOR)
    assert {t.technique for t in rows} == {METHOD}
    assert set(patch.WRAPPERS) == {t.symbol for t in rows}


def test_the_class_swap_overrides_exactly_the_managers_rows():
    """YALI's subclass of vLLM's manager overrides the rows' methods (its own helpers are `_yali_*`),
    and the hook check knows the parameters of each."""
    rows = on(ALL2ALL_MANAGER)
    assert {t.technique for t in rows} == {CLASS_SWAP}
    cls = ep_manager.manager_class(AgRsAll2AllManager)
    overrides = {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_yali")}
    assert overrides == {t.symbol for t in rows}
    assert set(ep_manager._PARAMS) == overrides | set(ep_manager.CALLED)
    assert ep_manager.AGRS_CLASS == AgRsAll2AllManager.__name__


# ----------------------------------------------------------------- the page
def test_the_integration_page_shows_the_touch_points_as_listed():
    table = touch_points.markdown_table()
    assert table in PAGE.read_text(), "docs/VLLM_INTEGRATION.md's touch-point table differs from:\n" + table
