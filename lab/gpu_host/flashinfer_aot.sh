#!/usr/bin/env bash
# FlashInfer's trtllm all-reduce module (the kernels of vLLM's all-reduce + RMSNorm fusion) built
# ahead of time, so that a fresh GPU host skips FlashInfer's JIT build of it (about 300 s there).
#   flashinfer_aot.sh build DIR     on a machine with nvcc and the same FlashInfer as the host's stack
#                                   (the checkout's .venv: flashinfer-python 0.7.2.post1), no GPU needed:
#                                   DIR/trtllm_comm.so for sm_90a (H100 / H200)
#   flashinfer_aot.sh install DIR   on the GPU host after the stack's install.sh: DIR/trtllm_comm.so
#                                   becomes FlashInfer's own AOT artifact (data/aot/trtllm_comm/), which
#                                   FlashInfer loads instead of building; prints whether it loads
set -euo pipefail
verb="${1:-}"; dir="${2:-}"
VERSION_PY='import flashinfer; print(f"flashinfer {flashinfer.__version__}")'  # DIR/VERSION, checked at install
[ -n "$verb" ] && [ -n "$dir" ] || { echo "usage: $0 build|install DIR" >&2; exit 2; }
case "$verb" in
  build)
    PY="${PYTHON:-.venv/bin/python}"
    ws="$(mktemp -d)"; mkdir -p "$dir" "$ws/stub"
    # The link line names -lcuda but the module uses no driver symbol: a machine without a driver
    # links against an empty stub (the host's driver is what loads).
    echo "" | gcc -shared -x c - -Wl,-soname,libcuda.so.1 -o "$ws/stub/libcuda.so"
    # FLASHINFER_CUDA_ARCH_LIST: the build needs no GPU; 9.0a is what the host's H100 / H200 pick
    FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$ws" LIBRARY_PATH="$ws/stub${LIBRARY_PATH:+:$LIBRARY_PATH}" \
      PATH="/usr/local/cuda/bin:$PATH" \
      timeout 3600 "$PY" -c 'from flashinfer.comm.trtllm_ar import get_trtllm_comm_module; get_trtllm_comm_module()'
    so="$(find "$ws/.cache" -name trtllm_comm.so | head -1)"
    [ -n "$so" ] || { echo "flashinfer_aot.sh: no trtllm_comm.so under $ws" >&2; exit 1; }
    cp "$so" "$dir/trtllm_comm.so"
    "$PY" -c "$VERSION_PY" > "$dir/VERSION"
    rm -rf "$ws"; ls -la "$dir"
    ;;
  install)
    . lab/gpu_host/env.sh
    want="$(python3 -c "$VERSION_PY")"
    have="$(cat "$dir/VERSION" 2>/dev/null || echo none)"
    [ "$want" = "$have" ] || { echo "flashinfer_aot.sh: $dir holds a build for '$have', the host has '$want': not installed" >&2; exit 1; }
    aot="$(python3 -c 'from flashinfer.jit import env; print(env.FLASHINFER_AOT_DIR)')/trtllm_comm"
    mkdir -p "$aot" && cp "$dir/trtllm_comm.so" "$aot/trtllm_comm.so"
    timeout 120 python3 -c '
from flashinfer.jit.comm import gen_trtllm_comm_module
from flashinfer.comm.trtllm_ar import get_trtllm_comm_module
assert gen_trtllm_comm_module().is_aot, "FlashInfer does not see the AOT module"
get_trtllm_comm_module()
print("FlashInfer trtllm comm module: ahead-of-time build loaded")'
    ;;
  *) echo "usage: $0 build|install DIR" >&2; exit 2 ;;
esac
