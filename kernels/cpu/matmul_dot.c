/* The fast matmul paths (moe_matmul_params.fast): dot-product instructions
 * that multiply narrow activations by narrow weights.
 *
 *   BF16 weights, AVX512-BF16: x is rounded to bf16 (nearest even) once per
 *   call; vdpbf16ps multiplies bf16 pairs exactly and adds them into f32
 *   accumulators (two roundings per pair, as an f32 FMA loop has one per
 *   element). bf16 keeps 8 significant bits, so rounding x_k to nearest
 *   moves it by less than 2^-8 |x_k|, and the error against the exact path
 *   (f32 x, the same bf16 weights) is
 *     |y - y_exact| <= 2^-8 sum_k |x_k w_k|               (the rounding of x)
 *                    + (n_in + 2) 2^-24 sum_k |x_k w_k|   (f32 sums, either side)
 *   (denormal inputs and outputs are flushed to zero by the instruction: an
 *   absolute error below 2^-126 per product). tests/unit/test_matmul_fast.c
 *   holds every output to this bound; random data reach ~0.65 of it.
 *   Where vdpbf16ps is slow (Intel without AMX) and AVX512-FP16 exists, calls
 *   of CPU_PH_STREAM_MIN_TOK .. CPU_PH_MIN_TOK - 1 tokens take fp16 streaming
 *   tiles instead (x scaled to |x| <= 1 and rounded to fp16, the weights
 *   widened to fp16 per tile, fp16 sums over 32 columns a lane, then f32:
 *   the arithmetic and bound of matmul.c's fp16 panels, see there).
 *
 *   I8 weights (W8A8), AVX512-VNNI: each token row x_t is quantized with its
 *   own scale sx_t = max_k |x_tk| / 127 to xq_tk = round(x_tk / sx_t) in
 *   [-127, 127]. vpdpbusd multiplies unsigned by signed bytes, so it is fed
 *   u_tk = xq_tk + 128 (in [1, 255]) and the offset is taken back per weight
 *   row: sum_k xq_tk q_ok = sum_k u_tk q_ok - 128 sum_k q_ok, all in exact
 *   int32 arithmetic (|sum| < 255 * 127 * n_in < 2^31 for n_in <= 65536).
 *   y_to = sx_t * w_scale_o * that. The row sums sum_k q_ok are computed in
 *   the kernel, not at load, once per packed panel (prefill), so the int8
 *   weight layout (common/quant.h) and every caller stay as they are. The
 *   streaming (decode) path swaps the operands instead: the weights become
 *   the unsigned side, q_ok ^ 0x80 = q_ok + 128 in [1, 255] (one XOR per 64
 *   weights, shared by a tile's tokens), the activations stay signed, and
 *   sum_k xq_tk (q_ok + 128) - 128 sum_k xq_tk is the same exact int32 sum;
 *   the token sums are taken once per call while quantizing, so no row-sum
 *   dot product per weight vector (there, at 16 tokens, the dot products
 *   are what binds). Error against the
 *   exact int8 path (f32 x, dequantized weights):
 *     |y - y_exact| <= (sx_t / 2) w_scale_o sum_k |q_ok| + f32 rounding,
 *   i.e. half a quantization step of x per element. Because the sums are
 *   exact integers, the result does not depend on tiling or threads.
 *
 *   I4 weights (W4A8), AVX512-VNNI: each token row is quantized as for I8 but
 *   kept signed (xq in [-127, 127]); the 4-bit codes u in [0, 15] are the
 *   unsigned operand, so vpdpbusd gives sum u xq exactly, and the accumulator
 *   starts at -8 sum xq of the same four columns (one more vpdpbusd against
 *   ones per token and 64 columns), which leaves sum (u - 8) xq: the signed
 *   weights' products, in exact int32. Each 64-column step is converted to
 *   f32 and multiplied by its group scales (one per 32, 64 or 128 columns;
 *   the lanes of a step belong to one or two groups) into f32 accumulators;
 *   y = sx_t * their sum. Error against the exact int4 path: half a
 *   quantization step of x per element, as for I8, plus f32 rounding of the
 *   per-step partial sums. Streaming tiles only (prefill too): a 64-column
 *   step widens 32 code bytes to 64 per row, shared by the tile's tokens.
 *
 *   I4 weights where the processor has AMX-BF16, from AMX_MIN_TOK_I4 tokens
 *   on: group scales stop integer sums at every group, which would cost
 *   the tiles most of their speed, so the rows are dequantized instead,
 *   32 at a time into a per-thread scratch, w = (u - 8) d_g rounded to bf16
 *   (nearest even), and go through the BF16 tiles (packed panels, or the
 *   weight-stationary form below 32 tokens) with bf16 activations. Both
 *   sides round once to bf16, so against the exact int4 path (f32 x, f32
 *   dequantized weights)
 *     |y - y_exact| <= (2^-7 + 2^-16) sum_k |x_k w_k| + f32 sums (as BF16),
 *   which is tighter than W4A8's half quantization step of x for typical
 *   rows. The dequantization (~14 instructions per 32 weights) is paid once
 *   per 32 rows and token block, shared by up to 256 tokens; below 8 tokens
 *   it would cost more than W4A8's whole dot products.
 *
 * Tiles as in matmul.c: decode-sized token counts stream the weights once
 * through T x R register tiles (dot products, horizontal sums at the end),
 * the R rows taken from R parts of a task so that each thread reads R
 * sequential streams (task_stream); larger ones pack 32 weight rows into a
 * panel of dword groups (bf16 pairs or int8 quads of k, 16 rows per vector)
 * and broadcast one group of each token against two panel vectors: PK_T x
 * 32 outputs per step, no horizontal sums.
 *
 * AMX (packed tiles only, where the processor has it): the same panels are
 * the B operand of the tile instructions as they stand (a panel row, 16
 * dword groups of 16 weight rows, is one 64-byte tile row; stride 128
 * bytes), the activation rows are the A operand (16 tokens x 64 bytes), and
 * a step is 2 x 2 tiles: 32 tokens x 32 weight rows per 64 bytes of k, in 4
 * tdpbf16ps / tdpbssd (one A tile, 2 x 1, for a last step of <= 16 tokens).
 * AMX takes over from 8 (bf16) / 16 (int8) tokens on, below DP_MIN_TOK.
 * Below 32 tokens, where n_in is a whole number of 64-byte steps, a
 * weight-stationary form (amx_stream_block) runs instead: the weights are
 * the A operand straight from memory (nothing packed per weight row; decode
 * is memory-bound) and the few tokens' activations, transposed once per
 * call, the B operand. BF16: the same bf16 products summed into f32 in the
 * instruction's order, so within the same bound as vdpbf16ps (another
 * rounding order). I8: tdpbssd takes signed activations (xq, no +128 offset,
 * so no row sums), and the exact i32 sums are the VNNI path's: AMX int8
 * results are bit-identical to AVX512-VNNI. The tile instructions are
 * written as inline asm with a "memory" clobber, ldtilecfg included: gcc
 * 12's _tile_loadconfig is declared as reading 8 bytes, so the stores that
 * build the 64-byte config can be dropped (../shared/NOTES.md), and its
 * tileloadd / tilestored carry no memory clobber either. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "quant.h"
#include "amx_x86.h"
#include "simd_x86.h"

#if defined(__x86_64__)
#define DOT_X86 1
#endif

#define DT_R 4          /* streaming: weight rows per register tile */
#define DT_T 4          /* streaming: tokens per register tile */
#define DT_TOK_BLOCK 64 /* streaming: tokens per task */
#define DP_R 32         /* packed: weight rows per panel (2 vectors of 16) */
#define DP_T 12         /* packed: tokens per register tile (24 accumulators) */
/* Token blocks at least this wide use the packed path (packing is a 16 x 16
 * dword transpose per 64 weight bytes, paid once per token block). */
#define DP_MIN_TOK 32
#define DP_TOK_BLOCK 256 /* packed: tokens per task */
#define DOT_MAX_N_IN 65536

enum dot_kind { DOT_BF16 = 0, DOT_I8 = 1, DOT_I4 = 2 };

/* fp16 streaming (below): gcc only, as the fp16 panels of matmul.c */
#if defined(DOT_X86)
#define DOT_PH MOE_HAVE_FP16
#else
#define DOT_PH 0
#endif

/* Whether p, a fast bf16 call, takes the fp16 streaming tiles: where
 * vdpbf16ps is slow (Intel without AMX) and the fp16 panels exist, calls of
 * CPU_PH_STREAM_MIN_TOK .. CPU_PH_MIN_TOK - 1 tokens (below: vdpbf16ps;
 * from there: the fp16 panels). */
static bool ph_stream_for(const struct moe_matmul_params *p)
{
    const unsigned f = cpu_kernels_features();
    return DOT_PH && p->fast && p->w_dtype == MOE_DTYPE_BF16 && !p->batch_invariant &&
           (f & CPU_FEAT_DPBF16_SLOW) && !(f & CPU_FEAT_AMX_BF16) && (f & CPU_FEAT_AVX512_BF16) &&
           p->n_tok >= CPU_PH_STREAM_MIN_TOK && p->n_tok < CPU_PH_MIN_TOK &&
           cpu_matmul_fp16_panels();
}

static enum dot_kind kind_of(enum moe_dtype wt)
{
    return wt == MOE_DTYPE_I8 ? DOT_I8 : wt == MOE_DTYPE_I4 ? DOT_I4 : DOT_BF16;
}

/* The packed path runs on AMX tiles for this weight type. */
static bool amx_for(enum moe_dtype wt)
{
    unsigned f = cpu_kernels_features();
    return wt == MOE_DTYPE_BF16 ? (f & CPU_FEAT_AMX_BF16) != 0
                                : wt == MOE_DTYPE_I8 && (f & CPU_FEAT_AMX_INT8) != 0;
}

/* I4 takes the dequantize-to-bf16 AMX route (see the top) from this many
 * tokens on: below it the W4A8 streaming tiles read half the bytes. */
#define AMX_MIN_TOK_I4 8

/* The processor can take I4 through the bf16 tiles. */
static bool q4_amx_ok(void)
{
    const unsigned need = CPU_FEAT_AMX_BF16 | CPU_FEAT_AVX512_BF16;
    return (cpu_kernels_features() & need) == need;
}

static bool q4_via_bf16(const struct moe_matmul_params *p)
{
    return p->w_dtype == MOE_DTYPE_I4 && p->n_tok >= AMX_MIN_TOK_I4 && q4_amx_ok();
}

bool cpu_matmul_dot_supported(const struct moe_matmul_params *p)
{
    if (!p->fast || cpu_kernels_isa() != CPU_ISA_AVX512 || p->n_in > DOT_MAX_N_IN)
        return false;
    /* bf16 and int4 pick their tiles (streaming, packed, AMX) by token count
     * and sum floats in each one's order; int8 sums integers exactly
     * whatever the tile (tests/unit/test_matmul_fast.c, batch invariance). */
    if (p->batch_invariant && p->w_dtype != MOE_DTYPE_I8)
        return false;
    unsigned f = cpu_kernels_features();
    /* CPU_FEAT_DPBF16_SLOW without AMX: vdpbf16ps for calls of a few rows,
     * the f32 FMA kernels from CPU_SLOW_DP_FMA_MIN_TOK tokens on (bench-kernels
     * --fast bf16, Emerald Rapids, 2 threads: the FMA kernels at 0.5-0.95x
     * of vdpbf16ps for 1-16 tokens, 1.13-1.88x for 32-512; with the tiles
     * widening by halves (matmul.c), 1.4x at 32-64 and level at 6-16 alone,
     * ahead from 8 in a whole decode step: see cpu_kernels.h) */
    if (p->w_dtype == MOE_DTYPE_BF16)
        return (f & CPU_FEAT_AVX512_BF16) &&
               (!(f & CPU_FEAT_DPBF16_SLOW) || (f & CPU_FEAT_AMX_BF16) ||
                p->n_tok < CPU_SLOW_DP_FMA_MIN_TOK || ph_stream_for(p));
    if (p->w_dtype == MOE_DTYPE_I8 || p->w_dtype == MOE_DTYPE_I4)
        return (f & CPU_FEAT_AVX512_VNNI) != 0;
    return false;
}

