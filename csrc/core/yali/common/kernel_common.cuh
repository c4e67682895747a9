// Pieces shared by the flash and stream kernels: waiting on a peer flag with a
// watchdog, splitting work, and the unrolled 16-byte copy / reduce loops.
#pragma once
#include <cstddef>
#include <cstdint>

#include "yali/common/layout.h"
#include "yali/common/ptx.cuh"
#include "yali/common/reduce.cuh"

namespace yali {

// Records why this kernel gives up (in host-mapped memory, so the host can read
// it after the context is lost) and traps.
// `mine`: this call's descriptor (AbortRef::call, from the launch's arguments).
// `theirs` (what = 9, a call mismatch): the peer's descriptor; otherwise the record takes the
// peer's unread descriptor, if any, from its slots.
// `peer`: the rank waited for or disagreeing (N ranks; -1: the peer of a two-rank communicator).
// One record per communicator: the first thread to give up claims it (an atomic on this GPU's
// LocalState), so with several waiters timing out at once (every CTA, N ranks) its fields all
// come from one of them. The others wait until the record is complete and only then trap: a trap
// ends the whole grid at once, so a thread that lost the claim and trapped at once would end the
// writer before its fields and magic reached the host (seen on two H100s: an EP combine's waiters
// timing out together left no record, only the launch failure).
__device__ __noinline__ static void abort_from(AbortInfo* abort, CallDesc mine, Kernel kernel, int what,
                                               uint64_t expected, uint64_t seen, const CallDesc* theirs, int peer) {
  volatile AbortInfo* a = abort;
  const volatile LocalState* st = abort->state;
  if (st && atomicCAS(const_cast<uint32_t*>(&st->abort_claim), 0u, 1u) != 0u) {
    while (a->magic != kAbortMagic) __nanosleep(1000);  // the writer traps right after the magic
    __trap();
  }
  for (int i = 0; i < 4; ++i) a->mine.w[i] = mine.w[i];
  for (int i = 0; i < 4; ++i) a->theirs.w[i] = theirs ? theirs->w[i] : kCallEmpty;
  // The unread descriptor of the peer: two slots with two ranks, slot [parity][peer] with more.
  const int stride = abort->world > 2 ? 4 * abort->world : 4;
  const int first = abort->world > 2 ? 4 * (peer >= 0 ? peer : 0) : 0;
  if (!theirs && abort->call_slots && (abort->world <= 2 || peer >= 0))
    for (int slot = 0; slot < 2; ++slot) {
      const volatile uint32_t* p = abort->call_slots + slot * stride + first;
      if (p[0] != kCallEmpty)
        for (int i = 0; i < 4; ++i) a->theirs.w[i] = p[i];
    }
  a->kernel = int(kernel);
  a->block = int(blockIdx.x);
  a->what = what;
  a->expected = expected;
  a->seen = seen;
  a->peer = peer;
  __threadfence_system();
  a->magic = kAbortMagic;
  __threadfence_system();
  __trap();
}

// The two-rank kernels' entry (their call sites stay as they were before N ranks existed).
__device__ __noinline__ static void abort_kernel(AbortInfo* abort, CallDesc mine, Kernel kernel, int what,
                                                 uint64_t expected, uint64_t seen, const CallDesc* theirs) {
  abort_from(abort, mine, kernel, what, expected, seen, theirs, -1);
}

// Every wait's entry: `peer` is a compile-time -1 in the two-rank kernels. The descriptor's words
// are read from the launch's arguments here, on the path that gives up only.
__device__ __forceinline__ void abort_waiting(const AbortRef& abort, Kernel kernel, int what, uint64_t expected,
                                              uint64_t seen, const CallDesc* theirs = nullptr, int peer = -1) {
  if (peer < 0) abort_kernel(abort.record, abort.call, kernel, what, expected, seen, theirs);
  else abort_from(abort.record, abort.call, kernel, what, expected, seen, theirs, peer);
}

// Spins until *flag >= target. A peer that never arrives (crashed process,
// mismatched call sequence) must not hang the GPU forever: after timeout_ns the
// kernel records why in host-mapped memory and traps, so the host sees a launch
// failure and can report the AbortInfo instead of hanging.
__device__ __forceinline__ void wait_flag(const uint64_t* flag, uint64_t target, uint64_t timeout_ns,
                                          const AbortRef& abort, Kernel kernel, int what) {
  uint64_t seen = load_acquire_sys(flag);
  if (seen >= target) return;
  const uint64_t start = global_timer_ns();
  for (uint32_t spins = 1;; ++spins) {
    seen = load_acquire_sys(flag);
    if (seen >= target) return;
    if (timeout_ns != 0 && (spins & 1023u) == 0 && global_timer_ns() - start > timeout_ns)
      abort_waiting(abort, kernel, what, target, seen);
  }
}

struct Range {
  size_t begin, end;
};

// Part `part` of `parts` contiguous, near-equal pieces of [begin, end).
__device__ __forceinline__ Range split_range(size_t begin, size_t end, int parts, int part) {
  const size_t n = end - begin;
  const size_t per = (n + parts - 1) / parts;
  const size_t b = begin + min(n, per * size_t(part));
  return {b, begin + min(n, per * size_t(part + 1))};
}

// dst[i] = src[i] for vector indices i in [r.begin, r.end), by `threads` threads
// starting at thread `t`. kUnroll independent loads are issued before the first
// store: that is the prefetch depth that keeps NVLink busy. kSharedSrc: the
// source is memory another agent wrote (read at L2 with .cg).
template <int kUnroll, bool kSharedSrc = false>
__device__ __forceinline__ void copy_vectors(Vec16* __restrict__ dst, const Vec16* __restrict__ src, Range r,
                                             int t, int threads) {
  for (size_t i = r.begin + t; i < r.end; i += size_t(kUnroll) * threads) {
    Vec16 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t k = i + size_t(u) * threads;
      if (k < r.end) v[u] = kSharedSrc ? load_shared_buffer(src + k) : load_local_input(src + k);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t k = i + size_t(u) * threads;
      if (k < r.end) store_vec(dst + k, v[u]);
    }
  }
}

// out[i] = mine[i] + theirs[i] (and also copy[i] = that sum when copy != nullptr).
// `theirs` is memory another agent wrote (peer buffer or a slot the peer filled):
// read at L2 with .cg.
template <typename T, int kUnroll>
__device__ __forceinline__ void reduce_vectors(Vec16* out, Vec16* copy, const Vec16* mine, const Vec16* theirs,
                                               Range r, int t, int threads) {
  for (size_t i = r.begin + t; i < r.end; i += size_t(kUnroll) * threads) {
    Vec16 a[kUnroll], b[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t k = i + size_t(u) * threads;
      if (k < r.end) {
        b[u] = load_shared_buffer(theirs + k);
        a[u] = load_local_input(mine + k);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t k = i + size_t(u) * threads;
      if (k < r.end) {
        const Vec16 s = add_vec<T>(a[u], b[u]);
        store_vec(out + k, s);
        if (copy) store_vec(copy + k, s);
      }
    }
  }
}

// The elements past the last full 16-byte vector (fewer than 16 bytes), done
// one element per thread by threads 0..n-1 of the calling group.
template <typename T>
struct Tail {
  size_t first;  // element index of the first tail element
  int count;
  __device__ __forceinline__ Tail(size_t nbytes)
      : first((nbytes / 16) * (16 / sizeof(T))), count(int((nbytes % 16) / sizeof(T))) {}
};

}  // namespace yali
