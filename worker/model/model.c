/* Mixtral / Qwen3-MoE forward pass over a paged KV cache.
 *
 * Per layer (shapes for one shard; n = n_tok):
 *   h   = rmsnorm(x)                          (n, d_model)
 *   q,k,v = h Wq^T, h Wk^T, h Wv^T            (n, n_head*d_head), (n, n_kv_head*d_head) x2
 *   [Qwen3] per-head rmsnorm of q and k
 *   rope(q), rope(k); k,v -> cache slots
 *   a   = attention(q, cache)                 (n, n_head*d_head)
 *   x  += a Wo^T
 *   h   = rmsnorm(x)
 *   MoE: router logits -> top-k -> tokens grouped by expert ->
 *        per expert: gather, [gate|up] = h We^T, silu(gate)*up, down, weighted scatter-add
 *   dense (Qwen3 mlp_only_layers): the same FFN for every token, weight 1
 *   x  += ffn
 * then final rmsnorm and lm_head on the rows that need logits.
 *
 * Memory is touched only through the backend, so the same code runs on any
 * backend. Router decisions come back to the host to group tokens by expert
 * (a few bytes per token). */
#include "model/model.h"
#include "model/model_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/placement.h"
#include "quant.h"
#include "safetensors.h"

/* ---- loading ------------------------------------------------------------------ */

struct loader {
    struct moe_model *m;
    struct st_model *st;
    const char *dir;
};

/* Looks a tensor up and checks its shape against what config.json implies. */
static enum moe_status find_tensor(struct loader *ld, const char *name, int n_dim, int64_t d0,
                                   int64_t d1, const struct st_tensor **out, struct moe_error *err)
{
    const struct st_tensor *t = st_find(ld->st, name);
    if (!t)
        return moe_error_set(err, MOE_ERR_NOT_FOUND, "%s: tensor '%s' not found in the checkpoint",
                             ld->dir, name);
    int64_t want[2] = {d0, d1};
    bool ok = t->n_dim == n_dim;
    for (int i = 0; ok && i < n_dim; i++)
        ok = t->shape[i] == want[i];
    if (!ok) {
        char got[128] = "";
        size_t len = 0;
        for (int i = 0; i < t->n_dim && len < sizeof got - 24; i++)
            len += (size_t)snprintf(got + len, sizeof got - len, "%s%lld", i ? ", " : "",
                                    (long long)t->shape[i]);
        if (n_dim == 1)
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "%s: tensor '%s' has shape [%s], config.json implies [%lld]",
                                 t->file, name, got, (long long)d0);
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s' has shape [%s], config.json implies [%lld, %lld]",
                             t->file, name, got, (long long)d0, (long long)d1);
    }
    *out = t;
    return MOE_OK;
}

/* Bytes of a Linear weight (n_rows, n_cols) as the model stores it. */
static size_t linear_bytes(const struct moe_model *m, int64_t n_rows, int64_t n_cols)
{
    if (m->lin_dtype == MOE_DTYPE_I8)
        return moe_i8_weight_bytes(n_rows, n_cols);
    return (size_t)n_rows * (size_t)n_cols * moe_dtype_size(m->lin_dtype);
}

/* Copies `bytes` of host memory into a new backend buffer (*out), counted in
 * the model's weight bytes. Frees `host` in every case. */
static enum moe_status upload_weight(struct loader *ld, const char *name, void *host, size_t bytes,
                                     void **out, struct moe_error *err)
{
    struct moe_backend *be = ld->m->be;
    void *buf = be->ops->buf_alloc(be, bytes);
    if (!buf) {
        free(host);
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: cannot allocate %zu bytes for '%s'", ld->dir,
                             bytes, name);
    }
    be->ops->buf_upload(be, buf, host, bytes);
    free(host);
    ld->m->weight_bytes += bytes;
    *out = buf;
    return MOE_OK;
}

/* Quantizes the f32 values of a Linear weight (n_rows, n_cols) to the int8
 * image (values, then row scales) and uploads it; under the i8_dequantized
 * test hook, uploads q * scale as f32 instead. Frees `f32` in every case. */
static enum moe_status upload_quantized(struct loader *ld, const char *name, float *f32,
                                        int64_t n_rows, int64_t n_cols, void **out,
                                        struct moe_error *err)
{
    size_t img_bytes = moe_i8_weight_bytes(n_rows, n_cols);
    char *img = calloc(1, img_bytes);
    if (!img) {
        free(f32);
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory quantizing '%s'", ld->dir,
                             name);
    }
    float *scale = (float *)(img + moe_i8_scale_offset(n_rows, n_cols));
    if (!moe_quant_i8_rows(f32, n_rows, n_cols, (int8_t *)img, scale)) {
        free(img);
        free(f32);
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s' holds a NaN or infinite weight; --dtype int8 "
                             "cannot quantize it",
                             ld->dir, name);
    }
    if (!ld->m->opts.i8_dequantized) {
        free(f32);
        return upload_weight(ld, name, img, img_bytes, out, err);
    }
    moe_dequant_i8_rows((const int8_t *)img, scale, n_rows, n_cols, f32);
    free(img);
    return upload_weight(ld, name, f32, (size_t)n_rows * (size_t)n_cols * sizeof(float), out, err);
}

/* Allocates a backend buffer and fills it with rows [row0, row0+n_rows) and
 * cols [col0, col0+n_cols) of tensor `name` (full shape rows x cols), in
 * `dtype`; I8 quantizes the block (read as f32) row by row. */
static enum moe_status load_block(struct loader *ld, const char *name, int64_t rows, int64_t cols,
                                  int64_t row0, int64_t n_rows, int64_t col0, int64_t n_cols,
                                  enum moe_dtype dtype, void **out, struct moe_error *err)
{
    const struct st_tensor *t;
    enum moe_status rc = find_tensor(ld, name, cols ? 2 : 1, rows, cols, &t, err);
    if (rc)
        return rc;
    if (!cols) { /* 1-D: one row of `rows` elements */
        n_cols = n_rows;
        col0 = row0;
        n_rows = 1;
        row0 = 0;
    }
    enum moe_dtype read_dtype = dtype == MOE_DTYPE_I8 ? MOE_DTYPE_F32 : dtype;
    size_t bytes = (size_t)n_rows * (size_t)n_cols * moe_dtype_size(read_dtype);
    void *host = malloc(bytes ? bytes : 1);
    if (!host)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory loading '%s'", ld->dir, name);
    rc = st_read_block(t, row0, n_rows, col0, n_cols, read_dtype, host, err);
    if (rc) {
        free(host);
        return rc;
    }
    if (dtype == MOE_DTYPE_I8)
        return upload_quantized(ld, name, host, n_rows, n_cols, out, err);
    return upload_weight(ld, name, host, bytes, out, err);
}

