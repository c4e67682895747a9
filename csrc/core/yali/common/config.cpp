#include "yali/common/config.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <unistd.h>  // environ

#include "yali/common/layout.h"
#include "yali/common/plan.h"

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

// Every setting of settings.def as written there.
struct SettingRow {
  const char* name;
  const char* type;
  const char* def;
  const char* low;
  const char* high;
  const char* step;
};
constexpr SettingRow kSettingRows[] = {
#define YALI_SETTING(name, field, type, def, low, high, step, help) {#name, #type, def, low, high, step},
#define YALI_PLUGIN_SETTING(name, type, def, low, high, step, help) {#name, #type, def, low, high, step},
#include "yali/common/settings.def"
#undef YALI_SETTING
#undef YALI_PLUGIN_SETTING
};

const SettingRow& setting_row(const char* name) {
  for (const SettingRow& r : kSettingRows)
    if (std::strcmp(r.name, name) == 0) return r;
  throw std::logic_error(std::string("settings.def declares no ") + name);
}

[[noreturn]] void bad(const char* var, const std::string& value, const std::string& accepted) {
  throw std::invalid_argument(std::string(var) + "=" + value + " is invalid: expected " + accepted);
}

// The value of `var` in the environment; false if unset or empty.
bool env_text(const char* var, std::string* out) {
  const char* s = std::getenv(var);
  if (!s || !*s) return false;
  *out = s;
  return true;
}

// Parses a byte count as a user writes it: "123", "64K", "16M", "2G" (binary units).
bool parse_bytes(const std::string& v, size_t* out) {
  const char* s = v.c_str();
  char* end = nullptr;
  errno = 0;
  unsigned long long n = std::strtoull(s, &end, 10);
  if (end == s || errno != 0 || v.find('-') != std::string::npos) return false;
  unsigned long long mul = 1;
  if (*end == 'K' || *end == 'k') mul = 1ull << 10, ++end;
  else if (*end == 'M' || *end == 'm') mul = 1ull << 20, ++end;
  else if (*end == 'G' || *end == 'g') mul = 1ull << 30, ++end;
  if (*end != '\0' || n > (~0ull) / mul) return false;
  *out = size_t(n * mul);
  return true;
}

bool parse_int(const std::string& v, int* out) {
  const char* s = v.c_str();
  char* end = nullptr;
  errno = 0;
  long n = std::strtol(s, &end, 10);
  if (end == s || *end != '\0' || errno != 0 || n < -(1l << 30) || n > (1l << 30)) return false;
  *out = int(n);
  return true;
}

bool parse_seconds(const std::string& v, double* out) {
  const char* s = v.c_str();
  char* end = nullptr;
  const double d = std::strtod(s, &end);
  if (end == s || *end != '\0') return false;
  *out = d;
  return true;
}

bool parse_mode(const std::string& v, KernelMode* out) {
  if (v == "auto") *out = KernelMode::Auto;
  else if (v == "flash") *out = KernelMode::Flash;
  else if (v == "stream") *out = KernelMode::Stream;
  else return false;
  return true;
}

// A number of settings.def (a default or a bound); `empty` where the text is "".
template <typename T, typename Parse>
T listed(const char* name, const char* what, const char* text, Parse parse, T empty) {
  if (!*text) return empty;
  T v{};
  if (!parse(text, &v))
    throw std::logic_error(std::string("settings.def: ") + name + "'s " + what + " \"" + text + "\" does not parse");
  return v;
}

// The bounds of a bytes or int setting, as settings.def gives them (step "" = 1).
struct ByteBounds {
  size_t low, high, step;
  ByteBounds(const char* name, const char* lo, const char* hi, const char* st)
      : low(listed<size_t>(name, "low", lo, parse_bytes, 0)),
        high(listed<size_t>(name, "high", hi, parse_bytes, ~size_t(0))),
        step(listed<size_t>(name, "step", st, parse_bytes, 1)) {}
  bool holds(size_t v) const { return v >= low && v <= high && v % step == 0; }
  std::string accepted() const {
    return "a byte count in [" + std::to_string(low) + ", " + std::to_string(high) + "]" +
           (step > 1 ? " and a multiple of " + std::to_string(step) : "") + " (suffixes K, M, G allowed)";
  }
};

