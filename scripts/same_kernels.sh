#!/usr/bin/env bash
# Do the kernels of the working tree compile to the same machine code as those of REV?
#   scripts/same_kernels.sh [REV]        (default HEAD)
# Compiles every .cu file under csrc/ of REV and of the working tree (csrc/core/yali/communicator.cu
# includes the all-reduce and fused kernel headers, ep/ep.cu the expert-parallel ones; csrc/testing
# holds the test-only kernels; a REV from before the per-op folders has every .cu in csrc/core/yali)
# for sm_90a and compares the SASS of every function, with the anonymous-namespace hash (which
# depends on the file's contents) masked. A function of REV is
#   the same     if some function of the tree has its code instruction for instruction;
#   the same but for its parameter offsets  if that holds once each function's kernel-parameter
#                operands (c[0x0][0x210] on) are renamed in the order they are first read and the
#                instruction encodings are dropped: the same instructions on a rearranged argument
#                struct (listed);
#   changed      otherwise (listed). Functions with new code, e.g. an opt-in variant, are listed.
# Exit 0: no function of REV changed, so what the GPU measured on REV still describes the paths that
# run that code; 1: some function of REV changed or is gone.
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
  : > "$2.sass"
  find "$1/csrc" -name '*.cu' | sort | while read -r cu; do
    nvcc -O3 -std=c++17 -arch=sm_90a -cubin -I "$1/csrc/core" -o "$2.cubin" "$cu"
    "$cuobjdump" -sass "$2.cubin" 2>/dev/null | sed 's/_GLOBAL__N__[0-9a-f]*_/_GLOBAL__N_/' >> "$2.sass"
  done
}
sass "$tmp" "$tmp/rev" & p1=$!
sass "$root" "$tmp/tree" & p2=$!
wait "$p1"; wait "$p2"  # either failing stops the script (set -e)
# Compare function bodies: every function of REV must still be there, instruction for instruction
# (under any name: a new defaulted template argument renames it); functions whose code is new are listed.
python3 - "$tmp/rev.sass" "$tmp/tree.sass" "$rev" <<'PY'
import collections, re, subprocess, sys

def functions(path):
    out, name = {}, None
    for line in open(path):
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name:
            out[name].append(line)
    return {n: "".join(b) for n, b in out.items()}

def demangle(names):
    try:
        return subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    except OSError:
        return list(names)

def without_param_offsets(body):
    """The body with its kernel-parameter operands renamed by first use and no encodings."""
    names = {}
    def rename(m):  # kernel parameters start at c[0x0][0x210] on sm_90; lower offsets stay
        off = int(m.group(1), 16)
        return m.group(0) if off < 0x210 else "c[0x0][P%d]" % names.setdefault(off, len(names))
    body = re.sub(r"/\* 0x[0-9a-f]{16} \*/", "", body)
    body = re.sub(r"c\[0x0\]\[(0x[0-9a-f]+)\]", rename, body)
    return re.sub(r"[ \t]+", " ", body)

rev, tree, rev_name = functions(sys.argv[1]), functions(sys.argv[2]), sys.argv[3]
tree_bodies, rev_bodies = collections.Counter(tree.values()), set(rev.values())
tree_loose = collections.Counter(without_param_offsets(b) for b in tree.values())
rev_loose = set(without_param_offsets(b) for b in rev.values())
moved = [n for n, b in rev.items() if tree_bodies[b] == 0 and tree_loose[without_param_offsets(b)] > 0]
gone = [n for n, b in rev.items() if tree_bodies[b] == 0 and tree_loose[without_param_offsets(b)] == 0]
new = [n for n, b in tree.items() if b not in rev_bodies and without_param_offsets(b) not in rev_loose]
print(f"same_kernels: {len(rev) - len(gone) - len(moved)} of the {len(rev)} functions of {rev_name} compile to the "
      f"same SASS in the working tree, {len(moved)} to the same SASS but for their parameter offsets")
for d in demangle(moved)[: len(moved)]:
    print(f"  same but for parameter offsets: {d}")
for d in demangle(new)[: len(new)]:
    print(f"  new code: {d}")
for d in demangle(gone)[: len(gone)]:
    print(f"  CHANGED or removed: {d}")
sys.exit(1 if gone else 0)
PY
