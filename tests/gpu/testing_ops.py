"""The test-only kernels (csrc/testing: occupy, early_trigger) as torch.ops.yali_testing.

They live in a library of their own beside this file, tests/gpu/yali_testing.abi3.so, built with
the product's library only when asked:
    YALI_BUILD_TESTING=1 python setup.py build_ext --inplace
The product's library (yali_vllm/_C.abi3.so) and its wheel hold none of them. A test that launches
them skips, saying how to build them, where the library is missing (needs_testing_ops)."""
from __future__ import annotations

import functools
import glob
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = "YALI_BUILD_TESTING=1 python setup.py build_ext --inplace"


def library_path() -> str | None:
    libs = sorted(glob.glob(os.path.join(HERE, "yali_testing*.so")))
    return libs[0] if libs else None


def missing() -> str | None:
    """Why there is no library to load (the collecting process asks this without loading it), or None."""
    if library_path() is None:
        return f"the test-only kernels are not built: no yali_testing*.so in {HERE} (build them: {BUILD})"
    return None


@functools.lru_cache(maxsize=None)
def load_error() -> str | None:
    """Why torch.ops.yali_testing is not there (the library missing or not loadable), or None once loaded."""
    if missing():
        return missing()
    import torch

    lib = library_path()
    try:
        torch.ops.load_library(lib)
    except OSError as e:
        return f"could not load {lib}: {e} (rebuild it: {BUILD})"
    return None


def ops():
    """torch.ops.yali_testing, after loading the library; RuntimeError naming the cause otherwise."""
    err = load_error()
    if err:
        raise RuntimeError(err)
    import torch

    return torch.ops.yali_testing


# The tests that launch the test-only kernels (in their rank processes) skip where they are not built.
needs_testing_ops = pytest.mark.skipif(missing() is not None, reason=str(missing()))
