/* Every CPU op against a naive reference written here (double accumulation
 * where it matters), on random and ragged shapes, on every SIMD path this
 * processor has (the kernels are forced onto each ISA in turn); backend
 * selection; and, where a GPU is usable, the CUDA ops against the CPU ones.
 *
 * Error measures: matmul error of each output divided by sum_k |x_k w_k|
 * (what f32 summation can be held to), elsewhere max |a - b| / max |b|. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/cpu_kernels.h"
#include "cuda/grouped_tiles.h" /* the tensor-core grouped GEMM's row tiles */
#include "testlib.h"

/* ---- helpers ---- */

static struct test_rng g_rng = {0x9e3779b97f4a7c15ull};

static float *rand_floats(size_t n)
{
    float *p = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++)
        p[i] = test_rng_float(&g_rng);
    return p;
}

/* max |a - b| / max |b| */
static double max_rel_err(const float *a, const double *b, size_t n)
{
    double num = 0.0, den = 1e-30;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]);
        if (!(e <= num)) /* NaN propagates */
            num = e;
        den = fabs(b[i]) > den ? fabs(b[i]) : den;
    }
    return num / den;
}

static struct moe_backend *g_cpu;     /* 2 threads */
static struct moe_threadpool *g_pool; /* 3 threads, for direct kernel calls */

/* ---- matmul ---- */

static double matmul_case(enum moe_dtype dt, int n_tok, int n_in, int n_out, int64_t ldw,
                          bool accumulate, int which)
{
    size_t nw = (size_t)n_out * ldw;
    float *x = rand_floats((size_t)n_tok * n_in);
    float *wf = rand_floats(nw);
    uint16_t *wb = malloc(nw * sizeof(uint16_t) + 2);
    for (size_t i = 0; i < nw; i++)
        wb[i] = moe_f32_to_bf16(wf[i]);
    size_t ny = (size_t)n_tok * n_out;
    float *y = rand_floats(ny + 16); /* 16 canaries past the end */
    float *y0 = malloc((ny + 16) * sizeof(float));
    memcpy(y0, y, (ny + 16) * sizeof(float));
    struct moe_matmul_params p = {
        .x = x,
        .n_tok = n_tok,
        .n_in = n_in,
        .w = dt == MOE_DTYPE_BF16 ? (void *)wb : (void *)wf,
        .w_dtype = dt,
        .ldw = ldw,
        .n_out = n_out,
        .y = y,
        .accumulate = accumulate,
    };
    if (which == 0)
        g_cpu->ops->matmul(g_cpu, &p);
    else if (which == 1)
        cpu_matmul(g_pool, &p);
    else if (which == 2)
        cpu_matmul(NULL, &p);
    else
        cpu_matmul_ref(&p);
    double worst = 0.0;
    for (int t = 0; t < n_tok; t++) {
        for (int o = 0; o < n_out; o++) {
            double acc = 0.0, mag = 0.0;
            for (int k = 0; k < n_in; k++) {
                double w = dt == MOE_DTYPE_BF16 ? moe_bf16_to_f32(wb[(size_t)o * ldw + k])
                                                : wf[(size_t)o * ldw + k];
                acc += (double)x[(size_t)t * n_in + k] * w;
                mag += fabs((double)x[(size_t)t * n_in + k] * w);
            }
            size_t i = (size_t)t * n_out + o;
            if (accumulate) {
                acc += y0[i];
                mag += fabs(y0[i]);
            }
            double e = fabs((double)y[i] - acc) / (mag > 1e-30 ? mag : 1e-30);
            if (!(e <= worst))
                worst = e;
        }
    }
    for (int i = 0; i < 16; i++)
        if (y[ny + i] != y0[ny + i])
            worst = INFINITY; /* wrote past the end */
    free(x);
    free(wf);
    free(wb);
    free(y);
    free(y0);
    return worst;
}

static void test_matmul(const char *isa)
{
    const double tol = 2e-6;
    /* Fixed ragged and benchmark-like shapes, then random ones. */
    static const int shapes[][3] = {
        {1, 1, 1},    {1, 15, 1},     {1, 16, 4},    {1, 17, 5},     {2, 33, 3},    {3, 100, 7},
        {4, 64, 64},  {5, 257, 9},    {8, 1024, 33}, {1, 1024, 300}, {37, 129, 13}, {64, 64, 17},
        {65, 48, 21}, {130, 200, 37}, {256, 96, 40}, {260, 40, 70},  {300, 33, 65},
    };
    double worst = 0.0;
    int n_cases = 0;
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        for (int dt = 0; dt < 2; dt++) {
            for (int acc = 0; acc < 2; acc++) {
                enum moe_dtype d = dt ? MOE_DTYPE_BF16 : MOE_DTYPE_F32;
                int64_t ldw = shapes[s][1] + (acc ? 3 : 0);
                double e = matmul_case(d, shapes[s][0], shapes[s][1], shapes[s][2], ldw, acc,
                                       (int)(s % 3));
                CHECKF(e < tol, "%s matmul %s n_tok %d n_in %d n_out %d ldw %lld acc %d: err %.3g",
                       isa, moe_dtype_name(d), shapes[s][0], shapes[s][1], shapes[s][2],
                       (long long)ldw, acc, e);
                worst = e > worst ? e : worst;
                n_cases++;
            }
        }
    }
    for (int i = 0; i < 40; i++) {
        int n_tok = test_rng_int(&g_rng, 1, 37);
        int n_in = test_rng_int(&g_rng, 1, 300);
        int n_out = test_rng_int(&g_rng, 1, 70);
        int64_t ldw = n_in + (test_rng_int(&g_rng, 0, 1) ? test_rng_int(&g_rng, 1, 20) : 0);
        enum moe_dtype d = test_rng_int(&g_rng, 0, 1) ? MOE_DTYPE_BF16 : MOE_DTYPE_F32;
        bool acc = test_rng_int(&g_rng, 0, 1);
        double e = matmul_case(d, n_tok, n_in, n_out, ldw, acc, i % 3);
        CHECKF(e < tol, "%s matmul %s n_tok %d n_in %d n_out %d ldw %lld acc %d: err %.3g", isa,
               moe_dtype_name(d), n_tok, n_in, n_out, (long long)ldw, acc, e);
        worst = e > worst ? e : worst;
        n_cases++;
    }
    printf("%s: matmul %d cases, worst err %.3g\n", isa, n_cases, worst);
}

static void test_matmul_ref(void)
{
    double worst = 0.0;
    for (int i = 0; i < 10; i++) {
        enum moe_dtype d = i % 2 ? MOE_DTYPE_BF16 : MOE_DTYPE_F32;
        int n_in = test_rng_int(&g_rng, 1, 200);
        double e = matmul_case(d, test_rng_int(&g_rng, 1, 9), n_in, test_rng_int(&g_rng, 1, 20),
                               n_in + test_rng_int(&g_rng, 0, 3), i % 3 == 0, 3);
        worst = e > worst ? e : worst;
    }
    CHECKF(worst < 2e-6, "matmul_ref err %.3g", worst);
}

/* A wrong result must be caught: corrupt one weight after the fact. */
static void test_matmul_detects_error(void)
{
    int n_tok = 3, n_in = 40, n_out = 5;
    float *x = rand_floats((size_t)n_tok * n_in), *w = rand_floats((size_t)n_out * n_in);
    float y[15], yr[15];
    struct moe_matmul_params p = {.x = x,
                                  .n_tok = n_tok,
                                  .n_in = n_in,
                                  .w = w,
                                  .w_dtype = MOE_DTYPE_F32,
                                  .ldw = n_in,
                                  .n_out = n_out,
                                  .y = y};
    cpu_matmul(g_pool, &p);
    w[7] += 0.5f;
    p.y = yr;
    cpu_matmul_ref(&p);
    double num = 0, den = 0;
    for (int i = 0; i < 15; i++) {
        num = fmax(num, fabs(y[i] - yr[i]));
        den = fmax(den, fabs(yr[i]));
    }
    CHECK(num / den > 1e-3);
    free(x);
    free(w);
}

/* ---- rmsnorm ---- */

static void test_rmsnorm(const char *isa)
{
    static const int dims[] = {1, 7, 16, 64, 100, 1024, 4097};
    double worst = 0.0;
    for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++) {
        for (int in_place = 0; in_place < 2; in_place++) {
            int dim = dims[di], n_rows = test_rng_int(&g_rng, 1, 50);
            size_t n = (size_t)n_rows * dim;
            float *x = rand_floats(n), *w = rand_floats((size_t)dim);
            float *y = in_place ? x : malloc(n * sizeof(float));
            double *ref = malloc(n * sizeof(double));
            float eps = 1e-6f;
            for (int r = 0; r < n_rows; r++) {
                double ss = 0;
                for (int i = 0; i < dim; i++)
                    ss += (double)x[(size_t)r * dim + i] * x[(size_t)r * dim + i];
                double inv = 1.0 / sqrt(ss / dim + eps);
                for (int i = 0; i < dim; i++)
                    ref[(size_t)r * dim + i] = (double)w[i] * x[(size_t)r * dim + i] * inv;
            }
            g_cpu->ops->rmsnorm(g_cpu, x, w, y, n_rows, dim, eps);
            double e = max_rel_err(y, ref, n);
            CHECKF(e < 2e-6, "%s rmsnorm dim %d rows %d in_place %d: err %.3g", isa, dim, n_rows,
                   in_place, e);
            worst = e > worst ? e : worst;
            free(x);
            free(w);
            if (!in_place)
                free(y);
            free(ref);
        }
    }
    printf("%s: rmsnorm worst err %.3g\n", isa, worst);
}

/* ---- fusions: add_rmsnorm and rope_kv_write against the ops they stand for ---- */

static float *dup_floats(const float *a, size_t n)
{
    float *p = malloc((n ? n : 1) * sizeof *p);
    memcpy(p, a, n * sizeof *p);
    return p;
}

/* The backend ops the model issued before the fusions, for one call of
 * rope_kv_write (worker/model/forward.c, rope_kv_unfused). */
static void rope_kv_by_ops(struct moe_backend *be, const struct moe_rope_kv_params *p)
{
    const struct moe_backend_ops *o = be->ops;
    const int n = p->n_tok, d = p->d_head, qd = p->n_head * d, kvd = p->n_kv_head * d;
    const int w = qd + 2 * kvd;
    float *k = malloc((size_t)n * kvd * 4 + 4), *v = malloc((size_t)n * kvd * 4 + 4);
    float *ones = malloc((size_t)n * 4 + 4);
    for (int t = 0; t < n; t++)
        ones[t] = 1.0f;
    o->copy_cols(be, p->q_out, qd, p->qkv, w, n, qd);
    o->copy_cols(be, k, kvd, p->qkv + qd, w, n, kvd);
    o->copy_cols(be, v, kvd, p->qkv + qd + kvd, w, n, kvd);
    const float *bias[3] = {p->bq, p->bk, p->bv};
    float *dst[3] = {p->q_out, k, v};
    const int width[3] = {qd, kvd, kvd};
    for (int i = 0; i < 3 && p->bq; i++) { /* y += ones . b^T, as the model adds biases */
        struct moe_matmul_params mp = {.x = ones,
                                       .n_tok = n,
                                       .n_in = 1,
                                       .w = bias[i],
                                       .w_dtype = MOE_DTYPE_F32,
                                       .ldw = 1,
                                       .n_out = width[i],
                                       .y = dst[i],
                                       .accumulate = true};
        o->matmul(be, &mp);
    }
    if (p->q_norm) {
        o->rmsnorm(be, p->q_out, p->q_norm, p->q_out, n * p->n_head, d, p->eps);
        o->rmsnorm(be, k, p->k_norm, k, n * p->n_kv_head, d, p->eps);
    }
    o->rope(be, p->q_out, p->pos, n, p->n_head, d, p->inv_freq, p->scale);
    o->rope(be, k, p->pos, n, p->n_kv_head, d, p->inv_freq, p->scale);
    o->kv_write(be, k, v, p->slots, n, kvd, p->k_cache, p->v_cache, p->kv_dtype);
    free(k);
    free(v);
    free(ones);
}

static void test_fusions(const char *isa)
{
    static const int ar[][2] = {{1, 64}, {7, 1000}, {300, 4096}}; /* rows, dim; the last threaded */
    for (size_t c = 0; c < sizeof ar / sizeof ar[0]; c++) {
        int n_rows = ar[c][0], dim = ar[c][1];
        size_t n = (size_t)n_rows * dim;
        float *x = rand_floats(n), *r = rand_floats(n), *w = rand_floats((size_t)dim);
        float *x2 = dup_floats(x, n), *y = malloc(n * 4), *y2 = malloc(n * 4);
        g_cpu->ops->add_rmsnorm(g_cpu, x, r, w, y, n_rows, dim, 1e-5f);
        g_cpu->ops->add(g_cpu, x2, r, n);
        g_cpu->ops->rmsnorm(g_cpu, x2, w, y2, n_rows, dim, 1e-5f);
        CHECKF(!memcmp(x, x2, n * 4) && !memcmp(y, y2, n * 4),
               "%s add_rmsnorm %d x %d: not the bits of add then rmsnorm", isa, n_rows, dim);
        free(x), free(r), free(w), free(x2), free(y), free(y2);
    }
    /* {n_tok, n_head, n_kv_head, d_head, biases, norms, bf16 cache, shared slots}; the third
     * and the last threaded; shared slots: every odd token writes its predecessor's slot (as
     * sequences sharing a prefix block do), and the later token must win, as in kv_write */
    static const int rk[][8] = {{5, 4, 2, 64, 0, 0, 0, 0},   {37, 8, 2, 128, 1, 0, 1, 0},
                                {64, 16, 4, 64, 0, 1, 1, 0}, {3, 2, 1, 16, 1, 1, 0, 0},
                                {1, 6, 6, 32, 0, 1, 0, 0},   {9, 2, 2, 32, 1, 0, 1, 1},
                                {64, 16, 4, 64, 0, 1, 0, 1}};
    for (size_t c = 0; c < sizeof rk / sizeof rk[0]; c++) {
        const int n = rk[c][0], H = rk[c][1], KV = rk[c][2], d = rk[c][3];
        const bool bias = rk[c][4], norm = rk[c][5], bf16 = rk[c][6];
        const int qd = H * d, kvd = KV * d, n_slot = 2 * n + 3;
        const size_t es = bf16 ? 2 : 4, cache = (size_t)n_slot * kvd * es;
        float *qkv = rand_floats((size_t)n * (qd + 2 * kvd));
        float *bq = rand_floats((size_t)qd), *bk = rand_floats((size_t)kvd);
        float *bv = rand_floats((size_t)kvd), *qn = rand_floats((size_t)d);
        float *kn = rand_floats((size_t)d), *inv = malloc((size_t)d / 2 * 4);
        int32_t *pos = malloc((size_t)n * 4), *slots = malloc((size_t)n * 4);
        for (int i = 0; i < d / 2; i++)
            inv[i] = powf(10000.0f, -(float)(2 * i) / (float)d);
        for (int t = 0; t < n; t++) {
            pos[t] = test_rng_int(&g_rng, 0, 5000);
            slots[t] = rk[c][7] && t % 2 ? slots[t - 1] : 2 * t + (t % 3 == 0); /* scattered */
        }
        char *kc[2], *vc[2];
        float *q[2];
        for (int v = 0; v < 2; v++) {
            kc[v] = malloc(cache);
            vc[v] = malloc(cache);
            memset(kc[v], 0x5a, cache); /* rows not written must stay as they were */
            memset(vc[v], 0xa5, cache);
            q[v] = malloc((size_t)n * qd * 4);
        }
        for (int v = 0; v < 2; v++) {
            struct moe_rope_kv_params p = {.qkv = qkv,
                                           .n_tok = n,
                                           .n_head = H,
                                           .n_kv_head = KV,
                                           .d_head = d,
                                           .bq = bias ? bq : NULL,
                                           .bk = bias ? bk : NULL,
                                           .bv = bias ? bv : NULL,
                                           .q_norm = norm ? qn : NULL,
                                           .k_norm = norm ? kn : NULL,
                                           .eps = 1e-6f,
                                           .pos = pos,
                                           .inv_freq = inv,
                                           .scale = 1.25f,
                                           .q_out = q[v],
                                           .slots = slots,
                                           .k_cache = kc[v],
                                           .v_cache = vc[v],
                                           .kv_dtype = bf16 ? MOE_DTYPE_BF16 : MOE_DTYPE_F32};
            if (v == 0)
                g_cpu->ops->rope_kv_write(g_cpu, &p);
            else
                rope_kv_by_ops(g_cpu, &p);
        }
        CHECKF(
            !memcmp(q[0], q[1], (size_t)n * qd * 4) && !memcmp(kc[0], kc[1], cache) &&
                !memcmp(vc[0], vc[1], cache),
            "%s rope_kv_write case %zu: not the bits of the ops it stands for (q %d, k %d, v %d)",
            isa, c, !memcmp(q[0], q[1], (size_t)n * qd * 4), !memcmp(kc[0], kc[1], cache),
            !memcmp(vc[0], vc[1], cache));
        for (int v = 0; v < 2; v++)
            free(kc[v]), free(vc[v]), free(q[v]);
        free(qkv), free(bq), free(bk), free(bv), free(qn), free(kn), free(inv), free(pos),
            free(slots);
    }
    printf("%s: add_rmsnorm and rope_kv_write equal their ops bit for bit\n", isa);
}

