"""CPU tests of the expert-parallel side of the vLLM plugin (yali_vllm/plugin/ep_manager.py, the EP
gate) against the real vLLM: its AgRsAll2AllManager's methods, and the set-up's decision over real
CudaCommunicators on gloo groups of 2 and 4 spawned CPU processes. The manager there is vLLM's
real class; its __init__ (which needs vLLM's DP group and config) is skipped, and its dp_group is a
stand-in carrying the ranks the gate compares. The real YaliCommunicator refuses on a CPU machine,
so the decisions below end OFF on every rank alike; tests/gpu/test_ep.py runs the kernels."""
from __future__ import annotations

import inspect
import os
import types

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager  # noqa: E402
from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator  # noqa: E402

from yali_vllm import config  # noqa: E402
from yali_vllm.plugin import ep_manager  # noqa: E402
from yali_vllm.plugin.gate import ep_gate, is_ep_group  # noqa: E402

from .cpu_ranks import cpu_rank, run_cpu_ranks, same_on_every_rank  # noqa: E402

HOST = ["h"]


def _gate(**kw):
    args = dict(unique_name="ep:0", manager_class="AgRsAll2AllManager", world_size=2, dp_world_size=2,
                same_ranks=True, hostnames=HOST * 2, platform_is_cuda=True, enabled=True)
    args.update(kw)
    return ep_gate(**args)


def test_ep_gate_serves_the_default_manager_of_a_dp_ep_group():
    for n in config.WORLD_SIZES:
        assert _gate(world_size=n, dp_world_size=n, hostnames=HOST * n) == (True, "ok")


@pytest.mark.parametrize("kwargs,why", [
    ({"unique_name": "tp:0"}, "not an expert-parallel group"),
    ({"manager_class": "DeepEPLLAll2AllManager"}, "DeepEPLLAll2AllManager; YALI serves the default"),
    ({"hook_problem": "AgRsAll2AllManager.combine is missing"}, "vLLM internals not recognised: AgRs"),
    ({"enabled": False}, "off: YALI_EP=1 turns it on"),
    ({"world_size": 3, "dp_world_size": 3, "hostnames": HOST * 3}, "world size is 3"),
    ({"platform_is_cuda": False}, "not CUDA"),
    ({"stateless": True}, "stateless"),
    ({"world_size": 4, "dp_world_size": 2, "hostnames": HOST * 4}, "data-parallel group (2 ranks)"),
    ({"same_ranks": False}, "which is not this 2-rank expert-parallel group"),
    ({"hostnames": ["a", "b"]}, "not on one host"),
    ({"p2p": False}, "no CUDA peer-to-peer access"),
])
def test_ep_gate_stays_off_with_the_reason(kwargs, why):
    ok, reason = _gate(**kwargs)
    assert not ok and why in reason, reason


def test_ep_group_is_vllms_ep_prefix_only():
    assert is_ep_group("ep:0") and is_ep_group("ep") and not is_ep_group("etp:0") and not is_ep_group("dp:0")


def test_installed_vllms_manager_has_the_methods_yali_overrides():
    assert ep_manager.agrs_hook_problem(AgRsAll2AllManager) is None


def test_a_changed_manager_is_named_and_left_alone():
    class Changed(AgRsAll2AllManager):
        def combine(self, hidden_states, is_sequence_parallel=False, out=None):
            return super().combine(hidden_states, is_sequence_parallel)

    problem = ep_manager.agrs_hook_problem(Changed)
    assert problem and "Changed.combine" in problem and "out" in problem


def test_yali_manager_is_a_subclass_whose_overrides_keep_vllms_signatures():
    cls = ep_manager.manager_class(AgRsAll2AllManager)
    assert ep_manager.manager_class(AgRsAll2AllManager) is cls  # made once
    assert issubclass(cls, AgRsAll2AllManager)
    for name in ("dispatch", "dispatch_router_logits", "combine", "allocate_combine_input", "combine_into_output",
                 "destroy"):
        base = getattr(AgRsAll2AllManager, name, None)
        if base is None:  # vLLM before 0.33 has no allocate_combine_input / combine_into_output
            continue
        mine = inspect.signature(getattr(cls, name))
        assert list(mine.parameters) == list(inspect.signature(base).parameters), name


def test_first_calls_log_one_line_per_process_group_and_path(caplog):
    """A line the first time a group's dispatch or combine is served by YALI and the first time it
    goes to vLLM's manager; never again in the process, also from a rebuilt manager."""
    from yali_vllm import vllm_log

    vllm_log.forget_logged()
    cls = ep_manager.manager_class(AgRsAll2AllManager)
    first, rebuilt = cls.__new__(cls), cls.__new__(cls)
    first.yali_group = rebuilt.yali_group = "ep:0"
    with caplog.at_level("INFO", logger=vllm_log.LOGGER):
        for m in (first, first, rebuilt):
            m._yali_log_first("dispatch", True, [1, 1])
            m._yali_log_first("combine", True, [1, 1])
            m._yali_log_first("dispatch", False, None)
    lines = [r.getMessage() for r in caplog.records if r.name == vllm_log.LOGGER]
    assert lines == ["YALI EP: first dispatch on group 'ep:0' served by YALI (tokens per rank [1, 1])",
                     "YALI EP: first combine on group 'ep:0' served by YALI (tokens per rank [1, 1])",
                     "YALI EP: first dispatch on group 'ep:0' that YALI does not serve (sequence-parallel, "
                     "another group, or above YALI_EP_SLOT_BYTES): vLLM's AgRsAll2AllManager"], lines


