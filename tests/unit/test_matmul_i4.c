/* 4-bit weights (MOE_DTYPE_I4, one scale per group of 32, 64 or 128
 * columns): the quantizer's properties (the layout, the scale rule, the
 * error bound), and the int4 matmul on every SIMD path this processor has
 * against cpu_matmul_ref on the dequantized f32 weights, held to 1e-5 of
 * sum_k |x_k w_k| per output (summation order only; the kernels compute on
 * exactly the dequantized values). Shapes: every group size, a row stride
 * wider than n_in (a column slice), 1..4 tokens (AVX-512 decode tiles),
 * 16 and 70 (tiles over token blocks), 130 (the AVX-512 packed prefill
 * panels and their leftover tokens), accumulation, and grouped (expert)
 * calls with a missing expert. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/cpu_kernels.h"
#include "quant.h"
#include "testlib.h"

#define SUM_ORDER_TOL 1e-5

static struct test_rng g_rng = {0x13198a2e03707344ull};

static struct moe_backend *g_cpu;     /* 2 threads, through the ops table */
static struct moe_threadpool *g_pool; /* 3 threads, direct kernel calls */

/* Groups of very different magnitudes, all-zero groups, positive and
 * negative outliers. */
static void fill_rows(float *w, int n_rows, int n_cols)
{
    for (int r = 0; r < n_rows; r++)
        for (int k = 0; k < n_cols; k++) {
            int g = k / 32;
            float mag = powf(10.0f, (float)((r + g) % 6) - 3.0f);
            float v = (r + g) % 7 == 4 ? 0.0f : mag * test_rng_float(&g_rng);
            if (k % 37 == (r % 37))
                v = (r % 2 ? 9.0f : -9.0f) * mag;
            w[(size_t)r * n_cols + k] = v;
        }
}

