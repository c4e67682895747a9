"""The test-only kernels' own library (tests/gpu/yali_testing.abi3.so, testing_ops.py), on the CPU:
it loads beside the product's library, registers its two ops under torch.ops.yali_testing (none
under torch.ops.yali) and refuses a bad argument, naming it, before anything is launched."""
import re
import shutil
import subprocess

import pytest
import torch

from . import testing_ops
from .testing_ops import needs_testing_ops

pytestmark = pytest.mark.cpu


@needs_testing_ops
def test_the_library_registers_its_ops_apart_from_the_products():
    y = testing_ops.ops()
    assert str(y.occupy) == "yali_testing.occupy" and str(y.early_trigger) == "yali_testing.early_trigger"
    assert not hasattr(torch.ops.yali, "occupy") and not hasattr(torch.ops.yali, "testing_occupy")


@needs_testing_ops
@pytest.mark.parametrize("args,named", [((0, 0, 1000), "ctas must be in [1, 1024], got 0"),
                                        ((0, 1025, 1000), "ctas must be in [1, 1024], got 1025"),
                                        ((0, 1, -1), "spin_ns must be >= 0, got -1")])
def test_occupy_refuses_a_bad_argument(args, named):
    with pytest.raises(RuntimeError, match=re.escape(f"yali_testing: {named}")):
        testing_ops.ops().occupy(*args)


@needs_testing_ops
def test_early_trigger_refuses_a_negative_spin():
    with pytest.raises(RuntimeError, match="yali_testing: spin_ns must be >= 0, got -5"):
        testing_ops.ops().early_trigger(0, -5)


@needs_testing_ops
@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
def test_the_library_imports_no_cpp_torch_symbol():
    """Built on torch's stable C ABI as the product's library is, so it loads in every supported torch."""
    out = subprocess.run(["nm", "-D", "--undefined-only", "--demangle", testing_ops.library_path()],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    syms = [line.split(None, 1)[-1] for line in out.splitlines() if line.strip()]
    assert any(s.startswith("aoti_torch_") for s in syms), "the library should use torch's C shim"
    assert [s for s in syms if re.match(r"(c10|at|torch|caffe2)::", s) or "c10::" in s] == []
    assert [s for s in syms if s.startswith("Py")] == []


def test_a_missing_library_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setattr(testing_ops, "HERE", str(tmp_path))
    assert testing_ops.library_path() is None
    assert testing_ops.BUILD in testing_ops.missing() and str(tmp_path) in testing_ops.missing()
