#!/usr/bin/env bash
# CI: the CPU suite against the installed binary wheel, as a user without a CUDA compiler has it.
#   .ci/wheel_suite.sh VENV   (VENV has vLLM and dist/yali_vllm-*.whl[test] installed)
# The tests run from a copy of the checkout's tracked files whose yali_vllm/ lacks its __init__.py:
# that directory is then no regular package, so `import yali_vllm` finds the installed one (a
# regular package later on sys.path wins over a namespace portion), while the tests that check
# the checkout's files (the Dockerfile's COPY sources) still find them. Every directory that
# holds nvcc is taken off PATH and CUDA_HOME is unset.
set -euo pipefail
venv=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
git -C "$root" ls-files -z | (cd "$root" && xargs -0 cp --parents -t "$copy")
rm "$copy/yali_vllm/__init__.py"
no_nvcc_path=$(printf '%s' "$PATH" | tr ':' '\n' | while read -r d; do [ -x "$d/nvcc" ] || printf '%s\n' "$d"; done | paste -sd:)
cd "$copy"
env -u CUDA_HOME PATH="$venv/bin:$no_nvcc_path" "$venv/bin/python" - <<'PY'
import shutil, yali_vllm, yali_vllm._ext as e, torch
assert shutil.which("nvcc") is None, shutil.which("nvcc")
assert "site-packages" in yali_vllm.__file__, yali_vllm.__file__
assert e.library_error() is None, e.library_error()
import os
assert not [f for f in os.listdir(os.path.dirname(yali_vllm.__file__)) if "testing" in f], "test-only kernels in the wheel"
print("[ci] wheel: yali_vllm from", yali_vllm.__file__, "| torch", torch.__version__, "|", torch.ops.yali.build_info())
PY
env -u CUDA_HOME PATH="$venv/bin:$no_nvcc_path" "$venv/bin/pytest" -q -p no:cacheprovider  # pyproject.toml's testpaths: tests/, lab/tests/
