"""The plugin's set-up with a live YaliCommunicator on 2 and 4 gloo ranks without a GPU, against the
real vLLM: every rank ends on the same backend, also when one rank fails a step, and none waits;
the EP manager routes each call to YALI or to vLLM's manager and returns vLLM's shapes.

Real: vLLM's CudaCommunicator and AgRsAll2AllManager classes, gloo groups, the plugin's gates,
exchanges and YaliCommunicator. Stand-ins, each named where used: the GPU-only parts of the
communicator (tests/core/gpu_stand_in.py; the communicators' device is set to the GPU each rank
would hold), the manager's DP group (its __init__ needs vLLM's DP set-up) and, for the routing,
vLLM's group lookups (_get_comm_group, _get_sizes: they need vLLM's distributed state and forward
context)."""
from __future__ import annotations

import os
import time
import types

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from .cpu_ranks import cpu_rank, run_cpu_ranks, same_on_every_rank  # noqa: E402


def vllm_release() -> tuple[int, int]:
    """The installed vLLM's (major, minor)."""
    import vllm

    return tuple(int(p) for p in vllm.__version__.split(".")[:2])

# A failing step on rank 1: where it fails, and the reason every rank must give.
FAILURES = {
    "create": "rank 1: RuntimeError: yali: create failed on this rank",
    "open_peer": "rank 1: cannot map another rank's buffer: yali: open_peer failed on this rank",
    "self_test": "self-test all-reduce over the peer mapping gave wrong values",
    "buffer_bytes": "rank 1 of the group: YALI set-up failed (RuntimeError: yali: buffer_bytes failed on this rank",
}
EP_FAILURES = {
    "open_peer": "rank 0 of the group: YaliUnavailable: rank 1: cannot map another rank's buffer",
    "buffer_bytes": "rank 1 of the group: RuntimeError: yali: buffer_bytes failed on this rank",
}


def _communicator(group, name: str):
    """vLLM's CudaCommunicator over `group`, built on the CPU (before the GPU stand-ins are installed:
    vLLM would query the stand-in GPUs as real ones)."""
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    return CudaCommunicator(cpu_group=group, device=torch.device("cpu"), device_group=group, unique_name=name)


def _tp_case(comm, rank: int) -> list:
    from yali_vllm.plugin import group_setup

    comm.device = torch.device("cuda", rank)  # the GPU this rank would hold
    yc, reason, warn = group_setup.setup_yali(comm, platform_is_cuda=True)
    if yc is not None:
        yc.close()
    comm.device = torch.device("cpu")
    comm.destroy()
    return [yc is not None, reason, warn]


def _manager(ranks: list[int]):
    """vLLM's AgRsAll2AllManager without its __init__ (which needs vLLM's DP group); dp_group stands in."""
    from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

    m = AgRsAll2AllManager.__new__(AgRsAll2AllManager)
    m.dp_group = types.SimpleNamespace(ranks=list(ranks))
    m.dp_world_size = len(ranks)
    return m


def _ep_case(comm, rank: int, world: int) -> list:
    """[the manager's class after setup_ep, the line it logged, how it routes when YALI serves]."""
    from yali_vllm.plugin import ep_manager

    comm.device = torch.device("cuda", rank)  # the GPU this rank would hold
    manager = _manager(list(range(world)))
    comm.all2all_manager = manager
    line = ep_manager.setup_ep(comm, platform_is_cuda=True)
    routing = _routing(manager, rank, world) if getattr(manager, "yali_comm", None) is not None else None
    comm.device = torch.device("cpu")
    comm.destroy()  # closes the manager's communicator, on every rank
    return [type(manager).__name__, line, routing]


