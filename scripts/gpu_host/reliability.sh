#!/usr/bin/env bash
# The never-wrong / never-hung cases on real GPUs, each rank on its own GPU (no vLLM needed):
# mismatched calls, a peer that never calls or dies, close(), the foreign PDL kernel
# (tests/gpu/test_reliability.py, two ranks), then ranks arriving at different times in CUDA graphs,
# PDL on and off, and a rank killed among them (tests/gpu/test_delays.py, 2, 4 and 8 ranks: as many
# as there are GPUs). One gpu-test-run result per file.
. scripts/gpu_host/env.sh
for t in reliability delays; do
  timeout -k 10 "${RELIABILITY_PART_S:-280}" python3 scripts/record_test_run.py --out "$OUT/gpu-tests-$t.json" -- \
    -q -p no:cacheprovider -rf --durations=10 "tests/gpu/test_$t.py" 2>&1 | tee "$OUT/gpu-tests-$t.log" | tail -20
done
