// Fused all-reduce + residual add + RMSNorm, one launch (vLLM's
// `all_reduce -> fused_add_rms_norm` / `all_reduce -> rms_norm` pair).
//
// The exchange is flash-push (push.cuh) with rows as the unit of work: CTA b
// owns rows b, b + grid, ... on both ranks, sends them all, then for each row
// receives the peer's copy, adds, and normalises the row while it is still in
// registers. Per element, with s the all-reduce output as a plain all-reduce
// returns it (fp32 sum rounded to T):
//   z = float(s) + float(residual)          (z = float(s) without a residual)
//   residual_out = T(z)
//   norm_out = T(float(T(z * rsqrt(mean(z^2) + eps))) * float(weight))
// which is the arithmetic of vLLM's reference fused_add_rms_norm / rms_norm
// (vllm/ir/ops/layernorm.py). mean(z^2) is a fixed-order block reduction, so
// both ranks produce identical bits.
//
// Above the one-launch size (Config::flash_bytes) the op runs a YALI all-reduce
// into norm_out and then add_rmsnorm_kernel, the same epilogue on its own.
//
// With Config::fused_cluster = C > 1 (an experiment, off by default) a row is
// split over the C CTAs of a thread-block cluster instead of one CTA, so a few
// tokens spread their NVLink stores and polls over C SMs; the row's sum of
// squares is then each CTA's block sum, added in cluster-rank order through
// distributed shared memory (the same order on both ranks: identical bits).
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
  int cluster;            // CTAs per row (a thread-block cluster when > 1)
};

// Which 16-byte vectors of a row this CTA owns: all of them, or its cluster
// rank's contiguous share when a row is split over a cluster.
struct RowSlice {
  int group, groups;  // row groups: rows group, group + groups, ...
  int begin, end;     // vectors [begin, end) of each row
};

__device__ __forceinline__ RowSlice row_slice(const FusedArgs& a) {
  const int c = a.cluster;
  const int rank = c > 1 ? int(cooperative_groups::this_cluster().block_rank()) : 0;
  const int per = (a.row_vecs + c - 1) / c;
  const int begin = min(a.row_vecs, rank * per);
  return {int(blockIdx.x) / c, int(gridDim.x) / c, begin, min(a.row_vecs, begin + per)};
}

// The row's total from each CTA's part, in cluster-rank order (c == 1: the part).
__device__ __forceinline__ float cluster_sum(float part, int c) {
  if (c == 1) return part;
  __shared__ float s_part;
  auto cluster = cooperative_groups::this_cluster();
  if (threadIdx.x == 0) s_part = part;
  cluster.sync();
  float total = 0.f;
  for (int r = 0; r < c; ++r) total += *cluster.map_shared_rank(&s_part, r);
  cluster.sync();  // every CTA has read every part before the next row overwrites them
  return total;
}

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

// The epilogue for one row, called by all threads of the CTA (and of its
// cluster). Thread t holds, for u with j = sl.begin + t + u * kFlashThreads <
// sl.end, vector j of the all-reduced row in s[u], of the residual row in r[u]
// (unused without a residual) and of the weight in w[u]: every load was issued
// before the wait that precedes this, so no memory latency is left in here but
// the stores.
template <typename T, int kV>
__device__ __forceinline__ void rmsnorm_row(const FusedArgs& a, int row, const Vec16 (&s)[kV], const Vec16 (&r)[kV],
                                            const Vec16 (&w)[kV], const RowSlice& sl) {
  constexpr int kN = 16 / sizeof(T);
  const int t = threadIdx.x;
  const size_t base = size_t(row) * a.row_vecs;
  float z[kV][kN];
  float sq = 0.f;
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = sl.begin + t + u * kFlashThreads;
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
  const float inv_rms = rsqrtf(cluster_sum(block_sum(sq), a.cluster) / float(a.hidden) + a.eps);
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = sl.begin + t + u * kFlashThreads;
    if (j >= sl.end) continue;
    float ww[kN], o[kN];
    unpack<T>(w[u], ww);
#pragma unroll
    for (int i = 0; i < kN; ++i) o[i] = round_to<T>(z[u][i] * inv_rms) * ww[i];
    store_vec(static_cast<Vec16*>(a.norm_out) + base + j, pack<T>(o));
  }
}

// Loads this thread's vectors of a row slice into v: the row starts at
// `row_start`; nullptr (no such array, or no row) loads nothing.
template <int kV>
__device__ __forceinline__ void load_slice(Vec16 (&v)[kV], const void* row_start, const RowSlice& sl) {
  if (row_start == nullptr) return;
  const Vec16* p = static_cast<const Vec16*>(row_start);
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = sl.begin + threadIdx.x + u * kFlashThreads;
    if (j < sl.end) v[u] = load_local_input(p + j);
  }
}

