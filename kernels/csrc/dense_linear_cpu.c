/* Dense linear layers on the CPU: out = x @ w^T (+ bias), x, w, bias and out of one type, sums in
 * float32. bfloat16 on CPUs with AVX512-BF16 (vdpbf16ps: per 32-bit lane, a pair of bfloat16
 * products added to a float32 sum); float32 with AVX-512 or AVX2 FMAs.
 *
 * Weight layout ("packed", made once by dense_pack_cpu): output channels in panels of PW = 64,
 * inputs in pairs (K2 = K rounded up to 2, halved; missing channels and inputs are zero). Panel p
 * is K2 * 64 pairs, contiguous; in it, pair k2 holds the 64 channels' inputs 2 k2 and 2 k2 + 1:
 *
 *     packed[((p * K2 + k2) * 64 + c) * 2 + i] = w[64 p + c, 2 k2 + i]
 *
 * so one pair step of a panel is four 64-byte loads, each one operand of vdpbf16ps for 16
 * channels. float32 weights: panels of PW32 channels (64 with AVX-512, 16 with AVX2), one input
 * at a time, packed[(p * K + k) * PW32 + c] = w[PW32 p + c, k]. A register tile is MR rows x a
 * panel's channels (24 float32 accumulators with AVX-512, 12 with AVX2); a
 * panel's rows run tile after tile, so the panel is read from memory once and then from the
 * core's cache. Panels are split over the threads in contiguous ranges.
 *
 * On AMX (bfloat16, K a multiple of 32) a tile is up to 32 rows on the tile registers
 * (tile_amx), and each panel is packed as two halves of 32 channels, each contiguous:
 *
 *     packed[(((p * 2 + h) * K2 + k2) * 32 + c) * 2 + i] = w[64 p + 32 h + c, 2 k2 + i]
 *
 * so 16 pair steps of 16 channels are one B tile (16 rows of 64 bytes, 128 bytes apart) and a
 * half streams from memory in order. A gated weight (dense_linear_gated_cpu, every tile kind)
 * puts half a panel's channels' gate rows (32; 8 in AVX2's float32 panels of 16) in a panel's
 * first half and the same channels' up rows in its second, and the tile writes silu(gate) * up:
 * an MLP's gate-up product and its activation in one pass. oneDNN's AMX
 * products, which the engine used before, cost about 30 us a call beyond their work (a 64 x 64
 * product: 30 us from Python, 7-13 us inside oneDNN); at 1 to 32 rows they took 1.14-1.21x this
 * kernel's time (the 0.5B model's four linears, 24 layers, weights from DRAM), at 256 and 512
 * rows within 15% either way, shape by shape.
 *
 * Prompt-sized products block both operands for the core's L2: rows in blocks of XBLOCK_BYTES
 * of x, panels in groups of GROUP_BYTES, each row block running over a group's panels (x comes
 * from L3 once per group, the group's weights from memory once); where x is over
 * X_CACHED_BYTES (more than its share of L3) each row block runs over all the thread's panels
 * instead (the weights come from L3 once per block, x from memory once). Without it each panel
 * streamed all of x: at 2048 rows the AVX2 float32 tiles ran at 0.83-0.90x oneDNN's, with it
 * 0.97-1.0x (load_tests/gemm_bench.py --isa avx2 --dtype float32). Decode-sized products are one
 * row block, as before. On AMX, products of more than one row block of three or more tiles
 * always run row blocks (of even size) over runs of panels, at least ROW_ITEMS work items a
 * thread: the block's x stays in L2 while the panels stream past, prefetched. With groups of
 * three panels x came from L3 once per group, and the tile loads waited on it: 2048 rows of the
 * 0.5B model's qkv product 10.1 -> 7.9 ms, of its unfused gate-up product 82 -> 67 ms; 512 rows
 * within 3% (dense_ab.py, builds alternating). Longer inputs (row blocks of fewer than three
 * tiles: the down projection's 4,864) run one tile at a time over all K, the sums in the tile
 * registers, and keep panels over all rows up to X_CACHED_AMX of x (L3s of AMX parts are large):
 * its 2048 rows as row blocks over all panels took 43 ms for 4 layers, panels over all rows 36.
 * The float32 vector tiles run three or more whole tiles of a panel k-blocked too
 * (panel_f32_blocked), and take row blocks over all panels only where a block has at least a
 * panel's width of rows (else each panel runs over all rows: the AVX-512 down projection).
 *
 * Why not oneDNN (what torch's prepacked linear calls): its products stall on memory. A decode
 * step's weights come from DRAM, and a product that reads a panel from memory for its first
 * tile and computes the other tiles from cache leaves the memory idle while it computes: at 29
 * rows the 0.5B model's linears took 36-42 ms a step against the 24 ms their multiply-adds need
 * at this core's peak. Here, while a panel's tiles run, each tile prefetches its share of the
 * next panel (paced over its k steps, below), so the next panel's memory traffic overlaps this
 * panel's arithmetic: 31 ms at 29 rows, 1.05-1.4x oneDNN from 1 to 64 rows, and even with it
 * on prompt-sized products (2048 rows, compute bound), load_tests/gemm_bench.py on two Zen 5
 * cores. One-tile products (up to MR rows) are memory bound and stream the weights without
 * software prefetch, except on AMX, where the tile asks for its weights a fixed distance ahead
 * (amx_half).
 */
#include "cpu_common.h"

#include <omp.h>

#define PW 64 /* bfloat16: output channels per panel */
#define MR 6  /* rows per register tile */
#define PF_TILES 16 /* a product of more tiles computes long enough per panel: no prefetch */
#define XBLOCK_BYTES (384 * 1024)  /* x rows per row block (whole tiles, at least one) */
#define GROUP_BYTES (384 * 1024)   /* packed weights per group of panels (at least one) */
#define X_CACHED_BYTES (12 << 20)  /* larger x: work items are row blocks over all panels */
#define X_CACHED_AMX (32 << 20)    /* the same on AMX, for inputs too long for row blocks of 3 tiles */
#define CHUNKS 8 /* work items (runs of panels) per thread */
#define STREAM_BYTES (8 << 20) /* larger outputs are stored streaming (see Epilogue): on vector
                                * tiles too, the LM head at 64 rows 73 -> 68.6 ms (AVX-512 float32),
                                * 114 -> 97 ms (AVX2 float32), dense_ab.py --march */
#define ROW_ITEMS 4 /* AMX prompts: work items (a row block over a run of panels) per thread, at least */
#if defined(__AVX512F__)
#define PW32 64
#define PF_GAP_F32 1 /* steps between a tile's prefetches, at least (float32; bfloat16: 1) */
#elif defined(__AVX2__) && defined(__FMA__)
#define PW32 16
#define PF_GAP_F32 4 /* an AVX2 step is a quarter of the others' arithmetic (12 ymm FMAs) */
#endif

/* The panel width of this build's kernel for `dtype` (0 = float32, 1 = bfloat16), 0 if none. */
int dense_supported_cpu(int dtype) {
#ifdef __AVX512BF16__
    if (dtype == 1) return PW;
#endif
#ifdef PW32
    if (dtype == 0) return PW32;
#endif
    return 0;
}