struct IntBounds {
  int low, high;
  IntBounds(const char* name, const char* lo, const char* hi)
      : low(listed<int>(name, "low", lo, parse_int, 0)), high(listed<int>(name, "high", hi, parse_int, 0)) {}
  bool holds(int v) const { return v >= low && v <= high; }
  std::string accepted() const { return "an integer in [" + std::to_string(low) + ", " + std::to_string(high) + "]"; }
};

// seconds: 0 (none) or within [low, high]; the message quotes the bounds as settings.def writes them.
struct SecondBounds {
  double low, high;
  const char* low_text;
  const char* high_text;
  SecondBounds(const char* name, const char* lo, const char* hi)
      : low(listed<double>(name, "low", lo, parse_seconds, 0.0)),
        high(listed<double>(name, "high", hi, parse_seconds, 0.0)),
        low_text(lo),
        high_text(hi) {}
  bool holds(double v) const { return v == 0.0 || (v >= low && v <= high); }
  std::string accepted() const {
    return std::string("0 (none) or seconds in [") + low_text + ", " + high_text + "]";
  }
};

constexpr char kModes[] = "one of auto, flash, stream";

// Reads one setting from the environment into `out` (left at its default when unset or empty).
void read_bytes(const char* var, const char* lo, const char* hi, const char* st, size_t* out) {
  std::string v;
  if (!env_text(var, &v)) return;
  const ByteBounds b(var, lo, hi, st);
  size_t n = 0;
  if (!parse_bytes(v, &n) || !b.holds(n)) bad(var, v, b.accepted());
  *out = n;
}

void read_int(const char* var, const char* lo, const char* hi, const char*, int* out) {
  std::string v;
  if (!env_text(var, &v)) return;
  const IntBounds b(var, lo, hi);
  int n = 0;
  if (!parse_int(v, &n) || !b.holds(n)) bad(var, v, b.accepted());
  *out = n;
}

void read_seconds(const char* var, const char* lo, const char* hi, const char*, double* out) {
  std::string v;
  if (!env_text(var, &v)) return;
  const SecondBounds b(var, lo, hi);
  double d = 0;
  if (!parse_seconds(v, &d) || !b.holds(d)) bad(var, v, b.accepted());
  *out = d;
}

void read_mode(const char* var, const char*, const char*, const char*, KernelMode* out) {
  std::string v;
  if (env_text(var, &v) && !parse_mode(v, out)) bad(var, v, kModes);
}

// Checks one value of a Config built in code against its bounds.
void check_bytes(const char* var, size_t v, const char* lo, const char* hi, const char* st) {
  const ByteBounds b(var, lo, hi, st);
  if (!b.holds(v)) bad(var, std::to_string(v), b.accepted());
}

void check_int(const char* var, int v, const char* lo, const char* hi, const char*) {
  const IntBounds b(var, lo, hi);
  if (!b.holds(v)) bad(var, std::to_string(v), b.accepted());
}

void check_seconds(const char* var, double v, const char* lo, const char* hi, const char*) {
  const SecondBounds b(var, lo, hi);
  if (!b.holds(v)) bad(var, std::to_string(v), b.accepted());
}

void check_mode(const char* var, KernelMode v, const char*, const char*, const char*) {
  if (v != KernelMode::Auto && v != KernelMode::Flash && v != KernelMode::Stream)
    bad(var, std::to_string(int(v)), kModes);
}

std::string text_bytes(size_t v) { return std::to_string(v); }
std::string text_int(int v) { return std::to_string(v); }
std::string text_seconds(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}
std::string text_mode(KernelMode m) { return m == KernelMode::Auto ? "auto" : m == KernelMode::Flash ? "flash" : "stream"; }

