// Thin torch op layer over the YALI core (csrc/core): argument checks with
// clear messages, tensor -> pointer, torch's current stream.
//
// Written against torch's stable C ABI only (torch/csrc/stable, torch/headeronly,
// the aoti_torch_* / torch_* C shim), with TORCH_TARGET_VERSION = 2.11 (setup.py):
// the library imports no C++ symbol of torch, so one build loads and runs in every
// torch from 2.11 on (tests/test_stable_abi.py checks the symbol table). No pybind,
// no Python.h: the library is independent of the Python version (abi3) and is
// loaded with torch.ops.load_library.
//
// Errors: the stable ABI carries only RuntimeError across the boundary, so a check
// that means ValueError or TypeError tags its message ("[ValueError] yali: ...");
// yali_vllm/_ext.py turns the tag back into that Python type.
//
// A communicator is passed around as an int64 handle (the Rank pointer), the
// same convention vLLM uses for its custom all-reduce; handles are tracked so a
// stale one raises instead of crashing.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "yali/common/config.h"
#include "yali/common/plan.h"
#include "yali/communicator.h"

extern "C" __attribute__((used, visibility("default"))) const char yali_build_info[] =
    "yali-vllm build: torch " YALI_BUILD_TORCH " headers, stable ABI target " YALI_TORCH_TARGET;

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// ------------------------------------------------------------------ errors
enum class Err { Runtime, Value, Type };

template <typename... Args>
[[noreturn]] void fail(Err kind, const Args&... args) {
  std::ostringstream o;
  o << (kind == Err::Value ? "[ValueError] " : kind == Err::Type ? "[TypeError] " : "") << "yali: ";
  (o << ... << args);
  throw std::runtime_error(o.str());
}

#define YALI_CHECK(cond, ...) \
  do {                        \
    if (!(cond)) fail(Err::Runtime, __VA_ARGS__); \
  } while (0)
#define YALI_CHECK_VALUE(cond, ...) \
  do {                              \
    if (!(cond)) fail(Err::Value, __VA_ARGS__); \
  } while (0)
#define YALI_CHECK_TYPE(cond, ...) \
  do {                             \
    if (!(cond)) fail(Err::Type, __VA_ARGS__); \
  } while (0)

// Core calls throw std::invalid_argument for bad settings (a YALI_* value) and
// std::runtime_error otherwise; keep that distinction across the boundary.
template <typename F>
auto core(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    fail(Err::Value, e.what());
  } catch (const std::exception& e) {
    fail(Err::Runtime, e.what());
  }
}

// ------------------------------------------------------------------ handles
std::mutex g_mu;
std::unordered_set<yali::Rank*> g_live;

yali::Rank* get(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* r = reinterpret_cast<yali::Rank*>(handle);
  YALI_CHECK(g_live.count(r), "communicator handle ", handle, " is not open (closed already?)");
  return r;
}

yali::Config config_from_env() { return core([] { return yali::Config::from_env(); }); }

// ------------------------------------------------------------------ tensors
std::string shape_of(const Tensor& t) {
  std::ostringstream o;
  o << "[";
  for (int64_t d = 0; d < t.dim(); ++d) o << (d ? ", " : "") << t.size(d);
  o << "]";
  return o.str();
}

std::string device_of(const Tensor& t) {
  return t.is_cuda() ? "cuda:" + std::to_string(t.get_device()) : t.is_cpu() ? "cpu" : "a non-CUDA device";
}

bool same_shape(const Tensor& a, const Tensor& b) {
  if (a.dim() != b.dim()) return false;
  for (int64_t d = 0; d < a.dim(); ++d)
    if (a.size(d) != b.size(d)) return false;
  return true;
}

bool on(const Tensor& t, int device) { return t.is_cuda() && t.get_device() == device; }

yali::DType to_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return yali::DType::F32;
    case ScalarType::Half: return yali::DType::F16;
    case ScalarType::BFloat16: return yali::DType::BF16;
    default: fail(Err::Type, "all_reduce supports float32, float16 and bfloat16, not ", t);
  }
}

cudaStream_t current_stream(int device) {
  void* s = nullptr;
  YALI_CHECK(aoti_torch_get_current_cuda_stream(device, &s) == AOTI_TORCH_SUCCESS,
             "cannot read torch's current CUDA stream on cuda:", device);
  return static_cast<cudaStream_t>(s);
}

yali::KernelMode to_mode(int64_t mode, const yali::Rank& r) {
  YALI_CHECK_VALUE(mode >= -1 && mode <= 2, "kernel mode ", mode, " is not -1 (config), 0, 1 or 2");
  return mode < 0 ? r.config().mode : yali::KernelMode(int(mode));
}

// A world size the core takes: `lowest` (2, or 3 for what only the N-rank kernels have) to kMaxRanks.
void check_world(int64_t world, int64_t lowest = 2) {
  YALI_CHECK_VALUE(world >= lowest && world <= yali::kMaxRanks, "world size ", world, " is not in [", lowest, ", ",
                   yali::kMaxRanks, "]");
}