static int amx_layout(int dtype, int64_t K);

/* w [N, K] of `dtype`, rows contiguous -> dst in the layout above (bfloat16: ceil(N / 64) * 64 *
 * (K rounded up to 2) elements; float32: ceil(N / PW32) * PW32 * K). -1 if unsupported. */
int dense_pack_cpu(void *dst, const void *w, int64_t N, int64_t K, int dtype, int num_threads) {
    const int pw = dense_supported_cpu(dtype);
    if (!pw) return -1;
    const int64_t P = (N + pw - 1) / pw, steps = dtype == 1 ? (K + 1) / 2 : K, g = dtype == 1 ? 2 : 1;
    const int halves = amx_layout(dtype, K); /* AMX: each half of a panel by itself */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < P; p++)
        for (int64_t s = 0; s < steps; s++)
            for (int c = 0; c < pw; c++)
                for (int i = 0; i < g; i++) {
                    const int64_t n = p * pw + c, k = g * s + i;
                    const int64_t at = halves
                        ? (((p * 2 + c / 32) * steps + s) * 32 + c % 32) * 2 + i
                        : ((p * steps + s) * pw + c) * g + i;
                    if (dtype == 1)
                        ((uint16_t *)dst)[at] = n < N && k < K ? ((const uint16_t *)w)[n * K + k] : 0;
                    else
                        ((float *)dst)[at] = n < N && k < K ? ((const float *)w)[n * K + k] : 0.0f;
                }
    return 0;
}

#if defined(__AVX512BF16__) || defined(PW32)
/* A tile's share of the next panel to prefetch: `left` lines from p, `lines` of them per `steps`
 * k steps (carried in acc). A share goes out at one line per PF_GAP_F32 steps (bfloat16: one per
 * step) from the tile's first step, or evenly over all its steps where that is sparser: a
 * burst of one line per AVX2 step (12 FMAs) filled the core's miss buffers and stalled the
 * arithmetic (29 rows on Zen 4: 0.97-1.08x oneDNN in bursts, 1.29-1.44x spread), while the
 * longer bfloat16 steps ran best front-loaded (1.11-1.26x against 1.05-1.18x spread). The
 * lines go to L2 (prefetcht2), not L1: a software prefetch to L1 holds one of the core's few L1
 * miss buffers for a DRAM round trip, which capped memory-bound products (8-22 rows) below the
 * bandwidth the L2 streamers reach; on Zen 4, bfloat16 at 8-16 rows 15% faster, AVX-512 float32
 * at 16 rows 24%, AVX2 float32 at 8 rows 21%, no product slower by more than 3% (interleaved
 * builds, 0.5B shapes). */
typedef struct { const char *p; int64_t left, acc, lines, steps; } Prefetch;
static inline __attribute__((always_inline)) void prefetch_step(Prefetch *f) {
    for (f->acc += f->lines; f->acc >= f->steps && f->left > 0; f->acc -= f->steps, f->left--) {
        _mm_prefetch(f->p, _MM_HINT_T2); /* to L2, not L1: see above */
        f->p += 64;
    }
}

/* Channels of a panel's vector j (of `width`) that exist: 0..width. */
static inline int live_cols(int ncols, int j, int width) {
    const int left = ncols - width * j;
    return left < 0 ? 0 : (left > width ? width : left);
}
#endif

#if defined(__AVX512BF16__) || defined(PW32)
/* silu(g) * u of one channel as silu_and_mul_cpu's scalar tail computes it. */
static inline float silu_mul_tail(float g, float u, int dtype) {
    return round_to(g / (1.0f + expf(-g)), dtype) * u;
}
#endif

#ifdef __AVX512BF16__
/* 32 bfloat16 (lo, then hi) at p as one whole line, stored streaming (p 64-byte aligned). */
static inline void stream_line_bf16(uint16_t *p, __m256i lo, __m256i hi) {
    _mm512_stream_si512((__m512i *)p, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}

/* out[i, 0..ncols) (ncols <= 32) = silu(g) * u for g = c[i, 0..32), u = c[i, 32..64) (row
 * stride 64), with the roundings of the two-step path: g and u rounded to bfloat16 as the
 * product stores them, then as silu_and_mul_cpu (elementwise_cpu.c) does, bit for bit (a
 * vector of fewer than 16 channels is the last of the row, which silu_and_mul_cpu does one by
 * one: silu_mul_tail). The AMX tiles' epilogue and the vector tiles' (tile_bf16). */
static void gated_epilogue(const float *c, uint16_t *out, int64_t so, int ncols, int mrc,
                           int stream) {
    if (stream && ncols == 32) { /* each row's 32 outputs are one line: streamed */
        for (int i = 0; i < mrc; i++) {
            __m256i h[2];
            for (int j = 0; j < 2; j++) {
                const vf g = v_round_dt(_mm512_load_ps(c + i * PW + 16 * j), 1);
                const vf u = v_round_dt(_mm512_load_ps(c + i * PW + 32 + 16 * j), 1);
                h[j] = pack16_bf16(v_silu_mul(g, u, 1)); /* as v_store_dt rounds */
            }
            stream_line_bf16(out + i * so, h[0], h[1]);
        }
        return;
    }
    for (int j = 0; j < 2; j++) {
        const int live = live_cols(ncols, j, 16);
        if (live == 0) continue;
        for (int i = 0; i < mrc; i++) {
            const vf g = v_round_dt(_mm512_load_ps(c + i * PW + 16 * j), 1);
            const vf u = v_round_dt(_mm512_load_ps(c + i * PW + 32 + 16 * j), 1);
            if (live == 16) {
                v_store_dt(out + i * so + 16 * j, v_silu_mul(g, u, 1), 1);
                continue;
            }
            float gs[16], us[16];
            v_store(gs, g);
            v_store(us, u);
            for (int l = 0; l < live; l++) out[i * so + 16 * j + l] = f32_to_bf16(silu_mul_tail(gs[l], us[l], 1));
        }
    }
}

/* One bfloat16 tile: rows x[0..MRC) (row stride sx) times panel wp, written to out (row stride
 * so) for the panel's first `ncols` channels, bias (the panel's part, or NULL) added before
 * rounding; pf: the share of the next panel this tile prefetches. `gated`: the panel is 32
 * channels' gate rows then their up rows, and out gets silu(gate) * up (gated_epilogue). */
static inline __attribute__((always_inline)) void tile_bf16(
    const uint16_t *x, int64_t sx, int64_t K, const uint16_t *wp, uint16_t *out, int64_t so,
    int ncols, const uint16_t *bias, Prefetch pf, int stream, int gated, const int MRC) {
    __m512 c[MR][4];
    for (int i = 0; i < MRC; i++)
        for (int j = 0; j < 4; j++) c[i][j] = _mm512_setzero_ps();
    const int64_t full = K / 2;
    for (int64_t k2 = 0; k2 < full; k2++) {
        const __m512i *wv = (const __m512i *)(wp + k2 * 2 * PW);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wv), w1 = (__m512bh)_mm512_loadu_si512(wv + 1),
                       w2 = (__m512bh)_mm512_loadu_si512(wv + 2), w3 = (__m512bh)_mm512_loadu_si512(wv + 3);
        if (pf.left) prefetch_step(&pf);
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
    if (gated) { /* no bias */
        float cs[MR * PW] __attribute__((aligned(64)));
        for (int i = 0; i < MRC; i++)
            for (int j = 0; j < 4; j++) _mm512_store_ps(cs + i * PW + 16 * j, c[i][j]);
        gated_epilogue(cs, out, so, ncols, MRC, stream);
        return;
    }
    __m512 b[4];
    for (int j = 0; j < 4; j++) {
        const __mmask16 m = (__mmask16)((1u << live_cols(ncols, j, 16)) - 1);
        b[j] = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                          _mm256_maskz_loadu_epi16(m, bias + 16 * j)), 16))
                    : _mm512_setzero_ps();
    }
    if (stream && ncols == PW) { /* a row's 64 outputs are two whole lines */
        for (int i = 0; i < MRC; i++)
            for (int h = 0; h < 2; h++)
                stream_line_bf16(out + i * so + 32 * h,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c[i][2 * h], b[2 * h])),
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c[i][2 * h + 1], b[2 * h + 1])));
        return;
    }
    for (int i = 0; i < MRC; i++)
        for (int j = 0; j < 4; j++) {
            const int live = live_cols(ncols, j, 16);
            const __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c[i][j], b[j]));
            if (live == 16) _mm256_storeu_si256((__m256i *)(out + i * so + 16 * j), y);
            else if (live > 0) _mm256_mask_storeu_epi16(out + i * so + 16 * j, (__mmask16)((1u << live) - 1), y);
        }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define DENSE_AMX 1