class StandInDpGroup:
    """Stand-in for vLLM's DP GroupCoordinator as the manager's vLLM methods use it: records the
    calls that reach vLLM's path."""

    def __init__(self, ranks: list[int], rank: int):
        self.ranks, self.world_size, self.rank_in_group = ranks, len(ranks), rank
        self.calls: list[str] = []
        self.device_communicator = self

    def all_gatherv(self, tensors, dim=0, sizes=None):
        self.calls.append("all_gatherv")
        return [torch.zeros(sum(sizes), *t.shape[1:], dtype=t.dtype) for t in tensors]

    def reduce_scatterv(self, x, dim=0, sizes=None):
        self.calls.append("reduce_scatterv")
        return torch.zeros(sizes[self.rank_in_group], *x.shape[1:], dtype=x.dtype)

    def reduce_scatterv_into_output(self, x, output, dim=0, sizes=None):
        self.calls.append("reduce_scatterv_into_output")
        return output

    def get_symmetric_memory_buffer(self, name, shape, dtype, device):
        self.calls.append("symmetric buffer")
        return torch.zeros(shape, dtype=dtype)


def _routing(manager, rank: int, world: int) -> dict:
    """Each manager method once with a call YALI serves and once with one it leaves to vLLM."""
    counts = [k + 1 for k in range(world)]
    total, mine = sum(counts), counts[rank]
    dp = StandInDpGroup(list(range(world)), rank)
    manager._get_comm_group = lambda is_sequence_parallel: dp  # stand-ins for vLLM's group lookups
    sizes = list(counts)
    manager._get_sizes = lambda n, group: list(sizes)
    h = torch.full((mine, 64), float(rank), dtype=torch.bfloat16)
    w = torch.full((mine, 2), 0.5)
    ids = torch.full((mine, 2), rank, dtype=torch.int32)
    scale = torch.full((mine, 4), float(rank))
    out: dict = {}

    def shapes(got):
        return [shapes(g) for g in got] if isinstance(got, (list, tuple)) else list(got.shape)

    def record(name, got):
        out[name] = {"shapes": shapes(got), "vllm": list(dp.calls)}
        dp.calls.clear()

    record("dispatch", manager.dispatch(h, w, ids))
    record("dispatch extra", manager.dispatch(h, w, ids, extra_tensors=[scale]))
    got = manager.dispatch(h, w, ids, extra_tensors=[scale])
    out["dispatch values"] = [int(v) for v in got[0][:, 0].float().tolist()] + [int(v) for v in got[3][0][:, 0].tolist()]
    dp.calls.clear()
    record("router logits", manager.dispatch_router_logits(h, w))
    record("router logits extra", manager.dispatch_router_logits(h, w, extra_tensors=[scale]))
    record("sequence parallel", manager.dispatch(h, w, ids, is_sequence_parallel=True))
    big = torch.zeros(mine, 1 << 16, dtype=torch.bfloat16)  # above the EP slot
    record("above the slot", manager.dispatch(big, w, ids))
    x = torch.full((total, 16), float(rank + 1))
    record("combine", manager.combine(x))
    out["combine values"] = manager.combine(x)[:, 0].tolist()
    dp.calls.clear()
    record("combine sequence parallel", manager.combine(x, is_sequence_parallel=True))
    if hasattr(type(manager).__mro__[1], "allocate_combine_input"):  # vLLM's manager has them from 0.33 on
        into = torch.zeros(mine, 16)
        got = manager.combine_into_output(x, into)
        out["combine into output"] = {"same": got is into, "values": into[:, 0].tolist(), "vllm": list(dp.calls)}
        dp.calls.clear()
        sizes[:] = [2] * world  # vLLM's manager offers its buffer only for equal token counts
        out["allocate served"] = [manager.allocate_combine_input((2 * world, 16), torch.float32, "cpu") is None,
                                  list(dp.calls)]
        dp.calls.clear()
        manager.allocate_combine_input((2 * world, 12), torch.bfloat16, "cpu")  # 24-byte rows: not YALI's
        sizes[:] = counts
        out["allocate unserved"] = list(dp.calls)
        dp.calls.clear()
    dp.ranks = dp.ranks[::-1]  # another group than YALI's
    record("another group", manager.dispatch(h, w, ids))
    return out


