"""The size table's lookups (csrc/core/yali/common/plan.cpp over plan_table.h) decide exactly as the
if/else ladders they replace (plan_ladders.cpp): every all-reduce plan, N-rank limit and fused launch
over a dense sweep of sizes, shapes, world sizes, modes and settings. Compiled with g++ (no GPU,
no CUDA)."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMON = ROOT / "csrc" / "core" / "yali" / "common"


@pytest.mark.timeout(300)
def test_the_table_decides_as_the_ladders(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "table_matches_ladders"
    sources = [Path(__file__).with_name("table_matches_ladders.cpp")] + [COMMON / f for f in
                                                                        ("plan.cpp", "plan_ladders.cpp", "config.cpp")]
    subprocess.run([cxx, "-O2", "-std=c++17", "-I", str(ROOT / "csrc" / "core"), "-o", str(exe), *map(str, sources)],
                   check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert ", 0 differ" in out.stdout and int(out.stdout.split()[0]) > 10**7, out.stdout
