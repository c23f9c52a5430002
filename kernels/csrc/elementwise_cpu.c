/* The CPU versions of the engine's small fused kernels, one pass over memory each (two for
 * top-p): RMSNorm (with the residual add fused in), SiLU-and-multiply, rotary embedding in
 * place, the KV-cache store, grammar masks of logits, the greedy argmax of logits and top-p
 * nucleus thresholds. Numerics follow the torch references in kernels/ (float32 inside; for
 * bfloat16, values are rounded where the references round). Rows are spread over OpenMP
 * threads (torch's pool: see paged_attention_cpu.c). Element types: 0 = float32, 1 = bfloat16.
 */
#include "cpu_common.h"

#define MAX_HIDDEN 65536
#define MAX_STORE_HEAD 256

/* out = rms_norm(x) * weight, x [T, H] rows strided by sx. With residual (rows strided by sr):
 * residual <- x + residual first (rounded to the element type), and that stored value is
 * normalised. For bfloat16 the normalised row is rounded before the weight multiplies it. */
int rms_norm_cpu(void *out, const void *x, void *residual, const void *weight, int64_t T, int H,
                 int64_t sx, int64_t sr, int64_t so, float eps, int dtype, int num_threads) {
    if (H > MAX_HIDDEN) return -1;
    const size_t es = dtype == 1 ? 2 : 4;
#pragma omp parallel num_threads(num_threads)
    {
        float *buf = malloc(sizeof(float) * (size_t)H);
        float *w = malloc(sizeof(float) * (size_t)H);
        if (buf && w) {
            for (int d = 0; d < H; d++)
                w[d] = dtype == 1 ? bf16_to_f32(((const uint16_t *)weight)[d]) : ((const float *)weight)[d];
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                const char *xr = (const char *)x + (size_t)t * sx * es;
                load_row(buf, xr, H, dtype);
                if (residual) {
                    char *rr = (char *)residual + (size_t)t * sr * es;
                    int d = 0;
#ifdef VF
                    for (; d + VW <= H; d += VW) {
                        const vf v = v_add(v_load(buf + d), v_load_dt(rr + d * es, dtype));
                        v_store_dt(rr + d * es, v, dtype);
                        v_store(buf + d, v_round_dt(v, dtype));
                    }
#endif
                    for (; d < H; d++) {
                        const float r = dtype == 1 ? bf16_to_f32(((uint16_t *)rr)[d]) : ((float *)rr)[d];
                        const float v = round_to(buf[d] + r, dtype);
                        if (dtype == 1) ((uint16_t *)rr)[d] = f32_to_bf16(v);
                        else ((float *)rr)[d] = v;
                        buf[d] = v;
                    }
                }
                float ss = 0.0f;
                int d0 = 0;
#ifdef VF
                vf acc = v_zero();
                for (; d0 + VW <= H; d0 += VW) {
                    const vf v = v_load(buf + d0);
                    acc = v_fmadd(v, v, acc);
                }
                ss = v_sum(acc);
#endif
                for (; d0 < H; d0++) ss += buf[d0] * buf[d0];
                const float inv = 1.0f / sqrtf(ss / (float)H + eps);
                char *orow = (char *)out + (size_t)t * so * es;
                int d = 0;
#ifdef VF
                const vf vinv = v_set1(inv);
                for (; d + VW <= H; d += VW) {
                    const vf n = v_round_dt(v_mul(v_load(buf + d), vinv), dtype);
                    v_store_dt(orow + d * es, v_mul(n, v_load(w + d)), dtype);
                }
#endif
                const int tail = d;
                for (; d < H; d++) buf[d] = round_to(buf[d] * inv, dtype) * w[d];
                store_row(orow + (size_t)tail * es, buf + tail, H - tail, dtype);
            }
        }
        free(buf);
        free(w);
    }
    return 0;
}

/* out [T, I] = silu(gate) * up for x [T, 2I] = (gate | up), rows strided by sx and so. For
 * bfloat16, silu(gate) is rounded before the product (as torch's two ops round). */
