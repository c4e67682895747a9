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


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    for item in items:
        if "gpu" in item.keywords or "/gpu/" in str(item.fspath):
            if not checked:
                reason, checked = _two_gpus_reason(), True
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))
