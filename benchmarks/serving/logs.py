"""What a server log says: the YALI lines, errors, and warnings about what was expected of a config."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.serving.configs import SERVER_CONFIGS


_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
KEY_LINE_PATTERNS = [
    re.compile(r"YALI", re.IGNORECASE),
    re.compile(r"all-reduce backends"),
    re.compile(r"flashinfer allreduce backend", re.IGNORECASE),
    re.compile(r"custom allreduce is disabled", re.IGNORECASE),
    re.compile(r"AllReduceFusion|fuse_allreduce_rms|allreduce_rms", re.IGNORECASE),
    re.compile(r"plugins for group|Loading plugin|Failed to load plugin"),
]
ERROR_PATTERNS = [re.compile(r"\bERROR\b"), re.compile(r"Traceback")]
# What the plugin (yali_vllm/plugin/) logs once it has hooked a TP group.
YALI_ON_RE = re.compile(r"YALI all-reduce ON")
YALI_OFF_RE = re.compile(r"YALI all-reduce OFF")
YALI_FUSION_ON_RE = re.compile(r"YALI fusion pass ON")
YALI_EP_ON_RE = re.compile(r"YALI EP ON")
YALI_EP_SERVED_RE = re.compile(r"YALI EP: first (dispatch|combine) on group .* served by YALI")
# The fused op's first call (yali_vllm/vllm_fusion.py): the only sign of YALI's fused op when vLLM
# loaded the compiled graph from its cache and never built the fusion pass.
YALI_FUSED_OP_RE = re.compile(r"YALI fused all-reduce \+ RMSNorm op: first call .* runs YALI's fused kernel")
_OWN_HEADER_PREFIXES = ("$ ", "# env: ")  # lines start_server()/run_bounded() write themselves


def yali_log_warnings(config: str, key_lines: Sequence[str]) -> list[str]:
    """Sanity checks on one server's key log lines: YALI's all-reduce and fusion pass on exactly
    where the configuration's environment (SERVER_CONFIGS) asks for them."""
    env = SERVER_CONFIGS[config].env if config in SERVER_CONFIGS else {}
    if config in SERVER_CONFIGS and SERVER_CONFIGS[config].parallel == "dp-ep":
        return _ep_log_warnings(config, env, key_lines)
    wants_yali = env.get("YALI_ENABLE") == "1"
    on = any(YALI_ON_RE.search(ln) for ln in key_lines)
    wants_fusion = wants_yali and env.get("YALI_FUSION") != "0"
    off = [ln for ln in key_lines if YALI_OFF_RE.search(ln)]
    fused = any(YALI_FUSION_ON_RE.search(ln) or YALI_FUSED_OP_RE.search(ln) for ln in key_lines)
    warnings: list[str] = []
    if not wants_yali:
        if on:
            warnings.append(f"'YALI all-reduce ON' in the {config} server's log: YALI_ENABLE=0 did not keep it off")
        return warnings
    if not on:
        warnings.append(f"no 'YALI all-reduce ON' line in the {config} server's log: is the plugin installed "
                        "and active?")
    if off:
        warnings.append(f"the {config} server logged 'YALI all-reduce OFF': " + off[0][-200:])
    if wants_fusion and on and not fused:
        warnings.append(f"no 'YALI fusion pass ON' line and no first call of YALI's fused op in the {config} "
                        "server's log: the all-reduce + RMSNorm pairs ran through vLLM's FlashInfer fusion or unfused")
    if env.get("YALI_FUSION") == "0" and fused:
        warnings.append(f"'YALI fusion pass ON' in the {config} server's log: YALI_FUSION=0 did "
                        "not hand the fused pairs to FlashInfer")
    return warnings


def yali_off_line(config: str, path: Path) -> str | None:
    """The 'YALI all-reduce OFF' line of a tensor-parallel configuration that asks for YALI
    (YALI_ENABLE=1), or None: such a server serves with vLLM's own all-reduce, so its points
    would not measure YALI (e.g. an extension missing from the tree the server imports)."""
    cfg = SERVER_CONFIGS.get(config)
    if cfg is None or cfg.parallel != "tp" or cfg.env.get("YALI_ENABLE") != "1":
        return None
    off = [ln for ln in scan_server_log(path)["key_lines"] if YALI_OFF_RE.search(ln)]
    return off[0] if off else None


def _ep_log_warnings(config: str, env: dict[str, str], key_lines: Sequence[str]) -> list[str]:
    """A data + expert parallel server: YALI's EP line on exactly where YALI_ENABLE and YALI_EP ask for it,
    and its first dispatch and combine served by YALI there."""
    wants = env.get("YALI_ENABLE") == "1" and env.get("YALI_EP") == "1"  # YALI_EP is off by default
    on = any(YALI_EP_ON_RE.search(ln) for ln in key_lines)
    served = {m.group(1) for ln in key_lines if (m := YALI_EP_SERVED_RE.search(ln))}
    if not wants:
        return [f"'YALI EP ON' in the {config} server's log: YALI_ENABLE=0 / YALI_EP=0 did not keep it off"] if on else []
    warnings = []
    if not on:
        warnings.append(f"no 'YALI EP ON' line in the {config} server's log: vLLM's manager served the MoE layers")
    for what in ("dispatch", "combine"):
        if on and what not in served:
            warnings.append(f"no MoE {what} served by YALI in the {config} server's log")
    return warnings


def scan_server_log(
    path: Path,
    start: int = 0,
    end: int | None = None,
    *,
    max_key_lines: int = 40,
    max_error_lines: int = 20,
) -> dict[str, Any]:
    """Key lines (all-reduce backend / YALI / plugin lines) and ERROR/Traceback lines.

    ``start``/``end`` are byte offsets, so the error check can stop at the moment
    the server was asked to shut down (teardown noise is not a serving error).
    """
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(max(0, end - start))
    except OSError:
        data = b""
    key_lines: list[str] = []
    seen: set[str] = set()
    errors: list[str] = []
    n_errors = 0
    for raw in data.decode("utf-8", "replace").splitlines():
        line = _ANSI_RE.sub("", raw).strip()
        if not line or line.startswith(_OWN_HEADER_PREFIXES):
            continue
        if any(p.search(line) for p in ERROR_PATTERNS):
            n_errors += 1
            if len(errors) < max_error_lines:
                errors.append(line[:400])
        if any(p.search(line) for p in KEY_LINE_PATTERNS):
            # de-duplicate across TP ranks: strip the "(Worker_TP1 pid=..)" and timestamp prefixes
            norm = re.sub(r"^\(.*?\)\s*", "", line)
            norm = re.sub(r"^(INFO|WARNING|DEBUG|ERROR)\s+\S+\s+\S+\s+", r"\1 ", norm)
            if norm not in seen and len(key_lines) < max_key_lines:
                seen.add(norm)
                key_lines.append(line[:400])
    return {"key_lines": key_lines, "error_count": n_errors, "error_lines": errors}


# ============================================================ bench + parsing
