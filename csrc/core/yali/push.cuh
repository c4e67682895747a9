// Flash-push: the latency kernel for small and medium messages, and the data
// exchange of the fused all-reduce + RMSNorm (fused.cuh).
//
// Each rank writes its input straight into the peer's push area with 16-byte
// stores over NVLink and then polls its own push area until the peer's data is
// there: one one-way NVLink trip, no staging copy, no flag words and no flag
// round trip. Arrival is detected in the data itself ("sentinel in data", the
// idea of the Lamport buffers of TensorRT-LLM's fused all-reduce):
//  * an empty 32-bit word holds kPushEmpty (0x80008000); the whole area starts
//    that way and every reader puts kPushEmpty back into each word it consumed;
//  * a sender never sends kPushEmpty: the one word that would read as empty is
//    replaced by a neighbour value of equal or near-equal meaning (canonical(),
//    both ranks apply it to their own operand too, so results stay bitwise
//    identical on both ranks). In fp16/bf16 the word 0x80008000 is the pair
//    (-0, -0), sent as (+0, +0); in fp32 it is the denormal -4.6e-41, sent as -0.
//  * a 16-byte vector access is four single-copy-atomic 32-bit accesses, so a
//    word is either empty or final: no torn values, no separate flag.
//
// Buffer reuse is the flash two-parity argument (flash.cuh): call e uses parity
// e & 1; the peer can write parity e & 1 again only in call e+2, which it starts
// after it received my data of call e+1, which I send after my kernel of call e
// (and with it the clearing of parity e & 1) completed.
#pragma once
#include "flash.cuh"

