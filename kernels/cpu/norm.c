/* RMSNorm and rotary embedding, in the order of float operations that
 * Hugging Face transformers uses (so results agree to ~1e-6):
 *   rmsnorm: var = mean(x^2) in f32; y = w * (x * (1 / sqrt(var + eps)))
 *   rope:    inv_freq[i] = 1 / theta^((2i as f32) / d_head)   (f32 pow)
 *            f = pos * inv_freq[i]; c = cos(f); s = sin(f)      (f32)
 *            y[i] = x[i] c - x[i+h] s;  y[i+h] = x[i+h] c + x[i] s
 * The kernels library is compiled with -ffp-contract=off so that these
 * products are never fused. */
#include <math.h>

#include "cpu_kernels.h"

#define PAR_MIN_ELEMS 32768 /* below this, one thread is faster than a pool run */

/* ---- rmsnorm ---- */

struct rmsnorm_job {
    const float *x, *w;
    float *y;
    int n_rows, dim, rows_per_task;
    float eps;
};

static void rmsnorm_rows(const struct rmsnorm_job *j, int r0, int r1)
{
    for (int r = r0; r < r1; r++) {
        const float *x = j->x + (size_t)r * j->dim;
        float *y = j->y + (size_t)r * j->dim;
        float var = cpu_vec_sumsq(x, j->dim) / (float)j->dim;
        float inv = 1.0f / sqrtf(var + j->eps);
        for (int i = 0; i < j->dim; i++)
            y[i] = j->w[i] * (x[i] * inv);
    }
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

static void rope_token(const struct rope_job *j, int t)
{
    int half = j->d_head / 2;
    float c[ROPE_MAX_HALF], s[ROPE_MAX_HALF];
    float pos = (float)j->pos[t];
    for (int i = 0; i < half; i++) {
        float f = pos * j->inv_freq[i];
        c[i] = cosf(f) * j->scale;
        s[i] = sinf(f) * j->scale;
    }
    for (int h = 0; h < j->n_heads; h++) {
        float *x = j->x + ((size_t)t * j->n_heads + h) * j->d_head;
        for (int i = 0; i < half; i++) {
            float a = x[i], b = x[i + half];
            float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
            x[i] = ac - bs;
            x[i + half] = bc + as;
        }
    }
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
