/* Helpers shared by the CPU kernels: bfloat16 and fp8 conversions, row loads/stores, a vector
 * exp. Element types: 0 = float32, 1 = bfloat16, 2 = fp8 E4M3 (the "fn" variant: no
 * infinities, 0x7f/0xff NaN, largest finite 448; loads only, for the KV cache). */
#ifndef PAGEDSERVE_CPU_COMMON_H
#define PAGEDSERVE_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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

static inline size_t dt_size(int dtype) { return dtype == 0 ? 4 : dtype == 1 ? 2 : 1; }

/* fp8 E4M3 -> float: normal numbers rebias the exponent (7 -> 127) in the integer bits,
 * subnormals (exponent field 0) are m * 2^-9; no float subnormal is formed, so the result does
 * not depend on denormals-are-zero. */
static inline float fp8_to_f32(uint8_t x) {
    const uint32_t mag = x & 0x7fu;
    float f;
    if (mag == 0x7fu) {
        f = NAN;
    } else if (mag >= 8u) {
        const uint32_t u = (mag << 20) + (120u << 23);
        memcpy(&f, &u, sizeof f);
    } else {
        f = (float)mag * 0x1p-9f;
    }
    return (x & 0x80u) ? -f : f;
}

/* float -> fp8 E4M3, rounding to nearest even and saturating at +-448 (as torch's conversion
 * does: infinities too); NaN stays NaN. */
static inline uint8_t f32_to_fp8(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7fu;
    if (u >= 0x43e00000u) return sign | 0x7eu; /* >= 448 */
    if (u < 0x3c800000u) { /* below 2^-6: subnormal steps of 2^-9 (8 steps round up to 2^-6) */
        float a;
        memcpy(&a, &u, sizeof a);
        return sign | (uint8_t)lrintf(a * 512.0f);
    }
    u += 0x7ffffu + ((u >> 20) & 1u); /* round the mantissa to 3 bits, ties to even */
    return sign | (uint8_t)(((u >> 20) - (120u << 3)) & 0x7fu);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

/* Whether this process may use the AMX tile registers: Linux lends them only on request
 * (arch_prctl), asked once per file that uses them, before any of its threads does. */
static inline int amx_permitted(void) {
    static int permitted = 0; /* 0: not asked yet, 1: granted, -1: refused */
    if (permitted == 0)
        permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                            18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return permitted == 1;
}
#endif

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

/* 16 floats -> 16 bfloat16 (round to nearest even, NaN kept quiet), and stored at p. */
static inline __m256i pack16_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

static inline void store16_bf16(void *p, __m512 x) { _mm256_storeu_si256((__m256i *)p, pack16_bf16(x)); }

/* 16 fp8 E4M3 values at p as floats (fp8_to_f32 lane-wise). */
static inline __m512 load16_fp8(const void *p) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
    const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
    __m512 f = _mm512_mask_mov_ps(sub, _mm512_cmpge_epi32_mask(mag, _mm512_set1_epi32(8)),
                                  _mm512_castsi512_ps(normal));
    f = _mm512_mask_mov_ps(f, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), _mm512_set1_ps(NAN));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}

/* 16 elements of `dtype` at p as floats. */
static inline __m512 load16(const void *p, int dtype) {
    if (dtype == 1) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)p);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dtype == 2) return load16_fp8(p);
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

/* One float vector of VW lanes, VF defined where there is one: AVX-512 (16 lanes) or AVX2 with
 * FMA (8). Loops written in these terms serve both classes; vm is a lane mask. */
