"""YaliCommunicator start-up on two real gloo ranks without GPUs: whatever fails
on one rank must make both ranks raise YaliUnavailable, never leave one waiting
in a collective (that would hang a server at start-up)."""
import pytest
import torch

from .comm_ranks import start_ranks


def _run(env, devices=None):
    return start_ranks(2, env, devices, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.timeout(180)
def test_both_ranks_refuse_together_without_gpu():
    got = _run({})
    for r in (0, 1):
        assert got[r].startswith("unavailable:"), got
        assert "rank 0:" in got[r] and "rank 1:" in got[r]  # each rank names both ranks' reasons


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.timeout(180)
def test_bad_setting_on_one_rank_fails_both():
    got = _run({1: {"YALI_DEV_PUSH_CTA_BYTES": "999"}})
    for r in (0, 1):
        assert got[r].startswith("unavailable:"), got


@pytest.mark.timeout(180)
def test_bad_device_argument_on_one_rank_fails_both():
    # torch.device("no-such-device") raises on rank 1 before the first exchange: recorded and
    # exchanged, so rank 0 is not left waiting in the collective.
    got = _run({}, devices={1: "no-such-device"})
    for r in (0, 1):
        assert got[r].startswith("unavailable:"), got
        assert "no-such-device" in got[r], got


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
def test_with_gpu_stand_ins_every_rank_builds(world_size):
    assert start_ranks(world_size, stand_in={}, timeout=120) == {r: "created" for r in range(world_size)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("step, reason", [
    ("create", "rank 1: RuntimeError: yali: create failed on this rank"),
    ("open_peer", "rank 1: cannot map another rank's buffer"),
    ("self_test", "self-test all-reduce over the peer mapping gave wrong values"),
])
def test_one_rank_failing_a_step_fails_every_rank_at_once(world_size, step, reason):
    """Rank 1 fails one step of the start-up (GPU stand-ins elsewhere): every rank raises
    YaliUnavailable naming it, and none waits for another (well within close()'s 10 s bound)."""
    import time

    t0 = time.monotonic()
    got = start_ranks(world_size, stand_in={1: step}, timeout=120)
    for r in range(world_size):
        assert got[r].startswith("unavailable:") and reason in got[r], got
    assert time.monotonic() - t0 < 60


@pytest.mark.timeout(180)
def test_settings_that_differ_on_one_rank_fail_every_rank():
    got = start_ranks(2, env={1: {"YALI_KERNEL_MODE": "flash"}}, stand_in={}, timeout=120)
    for r in (0, 1):
        assert got[r].startswith("unavailable: the ranks' YALI_* settings differ: rank 0 ["), got
        mine, _, theirs = got[r].partition("] vs rank 1 [")
        assert " mode=auto " in mine and " mode=flash " in theirs, got


@pytest.mark.parametrize("value, allowed", [(None, False), ("", False), ("0", False), ("1", True)])
def test_shared_gpu_switch(monkeypatch, value, allowed):
    from tests.gpu.pair import rank_device
    from yali_vllm.communicator import SHARED_GPU_VAR, shared_gpu_allowed

    if value is None:
        monkeypatch.delenv(SHARED_GPU_VAR, raising=False)
    else:
        monkeypatch.setenv(SHARED_GPU_VAR, value)
    assert shared_gpu_allowed() is allowed
    # the pair tests put rank 1 on GPU 0 only when both ranks may share it
    assert [rank_device(r) for r in (0, 1)] == ([0, 0] if allowed else [0, 1])


@pytest.mark.parametrize("value", ["yes", "true", "2", "-1"])
def test_shared_gpu_switch_refuses_other_values(monkeypatch, value):
    from yali_vllm.communicator import SHARED_GPU_VAR, shared_gpu_allowed

    monkeypatch.setenv(SHARED_GPU_VAR, value)
    with pytest.raises(ValueError, match=SHARED_GPU_VAR):
        shared_gpu_allowed()