// After a kernel of this rank gave up waiting (the watchdog trapped, so every later CUDA call of
// the process fails), the reason it recorded: appended to launch errors.
std::string after_abort(const yali::Rank& r) { return r.aborted() ? " <- " + r.abort_message() : std::string(); }

// ------------------------------------------------------------------ ops
// `ep_slot_bytes` > 0: the communicator of an expert-parallel group, with an EP push area of slots
// of that size (YALI_EP_SLOT_BYTES, read by yali_vllm.ep).
int64_t create(int64_t device, int64_t rank, int64_t world, int64_t ep_slot_bytes) {
  yali::Config c = config_from_env();
  YALI_CHECK_VALUE(ep_slot_bytes >= 0, "ep_slot_bytes must be >= 0, got ", ep_slot_bytes);
  c.ep_slot_bytes = size_t(ep_slot_bytes);
  core([&] { c.validate(); });
  check_world(world);
  YALI_CHECK_VALUE(rank >= 0 && rank < world, "rank ", rank, " is not in [0, ", world, ")");
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  YALI_CHECK(e == cudaSuccess && count > 0, "no CUDA device is available (",
             e == cudaSuccess ? "0 devices" : cudaGetErrorString(e), ")");
  YALI_CHECK_VALUE(device >= 0 && device < count, "device ", device, " does not exist (", count, " visible)");
  yali::Rank* r = core([&] { return new yali::Rank(int(device), int(rank), int(world), c); });
  std::lock_guard<std::mutex> lock(g_mu);
  g_live.insert(r);
  return reinterpret_cast<int64_t>(r);
}

// Unmaps the peer's buffer after this GPU's work finished (YaliCommunicator.close: the first step).
void close_peer(int64_t handle) {
  yali::Rank* r = get(handle);
  core([&] { r->close_peer(); });
}

void destroy(int64_t handle) {
  yali::Rank* r = get(handle);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_live.erase(r);
  }
  delete r;
}

// The CUDA IPC handle of this rank's buffer, as byte values (int[]).
std::vector<int64_t> ipc_handle(int64_t handle) {
  const yali::IpcHandleBytes h = core([&] { return get(handle)->ipc_handle(); });
  return std::vector<int64_t>(h.begin(), h.end());
}

// Maps rank `peer_rank`'s buffer (-1: the other rank of a two-rank communicator).
void open_peer(int64_t handle, std::vector<int64_t> peer, int64_t peer_rank) {
  yali::IpcHandleBytes h;
  YALI_CHECK_VALUE(peer.size() == h.size(), "open_peer expects the peer's ", h.size(), "-byte IPC handle, got ",
                   peer.size(), " bytes");
  for (size_t i = 0; i < h.size(); ++i) {
    YALI_CHECK_VALUE(peer[i] >= 0 && peer[i] <= 255, "open_peer: byte ", i, " of the IPC handle is ", peer[i]);
    h[i] = uint8_t(peer[i]);
  }
  yali::Rank* r = get(handle);
  YALI_CHECK_VALUE(peer_rank >= -1 && peer_rank < r->world() && peer_rank != r->rank() &&
                       (peer_rank >= 0 || r->world() == 2),
                   "open_peer: rank ", peer_rank, " is not another rank of this ", r->world(), "-rank communicator");
  core([&] { peer_rank < 0 ? r->open_peer(h) : r->open_peer(int(peer_rank), h); });
}

void attach_peer(int64_t handle, int64_t peer_handle) {
  yali::Rank* r = get(handle);
  yali::Rank* p = get(peer_handle);
  core([&] { r->attach_peer(*p); });
}

// The setting that bounds the messages `r` serves (for a refusal): at N ranks the N-rank limit
// (YALI_DEV_RANKS_MAX, or the world size's default when it is unset) or YALI_MAX_BYTES, whichever
// is lower; at two, YALI_MAX_BYTES and, for the plain all-reduce in
// flash mode, the flash limit.
std::string serve_limit(const yali::Rank& r, bool flash_mode) {
  const yali::Config& c = r.config();
  if (r.world() > 2) {
    const size_t top = yali::ranks_max_for(c, r.world());
    const std::string at = " at " + std::to_string(r.world()) + " ranks";
    if (top < c.max_bytes && c.ranks_max != 0) return "YALI_DEV_RANKS_MAX=" + std::to_string(top) + at;
    if (top < c.max_bytes) return "the N-rank limit " + std::to_string(top) + at + " (YALI_DEV_RANKS_MAX unset)";
    return "YALI_MAX_BYTES=" + std::to_string(c.max_bytes);
  }
  if (flash_mode) return "flash limit " + std::to_string(c.flash_bytes) + ", YALI_DEV_FLASH_BYTES";
  return "YALI_MAX_BYTES=" + std::to_string(c.max_bytes);
}

