/* The MoE layer: one implementation for one rank and for expert parallel
 * over W ranks, on every backend (ARCHITECTURE.md section 3):
 *
 *   permute   this rank's shard of the (token, expert) items, stably sorted
 *             by (rank that computes the item, expert): the backend's
 *             permute op; its offsets come to the host (the only copy: they
 *             size the exchange and the grouped GEMM's launch)
 *   gather    the shard's rows in that order
 *   [dispatch all-to-all-v of the rows and their expert ids; the received
 *             rows, in (source, expert, token) order, sorted by expert by
 *             permute again (top_k 1)]
 *   shared    the shared experts (Qwen2-MoE, DeepSeek-V3) on every row of the
 *             row group, replicated on its ranks; with expert parallel while
 *             the dispatched rows travel (between the exchange's start and
 *             finish, so a rank computes them while its slowest peer
 *             catches up instead of waiting)
 *   experts   grouped GEMM gate/up -> SwiGLU -> grouped GEMM down over all
 *             local experts at once (the rows are grouped by expert)
 *   [combine  the outputs back to receive order, all-to-all-v back to their
 *             senders, so they arrive in send order]
 *   unpermute each token's outputs weighted and summed in expert-id order
 *             (unpermute_combine), the order transformers sums in
 *   [all-gather of the shards within the row group]
 *   + shared  added after the routed sum (transformers' order)
 *
 * With one rank the bracketed steps are skipped and the shard is every row.
 * Routed on the device: with one rank, every expert held and a step of at
 * most MOE_ROUTE_DEVICE_MAX_TOK tokens (and what the backend's grouped GEMM
 * takes, its grouped_device_rows op), the offsets never come to the host:
 * one grouped GEMM per matmul over all experts reads them on the backend
 * (no expert has more rows than the step has tokens), the layer's offsets
 * stay in a per-layer slot for the step-end statistics
 * (moe_model_route_stats), and nothing waits: a decode step's MoE layers
 * queue without a host round trip, as a CUDA graph needs. The same rows and
 * the same per-expert matmuls as the host path, so the same bits.
 * In expert parallel every rank holds the same n rows (lock-step) and owns
 * the shard [t0, t1) = [r*c, min(n, (r+1)*c)), c = ceil(n / R), of its row
 * group: every rank, or with data-parallel attention (moe_model_opts.
 * dp_attention) its tensor-parallel sub-group, whose n may differ from the
 * other groups' (or be 0); pure DP (TP 1) shards nothing.
 * The (rank, expert) sort is the order the rows travel in; a replicated
 * expert's rank is picked by the token's row (moe_placement_pick), from a
 * copy of the placement on the backend.
 * Bytes moved per routed (token, expert) pair that leaves its rank: d_model
 * floats + one id out, d_model floats back.
 * Each rank counts the experts of its own shard (expert statistics); a
 * group's leader adds the other ranks' counts (group.c).
 * The layer allocates nothing: its buffers are in struct scratch, grown with
 * the activations (forward.c, scratch_reserve). */
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"
#include "clock.h"
#include "quant.h"

/* One call of the layer: this rank's shard of the rows, and how many items
 * go to and come from each rank. */
struct moe_step {
    struct moe_model *m;
    int l;            /* layer */
    int n;            /* rows of the row group */
    int W, me, k, d;  /* ranks (1 without expert parallel), this rank, top_k, d_model */
    size_t row_bytes; /* one row: d_model floats */
    /* the ranks holding the same n rows, over which they are sharded: every
     * rank (lock-step), or with DP attention the TP sub-group (NULL: this
     * rank alone) */
    struct moe_comm *row_comm;
    int R, row_rank;
    int chunk;     /* rows per shard: ceil(n / R) */
    int t0, t1;    /* this rank's shard [t0, t1) */
    int n_items;   /* (t1 - t0) * top_k items of the shard */
    size_t n_recv; /* items this rank computes (received from all ranks) */
    size_t send_counts[MOE_MAX_EP_RANKS], recv_counts[MOE_MAX_EP_RANKS]; /* items, by rank */
    size_t sd[MOE_MAX_EP_RANKS], rd[MOE_MAX_EP_RANKS]; /* their displacements, in items */
};

