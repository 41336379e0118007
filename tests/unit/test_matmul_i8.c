/* int8 weights (MOE_DTYPE_I8, per-output-row scales): the quantizer's
 * round-trip properties, and the int8 matmul on every SIMD path this
 * processor has against cpu_matmul_ref run on the dequantized f32 weights.
 *
 * The two must agree up to summation order: the kernels widen int8 exactly
 * and apply the row scale once per output (or dequantize rows they reuse),
 * so the error of each output is held to 1e-5 of sum_k |x_k w_k| (what f32
 * summation in another order can differ by), far below the quantization
 * error itself (~1e-2). Shapes cover odd n_in / n_out, a row stride wider
 * than n_in, and 1, 3, 16, 70 and 130 tokens: the GEMV tiles, the widened-row
 * tiles and the AVX-512 packed prefill path with its leftover tokens. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/cpu_kernels.h"
#include "quant.h"
#include "testlib.h"

#define SUM_ORDER_TOL 1e-5

static struct test_rng g_rng = {0x243f6a8885a308d3ull};

static struct moe_backend *g_cpu;     /* 2 threads, through the ops table */
static struct moe_threadpool *g_pool; /* 3 threads, direct kernel calls */

/* ---- quantization ---- */

/* Rows of very different magnitudes, an all-zero row, a single spike. */
static void fill_rows(float *w, int n_rows, int n_cols)
{
    for (int r = 0; r < n_rows; r++) {
        float mag = powf(10.0f, (float)(r % 7) - 4.0f); /* 1e-4 .. 1e2 */
        for (int k = 0; k < n_cols; k++)
            w[(size_t)r * n_cols + k] = r % 5 == 3 ? 0.0f : mag * test_rng_float(&g_rng);
        if (r % 6 == 1)
            w[(size_t)r * n_cols + (r % n_cols)] = -50.0f * mag; /* an outlier sets the scale */
    }
}

