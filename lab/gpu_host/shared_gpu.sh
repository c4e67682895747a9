#!/usr/bin/env bash
# The kernel tests on a machine with ONE GPU (an H200 or H100): every rank's process shares
# GPU 0 (YALI_ALLOW_SHARED_GPU=1, tests/gpu/pair.py), with the same CUDA IPC exchange, launches
# and checks as on a multi-GPU host. It runs the kernels' protocol, launch shapes (clusters
# included) and numerics on real silicon when no multi-GPU machine is available. Local memory
# stands where NVLink would be and the processes take turns on the GPU, so nothing here is a
# timing and a race that needs the link's latency may not show.
#   shared_gpu.sh [all|fused|allreduce|reliability|ranks|ep|delays|progress|abort] [pytest args...]
#   (pytest args, e.g. -k 8-ranks, go to every test file of the part)
#   all (default): the two-rank fused suite first, then the two-rank all-reduce (< 9.5 min);
#   reliability: mismatched calls, watchdog paths, a killed peer, close() (~5 min);
#   ranks: the all-reduce and the fused op at 2, 4, 6 and 8 ranks, a mismatched call included,
#   all N processes on GPU 0 (tests/gpu/test_ranks.py, ~3 min on an H100);
#   ep: the expert-parallel dispatch and combine at 2, 4, 6 and 8 ranks (tests/gpu/test_ep.py);
#   delays: ranks arriving at different times in CUDA graphs, a killed rank (tests/gpu/test_delays.py),
#   and calls beside a kernel that holds all but one SM (tests/gpu/test_progress.py)
#   progress: tests/gpu/test_progress.py alone (calls beside busy SMs, whole-row fused calls beside a
#   kernel that holds all but 60 SMs longer than YALI_TIMEOUT_S);
#   abort: overlapping buffers refused, the abort record of a stalled CTA, and every rank's process
#   raised or ended after a mismatched call (tests/gpu/test_overlap.py, test_abort_record.py,
#   test_abort_exit.py)
# Taking turns costs about 3.3 ms per call pair (the 10k-replay graph test, 70k pairs, takes
# 232 s: archive/gpu-tests/20261123-shared-h200), so the all-reduce part leaves out the 100k-call stress
# test, whose 300 s bound assumes concurrent ranks; it stays with the 2-GPU host (kernels.sh).
# Writes to $OUT: gpu-tests-shared-<part>-<date>.{json,log} (gpu-test-run results).
# SHARED_FUSED_S, SHARED_ALLREDUCE_S, SHARED_RELIABILITY_S, SHARED_RANKS_S, SHARED_EP_S, SHARED_DELAYS_S,
# SHARED_PROGRESS_S and SHARED_ABORT_S override the bounds of the parts.
. lab/gpu_host/env.sh
export YALI_ALLOW_SHARED_GPU=1 YALI_TIMEOUT_S=30
MODE="${1:-all}"
[ $# -gt 0 ] && shift
EXTRA=("$@")
STAMP="$(date +%Y%m%d)"

run_part() {  # run_part NAME SECONDS TEST_FILE [pytest args]
  local name="$1" bound="$2"
  shift 2
  timeout -k 10 "$bound" python3 lab/record_test_run.py --out "$OUT/gpu-tests-shared-$name-$STAMP.json" -- \
    -q -p no:cacheprovider -rA --durations=12 "$@" "${EXTRA[@]}" 2>&1 | tee "$OUT/gpu-tests-shared-$name-$STAMP.log" \
    | grep -v "shares cuda:0 with its peer\|Captured stderr" | tail -45
}

nvidia-smi --query-gpu=index,name,uuid,driver_version --format=csv,noheader
echo "MPS control: $(command -v nvidia-cuda-mps-control || echo 'not found') (not used: the processes time-slice)"
case "$MODE" in
  all)       run_part fused "${SHARED_FUSED_S:-200}" tests/gpu/test_fused.py
             run_part allreduce "${SHARED_ALLREDUCE_S:-380}" tests/gpu/test_allreduce.py tests/gpu/test_bench_timing.py -k "not stress" ;;
  fused)     run_part fused "${SHARED_FUSED_S:-540}" tests/gpu/test_fused.py ;;
  allreduce) run_part allreduce "${SHARED_ALLREDUCE_S:-540}" tests/gpu/test_allreduce.py tests/gpu/test_bench_timing.py -k "not stress" ;;
  reliability) run_part reliability "${SHARED_RELIABILITY_S:-540}" tests/gpu/test_reliability.py ;;
  ranks)     run_part ranks "${SHARED_RANKS_S:-560}" tests/gpu/test_ranks.py ;;
  ep)        run_part ep "${SHARED_EP_S:-560}" tests/gpu/test_ep.py ;;
  delays)    run_part delays "${SHARED_DELAYS_S:-560}" tests/gpu/test_delays.py tests/gpu/test_progress.py ;;
  progress)  run_part progress "${SHARED_PROGRESS_S:-560}" tests/gpu/test_progress.py ;;
  abort)     run_part abort "${SHARED_ABORT_S:-560}" tests/gpu/test_overlap.py tests/gpu/test_abort_record.py \
                 tests/gpu/test_abort_exit.py ;;
  *)         echo "usage: $0 [all|fused|allreduce|reliability|ranks|ep|delays|progress|abort]" >&2; exit 2 ;;
esac