static void step_init(struct moe_step *st, struct moe_model *m, int l, int n)
{
    const struct moe_comm *comm = m->ep_comm;
    *st = (struct moe_step){.m = m,
                            .l = l,
                            .n = n,
                            .W = comm ? comm->size : 1,
                            .me = comm ? comm->rank : 0,
                            .k = m->cfg.top_k,
                            .d = m->cfg.d_model};
    st->row_bytes = (size_t)st->d * sizeof(float);
    st->row_comm = !comm ? NULL : m->opts.dp_attention ? m->tp_comm : m->ep_comm;
    st->R = st->row_comm ? st->row_comm->size : 1;
    st->row_rank = st->row_comm ? st->row_comm->rank : 0;
    st->chunk = (n + st->R - 1) / st->R;
    st->t0 = st->row_rank * st->chunk < n ? st->row_rank * st->chunk : n;
    st->t1 = (st->row_rank + 1) * st->chunk < n ? (st->row_rank + 1) * st->chunk : n;
    st->n_items = (st->t1 - st->t0) * st->k;
}

/* The placement's replicas on the backend, for permute: (n_layer, n_expert,
 * MOE_PLACEMENT_MAX_REPLICAS) ranks and (n_layer, n_expert) counts, copied
 * again after a live placement change. */
static enum moe_status route_table(struct moe_model *m, struct moe_error *err)
{
    struct scratch *s = &m->s;
    const struct moe_config *c = &m->cfg;
    if (s->route_ranks && s->route_version == m->placement_version)
        return MOE_OK;
    size_t n_le = (size_t)c->n_layer * c->n_expert, n_r = n_le * MOE_PLACEMENT_MAX_REPLICAS;
    struct moe_backend *be = m->be;
    if (!s->route_ranks) {
        s->route_ranks = be->ops->buf_alloc(be, n_r * sizeof(int32_t));
        s->route_n = be->ops->buf_alloc(be, n_le * sizeof(int32_t));
        if (!s->route_ranks || !s->route_n)
            return moe_error_set(err, MOE_ERR_NOMEM, "cannot allocate the placement table");
    }
    int32_t *h = malloc((n_r + n_le) * sizeof *h);
    if (!h)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    const struct moe_placement *p = &m->placement;
    for (size_t i = 0; i < n_r; i++)
        h[i] = p->ranks[i];
    for (size_t i = 0; i < n_le; i++)
        h[n_r + i] = p->n_replicas[i];
    be->ops->buf_upload(be, s->route_ranks, h, n_r * sizeof *h);
    be->ops->buf_upload(be, s->route_n, h + n_r, n_le * sizeof *h);
    free(h);
    s->route_version = m->placement_version;
    return MOE_OK;
}

/* Per-rank byte counts and displacements of item counts `count` at item
 * displacements `displ`, `unit` bytes an item. */
static void to_bytes(int W, const size_t *count, const size_t *displ, size_t unit, size_t *bytes,
                     size_t *bytes_displ)
{
    for (int r = 0; r < W; r++) {
        bytes[r] = count[r] * unit;
        bytes_displ[r] = displ[r] * unit;
    }
}

/* Permute the shard and gather its rows into rows_a (send order); counts
 * the shard's experts in the statistics and fills st->send_counts. */
