/* Paged attention on the CPU for a mixed batch of prefill chunks and decode tokens.
 *
 * The same contract as kernels/paged_attention.py: sequence b owns query rows
 * query_start_loc[b] .. query_start_loc[b+1], its last q_len positions of a context of
 * seq_lens[b] tokens whose keys and values (the new ones included) are already in the paged
 * caches [num_blocks, block_size, Hk, D]. Query row i of it sits at position
 * seq_len - q_len + i and attends causally to positions 0..that position; with a sliding
 * window W > 0 only to the positions after position - W (the window's blocks are the only ones
 * read). A soft cap c > 0 maps each scaled score s to c * tanh(s / c) (Gemma 2). GQA: query head
 * h reads kv head h / (Hq / Hk). Rows outside every sequence are written as zeros.
 *
 * A work item is a tile of up to ROWS query rows of one sequence and a range of its kv heads.
 * It walks the sequence's blocks straight from the block table (no gather, no padding to the
 * longest sequence), a chunk of at most CHUNK keys at a time; every key and value row it loads
 * serves all the tile's query heads of that kv head. Decode rows (head size 64 or 128, AVX-512)
 * transpose each chunk of 16 keys once per kv head (one key per lane), so every head of the
 * group gets its 16 scores from D/2 bfloat16 dot products (or D float32 FMAs) with no
 * horizontal sum (attend_row_dc); other tiles run lane-wise across
 * their query vectors (attend_tile_qvec), which needs no horizontal sums; attend_item is the
 * plain-C path for head sizes that are not a multiple of 16 and CPUs without AVX-512. On AMX
 * machines, bfloat16 items over a bfloat16 cache go to attention_amx_cpu.c instead. The next
 * block is prefetched while one is processed. Scores and the running softmax are float32 (online softmax, rescaled once per
 * chunk). Items are spread over OpenMP threads; the library is loaded after torch and uses the
 * libgomp torch has loaded, so both share one thread pool.
 *
 * Element types (cpu_common.h): the query and output share `dtype`, 0 = float32 or 1 = bfloat16;
 * the caches hold `kv_dtype`, that type or 2 = fp8 E4M3 (read as floats; its scales are the
 * caller's: the key scale folded into `scale`, the value scale applied to the output).
 * Built and loaded by kernels/cpu_kernels.py.
 */
#include "cpu_common.h"

/* attention_amx_cpu.c: bfloat16 items on AMX tiles where the CPU and the OS allow them */
int attend_amx_supported(int dtype, int kv_dtype, int head_size, int block_size, int group);
void attend_amx(void *out, const void *query, const char *k_cache, const char *v_cache,
                const int32_t *table, int64_t row0, int nrows, int kvh0, int kvh1, int64_t pos0,
                int num_q_heads, int num_kv_heads, int head_size, int block_size, int max_blocks,
                int64_t q_stride_t, int64_t out_stride_t, float scale, int window, float softcap);

#define ROWS 8    /* query rows per tile (prefill chunks) */
#define CHUNK 32  /* keys per softmax update */
#define PF_BLOCKS 2 /* decode rows keep the blocks up to PF_BLOCKS - 1 ahead prefetched */
#define QVEC_MAX_LANES 1024 /* query vectors of one tile (ROWS x group, padded) in the tile path */

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
    float *q, *acc, *m, *l, *s, *kbuf; /* kbuf: 2 x CHUNK x D, a chunk's keys and values */
} Scratch;

/* n cache rows (row bytes apart) as float32 rows: a float32 cache in place, another type converted
 * into buf (D floats apart); *stride gets the rows' distance in bytes. */
static inline const char *float_rows(float *buf, const char *rows, int n, size_t row, int D,
                                     int kv_dtype, size_t *stride) {
    if (kv_dtype == 0) {
        *stride = row;
        return rows;
    }
    load_tokens(buf, rows, n, row, D, kv_dtype);
    *stride = sizeof(float) * D;
    return (const char *)buf;
}

/* The signature every general attention path shares (attend_item, attend_tile_qvec,
 * attend_row_avx2): one item of the batch, written into out. */
typedef void (*attend_fn)(const Item *it, Scratch *w, void *out, const void *query,
                          const char *k_cache, const char *v_cache, const int32_t *table,
                          int64_t pos0, int num_q_heads, int num_kv_heads, int head_size,
                          int block_size, int max_blocks, int64_t q_stride_t,
                          int64_t out_stride_t, float scale, int window, float softcap,
                          int dtype, int kv_dtype);

/* One kv head's rows of a cache block (`rows` of `bytes`, `stride` apart), keys and values. */
static inline void prefetch_head_rows(const char *k, const char *v, int rows, size_t stride,
                                      size_t bytes) {
    for (int t = 0; t < rows; t++) {
        prefetch_block(k + (size_t)t * stride, bytes);
        prefetch_block(v + (size_t)t * stride, bytes);
    }
}

/* One item: rows row0..row0+nrows-1 (positions pos0.. consecutive) of sequence `seq`, kv heads
 * kvh0..kvh1-1. The general path in plain C, for what the AVX-512 paths below do not take
 * (head sizes not a multiple of 16, CPUs without AVX-512). */
