"""`vllm serve --data-parallel-size 2 --enable-expert-parallel` of a Qwen3-MoE-shaped model (the embedded
qwen3-30b-a3b shape cut to 4 layers, dummy weights) on 2 GPUs, with CUDA graphs: with YALI's dispatch and
combine, and with vLLM's own all-gather / reduce-scatter manager (YALI_EP=0), one request after the other.

YALI's dispatch delivers the tokens bit for bit and its two-rank combine is one correctly rounded a + b, as
NCCL's two-rank reduce-scatter, and one request at a time gives both servers the same batches: the greedy
token ids and their logprobs must be the same (logprobs within LOGPROB_TOL, for the arithmetic after the
logits). Dummy weights make the logits nearly flat, so a tolerance on near ties would let almost anything
pass: none is given. The log must say YALI EP ON for both ranks, and that YALI
served the first dispatch and combine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.common.processes import free_port, stop_process_group

from . import vllm_serve
from .test_vllm_e2e import _SKIP, _timeout

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

LAYERS = 4
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Expert parallelism splits", "1, 2, 3, 5, 8,"]
MAX_TOKENS = 24
LOGPROB_TOL = 1e-4
SERVE_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    from yali_vllm.models import write_model_dir

    path = write_model_dir(tmp_path_factory.mktemp("qwen3moe") / "model", "qwen3-30b-a3b")
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_hidden_layers"] = LAYERS
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path


def _serve(moe_dir: Path, site: Path, tmp: Path, ep: bool) -> tuple[list[dict], str]:
    """Each prompt's greedy token ids and their logprobs, one request at a time, and the server log."""
    port = free_port()
    log = tmp / f"serve-ep{int(ep)}.log"
    env = vllm_serve.serve_env(vllm_serve.plugin_path(site), True, str(tmp / "cache"), YALI_EP="1" if ep else "0")
    cmd = vllm_serve.vllm_cmd() + [
        "serve", str(moe_dir), "--data-parallel-size", "2", "--enable-expert-parallel", "--load-format", "dummy",
        "--tokenizer-mode", "mistral", "--max-model-len", "2048", "--max-num-seqs", "8",
        "--gpu-memory-utilization", "0.6", "--host", "127.0.0.1", "--port", str(port),
    ]
    proc = vllm_serve.start_healthy(cmd, env, log, port, SERVE_TIMEOUT_S)
    out = []
    try:
        for prompt in PROMPTS:
            r = vllm_serve.post_json(f"http://127.0.0.1:{port}/v1/completions", {
                "model": str(moe_dir), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "logprobs": 1, "ignore_eos": True, "return_tokens_as_token_ids": True})
            lp = r["choices"][0]["logprobs"]
            out.append({"tokens": lp["tokens"], "logprobs": lp["token_logprobs"]})
    finally:
        stop_process_group(proc, grace_s=60)
    return out, log.read_text(errors="replace")


@_timeout(2 * SERVE_TIMEOUT_S + 300)
def test_dp_ep_tokens_match_vllms_manager_and_yali_serves(moe_dir, tmp_path_factory):
    site = tmp_path_factory.mktemp("plugin-site")
    tmp = tmp_path_factory.mktemp("ep-serve")
    yali, yali_log = _serve(moe_dir, site, tmp, ep=True)
    ref, ref_log = _serve(moe_dir, site, tmp, ep=False)

    on = [ln for ln in yali_log.splitlines() if "YALI EP ON for group 'ep:0'" in ln]
    assert len(on) == 2, "expected one YALI EP ON line per rank:\n" + yali_log[-6000:]
    for what in ("dispatch", "combine"):
        assert f"YALI EP: first {what} on group 'ep:0' served by YALI" in yali_log, yali_log[-6000:]
    assert "YALI EP OFF for group 'ep:0': off: YALI_EP=1 turns it on" in ref_log, ref_log[-6000:]

    for prompt, g, r in zip(PROMPTS, yali, ref):
        assert g["tokens"] == r["tokens"], f"{prompt!r}: YALI {g['tokens']} vs vLLM's manager {r['tokens']}"
        worst = max(abs(a - b) for a, b in zip(g["logprobs"], r["logprobs"]))
        assert worst <= LOGPROB_TOL, f"{prompt!r}: logprobs differ by up to {worst:.2e}"
