"""The server, model and budget options serving_bench and load_test share."""

from __future__ import annotations

import argparse
from pathlib import Path

from yali_vllm.models import QUANT_CHOICES

from benchmarks.common.cli_args import (
    add_world_size_arg,
    fraction,
    non_negative_int,
    positive_float,
    positive_int,
    tcp_port,
)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Server/model/budget options shared with load_test.py."""
    p.add_argument("--model-size", choices=("70b", "8b", "qwen3-30b-a3b", "mixtral-8x7b"), default="70b",
                   help="embedded dummy model (default 70b); the MoE shapes for the dp-ep configurations (yali-ep, vllm-ep)")
    p.add_argument("--quant", choices=QUANT_CHOICES, default="none",
                   help="the model's FP8 scheme (yali-vllm-model --quant; the Llama sizes): fp8-static "
                   "(compressed-tensors, static per-tensor activation scales), fp8-dynamic (compressed-tensors, "
                   "dynamic per-token), fp8-block (vLLM's fp8, 128x128 weight blocks, dynamic groups of 128); "
                   "default none (bf16). The result file's model summary names it as quantization")
    p.add_argument("--model-dir", type=Path, default=None, help="where to write the model; its config.json and tekken.json are replaced (default: a per-user directory under the system temp dir, see default_model_dir)")
    p.add_argument("--vllm-bin", default="vllm", help="vllm command, shell-split (default: vllm on PATH)")
    add_world_size_arg(p, "tensor-parallel size of every server (vllm serve --tensor-parallel-size), one GPU per rank")
    p.add_argument("--port", type=tcp_port, default=8100, help="first port to try; each server gets its own")
    p.add_argument("--max-model-len", type=positive_int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.90)
    p.add_argument("--max-num-seqs", type=positive_int, default=None, help="vllm serve --max-num-seqs (default: vLLM's); smaller = faster CUDA-graph capture at startup")
    p.add_argument("--extra-server-args", default="", help="extra vllm serve arguments for every config (one shell-quoted string)")
    p.add_argument("--budget-s", type=positive_float, default=540.0, help="global deadline for the whole run, seconds (default 540)")
    p.add_argument("--startup-timeout-s", type=positive_float, default=420.0, help="max wait for one server's /health (clipped to the budget)")
    p.add_argument("--stop-grace-s", type=positive_float, default=30.0, help="SIGTERM grace before SIGKILL when stopping a server")
    p.add_argument("--startup-estimate-s", type=positive_float, default=60.0, help="assumed server startup time until one is observed (budget planning)")
    p.add_argument("--warmup-requests", type=non_negative_int, default=4, help="short warm-up completions per server before measuring")
    p.add_argument("--dry-run", action="store_true", help="print the commands and environments, run nothing")
