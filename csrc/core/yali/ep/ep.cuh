// Expert parallelism: the dispatch and combine of a MoE layer over 2 to kMaxRanks GPUs, with the
// semantics of vLLM's all-gather / reduce-scatter manager (AgRsAll2AllManager), on YALI's push
// exchange (exchange.cuh: sentinel-in-data arrival, per-CTA epochs, call descriptors checked
// across the ranks, the watchdog).
//
//  * gather (dispatch): rank r holds T_r tokens; each of up to kEpMaxParts tensors ("parts":
//    hidden states in any dtype, fp8 bytes and their scales, top-k ids, top-k weights, ...) is
//    [T_r, row_bytes]. Every rank receives every part as [T_0 + ... + T_{N-1}, row_bytes], rank
//    r's rows from row T_0 + ... + T_{r-1} on. Rank r's message is its parts one after the
//    other, each padded to 16 bytes; it sends the message into its slot of every other rank's EP
//    push area and copies it into its own output. One NVLink trip, no counts, no atomics: every
//    rank knows every T_r (vLLM's DP metadata), so it knows what will arrive.
//  * reduce-scatter (combine): x is [T_0 + ... + T_{N-1}, hidden] of fp32, fp16 or bf16; rank r
//    receives its T_r rows summed over the ranks. Rank s sends rows of rank r into its slot of
//    rank r's EP push area; rank r adds the N copies in rank order 0, 1, ..., N - 1 in fp32 and
//    rounds once (the N-rank all-reduce's arithmetic, n_rank_exchange.cuh): bitwise the same
//    whatever the order of arrival.
//
// Sentinel words: a word 0x80008000 (kPushEmpty) is sent, and copied into the sender's own
// output, as 0x80000000 (ep_canonical). In the dtypes the callers pass (yali_vllm.communicator.
// EP_DTYPES) such a word is a pair of zeros or no valid value: bf16 / fp16 (-0, -0) becomes
// (+0, -0), fp8 e4m3 / e5m2 bytes (+0, -0, +0, -0) become (+0, +0, +0, -0), the fp32 denormal
// -4.6e-41 becomes -0, and an int32 (or an int64's high word) of -2147450880 is no token or expert
// index. Byte tensors of other meanings (int8, uint8-packed fp4 with e8m0 scales) would change
// value and are not passed. The gathered copy is otherwise bit for bit the input, on every rank.
//
// CTA b of every rank owns vectors split_range(b) of every rank's message (same grid on every
// rank, from the largest message): it sends its vectors of mine and receives its vectors of
// everyone else's, so it waits only for CTA b of the other ranks (forward progress as push
// one-shot). The slots' reuse is the N-rank push area's (n_rank_exchange.cuh): two parities, and
// every call checks every other rank's descriptor before it waits for data.
#pragma once
#include "yali/common/exchange.cuh"
#include "yali/common/n_rank_exchange.cuh"

namespace yali {

// One tensor of a gather: `in` is my [T_me, row_bytes], `out` the gathered [sum T, row_bytes].
// row_bytes and both pointers are multiples of 4; 16-byte alignment makes the copies vectors.
struct EpPart {
  const char* in;
  char* out;
  uint64_t row_bytes;
};

struct EpArgs {
  int rank;
  int world;
  int total_ctas;              // kMaxFlashCtas (advance_epochs)
  int parts;                   // gather: parts used
  EpPart part[kEpMaxParts];    // gather
  const void* rs_in;           // reduce-scatter: [sum T, hidden]
  void* rs_out;                // reduce-scatter: my [T_me, hidden]
  uint64_t rs_row_bytes;       // reduce-scatter: a row's bytes (a multiple of 16)
  uint32_t count[kMaxRanks];   // rows (tokens) of every rank
  uint32_t first[kMaxRanks];   // first row of every rank in the gathered tensors
  size_t slot_bytes;           // one rank's slot of one parity (SharedLayout::ep_slot)
  size_t push_off;             // SharedLayout::ep_push, the same in every rank's buffer
  size_t call_off;             // SharedLayout::call_slots
  char* bufs[kMaxRanks];       // every rank's shared buffer as mapped here
  LocalState* state;
  uint64_t timeout_ns;
  AbortRef abort;  // the abort record and this call's descriptor (layout.h)
  CallDesc call;
};

// Rank `from`'s slot of parity `parity` in rank `owner`'s EP push area.
__device__ __forceinline__ Vec16* ep_slot(const EpArgs& a, int owner, int parity, int from) {
  return reinterpret_cast<Vec16*>(a.bufs[owner] + a.push_off + size_t(parity * a.world + from) * a.slot_bytes);
}

// The rank that waits on `p` names it in its abort record; two ranks record the peer as -1, as
// every two-rank kernel does.
__device__ __forceinline__ int ep_who(const EpArgs& a, int p) { return a.world == 2 ? -1 : p; }

__device__ __forceinline__ uint32_t ep_canonical_word(uint32_t w) { return w != kPushEmpty ? w : 0x80000000u; }

__device__ __forceinline__ Vec16 ep_canonical(Vec16 v) {
  return {ep_canonical_word(v.x), ep_canonical_word(v.y), ep_canonical_word(v.z), ep_canonical_word(v.w)};
}

// Vector k (bytes [16k, 16k + 16)) of the n bytes at p; words past n read as 0. 16-byte aligned
// p: one vector load; else 32-bit loads (p and n multiples of 4).
__device__ __forceinline__ Vec16 ep_load(const char* p, size_t k, size_t n) {
  const char* at = p + 16 * k;
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0 && 16 * (k + 1) <= n)
    return load_local_input(reinterpret_cast<const Vec16*>(at));
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = 16 * k + 4 * (j + 1) <= n ? reinterpret_cast<const uint32_t*>(at)[j] : 0u;
  return {w[0], w[1], w[2], w[3]};
}

