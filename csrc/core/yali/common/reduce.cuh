// Element types and the 16-byte add used by every kernel.
//
// fp16/bf16 are widened to fp32, added, and rounded once. With two ranks the
// sum a+b is commutative in IEEE arithmetic, so both ranks produce the same
// bits whichever operand is "mine": no ordering rule is needed beyond that.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "yali/common/ptx.cuh"

namespace yali {

template <typename T> struct Elem;

// add: the all-reduce sum; to_float / from_float: widening and rounding (to
// nearest even) for the fused RMSNorm epilogue; round: a float rounded to T and back.
template <> struct Elem<float> {
  __device__ __forceinline__ static float add(float a, float b) { return a + b; }
  __device__ __forceinline__ static float to_float(float a) { return a; }
  __device__ __forceinline__ static float from_float(float a) { return a; }
};
template <> struct Elem<__half> {
  __device__ __forceinline__ static __half add(__half a, __half b) {
    return __float2half_rn(__half2float(a) + __half2float(b));
  }
  __device__ __forceinline__ static float to_float(__half a) { return __half2float(a); }
  __device__ __forceinline__ static __half from_float(float a) { return __float2half_rn(a); }
};
template <> struct Elem<__nv_bfloat16> {
  __device__ __forceinline__ static __nv_bfloat16 add(__nv_bfloat16 a, __nv_bfloat16 b) {
    return __float2bfloat16_rn(__bfloat162float(a) + __bfloat162float(b));
  }
  __device__ __forceinline__ static float to_float(__nv_bfloat16 a) { return __bfloat162float(a); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float a) { return __float2bfloat16_rn(a); }
};

template <typename T>
__device__ __forceinline__ float round_to(float a) {
  return Elem<T>::to_float(Elem<T>::from_float(a));
}

// A 16-byte pack of T widened to floats, and back (rounded to nearest even).
template <typename T>
__device__ __forceinline__ void unpack(const Vec16& v, float (&f)[16 / sizeof(T)]) {
  const T* p = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < int(16 / sizeof(T)); ++i) f[i] = Elem<T>::to_float(p[i]);
}

template <typename T>
__device__ __forceinline__ Vec16 pack(const float (&f)[16 / sizeof(T)]) {
  Vec16 v;
  T* p = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < int(16 / sizeof(T)); ++i) p[i] = Elem<T>::from_float(f[i]);
  return v;
}

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