/* The row tiles of CUDA's tensor-core grouped GEMM (kernels/cuda/grouped_tiles.h),
 * checked on the host: over random expert sizes (empty experts, one expert
 * with every row, more experts than rows), the slots of a launch sized from
 * n_rows and n_expert alone cover every row exactly once, in tiles of at
 * most bm rows inside one expert, and the slots past the last tile find none. */
static void test_grouped_tiles(void)
{
    int bad = 0, cases = 0;
    for (int it = 0; it < 400; it++) {
        const int n_e = test_rng_int(&g_rng, 1, 70), bm = it % 3 == 0 ? 64 : 16;
        const int n_rows = it % 5 == 0 ? test_rng_int(&g_rng, 0, 5) : test_rng_int(&g_rng, 0, 700);
        const int hot = test_rng_int(&g_rng, 0, n_e - 1), mode = it % 4;
        int32_t *off = calloc((size_t)n_e + 1, sizeof *off),
                *cnt = calloc((size_t)n_e, sizeof *cnt);
        int *seen = calloc((size_t)n_rows + 1, sizeof *seen);
        for (int r = 0; r < n_rows; r++)
            cnt[mode == 0   ? hot
                : mode == 1 ? test_rng_int(&g_rng, 0, n_e - 1) & ~1
                            : test_rng_int(&g_rng, 0, n_e - 1)]++;
        for (int e = 0; e < n_e; e++)
            off[e + 1] = off[e] + cnt[e];
        const long long slots = moe_grouped_tile_slots(n_rows, n_e, bm);
        long long used = 0;
        for (long long sl = 0; sl < slots + 3; sl++) {
            int row0 = -1, c = -1;
            int e = moe_grouped_tile_of(off, n_e, (int)sl, bm, &row0, &c);
            if (e < 0)
                continue;
            used++;
            bad += sl >= slots || c < 1 || c > bm || row0 < off[e] || row0 + c > off[e + 1];
            for (int r = row0; r < row0 + c && r >= 0 && r < n_rows; r++)
                seen[r]++;
        }
        for (int r = 0; r < n_rows; r++)
            bad += seen[r] != 1;
        bad += used > slots;
        cases++;
        free(off);
        free(cnt);
        free(seen);
    }
    CHECKF(bad == 0, "grouped tiles: %d violations over %d cases", bad, cases);
    printf("grouped GEMM row tiles (CUDA's map, on the host): %d cases, every row once\n", cases);
}

/* ---- rope ---- */

static void test_rope(void)
{
    static const int d_heads[] = {2, 16, 64, 128};
    double worst_f = 0.0, worst_d = 0.0;
    for (size_t di = 0; di < 4; di++) {
        int d = d_heads[di], half = d / 2, n_tok = test_rng_int(&g_rng, 1, 20),
            n_heads = test_rng_int(&g_rng, 1, 5);
        float theta = di % 2 ? 1000000.0f : 10000.0f;
        size_t n = (size_t)n_tok * n_heads * d;
        float *x = rand_floats(n);
        float *xf = malloc(n * sizeof(float));
        double *xd = malloc(n * sizeof(double));
        int32_t *pos = malloc((size_t)n_tok * sizeof(int32_t));
        for (int t = 0; t < n_tok; t++)
            pos[t] = t == 0 ? 0 : test_rng_int(&g_rng, 0, 5000);
        /* xf: the float operation order of HF (see norm.c); xd: exact math. */
        for (int t = 0; t < n_tok; t++) {
            for (int h = 0; h < n_heads; h++) {
                const float *a = x + ((size_t)t * n_heads + h) * d;
                float *o = xf + ((size_t)t * n_heads + h) * d;
                double *od = xd + ((size_t)t * n_heads + h) * d;
                for (int i = 0; i < half; i++) {
                    volatile float e = (float)(2 * i) / (float)d;
                    volatile float inv = 1.0f / powf(theta, e);
                    volatile float f = (float)pos[t] * inv;
                    float c = cosf(f), s = sinf(f);
                    volatile float ac = a[i] * c, bs = a[i + half] * s;
                    volatile float bc = a[i + half] * c, as = a[i] * s;
                    o[i] = ac - bs;
                    o[i + half] = bc + as;
                    double fd = pos[t] * pow((double)theta, -2.0 * i / d);
                    od[i] = a[i] * cos(fd) - a[i + half] * sin(fd);
                    od[i + half] = a[i + half] * cos(fd) + a[i] * sin(fd);
                }
            }
        }
        float inv_freq[64];
        for (int i = 0; i < half; i++) /* the model's table: moe_rope_inv_freq, default type */
            inv_freq[i] = 1.0f / powf(theta, (float)(2 * i) / (float)d);
        g_cpu->ops->rope(g_cpu, x, pos, n_tok, n_heads, d, inv_freq, 1.0f);
        double ef = 0.0;
        for (size_t i = 0; i < n; i++)
            ef = fmax(ef, fabs((double)x[i] - xf[i]));
        double ed = max_rel_err(x, xd, n);
        CHECKF(ef < 1e-6, "rope d_head %d: differs from the HF float order by %.3g", d, ef);
        /* f32 positions x frequencies lose ~pos * 2^-24 rad: loose vs exact math. */
        CHECKF(ed < 2e-3, "rope d_head %d: err vs exact %.3g", d, ed);
        worst_f = fmax(worst_f, ef);
        worst_d = fmax(worst_d, ed);
        free(x);
        free(xf);
        free(xd);
        free(pos);
    }
    printf("rope: worst diff vs HF float order %.3g, vs exact %.3g\n", worst_f, worst_d);
}

/* ---- kv_write + attention ---- */

