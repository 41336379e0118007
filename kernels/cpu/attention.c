/* Paged KV cache write and causal grouped-query attention over it: the
 * reference (cpu_attention_ref) here, the tiled kernel that cpu_attention
 * prefers in attention_tiled.c.
 *
 * Reference: one task per (token, query head). Positions are visited in chunks of
 * ATTN_CHUNK with an online softmax: scores of a chunk are computed, the
 * running max moves once per chunk (rescaling the partial sum), then the
 * chunk's V rows are added with weights exp(s - max). All in f32: a BF16
 * cache's rows are widened (exactly) before use, so a BF16 cache gives bit
 * for bit what an F32 cache holding the same rounded values gives. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#define ATTN_CHUNK 64

void cpu_kv_write(const float *k, const float *v, const int32_t *slots, int n_tok, int kv_dim,
                  void *k_cache, void *v_cache, enum moe_dtype kv_dtype)
{
    MOE_ASSERT(moe_kv_dtype_valid(kv_dtype));
    for (int t = 0; t < n_tok; t++) {
        size_t dst = (size_t)slots[t] * kv_dim, src = (size_t)t * kv_dim;
        if (kv_dtype == MOE_DTYPE_BF16) {
            cpu_vec_to_bf16((uint16_t *)k_cache + dst, k + src, kv_dim);
            if (v_cache)
                cpu_vec_to_bf16((uint16_t *)v_cache + dst, v + src, kv_dim);
        } else {
            memcpy((float *)k_cache + dst, k + src, (size_t)kv_dim * sizeof(float));
            if (v_cache)
                memcpy((float *)v_cache + dst, v + src, (size_t)kv_dim * sizeof(float));
        }
    }
}

struct ref_job {
    const struct moe_attn_params *p;
    float *wide; /* BF16 caches: per thread, ATTN_CHUNK K rows then ATTN_CHUNK V rows */
};

/* Row `off` (in elements) of a cache as f32: in place for F32, else widened
 * into `buf`. */
static const float *cache_row(const void *cache, enum moe_dtype dt, size_t off, int d, float *buf)
{
    if (dt == MOE_DTYPE_F32)
        return (const float *)cache + off;
    cpu_vec_from_bf16(buf, (const uint16_t *)cache + off, d);
    return buf;
}

static void attention_one(const struct moe_attn_params *p, float *wide, int t, int h)
{
    const int d = p->d_head, dv = p->d_v ? p->d_v : p->d_head;
    const int kvh = h / (p->n_head / p->n_kv_head);
    const size_t slot_stride = (size_t)p->n_kv_head * d;
    const float *q = p->q + ((size_t)t * p->n_head + h) * d;
    float *acc = p->out + ((size_t)t * p->n_head + h) * dv;
    const int32_t *blocks = p->block_tables + (size_t)p->tok_seq[t] * p->max_blocks;
    const int n_pos = p->tok_pos[t] + 1;
    float s[ATTN_CHUNK];
    const float *vrow[ATTN_CHUNK];
    float m = -INFINITY, l = 0.0f;
    memset(acc, 0, (size_t)dv * sizeof(float));
    for (int p0 = 0; p0 < n_pos; p0 += ATTN_CHUNK) {
        int n = n_pos - p0 < ATTN_CHUNK ? n_pos - p0 : ATTN_CHUNK;
        float cmax = -INFINITY;
        for (int j = 0; j < n; j++) {
            int pos = p0 + j;
            size_t slot = (size_t)blocks[pos / p->block_size] * p->block_size + pos % p->block_size;
            size_t off = slot * slot_stride + (size_t)kvh * d;
            const float *k = cache_row(p->k_cache, p->kv_dtype, off, d, wide + (size_t)j * d);
            s[j] = cpu_vec_dot(q, k, d) * p->scale;
            vrow[j] = p->v_cache == p->k_cache && p->kv_dtype != MOE_DTYPE_F32
                          ? k /* one latent row: widened once */
                          : cache_row(p->v_cache, p->kv_dtype, off, dv,
                                      wide + (size_t)(ATTN_CHUNK + j) * d);
            cmax = s[j] > cmax ? s[j] : cmax;
        }
        if (cmax > m) {
            if (l > 0.0f) {
                float r = expf(m - cmax);
                l *= r;
                cpu_vec_scale(acc, r, dv);
            }
            m = cmax;
        }
        for (int j = 0; j < n; j++) {
            float e = expf(s[j] - m);
            l += e;
            cpu_vec_axpy(acc, e, vrow[j], dv);
        }
    }
    cpu_vec_scale(acc, 1.0f / l, dv);
}

static void attention_task(void *arg, int task, int thread)
{
    const struct ref_job *j = arg;
    const struct moe_attn_params *p = j->p;
    float *wide = j->wide ? j->wide + (size_t)thread * 2 * ATTN_CHUNK * p->d_head : NULL;
    attention_one(p, wide, task / p->n_head, task % p->n_head);
}

void cpu_attention_ref(struct moe_threadpool *pool, const struct moe_attn_params *p)
{
    MOE_ASSERT(p->n_kv_head > 0 && p->n_head % p->n_kv_head == 0);
    MOE_ASSERT(p->block_size > 0 && p->d_head > 0 && p->d_v >= 0 && p->d_v <= p->d_head);
    MOE_ASSERT(moe_kv_dtype_valid(p->kv_dtype));
    struct ref_job j = {.p = p};
    if (p->kv_dtype != MOE_DTYPE_F32) {
        size_t n = (size_t)moe_threadpool_size(pool) * 2 * ATTN_CHUNK * p->d_head;
        j.wide = malloc(n * sizeof *j.wide);
        MOE_ASSERT(j.wide != NULL);
    }
    int n_tasks = p->n_tok * p->n_head;
    moe_threadpool_run(pool, n_tasks, attention_task, &j);
    free(j.wide);
}

void cpu_attention(struct moe_threadpool *pool, const struct moe_attn_params *p)
{
    MOE_ASSERT(p->n_kv_head > 0 && p->n_head % p->n_kv_head == 0);
    MOE_ASSERT(p->block_size > 0 && p->d_head > 0);
    if (cpu_attention_tiled_supported(p))
        cpu_attention_tiled(pool, p);
    else
        cpu_attention_ref(pool, p);
}