def _worker(rank: int, port: int, world: int, outdir: str) -> None:
    from tests.core import gpu_stand_in

    with cpu_rank(rank, port, world, outdir) as (res, handler):
        ranks = list(range(world))
        cases = ["tp ok", "ep ok"] + [f"tp {f}" for f in FAILURES] + [f"ep {f}" for f in EP_FAILURES]
        groups = {c: dist.new_group(ranks, backend="gloo") for c in cases}
        comms = {c: _communicator(g, c.split(" ")[0] + ":0") for c, g in groups.items()}
        lib = gpu_stand_in.install({world: groups["tp ok"]}, world)
        os.environ.update({"YALI_WORLD_SIZES": "all", "YALI_EP": "1", "YALI_EP_SLOT_BYTES": "65536"})
        for case, group in groups.items():
            t0 = time.monotonic()
            kind, fail = case.split(" ", 1)
            lib.groups[world] = group
            lib.fail = fail if rank == 1 and fail != "ok" else None
            if kind == "tp":
                res[case] = _tp_case(comms[case], rank)
            else:
                res[case] = _ep_case(comms[case], rank, world)
            dist.barrier(group=group)
            res[f"{case} s"] = time.monotonic() - t0


@pytest.fixture(scope="module", params=(2, 4), ids=lambda n: f"{n}ranks")
def ranks(request, tmp_path_factory):
    n = request.param
    return run_cpu_ranks(_worker, n, outdir=tmp_path_factory.mktemp(f"live{n}"), world_size=n)


@pytest.mark.timeout(400)
def test_every_rank_gets_yali(ranks):
    assert same_on_every_rank(ranks, "tp ok") == [True, "ok", False]


@pytest.mark.parametrize("step", FAILURES)
def test_one_rank_failing_leaves_every_rank_on_vllms_chain(ranks, step):
    on, reason, warn = same_on_every_rank(ranks, f"tp {step}")
    assert not on and warn and FAILURES[step] in reason, reason
    _none_waited(ranks, f"tp {step}")


def _none_waited(ranks: list[dict], case: str) -> None:
    """Every rank got through `case` well within close()'s 10 s bound: none waited for another."""
    took = [r[f"{case} s"] for r in ranks]
    assert max(took) < 6, took


def test_every_rank_gets_yalis_ep(ranks):
    for rank, (cls, line, _) in enumerate(r["ep ok"] for r in ranks):  # each line names its rank
        assert cls.startswith("YaliAgRsAll2AllManager"), cls
        assert line.startswith(f"YALI EP ON for group 'ep:0' (rank {rank} of {len(ranks)},"), line


@pytest.mark.parametrize("step", EP_FAILURES)
def test_one_rank_failing_leaves_every_rank_on_vllms_manager(ranks, step):
    cls, line, routing = same_on_every_rank(ranks, f"ep {step}")
    assert cls == "AgRsAll2AllManager" and EP_FAILURES[step] in line and routing is None, line
    _none_waited(ranks, f"ep {step}")


def test_ep_manager_routes_and_returns_vllms_shapes(ranks):
    n = len(ranks)
    counts = [k + 1 for k in range(n)]
    total = sum(counts)
    for rank, res in enumerate(ranks):
        got = res["ep ok"][2]
        yali = {"vllm": []}
        assert got["dispatch"] == {**yali, "shapes": [[total, 64], [total, 2], [total, 2]]}
        assert got["dispatch extra"] == {**yali, "shapes": [[total, 64], [total, 2], [total, 2], [[total, 4]]]}
        assert got["dispatch values"] == [k for k in range(n) for _ in range(counts[k])] * 2
        assert got["router logits"] == {**yali, "shapes": [[total, 64], [total, 2]]}
        assert got["router logits extra"] == {**yali, "shapes": [[total, 64], [total, 2], [[total, 4]]]}
        assert got["sequence parallel"]["vllm"] == ["all_gatherv"]
        assert got["above the slot"]["vllm"] == ["all_gatherv"]
        assert got["another group"]["vllm"] == ["all_gatherv"]
        assert got["combine"] == {**yali, "shapes": [counts[rank], 16]}
        assert got["combine values"] == [float(sum(range(1, n + 1)))] * counts[rank]
        assert got["combine sequence parallel"]["vllm"] == ["reduce_scatterv"]
        if "allocate served" not in got:  # vLLM before 0.33: no combine into a given output
            assert vllm_release() < (0, 33), vllm_release()
            continue
        assert got["combine into output"] == {"same": True, "values": [float(sum(range(1, n + 1)))] * counts[rank],
                                              "vllm": []}
        assert got["allocate served"] == [True, []]
        assert got["allocate unserved"] == ["symmetric buffer"]
