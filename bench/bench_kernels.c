/* Matmul throughput of the CPU backend on the benchmark model's shapes
 * (d_model 1024, expert FFN 2816): W 2816x1024 (gate/up), 1024x2816 (down),
 * 1536x1024 (QKV), f32, bf16 and int8 weights (per-row scales, laid out as
 * the model stores them), 1 and 2 threads, GEMV (n_tok 1) and
 * GEMM (n_tok 256), on the best SIMD path and on the portable path as a
 * baseline measured in the same run.
 *
 * GEMV rotates through enough copies of W (>= 256 MiB) that the weights come
 * from memory, not from the last-level cache, as in real decode; GB/s is
 * weight bytes streamed per second.
 *
 * --fast: the fast (moe_matmul_params.fast) paths instead: bf16, int8 and
 * int4 (group 32) weights at 1..512 tokens, on every dot-product path this processor has
 * (AMX, then AMX forced off: AVX512-BF16 / VNNI; on AVX2 the int8 W8A8
 * tiles alone, bf16 reported as skipped), the paths alternated within each
 * cell, best of 5, and their ratio.
 *
 * usage: bench-kernels [--quick | --argmax | --fast [bf16|int8|int4] | --peak | --attention]
 *        (--quick: fewer repetitions, no scalar GEMM; --argmax: only the host argmax cells;
 *        --fast: only the fast-path cells, of one type if named; --peak: the AVX2 tiles'
 *        arithmetic ceilings; --attention: the tiled attention kernel, prefill and decode) */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "cpu/cpu_kernels.h"
#include "quant.h"
#include "clock.h"
#include "threadpool.h"

struct shape {
    const char *name;
    int n_out, n_in;
};

#if defined(__x86_64__)
#include "cpu/simd_x86.h" /* bf16x8_to_f32, the tiles' own widening */

/* ---- --peak: what one core's arithmetic allows the AVX2 tiles ----
 * The inner loops of the AVX2 tiles, 2 tokens x 4 rows, on operands that
 * stay in L1 (4 KiB of k per row), so nothing but the arithmetic limits
 * them: the W8A8 chain (vpsignb, vpmaddubsw, vpmaddwd, vpaddd per 32 MACs
 * of a token and a row: the fewest exact s8 x s8 ops AVX2 has), the same
 * chain without vpsignb (not exact: a bound on what dropping it could buy),
 * the same exact sums on int16 (peak_w8a16), bf16 widened to f32
 * (vpmovzxwd + vpslld per 8 weights, 8 FMAs per 2 x 4 tile step), bf16
 * widened by halves (AND + shift per 16 weights, as the tiles do from 4
 * tokens), beside plain f32 FMAs. MACs a second on one thread. */
#define PEAK_K 4096
#define PEAK_REPS 40000

static int8_t g_pk_w8[4][PEAK_K] __attribute__((aligned(64)));
static int8_t g_pk_x8[2][PEAK_K] __attribute__((aligned(64)));
static int16_t g_pk_x16[2][PEAK_K] __attribute__((aligned(64)));
static uint16_t g_pk_wb[4][PEAK_K] __attribute__((aligned(64)));
static float g_pk_xf[2][PEAK_K] __attribute__((aligned(64)));

/* The integer chains' 2 x 4 accumulators summed into one value (so the
 * compiler cannot drop the loop). */
MOE_AVX2_TARGET __attribute__((always_inline)) static inline int peak_i32_result(__m256i acc[2][4])
{
    __m256i s = _mm256_setzero_si256();
    for (int t = 0; t < 2; t++)
        for (int r = 0; r < 4; r++)
            s = _mm256_add_epi32(s, acc[t][r]);
    int v = _mm256_extract_epi32(s, 0);
    _mm256_zeroupper();
    return v;
}

