"""CPU tests of the vLLM plugin (yali_vllm/plugin/) against the real vLLM.

Everything here uses vLLM's real classes: the plugin patches vLLM's own
CudaCommunicator, and the multi-rank tests build real CudaCommunicators over
real gloo process groups of 2 and 4 spawned CPU processes (vLLM's CUDA-only
members stay off on a CPU machine).  The only stand-ins are fake YALI
communicator objects in test_dispatch_* (to drive the dispatch wrapper on CPU
tensors) and in the multi-rank checkpoint case (to drive the decision over a
real gloo group): a real YaliCommunicator needs a GPU; see
tests/gpu/test_vllm_e2e.py for the real thing.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import socket
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from vllm.distributed.device_communicators.cuda_communicator import (  # noqa: E402
    CudaCommunicator,
)

from benchmarks.common.processes import free_port  # noqa: E402
from yali_vllm import config, plugin, vllm_log  # noqa: E402
from yali_vllm.plugin import fusion_patch, gate, group_setup, patch, stats, touch_points  # noqa: E402
from yali_vllm.plugin.gate import yali_gate  # noqa: E402
from .cpu_ranks import cpu_rank, run_cpu_ranks, same_on_every_rank  # noqa: E402

ENTRY_POINT = "yali_vllm.plugin:register"


@pytest.fixture
def unpatched():
    """vLLM's CudaCommunicator as shipped, restored after the test."""
    patch.unpatch_class(CudaCommunicator)
    yield CudaCommunicator
    patch.unpatch_class(CudaCommunicator)


@pytest.fixture
def patched(unpatched):
    plugin.register()
    assert patch.is_patched(CudaCommunicator)
    yield CudaCommunicator


# ----------------------------------------------------------------- YALI_ENABLE
@pytest.mark.parametrize("raw", ["1", "true", "YES", " on ", "True"])
def test_enable_true_values(raw):
    assert gate.parse_enable({"YALI_ENABLE": raw}) is True


@pytest.mark.parametrize("raw", ["0", "false", "No", "OFF"])
def test_enable_false_values(raw):
    assert gate.parse_enable({"YALI_ENABLE": raw}) is False


@pytest.mark.parametrize("env", [{}, {"YALI_ENABLE": ""}, {"YALI_ENABLE": "  "}])
def test_enable_default_is_on(env):
    assert gate.parse_enable(env) is True


@pytest.mark.parametrize("raw", ["2", "maybe", "enable", "y"])
def test_enable_bad_value_names_variable(raw):
    with pytest.raises(ValueError) as e:
        gate.parse_enable({"YALI_ENABLE": raw})
    msg = str(e.value)
    assert "YALI_ENABLE" in msg and repr(raw) in msg
    for accepted in ("1/0", "true/false", "yes/no", "on/off"):
        assert accepted in msg


# ----------------------------------------------------------------------- gating
@pytest.fixture
def every_world_size(monkeypatch):
    """YALI_WORLD_SIZES=all: the plugin serves every world size the kernels serve."""
    monkeypatch.setenv("YALI_WORLD_SIZES", "all")


@pytest.mark.parametrize("world_size", [2, 4, 6, 8])
def test_gate_on_for_served_world_sizes_on_one_host(world_size, every_world_size):
    assert world_size in config.WORLD_SIZES
    assert yali_gate("tp:0", world_size, ["gpu-a"] * world_size, True, True) == (True, "ok")
    assert yali_gate("tp:3", world_size, ["h"] * world_size, True, True, p2p=True) == (True, "ok")


@pytest.mark.parametrize("world_size", [6, 8])
def test_gate_leaves_unmeasured_world_sizes_off_by_default(world_size, monkeypatch):
    """Only world sizes whose serving runs show YALI at parity with vLLM's defaults are on
    without YALI_WORLD_SIZES; the reason names the result and the variable that turns it on."""
    monkeypatch.delenv("YALI_WORLD_SIZES", raising=False)
    assert yali_gate("tp:0", 2, ["h"] * 2, True, True) == (True, "ok")
    assert yali_gate("tp:0", 4, ["h"] * 4, True, True, p2p=True) == (True, "ok")
    ok, reason = yali_gate("tp:0", world_size, ["h"] * world_size, True, True, p2p=True)
    assert not ok
    assert reason == (f"world size {world_size} is off by default: {config.OFF_BY_DEFAULT[world_size]}; "
                      f"YALI_WORLD_SIZES=2,4,{world_size} turns it on")
    monkeypatch.setenv("YALI_WORLD_SIZES", f"2,{world_size}")
    assert yali_gate("tp:0", world_size, ["h"] * world_size, True, True, p2p=True) == (True, "ok")
    monkeypatch.setenv("YALI_WORLD_SIZES", str(world_size))  # two ranks, on by default, left out by the variable
    ok, reason = yali_gate("tp:0", 2, ["h"] * 2, True, True)
    assert not ok and reason == (f"world size 2 is not in YALI_WORLD_SIZES={world_size}; "
                                 f"YALI_WORLD_SIZES=2,{world_size} turns it on")


