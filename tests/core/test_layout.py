"""The product stays apart from the lab (lab/: results, design log, GPU-host scripts, their tests).
The product's Python (yali_vllm/, examples/) imports nothing of the repository but the package
yali_vllm itself (function-local imports included), so that it runs from the installed wheel; its
deploy files name no lab path; its library holds no test-only kernel (those build into a library
of their own, tests/gpu/yali_testing.abi3.so: setup.py). No file names a lab path from before the
lab had its folder, and every relative link of every Markdown file resolves."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

from yali_vllm import _ext

REPO = Path(__file__).resolve().parents[2]
PRODUCT_PYTHON = ("yali_vllm", "examples")
PACKAGE = "yali_vllm"


def tracked(pattern: str = "*") -> list[Path]:
    """The repository's files whose name matches `pattern`: git's list in a checkout; every file in a
    copy of the tracked files without git (CI's wheel leg, .ci/wheel_suite.sh)."""
    if not (REPO / ".git").exists():
        return sorted(p for p in REPO.rglob(pattern) if p.is_file())
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--", pattern], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    return [REPO / p for p in out.split("\0") if p]


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


def test_the_deploy_files_name_no_lab_path():
    files = [p for p in (REPO / "deploy").rglob("*") if p.is_file()]
    assert len(files) >= 5, files
    named = {str(p.relative_to(REPO)) for p in files if re.search(r"\blab/|gpu_host/|results/", p.read_text())}
    assert named == set(), named


# Where the lab's files were before lab/ held them. The result files under lab/results keep the paths
# their runs recorded.
OLD_PATHS = re.compile(r"benchmarks/results|scripts/gpu_host|docs/DESIGN_LOG\.md|tests/bench\b|"
                       r"scripts[/.](results_index|record_test_run|mutate_decisions)|"
                       r"benchmarks[/.](tune|decode_profile)\b")


def test_no_file_names_a_lab_path_from_before_lab():
    files = [p for p in tracked() if not p.is_relative_to(REPO / "lab" / "results") and p.is_file()
             and p != Path(__file__).resolve() and p.suffix not in (".png", ".so")]
    assert len(files) >= 100, len(files)
    named = {}
    for p in files:
        try:
            hits = sorted({m.group(0) for m in OLD_PATHS.finditer(p.read_text())})
        except UnicodeDecodeError:
            continue
        if hits:
            named[str(p.relative_to(REPO))] = hits
    assert named == {}, f"the lab lives in lab/ (lab/README.md): {named}"


# [text](target) and ![alt](target), an optional "title" after the target; code blocks and spans are skipped.
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def relative_links(text: str) -> list[str]:
    """The relative file targets of the Markdown links in `text` (no URL, no anchor of this page)."""
    out = []
    for target in LINK.findall(CODE.sub("", text)):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(unquote(target.split("#", 1)[0]))
    return out


def test_the_link_reader_finds_relative_links_only():
    text = ("[a](../x/README.md#part) ![p](plot.png) [u](https://e.org/y.md) [s](#here) [m](mailto:a@b)\n"
            "`[c](in-code.md)`\n```\n[d](in-block.md)\n```\n[t](file%20name.md \"title\")")
    assert relative_links(text) == ["../x/README.md", "plot.png", "file name.md"]


def test_every_relative_markdown_link_resolves():
    pages = tracked("*.md")
    assert len(pages) >= 100, len(pages)
    broken = [f"{page.relative_to(REPO)}: {target}" for page in pages
              for target in relative_links(page.read_text(errors="replace"))
              if not (REPO / target.lstrip("/") if target.startswith("/") else page.parent / target).exists()]
    assert broken == [], f"{len(broken)} links lead nowhere:\n" + "\n".join(broken[:50])
