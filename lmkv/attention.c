/* Paged attention on the CPU for a few queries per sequence (decode steps, short extends
 * after a cached prefix), reading the engine's paged KV in place (lmkv/cpu_attention.py
 * builds and loads this).
 *
 * lmkv_paged_attention: out[t, h] = softmax(scale * q[t, h] . K) V over the keys of t's
 *   sequence up to t's own position, for queries q [T, Hq, D] (float32, rows contiguous)
 *   and KV pages [2, blocks, block_size, Hkv, D] (float32, float16 or bfloat16; rows of
 *   Hkv * D contiguous, any block and K/V strides). Sequence i has queries [starts[i],
 *   starts[i + 1]), the last of them at position seq_lens[i] - 1, and its blocks in
 *   tables[i]. Query head h reads KV head h / (Hq / Hkv). Each sequence's keys are cut
 *   into spans of SPAN; a span is read block by block, each block's K and V rows once, in
 *   order, with a running softmax per query row (max, sum, weighted sum of V), and the
 *   spans' results are merged. Spans run in parallel with OpenMP when built with it: the
 *   same runtime as torch's (its threads, which are spinning from the step's last matrix
 *   product, take the spans at once; threads of our own would contend with them). exp() is
 *   a polynomial (relative error ~2e-7) that vectorizes.
 *
 * Re-entrant; no state outside a call. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { OK = 0, E_ARG = -1, E_MEMORY = -2 };
enum { F32 = 0, F16 = 1, BF16 = 2 };
enum { MAX_ROWS = 128, MAX_BLOCK = 128, MAX_DIM = 256 };
static const int64_t SPAN = 512; /* keys per work item */

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

/* e^x for x <= 0 (0 below -87): 2^(x log2 e) as 2^n times a polynomial of the fraction */
static inline float exp_neg(float x) {
    float t = (x < -87.f ? -87.f : x) * 1.44269504088896341f;
    float n = floorf(t), f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    union { float f; int32_t i; } u = {.f = p};
    u.i += (int32_t)n * (1 << 23);
    return x < -87.f ? 0.f : u.f;
}

static inline v16 load16(const float *p) {
    v16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* the sum of x's lanes, as a tree (a chain of 16 adds would be the dot's critical path) */
static inline float lanes_sum(v16 x) {
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    v16 acc = {0};
    int64_t e = 0;
    for (; e + 16 <= d; e += 16) acc += load16(a + e) * load16(b + e);
    float s = lanes_sum(acc);
    for (; e < d; e++) s += a[e] * b[e];
    return s;
}

#if defined(__FLT16_MAX__) && !defined(LMKV_NO_FLOAT16)
static inline float half_to_float(const char *p) { return (float)*(const _Float16 *)p; }
#else /* compilers without _Float16 (GCC < 12 on x86): from the bits */
static inline float half_to_float(const char *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    union { uint32_t i; float f; } u;
    if (exp == 0x1f) u.i = sign | 0x7f800000u | (man << 13); /* inf, nan */
    else if (exp) u.i = sign | ((exp + 112) << 23) | (man << 13);
    else { u.f = (float)man * 0x1p-24f; u.i |= sign; } /* zero, subnormal: exact */
    return u.f;
}
#endif

/* a row of d elements as float32: the row itself for float32 KV, else converted into buf */
static inline const float *as_float(const char *row, int64_t d, int64_t kind, float *buf) {
    if (kind == F32) return (const float *)row;
    if (kind == F16) {
        for (int64_t e = 0; e < d; e++) buf[e] = half_to_float(row + 2 * e);
    } else {
        const uint16_t *x = (const uint16_t *)row;
        for (int64_t e = 0; e < d; e++) {
            union { uint32_t i; float f; } u = {.i = (uint32_t)x[e] << 16};
            buf[e] = u.f;
        }
    }
    return buf;
}

/* acc = acc * keep + sum of p[i] * v[i] over i < n, rows of d; 16 columns at a time, each
 * summed in a register over the rows (through memory, every row would wait for the last) */
