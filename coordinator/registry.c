/* The cluster view: the set of workers (a static --workers list, or the
 * /moe/workers/ prefix of etcd kept current by a watch) and their load,
 * refreshed by a polling thread that calls Worker/GetLoad on each member.
 *
 * States: a worker whose GetLoad fails (or whose Generate failed with
 * UNAVAILABLE) is DOWN until a poll answers again; a worker that reports
 * draining (SIGTERM) or was drained by Admin is DRAINING; else SERVING. */
#include <cjson/cJSON.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coord.h"
#include "hostport.h"
#include "etcd.h"
#include "moe/v1/admin.pb-c.h"
#include "moe/v1/worker.pb-c.h"
#include "clock.h"

#define WORKERS_PREFIX "/moe/workers/"
#define POLL_TIMEOUT_MS 1000

/* ---- workers ------------------------------------------------------------------- */

static void worker_free(struct coord_worker *w)
{
    if (!w)
        return;
    rpc_client_destroy(w->client);
    free(w);
}

void coord_worker_ref_locked(struct coord_worker *w)
{
    w->refs++;
}

void coord_worker_unref_locked(struct coord_worker *w)
{
    MOE_ASSERT(w->refs > 0);
    if (--w->refs == 0)
        worker_free(w);
}

enum coord_worker_state coord_worker_state_locked(const struct coord_worker *w)
{
    if (w->down)
        return COORD_WORKER_DOWN;
    if (w->admin_drained || w->reported_draining)
        return COORD_WORKER_DRAINING;
    return COORD_WORKER_SERVING;
}

struct coord_worker *coord_registry_find_locked(struct coord *c, const char *id)
{
    for (size_t i = 0; i < c->n_workers; i++)
        if (!strcmp(c->workers[i]->id, id))
            return c->workers[i];
    return NULL;
}

static struct coord_worker *worker_create(const char *id, const char *address, int role,
                                          struct moe_tls *tls, struct moe_error *err)
{
    if (!id[0] || strlen(id) >= COORD_ID_MAX) {
        moe_error_set(err, MOE_ERR_INVALID, "worker id '%.40s': empty or longer than %d bytes", id,
                      COORD_ID_MAX - 1);
        return NULL;
    }
    char host[COORD_ADDR_MAX];
    int port;
    if (strlen(address) >= COORD_ADDR_MAX ||
        !moe_hostport_split(address, host, sizeof host, &port) || !host[0]) {
        moe_error_set(err, MOE_ERR_INVALID, "worker '%s': address '%.80s' is not HOST:PORT", id,
                      address);
        return NULL;
    }
    struct coord_worker *w = calloc(1, sizeof *w);
    if (!w) {
        moe_error_set(err, MOE_ERR_NOMEM, "worker '%s': out of memory", id);
        return NULL;
    }
    snprintf(w->id, sizeof w->id, "%s", id);
    snprintf(w->address, sizeof w->address, "%s", address);
    w->role = role;
    w->refs = 1; /* the registry's */
    w->member = true;
    w->block_size = COORD_DEFAULT_BLOCK;
    atomic_store(&w->progress_ms, moe_now_ms());
    struct rpc_client_options o = {
        .keepalive_time_ms = 10000, .keepalive_timeout_ms = 5000, .tls = tls};
    w->client = rpc_client_create(address, &o, err);
    if (!w->client) {
        moe_error_prefix(err, "worker '%s'", id);
        free(w);
        return NULL;
    }
    return w;
}

/* Removes member i; caller holds c->mu. */
static void member_drop_locked(struct coord *c, size_t i)
{
    struct coord_worker *w = c->workers[i];
    c->workers[i] = c->workers[--c->n_workers];
    w->member = false;
    coord_worker_unref_locked(w);
}