#define MR_AMX 32 /* rows per tile_amx call: two tiles of up to 16 */
#define KB_AMX 256 /* inputs per k block: a half's 32 channels of them are 16 KB, kept in L1 */
#define NT_AMX 8   /* whole tiles per panel_amx_blocked call: their sums are 64 KB */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} DenseTileConfig;

/* The tile registers for two row tiles of r0 and r1 rows (r1 may be 0): sums 0-3, rows 4-5,
 * weights 6-7. */
static void amx_configure(int r0, int r1) {
    DenseTileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

/* Inputs k0..k1 of one half of a panel (wh: its K / 2 pairs of 32 channels, in order) into the
 * sums in tiles 0-3, as tile_amx describes. With `ahead` (a constant in each inlined copy), each
 * 32-input step first asks for the lines read AMX_AHEAD bytes on (to L1), so the weights' stream
 * keeps enough misses in flight: the hardware prefetchers alone left the 0.5B model's products
 * at 1-64 rows at 15-18 GB/s of this VM's 25 (dense_ab.py, 12 layers, alternating builds: 32
 * rows 23.5 -> 18.9 ms, 16 rows 17.7 -> 16.0, 64 rows 30.8 -> 25.7, 1 row 17.1 -> 15.3; 4 and
 * 16 KB ahead, or to L2, did less). The stream runs on past the half into the next half or
 * panel, as the weights lie in memory. Only one-tile products (up to 32 rows) ask ahead: with
 * two tiles a panel the first tile's stream left the memory idle while the second ran from
 * cache, and each tile's share of the next panel to L2 (run_panels) did better: the LM head
 * (151,936 x 896, two copies) at 64 rows 41.7 -> 34.2 ms, at 40 rows 30.6-31.1 -> 29.4; the
 * layers at 64 rows within 3%. */
#define AMX_AHEAD 8192

static void amx_epilogue(const float *c, uint16_t *out, int64_t so, int ncols, const uint16_t *bias,
                         int mrc, int gated, int stream);

/* The epilogue of the tiles a thread finished last (their float32 sums -> out), done a few rows
 * at a time between the next tiles' steps, so that its vector work (gated: SiLU's exp and
 * divide per output) runs beside the tile unit's rather than after it. The gated product's
 * epilogue is a quarter of its time (4 layers of the 0.5B gate-up at 2048 rows: 80 ms, 58 with
 * the epilogue taken out): done this way 4% less than after the tiles at 2048 rows, 6% at 128.
 * The tile unit and the vector units do not fully overlap (a loop of four tile products and 16
 * FMAs took 60 cycles against 50 and 27 apart). Most of the epilogue's cost was its stores, not
 * the SiLU's arithmetic: a row's piece of a panel's output is one or two lines of their own
 * (rows are the output's width apart), each read for ownership before it is written; the
 * stores taken out, 4 layers at 128 rows took 5.8 ms against 6.7, the arithmetic taken out 6.3.
 * So where the output is not read again soon from cache (a gated product's, which the down
 * projection reads after streaming its weights, and outputs over STREAM_BYTES, the LM head's)
 * whole lines are stored streaming: gated 128 rows 7.0 -> 6.35 ms, 2048 rows 90 -> 80; the
 * 0.5B model's decode steps 106 -> 101.5 ms. Streaming the smaller outputs too (qkv, o, down)
 * made the small kernels that read them next slower (rotary 0.91 -> 1.1 ms a decode step).
 * Rows in c are PW floats apart, as tile_amx stores them. */
typedef struct {
    const float *c;
    uint16_t *out;
    const uint16_t *bias;
    int64_t so;
    int ncols, gated, rows, done, per; /* per: rows to do per step */
    int stream; /* whole lines stored streaming (non-temporal) */
} Epilogue;

/* Rows done..done + n: consecutive in c and in out across the tiles of a call. */
static inline void epilogue_rows(Epilogue *e, int n) {
    const int end = e->done + n < e->rows ? e->done + n : e->rows;
    if (end > e->done)
        amx_epilogue(e->c + (int64_t)e->done * PW, e->out + e->done * e->so, e->so, e->ncols,
                     e->bias, end - e->done, e->gated, e->stream);
    e->done = end;
}

/* Per thread: two buffers of tile sums, one being computed, one waiting for its epilogue. */
typedef struct {
    float sums[2][NT_AMX * MR_AMX * PW] __attribute__((aligned(64)));
    int cur;
    int stream; /* this product's outputs streamed (Job.stream) */
    Epilogue wait;
} AmxThread;

/* The sums just computed in th->sums[th->cur] wait for their epilogue; the other buffer is next. */
static void epilogue_defer(AmxThread *th, uint16_t *out, int64_t so, int ncols,
                           const uint16_t *bias, int rows, int gated, int64_t steps) {
    epilogue_rows(&th->wait, th->wait.rows); /* anything the last tiles' steps left */
    const Epilogue e = {th->sums[th->cur], out, bias, so, ncols, gated, rows, 0,
                        (int)((rows + steps - 1) / steps), th->stream};
    th->wait = e;
    th->cur ^= 1;
}

static inline __attribute__((always_inline)) void amx_half(
    const uint16_t *x, const uint16_t *x1, int64_t sxb, int64_t k0, int64_t k1, const uint16_t *wh,
    int r1, Prefetch *pf, const int ahead, Epilogue *ep) {
    for (int64_t k = k0; k < k1; k += 32) {
        const uint16_t *w = wh + k / 2 * 64; /* k / 2 pairs, 32 x 2 each */
        if (pf->left) prefetch_step(pf);
        if (ahead)
            for (int l = 0; l < 32; l++)
                _mm_prefetch((const char *)w + AMX_AHEAD + 64 * l, _MM_HINT_T0);
        _tile_loadd(6, w, 128);
        _tile_loadd(7, w + 32, 128);
        _tile_loadd(4, x + k, sxb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (r1) {
            _tile_loadd(5, x1 + k, sxb);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (ep->done < ep->rows) epilogue_rows(ep, ep->per);
    }
}

/* Rows x[0..mrc) (mrc <= 32) times panel wp on AMX tiles, as tile_bf16 does on vectors; the
 * panel in halves (the layout above: 16 pair steps of 16 channels are a B tile of 16 rows of 64
 * bytes, 128 bytes apart). K a multiple of 32. The panel runs half by half; per 32 inputs, two
 * row tiles (4, 5: up to 16 rows each) times the half's two weight quarters (6, 7) into four
 * float32 sums (0-3: row tile r, quarter q in tile 2 r + q), so each weight tile is loaded once
 * for all the rows and each row tile once for two quarters. */
static void tile_amx(const uint16_t *x, int64_t sx, int64_t K, const uint16_t *wp, uint16_t *out,
                     int64_t so, int ncols, const uint16_t *bias, Prefetch pf, int mrc, int gated,
                     int ahead, AmxThread *th) {
    const int r0 = mrc < 16 ? mrc : 16, r1 = mrc - r0;
    amx_configure(r0, r1);
    float *c = th->sums[th->cur];
    const int64_t sxb = sx * 2;
    const uint16_t *x1 = x + 16 * sx;
    for (int half = 0; half < 2; half++) {
        if (!gated && live_cols(ncols, 2 * half, 16) == 0) break;
        _tile_zero(0);
        _tile_zero(1);
        if (r1) {
            _tile_zero(2);
            _tile_zero(3);
        }
        const uint16_t *wh = wp + half * K / 2 * 64;
        if (ahead) amx_half(x, x1, sxb, 0, K, wh, r1, &pf, 1, &th->wait);
        else amx_half(x, x1, sxb, 0, K, wh, r1, &pf, 0, &th->wait);
        _tile_stored(0, c + 32 * half, PW * 4);
        _tile_stored(1, c + 32 * half + 16, PW * 4);
        if (r1) {
            _tile_stored(2, c + 16 * PW + 32 * half, PW * 4);
            _tile_stored(3, c + 16 * PW + 32 * half + 16, PW * 4);
        }
    }
    _tile_release();
    epilogue_defer(th, out, so, ncols, bias, mrc, gated, 2 * K / 32);
}

/* A tile's float32 sums c (rows of PW, as tile_amx stores them) -> out: bias added and rounded,
 * or silu(gate) * up where gated. */
static void amx_epilogue(const float *c, uint16_t *out, int64_t so, int ncols, const uint16_t *bias,
                         int mrc, int gated, int stream) {
    if (gated) { /* out = silu(gate) * up: the first half's channels are gates, the second's ups */
        gated_epilogue(c, out, so, ncols, mrc, stream);
        return;
    }
    if (stream && ncols == 64) { /* each row's 64 outputs are two lines: streamed */
        __m512 b[4];
        for (int j = 0; j < 4; j++) b[j] = bias ? load16(bias + 16 * j, 1) : _mm512_setzero_ps();
        for (int i = 0; i < mrc; i++)
            for (int h = 0; h < 2; h++) {
                const float *ch = c + i * PW + 32 * h;
                stream_line_bf16(out + i * so + 32 * h,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(ch), b[2 * h])),
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(ch + 16), b[2 * h + 1])));
            }
        return;
    }
    for (int j = 0; j < 4; j++) {
        const int live = live_cols(ncols, j, 16);
        if (live == 0) continue;
        const __mmask16 m = (__mmask16)((1u << live) - 1);
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                    _mm256_maskz_loadu_epi16(m, bias + 16 * j)), 16))
                              : _mm512_setzero_ps();
        for (int i = 0; i < mrc; i++) {
            const __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c + i * PW + 16 * j), b));
            _mm256_mask_storeu_epi16(out + i * so + 16 * j, m, y);
        }
    }
}

