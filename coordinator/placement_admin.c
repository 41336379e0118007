/* Expert placement in the coordinator: the epoch store, the expert-statistics
 * poller, and the Admin methods GetExpertStats, GetPlacement, PlanPlacement,
 * ApplyPlacement and RollbackPlacement.
 *
 * The store. With --etcd the placement lives at the key
 * /moe/placement/<model> (model = the model directory's last component) as
 *
 *   {"epoch": 4,
 *    "slots_per_rank": 4,
 *    "placement": {"n_rank": 2, "experts": [[0], [0, 1], ...],
 *                  "layers": {"0": [[0], [0, 1], ...], "1": [...], ...}},
 *    "previous": {"epoch": 3, "placement": {...same format...}}}
 *
 * "placement" is exactly a worker placement file (common/placement.h):
 * "experts" repeats layer 0 and "layers" lists every layer explicitly, so
 * moe_placement_load reads it as it is. "previous" is the map a rollback
 * restores. The key changes only by compare-and-swap on its mod revision
 * (moe_etcd_cas), each change writes epoch + 1, and a missing key means
 * epoch 0: the default even split. Workers pick up a new epoch by watching
 * the key (or polling GetPlacement) and report the epoch they run in
 * WorkerLoad.placement_epoch. Without etcd the same record is kept in
 * memory, with the same checks.
 *
 * Statistics. A thread polls Worker/GetLoad of every member once a second,
 * keeps the cumulative WorkerLoad.expert_tokens of the last 64 polls per
 * worker, and answers a window as the difference between the newest poll and
 * the last poll at or before the window's start (or everything counted since
 * the worker started, when the coordinator has watched it for less than the
 * window). Workers are summed: every group of the model shares one placement.
 *
 * Locks: `p->mu` guards the store and the statistics and is held across the
 * (short) etcd calls of the Admin handlers, which it serialises; it is never
 * held across a Worker call, and c->mu is only ever taken inside it, never
 * the other way round. */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coord.h"
#include "etcd.h"
#include "moe/v1/admin.pb-c.h"
#include "moe/v1/worker.pb-c.h"
#include "planner.h"
#include "clock.h"

#define STATS_RING 64
#define STATS_PERIOD_MS 1000
#define STATS_DEFAULT_WINDOW_S 30
#define ETCD_TIMEOUT_MS 3000
#define DEFAULT_KEEP_TOLERANCE 0.05

/* The cumulative counters of one worker over its last STATS_RING polls. */
struct worker_stats {
    char id[COORD_ID_MAX];
    int n_layer, n_expert; /* shape of the counters; 0: none reported yet */
    int n, head;           /* samples held; index of the oldest */
    double t[STATS_RING];
    uint64_t steps[STATS_RING];
    uint64_t *tokens; /* (STATS_RING, n_layer, n_expert) */
    uint64_t epoch;   /* WorkerLoad.placement_epoch */
    bool seen;        /* answered in the current round */
};

struct coord_placement {
    struct coord *c;
    pthread_mutex_t mu;
    struct moe_etcd *etcd; /* NULL: the in-memory store */
    char key[512];

    /* mu: the record as last read or written */
    uint64_t epoch;
    bool has_map; /* false: the default split */
    struct moe_placement map;
    bool has_prev;
    uint64_t prev_epoch;
    struct moe_placement prev;
    int64_t mod_revision; /* of the etcd key; 0: absent */

    /* mu: statistics */
    struct worker_stats *ws; /* (n_ws) */
    size_t n_ws;

    pthread_t thread;
    bool started;
    bool stop; /* mu */
    pthread_cond_t cond;
};

/* ---- small helpers ------------------------------------------------------------------ */

/* Ranks of the worker groups: the largest expert-parallel size any member
 * reported (1 before any report). */
static int group_ranks(struct coord *c)
{
    int n = 0;
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n_workers; i++) {
        const struct coord_worker *w = c->workers[i];
        int v = w->ep_size ? (int)w->ep_size : (int)w->world_size;
        if (v > n)
            n = v;
    }
    pthread_mutex_unlock(&c->mu);
    return n > 0 ? n : 1;
}

/* Experts a rank may hold per layer. */
static int slot_capacity(const struct coord *c, int n_rank)
{
    if (c->opts.expert_slots > 0)
        return c->opts.expert_slots;
    return 2 * ((c->cfg.n_expert + n_rank - 1) / n_rank);
}

/* ---- JSON form of a map ------------------------------------------------------------- */