/* A whole Linear weight (rows, cols), in the model's weight dtype (I8: quantized). */
static enum moe_status load_matrix(struct loader *ld, const char *name, int64_t rows, int64_t cols,
                                   void **out, struct moe_error *err)
{
    return load_block(ld, name, rows, cols, 0, rows, 0, cols, ld->m->opts.dtype, out, err);
}

/* Norm weights stay f32 on the device; with bf16 weights they are rounded to
 * bf16 first, so "--dtype bf16" means every weight of the model in bf16, as
 * model.to(torch.bfloat16) does (int8 models keep their unquantized weights
 * as bf16 models do). */
static enum moe_status load_norm(struct loader *ld, const char *name, int64_t dim, float **out,
                                 struct moe_error *err)
{
    const struct st_tensor *t;
    enum moe_status rc = find_tensor(ld, name, 1, dim, 0, &t, err);
    if (rc)
        return rc;
    float *host = malloc((size_t)dim * sizeof *host);
    if (!host)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory loading '%s'", ld->dir, name);
    rc = st_read_block(t, 0, 1, 0, dim, MOE_DTYPE_F32, host, err);
    if (!rc && ld->m->base_dtype == MOE_DTYPE_BF16)
        for (int64_t i = 0; i < dim; i++)
            host[i] = moe_bf16_to_f32(moe_f32_to_bf16(host[i]));
    struct moe_backend *be = ld->m->be;
    float *buf = rc ? NULL : be->ops->buf_alloc(be, (size_t)dim * sizeof *buf);
    if (!rc && !buf)
        rc = moe_error_set(err, MOE_ERR_NOMEM, "%s: cannot allocate '%s'", ld->dir, name);
    if (!rc) {
        be->ops->buf_upload(be, buf, host, (size_t)dim * sizeof *buf);
        ld->m->weight_bytes += (size_t)dim * sizeof *buf;
        *out = buf;
    }
    free(host);
    return rc;
}

/* Loads gate and up projections (each (d_ff, d_model)) into one (2*d_ff, d_model)
 * buffer: gate rows first, then up rows, matching the backend's swiglu. With
 * I8 the fused weight is quantized as one (rows are independent). */
static enum moe_status load_gate_up(struct loader *ld, const char *gate_name, const char *up_name,
                                    int64_t d_ff, int64_t d_model, void **out,
                                    struct moe_error *err)
{
    const struct st_tensor *tg, *tu;
    enum moe_status rc = find_tensor(ld, gate_name, 2, d_ff, d_model, &tg, err);
    if (!rc)
        rc = find_tensor(ld, up_name, 2, d_ff, d_model, &tu, err);
    if (rc)
        return rc;
    enum moe_dtype dt = ld->m->opts.dtype == MOE_DTYPE_I8 ? MOE_DTYPE_F32 : ld->m->opts.dtype;
    size_t half = (size_t)d_ff * (size_t)d_model * moe_dtype_size(dt);
    char *host = malloc(2 * half);
    if (!host)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory loading '%s'", ld->dir,
                             gate_name);
    rc = st_read_block(tg, 0, d_ff, 0, d_model, dt, host, err);
    if (!rc)
        rc = st_read_block(tu, 0, d_ff, 0, d_model, dt, host + half, err);
    if (rc) {
        free(host);
        return rc;
    }
    if (ld->m->opts.dtype == MOE_DTYPE_I8)
        return upload_quantized(ld, gate_name, (float *)host, 2 * d_ff, d_model, out, err);
    return upload_weight(ld, gate_name, host, 2 * half, out, err);
}

/* Loads expert e of MoE layer l: gate and up fused, and down. */
static enum moe_status load_expert(struct loader *ld, int l, int e, void **gate_up, void **down,
                                   struct moe_error *err)
{
    const struct moe_config *c = &ld->m->cfg;
    const char *moe = c->arch == MOE_ARCH_MIXTRAL ? "block_sparse_moe" : "mlp";
    const char *g = c->arch == MOE_ARCH_MIXTRAL ? "w1" : "gate_proj";
    const char *u = c->arch == MOE_ARCH_MIXTRAL ? "w3" : "up_proj";
    const char *dn = c->arch == MOE_ARCH_MIXTRAL ? "w2" : "down_proj";
    char name[256], name2[256];
    snprintf(name, sizeof name, "model.layers.%d.%s.experts.%d.%s.weight", l, moe, e, g);
    snprintf(name2, sizeof name2, "model.layers.%d.%s.experts.%d.%s.weight", l, moe, e, u);
    enum moe_status rc = load_gate_up(ld, name, name2, c->d_ff_expert, c->d_model, gate_up, err);
    if (rc)
        return rc;
    snprintf(name, sizeof name, "model.layers.%d.%s.experts.%d.%s.weight", l, moe, e, dn);
    return load_matrix(ld, name, c->d_model, c->d_ff_expert, down, err);
}

static enum moe_status load_layer(struct loader *ld, int l, struct moe_error *err)
{
    struct moe_model *m = ld->m;
    const struct moe_config *c = &m->cfg;
    struct layer_weights *w = &m->layers[l];
    const int64_t d = c->d_model, dh = c->d_head;
    const int64_t q0 = (int64_t)m->opts.tp_rank * m->q_dim;
    const int64_t kv0 = (int64_t)m->opts.tp_rank * m->kv_dim;
    char name[256], name2[256];
    enum moe_status rc;

#define NAME(buf, ...) snprintf(buf, sizeof buf, __VA_ARGS__)
    NAME(name, "model.layers.%d.input_layernorm.weight", l);
    if ((rc = load_norm(ld, name, d, &w->attn_norm, err)))
        return rc;
    NAME(name, "model.layers.%d.post_attention_layernorm.weight", l);
    if ((rc = load_norm(ld, name, d, &w->ffn_norm, err)))
        return rc;
    NAME(name, "model.layers.%d.self_attn.q_proj.weight", l);
    if ((rc = load_block(ld, name, (int64_t)c->n_head * dh, d, q0, m->q_dim, 0, d, m->opts.dtype,
                         &w->wq, err)))
        return rc;
    NAME(name, "model.layers.%d.self_attn.k_proj.weight", l);
    if ((rc = load_block(ld, name, (int64_t)c->n_kv_head * dh, d, kv0, m->kv_dim, 0, d,
                         m->opts.dtype, &w->wk, err)))
        return rc;
    NAME(name, "model.layers.%d.self_attn.v_proj.weight", l);
    if ((rc = load_block(ld, name, (int64_t)c->n_kv_head * dh, d, kv0, m->kv_dim, 0, d,
                         m->opts.dtype, &w->wv, err)))
        return rc;
    NAME(name, "model.layers.%d.self_attn.o_proj.weight", l);
    if ((rc = load_block(ld, name, d, (int64_t)c->n_head * dh, 0, d, q0, m->q_dim, m->opts.dtype,
                         &w->wo, err)))
        return rc;
    if (c->qk_norm) {
        NAME(name, "model.layers.%d.self_attn.q_norm.weight", l);
        if ((rc = load_norm(ld, name, dh, &w->q_norm, err)))
            return rc;
        NAME(name, "model.layers.%d.self_attn.k_norm.weight", l);
        if ((rc = load_norm(ld, name, dh, &w->k_norm, err)))
            return rc;
    }

