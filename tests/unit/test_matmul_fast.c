/* The fast matmul paths (moe_matmul_params.fast, kernels/cpu/matmul_dot.c)
 * on every one this processor has; a path it lacks is reported SKIPPED by
 * name, and the test exits 77 when it has none (so nothing passes without
 * running). Where the processor has AMX, each type runs twice: on AMX (the
 * packed tiles, 32+ tokens) and with AMX forced off (AVX-512 throughout);
 * AMX int8 must equal AVX512-VNNI bit for bit (the same exact i32 sums).
 *
 * Each path is held to two references computed here in double:
 *   - the exact path's arithmetic (f32 x, the same weights), within the
 *     documented bound of the approximation:
 *       avx512-bf16, amx-bf16: |y - ref| <= 2^-8 sum_k |x_k w_k| + (n_in + 2) 2^-24
 *         sum_k |x_k w_k|  (bf16 has 8 significant bits: x rounded to
 *         nearest moves by < 2^-8 |x|; then the f32 sums of either side);
 *       avx512-vnni, amx-int8: |y - ref| <= (1 + 1e-3) (sx / 2) w_scale sum_k |q_k|
 *         + 1e-5 sum_k |x_k w_k|  (half a quantization step of x per element);
 *   - an emulation of what the instruction computes (x rounded / quantized
 *     here, products and sums in double), to 1e-5 of sum_k |x_k w_k|: this
 *     one fails if a path computes something else than it claims (a wrong
 *     pair order, a lost offset, a wrong scale) even when the loose bound
 *     above would hide it.
 * Shapes: odd n_in / n_out (masked tails), a row stride wider than n_in,
 * 1..5 tokens (streaming tiles), 2..31 with n_in a multiple of 64 (AMX's
 * weight-stationary form), 8..17 (AMX's thresholds), 31..300 tokens
 * (packed panels with leftover tokens), accumulate on and off, through the ops table, the pool and
 * the calling thread. Also: int8 results do not depend on the batch they are in (exact integer
 * sums), a NaN row stays NaN, an all-zero row gives 0, a forced-off feature falls back to the
 * exact kernels bit for bit, and a grouped matmul (all experts in one pool run) equals one call
 * per expert bit for bit.
 *
 * avx2-w8a8 (int8 on AVX2, forced on AVX-512 machines too): every call is held to
 * the same bound and emulation, and besides, output by output, to the float the VNNI path's
 * formula gives from exact integer sums (bit for bit), at every call size, batch-invariant;
 * where the processor has AVX512-VNNI, avx2-w8a8 equals it bit for bit. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/cpu_kernels.h"
#include "quant.h"
#include "testlib.h"

static struct test_rng g_rng = {0x5851f42d4c957f2dull};

/* The path under test is avx2-w8a8 (matmul.c): every int8 call runs W8A8
 * there. */
static bool g_w8a8_avx2;

static struct moe_backend *g_cpu;     /* 2 threads, through the ops table */
static struct moe_threadpool *g_pool; /* 3 threads, direct kernel calls */

struct fcase {
    int n_tok, n_in, n_out;
    int64_t ldw;
    bool accumulate;
    int via; /* 0: ops table, 1: pool of 3, 2: calling thread */
};

/* Random weights of `dt` (I8: values in [-127, 127] and row scales, in one
 * buffer as the model lays them out); x with one outlier per row. */
static void *make_weights(enum moe_dtype dt, int n_out, int64_t ldw, const float **scale)
{
    size_t n = (size_t)n_out * ldw;
    if (dt == MOE_DTYPE_BF16) {
        uint16_t *w = malloc(n * 2);
        for (size_t i = 0; i < n; i++)
            w[i] = moe_f32_to_bf16(test_rng_float(&g_rng));
        *scale = NULL;
        return w;
    }
    size_t off = moe_i8_scale_offset(n_out, ldw);
    char *buf = malloc(off + (size_t)n_out * sizeof(float));
    int8_t *q = (int8_t *)buf;
    for (size_t i = 0; i < n; i++)
        q[i] = (int8_t)((int)(test_rng_u32(&g_rng) % 255) - 127);
    float *sc = (float *)(buf + off);
    for (int r = 0; r < n_out; r++)
        sc[r] = (0.5f + 0.5f * fabsf(test_rng_float(&g_rng))) / 127.0f;
    *scale = sc;
    return buf;
}

static double w_at(enum moe_dtype dt, const void *w, const float *sc, int64_t ldw, int o, int k,
                   bool raw)
{
    if (dt == MOE_DTYPE_BF16)
        return moe_bf16_to_f32(((const uint16_t *)w)[(size_t)o * ldw + k]);
    double q = ((const int8_t *)w)[(size_t)o * ldw + k];
    return raw ? q : q * sc[o];
}

/* What the instruction path computes for row x (n_in): bf16 rounding, or
 * the per-token quantization (xq and its scale). */
static void emulate_act(enum moe_dtype dt, const float *x, int n_in, double *xe, double *sx)
{
    if (dt == MOE_DTYPE_BF16) {
        for (int k = 0; k < n_in; k++)
            xe[k] = moe_bf16_to_f32(moe_f32_to_bf16(x[k]));
        *sx = 1.0;
        return;
    }
    float a = 0.0f;
    for (int k = 0; k < n_in; k++)
        a = fmaxf(a, fabsf(x[k]));
    float inv = a > 0.0f ? 127.0f / a : 0.0f;
    for (int k = 0; k < n_in; k++) {
        float q = nearbyintf(x[k] * inv);
        xe[k] = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
    }
    *sx = a > 0.0f ? (double)(a / 127.0f) : 0.0;
}

/* Runs one case on the fast path; returns the worst emulation error (the
 * bound check is done here). */
