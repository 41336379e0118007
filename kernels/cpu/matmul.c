/* y (n_tok, n_out) = x (n_tok, n_in) . W^T for f32, bf16 or int8 weights W
 * (n_out, n_in, row stride ldw), f32 activations and accumulation.
 *
 * cpu_matmul_ref is the plain reference. cpu_matmul splits y into tasks of
 * (token block x row block) for the thread pool; inside a task, register
 * tiles of MK_T tokens x MK_R weight rows walk n_in once, so each weight
 * vector loaded feeds MK_T tokens (decode: W is streamed once per call;
 * prefill: a 4-row weight tile stays in L1 while every token of the block
 * passes over it). bf16 weights are widened to f32 exactly (a 16-bit shift)
 * and multiplied in f32, so the result equals an f32 matmul with the
 * bf16-rounded weights up to summation order. Calls of PK_MIN_TOK (AVX-512)
 * or PK2_MIN_TOK (AVX2) tokens and more take packed panels: a block of
 * weight rows widened (dequantized) once into k-major f32 scratch, then
 * register tiles that broadcast x against it (tile_avx512_packed,
 * tile_avx2_packed). Below that, for token blocks wider than one register
 * tile the scalar path widens rows once into per-thread scratch; AVX-512
 * and AVX2 read the narrow rows in every tile (cheaper there, see
 * tile_avx512 and tile_avx2).
 *
 * int8 weights (MOE_DTYPE_I8, W8A16: W[o] = q[o] * w_scale[o], common/quant.h)
 * take the same tiles. Streaming tiles (decode) sign-extend 16 (AVX-512) or
 * 8 (AVX2) int8 values, convert them to f32 (exact), FMA in f32 with one
 * accumulator per (token, row) and multiply each output by its row scale
 * once at the end: half the bytes of bf16 per weight for the same FMAs, and
 * decode is bound by those bytes. Where rows are reused by many tokens
 * (AVX2 / scalar widened scratch rows, the AVX-512 packed prefill panels)
 * they are dequantized to q * scale while widening, which costs nothing
 * extra there. Either way the result equals an f32 matmul on the
 * dequantized weights up to summation order (tests/unit/test_matmul_i8.c).
 *
 * 4-bit weights (MOE_DTYPE_I4, W4A16: one scale per group of 32..128
 * columns, common/quant.h) are dequantized as they are read, (u - 8) * scale
 * in f32 (exact: a 4-bit integer times a float), so every tile computes on
 * the same values as cpu_matmul_ref: AVX-512 decode tiles widen 16 codes
 * per row and step (a quarter of bf16's bytes), the AVX-512 packed panels
 * dequantize while packing, and the AVX2 and scalar paths dequantize rows
 * into their widened scratch for every tile (tests/unit/test_matmul_i4.c). */
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "quant.h"
#include "simd_x86.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define MATMUL_X86 1
#endif

#define MK_R 4 /* weight rows per register tile */
#define MK_T 4 /* tokens per register tile (AVX-512, scalar) */
/* tokens per register tile on AVX2: 3 x 4 accumulators + 3 x vectors + 1
 * weight vector fill the 16 ymm registers; 3 against 2 made bf16 prefill
 * under batch_invariant (the tiles alone) 323 -> 376 tok/s on a Zen 3 */
#define MK_T_AVX2 3
#define MK_T_W8 2    /* tokens per register tile of the AVX2 W8A8 path */
#define TOK_BLOCK 64 /* tokens per task */
#define PK_R 32      /* AVX-512 prefill: weight rows per packed panel (2 zmm) */
#define PK_T 8       /* AVX-512 prefill: tokens per register tile */
/* Token blocks at least this wide use the packed path. Packing a panel (a
 * strided scalar transpose) costs about as much as using it for 16 tokens, so
 * decode batches and small expert groups do better on widened rows: 16 -> 96
 * made 16-sequence decode 8% (bf16) / 28% (int8) faster, 512-token prefill
 * unchanged (moe-generate on the benchmark shape, 2 threads, alternated 3x). */
#define PK_MIN_TOK 96
#define PK_TOK_BLOCK 256 /* tokens per task on the packed path (amortises packing) */
#define PK2_R 16         /* AVX2 prefill: weight rows per packed panel (2 ymm) */
#define PK2_T 6          /* AVX2 prefill: tokens per register tile (12 accumulators) */
/* Token blocks at least this wide take the AVX2 packed path. Below it the
 * tiles win: bench-kernels --fast, bf16 on a Zen 3, 2 threads, tiles against
 * panels: 8 tokens 106 vs 59 GFLOP/s, 16 117 vs 98, 32 131 vs 133, 64 131
 * vs 157 (8 made a decode batch's busy experts the slowest). */
#define PK2_MIN_TOK 32

/* ---------------------------------------------------------------------------
 * Weight access shared by every path */

/* Weight element `i` (row * ldw + col) as f32: exact for every type (bf16
 * widens by a shift, int8 converts); int8 is NOT scaled here. */
static inline float w_elem(enum moe_dtype wt, const void *w, int64_t i)
{
    if (wt == MOE_DTYPE_BF16)
        return moe_bf16_to_f32(((const uint16_t *)w)[i]);
    if (wt == MOE_DTYPE_I8)
        return (float)((const int8_t *)w)[i];
    return ((const float *)w)[i];
}

/* Address of weight element `i` (not I4: see q4_row). */
static inline const void *w_at(enum moe_dtype wt, const void *w, int64_t i)
{
    return (const char *)w + i * (int64_t)moe_dtype_size(wt);
}

/* I4: the codes of row o, and its group scales. */
static inline const uint8_t *q4_row(const struct moe_matmul_params *p, int64_t o)
{
    return (const uint8_t *)p->w + o * (p->ldw / 2);
}

static inline const float *q4_scales(const struct moe_matmul_params *p, int64_t o)
{
    return p->w_scale + o * moe_q4_groups(p->ldw, p->w_group);
}

/* I4: W[o][k] dequantized, (u - 8) * scale. */
static inline float q4_elem(const struct moe_matmul_params *p, int64_t o, int64_t k)
{
    return (float)(moe_q4_code(q4_row(p, o), k) - 8) * q4_scales(p, o)[k / p->w_group];
}

/* ---------------------------------------------------------------------------
 * Reference */

void cpu_matmul_ref(const struct moe_matmul_params *p)
{
    for (int t = 0; t < p->n_tok; t++) {
        const float *x = p->x + (size_t)t * p->n_in;
        for (int o = 0; o < p->n_out; o++) {
            float acc = 0.0f;
            if (p->w_dtype == MOE_DTYPE_I4)
                for (int k = 0; k < p->n_in; k++)
                    acc += x[k] * q4_elem(p, o, k);
            else
                for (int k = 0; k < p->n_in; k++)
                    acc += x[k] * w_elem(p->w_dtype, p->w, o * p->ldw + k);
            if (p->w_dtype == MOE_DTYPE_I8)
                acc *= p->w_scale[o];
            float *y = p->y + (size_t)t * p->n_out + o;
            *y = p->accumulate ? *y + acc : acc;
        }
    }
}

/* ---------------------------------------------------------------------------
 * One task: y[t0 .. t0+nt) x [o0 .. o0+no). `scratch` holds MK_R * n_in
 * floats for widened bf16 / int8 rows (PK_R * n_in on the packed path). */

struct mm_tile {
    const struct moe_matmul_params *p;
    int t0, nt, o0, no;
    float *scratch;
    bool packed;         /* the call takes the packed panels (cpu_matmul decides) */
    const float *xh;     /* bf16 tiles: x in bf16_halves_order (rows n_in apart), else NULL */
    const uint32_t *xph; /* fp16 panels: x as fp16 column pairs ((n_in + 1) / 2 a row), else NULL */
    const float *xs;     /* ... and each token's power-of-two scale */
};

/* The AVX2 integer paths' activations (fast int8 and int4): each token's row quantized, xq (ldq
 * bytes a row, zero past n_in), and its scale sx; for int4, xq in w8_quant_q4_order's order, and
 * xsum: -8 x the sum of xq over each weight group (ldg floats a row, zero past the groups). */
struct w8_act {
    int8_t *xq;
    float *sx;
    float *xsum;
    int ldq, ldg;
};

static inline void store_out(const struct moe_matmul_params *p, int t, int o, float v)
{
    float *y = p->y + (size_t)t * p->n_out + o;
    *y = p->accumulate ? *y + v : v;
}

/* Stores a T x R register tile at (t, o) whose rows are o, o + step, ...
 * `scale` (the row scales from row o on) is non-NULL when the tile was
 * computed on raw int8 values and still needs them. */
static inline void store_tile(const struct moe_matmul_params *p, int t, int T, int o, int R,
                              int step, const float *scale, float out[MK_T][MK_R])
{
    for (int tt = 0; tt < T; tt++)
        for (int r = 0; r < R; r++)
            store_out(p, t + tt, o + r * step, scale ? out[tt][r] * scale[r * step] : out[tt][r]);
}

/* Row scales a tile computed on raw weights at row o must apply. */
static inline const float *raw_scales(const struct moe_matmul_params *p, int o)
{
    return p->w_dtype == MOE_DTYPE_I8 ? p->w_scale + o : NULL;
}

/* ---- portable path ---- */

/* Rows [o, o+R) as f32 into dst (R, n_in). int8 rows come out dequantized
 * (q * scale, as the reference dequantizes), so results from widened rows
 * need no scale at the end. */
static void widen_rows_scalar(const struct moe_matmul_params *p, int o, int R, float *dst)
{
    if (p->w_dtype == MOE_DTYPE_I4) { /* dequantized too, a 32-column block at a time */
        for (int r = 0; r < R; r++) {
            const uint8_t *row = q4_row(p, o + r);
            const float *sc = q4_scales(p, o + r);
            float *d = dst + (size_t)r * p->n_in;
            for (int k = 0; k < p->n_in; k += MOE_Q4_BLOCK) {
                const uint8_t *b = row + k / 2;
                const float s = sc[k / p->w_group];
                for (int j = 0; j < MOE_Q4_BLOCK / 2; j++) {
                    d[k + j] = (float)((b[j] & 0x0f) - 8) * s;
                    d[k + j + MOE_Q4_BLOCK / 2] = (float)((b[j] >> 4) - 8) * s;
                }
            }
        }
        return;
    }
    for (int r = 0; r < R; r++) {
        float sc = p->w_dtype == MOE_DTYPE_I8 ? p->w_scale[o + r] : 1.0f;
        for (int k = 0; k < p->n_in; k++)
            dst[(size_t)r * p->n_in + k] =
                w_elem(p->w_dtype, p->w, (int64_t)(o + r) * p->ldw + k) * sc;
    }
}

/* acc[t][r] over rows w[r] (f32, stride ldw) for T tokens, R rows. */
static inline void mk_scalar_f32(int T, int R, const float *x, int n_in, const float *w,
                                 int64_t ldw, float acc[MK_T][MK_R])
{
    for (int t = 0; t < MK_T; t++)
        for (int r = 0; r < MK_R; r++)
            acc[t][r] = 0.0f;
    for (int k = 0; k < n_in; k++) {
        for (int r = 0; r < R; r++) {
            float wv = w[r * ldw + k];
            for (int t = 0; t < T; t++)
                acc[t][r] += x[(size_t)t * n_in + k] * wv;
        }
    }
}

static void tile_scalar(const struct mm_tile *mt)
{
    const struct moe_matmul_params *p = mt->p;
    int n_in = p->n_in;
    float acc[MK_T][MK_R];
    for (int o = mt->o0; o < mt->o0 + mt->no; o += MK_R) {
        int R = mt->o0 + mt->no - o < MK_R ? mt->o0 + mt->no - o : MK_R;
        const float *w;
        int64_t ldw;
        if (p->w_dtype != MOE_DTYPE_F32) {
            widen_rows_scalar(p, o, R, mt->scratch);
            w = mt->scratch;
            ldw = n_in;
        } else {
            w = (const float *)p->w + o * p->ldw;
            ldw = p->ldw;
        }
        for (int t = mt->t0; t < mt->t0 + mt->nt; t += MK_T) {
            int T = mt->t0 + mt->nt - t < MK_T ? mt->t0 + mt->nt - t : MK_T;
            mk_scalar_f32(T, R, p->x + (size_t)t * n_in, n_in, w, ldw, acc);
            store_tile(p, t, T, o, R, 1, NULL, acc);
        }
    }
}

#ifdef MATMUL_X86

/* ---- AVX-512 path ---- */

#define AVX512_TARGET MOE_AVX512_TARGET

AVX512_TARGET static inline __m512 i8x16_to_f32(__m128i q)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}

/* 16 weights from element i of w as f32 (int8 unscaled); WT is a constant
 * in every caller, so the branches fold away. */
AVX512_TARGET static inline __attribute__((always_inline)) __m512 load_w16(const enum moe_dtype WT,
                                                                           const void *w, int64_t i)
{
    if (WT == MOE_DTYPE_BF16)
        return bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i)));
    if (WT == MOE_DTYPE_I8)
        return i8x16_to_f32(_mm_loadu_si128((const __m128i *)((const int8_t *)w + i)));
    return _mm512_loadu_ps((const float *)w + i);
}

/* The first popcount(m) of those 16 weights, zeros after (no read past them). */
AVX512_TARGET static inline __attribute__((always_inline)) __m512
load_w16_mask(const enum moe_dtype WT, const void *w, int64_t i, __mmask16 m)
{
    if (WT == MOE_DTYPE_BF16)
        return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i));
    if (WT == MOE_DTYPE_I8)
        return i8x16_to_f32(_mm_maskz_loadu_epi8(m, (const int8_t *)w + i));
    return _mm512_maskz_loadu_ps(m, (const float *)w + i);
}

