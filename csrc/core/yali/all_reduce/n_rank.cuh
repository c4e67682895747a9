// The N-rank all-reduce (world sizes 3 to kMaxRanks; the communicator serves 4, 6 and 8) and the
// N-rank fused all-reduce + residual add + RMSNorm. Two ranks use flash-push and stream instead.
//
// Every rank maps every other rank's buffer (RanksArgs::bufs) and writes into it with 16-byte
// stores over NVLink; nothing is ever read across the link. Arrival is seen in the data, as in
// flash-push (exchange.cuh: kPushEmpty, canonical(), the reader gives every word back).
//
//  * push one-shot: every rank sends its whole input into slot `me` of every other rank's push
//    area, then adds the N inputs. One NVLink trip; every GPU sends N - 1 times the message.
//  * push two-shot: the message is cut into N segments, segment s reduced by rank s. Reduce-
//    scatter: every rank sends segment s of its input into slot `me` (phase 0) of rank s; rank s
//    adds the N contributions and sends the sum into slot s (phase 1) of every other rank, which
//    copies it out (all-gather). Two trips; every GPU sends about twice the message.
//  * fused: the exchange of push one-shot; a CTA owns whole rows as in fused.cuh (fused_work: it
//    waits only for chunks that CTAs of its own cluster or an earlier one send, on every rank), adds
//    the N copies of each row it owns and runs the fused op's epilogue (rmsnorm_row) on the sum.
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
#include <cooperative_groups.h>

#include "yali/fused/fused.cuh"

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

// out = the sum over the ranks of in. CTA b owns vectors split_range(b) of the message on every
// rank: it sends them to every other rank, then adds the N copies of the same vectors.
template <typename T, int kW>
__global__ void __launch_bounds__(kFlashThreads, 1) push_oneshot_kernel(RanksArgs a) {
  wait_prior_grids();
  constexpr int kU = 4;  // vectors in flight per thread
  const int world = world_of<kW>(a);
  const int t = threadIdx.x;
  const Range r = split_range(0, (a.nbytes + 15) / 16, gridDim.x, blockIdx.x);
  const auto input = [&](size_t k) { return load_input_vector<T>(a.in, k, a.nbytes); };
  Vec16 v[kU];
  load_batch(v, r.begin + t, r.end, input);  // while thread 0 fetches the epoch
  const bool checker = is_call_checker();
  const uint64_t call_n = checker ? a.state->call_seq + 1 : 0;
  uint32_t* call_slots = nullptr;
  const int parity = ranks_begin(a, world, checker, call_n, &call_slots);

  send_to_ranks<T, kW>(a, parity, v, r, input);
  if (checker) ranks_call_verify(a.call, call_slots, a.rank, world, a.timeout_ns, a.abort, Kernel::PushOneShot);
  for (size_t k = r.begin + t; k < r.end; k += kFlashThreads) {
    const Vec16 mine = canonical<T>(load_input_vector<T>(a.in, k, a.nbytes));  // in L2: sent above
    store_output_vector<T>(a.out, k, a.nbytes, sum_ranks<T, kW>(a, parity, k, mine, Kernel::PushOneShot));
  }
}

