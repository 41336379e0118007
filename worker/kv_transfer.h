/* The KV handoff of disaggregated serving, on one worker: the table of
 * handoffs in flight, their state machine with deadlines, the four
 * moe.v1.Worker RPCs that move KV blocks (KvReserve, KvTransfer, KvSend,
 * KvRelease) and the host copy of blocks between the engine's KV cache and
 * wire chunks.
 *
 * The flow (driven by the coordinator, see coordinator/forward.c):
 *   prefill worker P                      decode worker D
 *   Generate(prefill_only, H): prompt ->  .
 *   first token, sequence parked          .
 *   [PREFILLED]                           KvReserve(H, n_blocks): [RESERVING]
 *                                         -> engine reserves -> [RESERVED]
 *   KvSend(H, D, block ids): [SENDING]    .
 *   KvTransfer chunk (layers a..b) ---->  [RECEIVING] data written to blocks
 *   ... last chunk + tokens + RNG ----->  [COMPLETE]
 *   [DONE] blocks freed, KvSend answered  Generate(H): [CLAIMED] the sequence
 *                                         continues from its first token
 * Failures: a chunk that fails or times out makes P send an abort chunk to D
 * (best effort) and free its blocks ([FAILED]); KvSend answers the failure to
 * the coordinator, which releases D (KvRelease) and recomputes there. Every
 * state but SENDING and RESERVING has a deadline (ttl): when it passes, the
 * handoff is [EXPIRED] and its blocks are freed, so a crashed peer or
 * coordinator never leaks blocks. SENDING is bounded by the send deadline,
 * RESERVING by the engine's next step.
 *
 * Transport: this is the host path (KV staged through host memory, unary
 * gRPC calls, whole layers per chunk). A GPU path would move the same block
 * lists with NCCL send/recv on a per-pair communicator (unique id passed in
 * KvReserve / KvSend), one slice per TP rank; the table and the states stay.
 * Only single-rank workers (tp_size 1) hand off here; a block size, TP size
 * or KV layout mismatch is refused at KvReserve.
 *
 * Fault injection (tests): MOE_FAULT_TRANSFER_DELAY_MS=N sleeps N ms before
 * each chunk a prefill worker sends; MOE_FAULT_DIE_DURING_TRANSFER=1 makes it
 * exit right after its first chunk was acknowledged; MOE_KV_CHUNK_BYTES caps
 * a chunk (default 4 MiB, at least one layer). */
#ifndef MOE_KV_TRANSFER_H
#define MOE_KV_TRANSFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "engine.h"
#include "model.h"
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
    struct moe_backend *be;    /* borrowed: the KV cache's backend */
    int tp_size;               /* 0 = 1 */
    int ttl_ms;                /* lifetime of a parked / reserved handoff; 0 = 30000 */
    void (*wake)(void *user);  /* wakes the engine thread (may be NULL) */
    void *wake_user;
};

struct kvx_counters {
    uint64_t transfers_out; /* handoffs sent and acknowledged */
    uint64_t transfers_in;  /* handoffs received completely */
    uint64_t bytes_out;
    uint64_t bytes_in;
    double send_ms;    /* time spent in sends */
    uint32_t failures; /* failed, aborted or expired handoffs */
    uint32_t pending;  /* handoffs in the table now */
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

/* Waits for the sender threads and frees the table (the engine's blocks are
 * not touched: call before destroying the engine, after its thread ended).
 * NULL is a no-op. */
void kvx_destroy(struct kvx *x);

/* ---- host copies of KV blocks (exposed for tests) ---------------------------------- */

/* Bytes of layers [layer_begin, layer_end) of n_blocks blocks: per layer, K
 * of each block (block_size * kv_dim f32, contiguous) then V of each block. */
size_t kvx_layers_bytes(const struct moe_kv_cache *kv, int n_blocks, int layer_begin,
                        int layer_end);

/* Copies those layers of `blocks` out of the cache into host (to_host) or
 * from host into the cache. */
void kvx_copy_layers(struct moe_backend *be, struct moe_kv_cache *kv, const int32_t *blocks,
                     int n_blocks, int layer_begin, int layer_end, void *host, bool to_host);

#endif
