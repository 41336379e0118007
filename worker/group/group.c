#include "group/group.h"

#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "group/devices.h"
#include "test_fault.h"
#include "clock.h"

enum plan_op { PLAN_FORWARD = 1, PLAN_STOP = 2 };

#define DP_MAX_RANKS 64 /* data-parallel attention: ranks of a group (the EP limit) */

/* The fixed-size head of a step plan; the arrays follow in one broadcast. */
struct plan_head {
    int32_t op;
    int32_t n_tok;
    int32_t n_seq;
    int32_t max_blocks;
    int32_t kv_blocks; /* shape of the leader's KV cache */
    int32_t kv_block_size;
    int32_t prepare; /* 1: a placement follows the batch; start preparing it */
    int32_t n_logits;
    int64_t epoch; /* with prepare: its epoch */
};

/* A placement on the wire: per (layer, expert) the replica count and ranks. */
static size_t placement_ints(const struct moe_placement *p)
{
    return (size_t)p->n_layer * p->n_expert * (1 + MOE_PLACEMENT_MAX_REPLICAS);
}

static void placement_pack(const struct moe_placement *p, int32_t *out)
{
    size_t n = (size_t)p->n_layer * p->n_expert;
    for (size_t i = 0; i < n; i++) {
        out[i] = p->n_replicas[i];
        for (int r = 0; r < MOE_PLACEMENT_MAX_REPLICAS; r++)
            out[n + i * MOE_PLACEMENT_MAX_REPLICAS + r] =
                p->ranks[i * MOE_PLACEMENT_MAX_REPLICAS + r];
    }
}

static void placement_unpack(const int32_t *in, struct moe_placement *p)
{
    size_t n = (size_t)p->n_layer * p->n_expert;
    for (size_t i = 0; i < n; i++) {
        p->n_replicas[i] = (uint8_t)in[i];
        for (int r = 0; r < MOE_PLACEMENT_MAX_REPLICAS; r++)
            p->ranks[i * MOE_PLACEMENT_MAX_REPLICAS + r] =
                (int16_t)in[n + i * MOE_PLACEMENT_MAX_REPLICAS + r];
    }
}

static void *prepare_main(void *arg)
{
    struct moe_group *g = arg;
    struct moe_error err = {0};
    enum moe_status st = moe_model_prepare_placement(g->model, &g->preparing_placement, &err);
    /* settle_prepare polls it from the engine thread before joining */
    __atomic_store_n(&g->prepare_status, st, __ATOMIC_RELEASE);
    if (st)
        fprintf(stderr, "moe: rank %d: preparing placement epoch %lld: %s\n", g->rank,
                (long long)g->preparing_epoch, err.msg);
    return NULL;
}

static void join_prepare(struct moe_group *g)
{
    if (g->prepare_thread_live) {
        pthread_join(g->prepare_thread, NULL);
        g->prepare_thread_live = false;
    }
}

/* Every rank, after the plan arrived: start loading a new placement. */
static enum moe_status start_prepare(struct moe_group *g, struct moe_model *m, const int32_t *wire,
                                     int64_t epoch, struct moe_error *err)
{
    const struct moe_config *c = moe_model_config(m);
    join_prepare(g);
    moe_placement_free(&g->preparing_placement);
    enum moe_status rc =
        moe_placement_default(c->n_layer, c->n_expert, g->size, &g->preparing_placement, err);
    if (rc)
        return rc;
    placement_unpack(wire, &g->preparing_placement);
    g->model = m;
    g->preparing = true;
    g->preparing_epoch = epoch;
    g->prepare_status = MOE_OK;
    if (pthread_create(&g->prepare_thread, NULL, prepare_main, g))
        return moe_error_set(err, MOE_ERR_INTERNAL, "cannot start the placement loader thread");
    g->prepare_thread_live = true;
    return MOE_OK;
}

/* Every rank after each forward: each rank routed only its own shard of
 * the rows (moe_layer.c); the leader adds the others' counts to its
 * counters (what the metrics and `moectl experts stats` read). */
