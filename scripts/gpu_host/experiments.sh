#!/usr/bin/env bash
# Settings next to the defaults, measured in one go (no vLLM needed):
#   experiments.sh tests   the kernel tests whose sweeps cover the batched push poll
#                          (YALI_DEV_BATCH_POLL=1: all-reduce and fused sweeps, plain and odd grids)  ~1.5 min
#   experiments.sh bench   tune round 6 (flash-push: one-at-a-time vs batched poll), then the fused
#                          op (yali-fused only) in the default and each variant                        ~1.5 min
# Compare the fused rows with the fused benchmark's yali-fused / flashinfer-trtllm rows of the same
# machine. (Rounds 4 and 5, chunk sizes and PDL, are in tune.py and their results files.)
. scripts/gpu_host/env.sh
day=$(date +%Y%m%d)
case "${1:-all}" in
  tests|all)
    YALI_TIMEOUT_S=30 timeout 300 python3 benchmarks/record_test_run.py --out "$OUT/gpu-tests-batch-poll-$day.json" -- \
      -q -p no:cacheprovider -x tests/gpu/test_allreduce.py tests/gpu/test_fused.py -k "batch_poll or batch-poll" 2>&1 \
      | tee "$OUT/gpu-tests-batch-poll-$day.log" | tail -15 ;;&
  bench|all)
    timeout 120 python3 benchmarks/tune.py --variants round6 --out "$OUT" --name "tune-$day-r6" 2>&1 | grep -v -i warn | tail -14
    for v in "BATCH_POLL=0" "BATCH_POLL=1"; do
      name="fused-$day-$(echo "$v" | tr -c 'A-Za-z0-9\n' '-' | tr 'A-Z' 'a-z')"
      env YALI_DEV_$v timeout 100 python3 benchmarks/fused_bench.py --backends yali-fused --out /tmp/exp --name "$name" \
        --budget-s 60 2>&1 | grep -E "^\| [0-9]" | cut -d'|' -f2,4 | tr '\n' ' '; echo " <- $v"
    done
    tar czf "$OUT/fused-experiments-$day.tgz" -C /tmp exp ;;
  *) echo "usage: $0 [tests|bench|all]" >&2; exit 2 ;;
esac