/* Prompt-sized products on AMX (three or more tiles a panel): nt (<= NT_AMX) whole 32-row tiles
 * (x and out rows 32 t..) times panel wp, k-blocked. Per half and block of KB_AMX inputs every
 * tile runs over the block's weights, which then come from L1 for all but the first tile, its
 * sums kept in c between blocks (tile stores and loads of float32: the same sums, in the same
 * order, as tile_amx's, bit for bit). tile_amx instead reads both operands from L2 at every
 * step, 4 KB per four tile products. 0.5B shapes, 12 layers, alternating builds (dense_ab.py):
 * 256 rows 70.0 -> 64.1 ms, 512 rows 128.1 -> 116.8, 2048 rows 496.6 -> 470.6; blocks of 512
 * inputs, or of 128 over 16 tiles, did less. */
static void panel_amx_blocked(const uint16_t *x, int64_t sx, int64_t K, const uint16_t *wp,
                              uint16_t *out, int64_t so, int ncols, const uint16_t *bias,
                              Prefetch pf, int nt, int gated, AmxThread *th) {
    amx_configure(16, 16);
    float *c = th->sums[th->cur];
    const int64_t sxb = sx * 2;
    for (int half = 0; half < 2; half++) {
        if (!gated && live_cols(ncols, 2 * half, 16) == 0) break;
        const uint16_t *wh = wp + half * K / 2 * 64;
        for (int64_t k0 = 0; k0 < K; k0 += KB_AMX) {
            const int64_t k1 = k0 + KB_AMX < K ? k0 + KB_AMX : K;
            for (int t = 0; t < nt; t++) {
                float *ct = c + t * MR_AMX * PW + 32 * half;
                if (k0 == 0) {
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                } else {
                    _tile_loadd(0, ct, PW * 4);
                    _tile_loadd(1, ct + 16, PW * 4);
                    _tile_loadd(2, ct + 16 * PW, PW * 4);
                    _tile_loadd(3, ct + 16 * PW + 16, PW * 4);
                }
                const uint16_t *x0 = x + t * 32 * sx;
                amx_half(x0, x0 + 16 * sx, sxb, k0, k1, wh, 16, &pf, 0, &th->wait);
                _tile_stored(0, ct, PW * 4);
                _tile_stored(1, ct + 16, PW * 4);
                _tile_stored(2, ct + 16 * PW, PW * 4);
                _tile_stored(3, ct + 16 * PW + 16, PW * 4);
            }
        }
    }
    _tile_release();
    epilogue_defer(th, out, so, ncols, bias, nt * MR_AMX, gated, 2 * nt * K / 32);
}
#endif

/* Whether products of `dtype` with K inputs run on tile_amx, so their weights are packed in
 * halves. */
static int amx_layout(int dtype, int64_t K) {
#ifdef DENSE_AMX
    return dtype == 1 && K % 32 == 0 && amx_permitted();
#else
    (void)dtype, (void)K;
    return 0;
#endif
}