static enum moe_status sum_expert_tokens(struct moe_group *g, struct moe_model *m,
                                         struct moe_error *err)
{
    const struct moe_config *c = moe_model_config(m);
    size_t n = (size_t)c->n_layer * c->n_expert;
    if (!n)
        return MOE_OK;
    if (!g->dp_expert && (!(g->dp_expert = calloc(n, sizeof *g->dp_expert)) ||
                          !(g->dp_expert_seen = calloc(n, sizeof *g->dp_expert_seen))))
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    /* the shards are distinct (within a DP group, and between groups), the
     * leader's own are counted already */
    bool speaks = g->rank != 0;
    const uint64_t *now = moe_model_expert_tokens(m);
    for (size_t i = 0; i < n; i++) {
        g->dp_expert[i] = speaks ? (float)(now[i] - g->dp_expert_seen[i]) : 0.0f;
        g->dp_expert_seen[i] = now[i];
    }
    enum moe_status rc = moe_comm_all_reduce_sum(g->world, g->dp_expert, n, err);
    if (rc)
        return rc;
    if (g->rank == 0) {
        moe_model_add_expert_tokens(m, g->dp_expert);
        for (size_t i = 0; i < n; i++) /* not this rank's own next time */
            g->dp_expert_seen[i] += (uint64_t)g->dp_expert[i];
    }
    return MOE_OK;
}

/* Every rank, after each forward: share how many rows each rank computed in
 * this step (the measured per-rank expert load). */
static enum moe_status count_rank_rows(struct moe_group *g, struct moe_model *m,
                                       struct moe_error *err)
{
    float small[64], *v = g->size <= 64 ? small : calloc((size_t)g->size, sizeof *v);
    if (!v)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    memset(v, 0, (size_t)g->size * sizeof *v);
    uint64_t now = moe_model_ep_rows_computed(m);
    v[g->rank] = (float)(now - g->rows_seen);
    g->rows_seen = now;
    enum moe_status rc = moe_comm_all_reduce_sum(g->world, v, (size_t)g->size, err);
    if (!rc)
        rc = sum_expert_tokens(g, m, err);
    if (!rc) {
        pthread_mutex_lock(&g->mu);
        for (int r = 0; r < g->size; r++)
            g->rank_rows[r] += (uint64_t)v[r];
        g->steps++;
        pthread_mutex_unlock(&g->mu);
    }
    if (v != small)
        free(v);
    return rc ? moe_error_prefix(err, "sharing per-rank expert load") : MOE_OK;
}

void moe_group_rank_rows(struct moe_group *g, uint64_t *rows, uint64_t *steps)
{
    pthread_mutex_lock(&g->mu);
    memcpy(rows, g->rank_rows, (size_t)g->size * sizeof *rows);
    *steps = g->steps;
    pthread_mutex_unlock(&g->mu);
}

/* Every rank, after each forward while a placement is being prepared: agree
 * on whether all ranks are ready; if so, switch now (the same step boundary
 * everywhere); if one failed, everyone drops the change. */
static enum moe_status settle_prepare(struct moe_group *g, struct moe_model *m,
                                      struct moe_error *err)
{
    bool done = !g->prepare_thread_live || moe_model_placement_ready(m) ||
                __atomic_load_n(&g->prepare_status, __ATOMIC_ACQUIRE);
    if (done)
        join_prepare(g);
    float flag = __atomic_load_n(&g->prepare_status, __ATOMIC_ACQUIRE) ? 1000.0f
                 : done && moe_model_placement_ready(m)                ? 0.0f
                                                                       : 1.0f;
    enum moe_status rc = moe_comm_all_reduce_sum(g->world, &flag, 1, err);
    if (rc)
        return moe_error_prefix(err, "agreeing on a placement switch");
    if (flag >= 1000.0f) {
        join_prepare(g);
        moe_model_drop_placement(m);
        g->preparing = false;
        if (g->rank == 0)
            fprintf(stderr, "moe: placement epoch %lld abandoned: a rank could not load it\n",
                    (long long)g->preparing_epoch);
    } else if (flag == 0.0f) {
        double t0 = moe_now();
        moe_model_commit_placement(m);
        pthread_mutex_lock(&g->mu);
        g->last_switch_s = moe_now() - t0;
        g->epoch = g->preparing_epoch;
        g->switches++;
        pthread_mutex_unlock(&g->mu);
        g->preparing = false;
        if (g->rank == 0)
            fprintf(stderr, "moe: placement epoch %lld in force (switch took %.3f ms)\n",
                    (long long)g->epoch, g->last_switch_s * 1e3);
    }
    return MOE_OK;
}