// Stores the words of v that fall within the n bytes at p (vector k), as ep_load reads them.
__device__ __forceinline__ void ep_store(char* p, size_t k, size_t n, const Vec16& v) {
  char* at = p + 16 * k;
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0 && 16 * (k + 1) <= n)
    return store_vec(reinterpret_cast<Vec16*>(at), v);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (16 * k + 4 * (j + 1) <= n) reinterpret_cast<uint32_t*>(at)[j] = w[j];
}

// Vectors of rank r's gather message: every part's T_r rows, padded to 16 bytes.
__device__ __forceinline__ size_t ep_message_vecs(const EpArgs& a, int r) {
  size_t v = 0;
  for (int i = 0; i < a.parts; ++i) v += (a.count[r] * a.part[i].row_bytes + 15) / 16;
  return v;
}

// Which part vector k of rank r's message falls in, and its index within that part.
struct EpAt {
  int part;
  size_t k;
  size_t bytes;  // the part's bytes in rank r's message (T_r x row_bytes)
};
__device__ __forceinline__ EpAt ep_locate(const EpArgs& a, int r, size_t k) {
  for (int i = 0;; ++i) {
    const size_t bytes = a.count[r] * a.part[i].row_bytes;
    const size_t vecs = (bytes + 15) / 16;
    if (k < vecs || i == a.parts - 1) return {i, k, bytes};
    k -= vecs;
  }
}

// The start of every EP kernel, by all threads: advances the epochs and returns the parity; the
// checker thread sends this call's descriptor to every other rank (two ranks: into the peer's
// two-rank call slots, as the two-rank kernels do, so that both kinds of call share them).
__device__ __forceinline__ int ep_begin(const EpArgs& a, bool checker, uint64_t call_n, uint32_t** slot) {
  const uint64_t e = advance_epochs(a.state, a.total_ctas);
  if (checker) {
    if (a.world == 2) {
      const CallCheck c{a.call, reinterpret_cast<uint32_t*>(a.bufs[a.rank] + a.call_off),
                        reinterpret_cast<uint32_t*>(a.bufs[1 - a.rank] + a.call_off)};
      *slot = call_begin(c, a.state, call_n);
    } else {
      *slot = ranks_call_begin(a.call, a.bufs, a.call_off, a.rank, a.world, a.state, call_n);
    }
  }
  return int(e & 1);
}

__device__ __forceinline__ void ep_verify(const EpArgs& a, uint32_t* slot, Kernel kernel) {
  if (a.world == 2) verify_slot(a.call, slot, a.timeout_ns, a.abort, kernel, -1);
  else ranks_call_verify(a.call, slot, a.rank, a.world, a.timeout_ns, a.abort, kernel);
}

