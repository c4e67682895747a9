#!/usr/bin/env bash
# All kernel-level GPU tests (no vLLM needed): the all-reduce sweeps, graphs,
# stress, compile, abort paths, the non-default kernel paths, the fused
# all-reduce + RMSNorm, the 2-to-8-rank suites (as many ranks as GPUs), and the CPU tests of the
# core; one gpu-test-run result.
# YALI_TIMEOUT_S bounds a broken kernel's wait to 30 s instead of 300 s.
. lab/gpu_host/env.sh
nvidia-smi topo -m | head -3
YALI_TIMEOUT_S=30 timeout 580 python3 lab/record_test_run.py --out "$OUT/gpu-tests-kernels.json" -- \
  -q -p no:cacheprovider --durations=15 tests/gpu/test_allreduce.py tests/gpu/test_fused.py tests/gpu/test_bench_timing.py \
  tests/gpu/test_ranks.py tests/core/test_core_config.py tests/core/test_ranks_table.py 2>&1 | tee "$OUT/gpu-tests-kernels.log" | tail -40
