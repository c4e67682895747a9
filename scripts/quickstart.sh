#!/usr/bin/env bash
# Sets up yali-vllm in .venv and runs the main job (benchmarks/serve_demo.py):
#   torch 2.11.0 (CUDA 13 build) + vLLM 0.26.0 + this package, whose CUDA extension
#   is built here with nvcc for sm_90a; then the embedded dummy model is served
#   with `vllm serve --tensor-parallel-size 2` and the YALI plugin, and one
#   completion request is sent. On a machine without 2 GPUs it stops after the
#   set-up and says so. YALI_SKIP_INSTALL=1 uses the current Python environment
#   (e.g. an offline GPU host that already has torch and vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off in everything started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm
if [ "${YALI_SKIP_INSTALL:-0}" != 1 ]; then
  [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
  . .venv/bin/activate
  python -m pip install -q --upgrade pip
  python -m pip install -q torch==2.11.0 setuptools wheel ninja
  python -m pip install -q --no-build-isolation -e ".[vllm,bench,test]"
fi
python benchmarks/serve_demo.py "$@"