namespace yali {

constexpr uint32_t kPushEmpty = 0x80008000u;

template <typename T>
__device__ __forceinline__ uint32_t canonical_word(uint32_t w) {
  return w != kPushEmpty ? w : (sizeof(T) == 4 ? 0x80000000u : 0u);
}

template <typename T>
__device__ __forceinline__ Vec16 canonical(Vec16 v) {
  return {canonical_word<T>(v.x), canonical_word<T>(v.y), canonical_word<T>(v.z), canonical_word<T>(v.w)};
}

__device__ __forceinline__ bool push_arrived(const Vec16& v) {
  return v.x != kPushEmpty && v.y != kPushEmpty && v.z != kPushEmpty && v.w != kPushEmpty;
}

// Remote store into the peer's push area. Volatile (= relaxed, system scope):
// the store must become visible to the polling peer without any later fence.
__device__ __forceinline__ void store_push(Vec16* p, const Vec16& v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Poll of my own push area, which the peer writes over NVLink: never from L1.
__device__ __forceinline__ Vec16 load_push(const Vec16* p) {
  Vec16 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void clear_push(Vec16* p) { store_vec(p, Vec16{kPushEmpty, kPushEmpty, kPushEmpty, kPushEmpty}); }

// Spins until every word of *p arrived (v holds a first load already).
__device__ __forceinline__ void wait_push(const Vec16* p, Vec16& v, uint64_t timeout_ns, AbortInfo* abort,
                                          Kernel kernel) {
  if (push_arrived(v)) return;
  const uint64_t start = global_timer_ns();
  for (uint32_t spins = 1;; ++spins) {
    v = load_push(p);
    if (push_arrived(v)) return;
    if (timeout_ns != 0 && (spins & 1023u) == 0 && global_timer_ns() - start > timeout_ns)
      abort_kernel(abort, kernel, 6, kPushEmpty, v.x);
  }
}

// Sends this thread's vectors of r (r.begin + t, + kFlashThreads, ...) into the
// peer's push area, kU at a time: v holds the first batch already (loaded before
// the epoch fetch), `load` fetches the later ones. Both operands are made
// canonical on both ranks (see canonical()), so the sums stay bitwise equal.
template <typename T, int kU, typename Load>
__device__ __forceinline__ void push_send(Vec16* to_peer, Vec16 (&v)[kU], Range r, Load load) {
  const int t = threadIdx.x;
  for (size_t i = r.begin + t; i < r.end; i += size_t(kU) * kFlashThreads) {
    if (i != r.begin + t) load_batch(v, i, r.end, load);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t k = i + size_t(u) * kFlashThreads;
      if (k < r.end) store_push(to_peer + k, canonical<T>(v[u]));
    }
  }
}

// Spins until every vector u of a thread's batch arrived; at(u) is its address
// in my push area (nullptr: the batch has no vector u) and v[u] holds a first
// load of it. Each round re-loads every vector still empty before it looks at
// any of them, so a thread's polls overlap and it sees its last vector about one
// L2 round trip after that lands. wait_push() one vector after the other costs
// up to one round trip per vector whose first load came too early, but it
// re-loads nothing that was not needed. The fused op uses this from
// Config::fused_batch_poll_min on; flash-push waits one vector at a time,
// which measured faster at 2 KiB-1 MiB and 8 MiB (tune-20261122-r6).
template <int kU, typename At>
__device__ __forceinline__ void wait_push_batch(Vec16 (&v)[kU], At at, uint64_t timeout_ns, AbortInfo* abort,
                                                Kernel kernel) {
  const auto all_arrived = [&] {
    bool all = true;
#pragma unroll
    for (int u = 0; u < kU; ++u) all &= at(u) == nullptr || push_arrived(v[u]);
    return all;
  };
  if (all_arrived()) return;
  const uint64_t start = global_timer_ns();
  for (uint32_t spins = 1;; ++spins) {
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (at(u) != nullptr && !push_arrived(v[u])) v[u] = load_push(at(u));
    if (all_arrived()) return;
    if (timeout_ns != 0 && (spins & 1023u) == 0 && global_timer_ns() - start > timeout_ns) {
      uint32_t seen = kPushEmpty;
#pragma unroll
      for (int u = kU - 1; u >= 0; --u)
        if (at(u) != nullptr && !push_arrived(v[u])) seen = v[u].x;
      abort_kernel(abort, kernel, 6, kPushEmpty, seen);
    }
  }
}

// out = in(rank 0) + in(rank 1). CTA b owns vectors split_range(b) on both
// ranks: it sends them, then receives the peer's copies of the same vectors.
template <typename T>
__global__ void __launch_bounds__(kFlashThreads, 1) flash_push_kernel(FlashArgs a) {
  wait_prior_grids();
  constexpr int kU = 4;  // vectors in flight per thread
  const int t = threadIdx.x;
  const Range r = split_range(0, (a.nbytes + 15) / 16, gridDim.x, blockIdx.x);
  const auto input = [&](size_t k) { return load_input_vector<T>(a.in, k, a.nbytes); };
  Vec16 v[kU];
  load_batch(v, r.begin + t, r.end, input);  // while thread 0 fetches the epoch
  const bool checker = blockIdx.x == 0 && t == kFlashThreads - 1;  // idle at small sizes
  const uint64_t call_n = checker ? a.state->call_seq + 1 : 0;     // overlaps the epoch fetch
  const uint64_t e = flash_begin(a);
  const size_t par = (e & 1) * a.parity_bytes;
  Vec16* to_peer = reinterpret_cast<Vec16*>(a.peer_push + par);
  Vec16* from_peer = reinterpret_cast<Vec16*>(a.my_push + par);
  uint32_t* call_slot = checker ? call_begin(a.call, a.state, call_n) : nullptr;

  // 1. send everything first: the link is busy while we wait below
  push_send<T>(to_peer, v, r, input);
  if (checker) call_verify(a.call, call_slot, a.timeout_ns, a.abort, Kernel::FlashPush);
  // 2. receive, add, give the words back (the input is re-read: it is in L2)
  for (size_t i = r.begin + t; i < r.end; i += size_t(kU) * kFlashThreads) {
    Vec16 theirs[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t k = i + size_t(u) * kFlashThreads;
      if (k < r.end) {
        theirs[u] = load_push(from_peer + k);
        v[u] = load_input_vector<T>(a.in, k, a.nbytes);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t k = i + size_t(u) * kFlashThreads;
      if (k < r.end) {
        wait_push(from_peer + k, theirs[u], a.timeout_ns, a.abort, Kernel::FlashPush);
        store_output_vector<T>(a.out, k, a.nbytes, add_vec<T>(canonical<T>(v[u]), theirs[u]));
        clear_push(from_peer + k);
      }
    }
  }
}

}  // namespace yali
