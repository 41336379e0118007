/* The CPU backend: host memory and the kernels of kernels/cpu, run on a
 * thread pool that the backend owns. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "host_mem.h"

struct cpu_backend {
    struct moe_backend base; /* first: a struct moe_backend * is a struct cpu_backend * */
    struct moe_threadpool *pool;
    struct moe_error first_error; /* code MOE_OK while none (ops are called from one thread) */
    int32_t *cursor;              /* permute's counting-sort cursor */
    size_t cap_cursor;            /* entries */
};

static struct moe_threadpool *be_pool(struct moe_backend *be)
{
    return ((struct cpu_backend *)be)->pool;
}

/* 64-byte aligned and zeroed, freed with free(); large ones zeroed by the
 * kernel page by page as they are first touched (host_mem.h). */
static void *cpu_buf_alloc(struct moe_backend *be, size_t bytes)
{
    return moe_host_alloc_zeroed(bytes);
}

static void cpu_buf_free(struct moe_backend *be, void *p)
{
    free(p);
}

static void cpu_buf_copy(struct moe_backend *be, void *dst, const void *src, size_t bytes)
{
    if (bytes)
        memcpy(dst, src, bytes);
}

static void cpu_synchronize(struct moe_backend *be)
{
}

static void cpu_op_matmul(struct moe_backend *be, const struct moe_matmul_params *p)
{
    cpu_matmul(be_pool(be), p);
}

static void cpu_op_rmsnorm(struct moe_backend *be, const float *x, const float *w, float *y,
                           int n_rows, int dim, float eps)
{
    cpu_rmsnorm(be_pool(be), x, w, y, n_rows, dim, eps);
}

static void cpu_op_rope(struct moe_backend *be, float *x, const int32_t *pos, int n_tok,
                        int n_heads, int d_head, const float *inv_freq, float scale)
{
    cpu_rope(be_pool(be), x, pos, n_tok, n_heads, d_head, inv_freq, scale);
}

static void cpu_op_add_rmsnorm(struct moe_backend *be, float *x, const float *r, const float *w,
                               float *y, int n_rows, int dim, float eps)
{
    cpu_add_rmsnorm(be_pool(be), x, r, w, y, n_rows, dim, eps);
}

static void cpu_op_rope_kv_write(struct moe_backend *be, const struct moe_rope_kv_params *p)
{
    cpu_rope_kv_write(be_pool(be), p);
}

static void cpu_op_kv_write(struct moe_backend *be, const float *k, const float *v,
                            const int32_t *slots, int n_tok, int kv_dim, void *k_cache,
                            void *v_cache, enum moe_dtype kv_dtype)
{
    cpu_kv_write(k, v, slots, n_tok, kv_dim, k_cache, v_cache, kv_dtype);
}

static void cpu_op_attention(struct moe_backend *be, const struct moe_attn_params *p)
{
    cpu_attention(be_pool(be), p);
}

static void cpu_op_router_topk(struct moe_backend *be, const float *logits, int n_tok, int n_expert,
                               int top_k, bool renorm, int32_t *ids, float *weights)
{
    cpu_router_topk(logits, n_tok, n_expert, top_k, renorm, ids, weights);
}

static void cpu_op_router_topk_grouped(struct moe_backend *be,
                                       const struct moe_router_grouped_params *p)
{
    (void)be;
    cpu_router_topk_grouped(p);
}

static void cpu_op_copy_cols(struct moe_backend *be, float *dst, int ld_dst, const float *src,
                             int ld_src, int n_rows, int n_cols)
{
    (void)be;
    cpu_copy_cols(dst, ld_dst, src, ld_src, n_rows, n_cols);
}

static void cpu_op_swiglu(struct moe_backend *be, const float *gate_up, float *out, int n_rows,
                          int dim)
{
    cpu_swiglu(be_pool(be), gate_up, out, n_rows, dim);
}

static void cpu_op_gather_rows(struct moe_backend *be, const float *src, const int32_t *idx, int n,
                               int dim, float *dst)
{
    cpu_gather_rows(src, idx, n, dim, dst);
}

static void cpu_op_scatter_add_rows(struct moe_backend *be, const float *src, const int32_t *idx,
                                    const float *scale, int n, int dim, float *dst)
{
    cpu_scatter_add_rows(src, idx, scale, n, dim, dst);
}