static void attention_case(const char *isa, int n_kv_head, int rep, int d_head, int block_size,
                           double *worst)
{
    int n_head = n_kv_head * rep, kv_dim = n_kv_head * d_head;
    int n_seq = test_rng_int(&g_rng, 1, 3);
    int max_blocks = 0, n_block_total = 0;
    int seq_len[3], n_new[3];
    for (int s = 0; s < n_seq; s++) {
        seq_len[s] = test_rng_int(&g_rng, 1, 150);
        n_new[s] = test_rng_int(&g_rng, 1, seq_len[s] < 9 ? seq_len[s] : 9);
        int nb = (seq_len[s] + block_size - 1) / block_size;
        max_blocks = nb > max_blocks ? nb : max_blocks;
        n_block_total += nb;
    }
    int n_block = n_block_total + 5; /* spare blocks never referenced */
    /* Shuffled, non-contiguous block ids. */
    int32_t *perm = malloc((size_t)n_block * sizeof(int32_t));
    for (int i = 0; i < n_block; i++)
        perm[i] = i;
    for (int i = n_block - 1; i > 0; i--) {
        int j = test_rng_int(&g_rng, 0, i);
        int32_t tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    int32_t *bt = malloc((size_t)n_seq * max_blocks * sizeof(int32_t));
    int next = 0;
    for (int s = 0; s < n_seq; s++) {
        int nb = (seq_len[s] + block_size - 1) / block_size;
        for (int b = 0; b < max_blocks; b++)
            bt[s * max_blocks + b] = b < nb ? perm[next++] : -1;
    }
    size_t n_slot = (size_t)n_block * block_size;
    float *kc = rand_floats(n_slot * kv_dim), *vc = rand_floats(n_slot * kv_dim);
    /* The new tokens: the last n_new positions of each sequence. */
    int n_tok = 0;
    for (int s = 0; s < n_seq; s++)
        n_tok += n_new[s];
    int32_t *tok_seq = malloc((size_t)n_tok * sizeof(int32_t));
    int32_t *tok_pos = malloc((size_t)n_tok * sizeof(int32_t));
    int32_t *slots = malloc((size_t)n_tok * sizeof(int32_t));
    int t = 0;
    for (int s = 0; s < n_seq; s++) {
        for (int i = 0; i < n_new[s]; i++, t++) {
            tok_seq[t] = s;
            tok_pos[t] = seq_len[s] - n_new[s] + i;
            slots[t] =
                bt[s * max_blocks + tok_pos[t] / block_size] * block_size + tok_pos[t] % block_size;
        }
    }
    float *k = rand_floats((size_t)n_tok * kv_dim), *v = rand_floats((size_t)n_tok * kv_dim);
    /* A BF16 copy of the caches before the write (same rounded values). */
    uint16_t *kcb = malloc(n_slot * kv_dim * sizeof *kcb), *vcb = malloc(n_slot * kv_dim * 2);
    for (size_t i = 0; i < n_slot * kv_dim; i++) {
        kcb[i] = moe_f32_to_bf16(kc[i]);
        vcb[i] = moe_f32_to_bf16(vc[i]);
    }
    g_cpu->ops->kv_write(g_cpu, k, v, slots, n_tok, kv_dim, kc, vc, MOE_DTYPE_F32);
    g_cpu->ops->kv_write(g_cpu, k, v, slots, n_tok, kv_dim, kcb, vcb, MOE_DTYPE_BF16);
    int kv_ok = 1;
    for (t = 0; t < n_tok; t++)
        kv_ok &=
            memcmp(kc + (size_t)slots[t] * kv_dim, k + (size_t)t * kv_dim, (size_t)kv_dim * 4) ==
                0 &&
            memcmp(vc + (size_t)slots[t] * kv_dim, v + (size_t)t * kv_dim, (size_t)kv_dim * 4) == 0;
    CHECK(kv_ok);

    float *q = rand_floats((size_t)n_tok * n_head * d_head);
    for (size_t i = 0; i < (size_t)n_tok * n_head * d_head; i++)
        q[i] *= 3.0f; /* peakier softmax */
    float *out = malloc((size_t)n_tok * n_head * d_head * sizeof(float));
    double *ref = calloc((size_t)n_tok * n_head * d_head, sizeof(double));
    float scale = 1.0f / sqrtf((float)d_head);
    for (t = 0; t < n_tok; t++) {
        for (int h = 0; h < n_head; h++) {
            int kvh = h / rep, np = tok_pos[t] + 1;
            double *sc = malloc((size_t)np * sizeof(double));
            double mx = -INFINITY, sum = 0;
            const float *qq = q + ((size_t)t * n_head + h) * d_head;
            for (int p = 0; p < np; p++) {
                size_t slot = (size_t)bt[tok_seq[t] * max_blocks + p / block_size] * block_size +
                              p % block_size;
                const float *kk = kc + slot * kv_dim + (size_t)kvh * d_head;
                double dot = 0;
                for (int i = 0; i < d_head; i++)
                    dot += (double)qq[i] * kk[i];
                sc[p] = dot * scale;
                mx = fmax(mx, sc[p]);
            }
            for (int p = 0; p < np; p++)
                sum += exp(sc[p] - mx);
            double *o = ref + ((size_t)t * n_head + h) * d_head;
            for (int p = 0; p < np; p++) {
                size_t slot = (size_t)bt[tok_seq[t] * max_blocks + p / block_size] * block_size +
                              p % block_size;
                const float *vv = vc + slot * kv_dim + (size_t)kvh * d_head;
                double wgt = exp(sc[p] - mx) / sum;
                for (int i = 0; i < d_head; i++)
                    o[i] += wgt * vv[i];
            }
            free(sc);
        }
    }
    struct moe_attn_params ap = {
        .q = q,
        .out = out,
        .k_cache = kc,
        .v_cache = vc,
        .tok_seq = tok_seq,
        .tok_pos = tok_pos,
        .block_tables = bt,
        .max_blocks = max_blocks,
        .n_tok = n_tok,
        .n_head = n_head,
        .n_kv_head = n_kv_head,
        .d_head = d_head,
        .block_size = block_size,
        .scale = scale,
    };
    g_cpu->ops->attention(g_cpu, &ap);
    double e = max_rel_err(out, ref, (size_t)n_tok * n_head * d_head);
    CHECKF(e < 1e-5, "%s attention n_kv_head %d rep %d d_head %d block %d n_tok %d: err %.3g", isa,
           n_kv_head, rep, d_head, block_size, n_tok, e);
    *worst = fmax(*worst, e);

    /* BF16 caches: the write rounds each element to nearest even, and
     * attention over them equals, bit for bit, attention over F32 caches
     * holding the same rounded values. */
    int bf_ok = 1;
    for (t = 0; t < n_tok; t++)
        for (int i = 0; i < kv_dim; i++) {
            size_t c = (size_t)slots[t] * kv_dim + i, x = (size_t)t * kv_dim + i;
            bf_ok &= kcb[c] == moe_f32_to_bf16(k[x]) && vcb[c] == moe_f32_to_bf16(v[x]);
        }
    CHECKF(bf_ok, "%s kv_write BF16: an element is not the nearest-even bf16", isa);
    for (size_t i = 0; i < n_slot * kv_dim; i++) {
        kc[i] = moe_bf16_to_f32(kcb[i]);
        vc[i] = moe_bf16_to_f32(vcb[i]);
    }
    size_t nq = (size_t)n_tok * n_head * d_head;
    float *out_bf = malloc(nq * sizeof *out_bf);
    g_cpu->ops->attention(g_cpu, &ap); /* F32 caches of the rounded values */
    struct moe_attn_params apb = ap;
    apb.k_cache = kcb;
    apb.v_cache = vcb;
    apb.kv_dtype = MOE_DTYPE_BF16;
    apb.out = out_bf;
    g_cpu->ops->attention(g_cpu, &apb);
    CHECKF(!memcmp(out, out_bf, nq * sizeof *out),
           "%s attention over BF16 caches differs from F32 caches of the same values (n_kv_head "
           "%d rep %d d_head %d block %d)",
           isa, n_kv_head, rep, d_head, block_size);
    cpu_attention_ref(g_pool, &apb); /* the reference kernel's BF16 path too */
    cpu_attention_ref(g_pool, &ap);
    CHECKF(!memcmp(out, out_bf, nq * sizeof *out),
           "%s reference attention over BF16 caches differs from F32 caches of the same values",
           isa);
    free(out_bf);
    free(kcb);
    free(vcb);
    free(perm);
    free(bt);
    free(kc);
    free(vc);
    free(tok_seq);
    free(tok_pos);
    free(slots);
    free(k);
    free(v);
    free(q);
    free(out);
    free(ref);
}

/* cpu_vec_to_bf16 / cpu_vec_from_bf16 on this ISA against dtype.h's scalar
 * conversions, bit for bit: ties, subnormals, infinities, NaNs, odd lengths. */
static void test_bf16_convert(const char *isa)
{
    enum { N = 1000 };
    float *x = malloc(N * sizeof *x), *back = malloc(N * sizeof *back);
    uint16_t *h = malloc(N * sizeof *h);
    uint32_t special[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                          0xffc00001u, 0x7f800001u, 0x3f808000u, 0x3f818000u, 0x3f80ffffu,
                          0x00000001u, 0x807fffffu, 0x7f7fffffu, 0x7f7f8000u, 0x3f7f8000u};
    size_t n_special = sizeof special / sizeof special[0];
    for (int i = 0; i < N; i++) {
        uint32_t u = i < (int)n_special ? special[i] : (uint32_t)test_rng_u64(&g_rng);
        memcpy(&x[i], &u, 4);
    }
    int bad = 0;
    for (int n = 1; n <= N; n = n * 3 + 1) {
        memset(h, 0xab, N * sizeof *h);
        cpu_vec_to_bf16(h, x, n);
        for (int i = 0; i < n; i++)
            bad += h[i] != moe_f32_to_bf16(x[i]);
        bad += n < N && h[n] != 0xabab; /* nothing written past n */
        cpu_vec_from_bf16(back, h, n);
        for (int i = 0; i < n; i++) {
            float want = moe_bf16_to_f32(h[i]);
            bad += memcmp(&back[i], &want, 4) != 0;
        }
    }
    CHECKF(bad == 0, "%s: %d bf16 conversions differ from the scalar ones", isa, bad);
    free(x);
    free(back);
    free(h);
}

static void test_attention(const char *isa)
{
    static const int reps[] = {1, 2, 4};
    static const int d_heads[] = {16, 64, 100, 128};
    static const int blocks[] = {1, 5, 16};
    double worst = 0.0;
    int n = 0;
    for (int r = 0; r < 3; r++)
        for (int d = 0; d < 4; d++, n++)
            attention_case(isa, test_rng_int(&g_rng, 1, 3), reps[r], d_heads[d],
                           blocks[(r + d) % 3], &worst);
    printf("%s: attention %d cases, worst err %.3g\n", isa, n, worst);
}

/* The tiled attention kernel (on the ISA now forced: AVX2 or AVX-512)
 * against the reference kernel, and each token computed alone (a
 * decode-sized call over the same cache) equals the same token inside the
 * batch bit for bit: its arithmetic does not depend on the group it lands
 * in. Long sequences (several 64-key chunks), GQA ratios up to 64 query
 * heads per KV head, and one beyond (the reference path); heads whose width
 * is not a multiple of a vector (100, 20) over F32 and BF16 caches; tokens
 * alone of 1-8 rows over a BF16 cache take AVX2's in-place tiles (3 and 6
 * rows, a last pass of 8 columns: d 40, 24). */
static const struct {
    int n_kv_head, rep, d_head, block_size, seq_len, n_new;
} g_tiled_cases[] = {
    {4, 4, 64, 16, 300, 40},  {2, 8, 128, 16, 200, 17}, {1, 64, 32, 5, 70, 3},
    {1, 16, 16, 7, 129, 129}, {2, 1, 100, 3, 65, 64},   {3, 2, 20, 8, 90, 30},
    {1, 65, 16, 4, 20, 2},    {2, 3, 40, 16, 150, 5},   {1, 6, 24, 16, 100, 1},
};
#define N_TILED_CASES (sizeof g_tiled_cases / sizeof g_tiled_cases[0])

/* keep[c]: each case's output over its BF16 cache (malloc'd, for
 * test_attention_tiled_isas_agree); the data are the same on every call. */
static void test_attention_tiled(const char *isa, float *keep[N_TILED_CASES])
{
#define cases g_tiled_cases
    test_rng_seed(&g_rng, 0x7a11ed);
    double worst = 0;
    int differ = 0, n_tiled = 0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int nkv = cases[c].n_kv_head, n_head = nkv * cases[c].rep, d = cases[c].d_head;
        const int bs = cases[c].block_size, len = cases[c].seq_len, n_new = cases[c].n_new;
        const int kv_dim = nkv * d, n_seq = 2;
        const int max_blocks = (len + bs - 1) / bs, n_block = n_seq * max_blocks;
        int32_t *bt = malloc((size_t)n_block * sizeof *bt);
        for (int b = 0; b < n_block; b++)
            bt[b] = n_block - 1 - b; /* reversed: not contiguous */
        float *kc = rand_floats((size_t)n_block * bs * kv_dim);
        float *vc = rand_floats((size_t)n_block * bs * kv_dim);
        const int n_tok = n_seq * n_new;
        int32_t *seq = malloc((size_t)n_tok * sizeof *seq),
                *pos = malloc((size_t)n_tok * sizeof *pos);
        for (int t = 0; t < n_tok; t++) {
            seq[t] = t / n_new;
            pos[t] = len - n_new + t % n_new - (seq[t] ? 1 : 0); /* sequence 1 is one shorter */
        }
        size_t nq = (size_t)n_tok * n_head * d;
        float *q = rand_floats(nq), *ot = malloc(nq * sizeof(float)),
              *orf = malloc(nq * sizeof(float));
        for (size_t i = 0; i < nq; i++)
            q[i] *= 3.0f;
        struct moe_attn_params ap = {
            .q = q,
            .out = ot,
            .k_cache = kc,
            .v_cache = vc,
            .tok_seq = seq,
            .tok_pos = pos,
            .block_tables = bt,
            .max_blocks = max_blocks,
            .n_tok = n_tok,
            .n_head = n_head,
            .n_kv_head = nkv,
            .d_head = d,
            .block_size = bs,
            .scale = 1.0f / sqrtf((float)d),
        };
        bool tiled = cpu_attention_tiled_supported(&ap);
        CHECKF(tiled == (cases[c].rep <= 64), "case %zu: tiled supported %d", c, tiled);
        n_tiled += tiled;
        cpu_attention(g_pool, &ap);
        ap.out = orf;
        cpu_attention_ref(g_pool, &ap);
        double num = 0, den = 1e-30;
        for (size_t i = 0; i < nq; i++) {
            num = fmax(num, fabs((double)ot[i] - orf[i]));
            den = fmax(den, fabs((double)orf[i]));
        }
        double e = num / den;
        CHECKF(e <= 2e-6, "%s case %zu: tiled vs reference rel err %.3g", isa, c, e);
        worst = fmax(worst, e);
        /* BF16 caches: bit for bit F32 caches holding the same rounded values */
        const size_t n_cache = (size_t)n_block * bs * kv_dim;
        uint16_t *kb = malloc(n_cache * sizeof *kb), *vb = malloc(n_cache * sizeof *vb);
        for (size_t i = 0; i < n_cache; i++) {
            kb[i] = moe_f32_to_bf16(kc[i]);
            vb[i] = moe_f32_to_bf16(vc[i]);
            kc[i] = moe_bf16_to_f32(kb[i]);
            vc[i] = moe_bf16_to_f32(vb[i]);
        }
        struct moe_attn_params ab = ap;
        float *obf = malloc(nq * sizeof(float));
        ab.k_cache = kb;
        ab.v_cache = vb;
        ab.kv_dtype = MOE_DTYPE_BF16;
        ab.out = obf;
        cpu_attention(g_pool, &ab);
        cpu_attention(g_pool, &ap); /* ap: the rounded F32 caches, into orf */
        CHECKF(memcmp(obf, orf, nq * sizeof(float)) == 0,
               "%s case %zu: tiled attention over BF16 caches differs from F32 caches of the "
               "same values",
               isa, c);
        /* a sequence with more tokens than a task's group has its rows widened once for the
         * call; the same bits with no copies, and with a copy for the first sequence only (the
         * second, one position shorter, is over the limit) */
        const size_t ld = (size_t)(d + 15) / 16 * 16, first = (size_t)len * nkv * 2 * ld;
        const size_t limits[2] = {0, first};
        for (int l = 0; l < 2; l++) {
            const size_t was = cpu_attention_tiled_wide_limit(limits[l]);
            ab.out = ot;
            cpu_attention(g_pool, &ab);
            cpu_attention_tiled_wide_limit(was);
            CHECKF(memcmp(obf, ot, nq * sizeof(float)) == 0,
                   "%s case %zu: BF16 attention with %zu floats of widened rows differs", isa, c,
                   limits[l]);
        }
        keep[c] = obf;
        free(kb);
        free(vb);
        ap.out = ot;
        /* each token alone (over the rounded caches: against orf) */
        float *o1 = malloc((size_t)n_head * d * sizeof(float));
        for (int t = 0; t < n_tok; t += 5) {
            struct moe_attn_params a1 = ap;
            a1.q = q + (size_t)t * n_head * d;
            a1.out = o1;
            a1.tok_seq = seq + t;
            a1.tok_pos = pos + t;
            a1.n_tok = 1;
            cpu_attention(g_pool, &a1);
            differ +=
                memcmp(o1, orf + (size_t)t * n_head * d, (size_t)n_head * d * sizeof(float)) != 0;
        }
        free(o1);
        free(bt);
        free(kc);
        free(vc);
        free(seq);
        free(pos);
        free(q);
        free(ot);
        free(orf);
    }
    CHECKF(differ == 0, "%s: %d tokens differ alone vs in their batch", isa, differ);
    printf("%s attention tiled: %d of %zu cases tiled, worst rel err vs reference %.3g, tokens "
           "alone bit-identical to batched, BF16 caches to F32 of the same values\n",
           isa, n_tiled, sizeof cases / sizeof cases[0], worst);
#undef cases
}

/* A decode step's attention (one token per sequence, many sequences, a
 * BF16 cache; a task per sequence with every KV head when each head's
 * rows fit an AVX2 vector, on AVX-512 four heads a vector when they fit 4
 * lanes) against the reference, and each token alone (a task per KV head)
 * bit for bit the same. Sequences of 1 to 300 positions (inside one chunk,
 * ending mid-chunk, several chunks), blocks scattered; GQA 1 (8 KV heads)
 * to 8; heads of 24 to 128 (a last pass of 8 columns; on AVX-512 two passes
 * of 64, three vectors of 16); 3 KV heads (a padding head in the vector),
 * 3 rows a head (padding rows). */
static const struct {
    int n_kv_head, rep, d_head, block_size;
} g_decode_cases[] = {{4, 4, 64, 16}, {2, 8, 128, 16}, {8, 1, 64, 5},  {2, 3, 40, 7},
                      {3, 2, 24, 16}, {3, 3, 48, 7},   {2, 2, 128, 16}};
#define N_DECODE_CASES (sizeof g_decode_cases / sizeof g_decode_cases[0])

/* keep[c]: each case's batch output (malloc'd), for the AVX2 / AVX-512
 * comparison. */
static void test_attention_decode_batch(const char *isa, float *keep[N_DECODE_CASES])
{
#define cases g_decode_cases
    test_rng_seed(&g_rng, 0xdec0de);
    double worst = 0;
    int differ = 0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int nkv = cases[c].n_kv_head, n_head = nkv * cases[c].rep, d = cases[c].d_head;
        const int bs = cases[c].block_size, n_seq = 9, max_len = 300, kv_dim = nkv * d;
        static const int lens[9] = {1, 2, 63, 64, 65, 130, 200, 299, 300};
        const int max_blocks = (max_len + bs - 1) / bs, n_block = n_seq * max_blocks;
        int32_t *bt = malloc((size_t)n_block * sizeof *bt);
        for (int b = 0; b < n_block; b++)
            bt[b] = (int32_t)(((int64_t)b * 37) % n_block); /* scattered (37 and n_block coprime) */
        const size_t n_cache = (size_t)n_block * bs * kv_dim;
        uint16_t *kb = malloc(n_cache * sizeof *kb), *vb = malloc(n_cache * sizeof *vb);
        for (size_t i = 0; i < n_cache; i++) {
            kb[i] = moe_f32_to_bf16(test_rng_float(&g_rng) * 2.0f - 1.0f);
            vb[i] = moe_f32_to_bf16(test_rng_float(&g_rng) * 2.0f - 1.0f);
        }
        int32_t seq[9], pos[9];
        for (int t = 0; t < n_seq; t++) {
            seq[t] = t;
            pos[t] = lens[t] - 1;
        }
        const size_t nq = (size_t)n_seq * n_head * d;
        float *q = rand_floats(nq), *ob = malloc(nq * sizeof(float)),
              *orf = malloc(nq * sizeof(float)), *o1 = malloc(nq * sizeof(float));
        for (size_t i = 0; i < nq; i++)
            q[i] *= 3.0f;
        struct moe_attn_params ap = {
            .q = q,
            .out = ob,
            .k_cache = kb,
            .v_cache = vb,
            .kv_dtype = MOE_DTYPE_BF16,
            .tok_seq = seq,
            .tok_pos = pos,
            .block_tables = bt,
            .max_blocks = max_blocks,
            .n_tok = n_seq,
            .n_head = n_head,
            .n_kv_head = nkv,
            .d_head = d,
            .block_size = bs,
            .scale = 1.0f / sqrtf((float)d),
        };
        cpu_attention(g_pool, &ap);
        ap.out = orf;
        cpu_attention_ref(g_pool, &ap);
        double num = 0, den = 1e-30;
        for (size_t i = 0; i < nq; i++) {
            num = fmax(num, fabs((double)ob[i] - orf[i]));
            den = fmax(den, fabs((double)orf[i]));
        }
        CHECKF(num / den <= 2e-6, "%s decode case %zu: rel err %.3g vs reference", isa, c,
               num / den);
        worst = fmax(worst, num / den);
        for (int t = 0; t < n_seq; t++) {
            struct moe_attn_params a1 = ap;
            a1.q = q + (size_t)t * n_head * d;
            a1.out = o1 + (size_t)t * n_head * d;
            a1.tok_seq = seq + t;
            a1.tok_pos = pos + t;
            a1.n_tok = 1;
            cpu_attention(g_pool, &a1);
        }
        differ += memcmp(o1, ob, nq * sizeof(float)) != 0;
        keep[c] = ob;
        free(bt);
        free(kb);
        free(vb);
        free(q);
        free(orf);
        free(o1);
    }
    CHECKF(differ == 0, "%s: %d decode cases differ between the batch and tokens alone", isa,
           differ);
    printf("%s attention decode batch: %zu cases, worst rel err vs reference %.3g, tokens alone "
           "bit-identical to the batch\n",
           isa, sizeof cases / sizeof cases[0], worst);
