// Fused all-reduce + residual add + RMSNorm, one launch (vLLM's
// `all_reduce -> fused_add_rms_norm` / `all_reduce -> rms_norm` pair).
//
// The exchange is flash-push (push.cuh), with two kinds of work per CTA:
//  * sending: the message is cut into one contiguous chunk per CTA, exactly as
//    flash-push cuts it (Config::push_cta_bytes per CTA, at most flash_ctas
//    CTAs), and every CTA stores its chunk into the peer's push area. One SM
//    alone cannot keep many NVLink stores in flight: a 32 KiB flash-push sent
//    16 KiB per CTA took 4.00 us against 3.12 us at 1 KiB per CTA (tune r4),
//    and this split took the fused op at 1 token from 4.12 to 3.85 us.
//  * receiving: CTA b owns rows b, b + grid, ...: it polls the peer's copy of a
//    whole row in its own push area (local memory), adds its input, and
//    normalises the row while it is in registers. Only the owner reads a row's
//    words, so it alone gives them back (clears them) after reading.
// Per element, with s the all-reduce output as a plain all-reduce returns it
// (fp32 sum rounded to T):
//   z = float(s) + float(residual)          (z = float(s) without a residual)
//   residual_out = T(z)
//   norm_out = T(float(T(z * rsqrt(mean(z^2) + eps))) * float(weight))
// which is the arithmetic of vLLM's reference fused_add_rms_norm / rms_norm
// (vllm/ir/ops/layernorm.py). mean(z^2) is a fixed-order block reduction, so
// both ranks produce identical bits.
//
// Split rows (Config::fused_cluster = C > 1, Hopper thread block clusters):
// one CTA per row puts a whole row's receive and epilogue traffic through one SM
// (at hidden 8192 bf16 about 100 KiB of L2 loads and stores per row: the peer's
// row, input, residual, weight, the clears and both outputs), which is the
// difference between the fused op and a plain flash-push of the same bytes
// (1.1-1.8 us at 1-32 tokens). With C > 1 a cluster of C CTAs owns rows k,
// k + clusters, ... and CTA q of the cluster receives and normalises slice q of
// each (split_range of the row's vectors); the C partial sums of squares meet in
// distributed shared memory (cluster_sum). Sending is cut exactly as above.
//
// Above the one-launch size (Config::flash_bytes) the op runs a YALI all-reduce
// into norm_out and then add_rmsnorm_kernel, the same epilogue on its own.
#pragma once
#include <cooperative_groups.h>

#include "push.cuh"

namespace yali {

struct FusedArgs {
  FlashArgs f;            // exchange: f.in is the input, f.nbytes = rows * row bytes
  const void* sum;        // add_rmsnorm_kernel: the all-reduced input (may be norm_out)
  const void* residual;   // nullptr: no residual
  const void* weight;     // [hidden]
  void* norm_out;
  void* residual_out;     // may alias residual
  int rows;
  int row_vecs;           // 16-byte vectors per row
  int hidden;             // elements per row
  float eps;
};

// The vectors [begin, end) of a row that one CTA receives and normalises: the
// whole row, or its cluster slice (split rows).
struct RowSlice {
  int begin, end;
};

// Sum of v over the CTA, the same bits in every thread and on both ranks
// (butterfly within warps, then warp sums added in warp order).
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[kFlashThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  __syncthreads();  // the previous row's readers are done with warp_sums
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kFlashThreads / 32; ++w) total += warp_sums[w];
  return total;
}

// Cluster barrier halves (all threads of every CTA of the cluster; sm_90+).
// arrive releases this thread's earlier stores (shared::cluster ones included)
// unless relaxed; wait returns once every thread of the cluster arrived, and
// acquires what they released.
__device__ __forceinline__ void cluster_arrive(bool relaxed = false) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (relaxed) asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  else asm volatile("barrier.cluster.arrive.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}

// Sum of v over all threads of the cluster, the same bits in every CTA and on
// both ranks: each CTA's block_sum goes into slot [round & 1][its rank] of every
// CTA of the cluster (distributed shared memory), one cluster barrier, then
// every CTA adds the slots in rank order. Two sets of slots: a CTA writes set
// `round & 1` again in round + 2, after passing the barrier of round + 1, which
// every CTA reaches only after it read its slots of `round`. Remote shared
// memory may be written only once its CTA runs: the kernel arrives (relaxed) at
// its start and round 0 waits for everyone's arrival before its first write.
__device__ __forceinline__ float cluster_sum(float v, int round) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ float partials[2][kMaxFusedCluster];
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const float mine = block_sum(v);
  const unsigned n = cluster.num_blocks();
  float* slots = partials[round & 1];
  if (round == 0) cluster_wait();  // every CTA of the cluster has started (the arrive at the top)
  if (threadIdx.x < n) *cluster.map_shared_rank(slots + cluster.block_rank(), threadIdx.x) = mine;
  cluster_arrive();
  cluster_wait();
  float total = 0.f;
  for (unsigned q = 0; q < n; ++q) total += slots[q];
  return total;
#else
  return block_sum(v);  // never launched: clusters need sm_90 (Rank checks)
#endif
}

