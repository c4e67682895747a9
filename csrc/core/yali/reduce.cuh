// Element types and the 16-byte add used by every kernel.
//
// fp16/bf16 are widened to fp32, added, and rounded once. With two ranks the
// sum a+b is commutative in IEEE arithmetic, so both ranks produce the same
// bits whichever operand is "mine": no ordering rule is needed beyond that.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ptx.cuh"

namespace yali {

template <typename T> struct Elem;

template <> struct Elem<float> {
  __device__ __forceinline__ static float add(float a, float b) { return a + b; }
};
template <> struct Elem<__half> {
  __device__ __forceinline__ static __half add(__half a, __half b) {
    return __float2half_rn(__half2float(a) + __half2float(b));
  }
};
template <> struct Elem<__nv_bfloat16> {
  __device__ __forceinline__ static __nv_bfloat16 add(__nv_bfloat16 a, __nv_bfloat16 b) {
    return __float2bfloat16_rn(__bfloat162float(a) + __bfloat162float(b));
  }
};

// Adds two 16-byte packs element-wise as T (fp32 accumulation for 16-bit types).
template <typename T>
__device__ __forceinline__ Vec16 add_vec(const Vec16& a, const Vec16& b) {
  constexpr int kN = 16 / sizeof(T);
  Vec16 r;
  const T* pa = reinterpret_cast<const T*>(&a);
  const T* pb = reinterpret_cast<const T*>(&b);
  T* pr = reinterpret_cast<T*>(&r);
#pragma unroll
  for (int i = 0; i < kN; ++i) pr[i] = Elem<T>::add(pa[i], pb[i]);
  return r;
}

}  // namespace yali
