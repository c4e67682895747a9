#!/usr/bin/env bash
# Expert parallelism on TP GPUs (env TP, default 2; one GPU per rank): the dispatch / combine
# kernel tests (tests/gpu/test_ep.py, as many ranks as GPUs) as a gpu-test-run result, then the
# MoE microbenchmark (benchmarks/moe_bench.py): YALI against vLLM's AgRs manager's pynccl calls.
# Further arguments go to the benchmark (e.g. --quick). Writes to $OUT:
# gpu-tests-ep-<date>[-tpN].{json,log} and moe-<date>[-tpN].{json,md,png,log}.
# MOE_TESTS_TIMEOUT_S (default 300) and MOE_BENCH_TIMEOUT_S (default 240) bound the two parts.
. lab/gpu_host/env.sh
stamp="$(date +%Y%m%d)$TP_TAG"
YALI_TIMEOUT_S=30 timeout -k 10 "${MOE_TESTS_TIMEOUT_S:-300}" python3 lab/record_test_run.py \
  --out "$OUT/gpu-tests-ep-$stamp.json" -- -q -p no:cacheprovider --durations=10 tests/gpu/test_ep.py 2>&1 \
  | tee "$OUT/gpu-tests-ep-$stamp.log" | tail -25
timeout -k 20 "${MOE_BENCH_TIMEOUT_S:-240}" python3 -m benchmarks.moe_bench --world-size "$TP" --out "$OUT" \
  --name "moe-$stamp" "$@" 2>&1 | grep -v -i warn > "$OUT/moe-$stamp.log"
tail -30 "$OUT/moe-$stamp.log"