// out = sum over both ranks of `input`; out may be `input` (in-place).
void all_reduce(int64_t handle, const Tensor& input, const Tensor& out, int64_t mode) {
  const yali::Rank* r = get(handle);
  YALI_CHECK_VALUE(on(input, r->device()), "input must be on cuda:", r->device(), ", got ", device_of(input));
  YALI_CHECK_VALUE(on(out, r->device()) && out.scalar_type() == input.scalar_type() && out.numel() == input.numel(),
                   "out must match input's device, dtype and number of elements");
  YALI_CHECK_VALUE(input.is_contiguous() && out.is_contiguous(), "input and out must be contiguous");
  const yali::DType dt = to_dtype(input.scalar_type());
  const size_t nbytes = size_t(input.numel()) * input.element_size();
  if (nbytes == 0) return;
  YALI_CHECK_VALUE((reinterpret_cast<uintptr_t>(input.data_ptr()) | reinterpret_cast<uintptr_t>(out.data_ptr())) % 16 == 0,
                   "input and out must be 16-byte aligned (a sliced view may not be)");
  const char* overlap = yali::all_reduce_overlap_refusal(input.data_ptr(), out.data_ptr(), nbytes);
  YALI_CHECK_VALUE(overlap == nullptr, overlap);
  const yali::KernelMode m = to_mode(mode, *r);
  YALI_CHECK_VALUE(r->plan(nbytes, m).kernel != yali::Kernel::None, "a ", nbytes,
                   "-byte all-reduce is not served in this mode (", serve_limit(*r, m == yali::KernelMode::Flash),
                   "); check should_use() first");
  const torch::stable::accelerator::DeviceGuard guard(r->device());
  const cudaError_t e = r->all_reduce(input.data_ptr(), out.data_ptr(), nbytes, dt, current_stream(r->device()), m);
  YALI_CHECK(e == cudaSuccess, "all_reduce launch failed: ", cudaGetErrorString(e), after_abort(*r));
}

// (norm_out, residual_out) = RMSNorm(all_reduce(input) [+ residual]) over the last dimension.
void fused_allreduce_rmsnorm(int64_t handle, const Tensor& input, const std::optional<Tensor>& residual,
                             const Tensor& weight, double eps, const Tensor& norm_out, const Tensor& residual_out) {
  const yali::Rank* r = get(handle);
  YALI_CHECK_VALUE(on(input, r->device()), "input must be on cuda:", r->device(), ", got ", device_of(input));
  YALI_CHECK_VALUE(input.dim() >= 1 && input.size(-1) > 0, "input must be [..., hidden] with hidden > 0");
  const int64_t hidden = input.size(-1);
  const int64_t rows = input.numel() / hidden;
  const yali::DType dt = to_dtype(input.scalar_type());
  auto like_input = [&](const Tensor& t) {
    return on(t, r->device()) && t.scalar_type() == input.scalar_type() && same_shape(t, input) && t.is_contiguous();
  };
  YALI_CHECK_VALUE(input.is_contiguous(), "input must be contiguous");
  YALI_CHECK_VALUE(like_input(norm_out), "norm_out must be a contiguous tensor like input (shape ", shape_of(input), ")");
  YALI_CHECK_VALUE(like_input(residual_out), "residual_out must be a contiguous tensor like input (shape ",
                   shape_of(input), ")");
  if (residual) YALI_CHECK_VALUE(like_input(*residual), "residual must be a contiguous tensor like input");
  YALI_CHECK_VALUE(on(weight, r->device()) && weight.scalar_type() == input.scalar_type() && weight.dim() == 1 &&
                       weight.size(0) == hidden && weight.is_contiguous(),
                   "weight must be a contiguous [", hidden, "] tensor of input's dtype and device, got ",
                   shape_of(weight), " ", weight.scalar_type());
  const size_t row_bytes = size_t(hidden) * input.element_size();
  // Which output may lie over which input (overlap.h): the other ranks read this rank's input while
  // its CTAs write the outputs, and a CTA writes its rows while others still read theirs.
  const char* overlap = yali::fused_overlap_refusal(input.data_ptr(), residual ? residual->data_ptr() : nullptr,
                                                    weight.data_ptr(), norm_out.data_ptr(), residual_out.data_ptr(),
                                                    size_t(rows) * row_bytes, row_bytes);
  YALI_CHECK_VALUE(overlap == nullptr, overlap);
  if (rows == 0) return;
  YALI_CHECK_VALUE(row_bytes % 16 == 0 && row_bytes <= yali::kFusedMaxRowBytes, "a row of ", hidden, " ",
                   input.scalar_type(), " elements (", row_bytes, " bytes) is not served: it must be a multiple of ",
                   "16 bytes and at most ", yali::kFusedMaxRowBytes, " bytes");
  const size_t nbytes = size_t(rows) * row_bytes;
  YALI_CHECK_VALUE(r->fused_one_launch(size_t(rows), size_t(hidden), dt) ||
                       r->plan(nbytes, r->config().mode).kernel != yali::Kernel::None,
                   "a ", nbytes, "-byte fused all-reduce is not served (", serve_limit(*r, false), ")");
  const torch::stable::accelerator::DeviceGuard guard(r->device());
  const cudaError_t e = r->fused_allreduce_rmsnorm(
      input.data_ptr(), residual ? residual->data_ptr() : nullptr, weight.data_ptr(), float(eps), norm_out.data_ptr(),
      residual_out.data_ptr(), size_t(rows), size_t(hidden), dt, current_stream(r->device()));
  YALI_CHECK(e == cudaSuccess, "fused_allreduce_rmsnorm launch failed: ", cudaGetErrorString(e),
             r->aborted() ? after_abort(*r) : std::string(" (tensors must be 16-byte aligned)"));
}

