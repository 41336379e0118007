#include "group.h"

#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum plan_op { PLAN_FORWARD = 1, PLAN_STOP = 2 };

/* The fixed-size head of a step plan; the arrays follow in one broadcast. */
struct plan_head {
    int32_t op;
    int32_t n_tok;
    int32_t n_seq;
    int32_t max_blocks;
    int32_t kv_blocks;     /* shape of the leader's KV cache */
    int32_t kv_block_size;
};

bool moe_group_launched_by_mpi(void)
{
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
}

enum moe_status moe_group_create(int *argc, char ***argv, int tp_size, int timeout_ms,
                                 struct moe_group **out, struct moe_error *err)
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
    g->tp_rank = g->rank % tp_size;
    if (tp_size > 1 && (rc = moe_comm_split(g->world, g->rank / tp_size, g->tp_rank, &g->tp, err)))
        goto fail;
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
    if (g->follower_kv)
        moe_kv_cache_free(g->follower_model, g->follower_kv);
    moe_comm_destroy(g->tp);
    moe_comm_destroy(g->world);
    free(g);
    MPI_Finalize();
}

static size_t payload_ints(const struct plan_head *h)
{
    return 4 * (size_t)h->n_tok + (size_t)h->n_seq * h->max_blocks;
}

enum moe_status moe_group_forward(void *group, struct moe_model *m, struct moe_kv_cache *kv,
                                  const struct moe_batch *b, float *logits, struct moe_error *err)
{
    struct moe_group *g = group;
    struct plan_head h = {PLAN_FORWARD, b->n_tok, b->n_seq, b->max_blocks, kv->n_block,
                          kv->block_size};
    size_t n = payload_ints(&h);
    int32_t *pl = malloc((n ? n : 1) * sizeof *pl);
    if (!pl)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory for a step plan");
    size_t nt = (size_t)b->n_tok;
    memcpy(pl, b->tokens, nt * sizeof *pl);
    memcpy(pl + nt, b->pos, nt * sizeof *pl);
    memcpy(pl + 2 * nt, b->seq, nt * sizeof *pl);
    memcpy(pl + 3 * nt, b->slots, nt * sizeof *pl);
    memcpy(pl + 4 * nt, b->block_tables, (size_t)b->n_seq * b->max_blocks * sizeof *pl);
    enum moe_status rc = moe_comm_broadcast(g->world, &h, sizeof h, 0, err);
    if (!rc)
        rc = moe_comm_broadcast(g->world, pl, n * sizeof *pl, 0, err);
    free(pl);
    if (rc)
        return moe_error_prefix(err, "broadcasting the step plan");
    return moe_model_forward(m, kv, b, logits, err);
}

/* Fault injection for the tests (SQLite style, always compiled):
 * MOE_FAULT_RANK=r MOE_FAULT_AFTER_STEPS=n makes rank r die by SIGKILL after
 * running n steps, as a crashed or OOM-killed process would. */
static void maybe_die(const struct moe_group *g, int steps)
{
    const char *r = getenv("MOE_FAULT_RANK"), *n = getenv("MOE_FAULT_AFTER_STEPS");
    if (r && n && atoi(r) == g->rank && steps >= atoi(n)) {
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
    for (;;) {
        maybe_die(g, steps++);
        struct plan_head h;
        /* Idle groups wait for the next plan as long as it takes. */
        int timeout = g->world->timeout_ms;
        g->world->timeout_ms = 0;
        rc = moe_comm_broadcast(g->world, &h, sizeof h, 0, err);
        g->world->timeout_ms = timeout;
        if (rc || h.op == PLAN_STOP)
            break;
        if (h.op != PLAN_FORWARD || h.n_tok < 1 || h.n_seq < 1 || h.max_blocks < 1 ||
            h.kv_blocks < 1 || h.kv_block_size < 1) {
            rc = moe_error_set(err, MOE_ERR_INTERNAL, "rank %d: malformed step plan (op %d)",
                               g->rank, h.op);
            break;
        }
        size_t n = payload_ints(&h);
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
        struct moe_kv_cache *kv = g->follower_kv;
        if (!kv || kv->n_block != h.kv_blocks || kv->block_size != h.kv_block_size) {
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
            .n_logits = 0,
        };
        if ((rc = moe_model_forward(m, kv, &b, NULL, err)))
            break;
    }
    free(pl);
    return rc;
}

enum moe_status moe_group_stop(struct moe_group *g, struct moe_error *err)
{
    if (g->world->broken)
        return moe_error_set(err, MOE_ERR_IO, "the group is broken");
    struct plan_head h = {.op = PLAN_STOP};
    return moe_comm_broadcast(g->world, &h, sizeof h, 0, err);
}
