// The FP8 (e4m3) epilogue of the quantising fused all-reduce + RMSNorm (quant.h): the normalised
// row, still in registers, rounded to T as the plain op's norm_out holds it (y), is quantised with
// exactly the arithmetic of vLLM's own kernels applied to that norm_out, so both give the same codes
// and scales:
//  * Static (static_scaled_fp8_quant): inv = 1 / scale; q = e4m3(clamp(y * inv, -448, 448));
//  * PerToken (dynamic_per_token_scaled_fp8_quant, no upper bound): s = max(max|y| / 448,
//    1 / (448 * 512)) over the row; q = e4m3(clamp(y / s, -448, 448));
//  * Group (per_token_group_fp8_quant, eps 1e-10): s = max(1e-10, max|y| over the group) / 448,
//    with ue8m0 rounded up to a power of two (the exponent bumped whenever the mantissa is not 0);
//    q = e4m3(clamp(y / s, -448, 448)).
// Divisions are IEEE-rounded (__fdiv_rn) and the conversion rounds to nearest even, saturating, as
// vLLM's hardware and c10 conversions do within the clamp. A maximum is exact in any order, so
// every rank and every layout of the reduction give the same scales.
//
// Which threads hold a group: thread t holds the row's vectors first + t + u * kFlashThreads, so
// with `first` a multiple of the group's vectors (whole rows: 0; a spread slice: its start, which
// the launch keeps a multiple) a group of G vectors (G = 8 or 16, a power of two dividing
// kFlashThreads) lies in G consecutive lanes of one warp, the same u: a butterfly of G lanes.
#pragma once
#include <cuda_fp8.h>

#include "yali/common/kernel_common.cuh"
#include "yali/common/quant.h"

namespace yali {

// Max of v over the CTA, in every thread (the max is exact: any order gives the same bits).
__device__ __forceinline__ float block_max(float v) {
  __shared__ float warp_maxes[kFlashThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  __syncthreads();  // the previous row's readers are done with warp_maxes
  if ((threadIdx.x & 31) == 0) warp_maxes[threadIdx.x / 32] = v;
  __syncthreads();
  float m = 0.f;
#pragma unroll
  for (int w = 0; w < kFlashThreads / 32; ++w) m = fmaxf(m, warp_maxes[w]);
  return m;
}

// The group scale of a group whose magnitudes peak at `absmax` (already at least 1e-10).
__device__ __forceinline__ float group_scale(float absmax, bool ue8m0) {
  float s = __fdiv_rn(absmax, kFp8Max);
  if (ue8m0) {
    s = fmaxf(fabsf(s), 1e-10f);
    const uint32_t bits = __float_as_uint(s);
    s = __uint_as_float((((bits >> 23) & 0xffu) + ((bits & 0x7fffffu) != 0u ? 1u : 0u)) << 23);
  }
  return s;
}

// Eight e4m3 codes of v, element 0 in the lowest byte.
__device__ __forceinline__ uint2 to_e4m3x8(const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] = uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(v[2 * k], v[2 * k + 1]), __NV_SATFINITE, __NV_E4M3));
  return make_uint2(w[0] | w[1] << 16, w[2] | w[3] << 16);
}

// The epilogue's quantisation for one row (or one slice of it), by every thread of the CTA.
// Thread t holds vector first + j of the whole [rows, row_vecs] input, j = t + u * kFlashThreads <
// count, the row's vector row_first + j: z (the fp32 sum, residual added), w (the weight).
// `row_max(m)` turns this thread's max of |y| into the row's (PerToken), `static_inv` is 1 / scale
// (Static); `writes_row_scale`: this CTA stores the row's scale (PerToken). `residual_out`: where
// z goes after the row's reductions (nullptr: stored already, or not wanted).
template <typename T, int kV, QuantScheme kQ, typename RowMax>
__device__ __forceinline__ void quantize_row(const QuantOut& q, int row, size_t first, int row_first, int count,
                                             const float (&z)[kV][16 / sizeof(T)], const Vec16 (&w)[kV],
                                             float inv_rms, float static_inv, bool writes_row_scale, RowMax row_max,
                                             Vec16* residual_out) {
  static_assert(sizeof(T) == 2, "the quantising epilogue takes 16-bit inputs");
  constexpr int kN = 8;
  float y[kV][kN];
  float m = 0.f;
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = threadIdx.x + u * kFlashThreads;
    if (j >= count) {
#pragma unroll
      for (int i = 0; i < kN; ++i) y[u][i] = 0.f;
      continue;
    }
    float ww[kN];
    unpack<T>(w[u], ww);
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      y[u][i] = round_to<T>(round_to<T>(z[u][i] * inv_rms) * ww[i]);  // norm_out's value
      if constexpr (kQ == QuantScheme::PerToken) m = fmaxf(m, fabsf(y[u][i]));
    }
  }
  float row_scale = 0.f;
  if constexpr (kQ == QuantScheme::PerToken) {
    row_scale = fmaxf(__fdiv_rn(row_max(m), kFp8Max), 1.0f / (kFp8Max * 512.f));
    if (writes_row_scale && threadIdx.x == 0) q.scale[int64_t(row) * q.row_stride] = row_scale;
  }
  uint2* out = static_cast<uint2*>(q.out) + first;  // one 8-byte code vector per 16-byte input vector
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = threadIdx.x + u * kFlashThreads;
    float c[kN];
    if constexpr (kQ == QuantScheme::Group) {
      float g = 1e-10f;
#pragma unroll
      for (int i = 0; i < kN; ++i) g = fmaxf(g, fabsf(y[u][i]));
      for (int off = q.group_vecs / 2; off > 0; off >>= 1) g = fmaxf(g, __shfl_xor_sync(0xffffffffu, g, off));
      const float s = group_scale(g, q.ue8m0 != 0);
      if (j < count && (row_first + j) % q.group_vecs == 0)
        q.scale[int64_t(row) * q.row_stride + int64_t((row_first + j) / q.group_vecs) * q.group_stride] = s;
#pragma unroll
      for (int i = 0; i < kN; ++i) c[i] = fminf(fmaxf(__fdiv_rn(y[u][i], s), -kFp8Max), kFp8Max);
    } else if constexpr (kQ == QuantScheme::PerToken) {
#pragma unroll
      for (int i = 0; i < kN; ++i) c[i] = fmaxf(-kFp8Max, fminf(__fdiv_rn(y[u][i], row_scale), kFp8Max));
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) c[i] = fmaxf(-kFp8Max, fminf(y[u][i] * static_inv, kFp8Max));
    }
    if (j >= count) continue;
    if (residual_out) store_vec(residual_out + first + j, pack<T>(z[u]));
    out[j] = to_e4m3x8(c);
  }
}

}  // namespace yali
