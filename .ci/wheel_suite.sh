#!/usr/bin/env bash
# CI: the CPU suite against the installed binary wheel, as a user without a CUDA compiler has it.
#   .ci/wheel_suite.sh VENV   (VENV has vLLM and dist/yali_vllm-*.whl[test] installed)
# The tests run from a copy of the checkout's tracked files without yali_vllm/, so `import
# yali_vllm` finds the installed package, with every directory that holds nvcc taken off PATH
# and CUDA_HOME unset.
set -euo pipefail
venv=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
git -C "$root" ls-files -z | grep -zv '^yali_vllm/' | (cd "$root" && xargs -0 cp --parents -t "$copy")
no_nvcc_path=$(printf '%s' "$PATH" | tr ':' '\n' | while read -r d; do [ -x "$d/nvcc" ] || printf '%s\n' "$d"; done | paste -sd:)
cd "$copy"
env -u CUDA_HOME PATH="$venv/bin:$no_nvcc_path" "$venv/bin/python" - <<'PY'
import shutil, yali_vllm, yali_vllm._ext as e, torch
assert shutil.which("nvcc") is None, shutil.which("nvcc")
assert "site-packages" in yali_vllm.__file__, yali_vllm.__file__
assert e.library_error() is None, e.library_error()
print("[ci] wheel: yali_vllm from", yali_vllm.__file__, "| torch", torch.__version__, "|", torch.ops.yali.build_info())
PY
env -u CUDA_HOME PATH="$venv/bin:$no_nvcc_path" "$venv/bin/pytest" -q -p no:cacheprovider tests