const char *cpu_matmul_fast_path(enum moe_dtype wt)
{
    struct moe_matmul_params p = {.fast = true, .w_dtype = wt};
    if (!cpu_matmul_dot_supported(&p)) /* AVX2 int8 / int4: W8A8 / W4A8 tiles in matmul.c */
        return cpu_kernels_isa() != CPU_ISA_AVX2 ? "f32-fma"
               : wt == MOE_DTYPE_I8              ? "avx2-w8a8"
               : wt == MOE_DTYPE_I4              ? "avx2-w4a8"
                                                 : "f32-fma";
    if (wt == MOE_DTYPE_I4 && q4_amx_ok())
        return "avx512-vnni+amx-bf16"; /* W4A8 below AMX_MIN_TOK_I4 tokens */
    if (amx_for(wt))
        return wt == MOE_DTYPE_BF16 ? "amx-bf16" : "amx-int8";
    if (wt == MOE_DTYPE_BF16 && (cpu_kernels_features() & CPU_FEAT_DPBF16_SLOW))
        /* below CPU_SLOW_DP_FMA_MIN_TOK tokens / from there; with AVX512-FP16
         * (gcc builds), fp16 streaming tiles from CPU_PH_STREAM_MIN_TOK and
         * the fp16 panels of matmul.c from CPU_PH_MIN_TOK */
        return cpu_matmul_fp16_panels() && DOT_PH ? "avx512-bf16/fp16-fma" : "avx512-bf16/f32-fma";
    return wt == MOE_DTYPE_BF16 ? "avx512-bf16" : "avx512-vnni";
}

#ifdef DOT_X86

#define DOT_TARGET                                                                                 \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,fma,avx2")))

/* ---------------------------------------------------------------------------
 * Activations: bf16 rows, or u8 rows (xq + 128) with their scales. Rows are
 * ldx elements (a multiple of 64 bytes), zero past n_in. */

DOT_TARGET static void act_bf16_rows(const float *x, int n_in, int r0, int r1, uint16_t *xa,
                                     int ldx)
{
    for (int t = r0; t < r1; t++) {
        const float *xr = x + (size_t)t * n_in;
        uint16_t *d = xa + (size_t)t * ldx;
        for (int k = 0; k < ldx; k += 32) {
            int rem = n_in - k;
            __mmask16 m0 = rem >= 16 ? 0xffff : rem > 0 ? (__mmask16)((1u << rem) - 1u) : 0;
            __mmask16 m1 = rem >= 32 ? 0xffff : rem > 16 ? (__mmask16)((1u << (rem - 16)) - 1u) : 0;
            __m512 lo = _mm512_maskz_loadu_ps(m0, xr + k);
            __m512 hi = _mm512_maskz_loadu_ps(m1, xr + k + 16);
            __m512bh b = _mm512_cvtne2ps_pbh(hi, lo); /* lanes 0..15 from lo */
            _mm512_storeu_si512((void *)(d + k), (__m512i)b);
        }
    }
}

/* Returns the row's scale; NaN when the row holds a NaN or an infinity (the
 * outputs then come out NaN, as on the exact path). */
DOT_TARGET static float act_u8_row(const float *xr, int n_in, uint8_t *d, int ldx)
{
    __m512 amax = _mm512_setzero_ps(), bad = _mm512_setzero_ps();
    for (int k = 0; k < n_in; k += 16) {
        __mmask16 m = n_in - k >= 16 ? 0xffff : (__mmask16)((1u << (n_in - k)) - 1u);
        __m512 v = _mm512_maskz_loadu_ps(m, xr + k);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
        bad = _mm512_add_ps(bad, _mm512_mul_ps(v, _mm512_setzero_ps())); /* NaN if inf / NaN */
    }
    float a = _mm512_reduce_max_ps(amax);
    if (isnan(_mm512_reduce_add_ps(bad))) {
        memset(d, 128, (size_t)ldx);
        return NAN;
    }
    if (a == 0.0f) {
        memset(d, 128, (size_t)ldx);
        return 0.0f;
    }
    const __m512 inv = _mm512_set1_ps(127.0f / a);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    const __m512i off = _mm512_set1_epi32(128);
    for (int k = 0; k < ldx; k += 16) {
        int rem = n_in - k;
        __mmask16 m = rem >= 16 ? 0xffff : rem > 0 ? (__mmask16)((1u << rem) - 1u) : 0;
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + k), inv);
        __m512i q = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), off);
        _mm_storeu_si128((__m128i *)(d + k), _mm512_cvtusepi32_epi8(q));
    }
    return a / 127.0f;
}

/* The I4 path's activations: as act_u8_row, signed (no +128 offset). */
DOT_TARGET static float act_s8_row(const float *xr, int n_in, int8_t *d, int ldx)
{
    float sx = act_u8_row(xr, n_in, (uint8_t *)d, ldx);
    for (int k = 0; k < ldx; k += 64) { /* u - 128, in place */
        __m512i u = _mm512_loadu_si512((const void *)(d + k));
        _mm512_storeu_si512((void *)(d + k), _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80)));
    }
    return sx;
}

/* sum_k xq_k of a signed row (ldx a multiple of 64; zeros past n_in). */
DOT_TARGET static int32_t act_s8_sum(const int8_t *d, int ldx)
{
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i acc = _mm512_setzero_si512();
    for (int k = 0; k < ldx; k += 64)
        acc = _mm512_dpbusd_epi32(acc, ones, _mm512_loadu_si512((const void *)(d + k)));
    return _mm512_reduce_add_epi32(acc);
}

/* ---------------------------------------------------------------------------
 * The dot-product step, by kind: acc += x . w over one 64-byte vector
 * (32 bf16 pairs' worth, or 64 u8 x s8 quads' worth) */

DOT_TARGET static inline __attribute__((always_inline)) __m512 dot_bf16(__m512 acc, __m512i x,
                                                                        __m512i w)
{
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
}

/* acc += u8 x s8 quads. gcc 12 wraps the _mm512_dpbusd_epi32 builtin in
 * register copies (3 instructions per step, measured 2.7x slower in the
 * packed kernel); the instruction itself, with its accumulator tied. */
DOT_TARGET static inline __attribute__((always_inline)) __m512i dot_u8s8(__m512i acc, __m512i x_u8,
                                                                         __m512i w_s8)
{
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x_u8), "vm"(w_s8));
    return acc;
}

/* 64 bytes of a weight row from element k on; elements past n_in read as 0
 * (and are not read). */
DOT_TARGET static inline __attribute__((always_inline)) __m512i
load_w(const enum dot_kind K, const char *row, int k, int n_in)
{
    int rem = n_in - k;
    if (K == DOT_BF16) {
        const char *at = row + (size_t)k * 2;
        if (rem >= 32)
            return _mm512_loadu_si512((const void *)at);
        return _mm512_maskz_loadu_epi16(rem > 0 ? (__mmask32)((1u << rem) - 1u) : 0, at);
    }
    const char *at = row + k;
    if (rem >= 64)
        return _mm512_loadu_si512((const void *)at);
    return _mm512_maskz_loadu_epi8(rem > 0 ? (__mmask64)((1ull << rem) - 1ull) : 0, at);
}

/* Lane i of the result = the sum of the 16 lanes of v[i]; float adds, or
 * int32 adds (the bits of v are i32) with `ints`. */
DOT_TARGET static inline __attribute__((always_inline)) __m512 add2(bool ints, __m512 a, __m512 b)
{
    if (ints)
        return _mm512_castsi512_ps(
            _mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
    return _mm512_add_ps(a, b);
}

DOT_TARGET static inline __attribute__((always_inline)) __m512 hsum16(bool ints, __m512 v[16])
{
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* 128-bit lanes: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = add2(ints, _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                    _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* 128-bit lanes: partial sums of v[4i .. 4i+3] */
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = add2(ints, _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                    _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)
        w[i] = add2(ints, _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                    _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
    return add2(ints, _mm512_shuffle_f32x4(w[0], w[1], 0x88),
                _mm512_shuffle_f32x4(w[0], w[1], 0xdd));
}

/* ---------------------------------------------------------------------------
 * Streaming tiles: T tokens x R weight rows, one pass over n_in. Outputs
 * f32 sums (BF16) or offset-corrected i32 sums (I8) into out. */

union dot_out {
    float f[DT_T][DT_R];
    int32_t i[DT_T][DT_R];
};

/* I8: xa holds signed xq (zero past n_in) and xs[t] = sum_k xq_tk; the
 * weights go in as the unsigned operand, q + 128 (see the top). */
DOT_TARGET static inline __attribute__((always_inline)) void
mk_stream(const enum dot_kind K, const int T, const int R, const char *xa, int64_t ldxb,
          const int32_t *xs, const char *w, int64_t ldwb, const char *pf, int n_in,
          union dot_out *out)
{
    const int V = K == DOT_BF16 ? 32 : 64; /* elements per vector */
    const int esz = K == DOT_BF16 ? 2 : 1;
    /* Accumulators typed per kind (a cast array makes gcc keep them in memory). */
    __m512 accf[DT_T][DT_R];
    __m512i acci[DT_T][DT_R];
    const __m512i flip = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            if (K == DOT_BF16)
                accf[t][r] = _mm512_setzero_ps();
            else
                acci[t][r] = _mm512_setzero_si512();
        }
    /* pf: the next register tile's rows (same stride), prefetched as far
     * ahead as this one reads, into L2 only (T1). Measured on a Zen 4: T1
     * made 16-sequence decode 12% faster in bf16 and 7% in int8 than T0 (T2
     * alike, batch 1 unchanged; unmeasured on Intel). The likely reason: the
     * tile's activation rows (up to 6 x 2 KB) keep their L1 lines while the
     * weights stream through. */
    int k = 0;
    for (; k + V <= n_in; k += V) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            _mm_prefetch(pf + r * ldwb + (int64_t)k * esz, _MM_HINT_T1);
        __m512i xv[DT_T];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            xv[t] = _mm512_loadu_si512((const void *)(xa + t * ldxb + (int64_t)k * esz));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m512i wv = _mm512_loadu_si512((const void *)(w + r * ldwb + (int64_t)k * esz));
            if (K == DOT_I8)
                wv = _mm512_xor_si512(wv, flip);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                if (K == DOT_BF16)
                    accf[t][r] = dot_bf16(accf[t][r], xv[t], wv);
                else
                    acci[t][r] = dot_u8s8(acci[t][r], wv, xv[t]);
            }
        }
    }
    if (k < n_in) {
        __m512i xv[DT_T];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            xv[t] = _mm512_loadu_si512((const void *)(xa + t * ldxb + (int64_t)k * esz));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m512i wv = load_w(K, w + r * ldwb, k, n_in); /* past n_in: 128, times xq = 0 */
            if (K == DOT_I8)
                wv = _mm512_xor_si512(wv, flip);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                if (K == DOT_BF16)
                    accf[t][r] = dot_bf16(accf[t][r], xv[t], wv);
                else
                    acci[t][r] = dot_u8s8(acci[t][r], wv, xv[t]);
            }
        }
    }
    if (T == DT_T && R == DT_R) {
        /* All 16 sums at once: a 4-level add tree into one vector
         * (lane t * 4 + r), a third of the instructions of 16 reductions. */
        __m512 v[16];
#pragma GCC unroll 4
        for (int t = 0; t < DT_T; t++)
#pragma GCC unroll 4
            for (int r = 0; r < DT_R; r++)
                v[t * DT_R + r] = K == DOT_BF16 ? accf[t][r] : _mm512_castsi512_ps(acci[t][r]);
        __m512 sums = hsum16(K == DOT_I8, v);
        if (K == DOT_BF16) {
            _mm512_storeu_ps(&out->f[0][0], sums);
        } else {
            __m512i off = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int t = 0; t < DT_T; t++)
                off = _mm512_mask_set1_epi32(off, (__mmask16)(0xfu << (4 * t)), 128 * xs[t]);
            _mm512_storeu_si512((void *)&out->i[0][0],
                                _mm512_sub_epi32(_mm512_castps_si512(sums), off));
        }
        return;
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            if (K == DOT_BF16)
                out->f[t][r] = _mm512_reduce_add_ps(accf[t][r]);
            else
                out->i[t][r] = _mm512_reduce_add_epi32(acci[t][r]) - 128 * xs[t];
        }
}

