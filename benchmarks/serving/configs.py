"""The server configurations compared: yali, vLLM's defaults, the FlashInfer-fusion control, NCCL only;
and for MoE models data + expert parallelism with YALI's dispatch / combine or vLLM's manager.
`BASE+VAR=VALUE[+VAR=VALUE...]` names a variant: BASE with those YALI_* settings
(add_variants)."""

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
        "pairs in YALI's fused op; those of a quantised norm output where yali_vllm/fusion_routing.py sends them)",
    ),
    # YALI_FUSION=1 set explicitly: the same passes as "yali" (kept so that the runs that name it read).
    "yali-fusion": ServerConfig(
        "yali-fusion",
        {**YALI_ON, "YALI_FUSION": "1"},
        (),
        "yali plugin on, YALI_FUSION=1 set explicitly (the same passes as unset)",
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


# A variant sets YALI_* names only, so the multicast-off environment every server gets stays as it is.
VARIANT_SEP = "+"


def variant(name: str) -> ServerConfig:
    """The configuration `BASE+VAR=VALUE[+VAR=VALUE...]`: BASE with those YALI_* settings, e.g.
    `yali+YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX=131072`, a size-table choice served against `yali` in
    one alternation. ValueError naming the bad part."""
    from yali_vllm.config import unknown_variables

    base, *settings = name.split(VARIANT_SEP)
    if base not in SERVER_CONFIGS:
        raise ValueError(f"configuration {name!r}: unknown base {base!r}; known: {', '.join(SERVER_CONFIGS)}")
    if not settings:
        raise ValueError(f"configuration {name!r}: no VAR=VALUE after {base!r}")
    cfg = SERVER_CONFIGS[base]
    env = dict(cfg.env)
    for setting in settings:
        var, eq, value = setting.partition("=")
        if not eq or not var or not value:
            raise ValueError(f"configuration {name!r}: {setting!r} is not VAR=VALUE")
        if not var.startswith("YALI_") or unknown_variables({var: value}):
            raise ValueError(f"configuration {name!r}: {var!r} is not a YALI_* setting or YALI_DEV_* knob")
        env[var] = value
    return ServerConfig(name, env, cfg.args, f"{cfg.description}; with {', '.join(settings)}", cfg.parallel)


def add_variants(names: list[str]) -> None:
    """Every name a configuration: a known one, or a variant, which is added to SERVER_CONFIGS.
    SystemExit naming the first bad name."""
    for name in names:
        if name in SERVER_CONFIGS:
            continue
        if VARIANT_SEP not in name:
            raise SystemExit(f"unknown config {name!r}; known: {list(SERVER_CONFIGS)}, "
                             f"or BASE{VARIANT_SEP}YALI_VAR=VALUE")
        try:
            SERVER_CONFIGS[name] = variant(name)
        except ValueError as e:
            raise SystemExit(str(e)) from None