/* Fills layer l of m from a JSON array of rank lists. */
static enum moe_status layer_from_json(struct moe_placement *m, int l, const cJSON *arr,
                                       struct moe_error *err)
{
    if (!cJSON_IsArray(arr))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "placement: layer %d: must be an array of rank lists", l);
    int n = cJSON_GetArraySize(arr);
    if (n > m->n_expert)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "placement: layer %d: lists %d experts, the model has %d (expert %d "
                             "does not exist)",
                             l, n, m->n_expert, m->n_expert);
    if (n < m->n_expert)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "placement: layer %d: lists %d experts, the model has %d (expert %d "
                             "is missing)",
                             l, n, m->n_expert, n);
    memset(m->n_replicas + (size_t)l * m->n_expert, 0, (size_t)m->n_expert);
    for (int e = 0; e < m->n_expert; e++) {
        const cJSON *ranks = cJSON_GetArrayItem(arr, e);
        if (!cJSON_IsArray(ranks) || cJSON_GetArraySize(ranks) < 1)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "placement: layer %d expert %d: needs a list of 1 to %d ranks", l,
                                 e, MOE_PLACEMENT_MAX_REPLICAS);
        const cJSON *r;
        cJSON_ArrayForEach(r, ranks)
        {
            double v = cJSON_IsNumber(r) ? r->valuedouble : -1;
            if (v != floor(v) || v < -1e6 || v > 1e6)
                v = -1;
            enum moe_status rc = moe_placement_add(m, l, e, (int)v, err);
            if (rc) {
                if (v >= m->n_rank)
                    moe_error_set(err, MOE_ERR_INVALID,
                                  "placement: layer %d expert %d: rank %d does not exist (the "
                                  "worker groups have %d ranks)",
                                  l, e, (int)v, m->n_rank);
                else
                    moe_error_prefix(err, "placement");
                return rc;
            }
        }
    }
    return MOE_OK;
}

/* Parses a map in the worker format for a model of n_layer x n_expert on
 * n_rank ranks (m is allocated here; freed by the caller also on error). */
static enum moe_status map_from_json(const cJSON *o, int n_layer, int n_expert, int n_rank,
                                     struct moe_placement *m, struct moe_error *err)
{
    enum moe_status rc = moe_placement_alloc(n_layer, n_expert, n_rank, m, err);
    if (rc)
        return rc;
    if (!cJSON_IsObject(o))
        return moe_error_set(err, MOE_ERR_INVALID, "placement: not a JSON object");
    const cJSON *nr = cJSON_GetObjectItemCaseSensitive(o, "n_rank");
    if (!cJSON_IsNumber(nr) || nr->valuedouble != n_rank)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "placement: n_rank is %g, the worker groups have %d ranks",
                             cJSON_IsNumber(nr) ? nr->valuedouble : -1.0, n_rank);
    const cJSON *all = cJSON_GetObjectItemCaseSensitive(o, "experts");
    const cJSON *layers = cJSON_GetObjectItemCaseSensitive(o, "layers");
    if (layers && !cJSON_IsObject(layers))
        return moe_error_set(err, MOE_ERR_INVALID, "placement: 'layers' must be an object");
    const cJSON *it;
    cJSON_ArrayForEach(it, layers)
    {
        char *end;
        long l = strtol(it->string, &end, 10);
        if (*end || end == it->string || l < 0 || l >= n_layer)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "placement: layer '%s' does not exist (the model has %d layers)",
                                 it->string, n_layer);
    }
    for (int l = 0; l < n_layer; l++) {
        char k[16];
        snprintf(k, sizeof k, "%d", l);
        const cJSON *arr = layers ? cJSON_GetObjectItemCaseSensitive(layers, k) : NULL;
        if (!arr)
            arr = all;
        if (!arr)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "placement: layer %d: not in 'layers' and no 'experts' default",
                                 l);
        if ((rc = layer_from_json(m, l, arr, err)))
            return rc;
    }
    return MOE_OK;
}

/* ---- the store ----------------------------------------------------------------------- */

static void store_clear_locked(struct coord_placement *p)
{
    moe_placement_free(&p->map);
    moe_placement_free(&p->prev);
    p->has_map = p->has_prev = false;
    p->epoch = p->prev_epoch = 0;
}

/* An integer JSON number in [lo, hi] (so that casting it is defined). */
static bool json_int_in(const cJSON *j, double lo, double hi)
{
    return cJSON_IsNumber(j) && j->valuedouble >= lo && j->valuedouble <= hi &&
           floor(j->valuedouble) == j->valuedouble;
}

#define EPOCH_MAX 9007199254740992.0 /* 2^53: exact in a JSON number */

