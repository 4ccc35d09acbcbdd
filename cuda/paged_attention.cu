// Paged attention for decode (one query token per sequence) and prefill/extend (many query
// tokens per sequence, causal), GQA, fp32 accumulation. References (same semantics):
// paged_attention_decode / paged_attention_prefill in lmkv.ops_torch. Two kernels:
// paged_attention (below: prefill, and decode as the "tiles" choice) and paged_decode_warps
// (at the end: the engine's decode, one online softmax per warp).
//
// Work unit = one block: a group of up to R query "rows" (query token, query head) that share
// one KV head, against the keys of one partition [p * partition_size, ...) of its sequence.
//   decode : rows = up to R query heads of one KV head (GQA group), grid.x = sequence
//   prefill: rows = up to R / G consecutive query tokens x the G heads of a KV head (G < R), or
//            R heads of one token (G >= R); grid.x = query tile, mapped to its sequence through
//            tile_starts [num_seqs + 1] (exclusive cumsum of tiles per sequence)
// so every K/V element read from HBM is used by R rows (flash-decoding style split over
// partitions for long decode contexts; partials merged by paged_attention_merge).
// Keys are processed in tiles of kTile with an online softmax:
//   1. scores: 4 lanes per key, each holding D/4 of its elements (16-byte loads, interleaved so
//      one warp instruction reads 64 contiguous bytes per key); q in shared memory (broadcast)
//   2. softmax: one warp per row updates the running max m and sum l; p = exp(s - m)
//   3. values: D/VEC lanes per key, 16 bytes each, acc[R][VEC] in registers, rescaled by
//      exp(m_old - m_new) per tile
// then a shuffle + shared-memory reduction over warps and token groups.
//
// Cache addressing: K/V of (slot, kv head h) at k_cache/v_cache + slot * slot_stride +
// h * head_stride (elements); slot = block_tables[seq][t / block_size] * block_size + t % block_size.
// q/out: [num_q, Hq, D] contiguous. Row limits: decode sees keys [0, seq_len); prefill query j
// (0-based within its sequence) sees keys [0, seq_len - q_len + j].
// With num_partitions > 1, results go to part_o [num_q, Hq, P, D] and part_ml [num_q, Hq, P, 2]
// (running max, sum) instead of out. grid (seqs or tiles, Hkv * head_chunks, P); block 128.
// A sequence's partitions are partition_size keys, longer where it would need more than
// max_partitions (seq_partition); P covers the batch's longest.
#include "common.cuh"

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 256;  // keys per tile (logits kept in shared memory)
constexpr int kLanesPerKey = 4;

// Element d of a query row's result: o / l into out, or, split over partitions, the partial
// o with the row's running max m and sum l (d == 0) for paged_attention_merge.
template <class T, int D>
__device__ __forceinline__ void write_row(T* out, float* part_o, float* part_ml, i64 row, int d,
                                          int part, int num_partitions, float o, float m, float l) {
  if (num_partitions == 1) {
    out[row * D + d] = lmkv::from_float<T>(o / l);
  } else {
    part_o[(row * num_partitions + part) * D + d] = o;
    if (d == 0) {
      part_ml[(row * num_partitions + part) * 2] = m;
      part_ml[(row * num_partitions + part) * 2 + 1] = l;
    }
  }
}

// Keys per partition of a sequence of seq_len keys: partition_size, or the least multiple of
// it that splits the sequence into max_partitions at most. It follows the sequence's own
// length only, so its summation order (and every bit of its result) is the same in any batch
// and under any block-table width. One partition (no split): the launch's partition_size.
__device__ __forceinline__ int seq_partition(int partition_size, int num_partitions,
                                             int max_partitions, int seq_len) {
  if (num_partitions == 1) return partition_size;
  const i64 span = (i64)partition_size * max_partitions;
  return partition_size * (int)((seq_len + span - 1) / span);
}