static double fast_case(enum moe_dtype dt, const struct fcase *c, double *worst_bound)
{
    const float *sc = NULL;
    void *w = make_weights(dt, c->n_out, c->ldw, &sc);
    float *x = malloc((size_t)c->n_tok * c->n_in * sizeof *x);
    for (int t = 0; t < c->n_tok; t++)
        for (int k = 0; k < c->n_in; k++)
            x[(size_t)t * c->n_in + k] =
                test_rng_float(&g_rng) * (k == (t * 7) % c->n_in ? 8.0f : 1.0f);
    size_t ny = (size_t)c->n_tok * c->n_out;
    float *y = malloc((ny + 16) * sizeof *y), *y0 = malloc((ny + 16) * sizeof *y0);
    for (size_t i = 0; i < ny + 16; i++)
        y0[i] = y[i] = test_rng_float(&g_rng);
    struct moe_matmul_params p = {
        .x = x,
        .n_tok = c->n_tok,
        .n_in = c->n_in,
        .w = w,
        .w_dtype = dt,
        .ldw = c->ldw,
        .n_out = c->n_out,
        .y = y,
        .accumulate = c->accumulate,
        .w_scale = sc,
        .fast = true,
    };
    CHECK(g_w8a8_avx2 ? !cpu_matmul_dot_supported(&p) : cpu_matmul_dot_supported(&p));
    if (c->via == 0)
        g_cpu->ops->matmul(g_cpu, &p);
    else
        cpu_matmul(c->via == 1 ? g_pool : NULL, &p);
    double worst_emu = 0;
    double *xe = malloc((size_t)c->n_in * sizeof *xe);
    for (int t = 0; t < c->n_tok; t++) {
        const float *xt = x + (size_t)t * c->n_in;
        double sx;
        emulate_act(dt, xt, c->n_in, xe, &sx);
        for (int o = 0; o < c->n_out; o++) {
            double ref = 0, mag = 0, emu = 0, qsum = 0;
            for (int k = 0; k < c->n_in; k++) {
                double wv = w_at(dt, w, sc, c->ldw, o, k, false);
                ref += (double)xt[k] * wv;
                mag += fabs((double)xt[k] * wv);
                if (dt == MOE_DTYPE_BF16) {
                    emu += xe[k] * wv;
                } else {
                    double q = w_at(dt, w, sc, c->ldw, o, k, true);
                    emu += xe[k] * q;
                    qsum += fabs(q);
                }
            }
            if (dt == MOE_DTYPE_I8)
                emu *= sx * sc[o];
            size_t i = (size_t)t * c->n_out + o;
            double base = c->accumulate ? y0[i] : 0.0;
            double got = (double)y[i] - base;
            double bound = dt == MOE_DTYPE_BF16 ? ldexp(mag, -8) + (c->n_in + 2) * ldexp(mag, -24)
                                                : (1 + 1e-3) * 0.5 * sx * sc[o] * qsum + 1e-5 * mag;
            double slack = 1e-6 * fabs(base); /* the rounding of y += v */
            double eb = fabs(got - ref) / (bound + slack + 1e-30);
            double ee = fabs(got - emu) / (1e-5 * mag + slack + 1e-30);
            if (!(eb <= *worst_bound))
                *worst_bound = isnan(eb) ? INFINITY : eb;
            if (!(ee <= worst_emu))
                worst_emu = isnan(ee) ? INFINITY : ee;
            if (g_w8a8_avx2) {
                /* exact int32 sums scaled as the VNNI path scales them:
                 * the same float, bit for bit */
                int64_t isum = 0;
                for (int k = 0; k < c->n_in; k++)
                    isum += (int64_t)xe[k] * ((const int8_t *)w)[(size_t)o * c->ldw + k];
                float a = 0.0f;
                for (int k = 0; k < c->n_in; k++)
                    a = fmaxf(a, fabsf(xt[k]));
                float v = (float)isum * ((a / 127.0f) * sc[o]);
                float want = c->accumulate ? y0[i] + v : v;
                if (memcmp(&want, &y[i], sizeof want) != 0)
                    worst_emu = INFINITY;
            }
        }
    }
    for (int i = 0; i < 16; i++)
        if (y[ny + i] != y0[ny + i])
            worst_emu = INFINITY; /* wrote past the end */
    free(xe);
    free(x);
    free(y);
    free(y0);
    free(w);
    return worst_emu;
}

static void test_path(enum moe_dtype dt, const char *name)
{
    static const struct fcase fixed[] = {
        {1, 64, 4, 64, false, 0},
        {1, 1024, 2816, 1024, false, 0},
        /* one token: 16-row tiles from 4 streams, and the rows past them */
        {1, 128, 4096, 128, true, 0},
        {1, 100, 53, 104, true, 1},
        {1, 33, 300, 40, false, 2},
        {2, 77, 13, 80, true, 1},
        {3, 31, 5, 31, false, 2},
        {4, 2816, 1024, 2816, false, 0},
        {5, 100, 9, 128, true, 1},
        {31, 63, 33, 64, false, 0},
        {32, 64, 32, 64, false, 0},
        {33, 129, 47, 130, true, 1},
        {100, 1024, 96, 1024, false, 0},
        {300, 200, 70, 256, true, 2},
        {257, 65, 31, 65, false, 1},
        {8, 96, 40, 96, false, 0},
        {9, 33, 17, 40, true, 1},
        {16, 300, 33, 300, false, 2},
        {17, 64, 64, 64, true, 0},
        /* n_in a multiple of 64: AMX's weight-stationary form below 32 tokens */
        {2, 64, 33, 64, false, 0},
        {7, 128, 70, 136, true, 1},
        {8, 1024, 40, 1024, false, 2},
        {20, 192, 50, 200, true, 0},
        {31, 256, 31, 256, false, 1},
        {16, 2816, 32, 2816, true, 2},
        /* ... with 64+ rows a task: a block's 32 rows from 32 parts of it */
        {16, 256, 1100, 256, true, 1},
        {9, 128, 2050, 136, false, 0},
        {24, 64, 1500, 64, true, 2},
    };
    double worst_bound = 0, worst_emu = 0;
    int n = 0;
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++, n++)
        worst_emu = fmax(worst_emu, fast_case(dt, &fixed[i], &worst_bound));
    for (int i = 0; i < 40; i++, n++) {
        struct fcase c = {
            .n_tok = 1 + (int)(test_rng_u32(&g_rng) % (i % 2 ? 6 : 140)),
            .n_in = 1 + (int)(test_rng_u32(&g_rng) % 300),
            .n_out = 1 + (int)(test_rng_u32(&g_rng) % 90),
            .accumulate = test_rng_u32(&g_rng) % 2,
            .via = (int)(test_rng_u32(&g_rng) % 3),
        };
        c.ldw = c.n_in + (test_rng_u32(&g_rng) % 3 ? 0 : (int)(test_rng_u32(&g_rng) % 9));
        worst_emu = fmax(worst_emu, fast_case(dt, &c, &worst_bound));
    }
    CHECKF(worst_bound <= 1.0, "%s: error %.3g x the documented bound", name, worst_bound);
    CHECKF(worst_emu <= 1.0, "%s: differs from its emulation by %.3g x 1e-5 sum|xw|", name,
           worst_emu);
    printf("%s: %d cases, worst error %.3g of the documented bound, %.3g of 1e-5 sum|xw| vs the "
           "emulated instruction\n",
           name, n, worst_bound, worst_emu);
}

/* A token's int8 result does not depend on the other tokens of the call
 * (exact integer sums): token rows alone (streaming tiles) equal the same
 * rows inside a 200-token call (packed panels), bit for bit. */
static void test_i8_batch_invariance(const char *name)
{
    const int n_tok = 200, n_in = 300, n_out = 70;
    const float *sc;
    void *w = make_weights(MOE_DTYPE_I8, n_out, n_in, &sc);
    float *x = malloc((size_t)n_tok * n_in * sizeof *x);
    for (size_t i = 0; i < (size_t)n_tok * n_in; i++)
        x[i] = test_rng_float(&g_rng);
    float *ya = malloc((size_t)n_tok * n_out * sizeof *ya);
    float *y1 = malloc((size_t)n_out * sizeof *y1);
    struct moe_matmul_params p = {.x = x,
                                  .n_tok = n_tok,
                                  .n_in = n_in,
                                  .w = w,
                                  .w_dtype = MOE_DTYPE_I8,
                                  .ldw = n_in,
                                  .n_out = n_out,
                                  .y = ya,
                                  .w_scale = sc,
                                  .fast = true};
    cpu_matmul(g_pool, &p);
    int differ = 0;
    for (int t = 0; t < n_tok; t += 13) {
        struct moe_matmul_params q = p;
        q.x = x + (size_t)t * n_in;
        q.n_tok = 1;
        q.y = y1;
        cpu_matmul(NULL, &q);
        differ += memcmp(y1, ya + (size_t)t * n_out, (size_t)n_out * sizeof *y1) != 0;
    }
    CHECKF(differ == 0, "%s: %d tokens differ alone vs in a batch of %d", name, differ, n_tok);
    printf("%s: one token alone equals the same token in a %d-token call, bit for bit\n", name,
           n_tok);
    free(w);
    free(x);
    free(ya);
    free(y1);
}

/* avx2-w8a8 (forced AVX2) equals avx512-vnni bit for bit (its streaming
 * tiles below 8 tokens, packed panels and AMX above): the same quantization,
 * the same exact i32 sums, the same scaling. */
