// Compares the size table's lookups (plan.cpp over plan_table.h) with the if/else ladders they
// replace (plan_ladders.cpp) over a dense sweep of message sizes, fused shapes, world sizes, modes
// and settings. Built and run by tests/core/test_table_matches_ladders.py (g++, no GPU).
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "yali/common/config.h"
#include "yali/common/plan.h"

namespace yali {
namespace ladder {
int push_ctas_ladder(const Config& c, size_t bytes);
size_t ranks_max_for_ladder(const Config& c, int world);
size_t ranks_oneshot_max_ladder(const Config& c, int world);
size_t ranks_slot_bytes_ladder(const Config& c, int world);
size_t ranks_fused_one_launch_max_ladder(const Config& c, int world);
Plan plan_for_ladder(const Config& c, size_t nbytes, int world);
FusedLaunch fused_launch_for_ladder(const Config& c, size_t rows, size_t hidden, DType dtype, int world);
}  // namespace ladder
}  // namespace yali

using namespace yali;

namespace {

constexpr size_t KiB = 1024, MiB = KiB * KiB;
long long checked = 0, differ = 0;

void report(const Config& c, const char* what, int world, size_t a, size_t b, size_t x, size_t y) {
  if (++differ <= 20)
    std::printf("DIFFER %s world=%d args=(%zu, %zu) table=%zu ladder=%zu config=[%s]\n", what, world, a, b, x, y,
                c.to_string().c_str());
}

void same_plan(const Config& c, size_t nbytes, int world) {
  const Plan p = plan_for(c, nbytes, world), q = ladder::plan_for_ladder(c, nbytes, world);
  ++checked;
  if (p.kernel != q.kernel) report(c, "plan kernel", world, nbytes, 0, size_t(p.kernel), size_t(q.kernel));
  else if (p.blocks != q.blocks) report(c, "plan blocks", world, nbytes, 0, size_t(p.blocks), size_t(q.blocks));
  else if (p.chunk_bytes != q.chunk_bytes) report(c, "plan chunk", world, nbytes, 0, p.chunk_bytes, q.chunk_bytes);
}

void same_fused(const Config& c, size_t rows, size_t hidden, DType dt, int world) {
  const FusedLaunch a = fused_launch_for(c, rows, hidden, dt, world);
  const FusedLaunch b = ladder::fused_launch_for_ladder(c, rows, hidden, dt, world);
  ++checked;
  const size_t fa[] = {a.one_launch, size_t(a.grid), size_t(a.row_vecs_per_thread), a.cta_bytes, a.batch_poll,
                       a.row_loads_early, a.pdl, size_t(a.cluster), size_t(a.spread)};
  const size_t fb[] = {b.one_launch, size_t(b.grid), size_t(b.row_vecs_per_thread), b.cta_bytes, b.batch_poll,
                       b.row_loads_early, b.pdl, size_t(b.cluster), size_t(b.spread)};
  for (int i = 0; i < 9; ++i)
    if (fa[i] != fb[i]) {
      report(c, "fused field", world, rows, hidden * 10 + i, fa[i], fb[i]);
      return;
    }
}

void same_limits(const Config& c, int world) {
  ++checked;
  if (ranks_max_for(c, world) != ladder::ranks_max_for_ladder(c, world))
    report(c, "ranks_max_for", world, 0, 0, ranks_max_for(c, world), ladder::ranks_max_for_ladder(c, world));
  if (ranks_oneshot_max(c, world) != ladder::ranks_oneshot_max_ladder(c, world))
    report(c, "ranks_oneshot_max", world, 0, 0, ranks_oneshot_max(c, world), ladder::ranks_oneshot_max_ladder(c, world));
  if (ranks_slot_bytes(c, world) != ladder::ranks_slot_bytes_ladder(c, world))
    report(c, "ranks_slot_bytes", world, 0, 0, ranks_slot_bytes(c, world), ladder::ranks_slot_bytes_ladder(c, world));
  if (ranks_fused_one_launch_max(c, world) != ladder::ranks_fused_one_launch_max_ladder(c, world))
    report(c, "ranks_fused_one_launch_max", world, 0, 0, ranks_fused_one_launch_max(c, world),
           ladder::ranks_fused_one_launch_max_ladder(c, world));
  for (size_t b : {size_t(1), size_t(1000), 64 * KiB, 3 * MiB})
    if (push_ctas(c, b) != ladder::push_ctas_ladder(c, b))
      report(c, "push_ctas", world, b, 0, size_t(push_ctas(c, b)), size_t(ladder::push_ctas_ladder(c, b)));
}

// Message sizes: every size up to 64 KiB + 64, every size within 64 bytes of a power of two, of
// each multiple of 64 KiB up to 40 MiB and of every setting's value, and random sizes up to 4 GiB.
std::vector<size_t> sizes(const Config& c, std::mt19937_64& rng) {
  std::vector<size_t> s;
  for (size_t n = 0; n <= 64 * KiB + 64; ++n) s.push_back(n);
  std::vector<size_t> marks;
  for (int k = 0; k < 34; ++k) marks.push_back(size_t(1) << k);
  for (size_t m = 64 * KiB; m <= 40 * MiB; m += 64 * KiB) marks.push_back(m);
  for (size_t v : {c.max_bytes, c.flash_bytes, c.stream_min, c.ranks_max, c.ranks_oneshot_max,
                   c.ranks_fused_one_launch_max, c.slot_bytes * kStreamLanes, c.push_cta_bytes * kMaxFlashCtas})
    marks.push_back(v);
  for (size_t m : marks)
    for (size_t d = 0; d <= 64; ++d) {
      s.push_back(m + d);
      if (m >= d) s.push_back(m - d);
    }
  for (int i = 0; i < 20000; ++i) s.push_back(rng() % (size_t(4) << 30));
  return s;
}

void sweep(const Config& c, std::mt19937_64& rng, bool fused_dense) {
  const std::vector<size_t> ns = sizes(c, rng);
  for (int world = 1; world <= 9; ++world) {
    same_limits(c, world);
    for (size_t n : ns) same_plan(c, n, world);
  }
  const size_t hiddens[] = {8,    16,   64,   504,  512,  1024, 2048, 2056, 3072, 4096, 4104, 5120,
                            6144, 7168, 8192, 8200, 12288, 14336, 16384, 16392, 24576, 32768};
  const size_t max_rows = fused_dense ? 1100 : 300;
  for (int world = 2; world <= 8; ++world)
    for (DType dt : {DType::F32, DType::F16, DType::BF16})
      for (size_t h : hiddens) {
        if (h * dtype_size(dt) > kFusedMaxRowBytes) continue;
        for (size_t rows = 1; rows <= max_rows; ++rows) same_fused(c, rows, h, dt, world);
        for (int i = 0; i < 50; ++i) same_fused(c, 1 + rng() % 70000, h, dt, world);
      }
}

template <typename T>
T pick(std::mt19937_64& rng, std::initializer_list<T> xs) {
  return *(xs.begin() + rng() % xs.size());
}

}  // namespace

