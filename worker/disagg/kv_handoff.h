/* The KV handoff of disaggregated serving, on a group leader: the table of
 * handoffs in flight, their state machine with deadlines, and the four
 * moe.v1.Worker RPCs that steer it (KvReserve, KvSend, KvTransfer,
 * KvRelease). The bytes move rank to rank over the KV data plane
 * (kv_link.h): every TP rank of the prefill group sends its own heads to the
 * decode ranks that hold them, re-sliced when the TP or block sizes differ.
 * With data-parallel attention on either side, the group is the DP group
 * whose KV pool part holds the sequence (kv_handoff_opts.dp_size): a decode
 * worker reserves in its emptiest part and answers with that DP group's
 * ranks and block ids, so the sender sees a plain TP group.
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
 * them is running (kv_link_forget), so a late slice never lands in reused blocks.
 *
 * Fault injection (tests): see kv_link_push. */
#ifndef MOE_KV_HANDOFF_H
#define MOE_KV_HANDOFF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "engine/engine.h"
#include "disagg/kv_link.h"
#include "model/model.h"
#include "moe_error.h"
#include "rpc.h"

#define KV_HANDOFF_ID_MAX 200

enum kv_handoff_state {
    /* prefill side */
    KV_HANDOFF_PREFILLED = 1, /* parked, waiting for KvSend */
    KV_HANDOFF_SENDING,       /* pushing chunks */
    KV_HANDOFF_DONE,          /* acknowledged by the receiver; blocks freed */
    KV_HANDOFF_FAILED,        /* gave up (either side); blocks freed */
    KV_HANDOFF_EXPIRED,       /* deadline passed (either side); blocks freed */
    /* decode side */
    KV_HANDOFF_RESERVING, /* the engine is reserving blocks */
    KV_HANDOFF_RESERVED,  /* blocks held, no data yet */
    KV_HANDOFF_RECEIVING, /* some layers written */
    KV_HANDOFF_COMPLETE,  /* every layer and the sequence state arrived */
    KV_HANDOFF_CLAIMED,   /* a Generate took it over */
};

const char *kv_handoff_state_name(enum kv_handoff_state s);

struct kv_handoff_opts {
    struct moe_engine *engine; /* borrowed */
    struct kv_link *link;      /* borrowed: this rank's KV data plane */
    /* the KV endpoints of the group's ranks, by rank (world_size x
     * KV_LINK_ENDPOINT_MAX chars; copied) */
    const char *endpoints;
    int world_size; /* 0 = 1 */
    int tp_size;    /* 0 = 1 */
    /* Data-parallel attention (0 or 1: none): the engine's block pool is
     * dp_size equal parts, part d the KV cache of DP group d (ranks d *
     * tp_size .. + tp_size). A handoff's sequence lives in one part: only
     * that group's ranks send it or receive it, at the part's own block
     * ids. */
    int dp_size;
    int n_kv_head, d_head;
    bool latent;              /* kv_link_layout.latent: one latent row per token on every rank */
    int ttl_ms;               /* lifetime of a parked / reserved handoff; 0 = 30000 */
    void (*wake)(void *user); /* wakes the engine thread (may be NULL) */
    void *wake_user;
    struct moe_tls *tls; /* channels to peer workers over TLS (borrowed); NULL = plaintext */
};

struct kv_handoff_counters {
    uint64_t transfers_out; /* handoffs sent and acknowledged */
    uint64_t transfers_in;  /* handoffs received completely */
    uint64_t bytes_out;
    uint64_t bytes_in;
    double send_ms;    /* time spent in sends */
    uint32_t failures; /* failed, aborted or expired handoffs */
};

/* A completed handoff taken over by a decode request. */
struct kv_handoff_claim {
    uint64_t reservation; /* engine reservation key */
    int n_prompt;
    int n_tokens;
    int32_t *tokens; /* (n_tokens), malloc'd: the caller frees it */
    struct moe_rng rng;
};

struct kv_handoff;

/* Creates an empty table. Returns MOE_OK or MOE_ERR_NOMEM. */
enum moe_status kv_handoff_create(const struct kv_handoff_opts *opts, struct kv_handoff **out,
                                  struct moe_error *err);

/* Registers /moe.v1.Worker/KvReserve, KvTransfer, KvSend and KvRelease. */
enum moe_status kv_handoff_register(struct kv_handoff *x, struct rpc_server *server,
                                    struct moe_error *err);

/* Prefill side, engine thread (from the token callback): the sequence of
 * handoff `id` was parked. Copies what it needs from `ex`. A duplicate id
 * releases the new sequence at once. */
void kv_handoff_on_parked(struct kv_handoff *x, const char *id, const struct moe_seq_export *ex);

/* Decode side: takes over the COMPLETE handoff `id` (the table forgets it;
 * the caller owns out->tokens and the engine reservation). Returns RPC_OK,
 * or NOT_FOUND / FAILED_PRECONDITION with msg set. */
enum rpc_code kv_handoff_claim(struct kv_handoff *x, const char *id, struct kv_handoff_claim *out,
                               char *msg, size_t cap);

/* Expires handoffs whose deadline passed (call often, e.g. from the engine
 * loop). */
void kv_handoff_tick(struct kv_handoff *x);

void kv_handoff_counters(struct kv_handoff *x, struct kv_handoff_counters *out);

/* Makes senders stop at their next chunk (before the server shuts down). */
void kv_handoff_shutdown(struct kv_handoff *x);

/* Waits for the sender and control threads and frees the table (the engine's blocks are
 * not touched: call before destroying the engine, after its thread ended).
 * NULL is a no-op. */
void kv_handoff_destroy(struct kv_handoff *x);

#endif
