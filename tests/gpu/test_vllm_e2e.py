"""End-to-end vLLM tests of the YALI plugin on 2 NVLink GPUs (GPU host only).

Model: the embedded Llama-3-8B-shaped config (yali_vllm.models) with vLLM's
dummy (random, seeded) weights and the Tekken tokenizer; TP=2.

* Greedy token ids with YALI equal those with YALI_ENABLE=0 (vLLM's custom
  all-reduce) and with NCCL only (disable_custom_all_reduce=True).  In eager
  mode bit for bit: with 2 ranks every backend computes a+b exactly once per
  element.  In CUDA-graph mode (compiled) equal up to a near tie, by the rule
  vLLM's own two backends need there (see _check_compiled_trio).
* YALI's device-side kernel counter grows during generation by at least
  2 x layers per decode step: in CUDA-graph mode decode steps are graph
  replays (no Python runs), so this proves the captured graphs hold YALI's
  kernels rather than a fallback.  These CUDA-graph runs turn vLLM's
  all-reduce+RMSNorm fusion off, so every all-reduce is a plain one.
* vLLM's default configuration (all-reduce+RMSNorm fusion on): with the
  plugin, YALI's fusion pass replaces vLLM's FlashInfer one, and YALI's
  fused-kernel counter grows by >= 2 x layers per decode step (the graphs
  hold YALI's fused kernel); greedy tokens equal those of vLLM's FlashInfer
  fusion (plugin off) and of no fusion (plugin off, fusion off), up to a
  near tie (see check_same_greedy).
* `vllm serve` starts with the plugin from its entry point, logs the YALI
  selection line, and answers /v1/completions and /v1/chat/completions.
* FP8 models (yali-vllm-model --quant), vLLM's default configuration: a pair whose
  norm output is quantised goes where vLLM's defaults fuse its quantisation
  (yali_vllm/fusion_routing.py), so YALI's fused-kernel counter grows by the
  unquantised pairs only (the final norm) for static FP8, and by every pair for
  the dynamic scheme, whose quantisation vLLM keeps apart, and for block FP8,
  whose linears quantise inside vLLM's GEMM op on Hopper (test_vllm_fp8_passes.py).

Every configuration runs in a fresh subprocess (tests/gpu/vllm_generate.py),
bounded by a timeout, with NVLink multicast off, and each runs once per
module (results are shared between tests).  About 8 vLLM start-ups in all;
each is kept small (max_model_len 2048, 4 prompts x 32 tokens,
gpu_memory_utilization 0.5, 4 CUDA-graph sizes).  The runs share one fresh
vLLM compile cache (VLLM_CACHE_ROOT in a temporary directory): a compiled
graph is never carried over from an earlier invocation, so each compiled
run builds its fusion pass and logs which one, and a graph compiled by one
configuration is found by another only if the cache key fails to tell them
apart (which the fusion test would catch).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common.processes import free_port, stop_process_group

from ..greedy_compare import check_same_greedy, first_divergence
from . import vllm_serve

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "vllm_generate.py"

RUN_TIMEOUT_S = 900  # one vLLM start-up + generation (compile included)
SERVE_TIMEOUT_S = 900


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.cuda.device_count() < 2:
        return "needs 2 GPUs"
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    try:
        import yali_vllm
    except Exception as e:  # pragma: no cover
        return f"yali_vllm cannot be imported: {e}"
    reason = yali_vllm.unavailable_reason()
    if reason:
        return f"YALI extension unavailable: {reason}"
    return None


def _timeout(seconds: int):
    """pytest-timeout's mark when that plugin is installed (no unknown-mark
    warning otherwise); the subprocess timeouts below bound the runs anyway."""
    if importlib.util.find_spec("pytest_timeout") is None:
        return lambda f: f
    return pytest.mark.timeout(seconds)


_SKIP = _skip_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.two_gpus,
    pytest.mark.skipif(_SKIP is not None, reason=_SKIP or ""),
]


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> str:
    """Extra PYTHONPATH so vLLM's processes load the plugin (vllm_serve.plugin_path)."""
    return vllm_serve.plugin_path(tmp_path_factory.mktemp("plugin-site"))


_CACHE_ROOT: str | None = None


@pytest.fixture(scope="module", autouse=True)
def _fresh_compile_cache(tmp_path_factory):
    """One vLLM cache directory for this module's runs (see the module docstring)."""
    global _CACHE_ROOT
    _CACHE_ROOT = str(tmp_path_factory.mktemp("vllm-cache"))
    yield
    _CACHE_ROOT = None


