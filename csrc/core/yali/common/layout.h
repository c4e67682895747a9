// Byte layout of the buffer each rank allocates once and shares with its peers
// by CUDA IPC. The peer writes the push area, the stream flag words and the
// stream slots (remote stores over NVLink); with more than two ranks, every other
// rank writes its slots of the N-rank push area and of the call slots instead.
#pragma once
#include <cstddef>
#include <cstdint>

#include "yali/common/config.h"
#include "yali/common/plan.h"

namespace yali {

// What one call is, as both ranks must agree on it: built on the host (communicator.cu: call_desc), sent
// to the peer by every default kernel and compared there (call_check.cuh). Every word keeps bit
// 31 clear, so no descriptor word ever equals kCallEmpty.
//   w[0], w[1]: message bytes, low and high 31 bits
//   w[2]: op (bits 0-1: 1 all-reduce, 2 fused all-reduce + RMSNorm, 3 expert parallelism) | kernel (bits 2-5) |
//         dtype (bits 6-7) | CTAs or lanes of the launch (bits 8-19)
//   w[3]: the fused op's hidden size (0 for a plain all-reduce); expert parallelism: a 31-bit
//         digest of every rank's token count and the parts' row bytes (ep.cu: ep_digest)
struct CallDesc {
  uint32_t w[4];
};
constexpr uint32_t kCallEmpty = 0xffffffffu;
enum class CallOp : uint32_t { AllReduce = 1, Fused = 2, Ep = 3 };

// The descriptor of a call (the words above); `w3` is the fused op's hidden size or the EP digest.
inline CallDesc call_desc(CallOp op, Kernel kernel, size_t nbytes, DType dtype, int ctas, size_t w3) {
  CallDesc d;
  d.w[0] = uint32_t(nbytes & 0x7fffffffu);
  d.w[1] = uint32_t((nbytes >> 31) & 0x7fffffffu);
  d.w[2] = uint32_t(op) | (uint32_t(kernel) & 0xfu) << 2 | (uint32_t(dtype) & 0x3u) << 6 | (uint32_t(ctas) & 0xfffu) << 8;
  d.w[3] = uint32_t(w3 & 0x7fffffffu);
  return d;
}

struct SharedLayout {
  // Flag words, 8 bytes each, written only by the peer, polled only locally.
  size_t stream_ready;   // [kMaxLanes * kMaxSlots]  "slot holds my chunk with sequence g"
  size_t stream_credit;  // [kMaxLanes * kMaxSlots]  "I consumed your chunk with sequence g"
  size_t call_slots;     // [2][4] 32-bit words: the peer's descriptor of its current call (call_check.cuh);
                         // kCallEmpty wherever no unread descriptor is. N ranks: [2][N][4], rank r's in [.][r]
  // Data areas.
  size_t flash_push;     // 2 parities x flash_bytes: flash-push / fused data, written by the peer;
                         // holds kPushEmpty words wherever no unread data is (see exchange.cuh)
  size_t stream_slots;   // lanes x slots x slot_bytes: the peer's chunks land here
  size_t ranks_push;     // N ranks (n_rank_exchange.cuh): 2 parities x 2 phases x N x ranks_slot_bytes,
                         // written by the other ranks (rank r into slot r); kPushEmpty wherever no
                         // unread data is
  size_t ranks_slot;     // ranks_slot_bytes(c, world); 0 with two ranks
  size_t ep_push;        // expert parallelism (ep.cuh): 2 parities x N x ep_slot, rank r writes slot r;
                         // kPushEmpty wherever no unread data is
  size_t ep_slot;        // Config::ep_slot_bytes (0: no EP area)
  size_t total;

  // `world` ranks: two use the two-rank areas (flash-push, stream), more use only the N-rank push
  // area and the N-rank call slots (every other area takes no bytes).
  explicit SharedLayout(const Config& c, int world = 2) {
    const size_t pair = world == 2 ? 1 : 0;                   // 0: the two-rank areas take no bytes
    size_t off = 0;
    auto take = [&off](size_t bytes) {
      size_t at = off;
      off = (off + bytes + 255) / 256 * 256;  // keep every area 256-byte aligned
      return at;
    };
    stream_ready = take(pair * sizeof(uint64_t) * kMaxLanes * kMaxSlots);
    stream_credit = take(pair * sizeof(uint64_t) * kMaxLanes * kMaxSlots);
    call_slots_bytes = 2 * size_t(pair ? 1 : world) * sizeof(CallDesc);
    call_slots = take(call_slots_bytes);
    flags_end = off;
    flash_push = take(pair * 2 * c.flash_bytes);
    stream_slots = take(pair * size_t(kStreamLanes) * kStreamSlots * c.slot_bytes);
    ranks_slot = pair ? 0 : ranks_slot_bytes(c, world);
    ranks_push = take(2 * 2 * size_t(world) * ranks_slot);
    ep_slot = c.ep_slot_bytes;
    ep_push = take(2 * size_t(world) * ep_slot);  // after ranks_push: the Rank fills both with kPushEmpty
    total = off;
  }
  size_t flags_end;  // [0, flags_end) must be zeroed before the peer may write
  size_t call_slots_bytes;  // all ones before the peer may write (call_check.cuh: kCallEmpty)
};

// State only the owning GPU touches; it persists across calls and is advanced
// by the kernels themselves, which is what makes every call CUDA-graph safe.
struct LocalState {
  uint64_t flash_epoch[kMaxFlashCtas];  // per flash CTA; all advance together every flash call
  uint64_t lane_seq[kMaxLanes];         // chunks each stream lane has sent (= received)
  uint64_t calls;                       // YALI kernel launches that ran (graph replays included)
  uint64_t fused_calls;                 // fused all-reduce + RMSNorm operations that ran
  uint64_t call_seq;      // calls made so far (every kernel that checks its call advances it)
  uint32_t abort_claim;   // 0 until a thread claims the abort record (one writer per record)
};

// Written by a kernel that gave up waiting for its peer, read by the host after
// the launch failed (host-mapped, so it survives the aborted context).
struct AbortInfo {
  uint32_t magic;  // kAbortMagic once filled
  int32_t kernel;  // Kernel enum
  int32_t block;
  int32_t what;    // 3 = stream credit, 4 = stream ready (1, 2, 5: the retired kernels' waits),
                   // 6 = flash-push data, 8 = the peer's call descriptor, 9 = the ranks' calls differ
  uint64_t expected;
  uint64_t seen;
  CallDesc mine;    // this rank's call: the one whose kernel gave up (AbortRef::call)
  CallDesc theirs;  // the peer's call (what = 9), or its unread descriptor; kCallEmpty words: none seen
  // Set by the host before any launch: where abort_kernel finds the abort claim and the peer's
  // descriptors (device pointers), and the communicator's size.
  const LocalState* state;
  const uint32_t* call_slots;
  int32_t world;
  int32_t peer;  // the rank waited for or disagreeing (-1: the peer of a two-rank communicator)
};
constexpr uint32_t kAbortMagic = 0x59414c49;  // "YALI"

// What every wait of a kernel carries for the case it gives up: the record to fill and this call's
// descriptor, from the launch's own arguments. Whichever CTA gives up names this call, whether or
// not the CTA that checks the call (call_check.cuh: the last one) has run.
struct AbortRef {
  AbortInfo* record;
  CallDesc call;
};

// An empty 32-bit word of a push area (exchange.cuh): what a wait for pushed data sees until the
// data arrives.
constexpr uint32_t kPushEmpty = 0x80008000u;

}  // namespace yali
