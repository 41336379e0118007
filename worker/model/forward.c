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
 *   MoE: router logits -> top-k -> moe_layer.c: permute (rows grouped by
 *        expert) -> [EP dispatch] -> grouped GEMMs [gate|up], silu(gate)*up,
 *        down -> [EP combine] -> unpermute + weighted sum
 *   dense (Qwen3 mlp_only_layers): the same FFN for every token, weight 1
 *   x  += ffn
 * then final rmsnorm and lm_head on the rows that need logits.
 *
 * Memory is touched only through the backend, so the same code runs on any
 * backend. Routing is permuted on the backend; only the per-expert offsets
 * come back to the host (they size the grouped GEMMs' launches). */
#include "model/model.h"
#include "model/model_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "placement.h"
#include "quant.h"
#include "clock.h"

/* ---- forward ------------------------------------------------------------------------ */

/* Host memory for staging copies: the backend's (pinned) where it has it. */
static void *stage_alloc(struct moe_backend *be, size_t bytes)
{
    return be->ops->host_alloc ? be->ops->host_alloc(be, bytes) : malloc(bytes);
}

static void stage_free(struct moe_backend *be, void *p)
{
    if (p && be->ops->host_free)
        be->ops->host_free(be, p);
    else
        free(p);
}

enum {
    SI_U,
    SI_TEMP,
    SI_TOP_P,
    SI_TOKENS,
    SI_POS,
    SI_SEQ,
    SI_SLOTS,
    SI_LOGIT_ROWS,
    SI_TABLES,
    SI_N
};

/* Byte offsets of the step inputs' slices for cap rows and cap_tab block
 * table entries (each 256-byte aligned; the tables last), and the size. */
static size_t step_in_layout(size_t cap, size_t cap_tab, size_t off[SI_N])
{
    const size_t bytes[SI_N] = {
        cap * sizeof(double), cap * 4, cap * 4, cap * 4, cap * 4, cap * 4, cap * 4, cap * 4,
        cap_tab * 4};
    size_t at = 0;
    for (int i = 0; i < SI_N; i++) {
        off[i] = at;
        at += (bytes[i] + 255) / 256 * 256;
    }
    return at;
}

/* (Re)makes step_in and its host twin for cap rows and cap_tab table
 * entries and points the scratch's input slices into it. */
static enum moe_status step_in_alloc(struct moe_model *m, int cap, int cap_tab,
                                     struct moe_error *err)
{
    struct scratch *s = &m->s;
    struct moe_backend *be = m->be;
    size_t off[SI_N];
    const size_t bytes = step_in_layout((size_t)cap, (size_t)(cap_tab > 0 ? cap_tab : 1), off);
    void *dev = be->ops->buf_alloc(be, bytes);
    char *host = stage_alloc(be, bytes);
    if (!dev || !host) {
        if (dev)
            be->ops->buf_free(be, dev);
        stage_free(be, host);
        return moe_error_set(err, MOE_ERR_NOMEM,
                             "cannot allocate step inputs for %d tokens and %d block table entries",
                             cap, cap_tab);
    }
    if (s->step_in)
        be->ops->buf_free(be, s->step_in);
    stage_free(be, s->h_step_in);
    s->graph_gen++; /* graphs hold the old addresses */
    s->step_in = dev;
    s->h_step_in = host;
    char *d = dev;
    s->logit_u = (double *)(d + off[SI_U]);
    s->logit_temp = (float *)(d + off[SI_TEMP]);
    s->logit_top_p = (float *)(d + off[SI_TOP_P]);
    s->tokens = (int32_t *)(d + off[SI_TOKENS]);
    s->pos = (int32_t *)(d + off[SI_POS]);
    s->seq = (int32_t *)(d + off[SI_SEQ]);
    s->slots = (int32_t *)(d + off[SI_SLOTS]);
    s->logit_rows = (int32_t *)(d + off[SI_LOGIT_ROWS]);
    s->block_tables = (int32_t *)(d + off[SI_TABLES]);
    return MOE_OK;
}

/* A step's inputs (tokens, positions, sequences, KV slots, logit rows, the
 * sampled rows' draws, block tables) packed into the host twin and moved
 * in one upload, up to the last table entry used: one copy and one wait
 * per step on CUDA where there were up to seven. */
static void step_inputs_upload(struct moe_model *m, const struct moe_batch *b, int table_width)
{
    const int n_table = b->n_seq * table_width;
    struct scratch *s = &m->s;
    /* a slice's place in the host twin: its offset in step_in */
#define HOST_OF(slice) (s->h_step_in + ((const char *)(slice) - (const char *)s->step_in))
    const size_t ib = (size_t)b->n_tok * sizeof(int32_t);
    memcpy(HOST_OF(s->tokens), b->tokens, ib);
    memcpy(HOST_OF(s->pos), b->pos, ib);
    memcpy(HOST_OF(s->seq), b->seq, ib);
    memcpy(HOST_OF(s->slots), b->slots, ib);
    if (b->n_logits > 0)
        memcpy(HOST_OF(s->logit_rows), b->logit_rows, (size_t)b->n_logits * sizeof(int32_t));
    if (b->n_logits > 0 && b->argmax_out && b->sample_u) {
        memcpy(HOST_OF(s->logit_u), b->sample_u, (size_t)b->n_logits * sizeof(double));
        memcpy(HOST_OF(s->logit_temp), b->sample_temp, (size_t)b->n_logits * sizeof(float));
        memcpy(HOST_OF(s->logit_top_p), b->sample_top_p, (size_t)b->n_logits * sizeof(float));
    }
    if (table_width == b->max_blocks) {
        memcpy(HOST_OF(s->block_tables), b->block_tables, (size_t)n_table * sizeof(int32_t));
    } else { /* rows widened to table_width (graph keys, below); the rest unread */
        int32_t *t = (int32_t *)HOST_OF(s->block_tables);
        for (int q = 0; q < b->n_seq; q++) {
            int32_t *row = t + (size_t)q * table_width;
            memcpy(row, b->block_tables + (size_t)q * b->max_blocks,
                   (size_t)b->max_blocks * sizeof(int32_t));
            memset(row + b->max_blocks, 0, (size_t)(table_width - b->max_blocks) * sizeof(int32_t));
        }
    }
    const size_t used =
        (size_t)(HOST_OF(s->block_tables) - s->h_step_in) + (size_t)n_table * sizeof(int32_t);
#undef HOST_OF
    /* pinned staging (host_alloc): no wait, the step's end waits anyway and
     * the next step writes the staging after it */
    const struct moe_backend_ops *ops = m->be->ops;
    if (ops->host_alloc && ops->buf_upload_async)
        ops->buf_upload_async(m->be, s->step_in, s->h_step_in, used);
    else
        ops->buf_upload(m->be, s->step_in, s->h_step_in, used);
}

static enum moe_status scratch_reserve(struct moe_model *m, int n_tok, int n_table,
                                       struct moe_error *err)
{
    struct scratch *s = &m->s;
    if (n_tok <= s->cap_tok && n_table > s->cap_seq_blocks) {
        /* Only the block tables grew (sequences got longer): regrow them
         * alone, geometrically, so long decodes do not reallocate every
         * activation buffer each time a sequence takes another block. */
        int cap_tab = s->cap_seq_blocks * 2 > n_table ? s->cap_seq_blocks * 2 : n_table;
        enum moe_status rc = step_in_alloc(m, s->cap_tok, cap_tab, err);
        if (rc)
            return rc;
        s->cap_seq_blocks = cap_tab;
    }
    if (n_tok <= s->cap_tok && n_table <= s->cap_seq_blocks)
        return MOE_OK;
    int cap = n_tok > s->cap_tok ? n_tok : s->cap_tok;
    int cap_tab = n_table > s->cap_seq_blocks ? n_table : s->cap_seq_blocks;
    moe_model_scratch_free(m);
    const struct moe_config *c = &m->cfg;
    struct moe_backend *be = m->be;
    size_t n = (size_t)cap;
    int d_ff_max = c->d_ff_expert > c->d_ff_dense ? c->d_ff_expert : c->d_ff_dense;
    d_ff_max = c->d_ff_shared > d_ff_max ? c->d_ff_shared : d_ff_max;
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
    ALLOC(qkv, n * (m->q_dim + 2 * (size_t)m->kv_dim), float);
    ALLOC(att, n * m->q_dim, float);
    ALLOC(o, n * c->d_model, float);
    ALLOC(ffn_out, (n + MOE_MAX_EP_RANKS) * c->d_model, float); /* + padding for all-gather */
    ALLOC(router_logits, n * (size_t)(c->n_expert > 0 ? c->n_expert : 1), float);
    /* ids then weights in one buffer, so one copy moves both (see ffn_block) */
    ALLOC(topk_ids, 2 * n_route, int32_t);
    /* a device-routed MoE layer runs all top_k rows of its tokens at once */
    size_t ffn_rows = n < MOE_ROUTE_DEVICE_MAX_TOK ? n : MOE_ROUTE_DEVICE_MAX_TOK;
    ffn_rows *= (size_t)(c->top_k > 1 ? c->top_k : 1);
    ffn_rows = ffn_rows > n ? ffn_rows : n;
    ALLOC(gate_up, ffn_rows * 2 * (size_t)d_ff_max, float);
    ALLOC(shared_g, n, float);
    ALLOC(act, ffn_rows * (size_t)d_ff_max, float);
    ALLOC(ye, n * c->d_model, float);
    ALLOC(ones, n, float);
    ALLOC(iota, n, int32_t);
    ALLOC(logit_ids, n, int32_t);
    ok = ok && step_in_alloc(m, cap, cap_tab, err) == MOE_OK;
    if (c->mla) {
        struct mla_scratch *a = &s->mla;
        size_t H = (size_t)m->n_head_local, L = (size_t)c->kv_lora_rank, R = (size_t)c->d_head;
        size_t dn = (size_t)c->qk_nope_dim, dv = (size_t)c->v_head_dim;
        size_t q_hm = dn > L ? dn : L, lat_hm = L > dv ? L : dv;
        ALLOC(mla.qa, n * (size_t)(c->q_lora_rank ? c->q_lora_rank : 1), float);
        ALLOC(mla.q_nope, n * H * dn, float);
        ALLOC(mla.q_rope, n * H * R, float);
        ALLOC(mla.c, n * L, float);
        ALLOC(mla.k_rope, n * R, float);
        ALLOC(mla.q_hm, n * H * q_hm, float);
        ALLOC(mla.lat_hm, n * H * lat_hm, float);
        ALLOC(mla.lat, n * H * L, float);
        ALLOC(mla.q_full, n * H * (L + R), float);
        ALLOC(mla.to_hm, n * H, int32_t);
        ALLOC(mla.to_tm, n * H, int32_t);
        a->h_idx = malloc(n * H * sizeof *a->h_idx);
        a->h_off = malloc((H + 1) * sizeof *a->h_off);
        a->n_built = 0;
        ok = ok && a->h_idx && a->h_off;
    }
    size_t n_ep = (size_t)(m->ep_comm ? m->ep_comm->size : 1), n_e = (size_t)c->n_expert;
    if (c->n_expert > 0) { /* the MoE layer (moe_layer.c) */
        ALLOC(rows_a, n_route * c->d_model, float);
        ALLOC(rows_b, n_route * c->d_model, float);
        ALLOC(item_tok, n_route, int32_t);
        ALLOC(item_exp, n_route, int32_t);
        ALLOC(item_w, n_route, float);
        ALLOC(tok_rows, n_route, int32_t);
        ALLOC(offsets, n_ep * n_e + 1, int32_t);
        /* the offsets, then each layer's last row's experts (route_last) */
        size_t n_route_off = (size_t)c->n_layer * (n_e + 1 + (size_t)c->top_k);
        ALLOC(route_off, n_route_off, int32_t);
        s->route_last = s->route_off ? s->route_off + (size_t)c->n_layer * (n_e + 1) : NULL;
        s->h_route_off = malloc(n_route_off * sizeof *s->h_route_off);
        s->route_pending = calloc((size_t)c->n_layer, sizeof *s->route_pending);
        ALLOC(w_tab, (size_t)c->n_layer * 2 * n_e, void *);
        s->w_tab_version = -1;
        ok = ok && s->h_route_off && s->route_pending;
        s->h_offsets = malloc((n_ep * n_e + 1) * sizeof *s->h_offsets);
        s->h_win = malloc((n_e + 1) * sizeof *s->h_win);
        s->h_w_gu = malloc(n_e * sizeof *s->h_w_gu);
        s->h_w_dn = malloc(n_e * sizeof *s->h_w_dn);
        s->h_s_gu = malloc(n_e * sizeof *s->h_s_gu);
        s->h_s_dn = malloc(n_e * sizeof *s->h_s_dn);
        ok = ok && s->h_offsets && s->h_win && s->h_w_gu && s->h_w_dn && s->h_s_gu && s->h_s_dn;
        if (m->ep_comm) {
            ALLOC(rows_r, n_route * c->d_model, float);
            ALLOC(r_ids, n_route, int32_t);
            ALLOC(r_perm, n_route, int32_t);
            ALLOC(r_inv, n_route, int32_t);
            ALLOC(r_offsets, n_e + 1, int32_t);
            s->h_r_offsets = malloc((n_e + 1) * sizeof *s->h_r_offsets);
            ok = ok && s->h_r_offsets;
        }
    }
#undef ALLOC
    s->h_shared_g = malloc(n * sizeof *s->h_shared_g);
    s->h_zero = calloc((n_route > n + MOE_MAX_EP_RANKS ? n_route : n + MOE_MAX_EP_RANKS) *
                           (size_t)c->d_model,
                       sizeof *s->h_zero);
    float *h_ones = malloc(n * sizeof *h_ones);
    int32_t *h_iota = malloc(n * sizeof *h_iota);
    ok = ok && s->h_shared_g && s->h_zero && h_ones && h_iota;
    if (!ok) {
        free(h_ones);
        free(h_iota);
        moe_model_scratch_free(m);
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
    s->cap_ffn_rows = (int)ffn_rows;
    s->cap_seq_blocks = cap_tab;
    return MOE_OK;
}

/* The lm_head's output rows, grown to the step's n_logits: a prefill asks
 * for one row (not n_tok x vocab floats: 65 MB at 512 tokens of a 32000
 * vocabulary, zeroed at allocation). */
static enum moe_status logits_reserve(struct moe_model *m, int n_logits, struct moe_error *err)
{
    struct scratch *s = &m->s;
    if (n_logits <= s->cap_logits)
        return MOE_OK;
    float *l =
        m->be->ops->buf_alloc(m->be, (size_t)n_logits * (size_t)m->cfg.vocab_size * sizeof(float));
    if (!l)
        return moe_error_set(err, MOE_ERR_NOMEM, "cannot allocate logits for %d rows", n_logits);
    if (s->logits)
        m->be->ops->buf_free(m->be, s->logits);
    s->graph_gen++;
    s->logits = l;
    s->cap_logits = n_logits;
    return MOE_OK;
}

/* y (n_tok, n_out) (+)= x W^T, W (n_out, n_in) a whole weight in `dtype`
 * (I8: its row scales follow the values in the same buffer); `fast` lets the
 * backend round x (struct moe_matmul_params). */
static void matmul_dtype(struct moe_model *m, enum moe_dtype dtype, bool fast, const float *x,
                         int n_tok, int n_in, const void *w, int n_out, float *y, bool accumulate)
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
        .fast = fast,
        .batch_invariant = m->opts.batch_invariant,
    };
    if (dtype == MOE_DTYPE_I8)
        p.w_scale = (const float *)((const char *)w + moe_i8_scale_offset(n_out, n_in));
    if (dtype == MOE_DTYPE_I4) {
        p.w_scale = (const float *)((const char *)w + moe_q4_scale_offset(n_out, n_in));
        p.w_group = m->q4_group;
    }
    m->be->ops->matmul(m->be, &p);
}

