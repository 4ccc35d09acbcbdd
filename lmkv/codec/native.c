/* The hot loops of cachegen's transform decode (lmkv/codec/native.py builds and loads this).
 *
 * lmkv_symbols: a payload's streams, entropy-decoded with libzstd (or stored as they are):
 *   int8 ones written as bfloat16 coefficients where the batched matmul reads them, int16
 *   ones (the few strongest coefficients) kept as they are for lmkv_finish.
 * lmkv_finish: the matmul's bfloat16 products to the float32 chunk: + offset + the int16
 *   bands' products in float32, keys rotated by their positions, written with streaming stores.
 *
 * Both are re-entrant (no global state) and check every length they are given: a payload is
 * untrusted input. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* libzstd (the system's libzstd.so.1; declared here so that no header package is needed) */
size_t ZSTD_decompressDCtx(void *dctx, void *dst, size_t capacity, const void *src, size_t size);
void *ZSTD_createDCtx(void);
size_t ZSTD_freeDCtx(void *dctx);
unsigned ZSTD_isError(size_t code);

enum { WIDTH_INT8 = 1, WIDTH_INT16 = 2, WIDTH_STORED = 3 };
enum { OK = 0, E_TRUNCATED = -1, E_WIDTH = -2, E_LENGTH = -3, E_ZSTD = -4, E_STRAY = -5, E_MEMORY = -6 };

