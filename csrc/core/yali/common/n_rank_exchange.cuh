// The N-rank push exchange: what the N-rank all-reduce (all_reduce/n_rank.cuh, world sizes 3 to
// kMaxRanks; the communicator serves 4, 6 and 8), the N-rank fused op (fused/n_rank_fused.cuh) and
// expert parallelism (ep/ep.cuh, 2 to kMaxRanks ranks: wait_ranks, RankSum) share.
//
// Every rank maps every other rank's buffer (RanksArgs::bufs) and writes into it with 16-byte
// stores over NVLink; nothing is ever read across the link. Arrival is seen in the data, as in
// flash-push (exchange.cuh: kPushEmpty, canonical(), the reader gives every word back).
//
// Bitwise identical on every rank: every element is the sum of the N inputs (each made
// canonical) in rank order 0, 1, ..., N - 1, accumulated in fp32 and rounded once to T, on
// whichever rank computes it; in two-shot only the segment's owner computes it and the others
// copy its bits.
//
// Buffer reuse (two parities, no reset, no end barrier): rank p writes into my slots of parity
// q in its calls e and e + 2. It starts call e + 2 after its call e + 1 completed, and that call
// waited for my call descriptor of call e + 1 (call_check.cuh: every rank checks every other
// rank's call), which my call e + 1 sends only after my call e, with the clearing of parity q,
// completed. The epochs are flash-push's (advance_epochs), per CTA, shared by every kernel.
#pragma once
#include "yali/common/exchange.cuh"

namespace yali {

struct RanksArgs {
  const void* in;
  void* out;
  size_t nbytes;
  int rank;               // mine
  int world;
  int total_ctas;         // kMaxFlashCtas (advance_epochs)
  size_t slot_bytes;      // one rank's slot of one phase (SharedLayout::ranks_slot)
  size_t push_off;        // SharedLayout::ranks_push, the same in every rank's buffer
  size_t call_off;        // SharedLayout::call_slots
  char* bufs[kMaxRanks];  // every rank's shared buffer as mapped in this process (bufs[rank]: mine)
  LocalState* state;
  uint64_t timeout_ns;    // YALI_TIMEOUT_S (0 = no watchdog)
  AbortRef abort;         // the abort record and this call's descriptor (layout.h)
  CallDesc call;          // this call, checked against every other rank's (call_check.cuh)
  size_t round_vecs;      // push two-shot: vectors of a CTA's share of a segment per round (0 = all)
};

// The kernels are built per world size (kW = 4, 6, 8) so that every loop over the ranks is unrolled
// and every "% world" is a constant; kW = 0 is the build for any other world size (a.world).
template <int kW>
__device__ __forceinline__ int world_of(const RanksArgs& a) {
  return kW > 0 ? kW : a.world;
}
// The bound of an unrolled loop over the ranks (which breaks at world_of): kW, or kMaxRanks.
template <int kW>
constexpr int kRankLoop = kW > 0 ? kW : kMaxRanks;

// Rank `from`'s slot of phase `phase` (0: one-shot data, two-shot reduce-scatter; 1: two-shot
// all-gather) and parity `parity` in rank `owner`'s push area.
__device__ __forceinline__ Vec16* ranks_slot(const RanksArgs& a, int world, int owner, int parity, int phase,
                                             int from) {
  const size_t slot = size_t((parity * 2 + phase) * world + from);
  return reinterpret_cast<Vec16*>(a.bufs[owner] + a.push_off + slot * a.slot_bytes);
}

// The rank-order sum of one 16-byte vector position over the ranks, in fp32.
template <typename T>
struct RankSum {
  static constexpr int kN = 16 / sizeof(T);
  float f[kN];
  __device__ __forceinline__ void add(const Vec16& v, bool first) {
    float g[kN];
    unpack<T>(v, g);
#pragma unroll
    for (int i = 0; i < kN; ++i) f[i] = first ? g[i] : f[i] + g[i];
  }
  __device__ __forceinline__ Vec16 result() const { return pack<T>(f); }  // rounded once to T
};

// The start of every N-rank kernel, by all threads: advances the epochs and returns the parity of
// this call; the checker thread (is_call_checker) sends this call's descriptor to every other rank.
__device__ __forceinline__ int ranks_begin(const RanksArgs& a, int world, bool checker, uint64_t call_n,
                                           uint32_t** call_slots) {
  const uint64_t e = advance_epochs(a.state, a.total_ctas);
  if (checker) *call_slots = ranks_call_begin(a.call, a.bufs, a.call_off, a.rank, world, a.state, call_n);
  return int(e & 1);
}

// Sends vectors [r.begin, r.end) of my input (this thread's: r.begin + t, + kFlashThreads, ...)
// into my slot of phase 0 in every other rank's push area, kU at a time; v holds the first batch
// already, `load` fetches the later ones. Ranks are visited from my right neighbour on, so that
// the N - 1 links of a GPU start busy together.
template <typename T, int kW, int kU, typename Load>
__device__ __forceinline__ void send_to_ranks(const RanksArgs& a, int parity, Vec16 (&v)[kU], Range r, Load load) {
  const int world = world_of<kW>(a);
  const int t = threadIdx.x;
  for (size_t i = r.begin + t; i < r.end; i += size_t(kU) * kFlashThreads) {
    if (i != r.begin + t) load_batch(v, i, r.end, load);
#pragma unroll
    for (int u = 0; u < kU; ++u) v[u] = canonical<T>(v[u]);
#pragma unroll
    for (int d = 1; d < kRankLoop<kW>; ++d) {
      if (d >= world) break;
      const int p = (a.rank + d) % world;
      Vec16* to = ranks_slot(a, world, p, parity, 0, a.rank);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const size_t k = i + size_t(u) * kFlashThreads;
        if (k < r.end) store_push(to + k, v[u]);
      }
    }
  }
}