MOE_AVX2_TARGET __attribute__((always_inline)) static inline int peak_w8a8(const bool sign)
{
    __m256i acc[2][4];
    for (int t = 0; t < 2; t++)
        for (int r = 0; r < 4; r++)
            acc[t][r] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int rep = 0; rep < PEAK_REPS; rep++)
        for (int k = 0; k < PEAK_K; k += 32) {
            __m256i xs[2], xu[2];
            for (int t = 0; t < 2; t++) {
                xs[t] = _mm256_load_si256((const __m256i *)&g_pk_x8[t][k]);
                xu[t] = _mm256_abs_epi8(xs[t]);
            }
            for (int r = 0; r < 4; r++) {
                const __m256i wv = _mm256_load_si256((const __m256i *)&g_pk_w8[r][k]);
                for (int t = 0; t < 2; t++) {
                    __m256i q = sign ? _mm256_sign_epi8(wv, xs[t]) : wv;
                    __m256i pairs = _mm256_maddubs_epi16(xu[t], q);
                    acc[t][r] = _mm256_add_epi32(acc[t][r], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
    return peak_i32_result(acc);
}

/* The W8A8 sums on int16: the tokens' xq widened once (as a call would
 * store them), each row's 16 weights sign-extended (vpmovsxbw) and shared by
 * the two tokens, vpmaddwd + vpaddd per 16 MACs of a token and a row: two
 * ops where the chain above has four per 32, but only one of them on Zen 3's
 * two multiply pipes where the chain has three there. The same exact sums. */
MOE_AVX2_TARGET __attribute__((always_inline)) static inline int peak_w8a16(void)
{
    __m256i acc[2][4];
    for (int t = 0; t < 2; t++)
        for (int r = 0; r < 4; r++)
            acc[t][r] = _mm256_setzero_si256();
    for (int rep = 0; rep < PEAK_REPS; rep++)
        for (int k = 0; k < PEAK_K; k += 16) {
            const __m256i x0 = _mm256_load_si256((const __m256i *)&g_pk_x16[0][k]);
            const __m256i x1 = _mm256_load_si256((const __m256i *)&g_pk_x16[1][k]);
            for (int r = 0; r < 4; r++) {
                const __m256i wv =
                    _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)&g_pk_w8[r][k]));
                acc[0][r] = _mm256_add_epi32(acc[0][r], _mm256_madd_epi16(wv, x0));
                acc[1][r] = _mm256_add_epi32(acc[1][r], _mm256_madd_epi16(wv, x1));
            }
        }
    return peak_i32_result(acc);
}

/* The f32 chains' 2 x 4 accumulators: zeroed, and summed into one value
 * (so the compiler cannot drop the loop). */
MOE_AVX2_TARGET __attribute__((always_inline)) static inline void peak_f32_zero(__m256 acc[2][4])
{
    for (int t = 0; t < 2; t++)
        for (int r = 0; r < 4; r++)
            acc[t][r] = _mm256_setzero_ps();
}

MOE_AVX2_TARGET __attribute__((always_inline)) static inline float peak_f32_result(__m256 acc[2][4])
{
    __m256 s = _mm256_setzero_ps();
    for (int t = 0; t < 2; t++)
        for (int r = 0; r < 4; r++)
            s = _mm256_add_ps(s, acc[t][r]);
    float v = _mm256_cvtss_f32(s);
    _mm256_zeroupper();
    return v;
}

MOE_AVX2_TARGET __attribute__((always_inline)) static inline float peak_fma(const bool bf16)
{
    __m256 acc[2][4];
    peak_f32_zero(acc);
    for (int rep = 0; rep < PEAK_REPS / 4; rep++)
        for (int k = 0; k < PEAK_K; k += 8) {
            __m256 xv[2];
            for (int t = 0; t < 2; t++)
                xv[t] = _mm256_load_ps(&g_pk_xf[t][k]);
            for (int r = 0; r < 4; r++) {
                __m256 wv = bf16 ? bf16x8_to_f32(_mm_load_si128((const __m128i *)&g_pk_wb[r][k]))
                                 : xv[(r + 1) % 2];
                for (int t = 0; t < 2; t++)
                    acc[t][r] = _mm256_fmadd_ps(xv[t], wv, acc[t][r]);
            }
        }
    return peak_f32_result(acc);
}

/* The W4A8 tile step (matmul.c mk_w4a8_avx2): per row and 64 columns one
 * 32-byte load of codes, AND / shift / AND; per token and row two
 * vpmaddubsw, the two pair sums and the base added in int16, vpmaddwd,
 * conversion and an FMA by the groups' scales. `base` false drops the base
 * add, as the tiles do since the codes' offset is added once per row at the
 * end (matmul.c). */
static uint8_t g_pk_w4[4][PEAK_K / 2] __attribute__((aligned(64)));
static int16_t g_pk_base[2][PEAK_K / 4] __attribute__((aligned(64)));
static float g_pk_sc[4][PEAK_K / 32] __attribute__((aligned(64)));

