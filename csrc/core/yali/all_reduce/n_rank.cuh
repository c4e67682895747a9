// The N-rank all-reduce (world sizes 3 to kMaxRanks; the communicator serves 4, 6 and 8); two
// ranks use flash-push and stream instead. The exchange, its arithmetic (every element summed in
// rank order in fp32, rounded once) and the buffer reuse are common/n_rank_exchange.cuh's.
//
//  * push one-shot: every rank sends its whole input into slot `me` of every other rank's push
//    area, then adds the N inputs. One NVLink trip; every GPU sends N - 1 times the message.
//  * push two-shot: the message is cut into N segments, segment s reduced by rank s. Reduce-
//    scatter: every rank sends segment s of its input into slot `me` (phase 0) of rank s; rank s
//    adds the N contributions and sends the sum into slot s (phase 1) of every other rank, which
//    copies it out (all-gather). Two trips; every GPU sends about twice the message.
#pragma once
#include "yali/common/n_rank_exchange.cuh"

namespace yali {

// out = the sum over the ranks of in. CTA b owns vectors split_range(b) of the message on every
// rank: it sends them to every other rank, then adds the N copies of the same vectors.
template <typename T, int kW>
__global__ void __launch_bounds__(kFlashThreads, 1) push_oneshot_kernel(RanksArgs a) {
  const DependentLaunchScope dependent_launch;
  constexpr int kU = 4;  // vectors in flight per thread
  const int world = world_of<kW>(a);
  const int t = threadIdx.x;
  const Range r = split_range(0, (a.nbytes + 15) / 16, gridDim.x, blockIdx.x);
  const auto input = [&](size_t k) { return load_input_vector<T>(a.in, k, a.nbytes); };
  Vec16 v[kU];
  load_batch(v, r.begin + t, r.end, input);  // while thread 0 fetches the epoch
  const bool checker = is_call_checker();
  const uint64_t call_n = checker ? a.state->call_seq + 1 : 0;
  uint32_t* call_slots = nullptr;
  const int parity = ranks_begin(a, world, checker, call_n, &call_slots);

  send_to_ranks<T, kW>(a, parity, v, r, input);
  if (checker) ranks_call_verify(a.call, call_slots, a.rank, world, a.timeout_ns, a.abort, Kernel::PushOneShot);
  for (size_t k = r.begin + t; k < r.end; k += kFlashThreads) {
    const Vec16 mine = canonical<T>(load_input_vector<T>(a.in, k, a.nbytes));  // in L2: sent above
    store_output_vector<T>(a.out, k, a.nbytes, sum_ranks<T, kW>(a, parity, k, mine, Kernel::PushOneShot));
  }
}

// out = the sum over the ranks of in, by reduce-scatter and all-gather. The message's V vectors
// are cut into N segments of S = ceil(V / N) vectors (the last ones shorter or empty); CTA b owns
// positions split_range(b) of every segment, on every rank, and a thread the same positions in
// every phase, so each element is read (phase A or B) by the thread that later writes it: in-place
// is safe. A CTA runs the three phases round by round over a.round_vecs of its positions at a
// time (all of them when 0), each round on positions no other round reads or writes; it runs at
// least one round, so the checker makes the call check even when its CTA's range is empty.
template <typename T, int kW>
__global__ void __launch_bounds__(kFlashThreads, 1) push_twoshot_kernel(RanksArgs a) {
  const DependentLaunchScope dependent_launch;
  constexpr int kU = 4;
  const int world = world_of<kW>(a);
  const int t = threadIdx.x;
  const size_t vecs = (a.nbytes + 15) / 16;
  const size_t seg = (vecs + world - 1) / world;
  const Range mine_all = split_range(0, seg, gridDim.x, blockIdx.x);
  const bool checker = is_call_checker();
  const uint64_t call_n = checker ? a.state->call_seq + 1 : 0;
  uint32_t* call_slots = nullptr;
  const int parity = ranks_begin(a, world, checker, call_n, &call_slots);
  const size_t round = a.round_vecs ? a.round_vecs : max(mine_all.end - mine_all.begin, size_t(1));

  for (size_t rb = mine_all.begin;; rb += round) {
    const Range r{rb, min(mine_all.end, rb + round)};
    // A. reduce-scatter: segment p of my input to rank p
    for (int d = 1; d < world; ++d) {
      const int p = (a.rank + d) % world;
      Vec16* to = ranks_slot(a, world, p, parity, 0, a.rank);
      const size_t at = size_t(p) * seg;
      for (size_t i = r.begin + t; i < r.end; i += size_t(kU) * kFlashThreads) {
        Vec16 v[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const size_t j = i + size_t(u) * kFlashThreads;
          if (j < r.end && at + j < vecs) v[u] = load_input_vector<T>(a.in, at + j, a.nbytes);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const size_t j = i + size_t(u) * kFlashThreads;
          if (j < r.end && at + j < vecs) store_push(to + j, canonical<T>(v[u]));
        }
      }
    }
    // The checker verifies once, after its first round's sends and before it waits for any peer
    // data (call_check.cuh: the other CTAs never wait for the check). The round size need not
    // match across ranks (each position still has one sender and one reader), so CallDesc omits it.
    if (checker && rb == mine_all.begin)
      ranks_call_verify(a.call, call_slots, a.rank, world, a.timeout_ns, a.abort, Kernel::PushTwoShot);
    // B. my segment: add the N contributions, keep the sum, send it to every other rank
    const size_t mine_at = size_t(a.rank) * seg;
    for (size_t j = r.begin + t; j < r.end && mine_at + j < vecs; j += kFlashThreads) {
      const Vec16 mine = canonical<T>(load_input_vector<T>(a.in, mine_at + j, a.nbytes));
      const Vec16 sum = canonical<T>(sum_ranks<T, kW>(a, parity, j, mine, Kernel::PushTwoShot));  // sent: never empty
#pragma unroll
      for (int d = 1; d < kRankLoop<kW>; ++d) {
        if (d >= world) break;
        const int p = (a.rank + d) % world;
        store_push(ranks_slot(a, world, p, parity, 1, a.rank) + j, sum);
      }
      store_output_vector<T>(a.out, mine_at + j, a.nbytes, sum);
    }
    // C. all-gather: every other rank's summed segment
    for (int d = 1; d < world; ++d) {
      const int p = (a.rank + world - d) % world;  // the rank whose sends started with me
      Vec16* from = ranks_slot(a, world, a.rank, parity, 1, p);
      const size_t at = size_t(p) * seg;
      for (size_t i = r.begin + t; i < r.end; i += size_t(kU) * kFlashThreads) {
        Vec16 v[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const size_t j = i + size_t(u) * kFlashThreads;
          if (j < r.end && at + j < vecs) v[u] = load_push(from + j);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const size_t j = i + size_t(u) * kFlashThreads;
          if (j < r.end && at + j < vecs) {
            wait_push(from + j, v[u], a.timeout_ns, a.abort, Kernel::PushTwoShot, p);
            store_output_vector<T>(a.out, at + j, a.nbytes, v[u]);
            clear_push(from + j);
          }
        }
      }
    }
    if (r.end == mine_all.end) break;
  }
}

}  // namespace yali
