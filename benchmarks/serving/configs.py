"""The server configurations compared: yali, vLLM's defaults, the FlashInfer-fusion control, NCCL only;
and for MoE models data + expert parallelism with YALI's dispatch / combine or vLLM's manager."""

from __future__ import annotations

import json
from dataclasses import dataclass

NCCL_COMPILATION_CONFIG = {"pass_config": {"fuse_allreduce_rms": False}}
# The yali configurations serve every TP world size the kernels serve, also those the plugin
# leaves off by default (yali_vllm.config.OFF_BY_DEFAULT): measuring them is how one turns on.
YALI_ON = {"YALI_ENABLE": "1", "YALI_WORLD_SIZES": "all"}


@dataclass(frozen=True)
class ServerConfig:
    name: str
    env: dict[str, str]
    args: tuple[str, ...]
    description: str
    # "tp": --tensor-parallel-size N; "dp-ep": --data-parallel-size N --enable-expert-parallel (MoE)
    parallel: str = "tp"


SERVER_CONFIGS: dict[str, ServerConfig] = {
    "yali": ServerConfig(
        "yali",
        YALI_ON,
        (),
        "yali plugin on (YALI_ENABLE=1, YALI_WORLD_SIZES=all); vLLM defaults otherwise (the fused "
        "pairs in YALI's fused op, except below FlashInfer's limit at a world size of FUSION_BY_FLASHINFER)",
    ),
    # YALI's fused op for every fused pair at every world size, also where the plugin leaves them to
    # FlashInfer by default (yali_vllm.config.FUSION_BY_FLASHINFER): the configuration that measures it.
    "yali-fusion": ServerConfig(
        "yali-fusion",
        {**YALI_ON, "YALI_FUSION": "1"},
        (),
        "yali plugin on, YALI_FUSION=1: YALI's fused all-reduce+RMSNorm serves the fused pairs at every "
        "world size",
    ),
    "vllm-default": ServerConfig(
        "vllm-default",
        {"YALI_ENABLE": "0"},
        (),
        "YALI_ENABLE=0: vLLM's custom all-reduce + FlashInfer all-reduce+RMSNorm "
        "fusion as vLLM configures it (backend trtllm)",
    ),
    # The control for a yali vs vllm-default difference outside the all-reduce: YALI's plugin, its
    # buffers and its all-reduce hook exactly as in "yali", but YALI_FUSION=0 makes vLLM build its
    # FlashInfer fusion, so every decode all-reduce (all fused with an RMSNorm) runs FlashInfer's
    # kernel, as in vllm-default.
    "yali-flashinfer-fusion": ServerConfig(
        "yali-flashinfer-fusion",
        {**YALI_ON, "YALI_FUSION": "0"},
        (),
        "yali plugin on, YALI_FUSION=0: vLLM's FlashInfer all-reduce+RMSNorm fusion serves the "
        "fused pairs (the control for effects of the plugin outside its fused kernel)",
    ),
    # MoE models (--model-size qwen3-30b-a3b or mixtral-8x7b) with data + expert parallelism over the
    # same N GPUs: YALI's dispatch / combine against vLLM's all-gather / reduce-scatter manager (NCCL).
    "yali-ep": ServerConfig(
        "yali-ep",
        {**YALI_ON, "YALI_EP": "1"},
        (),
        "--data-parallel-size N --enable-expert-parallel, yali plugin on: YALI's MoE dispatch and combine",
        "dp-ep",
    ),
    "vllm-ep": ServerConfig(
        "vllm-ep",
        {"YALI_ENABLE": "0"},
        (),
        "--data-parallel-size N --enable-expert-parallel, YALI_ENABLE=0: vLLM's AgRsAll2AllManager on NCCL",
        "dp-ep",
    ),
    "nccl": ServerConfig(
        "nccl",
        {"YALI_ENABLE": "0"},
        (
            "--disable-custom-all-reduce",
            "--compilation-config",
            json.dumps(NCCL_COMPILATION_CONFIG),
        ),
        "YALI_ENABLE=0, --disable-custom-all-reduce, fuse_allreduce_rms off: NCCL only",
    ),
}
