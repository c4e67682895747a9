// Thin torch op layer over the YALI core (csrc/core): argument checks with
// clear messages, tensor -> pointer, torch's current stream. Registered with
// TORCH_LIBRARY only (no pybind, no Python.h), so the library is independent of
// the Python version (abi3) and is loaded with torch.ops.load_library.
//
// A communicator is passed around as an int64 handle (the Rank pointer), the
// same convention vLLM uses for its custom all-reduce; handles are tracked so a
// stale one raises instead of crashing.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <unordered_set>

#include "yali/config.h"
#include "yali/rank.h"

namespace {

std::mutex g_mu;
std::unordered_set<yali::Rank*> g_live;

yali::Rank* get(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* r = reinterpret_cast<yali::Rank*>(handle);
  TORCH_CHECK(g_live.count(r), "yali: communicator handle ", handle, " is not open (closed already?)");
  return r;
}

yali::Config config_from_env() {
  try {
    return yali::Config::from_env();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

int64_t create(int64_t device, int64_t rank) {
  const yali::Config c = config_from_env();
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  TORCH_CHECK(e == cudaSuccess && count > 0, "yali: no CUDA device is available (",
              e == cudaSuccess ? "0 devices" : cudaGetErrorString(e), ")");
  TORCH_CHECK(device >= 0 && device < count, "yali: device ", device, " does not exist (", count, " visible)");
  yali::Rank* r = nullptr;
  try {
    r = new yali::Rank(int(device), int(rank), c);
  } catch (const std::exception& ex) {
    TORCH_CHECK(false, ex.what());
  }
  std::lock_guard<std::mutex> lock(g_mu);
  g_live.insert(r);
  return reinterpret_cast<int64_t>(r);
}

void destroy(int64_t handle) {
  yali::Rank* r = get(handle);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_live.erase(r);
  }
  delete r;
}

at::Tensor ipc_handle(int64_t handle) {
  const auto h = get(handle)->ipc_handle();
  at::Tensor t = at::empty({int64_t(h.size())}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(t.data_ptr(), h.data(), h.size());
  return t;
}

void open_peer(int64_t handle, const at::Tensor& peer) {
  TORCH_CHECK(peer.device().is_cpu() && peer.scalar_type() == at::kByte &&
                  peer.numel() == int64_t(sizeof(yali::IpcHandleBytes)) && peer.is_contiguous(),
              "yali: open_peer expects the peer's ", sizeof(yali::IpcHandleBytes), "-byte CPU uint8 IPC handle");
  yali::IpcHandleBytes h;
  std::memcpy(h.data(), peer.data_ptr(), h.size());
  try {
    get(handle)->open_peer(h);
  } catch (const std::exception& ex) {
    TORCH_CHECK(false, ex.what());
  }
}

void attach_peer(int64_t handle, int64_t peer_handle) {
  try {
    get(handle)->attach_peer(*get(peer_handle));
  } catch (const std::exception& ex) {
    TORCH_CHECK(false, ex.what());
  }
}

yali::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return yali::DType::F32;
    case at::kHalf: return yali::DType::F16;
    case at::kBFloat16: return yali::DType::BF16;
    default: TORCH_CHECK_TYPE(false, "yali: all_reduce supports float32, float16 and bfloat16, not ", t);
  }
}

yali::KernelMode to_mode(int64_t mode, const yali::Rank& r) {
  TORCH_CHECK_VALUE(mode >= -1 && mode <= 2, "yali: kernel mode ", mode, " is not -1 (config), 0, 1 or 2");
  return mode < 0 ? r.config().mode : yali::KernelMode(int(mode));
}

// out = sum over both ranks of `input`; out may be `input` (in-place).
void all_reduce(int64_t handle, const at::Tensor& input, at::Tensor& out, int64_t mode) {
  const yali::Rank* r = get(handle);
  TORCH_CHECK(input.is_cuda() && input.get_device() == r->device(), "yali: input must be on cuda:", r->device(),
              ", got ", input.device());
  TORCH_CHECK(out.device() == input.device() && out.scalar_type() == input.scalar_type() &&
                  out.numel() == input.numel(),
              "yali: out must match input's device, dtype and number of elements");
  TORCH_CHECK(input.is_contiguous() && out.is_contiguous(), "yali: input and out must be contiguous");
  const yali::DType dt = to_dtype(input.scalar_type());
  const size_t nbytes = size_t(input.numel()) * input.element_size();
  if (nbytes == 0) return;
  TORCH_CHECK((reinterpret_cast<uintptr_t>(input.data_ptr()) | reinterpret_cast<uintptr_t>(out.data_ptr())) % 16 == 0,
              "yali: input and out must be 16-byte aligned (a sliced view may not be)");
  const yali::KernelMode m = to_mode(mode, *r);
  TORCH_CHECK(r->plan(nbytes, m).kernel != yali::Kernel::None, "yali: a ", nbytes,
              "-byte all-reduce is not served in this mode (YALI_MAX_BYTES=", r->config().max_bytes,
              ", flash limit ", r->config().flash_bytes, "); check should_use() first");
  const c10::cuda::CUDAGuard guard(input.device());
  const cudaError_t e =
      r->all_reduce(input.data_ptr(), out.data_ptr(), nbytes, dt, c10::cuda::getCurrentCUDAStream().stream(), m);
  TORCH_CHECK(e == cudaSuccess, "yali: all_reduce launch failed: ", cudaGetErrorString(e));
}

// (norm_out, residual_out) = RMSNorm(all_reduce(input) [+ residual]) over the last dimension.
void fused_allreduce_rmsnorm(int64_t handle, const at::Tensor& input, const std::optional<at::Tensor>& residual,
                             const at::Tensor& weight, double eps, at::Tensor& norm_out, at::Tensor& residual_out) {
  const yali::Rank* r = get(handle);
  TORCH_CHECK(input.is_cuda() && input.get_device() == r->device(), "yali: input must be on cuda:", r->device(),
              ", got ", input.device());
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) > 0, "yali: input must be [..., hidden] with hidden > 0");
  const int64_t hidden = input.size(-1);
  const int64_t rows = input.numel() / hidden;
  const yali::DType dt = to_dtype(input.scalar_type());
  auto same = [&](const at::Tensor& t) {
    return t.device() == input.device() && t.scalar_type() == input.scalar_type() && t.sizes() == input.sizes() &&
           t.is_contiguous();
  };
  TORCH_CHECK(input.is_contiguous(), "yali: input must be contiguous");
  TORCH_CHECK(same(norm_out), "yali: norm_out must be a contiguous tensor like input (shape ", input.sizes(), ")");
  TORCH_CHECK(same(residual_out), "yali: residual_out must be a contiguous tensor like input (shape ", input.sizes(),
              ")");
  if (residual) TORCH_CHECK(same(*residual), "yali: residual must be a contiguous tensor like input");
  TORCH_CHECK(weight.device() == input.device() && weight.scalar_type() == input.scalar_type() &&
                  weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(),
              "yali: weight must be a contiguous [", hidden, "] tensor of input's dtype and device, got ",
              weight.sizes(), " ", weight.scalar_type());
  TORCH_CHECK(norm_out.data_ptr() != residual_out.data_ptr() &&
                  (!residual || norm_out.data_ptr() != residual->data_ptr()),
              "yali: norm_out must not alias residual or residual_out");
  if (rows == 0) return;
  const size_t row_bytes = size_t(hidden) * input.element_size();
  TORCH_CHECK(row_bytes % 16 == 0 && row_bytes <= yali::kFusedMaxRowBytes, "yali: a row of ", hidden, " ",
              input.scalar_type(), " elements (", row_bytes, " bytes) is not served: it must be a multiple of 16 bytes ",
              "and at most ", yali::kFusedMaxRowBytes, " bytes");
  const size_t nbytes = size_t(rows) * row_bytes;
  TORCH_CHECK(r->fused_one_launch(size_t(rows), size_t(hidden), dt) ||
                  r->plan(nbytes, r->config().mode).kernel != yali::Kernel::None,
              "yali: a ", nbytes, "-byte fused all-reduce is not served (YALI_MAX_BYTES=", r->config().max_bytes, ")");
  const c10::cuda::CUDAGuard guard(input.device());
  const cudaError_t e = r->fused_allreduce_rmsnorm(
      input.data_ptr(), residual ? residual->data_ptr() : nullptr, weight.data_ptr(), float(eps), norm_out.data_ptr(),
      residual_out.data_ptr(), size_t(rows), size_t(hidden), dt, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(e == cudaSuccess, "yali: fused_allreduce_rmsnorm launch failed: ", cudaGetErrorString(e),
              " (tensors must be 16-byte aligned)");
}