/* The T token rows of x (ldx apart) at columns [k, k + 32): two vectors each. */
AVX512_TARGET static inline __attribute__((always_inline)) void
load_x32(const int T, const float *x, int64_t ldx, int64_t k, __m512 lo[MK_T], __m512 hi[MK_T])
{
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
        lo[t] = _mm512_loadu_ps(x + t * ldx + k);
        hi[t] = _mm512_loadu_ps(x + t * ldx + k + 16);
    }
}

/* Sum of each of the R x T accumulators. */
AVX512_TARGET static inline float hsum512(__m512 v)
{
    return _mm512_reduce_add_ps(v);
}

/* T tokens x R rows of w (type WT, row stride ldw elements): one pass over
 * n_in, one accumulator per (token, row), each weight vector converted once
 * and used by all T tokens. */
AVX512_TARGET static inline __attribute__((always_inline)) void
mk_avx512(const int T, const int R, const enum moe_dtype WT, const bool H, const float *x,
          int64_t ldx, int n_in, const void *w, int64_t ldw, bool split, float out[MK_T][MK_R])
{
    __m512 acc[MK_T][MK_R];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[t][r] = _mm512_setzero_ps();
    int k = 0;
    /* Narrow-weight decode streams W once: prefetch the next register tile's
     * rows (the rows after these R) as far ahead as this tile has read. */
    const bool narrow = WT != MOE_DTYPE_F32;
    const int64_t esz = (int64_t)moe_dtype_size(WT);
    const char *pf = (const char *)w + R * ldw * esz;
    const int64_t pf_ld = ldw * esz;
    if (WT == MOE_DTYPE_BF16 && H) {
        /* 32 weights (a cache line) of every row a step, widened by halves
         * (x in bf16_halves_order, blocks of 32): a bf16 in the high half of
         * a 32-bit lane is that f32, so an AND gives the odd columns and a
         * shift the even ones, one op per 16 weights where bf16x16_to_f32
         * takes two, and those ops compete with the FMAs for the same two
         * ports. The next tile's rows are prefetched as far ahead as this
         * one has read, whatever T: the first token tile of a row group
         * reads it from memory. */
        const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000u);
        for (; k + 32 <= n_in; k += 32) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                _mm_prefetch(pf + r * pf_ld + (int64_t)k * esz, _MM_HINT_T1);
            __m512 xe[MK_T], xo[MK_T];
            load_x32(T, x, ldx, k, xe, xo);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512i v =
                    _mm512_loadu_si512((const void *)((const uint16_t *)w + r * ldw + k));
                const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, hi16));
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    acc[t][r] = _mm512_fmadd_ps(xe[t], we, acc[t][r]);
                    acc[t][r] = _mm512_fmadd_ps(xo[t], wo, acc[t][r]);
                }
            }
        }
    }
    if (WT == MOE_DTYPE_I8 && T <= 2 && split) {
        /* int8 decode: a whole cache line (64 weights) of every row per step,
         * into two accumulator sets. At 16 int8 weights per step too few
         * lines are in flight to reach the memory bandwidth. Not under
         * batch_invariant (`split` false): 3- and 4-token tiles sum in one
         * set. */
        __m512 acc2[MK_T][MK_R];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                acc2[t][r] = _mm512_setzero_ps();
        for (; k + 64 <= n_in; k += 64) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                _mm_prefetch(pf + r * pf_ld + k, _MM_HINT_T0);
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) {
                __m512 xv[MK_T];
#pragma GCC unroll 4
                for (int t = 0; t < T; t++)
                    xv[t] = _mm512_loadu_ps(x + t * ldx + k + 16 * u);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    __m512 wv = load_w16(WT, w, r * ldw + k + 16 * u);
#pragma GCC unroll 4
                    for (int t = 0; t < T; t++) {
                        if (u % 2)
                            acc2[t][r] = _mm512_fmadd_ps(xv[t], wv, acc2[t][r]);
                        else
                            acc[t][r] = _mm512_fmadd_ps(xv[t], wv, acc[t][r]);
                    }
                }
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                acc[t][r] = _mm512_add_ps(acc[t][r], acc2[t][r]);
    }
    for (; k + 16 <= n_in; k += 16) {
        __m512 xv[MK_T];
        if (narrow && T <= 2) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                _mm_prefetch(pf + r * pf_ld + (int64_t)k * esz, _MM_HINT_T0);
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            xv[t] = _mm512_loadu_ps(x + t * ldx + k);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m512 wv = load_w16(WT, w, r * ldw + k);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                acc[t][r] = _mm512_fmadd_ps(xv[t], wv, acc[t][r]);
        }
    }
    if (k < n_in) {
        __mmask16 m = (__mmask16)((1u << (n_in - k)) - 1u);
        __m512 xv[MK_T];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            xv[t] = _mm512_maskz_loadu_ps(m, x + t * ldx + k);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m512 wv = load_w16_mask(WT, w, r * ldw + k, m);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                acc[t][r] = _mm512_fmadd_ps(xv[t], wv, acc[t][r]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            out[t][r] = hsum512(acc[t][r]);
}

/* Dispatches to a register tile with compile-time T, R (MK_R or 1) and
 * weight type; `halves` and `split` as in mk_avx512 (H, split). */
AVX512_TARGET static void mk_avx512_any(int T, int R, enum moe_dtype wt, bool halves,
                                        const float *x, int64_t ldx, int n_in, const void *w,
                                        int64_t ldw, bool split, float out[MK_T][MK_R])
{
#define MK512_CASE(TT, RR)                                                                         \
    case (TT)*8 + (RR):                                                                            \
        mk_avx512(TT, RR, MOE_DTYPE_F32, false, x, ldx, n_in, w, ldw, split, out);                 \
        return;                                                                                    \
    case 64 + (TT)*8 + (RR):                                                                       \
        mk_avx512(TT, RR, MOE_DTYPE_BF16, false, x, ldx, n_in, w, ldw, split, out);                \
        return;                                                                                    \
    case 128 + (TT)*8 + (RR):                                                                      \
        mk_avx512(TT, RR, MOE_DTYPE_I8, false, x, ldx, n_in, w, ldw, split, out);                  \
        return;                                                                                    \
    case 192 + (TT)*8 + (RR):                                                                      \
        mk_avx512(TT, RR, MOE_DTYPE_BF16, true, x, ldx, n_in, w, ldw, split, out);                 \
        return;
    int kind = wt == MOE_DTYPE_BF16 ? (halves ? 192 : 64) : wt == MOE_DTYPE_I8 ? 128 : 0;
    switch (kind + T * 8 + R) {
        MK512_CASE(1, 4)
        MK512_CASE(2, 4)
        MK512_CASE(3, 4)
        MK512_CASE(4, 4)
        MK512_CASE(1, 1)
        MK512_CASE(2, 1)
        MK512_CASE(3, 1)
        MK512_CASE(4, 1)
    default: break;
    }
#undef MK512_CASE
    MOE_ASSERT(0 && "mk_avx512_any: unsupported tile");
}

/* I4: the 16 dequantized weights at columns [k, k + 16) of a row of codes
 * (k a multiple of 16), scale s: one run of a 32-column block. */
AVX512_TARGET static inline __attribute__((always_inline)) __m512 q4_load16(const uint8_t *row,
                                                                            int64_t k, __m512 s)
{
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k / 32 * 16)));
    v = k % 32 ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(0x0f));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(8))), s);
}

/* I4 decode tile: T tokens x R rows [o, o + R) of p's weights, one pass over
 * n_in in 32-column blocks: 16 bytes of codes per row widened to two f32
 * vectors, scaled by the block's group scale, and used by all T tokens. */
AVX512_TARGET static inline __attribute__((always_inline)) void
mk_q4_avx512(const int T, const int R, const struct moe_matmul_params *p, const float *x,
             int64_t ldx, int o, float out[MK_T][MK_R])
{
    __m512 acc[MK_T][MK_R], acc2[MK_T][MK_R];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[t][r] = acc2[t][r] = _mm512_setzero_ps();
    const uint8_t *rows[MK_R];
    const float *sc[MK_R];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        rows[r] = q4_row(p, o + r);
        sc[r] = q4_scales(p, o + r);
    }
    /* the next tile's rows, prefetched as far ahead as this one has read */
    const uint8_t *pf = q4_row(p, o + R);
    const int64_t ldb = p->ldw / 2;
    const int n_in = p->n_in, group = p->w_group;
    for (int k = 0; k < n_in; k += 32) {
        if (T <= 2 && k % 128 == 0) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)pf + r * ldb + k / 2, _MM_HINT_T0);
        }
        __m512 x0[MK_T], x1[MK_T];
        load_x32(T, x, ldx, k, x0, x1);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m512 s = _mm512_set1_ps(sc[r][k / group]);
            const __m512 w0 = q4_load16(rows[r], k, s), w1 = q4_load16(rows[r], k + 16, s);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                acc[t][r] = _mm512_fmadd_ps(x0[t], w0, acc[t][r]);
                acc2[t][r] = _mm512_fmadd_ps(x1[t], w1, acc2[t][r]);
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            out[t][r] = hsum512(_mm512_add_ps(acc[t][r], acc2[t][r]));
}

AVX512_TARGET static void mk_q4_avx512_any(int T, int R, const struct moe_matmul_params *p,
                                           const float *x, int64_t ldx, int o,
                                           float out[MK_T][MK_R])
{
#define MKQ4_CASE(TT, RR)                                                                          \
    case (TT)*8 + (RR): mk_q4_avx512(TT, RR, p, x, ldx, o, out); return;
    switch (T * 8 + R) {
        MKQ4_CASE(1, 4)
        MKQ4_CASE(2, 4)
        MKQ4_CASE(3, 4)
        MKQ4_CASE(4, 4)
        MKQ4_CASE(1, 1)
        MKQ4_CASE(2, 1)
        MKQ4_CASE(3, 1)
        MKQ4_CASE(4, 1)
    default: break;
    }
#undef MKQ4_CASE
    MOE_ASSERT(0 && "mk_q4_avx512_any: unsupported tile");
}

/* A T x R tile at rows [o, o + R) of any weight type. */
/* T tokens from token t, R rows from o: x is the call's own, or with xh
 * (bf16 weights, mm_prepare) the same rows in bf16_halves_order. */
AVX512_TARGET static void mk_tile_avx512(int T, int R, const struct moe_matmul_params *p,
                                         const float *xh, int t, int o, float out[MK_T][MK_R])
{
    const float *x = (xh ? xh : p->x) + (size_t)t * p->n_in;
    if (p->w_dtype == MOE_DTYPE_I4)
        mk_q4_avx512_any(T, R, p, x, p->n_in, o, out);
    else
        mk_avx512_any(T, R, p->w_dtype, xh != NULL, x, p->n_in, p->n_in,
                      w_at(p->w_dtype, p->w, o * p->ldw), p->ldw, !p->batch_invariant, out);
}

/* Columns [k, k + kk) (kk <= 16) of rows [o, o + rr) (rr <= 16) widened to
 * f32 (int8 unscaled), v[i] for row o + i; zero past kk and for i >= rr.
 * The packers' load, before their transposes. */
AVX512_TARGET static inline __attribute__((always_inline)) void
load_rows16(const struct moe_matmul_params *p, int o, int rr, int k, int kk, __m512 v[16])
{
    const enum moe_dtype wt = p->w_dtype;
    const __mmask16 m = (__mmask16)((1u << kk) - 1u);
    for (int i = 0; i < 16; i++) {
        if (i >= rr) {
            v[i] = _mm512_setzero_ps();
            continue;
        }
        const int64_t at = (int64_t)(o + i) * p->ldw + k;
        v[i] = wt == MOE_DTYPE_BF16 ? (kk == 16 ? load_w16(MOE_DTYPE_BF16, p->w, at)
                                                : load_w16_mask(MOE_DTYPE_BF16, p->w, at, m))
               : wt == MOE_DTYPE_I8 ? (kk == 16 ? load_w16(MOE_DTYPE_I8, p->w, at)
                                                : load_w16_mask(MOE_DTYPE_I8, p->w, at, m))
                                    : (kk == 16 ? load_w16(MOE_DTYPE_F32, p->w, at)
                                                : load_w16_mask(MOE_DTYPE_F32, p->w, at, m));
    }
}

/* Prefill path: W rows [o, o+R) (R <= PK_R) are packed k-major into `panel`
 * (n_in, PK_R), widened to f32 (int8 dequantized), zero-padded; then each
 * register tile of PK_T tokens x PK_R outputs broadcasts one x element per
 * token and k against two weight vectors: 16 FMAs per 2 weight loads + 8
 * broadcasts, and no horizontal sums. */
/* One panel: rows [o, o + R) (R <= PK_R) as f32 (int8 rows scaled), k-major:
 * panel[k * PK_R + r]. Blocks of 16 rows x 16 columns are converted and
 * transposed in registers; rows past R are zero. */
AVX512_TARGET static void pack_panel_avx512(const struct moe_matmul_params *p, int o, int R,
                                            float *panel)
{
    const int n_in = p->n_in;
    const enum moe_dtype wt = p->w_dtype;
    if (R <= PK_R - 16) /* the upper half is never written below */
        for (int k = 0; k < n_in; k++)
            _mm512_storeu_ps(panel + (size_t)k * PK_R + 16, _mm512_setzero_ps());
    for (int r0 = 0; r0 < R; r0 += 16) {
        const int rr = R - r0 < 16 ? R - r0 : 16;
        float sc[16];
        for (int i = 0; i < 16; i++)
            sc[i] = i >= rr ? 0.0f : wt == MOE_DTYPE_I8 ? p->w_scale[o + r0 + i] : 1.0f;
        if (wt == MOE_DTYPE_I4) { /* n_in is a multiple of 32: no partial vector */
            for (int k = 0; k < n_in; k += 16) {
                __m512 v[16];
                for (int i = 0; i < 16; i++)
                    v[i] =
                        i >= rr
                            ? _mm512_setzero_ps()
                            : q4_load16(q4_row(p, o + r0 + i), k,
                                        _mm512_set1_ps(q4_scales(p, o + r0 + i)[k / p->w_group]));
                transpose16_avx512(v);
                for (int j = 0; j < 16; j++)
                    _mm512_storeu_ps(panel + (size_t)(k + j) * PK_R + r0, v[j]);
            }
            continue;
        }
        for (int k = 0; k < n_in; k += 16) {
            const int kk = n_in - k < 16 ? n_in - k : 16;
            __m512 v[16];
            load_rows16(p, o + r0, rr, k, kk, v);
            for (int i = 0; i < rr; i++)
                v[i] = _mm512_mul_ps(v[i], _mm512_set1_ps(sc[i]));
            transpose16_avx512(v);
            for (int j = 0; j < kk; j++)
                _mm512_storeu_ps(panel + (size_t)(k + j) * PK_R + r0, v[j]);
        }
    }
}