#undef cases
}

/* The AVX2 tiles do, lane for lane, the AVX-512 tiles' operations in the
 * same order (exp_avx2 is exp_avx512 bit for bit), so their outputs are
 * identical: checked where the processor has both. */
static void test_attention_tiled_isas_agree(float *a2[N_TILED_CASES], float *a5[N_TILED_CASES],
                                            float *d2[N_DECODE_CASES], float *d5[N_DECODE_CASES])
{
    int differ = 0;
    for (size_t c = 0; c < N_TILED_CASES; c++) {
        const int n_head = g_tiled_cases[c].n_kv_head * g_tiled_cases[c].rep;
        size_t nq = (size_t)2 * g_tiled_cases[c].n_new * n_head * g_tiled_cases[c].d_head;
        differ += memcmp(a2[c], a5[c], nq * sizeof(float)) != 0;
    }
    for (size_t c = 0; c < N_DECODE_CASES; c++) {
        const int n_head = g_decode_cases[c].n_kv_head * g_decode_cases[c].rep;
        size_t nq = (size_t)9 * n_head * g_decode_cases[c].d_head;
        differ += memcmp(d2[c], d5[c], nq * sizeof(float)) != 0;
    }
    CHECKF(differ == 0, "tiled attention: %d cases differ between AVX2 and AVX-512", differ);
    printf("attention tiled: avx2 and avx512 bit-identical in %zu tiled and %zu decode cases\n",
           N_TILED_CASES, N_DECODE_CASES);
}

/* A two-sequence case for the fast-mode attention tests: random K and V (V
 * times v_scale) in f32 and bf16 caches whose blocks are in reverse order,
 * the last n_new tokens of each sequence (sequence 1 one shorter), q times
 * 3; p over the bf16 (or f32) cache, fast on, out unset. */
struct fast_attn_case {
    struct moe_attn_params p;
    int32_t *bt, *seq, *pos;
    float *kf, *vf, *q;
    uint16_t *kb, *vb;
    size_t nq; /* floats of q and of an output */
};

static void fast_attn_case_make(struct fast_attn_case *fc, int nkv, int rep, int d, int bs, int len,
                                int n_new, bool bf16, float v_scale)
{
    const int n_head = nkv * rep, kv_dim = nkv * d, n_seq = 2;
    const int max_blocks = (len + bs - 1) / bs, n_block = n_seq * max_blocks;
    fc->bt = malloc((size_t)n_block * sizeof *fc->bt);
    for (int b = 0; b < n_block; b++)
        fc->bt[b] = n_block - 1 - b;
    const size_t n_cache = (size_t)n_block * bs * kv_dim;
    fc->kf = rand_floats(n_cache);
    fc->vf = rand_floats(n_cache);
    fc->kb = malloc(n_cache * 2);
    fc->vb = malloc(n_cache * 2);
    for (size_t i = 0; i < n_cache; i++) {
        fc->vf[i] *= v_scale;
        fc->kb[i] = moe_f32_to_bf16(fc->kf[i]);
        fc->vb[i] = moe_f32_to_bf16(fc->vf[i]);
    }
    const int n_tok = n_seq * n_new;
    fc->seq = malloc((size_t)n_tok * sizeof *fc->seq);
    fc->pos = malloc((size_t)n_tok * sizeof *fc->pos);
    for (int t = 0; t < n_tok; t++) {
        fc->seq[t] = t / n_new;
        fc->pos[t] = len - n_new + t % n_new - (fc->seq[t] ? 1 : 0);
    }
    fc->nq = (size_t)n_tok * n_head * d;
    fc->q = rand_floats(fc->nq);
    for (size_t i = 0; i < fc->nq; i++)
        fc->q[i] *= 3.0f;
    fc->p = (struct moe_attn_params){
        .q = fc->q,
        .k_cache = bf16 ? (const void *)fc->kb : (const void *)fc->kf,
        .v_cache = bf16 ? (const void *)fc->vb : (const void *)fc->vf,
        .kv_dtype = bf16 ? MOE_DTYPE_BF16 : MOE_DTYPE_F32,
        .tok_seq = fc->seq,
        .tok_pos = fc->pos,
        .block_tables = fc->bt,
        .max_blocks = max_blocks,
        .n_tok = n_tok,
        .n_head = n_head,
        .n_kv_head = nkv,
        .d_head = d,
        .block_size = bs,
        .scale = 1.0f / sqrtf((float)d),
        .fast = true,
    };
}

/* K rows at positions [0, pos_end) of both sequences (every position past
 * the last) times k_scale, in the f32 and the bf16 cache. */
static void fast_attn_case_scale_k(struct fast_attn_case *fc, int pos_end, float k_scale)
{
    const struct moe_attn_params *p = &fc->p;
    const size_t kv_dim = (size_t)p->n_kv_head * p->d_head;
    if (pos_end > p->max_blocks * p->block_size)
        pos_end = p->max_blocks * p->block_size;
    for (int s = 0; s < 2; s++)
        for (int pos = 0; pos < pos_end; pos++) {
            const size_t slot =
                (size_t)fc->bt[s * p->max_blocks + pos / p->block_size] * p->block_size +
                pos % p->block_size;
            for (size_t i = slot * kv_dim; i < (slot + 1) * kv_dim; i++) {
                fc->kf[i] *= k_scale;
                fc->kb[i] = moe_f32_to_bf16(fc->kf[i]);
            }
        }
}

static void fast_attn_case_free(struct fast_attn_case *fc)
{
    free(fc->bt);
    free(fc->seq);
    free(fc->pos);
    free(fc->kf);
    free(fc->vf);
    free(fc->q);
    free(fc->kb);
    free(fc->vb);
}

/* The case's fast output, the f32 reference and the f32 tiles' output
 * (fast off), through cpu_attention (dispatch) or cpu_attention_tiled. */
static void fast_attn_case_run(const struct fast_attn_case *fc, bool dispatch, float *fast,
                               float *ref, float *exact)
{
    void (*attn)(struct moe_threadpool *, const struct moe_attn_params *) =
        dispatch ? cpu_attention : cpu_attention_tiled;
    struct moe_attn_params a = fc->p;
    a.out = fast;
    attn(g_pool, &a);
    a.fast = false;
    a.out = ref;
    cpu_attention_ref(g_pool, &a);
    a.out = exact;
    attn(g_pool, &a);
}

/* max |a - b| / max |b| over n floats (NaN propagates) */
static double max_rel_err_f(const float *a, const float *b, size_t n)
{
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]);
        if (!(e <= num))
            num = e;
        den = fmax(den, fabs((double)b[i]));
    }
    return num / den;
}

/* Fast-mode attention with fp16 P V (AVX512-FP16 without AMX, attention_tiled.c):
 * prefill-sized calls over BF16 and F32 caches held to the f32 reference
 * within 1e-2 of max |ref| (random data reach ~6e-3) and not equal to the
 * f32 tiles (the path ran); d_v not a multiple of 32, --batch-invariant, and
 * chunks whose V holds values beyond FA_PH_MAX_V give the f32 tiles bit for
 * bit. Over a BF16 cache, sequences widened for the call (more tokens than
 * a task's rows) also take fp16 scores and softmax: their output differs
 * from the same call without the wide copies (f32 scores, fp16 P V only);
 * where every chunk's score bound trips (K times 40000) the two are equal
 * bit for bit, and where only the first 256 positions' chunks trip (their
 * m beyond fp16, later chunks fp16) they agree to 1e-6. AMX is masked off
 * for the test where the processor has it. */
static void test_attention_fp16_pv(void)
{
    const unsigned have = cpu_kernels_features();
    if (!(have & CPU_FEAT_AVX512_FP16)) {
        printf("SKIPPED: attention fp16 P V: this processor lacks AVX512-FP16\n");
        return;
    }
    cpu_kernels_force_features(have & ~(unsigned)(CPU_FEAT_AMX_BF16 | CPU_FEAT_AMX_INT8));
    enum { F32_TILES, FP16, FP16_SCORES, SCORES_TRIP, FIRST_TRIP };
    static const struct {
        int n_kv_head, rep, d_head, block_size, seq_len, n_new, kv_bf16;
        float v_scale;
        int path;  /* what the fast call takes */
        int k_big; /* K of positions below it times 40000 */
    } cases[] = {
        {4, 4, 64, 16, 300, 40, 1, 1.0f, FP16_SCORES, 0},
        {2, 8, 128, 16, 200, 70, 1, 1.0f, FP16_SCORES, 0}, /* two score segments */
        {1, 16, 32, 32, 129, 128, 0, 1.0f, FP16, 0},       /* F32 cache: fp16 P V only */
        {2, 2, 96, 16, 90, 64, 1, 1.0f, FP16_SCORES, 0},
        {2, 3, 64, 16, 200, 50, 1, 1.0f, FP16_SCORES, 0},  /* 63 rows a task */
        {2, 4, 48, 16, 100, 33, 1, 1.0f, F32_TILES, 0},    /* d_v 48: not a multiple of 32 */
        {4, 4, 64, 16, 150, 40, 1, 2048.0f, F32_TILES, 0}, /* |v| up to 2048: the f32 P V */
        {4, 4, 64, 16, 300, 40, 1, 1.0f, SCORES_TRIP, 1 << 20},
        {2, 4, 64, 16, 600, 64, 1, 1.0f, FIRST_TRIP, 256},
    };
    double worst = 0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        struct fast_attn_case fc;
        fast_attn_case_make(&fc, cases[c].n_kv_head, cases[c].rep, cases[c].d_head,
                            cases[c].block_size, cases[c].seq_len, cases[c].n_new, cases[c].kv_bf16,
                            cases[c].v_scale);
        if (cases[c].k_big)
            fast_attn_case_scale_k(&fc, cases[c].k_big, 40000.0f);
        const size_t nq = fc.nq;
        float *of = malloc(nq * sizeof(float)), *orf = malloc(nq * sizeof(float)),
              *oe = malloc(nq * sizeof(float)), *oi = malloc(nq * sizeof(float)),
              *on = malloc(nq * sizeof(float));
        fast_attn_case_run(&fc, false, of, orf, oe);
        struct moe_attn_params ai = fc.p;
        ai.out = oi;
        ai.batch_invariant = true;
        cpu_attention_tiled(g_pool, &ai);
        CHECKF(memcmp(oi, oe, nq * sizeof(float)) == 0,
               "fp16 P V case %zu: batch_invariant differs from the f32 tiles", c);
        struct moe_attn_params an = fc.p; /* no wide copies: f32 scores, fp16 P V */
        an.out = on;
        const size_t was = cpu_attention_tiled_wide_limit(0);
        cpu_attention_tiled(g_pool, &an);
        cpu_attention_tiled_wide_limit(was);
        const bool same = memcmp(of, oe, nq * sizeof(float)) == 0;
        const bool same_nowide = memcmp(of, on, nq * sizeof(float)) == 0;
        double e = max_rel_err_f(of, orf, nq);
        switch (cases[c].path) {
        case F32_TILES:
            CHECKF(same,
                   "fp16 P V case %zu: fast differs from the f32 tiles where it must not apply", c);
            break;
        case FP16:
        case FP16_SCORES:
            CHECKF(!same, "fp16 P V case %zu: fast gave the f32 tiles' bits (path not taken)", c);
            CHECKF(e <= 1e-2, "fp16 P V case %zu: max err %.3g of max |ref|", c, e);
            CHECKF(same_nowide == (cases[c].path == FP16), "fp16 P V case %zu: fp16 scores %s", c,
                   same_nowide ? "not taken (same bits as without wide copies)"
                               : "taken where they must not be");
            worst = fmax(worst, e);
            break;
        case SCORES_TRIP:
            CHECKF(same_nowide,
                   "fp16 P V case %zu: every chunk's bound trips, yet the output differs from the "
                   "f32 scores' (err %.3g of max |ref|)",
                   c, e);
            break;
        case FIRST_TRIP: {
            const double d = max_rel_err_f(of, on, nq);
            CHECKF(d <= 1e-6,
                   "fp16 P V case %zu: f32-score chunks then fp16 ones: %.3g of max |out| from the "
                   "f32 scores' output",
                   c, d);
            break;
        }
        }
        fast_attn_case_free(&fc);
        free(of);
        free(orf);
        free(oe);
        free(oi);
        free(on);
    }
    cpu_kernels_force_features(have);
    printf(
        "attention fp16 P V and scores: %zu cases, worst err %.3g of max |ref| (tolerance 1e-2); "
        "d_v 48, batch-invariant and |v| > 512 take the f32 tiles bit for bit; score bounds "
        "beyond %s take the f32 scores\n",
        sizeof cases / sizeof cases[0], worst, "FA_PH_MAX_S");
}

/* Fast-mode attention on AMX (p->fast over a BF16 cache, attention_tiled.c):
 * held to the f32 reference over the same cache within the tolerance of
 * rounding q and the probabilities to bf16 (max |out - ref| <= 2e-2 of
 * max |ref|; random data reach ~3e-3), each token alone bit-identical to
 * the same token in its batch, and fast = false still the f32 kernel bit for
 * bit. Blocks of 16 and 32 slots, d 32 .. 128, GQA 1 .. 64, sequences
 * shorter than a chunk, ending mid-chunk, several chunks long. */
