# Sourced by the GPU-host scripts from the checkout's root: multicast off (the settings of
# benchmarks/common/gpu_env.py, set again after the stack's own environment), unbuffered output,
# and the offline vLLM stack plus this checkout (with its prebuilt extension) on the path.
MULTICAST_OFF="$(python3 -m benchmarks.common.gpu_env)" || { echo "env.sh: no multicast-off settings" >&2; return 1; }
eval "$MULTICAST_OFF"
export PYTHONUNBUFFERED=1
if [ -f /opt/gpu-stack/env.sh ]; then . /opt/gpu-stack/env.sh; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
eval "$MULTICAST_OFF"
OUT="${OUT:-${TMPDIR:-/tmp}/yali-out-$(id -u)}"; mkdir -p "$OUT"
# TP: the benchmarks' ranks (--world-size), one GPU each, and the servers' tensor-parallel size:
# 2 (default), 4, 6 or 8 (the benchmarks refuse any other). Result names carry -tpN when N is not 2.
TP="${TP:-2}"
TP_TAG=""; [ "$TP" = 2 ] || TP_TAG="-tp$TP"
# The checkout is used in place (no pip install on the offline host): give vLLM's
# processes the package metadata that carries the vllm.general_plugins entry point.
PKG_VERSION="$(sed -n 's/^__version__ = "\(.*\)"/\1/p' yali_vllm/_version.py)"
META_ROOT="${TMPDIR:-/tmp}/yali-meta-$(id -u)"   # per user: it goes first on PYTHONPATH
META="$META_ROOT/yali_vllm-$PKG_VERSION.dist-info"
mkdir -p "$META"
printf 'Metadata-Version: 2.1\nName: yali-vllm\nVersion: %s\n' "$PKG_VERSION" > "$META/METADATA"
printf '[vllm.general_plugins]\nyali = yali_vllm.plugin:register\n\n[console_scripts]\nyali-vllm-model = yali_vllm.models:main\n' > "$META/entry_points.txt"
export PYTHONPATH="$META_ROOT:$PYTHONPATH"