def test_ep_slot_bytes_setting():
    assert config.ep_slot_bytes({}) == config.EP_SLOT_DEFAULT == 2 << 20
    assert config.ep_slot_bytes({"YALI_EP_SLOT_BYTES": "65536"}) == 65536
    for bad in ("1000", "0", "-4096", "1G", str(512 << 20)):
        with pytest.raises(ValueError, match="YALI_EP_SLOT_BYTES"):
            config.ep_slot_bytes({"YALI_EP_SLOT_BYTES": bad})
    assert "YALI_EP" in config.SETTINGS and "YALI_EP_SLOT_BYTES" in config.SETTINGS
    config.check_environment({"YALI_EP": "0", "YALI_EP_SLOT_BYTES": "4096"})  # known names


def test_ep_info_carries_what_the_p2p_check_reads():
    """On GPUs every rank's info names its CUDA device, and the P2P check then compares the ranks'
    CUDA_VISIBLE_DEVICES: the info must carry it (a KeyError there left EP off on every GPU host)."""
    from yali_vllm.plugin.collective import p2p_from_info

    comm = types.SimpleNamespace(ranks=[0, 1], device=torch.device("cuda", 0))
    infos = [ep_manager._ep_info(comm, _manager([0, 1])) for _ in range(2)]
    infos[1]["device"] = 1
    assert all("visible" in i for i in infos)
    expected = None if torch.cuda.device_count() < 2 else p2p_from_info(infos)
    assert p2p_from_info(infos) == expected


# ------------------------------------------- N real ranks on CPU (gloo)
def _manager(dp_ranks: list[int]) -> AgRsAll2AllManager:
    """vLLM's manager without its __init__ (which needs vLLM's DP group); dp_group stands in."""
    m = AgRsAll2AllManager.__new__(AgRsAll2AllManager)
    m.dp_group = types.SimpleNamespace(ranks=list(dp_ranks))
    m.dp_world_size = len(dp_ranks)
    return m


def _case(comm, manager, handler) -> list:
    """[the manager's class afterwards, the line setup_ep logged], once it is the line it returned."""
    comm.all2all_manager = manager
    line = ep_manager.setup_ep(comm, platform_is_cuda=True)
    assert handler.lines[-1] == line, (handler.lines[-1:], line)
    return [type(manager).__name__, line]


def _ep_worker(rank: int, port: int, world_size: int, outdir: str) -> None:
    with cpu_rank(rank, port, world_size, outdir) as (res, handler):
        ranks = list(range(world_size))
        group = dist.new_group(ranks, backend="gloo")
        comm = CudaCommunicator(cpu_group=group, device=torch.device("cpu"), device_group=group, unique_name="ep:0")
        res["no_manager"] = ep_manager.setup_ep(comm, platform_is_cuda=True)
        res["default_off"] = _case(comm, _manager(ranks), handler)  # YALI_EP unset
        os.environ["YALI_EP"] = "1"
        res["refused"] = _case(comm, _manager(ranks), handler)
        os.environ["YALI_EP"] = "0" if rank == 1 else "1"
        res["one_off"] = _case(comm, _manager(ranks), handler)
        os.environ["YALI_EP"] = "1"
        os.environ["YALI_EP_SLOT_BYTES"] = "12345"
        res["bad_slot"] = _case(comm, _manager(ranks), handler)
        os.environ["YALI_EP_SLOT_BYTES"] = "8192" if rank == 0 else "4096"
        res["slots_differ"] = _case(comm, _manager(ranks), handler)
        del os.environ["YALI_EP_SLOT_BYTES"]
        res["other_dp_group"] = _case(comm, _manager(ranks[::-1]), handler)
        res["cpu_platform"] = [ep_manager.setup_ep(comm, platform_is_cuda=False)]
        comm.all2all_manager = None
        comm.destroy()


@pytest.fixture(scope="module", params=(2, 4), ids=lambda n: f"{n}ranks")
def ep_ranks(request, tmp_path_factory):
    n = request.param
    return run_cpu_ranks(_ep_worker, n, outdir=tmp_path_factory.mktemp(f"ep{n}"), world_size=n)


def test_ranks_without_a_manager_are_left_alone(ep_ranks):
    assert same_on_every_rank(ep_ranks, "no_manager") == ""


def test_ranks_agree_when_the_communicator_refuses(ep_ranks):
    cls, line = same_on_every_rank(ep_ranks, "refused")
    assert cls == "AgRsAll2AllManager"  # vLLM's manager is left as it was
    assert line.startswith("YALI EP OFF for group 'ep:0': rank 0 of the group: YaliUnavailable"), line


def test_ranks_leave_ep_off_by_default(ep_ranks):
    cls, line = same_on_every_rank(ep_ranks, "default_off")
    assert cls == "AgRsAll2AllManager" and "off: YALI_EP=1 turns it on" in line, line


def test_ranks_agree_on_each_refusal(ep_ranks):
    n = len(ep_ranks)
    assert same_on_every_rank(ep_ranks, "one_off") == ["AgRsAll2AllManager",
                                          "YALI EP OFF for group 'ep:0': off: YALI_EP=1 turns it on (off by default until GPU runs have measured it; YALI_ENABLE=0 keeps it off)"]
    cls, line = same_on_every_rank(ep_ranks, "bad_slot")
    assert "invalid YALI_* setting: invalid YALI_EP_SLOT_BYTES='12345'" in line and cls == "AgRsAll2AllManager"
    cls, line = same_on_every_rank(ep_ranks, "slots_differ")
    assert f"YALI_EP_SLOT_BYTES differ: {[8192] + [4096] * (n - 1)}" in line
    cls, line = same_on_every_rank(ep_ranks, "other_dp_group")
    assert f"which is not this {n}-rank expert-parallel group" in line
    assert same_on_every_rank(ep_ranks, "cpu_platform") == ["YALI EP OFF for group 'ep:0': vLLM platform is not CUDA"]
