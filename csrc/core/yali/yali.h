// YALI C++ API: one process driving both GPUs.
//
//   yali::Comm comm(0, 1);                      // GPUs 0 and 1, Config from YALI_* env vars
//   yali::allreduce(comm, send0, recv0, send1, recv1, count);   // float, __half or __nv_bfloat16
//
// The two launches go to each GPU's stream (default: the legacy default stream
// of each device) and return immediately; synchronise the streams to wait.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "yali/common/config.h"
#include "yali/communicator.h"

namespace yali {

class Comm {
 public:
  Comm(int device0, int device1, const Config& config = Config::from_env())
      : r0_(std::make_unique<Rank>(device0, 0, config)), r1_(std::make_unique<Rank>(device1, 1, config)) {
    r0_->attach_peer(*r1_);
    r1_->attach_peer(*r0_);
  }
  // Both GPUs finish their work before either buffer is freed: a kernel on one GPU may still
  // write into the other's buffer.
  ~Comm() {
    for (Rank* r : {r0_.get(), r1_.get()}) r->close_peer();
  }
  Rank& rank(int r) { return r == 0 ? *r0_ : *r1_; }

 private:
  std::unique_ptr<Rank> r0_, r1_;
};

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<__half>() { return DType::F16; }
template <> constexpr DType dtype_of<__nv_bfloat16>() { return DType::BF16; }

// Sums send0 and send1 element-wise into recv0 (on GPU 0) and recv1 (on GPU 1).
// In-place (recvN == sendN) is allowed, any other overlap is not. Throws std::runtime_error on failure.
template <typename T>
void allreduce(Comm& comm, const T* send0, T* recv0, const T* send1, T* recv1, size_t count,
               cudaStream_t stream0 = nullptr, cudaStream_t stream1 = nullptr) {
  const size_t nbytes = count * sizeof(T);
  const void* sends[2] = {send0, send1};
  void* recvs[2] = {recv0, recv1};
  // Both ranks' calls are checked before either is launched: a launch on one GPU whose peer call
  // is refused would wait for the watchdog.
  for (int r = 0; r < 2; ++r) {
    Rank& rank = comm.rank(r);
    if (rank.plan(nbytes, rank.config().mode).kernel == Kernel::None)
      throw std::runtime_error("yali::allreduce: " + std::to_string(nbytes) +
                               " bytes is not served by this Config (see YALI_MAX_BYTES / YALI_KERNEL_MODE)");
    if ((reinterpret_cast<uintptr_t>(sends[r]) | reinterpret_cast<uintptr_t>(recvs[r])) % 16 != 0)
      throw std::runtime_error("yali::allreduce: rank " + std::to_string(r) +
                               "'s pointers are not 16-byte aligned");
    if (const char* overlap = all_reduce_overlap_refusal(sends[r], recvs[r], nbytes))
      throw std::runtime_error("yali::allreduce: rank " + std::to_string(r) + ": " + overlap);
  }
  for (int r = 0; r < 2; ++r) {
    Rank& rank = comm.rank(r);
    int saved = 0;
    cudaGetDevice(&saved);
    cudaSetDevice(rank.device());
    const cudaError_t e = rank.all_reduce(sends[r], recvs[r], nbytes, dtype_of<T>(), r == 0 ? stream0 : stream1,
                                          rank.config().mode);
    cudaSetDevice(saved);
    if (e != cudaSuccess)
      throw std::runtime_error(std::string("yali::allreduce: launch on rank ") + std::to_string(r) +
                               " failed: " + cudaGetErrorString(e) +
                               (rank.aborted() ? " <- " + rank.abort_message() : std::string()));
  }
}

}  // namespace yali