static void test_w8a8_avx2_equals_vnni(void)
{
    static const int shapes[][3] = {{1, 1024, 300}, {1, 100, 53},  {2, 77, 13},   {3, 31, 5},
                                    {5, 300, 70},   {7, 2816, 64}, {40, 300, 70}, {130, 256, 33}};
    int differ = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int n_tok = shapes[s][0], n_in = shapes[s][1], n_out = shapes[s][2];
        const float *sc;
        void *w = make_weights(MOE_DTYPE_I8, n_out, n_in, &sc);
        float *x = malloc((size_t)n_tok * n_in * sizeof *x);
        for (size_t i = 0; i < (size_t)n_tok * n_in; i++)
            x[i] = test_rng_float(&g_rng);
        float *yv = malloc((size_t)n_tok * n_out * sizeof *yv);
        float *ya = malloc((size_t)n_tok * n_out * sizeof *ya);
        struct moe_matmul_params p = {.x = x,
                                      .n_tok = n_tok,
                                      .n_in = n_in,
                                      .w = w,
                                      .w_dtype = MOE_DTYPE_I8,
                                      .ldw = n_in,
                                      .n_out = n_out,
                                      .y = yv,
                                      .w_scale = sc,
                                      .fast = true};
        cpu_matmul(g_pool, &p);
        enum cpu_isa was = cpu_kernels_isa();
        cpu_kernels_force_isa(CPU_ISA_AVX2);
        CHECK(strcmp(cpu_matmul_fast_path(MOE_DTYPE_I8), "avx2-w8a8") == 0);
        p.y = ya;
        cpu_matmul(g_pool, &p);
        cpu_kernels_force_isa(was);
        differ += memcmp(yv, ya, (size_t)n_tok * n_out * sizeof *yv) != 0;
        free(w);
        free(x);
        free(yv);
        free(ya);
    }
    CHECKF(differ == 0, "avx2-w8a8: %d shapes differ from avx512-vnni", differ);
    printf("avx2-w8a8: equals avx512-vnni bit for bit in %zu shapes\n",
           sizeof shapes / sizeof shapes[0]);
}

/* AMX int8 tiles and the AVX512-VNNI panels compute the same exact i32
 * sums and scale them alike: equal bit for bit, over shapes with token,
 * row and k tails. BF16 is held to the bound and emulation by test_path
 * instead (another f32 rounding order). */
static void test_amx_i8_equals_vnni(unsigned amx_on)
{
    static const int shapes[][3] = {{8, 128, 40},  {16, 100, 50},  {17, 64, 33},   {31, 256, 100},
                                    {32, 64, 32},  {33, 129, 47},  {200, 300, 70}, {47, 1024, 96},
                                    {257, 65, 31}, {16, 256, 1100}};
    int differ = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int n_tok = shapes[s][0], n_in = shapes[s][1], n_out = shapes[s][2];
        const float *sc;
        void *w = make_weights(MOE_DTYPE_I8, n_out, n_in, &sc);
        float *x = malloc((size_t)n_tok * n_in * sizeof *x);
        for (size_t i = 0; i < (size_t)n_tok * n_in; i++)
            x[i] = test_rng_float(&g_rng);
        float *ya = malloc((size_t)n_tok * n_out * sizeof *ya);
        float *yv = malloc((size_t)n_tok * n_out * sizeof *yv);
        struct moe_matmul_params p = {.x = x,
                                      .n_tok = n_tok,
                                      .n_in = n_in,
                                      .w = w,
                                      .w_dtype = MOE_DTYPE_I8,
                                      .ldw = n_in,
                                      .n_out = n_out,
                                      .y = ya,
                                      .w_scale = sc,
                                      .fast = true};
        cpu_kernels_force_features(amx_on);
        CHECK(strcmp(cpu_matmul_fast_path(MOE_DTYPE_I8), "amx-int8") == 0);
        cpu_matmul(g_pool, &p);
        cpu_kernels_force_features(amx_on & ~(unsigned)CPU_FEAT_AMX_INT8);
        CHECK(strcmp(cpu_matmul_fast_path(MOE_DTYPE_I8), "avx512-vnni") == 0);
        p.y = yv;
        cpu_matmul(g_pool, &p);
        differ += memcmp(ya, yv, (size_t)n_tok * n_out * sizeof *ya) != 0;
        free(w);
        free(x);
        free(ya);
        free(yv);
    }
    cpu_kernels_force_features(amx_on);
    CHECKF(differ == 0, "amx-int8: %d of 10 shapes differ from avx512-vnni", differ);
    printf("amx-int8: equals avx512-vnni bit for bit on 10 shapes (8..257 tokens)\n");
}

/* A grouped matmul on the fast path runs all its experts' tasks in one pool
 * run (cpu_matmul_dot_many); each expert's rows must come out bit for bit
 * as its own cpu_matmul call gives them. Row counts cross every tile kind's
 * threshold (streaming, AMX weight-stationary, packed) and include empty
 * experts; accumulate on and off; the pool and the calling thread. */
static void test_grouped_equals_each(enum moe_dtype dt, const char *name)
{
    enum { E = 8 };
    static const int counts[E] = {0, 1, 4, 9, 0, 40, 17, 300};
    const int n_in = 192, n_out = 70;
    int32_t off[E + 1] = {0};
    for (int e = 0; e < E; e++)
        off[e + 1] = off[e] + counts[e];
    const int n_rows = off[E];
    const void *w[E];
    const float *sc[E];
    for (int e = 0; e < E; e++)
        w[e] = make_weights(dt, n_out, n_in, &sc[e]);
    float *x = malloc((size_t)n_rows * n_in * sizeof *x);
    for (size_t i = 0; i < (size_t)n_rows * n_in; i++)
        x[i] = test_rng_float(&g_rng);
    float *yg = malloc((size_t)n_rows * n_out * sizeof *yg);
    float *ye = malloc((size_t)n_rows * n_out * sizeof *ye);
    int differ = 0, runs = 0;
    for (int acc = 0; acc < 2; acc++)
        for (int via = 0; via < 2; via++) {
            struct moe_threadpool *pool = via ? NULL : g_pool;
            for (size_t i = 0; i < (size_t)n_rows * n_out; i++)
                yg[i] = ye[i] = 0.25f * (float)(i % 7);
            struct moe_grouped_matmul_params gp = {
                .x = x,
                .n_rows = n_rows,
                .n_in = n_in,
                .n_out = n_out,
                .n_expert = E,
                .expert_offsets = off,
                .w = w,
                .w_dtype = dt,
                .ldw = n_in,
                .y = yg,
                .accumulate = acc,
                .w_scale = dt == MOE_DTYPE_I8 ? sc : NULL,
                .fast = true,
            };
            struct moe_error err = {0};
            CHECKF(cpu_grouped_matmul(pool, &gp, &err) == MOE_OK, "%s: grouped: %s", name, err.msg);
            for (int e = 0; e < E; e++) {
                struct moe_matmul_params p = {.x = x + (size_t)off[e] * n_in,
                                              .n_tok = counts[e],
                                              .n_in = n_in,
                                              .w = w[e],
                                              .w_dtype = dt,
                                              .ldw = n_in,
                                              .n_out = n_out,
                                              .y = ye + (size_t)off[e] * n_out,
                                              .accumulate = acc,
                                              .w_scale = sc[e],
                                              .fast = true};
                cpu_matmul(pool, &p);
            }
            differ += memcmp(yg, ye, (size_t)n_rows * n_out * sizeof *yg) != 0;
            runs++;
        }
    CHECKF(differ == 0, "%s: grouped matmul differs from one call per expert in %d of %d runs",
           name, differ, runs);
    if (differ == 0)
        printf("%s: a grouped matmul (8 experts, 0..300 rows) equals one call per expert, bit for "
               "bit\n",
               name);
    for (int e = 0; e < E; e++)
        free((void *)w[e]);
    free(x);
    free(yg);
    free(ye);
}

