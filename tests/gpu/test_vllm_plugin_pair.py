"""The plugin inside the installed vLLM on real GPUs, without a server: vLLM's entry point
registers it, and two ranks build vLLM's own CudaCommunicator for the group "tp:0"; the
patched class sets up YALI and serves vLLM's all_reduce with YALI's kernel.

Runs with one GPU per rank, or with both ranks on GPU 0 (YALI_ALLOW_SHARED_GPU=1), so a
one-GPU machine checks the plugin on each supported vLLM (correctness only). vLLM's other
backends that cannot share one GPU between two processes (PyNCCL, symmetric memory,
FlashInfer's all-reduce) are turned off for the test; YALI does not depend on them."""
from __future__ import annotations

import os

import pytest
import torch

from .pair import rank_device, run_pair

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm")

N = 3001  # odd: a tail after the last 16-byte vector


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(1234 + rank)).to(torch.bfloat16)


def _vllm_tp_communicator(rank: int, group):
    """vLLM's own CudaCommunicator for the group "tp:0", built as a vLLM worker builds it, with the
    plugin registered and vLLM's logging configured (its ON/OFF lines show in the test log)."""
    os.environ.update(VLLM_DISABLE_PYNCCL="1", VLLM_ALLREDUCE_USE_SYMM_MEM="0", VLLM_ALLREDUCE_USE_FLASHINFER="0")
    import vllm.logger

    vllm.logger._configure_vllm_root_logger()
    from vllm.distributed.device_communicators import custom_all_reduce
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    from yali_vllm.communicator import shared_gpu_allowed
    from yali_vllm.plugin import register

    if shared_gpu_allowed():
        # vLLM's custom all-reduce checks P2P with the rank as the device index (cuda:1 does not
        # exist on one GPU): it is told there is no P2P and stays off, as it does on such a machine.
        custom_all_reduce._can_p2p = lambda rank, world_size: False
    register()
    device = torch.device("cuda", rank_device(rank))
    return CudaCommunicator(cpu_group=group, device=device, device_group=group, unique_name="tp:0"), device


def _serve_through_vllm(rank: int, group) -> dict:
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    comm, device = _vllm_tp_communicator(rank, group)
    res: dict = {"yali": comm.yali_comm is not None, "vllm": vllm.__version__, "torch": torch.__version__}
    x = _inputs(rank).to(device)
    out = comm.all_reduce(x)
    torch.cuda.synchronize(device)
    ref = (_inputs(0).float() + _inputs(1).float()).to(torch.bfloat16)  # fp32 sum, rounded once
    res["exact"] = torch.equal(out.cpu(), ref)
    res["bits"] = out.view(torch.int16).cpu().tolist()
    res["device_calls"] = comm.yali_comm.device_calls() if comm.yali_comm is not None else None
    if callable(CudaCommunicator.__dict__.get("checkpoint_prepare")):  # vLLM 0.27+
        comm.checkpoint_prepare()  # nothing captured YALI: released, vLLM's chain serves from now on
        res["after_checkpoint"] = comm.yali_comm is None
    comm.destroy()
    return res


def test_vllm_entry_point_registers_the_plugin():
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    from vllm.plugins import load_general_plugins

    from yali_vllm.plugin.patch import is_patched

    load_general_plugins()
    assert is_patched(CudaCommunicator)
    assert hasattr(torch.ops.vllm, "yali_fused_allreduce_rmsnorm")


def test_vllm_cuda_communicator_serves_with_yali():
    results = run_pair(_serve_through_vllm, timeout=240)
    for res in results:
        assert res["yali"], res
        assert res["exact"], "vLLM's all_reduce through YALI differs from the fp32 sum rounded once"
        assert res["device_calls"] >= 2  # the set-up self-test and the call above
        if "after_checkpoint" in res:
            assert res["after_checkpoint"]
    assert results[0]["bits"] == results[1]["bits"], "the ranks' results are not bitwise equal"


def _serve_through_sleep(rank: int, group) -> dict:
    """YALI's buffers are its own cudaMalloc memory, outside torch's caching allocator (here with
    expandable segments) and vLLM's cuMem pools: vLLM's sleep mode offloads and restores tensors
    around it, and YALI keeps serving before, during and after."""
    from vllm.device_allocator.cumem import CuMemAllocator

    comm, device = _vllm_tp_communicator(rank, group)
    ref = (_inputs(0).float() + _inputs(1).float()).to(torch.bfloat16)
    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        pooled = _inputs(rank).to(device)  # in vLLM's cuMem pool, offloaded by sleep()
    plain = _inputs(rank).to(device)  # torch's caching allocator, expandable segments

    def exact(t) -> bool:
        out = comm.all_reduce(t)
        torch.cuda.synchronize(device)
        return torch.equal(out.cpu(), ref)

    res = {"yali": comm.yali_comm is not None, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    res["before"] = [exact(pooled), exact(plain)]
    allocator.sleep(offload_tags=("weights",))
    res["asleep"] = exact(plain)
    allocator.wake_up()
    res["after"] = [exact(pooled), exact(plain)]
    res["device_calls"] = comm.yali_comm.device_calls()
    comm.destroy()
    return res


def test_yali_keeps_serving_through_sleep_mode_and_expandable_segments():
    pytest.importorskip("vllm.device_allocator.cumem")
    results = run_pair(_serve_through_sleep, timeout=240,
                       env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    for res in results:
        assert res["yali"] and res["conf"] == "expandable_segments:True", res
        assert res["before"] == [True, True] and res["asleep"] and res["after"] == [True, True], res
        assert res["device_calls"] >= 6  # the self-test and the five calls above