    w->is_moe = c->layer_is_moe[l];
    const char *moe = c->arch == MOE_ARCH_MIXTRAL ? "block_sparse_moe" : "mlp";
    if (!w->is_moe) {
        NAME(name, "model.layers.%d.mlp.gate_proj.weight", l);
        NAME(name2, "model.layers.%d.mlp.up_proj.weight", l);
        if ((rc = load_gate_up(ld, name, name2, c->d_ff_dense, d, &w->dense_gate_up, err)))
            return rc;
        NAME(name, "model.layers.%d.mlp.down_proj.weight", l);
        return load_matrix(ld, name, d, c->d_ff_dense, &w->dense_down, err);
    }
    /* The router stays unquantized (base_dtype): int8 noise on its logits
     * could flip an expert choice, which changes a token's output far more
     * than the noise itself; it is also tiny. */
    NAME(name, "model.layers.%d.%s.gate.weight", l, moe);
    if ((rc = load_block(ld, name, c->n_expert, d, 0, c->n_expert, 0, d, m->base_dtype, &w->router,
                         err)))
        return rc;
    w->w_gate_up = calloc((size_t)c->n_expert, sizeof *w->w_gate_up);
    w->w_down = calloc((size_t)c->n_expert, sizeof *w->w_down);
    if (!w->w_gate_up || !w->w_down)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    for (int e = 0; e < c->n_expert; e++) {
        if (m->ep_comm && !moe_placement_holds(&m->placement, l, e, m->ep_comm->rank))
            continue; /* another rank's expert */
        if ((rc = load_expert(ld, l, e, &w->w_gate_up[e], &w->w_down[e], err)))
            return rc;
    }
#undef NAME
    return MOE_OK;
}

static enum moe_status check_opts(const struct moe_config *c, const struct moe_model_opts *o,
                                  const char *dir, struct moe_error *err)
{
    if (o->dtype != MOE_DTYPE_F32 && o->dtype != MOE_DTYPE_BF16 && o->dtype != MOE_DTYPE_I8)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "weight dtype %s is not supported (use f32, bf16 or int8)",
                             moe_dtype_name(o->dtype));
    if (o->i8_dequantized && o->dtype != MOE_DTYPE_I8)
        return moe_error_set(err, MOE_ERR_INVALID, "i8_dequantized needs weight dtype I8, not %s",
                             moe_dtype_name(o->dtype));
    if (o->tp_size < 1 || o->tp_rank < 0 || o->tp_rank >= o->tp_size)
        return moe_error_set(err, MOE_ERR_INVALID, "tensor-parallel rank %d of %d is invalid",
                             o->tp_rank, o->tp_size);
    if (c->n_head % o->tp_size)
        return moe_error_set(
            err, MOE_ERR_INVALID,
            "%s: num_attention_heads %d is not divisible by tensor-parallel size %d", dir,
            c->n_head, o->tp_size);
    if (o->tp_size > 1 &&
        (!o->tp_comm || o->tp_comm->size != o->tp_size || o->tp_comm->rank != o->tp_rank))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "tensor-parallel size %d needs a communicator of that size",
                             o->tp_size);
    if (o->ep_comm && o->ep_comm->size > MOE_MAX_EP_RANKS)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED, "expert parallel over %d ranks (at most %d)",
                             o->ep_comm->size, MOE_MAX_EP_RANKS);
    if (c->n_kv_head % o->tp_size)
        return moe_error_set(
            err, MOE_ERR_UNSUPPORTED,
            "%s: num_key_value_heads %d is not divisible by tensor-parallel size %d "
            "(replicating KV heads is not implemented)",
            dir, c->n_kv_head, o->tp_size);
    return MOE_OK;
}

enum moe_status moe_model_load(const char *dir, const struct moe_model_opts *opts,
                               struct moe_backend *be, struct moe_model **out,
                               struct moe_error *err)
{
    *out = NULL;
    struct moe_model *m = calloc(1, sizeof *m);
    if (!m)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    m->be = be;
    m->opts = *opts;
    m->lin_dtype = opts->dtype;
    m->base_dtype = opts->dtype;
    if (opts->dtype == MOE_DTYPE_I8) {
        m->lin_dtype = opts->i8_dequantized ? MOE_DTYPE_F32 : MOE_DTYPE_I8;
        m->base_dtype = MOE_DTYPE_BF16;
    }
    struct loader ld = {.m = m, .dir = dir};
    enum moe_status rc;
    if (!(m->dir = strdup(dir))) {
        free(m);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }

    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if ((rc = moe_config_load(path, &m->cfg, err)))
        goto fail;
    const struct moe_config *c = &m->cfg;
    if ((rc = check_opts(c, opts, dir, err)))
        goto fail;
    if (m->lin_dtype == MOE_DTYPE_I8 && be->device != MOE_DEVICE_CPU) {
        /* Refused here, before any weight moves: the CUDA matmuls would
         * reject every call and the forward pass would only fail later. */
        rc = moe_error_set(err, MOE_ERR_UNSUPPORTED,
                           "--dtype int8: the %s backend has no int8 kernels yet; use --device cpu",
                           be->name);
        goto fail;
    }
    m->tp_comm = opts->tp_size > 1 ? opts->tp_comm : NULL;
    m->ep_comm = opts->ep_comm && opts->ep_comm->size > 1 ? opts->ep_comm : NULL;
    if (m->ep_comm) {
        int w = m->ep_comm->size;
        if (opts->placement) {
            const struct moe_placement *pl = opts->placement;
            if (pl->n_rank != w || pl->n_expert != c->n_expert || pl->n_layer != c->n_layer) {
                rc = moe_error_set(err, MOE_ERR_INVALID,
                                   "placement is for %d experts x %d layers on %d ranks; the model "
                                   "has %d x %d and the group %d ranks",
                                   pl->n_expert, pl->n_layer, pl->n_rank, c->n_expert, c->n_layer,
                                   w);
                goto fail;
            }
            rc = moe_placement_default(c->n_layer, c->n_expert, w, &m->placement, err);
            if (!rc) {
                size_t n = (size_t)c->n_layer * c->n_expert;
                memcpy(m->placement.n_replicas, pl->n_replicas, n);
                memcpy(m->placement.ranks, pl->ranks,
                       n * MOE_PLACEMENT_MAX_REPLICAS * sizeof *pl->ranks);
            }
        } else {
            rc = moe_placement_default(c->n_layer, c->n_expert, w, &m->placement, err);
        }
        if (rc)
            goto fail;
    }
    m->n_head_local = c->n_head / opts->tp_size;
    m->n_kv_head_local = c->n_kv_head / opts->tp_size;
    m->q_dim = m->n_head_local * c->d_head;
    m->kv_dim = m->n_kv_head_local * c->d_head;

