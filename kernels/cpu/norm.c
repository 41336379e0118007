/* RMSNorm and rotary embedding, in the order of float operations that
 * Hugging Face transformers uses (so results agree to ~1e-6):
 *   rmsnorm: var = mean(x^2) in f32; y = w * (x * (1 / sqrt(var + eps)))
 *   rope:    inv_freq[i] = 1 / theta^((2i as f32) / d_head)   (f32 pow)
 *            f = pos * inv_freq[i]; c = cos(f); s = sin(f)      (f32)
 *            y[i] = x[i] c - x[i+h] s;  y[i+h] = x[i+h] c + x[i] s
 * The kernels library is compiled with -ffp-contract=off so that these
 * products are never fused. */
#include <math.h>
#include <stdlib.h>

#include "cpu_kernels.h"

#define PAR_MIN_ELEMS 32768 /* below this, one thread is faster than a pool run */

/* ---- rmsnorm ---- */

struct rmsnorm_job {
    const float *x, *w;
    float *y;
    int n_rows, dim, rows_per_task;
    float eps;
};

/* One row; y == x allowed (each x[i] is read before y[i] is written). */
static void rmsnorm_row(const float *x, const float *w, float *y, int dim, float eps)
{
    float var = cpu_vec_sumsq(x, dim) / (float)dim;
    float inv = 1.0f / sqrtf(var + eps);
    for (int i = 0; i < dim; i++)
        y[i] = w[i] * (x[i] * inv);
}

static void rmsnorm_rows(const struct rmsnorm_job *j, int r0, int r1)
{
    for (int r = r0; r < r1; r++)
        rmsnorm_row(j->x + (size_t)r * j->dim, j->w, j->y + (size_t)r * j->dim, j->dim, j->eps);
}

static void rmsnorm_task(void *arg, int task, int thread)
{
    const struct rmsnorm_job *j = arg;
    int r0 = task * j->rows_per_task;
    int r1 = r0 + j->rows_per_task < j->n_rows ? r0 + j->rows_per_task : j->n_rows;
    rmsnorm_rows(j, r0, r1);
}

void cpu_rmsnorm(struct moe_threadpool *pool, const float *x, const float *w, float *y, int n_rows,
                 int dim, float eps)
{
    if (n_rows <= 0 || dim <= 0)
        return;
    struct rmsnorm_job j = {x, w, y, n_rows, dim, 1, eps};
    if ((size_t)n_rows * dim < PAR_MIN_ELEMS || moe_threadpool_size(pool) == 1) {
        rmsnorm_rows(&j, 0, n_rows);
        return;
    }
    int per = PAR_MIN_ELEMS / 4 / dim;
    j.rows_per_task = per < 1 ? 1 : per;
    moe_threadpool_run(pool, (n_rows + j.rows_per_task - 1) / j.rows_per_task, rmsnorm_task, &j);
}

/* ---- rope ---- */

#define ROPE_MAX_HALF 512

struct rope_job {
    float *x;
    const int32_t *pos;
    int n_tok, n_heads, d_head;
    const float *inv_freq; /* (d_head / 2) */
    float scale;           /* multiplies cos and sin */
};

/* A position's cos and sin (each times scale) for the half frequencies. */
static void rope_cs(int32_t pos_i, const float *inv_freq, float scale, int half, float *c, float *s)
{
    float pos = (float)pos_i;
    for (int i = 0; i < half; i++) {
        float f = pos * inv_freq[i];
        c[i] = cosf(f) * scale;
        s[i] = sinf(f) * scale;
    }
}

/* One head's d_head values rotated in place. */
static void rope_head(float *x, int half, const float *c, const float *s)
{
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
        x[i] = ac - bs;
        x[i + half] = bc + as;
    }
}

static void rope_token(const struct rope_job *j, int t)
{
    int half = j->d_head / 2;
    float c[ROPE_MAX_HALF], s[ROPE_MAX_HALF];
    rope_cs(j->pos[t], j->inv_freq, j->scale, half, c, s);
    for (int h = 0; h < j->n_heads; h++)
        rope_head(j->x + ((size_t)t * j->n_heads + h) * j->d_head, half, c, s);
}

static void rope_task(void *arg, int task, int thread)
{
    rope_token(arg, task);
}

void cpu_rope(struct moe_threadpool *pool, float *x, const int32_t *pos, int n_tok, int n_heads,
              int d_head, const float *inv_freq, float scale)
{
    MOE_ASSERT(d_head % 2 == 0 && d_head / 2 <= ROPE_MAX_HALF);
    struct rope_job j = {x, pos, n_tok, n_heads, d_head, inv_freq, scale};
    if ((size_t)n_tok * n_heads * d_head < PAR_MIN_ELEMS || moe_threadpool_size(pool) == 1) {
        for (int t = 0; t < n_tok; t++)
            rope_token(&j, t);
        return;
    }
    moe_threadpool_run(pool, n_tok, rope_task, &j);
}

/* ---- fusions (the same per-row arithmetic as the ops they stand for) ---- */

struct add_rmsnorm_job {
    float *x;
    const float *r, *w;
    float *y;
    int dim, n_rows, rows_per_task;
    float eps;
};

static void add_rmsnorm_task(void *arg, int task, int thread)
{
    const struct add_rmsnorm_job *j = arg;
    int r0 = task * j->rows_per_task;
    int r1 = r0 + j->rows_per_task < j->n_rows ? r0 + j->rows_per_task : j->n_rows;
    for (int r = r0; r < r1; r++) {
        float *x = j->x + (size_t)r * j->dim;
        const float *res = j->r + (size_t)r * j->dim;
        for (int i = 0; i < j->dim; i++)
            x[i] += res[i];
        rmsnorm_row(x, j->w, j->y + (size_t)r * j->dim, j->dim, j->eps);
    }
}

