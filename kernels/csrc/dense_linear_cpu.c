/* Dense linear layers on the CPU: out = x @ w^T (+ bias), bfloat16 x, w, bias and out, float32
 * sums, on CPUs with AVX512-BF16 (vdpbf16ps: per 32-bit lane, a pair of bfloat16 products
 * added to a float32 sum).
 *
 * Weight layout ("packed", made once by dense_pack_cpu): output channels in panels of PW = 64,
 * inputs in pairs (K2 = K rounded up to 2, halved; missing channels and inputs are zero). Panel p
 * is K2 * 64 pairs, contiguous; in it, pair k2 holds the 64 channels' inputs 2 k2 and 2 k2 + 1:
 *
 *     packed[((p * K2 + k2) * 64 + c) * 2 + i] = w[64 p + c, 2 k2 + i]
 *
 * so one pair step of a panel is four 64-byte loads, each one operand of vdpbf16ps for 16
 * channels. A register tile is MR rows x the panel's 64 channels (24 float32 accumulators); a
 * panel's rows run tile after tile, so the panel is read from memory once and then from the
 * core's cache. Panels are split over the threads in contiguous ranges.
 *
 * Why not oneDNN (what torch's prepacked linear calls): its products stall on memory. A decode
 * step's weights come from DRAM, and a product that reads a panel from memory for its first
 * tile and computes the other tiles from cache leaves the memory idle while it computes: at 29
 * rows the 0.5B model's linears took 36-42 ms a step against the 24 ms their multiply-adds need
 * at this core's peak. Here, while a panel's tiles run, each tile prefetches its share of the
 * next panel (spread over its pair steps), so the next panel's memory traffic overlaps this
 * panel's arithmetic: 31 ms at 29 rows, 1.05-1.4x oneDNN from 1 to 64 rows, and even with it
 * on prompt-sized products (2048 rows, compute bound), load_tests/gemm_bench.py on two Zen 5
 * cores. One-tile products (up to MR rows) are memory bound and stream the weights without
 * software prefetch.
 */
#include "cpu_common.h"

#include <omp.h>

#define PW 64 /* output channels per panel */
#define MR 6  /* rows per register tile */

/* 1 when this build has the kernel for `dtype` (1 = bfloat16). */
int dense_supported_cpu(int dtype) {
#ifdef __AVX512BF16__
    return dtype == 1;
#else
    (void)dtype;
    return 0;
#endif
}

/* w [N, K] bfloat16, rows contiguous -> dst in the layout above: ceil(N / 64) * 64 *
 * (K rounded up to 2) elements. */
int dense_pack_cpu(uint16_t *dst, const uint16_t *w, int64_t N, int64_t K, int num_threads) {
    const int64_t K2 = (K + 1) / 2, P = (N + PW - 1) / PW;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < P; p++)
        for (int64_t k2 = 0; k2 < K2; k2++)
            for (int c = 0; c < PW; c++)
                for (int i = 0; i < 2; i++) {
                    const int64_t n = p * PW + c, k = 2 * k2 + i;
                    dst[((p * K2 + k2) * PW + c) * 2 + i] = n < N && k < K ? w[n * K + k] : 0;
                }
    return 0;
}

#ifdef __AVX512BF16__
/* Prefetch lines [0, n) of `pf` at `rate` lines per pair step: step k2 takes its share. */
static inline __attribute__((always_inline)) void prefetch_share(const char *pf, int64_t k2, int rate,
                                                                  int64_t n) {
    for (int q = 0; q < rate; q++)
        if (k2 * rate + q < n) _mm_prefetch(pf + (k2 * rate + q) * 64, _MM_HINT_T0);
}

/* One tile: rows x[0..MRC) (row stride sx) times panel wp, written to out (row stride so) for
 * the panel's first `ncols` channels, bias (the panel's part, or NULL) added before rounding. */
