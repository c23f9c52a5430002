/* Int8 linear layers on the CPU: y = x @ (q * scale)^T (+ bias), x in float32 or bfloat16, q an
 * int8 weight [N, K] with one float32 scale per output channel. Each row of x is quantized on
 * the fly to uint8 (scale amax / 127, zero point 128: the contract of kernels/quant_linear.py),
 * the products are summed exactly in int32, and the sums are scaled back:
 *
 *     y[m, n] = (float)(sum_k xq[m, k] q[n, k] - 128 colsum[n]) * xscale[m] * scale[n] (+ bias[n])
 *
 * Integer sums are exact, so every instruction set gives the same bits.
 *
 * Weight layout ("packed", made by quant_linear.pack_int8): output channels in blocks of 16,
 * inputs in groups of 4 (K4 = K rounded up to 4; missing channels and inputs are zero). Block b
 * is 16 * K4 contiguous bytes; in it, group g holds 16 channels x 4 inputs:
 *
 *     packed[b * 16 * K4 + g * 64 + c * 4 + i] = q[16 b + c, 4 g + i]
 *
 * One 64-byte load is one operand of AVX512-VNNI's vpdpbusd (per 32-bit lane, 4 uint8 x 4 int8
 * summed into int32). Without VNNI the weights are widened to int16 and multiplied with
 * vpmaddwd (no saturation, unlike vpmaddubsw with uint8 activations up to 255), AVX-512 or AVX2.
 * A tile is MR rows x NB blocks; tiles are spread over OpenMP threads (torch's pool) with the
 * rows of one column panel kept together, so a panel is read from memory once and then from
 * cache. Decode steps (few rows) read each weight byte once: they run at memory speed.
 */
#include "cpu_common.h"