bool moe_group_launched_by_mpi(void)
{
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
}

enum moe_status moe_group_create(int *argc, char ***argv, int tp_size, bool dp_attention,
                                 int timeout_ms, struct moe_group **out, struct moe_error *err)
{
    *out = NULL;
    int provided = 0;
    if (MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
        return moe_error_set(err, MOE_ERR_IO, "MPI_Init_thread failed");
    if (provided < MPI_THREAD_SERIALIZED) {
        MPI_Finalize();
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "MPI provides thread level %d, SERIALIZED (%d) is needed", provided,
                             MPI_THREAD_SERIALIZED);
    }
    struct moe_group *g = calloc(1, sizeof *g);
    if (!g) {
        MPI_Finalize();
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    enum moe_status rc = moe_comm_create_mpi(MPI_COMM_WORLD, timeout_ms, &g->world, err);
    if (rc)
        goto fail;
    g->rank = g->world->rank;
    g->size = g->world->size;
    g->tp_size = tp_size;
    if (tp_size < 1 || g->size % tp_size) {
        rc = moe_error_set(err, MOE_ERR_INVALID,
                           "--tp %d: the group has %d ranks, which is not a multiple of it",
                           tp_size, g->size);
        goto fail;
    }
    if (dp_attention && g->size > DP_MAX_RANKS) {
        rc = moe_error_set(err, MOE_ERR_UNSUPPORTED, "--dp-attention over %d ranks (at most %d)",
                           g->size, DP_MAX_RANKS);
        goto fail;
    }
    g->dp = dp_attention && g->size > tp_size; /* one DP group is plain TP */
    g->dp_size = g->dp ? g->size / tp_size : 1;
    g->tp_rank = g->rank % tp_size;
    pthread_mutex_init(&g->mu, NULL);
    if (!(g->rank_rows = calloc((size_t)g->size, sizeof *g->rank_rows))) {
        rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (tp_size > 1 && (rc = moe_comm_split(g->world, g->rank / tp_size, g->tp_rank, &g->tp, err)))
        goto fail;
    /* The processes of this node, numbered in rank order: the local rank
     * picks the GPU (the launcher's own variables, OMPI_COMM_WORLD_LOCAL_RANK
     * and the like, differ between launchers; this does not). */
    MPI_Comm node_comm;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, g->rank, MPI_INFO_NULL,
                            &node_comm) != MPI_SUCCESS) {
        rc = moe_error_set(err, MOE_ERR_IO, "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) failed");
        goto fail;
    }
    g->node = g->rank;
    MPI_Comm_rank(node_comm, &g->local_rank);
    MPI_Comm_size(node_comm, &g->local_size);
    MPI_Bcast(&g->node, 1, MPI_INT, 0, node_comm);
    MPI_Comm_free(&node_comm);
    *out = g;
    return MOE_OK;
fail:
    moe_group_destroy(g);
    return rc;
}

