/* Paged attention on AMX tiles: bfloat16 queries and caches on CPUs with AMX-BF16 (Intel
 * Sapphire Rapids and later). The contract is paged_attention_cpu.c's; that file's dispatch
 * hands an item here when attend_amx_supported() says so.
 *
 * A tile is the query vectors of up to 16 / group consecutive rows of one kv head (row r, head
 * h of the group is lane n = r * group + h; at most 16 lanes), or of a decode row for as many kv
 * heads as fit (amx_tile). For each chunk of 16 keys of one
 * cache block it computes the transposed scores S^T = K Q^T on the tiles (keys straight from the
 * cache rows as the A operand, the queries' bfloat16 pairs transposed once per tile as B), so a
 * query vector's 16 scores sit in one lane of 16 vectors: the running max and sum are lane-wise,
 * with no horizontal reductions. The probabilities are transposed back (one 16 x 16 float
 * transpose), rounded to bfloat16 and multiplied by the chunk's values, paired key by key as the
 * AMX B operand wants them (16-bit unpacks: the output columns come out in permuted_d's order and
 * are put back when the tile is written). Scores, softmax state and output accumulate in float32;
 * the softmax max moves only when a score passes it by more than 8, as in the AVX-512 path.
 *
 * Linux lends the tile registers to a process only on request (arch_prctl); without it, or
 * without AMX in the build, attend_amx_supported() says no and the other paths run.
 */
#include "cpu_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define AMX_MAX_D 256

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

typedef struct { /* one tile's buffers, 64-byte aligned */
    uint32_t qt[AMX_MAX_D / 32][16 * 16]; /* per 32 dims: 16 pairs x 16 query vectors */
    float s[16 * 16];                     /* S^T: 16 keys x 16 query vectors */
    uint16_t p[16 * 16];                  /* P: 16 query vectors x 16 keys, bfloat16 */
    uint32_t vb[AMX_MAX_D / 16][8 * 16];  /* per 16 output columns: 8 key pairs x 16 columns */
    float o[16 * AMX_MAX_D];              /* output accumulators, columns permuted */
    float l[16];
    int32_t qpos[16], first[16];
} AmxScratch;

/* Tiles: 0 S^T [16 x 16 f32]; 1 keys [16 x 32 bf16]; 2 Q^T pairs [16 x 16 pairs];
 * 3 P [16 x 16 bf16]; 4 value pairs [8 x 16 pairs]; 5 output [16 x 16 f32]. */
static void amx_configure(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    c.colsb[3] = 32;
    c.rows[4] = 8;
    _tile_loadconfig(&c);
}

int attend_amx_supported(int dtype, int kv_dtype, int head_size, int block_size, int group) {
    if (dtype != 1 || kv_dtype != 1 || head_size % 32 != 0 || head_size > AMX_MAX_D
        || block_size % 16 != 0 || group > 16)
        return 0;
    return amx_permitted();
}

/* The lanes' scores of one chunk (keys key0.., n of them live in the cache) with the scale,
 * soft cap and masks applied (a key a lane must not see: -inf); returns their lane-wise max. */
static __m512 chunk_scores(AmxScratch *w, __m512 sv[16], int64_t key0, int n, float scale,
                           float softcap) {
    const __m512i qpos = _mm512_load_si512(w->qpos), first = _mm512_load_si512(w->first);
    __m512 cmax = _mm512_set1_ps(-INFINITY);
    for (int k = 0; k < 16; k++) {
        __m512 s = _mm512_mul_ps(_mm512_load_ps(w->s + 16 * k), _mm512_set1_ps(scale));
        if (softcap > 0.0f) s = v_softcap(s, softcap);
        const __m512i kpos = _mm512_set1_epi32((int32_t)(key0 + k));
        const __mmask16 live = k < n ? _mm512_cmple_epi32_mask(kpos, qpos)
                                           & _mm512_cmple_epi32_mask(first, kpos) : 0;
        sv[k] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s);
        cmax = _mm512_max_ps(cmax, sv[k]);
    }
    return cmax;
}