#if defined(PW32) && defined(__AVX512F__)
#define NV 4 /* vectors of 16 channels per float32 panel */
typedef __m512 vacc;
static inline vacc acc_zero(void) { return _mm512_setzero_ps(); }
static inline vacc acc_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vacc acc_fma(vacc a, float x, vacc w) { return _mm512_fmadd_ps(_mm512_set1_ps(x), w, a); }
static inline vacc acc_add(vacc a, vacc b) { return _mm512_add_ps(a, b); }
static inline vacc acc_load_n(const float *p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
static inline void acc_store_n(float *p, vacc v, int n) {
    if (n == 16) _mm512_storeu_ps(p, v);
    else if (n > 0) _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
}
static inline void acc_stream(float *p, vacc v) { _mm512_stream_ps(p, v); }
static inline void acc_store(float *p, vacc v) { _mm512_storeu_ps(p, v); }
#elif defined(PW32)
#define NV 2 /* vectors of 8 channels per float32 panel */
typedef __m256 vacc;
static inline __m256i lanes_below(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vacc acc_zero(void) { return _mm256_setzero_ps(); }
static inline vacc acc_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vacc acc_fma(vacc a, float x, vacc w) { return _mm256_fmadd_ps(_mm256_set1_ps(x), w, a); }
static inline vacc acc_add(vacc a, vacc b) { return _mm256_add_ps(a, b); }
static inline vacc acc_load_n(const float *p, int n) { return _mm256_maskload_ps(p, lanes_below(n)); }
static inline void acc_store_n(float *p, vacc v, int n) {
    if (n == 8) _mm256_storeu_ps(p, v);
    else if (n > 0) _mm256_maskstore_ps(p, lanes_below(n), v);
}
static inline void acc_stream(float *p, vacc v) { _mm256_stream_ps(p, v); }
static inline void acc_store(float *p, vacc v) { _mm256_storeu_ps(p, v); }
#endif

#ifdef PW32
#define VL (PW32 / NV) /* channels per vector */
#define KC 128        /* inputs per partial sum */
/* The sums c of steps [k0, k1) of MRC rows (one KC block at most), from zero; pf: the share of
 * the next panel to prefetch (to L2), next: lines of this panel's next block (to L1, a line a
 * step). */
static inline __attribute__((always_inline)) void f32_block_sums(
    vacc c[MR][NV], const float *x, int64_t sx, int64_t k0, int64_t k1, const float *wp,
    Prefetch *pf, Prefetch *next, const int MRC) {
    for (int i = 0; i < MRC; i++)
        for (int j = 0; j < NV; j++) c[i][j] = acc_zero();
    for (int64_t k = k0; k < k1; k++) {
        vacc w[NV];
        for (int j = 0; j < NV; j++) w[j] = acc_load(wp + k * PW32 + VL * j);
        if (pf->left) prefetch_step(pf);
        if (next->left) {
            _mm_prefetch(next->p, _MM_HINT_T0);
            next->p += 64;
            next->left--;
        }
        for (int i = 0; i < MRC; i++) {
            const float xv = x[i * sx + k];
            for (int j = 0; j < NV; j++) c[i][j] = acc_fma(c[i][j], xv, w[j]);
        }
    }
}

/* Sums c plus the bias (the panel's part, or NULL) written to MRC rows of out, the panel's first
 * ncols channels. `gated`: the panel's first half is gates, its second the same channels' ups,
 * and out gets silu(gate) * up (no bias; ncols <= PW32 / 2) as the product's store and
 * silu_and_mul_cpu make it, bit for bit: a vector of fewer than VL channels is the row's last,
 * which silu_and_mul_cpu does one by one. */
static inline __attribute__((always_inline)) void f32_write(
    vacc c[MR][NV], float *out, int64_t so, int ncols, const float *bias, int stream, int gated,
    const int MRC) {
    if (gated) {
        for (int j = 0; j < NV / 2; j++) {
            const int live = live_cols(ncols, j, VL);
            for (int i = 0; i < MRC && live > 0; i++) {
                /* + 0 as the product's store adds a missing bias: -0 sums are stored as +0 */
                const vacc g = acc_add(c[i][j], acc_zero()), u = acc_add(c[i][j + NV / 2], acc_zero());
                if (live == VL) {
                    const vacc r = v_silu_mul(g, u, 0);
                    if (stream) acc_stream(out + i * so + VL * j, r);
                    else acc_store(out + i * so + VL * j, r);
                    continue;
                }
                float gs[VL], us[VL];
                acc_store(gs, g);
                acc_store(us, u);
                for (int l = 0; l < live; l++) out[i * so + VL * j + l] = silu_mul_tail(gs[l], us[l], 0);
            }
        }
        return;
    }
    for (int j = 0; j < NV; j++) {
        const int live = live_cols(ncols, j, VL);
        const vacc b = bias ? acc_load_n(bias + VL * j, live) : acc_zero();
        if (stream && live == VL) /* whole lines: a row's part of a panel is 64 or 256 bytes */
            for (int i = 0; i < MRC; i++) acc_stream(out + i * so + VL * j, acc_add(c[i][j], b));
        else
            for (int i = 0; i < MRC; i++) acc_store_n(out + i * so + VL * j, acc_add(c[i][j], b), live);
    }
}

/* One float32 tile, as tile_bf16 with one input per step. */
static inline __attribute__((always_inline)) void tile_f32(
    const float *x, int64_t sx, int64_t K, const float *wp, float *out, int64_t so, int ncols,
    const float *bias, Prefetch pf, int stream, int gated, const int MRC) {
    vacc c[MR][NV], sum[MR][NV]; /* sums of KC inputs at a time, added up (a shorter chain of
                                   * roundings than one sum over K: F.linear's accuracy) */
    Prefetch none = {NULL, 0, 0, 0, 1};
    for (int i = 0; i < MRC; i++)
        for (int j = 0; j < NV; j++) sum[i][j] = acc_zero();
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        f32_block_sums(c, x, sx, k0, k0 + KC < K ? k0 + KC : K, wp, &pf, &none, MRC);
        for (int i = 0; i < MRC; i++)
            for (int j = 0; j < NV; j++) sum[i][j] = acc_add(sum[i][j], c[i][j]);
    }
    f32_write(sum, out, so, ncols, bias, stream, gated, MRC);
}

#define NT_F32 16 /* whole tiles per panel_f32_blocked call: their sums are 24 KB (AVX-512) */
/* Whether float32 tiles run k-blocked at all. Not in builds for AMD's Zen cores (gcc names the
 * core for -march=native: __znver3__ on Zen 3 and, with gcc 12, on Zen 4): their L2 feeds tile
 * after tile over all K, and the blocks' extra passes cost more than they save. Zen 4, 0.5B
 * shapes, 2 threads, builds alternating (dense_ab.py): AVX-512 (native) 2048 rows 583 -> 558 ms
 * (219 GFLOP/s, about oneDNN's), 64 rows 56.2 -> 53.8, 29 rows 25.9 -> 24.6; AVX2 (-march=znver3,
 * Zen 3's build) 2048 rows 593 -> 588, 29 rows 26.6 -> 25.2. The same bits either way. The
 * class-capped builds (-march=haswell, skylake-avx512, ...) name no core and keep the blocks, as
 * do Intel's (the Xeon's AVX-512 build: 945 -> 799 ms with them, below). */
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) || \
    defined(__znver5__)