/* One token against DT_R weight rows (row r at w + r * ldwb), the sums left
 * as vectors in acc[r]: the single-token tile. With one token a 4 x 4 tile
 * holds only 4 sums, so each row paid a whole horizontal sum (~25% of a
 * 128-wide row's samples in the draft model's GEMVs); task_stream_tok1
 * reduces 4 such tiles in one add tree. The rows stay DT_R streams (16
 * would outrun the prefetchers: 10% slower decode at n_in 1024). */
DOT_TARGET static inline __attribute__((always_inline)) void
mk_stream1(const enum dot_kind K, const char *xa, const char *w, int64_t ldwb, const char *pf,
           int n_in, __m512 acc[DT_R])
{
    const int V = K == DOT_BF16 ? 32 : 64;
    const int esz = K == DOT_BF16 ? 2 : 1;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 accf[DT_R];
    __m512i acci[DT_R];
#pragma GCC unroll 4
    for (int r = 0; r < DT_R; r++) {
        accf[r] = _mm512_setzero_ps();
        acci[r] = _mm512_setzero_si512();
    }
    int k = 0;
    for (; k + V <= n_in; k += V) {
#pragma GCC unroll 4
        for (int r = 0; r < DT_R; r++)
            _mm_prefetch(pf + r * ldwb + (int64_t)k * esz, _MM_HINT_T1); /* as mk_stream */
        const __m512i xv = _mm512_loadu_si512((const void *)(xa + (int64_t)k * esz));
#pragma GCC unroll 4
        for (int r = 0; r < DT_R; r++) {
            __m512i wv = _mm512_loadu_si512((const void *)(w + r * ldwb + (int64_t)k * esz));
            if (K == DOT_BF16)
                accf[r] = dot_bf16(accf[r], xv, wv);
            else
                acci[r] = dot_u8s8(acci[r], _mm512_xor_si512(wv, flip), xv);
        }
    }
    if (k < n_in) {
        const __m512i xv = _mm512_loadu_si512((const void *)(xa + (int64_t)k * esz));
#pragma GCC unroll 4
        for (int r = 0; r < DT_R; r++) {
            __m512i wv = load_w(K, w + r * ldwb, k, n_in); /* past n_in: 128, times xq = 0 */
            if (K == DOT_BF16)
                accf[r] = dot_bf16(accf[r], xv, wv);
            else
                acci[r] = dot_u8s8(acci[r], _mm512_xor_si512(wv, flip), xv);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < DT_R; r++)
        acc[r] = K == DOT_BF16 ? accf[r] : _mm512_castsi512_ps(acci[r]);
}

/* I4: the codes of columns [k, k + 64) of a row (common/quant.h layout) as 64
 * unsigned bytes in column order; a step past n_in (n_in % 64 == 32) reads
 * only its first block and gives zero codes for the rest. */
DOT_TARGET static inline __attribute__((always_inline)) __m512i q4_codes64(const uint8_t *row,
                                                                           int k, int n_in)
{
    const __m256i mask = _mm256_set1_epi8(0x0f);
    __m256i b = n_in - k >= 64 ? _mm256_loadu_si256((const __m256i *)(row + k / 2))
                               : _mm256_maskz_loadu_epi8(0xffff, row + k / 2);
    __m256i lo = _mm256_and_si256(b, mask);                       /* [k, k+16), [k+32, k+48) */
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask); /* [k+16, k+32), [k+48, k+64) */
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0)); /* 128-bit lanes lo0 hi0 lo1 hi1 */
}

/* I4 streaming tile: T tokens x R rows o, o + step, ... (see the top);
 * the next tile starts at row o + next. out gets sum_g s_g sum (u - 8) xq
 * per (token, row): times sx_t is y. */
DOT_TARGET static inline __attribute__((always_inline)) void
mk_q4_acc(const int T, const int R, const int8_t *xa, int64_t ldxb,
          const struct moe_matmul_params *p, int o, int step, int next, __m512 v[16])
{
    const int n_in = p->n_in, group = p->w_group;
    const int64_t ldb = p->ldw / 2 * step, lds = moe_q4_groups(p->ldw, group) * step;
    const uint8_t *rows = (const uint8_t *)p->w + (int64_t)o * (p->ldw / 2);
    const uint8_t *pf = rows + (int64_t)next * (p->ldw / 2);
    const float *sc = p->w_scale + (int64_t)o * moe_q4_groups(p->ldw, group);
    const __m512i ones = _mm512_set1_epi8(1);
    __m512 acc[DT_T][DT_R];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[t][r] = _mm512_setzero_ps();
    for (int k = 0; k < n_in; k += 64) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            _mm_prefetch((const char *)(pf + r * ldb + k / 2), _MM_HINT_T0);
        __m512i xv[DT_T], base[DT_T];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            xv[t] = _mm512_loadu_si512((const void *)(xa + t * ldxb + k));
            /* -8 x (the 4-column sums of xq): the accumulator's start */
            base[t] = _mm512_sub_epi32(
                _mm512_setzero_si512(),
                _mm512_slli_epi32(dot_u8s8(_mm512_setzero_si512(), ones, xv[t]), 3));
        }
        /* lanes 0-7 are columns [k, k+32), lanes 8-15 [k+32, k+64) */
        const int g0 = k / group, g1 = (k + 32) / group;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m512i u = q4_codes64(rows + r * ldb, k, n_in);
            const float *sr = sc + r * lds;
            const __m512 sv = g0 == g1 || k + 32 >= n_in
                                  ? _mm512_set1_ps(sr[g0])
                                  : _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(sr[g0]),
                                                         _mm512_set1_ps(sr[g1]));
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                acc[t][r] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_u8s8(base[t], u, xv[t])), sv, acc[t][r]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < DT_T; t++)
#pragma GCC unroll 4
        for (int r = 0; r < DT_R; r++)
            v[t * DT_R + r] = t < T && r < R ? acc[t][r] : _mm512_setzero_ps();
}

/* mk_q4_acc's sums: one add tree for every tile shape (zeros where the tile
 * is short), so a token's result does not depend on the tokens beside it
 * (the single-token tiles of task_stream_tok1 share the tree's order). */
DOT_TARGET static inline __attribute__((always_inline)) void
mk_q4_dot(const int T, const int R, const int8_t *xa, int64_t ldxb,
          const struct moe_matmul_params *p, int o, int step, int next, float out[DT_T][DT_R])
{
    __m512 v[16];
    mk_q4_acc(T, R, xa, ldxb, p, o, step, next, v);
    _mm512_storeu_ps(&out[0][0], hsum16(false, v));
}

DOT_TARGET static void mk_q4_dot_any(int T, int R, const int8_t *xa, int64_t ldxb,
                                     const struct moe_matmul_params *p, int o, int step, int next,
                                     float out[DT_T][DT_R])
{
#define Q4D_CASE(TT, RR)                                                                           \
    case (TT)*8 + (RR): mk_q4_dot(TT, RR, xa, ldxb, p, o, step, next, out); return;
    switch (T * 8 + R) {
        Q4D_CASE(1, 4)
        Q4D_CASE(2, 4)
        Q4D_CASE(3, 4)
        Q4D_CASE(4, 4)
        Q4D_CASE(1, 1)
        Q4D_CASE(2, 1)
        Q4D_CASE(3, 1)
        Q4D_CASE(4, 1)
    default: break;
    }
#undef Q4D_CASE
    MOE_ASSERT(0 && "mk_q4_dot_any: unsupported tile");
}

DOT_TARGET static void mk_stream_any(enum dot_kind kind, int T, int R, const char *xa, int64_t ldxb,
                                     const int32_t *xs, const char *w, int64_t ldwb, const char *pf,
                                     int n_in, union dot_out *out)
{
#define DS_CASE(TT, RR)                                                                            \
    case (TT)*8 + (RR): mk_stream(DOT_BF16, TT, RR, xa, ldxb, xs, w, ldwb, pf, n_in, out); return; \
    case 64 + (TT)*8 + (RR):                                                                       \
        mk_stream(DOT_I8, TT, RR, xa, ldxb, xs, w, ldwb, pf, n_in, out);                           \
        return;
    switch ((kind == DOT_I8 ? 64 : 0) + T * 8 + R) {
        DS_CASE(1, 4)
        DS_CASE(2, 4)
        DS_CASE(3, 4)
        DS_CASE(4, 4)
        DS_CASE(1, 1)
        DS_CASE(2, 1)
        DS_CASE(3, 1)
        DS_CASE(4, 1)
    default: break;
    }
#undef DS_CASE
    MOE_ASSERT(0 && "mk_stream_any: unsupported tile");
}

/* ---------------------------------------------------------------------------
 * Packed panels: rows [o, o + R) (R <= DP_R) as dword groups of k,
 * panel[g * DP_R + r] = the group-th pair (bf16) / quad (int8) of row r;
 * rows past R and elements past n_in are zero. n_grp = groups per row
 * (whole vectors). I8: rs[r] = sum_k q_rk. */

DOT_TARGET static void pack_panel(enum dot_kind kind, const char *w, int64_t ldwb, int n_in, int R,
                                  int n_grp, int32_t *panel, int32_t rs[DP_R])
{
    const int V = kind == DOT_BF16 ? 32 : 64;
    const __m512i ones = _mm512_set1_epi8(1);
    for (int r0 = 0; r0 < DP_R; r0 += 16) {
        const int rr = R - r0 < 16 ? (R - r0 > 0 ? R - r0 : 0) : 16;
        __m512i sum = _mm512_setzero_si512();
        for (int g0 = 0; g0 < n_grp; g0 += 16) {
            const int k = g0 / 16 * V;
            __m512 v[16];
            for (int i = 0; i < 16; i++)
                v[i] = i < rr
                           ? _mm512_castsi512_ps(
                                 kind == DOT_BF16 ? load_w(DOT_BF16, w + (r0 + i) * ldwb, k, n_in)
                                                  : load_w(DOT_I8, w + (r0 + i) * ldwb, k, n_in))
                           : _mm512_setzero_ps();
            transpose16_avx512(v); /* v[j] = group g0 + j of rows r0 .. r0 + 15 */
            for (int j = 0; j < 16; j++) {
                __m512i g = _mm512_castps_si512(v[j]);
                if (kind == DOT_I8)
                    sum = _mm512_dpbusd_epi32(sum, ones, g);
                _mm512_storeu_si512((void *)(panel + (size_t)(g0 + j) * DP_R + r0), g);
            }
        }
        if (kind == DOT_I8)
            _mm512_storeu_si512((void *)(rs + r0), sum);
    }
}

