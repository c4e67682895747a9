// Stream: the bandwidth kernel. The message is cut into chunks of at most one
// ring slot; chunk j travels on lane j % lanes (one CTA per lane). In each lane
// the CTA's first half (senders) pushes my chunks into the peer's ring slots
// with 16-byte stores over NVLink, while its second half (receivers) adds the
// peer's chunks, landed in my slots, to my input. Both GPUs do this at once, so
// both directions of the link carry data all the time.
//
// Flow control, per lane and slot, with 64-bit sequence numbers that only grow
// (so nothing is ever reset and consecutive calls cannot race):
//   ready[lane][s]  (in the receiver's memory) = g : "chunk with sequence g is in slot s"
//   credit[lane][s] (in the sender's memory)   = g : "I am done with your chunk g in slot s"
// A sender may fill slot s with sequence g only once credit >= g - slots.
// LocalState::lane_seq holds each lane's sequence across calls; both ranks
// launch identical plans, so their counters stay equal.
#pragma once
#include "yali/common/exchange.cuh"

namespace yali {

struct StreamArgs {
  const void* in;
  void* out;
  size_t nbytes;
  size_t chunk_bytes;  // multiple of 16, <= slot_bytes
  int lanes;           // = gridDim.x
  int slots;
  size_t slot_bytes;
  char* my_slots;  // lanes x slots x slot_bytes, written by the peer
  char* peer_slots;
  uint64_t* my_ready;  // [lane * kMaxSlots + s]
  uint64_t* peer_ready;
  uint64_t* my_credit;
  uint64_t* peer_credit;
  LocalState* state;
  uint64_t timeout_ns;
  AbortRef abort;  // the abort record and this call's descriptor (layout.h)
  CallCheck call;  // lane 0 checks the call against the peer's before it adds any chunk (call_check.cuh)
};

// One CTA per lane: its first half (sender warps) and second half (receiver
// warps) each move whole chunks together and meet at named barriers. (A
// variant with one independent pipeline per warp measured slower at every size:
// lab/results/tune-*.md.)
template <typename T>
__global__ void __launch_bounds__(kStreamThreads, 1) stream_kernel(StreamArgs a) {
  const DependentLaunchScope dependent_launch;
  constexpr int kGroup = kStreamThreads / 2;
  __shared__ uint64_t s_base;
  __shared__ volatile uint32_t s_sent;  // chunks my senders have finished reading (in-place safety)
  __shared__ uint32_t* s_call_slot;
  const int lane = blockIdx.x;
  if (threadIdx.x == 0) {
    s_base = a.state->lane_seq[lane];
    s_sent = 0;
    if (lane == 0) {
      a.state->calls += 1;
      s_call_slot = call_begin(a.call, a.state, a.state->call_seq + 1);  // before any chunk is sent
    }
  }
  __syncthreads();
  if (lane == 0 && threadIdx.x == kGroup)  // lane 0's first receiver, before it adds any chunk
    call_verify(a.call, s_call_slot, a.timeout_ns, a.abort, Kernel::Stream);
  const uint64_t base = s_base;
  const size_t nchunks = (a.nbytes + a.chunk_bytes - 1) / a.chunk_bytes;
  const uint32_t my_chunks = nchunks > size_t(lane) ? uint32_t((nchunks - 1 - lane) / a.lanes + 1) : 0;
  const bool sender = threadIdx.x < kGroup;
  const int t = sender ? threadIdx.x : threadIdx.x - kGroup;

  for (uint32_t k = 0; k < my_chunks; ++k) {
    const uint64_t g = base + k + 1;
    const int s = int((g - 1) % uint64_t(a.slots));
    const size_t flag = size_t(lane) * kMaxSlots + s;
    const size_t begin = (size_t(lane) + size_t(k) * a.lanes) * a.chunk_bytes;
    const size_t len = min(a.chunk_bytes, a.nbytes - begin);
    const size_t slot_off = (size_t(lane) * a.slots + s) * a.slot_bytes;
    const Range vecs{0, len / 16};
    const Tail<T> tail(len);  // only the message's last chunk can have one
    const Vec16* in = reinterpret_cast<const Vec16*>(static_cast<const char*>(a.in) + begin);

    if (sender) {
      if (t == 0 && g > uint64_t(a.slots))
        wait_flag(a.my_credit + flag, g - a.slots, a.timeout_ns, a.abort, Kernel::Stream, 3);
      group_barrier(1, kGroup);
      Vec16* dst = reinterpret_cast<Vec16*>(a.peer_slots + slot_off);
      copy_vectors<8>(dst, in, vecs, t, kGroup);
      if (t < tail.count)
        reinterpret_cast<T*>(dst)[tail.first + t] = reinterpret_cast<const T*>(in)[tail.first + t];
      group_barrier(1, kGroup);
      if (t == 0) {
        store_release_sys(a.peer_ready + flag, g);
        s_sent = k + 1;
      }
    } else {
      if (t == 0) {
        wait_flag(a.my_ready + flag, g, a.timeout_ns, a.abort, Kernel::Stream, 4);
        while (s_sent < k + 1) {  // in-place: my senders must have read this chunk first
        }
      }
      group_barrier(2, kGroup);
      const Vec16* theirs = reinterpret_cast<const Vec16*>(a.my_slots + slot_off);
      Vec16* out = reinterpret_cast<Vec16*>(static_cast<char*>(a.out) + begin);
      reduce_vectors<T, 8>(out, nullptr, in, theirs, vecs, t, kGroup);
      if (t < tail.count) {
        const size_t i = tail.first + t;
        reinterpret_cast<T*>(out)[i] = Elem<T>::add(reinterpret_cast<const T*>(in)[i],
                                                    reinterpret_cast<const volatile T*>(theirs)[i]);
      }
      group_barrier(2, kGroup);
      if (t == 0) store_release_sys(a.peer_credit + flag, g);  // orders my reads of the slot before it
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) a.state->lane_seq[lane] = base + my_chunks;
}

}  // namespace yali
