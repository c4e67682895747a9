#!/usr/bin/env bash
# The fused op's launch shape next to its default (no vLLM needed):
#   experiments.sh tests   tests/gpu/test_fused.py: the default suite and every non-default setting
#                          (no PDL, batched / never batched poll, clusters never / always), then
#                          the whole suite with clusters of 8 at every size                       ~2.5 min
#   experiments.sh bench   the fused op (yali-fused only, 1-128 tokens, at TP ranks: env.sh) once
#                          per setting of SETTINGS below, the default first and last (drift
#                          check)                                                                 ~5 min
#   experiments.sh allreduce  the N-rank all-reduce (yali and NCCL, bf16, EXPERIMENT_SIZES, default
#                          4-64 MiB, with YALI_DEV_RANKS_MAX=64M so YALI serves them all) once per
#                          setting of ALLREDUCE_SETTINGS below, the default first and last      ~2 min
# Compare the rows with the fused benchmark's yali-fused / flashinfer-trtllm rows of the same machine.
# (flash-push has no batched poll: current/tune/20261122-batch-poll measured it slower.)
. lab/gpu_host/env.sh
day=$(date +%Y%m%d)
SETTINGS=(
  ""
  "FUSED_CLUSTER=0"
  "FUSED_CLUSTER=8"
  "FUSED_BATCH_POLL_MIN=0"
  ""
)
# The push two-shot round by round (YALI_DEV_RANKS_TWO_SHOT_ROUND) against its whole share at once.
ALLREDUCE_SETTINGS=(
  ""
  "RANKS_TWO_SHOT_ROUND=8K"
  "RANKS_TWO_SHOT_ROUND=32K"
  ""
)
# EXPERIMENT_SETTINGS="A=1 B=2;C=3;" replaces the list (of the mode that runs) (settings split at ';', an empty one = default);
# EXPERIMENT_TOKENS and EXPERIMENT_HIDDEN replace the benchmark's token counts and hidden sizes, e.g.
# the N-rank one-launch limit: EXPERIMENT_SETTINGS=";RANKS_FUSED_ONE_LAUNCH_MAX=1M;RANKS_FUSED_ONE_LAUNCH_MAX=512K;"
# EXPERIMENT_TOKENS=16,32,48,64,96,128,192,256 EXPERIMENT_HIDDEN=5120,8192 TP=4.
if [ -n "${EXPERIMENT_SETTINGS:-}" ]; then
  IFS=';' read -r -a SETTINGS <<< "$EXPERIMENT_SETTINGS"
  ALLREDUCE_SETTINGS=("${SETTINGS[@]}")
fi
case "${1:-all}" in tests|bench|allreduce|all) ;; *) echo "usage: $0 [tests|bench|allreduce|all]" >&2; exit 2 ;; esac
case "${1:-all}" in
  tests|all)
    YALI_TIMEOUT_S=30 timeout 300 python3 lab/record_test_run.py --out "$OUT/gpu-tests-fused-launch-$day.json" -- \
      -q -p no:cacheprovider tests/gpu/test_fused.py tests/core/test_core_config.py 2>&1 \
      | tee "$OUT/gpu-tests-fused-launch-$day.log" | tail -15
    # the whole fused suite (sweep, interleaved with plain all-reduces, 1000 graph replays,
    # torch.compile) launched as clusters of up to 8 CTAs at every size
    YALI_DEV_FUSED_CLUSTER=8 YALI_TIMEOUT_S=30 timeout 200 python3 lab/record_test_run.py \
      --out "$OUT/gpu-tests-fused-cluster8-$day.json" -- -q -p no:cacheprovider tests/gpu/test_fused.py \
      -k "not nondefault" 2>&1 | tee "$OUT/gpu-tests-fused-cluster8-$day.log" | tail -5 ;;&
  bench|all)
    n=0
    for v in "${SETTINGS[@]}"; do
      n=$((n + 1))
      name="fused-$day$TP_TAG-launch-$n-$(echo "${v:-default}" | tr -c 'A-Za-z0-9\n' '-' | tr 'A-Z' 'a-z')"
      env $(for kv in $v; do printf 'YALI_DEV_%s ' "$kv"; done) timeout 100 python3 -m benchmarks.fused_bench \
        --world-size "$TP" --backends yali-fused --tokens "${EXPERIMENT_TOKENS:-1,2,4,8,16,32,64,128}" --hidden "${EXPERIMENT_HIDDEN:-8192}" --out "$OUT/exp" --name "$name" --budget-s 60 2>&1 \
        | grep -E "^\| [0-9]" | cut -d'|' -f2,4 | tr '\n' ' '; echo " <- ${v:-default}"
    done
    tar czf "$OUT/fused-launch-$day.tgz" -C "$OUT" exp && rm -rf "$OUT/exp" ;;
  allreduce)
    n=0
    for v in "${ALLREDUCE_SETTINGS[@]}"; do
      n=$((n + 1))
      name="allreduce-$day$TP_TAG-exp-$n-$(echo "${v:-default}" | tr -c 'A-Za-z0-9\n' '-' | tr 'A-Z' 'a-z')"
      env YALI_DEV_RANKS_MAX=64M $(for kv in $v; do printf 'YALI_DEV_%s ' "$kv"; done) timeout 150 python3 -m benchmarks.allreduce_bench \
        --world-size "$TP" --backends yali,nccl --dtypes bf16 --sizes "${EXPERIMENT_SIZES:-4M,8M,16M,24M,32M,64M}" \
        --out "$OUT/exp" --name "$name" --timeout 140 > "$OUT/$name.log" 2>&1
      grep -E "^\| *[0-9]" "$OUT/exp/$name.md" 2>/dev/null | head -12; echo " <- ${v:-default}"
    done
    tar czf "$OUT/allreduce-exp-$day.tgz" -C "$OUT" exp && rm -rf "$OUT/exp" ;;
esac
