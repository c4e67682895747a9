#!/usr/bin/env bash
# vLLM end-to-end tests of the plugin (test_vllm_e2e.py; test_vllm_fault.py: a TP worker killed
# under `vllm serve`, TP=2 and, on a host with four GPUs, TP=4, ~4 min each; test_fusion_fallback.py: the fused op's fallback norm, one GPU;
# test_vllm_ep.py: DP=2 + EP serving of a Qwen3-MoE shape, YALI's dispatch / combine vs vLLM's manager);
# $1 selects them (pytest -k, e.g. "killed"), $2 names the result file.
# VLLM_TESTS_TIMEOUT_S (default 570) bounds the run, e.g. when it runs next to a benchmark.
. lab/gpu_host/env.sh
timeout "${VLLM_TESTS_TIMEOUT_S:-570}" python3 lab/record_test_run.py --out "$OUT/gpu-tests-vllm-$2.json" -- \
  -q -p no:cacheprovider -x --durations=10 tests/gpu/test_vllm_e2e.py tests/gpu/test_vllm_fault.py tests/gpu/test_fusion_fallback.py tests/gpu/test_vllm_ep.py -k "$1" 2>&1 | tee "$OUT/gpu-tests-vllm-$2.log" | tail -40