// quant_out (FP8 e4m3) and scale = the FP8 quantisation by `scheme` (quant.h: 0 static, 1 per-token,
// 2 per-token-group) of RMSNorm(all_reduce(input) [+ residual]); residual_out as in
// fused_allreduce_rmsnorm, or not stored when absent.
void fused_allreduce_rmsnorm_quant(int64_t handle, const Tensor& input, const std::optional<Tensor>& residual,
                                   const Tensor& weight, double eps, const Tensor& quant_out,
                                   const std::optional<Tensor>& residual_out, const Tensor& scale, int64_t scheme,
                                   int64_t group_size, bool scale_ue8m0) {
  const yali::Rank* r = get(handle);
  YALI_CHECK_VALUE(on(input, r->device()), "input must be on cuda:", r->device(), ", got ", device_of(input));
  YALI_CHECK_VALUE(input.dim() >= 1 && input.size(-1) > 0, "input must be [..., hidden] with hidden > 0");
  YALI_CHECK_VALUE(input.scalar_type() == ScalarType::BFloat16 || input.scalar_type() == ScalarType::Half,
                   "input must be bfloat16 or float16 for the quantising fused op, got ", input.scalar_type());
  YALI_CHECK_VALUE(input.is_contiguous(), "input must be contiguous");
  const int64_t hidden = input.size(-1);
  const int64_t rows = input.numel() / hidden;
  const yali::DType dt = to_dtype(input.scalar_type());
  auto like_input = [&](const Tensor& t) {
    return on(t, r->device()) && t.scalar_type() == input.scalar_type() && same_shape(t, input) && t.is_contiguous();
  };
  YALI_CHECK_VALUE(on(quant_out, r->device()) && quant_out.scalar_type() == ScalarType::Float8_e4m3fn &&
                       same_shape(quant_out, input) && quant_out.is_contiguous(),
                   "quant_out must be a contiguous float8_e4m3fn tensor of input's shape ", shape_of(input), ", got ",
                   shape_of(quant_out), " ", quant_out.scalar_type());
  if (residual) YALI_CHECK_VALUE(like_input(*residual), "residual must be a contiguous tensor like input");
  if (residual_out)
    YALI_CHECK_VALUE(like_input(*residual_out), "residual_out must be a contiguous tensor like input (shape ",
                     shape_of(input), ")");
  YALI_CHECK_VALUE(on(weight, r->device()) && weight.scalar_type() == input.scalar_type() && weight.dim() == 1 &&
                       weight.size(0) == hidden && weight.is_contiguous(),
                   "weight must be a contiguous [", hidden, "] tensor of input's dtype and device, got ",
                   shape_of(weight), " ", weight.scalar_type());
  YALI_CHECK_VALUE(scheme >= 0 && scheme <= 2, "scheme must be 0 (static per-tensor), 1 (dynamic per-token) or 2 ",
                   "(dynamic per-token-group), got ", scheme);
  const auto s = yali::QuantScheme(int(scheme));
  YALI_CHECK_VALUE(on(scale, r->device()) && scale.scalar_type() == ScalarType::Float,
                   "scale must be a float32 tensor on cuda:", r->device(), ", got ", scale.scalar_type(), " on ",
                   device_of(scale));
  yali::QuantOut q{quant_out.data_ptr(), static_cast<float*>(scale.data_ptr()), 0, 0, 0, 0};
  if (s == yali::QuantScheme::Static) {
    YALI_CHECK_VALUE(scale.numel() == 1, "scale must hold one element for the static scheme, got ", shape_of(scale));
  } else if (s == yali::QuantScheme::PerToken) {
    YALI_CHECK_VALUE(scale.numel() == rows && scale.is_contiguous(), "scale must be a contiguous [", rows,
                     ", 1] tensor for the per-token scheme (one scale per row), got ", shape_of(scale));
    q.row_stride = 1;
  } else {
    YALI_CHECK_VALUE(group_size == 64 || group_size == 128, "group_size must be 64 or 128, got ", group_size);
    YALI_CHECK_VALUE(hidden % group_size == 0, "group_size ", group_size, " must divide the hidden size ", hidden);
    YALI_CHECK_VALUE(scale.dim() == 2 && scale.size(0) == rows && scale.size(1) == hidden / group_size,
                     "scale must be [", rows, ", ", hidden / group_size, "] (rows, hidden / group_size) for the ",
                     "group scheme, got ", shape_of(scale));
    q.row_stride = scale.stride(0);
    q.group_stride = scale.stride(1);
    q.ue8m0 = scale_ue8m0 ? 1 : 0;
  }
  const int group = s == yali::QuantScheme::Group ? int(group_size) : 0;
  if (const char* why = yali::quant_scheme_refusal(s, size_t(rows), size_t(hidden), group, q.row_stride, q.group_stride))
    fail(Err::Value, why);
  const size_t row_bytes = size_t(hidden) * input.element_size();
  const void* res = residual ? residual->data_ptr() : nullptr;
  void* res_out = residual_out ? residual_out->data_ptr() : nullptr;
  const size_t groups = s == yali::QuantScheme::Group ? size_t(hidden / group_size) : 1;
  const size_t scale_bytes =
      s == yali::QuantScheme::Static ? 4
      : rows == 0                     ? 0
                                      : (size_t(q.row_stride) * size_t(rows - 1) + size_t(q.group_stride) * (groups - 1) + 1) * 4;
  const char* overlap = yali::fused_quant_overlap_refusal(
      input.data_ptr(), res, weight.data_ptr(), quant_out.data_ptr(), res_out, scale.data_ptr(),
      size_t(rows) * row_bytes, row_bytes, size_t(rows) * size_t(hidden), scale_bytes, s != yali::QuantScheme::Static);
  YALI_CHECK_VALUE(overlap == nullptr, overlap);
  if (rows == 0) return;
  YALI_CHECK_VALUE(row_bytes % 16 == 0 && row_bytes <= yali::kFusedMaxRowBytes, "a row of ", hidden, " ",
                   input.scalar_type(), " elements (", row_bytes, " bytes) is not served: it must be a multiple of ",
                   "16 bytes and at most ", yali::kFusedMaxRowBytes, " bytes");
  YALI_CHECK_VALUE(reinterpret_cast<uintptr_t>(quant_out.data_ptr()) % 16 == 0,
                   "quant_out must be 16-byte aligned (a sliced view may not be)");
  YALI_CHECK_VALUE(reinterpret_cast<uintptr_t>(scale.data_ptr()) % 4 == 0, "scale must be 4-byte aligned");
  const size_t nbytes = size_t(rows) * row_bytes;
  const yali::FusedLaunch l = r->fused_quant_launch(size_t(rows), size_t(hidden), dt, s, group);
  YALI_CHECK_VALUE(l.one_launch || r->plan(nbytes, r->config().mode).kernel != yali::Kernel::None, "a ", nbytes,
                   "-byte fused all-reduce is not served (", serve_limit(*r, false), ")");
  const torch::stable::accelerator::DeviceGuard guard(r->device());
  // The two-launch path's sum, where residual_out cannot hold it (Rank::fused_quant_workspace).
  std::optional<Tensor> workspace;
  if (r->fused_quant_workspace(size_t(rows), size_t(hidden), dt, s, group, res, res_out))
    workspace = torch::stable::empty_like(input);
  const cudaError_t e = r->fused_allreduce_rmsnorm_quant(
      input.data_ptr(), res, weight.data_ptr(), float(eps), q, s, group, res_out,
      workspace ? workspace->data_ptr() : nullptr, size_t(rows), size_t(hidden), dt, current_stream(r->device()));
  YALI_CHECK(e == cudaSuccess, "fused_allreduce_rmsnorm_quant launch failed: ", cudaGetErrorString(e),
             r->aborted() ? after_abort(*r) : std::string(" (tensors must be 16-byte aligned)"));
}

