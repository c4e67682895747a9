#!/usr/bin/env bash
# Decode-step profile of the 70B dummy model, yali vs vllm-default (torch profiler):
# which kernels run per token and the idle gaps around the fused all-reduces.
. lab/gpu_host/env.sh
work=/tmp/decode-profile-$(date +%Y%m%d)
timeout -k 20 570 python3 -m lab.decode_profile --model-size 70b --max-num-seqs 8 --tokens 32 \
  --budget-s 550 --out "$work" 2>&1 | tee "$OUT/decode-profile.log" | tail -40
cp "$work"/decode-profile.json "$work"/decode-profile.md "$OUT/" 2>/dev/null
tar czf "$OUT/decode-profile-traces.tgz" -C "$work" traces server-logs 2>/dev/null
ls -la "$OUT"
