// Fused all-reduce + residual add + RMSNorm, one launch (vLLM's
// `all_reduce -> fused_add_rms_norm` / `all_reduce -> rms_norm` pair).
//
// The exchange is flash-push's (exchange.cuh), with two kinds of work per CTA
// (fused_work, the same for the N-rank whole-row kernel in n_rank_fused.cuh):
//  * sending: the message is cut into one contiguous chunk per sending CTA, as
//    flash-push cuts it (the plan gives FusedLaunch::cta_bytes per CTA, at most
//    kMaxFlashCtas CTAs), and every CTA stores its chunk into the peer's push area.
//    One SM alone cannot keep many NVLink stores in flight: a 32 KiB flash-push
//    sent 16 KiB per CTA took 4.00 us against 3.12 us at 1 KiB per CTA (tune r4),
//    and this split took the fused op at 1 token from 4.12 to 3.85 us.
//  * receiving: a CTA owns whole rows: it polls the peer's copy of each of its
//    rows in its own push area (local memory), adds its input, and normalises the
//    row while it is in registers. Only the owner reads a row's words, so it
//    alone gives them back (clears them) after reading.
// Forward progress with few free SMs: the CTAs of a launch reach the SMs in index
// order (with clusters, cluster after cluster, the CTAs of one together), and
// another kernel may hold all other SMs. So a CTA waits only for chunks that the
// peer's CTAs of its own cluster or an earlier one send (without clusters: of an
// index up to its own), which are running or done whenever it runs: a row belongs
// to the cluster of the CTA that sends its last vector, within that cluster to
// the CTA that sends its first vector, or to the cluster's first CTA when that
// one lies in an earlier cluster. Without clusters that is the CTA of the row's
// last vector: CTA b owns the rows that end in its chunk. The checker of the call
// (is_call_checker: the last CTA) waits for the peer's last CTA. When a launch
// without clusters has more CTAs than rows, its last CTA sends nothing, so that
// it owns no row and the check delays no row. tests/core/test_progress_order_cpu.py
// checks the rule over the whole launch table.
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
#include "yali/common/exchange.cuh"
#include "yali/fused/quant.cuh"

namespace yali {

// The epilogue's operands (also those of the N-rank fused kernel, n_rank_fused.cuh).
struct RowNorm {
  const void* residual;   // nullptr: no residual
  const void* weight;     // [hidden]
  void* norm_out;
  void* residual_out;     // may alias residual
  int rows;
  int row_vecs;           // 16-byte vectors per row
  int hidden;             // elements per row
  float eps;
};

struct FusedArgs {
  ExchangeArgs x;         // exchange: x.in is the input, x.nbytes = rows * row bytes
  const void* sum;        // add_rmsnorm_kernel: the all-reduced input (may be norm_out)
  RowNorm n;
  QuantOut q;             // the quantising instances (kQ != None): the FP8 output; n.norm_out unused
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

// The epilogue for one row, called by all threads of the CTA that owns it.
// Thread t holds, for u with j = t + u * kFlashThreads < row_vecs, vector j of
// the all-reduced row in s[u], of the residual row in r[u] (unused without a
// residual) and of the weight in w[u]: every load was issued before the wait
// that precedes this, so no memory latency is left in here but the stores.
// kQ != None: the row is quantised (quant.cuh) into *q instead of being stored as norm_out, and
// residual_out may be nullptr (not stored).
template <typename T, int kV, QuantScheme kQ = QuantScheme::None>
__device__ __forceinline__ void rmsnorm_row(const RowNorm& a, int row, const Vec16 (&s)[kV], const Vec16 (&r)[kV],
                                            const Vec16 (&w)[kV], const QuantOut* q = nullptr) {
  constexpr int kN = 16 / sizeof(T);
  const size_t base = size_t(row) * a.row_vecs;
  float static_inv = 0.f;  // Static: 1 / scale, as vLLM's static_scaled_fp8_quant computes it
  if constexpr (kQ == QuantScheme::Static) static_inv = __fdiv_rn(1.f, *q->scale);
  float z[kV][kN];
  float sq = 0.f;
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = threadIdx.x + u * kFlashThreads;
    if (j >= a.row_vecs) continue;
    unpack<T>(s[u], z[u]);
    if (a.residual) {
      float rr[kN];
      unpack<T>(r[u], rr);
#pragma unroll
      for (int i = 0; i < kN; ++i) z[u][i] += rr[i];
    }
    if constexpr (kQ == QuantScheme::None) store_vec(static_cast<Vec16*>(a.residual_out) + base + j, pack<T>(z[u]));
    else if (a.residual_out) store_vec(static_cast<Vec16*>(a.residual_out) + base + j, pack<T>(z[u]));
#pragma unroll
    for (int i = 0; i < kN; ++i) sq = fmaf(z[u][i], z[u][i], sq);
  }
  const float inv_rms = rsqrtf(block_sum(sq) / float(a.hidden) + a.eps);
  if constexpr (kQ != QuantScheme::None) {
    quantize_row<T, kV, kQ>(*q, row, base, 0, a.row_vecs, z, w, inv_rms, static_inv, true,
                            [](float m) { return block_max(m); }, nullptr);
  } else {
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const int j = threadIdx.x + u * kFlashThreads;
      if (j >= a.row_vecs) continue;
      float ww[kN], o[kN];
      unpack<T>(w[u], ww);
#pragma unroll
      for (int i = 0; i < kN; ++i) o[i] = round_to<T>(z[u][i] * inv_rms) * ww[i];
      store_vec(static_cast<Vec16*>(a.norm_out) + base + j, pack<T>(o));
    }
  }
}

