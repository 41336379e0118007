/* The KV data plane of disaggregated serving: one endpoint per rank.
 *
 * Every rank of a prefill or decode group listens on its own TCP port and
 * moves its own slice of the KV cache (the KV heads of its tensor-parallel
 * rank) straight to the ranks of the other group that hold those heads. The
 * group leaders only steer (moe.v1.Worker KvReserve / KvSend / KvTransfer,
 * see kv_handoff.h); no KV byte passes through a leader that does not own it.
 *
 *   prefill rank i (heads [a, b))  --SLICE-->  decode rank j (heads [c, d)):
 *                                              the overlap of [a, b) and [c, d)
 *
 * A slice is token-major (per layer: K then V, each n_tokens x heads x d_head
 * elements of the caches' dtype, F32 or BF16), so the two sides may use
 * different TP sizes (heads are re-sliced by overlap) and different block
 * sizes (the receiver places tokens into its own blocks); the dtypes must be
 * the same (a mismatch is refused by name before a byte moves). Messages on a connection (one
 * request, one STATUS answer): EXPECT  decode leader -> its ranks: blocks B are reserved for
 * handoff H (a rank writes only into blocks expected for that handoff); FORGET  decode leader ->
 * its ranks: drop H once no write is running, answering the bytes written and whether every row
 * arrived; ORDER   prefill leader -> its ranks: push your slice of H to these targets; SLICE   any
 * rank -> a decode rank: the data, written on arrival (no engine step boundary is waited for: the
 * reserved blocks belong to no running sequence). A slice for an unknown, expired or differently
 * shaped handoff is refused before a byte of it is written. Every socket operation has a timeout,
 * so a dead or stuck peer fails the handoff instead of hanging it.
 *
 * Payloads: over the same TCP connection through host memory (the host path,
 * and the fallback), or between GPUs over NCCL (kv_link_opts.nccl: staged in a
 * device buffer, sent on a two-rank communicator per rank pair whose unique
 * id travels in the pair's first SLICE header). UNVERIFIED: no machine with
 * two GPUs has run the NCCL payload path yet. */
#ifndef MOE_KV_LINK_H
#define MOE_KV_LINK_H

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "comm/comm.h"
#include "kv/kv_cache.h"
#include "moe_error.h"

#define KV_LINK_ENDPOINT_MAX 128
#define KV_LINK_ID_MAX 200
#define KV_LINK_MAX_RANKS 256 /* ranks of a group */

/* Which KV heads a rank holds: [tp_rank, tp_rank + 1) * n_kv_head / tp_size;
 * with `latent` (multi-head latent attention: one row per token, K and V at
 * once, the same on every rank: n_kv_head 1, d_head its width) all of them.
 * A latent slice is that one plane per layer, and each rank of the other
 * group gets it from one sender only: decode rank i from prefill TP rank
 * i % tp_size. */
struct kv_link_layout {
    int n_layer, n_kv_head, d_head; /* the model's */
    int tp_size, tp_rank;
    bool latent;
};

struct kv_link_opts {
    struct moe_backend *be; /* borrowed: the KV cache's backend */
    /* host:port to listen on; port 0 picks a free one. The advertised
     * endpoint uses advertise_host (NULL: the listen host; 0.0.0.0 or an
     * empty host: this machine's name). */
    const char *listen;
    const char *advertise_host;
    struct kv_link_layout layout;
    int io_timeout_ms; /* per socket operation; 0 = 5000 */
    /* The device path: with a CUDA cache, slice payloads go device to device
     * over NCCL (a two-rank communicator per rank pair, made on the pair's
     * first slice from a unique id the sender passes in the SLICE header);
     * the messages stay on the socket. A peer without it, or a pair whose
     * communicator cannot connect, uses the socket. */
    bool nccl;
    int device; /* CUDA device ordinal of the cache */
    /* TLS on every connection (tls_opts.h; borrowed, outlives the link):
     * this rank serves with its certificate and, when a CA is given,
     * requires peers to present one from it (mutual TLS); it connects to
     * peers verifying theirs. Only the messages' sockets: a NCCL payload
     * (the device path) is not encrypted. NULL = plaintext. */
    struct moe_tls *tls;
};

struct kv_link;

enum moe_status kv_link_create(const struct kv_link_opts *o, struct kv_link **out,
                               struct moe_error *err);

/* "host:port" where the other ranks reach this one. */
const char *kv_link_endpoint(const struct kv_link *l);

/* The cache this rank serves. Slices are refused until it is set. */
void kv_link_attach_kv(struct kv_link *l, struct moe_kv_cache *kv);

/* Stops listening and waits for the connections being served. NULL: no-op. */
void kv_link_destroy(struct kv_link *l);

/* Heads [*begin, *end) of TP rank `tp_rank` of `tp_size`. */
void kv_link_heads(int n_kv_head, int tp_size, int tp_rank, int *begin, int *end);
/* The same for a layout (latent: every head on every rank). */
void kv_link_layout_heads(const struct kv_link_layout *lay, int *begin, int *end);

/* ---- decode side ------------------------------------------------------------------- */

/* Lets slices of handoff `id` (n_tokens KV positions) into `blocks` of this
 * rank for ttl_ms. `endpoint` NULL: this process's link `l`; else the remote
 * rank there. */
enum moe_status kv_link_expect(struct kv_link *l, const char *endpoint, const char *id,
                               const int32_t *blocks, int n_blocks, int n_tokens, int ttl_ms,
                               struct moe_error *err);