    if ((rc = st_open(dir, &ld.st, err)))
        goto fail;
    if ((rc = load_block(&ld, "model.embed_tokens.weight", c->vocab_size, c->d_model, 0,
                         c->vocab_size, 0, c->d_model, m->base_dtype, &m->embed, err)))
        goto fail;
    if ((rc = load_norm(&ld, "model.norm.weight", c->d_model, &m->final_norm, err)))
        goto fail;
    if (c->tie_word_embeddings && m->lin_dtype == m->base_dtype) {
        m->lm_head = m->embed;
    } else if (c->tie_word_embeddings) { /* int8 lm_head: a quantized copy of the table */
        if ((rc = load_matrix(&ld, "model.embed_tokens.weight", c->vocab_size, c->d_model,
                              &m->lm_head, err)))
            goto fail;
    } else if ((rc = load_matrix(&ld, "lm_head.weight", c->vocab_size, c->d_model, &m->lm_head,
                                 err))) {
        goto fail;
    }
    m->layers = calloc((size_t)c->n_layer, sizeof *m->layers);
    m->expert_tokens =
        calloc((size_t)c->n_layer * (c->n_expert > 0 ? c->n_expert : 1), sizeof *m->expert_tokens);
    if (!m->layers || !m->expert_tokens) {
        rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        goto fail;
    }
    for (int l = 0; l < c->n_layer; l++)
        if ((rc = load_layer(&ld, l, err)))
            goto fail;
    st_close(ld.st);
    *out = m;
    return MOE_OK;

fail:
    st_close(ld.st);
    moe_model_free(m);
    return rc;
}

static void scratch_free(struct moe_model *m)
{
    struct moe_backend *be = m->be;
    struct scratch *s = &m->s;
    void *dev[] = {s->x,
                   s->h,
                   s->q,
                   s->k,
                   s->v,
                   s->att,
                   s->o,
                   s->ffn_out,
                   s->router_logits,
                   s->topk_ids,
                   s->xe,
                   s->gate_up,
                   s->act,
                   s->ye,
                   s->route_idx,
                   s->ones,
                   s->iota,
                   s->tokens,
                   s->pos,
                   s->seq,
                   s->slots,
                   s->block_tables,
                   s->logit_rows,
                   s->logits,
                   s->ep_send,
                   s->ep_recv,
                   s->ep_out,
                   s->ep_ret,
                   s->ep_ids,
                   s->ep_rids,
                   s->ep_idx,
                   s->ep_w};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i])
            be->ops->buf_free(be, dev[i]);
    free(s->h_ids);
    free(s->h_route_idx);
    free(s->h_counts);
    free(s->h_zero);
    free(s->h_ep_tok);
    free(s->h_ep_exp);
    free(s->h_ep_pos);
    free(s->h_ep_rexp);
    free(s->h_ep_idx);
    free(s->h_ep_w);
    memset(s, 0, sizeof *s);
}

#define FREE_PENDING(p)                                                                            \
    do {                                                                                           \
        if (p)                                                                                     \
            m->be->ops->buf_free(m->be, p);                                                        \
    } while (0)

void moe_model_free(struct moe_model *m)
{
    if (!m)
        return;
    struct moe_backend *be = m->be;
#define FREE_BUF(p)                                                                                \
    do {                                                                                           \
        if (p)                                                                                     \
            be->ops->buf_free(be, p);                                                              \
    } while (0)
    if (m->layers) {
        for (int l = 0; l < m->cfg.n_layer; l++) {
            struct layer_weights *w = &m->layers[l];
            FREE_BUF(w->attn_norm);
            FREE_BUF(w->ffn_norm);
            FREE_BUF(w->wq);
            FREE_BUF(w->wk);
            FREE_BUF(w->wv);
            FREE_BUF(w->wo);
            FREE_BUF(w->q_norm);
            FREE_BUF(w->k_norm);
            FREE_BUF(w->router);
            FREE_BUF(w->dense_gate_up);
            FREE_BUF(w->dense_down);
            for (int e = 0; w->w_gate_up && e < m->cfg.n_expert; e++)
                FREE_BUF(w->w_gate_up[e]);
            for (int e = 0; w->w_down && e < m->cfg.n_expert; e++)
                FREE_BUF(w->w_down[e]);
            free(w->w_gate_up);
            free(w->w_down);
        }
        free(m->layers);
    }
    if (m->lm_head != m->embed)
        FREE_BUF(m->lm_head);
    FREE_BUF(m->embed);
    FREE_BUF(m->final_norm);
#undef FREE_BUF
    scratch_free(m);
    if (m->pending_gate_up) {
        for (size_t i = 0; i < (size_t)m->cfg.n_layer * m->cfg.n_expert; i++) {
            FREE_PENDING(m->pending_gate_up[i]);
            FREE_PENDING(m->pending_down[i]);
        }
    }
    free(m->pending_gate_up);
    free(m->pending_down);
    moe_placement_free(&m->pending);
    moe_placement_free(&m->placement);
    free(m->expert_tokens);
    free(m->dir);
    free(m);
}

const struct moe_config *moe_model_config(const struct moe_model *m)
{
    return &m->cfg;
}

size_t moe_model_weight_bytes(const struct moe_model *m)
{
    return m->weight_bytes;
}

void moe_model_zero(struct moe_model *m, void *p, size_t bytes)
{
    if (m->be->ops->buf_zero)
        m->be->ops->buf_zero(m->be, p, bytes); /* a device memset, no host round trip */
    else
        m->be->ops->buf_upload(m->be, p, m->s.h_zero, bytes);
}

