#!/usr/bin/env bash
# The off-by-default experiments, tested and then measured against the defaults:
#  * programmatic dependent launch (YALI_DEV_PDL=1) for every kernel;
#  * the fused kernel with a row split over a thread-block cluster (YALI_DEV_FUSED_CLUSTER=2/4/8).
#   experiments.sh tests   every kernel test with PDL on (the cluster sweeps are in kernels.sh)  ~2.5 min
#   experiments.sh bench   tune round 5, then the fused op (yali-fused only, no vLLM needed) in the
#                          default and in each variant                                          ~2 min
# Compare the fused rows with the fused benchmark's yali-fused / flashinfer-trtllm rows of the same machine.
. scripts/gpu_host/env.sh
day=$(date +%Y%m%d)
case "${1:-all}" in
  tests|all)
    YALI_DEV_PDL=1 YALI_TIMEOUT_S=30 timeout 300 python3 benchmarks/record_test_run.py --out "$OUT/gpu-tests-pdl-$day.json" -- \
      -q -p no:cacheprovider -x tests/gpu/test_allreduce.py tests/gpu/test_fused.py 2>&1 | tee "$OUT/gpu-tests-pdl-$day.log" | tail -15 ;;&
  bench|all)
    timeout 120 python3 benchmarks/tune.py --variants round5 --out "$OUT" --name "tune-$day-r5" 2>&1 | grep -v -i warn | tail -12
    for v in "FUSED_CLUSTER=1" "PDL=1" "FUSED_CLUSTER=2" "FUSED_CLUSTER=4" "FUSED_CLUSTER=8" "FUSED_CLUSTER=4 YALI_DEV_PDL=1"; do
      name="fused-$day-$(echo "$v" | tr -c 'A-Za-z0-9\n' '-' | tr 'A-Z' 'a-z')"
      env YALI_DEV_$v timeout 100 python3 benchmarks/fused_bench.py --backends yali-fused --out /tmp/exp --name "$name" \
        --budget-s 60 2>&1 | grep -E "^\| [0-9]" | cut -d'|' -f2,4 | tr '\n' ' '; echo " <- $v"
    done
    tar czf "$OUT/fused-experiments-$day.tgz" -C /tmp exp ;;
  *) echo "usage: $0 [tests|bench|all]" >&2; exit 2 ;;
esac
