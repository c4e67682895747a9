#!/usr/bin/env bash
# Fused all-reduce + residual add + RMSNorm on the GPU host.
#   fused.sh [all]       the 2-GPU tests (a gpu-test-run result), then the microbenchmark (< 9 min)
#   fused.sh tests       only tests/gpu/test_fused.py                                  (< 3.5 min)
#   fused.sh bench ...   only benchmarks/fused_bench.py at TP ranks (env TP, default 2: one GPU per
#                        rank); further arguments go to it                             (< 5.5 min)
#   fused.sh prebuild    start FlashInfer's JIT build in the background and return at once (run it
#                        early, e.g. before another benchmark, so the fused benchmark finds it built)
# The benchmark compares YALI with vLLM's FlashInfer fusion (trtllm backend only) and the unfused
# sequence. Writes to $OUT: gpu-tests-fused-<date>.{json,log}, fused-<date>[-tpN].{json,md,png},
# fused-bench-<date>[-tpN].log. FUSED_TEST_TIMEOUT_S and FUSED_BENCH_BUDGET_S override the bounds.
. lab/gpu_host/env.sh
MODE="${1:-all}"
[ $# -gt 0 ] && shift
STAMP="$(date +%Y%m%d)"
TEST_S="${FUSED_TEST_TIMEOUT_S:-200}"      # the tests take about a minute and a half (their pair: <= 150 s)
BUDGET_S="${FUSED_BENCH_BUDGET_S:-200}"    # the benchmark starts no measurement after this (from its start)

prebuild() {
  # FlashInfer JIT-builds its all-reduce kernels on a fresh host (CPU minutes). The benchmark
  # waits for a build in progress through FlashInfer's file lock.
  timeout 420 python3 -c '
import time
t = time.time()
from flashinfer.comm.trtllm_ar import get_trtllm_comm_module
get_trtllm_comm_module()
print(f"FlashInfer trtllm comm module ready in {time.time() - t:.0f}s")
' > /tmp/fused-flashinfer-jit.log 2>&1 < /dev/null &
}

run_tests() {
  timeout -k 10 "$TEST_S" python3 lab/record_test_run.py --out "$OUT/gpu-tests-fused-$STAMP.json" -- \
    -q -p no:cacheprovider -rA --durations=8 tests/gpu/test_fused.py 2>&1 \
    | tee "$OUT/gpu-tests-fused-$STAMP.log" | tail -40
}

run_bench() {
  timeout -k 20 "$((BUDGET_S + 110))" python3 -m benchmarks.fused_bench --world-size "$TP" --out "$OUT" \
    --name "fused-$STAMP$TP_TAG" --budget-s "$BUDGET_S" --timeout "$((BUDGET_S + 90))" "$@" 2>&1 \
    | tee "$OUT/fused-bench-$STAMP$TP_TAG.log" | grep -v -i "warn" | tail -60
  if [ -f /tmp/fused-flashinfer-jit.log ]; then echo "--- FlashInfer JIT pre-build:"; tail -3 /tmp/fused-flashinfer-jit.log; fi
}

case "$MODE" in
  all)      nvidia-smi topo -m | head -3; prebuild; run_tests; run_bench "$@" ;;
  tests)    nvidia-smi topo -m | head -3; run_tests ;;
  bench)    run_bench "$@" ;;
  prebuild) prebuild ;;
  *)        echo "usage: $0 [all|tests|bench [fused_bench.py args]|prebuild]" >&2; exit 2 ;;
esac
