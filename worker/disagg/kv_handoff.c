/* The KV handoff table and its RPCs. See kv_handoff.h for the protocol.
 *
 * Locking: x->mu guards the table, the counters and every handoff field.
 * While a handoff is SENDING only its sender may free it, while RESERVING or
 * RECEIVING only the control thread (a release just asks them to stop).
 * Engine calls made here only queue work (abort, reserve, unreserve), so
 * they are safe under x->mu, also from the engine thread. Network calls to
 * the group's ranks (expect, forget) run on the control thread, never under
 * x->mu and never on the engine thread. */
#include "disagg/kv_handoff.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/generate.h"
#include "moe/v1/worker.pb-c.h"
#include "request_check.h"

#define KV_HANDOFF_DEFAULT_TTL_MS 30000
#define KV_HANDOFF_DEFAULT_SEND_MS 10000
#define KV_HANDOFF_CALL_TIMEOUT_MS 5000
#define KV_HANDOFF_ABORT_TIMEOUT_MS 500
#define KV_HANDOFF_MAX_PEERS 32

struct handoff {
    char id[KV_HANDOFF_ID_MAX];
    enum kv_handoff_state state;
    bool prefill;           /* the sending side */
    double deadline;        /* moe_now() seconds */
    bool release_requested; /* SENDING / RESERVING / RECEIVING: stop and free when you can */
    /* prefill side: the parked sequence */
    uint64_t req_id;
    int n_prompt, n_tokens;
    int32_t *tokens; /* (n_tokens) */
    struct moe_rng rng;
    /* both: block ids in the KV cache of the ranks that hold the sequence
     * (decode side: once reserved): the DP group of pool part `part`, at
     * the part's own ids (without DP: part 0, the pool's ids) */
    int32_t *blocks; /* (n_blocks) */
    int n_blocks;
    int part;
    /* decode side */
    uint64_t key;             /* engine reservation */
    int n_kv;                 /* KV positions expected */
    struct rpc_call *pending; /* KvReserve or KvTransfer(commit) waiting for the control thread */
    bool announced;           /* the ranks were told to expect it: forget before freeing */
    uint64_t bytes;
    struct handoff *next;
};

/* Work for the control thread. */
enum job_kind {
    JOB_ANNOUNCE, /* tell every rank to expect h, then answer its KvReserve */
    JOB_COMMIT,   /* collect every rank's report, then answer the commit */
    JOB_RELEASE,  /* h left the table: forget it on every rank, then free its blocks */
};

struct job {
    enum job_kind kind;
    struct handoff *h;
    struct job *next;
};

struct kv_handoff {
    struct kv_handoff_opts o;
    char *endpoints; /* (world_size x KV_LINK_ENDPOINT_MAX) */
    int block_size;
    int part_blocks; /* blocks of one KV pool part (the whole pool without DP) */
    int n_layer;

    pthread_mutex_t mu;
    pthread_cond_t cond; /* n_senders dropped; jobs queued */
    struct handoff *list;
    uint64_t next_key;
    int n_senders;
    bool stopping; /* no new handoffs; running ones are answered */
    bool exiting;  /* the control thread ends once its queue is empty */
    struct kv_handoff_counters c;
    struct job *jobs, **jobs_tail;
    pthread_t control;
    bool control_live;
    /* One channel per decode worker, reused by every handoff to it. */
    struct {
        char target[300];
        struct rpc_client *cl;
    } peers[KV_HANDOFF_MAX_PEERS];
    int n_peers;
};

/* The cached channel to `target`, or a new one; *owned tells whether the
 * caller must destroy it (only when the cache is full). */
static struct rpc_client *peer_client(struct kv_handoff *x, const char *target, bool *owned,
                                      struct moe_error *err)
{
    *owned = false;
    pthread_mutex_lock(&x->mu);
    for (int i = 0; i < x->n_peers; i++)
        if (!strcmp(x->peers[i].target, target)) {
            struct rpc_client *cl = x->peers[i].cl;
            pthread_mutex_unlock(&x->mu);
            return cl;
        }
    struct rpc_client_options co = {.tls = x->o.tls};
    struct rpc_client *cl = rpc_client_create(target, &co, err);
    if (cl && x->n_peers < KV_HANDOFF_MAX_PEERS) {
        snprintf(x->peers[x->n_peers].target, sizeof x->peers[0].target, "%s", target);
        x->peers[x->n_peers++].cl = cl;
    } else if (cl) {
        *owned = true;
    }
    pthread_mutex_unlock(&x->mu);
    return cl;
}

/* Rank r's KV endpoint, or NULL for this process (rank 0). */
static const char *rank_endpoint(const struct kv_handoff *x, int r)
{
    return r == 0 ? NULL : x->endpoints + (size_t)r * KV_LINK_ENDPOINT_MAX;
}

/* The ranks holding h's KV: [*first, *first + return value). Without DP
 * every rank (each TP sub-group holds a replica); with DP the TP ranks of
 * the DP group whose part holds it. */
static int holders(const struct kv_handoff *x, const struct handoff *h, int *first)
{
    if (x->o.dp_size > 1) {
        *first = h->part * x->o.tp_size;
        return x->o.tp_size;
    }
    *first = 0;
    return x->o.world_size;
}

/* Engine block ids (the whole pool) -> the part they are in and the ids in
 * that part's cache, in place. */
static int to_part(const struct kv_handoff *x, int32_t *blocks, int n)
{
    int part = n ? blocks[0] / x->part_blocks : 0;
    for (int i = 0; i < n; i++)
        blocks[i] -= part * x->part_blocks;
    return part;
}

const char *kv_handoff_state_name(enum kv_handoff_state s)
{
    switch (s) {
    case KV_HANDOFF_PREFILLED: return "PREFILLED";
    case KV_HANDOFF_SENDING: return "SENDING";
    case KV_HANDOFF_DONE: return "DONE";
    case KV_HANDOFF_FAILED: return "FAILED";
    case KV_HANDOFF_EXPIRED: return "EXPIRED";
    case KV_HANDOFF_RESERVING: return "RESERVING";
    case KV_HANDOFF_RESERVED: return "RESERVED";
    case KV_HANDOFF_RECEIVING: return "RECEIVING";
    case KV_HANDOFF_COMPLETE: return "COMPLETE";
    case KV_HANDOFF_CLAIMED: return "CLAIMED";
    }
    return "?";
}

/* ---- table ------------------------------------------------------------------------ */

static void finish_msg(struct rpc_call *call, const ProtobufCMessage *msg)
{
    rpc_call_finish_msg(call, msg);
}

