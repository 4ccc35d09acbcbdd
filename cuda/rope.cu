// RoPE re-rotation of cached keys (CacheBlend moves a chunk's keys to new positions).
// HF Llama (neox, rotate_half) convention: for i in [0, D/2), angle = delta[t] * inv_freq[i],
//   x1 = x[i], x2 = x[i + D/2]:  x[i] <- x1 * cos - x2 * sin,  x[i + D/2] <- x2 * cos + x1 * sin.
// Rotations compose, so keys written at position p move to p + delta. In place.
//
// keys [N, T, Hkv, D] contiguous (N: e.g. layers), as rows (n, t, h); delta [T] int64;
// inv_freq [D/2] fp32. A thread owns VEC consecutive pairs (i0 .. i0+VEC) of one token t and
// computes their sin/cos once (accurate sincosf: angles reach 1e5 rad and more), then rotates
// them in kRowsPerThread of the N * Hkv rows of that token: VEC * sizeof(T) bytes (16 on the
// fast path) from each half of the row per step. Neighbouring threads take neighbouring
// pair-vectors, then neighbouring tokens, so a warp reads whole 128-byte half-rows.
// grid (ceil(T * D/2/VEC / 256), ceil(N * Hkv / kRowsPerThread)); block 256.
#include "common.cuh"

constexpr int kRowsPerThread = 8;

template <class T, int VEC>
__global__ void __launch_bounds__(256, 1)
    rerotate_keys(T* __restrict__ keys, const i64* __restrict__ delta,
                  const float* __restrict__ inv_freq, int num_rows_per_token, int num_tokens,
                  int heads, int head_dim) {
  const int half_dim = head_dim / 2, per_token = half_dim / VEC;
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (i64)num_tokens * per_token) return;
  const int t = (int)(i / per_token), j0 = (int)(i % per_token) * VEC;
  const float pos = (float)delta[t];
  float s[VEC], c[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) sincosf(pos * inv_freq[j0 + k], &s[k], &c[k]);
  const int r_end = min(num_rows_per_token, (int)(blockIdx.y + 1) * kRowsPerThread);
  for (int r = blockIdx.y * kRowsPerThread; r < r_end; ++r) {  // r = n * heads + h
    const int n = r / heads, h = r - n * heads;
    T* x = keys + (((i64)n * num_tokens + t) * heads + h) * head_dim + j0;
    float x1[VEC], x2[VEC];
    lmkv::load_float<T, VEC>(x, x1);
    lmkv::load_float<T, VEC>(x + half_dim, x2);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float a = x1[k], b = x2[k];
      x1[k] = a * c[k] - b * s[k];
      x2[k] = b * c[k] + a * s[k];
    }
    lmkv::store_float<T, VEC>(x, x1);
    lmkv::store_float<T, VEC>(x + half_dim, x2);
  }
}