MOE_AVX2_TARGET __attribute__((always_inline)) static inline float peak_w4a8(const bool base)
{
    __m256 acc[2][4];
    peak_f32_zero(acc);
    const __m256i ones = _mm256_set1_epi16(1), nib = _mm256_set1_epi8(0x0f);
    for (int rep = 0; rep < PEAK_REPS / 2; rep++)
        for (int k = 0; k < PEAK_K; k += 64) {
            for (int r = 0; r < 4; r++) {
                const __m256i c = _mm256_load_si256((const __m256i *)&g_pk_w4[r][k / 2]);
                const __m256i lo = _mm256_and_si256(c, nib);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), nib);
                const __m256 sv = _mm256_insertf128_ps(
                    _mm256_castps128_ps256(_mm_broadcast_ss(&g_pk_sc[r][k / 32])),
                    _mm_broadcast_ss(&g_pk_sc[r][k / 32 + 1]), 1);
                for (int t = 0; t < 2; t++) {
                    __m256i p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo,
                                             _mm256_load_si256((const __m256i *)&g_pk_x8[t][k])),
                        _mm256_maddubs_epi16(
                            hi, _mm256_load_si256((const __m256i *)&g_pk_x8[t][k + 32])));
                    if (base)
                        p = _mm256_add_epi16(
                            p, _mm256_load_si256((const __m256i *)&g_pk_base[t][k / 4]));
                    acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), sv,
                                                acc[t][r]);
                }
            }
        }
    return peak_f32_result(acc);
}

/* bf16 rows widened by halves: 16 weights a 32-byte load, the odd ones by
 * an AND (a bf16 in a 32-bit lane's high half is that f32), the even ones by
 * a shift, against activations stored even columns first in each 16 (the
 * AVX2 bf16 tiles from 4 tokens, matmul.c BF16_HALVES_MIN_TOK). */
MOE_AVX2_TARGET __attribute__((always_inline)) static inline float peak_bf16_halves(void)
{
    __m256 acc[2][4];
    peak_f32_zero(acc);
    const __m256i hi16 = _mm256_set1_epi32((int)0xffff0000u);
    for (int rep = 0; rep < PEAK_REPS / 4; rep++)
        for (int k = 0; k < PEAK_K; k += 16) {
            for (int r = 0; r < 4; r++) {
                const __m256i v = _mm256_load_si256((const __m256i *)&g_pk_wb[r][k]);
                const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi16));
                for (int t = 0; t < 2; t++) {
                    acc[t][r] = _mm256_fmadd_ps(_mm256_load_ps(&g_pk_xf[t][k]), we, acc[t][r]);
                    acc[t][r] = _mm256_fmadd_ps(_mm256_load_ps(&g_pk_xf[t][k + 8]), wo, acc[t][r]);
                }
            }
        }
    return peak_f32_result(acc);
}

/* one compiled loop per chain, each in a function of its own */
#define PEAK_FN(name, call)                                                                        \
    MOE_AVX2_TARGET __attribute__((noinline)) static double name(void)                             \
    {                                                                                              \
        return call;                                                                               \
    }
PEAK_FN(peak_c0, peak_w8a8(true))
PEAK_FN(peak_c1, peak_w8a8(false))
PEAK_FN(peak_c2, peak_w8a16())
PEAK_FN(peak_c3, peak_w4a8(true))
PEAK_FN(peak_c4, peak_w4a8(false))
PEAK_FN(peak_c5, peak_fma(true))
PEAK_FN(peak_c6, peak_bf16_halves())
PEAK_FN(peak_c7, peak_fma(false))

