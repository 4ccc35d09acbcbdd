// Helpers shared by lmkv's kernels. Every .cu here compiles three ways: NVRTC (CuPy
// RawModule, the run-time path), nvcc (the register/spill gate) and g++ with the cuemu
// emulator (CPU tests). So: no inline PTX, no INFINITY macro (NVRTC lacks it), full-warp
// shuffles only, and loops that contain shuffles are warp-uniform.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;

namespace lmkv {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// N elements of T moved as one aligned vector of N * sizeof(T) bytes (16 for the fast path).
template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <class T, int N>
__device__ __forceinline__ void load_float(const T* p, float (&out)[N]) {
  const Vec<T, N> x = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(x.v[i]);
}

template <class T, int N>
__device__ __forceinline__ void store_float(T* p, const float (&in)[N]) {
  Vec<T, N> x;
#pragma unroll
  for (int i = 0; i < N; ++i) x.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Vec<T, N>*>(p) = x;
}

// Sum / max over groups of WIDTH consecutive lanes (WIDTH a power of two <= 32); every lane
// of the warp must call it.
template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <int WIDTH>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace lmkv