#define F32_KBLOCKS 0
#else
#define F32_KBLOCKS 1
#endif
/* Steps [k0, k1) (one KC block) of a whole MR-row tile, as tile_f32's: the block's sums are
 * added to the tile's sums `s` (MR rows of PW32), or, at the last block, with them and the bias
 * written to out. The same bits as tile_f32. `next`: lines of the panel's next block to ask for
 * (to L1). */
static inline __attribute__((always_inline)) void tile_f32_block(
    const float *x, int64_t sx, int64_t k0, int64_t k1, const float *wp, float *s, int first,
    int last, float *out, int64_t so, int ncols, const float *bias, Prefetch *pf, int stream,
    int gated, Prefetch *next) {
    vacc c[MR][NV];
    f32_block_sums(c, x, sx, k0, k1, wp, pf, next, MR);
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NV; j++)
            c[i][j] = acc_add(first ? acc_zero() : acc_load(s + i * PW32 + VL * j), c[i][j]);
    if (!last) {
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NV; j++) acc_store(s + i * PW32 + VL * j, c[i][j]);
        return;
    }
    f32_write(c, out, so, ncols, bias, stream, gated, MR);
}

/* nt (<= NT_F32) whole tiles of a panel, k-blocked: for each block of KC inputs, every tile in
 * turn, so the block's weights (KC * PW32 floats: 32 KB with AVX-512) are read from L1 by all
 * but the first tile, where tile after tile over all K reads the whole panel from L2 at every
 * tile (256 bytes a step for 24 FMAs). The sums wait in `s` between blocks. With AVX-512, in
 * calls of up to 64 rows, the tiles also ask for the panel's next block to L1, a line a step,
 * so its first tile does not wait on L2: 0.5B shapes from DRAM, 24 layers, 29 rows 117.2 ->
 * 109.7 ms, 64 rows 5% faster, 2048 rows (16 tiles a call) 2% slower when it asked too; AVX2
 * (8 KB blocks): no gain at 29 rows, 5% slower at 512 (dense_ab.py). */
static void panel_f32_blocked(const float *x, int64_t sx, int64_t K, const float *wp, float *out,
                              int64_t so, int ncols, const float *bias, Prefetch pf, int stream,
                              int gated, int nt, float *s) {
    const int ahead = PW32 == 64 && nt * MR <= 64;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = k0 + KC < K ? k0 + KC : K, k2 = k1 + KC < K ? k1 + KC : K;
        Prefetch next = {(const char *)(wp + k1 * PW32), ahead ? (k2 - k1) * PW32 * 4 / 64 : 0,
                         0, 0, 0};
        for (int t = 0; t < nt; t++)
            tile_f32_block(x + t * MR * sx, sx, k0, k1, wp, s + t * MR * PW32, k0 == 0, k1 == K,
                           out + t * MR * so, so, ncols, bias, &pf, stream, gated, &next);
    }
}
#endif

#ifdef __AVX512BF16__
/* The bfloat16 tile of each row count compiled as a function of its own, called from tile_rows.
 * Inlined into run_panels (as the float32 tiles are), its loop ran 6-8% slower than this on Zen
 * 4 with the same instructions' bits: 0.5B shapes, 2 threads, 2048 rows 291.6 -> 272.9 ms (448
 * GFLOP/s, where oneDNN's reach 436-444), 29 rows 14.1 -> 13.0, 64 rows 29.2 -> 27.1, 1 row
 * 5.69 -> 5.55 (dense_ab.py, builds alternating). The cause inside gcc's code for the inlined
 * loop was not pinned down: it kept the rows' addresses in vector registers, but addressing the
 * rows from two bases, which removed most of those moves, gained nothing. The float32 tiles
 * compiled apart ran the same as inlined (2048 and 29 rows within 1%). */
#define TILE_BF16_ROWS(n)                                                                      \
    static __attribute__((noinline)) void tile_bf16_##n(                                      \
        const uint16_t *x, int64_t sx, int64_t K, const uint16_t *wp, uint16_t *out, int64_t so, \
        int ncols, const uint16_t *bias, Prefetch pf, int stream, int gated) {                \
        tile_bf16(x, sx, K, wp, out, so, ncols, bias, pf, stream, gated, n);                   \
    }
TILE_BF16_ROWS(1)
TILE_BF16_ROWS(2)
TILE_BF16_ROWS(3)
TILE_BF16_ROWS(4)
TILE_BF16_ROWS(5)
TILE_BF16_ROWS(6)
#undef TILE_BF16_ROWS
typedef void (*TileBf16)(const uint16_t *, int64_t, int64_t, const uint16_t *, uint16_t *, int64_t,
                         int, const uint16_t *, Prefetch, int, int);
static const TileBf16 TILE_BF16_BY_ROWS[MR] = {tile_bf16_1, tile_bf16_2, tile_bf16_3,
                                               tile_bf16_4, tile_bf16_5, tile_bf16_6};
#endif

#if defined(__AVX512BF16__) || defined(PW32)
/* Tile t of panel p (a tile of mr rows), for either element type. */
static void tile_rows(int dtype, const void *x, int64_t sx, int64_t K, const void *wp, void *out,
                      int64_t so, int ncols, const void *bias, Prefetch pf, int stream, int gated,
                      int mr) {
#define TILES(fn, T)                                                                           \
    switch (mr) {                                                                              \
    case 1: fn((const T *)x, sx, K, (const T *)wp, (T *)out, so, ncols, (const T *)bias, pf, stream, gated, 1); break; \
    case 2: fn((const T *)x, sx, K, (const T *)wp, (T *)out, so, ncols, (const T *)bias, pf, stream, gated, 2); break; \
    case 3: fn((const T *)x, sx, K, (const T *)wp, (T *)out, so, ncols, (const T *)bias, pf, stream, gated, 3); break; \
    case 4: fn((const T *)x, sx, K, (const T *)wp, (T *)out, so, ncols, (const T *)bias, pf, stream, gated, 4); break; \
    case 5: fn((const T *)x, sx, K, (const T *)wp, (T *)out, so, ncols, (const T *)bias, pf, stream, gated, 5); break; \
    default: fn((const T *)x, sx, K, (const T *)wp, (T *)out, so, ncols, (const T *)bias, pf, stream, gated, 6); break; \
    }
#ifdef __AVX512BF16__
    if (dtype == 1) {
        TILE_BF16_BY_ROWS[(mr < MR ? mr : MR) - 1]((const uint16_t *)x, sx, K, (const uint16_t *)wp,
                                                   (uint16_t *)out, so, ncols,
                                                   (const uint16_t *)bias, pf, stream, gated);
        return;
    }
#endif
#ifdef PW32
    TILES(tile_f32, float)
#endif
#undef TILES
    (void)dtype;
}
#endif