static void test_quant_roundtrip(void)
{
    const int n_rows = 40, n_cols = 77;
    float *w = malloc((size_t)n_rows * n_cols * sizeof *w);
    float *d = malloc((size_t)n_rows * n_cols * sizeof *d);
    int8_t *q = malloc((size_t)n_rows * n_cols);
    float sc[40];
    fill_rows(w, n_rows, n_cols);
    CHECK(moe_quant_i8_rows(w, n_rows, n_cols, q, sc));
    moe_dequant_i8_rows(q, sc, n_rows, n_cols, d);
    double worst = 0; /* max |w - deq| / (scale / 2) */
    for (int r = 0; r < n_rows; r++) {
        float amax = 0;
        int qmax = 0;
        for (int k = 0; k < n_cols; k++) {
            size_t i = (size_t)r * n_cols + k;
            amax = fmaxf(amax, fabsf(w[i]));
            qmax = abs(q[i]) > qmax ? abs(q[i]) : qmax;
            CHECKF(q[i] >= -127 && q[i] <= 127, "row %d col %d: q %d", r, k, q[i]);
            if (sc[r] > 0) {
                double e = fabs((double)w[i] - d[i]) / (0.5 * sc[r]);
                worst = e > worst ? e : worst;
            }
        }
        if (amax == 0.0f) { /* an all-zero row: scale 0, all q 0 */
            CHECKF(sc[r] == 0.0f && qmax == 0, "zero row %d: scale %g, max |q| %d", r, sc[r], qmax);
        } else {
            CHECKF(fabsf(sc[r] - amax / 127.0f) <= 1e-6f * sc[r], "row %d: scale %g, amax/127 %g",
                   r, sc[r], amax / 127.0f);
            CHECKF(qmax == 127, "row %d: the largest |w| maps to |q| %d, not 127", r, qmax);
        }
    }
    /* |w - q s| <= s/2, up to the rounding of w / s and of q * s */
    CHECKF(worst <= 1.0 + 1e-4, "max |w - deq| is %.6f x scale/2", worst);
    printf("quant: %d x %d, max |w - deq| = %.4f x scale/2\n", n_rows, n_cols, worst);
    /* every code is roundf(w / s) clamped, as libm rounds: halves away from zero */
    int off = 0;
    for (int i = 0; i < n_rows * n_cols; i++) {
        const float s = sc[i / n_cols];
        float v = s == 0.0f ? 0.0f : roundf(w[i] / s);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        off += q[i] != (int8_t)v;
    }
    CHECKF(off == 0, "quant: %d codes differ from roundf(w / scale)", off);
    /* a row whose scale is exactly 1: its quotients are its values, ties included */
    static const float ties[] = {127.0f, 0.5f,    -0.5f, 1.5f,        -1.5f,       2.5f,
                                 126.5f, -126.5f, 0.0f,  0.49999997f, -0.4999997f, 3.49999976f};
    static const int8_t want[] = {127, 1, -1, 2, -2, 3, 127, -127, 0, 0, 0, 3};
    int8_t tq[sizeof ties / sizeof ties[0]];
    float ts;
    CHECK(moe_quant_i8_rows(ties, 1, (int64_t)(sizeof ties / sizeof ties[0]), tq, &ts));
    CHECKF(ts == 1.0f, "quant: scale of the ties row %g, not 1", ts);
    for (size_t i = 0; i < sizeof ties / sizeof ties[0]; i++)
        CHECKF(tq[i] == want[i], "quant: %.8g -> %d, roundf gives %d", ties[i], tq[i], want[i]);

    w[5 * n_cols + 3] = NAN; /* no int8 image of a NaN */
    CHECK(!moe_quant_i8_rows(w, n_rows, n_cols, q, sc));
    w[5 * n_cols + 3] = INFINITY;
    CHECK(!moe_quant_i8_rows(w, n_rows, n_cols, q, sc));

    CHECK(moe_i8_scale_offset(3, 5) == 64 && moe_i8_weight_bytes(3, 5) == 64 + 12);
    CHECK(moe_i8_scale_offset(64, 2) == 128 && moe_dtype_size(MOE_DTYPE_I8) == 1);
    CHECK(!strcmp(moe_dtype_name(MOE_DTYPE_I8), "I8"));
    free(w);
    free(d);
    free(q);
}

/* ---- matmul ---- */

struct i8_weights {
    int8_t *q;  /* (n_out, ldw) */
    float *sc;  /* (n_out) */
    float *deq; /* (n_out, ldw): q * sc */
};

static struct i8_weights make_weights(int n_out, int64_t ldw)
{
    size_t n = (size_t)n_out * ldw;
    float *w = malloc(n * sizeof *w);
    fill_rows(w, n_out, (int)ldw);
    struct i8_weights iw = {malloc(n + 1), malloc(((size_t)n_out + 1) * sizeof(float)),
                            malloc(n * sizeof(float) + 1)};
    MOE_ASSERT(moe_quant_i8_rows(w, n_out, ldw, iw.q, iw.sc));
    moe_dequant_i8_rows(iw.q, iw.sc, n_out, ldw, iw.deq);
    free(w);
    return iw;
}

static void free_weights(struct i8_weights *iw)
{
    free(iw->q);
    free(iw->sc);
    free(iw->deq);
}

/* Runs the int8 matmul through `which` (0 backend op, 1 pooled kernel, 2 one
 * thread) and the f32 reference on the dequantized weights; returns the worst
 * error per output relative to sum |x w| (+ |y0| when accumulating), or
 * INFINITY when something was written past y. */