static void test_quant(void)
{
    const int n_rows = 12, n_cols = 256;
    static const int groups[] = {32, 64, 128};
    float *w = malloc((size_t)n_rows * n_cols * sizeof *w);
    float *d = malloc((size_t)n_rows * n_cols * sizeof *d);
    uint8_t *q = malloc((size_t)n_rows * n_cols / 2);
    float *sc = malloc((size_t)n_rows * (n_cols / 32) * sizeof *sc);
    fill_rows(w, n_rows, n_cols);
    for (int gi = 0; gi < 3; gi++) {
        const int G = groups[gi], ng = n_cols / G;
        CHECK(moe_quant_q4_rows(w, n_rows, n_cols, G, q, sc));
        moe_dequant_q4_rows(q, sc, n_rows, n_cols, G, d);
        double worst = 0; /* max |w - deq| / (|scale| / 2), the clamped +8 end aside */
        int bad_scale = 0, bad_code = 0, bad_round = 0, zero_ok = 1;
        for (int r = 0; r < n_rows; r++)
            for (int g = 0; g < ng; g++) {
                float m = 0;
                for (int k = g * G; k < (g + 1) * G; k++)
                    m = fabsf(w[r * n_cols + k]) > fabsf(m) ? w[r * n_cols + k] : m;
                float s = sc[r * ng + g];
                bad_scale += s != m / -8.0f;
                if (m == 0.0f) {
                    for (int k = g * G; k < (g + 1) * G; k++)
                        zero_ok &= d[r * n_cols + k] == 0.0f;
                    continue;
                }
                for (int k = g * G; k < (g + 1) * G; k++) {
                    size_t i = (size_t)r * n_cols + k;
                    int u = moe_q4_code(q + (size_t)r * n_cols / 2, k);
                    bad_code += u < 0 || u > 15;
                    /* as libm rounds w / s: halves away from zero, then clamped */
                    const float v = fminf(fmaxf(roundf(w[i] / s), -8.0f), 7.0f);
                    bad_round += u != (int)v + 8;
                    if (w[i] == m) /* the extreme is exact */
                        bad_code += u != 0 || d[i] != w[i];
                    if (u == 15 && w[i] / s > 7.5f) /* clamped: |w - deq| <= |s| */
                        continue;
                    double e = fabs((double)w[i] - d[i]) / (0.5 * fabs(s));
                    worst = e > worst ? e : worst;
                }
            }
        CHECKF(bad_scale == 0, "group %d: %d scales are not m / -8", G, bad_scale);
        CHECKF(bad_code == 0, "group %d: %d codes out of range or the extreme not exact", G,
               bad_code);
        CHECKF(bad_round == 0, "group %d: %d codes are not roundf(w / scale) clamped", G,
               bad_round);
        CHECKF(zero_ok, "group %d: an all-zero group does not dequantize to zeros", G);
        CHECKF(worst <= 1.0 + 1e-4, "group %d: max |w - deq| is %.6f x |scale|/2", G, worst);
        printf("quant int4 group %d: max |w - deq| = %.4f x |scale|/2\n", G, worst);
    }
    /* the layout: column j and j + 16 of a 32-column block share byte j */
    float one[64] = {0};
    one[0] = 8.0f;   /* sets the scale: d = -1 */
    one[17] = -7.0f; /* code -7 / -1 + 8 = 15 in the high nibble of byte 1 */
    one[33] = 3.0f;  /* second block, low nibble of byte 1 of that block */
    float s1[2];
    uint8_t q1[32];
    CHECK(moe_quant_q4_rows(one, 1, 64, 64, q1, s1));
    CHECKF(s1[0] == -1.0f && q1[0] == 0x80 && q1[1] == 0xf8 && q1[17] == 0x85,
           "layout: scale %g, bytes %02x %02x %02x", s1[0], q1[0], q1[1], q1[17]);
    /* equal magnitudes of both signs: the first sets the scale's sign */
    float tie[32] = {0};
    tie[3] = -5.0f;
    tie[9] = 5.0f;
    CHECK(moe_quant_q4_rows(tie, 1, 32, 32, q1, s1));
    CHECKF(s1[0] == 0.625f, "tie -5 then 5: scale %g, not 0.625", s1[0]);
    tie[3] = 5.0f;
    tie[9] = -5.0f;
    CHECK(moe_quant_q4_rows(tie, 1, 32, 32, q1, s1));
    CHECKF(s1[0] == -0.625f, "tie 5 then -5: scale %g, not -0.625", s1[0]);
    w[5] = NAN;
    CHECK(!moe_quant_q4_rows(w, n_rows, n_cols, 32, q, sc));
    CHECK(moe_q4_scale_offset(3, 64) == 128 && moe_q4_weight_bytes(3, 64, 32) == 128 + 24);
    /* a last group shorter than G: 96 columns in groups of 64 are 64 + 32 */
    CHECK(moe_q4_groups(96, 64) == 2 && moe_q4_weight_bytes(2, 96, 64) == 128 + 16);
    float part[96];
    for (int k = 0; k < 96; k++)
        part[k] = k < 64 ? 0.5f : (k == 70 ? -16.0f : 1.0f);
    float ps[2], pd[96];
    uint8_t pq[48];
    CHECK(moe_quant_q4_rows(part, 1, 96, 64, pq, ps));
    moe_dequant_q4_rows(pq, ps, 1, 96, 64, pd);
    CHECKF(ps[0] == 0.5f / -8.0f && ps[1] == 2.0f && pd[70] == -16.0f && pd[0] == 0.5f,
           "short last group: scales %g %g", ps[0], ps[1]);
    CHECK(moe_q4_group_valid(64) && !moe_q4_group_valid(16) && !moe_q4_group_valid(96));
    CHECK(!strcmp(moe_dtype_name(MOE_DTYPE_I4), "I4"));
    free(w);
    free(d);
    free(q);
    free(sc);
}

struct q4_weights {
    uint8_t *q; /* (n_out, ldw / 2) */
    float *sc;  /* (n_out, moe_q4_groups(ldw, G)) */
    float *deq; /* (n_out, ldw) */
};

static struct q4_weights make_weights(int n_out, int64_t ldw, int G)
{
    size_t n = (size_t)n_out * ldw;
    float *w = malloc(n * sizeof *w);
    fill_rows(w, n_out, (int)ldw);
    size_t n_sc = (size_t)n_out * (size_t)moe_q4_groups(ldw, G);
    struct q4_weights qw = {malloc(n / 2 + 1), malloc((n_sc + 1) * sizeof(float)),
                            malloc(n * sizeof(float) + 1)};
    MOE_ASSERT(moe_quant_q4_rows(w, n_out, ldw, G, qw.q, qw.sc));
    moe_dequant_q4_rows(qw.q, qw.sc, n_out, ldw, G, qw.deq);
    free(w);
    return qw;
}