#if defined(__AVX512BF16__) || defined(PW32)
typedef struct { /* one product's operands and blocking */
    int dtype;
    const char *x, *packed, *bias;
    char *out;
    int64_t sx, so, N, M, K, es, steps, panel, lines, pw, T, TB, G, P_ALL, PC;
    int64_t mr, ksteps; /* rows per tile; k steps per tile (prefetch pacing) */
    int amx;            /* tiles on AMX (tile_amx) */
    int gated;          /* silu(gate) * up of interleaved gate and up halves: 32 outputs a panel */
    int stream;         /* outputs stored streaming (larger than STREAM_BYTES; AMX: gated too) */
    int64_t opw;        /* output channels per panel: pw, or pw / 2 when gated */
} Job;

/* Panels [p0, p1) over row tiles [t0, t1): groups of G panels, row blocks of TB tiles, each
 * block over its group's panels. While a panel runs its tiles prefetch the next panel to come
 * from memory (below pf_end): the group's next one during the first row block, the next
 * group's (or the next work item's) first one during the last. */
static void run_panels(const Job *j, int64_t p0, int64_t p1, int64_t pf_end, int64_t t0,
                       int64_t t1, void *amx_thread) {
    (void)amx_thread; /* AMX builds only */
    for (int64_t g0 = p0; g0 < p1; g0 += j->G) {
        const int64_t g1 = g0 + j->G < p1 ? g0 + j->G : p1;
        for (int64_t b0 = t0; b0 < t1; b0 += j->TB) {
            const int64_t b1 = b0 + j->TB < t1 ? b0 + j->TB : t1, nb = b1 - b0;
            for (int64_t p = g0; p < g1; p++) {
                const char *wp = j->packed + (size_t)(p * j->panel * j->es);
                const int64_t opw = j->opw;
                const int ncols = (int)(j->N - p * opw < opw ? j->N - p * opw : opw);
                const char *pb = j->bias ? j->bias + (size_t)(p * j->pw * j->es) : NULL;
                const int fetch = nb > 1 && nb <= PF_TILES && p + 1 < pf_end &&
                                  ((b0 == t0 && p + 1 < g1) || (b1 == t1 && p + 1 == g1));
                int64_t tstart = b0;
#ifdef DENSE_AMX
                if (j->amx && nb >= 3) { /* prompt-sized: whole tiles k-blocked */
                    const int64_t whole = (j->M - b0 * j->mr) / j->mr;
                    const int64_t full = whole < nb ? whole : nb;
                    for (int64_t t = b0; t < b0 + full; t += NT_AMX) {
                        const int n = (int)(b0 + full - t < NT_AMX ? b0 + full - t : NT_AMX);
                        Prefetch pf = {NULL, 0, 0, 0, 1};
                        if (fetch && t == b0) { /* the whole tiles' shares of the next panel */
                            pf.p = wp + (size_t)(j->panel * j->es);
                            pf.left = pf.lines = full * j->lines / nb;
                            pf.steps = n * j->ksteps;
                        }
                        const char *xt = j->x + (size_t)(t * j->mr * j->sx * j->es);
                        char *ot = j->out + (size_t)((t * j->mr * j->so + p * opw) * j->es);
                        panel_amx_blocked((const uint16_t *)xt, j->sx, j->K, (const uint16_t *)wp,
                                          (uint16_t *)ot, j->so, ncols, (const uint16_t *)pb, pf,
                                          n, j->gated, amx_thread);
                    }
                    tstart = b0 + full;
                }
#endif
#ifdef PW32
                if (F32_KBLOCKS && !j->amx && j->dtype == 0 && nb >= 3) { /* three or more: k-blocked */
                    const int64_t whole = (j->M - b0 * j->mr) / j->mr;
                    const int64_t full = whole < nb ? whole : nb;
                    float s[NT_F32 * MR * PW32];
                    for (int64_t t = b0; t < b0 + full; t += NT_F32) {
                        const int n = (int)(b0 + full - t < NT_F32 ? b0 + full - t : NT_F32);
                        Prefetch pf = {NULL, 0, 0, 0, 1};
                        if (fetch) { /* these tiles' share of the next panel */
                            const int64_t a = (t - b0) * j->lines / nb;
                            const int64_t b = (t - b0 + n) * j->lines / nb;
                            pf.p = wp + (size_t)(j->panel * j->es + a * 64);
                            pf.left = pf.lines = b - a;
                            pf.steps = n * j->ksteps;
                        }
                        const char *xt = j->x + (size_t)(t * j->mr * j->sx * j->es);
                        char *ot = j->out + (size_t)((t * j->mr * j->so + p * opw) * j->es);
                        panel_f32_blocked((const float *)xt, j->sx, j->K, (const float *)wp,
                                          (float *)ot, j->so, ncols, (const float *)pb, pf,
                                          j->stream, j->gated, n, s);
                    }
                    tstart = b0 + full;
                }
#endif
                for (int64_t t = tstart; t < b1; t++) {
                    Prefetch pf = {NULL, 0, 0, 0, j->ksteps};
                    if (fetch) { /* this tile's share of the next panel */
                        const int64_t a = (t - b0) * j->lines / nb, b = (t - b0 + 1) * j->lines / nb;
                        pf.p = wp + (size_t)(j->panel * j->es + a * 64);
                        pf.left = pf.lines = b - a;
                        const int64_t gap = j->dtype == 0 ? PF_GAP_F32 : 1;
                        if (pf.lines * gap < j->ksteps) pf.steps = pf.lines * gap; /* front-load */
                    }
                    const int mr = (int)(j->M - t * j->mr < j->mr ? j->M - t * j->mr : j->mr);
                    const char *xt = j->x + (size_t)(t * j->mr * j->sx * j->es);
                    char *ot = j->out + (size_t)((t * j->mr * j->so + p * opw) * j->es);
#ifdef DENSE_AMX
                    if (j->amx) {
                        tile_amx((const uint16_t *)xt, j->sx, j->K, (const uint16_t *)wp,
                                 (uint16_t *)ot, j->so, ncols, (const uint16_t *)pb, pf, mr,
                                 j->gated, nb <= 2 && t == b0, amx_thread);
                        continue;
                    }
#endif
                    tile_rows(j->dtype, xt, j->sx, j->K, wp, ot, j->so, ncols, pb, pf, j->stream, j->gated,
                              mr);
                }
            }
        }
    }
}

typedef struct { int64_t v; char pad[56]; } __attribute__((aligned(64))) Counter;

/* Thread `id`'s share of the job, then whatever other threads have not started yet: work items
 * are taken from counters, so a thread the OS preempts (two cores shared with a server's other
 * processes) holds the product up by the item it is in, not by its whole static share. Items:
 * over CHUNKS contiguous runs of panels per thread, each over all rows (decode-sized products,
 * and prompts whose x the cache holds); or, for a larger x, row blocks over all panels. */
