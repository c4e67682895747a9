#!/usr/bin/env bash
# The fused op's receive poll next to its default (no vLLM needed):
#   experiments.sh tests   the fused sweeps with the poll batched at every size, at none, and on
#                          odd grids (YALI_DEV_FUSED_BATCH_POLL_MIN=0 / 1G)                       ~1 min
#   experiments.sh bench   the fused op (yali-fused only) with the default switch (512 KiB), always
#                          batched and never batched                                              ~1.5 min
# Compare the rows with the fused benchmark's yali-fused / flashinfer-trtllm rows of the same machine.
# (Session 5 measured flash-push's batched poll in tune round 6 and removed it: tune-20261122-r6.)
. scripts/gpu_host/env.sh
day=$(date +%Y%m%d)
case "${1:-all}" in
  tests|all)
    YALI_TIMEOUT_S=30 timeout 300 python3 benchmarks/record_test_run.py --out "$OUT/gpu-tests-batch-poll-$day.json" -- \
      -q -p no:cacheprovider -x tests/gpu/test_fused.py -k "batch-poll" 2>&1 \
      | tee "$OUT/gpu-tests-batch-poll-$day.log" | tail -15 ;;&
  bench|all)
    for v in "" "FUSED_BATCH_POLL_MIN=0" "FUSED_BATCH_POLL_MIN=1G"; do
      name="fused-$day-poll-$(echo "${v:-default}" | tr -c 'A-Za-z0-9\n' '-' | tr 'A-Z' 'a-z')"
      env ${v:+YALI_DEV_$v} timeout 100 python3 benchmarks/fused_bench.py --backends yali-fused --out /tmp/exp --name "$name" \
        --budget-s 60 2>&1 | grep -E "^\| [0-9]" | cut -d'|' -f2,4 | tr '\n' ' '; echo " <- ${v:-default}"
    done
    tar czf "$OUT/fused-experiments-$day.tgz" -C /tmp exp ;;
  *) echo "usage: $0 [tests|bench|all]" >&2; exit 2 ;;
esac
