#include "config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <unistd.h>  // environ
#include <vector>

#include "layout.h"
#include "plan.h"

namespace yali {

const char* kernel_name(Kernel k) {
  switch (k) {
    case Kernel::Stream: return "stream";
    case Kernel::FlashPush: return "flash-push";
    case Kernel::PushOneShot: return "push-oneshot";
    case Kernel::PushTwoShot: return "push-twoshot";
    case Kernel::EpGather: return "ep-gather";
    case Kernel::EpReduceScatter: return "ep-reduce-scatter";
    default: return "none";
  }
}

size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }

namespace {

[[noreturn]] void bad(const char* var, const std::string& value, const std::string& accepted) {
  throw std::invalid_argument(std::string(var) + "=" + value + " is invalid: expected " + accepted);
}

// Parses "123", "64K", "16M", "2G" (binary units). Returns false if unset or empty.
bool env_bytes(const char* var, size_t lo, size_t hi, size_t multiple, size_t* out) {
  const char* s = std::getenv(var);
  if (!s || !*s) return false;
  const std::string v(s);
  const std::string accepted = "a byte count in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                               "]" + (multiple > 1 ? " and a multiple of " + std::to_string(multiple) : "") +
                               " (suffixes K, M, G allowed)";
  char* end = nullptr;
  errno = 0;
  unsigned long long n = std::strtoull(s, &end, 10);
  if (end == s || errno != 0 || v[0] == '-') bad(var, v, accepted);
  unsigned long long mul = 1;
  if (*end == 'K' || *end == 'k') mul = 1ull << 10, ++end;
  else if (*end == 'M' || *end == 'm') mul = 1ull << 20, ++end;
  else if (*end == 'G' || *end == 'g') mul = 1ull << 30, ++end;
  if (*end != '\0' || n > (~0ull) / mul) bad(var, v, accepted);
  n *= mul;
  if (n < lo || n > hi || (multiple > 1 && n % multiple != 0)) bad(var, v, accepted);
  *out = size_t(n);
  return true;
}