/* A NaN in a row makes that row's outputs NaN; a zero row gives zeros. */
static void test_special_rows(enum moe_dtype dt, const char *name)
{
    const int n_in = 70, n_out = 9;
    const float *sc;
    void *w = make_weights(dt, n_out, n_in, &sc);
    for (int n_tok = 3; n_tok <= 40; n_tok += 37) { /* streaming and packed */
        float *x = malloc((size_t)n_tok * n_in * sizeof *x);
        for (size_t i = 0; i < (size_t)n_tok * n_in; i++)
            x[i] = test_rng_float(&g_rng);
        memset(x, 0, (size_t)n_in * sizeof *x); /* row 0: zeros */
        x[n_in + 5] = NAN;                      /* row 1: a NaN */
        float *y = malloc((size_t)n_tok * n_out * sizeof *y);
        struct moe_matmul_params p = {.x = x,
                                      .n_tok = n_tok,
                                      .n_in = n_in,
                                      .w = w,
                                      .w_dtype = dt,
                                      .ldw = n_in,
                                      .n_out = n_out,
                                      .y = y,
                                      .w_scale = sc,
                                      .fast = true};
        cpu_matmul(g_pool, &p);
        int zero_ok = 1, nan_ok = 1, rest_ok = 1;
        for (int o = 0; o < n_out; o++) {
            zero_ok &= y[o] == 0.0f;
            nan_ok &= isnan(y[n_out + o]);
            for (int t = 2; t < n_tok; t++)
                rest_ok &= isfinite(y[(size_t)t * n_out + o]);
        }
        CHECKF(zero_ok && nan_ok && rest_ok, "%s, %d tokens: zero row %d, NaN row %d, others %d",
               name, n_tok, zero_ok, nan_ok, rest_ok);
        free(x);
        free(y);
    }
    free(w);
}

/* With the features `off` forced off (and `on` on), fast = true runs the
 * exact kernels. */
static void test_forced_off(enum moe_dtype dt, unsigned off, unsigned on, const char *name)
{
    const int n_tok = 7, n_in = 96, n_out = 20;
    const float *sc;
    void *w = make_weights(dt, n_out, n_in, &sc);
    float *x = malloc((size_t)n_tok * n_in * sizeof *x);
    for (size_t i = 0; i < (size_t)n_tok * n_in; i++)
        x[i] = test_rng_float(&g_rng);
    float *ye = malloc((size_t)n_tok * n_out * sizeof *ye);
    float *yf = malloc((size_t)n_tok * n_out * sizeof *yf);
    struct moe_matmul_params p = {.x = x,
                                  .n_tok = n_tok,
                                  .n_in = n_in,
                                  .w = w,
                                  .w_dtype = dt,
                                  .ldw = n_in,
                                  .n_out = n_out,
                                  .y = ye,
                                  .w_scale = sc};
    cpu_matmul(NULL, &p);
    unsigned before = cpu_kernels_features();
    cpu_kernels_force_features((before & ~off) | on);
    p.fast = true;
    p.y = yf;
    CHECK(!cpu_matmul_dot_supported(&p));
    CHECK(strcmp(cpu_matmul_fast_path(dt), "f32-fma") == 0);
    cpu_matmul(NULL, &p);
    CHECKF(memcmp(ye, yf, (size_t)n_tok * n_out * sizeof *ye) == 0, "%s: fast differs from exact",
           name);
    CHECK(cpu_kernels_force_features(before) == before);
    free(w);
    free(x);
    free(ye);
    free(yf);
}

/* Where vdpbf16ps is slow (CPU_FEAT_DPBF16_SLOW in `feats`, no AMX), fast
 * bf16 calls of CPU_SLOW_DP_FMA_MIN_TOK+ tokens are the exact kernels bit for
 * bit, smaller ones
 * the vdpbf16ps path bit for bit (the same call with the bit cleared), and a
 * grouped call with experts on both sides equals each expert alone. */
static void test_slow_dpbf16(unsigned feats)
{
    const unsigned dot_feats = feats & ~CPU_FEAT_DPBF16_SLOW;
    cpu_kernels_force_features(feats);
    CHECK(strcmp(cpu_matmul_fast_path(MOE_DTYPE_BF16), "avx512-bf16/f32-fma") == 0);
    const int T = CPU_SLOW_DP_FMA_MIN_TOK;
    const int n_in = 96, n_out = 20, toks[] = {1, T - 1, T, 31, 32, 40};
    const float *sc;
    void *w = make_weights(MOE_DTYPE_BF16, n_out, n_in, &sc);
    float *x = malloc((size_t)40 * n_in * sizeof *x);
    float *ya = malloc((size_t)40 * n_out * sizeof *ya),
          *yb = malloc((size_t)40 * n_out * sizeof *yb);
    for (size_t i = 0; i < (size_t)40 * n_in; i++)
        x[i] = test_rng_float(&g_rng);
    for (size_t i = 0; i < sizeof toks / sizeof *toks; i++) {
        struct moe_matmul_params p = {.x = x,
                                      .n_tok = toks[i],
                                      .n_in = n_in,
                                      .w = w,
                                      .w_dtype = MOE_DTYPE_BF16,
                                      .ldw = n_in,
                                      .n_out = n_out,
                                      .y = ya,
                                      .fast = true};
        const bool dot = toks[i] < T;
        CHECKF(cpu_matmul_dot_supported(&p) == dot, "%d tokens: dot path %d", toks[i], !dot);
        cpu_matmul(g_pool, &p);
        p.y = yb;
        if (dot)
            cpu_kernels_force_features(dot_feats); /* vdpbf16ps at every size */
        else
            p.fast = false; /* the exact kernels */
        cpu_matmul(g_pool, &p);
        cpu_kernels_force_features(feats);
        CHECKF(memcmp(ya, yb, (size_t)toks[i] * n_out * sizeof *ya) == 0,
               "slow vdpbf16ps, %d tokens: fast differs from the %s path", toks[i],
               dot ? "vdpbf16ps" : "exact");
    }
    free(w);
    free(x);
    free(ya);
    free(yb);
    test_grouped_equals_each(MOE_DTYPE_BF16, "avx512-bf16/f32-fma");
    printf("avx512-bf16 where vdpbf16ps is slow: below %d tokens vdpbf16ps, from %d the exact "
           "kernels, bit for bit\n",
           T, T);
    cpu_kernels_force_features(dot_feats);
}

/* v rounded to fp16 (nearest even; 11 significant bits, subnormals in steps
 * of 2^-24, beyond 65504 infinite). */
static double fp16_round(double v)
{
    if (v == 0.0 || !isfinite(v))
        return v;
    int e;
    (void)frexp(v, &e); /* v = f 2^e, f in [0.5, 1) */
    const int q = e - 11 < -24 ? -24 : e - 11;
    const double r = ldexp(nearbyint(ldexp(v, -q)), q);
    return fabs(r) > 65504.0 ? copysign(INFINITY, v) : r;
}

/* A bf16 weight as the fp16 streaming tiles and panels take it
 * (simd_x86.h, fp16_from_bf16_scaled), times 2^CPU_PH_STREAM_W_SHIFT: the
 * exponent re-biased in 16-bit integer lanes (saturating at zero, shifted,
 * the sign put back). */
static double stream_w_emu(uint16_t b)
{
    const unsigned mag = b & 0x7fffu, bias = (127u - 15u - CPU_PH_STREAM_W_SHIFT) << 7;
    const unsigned h = ((mag > bias ? mag - bias : 0u) << 3) & 0xffffu;
    const unsigned ex = h >> 10, mt = h & 0x3ffu;
    const double v = ex == 0 ? ldexp(mt, -24) : ldexp(1024.0 + mt, (int)ex - 25);
    return (b & 0x8000u) ? -v : v;
}