enum moe_status coord_registry_upsert(struct coord *c, const char *id, const char *address,
                                      int role, struct moe_error *err)
{
    pthread_mutex_lock(&c->mu);
    struct coord_worker *old = coord_registry_find_locked(c, id);
    if (old && !strcmp(old->address, address)) {
        old->role = role;
        pthread_mutex_unlock(&c->mu);
        return MOE_OK;
    }
    pthread_mutex_unlock(&c->mu);
    /* New, or moved to another address: a new channel (created unlocked). */
    struct coord_worker *w = worker_create(id, address, role, c->opts.tls, err);
    if (!w)
        return err ? err->code : MOE_ERR_INVALID;
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n_workers; i++)
        if (!strcmp(c->workers[i]->id, id)) {
            member_drop_locked(c, i);
            break;
        }
    if (c->n_workers == c->cap_workers) {
        size_t cap = c->cap_workers ? 2 * c->cap_workers : 8;
        struct coord_worker **p = realloc(c->workers, cap * sizeof *p);
        if (!p) {
            coord_worker_unref_locked(w);
            pthread_mutex_unlock(&c->mu);
            return moe_error_set(err, MOE_ERR_NOMEM, "worker '%s': out of memory", id);
        }
        c->workers = p;
        c->cap_workers = cap;
    }
    c->workers[c->n_workers++] = w;
    pthread_mutex_unlock(&c->mu);
    fprintf(stderr, "moe-coordinator: worker %s at %s joined\n", id, address);
    return MOE_OK;
}

int coord_registry_remove(struct coord *c, const char *id)
{
    int found = 0;
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n_workers; i++)
        if (!strcmp(c->workers[i]->id, id)) {
            member_drop_locked(c, i);
            found = 1;
            break;
        }
    pthread_mutex_unlock(&c->mu);
    if (found)
        fprintf(stderr, "moe-coordinator: worker %s left\n", id);
    return found;
}

enum moe_status coord_registry_add_static(struct coord *c, const char *list, struct moe_error *err)
{
    char *copy = strdup(list);
    if (!copy)
        return moe_error_set(err, MOE_ERR_NOMEM, "--workers: out of memory");
    enum moe_status rc = MOE_OK;
    int n = 0;
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ')
            tok++;
        if (!*tok)
            continue;
        if ((rc = coord_registry_upsert(c, tok, tok, MOE__V1__WORKER_ROLE__WORKER_ROLE_MIXED,
                                        err))) {
            moe_error_prefix(err, "--workers");
            goto out;
        }
        n++;
    }
    if (n == 0)
        rc = moe_error_set(err, MOE_ERR_INVALID, "--workers: '%s' names no HOST:PORT", list);
out:
    free(copy);
    return rc;
}

/* ---- etcd membership ------------------------------------------------------------------ */

static int role_from_name(const char *s)
{
    if (s && !strcmp(s, "prefill"))
        return MOE__V1__WORKER_ROLE__WORKER_ROLE_PREFILL;
    if (s && !strcmp(s, "decode"))
        return MOE__V1__WORKER_ROLE__WORKER_ROLE_DECODE;
    return MOE__V1__WORKER_ROLE__WORKER_ROLE_MIXED;
}

/* A registration: key /moe/workers/<id> (the id is the key's suffix) with
 * JSON {"address": "host:port", "role": ...}. Malformed values are logged and
 * ignored: one bad registration must not take the coordinator down. */
static void etcd_put(struct coord *c, const char *key, const char *value, size_t len)
{
    const char *id = key + strlen(WORKERS_PREFIX);
    cJSON *j = cJSON_ParseWithLength(value, len);
    const cJSON *addr = j ? cJSON_GetObjectItemCaseSensitive(j, "address") : NULL;
    const cJSON *role = j ? cJSON_GetObjectItemCaseSensitive(j, "role") : NULL;
    struct moe_error err = {0};
    if (!cJSON_IsString(addr)) {
        fprintf(stderr,
                "moe-coordinator: etcd %s: value is not JSON with a string 'address'; "
                "ignored\n",
                key);
    } else if (coord_registry_upsert(
                   c, id, addr->valuestring,
                   role_from_name(cJSON_IsString(role) ? role->valuestring : NULL), &err)) {
        fprintf(stderr, "moe-coordinator: etcd %s: %s; ignored\n", key, err.msg);
    }
    cJSON_Delete(j);
}

