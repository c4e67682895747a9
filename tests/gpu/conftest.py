import pytest
import torch


def _two_gpus_reason():
    import yali_vllm

    reason = yali_vllm.unavailable_reason()
    if reason:
        return reason
    if torch.cuda.device_count() < 2:
        return f"needs 2 GPUs, {torch.cuda.device_count()} visible"
    if not torch.cuda.can_device_access_peer(0, 1):
        return "GPUs 0 and 1 have no P2P access"
    return None


def _shared_gpu_reason():
    """With YALI_ALLOW_SHARED_GPU=1 the pair tests put both ranks on GPU 0 (tests/gpu/pair.py)."""
    import yali_vllm

    reason = yali_vllm.unavailable_reason()
    if reason:
        return reason
    if torch.cuda.device_count() < 1:
        return "needs a GPU, none visible"
    return None


def pytest_collection_modifyitems(config, items):
    from yali_vllm.communicator import SHARED_GPU_VAR, shared_gpu_allowed

    shared = shared_gpu_allowed()
    reasons = {}  # computed once per kind of requirement
    for item in items:
        if not ("gpu" in item.keywords or "/gpu/" in str(item.fspath)):
            continue
        # Tests marked two_gpus drive two devices themselves (vLLM at TP=2, Ray, YaliPair(0, 1),
        # the C++ example): they need two GPUs even when the pair tests may share one.
        kind = "shared" if shared and "two_gpus" not in item.keywords else "two"
        if kind not in reasons:
            reasons[kind] = _shared_gpu_reason() if kind == "shared" else _two_gpus_reason()
        if reasons[kind]:
            extra = f" ({SHARED_GPU_VAR}=1 does not apply: it needs two devices)" if shared and kind == "two" else ""
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {reasons[kind]}{extra}"))