// ------------------------------------------------------------------ expert parallelism
// Every rank's token count as the core takes them; the list must name every rank.
std::vector<uint32_t> ep_counts(const yali::Rank& r, const std::vector<int64_t>& counts) {
  YALI_CHECK_VALUE(int64_t(counts.size()) == r.world(), "counts must give the tokens of each of the ", r.world(),
                   " ranks, got ", counts.size(), " values");
  std::vector<uint32_t> c;
  for (int64_t n : counts) {
    YALI_CHECK_VALUE(n >= 0 && n <= 0x7fffffff, "a token count must be in [0, 2^31), got ", n);
    c.push_back(uint32_t(n));
  }
  return c;
}

// Bytes of one row of t ([rows, ...]): the product of its other dimensions times the element size.
size_t row_bytes_of(const Tensor& t) {
  size_t n = size_t(t.element_size());
  for (int64_t d = 1; d < t.dim(); ++d) n *= size_t(t.size(d));
  return n;
}

bool ep_serves_dispatch(int64_t handle, std::vector<int64_t> row_bytes, std::vector<int64_t> counts) {
  const yali::Rank* r = get(handle);
  const std::vector<uint32_t> c = ep_counts(*r, counts);
  std::vector<size_t> rb(row_bytes.begin(), row_bytes.end());
  for (int64_t b : row_bytes) YALI_CHECK_VALUE(b >= 0, "row bytes must be >= 0, got ", b);
  return r->ep_gather_serves(rb.data(), int(rb.size()), c.data());
}

bool ep_serves_combine(int64_t handle, int64_t hidden, ScalarType dtype, std::vector<int64_t> counts) {
  const yali::Rank* r = get(handle);
  const std::vector<uint32_t> c = ep_counts(*r, counts);
  YALI_CHECK_VALUE(hidden >= 0, "hidden must be >= 0, got ", hidden);
  return r->ep_combine_serves(size_t(hidden), to_dtype(dtype), c.data());
}