AVX512_TARGET static void mk_packed_avx512(const float *x, int n_in, const float *panel, float *y,
                                           int64_t ldy, __mmask16 m0, __mmask16 m1, bool accumulate)
{
    __m512 acc[PK_T][2];
#pragma GCC unroll 8
    for (int t = 0; t < PK_T; t++) {
        acc[t][0] = _mm512_setzero_ps();
        acc[t][1] = _mm512_setzero_ps();
    }
    for (int k = 0; k < n_in; k++) {
        __m512 w0 = _mm512_loadu_ps(panel + (size_t)k * PK_R);
        __m512 w1 = _mm512_loadu_ps(panel + (size_t)k * PK_R + 16);
#pragma GCC unroll 8
        for (int t = 0; t < PK_T; t++) {
            __m512 xb = _mm512_set1_ps(x[(size_t)t * n_in + k]);
            acc[t][0] = _mm512_fmadd_ps(xb, w0, acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(xb, w1, acc[t][1]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < PK_T; t++) {
        float *yt = y + t * ldy;
        if (accumulate) {
            acc[t][0] = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, yt), acc[t][0]);
            acc[t][1] = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, yt + 16), acc[t][1]);
        }
        _mm512_mask_storeu_ps(yt, m0, acc[t][0]);
        _mm512_mask_storeu_ps(yt + 16, m1, acc[t][1]);
    }
}

/* The task's tokens against rows [o, o + R) (R <= PK_R) in one f32 panel. */
AVX512_TARGET static void tile_packed_rows_avx512(const struct mm_tile *mt, int o, int R)
{
    const struct moe_matmul_params *p = mt->p;
    const int n_in = p->n_in;
    const int t_end = mt->t0 + mt->nt;
    float out[MK_T][MK_R];
    pack_panel_avx512(p, o, R, mt->scratch);
    __mmask16 m0 = R >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << R) - 1u);
    __mmask16 m1 = R >= 32  ? (__mmask16)0xffff
                   : R > 16 ? (__mmask16)((1u << (R - 16)) - 1u)
                            : (__mmask16)0;
    int t = mt->t0;
    for (; t + PK_T <= t_end; t += PK_T)
        mk_packed_avx512(p->x + (size_t)t * n_in, n_in, mt->scratch,
                         p->y + (size_t)t * p->n_out + o, p->n_out, m0, m1, p->accumulate);
    /* Leftover tokens (< PK_T): dot-product tiles on the original rows. */
    for (; t < t_end; t += MK_T) {
        int T = t_end - t < MK_T ? t_end - t : MK_T;
        for (int oo = o; oo < o + R;) {
            int RR = o + R - oo >= MK_R ? MK_R : 1;
            mk_tile_avx512(T, RR, p, NULL, t, oo, out);
            store_tile(p, t, T, oo, RR, 1, raw_scales(p, oo), out);
            oo += RR;
        }
    }
}

AVX512_TARGET static void tile_avx512_packed(const struct mm_tile *mt)
{
    const int o_end = mt->o0 + mt->no;
    for (int o = mt->o0; o < o_end; o += PK_R)
        tile_packed_rows_avx512(mt, o, o_end - o < PK_R ? o_end - o : PK_R);
}

/* ---- fp16 packed panels (bf16 weights, fast mode, AVX512-FP16) ----
 * Where the processor has AVX512-FP16 but no fast bf16 dot product (Intel
 * without AMX: vdpbf16ps issues at a quarter of an FMA's rate there),
 * fast-mode bf16 calls of PH_MIN_TOK tokens and more take these panels
 * instead of the f32 ones: register tiles of vfmadd231ph, 32 multiply-adds
 * an instruction at the f32 FMA's rate. The arithmetic is the fp16
 * streaming tiles' (matmul_dot.c): each token's row scaled by a power of two
 * to |x| <= 1 and rounded to fp16 (11 significant bits, where the
 * dot-product paths keep 8), the weights x 2^CPU_PH_STREAM_W_SHIFT taken to
 * fp16 by a re-bias of their exponent (exact from 2^-(14 + shift); below,
 * flushed), both scales undone once at the end.
 *
 * A panel holds PH_R weight rows in column pairs: for each pair of columns
 * (2j, 2j + 1) the rows' two weights side by side, so a vector is 16 rows x
 * 2 columns and a token's two activations broadcast as one dword. Lane 2r +
 * c sums the products of row r's columns of parity c: PH_SEG of them in
 * fp16, then added in f32; the two parities are added at the end. Packing
 * is then a transpose of dwords (the f32 transposes' shuffles), and the
 * conversion runs on 32 weights a vector in 16-bit lanes. A panel whose
 * weights reach PH_MAX_W (a lane's fp16 sum could then near fp16's range)
 * takes the f32 panels. gcc only: clang 14 does not take the intrinsics
 * under a target attribute (as attention_tiled.c). */
#define MM_PH MOE_HAVE_FP16

#if MM_PH
#define PH_TARGET MOE_FP16_TARGET
#define PH_R 32 /* weight rows per fp16 panel (2 vectors of 16 rows x 2 columns) */
#define PH_T 12 /* tokens per register tile: 24 accumulators */
#define PH_SEG CPU_PH_SEG
#define PH_MAX_W CPU_PH_PANEL_MAX_W
#define PH_MIN_TOK CPU_PH_MIN_TOK
/* the largest sum a lane reaches in fp16: PH_SEG products of |x'| <= 1 and
 * |w'| < PH_MAX_W 2^shift */
#define PH_LANE_MAX ((float)PH_SEG * PH_MAX_W * (float)(1 << CPU_PH_STREAM_W_SHIFT))
_Static_assert(PH_LANE_MAX <= 32768.0f, "a lane's fp16 sum stays below half of fp16's range");

/* Token row x (n_in) as fp16 of x / 2^e with 2^e the least power of two
 * above max |x|, zero-padded to an even length (xh: (n_in + 1) / 2 dwords);
 * returns the output's scale, 2^(e - shift) (2^-shift for a zero row). */
PH_TARGET static float ph_act_row(const float *x, int n_in, uint16_t *xh)
{
    const int e = fp16_row_exp(x, n_in);
    const __m512 inv = _mm512_set1_ps(ldexpf(1.0f, -e)); /* exact */
    for (int k = 0; k < n_in; k += 16) {
        const int kk = n_in - k < 16 ? n_in - k : 16;
        const __mmask16 m16 = (__mmask16)((1u << kk) - 1u);
        _mm256_mask_storeu_epi16(xh + k, m16, fp16_scaled16(x + k, m16, inv));
    }
    if (n_in % 2)
        xh[n_in] = 0;
    return ldexpf(1.0f, e - CPU_PH_STREAM_W_SHIFT);
}

/* Rows [o, o + R) (R <= PH_R) of bf16 W, x 2^shift as fp16, in column pairs:
 * panel[(j * PH_R + r) * 2 + c] = w'[o + r][2j + c], zero past R and past
 * n_in. False (panel unusable) where a weight's magnitude reaches PH_MAX_W. */
PH_TARGET static bool pack_panel_ph(const struct moe_matmul_params *p, int o, int R,
                                    uint16_t *panel)
{
    const int n_in = p->n_in;
    const uint16_t *w = p->w;
    const __m512i abs_bits = _mm512_set1_epi16(0x7fff);
    __m512i mx = _mm512_setzero_si512();
    for (int r0 = 0; r0 < PH_R; r0 += 16) {
        for (int k = 0; k < n_in; k += 32) {
            const int kk = n_in - k < 32 ? n_in - k : 32;
            const __mmask32 m = kk == 32 ? ~(__mmask32)0 : (__mmask32)((1u << kk) - 1u);
            __m512 v[16];
            for (int i = 0; i < 16; i++) {
                if (r0 + i >= R) {
                    v[i] = _mm512_setzero_ps();
                    continue;
                }
                const __m512i wv =
                    _mm512_maskz_loadu_epi16(m, w + (size_t)(o + r0 + i) * p->ldw + k);
                const __m512i mag = _mm512_and_si512(wv, abs_bits);
                mx = _mm512_max_epu16(mx, mag);
                v[i] = _mm512_castph_ps(fp16_from_bf16_scaled(wv, mag, CPU_PH_STREAM_W_SHIFT));
            }
            transpose16_avx512(v); /* v[j]: column pair k / 2 + j of the 16 rows */
            for (int j = 0; j < (kk + 1) / 2; j++)
                _mm512_storeu_ps(panel + ((size_t)(k / 2 + j) * PH_R + r0) * 2, v[j]);
        }
    }
    /* bf16 bits of PH_MAX_W: a power of two, so |w| >= PH_MAX_W is mag >= them */
    const uint16_t big = moe_f32_to_bf16(PH_MAX_W);
    return _mm512_cmpge_epu16_mask(mx, _mm512_set1_epi16((short)big)) == 0;
}

/* The next panel's weights, fetched towards L2 a few lines at a time while
 * the current one computes: packing otherwise waits on memory (a weight
 * load stalled ~11% of the panels' time in a 4096-token prefill). */
struct ph_prefetch {
    const char *row;  /* the row being fetched */
    size_t ld;        /* bytes from row to row */
    int rows_left;    /* rows after this one */
    int line, n_line; /* next line in the row, lines a row */
};

/* Rows [o, o + R) of p's bf16 weights; none where R <= 0. */
static inline void ph_prefetch_init(struct ph_prefetch *pf, const struct moe_matmul_params *p,
                                    int o, int R)
{
    *pf = (struct ph_prefetch){0};
    if (R <= 0)
        return; /* line == n_line == 0: nothing to fetch */
    pf->row = (const char *)((const uint16_t *)p->w + (size_t)o * p->ldw);
    pf->ld = (size_t)p->ldw * sizeof(uint16_t);
    pf->rows_left = R - 1;
    pf->n_line = (int)(((size_t)p->n_in * sizeof(uint16_t) + 63) / 64);
}

static inline __attribute__((always_inline)) void ph_prefetch_some(struct ph_prefetch *pf, int n)
{
    for (; n > 0 && pf->line < pf->n_line; n--) {
        _mm_prefetch(pf->row + (size_t)pf->line * 64, _MM_HINT_T1);
        if (++pf->line == pf->n_line && pf->rows_left > 0) {
            pf->row += pf->ld;
            pf->rows_left--;
            pf->line = 0;
        }
    }
}

/* sum[t][2 r + c] (f32) = row r's products of parity c over the panel for
 * T tokens (xp: dword j of a token is its columns 2j, 2j + 1; ldx dwords
 * apart): fp16 register tiles, PH_SEG column pairs at a time. */
PH_TARGET static inline __attribute__((always_inline)) void
mk_packed_ph(const int T, const uint32_t *xp, size_t ldx, int n_pairs, const uint16_t *panel,
             struct ph_prefetch *pf, int pf_per_seg, float sum[PH_T][2 * PH_R])
{
#pragma GCC unroll 12
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int r = 0; r < 2 * PH_R; r += 16)
            _mm512_storeu_ps(sum[t] + r, _mm512_setzero_ps());
    for (int j0 = 0; j0 < n_pairs; j0 += PH_SEG) {
        const int j1 = n_pairs - j0 > PH_SEG ? j0 + PH_SEG : n_pairs;
        __m512h acc[PH_T][2];
#pragma GCC unroll 12
        for (int t = 0; t < T; t++)
            acc[t][0] = acc[t][1] = _mm512_setzero_ph();
        ph_prefetch_some(pf, pf_per_seg);
        for (int j = j0; j < j1; j++) {
            const __m512h w0 = _mm512_castsi512_ph(
                _mm512_loadu_si512((const void *)(panel + (size_t)j * 2 * PH_R)));
            const __m512h w1 = _mm512_castsi512_ph(
                _mm512_loadu_si512((const void *)(panel + (size_t)j * 2 * PH_R + 32)));
#pragma GCC unroll 12
            for (int t = 0; t < T; t++) {
                const __m512h xb = _mm512_castsi512_ph(_mm512_set1_epi32((int)xp[t * ldx + j]));
                acc[t][0] = _mm512_fmadd_ph(xb, w0, acc[t][0]);
                acc[t][1] = _mm512_fmadd_ph(xb, w1, acc[t][1]);
            }
        }
#pragma GCC unroll 12
        for (int t = 0; t < T; t++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m512 lo, hi;
                fp16_to_f32x2(acc[t][h], &lo, &hi);
                float *s = sum[t] + 32 * h;
                _mm512_storeu_ps(s, _mm512_add_ps(_mm512_loadu_ps(s), lo));
                _mm512_storeu_ps(s + 16, _mm512_add_ps(_mm512_loadu_ps(s + 16), hi));
            }
    }
}

/* A task holds PH_MIN_TOK tokens or more (mm_prepare's token blocks), so its
 * nearly equal tiles hold 9-12 (37 tokens: 10, 9, 9, 9); the smaller sizes
 * are there for any caller that gives fewer. */
