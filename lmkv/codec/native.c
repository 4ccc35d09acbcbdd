/* The hot loops of cachegen's transform decode (lmkv/codec/native.py builds and loads this).
 *
 * lmkv_symbols: a payload's streams, entropy-decoded with libzstd (or stored as they are):
 *   int8 ones written as coefficients (bfloat16 or float32, the batched matmul's dtype) where
 *   the matmul reads them, int16 ones (the few strongest coefficients) kept for lmkv_finish.
 * lmkv_finish: the matmul's products (bfloat16 or float32) to the chunk: + offset + the int16
 *   bands' products in float32, keys rotated by their positions, written with streaming stores.
 *
 * lmkv_decode_amx: both in one pass per (kv, layer) matrix, with AMX tiles.
 *
 * Re-entrant (the only state is one zstd context per thread). Every length read from a
 * payload is checked before it is used: a payload is untrusted input. The plan arrays (sizes,
 * offsets, bands) come from the caller's validated table and are trusted. */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#define LMKV_ASAN 1 /* gcc */
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LMKV_ASAN 1 /* clang */
#endif
#endif

/* libzstd (the system's libzstd.so.1; declared here so that no header package is needed) */
size_t ZSTD_decompressDCtx(void *dctx, void *dst, size_t capacity, const void *src, size_t size);
void *ZSTD_createDCtx(void);
size_t ZSTD_freeDCtx(void *dctx);
unsigned ZSTD_isError(size_t code);
size_t ZSTD_findFrameCompressedSize(const void *src, size_t size);
#define ZSTD_MAGICNUMBER 0xFD2FB528u

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

static void int8_to_f32(const int8_t *src, float *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = (float)src[i];
}

static uint32_t read_u32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

/* This thread's zstd decompression context: made on first use, freed when the thread ends. */
static pthread_key_t dctx_key;
static pthread_once_t dctx_once = PTHREAD_ONCE_INIT;
static void free_dctx(void *dctx) { ZSTD_freeDCtx(dctx); }
static void make_dctx_key(void) { pthread_key_create(&dctx_key, free_dctx); }

static void *thread_dctx(void) {
    pthread_once(&dctx_once, make_dctx_key);
    void *dctx = pthread_getspecific(dctx_key);
    if (dctx == NULL && (dctx = ZSTD_createDCtx()) != NULL) pthread_setspecific(dctx_key, dctx);
    return dctx;
}

/* One stream's `length` bytes at src, of `width`, to its n symbols: int8 at dst (widths 1
 * and 3) or int16 at wide_dst (width 2). Returns the width, or < 0 if they do not fit. */
static int read_stream(void *dctx, unsigned width, const uint8_t *src, size_t length, size_t n,
                       int8_t *dst, int16_t *wide_dst) {
    if (width != WIDTH_INT8 && width != WIDTH_INT16 && width != WIDTH_STORED) return E_WIDTH;
    if (n == 0 || length == 0) {
        if (n != 0 || length != 0) return E_LENGTH;
        memset(dst, 0, n);
        return WIDTH_INT8;
    }
    if (width == WIDTH_STORED) {
        if (length != n) return E_LENGTH;
        memcpy(dst, src, n);
        return WIDTH_STORED;
    }
    void *out = width == WIDTH_INT16 ? (void *)wide_dst : (void *)dst;
    size_t want = width == WIDTH_INT16 ? n * 2 : n;
    /* exactly one zstd frame, as the torch decoder takes (libzstd would also decode frames
     * after it, skippable ones and legacy formats) */
    if (length < 4 || (src[0] | src[1] << 8 | src[2] << 16 | (uint32_t)src[3] << 24) != ZSTD_MAGICNUMBER
        || ZSTD_findFrameCompressedSize(src, length) != length) return E_ZSTD;
    size_t got = ZSTD_decompressDCtx(dctx, out, want, src, length);
    if (ZSTD_isError(got) || got != want) return E_ZSTD;
    return (int)width;
}

