/* Paged attention on the CPU for a mixed batch of prefill chunks and decode tokens.
 *
 * The same contract as kernels/paged_attention.py: sequence b owns query rows
 * query_start_loc[b] .. query_start_loc[b+1], its last q_len positions of a context of
 * seq_lens[b] tokens whose keys and values (the new ones included) are already in the paged
 * caches [num_blocks, block_size, Hk, D]. Query row i of it sits at position
 * seq_len - q_len + i and attends causally to positions 0..that position. GQA: query head h
 * reads kv head h / (Hq / Hk). Rows outside every sequence are written as zeros.
 *
 * A work item is a tile of up to ROWS query rows of one sequence and a range of its kv heads.
 * It walks the sequence's blocks straight from the block table (no gather, no padding to the
 * longest sequence), a chunk of at most CHUNK keys at a time; every key and value row it loads
 * serves all the tile's query heads of that kv head. The next block is prefetched while one is
 * processed. Scores and the running softmax are float32 (online softmax, rescaled once per
 * chunk). Items are spread over OpenMP threads; the library is loaded after torch and uses the
 * libgomp torch has loaded, so both share one thread pool.
 *
 * Element types: 0 = float32, 1 = bfloat16 (query, caches and output share one type).
 * Built and loaded by kernels/cpu_attention.py.
 */
#include "cpu_common.h"

#define ROWS 8    /* query rows per tile (prefill chunks) */
#define CHUNK 32  /* keys per softmax update */

/* q . k over d < n (both float, q pre-scaled). */
static inline float dot_f32(const float *restrict q, const float *restrict k, int n) {
    float s = 0.0f;
    for (int d = 0; d < n; d++) s += q[d] * k[d];
    return s;
}

/* s[t] <- exp(s[t] - max) for t < n; returns the sum. */
static inline float exp_sum(float *s, int n, float max) {
    float sum = 0.0f;
#ifdef __AVX512F__
    for (int t0 = 0; t0 < n; t0 += 16) {
        const __mmask16 live = (__mmask16)(n - t0 >= 16 ? 0xffff : (1u << (n - t0)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(live, s + t0);
        const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, _mm512_set1_ps(max))));
        _mm512_mask_storeu_ps(s + t0, live, e);
        sum += _mm512_reduce_add_ps(e);
    }
#else
    for (int t = 0; t < n; t++) {
        s[t] = expf(s[t] - max);
        sum += s[t];
    }
#endif
    return sum;
}

typedef struct {
    int32_t seq, row0, nrows, kvh0, kvh1;
} Item;

typedef struct { /* one thread's buffers, sized for ROWS rows x Hq heads */
    float *q, *acc, *m, *l, *s, *kbuf; /* kbuf: CHUNK x D, a chunk's keys or values */
} Scratch;