double moe_model_clock(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void moe_model_profile(const struct moe_model *m, struct moe_model_profile *out)
{
    *out = m->prof;
}

void moe_model_ep_traffic(const struct moe_model *m, uint64_t *bytes_sent, uint64_t *rows_routed)
{
    *bytes_sent = m->ep_bytes_sent;
    *rows_routed = m->ep_rows_routed;
}

/* ---- KV cache -------------------------------------------------------------------- */

enum moe_status moe_kv_cache_alloc(struct moe_backend *be, int n_layer, int n_block, int block_size,
                                   int kv_dim, struct moe_kv_cache **out, struct moe_error *err)
{
    *out = NULL;
    if (n_layer <= 0 || n_block <= 0 || block_size <= 0 || kv_dim <= 0)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "KV cache of %d layers x %d blocks of %d tokens x %d floats is "
                             "invalid",
                             n_layer, n_block, block_size, kv_dim);
    struct moe_kv_cache *kv = calloc(1, sizeof *kv);
    if (!kv)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    kv->n_layer = n_layer;
    kv->n_block = n_block;
    kv->block_size = block_size;
    kv->kv_dim = kv_dim;
    kv->k = calloc((size_t)kv->n_layer, sizeof *kv->k);
    kv->v = calloc((size_t)kv->n_layer, sizeof *kv->v);
    if (!kv->k || !kv->v)
        goto nomem;
    size_t bytes = (size_t)n_block * (size_t)block_size * (size_t)kv->kv_dim * sizeof(float);
    for (int l = 0; l < kv->n_layer; l++) {
        kv->k[l] = be->ops->buf_alloc(be, bytes);
        kv->v[l] = be->ops->buf_alloc(be, bytes);
        if (!kv->k[l] || !kv->v[l])
            goto nomem;
    }
    *out = kv;
    return MOE_OK;
nomem:
    moe_kv_cache_release(be, kv);
    return moe_error_set(err, MOE_ERR_NOMEM, "cannot allocate a KV cache of %d blocks x %d tokens",
                         n_block, block_size);
}

void moe_kv_cache_release(struct moe_backend *be, struct moe_kv_cache *kv)
{
    if (!kv)
        return;
    for (int l = 0; l < kv->n_layer; l++) {
        if (kv->k && kv->k[l])
            be->ops->buf_free(be, kv->k[l]);
        if (kv->v && kv->v[l])
            be->ops->buf_free(be, kv->v[l]);
    }
    free(kv->k);
    free(kv->v);
    free(kv);
}

enum moe_status moe_kv_cache_create(const struct moe_model *m, int n_block, int block_size,
                                    struct moe_kv_cache **out, struct moe_error *err)
{
    return moe_kv_cache_alloc(m->be, m->cfg.n_layer, n_block, block_size, m->kv_dim, out, err);
}

void moe_kv_cache_free(const struct moe_model *m, struct moe_kv_cache *kv)
{
    moe_kv_cache_release(m->be, kv);
}

/* ---- forward ------------------------------------------------------------------------ */

static enum moe_status scratch_reserve(struct moe_model *m, int n_tok, int n_table,
                                       struct moe_error *err)
{
    struct scratch *s = &m->s;
    if (n_tok <= s->cap_tok && n_table > s->cap_seq_blocks) {
        /* Only the block tables grew (sequences got longer): regrow them
         * alone, geometrically, so long decodes do not reallocate every
         * activation buffer each time a sequence takes another block. */
        int cap_tab = s->cap_seq_blocks * 2 > n_table ? s->cap_seq_blocks * 2 : n_table;
        int32_t *t = m->be->ops->buf_alloc(m->be, (size_t)cap_tab * sizeof(int32_t));
        if (!t)
            return moe_error_set(err, MOE_ERR_NOMEM, "cannot allocate block tables for %d entries",
                                 cap_tab);
        m->be->ops->buf_free(m->be, s->block_tables);
        s->block_tables = t;
        s->cap_seq_blocks = cap_tab;
    }
    if (n_tok <= s->cap_tok && n_table <= s->cap_seq_blocks)
        return MOE_OK;
    int cap = n_tok > s->cap_tok ? n_tok : s->cap_tok;
    int cap_tab = n_table > s->cap_seq_blocks ? n_table : s->cap_seq_blocks;
    scratch_free(m);
    const struct moe_config *c = &m->cfg;
    struct moe_backend *be = m->be;
    size_t n = (size_t)cap;
    int d_ff_max = c->d_ff_expert > c->d_ff_dense ? c->d_ff_expert : c->d_ff_dense;
    size_t n_route = n * (size_t)(c->top_k > 0 ? c->top_k : 1);
    bool ok = true;
#define ALLOC(field, count, type)                                                                  \
    do {                                                                                           \
        s->field = be->ops->buf_alloc(be, (count) * sizeof(type));                                 \
        ok = ok && s->field;                                                                       \
    } while (0)
    ALLOC(x, n * c->d_model, float);
    ALLOC(h, n * c->d_model, float);
    ALLOC(q, n * m->q_dim, float);
    ALLOC(k, n * m->kv_dim, float);
    ALLOC(v, n * m->kv_dim, float);
    ALLOC(att, n * m->q_dim, float);
    ALLOC(o, n * c->d_model, float);
    ALLOC(ffn_out, (n + MOE_MAX_EP_RANKS) * c->d_model, float); /* + padding for all-gather */
    ALLOC(router_logits, n * (size_t)(c->n_expert > 0 ? c->n_expert : 1), float);
    /* ids then weights in one buffer, so one copy moves both (see ffn_block) */
    ALLOC(topk_ids, 2 * n_route, int32_t);
    ALLOC(xe, n * c->d_model, float);
    ALLOC(gate_up, n * 2 * (size_t)d_ff_max, float);
    ALLOC(act, n * (size_t)d_ff_max, float);
    ALLOC(ye, n * c->d_model, float);
    ALLOC(route_idx, 2 * n_route, int32_t); /* token indexes then weights */
    ALLOC(ones, n, float);
    ALLOC(iota, n, int32_t);
    ALLOC(tokens, n, int32_t);
    ALLOC(pos, n, int32_t);
    ALLOC(seq, n, int32_t);
    ALLOC(slots, n, int32_t);
    ALLOC(block_tables, (size_t)(cap_tab > 0 ? cap_tab : 1), int32_t);
    ALLOC(logit_rows, n, int32_t);
    ALLOC(logits, n * c->vocab_size, float);
    if (m->ep_comm) {
        ALLOC(ep_send, n_route * c->d_model, float);
        ALLOC(ep_recv, n_route * c->d_model, float);
        ALLOC(ep_out, n_route * c->d_model, float);
        ALLOC(ep_ret, n_route * c->d_model, float);
        ALLOC(ep_ids, n_route, int32_t);
        ALLOC(ep_rids, n_route, int32_t);
        ALLOC(ep_idx, n_route, int32_t);
        ALLOC(ep_w, n_route, float);
        s->h_ep_tok = malloc(n_route * sizeof *s->h_ep_tok);
        s->h_ep_exp = malloc(n_route * sizeof *s->h_ep_exp);
        s->h_ep_pos = malloc(n_route * sizeof *s->h_ep_pos);
        s->h_ep_rexp = malloc(n_route * sizeof *s->h_ep_rexp);
        s->h_ep_idx = malloc(n_route * sizeof *s->h_ep_idx);
        s->h_ep_w = malloc(n_route * sizeof *s->h_ep_w);
        ok = ok && s->h_ep_tok && s->h_ep_exp && s->h_ep_pos && s->h_ep_rexp && s->h_ep_idx &&
             s->h_ep_w;
    }
#undef ALLOC
    s->h_ids = malloc(2 * n_route * sizeof *s->h_ids); /* ids then weights */
    s->h_route_idx = malloc(2 * n_route * sizeof *s->h_route_idx);
    s->h_counts = malloc(((size_t)c->n_expert + 1) * sizeof *s->h_counts);
    s->h_zero = calloc((n_route > n + MOE_MAX_EP_RANKS ? n_route : n + MOE_MAX_EP_RANKS) *
                           (size_t)c->d_model,
                       sizeof *s->h_zero);
    float *h_ones = malloc(n * sizeof *h_ones);
    int32_t *h_iota = malloc(n * sizeof *h_iota);
    ok = ok && s->h_ids && s->h_route_idx && s->h_counts && s->h_zero && h_ones && h_iota;
    if (!ok) {
        free(h_ones);
        free(h_iota);
        scratch_free(m);
        return moe_error_set(err, MOE_ERR_NOMEM, "cannot allocate activations for %d tokens", cap);
    }
    for (int i = 0; i < cap; i++) {
        h_ones[i] = 1.0f;
        h_iota[i] = i;
    }
    be->ops->buf_upload(be, s->ones, h_ones, n * sizeof(float));
    be->ops->buf_upload(be, s->iota, h_iota, n * sizeof(int32_t));
    free(h_ones);
    free(h_iota);
    s->cap_tok = cap;
    s->cap_seq_blocks = cap_tab;
    return MOE_OK;
}

