// Flash: the latency kernels. One launch per all-reduce; every rank stages its
// input in its own IPC buffer, tells the peer (one flag per CTA), then reads the
// peer's staged copy directly over NVLink with 16-byte loads.
//
// Lock-step protocol (why no reset and no end barrier are needed):
//  * Every flash call advances all Config::flash_ctas epoch counters by one, so
//    all epochs equal the number of flash calls made so far. A launch has only
//    the CTAs that carry data; its CTA 0 advances the epochs of the others (no
//    other CTA of that launch touches them, and launches on a stream are ordered).
//  * The stage/reduced areas alternate between two parities (epoch & 1). A rank
//    can start call e+2 (reusing parity e&1) only after its call e+1 passed the
//    arrive flags, i.e. after the peer *started* call e+1, i.e. after the peer's
//    call e (which read our parity e&1 area) finished. Hence two parities suffice.
//  * Flags hold the epoch itself and are compared with >=, so they never need
//    resetting and a peer running one call ahead is harmless.
#pragma once
#include "call_check.cuh"

namespace yali {

struct FlashArgs {
  const void* in;
  void* out;
  size_t nbytes;
  int total_ctas;  // Config::flash_ctas: epochs of CTAs [gridDim.x, total_ctas) are advanced by CTA 0
  int rank;    // 0 or 1 (two-shot: rank 0 owns the first half)
  uint64_t* my_arrive;    // my flag words, written by the peer
  uint64_t* peer_arrive;  // the peer's flag words, written by me
  uint64_t* my_gather;
  uint64_t* peer_gather;
  char* my_stage;  // base of my two-parity stage area
  const char* peer_stage;
  char* my_reduced;
  const char* peer_reduced;
  size_t parity_bytes;  // size of one parity of stage/reduced (Config::flash_bytes)
  char* my_ll;          // flash-ll words the peer writes to me
  char* peer_ll;
  size_t ll_parity_bytes;  // 2 * Config::ll_max
  char* my_push;           // flash-push / fused area the peer writes to me (parity_bytes per parity)
  char* peer_push;
  LocalState* state;
  uint64_t timeout_ns;
  AbortInfo* abort;
  CallCheck call;  // flash-push and the fused op check their call against the peer's (call_check.cuh)
};

// Advances this CTA's epoch; returns it (same value in all threads).
__device__ __forceinline__ uint64_t flash_begin(const FlashArgs& a) {
  __shared__ uint64_t s_epoch;
  if (threadIdx.x == 0) {
    const uint64_t e = a.state->flash_epoch[blockIdx.x] + 1;
    a.state->flash_epoch[blockIdx.x] = e;
    if (blockIdx.x == 0) atomicAdd(reinterpret_cast<unsigned long long*>(&a.state->calls), 1ull);  // no return: a RED, no stall
    s_epoch = e;
  }
  if (blockIdx.x == 0)
    for (int i = int(gridDim.x) + threadIdx.x; i < a.total_ctas; i += blockDim.x) a.state->flash_epoch[i] += 1;
  __syncthreads();
  return s_epoch;
}

// v[u] = load(k) for k = i + u * kFlashThreads < end (u < kU): one batch of kU
// independent loads, issued together so that their latencies overlap. The
// kernels that send from registers (flash-ll, flash-push, the fused op) load
// their first batch this way before the epoch fetch, the later ones in the loop.
template <int kU, typename Load>
__device__ __forceinline__ void load_batch(Vec16 (&v)[kU], size_t i, size_t end, Load load) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const size_t k = i + size_t(u) * kFlashThreads;
    if (k < end) v[u] = load(k);
  }
}

// Publishes "my data for epoch e is in place" to the peer's CTA b and waits for
// the peer's matching word. The CTA barrier before it makes all threads' stores
// part of the release; the one after it extends the acquire to all threads.
__device__ __forceinline__ void flash_handshake(uint64_t* peer_word, const uint64_t* my_word, uint64_t e,
                                                const FlashArgs& a, Kernel k, int what) {
  __syncthreads();
  if (threadIdx.x == 0) {
    store_release_sys(peer_word, e);
    wait_flag(my_word, e, a.timeout_ns, a.abort, k, what);
  }
  __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kFlashThreads, 1) flash_oneshot_kernel(FlashArgs a) {
  wait_prior_grids();
  const uint64_t e = flash_begin(a);
  const int b = blockIdx.x, active = gridDim.x;
  const size_t par = (e & 1) * a.parity_bytes;
  const int t = threadIdx.x;
  const Range r = split_range(0, a.nbytes / 16, active, b);
  const Tail<T> tail(a.nbytes);
  const bool has_tail = b == active - 1 && t < tail.count;

  // 1. stage my slice of the input where the peer can read it
  copy_vectors<4>(reinterpret_cast<Vec16*>(a.my_stage + par), static_cast<const Vec16*>(a.in), r, t,
                  kFlashThreads);
  if (has_tail)
    reinterpret_cast<T*>(a.my_stage + par)[tail.first + t] = static_cast<const T*>(a.in)[tail.first + t];
  flash_handshake(a.peer_arrive + b, a.my_arrive + b, e, a, Kernel::FlashOneShot, 1);

  // 2. out = mine + peer's staged copy (remote loads over NVLink)
  reduce_vectors<T, 4>(static_cast<Vec16*>(a.out), nullptr, static_cast<const Vec16*>(a.in),
                       reinterpret_cast<const Vec16*>(a.peer_stage + par), r, t, kFlashThreads);
  if (has_tail) {
    const size_t i = tail.first + t;
    const T theirs = reinterpret_cast<const volatile T*>(a.peer_stage + par)[i];
    static_cast<T*>(a.out)[i] = Elem<T>::add(static_cast<const T*>(a.in)[i], theirs);
  }
}

