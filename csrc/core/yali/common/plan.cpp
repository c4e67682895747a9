// The size tables, with the measurement behind each choice. All numbers are
// from 2xH200 NV18 (bf16 unless said otherwise); the result files are under
// benchmarks/results/, and docs/DESIGN_LOG.md keeps what was tried and left.
#include "yali/common/plan.h"

#include <algorithm>

namespace yali {

namespace {

size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

// N ranks: the largest one-launch fused message (YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX sets another,
// within one rank's slot). At 4 ranks, hidden 8192 bf16, the two-launch path is faster from 48
// tokens on: 10.44 against 12.56 us at 48, 11.48 against 14.66 at 64, 17.21 against 23.40 at 128;
// 32 tokens (512 KiB) take 10.42 us in one launch (current/fused/20261128-tp4-h200-one-launch).
// Not measured at 6 and 8 ranks, where a one-shot exchange carries more per byte of message.
constexpr size_t kRanksFusedOneLaunchMax = size_t(512) << 10;

}  // namespace

int push_ctas(const Config& c, size_t bytes) {
  return int(std::min<size_t>(kMaxFlashCtas, ceil_div(bytes, c.push_cta_bytes)));
}

// All-reduce, with the defaults of config.h:
//  * flash-push up to 8 MiB (YALI_DEV_FLASH_BYTES, the push area): faster than the first
//    table (flash-ll, one-shot) at every size up to 8 MiB, 2.52 against 2.70 us at 2 KiB,
//    15.70 against 17.72 us at 4 MiB (current/allreduce/20261122-pdl, column yali-prev).
//  * 1 KiB per flash-push CTA, at most 128 CTAs (YALI_DEV_PUSH_CTA_BYTES, kMaxFlashCtas):
//    16 KiB is slower up to 1 MiB, 512 B-4 KiB within 0.4 us of each other (current/tune/20261122-push-cta-bytes).
//  * stream above 8 MiB (YALI_DEV_STREAM_MIN), 128 lanes x 8 slots (kStreamLanes, kStreamSlots)
//    x 64 KiB (YALI_DEV_SLOT_BYTES): the best of the configurations measured side by side
//    (current/tune/20261122-configs-first, current/tune/20261122-configs-second); the same from 16 MiB in both tables
//    (current/allreduce/20261122-pdl).
//  * programmatic dependent launch (YALI_DEV_PDL=1): 0.1-0.5 us faster up to 8 MiB, equal
//    above (current/tune/20261122-pdl).
namespace {

// N ranks, every rank pushing into every other rank's push area (n_rank.cuh). The one-shot /
// two-shot boundary starts where vLLM's custom all-reduce switches from its one-stage to its
// two-stage kernel (csrc/custom_all_reduce.cuh: below 512 KiB up to 4 ranks, below 256 KiB up to 8).
// The N-rank kernels stop (YALI_DEV_RANKS_MAX, 0 = ranks_max_for below):
//  * at 16 MiB up to 4 ranks: push two-shot against NCCL on 4xH100 NV18, graph p50, bf16:
//    83.2 against 96.9 us at 16 MiB (a 1024-token prefill all-reduce of hidden 8192), 135.2 against
//    134.2 at 24 MiB, slower from 32 MiB (current/allreduce/20261128-tp4-h100-big);
//  * at 8 MiB above 4 ranks, where vLLM's custom all-reduce stops too (its default buffer): not
//    measured on 6 or 8 GPUs. The YALI_DEV_RANKS_* knobs move both boundaries.
//  * push one-shot: each rank sends its whole input to every other rank, which adds the N inputs
//    in rank order: one NVLink trip, N - 1 times the message out of every GPU.
//  * push two-shot: reduce-scatter then all-gather, both by pushes: two trips, about twice the
//    message out of every GPU whatever N is.
//  * CTAs: 1 KiB of each rank's share per CTA, as flash-push (YALI_DEV_PUSH_CTA_BYTES), at most
//    kMaxFlashCtas.
Plan ranks_plan(const Config& c, size_t nbytes, int world) {
  Plan p;
  if (nbytes > ranks_max_for(c, world) || c.mode == KernelMode::Stream) return p;  // no N-rank bandwidth kernel
  const size_t vecs = ceil_div(nbytes, 16);
  if (nbytes <= ranks_oneshot_max(c, world)) {
    p.kernel = Kernel::PushOneShot;
    p.blocks = push_ctas(c, nbytes);
  } else {
    p.kernel = Kernel::PushTwoShot;
    const size_t segment_bytes = ceil_div(vecs, size_t(world)) * 16;
    p.blocks = push_ctas(c, segment_bytes);
  }
  return p;
}

}  // namespace

size_t ranks_max_for(const Config& c, int world) {
  if (c.ranks_max != 0) return c.ranks_max;
  return world <= 4 ? size_t(16) << 20 : size_t(8) << 20;
}

size_t ranks_oneshot_max(const Config& c, int world) {
  const size_t top = ranks_max_for(c, world);
  if (c.ranks_oneshot_max != 0) return std::min(c.ranks_oneshot_max, top);
  return std::min<size_t>(world <= 4 ? 512u << 10 : 256u << 10, top);
}

namespace {

// One rank's slot of the push area when the largest two-shot message is `top` bytes: a whole
// one-shot message or one rank's segment of `top`, in 256-byte multiples.
size_t slot_for(const Config& c, int world, size_t top) {
  const size_t segment = ceil_div(ceil_div(top, 16), size_t(world)) * 16;
  return (std::max(ranks_oneshot_max(c, world), segment) + 255) / 256 * 256;
}

}  // namespace

size_t ranks_slot_bytes(const Config& c, int world) { return slot_for(c, world, ranks_max_for(c, world)); }

size_t ranks_fused_one_launch_max(const Config& c, int world) {
  const size_t slot = ranks_slot_bytes(c, world);
  if (c.ranks_fused_one_launch_max != 0) return std::min(slot, c.ranks_fused_one_launch_max);
  return std::min(slot, kRanksFusedOneLaunchMax);
}

Plan plan_for(const Config& c, size_t nbytes, int world) {
  Plan p;
  if (nbytes == 0 || nbytes > c.max_bytes) return p;
  if (world > 2) return ranks_plan(c, nbytes, world);
  const bool flash_fits = nbytes <= c.flash_bytes;
  bool use_stream;
  switch (c.mode) {
    case KernelMode::Flash:
      if (!flash_fits) return p;  // forced flash cannot take it: the caller falls back
      use_stream = false;
      break;
    case KernelMode::Stream: use_stream = true; break;
    default: use_stream = !flash_fits || nbytes > c.stream_min; break;
  }
  if (use_stream) {
    p.kernel = Kernel::Stream;
    // Chunks of at most one ring slot, spread round-robin over the lanes; a lane
    // with several chunks cycles through its ring, overlapping send and receive.
    const size_t per_lane = ceil_div(nbytes, size_t(kStreamLanes));
    p.chunk_bytes = std::min(c.slot_bytes, ceil_div(per_lane, 16) * 16);
    p.blocks = int(std::min<size_t>(kStreamLanes, ceil_div(nbytes, p.chunk_bytes)));
    return p;
  }
  // flash-push: one one-way NVLink trip with no flag words and no staging copy
  // (sentinel-in-data, exchange.cuh).
  p.kernel = Kernel::FlashPush;
  p.blocks = push_ctas(c, nbytes);
  return p;
}

FusedLaunch fused_launch_for(const Config& c, size_t rows, size_t hidden, DType dtype, int world) {
  FusedLaunch l;
  const size_t row_bytes = hidden * dtype_size(dtype), nbytes = rows * row_bytes;
  const size_t per_thread = ceil_div(row_bytes / 16, kFlashThreads);  // a row lives in registers
  l.row_vecs_per_thread = per_thread <= 1 ? 1 : per_thread <= 2 ? 2 : per_thread <= 4 ? 4 : 8;
  l.pdl = c.pdl != 0;
  // One launch while the message fits the push area; above it the all-reduce table's kernel
  // (stream) and then the epilogue alone, one CTA per row, up to 1024 CTAs.
  // N ranks: one launch (push one-shot exchanges) up to kRanksFusedOneLaunchMax, within one
  // rank's slot; above it the two-launch path (push two-shot, then the epilogue).
  l.one_launch = world > 2 ? nbytes <= ranks_fused_one_launch_max(c, world) : nbytes <= c.flash_bytes;
  if (!l.one_launch) {
    l.grid = int(std::min<size_t>(rows, 1024));
    return l;
  }
  // Bytes sent per CTA and the row loads' place, the fused op alone at hidden 8192
  // (current/fused/20261122-launch-sweep):
  //  * up to 128 KiB (8 tokens): 4 KiB per CTA with the loads after the send, 0.0-0.5 us faster
  //    than 1 KiB with them first;
  //  * up to 256 KiB (16 tokens): 8 KiB per CTA with the loads first, the fastest (4.48 against
  //    5.07 us); rows of at most 8 KiB (hidden 4096 in bf16, 17-32 tokens) send 4 KiB per CTA
  //    with the loads after: 4.13-4.29 against 4.61-4.75 us at 24-32 tokens, where hidden 8192
  //    keeps 8 KiB (4.99 against 5.14 us at 16 tokens) (current/fused/20261128-tp2-h200-launch-band);
  //  * above: 1 KiB per CTA (the most CTAs: the chunk size does not matter once 128 CTAs send),
  //    the loads after the send, equal at 512 KiB-1 MiB and 0.3 us faster at 2 MiB.
  // Thread block clusters of up to 8 CTAs up to 128 KiB. The kernel uses nothing of the
  // cluster: in decode the op sits right before the gate_up and QKV GEMMs, whose cuBLAS
  // kernels (nvjet, 2x1 clusters) are most of a step, and their speed follows the launch
  // shape in front of them. In a 70B-layer CUDA graph the gate_up GEMM at 1 token took
  // 118.3 us after a plain launch of this kernel (4 CTAs), 109.7 us after one cluster of
  // 4 CTAs, 118.3 us after clusters of 2, 108.2 us after FlashInfer's fused kernel (clusters
  // of 8) (current/decode-gemm/20261122-gate-up). With a stand-in of this launch shape in the same graph on
  // one H200, clusters took 8-11 us off gate_up at 1-4 tokens, nothing at 8, and added 10 us at
  // 16 tokens (32 CTAs in clusters of 8: 109.5 -> 119.8 us) (current/gemm-after/20261123-one-gpu), so they
  // stop at 128 KiB. They cost the op itself 0.08 us at 1 token, nothing measurable at 2-64
  // tokens (current/fused/20261122-cluster-launch).
  size_t cta_bytes;
  int cluster;
  if (nbytes <= (128u << 10)) cta_bytes = 4u << 10, l.row_loads_early = false, cluster = 8;
  else if (nbytes <= (256u << 10) && row_bytes <= (8u << 10)) cta_bytes = 4u << 10, l.row_loads_early = false, cluster = 1;
  else if (nbytes <= (256u << 10)) cta_bytes = 8u << 10, l.row_loads_early = true, cluster = 1;
  else cta_bytes = 1u << 10, l.row_loads_early = false, cluster = 1;
  if (c.fused_cluster >= 0) cluster = std::max(c.fused_cluster, 1);
  l.cta_bytes = cta_bytes;
  // The sending is cut into cta_bytes per CTA (at most kMaxFlashCtas CTAs); every row needs a CTA too.
  // (Which CTA sends and owns what is the kernels' rule, fused.cuh fused_work: a launch without
  // clusters and with more CTAs than rows sends from all CTAs but its last.)
  const size_t senders = std::min<size_t>(kMaxFlashCtas, std::max<size_t>(1, ceil_div(nbytes, cta_bytes)));
  l.grid = int(std::max(senders, std::min<size_t>(rows, kMaxFlashCtas)));
  // Clusters: the largest power of two up to the limit that divides the grid.
  while (l.cluster * 2 <= cluster && l.grid % (l.cluster * 2) == 0) l.cluster *= 2;
  // The receivers poll a row's vectors batched from 512 KiB (32 tokens) on
  // (YALI_DEV_FUSED_BATCH_POLL_MIN): 0.1-0.3 us faster there, 0.2-0.7 us slower at 1-16 tokens
  // (archive/fused/20261122-variants-batch-poll).
  // N ranks: the receivers wait for each rank's row in turn (n_rank_exchange.cuh: wait_ranks),
  // never batched.
  l.batch_poll = world == 2 && nbytes >= c.fused_batch_poll_min;
  // N ranks: every row over a cluster of `spread` CTAs (YALI_DEV_RANKS_FUSED_SPREAD, default 4)
  // while the grid (rows x spread) is at most 64 CTAs; a thread holds its vectors of the row's
  // slice. At 4 ranks, hidden 8192 bf16, 4 CTAs a row take 1-16 tokens from 8.90-10.93 us to
  // 6.16-8.92 us; 128 CTAs (32 rows of 4, 16 of 8) are slower than whole rows (15.56 and 13.56 vs
  // 12.56 and 10.93 us) (current/fused/20261126-tp4-spread).
  const size_t spread = size_t(c.ranks_fused_spread);
  if (world > 2 && spread > 1 && rows * spread <= std::min<size_t>(64, kMaxFlashCtas)) {
    l.spread = l.cluster = int(spread);
    l.grid = int(rows * spread);
    const size_t slice_per_thread = ceil_div(ceil_div(row_bytes / 16, spread), kFlashThreads);
    l.row_vecs_per_thread = slice_per_thread <= 1 ? 1 : slice_per_thread <= 2 ? 2 : slice_per_thread <= 4 ? 4 : 8;
  }
  return l;
}

FusedLaunch fused_quant_launch_for(const Config& c, size_t rows, size_t hidden, DType dtype, int world, int scheme,
                                   int group_size) {
  FusedLaunch l = fused_launch_for(c, rows, hidden, dtype, world);
  if (!l.one_launch || l.spread <= 1 || scheme != 2 || group_size <= 0) return l;
  // A group's scales need the whole group in one CTA (fused/quant.cuh): slices of
  // ceil(row_vecs / spread) vectors (split_range) must be whole groups.
  const size_t row_vecs = hidden * dtype_size(dtype) / 16, group_vecs = size_t(group_size) * dtype_size(dtype) / 16;
  if (group_vecs > 0 && ceil_div(row_vecs, size_t(l.spread)) % group_vecs == 0) return l;
  FusedLaunch two;  // as fused_launch_for above its one-launch size
  two.one_launch = false;
  two.grid = int(std::min<size_t>(rows, 1024));
  two.row_vecs_per_thread = fused_launch_for(c, rows, hidden, dtype, 2).row_vecs_per_thread;  // whole rows
  two.pdl = l.pdl;
  return two;
}

}  // namespace yali