/* One fp16-panel call against (a) its arithmetic emulated here, bit for bit:
 * x scaled by 2^-e (e from max |x|) and rounded to fp16, the weights as
 * stream_w_emu takes them (tiny ones planted: flushed below
 * 2^-(14 + shift)), two lanes a row (its even and its odd columns), each
 * summing CPU_PH_SEG products by fp16 FMAs (product exact, one rounding:
 * done in double, where it is exact) before adding them in f32, the two
 * lanes added in f32, times 2^(e - shift); (b) the exact product in double,
 * within the bound
 *   (2^-11 + g + (n_in / (2 CPU_PH_SEG) + 4) 2^-24) sum|x w| + 2^-25 2^e (sum|w| + n_in) +
 *   2^-25 sum|x| + flushed,  g = CPU_PH_SEG 2^-11 / (1 - CPU_PH_SEG 2^-11)
 * (x's rounding, the fp16 sums', the f32 adds', subnormal steps, the
 * flushed weights' |x| 2^-(14 + shift) each). Adds the squared errors of the
 * path and of bf16-rounded activations (what the dot-product paths compute)
 * to err2 and err2_bf16; returns the worst error / bound. */
static double ph_case(const struct fcase *c, uint16_t *w, double *err2, double *err2_bf16)
{
    for (size_t k = 0; k < (size_t)c->n_out * c->ldw; k += 61) /* 2^-17 .. 2^-22 */
        w[k] = moe_f32_to_bf16((k % 2 ? -1.0f : 1.0f) *
                               ldexpf(1.0f + (float)(k % 7) / 8.0f, -17 - (int)(k % 6)));
    float *x = malloc((size_t)c->n_tok * c->n_in * sizeof *x);
    for (size_t i = 0; i < (size_t)c->n_tok * c->n_in; i++)
        x[i] = test_rng_float(&g_rng) * (i % 97 == 0 ? 8.0f : 1.0f);
    const size_t ny = (size_t)c->n_tok * c->n_out;
    float *y = malloc(ny * sizeof *y), *y0 = malloc(ny * sizeof *y0);
    for (size_t i = 0; i < ny; i++)
        y0[i] = y[i] = test_rng_float(&g_rng);
    struct moe_matmul_params p = {.x = x,
                                  .n_tok = c->n_tok,
                                  .n_in = c->n_in,
                                  .w = w,
                                  .w_dtype = MOE_DTYPE_BF16,
                                  .ldw = c->ldw,
                                  .n_out = c->n_out,
                                  .y = y,
                                  .accumulate = c->accumulate,
                                  .fast = true};
    CHECK(!cpu_matmul_dot_supported(&p));
    if (c->via == 0)
        g_cpu->ops->matmul(g_cpu, &p);
    else
        cpu_matmul(c->via == 1 ? g_pool : NULL, &p);
    const double u = ldexp(1.0, -11), g = CPU_PH_SEG * u / (1 - CPU_PH_SEG * u);
    const double tiny = ldexp(1.0, -14 - CPU_PH_STREAM_W_SHIFT);
    const int n_pairs = (c->n_in + 1) / 2;
    double worst = 0;
    int mismatches = 0;
    for (int t = 0; t < c->n_tok; t++) {
        const float *xt = x + (size_t)t * c->n_in;
        float m = 0.0f;
        for (int k = 0; k < c->n_in; k++)
            m = fmaxf(m, fabsf(xt[k]));
        int e = 0;
        if (m > 0.0f)
            (void)frexpf(m, &e);
        for (int o = 0; o < c->n_out; o++) {
            const uint16_t *wr = w + (size_t)o * c->ldw;
            double ref = 0, mag = 0, wsum = 0, xsum = 0, ref_bf16 = 0, flushed = 0;
            float lane[2] = {0.0f, 0.0f};
            for (int j0 = 0; j0 < n_pairs; j0 += CPU_PH_SEG) {
                for (int par = 0; par < 2; par++) {
                    double acc = 0;
                    for (int j = j0; j < n_pairs && j < j0 + CPU_PH_SEG; j++) {
                        const int k = 2 * j + par;
                        if (k >= c->n_in)
                            continue;
                        const double wv = moe_bf16_to_f32(wr[k]);
                        acc = fp16_round(fp16_round(ldexpf(xt[k], -e)) * stream_w_emu(wr[k]) + acc);
                        ref += (double)xt[k] * wv;
                        ref_bf16 += (double)moe_bf16_to_f32(moe_f32_to_bf16(xt[k])) * wv;
                        mag += fabs((double)xt[k] * wv);
                        wsum += fabs(wv);
                        xsum += fabs((double)xt[k]);
                        if (fabs(wv) < tiny)
                            flushed += fabs((double)xt[k]) * tiny;
                    }
                    lane[par] += (float)acc;
                }
            }
            const size_t i = (size_t)t * c->n_out + o;
            const float v = (lane[0] + lane[1]) * ldexpf(1.0f, e - CPU_PH_STREAM_W_SHIFT);
            const float want = c->accumulate ? y0[i] + v : v;
            if (memcmp(&want, &y[i], sizeof want) != 0 && mismatches++ < 3)
                printf("  fp16 panels %dx%dx%d: y[%d][%d] = %.9g, emulated %.9g\n", c->n_tok,
                       c->n_in, c->n_out, t, o, (double)y[i], (double)want);
            const double got = (double)y[i] - (c->accumulate ? y0[i] : 0.0);
            const double bound =
                (u + g + (c->n_in / (2 * CPU_PH_SEG) + 4) * ldexp(1.0, -24)) * mag +
                ldexp(1.0, e - 25) * (wsum + c->n_in) + ldexp(xsum, -25) + flushed +
                1e-6 * fabs((double)y0[i]) * c->accumulate;
            const double eb = fabs(got - ref) / (bound + 1e-30);
            if (!(eb <= worst))
                worst = isnan(eb) ? INFINITY : eb;
            *err2 += (got - ref) * (got - ref);
            *err2_bf16 += (ref_bf16 - ref) * (ref_bf16 - ref);
        }
    }
    CHECKF(mismatches == 0, "fp16 panels %dx%dx%d: %d outputs differ from the emulation", c->n_tok,
           c->n_in, c->n_out, mismatches);
    free(x);
    free(y);
    free(y0);
    return worst;
}

/* The fp16 panels (matmul.c): where the processor has AVX512-FP16 and
 * vdpbf16ps is slow (no AMX), bf16 fast calls of CPU_PH_MIN_TOK+ tokens
 * equal their emulation bit for bit and stay within the documented bound of
 * the exact product; one token fewer is the exact kernels bit for bit; a
 * panel holding a weight of CPU_PH_PANEL_MAX_W or more takes the f32 panels
 * (its rows equal the exact call's, the other panels' do not), one just
 * below it stays on the fp16 panels; a grouped call
 * equals each expert alone. The error against the exact product is printed
 * next to that of rounding the activations to bf16 (the dot-product paths'). */
