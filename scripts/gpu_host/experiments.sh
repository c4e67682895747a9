#!/usr/bin/env bash
# The two unmeasured experiments, tested and then measured against the defaults:
#  * programmatic dependent launch (YALI_DEV_PDL=1) for every kernel;
#  * the fused kernel with a row split over a thread-block cluster (YALI_DEV_FUSED_CLUSTER=2/4/8).
# Compare the fused rows with the fused benchmark's yali-fused / flashinfer-trtllm rows of the same machine.
. scripts/gpu_host/env.sh
day=$(date +%Y%m%d)
YALI_DEV_PDL=1 YALI_TIMEOUT_S=30 timeout 300 python3 benchmarks/record_test_run.py --out "$OUT/gpu-tests-experiments.json" -- \
  -q -p no:cacheprovider -x tests/gpu/test_allreduce.py tests/gpu/test_fused.py 2>&1 | tee "$OUT/gpu-tests-experiments.log" | tail -15
timeout 120 python3 benchmarks/tune.py --variants round5 --out "$OUT" --name "tune-$day-r5" 2>&1 | grep -v -i warn | tail -8
for v in "PDL=1" "FUSED_CLUSTER=2" "FUSED_CLUSTER=4" "FUSED_CLUSTER=8" "FUSED_CLUSTER=4 YALI_DEV_PDL=1"; do
  name="fused-$day-$(echo "$v" | tr -c 'A-Za-z0-9\n' '-' | tr 'A-Z' 'a-z')"
  env YALI_DEV_$v timeout 100 python3 benchmarks/fused_bench.py --backends yali-fused --out /tmp/exp --name "$name" \
    --budget-s 60 2>&1 | grep -E "^\[fused-bench" | tail -10
done
tar czf "$OUT/fused-experiments-$day.tgz" -C /tmp exp