template <class T, int D, int R>
__global__ void __launch_bounds__(kThreads, 1)
    paged_attention(T* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
                    const T* __restrict__ q, const T* __restrict__ k_cache,
                    const T* __restrict__ v_cache, i64 slot_stride, i64 head_stride,
                    const int* __restrict__ block_tables, int max_blocks, int block_size,
                    const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
                    const int* __restrict__ tile_starts, int prefill, int num_seqs, int num_q_heads,
                    int num_kv_heads, int heads_per_block, int tile_tokens, int partition_size,
                    int num_partitions, int max_partitions, float scale) {
  constexpr int VEC = 16 / sizeof(T);            // elements per 16-byte load
  constexpr int NV = D / (VEC * kLanesPerKey);    // 16-byte loads per lane per key (score phase)
  constexpr int KEYS_PER_WARP = 32 / kLanesPerKey;
  constexpr int LPR = D / VEC;                    // lanes per key row in the value phase
  constexpr int TPW = 32 / LPR;                   // keys per warp step in the value phase
  static_assert(NV >= 1 && LPR <= 32 && D % (VEC * kLanesPerKey) == 0, "unsupported head_dim");

  __shared__ __align__(16) float q_s[R * D];
  __shared__ __align__(16) float logits[R * kTile];
  __shared__ __align__(16) float red[kWarps * R * D];
  __shared__ float m_s[R], l_s[R], alpha_s[R];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = num_q_heads / num_kv_heads;
  const int head_chunks = (group + heads_per_block - 1) / heads_per_block;
  const int kvh = blockIdx.y / head_chunks;
  const int g0 = (blockIdx.y % head_chunks) * heads_per_block;
  const int row_heads = min(heads_per_block, group - g0);

  // ---- which sequence, which query tokens
  int seq, q0, nq, limit0;  // rows of token j (0-based in this block) see keys [0, limit0 + j)
  if (!prefill) {  // decode: query_start_loc / tile_starts are unused
    seq = blockIdx.x;
    q0 = seq;
    nq = 1;
    limit0 = seq_lens[seq];
  } else {
    const int tile = blockIdx.x;
    if (tile >= tile_starts[num_seqs]) return;
    int lo = 0, hi = num_seqs;  // largest s with tile_starts[s] <= tile
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (tile_starts[mid] <= tile) lo = mid;
      else hi = mid;
    }
    seq = lo;
    const int q_lo = query_start_loc[seq], q_len = query_start_loc[seq + 1] - q_lo;
    const int j0 = (tile - tile_starts[seq]) * tile_tokens;
    q0 = q_lo + j0;
    nq = min(tile_tokens, q_len - j0);
    limit0 = seq_lens[seq] - q_len + j0 + 1;
  }
  const int nrows = nq * row_heads;
  const int max_limit = limit0 + nq - 1;
  const int part = blockIdx.z;
  // decode: the sequence's own partitions (prefill runs unsplit)
  const int part_keys = seq_partition(partition_size, num_partitions, max_partitions, max_limit);
  const int k_begin = part * part_keys;
  if (k_begin >= max_limit) return;  // never read by the merge (decode) or never launched
  const int k_end = min(max_limit, k_begin + part_keys);
  const int* table = block_tables + (i64)seq * max_blocks;

  for (int i = tid; i < R * D; i += kThreads) {
    const int r = i / D, d = i % D;
    float v = 0.f;
    if (r < nrows) {
      const int hq = kvh * group + g0 + r % row_heads;
      v = lmkv::to_float(q[((i64)(q0 + r / row_heads) * num_q_heads + hq) * D + d]);
    }
    q_s[i] = v;
  }
  if (tid < R) {
    m_s[tid] = lmkv::neg_inf();
    l_s[tid] = 0.f;
  }
  float acc[R][VEC];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[r][e] = 0.f;
  __syncthreads();

  const T* k_head = k_cache + kvh * head_stride;
  const T* v_head = v_cache + kvh * head_stride;
  const int kg = lane / kLanesPerKey, kj = lane % kLanesPerKey;  // score phase: key, slice
  const int vg = lane / LPR, vj = lane % LPR;                      // value phase: key, slice

  for (int tile_lo = k_begin; tile_lo < k_end; tile_lo += kTile) {
    const int tile_hi = min(k_end, tile_lo + kTile);
    // ---- 1. scores (the loop bound is warp-uniform: every lane reaches the shuffles)
    for (int base = tile_lo + warp * KEYS_PER_WARP; base < tile_hi; base += kWarps * KEYS_PER_WARP) {
      const int t = base + kg;
      const bool valid = t < tile_hi;
      float kf[NV][VEC];
      if (valid) {
        const i64 slot = (i64)table[t / block_size] * block_size + t % block_size;
        const T* kp = k_head + slot * slot_stride;
#pragma unroll
        for (int v = 0; v < NV; ++v) lmkv::load_float<T, VEC>(kp + (kj + kLanesPerKey * v) * VEC, kf[v]);
      } else {
#pragma unroll
        for (int v = 0; v < NV; ++v)
#pragma unroll
          for (int e = 0; e < VEC; ++e) kf[v][e] = 0.f;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r >= nrows) continue;  // block-uniform
        const float* qr = q_s + r * D;
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < NV; ++v)
#pragma unroll
          for (int e = 0; e < VEC; ++e) s += kf[v][e] * qr[(kj + kLanesPerKey * v) * VEC + e];
        s = lmkv::group_sum<kLanesPerKey>(s);
        if (valid && kj == 0)
          logits[r * kTile + (t - tile_lo)] = t < limit0 + r / row_heads ? s * scale : lmkv::neg_inf();
      }
    }
    __syncthreads();
    // ---- 2. online softmax, one warp per row
    const int n = tile_hi - tile_lo;
    for (int r = warp; r < nrows; r += kWarps) {
      float* lr = logits + r * kTile;
      const float m_old = m_s[r];
      float mx = lmkv::neg_inf();
      for (int i = lane; i < n; i += 32) mx = fmaxf(mx, lr[i]);
      const float m_new = fmaxf(m_old, lmkv::group_max<32>(mx));
      const bool none = m_new == lmkv::neg_inf();  // every key so far masked for this row
      float sum = 0.f;
      for (int i = lane; i < n; i += 32) {
        const float p = none ? 0.f : __expf(lr[i] - m_new);
        lr[i] = p;
        sum += p;
      }
      sum = lmkv::group_sum<32>(sum);
      if (lane == 0) {
        const float alpha = none ? 1.f : __expf(m_old - m_new);
        alpha_s[r] = alpha;
        l_s[r] = l_s[r] * alpha + sum;
        m_s[r] = m_new;
      }
    }
    __syncthreads();
    // ---- 3. values
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= nrows) continue;
      const float a = alpha_s[r];
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[r][e] *= a;
    }
