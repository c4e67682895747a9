#!/usr/bin/env bash
# Do the kernels of the working tree compile to the same machine code as those of REV?
#   scripts/same_kernels.sh [REV]        (default HEAD)
# Compiles csrc/core/yali/rank.cu (every kernel lives in it) of REV and of the working tree for
# sm_90a and diffs the SASS of all functions, with the anonymous-namespace hash (which depends on
# the file's contents) masked. Exit 0: identical, so a refactor needs no new GPU run; 1: differ.
# Needs nvcc, and cuobjdump from the CUDA toolkit or from triton's bundled copy.
set -euo pipefail
rev="${1:-HEAD}"
root="$(git rev-parse --show-toplevel)"
cuobjdump="$(command -v cuobjdump || true)"
if [ -z "$cuobjdump" ]; then
  cuobjdump="$(python3 -c 'import pathlib, triton; print(pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump")' 2>/dev/null || true)"
fi
[ -x "$cuobjdump" ] || { echo "same_kernels: no cuobjdump (CUDA toolkit or triton)" >&2; exit 2; }
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
git -C "$root" archive "$rev" csrc | tar -x -C "$tmp"
sass() {  # $1: tree with csrc/, $2: output
  nvcc -O3 -std=c++17 -arch=sm_90a -cubin -I "$1/csrc/core" -o "$2.cubin" "$1/csrc/core/yali/rank.cu"
  "$cuobjdump" -sass "$2.cubin" 2>/dev/null | sed 's/_GLOBAL__N__[0-9a-f]*_/_GLOBAL__N_/' > "$2.sass"
}
sass "$tmp" "$tmp/rev" & p1=$!
sass "$root" "$tmp/tree" & p2=$!
wait "$p1"; wait "$p2"  # either failing stops the script (set -e)
n="$(grep -c 'Function :' "$tmp/tree.sass")"
if diff -q "$tmp/rev.sass" "$tmp/tree.sass" > /dev/null; then
  echo "same_kernels: the $n functions of the working tree compile to the same SASS as $rev"
else
  echo "same_kernels: SASS differs from $rev:"; diff "$tmp/rev.sass" "$tmp/tree.sass" | head -40; exit 1
fi