/* T tokens (rows of xa from xt) x the panel's 32 rows, into y (row stride
 * ldy) at output columns masked by m0 / m1. I8: scales sx (T) and sw (32,
 * zero past R), row sums rs. */
DOT_TARGET static inline __attribute__((always_inline)) void
mk_packed(const enum dot_kind K, const int T, const char *xt, int64_t ldxb, int n_grp,
          const int32_t *panel, float *y, int64_t ldy, __mmask16 m0, __mmask16 m1, bool accumulate,
          const float *sx, const float *sw, const int32_t *rs)
{
    __m512 accf[DP_T][2];
    __m512i acci[DP_T][2];
#pragma GCC unroll 12
    for (int t = 0; t < T; t++) {
        if (K == DOT_BF16) {
            accf[t][0] = _mm512_setzero_ps();
            accf[t][1] = _mm512_setzero_ps();
        } else {
            acci[t][0] = _mm512_setzero_si512();
            acci[t][1] = _mm512_setzero_si512();
        }
    }
    for (int g = 0; g < n_grp; g++) {
        __m512i w0 = _mm512_loadu_si512((const void *)(panel + (size_t)g * DP_R));
        __m512i w1 = _mm512_loadu_si512((const void *)(panel + (size_t)g * DP_R + 16));
#pragma GCC unroll 12
        for (int t = 0; t < T; t++) {
            int32_t xg;
            memcpy(&xg, xt + t * ldxb + (int64_t)g * 4, 4);
            __m512i xb = _mm512_set1_epi32(xg);
            if (K == DOT_BF16) {
                accf[t][0] = dot_bf16(accf[t][0], xb, w0);
                accf[t][1] = dot_bf16(accf[t][1], xb, w1);
            } else {
                acci[t][0] = dot_u8s8(acci[t][0], xb, w0);
                acci[t][1] = dot_u8s8(acci[t][1], xb, w1);
            }
        }
    }
    __m512i off0 = _mm512_setzero_si512(), off1 = off0;
    __m512 sw0 = _mm512_setzero_ps(), sw1 = sw0;
    if (K == DOT_I8) {
        off0 = _mm512_slli_epi32(_mm512_loadu_si512((const void *)rs), 7);
        off1 = _mm512_slli_epi32(_mm512_loadu_si512((const void *)(rs + 16)), 7);
        sw0 = _mm512_loadu_ps(sw);
        sw1 = _mm512_loadu_ps(sw + 16);
    }
#pragma GCC unroll 12
    for (int t = 0; t < T; t++) {
        __m512 v0, v1;
        if (K == DOT_BF16) {
            v0 = accf[t][0];
            v1 = accf[t][1];
        } else {
            __m512 s = _mm512_set1_ps(sx[t]);
            v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acci[t][0], off0)),
                               _mm512_mul_ps(s, sw0));
            v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acci[t][1], off1)),
                               _mm512_mul_ps(s, sw1));
        }
        float *yt = y + t * ldy;
        if (accumulate) {
            v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, yt), v0);
            v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, yt + 16), v1);
        }
        _mm512_mask_storeu_ps(yt, m0, v0);
        _mm512_mask_storeu_ps(yt + 16, m1, v1);
    }
}

DOT_TARGET static void mk_packed_any(enum dot_kind kind, int T, const char *xt, int64_t ldxb,
                                     int n_grp, const int32_t *panel, float *y, int64_t ldy,
                                     __mmask16 m0, __mmask16 m1, bool accumulate, const float *sx,
                                     const float *sw, const int32_t *rs)
{
#define DP_CASE(TT)                                                                                \
    case TT:                                                                                       \
        if (kind == DOT_BF16)                                                                      \
            mk_packed(DOT_BF16, TT, xt, ldxb, n_grp, panel, y, ldy, m0, m1, accumulate, sx, sw,    \
                      rs);                                                                         \
        else                                                                                       \
            mk_packed(DOT_I8, TT, xt, ldxb, n_grp, panel, y, ldy, m0, m1, accumulate, sx, sw, rs); \
        return;
    switch (T) {
        DP_CASE(1)
        DP_CASE(2)
        DP_CASE(3)
        DP_CASE(4)
        DP_CASE(5)
        DP_CASE(6)
        DP_CASE(7)
        DP_CASE(8)
        DP_CASE(9)
        DP_CASE(10)
        DP_CASE(11)
        DP_CASE(12)
    default: break;
    }
#undef DP_CASE
    MOE_ASSERT(0 && "mk_packed_any: unsupported tile");
}

/* ---------------------------------------------------------------------------
 * AMX tiles (see the top). Tile registers: 0-3 the 2 x 2 accumulators
 * (tokens 0-15 / 16-31 x panel rows 0-15 / 16-31), 4-5 activations, 6-7
 * the panel's two halves; all 16 rows x 64 bytes. */

#define AMX_T 32 /* tokens per step: two A tiles */
/* AMX from this many tokens on (bench-kernels --fast, Xeon with AMX, weights
 * hot and cold alike): bf16 1.2x the streaming tiles at 8 tokens, 2.2x at
 * 16 (vdpbf16ps reaches only ~110 GFLOP/s a core there); int8 0.75x at 8,
 * 1.3-1.5x at 16 (vpdpbusd is 3x vdpbf16ps). */
#define AMX_MIN_TOK_BF16 8
#define AMX_MIN_TOK_I8 16
/* The weight-stationary kernel (amx_stream_block) for calls of
 * AMX_STREAM_MIN_* .. AMX_STREAM_MAX - 1 tokens, the decode-sized ones. Weights
 * from memory, one thread (bench-kernels --fast): bf16 at 4 / 8 / 16 tokens
 * 1.1x / 1.5x / 2.5x the streaming tiles (13-16 GB/s against 16 for one
 * token); int8 at 4 tokens 0.85-1.05x, at 8 1.0-1.2x, at 16 1.4-1.7x. */
#define AMX_STREAM_MIN_BF16 2
#define AMX_STREAM_MIN_I8 8
#define AMX_STREAM_MAX 32

/* T (1..32) tokens from xt x the panel's 32 rows, over n_ks 64-byte steps
 * of k, into out (32 x 32, f32 for BF16, i32 for I8). Rows of xt past T
 * are read (the buffer is padded to whole tiles) and their outputs dropped
 * by the caller. */
static void amx_block(enum dot_kind kind, int T, const char *xt, int64_t ldxb, int n_ks,
                      const int32_t *panel, int32_t out[AMX_T][DP_R])
{
    const int64_t ldp = DP_R * 4; /* bytes per panel row */
    __asm__ volatile("tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3" ::
                         : "memory");
    const char *b = (const char *)panel;
#define AMX_STEP(insn, two)                                                                        \
    for (int ks = 0; ks < n_ks; ks++, b += 16 * ldp) {                                             \
        const char *a = xt + (int64_t)ks * 64;                                                     \
        AMX_LOAD(6, b, ldp);                                                                       \
        AMX_LOAD(7, b + 64, ldp);                                                                  \
        AMX_LOAD(4, a, ldxb);                                                                      \
        AMX_DP(insn, 0, 4, 6);                                                                     \
        AMX_DP(insn, 1, 4, 7);                                                                     \
        if (two) {                                                                                 \
            AMX_LOAD(5, a + 16 * ldxb, ldxb);                                                      \
            AMX_DP(insn, 2, 5, 6);                                                                 \
            AMX_DP(insn, 3, 5, 7);                                                                 \
        }                                                                                          \
    }
    if (kind == DOT_BF16) {
        if (T > 16)
            AMX_STEP("tdpbf16ps", 1)
        else
            AMX_STEP("tdpbf16ps", 0)
    } else {
        if (T > 16)
            AMX_STEP("tdpbssd", 1)
        else
            AMX_STEP("tdpbssd", 0)
    }
#undef AMX_STEP
    const int64_t ldo = DP_R * 4;
    AMX_STORE(0, &out[0][0], ldo);
    AMX_STORE(1, &out[0][16], ldo);
    if (T > 16) {
        AMX_STORE(2, &out[16][0], ldo);
        AMX_STORE(3, &out[16][16], ldo);
    }
}

/* out (T x 32) into y at columns masked by m0 / m1; I8: the VNNI path's
 * scaling, (float)sum * (sx_t * sw_r). */
DOT_TARGET static void amx_write(enum dot_kind kind, int T, int32_t out[AMX_T][DP_R], float *y,
                                 int64_t ldy, __mmask16 m0, __mmask16 m1, bool accumulate,
                                 const float *sx, const float *sw)
{
    __m512 sw0 = _mm512_setzero_ps(), sw1 = sw0;
    if (kind == DOT_I8) {
        sw0 = _mm512_loadu_ps(sw);
        sw1 = _mm512_loadu_ps(sw + 16);
    }
    for (int t = 0; t < T; t++) {
        __m512 v0, v1;
        if (kind == DOT_BF16) {
            v0 = _mm512_loadu_ps((const float *)&out[t][0]);
            v1 = _mm512_loadu_ps((const float *)&out[t][16]);
        } else {
            __m512 s = _mm512_set1_ps(sx[t]);
            v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)&out[t][0])),
                               _mm512_mul_ps(s, sw0));
            v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)&out[t][16])),
                               _mm512_mul_ps(s, sw1));
        }
        float *yt = y + t * ldy;
        if (accumulate) {
            v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, yt), v0);
            v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, yt + 16), v1);
        }
        _mm512_mask_storeu_ps(yt, m0, v0);
        _mm512_mask_storeu_ps(yt + 16, m1, v1);
    }
}

/* Weight-stationary AMX, for decode-sized calls (AMX_STREAM_MIN_* ..
 * AMX_STREAM_MAX - 1 tokens, n_in a whole number of 64-byte steps): the roles swap,
 * so nothing is packed per weight row. The A operand is 16 weight rows
 * straight from memory (stride ldw), the B operand 16 tokens' activations
 * transposed once per call into dword groups (xb: per 16-token group and
 * 64-byte step of k, 16 rows (k pairs / quads) x 16 tokens), and C is
 * 16 weight rows x 16 tokens, transposed on the way out. A block is 32
 * weight rows x up to 32 tokens (2 x 2 tiles). */

/* xb from the activation rows (tokens past n_tok are zero). */
DOT_TARGET static void amx_pack_act(const char *xa, int64_t ldxb, int n_tok, int n_ks, char *xb)
{
    for (int tg = 0; tg * 16 < n_tok; tg++)
        for (int ks = 0; ks < n_ks; ks++) {
            __m512 v[16];
            for (int i = 0; i < 16; i++) {
                int t = tg * 16 + i;
                v[i] = t < n_tok ? _mm512_loadu_ps((const float *)(xa + t * ldxb + ks * 64))
                                 : _mm512_setzero_ps();
            }
            transpose16_avx512(v); /* v[j]: dword j of k of tokens 0..15 */
            char *d = xb + ((size_t)tg * n_ks + (size_t)ks) * 1024;
            for (int j = 0; j < 16; j++)
                _mm512_storeu_ps((float *)(d + j * 64), v[j]);
        }
}

/* 32 weight rows from w (stride ldwb) x G (1, 2) token groups of xb into
 * out[token group][row group][row][token]. */