void moe_group_destroy(struct moe_group *g)
{
    if (!g)
        return;
    if (g->world && g->world->broken) {
        /* A peer died or hung: MPI_Finalize could wait for it forever. */
        fprintf(stderr, "moe: rank %d: the group is broken, aborting the MPI job\n", g->rank);
        fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    join_prepare(g);
    free(g->rank_rows);
    moe_dp_split_free(&g->split);
    free(g->dp_logits);
    free(g->dp_expert);
    free(g->dp_expert_seen);
    moe_comm_destroy(g->dev_tp);
    moe_comm_destroy(g->dev_world);
    moe_placement_free(&g->proposal);
    moe_placement_free(&g->preparing_placement);
    moe_comm_destroy(g->tp);
    moe_comm_destroy(g->world);
    free(g);
    MPI_Finalize();
}

enum moe_status moe_group_attach_device(struct moe_group *g, struct moe_backend *be,
                                        const struct moe_error *why, struct moe_error *err)
{
    struct moe_rank_device mine, *all = calloc((size_t)g->size, sizeof *all);
    if (!all)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    moe_rank_device_fill(&mine, be, why, g->node);
    enum moe_status rc = moe_comm_all_gather(g->world, &mine, all, sizeof mine, err);
    if (rc) {
        free(all);
        return moe_error_prefix(err, "sharing the ranks' devices");
    }
    rc = moe_rank_devices_check(all, g->size, err);
    free(all);
    if (rc)
        return rc;
    fprintf(stderr, "moe: rank %d of %d (local rank %d of %d on this node): %s\n", g->rank, g->size,
            g->local_rank, g->local_size, be->label);
    if (be->device != MOE_DEVICE_CUDA)
        return MOE_OK;
    struct moe_comm_nccl_id id = {{0}};
    rc = g->rank == 0 ? moe_comm_nccl_get_id(&id, err) : MOE_OK;
    /* everyone takes part in the broadcast, even after a failure on rank 0 */
    int failed = rc != MOE_OK;
    if (moe_comm_broadcast(g->world, &failed, sizeof failed, 0, err) ||
        moe_comm_broadcast(g->world, &id, sizeof id, 0, err))
        return moe_error_prefix(err, "sharing the NCCL unique id");
    if (failed)
        return rc ? rc : moe_error_set(err, MOE_ERR_IO, "rank 0 could not create an NCCL id");
    /* The default stream: the model synchronises the backend's stream before
     * every collective, and each collective waits for its own completion. */
    if ((rc = moe_comm_create_nccl(&id, g->size, g->rank, be->ordinal, NULL, g->world->timeout_ms,
                                   &g->dev_world, err)))
        return rc;
    if (g->tp_size > 1 &&
        (rc = moe_comm_split(g->dev_world, g->rank / g->tp_size, g->tp_rank, &g->dev_tp, err)))
        return rc;
    return MOE_OK;
}

struct moe_comm *moe_group_model_tp(const struct moe_group *g)
{
    return g->dev_tp ? g->dev_tp : g->tp;
}

struct moe_comm *moe_group_model_ep(const struct moe_group *g)
{
    return g->dev_world ? g->dev_world : g->world;
}

enum moe_status moe_group_share_kv(struct moe_group *g, struct moe_model *m, int n_block,
                                   int block_size, const char *endpoint, char *endpoints,
                                   struct moe_kv_cache **kv_out, struct moe_error *err)
{
    *kv_out = NULL;
    int32_t shape[2] = {n_block, block_size};
    char mine[128] = "";
    snprintf(mine, sizeof mine, "%s", endpoint ? endpoint : "");
    /* the leader may still be loading its tokenizer and engine: wait for it */
    int timeout = g->world->timeout_ms;
    if (g->rank != 0)
        g->world->timeout_ms = 0;
    enum moe_status rc = moe_comm_broadcast(g->world, shape, sizeof shape, 0, err);
    g->world->timeout_ms = timeout;
    if (!rc)
        rc = moe_comm_all_gather(g->world, mine, endpoints, sizeof mine, err);
    if (rc)
        return moe_error_prefix(err, "sharing the KV cache shape and endpoints");
    if (g->rank == 0)
        return MOE_OK;
    moe_kv_cache_free(m, g->follower_kv);
    g->follower_kv = NULL;
    if ((rc = moe_kv_cache_create(m, shape[0], shape[1], &g->follower_kv, err)))
        return rc;
    g->kv_shared = true;
    *kv_out = g->follower_kv;
    return MOE_OK;
}

static size_t payload_ints(const struct plan_head *h)
{
    return 4 * (size_t)h->n_tok + (size_t)h->n_seq * h->max_blocks + (size_t)h->n_logits;
}

/* Data-parallel attention, every rank: runs its DP group's share of the step
 * `b` (global block ids) on its KV cache `kv` (the group's TP ranks each
 * with their heads), then brings every DP group's logit rows, from its TP
 * rank 0, to the leader's `logits`, in the order of b->logit_rows. */
static enum moe_status dp_forward(struct moe_group *g, struct moe_model *m, struct moe_kv_cache *kv,
                                  const struct moe_batch *b, float *logits, struct moe_error *err)
{
    struct moe_dp_split *sp = &g->split;
    const int dp_rank = g->rank / g->tp_size, tp = g->tp_size;
    enum moe_status rc =
        moe_dp_split_batch(b, g->dp_size, kv->n_block, kv->block_size, dp_rank, sp, err);
    if (rc)
        return moe_error_prefix(err, "rank %d", g->rank);
    if (g->tp_rank) /* its TP rank 0 computes the DP group's logits */
        sp->b.n_logits = 0;
    size_t V = (size_t)moe_model_config(m)->vocab_size;
    size_t need = (size_t)(b->n_logits > 0 ? b->n_logits : 1) * V * (g->rank ? 1 : 2);
    if (need > g->cap_dp_logits) {
        free(g->dp_logits);
        g->cap_dp_logits = 0;
        if (!(g->dp_logits = malloc(need * sizeof *g->dp_logits)))
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory for %d rows of logits",
                                 b->n_logits);
        g->cap_dp_logits = need;
    }
    if ((rc = moe_model_forward(m, kv, &sp->b, g->dp_logits, err)))
        return rc;
    if (!b->n_logits)
        return MOE_OK;
    /* every DP group's rows to the leader, in group order (from the group's
     * TP rank 0, rank = group x tp) */
    size_t row = V * sizeof(float), sc[DP_MAX_RANKS] = {0}, sd[DP_MAX_RANKS] = {0},
           rc_[DP_MAX_RANKS] = {0}, rd[DP_MAX_RANKS] = {0};
    int per_group[DP_MAX_RANKS] = {0};
    for (int i = 0; i < b->n_logits; i++)
        per_group[sp->logit_rank[i]]++;
    sc[0] = (size_t)sp->b.n_logits * row;
    for (int d = 0, at = 0; g->rank == 0 && d < g->dp_size; d++) {
        rc_[d * tp] = (size_t)per_group[d] * row;
        rd[d * tp] = (size_t)at * row;
        at += per_group[d];
    }
    float *gathered = g->dp_logits + (size_t)b->n_logits * V; /* leader only */
    if ((rc = moe_comm_all_to_all_v(g->world, g->dp_logits, sc, sd, gathered, rc_, rd, err)))
        return moe_error_prefix(err, "gathering the ranks' logits");
    if (g->rank)
        return MOE_OK;
    int next[DP_MAX_RANKS], at = 0;
    for (int d = 0; d < g->dp_size; d++) {
        next[d] = at;
        at += per_group[d];
    }
    for (int i = 0; i < b->n_logits; i++)
        memcpy(logits + (size_t)i * V, gathered + (size_t)next[sp->logit_rank[i]]++ * V, row);
    return MOE_OK;
}