static void wake(struct kv_handoff *x)
{
    if (x->o.wake)
        x->o.wake(x->o.wake_user);
}

static struct handoff *find_locked(struct kv_handoff *x, const char *id, bool prefill)
{
    for (struct handoff *h = x->list; h; h = h->next)
        if (h->prefill == prefill && !strcmp(h->id, id))
            return h;
    return NULL;
}

static struct handoff *find_key_locked(struct kv_handoff *x, uint64_t key)
{
    for (struct handoff *h = x->list; h; h = h->next)
        if (!h->prefill && h->key == key)
            return h;
    return NULL;
}

static void handoff_free(struct handoff *h)
{
    if (!h)
        return;
    free(h->tokens);
    free(h->blocks);
    free(h);
}

/* Unlinks and frees h; caller holds x->mu. */
static void remove_locked(struct kv_handoff *x, struct handoff *h)
{
    for (struct handoff **p = &x->list; *p; p = &(*p)->next)
        if (*p == h) {
            *p = h->next;
            break;
        }
    handoff_free(h);
}

static void push_locked(struct kv_handoff *x, struct handoff *h)
{
    h->next = x->list;
    x->list = h;
}

static void queue_job_locked(struct kv_handoff *x, enum job_kind kind, struct handoff *h)
{
    struct job *j = malloc(sizeof *j);
    if (!j) { /* cannot happen in practice; keep the blocks rather than risk a late write */
        fprintf(stderr,
                "moe-worker: handoff %s: out of memory for its release: %d KV blocks "
                "stay reserved\n",
                h->id, h->n_blocks);
        return;
    }
    j->kind = kind;
    j->h = h;
    j->next = NULL;
    *x->jobs_tail = j;
    x->jobs_tail = &j->next;
    pthread_cond_broadcast(&x->cond);
}

/* Unlinks h from the table without freeing it; caller holds x->mu. */
static void unlink_locked(struct kv_handoff *x, struct handoff *h)
{
    for (struct handoff **p = &x->list; *p; p = &(*p)->next)
        if (*p == h) {
            *p = h->next;
            break;
        }
}

/* Gives up h and frees its engine side: the parked sequence at once; a
 * reservation once every rank confirmed it writes no more into it (on the
 * control thread). Caller holds x->mu; h leaves the table. */
static void drop_locked(struct kv_handoff *x, struct handoff *h, enum kv_handoff_state why)
{
    h->state = why;
    if (h->prefill) {
        moe_engine_abort(x->o.engine, h->req_id);
        remove_locked(x, h);
        return;
    }
    unlink_locked(x, h);
    if (h->n_blocks || h->announced)
        queue_job_locked(x, JOB_RELEASE, h);
    else {
        moe_engine_unreserve(x->o.engine, h->key);
        handoff_free(h);
    }
}

/* ---- the control thread: network calls to the group's ranks --------------------------- */

/* Tells every rank to expect h; on failure forgets it where it was told. */
static enum moe_status announce(struct kv_handoff *x, struct handoff *h, struct moe_error *err)
{
    /* the ranks' entries outlive the RESERVED deadline (set after this) */
    int ttl = x->o.ttl_ms + 1000, first, n = holders(x, h, &first);
    for (int r = first; r < first + n; r++) {
        enum moe_status rc = kv_link_expect(x->o.link, rank_endpoint(x, r), h->id, h->blocks,
                                            h->n_blocks, h->n_kv, ttl, err);
        if (rc) {
            for (int q = first; q < r; q++) {
                uint64_t b;
                bool c;
                struct moe_error ignored = {0};
                kv_link_forget(x->o.link, rank_endpoint(x, q), h->id, &b, &c, &ignored);
            }
            return moe_error_prefix(err, "telling rank %d to expect the handoff", r);
        }
    }
    return MOE_OK;
}

/* Forgets h on every rank: *bytes written in all, *complete when every rank
 * got every row. A rank that cannot be asked fails the whole (its writes are
 * bounded by its own socket timeouts). */
static enum moe_status forget_all(struct kv_handoff *x, struct handoff *h, uint64_t *bytes,
                                  bool *complete, struct moe_error *err)
{
    *bytes = 0;
    *complete = true;
    enum moe_status first = MOE_OK;
    int r0, n = holders(x, h, &r0);
    for (int r = r0; r < r0 + n; r++) {
        uint64_t b = 0;
        bool c = false;
        struct moe_error e = {0};
        enum moe_status rc = kv_link_forget(x->o.link, rank_endpoint(x, r), h->id, &b, &c, &e);
        if (rc && !first) {
            first = rc;
            moe_error_set(err, rc, "rank %d: %s", r, e.msg);
        }
        *bytes += b;
        *complete = *complete && c;
    }
    return first;
}

static void run_announce(struct kv_handoff *x, struct handoff *h)
{
    struct moe_error err = {0};
    enum moe_status rc = announce(x, h, &err);
    uint32_t *ids = malloc((size_t)(h->n_blocks ? h->n_blocks : 1) * sizeof *ids);
    int first, n_ranks = holders(x, h, &first);
    char **eps = malloc((size_t)n_ranks * sizeof *eps);
    pthread_mutex_lock(&x->mu);
    struct rpc_call *call = h->pending;
    h->pending = NULL;
    h->announced = rc == MOE_OK;
    if (rc || h->release_requested || !ids || !eps || x->stopping) {
        const char *why = rc                     ? err.msg
                          : h->release_requested ? "handoff released while reserving"
                          : x->stopping          ? "the worker is shutting down"
                                                 : "out of memory";
        char msg[sizeof err.msg];
        snprintf(msg, sizeof msg, "%s", why);
        drop_locked(x, h, KV_HANDOFF_FAILED);
        pthread_mutex_unlock(&x->mu);
        free(ids);
        free(eps);
        rpc_call_finish(call, rc ? RPC_UNAVAILABLE : RPC_ABORTED, msg, NULL, 0);
        return;
    }
    for (int i = 0; i < h->n_blocks; i++)
        ids[i] = (uint32_t)h->blocks[i];
    for (int r = 0; r < n_ranks; r++) /* the ranks holding it: a plain TP group to the sender */
        eps[r] = first + r == 0 ? (char *)kv_link_endpoint(x->o.link)
                                : (char *)rank_endpoint(x, first + r);
    h->state = KV_HANDOFF_RESERVED;
    h->deadline = moe_now() + x->o.ttl_ms / 1e3;
    Moe__V1__KvReserveResponse resp = MOE__V1__KV_RESERVE_RESPONSE__INIT;
    resp.handoff_id = h->id;
    resp.ok = true;
    resp.n_block_ids = (size_t)h->n_blocks;
    resp.block_ids = ids;
    resp.n_rank_endpoints = (size_t)n_ranks;
    resp.rank_endpoints = eps;
    resp.tp_size = (uint32_t)x->o.tp_size;
    resp.block_size = (uint32_t)x->block_size;
    finish_msg(call, &resp.base); /* packs under the lock: h->id stays valid */
    pthread_mutex_unlock(&x->mu);
    free(ids);
    free(eps);
}