// Refuses every YALI_DEV_* variable of the environment that settings.def does not declare, so a
// misspelt or removed knob (YALI_DEV_BATCH_POLL) cannot be silently ignored.
void refuse_unknown_dev_knobs() {
  constexpr char kPrefix[] = "YALI_DEV_";
  for (char** e = environ; e && *e; ++e) {
    const std::string entry(*e);
    if (entry.rfind(kPrefix, 0) != 0) continue;
    const std::string name = entry.substr(0, entry.find('='));
    const bool known = std::any_of(std::begin(kSettingRows), std::end(kSettingRows),
                                   [&](const SettingRow& r) { return name == r.name; });
    if (!known) {
      std::string list;
      for (const SettingRow& r : kSettingRows)
        if (std::strncmp(r.name, kPrefix, sizeof(kPrefix) - 1) == 0) list += (list.empty() ? "" : ", ") + std::string(r.name);
      throw std::invalid_argument(entry + " is invalid: no such YALI_DEV_* knob (known: " + list + ")");
    }
  }
}

}  // namespace

size_t default_bytes(const char* name, const char* text) { return listed<size_t>(name, "default", text, parse_bytes, 0); }
int default_int(const char* name, const char* text) { return listed<int>(name, "default", text, parse_int, 0); }
double default_seconds(const char* name, const char* text) {
  return listed<double>(name, "default", text, parse_seconds, 0.0);
}
KernelMode default_mode(const char* name, const char* text) {
  return listed<KernelMode>(name, "default", text, parse_mode, KernelMode::Auto);
}

Config Config::from_env() {
  Config c;
#define YALI_SETTING(name, field, type, def, low, high, step, help) read_##type(#name, low, high, step, &c.field);
#define YALI_PLUGIN_SETTING(name, type, def, low, high, step, help)
#include "yali/common/settings.def"
#undef YALI_SETTING
#undef YALI_PLUGIN_SETTING
  refuse_unknown_dev_knobs();
  c.validate();
  return c;
}

void Config::validate() const {
#define YALI_SETTING(name, field, type, def, low, high, step, help) check_##type(#name, field, low, high, step);
#define YALI_PLUGIN_SETTING(name, type, def, low, high, step, help)
#include "yali/common/settings.def"
#undef YALI_SETTING
#undef YALI_PLUGIN_SETTING
  // The N-rank one-shot limit is at most the N-rank limit, or the largest of the table's while
  // that is by world size (0); it is cut to the limit of a world size whose limit is lower
  // (plan_table.h kRanksRows, plan.cpp ranks_oneshot_max).
  if (ranks_oneshot_max != 0) {
    const std::string top = std::to_string(ranks_max != 0 ? ranks_max : table::ranks_serve_max_of_all());
    check_bytes("YALI_DEV_RANKS_ONESHOT_MAX", ranks_oneshot_max, "4K", top.c_str(), "4K");
  }
  static_assert(kMaxFusedSpread == 8, "the spreads checked here are 2, 4 and 8");
  if (ranks_fused_spread != 0 && ranks_fused_spread != 2 && ranks_fused_spread != 4 && ranks_fused_spread != 8)
    bad("YALI_DEV_RANKS_FUSED_SPREAD", std::to_string(ranks_fused_spread), "0 (off), 2, 4 or 8 (CTAs of a cluster)");
  if (ep_slot_bytes != 0) {
    const SettingRow& r = setting_row("YALI_EP_SLOT_BYTES");
    check_bytes(r.name, ep_slot_bytes, r.low, r.high, r.step);
  }
}

std::string Config::to_string() const {
  std::string s;
#define YALI_SETTING(name, field, type, def, low, high, step, help) s += (s.empty() ? "" : " ") + std::string(#field "=") + text_##type(field);
#define YALI_PLUGIN_SETTING(name, type, def, low, high, step, help)
#include "yali/common/settings.def"
#undef YALI_SETTING
#undef YALI_PLUGIN_SETTING
  return s + " ep_slot_bytes=" + std::to_string(ep_slot_bytes);
}

size_t shared_buffer_bytes(const Config& c, int world) { return SharedLayout(c, world).total; }

}  // namespace yali
