#!/usr/bin/env python3
"""Mutation run over YALI's Python decision code: each named mutation applied to a copy of the tree, its CPU tests run, killed or survived.

Each mutation (MUTATIONS) replaces one text, found exactly once in its file, by another: a flipped
boundary, a dropped condition, a skipped exchange of outcomes between ranks, a changed default.
The tree (tracked and untracked files, the built library) is copied once to a temporary directory;
each mutation is applied there alone and the CPU test files it names run (pytest -x, bounded): a
failure or a run past the bound kills it, a pass means it survived. One run at a time. Writes a
result file (kind gpu-test-run: one row per mutation, outcome "failed" when the tests killed it,
and the commit the row was measured at). Run from the repository root:

  python -m lab.mutate_decisions --out /tmp/mutations.json            # every mutation
  python -m lab.mutate_decisions --out /tmp/m.json --only flash-cap   # some, by name
  python -m lab.mutate_decisions --out /tmp/m.json --only flash-cap --update old.json
      # old.json's rows of the mutations still listed and not run now, with their commits, and the new rows
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from benchmarks.common.results import git_commit, results_header, write_results

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 420

LIVE = "tests/core/test_live_communicator_cpu.py"
SETUP = "tests/plugin/test_live_setup_cpu.py"
COMM = "tests/core/test_communicator_cpu.py"
CLOSE = "tests/core/test_close_cpu.py"
PLUGIN = "tests/plugin/test_vllm_plugin.py"
EP = "tests/plugin/test_ep_plugin.py"
FUSION = "tests/plugin/test_vllm_fusion.py"
ROUTING = "tests/plugin/test_fusion_routing.py"
OVERLAP = "tests/core/test_overlap_cpu.py"
ABORT = "tests/core/test_abort_exit_cpu.py"


class Mutation(NamedTuple):
    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]  # pytest arguments: test files, maybe with -k


def kept_rows(path: str, rerun: set[str]) -> list[dict]:
    """The rows of the earlier result file `path` for the mutations still listed that are not in
    `rerun`, each with the commit it was measured at (the file's, where a row names none)."""
    import json

    old = json.loads(Path(path).read_text())
    listed = {m.name for m in MUTATIONS}
    commit = old.get("versions", {}).get("git")
    return [{**r, "commit": r.get("commit", commit)} for r in old["records"]
            if r["mutation"] in listed and r["mutation"] not in rerun]


C, CFG, GATE = "yali_vllm/communicator.py", "yali_vllm/config.py", "yali_vllm/plugin/gate.py"
DEF = "yali_vllm/settings.def"  # the package's copy of the settings list (the C++ core's is built in)
GS, EPM, COLL, FP, VF, FR = ("yali_vllm/plugin/group_setup.py", "yali_vllm/plugin/ep_manager.py",
                             "yali_vllm/plugin/collective.py", "yali_vllm/plugin/fusion_patch.py",
                             "yali_vllm/vllm_fusion.py", "yali_vllm/fusion_routing.py")
_RANKS = '''    results = all_gather((yc is not None, why), comm.cpu_group)'''
_PARTLY = "return ranges_overlap(x, nx, y, ny) and not (x == y and nx == ny)"

MUTATIONS = (
    # ---- communicator.py: the serve limit, should_use, can_fuse, the EP checks
    Mutation("serve-limit-ignores-the-table", C, 'return min(max_bytes, int(table["limits"]["serve_max"]))',
             "return max_bytes", (LIVE,)),
    Mutation("serve-limit-ignores-max-bytes", C, 'return min(max_bytes, int(table["limits"]["serve_max"]))',
             'return int(table["limits"]["serve_max"])', (LIVE,)),
    Mutation("max-bytes-argument-ignored", C,
             'self.max_bytes = int(self.config["max_bytes"] if max_bytes is None else min(max_bytes, self.config["max_bytes"]))',
             'self.max_bytes = int(self.config["max_bytes"])', (LIVE,)),
    Mutation("serve-limit-exclusive", C, "and 0 < nbytes <= limit_bytes", "and 0 < nbytes < limit_bytes", (LIVE,)),
    Mutation("empty-message-served", C, "and 0 < nbytes <= limit_bytes", "and 0 <= nbytes <= limit_bytes", (LIVE,)),
    Mutation("non-contiguous-served", C, "        and x.is_contiguous()\n    )", "    )", (LIVE,)),
    Mutation("gradient-served", C, "and not x.requires_grad", "and True", (LIVE,)),
    Mutation("fused-rows-of-8-bytes", C, "if row_bytes % 16 != 0 or row_bytes > self.table",
             "if row_bytes % 8 != 0 or row_bytes > self.table", (LIVE,)),
    Mutation("fused-longest-row-plus-16", C, 'row_bytes > self.table["limits"]["fused_max_row_bytes"]:',
             'row_bytes > self.table["limits"]["fused_max_row_bytes"] + 16:', (LIVE,)),
    Mutation("fused-weight-dtype-unchecked", C, "weight.shape != (hidden,) or weight.dtype != out.dtype",
             "weight.shape != (hidden,)", (LIVE,)),
    Mutation("fused-residual-layout-unchecked", C, "residual.device == self.device\n            and residual.is_contiguous()",
             "residual.device == self.device", (LIVE,)),
    Mutation("stream-mode-at-n-ranks", C, 'if self.world_size > 2 and self.config["mode"] == "stream":', "if False:",
             (LIVE,)),
    Mutation("ep-nine-tensors", C, 'if not 1 <= len(tensors) <= self.table["limits"]["ep_max_parts"]:',
             'if not 1 <= len(tensors) <= self.table["limits"]["ep_max_parts"] + 1:', (LIVE,)),
    Mutation("ep-counts-length-unchecked", C,
             "len(counts) != self.world_size:\n            return False\n        if not 1 <= len(tensors)",
             "False:\n            return False\n        if not 1 <= len(tensors)", (LIVE,)),
    Mutation("ep-token-count-not-raised", C, "if t.shape[0] != counts[self.rank] or t.device != self.device:",
             "if False:", (LIVE,)),
    Mutation("ep-row-bytes-without-element-size", C, "    n = t.element_size()\n    for d in t.shape[1:]:",
             "    n = 1\n    for d in t.shape[1:]:", (LIVE,)),
    Mutation("ep-dispatch-rows-of-this-rank", C, "        total = sum(int(c) for c in counts)\n        ins =",
             "        total = int(counts[self.rank]) * self.world_size\n        ins =", (LIVE,)),
    Mutation("ep-combine-into-its-input", C, "and not _overlap(out, src))", ")", (LIVE,)),
    Mutation("overlap-of-adjacent-tensors", C, "x < y + ny and y < x + nx", "x <= y + ny and y <= x + nx",
             (LIVE, "-k", "overlap")),
    Mutation("all-reduce-in-place-refused", C, _PARTLY, "return ranges_overlap(x, nx, y, ny)", (OVERLAP,)),
    Mutation("all-reduce-out-from-the-same-start-served", C, _PARTLY,
             "return ranges_overlap(x, nx, y, ny) and not x == y", (OVERLAP,)),
    Mutation("ep-combine-rows-unchecked", C, "return x.shape[0] == sum(counts) and self.ep_serves_rows",
             "return self.ep_serves_rows", (LIVE,)),
    Mutation("ep-rows-dtype-unchecked", C,
             "if dtype not in SUPPORTED_DTYPES:\n            return False\n        return bool(_ext.ops().ep_serves_combine",
             "if False:\n            return False\n        return bool(_ext.ops().ep_serves_combine", (LIVE,)),
    # ---- communicator.py: the exchanges of outcomes at start-up and close
    Mutation("no-exchange-after-mapping", C, "            self._exchange(opened)  # every rank",
             "            pass  # every rank", (COMM, "-k", "stand_in or failing")),
    Mutation("exchange-ignores-errors", C, '        if errors:\n            raise YaliUnavailable("; ".join(errors))',
             "        if False:\n            pass", (COMM, "-k", "stand_in or failing")),
    Mutation("self-test-agrees-on-max", C, "op=dist.ReduceOp.MIN", "op=dist.ReduceOp.MAX",
             (COMM, "-k", "stand_in or failing")),
    Mutation("settings-not-compared", C, 'if d["config"] != first["config"]:', "if False:",
             (COMM, "-k", "settings")),
    Mutation("failed-rank-skips-close", C, "                join_close(self.group, self.world_size)",
             "                pass", (SETUP,)),
    Mutation("close-keeps-only-when-all-captured", C, "if any(captured):", "if all(captured):", (CLOSE,)),
    # ---- communicator.py: the abort watcher
    Mutation("abort-exit-without-grace", C, "and not raised and now - seen_at >= grace_s",
             "and not raised and now >= seen_at", (ABORT,)),
    Mutation("abort-exit-after-yali-error", C, "and not raised and now - seen_at >= grace_s",
             "and now - seen_at >= grace_s", (ABORT,)),
    # ---- config.py
    Mutation("world-size-6-dropped", CFG, "WORLD_SIZES = (2, 4, 6, 8)", "WORLD_SIZES = (2, 4, 8)", (LIVE,)),
    Mutation("every-world-size-on-by-default", DEF, 'YALI_PLUGIN_SETTING(YALI_WORLD_SIZES, sizes, "2,4",',
             'YALI_PLUGIN_SETTING(YALI_WORLD_SIZES, sizes, "all",', (PLUGIN, "-k", "not ranks")),
    Mutation("flag-default-inverted", CFG,
             "return SETTINGS[name].parse(SETTINGS[name].default) if default is None else default",
             "return not SETTINGS[name].parse(SETTINGS[name].default) if default is None else default",
             (PLUGIN, "-k", "not ranks")),
    Mutation("ep-slot-lowest-refused", CFG, "parse_bytes(s.low) <= n <= parse_bytes(s.high)",
             "parse_bytes(s.low) < n <= parse_bytes(s.high)", (LIVE, "-k", "slot")),
    Mutation("ep-slot-default-halved", DEF, 'YALI_PLUGIN_SETTING(YALI_EP_SLOT_BYTES, bytes, "2M",',
             'YALI_PLUGIN_SETTING(YALI_EP_SLOT_BYTES, bytes, "1M",', (EP, "-k", "not ranks")),
    Mutation("listed-world-size-ignored", CFG, "    if world_size in enabled:\n        return None",
             "    if True:\n        return None", (PLUGIN, "-k", "not ranks")),
    # ---- gate.py
    Mutation("tp-name-by-substring", GATE, 'return unique_name.split(":")[0] == "tp"', 'return "tp" in unique_name',
             (PLUGIN, "-k", "not ranks")),
    Mutation("custom-ar-switch-ignored", GATE, "    if not custom_ar_enabled:", "    if False:", (PLUGIN,)),
    Mutation("batch-invariant-ignored", GATE, "    if batch_invariant:", "    if False:", (PLUGIN, "-k", "not ranks")),
    Mutation("no-p2p-ignored", GATE, "    if p2p is False:", "    if False:", (PLUGIN, "-k", "not ranks")),
    Mutation("ep-other-dp-group-served", GATE, "if dp_world_size != world_size or not same_ranks:",
             "if dp_world_size != world_size:", (EP,)),
    Mutation("ep-on-by-default", GATE, '    if not enabled:\n        return False, "off: YALI_EP=1',
             '    if False:\n        return False, "off: YALI_EP=1', (EP,)),
    # ---- group_setup.py
    Mutation("tp-outcomes-not-exchanged", GS, _RANKS,
             "    results = [(yc is not None, why)] * int(comm.world_size)", (SETUP,)),
    Mutation("tp-enable-of-rank-0-only", GS, 'all(i["enabled"] for i in infos),\n        custom_ar_enabled',
             'infos[0]["enabled"],\n        custom_ar_enabled', (PLUGIN,)),
    Mutation("fusion-settings-not-compared", GS, "if len(set(fusion)) > 1:", "if False:", (PLUGIN,)),
    Mutation("checkpoint-not-agreed", GS, "captured = any(all_gather(bool(yc.captured), comm.cpu_group))",
             "captured = bool(yc.captured)", (PLUGIN,)),
    Mutation("failure-reason-of-rank-0", GS, "if len(failed) == world_size and len({why for _, why in failed}) == 1:",
             "if len(failed) == world_size:", (PLUGIN, "-k", "not ranks")),
    # ---- ep_manager.py
    Mutation("ep-outcomes-not-exchanged", EPM, _RANKS, "    results = [(yc is not None, why)] * world", (SETUP,)),
    Mutation("ep-dispatch-extras-unlisted", EPM, "return got[0], got[1], got[2], got[3:]",
             "return got[0], got[1], got[2], got[3]", (SETUP,)),
    Mutation("ep-router-logits-extras-unlisted", EPM, "return got[0], got[1], got[2:]",
             "return got[0], got[1], got[2]", (SETUP,)),
    Mutation("ep-sequence-parallel-served", EPM, "if self.yali_comm is None or is_sequence_parallel:",
             "if self.yali_comm is None:", (SETUP,)),
    Mutation("ep-other-group-served", EPM, 'if list(getattr(group, "ranks", [])) != self.yali_ranks:', "if False:",
             (SETUP,)),
    Mutation("ep-slot-sizes-not-compared", EPM, 'if len({i["slot_bytes"] for i in infos}) > 1:', "if False:", (EP,)),
    Mutation("ep-manager-buffer-taken", EPM,
             "if self._yali_serves_shape(shape, dtype, is_sequence_parallel):\n                return None",
             "if False:\n                return None", (SETUP,)),
    # ---- collective.py: what the TP and the EP set-up share
    Mutation("setup-failed-rank-skips-close", COLL, "    elif any(good for good, _ in results):", "    elif False:",
             (SETUP,)),
    # ---- fusion_patch.py, vllm_fusion.py and fusion_routing.py's decisions
    Mutation("fusion-build-failure-raises", FP, "except Exception as e:  # deterministic, so every rank falls back",
             "except ImportError as e:  # deterministic, so every rank falls back", (FUSION, "-k", "falls_back")),
    Mutation("vllm-pass-build-failure-raises", FP, "except Exception as e:  # deterministic, so every rank ends alike",
             "except ImportError as e:  # deterministic, so every rank ends alike", (FUSION, "-k", "factory")),
    Mutation("quantised-model-seen-as-bf16", FP, "return str(method) if method else None", "return None",
             (FUSION, "-k", "factory")),
    Mutation("vllm-pass-built-for-bf16", FP, "flashinfer = _build_quietly(original, config) if quant else None",
             "flashinfer = _build_quietly(original, config)", (FUSION, "-k", "factory")),
    Mutation("fusion-note-ignores-config", FP, "        if not cc.pass_config.fuse_allreduce_rms:\n            return False",
             "        if False:\n            return False", (PLUGIN, "-k", "fusion_note")),
    Mutation("fusion-off-by-default", VF, "return env_flag(FUSION_VAR, True, environ)",
             "return env_flag(FUSION_VAR, False, environ)", (FUSION, "-k", "fusion_flag")),
    Mutation("fusion-without-yali", VF,
             'if getattr(getattr(group, "device_communicator", None), "yali_comm", None) is None:', "if False:",
             (FUSION, "-k", "factory_follows")),
    Mutation("fused-rows-one-more", VF, "return int(limit) // row_bytes", "return int(limit) // row_bytes + 1",
             (FUSION, "-k", "applies_only")),
    Mutation("fused-op-ignores-can-fuse", VF, "if yc is not None and yc.can_fuse(input, residual, weight):",
             "if yc is not None:", (FUSION, "-k", "refuses")),
    Mutation("static-fp8-in-flashinfer-range-to-yali", FR,
             "return FLASHINFER if quant in FLASHINFER_QUANTISES else YALI",
             "return FLASHINFER if quant == NVFP4 else YALI", (ROUTING,)),
    Mutation("quantised-above-flashinfer-to-yali", FR, "else YALI\n    return VLLM", "else YALI\n    return YALI",
             (ROUTING,)),
    Mutation("dynamic-scale-read-as-static", FR, "reduced |= name in _REDUCTIONS", "reduced |= False", (ROUTING,)),
    Mutation("quantisation-past-a-matmul-is-the-norms", FR,
             "if depth >= MAX_DEPTH or name in _BOUNDARIES or name.startswith",
             "if depth >= MAX_DEPTH or name.startswith", (ROUTING,)),
    Mutation("residual-read-as-the-norm-output", FR, "u.target is operator.getitem and u.args[1] == index",
             "u.target is operator.getitem", (ROUTING,)),
)


def copy_tree(dest: Path) -> None:
    """The files git sees (tracked, and untracked ones it does not ignore) and the built library."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    extra = [str(p.relative_to(REPO)) for p in (REPO / "yali_vllm").glob("_C*.so")]
    for rel in [f for f in listed if f] + extra:
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def check_applies(m: Mutation, root: Path = REPO) -> str:
    """The mutated text of m's file; ValueError unless m's original occurs exactly once."""
    text = (root / m.file).read_text()
    n = text.count(m.original)
    if n != 1:
        raise ValueError(f"mutation {m.name}: its original text occurs {n} times in {m.file}, not once")
    if m.replacement == m.original:
        raise ValueError(f"mutation {m.name}: its replacement is its original")
    return text.replace(m.original, m.replacement)


def first_failure(output: str) -> str:
    """The first test pytest -q reports failed or in error ("" when none is named)."""
    found = re.search(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", output, re.M)  # ids may hold spaces
    return found.group(1) if found else ""


def run_tests(root: Path, args: tuple[str, ...], timeout: float) -> tuple[str, str, float]:
    """(outcome, first failing test, seconds): outcome "passed", "failed", "timeout" or "error"
    (pytest could not run them: no test collected, a usage error)."""
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout, env=env,
                           start_new_session=True)
    except subprocess.TimeoutExpired:
        return "timeout", f"no end within {timeout:.0f} s", time.monotonic() - t0
    outcome = {0: "passed", 1: "failed"}.get(r.returncode, "error")
    why = first_failure(r.stdout) if outcome == "failed" else r.stdout[-300:] if outcome == "error" else ""
    return outcome, why, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the result file to write (JSON)")
    ap.add_argument("--only", nargs="*", default=None, help="names of the mutations to run (default: all)")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds each mutation's tests may run")
    ap.add_argument("--update", default=None,
                    help="an earlier result file whose rows of the mutations not run now are kept, with their commits")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.only is None or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        ap.error(f"unknown mutation(s): {sorted(unknown)}")
    for m in chosen:
        check_applies(m)
    rows = []
    commit = git_commit()
    with tempfile.TemporaryDirectory(prefix="yali-mutate-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        for m in chosen:
            original = (root / m.file).read_text()
            (root / m.file).write_text(check_applies(m, root))
            try:
                outcome, why, took = run_tests(root, m.tests, args.timeout)
            finally:
                (root / m.file).write_text(original)
            result = {"passed": "survived", "failed": "killed", "timeout": "killed"}.get(outcome, "error")
            rows.append({"test": m.name, "outcome": "passed" if outcome == "passed" else "failed",
                         "duration_s": round(took, 1), "mutation": m.name, "file": m.file, "result": result,
                         "killed_by": why if result == "killed" else "", "error": why if result == "error" else "",
                         "tests": " ".join(m.tests), "commit": commit})
            print(f"{result:8s} {m.name:45s} {took:6.1f} s  {why[:100]}", flush=True)
    if args.update:
        order = {m.name: i for i, m in enumerate(MUTATIONS)}
        rows = sorted(rows + kept_rows(args.update, {m.name for m in chosen}), key=lambda r: order[r["mutation"]])
    doc = results_header("gpu-test-run", {
        "about": "mutation run over the Python decision code on a CPU (no GPU): a row per mutation, outcome "
                 "'failed' when its CPU tests failed (killed), 'passed' when they passed (survived); "
                 "'commit': the code each row ran on",
        "passed": sum(r["outcome"] == "passed" for r in rows),
        "failed": sum(r["outcome"] == "failed" for r in rows),
        "skipped": 0,
        "killed": sum(r["result"] == "killed" for r in rows),
        "survived": sum(r["result"] == "survived" for r in rows),
        "errors": [r["mutation"] for r in rows if r["result"] == "error"],
        "world_size": 8,  # the largest group the CPU tests simulate
        "world_sizes": [2, 4, 6, 8],
        "shared_gpu": False,
        "records": rows,
    })
    doc["host"] = f"no GPU: {os.cpu_count()} CPUs ({platform.machine()})"
    doc["cpu_only"] = True
    write_results(args.out, doc)
    print(f"{doc['killed']} killed, {doc['survived']} survived, {len(doc['errors'])} errors: {args.out}")
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
