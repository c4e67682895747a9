"""yali-vllm: an NVLink all-reduce for 2, 4, 6 or 8 GPUs of one node (YALI push kernels), and a fused
all-reduce + residual add + RMSNorm, for vLLM."""
from ._ext import available, unavailable_reason
from ._version import TESTED_VLLM_VERSION, __version__

__all__ = ["available", "unavailable_reason", "YaliCommunicator", "YaliPair", "YaliUnavailable", "YaliError",
           "__version__", "TESTED_VLLM_VERSION"]


def __getattr__(name):  # lazy: importing the package must stay cheap and never fail
    if name in ("YaliCommunicator", "YaliPair", "YaliUnavailable", "YaliError"):
        from . import communicator

        return getattr(communicator, name)
    raise AttributeError(name)
