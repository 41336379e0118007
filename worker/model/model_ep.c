/* The MoE layer over an expert-parallel group.
 *
 * Every rank holds the same n token rows (lock-step). Rank r owns the token
 * shard [t0, t1) = [r*c, min(n, (r+1)*c)) with c = ceil(n / W). With
 * data-parallel attention (moe_model_opts.dp_attention) every rank holds its
 * own n rows instead (n may differ between ranks, or be 0), shared only with
 * the other ranks of its tensor-parallel sub-group (its DP group): the
 * shards and the all-gather of step 5 are over that sub-group (pure DP, TP
 * 1: the shard is all n rows and step 5 does nothing).
 *   1. route: for each (token of the shard, chosen expert) pick a rank that
 *      holds the expert (the rank itself when it holds a replica);
 *   2. dispatch: all-to-all-v of the rows and their expert ids, grouped by
 *      destination, in (destination, expert, token) order;
 *   3. compute: the received rows, grouped by expert, through the local
 *      experts' SwiGLU FFN;
 *   4. combine: all-to-all-v of the outputs back to their senders, then for
 *      each expert in id order a weighted scatter-add into the token rows,
 *      which is the order the one-rank path sums in;
 *   5. all-gather the shards (padded to c rows each) so every rank has all n
 *      rows for the next attention block.
 * Bytes moved per routed (token, expert) pair that leaves its rank: d_model
 * floats + one id out, d_model floats back.
 * The layer allocates nothing: its host arrays are the h_ep_* scratch of
 * struct scratch, grown with the activations (forward.c, scratch_reserve). */
#include <string.h>

#include "model/model_internal.h"
#include "clock.h"

/* Counting sort of n items by key (0 <= key < n_keys), stable. `cursor`
 * holds n_keys entries of scratch. */
static void sort_by_key(const int32_t *key, int n, int n_keys, int32_t *order, int32_t *offsets,
                        int32_t *cursor)
{
    memset(offsets, 0, ((size_t)n_keys + 1) * sizeof *offsets);
    for (int i = 0; i < n; i++)
        offsets[key[i] + 1]++;
    for (int k = 0; k < n_keys; k++)
        offsets[k + 1] += offsets[k];
    memcpy(cursor, offsets, (size_t)n_keys * sizeof *cursor);
    for (int i = 0; i < n; i++)
        order[cursor[key[i]]++] = i;
}

/* One call of the layer: this rank's shard of the tokens, and how many
 * items (routed (token, expert) pairs) go to and come from each rank. */
struct ep_step {
    struct moe_model *m;
    int l;            /* layer */
    int n;            /* token rows, the same on every rank */
    int W, me, k, d;  /* ranks, this rank, top_k, d_model */
    size_t row_bytes; /* one row: d_model floats */
    int chunk;        /* rows per shard: ceil(n / R) */
    /* the ranks holding the same n rows, over which they are sharded: every
     * rank (lock-step), or with DP attention the TP sub-group (NULL: this
     * rank alone) */
    struct moe_comm *row_comm;
    int R, row_rank;
    int t0, t1;    /* this rank's shard [t0, t1) */
    int n_items;   /* (t1 - t0) * top_k items of the shard */
    size_t n_recv; /* items received from all ranks */
    size_t send_counts[MOE_MAX_EP_RANKS], recv_counts[MOE_MAX_EP_RANKS]; /* items, by rank */
    size_t sd[MOE_MAX_EP_RANKS], rd[MOE_MAX_EP_RANKS]; /* their displacements, in items */
};

