/* The moe.v1.Admin service: cluster status, the worker list, drain and
 * undrain (the coordinator stops / resumes routing new requests to a worker;
 * its running requests go on). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "moe/v1/admin.pb-c.h"
#include "request_check.h"
#include "clock.h"

/* A snapshot of every member, sorted by id. Strings point into `ids` and
 * `addrs`, owned by the snapshot. */
struct status_snap {
    uint32_t (*dp)[2][COORD_MAX_DP]; /* per worker: dp_kv_blocks_used, dp_running */
    Moe__V1__WorkerStatus *ws;       /* (n) */
    Moe__V1__WorkerStatus **ptr;     /* (n) */
    char (*ids)[COORD_ID_MAX];
    char (*addrs)[COORD_ADDR_MAX];
    size_t n;
};

static void snap_free(struct status_snap *s)
{
    free(s->ws);
    free(s->dp);
    free(s->ptr);
    free(s->ids);
    free(s->addrs);
}

static int cmp_status(const void *a, const void *b)
{
    const Moe__V1__WorkerStatus *x = *(Moe__V1__WorkerStatus *const *)a;
    const Moe__V1__WorkerStatus *y = *(Moe__V1__WorkerStatus *const *)b;
    return strcmp(x->id, y->id);
}

/* Fills the snapshot; caller holds c->mu. Returns false on no memory. */
static bool snap_fill_locked(struct coord *c, struct status_snap *s)
{
    size_t n = c->n_workers;
    memset(s, 0, sizeof *s);
    size_t m = n ? n : 1;
    s->ws = calloc(m, sizeof *s->ws);
    s->ptr = calloc(m, sizeof *s->ptr);
    s->ids = calloc(m, sizeof *s->ids);
    s->addrs = calloc(m, sizeof *s->addrs);
    s->dp = calloc(m, sizeof *s->dp);
    if (!s->ws || !s->ptr || !s->ids || !s->addrs || !s->dp) {
        snap_free(s);
        return false;
    }
    double now = moe_now();
    for (size_t i = 0; i < n; i++) {
        const struct coord_worker *w = c->workers[i];
        Moe__V1__WorkerStatus *st = &s->ws[i];
        moe__v1__worker_status__init(st);
        snprintf(s->ids[i], COORD_ID_MAX, "%s", w->id);
        snprintf(s->addrs[i], COORD_ADDR_MAX, "%s", w->address);
        st->id = s->ids[i];
        st->address = s->addrs[i];
        st->role = w->role;
        st->state = (Moe__V1__WorkerState)coord_worker_state_locked(w);
        st->running = w->running;
        st->waiting = w->waiting;
        st->kv_blocks_used = w->kv_used;
        st->kv_blocks_total = w->kv_total;
        st->prefix_hit_rate =
            w->prefix_lookup ? (double)w->prefix_hit / (double)w->prefix_lookup : 0.0;
        st->last_seen_ms_ago =
            w->last_seen > 0 ? (uint64_t)(1e3 * (now - w->last_seen)) : UINT64_MAX;
        st->world_size = w->world_size;
        st->tp_size = w->tp_size;
        st->ep_size = w->ep_size;
        if (w->dp_size > 1) {
            memcpy(s->dp[i][0], w->dp_used, w->dp_size * sizeof(uint32_t));
            memcpy(s->dp[i][1], w->dp_running, w->dp_size * sizeof(uint32_t));
            st->dp_size = w->dp_size;
            st->n_dp_kv_blocks_used = st->n_dp_running = w->dp_size;
            st->dp_kv_blocks_used = s->dp[i][0];
            st->dp_running = s->dp[i][1];
        }
        st->kv_transfers_out = w->kv_out;
        st->kv_transfers_in = w->kv_in;
        st->kv_transfer_bytes = w->kv_bytes;
        st->kv_transfer_failures = w->kv_failures;
        st->spec_draft_tokens = w->spec_draft;
        st->spec_accepted_tokens = w->spec_accepted;
        s->ptr[i] = st;
    }
    s->n = n;
    qsort(s->ptr, n, sizeof *s->ptr, cmp_status);
    return true;
}