static void amx_stream_block(enum dot_kind kind, int G, const char *w, int64_t ldwb, int n_ks,
                             const char *xb, int32_t out[2][2][16][16])
{
    __asm__ volatile("tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3" ::
                         : "memory");
    const char *b1 = xb + (size_t)n_ks * 1024;
#define AMX_WSTEP(insn, two)                                                                       \
    for (int ks = 0; ks < n_ks; ks++) {                                                            \
        const char *a = w + (int64_t)ks * 64;                                                      \
        AMX_LOAD(4, a, ldwb);                                                                      \
        AMX_LOAD(5, a + 16 * ldwb, ldwb);                                                          \
        AMX_LOAD(6, xb + (size_t)ks * 1024, 64);                                                   \
        AMX_DP(insn, 0, 4, 6);                                                                     \
        AMX_DP(insn, 1, 5, 6);                                                                     \
        if (two) {                                                                                 \
            AMX_LOAD(7, b1 + (size_t)ks * 1024, 64);                                               \
            AMX_DP(insn, 2, 4, 7);                                                                 \
            AMX_DP(insn, 3, 5, 7);                                                                 \
        }                                                                                          \
    }
    if (kind == DOT_BF16) {
        if (G > 1)
            AMX_WSTEP("tdpbf16ps", 1)
        else
            AMX_WSTEP("tdpbf16ps", 0)
    } else {
        if (G > 1)
            AMX_WSTEP("tdpbssd", 1)
        else
            AMX_WSTEP("tdpbssd", 0)
    }
#undef AMX_WSTEP
    AMX_STORE(0, &out[0][0][0][0], 64);
    AMX_STORE(1, &out[0][1][0][0], 64);
    if (G > 1) {
        AMX_STORE(2, &out[1][0][0][0], 64);
        AMX_STORE(3, &out[1][1][0][0], 64);
    }
}

/* out (rows x tokens) into y[t][o ..], transposed; T tokens, R rows, row
 * r of the block at column r * step (step 1: contiguous, masked stores;
 * else scattered, all 32 rows). */
DOT_TARGET static void amx_stream_write(enum dot_kind kind, int T, int R, int step,
                                        int32_t out[2][2][16][16], float *y, int64_t ldy,
                                        bool accumulate, const float *sx, const float *sw)
{
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int tg = 0; tg * 16 < T; tg++)
        for (int rg = 0; rg * 16 < R; rg++) {
            const int rr = R - rg * 16 < 16 ? R - rg * 16 : 16;
            const __mmask16 m = rr == 16 ? (__mmask16)0xffff : (__mmask16)((1u << rr) - 1u);
            __m512 v[16];
            for (int r = 0; r < 16; r++)
                v[r] = _mm512_loadu_ps((const float *)out[tg][rg][r]);
            transpose16_avx512(v); /* v[t]: rows of token t */
            __m512 swv =
                kind == DOT_I8 ? _mm512_maskz_loadu_ps(m, sw + rg * 16) : _mm512_setzero_ps();
            const int nt = T - tg * 16 < 16 ? T - tg * 16 : 16;
            for (int t = 0; t < nt; t++) {
                const int tt = tg * 16 + t;
                __m512 o = v[t];
                if (kind == DOT_I8)
                    o = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_castps_si512(o)),
                                      _mm512_mul_ps(_mm512_set1_ps(sx[tt]), swv));
                if (step > 1) {
                    const __m512i idx =
                        _mm512_mullo_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(rg * 16)),
                                           _mm512_set1_epi32(step));
                    float *yt = y + tt * ldy;
                    if (accumulate)
                        o = _mm512_add_ps(_mm512_i32gather_ps(idx, yt, 4), o);
                    _mm512_i32scatter_ps(yt, idx, o, 4);
                    continue;
                }
                float *yt = y + tt * ldy + rg * 16;
                if (accumulate)
                    o = _mm512_add_ps(_mm512_maskz_loadu_ps(m, yt), o);
                _mm512_mask_storeu_ps(yt, m, o);
            }
        }
}

/* Rows [o, o + R) of I4 weights as bf16 rows of ldx elements (zero past
 * n_in), and zero rows up to DP_R: w = (u - 8) d_g, rounded to nearest even. */
DOT_TARGET static void q4_rows_bf16(const struct moe_matmul_params *p, int o, int R, uint16_t *dst,
                                    int ldx)
{
    const int64_t ldb = p->ldw / 2, lds = moe_q4_groups(p->ldw, p->w_group);
    const __m128i lo4 = _mm_set1_epi8(0x0f);
    const __m512i eight = _mm512_set1_epi32(8);
    for (int r = 0; r < DP_R; r++) {
        uint16_t *d = dst + (size_t)r * ldx;
        int k = 0;
        if (r < R) {
            const uint8_t *codes = (const uint8_t *)p->w + (int64_t)(o + r) * ldb;
            const float *sc = p->w_scale + (int64_t)(o + r) * lds;
            for (; k < p->n_in; k += MOE_Q4_BLOCK) { /* a block lies in one group */
                __m128i b = _mm_loadu_si128((const __m128i *)(codes + k / 2));
                __m512i c0 = _mm512_cvtepu8_epi32(_mm_and_si128(b, lo4)); /* columns k .. k+15 */
                __m512i c1 = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), lo4));
                __m512 dg = _mm512_set1_ps(sc[k / p->w_group]);
                __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(c0, eight)), dg);
                __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(c1, eight)), dg);
                _mm512_storeu_si512((void *)(d + k), (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
            }
        }
        if (k < ldx)
            memset(d + k, 0, (size_t)(ldx - k) * sizeof *d);
    }
}

/* ---------------------------------------------------------------------------
 * fp16 streaming (bf16 weights, 8..31 tokens, where vdpbf16ps is slow and the
 * processor has AVX512-FP16: see cpu_kernels.h). Each token's activations
 * are scaled by a power of two to |x| <= 1 and rounded to fp16 once per
 * call (xph, sph); a tile is one weight row against up to PHS_T tokens,
 * lanes over k: each 32 weights are taken to fp16 once, scaled by
 * 2^CPU_PH_STREAM_W_SHIFT, by an integer re-bias (simd_x86.h's
 * fp16_from_bf16_scaled, as the fp16 panels take theirs; exact from 2^-18
 * up) and feed one vfmadd231ph per token. A lane's fp16 sum covers PHS_FLUSH
 * of its columns before it is added in f32. A
 * row holding a weight of CPU_PH_MAX_W / 2^shift or more (its fp16 sums
 * could overflow) is redone on the vdpbf16ps tiles from the bf16
 * activations the job also holds. */
#define PHS_T 16         /* tokens per fp16 streaming tile: 16 accumulators */
#define PHS_FLUSH 32     /* k-vectors a lane sums in fp16 (32 columns of its own) */
#define PHS_L1_COLS 1024 /* widest n_in for the 1 x 16 tile (task_stream_ph) */
#if DOT_PH
#define PH_TARGET                                                                                  \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,avx512fp16,fma,avx2")))

/* The activations' fp16 layout: groups of PHS_T tokens, each group k-block
 * major (32 columns of its PHS_T tokens, 1 KiB, then the next 32), so a
 * tile's loads are one pointer and constant offsets (token t of the group
 * at t x 64 bytes) instead of a register per token. Token t, column k of a
 * call whose rows are ldx halves (a multiple of 32): */
static inline size_t phs_at(int t, int k, int ldx)
{
    return ((size_t)(t / PHS_T) * (size_t)(ldx / 32) + (size_t)(k / 32)) * (PHS_T * 32) +
           (size_t)(t % PHS_T) * 32 + (size_t)(k % 32);
}

/* Token row t of x as fp16 of x / 2^e into the layout above (zero past
 * n_in, up to ldx), 2^e the least power of two above max |x| (1 for a zero
 * row); returns the factor that takes its sums against fp16_from_bf16_scaled's
 * weights back: 2^(e - shift). */
PH_TARGET static float act_ph_row(const float *x, int n_in, uint16_t *xph, int t, int ldx)
{
    const int e = fp16_row_exp(x, n_in);
    const __m512 inv = _mm512_set1_ps(ldexpf(1.0f, -e));
    for (int k = 0; k < ldx; k += 16) {
        const int rem = n_in - k;
        const __mmask16 m = rem >= 16 ? 0xffff : rem > 0 ? (__mmask16)((1u << rem) - 1u) : 0;
        _mm256_storeu_si256((__m256i *)(xph + phs_at(t, k, ldx)), fp16_scaled16(x + k, m, inv));
    }
    return ldexpf(1.0f, e - CPU_PH_STREAM_W_SHIFT);
}

/* sum[r * T + t] = x'_t . w'_r for R rows of bf16 W (ldw apart) and T tokens
 * (xph: the first one's columns in phs_at's layout; R x T <= PHS_T), w' = w x
 * 2^CPU_PH_STREAM_W_SHIFT (fp16_from_bf16_scaled); pf: the rows after, prefetched.
 * Returns a bit set of the rows holding a weight of magnitude CPU_PH_MAX_W /
 * 2^shift or more (their sums unusable). */
PH_TARGET static inline __attribute__((always_inline)) unsigned
mk_stream_ph(const int R, const int T, const uint16_t *xph, const uint16_t *w, int64_t ldw,
             const char *pf, int n_in, float sum[PHS_T])
{
    __m512h acc[PHS_T];
    __m512 fs[PHS_T];
    const __m512i abs_bits = _mm512_set1_epi16(0x7fff);
    /* bf16 bits of CPU_PH_MAX_W / 2^shift (2^(10 - shift): exponent field 137 - shift) */
    const __m512i big = _mm512_set1_epi16((short)((137 - CPU_PH_STREAM_W_SHIFT) << 7));
    _Static_assert(CPU_PH_MAX_W == 1024.0f, "mk_stream_ph's guard is 2^10");
    /* each row's largest |w| bits so far (one vpmaxuw a vector; compared once at the end) */
    __m512i wmax[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                       _mm512_setzero_si512()};
#pragma GCC unroll 16
    for (int i = 0; i < R * T; i++)
        acc[i] = _mm512_setzero_ph();
    int in_lane = 0;
    bool first = true;
    for (int k = 0; k < n_in; k += 32) {
        const int rem = n_in - k;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            _mm_prefetch(pf + (r * ldw + k) * 2, _MM_HINT_T1);
            const __m512i wv = rem >= 32 ? _mm512_loadu_si512((const void *)(w + r * ldw + k))
                                         : _mm512_maskz_loadu_epi16((__mmask32)((1ull << rem) - 1u),
                                                                    w + r * ldw + k);
            const __m512i mag = _mm512_and_si512(wv, abs_bits);
            wmax[r] = _mm512_max_epu16(wmax[r], mag);
            const __m512h wh = fp16_from_bf16_scaled(wv, mag, CPU_PH_STREAM_W_SHIFT);
#pragma GCC unroll 16
            for (int t = 0; t < T; t++)
                acc[r * T + t] =
                    _mm512_fmadd_ph(_mm512_castsi512_ph(_mm512_loadu_si512(
                                        (const void *)(xph + (k / 32) * (PHS_T * 32) + t * 32))),
                                    wh, acc[r * T + t]);
        }
        if (++in_lane == PHS_FLUSH || k + 32 >= n_in) {
#pragma GCC unroll 16
            for (int i = 0; i < R * T; i++) {
                __m512 flo, fhi;
                fp16_to_f32x2(acc[i], &flo, &fhi);
                const __m512 s = _mm512_add_ps(flo, fhi);
                fs[i] = first ? s : _mm512_add_ps(fs[i], s);
                acc[i] = _mm512_setzero_ph();
            }
            in_lane = 0;
            first = false;
        }
    }
    if (first) /* n_in == 0 */
        for (int i = 0; i < R * T; i++)
            fs[i] = _mm512_setzero_ps();
    if (R * T > 8) { /* one transpose-add for all the tile's sums */
        for (int i = R * T; i < PHS_T; i++)
            fs[i] = _mm512_setzero_ps();
        _mm512_storeu_ps(sum, hsum16(false, fs));
    } else {
        for (int i = 0; i < R * T; i++)
            sum[i] = _mm512_reduce_add_ps(fs[i]);
    }
    unsigned rows_bad = 0;
    for (int r = 0; r < R; r++)
        rows_bad |= (_mm512_cmpge_epu16_mask(wmax[r], big) != 0) << r;
    return rows_bad;
}

