"""Embedded model directories (Llama-shaped dense, Qwen3-MoE- and Mixtral-shaped MoE) for running
vLLM without a model hub.

The GPU hosts cannot reach a model hub, so end-to-end runs use a directory
that holds only a ``config.json`` (Llama-3 8B / 70B shapes) and a real
tokenizer (Mistral's Tekken tokenizer shipped inside the ``mistral_common``
package, which vLLM already depends on).  vLLM is then started with
``--load-format dummy`` (random weights, nothing to download) and
``--tokenizer-mode mistral``:

    yali-vllm-model /tmp/llama-8b --size 8b
    vllm serve /tmp/llama-8b --tensor-parallel-size 2 \\
        --load-format dummy --tokenizer-mode mistral

The shapes are what matter for all-reduce traffic: every decoder layer does
two all-reduces of ``tokens x hidden_size`` activations at TP=2. The MoE shapes
("qwen3-30b-a3b": 128 experts, top-8, hidden 2048; "mixtral-8x7b": 8 experts,
top-2, hidden 4096) are served with data + expert parallelism, where every MoE
layer dispatches and combines its tokens across the ranks:

    yali-vllm-model /tmp/qwen3-moe --size qwen3-30b-a3b
    vllm serve /tmp/qwen3-moe --data-parallel-size 2 --enable-expert-parallel \\
        --load-format dummy --tokenizer-mode mistral

The Llama shapes also come as FP8 checkpoints (``--quant``): ``config.json`` then carries a
``quantization_config`` of the form real FP8 checkpoints have, vLLM detects it on its own and its
dummy loader fills the FP8 weights and their scales (:data:`QUANT_CHOICES`):

    yali-vllm-model /tmp/llama-70b-fp8 --size 70b --quant fp8-dynamic
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
from pathlib import Path
from collections.abc import Sequence
from typing import Any

# Tekken (tekken_240911.json) has 131072 ids in total (130072 BPE ranks +
# 1000 special tokens); the embedding must have exactly that many rows so
# every id the tokenizer can produce has a row, and vice versa.
TOKENIZER_RESOURCE = "tekken_240911.json"
TOKENIZER_FILE = "tekken.json"
CONFIG_FILE = "config.json"
VOCAB_SIZE = 131072

_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "head_dim": 128,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    # Plain RoPE: a theta, no scaling.
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "use_cache": True,
    "torch_dtype": "bfloat16",
    # Tekken special ids: <unk>=0, <s>=1, </s>=2.
    "bos_token_id": 1,
    "eos_token_id": 2,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "8b": {
        **_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "70b": {
        **_COMMON,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
}


# The MoE shapes keep Tekken's vocabulary and special ids (the tokenizer is the same file).
_MOE_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "attention_dropout": 0.0,
}
CONFIGS["qwen3-30b-a3b"] = {  # Qwen3-30B-A3B's shape: 48 layers, 128 experts of 768, top-8
    **_MOE_COMMON,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
}
CONFIGS["mixtral-8x7b"] = {  # Mixtral-8x7B's shape: 32 layers, 8 experts of 14336, top-2
    **_MOE_COMMON,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "output_router_logits": False,
    "sliding_window": None,
}
# The sizes served with data + expert parallelism (serve_command's default for them).
MOE_SIZES = ("qwen3-30b-a3b", "mixtral-8x7b")


# FP8 quantisation schemes of the embedded models. "none": bf16 weights, no quantization_config.
QUANT_NONE = "none"
_FP8_ARGS: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}


def _compressed_tensors(weight_strategy: str, activations: dict[str, Any]) -> dict[str, Any]:
    """A compressed-tensors FP8 W8A8 config (llm-compressor's form): every Linear but lm_head."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**_FP8_ARGS, "strategy": weight_strategy},
                "input_activations": {**_FP8_ARGS, **activations},
                "output_activations": None,
            }
        },
    }