#if defined(__AVX512F__)
#define VF 1
#define VW 16
typedef __m512 vf;
typedef __mmask16 vm;
static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf v_set1(float x) { return _mm512_set1_ps(x); }
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf v_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vm v_le(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
static inline vm v_neq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ); }
static inline vm v_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
static inline vm v_unord(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); } /* a or b NaN */
static inline vm v_mor(vm a, vm b) { return a | b; }
static inline int v_many(vm m) { return m != 0; }
static inline vf v_select(vm m, vf a, vf b) { return _mm512_mask_mov_ps(b, m, a); } /* m ? a : b */
static inline float v_sum(vf x) { return _mm512_reduce_add_ps(x); }
static inline vf v_exp(vf x) { return exp16(x); }
static inline vf v_load_dt(const void *p, int dtype) { return load16(p, dtype); }
static inline void v_store_dt(void *p, vf x, int dtype) { store16(p, x, dtype); }
static inline vf v_round_dt(vf x, int dtype) { return round16(x, dtype); }
#elif defined(__AVX2__) && defined(__FMA__)
#define VF 1
#define VW 8
typedef __m256 vf;
typedef __m256 vm;
static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf v_set1(float x) { return _mm256_set1_ps(x); }
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf v_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vm v_le(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
static inline vm v_neq(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_NEQ_OQ); }
static inline vm v_gt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
static inline vm v_unord(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_UNORD_Q); } /* a or b NaN */
static inline vm v_mor(vm a, vm b) { return _mm256_or_ps(a, b); }
static inline int v_many(vm m) { return _mm256_movemask_ps(m) != 0; }
static inline vf v_select(vm m, vf a, vf b) { return _mm256_blendv_ps(b, a, m); } /* m ? a : b */
static inline float v_sum(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* exp(x) for 8 lanes as exp16 below, 2^k built in the exponent bits (k clamped to
 * [-126, 128]: below about -87 the result is 2^-126 p, not a denormal; 128 gives inf). */
static inline vf v_exp(vf x) {
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(128.0f));
    const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, k);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_and_ps(r, _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
}
/* 8 fp8 E4M3 values at p as floats (fp8_to_f32 lane-wise). */
static inline vf v_load_fp8(const void *p) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
    const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
    const __m256i is_normal = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(7));
    __m256 f = _mm256_blendv_ps(sub, _mm256_castsi256_ps(normal), _mm256_castsi256_ps(is_normal));
    const __m256i is_nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f));
    f = _mm256_blendv_ps(f, _mm256_set1_ps(NAN), _mm256_castsi256_ps(is_nan));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(f), sign));
}
static inline vf v_load_dt(const void *p, int dtype) {
    if (dtype == 1) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    if (dtype == 2) return v_load_fp8(p);
    return _mm256_loadu_ps((const float *)p);
}
/* 8 floats -> 8 bfloat16 (round to nearest even, NaN kept quiet) at p. */
static inline void v_store_bf16(void *p, vf x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
static inline void v_store_dt(void *p, vf x, int dtype) {
    if (dtype == 1) v_store_bf16(p, x);
    else _mm256_storeu_ps((float *)p, x);
}
static inline vf v_round_dt(vf x, int dtype) {
    if (dtype != 1) return x;
    uint16_t tmp[8];
    v_store_bf16(tmp, x);
    return v_load_dt(tmp, 1);
}
#endif

static inline void load_row(float *restrict dst, const void *p, int n, int dtype) {
#ifdef VF
    if (dtype != 0 && n % VW == 0) {
        const char *s = (const char *)p;
        for (int d = 0; d < n; d += VW) v_store(dst + d, v_load_dt(s + d * dt_size(dtype), dtype));
        return;
    }
#endif
    if (dtype == 1) {
        const uint16_t *s = (const uint16_t *)p;
        for (int d = 0; d < n; d++) dst[d] = bf16_to_f32(s[d]);
    } else if (dtype == 2) {
        const uint8_t *s = (const uint8_t *)p;
        for (int d = 0; d < n; d++) dst[d] = fp8_to_f32(s[d]);
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

/* x rounded to the element type and back. */
static inline float round_to(float x, int dtype) {
    return dtype == 1 ? bf16_to_f32(f32_to_bf16(x)) : x;
}

/* The first key position a query at `pos` sees (0 without a window). */
static inline int64_t window_start(int64_t pos, int window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* the rows of one cache block on their way into the caches */
static inline void prefetch_block(const char *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

/* Share i of `parts` of the `lines` cache lines from p, asked for to L2: a block's prefetch
 * spread over the work before it is needed. Asked all at once, a block's lines queue behind one
 * another and hold up the loads of the work in hand. */
static inline void prefetch_share(const char *p, int lines, int i, int parts) {
    for (int l = lines * i / parts; l < lines * (i + 1) / parts; l++)
        __builtin_prefetch(p + 64 * (size_t)l, 0, 1);
}

#ifdef VF
/* silu(g) * u in each lane, silu(g) rounded to the element type before the product (as torch's
 * two ops round): silu_and_mul_cpu's arithmetic, shared with the fused gate-up product. */
static inline vf v_silu_mul(vf g, vf u, int dtype) {
    const vf s = v_round_dt(v_div(g, v_add(v_set1(1.0f), v_exp(v_sub(v_zero(), g)))), dtype);
    return v_mul(s, u);
}

/* cap * tanh(x / cap) in each lane (tanhf: the scores of soft-capped models only). */
static inline vf v_softcap(vf x, float cap) {
    float t[VW];
    v_store(t, x);
    for (int i = 0; i < VW; i++) t[i] = cap * tanhf(t[i] / cap);
    return v_load(t);
}
#endif

#ifdef __AVX512F__
/* Where accumulator i of the bfloat16 value path belongs: its vectors pair keys t, t+1 with
 * 16-bit unpacks, which interleave within 128-bit lanes. Vector j = 2 c2 + e (e = 0: unpacklo,
 * 1: unpackhi) of the 32 elements of half c2, lane k: d = 32 c2 + 8 (k / 4) + 4 e + k % 4. */
static inline int permuted_d(int i) {
    const int j = i / 16, k = i % 16;
    return 32 * (j / 2) + 8 * (k / 4) + 4 * (j % 2) + k % 4;
}

/* An accumulator row a of D floats (D a multiple of 32) in permuted_d's order, times inv, as
 * bfloat16 at dst in the dims' order: per 32 dims, four lanes of vector 0 then four of vector 1,
 * in turn. The bits of store_row over a[permuted_d(i)] * inv, two permutes per 32 dims. */
static inline void store_permuted_bf16(uint16_t *dst, const float *a, float inv, int D) {
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    const __m512 s = _mm512_set1_ps(inv);
    for (int c2 = 0; c2 < D / 32; c2++) {
        const __m512 v0 = _mm512_mul_ps(_mm512_loadu_ps(a + 32 * c2), s);
        const __m512 v1 = _mm512_mul_ps(_mm512_loadu_ps(a + 32 * c2 + 16), s);
        store16_bf16(dst + 32 * c2, _mm512_permutex2var_ps(v0, lo, v1));
        store16_bf16(dst + 32 * c2 + 16, _mm512_permutex2var_ps(v0, hi, v1));
    }
}

/* A 16 x 16 matrix of 32-bit elements, one row per vector, transposed in place. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(u[i], u[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_i32x4(u[i], u[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_i32x4(u[8 + i], u[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_i32x4(u[8 + i], u[12 + i], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
        r[4 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0x88);
        r[12 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0xdd);
    }
}
#endif

#endif