/* Decode the `count` streams whose 5-byte descriptors (width u8, length u32 LE) start at
 * payload + desc; the stream bytes follow the descriptors and must end at payload + len.
 * Stream i holds sizes[i] symbols, written at coef + at[i] (elements: float32 if coef_f32,
 * else bfloat16); a wide (int16) stream goes to wide_sym + at[i] instead (its coef range
 * zeroed) and its index to wide[] (their number is returned). gaps: n_gaps (offset, length)
 * pairs of coef zeroed too (coefficients not stored). coef and wide_sym hold coef_len
 * elements each. On error returns < 0 and sets *bad to the stream concerned (or the stray
 * byte count). */
long lmkv_symbols(const uint8_t *payload, size_t len, size_t desc, int count, const int64_t *sizes,
                  const int64_t *at, void *coef_out, int coef_f32, int16_t *wide_sym, size_t coef_len,
                  const int64_t *gaps, int n_gaps, int32_t *wide, int64_t *bad) {
    size_t off = desc + (size_t)count * 5, most = 0, es = coef_f32 ? 4 : 2;
    char *coef = coef_out;
    long n_wide = 0;
    *bad = -1;
    if (desc > len || off > len) return E_TRUNCATED;
    for (int i = 0; i < count; i++) {
        if (sizes[i] < 0 || at[i] < 0 || (size_t)at[i] + (size_t)sizes[i] > coef_len) { *bad = i; return E_LENGTH; }
        if ((size_t)sizes[i] > most) most = (size_t)sizes[i];
    }
    for (int g = 0; g < n_gaps; g++) {
        if (gaps[2 * g] < 0 || gaps[2 * g + 1] < 0 || (size_t)(gaps[2 * g] + gaps[2 * g + 1]) > coef_len) { *bad = g; return E_LENGTH; }
        memset(coef + (size_t)gaps[2 * g] * es, 0, (size_t)gaps[2 * g + 1] * es);
    }
    int8_t *tmp = malloc(most ? most : 1);
    void *dctx = thread_dctx();
    long rc = OK;
    if (tmp == NULL || dctx == NULL) { rc = E_MEMORY; goto done; }
    for (int i = 0; i < count; i++) {
        const uint8_t *d = payload + desc + (size_t)i * 5;
        size_t length = read_u32(d + 1), n = (size_t)sizes[i];
        *bad = i;
        if (length > len - off) { rc = E_WIDTH; goto done; }
        int r = read_stream(dctx, d[0], payload + off, length, n, tmp, wide_sym + at[i]);
        off += length;
        if (r < 0) { rc = r; goto done; }
        if (r == WIDTH_INT16) {
            memset(coef + (size_t)at[i] * es, 0, n * es);
            wide[n_wide++] = i;
        } else if (coef_f32) {
            int8_to_f32(tmp, (float *)coef + at[i], n);
        } else {
            int8_to_bf16(tmp, (uint16_t *)coef + at[i], n);
        }
    }
    *bad = (int64_t)(len - off);
    rc = off == len ? n_wide : E_STRAY;
done:
    free(tmp);
    return rc;
}

enum { OUT_F32 = 0, OUT_F16 = 1, OUT_BF16 = 2 }; /* the chunk's dtype */

/* float32 to bfloat16, rounded to nearest even (NaN: the canonical quiet NaN, as torch) */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* A row of c floats to out in the chunk's dtype, rounded once. float32 rows use streaming
 * stores where 64-byte aligned (the chunk is not read again before it is copied on, so it
 * need not pass through the cache). */