static void test_attention_amx(void)
{
    if (!(cpu_kernels_features() & CPU_FEAT_AMX_BF16)) {
        printf("SKIPPED: attention amx-bf16: this processor (or its OS) lacks AMX-BF16\n");
        return;
    }
    static const struct {
        int n_kv_head, rep, d_head, block_size, seq_len, n_new;
    } cases[] = {
        {4, 4, 64, 16, 300, 40},   {2, 8, 128, 16, 200, 17}, {1, 64, 32, 32, 70, 3},
        {1, 16, 64, 16, 129, 128}, {2, 1, 96, 32, 65, 64},   {3, 2, 64, 16, 9, 8},
    }; /* n_new < seq_len: sequence 1 (one shorter) starts at position 0 */
    double worst = 0;
    int differ = 0, exact_differ = 0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        struct fast_attn_case fc;
        fast_attn_case_make(&fc, cases[c].n_kv_head, cases[c].rep, cases[c].d_head,
                            cases[c].block_size, cases[c].seq_len, cases[c].n_new, true, 1.0f);
        const size_t nq = fc.nq;
        const int n_head = fc.p.n_head, d = fc.p.d_head, n_tok = fc.p.n_tok;
        float *oa = malloc(nq * sizeof(float)), *orf = malloc(nq * sizeof(float)),
              *oe = malloc(nq * sizeof(float)), *ot = malloc(nq * sizeof(float));
        fast_attn_case_run(&fc, true, oa, orf, oe); /* oe: fast = false, the f32 tiles */
        struct moe_attn_params ar = fc.p;
        ar.fast = false;
        ar.out = ot;
        cpu_attention_tiled(NULL, &ar);
        exact_differ += memcmp(oe, ot, nq * sizeof(float)) != 0;
        double e = max_rel_err_f(oa, orf, nq);
        CHECKF(e <= 2e-2, "amx attention case %zu: max err %.3g of max |ref|", c, e);
        worst = fmax(worst, e);
        float *o1 = malloc((size_t)n_head * d * sizeof(float));
        for (int t = 0; t < n_tok; t += 3) {
            struct moe_attn_params a1 = fc.p;
            a1.q = fc.q + (size_t)t * n_head * d;
            a1.out = o1;
            a1.tok_seq = fc.seq + t;
            a1.tok_pos = fc.pos + t;
            a1.n_tok = 1;
            cpu_attention(g_pool, &a1);
            differ +=
                memcmp(o1, oa + (size_t)t * n_head * d, (size_t)n_head * d * sizeof(float)) != 0;
        }
        free(o1);
        fast_attn_case_free(&fc);
        free(oa);
        free(orf);
        free(oe);
        free(ot);
    }
    CHECKF(differ == 0, "amx attention: %d tokens differ alone vs in their batch", differ);
    CHECKF(exact_differ == 0, "amx attention: fast = false differs from the f32 tiles in %d cases",
           exact_differ);
    printf("attention amx-bf16: %zu cases, worst err %.3g of max |ref| (tolerance 2e-2), tokens "
           "alone bit-identical to batched\n",
           sizeof cases / sizeof cases[0], worst);
}

/* Latent attention (multi-head latent attention's cache): one row of
 * d = L + R per token that is K whole and, in its first d_v = L elements, V
 * (v_cache == k_cache); heads wider than the tiled kernel's 8-vector PV pass.
 * Both kernels against a double reference, F32 and BF16 caches (BF16: bit
 * for bit the F32 cache of the rounded values), a token alone bit-identical
 * to the same token in its batch. */
static void test_attention_latent(void)
{
    static const struct {
        int L, R, rep, len, n_new;
    } cases[] = {
        {32, 16, 4, 70, 9}, {256, 64, 16, 150, 33}, {512, 64, 16, 90, 1}, {100, 12, 3, 40, 40}};
    double worst = 0;
    int differ = 0, bf_differ = 0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int d = cases[c].L + cases[c].R, dv = cases[c].L, H = cases[c].rep;
        const int bs = 16, len = cases[c].len, n_new = cases[c].n_new;
        const int max_blocks = (len + bs - 1) / bs;
        int32_t *bt = malloc((size_t)max_blocks * sizeof *bt);
        for (int b = 0; b < max_blocks; b++)
            bt[b] = max_blocks - 1 - b;
        size_t n_slot = (size_t)max_blocks * bs;
        float *kc = rand_floats(n_slot * d);
        uint16_t *kb = malloc(n_slot * d * sizeof *kb);
        for (size_t i = 0; i < n_slot * d; i++) { /* the F32 cache holds bf16 values */
            kb[i] = moe_f32_to_bf16(kc[i]);
            kc[i] = moe_bf16_to_f32(kb[i]);
        }
        int32_t *seq = calloc((size_t)n_new, sizeof *seq), *pos = malloc((size_t)n_new * 4);
        for (int t = 0; t < n_new; t++)
            pos[t] = len - n_new + t;
        size_t nq = (size_t)n_new * H * d, no = (size_t)n_new * H * dv;
        float *q = rand_floats(nq), *out = malloc(no * 4), *out_ref = malloc(no * 4),
              *out_bf = malloc(no * 4);
        for (size_t i = 0; i < nq; i++)
            q[i] *= 2.0f;
        double *ref = calloc(no, sizeof *ref);
        const float scale = 1.0f / sqrtf((float)d);
        for (int t = 0; t < n_new; t++)
            for (int h = 0; h < H; h++) {
                const float *qq = q + ((size_t)t * H + h) * d;
                double *sc = malloc((size_t)(pos[t] + 1) * sizeof *sc), mx = -INFINITY, sum = 0;
                for (int p = 0; p <= pos[t]; p++) {
                    const float *kk = kc + ((size_t)bt[p / bs] * bs + p % bs) * d;
                    double dot = 0;
                    for (int i = 0; i < d; i++)
                        dot += (double)qq[i] * kk[i];
                    sc[p] = dot * scale;
                    mx = fmax(mx, sc[p]);
                }
                for (int p = 0; p <= pos[t]; p++)
                    sum += exp(sc[p] - mx);
                double *o = ref + ((size_t)t * H + h) * dv;
                for (int p = 0; p <= pos[t]; p++) {
                    const float *vv = kc + ((size_t)bt[p / bs] * bs + p % bs) * d;
                    for (int i = 0; i < dv; i++)
                        o[i] += exp(sc[p] - mx) / sum * vv[i];
                }
                free(sc);
            }
        struct moe_attn_params ap = {.q = q,
                                     .out = out,
                                     .k_cache = kc,
                                     .v_cache = kc,
                                     .tok_seq = seq,
                                     .tok_pos = pos,
                                     .block_tables = bt,
                                     .max_blocks = max_blocks,
                                     .n_tok = n_new,
                                     .n_head = H,
                                     .n_kv_head = 1,
                                     .d_head = d,
                                     .block_size = bs,
                                     .scale = scale,
                                     .d_v = dv};
        cpu_attention(g_pool, &ap);
        ap.out = out_ref;
        cpu_attention_ref(g_pool, &ap);
        double e = fmax(max_rel_err(out, ref, no), max_rel_err(out_ref, ref, no));
        CHECKF(e < 1e-5, "latent attention L %d R %d heads %d: err %.3g vs double", dv, cases[c].R,
               H, e);
        worst = fmax(worst, e);
        /* BF16 cache of the same values: the same bits, both kernels */
        ap.k_cache = ap.v_cache = kb;
        ap.kv_dtype = MOE_DTYPE_BF16;
        ap.out = out_bf;
        cpu_attention(g_pool, &ap);
        bf_differ += memcmp(out_bf, out, no * 4) != 0;
        cpu_attention_ref(g_pool, &ap);
        bf_differ += memcmp(out_bf, out_ref, no * 4) != 0;
        /* the last token alone */
        ap.k_cache = ap.v_cache = kc;
        ap.kv_dtype = MOE_DTYPE_F32;
        ap.q = q + (size_t)(n_new - 1) * H * d;
        ap.tok_seq = seq + n_new - 1;
        ap.tok_pos = pos + n_new - 1;
        ap.n_tok = 1;
        ap.out = out_bf;
        cpu_attention(g_pool, &ap);
        differ += memcmp(out_bf, out + (size_t)(n_new - 1) * H * dv, (size_t)H * dv * 4) != 0;
        free(bt);
        free(kc);
        free(kb);
        free(seq);
        free(pos);
        free(q);
        free(out);
        free(out_ref);
        free(out_bf);
        free(ref);
    }
    CHECKF(bf_differ == 0, "latent attention: %d BF16 runs differ from F32 of the same values",
           bf_differ);
    CHECKF(differ == 0, "latent attention: %d lone tokens differ from their batch", differ);
    printf("latent attention (K = V row, d up to 576): worst rel err %.3g vs double\n", worst);
}

/* ---- router ---- */

static void test_router(void)
{
    int bad_ids = 0;
    double worst = 0.0;
    for (int c = 0; c < 60; c++) {
        int n_expert = test_rng_int(&g_rng, 1, 64), top_k = test_rng_int(&g_rng, 1, n_expert),
            n_tok = test_rng_int(&g_rng, 1, 7);
        bool renorm = c % 2;
        bool ties = c % 3 == 0; /* logits from a handful of values: many ties */
        float *logits = malloc((size_t)n_tok * n_expert * sizeof(float));
        for (int i = 0; i < n_tok * n_expert; i++)
            logits[i] =
                ties ? (float)test_rng_int(&g_rng, -2, 2) * 0.5f : test_rng_float(&g_rng) * 4.0f;
        int32_t *ids = malloc((size_t)n_tok * top_k * sizeof(int32_t));
        float *w = malloc((size_t)n_tok * top_k * sizeof(float));
        g_cpu->ops->router_topk(g_cpu, logits, n_tok, n_expert, top_k, renorm, ids, w);
        for (int t = 0; t < n_tok; t++) {
            const float *x = logits + (size_t)t * n_expert;
            double mx = -INFINITY, sum = 0, ksum = 0;
            for (int e = 0; e < n_expert; e++)
                mx = fmax(mx, x[e]);
            for (int e = 0; e < n_expert; e++)
                sum += exp(x[e] - mx);
            /* Reference order: descending logit, ties to the lower id. */
            int32_t order[64];
            for (int e = 0; e < n_expert; e++)
                order[e] = e;
            for (int i = 1; i < n_expert; i++) /* insertion sort, stable */
                for (int j = i; j > 0 && x[order[j]] > x[order[j - 1]]; j--) {
                    int32_t tmp = order[j];
                    order[j] = order[j - 1];
                    order[j - 1] = tmp;
                }
            for (int k = 0; k < top_k; k++)
                ksum += exp(x[order[k]] - mx) / sum;
            for (int k = 0; k < top_k; k++) {
                bad_ids += ids[t * top_k + k] != order[k];
                double ref = exp(x[order[k]] - mx) / sum / (renorm ? ksum : 1.0);
                worst = fmax(worst, fabs(w[t * top_k + k] - ref) / ref);
            }
        }
        free(logits);
        free(ids);
        free(w);
    }
    CHECKF(bad_ids == 0, "router: %d expert ids differ from the reference order", bad_ids);
    CHECKF(worst < 2e-6, "router: weight err %.3g", worst);
    printf("router: worst weight err %.3g\n", worst);
}

/* DeepSeek-V3's grouped sigmoid routing: a hand case where the best expert's
 * group is dropped, then random cases against a reference that ranks by
 * sorting (doubles), groups of 2..8, with and without renormalisation. */
static void test_router_grouped(void)
{
    /* choice scores c = sigmoid(0) + bias: group 0 {0.95, 0.01} sums 0.96,
     * group 1 {0.6, 0.55} 1.15, group 2 {0.52, 0.45} 0.97, group 3 {0.3, 0.2};
     * with 2 groups kept the best expert (0) is out: experts 2 and 3 */
    float logits[8] = {0, 0, 0.4f, -0.4f, 0, 0, 0, 0}, bias[8];
    const float c[8] = {0.95f, 0.01f, 0.6f, 0.55f, 0.52f, 0.45f, 0.3f, 0.2f};
    for (int e = 0; e < 8; e++)
        bias[e] = c[e] - 1.0f / (1.0f + expf(-logits[e]));
    int32_t ids[2];
    float w[2];
    struct moe_router_grouped_params p = {.logits = logits,
                                          .bias = bias,
                                          .n_tok = 1,
                                          .n_expert = 8,
                                          .top_k = 2,
                                          .n_group = 4,
                                          .topk_group = 2,
                                          .renorm = true,
                                          .scale = 2.5f,
                                          .ids = ids,
                                          .weights = w};
    g_cpu->ops->router_topk_grouped(g_cpu, &p);
    double s2 = 1 / (1 + exp(-0.4)), s3 = 1 / (1 + exp(0.4)); /* weights are the scores */
    CHECKF(ids[0] == 2 && ids[1] == 3, "grouped router picked %d, %d (want 2, 3)", ids[0], ids[1]);
    CHECKF(fabs(w[0] - 2.5 * s2 / (s2 + s3)) < 1e-6 && fabs(w[1] - 2.5 * s3 / (s2 + s3)) < 1e-6,
           "grouped router weights %g %g", w[0], w[1]);
    p.topk_group = 4; /* every group: expert 0 is back */
    g_cpu->ops->router_topk_grouped(g_cpu, &p);
    CHECKF(ids[0] == 0 && ids[1] == 2, "all groups: picked %d, %d (want 0, 2)", ids[0], ids[1]);

    int bad = 0;
    double worst = 0;
    for (int k = 0; k < 80; k++) {
        int G = test_rng_int(&g_rng, 1, 8), per = test_rng_int(&g_rng, 2, 8), E = G * per;
        int tg = test_rng_int(&g_rng, 1, G), top_k = test_rng_int(&g_rng, 1, tg * per);
        int n_tok = test_rng_int(&g_rng, 1, 5);
        float *x = rand_floats((size_t)n_tok * E), *b = rand_floats((size_t)E);
        for (int e = 0; e < E; e++)
            b[e] *= 0.3f;
        int32_t *id = malloc((size_t)n_tok * top_k * sizeof *id);
        float *wt = malloc((size_t)n_tok * top_k * sizeof *wt);
        struct moe_router_grouped_params q = {.logits = x,
                                              .bias = b,
                                              .n_tok = n_tok,
                                              .n_expert = E,
                                              .top_k = top_k,
                                              .n_group = G,
                                              .topk_group = tg,
                                              .renorm = k % 2,
                                              .scale = 1.5f,
                                              .ids = id,
                                              .weights = wt};
        g_cpu->ops->router_topk_grouped(g_cpu, &q);
        for (int t = 0; t < n_tok; t++) {
            double sc[64], ch[64], gs[8];
            int gord[8], ord[64], n_ok = 0;
            for (int e = 0; e < E; e++) {
                sc[e] = 1.0 / (1.0 + exp(-(double)x[t * E + e]));
                ch[e] = sc[e] + b[e];
            }
            for (int g = 0; g < G; g++) { /* sum of the two best in the group */
                double v[8];
                for (int i = 0; i < per; i++)
                    v[i] = ch[g * per + i];
                for (int i = 0; i < 2; i++)
                    for (int j = i + 1; j < per; j++)
                        if (v[j] > v[i]) {
                            double tmp = v[i];
                            v[i] = v[j];
                            v[j] = tmp;
                        }
                gs[g] = v[0] + v[1];
                gord[g] = g;
            }
            for (int i = 1; i < G; i++) /* stable insertion sort, descending */
                for (int j = i; j > 0 && gs[gord[j]] > gs[gord[j - 1]]; j--) {
                    int tmp = gord[j];
                    gord[j] = gord[j - 1];
                    gord[j - 1] = tmp;
                }
            for (int e = 0; e < E; e++) {
                bool kept = false;
                for (int i = 0; i < tg; i++)
                    kept |= e / per == gord[i];
                if (kept)
                    ord[n_ok++] = e;
            }
            for (int i = 1; i < n_ok; i++)
                for (int j = i; j > 0 && ch[ord[j]] > ch[ord[j - 1]]; j--) {
                    int tmp = ord[j];
                    ord[j] = ord[j - 1];
                    ord[j - 1] = tmp;
                }
            double sum = 0;
            for (int i = 0; i < top_k; i++)
                sum += sc[ord[i]];
            for (int i = 0; i < top_k; i++) {
                bad += id[t * top_k + i] != ord[i];
                double ref = sc[ord[i]] / (q.renorm ? sum : 1.0) * 1.5;
                worst = fmax(worst, fabs(wt[t * top_k + i] - ref) / ref);
            }
        }
        free(x);
        free(b);
        free(id);
        free(wt);
    }
    CHECKF(bad == 0, "grouped router: %d ids differ from the reference", bad);
    CHECKF(worst < 2e-6, "grouped router: weight err %.3g", worst);
    printf("grouped router: hand case and 80 random cases, worst weight err %.3g\n", worst);
}