/* y (n_tok, n_out) (+)= x W^T, W (n_out, n_in) a whole weight in `dtype`
 * (I8: its row scales follow the values in the same buffer). */
static void matmul_dtype(struct moe_model *m, enum moe_dtype dtype, const float *x, int n_tok,
                         int n_in, const void *w, int n_out, float *y, bool accumulate)
{
    struct moe_matmul_params p = {
        .x = x,
        .n_tok = n_tok,
        .n_in = n_in,
        .w = w,
        .w_dtype = dtype,
        .ldw = n_in,
        .n_out = n_out,
        .y = y,
        .accumulate = accumulate,
    };
    if (dtype == MOE_DTYPE_I8)
        p.w_scale = (const float *)((const char *)w + moe_i8_scale_offset(n_out, n_in));
    m->be->ops->matmul(m->be, &p);
}

/* A Linear weight (stored in lin_dtype). */
static void matmul(struct moe_model *m, const float *x, int n_tok, int n_in, const void *w,
                   int n_out, float *y, bool accumulate)
{
    matmul_dtype(m, m->lin_dtype, x, n_tok, n_in, w, n_out, y, accumulate);
}

/* SwiGLU FFN on n rows of xe: ye = down(silu(gate(xe)) * up(xe)). */
void moe_model_ffn(struct moe_model *m, const float *xe, int n, const void *w_gate_up, int d_ff,
                   const void *w_down, float *ye)
{
    const struct moe_config *c = &m->cfg;
    struct scratch *s = &m->s;
    matmul(m, xe, n, c->d_model, w_gate_up, 2 * d_ff, s->gate_up, false);
    m->be->ops->swiglu(m->be, s->gate_up, s->act, n, d_ff);
    matmul(m, s->act, n, d_ff, w_down, c->d_model, ye, false);
}

static enum moe_status attention_block(struct moe_model *m, struct moe_kv_cache *kv, int l,
                                       const struct moe_batch *b, struct moe_error *err)
{
    const struct moe_config *c = &m->cfg;
    const struct layer_weights *w = &m->layers[l];
    struct scratch *s = &m->s;
    const struct moe_backend_ops *ops = m->be->ops;
    int n = b->n_tok;

    ops->rmsnorm(m->be, s->x, w->attn_norm, s->h, n, c->d_model, c->rms_eps);
    matmul(m, s->h, n, c->d_model, w->wq, m->q_dim, s->q, false);
    matmul(m, s->h, n, c->d_model, w->wk, m->kv_dim, s->k, false);
    matmul(m, s->h, n, c->d_model, w->wv, m->kv_dim, s->v, false);
    if (c->qk_norm) {
        ops->rmsnorm(m->be, s->q, w->q_norm, s->q, n * m->n_head_local, c->d_head, c->rms_eps);
        ops->rmsnorm(m->be, s->k, w->k_norm, s->k, n * m->n_kv_head_local, c->d_head, c->rms_eps);
    }
    ops->rope(m->be, s->q, s->pos, n, m->n_head_local, c->d_head, c->rope_theta);
    ops->rope(m->be, s->k, s->pos, n, m->n_kv_head_local, c->d_head, c->rope_theta);
    ops->kv_write(m->be, s->k, s->v, s->slots, n, m->kv_dim, kv->k[l], kv->v[l]);
    struct moe_attn_params ap = {
        .q = s->q,
        .out = s->att,
        .k_cache = kv->k[l],
        .v_cache = kv->v[l],
        .tok_seq = s->seq,
        .tok_pos = s->pos,
        .block_tables = s->block_tables,
        .max_blocks = b->max_blocks,
        .n_tok = n,
        .n_head = m->n_head_local,
        .n_kv_head = m->n_kv_head_local,
        .d_head = c->d_head,
        .block_size = kv->block_size,
        .scale = 1.0f / sqrtf((float)c->d_head),
    };
    ops->attention(m->be, &ap);
    /* Row-parallel o_proj: with tp_size > 1 the partial sums are all-reduced here. */
    matmul(m, s->att, n, m->q_dim, w->wo, c->d_model, s->o, false);
    if (m->tp_comm) {
        ops->synchronize(m->be);
        enum moe_status rc = moe_comm_all_reduce_sum(m->tp_comm, s->o, (size_t)n * c->d_model, err);
        if (rc)
            return moe_error_prefix(err, "layer %d attention all-reduce", l);
    }
    ops->add(m->be, s->x, s->o, (size_t)n * c->d_model);
    return MOE_OK;
}

/* Groups the top-k choices by expert (counting sort): h_counts[e]..h_counts[e+1]
 * index the (token, weight) pairs of expert e. */