static void run_commit(struct kv_handoff *x, struct handoff *h)
{
    struct moe_error err = {0};
    uint64_t bytes = 0;
    bool complete = false;
    enum moe_status rc = forget_all(x, h, &bytes, &complete, &err);
    pthread_mutex_lock(&x->mu);
    h->announced = false; /* forgotten everywhere (or a rank is unreachable) */
    struct rpc_call *call = h->pending;
    h->pending = NULL;
    char msg[600] = "";
    enum rpc_code code = RPC_OK;
    if (rc) {
        code = RPC_UNAVAILABLE;
        snprintf(msg, sizeof msg, "handoff %.100s: %.450s", h->id, err.msg);
    } else if (!complete) {
        code = RPC_FAILED_PRECONDITION;
        snprintf(msg, sizeof msg,
                 "handoff %.100s: committed, but the ranks hold %llu bytes, not every row of "
                 "every layer",
                 h->id, (unsigned long long)bytes);
    } else if (h->release_requested || x->stopping) {
        code = RPC_ABORTED;
        snprintf(msg, sizeof msg, "handoff %.100s: released while committing", h->id);
    }
    if (code) {
        fprintf(stderr, "moe-worker: %s\n", msg);
        x->c.failures++;
        drop_locked(x, h, KV_HANDOFF_FAILED);
        pthread_mutex_unlock(&x->mu);
        wake(x);
        rpc_call_finish(call, code, msg, NULL, 0);
        return;
    }
    h->bytes = bytes;
    h->state = KV_HANDOFF_COMPLETE;
    h->deadline = moe_now() + x->o.ttl_ms / 1e3; /* now wait for the Generate */
    x->c.transfers_in++;
    x->c.bytes_in += bytes;
    Moe__V1__KvTransferResponse resp = MOE__V1__KV_TRANSFER_RESPONSE__INIT;
    resp.handoff_id = h->id;
    resp.ok = true;
    resp.bytes_received = bytes;
    finish_msg(call, &resp.base);
    pthread_mutex_unlock(&x->mu);
}

static void run_release(struct kv_handoff *x, struct handoff *h)
{
    if (h->announced) {
        uint64_t bytes;
        bool complete;
        struct moe_error err = {0};
        if (forget_all(x, h, &bytes, &complete, &err))
            fprintf(stderr, "moe-worker: handoff %s: %s (freeing its blocks anyway)\n", h->id,
                    err.msg);
    }
    moe_engine_unreserve(x->o.engine, h->key);
    handoff_free(h);
    wake(x);
}

static void *control_main(void *arg)
{
    struct kv_handoff *x = arg;
    pthread_mutex_lock(&x->mu);
    for (;;) {
        while (!x->jobs && !x->exiting)
            pthread_cond_wait(&x->cond, &x->mu);
        if (!x->jobs)
            break; /* exiting and nothing left */
        struct job *j = x->jobs;
        x->jobs = j->next;
        if (!x->jobs)
            x->jobs_tail = &x->jobs;
        pthread_mutex_unlock(&x->mu);
        switch (j->kind) {
        case JOB_ANNOUNCE: run_announce(x, j->h); break;
        case JOB_COMMIT: run_commit(x, j->h); break;
        case JOB_RELEASE: run_release(x, j->h); break;
        }
        free(j);
        pthread_mutex_lock(&x->mu);
    }
    pthread_mutex_unlock(&x->mu);
    return NULL;
}