static double i8_case(int n_tok, int n_in, int n_out, int64_t ldw, bool accumulate, int which)
{
    struct i8_weights iw = make_weights(n_out, ldw);
    size_t nx = (size_t)n_tok * n_in, ny = (size_t)n_tok * n_out;
    float *x = malloc(nx * sizeof *x + 1);
    for (size_t i = 0; i < nx; i++)
        x[i] = test_rng_float(&g_rng);
    float *y = malloc((ny + 16) * sizeof *y), *y_ref = malloc((ny + 16) * sizeof *y);
    float *y0 = malloc((ny + 16) * sizeof *y);
    for (size_t i = 0; i < ny + 16; i++)
        y0[i] = y[i] = y_ref[i] = test_rng_float(&g_rng); /* accumulate base, then 16 canaries */
    struct moe_matmul_params p = {
        .x = x,
        .n_tok = n_tok,
        .n_in = n_in,
        .w = iw.q,
        .w_dtype = MOE_DTYPE_I8,
        .ldw = ldw,
        .n_out = n_out,
        .y = y,
        .accumulate = accumulate,
        .w_scale = iw.sc,
    };
    if (which == 0)
        g_cpu->ops->matmul(g_cpu, &p);
    else
        cpu_matmul(which == 1 ? g_pool : NULL, &p);
    struct moe_matmul_params r = p;
    r.w = iw.deq;
    r.w_dtype = MOE_DTYPE_F32;
    r.w_scale = NULL;
    r.y = y_ref;
    cpu_matmul_ref(&r);
    double worst = 0;
    for (int t = 0; t < n_tok; t++) {
        for (int o = 0; o < n_out; o++) {
            double mag = 0;
            for (int k = 0; k < n_in; k++)
                mag += fabs((double)x[(size_t)t * n_in + k] * iw.deq[(size_t)o * ldw + k]);
            size_t i = (size_t)t * n_out + o;
            if (accumulate)
                mag += fabs((double)y0[i]);
            double e = fabs((double)y[i] - y_ref[i]) / (mag > 1e-30 ? mag : 1e-30);
            if (!(e <= worst))
                worst = e; /* NaN propagates */
        }
    }
    for (int i = 0; i < 16; i++)
        if (y[ny + i] != y_ref[ny + i])
            worst = INFINITY;
    free(x);
    free(y);
    free(y_ref);
    free(y0);
    free_weights(&iw);
    return worst;
}

static void test_matmul_i8(const char *isa)
{
    /* n_tok 1, 3 (GEMV tiles), 16 and 70 (widened rows), 130 (packed + leftovers) */
    static const int toks[] = {1, 3, 16, 70, 130, 5, 2};
    static const int dims[][2] = {
        {1, 1}, {15, 3}, {16, 4}, {17, 5}, {33, 37}, {100, 7}, {129, 65}, {257, 33}, {1024, 66},
    };
    double worst = 0;
    int n = 0;
    for (size_t ti = 0; ti < sizeof toks / sizeof toks[0]; ti++) {
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
            int n_tok = toks[ti], n_in = dims[di][0], n_out = dims[di][1];
            bool acc = (ti + di) % 2;
            int64_t ldw = n_in + ((ti + di) % 3 == 0 ? 5 : 0);
            double e = i8_case(n_tok, n_in, n_out, ldw, acc, (int)((ti + di) % 3));
            CHECKF(e < SUM_ORDER_TOL,
                   "%s int8 matmul n_tok %d n_in %d n_out %d ldw %lld acc %d: "
                   "err %.3g",
                   isa, n_tok, n_in, n_out, (long long)ldw, acc, e);
            worst = e > worst ? e : worst;
            n++;
        }
    }
    printf("%s: int8 matmul %d cases, worst err %.3g vs the f32 reference on dequantized "
           "weights\n",
           isa, n, worst);
}

/* The check can fail: the scales must be applied, each to its own row. */
static void test_matmul_i8_detects_error(void)
{
    const int n_tok = 3, n_in = 40, n_out = 6;
    struct i8_weights iw = make_weights(n_out, n_in);
    float x[3 * 40], y[18], y_ref[18];
    for (int i = 0; i < n_tok * n_in; i++)
        x[i] = test_rng_float(&g_rng);
    struct moe_matmul_params p = {.x = x,
                                  .n_tok = n_tok,
                                  .n_in = n_in,
                                  .w = iw.q,
                                  .w_dtype = MOE_DTYPE_I8,
                                  .ldw = n_in,
                                  .n_out = n_out,
                                  .y = y,
                                  .w_scale = iw.sc};
    cpu_matmul(g_pool, &p);
    struct moe_matmul_params r = p;
    r.w = iw.deq;
    r.w_dtype = MOE_DTYPE_F32;
    r.w_scale = NULL;
    r.y = y_ref;
    iw.deq[2 * n_in + 7] *= 1.5f; /* one dequantized weight off */
    iw.deq[2 * n_in + 7] += 0.5f;
    cpu_matmul_ref(&r);
    double num = 0, den = 0;
    for (int i = 0; i < n_tok * n_out; i++) {
        num = fmax(num, fabs(y[i] - y_ref[i]));
        den = fmax(den, fabs(y_ref[i]));
    }
    CHECKF(num / den > 1e-3, "a corrupted reference weight went unnoticed (err %.3g)", num / den);
    free_weights(&iw);
}

