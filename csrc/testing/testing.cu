#include "testing.h"
#include "yali/common/ptx.cuh"

namespace yali::testing {

namespace {

__global__ void early_trigger_kernel(uint64_t spin_ns) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
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

cudaError_t launch_early_trigger_kernel(cudaStream_t stream, uint64_t spin_ns) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(1);
  cfg.blockDim = dim3(32);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, early_trigger_kernel, spin_ns);
}

cudaError_t launch_occupy_kernel(cudaStream_t stream, int ctas, uint64_t spin_ns) {
  if (ctas < 1) return cudaErrorInvalidValue;
  cudaError_t e = cudaFuncSetAttribute(occupy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kOccupySmem);
  if (e != cudaSuccess) return e;
  occupy_kernel<<<ctas, kOccupyThreads, kOccupySmem, stream>>>(spin_ns, nullptr);
  return cudaGetLastError();
}

}  // namespace yali::testing