@pytest.mark.parametrize("raw, bad", [("3", "'3'"), ("2,x", "'x'"), ("2;4", "'2;4'"), ("16", "'16'"), ("2,,4", "''")])
def test_world_sizes_bad_value_names_the_variable(raw, bad, monkeypatch):
    monkeypatch.setenv("YALI_WORLD_SIZES", raw)
    with pytest.raises(ValueError) as e:
        config.plugin_world_sizes()
    msg = str(e.value)
    assert f"invalid YALI_WORLD_SIZES={raw!r}" in msg and f"{bad} is not a world size YALI serves" in msg
    assert "2, 4, 6, 8" in msg
    ok, reason = yali_gate("tp:0", 2, ["h"] * 2, True, True)
    assert not ok and reason == f"invalid YALI_* setting: {msg}"


@pytest.mark.parametrize("raw, sizes", [("", (2, 4)), ("2", (2,)), (" 4 , 2 ", (2, 4)), ("all", (2, 4, 6, 8)),
                                        ("ALL", (2, 4, 6, 8)), ("8,8", (8,))])
def test_world_sizes_values(raw, sizes):
    assert config.plugin_world_sizes({"YALI_WORLD_SIZES": raw}) == sizes
    assert config.plugin_world_sizes({}) == config.DEFAULT_WORLD_SIZES == (2, 4)


@pytest.mark.parametrize("world_size", [1, 3, 5, 7, 16])
def test_gate_refuses_other_world_sizes_with_the_reason(world_size):
    ok, reason = yali_gate("tp:0", world_size, ["h"] * world_size, True, True, p2p=True)
    assert not ok
    assert reason == config.world_size_refusal(world_size)
    assert reason == f"world size is {world_size}; YALI serves 2, 4, 6 or 8 ranks"


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_gate_p2p_refusal_names_every_pair(world_size, every_world_size):
    ok, reason = yali_gate("tp:0", world_size, ["h"] * world_size, True, True, p2p=False)
    assert not ok
    assert reason == f"no CUDA peer-to-peer access between every pair of the group's {world_size} GPUs"


@pytest.mark.parametrize(
    "kwargs, why",
    [
        # Non-TP groups: the names vLLM gives its other groups.
        (dict(unique_name="pp:0"), "not a tensor-parallel group"),
        (dict(unique_name="dp:0"), "not a tensor-parallel group"),
        (dict(unique_name="ep:0"), "not a tensor-parallel group"),
        (dict(unique_name="world:0"), "not a tensor-parallel group"),
        (dict(unique_name=""), "not a tensor-parallel group"),
        (dict(world_size=1, hostnames=["h"]), "world size is 1"),
        (dict(world_size=3, hostnames=["h"] * 3), "world size is 3"),
        (dict(hostnames=["node-a", "node-b"]), "not on one host"),
        (dict(hostnames=["h"]), "not on one host"),
        (dict(world_size=4, hostnames=["h", "h", "h", "node-b"]), "not on one host"),
        (dict(enabled=False), "disabled by YALI_ENABLE"),
        (dict(platform_is_cuda=False), "platform is not CUDA"),
        (dict(custom_ar_enabled=False), "custom all-reduce is disabled"),
        (dict(p2p=False), "no CUDA peer-to-peer"),
        (dict(stateless=True), "stateless"),
    ],
)
def test_gate_stays_off(kwargs, why, every_world_size):
    args = dict(
        unique_name="tp:0",
        world_size=2,
        hostnames=["h", "h"],
        platform_is_cuda=True,
        enabled=True,
    )
    args.update(kwargs)
    ok, reason = yali_gate(**args)
    assert not ok
    assert why in reason


def test_gate_uses_vllms_tp_name_test():
    # vLLM names groups "<name>:<index>" (parallel_state._get_unique_name) and
    # enables its TP-only backends for the exact name "tp" (0.30+ has "etp" groups too).
    from vllm.distributed.parallel_state import _get_unique_name

    assert gate.is_tp_group(_get_unique_name("tp"))
    for other in ("pp", "etp", "dcp", "pcp", "ep", "world"):
        assert not gate.is_tp_group(_get_unique_name(other)), other