static void test_fp16_panels(unsigned feats)
{
    cpu_kernels_force_features(feats);
    CHECK(cpu_matmul_fp16_panels());
    CHECK(strcmp(cpu_matmul_fast_path(MOE_DTYPE_BF16), "avx512-bf16/fp16-fma") == 0);
    static const struct fcase fixed[] = {
        {CPU_PH_MIN_TOK, 64, 64, 64, false, 0},
        {40, 96, 20, 96, true, 1},
        {100, 1024, 96, 1024, false, 2},
        {33, 129, 47, 130, true, 1},
        {300, 200, 70, 256, true, 2},  /* several token blocks */
        {257, 65, 31, 65, false, 1},   /* tasks of 129 and 128 tokens: tiles of 12 and 11 */
        {40, 2816, 20, 2816, true, 1}, /* 22 fp16 segments a lane */
        {64, 1000, 130, 1000, false, 0},
        {45, 31, 200, 33, true, 0},
    };
    double worst = 0, err2 = 0, err2_bf16 = 0;
    int n = 0;
    for (int i = 0; i < (int)(sizeof fixed / sizeof *fixed) + 12; i++, n++) {
        struct fcase c;
        if (i < (int)(sizeof fixed / sizeof *fixed)) {
            c = fixed[i];
        } else {
            c = (struct fcase){.n_tok = CPU_PH_MIN_TOK + (int)(test_rng_u32(&g_rng) % 120),
                               .n_in = 1 + (int)(test_rng_u32(&g_rng) % 300),
                               .n_out = 1 + (int)(test_rng_u32(&g_rng) % 150),
                               .accumulate = test_rng_u32(&g_rng) % 2,
                               .via = (int)(test_rng_u32(&g_rng) % 3)};
            c.ldw = c.n_in + (int)(test_rng_u32(&g_rng) % 5);
        }
        const float *sc;
        uint16_t *w = make_weights(MOE_DTYPE_BF16, c.n_out, c.ldw, &sc);
        worst = fmax(worst, ph_case(&c, w, &err2, &err2_bf16));
        free(w);
    }
    CHECKF(worst <= 1.0, "fp16 panels: error %.3g x the documented bound", worst);

    /* the threshold: one token below it the dot-product paths (the fp16
     * streaming tiles, test_fp16_stream); a panel (32 rows, matmul.c's
     * PH_R) with a weight of CPU_PH_PANEL_MAX_W: the f32 panels for its rows;
     * one with a weight just below it (row 100): the fp16 panels */
    const int n_in = 96, n_out = 130, n_tok = 100, big_row = 70, panel_rows = 32;
    const float *sc;
    uint16_t *w = make_weights(MOE_DTYPE_BF16, n_out, n_in, &sc);
    w[(size_t)big_row * n_in + 5] = moe_f32_to_bf16(CPU_PH_PANEL_MAX_W);
    w[(size_t)100 * n_in + 7] = moe_f32_to_bf16(-CPU_PH_PANEL_MAX_W + 0.125f);
    float *x = malloc((size_t)n_tok * n_in * sizeof *x);
    float *ya = malloc((size_t)n_tok * n_out * sizeof *ya),
          *yb = malloc((size_t)n_tok * n_out * sizeof *yb);
    for (size_t i = 0; i < (size_t)n_tok * n_in; i++)
        x[i] = test_rng_float(&g_rng);
    struct moe_matmul_params p = {.x = x,
                                  .n_tok = CPU_PH_MIN_TOK - 1,
                                  .n_in = n_in,
                                  .w = w,
                                  .w_dtype = MOE_DTYPE_BF16,
                                  .ldw = n_in,
                                  .n_out = n_out,
                                  .y = ya,
                                  .fast = true};
    CHECKF(cpu_matmul_dot_supported(&p), "fp16 panels: %d tokens not on the dot-product paths",
           p.n_tok);
    p.n_tok = CPU_PH_MIN_TOK;
    CHECKF(!cpu_matmul_dot_supported(&p), "fp16 panels: %d tokens on the dot-product paths",
           p.n_tok);
    p.fast = false;
    p.y = yb;
    p.n_tok = n_tok;
    cpu_matmul(g_pool, &p); /* exact, packed f32 panels */
    p.fast = true;
    p.y = ya;
    cpu_matmul(g_pool, &p);
    int same_big = 0, same_other = 0;
    for (int t = 0; t < n_tok; t++)
        for (int o = 0; o < n_out; o++) {
            const size_t i = (size_t)t * n_out + o;
            const bool same = memcmp(&ya[i], &yb[i], sizeof *ya) == 0;
            if (o / panel_rows == big_row / panel_rows)
                same_big += same;
            else
                same_other += same;
        }
    CHECKF(same_big == n_tok * panel_rows,
           "fp16 panels: a panel with |w| = %g: %d of %d outputs as exact",
           (double)CPU_PH_PANEL_MAX_W, same_big, n_tok * panel_rows);
    CHECKF(same_other < n_tok * (n_out - panel_rows) / 2,
           "fp16 panels: panels without a large weight gave the exact bits (%d of %d)", same_other,
           n_tok * (n_out - panel_rows));
    free(w);
    free(x);
    free(ya);
    free(yb);
    test_grouped_equals_each(MOE_DTYPE_BF16, "avx512-bf16/fp16-fma");
    printf("fp16 panels: %d cases equal their emulation bit for bit, worst error %.3g of the "
           "documented bound; rms error %.3g x that of bf16-rounded activations; from %d tokens, "
           "a panel with |w| >= %g the f32 panels\n",
           n, worst, sqrt(err2 / (err2_bf16 + 1e-300)), CPU_PH_MIN_TOK, (double)CPU_PH_PANEL_MAX_W);
}

/* The fp16 streaming tiles (matmul_dot.c): where the fp16 panels exist,
 * fast bf16 calls of CPU_PH_STREAM_MIN_TOK .. CPU_PH_MIN_TOK - 1 tokens.
 * Each output is held to its arithmetic emulated here: x scaled by 2^-e and
 * rounded to fp16, the weights as stream_w_emu takes them (tiny ones
 * planted: flushed below 2^-(14 + shift)), each of the 32 lanes (the
 * columns k = j mod 32) summed by fp16 FMAs (exact in double, then one
 * rounding) over 32 of its columns at a time, those lane sums (exact fp16
 * values) added in f32 in an order of the kernel's own: to 1e-5 of
 * 2^e sum|x' w'|. Also to the exact product within the panels' bound
 * (plus the flushed weights' share), its rms error reported against
 * bf16-rounded activations'; a row holding a weight past fp16's range
 * (2^17), or at the guard (CPU_PH_MAX_W / 2^shift), comes out within the
 * vdpbf16ps bound (it is redone there), one just below the guard matches
 * its emulation; the tiles (1 x 16, 2 x 8, 2 x 5..7, 4 x 1..4, single
 * leftover rows) all run; a grouped call equals each expert alone. */