static void attend_item(const Item *it, Scratch *w, void *out, const void *query,
                        const char *k_cache, const char *v_cache, const int32_t *table,
                        int64_t pos0, int num_q_heads, int num_kv_heads, int head_size,
                        int block_size, int max_blocks, int64_t q_stride_t, int64_t out_stride_t,
                        float scale, int window, float softcap, int dtype, int kv_dtype) {
    const int group = num_q_heads / num_kv_heads;
    const size_t esize = dt_size(dtype), kes = dt_size(kv_dtype);
    const int64_t token_stride = (int64_t)num_kv_heads * head_size;
    const int64_t block_stride = (int64_t)block_size * token_stride;
    const int D = head_size, R = it->nrows;
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
    for (int64_t j = window_start(pos0, window) / block_size; j < nblocks && j < max_blocks; j++) {
        const int64_t blk = table[j];
        if (blk < 0) continue; /* an unfilled table entry: nothing cached there */
        if (j + 1 < nblocks && j + 1 < max_blocks && table[j + 1] >= 0) {
            const size_t bytes = (size_t)block_stride * kes;
            prefetch_block(k_cache + (size_t)table[j + 1] * bytes, bytes);
            prefetch_block(v_cache + (size_t)table[j + 1] * bytes, bytes);
        }
        for (int c0 = 0; c0 < block_size; c0 += CHUNK) {
            const int64_t key0 = j * block_size + c0; /* position of the chunk's first key */
            if (key0 >= kv_len) break;
            int n = block_size - c0 < CHUNK ? block_size - c0 : CHUNK;
            if (key0 + n > kv_len) n = (int)(kv_len - key0);
            const char *kb = k_cache + ((size_t)blk * block_stride + (size_t)c0 * token_stride) * kes;
            const char *vb = v_cache + ((size_t)blk * block_stride + (size_t)c0 * token_stride) * kes;
            int nv[ROWS], lo[ROWS]; /* keys lo[r]..nv[r]-1 of this chunk row r sees */
            for (int r = 0; r < R; r++) {
                const int64_t v = pos0 + r + 1 - key0, first = window_start(pos0 + r, window) - key0;
                nv[r] = v <= 0 ? 0 : (v < n ? (int)v : n);
                lo[r] = first <= 0 ? 0 : (first < n ? (int)first : n);
                if (lo[r] >= nv[r]) nv[r] = 0; /* the whole chunk is outside the row's window */
            }
            for (int kvh = it->kvh0; kvh < it->kvh1; kvh++) {
                const int h0 = kvh * group;
                /* the chunk's keys of this kv head as floats: kbuf[t * D + d] */
                load_tokens(w->kbuf, kb + (size_t)kvh * D * kes, n, token_stride * kes, D, kv_dtype);
                /* scores s[(r * Hq + h) * CHUNK + t] */
                for (int r = 0; r < R; r++) {
                    for (int h = h0; h < h0 + group; h++) {
                        const size_t i = (size_t)r * num_q_heads + h;
                        const float *q = w->q + i * D;
                        float *s = w->s + i * CHUNK;
                        for (int t = 0; t < nv[r]; t++) {
                            s[t] = t < lo[r] ? -INFINITY : dot_f32(q, w->kbuf + (size_t)t * D, D);
                            if (softcap > 0.0f && t >= lo[r]) s[t] = softcap * tanhf(s[t] / softcap);
                        }
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
                load_tokens(w->kbuf, vb + (size_t)kvh * D * kes, n, token_stride * kes, D, kv_dtype);
                for (int r = 0; r < R; r++) {
                    for (int h = h0; h < h0 + group; h++) {
                        const size_t i = (size_t)r * num_q_heads + h;
                        const float *p = w->s + i * CHUNK;
                        float *a = w->acc + i * D;
                        for (int t = lo[r]; t < nv[r]; t++)
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

#ifdef __AVX512F__
#ifdef __AVX512BF16__
/* n rows of D fp8 E4M3 values (src_stride bytes apart) as bfloat16, D apart, at dst: exact (its
 * 3 mantissa bits and range fit bfloat16). D % 32 == 0. */
static void fp8_rows_to_bf16(uint16_t *dst, const char *src, int n, size_t src_stride, int D) {
    /* In 16-bit lanes: a normal value's exponent rebiased (7 -> 127) by an integer add, the 7
     * subnormals (m * 2^-9) from a table, NaN kept, the sign moved up. */
    static const uint16_t subnormal[32] = {0, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40,
                                           0x3c60};
    const __m512i table = _mm512_loadu_si512(subnormal);
    for (int t = 0; t < n; t++)
        for (int d = 0; d < D; d += 32) {
            const __m512i x = _mm512_cvtepu8_epi16(
                _mm256_loadu_si256((const __m256i *)(src + (size_t)t * src_stride + d)));
            const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7f));
            __m512i r = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
            r = _mm512_mask_mov_epi16(r, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)),
                                      _mm512_permutexvar_epi16(mag, table));
            r = _mm512_mask_mov_epi16(r, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)),
                                      _mm512_set1_epi16(0x7fc0));
            r = _mm512_or_si512(r, _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8));
            _mm512_storeu_si512(dst + (size_t)t * D + d, r);
        }
}
#endif

/* n <= 16 key rows of `vecs` 64-byte vectors each (row bytes apart), transposed by 32-bit
 * element: kt[16 c + e] lane t = element e of vector c of row t, zero for t >= n. For float32
 * keys an element is k[t][d]; for bfloat16 keys the pair (k[t][2p], k[t][2p + 1]). */
static inline void transpose_keys(__m512i *kt, const char *kb, int n, size_t row, int vecs) {
    for (int c = 0; c < vecs; c++) {
        __m512i r[16];
        for (int t = 0; t < 16; t++)
            r[t] = t < n ? _mm512_loadu_si512(kb + (size_t)t * row + 64 * c) : _mm512_setzero_si512();
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(kt + 16 * c + i, r[i]);
    }
}

/* A qk_heads function for nh heads, 8 at a time (NH a constant in each call). */
#define QK_GROUP(heads_fn, kt, q, stride, s, nh)                                                   \
    for (; nh > 0; nh -= 8, q += 8 * (stride), s += 128) {                                        \
        switch (nh < 8 ? nh : 8) {                                                                \
        case 1: heads_fn(kt, q, stride, s, 1); break;                                             \
        case 2: heads_fn(kt, q, stride, s, 2); break;                                             \
        case 3: heads_fn(kt, q, stride, s, 3); break;                                             \
        case 4: heads_fn(kt, q, stride, s, 4); break;                                             \
        case 5: heads_fn(kt, q, stride, s, 5); break;                                             \
        case 6: heads_fn(kt, q, stride, s, 6); break;                                             \
        case 7: heads_fn(kt, q, stride, s, 7); break;                                             \
        default: heads_fn(kt, q, stride, s, 8); break;                                            \
        }                                                                                         \
    }

/* Scores of NH heads for the 16 keys of kt (float32): s[h * 16 + t] = q_h . k_t, q_h at q + h * D. */
static inline __attribute__((always_inline)) void qk_heads_f32(const __m512i *kt, const float *q,
                                                                int D, float *s, const int NH) {
    __m512 a[8], b[8];
    for (int h = 0; h < NH; h++) a[h] = b[h] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 2) {
        const __m512 k0 = _mm512_castsi512_ps(_mm512_loadu_si512(kt + d));
        const __m512 k1 = _mm512_castsi512_ps(_mm512_loadu_si512(kt + d + 1));
        for (int h = 0; h < NH; h++) {
            a[h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * D + d]), k0, a[h]);
            b[h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * D + d + 1]), k1, b[h]);
        }
    }
    for (int h = 0; h < NH; h++) _mm512_storeu_ps(s + 16 * h, _mm512_add_ps(a[h], b[h]));
}

static void qk_group_f32(const __m512i *kt, const float *q, int D, float *s, int nh) {
    QK_GROUP(qk_heads_f32, kt, q, D, s, nh)
}

#ifdef __AVX512BF16__
/* Raw scores of NH heads for the 16 keys of kt: s[h * 16 + t] = q_h . k_t, q_h the bfloat16 pairs
 * at q + h * P (P = D / 2 pairs). Two chains per head hide the dot products' latency. */
static inline __attribute__((always_inline)) void qk_heads(const __m512i *kt, const uint32_t *q,
                                                            int P, float *s, const int NH) {
    __m512 a[8], b[8];
    for (int h = 0; h < NH; h++) a[h] = b[h] = _mm512_setzero_ps();
    for (int p = 0; p < P; p += 2) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p), k1 = (__m512bh)_mm512_loadu_si512(kt + p + 1);
        for (int h = 0; h < NH; h++) {
            a[h] = _mm512_dpbf16_ps(a[h], (__m512bh)_mm512_set1_epi32((int)q[h * P + p]), k0);
            b[h] = _mm512_dpbf16_ps(b[h], (__m512bh)_mm512_set1_epi32((int)q[h * P + p + 1]), k1);
        }
    }
    for (int h = 0; h < NH; h++) _mm512_storeu_ps(s + 16 * h, _mm512_add_ps(a[h], b[h]));
}

