"""The embedded dummy model the servers load: where it is written and what it is."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


MODEL_SUMMARY_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "torch_dtype",
    "dtype",
    "max_position_embeddings",
)


def tensor_parallel_refusal(size: str, tp: int) -> str | None:
    """Why vLLM cannot split the embedded ``size`` model over ``tp`` ranks, or None: the attention
    heads and the MLP's intermediate size must divide by tp, and the KV heads divide by tp or tp by
    them (vLLM replicates KV heads when tp exceeds them)."""
    from yali_vllm.models import model_config

    cfg = model_config(size)
    heads, kv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    if heads % tp or inter % tp or (kv % tp if kv >= tp else tp % kv):
        return (f"the {size} model ({heads} attention heads, {kv} KV heads, intermediate size {inter}) does not "
                f"split over {tp} tensor-parallel ranks")
    return None


def quantisation_refusal(size: str, quant: str) -> str | None:
    """Why the embedded ``size`` model does not come quantised as ``quant``, or None."""
    from yali_vllm.models import model_config

    try:
        model_config(size, quant)
    except ValueError as e:
        return str(e)
    return None


def default_model_dir(size: str, quant: str = "none") -> Path:
    """The benchmarks' scratch model directory, one per size and quantisation: per user, under the
    system temp dir (another user's directory of the same name is never written into)."""
    import tempfile

    name = size if quant == "none" else f"{size}-{quant}"
    return Path(tempfile.gettempdir()) / f"yali-serving-model-{name}-{os.getuid()}"


def prepare_model(size: str, model_dir: Path, quant: str = "none") -> Path:
    from yali_vllm.models import write_model_dir

    # The benchmark's model directory is rewritten on every run: force replaces config.json and
    # tekken.json there (never through a symbolic link) and keeps every other file.
    return Path(write_model_dir(model_dir, size=size, quant=quant, force=True)).resolve()


def model_summary(model_dir: Path, size: str) -> dict[str, Any]:
    """The model keys of a result file, read from the directory the servers loaded; `quantization`
    names its scheme ("none", "fp8-static", "fp8-dynamic", "fp8-block"; "other: METHOD" for a
    quantization_config the embedded models do not write)."""
    from yali_vllm.models import quant_of

    out: dict[str, Any] = {"size": size, "dir": str(model_dir)}
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    for k in MODEL_SUMMARY_KEYS:
        if k in cfg:
            val = cfg[k]
            out[k] = ",".join(map(str, val)) if isinstance(val, list) else val
    if cfg:
        quant = quant_of(cfg)
        out["quantization"] = quant if quant is not None else f"other: {cfg['quantization_config'].get('quant_method')}"
    return out
