/* Live expert placement on a model shard: the experts a new placement puts
 * on this rank are loaded beside the running ones (prepare), then swapped in
 * between two forward passes (commit); and the routing statistics the
 * planner reads. */
#include "model/model.h"
#include "model/model_internal.h"

#include <stdlib.h>
#include <string.h>

#include "placement.h"
#include "safetensors.h"

/* ---- expert statistics and live placement ------------------------------------------ */

const uint64_t *moe_model_expert_tokens(const struct moe_model *m)
{
    return m->expert_tokens;
}

void moe_model_add_expert_tokens(struct moe_model *m, const float *counts)
{
    size_t n = (size_t)m->cfg.n_layer * m->cfg.n_expert;
    for (size_t i = 0; i < n; i++)
        if (counts[i] > 0)
            __atomic_fetch_add(&m->expert_tokens[i], (uint64_t)counts[i], __ATOMIC_RELAXED);
}

uint64_t moe_model_ep_rows_computed(const struct moe_model *m)
{
    return m->ep_rows_computed;
}

#define FREE_PENDING(p)                                                                            \
    do {                                                                                           \
        if (p)                                                                                     \
            m->be->ops->buf_free(m->be, p);                                                        \
    } while (0)

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
    /* atomic like every access: the engine thread polls it while the loader
     * thread (group.c) starts a new preparation with this */
    __atomic_store_n(&m->pending_ready, false, __ATOMIC_RELEASE);
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
    struct st_model *st = NULL;
    size_t bytes_before = m->weight_bytes;
    if ((rc = st_open(m->dir, &st, err))) {
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
                rc = moe_model_load_expert(m, st, l, e, &m->pending_gate_up[i], &m->pending_down[i],
                                           err);
        }
    }
    st_close(st);
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
    size_t expert_bytes = moe_model_linear_bytes(m, 2 * (int64_t)c->d_ff_expert, c->d_model) +
                          moe_model_linear_bytes(m, c->d_model, c->d_ff_expert);
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
    m->placement_version++; /* the MoE layer copies it to the backend again */
    memset(&m->pending, 0, sizeof m->pending);
    drop_pending(m);
}
