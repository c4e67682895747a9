// Every call is checked across the ranks: before a kernel uses the peer's data, it knows that the
// peer is running the same call (op, kernel, bytes, dtype, CTAs, hidden size: CallDesc). Two calls
// that differ would otherwise complete with wrong values whenever they fill the same 16-byte
// vectors or chunks, or wait for data that never comes.
//
// Per call, one thread of the launch (the "checker", is_call_checker below):
//  1. call_begin: advances LocalState::call_seq (n) and stores this rank's descriptor into the
//     peer's slot n & 1 with one 16-byte store over NVLink, before any data is sent;
//  2. call_verify, before it waits for any of the peer's data: waits until the peer's descriptor
//     is in my slot n & 1 (arrival is seen in the words themselves, as flash-push sees its data:
//     kCallEmpty marks an empty word and no descriptor word is ever kCallEmpty), compares it with
//     mine, and gives the slot back (kCallEmpty). A difference traps at once on both ranks (each
//     compares), recording both descriptors; the host names both calls (Rank::abort_message).
// The other CTAs never wait for the check: a trap ends the whole launch, and a launch whose
// descriptor matches loses nothing. The checker's wait overlaps the wait for data, which the peer
// sends after its descriptor.
//
// Two slots suffice by the flash-push parity argument: the peer writes slot n & 1 again in its
// call n + 2, which starts after its call n + 1 completed, which needed my descriptor of call
// n + 1, which I send after my call n (and with it my clearing of slot n & 1) completed.
//
// The same chain orders the reuse of every receive buffer (the push area, the stream slots, the
// descriptor slots): my call n clears the words the peer wrote (weak stores, any thread) -> my
// kernel ends -> my call n + 1's checker stores its descriptor -> the peer's checker sees it -> the
// peer's call n + 1 ends, which needs its checker -> the peer's call n + 2 writes those words
// again. What makes my clearing visible before the peer's rewrite is the kernel boundary (a
// finished kernel's stores are in my GPU's L2) and that every peer reaches my memory through that
// same L2, the property the Lamport buffers of TensorRT-LLM and FlashInfer rest on too. A
// system-scope release fence before the descriptor store and an acquire load after it would make
// it an order of CUDA's memory model instead; measured, the pair costs 1.4 us per 2 KiB call at two
// ranks (2.56 -> 3.98 us) and 1.6 us at four (3.41 -> 5.04 us)
// (lab/results/current/allreduce/20261126-tp4-h100-release-fence, lab/DESIGN_LOG.md), half
// the whole exchange, so the kernels do not issue it.
#pragma once
#include "yali/common/kernel_common.cuh"

namespace yali {

// The checker is the last thread of the last CTA. Its wait for the peers' descriptors delays the
// work of its own thread, and through the CTA's barriers that of its CTA, so it sits where there is
// the least. A fused kernel's last CTA owns no row whenever the launch has more CTAs than rows (at
// two ranks every token count up to 64 but 32 of hidden 4096); CTA 0's last thread owns vectors
// of row 0, which CTA 0 normalises together, and as that thread the check cost the two-rank fused
// op 0.5-1.3 us at 1-16 tokens, here 0-0.25 us (current/fused/20261128-tp2-h200-call-check). A
// flash-push CTA holds fewer vectors than its kFlashThreads threads below 1 MiB (Config::
// push_cta_bytes, 1 KiB per CTA up to kMaxFlashCtas CTAs), and so does a slice of the N-rank spread
// kernel at hidden 8192 and 4 CTAs a row (256 vectors): there the last thread holds none.
__device__ __forceinline__ bool is_call_checker() {
  return blockIdx.x == gridDim.x - 1 && threadIdx.x == blockDim.x - 1;
}

struct CallCheck {
  CallDesc desc;         // this call
  uint32_t* my_slots;    // [2][4]: the peer's descriptors land here
  uint32_t* peer_slots;  // [2][4] in the peer's buffer
};

__device__ __forceinline__ void store_call(uint32_t* p, const CallDesc& d) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(d.w[0]), "r"(d.w[1]), "r"(d.w[2]), "r"(d.w[3]) : "memory");
}

__device__ __forceinline__ CallDesc load_call(const uint32_t* p) {
  CallDesc d;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(d.w[0]), "=r"(d.w[1]), "=r"(d.w[2]), "=r"(d.w[3]) : "l"(p) : "memory");
  return d;
}

