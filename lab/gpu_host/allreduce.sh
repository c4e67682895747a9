#!/usr/bin/env bash
# The all-reduce microbenchmark (benchmarks/allreduce_bench.py) at TP ranks (env TP, default 2; one
# GPU per rank): YALI against NCCL, vLLM's custom all-reduce and pynccl, and torch symmetric
# memory's one-shot and two-shot all-reduce (multicast off), 2 KiB to 1 GiB. Further arguments go to
# the benchmark (e.g. --quick). Writes to $OUT: allreduce-<date>[-tpN].{json,md,png,log}.
# ALLREDUCE_TIMEOUT_S (default 200) bounds the run.
. lab/gpu_host/env.sh
name="allreduce-$(date +%Y%m%d)$TP_TAG"
timeout -k 20 "${ALLREDUCE_TIMEOUT_S:-200}" python3 -m benchmarks.allreduce_bench --world-size "$TP" --out "$OUT" \
  --name "$name" --sizes 2K,16K,64K,128K,256K,512K,1M,2M,4M,8M,16M,64M,256M,1G "$@" 2>&1 \
  | grep -v -i warn > "$OUT/$name.log"
tail -45 "$OUT/$name.log"
