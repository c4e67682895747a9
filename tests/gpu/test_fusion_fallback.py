"""The fused op's fallback on a GPU (one GPU, no YALI communicator): the group's all-reduce, then
vLLM's CUDA RMSNorm kernel in one launch, not vLLM IR's native op, which an eager call outside a
compiled graph dispatches to under torch.compile (about ten elementwise kernels over fp32 copies)."""
import pytest
import torch

pytestmark = pytest.mark.gpu

HIDDEN, TOKENS, EPS = 8192, 1024, 1e-5


class _Group:
    """A group whose all-reduce adds a fixed 'peer' tensor (no YALI communicator)."""

    def __init__(self, peer):
        self.peer = peer
        self.device_communicator = None
        self.unique_name = "tp:fallback"

    def all_reduce(self, x):
        return x + self.peer


def _tensors(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, peer, res = (torch.randn(TOKENS, HIDDEN, generator=g, device="cuda").bfloat16() for _ in range(3))
    w = torch.randn(HIDDEN, generator=g, device="cuda").bfloat16()
    return x, peer, res, w


@pytest.mark.parametrize("with_residual", [True, False])
def test_fallback_runs_vllms_cuda_norm_kernel_once(with_residual):
    pytest.importorskip("vllm._custom_ops")  # loads vLLM's kernels (torch.ops._C)
    from torch.profiler import ProfilerActivity, profile

    from yali_vllm import vllm_fusion

    x, peer, res, w = _tensors(7)
    res_in = res.clone() if with_residual else None
    vllm_fusion.run_on_group(_Group(peer), x, res_in, w, EPS)  # warm-up (first-call log, lazy loads)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        norm, res_out = vllm_fusion.run_on_group(_Group(peer), x, res_in, w, EPS)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    norm_kernels = [n for n in names if "rms_norm" in n.lower()]
    assert len(norm_kernels) == 1, names  # one launch of vLLM's kernel
    # Against vLLM's native arithmetic in fp32 (the kernels may order the variance sum differently).
    z = (x + peer).float() + (res.float() if with_residual else 0)
    ref = (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + EPS)).bfloat16() * w
    err = (norm.float() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2, err
    assert torch.equal(res_out, z.bfloat16() if with_residual else (x + peer))
    if with_residual:
        assert torch.equal(res_in, res)  # functional: the residual input is untouched
