// The launch of a YALI kernel and the one map from DType to the kernels' element type, shared by
// the translation units that launch kernels (communicator.cu, ep.cu).
#pragma once
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "yali/common/config.h"

namespace yali {

// One launch, with programmatic dependent launch when `pdl` (see ptx.cuh:
// DependentLaunchScope, which every YALI kernel opens first).
// `cluster` > 1: as thread block clusters of that many CTAs (it divides grid).
template <typename Args>
inline cudaError_t launch(void (*kernel)(Args), int grid, int threads, cudaStream_t stream, bool pdl, const Args& args,
                   int cluster = 1) {
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = unsigned(cluster);
    attr[n].val.clusterDim.y = 1;
    attr[n++].val.clusterDim.z = 1;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(grid));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, args);
}

// Calls f with a value of dtype's element type; f uses only its type, e.g.
// [&](auto zero) { using T = decltype(zero); ... }: the one place that maps the
// DType enum to the kernels' template argument.
template <typename F>
inline cudaError_t with_element_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32: return f(float{});
    case DType::F16: return f(__half{});
    case DType::BF16: return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// f(std::integral_constant<int, W>{}) with W the world size the N-rank kernels are built for (4,
// 6, 8), or W = 0 (the kernels for any world size) for the others.
template <typename F>
inline cudaError_t with_world(int world, F&& f) {
  switch (world) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

}  // namespace yali
