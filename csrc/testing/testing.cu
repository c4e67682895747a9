#include "testing.h"
#include "yali/common/ptx.cuh"

namespace yali::testing {

namespace {

constexpr int kProbeThreads = 32;

__global__ void early_trigger_kernel(uint64_t spin_ns, const uint32_t* watched, size_t words, uint32_t* incomplete) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  // 32 threads read 1024 words spread over the whole buffer and its last word (at L2: the kernel
  // before wrote them, possibly from many CTAs).
  if (watched != nullptr && words > 0) {
    const size_t step = words > 1024 ? words / 1024 : 1;
    uint32_t poisoned = 0;
    for (size_t i = size_t(threadIdx.x) * step; i < words; i += size_t(kProbeThreads) * step) {
      uint32_t w;
      asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(w) : "l"(watched + i) : "memory");
      poisoned += (w == 0xffffffffu);
    }
    if (threadIdx.x == 0) {
      uint32_t w;
      asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(w) : "l"(watched + words - 1) : "memory");
      poisoned += (w == 0xffffffffu);
    }
    if (poisoned != 0) atomicAdd(incomplete, poisoned);
  }
  const uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < spin_ns) {
  }
}

constexpr int kOccupyThreads = 1024;
constexpr int kOccupyLive = 60;  // registers kept live per thread: with the loop's own, the whole file
constexpr int kOccupySmem = 200 << 10;  // more than half an SM's shared memory: one such CTA per SM

__global__ void __launch_bounds__(kOccupyThreads, 1) occupy_kernel(uint64_t spin_ns, uint32_t* sink) {
  extern __shared__ uint32_t smem[];
  uint32_t r[kOccupyLive];
#pragma unroll
  for (int i = 0; i < kOccupyLive; ++i) r[i] = threadIdx.x * (i + 1);
  const uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < spin_ns) {
#pragma unroll
    for (int i = 0; i < kOccupyLive; ++i) asm volatile("add.u32 %0, %0, 1;" : "+r"(r[i]));
  }
  uint32_t acc = 0;
#pragma unroll
  for (int i = 0; i < kOccupyLive; ++i) acc ^= r[i];
  smem[threadIdx.x] = acc;
  if (acc == 0xdeadbeefu && sink != nullptr) sink[0] = smem[(threadIdx.x + 1) % kOccupyThreads];
}

}  // namespace

cudaError_t launch_early_trigger_kernel(cudaStream_t stream, uint64_t spin_ns, const uint32_t* watched, size_t words,
                                       uint32_t* incomplete) {
  if (watched != nullptr && incomplete == nullptr) return cudaErrorInvalidValue;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(1);
  cfg.blockDim = dim3(kProbeThreads);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, early_trigger_kernel, spin_ns, watched, words, incomplete);
}

cudaError_t launch_occupy_kernel(cudaStream_t stream, int ctas, uint64_t spin_ns) {
  if (ctas < 1) return cudaErrorInvalidValue;
  cudaError_t e = cudaFuncSetAttribute(occupy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kOccupySmem);
  if (e != cudaSuccess) return e;
  occupy_kernel<<<ctas, kOccupyThreads, kOccupySmem, stream>>>(spin_ns, nullptr);
  return cudaGetLastError();
}

}  // namespace yali::testing