enum moe_status moe_group_forward(void *group, struct moe_model *m, struct moe_kv_cache *kv,
                                  const struct moe_batch *b, float *logits, struct moe_error *err)
{
    struct moe_group *g = group;
    struct plan_head h = {
        PLAN_FORWARD, b->n_tok, b->n_seq, b->max_blocks, kv->n_block, kv->block_size, 0,
        b->n_logits,  0};
    struct moe_placement start = {0};
    pthread_mutex_lock(&g->mu);
    if (g->has_proposal && !g->preparing) {
        start = g->proposal;
        memset(&g->proposal, 0, sizeof g->proposal);
        g->has_proposal = false;
        h.prepare = 1;
        h.epoch = g->proposal_epoch;
    }
    pthread_mutex_unlock(&g->mu);
    size_t n = payload_ints(&h) + (h.prepare ? placement_ints(&start) : 0);
    int32_t *pl = malloc((n ? n : 1) * sizeof *pl);
    if (!pl)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory for a step plan");
    size_t nt = (size_t)b->n_tok;
    memcpy(pl, b->tokens, nt * sizeof *pl);
    memcpy(pl + nt, b->pos, nt * sizeof *pl);
    memcpy(pl + 2 * nt, b->seq, nt * sizeof *pl);
    memcpy(pl + 3 * nt, b->slots, nt * sizeof *pl);
    memcpy(pl + 4 * nt, b->block_tables, (size_t)b->n_seq * b->max_blocks * sizeof *pl);
    if (b->n_logits)
        memcpy(pl + 4 * nt + (size_t)b->n_seq * b->max_blocks, b->logit_rows,
               (size_t)b->n_logits * sizeof *pl);
    if (h.prepare)
        placement_pack(&start, pl + payload_ints(&h));
    enum moe_status rc = moe_comm_broadcast(g->world, &h, sizeof h, 0, err);
    if (!rc)
        rc = moe_comm_broadcast(g->world, pl, n * sizeof *pl, 0, err);
    if (!rc && h.prepare)
        rc = start_prepare(g, m, pl + payload_ints(&h), h.epoch, err);
    free(pl);
    moe_placement_free(&start);
    if (rc)
        return moe_error_prefix(err, "broadcasting the step plan");
    rc = g->dp ? dp_forward(g, m, kv, b, logits, err) : moe_model_forward(m, kv, b, logits, err);
    if (rc || (rc = count_rank_rows(g, m, err)))
        return rc;
    return g->preparing ? settle_prepare(g, m, err) : MOE_OK;
}