enum moe_status kv_handoff_create(const struct kv_handoff_opts *opts, struct kv_handoff **out,
                                  struct moe_error *err)
{
    *out = NULL;
    struct kv_handoff *x = calloc(1, sizeof *x);
    if (!x)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    x->o = *opts;
    if (x->o.tp_size <= 0)
        x->o.tp_size = 1;
    if (x->o.world_size <= 0)
        x->o.world_size = 1;
    if (x->o.ttl_ms <= 0)
        x->o.ttl_ms = KV_HANDOFF_DEFAULT_TTL_MS;
    size_t eb = (size_t)x->o.world_size * KV_LINK_ENDPOINT_MAX;
    if (!(x->endpoints = calloc(1, eb))) {
        free(x);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    if (opts->endpoints)
        memcpy(x->endpoints, opts->endpoints, eb);
    x->o.endpoints = NULL;
    if (x->o.dp_size <= 0)
        x->o.dp_size = 1;
    x->block_size = moe_engine_block_size(opts->engine);
    x->part_blocks = moe_engine_n_block(opts->engine) / x->o.dp_size;
    if (x->o.dp_size > 1 && (x->o.dp_size * x->o.tp_size != x->o.world_size ||
                             moe_engine_n_block(opts->engine) % x->o.dp_size)) {
        moe_error_set(
            err, MOE_ERR_INVALID, "KV handoff: %d DP groups of TP %d over %d ranks and %d blocks",
            opts->dp_size, x->o.tp_size, x->o.world_size, moe_engine_n_block(opts->engine));
        free(x->endpoints);
        free(x);
        return MOE_ERR_INVALID;
    }
    x->n_layer = moe_engine_kv_cache(opts->engine)->n_layer;
    x->next_key = 1;
    x->jobs_tail = &x->jobs;
    pthread_mutex_init(&x->mu, NULL);
    pthread_cond_init(&x->cond, NULL);
    if (pthread_create(&x->control, NULL, control_main, x)) {
        kv_handoff_destroy(x);
        return moe_error_set(err, MOE_ERR_INTERNAL, "cannot start the KV handoff thread");
    }
    x->control_live = true;
    *out = x;
    return MOE_OK;
}

void kv_handoff_shutdown(struct kv_handoff *x)
{
    if (!x)
        return;
    pthread_mutex_lock(&x->mu);
    x->stopping = true;
    pthread_cond_broadcast(&x->cond);
    pthread_mutex_unlock(&x->mu);
}

void kv_handoff_destroy(struct kv_handoff *x)
{
    if (!x)
        return;
    pthread_mutex_lock(&x->mu);
    x->stopping = true;
    x->exiting = true; /* the engine thread ended: no job comes after this */
    pthread_cond_broadcast(&x->cond);
    while (x->n_senders > 0)
        pthread_cond_wait(&x->cond, &x->mu);
    pthread_mutex_unlock(&x->mu);
    if (x->control_live) /* it runs what is queued, then ends */
        pthread_join(x->control, NULL);
    while (x->list) {
        struct handoff *h = x->list;
        x->list = h->next;
        handoff_free(h); /* a pending call was answered before the server went away */
    }
    for (int i = 0; i < x->n_peers; i++)
        rpc_client_destroy(x->peers[i].cl);
    pthread_mutex_destroy(&x->mu);
    pthread_cond_destroy(&x->cond);
    free(x->endpoints);
    free(x);
}

void kv_handoff_counters(struct kv_handoff *x, struct kv_handoff_counters *out)
{
    pthread_mutex_lock(&x->mu);
    *out = x->c;
    pthread_mutex_unlock(&x->mu);
}

void kv_handoff_on_parked(struct kv_handoff *x, const char *id, const struct moe_seq_export *ex)
{
    struct handoff *h = calloc(1, sizeof *h);
    if (h) {
        h->tokens = malloc((size_t)ex->n_tokens * sizeof *h->tokens);
        h->blocks = malloc((size_t)(ex->n_blocks ? ex->n_blocks : 1) * sizeof *h->blocks);
    }
    pthread_mutex_lock(&x->mu);
    if (!h || !h->tokens || !h->blocks || find_locked(x, id, true) ||
        strlen(id) >= KV_HANDOFF_ID_MAX) {
        pthread_mutex_unlock(&x->mu);
        fprintf(stderr, "moe-worker: handoff '%.100s': %s; its blocks are freed\n", id,
                h && h->tokens && h->blocks ? "duplicate or too long id" : "out of memory");
        moe_engine_abort(x->o.engine, ex->req_id);
        handoff_free(h);
        return;
    }
    snprintf(h->id, sizeof h->id, "%s", id);
    h->prefill = true;
    h->state = KV_HANDOFF_PREFILLED;
    h->deadline = moe_now() + x->o.ttl_ms / 1e3;
    h->req_id = ex->req_id;
    h->n_prompt = ex->n_prompt;
    h->n_tokens = ex->n_tokens;
    memcpy(h->tokens, ex->tokens, (size_t)ex->n_tokens * sizeof *h->tokens);
    h->n_blocks = ex->n_blocks;
    if (ex->n_blocks)
        memcpy(h->blocks, ex->blocks, (size_t)ex->n_blocks * sizeof *h->blocks);
    h->part = to_part(x, h->blocks, h->n_blocks);
    h->rng = ex->rng;
    push_locked(x, h);
    pthread_mutex_unlock(&x->mu);
}

void kv_handoff_tick(struct kv_handoff *x)
{
    double now = moe_now();
    bool woke = false;
    pthread_mutex_lock(&x->mu);
    for (struct handoff *h = x->list, *next; h; h = next) {
        next = h->next;
        if (now <= h->deadline || h->state == KV_HANDOFF_SENDING ||
            h->state == KV_HANDOFF_RESERVING || h->state == KV_HANDOFF_RECEIVING)
            continue;
        fprintf(stderr, "moe-worker: handoff %s expired in state %s; %d KV blocks freed\n", h->id,
                kv_handoff_state_name(h->state), h->n_blocks);
        x->c.failures++;
        drop_locked(x, h, KV_HANDOFF_EXPIRED);
        woke = true;
    }
    pthread_mutex_unlock(&x->mu);
    if (woke)
        wake(x);
}

enum rpc_code kv_handoff_claim(struct kv_handoff *x, const char *id, struct kv_handoff_claim *out,
                               char *msg, size_t cap)
{
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&x->mu);
    struct handoff *h = find_locked(x, id, false);
    enum rpc_code code = RPC_OK;
    if (!h) {
        code = RPC_NOT_FOUND;
        snprintf(msg, cap,
                 "handoff_id: '%.100s' is unknown here (never reserved, released or "
                 "expired)",
                 id);
    } else if (h->state != KV_HANDOFF_COMPLETE) {
        code = RPC_FAILED_PRECONDITION;
        snprintf(msg, cap, "handoff_id: '%.100s' is %s, not COMPLETE", id,
                 kv_handoff_state_name(h->state));
    } else {
        h->state = KV_HANDOFF_CLAIMED;
        out->reservation = h->key;
        out->n_prompt = h->n_prompt;
        out->n_tokens = h->n_tokens;
        out->tokens = h->tokens;
        out->rng = h->rng;
        h->tokens = NULL;
        remove_locked(x, h);
    }
    pthread_mutex_unlock(&x->mu);
    return code;
}

/* ---- KvReserve (decode side) --------------------------------------------------------- */

/* Engine thread: the reservation of `key` was served. The ranks are told
 * to expect the handoff on the control thread, which then answers. */
static void on_reserved(void *user, uint64_t key, const int32_t *blocks, int n_blocks,
                        const char *error)
{
    struct kv_handoff *x = user;
    pthread_mutex_lock(&x->mu);
    struct handoff *h = find_key_locked(x, key);
    int32_t *copy = blocks ? malloc((size_t)(n_blocks ? n_blocks : 1) * sizeof *copy) : NULL;
    if (!h || h->release_requested || error || !copy) {
        struct rpc_call *call = h ? h->pending : NULL;
        if (h) {
            h->pending = NULL;
            remove_locked(x, h);
        }
        if (blocks)
            moe_engine_unreserve(x->o.engine, key);
        pthread_mutex_unlock(&x->mu);
        free(copy);
        if (call)
            rpc_call_finish(call, error || !copy ? RPC_RESOURCE_EXHAUSTED : RPC_ABORTED,
                            error  ? error
                            : copy ? "handoff released while reserving"
                                   : "out of memory",
                            NULL, 0);
        return;
    }
    memcpy(copy, blocks, (size_t)n_blocks * sizeof *copy);
    h->blocks = copy;
    h->n_blocks = n_blocks;
    h->part = to_part(x, h->blocks, n_blocks); /* the engine reserves in one part */
    queue_job_locked(x, JOB_ANNOUNCE, h);      /* h->pending stays: the job answers */
    pthread_mutex_unlock(&x->mu);
}

