#!/usr/bin/env bash
# Settings next to the defaults, measured in one go (no vLLM needed):
#   experiments.sh tests   every kernel test without programmatic dependent launch (YALI_DEV_PDL=0)  ~2.5 min
#   experiments.sh bench   tune round 5 (PDL on/off), then the fused op (yali-fused only) in the
#                          default and each variant (PDL off, smaller/larger send chunks)          ~1.5 min
# Compare the fused rows with the fused benchmark's yali-fused / flashinfer-trtllm rows of the same machine.
. scripts/gpu_host/env.sh
day=$(date +%Y%m%d)
case "${1:-all}" in
  tests|all)
    YALI_DEV_PDL=0 YALI_TIMEOUT_S=30 timeout 300 python3 benchmarks/record_test_run.py --out "$OUT/gpu-tests-nopdl-$day.json" -- \
      -q -p no:cacheprovider -x tests/gpu/test_allreduce.py tests/gpu/test_fused.py 2>&1 | tee "$OUT/gpu-tests-nopdl-$day.log" | tail -15 ;;&
  bench|all)
    timeout 120 python3 benchmarks/tune.py --variants round5 --out "$OUT" --name "tune-$day-r5" 2>&1 | grep -v -i warn | tail -12
    for v in "PDL=1" "PDL=0" "PUSH_CTA_BYTES=512" "PUSH_CTA_BYTES=4K"; do
      name="fused-$day-$(echo "$v" | tr -c 'A-Za-z0-9\n' '-' | tr 'A-Z' 'a-z')"
      env YALI_DEV_$v timeout 100 python3 benchmarks/fused_bench.py --backends yali-fused --out /tmp/exp --name "$name" \
        --budget-s 60 2>&1 | grep -E "^\| [0-9]" | cut -d'|' -f2,4 | tr '\n' ' '; echo " <- $v"
    done
    tar czf "$OUT/fused-experiments-$day.tgz" -C /tmp exp ;;
  *) echo "usage: $0 [tests|bench|all]" >&2; exit 2 ;;
esac