PH_TARGET static void mk_packed_ph_any(int T, const uint32_t *xp, size_t ldx, int n_pairs,
                                       const uint16_t *panel, struct ph_prefetch *pf,
                                       int pf_per_seg, float sum[PH_T][2 * PH_R])
{
    switch (T) {
#define PH_CASE(n)                                                                                 \
    case n: mk_packed_ph(n, xp, ldx, n_pairs, panel, pf, pf_per_seg, sum); return;
        PH_CASE(1)
        PH_CASE(2)
        PH_CASE(3)
        PH_CASE(4)
        PH_CASE(5)
        PH_CASE(6)
        PH_CASE(7)
        PH_CASE(8)
        PH_CASE(9)
        PH_CASE(10)
        PH_CASE(11)
        PH_CASE(12)
#undef PH_CASE
    default: break;
    }
    MOE_ASSERT(0 && "mk_packed_ph_any: unsupported tile");
}

/* The task's rows in fp16 panels of PH_R; a panel pack_panel_ph refuses
 * takes the f32 panels (tile_packed_rows_avx512). */
PH_TARGET static void tile_avx512_packed_ph(const struct mm_tile *mt)
{
    const struct moe_matmul_params *p = mt->p;
    const int n_pairs = (p->n_in + 1) / 2, o_end = mt->o0 + mt->no;
    uint16_t *panel = (uint16_t *)mt->scratch;
    float sum[PH_T][2 * PH_R];
    /* lanes 2r + c of two vectors: the even ones (c = 0), the odd ones */
    const __m512i even =
        _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    /* the task's tokens in tiles of nearly equal size (at most PH_T), where
     * cutting whole tiles off first would leave tiles of 1-8 */
    const int n_tiles = (mt->nt + PH_T - 1) / PH_T;
    /* the next panel's lines spread over this one's fp16 segments */
    const int n_seg = n_tiles * ((n_pairs + PH_SEG - 1) / PH_SEG);
    for (int o = mt->o0; o < o_end; o += PH_R) {
        const int R = o_end - o < PH_R ? o_end - o : PH_R;
        if (!pack_panel_ph(p, o, R, panel)) {
            tile_packed_rows_avx512(mt, o, R);
            continue;
        }
        const int R_next = o_end - (o + PH_R) < PH_R ? o_end - (o + PH_R) : PH_R;
        struct ph_prefetch pf;
        ph_prefetch_init(&pf, p, o + PH_R, R_next);
        const int pf_per_seg = R_next > 0 ? (R_next * pf.n_line + n_seg - 1) / n_seg : 0;
        for (int i = 0, t = mt->t0; i < n_tiles; i++) {
            const int T = mt->nt / n_tiles + (i < mt->nt % n_tiles);
            mk_packed_ph_any(T, mt->xph + (size_t)t * n_pairs, (size_t)n_pairs, n_pairs, panel, &pf,
                             pf_per_seg, sum);
            for (int tt = 0; tt < T; tt++) {
                const __m512 s = _mm512_set1_ps(mt->xs[t + tt]);
                float *y = p->y + (size_t)(t + tt) * p->n_out + o;
                for (int r = 0; r < R; r += 16) {
                    const __mmask16 m =
                        R - r >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (R - r)) - 1u);
                    const __m512 a = _mm512_loadu_ps(sum[tt] + 2 * r),
                                 b = _mm512_loadu_ps(sum[tt] + 2 * r + 16);
                    __m512 v = _mm512_mul_ps(_mm512_add_ps(_mm512_permutex2var_ps(a, even, b),
                                                           _mm512_permutex2var_ps(a, odd, b)),
                                             s);
                    if (p->accumulate)
                        v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, y + r), v);
                    _mm512_mask_storeu_ps(y + r, m, v);
                }
            }
            t += T;
        }
    }
}
#else
#define PH_R PK_R
#define PH_MIN_TOK PK_MIN_TOK
#endif /* MM_PH */

AVX512_TARGET static void tile_avx512(const struct mm_tile *mt)
{
    if (mt->packed) {
#if MM_PH
        if (mt->xph) {
            tile_avx512_packed_ph(mt);
            return;
        }
#endif
        tile_avx512_packed(mt);
        return;
    }
    const struct moe_matmul_params *p = mt->p;
    /* Narrow rows are read as they are by every 4-token tile: a 4-row tile
     * of bf16 / int8 stays in L1, and converting it again per tile is cheaper
     * than widening it to f32 scratch first (measured: widening made
     * 16-sequence decode 13% (bf16) / 22% (int8) slower, 64-token prefill
     * 20% slower, and won nowhere below the packed path). */
    float out[MK_T][MK_R];
    int o = mt->o0;
    const int o_end = mt->o0 + mt->no;
    while (o < o_end) {
        int R = o_end - o >= MK_R ? MK_R : 1;
        const float *sc = raw_scales(p, o);
        for (int t = mt->t0; t < mt->t0 + mt->nt; t += MK_T) {
            int T = mt->t0 + mt->nt - t < MK_T ? mt->t0 + mt->nt - t : MK_T;
            mk_tile_avx512(T, R, p, mt->xh, t, o, out);
            store_tile(p, t, T, o, R, 1, sc, out);
        }
        o += R;
    }
}

/* ---- AVX2 path ---- */

#define AVX2_TARGET MOE_AVX2_TARGET

/* 8 weights from element i of w as f32 (int8 unscaled). */
AVX2_TARGET static inline __attribute__((always_inline)) __m256 load_w8(const enum moe_dtype WT,
                                                                        const void *w, int64_t i)
{
    if (WT == MOE_DTYPE_BF16)
        return bf16x8_to_f32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    if (WT == MOE_DTYPE_I8) {
        __m128i q = _mm_loadl_epi64((const __m128i *)((const int8_t *)w + i));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    }
    return _mm256_loadu_ps((const float *)w + i);
}

/* The sum of v's lanes as ((v0+v4) + (v2+v6)) + ((v1+v5) + (v3+v7)). */
AVX2_TARGET static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* hsum256 of four vectors at once, each summed in hsum256's order (float
 * addition commutes exactly, so the swapped pairs below give its bits): a
 * row's outputs do not depend on whether it was in a tile of 4 or of 1. */
AVX2_TARGET static inline __attribute__((always_inline)) __m128 hsum256_x4(const __m256 v[4])
{
    /* [v0 lo + v0 hi | v1 lo + v1 hi], the same for v2, v3 */
    __m256 a = _mm256_add_ps(_mm256_permute2f128_ps(v[0], v[1], 0x20),
                             _mm256_permute2f128_ps(v[0], v[1], 0x31));
    __m256 b = _mm256_add_ps(_mm256_permute2f128_ps(v[2], v[3], 0x20),
                             _mm256_permute2f128_ps(v[2], v[3], 0x31));
    /* per 128-bit lane [e0 e1 e2 e3]: (e0+e2) + (e1+e3) in every element */
    a = _mm256_add_ps(a, _mm256_permute_ps(a, 0x4e));
    b = _mm256_add_ps(b, _mm256_permute_ps(b, 0x4e));
    a = _mm256_add_ps(a, _mm256_permute_ps(a, 0xb1));
    b = _mm256_add_ps(b, _mm256_permute_ps(b, 0xb1));
    /* [a0 a0 b0 b0 | a4 a4 b4 b4] -> [a0 a4 b0 b4] = the four sums */
    __m256 z = _mm256_shuffle_ps(a, b, 0x00);
    return _mm_blend_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1), 0xa);
}

/* The rows of a task's 4-row tile i on the AVX2 tiles: o, o + step, o + 2
 * step, o + 3 step; the next tile's first row is `next` rows on. A task of
 * few tokens (decode) reads its rows as four streams a quarter of it apart
 * (tile i: rows o0 + i + r q, q = no / 4), as the AVX-512 streaming tiles
 * do: a core keeps more reads in flight over four sequential streams than
 * over one (bench-kernels --fast, Zen 3, one token, 2 threads: int8
 * 21 -> 34 GB/s, bf16 25 -> 35). A task of many tokens (prefill) reads
 * its tiles' rows from L1 again for every token tile, and rows a power of
 * two apart share L1 sets: there the four rows are consecutive (int8
 * prefill of 512 was 10% slower on the streams). Either way a row's sums
 * are the same: the order of the rows does not change a bit. */
#define STREAM_MAX_TOK 16

/* bf16 calls of this many tokens on (not under batch_invariant: the sums
 * run in another order) widen their rows by halves below the packed path:
 * on AVX2 (mk_avx2) in 2-token tiles, where below it the 3-token tiles
 * widening 8 weights at a time are faster (bench-kernels --fast bf16, Zen 3,
 * 2 threads: 2-3 tokens 5-10% slower by halves, 4 tokens 15-20% faster, 6-16
 * 5-10%); on AVX-512 (mk_avx512) in the same 4-token tiles (Emerald Rapids,
 * exact calls, alternated in one process, weights from memory: 4-16 tokens
 * 1.1-1.7x; bench-kernels --fast bf16, weights in cache: 32-64 tokens 90 ->
 * 106-109 GFLOP/s a core). */
#define BF16_HALVES_MIN_TOK 4

struct tile_rows {
    int o, step, next;
};

/* `streams`: the caller's kind of tile may take the four streams. */
static inline struct tile_rows tile_rows(const struct mm_tile *mt, int i, bool streams)
{
    if (streams && mt->nt <= STREAM_MAX_TOK)
        return (struct tile_rows){.o = mt->o0 + i, .step = mt->no / MK_R, .next = 1};
    return (struct tile_rows){.o = mt->o0 + MK_R * i, .step = 1, .next = MK_R};
}

AVX2_TARGET static inline __attribute__((always_inline)) void
mk_avx2(const int T, const int R, const enum moe_dtype WT, const bool H, const float *x,
        int64_t ldx, int n_in, const void *w, int64_t ldw, int64_t pf_off, bool split,
        float out[MK_T][MK_R])
{
    __m256 acc[MK_T_AVX2][MK_R];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[t][r] = _mm256_setzero_ps();
    int k = 0;
    if (WT != MOE_DTYPE_F32) {
        /* Narrow-weight tiles (every T: the 3-token tiles of a busy expert
         * read its rows from memory first, before the 1- and 2-token tiles
         * did) stream W once: a cache line of every row per
         * step (32 bf16 / 64 int8 weights), the next tile's rows prefetched
         * into L2 (T1: into L1 (T0) one sequence decoded 6-8% slower on a
         * Zen 3) as far ahead as this one has read, and for one token a second
         * accumulator set so the FMA chains do not wait on each other
         * (unless `split` is false, under batch_invariant: then one token
         * sums in the order two do). */
        const int64_t esz = (int64_t)moe_dtype_size(WT), line = 64 / esz;
        const char *pf = (const char *)w + pf_off * esz;
        __m256 acc2[MK_T_AVX2][MK_R];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                acc2[t][r] = _mm256_setzero_ps();
        for (; k + line <= n_in; k += line) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                _mm_prefetch(pf + (r * ldw + k) * esz, _MM_HINT_T1);
            if (WT == MOE_DTYPE_BF16 && H) {
                /* 16 weights a load, widened by halves (x in
                 * bf16_halves_order): a bf16 in the high half of a 32-bit
                 * lane is that f32, so an AND gives the odd columns and a
                 * shift the even ones, one op per 8 weights where
                 * bf16x8_to_f32 takes two (bench-kernels --peak, Zen 3:
                 * 33 -> 43 GMAC/s a core) */
                const __m256i hi16 = _mm256_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 2
                for (int u = 0; u < 2; u++) {
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) {
                        const __m256i v = _mm256_loadu_si256(
                            (const __m256i *)((const uint16_t *)w + r * ldw + k + 16 * u));
                        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi16));
                        const float *xk = x + k + 16 * u;
#pragma GCC unroll 4
                        for (int t = 0; t < T; t++) {
                            const __m256 xe = _mm256_loadu_ps(xk + t * ldx);
                            const __m256 xo = _mm256_loadu_ps(xk + t * ldx + 8);
                            acc[t][r] = _mm256_fmadd_ps(xe, we, acc[t][r]);
                            if (T == 1 && split) /* the odd columns' own chain */
                                acc2[t][r] = _mm256_fmadd_ps(xo, wo, acc2[t][r]);
                            else
                                acc[t][r] = _mm256_fmadd_ps(xo, wo, acc[t][r]);
                        }
                    }
                }
                continue;
            }
#pragma GCC unroll 8
            for (int u = 0; u < line / 8; u++) {
                __m256 xv[MK_T_AVX2];
#pragma GCC unroll 4
                for (int t = 0; t < T; t++)
                    xv[t] = _mm256_loadu_ps(x + t * ldx + k + 8 * u);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    __m256 wv = load_w8(WT, w, r * ldw + k + 8 * u);
#pragma GCC unroll 4
                    for (int t = 0; t < T; t++) {
                        if (T == 1 && split && u % 2)
                            acc2[t][r] = _mm256_fmadd_ps(xv[t], wv, acc2[t][r]);
                        else
                            acc[t][r] = _mm256_fmadd_ps(xv[t], wv, acc[t][r]);
                    }
                }
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                acc[t][r] = _mm256_add_ps(acc[t][r], acc2[t][r]);
    }
    for (; k + 8 <= n_in; k += 8) {
        __m256 xv[MK_T_AVX2];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            xv[t] = _mm256_loadu_ps(x + t * ldx + k);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m256 wv = load_w8(WT, w, r * ldw + k);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                acc[t][r] = _mm256_fmadd_ps(xv[t], wv, acc[t][r]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
        if (R == MK_R)
            _mm_storeu_ps(out[t], hsum256_x4(acc[t]));
        else
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                out[t][r] = hsum256(acc[t][r]);
    }
    if (k < n_in)
        for (int t = 0; t < T; t++)
            for (int r = 0; r < R; r++)
                for (int kk = k; kk < n_in; kk++)
                    out[t][r] += x[t * ldx + kk] * w_elem(WT, w, r * ldw + kk);
}