static void handle_reserve(struct rpc_call *call, const uint8_t *bytes, size_t len, void *user)
{
    struct kv_handoff *x = user;
    char msg[512];
    enum rpc_code code = RPC_OK;
    struct handoff *h = NULL;
    Moe__V1__KvReserveRequest *rq = moe__v1__kv_reserve_request__unpack(NULL, len, bytes);
    uint32_t tp = rq && rq->tp_size ? rq->tp_size : 1;
    uint32_t bs = (uint32_t)x->block_size;
    uint32_t heads = (uint32_t)x->o.n_kv_head, dh = (uint32_t)x->o.d_head;
    if (!rq) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg, "request: not a valid KvReserveRequest message");
    } else if (!rq->handoff_id[0] || strlen(rq->handoff_id) >= KV_HANDOFF_ID_MAX) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg, "handoff_id: empty or longer than %d bytes",
                 KV_HANDOFF_ID_MAX - 1);
    } else if ((rq->n_layer && rq->n_layer != (uint32_t)x->n_layer) ||
               (rq->n_kv_heads && rq->n_kv_heads != heads) ||
               (rq->head_dim && rq->head_dim != dh) ||
               (rq->kv_dim && rq->kv_dim * (x->o.latent ? 1 : tp) != heads * dh)) {
        code = RPC_FAILED_PRECONDITION;
        snprintf(msg, sizeof msg,
                 "KV layout: the sender has %u layers x %u KV heads x head dim %u (kv_dim %u on "
                 "each of %u TP ranks), this worker %d x %u x %u: not the same model",
                 rq->n_layer, rq->n_kv_heads, rq->head_dim, rq->kv_dim, tp, x->n_layer, heads, dh);
    } else if (rq->n_tokens < 1 || (rq->n_blocks && rq->n_blocks != (rq->n_tokens + bs - 1) / bs)) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg,
                 "n_blocks: %u blocks do not hold %u tokens of %u per block (this worker's "
                 "block size)",
                 rq->n_blocks, rq->n_tokens, bs);
    } else if ((rq->n_tokens + bs - 1) / bs > (uint32_t)x->part_blocks) {
        code = RPC_RESOURCE_EXHAUSTED;
        snprintf(msg, sizeof msg,
                 "no free KV blocks: the handoff needs %u, the whole pool has %d%s",
                 (rq->n_tokens + bs - 1) / bs, x->part_blocks,
                 x->o.dp_size > 1 ? " in each data-parallel group" : "");
    } else if (!(h = calloc(1, sizeof *h))) {
        code = RPC_RESOURCE_EXHAUSTED;
        snprintf(msg, sizeof msg, "out of memory");
    }
    {
        char smsg[256];
        if (moe_check_strings(&rq->base, smsg, sizeof smsg)) {
            moe__v1__kv_reserve_request__free_unpacked(rq, NULL);
            rpc_call_finish(call, RPC_INVALID_ARGUMENT, smsg, NULL, 0);
            return;
        }
    }
    if (code) {
        if (rq)
            moe__v1__kv_reserve_request__free_unpacked(rq, NULL);
        rpc_call_finish(call, code, msg, NULL, 0);
        return;
    }
    snprintf(h->id, sizeof h->id, "%s", rq->handoff_id);
    h->state = KV_HANDOFF_RESERVING;
    h->pending = call;
    h->n_kv = (int)rq->n_tokens;
    int n_blocks = (int)((rq->n_tokens + bs - 1) / bs);
    int ttl = rq->ttl_ms ? (int)rq->ttl_ms : x->o.ttl_ms;
    h->deadline = moe_now() + ttl / 1e3;
    moe__v1__kv_reserve_request__free_unpacked(rq, NULL);
    struct moe_error err = {0};
    pthread_mutex_lock(&x->mu);
    if (x->stopping || find_locked(x, h->id, false)) {
        bool stopping = x->stopping;
        pthread_mutex_unlock(&x->mu);
        snprintf(msg, sizeof msg, "handoff_id: '%.100s' %s", h->id,
                 stopping ? "refused: the worker is shutting down" : "is already reserved here");
        handoff_free(h);
        rpc_call_finish(call, stopping ? RPC_UNAVAILABLE : RPC_ALREADY_EXISTS, msg, NULL, 0);
        return;
    }
    h->key = x->next_key++;
    push_locked(x, h);
    enum moe_status rc = moe_engine_reserve(x->o.engine, h->key, n_blocks, on_reserved, x, &err);
    if (rc) {
        remove_locked(x, h);
        pthread_mutex_unlock(&x->mu);
        rpc_call_finish(call, rpc_code_from_status(rc), err.msg, NULL, 0);
        return;
    }
    pthread_mutex_unlock(&x->mu);
    wake(x);
}

/* ---- KvTransfer: commit or abort (decode side) ------------------------------------ */

/* Checks a commit against h and takes the sequence state; caller holds x->mu.
 * Returns RPC_OK or a code with msg set. */
static enum rpc_code commit_locked(struct kv_handoff *x, struct handoff *h,
                                   const Moe__V1__KvTransferChunk *ch, char *msg, size_t cap)
{
    if (h->state != KV_HANDOFF_RESERVED) {
        snprintf(msg, cap, "handoff %s is %s, not RESERVED", h->id,
                 kv_handoff_state_name(h->state));
        return RPC_FAILED_PRECONDITION;
    }
    if (ch->n_block_ids != (size_t)h->n_blocks) {
        snprintf(msg, cap, "block_ids: %zu ids, %d blocks were reserved", ch->n_block_ids,
                 h->n_blocks);
        return RPC_INVALID_ARGUMENT;
    }
    for (int i = 0; i < h->n_blocks; i++)
        if (ch->block_ids[i] != (uint32_t)h->blocks[i]) {
            snprintf(msg, cap, "block_ids[%d]: %u, block %d was reserved", i, ch->block_ids[i],
                     h->blocks[i]);
            return RPC_INVALID_ARGUMENT;
        }
    if (!ch->last || ch->n_rng_state != 4 || ch->n_prompt < 1 || ch->n_token_ids <= ch->n_prompt ||
        (int)ch->n_token_ids - 1 != h->n_kv) {
        snprintf(msg, cap,
                 "commit: %zu tokens after a prompt of %u, %zu RNG words: not a complete "
                 "sequence for %d KV positions",
                 ch->n_token_ids, ch->n_prompt, ch->n_rng_state, h->n_kv);
        return RPC_INVALID_ARGUMENT;
    }
    int32_t *tokens = malloc(ch->n_token_ids * sizeof *tokens);
    if (!tokens) {
        snprintf(msg, cap, "out of memory");
        return RPC_RESOURCE_EXHAUSTED;
    }
    for (size_t i = 0; i < ch->n_token_ids; i++)
        tokens[i] = (int32_t)ch->token_ids[i];
    free(h->tokens);
    h->tokens = tokens;
    h->n_tokens = (int)ch->n_token_ids;
    h->n_prompt = (int)ch->n_prompt;
    for (int i = 0; i < 4; i++)
        h->rng.s[i] = ch->rng_state[i];
    return RPC_OK;
}

