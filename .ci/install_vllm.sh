#!/usr/bin/env bash
# CI only: installs vLLM VERSION into the virtual environment VENV from the package index
# CI reaches, which lacks certifi >= 2026.10.19 (vLLM 0.33.0 requires it; the newest there
# is 2026.10.18). vLLM's own requirements are installed with that one pin relaxed to any
# certifi, then vLLM itself without dependencies; `pip check` must then report nothing but
# that pin. Users install with the plain `pip install vllm==VERSION` (README).
#   .ci/install_vllm.sh VENV VERSION
set -euo pipefail
venv=$1 version=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" -m pip download -q --no-deps -d "$work" "vllm==$version"
"$venv/bin/python" - "$work" <<'PY'
import glob, sys, zipfile
from email.parser import Parser
work = sys.argv[1]
whl = glob.glob(f"{work}/vllm-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
reqs = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
relaxed = [("certifi" if r.replace(" ", "").startswith("certifi>=") else r) for r in reqs]
changed = [r for r, s in zip(reqs, relaxed) if r != s]
print(f"[ci] vLLM's requirements: {len(reqs)}, relaxed: {changed or 'none'}")
open(f"{work}/requirements.txt", "w").write("\n".join(relaxed) + "\n")
PY
"$venv/bin/python" -m pip install -q -r "$work/requirements.txt"
"$venv/bin/python" -m pip install -q --no-deps "$work"/vllm-*.whl
if ! problems=$("$venv/bin/python" -m pip check 2>&1); then
  others=$(printf '%s\n' "$problems" | grep -v "has requirement certifi" || true)
  if [ -n "$others" ]; then
    printf '[ci] pip check found more than the relaxed certifi pin:\n%s\n' "$others" >&2
    exit 1
  fi
fi
echo "[ci] vLLM $version installed in $venv"
