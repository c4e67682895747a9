# Sourced by the GPU-host scripts: multicast off, unbuffered output, and the
# offline vLLM stack plus this checkout (with its prebuilt extension) on the path.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm PYTHONUNBUFFERED=1
if [ -f /opt/gpu-stack/env.sh ]; then . /opt/gpu-stack/env.sh; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-${TMPDIR:-/tmp}/yali-out-$(id -u)}"; mkdir -p "$OUT"
# The checkout is used in place (no pip install on the offline host): give vLLM's
# processes the package metadata that carries the vllm.general_plugins entry point.
YALI_VERSION="$(sed -n 's/^__version__ = "\(.*\)"/\1/p' yali_vllm/_version.py)"
META_ROOT="${TMPDIR:-/tmp}/yali-meta-$(id -u)"   # per user: it goes first on PYTHONPATH
META="$META_ROOT/yali_vllm-$YALI_VERSION.dist-info"
mkdir -p "$META"
printf 'Metadata-Version: 2.1\nName: yali-vllm\nVersion: %s\n' "$YALI_VERSION" > "$META/METADATA"
printf '[vllm.general_plugins]\nyali = yali_vllm.plugin:register\n\n[console_scripts]\nyali-vllm-model = yali_vllm.models:main\n' > "$META/entry_points.txt"
export PYTHONPATH="$META_ROOT:$PYTHONPATH"
