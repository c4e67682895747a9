// Stand-ins for the kernel in front of a decode GEMM, for research/gemm_after_bench.py: the
// shape of YALI's fused all-reduce + RMSNorm (512 threads, at most one CTA per SM, CTA b owns rows
// b, b + grid, ...) with no communication, launched with a chosen grid, thread block cluster size
// and programmatic dependent launch. The cuBLAS gate_up GEMM runs ~10 % slower after a
// plain launch of YALI's op than after a cluster launch of it or FlashInfer's kernel
// (benchmarks/results/current/decode-gemm/20261122-gate-up); these launch
// the same work in every shape so that one GPU can tell which part of the launch matters.
//
// Plain C ABI (ctypes), no torch: nvcc -O3 -shared -Xcompiler -fPIC -arch=sm_90a -o probe.so probe_kernels.cu
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace {

constexpr int kThreads = 512;

// out[row] = x[row] * rsqrt(mean(x[row]^2) + eps) * w, rows of `hidden` bf16 (hidden % 8 == 0).
__global__ void __launch_bounds__(kThreads, 1)
    row_rmsnorm(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* out, int rows, int hidden, float eps) {
  // With programmatic dependent launch the kernel may start before the previous one finished:
  // wait for its memory here (a no-op in a plain launch), as YALI's kernels do first.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  __shared__ float warp_sums[kThreads / 32];
  const int vecs = hidden / 8;
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    const uint4* xr = reinterpret_cast<const uint4*>(x + size_t(row) * hidden);
    float sq = 0.f;
    for (int j = threadIdx.x; j < vecs; j += kThreads) {
      const uint4 v = xr[j];
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        sq += f.x * f.x + f.y * f.y;
      }
    }
    for (int off = 16; off > 0; off >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);
    __syncthreads();  // the previous row's readers are done with warp_sums
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = sq;
    __syncthreads();
    float total = 0.f;
    for (int k = 0; k < kThreads / 32; ++k) total += warp_sums[k];
    const float inv = rsqrtf(total / float(hidden) + eps);
    uint4* orow = reinterpret_cast<uint4*>(out + size_t(row) * hidden);
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    for (int j = threadIdx.x; j < vecs; j += kThreads) {
      uint4 v = xr[j];
      const uint4 g = wv[j];
      __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
      const __nv_bfloat162* gh = reinterpret_cast<const __nv_bfloat162*>(&g);
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        const float2 s = __bfloat1622float2(gh[i]);
        h[i] = __floats2bfloat162_rn(f.x * inv * s.x, f.y * inv * s.y);
      }
      orow[j] = v;
    }
  }
}

// A kernel that fills an SM (all of its shared memory): how many clusters of a size fit at once
// tells how the GPU's SMs are spread over its GPCs (cudaOccupancyMaxActiveClusters).
__global__ void full_sm() {
  extern __shared__ char smem[];
  smem[threadIdx.x] = 0;
}

}  // namespace

// Launches row_rmsnorm on `stream` (0: the legacy default stream) as `grid` CTAs in clusters of
// `cluster` (1: no clusters; must divide grid), with programmatic dependent launch when `pdl`.
// Returns the cudaError_t.
extern "C" int probe_rmsnorm(void* stream, int grid, int cluster, int pdl, const void* x, const void* w, void* out,
                             int rows, int hidden, float eps) {
  if (grid < 1 || cluster < 1 || grid % cluster != 0 || hidden % 8 != 0) return int(cudaErrorInvalidValue);
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(grid));
  cfg.blockDim = dim3(unsigned(kThreads));
  cfg.stream = static_cast<cudaStream_t>(stream);
  cfg.attrs = attr;
  unsigned n = 0;
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = unsigned(cluster);
    attr[n].val.clusterDim.y = 1;
    attr[n++].val.clusterDim.z = 1;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  cfg.numAttrs = n;
  return int(cudaLaunchKernelEx(&cfg, row_rmsnorm, static_cast<const __nv_bfloat16*>(x),
                                static_cast<const __nv_bfloat16*>(w), static_cast<__nv_bfloat16*>(out), rows, hidden,
                                eps));
}

// How many clusters of `cluster` CTAs, each CTA filling an SM, the GPU runs at once (into *out).
// Returns the cudaError_t.
extern "C" int probe_max_active_clusters(int cluster, int* out) {
  int device = 0, smem = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(full_sm, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess && cluster > 8)
    e = cudaFuncSetAttribute(full_sm, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (e != cudaSuccess) return int(e);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;  // also for 1: the query needs a cluster shape
  attr[0].val.clusterDim.x = unsigned(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(cluster));
  cfg.blockDim = dim3(128);
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return int(cudaOccupancyMaxActiveClusters(out, full_sm, &cfg));
}