static void free_weights(struct q4_weights *qw)
{
    free(qw->q);
    free(qw->sc);
    free(qw->deq);
}

/* An int4 matmul's parameters over qw (exact; callers set .fast and
 * .accumulate). */
static struct moe_matmul_params i4_params(const float *x, int n_tok, int n_in, int64_t ldw,
                                          int n_out, const struct q4_weights *qw, int G, float *y)
{
    return (struct moe_matmul_params){.x = x,
                                      .n_tok = n_tok,
                                      .n_in = n_in,
                                      .w = qw->q,
                                      .w_dtype = MOE_DTYPE_I4,
                                      .ldw = ldw,
                                      .n_out = n_out,
                                      .y = y,
                                      .w_scale = qw->sc,
                                      .w_group = G};
}

/* The worst per-output error of the int4 matmul (through `which`: 0 the
 * backend op, 1 the pooled kernel, 2 one thread) against the f32 reference
 * on the dequantized weights, relative to sum |x w| (+ |y0| accumulating);
 * INFINITY when something was written past y. */
static double i4_case(int n_tok, int n_in, int n_out, int64_t ldw, int G, bool accumulate,
                      int which)
{
    struct q4_weights qw = make_weights(n_out, ldw, G);
    size_t nx = (size_t)n_tok * n_in, ny = (size_t)n_tok * n_out;
    float *x = malloc(nx * sizeof *x + 1);
    for (size_t i = 0; i < nx; i++)
        x[i] = test_rng_float(&g_rng);
    float *y = malloc((ny + 16) * sizeof *y), *y_ref = malloc((ny + 16) * sizeof *y);
    float *y0 = malloc((ny + 16) * sizeof *y);
    for (size_t i = 0; i < ny + 16; i++)
        y0[i] = y[i] = y_ref[i] = test_rng_float(&g_rng);
    struct moe_matmul_params p = i4_params(x, n_tok, n_in, ldw, n_out, &qw, G, y);
    p.accumulate = accumulate;
    if (which == 0)
        g_cpu->ops->matmul(g_cpu, &p);
    else
        cpu_matmul(which == 1 ? g_pool : NULL, &p);
    struct moe_matmul_params r = p;
    r.w = qw.deq;
    r.w_dtype = MOE_DTYPE_F32;
    r.w_scale = NULL;
    r.y = y_ref;
    cpu_matmul_ref(&r);
    double worst = 0;
    for (int t = 0; t < n_tok; t++)
        for (int o = 0; o < n_out; o++) {
            double mag = 0;
            for (int k = 0; k < n_in; k++)
                mag += fabs((double)x[(size_t)t * n_in + k] * qw.deq[(size_t)o * ldw + k]);
            size_t i = (size_t)t * n_out + o;
            if (accumulate)
                mag += fabs((double)y0[i]);
            double e = fabs((double)y[i] - y_ref[i]) / (mag > 1e-30 ? mag : 1e-30);
            if (!(e <= worst))
                worst = e;
        }
    for (int i = 0; i < 16; i++)
        if (y[ny + i] != y_ref[ny + i])
            worst = INFINITY;
    /* the int4 reference itself (cpu_matmul_ref on the codes) agrees too */
    struct moe_matmul_params q = p;
    float *y_q = malloc((ny + 16) * sizeof *y_q);
    memcpy(y_q, y0, (ny + 16) * sizeof *y_q);
    q.y = y_q;
    cpu_matmul_ref(&q);
    for (size_t i = 0; i < ny; i++)
        if (y_q[i] != y_ref[i])
            worst = INFINITY; /* the same products in the same order: bit-identical */
    free(y_q);
    free(x);
    free(y);
    free(y_ref);
    free(y0);
    free_weights(&qw);
    return worst;
}