#pragma unroll 4  // several V loads in flight per lane
    for (int t = tile_lo + warp * TPW + vg; t < tile_hi; t += kWarps * TPW) {
      const i64 slot = (i64)table[t / block_size] * block_size + t % block_size;
      float vf[VEC];
      lmkv::load_float<T, VEC>(v_head + slot * slot_stride + vj * VEC, vf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r >= nrows) continue;
        const float p = logits[r * kTile + (t - tile_lo)];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[r][e] += p * vf[e];
      }
    }
    __syncthreads();  // logits / alpha_s are rewritten by the next tile
  }

  // ---- reduce acc over the TPW key groups of a warp, then over warps
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= nrows) continue;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      float v = acc[r][e];
#pragma unroll
      for (int o = LPR; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (vg == 0) red[(warp * R + r) * D + vj * VEC + e] = v;
    }
  }
  __syncthreads();
  for (int i = tid; i < nrows * D; i += kThreads) {
    const int r = i / D, d = i % D;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += red[(w * R + r) * D + d];
    const int hq = kvh * group + g0 + r % row_heads;
    const i64 row = (i64)(q0 + r / row_heads) * num_q_heads + hq;
    write_row<T, D>(out, part_o, part_ml, row, d, part, num_partitions, o, m_s[r], l_s[r]);
  }
}

