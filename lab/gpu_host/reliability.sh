#!/usr/bin/env bash
# The never-wrong / never-hung cases on real GPUs, each rank on its own GPU (no vLLM needed):
# mismatched calls, a peer that never calls or dies, close(), the foreign PDL kernel
# (tests/gpu/test_reliability.py, two ranks), then ranks arriving at different times in CUDA graphs,
# PDL on and off, and a rank killed among them (tests/gpu/test_delays.py), and calls beside a kernel
# that holds all but one SM (tests/gpu/test_progress.py), at 2, 4 and 8 ranks as the GPUs allow.
# One gpu-test-run result per file.
. lab/gpu_host/env.sh
# PARTS (default "reliability delays progress") picks the parts; their bounds (s, 560 in all on two or
# four GPUs) are RELIABILITY_S, DELAYS_S, PROGRESS_S. test_reliability takes about 160 s (three
# 30 s watchdog waits), test_delays about 160 s on four GPUs, test_progress about 30 s. On eight
# GPUs run one part per call, e.g. PARTS=delays DELAYS_S=560.
for t in ${PARTS:-reliability delays progress}; do
  case "$t" in reliability) b=${RELIABILITY_S:-210} ;; delays) b=${DELAYS_S:-250} ;; progress) b=${PROGRESS_S:-100} ;;
    *) echo "reliability.sh: unknown part '$t' (reliability, delays, progress)" >&2; exit 2 ;; esac
  set -- "$t" "$b"
  timeout -k 10 "$2" python3 lab/record_test_run.py --out "$OUT/gpu-tests-$t.json" -- \
    -q -p no:cacheprovider -rf --durations=10 "tests/gpu/test_$t.py" 2>&1 | tee "$OUT/gpu-tests-$t.log" | tail -20
done
# $OUT keeps one JSON per part and one archive of the logs (a host returns only a few files)
logs=$(cd "$OUT" && ls gpu-tests-reliability.log gpu-tests-delays.log gpu-tests-progress.log 2>/dev/null)
if [ -n "$logs" ]; then tar czf "$OUT/gpu-tests-logs.tgz" -C "$OUT" $logs && (cd "$OUT" && rm -f $logs); fi
