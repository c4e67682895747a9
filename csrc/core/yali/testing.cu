#include "ptx.cuh"
#include "testing.h"

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

}  // namespace yali::testing
