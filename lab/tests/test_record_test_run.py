"""lab/record_test_run.py on a real pytest run: one row per test with its outcome, and what a
test recorded with record_property (the GPU end-to-end tests record where two runs diverged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CASES = '''
def test_records_a_divergence(record_property):
    record_property("near-tie divergences (prompt, position, gap), a vs b", [(1, 4, 0.0078)])

def test_fails():
    assert 1 == 2, "one is not two"
'''


def test_rows_carry_outcomes_and_recorded_properties(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    out = tmp_path / "run.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "lab" / "record_test_run.py"), "--out", str(out), "--",
                           "-q", "-p", "no:cacheprovider", str(tmp_path / "test_cases.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # pytest's exit code: a test failed
    run = json.loads(out.read_text())
    assert (run["kind"], run["passed"], run["failed"]) == ("gpu-test-run", 1, 1)
    rows = {r["test"].rsplit("::", 1)[1]: r for r in run["records"]}
    assert rows["test_records_a_divergence"]["outcome"] == "passed"
    assert rows["test_records_a_divergence"]["properties"] == {
        "near-tie divergences (prompt, position, gap), a vs b": "[(1, 4, 0.0078)]"}
    assert rows["test_fails"]["outcome"] == "failed" and "one is not two" in rows["test_fails"]["message"]
    assert "properties" not in rows["test_fails"]