// The epilogue for one row, called by all threads of the CTA. Thread t holds,
// for u with j = s.begin + t + u * kFlashThreads < s.end, vector j of the
// all-reduced row in x[u], of the residual row in r[u] (unused without a
// residual) and of the weight in w[u]: every load was issued before the wait
// that precedes this, so no memory latency is left in here but the stores.
// row_sum(v) returns the sum of v over every thread that holds part of the row
// (block_sum, or cluster_sum when a cluster splits the row).
template <typename T, int kV, typename RowSum>
__device__ __forceinline__ void rmsnorm_row(const FusedArgs& a, int row, RowSlice sl, const Vec16 (&s)[kV],
                                            const Vec16 (&r)[kV], const Vec16 (&w)[kV], RowSum row_sum) {
  constexpr int kN = 16 / sizeof(T);
  const size_t base = size_t(row) * a.row_vecs;
  float z[kV][kN];
  float sq = 0.f;
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = sl.begin + threadIdx.x + u * kFlashThreads;
    if (j >= sl.end) continue;
    unpack<T>(s[u], z[u]);
    if (a.residual) {
      float rr[kN];
      unpack<T>(r[u], rr);
#pragma unroll
      for (int i = 0; i < kN; ++i) z[u][i] += rr[i];
    }
    store_vec(static_cast<Vec16*>(a.residual_out) + base + j, pack<T>(z[u]));
#pragma unroll
    for (int i = 0; i < kN; ++i) sq = fmaf(z[u][i], z[u][i], sq);
  }
  const float inv_rms = rsqrtf(row_sum(sq) / float(a.hidden) + a.eps);
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = sl.begin + threadIdx.x + u * kFlashThreads;
    if (j >= sl.end) continue;
    float ww[kN], o[kN];
    unpack<T>(w[u], ww);
#pragma unroll
    for (int i = 0; i < kN; ++i) o[i] = round_to<T>(z[u][i] * inv_rms) * ww[i];
    store_vec(static_cast<Vec16*>(a.norm_out) + base + j, pack<T>(o));
  }
}

// Loads this thread's vectors of slice sl of row `row` of the [rows, row_vecs]
// array at `base` into v; nothing for base == nullptr or row >= rows.
template <int kV>
__device__ __forceinline__ void load_row(Vec16 (&v)[kV], const void* base, int row, RowSlice sl, const FusedArgs& a) {
  if (base == nullptr || row >= a.rows) return;
  const Vec16* p = static_cast<const Vec16*>(base) + size_t(row) * a.row_vecs;
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = sl.begin + threadIdx.x + u * kFlashThreads;
    if (j < sl.end) v[u] = load_local_input(p + j);
  }
}

// This CTA's rank in its cluster and the number of CTAs of its cluster (split
// rows; clusters are 1-D, so cluster i is CTAs i * size ... i * size + size - 1).
__device__ __forceinline__ int cluster_ctas() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return int(cooperative_groups::this_cluster().num_blocks());
#else
  return 1;
#endif
}

__device__ __forceinline__ int cluster_cta_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return int(cooperative_groups::this_cluster().block_rank());
#else
  return 0;
#endif
}