// Two-shot: reduce-scatter (each rank reduces the half it owns, reading the
// peer's staged copy of that half), then all-gather (each rank reads the peer's
// reduced half). Rank 0 owns vectors [0, n/2), rank 1 the rest plus the tail.
template <typename T>
__global__ void __launch_bounds__(kFlashThreads, 1) flash_twoshot_kernel(FlashArgs a) {
  wait_prior_grids();
  const uint64_t e = flash_begin(a);
  const int b = blockIdx.x, active = gridDim.x;
  const size_t par = (e & 1) * a.parity_bytes;
  const int t = threadIdx.x;
  const size_t nvec = a.nbytes / 16, half = nvec / 2;
  const Range owned0 = split_range(0, half, active, b), owned1 = split_range(half, nvec, active, b);
  const Range mine = a.rank == 0 ? owned0 : owned1, theirs = a.rank == 0 ? owned1 : owned0;
  const Tail<T> tail(a.nbytes);
  const bool tail_cta = b == active - 1 && t < tail.count;
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);

  // 1. stage the half the peer owns
  copy_vectors<4>(reinterpret_cast<Vec16*>(a.my_stage + par), static_cast<const Vec16*>(a.in), theirs, t,
                  kFlashThreads);
  if (tail_cta && a.rank == 0)
    reinterpret_cast<T*>(a.my_stage + par)[tail.first + t] = in[tail.first + t];
  flash_handshake(a.peer_arrive + b, a.my_arrive + b, e, a, Kernel::FlashTwoShot, 1);

  // 2. reduce the half I own; publish the result for the peer
  reduce_vectors<T, 4>(static_cast<Vec16*>(a.out), reinterpret_cast<Vec16*>(a.my_reduced + par),
                       static_cast<const Vec16*>(a.in), reinterpret_cast<const Vec16*>(a.peer_stage + par), mine,
                       t, kFlashThreads);
  if (tail_cta && a.rank == 1) {
    const size_t i = tail.first + t;
    const T s = Elem<T>::add(in[i], reinterpret_cast<const volatile T*>(a.peer_stage + par)[i]);
    out[i] = s;
    reinterpret_cast<T*>(a.my_reduced + par)[i] = s;
  }
  flash_handshake(a.peer_gather + b, a.my_gather + b, e, a, Kernel::FlashTwoShot, 2);

  // 3. gather the peer's reduced half
  copy_vectors<4, true>(static_cast<Vec16*>(a.out), reinterpret_cast<const Vec16*>(a.peer_reduced + par), theirs,
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
__global__ void __launch_bounds__(kFlashThreads, 1) flash_ll_kernel(FlashArgs a) {
  wait_prior_grids();
  constexpr int kU = 4;
  const int t = threadIdx.x;
  const Range r = split_range(0, (a.nbytes + 15) / 16, gridDim.x, blockIdx.x);
  const auto input = [&](size_t k) { return load_input_vector<T>(a.in, k, a.nbytes); };
  Vec16 v[kU];
  load_batch(v, r.begin + t, r.end, input);  // while thread 0 fetches the epoch
  const uint64_t e = flash_begin(a);
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
        if (a.timeout_ns != 0 && (spins & 1023u) == 0 && global_timer_ns() - start > a.timeout_ns)
          abort_kernel(a.abort, Kernel::FlashLL, 5, f >> 32, w[0] >> 32);
      }
      const Vec16 theirs{uint32_t(w[0]), uint32_t(w[1]), uint32_t(w[2]), uint32_t(w[3])};
      store_output_vector<T>(a.out, k, a.nbytes, add_vec<T>(v[u], theirs));
      store_ll_pair(from_peer + k * 32, 0, 0);
      store_ll_pair(from_peer + k * 32 + 16, 0, 0);
    }
  }
}

}  // namespace yali
