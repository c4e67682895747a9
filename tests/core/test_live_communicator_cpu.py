"""A live YaliCommunicator on gloo ranks without a GPU: its decisions at their boundaries, for every
world size YALI serves (2, 4, 6, 8: groups of one 8-rank gloo world) and every kernel mode.

The communicator runs its real start-up (every exchange between the ranks, the library's settings
and size table); only the GPU-only parts are stood in (tests/core/gpu_stand_in.py names them).
Checked: the serve limit (YALI_MAX_BYTES, the max_bytes argument, the flash-mode cap, the N-rank
limit), should_use at the limit, a kernel in the plan for every size up to it, can_fuse (rows of a
multiple of 16 bytes, the longest row, the weight and residual), the EP checks (ep_serves_dispatch,
ep_serves_combine), the EP dispatch's output and the combine into an output over its input."""
from __future__ import annotations

import os

import pytest
import torch

from tests.plugin.cpu_ranks import cpu_rank, run_cpu_ranks

WORLDS = (2, 4, 6, 8)
ARG_MAX = (1 << 20) + 16  # a max_bytes argument that is no power of two
SMALL_MAX = 3 << 20  # a YALI_MAX_BYTES below the flash buffer (8 MiB by default)
EP_SLOT = 8192
# Each scenario: (environment, YaliCommunicator keyword arguments).
SCENARIOS = {
    "auto": ({}, {}),
    "flash": ({"YALI_KERNEL_MODE": "flash"}, {}),
    "stream": ({"YALI_KERNEL_MODE": "stream"}, {}),
    "small": ({"YALI_MAX_BYTES": str(SMALL_MAX)}, {}),
    "flash-small": ({"YALI_KERNEL_MODE": "flash", "YALI_MAX_BYTES": str(SMALL_MAX)}, {}),
    "arg": ({}, {"max_bytes": ARG_MAX}),
    "ep": ({}, {"ep_slot_bytes": EP_SLOT}),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sizes_to_check(limit: int, cfg: dict, world: int) -> list[int]:
    """Sizes at every boundary of the size table up to `limit`: the small sizes, each power of two
    and its neighbours, the configured switch points and the limit."""
    from yali_vllm import config

    points = [1 << p for p in range(4, 32)] + [int(v) for v in cfg.values() if isinstance(v, int) and v > 0]
    limits = config.limits(world)
    points += [int(limits[k]) for k in ("serve_max", "oneshot_max", "slot_bytes", "fused_one_launch_max") if limits[k]]
    near = {p + d for p in points + [limit] for d in (-16, -4, -2, 0, 2, 4, 16)}
    return sorted(s for s in near | set(range(2, 4097, 2)) if 0 < s <= limit)


def _should_use_boundaries(comm) -> dict:
    """should_use at one element below, at and one element above the limit, per dtype."""
    out = {}
    for name, dtype in DTYPES.items():
        e = torch.empty((), dtype=dtype).element_size()
        top = comm.serve_limit // e
        for label, n in (("one", 1), ("limit-1", top - 1), ("limit", top), ("limit+1", top + 1)):
            out[f"{name} {label}"] = comm.should_use(torch.empty(n, dtype=dtype))
    x = torch.ones(64)
    out["empty"] = comm.should_use(torch.empty(0))
    out["int32"] = comm.should_use(torch.ones(64, dtype=torch.int32))
    out["requires grad"] = comm.should_use(torch.ones(64, requires_grad=True))
    out["not contiguous"] = comm.should_use(torch.ones(8, 8).t())
    out["a view in place"] = comm.should_use(x[16:48])
    out["not a tensor"] = comm.should_use([1.0])
    return out


def _can_fuse_cases(comm) -> dict:
    bf16 = torch.bfloat16
    longest = comm.table["limits"]["fused_max_row_bytes"] // 2

    def fuse(rows, hidden, dtype=bf16, residual="like", weight="like"):
        x = torch.empty(rows, hidden, dtype=dtype)
        w = torch.ones(hidden, dtype=dtype) if weight == "like" else weight
        r = torch.empty_like(x) if residual == "like" else residual
        return comm.can_fuse(x, r, w)

    rows_at_limit = comm.serve_limit // 16  # rows of 8 bf16 (16 bytes)
    return {
        "16-byte rows": fuse(4, 8),
        "24-byte rows": fuse(4, 12),
        "8-byte rows": fuse(4, 4),
        "fp32 16-byte rows": fuse(4, 4, torch.float32),
        "fp32 24-byte rows": fuse(4, 6, torch.float32),
        "the longest row": fuse(2, longest),
        "a row 16 bytes longer": fuse(2, longest + 8),
        "no residual": fuse(4, 64, residual=None),
        "message at the limit": fuse(rows_at_limit, 8, residual=None),
        "message above the limit": fuse(rows_at_limit + 1, 8, residual=None),
        "weight of another length": fuse(4, 64, weight=torch.ones(32, dtype=bf16)),
        "weight of another dtype": fuse(4, 64, weight=torch.ones(64)),
        "weight not contiguous": fuse(4, 64, weight=torch.ones(64, 2, dtype=bf16)[:, 0]),
        "residual of another shape": fuse(4, 64, residual=torch.empty(2, 64, dtype=bf16)),
        "residual of another dtype": fuse(4, 64, residual=torch.empty(4, 64)),
        "residual not contiguous": fuse(4, 64, residual=torch.empty(64, 4, dtype=bf16).t()),
        "a scalar": comm.can_fuse(torch.ones((), dtype=bf16), None, torch.ones(1, dtype=bf16)),
        "int32": fuse(4, 8, torch.int32),
    }


def _can_fuse_quant_cases(comm) -> dict:
    from yali_vllm import ops

    bf16 = torch.bfloat16

    def fuse(shape, scheme, group=128, dtype=bf16):
        x = torch.empty(*shape, dtype=dtype)
        return comm.can_fuse_quant(x, torch.empty_like(x), torch.ones(shape[-1], dtype=dtype), scheme, group)

    return {
        "static bf16": fuse((4, 256), ops.SCHEME_STATIC),
        "per-token fp16": fuse((4, 256), ops.SCHEME_PER_TOKEN, dtype=torch.float16),
        "group 128": fuse((4, 256), ops.SCHEME_GROUP),
        "group 64": fuse((4, 192), ops.SCHEME_GROUP, 64),
        "group 128 not dividing the row": fuse((4, 192), ops.SCHEME_GROUP),
        "group 32": fuse((4, 256), ops.SCHEME_GROUP, 32),
        "fp32": fuse((4, 256), ops.SCHEME_STATIC, dtype=torch.float32),
        "an unknown scheme": fuse((4, 256), 3),
        "three dimensions": fuse((2, 2, 256), ops.SCHEME_PER_TOKEN),
        "24-byte rows": fuse((4, 12), ops.SCHEME_STATIC),
    }


def _ep_serves_cases(comm) -> dict:
    """ep_serves_dispatch / ep_serves_combine at their boundaries (every rank has 4 tokens)."""
    w, r = comm.world_size, comm.rank
    counts = [4] * w
    bf16 = torch.bfloat16

    def t(cols, dtype=bf16, rows=4):
        return torch.zeros(rows, cols, dtype=dtype)

    def dispatch(tensors, c=counts):
        try:
            return comm.ep_serves_dispatch(tensors, c)
        except ValueError as e:
            return f"ValueError: {'names it' if f'tensor {len(tensors) - 1}' in str(e) else e}"

    top = EP_SLOT // 4 // 2  # bf16 columns of a row that fills the slot with 4 tokens
    return {
        "moe tensors": dispatch([t(64), t(2, torch.float32), t(2, torch.int32)]),
        "a row that fills the slot": dispatch([t(top)]),
        "a row 4 bytes longer": dispatch([t(top + 2)]),
        "two tensors that fill the slot": dispatch([t(top // 2), t(top // 2)]),
        "two tensors a little over it": dispatch([t(top // 2), t(top // 2 + 2)]),
        "8 tensors": dispatch([t(2)] * 8),
        "9 tensors": dispatch([t(2)] * 9),
        "no tensor": dispatch([]),
        "6-byte rows": dispatch([t(3)]),
        "int8": dispatch([t(4, torch.int8)]),
        "a tensor without rows": dispatch([torch.zeros((), dtype=bf16)]),
        "counts of another world": dispatch([t(64)], [4] * (w + 1)),
        "another token count": dispatch([t(64), t(2, rows=3)]),
        "combine": comm.ep_serves_combine(t(top, rows=4 * w), counts),
        "combine, a row 16 bytes longer": comm.ep_serves_combine(t(top + 8, rows=4 * w), counts),
        "combine, 24-byte rows": comm.ep_serves_combine(t(12, rows=4 * w), counts),
        "combine, rows of another total": comm.ep_serves_combine(t(64, rows=4 * w - 1), counts),
        "combine, 3 dims": comm.ep_serves_combine(torch.zeros(4 * w, 8, 8, dtype=bf16), counts),
        "combine, int32": comm.ep_serves_combine(t(64, torch.int32, rows=4 * w), counts),
        "combine, counts of another world": comm.ep_serves_combine(t(64, rows=4 * (w + 1)), [4] * (w + 1)),
        "rows": comm.ep_serves_rows(top, bf16, counts),
        "rows, 16 bytes longer": comm.ep_serves_rows(top + 8, bf16, counts),
        "rows, int32": comm.ep_serves_rows(64, torch.int32, counts),
        "rank": r,
    }


def _ep_calls(comm) -> dict:
    """The EP dispatch's outputs (shapes, values) and the combine, with its out over its input."""
    w, r = comm.world_size, comm.rank
    counts = [k + 1 for k in range(w)]  # rank k has k + 1 tokens
    mine = counts[r]
    hidden = torch.full((mine, 64), float(r), dtype=torch.bfloat16)
    ids = torch.arange(mine * 2, dtype=torch.int32).reshape(mine, 2) + 100 * r
    outs = comm.ep_dispatch([hidden, ids, ids[:, :1]], counts)  # the last one is not contiguous
    first = sum(counts[:r])
    x = torch.arange(sum(counts) * 8, dtype=torch.float32).reshape(-1, 8) * (r + 1)
    expected = (torch.arange(sum(counts) * 8, dtype=torch.float32).reshape(-1, 8) * sum(range(1, w + 1)))[first:first + mine]
    separate = torch.empty(mine, 8)
    got_new = comm.ep_combine(x.clone(), counts)
    got_out = comm.ep_combine(x.clone(), counts, out=separate)
    over = x.clone()
    got_over = comm.ep_combine(over, counts, out=over[first:first + mine])  # out over its own input
    return {
        "shapes": [list(o.shape) for o in outs],
        "dtypes": [str(o.dtype) for o in outs],
        "hidden rows of each rank": [int(v) for v in outs[0][:, 0].float().tolist()],
        "ids": outs[1].tolist(),
        "ids column": outs[2].tolist(),
        "combine": bool(torch.equal(got_new, expected)),
        "combine into out": bool(torch.equal(got_out, expected)) and got_out is separate,
        "combine over its input": bool(torch.equal(over[first:first + mine], expected)) and got_over.shape == expected.shape,
    }


def _scenario(comm, name: str) -> dict:
    from yali_vllm import config

    cfg = config.parse_config_string(config._ext.ops().config_string())
    limit = comm.serve_limit
    res = {
        "limit": limit,
        "device": str(comm.gpu_device),
        "unplanned": [s for s in _sizes_to_check(limit, cfg, comm.world_size)
                      if config.plan(s, "config", comm.world_size)[0] is None],
        "should_use": _should_use_boundaries(comm),
        "can_fuse": _can_fuse_cases(comm),
        "can_fuse_quant": _can_fuse_quant_cases(comm),
        "ep": _ep_serves_cases(comm),
    }
    if name == "ep":
        res["ep_calls"] = _ep_calls(comm)
    comm.close()
    res["closed"] = [comm.should_use(torch.ones(4)), comm.ep_serves_dispatch([torch.zeros(4, 4)], [4] * comm.world_size)]
    return res


def _worker(rank: int, port: int, world_size: int, outdir: str) -> None:
    import torch.distributed as dist

    from tests.core import gpu_stand_in

    with cpu_rank(rank, port, world_size, outdir) as (res, _):
        groups = {w: dist.new_group(list(range(w)), backend="gloo") for w in WORLDS}
        gpu_stand_in.install({w: g for w, g in groups.items() if rank < w}, world_size)
        from yali_vllm.communicator import YaliCommunicator, YaliUnavailable

        for w in WORLDS:
            if rank >= w:
                continue
            for name, (env, kwargs) in SCENARIOS.items():
                os.environ.update(env)
                try:
                    comm = YaliCommunicator(groups[w], rank, **kwargs)
                    res[f"{w} {name}"] = _scenario(comm, name)
                except YaliUnavailable as e:
                    res[f"{w} {name}"] = f"unavailable: {e}"
                finally:
                    for k in env:
                        del os.environ[k]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_cpu_ranks(_worker, 8, outdir=tmp_path_factory.mktemp("live"), world_size=8)


def _every_rank(ranks: list[dict], world: int, name: str):
    """The result of scenario `name` at `world` ranks, after checking its ranks agree (but for
    the rank numbers they record)."""
    got = [r[f"{world} {name}"] for r in ranks[:world]]
    strip = [{k: v for k, v in g.items() if k not in ("device", "ep", "ep_calls")} if isinstance(g, dict) else g
             for g in got]
    assert all(s == strip[0] for s in strip), f"the ranks of {world} {name} differ"
    return got


def _limit(world: int, name: str) -> int:
    """The serve limit scenario `name` must give at `world` ranks: its YALI_MAX_BYTES or max_bytes
    (2 GiB by default), at two ranks in flash mode at most the flash buffer (8 MiB), above two ranks
    at most the N-rank table's largest message."""
    from yali_vllm import config

    limit = {"small": SMALL_MAX, "flash-small": SMALL_MAX, "arg": ARG_MAX}.get(name, 2 << 30)
    if world > 2:
        return min(limit, int(config.limits(world)["serve_max"]))
    return min(limit, 8 << 20) if name.startswith("flash") else limit


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", WORLDS)
def test_the_serve_limit_of_every_mode(ranks, world):
    for name in SCENARIOS:
        got = _every_rank(ranks, world, name)[0]
        if world > 2 and name == "stream":
            assert got == (f"unavailable: YALI_KERNEL_MODE=stream: there is no stream kernel for {world} ranks "
                           f"(auto or flash pick push one-shot / two-shot)"), got
            continue
        assert got["limit"] == _limit(world, name), (name, got["limit"])


@pytest.mark.parametrize("world", WORLDS)
def test_every_size_up_to_the_limit_has_a_kernel(ranks, world):
    for name in SCENARIOS:
        got = _every_rank(ranks, world, name)[0]
        if isinstance(got, dict):
            assert got["unplanned"] == [], (name, got["unplanned"][:5])


@pytest.mark.parametrize("world", WORLDS)
def test_should_use_at_the_limit(ranks, world):
    expected = {"fp32 one": True, "fp32 limit-1": True, "fp32 limit": True, "fp32 limit+1": False,
                "bf16 one": True, "bf16 limit-1": True, "bf16 limit": True, "bf16 limit+1": False,
                "empty": False, "int32": False, "requires grad": False, "not contiguous": False,
                "a view in place": True, "not a tensor": False}
    for name in SCENARIOS:
        got = _every_rank(ranks, world, name)[0]
        if isinstance(got, dict):
            assert got["should_use"] == expected, name
            assert got["closed"] == [False, False], name  # a closed communicator serves nothing


@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_takes_its_own_gpu(ranks, world):
    assert [r[f"{world} auto"]["device"] for r in ranks[:world]] == [f"cuda:{r}" for r in range(world)]


@pytest.mark.parametrize("world", WORLDS)
def test_can_fuse_at_its_boundaries(ranks, world):
    expected = {
        "16-byte rows": True, "24-byte rows": False, "8-byte rows": False, "fp32 16-byte rows": True,
        "fp32 24-byte rows": False, "the longest row": True, "a row 16 bytes longer": False, "no residual": True,
        "message at the limit": True, "message above the limit": False, "weight of another length": False,
        "weight of another dtype": False, "weight not contiguous": False, "residual of another shape": False,
        "residual of another dtype": False, "residual not contiguous": False, "a scalar": False, "int32": False,
    }
    for name in ("auto", "flash", "arg", "small"):
        assert _every_rank(ranks, world, name)[0]["can_fuse"] == expected, name


@pytest.mark.parametrize("world", WORLDS)
def test_can_fuse_quant_at_its_boundaries(ranks, world):
    expected = {
        "static bf16": True, "per-token fp16": True, "group 128": True, "group 64": True,
        "group 128 not dividing the row": False, "group 32": False, "fp32": False, "an unknown scheme": False,
        "three dimensions": False, "24-byte rows": False,
    }
    for name in ("auto", "flash", "arg", "small"):
        assert _every_rank(ranks, world, name)[0]["can_fuse_quant"] == expected, name


@pytest.mark.parametrize("world", WORLDS)
def test_ep_checks_at_their_boundaries(ranks, world):
    expected = {
        "moe tensors": True, "a row that fills the slot": True, "a row 4 bytes longer": False,
        "two tensors that fill the slot": True, "two tensors a little over it": False, "8 tensors": True,
        "9 tensors": False, "no tensor": False, "6-byte rows": False, "int8": False,
        "a tensor without rows": False, "counts of another world": False, "another token count": "ValueError: names it",
        "combine": True, "combine, a row 16 bytes longer": False, "combine, 24-byte rows": False,
        "combine, rows of another total": False, "combine, 3 dims": False, "combine, int32": False,
        "combine, counts of another world": False, "rows": True, "rows, 16 bytes longer": False,
        "rows, int32": False,
    }
    for r, got in enumerate(_every_rank(ranks, world, "ep")):
        assert got["ep"] == {**expected, "rank": r}, r
    # Without an EP area nothing is served, and nothing raises.
    without = _every_rank(ranks, world, "auto")[0]["ep"]
    assert {k for k, v in without.items() if v is True} == set(), without


@pytest.mark.parametrize("world", WORLDS)
def test_ep_dispatch_gathers_every_rank_in_order(ranks, world):
    counts = [k + 1 for k in range(world)]
    total = sum(counts)
    for r, got in enumerate(_every_rank(ranks, world, "ep")):
        calls = got["ep_calls"]
        assert calls["shapes"] == [[total, 64], [total, 2], [total, 1]], r
        assert calls["dtypes"] == ["torch.bfloat16", "torch.int32", "torch.int32"]
        assert calls["hidden rows of each rank"] == [k for k in range(world) for _ in range(counts[k])]
        ids = [[2 * i + 100 * k, 2 * i + 1 + 100 * k] for k in range(world) for i in range(counts[k])]
        assert calls["ids"] == ids and calls["ids column"] == [[a] for a, _ in ids]
        assert calls["combine"] and calls["combine into out"] and calls["combine over its input"], calls


# ------------------------------------------------------------ one process: the overlap check
def test_overlap_at_its_boundaries():
    from yali_vllm.communicator import _overlap

    x = torch.zeros(64)
    assert _overlap(x, x) and _overlap(x[:32], x[31:40]) and _overlap(x[8:9], x)
    assert not _overlap(x[:32], x[32:]) and not _overlap(x[32:], x[:32])  # adjacent: no shared byte
    assert not _overlap(x[:0], x) and not _overlap(x, x[5:5])  # an empty tensor overlaps nothing
    assert not _overlap(x, torch.zeros(64))


def test_ep_slot_bytes_at_its_bounds():
    from yali_vllm.config import EP_SLOT_RANGE, ep_slot_bytes

    lo, hi = EP_SLOT_RANGE
    assert (lo, hi) == (4096, 256 << 20)
    assert [ep_slot_bytes({"YALI_EP_SLOT_BYTES": str(n)}) for n in (lo, hi)] == [lo, hi]
    for bad in (lo - 4096, hi + 4096, lo + 1):
        with pytest.raises(ValueError, match="YALI_EP_SLOT_BYTES"):
            ep_slot_bytes({"YALI_EP_SLOT_BYTES": str(bad)})
