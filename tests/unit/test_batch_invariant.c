/* moe_matmul_params.batch_invariant: a token's outputs are the same bits
 * whatever call it is in. For every CPU path this processor has (each ISA
 * forced in turn; on AVX-512 the dot-product features on, and AMX forced off
 * where present), exact and fast, f32 / bf16 / int8 / int4 weights, with
 * and without accumulate: one call of 130 tokens (the AVX-512 and AVX2
 * packed panels' size when the flag is off, and more than one token block)
 * is held bit for bit to each token alone, to 3-, 7-, 9- and 33-token calls
 * (the tiles' remainders, the AVX2 packed path's threshold), through a
 * pool of 3 threads and the calling thread. The exact results are also held
 * to cpu_matmul_ref within 1e-5 of sum |x w| (so a path cannot pass by being
 * wrong the same way every time); the fast ones are tests/unit/
 * test_matmul_fast.c's. Without the flag the same calls are counted, not
 * checked: on AVX-512 and AVX2 the packed panels sum in another order, and
 * the count shows what the flag changes. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/cpu_kernels.h"
#include "quant.h"
#include "testlib.h"

static struct test_rng g_rng = {0x2545f4914f6cdd1dull};
static struct moe_threadpool *g_pool;

enum { N_TOK = 130, N_OUT = 37 };

struct weights {
    enum moe_dtype dt;
    int n_in;
    void *w;
    const float *scale;
    int group;
};

static struct weights make_weights(enum moe_dtype dt, int n_in)
{
    struct weights W = {.dt = dt, .n_in = n_in};
    size_t n = (size_t)N_OUT * n_in;
    float *f = malloc(n * sizeof *f);
    for (size_t i = 0; i < n; i++)
        f[i] = test_rng_float(&g_rng);
    if (dt == MOE_DTYPE_F32) {
        W.w = f;
        return W;
    }
    if (dt == MOE_DTYPE_BF16) {
        uint16_t *b = malloc(n * 2);
        for (size_t i = 0; i < n; i++)
            b[i] = moe_f32_to_bf16(f[i]);
        W.w = b;
    } else if (dt == MOE_DTYPE_I8) {
        size_t off = moe_i8_scale_offset(N_OUT, n_in);
        char *buf = malloc(off + N_OUT * sizeof(float));
        MOE_ASSERT(moe_quant_i8_rows(f, N_OUT, n_in, (int8_t *)buf, (float *)(buf + off)));
        W.w = buf;
        W.scale = (const float *)(buf + off);
    } else {
        W.group = 64;
        size_t off = moe_q4_scale_offset(N_OUT, n_in);
        char *buf = malloc(moe_q4_weight_bytes(N_OUT, n_in, W.group));
        MOE_ASSERT(
            moe_quant_q4_rows(f, N_OUT, n_in, W.group, (uint8_t *)buf, (float *)(buf + off)));
        W.w = buf;
        W.scale = (const float *)(buf + off);
    }
    free(f);
    return W;
}

static struct moe_matmul_params params(const struct weights *W, const float *x, int n_tok, float *y,
                                       bool fast, bool invariant, bool accumulate)
{
    return (struct moe_matmul_params){.x = x,
                                      .n_tok = n_tok,
                                      .n_in = W->n_in,
                                      .w = W->w,
                                      .w_dtype = W->dt,
                                      .ldw = W->n_in,
                                      .n_out = N_OUT,
                                      .y = y,
                                      .accumulate = accumulate,
                                      .w_scale = W->scale,
                                      .w_group = W->group,
                                      .fast = fast,
                                      .batch_invariant = invariant};
}

/* y = (accumulate ? y0 : 0) + x W^T for tokens [t0, t0 + n) in one call. */
static void run(const struct weights *W, const float *x, int t0, int n, const float *y0, float *y,
                bool fast, bool invariant, bool accumulate, struct moe_threadpool *pool)
{
    memcpy(y + (size_t)t0 * N_OUT, y0 + (size_t)t0 * N_OUT, (size_t)n * N_OUT * sizeof *y);
    struct moe_matmul_params p =
        params(W, x + (size_t)t0 * W->n_in, n, y + (size_t)t0 * N_OUT, fast, invariant, accumulate);
    cpu_matmul(pool, &p);
}

/* Tokens whose rows in a and b differ. */
static int rows_differ(const float *a, const float *b)
{
    int n = 0;
    for (int t = 0; t < N_TOK; t++)
        n += memcmp(a + (size_t)t * N_OUT, b + (size_t)t * N_OUT, N_OUT * sizeof *a) != 0;
    return n;
}

/* The calls of one path: the whole batch, then the same tokens in other
 * splits. Returns the number of tokens (over the splits) that differ from
 * the whole call. */
static int splits_differ(const struct weights *W, const float *x, const float *y0, float *all,
                         float *part, bool fast, bool invariant, bool accumulate)
{
    run(W, x, 0, N_TOK, y0, all, fast, invariant, accumulate, g_pool);
    static const int sizes[] = {1, 3, 7, 9, 33};
    int differ = 0;
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        for (int t = 0; t < N_TOK; t += sizes[s]) {
            int n = N_TOK - t < sizes[s] ? N_TOK - t : sizes[s];
            run(W, x, t, n, y0, part, fast, invariant, accumulate, s % 2 ? g_pool : NULL);
        }
        differ += rows_differ(all, part);
    }
    return differ;
}