static int bench_peak(void)
{
    if (cpu_kernels_detect_isa() < CPU_ISA_AVX2) {
        printf("bench-kernels --peak: this processor lacks AVX2\n");
        return 1;
    }
    for (int i = 0; i < PEAK_K; i++) {
        for (int r = 0; r < 4; r++) {
            g_pk_w8[r][i] = (int8_t)((i * 7 + r * 3) % 255 - 127);
            g_pk_wb[r][i] = moe_f32_to_bf16((float)((i + r) % 13) * 0.01f);
            if (i % 2 == 0)
                g_pk_w4[r][i / 2] = (uint8_t)((i * 3 + r) % 256);
            if (i % 32 == 0)
                g_pk_sc[r][i / 32] = 0.01f;
        }
        for (int t = 0; t < 2; t++) {
            g_pk_x8[t][i] = (int8_t)((i * 5 + t * 11) % 255 - 127);
            g_pk_x16[t][i] = g_pk_x8[t][i];
            g_pk_xf[t][i] = (float)((i + t) % 7) * 0.001f;
            if (i % 4 == 0)
                g_pk_base[t][i / 4] = (int16_t)(-8 * (i % 61));
        }
    }
    volatile double sink = 0;
    printf("# one thread, operands in L1, 2 tokens x 4 rows a tile step; best of 3\n");
    printf("%-42s %10s\n", "chain", "GMAC/s");
    static const char *names[] = {
        "int8 W8A8 (sign, maddubs, madd, add)",     "int8 without vpsignb (not exact)",
        "int8 on int16 (vpmovsxbw, madd, add)",     "int4 W4A8 (7 ops a token, row, 64 MACs)",
        "int4 W4A8, no base add (the tiles now)",   "bf16 widened to f32, FMA",
        "bf16 widened by halves (AND, shift), FMA", "f32 FMA"};
    static double (*const chains[])(void) = {peak_c0, peak_c1, peak_c2, peak_c3,
                                             peak_c4, peak_c5, peak_c6, peak_c7};
    for (int i = 0; i < 8; i++) {
        double best = 1e9;
        for (int round = 0; round < 3; round++) {
            double t0 = moe_now();
            sink += chains[i]();
            best = fmin(best, moe_now() - t0);
        }
        double macs = (double)(i < 3   ? PEAK_REPS
                               : i < 5 ? PEAK_REPS / 2
                                       : PEAK_REPS / 4) *
                      PEAK_K * 8;
        printf("%-42s %10.1f\n", names[i], macs / best * 1e-9);
    }
    (void)sink;
    return 0;
}
#else
static int bench_peak(void)
{
    printf("bench-kernels --peak: x86 only\n");
    return 1;
}
#endif

/* The int4 cells' group: the bundled models' (llama.cpp Q4_0's) 32 columns. */
#define Q4_GROUP 32

/* Bytes of one weight copy (I8: values, padding, row scales; I4: codes, group scales). */
static size_t weight_bytes(enum moe_dtype dt, const struct shape *sh)
{
    if (dt == MOE_DTYPE_I8)
        return moe_i8_weight_bytes(sh->n_out, sh->n_in);
    if (dt == MOE_DTYPE_I4)
        return moe_q4_weight_bytes(sh->n_out, sh->n_in, Q4_GROUP);
    return (size_t)sh->n_out * sh->n_in * moe_dtype_size(dt);
}

static void fill_weights(void *w, enum moe_dtype dt, const struct shape *sh, unsigned seed)
{
    size_t n = (size_t)sh->n_out * sh->n_in;
    if (dt == MOE_DTYPE_I4) { /* random codes, scales that keep W near [-0.5, 0.5) */
        uint8_t *codes = w;
        for (size_t i = 0; i < n / 2; i++) {
            seed = seed * 1664525u + 1013904223u;
            codes[i] = (uint8_t)(seed >> 24);
        }
        float *sc = (float *)((char *)w + moe_q4_scale_offset(sh->n_out, sh->n_in));
        for (int64_t g = 0; g < sh->n_out * moe_q4_groups(sh->n_in, Q4_GROUP); g++)
            sc[g] = 0.5f / 8.0f;
        return;
    }
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        float v = (float)(seed >> 8) / 16777216.0f - 0.5f;
        if (dt == MOE_DTYPE_BF16)
            ((uint16_t *)w)[i] = moe_f32_to_bf16(v);
        else if (dt == MOE_DTYPE_I8)
            ((int8_t *)w)[i] = (int8_t)(v * 254.0f);
        else
            ((float *)w)[i] = v;
    }
    if (dt == MOE_DTYPE_I8) {
        float *sc = (float *)((char *)w + moe_i8_scale_offset(sh->n_out, sh->n_in));
        for (int r = 0; r < sh->n_out; r++)
            sc[r] = 0.5f / 127.0f;
    }
}

/* n filled copies of one weight (seeds seed, seed + 1, ...): calls rotate
 * over them so the weights come from memory, as in decode. */
static void **weight_copies(enum moe_dtype dt, const struct shape *sh, int n, unsigned seed)
{
    void **copies = calloc((size_t)n, sizeof(void *));
    for (int c = 0; c < n; c++) {
        /* 64-byte aligned, as the engine's weights are (cpu_buf_alloc) */
        MOE_ASSERT(posix_memalign(&copies[c], 64, weight_bytes(dt, sh)) == 0);
        fill_weights(copies[c], dt, sh, seed + (unsigned)c);
    }
    return copies;
}

static void free_copies(void **copies, int n)
{
    for (int c = 0; c < n; c++)
        free(copies[c]);
    free(copies);
}

/* Points p at weight copy `w` (and its row scales when I8). */
static void set_weights(struct moe_matmul_params *p, void *w)
{
    p->w = w;
    if (p->w_dtype == MOE_DTYPE_I8)
        p->w_scale = (const float *)((const char *)w + moe_i8_scale_offset(p->n_out, p->n_in));
    if (p->w_dtype == MOE_DTYPE_I4)
        p->w_scale = (const float *)((const char *)w + moe_q4_scale_offset(p->n_out, p->n_in));
}