static void test_matmul_i4(const char *isa)
{
    static const int toks[] = {1, 2, 3, 4, 16, 70, 130};
    static const int dims[][2] = {{32, 1}, {64, 3}, {128, 4}, {256, 5}, {384, 37}, {1024, 66}};
    static const int groups[] = {32, 64, 128};
    double worst = 0;
    int n = 0;
    for (size_t ti = 0; ti < sizeof toks / sizeof toks[0]; ti++)
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
            int n_tok = toks[ti], n_in = dims[di][0], n_out = dims[di][1];
            int G = groups[(ti + di) % 3]; /* a last group shorter than G where G > n_in % G */
            bool acc = (ti + di) % 2;
            int64_t ldw = n_in + ((ti + di) % 3 == 0 ? 2 * G : 0); /* a column slice */
            double e = i4_case(n_tok, n_in, n_out, ldw, G, acc, (int)((ti + di) % 3));
            CHECKF(e < SUM_ORDER_TOL,
                   "%s int4 matmul n_tok %d n_in %d n_out %d ldw %lld group %d acc %d: err %.3g",
                   isa, n_tok, n_in, n_out, (long long)ldw, G, acc, e);
            worst = e > worst ? e : worst;
            n++;
        }
    printf("%s: int4 matmul %d cases, worst err %.3g vs the f32 reference on dequantized "
           "weights\n",
           isa, n, worst);
}

/* The fast paths against the exact int4 path (f32 x, f32 dequantized
 * weights), and against an emulation of what they compute; each must also
 * differ from exact somewhere (it ran).
 *   path "avx512-vnni" (AMX forced off) and "avx2-w4a8" (AVX2 forced), W4A8: activations quantized
 *     per token to int8; every output within half a quantization step of x
 *     per element, (sx_t / 2) sum_k |deq_ok| (sx_t = max|x_t| / 127), plus
 *     1e-5 of sum |x w|; the emulation: xq rounded to nearest even, exact
 *     integer sums per group, to 1e-5 of sum_g |s_g| sum_k (u_k + 8) |xq_k| sx
 *     (the sizes of the two f32 sums avx2-w4a8 adds: the codes' and their
 *     offset's; sum |x w| can be far smaller when they cancel).
 *   path "amx-bf16" (AMX-BF16, from 8 tokens): the rows dequantized to bf16 and
 *     the activations rounded to bf16; within (2^-7 + 2^-16 + 2 (n_in + 2)
 *     2^-24) sum |x w| (one bf16 rounding of each operand, f32 sums either
 *     side); the emulation: both operands rounded as the kernel does,
 *     products summed in double, to 1e-5 of sum |x w|.
 * SKIPPED by name where the processor lacks the path. */
