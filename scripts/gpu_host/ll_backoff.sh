#!/usr/bin/env bash
# Correctness of every kernel path (default table + non-default configs incl. the
# flash-ll backoff), then the flash-ll backoff measured against spinning.
. scripts/gpu_host/env.sh
timeout 100 python3 benchmarks/record_test_run.py --out "$OUT/gpu-tests-kernel-paths.json" -- \
  -q -p no:cacheprovider tests/gpu/test_allreduce.py -k "nondefault or sweep_all" 2>&1 | tail -4
timeout 80 python3 benchmarks/tune.py --variants ll-r3-spin,ll-r3-b32,ll-r3-b128,ll-r3-b512,oneshot-r3 \
  --out "$OUT" --name tune-r3 2>&1 | grep -v -i warn | tail -12