/* Seconds per call: runs until min_time has passed (at least min_reps). */
static double time_matmul(struct moe_backend *be, struct moe_matmul_params *p, void **copies,
                          int n_copies, double min_time, int min_reps)
{
    set_weights(p, copies[0]);
    be->ops->matmul(be, p); /* warm-up */
    int reps = 0;
    double t0 = moe_now(), t;
    do {
        set_weights(p, copies[reps % n_copies]);
        be->ops->matmul(be, p);
        reps++;
        t = moe_now();
    } while (reps < min_reps || t - t0 < min_time);
    return (t - t0) / reps;
}

/* The host argmax of a logits row (greedy sampling): the plain loop (the
 * scalar path of the same function) against moe_host_argmax's two-pass
 * vector form, on vocabularies of 32000 (Mixtral) and 151936 (Qwen), the
 * row hot in cache as after the lm_head wrote it. */
static int32_t argmax_loop(const float *x, int n)
{
    return cpu_vec_argmax_isa(x, n, CPU_ISA_SCALAR);
}

static void bench_argmax(bool quick)
{
    static const int vocabs[] = {32000, 151936};
    printf("\n%-8s %-8s %12s %12s %8s\n", "isa", "vocab", "loop us", "vector us", "speedup");
    for (size_t v = 0; v < sizeof vocabs / sizeof *vocabs; v++) {
        int n = vocabs[v];
        float *x = malloc((size_t)n * sizeof *x);
        for (int i = 0; i < n; i++)
            x[i] = (float)((i * 2654435761u) % 100003u) / 1000.0f;
        volatile int32_t sink = 0;
        int reps = quick ? 200 : 2000;
        double best_loop = 1e9, best_vec = 1e9;
        for (int round = 0; round < 5; round++) { /* alternated, best of 5 */
            double t0 = moe_now();
            for (int r = 0; r < reps; r++)
                sink += argmax_loop(x, n);
            double t1 = moe_now();
            for (int r = 0; r < reps; r++)
                sink += moe_host_argmax(x, n);
            double t2 = moe_now();
            best_loop = fmin(best_loop, (t1 - t0) / reps);
            best_vec = fmin(best_vec, (t2 - t1) / reps);
        }
        if (argmax_loop(x, n) != moe_host_argmax(x, n))
            printf("argmax: the two disagree on vocab %d\n", n);
        printf("%-8s %-8d %12.2f %12.2f %7.2fx\n", cpu_isa_name(cpu_kernels_isa()), n,
               best_loop * 1e6, best_vec * 1e6, best_loop / best_vec);
        free(x);
    }
}

/* --attention: the tiled attention kernel (cpu_attention_tiled) at the
 * benchmark model's attention shape (16 query heads, 4 KV heads of 64) over
 * a bf16 paged cache whose blocks are scattered: a 512-token prefill chunk
 * at the end of a context of 512, 2048 and 4096 positions (causal), and one
 * decode token per sequence for 16 sequences of those lengths; 1 and 2
 * threads, best of 5. GFLOP/s counts q k and p v over the visible keys; KV
 * GB/s the bf16 K and V rows each token's KV heads read (decode is bound by
 * them: its roofline is the machine's read bandwidth, bench-triad). */
