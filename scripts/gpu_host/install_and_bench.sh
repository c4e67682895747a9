#!/usr/bin/env bash
# With every gpu-stack part in .gpu-stack: install vLLM 0.26.0 offline, then the full
# all-reduce microbenchmark and the fused all-reduce + RMSNorm microbenchmark
# (the first FlashInfer use JIT-compiles its kernels into ~/.cache/flashinfer,
# which the later vllm-default servers on this machine reuse).
bash .gpu-stack/install.sh .gpu-stack > /tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
tail -2 /tmp/install.log
. scripts/gpu_host/env.sh
bash scripts/gpu_host/fused.sh prebuild   # FlashInfer's JIT build overlaps the all-reduce benchmark
day=$(date +%Y%m%d)
timeout 200 python3 -m benchmarks.allreduce_bench --out "$OUT" --name "allreduce-$day" \
  --sizes 2K,16K,64K,128K,256K,512K,1M,2M,4M,8M,16M,64M,256M,1G 2>&1 \
  | grep -v -i warn > "$OUT/allreduce-$day.log"
tail -45 "$OUT/allreduce-$day.log"
bash scripts/gpu_host/fused.sh bench
