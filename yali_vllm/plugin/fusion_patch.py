"""The fusion pass patch: YALI's all-reduce+RMSNorm pass instead of vLLM's FlashInfer one.

In a worker, once a CUDA TP group exists (group_setup.py), the ``AllReduceFusionPass`` name
in vLLM's pass manager module is replaced by a factory (:func:`fusion_pass_factory`) that
builds YALI's fusion pass (yali_vllm/vllm_fusion.py) instead of vLLM's FlashInfer one when
YALI serves the group and ``YALI_FUSION`` is on (for a quantised model with vLLM's pass inside
it, yali_vllm/fusion_routing.py), and vLLM's compile cache key gets the choice
(:data:`CACHE_FACTOR`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Any

from yali_vllm.vllm_log import LOGGER, log_once

from .touch_points import ENVS, PASS_MANAGER, on

logger = logging.getLogger(LOGGER)

(_PASS,) = on(PASS_MANAGER)
_PM_MODULE, _PM_SYMBOL = _PASS.module, _PASS.symbol
(_CACHE_KEY,) = on(ENVS)
# Attribute of the factory holding the class it stands in for (marks the patch).
_FACTORY_ORIGINAL = "_yali_original"
# Compile-cache factor (see _register_cache_factor).
CACHE_FACTOR = "YALI_FUSION_PASS"


def model_quantisation(config: Any) -> str | None:
    """The quantisation method of `config`'s model ("fp8", "compressed-tensors", "modelopt", ...),
    or None for an unquantised model (or no model config)."""
    model = getattr(config, "model_config", None)
    method = getattr(model, "quantization", None)
    return str(method) if method else None


def fusion_pass_factory(original: Any) -> Any:
    """What PostGradPassManager.configure calls instead of vLLM's
    AllReduceFusionPass(config): YALI's pass when YALI serves the TP group
    and YALI_FUSION is on, else vLLM's pass (``original``). For a quantised model YALI's pass
    gets vLLM's pass too, and leaves it the pairs vLLM fuses with their quantisation
    (yali_vllm/fusion_routing.py). A bad YALI_FUSION raises ValueError naming it."""

    def AllReduceFusionPass(config: Any) -> Any:
        from yali_vllm import vllm_fusion

        yali, why = vllm_fusion.fusion_decision()
        if not yali:
            log_once(
                logger, logging.INFO, "YALI fusion pass OFF: %s; using vLLM's FlashInfer all-reduce+RMSNorm fusion", why
            )
            return original(config)
        quant = model_quantisation(config)
        flashinfer = _build_quietly(original, config) if quant else None
        try:
            pass_ = vllm_fusion.YaliAllReduceFusionPass(config, flashinfer=flashinfer)
        except Exception as e:  # deterministic, so every rank falls back alike
            logger.warning(
                "YALI fusion pass OFF: building it failed (%s: %s); using vLLM's FlashInfer fusion",
                type(e).__name__, e, exc_info=True,
            )
            return flashinfer if flashinfer is not None else original(config)
        log_once(
            logger, logging.INFO,
            "YALI fusion pass ON (replaces vLLM's FlashInfer all-reduce+RMSNorm fusion): %s%s", why,
            "" if quant is None else "; " + quantised_routing_note(quant, flashinfer),
        )
        return pass_

    setattr(AllReduceFusionPass, _FACTORY_ORIGINAL, original)
    return AllReduceFusionPass


def _build_quietly(original: Any, config: Any) -> Any:
    """vLLM's pass (built once: its workspace is set up at construction), or None with a warning
    when building it fails (then every quantised pair stays unfused, as without FlashInfer)."""
    try:
        return original(config)
    except Exception as e:  # deterministic, so every rank ends alike
        logger.warning("YALI: building vLLM's FlashInfer fusion pass failed (%s: %s); the quantised pairs stay "
                       "unfused", type(e).__name__, e, exc_info=True)
        return None


def quantised_routing_note(quant: str, flashinfer: Any, environ=None) -> str:
    """What the ON line adds for a quantised model: where its pairs go (YALI_FUSE_QUANT, then
    fusion_routing.route for the pairs left)."""
    from yali_vllm.config import fuse_quant_enabled

    if fuse_quant_enabled(environ):
        return (f"the model is quantised ({quant}) and YALI_FUSE_QUANT=1: where YALI serves the compile range a "
                "pair whose RMSNorm output is quantised to static, per-token or group-128 FP8 goes to YALI's "
                "fused all-reduce + RMSNorm + FP8 quant op; any other quantised pair as with YALI_FUSE_QUANT=0 ("
                + _routing_without_fuse_quant(quant, flashinfer) + ")")
    return _routing_without_fuse_quant(quant, flashinfer)


def _routing_without_fuse_quant(quant: str, flashinfer: Any) -> str:
    """Where fusion_routing.route sends a quantised model's pairs, for the ON line."""
    limit = getattr(flashinfer, "max_token_num", None)
    if getattr(flashinfer, "disabled", True) or limit is None:
        return (f"the model is quantised ({quant}) and vLLM's FlashInfer fusion is off: a pair whose RMSNorm "
                "output is quantised stays with YALI's all-reduce, then vLLM's RMSNorm + quant")
    return (f"the model is quantised ({quant}): up to {limit} tokens (FlashInfer's compile ranges) a pair whose "
            "RMSNorm output is quantised to static FP8 goes to vLLM's FlashInfer all-reduce + RMSNorm + quant "
            "kernel and a dynamic or per-group one to YALI's fused op, then vLLM's quant; above that every "
            "quantised pair stays with YALI's all-reduce, then vLLM's RMSNorm + quant")


