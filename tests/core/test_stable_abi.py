"""The compiled library is built on torch's stable C ABI only: one file loads in every
supported torch (2.11 through 2.14). CPU tests: the symbol table, the build record,
the error types the stable ABI cannot carry, and the message when loading fails."""
import os
import re
import shutil
import subprocess

import pytest
import torch

from yali_vllm import _ext, config

LIB = _ext._library_path()
pytestmark = pytest.mark.skipif(_ext.library_error() is not None, reason=f"extension not built: {_ext.library_error()}")


def _undefined_symbols() -> list[str]:
    out = subprocess.run(["nm", "-D", "--undefined-only", "--demangle", LIB], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return [line.split(None, 1)[-1] for line in out.splitlines() if line.strip()]


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
def test_library_imports_no_cpp_torch_symbol():
    syms = _undefined_symbols()
    assert any(s.startswith("aoti_torch_") for s in syms), "the library should use torch's C shim"
    cpp_torch = [s for s in syms if re.match(r"(c10|at|torch|caffe2)::", s) or "c10::" in s]
    assert not cpp_torch, f"C++ torch symbols imported (the library would load in one torch only): {cpp_torch[:10]}"
    python = [s for s in syms if s.startswith("Py")]
    assert not python, f"Python C-API symbols imported: {python[:10]}"


def test_build_record_in_the_file_matches_the_library():
    info = _ext.build_info_of(LIB)
    assert info == torch.ops.yali.build_info()
    assert re.fullmatch(r"yali-vllm build: torch 2\.\d+\.\d+\S* headers, stable ABI target 2\.11", info), info


def test_runs_in_the_torch_of_this_environment():
    # The CI leg on the oldest supported vLLM runs this with torch 2.11 and the library built against
    # the newest supported torch (CI_EXPECT_OTHER_BUILD_TORCH=1 there): the same file, another torch.
    built = re.search(r"torch (\S+) headers", torch.ops.yali.build_info()).group(1)
    if os.environ.get("CI_EXPECT_OTHER_BUILD_TORCH") == "1":
        assert built.split("+")[0] != torch.__version__.split("+")[0], (built, torch.__version__)
    assert config.plan(4096)[0] == "flash-push"
    assert "max_bytes=" in torch.ops.yali.config_string()


def test_tagged_errors_come_back_as_their_python_types(monkeypatch):
    with pytest.raises(RuntimeError, match=r"\[ValueError\] yali: kernel mode 7"):
        torch.ops.yali.plan(4096, 7)  # the raw op: the stable ABI raises RuntimeError
    with pytest.raises(ValueError, match=r"^yali: kernel mode 7 is not -1, 0, 1 or 2$"):
        _ext.ops().plan(4096, 7)
    monkeypatch.setenv("YALI_DEV_SLOT_BYTES", "0")
    with pytest.raises(ValueError, match=r"^yali: YALI_DEV_SLOT_BYTES=0 is invalid"):
        _ext.ops().config_string()


@pytest.mark.parametrize("text,kind,message", [
    ("[TypeError] yali: all_reduce supports float32, float16 and bfloat16, not Int",
     TypeError, "yali: all_reduce supports float32, float16 and bfloat16, not Int"),
    ("[ValueError] yali: device 9 does not exist (2 visible)", ValueError, "yali: device 9 does not exist (2 visible)"),
    ("yali: all_reduce launch failed: invalid argument", RuntimeError, "yali: all_reduce launch failed: invalid argument"),
])
def test_remap(text, kind, message):
    e = _ext.remap(RuntimeError(text))
    assert type(e) is kind and str(e) == message


def test_untagged_errors_stay_runtime_errors():
    with pytest.raises(RuntimeError, match="is not open"):
        _ext.ops().buffer_bytes(12345)


def test_load_failure_names_the_build_and_the_running_torch(tmp_path):
    lib = tmp_path / "_C.abi3.so"
    lib.write_bytes(b"\x7fELF junk yali-vllm build: torch 2.14.0+cu130 headers, stable ABI target 2.11\x00 more")
    msg = _ext.load_error_message(str(lib), OSError(f"{lib}: undefined symbol: aoti_torch_new_thing"))
    assert "undefined symbol: aoti_torch_new_thing" in msg
    assert "torch 2.14.0+cu130 headers, stable ABI target 2.11" in msg
    assert f"torch {torch.__version__} is running" in msg
    assert "rebuild" in msg


def test_load_failure_of_a_file_without_a_build_record(tmp_path):
    lib = tmp_path / "_C.abi3.so"
    lib.write_bytes(b"not a library")
    msg = _ext.load_error_message(str(lib), OSError("invalid ELF header"))
    assert "build information not found" in msg and "invalid ELF header" in msg