static enum moe_status permute_shard(struct moe_step *st, struct moe_error *err)
{
    struct moe_model *m = st->m;
    const struct moe_config *c = &m->cfg;
    struct scratch *s = &m->s;
    struct moe_backend *be = m->be;
    const struct moe_backend_ops *ops = be->ops;
    enum moe_status rc;
    if (st->W > 1 && (rc = route_table(m, err)))
        return rc;
    size_t at = (size_t)st->t0 * st->k;
    size_t stride = MOE_PLACEMENT_MAX_REPLICAS;
    struct moe_permute_params p = {
        .ids = s->topk_ids + at,
        .weights = s->topk_w + at,
        .n_tok = st->t1 - st->t0,
        .top_k = st->k,
        .n_expert = c->n_expert,
        .n_dest = st->W,
        .ranks = st->W > 1 ? s->route_ranks + (size_t)st->l * c->n_expert * stride : NULL,
        .n_ranks = st->W > 1 ? s->route_n + (size_t)st->l * c->n_expert : NULL,
        .rank_stride = (int)stride,
        .token_base = st->t0,
        .item_tok = s->item_tok,
        .item_exp = s->item_exp,
        .item_w = s->item_w,
        .tok_rows = s->tok_rows,
        .offsets = s->offsets,
    };
    ops->permute(be, &p);
    size_t n_keys = (size_t)st->W * c->n_expert;
    ops->buf_download(be, s->h_offsets, s->offsets, (n_keys + 1) * sizeof(int32_t));
    if ((rc = ops->status(be, err)))
        return moe_error_prefix(err, "layer %d routing", st->l);
    for (int e = 0; e < c->n_expert; e++) {
        uint64_t cnt = 0;
        for (int r = 0; r < st->W; r++)
            cnt += (uint64_t)(s->h_offsets[r * c->n_expert + e + 1] -
                              s->h_offsets[r * c->n_expert + e]);
        if (cnt)
            __atomic_fetch_add(&m->expert_tokens[(size_t)st->l * c->n_expert + e], cnt,
                               __ATOMIC_RELAXED);
    }
    for (int r = 0; r < st->W; r++)
        st->send_counts[r] =
            (size_t)(s->h_offsets[(r + 1) * c->n_expert] - s->h_offsets[r * c->n_expert]);
    if (st->n_items)
        ops->gather_rows(be, s->h + (size_t)st->t0 * st->d, s->item_tok, st->n_items, st->d,
                         s->rows_a);
    return MOE_OK;
}

/* The dispatch's start: exchange the counts and the expert ids (item_exp ->
 * r_ids), then start the all-to-all-v of the rows (rows_a -> rows_r). */
static enum moe_status dispatch_start(struct moe_step *st, struct moe_error *err)
{
    struct moe_model *m = st->m;
    struct scratch *s = &m->s;
    struct moe_backend *be = m->be;
    const struct moe_backend_ops *ops = be->ops;
    struct moe_comm *comm = m->ep_comm;
    const int W = st->W, me = st->me;
    enum moe_status rc = moe_comm_all_to_all_counts(comm, st->send_counts, st->recv_counts, err);
    size_t n_sent_off_rank = 0;
    st->n_recv = 0;
    for (int r = 0, so = 0; r < W; r++) {
        st->sd[r] = (size_t)so;
        so += (int)st->send_counts[r];
        st->rd[r] = st->n_recv;
        st->n_recv += st->recv_counts[r];
        if (r != me)
            n_sent_off_rank += st->send_counts[r];
    }
    if (!rc && st->n_recv > (size_t)s->cap_tok * st->k)
        rc = moe_error_set(err, MOE_ERR_INTERNAL, "rank %d would receive %zu rows, room for %d", me,
                           st->n_recv, s->cap_tok * st->k);
    if (rc)
        return moe_error_prefix(err, "layer %d expert dispatch", st->l);
    ops->synchronize(be);
    size_t sb[MOE_MAX_EP_RANKS], rb[MOE_MAX_EP_RANKS], sdb[MOE_MAX_EP_RANKS], rdb[MOE_MAX_EP_RANKS];
    to_bytes(W, st->send_counts, st->sd, sizeof(int32_t), sb, sdb);
    to_bytes(W, st->recv_counts, st->rd, sizeof(int32_t), rb, rdb);
    rc = moe_comm_all_to_all_v(comm, s->item_exp, sb, sdb, s->r_ids, rb, rdb, err);
    if (!rc) {
        to_bytes(W, st->send_counts, st->sd, st->row_bytes, sb, sdb);
        to_bytes(W, st->recv_counts, st->rd, st->row_bytes, rb, rdb);
        rc = moe_comm_all_to_all_v_start(comm, s->rows_a, sb, sdb, s->rows_r, rb, rdb, err);
    }
    if (rc)
        return moe_error_prefix(err, "layer %d expert dispatch", st->l);
    m->ep_bytes_sent += n_sent_off_rank * (st->row_bytes + sizeof(int32_t));
    m->ep_rows_routed += (uint64_t)st->n_items;
    return MOE_OK;
}

