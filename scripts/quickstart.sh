#!/usr/bin/env bash
# Sets up yali-vllm in .venv and runs the main job (examples/serve_demo.py):
#   vLLM 0.33.0 (with the torch 2.14.0 it pins) + this package, whose CUDA extension is
#   built here with nvcc for sm_90a against that torch's stable ABI; then the embedded
#   dummy model is served with `vllm serve --tensor-parallel-size 2` and the YALI plugin,
#   and one completion request is sent. On a machine without 2 GPUs it stops after the
#   set-up and says so.
#   YALI_VLLM_VERSION=0.26.0 (any release 0.26.0 .. 0.33.x) sets up another vLLM; a .venv
#   that already has that vLLM keeps it (and its torch) as it is.
#   YALI_SKIP_INSTALL=1 uses the current Python environment (e.g. an offline GPU host
#   that already has torch and vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off in everything started from here (benchmarks/common/gpu_env.py).
MULTICAST_OFF="$("${PYTHON:-python3}" -m benchmarks.common.gpu_env)"
eval "$MULTICAST_OFF"
VLLM_VERSION="${YALI_VLLM_VERSION:-0.33.0}"
SKIP_INSTALL="${YALI_SKIP_INSTALL:-0}"
# This script's own variables, not yali-vllm settings: the plugin refuses unknown YALI_* names.
unset YALI_VLLM_VERSION YALI_SKIP_INSTALL
if [ "$SKIP_INSTALL" != 1 ]; then
  [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
  . .venv/bin/activate
  python -m pip install -q --upgrade pip
  if python -c "import sys, importlib.metadata as m; sys.exit(m.version('vllm') != '$VLLM_VERSION')" 2>/dev/null; then
    echo "[quickstart] vLLM $VLLM_VERSION is already installed in .venv: kept as it is"
  else
    python -m pip install -q "vllm==$VLLM_VERSION"   # brings the torch it pins
  fi
  python -m pip install -q setuptools wheel ninja
  # Built against the installed torch; pip leaves vLLM's torch alone (yali-vllm accepts 2.11-2.14).
  python -m pip install -q --no-build-isolation -e ".[bench,test]"
fi
# The example needs the installed package only: run as a script, it imports nothing else of this tree.
python examples/serve_demo.py "$@"