// Merges the partitions of a split decode: out = sum_p o_p * exp(m_p - M) / sum_p l_p * exp(m_p - M).
// grid (num_seqs * Hq) (one dimension: a y dimension would cap the batch at 65535); block D
// threads. The sequence's partitions (seq_partition) are read.
template <class T, int D>
__global__ void __launch_bounds__(D)
    paged_attention_merge(T* __restrict__ out, const float* __restrict__ part_o,
                          const float* __restrict__ part_ml, const int* __restrict__ seq_lens,
                          int num_q_heads, int partition_size, int num_partitions,
                          int max_partitions) {
  const i64 row = blockIdx.x;  // seq * Hq + hq
  const int seq = (int)(row / num_q_heads), d = threadIdx.x;
  const int seq_len = seq_lens[seq];
  const int part_keys = seq_partition(partition_size, num_partitions, max_partitions, seq_len);
  const int np = (seq_len + part_keys - 1) / part_keys;
  const float* ml = part_ml + row * num_partitions * 2;
  float m = lmkv::neg_inf();
  for (int p = 0; p < np; ++p) m = fmaxf(m, ml[2 * p]);
  float l = 0.f, o = 0.f;
  for (int p = 0; p < np; ++p) {
    const float w = __expf(ml[2 * p] - m);
    l += ml[2 * p + 1] * w;
    o += part_o[(row * num_partitions + p) * D + d] * w;
  }
  out[row * D + d] = lmkv::from_float<T>(o / l);
}