/* The online softmax over one chunk's scores: the max moved where needed (accumulators and sums
 * rescaled), then P (bfloat16, query vectors by keys) written to w->p for tile 3. */
static void chunk_softmax(AmxScratch *w, __m512 sv[16], __m512 cmax, __m512 *m, int D) {
    const __mmask16 moved = _mm512_cmp_ps_mask(cmax, _mm512_add_ps(*m, _mm512_set1_ps(8.0f)), _CMP_GT_OQ);
    __m512 l = _mm512_load_ps(w->l);
    if (moved) {
        const __m512 mnew = _mm512_mask_mov_ps(*m, moved, cmax);
        const __m512 corr = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), moved, exp16(_mm512_sub_ps(*m, mnew)));
        l = _mm512_mul_ps(l, corr);
        float c[16];
        _mm512_storeu_ps(c, corr);
        for (int n = 0; n < 16; n++)
            if (moved >> n & 1)
                for (int d = 0; d < D; d += 16) {
                    float *o = w->o + (size_t)n * D + d;
                    _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(o), _mm512_set1_ps(c[n])));
                }
        *m = mnew;
    }
    const __m512 base = _mm512_mask_mov_ps(*m, _mm512_cmp_ps_mask(*m, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                                           _mm512_setzero_ps()); /* lanes that saw no key yet */
    __m512i p[16];
    for (int k = 0; k < 16; k++) {
        const __m512 e = exp16(_mm512_sub_ps(sv[k], base));
        l = _mm512_add_ps(l, e);
        p[k] = _mm512_castps_si512(e);
    }
    _mm512_store_ps(w->l, l);
    transpose16(p);
    for (int n = 0; n < 16; n++)
        _mm256_store_si256((__m256i *)(w->p + 16 * n), (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(p[n])));
}

/* The chunk's values (n rows, row bytes apart; rows past n read as zeros) paired key by key into
 * w->vb: vb[2 g + e] row t2 = unpack{lo,hi}(v[2 t2], v[2 t2 + 1]) over dims 32 g .. 32 g + 31. */
static void pair_values(AmxScratch *w, const char *vb, int n, size_t row, int D) {
    static const char zero_row[2 * AMX_MAX_D] __attribute__((aligned(64)));
    for (int t2 = 0; t2 < 8; t2++) {
        const char *r0 = 2 * t2 < n ? vb + (size_t)(2 * t2) * row : zero_row;
        const char *r1 = 2 * t2 + 1 < n ? vb + (size_t)(2 * t2 + 1) * row : zero_row;
        for (int g = 0; g < D / 32; g++) {
            const __m512i x = _mm512_loadu_si512(r0 + 64 * g), y = _mm512_loadu_si512(r1 + 64 * g);
            _mm512_store_si512(w->vb[2 * g] + 16 * t2, _mm512_unpacklo_epi16(x, y));
            _mm512_store_si512(w->vb[2 * g + 1] + 16 * t2, _mm512_unpackhi_epi16(x, y));
        }
    }
}

/* Bytes from a [T, Hq, D] bfloat16 tensor (row stride `stride` elements) to row t, head h. */
static inline size_t vec_offset(int64_t t, int h, int D, int64_t stride) {
    return ((size_t)t * (size_t)stride + (size_t)h * D) * 2;
}

/* What every tile of a call shares. */
typedef struct {
    void *out;
    const void *query;
    const char *k_cache, *v_cache;
    const int32_t *table;
    int num_q_heads, num_kv_heads, D, block_size, max_blocks, window;
    int64_t q_stride_t, out_stride_t;
    float scale, softcap;
} AmxJob;

/* One tile: rows r0 .. r0 + nr - 1 of the query (positions pos0 ..) and kv heads kvh ..
 * kvh + heads - 1. The heads' keys and values lie side by side in a cache row, so the tile
 * takes them as one head of heads * D dims whose query vectors are zero outside their own
 * head's dims: a lane's scores are its own head's, and of the output's heads * D columns it
 * keeps its head's D. The tile ops are as many as per head, while the vector work on the
 * scores (mask, max, exp, transpose) is done once for all: a decode row of a group of 7 fills
 * 14 lanes with two heads rather than 7 with one. With `fetch` the tile asks for the next block
 * ahead (below): the first tile of the heads in an item; the item's later tiles read the same
 * blocks, from cache, and asking again cost a prompt's attention 7%. What a tile does once (its
 * queries transposed, its output written) is vector work too: done lane by lane in scalar code
 * it was a third of a prompt's attention. */