/* A Linear weight (stored in lin_dtype), on the fast path unless the model
 * was loaded exact (moe_model_opts.fast). */
static void matmul(struct moe_model *m, const float *x, int n_tok, int n_in, const void *w,
                   int n_out, float *y, bool accumulate)
{
    matmul_dtype(m, m->lin_dtype, m->opts.fast, x, n_tok, n_in, w, n_out, y, accumulate);
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

/* What rope_kv_write (kernels/backend.h) does, op by op: for backends
 * without it, and OLMoE's norm over each token's whole q and k. */
static void rope_kv_unfused(struct moe_model *m, struct moe_kv_cache *kv, int l, int n)
{
    const struct moe_config *c = &m->cfg;
    const struct layer_weights *w = &m->layers[l];
    struct scratch *s = &m->s;
    const struct moe_backend_ops *ops = m->be->ops;
    const int qkv_dim = m->q_dim + 2 * m->kv_dim;
    ops->copy_cols(m->be, s->q, m->q_dim, s->qkv, qkv_dim, n, m->q_dim);
    ops->copy_cols(m->be, s->k, m->kv_dim, s->qkv + m->q_dim, qkv_dim, n, m->kv_dim);
    ops->copy_cols(m->be, s->v, m->kv_dim, s->qkv + m->q_dim + m->kv_dim, qkv_dim, n, m->kv_dim);
    if (w->bq) { /* y += b for every row: ones (n, 1) . b (dim, 1)^T, exact */
        matmul_dtype(m, MOE_DTYPE_F32, false, s->ones, n, 1, w->bq, m->q_dim, s->q, true);
        matmul_dtype(m, MOE_DTYPE_F32, false, s->ones, n, 1, w->bk, m->kv_dim, s->k, true);
        matmul_dtype(m, MOE_DTYPE_F32, false, s->ones, n, 1, w->bv, m->kv_dim, s->v, true);
    }
    if (c->qk_norm_full) { /* OLMoE: one norm over each token's whole q and k */
        ops->rmsnorm(m->be, s->q, w->q_norm, s->q, n, m->q_dim, c->rms_eps);
        ops->rmsnorm(m->be, s->k, w->k_norm, s->k, n, m->kv_dim, c->rms_eps);
    }
    if (c->qk_norm) {
        ops->rmsnorm(m->be, s->q, w->q_norm, s->q, n * m->n_head_local, c->d_head, c->rms_eps);
        ops->rmsnorm(m->be, s->k, w->k_norm, s->k, n * m->n_kv_head_local, c->d_head, c->rms_eps);
    }
    ops->rope(m->be, s->q, s->pos, n, m->n_head_local, c->d_head, m->rope_inv_freq,
              c->rope.attention_factor);
    ops->rope(m->be, s->k, s->pos, n, m->n_kv_head_local, c->d_head, m->rope_inv_freq,
              c->rope.attention_factor);
    ops->kv_write(m->be, s->k, s->v, s->slots, n, m->kv_dim, kv->k[l], kv->v[l], kv->dtype);
}

/* The residual stream's update and the next norm: x += r (the previous
 * block's output; r NULL: nothing pending), then h = rmsnorm(x) with w, in
 * one op where the backend fuses them (add_rmsnorm). A block leaves its
 * output pending instead of adding it, so the add rides with the norm that
 * follows it. */
static void residual_norm(struct moe_model *m, const float *r, const float *w, int n)
{
    const struct moe_config *c = &m->cfg;
    struct scratch *s = &m->s;
    const struct moe_backend_ops *ops = m->be->ops;
    if (r && ops->add_rmsnorm) {
        ops->add_rmsnorm(m->be, s->x, r, w, s->h, n, c->d_model, c->rms_eps);
        return;
    }
    if (r)
        ops->add(m->be, s->x, r, (size_t)n * c->d_model);
    ops->rmsnorm(m->be, s->x, w, s->h, n, c->d_model, c->rms_eps);
}

/* *res: in, the residual still to add to x (or NULL); out, this block's
 * output, left for the next norm (residual_norm). */
static enum moe_status attention_block(struct moe_model *m, struct moe_kv_cache *kv, int l,
                                       const struct moe_batch *b, const float **res,
                                       struct moe_error *err)
{
    const struct moe_config *c = &m->cfg;
    const struct layer_weights *w = &m->layers[l];
    struct scratch *s = &m->s;
    const struct moe_backend_ops *ops = m->be->ops;
    int n = b->n_tok;

    residual_norm(m, *res, w->attn_norm, n);
    const int qkv_dim = m->q_dim + 2 * m->kv_dim;
    matmul(m, s->h, n, c->d_model, w->wqkv, qkv_dim, s->qkv, false);
    if (ops->rope_kv_write && !c->qk_norm_full) { /* split, biases, norms, RoPE, KV write */
        struct moe_rope_kv_params rp = {
            .qkv = s->qkv,
            .n_tok = n,
            .n_head = m->n_head_local,
            .n_kv_head = m->n_kv_head_local,
            .d_head = c->d_head,
            .bq = w->bq,
            .bk = w->bk,
            .bv = w->bv,
            .q_norm = c->qk_norm ? w->q_norm : NULL,
            .k_norm = c->qk_norm ? w->k_norm : NULL,
            .eps = c->rms_eps,
            .pos = s->pos,
            .inv_freq = m->rope_inv_freq,
            .scale = c->rope.attention_factor,
            .q_out = s->q,
            .slots = s->slots,
            .k_cache = kv->k[l],
            .v_cache = kv->v[l],
            .kv_dtype = kv->dtype,
        };
        ops->rope_kv_write(m->be, &rp);
    } else {
        rope_kv_unfused(m, kv, l, n);
    }
    struct moe_attn_params ap = {
        .q = s->q,
        .out = s->att,
        .k_cache = kv->k[l],
        .v_cache = kv->v[l],
        .kv_dtype = kv->dtype,
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
        .fast = m->opts.fast,
        .batch_invariant = m->opts.batch_invariant,
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
    *res = s->o;
    return MOE_OK;
}

/* Where an n-token step's latent-attention indexes are on the backend:
 * the gathers between token-major rows (t * H + h) and head-major rows
 * (h * n + t), and (steps of up to MOE_ROUTE_DEVICE_MAX_TOK tokens) the
 * heads' row offsets; off NULL: host offsets only (mla_scratch.h_off). */
struct mla_index {
    const int32_t *to_hm, *to_tm, *off;
};

static void mla_fill(int32_t *to_hm, int32_t *to_tm, int n, int H)
{
    for (int h = 0; h < H; h++)
        for (int t = 0; t < n; t++) {
            to_hm[h * n + t] = t * H + h;
            to_tm[t * H + h] = h * n + t;
        }
}

/* The indexes of an n-token step (and h_off, the host offsets, for it):
 * kept per n up to MOE_ROUTE_DEVICE_MAX_TOK (mla_scratch.by_n), else built
 * in the shared scratch whenever n changes. */
static enum moe_status mla_indexes(struct moe_model *m, int n, struct mla_index *ix,
                                   struct moe_error *err)
{
    struct mla_scratch *a = &m->s.mla;
    struct moe_backend *be = m->be;
    const int H = m->n_head_local;
    const size_t nh = (size_t)n * H;
    for (int h = 0; h <= H; h++)
        a->h_off[h] = h * n;
    if (n <= MOE_ROUTE_DEVICE_MAX_TOK) {
        if (!a->by_n[n]) {
            const size_t bytes = (2 * nh + (size_t)H + 1) * sizeof(int32_t);
            int32_t *h = malloc(bytes), *d = be->ops->buf_alloc(be, bytes);
            if (!h || !d) {
                free(h);
                if (d)
                    be->ops->buf_free(be, d);
                return moe_error_set(err, MOE_ERR_NOMEM,
                                     "latent attention: cannot allocate %zu bytes of indexes for "
                                     "%d-token steps",
                                     bytes, n);
            }
            mla_fill(h, h + nh, n, H);
            memcpy(h + 2 * nh, a->h_off, ((size_t)H + 1) * sizeof *h);
            be->ops->buf_upload(be, d, h, bytes);
            free(h);
            a->by_n[n] = d;
        }
        *ix = (struct mla_index){a->by_n[n], a->by_n[n] + nh, a->by_n[n] + 2 * nh};
        return MOE_OK;
    }
    if (a->n_built != n) {
        int32_t *tm = malloc(nh * sizeof *tm);
        if (!tm)
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        mla_fill(a->h_idx, tm, n, H);
        be->ops->buf_upload(be, a->to_hm, a->h_idx, nh * sizeof *a->h_idx);
        be->ops->buf_upload(be, a->to_tm, tm, nh * sizeof *tm);
        free(tm);
        a->n_built = n;
    }
    *ix = (struct mla_index){a->to_hm, a->to_tm, NULL};
    return MOE_OK;
}

/* Every layer's per-head weight pointers on the backend (mla_scratch.head_tab). */
static enum moe_status mla_head_table(struct moe_model *m, struct moe_error *err)
{
    struct mla_scratch *a = &m->s.mla;
    if (a->head_tab)
        return MOE_OK;
    const int H = m->n_head_local, L = m->cfg.n_layer;
    const size_t bytes = (size_t)L * 2 * (size_t)H * sizeof(void *);
    void **h = malloc(bytes);
    void *d = h ? m->be->ops->buf_alloc(m->be, bytes) : NULL;
    if (!d) {
        free(h);
        return moe_error_set(err, MOE_ERR_NOMEM,
                             "latent attention: cannot allocate the heads' weight table");
    }
    for (int l = 0; l < L; l++)
        for (int i = 0; i < H; i++) {
            h[((size_t)l * 2 + 0) * H + i] = m->layers[l].w_uk_t ? m->layers[l].w_uk_t[i] : NULL;
            h[((size_t)l * 2 + 1) * H + i] = m->layers[l].w_uv ? m->layers[l].w_uv[i] : NULL;
        }
    m->be->ops->buf_upload(m->be, d, h, bytes);
    free(h);
    a->head_tab = d;
    return MOE_OK;
}

static struct moe_grouped_matmul_params grouped_params(const struct moe_model *m, const float *x,
                                                       int n_rows, int n_in, int n_out,
                                                       int n_groups, const void *const *w,
                                                       const float **w_scale, float *y)
{
    bool quant = m->lin_dtype == MOE_DTYPE_I8 || m->lin_dtype == MOE_DTYPE_I4;
    return (struct moe_grouped_matmul_params){
        .x = x,
        .n_rows = n_rows,
        .n_in = n_in,
        .n_out = n_out,
        .n_expert = n_groups,
        .w = w,
        .w_dtype = m->lin_dtype,
        .ldw = n_in,
        .y = y,
        .w_scale = quant ? (const float *const *)w_scale : NULL,
        .w_group = m->q4_group,
        .fast = m->opts.fast,
        .batch_invariant = m->opts.batch_invariant,
    };
}

void moe_model_grouped_matmul(struct moe_model *m, const float *x, int n_rows, int n_in, int n_out,
                              int n_groups, const int32_t *offsets, const void **w,
                              const float **w_scale, float *y)
{
    struct moe_grouped_matmul_params p =
        grouped_params(m, x, n_rows, n_in, n_out, n_groups, (const void *const *)w, w_scale, y);
    p.expert_offsets = offsets;
    m->be->ops->grouped_matmul(m->be, &p);
}

void moe_model_grouped_matmul_dev(struct moe_model *m, const float *x, int n_rows, int n_in,
                                  int n_out, int n_groups, const int32_t *off_dev, int max_rows,
                                  const void *const *w, const void *const *w_dev,
                                  const float **w_scale, float *y)
{
    struct moe_grouped_matmul_params p =
        grouped_params(m, x, n_rows, n_in, n_out, n_groups, w, w_scale, y);
    p.expert_offsets_dev = off_dev;
    p.w_dev = w_dev;
    p.max_expert_rows = max_rows;
    m->be->ops->grouped_matmul(m->be, &p);
}

/* y (H * n rows, n_out) = x (H * n rows, n_in) . W_h^T, head h's rows against
 * its own weight: one grouped matmul with the heads as its groups; with the
 * offsets on the device (ix->off, w_dev) where the backend takes n rows a
 * group so, as device-routed MoE layers do (no host array to copy: a graph
 * can hold it), else with host offsets. */
static void per_head_matmul(struct moe_model *m, const struct mla_index *ix, int n, const float *x,
                            int n_in, void **w, const void *const *w_dev, const float **w_scale,
                            int n_out, float *y)
{
    const struct moe_backend_ops *ops = m->be->ops;
    const int H = m->n_head_local;
    if (ix->off && ops->grouped_device_rows && n <= ops->grouped_device_rows(m->be, m->lin_dtype))
        moe_model_grouped_matmul_dev(m, x, H * n, n_in, n_out, H, ix->off, n,
                                     (const void *const *)w, w_dev, w_scale, y);
    else
        moe_model_grouped_matmul(m, x, H * n, n_in, n_out, H, m->s.mla.h_off, (const void **)w,
                                 w_scale, y);
}

/* DeepSeek-V3 multi-head latent attention, in the absorbed form for every
 * token (prefill and decode alike), so attention reads only the latent
 * cache: per token one row [c | k_rope] of L + R (c = RMSNorm(h W_kva^T), the
 * rotary key shared by all heads), which serves as K and as V. Head h's
 * score against position j is q_nope_h . (W_UK_h c_j) + q_rope_h . k_rope_j
 * = [W_UK_h^T q_nope_h | q_rope_h] . [c_j | k_rope_j]: multi-query attention
 * with one KV head of L + R whose V is the row's first L columns (d_v):
 * the probability-weighted sum of c_j, which W_UV_h turns into the head's
 * value. Transformers
 * expands K and V per head instead; the two agree up to f32 rounding. */
static enum moe_status mla_block(struct moe_model *m, struct moe_kv_cache *kv, int l,
                                 const struct moe_batch *b, const float **res,
                                 struct moe_error *err)
{
    const struct moe_config *c = &m->cfg;
    const struct layer_weights *w = &m->layers[l];
    struct scratch *s = &m->s;
    struct mla_scratch *a = &s->mla;
    const struct moe_backend_ops *ops = m->be->ops;
    const int n = b->n_tok, H = m->n_head_local, nh = n * H;
    const int L = c->kv_lora_rank, R = c->d_head, dn = c->qk_nope_dim, dv = c->v_head_dim;
    const float lora_eps = 1e-6f; /* q_a_layernorm, kv_a_layernorm: RMSNorm's default */

    struct mla_index ix = {0};
    enum moe_status rc = mla_indexes(m, n, &ix, err);
    if (!rc)
        rc = mla_head_table(m, err);
    if (rc)
        return moe_error_prefix(err, "layer %d", l);
    const void *const *heads = (const void *const *)a->head_tab + (size_t)l * 2 * H;
    residual_norm(m, *res, w->attn_norm, n);
    const float *q_in = s->h;
    int d_in = c->d_model;
    if (c->q_lora_rank) {
        matmul(m, s->h, n, c->d_model, w->wq_a, c->q_lora_rank, a->qa, false);
        ops->rmsnorm(m->be, a->qa, w->q_a_norm, a->qa, n, c->q_lora_rank, lora_eps);
        q_in = a->qa;
        d_in = c->q_lora_rank;
    }
    matmul(m, q_in, n, d_in, w->wq_nope, H * dn, a->q_nope, false);
    matmul(m, q_in, n, d_in, w->wq_rope, H * R, a->q_rope, false);
    ops->rope(m->be, a->q_rope, s->pos, n, H, R, m->rope_inv_freq, c->rope.attention_factor);

    /* the latent row [c | k_rope] into the cache (s->k holds it) */
    matmul(m, s->h, n, c->d_model, w->wkv_a, L, a->c, false);
    ops->rmsnorm(m->be, a->c, w->kv_a_norm, a->c, n, L, lora_eps);
    matmul(m, s->h, n, c->d_model, w->wk_rope, R, a->k_rope, false);
    ops->rope(m->be, a->k_rope, s->pos, n, 1, R, m->rope_inv_freq, c->rope.attention_factor);
    ops->copy_cols(m->be, s->k, L + R, a->c, L, n, L);
    ops->copy_cols(m->be, s->k + L, L + R, a->k_rope, R, n, R);
    ops->kv_write(m->be, s->k, NULL, s->slots, n, L + R, kv->k[l], NULL, kv->dtype);

    /* absorbed query [W_UK_h^T q_nope_h | q_rope_h] per (token, head) */
    ops->gather_rows(m->be, a->q_nope, ix.to_hm, nh, dn, a->q_hm);
    per_head_matmul(m, &ix, n, a->q_hm, dn, w->w_uk_t, heads, w->w_uk_scale, L, a->lat_hm);
    ops->gather_rows(m->be, a->lat_hm, ix.to_tm, nh, L, a->lat);
    ops->copy_cols(m->be, a->q_full, L + R, a->lat, L, nh, L);
    ops->copy_cols(m->be, a->q_full + L, L + R, a->q_rope, R, nh, R);
    struct moe_attn_params ap = {
        .q = a->q_full,
        .out = a->lat,
        .k_cache = kv->k[l],
        .v_cache = kv->k[l],
        .kv_dtype = kv->dtype,
        .tok_seq = s->seq,
        .tok_pos = s->pos,
        .block_tables = s->block_tables,
        .max_blocks = b->max_blocks,
        .n_tok = n,
        .n_head = H,
        .n_kv_head = 1,
        .d_head = L + R,
        .block_size = kv->block_size,
        .scale = c->attn_scale,
        .d_v = L, /* V is the row's compressed part */
    };
    ops->attention(m->be, &ap);

    /* values: W_UV_h (sum_j p_j c_j) per head, back to token-major rows */
    ops->gather_rows(m->be, a->lat, ix.to_hm, nh, L, a->q_hm);
    per_head_matmul(m, &ix, n, a->q_hm, L, w->w_uv, heads + H, w->w_uv_scale, dv, a->lat_hm);
    ops->gather_rows(m->be, a->lat_hm, ix.to_tm, nh, dv, s->att);
    matmul(m, s->att, n, H * dv, w->wo, c->d_model, s->o, false);
    if (m->tp_comm) {
        ops->synchronize(m->be);
        rc = moe_comm_all_reduce_sum(m->tp_comm, s->o, (size_t)n * c->d_model, err);
        if (rc)
            return moe_error_prefix(err, "layer %d attention all-reduce", l);
    }
    *res = s->o;
    return MOE_OK;
}

/* The shared experts, in two halves so the MoE layer can run the first
 * while its dispatch travels (moe_layer.c). Qwen2-MoE: ffn_out +=
 * sigmoid(shared_gate . h) * shared_expert(h), per token, after the routed
 * experts' sum (transformers' order); DeepSeek-V3 (no gate): ffn_out +=
 * shared_experts(h). compute leaves shared_expert(h) in s->ye and the gate
 * in s->shared_g; add adds them to s->ffn_out. */
void moe_model_shared_compute(struct moe_model *m, const struct layer_weights *w, int n)
{
    const struct moe_config *c = &m->cfg;
    struct scratch *s = &m->s;
    const struct moe_backend_ops *ops = m->be->ops;
    moe_model_ffn(m, s->h, n, w->shared_gate_up, c->d_ff_shared, w->shared_down, s->ye);
    if (!w->shared_gate)
        return;
    matmul_dtype(m, m->base_dtype, false, s->h, n, c->d_model, w->shared_gate, 1, s->shared_g,
                 false);
    if (ops->sigmoid) {
        ops->sigmoid(m->be, s->shared_g, (size_t)n);
        return;
    }
    ops->buf_download(m->be, s->h_shared_g, s->shared_g, (size_t)n * sizeof(float));
    for (int t = 0; t < n; t++)
        s->h_shared_g[t] = 1.0f / (1.0f + expf(-s->h_shared_g[t]));
    ops->buf_upload(m->be, s->shared_g, s->h_shared_g, (size_t)n * sizeof(float));
}

void moe_model_shared_add(struct moe_model *m, const struct layer_weights *w, int n)
{
    const struct moe_config *c = &m->cfg;
    struct scratch *s = &m->s;
    const struct moe_backend_ops *ops = m->be->ops;
    if (!w->shared_gate)
        ops->add(m->be, s->ffn_out, s->ye, (size_t)n * c->d_model);
    else
        ops->scatter_add_rows(m->be, s->ye, s->iota, s->shared_g, n, c->d_model, s->ffn_out);
}

/* *res as in attention_block. */
static enum moe_status ffn_block(struct moe_model *m, int l, int n, const float **res,
                                 struct moe_error *err)
{
    const struct moe_config *c = &m->cfg;
    const struct layer_weights *w = &m->layers[l];
    struct scratch *s = &m->s;
    const struct moe_backend_ops *ops = m->be->ops;

    residual_norm(m, *res, w->ffn_norm, n);
    *res = NULL;
    if (!w->is_moe) {
        moe_model_ffn(m, s->h, n, w->dense_gate_up, c->d_ff_dense, w->dense_down, s->ye);
        *res = s->ye;
        return MOE_OK;
    }
    double t0 = moe_now();
    s->topk_w = (float *)(s->topk_ids + (size_t)n * c->top_k);
    /* The router stays exact: a rounded logit can flip an expert choice. */
    matmul_dtype(m, m->base_dtype, false, s->h, n, c->d_model, w->router, c->n_expert,
                 s->router_logits, false);
    if (c->router_sigmoid) {
        struct moe_router_grouped_params rp = {
            .logits = s->router_logits,
            .bias = w->router_bias,
            .n_tok = n,
            .n_expert = c->n_expert,
            .top_k = c->top_k,
            .n_group = c->n_group,
            .topk_group = c->topk_group,
            .renorm = c->norm_topk_prob,
            .scale = c->routed_scaling,
            .ids = s->topk_ids,
            .weights = s->topk_w,
        };
        ops->router_topk_grouped(m->be, &rp);
    } else {
        ops->router_topk(m->be, s->router_logits, n, c->n_expert, c->top_k, c->norm_topk_prob,
                         s->topk_ids, s->topk_w);
    }
    m->prof.moe_layer_tokens += (uint64_t)n;
    double t1 = moe_now();
    m->prof.router_s += t1 - t0;
    enum moe_status rc = moe_moe_layer(m, l, n, err); /* routed + shared experts */
    if (rc)
        return rc;
    *res = s->ffn_out; /* one residual add, with the next norm */
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

static enum moe_status forward(struct moe_model *m, struct moe_kv_cache *kv,
                               const struct moe_batch *b, float *logits, struct moe_error *err);

enum moe_status moe_model_forward(struct moe_model *m, struct moe_kv_cache *kv,
                                  const struct moe_batch *b, float *logits, struct moe_error *err)
{
    moe_kv_cache_fence(kv); /* the KV data plane's writes before this step */
    enum moe_status rc = forward(m, kv, b, logits, err);
    moe_kv_cache_fence(kv); /* this step's writes, for the data plane */
    return rc;
}

/* Data-parallel attention, a rank with no tokens this step: it still takes
 * part in every MoE layer's exchange, computing the rows the other ranks
 * send to its experts. */
static enum moe_status forward_idle(struct moe_model *m, const struct moe_batch *b,
                                    struct moe_error *err)
{
    enum moe_status rc = scratch_reserve(m, b->n_tok_group > 1 ? b->n_tok_group : 1, 1, err);
    for (int l = 0; !rc && l < m->cfg.n_layer; l++)
        if (m->layers[l].is_moe)
            rc = moe_moe_layer(m, l, 0, err);
    m->be->ops->synchronize(m->be);
    if (!rc && m->be->ops->status && (rc = m->be->ops->status(m->be, err)))
        return moe_error_prefix(err, "forward pass");
    return rc;
}

/* A step's ops, from the embedding to the logits (or the ids, argmax or
 * sampled, with argmax_out): everything but the copies to the host. */
static enum moe_status forward_ops(struct moe_model *m, struct moe_kv_cache *kv,
                                   const struct moe_batch *b, struct moe_error *err)
{
    const struct moe_config *c = &m->cfg;
    struct scratch *s = &m->s;
    struct moe_backend *be = m->be;
    const struct moe_backend_ops *ops = be->ops;
    const int n = b->n_tok;
    ops->embed(be, m->embed, m->base_dtype, s->tokens, n, c->d_model, s->x);
    const float *res = NULL; /* a block's output not yet added to x (residual_norm) */
    for (int l = 0; l < c->n_layer; l++) {
        double t = moe_now();
        enum moe_status rc =
            c->mla ? mla_block(m, kv, l, b, &res, err) : attention_block(m, kv, l, b, &res, err);
        m->prof.attention_s += moe_now() - t;
        if (rc || (rc = ffn_block(m, l, n, &res, err)))
            return rc;
    }
    if (res)
        ops->add(be, s->x, res, (size_t)n * c->d_model);
    if (b->n_logits > 0) {
        ops->gather_rows(be, s->x, s->logit_rows, b->n_logits, c->d_model, s->h);
        ops->rmsnorm(be, s->h, m->final_norm, s->h, b->n_logits, c->d_model, c->rms_eps);
        matmul(m, s->h, b->n_logits, c->d_model, m->lm_head, c->vocab_size, s->logits, false);
        if (b->argmax_out && b->sample_u) /* each row's draw and settings from step_in */
            ops->sample_rows(be, s->logits, b->n_logits, c->vocab_size, s->logit_temp,
                             s->logit_top_p, s->logit_u, s->logit_ids);
        else if (b->argmax_out)
            ops->argmax(be, s->logits, b->n_logits, c->vocab_size, s->logit_ids);
    }
    return MOE_OK;
}

/* The step-independent part of step_graphable (below). */
static bool graph_candidate(const struct moe_model *m, const struct moe_batch *b)
{
    const struct moe_backend_ops *ops = m->be->ops;
    return ops->graph_launch && !m->opts.no_graphs && b->argmax_out && !m->tp_comm &&
           !(m->ep_comm && m->ep_comm->size > 1) &&
           (!m->cfg.mla || b->n_tok <= MOE_ROUTE_DEVICE_MAX_TOK) && !m->opts.profile &&
           b->n_logits >= 1 && ops->grouped_device_rows &&
           b->n_tok <= ops->grouped_device_rows(m->be, m->lin_dtype);
}

/* Pure-decode greedy steps that may be graphs are padded to a power-of-two
 * batch (up to what the backend routes on the device), so one graph serves
 * while requests join and leave. A padding row repeats the last sequence's
 * row: its token, position, sequence and KV slot (the same K/V written
 * again to the same slot), so the same experts; its id is dropped, and the
 * expert statistics take it out again (moe_model_route_stats, from each
 * layer's last-row experts). Returns b or the padded step in *pb. */
static const struct moe_batch *pad_for_graph(struct moe_model *m, const struct moe_batch *b,
                                             struct moe_batch *pb)
{
    const int n = b->n_tok;
    if (!graph_candidate(m, b) || n != b->n_seq || n != b->n_logits)
        return b;
    int np = 1;
    while (np < n)
        np *= 2;
    if (np == n || np > MOE_ROUTE_DEVICE_MAX_TOK ||
        np > m->be->ops->grouped_device_rows(m->be, m->lin_dtype))
        return b;
    for (int i = 0; i < n; i++)
        if (b->seq[i] != i || b->logit_rows[i] != i)
            return b;
    /* the draws first (8-byte aligned), then the settings, then the ints */
    const size_t W = (size_t)b->max_blocks;
    const size_t need = (size_t)np * sizeof(double) + (8 * (size_t)np + (size_t)np * W) * 4;
    if (need > m->h_pad_cap) {
        void *p = realloc(m->h_pad, need);
        if (!p)
            return b; /* unpadded: the step runs without a graph */
        m->h_pad = p;
        m->h_pad_cap = need;
    }
    double *u = m->h_pad;
    float *temp = (float *)(u + np), *top_p = temp + np;
    int32_t *tok = (int32_t *)(top_p + np), *pos = tok + np, *seq = pos + np, *slots = seq + np;
    int32_t *rows = slots + np, *ids = rows + np, *tab = ids + np;
    for (int i = 0; i < np; i++) {
        int r = i < n ? i : n - 1;
        tok[i] = b->tokens[r];
        pos[i] = b->pos[r];
        seq[i] = r;
        slots[i] = b->slots[r];
        rows[i] = i;
        memcpy(tab + (size_t)i * W, b->block_tables + (size_t)r * W, W * sizeof *tab);
        if (b->sample_u) {
            u[i] = b->sample_u[r];
            temp[i] = b->sample_temp[r];
            top_p[i] = b->sample_top_p[r];
        }
    }
    *pb = *b;
    if (b->sample_u) {
        pb->sample_u = u;
        pb->sample_temp = temp;
        pb->sample_top_p = top_p;
    }
    pb->n_tok = pb->n_seq = pb->n_logits = np;
    pb->tokens = tok;
    pb->pos = pos;
    pb->seq = seq;
    pb->slots = slots;
    pb->logit_rows = rows;
    pb->block_tables = tab;
    pb->argmax_out = ids;
    return pb;
}

/* Decode steps as graphs (kernels/backend.h, graph_launch): an ids-only
 * step (greedy, or sampled: sample_rows reads each row's settings from
 * step_in) on one rank whose MoE layers all route on
 * the device (moe_layer.c: at most MOE_ROUTE_DEVICE_MAX_TOK tokens, and
 * what the backend's grouped GEMM takes so) and whose ops read only backend
 * memory (latent attention's indexes and per-head offsets are kept per step
 * size on the backend, mla_indexes): not a shared expert gate on a backend without
 * `sigmoid`, tensor or expert parallel (their collectives), or --profile
 * (its waits). The inputs are in step_in
 * already (step_inputs_upload), the scratch at fixed addresses. */
static bool step_graphable(const struct moe_model *m, const struct moe_batch *b)
{
    const struct moe_config *c = &m->cfg;
    const struct moe_backend_ops *ops = m->be->ops;
    if (!graph_candidate(m, b))
        return false;
    for (int l = 0; l < c->n_layer; l++)
        if (m->layers[l].shared_gate && !ops->sigmoid)
            return false;
    return moe_model_routes_on_device(m, b->n_tok);
}

/* What identifies a step's graph: the model and cache, the shapes its ops
 * were launched with, and the scratch generation (its addresses), hashed
 * to the 64 bits the backend keeps (two live keys colliding: ~2^-54). */
static uint64_t step_key(const struct moe_model *m, const struct moe_kv_cache *kv,
                         const struct moe_batch *b)
{
    const uint64_t f[] = {
        (uint64_t)(uintptr_t)m, (uint64_t)(uintptr_t)kv, (uint64_t)(uintptr_t)kv->k[0],
        (uint64_t)b->n_tok,     (uint64_t)b->n_seq,      (uint64_t)b->max_blocks,
        (uint64_t)b->n_logits,  m->s.graph_gen};
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a over the fields' bytes */
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        for (int k = 0; k < 8; k++) {
            h ^= (f[i] >> (8 * k)) & 0xff;
            h *= 0x100000001b3ull;
        }
    return h;
}

/* A replayed step did on the backend what forward_ops does; this is its
 * host-side bookkeeping: the routing statistics and the profile's counts. */
static void graph_replayed(struct moe_model *m, int n)
{
    const struct moe_config *c = &m->cfg;
    for (int l = 0; l < c->n_layer; l++) {
        if (!m->layers[l].is_moe)
            continue;
        m->s.route_pending[l] = true;
        m->s.route_any = true;
        m->prof.moe_layer_tokens += (uint64_t)n;
        m->ep_rows_computed += (uint64_t)n * (uint64_t)c->top_k;
    }
    m->prof.graphs_replayed++;
}

static enum moe_status forward(struct moe_model *m, struct moe_kv_cache *kv,
                               const struct moe_batch *b, float *logits, struct moe_error *err)
{
    bool dp = m->opts.dp_attention && m->ep_comm;
    if (dp && b->n_tok == 0)
        return forward_idle(m, b, err);
    enum moe_status rc = check_batch(m, kv, b, err);
    if (rc)
        return rc;
    const struct moe_batch *user = b;
    struct moe_batch pb;
    b = pad_for_graph(m, b, &pb);
    /* Where graphs may replay the step, its block table rows are widened to
     * a multiple of MOE_GRAPH_TABLE_QUANTUM blocks: the width is part of a
     * graph's key, and a sequence's table grows a block every block_size
     * tokens. Attention reads a row only up to the token's position. */
    const struct moe_batch *orig = b;
    struct moe_batch wb = *b;
    if (m->be->ops->graph_launch)
        wb.max_blocks = (b->max_blocks + MOE_GRAPH_TABLE_QUANTUM - 1) / MOE_GRAPH_TABLE_QUANTUM *
                        MOE_GRAPH_TABLE_QUANTUM;
    b = &wb;
    int n = b->n_tok, n_table = b->n_seq * b->max_blocks;
    if ((rc = scratch_reserve(m, dp && b->n_tok_group > n ? b->n_tok_group : n, n_table, err)) ||
        (rc = logits_reserve(m, b->n_logits, err)))
        return rc;
    const struct moe_config *c = &m->cfg;
    struct scratch *s = &m->s;
    struct moe_backend *be = m->be;
    const struct moe_backend_ops *ops = be->ops;
    s->route_pad = b->n_tok - user->n_tok;
    step_inputs_upload(m, orig, b->max_blocks);
    bool graph = step_graphable(m, b);
    uint64_t key = graph ? step_key(m, kv, b) : 0;

    double t_start = moe_now();
    struct moe_model_profile before = m->prof;
    if (!graph || !ops->graph_launch(be, key)) {
        bool record = graph && ops->graph_begin(be, key);
        rc = forward_ops(m, kv, b, err);
        if (record && rc) { /* a host-side failure mid-way: keep no graph of it */
            struct moe_error gerr = {0};
            if (ops->graph_end(be, &gerr) == MOE_OK && ops->graph_reset)
                ops->graph_reset(be);
        } else if (record) {
            struct moe_error gerr = {0};
            if (ops->graph_end(be, &gerr) != MOE_OK) { /* nothing ran: run the ops */
                if (!m->graph_warned) {
                    fprintf(stderr, "moe: %s; such steps run without a graph\n", gerr.msg);
                    m->graph_warned = true;
                }
                rc = rc ? rc : forward_ops(m, kv, b, err);
            } else if (!rc) {
                m->prof.graphs_recorded++;
            }
        }
        if (rc) { /* wait for what was queued: the staging may be rewritten next */
            ops->synchronize(be);
            return rc;
        }
    } else {
        graph_replayed(m, user->n_tok);
    }
    if (b->n_logits > 0) {
        if (b->argmax_out) { /* n ids come back instead of n x vocab floats */
            ops->buf_download(be, b->argmax_out, s->logit_ids,
                              (size_t)b->n_logits * sizeof(int32_t));
        } else {
            ops->buf_download(be, logits, s->logits,
                              (size_t)b->n_logits * (size_t)c->vocab_size * sizeof(float));
        }
    }
    ops->synchronize(be);
    /* An op that failed on the device (launch error, unsupported shape) is
     * reported here instead of returning wrong logits. */
    if (ops->status && (rc = ops->status(be, err)))
        return moe_error_prefix(err, "forward pass");
    moe_model_route_stats(m);
    if (b->n_tok != user->n_tok) /* the padding rows' ids dropped */
        memcpy(user->argmax_out, b->argmax_out, (size_t)user->n_logits * sizeof(int32_t));
    double total = moe_now() - t_start;
    double phases = (m->prof.attention_s - before.attention_s) +
                    (m->prof.router_s - before.router_s) +
                    (m->prof.dispatch_s - before.dispatch_s) +
                    (m->prof.experts_s - before.experts_s) + (m->prof.combine_s - before.combine_s);
    m->prof.other_s += total > phases ? total - phases : 0;
    m->prof.forwards++;
    m->prof.tokens += (uint64_t)user->n_tok;
    return MOE_OK;
}

/* ---- scratch, statistics ------------------------------------------------------------ */

void moe_model_scratch_free(struct moe_model *m)
{
    struct moe_backend *be = m->be;
    struct scratch *s = &m->s;
    void *dev[] = {s->x,
                   s->h,
                   s->q,
                   s->qkv,
                   s->k,
                   s->v,
                   s->att,
                   s->o,
                   s->ffn_out,
                   s->shared_g,
                   s->router_logits,
                   s->topk_ids,
                   s->gate_up,
                   s->act,
                   s->ye,
                   s->ones,
                   s->iota,
                   s->step_in,
                   s->logits,
                   s->logit_ids,
                   s->rows_a,
                   s->rows_b,
                   s->rows_r,
                   s->item_tok,
                   s->item_exp,
                   s->item_w,
                   s->tok_rows,
                   s->offsets,
                   s->r_ids,
                   s->r_perm,
                   s->r_inv,
                   s->r_offsets,
                   s->route_ranks,
                   s->route_n,
                   s->route_off,
                   (void *)s->w_tab,
                   s->mla.qa,
                   s->mla.q_nope,
                   s->mla.q_rope,
                   s->mla.c,
                   s->mla.k_rope,
                   s->mla.q_hm,
                   s->mla.lat_hm,
                   s->mla.lat,
                   s->mla.q_full,
                   s->mla.to_hm,
                   s->mla.to_tm};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i])
            be->ops->buf_free(be, dev[i]);
    free(s->h_shared_g);
    free(s->h_zero);
    free(s->h_offsets);
    free(s->h_r_offsets);
    free(s->h_win);
    free(s->h_w_gu);
    free(s->h_w_dn);
    free(s->h_s_gu);
    free(s->h_s_dn);
    free(s->h_route_off);
    free(s->route_pending);
    for (int i = 0; i <= MOE_ROUTE_DEVICE_MAX_TOK; i++)
        if (s->mla.by_n[i])
            be->ops->buf_free(be, s->mla.by_n[i]);
    if (s->mla.head_tab)
        be->ops->buf_free(be, s->mla.head_tab);
    free(s->mla.h_idx);
    free(s->mla.h_off);
    stage_free(be, s->h_step_in);
    uint64_t gen = s->graph_gen;
    memset(s, 0, sizeof *s);
    s->graph_gen = gen + 1; /* the next scratch is at other addresses */
}

void moe_model_zero(struct moe_model *m, void *p, size_t bytes)
{
    if (m->be->ops->buf_zero)
        m->be->ops->buf_zero(m->be, p, bytes); /* a device memset, no host round trip */
    else
        m->be->ops->buf_upload(m->be, p, m->s.h_zero, bytes);
}

void moe_model_profile(const struct moe_model *m, struct moe_model_profile *out)
{
    *out = m->prof;
}

void moe_model_reset_counters(struct moe_model *m)
{
    m->prof = (struct moe_model_profile){0};
    memset(m->expert_tokens, 0,
           (size_t)m->cfg.n_layer * (size_t)(m->cfg.n_expert > 0 ? m->cfg.n_expert : 1) *
               sizeof *m->expert_tokens);
    m->ep_rows_computed = 0;
    m->ep_bytes_sent = 0;
    m->ep_rows_routed = 0;
}

void moe_model_ep_traffic(const struct moe_model *m, uint64_t *bytes_sent, uint64_t *rows_routed)
{
    *bytes_sent = m->ep_bytes_sent;
    *rows_routed = m->ep_rows_routed;
}
