"""Loads the compiled YALI library (yali_vllm/_C.abi3.so) into torch.ops.yali.

Import never fails: without the library (not built) or without a GPU, callers get
`available() == False` and `unavailable_reason()` says why.
"""
from __future__ import annotations

import functools
import glob
import os

import torch


@functools.lru_cache(maxsize=None)
def _load() -> str | None:
    """Returns None when loaded, else the reason it could not be."""
    here = os.path.dirname(os.path.abspath(__file__))
    libs = sorted(glob.glob(os.path.join(here, "_C*.so")))
    if not libs:
        return f"the compiled extension yali_vllm/_C*.so is missing in {here} (build it: pip install --no-build-isolation .)"
    try:
        torch.ops.load_library(libs[0])
    except OSError as e:  # wrong torch, missing CUDA runtime, ...
        return f"could not load {libs[0]}: {e}"
    return None


def library_error() -> str | None:
    """Why the library is not loaded, or None once it is."""
    return _load()


def unavailable_reason() -> str | None:
    """None when YALI can run here; otherwise a one-line reason (no library, no GPU)."""
    err = _load()
    if err:
        return err
    n = torch.ops.yali.device_count()
    if n < 1:
        return "no CUDA GPU is visible to the YALI extension"
    return None


def available() -> bool:
    return unavailable_reason() is None


def ops():
    """torch.ops.yali, after loading the library; raises RuntimeError naming the cause."""
    err = _load()
    if err:
        raise RuntimeError(f"yali: {err}")
    return torch.ops.yali
