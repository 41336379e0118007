/* moe-coordinator internals: the cluster view (registry.c), the routing
 * rule (router.c), one forwarded request (forward.c), the public services
 * (frontend.c, admin.c). One mutex, `coord.mu`, guards every mutable field
 * marked "mu" below; it is never held across a network call.
 *
 * Lifetimes: a `struct coord_worker` is reference counted. The registry
 * holds one reference while the worker is a member; every forwarded request
 * holds one while it talks to the worker, so a worker that leaves (etcd key
 * deleted) is freed, channel included, only after its last stream ended. */
#ifndef MOE_COORD_H
#define MOE_COORD_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "metrics.h"
#include "model_config.h"
#include "moe/v1/inference.pb-c.h"
#include "moe_error.h"
#include "auth_token.h"
#include "rpc.h"
#include "tls_opts.h"
#include "tokenizer.h"
#include "clock.h"

#define COORD_ID_MAX 160
#define COORD_ADDR_MAX 300
#define COORD_MAX_RETRIES 2 /* extra attempts when a worker fails before the first token */
#define COORD_AFFINITY_SLOTS 4096
#define COORD_AFFINITY_BLOCKS 4 /* prefix levels hashed: 1..4 blocks */
#define COORD_DEFAULT_BLOCK 16

enum coord_worker_state {
    COORD_WORKER_SERVING = 1,
    COORD_WORKER_DRAINING = 2,
    COORD_WORKER_DOWN = 3,
};

/* Data-parallel attention ranks of a worker the coordinator keeps load for. */
#define COORD_MAX_DP 64

struct coord_worker {
    char id[COORD_ID_MAX];
    char address[COORD_ADDR_MAX];
    int role;                  /* Moe__V1__WorkerRole */
    struct rpc_client *client; /* the channel; freed with the worker */
    int refs;                  /* mu */
    bool member;               /* mu: still in the registry */

    /* mu: state */
    bool admin_drained;     /* Admin DrainWorker */
    bool reported_draining; /* GetLoad.draining (the worker got SIGTERM) */
    bool down;              /* last poll failed, or a call failed with UNAVAILABLE */
    bool ever_seen;         /* one poll answered */
    double last_seen;       /* moe_now() of the last answer; 0: never */
    char last_error[256];

    /* mu: load, from the last GetLoad */
    uint32_t running, waiting, kv_used, kv_total, block_size;
    uint64_t prefix_lookup, prefix_hit;
    uint32_t world_size, tp_size, ep_size;
    uint32_t dp_size; /* data-parallel attention ranks (0 or 1: one KV pool) */
    uint32_t dp_used[COORD_MAX_DP], dp_running[COORD_MAX_DP];
    uint64_t kv_out, kv_in, kv_bytes; /* KV handoffs (disaggregated serving) */
    uint32_t kv_failures;
    uint64_t spec_draft, spec_accepted; /* speculative decoding */
    /* mu: the coordinator's own counters */
    int in_flight;     /* forwarded requests running on it now */
    uint64_t n_routed; /* requests ever routed to it */
    /* Progress, for the stall watchdog (forward.c): moe_now_ms() of the last
     * sign that its engine works (a message on any of its streams, or a
     * GetLoad whose step count moved). Atomic: written per message. */
    _Atomic int64_t progress_ms;
    uint64_t last_steps; /* mu: engine steps of the last GetLoad */
};

/* One entry of the prefix-affinity table (direct mapped by hash). */
struct coord_affinity {
    uint64_t hash;
    char worker_id[COORD_ID_MAX];
};

struct coord_opts {
    const char *listen;
    const char *http_listen;   /* OpenAI HTTP API + /metrics (NULL: off) */
    const char *chat_template; /* --chat-template FILE (NULL: the checkpoint's) */
    int http_threads;
    size_t http_max_body;
    int http_timeout_s;
    const char *model_dir;
    const char *workers; /* static list "host:port,host:port" (or NULL) */
    const char *etcd;    /* etcd endpoints (or NULL) */
    int max_queue;       /* requests in flight cap */
    int poll_ms;         /* GetLoad polling interval */
    int rpc_threads;
    int grace_ms;         /* shutdown grace for running streams */
    int expert_slots;     /* experts a rank may hold per layer; 0: 2 * ceil(n_expert / n_rank) */
    int stall_timeout_ms; /* a worker stream with no message this long, from a worker that
                             made no progress as long, is ended (0: never) */
    /* security (tls_opts.h, auth_token.h): NULL = off */
    struct moe_tls *tls;             /* every port, and the channels to workers */
    struct moe_tokens *api_tokens;   /* --api-token-file: Inference and the HTTP API */
    struct moe_tokens *admin_tokens; /* --admin-token-file: Admin */
};

struct fwd;
struct coord_placement;
struct coord_metrics;
struct coord_http;

struct coord {
    struct coord_opts opts;
    struct moe_config cfg;
    struct moe_tokenizer *tok;
    char model_name[256];
    char model_dtype[16]; /* mu: from the first worker's GetModelInfo */
    double t_start;

