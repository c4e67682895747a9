#!/usr/bin/env bash
# Correctness of the kernel paths the default table leaves out (no vLLM needed).
. scripts/gpu_host/env.sh
timeout 240 python3 benchmarks/record_test_run.py --out "$OUT/gpu-tests-kernel-paths.json" -- \
  -q -p no:cacheprovider --durations=5 tests/gpu/test_allreduce.py -k "nondefault or sweep_all" 2>&1 | tee "$OUT/gpu-tests-kernel-paths.log" | tail -15