/* Re-reads the etcd record (no-op in memory). */
static enum moe_status store_load_locked(struct coord_placement *p, struct moe_error *err)
{
    if (!p->etcd)
        return MOE_OK;
    struct coord *c = p->c;
    struct moe_etcd_kv kv;
    enum moe_status rc = moe_etcd_get(p->etcd, p->key, &kv, NULL, err);
    if (rc == MOE_ERR_NOT_FOUND) {
        store_clear_locked(p);
        p->mod_revision = 0;
        return MOE_OK;
    }
    if (rc)
        return rc;
    if (kv.mod_revision == p->mod_revision) {
        moe_etcd_kv_clear(&kv);
        return MOE_OK;
    }
    cJSON *root = cJSON_Parse(kv.value);
    const cJSON *ep = cJSON_GetObjectItemCaseSensitive(root, "epoch");
    const cJSON *pl = cJSON_GetObjectItemCaseSensitive(root, "placement");
    const cJSON *pv = cJSON_GetObjectItemCaseSensitive(root, "previous");
    struct moe_placement m = {0}, prev = {0};
    uint64_t prev_epoch = 0;
    if (!json_int_in(ep, 1, EPOCH_MAX) || !pl) {
        rc = moe_error_set(err, MOE_ERR_FORMAT,
                           "etcd key %s: no integer 'epoch' in [1, 2^53] and 'placement'", p->key);
        goto out;
    }
    const cJSON *nr = cJSON_GetObjectItemCaseSensitive(pl, "n_rank");
    if (!json_int_in(nr, 1, 32767)) {
        rc = moe_error_set(err, MOE_ERR_FORMAT,
                           "etcd key %s: placement: 'n_rank' must be an integer in [1, 32767]",
                           p->key);
        goto out;
    }
    int n_rank = (int)nr->valuedouble;
    if ((rc = map_from_json(pl, c->cfg.n_layer, c->cfg.n_expert, n_rank, &m, err))) {
        moe_error_prefix(err, "etcd key %s", p->key);
        goto out;
    }
    if (pv) {
        const cJSON *pe = cJSON_GetObjectItemCaseSensitive(pv, "epoch");
        const cJSON *pp = cJSON_GetObjectItemCaseSensitive(pv, "placement");
        nr = cJSON_GetObjectItemCaseSensitive(pp, "n_rank");
        n_rank = json_int_in(nr, 1, 32767) ? (int)nr->valuedouble : 0;
        if (!json_int_in(pe, 0, EPOCH_MAX) || !n_rank ||
            (rc = map_from_json(pp, c->cfg.n_layer, c->cfg.n_expert, n_rank, &prev, err))) {
            rc = rc       ? rc
                 : n_rank ? moe_error_set(err, MOE_ERR_FORMAT, "no integer 'epoch' in [0, 2^53]")
                          : moe_error_set(err, MOE_ERR_FORMAT,
                                          "placement: 'n_rank' must be an integer in [1, 32767]");
            moe_error_prefix(err, "etcd key %s: previous", p->key);
            goto out;
        }
        prev_epoch = (uint64_t)pe->valuedouble;
    }
    store_clear_locked(p);
    p->epoch = (uint64_t)ep->valuedouble;
    p->map = m;
    p->has_map = true;
    memset(&m, 0, sizeof m);
    if (pv) {
        p->prev = prev;
        p->has_prev = true;
        p->prev_epoch = prev_epoch;
        memset(&prev, 0, sizeof prev);
    }
    p->mod_revision = kv.mod_revision;
out:
    moe_placement_free(&m);
    moe_placement_free(&prev);
    cJSON_Delete(root);
    moe_etcd_kv_clear(&kv);
    return rc;
}

/* The current map for groups of n_rank ranks (the default split when none is
 * stored, or when the stored one is for another group size). */
static enum moe_status current_map_locked(struct coord_placement *p, int n_rank,
                                          struct moe_placement *out, struct moe_error *err)
{
    if (p->has_map && p->map.n_rank == n_rank)
        return moe_placement_copy(&p->map, out, err);
    return moe_placement_default(p->c->cfg.n_layer, p->c->cfg.n_expert, n_rank, out, err);
}

/* Writes epoch + 1 = `next` with `prev` as the previous map: CAS in etcd,
 * plain assignment in memory. Takes ownership of nothing; copies both. A
 * lost race is MOE_ERR_AGAIN. */
static enum moe_status store_write_locked(struct coord_placement *p,
                                          const struct moe_placement *next,
                                          const struct moe_placement *prev, struct moe_error *err)
{
    struct coord *c = p->c;
    enum moe_status rc = MOE_OK;
    struct moe_placement a = {0}, b = {0};
    char *text = NULL;
    cJSON *root = NULL;
    uint64_t epoch = p->epoch + 1;
    if ((rc = moe_placement_copy(next, &a, err)) || (rc = moe_placement_copy(prev, &b, err)))
        goto out;
    if (p->etcd) {
        root = cJSON_CreateObject();
        cJSON *pv = cJSON_CreateObject();
        cJSON *jn = moe_placement_to_json(next), *jp = moe_placement_to_json(prev);
        if (!root || !pv || !jn || !jp) {
            cJSON_Delete(pv);
            cJSON_Delete(jn);
            cJSON_Delete(jp);
            rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
            goto out;
        }
        cJSON_AddNumberToObject(root, "epoch", (double)epoch);
        cJSON_AddNumberToObject(root, "slots_per_rank", slot_capacity(c, next->n_rank));
        cJSON_AddItemToObject(root, "placement", jn);
        cJSON_AddNumberToObject(pv, "epoch", (double)p->epoch);
        cJSON_AddItemToObject(pv, "placement", jp);
        cJSON_AddItemToObject(root, "previous", pv);
        text = cJSON_PrintUnformatted(root);
        if (!text) {
            rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
            goto out;
        }
        int ok = 0;
        int64_t rev = 0;
        if ((rc = moe_etcd_cas(p->etcd, p->key, p->mod_revision, text, strlen(text), 0, &ok, &rev,
                               err)))
            goto out;
        if (!ok) {
            p->mod_revision = -1; /* force a re-read */
            rc = moe_error_set(err, MOE_ERR_AGAIN,
                               "the placement changed while this call ran (another apply won the "
                               "compare-and-swap on %s): read it again and replan",
                               p->key);
            goto out;
        }
        p->mod_revision = rev;
    }
    store_clear_locked(p);
    p->epoch = epoch;
    p->map = a;
    p->has_map = true;
    p->prev = b;
    p->has_prev = true;
    p->prev_epoch = epoch - 1;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    fprintf(stderr, "moe-coordinator: placement epoch %" PRIu64 " installed (%s)\n", epoch,
            p->etcd ? p->key : "in memory");
out:
    moe_placement_free(&a);
    moe_placement_free(&b);
    free(text);
    cJSON_Delete(root);
    return rc;
}