#define ZP 128
#define NB_MAX 4

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MR 4
#define WIDE_X 0 /* the quantized rows stay uint8 */
static inline __attribute__((always_inline)) void tile(const void *xq, int64_t K4, const int8_t *w,
                                                       int64_t bstride, int mr, int nb,
                                                       int32_t acc[MR][NB_MAX * 16]) {
    __m512i c[MR][NB_MAX];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nb; j++) c[i][j] = _mm512_setzero_si512();
    const uint8_t *x = (const uint8_t *)xq;
    for (int64_t g = 0; g < K4 / 4; g++) {
        __m512i wv[NB_MAX];
        for (int j = 0; j < nb; j++) wv[j] = _mm512_loadu_si512(w + j * bstride + g * 64);
        for (int i = 0; i < mr; i++) {
            int32_t x4;
            memcpy(&x4, x + i * K4 + 4 * g, 4);
            const __m512i xb = _mm512_set1_epi32(x4);
            for (int j = 0; j < nb; j++) c[i][j] = _mm512_dpbusd_epi32(c[i][j], xb, wv[j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nb; j++) _mm512_storeu_si512(acc[i] + 16 * j, c[i][j]);
}
/* The full tile, written out: sixteen named accumulators stay in registers (the array form
 * above made the compiler copy them around every step). */
static inline void tile_full(const void *xq, int64_t K4, const int8_t *w, int64_t bs,
                             int32_t acc[MR][NB_MAX * 16]) {
#define ROW(i) __m512i c##i##0 = _mm512_setzero_si512(), c##i##1 = c##i##0, c##i##2 = c##i##0, \
                       c##i##3 = c##i##0;
    ROW(0) ROW(1) ROW(2) ROW(3)
#undef ROW
    const uint8_t *x = (const uint8_t *)xq;
    for (int64_t g = 0; g < K4 / 4; g++) {
        const __m512i w0 = _mm512_loadu_si512(w + g * 64), w1 = _mm512_loadu_si512(w + bs + g * 64),
                      w2 = _mm512_loadu_si512(w + 2 * bs + g * 64),
                      w3 = _mm512_loadu_si512(w + 3 * bs + g * 64);
        int32_t x4;
#define ROW(i)                                                                                \
    memcpy(&x4, x + i * K4 + 4 * g, 4);                                                       \
    {                                                                                         \
        const __m512i xb = _mm512_set1_epi32(x4);                                             \
        c##i##0 = _mm512_dpbusd_epi32(c##i##0, xb, w0);                                       \
        c##i##1 = _mm512_dpbusd_epi32(c##i##1, xb, w1);                                       \
        c##i##2 = _mm512_dpbusd_epi32(c##i##2, xb, w2);                                       \
        c##i##3 = _mm512_dpbusd_epi32(c##i##3, xb, w3);                                       \
    }
        ROW(0) ROW(1) ROW(2) ROW(3)
#undef ROW
    }
#define ROW(i)                                                                                \
    _mm512_storeu_si512(acc[i], c##i##0);                                                     \
    _mm512_storeu_si512(acc[i] + 16, c##i##1);                                                \
    _mm512_storeu_si512(acc[i] + 32, c##i##2);                                                \
    _mm512_storeu_si512(acc[i] + 48, c##i##3);
    ROW(0) ROW(1) ROW(2) ROW(3)
#undef ROW
}
#define HAS_TILE_FULL 1
#elif defined(__AVX512BW__)
#define MR 2
#define WIDE_X 1 /* rows widened to int16: four inputs are one 64-bit broadcast */
/* vpmaddwd on 8 channels x 4 inputs: lanes 2c, 2c+1 hold channel c's two halves. */
static inline void sum_pairs(int32_t *dst, const int32_t *lanes, int n) {
    for (int c = 0; c < n; c++) dst[c] = lanes[2 * c] + lanes[2 * c + 1];
}
static inline __attribute__((always_inline)) void tile(const void *xq, int64_t K4, const int8_t *w,
                                                       int64_t bstride, int mr, int nb,
                                                       int32_t acc[MR][NB_MAX * 16]) {
    __m512i c[MR][2 * NB_MAX];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 2 * nb; j++) c[i][j] = _mm512_setzero_si512();
    const uint16_t *x = (const uint16_t *)xq;
    for (int64_t g = 0; g < K4 / 4; g++) {
        __m512i wv[2 * NB_MAX];
        for (int j = 0; j < nb; j++) {
            const __m512i raw = _mm512_loadu_si512(w + j * bstride + g * 64);
            wv[2 * j] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(raw));
            wv[2 * j + 1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(raw, 1));
        }
        for (int i = 0; i < mr; i++) {
            int64_t x4;
            memcpy(&x4, x + i * K4 + 4 * g, 8);
            const __m512i xb = _mm512_set1_epi64(x4);
            for (int j = 0; j < 2 * nb; j++)
                c[i][j] = _mm512_add_epi32(c[i][j], _mm512_madd_epi16(wv[j], xb));
        }
    }
    int32_t lanes[16];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 2 * nb; j++) {
            _mm512_storeu_si512(lanes, c[i][j]);
            sum_pairs(acc[i] + 8 * j, lanes, 8);
        }
}
#elif defined(__AVX2__)
#define MR 2
#define WIDE_X 1
static inline __attribute__((always_inline)) void tile(const void *xq, int64_t K4, const int8_t *w,
                                                       int64_t bstride, int mr, int nb,
                                                       int32_t acc[MR][NB_MAX * 16]) {
    for (int j = 0; j < nb; j++) { /* one block (16 channels) at a time: 8 accumulators */
        __m256i c[MR][4];
        for (int i = 0; i < mr; i++)
            for (int q = 0; q < 4; q++) c[i][q] = _mm256_setzero_si256();
        const uint16_t *x = (const uint16_t *)xq;
        const int8_t *wb = w + j * bstride;
        for (int64_t g = 0; g < K4 / 4; g++) {
            __m256i xb[MR];
            for (int i = 0; i < mr; i++) {
                int64_t x4;
                memcpy(&x4, x + i * K4 + 4 * g, 8);
                xb[i] = _mm256_set1_epi64x(x4);
            }
            for (int q = 0; q < 4; q++) {
                const __m256i wv = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(wb + g * 64 + 16 * q)));
                for (int i = 0; i < mr; i++)
                    c[i][q] = _mm256_add_epi32(c[i][q], _mm256_madd_epi16(wv, xb[i]));
            }
        }
        int32_t lanes[8];
        for (int i = 0; i < mr; i++)
            for (int q = 0; q < 4; q++) {
                _mm256_storeu_si256((__m256i *)lanes, c[i][q]);
                for (int cc = 0; cc < 4; cc++)
                    acc[i][16 * j + 4 * q + cc] = lanes[2 * cc] + lanes[2 * cc + 1];
            }
    }
}
#else
#define MR 1
#define WIDE_X 0
static void tile(const void *xq, int64_t K4, const int8_t *w, int64_t bstride, int mr, int nb,
                 int32_t acc[MR][NB_MAX * 16]) {
    const uint8_t *x = (const uint8_t *)xq;
    (void)mr;
    for (int j = 0; j < nb; j++) {
        int32_t s[16] = {0};
        for (int64_t g = 0; g < K4 / 4; g++)
            for (int c = 0; c < 16; c++)
                for (int i = 0; i < 4; i++)
                    s[c] += (int32_t)x[4 * g + i] * (int32_t)w[j * bstride + g * 64 + c * 4 + i];
        memcpy(acc[0] + 16 * j, s, sizeof s);
    }
}
#endif

/* Every (mr, nb) a tile can have, so that each call site's loops have constant bounds. */
static void tile_any(const void *xq, int64_t K4, const int8_t *w, int64_t bstride, int mr,
                     int nb, int32_t acc[MR][NB_MAX * 16]) {
#define TILE_NB(M)                                                                           \
    switch (nb) {                                                                            \
    case 1: tile(xq, K4, w, bstride, M, 1, acc); break;                                      \
    case 2: tile(xq, K4, w, bstride, M, 2, acc); break;                                      \
    case 3: tile(xq, K4, w, bstride, M, 3, acc); break;                                      \
    default: tile(xq, K4, w, bstride, M, 4, acc); break;                                     \
    }
#ifdef HAS_TILE_FULL
    if (mr == MR && nb == NB_MAX) {
        tile_full(xq, K4, w, bstride, acc);
        return;
    }
#endif
    switch (mr) {
    case 1: TILE_NB(1) break;
#if MR >= 2
    case 2: TILE_NB(2) break;
#endif
#if MR >= 4
    case 3: TILE_NB(3) break;
    case 4: TILE_NB(4) break;
#endif
#if MR >= 6
    case 5: TILE_NB(5) break;
    case 6: TILE_NB(6) break;
#endif
    default: break;
    }
#undef TILE_NB
}

/* Row t of x -> uint8 with the zero point (or its int16 widening), K4 wide (padding holds the
 * zero point: it meets zero weights), and the row's scale. */
static void quantize_row(void *dst, float *scale, const void *x, int64_t K, int64_t K4, int dtype) {
    float amax = 0.0f;
    for (int64_t d = 0; d < K; d++) {
        const float v = dtype == 1 ? bf16_to_f32(((const uint16_t *)x)[d]) : ((const float *)x)[d];
        amax = fmaxf(amax, fabsf(v));
    }
    const float s = fmaxf(amax, 1e-10f) / 127.0f;
    *scale = s;
    for (int64_t d = 0; d < K4; d++) {
        int v = ZP;
        if (d < K) {
            const float f = dtype == 1 ? bf16_to_f32(((const uint16_t *)x)[d]) : ((const float *)x)[d];
            v = (int)(rintf(f / s) + 128.0f);
        }
        if (WIDE_X) ((uint16_t *)dst)[d] = (uint16_t)v;
        else ((uint8_t *)dst)[d] = (uint8_t)v;
    }
}

/* No fused multiply-add here (the build allows contraction): the reference rounds the scaled
 * product before it adds the bias, and every class should give its bits. */
__attribute__((optimize("fp-contract=off")))
static void store_tile(void *out, int64_t so, int dtype, int64_t row0, int mr, int64_t col0,
                       int64_t ncols, int32_t acc[MR][NB_MAX * 16], const float *xscale,
                       const float *wscale, const int32_t *colsum, const void *bias) {
    float y[NB_MAX * 16], b[NB_MAX * 16];
    if (bias) load_row(b, (const char *)bias + (size_t)col0 * dt_size(dtype), (int)ncols, dtype);
    for (int i = 0; i < mr; i++) {
        const float xs = xscale[row0 + i];
        for (int64_t c = 0; c < ncols; c++)
            y[c] = (float)(acc[i][c] - ZP * colsum[col0 + c]) * xs * wscale[col0 + c];
        if (bias)
            for (int64_t c = 0; c < ncols; c++) y[c] += b[c];
        char *o = (char *)out + (size_t)((row0 + i) * so + col0) * dt_size(dtype);
#ifdef VF
        if (ncols % VW == 0) {
            for (int64_t c = 0; c < ncols; c += VW) v_store_dt(o + c * dt_size(dtype), v_load(y + c), dtype);
            continue;
        }
#endif
        store_row(o, y, (int)ncols, dtype);
    }
}

/* out [M, N] (rows strided by so) = x [M, K] (rows strided by sx) times the packed weight; see
 * the top of the file. colsum[n] = sum_k q[n, k]. Element types: 0 float32, 1 bfloat16 (x, bias
 * and out alike). Returns -1 when a buffer cannot be allocated. */
int int8_linear_cpu(void *out, const void *x, const int8_t *packed, const float *wscale,
                    const int32_t *colsum, const void *bias, int64_t M, int64_t N, int64_t K,
                    int64_t sx, int64_t so, int dtype, int num_threads) {
    const int64_t K4 = (K + 3) & ~(int64_t)3, blocks = (N + 15) / 16;
    const size_t xes = WIDE_X ? 2 : 1, es = dtype == 1 ? 2 : 4;
    char *xq = malloc((size_t)M * (size_t)K4 * xes);
    float *xscale = malloc(sizeof(float) * (size_t)M);
    if (!xq || !xscale) {
        free(xq);
        free(xscale);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K > 65536)
    for (int64_t t = 0; t < M; t++)
        quantize_row(xq + (size_t)t * K4 * xes, xscale + t, (const char *)x + (size_t)t * sx * es,
                     K, K4, dtype);
    const int64_t panels = (blocks + NB_MAX - 1) / NB_MAX, row_tiles = (M + MR - 1) / MR;
    const int64_t bstride = 16 * K4;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t rt = 0; rt < row_tiles; rt++) {
            const int nb = (int)(blocks - p * NB_MAX < NB_MAX ? blocks - p * NB_MAX : NB_MAX);
            const int mr = (int)(M - rt * MR < MR ? M - rt * MR : MR);
            int32_t acc[MR][NB_MAX * 16];
            tile_any(xq + (size_t)(rt * MR) * K4 * xes, K4, packed + p * NB_MAX * bstride,
                     bstride, mr, nb, acc);
            const int64_t col0 = p * NB_MAX * 16;
            const int64_t ncols = N - col0 < nb * 16 ? N - col0 : nb * 16;
            store_tile(out, so, dtype, rt * MR, mr, col0, ncols, acc, xscale, wscale, colsum,
                       bias);
        }
    }
    free(xq);
    free(xscale);
    return 0;
}
