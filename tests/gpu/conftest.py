import os

import pytest
import torch

from benchmarks.common.gpu_env import MULTICAST_OFF_ENV

# NVLink multicast stays off in the GPU tests and in every process they start.
os.environ.update(MULTICAST_OFF_ENV)


def _skip_reason(gpus: int):
    """Why the GPU tests cannot run here with `gpus` GPUs needed (1: the pair tests with both ranks
    on GPU 0, YALI_ALLOW_SHARED_GPU=1; 2: one GPU each, with P2P), or None."""
    import yali_vllm

    reason = yali_vllm.unavailable_reason()
    if reason:
        return reason
    if torch.cuda.device_count() < gpus:
        return f"needs {gpus} GPU{'s' if gpus > 1 else ''}, {torch.cuda.device_count()} visible"
    if gpus > 1 and not torch.cuda.can_device_access_peer(0, 1):
        return "GPUs 0 and 1 have no P2P access"
    return None


def pytest_collection_modifyitems(config, items):
    from yali_vllm.communicator import SHARED_GPU_VAR, shared_gpu_allowed

    shared = shared_gpu_allowed()
    reasons = {}  # computed once per kind of requirement
    for item in items:
        if not ("gpu" in item.keywords or "/gpu/" in str(item.fspath)) or "cpu" in item.keywords:
            continue
        # Tests marked two_gpus drive two devices themselves (vLLM at TP=2, Ray, YaliPair(0, 1),
        # the C++ example): they need two GPUs even when the pair tests may share one.
        kind = "shared" if shared and "two_gpus" not in item.keywords else "two"
        if kind not in reasons:
            reasons[kind] = _skip_reason(1 if kind == "shared" else 2)
        if reasons[kind]:
            extra = f" ({SHARED_GPU_VAR}=1 does not apply: it needs two devices)" if shared and kind == "two" else ""
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {reasons[kind]}{extra}"))