/* Sets up the step for n rows of layer l. */
static void ep_step_init(struct ep_step *st, struct moe_model *m, int l, int n)
{
    const struct moe_comm *comm = m->ep_comm;
    *st = (struct ep_step){.m = m,
                           .l = l,
                           .n = n,
                           .W = comm->size,
                           .me = comm->rank,
                           .k = m->cfg.top_k,
                           .d = m->cfg.d_model};
    st->row_bytes = (size_t)st->d * sizeof(float);
    st->row_comm = m->opts.dp_attention ? m->tp_comm : m->ep_comm;
    st->R = st->row_comm ? st->row_comm->size : 1;
    st->row_rank = st->row_comm ? st->row_comm->rank : 0;
    st->chunk = (n + st->R - 1) / st->R;
    st->t0 = st->row_rank * st->chunk < n ? st->row_rank * st->chunk : n;
    st->t1 = (st->row_rank + 1) * st->chunk < n ? (st->row_rank + 1) * st->chunk : n;
    st->n_items = (st->t1 - st->t0) * st->k;
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

/* 1. Route this rank's shard: pick a rank for every item and lay the items
 * out in send order, (destination, expert, token), in s->h_ep_tok,
 * s->h_ep_exp and s->h_ep_w; fills st->send_counts. Counts every token of
 * the layer in the expert statistics. */
static void ep_route(struct ep_step *st)
{
    struct moe_model *m = st->m;
    const struct moe_config *c = &m->cfg;
    struct scratch *s = &m->s;
    struct moe_backend *be = m->be;
    const int k = st->k, t0 = st->t0, n_items = st->n_items;
    /* the ids and, after them, the weights */
    be->ops->buf_download(be, s->h_ids, s->topk_ids, 2 * (size_t)st->n * k * sizeof(int32_t));
    for (int i = 0; i < st->n * k; i++) /* statistics: every rank counts every token (with DP
                                         * attention its own: group.c sums them) */
        __atomic_fetch_add(&m->expert_tokens[(size_t)st->l * c->n_expert + s->h_ids[i]], 1,
                           __ATOMIC_RELAXED);
    int32_t *dest = s->h_ep_idx; /* scratch: destination of each item */
    for (int i = 0; i < n_items; i++) {
        int t = t0 + i / k, e = s->h_ids[t * k + i % k];
        dest[i] = moe_placement_pick(&m->placement, st->l, e, t, st->me);
    }
    /* order items by (destination, expert, token): sort by expert, then a
     * stable sort by destination keeps experts in order within each */
    int32_t *exp_of = s->h_ep_rexp; /* scratch */
    for (int i = 0; i < n_items; i++)
        exp_of[i] = s->h_ids[(t0 + i / k) * k + i % k];
    int32_t *order_e = s->h_ep_pos, *order = s->h_ep_order, *dest_sorted = s->h_ep_dest;
    int32_t offsets[MOE_MAX_EP_RANKS + 1];
    sort_by_key(exp_of, n_items, c->n_expert, order_e, s->h_ep_off, s->h_ep_cursor);
    for (int i = 0; i < n_items; i++)
        dest_sorted[i] = dest[order_e[i]];
    sort_by_key(dest_sorted, n_items, st->W, order, offsets, s->h_ep_cursor);
    for (int r = 0; r < st->W; r++)
        st->send_counts[r] = (size_t)(offsets[r + 1] - offsets[r]);
    /* final send order: item j = order_e[order[j]] */
    for (int j = 0; j < n_items; j++) {
        int i = order_e[order[j]];
        int t = t0 + i / k;
        s->h_ep_tok[j] = t;
        s->h_ep_exp[j] = exp_of[i];
        s->h_ep_w[j] = s->h_w[t * k + i % k];
    }
}

/* 2. Dispatch: exchange the counts, then all-to-all-v the expert ids
 * (ep_ids -> ep_rids) and the rows (ep_send -> ep_recv). */
static enum moe_status ep_dispatch(struct ep_step *st, struct moe_error *err)
{
    struct moe_model *m = st->m;
    struct scratch *s = &m->s;
    struct moe_backend *be = m->be;
    const struct moe_backend_ops *ops = be->ops;
    struct moe_comm *comm = m->ep_comm;
    const int W = st->W, me = st->me, k = st->k, n_items = st->n_items;
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
    if (!rc && st->n_recv > (size_t)s->cap_tok * k)
        rc = moe_error_set(err, MOE_ERR_INTERNAL, "rank %d would receive %zu rows, room for %d", me,
                           st->n_recv, s->cap_tok * k);
    if (rc)
        return moe_error_prefix(err, "layer %d expert dispatch", st->l);
    if (n_items) {
        ops->buf_upload(be, s->ep_idx, s->h_ep_tok, (size_t)n_items * sizeof(int32_t));
        ops->gather_rows(be, s->h, s->ep_idx, n_items, st->d, s->ep_send);
        ops->buf_upload(be, s->ep_ids, s->h_ep_exp, (size_t)n_items * sizeof(int32_t));
    }
    ops->synchronize(be);
    size_t sb[MOE_MAX_EP_RANKS], rb[MOE_MAX_EP_RANKS], sdb[MOE_MAX_EP_RANKS], rdb[MOE_MAX_EP_RANKS];
    to_bytes(W, st->send_counts, st->sd, sizeof(int32_t), sb, sdb);
    to_bytes(W, st->recv_counts, st->rd, sizeof(int32_t), rb, rdb);
    rc = moe_comm_all_to_all_v(comm, s->ep_ids, sb, sdb, s->ep_rids, rb, rdb, err);
    if (!rc) {
        to_bytes(W, st->send_counts, st->sd, st->row_bytes, sb, sdb);
        to_bytes(W, st->recv_counts, st->rd, st->row_bytes, rb, rdb);
        rc = moe_comm_all_to_all_v(comm, s->ep_send, sb, sdb, s->ep_recv, rb, rdb, err);
    }
    if (rc)
        return moe_error_prefix(err, "layer %d expert dispatch", st->l);
    m->ep_bytes_sent += n_sent_off_rank * (st->row_bytes + sizeof(int32_t));
    m->ep_rows_computed += st->n_recv;
    m->ep_rows_routed += (uint64_t)n_items;
    return MOE_OK;
}

/* 3. Compute: the received rows, grouped by expert, through the local
 * experts into ep_out (in receive order). Fails on a row for an expert this
 * rank does not hold. */
static enum moe_status ep_compute(struct ep_step *st, struct moe_error *err)
{
    struct moe_model *m = st->m;
    const struct moe_config *c = &m->cfg;
    const struct layer_weights *w = &m->layers[st->l];
    struct scratch *s = &m->s;
    struct moe_backend *be = m->be;
    const struct moe_backend_ops *ops = be->ops;
    const size_t n_recv = st->n_recv;
    if (!n_recv)
        return MOE_OK;
    ops->buf_download(be, s->h_ep_rexp, s->ep_rids, n_recv * sizeof(int32_t));
    for (size_t i = 0; i < n_recv; i++)
        if (s->h_ep_rexp[i] < 0 || s->h_ep_rexp[i] >= c->n_expert || !w->w_gate_up[s->h_ep_rexp[i]])
            return moe_error_set(err, MOE_ERR_INTERNAL,
                                 "layer %d: rank %d received a row for expert %d it does not "
                                 "hold (placements differ between ranks?)",
                                 st->l, st->me, s->h_ep_rexp[i]);
    int32_t *rorder = s->h_ep_order, *exp_offsets = s->h_ep_off;
    sort_by_key(s->h_ep_rexp, (int)n_recv, c->n_expert, rorder, exp_offsets, s->h_ep_cursor);
    ops->buf_upload(be, s->ep_idx, rorder, n_recv * sizeof(int32_t));
    for (int e = 0; e < c->n_expert; e++) {
        int begin = exp_offsets[e], cnt = exp_offsets[e + 1] - begin;
        if (!cnt)
            continue;
        ops->gather_rows(be, s->ep_recv, s->ep_idx + begin, cnt, st->d, s->xe);
        moe_model_ffn(m, s->xe, cnt, w->w_gate_up[e], c->d_ff_expert, w->w_down[e], s->ye);
        /* ep_out[rorder[i]] = ye[i]: scatter with weight 1 into zeroed rows */
        ops->scatter_add_rows(be, s->ye, s->ep_idx + begin, s->ones, cnt, st->d, s->ep_out);
    }
    return MOE_OK;
}

/* 4. Combine: the outputs back to their senders (ep_out -> ep_ret, in send
 * order), then per expert in id order a weighted scatter-add into this
 * rank's shard of ffn_out, the order the one-rank path sums in. */
static enum moe_status ep_combine(struct ep_step *st, struct moe_error *err)
{
    struct moe_model *m = st->m;
    const struct moe_config *c = &m->cfg;
    struct scratch *s = &m->s;
    struct moe_backend *be = m->be;
    const struct moe_backend_ops *ops = be->ops;
    const int W = st->W, d = st->d, n_items = st->n_items;
    const size_t row_bytes = st->row_bytes, n_recv = st->n_recv;
    size_t sb[MOE_MAX_EP_RANKS], rb[MOE_MAX_EP_RANKS], sdb[MOE_MAX_EP_RANKS], rdb[MOE_MAX_EP_RANKS];
    to_bytes(W, st->recv_counts, st->rd, row_bytes, sb, sdb);
    to_bytes(W, st->send_counts, st->sd, row_bytes, rb, rdb);
    enum moe_status rc =
        moe_comm_all_to_all_v(m->ep_comm, s->ep_out, sb, sdb, s->ep_ret, rb, rdb, err);
    if (rc)
        return moe_error_prefix(err, "layer %d expert combine", st->l);
    m->ep_bytes_sent += (n_recv - st->recv_counts[st->me]) * row_bytes;
    /* clear what step 3 scattered into, for the next layer */
    if (n_recv)
        moe_model_zero(m, s->ep_out, n_recv * row_bytes);
    moe_model_zero(m, s->ffn_out, (size_t)st->chunk * st->R * row_bytes);
    if (!n_items)
        return MOE_OK;
    /* per expert, in id order: rows of that expert among the sent items */
    int32_t *pos_by_exp = s->h_ep_order, *eoff = s->h_ep_off, *tok = s->h_ep_ctok;
    float *wt = s->h_ep_cw;
    sort_by_key(s->h_ep_exp, n_items, c->n_expert, pos_by_exp, eoff, s->h_ep_cursor);
    for (int j = 0; j < n_items; j++) {
        tok[j] = s->h_ep_tok[pos_by_exp[j]];
        wt[j] = s->h_ep_w[pos_by_exp[j]];
    }
    ops->buf_upload(be, s->ep_idx, pos_by_exp, (size_t)n_items * sizeof(int32_t));
    ops->gather_rows(be, s->ep_ret, s->ep_idx, n_items, d, s->ep_send);
    ops->buf_upload(be, s->ep_idx, tok, (size_t)n_items * sizeof(int32_t));
    ops->buf_upload(be, s->ep_w, wt, (size_t)n_items * sizeof(float));
    for (int e = 0; e < c->n_expert; e++) {
        int begin = eoff[e], cnt = eoff[e + 1] - begin;
        if (cnt)
            ops->scatter_add_rows(be, s->ep_send + (size_t)begin * d, s->ep_idx + begin,
                                  s->ep_w + begin, cnt, d, s->ffn_out);
    }
    return MOE_OK;
}

enum moe_status moe_ep_moe_layer(struct moe_model *m, int l, int n, struct moe_error *err)
{
    struct moe_backend *be = m->be;
    struct scratch *s = &m->s;
    struct ep_step st;
    ep_step_init(&st, m, l, n);
    enum moe_status rc;
    double t_begin = moe_now();

    ep_route(&st);
    if ((rc = ep_dispatch(&st, err)))
        return rc;
    double t_dispatched = moe_now();
    m->prof.dispatch_s += t_dispatched - t_begin;

    if ((rc = ep_compute(&st, err)))
        return rc;
    be->ops->synchronize(be);
    double t_computed = moe_now();
    m->prof.experts_s += t_computed - t_dispatched;

    if ((rc = ep_combine(&st, err)))
        return rc;
    /* 5. every rank of the row group gets every row: all-gather of the
     * padded shards */
    be->ops->synchronize(be);
    if (st.R == 1) {
        m->prof.combine_s += moe_now() - t_computed;
        return MOE_OK;
    }
    rc = moe_comm_all_gather(st.row_comm, s->ffn_out + (size_t)st.row_rank * st.chunk * st.d,
                             s->ffn_out, (size_t)st.chunk * st.row_bytes, err);
    if (rc)
        return moe_error_prefix(err, "layer %d expert all-gather", l);
    m->prof.combine_s += moe_now() - t_computed;
    return MOE_OK;
}