std::vector<int64_t> plan(int64_t nbytes, int64_t mode) {
  yali::Config c = config_from_env();
  TORCH_CHECK_VALUE(mode >= -1 && mode <= 2, "yali: kernel mode ", mode, " is not -1, 0, 1 or 2");
  if (mode >= 0) c.mode = yali::KernelMode(int(mode));
  const yali::Plan p = yali::plan_for(c, size_t(nbytes));
  return {int64_t(p.kernel), int64_t(p.blocks), int64_t(p.chunk_bytes)};
}

std::string config_string() { return config_from_env().to_string(); }
int64_t shared_bytes_for_env() { return int64_t(yali::shared_buffer_bytes(config_from_env())); }
int64_t buffer_bytes(int64_t handle) { return int64_t(get(handle)->buffer_bytes()); }
int64_t device_calls(int64_t handle) {
  try {
    return int64_t(get(handle)->device_calls());
  } catch (const std::exception& ex) {
    TORCH_CHECK(false, ex.what());
  }
}
int64_t device_fused_calls(int64_t handle) {
  try {
    return int64_t(get(handle)->device_fused_calls());
  } catch (const std::exception& ex) {
    TORCH_CHECK(false, ex.what());
  }
}
std::string abort_message(int64_t handle) { return get(handle)->abort_message(); }
// How a fused call of this shape runs: [one_launch, grid, split, batch_poll, row_loads_early, cta_bytes, cluster].
std::vector<int64_t> fused_launch(int64_t handle, int64_t rows, int64_t hidden, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(rows > 0 && hidden > 0, "yali: fused_launch needs rows > 0 and hidden > 0, got ", rows, ", ", hidden);
  const yali::FusedLaunch l = get(handle)->fused_launch(size_t(rows), size_t(hidden), to_dtype(dtype));
  return {l.one_launch, l.grid, l.split, l.batch_poll, l.row_loads_early, int64_t(l.cta_bytes), l.cluster};
}
std::string handle_config(int64_t handle) { return get(handle)->config().to_string(); }