bool env_int(const char* var, int lo, int hi, int* out) {
  const char* s = std::getenv(var);
  if (!s || !*s) return false;
  char* end = nullptr;
  errno = 0;
  long n = std::strtol(s, &end, 10);
  if (end == s || *end != '\0' || errno != 0 || n < lo || n > hi)
    bad(var, s, "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  *out = int(n);
  return true;
}

void check_range(const char* var, size_t v, size_t lo, size_t hi, size_t multiple) {
  if (v < lo || v > hi || (multiple > 1 && v % multiple))
    bad(var, std::to_string(v),
        "a byte count in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]" +
            (multiple > 1 ? " and a multiple of " + std::to_string(multiple) : ""));
}

void check_int(const char* var, int v, int lo, int hi) {
  if (v < lo || v > hi)
    bad(var, std::to_string(v), "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}


// Refuses every YALI_DEV_* variable of the environment that is not in `known` (the
// names from_env() read), so a misspelt or removed knob (YALI_DEV_BATCH_POLL) cannot
// be silently ignored.
void refuse_unknown_dev_knobs(const std::vector<std::string>& known) {
  constexpr char kPrefix[] = "YALI_DEV_";
  for (char** e = environ; e && *e; ++e) {
    const std::string entry(*e);
    if (entry.rfind(kPrefix, 0) != 0) continue;
    const std::string name = entry.substr(0, entry.find('='));
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      std::string list;
      for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
      throw std::invalid_argument(entry + " is invalid: no such YALI_DEV_* knob (known: " + list + ")");
    }
  }
}

}  // namespace

Config Config::from_env() {
  Config c;
  std::vector<std::string> dev_knobs;  // every YALI_DEV_* name read below; any other is refused
  const auto dev_bytes = [&](const char* var, size_t lo, size_t hi, size_t multiple, size_t* out) {
    dev_knobs.emplace_back(var);
    env_bytes(var, lo, hi, multiple, out);
  };
  const auto dev_int = [&](const char* var, int lo, int hi, int* out) {
    dev_knobs.emplace_back(var);
    env_int(var, lo, hi, out);
  };
  if (const char* m = std::getenv("YALI_KERNEL_MODE"); m && *m) {
    const std::string v(m);
    if (v == "auto") c.mode = KernelMode::Auto;
    else if (v == "flash") c.mode = KernelMode::Flash;
    else if (v == "stream") c.mode = KernelMode::Stream;
    else bad("YALI_KERNEL_MODE", v, "one of auto, flash, stream");
  }
  env_bytes("YALI_MAX_BYTES", 16, size_t(1) << 40, 1, &c.max_bytes);
  dev_bytes("YALI_DEV_FLASH_BYTES", 4096, size_t(1) << 30, 4096, &c.flash_bytes);
  dev_bytes("YALI_DEV_PUSH_CTA_BYTES", 256, size_t(16) << 20, 16, &c.push_cta_bytes);
  dev_bytes("YALI_DEV_STREAM_MIN", 0, size_t(1) << 40, 1, &c.stream_min);
  dev_int("YALI_DEV_FLASH_CTAS", 1, kMaxFlashCtas, &c.flash_ctas);
  dev_int("YALI_DEV_LANES", 1, kMaxLanes, &c.lanes);
  dev_int("YALI_DEV_SLOTS", 2, kMaxSlots, &c.slots);
  dev_bytes("YALI_DEV_SLOT_BYTES", 4096, size_t(16) << 20, 4096, &c.slot_bytes);
  dev_int("YALI_DEV_PDL", 0, 1, &c.pdl);
  dev_bytes("YALI_DEV_FUSED_BATCH_POLL_MIN", 0, size_t(1) << 40, 1, &c.fused_batch_poll_min);
  dev_bytes("YALI_DEV_FUSED_CTA_BYTES", 0, size_t(16) << 20, 16, &c.fused_cta_bytes);
  dev_int("YALI_DEV_FUSED_ROW_LOADS_EARLY", -1, 1, &c.fused_row_loads_early);
  dev_int("YALI_DEV_FUSED_CLUSTER", -1, 8, &c.fused_cluster);
  dev_bytes("YALI_DEV_RANKS_MAX", 0, size_t(64) << 20, 4096, &c.ranks_max);
  dev_bytes("YALI_DEV_RANKS_ONESHOT_MAX", 0, size_t(64) << 20, 4096, &c.ranks_oneshot_max);
  dev_int("YALI_DEV_RANKS_FUSED_SPREAD", 0, 8, &c.ranks_fused_spread);
  dev_bytes("YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX", 0, size_t(16) << 20, 4096, &c.ranks_fused_one_launch_max);
  // a multiple of one vector per thread of a CTA (kFlashThreads x 16 bytes): no thread idles in a round
  dev_bytes("YALI_DEV_RANKS_TWO_SHOT_ROUND", 0, size_t(16) << 20, size_t(kFlashThreads) * 16, &c.ranks_two_shot_round);
  refuse_unknown_dev_knobs(dev_knobs);
  if (const char* t = std::getenv("YALI_TIMEOUT_S"); t && *t) {
    char* end = nullptr;
    double v = std::strtod(t, &end);
    // Below a millisecond the watchdog could not tell a slow peer from a missing one.
    if (end == t || *end != '\0' || !(v == 0.0 || (v >= kMinTimeoutS && v <= 86400.0)))
      bad("YALI_TIMEOUT_S", t, "0 (no watchdog) or seconds in [0.001, 86400]");
    c.timeout_s = v;
  }
  c.validate();
  return c;
}

void Config::validate() const {
  check_range("YALI_MAX_BYTES", max_bytes, 16, size_t(1) << 40, 1);
  check_range("YALI_DEV_FLASH_BYTES", flash_bytes, 4096, size_t(1) << 30, 4096);
  check_range("YALI_DEV_PUSH_CTA_BYTES", push_cta_bytes, 256, size_t(16) << 20, 16);
  check_int("YALI_DEV_FLASH_CTAS", flash_ctas, 1, kMaxFlashCtas);
  check_int("YALI_DEV_LANES", lanes, 1, kMaxLanes);
  check_int("YALI_DEV_SLOTS", slots, 2, kMaxSlots);
  check_range("YALI_DEV_SLOT_BYTES", slot_bytes, 4096, size_t(16) << 20, 4096);
  check_int("YALI_DEV_PDL", pdl, 0, 1);
  check_range("YALI_DEV_FUSED_BATCH_POLL_MIN", fused_batch_poll_min, 0, size_t(1) << 40, 1);
  if (fused_cta_bytes != 0) check_range("YALI_DEV_FUSED_CTA_BYTES", fused_cta_bytes, 256, size_t(16) << 20, 16);
  check_int("YALI_DEV_FUSED_ROW_LOADS_EARLY", fused_row_loads_early, -1, 1);
  check_int("YALI_DEV_FUSED_CLUSTER", fused_cluster, -1, 8);
  // Both N-rank limits, like the other buffer sizes, are multiples of 4 KiB (0: by world size). With
  // the N-rank limit by world size the one-shot limit is at most its largest (16 MiB) and is cut to
  // the limit of a world size whose limit is lower (plan.cpp ranks_oneshot_max).
  if (ranks_max != 0) check_range("YALI_DEV_RANKS_MAX", ranks_max, 4096, size_t(64) << 20, 4096);
  if (ranks_oneshot_max != 0)
    check_range("YALI_DEV_RANKS_ONESHOT_MAX", ranks_oneshot_max, 4096, ranks_max != 0 ? ranks_max : size_t(16) << 20, 4096);
  if (ranks_fused_one_launch_max != 0)
    check_range("YALI_DEV_RANKS_FUSED_ONE_LAUNCH_MAX", ranks_fused_one_launch_max, 4096, size_t(16) << 20, 4096);
  if (ranks_two_shot_round != 0)
    check_range("YALI_DEV_RANKS_TWO_SHOT_ROUND", ranks_two_shot_round, size_t(kFlashThreads) * 16, size_t(16) << 20,
                size_t(kFlashThreads) * 16);
  static_assert(kMaxFusedSpread == 8, "the spreads checked here are 2, 4 and 8");
  if (ranks_fused_spread != 0 && ranks_fused_spread != 2 && ranks_fused_spread != 4 && ranks_fused_spread != 8)
    bad("YALI_DEV_RANKS_FUSED_SPREAD", std::to_string(ranks_fused_spread), "0 (off), 2, 4 or 8 (CTAs of a cluster)");
  if (ep_slot_bytes != 0) check_range("YALI_EP_SLOT_BYTES", ep_slot_bytes, 4096, size_t(256) << 20, 4096);
  if (!(timeout_s == 0.0 || (timeout_s >= kMinTimeoutS && timeout_s <= 86400.0)))
    bad("YALI_TIMEOUT_S", std::to_string(timeout_s), "0 (no watchdog) or seconds in [0.001, 86400]");
}

std::string Config::to_string() const {
  std::ostringstream o;
  o << "mode=" << (mode == KernelMode::Auto ? "auto" : mode == KernelMode::Flash ? "flash" : "stream")
    << " max_bytes=" << max_bytes << " flash_bytes=" << flash_bytes << " push_cta_bytes=" << push_cta_bytes
    << " stream_min=" << stream_min << " flash_ctas=" << flash_ctas
    << " lanes=" << lanes << " slots=" << slots << " slot_bytes=" << slot_bytes << " pdl=" << pdl << " fused_batch_poll_min=" << fused_batch_poll_min
    << " fused_cta_bytes=" << fused_cta_bytes
    << " fused_row_loads_early=" << fused_row_loads_early << " fused_cluster=" << fused_cluster
    << " ranks_max=" << ranks_max << " ranks_oneshot_max=" << ranks_oneshot_max
    << " ranks_fused_spread=" << ranks_fused_spread << " ranks_fused_one_launch_max=" << ranks_fused_one_launch_max
    << " ranks_two_shot_round=" << ranks_two_shot_round
    << " timeout_s=" << timeout_s << " ep_slot_bytes=" << ep_slot_bytes;
  return o.str();
}

size_t shared_buffer_bytes(const Config& c, int world) { return SharedLayout(c, world).total; }

}  // namespace yali
