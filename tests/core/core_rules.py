"""The core's pure C++ rules (overlap.h, quant.h, abort_text.cpp) built with the host compiler into a small
query program (core_rules.cpp) for the CPU tests: no CUDA, no GPU, no extension."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = ["tests/core/core_rules.cpp", "csrc/core/yali/common/abort_text.cpp", "csrc/core/yali/common/config.cpp",
           "csrc/core/yali/common/plan.cpp", "csrc/core/yali/common/quant.cpp"]


@functools.lru_cache(maxsize=None)
def _program() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++ / c++) on PATH")
    exe = os.path.join(tempfile.mkdtemp(prefix="yali-core-rules-"), "core_rules")
    subprocess.run([cxx, "-std=c++20", "-O1", "-I", os.path.join(ROOT, "csrc/core"), "-I", os.path.join(ROOT, "csrc"),
                    *(os.path.join(ROOT, s) for s in SOURCES), "-o", exe], check=True, capture_output=True, text=True,
                   timeout=300)
    return exe


def query(*lines: str) -> list[str]:
    """The program's answer to each query line (see core_rules.cpp)."""
    out = subprocess.run([_program()], input="".join(f"{q}\n" for q in lines), capture_output=True, text=True,
                         check=True, timeout=60)
    return out.stdout.splitlines()