// out = the sum over the ranks of in, by reduce-scatter and all-gather. The message's V vectors
// are cut into N segments of S = ceil(V / N) vectors (the last ones shorter or empty); CTA b owns
// positions split_range(b) of every segment, on every rank, and a thread the same positions in
// every phase, so each element is read (phase A or B) by the thread that later writes it: in-place
// is safe. A CTA runs the three phases round by round over a.round_vecs of its positions at a
// time (all of them when 0), each round on positions no other round reads or writes; it runs at
// least one round, so the checker makes the call check even when its CTA's range is empty.
template <typename T, int kW>
__global__ void __launch_bounds__(kFlashThreads, 1) push_twoshot_kernel(RanksArgs a) {
  wait_prior_grids();
  constexpr int kU = 4;
  const int world = world_of<kW>(a);
  const int t = threadIdx.x;
  const size_t vecs = (a.nbytes + 15) / 16;
  const size_t seg = (vecs + world - 1) / world;
  const Range mine_all = split_range(0, seg, gridDim.x, blockIdx.x);
  const bool checker = is_call_checker();
  const uint64_t call_n = checker ? a.state->call_seq + 1 : 0;
  uint32_t* call_slots = nullptr;
  const int parity = ranks_begin(a, world, checker, call_n, &call_slots);
  const size_t round = a.round_vecs ? a.round_vecs : max(mine_all.end - mine_all.begin, size_t(1));

  for (size_t rb = mine_all.begin;; rb += round) {
    const Range r{rb, min(mine_all.end, rb + round)};
    // A. reduce-scatter: segment p of my input to rank p
    for (int d = 1; d < world; ++d) {
      const int p = (a.rank + d) % world;
      Vec16* to = ranks_slot(a, world, p, parity, 0, a.rank);
      const size_t at = size_t(p) * seg;
      for (size_t i = r.begin + t; i < r.end; i += size_t(kU) * kFlashThreads) {
        Vec16 v[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const size_t j = i + size_t(u) * kFlashThreads;
          if (j < r.end && at + j < vecs) v[u] = load_input_vector<T>(a.in, at + j, a.nbytes);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const size_t j = i + size_t(u) * kFlashThreads;
          if (j < r.end && at + j < vecs) store_push(to + j, canonical<T>(v[u]));
        }
      }
    }
    // The checker verifies once, after its first round's sends and before it waits for any peer
    // data (call_check.cuh: the other CTAs never wait for the check). The round size need not
    // match across ranks (each position still has one sender and one reader), so CallDesc omits it.
    if (checker && rb == mine_all.begin)
      ranks_call_verify(a.call, call_slots, a.rank, world, a.timeout_ns, a.abort, Kernel::PushTwoShot);
    // B. my segment: add the N contributions, keep the sum, send it to every other rank
    const size_t mine_at = size_t(a.rank) * seg;
    for (size_t j = r.begin + t; j < r.end && mine_at + j < vecs; j += kFlashThreads) {
      const Vec16 mine = canonical<T>(load_input_vector<T>(a.in, mine_at + j, a.nbytes));
      const Vec16 sum = canonical<T>(sum_ranks<T, kW>(a, parity, j, mine, Kernel::PushTwoShot));  // sent: never empty
#pragma unroll
      for (int d = 1; d < kRankLoop<kW>; ++d) {
        if (d >= world) break;
        const int p = (a.rank + d) % world;
        store_push(ranks_slot(a, world, p, parity, 1, a.rank) + j, sum);
      }
      store_output_vector<T>(a.out, mine_at + j, a.nbytes, sum);
    }
    // C. all-gather: every other rank's summed segment
    for (int d = 1; d < world; ++d) {
      const int p = (a.rank + world - d) % world;  // the rank whose sends started with me
      Vec16* from = ranks_slot(a, world, a.rank, parity, 1, p);
      const size_t at = size_t(p) * seg;
      for (size_t i = r.begin + t; i < r.end; i += size_t(kU) * kFlashThreads) {
        Vec16 v[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const size_t j = i + size_t(u) * kFlashThreads;
          if (j < r.end && at + j < vecs) v[u] = load_push(from + j);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const size_t j = i + size_t(u) * kFlashThreads;
          if (j < r.end && at + j < vecs) {
            wait_push(from + j, v[u], a.timeout_ns, a.abort, Kernel::PushTwoShot, p);
            store_output_vector<T>(a.out, at + j, a.nbytes, v[u]);
            clear_push(from + j);
          }
        }
      }
    }
    if (r.end == mine_all.end) break;
  }
}

// The fused op's exchange, by all threads of every CTA: the epoch and the call check (is_call_checker),
// the fused call's count (CTA 0's first), and vectors `chunk` of my input (the first batch
// in p already) to every other rank. Returns the call's parity.
template <typename T, int kW, int kU, typename Load>
__device__ __forceinline__ int fused_ranks_exchange(const RanksArgs& x, Vec16 (&p)[kU], Range chunk, Load input) {
  const int t = threadIdx.x;
  const int world = world_of<kW>(x);
  const bool checker = is_call_checker();
  const uint64_t call_n = checker ? x.state->call_seq + 1 : 0;
  uint32_t* call_slots = nullptr;
  const int parity = ranks_begin(x, world, checker, call_n, &call_slots);
  if (blockIdx.x == 0 && t == 0) atomicAdd(reinterpret_cast<unsigned long long*>(&x.state->fused_calls), 1ull);

  send_to_ranks<T, kW>(x, parity, p, chunk, input);
  if (checker) ranks_call_verify(x.call, call_slots, x.rank, world, x.timeout_ns, x.abort, Kernel::PushOneShot);
  return parity;
}