__device__ __forceinline__ bool call_arrived(const CallDesc& d) {
  return d.w[0] != kCallEmpty && d.w[1] != kCallEmpty && d.w[2] != kCallEmpty && d.w[3] != kCallEmpty;
}

// Step 1, by the checker thread, with n = LocalState::call_seq + 1 (loaded early by the caller, so
// that the load overlaps the kernel's other start-up loads). Returns my slot of this call.
__device__ __forceinline__ uint32_t* call_begin(const CallCheck& c, LocalState* state, uint64_t n) {
  state->call_seq = n;
  const int slot = int(n & 1);
  store_call(c.peer_slots + 4 * slot, c.desc);
  return c.my_slots + 4 * slot;
}

// Waits for the descriptor in `slot` (the peer's, or rank `peer`'s with N ranks; `v` holds a first
// load of it), compares it with mine, and gives the slot back.
__device__ __forceinline__ void verify_loaded(const CallDesc& mine, uint32_t* slot, CallDesc v, uint64_t timeout_ns,
                                              const AbortRef& abort, Kernel kernel, int peer) {
  if (!call_arrived(v)) {
    const uint64_t start = global_timer_ns();
    for (uint32_t spins = 1;; ++spins) {
      v = load_call(slot);
      if (call_arrived(v)) break;
      if (timeout_ns != 0 && (spins & 1023u) == 0 && global_timer_ns() - start > timeout_ns)
        abort_waiting(abort, kernel, 8, 0, 0, nullptr, peer);
    }
  }
  if (v.w[0] != mine.w[0] || v.w[1] != mine.w[1] || v.w[2] != mine.w[2] || v.w[3] != mine.w[3])
    abort_waiting(abort, kernel, 9, 0, 0, &v, peer);
  store_call(slot, CallDesc{{kCallEmpty, kCallEmpty, kCallEmpty, kCallEmpty}});
}

__device__ __forceinline__ void verify_slot(const CallDesc& mine, uint32_t* slot, uint64_t timeout_ns,
                                            const AbortRef& abort, Kernel kernel, int peer) {
  verify_loaded(mine, slot, load_call(slot), timeout_ns, abort, kernel, peer);
}

// Step 2, by the same thread (or one that synchronised with it since).
__device__ __forceinline__ void call_verify(const CallCheck& c, uint32_t* slot, uint64_t timeout_ns,
                                            const AbortRef& abort, Kernel kernel) {
  verify_slot(c.desc, slot, timeout_ns, abort, kernel, -1);
}

// N ranks (n_rank_exchange.cuh): the same check with every other rank. Each rank's buffer holds
// slots [2][world][4]: rank r's descriptor of call n lands in [n & 1][r]. The checker stores mine
// into every other rank's buffer, then waits for, compares and gives back every other rank's, in
// rank order. The two-slot argument holds per pair of ranks as above: every rank's call n + 1 waits
// for every other rank's descriptor of call n + 1.
__device__ __forceinline__ uint32_t* ranks_call_slot(char* buf, size_t off, int parity, int rank, int world) {
  return reinterpret_cast<uint32_t*>(buf + off) + 4 * (parity * world + rank);
}

// Step 1 for N ranks; returns my slots of this call ([world][4], slot [r] for rank r).
__device__ __forceinline__ uint32_t* ranks_call_begin(const CallDesc& d, char* const* bufs, size_t off, int me,
                                                      int world, LocalState* state, uint64_t n) {
  state->call_seq = n;
  const int parity = int(n & 1);
  for (int p = 0; p < world; ++p)
    if (p != me) store_call(ranks_call_slot(bufs[p], off, parity, me, world), d);
  return ranks_call_slot(bufs[me], off, parity, 0, world);
}

// Step 2 for N ranks: every other rank's slot is loaded first, so that the N - 1 loads of memory
// the peers wrote overlap (one round trip, not N - 1), then each is checked in rank order.
__device__ __forceinline__ void ranks_call_verify(const CallDesc& d, uint32_t* mine, int me, int world,
                                                  uint64_t timeout_ns, const AbortRef& abort, Kernel kernel) {
  CallDesc v[kMaxRanks];
#pragma unroll
  for (int p = 0; p < kMaxRanks; ++p)
    if (p < world && p != me) v[p] = load_call(mine + 4 * p);
#pragma unroll
  for (int p = 0; p < kMaxRanks; ++p)
    if (p < world && p != me) verify_loaded(d, mine + 4 * p, v[p], timeout_ns, abort, kernel, p);
}

}  // namespace yali