static void prefetch_block(const char *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

/* One item: rows row0..row0+nrows-1 (positions pos0.. consecutive) of sequence `seq`, kv heads
 * kvh0..kvh1-1. */
static void attend_item(const Item *it, Scratch *w, void *out, const void *query,
                        const char *k_cache, const char *v_cache, const int32_t *table,
                        int64_t pos0, int num_q_heads, int num_kv_heads, int head_size,
                        int block_size, int max_blocks, int64_t q_stride_t, int64_t out_stride_t,
                        float scale, int dtype) {
    const int group = num_q_heads / num_kv_heads;
    const size_t esize = dtype == 1 ? 2 : 4;
    const int64_t token_stride = (int64_t)num_kv_heads * head_size;
    const int64_t block_stride = (int64_t)block_size * token_stride;
    const int D = head_size, R = it->nrows;
    const int vec = D % 16 == 0; /* the AVX-512 loops take whole 16-lane chunks */
    (void)vec;
    /* state index of (row r, query head h): r * Hq + h */
    for (int r = 0; r < R; r++) {
        const char *q_row = (const char *)query + (size_t)(it->row0 + r) * q_stride_t * esize;
        for (int h = it->kvh0 * group; h < it->kvh1 * group; h++) {
            float *q = w->q + ((size_t)r * num_q_heads + h) * D;
            load_row(q, q_row + (size_t)h * D * esize, D, dtype);
            for (int d = 0; d < D; d++) q[d] *= scale;
            memset(w->acc + ((size_t)r * num_q_heads + h) * D, 0, sizeof(float) * D);
            w->m[r * num_q_heads + h] = -INFINITY;
            w->l[r * num_q_heads + h] = 0.0f;
        }
    }
    const int64_t kv_len = pos0 + R; /* the last row sees keys 0..pos0+R-1 */
    const int64_t nblocks = (kv_len + block_size - 1) / block_size;
    for (int64_t j = 0; j < nblocks && j < max_blocks; j++) {
        const int64_t blk = table[j];
        if (blk < 0) continue; /* an unfilled table entry: nothing cached there */
        if (j + 1 < nblocks && j + 1 < max_blocks && table[j + 1] >= 0) {
            const size_t bytes = (size_t)block_stride * esize;
            prefetch_block(k_cache + (size_t)table[j + 1] * bytes, bytes);
            prefetch_block(v_cache + (size_t)table[j + 1] * bytes, bytes);
        }
        for (int c0 = 0; c0 < block_size; c0 += CHUNK) {
            const int64_t key0 = j * block_size + c0; /* position of the chunk's first key */
            if (key0 >= kv_len) break;
            int n = block_size - c0 < CHUNK ? block_size - c0 : CHUNK;
            if (key0 + n > kv_len) n = (int)(kv_len - key0);
            const char *kb = k_cache + ((size_t)blk * block_stride + (size_t)c0 * token_stride) * esize;
            const char *vb = v_cache + ((size_t)blk * block_stride + (size_t)c0 * token_stride) * esize;
            int nv[ROWS]; /* keys of this chunk each row sees (causal) */
            for (int r = 0; r < R; r++) {
                const int64_t v = pos0 + r + 1 - key0;
                nv[r] = v <= 0 ? 0 : (v < n ? (int)v : n);
            }
            for (int kvh = it->kvh0; kvh < it->kvh1; kvh++) {
                const int h0 = kvh * group;
                /* the chunk's keys of this kv head as floats: kbuf[t * D + d] */
                for (int t = 0; t < n; t++)
                    load_row(w->kbuf + (size_t)t * D,
                             kb + ((size_t)t * token_stride + (size_t)kvh * D) * esize, D, dtype);
                /* scores s[(r * Hq + h) * CHUNK + t] */
                for (int r = 0; r < R; r++) {
                    for (int h = h0; h < h0 + group; h++) {
                        const size_t i = (size_t)r * num_q_heads + h;
                        const float *q = w->q + i * D;
                        float *s = w->s + i * CHUNK;
#ifdef __AVX512F__
                        if (vec) {
                            __m512 q4[16];
                            for (int c = 0; c < D / 16; c++) q4[c] = _mm512_loadu_ps(q + 16 * c);
                            for (int t = 0; t < nv[r]; t++) {
                                const float *k = w->kbuf + (size_t)t * D;
                                __m512 dot = _mm512_mul_ps(q4[0], _mm512_loadu_ps(k));
                                for (int c = 1; c < D / 16; c++)
                                    dot = _mm512_fmadd_ps(q4[c], _mm512_loadu_ps(k + 16 * c), dot);
                                s[t] = _mm512_reduce_add_ps(dot);
                            }
                            continue;
                        }
#endif
                        for (int t = 0; t < nv[r]; t++) s[t] = dot_f32(q, w->kbuf + (size_t)t * D, D);
                    }
                }
                /* online softmax update */
                for (int r = 0; r < R; r++) {
                    if (nv[r] == 0) continue;
                    for (int h = h0; h < h0 + group; h++) {
                        const size_t i = (size_t)r * num_q_heads + h;
                        float *s = w->s + i * CHUNK;
                        float bmax = w->m[i];
                        for (int t = 0; t < nv[r]; t++) bmax = s[t] > bmax ? s[t] : bmax;
                        const float corr = w->m[i] == -INFINITY ? 0.0f : expf(w->m[i] - bmax);
                        w->l[i] = w->l[i] * corr + exp_sum(s, nv[r], bmax);
                        w->m[i] = bmax;
                        if (corr != 1.0f) {
                            float *a = w->acc + i * D;
                            for (int d = 0; d < D; d++) a[d] *= corr;
                        }
                    }
                }
                /* acc += p V, the chunk's values as floats first */
                for (int t = 0; t < n; t++)
                    load_row(w->kbuf + (size_t)t * D,
                             vb + ((size_t)t * token_stride + (size_t)kvh * D) * esize, D, dtype);
                for (int r = 0; r < R; r++) {
                    for (int h = h0; h < h0 + group; h++) {
                        const size_t i = (size_t)r * num_q_heads + h;
                        const float *p = w->s + i * CHUNK;
                        float *a = w->acc + i * D;
#ifdef __AVX512F__
                        if (vec) {
                            for (int c = 0; c < D / 16; c++) {
                                __m512 acc = _mm512_loadu_ps(a + 16 * c);
                                for (int t = 0; t < nv[r]; t++)
                                    acc = _mm512_fmadd_ps(_mm512_set1_ps(p[t]),
                                                          _mm512_loadu_ps(w->kbuf + (size_t)t * D + 16 * c), acc);
                                _mm512_storeu_ps(a + 16 * c, acc);
                            }
                            continue;
                        }
#endif
                        for (int t = 0; t < nv[r]; t++)
                            for (int d = 0; d < D; d++) a[d] += p[t] * w->kbuf[(size_t)t * D + d];
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {
        char *out_row = (char *)out + (size_t)(it->row0 + r) * out_stride_t * esize;
        for (int h = it->kvh0 * group; h < it->kvh1 * group; h++) {
            const size_t i = (size_t)r * num_q_heads + h;
            const float inv = w->l[i] > 0.0f ? 1.0f / w->l[i] : 0.0f;
            float *a = w->acc + i * D;
            for (int d = 0; d < D; d++) a[d] *= inv;
            store_row(out_row + (size_t)h * D * esize, a, D, dtype);
        }
    }
}

/* Returns 0, -1 on a bad size, -2 when out of memory. */
int paged_attention_cpu(
    void *out,                /* [T, Hq, D], row stride out_stride_t, head stride D */
    const void *query,        /* [T, Hq, D], row stride q_stride_t, head stride D */
    const void *k_cache,      /* [num_blocks, block_size, Hk, D] contiguous */
    const void *v_cache,      /* same shape as k_cache */
    const int32_t *block_tables, /* [B, max_blocks] */
    const int32_t *seq_lens,  /* [B] */
    const int32_t *query_start_loc, /* [B + 1] */
    int64_t num_tokens, int num_seqs, int num_q_heads, int num_kv_heads, int head_size,
    int block_size, int max_blocks, int64_t q_stride_t, int64_t out_stride_t,
    float scale, int dtype, int num_threads) {
    if (head_size > 256 || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) return -1;
    const size_t esize = dtype == 1 ? 2 : 4;
    const int64_t total_rows = num_seqs > 0 ? query_start_loc[num_seqs] : 0;
    for (int64_t row = total_rows; row < num_tokens; row++) /* padding rows */
        memset((char *)out + (size_t)row * out_stride_t * esize, 0,
               (size_t)num_q_heads * head_size * esize);
    /* Items: tiles of ROWS rows per sequence; all kv heads per item unless there are too few
     * tiles to keep the threads busy, then one kv head per item. */
    int64_t tiles = 0;
    for (int b = 0; b < num_seqs; b++)
        tiles += (query_start_loc[b + 1] - query_start_loc[b] + ROWS - 1) / ROWS;
    const int split = tiles < 4 * (int64_t)num_threads ? num_kv_heads : 1;
    Item *items = malloc(sizeof(Item) * (size_t)(tiles * split + 1));
    if (!items) return -2;
    int64_t n_items = 0;
    for (int b = 0; b < num_seqs; b++) {
        const int32_t start = query_start_loc[b], end = query_start_loc[b + 1];
        for (int32_t r0 = start; r0 < end; r0 += ROWS)
            for (int sp = 0; sp < split; sp++) {
                Item it = {b, r0, end - r0 < ROWS ? end - r0 : ROWS,
                           sp * num_kv_heads / split, (sp + 1) * num_kv_heads / split};
                items[n_items++] = it;
            }
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        Scratch w;
        const size_t states = (size_t)ROWS * num_q_heads;
        w.q = malloc(sizeof(float) * states * head_size);
        w.acc = malloc(sizeof(float) * states * head_size);
        w.m = malloc(sizeof(float) * states);
        w.l = malloc(sizeof(float) * states);
        w.s = malloc(sizeof(float) * states * CHUNK);
        w.kbuf = malloc(sizeof(float) * CHUNK * head_size);
        if (!w.q || !w.acc || !w.m || !w.l || !w.s || !w.kbuf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; i++) {
            if (failed) continue;
            const Item *it = &items[i];
            const int32_t b = it->seq;
            const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b];
            const int64_t pos0 = seq_lens[b] - q_len + (it->row0 - query_start_loc[b]);
            attend_item(it, &w, out, query, (const char *)k_cache, (const char *)v_cache,
                        block_tables + (int64_t)b * max_blocks, pos0, num_q_heads, num_kv_heads,
                        head_size, block_size, max_blocks, q_stride_t, out_stride_t, scale, dtype);
        }
        free(w.q); free(w.acc); free(w.m); free(w.l); free(w.s); free(w.kbuf);
    }
    free(items);
    return failed ? -2 : 0;
}
