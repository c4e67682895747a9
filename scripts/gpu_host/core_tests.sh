#!/usr/bin/env bash
# Kernel/communicator GPU tests + CPU tests of the core, recorded as a gpu-test-run result.
. scripts/gpu_host/env.sh
nvidia-smi topo -m | head -3
timeout 560 python3 benchmarks/record_test_run.py --out "$OUT/gpu-tests-core.json" -- \
  -q -p no:cacheprovider --durations=12 tests/gpu/test_allreduce.py tests/test_core_config.py 2>&1 | tee "$OUT/gpu-tests-core.log" | tail -30
