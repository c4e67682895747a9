// Host-side helpers for CUDA calls (communicator.cu): an error check that throws, and a
// scope that switches the current device and restores it.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace yali {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("yali: ") + what + " failed: " + cudaGetErrorString(e));
}

// Makes `device` current for the scope; restores the caller's device on leaving it.
struct ScopedDevice {
  int saved = -1;
  explicit ScopedDevice(int device) {
    check_cuda(cudaGetDevice(&saved), "cudaGetDevice");
    if (saved != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~ScopedDevice() {
    int now = -1;
    if (saved >= 0 && cudaGetDevice(&now) == cudaSuccess && now != saved) cudaSetDevice(saved);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
};

}  // namespace yali
