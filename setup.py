"""Build of yali-vllm's CUDA extension (csrc/) as one library, yali_vllm/_C.abi3.so.

The torch op layer (csrc/bindings) uses torch's stable C ABI only, targeting torch
2.11 (TORCH_TARGET_VERSION): the library imports no C++ symbol of torch and no
Python symbol, so one build loads in every supported torch (2.11 through 2.14) and
every Python. It is compiled against whatever torch is installed (pip's
--no-build-isolation), which must be 2.11 or newer.
Hopper: TORCH_CUDA_ARCH_LIST defaults to 9.0a (sm_90a).

YALI_BUILD_TESTING=1 also builds the test-only kernels (csrc/testing) as a library of their own,
tests/gpu/yali_testing.abi3.so (torch.ops.yali_testing), which some GPU tests launch:
    YALI_BUILD_TESTING=1 python setup.py build_ext --inplace
It lies outside the package, so no wheel ever holds it.
"""
import glob
import os

from setuptools import setup

os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
# torch finds the toolkit from CUDA_HOME or from `nvcc` on PATH; where PATH holds a
# wrapper outside the toolkit, point it at the standard install instead.
if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"
import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CUDAExtension  # noqa: E402

# The oldest torch whose stable ABI the library uses (major << 56 | minor << 48).
TARGET = (2, 11)
_built_against = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if _built_against < TARGET:
    raise SystemExit(f"yali-vllm builds against torch >= {TARGET[0]}.{TARGET[1]}; torch {torch.__version__} is installed")

# The core (csrc/core/yali: common/, one folder per op, the communicator), then the torch op layer.
sources = sorted(
    glob.glob("csrc/core/yali/**/*.cu", recursive=True) + glob.glob("csrc/core/yali/**/*.cpp", recursive=True)
) + ["csrc/bindings/torch_ops.cpp"]
defines = [
    f"-DTORCH_TARGET_VERSION=0x{TARGET[0]:02x}{TARGET[1]:02x}000000000000ULL",
    "-DUSE_CUDA",
    f'-DYALI_BUILD_TORCH="{torch.__version__}"',
    f'-DYALI_TORCH_TARGET="{TARGET[0]}.{TARGET[1]}"',
]


def extension(name: str, ext_sources: list[str]) -> CUDAExtension:
    return CUDAExtension(
        name=name,
        sources=ext_sources,
        include_dirs=[os.path.abspath("csrc/core"), os.path.abspath("csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++20", *defines], "nvcc": ["-O3", "-std=c++17"]},
        py_limited_api=True,
    )


def build_testing() -> bool:
    value = os.environ.get("YALI_BUILD_TESTING", "0")
    if value not in ("0", "1"):
        raise SystemExit(f"YALI_BUILD_TESTING={value!r}: 1 builds the test-only kernels as well, 0 (default) does not")
    return value == "1"


extensions = [extension("yali_vllm._C", sources)]
if build_testing():  # the test-only kernels: tests/gpu/yali_testing.abi3.so, outside the package
    extensions.append(extension("tests.gpu.yali_testing", ["csrc/testing/testing.cu", "csrc/testing/testing_ops.cpp"]))

setup(
    ext_modules=extensions,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},  # requires-python >= 3.10
)