static void test_fast_i4(const char *name)
{
    const unsigned have = cpu_kernels_detect_features();
    const unsigned amx_bits = CPU_FEAT_AMX_BF16 | CPU_FEAT_AMX_INT8;
    const enum cpu_isa isa = cpu_kernels_detect_isa();
    const bool amx = !strcmp(name, "amx-bf16"), avx2 = !strcmp(name, "avx2-w4a8");
    if (avx2 ? isa < CPU_ISA_AVX2
             : !(have & CPU_FEAT_AVX512_VNNI) ||
                   (amx && !((have & CPU_FEAT_AMX_BF16) && (have & CPU_FEAT_AVX512_BF16)))) {
        printf("SKIPPED: int4 fast path (%s): this processor lacks it\n", name);
        return;
    }
    if (avx2)
        cpu_kernels_force_isa(CPU_ISA_AVX2);
    else
        cpu_kernels_force_features(amx ? have : have & ~amx_bits);
    CHECKF(!strcmp(cpu_matmul_fast_path(MOE_DTYPE_I4), avx2  ? "avx2-w4a8"
                                                       : amx ? "avx512-vnni+amx-bf16"
                                                             : "avx512-vnni"),
           "%s: int4 fast path is %s", name, cpu_matmul_fast_path(MOE_DTYPE_I4));
    /* avx2-w4a8 takes calls below 32 tokens (larger ones: see below) */
    static const int toks_w4a8[] = {1, 3, 4, 9, 40}, toks_amx[] = {8, 9, 17, 31, 32, 40, 100},
                     toks_avx2[] = {1, 3, 4, 9, 31};
    const int *toks = amx ? toks_amx : avx2 ? toks_avx2 : toks_w4a8;
    const int n_toks = amx ? 7 : 5;
    static const int dims[][3] = {
        {64, 5, 32},    {96, 4, 32},  {256, 33, 64}, {384, 7, 128},
        {1024, 18, 32}, {160, 5, 64}, {224, 3, 128}}; /* short last groups */
    double worst = 0;                                 /* error / bound */
    double emul_worst = 0; /* error vs the emulation / its magnitude (above) */
    int differ = 0, n = 0;
    for (int ti = 0; ti < n_toks; ti++)
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
            const int n_tok = toks[ti], n_in = dims[di][0], n_out = dims[di][1], G = dims[di][2];
            const int64_t ldw = n_in + (ti % 2 ? G : 0);
            struct q4_weights qw = make_weights(n_out, ldw, G);
            float *x = malloc((size_t)n_tok * n_in * sizeof *x);
            for (int i = 0; i < n_tok * n_in; i++)
                x[i] = test_rng_float(&g_rng) * (i % 13 == 0 ? 4.0f : 1.0f);
            float *yf = malloc((size_t)n_tok * n_out * sizeof *yf);
            float *ye = malloc((size_t)n_tok * n_out * sizeof *ye);
            struct moe_matmul_params p = i4_params(x, n_tok, n_in, ldw, n_out, &qw, G, yf);
            p.fast = true;
            CHECK(cpu_matmul_dot_supported(&p) == !avx2);
            cpu_matmul(g_pool, &p);
            p.fast = false;
            p.y = ye;
            cpu_matmul(g_pool, &p);
            for (int t = 0; t < n_tok; t++) {
                float amax = 0;
                for (int k = 0; k < n_in; k++)
                    amax = fmaxf(amax, fabsf(x[(size_t)t * n_in + k]));
                double sx = amax / 127.0;
                /* the instruction emulated: xq rounded to nearest even, exact sums */
                const float inv = 127.0f / amax;
                for (int o = 0; amx && o < n_out; o++) { /* bf16 x bf16, summed in double */
                    double em = 0, mag = 0;
                    for (int k = 0; k < n_in; k++) {
                        float xv = x[(size_t)t * n_in + k];
                        float wq = (float)(moe_q4_code(qw.q + (size_t)o * (ldw / 2), k) - 8) *
                                   qw.sc[(size_t)o * moe_q4_groups(ldw, G) + k / G];
                        em += (double)moe_bf16_to_f32(moe_f32_to_bf16(xv)) *
                              moe_bf16_to_f32(moe_f32_to_bf16(wq));
                        mag += fabs((double)xv * qw.deq[(size_t)o * ldw + k]);
                    }
                    double e = fabs(yf[(size_t)t * n_out + o] - em) / (mag + 1e-30);
                    emul_worst = e > emul_worst || e != e ? e : emul_worst;
                }
                for (int o = 0; !amx && o < n_out; o++) {
                    /* mag: the sizes of the two sums the path adds in f32,
                     * sum s_g u xq and sum s_g (-8) xq (its rounding scales
                     * with them, not with sum |x w|) */
                    double em = 0, mag = 0;
                    for (int g = 0; g < moe_q4_groups(n_in, G); g++) {
                        int64_t isum = 0, asum = 0;
                        for (int k = g * G; k < (g + 1) * G && k < n_in; k++) {
                            float v = nearbyintf(x[(size_t)t * n_in + k] * inv);
                            int xq = v > 127 ? 127 : v < -127 ? -127 : (int)v;
                            const int u = moe_q4_code(qw.q + (size_t)o * (ldw / 2), k);
                            isum += (int64_t)xq * (u - 8);
                            asum += (int64_t)abs(xq) * (u + 8);
                        }
                        const double sg = qw.sc[(size_t)o * moe_q4_groups(ldw, G) + g];
                        em += (double)isum * sg;
                        mag += (double)asum * fabs(sg);
                    }
                    em *= (double)(amax / 127.0f);
                    mag *= (double)(amax / 127.0f);
                    double e = fabs(yf[(size_t)t * n_out + o] - em) / (mag + 1e-30);
                    emul_worst = e > emul_worst || e != e ? e : emul_worst;
                }
                for (int o = 0; o < n_out; o++) {
                    double sw = 0, mag = 0;
                    for (int k = 0; k < n_in; k++) {
                        double w = qw.deq[(size_t)o * ldw + k];
                        sw += fabs(w);
                        mag += fabs(w * x[(size_t)t * n_in + k]);
                    }
                    double bound =
                        amx ? (0x1p-7 + 0x1p-16 + 2.0 * (n_in + 2) * 0x1p-24) * mag + 1e-30
                            : 0.5 * sx * sw * (1 + 1e-4) + 1e-5 * mag + 1e-30;
                    size_t i = (size_t)t * n_out + o;
                    double e = fabs((double)yf[i] - ye[i]) / bound;
                    worst = e > worst || e != e ? e : worst;
                    differ += yf[i] != ye[i];
                }
            }
            n++;
            free(x);
            free(yf);
            free(ye);
            free_weights(&qw);
        }
    CHECKF(worst <= 1.0, "%s: int4 fast: an output is %.3g x its bound from the exact int4 path",
           name, worst);
    CHECKF(differ > 0, "%s: int4 fast: every output equals the exact path (fast path not used?)",
           name);
    CHECKF(emul_worst < 1e-5, "%s: int4 fast: %.3g of its magnitude from an emulation of the path",
           name, emul_worst);
    printf("%s: int4 fast (%s) %d cases, worst error %.3g of the bound, %.3g of its magnitude "
           "from the emulation, %d outputs differ from exact\n",
           name, amx ? "bf16-dequantized rows, bf16 x" : "W4A8", n, worst, emul_worst, differ);
    cpu_kernels_force_features(have);
    cpu_kernels_force_isa(isa);
}