static inline uint16_t small_int_to_bf16(int8_t x) {
    float f = (float)x; /* |x| < 256: exact in bfloat16, so the top half of the float is it */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void int8_to_bf16(const int8_t *src, uint16_t *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = small_int_to_bf16(src[i]);
}

static uint32_t read_u32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

/* Decode the `count` streams whose 5-byte descriptors (width u8, length u32 LE) start at
 * payload + desc; the stream bytes follow the descriptors and must end at payload + len.
 * Stream i holds sizes[i] symbols, written as bfloat16 at coef + at[i]; a wide (int16) stream
 * goes to wide_sym + at[i] instead (its coef range zeroed) and its index to wide[] (their
 * number is returned). gaps: n_gaps (offset, length) pairs of coef zeroed too (coefficients
 * not stored). coef and wide_sym hold coef_len each. On error returns < 0 and sets *bad to
 * the stream concerned (or the stray byte count). */
long lmkv_symbols(const uint8_t *payload, size_t len, size_t desc, int count, const int64_t *sizes,
                  const int64_t *at, uint16_t *coef, int16_t *wide_sym, size_t coef_len,
                  const int64_t *gaps, int n_gaps, int32_t *wide, int64_t *bad) {
    size_t off = desc + (size_t)count * 5, most = 0;
    long n_wide = 0;
    *bad = -1;
    if (desc > len || off > len) return E_TRUNCATED;
    for (int i = 0; i < count; i++) {
        if (sizes[i] < 0 || at[i] < 0 || (size_t)at[i] + (size_t)sizes[i] > coef_len) { *bad = i; return E_LENGTH; }
        if ((size_t)sizes[i] > most) most = (size_t)sizes[i];
    }
    for (int g = 0; g < n_gaps; g++) {
        if (gaps[2 * g] < 0 || gaps[2 * g + 1] < 0 || (size_t)(gaps[2 * g] + gaps[2 * g + 1]) > coef_len) { *bad = g; return E_LENGTH; }
        memset(coef + gaps[2 * g], 0, (size_t)gaps[2 * g + 1] * 2);
    }
    int8_t *tmp = malloc(most ? most : 1);
    void *dctx = ZSTD_createDCtx();
    long rc = OK;
    if (tmp == NULL || dctx == NULL) { rc = E_MEMORY; goto done; }
    for (int i = 0; i < count; i++) {
        const uint8_t *d = payload + desc + (size_t)i * 5;
        unsigned width = d[0];
        size_t length = read_u32(d + 1), n = (size_t)sizes[i];
        *bad = i;
        if ((width != WIDTH_INT8 && width != WIDTH_INT16 && width != WIDTH_STORED) || length > len - off) { rc = E_WIDTH; goto done; }
        const uint8_t *src = payload + off;
        off += length;
        if (n == 0 || length == 0) {
            if (n != 0 || length != 0) { rc = E_LENGTH; goto done; }
        } else if (width == WIDTH_INT16) {
            size_t got = ZSTD_decompressDCtx(dctx, wide_sym + at[i], n * 2, src, length);
            if (ZSTD_isError(got) || got != n * 2) { rc = E_ZSTD; goto done; }
            memset(coef + at[i], 0, n * 2);
            wide[n_wide++] = i;
        } else if (width == WIDTH_STORED) {
            if (length != n) { rc = E_LENGTH; goto done; }
            int8_to_bf16((const int8_t *)src, coef + at[i], n);
        } else {
            size_t got = ZSTD_decompressDCtx(dctx, tmp, n, src, length);
            if (ZSTD_isError(got) || got != n) { rc = E_ZSTD; goto done; }
            int8_to_bf16(tmp, coef + at[i], n);
        }
    }
    *bad = (int64_t)(len - off);
    rc = off == len ? n_wide : E_STRAY;
done:
    if (dctx) ZSTD_freeDCtx(dctx);
    free(tmp);
    return rc;
}

/* A row of c floats to out: streaming stores where the row is 64-byte aligned (the chunk is
 * not read again before it is copied on, so it need not pass through the cache). */
static void put_row(float *out, const float *row, int c) {
#if defined(__AVX512F__)
    if (((uintptr_t)out & 63) == 0 && c % 16 == 0) {
        for (int j = 0; j < c; j += 16) _mm512_stream_ps(out + j, _mm512_load_ps(row + j));
        return;
    }
#endif
    memcpy(out, row, (size_t)c * 4);
}

/* out[m, t, :] = low[m, t, :] + offset[m, :] + sum over the n_wide int16 bands of m of
 * their symbols times synthesis rows, for n matrices of t rows of heads * d; the first n_rot
 * (keys) are then rotated per row by cos/sin [t, d/2] (HF rotate_half pairs j, j + d/2).
 * Band w is stream wide[w]: rows band[3 * s + 1] .. band[3 * s + 2] of synthesis[band[3 * s]]
 * ([n, c, c] float32), symbols [rows, t] at wide_sym + at[s]. c = heads * d <= 4096. */
int lmkv_finish(int n, int t, int heads, int d, const uint16_t *low, const float *offset,
                const float *synthesis, const int16_t *wide_sym, const int32_t *wide, int n_wide,
                const int32_t *band, const int64_t *at, float *out, int n_rot, const float *cosv,
                const float *sinv) {
    int c = heads * d, half = d / 2;
    if (c > 4096 || d % 2) return -1;
    float row[4096] __attribute__((aligned(64)));
    float rot[4096] __attribute__((aligned(64)));
    for (int m = 0; m < n; m++) {
        const float *off = offset + (size_t)m * c;
        for (int r = 0; r < t; r++) {
            const uint16_t *l = low + ((size_t)m * t + r) * c;
            for (int j = 0; j < c; j++) row[j] = bf16_to_float(l[j]) + off[j];
            for (int w = 0; w < n_wide; w++) {
                const int32_t *b = band + 3 * wide[w];
                if (b[0] != m) continue;
                const int16_t *q = wide_sym + at[wide[w]] + r;
                for (int k = b[1]; k < b[2]; k++) {
                    float x = (float)q[(size_t)(k - b[1]) * t];
                    const float *s = synthesis + ((size_t)m * c + k) * c;
                    for (int j = 0; j < c; j++) row[j] += x * s[j];
                }
            }
            float *o = out + ((size_t)m * t + r) * c;
            if (m >= n_rot) { put_row(o, row, c); continue; }
            const float *cs = cosv + (size_t)r * half, *sn = sinv + (size_t)r * half;
            for (int h = 0; h < heads; h++) {
                const float *x = row + h * d;
                float *y = rot + h * d;
                for (int j = 0; j < half; j++) {
                    y[j] = x[j] * cs[j] - x[j + half] * sn[j];
                    y[j + half] = x[j + half] * cs[j] + x[j] * sn[j];
                }
            }
            put_row(o, rot, c);
        }
    }
#if defined(__AVX512F__)
    _mm_sfence();
#endif
    return 0;
}