/* The dispatch's end: wait for the rows, sort what arrived by expert
 * (r_perm, r_inv, h_r_offsets) and gather it into rows_a. */
static enum moe_status dispatch_finish(struct moe_step *st, struct moe_error *err)
{
    struct moe_model *m = st->m;
    const struct moe_config *c = &m->cfg;
    struct scratch *s = &m->s;
    struct moe_backend *be = m->be;
    const struct moe_backend_ops *ops = be->ops;
    enum moe_status rc = moe_comm_all_to_all_v_finish(m->ep_comm, err);
    if (rc)
        return moe_error_prefix(err, "layer %d expert dispatch", st->l);
    struct moe_permute_params p = {.ids = s->r_ids,
                                   .n_tok = (int)st->n_recv,
                                   .top_k = 1,
                                   .n_expert = c->n_expert,
                                   .n_dest = 1,
                                   .item_tok = s->r_perm,
                                   .tok_rows = s->r_inv,
                                   .offsets = s->r_offsets};
    ops->permute(be, &p);
    ops->buf_download(be, s->h_r_offsets, s->r_offsets,
                      ((size_t)c->n_expert + 1) * sizeof(int32_t));
    if ((rc = ops->status(be, err)))
        return moe_error_prefix(err, "layer %d: the rows rank %d received", st->l, st->me);
    if (st->n_recv)
        ops->gather_rows(be, s->rows_r, s->r_perm, (int)st->n_recv, st->d, s->rows_a);
    return MOE_OK;
}

/* Whether a step of n tokens on one rank may route layer l on the device
 * (the file's comment). */
static bool layer_routes_on_device(const struct moe_model *m, int l, int n)
{
    const struct layer_weights *w = &m->layers[l];
    const struct moe_backend_ops *ops = m->be->ops;
    if ((m->ep_comm && m->ep_comm->size > 1) || n < 1 || n > MOE_ROUTE_DEVICE_MAX_TOK ||
        (int64_t)n * m->cfg.top_k > m->s.cap_ffn_rows || !ops->grouped_device_rows ||
        n > ops->grouped_device_rows(m->be, m->lin_dtype))
        return false;
    for (int e = 0; e < m->cfg.n_expert; e++)
        if (!w->w_gate_up[e] || !w->w_down[e])
            return false;
    return true;
}

bool moe_model_routes_on_device(const struct moe_model *m, int n)
{
    if (m->cfg.n_expert > 0 && m->s.w_tab_version != m->placement_version)
        return false; /* the weight table would be copied during the step */
    for (int l = 0; l < m->cfg.n_layer; l++)
        if (m->layers[l].is_moe && !layer_routes_on_device(m, l, n))
            return false;
    return m->s.cap_tok >= n;
}

/* The experts' weight pointers of every layer on the backend (w_tab),
 * copied again after a placement change. */
static enum moe_status weight_table(struct moe_model *m, struct moe_error *err)
{
    struct scratch *s = &m->s;
    if (s->w_tab_version == m->placement_version)
        return MOE_OK;
    const int E = m->cfg.n_expert;
    size_t n = (size_t)m->cfg.n_layer * 2 * (size_t)E;
    const void **h = malloc(n * sizeof *h);
    if (!h)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    for (int l = 0; l < m->cfg.n_layer; l++)
        for (int e = 0; e < E; e++) {
            const struct layer_weights *w = &m->layers[l];
            h[((size_t)l * 2) * E + e] = w->is_moe ? w->w_gate_up[e] : NULL;
            h[((size_t)l * 2 + 1) * E + e] = w->is_moe ? w->w_down[e] : NULL;
        }
    m->be->ops->buf_upload(m->be, (void *)s->w_tab, h, n * sizeof *h);
    free(h);
    s->w_tab_version = m->placement_version;
    return MOE_OK;
}