/* ---- statistics ---------------------------------------------------------------------- */

static struct worker_stats *stats_find_locked(struct coord_placement *p, const char *id)
{
    for (size_t i = 0; i < p->n_ws; i++)
        if (!strcmp(p->ws[i].id, id))
            return &p->ws[i];
    struct worker_stats *grown = realloc(p->ws, (p->n_ws + 1) * sizeof *grown);
    if (!grown)
        return NULL;
    p->ws = grown;
    struct worker_stats *s = &p->ws[p->n_ws++];
    memset(s, 0, sizeof *s);
    snprintf(s->id, sizeof s->id, "%s", id);
    return s;
}

/* Records one poll of a worker's counters. */
static void stats_record_locked(struct coord_placement *p, const char *id,
                                const Moe__V1__WorkerLoad *load, double now)
{
    struct worker_stats *s = stats_find_locked(p, id);
    if (!s)
        return;
    s->seen = true;
    s->epoch = load->placement_epoch;
    size_t n = (size_t)load->stats_layers * load->stats_experts;
    if (!n || n != load->n_expert_tokens || n > ((size_t)1 << 24))
        return;
    if ((int)load->stats_layers != s->n_layer || (int)load->stats_experts != s->n_expert) {
        free(s->tokens);
        s->tokens = calloc(STATS_RING * n, sizeof *s->tokens);
        s->n_layer = s->tokens ? (int)load->stats_layers : 0;
        s->n_expert = s->tokens ? (int)load->stats_experts : 0;
        s->n = s->head = 0;
        if (!s->tokens)
            return;
    }
    if (s->n) { /* counts going down: the worker restarted */
        int last = (s->head + s->n - 1) % STATS_RING;
        bool down = load->stats_steps < s->steps[last];
        for (size_t i = 0; i < n && !down; i++)
            down = load->expert_tokens[i] < s->tokens[(size_t)last * n + i];
        if (down)
            s->n = s->head = 0;
    }
    int slot;
    if (s->n < STATS_RING) {
        slot = (s->head + s->n++) % STATS_RING;
    } else {
        slot = s->head;
        s->head = (s->head + 1) % STATS_RING;
    }
    s->t[slot] = now;
    s->steps[slot] = load->stats_steps;
    if (n && load->expert_tokens)
        memcpy(s->tokens + (size_t)slot * n, load->expert_tokens, n * sizeof *s->tokens);
}

/* Sums the window of every worker into tokens (n_layer, n_expert), zeroed
 * here. Returns the number of workers with statistics. */
static int stats_window_locked(struct coord_placement *p, double window_s, int n_layer,
                               int n_expert, uint64_t *tokens, uint64_t *steps, double *covered)
{
    size_t n = (size_t)n_layer * n_expert;
    memset(tokens, 0, n * sizeof *tokens);
    *steps = 0;
    *covered = 0;
    double now = moe_now();
    int reporting = 0;
    for (size_t w = 0; w < p->n_ws; w++) {
        const struct worker_stats *s = &p->ws[w];
        if (!s->n || s->n_layer != n_layer || s->n_expert != n_expert)
            continue;
        int last = (s->head + s->n - 1) % STATS_RING;
        int base = -1; /* newest sample at or before the window's start */
        for (int k = 0; k < s->n; k++) {
            int i = (s->head + k) % STATS_RING;
            if (s->t[i] <= now - window_s)
                base = i;
        }
        const uint64_t *hi = s->tokens + (size_t)last * n;
        const uint64_t *lo = base >= 0 ? s->tokens + (size_t)base * n : NULL;
        for (size_t i = 0; i < n; i++)
            tokens[i] += hi[i] - (lo ? lo[i] : 0);
        *steps += s->steps[last] - (base >= 0 ? s->steps[base] : 0);
        double cov = base >= 0 ? s->t[last] - s->t[base] : s->t[last] - s->t[s->head];
        if (cov > *covered)
            *covered = cov;
        reporting++;
    }
    return reporting;
}

