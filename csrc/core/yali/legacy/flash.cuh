// The retired flash kernels: flash-ll, one-shot and two-shot, the first small
// and medium-size kernels, which flash-push replaced at every size (the default
// table never picks them; docs/DESIGN_LOG.md has the measurements). Compiled
// only with -DYALI_LEGACY_KERNELS (YALI_BUILD_LEGACY=1 at build time) and
// reached only through YALI_DEV_PUSH_MAX below YALI_DEV_FLASH_BYTES, for
// comparison and tuning. Their buffers (stage, reduced, LL words and the
// arrive / gather flags) are allocated only when the Config selects them
// (layout.h).
//
// One-shot and two-shot stage their input in their own IPC buffer, tell the
// peer (one flag per CTA), then read the peer's staged copy directly over
// NVLink with 16-byte loads. The stage/reduced areas alternate between two
// parities (epoch & 1), as the push area does (exchange.cuh): a rank can start
// call e+2 (reusing parity e&1) only after its call e+1 passed the arrive flags,
// i.e. after the peer *started* call e+1, i.e. after the peer's call e (which
// read our parity e&1 area) finished. Flags hold the epoch itself and are
// compared with >=, so they never need resetting and a peer running one call
// ahead is harmless.
#pragma once
#include "../exchange.cuh"

