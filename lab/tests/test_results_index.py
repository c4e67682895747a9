"""lab/results/README.md is what lab/results_index.py writes from index.json and the run
directories: a run added, moved or removed without regenerating the index fails here."""
import glob
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "lab" / "results"


def test_committed_results_index_is_generated():
    r = subprocess.run([sys.executable, str(REPO / "lab" / "results_index.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_index_names_the_commit_of_every_current_file():
    # `code` of a run under current/ lists every commit its files' versions.git names
    runs = json.loads((RESULTS / "index.json").read_text())["runs"]
    missing = []
    for run in (r for r in runs if r["dir"].startswith("current/")):
        for path in sorted(glob.glob(str(RESULTS / run["dir"] / "**" / "*.json"), recursive=True)):
            commit = json.loads(Path(path).read_text())["versions"]["git"]
            if commit[:7] not in (run["code"] or ""):
                missing.append((run["dir"], commit))
    assert missing == []