# Inductor picks some reduction kernels' block size and warp count by timing them in each process
# (torch._inductor.config.deterministic); its deterministic mode skips those timings, so compiled
# runs of this module differ only where they must. It is not enough for bitwise tokens: compiled
# with it, vLLM's custom all-reduce and NCCL (no YALI) chose differently at one position of one
# prompt of four, where each run's top two tokens share the top logprob bit for bit
# (lab/results/current/gpu-tests/20261128-tp2-h200-compiled-ties); compiled runs are
# therefore compared by the near-tie rule of check_same_greedy.
INDUCTOR_DETERMINISTIC = {"TORCHINDUCTOR_DETERMINISTIC": "1"}


def _env(plugin_path: str, yali: bool) -> dict[str, str]:
    return vllm_serve.serve_env(plugin_path, yali, _CACHE_ROOT, **INDUCTOR_DETERMINISTIC)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from yali_vllm.models import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("llama8b") / "model", "8b")


_RESULTS: dict[tuple, dict] = {}


def _generate(
    model_dir: Path,
    plugin_path: str,
    tmp: Path,
    *,
    yali: bool,
    eager: bool,
    nccl: bool = False,
    fuse: str = "default",
    long_prompts: bool = False,
) -> dict:
    """Run (or reuse) one configuration; returns the runner's JSON."""
    key = (str(model_dir), yali, eager, nccl, fuse, long_prompts)
    if key in _RESULTS:
        return _RESULTS[key]
    name = (
        f"{'yali' if yali else 'noyali'}-{'eager' if eager else 'graph'}-"
        f"{'nccl' if nccl else 'ca'}-fuse_{fuse}{'-long' if long_prompts else ''}"
    )
    out = tmp / f"{name}.json"
    log = tmp / f"{name}.log"
    cmd = [
        sys.executable,
        str(RUNNER),
        "--model-dir",
        str(model_dir),
        "--out",
        str(out),
        "--fuse",
        fuse,
    ]
    if eager:
        cmd.append("--eager")
    if nccl:
        cmd.append("--nccl")
    if long_prompts:
        cmd.append("--long-prompts")
    env = _env(plugin_path, yali)
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            stop_process_group(proc, grace_s=60)  # also reaps workers a clean exit left behind
    tail = log.read_text(errors="replace")[-6000:]
    assert rc == 0 and out.is_file(), f"{name} failed (rc={rc}); log tail:\n{tail}"
    result = json.loads(out.read_text())
    result["log"] = log.read_text(errors="replace")
    print(
        f"{name}: startup {result['startup_s']} s, generate {result['generate_s']} s, "
        f"YALI calls {_yali_calls(result)}"
    )
    _RESULTS[key] = result
    return result


def _yali_calls(result: dict, counter: str = "device_calls") -> list[int] | None:
    """Per-rank growth of one of YALI's device counters during generate()
    (device_calls: all-reduce launches; device_fused_calls: fused
    all-reduce+RMSNorm launches)."""
    before, after = result["stats_before"], result["stats_after"]
    if not all(s["yali"] and s.get(counter) is not None for s in after):
        return None
    return [a[counter] - b[counter] for a, b in zip(after, before, strict=True)]


def _check_trio(model_dir: Path, plugin_path: str, tmp: Path, *, eager: bool, fuse: str, record) -> None:
    yali = _generate(model_dir, plugin_path, tmp, yali=True, eager=eager, fuse=fuse)
    custom = _generate(model_dir, plugin_path, tmp, yali=False, eager=eager, fuse=fuse)
    nccl = _generate(model_dir, plugin_path, tmp, yali=False, eager=eager, nccl=True, fuse=fuse)

    # Which backend served: YALI on both ranks in the YALI run only.
    assert [s["yali"] for s in yali["stats_after"]] == [True, True], yali["stats_after"]
    assert [s["yali"] for s in custom["stats_after"]] == [False, False]
    assert [s["yali"] for s in nccl["stats_after"]] == [False, False]
    assert "YALI all-reduce ON for group 'tp:0'" in yali["log"]
    assert "YALI all-reduce OFF for group 'tp:0': disabled by YALI_ENABLE" in custom["log"]

    # YALI served every all-reduce of every step: >= 2 per layer per decode
    # step (plus the prefill and the embedding's).
    minimum = 2 * yali["num_layers"] * (yali["max_tokens"] - 1)
    calls = _yali_calls(yali)
    assert calls is not None and all(c >= minimum for c in calls), (calls, minimum)

    assert all(len(t) == yali["max_tokens"] for t in yali["token_ids"])
    if eager:
        # vLLM against itself first: if its own two backends disagree, YALI is not what differs.
        assert custom["token_ids"] == nccl["token_ids"], first_divergence("vLLM custom all-reduce vs NCCL", custom, nccl)
        assert yali["token_ids"] == custom["token_ids"], first_divergence("YALI vs vLLM custom all-reduce", yali, custom)
        assert yali["token_ids"] == nccl["token_ids"], first_divergence("YALI vs NCCL", yali, nccl)
    else:
        _check_compiled_trio(yali, custom, nccl, record)


