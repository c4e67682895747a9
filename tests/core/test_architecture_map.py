"""docs/ARCHITECTURE.md opens with a map of the product's source files: every file under csrc/ and
yali_vllm/ is named there (a moved, added or renamed file fails here until the map follows)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("*.h", "*.cuh", "*.cu", "*.cpp", "*.py")


def map_names() -> set[str]:
    """The file names the map's code block gives: `config.h/.cpp` names config.h and config.cpp,
    `legacy/flash.cuh` names that path, `csrc/bindings/torch_ops.cpp` torch_ops.cpp."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    block = text[text.index("```\n") + 4:]
    block = block[:block.index("```")]
    names = set()
    for first in re.findall(r"^\s*(\S+)", block, re.M):
        while "/" in first and "." not in first.split("/")[0] and not first.startswith("legacy/"):
            first = first.split("/", 1)[1]  # csrc/bindings/torch_ops.cpp: the file's name
        stem, _, exts = first.partition(".")
        names.update(f"{stem}.{ext.lstrip('.')}" for ext in exts.split("/"))
    return names


def source_files() -> list[str]:
    """Every source file of the product: csrc/core/yali/legacy/flash.cuh as legacy/flash.cuh,
    yali_vllm/plugin/hook.py as hook.py (the map names files within their folder's block)."""
    out = []
    for top in ("csrc", "yali_vllm"):
        for pattern in SOURCES:
            for path in (REPO / top).rglob(pattern):
                rel = path.relative_to(REPO).as_posix()
                out.append("legacy/" + path.name if "/legacy/" in rel else path.name)
    return sorted(set(out))


def test_the_map_names_every_source_file():
    files = source_files()
    assert "communicator.cu" in files and "hook.py" in files and "torch_ops.cpp" in files
    missing = [f for f in files if f not in map_names()]
    assert missing == [], f"docs/ARCHITECTURE.md's map does not name {missing}"


def test_the_map_names_no_file_that_is_gone():
    gone = [n for n in map_names() if re.fullmatch(r"[\w/]+\.(h|cuh|cu|cpp|py)", n) and n not in source_files()]
    assert gone == [], f"docs/ARCHITECTURE.md's map names {gone}, which no longer exist"