QUANT_CONFIGS: dict[str, dict[str, Any]] = {
    # Static per-tensor: FP8 weights with one scale per tensor, activations quantised with a
    # calibrated per-tensor scale (the checkpoint's input_scale).
    "fp8-static": _compressed_tensors("tensor", {"strategy": "tensor"}),
    # Dynamic per-token: FP8 weights with one scale per output channel, activations quantised with
    # a scale per token, taken at run time (llm-compressor's FP8_DYNAMIC).
    "fp8-dynamic": _compressed_tensors("channel", {"strategy": "token", "dynamic": True}),
    # Block: weights in 128x128 blocks with a scale each, activations in groups of 128 per token
    # with dynamic scales (DeepSeek-V3's and Qwen3-FP8's form).
    "fp8-block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}
QUANT_CHOICES = (QUANT_NONE, *QUANT_CONFIGS)
# What vLLM sets in model_config.quantization for each scheme (its quantisation method's name).
VLLM_QUANTIZATION = {"fp8-static": "compressed-tensors", "fp8-dynamic": "compressed-tensors", "fp8-block": "fp8"}
# The sizes that come quantised: the dense Llama shapes.
QUANT_SIZES = ("8b", "70b")


def quantization_config(quant: str) -> dict[str, Any] | None:
    """The ``quantization_config`` of ``config.json`` for ``quant`` (a copy), or None for "none"."""
    if quant == QUANT_NONE:
        return None
    try:
        return copy.deepcopy(QUANT_CONFIGS[quant])
    except KeyError:
        raise ValueError(f"unknown quantisation {quant!r}; expected one of {list(QUANT_CHOICES)}") from None


def quant_of(config: dict[str, Any]) -> str | None:
    """The QUANT_CHOICES name of the ``config.json`` contents ``config``: "none" without a
    ``quantization_config``, the scheme whose config it carries, or None for another one."""
    qcfg = config.get("quantization_config")
    if qcfg is None:
        return QUANT_NONE
    return next((name for name, known in QUANT_CONFIGS.items() if known == qcfg), None)


def model_config(size: str = "8b", quant: str = QUANT_NONE) -> dict[str, Any]:
    """Return a copy of the embedded ``config.json`` contents for ``size``, quantised as ``quant``
    (one of QUANT_CHOICES; only the sizes of QUANT_SIZES come quantised)."""
    try:
        config = copy.deepcopy(CONFIGS[size])
    except KeyError:
        raise ValueError(
            f"unknown model size {size!r}; expected one of {sorted(CONFIGS)}"
        ) from None
    qcfg = quantization_config(quant)
    if qcfg is not None:
        if size not in QUANT_SIZES:
            raise ValueError(f"quantisation {quant!r} is for the dense sizes {list(QUANT_SIZES)}, not {size!r}")
        config["quantization_config"] = qcfg
    return config


def tokenizer_source() -> Path:
    """Path of the Tekken tokenizer file inside the installed mistral_common."""
    try:
        import mistral_common
    except ImportError as e:  # pragma: no cover - vLLM always brings it
        raise RuntimeError(
            "the 'mistral_common' package is needed for the tokenizer "
            "(it is installed with vLLM: pip install 'yali-vllm[vllm]')"
        ) from e
    src = Path(mistral_common.__file__).parent / "data" / TOKENIZER_RESOURCE
    if not src.is_file():
        raise RuntimeError(f"tokenizer file not found in mistral_common: {src}")
    return src


def _write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``; a symbolic link there is an error, never followed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_model_dir(path: str | Path, size: str = "8b", *, quant: str = QUANT_NONE, force: bool = False) -> Path:
    """Write ``config.json`` (of ``size``, quantised as ``quant``) and ``tekken.json`` into ``path``;
    return it.

    ``path`` is created if missing.  An existing directory that is not empty is
    refused unless it already holds exactly these two files with this content
    (a re-run: left as it is) or ``force`` is set; with ``force`` files of those
    two names are replaced and other files are kept.  A symbolic link in place
    of either file is refused (with or without ``force``), so nothing is written
    through it.
    """
    if not str(path).strip():
        raise ValueError(f"model directory {str(path)!r} is an empty name: name a directory to write")
    config = model_config(size, quant)
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    for name in (CONFIG_FILE, TOKENIZER_FILE):
        if (out / name).is_symlink():
            raise FileExistsError(f"{out / name} is a symbolic link; remove it first (nothing is written through a link)")
    src = tokenizer_source()
    tokenizer = src.read_bytes()
    # Guard against a mistral_common whose tokenizer no longer matches.
    tok_vocab = json.loads(tokenizer)["config"]["default_vocab_size"]
    if tok_vocab != config["vocab_size"]:
        raise RuntimeError(
            f"{src} has vocab size {tok_vocab}, the embedded config expects {config['vocab_size']}"
        )
    files = {CONFIG_FILE: (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8"), TOKENIZER_FILE: tokenizer}
    if out.is_dir() and not force and any(out.iterdir()):
        if sorted(p.name for p in out.iterdir()) == sorted(files) and all(
            (out / name).read_bytes() == data for name, data in files.items()
        ):
            return out
        raise FileExistsError(
            f"{out} is not empty; --force writes {CONFIG_FILE} and {TOKENIZER_FILE} into it anyway "
            "(replacing files of those names, keeping the others)"
        )
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        _write_file(out / name, data)
    return out


def serve_command(path: str | Path, tensor_parallel_size: int = 2, *, vllm: Sequence[str] = ("vllm",),
                  max_model_len: int = 4096, data_parallel_size: int = 0) -> list[str]:
    """The ``vllm serve`` argv that fits a directory from write_model_dir
    (``vllm``: the program, possibly several words). ``data_parallel_size`` > 0: that many
    data-parallel ranks with expert parallelism (a MoE model) instead of tensor parallelism."""
    parallel = (["--data-parallel-size", str(data_parallel_size), "--enable-expert-parallel"]
                if data_parallel_size > 0 else ["--tensor-parallel-size", str(tensor_parallel_size)])
    return [
        *vllm,
        "serve",
        str(path),
        *parallel,
        "--load-format",
        "dummy",
        "--tokenizer-mode",
        "mistral",
        "--max-model-len",
        str(max_model_len),
    ]


def _directory(text: str) -> str:
    """argparse type of the ``dir`` argument: a name that is not empty or blank."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty: name a directory to write")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="yali-vllm-model",
        description="Write a model directory (config.json + Tekken tokenizer) of a Llama (8b, 70b), "
        "Qwen3-MoE or Mixtral shape for vLLM dummy-weight runs (--load-format dummy: random weights, "
        "nothing downloaded).",
    )
    parser.add_argument("dir", type=_directory, help="directory to write (created if missing; refused if not empty, "
                        "unless --force)")
    parser.add_argument("--size", choices=sorted(CONFIGS), default="8b")
    parser.add_argument(
        "--quant", choices=QUANT_CHOICES, default=QUANT_NONE,
        help="weights and activations in FP8 (e4m3), for the Llama sizes: config.json then carries a "
        "quantization_config that vLLM reads on its own (no --quantization flag). "
        "fp8-static: compressed-tensors, per-tensor weight scales, static per-tensor activation scales; "
        "fp8-dynamic: compressed-tensors, per-channel weight scales, dynamic per-token activation scales; "
        "fp8-block: vLLM's fp8 method, 128x128 weight blocks, dynamic activation scales per group of 128 "
        "(DeepSeek-V3 / Qwen3-FP8 form). vLLM's dummy loader fills the FP8 weights and their scales. "
        "Default: none (bf16)")
    parser.add_argument("--force", action="store_true", help="write into a directory that is not empty, replacing "
                        f"its {CONFIG_FILE} and {TOKENIZER_FILE} (a symbolic link there is still refused)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        out = write_model_dir(args.dir, args.size, quant=args.quant, force=args.force).resolve()
    except (OSError, ValueError) as e:
        parser.error(str(e))
    print(f"wrote {out / CONFIG_FILE} and {out / TOKENIZER_FILE}")
    if args.quant != QUANT_NONE:
        print(f"quantisation {args.quant}: vLLM reads it as its {VLLM_QUANTIZATION[args.quant]!r} method")
    print("serve it with:")
    print("  " + shlex.join(serve_command(out, data_parallel_size=2 if args.size in MOE_SIZES else 0)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
