// Flash-push: the latency kernel for small and medium messages, and the data
// exchange of the fused all-reduce + RMSNorm (fused.cuh).
//
// Each rank writes its input straight into the peer's push area with 16-byte
// stores over NVLink and then polls its own push area until the peer's data is
// there: one one-way NVLink trip, no staging copy, no flag words and no flag
// round trip (the sentinel-in-data protocol and the buffer reuse argument are
// in exchange.cuh).
#pragma once
#include "yali/common/exchange.cuh"

namespace yali {

// out = in(rank 0) + in(rank 1). CTA b owns vectors split_range(b) on both
// ranks: it sends them, then receives the peer's copies of the same vectors.
template <typename T>
__global__ void __launch_bounds__(kFlashThreads, 1) flash_push_kernel(ExchangeArgs a) {
  const DependentLaunchScope dependent_launch;
  constexpr int kU = 4;  // vectors in flight per thread
  const int t = threadIdx.x;
  const Range r = split_range(0, (a.nbytes + 15) / 16, gridDim.x, blockIdx.x);
  const auto input = [&](size_t k) { return load_input_vector<T>(a.in, k, a.nbytes); };
  Vec16 v[kU];
  load_batch(v, r.begin + t, r.end, input);  // while thread 0 fetches the epoch
  const bool checker = is_call_checker();  // sends nothing below 1 MiB (call_check.cuh)
  const uint64_t call_n = checker ? a.state->call_seq + 1 : 0;     // overlaps the epoch fetch
  const uint64_t e = exchange_begin(a);
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
