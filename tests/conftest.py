import os

# NVLink multicast must stay off on the shared GPU hosts, for every process the tests start.
for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
               "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm"}.items():
    os.environ[_k] = _v