// Loads this thread's vectors of row `row` of the [rows, row_vecs] array at
// `base` (row 0 for the weight) into v; nothing for base == nullptr or a CTA
// that owns no row (row >= rows).
template <int kV>
__device__ __forceinline__ void load_row(Vec16 (&v)[kV], const void* base, int row, const RowNorm& a) {
  if (base == nullptr || row >= a.rows) return;
  const Vec16* q = static_cast<const Vec16*>(base) + size_t(row) * a.row_vecs;
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = threadIdx.x + u * kFlashThreads;
    if (j < a.row_vecs) v[u] = load_local_input(q + j);
  }
}

// What one CTA of a whole-row fused kernel does (the rule is in the header):
// `send`, the vectors of the message it sends; rows [row_begin, row_end), the
// rows it owns (none when row_begin >= row_end). Computed once per CTA in 32-bit
// arithmetic: a message of at most YALI_DEV_FLASH_BYTES has fewer than 2^32 vectors.
struct FusedWork {
  Range send;
  int row_begin, row_end;
};

__device__ __forceinline__ FusedWork fused_work(int rows, int row_vecs) {
  uint32_t cluster = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(cluster));  // 1 without clusters
#endif
  const uint32_t grid = gridDim.x, b = blockIdx.x, rv = uint32_t(row_vecs);
  const uint32_t senders = cluster == 1 && uint32_t(rows) < grid ? grid - 1 : grid;
  const uint32_t vecs = uint32_t(rows) * rv;
  const uint32_t per = (vecs + senders - 1) / senders;  // split_range's cut over the senders
  const auto at = [&](uint32_t i) { return uint32_t(min(size_t(vecs), size_t(per) * i)); };  // chunk i's start
  const uint32_t first = b - b % cluster;  // my cluster's first CTA
  const uint32_t row_begin = b == first ? at(first) / rv : (at(b) + rv - 1) / rv;
  const uint32_t row_end = min((at(b + 1) + rv - 1) / rv, at(first + cluster) / rv);
  return {{at(b), at(b + 1)}, int(row_begin), int(row_end)};
}