static void handle_cluster_status(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    struct coord *c = user;
    struct status_snap s;
    Moe__V1__ClusterStatusResponse resp = MOE__V1__CLUSTER_STATUS_RESPONSE__INIT;
    pthread_mutex_lock(&c->mu);
    bool ok = snap_fill_locked(c, &s);
    resp.requests_running = (uint32_t)c->n_running;
    resp.requests_total = c->n_total;
    resp.requests_failed = c->n_failed;
    pthread_mutex_unlock(&c->mu);
    if (!ok) {
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory", NULL, 0);
        return;
    }
    resp.n_workers = s.n;
    resp.workers = s.ptr;
    resp.model = c->model_name;
    resp.uptime_s = moe_now() - c->t_start;
    resp.placement_epoch = coord_placement_epoch(c);
    rpc_call_finish_msg(call, &resp);
    snap_free(&s);
}

static void handle_list_workers(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    struct coord *c = user;
    struct status_snap s;
    pthread_mutex_lock(&c->mu);
    bool ok = snap_fill_locked(c, &s);
    pthread_mutex_unlock(&c->mu);
    if (!ok) {
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory", NULL, 0);
        return;
    }
    Moe__V1__ListWorkersResponse resp = MOE__V1__LIST_WORKERS_RESPONSE__INIT;
    resp.n_workers = s.n;
    resp.workers = s.ptr;
    rpc_call_finish_msg(call, &resp);
    snap_free(&s);
}

/* Drain (drain = true) or undrain a worker by id. */
static void set_drained(struct coord *c, struct rpc_call *call, const char *id, bool drain,
                        Moe__V1__WorkerState *state)
{
    pthread_mutex_lock(&c->mu);
    struct coord_worker *w = coord_registry_find_locked(c, id);
    if (w) {
        w->admin_drained = drain;
        *state = (Moe__V1__WorkerState)coord_worker_state_locked(w);
    }
    pthread_mutex_unlock(&c->mu);
    if (!w) {
        char msg[COORD_ID_MAX + 64];
        snprintf(msg, sizeof msg, "id: no worker '%.*s'", COORD_ID_MAX, id);
        rpc_call_finish(call, RPC_NOT_FOUND, msg, NULL, 0);
        return;
    }
    fprintf(stderr, "moe-coordinator: worker %s %s by Admin\n", id,
            drain ? "drained" : "undrained");
}

static void handle_drain(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    Moe__V1__DrainWorkerRequest *rq =
        rpc_call_unpack(call, &moe__v1__drain_worker_request__descriptor, req, len);
    if (!rq)
        return;
    Moe__V1__DrainWorkerResponse resp = MOE__V1__DRAIN_WORKER_RESPONSE__INIT;
    resp.state = 0;
    set_drained(user, call, rq->id, true, &resp.state);
    if (resp.state)
        rpc_call_finish_msg(call, &resp);
    moe__v1__drain_worker_request__free_unpacked(rq, NULL);
}

static void handle_undrain(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    Moe__V1__UndrainWorkerRequest *rq =
        rpc_call_unpack(call, &moe__v1__undrain_worker_request__descriptor, req, len);
    if (!rq)
        return;
    Moe__V1__UndrainWorkerResponse resp = MOE__V1__UNDRAIN_WORKER_RESPONSE__INIT;
    resp.state = 0;
    set_drained(user, call, rq->id, false, &resp.state);
    if (resp.state)
        rpc_call_finish_msg(call, &resp);
    moe__v1__undrain_worker_request__free_unpacked(rq, NULL);
}

enum moe_status coord_admin_register(struct coord *c, struct moe_error *err)
{
    enum moe_status rc;
    if ((rc = rpc_server_add_unary(c->server, "/moe.v1.Admin/ClusterStatus", handle_cluster_status,
                                   c, err)) ||
        (rc = rpc_server_add_unary(c->server, "/moe.v1.Admin/ListWorkers", handle_list_workers, c,
                                   err)) ||
        (rc = rpc_server_add_unary(c->server, "/moe.v1.Admin/DrainWorker", handle_drain, c, err)) ||
        (rc = rpc_server_add_unary(c->server, "/moe.v1.Admin/UndrainWorker", handle_undrain, c,
                                   err)))
        return rc;
    return MOE_OK;
}