    struct rpc_server *server;
    struct coord_http *http;       /* http_api.c (NULL: no --http-listen) */
    struct coord_metrics *metrics; /* metrics.c; never NULL after start-up */

    pthread_mutex_t mu;
    pthread_cond_t cond;           /* signalled when n_threads drops, and to stop the poller */
    bool stopping;                 /* mu */
    struct coord_worker **workers; /* mu: members, (n_workers) */
    size_t n_workers, cap_workers;
    uint64_t rr;                     /* mu: round-robin cursor for ties */
    struct coord_affinity *affinity; /* mu: (COORD_AFFINITY_SLOTS) */

    struct fwd *reqs;                         /* mu: running requests (linked through fwd->next) */
    int n_running;                            /* mu */
    int n_threads;                            /* mu: live forwarding threads */
    uint64_t n_total, n_failed, next_auto_id; /* mu */

    pthread_t poll_thread;
    bool poll_started;
    pthread_t watchdog_thread; /* forward.c: the stall watchdog */
    bool watchdog_started;
    struct moe_etcd_watch *watch;
    struct coord_placement *placement; /* placement_admin.c; its own lock */
};

/* ---- registry.c -------------------------------------------------------------- */

/* Adds the workers of a static list "host:port,host:port" (id = the entry).
 * A malformed entry is MOE_ERR_INVALID naming it. */
enum moe_status coord_registry_add_static(struct coord *c, const char *list, struct moe_error *err);

/* Reads /moe/workers/ from etcd and starts watching it. */
enum moe_status coord_registry_start_etcd(struct coord *c, struct moe_error *err);

/* Starts the GetLoad polling thread. */
enum moe_status coord_registry_start_poller(struct coord *c, struct moe_error *err);

/* Stops the watcher and the poller and drops every member (workers still
 * referenced by requests are freed with their last reference). */
void coord_registry_stop(struct coord *c);

/* Adds or updates a member (etcd PUT). Caller holds no lock. */
enum moe_status coord_registry_upsert(struct coord *c, const char *id, const char *address,
                                      int role, struct moe_error *err);

/* Removes a member by id (etcd DELETE); 0 if there was none. */
int coord_registry_remove(struct coord *c, const char *id);

/* Finds a member by id; caller holds c->mu. NULL if none. */
struct coord_worker *coord_registry_find_locked(struct coord *c, const char *id);

/* Reference counting; caller holds c->mu. */
void coord_worker_ref_locked(struct coord_worker *w);
void coord_worker_unref_locked(struct coord_worker *w);

/* The state shown by Admin; caller holds c->mu. */
enum coord_worker_state coord_worker_state_locked(const struct coord_worker *w);

/* ---- router.c ------------------------------------------------------------------ */

/* Picks a worker for a prompt and returns it with one reference held and
 * its in_flight count raised (undo both with coord_router_done), or NULL
 * when no worker is serving. Workers in `exclude` (n_exclude) are skipped
 * (the ones a retry already tried). Takes c->mu. */
struct coord_worker *coord_router_pick(struct coord *c, const int32_t *ids, size_t n_ids,
                                       struct coord_worker *const *exclude, size_t n_exclude);

/* As coord_router_pick among the workers of one role (Moe__V1__WorkerRole;
 * 0: mixed and decode workers, i.e. any that decodes; a prefill worker only
 * if no other is serving). With need_tokens > 0 only workers with free KV
 * blocks for that many tokens (in their own block size) qualify (a decode
 * worker able to take a handoff: block and TP sizes may differ from the
 * sender's, the KV data plane re-slices); they are picked by load alone. */
struct coord_worker *coord_router_pick_role(struct coord *c, int role, const int32_t *ids,
                                            size_t n_ids, struct coord_worker *const *exclude,
                                            size_t n_exclude, uint32_t need_tokens);

/* The request routed by coord_router_pick ended. Takes c->mu. */
void coord_router_done(struct coord *c, struct coord_worker *w);

/* The load score used by the router; caller holds c->mu. */
double coord_worker_load_locked(const struct coord_worker *w);

/* ---- forward.c ------------------------------------------------------------------- */

/* Where a forwarded request's output goes: the gRPC stream (forward.c) or an
 * HTTP response (openai.c). The one path that validates, tokenizes, routes
 * and relays a request (coord_request_start) talks to its client only
 * through these, so gRPC and HTTP requests are handled alike. */
struct coord_sink {
    /* Called once, before any other call and before coord_request_start
     * returns: from now on coord_request_cancel(f) may be called (client
     * gone) until finish returns. */
    void (*attach)(void *user, struct fwd *f);
    /* One message for the client: tokens (text deltas when stream_text),
     * logprobs; the last one has finish_reason, usage and timings. Borrowed
     * for the call. Returns false once the client is gone. Called from the
     * forwarding thread, one call at a time. */
    bool (*send)(void *user, const Moe__V1__GenerateResponse *m);
    /* The end, exactly once, last: RPC_OK after the message with the finish
     * reason (or an Abort's), else an error code and a one-line message
     * naming the field or the failure. The handle f is invalid afterwards. */
    void (*finish)(void *user, enum rpc_code code, const char *msg);
};

