"""Build of yali-vllm's CUDA extension (csrc/) as one abi3 library, yali_vllm/_C.abi3.so.

The library registers torch ops with TORCH_LIBRARY only (no pybind), so it does
not depend on the Python version, only on the torch it was built against.
Hopper: TORCH_CUDA_ARCH_LIST defaults to 9.0a (sm_90a).
"""
import glob
import os

from setuptools import setup

os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
# torch finds the toolkit from CUDA_HOME or from `nvcc` on PATH; where PATH holds a
# wrapper outside the toolkit, point it at the standard install instead.
if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"
from torch.utils.cpp_extension import BuildExtension, CUDAExtension  # noqa: E402

sources = sorted(glob.glob("csrc/core/yali/*.cu") + glob.glob("csrc/core/yali/*.cpp")) + [
    "csrc/bindings/torch_ops.cpp"
]

setup(
    ext_modules=[
        CUDAExtension(
            name="yali_vllm._C",
            sources=sources,
            include_dirs=[os.path.abspath("csrc/core")],
            extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": ["-O3", "-std=c++17"]},
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
