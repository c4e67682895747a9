// Minimal use of the YALI C++ API: one process, GPUs 0 and 1, 1M bf16 elements.
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -I csrc/core \
//        examples/allreduce_example.cu csrc/core/yali/communicator.cu csrc/core/yali/common/config.cpp \
//        csrc/core/yali/common/plan.cpp csrc/core/yali/common/abort_text.cpp -o allreduce_example
#include <cstdio>
#include <vector>

#include "yali/yali.h"

int main() {
  const size_t count = 1 << 20;
  std::vector<__nv_bfloat16> h0(count), h1(count), out(count);
  for (size_t i = 0; i < count; ++i) {
    h0[i] = __float2bfloat16(float(i % 97) * 0.25f);
    h1[i] = __float2bfloat16(float(i % 89) * -0.5f);
  }
  __nv_bfloat16 *d0, *d1;
  cudaSetDevice(0);
  cudaMalloc(&d0, count * sizeof(*d0));
  cudaMemcpy(d0, h0.data(), count * sizeof(*d0), cudaMemcpyHostToDevice);
  cudaSetDevice(1);
  cudaMalloc(&d1, count * sizeof(*d1));
  cudaMemcpy(d1, h1.data(), count * sizeof(*d1), cudaMemcpyHostToDevice);
  try {
    yali::Comm comm(0, 1);
    yali::allreduce(comm, d0, d0, d1, d1, count);  // in place on both GPUs
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  size_t bad = 0;
  for (int dev = 0; dev < 2; ++dev) {
    cudaSetDevice(dev);
    if (cudaDeviceSynchronize() != cudaSuccess) return 2;
    cudaMemcpy(out.data(), dev == 0 ? d0 : d1, count * sizeof(*d0), cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < count; ++i) {
      const float want = __bfloat162float(__float2bfloat16(__bfloat162float(h0[i]) + __bfloat162float(h1[i])));
      if (__bfloat162float(out[i]) != want) ++bad;
    }
  }
  std::printf("yali allreduce example: %zu elements, %zu mismatches\n", count, bad);
  return bad == 0 ? 0 : 3;
}