int silu_and_mul_cpu(void *out, const void *x, int64_t T, int I, int64_t sx, int64_t so,
                     int dtype, int num_threads) {
    const size_t es = dtype == 1 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        const char *g = (const char *)x + (size_t)t * sx * es;
        const char *u = g + (size_t)I * es;
        char *o = (char *)out + (size_t)t * so * es;
        int d = 0;
#ifdef VF
        for (; d + VW <= I; d += VW)
            v_store_dt(o + d * es,
                       v_silu_mul(v_load_dt(g + d * es, dtype), v_load_dt(u + d * es, dtype), dtype),
                       dtype);
#endif
        for (; d < I; d++) {
            const float gv = dtype == 1 ? bf16_to_f32(((const uint16_t *)g)[d]) : ((const float *)g)[d];
            const float uv = dtype == 1 ? bf16_to_f32(((const uint16_t *)u)[d]) : ((const float *)u)[d];
            const float r = round_to(gv / (1.0f + expf(-gv)), dtype) * uv;
            if (dtype == 1) ((uint16_t *)o)[d] = f32_to_bf16(r);
            else ((float *)o)[d] = r;
        }
    }
    return 0;
}

/* Rotate `heads` heads of D at row p in place: x1 = [:D/2], x2 = [D/2:];
 * x1 <- x1 cos - x2 sin, x2 <- x2 cos + x1 sin. */
static void rotate_heads(char *p, int heads, int D, const float *cos, const float *sin, int dtype) {
    const size_t es = dtype == 1 ? 2 : 4;
    const int half = D / 2;
    for (int h = 0; h < heads; h++) {
        char *x1 = p + (size_t)h * D * es, *x2 = x1 + (size_t)half * es;
        int d = 0;
#ifdef VF
        for (; d + VW <= half; d += VW) {
            const vf a = v_load_dt(x1 + d * es, dtype), b = v_load_dt(x2 + d * es, dtype);
            const vf c = v_load(cos + d), s = v_load(sin + d);
            v_store_dt(x1 + d * es, v_sub(v_mul(a, c), v_mul(b, s)), dtype);
            v_store_dt(x2 + d * es, v_add(v_mul(b, c), v_mul(a, s)), dtype);
        }
#endif
        for (; d < half; d++) {
            float a, b;
            if (dtype == 1) {
                a = bf16_to_f32(((uint16_t *)x1)[d]);
                b = bf16_to_f32(((uint16_t *)x2)[d]);
                ((uint16_t *)x1)[d] = f32_to_bf16(a * cos[d] - b * sin[d]);
                ((uint16_t *)x2)[d] = f32_to_bf16(b * cos[d] + a * sin[d]);
            } else {
                a = ((float *)x1)[d];
                b = ((float *)x2)[d];
                ((float *)x1)[d] = a * cos[d] - b * sin[d];
                ((float *)x2)[d] = b * cos[d] + a * sin[d];
            }
        }
    }
}

/* q [T, Hq*D] and k [T, Hk*D] (rows strided by sq, sk) rotated in place by
 * cos_sin [max_pos, D] float32 (cos | sin) at positions [T] int64. */
int rotary_cpu(const int64_t *positions, void *q, void *k, const float *cos_sin, int64_t T,
               int Hq, int Hk, int D, int64_t sq, int64_t sk, int64_t scache, int dtype,
               int num_threads) {
    const size_t es = dtype == 1 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        const float *cs = cos_sin + positions[t] * scache;
        rotate_heads((char *)q + (size_t)t * sq * es, Hq, D, cs, cs + D / 2, dtype);
        rotate_heads((char *)k + (size_t)t * sk * es, Hk, D, cs, cs + D / 2, dtype);
    }
    return 0;
}

/* key/value [T, Hk, D] (strides skt/skh, svt/svh, elements; `dtype`) into the contiguous caches
 * [num_blocks, block_size, Hk, D] at slot_mapping [T] (int64; -1 = skip), copied as they are
 * when the caches hold `dtype`, or (kv_dtype 2) multiplied by the inverse scale and converted
 * to fp8 E4M3 as torch converts (the reference in kernels/kv_cache.py). */
