// Test-only kernels: launched by the GPU tests, never by YALI itself.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace yali::testing {

// A foreign kernel as the PDL transitivity case needs it (docs/DESIGN_LOG.md §7): one CTA,
// launched on `stream` with programmatic stream serialization, that triggers its dependents at
// once, never waits for the grid before it (griddepcontrol.wait) and spins `spin_ns` nanoseconds.
// Legal CUDA: it declares no dependency on the kernel before it.
cudaError_t launch_early_trigger_kernel(cudaStream_t stream, uint64_t spin_ns);

}  // namespace yali::testing
