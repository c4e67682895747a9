#!/usr/bin/env bash
# End-to-end serving benchmark of an embedded dummy model (MODEL_SIZE, default 70b; also 8b),
# bounded by its own budget. QUANT (default none): the model's FP8 scheme, fp8-static, fp8-dynamic or
# fp8-block (yali-vllm-model --quant); the result name then carries it.
#   serving.sh [REPEATS] [SUFFIX] [CONFIGS] [PROFILE_TOKENS]
# (OUTPUT_LEN: tokens out, default 256, input 1024; MIN_PROMPTS: the fewest prompts of a point (default 8);
# LONG_PROMPT_LEN > 0: one more point per server, 32 prompts of that many tokens at concurrency 1
# (the max model length grows to hold it).)
# (TP: the servers' tensor-parallel size, default 2; 4 or 8 on a host with that many GPUs (6 splits
# neither embedded model, and the benchmark refuses it); the result name then carries -tpN.)
# (SERVING_BUDGET_S bounds the run, default 555 s. LOCUST_USERS > 0: a locust run of LOCUST_S
# seconds (default 60) on each config's server after its points; SOAK_S > 0: then a soak of that
# many seconds with 64 users on the yali server; both take their time from the same budget.)
# REPEATS default 1 (repeats alternate between the configs), SUFFIX (result name) default r1,
# CONFIGS default yali,vllm-default,nccl (also: yali-flashinfer-fusion, the plugin with YALI_FUSION=0;
# yali-fusion, YALI_FUSION=1 set explicitly, the same passes as yali;
# BASE+YALI_VAR=VALUE: BASE with that YALI_* setting, e.g. yali+YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX=131072)
# (three do not fit one 10-minute run: split them and merge the results with
# `serving_bench.py --report-only A.json B.json --out DIR`), PROFILE_TOKENS default 0: > 0 profiles
# one request of that many tokens per config after its measurements (decode-profile.json/.md);
# PROFILE_PREFILL_TOKENS > 0 (env) then profiles the prefill of a prompt of that many tokens
# (prefill-profile.json/.md).
# STEP_TIMES=1: every server logs its engine steps, and step-times.md tables their times per config by
# the tokens a step carries (which steps an ITL p99 difference sits in).
# STOP_GRACE_S (default 30) is the SIGTERM grace of a server stop, which the budget keeps in reserve.
# The budget plans each server start and point with the times an earlier run of the same workload
# observed on this machine (~/.cache/yali-serving-bench/estimates.json, beside vLLM's compile cache),
# so a run does not start a server whose points then do not fit.
# CONCURRENCY (default 1,8,32) narrows the points, e.g. to add one config's missing c=32 to an
# earlier run. $OUT is kept to a few files, also when two runs share it: each run leaves
# its log, its JSON and one archive (the markdown, load-test/soak JSON, per-point raw files, server
# logs and locust CSV/HTML are inside it; the markdown is also printed).
. lab/gpu_host/env.sh
MODEL_SIZE="${MODEL_SIZE:-70b}"
QUANT="${QUANT:-none}"
QUANT_TAG=$([ "$QUANT" = none ] || echo "-$QUANT")
LONG="${LONG_PROMPT_LEN:-0}"
MAX_LEN=$(( (LONG > 1024 ? LONG : 1024) + ${OUTPUT_LEN:-256} ))
MAX_LEN=$(( MAX_LEN > 2048 ? MAX_LEN : 2048 ))
name="serving-$MODEL_SIZE$QUANT_TAG-$(date +%Y%m%d)$TP_TAG-${2:-r1}"
work=/tmp/$name
timeout -k 20 "$(( ${SERVING_BUDGET_S:-555} + 20 ))" python3 -m benchmarks.serving_bench --model-size "$MODEL_SIZE" --quant "$QUANT" --world-size "$TP" --repeats "${1:-1}" --concurrency "${CONCURRENCY:-1,8,32}" \
  --configs "${3:-yali,vllm-default,nccl}" --profile-tokens "${4:-0}" --profile-prefill-tokens "${PROFILE_PREFILL_TOKENS:-0}" \
  --locust-users "${LOCUST_USERS:-0}" --locust-duration-s "${LOCUST_S:-60}" --soak-s "${SOAK_S:-0}" \
  --random-input-len 1024 --random-output-len "${OUTPUT_LEN:-256}" --min-prompts "${MIN_PROMPTS:-8}" --long-prompt-len "$LONG" \
  --max-model-len "$MAX_LEN" --max-num-seqs 64 --stop-grace-s "${STOP_GRACE_S:-30}" --budget-s "${SERVING_BUDGET_S:-555}" --out "$work" \
  --estimates-file "$HOME/.cache/yali-serving-bench/estimates.json" \
  ${STEP_TIMES:+--step-times} 2>&1 \
  | tee "$OUT/$name.log" | grep -v -i warn | tail -45
cp "$work"/serving-benchmark.json "$OUT/$name.json" 2>/dev/null
cat "$work"/serving-benchmark.md 2>/dev/null | head -40
cat "$work"/decode-profile.md 2>/dev/null | head -60  # through the decode-step table
cat "$work"/prefill-profile.md 2>/dev/null | head -40
for f in load-test soak step-times; do cat "$work/$f.md" 2>/dev/null | head -30; done
tar czf "$OUT/$name-raw.tgz" -C /tmp --exclude='*.pt.trace.json*' "$name"  # per-point JSONs, server logs, profile, locust CSV/HTML
ls -la "$OUT"