static void qk_group(const __m512i *kt, const uint32_t *q, int P, float *s, int nh) {
    QK_GROUP(qk_heads, kt, q, P, s, nh)
}
#endif

/* The decode path (one query row) for D = 16 * DC: keys in chunks of 16, transposed once per kv
 * head (transpose_keys) so that the group's scores come out one key per lane
 * (qk_group, qk_group_f32), the softmax on that vector, and values accumulated with HG heads'
 * accumulators held in registers. On CPUs with AVX512-BF16, bfloat16 scores and values go through
 * dot-product instructions on the cached rows as they are (an fp8 cache's chunk converted to
 * bfloat16 first, once per kv head); float32 caches are read in place. The next block's lines
 * are asked for a share at each chunk and kv head (prefetch_share): 64 rows of 340 keys, 14
 * query and 2 kv heads of 64, 24 layers from memory, float32 44.6 -> 42.4 ms (skylake-avx512
 * build), bfloat16 32.0 -> 30.0 (cooperlake). */
static inline __attribute__((always_inline)) void attend_row_dc(
    const Item *it, Scratch *w, void *out, const void *query, const char *k_cache,
    const char *v_cache, const int32_t *table, int64_t pos, int num_q_heads, int num_kv_heads,
    int block_size, int max_blocks, int64_t q_stride_t, int64_t out_stride_t, float scale,
    int window, float softcap, int dtype, int kv_dtype, const int DC) {
    const int D = 16 * DC, group = num_q_heads / num_kv_heads;
    const int HG = 16 / DC; /* heads whose accumulators fit in registers at once */
    const size_t es = dt_size(dtype), kes = dt_size(kv_dtype);
    const int64_t token_stride = (int64_t)num_kv_heads * D;
    const int64_t block_stride = (int64_t)block_size * token_stride;
    const int64_t kv_len = pos + 1;
    const int h0 = it->kvh0 * group, h1 = it->kvh1 * group;
    const char *q_row = (const char *)query + (size_t)it->row0 * q_stride_t * es;
    for (int h = h0; h < h1; h++) {
        float *q = w->q + (size_t)h * D;
        load_row(q, q_row + (size_t)h * D * es, D, dtype);
        for (int d = 0; d < D; d++) q[d] *= scale;
        memset(w->acc + (size_t)h * D, 0, sizeof(float) * D);
        w->m[h] = -INFINITY;
        w->l[h] = 0.0f;
    }
    const int64_t nblocks = (kv_len + block_size - 1) / block_size;
    const int64_t first = window_start(pos, window);
    const int64_t jend = nblocks < max_blocks ? nblocks : max_blocks;
    const size_t block_bytes = (size_t)block_stride * kes;
    for (int64_t j = first / block_size; j < jend && j < first / block_size + PF_BLOCKS - 1; j++)
        if (table[j] >= 0) {
            prefetch_block(k_cache + (size_t)table[j] * block_bytes, block_bytes);
            prefetch_block(v_cache + (size_t)table[j] * block_bytes, block_bytes);
        }
    for (int64_t j = first / block_size; j < jend; j++) {
        const int64_t blk = table[j];
        if (blk < 0) continue;
        /* block j + PF_BLOCKS - 1, asked for a share at each chunk and kv head of this one */
        const int pf = j + PF_BLOCKS - 1 < jend && table[j + PF_BLOCKS - 1] >= 0;
        const char *knext = pf ? k_cache + (size_t)table[j + PF_BLOCKS - 1] * block_bytes : NULL;
        const char *vnext = pf ? v_cache + (size_t)table[j + PF_BLOCKS - 1] * block_bytes : NULL;
        const int nk = it->kvh1 - it->kvh0, parts = (block_size + 15) / 16 * nk;
        const int lines = (int)(block_bytes / 64);
        for (int c0 = 0; c0 < block_size; c0 += 16) {
            const int64_t key0 = j * block_size + c0;
            if (key0 >= kv_len) break;
            int n = block_size - c0 < 16 ? block_size - c0 : 16;
            if (key0 + n > kv_len) n = (int)(kv_len - key0);
            if (key0 + n <= first) continue; /* before the window */
            const int skip = first > key0 ? (int)(first - key0) : 0; /* keys before the window */
            const __mmask16 live = (__mmask16)((n == 16 ? 0xffffu : (1u << n) - 1) & ~((1u << skip) - 1));
            for (int kvh = it->kvh0; kvh < it->kvh1; kvh++) {
                if (knext) {
                    prefetch_share(knext, lines, c0 / 16 * nk + kvh - it->kvh0, parts);
                    prefetch_share(vnext, lines, c0 / 16 * nk + kvh - it->kvh0, parts);
                }
                const size_t base = ((size_t)blk * block_stride + (size_t)c0 * token_stride + (size_t)kvh * D) * kes;
                const char *kb = k_cache + base, *vb = v_cache + base;
                size_t kv_row = (size_t)token_stride * kes; /* bytes from one key to the next */
                int direct = 0;
#ifdef __AVX512BF16__
                direct = dtype == 1 && kv_dtype != 0;
                if (direct && kv_dtype == 2) { /* the chunk's fp8 keys and values as bfloat16 */
                    uint16_t *kb16 = (uint16_t *)w->kbuf, *vb16 = kb16 + (size_t)16 * D;
                    fp8_rows_to_bf16(kb16, kb, n, kv_row, D);
                    fp8_rows_to_bf16(vb16, vb, n, kv_row, D);
                    kb = (const char *)kb16;
                    vb = (const char *)vb16;
                    kv_row = (size_t)2 * D;
                }
#endif
                /* the group's raw scores at w->s + h * 16, from the chunk's keys transposed once
                 * (one key per lane: no horizontal sums), at w->kbuf + 16 D past the key rows */
                __m512i *kt = (__m512i *)(w->kbuf + (size_t)16 * D);
#ifdef __AVX512BF16__
                if (direct) {
                    transpose_keys(kt, kb, n, kv_row, D / 32);
                    qk_group(kt, (const uint32_t *)(q_row + (size_t)kvh * group * D * es), D / 2,
                             w->s + (size_t)kvh * group * 16, group);
                }
#endif
                if (!direct) { /* float32 caches are read in place, others as floats */
                    size_t row;
                    const char *rows = float_rows(w->kbuf, kb, n, kv_row, D, kv_dtype, &row);
                    transpose_keys(kt, rows, n, row, D / 16);
                    qk_group_f32(kt, w->q + (size_t)kvh * group * D, D, w->s + (size_t)kvh * group * 16, group);
                }
                for (int h = kvh * group; h < (kvh + 1) * group; h++) {
                    __m512 sv = _mm512_loadu_ps(w->s + (size_t)h * 16);
                    if (direct) sv = _mm512_mul_ps(sv, _mm512_set1_ps(scale));
                    if (softcap > 0.0f) sv = v_softcap(sv, softcap);
                    sv = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, sv);
                    /* The running max moves only when a score passes it by more than 8
                     * (so exp stays below e^8 = 2981 in float32): most groups then need no
                     * exp of the old max and no rescale of the accumulators. */
                    const float mold = w->m[h];
                    const float cmax = _mm512_reduce_max_ps(sv);
                    float bmax = mold, corr = 1.0f;
                    if (mold == -INFINITY) {
                        bmax = cmax;
                        corr = 0.0f;
                    } else if (cmax > mold + 8.0f) {
                        bmax = cmax;
                        corr = expf(mold - bmax);
                    }
                    const __m512 pv = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(bmax))));
                    w->l[h] = w->l[h] * corr + _mm512_reduce_add_ps(pv);
                    w->m[h] = bmax;
                    _mm512_storeu_ps(w->s + (size_t)h * 16, pv);
#ifdef __AVX512BF16__
                    if (direct) /* (p[t], p[t+1]) bfloat16 pairs for the value path, rounded as f32_to_bf16 */
                        _mm256_storeu_si256((__m256i *)(w->s + (size_t)num_q_heads * 16 + (size_t)h * 8),
                                            (__m256i)_mm512_cvtneps_pbh(pv));
#endif
                    if (corr != 1.0f) {
                        float *a = w->acc + (size_t)h * D;
                        for (int c = 0; c < DC; c++)
                            _mm512_storeu_ps(a + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), _mm512_set1_ps(corr)));
                    }
                }
