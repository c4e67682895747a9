// The exchange every default kernel builds on: the arguments of a launch that
// talks to the peer, the per-CTA epochs, and flash-push's sentinel-in-data
// transfer (one-way 16-byte stores into the peer's push area, polled locally).
// flash-push (push.cuh) and the fused all-reduce + RMSNorm (fused.cuh) exchange
// their data this way; stream (stream.cuh) has its own ring and flow control.
//
// Lock-step protocol (why no reset and no end barrier are needed):
//  * Every exchange call advances all kMaxFlashCtas epoch counters by one,
//    so all epochs equal the number of such calls made so far. A launch has only
//    the CTAs that carry data; its CTA 0 advances the epochs of the others (no
//    other CTA of that launch touches them, and launches on a stream are ordered).
//  * The push area alternates between two parities (epoch & 1): call e uses
//    parity e & 1; the peer can write parity e & 1 again only in call e+2, which
//    it starts after it received my data of call e+1, which I send after my
//    kernel of call e (and with it the clearing of parity e & 1) completed.
//
// Arrival is detected in the data itself ("sentinel in data", the idea of the
// Lamport buffers of TensorRT-LLM's fused all-reduce):
//  * an empty 32-bit word holds kPushEmpty (0x80008000); the whole area starts
//    that way and every reader puts kPushEmpty back into each word it consumed;
//  * a sender never sends kPushEmpty: the one word that would read as empty is
//    replaced by a neighbour value of equal or near-equal meaning (canonical(),
//    both ranks apply it to their own operand too, so results stay bitwise
//    identical on both ranks). In fp16/bf16 the word 0x80008000 is the pair
//    (-0, -0), sent as (+0, +0); in fp32 it is the denormal -4.6e-41, sent as -0.
//  * a 16-byte vector access is four single-copy-atomic 32-bit accesses, so a
//    word is either empty or final: no torn values, no separate flag.
#pragma once
#include "yali/common/call_check.cuh"

namespace yali {

struct ExchangeArgs {
  const void* in;
  void* out;
  size_t nbytes;
  int total_ctas;        // kMaxFlashCtas: epochs of CTAs [gridDim.x, total_ctas) are advanced by CTA 0
  size_t parity_bytes;   // one parity of the push area (Config::flash_bytes)
  char* my_push;         // the push area the peer writes to me (2 parities)
  char* peer_push;
  LocalState* state;
  uint64_t timeout_ns;   // YALI_TIMEOUT_S (0 = no watchdog)
  AbortRef abort;        // the abort record and this call's descriptor (layout.h)
  CallCheck call;        // this call, checked against the peer's (call_check.cuh)
};

// Advances this CTA's epoch; returns it (same value in all threads). CTA 0 also advances the
// epochs of CTAs [gridDim.x, total_ctas) and counts the launch.
__device__ __forceinline__ uint64_t advance_epochs(LocalState* state, int total_ctas) {
  __shared__ uint64_t s_epoch;
  if (threadIdx.x == 0) {
    const uint64_t e = state->flash_epoch[blockIdx.x] + 1;
    state->flash_epoch[blockIdx.x] = e;
    if (blockIdx.x == 0) atomicAdd(reinterpret_cast<unsigned long long*>(&state->calls), 1ull);  // no return: a RED, no stall
    s_epoch = e;
  }
  if (blockIdx.x == 0)
    for (int i = int(gridDim.x) + threadIdx.x; i < total_ctas; i += blockDim.x) state->flash_epoch[i] += 1;
  __syncthreads();
  return s_epoch;
}

__device__ __forceinline__ uint64_t exchange_begin(const ExchangeArgs& a) { return advance_epochs(a.state, a.total_ctas); }

// v[u] = load(k) for k = i + u * kFlashThreads < end (u < kU): one batch of kU
// independent loads, issued together so that their latencies overlap. The
// kernels that send from registers (flash-push, the fused op) load
// their first batch this way before the epoch fetch, the later ones in the loop.
template <int kU, typename Load>
__device__ __forceinline__ void load_batch(Vec16 (&v)[kU], size_t i, size_t end, Load load) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const size_t k = i + size_t(u) * kFlashThreads;
    if (k < end) v[u] = load(k);
  }
}

template <typename T>
__device__ __forceinline__ Vec16 load_input_vector(const void* in, size_t k, size_t nbytes) {
  if ((k + 1) * 16 <= nbytes) return load_local_input(static_cast<const Vec16*>(in) + k);
  Vec16 v{0, 0, 0, 0};  // the message's partial last vector
  const T* src = static_cast<const T*>(in) + k * (16 / sizeof(T));
  T* dst = reinterpret_cast<T*>(&v);
  const size_t n = nbytes / sizeof(T) - k * (16 / sizeof(T));
#pragma unroll
  for (int j = 0; j < int(16 / sizeof(T)); ++j)  // constant indices keep v in registers
    if (j < n) dst[j] = src[j];
  return v;
}

template <typename T>
__device__ __forceinline__ void store_output_vector(void* out, size_t k, size_t nbytes, const Vec16& v) {
  if ((k + 1) * 16 <= nbytes) return store_vec(static_cast<Vec16*>(out) + k, v);
  const T* src = reinterpret_cast<const T*>(&v);
  T* dst = static_cast<T*>(out) + k * (16 / sizeof(T));
  const size_t n = nbytes / sizeof(T) - k * (16 / sizeof(T));
#pragma unroll
  for (int j = 0; j < int(16 / sizeof(T)); ++j)
    if (j < n) dst[j] = src[j];
}

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
// `peer`: the rank that writes *p (N ranks; -1: the peer of a two-rank communicator).
__device__ __forceinline__ void wait_push(const Vec16* p, Vec16& v, uint64_t timeout_ns, const AbortRef& abort,
                                          Kernel kernel, int peer = -1) {
  if (push_arrived(v)) return;
  const uint64_t start = global_timer_ns();
  for (uint32_t spins = 1;; ++spins) {
    v = load_push(p);
    if (push_arrived(v)) return;
    if (timeout_ns != 0 && (spins & 1023u) == 0 && global_timer_ns() - start > timeout_ns)
      abort_waiting(abort, kernel, 6, kPushEmpty, v.x, nullptr, peer);
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
// which measured faster at 2 KiB-1 MiB and 8 MiB (current/tune/20261122-batch-poll).
template <int kU, typename At>
__device__ __forceinline__ void wait_push_batch(Vec16 (&v)[kU], At at, uint64_t timeout_ns, const AbortRef& abort,
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
      abort_waiting(abort, kernel, 6, kPushEmpty, seen);
    }
  }
}

}  // namespace yali