/* Drops handoff `id` after any write into it ended. *bytes: bytes written;
 * *complete: every row of every layer of this rank's heads arrived. An
 * unknown id answers 0 bytes, not complete. */
enum moe_status kv_link_forget(struct kv_link *l, const char *endpoint, const char *id,
                               uint64_t *bytes, bool *complete, struct moe_error *err);

/* ---- prefill side ------------------------------------------------------------------- */

struct kv_link_target { /* one rank of the decode group */
    char endpoint[KV_LINK_ENDPOINT_MAX];
    int head_begin, head_end;
};

struct kv_link_push {
    const char *id;
    const int32_t *src_blocks; /* the sequence's blocks in the sender's cache */
    int n_src_blocks;
    int n_tokens;              /* KV positions to move */
    const int32_t *dst_blocks; /* reserved on the decode group (same ids on its ranks) */
    int n_dst_blocks;
    int dst_block_size;
    const struct kv_link_target *targets;
    int n_targets;
    int deadline_ms; /* the whole push */
};

/* Pushes this rank's slice to every target whose heads overlap it; returns
 * the payload bytes sent. Fault injection (tests only: armed by
 * MOE_TEST_FAULTS=1, see test_fault.h): MOE_FAULT_TRANSFER_DELAY_MS sleeps
 * before each layer; MOE_FAULT_DIE_DURING_TRANSFER exits after the first
 * layer went out. */
enum moe_status kv_link_push(struct kv_link *l, const struct kv_link_push *p, uint64_t *bytes,
                             struct moe_error *err);

/* Asks the rank at `endpoint` to run kv_link_push(p) there: started at once on a
 * thread of this process, collected by kv_link_order_wait (which frees it). */
struct kv_link_order;
enum moe_status kv_link_order_start(struct kv_link *l, const char *endpoint,
                                    const struct kv_link_push *p, struct kv_link_order **out,
                                    struct moe_error *err);
enum moe_status kv_link_order_wait(struct kv_link_order *o, uint64_t *bytes, struct moe_error *err);

/* ---- the wire, as pure functions (the server and the clients above decode
 * every message through these; tests/fuzz/fuzz_kv_link.c feeds them bytes) ---- */

/* A message is a head of three host-order 32-bit words {magic "MOEK", type,
 * body length <= KV_LINK_MAX_BODY} and a body of 32/64-bit words, int32 arrays
 * (count, then items) and strings (length, then bytes, no NUL). */
#define KV_LINK_HEAD_BYTES 12
#define KV_LINK_MAX_BODY (1u << 24)
#define KV_LINK_MAX_BLOCKS (1 << 22) /* per block list */

enum kv_link_msg_type {
    KV_LINK_MSG_EXPECT = 1, /* id, n_tokens, ttl_ms, blocks */
    KV_LINK_MSG_FORGET,     /* id */
    KV_LINK_MSG_ORDER,      /* id, n_tokens, deadline_ms, src_blocks, dst_block_size, blocks,
                           n_targets x {endpoint, head_begin, head_end} */
    KV_LINK_MSG_SLICE,      /* id, n_layer, d_head, head_begin, head_end, n_tokens,
                           dst_block_size, blocks, transport, init, nccl_id, sender */
    KV_LINK_MSG_STATUS,     /* status, value, flag, msg */
};

/* One decoded message: the fields its type carries (see above), the rest
 * zero. `blocks` is the reservation of an EXPECT and the destination blocks
 * of an ORDER or a SLICE. Arrays are malloc'd: kv_link_msg_clear frees them. */
struct kv_link_msg {
    uint32_t type;
    char id[KV_LINK_ID_MAX];
    int n_tokens, ttl_ms, deadline_ms, dst_block_size;
    int32_t *blocks; /* (n_blocks) */
    int n_blocks;
    int32_t *src_blocks; /* (n_src_blocks) */
    int n_src_blocks;
    struct kv_link_target *targets; /* (n_targets), 1..KV_LINK_MAX_RANKS of them */
    int n_targets;
    int n_layer, d_head, head_begin, head_end;
    int kv_dtype;  /* SLICE: the payload's element type (enum moe_dtype: F32 or BF16) */
    int transport; /* SLICE: 1 = the payload goes over NCCL */
    int init;      /* SLICE: the first slice of the pair: make the communicator */
    struct moe_comm_nccl_id nccl_id;
    char sender[KV_LINK_ENDPOINT_MAX];
    int32_t status; /* STATUS: an enum moe_status */
    uint64_t value;
    bool flag;
    char msg[MOE_ERROR_MSG_MAX];
};

/* Checks a head (KV_LINK_HEAD_BYTES at `head`): the magic and the body length.
 * MOE_ERR_INVALID naming both when it is not a KV link message. */
enum moe_status kv_link_head_parse(const uint8_t *head, uint32_t *type, uint32_t *body_len,
                                   struct moe_error *err);

/* Decodes the body of a message of `type` (`len` bytes at `body`) into *m.
 * An unknown type, a body that ends inside a field, a length or count out
 * of range is MOE_ERR_INVALID "malformed SLICE: 'sender' ..." naming the
 * field; *m is then cleared. Bytes after the last field are ignored. */
enum moe_status kv_link_msg_parse(uint32_t type, const uint8_t *body, size_t len,
                                  struct kv_link_msg *m, struct moe_error *err);

/* Frees the arrays of *m and zeroes it. NULL is a no-op. */
void kv_link_msg_clear(struct kv_link_msg *m);

#endif