/* ---- element-wise and row ops ---- */

/* copy_cols: a block of columns between matrices of different row strides. */
static void test_copy_cols(void)
{
    float src[4 * 7], dst[4 * 9];
    for (int i = 0; i < 4 * 7; i++)
        src[i] = (float)i;
    for (int i = 0; i < 4 * 9; i++)
        dst[i] = -1.0f;
    g_cpu->ops->copy_cols(g_cpu, dst + 5, 9, src + 2, 7, 4, 3); /* src cols 2..4 -> dst 5..7 */
    int bad = 0;
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 9; j++)
            bad += dst[r * 9 + j] != (j >= 5 && j < 8 ? src[r * 7 + j - 3] : -1.0f);
    CHECKF(bad == 0, "copy_cols: %d elements wrong", bad);
}

/* swiglu on the given ISA: random rows (masked tails, the pool above its
 * threshold), and the edges: |g| past exp's range both ways, zeros, a NaN. */
static void test_swiglu(const char *isa)
{
    for (int c = 0; c < 7; c++) {
        int n_rows = test_rng_int(&g_rng, 1, 40),
            dim = c == 5 ? 3000 : test_rng_int(&g_rng, 1, 300);
        if (c == 6) {
            n_rows = 1;
            dim = 19;
        }
        float *gu = rand_floats((size_t)n_rows * 2 * dim);
        for (size_t i = 0; i < (size_t)n_rows * 2 * dim; i++)
            gu[i] *= 8.0f;
        static const float edge[18] = {-1000.0f, -104.0f, -100.0f, -89.0f, -88.0f, -87.0f,
                                       -20.0f,   -1e-3f,  -0.0f,   0.0f,   1e-3f,  20.0f,
                                       87.0f,    88.0f,   89.0f,   100.0f, 104.0f, 1000.0f};
        if (c == 6)
            memcpy(gu, edge, sizeof edge); /* gate 18 = the NaN */
        if (c == 6)
            gu[18] = NAN;
        float *out = malloc((size_t)n_rows * dim * sizeof(float));
        double *ref = malloc((size_t)n_rows * dim * sizeof(double));
        for (int r = 0; r < n_rows; r++)
            for (int i = 0; i < dim; i++) {
                double g = gu[(size_t)r * 2 * dim + i], u = gu[(size_t)r * 2 * dim + dim + i];
                ref[(size_t)r * dim + i] = g < -700.0 ? 0.0 * u : g / (1.0 + exp(-g)) * u;
            }
        g_cpu->ops->swiglu(g_cpu, gu, out, n_rows, dim);
        size_t n = (size_t)n_rows * dim - (c == 6); /* the NaN's output checked below */
        double e = max_rel_err(out, ref, n);
        CHECKF(e < 1e-6, "%s swiglu rows %d dim %d: err %.3g", isa, n_rows, dim, e);
        if (c == 6)
            CHECKF(isnan(out[18]), "%s swiglu: a NaN gate gave %g, not NaN", isa, out[18]);
        free(gu);
        free(out);
        free(ref);
    }
}

static void test_elementwise(void)
{
    /* gather_rows, scatter_add_rows (with and without scale) */
    {
        int n_src = 20, n = 12, dim = 33;
        float *src = rand_floats((size_t)n_src * dim);
        int32_t idx[12];
        for (int i = 0; i < n; i++)
            idx[i] = (i * 7 + 3) % n_src; /* distinct */
        float *g = malloc((size_t)n * dim * sizeof(float));
        g_cpu->ops->gather_rows(g_cpu, src, idx, n, dim, g);
        int ok = 1;
        for (int i = 0; i < n; i++)
            ok &= memcmp(g + (size_t)i * dim, src + (size_t)idx[i] * dim, (size_t)dim * 4) == 0;
        CHECK(ok);
        float scale[12];
        for (int i = 0; i < n; i++)
            scale[i] = test_rng_float(&g_rng);
        float *dst = rand_floats((size_t)n_src * dim);
        double *ref = malloc((size_t)n_src * dim * sizeof(double));
        for (int i = 0; i < n_src * dim; i++)
            ref[i] = dst[i];
        for (int i = 0; i < n; i++)
            for (int k = 0; k < dim; k++)
                ref[(size_t)idx[i] * dim + k] += 2.0 * scale[i] * g[(size_t)i * dim + k];
        g_cpu->ops->scatter_add_rows(g_cpu, g, idx, scale, n, dim, dst);
        g_cpu->ops->scatter_add_rows(g_cpu, g, idx, scale, n, dim, dst);
        CHECKF(max_rel_err(dst, ref, (size_t)n_src * dim) < 1e-6, "scatter_add_rows");
        for (int i = 0; i < n_src * dim; i++)
            ref[i] = dst[i];
        for (int i = 0; i < n; i++)
            for (int k = 0; k < dim; k++)
                ref[(size_t)idx[i] * dim + k] += g[(size_t)i * dim + k];
        cpu_scatter_add_rows(g, idx, NULL, n, dim, dst);
        CHECKF(max_rel_err(dst, ref, (size_t)n_src * dim) < 1e-6, "scatter_add_rows scale NULL");
        free(src);
        free(g);
        free(dst);
        free(ref);
    }

    /* embed: f32, bf16, f16 tables */
    {
        int n_vocab = 10, dim = 19, n_tok = 6;
        int32_t ids[6] = {3, 0, 9, 3, 5, 1};
        float *tf = rand_floats((size_t)n_vocab * dim);
        uint16_t *tb = malloc((size_t)n_vocab * dim * 2), *th = malloc((size_t)n_vocab * dim * 2);
        for (int i = 0; i < n_vocab * dim; i++) {
            tb[i] = moe_f32_to_bf16(tf[i]);
            th[i] = (uint16_t)(0x3c00 + (i % 1024)); /* 1.0 + i/1024 */
        }
        th[3 * dim] = 0x8001;     /* -2^-24, subnormal */
        th[3 * dim + 1] = 0x7bff; /* 65504 */
        float out[6 * 19];
        int ok_f = 1, ok_b = 1, ok_h = 1;
        g_cpu->ops->embed(g_cpu, tf, MOE_DTYPE_F32, ids, n_tok, dim, out);
        for (int t = 0; t < n_tok; t++)
            ok_f &= memcmp(out + t * dim, tf + ids[t] * dim, (size_t)dim * 4) == 0;
        g_cpu->ops->embed(g_cpu, tb, MOE_DTYPE_BF16, ids, n_tok, dim, out);
        for (int t = 0; t < n_tok; t++)
            for (int i = 0; i < dim; i++)
                ok_b &= out[t * dim + i] == moe_bf16_to_f32(tb[ids[t] * dim + i]) &&
                        fabsf(out[t * dim + i] - tf[ids[t] * dim + i]) <=
                            fabsf(tf[ids[t] * dim + i]) / 256.0f;
        g_cpu->ops->embed(g_cpu, th, MOE_DTYPE_F16, ids, n_tok, dim, out);
        for (int t = 0; t < n_tok; t++)
            for (int i = 0; i < dim; i++) {
                int j = ids[t] * dim + i;
                float want = 1.0f + (float)(j % 1024) / 1024.0f;
                if (j == 3 * dim)
                    want = -ldexpf(1.0f, -24);
                if (j == 3 * dim + 1)
                    want = 65504.0f;
                ok_h &= out[t * dim + i] == want;
            }
        CHECK(ok_f);
        CHECK(ok_b);
        CHECK(ok_h);
        free(tf);
        free(tb);
        free(th);
    }

    /* add: small (inline) and large (threaded) */
    size_t sizes[] = {1, 17, 1000003};
    for (int c = 0; c < 3; c++) {
        size_t n = sizes[c];
        float *y = rand_floats(n), *x = rand_floats(n);
        float *want = malloc(n * sizeof(float));
        for (size_t i = 0; i < n; i++)
            want[i] = y[i] + x[i];
        g_cpu->ops->add(g_cpu, y, x, n);
        CHECKF(memcmp(y, want, n * sizeof(float)) == 0, "add n %zu", n);
        free(y);
        free(x);
        free(want);
    }
}

/* ---- buffers and backend selection ---- */

static void test_buffers(struct moe_backend *be)
{
    size_t n = 1000;
    unsigned char *p = be->ops->buf_alloc(be, n);
    CHECK(p != NULL);
    if (!p)
        return;
    unsigned char host[1000], back[1000];
    for (size_t i = 0; i < n; i++)
        host[i] = (unsigned char)(i * 31 + 7);
    be->ops->buf_download(be, back, p, n);
    int zero = 1;
    for (size_t i = 0; i < n; i++)
        zero &= back[i] == 0;
    CHECKF(zero, "%s: buf_alloc memory is not zeroed", be->name);
    be->ops->buf_upload(be, p, host, n);
    be->ops->synchronize(be);
    be->ops->buf_download(be, back, p, n);
    CHECKF(memcmp(host, back, n) == 0, "%s: upload/download round trip", be->name);
    be->ops->buf_free(be, p);
    void *z = be->ops->buf_alloc(be, 0);
    be->ops->buf_free(be, z);
    be->ops->buf_free(be, NULL);
}

static void test_backend_select(void)
{
    struct moe_backend *be = NULL;
    struct moe_error err = {0};
    CHECK(moe_backend_create("bogus", 1, &be, &err) == MOE_ERR_INVALID && be == NULL);
    CHECKF(strstr(err.msg, "bogus") != NULL, "message does not name the device: %s", err.msg);
    CHECK(moe_backend_create(NULL, 1, &be, &err) == MOE_ERR_INVALID && be == NULL);

    CHECK(moe_backend_create("cpu", 1, &be, &err) == MOE_OK && be && be->device == MOE_DEVICE_CPU);
    CHECK(be && strcmp(be->name, "cpu") == 0);
    moe_backend_destroy(be);
    moe_backend_destroy(NULL);

    /* auto: a working backend; CPU unless a complete CUDA backend is usable. */
    be = NULL;
    CHECKF(moe_backend_create("auto", 2, &be, &err) == MOE_OK && be, "%s", err.msg);
    struct moe_error cerr = {0};
    struct moe_backend *cuda = NULL;
    enum moe_status cst = moe_backend_cuda_create(0, &cuda, &cerr);
    if (be)
        CHECK(be->device == (cst == MOE_OK ? MOE_DEVICE_CUDA : MOE_DEVICE_CPU));
    moe_backend_destroy(be);
    moe_backend_destroy(cuda);

    /* "cuda" fails exactly when direct creation does, with a reason. */
    be = NULL;
    enum moe_status st = moe_backend_create("cuda", 1, &be, &err);
    CHECK(st == cst);
    if (st != MOE_OK) {
        CHECK(st == MOE_ERR_UNSUPPORTED && be == NULL && err.msg[0] != '\0');
        if (!moe_backend_cuda_compiled())
            CHECKF(strstr(err.msg, "without CUDA") != NULL, "%s", err.msg);
        printf("cuda backend (complete): %s\n", err.msg);
    }
    moe_backend_destroy(be);
}

/* ---- ops added for the GPU path: grouped matmul, combine, sampling, KV blocks ---- */

/* Random expert offsets for n_rows rows over n_expert experts; mode 0:
 * random, 1: one expert takes every row, 2: half the experts empty. */
static void random_offsets(int32_t *off, int n_expert, int n_rows, int mode)
{
    int32_t *cnt = calloc((size_t)n_expert, sizeof *cnt);
    int hot = test_rng_int(&g_rng, 0, n_expert - 1);
    for (int r = 0; r < n_rows; r++) {
        int e = mode == 1 ? hot : test_rng_int(&g_rng, 0, n_expert - 1);
        if (mode == 2)
            e &= ~1; /* odd experts stay empty */
        cnt[e]++;
    }
    off[0] = 0;
    for (int e = 0; e < n_expert; e++)
        off[e + 1] = off[e] + cnt[e];
    free(cnt);
}