static void test_fp16_stream(unsigned feats)
{
    cpu_kernels_force_features(feats);
    static const struct fcase fixed[] = {
        {CPU_SLOW_DP_FMA_MIN_TOK, 64, 40, 64, false, 0},
        {16, 1024, 96, 1024, false, 1},
        {16, 2816, 33, 2816, true, 2}, /* three f32 flushes a lane */
        {CPU_PH_MIN_TOK - 1, 129, 47, 130, true, 1},
        {23, 31, 200, 33, false, 0}, /* tiles of 16, 4, 1 x 3 */
        {12, 1000, 20, 1000, true, 2},
        {12, 2816, 41, 2816, false, 1}, /* 2 x 8 + 4 x 4 tiles, a leftover row */
        {16, 1500, 18, 1504, true, 2},  /* 16 tokens on two rows of 8 (n_in > 1024) */
        {13, 200, 30, 200, false, 0},   /* 2 x 8 + 2 x 5 */
        {15, 64, 9, 64, true, 1},       /* 2 x 8 + 2 x 7 */
        {9, 100, 7, 100, false, 2},     /* 2 x 8 + 4 x 1 */
        {CPU_PH_STREAM_MIN_TOK, 1024, 37, 1024, true, 1}, /* 4 x 2 tiles, a leftover row */
        {3, 2816, 12, 2816, false, 2},                    /* 4 x 3 */
        {5, 300, 9, 301, true, 0},                        /* 2 x 5, a leftover row */
        {7, 1500, 8, 1500, false, 1},                     /* 2 x 7 */
    };
    const float guard_w = CPU_PH_MAX_W / (float)(1 << CPU_PH_STREAM_W_SHIFT);
    const int n_fixed = (int)(sizeof fixed / sizeof *fixed);
    const double u = ldexp(1.0, -11), g = 32 * u / (1 - 32 * u);
    double worst_emu = 0, worst_bound = 0, err2 = 0, err2_bf16 = 0;
    int n = 0, n_redone = 0;
    for (int i = 0; i < n_fixed + 10; i++, n++) {
        struct fcase c;
        if (i < n_fixed) {
            c = fixed[i];
        } else {
            c = (struct fcase){
                .n_tok = CPU_PH_STREAM_MIN_TOK +
                         (int)(test_rng_u32(&g_rng) % (CPU_PH_MIN_TOK - CPU_PH_STREAM_MIN_TOK)),
                .n_in = 1 + (int)(test_rng_u32(&g_rng) % 400),
                .n_out = 1 + (int)(test_rng_u32(&g_rng) % 70),
                .accumulate = test_rng_u32(&g_rng) % 2,
                .via = (int)(test_rng_u32(&g_rng) % 3)};
            c.ldw = c.n_in + (int)(test_rng_u32(&g_rng) % 5);
        }
        const float *sc;
        uint16_t *w = make_weights(MOE_DTYPE_BF16, c.n_out, c.ldw, &sc);
        const int big_row = i == 1 ? 7 : -1;
        if (big_row >= 0)
            w[(size_t)big_row * c.ldw + 3] = moe_f32_to_bf16(131072.0f);
        if (i == 6) { /* at the guard (redone) and just below it (fp16) */
            w[(size_t)5 * c.ldw + 100] = moe_f32_to_bf16(-guard_w);
            w[(size_t)9 * c.ldw + 2000] = moe_f32_to_bf16(guard_w - 0.5f);
        }
        for (size_t k = 0; k < (size_t)c.n_out * c.ldw; k += 53) /* 2^-17 .. 2^-22 */
            w[k] = moe_f32_to_bf16((k % 2 ? -1.0f : 1.0f) *
                                   ldexpf(1.0f + (float)(k % 7) / 8.0f, -17 - (int)(k % 6)));
        float *x = malloc((size_t)c.n_tok * c.n_in * sizeof *x);
        for (size_t k = 0; k < (size_t)c.n_tok * c.n_in; k++)
            x[k] = test_rng_float(&g_rng) * (k % 89 == 0 ? 8.0f : 1.0f);
        const size_t ny = (size_t)c.n_tok * c.n_out;
        float *y = malloc(ny * sizeof *y), *y0 = malloc(ny * sizeof *y0);
        for (size_t k = 0; k < ny; k++)
            y0[k] = y[k] = test_rng_float(&g_rng);
        struct moe_matmul_params p = {.x = x,
                                      .n_tok = c.n_tok,
                                      .n_in = c.n_in,
                                      .w = w,
                                      .w_dtype = MOE_DTYPE_BF16,
                                      .ldw = c.ldw,
                                      .n_out = c.n_out,
                                      .y = y,
                                      .accumulate = c.accumulate,
                                      .fast = true};
        CHECK(cpu_matmul_dot_supported(&p));
        if (c.via == 0)
            g_cpu->ops->matmul(g_cpu, &p);
        else
            cpu_matmul(c.via == 1 ? g_pool : NULL, &p);
        for (int t = 0; t < c.n_tok; t++) {
            const float *xt = x + (size_t)t * c.n_in;
            float m = 0.0f;
            for (int k = 0; k < c.n_in; k++)
                m = fmaxf(m, fabsf(xt[k]));
            int e = 0;
            if (m > 0.0f)
                (void)frexpf(m, &e);
            for (int o = 0; o < c.n_out; o++) {
                const uint16_t *wr = w + (size_t)o * c.ldw;
                double ref = 0, mag = 0, wsum = 0, xsum = 0, ref_bf16 = 0, emu = 0, emu_mag = 0;
                double flushed = 0, wmax = 0;
                double lane[32] = {0};
                const int n_vec = (c.n_in + 31) / 32;
                for (int v = 0; v < n_vec; v++) {
                    for (int j = 0; j < 32; j++) {
                        const int k = 32 * v + j;
                        if (k >= c.n_in)
                            continue;
                        const double wv = moe_bf16_to_f32(wr[k]);
                        const double xh = fp16_round(ldexpf(xt[k], -e)), wh = stream_w_emu(wr[k]);
                        if (fabs(wv) < ldexp(1.0, -14 - CPU_PH_STREAM_W_SHIFT))
                            flushed += ldexp(fabs((double)xt[k]), -14 - CPU_PH_STREAM_W_SHIFT);
                        wmax = fmax(wmax, fabs(wv));
                        lane[j] = fp16_round(xh * wh + lane[j]);
                        emu_mag += fabs(xh * wh);
                        ref += (double)xt[k] * wv;
                        ref_bf16 += (double)moe_bf16_to_f32(moe_f32_to_bf16(xt[k])) * wv;
                        mag += fabs((double)xt[k] * wv);
                        wsum += fabs(wv);
                        xsum += fabs((double)xt[k]);
                    }
                    if ((v + 1) % 32 == 0 || v + 1 == n_vec)
                        for (int j = 0; j < 32; j++) {
                            emu += lane[j];
                            lane[j] = 0;
                        }
                }
                emu = ldexp(emu, e - CPU_PH_STREAM_W_SHIFT);
                const size_t yi = (size_t)t * c.n_out + o;
                const double base = c.accumulate ? y0[yi] : 0.0;
                const double got = (double)y[yi] - base;
                const double slack = 1e-6 * fabs(base);
                if (wmax >= guard_w) { /* redone on vdpbf16ps */
                    n_redone += t == 0;
                    const double bound = ldexp(mag, -8) + (c.n_in + 2) * ldexp(mag, -24);
                    const double eb = fabs(got - ref) / (bound + slack + 1e-30);
                    CHECKF(eb <= 1.0,
                           "fp16 streaming: a row with |w| = %g is %.3g x the "
                           "vdpbf16ps bound from exact (t %d)",
                           wmax, eb, t);
                    continue;
                }
                const double ee =
                    fabs(got - emu) /
                    (1e-5 * ldexp(emu_mag, e - CPU_PH_STREAM_W_SHIFT) + slack + 1e-30);
                if (!(ee <= worst_emu))
                    worst_emu = isnan(ee) ? INFINITY : ee;
                const double bound = (u + g + (c.n_in / 32 + 3) * ldexp(1.0, -24)) * mag +
                                     ldexp(1.0, e - 25) * (wsum + c.n_in) + ldexp(xsum, -25) +
                                     flushed + slack;
                const double eb = fabs(got - ref) / (bound + 1e-30);
                if (!(eb <= worst_bound))
                    worst_bound = isnan(eb) ? INFINITY : eb;
                err2 += (got - ref) * (got - ref);
                err2_bf16 += (ref_bf16 - ref) * (ref_bf16 - ref);
            }
        }
        free(w);
        free(x);
        free(y);
        free(y0);
    }
    CHECKF(worst_emu <= 1.0, "fp16 streaming: %.3g x 1e-5 of sum|x' w'| from its emulation",
           worst_emu);
    CHECKF(worst_bound <= 1.0, "fp16 streaming: error %.3g x the documented bound", worst_bound);
    CHECKF(n_redone == 2, "fp16 streaming: %d rows at or past the guard, expected 2", n_redone);
    /* The lower edge: one token stays on vdpbf16ps (bit for bit the call
     * without AVX512-FP16), CPU_PH_STREAM_MIN_TOK tokens do not. */
    {
        const int n_in = 512, n_out = 24, T = CPU_PH_STREAM_MIN_TOK;
        const float *sc;
        void *w = make_weights(MOE_DTYPE_BF16, n_out, n_in, &sc);
        float *x = malloc((size_t)T * n_in * sizeof *x);
        float *ya = malloc((size_t)T * n_out * sizeof *ya),
              *yb = malloc((size_t)T * n_out * sizeof *yb);
        for (size_t k = 0; k < (size_t)T * n_in; k++)
            x[k] = test_rng_float(&g_rng);
        for (int nt = 1; nt <= T; nt += T - 1) {
            struct moe_matmul_params p = {.x = x,
                                          .n_tok = nt,
                                          .n_in = n_in,
                                          .w = w,
                                          .w_dtype = MOE_DTYPE_BF16,
                                          .ldw = n_in,
                                          .n_out = n_out,
                                          .y = ya,
                                          .fast = true};
            cpu_matmul(g_pool, &p);
            cpu_kernels_force_features(feats & ~CPU_FEAT_AVX512_FP16);
            p.y = yb;
            cpu_matmul(g_pool, &p);
            cpu_kernels_force_features(feats);
            const bool same = memcmp(ya, yb, (size_t)nt * n_out * sizeof *ya) == 0;
            CHECKF(same == (nt == 1), "fp16 streaming, %d tokens: %s the vdpbf16ps call", nt,
                   same ? "equals" : "differs from");
        }
        free(w);
        free(x);
        free(ya);
        free(yb);
    }
    test_grouped_equals_each(MOE_DTYPE_BF16, "avx512-bf16/fp16-fma streaming");
    printf("fp16 streaming (%d..%d tokens): %d cases within %.3g of 1e-5 sum|x'w'| of their "
           "emulation, worst error %.3g of the documented bound; rms error %.3g x that of "
           "bf16-rounded activations; rows with |w| = 2^17 and %g redone on vdpbf16ps\n",
           CPU_PH_STREAM_MIN_TOK, CPU_PH_MIN_TOK - 1, n, worst_emu, worst_bound,
           sqrt(err2 / (err2_bf16 + 1e-300)), (double)guard_w);
}

