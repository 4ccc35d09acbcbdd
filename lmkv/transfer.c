/* Copies between an engine's paged KV memory and a chunk on the CPU (lmkv/transfer.py builds
 * and loads this).
 *
 * lmkv_transfer: tokens [0, tokens) of a chunk [2, L, T, Hkv, D] to or from their slots in
 *   paged memory [L, 2, slots, Hkv, D] (rows of Hkv * D elements contiguous on both sides;
 *   any strides above them). Tokens whose slots follow one another form a run, copied with
 *   one memcpy per layer and K/V where the chunk's tokens are contiguous too. Every slot is
 *   checked before anything is written. Large copies are split over threads by bytes and,
 *   when asked, written with streaming stores (they bypass the caches: a multi-megabyte
 *   copy does not evict what the engine is working on, and skips reading its destination).
 *
 * Re-entrant; no state outside a call. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

enum { OK = 0, E_SLOT = -1, E_MEMORY = -2 };
enum { MAX_THREADS = 64 };
static const int64_t THREAD_BYTES = 2 << 20; /* the least a thread is started for */

typedef struct {
    int64_t t, slot, n; /* a run: tokens [t, t + n) at slots [slot, slot + n) */
} run_t;

typedef struct {
    char *chunk, *pages;
    const run_t *runs;
    int64_t nruns, tokens, row;
    int64_t c_kv, c_layer, c_t, p_layer, p_kv, p_slot; /* strides, in bytes */
    int64_t lo, hi; /* this part: [lo, hi) of the (layer * 2 + kv) * tokens + token space */
    int to_paged, stream;
} part_t;

/* n bytes from src to dst with streaming stores where the vector width allows */
static void copy_streaming(char *dst, const char *src, int64_t n) {
#if defined(__AVX512F__)
    enum { W = 64 };
#elif defined(__AVX__)
    enum { W = 32 };
#elif defined(__SSE2__)
    enum { W = 16 };
#else
    enum { W = 0 };
#endif
    if (W == 0 || n < 4 * W) {
        memcpy(dst, src, (size_t)n);
        return;
    }
    int64_t head = (int64_t)((W - ((uintptr_t)dst & (W - 1))) & (W - 1));
    memcpy(dst, src, (size_t)head);
    dst += head, src += head, n -= head;
    int64_t body = n & ~(int64_t)(W - 1);
    for (int64_t i = 0; i < body; i += W) {
#if defined(__AVX512F__)
        _mm512_stream_si512((void *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
#elif defined(__AVX__)
        _mm256_stream_si256((__m256i *)(dst + i), _mm256_loadu_si256((const __m256i *)(src + i)));
#elif defined(__SSE2__)
        _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
#endif
    }
    memcpy(dst + body, src + body, (size_t)(n - body));
}

/* the run holding token t (runs are sorted by t and cover [0, tokens)) */
static int64_t run_at(const run_t *runs, int64_t nruns, int64_t t) {
    int64_t a = 0, b = nruns - 1;
    while (a < b) {
        int64_t m = (a + b + 1) / 2;
        if (runs[m].t <= t) a = m;
        else b = m - 1;
    }
    return a;
}

static void *copy_part(void *arg) {
    const part_t *p = arg;
    for (int64_t pair = p->lo / p->tokens; pair * p->tokens < p->hi; pair++) {
        int64_t base = pair * p->tokens, layer = pair / 2, kv = pair % 2;
        int64_t a = (p->lo > base ? p->lo : base) - base;
        int64_t b = (p->hi < base + p->tokens ? p->hi : base + p->tokens) - base;
        char *chunk = p->chunk + kv * p->c_kv + layer * p->c_layer;
        char *pages = p->pages + layer * p->p_layer + kv * p->p_kv;
        for (int64_t r = run_at(p->runs, p->nruns, a); r < p->nruns && p->runs[r].t < b; r++) {
            const run_t *run = &p->runs[r];
            int64_t t0 = run->t > a ? run->t : a;
            int64_t t1 = run->t + run->n < b ? run->t + run->n : b;
            char *c = chunk + t0 * p->c_t;
            char *pg = pages + (run->slot + t0 - run->t) * p->p_slot;
            char *dst = p->to_paged ? pg : c;
            const char *src = p->to_paged ? c : pg;
            int64_t n = (t1 - t0) * p->row;
            if (p->stream) copy_streaming(dst, src, n);
            else memcpy(dst, src, (size_t)n);
        }
    }
#if defined(__SSE2__)
    if (p->stream) _mm_sfence(); /* streaming stores are visible before the thread reports done */
#endif
    return NULL;
}

/* A run spans tokens only where both sides hold them back to back: the chunk's tokens are
 * rows apart (c_t == row) and so are the slots (p_slot == row). Returns OK, E_SLOT (a slot
 * outside [0, num_slots); nothing written) or E_MEMORY. */
int lmkv_transfer(char *chunk, char *pages, const int64_t *slots, int64_t tokens, int64_t num_slots,
                  int64_t layers, int64_t row, int64_t c_kv, int64_t c_layer, int64_t c_t,
                  int64_t p_layer, int64_t p_kv, int64_t p_slot, int to_paged, int threads,
                  int stream) {
    for (int64_t t = 0; t < tokens; t++) /* (also when there is nothing to copy) */
        if (slots[t] < 0 || slots[t] >= num_slots) return E_SLOT;
    if (tokens <= 0 || layers <= 0 || row <= 0) return OK;
    run_t *runs = malloc((size_t)tokens * sizeof(run_t));
    if (runs == NULL) return E_MEMORY;
    int merge = c_t == row && p_slot == row;
    int64_t nruns = 0;
    for (int64_t t = 0; t < tokens;) {
        int64_t n = 1;
        while (merge && t + n < tokens && slots[t + n] == slots[t] + n) n++;
        runs[nruns++] = (run_t){t, slots[t], n};
        t += n;
    }
    int64_t items = 2 * layers * tokens, bytes = items * row;
    int64_t n = bytes / THREAD_BYTES;
    if (n > threads) n = threads;
    if (n > MAX_THREADS) n = MAX_THREADS;
    if (n > items) n = items;
    if (n < 1) n = 1;
    part_t parts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t i = 0; i < n; i++) {
        parts[i] = (part_t){chunk, pages, runs, nruns, tokens, row, c_kv, c_layer, c_t, p_layer,
                            p_kv, p_slot, items * i / n, items * (i + 1) / n, to_paged, stream};
        /* part 0 runs here; a thread that cannot be started runs here too */
        if (i > 0) started[i] = pthread_create(&ids[i], NULL, copy_part, &parts[i]) == 0;
    }
    for (int64_t i = 0; i < n; i++)
        if (!started[i]) copy_part(&parts[i]);
    for (int64_t i = 1; i < n; i++)
        if (started[i]) pthread_join(ids[i], NULL);
    free(runs);
    return OK;
}