/* How many tokens of the call p (already run: its outputs in p->y) come out
 * otherwise when each runs alone with p's other settings. */
static int tokens_differing_alone(const struct moe_matmul_params *p)
{
    float *y1 = malloc((size_t)p->n_out * sizeof *y1);
    int differ = 0;
    for (int t = 0; t < p->n_tok; t++) {
        struct moe_matmul_params q = *p;
        q.x = p->x + (size_t)t * p->n_in;
        q.n_tok = 1;
        q.y = y1;
        cpu_matmul(g_pool, &q);
        differ += memcmp(y1, p->y + (size_t)t * p->n_out, (size_t)p->n_out * sizeof *y1) != 0;
    }
    free(y1);
    return differ;
}

/* W4A8 (AMX off) reduces every tile with one add tree, so a token's output
 * does not depend on the other tokens of the call: each token of a 7-token
 * call (a 4-token tile and a 3-token one; on AVX2 three 2-token tiles and a
 * 1-token one) alone equals its row, bit for bit. */
static void test_i4_token_alone(const char *name)
{
    const unsigned have = cpu_kernels_detect_features();
    const enum cpu_isa isa = cpu_kernels_detect_isa();
    const bool avx2 = !strcmp(name, "avx2-w4a8");
    if (avx2 ? isa < CPU_ISA_AVX2 : !(have & CPU_FEAT_AVX512_VNNI)) {
        printf("SKIPPED: int4 token alone (%s): this processor lacks it\n", name);
        return;
    }
    if (avx2)
        cpu_kernels_force_isa(CPU_ISA_AVX2);
    else
        cpu_kernels_force_features(have & ~(CPU_FEAT_AMX_BF16 | CPU_FEAT_AMX_INT8));
    const int n_tok = 7, n_in = 256, n_out = 70, G = 32;
    struct q4_weights qw = make_weights(n_out, n_in, G);
    float *x = malloc((size_t)n_tok * n_in * sizeof *x);
    for (int i = 0; i < n_tok * n_in; i++)
        x[i] = test_rng_float(&g_rng);
    float *ya = malloc((size_t)n_tok * n_out * sizeof *ya);
    struct moe_matmul_params p = i4_params(x, n_tok, n_in, n_in, n_out, &qw, G, ya);
    p.fast = true;
    cpu_matmul(g_pool, &p);
    int differ = tokens_differing_alone(&p);
    CHECKF(differ == 0, "%s int4: %d of %d tokens differ alone from in the call", name, differ,
           n_tok);
    printf("%s int4: each token alone equals its row of a %d-token call, bit for bit\n", name,
           n_tok);
    free(x);
    free(ya);
    free_weights(&qw);
    cpu_kernels_force_features(have);
    cpu_kernels_force_isa(isa);
}