// Decode with independent warps: each warp of a block runs its own online softmax over its
// share of the partition's keys, KS keys per step, and issues the step's K and V loads
// together before it uses any of them (8 K and 8 V 16-byte loads per lane: 8 KiB per warp in
// flight at bf16, D = 128); no block barrier until the warps' partial results are combined at
// the end. Rows = up to R query heads of one KV head. Same arguments, grid and outputs as
// paged_attention's decode (prefill = 0; query_start_loc, tile_starts, tile_tokens unused).
// LEAN ("warps_lean" in lmkv_cuda.attention): fewer instructions per step, for a kernel whose
// loop is long (benchmarks/sass_loop.py: 1211 instead of 1465 per warp step at bf16, D = 128,
// R = 4, 516 of them the FMAs): one integer division by block_size per step instead of
// one per load (each lane computes the slot of key base + lane; slots are 32-bit, the wrapper
// checks that they fit), the row max and sum reduced over the 8 key groups only (the 4 lanes of
// a key hold the same score), and the weights handed to the value lanes through shared memory
// (one vector read per key instead of a shuffle per row).
template <class T, int D, int R, bool LEAN = false>
__global__ void __launch_bounds__(kThreads, R <= 4 ? 3 : 2)  // R 4: <= 168 registers (128 spill)
    paged_decode_warps(T* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
                       const T* __restrict__ q, const T* __restrict__ k_cache,
                       const T* __restrict__ v_cache, i64 slot_stride, i64 head_stride,
                       const int* __restrict__ block_tables, int max_blocks, int block_size,
                       const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
                       const int* __restrict__ tile_starts, int prefill, int num_seqs,
                       int num_q_heads, int num_kv_heads, int heads_per_block, int tile_tokens,
                       int partition_size, int num_partitions, int max_partitions,
                       float scale) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int NV = D / (VEC * kLanesPerKey);  // K loads per lane per key
  constexpr int KPP = 32 / kLanesPerKey;        // keys per score pass of a warp (8)
  constexpr int KU = NV >= 8 ? 1 : 8 / NV;      // score passes per step: 8 K loads per lane
  constexpr int KS = KPP * KU;                  // keys per warp step
  constexpr int LPR = D / VEC;                  // lanes per key row in the value phase
  constexpr int TPW = 32 / LPR;                 // keys per value pass
  constexpr int VP = KS / TPW;                  // value passes per step
  static_assert(NV >= 1 && LPR <= 32 && D % (VEC * kLanesPerKey) == 0, "unsupported head_dim");
  static_assert(KPP % TPW == 0, "a value pass must not straddle two score passes");
  static_assert(KS <= 32, "one block-table read per lane covers a step");

  __shared__ __align__(16) float q_s[R * D];
  __shared__ __align__(16) float red[kWarps * R * D];
  __shared__ float m_w[kWarps * R], l_w[kWarps * R];
  constexpr int RP = LEAN ? (R + 3) / 4 * 4 : 1;  // a key's weights, padded to float4s
  __shared__ __align__(16) float p_s[kWarps][LEAN ? KS : 1][RP];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = num_q_heads / num_kv_heads;
  const int head_chunks = (group + heads_per_block - 1) / heads_per_block;
  const int kvh = blockIdx.y / head_chunks;
  const int g0 = (blockIdx.y % head_chunks) * heads_per_block;
  const int nrows = min(heads_per_block, group - g0);
  const int seq = blockIdx.x;
  const int seq_len = seq_lens[seq];
  const int part = blockIdx.z;
  const int part_keys = seq_partition(partition_size, num_partitions, max_partitions, seq_len);
  const int k_begin = part * part_keys;
  if (k_begin >= seq_len) return;  // never read by the merge
  const int k_end = min(seq_len, k_begin + part_keys);
  const int* table = block_tables + (i64)seq * max_blocks;

  for (int i = tid; i < R * D; i += kThreads) {
    const int r = i / D;
    q_s[i] = r < nrows ? lmkv::to_float(q[((i64)seq * num_q_heads + kvh * group + g0 + r) * D + i % D])
                       : 0.f;
  }
  __syncthreads();

  const T* k_head = k_cache + kvh * head_stride;
  const T* v_head = v_cache + kvh * head_stride;
  const int kg = lane / kLanesPerKey, kj = lane % kLanesPerKey;  // score: key, slice
  const int vg = lane / LPR, vj = lane % LPR;                      // value: key, slice
  float m[R], l[R], acc[R][VEC];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = lmkv::neg_inf();
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[r][e] = 0.f;
  }

  // the loop bound is warp-uniform: every lane reaches the shuffles
  for (int base = k_begin + warp * KS; base < k_end; base += kWarps * KS) {
    // one block-table read per lane (the block of key base + lane), handed to the lanes
    // that load each key; keys past the end re-read the last one (their weight is 0)
    const int tl = min(base + lane, k_end - 1);
    const int block = table[tl / block_size];
    const int lane_slot = LEAN ? block * block_size + tl % block_size : 0;  // LEAN: 32-bit slots
    lmkv::Vec<T, VEC> kv[KU][NV], vv[VP];
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int t = min(base + u * KPP + kg, k_end - 1);
      const i64 slot = LEAN ? (i64)__shfl_sync(0xffffffffu, lane_slot, t - base)
                            : (i64)__shfl_sync(0xffffffffu, block, t - base) * block_size + t % block_size;
      const T* kp = k_head + slot * slot_stride;
#pragma unroll
      for (int v = 0; v < NV; ++v)
        kv[u][v] = *reinterpret_cast<const lmkv::Vec<T, VEC>*>(kp + (kj + kLanesPerKey * v) * VEC);
    }
#pragma unroll
    for (int i = 0; i < VP; ++i) {
      const int t = min(base + i * TPW + vg, k_end - 1);
      const i64 slot = LEAN ? (i64)__shfl_sync(0xffffffffu, lane_slot, t - base)
                            : (i64)__shfl_sync(0xffffffffu, block, t - base) * block_size + t % block_size;
      vv[i] = *reinterpret_cast<const lmkv::Vec<T, VEC>*>(v_head + slot * slot_stride + vj * VEC);
    }
    // scores of the step's keys: s[r][u] for key base + u * KPP + kg, on all 4 lanes of the key
    float s[R][KU];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < KU; ++u) s[r][u] = 0.f;
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float kf[KU];
#pragma unroll
        for (int u = 0; u < KU; ++u) kf[u] = lmkv::to_float(kv[u][v].v[e]);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float qe = q_s[r * D + (kj + kLanesPerKey * v) * VEC + e];
