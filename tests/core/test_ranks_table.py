"""CPU tests of the N-rank side of the core (world sizes above 2): the size -> kernel table, the
buffer it allocates, its knobs and their errors, and the world-size checks of the ops and the
communicator. They need the compiled extension, not a GPU."""
import os

import pytest
import torch

from yali_vllm import _ext, config

from .comm_ranks import start_ranks

pytestmark = pytest.mark.skipif(_ext.library_error() is not None, reason=f"extension not built: {_ext.library_error()}")
KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("YALI_"):
            monkeypatch.delenv(k)


@pytest.mark.parametrize("world, oneshot_max, top", [(4, 512 * KiB, 16 * MiB), (6, 256 * KiB, 8 * MiB),
                                                    (8, 256 * KiB, 8 * MiB)])
def test_table_one_shot_then_two_shot_then_the_chain(world, oneshot_max, top):
    assert config.plan(16, world_size=world)[0] == "push-oneshot"
    assert config.plan(oneshot_max, world_size=world) == ("push-oneshot", 128, 0)  # 1 KiB per CTA, at most 128
    assert config.plan(2 * KiB, world_size=world) == ("push-oneshot", 2, 0)
    assert config.plan(oneshot_max + 16, world_size=world)[0] == "push-twoshot"
    assert config.plan(top, world_size=world)[0] == "push-twoshot"
    assert config.plan(top + 16, world_size=world)[0] is None  # vLLM's chain
    assert config.limits(world)["serve_max"] == top
    # two-shot CTAs: 1 KiB of each rank's segment per CTA
    assert config.plan(oneshot_max + 16 * KiB, world_size=world)[1] == min(128, -(-(oneshot_max + 16 * KiB) // world // KiB))


def test_table_is_monotone_per_world():
    order = {"push-oneshot": 0, "push-twoshot": 1, None: 2}
    for world in (3, 4, 5, 6, 7, 8):
        sizes = (16, 4 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 8 * MiB, 9 * MiB, 16 * MiB, 17 * MiB)
        kernels = [config.plan(n, world_size=world)[0] for n in sizes]
        assert [order[k] for k in kernels] == sorted(order[k] for k in kernels), (world, kernels)


def test_two_ranks_keep_their_table():
    assert config.plan(8 * MiB, world_size=2)[0] == "flash-push"
    assert config.plan(8 * MiB + 16, world_size=2)[0] == "stream"


def test_knobs_move_the_boundaries(monkeypatch):
    monkeypatch.setenv("YALI_DEV_RANKS_ONESHOT_MAX", "64K")
    monkeypatch.setenv("YALI_DEV_RANKS_MAX", "1M")
    assert config.plan(64 * KiB, world_size=8)[0] == "push-oneshot"
    assert config.plan(64 * KiB + 16, world_size=8)[0] == "push-twoshot"
    assert config.plan(1 * MiB + 16, world_size=8)[0] is None
    limits = config.limits(8)
    assert (limits["oneshot_max"], limits["serve_max"], limits["slot_bytes"]) == (64 * KiB, 1 * MiB, 128 * KiB)  # 1 MiB / 8


def test_stream_mode_has_no_n_rank_kernel(monkeypatch):
    monkeypatch.setenv("YALI_KERNEL_MODE", "stream")
    assert config.plan(1 * MiB, world_size=4)[0] is None
    monkeypatch.setenv("YALI_KERNEL_MODE", "flash")
    assert config.plan(1 * MiB, world_size=4)[0] == "push-twoshot"


def test_fused_spread_knob(monkeypatch):
    assert config.kernel_config()["ranks_fused_spread"] == 4  # the default (settings.def, plan_table.h)
    monkeypatch.setenv("YALI_DEV_RANKS_FUSED_SPREAD", "0")
    assert config.kernel_config()["ranks_fused_spread"] == 0


def test_fused_rows_spread_over_clusters_while_the_grid_is_at_most_64_ctas(monkeypatch):
    def launch(rows, world=4):
        return config.fused_plan(rows, 8192, torch.bfloat16, world_size=world)

    for rows in (1, 7, 16):  # 4 CTAs a row, one cluster each (current/fused/20261126-tp4-spread)
        l = launch(rows)
        assert (l["one_launch"], l["spread"], l["cluster"], l["grid"]) == (1, 4, 4, 4 * rows), (rows, l)
    assert launch(16, world=8)["spread"] == 4
    for rows in (17, 32, 64):  # past 64 CTAs: whole rows
        assert launch(rows)["spread"] == 1, rows
    assert launch(1, world=2)["spread"] == 1  # two ranks: fused.cuh's kernel
    monkeypatch.setenv("YALI_DEV_RANKS_FUSED_SPREAD", "8")
    assert (launch(8)["spread"], launch(8)["grid"], launch(9)["spread"]) == (8, 64, 1)
    monkeypatch.setenv("YALI_DEV_RANKS_FUSED_SPREAD", "0")
    assert launch(1)["spread"] == 1


@pytest.mark.parametrize("var, value, fragment", [
    ("YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX", "100", "multiple of 4096"),
    ("YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX", "32M", "YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX"),
    ("YALI_DEV_RANKS_FUSED_SPREAD", "3", "0 (off), 2, 4 or 8"),
    ("YALI_DEV_RANKS_FUSED_SPREAD", "16", "YALI_DEV_RANKS_FUSED_SPREAD"),
    ("YALI_DEV_RANKS_MAX", "1000", "YALI_DEV_RANKS_MAX=1000 is invalid"),
    ("YALI_DEV_RANKS_MAX", "128M", "67108864]"),
    ("YALI_DEV_RANKS_ONESHOT_MAX", "32M", "YALI_DEV_RANKS_ONESHOT_MAX"),
    ("YALI_DEV_RANKS_ONESHOT_MAX", "100", "multiple of 4096"),
    ("YALI_DEV_RANKS_TWO_SHOT_ROUND", "4K", "multiple of 8192"),
    ("YALI_DEV_RANKS_TWO_SHOT_ROUND", "32M", "YALI_DEV_RANKS_TWO_SHOT_ROUND"),
])
def test_bad_knobs_name_the_variable(monkeypatch, var, value, fragment):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as e:
        config.kernel_config()
    assert fragment in str(e.value)


@pytest.mark.parametrize("world, top", [(4, 16 * MiB), (6, 8 * MiB), (8, 8 * MiB)])
def test_buffer_is_the_push_area_and_call_slots(world, top):
    # 2 parities x 2 phases x N slots of max(one-shot limit, top / N) (256-byte multiples), and the
    # call slots (2 x N x 16 B in one 256-byte area): about 4 x top, no two-rank area.
    limits = config.limits(world)
    slot = limits["slot_bytes"]
    assert slot == -(-max(limits["oneshot_max"], -(-top // 16 // world) * 16) // 256) * 256
    assert torch.ops.yali.shared_bytes_for_env(world) == 256 + 4 * world * slot
    assert 4 * top <= torch.ops.yali.shared_bytes_for_env(world) <= 4 * top + 8 * KiB


@pytest.mark.parametrize("world", [4, 6, 8])
def test_fused_one_launch_stops_at_512_kib(world, monkeypatch):
    # 32 tokens of hidden 8192 in bf16 (plan_table.h kRanksRows), whatever YALI_DEV_RANKS_MAX
    # makes the slot above it
    def one_launch(rows):
        return config.fused_plan(rows, 8192, torch.bfloat16, world_size=world)["one_launch"]

    for limit in (None, "64M"):
        if limit:
            monkeypatch.setenv("YALI_DEV_RANKS_MAX", limit)
        assert (one_launch(32), one_launch(33)) == (1, 0)


def test_fused_one_launch_never_exceeds_the_slot(monkeypatch):
    # 8 ranks with YALI_DEV_RANKS_MAX=1M: a 256 KiB slot (the one-shot limit), 16 rows of hidden 8192
    monkeypatch.setenv("YALI_DEV_RANKS_MAX", "1M")
    assert config.limits(8)["slot_bytes"] == 256 * KiB
    assert [config.fused_plan(r, 8192, torch.bfloat16, world_size=8)["one_launch"] for r in (16, 17)] == [1, 0]


def test_fused_one_launch_knob_moves_the_limit_within_the_slot(monkeypatch):
    # the default: test_fused_one_launch_stops_at_512_kib
    def one_launch(rows, world=4):
        return config.fused_plan(rows, 8192, torch.bfloat16, world_size=world)["one_launch"]

    monkeypatch.setenv("YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX", "256K")
    assert config.kernel_config()["ranks_fused_one_launch_max"] == 256 * KiB
    assert (one_launch(16), one_launch(17), one_launch(16, world=8)) == (1, 0, 1)
    monkeypatch.setenv("YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX", "16M")  # never above one rank's slot: 4 MiB at 4 ranks
    assert (one_launch(256), one_launch(257)) == (1, 0)


@pytest.mark.parametrize("world", [0, 1, 9, 16])
def test_ops_refuse_world_sizes_outside_2_to_8(world):
    with pytest.raises(ValueError, match=f"world size {world} is not in"):
        _ext.call(torch.ops.yali.plan, 4096, -1, world)
    with pytest.raises(ValueError, match=f"world size {world} is not in"):
        _ext.call(torch.ops.yali.create, 0, 0, world)


def test_create_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank 4 is not in \\[0, 4\\)"):
        _ext.call(torch.ops.yali.create, 0, 4, 4)


@pytest.mark.parametrize("world, served", [(1, False), (2, True), (3, False), (4, True), (5, False), (6, True),
                                           (7, False), (8, True), (16, False)])
def test_world_size_refusal(world, served):
    reason = config.world_size_refusal(world)
    assert (reason is None) == served
    if not served:
        assert reason == f"world size is {world}; YALI serves 2, 4, 6 or 8 ranks"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [3, 4])
def test_every_rank_of_a_group_refuses_together(world):
    """A world size YALI does not serve (3) is refused on every rank before any collective; a served
    one (4) on a machine without a GPU fails in set-up on every rank with every rank's reason, and
    no rank is left waiting."""
    got = start_ranks(world, devices={r: torch.device("cuda", 0) for r in range(world)})
    for r in range(world):
        assert got[r].startswith("unavailable:"), got
        if world == 3:
            assert "world size is 3; YALI serves 2, 4, 6 or 8 ranks" in got[r]
        else:
            assert all(f"rank {q}:" in got[r] for q in range(world)), got[r]
