#include "rank.h"

#include <cstring>
#include <stdexcept>

#include "flash.cuh"
#include "stream.cuh"

namespace yali {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("yali: ") + what + " failed: " + cudaGetErrorString(e));
}

// Restores the caller's current device when leaving a scope.
struct DeviceGuard {
  int saved = -1;
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&saved), "cudaGetDevice");
    if (saved != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int now = -1;
    if (saved >= 0 && cudaGetDevice(&now) == cudaSuccess && now != saved) cudaSetDevice(saved);
  }
};

template <typename T>
cudaError_t launch_typed(const Plan& p, const FlashArgs& f, const StreamArgs& s, cudaStream_t stream) {
  switch (p.kernel) {
    case Kernel::FlashLL:
      flash_ll_kernel<T><<<p.blocks, kFlashThreads, 0, stream>>>(f);
      break;
    case Kernel::FlashOneShot:
      flash_oneshot_kernel<T><<<p.blocks, kFlashThreads, 0, stream>>>(f);
      break;
    case Kernel::FlashTwoShot:
      flash_twoshot_kernel<T><<<p.blocks, kFlashThreads, 0, stream>>>(f);
      break;
    case Kernel::Stream:
      stream_kernel<T><<<p.blocks, kStreamThreads, 0, stream>>>(s);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

Rank::Rank(int device, int rank, const Config& config)
    : device_(device), rank_(rank), config_(config), layout_(config) {
  if (rank != 0 && rank != 1) throw std::invalid_argument("yali: rank must be 0 or 1");
  config_.validate();
  DeviceGuard guard(device);
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  if (major < 7) throw std::runtime_error("yali: needs compute capability 7.0+ (system-scope acquire/release)");
  check(cudaMalloc(&shared_, layout_.total), "cudaMalloc(shared buffer)");
  check(cudaMemset(shared_, 0, layout_.flags_end), "cudaMemset(flags)");
  check(cudaMalloc(&state_, sizeof(LocalState)), "cudaMalloc(local state)");
  check(cudaMemset(state_, 0, sizeof(LocalState)), "cudaMemset(local state)");
  check(cudaHostAlloc(&abort_host_, sizeof(AbortInfo), cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc(abort record)");
  std::memset(abort_host_, 0, sizeof(AbortInfo));
  check(cudaHostGetDevicePointer(&abort_dev_, abort_host_, 0), "cudaHostGetDevicePointer");
  // The peer may write our flags as soon as it has our handle: they must be zero by then.
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

Rank::~Rank() {
  int saved = -1;
  cudaGetDevice(&saved);
  cudaSetDevice(device_);
  // Nothing may still be using the buffers; errors here are ignored (destructor).
  cudaDeviceSynchronize();
  if (peer_shared_ && peer_is_ipc_) cudaIpcCloseMemHandle(peer_shared_);
  if (shared_) cudaFree(shared_);
  if (state_) cudaFree(state_);
  if (abort_host_) cudaFreeHost(abort_host_);
  if (saved >= 0) cudaSetDevice(saved);
}

IpcHandleBytes Rank::ipc_handle() const {
  DeviceGuard guard(device_);
  cudaIpcMemHandle_t h;
  check(cudaIpcGetMemHandle(&h, shared_), "cudaIpcGetMemHandle");
  IpcHandleBytes out;
  std::memcpy(out.data(), &h, sizeof(h));
  return out;
}

void Rank::open_peer(const IpcHandleBytes& peer) {
  if (peer_shared_) throw std::runtime_error("yali: peer already connected");
  DeviceGuard guard(device_);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, peer.data(), sizeof(h));
  void* p = nullptr;
  check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle(peer buffer)");
  peer_shared_ = static_cast<char*>(p);
  peer_is_ipc_ = true;
}

void Rank::attach_peer(Rank& peer) {
  if (peer_shared_) throw std::runtime_error("yali: peer already connected");
  if (!(peer.config_ == config_)) throw std::invalid_argument("yali: both ranks need the same Config");
  int can = 0;
  check(cudaDeviceCanAccessPeer(&can, device_, peer.device_), "cudaDeviceCanAccessPeer");
  if (!can)
    throw std::runtime_error("yali: GPU " + std::to_string(device_) + " cannot access GPU " +
                             std::to_string(peer.device_) + " (no P2P)");
  DeviceGuard guard(device_);
  cudaError_t e = cudaDeviceEnablePeerAccess(peer.device_, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
  else check(e, "cudaDeviceEnablePeerAccess");
  peer_shared_ = peer.shared_;
  peer_is_ipc_ = false;
}

Plan Rank::plan(size_t nbytes, KernelMode mode) const {
  if (mode == config_.mode) return plan_for(config_, nbytes);
  Config c = config_;
  c.mode = mode;
  return plan_for(c, nbytes);
}

cudaError_t Rank::all_reduce(const void* in, void* out, size_t nbytes, DType dtype, cudaStream_t stream,
                             KernelMode mode) const {
  const Plan p = plan(nbytes, mode);
  if (p.kernel == Kernel::None || !peer_shared_ || nbytes % dtype_size(dtype) != 0 ||
      (reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out)) % 16 != 0)
    return cudaErrorInvalidValue;
  const uint64_t timeout_ns = uint64_t(config_.timeout_s * 1e9);
  auto flags = [](char* base, size_t off) { return reinterpret_cast<uint64_t*>(base + off); };
  FlashArgs f{};
  StreamArgs s{};
  if (p.kernel == Kernel::Stream) {
    s = StreamArgs{in, out, nbytes, p.chunk_bytes, p.blocks, config_.slots, config_.slot_bytes,
                   shared_ + layout_.stream_slots, peer_shared_ + layout_.stream_slots,
                   flags(shared_, layout_.stream_ready), flags(peer_shared_, layout_.stream_ready),
                   flags(shared_, layout_.stream_credit), flags(peer_shared_, layout_.stream_credit),
                   state_, timeout_ns, abort_dev_};
  } else {
    f = FlashArgs{in, out, nbytes, config_.flash_ctas, rank_,
                  flags(shared_, layout_.flash_arrive), flags(peer_shared_, layout_.flash_arrive),
                  flags(shared_, layout_.flash_gather), flags(peer_shared_, layout_.flash_gather),
                  shared_ + layout_.flash_stage, peer_shared_ + layout_.flash_stage,
                  shared_ + layout_.flash_reduced, peer_shared_ + layout_.flash_reduced,
                  config_.flash_bytes, shared_ + layout_.flash_ll, peer_shared_ + layout_.flash_ll,
                  2 * config_.ll_max, state_, timeout_ns, abort_dev_};
  }
  switch (dtype) {
    case DType::F32: return launch_typed<float>(p, f, s, stream);
    case DType::F16: return launch_typed<__half>(p, f, s, stream);
    case DType::BF16: return launch_typed<__nv_bfloat16>(p, f, s, stream);
  }
  return cudaErrorInvalidValue;
}

uint64_t Rank::device_calls() const {
  DeviceGuard guard(device_);
  uint64_t v = 0;
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check(cudaMemcpy(&v, &state_->calls, sizeof(v), cudaMemcpyDeviceToHost), "cudaMemcpy(calls)");
  return v;
}

std::string Rank::abort_message() const {
  const volatile AbortInfo* a = abort_host_;
  if (a->magic != kAbortMagic) return "";
  static const char* whats[] = {"?", "flash arrive flag", "flash gather flag", "stream credit", "stream ready",
                                "flash-ll data"};
  const int w = (a->what >= 1 && a->what <= 5) ? a->what : 0;
  return "yali: rank " + std::to_string(rank_) + " " + kernel_name(Kernel(a->kernel)) + " kernel, block " +
         std::to_string(a->block) + ", gave up after YALI_TIMEOUT_S=" + std::to_string(config_.timeout_s) +
         "s waiting for the peer's " + whats[w] + " (expected >= " + std::to_string(a->expected) + ", saw " +
         std::to_string(a->seen) + "): the peer process died or the two ranks issued different all-reduces";
}

}  // namespace yali