static void handle_transfer(struct rpc_call *call, const uint8_t *bytes, size_t len, void *user)
{
    struct kv_handoff *x = user;
    char msg[512] = "";
    Moe__V1__KvTransferChunk *ch =
        rpc_call_unpack(call, &moe__v1__kv_transfer_chunk__descriptor, bytes, len);
    if (!ch)
        return;
    enum rpc_code code = RPC_OK;
    bool woke = false, answered_later = false;
    pthread_mutex_lock(&x->mu);
    struct handoff *h = find_locked(x, ch->handoff_id, false);
    if (!h) {
        code = RPC_NOT_FOUND;
        snprintf(msg, sizeof msg, "handoff %.100s: no reservation here (released or expired)",
                 ch->handoff_id);
    } else if (ch->abort) {
        fprintf(stderr, "moe-worker: handoff %s aborted by the sender: %.200s\n", h->id, ch->error);
        if (h->state == KV_HANDOFF_RESERVING ||
            h->state == KV_HANDOFF_RECEIVING) /* its job frees it */
            h->release_requested = true;
        else
            drop_locked(x, h, KV_HANDOFF_FAILED);
        x->c.failures++;
        woke = true;
    } else if ((code = commit_locked(x, h, ch, msg, sizeof msg)) != RPC_OK) {
        fprintf(stderr, "moe-worker: handoff %s failed: %s\n", h->id, msg);
        drop_locked(x, h, KV_HANDOFF_FAILED);
        x->c.failures++;
        woke = true;
    } else {
        /* every rank reports what it got before the handoff is COMPLETE */
        h->state = KV_HANDOFF_RECEIVING;
        h->pending = call;
        queue_job_locked(x, JOB_COMMIT, h);
        answered_later = true;
    }
    pthread_mutex_unlock(&x->mu);
    if (woke)
        wake(x);
    if (code)
        rpc_call_finish(call, code, msg, NULL, 0);
    else if (!answered_later) {
        Moe__V1__KvTransferResponse resp = MOE__V1__KV_TRANSFER_RESPONSE__INIT;
        resp.handoff_id = ch->handoff_id;
        resp.ok = true;
        finish_msg(call, &resp.base);
    }
    moe__v1__kv_transfer_chunk__free_unpacked(ch, NULL);
}

/* ---- KvSend (prefill side) ------------------------------------------------------------ */

struct sender {
    struct kv_handoff *x;
    struct rpc_call *call;
    struct handoff *h;    /* SENDING: owned by this sender until it ends */
    char target[300];     /* the decode leader's Worker service */
    uint32_t *dst_blocks; /* (h->n_blocks of the receiver) */
    int n_dst_blocks, dst_block_size;
    struct kv_link_target *targets; /* the decode group's ranks */
    int n_targets;
    double deadline;
};

static int64_t ms_until(double t)
{
    double left = (t - moe_now()) * 1e3;
    return left < 1 ? 1 : (int64_t)left;
}

/* Every TP rank holding the sequence pushes its heads (the first TP group,
 * or with DP the sequence's DP group; rank 0 here, the others by order);
 * returns RPC_OK or the failure with msg set. */
static enum rpc_code push_slices(struct sender *s, uint64_t *bytes, uint32_t *slices, char *msg,
                                 size_t cap)
{
    struct kv_handoff *x = s->x;
    struct handoff *h = s->h;
    int32_t *dst = malloc((size_t)(s->n_dst_blocks ? s->n_dst_blocks : 1) * sizeof *dst);
    if (!dst) {
        snprintf(msg, cap, "out of memory");
        return RPC_RESOURCE_EXHAUSTED;
    }
    for (int i = 0; i < s->n_dst_blocks; i++)
        dst[i] = (int32_t)s->dst_blocks[i];
    struct kv_link_push p = {.id = h->id,
                             .src_blocks = h->blocks,
                             .n_src_blocks = h->n_blocks,
                             .n_tokens = h->n_tokens - 1, /* the last token has no KV yet */
                             .dst_blocks = dst,
                             .n_dst_blocks = s->n_dst_blocks,
                             .dst_block_size = s->dst_block_size,
                             .targets = s->targets,
                             .n_targets = s->n_targets,
                             .deadline_ms = (int)ms_until(s->deadline)};
    struct kv_link_order *orders[KV_LINK_MAX_RANKS] = {0};
    struct moe_error err = {0};
    enum moe_status rc = MOE_OK;
    int n_orders = x->o.tp_size < KV_LINK_MAX_RANKS ? x->o.tp_size : KV_LINK_MAX_RANKS;
    int first = x->o.dp_size > 1 ? h->part * x->o.tp_size : 0; /* the senders' first rank */
    for (int r = first ? 0 : 1; r < n_orders && !rc; r++)
        rc = kv_link_order_start(x->o.link, rank_endpoint(x, first + r), &p, &orders[r], &err);
    uint64_t mine = 0;
    if (!rc && first == 0)
        rc = kv_link_push(x->o.link, &p, &mine, &err);
    *bytes += mine;
    for (int r = 0; r < n_orders; r++) {
        if (!orders[r])
            continue;
        uint64_t theirs = 0;
        struct moe_error e = {0};
        enum moe_status orc = kv_link_order_wait(orders[r], &theirs, &e);
        *bytes += theirs;
        if (orc && !rc) {
            rc = orc;
            moe_error_set(&err, orc, "rank %d: %s", first + r, e.msg);
        }
    }
    free(dst);
    /* one slice per (sender, receiver) pair whose heads overlap; latent:
     * one per receiver (kv_link_push) */
    for (int r = 0; r < x->o.tp_size; r++)
        for (int t = 0; t < s->n_targets; t++) {
            struct kv_link_layout lay = {.n_kv_head = x->o.n_kv_head,
                                         .tp_size = x->o.tp_size,
                                         .tp_rank = r,
                                         .latent = x->o.latent};
            int a, b;
            kv_link_layout_heads(&lay, &a, &b);
            if (x->o.latent ? t % x->o.tp_size == r
                            : s->targets[t].head_begin < b && a < s->targets[t].head_end)
                (*slices)++;
        }
    if (rc) {
        snprintf(msg, cap, "%.700s", err.msg);
        return RPC_UNAVAILABLE;
    }
    return RPC_OK;
}

