/* Helpers shared by the CPU kernels: bfloat16 conversions, row loads/stores, a vector exp. */
#ifndef PAGEDSERVE_CPU_COMMON_H
#define PAGEDSERVE_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline void load_row(float *restrict dst, const void *p, int n, int dtype) {
#ifdef __AVX512F__
    if (dtype == 1 && n % 16 == 0) {
        const uint16_t *s = (const uint16_t *)p;
        for (int d = 0; d < n; d += 16) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(s + d));
            _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
        return;
    }
#endif
    if (dtype == 1) {
        const uint16_t *s = (const uint16_t *)p;
        for (int d = 0; d < n; d++) dst[d] = bf16_to_f32(s[d]);
    } else {
        memcpy(dst, p, (size_t)n * sizeof(float));
    }
}

/* n consecutive tokens' rows (D values each, token_stride_bytes apart) as floats: dst[t * D + d] */
static inline void load_tokens(float *restrict dst, const char *p, int n, size_t token_stride_bytes,
                               int D, int dtype) {
    for (int t = 0; t < n; t++) load_row(dst + (size_t)t * D, p + (size_t)t * token_stride_bytes, D, dtype);
}

static inline void store_row(void *p, const float *restrict src, int n, int dtype) {
    if (dtype == 1) {
        uint16_t *o = (uint16_t *)p;
        for (int d = 0; d < n; d++) o[d] = f32_to_bf16(src[d]);
    } else {
        memcpy(p, src, (size_t)n * sizeof(float));
    }
}

#ifdef __AVX512F__
/* exp(x) for 16 lanes: 2^(x log2 e) = 2^k 2^f with f in [-0.5, 0.5], 2^f by a
 * degree-6 polynomial (relative error about 2e-7), scaled by scalef; -inf lanes give 0. */
static inline __m512 exp16(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, k);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return _mm512_maskz_scalef_ps(finite, p, k);
}

/* 16 floats -> 16 bfloat16 (round to nearest even, NaN kept quiet) stored at p. */
static inline void store16_bf16(void *p, __m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}

/* 16 elements of `dtype` (0 float32, 1 bfloat16) at p as floats. */
static inline __m512 load16(const void *p, int dtype) {
    if (dtype == 1) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)p);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps(p);
}

static inline void store16(void *p, __m512 x, int dtype) {
    if (dtype == 1) store16_bf16(p, x);
    else _mm512_storeu_ps(p, x);
}

/* x rounded to bfloat16 and back (dtype 1), or x (dtype 0). */
static inline __m512 round16(__m512 x, int dtype) {
    if (dtype != 1) return x;
    uint16_t tmp[16];
    store16_bf16(tmp, x);
    return load16(tmp, 1);
}
#endif

/* x rounded to the element type and back. */
static inline float round_to(float x, int dtype) {
    return dtype == 1 ? bf16_to_f32(f32_to_bf16(x)) : x;
}

#endif