static void bench_attention(void)
{
    enum { H = 16, KV = 4, D = 64, BS = 16 };
    static const int ctxs[] = {512, 2048, 4096};
    printf("# cpu isa %s; attention: %d heads, %d KV heads of %d, bf16 cache, blocks of %d\n",
           cpu_isa_name(cpu_kernels_isa()), H, KV, D, BS);
    printf("%-8s %6s %6s %3s %10s %10s %9s\n", "cell", "ctx", "n_tok", "thr", "ms/call", "GFLOP/s",
           "KV GB/s");
    struct moe_threadpool *pools[3] = {NULL, NULL, NULL};
    struct moe_error err = {0};
    for (int th = 1; th <= 2; th++)
        MOE_ASSERT(moe_threadpool_create(th, &pools[th], &err) == MOE_OK);
    for (size_t ci = 0; ci < sizeof ctxs / sizeof *ctxs; ci++) {
        for (int decode = 0; decode < 2; decode++) {
            const int ctx = ctxs[ci], n_seq = decode ? 16 : 1, n_tok = decode ? 16 : 512;
            const int max_blocks = (ctx + BS - 1) / BS, n_block = n_seq * max_blocks;
            const size_t n_kv = (size_t)n_block * BS * KV * D;
            uint16_t *kc = malloc(n_kv * sizeof *kc), *vc = malloc(n_kv * sizeof *vc);
            for (size_t i = 0; i < n_kv; i++) {
                kc[i] = moe_f32_to_bf16((float)((i * 2654435761u) % 1009u) / 1009.0f - 0.5f);
                vc[i] = moe_f32_to_bf16((float)((i * 40503u) % 1013u) / 1013.0f - 0.5f);
            }
            int32_t *bt = malloc((size_t)n_block * sizeof *bt);
            for (int b = 0; b < n_block; b++)
                bt[b] = (int32_t)(((int64_t)b * 7919) % n_block); /* scattered */
            const size_t nq = (size_t)n_tok * H * D;
            float *q = malloc(nq * sizeof *q), *out = malloc(nq * sizeof *out);
            for (size_t i = 0; i < nq; i++)
                q[i] = (float)((i * 97u) % 101u) / 101.0f - 0.5f;
            int32_t *seq = malloc((size_t)n_tok * sizeof *seq),
                    *pos = malloc((size_t)n_tok * sizeof *pos);
            double keys = 0;
            for (int t = 0; t < n_tok; t++) {
                seq[t] = decode ? t : 0;
                pos[t] = decode ? ctx - 1 : ctx - n_tok + t;
                keys += pos[t] + 1;
            }
            struct moe_attn_params ap = {
                .q = q,
                .out = out,
                .k_cache = kc,
                .v_cache = vc,
                .kv_dtype = MOE_DTYPE_BF16,
                .tok_seq = seq,
                .tok_pos = pos,
                .block_tables = bt,
                .max_blocks = max_blocks,
                .n_tok = n_tok,
                .n_head = H,
                .n_kv_head = KV,
                .d_head = D,
                .block_size = BS,
                .scale = 0.125f,
            };
            const double flops = keys * H * D * 4.0, kv_bytes = keys * KV * D * 2.0 * 2.0;
            for (int th = 1; th <= 2; th++) {
                double best = 1e9;
                cpu_attention_tiled(pools[th], &ap); /* warm-up */
                for (int r = 0; r < 5; r++) {
                    double t0 = moe_now();
                    cpu_attention_tiled(pools[th], &ap);
                    best = fmin(best, moe_now() - t0);
                }
                printf("%-8s %6d %6d %3d %10.3f %10.1f %9.2f\n", decode ? "decode" : "prefill", ctx,
                       n_tok, th, best * 1e3, flops / best * 1e-9, kv_bytes / best * 1e-9);
            }
            free(kc);
            free(vc);
            free(bt);
            free(q);
            free(out);
            free(seq);
            free(pos);
        }
    }
    moe_threadpool_destroy(pools[1]);
    moe_threadpool_destroy(pools[2]);
}

/* The fast paths side by side: for each cell, every path this machine has,
 * alternated five times, the best time of each. */