static inline void add_weighted(float *restrict acc, float keep, const float *restrict p,
                                const float *const *v, int64_t n, int64_t d) {
    int64_t e = 0;
    for (; e + 16 <= d; e += 16) {
        v16 a = load16(acc + e) * keep;
        for (int64_t i = 0; i < n; i++) a += p[i] * load16(v[i] + e);
        memcpy(acc + e, &a, sizeof a);
    }
    for (; e < d; e++) {
        float a = acc[e] * keep;
        for (int64_t i = 0; i < n; i++) a += p[i] * v[i][e];
        acc[e] = a;
    }
}

typedef struct {
    const char *kv;
    int64_t hq, hkv, dim, bs, kind;
    int64_t kv_half, block_bytes, token_bytes; /* strides, in bytes */
    float scale;
} pass_t;

/* Keys [t0, t1) of one sequence of len keys (blocks in table) for its nq queries q: each
 * query row's running max, sum and weighted sum of V into state (row qi * hq + head). */
static void attend(const pass_t *p, const float *q, float *state, int64_t nq, int64_t len,
                   int64_t t0, int64_t t1, const int64_t *table, float *kbuf, float *vbuf,
                   float *scores) {
    int64_t d = p->dim, g = p->hq / p->hkv, elem = p->kind == F32 ? 4 : 2, width = d + 2;
    const float *krow[MAX_BLOCK], *vrow[MAX_BLOCK];
    for (int64_t r = 0; r < nq * p->hq; r++) {
        state[r * width] = -INFINITY;
        state[r * width + 1] = 0.f;
        memset(state + r * width + 2, 0, (size_t)d * sizeof(float));
    }
    for (int64_t tb = t0; tb < t1;) {
        int64_t off = tb % p->bs, n = p->bs - off < t1 - tb ? p->bs - off : t1 - tb;
        const char *block = p->kv + table[tb / p->bs] * p->block_bytes + off * p->token_bytes;
        for (int64_t h = 0; h < p->hkv; h++) {
            const char *base = block + h * d * elem;
            for (int64_t i = 0; i < n; i++) {
                const char *row = base + i * p->token_bytes;
                krow[i] = as_float(row, d, p->kind, kbuf + i * d);
                vrow[i] = as_float(row + p->kv_half, d, p->kind, vbuf + i * d);
                for (int64_t qi = 0; qi < nq; qi++)
                    for (int64_t r = 0; r < g; r++)
                        scores[(qi * g + r) * MAX_BLOCK + i] =
                            dot(q + (qi * p->hq + h * g + r) * d, krow[i], d) * p->scale;
            }
            for (int64_t qi = 0; qi < nq; qi++) {
                int64_t valid = len - nq + qi + 1 - tb;
                if (valid <= 0) continue;
                if (valid > n) valid = n;
                for (int64_t r = 0; r < g; r++) {
                    float *restrict s = scores + (qi * g + r) * MAX_BLOCK;
                    float *m = state + (qi * p->hq + h * g + r) * width;
                    float top = m[0], sum = 0.f;
                    for (int64_t i = 0; i < valid; i++) top = s[i] > top ? s[i] : top;
                    float keep = m[0] == -INFINITY ? 0.f : exp_neg(m[0] - top);
                    for (int64_t i = 0; i < valid; i++) s[i] = exp_neg(s[i] - top);
                    for (int64_t i = 0; i < valid; i++) sum += s[i];
                    add_weighted(m + 2, keep, s, vrow, valid, d);
                    m[0] = top;
                    m[1] = m[1] * keep + sum;
                }
            }
        }
        tb += n;
    }
}

/* tables: [nseq, table_stride] block ids, of num_blocks; seq_lens, starts: [nseq],
 * [nseq + 1]; kind: F32, F16 or BF16 (the KV's); out: [T, Hq, D] float32. Returns OK, E_ARG
 * (a shape beyond the limits above, a sequence with more queries than keys or longer than
 * its table, a block id outside the pages; nothing read) or E_MEMORY. */
