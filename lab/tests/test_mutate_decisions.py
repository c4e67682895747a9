"""lab/mutate_decisions.py's mutation list still applies to the code: each mutation's original
text occurs exactly once in its file (a changed line would otherwise drop the mutation unseen), and
the tests each one runs exist."""
import json
from pathlib import Path

import pytest

from lab import mutate_decisions as mutate

REPO = Path(__file__).resolve().parents[2]


def test_the_list_is_long_and_its_names_unique():
    names = [m.name for m in mutate.MUTATIONS]
    assert len(names) >= 35 and len(set(names)) == len(names)


@pytest.mark.parametrize("m", mutate.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_applies_once(m):
    mutated = mutate.check_applies(m)
    assert mutated != (REPO / m.file).read_text()
    files = [a for a in m.tests if a.endswith(".py")]
    assert files and all((REPO / f).is_file() for f in files), m.tests


def test_a_stale_mutation_is_refused(tmp_path):
    (tmp_path / "x.py").write_text("a = 1\na = 1\n")
    stale = mutate.Mutation("twice", "x.py", "a = 1", "a = 2", ("x.py",))
    with pytest.raises(ValueError, match="occurs 2 times"):
        mutate.check_applies(stale, tmp_path)


def test_first_failure_names_the_test():
    out = "..F\nFAILED tests/core/a.py::test_b[2] - AssertionError\nERROR tests/c.py::d\n"
    assert mutate.first_failure(out) == "tests/core/a.py::test_b[2]"
    spaced = "FAILED tests/plugin/r.py::test_route[static FP8-True-flashinfer] - AssertionError: x - y\n"
    assert mutate.first_failure(spaced) == "tests/plugin/r.py::test_route[static FP8-True-flashinfer]"
    assert mutate.first_failure("ERROR tests/c.py::d\n") == "tests/c.py::d"


def test_an_update_keeps_the_earlier_rows_not_run_again_with_their_commits(tmp_path):
    first, second, gone = mutate.MUTATIONS[0].name, mutate.MUTATIONS[1].name, "no-longer-listed"
    old = {"versions": {"git": "abc1234"},
           "records": [{"mutation": first, "result": "killed"}, {"mutation": second, "result": "killed"},
                       {"mutation": gone, "result": "killed"}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert mutate.kept_rows(str(tmp_path / "old.json"), {second}) == [
        {"mutation": first, "result": "killed", "commit": "abc1234"}]


def test_the_script_runs_as_a_module_and_refuses_an_unknown_name():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "lab.mutate_decisions", "--out", "/dev/null", "--only", "no-such"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown mutation(s): ['no-such']" in r.stderr, r.stderr