/* The tiles (rows x tokens): 1 x 16, 2 x 8, and for what is left of a
 * call's tokens past its 8s (1-7) 2 x 5..7 and 4 x 1..4, several rows
 * sharing the end-of-row sums; single rows of every width for a task's
 * leftover rows. */
PH_TARGET static unsigned mk_stream_ph_any(int R, int T, const uint16_t *xph, const uint16_t *w,
                                           int64_t ldw, const char *pf, int n_in, float sum[PHS_T])
{
#define PHS_CASE(RR, TT)                                                                           \
    if (R == RR && T == TT)                                                                        \
        return mk_stream_ph(RR, TT, xph, w, ldw, pf, n_in, sum);
    PHS_CASE(1, 16)
    PHS_CASE(2, 8)
    PHS_CASE(2, 7)
    PHS_CASE(2, 6)
    PHS_CASE(2, 5)
    PHS_CASE(4, 4)
    PHS_CASE(4, 3)
    PHS_CASE(4, 2)
    PHS_CASE(4, 1)
    PHS_CASE(1, 8)
    PHS_CASE(1, 7)
    PHS_CASE(1, 6)
    PHS_CASE(1, 5)
    PHS_CASE(1, 4)
    PHS_CASE(1, 3)
    PHS_CASE(1, 2)
    PHS_CASE(1, 1)
#undef PHS_CASE
    MOE_ASSERT(0 && "mk_stream_ph_any: unsupported tile");
    return ~0u;
}

/* Rows per tile for a tile of T tokens. */
static inline int phs_rows(int T)
{
    return T >= 16 ? 1 : T >= 5 ? 2 : 4;
}
#endif /* DOT_PH */

/* ---------------------------------------------------------------------------
 * Tasks */

struct dot_job {
    const struct moe_matmul_params *p;
    enum dot_kind kind;
    const char *xa; /* (n_tok, ldx) bf16 or u8 activations */
    int64_t ldxb;   /* bytes per activation row */
    int ldx;        /* elements per activation row */
    float *sx;      /* I8, I4: (n_tok) token scales */
    int32_t *xs;    /* I8 streaming: (n_tok) sums of each row's xq */
    bool packed;
    bool amx;        /* AMX tiles (activations signed for I8) */
    bool amx_stream; /* ... weight-stationary (amx_stream_block), xb below */
    bool q4_bf16;    /* I4 weights through the BF16 tiles (kind DOT_BF16), see the top */
    char *xb;        /* amx_stream: the activations as B tiles */
    bool ph;         /* BF16: the fp16 streaming tiles (ph_stream_for); xa stays their fallback */
    uint16_t *xph;   /* ... the activations scaled to fp16 (n_tok, ldx; phs_at's layout) */
    float *sph;      /* ... and each token's power-of-two scale */
    int row_block, n_row_blocks, tok_block;
    char *scratch; /* packed: (n_threads, scratch_stride) panels */
    size_t scratch_stride;
    int n_tasks;
    char *buf; /* the one allocation all of the above live in */
};

static void store_out(const struct moe_matmul_params *p, int t, int o, float v)
{
    float *y = p->y + (size_t)t * p->n_out + o;
    *y = p->accumulate ? *y + v : v;
}

/* A whole streaming tile's 16 outputs, lane l = t * DT_R + r as dot_out
 * and hsum16 hold them: token t of the tile, row r (o + r * step). */
_Static_assert(DT_T == 4 && DT_R == 4, "tile_map: 16 lanes, 4 x 4");
struct tile_map {
    __m512i tok; /* t */
    __m512i row; /* r * step */
    __m512i off; /* t * n_out + r * step: from y[t0][o] to the output */
};

DOT_TARGET static inline struct tile_map tile_map(int n_out, int step)
{
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    struct tile_map m;
    m.tok = _mm512_srli_epi32(lane, 2);
    m.row =
        _mm512_mullo_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(3)), _mm512_set1_epi32(step));
    m.off = _mm512_add_epi32(_mm512_mullo_epi32(m.tok, _mm512_set1_epi32(n_out)), m.row);
    return m;
}

/* Each lane's token scale, from the tile's first token's. */
DOT_TARGET static inline __m512 tile_sx(const struct tile_map *m, const float *sx)
{
    return _mm512_permutexvar_ps(m->tok, _mm512_castps128_ps512(_mm_loadu_ps(sx)));
}

/* The tile's outputs into y (= y[t0][o]), added to what is there when
 * accumulating: store_out's arithmetic, one scatter. */
DOT_TARGET static inline void tile_store(const struct tile_map *m, float *y, __m512 v,
                                         bool accumulate)
{
    if (accumulate)
        v = _mm512_add_ps(_mm512_i32gather_ps(m->off, y, 4), v);
    _mm512_i32scatter_ps(y, m->off, v, 4);
}

/* R rows o, o + step, ... of an I4 streaming task x tokens [t0, t0 + nt). */
DOT_TARGET static void stream_rows_q4(const struct dot_job *j, int t0, int nt, int o, int R,
                                      int step)
{
    const struct moe_matmul_params *p = j->p;
    float out[DT_T][DT_R] __attribute__((aligned(64)));
    const struct tile_map m = tile_map(p->n_out, step);
    for (int t = t0; t < t0 + nt; t += DT_T) {
        int T = t0 + nt - t < DT_T ? t0 + nt - t : DT_T;
        mk_q4_dot_any(T, R, (const int8_t *)j->xa + t * j->ldxb, j->ldxb, p, o, step, 1, out);
        if (T == DT_T && R == DT_R) {
            tile_store(&m, p->y + (size_t)t * p->n_out + o,
                       _mm512_mul_ps(_mm512_load_ps(&out[0][0]), tile_sx(&m, j->sx + t)),
                       p->accumulate);
            continue;
        }
        for (int tt = 0; tt < T; tt++)
            for (int r = 0; r < R; r++)
                store_out(p, t + tt, o + r * step, out[tt][r] * j->sx[t + tt]);
    }
}

/* The rows of a tile from DT_R parts of the task, as task_stream does. */
DOT_TARGET static void task_stream_q4(const struct dot_job *j, int t0, int nt, int o0, int no)
{
    const int q = no / DT_R;
    for (int i = 0; i < q; i++)
        stream_rows_q4(j, t0, nt, o0 + i, DT_R, q);
    for (int o = o0 + DT_R * q; o < o0 + no; o++)
        stream_rows_q4(j, t0, nt, o, 1, 1);
}

/* R rows o, o + step, ... of a streaming task x tokens [t0, t0 + nt); the
 * next tile starts at row o + 1. A whole tile is scaled as the loop for
 * short ones below scales (sx_t * sw_r first) and scattered at once. */
DOT_TARGET static void stream_rows(const struct dot_job *j, int t0, int nt, int o, int R, int step)
{
    const struct moe_matmul_params *p = j->p;
    const int64_t ldwb = p->ldw * (j->kind == DOT_BF16 ? 2 : 1);
    const char *w = (const char *)p->w + o * ldwb;
    union dot_out out;
    const struct tile_map m = tile_map(p->n_out, step);
    const __m512 swv = j->kind == DOT_I8 && R == DT_R
                           ? _mm512_i32gather_ps(m.row, p->w_scale + o, 4)
                           : _mm512_setzero_ps();
    for (int t = t0; t < t0 + nt; t += DT_T) {
        int T = t0 + nt - t < DT_T ? t0 + nt - t : DT_T;
        mk_stream_any(j->kind, T, R, j->xa + t * j->ldxb, j->ldxb, j->xs ? j->xs + t : NULL, w,
                      step * ldwb, w + ldwb, p->n_in, &out);
        if (T == DT_T && R == DT_R) {
            __m512 v = j->kind == DOT_BF16
                           ? _mm512_loadu_ps(&out.f[0][0])
                           : _mm512_mul_ps(
                                 _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)&out.i[0][0])),
                                 _mm512_mul_ps(tile_sx(&m, j->sx + t), swv));
            tile_store(&m, p->y + (size_t)t * p->n_out + o, v, p->accumulate);
            continue;
        }
        for (int tt = 0; tt < T; tt++)
            for (int r = 0; r < R; r++) {
                const int row = o + r * step;
                store_out(p, t + tt, row,
                          j->kind == DOT_BF16
                              ? out.f[tt][r]
                              : (float)out.i[tt][r] * (j->sx[t + tt] * p->w_scale[row]));
            }
    }
}

/* A register tile's DT_R rows come from DT_R equal parts of the task's rows
 * (o0 + i, o0 + q + i, ...), so each thread reads DT_R sequential streams,
 * which the L2 prefetchers serve faster than DT_R neighbouring rows sharing
 * a page or two (Xeon, 2 threads: bench-triad's read probe 30.5-31 GB/s
 * with 4 streams a thread against 22-25 with 1; the 16-sequence int8
 * decode step 27.4 -> 24.2 ms). Row i's result does not depend on the
 * order. */
DOT_TARGET static void task_stream(const struct dot_job *j, int t0, int nt, int o0, int no)
{
    if (j->kind == DOT_I4) {
        task_stream_q4(j, t0, nt, o0, no);
        return;
    }
    const int q = no / DT_R;
    for (int i = 0; i < q; i++)
        stream_rows(j, t0, nt, o0 + i, DT_R, q);
    for (int o = o0 + DT_R * q; o < o0 + no; o++)
        stream_rows(j, t0, nt, o, 1, 1);
}

/* One token, rows [o0, o0 + no): task_stream's tiles (row o0 + i + r q of
 * tile i), four tiles at a time reduced by one add tree (lane i' * 4 + r:
 * tile i + i', row r); the rest as task_stream does them. */
DOT_TARGET static void task_stream_tok1(const struct dot_job *j, int t0, int o0, int no)
{
    const struct moe_matmul_params *p = j->p;
    const int64_t ldwb = p->ldw * (j->kind == DOT_BF16 ? 2 : 1);
    const bool i8 = j->kind == DOT_I8;
    const int q = no / DT_R;
    const struct tile_map m = tile_map(1, q); /* off = i' + r q */
    const char *xa = j->xa + t0 * j->ldxb;
    float *y = p->y + (size_t)t0 * p->n_out;
    const __m512 scale = _mm512_set1_ps(j->kind != DOT_BF16 ? j->sx[t0] : 0.0f);
    const __m512i xs_off = _mm512_set1_epi32(i8 ? 128 * j->xs[t0] : 0);
    int i = 0;
    for (; i + 4 <= q; i += 4) {
        const int o = o0 + i;
        __m512 v[16];
#pragma GCC unroll 4
        for (int ii = 0; ii < 4; ii++) {
            const char *w = (const char *)p->w + (o + ii) * ldwb;
            if (j->kind == DOT_I4) {
                __m512 t1[16];
                mk_q4_acc(1, DT_R, (const int8_t *)xa, j->ldxb, p, o + ii, q, 1, t1);
#pragma GCC unroll 4
                for (int r = 0; r < DT_R; r++)
                    v[4 * ii + r] = t1[r];
            } else if (i8)
                mk_stream1(DOT_I8, xa, w, q * ldwb, w + ldwb, p->n_in, v + 4 * ii);
            else
                mk_stream1(DOT_BF16, xa, w, q * ldwb, w + ldwb, p->n_in, v + 4 * ii);
        }
        __m512 sums = hsum16(i8, v);
        if (j->kind == DOT_I4)
            sums = _mm512_mul_ps(sums, scale);
        else if (i8)
            sums = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_castps_si512(sums), xs_off)),
                _mm512_mul_ps(scale, _mm512_i32gather_ps(m.off, p->w_scale + o, 4)));
        tile_store(&m, y + o, sums, p->accumulate);
    }
    for (; i < q; i++)
        j->kind == DOT_I4 ? stream_rows_q4(j, t0, 1, o0 + i, DT_R, q)
                          : stream_rows(j, t0, 1, o0 + i, DT_R, q);
    for (int o = o0 + DT_R * q; o < o0 + no; o++)
        j->kind == DOT_I4 ? stream_rows_q4(j, t0, 1, o, 1, 1) : stream_rows(j, t0, 1, o, 1, 1);
}

