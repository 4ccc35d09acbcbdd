// RoPE re-rotation of cached keys (CacheBlend moves a chunk's keys to new positions).
// HF Llama (neox, rotate_half) convention: for i in [0, D/2), angle = delta[t] * inv_freq[i],
//   x1 = x[i], x2 = x[i + D/2]:  x[i] <- x1 * cos - x2 * sin,  x[i + D/2] <- x2 * cos + x1 * sin.
// Rotations compose, so keys written at position p move to p + delta. In place.
//
// keys [N, T, Hkv, D] contiguous (N: e.g. layers); delta [T] int64; inv_freq [D/2] fp32.
// Each thread handles VEC consecutive pairs of one (n, t, head) row: VEC * sizeof(T) bytes from
// each half (16 on the fast path). grid: any (grid-stride); block: 256.
#include "common.cuh"

template <class T, int VEC>
__global__ void __launch_bounds__(256)
    rerotate_keys(T* __restrict__ keys, const i64* __restrict__ delta,
                  const float* __restrict__ inv_freq, i64 num_rows, int num_tokens, int heads,
                  int head_dim) {
  const int half_dim = head_dim / 2, per_row = half_dim / VEC;
  const i64 total = num_rows * per_row;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (i64)gridDim.x * blockDim.x) {
    const i64 row = i / per_row;  // row = (n * T + t) * heads + h
    const int j0 = (int)(i - row * per_row) * VEC;
    const int t = (int)((row / heads) % num_tokens);
    const float pos = (float)delta[t];
    T* x = keys + row * head_dim + j0;
    float x1[VEC], x2[VEC];
    lmkv::load_float<T, VEC>(x, x1);
    lmkv::load_float<T, VEC>(x + half_dim, x2);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      float s, c;
      sincosf(pos * inv_freq[j0 + k], &s, &c);
      const float a = x1[k], b = x2[k];
      x1[k] = a * c - b * s;
      x2[k] = b * c + a * s;
    }
    lmkv::store_float<T, VEC>(x, x1);
    lmkv::store_float<T, VEC>(x + half_dim, x2);
  }
}
