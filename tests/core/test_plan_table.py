"""Properties of the size table compiled into the library (csrc/core/yali/common/plan_table.h, read
through yali_vllm.config.plan_table), and the lookups that follow it (config.plan, config.fused_plan):
the all-reduce bands are contiguous and non-overlapping, every size up to the serve limit has a
kernel, CTA counts grow with the size, chunks fit their slots, every fused call falls in one band
and launches as it says. They need the compiled extension, not a GPU."""
import os

import pytest
import torch

from yali_vllm import _ext, config

from ..size_table import allreduce_kernel, fused_band

pytestmark = pytest.mark.skipif(_ext.library_error() is not None, reason=f"extension not built: {_ext.library_error()}")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
WORLDS = (2, 3, 4, 5, 6, 7, 8)
DTYPES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
# Settings under which the properties must hold too: the defaults, the forced modes, and knobs that
# move every boundary.
SETTINGS = {
    "defaults": {},
    "flash": {"YALI_KERNEL_MODE": "flash"},
    "stream": {"YALI_KERNEL_MODE": "stream"},
    "moved": {"YALI_DEV_FLASH_BYTES": "1M", "YALI_DEV_STREAM_MIN": "256K", "YALI_DEV_PUSH_CTA_BYTES": "4K",
              "YALI_DEV_SLOT_BYTES": "16K", "YALI_DEV_RANKS_MAX": "4M", "YALI_DEV_RANKS_ONESHOT_MAX": "64K",
              "YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX": "128K", "YALI_MAX_BYTES": "3M"},
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("YALI_"):
            monkeypatch.delenv(k)


@pytest.fixture(params=list(SETTINGS))
def settings(request, monkeypatch):
    for k, v in SETTINGS[request.param].items():
        monkeypatch.setenv(k, v)
    return request.param


def probe_sizes(table: dict) -> list[int]:
    """Sizes around every boundary of the all-reduce table, the small sizes and each power of two."""
    marks = [b["up_to"] for b in table["allreduce"]] + [1 << p for p in range(4, 32)]
    near = {m + d for m in marks for d in (-16, -2, -1, 0, 1, 2, 16)}
    return sorted(n for n in near | set(range(1, 4097, 7)) if n > 0)


@pytest.mark.parametrize("world", WORLDS)
def test_allreduce_bands_are_contiguous_and_end_at_the_serve_limit(settings, world):
    table = config.plan_table(world)
    bands, limits = table["allreduce"], table["limits"]
    tops = [b["up_to"] for b in bands]
    assert tops == sorted(set(tops)) and all(t > 0 for t in tops), bands  # increasing: no overlap, no gap
    assert limits["serve_max"] == (tops[-1] if tops else 0)
    assert limits["serve_max"] <= config.kernel_config()["max_bytes"]
    if settings == "stream" and world > 2:
        assert bands == []  # no N-rank stream kernel: vLLM's chain serves everything
    else:
        assert bands, (settings, world)
    kernels = [b["kernel"] for b in bands]
    assert len(set(kernels)) == len(kernels)
    assert set(kernels) <= ({"flash-push", "stream"} if world == 2 else {"push-oneshot", "push-twoshot"})


@pytest.mark.parametrize("world", WORLDS)
def test_every_size_up_to_the_serve_limit_has_the_kernel_of_its_band(settings, world):
    table = config.plan_table(world)
    top = table["limits"]["serve_max"]
    for n in probe_sizes(table):
        kernel = config.plan(n, world_size=world)[0]
        assert kernel == allreduce_kernel(table["allreduce"], n), (n, kernel)
        assert (kernel is not None) == (n <= top), (n, top)
    assert config.plan(0, world_size=world)[0] is None


@pytest.mark.parametrize("world", WORLDS)
def test_push_ctas_grow_with_the_size_and_stream_chunks_fit_their_slots(settings, world):
    table = config.plan_table(world)
    limits, cfg = table["limits"], config.kernel_config()
    last: dict = {}
    for n in probe_sizes(table):
        kernel, blocks, chunk = config.plan(n, world_size=world)
        if kernel is None:
            continue
        if kernel == "stream":  # chunks of at most one slot, 16-byte multiples, covering the message
            assert 1 <= blocks <= limits["stream_lanes"] and chunk % 16 == 0 and chunk <= cfg["slot_bytes"]
            assert chunk * blocks >= n > chunk * (blocks - 1) or blocks == limits["stream_lanes"], (n, blocks, chunk)
        else:  # push CTAs: push_cta_bytes of the largest per-rank share each, up to max_ctas
            assert blocks >= last.get(kernel, 1), (n, kernel, blocks, last)  # more CTAs for larger messages
            last[kernel] = blocks
            share = n if kernel != "push-twoshot" else -(-(-(-n // 16)) // world) * 16
            assert blocks == min(limits["max_ctas"], -(-share // cfg["push_cta_bytes"])), (n, kernel, blocks)
            assert chunk == 0


@pytest.mark.parametrize("world", (3, 4, 5, 6, 7, 8))
def test_n_rank_limits_fit_one_ranks_slot(settings, world):
    table = config.plan_table(world)
    limits, max_bytes = table["limits"], config.kernel_config()["max_bytes"]
    if settings == "stream":
        pytest.skip("no N-rank stream kernel (test_allreduce_bands_are_contiguous_and_end_at_the_serve_limit)")
    assert limits["oneshot_max"] > 0
    assert table["allreduce"][0] == {"kernel": "push-oneshot", "up_to": min(limits["oneshot_max"], max_bytes)}
    slot = limits["slot_bytes"]
    assert slot % 256 == 0 and slot >= limits["oneshot_max"]
    assert slot * world >= limits["serve_max"]  # every rank's segment of the largest message fits
    assert 0 < limits["fused_one_launch_max"] <= slot


def test_more_ranks_never_serve_more():
    # a one-shot exchange carries more per byte of message as the world grows: the table's limits
    # never grow with it
    for key in ("serve_max", "oneshot_max"):
        values = [config.limits(w)[key] for w in (3, 4, 5, 6, 7, 8)]
        assert values == sorted(values, reverse=True), (key, values)


def test_fused_bands_are_ordered_and_the_last_holds_every_call():
    bands = config.plan_table(2)["fused_band"]
    assert bands[-1]["up_to"] == 0 and bands[-1]["row_bytes_max"] == 0  # unbounded
    bounded = [b["up_to"] for b in bands[:-1]]
    assert all(t > 0 for t in bounded) and bounded == sorted(bounded)
    for a, b in zip(bands, bands[1:]):  # within one message bound, the narrower row bound comes first
        if a["up_to"] == b["up_to"]:
            assert 0 < a["row_bytes_max"] and (b["row_bytes_max"] == 0 or a["row_bytes_max"] < b["row_bytes_max"])
    limits = config.limits(2)
    for b in bands:
        # each CTA sends whole 16-byte vectors, and a bounded band's largest message whole CTA chunks
        assert b["cta_bytes"] % 16 == 0 and b["cta_bytes"] <= limits["fused_max_row_bytes"]
        assert b["up_to"] % b["cta_bytes"] == 0, b
        assert b["cluster_max"] in (1, 2, 4, 8) and b["row_loads_early"] in (0, 1)
    assert config.plan_table(4)["fused_band"] == bands  # one set of bands for every world size


def fused_shapes():
    """Rows x hidden x dtype around every fused band boundary and the one-launch limits."""
    hiddens = (512, 2048, 4096, 5120, 8192, 16384)
    rows = sorted({1, 2, 3, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 48, 64, 65, 127, 128, 129, 256, 512, 513, 1024})
    return [(r, h, d) for d in DTYPES for h in hiddens for r in rows]


@pytest.mark.parametrize("cluster,expected", [("0", 1), ("2", 2), ("8", 8)])
def test_the_fused_bands_name_the_cluster_the_setting_gives(monkeypatch, cluster, expected):
    """YALI_DEV_FUSED_CLUSTER replaces every band's cluster_max (0, never: a cluster of one), and each
    call launches within it."""
    monkeypatch.setenv("YALI_DEV_FUSED_CLUSTER", cluster)
    table = config.plan_table(2)
    assert {b["cluster_max"] for b in table["fused_band"]} == {expected}
    for rows, hidden, dtype in fused_shapes():
        if hidden * DTYPES[dtype] <= table["limits"]["fused_max_row_bytes"]:
            l = config.fused_plan(rows, hidden, dtype, world_size=2)
            assert not l["one_launch"] or l["cluster"] <= expected, (rows, hidden, dtype, l)


@pytest.mark.parametrize("world", (2, 4, 8))
def test_every_fused_call_launches_as_its_band_says(settings, world):
    table = config.plan_table(world)
    limits, cfg = table["limits"], config.kernel_config()
    for rows, hidden, dtype in fused_shapes():
        row_bytes = hidden * DTYPES[dtype]
        if row_bytes > limits["fused_max_row_bytes"]:
            continue
        nbytes = rows * row_bytes
        l = config.fused_plan(rows, hidden, dtype, world_size=world)
        shape = (rows, hidden, dtype, l)
        assert l["one_launch"] == (nbytes <= limits["fused_one_launch_max"]), shape
        if not l["one_launch"]:  # the all-reduce, then the epilogue: one CTA per row
            assert l["grid"] == min(rows, limits["epilogue_max_ctas"]), shape
            continue
        band = fused_band(table["fused_band"], nbytes, row_bytes)
        assert (l["cta_bytes"], l["row_loads_early"]) == (band["cta_bytes"], band["row_loads_early"]), (shape, band)
        if l["spread"] > 1:  # N ranks: rows over clusters of `spread` CTAs, up to spread_max_ctas
            assert world > 2 and l["grid"] == rows * l["spread"] <= limits["spread_max_ctas"], shape
            assert l["cluster"] == l["spread"] == cfg["ranks_fused_spread"], shape
            continue
        assert min(rows, limits["max_ctas"]) <= l["grid"] <= limits["max_ctas"], shape
        assert l["grid"] >= min(limits["max_ctas"], -(-nbytes // band["cta_bytes"])), shape  # every chunk sent
        assert l["cluster"] <= band["cluster_max"] and l["grid"] % l["cluster"] == 0, (shape, band)
        assert l["batch_poll"] == (world == 2 and nbytes >= cfg["fused_batch_poll_min"]), shape


def test_the_sweep_above_meets_every_band():
    bands = config.plan_table(2)["fused_band"]
    met = {bands.index(fused_band(bands, r * h * DTYPES[d], h * DTYPES[d])) for r, h, d in fused_shapes()}
    assert met == set(range(len(bands)))


def test_the_limits_name_the_kernels_hard_limits():
    # the values the Python package reads instead of keeping its own copies
    limits = config.limits(2)
    assert limits["fused_max_row_bytes"] == 512 * 8 * 16  # kFlashThreads x 8 vectors x 16 bytes: hidden 32768 bf16
    assert (limits["max_ranks"], limits["ep_max_parts"], limits["max_ctas"]) == (8, 8, 128)
    with pytest.raises(ValueError, match="world size 9 is not in"):
        config.plan_table(9)