// kSplitRows: launched in clusters, each cluster sharing its rows (see the top
// of this file); otherwise CTA b owns rows b, b + grid, ... whole.
template <typename T, int kV, bool kBatchPoll = false, bool kSplitRows = false>
__global__ void __launch_bounds__(kFlashThreads, 1) fused_allreduce_rmsnorm_kernel(FusedArgs a) {
  wait_prior_grids();
  constexpr int kU = 4;  // sent vectors in flight per thread
  const int t = threadIdx.x;
  const int ctas_per_row = kSplitRows ? cluster_ctas() : 1;
  const int first = blockIdx.x / ctas_per_row;        // this CTA's first row (none when >= rows)
  const int row_step = gridDim.x / ctas_per_row;      // rows first, first + row_step, ...
  RowSlice sl{0, a.row_vecs};                         // the vectors of each of those rows it owns
  if constexpr (kSplitRows) {
    const Range q = split_range(0, a.row_vecs, ctas_per_row, cluster_cta_rank());
    sl = RowSlice{int(q.begin), int(q.end)};
  }
  const Range chunk = split_range(0, a.f.nbytes / 16, gridDim.x, blockIdx.x);  // what this CTA sends
  const Vec16* in = static_cast<const Vec16*>(a.f.in);
  const auto input = [&](size_t k) { return load_local_input(in + k); };  // rows are whole vectors: no tail
  // Every load is issued before the epoch fetch: they are independent, and
  // inside a model the residual and the weight are usually not in L2 any more
  // (the GEMM before this streamed its weights through it), so loading them
  // after the peer's data arrived would put DRAM latencies on the critical path.
  if constexpr (kSplitRows) cluster_arrive(/*relaxed=*/true);  // "this CTA runs" (see cluster_sum)
  Vec16 p[kU], w[kV], x[kV], r[kV];
  load_batch(p, chunk.begin + t, chunk.end, input);
  load_row(w, first < a.rows ? a.weight : nullptr, 0, sl, a);
  load_row(x, a.f.in, first, sl, a);
  load_row(r, a.residual, first, sl, a);
  const uint64_t e = flash_begin(a.f);
  if (blockIdx.x == 0 && t == 0) atomicAdd(reinterpret_cast<unsigned long long*>(&a.f.state->fused_calls), 1ull);
  const size_t par = (e & 1) * a.f.parity_bytes;
  Vec16* to_peer = reinterpret_cast<Vec16*>(a.f.peer_push + par);
  Vec16* from_peer = reinterpret_cast<Vec16*>(a.f.my_push + par);

  // 1. send my chunk
  push_send<T>(to_peer, p, chunk, input);
  // 2. per row of mine: receive the peer's partial sums, add mine, normalise.
  //    A later row's input and residual loads go out together with its polls.
  //    (All CTAs of a cluster walk the same rows: the same rounds of cluster_sum.)
  int round = 0;
  for (int row = first; row < a.rows; row += row_step, ++round) {
    const size_t base = size_t(row) * a.row_vecs;
    if (row != first) {
      load_row(x, a.f.in, row, sl, a);
      load_row(r, a.residual, row, sl, a);
    }
    Vec16 theirs[kV];
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const int j = sl.begin + t + u * kFlashThreads;
      if (j < sl.end) theirs[u] = load_push(from_peer + base + j);
    }
    if constexpr (kBatchPoll) {  // see wait_push_batch
      const auto at = [&](int u) -> const Vec16* {
        const int j = sl.begin + t + u * kFlashThreads;
        return j < sl.end ? from_peer + base + j : nullptr;
      };
      wait_push_batch(theirs, at, a.f.timeout_ns, a.f.abort, Kernel::FlashPush);
    }
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const int j = sl.begin + t + u * kFlashThreads;
      if (j < sl.end) {
        if constexpr (!kBatchPoll) wait_push(from_peer + base + j, theirs[u], a.f.timeout_ns, a.f.abort, Kernel::FlashPush);
        x[u] = add_vec<T>(canonical<T>(x[u]), theirs[u]);
        clear_push(from_peer + base + j);
      }
    }
    if constexpr (kSplitRows)
      rmsnorm_row<T, kV>(a, row, sl, x, r, w, [round](float v) { return cluster_sum(v, round); });
    else
      rmsnorm_row<T, kV>(a, row, sl, x, r, w, [](float v) { return block_sum(v); });
  }
  if constexpr (kSplitRows)
    if (round == 0) cluster_wait();  // a cluster with no rows: complete the start barrier's phase
}

// The epilogue alone, for messages above the one-launch size: a.sum holds the
// all-reduce output (written by the YALI all-reduce launched just before).
template <typename T, int kV>
__global__ void __launch_bounds__(kFlashThreads, 1) add_rmsnorm_kernel(FusedArgs a) {
  wait_prior_grids();
  if (blockIdx.x == 0 && threadIdx.x == 0)
    atomicAdd(reinterpret_cast<unsigned long long*>(&a.f.state->fused_calls), 1ull);
  const RowSlice whole{0, a.row_vecs};
  Vec16 w[kV], s[kV], r[kV];
  load_row(w, int(blockIdx.x) < a.rows ? a.weight : nullptr, 0, whole, a);
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    load_row(s, a.sum, row, whole, a);
    load_row(r, a.residual, row, whole, a);
    rmsnorm_row<T, kV>(a, row, whole, s, r, w, [](float v) { return block_sum(v); });
  }
}

}  // namespace yali