/* Re-reads the prefix: members not there any more are dropped. */
static enum moe_status etcd_resync(struct coord *c, int64_t *revision, struct moe_error *err)
{
    struct moe_etcd *e = NULL;
    struct moe_etcd_kvs kvs = {0};
    enum moe_status rc = moe_etcd_create(c->opts.etcd, 2000, &e, err);
    if (!rc)
        rc = moe_etcd_get_prefix(e, WORKERS_PREFIX, &kvs, err);
    moe_etcd_destroy(e);
    if (rc)
        return rc;
    for (size_t i = 0; i < kvs.n; i++)
        etcd_put(c, kvs.kvs[i].key, kvs.kvs[i].value, kvs.kvs[i].value_len);
    /* Drop members whose key is gone. */
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n_workers;) {
        bool present = false;
        for (size_t k = 0; k < kvs.n && !present; k++)
            present = !strcmp(kvs.kvs[k].key + strlen(WORKERS_PREFIX), c->workers[i]->id);
        if (present) {
            i++;
        } else {
            fprintf(stderr, "moe-coordinator: worker %s left (resync)\n", c->workers[i]->id);
            member_drop_locked(c, i);
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (revision)
        *revision = kvs.revision;
    moe_etcd_kvs_clear(&kvs);
    return MOE_OK;
}

static void on_etcd_event(void *user, const struct moe_etcd_event *ev)
{
    struct coord *c = user;
    struct moe_error err = {0};
    if (ev->type == MOE_ETCD_EVENT_RESYNC) {
        if (etcd_resync(c, NULL, &err))
            fprintf(stderr, "moe-coordinator: etcd resync failed: %s\n", err.msg);
        return;
    }
    if (ev->key_len <= strlen(WORKERS_PREFIX))
        return;
    if (ev->type == MOE_ETCD_EVENT_PUT)
        etcd_put(c, ev->key, ev->value, ev->value_len);
    else
        coord_registry_remove(c, ev->key + strlen(WORKERS_PREFIX));
}

enum moe_status coord_registry_start_etcd(struct coord *c, struct moe_error *err)
{
    int64_t revision = 0;
    enum moe_status rc = etcd_resync(c, &revision, err);
    if (rc)
        return moe_error_prefix(err, "--etcd");
    rc = moe_etcd_watch_create(c->opts.etcd, 2000, WORKERS_PREFIX, 1, revision + 1, on_etcd_event,
                               c, &c->watch, err);
    return rc ? moe_error_prefix(err, "--etcd") : MOE_OK;
}

/* ---- load polling ------------------------------------------------------------------------ */

/* Asks one worker for its load (and, once, its dtype). No lock held. */
static void poll_one(struct coord *c, struct coord_worker *w)
{
    struct rpc_reply reply;
    Moe__V1__GetLoadRequest rq = MOE__V1__GET_LOAD_REQUEST__INIT;
    size_t len;
    void *bytes = rpc_pack(&rq, &len);
    rpc_client_call(w->client, "/moe.v1.Worker/GetLoad", bytes, len, POLL_TIMEOUT_MS, &reply);
    Moe__V1__WorkerLoad *load = NULL;
    if (reply.code == RPC_OK)
        load = moe__v1__worker_load__unpack(NULL, reply.len, reply.data);
    bool need_dtype = false;
    pthread_mutex_lock(&c->mu);
    if (load) {
        if (w->down && w->ever_seen)
            fprintf(stderr, "moe-coordinator: worker %s at %s is up again\n", w->id, w->address);
        w->down = false;
        if (!w->ever_seen || load->stats_steps != w->last_steps)
            atomic_store(&w->progress_ms, moe_now_ms()); /* its engine ran a step */
        w->last_steps = load->stats_steps;
        w->ever_seen = true;
        w->last_seen = moe_now();
        w->last_error[0] = '\0';
        w->running = load->running;
        w->waiting = load->waiting;
        w->kv_used = load->kv_blocks_used;
        w->kv_total = load->kv_blocks_total;
        if (load->block_size)
            w->block_size = load->block_size;
        w->prefix_lookup = load->prefix_lookup_tokens;
        w->prefix_hit = load->prefix_hit_tokens;
        w->reported_draining = load->draining;
        w->world_size = load->world_size;
        w->tp_size = load->tp_size;
        w->ep_size = load->ep_size;
        w->dp_size = 0;
        if (load->dp_size > 1 && load->dp_size <= COORD_MAX_DP &&
            load->n_dp_kv_blocks_used == load->dp_size && load->n_dp_running == load->dp_size) {
            w->dp_size = load->dp_size;
            for (uint32_t r = 0; r < load->dp_size; r++) {
                w->dp_used[r] = load->dp_kv_blocks_used[r];
                w->dp_running[r] = load->dp_running[r];
            }
        }
        if (load->role)
            w->role = load->role;
        w->kv_out = load->kv_transfers_out;
        w->kv_in = load->kv_transfers_in;
        w->kv_bytes = load->kv_transfer_bytes_out + load->kv_transfer_bytes_in;
        w->kv_failures = load->kv_transfer_failures;
        w->spec_draft = load->spec_draft_tokens;
        w->spec_accepted = load->spec_accepted_tokens;
        need_dtype = !c->model_dtype[0];
    } else {
        if (!w->down)
            fprintf(stderr, "moe-coordinator: worker %s at %s is down: %s %s\n", w->id, w->address,
                    rpc_code_name(reply.code), reply.message);
        w->down = true;
        snprintf(w->last_error, sizeof w->last_error, "GetLoad: %s %.200s",
                 rpc_code_name(reply.code), reply.code == RPC_OK ? "bad answer" : reply.message);
    }
    pthread_mutex_unlock(&c->mu);
    if (load)
        moe__v1__worker_load__free_unpacked(load, NULL);
    rpc_reply_clear(&reply);
    free(bytes);

    if (need_dtype) {
        Moe__V1__ModelInfoRequest mrq = MOE__V1__MODEL_INFO_REQUEST__INIT;
        bytes = rpc_pack(&mrq, &len);
        if (rpc_client_call(w->client, "/moe.v1.Worker/GetModelInfo", bytes, len, POLL_TIMEOUT_MS,
                            &reply) == RPC_OK) {
            Moe__V1__ModelInfo *info = moe__v1__model_info__unpack(NULL, reply.len, reply.data);
            if (info) {
                pthread_mutex_lock(&c->mu);
                snprintf(c->model_dtype, sizeof c->model_dtype, "%s", info->dtype);
                pthread_mutex_unlock(&c->mu);
                if (strcmp(info->name, c->model_name))
                    fprintf(stderr,
                            "moe-coordinator: warning: worker %s serves '%s', this "
                            "coordinator '%s'\n",
                            w->id, info->name, c->model_name);
                moe__v1__model_info__free_unpacked(info, NULL);
            }
        }
        rpc_reply_clear(&reply);
        free(bytes);
    }
}

/* One round over a snapshot of the members. */
static void poll_round(struct coord *c)
{
    pthread_mutex_lock(&c->mu);
    size_t n = c->n_workers;
    struct coord_worker **snap = n ? malloc(n * sizeof *snap) : NULL;
    if (!snap)
        n = 0;
    for (size_t i = 0; i < n; i++) {
        snap[i] = c->workers[i];
        coord_worker_ref_locked(snap[i]);
    }
    pthread_mutex_unlock(&c->mu);
    for (size_t i = 0; i < n; i++)
        poll_one(c, snap[i]);
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < n; i++)
        coord_worker_unref_locked(snap[i]);
    pthread_mutex_unlock(&c->mu);
    free(snap);
}