/* `halves`: bf16 rows widened by halves, x in bf16_halves_order (2-token tiles at most). */
AVX2_TARGET static void mk_avx2_any(int T, int R, enum moe_dtype wt, bool halves, const float *x,
                                    int64_t ldx, int n_in, const void *w, int64_t ldw,
                                    int64_t pf_off, bool split, float out[MK_T][MK_R])
{
#define MK256_CASE(TT, RR)                                                                         \
    case (TT)*8 + (RR):                                                                            \
        mk_avx2(TT, RR, MOE_DTYPE_F32, false, x, ldx, n_in, w, ldw, pf_off, split, out);           \
        return;                                                                                    \
    case 64 + (TT)*8 + (RR):                                                                       \
        mk_avx2(TT, RR, MOE_DTYPE_BF16, false, x, ldx, n_in, w, ldw, pf_off, split, out);          \
        return;                                                                                    \
    case 128 + (TT)*8 + (RR):                                                                      \
        mk_avx2(TT, RR, MOE_DTYPE_I8, false, x, ldx, n_in, w, ldw, pf_off, split, out);            \
        return;
#define MK256_HALVES(TT, RR)                                                                       \
    case 192 + (TT)*8 + (RR):                                                                      \
        mk_avx2(TT, RR, MOE_DTYPE_BF16, true, x, ldx, n_in, w, ldw, pf_off, split, out);           \
        return;
    int kind = wt == MOE_DTYPE_BF16 ? (halves ? 192 : 64) : wt == MOE_DTYPE_I8 ? 128 : 0;
    switch (kind + T * 8 + R) {
        MK256_CASE(1, 4)
        MK256_CASE(2, 4)
        MK256_CASE(3, 4)
        MK256_CASE(1, 1)
        MK256_CASE(2, 1)
        MK256_CASE(3, 1)
        MK256_HALVES(1, 4)
        MK256_HALVES(2, 4)
        MK256_HALVES(1, 1)
        MK256_HALVES(2, 1)
    default: break;
    }
#undef MK256_HALVES
#undef MK256_CASE
    MOE_ASSERT(0 && "mk_avx2_any: unsupported tile");
}

/* AVX2 prefill path, the AVX-512 packed path's shape on 8 lanes: W rows
 * [o, o + R) (R <= PK2_R) widened to f32 (int8 and int4 dequantized) and
 * packed k-major into a panel (n_in, PK2_R) through 8 x 8 in-register
 * transposes; then each register tile of up to PK2_T tokens x PK2_R
 * outputs broadcasts one x element per token and k against the panel's two
 * vectors: 12 FMAs per 2 weight loads + 6 broadcasts, no horizontal sums,
 * one accumulator per output (k ascending). */

/* In-register transpose of an 8 x 8 f32 block: v[i] lane j <-> v[j] lane i. */
AVX2_TARGET static inline __attribute__((always_inline)) void transpose8_avx2(__m256 v[8])
{
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int c = 0; c < 4; c++) {
        v[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
        v[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
}

/* Columns [k, k + 8) of row o as f32 (int8 times its row scale; not I4:
 * q4_row8_avx2). */
AVX2_TARGET static inline __attribute__((always_inline)) __m256
row8_avx2(const struct moe_matmul_params *p, int o, int k)
{
    switch (p->w_dtype) {
    case MOE_DTYPE_BF16: return load_w8(MOE_DTYPE_BF16, p->w, (int64_t)o * p->ldw + k);
    case MOE_DTYPE_I8:
        return _mm256_mul_ps(load_w8(MOE_DTYPE_I8, p->w, (int64_t)o * p->ldw + k),
                             _mm256_set1_ps(p->w_scale[o]));
    default: return _mm256_loadu_ps((const float *)p->w + (int64_t)o * p->ldw + k);
    }
}

/* I4: columns [k, k + 8) of the codes `row` (k a multiple of 8) dequantized,
 * (u - 8) * s. Column j of a 32-column block is byte j % 16 of the block's
 * 16, its low nibble below 16. The callers find the row and its group scale
 * once (q4_row and q4_scales divide), not per 8 columns. */
AVX2_TARGET static inline __attribute__((always_inline)) __m256 q4_row8_avx2(const uint8_t *row,
                                                                             int k, __m256 s)
{
    const int b = k % MOE_Q4_BLOCK;
    __m256i u = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64((const __m128i *)(row + k / MOE_Q4_BLOCK * 16 + b % 16)));
    u = b >= 16 ? _mm256_srli_epi32(u, 4) : _mm256_and_si256(u, _mm256_set1_epi32(0x0f));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u, _mm256_set1_epi32(8))), s);
}

/* One panel: rows [o, o + R) as f32, panel[k * PK2_R + r]; rows past R are
 * zero. */
AVX2_TARGET static void pack_panel_avx2(const struct moe_matmul_params *p, int o, int R,
                                        float *panel)
{
    const int n_in = p->n_in, k8 = n_in / 8 * 8;
    const bool i4 = p->w_dtype == MOE_DTYPE_I4;
    for (int r0 = 0; r0 < PK2_R; r0 += 8) {
        const int rr = R - r0 <= 0 ? 0 : R - r0 < 8 ? R - r0 : 8;
        const uint8_t *q4r[8];
        const float *q4s[8];
        for (int i = 0; i < rr && i4; i++) {
            q4r[i] = q4_row(p, o + r0 + i);
            q4s[i] = q4_scales(p, o + r0 + i);
        }
        for (int k = 0; k < k8; k += 8) {
            __m256 v[8];
            const int g = i4 ? k / p->w_group : 0;
            for (int i = 0; i < 8; i++)
                v[i] = i >= rr ? _mm256_setzero_ps()
                       : i4    ? q4_row8_avx2(q4r[i], k, _mm256_set1_ps(q4s[i][g]))
                               : row8_avx2(p, o + r0 + i, k);
            transpose8_avx2(v);
            for (int j = 0; j < 8; j++)
                _mm256_storeu_ps(panel + (size_t)(k + j) * PK2_R + r0, v[j]);
        }
        for (int k = k8; k < n_in; k++) /* never for int4: n_in is whole blocks */
            for (int i = 0; i < 8; i++)
                panel[(size_t)k * PK2_R + r0 + i] =
                    i < rr ? w_elem(p->w_dtype, p->w, (int64_t)(o + r0 + i) * p->ldw + k) *
                                 (p->w_dtype == MOE_DTYPE_I8 ? p->w_scale[o + r0 + i] : 1.0f)
                           : 0.0f;
    }
}

/* int4 rows [o, o + R) dequantized into f32 rows of n_in (widen_rows_scalar's
 * result), 8 columns at a time; each row's codes and scales found once.
 * The only rows tile_avx2 widens: bf16 and int8 tiles read theirs as they
 * are. */
AVX2_TARGET static void widen_q4_rows_avx2(const struct moe_matmul_params *p, int o, int R,
                                           float *dst)
{
    MOE_ASSERT(p->w_dtype == MOE_DTYPE_I4); /* n_in is whole 32-column blocks */
    const int n_in = p->n_in;
    for (int r = 0; r < R; r++) {
        float *d = dst + (size_t)r * n_in;
        const uint8_t *row = q4_row(p, o + r);
        const float *sc = q4_scales(p, o + r);
        for (int k = 0; k < n_in; k += MOE_Q4_BLOCK) {
            const __m256 sv = _mm256_set1_ps(sc[k / p->w_group]);
            for (int j = 0; j < MOE_Q4_BLOCK; j += 8)
                _mm256_storeu_ps(d + k + j, q4_row8_avx2(row, k + j, sv));
        }
    }
}

/* y[t][0 .. R) (+)= x[t] . panel for T tokens; m0, m1 mask the outputs of
 * the panel's two vectors when R < PK2_R. */
AVX2_TARGET static inline __attribute__((always_inline)) void
mk_packed_avx2(const int T, const float *x, int n_in, const float *panel, float *y, int64_t ldy,
               bool full, __m256i m0, __m256i m1, bool accumulate)
{
    __m256 acc[PK2_T][2];
#pragma GCC unroll 6
    for (int t = 0; t < T; t++)
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int k = 0; k < n_in; k++) {
        __m256 w0 = _mm256_loadu_ps(panel + (size_t)k * PK2_R);
        __m256 w1 = _mm256_loadu_ps(panel + (size_t)k * PK2_R + 8);
#pragma GCC unroll 6
        for (int t = 0; t < T; t++) {
            __m256 xb = _mm256_broadcast_ss(x + (size_t)t * n_in + k);
            acc[t][0] = _mm256_fmadd_ps(xb, w0, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(xb, w1, acc[t][1]);
        }
    }
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
        float *yt = y + t * ldy;
        if (full) {
            if (accumulate) {
                acc[t][0] = _mm256_add_ps(_mm256_loadu_ps(yt), acc[t][0]);
                acc[t][1] = _mm256_add_ps(_mm256_loadu_ps(yt + 8), acc[t][1]);
            }
            _mm256_storeu_ps(yt, acc[t][0]);
            _mm256_storeu_ps(yt + 8, acc[t][1]);
        } else {
            if (accumulate) {
                acc[t][0] = _mm256_add_ps(_mm256_maskload_ps(yt, m0), acc[t][0]);
                acc[t][1] = _mm256_add_ps(_mm256_maskload_ps(yt + 8, m1), acc[t][1]);
            }
            _mm256_maskstore_ps(yt, m0, acc[t][0]);
            _mm256_maskstore_ps(yt + 8, m1, acc[t][1]);
        }
    }
}

AVX2_TARGET static void mk_packed_avx2_any(int T, const float *x, int n_in, const float *panel,
                                           float *y, int64_t ldy, bool full, __m256i m0, __m256i m1,
                                           bool accumulate)
{
    switch (T) {
    case 6: mk_packed_avx2(6, x, n_in, panel, y, ldy, full, m0, m1, accumulate); return;
    case 5: mk_packed_avx2(5, x, n_in, panel, y, ldy, full, m0, m1, accumulate); return;
    case 4: mk_packed_avx2(4, x, n_in, panel, y, ldy, full, m0, m1, accumulate); return;
    case 3: mk_packed_avx2(3, x, n_in, panel, y, ldy, full, m0, m1, accumulate); return;
    case 2: mk_packed_avx2(2, x, n_in, panel, y, ldy, full, m0, m1, accumulate); return;
    case 1: mk_packed_avx2(1, x, n_in, panel, y, ldy, full, m0, m1, accumulate); return;
    default: break;
    }
    MOE_ASSERT(0 && "mk_packed_avx2_any: unsupported tile");
}

AVX2_TARGET static void tile_avx2_packed(const struct mm_tile *mt)
{
    const struct moe_matmul_params *p = mt->p;
    const int n_in = p->n_in;
    const int o_end = mt->o0 + mt->no, t_end = mt->t0 + mt->nt;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int o = mt->o0; o < o_end; o += PK2_R) {
        const int R = o_end - o < PK2_R ? o_end - o : PK2_R;
        pack_panel_avx2(p, o, R, mt->scratch);
        const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(R), lane);
        const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(R - 8), lane);
        for (int t = mt->t0; t < t_end; t += PK2_T) {
            const int T = t_end - t < PK2_T ? t_end - t : PK2_T;
            mk_packed_avx2_any(T, p->x + (size_t)t * n_in, n_in, mt->scratch,
                               p->y + (size_t)t * p->n_out + o, p->n_out, R == PK2_R, m0, m1,
                               p->accumulate);
        }
    }
    /* gcc 12 returned from here with the upper ymm halves dirty (its callee
     * mk_packed_avx2_any skips vzeroupper), and the SSE code that ran next on
     * the thread (libm's expf in swiglu) stalled on every instruction:
     * swiglu went from ~1% to ~30% of a 512-token prefill on a Zen 3. */
    _mm256_zeroupper();
}

AVX2_TARGET static void tile_avx2(const struct mm_tile *mt)
{
    if (mt->packed) {
        tile_avx2_packed(mt);
        return;
    }
    const struct moe_matmul_params *p = mt->p;
    const int n_in = p->n_in;
    /* Below the packed path every tile reads the narrow rows as they are
     * (the first from memory, the rest from L1/L2), as the AVX-512 tiles do:
     * widening them to f32 scratch first made 16- and 24-sequence decode
     * 15-40% slower on a Zen 3. int4 codes are dequantized into scratch. */
    const bool widen = p->w_dtype == MOE_DTYPE_I4;
    /* bf16 calls of BF16_HALVES_MIN_TOK+ tokens (mm_prepare reordered their
     * x): widened by halves, in 2-token tiles */
    const bool halves = mt->xh != NULL;
    const float *xt = halves ? mt->xh : p->x;
    const int tstep = halves ? 2 : MK_T_AVX2;
    float out[MK_T][MK_R];
    int o = mt->o0;
    const int o_end = mt->o0 + mt->no;
    /* tile_rows' tiles; then the rows left over
     * (no % 4) one at a time below. int4 tiles, bound by widening rather
     * than by reading, keep consecutive rows: on the four streams the
     * benchmark model's decode was slower (one sequence 67 -> 48 tok/s). */
    const int q = mt->no / MK_R;
    for (int i = 0; i < q; i++) {
        const struct tile_rows tr = tile_rows(mt, i, !widen);
        enum moe_dtype wt = p->w_dtype;
        const void *w = w_at(wt, p->w, tr.o * p->ldw);
        int64_t ldw = tr.step * p->ldw, pf_off = tr.next * p->ldw;
        const float *sc = raw_scales(p, tr.o);
        if (widen) { /* tr.step is 1 */
            widen_q4_rows_avx2(p, tr.o, MK_R, mt->scratch);
            wt = MOE_DTYPE_F32;
            w = mt->scratch;
            ldw = pf_off = n_in;
        }
        for (int t = mt->t0; t < mt->t0 + mt->nt; t += tstep) {
            const int T = mt->t0 + mt->nt - t < tstep ? mt->t0 + mt->nt - t : tstep;
            mk_avx2_any(T, MK_R, wt, halves, xt + (size_t)t * n_in, n_in, n_in, w, ldw, pf_off,
                        !p->batch_invariant, out);
            store_tile(p, t, T, tr.o, MK_R, tr.step, sc, out);
        }
    }
    o = mt->o0 + MK_R * q;
    for (; o < o_end; o++) {
        enum moe_dtype wt = p->w_dtype;
        const void *w = w_at(wt, p->w, o * p->ldw);
        int64_t ldw = p->ldw;
        const float *sc = raw_scales(p, o);
        if (widen) {
            widen_q4_rows_avx2(p, o, 1, mt->scratch);
            wt = MOE_DTYPE_F32;
            w = mt->scratch;
            ldw = n_in;
            sc = NULL;
        }
        for (int t = mt->t0; t < mt->t0 + mt->nt; t += tstep) {
            int T = mt->t0 + mt->nt - t < tstep ? mt->t0 + mt->nt - t : tstep;
            mk_avx2_any(T, 1, wt, halves, xt + (size_t)t * n_in, n_in, n_in, w, ldw, ldw,
                        !p->batch_invariant, out);
            store_tile(p, t, T, o, 1, 1, sc, out);
        }
    }
    _mm256_zeroupper(); /* see tile_avx2_packed */
}