// Dispatch: outputs[i] = inputs[i] of every rank, rank order ([sum counts, ...]).
void ep_dispatch(int64_t handle, std::vector<Tensor> inputs, std::vector<Tensor> outputs, std::vector<int64_t> counts) {
  const yali::Rank* r = get(handle);
  const std::vector<uint32_t> c = ep_counts(*r, counts);
  YALI_CHECK_VALUE(!inputs.empty() && inputs.size() == outputs.size() && inputs.size() <= size_t(yali::kEpMaxParts),
                   "ep_dispatch takes 1 to ", yali::kEpMaxParts, " inputs and as many outputs, got ", inputs.size(),
                   " and ", outputs.size());
  int64_t total = 0;
  for (uint32_t n : c) total += n;
  std::vector<yali::EpTensor> ts;
  std::vector<size_t> rb;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& in = inputs[i];
    const Tensor& out = outputs[i];
    YALI_CHECK_VALUE(on(in, r->device()) && in.is_contiguous() && in.dim() >= 1 && in.size(0) == c[r->rank()],
                     "inputs[", i, "] must be a contiguous [", c[r->rank()], ", ...] tensor on cuda:", r->device(),
                     " (this rank's token count), got ", shape_of(in), " on ", device_of(in));
    YALI_CHECK_VALUE(on(out, r->device()) && out.is_contiguous() && out.scalar_type() == in.scalar_type() &&
                         out.dim() == in.dim() && out.size(0) == total && row_bytes_of(out) == row_bytes_of(in),
                     "outputs[", i, "] must be a contiguous [", total, ", ...] tensor shaped and typed like inputs[",
                     i, "] ", shape_of(in), ", got ", shape_of(out));
    YALI_CHECK_VALUE(row_bytes_of(in) % 4 == 0 && row_bytes_of(in) > 0, "inputs[", i, "]: a row of ",
                     row_bytes_of(in), " bytes is not served (a positive multiple of 4 bytes)");
    YALI_CHECK_VALUE((reinterpret_cast<uintptr_t>(in.data_ptr()) | reinterpret_cast<uintptr_t>(out.data_ptr())) % 4 == 0,
                     "inputs[", i, "] and outputs[", i, "] must be 4-byte aligned");
    ts.push_back({in.data_ptr(), out.data_ptr(), row_bytes_of(in)});
    rb.push_back(row_bytes_of(in));
  }
  // This rank copies its own rows into every output while it still sends its inputs, and every
  // output receives every rank's rows: no output may overlap an input or another output.
  for (size_t j = 0; j < ts.size(); ++j) {
    const size_t out_bytes = size_t(total) * ts[j].row_bytes;
    for (size_t i = 0; i < ts.size(); ++i) {
      YALI_CHECK_VALUE(!yali::ranges_overlap(ts[j].out, out_bytes, ts[i].in, size_t(c[r->rank()]) * ts[i].row_bytes),
                       "outputs[", j, "] must not overlap inputs[", i, "]");
      YALI_CHECK_VALUE(i >= j || !yali::ranges_overlap(ts[j].out, out_bytes, ts[i].out, size_t(total) * ts[i].row_bytes),
                       "outputs[", j, "] must not overlap outputs[", i, "]");
    }
  }
  YALI_CHECK_VALUE(r->ep_gather_serves(rb.data(), int(rb.size()), c.data()),
                   "this dispatch is not served: some rank's tokens of every input, each padded to 16 bytes, exceed "
                   "the EP slot (", r->ep_slot_bytes(), " bytes, YALI_EP_SLOT_BYTES); check ep_serves_dispatch first");
  const torch::stable::accelerator::DeviceGuard guard(r->device());
  const cudaError_t e = r->ep_gather(ts.data(), int(ts.size()), c.data(), current_stream(r->device()));
  YALI_CHECK(e == cudaSuccess, "ep_dispatch launch failed: ", cudaGetErrorString(e),
             after_abort(*r));
}