int lmkv_paged_attention(const float *q, float *out, const char *kv, const int64_t *tables,
                         int64_t table_stride, const int64_t *seq_lens, const int64_t *starts,
                         int64_t nseq, int64_t hq, int64_t hkv, int64_t dim, int64_t bs,
                         int64_t kind, int64_t kv_half, int64_t block_bytes, int64_t num_blocks,
                         float scale) {
    if (hkv <= 0 || hq % hkv || dim <= 0 || dim > MAX_DIM || bs <= 0 || bs > MAX_BLOCK
        || (kind != F32 && kind != F16 && kind != BF16))
        return E_ARG;
    int64_t items = 0;
    for (int64_t s = 0; s < nseq; s++) {
        int64_t nq = starts[s + 1] - starts[s], used = (seq_lens[s] + bs - 1) / bs;
        if (nq < 0 || nq * (hq / hkv) > MAX_ROWS || seq_lens[s] < nq) return E_ARG;
        if (nq == 0) continue;
        if (used > table_stride) return E_ARG;
        for (int64_t b = 0; b < used; b++)
            if (tables[s * table_stride + b] < 0 || tables[s * table_stride + b] >= num_blocks)
                return E_ARG;
        items += (seq_lens[s] + SPAN - 1) / SPAN;
    }
    if (items == 0) return OK;
    int64_t *ints = malloc((size_t)items * 4 * sizeof(int64_t));
    if (ints == NULL) return E_MEMORY;
    int64_t *iseq = ints, *it0 = ints + items, *it1 = ints + 2 * items, *ioff = ints + 3 * items;
    int64_t n = 0, floats = 0;
    for (int64_t s = 0; s < nseq; s++) {
        int64_t nq = starts[s + 1] - starts[s];
        if (nq == 0) continue;
        for (int64_t t = 0; t < seq_lens[s]; t += SPAN, n++) {
            iseq[n] = s, it0[n] = t, it1[n] = t + SPAN < seq_lens[s] ? t + SPAN : seq_lens[s];
            ioff[n] = floats;
            floats += nq * hq * (dim + 2);
        }
    }
    float *partial = malloc((size_t)floats * sizeof(float));
    if (partial == NULL) {
        free(ints);
        return E_MEMORY;
    }
    int64_t elem = kind == F32 ? 4 : 2;
    pass_t p = {kv, hq, hkv, dim, bs, kind, kv_half, block_bytes, hkv * dim * elem, scale};
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *work = malloc((size_t)(2 * MAX_BLOCK * MAX_DIM + MAX_ROWS * MAX_BLOCK) * sizeof(float));
        failed = work == NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < items; i++) {
            if (work == NULL) continue;
            int64_t s = iseq[i];
            attend(&p, q + starts[s] * hq * dim, partial + ioff[i], starts[s + 1] - starts[s],
                   seq_lens[s], it0[i], it1[i], tables + s * table_stride, work,
                   work + MAX_BLOCK * MAX_DIM, work + 2 * MAX_BLOCK * MAX_DIM);
        }
        free(work);
    }
    for (int64_t a = 0; a < items && !failed;) { /* merge each sequence's spans */
        int64_t s = iseq[a], b = a;
        while (b < items && iseq[b] == s) b++;
        int64_t first = starts[s], rows = (starts[s + 1] - first) * hq;
        for (int64_t row = 0; row < rows; row++) {
            float top = -INFINITY, sum = 0.f;
            for (int64_t i = a; i < b; i++) {
                float m = partial[ioff[i] + row * (dim + 2)];
                top = m > top ? m : top;
            }
            float *o = out + (first * hq + row) * dim;
            memset(o, 0, (size_t)dim * sizeof(float));
            for (int64_t i = a; i < b; i++) {
                const float *m = partial + ioff[i] + row * (dim + 2);
                if (m[0] == -INFINITY) continue;
                float w = exp_neg(m[0] - top);
                sum += w * m[1];
                for (int64_t e = 0; e < dim; e++) o[e] += w * m[2 + e];
            }
            for (int64_t e = 0; e < dim; e++) o[e] /= sum;
        }
        a = b;
    }
    free(partial);
    free(ints);
    return failed ? E_MEMORY : OK;
}