/* The quantized experts' scales of layer l (NULL for F32 and BF16). */
static void expert_scales(struct moe_model *m, int l, int e, const float **gu, const float **dn)
{
    const struct layer_weights *w = &m->layers[l];
    const int d = m->cfg.d_model, ff = m->cfg.d_ff_expert;
    *gu = *dn = NULL;
    if (!w->w_gate_up[e])
        return;
    if (m->lin_dtype == MOE_DTYPE_I8) {
        *gu = (const float *)((const char *)w->w_gate_up[e] + moe_i8_scale_offset(2 * ff, d));
        *dn = (const float *)((const char *)w->w_down[e] + moe_i8_scale_offset(d, ff));
    } else if (m->lin_dtype == MOE_DTYPE_I4) {
        *gu = (const float *)((const char *)w->w_gate_up[e] + moe_q4_scale_offset(2 * ff, d));
        *dn = (const float *)((const char *)w->w_down[e] + moe_q4_scale_offset(d, ff));
    }
}

/* Routed on the device: the shard's items sorted by expert into this
 * layer's slot of route_off, their rows gathered, then every expert's
 * SwiGLU FFN in one grouped GEMM per matmul (rows_a -> rows_b). */
static enum moe_status experts_on_device(struct moe_step *st, struct moe_error *err)
{
    struct moe_model *m = st->m;
    const struct moe_config *c = &m->cfg;
    const struct layer_weights *w = &m->layers[st->l];
    struct scratch *s = &m->s;
    struct moe_backend *be = m->be;
    const struct moe_backend_ops *ops = be->ops;
    const int E = c->n_expert, d = st->d, ff = c->d_ff_expert, n = st->n_items;
    enum moe_status rc = weight_table(m, err);
    if (rc)
        return rc;
    int32_t *off = s->route_off + (size_t)st->l * (E + 1);
    struct moe_permute_params p = {
        .ids = s->topk_ids,
        .weights = s->topk_w,
        .n_tok = st->n,
        .top_k = st->k,
        .n_expert = E,
        .n_dest = 1,
        .item_tok = s->item_tok,
        .item_exp = s->item_exp,
        .item_w = s->item_w,
        .tok_rows = s->tok_rows,
        .offsets = off,
    };
    ops->permute(be, &p);
    s->route_pending[st->l] = true;
    s->route_any = true;
    if (ops->graph_launch) /* a padded step's padding repeats its last row (forward.c) */
        ops->buf_copy(be, s->route_last + (size_t)st->l * st->k,
                      s->topk_ids + (size_t)(st->n - 1) * st->k, (size_t)st->k * sizeof(int32_t));
    ops->gather_rows(be, s->h, s->item_tok, n, d, s->rows_a);
    for (int e = 0; e < E; e++)
        expert_scales(m, st->l, e, &s->h_s_gu[e], &s->h_s_dn[e]);
    const void *const *tab = s->w_tab + (size_t)st->l * 2 * E;
    moe_model_grouped_matmul_dev(m, s->rows_a, n, d, 2 * ff, E, off, st->n,
                                 (const void *const *)w->w_gate_up, tab, s->h_s_gu, s->gate_up);
    ops->swiglu(be, s->gate_up, s->act, n, ff);
    moe_model_grouped_matmul_dev(m, s->act, n, ff, d, E, off, st->n, (const void *const *)w->w_down,
                                 tab + E, s->h_s_dn, s->rows_b);
    m->ep_rows_computed += (uint64_t)n;
    return MOE_OK;
}

void moe_model_route_stats(struct moe_model *m)
{
    struct scratch *s = &m->s;
    if (!s->route_any)
        return;
    const int E = m->cfg.n_expert, k = m->cfg.top_k, L = m->cfg.n_layer;
    const size_t n_off = (size_t)L * (E + 1);
    /* the padding rows' experts (the last row's) come along when there are any */
    m->be->ops->buf_download(m->be, s->h_route_off, s->route_off,
                             (n_off + (s->route_pad ? (size_t)L * k : 0)) * sizeof(int32_t));
    for (int l = 0; l < L; l++) {
        if (!s->route_pending[l])
            continue;
        const int32_t *off = s->h_route_off + (size_t)l * (E + 1);
        const int32_t *last = s->h_route_off + n_off + (size_t)l * k;
        for (int e = 0; e < E; e++) {
            int64_t cnt = off[e + 1] - off[e];
            for (int j = 0; j < k && s->route_pad; j++)
                cnt -= last[j] == e ? s->route_pad : 0;
            if (cnt > 0)
                __atomic_fetch_add(&m->expert_tokens[(size_t)l * E + e], (uint64_t)cnt,
                                   __ATOMIC_RELAXED);
        }
        s->route_pending[l] = false;
    }
    s->route_any = false;
}