/* Validates `rq` (owned from here on, also on failure), then forwards it on
 * a thread of its own: tokenizes a text prompt, checks the lengths, routes
 * (prefix affinity, disaggregated prefill / decode), retries a worker that
 * fails before the first token and relays the worker's messages to `sink`.
 * deadline_ms_left: the client's deadline (INT64_MAX: none; rq->deadline_ms
 * applies too). Returns RPC_OK when started (sink gets attach, sends, one
 * finish), or the code of a refusal with `msg` set ("field: why") and no
 * call on the sink: INVALID_ARGUMENT, NOT_FOUND (model), ALREADY_EXISTS
 * (request_id) or RESOURCE_EXHAUSTED (--max-queue). Failures found later
 * (prompt length, no worker serving) arrive through finish, before any
 * send. */
enum rpc_code coord_request_start(struct coord *c, Moe__V1__GenerateRequest *rq,
                                  int64_t deadline_ms_left, const struct coord_sink *sink,
                                  void *sink_user, char *msg, size_t cap);

/* The client went away: cancels the worker call (the worker frees the KV
 * blocks) and ends the request with RPC_CANCELLED. Only between attach and
 * the end of finish. */
void coord_request_cancel(struct fwd *f);

/* The gRPC Generate: parses the request bytes (borrowed) and calls
 * coord_request_start with a sink over `stream`. Takes ownership of the
 * stream reference: it always finishes and releases the stream. */
void coord_generate_start(struct coord *c, struct rpc_stream *stream, const uint8_t *req,
                          size_t len);

/* Aborts the running request `request_id`; 1 if one was found. */
int coord_abort(struct coord *c, const char *request_id);

/* Waits until every forwarding thread has ended. */
void coord_wait_threads(struct coord *c);

/* The stall watchdog (--stall-timeout-ms): a thread that ends the worker
 * call of any request whose worker stream brought no message for the
 * timeout while that worker showed no progress either (a SIGSTOPped or
 * hung process). Before the first message the request is retried on
 * another worker; after it, the request ends UNAVAILABLE naming the worker
 * and the stall. The worker is marked DOWN until a poll answers again.
 * No-op when stall_timeout_ms is 0. Stop before coord_registry_stop. */
enum moe_status coord_watchdog_start(struct coord *c, struct moe_error *err);
void coord_watchdog_stop(struct coord *c);

/* ---- frontend.c / admin.c -------------------------------------------------------- */

/* Registers the Inference and Health methods. */
enum moe_status coord_frontend_register(struct coord *c, struct moe_error *err);

/* Registers the Admin methods. */
enum moe_status coord_admin_register(struct coord *c, struct moe_error *err);

/* ---- metrics.c: the coordinator's Prometheus series --------------------------------- */

/* Creates the registry (constant label model_name) with the request-level
 * vLLM series and the cluster collector. NULL on no memory. */
struct coord_metrics *coord_metrics_create(struct coord *c);
void coord_metrics_destroy(struct coord_metrics *m);
struct moe_metrics *coord_metrics_registry(struct coord_metrics *m);

/* One line where each thing happens (forward.c); NULL m is a no-op. */
/* Tokens relayed: the first ones of a request (seconds since receipt:
 * TTFT) or later ones (seconds since the previous: inter-token latency). */
void coord_metrics_token(struct coord_metrics *m, bool first, double seconds);
/* The last message of a request (finish reason, usage, timings). */
void coord_metrics_final(struct coord_metrics *m, const Moe__V1__GenerateResponse *last);
/* A request that ended with a status other than OK (CANCELLED: the client
 * went away, also counted as finished_reason "abort"). */
void coord_metrics_failed(struct coord_metrics *m, enum rpc_code code);
/* A KV handoff: failure `reason`, or NULL for a transfer that took seconds. */
void coord_metrics_handoff(struct coord_metrics *m, const char *reason, double seconds);
/* An HTTP request answered (http_api.c, openai.c). */
void coord_metrics_http(struct coord_metrics *m, const char *path, int status);

/* ---- http_api.c / openai.c: the OpenAI-compatible HTTP API ------------------------ */

/* Starts the HTTP server on opts.http_listen (routes of http_api.c and
 * openai.c, and /metrics). */
enum moe_status coord_http_start(struct coord *c, struct moe_error *err);
int coord_http_port(struct coord *c);
/* Stops accepting HTTP connections (shutdown begins). */
void coord_http_quiesce(struct coord *c);
/* Stops it: running requests get grace_ms, then are cancelled. */
void coord_http_stop(struct coord *c, int grace_ms);

/* ---- placement_admin.c ------------------------------------------------------------ */

/* Creates the placement store (etcd key /moe/placement/<model> with --etcd,
 * else in memory), starts the expert-statistics poller and registers the
 * Admin placement methods (before rpc_server_start). */
enum moe_status coord_placement_start(struct coord *c, struct moe_error *err);

/* Stops the poller and frees the store. No-op if never started. */
void coord_placement_stop(struct coord *c);

/* The current placement epoch as last read (0: the default placement). */
uint64_t coord_placement_epoch(struct coord *c);

#endif