static inline __attribute__((always_inline)) void tile(
    const uint16_t *x, int64_t sx, int64_t K, const uint16_t *wp, uint16_t *out, int64_t so,
    int ncols, const uint16_t *bias, const char *pf, int64_t pfn, int rate, const int MRC) {
    __m512 c[MR][4];
    for (int i = 0; i < MRC; i++)
        for (int j = 0; j < 4; j++) c[i][j] = _mm512_setzero_ps();
    const int64_t full = K / 2;
    for (int64_t k2 = 0; k2 < full; k2++) {
        const __m512i *wv = (const __m512i *)(wp + k2 * 2 * PW);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wv), w1 = (__m512bh)_mm512_loadu_si512(wv + 1),
                       w2 = (__m512bh)_mm512_loadu_si512(wv + 2), w3 = (__m512bh)_mm512_loadu_si512(wv + 3);
        if (pf) prefetch_share(pf, k2, rate, pfn);
        for (int i = 0; i < MRC; i++) {
            int32_t xx;
            memcpy(&xx, x + i * sx + 2 * k2, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(xx);
            c[i][0] = _mm512_dpbf16_ps(c[i][0], xb, w0);
            c[i][1] = _mm512_dpbf16_ps(c[i][1], xb, w1);
            c[i][2] = _mm512_dpbf16_ps(c[i][2], xb, w2);
            c[i][3] = _mm512_dpbf16_ps(c[i][3], xb, w3);
        }
    }
    if (K & 1) { /* the last input alone: its pair's second half is zero in x and in w */
        const __m512i *wv = (const __m512i *)(wp + full * 2 * PW);
        for (int i = 0; i < MRC; i++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int32_t)x[i * sx + K - 1]);
            for (int j = 0; j < 4; j++)
                c[i][j] = _mm512_dpbf16_ps(c[i][j], xb, (__m512bh)_mm512_loadu_si512(wv + j));
        }
    }
    __m512 b[4];
    for (int j = 0; j < 4; j++) {
        const int live = ncols - 16 * j < 0 ? 0 : (ncols - 16 * j > 16 ? 16 : ncols - 16 * j);
        const __mmask16 m = (__mmask16)((1u << live) - 1);
        b[j] = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                          _mm256_maskz_loadu_epi16(m, bias + 16 * j)), 16))
                    : _mm512_setzero_ps();
    }
    for (int i = 0; i < MRC; i++)
        for (int j = 0; j < 4; j++) {
            const int live = ncols - 16 * j < 0 ? 0 : (ncols - 16 * j > 16 ? 16 : ncols - 16 * j);
            const __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c[i][j], b[j]));
            if (live == 16) _mm256_storeu_si256((__m256i *)(out + i * so + 16 * j), y);
            else if (live > 0) _mm256_mask_storeu_epi16(out + i * so + 16 * j, (__mmask16)((1u << live) - 1), y);
        }
}

static void tile_rows(const uint16_t *x, int64_t sx, int64_t K, const uint16_t *wp, uint16_t *out,
                      int64_t so, int ncols, const uint16_t *bias, const char *pf, int64_t pfn,
                      int rate, int mr) {
#define TILE(R) tile(x, sx, K, wp, out, so, ncols, bias, pf, pfn, rate, R)
    switch (mr) {
    case 1: TILE(1); break;
    case 2: TILE(2); break;
    case 3: TILE(3); break;
    case 4: TILE(4); break;
    case 5: TILE(5); break;
    default: TILE(6); break;
    }
#undef TILE
}
#endif

/* out [M, N] (row stride so) = x [M, K] (row stride sx) @ w^T (+ bias [N]), w packed as above.
 * Returns 0, or -1 when this build has no kernel for `dtype` (1 = bfloat16). */
int dense_linear_cpu(void *out, const void *x, const void *packed, const void *bias, int64_t M,
                     int64_t N, int64_t K, int64_t sx, int64_t so, int dtype, int num_threads) {
    if (!dense_supported_cpu(dtype)) return -1;
#ifdef __AVX512BF16__
    const int64_t K2 = (K + 1) / 2, P = (N + PW - 1) / PW, T = (M + MR - 1) / MR;
    const int64_t panel = K2 * 2 * PW, lines = panel * 2 / 64; /* a panel's elements, its lines */
    const int nt = (int)(P < num_threads ? P : num_threads);
#pragma omp parallel num_threads(nt)
    {
        const int64_t id = omp_get_thread_num(), p0 = P * id / nt, p1 = P * (id + 1) / nt;
        for (int64_t p = p0; p < p1; p++) {
            const uint16_t *wp = (const uint16_t *)packed + p * panel;
            const int ncols = (int)(N - p * PW < PW ? N - p * PW : PW);
            const uint16_t *pb = bias ? (const uint16_t *)bias + p * PW : NULL;
            for (int64_t t = 0; t < T; t++) {
                const char *pf = NULL;
                int64_t pfn = 0;
                int rate = 0;
                if (T > 1 && p + 1 < p1) { /* tile t prefetches its share of the next panel */
                    const int64_t a = t * lines / T, b = (t + 1) * lines / T;
                    pf = (const char *)(wp + panel) + a * 64;
                    pfn = b - a;
                    rate = (int)((pfn + K2 - 1) / K2);
                }
                const int mr = (int)(M - t * MR < MR ? M - t * MR : MR);
                tile_rows((const uint16_t *)x + t * MR * sx, sx, K, wp,
                          (uint16_t *)out + t * MR * so + p * PW, so, ncols, pb, pf, pfn, rate, mr);
            }
        }
    }
    return 0;
#else
    (void)out; (void)x; (void)packed; (void)bias; (void)M; (void)N; (void)K; (void)sx; (void)so;
    (void)num_threads;
    return -1;
#endif
}