/* One grouped GEMM over rows [r0, r1) of x (their experts' offsets `off`,
 * absolute), weights `w` / scales `sc` per expert. */
static void grouped(struct moe_model *m, const float *x, int r0, int r1, const int32_t *off,
                    int n_in, int n_out, const void **w, const float **sc, float *y)
{
    const struct moe_config *c = &m->cfg;
    int32_t *win = m->s.h_win;
    for (int e = 0; e <= c->n_expert; e++) {
        int v = off[e] < r0 ? r0 : off[e] > r1 ? r1 : off[e];
        win[e] = v - r0;
    }
    moe_model_grouped_matmul(m, x, r1 - r0, n_in, n_out, c->n_expert, win, w, sc, y);
}

/* The experts: `n_rows` rows of rows_a grouped by expert (offsets `off` on
 * the host) through their SwiGLU FFNs into rows_b, in windows of at most
 * cap_ffn_rows rows (the gate/up scratch) that end at an expert's last row where
 * they can. Fails on rows for an expert this rank does not hold. */
static enum moe_status experts(struct moe_step *st, const int32_t *off, int n_rows,
                               struct moe_error *err)
{
    struct moe_model *m = st->m;
    const struct moe_config *c = &m->cfg;
    const struct layer_weights *w = &m->layers[st->l];
    struct scratch *s = &m->s;
    const struct moe_backend_ops *ops = m->be->ops;
    const int d = st->d, ff = c->d_ff_expert;
    for (int e = 0; e < c->n_expert; e++) {
        bool rows = off[e + 1] > off[e];
        if (rows && !w->w_gate_up[e])
            return moe_error_set(err, MOE_ERR_INTERNAL,
                                 "layer %d: rank %d has %d rows for expert %d, which it does not "
                                 "hold (placements differ between ranks?)",
                                 st->l, st->me, off[e + 1] - off[e], e);
        s->h_w_gu[e] = rows ? w->w_gate_up[e] : NULL;
        s->h_w_dn[e] = rows ? w->w_down[e] : NULL;
        s->h_s_gu[e] = s->h_s_dn[e] = NULL;
        if (rows)
            expert_scales(m, st->l, e, &s->h_s_gu[e], &s->h_s_dn[e]);
    }
    const int cap = s->cap_ffn_rows;
    for (int r0 = 0, e = 0; r0 < n_rows;) {
        /* the window: whole experts while they fit, else cap rows of one */
        while (off[e + 1] <= r0)
            e++;
        int r1 = off[e + 1] - r0 > cap ? r0 + cap : off[e + 1];
        while (e + 1 < c->n_expert && off[e + 2] - r0 <= cap && r1 < n_rows) {
            e++;
            r1 = off[e + 1];
        }
        int nw = r1 - r0;
        grouped(m, s->rows_a + (size_t)r0 * d, r0, r1, off, d, 2 * ff, s->h_w_gu, s->h_s_gu,
                s->gate_up);
        ops->swiglu(m->be, s->gate_up, s->act, nw, ff);
        grouped(m, s->act, r0, r1, off, ff, d, s->h_w_dn, s->h_s_dn, s->rows_b + (size_t)r0 * d);
        r0 = r1;
    }
    return MOE_OK;
}

/* Combine: the outputs (rows_b, by expert) back to receive order (rows_r),
 * then to their senders, arriving in send order in rows_a. */