def _check_compiled_trio(yali: dict, custom: dict, nccl: dict, record) -> None:
    """Compiled runs: vLLM's two backends are not equal bit for bit with each other (see
    INDUCTOR_DETERMINISTIC), so each pair is held to check_same_greedy's rule (tests/greedy_compare.py):
    identical tokens with logprobs within LOGPROB_TOL up to a prompt's first divergence, and that
    divergence a near tie in both runs. A wrong all-reduce changes the logits wholesale and fails it
    at once. Each pair's divergences go into the result file (record: pytest's record_property)."""
    pairs = [("vLLM custom all-reduce vs NCCL", custom, nccl), ("YALI vs vLLM custom all-reduce", yali, custom),
             ("YALI vs NCCL", yali, nccl)]
    for name, got, ref in pairs:
        _same_greedy(name, got, ref, record)


def _same_greedy(name: str, got: dict, ref: dict, record) -> None:
    """check_same_greedy, with its divergences recorded in the result file (record: pytest's
    record_property)."""
    record(f"near-tie divergences (prompt, position, gap), {name}", json.dumps(check_same_greedy(name, got, ref)))


@_timeout(3 * RUN_TIMEOUT_S + 60)
def test_eager_tokens_match_custom_ar_and_nccl(model_dir, plugin_path, tmp_path_factory):
    _check_trio(
        model_dir, plugin_path, tmp_path_factory.mktemp("eager"), eager=True, fuse="default", record=None
    )


@_timeout(3 * RUN_TIMEOUT_S + 60)
def test_cuda_graph_tokens_match_and_graphs_run_yali(model_dir, plugin_path, tmp_path_factory, record_property):
    _check_trio(model_dir, plugin_path, tmp_path_factory.mktemp("graph"), eager=False, fuse="off",
                record=record_property)


@_timeout(3 * RUN_TIMEOUT_S + 60)
def test_yali_fusion_tokens_match_flashinfer_and_unfused(model_dir, plugin_path, tmp_path_factory, record_property):
    """vLLM's default compile config (all-reduce+RMSNorm fusion on, CUDA
    graphs).  With YALI, YALI's fusion pass replaces FlashInfer's; without the
    plugin's all-reduce (YALI_ENABLE=0), vLLM's FlashInfer fusion runs; the
    third run has no fusion at all.  (The last run is shared with
    test_cuda_graph_tokens_match_and_graphs_run_yali.)"""
    tmp = tmp_path_factory.mktemp("fusion")
    yali = _generate(model_dir, plugin_path, tmp, yali=True, eager=False)
    flashinfer = _generate(model_dir, plugin_path, tmp, yali=False, eager=False)
    unfused = _generate(model_dir, plugin_path, tmp, yali=False, eager=False, fuse="off")

    assert [s["yali"] for s in yali["stats_after"]] == [True, True], yali["stats_after"]
    assert [s["yali"] for s in flashinfer["stats_after"]] == [False, False]
    # Which fusion pass each run built (each compiles: fresh compile cache).
    assert "YALI fusion pass ON (replaces vLLM's FlashInfer all-reduce+RMSNorm fusion): " \
        "YALI serves TP group 'tp:0'" in yali["log"], yali["log"][-6000:]
    assert "YALI fusion pass OFF" not in yali["log"]
    assert "YALI fusion pass OFF: YALI all-reduce is OFF for group 'tp:0'; using vLLM's FlashInfer " \
        "all-reduce+RMSNorm fusion" in flashinfer["log"], flashinfer["log"][-6000:]
    assert "YALI fusion pass ON" not in flashinfer["log"]
    assert "YALI fusion pass" not in unfused["log"]  # no fusion pass is built at all

    # The captured graphs replay YALI's fused kernel: in a Llama decoder every
    # all-reduce is followed by an RMSNorm, 2 per layer plus the embedding's.
    minimum = 2 * yali["num_layers"] * (yali["max_tokens"] - 1)
    fused = _yali_calls(yali, "device_fused_calls")
    assert fused is not None and all(c >= minimum for c in fused), (fused, minimum)

    assert all(len(t) == yali["max_tokens"] for t in yali["token_ids"])
    _same_greedy("YALI fusion vs FlashInfer fusion", yali, flashinfer, record_property)
    _same_greedy("YALI fusion vs no fusion", yali, unfused, record_property)
    print(f"YALI fused calls during generate: {fused}; plain YALI all-reduces: {_yali_calls(yali)}")