static void *stats_main(void *arg)
{
    struct coord_placement *p = arg;
    struct coord *c = p->c;
    Moe__V1__GetLoadRequest rq = MOE__V1__GET_LOAD_REQUEST__INIT;
    size_t rq_len = moe__v1__get_load_request__get_packed_size(&rq);
    uint8_t rq_buf[16];
    moe__v1__get_load_request__pack(&rq, rq_buf);
    for (;;) {
        pthread_mutex_lock(&p->mu);
        if (p->stop) {
            pthread_mutex_unlock(&p->mu);
            break;
        }
        for (size_t i = 0; i < p->n_ws; i++)
            p->ws[i].seen = false;
        pthread_mutex_unlock(&p->mu);

        pthread_mutex_lock(&c->mu);
        size_t nw = c->n_workers;
        struct coord_worker **ws = calloc(nw ? nw : 1, sizeof *ws);
        for (size_t i = 0; ws && i < nw; i++) {
            ws[i] = c->workers[i];
            coord_worker_ref_locked(ws[i]);
        }
        pthread_mutex_unlock(&c->mu);
        for (size_t i = 0; ws && i < nw; i++) {
            struct rpc_reply reply;
            rpc_client_call(ws[i]->client, "/moe.v1.Worker/GetLoad", rq_buf, rq_len, 1000, &reply);
            Moe__V1__WorkerLoad *load =
                reply.code == RPC_OK ? moe__v1__worker_load__unpack(NULL, reply.len, reply.data)
                                     : NULL;
            if (load) {
                pthread_mutex_lock(&p->mu);
                stats_record_locked(p, ws[i]->id, load, moe_now());
                pthread_mutex_unlock(&p->mu);
                moe__v1__worker_load__free_unpacked(load, NULL);
            }
            rpc_reply_clear(&reply);
        }
        pthread_mutex_lock(&c->mu);
        for (size_t i = 0; ws && i < nw; i++)
            coord_worker_unref_locked(ws[i]);
        pthread_mutex_unlock(&c->mu);
        free(ws);

        pthread_mutex_lock(&p->mu);
        /* forget workers that left (or stopped answering) */
        for (size_t i = 0; i < p->n_ws;) {
            if (!p->ws[i].seen) {
                free(p->ws[i].tokens);
                p->ws[i] = p->ws[--p->n_ws];
            } else {
                i++;
            }
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += STATS_PERIOD_MS / 1000;
        ts.tv_nsec += (long)(STATS_PERIOD_MS % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        if (!p->stop)
            pthread_cond_timedwait(&p->cond, &p->mu, &ts);
        pthread_mutex_unlock(&p->mu);
    }
    return NULL;
}

/* ---- handlers ------------------------------------------------------------------------- */

/* Answers a failed call; `rc` from a store/plan function with err filled. */
static void finish_err(struct rpc_call *call, enum moe_status rc, const struct moe_error *err)
{
    rpc_call_finish(call, rpc_code_from_status(rc), err->msg, NULL, 0);
}

/* Checks that the model has experts; answers the call if not. */
static bool need_experts(struct coord *c, struct rpc_call *call)
{
    if (c->cfg.n_expert > 0 && c->cfg.n_layer > 0)
        return true;
    rpc_call_finish(call, RPC_FAILED_PRECONDITION, "the model has no experts", NULL, 0);
    return false;
}

static void handle_stats(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    struct coord *c = user;
    struct coord_placement *p = c->placement;
    if (!need_experts(c, call))
        return;
    Moe__V1__GetExpertStatsRequest *rq =
        rpc_call_unpack(call, &moe__v1__get_expert_stats_request__descriptor, req, len);
    if (!rq)
        return;
    double window = rq->window_s ? rq->window_s : STATS_DEFAULT_WINDOW_S;
    moe__v1__get_expert_stats_request__free_unpacked(rq, NULL);
    size_t n = (size_t)c->cfg.n_layer * c->cfg.n_expert;
    uint64_t *tokens = calloc(n, sizeof *tokens);
    if (!tokens) {
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory", NULL, 0);
        return;
    }
    Moe__V1__ExpertStats resp = MOE__V1__EXPERT_STATS__INIT;
    pthread_mutex_lock(&p->mu);
    resp.workers_reporting = (uint32_t)stats_window_locked(
        p, window, c->cfg.n_layer, c->cfg.n_expert, tokens, &resp.steps, &resp.window_s);
    resp.workers_total = (uint32_t)p->n_ws;
    pthread_mutex_unlock(&p->mu);
    resp.n_layer = (uint32_t)c->cfg.n_layer;
    resp.n_expert = (uint32_t)c->cfg.n_expert;
    resp.n_tokens = n;
    resp.tokens = tokens;
    rpc_call_finish_msg(call, &resp);
    free(tokens);
}

/* Fills a PlacementInfo from the store; strings and arrays are malloc'd
 * into *json and *we (freed by the caller). Caller holds p->mu. */
static enum moe_status info_fill_locked(struct coord_placement *p, Moe__V1__PlacementInfo *info,
                                        char **json, Moe__V1__WorkerEpoch **we,
                                        Moe__V1__WorkerEpoch ***wp, struct moe_error *err)
{
    struct coord *c = p->c;
    int n_rank = p->has_map ? p->map.n_rank : group_ranks(c);
    struct moe_placement m;
    enum moe_status rc = current_map_locked(p, n_rank, &m, err);
    if (rc)
        return rc;
    *json = moe_placement_to_string(&m);
    *we = calloc(p->n_ws + 1, sizeof **we);
    *wp = calloc(p->n_ws + 1, sizeof **wp);
    if (!*json || !*we || !*wp) {
        moe_placement_free(&m);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    info->epoch = p->epoch;
    info->placement_json = *json;
    info->n_layer = (uint32_t)m.n_layer;
    info->n_expert = (uint32_t)m.n_expert;
    info->n_rank = (uint32_t)m.n_rank;
    info->slots_per_rank = (uint32_t)slot_capacity(c, m.n_rank);
    info->n_redundant = (uint32_t)moe_placement_n_redundant(&m);
    info->has_previous = p->has_prev;
    info->previous_epoch = p->prev_epoch;
    info->store = p->etcd ? p->key : "memory";
    for (size_t i = 0; i < p->n_ws; i++) {
        moe__v1__worker_epoch__init(&(*we)[i]);
        (*we)[i].id = p->ws[i].id;
        (*we)[i].epoch = p->ws[i].epoch;
        (*wp)[i] = &(*we)[i];
    }
    info->n_workers = p->n_ws;
    info->workers = *wp;
    moe_placement_free(&m);
    return MOE_OK;
}

/* Answers with the store's PlacementInfo; caller holds p->mu (released here). */
static void finish_info_unlock(struct coord_placement *p, struct rpc_call *call)
{
    struct moe_error err = {0};
    Moe__V1__PlacementInfo info = MOE__V1__PLACEMENT_INFO__INIT;
    char *json = NULL;
    Moe__V1__WorkerEpoch *we = NULL, **wp = NULL;
    enum moe_status rc = info_fill_locked(p, &info, &json, &we, &wp, &err);
    if (rc) {
        pthread_mutex_unlock(&p->mu);
        finish_err(call, rc, &err);
    } else {
        size_t len;
        void *out = rpc_pack(&info, &len); /* packs strings owned by p: under the lock */
        pthread_mutex_unlock(&p->mu);
        rpc_call_finish(call, out ? RPC_OK : RPC_RESOURCE_EXHAUSTED, out ? NULL : "out of memory",
                        out, len);
        free(out);
    }
    free(json);
    free(we);
    free(wp);
}

static void handle_get(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    struct coord *c = user;
    struct coord_placement *p = c->placement;
    if (!need_experts(c, call))
        return;
    struct moe_error err = {0};
    pthread_mutex_lock(&p->mu);
    enum moe_status rc = store_load_locked(p, &err);
    if (rc) {
        pthread_mutex_unlock(&p->mu);
        finish_err(call, rc, &err);
        return;
    }
    finish_info_unlock(p, call);
}

/* Current stats as doubles (n_layer, n_expert); returns total tokens. */
static uint64_t stats_load_locked(struct coord_placement *p, double window, double *load)
{
    struct coord *c = p->c;
    size_t n = (size_t)c->cfg.n_layer * c->cfg.n_expert;
    uint64_t *tok = calloc(n, sizeof *tok);
    uint64_t steps, total = 0;
    double cov;
    if (!tok) {
        memset(load, 0, n * sizeof *load);
        return 0;
    }
    stats_window_locked(p, window, c->cfg.n_layer, c->cfg.n_expert, tok, &steps, &cov);
    for (size_t i = 0; i < n; i++) {
        load[i] = (double)tok[i];
        total += tok[i];
    }
    free(tok);
    return total;
}

static void handle_plan(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    struct coord *c = user;
    struct coord_placement *p = c->placement;
    if (!need_experts(c, call))
        return;
    Moe__V1__PlanPlacementRequest *rq =
        rpc_call_unpack(call, &moe__v1__plan_placement_request__descriptor, req, len);
    if (!rq)
        return;
    struct moe_error err = {0};
    struct moe_placement cur = {0};
    struct planner_result res = {0};
    Moe__V1__PlacementPlan plan = MOE__V1__PLACEMENT_PLAN__INIT;
    Moe__V1__PlacementChange *ch = NULL, **chp = NULL;
    uint32_t *rank_buf = NULL;
    double *sums = NULL;
    char *json = NULL;
    int L = c->cfg.n_layer, E = c->cfg.n_expert;
    double *load = calloc((size_t)L * E, sizeof *load);
    enum moe_status rc = MOE_OK;
    if (!load) {
        rc = moe_error_set(&err, MOE_ERR_NOMEM, "out of memory");
        goto done;
    }
    int n_rank = group_ranks(c);
    pthread_mutex_lock(&p->mu);
    rc = store_load_locked(p, &err);
    if (!rc)
        rc = current_map_locked(p, n_rank, &cur, &err);
    plan.base_epoch = p->epoch;
    plan.stats_tokens =
        stats_load_locked(p, rq->window_s ? rq->window_s : STATS_DEFAULT_WINDOW_S, load);
    pthread_mutex_unlock(&p->mu);
    if (rc)
        goto done;
    struct planner_params pp = {
        .n_redundant = rq->set_redundant ? (int)rq->redundant : moe_placement_n_redundant(&cur),
        .slots_per_rank = slot_capacity(c, n_rank),
        .keep_tolerance = rq->set_keep_tolerance ? rq->keep_tolerance : DEFAULT_KEEP_TOLERANCE,
    };
    if (rq->set_redundant && rq->redundant > (1u << 24)) {
        rc = moe_error_set(&err, MOE_ERR_INVALID, "redundant %u: too many replicas", rq->redundant);
        goto done;
    }
    if ((rc = planner_plan(&pp, &cur, load, &res, &err))) {
        if (rc == MOE_ERR_INVALID)
            moe_error_prefix(&err, "the plan does not fit (--expert-slots %d on %d ranks)",
                             pp.slots_per_rank, n_rank);
        goto done;
    }
    /* the diff */
    size_t n_ch = 0;
    for (int l = 0; l < L; l++)
        for (int e = 0; e < E; e++) {
            int a = moe_placement_n_replicas(&cur, l, e),
                b = moe_placement_n_replicas(&res.map, l, e);
            bool same = a == b;
            for (int i = 0; i < a && same; i++)
                same = moe_placement_rank(&cur, l, e, i) == moe_placement_rank(&res.map, l, e, i);
            n_ch += !same;
        }
    ch = calloc(n_ch + 1, sizeof *ch);
    chp = calloc(n_ch + 1, sizeof *chp);
    rank_buf = calloc((n_ch + 1) * 2 * MOE_PLACEMENT_MAX_REPLICAS, sizeof *rank_buf);
    sums = calloc(2 * (size_t)n_rank, sizeof *sums);
    json = moe_placement_to_string(&res.map);
    if (!ch || !chp || !rank_buf || !sums || !json) {
        rc = moe_error_set(&err, MOE_ERR_NOMEM, "out of memory");
        goto done;
    }
    size_t k = 0;
    for (int l = 0; l < L; l++)
        for (int e = 0; e < E; e++) {
            int a = moe_placement_n_replicas(&cur, l, e),
                b = moe_placement_n_replicas(&res.map, l, e);
            bool same = a == b;
            for (int i = 0; i < a && same; i++)
                same = moe_placement_rank(&cur, l, e, i) == moe_placement_rank(&res.map, l, e, i);
            if (same)
                continue;
            Moe__V1__PlacementChange *x = &ch[k];
            moe__v1__placement_change__init(x);
            x->layer = (uint32_t)l;
            x->expert = (uint32_t)e;
            x->ranks_before = rank_buf + k * 2 * MOE_PLACEMENT_MAX_REPLICAS;
            x->ranks_after = x->ranks_before + MOE_PLACEMENT_MAX_REPLICAS;
            x->n_ranks_before = (size_t)a;
            x->n_ranks_after = (size_t)b;
            for (int i = 0; i < a; i++)
                x->ranks_before[i] = (uint32_t)moe_placement_rank(&cur, l, e, i);
            for (int i = 0; i < b; i++)
                x->ranks_after[i] = (uint32_t)moe_placement_rank(&res.map, l, e, i);
            chp[k] = x;
            k++;
        }
    for (int l = 0; l < L; l++)
        for (int r = 0; r < n_rank; r++) {
            sums[r] += res.load_before[(size_t)l * n_rank + r];
            sums[n_rank + r] += res.load_after[(size_t)l * n_rank + r];
        }
    plan.placement_json = json;
    plan.imbalance_before = res.imbalance_before;
    plan.imbalance_after = res.imbalance_after;
    plan.moves = (uint32_t)res.n_moves;
    plan.removed = (uint32_t)res.n_removed;
    plan.layers_changed = (uint32_t)res.n_layers_changed;
    plan.redundant = (uint32_t)res.n_redundant;
    plan.slots_per_rank = (uint32_t)res.slots_per_rank;
    plan.n_changes = n_ch;
    plan.changes = chp;
    plan.n_rank_load_before = (size_t)n_rank;
    plan.rank_load_before = sums;
    plan.n_rank_load_after = (size_t)n_rank;
    plan.rank_load_after = sums + n_rank;
    plan.n_layer = (uint32_t)L;
    plan.n_expert = (uint32_t)E;
    plan.n_rank = (uint32_t)n_rank;
done:
    if (rc)
        finish_err(call, rc, &err);
    else
        rpc_call_finish_msg(call, &plan);
    moe__v1__plan_placement_request__free_unpacked(rq, NULL);
    moe_placement_free(&cur);
    planner_result_free(&res);
    free(ch);
    free(chp);
    free(rank_buf);
    free(sums);
    free(json);
    free(load);
}

static void handle_apply(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    struct coord *c = user;
    struct coord_placement *p = c->placement;
    if (!need_experts(c, call))
        return;
    Moe__V1__ApplyPlacementRequest *rq =
        rpc_call_unpack(call, &moe__v1__apply_placement_request__descriptor, req, len);
    if (!rq)
        return;
    struct moe_error err = {0};
    struct moe_placement next = {0}, cur = {0};
    int n_rank = group_ranks(c);
    cJSON *root = cJSON_Parse(rq->placement_json);
    const cJSON *obj = root;
    if (cJSON_IsObject(root) && cJSON_GetObjectItemCaseSensitive(root, "placement"))
        obj = cJSON_GetObjectItemCaseSensitive(root, "placement");
    enum moe_status rc =
        root ? MOE_OK : moe_error_set(&err, MOE_ERR_INVALID, "placement_json: not valid JSON");
    if (!rc)
        rc = map_from_json(obj, c->cfg.n_layer, c->cfg.n_expert, n_rank, &next, &err);
    if (!rc && (rc = moe_placement_check(&next, slot_capacity(c, n_rank), &err)))
        moe_error_prefix(&err, "placement (--expert-slots %d)", slot_capacity(c, n_rank));
    if (rc) {
        finish_err(call, rc, &err);
        goto out;
    }
    pthread_mutex_lock(&p->mu);
    rc = store_load_locked(p, &err);
    if (!rc && rq->base_epoch != p->epoch) {
        char msg[160];
        snprintf(msg, sizeof msg,
                 "plan built on epoch %" PRIu64 ", current epoch is %" PRIu64 ": plan again",
                 rq->base_epoch, p->epoch);
        pthread_mutex_unlock(&p->mu);
        rpc_call_finish(call, RPC_FAILED_PRECONDITION, msg, NULL, 0);
        goto out;
    }
    if (!rc)
        rc = current_map_locked(p, n_rank, &cur, &err);
    if (!rc)
        rc = store_write_locked(p, &next, &cur, &err);
    if (rc) {
        pthread_mutex_unlock(&p->mu);
        finish_err(call, rc, &err);
        goto out;
    }
    finish_info_unlock(p, call);
out:
    cJSON_Delete(root);
    moe_placement_free(&next);
    moe_placement_free(&cur);
    moe__v1__apply_placement_request__free_unpacked(rq, NULL);
}

static void handle_rollback(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    struct coord *c = user;
    struct coord_placement *p = c->placement;
    if (!need_experts(c, call))
        return;
    struct moe_error err = {0};
    struct moe_placement cur = {0}, back = {0};
    pthread_mutex_lock(&p->mu);
    enum moe_status rc = store_load_locked(p, &err);
    if (!rc && !p->has_prev) {
        pthread_mutex_unlock(&p->mu);
        rpc_call_finish(call, RPC_FAILED_PRECONDITION,
                        "no previous placement to roll back to (epoch 0: the default split)", NULL,
                        0);
        return;
    }
    if (!rc)
        rc = moe_placement_copy(&p->prev, &back, &err);
    if (!rc)
        rc = moe_placement_copy(&p->map, &cur, &err);
    if (!rc)
        rc = store_write_locked(p, &back, &cur, &err);
    if (rc) {
        pthread_mutex_unlock(&p->mu);
        finish_err(call, rc, &err);
    } else {
        finish_info_unlock(p, call);
    }
    moe_placement_free(&cur);
    moe_placement_free(&back);
}

/* ---- life cycle ------------------------------------------------------------------------ */

uint64_t coord_placement_epoch(struct coord *c)
{
    struct coord_placement *p = c->placement;
    if (!p)
        return 0;
    pthread_mutex_lock(&p->mu);
    uint64_t e = p->epoch;
    pthread_mutex_unlock(&p->mu);
    return e;
}

enum moe_status coord_placement_start(struct coord *c, struct moe_error *err)
{
    struct coord_placement *p = calloc(1, sizeof *p);
    if (!p)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    p->c = c;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cond, NULL);
    c->placement = p;
    snprintf(p->key, sizeof p->key, "/moe/placement/%s", c->model_name);
    enum moe_status rc;
    if (c->opts.etcd) {
        if ((rc = moe_etcd_create(c->opts.etcd, ETCD_TIMEOUT_MS, &p->etcd, err)))
            return rc;
        struct moe_error e2 = {0};
        pthread_mutex_lock(&p->mu);
        if (c->cfg.n_expert > 0 && store_load_locked(p, &e2))
            fprintf(stderr, "moe-coordinator: placement: %s (read again on the next call)\n",
                    e2.msg);
        pthread_mutex_unlock(&p->mu);
    }
    if ((rc = rpc_server_add_unary(c->server, "/moe.v1.Admin/GetExpertStats", handle_stats, c,
                                   err)) ||
        (rc = rpc_server_add_unary(c->server, "/moe.v1.Admin/GetPlacement", handle_get, c, err)) ||
        (rc =
             rpc_server_add_unary(c->server, "/moe.v1.Admin/PlanPlacement", handle_plan, c, err)) ||
        (rc = rpc_server_add_unary(c->server, "/moe.v1.Admin/ApplyPlacement", handle_apply, c,
                                   err)) ||
        (rc = rpc_server_add_unary(c->server, "/moe.v1.Admin/RollbackPlacement", handle_rollback, c,
                                   err)))
        return rc;
    if (pthread_create(&p->thread, NULL, stats_main, p))
        return moe_error_set(err, MOE_ERR_INTERNAL, "cannot start the expert statistics thread");
    p->started = true;
    return MOE_OK;
}

void coord_placement_stop(struct coord *c)
{
    struct coord_placement *p = c->placement;
    if (!p)
        return;
    if (p->started) {
        pthread_mutex_lock(&p->mu);
        p->stop = true;
        pthread_cond_broadcast(&p->cond);
        pthread_mutex_unlock(&p->mu);
        pthread_join(p->thread, NULL);
    }
    store_clear_locked(p);
    for (size_t i = 0; i < p->n_ws; i++)
        free(p->ws[i].tokens);
    free(p->ws);
    moe_etcd_destroy(p->etcd);
    pthread_cond_destroy(&p->cond);
    pthread_mutex_destroy(&p->mu);
    free(p);
    c->placement = NULL;
}