#ifdef __AVX512BF16__
                if (direct) { /* acc += p V with bfloat16 pairs of keys (see permuted_d) */
                    static const char zero_row[512];
                    for (int hb = kvh * group; hb < (kvh + 1) * group; hb += HG) {
                        const int nh = (kvh + 1) * group - hb < HG ? (kvh + 1) * group - hb : HG;
                        __m512 a[16];
                        /* (p[t], p[t+1]) of head hb + hh as one bfloat16 pair: pp[hh * 8 + t / 2] */
                        const uint32_t *pp = (const uint32_t *)(w->s + (size_t)num_q_heads * 16) + (size_t)hb * 8;
                        for (int hh = 0; hh < nh; hh++)
                            for (int c = 0; c < DC; c++) a[hh * DC + c] = _mm512_loadu_ps(w->acc + (size_t)(hb + hh) * D + 16 * c);
                        for (int t = 0; t < n; t += 2) {
                            const char *r0 = vb + (size_t)t * kv_row;
                            const char *r1 = t + 1 < n ? vb + (size_t)(t + 1) * kv_row : zero_row;
                            for (int c2 = 0; c2 < DC / 2; c2++) {
                                const __m512i x = _mm512_loadu_si512(r0 + 64 * c2);
                                const __m512i y = _mm512_loadu_si512(r1 + 64 * c2);
                                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y);
                                const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
                                for (int hh = 0; hh < nh; hh++) {
                                    const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp[hh * 8 + t / 2]);
                                    a[hh * DC + 2 * c2] = _mm512_dpbf16_ps(a[hh * DC + 2 * c2], lo, pb);
                                    a[hh * DC + 2 * c2 + 1] = _mm512_dpbf16_ps(a[hh * DC + 2 * c2 + 1], hi, pb);
                                }
                            }
                        }
                        for (int hh = 0; hh < nh; hh++)
                            for (int c = 0; c < DC; c++) _mm512_storeu_ps(w->acc + (size_t)(hb + hh) * D + 16 * c, a[hh * DC + c]);
                    }
                    continue;
                }
#endif
                size_t vrow;
                const char *vrows = float_rows(w->kbuf, vb, n, kv_row, D, kv_dtype, &vrow);
                for (int hb = kvh * group; hb < (kvh + 1) * group; hb += HG) {
                    const int nh = (kvh + 1) * group - hb < HG ? (kvh + 1) * group - hb : HG;
                    __m512 a[16];
                    for (int hh = 0; hh < nh; hh++)
                        for (int c = 0; c < DC; c++) a[hh * DC + c] = _mm512_loadu_ps(w->acc + (size_t)(hb + hh) * D + 16 * c);
                    for (int t = 0; t < n; t++) {
                        const float *v = (const float *)(vrows + (size_t)t * vrow);
                        for (int c = 0; c < DC; c++) {
                            const __m512 vc = _mm512_loadu_ps(v + 16 * c);
                            for (int hh = 0; hh < nh; hh++)
                                a[hh * DC + c] = _mm512_fmadd_ps(_mm512_set1_ps(w->s[(size_t)(hb + hh) * 16 + t]), vc, a[hh * DC + c]);
                        }
                    }
                    for (int hh = 0; hh < nh; hh++)
                        for (int c = 0; c < DC; c++) _mm512_storeu_ps(w->acc + (size_t)(hb + hh) * D + 16 * c, a[hh * DC + c]);
                }
            }
        }
    }
    char *out_row = (char *)out + (size_t)it->row0 * out_stride_t * es;
    int permuted = 0;
#ifdef __AVX512BF16__
    permuted = dtype == 1 && kv_dtype != 0;
#endif
    for (int h = h0; h < h1; h++) {
        const float inv = w->l[h] > 0.0f ? 1.0f / w->l[h] : 0.0f;
        float *a = w->acc + (size_t)h * D;
        if (permuted) { /* bfloat16 */
            store_permuted_bf16((uint16_t *)(out_row + (size_t)h * D * es), a, inv, D);
            continue;
        }
        float *o = w->kbuf;
        for (int i = 0; i < D; i++) o[i] = a[i] * inv;
        store_row(out_row + (size_t)h * D * es, o, D, dtype);
    }
}

static void attend_row_d64(const Item *it, Scratch *w, void *out, const void *query,
                           const char *k_cache, const char *v_cache, const int32_t *table,
                           int64_t pos, int num_q_heads, int num_kv_heads, int block_size,
                           int max_blocks, int64_t q_stride_t, int64_t out_stride_t, float scale,
                           int window, float softcap, int dtype, int kv_dtype) {
    attend_row_dc(it, w, out, query, k_cache, v_cache, table, pos, num_q_heads, num_kv_heads,
                  block_size, max_blocks, q_stride_t, out_stride_t, scale, window, softcap, dtype,
                  kv_dtype, 4);
}

static void attend_row_d128(const Item *it, Scratch *w, void *out, const void *query,
                            const char *k_cache, const char *v_cache, const int32_t *table,
                            int64_t pos, int num_q_heads, int num_kv_heads, int block_size,
                            int max_blocks, int64_t q_stride_t, int64_t out_stride_t, float scale,
                            int window, float softcap, int dtype, int kv_dtype) {
    attend_row_dc(it, w, out, query, k_cache, v_cache, table, pos, num_q_heads, num_kv_heads,
                  block_size, max_blocks, q_stride_t, out_stride_t, scale, window, softcap, dtype,
                  kv_dtype, 8);
}
#endif

#ifdef VF
/* The tile paths' lanes: lane j (nq of nqp real) is query row j / group, at position pos0 +
 * j / group (padding lanes see no key); pos_lo: its window's first key; no softmax state and
 * zero sums (acc: D rows of nqp) yet. */
