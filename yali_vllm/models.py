"""Embedded Llama-shaped model directories for running vLLM without a model hub.

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
two all-reduces of ``tokens x hidden_size`` activations at TP=2.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import shutil
from pathlib import Path
from collections.abc import Sequence
from typing import Any

# Tekken (tekken_240911.json) has 131072 ids in total (130072 BPE ranks +
# 1000 special tokens); the embedding must have exactly that many rows so
# every id the tokenizer can produce has a row, and vice versa.
TOKENIZER_RESOURCE = "tekken_240911.json"
TOKENIZER_FILE = "tekken.json"
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


def model_config(size: str = "8b") -> dict[str, Any]:
    """Return a copy of the embedded ``config.json`` contents for ``size``."""
    try:
        return copy.deepcopy(CONFIGS[size])
    except KeyError:
        raise ValueError(
            f"unknown model size {size!r}; expected one of {sorted(CONFIGS)}"
        ) from None


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


def write_model_dir(path: str | Path, size: str = "8b") -> Path:
    """Write ``config.json`` and ``tekken.json`` into ``path``; return it.

    Existing files of the same names are overwritten, other files are kept.
    """
    config = model_config(size)
    src = tokenizer_source()
    # Guard against a mistral_common whose tokenizer no longer matches.
    with open(src, encoding="utf-8") as f:
        tok_vocab = json.load(f)["config"]["default_vocab_size"]
    if tok_vocab != config["vocab_size"]:
        raise RuntimeError(
            f"{src} has vocab size {tok_vocab}, the embedded config expects {config['vocab_size']}"
        )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    shutil.copyfile(src, out / TOKENIZER_FILE)
    return out


def serve_command(path: str | Path, tensor_parallel_size: int = 2, *, vllm: Sequence[str] = ("vllm",),
                  max_model_len: int = 4096) -> list[str]:
    """The ``vllm serve`` argv that fits a directory from write_model_dir
    (``vllm``: the program, possibly several words)."""
    return [
        *vllm,
        "serve",
        str(path),
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--load-format",
        "dummy",
        "--tokenizer-mode",
        "mistral",
        "--max-model-len",
        str(max_model_len),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="yali-vllm-model",
        description="Write a Llama-shaped model directory (config.json + "
        "Tekken tokenizer) for vLLM dummy-weight runs.",
    )
    parser.add_argument("dir", help="directory to write (created if missing)")
    parser.add_argument("--size", choices=sorted(CONFIGS), default="8b")
    args = parser.parse_args(argv)
    out = write_model_dir(args.dir, args.size).resolve()
    print(f"wrote {out / 'config.json'} and {out / TOKENIZER_FILE}")
    print("serve it with:")
    print("  " + shlex.join(serve_command(out)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
