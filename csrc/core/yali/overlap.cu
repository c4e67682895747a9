#include "overlap.h"

#include <algorithm>
#include <cstring>

#include "cuda_check.h"
#include "overlap.cuh"

namespace yali {

namespace {

uint64_t* words(char* base, size_t off) { return reinterpret_cast<uint64_t*>(base + off); }

template <typename T>
cudaError_t launch_consume(const OverlapConsumeArgs& c, int grid, cudaStream_t stream) {
  const int per_thread = (c.a.n.row_vecs + kFlashThreads - 1) / kFlashThreads;
  if (per_thread <= 1) overlap_consume_kernel<T, 1><<<grid, kFlashThreads, 0, stream>>>(c);
  else if (per_thread <= 2) overlap_consume_kernel<T, 2><<<grid, kFlashThreads, 0, stream>>>(c);
  else if (per_thread <= 4) overlap_consume_kernel<T, 4><<<grid, kFlashThreads, 0, stream>>>(c);
  else if (per_thread <= 8) overlap_consume_kernel<T, 8><<<grid, kFlashThreads, 0, stream>>>(c);
  else return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace

Overlap::Overlap(int device, int rank, size_t slot_bytes, double timeout_s)
    : device_(device),
      rank_(rank),
      slot_bytes_(slot_bytes),
      timeout_ns_(uint64_t(timeout_s * 1e9)),
      timeout_s_(timeout_s),
      layout_(slot_bytes) {
  if (slot_bytes == 0 || slot_bytes % 256 != 0)
    throw std::invalid_argument("yali: the overlap slot size must be a positive multiple of 256 bytes");
  ScopedDevice guard(device);
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  consumer_ctas_ = std::max(1, sms - kOverlapFreeSms);
  check_cuda(cudaMalloc(&shared_, layout_.total), "cudaMalloc(overlap buffer)");
  check_cuda(cudaMemset(shared_, 0, layout_.flags_end), "cudaMemset(overlap flags)");
  check_cuda(cudaMalloc(&state_, sizeof(OverlapState)), "cudaMalloc(overlap state)");
  check_cuda(cudaMemset(state_, 0, sizeof(OverlapState)), "cudaMemset(overlap state)");
  check_cuda(cudaHostAlloc(&abort_host_, sizeof(AbortInfo), cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc(overlap abort record)");
  std::memset(abort_host_, 0, sizeof(AbortInfo));
  check_cuda(cudaHostGetDevicePointer(&abort_dev_, abort_host_, 0), "cudaHostGetDevicePointer");
  // The peer may store our flags as soon as it has our handle: they must be zero by then.
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

Overlap::~Overlap() {
  int saved = -1;
  cudaGetDevice(&saved);
  cudaSetDevice(device_);
  cudaDeviceSynchronize();  // errors ignored (destructor)
  if (peer_shared_) cudaIpcCloseMemHandle(peer_shared_);
  if (shared_) cudaFree(shared_);
  if (state_) cudaFree(state_);
  if (abort_host_) cudaFreeHost(abort_host_);
  if (saved >= 0) cudaSetDevice(saved);
}

IpcHandleBytes Overlap::ipc_handle() const {
  ScopedDevice guard(device_);
  cudaIpcMemHandle_t h;
  check_cuda(cudaIpcGetMemHandle(&h, shared_), "cudaIpcGetMemHandle(overlap buffer)");
  IpcHandleBytes out;
  std::memcpy(out.data(), &h, sizeof(h));
  return out;
}

void Overlap::open_peer(const IpcHandleBytes& peer) {
  if (peer_shared_) throw std::runtime_error("yali: overlap peer already connected");
  ScopedDevice guard(device_);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, peer.data(), sizeof(h));
  void* p = nullptr;
  check_cuda(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle(peer overlap buffer)");
  peer_shared_ = static_cast<char*>(p);
}

void Overlap::close_peer() {
  if (!peer_shared_) return;
  ScopedDevice guard(device_);
  cudaDeviceSynchronize();  // errors ignored: a trapped context still unmaps below
  cudaIpcCloseMemHandle(peer_shared_);
  peer_shared_ = nullptr;
}

cudaError_t Overlap::send(const void* src, size_t offset, size_t nbytes, int slot, int chunk,
                          cudaStream_t stream) const {
  if (!peer_shared_ || slot < 0 || slot > 1 || chunk < 0 || chunk >= kOverlapMaxChunks || offset > slot_bytes_ ||
      nbytes > slot_bytes_ - offset)
    return cudaErrorInvalidValue;
  const OverlapSendArgs a{state_, words(shared_, layout_.credit), words(peer_shared_, layout_.ready),
                          slot, chunk, timeout_ns_, abort_dev_};
  if (chunk == 0) {
    overlap_claim_kernel<<<1, 1, 0, stream>>>(a);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (nbytes != 0) {
    char* dst = peer_shared_ + layout_.slots + size_t(slot) * slot_bytes_ + offset;
    if (const cudaError_t e = cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream); e != cudaSuccess) return e;
  }
  overlap_flag_kernel<<<1, 1, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t Overlap::consume(const void* partial, const void* residual, const void* weight, float eps,
                             void* norm_out, void* residual_out, size_t rows, size_t hidden, size_t chunk_rows,
                             DType dtype, int slot, cudaStream_t stream) const {
  const size_t row_bytes = hidden * dtype_size(dtype);
  const uintptr_t any = reinterpret_cast<uintptr_t>(partial) | reinterpret_cast<uintptr_t>(residual) |
                        reinterpret_cast<uintptr_t>(weight) | reinterpret_cast<uintptr_t>(norm_out) |
                        reinterpret_cast<uintptr_t>(residual_out);
  if (!peer_shared_ || slot < 0 || slot > 1 || rows == 0 || hidden == 0 || chunk_rows == 0 ||
      row_bytes % 16 != 0 || row_bytes > kFusedMaxRowBytes || any % 16 != 0 || rows * row_bytes > slot_bytes_ ||
      (rows + chunk_rows - 1) / chunk_rows > size_t(kOverlapMaxChunks))
    return cudaErrorInvalidValue;
  OverlapConsumeArgs c{};
  c.a.sum = partial;
  c.a.n.residual = residual;
  c.a.n.weight = weight;
  c.a.n.norm_out = norm_out;
  c.a.n.residual_out = residual_out;
  c.a.n.rows = int(rows);
  c.a.n.row_vecs = int(row_bytes / 16);
  c.a.n.hidden = int(hidden);
  c.a.n.eps = eps;
  c.theirs = shared_ + layout_.slots + size_t(slot) * slot_bytes_;
  c.ready = words(shared_, layout_.ready) + slot * kOverlapMaxChunks;
  c.peer_credit = words(peer_shared_, layout_.credit) + slot;
  c.state = state_;
  c.slot = slot;
  c.chunk_rows = int(std::min(chunk_rows, rows));
  c.timeout_ns = timeout_ns_;
  c.abort = abort_dev_;
  const int grid = int(std::min<size_t>(rows, size_t(consumer_ctas_)));
  switch (dtype) {
    case DType::F32: return launch_consume<float>(c, grid, stream);
    case DType::F16: return launch_consume<__half>(c, grid, stream);
    case DType::BF16: return launch_consume<__nv_bfloat16>(c, grid, stream);
  }
  return cudaErrorInvalidValue;
}

uint64_t Overlap::device_calls() const {
  ScopedDevice guard(device_);
  uint64_t v = 0;
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_cuda(cudaMemcpy(&v, &state_->calls, sizeof(v), cudaMemcpyDeviceToHost), "cudaMemcpy(overlap calls)");
  return v;
}

bool Overlap::aborted() const { return static_cast<const volatile AbortInfo*>(abort_host_)->magic == kAbortMagic; }

std::string Overlap::abort_message() const {
  const volatile AbortInfo* a = abort_host_;
  if (a->magic != kAbortMagic) return "";
  const std::string what = a->what == kOverlapWaitCredit
                               ? "credit for its receive slot (its consumer of an earlier call had not run)"
                               : "flag of GEMM chunk " + std::to_string(a->what - 1);
  return "yali: rank " + std::to_string(rank_) + " overlapped GEMM + all-reduce + RMSNorm, block " +
         std::to_string(a->block) + ", gave up after YALI_TIMEOUT_S=" + std::to_string(timeout_s_) +
         "s waiting for the peer's " + what + " (expected >= " + std::to_string(a->expected) + ", saw " +
         std::to_string(a->seen) + "): the peer process died or the two ranks issued different calls";
}

}  // namespace yali