static void test_grouped_matmul(void)
{
    static const struct {
        int n_rows, n_expert, n_in, n_out, pad, mode;
        enum moe_dtype dt;
    } cases[] = {
        {1, 1, 1, 1, 0, 0, MOE_DTYPE_F32},      {37, 8, 33, 17, 3, 0, MOE_DTYPE_BF16},
        {64, 8, 64, 40, 0, 1, MOE_DTYPE_F32},   {50, 16, 48, 9, 5, 2, MOE_DTYPE_BF16},
        {0, 4, 16, 16, 0, 0, MOE_DTYPE_F32},    {200, 60, 96, 70, 0, 0, MOE_DTYPE_BF16},
        {300, 4, 64, 40, 0, 1, MOE_DTYPE_BF16}, {150, 3, 40, 24, 2, 0, MOE_DTYPE_F32},
    };
    double worst = 0.0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int n_rows = cases[c].n_rows, n_e = cases[c].n_expert, n_in = cases[c].n_in;
        int n_out = cases[c].n_out;
        int64_t ldw = n_in + cases[c].pad;
        bool bf16 = cases[c].dt == MOE_DTYPE_BF16;
        size_t nw = (size_t)n_e * n_out * ldw;
        float *x = rand_floats((size_t)n_rows * n_in), *wf = rand_floats(nw);
        uint16_t *wb = malloc((nw + 1) * sizeof *wb);
        for (size_t i = 0; i < nw; i++)
            wb[i] = moe_f32_to_bf16(wf[i]);
        int32_t *off = malloc(((size_t)n_e + 1) * sizeof *off);
        random_offsets(off, n_e, n_rows, cases[c].mode);
        const void **w = calloc((size_t)n_e, sizeof *w);
        for (int e = 0; e < n_e; e++) {
            size_t at = (size_t)e * n_out * ldw;
            /* experts without rows get no weights, as on a rank that does not hold them */
            if (off[e + 1] > off[e])
                w[e] = bf16 ? (const void *)(wb + at) : (const void *)(wf + at);
        }
        size_t ny = (size_t)n_rows * n_out;
        float *y = rand_floats(ny), *y_ref = malloc((ny + 1) * sizeof(float));
        float *y_each = malloc((ny + 1) * sizeof(float));
        float *y_in = malloc((ny + 1) * sizeof(float)); /* y before the call */
        memcpy(y_ref, y, ny * sizeof(float));
        memcpy(y_each, y, ny * sizeof(float));
        memcpy(y_in, y, ny * sizeof(float));
        bool acc = c % 2;
        struct moe_grouped_matmul_params p = {
            .x = x,
            .n_rows = n_rows,
            .n_in = n_in,
            .n_out = n_out,
            .n_expert = n_e,
            .expert_offsets = off,
            .w = w,
            .w_dtype = cases[c].dt,
            .ldw = ldw,
            .y = y,
            .accumulate = acc,
        };
        g_cpu->ops->grouped_matmul(g_cpu, &p);
        struct moe_error err = {0};
        CHECKF(g_cpu->ops->status(g_cpu, &err) == MOE_OK, "grouped_matmul case %zu: %s", c,
               err.msg);
        for (int e = 0; e < n_e; e++) { /* naive: the plain reference per expert */
            int cnt = off[e + 1] - off[e];
            if (!cnt)
                continue;
            struct moe_matmul_params mp = {
                .x = x + (size_t)off[e] * n_in,
                .n_tok = cnt,
                .n_in = n_in,
                .w = w[e],
                .w_dtype = cases[c].dt,
                .ldw = ldw,
                .n_out = n_out,
                .y = y_ref + (size_t)off[e] * n_out,
                .accumulate = acc,
            };
            cpu_matmul_ref(&mp);
            /* and one matmul call per expert: the grouped call runs every
             * expert's tasks in one pool run (cpu_matmul_many), each exactly
             * as its own call would */
            mp.y = y_each + (size_t)off[e] * n_out;
            g_cpu->ops->matmul(g_cpu, &mp);
        }
        CHECKF(memcmp(y, y_each, ny * sizeof(float)) == 0,
               "grouped_matmul case %zu: differs from one matmul per expert", c);
        /* three threads: the two-ended hand-out's front and back, and a
         * second front taker (cpu_matmul_many) */
        memcpy(y_each, y_in, ny * sizeof(float));
        struct moe_grouped_matmul_params p3 = p;
        p3.y = y_each;
        CHECK(cpu_grouped_matmul(g_pool, &p3, &err) == MOE_OK);
        CHECKF(memcmp(y, y_each, ny * sizeof(float)) == 0,
               "grouped_matmul case %zu: 3 threads differ from 2", c);
        double num = 0, den = 1e-30;
        for (size_t i = 0; i < ny; i++) {
            num = fmax(num, fabs((double)y[i] - y_ref[i]));
            den = fmax(den, fabs((double)y_ref[i]));
        }
        CHECKF(num / den < 1e-5, "grouped_matmul case %zu: err %.3g", c, num / den);
        worst = fmax(worst, num / den);

        /* an expert with rows and no weights: an error, and nothing computed */
        if (n_rows > 0) {
            int e = 0;
            while (off[e + 1] == off[e])
                e++;
            const void *keep = w[e];
            w[e] = NULL;
            memcpy(y_ref, y, ny * sizeof(float));
            g_cpu->ops->grouped_matmul(g_cpu, &p);
            enum moe_status st = g_cpu->ops->status(g_cpu, &err);
            CHECKF(st == MOE_ERR_INVALID && strstr(err.msg, "no weights"),
                   "grouped_matmul NULL weights: status %d (%s)", (int)st, err.msg);
            CHECK(memcmp(y, y_ref, ny * sizeof(float)) == 0);
            CHECK(g_cpu->ops->status(g_cpu, &err) == MOE_OK); /* cleared by the first call */
            w[e] = keep;
            off[n_e] += 1; /* offsets that do not end at n_rows */
            g_cpu->ops->grouped_matmul(g_cpu, &p);
            CHECK(g_cpu->ops->status(g_cpu, &err) == MOE_ERR_INVALID);
        }
        free(x);
        free(wf);
        free(wb);
        free(off);
        free(w);
        free(y);
        free(y_ref);
        free(y_each);
        free(y_in);
    }
    printf("grouped_matmul: worst err %.3g vs the per-expert reference; equals one matmul per "
           "expert bit for bit\n",
           worst);
}

/* Routes n_tok tokens to top_k distinct experts each, groups the (token, k)
 * pairs by expert as the model does (stable counting sort), and fills
 * route_tok / route_w (n_route, permuted order), tok_rows (n_tok, top_k:
 * positions sorted by expert) and off (n_expert + 1). */
static void random_routing(int n_tok, int top_k, int n_expert, int32_t *route_tok, float *route_w,
                           int32_t *tok_rows, int32_t *off)
{
    int n_route = n_tok * top_k;
    int32_t *ids = malloc(((size_t)n_route + 1) * sizeof *ids);
    for (int t = 0; t < n_tok; t++)
        for (int j = 0; j < top_k; j++) {
            int e, dup;
            do {
                e = test_rng_int(&g_rng, 0, n_expert - 1);
                dup = 0;
                for (int i = 0; i < j; i++)
                    dup |= ids[t * top_k + i] == e;
            } while (dup);
            ids[t * top_k + j] = e;
        }
    memset(off, 0, ((size_t)n_expert + 1) * sizeof *off);
    for (int i = 0; i < n_route; i++)
        off[ids[i] + 1]++;
    for (int e = 0; e < n_expert; e++)
        off[e + 1] += off[e];
    int32_t *cur = malloc(((size_t)n_expert + 1) * sizeof *cur);
    memcpy(cur, off, (size_t)n_expert * sizeof *cur);
    for (int i = 0; i < n_route; i++) {
        int at = cur[ids[i]]++;
        route_tok[at] = i / top_k;
        route_w[at] = test_rng_float(&g_rng);
    }
    /* a token's positions, sorted by expert = sorted by position */
    int32_t *fill = calloc((size_t)n_tok + 1, sizeof *fill);
    for (int at = 0; at < n_route; at++) {
        int t = route_tok[at];
        tok_rows[(size_t)t * top_k + fill[t]++] = at;
    }
    free(fill);
    free(cur);
    free(ids);
}

static void test_unpermute_combine(void)
{
    static const int shapes[][4] = {{1, 1, 1, 1}, {13, 2, 8, 63}, {40, 8, 64, 100}, {5, 4, 4, 7}};
    for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
        int n_tok = shapes[c][0], k = shapes[c][1], n_e = shapes[c][2], dim = shapes[c][3];
        int n_route = n_tok * k;
        int32_t *route_tok = malloc((size_t)n_route * 4), *tok_rows = malloc((size_t)n_route * 4);
        int32_t *off = malloc(((size_t)n_e + 1) * 4);
        float *route_w = malloc((size_t)n_route * 4);
        random_routing(n_tok, k, n_e, route_tok, route_w, tok_rows, off);
        float *rows = rand_floats((size_t)n_route * dim);
        size_t ny = (size_t)n_tok * dim;
        float *y = calloc(ny, sizeof(float)), *y_ref = calloc(ny, sizeof(float));
        /* the model's loop: per expert, scatter-add its rows in order */
        for (int e = 0; e < n_e; e++)
            cpu_scatter_add_rows(rows + (size_t)off[e] * dim, route_tok + off[e], route_w + off[e],
                                 off[e + 1] - off[e], dim, y_ref);
        g_cpu->ops->unpermute_combine(g_cpu, rows, route_w, tok_rows, n_tok, k, dim, y);
        CHECKF(memcmp(y, y_ref, ny * sizeof(float)) == 0,
               "unpermute_combine case %zu differs from the scatter loop", c);
        /* holes (-1) skip an entry: combine again over a random subset */
        float *y2 = rand_floats(ny);
        double *naive = malloc(ny * sizeof(double));
        for (size_t i = 0; i < ny; i++)
            naive[i] = y2[i];
        for (int t = 0; t < n_tok; t++)
            for (int j = 0; j < k; j++) {
                int32_t *e = &tok_rows[(size_t)t * k + j];
                if (test_rng_int(&g_rng, 0, 2) == 0) {
                    *e = -1;
                    continue;
                }
                for (int d = 0; d < dim; d++)
                    naive[(size_t)t * dim + d] += (double)route_w[*e] * rows[(size_t)*e * dim + d];
            }
        g_cpu->ops->unpermute_combine(g_cpu, rows, route_w, tok_rows, n_tok, k, dim, y2);
        double e = max_rel_err(y2, naive, ny);
        CHECKF(e < 1e-6, "unpermute_combine holes case %zu: err %.3g", c, e);
        free(route_tok);
        free(tok_rows);
        free(off);
        free(route_w);
        free(rows);
        free(y);
        free(y_ref);
        free(y2);
        free(naive);
    }
}

/* moe_sample (worker/engine/sampler.c) restricted to temperature and top-p, with
 * its double sums: what sample_top_p must agree with. */
static int32_t naive_sample(const float *l, int n, float temp, float top_p, double u)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (l[i] > l[best])
            best = i;
    if (temp <= 0.0f)
        return best;
    int32_t *ord = calloc((size_t)n, sizeof *ord);
    float *p = malloc((size_t)n * sizeof *p);
    for (int i = 0; i < n; i++) {
        ord[i] = i;
        p[i] = expf((l[i] - l[best]) / temp);
    }
    bool nucleus = top_p > 0.0f && top_p < 1.0f;
    if (nucleus) /* insertion sort: p descending, ties to the lower id */
        for (int i = 1; i < n; i++) {
            int32_t v = ord[i];
            int j = i;
            while (j > 0 && (p[ord[j - 1]] < p[v] || (p[ord[j - 1]] == p[v] && ord[j - 1] > v))) {
                ord[j] = ord[j - 1];
                j--;
            }
            ord[j] = v;
        }
    int keep = n;
    double sum = 0, acc = 0;
    for (int i = 0; i < n; i++)
        sum += p[ord[i]];
    if (nucleus)
        for (int i = 0; i < n; i++) {
            acc += p[ord[i]];
            if (acc >= top_p * sum) {
                keep = i + 1;
                sum = acc;
                break;
            }
        }
    double r = u * sum;
    int32_t id = ord[keep - 1];
    acc = 0;
    for (int i = 0; i < keep; i++) {
        acc += p[ord[i]];
        if (r < acc) {
            id = ord[i];
            break;
        }
    }
    free(ord);
    free(p);
    return id;
}

static void test_sampling(void)
{
    static const struct {
        int n, vocab;
        float temp, top_p, scale;
        int ties;
    } cases[] = {
        {50, 1, 1.0f, 0.9f, 1.0f, 0},    {40, 300, 1.0f, 0.0f, 3.0f, 0},
        {40, 300, 0.7f, 0.9f, 3.0f, 0},  {40, 1000, 1.3f, 0.5f, 8.0f, 0},
        {40, 257, 1.0f, 0.95f, 1.0f, 1}, {20, 500, 0.0f, 0.9f, 2.0f, 1},
        {30, 2000, 0.8f, 1.0f, 5.0f, 0}, {30, 100, 2.0f, 0.3f, 0.5f, 1},
    };
    int n_rows = 0, mismatch = 0, argmax_bad = 0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int n = cases[c].n, vocab = cases[c].vocab;
        size_t nl = (size_t)n * vocab;
        float *l = malloc(nl * sizeof(float));
        for (size_t i = 0; i < nl; i++)
            l[i] = cases[c].ties ? (float)test_rng_int(&g_rng, 0, 4)
                                 : cases[c].scale * test_rng_float(&g_rng);
        double *u = malloc((size_t)n * sizeof(double));
        for (int r = 0; r < n; r++)
            u[r] = (double)test_rng_u32(&g_rng) / 4294967296.0;
        u[0] = 0.0;
        if (n > 1)
            u[1] = 1.0 - 0x1p-53; /* the top of [0, 1): the last-candidate fallback */
        int32_t *got = malloc((size_t)n * 4), *again = malloc((size_t)n * 4);
        int32_t *am = malloc((size_t)n * 4);
        g_cpu->ops->sample_top_p(g_cpu, l, n, vocab, cases[c].temp, cases[c].top_p, u, got);
        g_cpu->ops->sample_top_p(g_cpu, l, n, vocab, cases[c].temp, cases[c].top_p, u, again);
        g_cpu->ops->argmax(g_cpu, l, n, vocab, am);
        CHECK(memcmp(got, again, (size_t)n * 4) == 0); /* deterministic given u */
        for (int r = 0; r < n; r++) {
            const float *row = l + (size_t)r * vocab;
            int32_t want = naive_sample(row, vocab, cases[c].temp, cases[c].top_p, u[r]);
            mismatch += got[r] != want;
            argmax_bad += am[r] != naive_sample(row, vocab, 0.0f, 0.0f, 0.0);
            CHECKF(got[r] == want, "sample case %zu row %d: got %d, moe_sample's rule gives %d", c,
                   r, got[r], want);
            n_rows++;
        }
        free(l);
        free(u);
        free(got);
        free(again);
        free(am);
    }
    CHECK(argmax_bad == 0);
    /* a dominant logit and a small top_p: only the argmax is ever kept */
    float row[64];
    for (int i = 0; i < 64; i++)
        row[i] = test_rng_float(&g_rng);
    row[37] = 20.0f;
    int32_t id = -1;
    double us[3] = {0.0, 0.5, 0.999999};
    for (int i = 0; i < 3; i++) {
        g_cpu->ops->sample_top_p(g_cpu, row, 1, 64, 1.0f, 0.5f, &us[i], &id);
        CHECK(id == 37);
    }
    struct moe_error err = {0};
    CHECK(g_cpu->ops->status(g_cpu, &err) == MOE_OK);
    printf("sampling: %d rows, %d differ from moe_sample's rule with double sums\n", n_rows,
           mismatch);
}

/* moe_host_argmax on one ISA against the plain loop: random rows of many
 * lengths (the vector bodies and their tails), ties (the lower index wins),
 * NaNs anywhere (never chosen; x[0] NaN gives 0), +-inf, signed zeros. */