static void amx_tile(AmxScratch *w, const AmxJob *J, int64_t r0, int nr, int kvh, int heads,
                     int64_t pos0, int fetch) {
    const int group = J->num_q_heads / J->num_kv_heads, per = nr * group, lanes = heads * per;
    const int D = J->D, Dc = heads * D, block_size = J->block_size;
    const size_t row = (size_t)J->num_kv_heads * D * 2, block_bytes = (size_t)block_size * row;
    memset(w->o, 0, sizeof(float) * 16 * (size_t)Dc);
    memset(w->l, 0, sizeof w->l);
    /* The lanes: the heads in turn, each with its rows in turn, each with its group's query
     * heads in turn (counted, not divided: a prompt has many small tiles). */
    const char *qrow[16] = {0};
    int slot[16], qh[16];
    int64_t trow[16];
    for (int n = 0, h = 0; h < heads; h++)
        for (int r = 0; r < nr; r++)
            for (int g = 0; g < group; g++, n++) {
                slot[n] = h;
                trow[n] = r0 + r;
                qh[n] = (kvh + h) * group + g;
                w->qpos[n] = (int32_t)(pos0 + r);
                w->first[n] = (int32_t)window_start(pos0 + r, J->window);
                qrow[n] = (const char *)J->query + vec_offset(trow[n], qh[n], D, J->q_stride_t);
            }
    for (int n = lanes; n < 16; n++) {
        w->qpos[n] = -1;
        w->first[n] = INT32_MAX;
    }
    for (int c = 0; c < Dc / 32; c++) { /* qt[c]: 16 pairs x 16 lanes; zero past `lanes` and
                                          * outside the lane's head */
        const int h = c / (D / 32), cc = c % (D / 32);
        __m512i r[16];
        for (int n = 0; n < 16; n++)
            r[n] = n < lanes && slot[n] == h ? _mm512_loadu_si512(qrow[n] + 64 * cc)
                                             : _mm512_setzero_si512();
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_store_si512(w->qt[c] + 16 * i, r[i]);
    }
    const int64_t last = pos0 + nr - 1, lo = window_start(pos0, J->window);
    __m512 m = _mm512_set1_ps(-INFINITY), sv[16];
    const int32_t *table = J->table;
    for (int64_t j = lo / block_size; j <= last / block_size && j < J->max_blocks; j++) {
        if (table[j] < 0) continue;
        const char *kblock = J->k_cache + (size_t)table[j] * block_bytes + (size_t)kvh * D * 2;
        const char *vblock = J->v_cache + (size_t)table[j] * block_bytes + (size_t)kvh * D * 2;
        /* Each chunk asks for the same rows of the next block (all heads), a share of its key
         * lines before each key tile and of its value lines before each value tile: spread over
         * the chunk's work, not asked all at once when a block starts (which left the asks
         * queued behind one another): 64 decode rows of 340 keys, 24 layers from memory 21.6 ->
         * 17.1 ms, one layer from cache 0.59 -> 0.50. (Two blocks ahead, or to L1: no better.) */
        const int64_t ahead = j + 1;
        const int pf = fetch && ahead <= last / block_size && ahead < J->max_blocks
                       && table[ahead] >= 0;
        const char *knext = pf ? J->k_cache + (size_t)table[ahead] * block_bytes : NULL;
        const char *vnext = pf ? J->v_cache + (size_t)table[ahead] * block_bytes : NULL;
        const int lines = (int)(16 * row / 64);
        for (int c0 = 0; c0 < block_size; c0 += 16) {
            const int64_t key0 = j * block_size + c0;
            if (key0 > last) break;
            if (key0 + 15 < lo) continue;
            const int n = last + 1 - key0 < 16 ? (int)(last + 1 - key0) : 16;
            _tile_zero(0);
            for (int c = 0; c < Dc / 32; c++) {
                if (knext) prefetch_share(knext + (size_t)c0 * row, lines, c, Dc / 32);
                _tile_loadd(1, kblock + (size_t)c0 * row + 64 * c, row);
                _tile_loadd(2, w->qt[c], 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, w->s, 64);
            chunk_softmax(w, sv, chunk_scores(w, sv, key0, n, J->scale, J->softcap), &m, Dc);
            pair_values(w, vblock + (size_t)c0 * row, n, row, Dc);
            _tile_loadd(3, w->p, 32);
            for (int t = 0; t < Dc / 16; t++) {
                if (vnext) prefetch_share(vnext + (size_t)c0 * row, lines, t, Dc / 16);
                _tile_loadd(4, w->vb[t], 64);
                _tile_loadd(5, w->o + 16 * t, Dc * 4);
                _tile_dpbf16ps(5, 3, 4);
                _tile_stored(5, w->o + 16 * t, Dc * 4);
            }
        }
    }
    for (int n = 0; n < lanes; n++)
        store_permuted_bf16((uint16_t *)((char *)J->out
                                         + vec_offset(trow[n], qh[n], D, J->out_stride_t)),
                            w->o + (size_t)n * Dc + (size_t)slot[n] * D,
                            w->l[n] > 0.0f ? 1.0f / w->l[n] : 0.0f, D);
}

/* Rows row0 .. row0 + nrows - 1 (positions pos0 ..) and kv heads kvh0 .. kvh1 - 1 of one
 * sequence, in tiles of 16 / group rows, a kv head at a time; where all the rows fill at most
 * half a tile's lanes (a decode row), kv heads share tiles, as many as fit in the lanes and in
 * AMX_MAX_D dims. 64 decode rows of 340 keys, 14 query and 2 kv heads of 64, 24 layers' caches
 * from memory: 22.5 -> 19.7 ms; one layer's from cache: 0.61 -> 0.49 ms; the same bits. (The
 * one-head tiles keep their own loop: through the sharing one, prompts' attention was 3%
 * slower.) Call only where attend_amx_supported() said yes. */
void attend_amx(void *out, const void *query, const char *k_cache, const char *v_cache,
                const int32_t *table, int64_t row0, int nrows, int kvh0, int kvh1, int64_t pos0,
                int num_q_heads, int num_kv_heads, int head_size, int block_size, int max_blocks,
                int64_t q_stride_t, int64_t out_stride_t, float scale, int window, float softcap) {
    AmxScratch w __attribute__((aligned(64))); /* 34 KB of this thread's stack */
    const AmxJob job = {out, query, k_cache, v_cache, table, num_q_heads, num_kv_heads,
                        head_size, block_size, max_blocks, window, q_stride_t, out_stride_t,
                        scale, softcap};
    const int group = num_q_heads / num_kv_heads, per_tile = 16 / group;
    int fit = nrows * group <= 8 ? 16 / (nrows * group) : 1;
    if (fit > AMX_MAX_D / head_size) fit = AMX_MAX_D / head_size;
    amx_configure();
    if (fit == 1) {
        for (int kvh = kvh0; kvh < kvh1; kvh++)
            for (int r = 0; r < nrows; r += per_tile)
                amx_tile(&w, &job, row0 + r, nrows - r < per_tile ? nrows - r : per_tile, kvh,
                         1, pos0 + r, r == 0);
    } else {
        for (int kvh = kvh0; kvh < kvh1; kvh += fit)
            amx_tile(&w, &job, row0, nrows, kvh, kvh1 - kvh < fit ? kvh1 - kvh : fit, pos0, 1);
    }
    _tile_release();
}
#else
int attend_amx_supported(int dtype, int kv_dtype, int head_size, int block_size, int group) {
    (void)dtype; (void)kv_dtype; (void)head_size; (void)block_size; (void)group;
    return 0;
}
#endif