int store_kv_cpu(const void *key, const void *value, void *k_cache, void *v_cache,
                 const int64_t *slots, int64_t T, int Hk, int D, int64_t skt, int64_t skh,
                 int64_t svt, int64_t svh, int dtype, int kv_dtype, float k_inv_scale,
                 float v_inv_scale) {
    const size_t es = dt_size(dtype), row = (size_t)D * dt_size(kv_dtype);
    if (kv_dtype != dtype && kv_dtype != 2) return -1;
    float buf[MAX_STORE_HEAD];
    if (kv_dtype == 2 && D > MAX_STORE_HEAD) return -1;
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        for (int h = 0; h < Hk; h++) {
            const char *ks = (const char *)key + ((size_t)t * skt + (size_t)h * skh) * es;
            const char *vs = (const char *)value + ((size_t)t * svt + (size_t)h * svh) * es;
            char *kd = (char *)k_cache + ((size_t)slot * Hk + h) * row;
            char *vd = (char *)v_cache + ((size_t)slot * Hk + h) * row;
            if (kv_dtype == dtype) {
                memcpy(kd, ks, row);
                memcpy(vd, vs, row);
                continue;
            }
            load_row(buf, ks, D, dtype); /* fp8: scaled, rounded to nearest even, saturated */
            for (int d = 0; d < D; d++) ((uint8_t *)kd)[d] = f32_to_fp8(buf[d] * k_inv_scale);
            load_row(buf, vs, D, dtype);
            for (int d = 0; d < D; d++) ((uint8_t *)vd)[d] = f32_to_fp8(buf[d] * v_inv_scale);
        }
    }
    return 0;
}

/* Grammar masks (structured output): for each i < n, logits[rows[i], t] = -inf wherever bit
 * t % 32 of word t / 32 of bitmask row rows[i] is 0 (xgrammar's token bitmask, [*, words]
 * int32), for t < V, in place; float32 or bfloat16 rows strided by row_stride elements. */
int mask_logits_cpu(void *logits, int64_t row_stride, const int32_t *bitmask, int64_t words,
                    const int64_t *rows, int64_t n, int64_t V, int dtype, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * V > (1 << 20))
    for (int64_t i = 0; i < n; i++) {
        const uint32_t *bits = (const uint32_t *)bitmask + rows[i] * words;
        for (int64_t w = 0; w < words && w * 32 < V; w++) {
            const uint32_t m = bits[w];
            if (m == 0xffffffffu) continue;
            const int64_t t1 = w * 32 + 32 < V ? w * 32 + 32 : V;
            for (int64_t t = w * 32; t < t1; t++) {
                if ((m >> (t & 31)) & 1u) continue;
                if (dtype == 1) ((uint16_t *)logits)[rows[i] * row_stride + t] = 0xff80u;
                else ((float *)logits)[rows[i] * row_stride + t] = -INFINITY;
            }
        }
    }
    return 0;
}

/* The index of the largest of n values (element type dtype) at row: the first of equal
 * maxima, and the first NaN where the row has one (torch's max(dim).indices). */
