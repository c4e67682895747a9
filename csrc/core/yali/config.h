// Run-time configuration. The size tables that use it are in plan.h.
//
// Everything a user or tuner can change is read here, once, from environment
// variables, and validated: a bad value throws std::invalid_argument whose
// message names the variable and the accepted range. Both ranks must resolve
// the same Config (the communicator checks), because the kernels' lock-step
// protocols assume both GPUs launch the same kernel with the same shape.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace yali {

enum class KernelMode : int { Auto = 0, Flash = 1, Stream = 2 };
// Ids 1, 2 and 4 were the retired flash one-shot, two-shot and flash-ll kernels (docs/DESIGN_LOG.md).
enum class Kernel : int {
  None = 0, Stream = 3, FlashPush = 5,
  PushOneShot = 6, PushTwoShot = 7,  // N ranks (ranks.cuh)
  EpGather = 8, EpReduceScatter = 9   // expert parallelism, 2 to kMaxRanks ranks (ep.cuh)
};
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

const char* kernel_name(Kernel k);
size_t dtype_size(DType t);

// Hard limits of the kernels (array sizes in the shared flag region).
constexpr int kMaxFlashCtas = 128;
// Most ranks of one communicator: the N-rank kernels (ranks.cuh) keep one pointer per rank.
constexpr int kMaxRanks = 8;
// Most tensors one expert-parallel dispatch carries (ep.cuh: hidden states, scales, top-k ids, ...).
constexpr int kEpMaxParts = 8;
constexpr int kMaxLanes = 128;
constexpr int kMaxSlots = 16;
constexpr int kFlashThreads = 512;
// The most CTAs a fused row spreads over (YALI_DEV_RANKS_FUSED_SPREAD): the cluster's slots for
// their sums of squares in fused_ranks_spread_kernel.
constexpr int kMaxFusedSpread = 8;
constexpr int kStreamThreads = 512;  // half senders, half receivers
// The fused all-reduce + RMSNorm kernel keeps one row in registers: at most
// kFlashThreads threads x 8 vectors x 16 bytes (hidden 32768 in 16-bit types).
constexpr size_t kFusedMaxRowBytes = size_t(kFlashThreads) * 8 * 16;
// Shortest watchdog YALI_TIMEOUT_S accepts (0 = none): below it a slow peer looks like a missing one.
constexpr double kMinTimeoutS = 1e-3;

// The defaults are the measured best on 2xH200; plan.cpp gives the measurement behind each.
struct Config {
  KernelMode mode = KernelMode::Auto;  // YALI_KERNEL_MODE
  size_t max_bytes = size_t(2) << 30;  // YALI_MAX_BYTES: largest message served
  size_t flash_bytes = 8u << 20;       // YALI_DEV_FLASH_BYTES: largest message flash can take
  size_t push_cta_bytes = 1u << 10;    // YALI_DEV_PUSH_CTA_BYTES: bytes per active flash-push CTA
  size_t stream_min = 8u << 20;        // YALI_DEV_STREAM_MIN: auto picks stream above this
  int flash_ctas = 128;                // YALI_DEV_FLASH_CTAS: most CTAs of a flash launch
  int lanes = 128;                     // YALI_DEV_LANES: stream lanes (one CTA each)
  int slots = 8;                       // YALI_DEV_SLOTS: ring slots per lane
  size_t slot_bytes = 64u << 10;       // YALI_DEV_SLOT_BYTES
  int pdl = 1;                         // YALI_DEV_PDL: 1 = launch with programmatic dependent launch, 0 = plain
  // YALI_DEV_FUSED_BATCH_POLL_MIN: the fused op's receivers poll all their vectors of a row per
  // round (wait_push_batch) from this message size on, one vector after the other below it.
  size_t fused_batch_poll_min = 512u << 10;
  // YALI_DEV_FUSED_CTA_BYTES: bytes of the message each CTA of the one-launch fused op sends
  // (at most flash_ctas CTAs); 0 = by message size (fused_launch_for).
  size_t fused_cta_bytes = 0;
  // YALI_DEV_FUSED_ROW_LOADS_EARLY: 1 = a row's weight / input / residual loads go out before the
  // epoch fetch, 0 = right after this CTA's send (fused.cuh), -1 = by message size (fused_launch_for).
  int fused_row_loads_early = -1;
  // YALI_DEV_FUSED_CLUSTER: the one-launch fused kernel runs as thread block clusters of up to
  // this many CTAs (the largest power of two <= it that divides the grid); 0 = never clusters,
  // -1 = by message size (fused_launch_for, which says why).
  int fused_cluster = -1;
  // N ranks (world size above 2, ranks.cuh; plan.cpp gives the table):
  // YALI_DEV_RANKS_MAX: the largest message the N-rank kernels take; above it vLLM's chain serves.
  // 0 = by world size (plan.cpp ranks_max_for: 16 MiB up to 4 ranks, 8 MiB above).
  size_t ranks_max = 0;
  // YALI_DEV_RANKS_ONESHOT_MAX: push one-shot up to here, push two-shot above; 0 = by world size.
  size_t ranks_oneshot_max = 0;
  // YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX: the largest N-rank fused op served in one launch, at most
  // one rank's slot; 0 = 512 KiB (plan.cpp ranks_fused_one_launch_max).
  size_t ranks_fused_one_launch_max = 0;
  // YALI_DEV_RANKS_FUSED_SPREAD: the one-launch fused op at N ranks spreads every row over a
  // cluster of this many CTAs (2, 4 or 8; while rows x it <= 64), each adding and normalising its
  // slice (ranks.cuh fused_ranks_spread_kernel); 0 = a CTA owns whole rows (plan.cpp says why 4).
  int ranks_fused_spread = 4;
  // YALI_DEV_RANKS_TWO_SHOT_ROUND: a push two-shot CTA runs its reduce-scatter, sum and all-gather
  // round by round over this many bytes of its share of each segment (ranks.cuh); 0 = its whole
  // share in one round.
  size_t ranks_two_shot_round = 0;
  double timeout_s = 300.0;            // YALI_TIMEOUT_S: a kernel waiting longer aborts (0 = never)
  // Expert parallelism (ep.cuh): one rank's slot of each parity of the EP push area, the largest
  // dispatch message (every part of one rank's tokens, each padded to 16 bytes) or combine
  // message (one rank's rows) it serves. 0 = no EP area (an all-reduce communicator). Set by
  // the EP communicator from YALI_EP_SLOT_BYTES, not read by from_env().
  size_t ep_slot_bytes = 0;

  static Config from_env();  // throws std::invalid_argument naming the bad variable
  void validate() const;     // same checks, for configs built in code
  std::string to_string() const;
  bool operator==(const Config& o) const { return to_string() == o.to_string(); }
};

// Bytes of the IPC-shared buffer one rank of a `world`-rank communicator allocates for this config.
size_t shared_buffer_bytes(const Config& c, int world = 2);

}  // namespace yali