enum moe_status moe_group_propose_placement(struct moe_group *g, const struct moe_placement *p,
                                            int64_t epoch, struct moe_error *err)
{
    if (p->n_rank != g->size)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "placement epoch %lld is for %d ranks, the group has %d",
                             (long long)epoch, p->n_rank, g->size);
    struct moe_placement copy;
    enum moe_status rc = moe_placement_default(p->n_layer, p->n_expert, p->n_rank, &copy, err);
    if (rc)
        return rc;
    size_t n = (size_t)p->n_layer * p->n_expert;
    memcpy(copy.n_replicas, p->n_replicas, n);
    memcpy(copy.ranks, p->ranks, n * MOE_PLACEMENT_MAX_REPLICAS * sizeof *p->ranks);
    pthread_mutex_lock(&g->mu);
    moe_placement_free(&g->proposal);
    g->proposal = copy;
    g->proposal_epoch = epoch;
    g->has_proposal = true;
    pthread_mutex_unlock(&g->mu);
    return MOE_OK;
}

int64_t moe_group_placement_epoch(struct moe_group *g, double *last_switch_s)
{
    pthread_mutex_lock(&g->mu);
    int64_t e = g->epoch;
    if (last_switch_s)
        *last_switch_s = g->last_switch_s;
    pthread_mutex_unlock(&g->mu);
    return e;
}

/* Fault injection for the tests (test_fault.h: armed only with
 * MOE_TEST_FAULTS=1): MOE_FAULT_RANK=r MOE_FAULT_AFTER_STEPS=n makes rank r
 * die by SIGKILL after running n steps, as a crashed or OOM-killed process
 * would. */
static void maybe_die(const struct moe_group *g, int fault_rank, int fault_after, int steps)
{
    if (fault_rank == g->rank && fault_after >= 0 && steps >= fault_after) {
        fprintf(stderr, "moe: rank %d: MOE_FAULT_RANK: dying after %d steps\n", g->rank, steps);
        fflush(stderr);
        raise(SIGKILL);
    }
}