static int64_t argmax_row(const char *row, int64_t n, int dtype) {
    const size_t es = dtype == 1 ? 2 : 4;
    int64_t best_i = 0, i = 0;
    float best = -INFINITY;
#ifdef VF
    if (n >= 2 * VW && n < (1 << 24)) { /* lane indices kept as floats: exact below 2^24 */
        float lane[VW];
        for (int l = 0; l < VW; l++) lane[l] = (float)l;
        vf idx0 = v_load(lane), idx1 = v_add(idx0, v_set1((float)VW));
        vf b0 = v_load_dt(row, dtype), b1 = v_load_dt(row + VW * es, dtype);
        vf i0 = idx0, i1 = idx1;
        vm nan = v_unord(b0, b1);
        const vf step = v_set1((float)(2 * VW));
        for (i = 2 * VW; i + 2 * VW <= n; i += 2 * VW) { /* two chains: lane i % (2 VW) */
            idx0 = v_add(idx0, step);
            idx1 = v_add(idx1, step);
            const vf x0 = v_load_dt(row + (size_t)i * es, dtype);
            const vf x1 = v_load_dt(row + (size_t)(i + VW) * es, dtype);
            const vm g0 = v_gt(x0, b0), g1 = v_gt(x1, b1);
            b0 = v_select(g0, x0, b0);
            i0 = v_select(g0, idx0, i0);
            b1 = v_select(g1, x1, b1);
            i1 = v_select(g1, idx1, i1);
            nan = v_mor(nan, v_unord(x0, x1));
        }
        float bv[2 * VW], bi[2 * VW];
        v_store(bv, b0), v_store(bv + VW, b1), v_store(bi, i0), v_store(bi + VW, i1);
        if (v_many(nan)) {
            i = 0; /* a NaN somewhere in the vector part: find the first one below */
        } else {
            best = bv[0], best_i = (int64_t)bi[0];
            for (int l = 1; l < 2 * VW; l++) /* the largest; the lowest index among equals */
                if (bv[l] > best || (bv[l] == best && (int64_t)bi[l] < best_i))
                    best = bv[l], best_i = (int64_t)bi[l];
        }
    }
#endif
    for (; i < n; i++) {
        const float v = dtype == 1 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
        if (v != v) return i;
        if (v > best || i == 0) best = v, best_i = i;
    }
    return best_i;
}

/* Greedy tokens: out[i] = argmax_row of row i of logits [n, V] (float32 or bfloat16, rows
 * row_stride elements apart). Rows are spread over the threads only when there are enough. */
int argmax_rows_cpu(int64_t *out, const void *logits, int64_t n, int64_t V, int64_t row_stride,
                    int dtype, int num_threads) {
    const size_t es = dtype == 1 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n > 1 && n * V > (1 << 18))
    for (int64_t r = 0; r < n; r++)
        out[r] = argmax_row((const char *)logits + (size_t)(r * row_stride) * es, V, dtype);
    return 0;
}

/* Top-p (nucleus) thresholds. Row r's tokens, taken from the most likely down, are kept while
 * the mass before them is below top_p[r] times the row's total; tau[r] is the smallest kept
 * probability, so the nucleus is every token with probability >= tau[r] (ties with the last
 * kept token included). No sort of the row: one pass adds each probability (float32, >= 0) to
 * a histogram bucket named by its top 12 bits (exponent and 3 mantissa bits: buckets are in
 * the values' order), a scan from the top bucket finds the one where the mass crosses top_p,
 * and only that bucket's values are gathered and sorted. */
#define TOP_P_BUCKETS 4096

static int cmp_desc(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static float top_p_row(const float *p, int64_t V, double top_p, float *gathered) {
    double hist[TOP_P_BUCKETS] = {0}, total = 0.0;
    for (int64_t v = 0; v < V; v++) {
        uint32_t bits;
        memcpy(&bits, p + v, 4);
        hist[bits >> 20] += p[v];
        total += p[v];
    }
    const double want = top_p * total;
    double above = 0.0; /* the mass of the buckets above c */
    int c = TOP_P_BUCKETS - 1;
    for (; c > 0 && above + hist[c] < want; c--) above += hist[c];
    int64_t m = 0;
    for (int64_t v = 0; v < V; v++) {
        uint32_t bits;
        memcpy(&bits, p + v, 4);
        if ((int)(bits >> 20) == c) gathered[m++] = p[v];
    }
    if (m == 0) return 0.0f; /* (rounding: no crossing) every token is kept */
    qsort(gathered, (size_t)m, sizeof(float), cmp_desc);
    float tau = gathered[0];
    for (int64_t i = 0; i < m && above < want; i++) tau = gathered[i], above += gathered[i];
    return tau;
}

int top_p_threshold_cpu(float *tau, const float *probs, int64_t n, int64_t V,
                        int64_t row_stride, const float *top_p, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (n > 1)
    {
        float *gathered = malloc(sizeof(float) * (size_t)V);
        if (!gathered) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < n; r++)
            if (gathered) tau[r] = top_p_row(probs + (size_t)(r * row_stride), V, top_p[r], gathered);
        free(gathered);
    }
    return failed ? -1 : 0;
}