/* Token row x quantized as the VNNI path quantizes it (act_u8_row in
 * matmul_dot.c): sx = max |x| / 127, xq = round-to-nearest-even(x * (127 /
 * max |x|)) clamped to [-127, 127] (cvtps2dq under the default MXCSR; lrintf
 * for the tail); a row holding an infinity or a NaN gets sx = NaN (its
 * outputs are NaN, as on the exact path) and xq = 0, an all-zero row sx = 0.
 * xq is zero past n_in. Returns sx. */
AVX2_TARGET static float w8_quant_row_avx2(const float *x, int n_in, int8_t *xq, int ldq)
{
    const int n32 = n_in / 32 * 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int k = 0; k < n32; k += 8) {
        __m256 v = _mm256_loadu_ps(x + k);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
        bad = _mm256_add_ps(bad, _mm256_mul_ps(v, _mm256_setzero_ps())); /* NaN if inf / NaN */
    }
    float lanes[8], a = 0.0f;
    _mm256_storeu_ps(lanes, amax);
    for (int i = 0; i < 8; i++)
        a = fmaxf(a, lanes[i]);
    _mm256_storeu_ps(lanes, bad);
    bool nonfinite = false;
    for (int i = 0; i < 8; i++)
        nonfinite |= isnan(lanes[i]);
    for (int k = n32; k < n_in; k++) {
        nonfinite |= !isfinite(x[k]);
        a = fmaxf(a, fabsf(x[k]));
    }
    memset(xq, 0, (size_t)ldq);
    if (nonfinite) {
        _mm256_zeroupper();
        return NAN;
    }
    if (a == 0.0f) {
        _mm256_zeroupper();
        return 0.0f;
    }
    const float inv = 127.0f / a;
    const __m256 invv = _mm256_set1_ps(inv);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int k = 0; k < n32; k += 32) {
        __m256i q[4];
        for (int i = 0; i < 4; i++) {
            q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8 * i), invv));
            q[i] = _mm256_min_epi32(_mm256_max_epi32(q[i], lo), hi);
        }
        /* int32 -> int16 -> int8 packs interleave 128-bit lanes; put the
         * 4-byte groups back in column order */
        __m256i b =
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        b = _mm256_permutevar8x32_epi32(b, order);
        _mm256_storeu_si256((__m256i *)(xq + k), b);
    }
    for (int k = n32; k < n_in; k++) {
        long v = lrintf(x[k] * inv);
        v = v > 127 ? 127 : v < -127 ? -127 : v;
        xq[k] = (int8_t)v;
    }
    _mm256_zeroupper();
    return a / 127.0f;
}

/* ---- AVX2 W8A8: fast int8 weights, every call ----
 * No AVX2 instruction multiplies signed bytes by signed bytes, but
 * vpmaddubsw multiplies unsigned by signed ones and adds neighbouring pairs
 * into int16: fed |xq| and q * sign(xq) (vpsignb), or |q| and xq * sign(q),
 * it gives xq q pairs, and with |xq|, |q| <= 127 (common/quant.c clamps q to
 * [-127, 127]) a pair is at most 2 * 127 * 127 = 32258, so it never
 * saturates; vpmaddwd by ones widens the pairs to int32. A tile takes |.| of
 * its fewer vectors (the tokens' in a tile of 2 tokens x 4 rows, the row's in
 * one of 2 x 1), in registers as it goes rather than from a second copy of
 * the activations: 8-13% more MACs a second at 4-512 tokens (bench-kernels
 * --fast int8, Zen 3). The sums are the exact int32 sums the VNNI path
 * forms, from the same per-token quantization (w8_quant_row_avx2), scaled as
 * it scales them, so the results are bit for bit avx512-vnni's. */

AVX2_TARGET static inline __attribute__((always_inline)) int32_t hsum256_epi32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* T tokens (quantized rows xq, ldq apart) x R rows of int8 weights
 * w (ldw apart): exact int32 sums into out; the next tile's rows (pf bytes
 * on from these) prefetched into L2 as far ahead as this one has read (as
 * in mk_avx2). */
AVX2_TARGET static inline __attribute__((always_inline)) void
mk_w8a8_avx2(const int T, const int R, const int8_t *xq, int64_t ldq, const int8_t *w, int64_t ldw,
             int64_t pf_off, int n_in, int32_t out[MK_T][MK_R])
{
    __m256i acc[MK_T_W8][MK_R];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[t][r] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    /* |.| goes onto whichever side has fewer vectors in the tile */
    const bool abs_x = T < R;
    const int8_t *pf = w + pf_off;
    const int n32 = n_in / 32 * 32;
    for (int k = 0; k < n32; k += 32) {
        if (k % 64 == 0) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)(pf + r * ldw + k), _MM_HINT_T1);
        }
        __m256i xs[MK_T_W8], xu[MK_T_W8];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            xs[t] = _mm256_loadu_si256((const __m256i *)(xq + t * ldq + k));
            if (abs_x)
                xu[t] = _mm256_abs_epi8(xs[t]);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + r * ldw + k));
            const __m256i wa = abs_x ? wv : _mm256_abs_epi8(wv);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                __m256i pairs = abs_x ? _mm256_maddubs_epi16(xu[t], _mm256_sign_epi8(wv, xs[t]))
                                      : _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xs[t], wv));
                acc[t][r] = _mm256_add_epi32(acc[t][r], _mm256_madd_epi16(pairs, ones));
            }
        }
    }
    if (R == MK_R) { /* the four rows' sums at once: an hadd tree, then the two lanes */
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[t][0], acc[t][1]),
                                                _mm256_hadd_epi32(acc[t][2], acc[t][3]));
            _mm_storeu_si128((__m128i *)out[t], _mm_add_epi32(_mm256_castsi256_si128(s),
                                                              _mm256_extracti128_si256(s, 1)));
        }
    } else {
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                out[t][r] = hsum256_epi32(acc[t][r]);
    }
    if (n32 < n_in)
        for (int t = 0; t < T; t++)
            for (int r = 0; r < R; r++)
                for (int k = n32; k < n_in; k++)
                    out[t][r] += (int32_t)xq[t * ldq + k] * w[r * ldw + k];
}

AVX2_TARGET static void mk_w8a8_avx2_any(int T, int R, const int8_t *xq, int64_t ldq,
                                         const int8_t *w, int64_t ldw, int64_t pf_off, int n_in,
                                         int32_t out[MK_T][MK_R])
{
    if (T == 2 && R == 4)
        mk_w8a8_avx2(2, 4, xq, ldq, w, ldw, pf_off, n_in, out);
    else if (T == 1 && R == 4)
        mk_w8a8_avx2(1, 4, xq, ldq, w, ldw, pf_off, n_in, out);
    else if (T == 2 && R == 1)
        mk_w8a8_avx2(2, 1, xq, ldq, w, ldw, pf_off, n_in, out);
    else if (T == 1 && R == 1)
        mk_w8a8_avx2(1, 1, xq, ldq, w, ldw, pf_off, n_in, out);
    else
        MOE_ASSERT(0 && "mk_w8a8_avx2_any: unsupported tile");
}

/* A task of the W8A8 path: y = sum * (sx_t * w_scale_o), the VNNI path's
 * arithmetic (matmul_dot.c, stream_rows), on tile_rows' tiles; the rows
 * left over (no % 4) one at a time. */
AVX2_TARGET static void tile_avx2_w8a8(const struct mm_tile *mt, const struct w8_act *a)
{
    const struct moe_matmul_params *p = mt->p;
    int32_t out[MK_T][MK_R];
    const int q = mt->no / MK_R, o_end = mt->o0 + mt->no;
    const int64_t ldw = p->ldw;
    for (int i = 0; i < q; i++) {
        const struct tile_rows tr = tile_rows(mt, i, true);
        const int8_t *w = (const int8_t *)p->w + (int64_t)tr.o * ldw;
        float ws[MK_R];
        for (int r = 0; r < MK_R; r++)
            ws[r] = p->w_scale[tr.o + r * tr.step];
        for (int t = mt->t0; t < mt->t0 + mt->nt; t += MK_T_W8) {
            const int T = mt->t0 + mt->nt - t < MK_T_W8 ? mt->t0 + mt->nt - t : MK_T_W8;
            mk_w8a8_avx2_any(T, MK_R, a->xq + (size_t)t * a->ldq, a->ldq, w, tr.step * ldw,
                             tr.next * ldw, p->n_in, out);
            for (int tt = 0; tt < T; tt++)
                for (int r = 0; r < MK_R; r++)
                    store_out(p, t + tt, tr.o + r * tr.step,
                              (float)out[tt][r] * (a->sx[t + tt] * ws[r]));
        }
    }
    for (int o = mt->o0 + MK_R * q; o < o_end; o++) {
        const int8_t *w = (const int8_t *)p->w + (int64_t)o * ldw;
        for (int t = mt->t0; t < mt->t0 + mt->nt; t += MK_T_W8) {
            const int T = mt->t0 + mt->nt - t < MK_T_W8 ? mt->t0 + mt->nt - t : MK_T_W8;
            mk_w8a8_avx2_any(T, 1, a->xq + (size_t)t * a->ldq, a->ldq, w, ldw, ldw, p->n_in, out);
            for (int tt = 0; tt < T; tt++)
                store_out(p, t + tt, o, (float)out[tt][0] * (a->sx[t + tt] * p->w_scale[o]));
        }
    }
    _mm256_zeroupper(); /* see tile_avx2_packed */
}

/* ---- AVX2 W4A8: fast int4 weights, calls below 32 tokens (w8a8_avx2_for) ----
 * The VNNI path's W4A8 (matmul_dot.c) on AVX2: each token quantized as for
 * W8A8; a 32-column block's 4-bit codes u in [0, 15] are vpmaddubsw's
 * unsigned operand and xq its signed one, so no sign trick is needed (a pair
 * is at most 2 * 15 * 127); vpmaddwd by ones gives 8 int32 lanes of 4
 * columns each, exact sums of u xq. Each block's sums go to f32 times their
 * group's scale (groups are whole blocks) into f32 accumulators; the codes'
 * offset, sum_g s_g x (-8 x the group's sum of xq) (w8_act.xsum, once per
 * token), is added at the end, 8 groups an FMA; y = sx_t x their sum. (The
 * offset once folded into each step's int16 pairs, exact per group, took
 * one more op per token, row and 64 columns: bench-kernels --fast int4, one
 * core, 4-16 tokens, 91-100 -> 98-108 GFLOP/s without it. Its f32 sums now
 * round on the two parts' sizes, sum_g |s_g| sum (u + 8) |xq|, not on
 * sum |x w|: unit/test_matmul_i4 measures 3e-8 of that; the activations'
 * quantization is ~1e-2.)
 * Two blocks at a time: one 32-byte load holds their codes, and its low
 * nibbles are columns 0-15 of each (one block a 128-bit lane), its high ones
 * 16-31, so two ANDs and a shift unpack 64 codes, if the activations are
 * stored in that order (xq's 16-byte chunks 0 2 1 3 in each 64 columns,
 * w8_quant_q4_order); lane j of both halves' vpmaddubsw pairs then belongs
 * to the same block, and the pairs are small (|u xq + u' xq'| <= 2 * 15 *
 * 127), so the two halves add exactly in int16, before one vpmaddwd, one
 * conversion and one FMA: 6 ops per 64 MACs of a token and a row (W8A8
 * needs 8), plus 3 unpacking ops per 64 codes shared by the tile's tokens,
 * on half W8A8's bytes. A row whose length is an odd number of blocks ends
 * with one block in column order. The exact int4 path dequantizes every
 * weight to f32 first. */

/* The 32 codes of a block (common/quant.h: column j is byte j % 16's low
 * nibble below 16, its high one above) in column order. */