int64_t device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

}  // namespace

TORCH_LIBRARY(yali, m) {
  m.def("create(int device, int rank) -> int", &create);
  m.def("destroy(int comm) -> ()", &destroy);
  m.def("ipc_handle(int comm) -> Tensor", &ipc_handle);
  m.def("open_peer(int comm, Tensor peer_handle) -> ()", &open_peer);
  m.def("attach_peer(int comm, int peer_comm) -> ()", &attach_peer);
  m.def("all_reduce(int comm, Tensor input, Tensor(a!) out, int kernel_mode=-1) -> ()");
  m.def(
      "fused_allreduce_rmsnorm(int comm, Tensor input, Tensor? residual, Tensor weight, float eps, "
      "Tensor(a!) norm_out, Tensor(b!) residual_out) -> ()");
  m.def("plan(int nbytes, int mode=-1) -> int[]", &plan);
  m.def("config_string() -> str", &config_string);
  m.def("shared_bytes_for_env() -> int", &shared_bytes_for_env);
  m.def("buffer_bytes(int comm) -> int", &buffer_bytes);
  m.def("device_calls(int comm) -> int", &device_calls);
  m.def("device_fused_calls(int comm) -> int", &device_fused_calls);
  m.def("abort_message(int comm) -> str", &abort_message);
  m.def("fused_launch(int comm, int rows, int hidden, ScalarType dtype) -> int[]", &fused_launch);
  m.def("handle_config(int comm) -> str", &handle_config);
  m.def("device_count() -> int", &device_count);
}

TORCH_LIBRARY_IMPL(yali, CUDA, m) {
  m.impl("all_reduce", &all_reduce);
  m.impl("fused_allreduce_rmsnorm", &fused_allreduce_rmsnorm);
}