/* avx2-w4a8 from 32 tokens: a fast call takes the exact kernels (their
 * packed panels share the dequantization over the tokens), so it equals the
 * exact call bit for bit; under batch_invariant it stays on W4A8, each token
 * equal to itself alone. */
static void test_avx2_w4a8_large(void)
{
    const enum cpu_isa isa = cpu_kernels_detect_isa();
    if (isa < CPU_ISA_AVX2) {
        printf("SKIPPED: avx2-w4a8 large calls: this processor lacks AVX2\n");
        return;
    }
    cpu_kernels_force_isa(CPU_ISA_AVX2);
    const int n_tok = 40, n_in = 256, n_out = 37, G = 64;
    struct q4_weights qw = make_weights(n_out, n_in, G);
    float *x = malloc((size_t)n_tok * n_in * sizeof *x);
    for (int i = 0; i < n_tok * n_in; i++)
        x[i] = test_rng_float(&g_rng);
    float *yf = malloc((size_t)n_tok * n_out * sizeof *yf),
          *ye = malloc((size_t)n_tok * n_out * sizeof *ye);
    struct moe_matmul_params p = i4_params(x, n_tok, n_in, n_in, n_out, &qw, G, yf);
    p.fast = true;
    cpu_matmul(g_pool, &p);
    p.fast = false;
    p.y = ye;
    cpu_matmul(g_pool, &p);
    CHECKF(memcmp(yf, ye, (size_t)n_tok * n_out * sizeof *yf) == 0,
           "avx2-w4a8: a %d-token fast call differs from the exact one", n_tok);
    p.fast = p.batch_invariant = true;
    p.y = yf;
    cpu_matmul(g_pool, &p);
    int differ = tokens_differing_alone(&p);
    CHECKF(differ == 0, "avx2-w4a8 batch_invariant: %d of %d tokens differ alone", differ, n_tok);
    CHECKF(memcmp(yf, ye, (size_t)n_tok * n_out * sizeof *yf) != 0,
           "avx2-w4a8 batch_invariant: the call equals the exact path (W4A8 not used?)");
    printf("avx2-w4a8: a %d-token call equals the exact kernels bit for bit; under "
           "batch_invariant it stays W4A8, each token equal to itself alone\n",
           n_tok);
    free(x);
    free(yf);
    free(ye);
    free_weights(&qw);
    cpu_kernels_force_isa(isa);
}

/* The comparison can fail: one dequantized reference weight off by one code. */
static void test_detects_error(void)
{
    const int n_tok = 2, n_in = 64, n_out = 5;
    struct q4_weights qw = make_weights(n_out, n_in, 32);
    float x[2 * 64], y[10], y_ref[10];
    for (int i = 0; i < n_tok * n_in; i++)
        x[i] = 1.0f + test_rng_float(&g_rng);
    struct moe_matmul_params p = i4_params(x, n_tok, n_in, n_in, n_out, &qw, 32, y);
    cpu_matmul(g_pool, &p);
    int o = 3, k = 40; /* group 1 of row 3 */
    qw.deq[o * n_in + k] += fabsf(qw.sc[o * 2 + 1]) + 1.0f;
    struct moe_matmul_params r = p;
    r.w = qw.deq;
    r.w_dtype = MOE_DTYPE_F32;
    r.w_scale = NULL;
    r.y = y_ref;
    cpu_matmul_ref(&r);
    double num = 0, den = 1e-30;
    for (int i = 0; i < n_tok * n_out; i++) {
        num = fmax(num, fabs(y[i] - y_ref[i]));
        den = fmax(den, fabs(y_ref[i]));
    }
    CHECKF(num / den > 1e-4, "a corrupted reference weight went unnoticed (err %.3g)", num / den);
    free_weights(&qw);
}