// Row `row` of the [rows, row_vecs] array at `base`; nullptr for no array or no such row.
__device__ __forceinline__ const void* row_start(const void* base, int row, const FusedArgs& a) {
  if (base == nullptr || row >= a.rows) return nullptr;
  return static_cast<const Vec16*>(base) + size_t(row) * a.row_vecs;
}

template <typename T, int kV>
__global__ void __launch_bounds__(kFlashThreads, 1) fused_allreduce_rmsnorm_kernel(FusedArgs a) {
  wait_prior_grids();
  const int t = threadIdx.x;
  const RowSlice sl = row_slice(a);
  const int first = sl.group;  // this CTA's first row (>= rows: it has none)
  // Every load the first row needs is issued before the epoch fetch: all of
  // them are independent, and inside a model the residual and the weight are
  // usually not in L2 any more (the GEMM before this streamed its weights
  // through it), so loading them after the peer's data arrived would put two
  // DRAM latencies on the critical path. x stays in registers for the add.
  Vec16 w[kV], x[kV], r[kV];
  load_slice(w, first < a.rows ? a.weight : nullptr, sl);
  load_slice(x, row_start(a.f.in, first, a), sl);
  load_slice(r, row_start(a.residual, first, a), sl);
  const uint64_t e = flash_begin(a.f);
  if (blockIdx.x == 0 && t == 0) atomicAdd(reinterpret_cast<unsigned long long*>(&a.f.state->fused_calls), 1ull);
  const size_t par = (e & 1) * a.f.parity_bytes;
  Vec16* to_peer = reinterpret_cast<Vec16*>(a.f.peer_push + par);
  Vec16* from_peer = reinterpret_cast<Vec16*>(a.f.my_push + par);

  // 1. send all my rows (my slice of them); the first one is in registers
  for (int row = first; row < a.rows; row += sl.groups) {
    const size_t base = size_t(row) * a.row_vecs;
    Vec16 v[kV];
    if (row == first) {
#pragma unroll
      for (int u = 0; u < kV; ++u) v[u] = x[u];
    } else {
      load_slice(v, row_start(a.f.in, row, a), sl);
    }
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const int j = sl.begin + t + u * kFlashThreads;
      if (j < sl.end) store_push(to_peer + base + j, canonical<T>(v[u]));
    }
  }
  // 2. per row: receive the peer's partial sums, add mine, normalise. A later
  //    row's input and residual loads are issued together with its first polls.
  for (int row = first; row < a.rows; row += sl.groups) {
    const size_t base = size_t(row) * a.row_vecs;
    Vec16 theirs[kV];
    if (row != first) {
      load_slice(x, row_start(a.f.in, row, a), sl);
      load_slice(r, row_start(a.residual, row, a), sl);
    }
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const int j = sl.begin + t + u * kFlashThreads;
      if (j < sl.end) theirs[u] = load_push(from_peer + base + j);
    }
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const int j = sl.begin + t + u * kFlashThreads;
      if (j < sl.end) {
        wait_push(from_peer + base + j, theirs[u], a.f.timeout_ns, a.f.abort, Kernel::FlashPush);
        x[u] = add_vec<T>(canonical<T>(x[u]), theirs[u]);
        clear_push(from_peer + base + j);
      }
    }
    rmsnorm_row<T, kV>(a, row, x, r, w, sl);
  }
}

// The epilogue alone, for messages above the one-launch size: a.sum holds the
// all-reduce output (written by the YALI all-reduce launched just before).
template <typename T, int kV>
__global__ void __launch_bounds__(kFlashThreads, 1) add_rmsnorm_kernel(FusedArgs a) {
  wait_prior_grids();
  if (blockIdx.x == 0 && threadIdx.x == 0)
    atomicAdd(reinterpret_cast<unsigned long long*>(&a.f.state->fused_calls), 1ull);
  const RowSlice sl{0, 1, 0, a.row_vecs};  // launched with a.cluster == 1: a CTA per row
  Vec16 w[kV], s[kV], r[kV];
  load_slice(w, int(blockIdx.x) < a.rows ? a.weight : nullptr, sl);
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    load_slice(s, row_start(a.sum, row, a), sl);
    load_slice(r, row_start(a.residual, row, a), sl);
    rmsnorm_row<T, kV>(a, row, s, r, w, sl);
  }
}

}  // namespace yali