static int bench_fast(const struct shape *shapes, size_t n_shapes, struct moe_backend **be,
                      const char *only)
{
    unsigned have = cpu_kernels_detect_features();
    const unsigned amx = CPU_FEAT_AMX_BF16 | CPU_FEAT_AMX_INT8;
    /* AMX against the AVX-512 paths; without AMX, where vdpbf16ps is slow
     * (bf16 on the f32 FMA kernels), the default against vdpbf16ps forced */
    const bool slow = (have & CPU_FEAT_DPBF16_SLOW) && !(have & amx);
    unsigned sets[2] = {have, slow ? have & ~CPU_FEAT_DPBF16_SLOW : have & ~amx};
    int n_sets = (have & amx) || slow ? 2 : 1;
    const char *const labels[2] = {slow ? "dflt GFLOP/s" : "AMX GFLOP/s",
                                   slow ? "dpbf16 GFLOP/s" : "AVX512 GFLOP/s"};
    char names[2][64];
    static const enum moe_dtype dts[] = {MOE_DTYPE_BF16, MOE_DTYPE_I8, MOE_DTYPE_I4};
    static const int toks[] = {1, 2, 3, 4, 6, 8, 16, 32, 64, 128, 512};
    const size_t cold_bytes = (size_t)256 << 20;
    printf("# fast paths; features %s%s\n", cpu_features_name(have, names[0], sizeof names[0]),
           n_sets == 1 ? " (no AMX: one path per type)" : "");
    printf("# up to 16 tokens the weights come from memory (copies rotating over >= %zu MiB, as "
           "in decode), from cache above; W GB/s: weight bytes per second\n",
           cold_bytes >> 20);
    printf("%-5s %-18s %-3s %6s", "dtype", "shape", "thr", "n_tok");
    for (int i = 0; i < n_sets; i++)
        printf(" %14s %8s",
               n_sets == 2                                  ? labels[i]
               : cpu_kernels_detect_isa() == CPU_ISA_AVX512 ? "AVX512 GFLOP/s"
                                                            : "GFLOP/s",
               "W GB/s");
    printf("%s\n", n_sets == 1 ? "" : slow ? "  dflt/dpbf16" : "  AMX/AVX512");
    for (size_t d = 0; d < sizeof dts / sizeof *dts; d++) {
        enum moe_dtype dt = dts[d];
        static const char *const flag_names[] = {"bf16", "int8", "int4"};
        if (only && strcmp(only, flag_names[d]) != 0)
            continue;
        if (strcmp(cpu_matmul_fast_path(dt), "f32-fma") == 0)
            printf("%-5s (no dot-product path on this processor: the f32-FMA tiles)\n",
                   moe_dtype_name(dt));
        for (size_t s = 0; s < n_shapes; s++) {
            const struct shape *sh = &shapes[s];
            const size_t w_bytes = weight_bytes(dt, sh);
            int n_copies = (int)((cold_bytes + w_bytes - 1) / w_bytes);
            void **copies = weight_copies(dt, sh, n_copies, 777u);
            float *x = malloc((size_t)512 * sh->n_in * sizeof(float));
            float *y = malloc((size_t)512 * sh->n_out * sizeof(float));
            for (size_t i = 0; i < (size_t)512 * sh->n_in; i++)
                x[i] = (float)(i % 97) / 97.0f - 0.5f;
            for (int th = 1; th <= 2; th++)
                for (size_t k = 0; k < sizeof toks / sizeof *toks; k++) {
                    struct moe_matmul_params p = {.x = x,
                                                  .n_tok = toks[k],
                                                  .n_in = sh->n_in,
                                                  .w_dtype = dt,
                                                  .w_group = Q4_GROUP,
                                                  .ldw = sh->n_in,
                                                  .n_out = sh->n_out,
                                                  .y = y,
                                                  .fast = true};
                    double best[2] = {1e9, 1e9};
                    for (int round = 0; round < 5; round++)
                        for (int i = 0; i < n_sets; i++) {
                            cpu_kernels_force_features(sets[i]);
                            best[i] =
                                fmin(best[i], time_matmul(be[th], &p, copies,
                                                          toks[k] <= 16 ? n_copies : 1, 0.04, 2));
                        }
                    double flop = 2.0 * toks[k] * (double)sh->n_out * sh->n_in * 1e-9;
                    printf("%-5s %-18s %-3d %6d", moe_dtype_name(dt), sh->name, th, toks[k]);
                    for (int i = 0; i < n_sets; i++)
                        printf(" %14.1f %8.2f", flop / best[i], (double)w_bytes / best[i] * 1e-9);
                    if (n_sets == 2)
                        printf("  %9.2fx", best[1] / best[0]);
                    printf("\n");
                    fflush(stdout);
                }
            free_copies(copies, n_copies);
            free(x);
            free(y);
        }
    }
    cpu_kernels_force_features(have);
    return 0;
}