struct FusedRanksArgs {
  RanksArgs x;  // x.in is the input, x.nbytes = rows * row bytes; x.out unused
  RowNorm n;
};

// The fused all-reduce + residual add + RMSNorm for N ranks, one launch: push one-shot's exchange
// (the message cut into one chunk per sending CTA, sent to every other rank), then per row of mine
// (fused_work) the rank-order sum (as push one-shot returns it) and fused.cuh's epilogue.
// kRowLoadsEarly as there.
template <typename T, int kV, bool kRowLoadsEarly, int kW>
__global__ void __launch_bounds__(kFlashThreads, 1) fused_ranks_kernel(FusedRanksArgs a) {
  wait_prior_grids();
  constexpr int kU = 4;
  const int t = threadIdx.x;
  const FusedWork work = fused_work(a.n.rows, a.n.row_vecs);
  const Range chunk = work.send;
  const int first = work.row_begin < work.row_end ? work.row_begin : a.n.rows;  // a.n.rows: no row
  const Vec16* in = static_cast<const Vec16*>(a.x.in);
  const auto input = [&](size_t k) { return load_local_input(in + k); };  // rows are whole vectors
  Vec16 p[kU], w[kV], x[kV], r[kV];
  const auto load_first_row = [&] {
    load_row(w, a.n.weight, 0, a.n);
    load_row(x, a.x.in, first, a.n);
    load_row(r, a.n.residual, first, a.n);
  };
  load_batch(p, chunk.begin + t, chunk.end, input);
  if constexpr (kRowLoadsEarly) load_first_row();
  const int parity = fused_ranks_exchange<T, kW>(a.x, p, chunk, input);
  if constexpr (!kRowLoadsEarly) load_first_row();
  for (int row = first; row < work.row_end; ++row) {
    const size_t base = size_t(row) * a.n.row_vecs;
    if (row != first) {
      load_row(x, a.x.in, row, a.n);
      load_row(r, a.n.residual, row, a.n);
    }
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const int j = t + u * kFlashThreads;
      if (j < a.n.row_vecs) x[u] = sum_ranks<T, kW>(a.x, parity, base + j, canonical<T>(x[u]), Kernel::PushOneShot);
    }
    rmsnorm_row<T, kV>(a.n, row, x, r, w);
  }
}

// The spread kernel's vectors of a row slice: `count` vectors from vector `first` of `base`, this
// thread's at j = t + u * kFlashThreads. (Its own copies of fused.cuh's load_row and rmsnorm_row:
// sharing them changes the measured kernels' machine code.)
template <int kV>
__device__ __forceinline__ void load_slice(Vec16 (&v)[kV], const void* base, size_t first, int count) {
  if (base == nullptr) return;
  const Vec16* q = static_cast<const Vec16*>(base) + first;
#pragma unroll
  for (int u = 0; u < kV; ++u)
    if (threadIdx.x + u * kFlashThreads < count) v[u] = load_local_input(q + threadIdx.x + u * kFlashThreads);
}

