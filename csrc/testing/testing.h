// Test-only kernels: launched by the GPU tests, never by YALI itself.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace yali::testing {

// A foreign kernel as the PDL transitivity case needs it (lab/DESIGN_LOG.md §7): one CTA,
// launched on `stream` with programmatic stream serialization, that triggers its dependents at
// once, never waits for the grid before it (griddepcontrol.wait) and spins `spin_ns` nanoseconds.
// Legal CUDA: it declares no dependency on the kernel before it.
// `watched` (optional, `words` 32-bit words): the output of the YALI call launched just before, poisoned
// with all-ones words before that call. The kernel first samples it and adds the number of
// all-ones words it sees to `*incomplete`: non-zero means it started before that call's last
// store, and so could the YALI call after it (DESIGN_LOG section 7).
cudaError_t launch_early_trigger_kernel(cudaStream_t stream, uint64_t spin_ns, const uint32_t* watched = nullptr,
                                       size_t words = 0, uint32_t* incomplete = nullptr);

// A kernel that takes whole SMs away from every other kernel for `spin_ns` nanoseconds: `ctas` CTAs
// of 1024 threads, each holding the SM's whole register file (64 live registers a thread) and
// most of its shared memory, so no CTA of another kernel fits beside one (the forward-progress
// case: YALI's kernels on the SMs that are left).
cudaError_t launch_occupy_kernel(cudaStream_t stream, int ctas, uint64_t spin_ns);

}  // namespace yali::testing
