// A decode GEMM that streams its weights while the kernel in front of it still runs, for
// research/decode_prefetch/bench.py.
//
//   y[M, N] = x[M, K] @ W[N, K]^T      bf16 in and out, fp32 accumulation, M <= 64 tokens
//
// W is stored as vLLM stores a linear layer's weight ([N, K], K contiguous), so the cuBLAS
// reference is F.linear(x, W). The weights do not depend on the kernel in front (an all-reduce in a
// decoder layer); x does. So each CTA starts the bulk copies of its first pipeline stages of W
// before `griddepcontrol.wait`, and copies x only after it. Launched with programmatic dependent
// launch behind a kernel that runs `griddepcontrol.launch_dependents` early, the weight stream
// starts while that kernel runs; launched plainly, the wait is a no-op.
//
// Work split: CTA b of G owns the rows [b*N/G, (b+1)*N/G) of W (balanced to one row) over all of K.
// One producer warp streams that slice through a ring of shared-memory stages with cp.async.bulk
// (one copy per row and stage, completing on the stage's mbarrier); 8 consumer warps multiply each
// stage with mma.sync m16n8k16 (W rows as A, tokens as B). A CTA of few 16-row tiles also splits
// each stage's K among its warps; the warps' partial sums meet in shared memory (fp32 atomics) and
// the CTA writes its slice of y.
//
// Register layout: a lane (g = lane/4, t = lane%4) reads 16 bytes of a W row (k = 8t..8t+7 of a
// 32-wide k-step) and the same 16 bytes of a token row; the two mma k16 halves of the step take
// elements 0-3 and 4-7. A dot product does not care in which order k is summed, as long as A and B
// use the same order, so no ldmatrix or shuffles are needed.
//
// Plain C ABI (ctypes), no torch:
//   nvcc -O3 -shared -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a -o pg.so prefetch_gemm.cu
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kConsumerWarps = 8;
constexpr int kThreads = (kConsumerWarps + 1) * 32;  // + the producer warp
constexpr int kMaxTokens = 64;
constexpr int kMaxTilesPerWarp = 2;
constexpr int kMaxRows = kConsumerWarps * kMaxTilesPerWarp * 16;  // rows of W one CTA may own
constexpr int kMaxStages = 16;
constexpr int kSmemBudget = 200 * 1024;  // leaves room on the SM for the kernel in front

// The stage layout, the same on host and device.
struct Plan {
  int grid;       // CTAs
  int kc;         // k columns per stage (a multiple of 64 dividing K)
  int stages;     // ring depth
  int row_alloc;  // W rows per stage buffer (the largest slice, rounded up to 16)
  int tok_alloc;  // token rows per stage buffer (M rounded up to 8)
  int stride;     // bytes per row in a stage buffer: 2*kc + 64, so rows 2q and 2q+1 use different banks
  int smem;       // dynamic shared memory bytes
};

// Token tiles of 8 the kernel computes for M tokens: one of the instantiated 1, 2, 4, 8.
inline int token_tiles(int M) { return M <= 8 ? 1 : M <= 16 ? 2 : M <= 32 ? 4 : 8; }

__host__ __device__ inline int stage_bytes(const Plan& p) { return (p.row_alloc + p.tok_alloc) * p.stride; }