#if DOT_PH
/* One block of nr rows (ob, ob + step, ...; nr 4 or 1) of the fp16 streaming
 * task against tokens [t0, t0 + nt) in tiles of 16, 8 and what is left
 * (1-7), each tile on phs_rows(T) of the block's rows at a time: the
 * block's weights come from memory once, from L1 for its later tiles. */
PH_TARGET static void stream_ph_block(const struct dot_job *j, int t0, int nt, int ob, int nr,
                                      int64_t step)
{
    const struct moe_matmul_params *p = j->p;
    const int64_t ldwb = p->ldw * 2;
    float sum[PHS_T];
    union dot_out out;
    /* 16 tokens on one row while their activations fit L1 beside the
     * weights (n_in <= 1024: 32 KiB); wider, on two rows of 8, which halves
     * the activation loads from L2 (cpu_matmul alone, 2 threads, weights from memory:
     * n_in 2816 1.1x, n_in 1024 0.8x) */
    const bool wide16 = j->ldx <= PHS_L1_COLS;
    for (int t = t0; t < t0 + nt;) {
        const int left = t0 + nt - t;
        const int T = left >= 16 && wide16 ? 16 : left >= 8 ? 8 : left;
        for (int r0 = 0; r0 < nr;) {
            const int R = nr - r0 >= phs_rows(T) ? phs_rows(T) : 1;
            const int o = ob + (int)(r0 * step);
            const uint16_t *w = (const uint16_t *)p->w + (size_t)o * p->ldw;
            const char *pf = (const char *)(w + p->ldw);
            const unsigned bad = mk_stream_ph_any(R, T, j->xph + phs_at(t, 0, j->ldx), w,
                                                  step * p->ldw, pf, p->n_in, sum);
            for (int r = 0; r < R; r++) {
                const int row = o + (int)(r * step);
                if (!(bad >> r & 1u)) {
                    for (int tt = 0; tt < T; tt++)
                        store_out(p, t + tt, row, sum[r * T + tt] * j->sph[t + tt]);
                    continue;
                }
                /* a weight of CPU_PH_MAX_W / 2^shift or more: the row on vdpbf16ps */
                const char *wr = (const char *)((const uint16_t *)p->w + (size_t)row * p->ldw);
                for (int tt = 0; tt < T; tt += DT_T) {
                    const int TT = T - tt < DT_T ? T - tt : DT_T;
                    mk_stream_any(DOT_BF16, TT, 1, j->xa + (t + tt) * j->ldxb, j->ldxb, NULL, wr,
                                  ldwb, wr + ldwb, p->n_in, &out);
                    for (int u = 0; u < TT; u++)
                        store_out(p, t + tt + u, row, out.f[u][0]);
                }
            }
            r0 += R;
        }
        t += T;
    }
}

/* The fp16 streaming task: rows [o0, o0 + no) in blocks of 4 taken from 4
 * equal parts of the task (o0 + i + r q, as task_stream's tiles: each
 * thread reads 4 sequential streams), the leftover rows one at a time. */
PH_TARGET static void task_stream_ph(const struct dot_job *j, int t0, int nt, int o0, int no)
{
    const int q = no / 4;
    for (int i = 0; i < q; i++)
        stream_ph_block(j, t0, nt, o0 + i, 4, q);
    for (int o = o0 + 4 * q; o < o0 + no; o++)
        stream_ph_block(j, t0, nt, o, 1, 1);
}
#endif

DOT_TARGET static void task_packed(const struct dot_job *j, int thread, int t0, int nt, int o0,
                                   int no)
{
    const struct moe_matmul_params *p = j->p;
    const int64_t esz = j->kind == DOT_BF16 ? 2 : 1;
    const int64_t ldwb = p->ldw * esz;
    const int n_grp = (int)(j->ldxb / 4);
    int32_t *panel = (int32_t *)(j->scratch + (size_t)thread * j->scratch_stride);
    int32_t rs[DP_R];
    float sw[DP_R];
    for (int o = o0; o < o0 + no; o += DP_R) {
        int R = o0 + no - o < DP_R ? o0 + no - o : DP_R;
        if (j->q4_bf16) { /* dequantized rows after the panel, packed like bf16 ones */
            uint16_t *rows = (uint16_t *)((char *)panel + j->scratch_stride / 2);
            q4_rows_bf16(p, o, R, rows, j->ldx);
            pack_panel(DOT_BF16, (const char *)rows, j->ldxb, p->n_in, R, n_grp, panel, rs);
        } else {
            pack_panel(j->kind, (const char *)p->w + o * ldwb, ldwb, p->n_in, R, n_grp, panel, rs);
        }
        if (j->kind == DOT_I8)
            for (int r = 0; r < DP_R; r++)
                sw[r] = r < R ? p->w_scale[o + r] : 0.0f;
        __mmask16 m0 = R >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << R) - 1u);
        __mmask16 m1 = R >= 32  ? (__mmask16)0xffff
                       : R > 16 ? (__mmask16)((1u << (R - 16)) - 1u)
                                : (__mmask16)0;
        if (j->amx) {
            int32_t out[AMX_T][DP_R] __attribute__((aligned(64)));
            for (int t = t0; t < t0 + nt; t += AMX_T) {
                int T = t0 + nt - t < AMX_T ? t0 + nt - t : AMX_T;
                amx_block(j->kind, T, j->xa + t * j->ldxb, j->ldxb, (int)(j->ldxb / 64), panel,
                          out);
                amx_write(j->kind, T, out, p->y + (size_t)t * p->n_out + o, p->n_out, m0, m1,
                          p->accumulate, j->sx ? j->sx + t : NULL, sw);
            }
            continue;
        }
        for (int t = t0; t < t0 + nt; t += DP_T) {
            int T = t0 + nt - t < DP_T ? t0 + nt - t : DP_T;
            mk_packed_any(j->kind, T, j->xa + t * j->ldxb, j->ldxb, n_grp, panel,
                          p->y + (size_t)t * p->n_out + o, p->n_out, m0, m1, p->accumulate,
                          j->sx ? j->sx + t : NULL, sw, rs);
        }
    }
}

/* 32 rows o, o + step, ... (step > 1: all of them in the matrix; step 1: R
 * of them, the rest zero) x all tokens. */
DOT_TARGET static void amx_stream_rows(const struct dot_job *j, int thread, int o, int R, int step)
{
    const struct moe_matmul_params *p = j->p;
    const int64_t esz = j->kind == DOT_BF16 ? 2 : 1;
    const int64_t ldwb = p->ldw * esz;
    const int n_ks = (int)(j->ldxb / 64), G = (p->n_tok + 15) / 16;
    int32_t out[2][2][16][16] __attribute__((aligned(64)));
    float sw[DP_R];
    const char *w = j->q4_bf16 ? NULL : (const char *)p->w + o * ldwb;
    int64_t ld = ldwb * step;
    if (j->q4_bf16) { /* dequantized, zero-padded to 32 rows */
        char *rows = j->scratch + (size_t)thread * j->scratch_stride;
        q4_rows_bf16(p, o, R, (uint16_t *)rows, j->ldx);
        w = rows;
        ld = j->ldxb;
    } else if (R < DP_R) { /* the matrix's last rows: a zero-padded copy (tiles read 32) */
        char *pad = j->scratch + (size_t)thread * j->scratch_stride;
        for (int r = 0; r < DP_R; r++) {
            if (r < R)
                memcpy(pad + r * j->ldxb, w + r * ldwb, (size_t)j->ldxb);
            else
                memset(pad + r * j->ldxb, 0, (size_t)j->ldxb);
        }
        w = pad;
        ld = j->ldxb;
    }
    if (j->kind == DOT_I8)
        for (int r = 0; r < DP_R; r++)
            sw[r] = r < R ? p->w_scale[o + r * step] : 0.0f;
    for (int tg = 0; tg < G; tg += 2) {
        const int T = p->n_tok - tg * 16 < 32 ? p->n_tok - tg * 16 : 32;
        amx_stream_block(j->kind, T > 16 ? 2 : 1, w, ld, n_ks, j->xb + (size_t)tg * n_ks * 1024,
                         out);
        amx_stream_write(j->kind, T, R, step, out, p->y + (size_t)tg * 16 * p->n_out + o, p->n_out,
                         p->accumulate, j->sx ? j->sx + tg * 16 : NULL, sw);
    }
}

/* As task_stream: a block's 32 rows from 32 parts of the task's rows, so
 * each 16-row tile load touches 16 streams, not 4 rows of each of 4 pages
 * (16-sequence int8 decode step -2.5% on a Xeon); the outputs are
 * scattered. Dequantized I4 rows stay contiguous (q4_rows_bf16). */
DOT_TARGET static void task_amx_stream(const struct dot_job *j, int thread, int o0, int no)
{
    const int q = j->q4_bf16 ? 0 : no / DP_R;
    for (int i = 0; i < q; i++)
        amx_stream_rows(j, thread, o0 + i, DP_R, q);
    for (int o = o0 + q * DP_R; o < o0 + no; o += DP_R)
        amx_stream_rows(j, thread, o, o0 + no - o < DP_R ? o0 + no - o : DP_R, 1);
}

static void dot_task(void *arg, int task, int thread)
{
    const struct dot_job *j = arg;
    const struct moe_matmul_params *p = j->p;
    int rb = task % j->n_row_blocks, tb = task / j->n_row_blocks;
    int o0 = rb * j->row_block, t0 = tb * j->tok_block;
    int no = p->n_out - o0 < j->row_block ? p->n_out - o0 : j->row_block;
    int nt = p->n_tok - t0 < j->tok_block ? p->n_tok - t0 : j->tok_block;
    if (j->amx_stream) {
        amx_begin();
        task_amx_stream(j, thread, o0, no);
        amx_end();
    } else if (j->packed && j->amx) {
        amx_begin();
        task_packed(j, thread, t0, nt, o0, no);
        amx_end();
    } else if (j->packed)
        task_packed(j, thread, t0, nt, o0, no);
#if DOT_PH
    else if (j->ph)
        task_stream_ph(j, t0, nt, o0, no);
#endif
    else if (nt == 1)
        task_stream_tok1(j, t0, o0, no);
    else
        task_stream(j, t0, nt, o0, no);
}

/* Activation conversion, CVT_ROWS token rows per task. */
#define CVT_ROWS 16

