// YALI's size table: every size boundary, band and launch choice, one literal row each, indexed by
// world size and message bytes (and row bytes where the fused op needs them). The comment line of a
// row names why it holds and its result folder under lab/results/; the numbers are from
// 2xH200 NV18 in bf16 unless a row says otherwise, and lab/DESIGN_LOG.md keeps what was tried and
// left. plan.cpp looks the rows up (plan_for, fused_launch_for, ranks_max_for, ...) and nothing else
// holds a boundary; the library exports the table resolved under the settings (plan_text, the torch
// op plan_table), which the Python package and the tests read.
//
// A boundary that a setting moves names it: two-rank boundaries ARE settings (settings.def holds
// their defaults, the measured best, and their YALI_DEV_* knobs); an N-rank row's value holds
// while its knob is 0.
#pragma once
#include <cstddef>

#include "yali/common/config.h"

namespace yali {
namespace table {

constexpr size_t KiB = size_t(1) << 10;
constexpr size_t MiB = size_t(1) << 20;
constexpr size_t kAny = ~size_t(0);  // a row bound that holds every size

// ---- All-reduce, two ranks (plan_for): per kernel mode, the first row whose bound holds the
// message serves it, at most YALI_MAX_BYTES; no row: YALI does not serve it (the caller falls back).
//  * flash-push (one one-way NVLink trip, no flag words, no staging copy: sentinel-in-data,
//    exchange.cuh) up to 8 MiB (YALI_DEV_FLASH_BYTES, the push area; YALI_DEV_STREAM_MIN): faster
//    than the first table (flash-ll, one-shot) at every size up to 8 MiB, 2.52 against 2.70 us at
//    2 KiB, 15.70 against 17.72 us at 4 MiB (current/allreduce/20261122-pdl, column yali-prev).
//  * stream above 8 MiB: the same as the first table from 16 MiB on (current/allreduce/20261122-pdl).
enum class TwoRankBound : int {
  FlashAndStreamMin,  // YALI_DEV_FLASH_BYTES and YALI_DEV_STREAM_MIN, whichever is lower
  FlashBytes,         // YALI_DEV_FLASH_BYTES: the push area
  MaxBytes,           // YALI_MAX_BYTES
};
struct TwoRankRow {
  KernelMode mode;
  TwoRankBound up_to;
  Kernel kernel;
};
constexpr TwoRankRow kTwoRankRows[] = {
    // auto: flash-push up to 8 MiB, faster than flash-ll / one-shot at every size (current/allreduce/20261122-pdl)
    {KernelMode::Auto, TwoRankBound::FlashAndStreamMin, Kernel::FlashPush},
    // auto: stream above, equal to the first table from 16 MiB on (current/allreduce/20261122-pdl)
    {KernelMode::Auto, TwoRankBound::MaxBytes, Kernel::Stream},
    // flash (forced, YALI_KERNEL_MODE): flash-push up to its push area, nothing above (the caller falls back)
    {KernelMode::Flash, TwoRankBound::FlashBytes, Kernel::FlashPush},
    // stream (forced, YALI_KERNEL_MODE): stream at every size
    {KernelMode::Stream, TwoRankBound::MaxBytes, Kernel::Stream},
};

// ---- Launch shapes of the all-reduce kernels.
//  * push CTAs (flash-push, push one-shot / two-shot, the EP kernels): YALI_DEV_PUSH_CTA_BYTES
//    (1 KiB) of the largest per-rank share each, at most kMaxFlashCtas (config.h): 16 KiB is slower
//    up to 1 MiB, 512 B-4 KiB within 0.4 us of each other (current/tune/20261122-push-cta-bytes).
//  * the stream ring: kStreamLanes lanes (one CTA each) x kStreamSlots slots x YALI_DEV_SLOT_BYTES
//    (64 KiB); a message is cut into chunks of at most one slot, spread round-robin over the lanes
//    (a lane with several chunks cycles through its ring, overlapping send and receive): the best
//    of the configurations measured side by side (current/tune/20261122-configs-first,
//    current/tune/20261122-configs-second).
//  * programmatic dependent launch (YALI_DEV_PDL=1): 0.1-0.5 us faster up to 8 MiB, equal above
//    (current/tune/20261122-pdl).
// 128 lanes of the stream ring, the best ring shape measured (current/tune/20261122-configs-first)
constexpr int kStreamLanes = 128;
// 8 slots per lane, the best ring shape measured (current/tune/20261122-configs-second)
constexpr int kStreamSlots = 8;
static_assert(kStreamLanes <= kMaxLanes && kStreamSlots <= kMaxSlots, "the stream flag words hold the ring");

// ---- All-reduce, N ranks (world > 2; plan_for), every rank pushing into every other rank's push
// area (n_rank.cuh): push one-shot up to oneshot_max, push two-shot up to serve_max, vLLM's chain
// above; nothing in stream mode. The first row whose world_max holds the world size.
//  * push one-shot: each rank sends its whole input to every other rank, which adds the N inputs
//    in rank order: one NVLink trip, N - 1 times the message out of every GPU. It stops where
//    vLLM's custom all-reduce switches from its one-stage to its two-stage kernel
//    (csrc/custom_all_reduce.cuh: below 512 KiB up to 4 ranks, below 256 KiB up to 8).
//  * push two-shot: reduce-scatter then all-gather, both by pushes: two trips, about twice the
//    message out of every GPU whatever N is; CTAs by one rank's segment of the message.
//  * serve_max up to 4 ranks: push two-shot against NCCL on 4xH100 NV18, graph p50, bf16: 83.2
//    against 96.9 us at 16 MiB (a 1024-token prefill all-reduce of hidden 8192), 135.2 against
//    134.2 at 24 MiB, slower from 32 MiB (current/allreduce/20261128-tp4-h100-big); above 4 ranks
//    8 MiB, where vLLM's custom all-reduce stops too (its default buffer): not measured on 6 or 8
//    GPUs.
//  * fused_one_launch_max: the largest fused message served in one launch (push one-shot
//    exchanges), within one rank's slot of the push area. At 4 ranks, hidden 8192 bf16, the
//    two-launch path is faster from 48 tokens on: 10.44 against 12.56 us at 48, 11.48 against
//    14.66 at 64, 17.21 against 23.40 at 128; 32 tokens (512 KiB) take 10.42 us in one launch
//    (current/fused/20261128-tp4-h200-one-launch). Not measured at 6 and 8 ranks, where a
//    one-shot exchange carries more per byte of message.
// Knobs: YALI_DEV_RANKS_ONESHOT_MAX (cut to serve_max), YALI_DEV_RANKS_MAX,
// YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX (cut to one rank's slot); 0 = the row's value.
struct RanksRow {
  int world_max;                // the row holds for world sizes up to here (rows in increasing order)
  size_t oneshot_max;           // push one-shot up to here, push two-shot above
  size_t serve_max;             // the largest message the N-rank kernels serve
  size_t fused_one_launch_max;  // the largest one-launch fused message
};
constexpr RanksRow kRanksRows[] = {
    // <= 4 ranks: 16 MiB (current/allreduce/20261128-tp4-h100-big), fused (current/fused/20261128-tp4-h200-one-launch)
    {4, 512 * KiB, 16 * MiB, 512 * KiB},
    // <= 8 ranks: one-shot and limit as vLLM's custom all-reduce, fused as at 4 (not measured on 6 or 8 GPUs)
    {kMaxRanks, 256 * KiB, 8 * MiB, 512 * KiB},
};

// ---- Fused all-reduce + RMSNorm (fused_launch_for).
// One launch while the message fits: two ranks, the push area (YALI_DEV_FLASH_BYTES); N ranks,
// RanksRow::fused_one_launch_max. Above: the all-reduce table's kernel (stream, push two-shot),
// then the epilogue alone, one CTA per row up to kEpilogueMaxCtas.
// The epilogue of the two-launch path: one CTA per row, at most 1024
constexpr size_t kEpilogueMaxCtas = 1024;

// The bands of a one-launch fused call: the first row whose message and row bounds hold it gives
// the bytes each CTA sends (at most kMaxFlashCtas CTAs; every row needs a CTA too), the place of
// the row loads, and the most CTAs of a thread block cluster (YALI_DEV_FUSED_CLUSTER overrides it).
//  * Bytes per CTA and the loads' place, the fused op alone at hidden 8192
//    (current/fused/20261122-launch-sweep): up to 128 KiB (8 tokens) 4 KiB per CTA with the loads
//    after the send, 0.0-0.5 us faster than 1 KiB with them first; up to 256 KiB (16 tokens) 8 KiB
//    per CTA with the loads first, the fastest (4.48 against 5.07 us); rows of at most 8 KiB
//    (hidden 4096 in bf16, 17-32 tokens) send 4 KiB per CTA with the loads after: 4.13-4.29
//    against 4.61-4.75 us at 24-32 tokens, where hidden 8192 keeps 8 KiB (4.99 against 5.14 us at
//    16 tokens) (current/fused/20261128-tp2-h200-launch-band); above, 1 KiB per CTA (the most
//    CTAs: the chunk size does not matter once 128 CTAs send) with the loads after the send, equal
//    at 512 KiB-1 MiB and 0.3 us faster at 2 MiB.
//  * Clusters of up to 8 CTAs up to 128 KiB. The kernel uses nothing of the cluster: in decode the
//    op sits right before the gate_up and QKV GEMMs, whose cuBLAS kernels (nvjet, 2x1 clusters)
//    are most of a step, and their speed follows the launch shape in front of them. In a 70B-layer
//    CUDA graph the gate_up GEMM at 1 token took 118.3 us after a plain launch of this kernel
//    (4 CTAs), 109.7 us after one cluster of 4 CTAs, 118.3 us after clusters of 2, 108.2 us after
//    FlashInfer's fused kernel (clusters of 8) (current/decode-gemm/20261122-gate-up). With a
//    stand-in of this launch shape in the same graph on one H200, clusters took 8-11 us off
//    gate_up at 1-4 tokens, nothing at 8, and added 10 us at 16 tokens (32 CTAs in clusters of 8:
//    109.5 -> 119.8 us) (current/gemm-after/20261123-one-gpu), so they stop at 128 KiB. They cost
//    the op itself 0.08 us at 1 token, nothing measurable at 2-64 tokens
//    (current/fused/20261122-cluster-launch).
struct FusedBand {
  size_t up_to;            // message bytes
  size_t row_bytes_max;    // bytes of one row
  size_t cta_bytes;        // message bytes each CTA sends
  bool row_loads_early;    // a row's loads before the epoch fetch, or after the send
  int cluster_max;         // CTAs of a cluster, at most (the largest power of two that divides the grid)
};
constexpr FusedBand kFusedBands[] = {
    // <= 128 KiB: 4 KiB a CTA, loads after, clusters (current/fused/20261122-launch-sweep, current/gemm-after/20261123-one-gpu)
    {128 * KiB, kAny, 4 * KiB, false, 8},
    // up to 256 KiB, rows of at most 8 KiB: 4 KiB per CTA, loads after (current/fused/20261128-tp2-h200-launch-band)
    {256 * KiB, 8 * KiB, 4 * KiB, false, 1},
    // up to 256 KiB: 8 KiB per CTA, loads first (current/fused/20261122-launch-sweep)
    {256 * KiB, kAny, 8 * KiB, true, 1},
    // above: 1 KiB per CTA (the most CTAs), loads after (current/fused/20261122-launch-sweep)
    {kAny, kAny, 1 * KiB, false, 1},
};

// A thread's 16-byte vectors of a row (the kernels' kV, one instance each): the fewest that hold
// its share of the row, which lives in registers (at most kFusedMaxRowBytes, config.h).
// 1, 2, 4 or 8 vectors a thread: the kernel instances (communicator.cu: launch_fused)
constexpr int kRowVecsPerThread[] = {1, 2, 4, 8};
static_assert(size_t(kFlashThreads) * 8 * 16 == kFusedMaxRowBytes, "the largest instance holds the longest row");

// Two ranks: the receivers poll a row's vectors batched from YALI_DEV_FUSED_BATCH_POLL_MIN (512 KiB,
// 32 tokens) on: 0.1-0.3 us faster there, 0.2-0.7 us slower at 1-16 tokens
// (archive/fused/20261122-variants-batch-poll). N ranks: the receivers wait for each rank's row in
// turn (n_rank_exchange.cuh: wait_ranks), never batched.
//
// N ranks: every row over a cluster of YALI_DEV_RANKS_FUSED_SPREAD CTAs (4) while the grid (rows x
// spread) is at most kSpreadMaxCtas; a thread holds its vectors of the row's slice. At 4 ranks,
// hidden 8192 bf16, 4 CTAs a row take 1-16 tokens from 8.90-10.93 us to 6.16-8.92 us; 128 CTAs
// (32 rows of 4, 16 of 8) are slower than whole rows (15.56 and 13.56 vs 12.56 and 10.93 us).
// rows spread over CTAs while the grid is at most 64 CTAs (current/fused/20261126-tp4-spread)
constexpr size_t kSpreadMaxCtas = 64;
static_assert(kSpreadMaxCtas <= size_t(kMaxFlashCtas), "a spread launch is a push launch");

// The largest N-rank message of any world size (the bound of YALI_DEV_RANKS_ONESHOT_MAX while
// YALI_DEV_RANKS_MAX is 0).
constexpr size_t ranks_serve_max_of_all() {
  size_t m = 0;
  for (const RanksRow& r : kRanksRows) m = r.serve_max > m ? r.serve_max : m;
  return m;
}

}  // namespace table
}  // namespace yali