int main(void)
{
    struct moe_error err = {0};
    if (moe_backend_cpu_create(2, &g_cpu, &err) != MOE_OK ||
        moe_threadpool_create(3, &g_pool, &err) != MOE_OK) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return 1;
    }
    char names[128];
    unsigned have = cpu_kernels_detect_features();
    enum cpu_isa isa = cpu_kernels_detect_isa();
    printf("cpu: isa %s, dot-product features %s\n", cpu_isa_name(isa),
           cpu_features_name(have, names, sizeof names));
    int ran = 0;
    cpu_kernels_force_isa(isa);
    const unsigned amx = CPU_FEAT_AMX_BF16 | CPU_FEAT_AMX_INT8;
    if (isa == CPU_ISA_AVX512 && (have & CPU_FEAT_AMX_BF16) && (have & CPU_FEAT_AVX512_BF16)) {
        cpu_kernels_force_features(have);
        CHECK(strcmp(cpu_matmul_fast_path(MOE_DTYPE_BF16), "amx-bf16") == 0);
        test_path(MOE_DTYPE_BF16, "amx-bf16");
        test_special_rows(MOE_DTYPE_BF16, "amx-bf16");
        test_grouped_equals_each(MOE_DTYPE_BF16, "amx-bf16");
        ran++;
    } else {
        printf("SKIPPED: amx-bf16: this processor (or its OS) lacks AMX-BF16\n");
    }
    if (isa == CPU_ISA_AVX512 && (have & CPU_FEAT_AMX_INT8) && (have & CPU_FEAT_AVX512_VNNI)) {
        cpu_kernels_force_features(have);
        test_path(MOE_DTYPE_I8, "amx-int8");
        test_i8_batch_invariance("amx-int8");
        test_special_rows(MOE_DTYPE_I8, "amx-int8");
        test_grouped_equals_each(MOE_DTYPE_I8, "amx-int8");
        test_amx_i8_equals_vnni(have);
        ran++;
    } else {
        printf("SKIPPED: amx-int8: this processor (or its OS) lacks AMX-INT8\n");
    }
    /* The AVX-512 paths, AMX forced off (where there is any), vdpbf16ps used
     * even where it is slower than f32 FMAs (CPU_FEAT_DPBF16_SLOW: then the
     * bf16 fast path is the exact kernels, checked after). */
    cpu_kernels_force_features(have & ~(amx | CPU_FEAT_DPBF16_SLOW));
    if (isa == CPU_ISA_AVX512 && (have & CPU_FEAT_AVX512_BF16)) {
        CHECK(strcmp(cpu_matmul_fast_path(MOE_DTYPE_BF16), "avx512-bf16") == 0);
        test_path(MOE_DTYPE_BF16, "avx512-bf16");
        test_special_rows(MOE_DTYPE_BF16, "avx512-bf16");
        test_grouped_equals_each(MOE_DTYPE_BF16, "avx512-bf16");
        test_forced_off(MOE_DTYPE_BF16, CPU_FEAT_AVX512_BF16, 0, "avx512-bf16 forced off");
        if (have & CPU_FEAT_DPBF16_SLOW) {
            test_slow_dpbf16(have & ~(amx | CPU_FEAT_AVX512_FP16));
            cpu_kernels_force_features(have & ~amx);
            if (cpu_matmul_fp16_panels()) {
                test_fp16_panels(have & ~amx);
                test_fp16_stream(have & ~amx);
            } else
                printf("SKIPPED: fp16 panels: this processor lacks AVX512-FP16 (or the build "
                       "is not gcc)\n");
            cpu_kernels_force_features(have & ~(amx | CPU_FEAT_DPBF16_SLOW));
        } else
            printf("SKIPPED: bf16 fast path by f32 FMA: vdpbf16ps is not slow here (not Intel)\n");
        ran++;
    } else {
        printf("SKIPPED: avx512-bf16: this processor lacks AVX512-BF16\n");
    }
    if (isa == CPU_ISA_AVX512 && (have & CPU_FEAT_AVX512_VNNI)) {
        test_path(MOE_DTYPE_I8, "avx512-vnni");
        test_i8_batch_invariance("avx512-vnni");
        test_special_rows(MOE_DTYPE_I8, "avx512-vnni");
        test_grouped_equals_each(MOE_DTYPE_I8, "avx512-vnni");
        test_forced_off(MOE_DTYPE_I8, CPU_FEAT_AVX512_VNNI, 0, "avx512-vnni forced off");
        test_w8a8_avx2_equals_vnni();
        ran++;
    } else {
        printf("SKIPPED: avx512-vnni: this processor lacks AVX512-VNNI\n");
    }
    cpu_kernels_force_features(have);
    /* int8 on AVX2 (forced on AVX-512 machines): W8A8 at every size */
    if (isa >= CPU_ISA_AVX2) {
        cpu_kernels_force_isa(CPU_ISA_AVX2);
        CHECK(strcmp(cpu_matmul_fast_path(MOE_DTYPE_I8), "avx2-w8a8") == 0);
        g_w8a8_avx2 = true;
        test_path(MOE_DTYPE_I8, "avx2-w8a8");
        test_i8_batch_invariance("avx2-w8a8");
        test_special_rows(MOE_DTYPE_I8, "avx2-w8a8");
        test_grouped_equals_each(MOE_DTYPE_I8, "avx2-w8a8");
        g_w8a8_avx2 = false;
        cpu_kernels_force_isa(isa);
        ran++;
    } else {
        printf("SKIPPED: avx2-w8a8: this processor lacks AVX2\n");
    }
    /* Off AVX-512 (forced), fast asks for nothing the kernels cannot do. */
    if (isa == CPU_ISA_AVX512) {
        cpu_kernels_force_isa(CPU_ISA_AVX2);
        struct moe_matmul_params p = {.fast = true, .w_dtype = MOE_DTYPE_BF16, .n_in = 8};
        CHECK(!cpu_matmul_dot_supported(&p));
        cpu_kernels_force_isa(isa);
    }
    moe_threadpool_destroy(g_pool);
    moe_backend_destroy(g_cpu);
    if (!ran) {
        printf("SKIPPED: no fast matmul path on this processor\n");
        test_summary();
        return TEST_SKIP_CODE;
    }
    return test_summary();
}