@_timeout(2 * RUN_TIMEOUT_S + 60)
def test_long_prefill_tokens_match_vllm_defaults(model_dir, plugin_path, tmp_path_factory, record_property):
    """Prefills of several hundred tokens (YALI's fused op at its larger launches, above the CUDA
    graph sizes) give the greedy tokens of vLLM's defaults."""
    tmp = tmp_path_factory.mktemp("long")
    yali = _generate(model_dir, plugin_path, tmp, yali=True, eager=False, long_prompts=True)
    plain = _generate(model_dir, plugin_path, tmp, yali=False, eager=False, long_prompts=True)
    # YALI's fused kernel served (its op's first call on that path; also from another test's cached graph)
    assert "runs YALI's fused kernel" in yali["log"], yali["log"][-6000:]
    assert all(len(t) == yali["max_tokens"] for t in yali["token_ids"])
    _same_greedy("YALI vs vLLM's defaults, long prefills", yali, plain, record_property)


# ------------------------------------------------------------------ vllm serve
@_timeout(SERVE_TIMEOUT_S + 120)
def test_vllm_serve_selects_yali_and_answers(model_dir, plugin_path, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    # Eager keeps start-up short; CUDA graphs are covered above.
    proc = vllm_serve.start_healthy(vllm_serve.serve_argv(model_dir, port), _env(plugin_path, True), log, port,
                                    SERVE_TIMEOUT_S)
    try:
        comp = vllm_serve.post_json(
            base + "/v1/completions",
            {
                "model": str(model_dir),
                "prompt": "The capital of France is",
                "max_tokens": 16,
                "temperature": 0,
            },
        )
        assert comp["choices"] and comp["usage"]["completion_tokens"] > 0
        chat = vllm_serve.post_json(
            base + "/v1/chat/completions",
            {
                "model": str(model_dir),
                "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 16,
                "temperature": 0,
            },
        )
        assert chat["choices"] and chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["usage"]["completion_tokens"] > 0
    finally:
        stop_process_group(proc, grace_s=60)
    text = log.read_text(errors="replace")
    on_lines = [ln for ln in text.splitlines() if "YALI all-reduce ON for group 'tp:0'" in ln]
    assert len(on_lines) == 2, "expected one YALI selection line per TP rank:\n" + text[-6000:]


# Every decode step of the embedded Llama shape has 1 + 2 x layers all-reduce + RMSNorm pairs: the
# embedding's with the first input norm, then per layer the attention output's with the
# post-attention norm and the MLP output's with the next input norm (the last: the final norm, whose
# output feeds the unquantised LM head). In an FP8 model every norm but the final one is quantised.
@pytest.mark.parametrize("quant", ["fp8-static", "fp8-dynamic", "fp8-block"])
@_timeout(RUN_TIMEOUT_S + 60)
def test_fp8_model_keeps_vllms_quant_fusions(quant, plugin_path, tmp_path_factory):
    """Decode steps lie within FlashInfer's compile range (TP=2): a static FP8 pair goes to
    FlashInfer's all-reduce + RMSNorm + FP8 kernel, so YALI's fused kernel serves the final norm
    alone, about one call per step; a dynamic pair goes to YALI's op (vLLM's defaults fuse only
    the all-reduce and the norm there), and so does a block-FP8 pair (its quantisation is inside
    vLLM's GEMM op on Hopper: a plain pair), 1 + 2 x layers calls per step. The plain
    all-reduces the FlashInfer kernel does not take stay with YALI."""
    from yali_vllm.models import write_model_dir

    tmp = tmp_path_factory.mktemp(f"fp8-{quant}")
    model = write_model_dir(tmp / "model", "8b", quant=quant)
    got = _generate(model, plugin_path, tmp, yali=True, eager=False)
    assert [s["yali"] for s in got["stats_after"]] == [True, True], got["stats_after"]
    assert "the model is quantised" in got["log"], got["log"][-6000:]
    steps, layers = got["max_tokens"] - 1, got["num_layers"]
    fused = _yali_calls(got, "device_fused_calls")
    assert fused is not None, got["stats_after"]
    if quant == "fp8-static":
        assert all(steps <= c < 2 * layers * steps for c in fused), (fused, steps, layers)
        assert "to vLLM's FlashInfer all-reduce + RMSNorm + quant kernel" in got["log"], got["log"][-6000:]
    else:
        assert all(c >= (1 + 2 * layers) * steps for c in fused), (fused, steps, layers)
    assert all(len(t) == got["max_tokens"] for t in got["token_ids"])

