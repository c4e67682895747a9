// Memory-ordering and vector-access primitives shared by every YALI kernel.
//
// Why inline PTX: the flags that pair the two GPUs are written over NVLink by
// one GPU and polled by the other, so they need *system*-scope release/acquire
// semantics. Data that another agent wrote (the peer, over NVLink) is read with
// `.cg` loads so a stale L1 line can never be returned when a buffer is reused
// inside one long-running kernel.
#pragma once
#include <cstdint>

namespace yali {

struct alignas(16) Vec16 {
  uint32_t x, y, z, w;
};

// ---- 16-byte accesses -------------------------------------------------------
__device__ __forceinline__ Vec16 load_local_input(const Vec16* p) {
  // The caller's input (may alias the output when in-place, so no .nc path).
  Vec16 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ Vec16 load_shared_buffer(const Vec16* p) {
  // Buffers written by the peer (or read from the peer): cache at L2 only.
  Vec16 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void store_vec(Vec16* p, const Vec16& v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// ---- LL words: 32 bits of data and a 32-bit flag in one 64-bit access -------
// A 64-bit aligned access is single-copy atomic, so a reader that sees the flag
// also sees the data written with it: no separate fence or flag round trip.
__device__ __forceinline__ void store_ll_pair(void* p, uint64_t w0, uint64_t w1) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1,%2};" :: "l"(p), "l"(w0), "l"(w1) : "memory");
}

__device__ __forceinline__ void load_ll_pair(const void* p, uint64_t& w0, uint64_t& w1) {
  asm volatile("ld.volatile.global.v2.u64 {%0,%1}, [%2];" : "=l"(w0), "=l"(w1) : "l"(p) : "memory");
}

// ---- flags ------------------------------------------------------------------
__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// A word shared by the CTAs of one GPU (the fused op's row partial sums): a
// 64-bit aligned access is single-copy atomic, so a tag and a value packed into
// one word are seen together.
__device__ __forceinline__ void store_relaxed_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t load_relaxed_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Programmatic dependent launch (sm_90+). Every YALI kernel opens with a
// DependentLaunchScope, before it touches its input or its device state.
//  * Its constructor waits (griddepcontrol.wait) until the kernel launched just
//    before on the stream completed and its memory is visible: a kernel launched
//    with PDL (Config::pdl) may start while that kernel drains, and everything
//    after the wait is ordered exactly as without PDL (a no-op without PDL).
//  * Its destructor, as each thread leaves the kernel, makes the thread's stores
//    visible on the GPU (fence.acq_rel.gpu). The kernels never trigger their
//    dependents explicitly: a CTA triggers when its last thread exits, so the next
//    PDL-launched kernel starts only once every thread of every CTA has done its
//    last store. (griddepcontrol.launch_dependents counts for the whole CTA when
//    its first thread issues it, so issued by each thread at its end it would
//    let the next kernel start while the CTA's other threads still work: seen at
//    four ranks, where threads of one CTA end at different times.)
// Why at the end and not at the start: PDL is not transitive. griddepcontrol.wait
// orders a kernel after the grid just before it only; a foreign kernel F between
// YALI calls n and n + 1 that is launched with PDL, triggers at once and never
// waits would let call n + 1 start after F alone, while call n still runs, had
// call n triggered at its start. Both calls would then read the same per-CTA
// epochs and share a parity of the push areas (exchange.cuh). Triggered at the
// end, F and everything after it start only after call n's last store
// (DESIGN_LOG section 7; tests/gpu/test_reliability.py checks it on the device).
struct DependentLaunchScope {
  __device__ __forceinline__ DependentLaunchScope() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  }
  __device__ __forceinline__ ~DependentLaunchScope() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
#endif
  }
  DependentLaunchScope(const DependentLaunchScope&) = delete;
  DependentLaunchScope& operator=(const DependentLaunchScope&) = delete;
};

// Named barrier for a subset of the CTA's warps (warp-specialised kernels).
__device__ __forceinline__ void group_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

}  // namespace yali