#pragma unroll
          for (int u = 0; u < KU; ++u) s[r][u] += qe * kf[u];
        }
      }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= nrows) continue;  // block-uniform
      float mx = lmkv::neg_inf();
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const float su = lmkv::group_sum<kLanesPerKey>(s[r][u]);
        s[r][u] = base + u * KPP + kg < k_end ? su * scale : lmkv::neg_inf();
        mx = fmaxf(mx, s[r][u]);
      }
      float alpha;
      if constexpr (LEAN) {  // over the key groups: the 4 lanes of a key hold its score
#pragma unroll
        for (int o = kLanesPerKey; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_new = fmaxf(m[r], mx);  // finite: the step has a key
        float sum = 0.f;
#pragma unroll
        for (int u = 0; u < KU; ++u) {
          s[r][u] = __expf(s[r][u] - m_new);  // now the key's weight p
          sum += s[r][u];
          if (kj == 0) p_s[warp][u * KPP + kg][r] = s[r][u];
        }
#pragma unroll
        for (int o = kLanesPerKey; o < 32; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        alpha = __expf(m[r] - m_new);  // 0 on the first step (m = -inf)
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
      } else {
        const float m_new = fmaxf(m[r], lmkv::group_max<32>(mx));  // finite: the step has a key
        float sum = 0.f;
#pragma unroll
        for (int u = 0; u < KU; ++u) {
          s[r][u] = __expf(s[r][u] - m_new);  // now the key's weight p
          sum += kj == 0 ? s[r][u] : 0.f;
        }
        alpha = __expf(m[r] - m_new);  // 0 on the first step (m = -inf)
        l[r] = l[r] * alpha + lmkv::group_sum<32>(sum);
        m[r] = m_new;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[r][e] *= alpha;
    }
    // values: pass i takes key i * TPW + vg of the step, whose weight sits on lane 4 * (its
    // index mod KPP) in s[r][its index / KPP] (LEAN: in p_s[warp][its index])
    if (LEAN) __syncwarp();
#pragma unroll
    for (int i = 0; i < VP; ++i) {
      float vf[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) vf[e] = lmkv::to_float(vv[i].v[e]);
      float pk[RP];
      if constexpr (LEAN) {
#pragma unroll
        for (int r4 = 0; r4 < RP; r4 += 4)
          *reinterpret_cast<float4*>(pk + r4) =
              *reinterpret_cast<const float4*>(&p_s[warp][i * TPW + vg][r4]);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r >= nrows) continue;
        float p;
        if constexpr (LEAN) p = pk[r];
        else p = __shfl_sync(0xffffffffu, s[r][(i * TPW) / KPP], kLanesPerKey * ((i * TPW) % KPP + vg));
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[r][e] += p * vf[e];
      }
    }
    if (LEAN) __syncwarp();  // p_s is rewritten by the next step
  }

  // ---- combine: lanes of a warp over their TPW key groups, then the warps' softmax states
  // (paged_attention's reduction, kept inline: as a shared helper it changed the register
  // allocation, so the code, of this kernel as measured on the H200)
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= nrows) continue;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      float v = acc[r][e];
#pragma unroll
      for (int o = LPR; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (vg == 0) red[(warp * R + r) * D + vj * VEC + e] = v;
    }
    if (lane == 0) {
      m_w[warp * R + r] = m[r];
      l_w[warp * R + r] = l[r];
    }
  }
  __syncthreads();
  for (int i = tid; i < nrows * D; i += kThreads) {
    const int r = i / D, d = i % D;
    float mx = lmkv::neg_inf();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_w[w * R + r]);
    float o = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {  // a warp without keys: m = -inf, weight 0
      const float wt = m_w[w * R + r] == lmkv::neg_inf() ? 0.f : __expf(m_w[w * R + r] - mx);
      o += red[(w * R + r) * D + d] * wt;
      sum += l_w[w * R + r] * wt;
    }
    const i64 row = (i64)seq * num_q_heads + kvh * group + g0 + r;
    write_row<T, D>(out, part_o, part_ml, row, d, part, num_partitions, o, mx, sum);
  }
}