AVX2_TARGET static inline __attribute__((always_inline)) __m256i q4_codes32_avx2(const uint8_t *b)
{
    const __m128i v = _mm_loadu_si128((const __m128i *)b), m = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* T tokens (xq rows and their xsum rows) x R rows of codes w (ldb bytes
 * apart; scales sc, lds apart): sum_g s_g sum (u - 8) xq per (token, row)
 * into out; the next tile's rows (pf bytes on) prefetched into L2 as in
 * mk_w8a8_avx2. */
AVX2_TARGET static inline __attribute__((always_inline)) void
mk_w4a8_avx2(const int T, const int R, const int G, const struct w8_act *a, int t, const uint8_t *w,
             int64_t ldb, const float *sc, int64_t lds, int64_t pf_off, int n_in,
             float out[MK_T][MK_R])
{
    __m256 acc[MK_T_W8][MK_R];
#pragma GCC unroll 4
    for (int tt = 0; tt < T; tt++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[tt][r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *xq = a->xq + (size_t)t * a->ldq;
    const uint8_t *pf = w + pf_off;
    const __m256i nib = _mm256_set1_epi8(0x0f);
    int k = 0;
    for (; k + 2 * MOE_Q4_BLOCK <= n_in; k += 2 * MOE_Q4_BLOCK) {
        if (k % 128 == 0) { /* a cache line holds 128 columns' codes */
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)(pf + r * ldb + k / 2), _MM_HINT_T1);
        }
        const int g0 = k / G; /* a constant G: a shift, not a division */
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(w + r * ldb + k / 2));
            const __m256i lo = _mm256_and_si256(c, nib);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), nib);
            const float *sr = sc + r * lds;
            /* lanes 0-3 the first block's scale, 4-7 the second's: groups
             * of 64 or 128 columns hold both blocks (k is a multiple of 64) */
            const __m256 s =
                G > MOE_Q4_BLOCK
                    ? _mm256_broadcast_ss(sr + g0)
                    : _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(sr + g0)),
                                           _mm_broadcast_ss(sr + g0 + 1), 1);
            /* the tokens' operands read from L1 for each row, as memory
             * operands: kept in registers across rows they would push the
             * accumulators out of them */
            const int8_t *xk = xq + k;
            __asm__ volatile("" : "+r"(xk));
#pragma GCC unroll 4
            for (int tt = 0; tt < T; tt++) {
                const int8_t *xr = xk + (size_t)tt * a->ldq;
                const __m256i p0 =
                    _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xr));
                const __m256i p1 =
                    _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr + 32)));
                /* |p0|, |p1| <= 2 * 15 * 127: exact in int16 */
                const __m256i d = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones);
                acc[tt][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, acc[tt][r]);
            }
        }
    }
    for (; k < n_in; k += MOE_Q4_BLOCK) { /* the last, odd block */
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            _mm_prefetch((const char *)(pf + r * ldb + k / 2), _MM_HINT_T1);
        __m256i xs[MK_T_W8];
#pragma GCC unroll 4
        for (int tt = 0; tt < T; tt++)
            xs[tt] = _mm256_loadu_si256((const __m256i *)(xq + (size_t)tt * a->ldq + k));
        const int g = k / G;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256i u = q4_codes32_avx2(w + r * ldb + k / 2);
            const __m256 s = _mm256_broadcast_ss(sc + r * lds + g);
#pragma GCC unroll 4
            for (int tt = 0; tt < T; tt++) {
                const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(u, xs[tt]), ones);
                acc[tt][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, acc[tt][r]);
            }
        }
    }
    /* the codes' offset: sum_g s_g x (-8 x the group's xq), 8 groups a step
     * (xsum is zero past the row's groups; the scales are masked there) */
    const int n_g = (n_in + G - 1) / G;
    const float *xg = a->xsum + (size_t)t * a->ldg;
    for (int g = 0; g < n_g; g += 8) {
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n_g - g),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256 s = _mm256_maskload_ps(sc + r * lds + g, m);
#pragma GCC unroll 4
            for (int tt = 0; tt < T; tt++)
                acc[tt][r] =
                    _mm256_fmadd_ps(s, _mm256_loadu_ps(xg + (size_t)tt * a->ldg + g), acc[tt][r]);
        }
    }
#pragma GCC unroll 4
    for (int tt = 0; tt < T; tt++) {
        if (R == MK_R)
            _mm_storeu_ps(out[tt], hsum256_x4(acc[tt]));
        else
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                out[tt][r] = hsum256(acc[tt][r]);
    }
}

/* The tiles and groups there are, each its own code (T, R and G constants). */
#define W4A8_TILE(T, R, G) mk_w4a8_avx2(T, R, G, a, t, w, ldb, sc, lds, pf_off, n_in, out)
#define W4A8_TILES(T, R)                                                                           \
    (group == 32 ? W4A8_TILE(T, R, 32) : group == 64 ? W4A8_TILE(T, R, 64) : W4A8_TILE(T, R, 128))

AVX2_TARGET static void mk_w4a8_avx2_any(int T, int R, const struct w8_act *a, int t,
                                         const uint8_t *w, int64_t ldb, const float *sc,
                                         int64_t lds, int group, int64_t pf_off, int n_in,
                                         float out[MK_T][MK_R])
{
    /* group: 32, 64 or 128 (mm_prepare asserts it once per call) */
    if (T == 2 && R == 4)
        W4A8_TILES(2, 4);
    else if (T == 1 && R == 4)
        W4A8_TILES(1, 4);
    else if (T == 2 && R == 1)
        W4A8_TILES(2, 1);
    else if (T == 1 && R == 1)
        W4A8_TILES(1, 1);
    else
        MOE_ASSERT(0 && "mk_w4a8_avx2_any: unsupported tile");
}
#undef W4A8_TILES
#undef W4A8_TILE

/* A task of the W4A8 path, on tile_rows' tiles as tile_avx2_w8a8. */
AVX2_TARGET static void tile_avx2_w4a8(const struct mm_tile *mt, const struct w8_act *a)
{
    const struct moe_matmul_params *p = mt->p;
    float out[MK_T][MK_R];
    const int q = mt->no / MK_R, o_end = mt->o0 + mt->no;
    const int64_t ldb = p->ldw / 2, lds = moe_q4_groups(p->ldw, p->w_group);
    for (int i = 0; i <= q; i++) {
        /* the 4-row tiles, then the rows left over (no % 4) one at a time */
        const bool rest = i == q;
        const struct tile_rows tr =
            rest ? (struct tile_rows){.o = mt->o0 + MK_R * q, .step = 1, .next = 1}
                 : tile_rows(mt, i, true);
        const int R = rest ? 1 : MK_R, n_tiles = rest ? o_end - tr.o : 1;
        for (int j = 0; j < n_tiles; j++) {
            const int o = tr.o + j;
            const uint8_t *w = (const uint8_t *)p->w + (int64_t)o * ldb;
            for (int t = mt->t0; t < mt->t0 + mt->nt; t += MK_T_W8) {
                const int T = mt->t0 + mt->nt - t < MK_T_W8 ? mt->t0 + mt->nt - t : MK_T_W8;
                mk_w4a8_avx2_any(T, R, a, t, w, tr.step * ldb, p->w_scale + (int64_t)o * lds,
                                 tr.step * lds, p->w_group, tr.next * ldb, p->n_in, out);
                for (int tt = 0; tt < T; tt++)
                    for (int r = 0; r < R; r++)
                        store_out(p, t + tt, o + r * tr.step, out[tt][r] * a->sx[t + tt]);
            }
        }
    }
    _mm256_zeroupper(); /* see tile_avx2_packed */
}

#endif /* MATMUL_X86 */

/* ---------------------------------------------------------------------------
 * Threading */

struct mm_job {
    const struct moe_matmul_params *p;
    enum cpu_isa isa;
    int row_block, n_row_blocks;
    int tok_block;
    float *scratch; /* (n_threads, scratch_stride) or NULL */
    size_t scratch_stride;
    bool packed;             /* every task takes the packed panels */
    const struct w8_act *w8; /* the AVX2 W8A8 / W4A8 paths, or NULL */
    const float *xh;         /* the bf16 tiles' activations by halves, or NULL */
    const uint32_t *xph;     /* the fp16 panels' activations (mm_tile), or NULL */
    const float *xs;
};

static void mm_run_tile(enum cpu_isa isa, const struct mm_tile *mt)
{
#ifdef MATMUL_X86
    if (isa == CPU_ISA_AVX512) {
        tile_avx512(mt);
        return;
    }
    if (isa == CPU_ISA_AVX2) {
        tile_avx2(mt);
        return;
    }
#endif
    (void)isa;
    tile_scalar(mt);
}

static void mm_task(void *arg, int task, int thread)
{
    const struct mm_job *job = arg;
    const struct moe_matmul_params *p = job->p;
    int rb = task % job->n_row_blocks;
    int tb = task / job->n_row_blocks;
    struct mm_tile mt = {.p = p};
    mt.o0 = rb * job->row_block;
    mt.no = p->n_out - mt.o0 < job->row_block ? p->n_out - mt.o0 : job->row_block;
    mt.t0 = tb * job->tok_block;
    mt.nt = p->n_tok - mt.t0 < job->tok_block ? p->n_tok - mt.t0 : job->tok_block;
    mt.scratch = job->scratch ? job->scratch + (size_t)thread * job->scratch_stride : NULL;
    mt.packed = job->packed;
    mt.xh = job->xh;
    mt.xph = job->xph;
    mt.xs = job->xs;
#ifdef MATMUL_X86
    if (job->w8) {
        if (p->w_dtype == MOE_DTYPE_I4)
            tile_avx2_w4a8(&mt, job->w8);
        else
            tile_avx2_w8a8(&mt, job->w8);
        return;
    }
#endif
    mm_run_tile(job->isa, &mt);
}

/* Fast int8 weights on AVX2: the W8A8 tiles, whatever the token count (its
 * integer sums do not depend on the tile, so it is batch-invariant as it
 * is). Prefill too: on a Zen 3 they beat the f32 packed panels on the
 * dequantized rows (2 threads, against the commit before, same rounds:
 * 512-token prefill 488 -> 590 tok/s, 16-sequence decode 277 -> 354): a
 * vpmaddubsw + vpmaddwd pair does 32 multiplies where an FMA does 8. Fast
 * int4 takes the W4A8 tiles below PK2_MIN_TOK tokens (decode on a Zen 3, 2
 * threads, same rounds: one sequence 70 -> 251 tok/s, sixteen 193 -> 386), and at every
 * size under batch_invariant (a token's sums are its own); from there the
 * f32 packed panels on dequantized rows, as exact, are faster (their
 * dequantization is shared by the panel's tokens, where a W4A8 tile unpacks
 * its codes for every 2 tokens: 512-token prefill 483 vs 445 tok/s). */
static bool w8a8_avx2_for(const struct moe_matmul_params *p, enum cpu_isa isa)
{
    if (!p->fast || isa != CPU_ISA_AVX2)
        return false;
    return p->w_dtype == MOE_DTYPE_I8 ||
           (p->w_dtype == MOE_DTYPE_I4 && (p->n_tok < PK2_MIN_TOK || p->batch_invariant));
}

#ifdef MATMUL_X86
/* A quantized token row xq (n_in a multiple of 32) as mk_w4a8_avx2 reads
 * it: in each whole 64 columns the 16-byte chunks 0 2 1 3 (the order of the
 * codes' nibbles; a last, odd block as it is), and xsum: for each group of
 * `group` columns, -8 x the sum of its xq (exact in f32), zero from there
 * to ldg. */
static void w8_quant_q4_order(int8_t *xq, int n_in, int group, float *xsum, int ldg)
{
    for (int g = 0; g < ldg; g++) {
        int sum = 0;
        for (int k = g * group; k < (g + 1) * group && k < n_in; k++)
            sum += xq[k];
        xsum[g] = (float)(-8 * sum);
    }
    for (int k = 0; k + 64 <= n_in; k += 64) {
        int8_t c1[16];
        memcpy(c1, xq + k + 16, 16);
        memmove(xq + k + 16, xq + k + 32, 16);
        memcpy(xq + k + 32, c1, 16);
    }
}

/* A token row x as the bf16 tiles widening by halves read it: in each whole
 * 32 columns (a cache line of bf16 weights), each `block` columns' even
 * ones, then their odd ones (block 16: an AVX2 load, mk_avx2; 32: an AVX-512
 * load, mk_avx512); the columns past the last whole 32 as they are. */
static void bf16_halves_order(const float *x, int n_in, int block, float *xh)
{
    const int n_lines = n_in / 32 * 32, half = block / 2;
    for (int k = 0; k < n_lines; k += block)
        for (int i = 0; i < half; i++) {
            xh[k + i] = x[k + 2 * i];
            xh[k + half + i] = x[k + 2 * i + 1];
        }
    memcpy(xh + n_lines, x + n_lines, (size_t)(n_in - n_lines) * sizeof(float));
}
#endif

/* One call's job, its W8A8 / W4A8 activations and buffers, between mm_prepare and
 * mm_release (job.w8 points into it: it does not move meanwhile). */
struct mm_call {
    struct mm_job job;
    struct w8_act w8;
    int8_t *w8_buf;
    float *xh_buf;
    float *ph_buf; /* the fp16 panels' scales, then activations */
    float *heap_scratch;
    int n_tasks;
    double flops;
};

/* Sets c up for p (p->n_tok, p->n_out > 0; not a dot-product call): task
 * shapes, scratch (`stack` when its `stack_n` floats suffice), and on the
 * W8A8 / W4A8 paths the quantized activations. */
static void mm_prepare(struct moe_threadpool *pool, const struct moe_matmul_params *p,
                       struct mm_call *c, float *stack, size_t stack_n)
{
    MOE_ASSERT(p->ldw >= p->n_in && p->n_in >= 0);
    MOE_ASSERT(p->w_dtype == MOE_DTYPE_F32 || p->w_dtype == MOE_DTYPE_BF16 ||
               (p->w_dtype == MOE_DTYPE_I8 && p->w_scale != NULL) ||
               (p->w_dtype == MOE_DTYPE_I4 && p->w_scale != NULL &&
                moe_q4_group_valid(p->w_group) && p->n_in % MOE_Q4_BLOCK == 0 &&
                p->ldw % MOE_Q4_BLOCK == 0));
    *c = (struct mm_call){.job = {.p = p, .isa = cpu_kernels_isa()}};
    struct mm_job *job = &c->job;
    int n_threads = moe_threadpool_size(pool);