static void test_argmax(const char *isa)
{
    enum cpu_isa now = cpu_kernels_isa();
    struct test_rng rng;
    test_rng_seed(&rng, 0xa7a7);
    static float x[32000 + 64];
    int bad = 0, rows = 0;
    for (int trial = 0; trial < 600; trial++) {
        int n = trial < 200 ? 1 + trial : trial < 580 ? 1 + test_rng_int(&rng, 0, 400) : 32000;
        int kind = trial % 6;
        for (int i = 0; i < n; i++) {
            float v = test_rng_float(&rng) * 8.0f - 4.0f;
            if (kind == 1) /* few distinct values: many ties */
                v = (float)test_rng_int(&rng, 0, 3);
            x[i] = v;
        }
        if (kind == 2) /* NaNs sprinkled, maybe at 0 */
            for (int j = 0; j < 1 + n / 8; j++)
                x[test_rng_int(&rng, 0, n - 1)] = NAN;
        if (kind == 3) { /* infinities */
            x[test_rng_int(&rng, 0, n - 1)] = -INFINITY;
            if (trial & 8)
                x[test_rng_int(&rng, 0, n - 1)] = INFINITY;
        }
        if (kind == 4) /* all zeros of both signs */
            for (int i = 0; i < n; i++)
                x[i] = test_rng_int(&rng, 0, 1) ? 0.0f : -0.0f;
        if (kind == 5) /* all -inf, or all NaN but one */
            for (int i = 0; i < n; i++)
                x[i] = trial & 16 ? -INFINITY : NAN;
        if (kind == 5 && !(trial & 16))
            x[test_rng_int(&rng, 0, n - 1)] = -1.0f;
        int32_t want = 0;
        for (int i = 1; i < n; i++)
            if (x[i] > x[want])
                want = i;
        int32_t got = cpu_vec_argmax_isa(x, n, now);
        rows++;
        if (got != want && bad++ < 5)
            fprintf(stderr, "argmax %s: n %d kind %d: got %d want %d\n", isa, n, kind, got, want);
    }
    CHECKF(bad == 0, "%s: %d of %d rows differ from the plain loop", isa, bad, rows);
    CHECK(moe_host_argmax(x, 0) == 0 && moe_host_argmax(x, 1) == 0);
    printf("argmax %s: %d rows identical to the plain loop\n", isa, rows - bad);
}

/* The permute op against its definition, computed the slow way: for each
 * key (dest, expert) in order, the items with that key in item order; each
 * token's positions listed by expert id; offsets the running counts. With
 * and without a placement table (replicas picked by token_base + t), top_k
 * 1 as the receive-side sort (item_tok a permutation, tok_rows its inverse). */
static void test_permute(void)
{
    struct test_rng rng;
    test_rng_seed(&rng, 0x9e37);
    int bad = 0, cases = 0;
    for (int trial = 0; trial < 120; trial++) {
        int n_tok = test_rng_int(&rng, 0, 90), k = 1 + test_rng_int(&rng, 0, 7);
        int n_e = k + test_rng_int(&rng, 0, 40),
            n_dest = trial % 3 ? 1 + test_rng_int(&rng, 0, 5) : 1;
        int base = test_rng_int(&rng, 0, 9), stride = 3;
        int n_items = n_tok * k, n_keys = n_dest * n_e;
        int32_t *ids = malloc((size_t)(n_items + 1) * 4), *ranks = malloc((size_t)n_e * stride * 4);
        int32_t *n_ranks = malloc((size_t)n_e * 4);
        float *w = malloc((size_t)(n_items + 1) * 4);
        for (int t = 0; t < n_tok; t++)
            for (int j = 0; j < k; j++) {
                int e, dup;
                do {
                    e = test_rng_int(&rng, 0, n_e - 1);
                    dup = 0;
                    for (int i = 0; i < j; i++)
                        dup |= ids[t * k + i] == e;
                } while (dup);
                ids[t * k + j] = e;
                w[t * k + j] = test_rng_float(&rng);
            }
        for (int e = 0; e < n_e; e++) {
            n_ranks[e] = 1 + test_rng_int(&rng, 0, n_dest < stride ? n_dest - 1 : stride - 1);
            for (int q = 0; q < n_ranks[e]; q++)
                ranks[e * stride + q] = (e + q) % n_dest;
        }
        int32_t *tok = malloc((size_t)(n_items + 1) * 4), *exp = malloc((size_t)(n_items + 1) * 4);
        int32_t *rows = malloc((size_t)(n_items + 1) * 4), *off = malloc((size_t)(n_keys + 1) * 4);
        float *iw = malloc((size_t)(n_items + 1) * 4);
        struct moe_permute_params p = {.ids = ids,
                                       .weights = w,
                                       .n_tok = n_tok,
                                       .top_k = k,
                                       .n_expert = n_e,
                                       .n_dest = n_dest,
                                       .ranks = n_dest > 1 ? ranks : NULL,
                                       .n_ranks = n_ranks,
                                       .rank_stride = stride,
                                       .token_base = base,
                                       .item_tok = tok,
                                       .item_exp = exp,
                                       .item_w = iw,
                                       .tok_rows = rows,
                                       .offsets = off};
        g_cpu->ops->permute(g_cpu, &p);
        struct moe_error err = {0};
        CHECKF(g_cpu->ops->status(g_cpu, &err) == MOE_OK, "%s", err.msg);
        /* the slow way */
        int q = 0, wrong = 0;
        int32_t *where = malloc((size_t)(n_items + 1) * 4);
        for (int key = 0; key < n_keys; key++) {
            wrong += off[key] != q;
            for (int i = 0; i < n_items; i++) {
                int t = i / k, e = ids[i];
                int dest = n_dest > 1 ? ranks[e * stride + (base + t) % n_ranks[e]] : 0;
                if (dest * n_e + e != key)
                    continue;
                wrong += tok[q] != t || exp[q] != e || iw[q] != w[i];
                where[i] = q++;
            }
        }
        wrong += off[n_keys] != n_items || q != n_items;
        for (int t = 0; t < n_tok; t++) /* by expert id: each entry's expert rises */
            for (int j = 0; j < k; j++) {
                int at = rows[t * k + j];
                wrong += at < 0 || at >= n_items || tok[at] != t;
                if (j && at >= 0 && at < n_items)
                    wrong += exp[at] <= exp[rows[t * k + j - 1]];
                int found = 0;
                for (int jj = 0; jj < k; jj++)
                    found += where[t * k + jj] == at;
                wrong += found != 1;
            }
        cases++;
        if (wrong && bad++ < 3)
            fprintf(stderr, "permute: n_tok %d k %d n_e %d n_dest %d: %d wrong\n", n_tok, k, n_e,
                    n_dest, wrong);
        free(where);
        free(ids);
        free(ranks);
        free(n_ranks);
        free(w);
        free(tok);
        free(exp);
        free(rows);
        free(off);
        free(iw);
    }
    CHECKF(bad == 0, "permute: %d of %d cases differ from the definition", bad, cases);
    /* top_k 1, no weights: the receive side's sort by expert */
    int32_t rid[7] = {3, 1, 3, 0, 1, 3, 2}, perm[7], inv[7], off[5];
    struct moe_permute_params r = {.ids = rid,
                                   .n_tok = 7,
                                   .top_k = 1,
                                   .n_expert = 4,
                                   .n_dest = 1,
                                   .item_tok = perm,
                                   .tok_rows = inv,
                                   .offsets = off};
    g_cpu->ops->permute(g_cpu, &r);
    const int32_t want_perm[7] = {3, 1, 4, 6, 0, 2, 5}, want_off[5] = {0, 1, 3, 4, 7};
    CHECK(!memcmp(perm, want_perm, sizeof perm) && !memcmp(off, want_off, sizeof off));
    for (int i = 0; i < 7; i++)
        CHECK(perm[inv[i]] == i);
    /* refusals by value */
    rid[2] = 9;
    g_cpu->ops->permute(g_cpu, &r);
    struct moe_error err = {0};
    CHECK(g_cpu->ops->status(g_cpu, &err) == MOE_ERR_INVALID);
    CHECKF(strstr(err.msg, "names expert 9 of 4"), "%s", err.msg);
    printf("permute: %d random cases equal the definition\n", cases - bad);
}

static void test_kv_blocks(void)
{
    int n_block = 9, bs = 4, kv_dim = 6, n = 5;
    size_t nc = (size_t)n_block * bs * kv_dim, blk = (size_t)bs * kv_dim;
    float *k = rand_floats(nc), *v = rand_floats(nc), *packed = rand_floats(2 * n * blk);
    int32_t ids[5] = {7, 0, 3, 8, 2};
    g_cpu->ops->kv_gather_blocks(g_cpu, k, v, ids, n, bs, kv_dim, packed);
    int bad = 0;
    for (int i = 0; i < n; i++)
        for (size_t e = 0; e < blk; e++) {
            bad += packed[(2 * i) * blk + e] != k[ids[i] * blk + e];
            bad += packed[(2 * i + 1) * blk + e] != v[ids[i] * blk + e];
        }
    CHECK(bad == 0);
    /* scatter into fresh caches at other blocks, then gather back */
    float *k2 = calloc(nc, sizeof(float)), *v2 = calloc(nc, sizeof(float));
    float *back = calloc(2 * n * blk, sizeof(float));
    int32_t ids2[5] = {1, 4, 5, 6, 0};
    g_cpu->ops->kv_scatter_blocks(g_cpu, packed, ids2, n, bs, kv_dim, k2, v2);
    g_cpu->ops->kv_gather_blocks(g_cpu, k2, v2, ids2, n, bs, kv_dim, back);
    CHECK(memcmp(back, packed, 2 * n * blk * sizeof(float)) == 0);
    for (size_t e = 0; e < blk; e++) /* block 2, 3 untouched */
        bad += k2[2 * blk + e] != 0.0f || v2[3 * blk + e] != 0.0f;
    CHECK(bad == 0);
    /* buf_zero clears exactly the range asked for */
    unsigned char *b = g_cpu->ops->buf_alloc(g_cpu, 100);
    memset(b, 0xab, 100);
    g_cpu->ops->buf_zero(g_cpu, b + 3, 90);
    CHECK(b[2] == 0xab && b[3] == 0 && b[92] == 0 && b[93] == 0xab);
    g_cpu->ops->buf_free(g_cpu, b);
    free(k);
    free(v);
    free(packed);
    free(k2);
    free(v2);
    free(back);
}

/* ---- CUDA ops against the CPU ---- */

static int test_cuda(void)
{
    struct moe_backend *cu = NULL;
    struct moe_error err = {0};
    enum moe_status st = moe_backend_cuda_create(0, &cu, &err);
    if (st != MOE_OK) { /* a skip: reported, never counted as a pass */
        printf("cuda: skipped (%s)\n", err.msg);
        return 0;
    }
    test_buffers(cu);
    static const int dims[] = {1, 31, 64, 1000, 4097};
    double worst = 0.0;
    for (int c = 0; c < 5; c++) {
        int dim = dims[c], n_rows = test_rng_int(&g_rng, 1, 70);
        size_t n = (size_t)n_rows * dim;
        float *x = rand_floats(n), *w = rand_floats((size_t)dim);
        float *y_cpu = malloc(n * sizeof(float)), *y_gpu = malloc(n * sizeof(float));
        g_cpu->ops->rmsnorm(g_cpu, x, w, y_cpu, n_rows, dim, 1e-5f);
        float *dx = cu->ops->buf_alloc(cu, n * 4), *dw = cu->ops->buf_alloc(cu, (size_t)dim * 4);
        float *dy = cu->ops->buf_alloc(cu, n * 4);
        cu->ops->buf_upload(cu, dx, x, n * 4);
        cu->ops->buf_upload(cu, dw, w, (size_t)dim * 4);
        for (int in_place = 0; in_place < 2; in_place++) {
            cu->ops->rmsnorm(cu, dx, dw, in_place ? dx : dy, n_rows, dim, 1e-5f);
            cu->ops->synchronize(cu);
            cu->ops->buf_download(cu, y_gpu, in_place ? dx : dy, n * 4);
            double num = 0, den = 1e-30;
            for (size_t i = 0; i < n; i++) {
                num = fmax(num, fabs((double)y_gpu[i] - y_cpu[i]));
                den = fmax(den, fabs((double)y_cpu[i]));
            }
            CHECKF(num / den < 2e-6, "cuda rmsnorm dim %d rows %d in_place %d: err %.3g", dim,
                   n_rows, in_place, num / den);
            worst = fmax(worst, num / den);
        }
        cu->ops->buf_free(cu, dx);
        cu->ops->buf_free(cu, dw);
        cu->ops->buf_free(cu, dy);
        free(x);
        free(w);
        free(y_cpu);
        free(y_gpu);
    }
    printf("cuda: rmsnorm vs cpu worst err %.3g\n", worst);
    moe_backend_destroy(cu);
    return 1;
}

int main(void)
{
    struct moe_error err = {0};
    if (moe_backend_cpu_create(2, &g_cpu, &err) != MOE_OK ||
        moe_threadpool_create(3, &g_pool, &err) != MOE_OK) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return 1;
    }
    enum cpu_isa best = cpu_kernels_detect_isa();
    printf("cpu isa detected: %s\n", cpu_isa_name(best));
    for (int isa = CPU_ISA_SCALAR; isa <= (int)best; isa++) {
        enum cpu_isa got = cpu_kernels_force_isa((enum cpu_isa)isa);
        CHECK(got == (enum cpu_isa)isa && cpu_kernels_isa() == got);
        const char *name = cpu_isa_name(got);
        test_matmul(name);
        test_rmsnorm(name);
        test_fusions(name);
        test_bf16_convert(name);
        test_attention(name);
        test_argmax(name);
        test_swiglu(name);
    }
    float *tiled2[N_TILED_CASES] = {0}, *tiled5[N_TILED_CASES] = {0};
    float *dec2[N_DECODE_CASES] = {0}, *dec5[N_DECODE_CASES] = {0};
    if (best >= CPU_ISA_AVX2) {
        cpu_kernels_force_isa(CPU_ISA_AVX2);
        test_attention_tiled("avx2", tiled2);
        test_attention_decode_batch("avx2", dec2);
    } else
        printf("SKIPPED: attention tiled avx2: this processor lacks AVX2\n");
    CHECK(cpu_kernels_force_isa(CPU_ISA_AVX512) == best); /* clamped to what exists */
    if (best == CPU_ISA_AVX512) {
        test_attention_tiled("avx512", tiled5);
        test_attention_decode_batch("avx512", dec5);
        test_attention_tiled_isas_agree(tiled2, tiled5, dec2, dec5);
        test_attention_amx();
        test_attention_fp16_pv();
    } else
        printf("SKIPPED: attention tiled avx512 (and avx2 == avx512): this processor lacks "
               "AVX-512\n");
    for (size_t c = 0; c < N_TILED_CASES; c++) {
        free(tiled2[c]);
        free(tiled5[c]);
    }
    for (size_t c = 0; c < N_DECODE_CASES; c++) {
        free(dec2[c]);
        free(dec5[c]);
    }
    test_matmul_ref();
    test_matmul_detects_error();
    test_rope();
    test_attention_latent();
    test_router();
    test_router_grouped();
    test_copy_cols();
    test_elementwise();
    test_grouped_matmul();
    test_grouped_tiles();
    test_unpermute_combine();
    test_permute();
    test_sampling();
    test_kv_blocks();
    test_buffers(g_cpu);
    test_backend_select();
    test_cuda();

    moe_threadpool_destroy(g_pool);
    moe_backend_destroy(g_cpu);
    return test_summary();
}