// Spins until every other rank's vector (got[p], a first load of at(p)) has arrived. Each round
// re-loads every one still empty before it looks again, so the round trips of the ranks' vectors
// overlap: a rank whose first load came too early costs one more round trip in all, not one more
// before the next rank is looked at. A timeout names the first rank still missing (two ranks: the
// peer, as -1). exchange.cuh's wait_push_batch polls the same way, but marks an absent vector by
// a null address: written through it, the whole-row fused kernel at 2 vectors a thread (4 ranks,
// 17-128 tokens of hidden 8192) spills 64 bytes, as it does not here.
template <typename At>
__device__ __forceinline__ void wait_ranks(Vec16 (&got)[kMaxRanks], int me, int world, At at, uint64_t timeout_ns,
                                           const AbortRef& abort, Kernel kernel) {
  const auto missing = [&] {  // the first rank whose vector has not arrived, or -1
    int m = -1;
#pragma unroll
    for (int p = kMaxRanks - 1; p >= 0; --p)
      if (p < world && p != me && !push_arrived(got[p])) m = p;
    return m;
  };
  if (missing() < 0) return;
  const uint64_t start = global_timer_ns();
  for (uint32_t spins = 1;; ++spins) {
#pragma unroll
    for (int p = 0; p < kMaxRanks; ++p)
      if (p < world && p != me && !push_arrived(got[p])) got[p] = load_push(at(p));
    const int m = missing();
    if (m < 0) return;
    if (timeout_ns != 0 && (spins & 1023u) == 0 && global_timer_ns() - start > timeout_ns) {
      uint32_t seen = kPushEmpty;  // rank m's last load, picked with constant indices: got stays in registers
#pragma unroll
      for (int p = 0; p < kMaxRanks; ++p)
        if (p == m) seen = got[p].x;
      abort_waiting(abort, kernel, 6, kPushEmpty, seen, nullptr, world == 2 ? -1 : m);
    }
  }
}

// The rank-order sum of vector j of phase-0 slots in my push area (every other rank's copy) and
// `mine` (my own, canonical already); gives the slots' words back.
template <typename T, int kW>
__device__ __forceinline__ Vec16 sum_ranks(const RanksArgs& a, int parity, size_t j, const Vec16& mine, Kernel kernel) {
  const int world = world_of<kW>(a);
  const auto at = [&](int p) { return ranks_slot(a, world, a.rank, parity, 0, p) + j; };
  Vec16 got[kMaxRanks];
#pragma unroll
  for (int p = 0; p < kMaxRanks; ++p)  // every load first: their latencies overlap
    if (p < world && p != a.rank) got[p] = load_push(at(p));
  wait_ranks(got, a.rank, world, at, a.timeout_ns, a.abort, kernel);
  RankSum<T> s;
#pragma unroll
  for (int p = 0; p < kMaxRanks; ++p) {
    if (p >= world) break;
    if (p == a.rank) {
      s.add(mine, p == 0);
      continue;
    }
    s.add(got[p], p == 0);
    clear_push(at(p));
  }
  return s.result();
}

}  // namespace yali