def test_gate_leaves_batch_invariant_mode_to_vllm():
    ok, reason = yali_gate("tp:0", 2, ["h", "h"], True, True, batch_invariant=True)
    assert not ok and "VLLM_BATCH_INVARIANT=1" in reason


@pytest.mark.parametrize("version,inside", [
    ("0.26.0", True), ("0.29.1", True), ("0.33.0", True), ("0.33.2.dev5+gabc", True),
    ("0.25.1", False), ("0.34.0", False), ("1.0.0", False), ("unknown", False),
])
def test_supported_range(version, inside):
    assert plugin.in_supported_range(version) is inside


def test_installed_vllm_is_in_the_supported_range():
    import vllm

    assert plugin.in_supported_range(vllm.__version__), vllm.__version__


def test_optional_hooks_follow_the_installed_vllm(unpatched):
    # suspend (0.30+) and checkpoint_prepare (0.27+) are wrapped where vLLM's class defines them.
    shipped = {t.symbol: unpatched.__dict__.get(t.symbol) for t in touch_points.on(touch_points.COMMUNICATOR)
               if t.optional}
    assert set(shipped) == {"suspend", "checkpoint_prepare"}
    plugin.register()
    for name, fn in shipped.items():
        if callable(fn):
            assert unpatched.__dict__[name].__wrapped__ is fn, name
        else:
            assert name not in unpatched.__dict__, name
    patch.unpatch_class(unpatched)
    assert {n: unpatched.__dict__.get(n) for n in shipped} == shipped


# -------------------------------------------------------------- registration
def _our_distribution():
    for name in ("yali-vllm", "yali_vllm"):
        try:
            return importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def test_entry_point_registered_in_metadata():
    dist_ = _our_distribution()
    if dist_ is None:
        pytest.skip("yali-vllm is not pip-installed (no package metadata)")
    eps = [ep for ep in dist_.entry_points if ep.group == "vllm.general_plugins"]
    assert [(ep.name, ep.value) for ep in eps] == [("yali", ENTRY_POINT)]
    # And vLLM's own loader finds it and hands back our register().
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert plugins.get("yali") is plugin.register


def test_wheel_ships_every_package():
    # pyproject.toml lists the packages a wheel (deploy/Dockerfile) installs: yali_vllm.plugin too.
    # Read from the imported package: the checkout, or the installed wheel in CI's wheel legs.
    import yali_vllm

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parents[2]
    listed = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    pkg = Path(yali_vllm.__file__).parent
    found = [".".join(p.parent.relative_to(pkg.parent).parts) for p in sorted(pkg.rglob("__init__.py"))]
    assert sorted(listed) == found


def test_hook_points_of_installed_vllm_are_recognised():
    # Fails loudly on a vLLM upgrade that moves the hook points.
    assert patch.check_hook_points(CudaCommunicator) is None


def test_register_patches_real_class_once(unpatched):
    originals = {n: CudaCommunicator.__dict__[n] for n in ("__init__", "all_reduce", "destroy")}
    plugin.register()
    assert patch.is_patched(CudaCommunicator)
    wrappers = {n: CudaCommunicator.__dict__[n] for n in originals}
    for name in originals:
        assert wrappers[name] is not originals[name]
        assert wrappers[name].__wrapped__ is originals[name]
    # vLLM may load general plugins more than once per process.
    plugin.register()
    plugin.register()
    for name in originals:
        assert CudaCommunicator.__dict__[name] is wrappers[name]
    # The patched class still passes the hook-point check (signatures kept).
    assert patch.check_hook_points(CudaCommunicator) is None
    patch.unpatch_class(CudaCommunicator)
    for name in originals:
        assert CudaCommunicator.__dict__[name] is originals[name]


def test_register_survives_missing_vllm_module(monkeypatch, caplog):
    monkeypatch.setattr(plugin, "_COMM_MODULE", "vllm.no_such_module_for_yali")
    with caplog.at_level(logging.WARNING, logger="vllm.yali"):
        plugin.register()  # must not raise
    assert "cannot be loaded" in caplog.text and "YALI stays off" in caplog.text


class _NoAllReduce:
    """A communicator of a hypothetical future vLLM that renamed all_reduce."""

    def __init__(self, cpu_group, device=None, device_group=None, unique_name=""):
        pass

    def all_reduce_v2(self, input_):
        return input_

    def destroy(self):
        pass


class _NewAllReduceSignature(_NoAllReduce):
    """... whose all_reduce grew a parameter."""

    def all_reduce(self, input_, out=None):
        return input_

    def destroy(self):
        pass