// Returns false when the shape is out of this kernel's range.
bool make_plan(int M, int N, int K, int grid, Plan* p) {
  if (M < 1 || M > kMaxTokens || N < 1 || K < 64 || K % 64 != 0 || grid < 1) return false;
  p->grid = grid;
  const int rows = (N + grid - 1) / grid;
  if (rows > kMaxRows) return false;
  p->row_alloc = (rows + 15) / 16 * 16;
  p->tok_alloc = 8 * token_tiles(M);
  // The widest stage that still leaves 4 stages in the budget (2 at the narrowest).
  const int bar_bytes = 2 * kMaxStages * 8;
  for (int kc : {256, 128, 64}) {
    if (K % kc != 0) continue;
    p->kc = kc;
    p->stride = 2 * kc + 64;
    p->stages = (kSmemBudget - bar_bytes) / stage_bytes(*p);
    if (p->stages >= 4 || kc == 64) break;
  }
  if (p->stages > kMaxStages) p->stages = kMaxStages;
  if (p->stages > K / p->kc) p->stages = K / p->kc;
  if (p->stages < 2 && K / p->kc >= 2) return false;
  p->smem = bar_bytes + p->stages * stage_bytes(*p);
  // The reduction buffer (fp32, rows x tokens) reuses the ring.
  if (p->row_alloc * p->tok_alloc * 4 > p->stages * stage_bytes(*p)) return false;
  return true;
}

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// One bulk copy global -> this CTA's shared memory, completing `bytes` on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// NT: token tiles of 8 (M <= 8 * NT).
template <int NT>
__global__ void __launch_bounds__(kThreads, 1)
    prefetch_gemm(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x,
                  __nv_bfloat16* __restrict__ y, int M, int N, int K, Plan p) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxStages;
  unsigned char* ring = smem + 2 * kMaxStages * 8;
  const int sbytes = stage_bytes(p);

  const int r0 = int(int64_t(blockIdx.x) * N / gridDim.x);
  const int rows = int(int64_t(blockIdx.x + 1) * N / gridDim.x) - r0;
  const int nk = K / p.kc;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == kConsumerWarps) {
    // Producer: lane l copies rows l, l+32, ... of each stage.
    const uint32_t row_bytes = uint32_t(p.kc) * 2;
    const uint32_t tx = uint32_t(rows + M) * row_bytes;
    auto copy_w = [&](int i) {
      unsigned char* buf = ring + (i % p.stages) * sbytes;
      const __nv_bfloat16* src = w + int64_t(r0) * K + int64_t(i) * p.kc;
      for (int r = lane; r < rows; r += 32) bulk_copy(buf + r * p.stride, src + int64_t(r) * K, row_bytes, &full[i % p.stages]);
    };
    auto copy_x = [&](int i) {
      unsigned char* buf = ring + (i % p.stages) * sbytes + p.row_alloc * p.stride;
      for (int m = lane; m < M; m += 32)
        bulk_copy(buf + m * p.stride, x + int64_t(m) * K + int64_t(i) * p.kc, row_bytes, &full[i % p.stages]);
    };
    // The weights of the first stages do not depend on the kernel in front: start them now.
    const int early = nk < p.stages ? nk : p.stages;
    for (int i = 0; i < early; ++i) {
      if (lane == 0) mbar_arrive_expect_tx(&full[i], tx);
      copy_w(i);
    }
    grid_dependency_wait();  // x is the kernel in front's output
    for (int i = 0; i < early; ++i) copy_x(i);
    for (int i = early; i < nk; ++i) {
      mbar_wait(&empty[i % p.stages], ((i / p.stages) + 1) & 1);
      if (lane == 0) mbar_arrive_expect_tx(&full[i % p.stages], tx);
      copy_w(i);
      copy_x(i);
    }
  } else {
    // Consumers. T tiles of 16 rows; KG groups of warps split each stage's k-steps.
    const int tiles = (rows + 15) / 16;
    const int kg_count = tiles <= 1 ? 8 : tiles <= 2 ? 4 : tiles <= 4 ? 2 : 1;
    const int tile_warps = kConsumerWarps / kg_count;
    const int kg = warp / tile_warps, tw = warp % tile_warps;
    const int g = lane / 4, t = lane % 4;
    const int steps = p.kc / 32;

    float acc[kMaxTilesPerWarp][NT][4];
#pragma unroll
    for (int j = 0; j < kMaxTilesPerWarp; ++j)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][n][e] = 0.f;

    for (int i = 0; i < nk; ++i) {
      const int slot = i % p.stages;
      mbar_wait(&full[slot], (i / p.stages) & 1);
      const unsigned char* wbuf = ring + slot * sbytes;
      const unsigned char* xbuf = wbuf + p.row_alloc * p.stride;
      for (int s = kg; s < steps; s += kg_count) {
        const int off = s * 64 + t * 16;
        uint4 b[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n) b[n] = *reinterpret_cast<const uint4*>(xbuf + (n * 8 + g) * p.stride + off);
#pragma unroll
        for (int j = 0; j < kMaxTilesPerWarp; ++j) {
          const int tile = tw + j * tile_warps;
          if (tile < tiles) {
            const uint4 lo = *reinterpret_cast<const uint4*>(wbuf + (tile * 16 + g) * p.stride + off);
            const uint4 hi = *reinterpret_cast<const uint4*>(wbuf + (tile * 16 + g + 8) * p.stride + off);
#pragma unroll
            for (int n = 0; n < NT; ++n) {
              mma_bf16(acc[j][n], lo.x, hi.x, lo.y, hi.y, b[n].x, b[n].y);
              mma_bf16(acc[j][n], lo.z, hi.z, lo.w, hi.w, b[n].z, b[n].w);
            }
          }
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot]);
    }

    // Every stage is consumed: the ring becomes the reduction buffer red[token][row] (fp32).
    float* red = reinterpret_cast<float*>(ring);
    asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32) : "memory");
    for (int idx = threadIdx.x; idx < p.tok_alloc * p.row_alloc; idx += kConsumerWarps * 32) red[idx] = 0.f;
    asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32) : "memory");