static void test_grouped_i4(void)
{
    const int n_e = 4, n_in = 128, n_out = 9, G = 64;
    const int32_t off[5] = {0, 2, 2, 19, 23}; /* expert 1 has no rows */
    const int n_rows = off[4];
    struct q4_weights qw[4];
    const void *w[4];
    const float *sc[4];
    for (int e = 0; e < n_e; e++) {
        qw[e] = make_weights(n_out, n_in, G);
        w[e] = e == 1 ? NULL : qw[e].q;
        sc[e] = e == 1 ? NULL : qw[e].sc;
    }
    float *x = malloc((size_t)n_rows * n_in * sizeof *x);
    float y[23 * 9], y_ref[23 * 9];
    for (int i = 0; i < n_rows * n_in; i++)
        x[i] = test_rng_float(&g_rng);
    struct moe_grouped_matmul_params p = {
        .x = x,
        .n_rows = n_rows,
        .n_in = n_in,
        .n_out = n_out,
        .n_expert = n_e,
        .expert_offsets = off,
        .w = w,
        .w_dtype = MOE_DTYPE_I4,
        .ldw = n_in,
        .y = y,
        .w_scale = sc,
        .w_group = G,
    };
    struct moe_error err = {0};
    g_cpu->ops->grouped_matmul(g_cpu, &p);
    CHECKF(g_cpu->ops->status(g_cpu, &err) == MOE_OK, "grouped int4: %s", err.msg);
    for (int e = 0; e < n_e; e++) {
        if (off[e + 1] == off[e])
            continue;
        struct moe_matmul_params r = {.x = x + (size_t)off[e] * n_in,
                                      .n_tok = off[e + 1] - off[e],
                                      .n_in = n_in,
                                      .w = qw[e].deq,
                                      .w_dtype = MOE_DTYPE_F32,
                                      .ldw = n_in,
                                      .n_out = n_out,
                                      .y = y_ref + (size_t)off[e] * n_out};
        cpu_matmul_ref(&r);
    }
    double num = 0, den = 1e-30;
    for (int i = 0; i < n_rows * n_out; i++) {
        num = fmax(num, fabs((double)y[i] - y_ref[i]));
        den = fmax(den, fabs((double)y_ref[i]));
    }
    CHECKF(num / den < SUM_ORDER_TOL, "grouped int4 err %.3g", num / den);
    p.w_group = 48; /* not a group size */
    g_cpu->ops->grouped_matmul(g_cpu, &p);
    enum moe_status st = g_cpu->ops->status(g_cpu, &err);
    CHECKF(st == MOE_ERR_INVALID && strstr(err.msg, "I4 group 48"), "status %d (%s)", (int)st,
           err.msg);
    p.w_group = G;
    sc[2] = NULL;
    g_cpu->ops->grouped_matmul(g_cpu, &p);
    st = g_cpu->ops->status(g_cpu, &err);
    CHECKF(st == MOE_ERR_INVALID && strstr(err.msg, "no scales"), "status %d (%s)", (int)st,
           err.msg);
    printf("grouped_matmul int4: err %.3g vs the per-expert reference; bad group and missing "
           "scales refused\n",
           num / den);
    free(x);
    for (int e = 0; e < n_e; e++)
        free_weights(&qw[e]);
}

int main(void)
{
    struct moe_error err = {0};
    if (moe_backend_cpu_create(2, &g_cpu, &err) != MOE_OK ||
        moe_threadpool_create(3, &g_pool, &err) != MOE_OK) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return 1;
    }
    test_quant();
    enum cpu_isa best = cpu_kernels_detect_isa();
    for (int isa = CPU_ISA_SCALAR; isa <= (int)best; isa++) {
        enum cpu_isa got = cpu_kernels_force_isa((enum cpu_isa)isa);
        CHECK(got == (enum cpu_isa)isa);
        test_matmul_i4(cpu_isa_name(got));
    }
    cpu_kernels_force_isa(best);
    test_detects_error();
    test_fast_i4("avx2-w4a8");
    test_fast_i4("avx512-vnni");
    test_i4_token_alone("avx2-w4a8");
    test_avx2_w4a8_large();
    test_i4_token_alone("avx512-vnni");
    test_fast_i4("amx-bf16");
    test_grouped_i4();
    moe_threadpool_destroy(g_pool);
    moe_backend_destroy(g_cpu);
    return test_summary();
}