enum moe_status moe_group_follow(struct moe_group *g, struct moe_model *m, struct moe_error *err)
{
    int32_t *pl = NULL;
    size_t cap = 0;
    enum moe_status rc = MOE_OK;
    int steps = 0;
    g->follower_model = m;
    int fault_rank = moe_fault_int("MOE_FAULT_RANK", -1);
    int fault_after = fault_rank >= 0 ? moe_fault_int("MOE_FAULT_AFTER_STEPS", -1) : -1;
    for (;;) {
        maybe_die(g, fault_rank, fault_after, steps++);
        struct plan_head h;
        /* Idle groups wait for the next plan as long as it takes. */
        int timeout = g->world->timeout_ms;
        g->world->timeout_ms = 0;
        rc = moe_comm_broadcast(g->world, &h, sizeof h, 0, err);
        g->world->timeout_ms = timeout;
        if (rc || h.op == PLAN_STOP)
            break;
        if (h.op != PLAN_FORWARD || h.n_tok < 1 || h.n_seq < 1 || h.max_blocks < 1 ||
            h.kv_blocks < 1 || h.kv_block_size < 1 || h.n_logits < 0 || h.n_logits > h.n_tok) {
            rc = moe_error_set(err, MOE_ERR_INTERNAL, "rank %d: malformed step plan (op %d)",
                               g->rank, h.op);
            break;
        }
        size_t n = payload_ints(&h) +
                   (h.prepare ? (size_t)moe_model_config(m)->n_layer *
                                    moe_model_config(m)->n_expert * (1 + MOE_PLACEMENT_MAX_REPLICAS)
                              : 0);
        if (n > cap) {
            free(pl);
            cap = n;
            if (!(pl = malloc(cap * sizeof *pl))) {
                rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory for a step plan");
                break;
            }
        }
        if ((rc = moe_comm_broadcast(g->world, pl, n * sizeof *pl, 0, err)))
            break;
        if (h.prepare && (rc = start_prepare(g, m, pl + payload_ints(&h), h.epoch, err)))
            break;
        struct moe_kv_cache *kv = g->follower_kv;
        if (!kv || kv->n_block != h.kv_blocks || kv->block_size != h.kv_block_size) {
            if (g->kv_shared) { /* the KV data plane holds it */
                rc = moe_error_set(err, MOE_ERR_INTERNAL,
                                   "rank %d: the leader's KV cache changed shape after it "
                                   "was shared",
                                   g->rank);
                break;
            }
            moe_kv_cache_free(m, kv);
            g->follower_kv = NULL;
            if ((rc = moe_kv_cache_create(m, h.kv_blocks, h.kv_block_size, &g->follower_kv, err)))
                break;
            kv = g->follower_kv;
        }
        size_t nt = (size_t)h.n_tok;
        struct moe_batch b = {
            .n_tok = h.n_tok,
            .tokens = pl,
            .pos = pl + nt,
            .seq = pl + 2 * nt,
            .slots = pl + 3 * nt,
            .n_seq = h.n_seq,
            .block_tables = pl + 4 * nt,
            .max_blocks = h.max_blocks,
            .n_logits = g->dp ? h.n_logits : 0, /* followers compute logits only for DP */
            .logit_rows = pl + 4 * nt + (size_t)h.n_seq * h.max_blocks,
        };
        rc = g->dp ? dp_forward(g, m, kv, &b, NULL, err) : moe_model_forward(m, kv, &b, NULL, err);
        if (rc || (rc = count_rank_rows(g, m, err)))
            break;
        if (g->preparing && (rc = settle_prepare(g, m, err)))
            break;
    }
    free(pl);
    join_prepare(g);   /* it may still be loading into the model */
    if (!g->kv_shared) /* a shared cache is the caller's to free (after its KV link) */
        moe_kv_cache_free(m, g->follower_kv); /* before the caller frees the model */
    g->follower_kv = NULL;
    return rc;
}

enum moe_status moe_group_stop(struct moe_group *g, struct moe_error *err)
{
    join_prepare(g); /* before the caller frees the model it loads into */
    if (g->world->broken)
        return moe_error_set(err, MOE_ERR_IO, "the group is broken");
    struct plan_head h = {.op = PLAN_STOP};
    return moe_comm_broadcast(g->world, &h, sizeof h, 0, err);
}