/* |y - ref| <= 1e-5 sum |x w| for every output. */
static bool near_ref(const struct weights *W, const float *x, const float *y0, const float *y,
                     bool accumulate)
{
    float *ref = malloc((size_t)N_TOK * N_OUT * sizeof *ref);
    memcpy(ref, y0, (size_t)N_TOK * N_OUT * sizeof *ref);
    struct moe_matmul_params p = params(W, x, N_TOK, ref, false, false, accumulate);
    cpu_matmul_ref(&p);
    /* sum |x w| through the reference on |x| and |w| would need |w| in
     * every format; bound it by max|w| sum|x| instead (|w| <= 1 here, with
     * scales: int8 q * s <= max|w|, int4 (u - 8) * s <= 8/7 max|w|). */
    bool ok = true;
    for (int t = 0; t < N_TOK && ok; t++) {
        double ax = 0;
        for (int k = 0; k < W->n_in; k++)
            ax += fabs(x[(size_t)t * W->n_in + k]);
        for (int o = 0; o < N_OUT; o++) {
            size_t i = (size_t)t * N_OUT + o;
            double tol = 1e-5 * (1.15 * ax + fabs(y0[i]));
            if (!(fabs((double)y[i] - ref[i]) <= tol)) {
                fprintf(stderr, "token %d output %d: %.9g, reference %.9g\n", t, o, y[i], ref[i]);
                ok = false;
                break;
            }
        }
    }
    free(ref);
    return ok;
}

static void test_path(const char *path)
{
    static const enum moe_dtype types[] = {MOE_DTYPE_F32, MOE_DTYPE_BF16, MOE_DTYPE_I8,
                                           MOE_DTYPE_I4};
    int cases = 0, bad = 0, default_differ = 0;
    for (size_t d = 0; d < sizeof types / sizeof types[0]; d++) {
        /* int4 rows are whole 32-column blocks; the others get tails */
        const int n_in = types[d] == MOE_DTYPE_I4 ? 320 : 300;
        struct weights W = make_weights(types[d], n_in);
        float *x = malloc((size_t)N_TOK * n_in * sizeof *x);
        float *y0 = malloc((size_t)N_TOK * N_OUT * sizeof *y0);
        float *all = malloc((size_t)N_TOK * N_OUT * sizeof *all);
        float *part = malloc((size_t)N_TOK * N_OUT * sizeof *part);
        for (size_t i = 0; i < (size_t)N_TOK * n_in; i++)
            x[i] = test_rng_float(&g_rng);
        for (size_t i = 0; i < (size_t)N_TOK * N_OUT; i++)
            y0[i] = test_rng_float(&g_rng);
        for (int fast = 0; fast <= 1; fast++) {
            for (int acc = 0; acc <= 1; acc++) {
                int differ = splits_differ(&W, x, y0, all, part, fast, true, acc);
                bad += differ != 0;
                CHECKF(differ == 0,
                       "%s %s %s%s: %d token rows differ from the 130-token call under "
                       "batch_invariant",
                       path, moe_dtype_name(types[d]), fast ? "fast" : "exact",
                       acc ? " accumulate" : "", differ);
                if (!fast)
                    CHECKF(near_ref(&W, x, y0, all, acc), "%s %s exact%s: off the reference", path,
                           moe_dtype_name(types[d]), acc ? " accumulate" : "");
                default_differ += splits_differ(&W, x, y0, all, part, fast, false, acc);
                cases++;
            }
        }
        free(W.w);
        free(x);
        free(y0);
        free(all);
        free(part);
    }
    printf("%s: %d of %d cases (4 types, exact and fast, accumulate on and off) bit-identical "
           "in calls of 1, 3, 7, 9, 33 and 130 tokens; without batch_invariant %d token rows "
           "differed\n",
           path, cases - bad, cases, default_differ);
}

int main(void)
{
    struct moe_error err = {0};
    if (moe_threadpool_create(3, &g_pool, &err) != MOE_OK) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return 1;
    }
    const enum cpu_isa best = cpu_kernels_detect_isa();
    const unsigned have = cpu_kernels_detect_features();
    const unsigned amx = CPU_FEAT_AMX_BF16 | CPU_FEAT_AMX_INT8;
    for (int isa = CPU_ISA_SCALAR; isa <= (int)best; isa++) {
        CHECK(cpu_kernels_force_isa((enum cpu_isa)isa) == (enum cpu_isa)isa);
        char name[96];
        if (isa == CPU_ISA_AVX512 && (have & amx)) {
            cpu_kernels_force_features(have);
            test_path("avx512+amx");
            cpu_kernels_force_features(have & ~amx);
            test_path("avx512 (amx off)");
        } else {
            char feats[64];
            snprintf(name, sizeof name, "%s (%s)", cpu_isa_name((enum cpu_isa)isa),
                     isa == CPU_ISA_AVX512 ? cpu_features_name(have, feats, sizeof feats)
                                           : "no dot-product features");
            cpu_kernels_force_features(have);
            test_path(name);
        }
    }
    cpu_kernels_force_isa(best);
    cpu_kernels_force_features(have);
    moe_threadpool_destroy(g_pool);
    return test_summary();
}
