/* The KV handoff of disaggregated serving, on a group leader: the table of
 * handoffs in flight, their state machine with deadlines, and the four
 * moe.v1.Worker RPCs that steer it (KvReserve, KvSend, KvTransfer,
 * KvRelease). The bytes move rank to rank over the KV data plane
 * (kv_link.h): every TP rank of the prefill group sends its own heads to the
 * decode ranks that hold them, re-sliced when the TP or block sizes differ.
 *
 * The flow (driven by the coordinator, see coordinator/forward.c):
 *   prefill group P                       decode group D
 *   Generate(prefill_only, H): prompt ->  .
 *   first token, sequence parked          .
 *   [PREFILLED]                           KvReserve(H, n_tokens): [RESERVING]
 *                                         engine reserves, every rank is told
 *                                         to expect H in those blocks
 *                                         -> [RESERVED] (+ rank endpoints)
 *   KvSend(H, D's endpoints, blocks):     .
 *   [SENDING] ranks push their slices --> each rank writes its heads on arrival
 *   all slices acknowledged:              .
 *   KvTransfer(commit, tokens, RNG) ----> [RECEIVING] every rank reports what
 *                                         it got; all rows there -> [COMPLETE]
 *   [DONE] blocks freed, KvSend answered  Generate(H): [CLAIMED] the sequence
 *                                         continues from its first token
 * Failures: a slice that fails or times out makes P send an abort to D (best
 * effort) and free its blocks ([FAILED]); KvSend answers the failure to the
 * coordinator, which releases D (KvRelease) and recomputes there. Every state
 * but SENDING, RESERVING and RECEIVING has a deadline (ttl): when it passes,
 * the handoff is [EXPIRED] and its blocks are freed, so a crashed peer or
 * coordinator never leaks blocks. SENDING is bounded by the send deadline,
 * RESERVING and RECEIVING by the data plane's socket timeouts. Before a
 * decode group frees reserved blocks, every rank confirms that no write into
 * them is running (kvl_forget), so a late slice never lands in reused blocks.
 *
 * Fault injection (tests): see kvl_push. */
#ifndef MOE_KV_TRANSFER_H
#define MOE_KV_TRANSFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "engine/engine.h"
#include "disagg/kv_link.h"
#include "model/model.h"
#include "moe_error.h"
#include "rpc.h"

#define KVX_ID_MAX 200

enum kvx_state {
    /* prefill side */
    KVX_PREFILLED = 1, /* parked, waiting for KvSend */
    KVX_SENDING,       /* pushing chunks */
    KVX_DONE,          /* acknowledged by the receiver; blocks freed */
    KVX_FAILED,        /* gave up (either side); blocks freed */
    KVX_EXPIRED,       /* deadline passed (either side); blocks freed */
    /* decode side */
    KVX_RESERVING, /* the engine is reserving blocks */
    KVX_RESERVED,  /* blocks held, no data yet */
    KVX_RECEIVING, /* some layers written */
    KVX_COMPLETE,  /* every layer and the sequence state arrived */
    KVX_CLAIMED,   /* a Generate took it over */
};

const char *kvx_state_name(enum kvx_state s);

struct kvx_opts {
    struct moe_engine *engine; /* borrowed */
    struct kvl *link;          /* borrowed: this rank's KV data plane */
    /* the KV endpoints of the group's ranks, by rank (world_size x
     * KVL_ENDPOINT_MAX chars; copied) */
    const char *endpoints;
    int world_size; /* 0 = 1 */
    int tp_size;    /* 0 = 1 */
    int n_kv_head, d_head;
    int ttl_ms;               /* lifetime of a parked / reserved handoff; 0 = 30000 */
    void (*wake)(void *user); /* wakes the engine thread (may be NULL) */
    void *wake_user;
};

struct kvx_counters {
    uint64_t transfers_out; /* handoffs sent and acknowledged */
    uint64_t transfers_in;  /* handoffs received completely */
    uint64_t bytes_out;
    uint64_t bytes_in;
    double send_ms;    /* time spent in sends */
    uint32_t failures; /* failed, aborted or expired handoffs */
};

/* A completed handoff taken over by a decode request. */
struct kvx_claim {
    uint64_t reservation; /* engine reservation key */
    int n_prompt;
    int n_tokens;
    int32_t *tokens; /* (n_tokens), malloc'd: the caller frees it */
    struct moe_rng rng;
};

struct kvx;

/* Creates an empty table. Returns MOE_OK or MOE_ERR_NOMEM. */
enum moe_status kvx_create(const struct kvx_opts *opts, struct kvx **out, struct moe_error *err);

/* Registers /moe.v1.Worker/KvReserve, KvTransfer, KvSend and KvRelease. */
enum moe_status kvx_register(struct kvx *x, struct rpc_server *server, struct moe_error *err);

/* Prefill side, engine thread (from the token callback): the sequence of
 * handoff `id` was parked. Copies what it needs from `ex`. A duplicate id
 * releases the new sequence at once. */
void kvx_on_parked(struct kvx *x, const char *id, const struct moe_seq_export *ex);

/* Decode side: takes over the COMPLETE handoff `id` (the table forgets it;
 * the caller owns out->tokens and the engine reservation). Returns RPC_OK,
 * or NOT_FOUND / FAILED_PRECONDITION with msg set. */
enum rpc_code kvx_claim(struct kvx *x, const char *id, struct kvx_claim *out, char *msg,
                        size_t cap);

/* Expires handoffs whose deadline passed (call often, e.g. from the engine
 * loop). */
void kvx_tick(struct kvx *x);

void kvx_counters(struct kvx *x, struct kvx_counters *out);

/* Makes senders stop at their next chunk (before the server shuts down). */
void kvx_shutdown(struct kvx *x);

/* Waits for the sender and control threads and frees the table (the engine's blocks are
 * not touched: call before destroying the engine, after its thread ended).
 * NULL is a no-op. */
void kvx_destroy(struct kvx *x);

#endif
