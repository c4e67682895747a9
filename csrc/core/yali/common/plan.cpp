// The size lookups over the rows of plan_table.h, which holds every boundary and band with the
// measurement behind it; here only how a row applies (the settings that move it, the launch shape
// that follows from it).
#include "yali/common/plan.h"

#include <algorithm>
#include <sstream>

namespace yali {

namespace {

size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

// The row of plan_table.h's kRanksRows for `world` ranks (the last for a world size past them all).
const table::RanksRow& ranks_row(int world) {
  for (const table::RanksRow& r : table::kRanksRows)
    if (world <= r.world_max) return r;
  return std::end(table::kRanksRows)[-1];
}

// The setting that bounds a two-rank row.
size_t two_rank_bound(const Config& c, table::TwoRankBound b) {
  switch (b) {
    case table::TwoRankBound::FlashAndStreamMin: return std::min(c.flash_bytes, c.stream_min);
    case table::TwoRankBound::FlashBytes: return c.flash_bytes;
    default: return c.max_bytes;
  }
}

// Adds `kernel` up to `up_to` (cut to YALI_MAX_BYTES) to `b` when it serves any message above the last band.
void add_band(Bands& b, const Config& c, Kernel kernel, size_t up_to) {
  up_to = std::min(up_to, c.max_bytes);
  if (up_to > (b.n ? b.band[b.n - 1].up_to : 0)) b.band[b.n++] = Band{kernel, up_to};
}

// The launch shape of `kernel` for an `nbytes` message at `world` ranks.
Plan shape(const Config& c, Kernel kernel, size_t nbytes, int world) {
  Plan p;
  p.kernel = kernel;
  if (kernel == Kernel::Stream) {
    // Chunks of at most one ring slot, spread round-robin over the lanes.
    const size_t per_lane = ceil_div(nbytes, size_t(kStreamLanes));
    p.chunk_bytes = std::min(c.slot_bytes, ceil_div(per_lane, 16) * 16);
    p.blocks = int(std::min<size_t>(kStreamLanes, ceil_div(nbytes, p.chunk_bytes)));
  } else if (kernel == Kernel::PushTwoShot) {  // CTAs by one rank's segment
    p.blocks = push_ctas(c, ceil_div(ceil_div(nbytes, 16), size_t(world)) * 16);
  } else {  // flash-push, push one-shot: by the whole message
    p.blocks = push_ctas(c, nbytes);
  }
  return p;
}

// The fewest vectors a thread of the fused kernels holds for `vecs` of them (kRowVecsPerThread).
int row_vecs_for(size_t vecs) {
  for (int v : table::kRowVecsPerThread)
    if (vecs <= size_t(v)) return v;
  return std::end(table::kRowVecsPerThread)[-1];
}

// The band of a one-launch fused call of `nbytes` in rows of `row_bytes` (the last row holds all).
const table::FusedBand& fused_band(size_t nbytes, size_t row_bytes) {
  for (const table::FusedBand& b : table::kFusedBands)
    if (nbytes <= b.up_to && row_bytes <= b.row_bytes_max) return b;
  return std::end(table::kFusedBands)[-1];
}

// The most CTAs of a cluster in `band` under the settings: YALI_DEV_FUSED_CLUSTER when set (0, never,
// is a cluster of one), else the band's own.
int cluster_max(const Config& c, const table::FusedBand& band) {
  return c.fused_cluster >= 0 ? std::max(c.fused_cluster, 1) : band.cluster_max;
}

static_assert(std::end(table::kFusedBands)[-1].up_to == table::kAny &&
                  std::end(table::kFusedBands)[-1].row_bytes_max == table::kAny,
              "the last fused band holds every call");
static_assert(std::end(table::kRanksRows)[-1].world_max == kMaxRanks, "the N-rank rows cover every world size");

}  // namespace

int push_ctas(const Config& c, size_t bytes) {
  return int(std::min<size_t>(kMaxFlashCtas, ceil_div(bytes, c.push_cta_bytes)));
}

Bands allreduce_bands(const Config& c, int world) {
  Bands b;
  if (world <= 2) {
    for (const table::TwoRankRow& r : table::kTwoRankRows)
      if (r.mode == c.mode) add_band(b, c, r.kernel, two_rank_bound(c, r.up_to));
    return b;
  }
  if (c.mode == KernelMode::Stream) return b;  // no N-rank stream kernel
  add_band(b, c, Kernel::PushOneShot, ranks_oneshot_max(c, world));
  add_band(b, c, Kernel::PushTwoShot, ranks_max_for(c, world));
  return b;
}

Plan plan_for(const Config& c, size_t nbytes, int world) {
  if (nbytes == 0) return Plan{};
  const Bands b = allreduce_bands(c, world);
  for (int i = 0; i < b.n; ++i)
    if (nbytes <= b.band[i].up_to) return shape(c, b.band[i].kernel, nbytes, world);
  return Plan{};
}

size_t serve_max(const Config& c, int world) {
  const Bands b = allreduce_bands(c, world);
  return b.n ? b.band[b.n - 1].up_to : 0;
}

size_t ranks_max_for(const Config& c, int world) {
  return c.ranks_max != 0 ? c.ranks_max : ranks_row(world).serve_max;
}

size_t ranks_oneshot_max(const Config& c, int world) {
  const size_t knob = c.ranks_oneshot_max;
  return std::min(knob != 0 ? knob : ranks_row(world).oneshot_max, ranks_max_for(c, world));
}

size_t ranks_slot_bytes(const Config& c, int world) {
  // A whole one-shot message or one rank's segment of the largest two-shot message, in 256-byte multiples.
  const size_t segment = ceil_div(ceil_div(ranks_max_for(c, world), 16), size_t(world)) * 16;
  return (std::max(ranks_oneshot_max(c, world), segment) + 255) / 256 * 256;
}

size_t ranks_fused_one_launch_max(const Config& c, int world) {
  const size_t knob = c.ranks_fused_one_launch_max;
  return std::min(ranks_slot_bytes(c, world), knob != 0 ? knob : ranks_row(world).fused_one_launch_max);
}

size_t fused_one_launch_max(const Config& c, int world) {
  return world > 2 ? ranks_fused_one_launch_max(c, world) : c.flash_bytes;
}

FusedLaunch fused_launch_for(const Config& c, size_t rows, size_t hidden, DType dtype, int world) {
  FusedLaunch l;
  const size_t row_bytes = hidden * dtype_size(dtype), nbytes = rows * row_bytes;
  l.row_vecs_per_thread = row_vecs_for(ceil_div(row_bytes / 16, kFlashThreads));  // a row lives in registers
  l.pdl = c.pdl != 0;
  l.one_launch = nbytes <= fused_one_launch_max(c, world);
  if (!l.one_launch) {  // the all-reduce, then the epilogue alone: one CTA per row
    l.grid = int(std::min<size_t>(rows, table::kEpilogueMaxCtas));
    return l;
  }
  const table::FusedBand& band = fused_band(nbytes, row_bytes);
  l.cta_bytes = band.cta_bytes;
  l.row_loads_early = band.row_loads_early;
  const int cluster = cluster_max(c, band);
  // The sending is cut into cta_bytes per CTA (at most kMaxFlashCtas CTAs); every row needs a CTA too.
  // (Which CTA sends and owns what is the kernels' rule, fused.cuh fused_work: a launch without
  // clusters and with more CTAs than rows sends from all CTAs but its last.)
  const size_t senders = std::min<size_t>(kMaxFlashCtas, std::max<size_t>(1, ceil_div(nbytes, l.cta_bytes)));
  l.grid = int(std::max(senders, std::min<size_t>(rows, kMaxFlashCtas)));
  // Clusters: the largest power of two up to the limit that divides the grid.
  while (l.cluster * 2 <= cluster && l.grid % (l.cluster * 2) == 0) l.cluster *= 2;
  l.batch_poll = world == 2 && nbytes >= c.fused_batch_poll_min;  // N ranks: never batched
  // N ranks: every row over a cluster of `spread` CTAs while the grid is at most kSpreadMaxCtas.
  const size_t spread = size_t(c.ranks_fused_spread);
  if (world > 2 && spread > 1 && rows * spread <= table::kSpreadMaxCtas) {
    l.spread = l.cluster = int(spread);
    l.grid = int(rows * spread);
    l.row_vecs_per_thread = row_vecs_for(ceil_div(ceil_div(row_bytes / 16, spread), kFlashThreads));
  }
  return l;
}

namespace {

// An unbounded size as plan_text writes it: 0.
size_t bound_text(size_t v) { return v == table::kAny ? 0 : v; }

}  // namespace

std::string plan_text(const Config& c, int world) {
  std::ostringstream o;
  const Bands b = allreduce_bands(c, world);
  for (int i = 0; i < b.n; ++i)
    o << "allreduce kernel=" << kernel_name(b.band[i].kernel) << " up_to=" << b.band[i].up_to << "\n";
  for (const table::FusedBand& f : table::kFusedBands)
    o << "fused_band up_to=" << bound_text(f.up_to) << " row_bytes_max=" << bound_text(f.row_bytes_max)
      << " cta_bytes=" << f.cta_bytes << " row_loads_early=" << int(f.row_loads_early)
      << " cluster_max=" << cluster_max(c, f) << "\n";
  const bool ranks = world > 2;
  o << "limits serve_max=" << serve_max(c, world) << " oneshot_max=" << (ranks ? ranks_oneshot_max(c, world) : 0)
    << " slot_bytes=" << (ranks ? ranks_slot_bytes(c, world) : 0)
    << " fused_one_launch_max=" << fused_one_launch_max(c, world) << " fused_max_row_bytes=" << kFusedMaxRowBytes
    << " max_ctas=" << kMaxFlashCtas << " epilogue_max_ctas=" << table::kEpilogueMaxCtas
    << " spread_max_ctas=" << table::kSpreadMaxCtas << " stream_lanes=" << kStreamLanes
    << " stream_slots=" << kStreamSlots << " max_ranks=" << kMaxRanks << " ep_max_parts=" << kEpMaxParts << "\n";
  return o.str();
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
  two.grid = int(std::min<size_t>(rows, table::kEpilogueMaxCtas));
  two.row_vecs_per_thread = fused_launch_for(c, rows, hidden, dtype, 2).row_vecs_per_thread;  // whole rows
  two.pdl = l.pdl;
  return two;
}

}  // namespace yali