static enum moe_status combine(struct moe_step *st, struct moe_error *err)
{
    struct moe_model *m = st->m;
    struct scratch *s = &m->s;
    struct moe_backend *be = m->be;
    const struct moe_backend_ops *ops = be->ops;
    const int W = st->W;
    const size_t row_bytes = st->row_bytes, n_recv = st->n_recv;
    if (n_recv)
        ops->gather_rows(be, s->rows_b, s->r_inv, (int)n_recv, st->d, s->rows_r);
    ops->synchronize(be);
    size_t sb[MOE_MAX_EP_RANKS], rb[MOE_MAX_EP_RANKS], sdb[MOE_MAX_EP_RANKS], rdb[MOE_MAX_EP_RANKS];
    to_bytes(W, st->recv_counts, st->rd, row_bytes, sb, sdb);
    to_bytes(W, st->send_counts, st->sd, row_bytes, rb, rdb);
    enum moe_status rc =
        moe_comm_all_to_all_v(m->ep_comm, s->rows_r, sb, sdb, s->rows_a, rb, rdb, err);
    if (rc)
        return moe_error_prefix(err, "layer %d expert combine", st->l);
    m->ep_bytes_sent += (n_recv - st->recv_counts[st->me]) * row_bytes;
    return MOE_OK;
}

enum moe_status moe_moe_layer(struct moe_model *m, int l, int n, struct moe_error *err)
{
    struct moe_backend *be = m->be;
    const struct moe_backend_ops *ops = be->ops;
    struct scratch *s = &m->s;
    struct moe_step st;
    step_init(&st, m, l, n);
    enum moe_status rc;
    double t_begin = moe_now();

    const struct layer_weights *w = &m->layers[l];
    if (st.W == 1 && layer_routes_on_device(m, l, n)) {
        if (w->shared_gate_up && n)
            moe_model_shared_compute(m, w, n);
        if ((rc = experts_on_device(&st, err)))
            return rc;
        if (m->opts.profile)
            ops->synchronize(be);
        double t_computed = moe_now(); /* routing counted with the experts */
        m->prof.experts_s += t_computed - t_begin;
        moe_model_zero(m, s->ffn_out, st.row_bytes * (size_t)n);
        ops->unpermute_combine(be, s->rows_b, s->item_w, s->tok_rows, n, st.k, st.d, s->ffn_out);
        if (w->shared_gate_up)
            moe_model_shared_add(m, w, n);
        m->prof.combine_s += moe_now() - t_computed;
        return MOE_OK;
    }
    if ((rc = permute_shard(&st, err)))
        return rc;
    const int32_t *off = s->h_offsets; /* one rank: grouped by expert already */
    float *out = s->rows_b;            /* expert outputs in send order */
    st.n_recv = (size_t)st.n_items;
    if (st.W > 1 && (rc = dispatch_start(&st, err)))
        return rc;
    double t_shared = moe_now();
    if (w->shared_gate_up && n)
        moe_model_shared_compute(m, w, n);
    double t_shared_done = moe_now();
    if (st.W > 1) {
        if ((rc = dispatch_finish(&st, err)))
            return rc;
        off = s->h_r_offsets;
        out = s->rows_a;
    }
    double t_dispatched = moe_now();
    m->prof.experts_s += t_shared_done - t_shared;
    m->prof.dispatch_s += t_dispatched - t_begin - (t_shared_done - t_shared);
    m->ep_rows_computed += st.n_recv;

    if ((rc = experts(&st, off, (int)st.n_recv, err)))
        return rc;
    ops->synchronize(be);
    double t_computed = moe_now();
    m->prof.experts_s += t_computed - t_dispatched;

    if (st.W > 1 && (rc = combine(&st, err)))
        return rc;
    /* each token's rows weighted, in expert-id order, into its row of the
     * (zeroed) shard of ffn_out */
    moe_model_zero(m, s->ffn_out, (size_t)st.chunk * st.R * st.row_bytes);
    if (st.n_items)
        ops->unpermute_combine(be, out, s->item_w, s->tok_rows, st.t1 - st.t0, st.k, st.d,
                               s->ffn_out + (size_t)st.t0 * st.d);
    /* every rank of the row group gets every row: all-gather of the padded
     * shards */
    ops->synchronize(be);
    if (st.R > 1) {
        rc = moe_comm_all_gather(st.row_comm, s->ffn_out + (size_t)st.row_rank * st.chunk * st.d,
                                 s->ffn_out, (size_t)st.chunk * st.row_bytes, err);
        if (rc)
            return moe_error_prefix(err, "layer %d expert all-gather", l);
    }
    if (w->shared_gate_up && n)
        moe_model_shared_add(m, w, n);
    m->prof.combine_s += moe_now() - t_computed;
    return MOE_OK;
}
