// Run-time configuration. The size table that uses it is plan_table.h (looked up by plan.h).
//
// Everything a user or tuner can change is declared in settings.def (name, type, default,
// bounds) and read here, once, from environment variables, and validated: a bad value throws
// std::invalid_argument whose message names the variable and the accepted range. Both ranks must
// resolve the same Config (the communicator checks), because the kernels' lock-step protocols
// assume both GPUs launch the same kernel with the same shape.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace yali {

enum class KernelMode : int { Auto = 0, Flash = 1, Stream = 2 };
// Ids 1, 2 and 4 were the retired flash one-shot, two-shot and flash-ll kernels (lab/DESIGN_LOG.md).
enum class Kernel : int {
  None = 0, Stream = 3, FlashPush = 5,
  PushOneShot = 6, PushTwoShot = 7,  // N ranks (n_rank.cuh)
  EpGather = 8, EpReduceScatter = 9   // expert parallelism, 2 to kMaxRanks ranks (ep.cuh)
};
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

const char* kernel_name(Kernel k);
size_t dtype_size(DType t);

// Hard limits of the kernels (array sizes in the shared flag region).
constexpr int kMaxFlashCtas = 128;
// Most ranks of one communicator: the N-rank kernels (n_rank_exchange.cuh: RanksArgs) keep one
// pointer per rank.
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

// The value types of the settings (settings.def: type) and their defaults' parsers, which read a
// default as a user writes the value ("8M", "-1", "auto"). A default that does not parse throws
// std::logic_error naming the setting (tests/core/test_core_config.py reads every default).
using setting_bytes = size_t;
using setting_int = int;
using setting_seconds = double;
using setting_mode = KernelMode;
size_t default_bytes(const char* name, const char* text);
int default_int(const char* name, const char* text);
double default_seconds(const char* name, const char* text);
KernelMode default_mode(const char* name, const char* text);

// One member per YALI_SETTING of settings.def (its `field`: mode, max_bytes, timeout_s,
// flash_bytes, stream_min, push_cta_bytes, slot_bytes, pdl, fused_batch_poll_min,
// fused_cluster, ranks_max, ranks_oneshot_max, ranks_fused_one_launch_max, ranks_fused_spread,
// ranks_two_shot_round), holding its default: the measured best on 2xH200 (plan_table.h gives the
// measurement behind each).
struct Config {
#define YALI_SETTING(name, field, type, def, low, high, step, help) setting_##type field = default_##type(#name, def);
#define YALI_PLUGIN_SETTING(name, type, def, low, high, step, help)
#include "yali/common/settings.def"
#undef YALI_SETTING
#undef YALI_PLUGIN_SETTING
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