/* The commit: the sequence state to the decode leader, after every slice. */
static enum rpc_code commit(struct sender *s, struct rpc_client *cl, char *msg, size_t cap)
{
    struct handoff *h = s->h;
    uint32_t *tok = malloc((size_t)h->n_tokens * sizeof *tok);
    if (!tok) {
        snprintf(msg, cap, "out of memory");
        return RPC_RESOURCE_EXHAUSTED;
    }
    for (int i = 0; i < h->n_tokens; i++)
        tok[i] = (uint32_t)h->tokens[i];
    Moe__V1__KvTransferChunk ch = MOE__V1__KV_TRANSFER_CHUNK__INIT;
    ch.handoff_id = h->id;
    ch.n_block_ids = (size_t)s->n_dst_blocks;
    ch.block_ids = s->dst_blocks;
    ch.last = true;
    ch.n_token_ids = (size_t)h->n_tokens;
    ch.token_ids = tok;
    ch.n_prompt = (uint32_t)h->n_prompt;
    ch.n_rng_state = 4;
    ch.rng_state = h->rng.s;
    size_t len;
    void *req = rpc_pack(&ch.base, &len);
    free(tok);
    if (!req) {
        snprintf(msg, cap, "out of memory");
        return RPC_RESOURCE_EXHAUSTED;
    }
    int64_t left = ms_until(s->deadline);
    struct rpc_reply r;
    rpc_client_call(cl, "/moe.v1.Worker/KvTransfer", req, len,
                    left < KV_HANDOFF_CALL_TIMEOUT_MS ? left : KV_HANDOFF_CALL_TIMEOUT_MS, &r);
    free(req);
    enum rpc_code code = RPC_OK;
    if (r.code != RPC_OK) {
        code = r.code == RPC_DEADLINE_EXCEEDED ? RPC_DEADLINE_EXCEEDED
               : r.code == RPC_UNAVAILABLE     ? RPC_UNAVAILABLE
                                               : RPC_ABORTED;
        snprintf(msg, cap, "KvTransfer (commit) to %.200s: %s %.200s", s->target,
                 rpc_code_name(r.code), r.message);
    }
    rpc_reply_clear(&r);
    return code;
}

static void *sender_thread(void *arg)
{
    struct sender *s = arg;
    struct kv_handoff *x = s->x;
    struct handoff *h = s->h;
    double t0 = moe_now();
    char msg[800] = "";
    uint64_t bytes = 0;
    uint32_t slices = 0;
    struct moe_error err = {0};
    bool owned = false;
    struct rpc_client *cl = peer_client(x, s->target, &owned, &err);
    enum rpc_code code = RPC_OK;
    if (!cl) {
        code = RPC_UNAVAILABLE;
        snprintf(msg, sizeof msg, "target %.200s: %.300s", s->target, err.msg);
    } else {
        code = push_slices(s, &bytes, &slices, msg, sizeof msg);
        pthread_mutex_lock(&x->mu);
        bool stop = x->stopping || h->release_requested;
        pthread_mutex_unlock(&x->mu);
        if (code == RPC_OK && stop) {
            code = RPC_ABORTED;
            snprintf(msg, sizeof msg, "released or shutting down before the commit");
        }
        if (code == RPC_OK)
            code = commit(s, cl, msg, sizeof msg);
    }
    if (code != RPC_OK && cl) {
        /* Tell the receiver at once (best effort); its ttl covers the rest. */
        Moe__V1__KvTransferChunk ab = MOE__V1__KV_TRANSFER_CHUNK__INIT;
        ab.handoff_id = h->id;
        ab.abort = true;
        ab.error = msg;
        size_t len;
        void *req = rpc_pack(&ab.base, &len);
        struct rpc_reply r;
        if (req)
            rpc_client_call(cl, "/moe.v1.Worker/KvTransfer", req, len, KV_HANDOFF_ABORT_TIMEOUT_MS,
                            &r);
        else
            memset(&r, 0, sizeof r);
        rpc_reply_clear(&r);
        free(req);
    }
    if (owned)
        rpc_client_destroy(cl);
    double ms = 1e3 * (moe_now() - t0);
    char id[KV_HANDOFF_ID_MAX];
    snprintf(id, sizeof id, "%s", h->id);
    pthread_mutex_lock(&x->mu);
    if (code == RPC_OK) {
        x->c.transfers_out++;
        x->c.bytes_out += bytes;
    } else {
        x->c.failures++;
    }
    x->c.send_ms += ms;
    /* either way the prefill side is done with the blocks */
    drop_locked(x, h, code == RPC_OK ? KV_HANDOFF_DONE : KV_HANDOFF_FAILED);
    pthread_mutex_unlock(&x->mu);
    wake(x);
    if (code == RPC_OK) {
        Moe__V1__KvSendResponse resp = MOE__V1__KV_SEND_RESPONSE__INIT;
        resp.handoff_id = id;
        resp.ok = true;
        resp.bytes = bytes;
        resp.transfer_ms = ms;
        resp.chunks = slices;
        finish_msg(s->call, &resp.base);
    } else {
        fprintf(stderr, "moe-worker: handoff %s failed: %s\n", id, msg);
        char full[1000];
        snprintf(full, sizeof full, "handoff %.100s: %s", id, msg);
        rpc_call_finish(s->call, code, full, NULL, 0);
    }
    free(s->dst_blocks);
    free(s->targets);
    free(s);
    pthread_mutex_lock(&x->mu);
    x->n_senders--;
    pthread_cond_broadcast(&x->cond);
    pthread_mutex_unlock(&x->mu);
    return NULL;
}