static void run_share(const Job *j, Counter *next, const int64_t *first, int nt, int id,
                      int by_rows) {
    const int64_t items = first[nt];
#ifdef DENSE_AMX
    AmxThread th; /* 128 KB of sums on the stack */
    th.cur = 0;
    th.stream = j->stream;
    th.wait.rows = th.wait.done = 0;
    void *amx_thread = &th;
#else
    void *amx_thread = NULL;
#endif
    for (int v = 0; v < nt; v++) {
        const int o = (id + v) % nt;
        for (int64_t c; (c = __atomic_fetch_add(&next[o].v, 1, __ATOMIC_RELAXED)) < first[o + 1];) {
            if (by_rows) { /* row block c / PC over its panel chunk c % PC */
                const int64_t t0 = c / j->PC * j->TB, t1 = t0 + j->TB < j->T ? t0 + j->TB : j->T;
                const int64_t pc = c % j->PC, p0 = j->P_ALL * pc / j->PC;
                const int64_t p1 = j->P_ALL * (pc + 1) / j->PC;
                run_panels(j, p0, p1, pc + 1 < j->PC && c + 1 < first[o + 1] ? p1 + 1 : p1, t0, t1,
                           amx_thread);
            } else {
                const int64_t P = j->P_ALL, p0 = P * c / items, p1 = P * (c + 1) / items;
                const int64_t pf_end = c + 1 < first[o + 1] ? P * (c + 2) / items : p1;
                run_panels(j, p0, p1, pf_end, 0, j->T, amx_thread);
            }
        }
    }
#ifdef DENSE_AMX
    epilogue_rows(&th.wait, th.wait.rows);
#endif
    if (j->stream) _mm_sfence(); /* the streamed lines, before other threads read them */
}
#endif

/* dense_linear_cpu (gated = 0) and dense_linear_gated_cpu (1). */
static int dense_run(void *out, const void *x, const void *packed, const void *bias, int64_t M,
                     int64_t N, int64_t K, int64_t sx, int64_t so, int dtype, int num_threads,
                     int gated) {
    const int pw = dense_supported_cpu(dtype);
    if (!pw) return -1;
#if defined(__AVX512BF16__) || defined(PW32)
    Job j = {.dtype = dtype, .x = x, .packed = packed, .bias = bias, .out = out, .sx = sx,
             .so = so, .N = N, .M = M, .K = K, .es = dtype == 1 ? 2 : 4, .pw = pw,
             .gated = gated};
    j.steps = dtype == 1 ? (K + 1) / 2 : K; /* a panel's k steps, 256 or 64 B each */
    j.opw = gated ? pw / 2 : pw;
    j.P_ALL = (N + j.opw - 1) / j.opw;
    j.mr = MR;
    j.ksteps = j.steps;
    const int aligned = ((uintptr_t)out & 63) == 0 && so * j.es % 64 == 0;
    /* streamed stores only of whole lines: not a gated AVX2 float32 row's 32 bytes a panel */
    j.stream = M * N * j.es > STREAM_BYTES && aligned && j.opw * j.es % 64 == 0;
#ifdef DENSE_AMX
    if (amx_layout(dtype, K)) {
        j.amx = 1;
        j.mr = MR_AMX;
        j.ksteps = K / 16; /* 32 inputs a step, in each half */
        j.stream = (gated || M * N * 2 > STREAM_BYTES) && aligned;
    }
#endif
    j.T = (M + j.mr - 1) / j.mr;
    j.panel = j.steps * (dtype == 1 ? 2 : 1) * pw; /* elements */
    j.lines = j.panel * j.es / 64;
    j.TB = XBLOCK_BYTES / (j.mr * K * j.es);
    if (j.TB < 1) j.TB = 1;
    j.G = GROUP_BYTES / (j.panel * j.es);
    if (j.G < 1) j.G = 1;
    const int64_t xbytes = M * K * j.es;
    /* Vector tiles: a row block over all panels reads the weights once per TB * mr rows, a panel
     * over all rows reads x once per panel width: the one moving less. */
    const int by_rows = (j.amx ? j.TB >= 3 || xbytes > X_CACHED_AMX
                               : xbytes > X_CACHED_BYTES && j.TB * j.mr >= j.opw) &&
                        j.T > j.TB;
    int64_t units = j.P_ALL;
    j.PC = 1;
    if (by_rows) { /* row blocks of even size; on AMX, each over a chunk of the panels */
        const int64_t blocks = (j.T + j.TB - 1) / j.TB;
        j.TB = (j.T + blocks - 1) / blocks;
        if (j.amx) {
            const int64_t want = (int64_t)num_threads * ROW_ITEMS;
            j.PC = blocks >= want ? 1 : (want + blocks - 1) / blocks;
            if (j.PC > j.P_ALL) j.PC = j.P_ALL;
        }
        units = blocks * j.PC;
    }
    const int nt = (int)(units < num_threads ? units : num_threads);
    const int64_t items = by_rows ? units : (units < nt * CHUNKS ? units : nt * CHUNKS);
    Counter next[nt];
    int64_t first[nt + 1];
    for (int i = 0; i <= nt; i++) first[i] = items * i / nt;
    for (int i = 0; i < nt; i++) next[i].v = first[i];
#pragma omp parallel num_threads(nt)
    run_share(&j, next, first, nt, omp_get_thread_num(), by_rows);
    return 0;
#else
    (void)out; (void)x; (void)packed; (void)bias; (void)M; (void)N; (void)K; (void)sx; (void)so;
    (void)num_threads; (void)gated;
    return -1;
#endif
}

/* out [M, N] (row stride so) = x [M, K] (row stride sx) @ w^T (+ bias [N]), w packed as above,
 * all of `dtype`. Returns 0, or -1 when this build has no kernel for `dtype`. */
int dense_linear_cpu(void *out, const void *x, const void *packed, const void *bias, int64_t M,
                     int64_t N, int64_t K, int64_t sx, int64_t so, int dtype, int num_threads) {
    return dense_run(out, x, packed, bias, M, N, K, sx, so, dtype, num_threads, 0);
}

/* The channels of each half of a gated panel (gate rows, then up rows) for products of `dtype`
 * with K inputs: 32 for bfloat16 (AMX tiles and vector tiles alike) and for AVX-512 float32, 8
 * for AVX2 float32 (half of PW32); 0 where this build has no such product. */
int dense_gated_supported_cpu(int dtype, int64_t K) {
    if (amx_layout(dtype, K)) return 32;
#ifdef __AVX512BF16__
    if (dtype == 1) return PW / 2;
#endif
#ifdef PW32
    if (dtype == 0) return PW32 / 2;
#endif
    return 0;
}

/* out [M, N] = silu(x @ gate^T) * (x @ up^T), gate and up [N, K] packed as one weight of
 * ceil(N / H) panels (H = dense_gated_supported_cpu), panel p = gate rows H p.. then up rows
 * H p.. (each block of H padded with zero rows): the gate-up product and SiLU-and-multiply in
 * one pass, its [M, 2N] product never stored. -1 where dense_gated_supported_cpu says no. */
int dense_linear_gated_cpu(void *out, const void *x, const void *packed, int64_t M, int64_t N,
                           int64_t K, int64_t sx, int64_t so, int dtype, int num_threads) {
    if (!dense_gated_supported_cpu(dtype, K)) return -1;
    return dense_run(out, x, packed, NULL, M, N, K, sx, so, dtype, num_threads, 1);
}