void cpu_add_rmsnorm(struct moe_threadpool *pool, float *x, const float *r, const float *w,
                     float *y, int n_rows, int dim, float eps)
{
    if (n_rows <= 0 || dim <= 0)
        return;
    struct add_rmsnorm_job j = {x, r, w, y, dim, n_rows, n_rows, eps};
    if ((size_t)n_rows * dim < PAR_MIN_ELEMS || moe_threadpool_size(pool) == 1) {
        add_rmsnorm_task(&j, 0, 0);
        return;
    }
    int per = PAR_MIN_ELEMS / 4 / dim;
    j.rows_per_task = per < 1 ? 1 : per;
    moe_threadpool_run(pool, (n_rows + j.rows_per_task - 1) / j.rows_per_task, add_rmsnorm_task,
                       &j);
}

/* One head of d values from src (+ bias), normed, rotated, into dst (f32)
 * or, through buf, into a bf16 cache row. c NULL: no rotation (V). */
static void rope_kv_head(const struct moe_rope_kv_params *p, const float *src, const float *bias,
                         const float *norm, const float *c, const float *s, void *dst,
                         enum moe_dtype dt, float *buf)
{
    const int d = p->d_head;
    float *x = dt == MOE_DTYPE_F32 ? dst : buf;
    for (int i = 0; i < d; i++)
        x[i] = bias ? src[i] + bias[i] : src[i];
    if (norm)
        rmsnorm_row(x, norm, x, d, p->eps);
    if (c)
        rope_head(x, d / 2, c, s);
    if (dt == MOE_DTYPE_BF16)
        cpu_vec_to_bf16(dst, x, d);
}

/* Token t: q to q_out; k and v to the caches at slots[t], or (kv_tmp) to
 * kv_tmp's row t as f32 [k | v] for the caller's in-order write. */
static void rope_kv_token(const struct moe_rope_kv_params *p, int t, float *kv_tmp)
{
    const int d = p->d_head, half = d / 2, qd = p->n_head * d, kvd = p->n_kv_head * d;
    const float *row = p->qkv + (size_t)t * (size_t)(qd + 2 * kvd);
    float c[ROPE_MAX_HALF], s[ROPE_MAX_HALF], buf[2 * ROPE_MAX_HALF];
    rope_cs(p->pos[t], p->inv_freq, p->scale, half, c, s);
    for (int h = 0; h < p->n_head; h++)
        rope_kv_head(p, row + h * d, p->bq ? p->bq + h * d : NULL, p->q_norm, c, s,
                     p->q_out + (size_t)t * qd + h * d, MOE_DTYPE_F32, buf);
    const enum moe_dtype dt = kv_tmp ? MOE_DTYPE_F32 : p->kv_dtype;
    const size_t es = dt == MOE_DTYPE_BF16 ? 2 : 4;
    char *kc = kv_tmp ? (char *)(kv_tmp + (size_t)t * 2 * kvd)
                      : (char *)p->k_cache + (size_t)p->slots[t] * kvd * es;
    char *vc = kv_tmp ? (char *)(kv_tmp + (size_t)t * 2 * kvd + kvd)
                      : (char *)p->v_cache + (size_t)p->slots[t] * kvd * es;
    for (int h = 0; h < p->n_kv_head; h++) {
        rope_kv_head(p, row + qd + h * d, p->bk ? p->bk + h * d : NULL, p->k_norm, c, s,
                     kc + (size_t)h * d * es, dt, buf);
        rope_kv_head(p, row + qd + kvd + h * d, p->bv ? p->bv + h * d : NULL, NULL, NULL, NULL,
                     vc + (size_t)h * d * es, dt, buf);
    }
}

struct rope_kv_job {
    const struct moe_rope_kv_params *p;
    float *kv_tmp;
};

static void rope_kv_task(void *arg, int t, int thread)
{
    const struct rope_kv_job *j = arg;
    rope_kv_token(j->p, t, j->kv_tmp);
}

/* Tokens in parallel, but their K and V reach the cache in token order, as
 * kv_write writes them: two tokens of one call may share a slot (sequences
 * sharing a prefix block feed it again), and the last one wins, as before. */
void cpu_rope_kv_write(struct moe_threadpool *pool, const struct moe_rope_kv_params *p)
{
    MOE_ASSERT(p->d_head % 2 == 0 && p->d_head / 2 <= ROPE_MAX_HALF);
    MOE_ASSERT(moe_kv_dtype_valid(p->kv_dtype));
    const int kvd = p->n_kv_head * p->d_head;
    const size_t work = (size_t)p->n_tok * (size_t)(p->n_head + 2 * p->n_kv_head) * p->d_head;
    float *kv_tmp = NULL;
    if (work >= PAR_MIN_ELEMS && moe_threadpool_size(pool) > 1)
        kv_tmp = malloc((size_t)p->n_tok * 2 * (size_t)kvd * sizeof *kv_tmp);
    if (!kv_tmp) { /* one thread (small, or no memory for the staging): in order */
        for (int t = 0; t < p->n_tok; t++)
            rope_kv_token(p, t, NULL);
        return;
    }
    struct rope_kv_job j = {p, kv_tmp};
    moe_threadpool_run(pool, p->n_tok, rope_kv_task, &j);
    for (int t = 0; t < p->n_tok; t++) {
        const float *k = kv_tmp + (size_t)t * 2 * kvd;
        cpu_kv_write(k, k + kvd, p->slots + t, 1, kvd, p->k_cache, p->v_cache, p->kv_dtype);
    }
    free(kv_tmp);
}