def patch_fusion_pass() -> bool:
    """Replace ``AllReduceFusionPass`` in vLLM's pass_manager module (the name
    ``PostGradPassManager.configure`` instantiates) by fusion_pass_factory,
    once.  False, with a log line, when the module or the name is missing."""
    import importlib

    try:
        module = importlib.import_module(_PM_MODULE)
    except Exception as e:
        logger.warning(
            "YALI: vLLM's %s cannot be loaded (%s: %s); YALI fusion pass not installed",
            _PM_MODULE, type(e).__name__, e,
        )
        return False
    current = module.__dict__.get(_PM_SYMBOL)
    if current is None:
        logger.warning(
            "YALI: vLLM internals not recognised (%s.%s is missing); YALI fusion pass not "
            "installed, vLLM's compilation passes are left unchanged", _PM_MODULE, _PM_SYMBOL,
        )
        return False
    if getattr(current, _FACTORY_ORIGINAL, None) is None:
        setattr(module, _PM_SYMBOL, fusion_pass_factory(current))
    return True


def unpatch_fusion_pass() -> None:
    """Undo patch_fusion_pass (tests and debugging)."""
    import sys

    module = sys.modules.get(_PM_MODULE)
    current = module.__dict__.get(_PM_SYMBOL) if module is not None else None
    original = getattr(current, _FACTORY_ORIGINAL, None)
    if original is not None:
        setattr(module, _PM_SYMBOL, original)


def fusion_cache_factor() -> str:
    """Which passes this process builds, as vLLM's compile cache key sees them: "vllm", or
    "yali@" and the hash of YALI's pass sources (a graph rewritten by another version of them is
    not reused), "+quant" with YALI_FUSE_QUANT=1; "invalid (...)" for a bad knob."""
    try:
        from yali_vllm.vllm_fusion import fusion_decision

        from yali_vllm.config import fuse_quant_enabled

        if not fusion_decision()[0]:
            return "vllm"
        return f"yali@{_pass_sources_hash()}" + ("+quant" if fuse_quant_enabled() else "")
    except Exception as e:
        return f"invalid ({type(e).__name__})"