static void route_group(struct moe_model *m, int layer, int n)
{
    const struct moe_config *c = &m->cfg;
    struct scratch *s = &m->s;
    int n_route = n * c->top_k;
    /* one copy each way: [ids | weights] down, [token indexes | weights] up */
    m->be->ops->buf_download(m->be, s->h_ids, s->topk_ids, 2 * (size_t)n_route * sizeof(int32_t));
    s->h_route_w = (float *)(s->h_route_idx + n_route);
    s->route_w = (float *)(s->route_idx + n_route);
    memset(s->h_counts, 0, ((size_t)c->n_expert + 1) * sizeof *s->h_counts);
    for (int i = 0; i < n_route; i++)
        s->h_counts[s->h_ids[i] + 1]++;
    for (int e = 0; e < c->n_expert; e++)
        s->h_counts[e + 1] += s->h_counts[e];
    for (int e = 0; e < c->n_expert; e++)
        __atomic_fetch_add(&m->expert_tokens[(size_t)layer * c->n_expert + e],
                           (uint64_t)(s->h_counts[e + 1] - s->h_counts[e]), __ATOMIC_RELAXED);
    /* stable fill: the tokens of an expert stay in token order */
    int32_t next[1024];
    int32_t *cursor = c->n_expert <= 1024 ? next : malloc((size_t)c->n_expert * sizeof *cursor);
    MOE_ASSERT(cursor);
    memcpy(cursor, s->h_counts, (size_t)c->n_expert * sizeof *cursor);
    for (int i = 0; i < n_route; i++) {
        int e = s->h_ids[i];
        int at = cursor[e]++;
        s->h_route_idx[at] = i / c->top_k;
        s->h_route_w[at] = s->h_w[i];
    }
    if (cursor != next)
        free(cursor);
    m->be->ops->buf_upload(m->be, s->route_idx, s->h_route_idx,
                           2 * (size_t)n_route * sizeof(int32_t));
}

static enum moe_status ffn_block(struct moe_model *m, int l, int n, struct moe_error *err)
{
    const struct moe_config *c = &m->cfg;
    const struct layer_weights *w = &m->layers[l];
    struct scratch *s = &m->s;
    const struct moe_backend_ops *ops = m->be->ops;
    size_t row_bytes = (size_t)c->d_model * sizeof(float);

    ops->rmsnorm(m->be, s->x, w->ffn_norm, s->h, n, c->d_model, c->rms_eps);
    if (!w->is_moe) {
        moe_model_ffn(m, s->h, n, w->dense_gate_up, c->d_ff_dense, w->dense_down, s->ye);
        ops->add(m->be, s->x, s->ye, (size_t)n * c->d_model);
        return MOE_OK;
    }
    double t0 = moe_model_clock();
    s->topk_w = (float *)(s->topk_ids + (size_t)n * c->top_k);
    s->h_w = (float *)(s->h_ids + (size_t)n * c->top_k);
    matmul_dtype(m, m->base_dtype, s->h, n, c->d_model, w->router, c->n_expert, s->router_logits,
                 false);
    ops->router_topk(m->be, s->router_logits, n, c->n_expert, c->top_k, c->norm_topk_prob,
                     s->topk_ids, s->topk_w);
    m->prof.moe_layer_tokens += (uint64_t)n;
    double t1 = moe_model_clock();
    m->prof.router_s += t1 - t0;
    if (m->ep_comm) {
        enum moe_status rc = moe_ep_moe_layer(m, l, n, err);
        if (rc)
            return rc;
        ops->add(m->be, s->x, s->ffn_out, (size_t)n * c->d_model);
        return MOE_OK;
    }
    route_group(m, l, n);
    double t2 = moe_model_clock();
    m->prof.dispatch_s += t2 - t1;
    /* Sum of the experts' weighted outputs, then one residual add (the order
     * transformers uses). */
    moe_model_zero(m, s->ffn_out, (size_t)n * row_bytes);
    for (int e = 0; e < c->n_expert; e++) {
        int begin = s->h_counts[e], cnt = s->h_counts[e + 1] - begin;
        if (!cnt || !w->w_gate_up[e])
            continue;
        ops->gather_rows(m->be, s->h, s->route_idx + begin, cnt, c->d_model, s->xe);
        moe_model_ffn(m, s->xe, cnt, w->w_gate_up[e], c->d_ff_expert, w->w_down[e], s->ye);
        ops->scatter_add_rows(m->be, s->ye, s->route_idx + begin, s->route_w + begin, cnt,
                              c->d_model, s->ffn_out);
    }
    ops->add(m->be, s->x, s->ffn_out, (size_t)n * c->d_model);
    m->prof.experts_s += moe_model_clock() - t2;
    return MOE_OK;
}

static enum moe_status check_batch(const struct moe_model *m, const struct moe_kv_cache *kv,
                                   const struct moe_batch *b, struct moe_error *err)
{
    const struct moe_config *c = &m->cfg;
    if (b->n_tok <= 0 || b->n_seq <= 0 || b->max_blocks <= 0)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "empty batch (n_tok %d, n_seq %d, max_blocks %d)", b->n_tok, b->n_seq,
                             b->max_blocks);
    if (kv->kv_dim != m->kv_dim || kv->n_layer != c->n_layer)
        return moe_error_set(err, MOE_ERR_INVALID, "KV cache does not belong to this model");
    int n_slot = kv->n_block * kv->block_size;
    for (int t = 0; t < b->n_tok; t++) {
        if (b->tokens[t] < 0 || b->tokens[t] >= c->vocab_size)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "token id %d at batch row %d is outside the vocabulary [0, %d)",
                                 b->tokens[t], t, c->vocab_size);
        if (b->seq[t] < 0 || b->seq[t] >= b->n_seq)
            return moe_error_set(err, MOE_ERR_INVALID, "batch row %d: sequence %d out of range", t,
                                 b->seq[t]);
        if (b->pos[t] < 0 || b->pos[t] / kv->block_size >= b->max_blocks)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "batch row %d: position %d beyond the block table", t, b->pos[t]);
        if (b->slots[t] < 0 || b->slots[t] >= n_slot)
            return moe_error_set(err, MOE_ERR_INVALID, "batch row %d: KV slot %d out of range", t,
                                 b->slots[t]);
    }
    for (int i = 0; i < b->n_logits; i++)
        if (b->logit_rows[i] < 0 || b->logit_rows[i] >= b->n_tok)
            return moe_error_set(err, MOE_ERR_INVALID, "logit row %d out of range",
                                 b->logit_rows[i]);
    return MOE_OK;
}