// Combine: out = this rank's rows of input ([sum counts, hidden]) summed over the ranks.
void ep_combine(int64_t handle, const Tensor& input, const Tensor& out, std::vector<int64_t> counts) {
  const yali::Rank* r = get(handle);
  const std::vector<uint32_t> c = ep_counts(*r, counts);
  int64_t total = 0;
  for (uint32_t n : c) total += n;
  YALI_CHECK_VALUE(on(input, r->device()) && input.is_contiguous() && input.dim() == 2 && input.size(0) == total,
                   "input must be a contiguous [", total, ", hidden] tensor on cuda:", r->device(),
                   " (every rank's tokens), got ", shape_of(input), " on ", device_of(input));
  const yali::DType dt = to_dtype(input.scalar_type());
  const int64_t hidden = input.size(1);
  YALI_CHECK_VALUE(on(out, r->device()) && out.is_contiguous() && out.scalar_type() == input.scalar_type() &&
                       out.dim() == 2 && out.size(0) == c[r->rank()] && out.size(1) == hidden,
                   "out must be a contiguous [", c[r->rank()], ", ", hidden, "] tensor like input, got ", shape_of(out));
  YALI_CHECK_VALUE((reinterpret_cast<uintptr_t>(input.data_ptr()) | reinterpret_cast<uintptr_t>(out.data_ptr())) % 16 == 0,
                   "input and out must be 16-byte aligned (a sliced view may not be)");
  YALI_CHECK_VALUE(!yali::ranges_overlap(out.data_ptr(), size_t(c[r->rank()]) * size_t(hidden) * input.element_size(),
                                         input.data_ptr(), size_t(total) * size_t(hidden) * input.element_size()),
                   "out must not overlap input (the sends read rows of input that the sums, written meanwhile, "
                   "would overwrite)");
  YALI_CHECK_VALUE(r->ep_combine_serves(size_t(hidden), dt, c.data()),
                   "this combine is not served: rows of ", hidden, " ", input.scalar_type(),
                   " must be a multiple of 16 bytes and every rank's rows at most the EP slot (", r->ep_slot_bytes(),
                   " bytes, YALI_EP_SLOT_BYTES); check ep_serves_combine first");
  const torch::stable::accelerator::DeviceGuard guard(r->device());
  const cudaError_t e = r->ep_reduce_scatter(input.data_ptr(), out.data_ptr(), size_t(hidden), dt, c.data(),
                                             current_stream(r->device()));
  YALI_CHECK(e == cudaSuccess, "ep_combine launch failed: ", cudaGetErrorString(e),
             after_abort(*r));
}

std::vector<int64_t> plan(int64_t nbytes, int64_t mode, int64_t world) {
  yali::Config c = config_from_env();
  YALI_CHECK_VALUE(mode >= -1 && mode <= 2, "kernel mode ", mode, " is not -1, 0, 1 or 2");
  check_world(world);
  if (mode >= 0) c.mode = yali::KernelMode(int(mode));
  const yali::Plan p = yali::plan_for(c, size_t(nbytes), int(world));
  return {int64_t(p.kernel), int64_t(p.blocks), int64_t(p.chunk_bytes)};
}

std::string config_string() { return config_from_env().to_string(); }
// The size table as `world` ranks use it under the settings, one row a line (plan.h: plan_text).
std::string plan_table(int64_t world) {
  check_world(world);
  return yali::plan_text(config_from_env(), int(world));
}
int64_t shared_bytes_for_env(int64_t world) {
  check_world(world);
  return int64_t(yali::shared_buffer_bytes(config_from_env(), int(world)));
}
int64_t buffer_bytes(int64_t handle) { return int64_t(get(handle)->buffer_bytes()); }
int64_t device_calls(int64_t handle) {
  const yali::Rank* r = get(handle);
  YALI_CHECK(!r->aborted(), r->abort_message());
  return core([&] { return int64_t(r->device_calls()); });
}
int64_t device_fused_calls(int64_t handle) {
  const yali::Rank* r = get(handle);
  YALI_CHECK(!r->aborted(), r->abort_message());
  return core([&] { return int64_t(r->device_fused_calls()); });
}
std::string abort_message(int64_t handle) { return get(handle)->abort_message(); }
// How a fused call of this shape runs: [one_launch, grid, batch_poll, row_loads_early, cta_bytes,
// cluster, spread].
std::vector<int64_t> launch_values(const yali::FusedLaunch& l) {
  return {l.one_launch, l.grid, l.batch_poll, l.row_loads_early, int64_t(l.cta_bytes), l.cluster, l.spread};
}
std::vector<int64_t> fused_launch(int64_t handle, int64_t rows, int64_t hidden, ScalarType dtype) {
  YALI_CHECK_VALUE(rows > 0 && hidden > 0, "fused_launch needs rows > 0 and hidden > 0, got ", rows, ", ", hidden);
  return launch_values(get(handle)->fused_launch(size_t(rows), size_t(hidden), to_dtype(dtype)));
}
// How a quantising fused call of this shape and scheme runs (the same values).
std::vector<int64_t> fused_quant_launch(int64_t handle, int64_t rows, int64_t hidden, ScalarType dtype, int64_t scheme,
                                        int64_t group_size) {
  YALI_CHECK_VALUE(rows > 0 && hidden > 0, "fused_quant_launch needs rows > 0 and hidden > 0, got ", rows, ", ", hidden);
  YALI_CHECK_VALUE(scheme >= 0 && scheme <= 2, "scheme must be 0, 1 or 2, got ", scheme);
  return launch_values(get(handle)->fused_quant_launch(size_t(rows), size_t(hidden), to_dtype(dtype),
                                                       yali::QuantScheme(int(scheme)), int(group_size)));
}
// The same from the settings alone (no communicator, no GPU): the fused op's launch table of `world` ranks.
std::vector<int64_t> fused_plan(int64_t rows, int64_t hidden, ScalarType dtype, int64_t world) {
  YALI_CHECK_VALUE(rows > 0 && hidden > 0, "fused_plan needs rows > 0 and hidden > 0, got ", rows, ", ", hidden);
  check_world(world);
  return launch_values(yali::fused_launch_for(config_from_env(), size_t(rows), size_t(hidden), to_dtype(dtype),
                                              int(world)));
}

