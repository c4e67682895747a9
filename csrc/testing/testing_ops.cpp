// The test-only kernels (testing.cu) as torch ops, torch.ops.yali_testing: a library of their own
// (tests/gpu/yali_testing.abi3.so, built only with YALI_BUILD_TESTING=1, setup.py), never part of
// the product's library or wheel. Loaded by tests/gpu/testing_ops.py.
//
// Written against torch's stable C ABI only, as csrc/bindings/torch_ops.cpp is, so the one build
// loads in every torch the product's library loads in.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>

#include "testing/testing.h"

namespace {

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream o;
  o << "yali_testing: ";
  (o << ... << args);
  throw std::runtime_error(o.str());
}

cudaStream_t current_stream(int device) {
  void* s = nullptr;
  if (aoti_torch_get_current_cuda_stream(device, &s) != AOTI_TORCH_SUCCESS)
    fail("cannot read torch's current CUDA stream on cuda:", device);
  return static_cast<cudaStream_t>(s);
}

void check_launch(const char* op, cudaError_t e) {
  if (e != cudaSuccess) fail(op, " launch failed: ", cudaGetErrorString(e));
}

using torch::stable::Tensor;

bool on(const Tensor& t, int64_t device) { return t.is_cuda() && t.get_device() == device; }

// tests/gpu/reliability.py, pdl_scenarios.py, the PDL cases: a foreign kernel on torch's current
// stream of `device` that triggers its programmatic dependents at once and never waits. With
// `watched` (the output of the call just before, poisoned with all-ones words), it first adds the
// all-ones words it samples there to `incomplete` (one int32).
void early_trigger(int64_t device, int64_t spin_ns, const std::optional<Tensor>& watched,
                   const std::optional<Tensor>& incomplete) {
  if (spin_ns < 0) fail("spin_ns must be >= 0, got ", spin_ns);
  if (watched.has_value() != incomplete.has_value()) fail("watched and incomplete go together");
  const uint32_t* words = nullptr;
  size_t nwords = 0;
  uint32_t* count = nullptr;
  if (watched.has_value()) {
    if (!on(*watched, device) || !on(*incomplete, device)) fail("watched and incomplete must be on cuda:", device);
    const size_t bytes = size_t(watched->numel()) * watched->element_size();
    if (!watched->is_contiguous() || bytes % 4 != 0) fail("watched must be contiguous, a whole number of 32-bit words");
    if (incomplete->scalar_type() != torch::headeronly::ScalarType::Int || incomplete->numel() != 1)
      fail("incomplete must be one int32");
    words = static_cast<const uint32_t*>(watched->data_ptr());
    nwords = bytes / 4;
    count = static_cast<uint32_t*>(incomplete->data_ptr());
  }
  const torch::stable::accelerator::DeviceGuard guard(device);
  check_launch("early_trigger", yali::testing::launch_early_trigger_kernel(current_stream(int(device)),
                                                                           uint64_t(spin_ns), words, nwords, count));
}

// tests/gpu/progress_scenarios.py, stall_scenarios.py: `ctas` CTAs on torch's current stream of
// `device` that each hold a whole SM for spin_ns nanoseconds.
void occupy(int64_t device, int64_t ctas, int64_t spin_ns) {
  if (ctas < 1 || ctas > 1024) fail("ctas must be in [1, 1024], got ", ctas);
  if (spin_ns < 0) fail("spin_ns must be >= 0, got ", spin_ns);
  const torch::stable::accelerator::DeviceGuard guard(device);
  check_launch("occupy",
               yali::testing::launch_occupy_kernel(current_stream(int(device)), int(ctas), uint64_t(spin_ns)));
}

}  // namespace

STABLE_TORCH_LIBRARY(yali_testing, m) {
  m.def("early_trigger(int device, int spin_ns, Tensor? watched=None, Tensor(a!)? incomplete=None) -> ()");
  m.def("occupy(int device, int ctas, int spin_ns) -> ()");
}

// Registered for every backend: occupy takes no tensor, and early_trigger's are optional.
STABLE_TORCH_LIBRARY_IMPL(yali_testing, CompositeExplicitAutograd, m) {
  m.impl("early_trigger", TORCH_BOX(&early_trigger));
  m.impl("occupy", TORCH_BOX(&occupy));
}