// kRowLoadsEarly: the weight, input and residual loads of this CTA's first row
// go out before the epoch fetch (inside a model they come from DRAM and have the
// whole wait to land), or after the send, so that they do not queue in front of
// the epoch fetch and the sent vectors of this CTA. FusedLaunch::row_loads_early.
// kQ != None: the quantising op (quant.cuh), a.q its FP8 output.
template <typename T, int kV, bool kBatchPoll, bool kRowLoadsEarly, QuantScheme kQ = QuantScheme::None>
__global__ void __launch_bounds__(kFlashThreads, 1) fused_allreduce_rmsnorm_kernel(FusedArgs a) {
  const DependentLaunchScope dependent_launch;
  constexpr int kU = 4;  // sent vectors in flight per thread
  const int t = threadIdx.x;
  const FusedWork work = fused_work(a.n.rows, a.n.row_vecs);
  const Range chunk = work.send;
  const int first = work.row_begin < work.row_end ? work.row_begin : a.n.rows;  // a.n.rows: no row
  const Vec16* in = static_cast<const Vec16*>(a.x.in);
  const auto input = [&](size_t k) { return load_local_input(in + k); };  // rows are whole vectors: no tail
  Vec16 p[kU], w[kV], x[kV], r[kV];
  const auto load_first_row = [&] {
    load_row(w, a.n.weight, 0, a.n);
    load_row(x, a.x.in, first, a.n);
    load_row(r, a.n.residual, first, a.n);
  };
  load_batch(p, chunk.begin + t, chunk.end, input);
  if constexpr (kRowLoadsEarly) load_first_row();
  const bool checker = is_call_checker();
  const uint64_t call_n = checker ? a.x.state->call_seq + 1 : 0;  // overlaps the epoch fetch
  const uint64_t e = exchange_begin(a.x);
  if (blockIdx.x == 0 && t == 0) atomicAdd(reinterpret_cast<unsigned long long*>(&a.x.state->fused_calls), 1ull);
  const size_t par = (e & 1) * a.x.parity_bytes;
  Vec16* to_peer = reinterpret_cast<Vec16*>(a.x.peer_push + par);
  Vec16* from_peer = reinterpret_cast<Vec16*>(a.x.my_push + par);
  uint32_t* call_slot = checker ? call_begin(a.x.call, a.x.state, call_n) : nullptr;

  // 1. send my chunk
  push_send<T>(to_peer, p, chunk, input);
  if (checker) call_verify(a.x.call, call_slot, a.x.timeout_ns, a.x.abort, Kernel::FlashPush);
  if constexpr (!kRowLoadsEarly) load_first_row();  // in flight while the peer's data crosses the link
  // 2. per row of mine: receive the peer's partial sums, add mine, normalise.
  //    A later row's input and residual loads go out together with its polls.
  for (int row = first; row < work.row_end; ++row) {
    const size_t base = size_t(row) * a.n.row_vecs;
    if (row != first) {
      load_row(x, a.x.in, row, a.n);
      load_row(r, a.n.residual, row, a.n);
    }
    Vec16 theirs[kV];
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const int j = t + u * kFlashThreads;
      if (j < a.n.row_vecs) theirs[u] = load_push(from_peer + base + j);
    }
    if constexpr (kBatchPoll) {  // see wait_push_batch
      const auto at = [&](int u) -> const Vec16* {
        const int j = t + u * kFlashThreads;
        return j < a.n.row_vecs ? from_peer + base + j : nullptr;
      };
      wait_push_batch(theirs, at, a.x.timeout_ns, a.x.abort, Kernel::FlashPush);
    }
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const int j = t + u * kFlashThreads;
      if (j < a.n.row_vecs) {
        if constexpr (!kBatchPoll) wait_push(from_peer + base + j, theirs[u], a.x.timeout_ns, a.x.abort, Kernel::FlashPush);
        x[u] = add_vec<T>(canonical<T>(x[u]), theirs[u]);
        clear_push(from_peer + base + j);
      }
    }
    if constexpr (kQ == QuantScheme::None) rmsnorm_row<T, kV>(a.n, row, x, r, w);
    else rmsnorm_row<T, kV, kQ>(a.n, row, x, r, w, &a.q);
  }
}

// The epilogue alone, for messages above the one-launch size: a.sum holds the
// all-reduce output (written by the YALI all-reduce launched just before).
template <typename T, int kV, QuantScheme kQ = QuantScheme::None>
__global__ void __launch_bounds__(kFlashThreads, 1) add_rmsnorm_kernel(FusedArgs a) {
  const DependentLaunchScope dependent_launch;
  if (blockIdx.x == 0 && threadIdx.x == 0)
    atomicAdd(reinterpret_cast<unsigned long long*>(&a.x.state->fused_calls), 1ull);
  Vec16 w[kV], s[kV], r[kV];
  load_row(w, a.n.weight, 0, a.n);
  for (int row = blockIdx.x; row < a.n.rows; row += gridDim.x) {
    load_row(s, a.sum, row, a.n);
    load_row(r, a.n.residual, row, a.n);
    if constexpr (kQ == QuantScheme::None) rmsnorm_row<T, kV>(a.n, row, s, r, w);
    else rmsnorm_row<T, kV, kQ>(a.n, row, s, r, w, &a.q);
  }
}

}  // namespace yali
