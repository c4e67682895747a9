#!/usr/bin/env bash
# Last gpu-stack part is here: install vLLM 0.26.0 offline, then the full all-reduce microbenchmark.
bash .gpu-stack/install.sh .gpu-stack > /tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
tail -2 /tmp/install.log
. scripts/gpu_host/env.sh
timeout 500 python3 benchmarks/allreduce_bench.py --out "$OUT" --name "allreduce-$(date +%Y%m%d)" 2>&1 \
  | grep -v -i warn | tee "$OUT/allreduce-bench.log" | tail -70