enum moe_status moe_model_forward(struct moe_model *m, struct moe_kv_cache *kv,
                                  const struct moe_batch *b, float *logits, struct moe_error *err)
{
    enum moe_status rc = check_batch(m, kv, b, err);
    if (rc)
        return rc;
    int n = b->n_tok, n_table = b->n_seq * b->max_blocks;
    if ((rc = scratch_reserve(m, n, n_table, err)))
        return rc;
    const struct moe_config *c = &m->cfg;
    struct scratch *s = &m->s;
    struct moe_backend *be = m->be;
    const struct moe_backend_ops *ops = be->ops;
    size_t ib = (size_t)n * sizeof(int32_t);
    ops->buf_upload(be, s->tokens, b->tokens, ib);
    ops->buf_upload(be, s->pos, b->pos, ib);
    ops->buf_upload(be, s->seq, b->seq, ib);
    ops->buf_upload(be, s->slots, b->slots, ib);
    ops->buf_upload(be, s->block_tables, b->block_tables, (size_t)n_table * sizeof(int32_t));

    double t_start = moe_model_clock();
    struct moe_model_profile before = m->prof;
    ops->embed(be, m->embed, m->base_dtype, s->tokens, n, c->d_model, s->x);
    for (int l = 0; l < c->n_layer; l++) {
        double t = moe_model_clock();
        rc = attention_block(m, kv, l, b, err);
        m->prof.attention_s += moe_model_clock() - t;
        if (rc || (rc = ffn_block(m, l, n, err)))
            return rc;
    }
    if (b->n_logits > 0) {
        ops->buf_upload(be, s->logit_rows, b->logit_rows, (size_t)b->n_logits * sizeof(int32_t));
        ops->gather_rows(be, s->x, s->logit_rows, b->n_logits, c->d_model, s->h);
        ops->rmsnorm(be, s->h, m->final_norm, s->h, b->n_logits, c->d_model, c->rms_eps);
        matmul(m, s->h, b->n_logits, c->d_model, m->lm_head, c->vocab_size, s->logits, false);
        ops->buf_download(be, logits, s->logits,
                          (size_t)b->n_logits * (size_t)c->vocab_size * sizeof(float));
    }
    ops->synchronize(be);
    /* An op that failed on the device (launch error, unsupported shape) is
     * reported here instead of returning wrong logits. */
    if (ops->status && (rc = ops->status(be, err)))
        return moe_error_prefix(err, "forward pass");
    double total = moe_model_clock() - t_start;
    double phases = (m->prof.attention_s - before.attention_s) +
                    (m->prof.router_s - before.router_s) +
                    (m->prof.dispatch_s - before.dispatch_s) +
                    (m->prof.experts_s - before.experts_s) + (m->prof.combine_s - before.combine_s);
    m->prof.other_s += total > phases ? total - phases : 0;
    m->prof.forwards++;
    m->prof.tokens += (uint64_t)n;
    return MOE_OK;
}

/* ---- expert statistics and live placement ------------------------------------------ */

const uint64_t *moe_model_expert_tokens(const struct moe_model *m)
{
    return m->expert_tokens;
}

uint64_t moe_model_ep_rows_computed(const struct moe_model *m)
{
    return m->ep_rows_computed;
}

static void drop_pending(struct moe_model *m)
{
    size_t n = (size_t)m->cfg.n_layer * m->cfg.n_expert;
    for (size_t i = 0; m->pending_gate_up && i < n; i++) {
        FREE_PENDING(m->pending_gate_up[i]);
        FREE_PENDING(m->pending_down[i]);
    }
    free(m->pending_gate_up);
    free(m->pending_down);
    m->pending_gate_up = m->pending_down = NULL;
    moe_placement_free(&m->pending);
    m->pending_ready = false;
}

enum moe_status moe_model_prepare_placement(struct moe_model *m, const struct moe_placement *p,
                                            struct moe_error *err)
{
    const struct moe_config *c = &m->cfg;
    if (!m->ep_comm)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "placement: this model runs on one rank and holds every expert");
    if (p->n_rank != m->ep_comm->size || p->n_expert != c->n_expert || p->n_layer != c->n_layer)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "placement is for %d experts x %d layers on %d ranks; the model has "
                             "%d x %d on %d ranks",
                             p->n_expert, p->n_layer, p->n_rank, c->n_expert, c->n_layer,
                             m->ep_comm->size);
    drop_pending(m);
    size_t n = (size_t)c->n_layer * c->n_expert;
    enum moe_status rc =
        moe_placement_default(c->n_layer, c->n_expert, p->n_rank, &m->pending, err);
    if (rc)
        return rc;
    memcpy(m->pending.n_replicas, p->n_replicas, n);
    memcpy(m->pending.ranks, p->ranks, n * MOE_PLACEMENT_MAX_REPLICAS * sizeof *p->ranks);
    m->pending_gate_up = calloc(n, sizeof *m->pending_gate_up);
    m->pending_down = calloc(n, sizeof *m->pending_down);
    if (!m->pending_gate_up || !m->pending_down) {
        drop_pending(m);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    struct loader ld = {.m = m, .dir = m->dir};
    size_t bytes_before = m->weight_bytes;
    if ((rc = st_open(m->dir, &ld.st, err))) {
        drop_pending(m);
        return rc;
    }
    int me = m->ep_comm->rank;
    for (int l = 0; l < c->n_layer && !rc; l++) {
        if (!m->layers[l].is_moe)
            continue;
        for (int e = 0; e < c->n_expert && !rc; e++) {
            size_t i = (size_t)l * c->n_expert + e;
            if (moe_placement_holds(&m->pending, l, e, me) && !m->layers[l].w_gate_up[e])
                rc = load_expert(&ld, l, e, &m->pending_gate_up[i], &m->pending_down[i], err);
        }
    }
    st_close(ld.st);
    m->weight_bytes = bytes_before; /* counted again at commit */
    if (rc) {
        drop_pending(m);
        return rc;
    }
    __atomic_store_n(&m->pending_ready, true, __ATOMIC_RELEASE);
    return MOE_OK;
}

void moe_model_drop_placement(struct moe_model *m)
{
    drop_pending(m);
}

bool moe_model_placement_ready(const struct moe_model *m)
{
    return __atomic_load_n(&m->pending_ready, __ATOMIC_ACQUIRE);
}

void moe_model_commit_placement(struct moe_model *m)
{
    if (!moe_model_placement_ready(m))
        return;
    const struct moe_config *c = &m->cfg;
    int me = m->ep_comm->rank;
    size_t expert_bytes = linear_bytes(m, 2 * (int64_t)c->d_ff_expert, c->d_model) +
                          linear_bytes(m, c->d_model, c->d_ff_expert);
    for (int l = 0; l < c->n_layer; l++) {
        struct layer_weights *w = &m->layers[l];
        if (!w->is_moe)
            continue;
        for (int e = 0; e < c->n_expert; e++) {
            size_t i = (size_t)l * c->n_expert + e;
            bool keep = moe_placement_holds(&m->pending, l, e, me);
            if (keep && !w->w_gate_up[e]) {
                w->w_gate_up[e] = m->pending_gate_up[i];
                w->w_down[e] = m->pending_down[i];
                m->pending_gate_up[i] = m->pending_down[i] = NULL;
                m->weight_bytes += expert_bytes;
            } else if (!keep && w->w_gate_up[e]) {
                m->be->ops->buf_free(m->be, w->w_gate_up[e]);
                m->be->ops->buf_free(m->be, w->w_down[e]);
                w->w_gate_up[e] = w->w_down[e] = NULL;
                m->weight_bytes -= expert_bytes;
            }
        }
    }
    moe_placement_free(&m->placement);
    m->placement = m->pending;
    memset(&m->pending, 0, sizeof m->pending);
    drop_pending(m);
}