/* ---- grouped matmul ---- */

static void test_grouped_i8(void)
{
    const int n_e = 5, n_in = 45, n_out = 19;
    const int32_t off[6] = {0, 3, 3, 20, 21, 37}; /* expert 1 has no rows */
    const int n_rows = off[5];
    struct i8_weights iw[5];
    const void *w[5];
    const float *sc[5];
    for (int e = 0; e < n_e; e++) {
        iw[e] = make_weights(n_out, n_in);
        w[e] = e == 1 ? NULL : iw[e].q; /* not held, as on another rank */
        sc[e] = e == 1 ? NULL : iw[e].sc;
    }
    float x[37 * 45], y[37 * 19], y_ref[37 * 19];
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
        .w_dtype = MOE_DTYPE_I8,
        .ldw = n_in,
        .y = y,
        .w_scale = sc,
    };
    struct moe_error err = {0};
    g_cpu->ops->grouped_matmul(g_cpu, &p);
    CHECKF(g_cpu->ops->status(g_cpu, &err) == MOE_OK, "grouped int8: %s", err.msg);
    for (int e = 0; e < n_e; e++) {
        if (off[e + 1] == off[e])
            continue;
        struct moe_matmul_params r = {.x = x + (size_t)off[e] * n_in,
                                      .n_tok = off[e + 1] - off[e],
                                      .n_in = n_in,
                                      .w = iw[e].deq,
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
    CHECKF(num / den < SUM_ORDER_TOL, "grouped int8 err %.3g", num / den);
    printf("grouped_matmul int8: err %.3g vs the per-expert reference\n", num / den);

    /* scales missing for an expert with rows, or the whole array: refused */
    sc[2] = NULL;
    g_cpu->ops->grouped_matmul(g_cpu, &p);
    enum moe_status st = g_cpu->ops->status(g_cpu, &err);
    CHECKF(st == MOE_ERR_INVALID && strstr(err.msg, "no scales"), "status %d (%s)", (int)st,
           err.msg);
    p.w_scale = NULL;
    g_cpu->ops->grouped_matmul(g_cpu, &p);
    st = g_cpu->ops->status(g_cpu, &err);
    CHECKF(st == MOE_ERR_INVALID && strstr(err.msg, "w_scale"), "status %d (%s)", (int)st, err.msg);
    for (int e = 0; e < n_e; e++)
        free_weights(&iw[e]);
}

int main(void)
{
    struct moe_error err = {0};
    if (moe_backend_cpu_create(2, &g_cpu, &err) != MOE_OK ||
        moe_threadpool_create(3, &g_pool, &err) != MOE_OK) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return 1;
    }
    test_quant_roundtrip();
    enum cpu_isa best = cpu_kernels_detect_isa();
    for (int isa = CPU_ISA_SCALAR; isa <= (int)best; isa++) {
        enum cpu_isa got = cpu_kernels_force_isa((enum cpu_isa)isa);
        CHECK(got == (enum cpu_isa)isa);
        test_matmul_i8(cpu_isa_name(got));
    }
    cpu_kernels_force_isa(best);
    test_matmul_i8_detects_error();
    test_grouped_i8();
    moe_threadpool_destroy(g_pool);
    moe_backend_destroy(g_cpu);
    return test_summary();
}
