#!/usr/bin/env bash
# End-to-end serving benchmark (8B-class dummy model), bounded by its own budget.
. scripts/gpu_host/env.sh
timeout -k 20 570 python3 benchmarks/serving_bench.py --model-size 8b --repeats 2 --concurrency 1,8,32 \
  --random-output-len 128 --max-num-seqs 64 --budget-s 520 --out "$OUT/serving-8b" 2>&1 | tee "$OUT/serving.log" | tail -40