static void tile_lanes_init(float *pos, float *pos_lo, float *m, float *l, float *acc, int D,
                            int nq, int nqp, int group, int64_t pos0, int window) {
    memset(acc, 0, sizeof(float) * (size_t)D * nqp);
    for (int j = 0; j < nqp; j++) {
        pos[j] = j < nq ? (float)(pos0 + j / group) : -1.0f;
        pos_lo[j] = window > 0 ? pos[j] - (float)window + 1.0f : -INFINITY;
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
}

/* Block jb + 1's rows of kv head kvh (rows `row` bytes apart), asked for while block jb runs:
 * AVX2 decode rows (14 query and 2 kv heads of 64, 64 rows of 340 keys, 24 layers from memory)
 * float32 63 -> 47 ms, bfloat16 42.7 -> 38.3; prompts' tiles the same. */
static inline void prefetch_next_head_block(const int32_t *table, int64_t jb, int64_t nblocks,
                                            int max_blocks, const char *k_cache,
                                            const char *v_cache, int64_t block_stride, int kvh,
                                            int D, size_t kes, int block_size, size_t row) {
    if (jb + 1 < nblocks && jb + 1 < max_blocks && table[jb + 1] >= 0) {
        const size_t nb = ((size_t)table[jb + 1] * block_stride + (size_t)kvh * D) * kes;
        prefetch_head_rows(k_cache + nb, v_cache + nb, block_size, row, (size_t)D * kes);
    }
}

/* The keys of the chunk at c0 of a block (its first at position key0) that a tile reads: -1
 * past the context (no more chunks), 0 before every lane's window (skip it). */
static inline int chunk_keys(int64_t key0, int c0, int block_size, int64_t kv_len, int64_t first) {
    if (key0 >= kv_len) return -1;
    int n = block_size - c0 < CHUNK ? block_size - c0 : CHUNK;
    if (key0 + n > kv_len) n = (int)(kv_len - key0);
    return key0 + n <= first ? 0 : n;
}

/* The tile path (a tile's R x GROUP query vectors of one kv head): vectorised across the
 * query vectors rather than along D, so no horizontal sums. Scores of VW query vectors (16 with
 * AVX-512, 8 with AVX2) for one key are D FMAs of their transposed rows qt[d][j] with the key's
 * element d broadcast; the softmax runs lane-wise; values accumulate into acc_t[d][j] the same
 * way. Prefill tiles on every vector class, and decode rows where the AVX-512 row path does not
 * apply (AVX2 only, or other head sizes). */
static void attend_tile_qvec(const Item *it, Scratch *w, void *out, const void *query,
                             const char *k_cache, const char *v_cache, const int32_t *table,
                             int64_t pos0, int num_q_heads, int num_kv_heads, int D,
                             int block_size, int max_blocks, int64_t q_stride_t,
                             int64_t out_stride_t, float scale, int window, float softcap,
                             int dtype, int kv_dtype) {
    const int group = num_q_heads / num_kv_heads, R = it->nrows;
    const size_t esize = dt_size(dtype), kes = dt_size(kv_dtype);
    const int64_t token_stride = (int64_t)num_kv_heads * D;
    const int64_t block_stride = (int64_t)block_size * token_stride;
    const int nq = R * group, ngroups = (nq + VW - 1) / VW, nqp = ngroups * VW;
    float *qt = w->q, *acc = w->acc, *S = w->s; /* qt, acc: [D][nqp]; S: [CHUNK][nqp] */
    float *m = w->m, *l = w->l;                 /* [nqp] */
    float pos[QVEC_MAX_LANES];                  /* lane j's query position (as a float) */
    float pos_lo[QVEC_MAX_LANES];               /* lane j's first visible key (window) */
    const int64_t kv_len = pos0 + R, first = window_start(pos0, window);
    for (int kvh = it->kvh0; kvh < it->kvh1; kvh++) {
        memset(qt, 0, sizeof(float) * (size_t)D * nqp);
        for (int j = 0; j < nq; j++) {
            const int r = j / group, h = kvh * group + j % group;
            load_row(w->kbuf, (const char *)query + ((size_t)(it->row0 + r) * q_stride_t + (size_t)h * D) * esize, D, dtype);
            for (int d = 0; d < D; d++) qt[(size_t)d * nqp + j] = w->kbuf[d] * scale;
        }
        tile_lanes_init(pos, pos_lo, m, l, acc, D, nq, nqp, group, pos0, window);
        const int64_t nblocks = (kv_len + block_size - 1) / block_size;
        for (int64_t jb = first / block_size; jb < nblocks && jb < max_blocks; jb++) {
            const int64_t blk = table[jb];
            if (blk < 0) continue;
            prefetch_next_head_block(table, jb, nblocks, max_blocks, k_cache, v_cache, block_stride,
                                     kvh, D, kes, block_size, token_stride * kes);
            for (int c0 = 0; c0 < block_size; c0 += CHUNK) {
                const int64_t key0 = jb * block_size + c0;
                const int n = chunk_keys(key0, c0, block_size, kv_len, first);
                if (n < 0) break;
                if (n == 0) continue; /* before every lane's window */
                const char *kb = k_cache + ((size_t)blk * block_stride + (size_t)c0 * token_stride + (size_t)kvh * D) * kes;
                const char *vb = v_cache + ((size_t)blk * block_stride + (size_t)c0 * token_stride + (size_t)kvh * D) * kes;
                /* the chunk's key and value rows as floats (the same distance apart), converted
                 * once for all the tile's lane groups */
                size_t rb;
                const size_t row = (size_t)token_stride * kes;
                const float *kr = (const float *)float_rows(w->kbuf, kb, n, row, D, kv_dtype, &rb);
                const float *vr = (const float *)float_rows(w->kbuf + (size_t)CHUNK * D, vb, n, row,
                                                            D, kv_dtype, &rb);
                const size_t rs = rb / sizeof(float);
                for (int g = 0; g < ngroups; g++) {
                    const float *qg = qt + VW * g;
                    const vf pg = v_load(pos + VW * g), pg_lo = v_load(pos_lo + VW * g);
                    vf mx = v_load(m + VW * g);
                    int t = 0;
                    for (; t + 8 <= n; t += 8) { /* eight keys: eight independent chains */
                        vf sv[8];
                        for (int i = 0; i < 8; i++) sv[i] = v_zero();
                        const float *k0 = kr + (size_t)t * rs;
                        for (int d = 0; d < D; d++) {
                            const vf q = v_load(qg + (size_t)d * nqp);
                            for (int i = 0; i < 8; i++)
                                sv[i] = v_fmadd(q, v_set1(k0[(size_t)i * rs + d]), sv[i]);
                        }
                        for (int i = 0; i < 8; i++) {
                            const vf key = v_set1((float)(key0 + t + i));
                            if (softcap > 0.0f) sv[i] = v_softcap(sv[i], softcap);
                            sv[i] = v_select(v_le(key, pg), sv[i], v_set1(-INFINITY));
                            sv[i] = v_select(v_le(pg_lo, key), sv[i], v_set1(-INFINITY));
                            mx = v_max(mx, sv[i]);
                            v_store(S + (size_t)(t + i) * nqp + VW * g, sv[i]);
                        }
                    }
                    for (; t < n; t++) {
                        vf s0 = v_zero();
                        for (int d = 0; d < D; d++)
                            s0 = v_fmadd(v_load(qg + (size_t)d * nqp), v_set1(kr[(size_t)t * rs + d]), s0);
                        const vf key = v_set1((float)(key0 + t));
                        if (softcap > 0.0f) s0 = v_softcap(s0, softcap);
                        s0 = v_select(v_le(key, pg), s0, v_set1(-INFINITY));
                        s0 = v_select(v_le(pg_lo, key), s0, v_set1(-INFINITY));
                        mx = v_max(mx, s0);
                        v_store(S + (size_t)t * nqp + VW * g, s0);
                    }
                    /* lanes whose max is still -inf saw no key yet: leave them untouched */
                    const vm seen = v_neq(mx, v_set1(-INFINITY));
                    const vf mold = v_load(m + VW * g);
                    const vf corr = v_select(seen, v_exp(v_sub(mold, mx)), v_set1(1.0f));
                    vf sum = v_zero();
                    for (int t2 = 0; t2 < n; t2++) {
                        float *st = S + (size_t)t2 * nqp + VW * g;
                        const vf p = v_select(seen, v_exp(v_sub(v_load(st), mx)), v_zero());
                        v_store(st, p);
                        sum = v_add(sum, p);
                    }
                    v_store(l + VW * g, v_fmadd(v_load(l + VW * g), corr, sum));
                    v_store(m + VW * g, v_select(seen, mx, mold));
                    /* acc_t[d] = acc_t[d] * corr + sum_t p[t] v[t][d], eight independent
                     * chains (D % 8 == 0) so the FMAs' latency is hidden */
                    for (int d = 0; d < D; d += 8) {
                        float *ad = acc + (size_t)d * nqp + VW * g;
                        vf a[8];
                        for (int i = 0; i < 8; i++) a[i] = v_mul(v_load(ad + (size_t)i * nqp), corr);
                        for (int t2 = 0; t2 < n; t2++) {
                            const vf p = v_load(S + (size_t)t2 * nqp + VW * g);
                            const float *v = vr + (size_t)t2 * rs + d;
                            for (int i = 0; i < 8; i++) a[i] = v_fmadd(p, v_set1(v[i]), a[i]);
                        }
                        for (int i = 0; i < 8; i++) v_store(ad + (size_t)i * nqp, a[i]);
                    }
                }
            }
        }
        for (int j = 0; j < nq; j++) {
            const int r = j / group, h = kvh * group + j % group;
            const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
            for (int d = 0; d < D; d++) w->kbuf[d] = acc[(size_t)d * nqp + j] * inv;
            store_row((char *)out + ((size_t)(it->row0 + r) * out_stride_t + (size_t)h * D) * esize, w->kbuf, D, dtype);
        }
    }
}
#endif

#ifdef __AVX512BF16__
/* attend_tile_qvec for bfloat16 queries over a bfloat16 cache (D a multiple of 32), on bfloat16
 * dot products as the decode rows (attend_row_dc): 16 query vectors' scores for one key are D / 2
 * vdpbf16ps of their transposed (q[2i], q[2i+1]) pairs with the key's pair broadcast, scaled
 * after; the values accumulate from (p[t], p[t+1]) pairs (the probabilities rounded to bfloat16)
 * times (v[t][d], v[t+1][d]) pairs, made once per chunk and kv head with 16-bit unpacks, so the
 * accumulators run in permuted_d's order. Half the float32 path's instructions: 7 prompts of
 * 290 tokens, 14 query and 2 kv heads of 64, 24 layers, 197 -> 132 ms on Zen 4 (the 0.5B
 * model's prompt steps of 2,048 tokens: 217-221 -> 147-148 ms). */
static void attend_tile_bf16(const Item *it, Scratch *w, void *out, const void *query,
                             const char *k_cache, const char *v_cache, const int32_t *table,
                             int64_t pos0, int num_q_heads, int num_kv_heads, int D,
                             int block_size, int max_blocks, int64_t q_stride_t,
                             int64_t out_stride_t, float scale, int window, float softcap,
                             int dtype, int kv_dtype) {
    (void)dtype, (void)kv_dtype; /* both bfloat16 */
    static const char zero_row[512];
    const int group = num_q_heads / num_kv_heads, R = it->nrows, P = D / 2;
    const int64_t token_stride = (int64_t)num_kv_heads * D;
    const int64_t block_stride = (int64_t)block_size * token_stride;
    const size_t row = (size_t)token_stride * 2; /* bytes from one key to the next */
    const int nq = R * group, ngroups = (nq + 15) / 16, nqp = ngroups * 16;
    uint32_t *qt = (uint32_t *)w->q;   /* [P][nqp]: each lane's query pairs, unscaled */
    float *acc = w->acc, *S = w->s;    /* acc: [D][nqp], rows in permuted_d order; S: [CHUNK][nqp] */
    uint32_t *vp = (uint32_t *)w->kbuf; /* [CHUNK / 2][D]: a chunk's value pairs, permuted_d order */
    float *m = w->m, *l = w->l;        /* [nqp] */
    float pos[QVEC_MAX_LANES], pos_lo[QVEC_MAX_LANES];
    int at[256];                       /* at[d]: the accumulator row of dim d */
    for (int i = 0; i < D; i++) at[permuted_d(i)] = i;
    const int64_t kv_len = pos0 + R, first = window_start(pos0, window);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int kvh = it->kvh0; kvh < it->kvh1; kvh++) {
        memset(qt, 0, sizeof(uint32_t) * (size_t)P * nqp);
        for (int j = 0; j < nq; j++) {
            const int r = j / group, h = kvh * group + j % group;
            const uint32_t *qr = (const uint32_t *)((const char *)query + ((size_t)(it->row0 + r) * q_stride_t + (size_t)h * D) * 2);
            for (int p = 0; p < P; p++) qt[(size_t)p * nqp + j] = qr[p];
        }
        tile_lanes_init(pos, pos_lo, m, l, acc, D, nq, nqp, group, pos0, window);
        const int64_t nblocks = (kv_len + block_size - 1) / block_size;
        for (int64_t jb = first / block_size; jb < nblocks && jb < max_blocks; jb++) {
            const int64_t blk = table[jb];
            if (blk < 0) continue;
            prefetch_next_head_block(table, jb, nblocks, max_blocks, k_cache, v_cache, block_stride,
                                     kvh, D, 2, block_size, row);
            for (int c0 = 0; c0 < block_size; c0 += CHUNK) {
                const int64_t key0 = jb * block_size + c0;
                const int n = chunk_keys(key0, c0, block_size, kv_len, first);
                if (n < 0) break;
                if (n == 0) continue; /* before every lane's window */
                const size_t base = ((size_t)blk * block_stride + (size_t)c0 * token_stride + (size_t)kvh * D) * 2;
                const char *kb = k_cache + base, *vb = v_cache + base;
                for (int t = 0; t < n; t += 2) { /* the chunk's value pairs (a missing key: zeros) */
                    const char *r0 = vb + (size_t)t * row, *r1 = t + 1 < n ? r0 + row : zero_row;
                    for (int c2 = 0; c2 < D / 32; c2++) {
                        const __m512i x = _mm512_loadu_si512(r0 + 64 * c2), y = _mm512_loadu_si512(r1 + 64 * c2);
                        _mm512_storeu_si512(vp + (size_t)(t / 2) * D + 32 * c2, _mm512_unpacklo_epi16(x, y));
                        _mm512_storeu_si512(vp + (size_t)(t / 2) * D + 32 * c2 + 16, _mm512_unpackhi_epi16(x, y));
                    }
                }
                for (int g = 0; g < ngroups; g++) {
                    const uint32_t *qg = qt + 16 * g;
                    const __m512 pg = _mm512_loadu_ps(pos + 16 * g), pg_lo = _mm512_loadu_ps(pos_lo + 16 * g);
                    __m512 mx = _mm512_loadu_ps(m + 16 * g);
                    for (int t = 0; t < n; t += 8) { /* eight keys: eight independent chains */
                        const int nk = n - t < 8 ? n - t : 8;
                        __m512 sv[8];
                        for (int i = 0; i < 8; i++) sv[i] = _mm512_setzero_ps();
                        const uint32_t *k0 = (const uint32_t *)(kb + (size_t)t * row);
                        const size_t rs = row / 4;
                        if (nk == 8) {
                            for (int p = 0; p < P; p++) {
                                const __m512bh q = (__m512bh)_mm512_loadu_si512(qg + (size_t)p * nqp);
                                for (int i = 0; i < 8; i++)
                                    sv[i] = _mm512_dpbf16_ps(sv[i], q, (__m512bh)_mm512_set1_epi32((int)k0[i * rs + p]));
                            }
                        } else {
                            for (int p = 0; p < P; p++) {
                                const __m512bh q = (__m512bh)_mm512_loadu_si512(qg + (size_t)p * nqp);
                                for (int i = 0; i < nk; i++)
                                    sv[i] = _mm512_dpbf16_ps(sv[i], q, (__m512bh)_mm512_set1_epi32((int)k0[i * rs + p]));
                            }
                        }
                        for (int i = 0; i < nk; i++) {
                            const __m512 key = _mm512_set1_ps((float)(key0 + t + i));
                            __m512 si = _mm512_mul_ps(sv[i], vscale);
                            if (softcap > 0.0f) si = v_softcap(si, softcap);
                            si = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm512_cmp_ps_mask(key, pg, _CMP_LE_OQ), si);
                            si = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm512_cmp_ps_mask(pg_lo, key, _CMP_LE_OQ), si);
                            mx = _mm512_max_ps(mx, si);
                            _mm512_storeu_ps(S + (size_t)(t + i) * nqp + 16 * g, si);
                        }
                    }
                    /* lanes whose max is still -inf saw no key yet: leave them untouched */
                    const __mmask16 seen = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                    const __m512 mold = _mm512_loadu_ps(m + 16 * g);
                    const __m512 corr = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), seen, exp16(_mm512_sub_ps(mold, mx)));
                    __m512 sum = _mm512_setzero_ps();
                    /* p of keys t, t + 1 as one bfloat16 pair per lane, over S's row t */
                    for (int t2 = 0; t2 < n; t2 += 2) {
                        float *s0 = S + (size_t)t2 * nqp + 16 * g;
                        const __m512 p0 = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(_mm512_loadu_ps(s0), mx)));
                        __m512 p1 = _mm512_setzero_ps();
                        if (t2 + 1 < n)
                            p1 = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(_mm512_loadu_ps(s0 + nqp), mx)));
                        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
                        const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p0));
                        const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p1)), 16);
                        _mm512_storeu_si512(s0, _mm512_or_si512(lo, hi));
                    }
                    _mm512_storeu_ps(l + 16 * g, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * g), corr, sum));
                    _mm512_storeu_ps(m + 16 * g, _mm512_mask_mov_ps(mold, seen, mx));
                    for (int d = 0; d < D; d += 8) { /* eight accumulator rows: eight chains */
                        float *ad = acc + (size_t)d * nqp + 16 * g;
                        __m512 a[8];
                        for (int i = 0; i < 8; i++) a[i] = _mm512_mul_ps(_mm512_loadu_ps(ad + (size_t)i * nqp), corr);
                        for (int t2 = 0; t2 < n; t2 += 2) {
                            const __m512bh pp = (__m512bh)_mm512_loadu_si512(S + (size_t)t2 * nqp + 16 * g);
                            const uint32_t *v = vp + (size_t)(t2 / 2) * D + d;
                            for (int i = 0; i < 8; i++)
                                a[i] = _mm512_dpbf16_ps(a[i], pp, (__m512bh)_mm512_set1_epi32((int)v[i]));
                        }
                        for (int i = 0; i < 8; i++) _mm512_storeu_ps(ad + (size_t)i * nqp, a[i]);
                    }
                }
            }
        }
        float *o = (float *)w->kbuf;
        for (int j = 0; j < nq; j++) {
            const int r = j / group, h = kvh * group + j % group;
            const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
            for (int d = 0; d < D; d++) o[d] = acc[(size_t)at[d] * nqp + j] * inv;
            store_row((char *)out + ((size_t)(it->row0 + r) * out_stride_t + (size_t)h * D) * 2, o, D, 1);
        }
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define ROW_MAX_GROUP 4 /* decode rows of GQA groups up to this size take attend_row_avx2 */

