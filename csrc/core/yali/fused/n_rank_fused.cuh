// The N-rank fused all-reduce + residual add + RMSNorm (world sizes 3 to kMaxRanks; two ranks use
// fused.cuh): the exchange of push one-shot (common/n_rank_exchange.cuh, the arithmetic and buffer
// reuse of the N-rank all-reduce); a CTA owns whole rows as in fused.cuh (fused_work: it waits only
// for chunks that CTAs of its own cluster or an earlier one send, on every rank), adds the N copies
// of each row it owns and runs the fused op's epilogue (rmsnorm_row) on the sum, or a thread block
// cluster spreads every row (fused_ranks_spread_kernel).
#pragma once
#include <cooperative_groups.h>

#include "yali/common/n_rank_exchange.cuh"
#include "yali/fused/fused.cuh"

namespace yali {

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
  QuantOut q;   // the quantising instances (kQ != None): the FP8 output; n.norm_out unused
};

// The fused all-reduce + residual add + RMSNorm for N ranks, one launch: push one-shot's exchange
// (the message cut into one chunk per sending CTA, sent to every other rank), then per row of mine
// (fused_work) the rank-order sum (as push one-shot returns it) and fused.cuh's epilogue.
// kRowLoadsEarly as there.
// kQ != None: the quantising op (quant.cuh), a.q its FP8 output.
template <typename T, int kV, bool kRowLoadsEarly, int kW, QuantScheme kQ = QuantScheme::None>
__global__ void __launch_bounds__(kFlashThreads, 1) fused_ranks_kernel(FusedRanksArgs a) {
  const DependentLaunchScope dependent_launch;
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
    if constexpr (kQ == QuantScheme::None) rmsnorm_row<T, kV>(a.n, row, x, r, w);
    else rmsnorm_row<T, kV, kQ>(a.n, row, x, r, w, &a.q);
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
// kQ != None: the slice is quantised (quant.cuh) into *q instead, after `row_max` turned this CTA's
// max into the row's (PerToken), and residual_out (nullptr: not stored) after that; `row` is the
// row, `row_first` the slice's first vector in it, `writes_row_scale`: this CTA stores its scale.
template <typename T, int kV, typename RowSq, QuantScheme kQ = QuantScheme::None, typename RowMax = RowSq>
__device__ __forceinline__ void rmsnorm_slice(const RowNorm& a, size_t first, int count, const Vec16 (&s)[kV],
                                              const Vec16 (&r)[kV], const Vec16 (&w)[kV], RowSq row_sq,
                                              const QuantOut* q = nullptr, int row = 0, int row_first = 0,
                                              bool writes_row_scale = false, RowMax* row_max = nullptr) {
  float static_inv = 0.f;  // Static: 1 / scale, as vLLM's static_scaled_fp8_quant computes it
  if constexpr (kQ == QuantScheme::Static) static_inv = __fdiv_rn(1.f, *q->scale);
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
  if constexpr (kQ != QuantScheme::None) {
    quantize_row<T, kV, kQ>(*q, row, first, row_first, count, z, w, inv_rms, static_inv, writes_row_scale, *row_max,
                            static_cast<Vec16*>(a.residual_out));
  } else {
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
}

// The fused op for N ranks with every row spread over a thread block cluster of S CTAs
// (YALI_DEV_RANKS_FUSED_SPREAD; grid = rows x S, cluster = S): CTA s of row r's cluster sends slice
// s of the row (split_range of its vectors) to every other rank, adds the N copies of that slice,
// and the cluster's CTAs add their sums of squares in cluster rank order through distributed shared
// memory, so every CTA of the row, on every rank, normalises with the same bits. A CTA waits only
// for its own slice, which the same CTA of every rank sends, and writes only the outputs of its
// slice, which no CTA sends: an output over the input cannot be read by a peer, and no CTA waits for
// one that is not scheduled.
// kQ != None: the quantising op (quant.cuh), a.q its FP8 output; PerToken adds the cluster's maxima
// as it adds the sums of squares, after a second cluster barrier; the group scheme needs slices of
// whole groups (the launch sees to it).
template <typename T, int kV, int kW, QuantScheme kQ = QuantScheme::None>
__global__ void __launch_bounds__(kFlashThreads, 1) fused_ranks_spread_kernel(FusedRanksArgs a) {
  namespace cg = cooperative_groups;
  const DependentLaunchScope dependent_launch;
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
  const auto row_sq = [&](float sq) {
    // Every CTA stores its sum into slot s of every CTA's shared memory, then one cluster barrier
    // (release / acquire): after it each CTA reads only its own copies, so none waits for another
    // to finish reading before it leaves.
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // every CTA of the cluster runs
    if (t < spread) *cluster.map_shared_rank(&cta_sqs[s], t) = sq;
    cluster.sync();
    float total = 0.f;
    for (int c = 0; c < spread; ++c) total += cta_sqs[c];  // in cluster rank order: the same bits everywhere
    return total;
  };
  if constexpr (kQ == QuantScheme::None) {
    rmsnorm_slice<T, kV>(a.n, chunk.begin, count, x, r, w, row_sq);
  } else {
    __shared__ float cta_maxes[kMaxFusedSpread];  // [c]: CTA c's max of |y|, stored here by CTA c
    auto row_max = [&](float m) {
      // m is this thread's max: first the CTA's (block_max), then as row_sq, into slots of their
      // own: every CTA has passed the first barrier, and reads its maxima only after the second.
      const float mine = block_max(m);
      if (t < spread) *cluster.map_shared_rank(&cta_maxes[s], t) = mine;
      cluster.sync();
      float top = 0.f;
      for (int c = 0; c < spread; ++c) top = fmaxf(top, cta_maxes[c]);
      return top;
    };
    rmsnorm_slice<T, kV, decltype(row_sq), kQ>(a.n, chunk.begin, count, x, r, w, row_sq, &a.q, row,
                                                int(slice.begin), s == 0, &row_max);
  }
}

}  // namespace yali
