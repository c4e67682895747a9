"""benchmarks/results/README.md is what scripts/results_index.py writes from index.json and the run
directories: a run added, moved or removed without regenerating the index fails here."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_committed_results_index_is_generated():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "results_index.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
