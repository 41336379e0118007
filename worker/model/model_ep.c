/* The MoE layer over an expert-parallel group.
 *
 * Every rank holds the same n token rows (lock-step). Rank r owns the token
 * shard [t0, t1) = [r*c, min(n, (r+1)*c)) with c = ceil(n / W):
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
 * floats + one id out, d_model floats back. */
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"
#include "clock.h"

/* Counting sort of n items by key (0 <= key < n_keys), stable. */
static void sort_by_key(const int32_t *key, int n, int n_keys, int32_t *order, int32_t *offsets)
{
    memset(offsets, 0, ((size_t)n_keys + 1) * sizeof *offsets);
    for (int i = 0; i < n; i++)
        offsets[key[i] + 1]++;
    for (int k = 0; k < n_keys; k++)
        offsets[k + 1] += offsets[k];
    int32_t cursor[MOE_MAX_EP_RANKS > 1024 ? MOE_MAX_EP_RANKS : 1024];
    int32_t *cur = n_keys <= (int)(sizeof cursor / sizeof *cursor)
                       ? cursor
                       : malloc((size_t)n_keys * sizeof *cur);
    MOE_ASSERT(cur);
    memcpy(cur, offsets, (size_t)n_keys * sizeof *cur);
    for (int i = 0; i < n; i++)
        order[cur[key[i]]++] = i;
    if (cur != cursor)
        free(cur);
}

enum moe_status moe_ep_moe_layer(struct moe_model *m, int l, int n, struct moe_error *err)
{
    const struct moe_config *c = &m->cfg;
    const struct layer_weights *w = &m->layers[l];
    struct scratch *s = &m->s;
    struct moe_backend *be = m->be;
    const struct moe_backend_ops *ops = be->ops;
    struct moe_comm *comm = m->ep_comm;
    const int W = comm->size, me = comm->rank, k = c->top_k, d = c->d_model;
    const size_t row_bytes = (size_t)d * sizeof(float);
    const int chunk = (n + W - 1) / W;
    const int t0 = me * chunk < n ? me * chunk : n;
    const int t1 = (me + 1) * chunk < n ? (me + 1) * chunk : n;
    const int n_items = (t1 - t0) * k;
    enum moe_status rc;
    double t_begin = moe_now();

    /* 1. route this rank's shard */
    ops->buf_download(be, s->h_ids, s->topk_ids, 2 * (size_t)n * k * sizeof(int32_t)); /* + w */
    for (int i = 0; i < n * k; i++) /* statistics: every rank counts every token */
        __atomic_fetch_add(&m->expert_tokens[(size_t)l * c->n_expert + s->h_ids[i]], 1,
                           __ATOMIC_RELAXED);
    int32_t *dest = s->h_ep_idx; /* scratch: destination of each item */
    for (int i = 0; i < n_items; i++) {
        int t = t0 + i / k, e = s->h_ids[t * k + i % k];
        dest[i] = moe_placement_pick(&m->placement, l, e, t, me);
    }
    /* order items by (destination, expert, token): sort by expert, then a
     * stable sort by destination keeps experts in order within each */
    int32_t *exp_of = s->h_ep_rexp; /* scratch */
    for (int i = 0; i < n_items; i++)
        exp_of[i] = s->h_ids[(t0 + i / k) * k + i % k];
    int32_t *order_e = s->h_ep_pos, offsets[MOE_MAX_EP_RANKS + 1];
    int32_t *exp_offsets = malloc(((size_t)c->n_expert + 1) * sizeof *exp_offsets);
    int32_t *order = malloc((size_t)(n_items ? n_items : 1) * sizeof *order);
    int32_t *dest_sorted = malloc((size_t)(n_items ? n_items : 1) * sizeof *dest_sorted);
    if (!exp_offsets || !order || !dest_sorted) {
        free(exp_offsets);
        free(order);
        free(dest_sorted);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory in the expert-parallel layer");
    }
    sort_by_key(exp_of, n_items, c->n_expert, order_e, exp_offsets);
    for (int i = 0; i < n_items; i++)
        dest_sorted[i] = dest[order_e[i]];
    sort_by_key(dest_sorted, n_items, W, order, offsets);
    size_t send_counts[MOE_MAX_EP_RANKS], recv_counts[MOE_MAX_EP_RANKS];
    for (int r = 0; r < W; r++)
        send_counts[r] = (size_t)(offsets[r + 1] - offsets[r]);
    /* final send order: item j = order_e[order[j]] */
    for (int j = 0; j < n_items; j++) {
        int i = order_e[order[j]];
        int t = t0 + i / k;
        s->h_ep_tok[j] = t;
        s->h_ep_exp[j] = exp_of[i];
        s->h_ep_w[j] = s->h_w[t * k + i % k];
    }
    free(order);
    free(dest_sorted);

