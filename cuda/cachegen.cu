// cachegen quantize / dequantize: the per-element steps of lmkv's lossy KV codec
// (lmkv/codec/cachegen.py; the torch twins there have the same signatures).
//
// kv, out [2, L, T, H, D] (float, __half or __nv_bfloat16), contiguous, as streams
// s = kv * L + layer in [0, 2L), each [T, H * D]; step, mean [2, L, H, D] fp32; delta [2, L]
// uint8 (1: the stream is delta-coded); symbols [2, L, T, H, D] int16.
// quantize:   q = clamp(rint((x - mean) / step), -16383, 16383) (division, not a reciprocal
//   multiply, and rint = round half to even: bit-identical to torch.round); in delta streams
//   a token t with t % G != 0 stores q(t) - q(t - t % G). The anchor's q is recomputed from
//   x by the same thread, so threads never depend on each other.
// dequantize: q = symbols(t) (+ symbols(anchor) for non-anchor tokens of delta streams);
//   out = fma(q, step, mean), rounded to the output type (the twin may round q * step first:
//   the results agree to within one rounding).
// One thread per element, consecutive threads on consecutive channels (coalesced rows);
// grid-stride loop over n = 2L * T * H * D elements.
#include "common.cuh"

constexpr float kQmax = 16383.f;

__device__ __forceinline__ float cg_quant(float x, float mean, float step) {
  return fminf(fmaxf(rintf((x - mean) / step), -kQmax), kQmax);
}

template <class T>
__global__ void __launch_bounds__(256)
    cachegen_quantize(const T* __restrict__ kv, const float* __restrict__ step,
                      const float* __restrict__ mean, const unsigned char* __restrict__ delta,
                      short* __restrict__ symbols, i64 n, int tokens, int row, int group) {
  const i64 per_stream = (i64)tokens * row;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const int s = (int)(i / per_stream);
    const i64 rem = i - s * per_stream;
    const int t = (int)(rem / row), c = (int)(rem - (i64)t * row);
    const int p = s * row + c;  // [2, L, H, D] index
    const float m = mean[p], st = step[p];
    float q = cg_quant(lmkv::to_float(kv[i]), m, st);
    const int back = t % group;
    if (delta[s] && back != 0) q -= cg_quant(lmkv::to_float(kv[i - (i64)back * row]), m, st);
    symbols[i] = (short)q;
  }
}

template <class T>
__global__ void __launch_bounds__(256)
    cachegen_dequantize(const short* __restrict__ symbols, const float* __restrict__ step,
                        const float* __restrict__ mean, const unsigned char* __restrict__ delta,
                        T* __restrict__ out, i64 n, int tokens, int row, int group) {
  const i64 per_stream = (i64)tokens * row;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const int s = (int)(i / per_stream);
    const i64 rem = i - s * per_stream;
    const int t = (int)(rem / row), c = (int)(rem - (i64)t * row);
    const int p = s * row + c;
    float q = (float)symbols[i];
    const int back = t % group;
    if (delta[s] && back != 0) q += (float)symbols[i - (i64)back * row];
    out[i] = lmkv::from_float<T>(__fmaf_rn(q, step[p], mean[p]));
  }
}
