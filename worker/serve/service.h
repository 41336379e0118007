/* The worker's gRPC face: the internal moe.v1.Worker service (Generate,
 * Abort, GetLoad, GetModelInfo, and the KV handoff RPCs of kv_handoff.h)
 * and grpc.health.v1.Health over one engine, with the engine's step loop on
 * its own thread.
 *
 * Disaggregated serving: Generate with prefill_only + handoff_id runs the
 * prompt, streams the first token (with queue / prefill timings) and ends the
 * stream OK without a finish reason: the sequence is parked for the handoff.
 * Generate with handoff_id alone continues a handed-off sequence (its KV
 * arrived through KvTransfer) and streams the tokens after the first.
 *
 * Handlers only parse, validate and enqueue; tokens flow from the engine
 * thread into each call's send queue, which never blocks on the network. A
 * client that goes away (cancel, deadline, lost connection) aborts its
 * request, and the request's KV blocks are freed in the engine's next step. */
#ifndef MOE_WORKER_SERVICE_H
#define MOE_WORKER_SERVICE_H

#include <stdbool.h>

#include "engine/engine.h"
#include "disagg/kv_link.h"
#include "group/group.h"
#include "model/model.h"
#include "moe_error.h"
#include "tokenizer.h"

struct worker_service_opts {
    const char *listen;     /* "127.0.0.1:0" picks a free port */
    int rpc_threads;        /* completion-queue threads (default 2) */
    const char *model_name; /* reported by GetModelInfo */
    const char *dtype_name; /* "bf16", "f32", "int8" */
    int world_size;         /* ranks in the group (reported by GetLoad; 0 = 1) */
    int tp_size;
    int role;                 /* Moe__V1__WorkerRole (0 = mixed), reported by GetLoad */
    struct moe_backend *be;   /* the KV cache's backend (KV handoff); NULL: no handoff */
    struct kv_link *kv_link;  /* this rank's KV data plane (KV handoff); NULL: no handoff */
    const char *kv_endpoints; /* every rank's KV endpoint (world_size x KV_LINK_ENDPOINT_MAX) */
    int handoff_ttl_ms;       /* lifetime of parked / reserved handoffs (0 = 30000) */
    struct moe_group *group;  /* worker group (placement epoch, per-rank load); NULL: one rank */
    /* TLS (tls_opts.h; borrowed): the gRPC port serves TLS, requiring client
     * certificates from the CA when one is given (mutual TLS); the channels
     * to other workers (KV handoffs) use it too. NULL = plaintext. */
    struct moe_tls *tls;
};

struct worker_service;

/* Starts serving. The service borrows `engine`, `model` and `tok` (tok may be
 * NULL: then only token ids and no stop strings). */
enum moe_status worker_service_create(struct moe_engine *engine, struct moe_model *model,
                                      struct moe_tokenizer *tok,
                                      const struct worker_service_opts *opts,
                                      struct worker_service **out, struct moe_error *err);

int worker_service_port(const struct worker_service *ws);

/* Starts draining: health NOT_SERVING, new Generate calls refused with
 * UNAVAILABLE, running ones continue. Thread-safe, idempotent. */
void worker_service_drain(struct worker_service *ws);

/* Requests in flight (accepted and not finished). Thread-safe. */
int worker_service_in_flight(struct worker_service *ws);

/* For metrics: the KV handoff table (NULL without one) and whether the
 * worker drains. Thread-safe. */
struct kv_handoff *worker_service_kvx(struct worker_service *ws);
bool worker_service_draining(struct worker_service *ws);

/* Stops the engine thread and the server (running calls are cancelled after
 * grace_ms). NULL is a no-op. */
void worker_service_destroy(struct worker_service *ws, int grace_ms);

#endif