    /* 2. dispatch */
    rc = moe_comm_all_to_all_counts(comm, send_counts, recv_counts, err);
    size_t n_recv = 0, sd[MOE_MAX_EP_RANKS], rd[MOE_MAX_EP_RANKS];
    size_t sb[MOE_MAX_EP_RANKS], rb[MOE_MAX_EP_RANKS], sdb[MOE_MAX_EP_RANKS], rdb[MOE_MAX_EP_RANKS];
    size_t n_sent_off_rank = 0;
    for (int r = 0, so = 0; r < W; r++) {
        sd[r] = (size_t)so;
        so += (int)send_counts[r];
        rd[r] = n_recv;
        n_recv += recv_counts[r];
        if (r != me)
            n_sent_off_rank += send_counts[r];
    }
    if (!rc && n_recv > (size_t)s->cap_tok * k)
        rc = moe_error_set(err, MOE_ERR_INTERNAL, "rank %d would receive %zu rows, room for %d", me,
                           n_recv, s->cap_tok * k);
    if (rc) {
        free(exp_offsets);
        return moe_error_prefix(err, "layer %d expert dispatch", l);
    }
    if (n_items) {
        ops->buf_upload(be, s->ep_idx, s->h_ep_tok, (size_t)n_items * sizeof(int32_t));
        ops->gather_rows(be, s->h, s->ep_idx, n_items, d, s->ep_send);
        ops->buf_upload(be, s->ep_ids, s->h_ep_exp, (size_t)n_items * sizeof(int32_t));
    }
    ops->synchronize(be);
    for (int r = 0; r < W; r++) {
        sb[r] = send_counts[r] * sizeof(int32_t);
        sdb[r] = sd[r] * sizeof(int32_t);
        rb[r] = recv_counts[r] * sizeof(int32_t);
        rdb[r] = rd[r] * sizeof(int32_t);
    }
    rc = moe_comm_all_to_all_v(comm, s->ep_ids, sb, sdb, s->ep_rids, rb, rdb, err);
    for (int r = 0; !rc && r < W; r++) {
        sb[r] = send_counts[r] * row_bytes;
        sdb[r] = sd[r] * row_bytes;
        rb[r] = recv_counts[r] * row_bytes;
        rdb[r] = rd[r] * row_bytes;
    }
    if (!rc)
        rc = moe_comm_all_to_all_v(comm, s->ep_send, sb, sdb, s->ep_recv, rb, rdb, err);
    if (rc) {
        free(exp_offsets);
        return moe_error_prefix(err, "layer %d expert dispatch", l);
    }
    m->ep_bytes_sent += n_sent_off_rank * (row_bytes + sizeof(int32_t));
    m->ep_rows_computed += n_recv;
    m->ep_rows_routed += (uint64_t)n_items;

    double t_dispatched = moe_now();
    m->prof.dispatch_s += t_dispatched - t_begin;

