#!/usr/bin/env bash
# Programmatic dependent launch (YALI_DEV_PDL=1): correctness of every kernel with it,
# then plain vs PDL launches side by side (tune round 5), then the fused op with PDL
# (compare with the fused benchmark's yali-fused row of the same machine).
. scripts/gpu_host/env.sh
YALI_DEV_PDL=1 YALI_TIMEOUT_S=30 timeout 300 python3 benchmarks/record_test_run.py --out "$OUT/gpu-tests-pdl.json" -- \
  -q -p no:cacheprovider -x tests/gpu/test_allreduce.py tests/gpu/test_fused.py 2>&1 | tee "$OUT/gpu-tests-pdl.log" | tail -15
timeout 120 python3 benchmarks/tune.py --variants round5 --out "$OUT" --name "tune-$(date +%Y%m%d)-r5" 2>&1 | grep -v -i warn | tail -12
YALI_DEV_PDL=1 timeout 150 python3 benchmarks/fused_bench.py --backends yali-fused --out "$OUT" --name "fused-pdl-$(date +%Y%m%d)" \
  --budget-s 100 2>&1 | grep -v -i warn | tail -20
