"""The benchmark library's layout holds: every module of benchmarks/ and examples/, and the lab's
tools built on that library, imports on a machine without a GPU, the imports between the
repository's own modules (function-local ones included; the product, yali_vllm/, and the lab,
lab/, among them) form no circle, and no file edits sys.path."""
from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("yali_vllm", "benchmarks", "examples", "tests", "lab")
LOCUSTFILE = "benchmarks.locustfile"  # locust patches the process it is imported in (gevent)
LAB_TOOLS = ("lab.tune", "lab.decode_profile")  # the lab's GPU tools, built on the benchmarks' library


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")
            if "results" not in p.relative_to(REPO).parts}


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The repository modules `name` imports anywhere in its file (top level or inside functions)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def test_the_repositorys_imports_form_no_circle():
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert "benchmarks.serving.bench_run" in graph["benchmarks.serving_bench"]
    assert "benchmarks.serving.server" in graph["benchmarks.serving.bench_run"]
    assert "yali_vllm.plugin.ep_manager" in graph["yali_vllm.plugin.group_setup"]  # the product is read too
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circle = path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
                pytest.fail("import circle: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])


def test_every_library_module_imports_without_a_gpu():
    names = sorted(n for n in modules() if (n.split(".")[0] in ("benchmarks", "examples") or n in LAB_TOOLS)
                   and n != LOCUSTFILE)
    assert len(names) >= 20 and set(LAB_TOOLS) <= set(names), names
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\nprint('ok', len(sys.argv) - 1)"
    r = subprocess.run([sys.executable, "-c", code, *names], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ok", str(len(names))]


@pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="needs locust")
def test_the_locustfile_imports():
    r = subprocess.run([sys.executable, "-c", f"import {LOCUSTFILE}"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def test_no_file_edits_sys_path():
    files = [*REPO.glob("*.py"), *(p for d in (*PACKAGES, "scripts", "yali_vllm", "deploy", "csrc")
                                   for p in (REPO / d).rglob("*.py"))]
    edits = [str(p.relative_to(REPO)) for p in files
             if "sys.path." in p.read_text(errors="replace") and p != Path(__file__).resolve()]
    assert not edits, edits