    /* 3. compute the received rows on the local experts */
    if (n_recv) {
        ops->buf_download(be, s->h_ep_rexp, s->ep_rids, n_recv * sizeof(int32_t));
        for (size_t i = 0; i < n_recv; i++)
            if (s->h_ep_rexp[i] < 0 || s->h_ep_rexp[i] >= c->n_expert ||
                !w->w_gate_up[s->h_ep_rexp[i]]) {
                free(exp_offsets);
                return moe_error_set(err, MOE_ERR_INTERNAL,
                                     "layer %d: rank %d received a row for expert %d it does not "
                                     "hold (placements differ between ranks?)",
                                     l, me, s->h_ep_rexp[i]);
            }
        int32_t *rorder = malloc(n_recv * sizeof *rorder);
        if (!rorder) {
            free(exp_offsets);
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        }
        sort_by_key(s->h_ep_rexp, (int)n_recv, c->n_expert, rorder, exp_offsets);
        ops->buf_upload(be, s->ep_idx, rorder, n_recv * sizeof(int32_t));
        free(rorder);
        for (int e = 0; e < c->n_expert; e++) {
            int begin = exp_offsets[e], cnt = exp_offsets[e + 1] - begin;
            if (!cnt)
                continue;
            ops->gather_rows(be, s->ep_recv, s->ep_idx + begin, cnt, d, s->xe);
            moe_model_ffn(m, s->xe, cnt, w->w_gate_up[e], c->d_ff_expert, w->w_down[e], s->ye);
            /* ep_out[rorder[i]] = ye[i]: scatter with weight 1 into zeroed rows */
            ops->scatter_add_rows(be, s->ye, s->ep_idx + begin, s->ones, cnt, d, s->ep_out);
        }
    }
    free(exp_offsets);

    /* 4. combine: outputs back to their senders, in send order */
    ops->synchronize(be);
    double t_computed = moe_now();
    m->prof.experts_s += t_computed - t_dispatched;
    for (int r = 0; r < W; r++) {
        sb[r] = recv_counts[r] * row_bytes;
        sdb[r] = rd[r] * row_bytes;
        rb[r] = send_counts[r] * row_bytes;
        rdb[r] = sd[r] * row_bytes;
    }
    rc = moe_comm_all_to_all_v(comm, s->ep_out, sb, sdb, s->ep_ret, rb, rdb, err);
    if (rc)
        return moe_error_prefix(err, "layer %d expert combine", l);
    m->ep_bytes_sent += (n_recv - recv_counts[me]) * row_bytes;
    /* clear what step 3 scattered into, for the next layer */
    if (n_recv)
        moe_model_zero(m, s->ep_out, n_recv * row_bytes);
    moe_model_zero(m, s->ffn_out, (size_t)chunk * W * row_bytes);
    /* per expert, in id order: rows of that expert among the sent items */
    if (n_items) {
        int32_t *pos_by_exp = malloc((size_t)n_items * sizeof *pos_by_exp);
        int32_t *eoff = malloc(((size_t)c->n_expert + 1) * sizeof *eoff);
        int32_t *tok = malloc((size_t)n_items * sizeof *tok);
        float *wt = malloc((size_t)n_items * sizeof *wt);
        if (!pos_by_exp || !eoff || !tok || !wt) {
            free(pos_by_exp);
            free(eoff);
            free(tok);
            free(wt);
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        }
        sort_by_key(s->h_ep_exp, n_items, c->n_expert, pos_by_exp, eoff);
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
        free(pos_by_exp);
        free(eoff);
        free(tok);
        free(wt);
    }

    /* 5. every rank gets every row: all-gather of the padded shards */
    ops->synchronize(be);
    rc = moe_comm_all_gather(comm, s->ffn_out + (size_t)me * chunk * d, s->ffn_out,
                             (size_t)chunk * row_bytes, err);
    if (rc)
        return moe_error_prefix(err, "layer %d expert all-gather", l);
    m->prof.combine_s += moe_now() - t_computed;
    return MOE_OK;
}