static void cpu_op_embed(struct moe_backend *be, const void *table, enum moe_dtype dtype,
                         const int32_t *ids, int n_tok, int dim, float *dst)
{
    cpu_embed(table, dtype, ids, n_tok, dim, dst);
}

static void cpu_op_add(struct moe_backend *be, float *y, const float *x, size_t n)
{
    cpu_add(be_pool(be), y, x, n);
}

static void cpu_op_sigmoid(struct moe_backend *be, float *x, size_t n)
{
    (void)be;
    for (size_t i = 0; i < n; i++)
        x[i] = 1.0f / (1.0f + expf(-x[i]));
}

/* Keeps the first error of an op until `status` takes it. */
static void cpu_record(struct moe_backend *be, enum moe_status st, const struct moe_error *e)
{
    struct cpu_backend *cb = (struct cpu_backend *)be;
    if (st == MOE_OK || cb->first_error.code != MOE_OK)
        return;
    cb->first_error = *e;
    cb->first_error.code = st;
}

static enum moe_status cpu_status(struct moe_backend *be, struct moe_error *err)
{
    struct cpu_backend *cb = (struct cpu_backend *)be;
    enum moe_status st = cb->first_error.code;
    if (st != MOE_OK)
        moe_error_set(err, st, "cpu backend: %s", cb->first_error.msg);
    cb->first_error.code = MOE_OK;
    cb->first_error.msg[0] = '\0';
    return st;
}

static void cpu_buf_zero(struct moe_backend *be, void *p, size_t bytes)
{
    if (bytes)
        memset(p, 0, bytes);
}

static void cpu_op_grouped_matmul(struct moe_backend *be, const struct moe_grouped_matmul_params *p)
{
    struct moe_error e = {0};
    cpu_record(be, cpu_grouped_matmul(be_pool(be), p, &e), &e);
}

/* Any bound: the backend's buffers are host memory, the offsets read where
 * they are. */
static int cpu_grouped_device_rows(struct moe_backend *be, enum moe_dtype w_dtype)
{
    (void)be;
    (void)w_dtype;
    return INT_MAX;
}

static void cpu_op_permute(struct moe_backend *be, const struct moe_permute_params *p)
{
    struct cpu_backend *cb = (struct cpu_backend *)be;
    struct moe_error e = {0};
    size_t keys =
        (size_t)(p->n_dest > 0 ? p->n_dest : 1) * (size_t)(p->n_expert > 0 ? p->n_expert : 1);
    if (p->top_k < 1 || p->top_k > 64 || p->n_dest < 1 || p->n_expert < 1 || p->n_tok < 0) {
        cpu_record(be,
                   moe_error_set(&e, MOE_ERR_INVALID,
                                 "permute: bad sizes (n_tok %d, top_k %d (1..64), n_expert %d, "
                                 "n_dest %d)",
                                 p->n_tok, p->top_k, p->n_expert, p->n_dest),
                   &e);
        return;
    }
    if (keys > cb->cap_cursor) {
        int32_t *c = realloc(cb->cursor, keys * sizeof *c);
        if (!c) {
            cpu_record(be, moe_error_set(&e, MOE_ERR_NOMEM, "permute: out of memory"), &e);
            return;
        }
        cb->cursor = c;
        cb->cap_cursor = keys;
    }
    cpu_record(be, cpu_permute(p, cb->cursor, &e), &e);
}

static void cpu_op_unpermute_combine(struct moe_backend *be, const float *rows,
                                     const float *weights, const int32_t *tok_rows, int n_tok,
                                     int top_k, int dim, float *y)
{
    cpu_unpermute_combine(rows, weights, tok_rows, n_tok, top_k, dim, y);
}

static void cpu_op_argmax(struct moe_backend *be, const float *logits, int n, int vocab,
                          int32_t *out_ids)
{
    cpu_argmax(logits, n, vocab, out_ids);
}

static void cpu_op_sample_top_p(struct moe_backend *be, const float *logits, int n, int vocab,
                                float temperature, float top_p, const double *uniform,
                                int32_t *out_ids)
{
    struct moe_error e = {0};
    cpu_record(be, cpu_sample_top_p(logits, n, vocab, temperature, top_p, uniform, out_ids, &e),
               &e);
}