// The epilogue on a slice (fused.cuh's rmsnorm_row): z = sum [+ residual] to residual_out, then
// z * rsqrt(row's mean square + eps), rounded, times the weight, to norm_out; `row_sq` turns this
// CTA's sum of squares into the row's. Both outputs are stored after row_sq.
template <typename T, int kV, typename RowSq>
__device__ __forceinline__ void rmsnorm_slice(const RowNorm& a, size_t first, int count, const Vec16 (&s)[kV],
                                              const Vec16 (&r)[kV], const Vec16 (&w)[kV], RowSq row_sq) {
  constexpr int kN = 16 / sizeof(T);
  float z[kV][kN];
  float sq = 0.f;
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = threadIdx.x + u * kFlashThreads;
    if (j >= count) continue;
    unpack<T>(s[u], z[u]);
    float rr[kN];
    if (a.residual) unpack<T>(r[u], rr);
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      if (a.residual) z[u][i] += rr[i];
      sq = fmaf(z[u][i], z[u][i], sq);
    }
  }
  // Both outputs stored after the cluster's sum: the release fence of its barrier waits for no
  // output store.
  const float inv_rms = rsqrtf(row_sq(block_sum(sq)) / float(a.hidden) + a.eps);
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = threadIdx.x + u * kFlashThreads;
    if (j >= count) continue;
    store_vec(static_cast<Vec16*>(a.residual_out) + first + j, pack<T>(z[u]));
    float ww[kN], o[kN];
    unpack<T>(w[u], ww);
#pragma unroll
    for (int i = 0; i < kN; ++i) o[i] = round_to<T>(z[u][i] * inv_rms) * ww[i];
    store_vec(static_cast<Vec16*>(a.norm_out) + first + j, pack<T>(o));
  }
}

// The fused op for N ranks with every row spread over a thread block cluster of S CTAs
// (YALI_DEV_RANKS_FUSED_SPREAD; grid = rows x S, cluster = S): CTA s of row r's cluster sends slice
// s of the row (split_range of its vectors) to every other rank, adds the N copies of that slice,
// and the cluster's CTAs add their sums of squares in cluster rank order through distributed shared
// memory, so every CTA of the row, on every rank, normalises with the same bits. A CTA waits only
// for its own slice, which the same CTA of every rank sends, and writes only the outputs of its
// slice, which no CTA sends: an output over the input cannot be read by a peer, and no CTA waits for
// one that is not scheduled.
template <typename T, int kV, int kW>
__global__ void __launch_bounds__(kFlashThreads, 1) fused_ranks_spread_kernel(FusedRanksArgs a) {
  namespace cg = cooperative_groups;
  wait_prior_grids();
  constexpr int kU = 4;
  __shared__ float cta_sqs[kMaxFusedSpread];  // [c]: CTA c's sum of squares, stored here by CTA c
  const cg::cluster_group cluster = cg::this_cluster();
  const int spread = int(cluster.num_blocks()), s = int(cluster.block_rank());
  const int t = threadIdx.x, row = blockIdx.x / spread;
  // "This CTA runs": a CTA stores into another's shared memory below only after every CTA of the
  // cluster has arrived here (the wait before the stores is long satisfied by then).
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  const Range slice = split_range(0, a.n.row_vecs, spread, s);
  const size_t base = size_t(row) * a.n.row_vecs;
  const Range chunk{base + slice.begin, base + slice.end};  // what this CTA sends and adds
  const Vec16* in = static_cast<const Vec16*>(a.x.in);
  const auto input = [&](size_t k) { return load_local_input(in + k); };
  Vec16 p[kU], w[kV], x[kV], r[kV];
  load_batch(p, chunk.begin + t, chunk.end, input);
  const int count = int(slice.end - slice.begin);
  load_slice(w, a.n.weight, slice.begin, count);
  load_slice(x, a.x.in, chunk.begin, count);
  load_slice(r, a.n.residual, chunk.begin, count);
  const int parity = fused_ranks_exchange<T, kW>(a.x, p, chunk, input);
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const size_t j = slice.begin + t + size_t(u) * kFlashThreads;
    if (j < slice.end) x[u] = sum_ranks<T, kW>(a.x, parity, base + j, canonical<T>(x[u]), Kernel::PushOneShot);
  }
  rmsnorm_slice<T, kV>(a.n, chunk.begin, count, x, r, w, [&](float sq) {
    // Every CTA stores its sum into slot s of every CTA's shared memory, then one cluster barrier
    // (release / acquire): after it each CTA reads only its own copies, so none waits for another
    // to finish reading before it leaves.
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // every CTA of the cluster runs
    if (t < spread) *cluster.map_shared_rank(&cta_sqs[s], t) = sq;
    cluster.sync();
    float total = 0.f;
    for (int c = 0; c < spread; ++c) total += cta_sqs[c];  // in cluster rank order: the same bits everywhere
    return total;
  });
}

}  // namespace yali