class _RenamedInitParams:
    """... whose constructor no longer takes cpu_group/unique_name."""

    def __init__(self, group, device=None, name=""):
        pass

    def all_reduce(self, input_):
        return input_

    def destroy(self):
        pass


@pytest.mark.parametrize("cls", [_NoAllReduce, _NewAllReduceSignature, _RenamedInitParams])
def test_unrecognised_internals_left_untouched(cls, caplog):
    before = dict(cls.__dict__)
    assert patch.check_hook_points(cls) is not None
    with caplog.at_level(logging.WARNING, logger="vllm.yali"):
        assert patch.patch_class(cls) is False
    assert dict(cls.__dict__) == before
    assert "internals not recognised" in caplog.text


# ------------------------------------------------- dispatch wrapper (CPU, fake)
class FakeYali:
    """Stand-in for a YaliCommunicator (which needs GPUs): records calls."""

    def __init__(self, use: bool):
        self.use = use
        self.calls = 0
        self.closed = 0

    def should_use(self, x):
        return self.use

    def all_reduce(self, x, out=None):
        self.calls += 1
        return torch.full_like(x, -7.0)

    def close(self):
        self.closed += 1


@pytest.fixture
def single_rank_comm(patched):
    """A real, patched vLLM CudaCommunicator over a 1-rank gloo group on CPU."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        group = dist.new_group([0], backend="gloo")
        comm = CudaCommunicator(
            cpu_group=group, device=torch.device("cpu"), device_group=group, unique_name="tp:0"
        )
        yield comm
        comm.destroy()
    finally:
        dist.destroy_process_group()


def test_dispatch_falls_through_to_vllm_chain(single_rank_comm):
    """Fake YALI communicator (stated above): should_use() False -> vLLM's chain."""
    comm = single_rank_comm
    assert comm.yali_comm is None  # the real gate said no: world size 1
    x = torch.arange(8, dtype=torch.float32)
    assert torch.equal(comm.all_reduce(x), x)  # vLLM's chain, gloo, 1 rank
    fake = FakeYali(use=False)
    comm.yali_comm = fake
    assert torch.equal(comm.all_reduce(x), x)
    assert fake.calls == 0


def test_dispatch_uses_yali_first(single_rank_comm):
    """Fake YALI communicator (stated above): should_use() True -> YALI's result."""
    comm = single_rank_comm
    fake = FakeYali(use=True)
    comm.yali_comm = fake
    out = comm.all_reduce(torch.ones(4))
    assert fake.calls == 1 and torch.equal(out, torch.full((4,), -7.0))


class FakeCustomAR:
    """Stand-in for vLLM's CustomAllreduce (needs GPUs): serves everything it is offered."""

    disabled = False

    def __init__(self):
        self.calls = 0

    def should_custom_ar(self, x):
        return True

    def custom_all_reduce(self, x):
        self.calls += 1
        return torch.full_like(x, -3.0)