/* Lane i: the sum of a[i]'s lanes. */
static inline __m256 hsum8(const __m256 a[8]) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                         _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

static inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* The AVX2 decode path (one query row), vectorised along D: for each kv head, keys in groups of
 * 8 consecutive positions (never across a block: blocks hold a multiple of 8); each head of the
 * GQA group gets the 8 keys' scores from D/8 FMAs per key and one transposing horizontal sum
 * (hsum8), a softmax step over that vector, and the 8 value rows accumulated into its D floats.
 * Where a decode row has few query heads per kv head, the lane-wise tile path would leave most
 * of its lanes idle. float32 caches are read in place, others converted per group of keys. */
static void attend_row_avx2(const Item *it, Scratch *w, void *out, const void *query,
                            const char *k_cache, const char *v_cache, const int32_t *table,
                            int64_t pos, int num_q_heads, int num_kv_heads, int D,
                            int block_size, int max_blocks, int64_t q_stride_t,
                            int64_t out_stride_t, float scale, int window, float softcap,
                            int dtype, int kv_dtype) {
    const int group = num_q_heads / num_kv_heads;
    const size_t es = dt_size(dtype), kes = dt_size(kv_dtype);
    const int64_t token_stride = (int64_t)num_kv_heads * D;
    const int64_t block_stride = (int64_t)block_size * token_stride;
    const int64_t kv_len = pos + 1, first = window_start(pos, window);
    const char *q_row = (const char *)query + (size_t)it->row0 * q_stride_t * es;
    float *q = w->q, *acc = w->acc, *m = w->m, *l = w->l; /* q, acc: [group][D] */
    float *kf = w->kbuf, *vf_ = w->kbuf + 8 * (size_t)D;  /* converted rows (not float32) */
    const float lane_pos[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int kvh = it->kvh0; kvh < it->kvh1; kvh++) {
        for (int g = 0; g < group; g++) {
            load_row(q + (size_t)g * D, q_row + (size_t)(kvh * group + g) * D * es, D, dtype);
            for (int d = 0; d < D; d++) q[(size_t)g * D + d] *= scale;
            memset(acc + (size_t)g * D, 0, sizeof(float) * (size_t)D);
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
        for (int64_t p0 = first - first % 8; p0 < kv_len; p0 += 8) {
            const int64_t jb = p0 / block_size;
            if (jb >= max_blocks) break;
            const int64_t blk = table[jb];
            if (blk < 0) continue;
            const int n = kv_len - p0 < 8 ? (int)(kv_len - p0) : 8;
            if (p0 % block_size == 0 && jb + 1 < max_blocks && table[jb + 1] >= 0 &&
                (jb + 1) * block_size < kv_len) { /* the next block's rows of this kv head */
                const size_t nb = ((size_t)table[jb + 1] * block_stride + (size_t)kvh * D) * kes;
                prefetch_head_rows(k_cache + nb, v_cache + nb, block_size, token_stride * kes,
                                   (size_t)D * kes);
            }
            const size_t off = ((size_t)blk * block_stride + (size_t)(p0 % block_size) * token_stride
                                + (size_t)kvh * D) * kes;
            size_t ks, vs;
            const char *kr = float_rows(kf, k_cache + off, n, token_stride * kes, D, kv_dtype, &ks);
            const char *vr = float_rows(vf_, v_cache + off, n, token_stride * kes, D, kv_dtype, &vs);
            const float *krow[8], *vrow[8];
            for (int i = 0; i < n; i++)
                krow[i] = (const float *)(kr + i * ks), vrow[i] = (const float *)(vr + i * vs);
            /* lanes of keys past the row, or before its window, score -inf */
            const __m256 kpos = _mm256_add_ps(_mm256_loadu_ps(lane_pos), _mm256_set1_ps((float)p0));
            const __m256 live = _mm256_and_ps(
                _mm256_cmp_ps(kpos, _mm256_set1_ps((float)(kv_len - 1)), _CMP_LE_OQ),
                _mm256_cmp_ps(kpos, _mm256_set1_ps((float)first), _CMP_GE_OQ));
            for (int g = 0; g < group; g++) {
                const float *qg = q + (size_t)g * D;
                __m256 a[8];
                for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
                for (int d = 0; d < D; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qg + d);
                    for (int i = 0; i < n; i++) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(krow[i] + d), a[i]);
                }
                __m256 sc = hsum8(a);
                if (softcap > 0.0f) sc = v_softcap(sc, softcap);
                sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc, live);
                const float mx = hmax8(sc);
                if (mx == -INFINITY) continue; /* no live key here for this row */
                float *ag = acc + (size_t)g * D;
                if (mx > m[g]) {
                    const float corr = expf(m[g] - mx); /* 0 while m is -inf */
                    l[g] *= corr;
                    for (int d = 0; d < D; d += 8)
                        _mm256_storeu_ps(ag + d, _mm256_mul_ps(_mm256_loadu_ps(ag + d), _mm256_set1_ps(corr)));
                    m[g] = mx;
                }
                const __m256 pv = v_exp(_mm256_sub_ps(sc, _mm256_set1_ps(m[g])));
                l[g] += v_sum(pv);
                float p[8];
                _mm256_storeu_ps(p, pv);
                for (int d = 0; d < D; d += 8) {
                    __m256 av = _mm256_loadu_ps(ag + d);
                    for (int i = 0; i < n; i++)
                        av = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), _mm256_loadu_ps(vrow[i] + d), av);
                    _mm256_storeu_ps(ag + d, av);
                }
            }
        }
        char *out_row = (char *)out + (size_t)it->row0 * out_stride_t * es;
        for (int g = 0; g < group; g++) {
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
            float *ag = acc + (size_t)g * D;
            for (int d = 0; d < D; d++) ag[d] *= inv;
            store_row(out_row + (size_t)(kvh * group + g) * D * es, ag, D, dtype);
        }
    }
}
#endif

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
    float scale, int window, float softcap, /* window 0 and softcap 0: off */
    int dtype, int kv_dtype, int num_threads) {
    if (head_size > 256 || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) return -1;
    if (window < 0 || softcap < 0.0f) return -1;
    const size_t esize = dt_size(dtype);
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
    const int amx = attend_amx_supported(dtype, kv_dtype, head_size, block_size,
                                         num_q_heads / num_kv_heads);
#pragma omp parallel num_threads(num_threads)
    {
        Scratch w;
        const size_t states = (size_t)ROWS * num_q_heads + 16; /* + lane padding (qvec path) */
        w.q = malloc(sizeof(float) * states * head_size);
        w.acc = malloc(sizeof(float) * states * head_size);
        w.m = malloc(sizeof(float) * states);
        w.l = malloc(sizeof(float) * states);
        w.s = malloc(sizeof(float) * states * CHUNK);
        w.kbuf = malloc(sizeof(float) * 2 * CHUNK * head_size);
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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
            if (amx) {
                attend_amx(out, query, (const char *)k_cache, (const char *)v_cache,
                           block_tables + (int64_t)b * max_blocks, it->row0, it->nrows, it->kvh0,
                           it->kvh1, pos0, num_q_heads, num_kv_heads, head_size, block_size,
                           max_blocks, q_stride_t, out_stride_t, scale, window, softcap);
                continue;
            }
#endif
#ifdef __AVX512F__
            if (it->nrows == 1 && (head_size == 64 || head_size == 128)) {
                (head_size == 64 ? attend_row_d64 : attend_row_d128)(
                    it, &w, out, query, (const char *)k_cache, (const char *)v_cache,
                    block_tables + (int64_t)b * max_blocks, pos0, num_q_heads, num_kv_heads,
                    block_size, max_blocks, q_stride_t, out_stride_t, scale, window, softcap,
                    dtype, kv_dtype);
                continue;
            }
#endif
            attend_fn path = attend_item; /* the plain-C path takes every item */
#ifdef VF
            if (head_size % 8 == 0 && (int64_t)ROWS * (num_q_heads / num_kv_heads) + VW <= QVEC_MAX_LANES)
                path = attend_tile_qvec;
#endif
#ifdef __AVX512BF16__
            if (dtype == 1 && kv_dtype == 1 && head_size % 32 == 0 && head_size <= 256 &&
                (int64_t)ROWS * (num_q_heads / num_kv_heads) + 16 <= QVEC_MAX_LANES)
                path = attend_tile_bf16;
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
            if (it->nrows == 1 && head_size % 8 == 0 && num_q_heads / num_kv_heads <= ROW_MAX_GROUP)
                path = attend_row_avx2;
#endif
            path(it, &w, out, query, (const char *)k_cache, (const char *)v_cache,
                 block_tables + (int64_t)b * max_blocks, pos0, num_q_heads, num_kv_heads,
                 head_size, block_size, max_blocks, q_stride_t, out_stride_t, scale, window,
                 softcap, dtype, kv_dtype);
        }
        free(w.q); free(w.acc); free(w.m); free(w.l); free(w.s); free(w.kbuf);
    }
    free(items);
    return failed ? -2 : 0;
}
