// Fused all-reduce + residual add + RMSNorm, one launch (vLLM's
// `all_reduce -> fused_add_rms_norm` / `all_reduce -> rms_norm` pair).
//
// The exchange is flash-push (push.cuh), with two kinds of work per CTA:
//  * sending: the message is cut into one contiguous chunk per CTA, as
//    flash-push cuts it (Config::fused_cta_bytes per CTA, at most flash_ctas
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
// Above the one-launch size (Config::flash_bytes) the op runs a YALI all-reduce
// into norm_out and then add_rmsnorm_kernel, the same epilogue on its own.
#pragma once
#include "push.cuh"

namespace yali {

struct FusedArgs {
  ExchangeArgs x;         // exchange: x.in is the input, x.nbytes = rows * row bytes
  const void* sum;        // add_rmsnorm_kernel: the all-reduced input (may be norm_out)
  const void* residual;   // nullptr: no residual
  const void* weight;     // [hidden]
  void* norm_out;
  void* residual_out;     // may alias residual
  int rows;
  int row_vecs;           // 16-byte vectors per row
  int hidden;             // elements per row
  float eps;
  // CTAs per row. 1: CTA b owns rows b, b + grid, ... whole. > 1 (one-launch
  // kernel only; Rank::fused_launch keeps rows * split <= grid and split <= 32):
  // CTA b < rows * split owns part b % split of row b / split.
  int split;
};

// The vectors [begin, end) of row `row` that one CTA receives and normalises;
// `part` is its index among the row's split parts.
struct RowPart {
  int row, begin, end, part;
};

__device__ __forceinline__ RowPart row_part(const FusedArgs& a, int item) {
  if (a.split == 1) return {item, 0, a.row_vecs, 0};
  const int q = item % a.split;
  const Range r = split_range(0, size_t(a.row_vecs), a.split, q);
  return {item / a.split, int(r.begin), int(r.end), q};
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

// The sum of squares of a row split over a.split CTAs (`mine`: this CTA's part).
// Every CTA of the row publishes its part's sum in its own word of
// LocalState::row_partial, tagged with the call's epoch (tag and value in one
// 64-bit word, so they arrive together), then lane q of warp 0 takes part q's
// sum and a butterfly adds them: x + y == y + x bitwise, so every lane, every
// CTA of the row and both ranks (whose parts hold the same z) get the same bits.
// The epoch advances once per flash call; a stale word could pass the 32-bit tag
// check only if its CTA had written no split row for 2^32 calls and the first
// read after that fell exactly on the wrapped epoch. The words are reused on the
// next call only after this launch completed (griddepcontrol.wait), so no part
// is overwritten before every CTA of its row read it.
__device__ __forceinline__ float row_sum(const FusedArgs& a, const RowPart& p, uint64_t e, float mine) {
  __shared__ float s_total;
  uint64_t* words = a.x.state->row_partial + p.row * a.split;
  const uint64_t tag = uint64_t(uint32_t(e)) << 32;
  if (threadIdx.x == 0) store_relaxed_gpu(words + p.part, tag | __float_as_uint(mine));
  if (threadIdx.x < 32) {
    const int q = threadIdx.x;
    float v = 0.f;
    if (q == p.part) {
      v = mine;
    } else if (q < a.split) {
      uint64_t w = load_relaxed_gpu(words + q);
      if ((w & ~0xffffffffull) != tag) {
        const uint64_t start = global_timer_ns();
        for (uint32_t spins = 1;; ++spins) {
          w = load_relaxed_gpu(words + q);
          if ((w & ~0xffffffffull) == tag) break;
          if (a.x.timeout_ns != 0 && (spins & 1023u) == 0 && global_timer_ns() - start > a.x.timeout_ns)
            abort_kernel(a.x.abort, Kernel::FlashPush, 7, tag >> 32, w >> 32);
        }
      }
      v = __uint_as_float(uint32_t(w));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (q == 0) s_total = v;
  }
  __syncthreads();
  return s_total;
}

// The epilogue for one CTA's part of a row, called by all threads of the CTA.
// Thread t holds, for u with j = p.begin + t + u * kFlashThreads < p.end, vector
// j of the all-reduced row in s[u], of the residual row in r[u] (unused without
// a residual) and of the weight in w[u]: every load was issued before the wait
// that precedes this, so no memory latency is left in here but the stores (and,
// for a split row, the other parts' sums).
template <typename T, int kV>
__device__ __forceinline__ void rmsnorm_part(const FusedArgs& a, const RowPart& p, uint64_t e, const Vec16 (&s)[kV],
                                             const Vec16 (&r)[kV], const Vec16 (&w)[kV]) {
  constexpr int kN = 16 / sizeof(T);
  const size_t base = size_t(p.row) * a.row_vecs;
  float z[kV][kN];
  float sq = 0.f;
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = p.begin + threadIdx.x + u * kFlashThreads;
    if (j >= p.end) continue;
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
  float total = block_sum(sq);
  if (a.split > 1) total = row_sum(a, p, e, total);
  const float inv_rms = rsqrtf(total / float(a.hidden) + a.eps);
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = p.begin + threadIdx.x + u * kFlashThreads;
    if (j >= p.end) continue;
    float ww[kN], o[kN];
    unpack<T>(w[u], ww);
#pragma unroll
    for (int i = 0; i < kN; ++i) o[i] = round_to<T>(z[u][i] * inv_rms) * ww[i];
    store_vec(static_cast<Vec16*>(a.norm_out) + base + j, pack<T>(o));
  }
}

// Loads this thread's vectors of part p of the [rows, row_vecs] array at `base`
// (row 0 for the weight) into v; nothing for base == nullptr or p.row >= rows.
template <int kV>
__device__ __forceinline__ void load_part(Vec16 (&v)[kV], const void* base, int row, const RowPart& p,
                                          const FusedArgs& a) {
  if (base == nullptr || p.row >= a.rows) return;
  const Vec16* q = static_cast<const Vec16*>(base) + size_t(row) * a.row_vecs;
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = p.begin + threadIdx.x + u * kFlashThreads;
    if (j < p.end) v[u] = load_local_input(q + j);
  }
}

// kRowLoadsEarly: the weight, input and residual loads of this CTA's first part
// go out before the epoch fetch (inside a model they come from DRAM and have the
// whole wait to land), or after the send, so that they do not queue in front of
// the epoch fetch and the sent vectors of this CTA. Config::fused_row_loads_early.
template <typename T, int kV, bool kBatchPoll, bool kRowLoadsEarly>
__global__ void __launch_bounds__(kFlashThreads, 1) fused_allreduce_rmsnorm_kernel(FusedArgs a) {
  wait_prior_grids();
  constexpr int kU = 4;  // sent vectors in flight per thread
  const int t = threadIdx.x;
  const int items = a.rows * a.split;  // (row, part) pairs; CTA b owns items b, b + grid, ...
  const RowPart first = row_part(a, blockIdx.x);
  const Range chunk = split_range(0, a.x.nbytes / 16, gridDim.x, blockIdx.x);  // what this CTA sends
  const Vec16* in = static_cast<const Vec16*>(a.x.in);
  const auto input = [&](size_t k) { return load_local_input(in + k); };  // rows are whole vectors: no tail
  Vec16 p[kU], w[kV], x[kV], r[kV];
  const auto load_first_part = [&] {
    load_part(w, a.weight, 0, first, a);
    load_part(x, a.x.in, first.row, first, a);
    load_part(r, a.residual, first.row, first, a);
  };
  load_batch(p, chunk.begin + t, chunk.end, input);
  if constexpr (kRowLoadsEarly) load_first_part();
  const uint64_t e = exchange_begin(a.x);
  if (blockIdx.x == 0 && t == 0) atomicAdd(reinterpret_cast<unsigned long long*>(&a.x.state->fused_calls), 1ull);
  const size_t par = (e & 1) * a.x.parity_bytes;
  Vec16* to_peer = reinterpret_cast<Vec16*>(a.x.peer_push + par);
  Vec16* from_peer = reinterpret_cast<Vec16*>(a.x.my_push + par);

  // 1. send my chunk
  push_send<T>(to_peer, p, chunk, input);
  if constexpr (!kRowLoadsEarly) load_first_part();  // in flight while the peer's data crosses the link
  // 2. per part of mine: receive the peer's partial sums, add mine, normalise.
  //    A later row's input and residual loads go out together with its polls.
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const RowPart part = item == int(blockIdx.x) ? first : row_part(a, item);
    const size_t base = size_t(part.row) * a.row_vecs;
    if (item != int(blockIdx.x)) {
      load_part(x, a.x.in, part.row, part, a);
      load_part(r, a.residual, part.row, part, a);
    }
    Vec16 theirs[kV];
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const int j = part.begin + t + u * kFlashThreads;
      if (j < part.end) theirs[u] = load_push(from_peer + base + j);
    }
    if constexpr (kBatchPoll) {  // see wait_push_batch
      const auto at = [&](int u) -> const Vec16* {
        const int j = part.begin + t + u * kFlashThreads;
        return j < part.end ? from_peer + base + j : nullptr;
      };
      wait_push_batch(theirs, at, a.x.timeout_ns, a.x.abort, Kernel::FlashPush);
    }
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const int j = part.begin + t + u * kFlashThreads;
      if (j < part.end) {
        if constexpr (!kBatchPoll) wait_push(from_peer + base + j, theirs[u], a.x.timeout_ns, a.x.abort, Kernel::FlashPush);
        x[u] = add_vec<T>(canonical<T>(x[u]), theirs[u]);
        clear_push(from_peer + base + j);
      }
    }
    rmsnorm_part<T, kV>(a, part, e, x, r, w);
  }
}

// The epilogue alone, for messages above the one-launch size: a.sum holds the
// all-reduce output (written by the YALI all-reduce launched just before).
// Whole rows (a.split == 1).
template <typename T, int kV>
__global__ void __launch_bounds__(kFlashThreads, 1) add_rmsnorm_kernel(FusedArgs a) {
  wait_prior_grids();
  if (blockIdx.x == 0 && threadIdx.x == 0)
    atomicAdd(reinterpret_cast<unsigned long long*>(&a.x.state->fused_calls), 1ull);
  Vec16 w[kV], s[kV], r[kV];
  const RowPart whole = {int(blockIdx.x), 0, a.row_vecs, 0};
  load_part(w, a.weight, 0, whole, a);
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const RowPart part = {row, 0, a.row_vecs, 0};
    load_part(s, a.sum, row, part, a);
    load_part(r, a.residual, row, part, a);
    rmsnorm_part<T, kV>(a, part, 0, s, r, w);
  }
}

}  // namespace yali