def test_dispatch_prefers_yali_over_custom_ar_at_every_size(single_rank_comm):
    """Fakes for both communicators (stated above): YALI measured faster than vLLM's
    custom all-reduce at every size, so YALI serves everything it takes, also where
    the custom all-reduce would take the tensor; the rest goes to vLLM's chain."""
    comm = single_rank_comm
    fake, ca = FakeYali(use=True), FakeCustomAR()
    comm.yali_comm, saved, comm.ca_comm = fake, comm.ca_comm, ca
    try:
        for nbytes in [64 << 10, 128 << 10, 256 << 10, (1 << 20) - 16, 1 << 20, 4 << 20]:
            assert comm.all_reduce(torch.ones(nbytes // 4))[0].item() == -7.0, nbytes
        assert fake.calls == 6 and ca.calls == 0
        fake.use = False  # YALI refuses: vLLM's chain (its custom all-reduce) serves
        assert comm.all_reduce(torch.ones((256 << 10) // 4))[0].item() == -3.0
        assert ca.calls == 1
    finally:
        comm.ca_comm = saved


def test_dispatch_logs_backend_once_per_size_class(single_rank_comm, caplog, monkeypatch):
    """Fakes (stated above): the first all-reduce of each dtype and size class
    logs which backend served it; repeats do not, and do not ask the library for the
    kernel's name either (the dispatch path stays a set lookup). The library is asked
    for the group's world size."""
    comm = single_rank_comm
    comm.yali_comm = FakeYali(use=True)
    asked = []
    real = stats._yali_kernel
    monkeypatch.setattr(stats, "_yali_kernel", lambda n, w: asked.append((n, w)) or real(n, w))
    with caplog.at_level(logging.INFO, logger="vllm.yali"):
        for _ in range(3):
            comm.all_reduce(torch.ones(1000))  # 4000 bytes: size class 2048..4095
            comm.all_reduce(torch.ones(10, dtype=torch.bfloat16))
        comm.yali_comm.use = False
        comm.all_reduce(torch.ones(1000))
    lines = [r.getMessage() for r in caplog.records if "YALI dispatch" in r.getMessage()]
    assert len(lines) == 3, lines
    assert "torch.float32 all-reduces of 2048..4095 bytes -> yali" in lines[0]
    assert "torch.bfloat16 all-reduces of 16..31 bytes -> yali" in lines[1]
    assert lines[2].endswith("-> vLLM's all-reduce chain")
    assert asked == [(4000, 1), (20, 1)]  # once per new YALI line, never on a repeat


def test_dispatch_below_info_logs_later_when_info_is_on(single_rank_comm, caplog):
    """Fake (stated above): below INFO the dispatch records nothing, so a size class first
    served then still gets its line once INFO logging is on."""
    comm = single_rank_comm
    comm.yali_comm = FakeYali(use=True)
    with caplog.at_level(logging.WARNING, logger="vllm.yali"):
        comm.all_reduce(torch.ones(1000))
    assert not [r for r in caplog.records if "YALI dispatch" in r.getMessage()]
    with caplog.at_level(logging.INFO, logger="vllm.yali"):
        comm.all_reduce(torch.ones(1000))
        comm.all_reduce(torch.ones(1000))
    lines = [r.getMessage() for r in caplog.records if "YALI dispatch" in r.getMessage()]
    assert len(lines) == 1 and "torch.float32 all-reduces of 2048..4095 bytes -> yali" in lines[0]


def test_destroy_closes_yali(single_rank_comm):
    comm = single_rank_comm
    fake = FakeYali(use=True)
    comm.yali_comm = fake
    comm.destroy()
    assert fake.closed == 1 and comm.yali_comm is None
    comm.destroy()  # vLLM may call destroy again at shutdown
    assert fake.closed == 1


@pytest.mark.parametrize("failed, world_size, reason", [
    ([(0, "no GPU"), (1, "no GPU"), (2, "no GPU"), (3, "no GPU")], 4, "no GPU"),
    ([(2, "no GPU")], 4, "rank 2 of the group: no GPU"),
    ([(0, "no GPU"), (1, "bad device")], 2, "rank 0 of the group: no GPU"),
])
def test_setup_failure_reason_is_one_text_for_every_rank(failed, world_size, reason):
    # Every rank computes it from the same gathered results, so every rank logs this text.
    assert group_setup._agreed_failure(failed, world_size) == reason


def test_setup_refuses_unrecognised_communicator_object():
    yc, reason, warn = group_setup.setup_yali(object(), platform_is_cuda=True)
    assert yc is None and warn
    assert "vLLM internals not recognised" in reason and "unique_name" in reason


# --------------------------------------------------- fusion note (real config)
def test_fusion_note_follows_vllm_config():
    from vllm.config import (
        CompilationConfig,
        DeviceConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.config.compilation import CompilationMode, PassConfig

    def note(mode, fuse):
        cfg = VllmConfig(
            device_config=DeviceConfig(device="cpu"),
            compilation_config=CompilationConfig(
                mode=mode, pass_config=PassConfig(fuse_allreduce_rms=fuse)
            ),
        )
        with set_current_vllm_config(cfg):
            return fusion_patch.fusion_note()

    text = note(CompilationMode.VLLM_COMPILE, True)
    assert text and "fuse_allreduce_rms" in text
    assert note(CompilationMode.VLLM_COMPILE, False) is None
    assert note(CompilationMode.NONE, True) is None  # eager: the pass never runs
    assert fusion_patch.fusion_note() is None  # no config set


# ------------------------------------------- N real ranks on CPU (gloo)
# The world sizes of the multi-rank tests: YALI's two-rank path and its N-rank one.
CPU_WORLD_SIZES = (2, 4)


def _decision(comm) -> list:
    yc, reason, warn = group_setup.setup_yali(comm, platform_is_cuda=True)
    assert yc is None
    return [reason, warn]


class _StandInYali:
    """What checkpoint_release uses of a YaliCommunicator: captured, synchronize(), close()."""

    def __init__(self, captured: bool):
        self.captured, self.synced, self.closed = captured, False, False

    def synchronize(self):
        self.synced = True

    def close(self):
        self.closed = True


def _checkpoint_cases(comm, rank: int) -> dict:
    out = {}
    for case, captured_on in {"none_captured": (), "one_captured": (0,)}.items():
        yc = _StandInYali(rank in captured_on)
        comm.yali_comm = yc
        what = group_setup.checkpoint_release(comm)
        out[case] = [comm.yali_comm is None, yc.closed, yc.synced, what]
    comm.yali_comm = None
    return out


def _cpu_communicator(group, name: str) -> CudaCommunicator:
    return CudaCommunicator(cpu_group=group, device=torch.device("cpu"), device_group=group, unique_name=name)


def _unserved_group_case(group) -> dict:
    """A "tp:1" CudaCommunicator over `group`, whose world size YALI does not serve: whether the
    plugin gave it YALI, and the decision as if the platform were CUDA."""
    comm = _cpu_communicator(group, "tp:1")
    try:
        return {"yali_comm": comm.yali_comm is not None, "cuda": _decision(comm)}
    finally:
        comm.destroy()


def _rank_worker(rank: int, port: int, world_size: int, outdir: str) -> None:
    """Spawned `world_size` times.  Builds real vLLM CudaCommunicators ("tp:0" over every
    rank, "tp:1" over all ranks but the last) on CPU and records what the plugin decided;
    written to rank<N>.json."""
    os.environ["YALI_ENABLE"] = "1"
    os.environ["YALI_WORLD_SIZES"] = "all"  # every world size the kernels serve; the default is below
    with cpu_rank(rank, port, world_size, outdir) as (res, handler):
        plugin.register()
        ranks = list(range(world_size))
        group = dist.new_group(ranks, backend="gloo")
        unserved = dist.new_group(ranks[:-1], backend="gloo")  # every rank takes part in new_group

        comm = _cpu_communicator(group, "tp:0")
        res["tp_yali_comm"] = comm.yali_comm is not None
        # vLLM's chain still reduces (gloo, through the patched all_reduce).
        res["sum"] = comm.all_reduce(torch.full((4,), float(rank + 1))).tolist()
        pp = _cpu_communicator(group, "pp:0")
        res["pp_yali_comm"] = pp.yali_comm is not None
        if rank < world_size - 1:
            res["unserved"] = _unserved_group_case(unserved)
        res["log"] = list(handler.lines)

        # Same group, as if the platform were CUDA: the per-rank inputs are
        # gathered and the real YaliCommunicator is asked (it refuses on CPU).
        res["info"] = group_setup.gather_group_info(comm)
        res["cuda_enabled"] = _decision(comm)
        group_setup.log_off(comm, *res["cuda_enabled"])  # the line after_init logs on a CUDA platform
        res["cuda_enabled_line"] = handler.lines[-1]
        os.environ["YALI_ENABLE"] = "0"
        res["cuda_disabled"] = _decision(comm)
        # Off on one rank only: every rank must agree on off.
        os.environ["YALI_ENABLE"] = "0" if rank == 1 else "1"
        res["cuda_one_disabled"] = _decision(comm)
        os.environ["YALI_ENABLE"] = "sometimes"
        res["cuda_bad_enable"] = _decision(comm)
        os.environ["YALI_ENABLE"] = "1"
        os.environ["YALI_MAX_BYTE"] = "1M"  # a typo of YALI_MAX_BYTES
        res["cuda_unknown_var"] = _decision(comm)
        del os.environ["YALI_MAX_BYTE"]
        os.environ["YALI_FUSION"] = "1" if rank == 0 else "0"
        res["cuda_fusion_differs"] = _decision(comm)
        # YALI_FUSION=1 on rank 0 only: the same passes as unset, so the ranks agree
        os.environ["YALI_FUSION"] = "1"
        if rank != 0:
            del os.environ["YALI_FUSION"]
        res["cuda_fusion_set_agrees"] = _decision(comm)
        os.environ.pop("YALI_FUSION", None)
        os.environ["YALI_FUSE_QUANT"] = "1" if rank == 0 else "0"  # quantised pairs to YALI on rank 0 only
        res["cuda_fuse_quant_differs"] = _decision(comm)
        os.environ.pop("YALI_FUSE_QUANT")
        del os.environ["YALI_WORLD_SIZES"]  # the default: two and four ranks
        res["cuda_default_world_sizes"] = _decision(comm)
        os.environ["YALI_WORLD_SIZES"] = "8"  # leaves this group's world size out
        res["cuda_left_out_world_size"] = _decision(comm)
        os.environ["YALI_WORLD_SIZES"] = "2,5"
        res["cuda_bad_world_sizes"] = _decision(comm)
        os.environ["YALI_WORLD_SIZES"] = "all"
        comm.use_custom_allreduce = False  # as under --disable-custom-all-reduce
        res["cuda_no_custom_ar"] = _decision(comm)
        res["checkpoint"] = _checkpoint_cases(comm, rank)
        comm.destroy()
        pp.destroy()


@pytest.fixture(scope="module", params=CPU_WORLD_SIZES, ids=lambda n: f"{n}ranks")
def cpu_ranks(request, tmp_path_factory):
    """Every rank's result of _rank_worker on a gloo group of `request.param` ranks."""
    world_size = request.param
    outdir = tmp_path_factory.mktemp(f"ranks{world_size}")
    return run_cpu_ranks(_rank_worker, world_size, outdir=outdir, world_size=world_size)


def test_ranks_off_on_cpu_platform_and_vllm_chain_still_reduces(cpu_ranks):
    n = len(cpu_ranks)
    for res in cpu_ranks:
        assert res["tp_yali_comm"] is False and res["pp_yali_comm"] is False
        assert res["sum"] == [n * (n + 1) / 2] * 4
        tp_lines = [ln for ln in res["log"] if "group 'tp:0'" in ln]
        assert tp_lines == [f"YALI all-reduce OFF for group 'tp:0': vLLM platform is not CUDA (world size {n})"]
        assert any(
            "group 'pp:0'" in ln and "not a tensor-parallel group" in ln for ln in res["log"]
        )


def test_ranks_refuse_a_world_size_yali_does_not_serve(cpu_ranks):
    n = len(cpu_ranks) - 1  # the "tp:1" group: every rank but the last
    refusal = config.world_size_refusal(n)
    assert refusal is not None and f"world size is {n}" in refusal
    members = cpu_ranks[:-1]
    assert same_on_every_rank(members, "unserved") == {"yali_comm": False, "cuda": [refusal, False]}
    for res in members:
        tp1_lines = [ln for ln in res["log"] if "group 'tp:1'" in ln]
        assert tp1_lines == [f"YALI all-reduce OFF for group 'tp:1': {refusal} (world size {n})"]
    assert "unserved" not in cpu_ranks[-1]


def test_ranks_checkpoint_releases_yali_only_when_no_graph_captured_it(cpu_ranks):
    for res in cpu_ranks:
        off, closed, synced, what = res["checkpoint"]["none_captured"]
        assert off and closed and synced and "released" in what
        # Rank 0's graph captured YALI: every rank keeps it (the decision is agreed).
        off, closed, synced, what = res["checkpoint"]["one_captured"]
        assert not off and not closed and synced and "CUDA graphs captured" in what


def test_ranks_gather_identical_info(cpu_ranks):
    info = same_on_every_rank(cpu_ranks, "info")
    assert len(info) == len(cpu_ranks)
    assert {i["host"] for i in info} == {socket.gethostname()}


def test_ranks_agree_on_the_communicator_refusal(cpu_ranks):
    """The TP group passes the gate at every served world size; on a CPU machine the real
    YaliCommunicator refuses, and every rank gives the same reason and falls back."""
    try:
        import yali_vllm.communicator  # noqa: F401
    except Exception:
        expected = "cannot be imported"
    else:
        expected = "YALI unavailable"  # YaliUnavailable raised on a CPU machine
    reason, warn = same_on_every_rank(cpu_ranks, "cuda_enabled")
    assert expected in reason and warn, reason
    line = same_on_every_rank(cpu_ranks, "cuda_enabled_line")
    assert line == f"YALI all-reduce OFF for group 'tp:0': {reason} (world size {len(cpu_ranks)})"


def test_ranks_agree_on_yali_enable(cpu_ranks):
    n = len(cpu_ranks)
    assert same_on_every_rank(cpu_ranks, "cuda_disabled") == ["disabled by YALI_ENABLE", False]
    assert same_on_every_rank(cpu_ranks, "cuda_one_disabled") == ["disabled by YALI_ENABLE", False]
    reason, warn = same_on_every_rank(cpu_ranks, "cuda_bad_enable")
    assert "invalid YALI_* setting" in reason and warn
    assert "invalid YALI_ENABLE='sometimes'" in reason
    reason, warn = same_on_every_rank(cpu_ranks, "cuda_unknown_var")
    assert "unknown YALI_* variable(s) YALI_MAX_BYTE='1M'" in reason and warn
    reason, warn = same_on_every_rank(cpu_ranks, "cuda_fusion_differs")
    settings = ["on"] + ["off"] * (n - 1)
    assert f"YALI_FUSION / YALI_FUSE_QUANT settings differ: {settings}" in reason and warn
    reason, warn = same_on_every_rank(cpu_ranks, "cuda_fuse_quant_differs")
    settings = ["on, quant on"] + ["on"] * (n - 1)
    assert f"YALI_FUSE_QUANT settings differ: {settings}" in reason and warn
    reason, warn = same_on_every_rank(cpu_ranks, "cuda_fusion_set_agrees")
    assert "YALI_FUSION" not in reason and ("YALI unavailable" in reason or "cannot be imported" in reason)
    reason, warn = same_on_every_rank(cpu_ranks, "cuda_no_custom_ar")
    assert "custom all-reduce is disabled" in reason and not warn
    reason, warn = same_on_every_rank(cpu_ranks, "cuda_bad_world_sizes")
    assert "invalid YALI_* setting: invalid YALI_WORLD_SIZES='2,5'" in reason and warn


def test_ranks_follow_the_default_world_sizes(cpu_ranks):
    """Without YALI_WORLD_SIZES two and four ranks go on to the communicator (which refuses on a
    CPU machine); a YALI_WORLD_SIZES that leaves the group's size out keeps it off, every rank with
    the one reason that names the variable (six and eight ranks: test_gate_leaves_unmeasured_...)."""
    n = len(cpu_ranks)
    reason, warn = same_on_every_rank(cpu_ranks, "cuda_default_world_sizes")
    assert n in config.DEFAULT_WORLD_SIZES
    assert "YALI unavailable" in reason or "cannot be imported" in reason
    reason, warn = same_on_every_rank(cpu_ranks, "cuda_left_out_world_size")
    assert reason == config.plugin_world_size_refusal(n, {"YALI_WORLD_SIZES": "8"}) and not warn
    assert reason == f"world size {n} is not in YALI_WORLD_SIZES=8; YALI_WORLD_SIZES={n},8 turns it on"


# ------------------------------------------- the plugin's lines in vLLM's log
_LOG_PROBE = r"""
import logging
import vllm.logger as vllm_logger
configured_at_import = bool(logging.getLogger("vllm").handlers)
from yali_vllm.plugin import register
register()
print("PROBE registered; vLLM logging configured at import:", configured_at_import, flush=True)
vllm_logger._configure_vllm_root_logger()  # what vLLM's API server, LLM(...) and workers do
print("PROBE configured", flush=True)
"""


def test_plugin_line_reaches_vllms_log_on_every_supported_version():
    """vLLM 0.31+ configures its loggers only when a process applies its logging
    configuration, after the API server loaded plugins: the plugin's INFO line is held
    until then, and appears in vLLM's format (vLLM 0.26-0.30 configure at import)."""
    import subprocess
    import sys

    import vllm

    env = dict(os.environ, VLLM_CONFIGURE_LOGGING="1", VLLM_LOGGING_LEVEL="INFO",
               VLLM_LOGGING_STREAM="ext://sys.stdout")
    r = subprocess.run([sys.executable, "-c", _LOG_PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    lines = [ln for ln in out.splitlines() if "YALI: plugin loaded for vLLM" in ln]
    assert len(lines) == 1, out[-3000:]
    assert f"vLLM {vllm.__version__}" in lines[0] and "INFO" in lines[0]
    if "configured at import: False" in out:  # 0.31+: held, then emitted once vLLM configured logging
        assert out.index("PROBE registered") < out.index(lines[0]) < out.index("PROBE configured")


def test_log_once_logs_each_line_once_per_process_until_forgotten(caplog):
    """log_once knows a line by its text, or by the key it is given; forget_logged makes it new again.
    A line below the logger's level counts as logged."""
    log = logging.getLogger("yali_test.log_once")
    vllm_log.forget_logged()
    with caplog.at_level(logging.INFO, logger=log.name):
        vllm_log.log_once(log, logging.DEBUG, "quiet %s", 1)
        for _ in range(2):
            vllm_log.log_once(log, logging.INFO, "group '%s' at %d%%", "tp:0", 50)
            vllm_log.log_once(log, logging.INFO, "group '%s' at %d%%", "tp:1", 50)
            vllm_log.log_once(log, logging.WARNING, "no args, 100%")
            vllm_log.log_once(log, logging.INFO, "tokens %s", [1, 1], key=("first", "tp:0"))
            vllm_log.log_once(log, logging.INFO, "tokens %s", [2, 2], key=("first", "tp:0"))
        vllm_log.log_once(log, logging.INFO, "quiet %s", 1)
        vllm_log.forget_logged()
        vllm_log.log_once(log, logging.INFO, "group '%s' at %d%%", "tp:0", 50)
    got = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == log.name]
    assert got == [(logging.INFO, "group 'tp:0' at 50%"), (logging.INFO, "group 'tp:1' at 50%"),
                   (logging.WARNING, "no args, 100%"), (logging.INFO, "tokens [1, 1]"),
                   (logging.INFO, "group 'tp:0' at 50%")], got
