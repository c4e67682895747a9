// The kernels of the copy-engine overlap (overlap.h says how they fit together): the slot
// claim and the chunk flag (one thread each, on the side stream) and the consumer (all-reduce
// sum + residual add + RMSNorm, per chunk as its flag arrives, on the main stream).
#pragma once
#include "fused.cuh"
#include "overlap.h"

namespace yali {

struct OverlapSendArgs {
  OverlapState* state;
  const uint64_t* my_credit;  // [2] in my buffer, stored by the peer's consumer
  uint64_t* peer_ready;       // [2][kOverlapMaxChunks] in the peer's buffer
  int slot;
  int chunk;
  uint64_t timeout_ns;
  AbortInfo* abort;
};

// Before the first copy of a call into the peer's slot: wait until the peer consumed every
// earlier call I sent there, then count this one (its flags carry the count).
__global__ void overlap_claim_kernel(OverlapSendArgs a) {
  const uint64_t n = a.state->sends[a.slot] + 1;
  wait_flag(a.my_credit + a.slot, n - 1, a.timeout_ns, a.abort, Kernel::None, kOverlapWaitCredit);
  a.state->sends[a.slot] = n;
}

// After a chunk's copy (stream-ordered: the copy completed before this kernel starts): the
// chunk's flag in the peer's buffer, with the call's count read from the device.
__global__ void overlap_flag_kernel(OverlapSendArgs a) {
  const uint64_t n = a.state->sends[a.slot];
  __threadfence_system();
  store_release_sys(a.peer_ready + a.slot * kOverlapMaxChunks + a.chunk, n);
}

struct OverlapConsumeArgs {
  FusedArgs a;             // the epilogue's arguments: a.sum is my partial
  const void* theirs;      // my receive slot: the peer's partial, same row layout
  const uint64_t* ready;   // my ready flags of this slot [kOverlapMaxChunks]
  uint64_t* peer_credit;   // the peer's credit word of this slot
  OverlapState* state;
  int slot;
  int chunk_rows;
  uint64_t timeout_ns;
  AbortInfo* abort;
};

// CTA b owns rows b, b + grid, ... (in order, so chunks are waited for in order). The
// all-reduce sum is add_vec (fp32 sum rounded once to T, commutative: both ranks get the same
// bits), then fused.cuh's rmsnorm_row, the fused op's exact epilogue.
template <typename T, int kV>
__global__ void __launch_bounds__(kFlashThreads, 1) overlap_consume_kernel(OverlapConsumeArgs c) {
  const FusedArgs& a = c.a;
  const uint64_t n = c.state->recvs[c.slot] + 1;  // this call's count; advanced below by the last CTA
  const Vec16* theirs = static_cast<const Vec16*>(c.theirs);
  Vec16 w[kV], s[kV], r[kV];
  load_row(w, a.n.weight, 0, a.n);
  int arrived = -1;  // chunks up to this one are in my slot
  for (int row = blockIdx.x; row < a.n.rows; row += gridDim.x) {
    load_row(s, a.sum, row, a.n);
    load_row(r, a.n.residual, row, a.n);
    const int chunk = row / c.chunk_rows;
    if (chunk > arrived) {  // the same for every thread of the CTA
      if (threadIdx.x == 0)
        wait_flag(c.ready + chunk, n, c.timeout_ns, c.abort, Kernel::None, 1 + chunk);
      __syncthreads();  // thread 0's acquire orders the CTA's reads of the chunk after it
      arrived = chunk;
    }
    const size_t base = size_t(row) * a.n.row_vecs;
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const int j = threadIdx.x + u * kFlashThreads;
      if (j < a.n.row_vecs) s[u] = add_vec<T>(s[u], load_shared_buffer(theirs + base + j));
    }
    rmsnorm_row<T, kV>(a.n, row, s, r, w);
  }
  // The last CTA to finish gives the slot back to the peer: every CTA's reads of it are done.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned long long prev = atomicAdd(reinterpret_cast<unsigned long long*>(&c.state->done_ctas), 1ull);
    if (prev == gridDim.x - 1) {
      c.state->done_ctas = 0;
      c.state->recvs[c.slot] = n;
      c.state->calls += 1;
      __threadfence_system();
      store_release_sys(c.peer_credit, n);
    }
  }
}

}  // namespace yali
