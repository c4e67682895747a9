"""Loads the compiled YALI library (yali_vllm/_C.abi3.so) into torch.ops.yali.

The library uses torch's stable C ABI only (csrc/bindings/torch_ops.cpp), so one
build loads in every torch from 2.11 on. Import never fails: without the library
(not built, or not loadable) or without a GPU, callers get `available() == False`
and `unavailable_reason()` says why.

The stable ABI raises every C++ error as RuntimeError; the library tags the ones
that mean ValueError or TypeError ("[ValueError] yali: ..."), and `call()` /
`ops()` raise them as that type again.
"""
from __future__ import annotations

import functools
import glob
import os
import re

import torch

# The oldest torch the library's stable ABI target allows (setup.py: TARGET).
MIN_TORCH = (2, 11)
_BUILD_INFO = re.compile(rb"yali-vllm build: [ -~]+")
_TAG = re.compile(r"\[(ValueError|TypeError)\] ")
_TYPES = {"ValueError": ValueError, "TypeError": TypeError}


def _library_path() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    libs = sorted(glob.glob(os.path.join(here, "_C*.so")))
    return libs[0] if libs else None


def build_info_of(path: str) -> str | None:
    """What the library at `path` was built against ("yali-vllm build: torch 2.14.0+cu130 headers,
    stable ABI target 2.11"), read from the file itself, so it works when loading does not."""
    try:
        with open(path, "rb") as f:
            m = _BUILD_INFO.search(f.read())
    except OSError:
        return None
    return m.group(0).decode() if m else None


def _torch_version() -> tuple[int, int]:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[return-value]


def load_error_message(path: str, error: BaseException) -> str:
    """Why the library at `path` did not load, with what it was built for and the torch running."""
    built = build_info_of(path) or "build information not found in the file"
    running = f"torch {torch.__version__} is running"
    hint = ""
    if _torch_version() < MIN_TORCH:
        hint = f"; yali-vllm needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}"
    elif "undefined symbol" in str(error):
        hint = "; a symbol it imports is missing from this torch or CUDA runtime (rebuild: pip install --no-build-isolation .)"
    return f"could not load {path}: {error} ({built}; {running}{hint})"


@functools.lru_cache(maxsize=None)
def _load() -> str | None:
    """Returns None when loaded, else the reason it could not be."""
    lib = _library_path()
    if lib is None:
        here = os.path.dirname(os.path.abspath(__file__))
        return f"the compiled extension yali_vllm/_C*.so is missing in {here} (build it: pip install --no-build-isolation .)"
    try:
        torch.ops.load_library(lib)
    except OSError as e:  # a missing symbol or CUDA runtime, an unreadable file, ...
        return load_error_message(lib, e)
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


def remap(e: RuntimeError) -> Exception:
    """The exception the library meant: ValueError / TypeError for a tagged message, else `e`."""
    m = _TAG.search(str(e))
    if m is None:
        return e
    text = str(e)
    return _TYPES[m.group(1)](text[: m.start()] + text[m.end():])


def call(op, *args):
    """op(*args), with the library's tagged errors raised as ValueError / TypeError."""
    try:
        return op(*args)
    except RuntimeError as e:
        mapped = remap(e)
        if mapped is e:
            raise
        raise mapped from None


class _Ops:
    """torch.ops.yali with call()'s error types: ops().config_string() raises ValueError naming a bad
    YALI_* variable, as a Python function would."""

    def __getattr__(self, name: str):
        return functools.partial(call, getattr(torch.ops.yali, name))


def ops() -> _Ops:
    """torch.ops.yali (errors typed as above), after loading the library; raises RuntimeError naming the cause."""
    err = _load()
    if err:
        raise RuntimeError(f"yali: {err}")
    return _Ops()