// Dispatch: every part of every rank into every rank's output (see the top of this file).
__global__ void __launch_bounds__(kFlashThreads, 1) ep_gather_kernel(EpArgs a) {
  const DependentLaunchScope dependent_launch;
  constexpr int kU = 4;
  const int t = threadIdx.x;
  const bool checker = is_call_checker();
  const uint64_t call_n = checker ? a.state->call_seq + 1 : 0;
  uint32_t* call_slot = nullptr;
  const int parity = ep_begin(a, checker, call_n, &call_slot);

  // 1. my message: into my slot of every other rank, and into my own output
  const Range r = split_range(0, ep_message_vecs(a, a.rank), gridDim.x, blockIdx.x);
  for (size_t i = r.begin + t; i < r.end; i += size_t(kU) * kFlashThreads) {
    Vec16 v[kU];
    EpAt at[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t k = i + size_t(u) * kFlashThreads;
      if (k < r.end) {
        at[u] = ep_locate(a, a.rank, k);
        v[u] = ep_canonical(ep_load(a.part[at[u].part].in, at[u].k, at[u].bytes));
      }
    }
    for (int d = 1; d < a.world; ++d) {
      Vec16* to = ep_slot(a, (a.rank + d) % a.world, parity, a.rank);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const size_t k = i + size_t(u) * kFlashThreads;
        if (k < r.end) store_push(to + k, v[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t k = i + size_t(u) * kFlashThreads;
      if (k < r.end) {
        const EpPart& p = a.part[at[u].part];
        ep_store(p.out + a.first[a.rank] * p.row_bytes, at[u].k, at[u].bytes, v[u]);
      }
    }
  }
  if (checker) ep_verify(a, call_slot, Kernel::EpGather);
  // 2. every other rank's message, from my left neighbour on (the rank whose sends start with me)
  for (int d = 1; d < a.world; ++d) {
    const int p = (a.rank + a.world - d) % a.world;
    Vec16* from = ep_slot(a, a.rank, parity, p);
    const Range q = split_range(0, ep_message_vecs(a, p), gridDim.x, blockIdx.x);
    for (size_t i = q.begin + t; i < q.end; i += size_t(kU) * kFlashThreads) {
      Vec16 v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const size_t k = i + size_t(u) * kFlashThreads;
        if (k < q.end) v[u] = load_push(from + k);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const size_t k = i + size_t(u) * kFlashThreads;
        if (k < q.end) {
          wait_push(from + k, v[u], a.timeout_ns, a.abort, Kernel::EpGather, ep_who(a, p));
          const EpAt at = ep_locate(a, p, k);
          const EpPart& part = a.part[at.part];
          ep_store(part.out + a.first[p] * part.row_bytes, at.k, at.bytes, v[u]);
          clear_push(from + k);
        }
      }
    }
  }
}

// Combine: my rows of x summed over the ranks, in rank order (see the top of this file).
template <typename T>
__global__ void __launch_bounds__(kFlashThreads, 1) ep_reduce_scatter_kernel(EpArgs a) {
  const DependentLaunchScope dependent_launch;
  constexpr int kU = 4;
  const int t = threadIdx.x;
  const Vec16* x = static_cast<const Vec16*>(a.rs_in);
  const size_t row_vecs = a.rs_row_bytes / 16;
  const bool checker = is_call_checker();
  const uint64_t call_n = checker ? a.state->call_seq + 1 : 0;
  uint32_t* call_slot = nullptr;
  const int parity = ep_begin(a, checker, call_n, &call_slot);

  // 1. rank p's rows of my x into my slot of rank p, from my right neighbour on
  for (int d = 1; d < a.world; ++d) {
    const int p = (a.rank + d) % a.world;
    Vec16* to = ep_slot(a, p, parity, a.rank);
    const Vec16* src = x + a.first[p] * row_vecs;
    const Range r = split_range(0, a.count[p] * row_vecs, gridDim.x, blockIdx.x);
    for (size_t i = r.begin + t; i < r.end; i += size_t(kU) * kFlashThreads) {
      Vec16 v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const size_t k = i + size_t(u) * kFlashThreads;
        if (k < r.end) v[u] = load_local_input(src + k);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const size_t k = i + size_t(u) * kFlashThreads;
        if (k < r.end) store_push(to + k, canonical<T>(v[u]));
      }
    }
  }
  if (checker) ep_verify(a, call_slot, Kernel::EpReduceScatter);
  // 2. my rows: the N copies added in rank order
  const Vec16* mine = x + a.first[a.rank] * row_vecs;
  const Range r = split_range(0, a.count[a.rank] * row_vecs, gridDim.x, blockIdx.x);
  for (size_t k = r.begin + t; k < r.end; k += kFlashThreads) {
    const auto at = [&](int p) { return ep_slot(a, a.rank, parity, p) + k; };
    Vec16 got[kMaxRanks];
#pragma unroll
    for (int p = 0; p < kMaxRanks; ++p)  // every load first: their latencies overlap
      if (p < a.world && p != a.rank) got[p] = load_push(at(p));
    wait_ranks(got, a.rank, a.world, at, a.timeout_ns, a.abort, Kernel::EpReduceScatter);
    RankSum<T> s;
#pragma unroll
    for (int p = 0; p < kMaxRanks; ++p) {
      if (p >= a.world) break;
      if (p == a.rank) {
        s.add(canonical<T>(load_local_input(mine + k)), p == 0);
        continue;
      }
      s.add(got[p], p == 0);
      clear_push(at(p));
    }
    store_vec(static_cast<Vec16*>(a.rs_out) + k, s.result());
  }
}

}  // namespace yali