    /* Rows per task: about 8 tasks per thread, a multiple of MK_R, 16..256. */
    int rb = (p->n_out + 8 * n_threads - 1) / (8 * n_threads);
    rb = (rb + MK_R - 1) / MK_R * MK_R;
    rb = rb < 16 ? 16 : rb > 256 ? 256 : rb;
    if (rb > p->n_out)
        rb = p->n_out;
    job->row_block = rb;
    job->n_row_blocks = (p->n_out + rb - 1) / rb;
    job->tok_block = p->n_tok < TOK_BLOCK ? p->n_tok : TOK_BLOCK;
    size_t scratch_rows = MK_R;
    const bool w8a8 = w8a8_avx2_for(p, job->isa);
    bool need_scratch =
        p->w_dtype != MOE_DTYPE_F32 && !w8a8 &&
        (job->isa == CPU_ISA_SCALAR || (job->isa == CPU_ISA_AVX2 && p->w_dtype == MOE_DTYPE_I4));
    /* fp16 panels (see there): fast bf16 on AVX512-FP16, where the dot
     * product paths declined the call */
    const bool ph_ok = p->fast && p->w_dtype == MOE_DTYPE_BF16 && cpu_matmul_fp16_panels();
    const int pk_min = ph_ok ? PH_MIN_TOK : job->isa == CPU_ISA_AVX512 ? PK_MIN_TOK : PK2_MIN_TOK;
    job->packed = job->isa != CPU_ISA_SCALAR && p->n_tok >= pk_min && !p->batch_invariant && !w8a8;
    const bool ph = ph_ok && job->packed;
    const int pk_r = ph ? PH_R : job->isa == CPU_ISA_AVX512 ? PK_R : PK2_R;
    if (job->packed) {
        /* Packed path: row blocks of whole panels, wide token blocks, none
         * narrower than pk_min. Its sums run k by k (one accumulator lane
         * per output), the tiles' in vector lanes: a token's last bits
         * depend on whether its call reached pk_min, hence not under
         * batch_invariant. */
        job->row_block = rb <= pk_r ? pk_r : (rb + pk_r - 1) / pk_r * pk_r;
        /* >= PH_R; the fp16 panels' tasks up to 4 panels (each fetches the
         * next while it computes) */
        const int rb_max = ph ? 4 * PH_R : 2 * PK_R;
        job->row_block = job->row_block > rb_max ? rb_max : job->row_block;
        job->n_row_blocks = (p->n_out + job->row_block - 1) / job->row_block;
        job->tok_block = p->n_tok < PK_TOK_BLOCK ? p->n_tok : PK_TOK_BLOCK;
        if (p->n_tok - (p->n_tok / job->tok_block) * job->tok_block > 0 &&
            p->n_tok % job->tok_block < pk_min)
            job->tok_block = (p->n_tok + (p->n_tok + PK_TOK_BLOCK - 1) / PK_TOK_BLOCK - 1) /
                             ((p->n_tok + PK_TOK_BLOCK - 1) / PK_TOK_BLOCK);
        scratch_rows =
            (size_t)(job->isa == CPU_ISA_AVX512 ? PK_R : PK2_R); /* holds an fp16 panel */
        need_scratch = true;
    }
    int n_tok_blocks = (p->n_tok + job->tok_block - 1) / job->tok_block;
    job->scratch_stride = scratch_rows * (size_t)p->n_in;
    if (need_scratch) {
        size_t n = (size_t)n_threads * job->scratch_stride;
        if (stack && n <= stack_n) {
            job->scratch = stack;
        } else {
            c->heap_scratch = malloc(n * sizeof(float));
            MOE_ASSERT(c->heap_scratch != NULL);
            job->scratch = c->heap_scratch;
        }
    }
#ifdef MATMUL_X86
    if ((job->isa == CPU_ISA_AVX2 || job->isa == CPU_ISA_AVX512) && p->w_dtype == MOE_DTYPE_BF16 &&
        !job->packed && !p->batch_invariant && p->n_tok >= BF16_HALVES_MIN_TOK) {
        c->xh_buf = malloc((size_t)p->n_tok * p->n_in * sizeof(float));
        MOE_ASSERT(c->xh_buf != NULL);
        const int block = job->isa == CPU_ISA_AVX512 ? 32 : 16;
        for (int t = 0; t < p->n_tok; t++)
            bf16_halves_order(p->x + (size_t)t * p->n_in, p->n_in, block,
                              c->xh_buf + (size_t)t * p->n_in);
        job->xh = c->xh_buf;
    }
#if MM_PH
    if (ph) {
        const size_t n_pairs = ((size_t)p->n_in + 1) / 2;
        c->ph_buf = malloc((size_t)p->n_tok * (n_pairs + 1) * sizeof(float));
        MOE_ASSERT(c->ph_buf != NULL);
        uint32_t *xph = (uint32_t *)(c->ph_buf + p->n_tok);
        for (int t = 0; t < p->n_tok; t++)
            c->ph_buf[t] = ph_act_row(p->x + (size_t)t * p->n_in, p->n_in,
                                      (uint16_t *)(xph + (size_t)t * n_pairs));
        job->xs = c->ph_buf;
        job->xph = xph;
    }
#endif
    if (w8a8) {
        struct w8_act *w8 = &c->w8;
        const bool i4 = p->w_dtype == MOE_DTYPE_I4;
        w8->ldq = (p->n_in + 31) / 32 * 32;
        w8->ldg = i4 ? (int)(moe_q4_groups(p->n_in, p->w_group) + 7) / 8 * 8 : 0;
        /* per token: xsum (int4: ldg floats), sx, xq */
        const size_t per_tok = ((size_t)w8->ldg + 1) * sizeof(float) + (size_t)w8->ldq;
        c->w8_buf = malloc((size_t)p->n_tok * per_tok);
        MOE_ASSERT(c->w8_buf != NULL);
        w8->xsum = i4 ? (float *)c->w8_buf : NULL;
        w8->sx = (float *)c->w8_buf + (size_t)p->n_tok * w8->ldg;
        w8->xq = (int8_t *)(w8->sx + p->n_tok);
        for (int t = 0; t < p->n_tok; t++) {
            int8_t *xq = w8->xq + (size_t)t * w8->ldq;
            w8->sx[t] = w8_quant_row_avx2(p->x + (size_t)t * p->n_in, p->n_in, xq, w8->ldq);
            if (i4)
                w8_quant_q4_order(xq, p->n_in, p->w_group, w8->xsum + (size_t)t * w8->ldg, w8->ldg);
        }
        job->w8 = w8;
    }
#endif
    c->n_tasks = job->n_row_blocks * n_tok_blocks;
    c->flops = 2.0 * p->n_tok * (double)p->n_out * p->n_in;
}

bool cpu_matmul_fp16_panels(void)
{
    return MM_PH && cpu_kernels_isa() == CPU_ISA_AVX512 &&
           (cpu_kernels_features() & CPU_FEAT_AVX512_FP16);
}

static void mm_release(struct mm_call *c)
{
    free(c->heap_scratch);
    free(c->w8_buf);
    free(c->xh_buf);
    free(c->ph_buf);
}

/* Too little work to wake the helpers for. */
static bool mm_serial(double flops, int n_tasks)
{
    return flops < 65536.0 || n_tasks == 1;
}

void cpu_matmul(struct moe_threadpool *pool, const struct moe_matmul_params *p)
{
    if (p->n_tok <= 0 || p->n_out <= 0)
        return;
    if (p->fast && cpu_matmul_dot_supported(p)) {
        cpu_matmul_dot(pool, p);
        return;
    }
    float stack_scratch[MK_R * 1024];
    struct mm_call c;
    mm_prepare(pool, p, &c, stack_scratch, sizeof stack_scratch / sizeof *stack_scratch);
    if (mm_serial(c.flops, c.n_tasks)) {
        for (int t = 0; t < c.n_tasks; t++)
            mm_task(&c.job, t, 0);
    } else {
        moe_threadpool_run(pool, c.n_tasks, mm_task, &c.job);
    }
    mm_release(&c);
}

/* A call's place in a two-ended run: by tokens, most first; equal ones in
 * their given order. */
struct mm_rank {
    int n_tok, call;
};

/* Several calls' tasks in one pool run, the calls taken in `rank`'s order:
 * the i-th call run is calls[rank[i].call], its tasks [first[i], first[i + 1]). */
struct mm_many {
    struct mm_call *calls;
    const struct mm_rank *rank;
    const int *first;
    int n;
    /* the tasks not yet taken, [front, back): front in the low 32 bits */
    _Atomic uint64_t ends;
};

static void mm_many_task(void *arg, int task, int thread)
{
    const struct mm_many *mm = arg;
    const int i = cpu_task_owner(mm->first, mm->n, task);
    mm_task(&mm->calls[mm->rank[i].call].job, task - mm->first[i], thread);
}

/* Takes the next task from the front or from the back of [front, back). */
static bool mm_many_claim(struct mm_many *mm, bool back, int *task)
{
    uint64_t e = atomic_load_explicit(&mm->ends, memory_order_relaxed);
    for (;;) {
        const uint32_t f = (uint32_t)e, b = (uint32_t)(e >> 32);
        if (f >= b)
            return false;
        const uint64_t next = back ? (uint64_t)(b - 1) << 32 | f : (uint64_t)b << 32 | (f + 1);
        if (atomic_compare_exchange_weak_explicit(&mm->ends, &e, next, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *task = (int)(back ? b - 1 : f);
            return true;
        }
    }
}

/* One thread's share of a two-ended run: pool task `side` 0, 2, 4, ...
 * takes tasks from the front, 1, 3, ... from the back, until none is left. */
static void mm_many_ends(void *arg, int side, int thread)
{
    struct mm_many *mm = arg;
    int task;
    while (mm_many_claim(mm, side % 2 == 1, &task))
        mm_many_task(mm, task, thread);
}

static int mm_rank_cmp(const void *a, const void *b)
{
    const struct mm_rank *x = a, *y = b;
    if (x->n_tok != y->n_tok)
        return x->n_tok > y->n_tok ? -1 : 1;
    return (x->call > y->call) - (x->call < y->call);
}

/* The calls of a fast grouped matmul that the dot-product paths take
 * (cpu_matmul_dot_supported: by weight type, and where vdpbf16ps is slow by
 * size too) run there, in one pool run; the rest, if any, through
 * cpu_matmul_many's own. Returns false when the dot paths take none. */
static bool mm_many_split_dot(struct moe_threadpool *pool, const struct moe_matmul_params *ps,
                              int n)
{
    int n_dot = 0, n_work = 0;
    for (int i = 0; i < n; i++) {
        if (ps[i].n_tok <= 0 || ps[i].n_out <= 0)
            continue;
        n_work++;
        n_dot += cpu_matmul_dot_supported(&ps[i]);
    }
    if (n_dot == 0)
        return false;
    if (n_dot == n_work) {
        cpu_matmul_dot_many(pool, ps, n);
        return true;
    }
    struct moe_matmul_params *dot = malloc((size_t)n_work * sizeof *dot);
    MOE_ASSERT(dot != NULL);
    struct moe_matmul_params *rest = dot + n_dot;
    int d = 0, r = 0;
    for (int i = 0; i < n; i++) {
        if (ps[i].n_tok <= 0 || ps[i].n_out <= 0)
            continue;
        if (cpu_matmul_dot_supported(&ps[i]))
            dot[d++] = ps[i];
        else
            rest[r++] = ps[i];
    }
    cpu_matmul_dot_many(pool, dot, d);
    cpu_matmul_many(pool, rest, r);
    free(dot);
    return true;
}

void cpu_matmul_many(struct moe_threadpool *pool, const struct moe_matmul_params *ps, int n)
{
    if (n == 1) {
        cpu_matmul(pool, &ps[0]);
        return;
    }
    if (n > 1 && ps[0].fast && mm_many_split_dot(pool, ps, n))
        return;
    const size_t cap = (size_t)(n > 0 ? n : 1);
    struct mm_call *calls = malloc(cap * sizeof *calls);
    struct mm_rank *rank = malloc(cap * sizeof *rank);
    int *first = malloc((cap + 1) * sizeof *first);
    MOE_ASSERT(calls != NULL && rank != NULL && first != NULL);
    int k = 0;
    double flops = 0.0;
    for (int i = 0; i < n; i++) {
        const struct moe_matmul_params *p = &ps[i];
        if (p->n_tok <= 0 || p->n_out <= 0)
            continue;
        MOE_ASSERT(!(p->fast && cpu_matmul_dot_supported(p))); /* mm_many_split_dot took those */
        mm_prepare(pool, p, &calls[k], NULL, 0);
        flops += calls[k].flops;
        rank[k] = (struct mm_rank){.n_tok = p->n_tok, .call = k};
        k++;
    }
    /* With more than one thread, the calls (a grouped expert GEMM's
     * experts) go busiest first and the threads take tasks from both ends:
     * the experts with many rows are bound by the cores' arithmetic, those
     * with a row or two by reading their weights, and side by side the two
     * use the multipliers and the memory at once, where one after the other
     * each waits on one of them (decode of 16 sequences on a Zen 3, 2
     * threads: the experts' time -7% bf16, -2% int8). Which task computes
     * an output does not change it, so the results are the same. */
    const bool two_ended = moe_threadpool_size(pool) > 1 && k > 1;
    if (two_ended)
        qsort(rank, (size_t)k, sizeof *rank, mm_rank_cmp);
    int total = 0;
    for (int i = 0; i < k; i++) {
        first[i] = total;
        total += calls[rank[i].call].n_tasks;
    }
    first[k] = total;
    struct mm_many mm = {.calls = calls, .rank = rank, .first = first, .n = k};
    atomic_init(&mm.ends, (uint64_t)(uint32_t)total << 32);
    if (k > 0) {
        if (mm_serial(flops, total)) {
            for (int t = 0; t < total; t++)
                mm_many_task(&mm, t, 0);
        } else if (two_ended) {
            moe_threadpool_run(pool, moe_threadpool_size(pool), mm_many_ends, &mm);
        } else {
            moe_threadpool_run(pool, total, mm_many_task, &mm);
        }
    }
    for (int i = 0; i < k; i++)
        mm_release(&calls[i]);
    free(calls);
    free(rank);
    free(first);
}
