#!/usr/bin/env bash
# The fused op with its rows split over thread block clusters (YALI_DEV_FUSED_CLUSTER) next to
# one CTA per row (no vLLM needed for the tests; the benchmark's FlashInfer rows need it):
#   experiments.sh tests   the fused sweeps with clusters of 1, 2, 3, 4, 8 CTAs per row, batched
#                          polling and odd grids (tests/gpu/test_fused.py -k cluster)            ~2 min
#   experiments.sh bench   the full fused benchmark (YALI, FlashInfer, unfused; one run each) with
#                          clusters of 1, 4 and 8, then YALI alone with 2 and 3                   ~5 min
# Each result file's yali_config / yali_env records the setting it ran with.
. scripts/gpu_host/env.sh
day=$(date +%Y%m%d)
case "${1:-all}" in
  tests|all)
    YALI_TIMEOUT_S=30 timeout 300 python3 benchmarks/record_test_run.py --out "$OUT/gpu-tests-cluster-$day.json" -- \
      -q -p no:cacheprovider -x tests/gpu/test_fused.py -k "cluster" 2>&1 \
      | tee "$OUT/gpu-tests-cluster-$day.log" | tail -15 ;;&
  bench|all)
    mkdir -p /tmp/exp
    for c in 1 4 8; do
      echo "--- YALI_DEV_FUSED_CLUSTER=$c (with FlashInfer and the unfused sequence)"
      YALI_DEV_FUSED_CLUSTER=$c timeout 150 python3 benchmarks/fused_bench.py --out /tmp/exp \
        --name "fused-$day-cluster-$c" --budget-s 100 --timeout 140 2>&1 | tee "/tmp/exp/fused-$day-cluster-$c.log" \
        | grep -E "^\| [0-9]" | cut -d'|' -f2,4,5,7 | tr '\n' ' '; echo
    done
    for c in 2 3; do
      YALI_DEV_FUSED_CLUSTER=$c timeout 100 python3 benchmarks/fused_bench.py --backends yali-fused --out /tmp/exp \
        --name "fused-$day-cluster-$c" --budget-s 60 2>&1 | tee "/tmp/exp/fused-$day-cluster-$c.log" \
        | grep -E "^\| [0-9]" | cut -d'|' -f2,4 | tr '\n' ' '; echo " <- YALI_DEV_FUSED_CLUSTER=$c"
    done
    tar czf "$OUT/fused-cluster-$day.tgz" -C /tmp/exp . ;;
  *) echo "usage: $0 [tests|bench|all]" >&2; exit 2 ;;
esac