int64_t device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// The torch the library was compiled against and the stable ABI version it targets.
// Also readable from the file itself (yali_vllm/_ext.py does, when the library fails to load).
std::string build_info() { return yali_build_info; }

}  // namespace

STABLE_TORCH_LIBRARY(yali, m) {
  m.def("create(int device, int rank, int world=2, int ep_slot_bytes=0) -> int");
  m.def("destroy(int comm) -> ()");
  m.def("close_peer(int comm) -> ()");
  m.def("ipc_handle(int comm) -> int[]");
  m.def("open_peer(int comm, int[] peer_handle, int peer_rank=-1) -> ()");
  m.def("attach_peer(int comm, int peer_comm) -> ()");
  m.def("all_reduce(int comm, Tensor input, Tensor(a!) out, int kernel_mode=-1) -> ()");
  m.def(
      "fused_allreduce_rmsnorm(int comm, Tensor input, Tensor? residual, Tensor weight, float eps, "
      "Tensor(a!) norm_out, Tensor(b!) residual_out) -> ()");
  m.def(
      "fused_allreduce_rmsnorm_quant(int comm, Tensor input, Tensor? residual, Tensor weight, float eps, "
      "Tensor(a!) quant_out, Tensor(b!)? residual_out, Tensor(c!) scale, int scheme, int group_size, "
      "bool scale_ue8m0) -> ()");
  m.def("plan(int nbytes, int mode=-1, int world=2) -> int[]");
  m.def("config_string() -> str");
  m.def("plan_table(int world=2) -> str");
  m.def("shared_bytes_for_env(int world=2) -> int");
  m.def("buffer_bytes(int comm) -> int");
  m.def("device_calls(int comm) -> int");
  m.def("device_fused_calls(int comm) -> int");
  m.def("abort_message(int comm) -> str");
  m.def("fused_launch(int comm, int rows, int hidden, ScalarType dtype) -> int[]");
  m.def("fused_plan(int rows, int hidden, ScalarType dtype, int world=2) -> int[]");
  m.def("fused_quant_launch(int comm, int rows, int hidden, ScalarType dtype, int scheme, int group_size) -> int[]");
  m.def("device_count() -> int");
  m.def("build_info() -> str");
  // expert parallelism (see the block above)
  m.def("ep_serves_dispatch(int comm, int[] row_bytes, int[] counts) -> bool");
  m.def("ep_serves_combine(int comm, int hidden, ScalarType dtype, int[] counts) -> bool");
  m.def("ep_dispatch(int comm, Tensor[] inputs, Tensor(a!)[] outputs, int[] counts) -> ()");
  m.def("ep_combine(int comm, Tensor input, Tensor(a!) out, int[] counts) -> ()");
}

// Ops without tensor arguments have no dispatch key to pick: registered for every backend.
STABLE_TORCH_LIBRARY_IMPL(yali, CompositeExplicitAutograd, m) {
  m.impl("create", TORCH_BOX(&create));
  m.impl("destroy", TORCH_BOX(&destroy));
  m.impl("close_peer", TORCH_BOX(&close_peer));
  m.impl("ipc_handle", TORCH_BOX(&ipc_handle));
  m.impl("open_peer", TORCH_BOX(&open_peer));
  m.impl("attach_peer", TORCH_BOX(&attach_peer));
  m.impl("plan", TORCH_BOX(&plan));
  m.impl("config_string", TORCH_BOX(&config_string));
  m.impl("plan_table", TORCH_BOX(&plan_table));
  m.impl("shared_bytes_for_env", TORCH_BOX(&shared_bytes_for_env));
  m.impl("buffer_bytes", TORCH_BOX(&buffer_bytes));
  m.impl("device_calls", TORCH_BOX(&device_calls));
  m.impl("device_fused_calls", TORCH_BOX(&device_fused_calls));
  m.impl("abort_message", TORCH_BOX(&abort_message));
  m.impl("fused_launch", TORCH_BOX(&fused_launch));
  m.impl("fused_plan", TORCH_BOX(&fused_plan));
  m.impl("fused_quant_launch", TORCH_BOX(&fused_quant_launch));
  m.impl("device_count", TORCH_BOX(&device_count));
  m.impl("build_info", TORCH_BOX(&build_info));
  m.impl("ep_serves_dispatch", TORCH_BOX(&ep_serves_dispatch));
  m.impl("ep_serves_combine", TORCH_BOX(&ep_serves_combine));
}

STABLE_TORCH_LIBRARY_IMPL(yali, CUDA, m) {
  m.impl("all_reduce", TORCH_BOX(&all_reduce));
  m.impl("fused_allreduce_rmsnorm", TORCH_BOX(&fused_allreduce_rmsnorm));
  m.impl("fused_allreduce_rmsnorm_quant", TORCH_BOX(&fused_allreduce_rmsnorm_quant));
  m.impl("ep_dispatch", TORCH_BOX(&ep_dispatch));
  m.impl("ep_combine", TORCH_BOX(&ep_combine));
}
