"""The product stays apart from the rest of the repository: its Python (yali_vllm/, examples/)
imports nothing of the repository but the package yali_vllm itself (function-local imports
included), so that it runs from the installed wheel; and the product's library holds no test-only
kernel (those build into a library of their own, tests/gpu/yali_testing.abi3.so: setup.py)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from yali_vllm import _ext

REPO = Path(__file__).resolve().parents[2]
PRODUCT_PYTHON = ("yali_vllm", "examples")
PACKAGE = "yali_vllm"


def repository_roots() -> set[str]:
    """The names a module of this repository can be imported by: its top-level folders and .py files."""
    return {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")} | {
        p.stem for p in REPO.glob("*.py")}


def imported_roots(path: Path) -> set[str]:
    """The first name of every absolute module `path` imports, anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_product_imports_nothing_of_the_repository_but_its_package():
    lab = repository_roots() - {PACKAGE}
    assert {"benchmarks", "tests", "scripts", "lab", "examples"} <= lab
    files = [p for top in PRODUCT_PYTHON for p in (REPO / top).rglob("*.py")]
    assert len(files) >= 20, files
    found = {str(p.relative_to(REPO)): sorted(imported_roots(p) & lab) for p in files}
    assert {f: n for f, n in found.items() if n} == {}, "the product imports from outside the package"


def test_the_import_check_sees_function_local_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os\n\ndef f():\n    from benchmarks.serving import http\n    import lab.x\n")
    assert imported_roots(sample) == {"os", "benchmarks", "lab"}


@pytest.mark.skipif(_ext.library_error() is not None, reason=f"extension not built: {_ext.library_error()}")
def test_the_product_library_holds_no_test_kernel():
    import torch

    data = Path(_ext._library_path()).read_bytes()
    assert b"_ZN4yali" in data, "the check reads the mangled names of namespace yali"
    assert b"4yali7testing" not in data, "a symbol or kernel of namespace yali::testing is in the library"
    for op in ("testing_occupy", "testing_early_trigger", "occupy", "early_trigger"):
        assert not hasattr(torch.ops.yali, op), op
