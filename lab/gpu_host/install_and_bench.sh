#!/usr/bin/env bash
# With every gpu-stack part in .gpu-stack: install vLLM 0.26.0 offline, then the full
# all-reduce microbenchmark (allreduce.sh) and the fused all-reduce + RMSNorm microbenchmark
# (fused.sh bench), both at TP ranks (env TP, default 2; one GPU per rank)
# (the first FlashInfer use JIT-compiles its kernels into ~/.cache/flashinfer,
# which the later vllm-default servers on this machine reuse).
bash .gpu-stack/install.sh .gpu-stack > /tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
tail -2 /tmp/install.log
. lab/gpu_host/env.sh
# FlashInfer's module built ahead of time (flashinfer_aot.sh build), when it travels with the parts
if [ -f .gpu-stack/flashinfer-aot/trtllm_comm.so ]; then bash lab/gpu_host/flashinfer_aot.sh install .gpu-stack/flashinfer-aot || true; fi
bash lab/gpu_host/fused.sh prebuild   # FlashInfer's JIT build overlaps the all-reduce benchmark
TP="$TP" bash lab/gpu_host/allreduce.sh
TP="$TP" bash lab/gpu_host/fused.sh bench