int main(int argc, char **argv)
{
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    if (argc > 1 && strcmp(argv[1], "--peak") == 0)
        return bench_peak();
    if (argc > 1 && strcmp(argv[1], "--attention") == 0) {
        cpu_kernels_env();
        if (!cpu_attention_tiled_supported(
                &(struct moe_attn_params){.n_head = 16, .n_kv_head = 4, .d_head = 64})) {
            printf("bench-kernels --attention: no tiled attention on this processor (AVX2 or "
                   "AVX-512 needed)\n");
            return 1;
        }
        bench_attention();
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "--argmax") == 0) {
        cpu_kernels_env();
        bench_argmax(false);
        return 0;
    }
    static const struct shape shapes[] = {
        {"gate/up 2816x1024", 2816, 1024},
        {"down    1024x2816", 1024, 2816},
        {"qkv     1536x1024", 1536, 1024},
    };
    enum cpu_isa best = cpu_kernels_detect_isa();
    enum cpu_isa isas[2] = {best, CPU_ISA_SCALAR};
    int n_isa = best == CPU_ISA_SCALAR ? 1 : 2;
    const size_t cold_bytes = (size_t)256 << 20;

    struct moe_backend *be[3] = {NULL, NULL, NULL};
    struct moe_error err = {0};
    for (int th = 1; th <= 2; th++) {
        if (moe_backend_cpu_create(th, &be[th], &err) != MOE_OK) {
            fprintf(stderr, "bench-kernels: %s\n", err.msg);
            return 1;
        }
    }
    if (argc > 1 && strcmp(argv[1], "--fast") == 0) {
        cpu_kernels_env();
        const char *only = argc > 2 ? argv[2] : NULL;
        if (only && strcmp(only, "bf16") != 0 && strcmp(only, "int8") != 0 &&
            strcmp(only, "int4") != 0) {
            fprintf(stderr, "bench-kernels --fast: type '%s' is not bf16, int8 or int4\n", only);
            return 2;
        }
        int rc = 0;
        if (strcmp(cpu_matmul_fast_path(MOE_DTYPE_BF16), "f32-fma") == 0 &&
            strcmp(cpu_matmul_fast_path(MOE_DTYPE_I8), "f32-fma") == 0) {
            printf("bench-kernels --fast: this processor has no fast matmul path (AVX512-BF16, "
                   "VNNI or AVX2 W8A8)\n");
            rc = 1;
        } else {
            rc = bench_fast(shapes, sizeof shapes / sizeof shapes[0], be, only);
        }
        moe_backend_destroy(be[1]);
        moe_backend_destroy(be[2]);
        return rc;
    }
    printf("# cpu isa detected: %s; GEMV weights rotate over >= %zu MiB of copies\n",
           cpu_isa_name(best), cold_bytes >> 20);
    printf("%-8s %-5s %-18s %-3s %6s %10s %10s %9s\n", "isa", "dtype", "shape", "thr", "n_tok",
           "ms/call", "GFLOP/s", "W GB/s");
    for (int ii = 0; ii < n_isa; ii++) {
        cpu_kernels_force_isa(isas[ii]);
        static const enum moe_dtype dts[] = {MOE_DTYPE_F32, MOE_DTYPE_BF16, MOE_DTYPE_I8};
        for (int dti = 0; dti < 3; dti++) {
            enum moe_dtype dt = dts[dti];
            for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
                const struct shape *sh = &shapes[s];
                size_t n_w = (size_t)sh->n_out * sh->n_in;
                size_t w_bytes = weight_bytes(dt, sh);
                int n_copies = (int)((cold_bytes + w_bytes - 1) / w_bytes);
                if (quick || isas[ii] == CPU_ISA_SCALAR)
                    n_copies =
                        n_copies < 4 ? n_copies : 4; /* the scalar path is not bandwidth-bound */
                void **copies = weight_copies(dt, sh, n_copies, 12345u);
                int max_tok = 256;
                float *x = malloc((size_t)max_tok * sh->n_in * sizeof(float));
                float *y = malloc((size_t)max_tok * sh->n_out * sizeof(float));
                for (size_t i = 0; i < (size_t)max_tok * sh->n_in; i++)
                    x[i] = (float)(i % 97) / 97.0f - 0.5f;
                for (int th = 1; th <= 2; th++) {
                    for (int tk = 0; tk < 2; tk++) {
                        int n_tok = tk ? 256 : 1;
                        if (isas[ii] == CPU_ISA_SCALAR && n_tok > 1 && (quick || th == 2))
                            continue;
                        struct moe_matmul_params p = {
                            .x = x,
                            .n_tok = n_tok,
                            .n_in = sh->n_in,
                            .w_dtype = dt,
                            .ldw = sh->n_in,
                            .n_out = sh->n_out,
                            .y = y,
                            .accumulate = false,
                        };
                        double min_time = quick ? 0.05 : 0.25;
                        double sec =
                            time_matmul(be[th], &p, copies, n_tok == 1 ? n_copies : 1, min_time, 3);
                        double gflops = 2.0 * n_tok * (double)n_w / sec * 1e-9;
                        double gbs = (double)w_bytes / sec * 1e-9;
                        printf("%-8s %-5s %-18s %-3d %6d %10.3f %10.1f %9.2f\n",
                               cpu_isa_name(isas[ii]), moe_dtype_name(dt), sh->name, th, n_tok,
                               sec * 1e3, gflops, gbs);
                        fflush(stdout);
                    }
                }
                free_copies(copies, n_copies);
                free(x);
                free(y);
            }
        }
    }
    cpu_kernels_force_isa(best);
    bench_argmax(quick);
    moe_backend_destroy(be[1]);
    moe_backend_destroy(be[2]);
    return 0;
}
