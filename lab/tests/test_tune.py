"""lab/tune.py's variant selection per world size (CPU only)."""
import pytest

from lab import tune


def test_default_variants_follow_the_world_size():
    two = tune.variant_names("", 2)
    eight = tune.variant_names("", 8)
    assert "push-cta1K" in two and not any(n.startswith("ranks-") for n in two)
    assert eight == tune.RANKS and {"ranks-oneshot", "ranks-twoshot", "ranks-default"} <= set(eight)


def test_rounds_and_lists():
    assert tune.variant_names("round5", 2) == tune.ROUND5
    assert tune.variant_names("ranks", 4) == tune.RANKS
    assert tune.variant_names("push-pdl, stream-pdl", 2) == ["push-pdl", "stream-pdl"]


@pytest.mark.parametrize("spec, world, fragment", [
    ("no-such", 2, "unknown variant(s) ['no-such']"),
    ("ranks", 2, "need --world-size 4, 6 or 8"),
    ("push-pdl", 8, "do not run at --world-size 8"),
])
def test_bad_selections_are_refused_by_name(spec, world, fragment):
    with pytest.raises(SystemExit) as e:
        tune.variant_names(spec, world)
    assert fragment in str(e.value)


def test_n_rank_variants_move_only_the_n_rank_knobs():
    for name in tune.RANKS:
        env, mode, sizes = tune.VARIANTS[name]
        assert set(env) <= {"YALI_DEV_RANKS_ONESHOT_MAX", "YALI_DEV_PUSH_CTA_BYTES"} and mode == "auto"
        assert sizes.split(",")[-1] == "8M"  # the N-rank limit at every world size (16 MiB at 4 ranks)