/* Checks the decode group's description in rq; fills s's targets. */
static enum rpc_code take_targets(struct kv_handoff *x, const Moe__V1__KvSendRequest *rq,
                                  struct sender *s, int n_kv, char *msg, size_t cap)
{
    uint32_t tp = rq->target_tp_size, bs = rq->target_block_size;
    size_t n = rq->n_target_endpoints;
    if (n < 1 || n > KV_LINK_MAX_RANKS || tp < 1 || n % tp ||
        (!x->o.latent && (uint32_t)x->o.n_kv_head % tp)) {
        snprintf(msg, cap,
                 "target_endpoints / target_tp_size: %zu ranks with tp %u cannot hold %d KV "
                 "heads",
                 n, tp, x->o.n_kv_head);
        return RPC_INVALID_ARGUMENT;
    }
    if (bs < 1 || rq->n_block_ids != (size_t)((n_kv + (int)bs - 1) / (int)bs)) {
        snprintf(msg, cap, "block_ids: %zu receiver blocks of %u tokens for %d KV positions",
                 rq->n_block_ids, bs, n_kv);
        return RPC_INVALID_ARGUMENT;
    }
    for (size_t i = 0; i < n; i++)
        if (!rq->target_endpoints[i][0] ||
            strlen(rq->target_endpoints[i]) >= KV_LINK_ENDPOINT_MAX) {
            snprintf(msg, cap, "target_endpoints[%zu]: empty or too long", i);
            return RPC_INVALID_ARGUMENT;
        }
    s->targets = calloc(n, sizeof *s->targets);
    s->dst_blocks = malloc((rq->n_block_ids ? rq->n_block_ids : 1) * sizeof *s->dst_blocks);
    if (!s->targets || !s->dst_blocks) {
        snprintf(msg, cap, "out of memory");
        return RPC_RESOURCE_EXHAUSTED;
    }
    for (size_t i = 0; i < n; i++) {
        snprintf(s->targets[i].endpoint, KV_LINK_ENDPOINT_MAX, "%s", rq->target_endpoints[i]);
        struct kv_link_layout lay = {.n_kv_head = x->o.n_kv_head,
                                     .tp_size = (int)tp,
                                     .tp_rank = (int)(i % tp),
                                     .latent = x->o.latent};
        kv_link_layout_heads(&lay, &s->targets[i].head_begin, &s->targets[i].head_end);
    }
    s->n_targets = (int)n;
    memcpy(s->dst_blocks, rq->block_ids, rq->n_block_ids * sizeof *s->dst_blocks);
    s->n_dst_blocks = (int)rq->n_block_ids;
    s->dst_block_size = (int)bs;
    return RPC_OK;
}

static void handle_send(struct rpc_call *call, const uint8_t *bytes, size_t len, void *user)
{
    struct kv_handoff *x = user;
    char msg[512];
    enum rpc_code code = RPC_OK;
    struct sender *s = NULL;
    Moe__V1__KvSendRequest *rq =
        rpc_call_unpack(call, &moe__v1__kv_send_request__descriptor, bytes, len);
    if (!rq)
        return;
    pthread_mutex_lock(&x->mu);
    struct handoff *h = find_locked(x, rq->handoff_id, true);
    if (x->stopping) {
        code = RPC_UNAVAILABLE;
        snprintf(msg, sizeof msg, "worker is shutting down");
    } else if (!h) {
        code = RPC_NOT_FOUND;
        snprintf(msg, sizeof msg, "handoff_id: '%.100s' is not parked here (expired or released)",
                 rq->handoff_id);
    } else if (h->state != KV_HANDOFF_PREFILLED) {
        code = RPC_FAILED_PRECONDITION;
        snprintf(msg, sizeof msg, "handoff_id: '%.100s' is %s, not PREFILLED", h->id,
                 kv_handoff_state_name(h->state));
    } else if (!rq->target_address[0] || strlen(rq->target_address) >= 300) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg, "target_address: empty or too long");
    } else if (!(s = calloc(1, sizeof *s))) {
        code = RPC_RESOURCE_EXHAUSTED;
        snprintf(msg, sizeof msg, "out of memory");
    } else {
        code = take_targets(x, rq, s, h->n_tokens - 1, msg, sizeof msg);
    }
    if (code) {
        pthread_mutex_unlock(&x->mu);
        if (s) {
            free(s->dst_blocks);
            free(s->targets);
        }
        free(s);
        moe__v1__kv_send_request__free_unpacked(rq, NULL);
        rpc_call_finish(call, code, msg, NULL, 0);
        return;
    }
    s->x = x;
    s->call = call;
    s->h = h;
    snprintf(s->target, sizeof s->target, "%s", rq->target_address);
    int64_t left = rq->deadline_ms ? (int64_t)rq->deadline_ms : KV_HANDOFF_DEFAULT_SEND_MS;
    int64_t call_left = rpc_call_deadline_ms_left(call);
    if (call_left < left)
        left = call_left;
    s->deadline = moe_now() + (double)left / 1e3;
    h->state = KV_HANDOFF_SENDING;
    x->n_senders++;
    pthread_mutex_unlock(&x->mu);
    moe__v1__kv_send_request__free_unpacked(rq, NULL);

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t th;
    int rc = pthread_create(&th, &attr, sender_thread, s);
    pthread_attr_destroy(&attr);
    if (rc) {
        pthread_mutex_lock(&x->mu);
        h->state = KV_HANDOFF_PREFILLED; /* nothing sent: it may be asked again or expire */
        x->n_senders--;
        pthread_cond_broadcast(&x->cond);
        pthread_mutex_unlock(&x->mu);
        free(s->dst_blocks);
        free(s->targets);
        free(s);
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "cannot start a sender thread", NULL, 0);
    }
}

/* ---- KvRelease (either side) -------------------------------------------------------------- */

static void handle_release(struct rpc_call *call, const uint8_t *bytes, size_t len, void *user)
{
    struct kv_handoff *x = user;
    Moe__V1__KvReleaseRequest *rq =
        rpc_call_unpack(call, &moe__v1__kv_release_request__descriptor, bytes, len);
    if (!rq)
        return;
    Moe__V1__KvReleaseResponse resp = MOE__V1__KV_RELEASE_RESPONSE__INIT;
    pthread_mutex_lock(&x->mu);
    for (int side = 0; side < 2; side++) {
        struct handoff *h = find_locked(x, rq->handoff_id, side == 0);
        if (!h)
            continue;
        resp.found = true;
        if (h->state == KV_HANDOFF_SENDING || h->state == KV_HANDOFF_RESERVING ||
            h->state == KV_HANDOFF_RECEIVING) {
            h->release_requested = true; /* its sender / job frees it */
            continue;
        }
        fprintf(stderr, "moe-worker: handoff %s released in state %s (%.200s)\n", h->id,
                kv_handoff_state_name(h->state), rq->reason);
        drop_locked(x, h, KV_HANDOFF_FAILED);
    }
    pthread_mutex_unlock(&x->mu);
    moe__v1__kv_release_request__free_unpacked(rq, NULL);
    wake(x);
    finish_msg(call, &resp.base);
}

enum moe_status kv_handoff_register(struct kv_handoff *x, struct rpc_server *server,
                                    struct moe_error *err)
{
    enum moe_status rc;
    if ((rc = rpc_server_add_unary(server, "/moe.v1.Worker/KvReserve", handle_reserve, x, err)) ||
        (rc = rpc_server_add_unary(server, "/moe.v1.Worker/KvTransfer", handle_transfer, x, err)) ||
        (rc = rpc_server_add_unary(server, "/moe.v1.Worker/KvSend", handle_send, x, err)) ||
        (rc = rpc_server_add_unary(server, "/moe.v1.Worker/KvRelease", handle_release, x, err)))
        return rc;
    return MOE_OK;
}