static void put_row(void *out, int kind, const float *row, int c) {
    if (kind == OUT_F16) {
        uint16_t *o = out;
        for (int j = 0; j < c; j++) {
            _Float16 h = (_Float16)row[j]; /* the compiler's IEEE conversion, nearest even */
            memcpy(o + j, &h, 2);
        }
        return;
    }
    if (kind == OUT_BF16) {
        uint16_t *o = out;
        for (int j = 0; j < c; j++) o[j] = float_to_bf16(row[j]);
        return;
    }
#if defined(__AVX512F__) && !defined(LMKV_ASAN) /* ASan does not see streaming stores */
    if (((uintptr_t)out & 63) == 0 && c % 16 == 0) {
        for (int j = 0; j < c; j += 16) _mm512_stream_ps((float *)out + j, _mm512_load_ps(row + j));
        return;
    }
#endif
    memcpy(out, row, (size_t)c * 4);
}

/* What a decode pass shares: the table's float32 synthesis rows [n, c, c] and offset [n, c],
 * the int16 bands (symbols at wide_sym + at[s] for each stream s in wide[]; band[3 s ..] =
 * matrix, first and end coefficient), the keys' rotation and the output. */
struct pass {
    int t, heads, d, c, n_rot, n_wide;
    const float *offset, *synthesis, *cosv, *sinv;
    const int16_t *wide_sym;
    const int32_t *wide, *band;
    const int64_t *at;
    void *out; /* [n, t, c] of out_kind */
    int out_kind;
};

/* Row r of matrix m, its product in row[c]: + offset + the int16 bands' products, keys
 * rotated by cos/sin [t, d/2] (HF rotate_half pairs j, j + d/2), stored to out. */
static void finish_row(const struct pass *p, int m, int r, float *row) {
    int c = p->c, d = p->d, half = p->d / 2;
    const float *off = p->offset + (size_t)m * c;
    for (int j = 0; j < c; j++) row[j] += off[j];
    for (int w = 0; w < p->n_wide; w++) {
        const int32_t *b = p->band + 3 * p->wide[w];
        if (b[0] != m) continue;
        const int16_t *q = p->wide_sym + p->at[p->wide[w]] + r;
        for (int k = b[1]; k < b[2]; k++) {
            float x = (float)q[(size_t)(k - b[1]) * p->t];
            const float *s = p->synthesis + ((size_t)m * c + k) * c;
            for (int j = 0; j < c; j++) row[j] += x * s[j];
        }
    }
    char *o = (char *)p->out + ((size_t)m * p->t + r) * c * (p->out_kind == OUT_F32 ? 4 : 2);
    if (m >= p->n_rot) {
        put_row(o, p->out_kind, row, c);
        return;
    }
    float rot[4096] __attribute__((aligned(64)));
    const float *cs = p->cosv + (size_t)r * half, *sn = p->sinv + (size_t)r * half;
    for (int h = 0; h < p->heads; h++) {
        const float *x = row + h * d;
        float *y = rot + h * d;
        for (int j = 0; j < half; j++) {
            y[j] = x[j] * cs[j] - x[j + half] * sn[j];
            y[j + half] = x[j + half] * cs[j] + x[j] * sn[j];
        }
    }
    put_row(o, p->out_kind, rot, c);
}

/* out[m, t, :] = low[m, t, :] (the products: float32 if low_f32, else bfloat16) finished by
 * finish_row, for n matrices of t rows of heads * d (<= 4096); the first n_rot are keys; out
 * in float32, float16 or bfloat16 (out_kind 0, 1, 2). */
int lmkv_finish(int n, int t, int heads, int d, const void *low, int low_f32, const float *offset,
                const float *synthesis, const int16_t *wide_sym, const int32_t *wide, int n_wide,
                const int32_t *band, const int64_t *at, void *out, int out_kind, int n_rot,
                const float *cosv, const float *sinv) {
    int c = heads * d;
    if (c > 4096 || d % 2 || out_kind < OUT_F32 || out_kind > OUT_BF16) return -1;
    struct pass p = {t, heads, d, c, n_rot, n_wide, offset, synthesis, cosv, sinv, wide_sym, wide, band, at,
                     out, out_kind};
    float row[4096] __attribute__((aligned(64)));
    for (int m = 0; m < n; m++) {
        for (int r = 0; r < t; r++) {
            size_t at_row = ((size_t)m * t + r) * c;
            if (low_f32) {
                memcpy(row, (const float *)low + at_row, (size_t)c * 4);
            } else {
                const uint16_t *l = (const uint16_t *)low + at_row;
                for (int j = 0; j < c; j++) row[j] = bf16_to_float(l[j]);
            }
            finish_row(&p, m, r, row);
        }
    }
#if defined(__AVX512F__)
    _mm_sfence();
#endif
    return 0;
}

