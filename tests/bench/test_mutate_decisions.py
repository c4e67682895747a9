"""scripts/mutate_decisions.py's mutation list still applies to the code: each mutation's original
text occurs exactly once in its file (a changed line would otherwise drop the mutation unseen), and
the tests each one runs exist."""
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mutate_decisions", REPO / "scripts" / "mutate_decisions.py")
mutate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutate)


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