namespace yali {

struct LegacyArgs {
  ExchangeArgs x;         // in, out, nbytes, epochs, watchdog; x.parity_bytes: one parity of stage/reduced
  int rank;               // 0 or 1 (two-shot: rank 0 owns the first half)
  uint64_t* my_arrive;    // my flag words, written by the peer
  uint64_t* peer_arrive;  // the peer's flag words, written by me
  uint64_t* my_gather;
  uint64_t* peer_gather;
  char* my_stage;  // base of my two-parity stage area
  const char* peer_stage;
  char* my_reduced;
  const char* peer_reduced;
  char* my_ll;             // flash-ll words the peer writes to me
  char* peer_ll;
  size_t ll_parity_bytes;  // 2 * Config::ll_max
};

// Publishes "my data for epoch e is in place" to the peer's CTA b and waits for
// the peer's matching word. The CTA barrier before it makes all threads' stores
// part of the release; the one after it extends the acquire to all threads.
__device__ __forceinline__ void flash_handshake(uint64_t* peer_word, const uint64_t* my_word, uint64_t e,
                                                const LegacyArgs& a, Kernel k, int what) {
  __syncthreads();
  if (threadIdx.x == 0) {
    store_release_sys(peer_word, e);
    wait_flag(my_word, e, a.x.timeout_ns, a.x.abort, k, what);
  }
  __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kFlashThreads, 1) flash_oneshot_kernel(LegacyArgs a) {
  wait_prior_grids();
  const uint64_t e = exchange_begin(a.x);
  const int b = blockIdx.x, active = gridDim.x;
  const size_t par = (e & 1) * a.x.parity_bytes;
  const int t = threadIdx.x;
  const Range r = split_range(0, a.x.nbytes / 16, active, b);
  const Tail<T> tail(a.x.nbytes);
  const bool has_tail = b == active - 1 && t < tail.count;

  // 1. stage my slice of the input where the peer can read it
  copy_vectors<4>(reinterpret_cast<Vec16*>(a.my_stage + par), static_cast<const Vec16*>(a.x.in), r, t,
                  kFlashThreads);
  if (has_tail)
    reinterpret_cast<T*>(a.my_stage + par)[tail.first + t] = static_cast<const T*>(a.x.in)[tail.first + t];
  flash_handshake(a.peer_arrive + b, a.my_arrive + b, e, a, Kernel::FlashOneShot, 1);

  // 2. out = mine + peer's staged copy (remote loads over NVLink)
  reduce_vectors<T, 4>(static_cast<Vec16*>(a.x.out), nullptr, static_cast<const Vec16*>(a.x.in),
                       reinterpret_cast<const Vec16*>(a.peer_stage + par), r, t, kFlashThreads);
  if (has_tail) {
    const size_t i = tail.first + t;
    const T theirs = reinterpret_cast<const volatile T*>(a.peer_stage + par)[i];
    static_cast<T*>(a.x.out)[i] = Elem<T>::add(static_cast<const T*>(a.x.in)[i], theirs);
  }
}

// Two-shot: reduce-scatter (each rank reduces the half it owns, reading the
// peer's staged copy of that half), then all-gather (each rank reads the peer's
// reduced half). Rank 0 owns vectors [0, n/2), rank 1 the rest plus the tail.
template <typename T>
__global__ void __launch_bounds__(kFlashThreads, 1) flash_twoshot_kernel(LegacyArgs a) {
  wait_prior_grids();
  const uint64_t e = exchange_begin(a.x);
  const int b = blockIdx.x, active = gridDim.x;
  const size_t par = (e & 1) * a.x.parity_bytes;
  const int t = threadIdx.x;
  const size_t nvec = a.x.nbytes / 16, half = nvec / 2;
  const Range owned0 = split_range(0, half, active, b), owned1 = split_range(half, nvec, active, b);
  const Range mine = a.rank == 0 ? owned0 : owned1, theirs = a.rank == 0 ? owned1 : owned0;
  const Tail<T> tail(a.x.nbytes);
  const bool tail_cta = b == active - 1 && t < tail.count;
  const T* in = static_cast<const T*>(a.x.in);
  T* out = static_cast<T*>(a.x.out);

  // 1. stage the half the peer owns
  copy_vectors<4>(reinterpret_cast<Vec16*>(a.my_stage + par), static_cast<const Vec16*>(a.x.in), theirs, t,
                  kFlashThreads);
  if (tail_cta && a.rank == 0)
    reinterpret_cast<T*>(a.my_stage + par)[tail.first + t] = in[tail.first + t];
  flash_handshake(a.peer_arrive + b, a.my_arrive + b, e, a, Kernel::FlashTwoShot, 1);

  // 2. reduce the half I own; publish the result for the peer
  reduce_vectors<T, 4>(static_cast<Vec16*>(a.x.out), reinterpret_cast<Vec16*>(a.my_reduced + par),
                       static_cast<const Vec16*>(a.x.in), reinterpret_cast<const Vec16*>(a.peer_stage + par), mine,
                       t, kFlashThreads);
  if (tail_cta && a.rank == 1) {
    const size_t i = tail.first + t;
    const T s = Elem<T>::add(in[i], reinterpret_cast<const volatile T*>(a.peer_stage + par)[i]);
    out[i] = s;
    reinterpret_cast<T*>(a.my_reduced + par)[i] = s;
  }
  flash_handshake(a.peer_gather + b, a.my_gather + b, e, a, Kernel::FlashTwoShot, 2);

  // 3. gather the peer's reduced half
  copy_vectors<4, true>(static_cast<Vec16*>(a.x.out), reinterpret_cast<const Vec16*>(a.peer_reduced + par), theirs,
                        t, kFlashThreads);
  if (tail_cta && a.rank == 0)
    out[tail.first + t] = reinterpret_cast<const volatile T*>(a.peer_reduced + par)[tail.first + t];
}

// Flash-LL: the small-message kernel. Each 16-byte vector of my input travels
// to the peer as two 64-bit LL words {data32, flag32} x 2 (a 2x traffic cost
// that is irrelevant at these sizes), written straight into the peer's LL area.
// The peer polls its own memory until the words carry this call's flag: one
// one-way NVLink trip, no flag/fence round trip and no remote read. After
// reading, the receiver zeroes the words, so a flag value can never be mistaken
// for a later call's even after the 32-bit flag wraps. Buffer reuse follows the
// same two-parity argument as the other flash kernels.
__device__ __forceinline__ uint32_t ll_flag(uint64_t epoch) { return uint32_t(epoch % 0xffffffffull) + 1; }

template <typename T>
__global__ void __launch_bounds__(kFlashThreads, 1) flash_ll_kernel(LegacyArgs a) {
  wait_prior_grids();
  constexpr int kU = 4;
  const int t = threadIdx.x;
  const Range r = split_range(0, (a.x.nbytes + 15) / 16, gridDim.x, blockIdx.x);
  const auto input = [&](size_t k) { return load_input_vector<T>(a.x.in, k, a.x.nbytes); };
  Vec16 v[kU];
  load_batch(v, r.begin + t, r.end, input);  // while thread 0 fetches the epoch
  const uint64_t e = exchange_begin(a.x);
  const uint64_t f = uint64_t(ll_flag(e)) << 32;
  const size_t par = (e & 1) * a.ll_parity_bytes;
  char* to_peer = a.peer_ll + par;
  char* from_peer = a.my_ll + par;
  for (size_t i = r.begin + t; i < r.end; i += size_t(kU) * kFlashThreads) {
    if (i != r.begin + t) load_batch(v, i, r.end, input);
#pragma unroll
    for (int u = 0; u < kU; ++u) {  // send
      const size_t k = i + size_t(u) * kFlashThreads;
      if (k < r.end) {
        store_ll_pair(to_peer + k * 32, f | v[u].x, f | v[u].y);
        store_ll_pair(to_peer + k * 32 + 16, f | v[u].z, f | v[u].w);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {  // receive, add, reset
      const size_t k = i + size_t(u) * kFlashThreads;
      if (k >= r.end) continue;
      uint64_t w[4];
      const uint64_t start = global_timer_ns();
      for (uint32_t spins = 1;; ++spins) {
        load_ll_pair(from_peer + k * 32, w[0], w[1]);
        load_ll_pair(from_peer + k * 32 + 16, w[2], w[3]);
        if (((w[0] & w[1] & w[2] & w[3]) >> 32) == (f >> 32) &&
            ((w[0] | w[1] | w[2] | w[3]) >> 32) == (f >> 32))
          break;
        if (a.x.timeout_ns != 0 && (spins & 1023u) == 0 && global_timer_ns() - start > a.x.timeout_ns)
          abort_waiting(a.x.abort, Kernel::FlashLL, 5, f >> 32, w[0] >> 32);
      }
      const Vec16 theirs{uint32_t(w[0]), uint32_t(w[1]), uint32_t(w[2]), uint32_t(w[3])};
      store_output_vector<T>(a.x.out, k, a.x.nbytes, add_vec<T>(v[u], theirs));
      store_ll_pair(from_peer + k * 32, 0, 0);
      store_ll_pair(from_peer + k * 32 + 16, 0, 0);
    }
  }
}

}  // namespace yali