static void cvt_task(void *arg, int task, int thread)
{
    (void)thread;
    const struct dot_job *j = arg;
    const struct moe_matmul_params *p = j->p;
    int r0 = task * CVT_ROWS, r1 = r0 + CVT_ROWS < p->n_tok ? r0 + CVT_ROWS : p->n_tok;
    if (j->kind == DOT_BF16) {
        act_bf16_rows(p->x, p->n_in, r0, r1, (uint16_t *)j->xa, j->ldx);
#if DOT_PH
        for (int t = r0; t < r1 && j->ph; t++)
            j->sph[t] = act_ph_row(p->x + (size_t)t * p->n_in, p->n_in, j->xph, t, j->ldx);
#endif
        return;
    }
    const bool u8 = j->kind == DOT_I8 && j->packed && !j->amx; /* VNNI panels: xq + 128 */
    for (int t = r0; t < r1; t++) {
        const float *xr = p->x + (size_t)t * p->n_in;
        char *d = (char *)j->xa + t * j->ldxb;
        j->sx[t] = u8 ? act_u8_row(xr, p->n_in, (uint8_t *)d, j->ldx)
                      : act_s8_row(xr, p->n_in, (int8_t *)d, j->ldx);
        if (j->xs)
            j->xs[t] = act_s8_sum((const int8_t *)d, j->ldx);
    }
}

/* Everything before the dot products: the kind of tile, one allocation, the
 * activations converted (on the pool when there are many), the tasks. */
static void dot_prepare(struct moe_threadpool *pool, const struct moe_matmul_params *p,
                        struct dot_job *jp)
{
    MOE_ASSERT(cpu_matmul_dot_supported(p));
    MOE_ASSERT(p->ldw >= p->n_in && p->n_in >= 0);
    MOE_ASSERT(p->w_dtype == MOE_DTYPE_BF16 ||
               ((p->w_dtype == MOE_DTYPE_I8 || p->w_dtype == MOE_DTYPE_I4) && p->w_scale));
    const int n_threads = moe_threadpool_size(pool);
    struct dot_job j = {.p = p, .kind = kind_of(p->w_dtype), .q4_bf16 = q4_via_bf16(p)};
    if (j.q4_bf16)
        j.kind = DOT_BF16;
    const int V = j.kind == DOT_BF16 ? 32 : 64;
    const int esz = j.kind == DOT_BF16 ? 2 : 1;
    j.ldx = (p->n_in + V - 1) / V * V;
    if (j.ldx == 0)
        j.ldx = V;
    j.ldxb = (int64_t)j.ldx * esz;

    /* One allocation: activations (AMX: whole 16-row tiles, zero past
     * n_tok), token scales, panels. */
    const bool amx = j.q4_bf16 || amx_for(p->w_dtype);
    j.amx_stream = amx &&
                   p->n_tok >= (j.kind == DOT_BF16 ? AMX_STREAM_MIN_BF16 : AMX_STREAM_MIN_I8) &&
                   p->n_tok < AMX_STREAM_MAX && p->n_in % V == 0;
    j.amx = j.amx_stream ||
            (amx && p->n_tok >= (j.kind == DOT_BF16 ? AMX_MIN_TOK_BF16 : AMX_MIN_TOK_I8));
    j.packed = !j.amx_stream && (j.amx || (p->n_tok >= DP_MIN_TOK && j.kind != DOT_I4));
    size_t act_rows = j.amx ? ((size_t)p->n_tok + 15) / 16 * 16 : (size_t)p->n_tok;
    size_t act_bytes = act_rows * (size_t)j.ldxb;
    size_t sx_bytes = j.kind != DOT_BF16 ? ((size_t)p->n_tok * sizeof(float) + 63) / 64 * 64 : 0;
    const bool stream_i8 = j.kind == DOT_I8 && !j.packed && !j.amx_stream;
    size_t xs_bytes = stream_i8 ? ((size_t)p->n_tok * sizeof(int32_t) + 63) / 64 * 64 : 0;
    /* per thread: a panel, or the weight-stationary form's padded rows; for
     * q4_bf16's panels also the dequantized rows they are packed from */
    j.scratch_stride =
        j.packed || j.amx_stream ? ((size_t)DP_R * (size_t)j.ldxb + 63) / 64 * 64 : 0;
    if (j.q4_bf16 && j.packed)
        j.scratch_stride *= 2;
    size_t xb_bytes = j.amx_stream ? (size_t)(p->n_tok + 15) / 16 * (size_t)j.ldxb * 16 : 0;
    j.ph = j.kind == DOT_BF16 && !j.q4_bf16 && !j.packed && !j.amx && ph_stream_for(p);
    const size_t ph_rows = ((size_t)p->n_tok + PHS_T - 1) / PHS_T * PHS_T; /* whole groups */
    size_t ph_bytes =
        j.ph ? ph_rows * (size_t)j.ldxb + ((size_t)p->n_tok * sizeof(float) + 63) / 64 * 64 : 0;
    size_t total = act_bytes + sx_bytes + xs_bytes + (size_t)n_threads * j.scratch_stride +
                   xb_bytes + ph_bytes;
    char *buf = NULL;
    MOE_ASSERT(posix_memalign((void **)&buf, 64, total) == 0);
    j.xa = buf;
    j.sx = j.kind != DOT_BF16 ? (float *)(buf + act_bytes) : NULL;
    j.xs = stream_i8 ? (int32_t *)(buf + act_bytes + sx_bytes) : NULL;
    char *after = buf + act_bytes + sx_bytes + xs_bytes;
    j.scratch = j.packed || j.amx_stream ? after : NULL;
    j.xb = j.amx_stream ? after + (size_t)n_threads * j.scratch_stride : NULL;
    if (j.ph) {
        j.xph = (uint16_t *)(after + (size_t)n_threads * j.scratch_stride + xb_bytes);
        j.sph = (float *)((char *)j.xph + ph_rows * (size_t)j.ldxb);
    }
    if (act_rows > (size_t)p->n_tok)
        memset(buf + (size_t)p->n_tok * j.ldxb, 0, (act_rows - (size_t)p->n_tok) * j.ldxb);

    int n_cvt = (p->n_tok + CVT_ROWS - 1) / CVT_ROWS;
    if ((size_t)p->n_tok * p->n_in < 65536 || n_cvt == 1) {
        for (int t = 0; t < n_cvt; t++)
            cvt_task(&j, t, 0);
    } else {
        moe_threadpool_run(pool, n_cvt, cvt_task, &j);
    }

    if (j.amx_stream)
        amx_pack_act(j.xa, j.ldxb, p->n_tok, (int)(j.ldxb / 64), j.xb);

    /* Rows per task: about 8 tasks per thread, 16..256 (streaming: below). */
    int rb = (p->n_out + 8 * n_threads - 1) / (8 * n_threads);
    if (j.amx_stream) {
        rb = (rb + DP_R - 1) / DP_R * DP_R;
        j.tok_block = p->n_tok;
    } else if (j.packed) {
        rb = (rb + DP_R - 1) / DP_R * DP_R;
        rb = rb > 2 * DP_R ? 2 * DP_R : rb;
        j.tok_block = p->n_tok < DP_TOK_BLOCK ? p->n_tok : DP_TOK_BLOCK;
        /* Even token blocks: no thin leftover block. */
        int n_tb = (p->n_tok + DP_TOK_BLOCK - 1) / DP_TOK_BLOCK;
        j.tok_block = (p->n_tok + n_tb - 1) / n_tb;
        if (j.amx) /* whole 32-token steps but the last */
            j.tok_block = (j.tok_block + AMX_T - 1) / AMX_T * AMX_T;
    } else {
        /* Longer: each task starts DT_R new streams, which the prefetchers
         * take a while to follow; ~2 tasks a thread, 16..1024 rows (the
         * 16-sequence int8 decode step -3% against 8 of <= 256 rows). */
        rb = (p->n_out + 2 * n_threads - 1) / (2 * n_threads);
        rb = (rb + DT_R - 1) / DT_R * DT_R;
        rb = rb < 16 ? 16 : rb > 1024 ? 1024 : rb;
        j.tok_block = p->n_tok < DT_TOK_BLOCK ? p->n_tok : DT_TOK_BLOCK;
    }
    j.row_block = rb > p->n_out ? p->n_out : rb;
    j.n_row_blocks = (p->n_out + j.row_block - 1) / j.row_block;
    j.n_tasks = j.n_row_blocks * ((p->n_tok + j.tok_block - 1) / j.tok_block);
    j.buf = buf;
    *jp = j;
}

/* Small calls run on the calling thread alone. */
static bool dot_serial(double flops, int n_tasks)
{
    return flops < 65536.0 || n_tasks == 1;
}

void cpu_matmul_dot(struct moe_threadpool *pool, const struct moe_matmul_params *p)
{
    if (p->n_tok <= 0 || p->n_out <= 0)
        return;
    struct dot_job j;
    dot_prepare(pool, p, &j);
    if (dot_serial(2.0 * p->n_tok * (double)p->n_out * p->n_in, j.n_tasks)) {
        for (int t = 0; t < j.n_tasks; t++)
            dot_task(&j, t, 0);
    } else {
        moe_threadpool_run(pool, j.n_tasks, dot_task, &j);
    }
    free(j.buf);
}

/* Several matmuls' tasks in one pool run: task i belongs to the job whose
 * range [first[k], first[k + 1]) holds it. */
struct dot_many {
    struct dot_job *jobs;
    int *first; /* n + 1 */
    int n;
};

static void dot_many_task(void *arg, int task, int thread)
{
    const struct dot_many *dm = arg;
    const int i = cpu_task_owner(dm->first, dm->n, task);
    dot_task(&dm->jobs[i], task - dm->first[i], thread);
}

void cpu_matmul_dot_many(struct moe_threadpool *pool, const struct moe_matmul_params *ps, int n)
{
    struct dot_job stack_jobs[16];
    int stack_first[17];
    struct dot_job *jobs = stack_jobs;
    int *first = stack_first;
    if (n > 16) {
        jobs = malloc((size_t)n * sizeof *jobs);
        first = malloc(((size_t)n + 1) * sizeof *first);
        MOE_ASSERT(jobs && first);
    }
    int k = 0, total = 0;
    double flops = 0.0;
    for (int i = 0; i < n; i++) {
        const struct moe_matmul_params *p = &ps[i];
        if (p->n_tok <= 0 || p->n_out <= 0)
            continue;
        dot_prepare(pool, p, &jobs[k]);
        first[k] = total;
        total += jobs[k].n_tasks;
        flops += 2.0 * p->n_tok * (double)p->n_out * p->n_in;
        k++;
    }
    first[k] = total;
    struct dot_many dm = {.jobs = jobs, .first = first, .n = k};
    if (k > 0) {
        if (dot_serial(flops, total)) {
            for (int t = 0; t < total; t++)
                dot_many_task(&dm, t, 0);
        } else {
            moe_threadpool_run(pool, total, dot_many_task, &dm);
        }
    }
    for (int i = 0; i < k; i++)
        free(jobs[i].buf);
    if (jobs != stack_jobs) {
        free(jobs);
        free(first);
    }
}

#else /* !DOT_X86 */

void cpu_matmul_dot(struct moe_threadpool *pool, const struct moe_matmul_params *p)
{
    (void)pool;
    (void)p;
    MOE_ASSERT(0 && "cpu_matmul_dot: no dot-product path on this architecture");
}

void cpu_matmul_dot_many(struct moe_threadpool *pool, const struct moe_matmul_params *ps, int n)
{
    (void)pool;
    (void)ps;
    (void)n;
    MOE_ASSERT(0 && "cpu_matmul_dot_many: no dot-product path on this architecture");
}

#endif
