// Moving K/V rows between paged KV memory and token-major buffers (lmkv chunk buffers, new
// K/V of a forward step). One kernel serves every layout and direction:
//   - paged_to_chunk / chunk_to_paged, bundled engine layout
//       kv_cache [L, 2, num_blocks, block_size, Hkv, D] <-> chunk [2, L, T, Hkv, D]
//   - the same for vLLM's GPU layout: per layer [num_blocks, block_size, Hkv, 2*D] (K = [..., :D],
//     V = [..., D:]), layers reached through a table of data pointers
//   - reshape_and_cache: key/value [T, Hkv, D] (rows may be strided) -> one engine layer
//
// A row is the Hkv * D elements of one (kv in {0, 1}, layer l, token t); rows of tokens
// t in [skip, T) are copied, ordered (kv, l, t) so that neighbouring warps touch neighbouring
// chunk rows. All strides and sizes are in units of U (16 bytes on the fast path; the
// wrapper picks the widest unit that divides every stride and base address).
// Paged address of unit u of a row: layer_base(l) + kv * paged_kv_stride + slot * slot_stride
//   + (u / head_units) * head_stride + u % head_units, where layer_base(l) is layer_ptrs[l] if
//   layer_table, else paged_base + l * paged_layer_stride (the unused pointer is a dummy).
// Flat address: (kv ? flat_v : flat_k) + l * flat_layer_stride + t * flat_token_stride + u.
// Slots < 0 or >= num_slots are skipped (reshape_and_cache's -1; the wrapper rejects others).
//
// grid: any (grid-stride over rows); block: 256 threads = 8 warps, one warp per row.
#include "common.cuh"

constexpr int kCopyWarps = 8;
constexpr int kCopyUnroll = 4;  // loads in flight per lane before the stores

template <class U, bool TO_PAGED>
__global__ void __launch_bounds__(kCopyWarps * 32)
    kv_copy(const i64* __restrict__ layer_ptrs, int layer_table, U* paged_base, i64 paged_layer_stride,
            i64 paged_kv_stride, i64 slot_stride, i64 head_stride, int head_units, int heads,
            U* flat_k, U* flat_v, i64 flat_layer_stride, i64 flat_token_stride,
            const i64* __restrict__ slots, i64 num_slots, int num_layers, int num_tokens, int skip) {
  const int lane = threadIdx.x & 31;
  const i64 n = num_tokens - skip;           // tokens copied per (kv, layer)
  const i64 rows = 2 * (i64)num_layers * n;
  const int row_units = heads * head_units;
  for (i64 r = (i64)blockIdx.x * kCopyWarps + (threadIdx.x >> 5); r < rows;
       r += (i64)gridDim.x * kCopyWarps) {
    const int kv = (int)(r / (num_layers * n));
    const i64 rem = r - kv * (num_layers * n);
    const int l = (int)(rem / n);
    const int t = skip + (int)(rem - l * n);
    const i64 slot = slots[t];
    if (slot < 0 || slot >= num_slots) continue;  // warp-uniform
    U* layer = layer_table ? reinterpret_cast<U*>(layer_ptrs[l]) : paged_base + l * paged_layer_stride;
    U* paged = layer + kv * paged_kv_stride + slot * slot_stride;
    U* flat = (kv ? flat_v : flat_k) + l * flat_layer_stride + t * flat_token_stride;
    for (int u0 = 0; u0 < row_units; u0 += 32 * kCopyUnroll) {
      U buf[kCopyUnroll];
#pragma unroll
      for (int k = 0; k < kCopyUnroll; ++k) {
        const int u = u0 + k * 32 + lane;
        if (u < row_units) {
          const int h = u / head_units;
          const i64 p = h * head_stride + (u - h * head_units);
          buf[k] = TO_PAGED ? flat[u] : paged[p];
        }
      }
#pragma unroll
      for (int k = 0; k < kCopyUnroll; ++k) {
        const int u = u0 + k * 32 + lane;
        if (u < row_units) {
          const int h = u / head_units;
          const i64 p = h * head_stride + (u - h * head_units);
          if (TO_PAGED) paged[p] = buf[k];
          else flat[u] = buf[k];
        }
      }
    }
  }
}
