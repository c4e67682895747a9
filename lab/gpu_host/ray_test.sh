#!/usr/bin/env bash
# vLLM's Ray executor with the plugin on a local single-node Ray cluster.
. lab/gpu_host/env.sh
RAY_TEST_TIMEOUT=240 timeout 570 python3 lab/record_test_run.py --out "$OUT/gpu-tests-ray.json" -- \
  -q -p no:cacheprovider -s --durations=5 tests/gpu/test_ray_executor.py 2>&1 | tee "$OUT/gpu-tests-ray.log" | tail -40
