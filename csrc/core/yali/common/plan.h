// The size lookups: which kernel serves an all-reduce of a given size, and how the fused
// all-reduce + RMSNorm launches for a given shape. They look up the rows of plan_table.h, the one
// place that holds every size boundary, band and launch choice with the measurement behind it.
#pragma once
#include <cstddef>
#include <string>

#include "yali/common/config.h"
#include "yali/common/plan_table.h"

namespace yali {

using table::kStreamLanes;
using table::kStreamSlots;

// What one all-reduce launches.
struct Plan {
  Kernel kernel = Kernel::None;  // None: YALI does not serve this message
  int blocks = 0;                // active flash CTAs, or stream lanes
  size_t chunk_bytes = 0;        // stream only: bytes per ring slot use
};

// One band of the all-reduce table: `kernel` serves the messages above the previous band's
// `up_to` and up to this one's.
struct Band {
  Kernel kernel = Kernel::None;
  size_t up_to = 0;
};
// The all-reduce bands of a `world`-rank communicator under `c`, in increasing order, non-empty
// and at most YALI_MAX_BYTES (plan_table.h: kTwoRankRows, kRanksRows). No band serves a message
// above the last: vLLM's chain does.
struct Bands {
  Band band[2];
  int n = 0;
};
Bands allreduce_bands(const Config& c, int world);

// The size -> kernel table of a `world`-rank communicator. `nbytes` is the message size in bytes.
// Two ranks: flash-push and stream. More: push one-shot and push two-shot up to
// ranks_max_for(), nothing above (vLLM's chain serves those messages).
Plan plan_for(const Config& c, size_t nbytes, int world = 2);

// The largest message plan_for serves at `world` ranks under `c` (0: none).
size_t serve_max(const Config& c, int world);

// CTAs of a push launch whose largest per-rank share is `bytes`: Config::push_cta_bytes each, at most
// kMaxFlashCtas (flash-push, push one-shot / two-shot, the EP kernels).
int push_ctas(const Config& c, size_t bytes);

// N ranks: the largest message the N-rank kernels serve (Config::ranks_max, or the world size's default).
size_t ranks_max_for(const Config& c, int world);
// N ranks: the largest push one-shot message (Config::ranks_oneshot_max, or the world size's default).
size_t ranks_oneshot_max(const Config& c, int world);
// N ranks: the bytes of one rank's slot in each phase of the push area (layout.h): a whole one-shot
// message, or one rank's segment of the largest two-shot message.
size_t ranks_slot_bytes(const Config& c, int world);
// N ranks: the largest message of the one-launch fused op: Config::ranks_fused_one_launch_max, or
// else the world size's row (plan_table.h); never above ranks_slot_bytes.
size_t ranks_fused_one_launch_max(const Config& c, int world);
// The largest message of the one-launch fused op at `world` ranks: the push area with two,
// ranks_fused_one_launch_max with more.
size_t fused_one_launch_max(const Config& c, int world);

// How the fused op runs for one shape; Rank::fused_allreduce_rmsnorm launches
// exactly this (launch_fused in communicator.cu maps it to a kernel instance).
struct FusedLaunch {
  bool one_launch = true;       // false: YALI all-reduce, then the add + norm kernel
  int grid = 0;                 // CTAs
  int row_vecs_per_thread = 1;  // 1, 2, 4 or 8: a thread's 16-byte vectors of a row (the kernels' kV)
  size_t cta_bytes = 0;         // message bytes each CTA sends
  bool batch_poll = false;      // receivers poll a row's vectors batched (wait_push_batch)
  bool row_loads_early = true;  // a row's loads before the epoch fetch, or after the send
  bool pdl = true;              // programmatic dependent launch
  int cluster = 1;              // CTAs per thread block cluster (1 = no clusters)
  int spread = 1;               // N ranks: CTAs per row (its cluster), each owning a slice; 1 = whole rows
};

// The fused op's launch table for `rows` rows of `hidden` elements of `dtype`
// (rows * hidden * dtype size bytes) on a `world`-rank communicator. The YALI_DEV_FUSED_* knobs
// override it. Rows must be 16-byte multiples of at most kFusedMaxRowBytes (the caller checks).
FusedLaunch fused_launch_for(const Config& c, size_t rows, size_t hidden, DType dtype, int world = 2);

// The table as `world` ranks use it under `c`, one row a line, "<table> key=value ...": the
// all-reduce bands ("allreduce kernel=... up_to=..."), the fused op's one-launch bands
// ("fused_band up_to=... row_bytes_max=... cta_bytes=... row_loads_early=... cluster_max=...";
// an unbounded up_to or row_bytes_max is 0) and the limits ("limits serve_max=... ..."). The torch
// op plan_table returns it; the Python package reads its limits there (yali_vllm/config.py).
std::string plan_text(const Config& c, int world);

// The quantising fused op's launch (Rank::fused_allreduce_rmsnorm_quant) for `scheme`
// (quant.h: 0 static, 1 per-token, 2 per-token-group of `group_size`): the plain op's, except that
// a row spread over a cluster whose slices are not whole groups (group scheme) runs in two launches.
FusedLaunch fused_quant_launch_for(const Config& c, size_t rows, size_t hidden, DType dtype, int world, int scheme,
                                   int group_size);

}  // namespace yali
