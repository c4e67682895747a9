#!/usr/bin/env python3
"""Runs pytest and records the run as a `gpu-test-run` result file (one row per
test: node id, outcome, duration, and what it recorded with pytest's record_property), with the
usual header (command, date, host, versions). Exits with pytest's exit code.

  python -m lab.record_test_run --out /tmp/yali-results/gpu-tests-<date>.json -- tests/gpu -q
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

from benchmarks.common.gpu_env import child_env
from benchmarks.common.results import results_header, write_results


def rows_from_junit(path: str) -> list[dict]:
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):  # the empty case pytest leaves in the report of an interrupted run
            continue
        node = f"{case.get('file') or case.get('classname', '').replace('.', '/') + '.py'}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        row = {"test": node, "outcome": outcome, "duration_s": round(float(case.get("time", 0)), 2)}
        props = {p.get("name"): p.get("value") for c in case if c.tag == "properties" for p in c}
        if props:  # what a test recorded with pytest's record_property, e.g. which runs diverged where
            row["properties"] = props
        msg = [c.get("message") for c in case if c.tag in ("failure", "error", "skipped")]
        if msg and msg[0]:
            row["message"] = msg[0][:500]
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="result JSON path")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="arguments after -- go to pytest")
    args = ap.parse_args()
    pargs = [a for a in args.pytest_args if a != "--"]
    env = child_env()
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "junit.xml")
        rc = subprocess.call([sys.executable, "-m", "pytest", f"--junitxml={junit}", "-o", "junit_family=xunit1",
                              *pargs], env=env)
        rows = rows_from_junit(junit) if os.path.exists(junit) else []
    hdr = results_header("gpu-test-run", {
        "pytest_args": pargs, "exit_code": rc,
        "passed": sum(r["outcome"] == "passed" for r in rows),
        "failed": sum(r["outcome"] == "failed" for r in rows),
        "skipped": sum(r["outcome"] == "skipped" for r in rows),
    })
    hdr["records"] = rows
    write_results(args.out, hdr)
    print(f"recorded {len(rows)} tests ({hdr['passed']} passed, {hdr['failed']} failed, {hdr['skipped']} skipped) "
          f"in {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