int main() {
  std::mt19937_64 rng(53);
  std::vector<Config> configs;
  configs.push_back(Config{});
  for (KernelMode m : {KernelMode::Flash, KernelMode::Stream}) {
    Config c;
    c.mode = m;
    configs.push_back(c);
  }
  for (int i = 0; i < 60; ++i) {
    Config c;
    c.mode = pick(rng, {KernelMode::Auto, KernelMode::Auto, KernelMode::Flash, KernelMode::Stream});
    c.max_bytes = pick(rng, {size_t(16), 64 * KiB, 1 * MiB + 16, 12 * MiB, size_t(2) << 30});
    c.flash_bytes = pick(rng, {4 * KiB, 1 * MiB, 8 * MiB, 16 * MiB});
    c.stream_min = pick(rng, {size_t(0), 1 * MiB, 8 * MiB, size_t(1) << 30});
    c.push_cta_bytes = pick(rng, {size_t(256), 1 * KiB, 4 * KiB, 16 * KiB});
    c.slot_bytes = pick(rng, {4 * KiB, 64 * KiB, 128 * KiB});
    c.pdl = pick(rng, {0, 1});
    c.fused_batch_poll_min = pick(rng, {size_t(0), 512 * KiB, size_t(1) << 30});
    c.fused_cluster = pick(rng, {-1, -1, 0, 1, 2, 4, 8});
    c.ranks_max = pick(rng, {size_t(0), size_t(0), 1 * MiB, 4 * MiB, 64 * MiB});
    c.ranks_oneshot_max = pick(rng, {size_t(0), size_t(0), 64 * KiB, 1 * MiB, 16 * MiB});
    c.ranks_fused_one_launch_max = pick(rng, {size_t(0), size_t(0), 256 * KiB, 2 * MiB, 16 * MiB});
    c.ranks_fused_spread = pick(rng, {0, 2, 4, 4, 8});
    configs.push_back(c);
  }
  for (size_t i = 0; i < configs.size(); ++i) sweep(configs[i], rng, i < 3);
  std::printf("%lld decisions compared over %zu configurations, %lld differ\n", checked, configs.size(), differ);
  return differ == 0 ? 0 : 1;
}
