#include "yali/communicator.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "yali/all_reduce/n_rank.cuh"
#include "yali/all_reduce/push.cuh"
#include "yali/all_reduce/stream.cuh"
#include "yali/common/abort_text.h"
#include "yali/common/cuda_check.h"
#include "yali/common/launch.cuh"
#include "yali/fused/fused.cuh"
#include "yali/fused/n_rank_fused.cuh"

namespace yali {

namespace {

// The 64-bit flag words at byte offset `off` of a shared buffer.
uint64_t* flag_words(char* base, size_t off) { return reinterpret_cast<uint64_t*>(base + off); }

__global__ void fill_words(uint32_t* p, size_t n, uint32_t v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) p[i] = v;
}

}  // namespace

namespace {

int checked_world(int rank, int world) {
  if (world < 2 || world > kMaxRanks)
    throw std::invalid_argument("yali: world size " + std::to_string(world) + " is not in [2, " +
                                std::to_string(kMaxRanks) + "]");
  if (rank < 0 || rank >= world)
    throw std::invalid_argument("yali: rank " + std::to_string(rank) + " is not in [0, " + std::to_string(world) + ")");
  return world;
}

}  // namespace

Rank::Rank(int device, int rank, int world, const Config& config)
    : device_(device), rank_(rank), world_(checked_world(rank, world)), config_(config), layout_(config, world) {
  config_.validate();
  ScopedDevice guard(device);
  int major = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  if (major < 7) throw std::runtime_error("yali: needs compute capability 7.0+ (system-scope acquire/release)");
  check_cuda(cudaMalloc(&shared_, layout_.total), "cudaMalloc(shared buffer)");
  check_cuda(cudaMemset(shared_, 0, layout_.flags_end), "cudaMemset(flags)");
  // The call descriptor slots start empty (call_check.cuh: kCallEmpty is all ones).
  check_cuda(cudaMemset(shared_ + layout_.call_slots, 0xff, layout_.call_slots_bytes), "cudaMemset(call slots)");
  // The push areas (flash-push's with two ranks, the N-rank one with more, the EP area) start empty
  // (exchange.cuh).
  for (const auto& [off, bytes] : {std::pair<size_t, size_t>{layout_.flash_push, layout_.stream_slots - layout_.flash_push},
                                   std::pair<size_t, size_t>{layout_.ranks_push, layout_.total - layout_.ranks_push}})
    if (bytes > 0) fill_words<<<256, 256>>>(reinterpret_cast<uint32_t*>(shared_ + off), bytes / 4, kPushEmpty);
  check_cuda(cudaGetLastError(), "fill(push area)");
  bufs_[rank_] = shared_;
  check_cuda(cudaMalloc(&state_, sizeof(LocalState)), "cudaMalloc(local state)");
  check_cuda(cudaMemset(state_, 0, sizeof(LocalState)), "cudaMemset(local state)");
  check_cuda(cudaHostAlloc(&abort_host_, sizeof(AbortInfo), cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc(abort record)");
  std::memset(abort_host_, 0, sizeof(AbortInfo));
  abort_host_->state = state_;
  abort_host_->call_slots = reinterpret_cast<const uint32_t*>(shared_ + layout_.call_slots);
  abort_host_->world = world_;
  abort_host_->peer = -1;
  check_cuda(cudaHostGetDevicePointer(&abort_dev_, abort_host_, 0), "cudaHostGetDevicePointer");
  // The peer may write our flags as soon as it has our handle: they must be zero by then.
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

Rank::~Rank() {
  int saved = -1;
  cudaGetDevice(&saved);
  cudaSetDevice(device_);
  // Nothing may still be using the buffers; errors here are ignored (destructor).
  cudaDeviceSynchronize();
  if (peer_is_ipc_)
    for (int r = 0; r < world_; ++r)
      if (r != rank_ && bufs_[r]) cudaIpcCloseMemHandle(bufs_[r]);
  if (shared_) cudaFree(shared_);
  if (state_) cudaFree(state_);
  if (abort_host_) cudaFreeHost(abort_host_);
  if (saved >= 0) cudaSetDevice(saved);
}

IpcHandleBytes Rank::ipc_handle() const {
  ScopedDevice guard(device_);
  cudaIpcMemHandle_t h;
  check_cuda(cudaIpcGetMemHandle(&h, shared_), "cudaIpcGetMemHandle");
  IpcHandleBytes out;
  std::memcpy(out.data(), &h, sizeof(h));
  return out;
}

void Rank::open_peer(const IpcHandleBytes& peer) {
  if (world_ != 2)
    throw std::invalid_argument("yali: a communicator of " + std::to_string(world_) +
                                " ranks maps each other rank's buffer by its rank (open_peer(rank, handle))");
  open_peer(1 - rank_, peer);
}

void Rank::open_peer(int peer_rank, const IpcHandleBytes& peer) {
  if (peer_rank < 0 || peer_rank >= world_ || peer_rank == rank_)
    throw std::invalid_argument("yali: rank " + std::to_string(rank_) + " of " + std::to_string(world_) +
                                " cannot map rank " + std::to_string(peer_rank) + "'s buffer");
  if (bufs_[peer_rank]) throw std::runtime_error("yali: rank " + std::to_string(peer_rank) + " already connected");
  ScopedDevice guard(device_);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, peer.data(), sizeof(h));
  void* p = nullptr;
  check_cuda(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
             ("cudaIpcOpenMemHandle(rank " + std::to_string(peer_rank) + "'s buffer)").c_str());
  bufs_[peer_rank] = static_cast<char*>(p);
  peer_is_ipc_ = true;
}

bool Rank::connected() const {
  for (int r = 0; r < world_; ++r)
    if (!bufs_[r]) return false;
  return true;
}

void Rank::attach_peer(Rank& peer) {
  if (world_ != 2 || peer.world_ != 2 || peer.rank_ == rank_)
    throw std::invalid_argument("yali: attach_peer joins the two ranks of a two-rank communicator");
  if (bufs_[peer.rank_]) throw std::runtime_error("yali: peer already connected");
  if (!(peer.config_ == config_)) throw std::invalid_argument("yali: both ranks need the same Config");
  int can = 0;
  check_cuda(cudaDeviceCanAccessPeer(&can, device_, peer.device_), "cudaDeviceCanAccessPeer");
  if (!can)
    throw std::runtime_error("yali: GPU " + std::to_string(device_) + " cannot access GPU " +
                             std::to_string(peer.device_) + " (no P2P)");
  ScopedDevice guard(device_);
  cudaError_t e = cudaDeviceEnablePeerAccess(peer.device_, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
  else check_cuda(e, "cudaDeviceEnablePeerAccess");
  bufs_[peer.rank_] = peer.shared_;
  peer_is_ipc_ = false;
}

void Rank::close_peer() {
  bool any = false;
  for (int r = 0; r < world_; ++r) any |= r != rank_ && bufs_[r] != nullptr;
  if (!any) return;
  ScopedDevice guard(device_);
  cudaDeviceSynchronize();  // errors ignored: a trapped context still unmaps below
  for (int r = 0; r < world_; ++r) {
    if (r == rank_ || !bufs_[r]) continue;
    if (peer_is_ipc_) cudaIpcCloseMemHandle(bufs_[r]);
    bufs_[r] = nullptr;
  }
}

Plan Rank::plan(size_t nbytes, KernelMode mode) const {
  if (mode == config_.mode) return plan_for(config_, nbytes, world_);
  Config c = config_;
  c.mode = mode;
  return plan_for(c, nbytes, world_);
}

cudaError_t Rank::all_reduce(const void* in, void* out, size_t nbytes, DType dtype, cudaStream_t stream,
                             KernelMode mode, const CallDesc* fused) const {
  const Plan p = plan(nbytes, mode);
  if (p.kernel == Kernel::None || !connected() || nbytes % dtype_size(dtype) != 0 ||
      (reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out)) % 16 != 0 ||
      all_reduce_overlap_refusal(in, out, nbytes) != nullptr)
    return cudaErrorInvalidValue;
  const bool pdl = config_.pdl != 0;
  // The call the peer checks: this all-reduce, or the fused op whose first launch it is (then with
  // this launch's kernel and CTAs).
  CallDesc desc = call_desc(CallOp::AllReduce, p.kernel, nbytes, dtype, p.blocks, 0);
  if (fused) {
    desc.w[2] = (fused->w[2] & 0x3u) | (desc.w[2] & ~0x3u);
    desc.w[3] = fused->w[3];
  }
  return with_element_type(dtype, [&](auto zero) {
    using T = decltype(zero);
    switch (p.kernel) {
      case Kernel::FlashPush:
        return launch(flash_push_kernel<T>, p.blocks, kFlashThreads, stream, pdl, exchange_args(in, out, nbytes, desc));
      case Kernel::Stream:
        return launch(stream_kernel<T>, p.blocks, kStreamThreads, stream, pdl, stream_args(in, out, nbytes, p, desc));
      case Kernel::PushOneShot:
        return with_world(world_, [&](auto w) {
          return launch(push_oneshot_kernel<T, decltype(w)::value>, p.blocks, kFlashThreads, stream, pdl,
                        ranks_args(in, out, nbytes, desc));
        });
      case Kernel::PushTwoShot:
        return with_world(world_, [&](auto w) {
          return launch(push_twoshot_kernel<T, decltype(w)::value>, p.blocks, kFlashThreads, stream, pdl,
                        ranks_args(in, out, nbytes, desc));
        });
      default: return cudaErrorInvalidValue;
    }
  });
}

ExchangeArgs Rank::exchange_args(const void* in, void* out, size_t nbytes, const CallDesc& desc) const {
  ExchangeArgs x{};
  x.in = in;
  x.out = out;
  x.nbytes = nbytes;
  x.total_ctas = kMaxFlashCtas;
  x.parity_bytes = config_.flash_bytes;
  x.my_push = shared_ + layout_.flash_push;
  x.peer_push = peer_buf() + layout_.flash_push;
  x.state = state_;
  x.timeout_ns = uint64_t(config_.timeout_s * 1e9);
  x.abort = AbortRef{abort_dev_, desc};
  x.call = call_check(desc);
  return x;
}

CallCheck Rank::call_check(const CallDesc& desc) const {
  CallCheck c;
  c.desc = desc;
  c.my_slots = reinterpret_cast<uint32_t*>(shared_ + layout_.call_slots);
  c.peer_slots = reinterpret_cast<uint32_t*>(peer_buf() + layout_.call_slots);
  return c;
}

RanksArgs Rank::ranks_args(const void* in, void* out, size_t nbytes, const CallDesc& desc) const {
  RanksArgs a{};
  a.in = in;
  a.out = out;
  a.nbytes = nbytes;
  a.rank = rank_;
  a.world = world_;
  a.total_ctas = kMaxFlashCtas;
  a.slot_bytes = layout_.ranks_slot;
  a.push_off = layout_.ranks_push;
  a.call_off = layout_.call_slots;
  for (int r = 0; r < world_; ++r) a.bufs[r] = bufs_[r];
  a.state = state_;
  a.timeout_ns = uint64_t(config_.timeout_s * 1e9);
  a.abort = AbortRef{abort_dev_, desc};
  a.call = desc;
  a.round_vecs = config_.ranks_two_shot_round / 16;
  return a;
}

StreamArgs Rank::stream_args(const void* in, void* out, size_t nbytes, const Plan& p, const CallDesc& desc) const {
  return StreamArgs{in, out, nbytes, p.chunk_bytes, p.blocks, kStreamSlots, config_.slot_bytes,
                    shared_ + layout_.stream_slots, peer_buf() + layout_.stream_slots,
                    flag_words(shared_, layout_.stream_ready), flag_words(peer_buf(), layout_.stream_ready),
                    flag_words(shared_, layout_.stream_credit), flag_words(peer_buf(), layout_.stream_credit),
                    state_, uint64_t(config_.timeout_s * 1e9), AbortRef{abort_dev_, desc}, call_check(desc)};
}


namespace {

// Maps the fused op's launch (fused_launch_for over plan_table.h: the one place that decides it) to a
// kernel instance.
template <typename T, int kV>
cudaError_t launch_fused_with(const FusedArgs& a, const FusedLaunch& l, cudaStream_t stream) {
  void (*kernel)(FusedArgs);
  if (!l.one_launch) kernel = add_rmsnorm_kernel<T, kV>;
  else if (l.batch_poll) kernel = l.row_loads_early ? fused_allreduce_rmsnorm_kernel<T, kV, true, true>
                                                    : fused_allreduce_rmsnorm_kernel<T, kV, true, false>;
  else kernel = l.row_loads_early ? fused_allreduce_rmsnorm_kernel<T, kV, false, true>
                                  : fused_allreduce_rmsnorm_kernel<T, kV, false, false>;
  return launch(kernel, l.grid, kFlashThreads, stream, l.pdl, a, l.cluster);
}

template <typename T>
cudaError_t launch_fused(const FusedArgs& a, const FusedLaunch& l, cudaStream_t stream) {
  switch (l.row_vecs_per_thread) {
    case 1: return launch_fused_with<T, 1>(a, l, stream);
    case 2: return launch_fused_with<T, 2>(a, l, stream);
    case 4: return launch_fused_with<T, 4>(a, l, stream);
    case 8: return launch_fused_with<T, 8>(a, l, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool Rank::fused_one_launch(size_t rows, size_t hidden, DType dtype) const {
  return fused_launch(rows, hidden, dtype).one_launch;
}

FusedLaunch Rank::fused_launch(size_t rows, size_t hidden, DType dtype) const {
  return fused_launch_for(config_, rows, hidden, dtype, world_);
}

cudaError_t Rank::fused_allreduce_rmsnorm(const void* in, const void* residual, const void* weight, float eps,
                                          void* norm_out, void* residual_out, size_t rows, size_t hidden,
                                          DType dtype, cudaStream_t stream) const {
  const size_t row_bytes = hidden * dtype_size(dtype);
  const uintptr_t any = reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(residual) |
                        reinterpret_cast<uintptr_t>(weight) | reinterpret_cast<uintptr_t>(norm_out) |
                        reinterpret_cast<uintptr_t>(residual_out);
  if (!connected() || rows == 0 || hidden == 0 || row_bytes % 16 != 0 || row_bytes > kFusedMaxRowBytes ||
      any % 16 != 0 || rows > size_t(INT32_MAX) ||
      fused_overlap_refusal(in, residual, weight, norm_out, residual_out, rows * row_bytes, row_bytes) != nullptr)
    return cudaErrorInvalidValue;
  if (world_ > 2) return ranks_fused(in, residual, weight, eps, norm_out, residual_out, rows, hidden, dtype, stream);
  const size_t nbytes = rows * row_bytes;
  const FusedLaunch l = fused_launch(rows, hidden, dtype);
  const CallDesc desc = call_desc(CallOp::Fused, Kernel::FlashPush, nbytes, dtype, l.grid, hidden);
  FusedArgs a{};
  a.x = exchange_args(in, nullptr, nbytes, desc);
  a.n.residual = residual;
  a.n.weight = weight;
  a.n.norm_out = norm_out;
  a.n.residual_out = residual_out;
  a.n.rows = int(rows);
  a.n.row_vecs = int(row_bytes / 16);
  a.n.hidden = int(hidden);
  a.n.eps = eps;
  if (!l.one_launch) {
    // All-reduce into norm_out (never residual, which may alias residual_out),
    // then the epilogue reads the sum from there, row by row.
    const cudaError_t e = all_reduce(in, norm_out, nbytes, dtype, stream, config_.mode, &desc);
    if (e != cudaSuccess) return e;
    a.sum = norm_out;
  }
  return with_element_type(dtype, [&](auto zero) { return launch_fused<decltype(zero)>(a, l, stream); });
}

namespace {

template <typename T, int kV>
cudaError_t launch_fused_ranks_with(const FusedRanksArgs& a, const FusedLaunch& l, cudaStream_t stream) {
  return with_world(a.x.world, [&](auto w) {
    constexpr int kW = decltype(w)::value;
    if (l.spread > 1)
      return launch(fused_ranks_spread_kernel<T, kV, kW>, l.grid, kFlashThreads, stream, l.pdl, a, l.cluster);
    return launch(l.row_loads_early ? fused_ranks_kernel<T, kV, true, kW> : fused_ranks_kernel<T, kV, false, kW>,
                  l.grid, kFlashThreads, stream, l.pdl, a, l.cluster);
  });
}

template <typename T>
cudaError_t launch_fused_ranks(const FusedRanksArgs& a, const FusedLaunch& l, cudaStream_t stream) {
  switch (l.row_vecs_per_thread) {
    case 1: return launch_fused_ranks_with<T, 1>(a, l, stream);
    case 2: return launch_fused_ranks_with<T, 2>(a, l, stream);
    case 4: return launch_fused_ranks_with<T, 4>(a, l, stream);
    case 8: return launch_fused_ranks_with<T, 8>(a, l, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

// N ranks: one launch of fused_ranks_kernel up to ranks_fused_one_launch_max (within one rank's slot), else the
// N-rank all-reduce into norm_out and the epilogue alone (add_rmsnorm_kernel), as with two ranks.
cudaError_t Rank::ranks_fused(const void* in, const void* residual, const void* weight, float eps, void* norm_out,
                              void* residual_out, size_t rows, size_t hidden, DType dtype, cudaStream_t stream) const {
  const size_t row_bytes = hidden * dtype_size(dtype), nbytes = rows * row_bytes;
  const RowNorm n{residual, weight, norm_out, residual_out, int(rows), int(row_bytes / 16), int(hidden), eps};
  const FusedLaunch l = fused_launch(rows, hidden, dtype);
  const CallDesc desc = call_desc(CallOp::Fused, Kernel::PushOneShot, nbytes, dtype, l.grid, hidden);
  if (l.one_launch) {
    const FusedRanksArgs a{ranks_args(in, nullptr, nbytes, desc), n};
    return with_element_type(dtype, [&](auto zero) { return launch_fused_ranks<decltype(zero)>(a, l, stream); });
  }
  const cudaError_t e = all_reduce(in, norm_out, nbytes, dtype, stream, config_.mode, &desc);
  if (e != cudaSuccess) return e;
  FusedArgs a{};
  a.x.state = state_;  // the epilogue counts the fused call there
  a.sum = norm_out;
  a.n = n;
  return with_element_type(dtype, [&](auto zero) { return launch_fused<decltype(zero)>(a, l, stream); });
}

uint64_t Rank::device_fused_calls() const {
  ScopedDevice guard(device_);
  uint64_t v = 0;
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_cuda(cudaMemcpy(&v, &state_->fused_calls, sizeof(v), cudaMemcpyDeviceToHost), "cudaMemcpy(fused calls)");
  return v;
}

uint64_t Rank::device_calls() const {
  ScopedDevice guard(device_);
  uint64_t v = 0;
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_cuda(cudaMemcpy(&v, &state_->calls, sizeof(v), cudaMemcpyDeviceToHost), "cudaMemcpy(calls)");
  return v;
}

bool Rank::aborted() const { return static_cast<const volatile AbortInfo*>(abort_host_)->magic == kAbortMagic; }

std::string Rank::abort_message() const {
  const volatile AbortInfo* v = abort_host_;
  if (v->magic != kAbortMagic) return "";
  AbortInfo a{};  // a plain copy of the record the kernel wrote
  a.magic = v->magic;
  a.kernel = v->kernel;
  a.block = v->block;
  a.what = v->what;
  a.expected = v->expected;
  a.seen = v->seen;
  for (int i = 0; i < 4; ++i) {
    a.mine.w[i] = v->mine.w[i];
    a.theirs.w[i] = v->theirs.w[i];
  }
  a.world = v->world;
  a.peer = v->peer;
  return abort_text(a, rank_, world_, config_.timeout_s);
}

}  // namespace yali