#pragma unroll
    for (int j = 0; j < kMaxTilesPerWarp; ++j) {
      const int tile = tw + j * tile_warps;
      if (tile < tiles) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const int row = tile * 16 + g, tok = n * 8 + 2 * t;
          atomicAdd(&red[tok * p.row_alloc + row], acc[j][n][0]);
          atomicAdd(&red[(tok + 1) * p.row_alloc + row], acc[j][n][1]);
          atomicAdd(&red[tok * p.row_alloc + row + 8], acc[j][n][2]);
          atomicAdd(&red[(tok + 1) * p.row_alloc + row + 8], acc[j][n][3]);
        }
      }
    }
    asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32) : "memory");
    grid_dependency_wait();  // y may still be read by the kernel in front (a no-op by now)
    for (int idx = threadIdx.x; idx < M * rows; idx += kConsumerWarps * 32) {
      const int tok = idx / rows, row = idx % rows;
      y[int64_t(tok) * N + r0 + row] = __float2bfloat16_rn(red[tok * p.row_alloc + row]);
    }
  }
}

// Stand-in for the all-reduce in front of the GEMM: spins `ns` nanoseconds of the global timer,
// then copies `n16` 16-byte words src -> dst (the activations it "produces": the GEMM's x). With
// `trigger` it lets a dependent launch start at once (griddepcontrol.launch_dependents), as an
// all-reduce could: its output is not the GEMM's weights.
__global__ void standin_spin(unsigned long long ns, int trigger, const uint4* src, uint4* dst, int n16) {
  if (trigger) asm volatile("griddepcontrol.launch_dependents;");
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += gridDim.x * blockDim.x) dst[i] = src[i];
}

constexpr int kStandinThreads = 512;

template <int NT>
cudaError_t launch_nt(cudaStream_t stream, int pdl, const void* w, const void* x, void* y, int M, int N, int K,
                      const Plan& p) {
  // Same carveout as the stand-in, so that a GEMM CTA may join an SM the stand-in runs on.
  cudaError_t e = cudaFuncSetAttribute(prefetch_gemm<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, p.smem);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(prefetch_gemm<NT>, cudaFuncAttributePreferredSharedMemoryCarveout,
                             int(cudaSharedmemCarveoutMaxShared));
  if (e != cudaSuccess) return e;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(p.grid));
  cfg.blockDim = dim3(unsigned(kThreads));
  cfg.dynamicSmemBytes = size_t(p.smem);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, prefetch_gemm<NT>, static_cast<const __nv_bfloat16*>(w),
                            static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(y), M, N, K, p);
}

}  // namespace

// The plan for a shape on `grid` CTAs into out[7] = {grid, kc, stages, row_alloc, tok_alloc,
// stride, smem}. Returns 0, or cudaErrorInvalidValue when the shape is out of range.
extern "C" int pg_plan(int M, int N, int K, int grid, int* out) {
  Plan p;
  if (!make_plan(M, N, K, grid, &p)) return int(cudaErrorInvalidValue);
  const int v[7] = {p.grid, p.kc, p.stages, p.row_alloc, p.tok_alloc, p.stride, p.smem};
  for (int i = 0; i < 7; ++i) out[i] = v[i];
  return 0;
}

// y[M, N] = x[M, K] @ w[N, K]^T on `stream` over `grid` CTAs, with programmatic dependent launch
// when `pdl`. All pointers 16-byte aligned, rows contiguous. Returns the cudaError_t.
extern "C" int pg_gemm(void* stream, int pdl, const void* w, const void* x, void* y, int M, int N, int K, int grid) {
  Plan p;
  if (!make_plan(M, N, K, grid, &p)) return int(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (token_tiles(M)) {
    case 1: return int(launch_nt<1>(s, pdl, w, x, y, M, N, K, p));
    case 2: return int(launch_nt<2>(s, pdl, w, x, y, M, N, K, p));
    case 4: return int(launch_nt<4>(s, pdl, w, x, y, M, N, K, p));
    default: return int(launch_nt<8>(s, pdl, w, x, y, M, N, K, p));
  }
}

// The stand-in on `stream`: `grid` CTAs of 512 threads spinning `ns` ns, triggering dependents
// at their start when `trigger`, then copying `bytes` (a multiple of 16) src -> dst. Returns the
// cudaError_t.
extern "C" int pg_standin(void* stream, int grid, unsigned long long ns, int trigger, const void* src, void* dst,
                          long long bytes) {
  if (grid < 1 || bytes < 0 || bytes % 16 != 0) return int(cudaErrorInvalidValue);
  cudaError_t e = cudaFuncSetAttribute(standin_spin, cudaFuncAttributePreferredSharedMemoryCarveout,
                                       int(cudaSharedmemCarveoutMaxShared));
  if (e != cudaSuccess) return int(e);
  standin_spin<<<unsigned(grid), kStandinThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      ns, trigger, static_cast<const uint4*>(src), static_cast<uint4*>(dst), int(bytes / 16));
  return int(cudaGetLastError());
}