/* ---- one pass per (kv, layer) matrix with AMX (Intel Sapphire Rapids and later) ---- */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>

/* Whether AMX tiles may be used: compiled in and granted by the kernel (once per process). */
int lmkv_amx(void) {
    static int ok = -1;
    if (ok < 0) ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* 16 x 16 floats: dst[r][c] = src[c][r] (rows of dst_stride floats; src rows of 16). */
static void transpose16(const float *src, float *dst, int dst_stride) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(src + 16 * i);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + (size_t)dst_stride * i, r[i]);
}

/* A whole transform payload in one pass per (kv, layer) matrix m: its streams to int8
 * symbols [c, t], paired into bfloat16 (VNNI layout), times the bfloat16 synthesis columns
 * synthesis_t [n, c, c] with AMX, 16 tokens at a time, each row finished by finish_row.
 * Streams are in matrix order (band[3 s] non-decreasing); c % 32 == 0, t % 16 == 0. Returns
 * the int16 streams' count (their indices in wide[]) or < 0 as lmkv_symbols does. */
long lmkv_decode_amx(const uint8_t *payload, size_t len, size_t desc, int count, const int64_t *sizes,
                     const int64_t *at, const int32_t *band, int n, int t, int heads, int d,
                     const uint16_t *synthesis_t, const float *offset, const float *synthesis,
                     int16_t *wide_sym, void *out, int out_kind, int n_rot, const float *cosv, const float *sinv,
                     uint8_t *work, size_t work_len, int32_t *wide, int64_t *bad) {
    int c = heads * d;
    size_t mat = (size_t)c * t, off = desc + (size_t)count * 5;
    *bad = -1;
    if (!lmkv_amx() || c % 32 || t <= 0 || t % 16 || c > 4096 || d % 2 || out_kind < OUT_F32
        || out_kind > OUT_BF16) return E_LENGTH;
    if (desc > len || off > len) return E_TRUNCATED;
    for (int i = 0; i < count; i++) {
        int m = band[3 * i];
        if (m < 0 || m >= n || (i && m < band[3 * i - 3]) || sizes[i] < 0 || at[i] < (int64_t)(m * mat)
            || (size_t)(at[i] - (int64_t)(m * mat)) + (size_t)sizes[i] > mat) { *bad = i; return E_LENGTH; }
    }
    struct pass p = {t, heads, d, c, n_rot, 0, offset, synthesis, cosv, sinv, wide_sym, wide, band, at,
                     out, out_kind};
    /* work (64-byte aligned): token pairs [c / 2, t] u32, the products by column [c, t] f32,
     * 16 tokens' by row [16, c] f32, symbols [c, t] i8 */
    if ((uintptr_t)work & 63 || work_len < mat * 7 + (size_t)c * 64) return E_MEMORY;
    uint32_t *pairs = (uint32_t *)work;
    float *cols = (float *)(work + mat * 2), *rows = cols + mat;
    int8_t *sym = (int8_t *)(rows + (size_t)c * 16);
    void *dctx = thread_dctx();
    long rc = OK;
    if (!dctx) return E_MEMORY;
    struct tile_config cfg = {0};
    cfg.palette = 1;
    for (int i = 0; i < 6; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64; /* 0-3 C, 4 A, 5 B */
    _tile_loadconfig(&cfg);
    int s = 0;
    for (int m = 0; m < n; m++) {
        memset(sym, 0, mat);
        for (; s < count && band[3 * s] == m; s++) {
            const uint8_t *dsc = payload + desc + (size_t)s * 5;
            size_t length = read_u32(dsc + 1);
            *bad = s;
            if (length > len - off) { rc = E_WIDTH; goto release; }
            int r = read_stream(dctx, dsc[0], payload + off, length, (size_t)sizes[s],
                                sym + (at[s] - (int64_t)(m * mat)), wide_sym + at[s]);
            off += length;
            if (r < 0) { rc = r; goto release; }
            if (r == WIDTH_INT16) {
                memset(sym + (at[s] - (int64_t)(m * mat)), 0, (size_t)sizes[s]);
                wide[p.n_wide++] = s;
            }
        }
        for (int k = 0; k < c; k += 2) { /* pair coefficients k, k + 1 of each token */
            const int8_t *a = sym + (size_t)k * t, *b = a + t;
            uint32_t *dst = pairs + (size_t)(k / 2) * t;
            for (int r = 0; r < t; r++)
                dst[r] = (uint32_t)small_int_to_bf16(b[r]) << 16 | small_int_to_bf16(a[r]);
        }
        /* 64 output channels at a time (their synthesis columns stay in L1) over all tokens */
        const uint16_t *at_m = synthesis_t + (size_t)m * c * c;
        for (int jb = 0; jb < c / 16; jb += 4) {
            int nj = c / 16 - jb < 4 ? c / 16 - jb : 4;
            const uint16_t *a = at_m + (size_t)jb * 16 * c;
            for (int tb = 0; tb < t; tb += 16) {
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int kb = 0; kb < c; kb += 32) {
                    _tile_loadd(5, pairs + (size_t)(kb / 2) * t + tb, t * 4);
                    _tile_loadd(4, a + kb, c * 2); _tile_dpbf16ps(0, 4, 5);
                    if (nj > 1) { _tile_loadd(4, a + 16 * c + kb, c * 2); _tile_dpbf16ps(1, 4, 5); }
                    if (nj > 2) { _tile_loadd(4, a + 32 * c + kb, c * 2); _tile_dpbf16ps(2, 4, 5); }
                    if (nj > 3) { _tile_loadd(4, a + 48 * c + kb, c * 2); _tile_dpbf16ps(3, 4, 5); }
                }
                float *col = cols + ((size_t)tb / 16 * (c / 16) + jb) * 256; /* [t / 16][c / 16][16 x 16] */
                _tile_stored(0, col, 64);
                if (nj > 1) _tile_stored(1, col + 256, 64);
                if (nj > 2) _tile_stored(2, col + 512, 64);
                if (nj > 3) _tile_stored(3, col + 768, 64);
            }
        }
        for (int tb = 0; tb < t; tb += 16) {
            const float *col = cols + (size_t)tb / 16 * (c / 16) * 256;
            for (int jb = 0; jb < c / 16; jb++) transpose16(col + (size_t)jb * 256, rows + jb * 16, c);
            for (int r = 0; r < 16; r++) finish_row(&p, m, tb + r, rows + (size_t)r * c);
        }
    }
    *bad = (int64_t)(len - off);
    rc = off == len ? p.n_wide : E_STRAY;
release:
    _tile_release();
    _mm_sfence();
    return rc;
}
#else
int lmkv_amx(void) { return 0; }
long lmkv_decode_amx(const uint8_t *payload, size_t len, size_t desc, int count, const int64_t *sizes,
                     const int64_t *at, const int32_t *band, int n, int t, int heads, int d,
                     const uint16_t *synthesis_t, const float *offset, const float *synthesis,
                     int16_t *wide_sym, void *out, int out_kind, int n_rot, const float *cosv, const float *sinv,
                     uint8_t *work, size_t work_len, int32_t *wide, int64_t *bad) {
    return E_LENGTH; /* never called: lmkv_amx() is 0 */
}
#endif