static void *poll_thread(void *arg)
{
    struct coord *c = arg;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        long ns = until.tv_nsec + (long)c->opts.poll_ms * 1000000L;
        until.tv_sec += ns / 1000000000L;
        until.tv_nsec = ns % 1000000000L;
        while (!c->stopping) {
            if (pthread_cond_timedwait(&c->cond, &c->mu, &until))
                break; /* timed out */
        }
        bool stop = c->stopping;
        pthread_mutex_unlock(&c->mu);
        if (stop)
            break;
        poll_round(c);
    }
    return NULL;
}

enum moe_status coord_registry_start_poller(struct coord *c, struct moe_error *err)
{
    poll_round(c); /* the first view before serving */
    if (pthread_create(&c->poll_thread, NULL, poll_thread, c))
        return moe_error_set(err, MOE_ERR_INTERNAL, "cannot start the polling thread");
    c->poll_started = true;
    return MOE_OK;
}

void coord_registry_stop(struct coord *c)
{
    moe_etcd_watch_destroy(c->watch);
    c->watch = NULL;
    if (c->poll_started) {
        pthread_mutex_lock(&c->mu);
        c->stopping = true;
        pthread_cond_broadcast(&c->cond);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->poll_thread, NULL);
        c->poll_started = false;
    }
    pthread_mutex_lock(&c->mu);
    while (c->n_workers)
        member_drop_locked(c, c->n_workers - 1);
    pthread_mutex_unlock(&c->mu);
}