static void cpu_op_sample_rows(struct moe_backend *be, const float *logits, int n, int vocab,
                               const float *temperature, const float *top_p, const double *uniform,
                               int32_t *out_ids)
{
    struct moe_error e = {0};
    enum moe_status st = MOE_OK;
    for (int r = 0; r < n && st == MOE_OK; r++)
        st = cpu_sample_top_p(logits + (size_t)r * (size_t)vocab, 1, vocab, temperature[r],
                              top_p[r], uniform + r, out_ids + r, &e);
    cpu_record(be, st, &e);
}

static void cpu_op_kv_gather_blocks(struct moe_backend *be, const float *k_cache,
                                    const float *v_cache, const int32_t *block_ids, int n,
                                    int block_size, int kv_dim, float *out)
{
    cpu_kv_gather_blocks(k_cache, v_cache, block_ids, n, block_size, kv_dim, out);
}

static void cpu_op_kv_scatter_blocks(struct moe_backend *be, const float *in,
                                     const int32_t *block_ids, int n, int block_size, int kv_dim,
                                     float *k_cache, float *v_cache)
{
    cpu_kv_scatter_blocks(in, block_ids, n, block_size, kv_dim, k_cache, v_cache);
}

static const struct moe_backend_ops cpu_ops = {
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .buf_upload = cpu_buf_copy,
    .buf_download = cpu_buf_copy,
    .buf_copy = cpu_buf_copy,
    .synchronize = cpu_synchronize,
    .matmul = cpu_op_matmul,
    .rmsnorm = cpu_op_rmsnorm,
    .rope = cpu_op_rope,
    .kv_write = cpu_op_kv_write,
    .attention = cpu_op_attention,
    .router_topk = cpu_op_router_topk,
    .swiglu = cpu_op_swiglu,
    .gather_rows = cpu_op_gather_rows,
    .scatter_add_rows = cpu_op_scatter_add_rows,
    .embed = cpu_op_embed,
    .add = cpu_op_add,
    .status = cpu_status,
    .buf_zero = cpu_buf_zero,
    .grouped_matmul = cpu_op_grouped_matmul,
    .permute = cpu_op_permute,
    .unpermute_combine = cpu_op_unpermute_combine,
    .argmax = cpu_op_argmax,
    .sample_top_p = cpu_op_sample_top_p,
    .sample_rows = cpu_op_sample_rows,
    .kv_gather_blocks = cpu_op_kv_gather_blocks,
    .kv_scatter_blocks = cpu_op_kv_scatter_blocks,
    .copy_cols = cpu_op_copy_cols,
    .router_topk_grouped = cpu_op_router_topk_grouped,
    .sigmoid = cpu_op_sigmoid,
    .grouped_device_rows = cpu_grouped_device_rows,
    .add_rmsnorm = cpu_op_add_rmsnorm,
    .rope_kv_write = cpu_op_rope_kv_write,
};

enum moe_status moe_backend_cpu_create(int n_threads, struct moe_backend **out,
                                       struct moe_error *err)
{
    *out = NULL;
    struct cpu_backend *cb = calloc(1, sizeof(*cb));
    if (!cb)
        return moe_error_set(err, MOE_ERR_NOMEM, "cpu backend: out of memory");
    enum moe_status st = moe_threadpool_create(n_threads, &cb->pool, err);
    if (st != MOE_OK)
        goto fail;
    cpu_kernels_env(); /* the ISA is fixed before any kernel runs */
    cb->base.name = "cpu";
    cb->base.device = MOE_DEVICE_CPU;
    cb->base.ops = &cpu_ops;
    cb->base.ctx = cb;
    cb->base.ordinal = -1;
    char feats[96];
    unsigned f = cpu_kernels_features();
    snprintf(cb->base.label, sizeof cb->base.label, "cpu (%d thread%s, %s%s%s)",
             moe_threadpool_size(cb->pool), moe_threadpool_size(cb->pool) == 1 ? "" : "s",
             cpu_isa_name(cpu_kernels_isa()), f ? " + " : "",
             f ? cpu_features_name(f, feats, sizeof feats) : "");
    *out = &cb->base;
    return MOE_OK;
fail:
    free(cb);
    return st;
}

void cpu_backend_destroy(struct moe_backend *be)
{
    if (!be)
        return;
    struct cpu_backend *cb = (struct cpu_backend *)be;
    moe_threadpool_destroy(cb->pool);
    free(cb->cursor);
    free(cb);
}
