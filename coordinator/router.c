/* Picks a worker for a request.
 *
 * Load of a worker (lower is better):
 *   queue = max(running + waiting from its last GetLoad, requests the
 *               coordinator has in flight on it now)
 *   load  = queue + 4 * (KV blocks used / KV blocks total)
 * The coordinator's own in-flight count moves at once, so a burst spreads
 * before the next poll; the max() avoids counting our requests twice while
 * still seeing load that other clients put on the worker directly.
 *
 * Prefix affinity: the prompt's first 1..4 whole blocks of 16 tokens are
 * hashed (one hash per length, each chaining the previous one). The worker
 * that last served the longest known prefix is preferred unless its load
 * exceeds the least loaded worker's by more than 2 + 25% ("clearly
 * higher"): then the least loaded one wins and becomes the prefix's worker.
 * Ties between equally loaded workers rotate (round robin).
 *
 * Only SERVING workers are eligible: not DOWN, not drained by Admin, not
 * reporting draining.
 *
 * Roles (disaggregated serving): a plain pick prefers mixed and decode
 * workers (prefill workers only when nothing else serves); forward.c picks a
 * prefill worker by role, and a decode worker for a handoff by load among
 * those with enough free KV blocks and the same block and TP size. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "coord.h"
#include "moe/v1/admin.pb-c.h"

#define KV_WEIGHT 4.0
#define AFFINITY_SLACK_ABS 2.0
#define AFFINITY_SLACK_REL 0.25

double coord_worker_load_locked(const struct coord_worker *w)
{
    double polled = (double)w->running + (double)w->waiting;
    double mine = (double)w->in_flight;
    double queue = polled > mine ? polled : mine;
    double kv = w->kv_total ? (double)w->kv_used / (double)w->kv_total : 0.0;
    if (w->dp_size > 1 && w->kv_total) {
        /* data-parallel attention: a new sequence goes to the rank with the
         * most room, so that rank's fill is what one more request meets */
        double part = (double)w->kv_total / w->dp_size;
        kv = 1.0;
        for (uint32_t r = 0; r < w->dp_size; r++)
            kv = fmin(kv, w->dp_used[r] / part);
    }
    return queue + KV_WEIGHT * kv;
}

/* FNV-1a over the token ids, chained from `h`. */
static uint64_t hash_tokens(uint64_t h, const int32_t *ids, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)ids[i];
        for (int b = 0; b < 4; b++) {
            h ^= (v >> (8 * b)) & 0xffu;
            h *= 1099511628211ull;
        }
    }
    return h ? h : 1; /* 0 marks an empty slot */
}

static bool eligible(const struct coord_worker *w, struct coord_worker *const *exclude,
                     size_t n_exclude)
{
    if (coord_worker_state_locked(w) != COORD_WORKER_SERVING)
        return false;
    for (size_t i = 0; i < n_exclude; i++)
        if (exclude[i] == w)
            return false;
    return true;
}

/* Which workers a pick may take. */
struct pick_filter {
    int role;             /* 0: any; else only this Moe__V1__WorkerRole */
    bool no_prefill;      /* skip prefill-role workers */
    uint32_t need_tokens; /* > 0: a handoff target with free blocks for them */
};

static bool fits(const struct coord_worker *w, const struct pick_filter *pf)
{
    if (pf->role && w->role != pf->role)
        return false;
    if (pf->no_prefill && w->role == MOE__V1__WORKER_ROLE__WORKER_ROLE_PREFILL)
        return false;
    if (pf->need_tokens) {
        uint32_t bs = w->block_size ? w->block_size : COORD_DEFAULT_BLOCK;
        uint32_t need = (pf->need_tokens + bs - 1) / bs;
        if (w->kv_total &&
            w->kv_total - (w->kv_used < w->kv_total ? w->kv_used : w->kv_total) < need)
            return false;
    }
    return true;
}

static struct coord_worker *pick(struct coord *c, const int32_t *ids, size_t n_ids,
                                 struct coord_worker *const *exclude, size_t n_exclude,
                                 const struct pick_filter *pf)
{
    uint64_t hashes[COORD_AFFINITY_BLOCKS];
    size_t n_levels = pf->need_tokens ? 0 : n_ids / COORD_DEFAULT_BLOCK;
    if (n_levels > COORD_AFFINITY_BLOCKS)
        n_levels = COORD_AFFINITY_BLOCKS;
    uint64_t h = 1469598103934665603ull;
    for (size_t l = 0; l < n_levels; l++) {
        h = hash_tokens(h, ids + l * COORD_DEFAULT_BLOCK, COORD_DEFAULT_BLOCK);
        hashes[l] = h;
    }

    pthread_mutex_lock(&c->mu);
    struct coord_worker *best = NULL;
    double best_load = 0;
    size_t n = c->n_workers;
    size_t start = n ? (size_t)(c->rr++ % n) : 0;
    for (size_t k = 0; k < n; k++) {
        struct coord_worker *w = c->workers[(start + k) % n];
        if (!eligible(w, exclude, n_exclude) || !fits(w, pf))
            continue;
        double load = coord_worker_load_locked(w);
        if (!best || load < best_load) {
            best = w;
            best_load = load;
        }
    }
    if (best && n_levels) {
        for (size_t l = n_levels; l-- > 0;) {
            struct coord_affinity *slot = &c->affinity[hashes[l] % COORD_AFFINITY_SLOTS];
            if (slot->hash != hashes[l])
                continue;
            struct coord_worker *w = coord_registry_find_locked(c, slot->worker_id);
            if (w && eligible(w, exclude, n_exclude) && fits(w, pf) &&
                coord_worker_load_locked(w) <=
                    best_load + AFFINITY_SLACK_ABS + AFFINITY_SLACK_REL * best_load)
                best = w;
            break; /* the longest known prefix decides */
        }
        for (size_t l = 0; l < n_levels; l++) {
            struct coord_affinity *slot = &c->affinity[hashes[l] % COORD_AFFINITY_SLOTS];
            slot->hash = hashes[l];
            snprintf(slot->worker_id, sizeof slot->worker_id, "%s", best->id);
        }
    }
    if (best) {
        coord_worker_ref_locked(best);
        best->in_flight++;
        best->n_routed++;
    }
    pthread_mutex_unlock(&c->mu);
    return best;
}

struct coord_worker *coord_router_pick_role(struct coord *c, int role, const int32_t *ids,
                                            size_t n_ids, struct coord_worker *const *exclude,
                                            size_t n_exclude, uint32_t need_tokens)
{
    struct pick_filter pf = {.role = role, .no_prefill = role == 0, .need_tokens = need_tokens};
    struct coord_worker *w = pick(c, ids, n_ids, exclude, n_exclude, &pf);
    if (!w && role == 0) {
        pf.no_prefill = false; /* only prefill workers left: they decode too */
        w = pick(c, ids, n_ids, exclude, n_exclude, &pf);
    }
    return w;
}

struct coord_worker *coord_router_pick(struct coord *c, const int32_t *ids, size_t n_ids,
                                       struct coord_worker *const *exclude, size_t n_exclude)
{
    return coord_router_pick_role(c, 0, ids, n_ids, exclude, n_exclude, 0);
}

void coord_router_done(struct coord *c, struct coord_worker *w)
{
    pthread_mutex_lock(&c->mu);
    w->in_flight--;
    coord_worker_unref_locked(w);
    pthread_mutex_unlock(&c->mu);
}