@functools.lru_cache(maxsize=1)
def _pass_sources_hash() -> str:
    """The hash of the modules that decide how vLLM's graphs are rewritten: the fusion pass and
    what it reads (the routing of quantised pairs, the limits)."""
    from yali_vllm import config, fusion_routing, vllm_fusion

    h = hashlib.sha256()
    from yali_vllm import quant_schemes

    for module in (vllm_fusion, fusion_routing, config, quant_schemes):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()[:16]


def _register_cache_factor() -> None:
    """Make vLLM's compile cache key depend on the passes chosen (fusion_cache_factor).

    vLLM keys its torch.compile caches (VllmBackend's cache directory and the
    AOT-compiled artifact) on its config and on ``vllm.envs.compile_factors()``,
    which hashes every entry of ``vllm.envs.environment_variables``; the
    plugin's choice is in neither (the AOT key does not see the passes' uuid).
    Without this entry a run with YALI's pass would load a graph compiled with
    FlashInfer's fusion by an earlier run without YALI (or the reverse).  The entry's getter is evaluated when vLLM
    computes the key, in the worker, after the TP group is set up."""
    import importlib

    table = getattr(importlib.import_module(_CACHE_KEY.module), _CACHE_KEY.symbol)
    table.setdefault(CACHE_FACTOR, fusion_cache_factor)


def install_fusion_hooks() -> None:
    """Worker side, once a CUDA TP group exists: the pass factory and the cache
    factor.  Skipped when vLLM will not build its fusion pass (eager, or
    fuse_allreduce_rms off), which also spares the import of vLLM's
    compilation passes (FlashInfer's comm module among them) in eager runs."""
    if fusion_configured() is False:
        return
    try:
        if patch_fusion_pass():
            _register_cache_factor()
    except Exception:
        logger.warning("YALI: installing the fusion pass failed; vLLM's passes unchanged", exc_info=True)


def fusion_configured() -> bool | None:
    """Whether vLLM will build its all-reduce+RMSNorm fusion pass: the pass
    config asks for it and vLLM compiles (eager runs, mode NONE, and stock
    torch.compile never apply it).  None when no vLLM config is current."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
        if cfg is None:
            return None
        cc = cfg.compilation_config
        if not cc.pass_config.fuse_allreduce_rms:
            return False
        return getattr(getattr(cc, "mode", None), "name", "VLLM_COMPILE") == "VLLM_COMPILE"
    except Exception:
        return None


def fusion_note() -> str | None:
    """A note when vLLM's FlashInfer all-reduce+RMSNorm fusion is configured,
    since the all-reduces it fuses never reach the device communicator.
    Logged only when YALI's own fusion pass is turned off (YALI_FUSION=0)."""
    if not fusion_configured():
        return None
    return (
        "vLLM's all-reduce+RMSNorm fusion (compilation_config.pass_config."
        "fuse_allreduce_rms) is on and YALI_FUSION=0 keeps vLLM's FlashInfer fusion: "
        "the all-reduces it fuses run in FlashInfer's fused kernel, not YALI; YALI serves "
        "the remaining ones (YALI_FUSION=1 fuses them with YALI's kernel instead, "
        "-cc.pass_config.fuse_allreduce_rms=false routes all of them to YALI's all-reduce)"
    )


def yali_fusion_wanted() -> bool:
    """Whether this rank's YALI_FUSION asks for YALI's fusion pass."""
    try:
        from yali_vllm.vllm_fusion import fusion_enabled

        return fusion_enabled()
    except ValueError:
        return True  # invalid YALI_FUSION: the fusion pass factory raises, naming it
    except Exception:
        return False


def register_fusion_op() -> None:
    """torch.ops.vllm.yali_fused_allreduce_rmsnorm, in every vLLM process (the
    op YALI's fusion pass puts into compiled graphs).  Never raises."""
    try:
        from yali_vllm.vllm_fusion import register_op

        register_op()
    except Exception as e:
        logger.warning(
            "YALI: the fused all-reduce+RMSNorm op cannot be registered (%s: %s); "
            "YALI's fusion pass stays off",
            type(e).__name__,
            e,
        )
