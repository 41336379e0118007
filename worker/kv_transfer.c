/* The KV handoff table and its RPCs. See kv_transfer.h for the protocol.
 *
 * Locking: x->mu guards the table, the counters and every handoff field.
 * Writes into reserved blocks happen under x->mu (a release or expiry can
 * then never free blocks being written); reads of a parked sequence's
 * blocks happen in its sender thread without the lock: while a handoff is
 * SENDING only its sender may free it (a release just asks it to stop).
 * Engine calls made here only queue work (abort, reserve, unreserve), so
 * they are safe under x->mu, also from the engine thread. */
#include "kv_transfer.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "generate.h"
#include "moe/v1/worker.pb-c.h"

#define KVX_DEFAULT_TTL_MS 30000
#define KVX_DEFAULT_SEND_MS 10000
#define KVX_CALL_TIMEOUT_MS 5000
#define KVX_ABORT_TIMEOUT_MS 500
#define KVX_DEFAULT_CHUNK ((size_t)16 << 20) /* well under the 64 MiB message limit */
#define KVX_MAX_PEERS 32

struct handoff {
    char id[KVX_ID_MAX];
    enum kvx_state state;
    bool prefill;           /* the sending side */
    double deadline;        /* moe_now() seconds */
    bool release_requested; /* SENDING / RESERVING: stop and free when you can */
    /* prefill side: the parked sequence */
    uint64_t req_id;
    int n_prompt, n_tokens;
    int32_t *tokens; /* (n_tokens) */
    struct moe_rng rng;
    /* both: block ids in this worker's cache (decode side: once reserved) */
    int32_t *blocks; /* (n_blocks) */
    int n_blocks;
    /* decode side */
    uint64_t key;             /* engine reservation */
    struct rpc_call *pending; /* KvReserve waiting for the engine */
    int next_layer;
    uint64_t bytes;
    struct handoff *next;
};

struct kvx {
    struct kvx_opts o;
    struct moe_kv_cache *kv;
    int block_size;
    size_t chunk_limit;
    int fault_delay_ms;
    bool fault_die;

    pthread_mutex_t mu;
    pthread_cond_t cond; /* n_senders dropped */
    struct handoff *list;
    uint64_t next_key;
    int n_senders;
    bool stopping;
    struct kvx_counters c;
    /* One channel per decode worker, reused by every handoff to it (a new
     * connection per handoff cost more than the data on small prompts). */
    struct {
        char target[300];
        struct rpc_client *cl;
    } peers[KVX_MAX_PEERS];
    int n_peers;
};

/* The cached channel to `target`, or a new one; *owned tells whether the
 * caller must destroy it (only when the cache is full). */
static struct rpc_client *peer_client(struct kvx *x, const char *target, bool *owned,
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
    struct rpc_client *cl = rpc_client_create(target, NULL, err);
    if (cl && x->n_peers < KVX_MAX_PEERS) {
        snprintf(x->peers[x->n_peers].target, sizeof x->peers[0].target, "%s", target);
        x->peers[x->n_peers++].cl = cl;
    } else if (cl) {
        *owned = true;
    }
    pthread_mutex_unlock(&x->mu);
    return cl;
}

const char *kvx_state_name(enum kvx_state s)
{
    switch (s) {
    case KVX_PREFILLED: return "PREFILLED";
    case KVX_SENDING: return "SENDING";
    case KVX_DONE: return "DONE";
    case KVX_FAILED: return "FAILED";
    case KVX_EXPIRED: return "EXPIRED";
    case KVX_RESERVING: return "RESERVING";
    case KVX_RESERVED: return "RESERVED";
    case KVX_RECEIVING: return "RECEIVING";
    case KVX_COMPLETE: return "COMPLETE";
    case KVX_CLAIMED: return "CLAIMED";
    }
    return "?";
}

/* ---- host copies ---------------------------------------------------------------- */

size_t kvx_layers_bytes(const struct moe_kv_cache *kv, int n_blocks, int layer_begin, int layer_end)
{
    return (size_t)(layer_end - layer_begin) * 2 * (size_t)n_blocks * (size_t)kv->block_size *
           (size_t)kv->kv_dim * sizeof(float);
}

void kvx_copy_layers(struct moe_backend *be, struct moe_kv_cache *kv, const int32_t *blocks,
                     int n_blocks, int layer_begin, int layer_end, void *host, bool to_host)
{
    size_t blk = (size_t)kv->block_size * (size_t)kv->kv_dim * sizeof(float);
    uint8_t *p = host;
    for (int l = layer_begin; l < layer_end; l++)
        for (int kind = 0; kind < 2; kind++) {
            uint8_t *base = (uint8_t *)(kind ? kv->v[l] : kv->k[l]);
            for (int b = 0; b < n_blocks; b++, p += blk) {
                uint8_t *slot = base + (size_t)blocks[b] * blk;
                if (to_host)
                    be->ops->buf_download(be, p, slot, blk);
                else
                    be->ops->buf_upload(be, slot, p, blk);
            }
        }
    if (!to_host)
        be->ops->synchronize(be);
}

/* ---- table ------------------------------------------------------------------------ */

static void *pack_msg(const ProtobufCMessage *msg, size_t *len)
{
    *len = protobuf_c_message_get_packed_size(msg);
    uint8_t *buf = malloc(*len ? *len : 1);
    if (buf)
        protobuf_c_message_pack(msg, buf);
    return buf;
}

static void finish_msg(struct rpc_call *call, const ProtobufCMessage *msg)
{
    size_t n;
    void *out = pack_msg(msg, &n);
    rpc_call_finish(call, out ? RPC_OK : RPC_RESOURCE_EXHAUSTED, out ? NULL : "out of memory", out,
                    n);
    free(out);
}

static void wake(struct kvx *x)
{
    if (x->o.wake)
        x->o.wake(x->o.wake_user);
}

static struct handoff *find_locked(struct kvx *x, const char *id, bool prefill)
{
    for (struct handoff *h = x->list; h; h = h->next)
        if (h->prefill == prefill && !strcmp(h->id, id))
            return h;
    return NULL;
}

static struct handoff *find_key_locked(struct kvx *x, uint64_t key)
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
static void remove_locked(struct kvx *x, struct handoff *h)
{
    for (struct handoff **p = &x->list; *p; p = &(*p)->next)
        if (*p == h) {
            *p = h->next;
            break;
        }
    x->c.pending--;
    handoff_free(h);
}

static void push_locked(struct kvx *x, struct handoff *h)
{
    h->next = x->list;
    x->list = h;
    x->c.pending++;
}

/* Frees the engine side of a handoff: the parked sequence or the reservation. */
static void release_engine(struct kvx *x, const struct handoff *h)
{
    if (h->prefill)
        moe_engine_abort(x->o.engine, h->req_id);
    else
        moe_engine_unreserve(x->o.engine, h->key);
}

enum moe_status kvx_create(const struct kvx_opts *opts, struct kvx **out, struct moe_error *err)
{
    *out = NULL;
    struct kvx *x = calloc(1, sizeof *x);
    if (!x)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    x->o = *opts;
    if (x->o.tp_size <= 0)
        x->o.tp_size = 1;
    if (x->o.ttl_ms <= 0)
        x->o.ttl_ms = KVX_DEFAULT_TTL_MS;
    x->kv = moe_engine_kv_cache(opts->engine);
    x->block_size = moe_engine_block_size(opts->engine);
    x->next_key = 1;
    x->chunk_limit = KVX_DEFAULT_CHUNK;
    const char *v = getenv("MOE_KV_CHUNK_BYTES");
    if (v && atol(v) > 0)
        x->chunk_limit = (size_t)atol(v);
    v = getenv("MOE_FAULT_TRANSFER_DELAY_MS");
    if (v && atoi(v) > 0)
        x->fault_delay_ms = atoi(v);
    v = getenv("MOE_FAULT_DIE_DURING_TRANSFER");
    x->fault_die = v && atoi(v) > 0;
    pthread_mutex_init(&x->mu, NULL);
    pthread_cond_init(&x->cond, NULL);
    *out = x;
    return MOE_OK;
}

void kvx_shutdown(struct kvx *x)
{
    if (!x)
        return;
    pthread_mutex_lock(&x->mu);
    x->stopping = true;
    pthread_mutex_unlock(&x->mu);
}

void kvx_destroy(struct kvx *x)
{
    if (!x)
        return;
    pthread_mutex_lock(&x->mu);
    x->stopping = true;
    while (x->n_senders > 0)
        pthread_cond_wait(&x->cond, &x->mu);
    while (x->list) {
        struct handoff *h = x->list;
        x->list = h->next;
        handoff_free(h); /* a pending call was answered before the server went away */
    }
    pthread_mutex_unlock(&x->mu);
    for (int i = 0; i < x->n_peers; i++)
        rpc_client_destroy(x->peers[i].cl);
    pthread_mutex_destroy(&x->mu);
    pthread_cond_destroy(&x->cond);
    free(x);
}

void kvx_counters(struct kvx *x, struct kvx_counters *out)
{
    pthread_mutex_lock(&x->mu);
    *out = x->c;
    pthread_mutex_unlock(&x->mu);
}

void kvx_on_parked(struct kvx *x, const char *id, const struct moe_seq_export *ex)
{
    struct handoff *h = calloc(1, sizeof *h);
    if (h) {
        h->tokens = malloc((size_t)ex->n_tokens * sizeof *h->tokens);
        h->blocks = malloc((size_t)(ex->n_blocks ? ex->n_blocks : 1) * sizeof *h->blocks);
    }
    pthread_mutex_lock(&x->mu);
    if (!h || !h->tokens || !h->blocks || find_locked(x, id, true) || strlen(id) >= KVX_ID_MAX) {
        pthread_mutex_unlock(&x->mu);
        fprintf(stderr, "moe-worker: handoff '%.100s': %s; its blocks are freed\n", id,
                h && h->tokens && h->blocks ? "duplicate or too long id" : "out of memory");
        moe_engine_abort(x->o.engine, ex->req_id);
        handoff_free(h);
        return;
    }
    snprintf(h->id, sizeof h->id, "%s", id);
    h->prefill = true;
    h->state = KVX_PREFILLED;
    h->deadline = moe_now() + x->o.ttl_ms / 1e3;
    h->req_id = ex->req_id;
    h->n_prompt = ex->n_prompt;
    h->n_tokens = ex->n_tokens;
    memcpy(h->tokens, ex->tokens, (size_t)ex->n_tokens * sizeof *h->tokens);
    h->n_blocks = ex->n_blocks;
    if (ex->n_blocks)
        memcpy(h->blocks, ex->blocks, (size_t)ex->n_blocks * sizeof *h->blocks);
    h->rng = ex->rng;
    push_locked(x, h);
    pthread_mutex_unlock(&x->mu);
}

void kvx_tick(struct kvx *x)
{
    double now = moe_now();
    bool woke = false;
    pthread_mutex_lock(&x->mu);
    for (struct handoff *h = x->list, *next; h; h = next) {
        next = h->next;
        if (now <= h->deadline || h->state == KVX_SENDING || h->pending)
            continue;
        fprintf(stderr, "moe-worker: handoff %s expired in state %s; %d KV blocks freed\n", h->id,
                kvx_state_name(h->state), h->n_blocks);
        h->state = KVX_EXPIRED;
        release_engine(x, h);
        x->c.failures++;
        remove_locked(x, h);
        woke = true;
    }
    pthread_mutex_unlock(&x->mu);
    if (woke)
        wake(x);
}

enum rpc_code kvx_claim(struct kvx *x, const char *id, struct kvx_claim *out, char *msg, size_t cap)
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
    } else if (h->state != KVX_COMPLETE) {
        code = RPC_FAILED_PRECONDITION;
        snprintf(msg, cap, "handoff_id: '%.100s' is %s, not COMPLETE", id,
                 kvx_state_name(h->state));
    } else {
        h->state = KVX_CLAIMED;
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

/* Engine thread: the reservation of `key` was served. */
static void on_reserved(void *user, uint64_t key, const int32_t *blocks, int n_blocks,
                        const char *error)
{
    struct kvx *x = user;
    pthread_mutex_lock(&x->mu);
    struct handoff *h = find_key_locked(x, key);
    struct rpc_call *call = h ? h->pending : NULL;
    if (h)
        h->pending = NULL;
    if (!h || h->release_requested || error) {
        if (blocks)
            moe_engine_unreserve(x->o.engine, key);
        if (h)
            remove_locked(x, h);
        pthread_mutex_unlock(&x->mu);
        if (call)
            rpc_call_finish(call, error ? RPC_RESOURCE_EXHAUSTED : RPC_ABORTED,
                            error ? error : "handoff released while reserving", NULL, 0);
        return;
    }
    int32_t *copy = malloc((size_t)n_blocks * sizeof *copy);
    uint32_t *ids = malloc((size_t)n_blocks * sizeof *ids);
    if (!copy || !ids) {
        moe_engine_unreserve(x->o.engine, key);
        remove_locked(x, h);
        pthread_mutex_unlock(&x->mu);
        free(copy);
        free(ids);
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory", NULL, 0);
        return;
    }
    if (n_blocks)
        memcpy(copy, blocks, (size_t)n_blocks * sizeof *copy);
    for (int i = 0; i < n_blocks; i++)
        ids[i] = (uint32_t)blocks[i];
    h->blocks = copy;
    h->n_blocks = n_blocks;
    h->state = KVX_RESERVED;
    h->deadline = moe_now() + x->o.ttl_ms / 1e3;
    Moe__V1__KvReserveResponse resp = MOE__V1__KV_RESERVE_RESPONSE__INIT;
    resp.handoff_id = h->id;
    resp.ok = true;
    resp.n_block_ids = (size_t)n_blocks;
    resp.block_ids = ids;
    finish_msg(call, &resp.base); /* packs under the lock: h->id stays valid */
    pthread_mutex_unlock(&x->mu);
    free(ids);
}

static void handle_reserve(struct rpc_call *call, const uint8_t *bytes, size_t len, void *user)
{
    struct kvx *x = user;
    char msg[512];
    enum rpc_code code = RPC_OK;
    struct handoff *h = NULL;
    Moe__V1__KvReserveRequest *rq = moe__v1__kv_reserve_request__unpack(NULL, len, bytes);
    uint32_t tp = rq && rq->tp_size ? rq->tp_size : 1;
    uint32_t bs = (uint32_t)x->block_size;
    if (!rq) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg, "request: not a valid KvReserveRequest message");
    } else if (!rq->handoff_id[0] || strlen(rq->handoff_id) >= KVX_ID_MAX) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg, "handoff_id: empty or longer than %d bytes", KVX_ID_MAX - 1);
    } else if (rq->block_size != bs) {
        code = RPC_FAILED_PRECONDITION;
        snprintf(msg, sizeof msg,
                 "block_size: the sender uses %u tokens per KV block, this worker %u (re-slicing "
                 "is not supported)",
                 rq->block_size, bs);
    } else if (tp != (uint32_t)x->o.tp_size) {
        code = RPC_FAILED_PRECONDITION;
        snprintf(msg, sizeof msg,
                 "tp_size: the sender has %u tensor-parallel ranks, this worker %d", tp,
                 x->o.tp_size);
    } else if ((rq->n_layer && rq->n_layer != (uint32_t)x->kv->n_layer) ||
               (rq->kv_dim && rq->kv_dim != (uint32_t)x->kv->kv_dim)) {
        code = RPC_FAILED_PRECONDITION;
        snprintf(msg, sizeof msg,
                 "KV layout: the sender has %u layers x kv_dim %u, this worker %d x %d",
                 rq->n_layer, rq->kv_dim, x->kv->n_layer, x->kv->kv_dim);
    } else if (rq->n_tokens < 1 || rq->n_blocks != (rq->n_tokens + bs - 1) / bs) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg, "n_blocks: %u blocks do not hold %u tokens of %u per block",
                 rq->n_blocks, rq->n_tokens, bs);
    } else if (rq->n_blocks > (uint32_t)moe_engine_n_block(x->o.engine)) {
        code = RPC_RESOURCE_EXHAUSTED;
        snprintf(msg, sizeof msg, "no free KV blocks: the handoff needs %u, the whole pool has %d",
                 rq->n_blocks, moe_engine_n_block(x->o.engine));
    } else if (!(h = calloc(1, sizeof *h))) {
        code = RPC_RESOURCE_EXHAUSTED;
        snprintf(msg, sizeof msg, "out of memory");
    }
    if (code) {
        if (rq)
            moe__v1__kv_reserve_request__free_unpacked(rq, NULL);
        rpc_call_finish(call, code, msg, NULL, 0);
        return;
    }
    snprintf(h->id, sizeof h->id, "%s", rq->handoff_id);
    h->state = KVX_RESERVING;
    h->pending = call;
    h->n_tokens = (int)rq->n_tokens;
    int n_blocks = (int)rq->n_blocks;
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
        rpc_call_finish(call, rc == MOE_ERR_NOMEM ? RPC_RESOURCE_EXHAUSTED : RPC_INVALID_ARGUMENT,
                        err.msg, NULL, 0);
        return;
    }
    pthread_mutex_unlock(&x->mu);
    wake(x);
}

/* ---- KvTransfer (decode side) -------------------------------------------------------- */

/* Validates and writes one chunk into h's blocks; caller holds x->mu.
 * Returns RPC_OK or a code with msg set. */
static enum rpc_code receive_locked(struct kvx *x, struct handoff *h,
                                    const Moe__V1__KvTransferChunk *ch, char *msg, size_t cap)
{
    if (h->state != KVX_RESERVED && h->state != KVX_RECEIVING) {
        snprintf(msg, cap, "handoff %s is %s, not receiving", h->id, kvx_state_name(h->state));
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
    if (ch->tp_rank != 0 || ch->layer_begin != (uint32_t)h->next_layer ||
        ch->layer_end <= ch->layer_begin || ch->layer_end > (uint32_t)x->kv->n_layer) {
        snprintf(msg, cap, "layers [%u, %u) of rank %u: expected [%d, ...) of rank 0, at most %d",
                 ch->layer_begin, ch->layer_end, ch->tp_rank, h->next_layer, x->kv->n_layer);
        return RPC_INVALID_ARGUMENT;
    }
    size_t want = kvx_layers_bytes(x->kv, h->n_blocks, (int)ch->layer_begin, (int)ch->layer_end);
    if (ch->data.len != want) {
        snprintf(msg, cap, "data: %zu bytes for layers [%u, %u), expected %zu", ch->data.len,
                 ch->layer_begin, ch->layer_end, want);
        return RPC_INVALID_ARGUMENT;
    }
    if (ch->last) {
        int n_kv = (int)ch->n_token_ids - 1;
        if (ch->layer_end != (uint32_t)x->kv->n_layer || ch->n_rng_state != 4 || ch->n_prompt < 1 ||
            ch->n_token_ids <= ch->n_prompt ||
            (n_kv + x->block_size - 1) / x->block_size != h->n_blocks) {
            snprintf(msg, cap,
                     "last chunk: layers end at %u of %d, %zu tokens after a prompt of %u, %zu "
                     "RNG words: not a complete sequence for %d blocks",
                     ch->layer_end, x->kv->n_layer, ch->n_token_ids, ch->n_prompt, ch->n_rng_state,
                     h->n_blocks);
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
    }
    kvx_copy_layers(x->o.be, x->kv, h->blocks, h->n_blocks, (int)ch->layer_begin,
                    (int)ch->layer_end, ch->data.data, false);
    h->next_layer = (int)ch->layer_end;
    h->bytes += ch->data.len;
    h->state = ch->last ? KVX_COMPLETE : KVX_RECEIVING;
    if (ch->last) {
        h->deadline = moe_now() + x->o.ttl_ms / 1e3; /* now wait for the Generate */
        x->c.transfers_in++;
        x->c.bytes_in += h->bytes;
    }
    return RPC_OK;
}

static void handle_transfer(struct rpc_call *call, const uint8_t *bytes, size_t len, void *user)
{
    struct kvx *x = user;
    char msg[512] = "";
    Moe__V1__KvTransferChunk *ch = moe__v1__kv_transfer_chunk__unpack(NULL, len, bytes);
    if (!ch) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "request: not a valid KvTransferChunk", NULL,
                        0);
        return;
    }
    Moe__V1__KvTransferResponse resp = MOE__V1__KV_TRANSFER_RESPONSE__INIT;
    resp.handoff_id = ch->handoff_id;
    enum rpc_code code = RPC_OK;
    bool woke = false;
    pthread_mutex_lock(&x->mu);
    struct handoff *h = find_locked(x, ch->handoff_id, false);
    if (!h) {
        code = RPC_NOT_FOUND;
        snprintf(msg, sizeof msg, "handoff %.100s: no reservation here (released or expired)",
                 ch->handoff_id);
    } else if (ch->abort) {
        fprintf(stderr, "moe-worker: handoff %s aborted by the sender: %.200s\n", h->id, ch->error);
        if (h->pending) { /* still reserving: on_reserved frees it */
            h->release_requested = true;
        } else {
            h->state = KVX_FAILED;
            release_engine(x, h);
            remove_locked(x, h);
        }
        x->c.failures++;
        woke = true;
    } else if ((code = receive_locked(x, h, ch, msg, sizeof msg)) != RPC_OK) {
        fprintf(stderr, "moe-worker: handoff %s failed: %s\n", h->id, msg);
        h->state = KVX_FAILED;
        release_engine(x, h);
        remove_locked(x, h);
        x->c.failures++;
        woke = true;
    } else {
        resp.ok = true;
        resp.bytes_received = h->bytes;
    }
    pthread_mutex_unlock(&x->mu);
    if (woke)
        wake(x);
    if (code)
        rpc_call_finish(call, code, msg, NULL, 0);
    else
        finish_msg(call, &resp.base);
    moe__v1__kv_transfer_chunk__free_unpacked(ch, NULL);
}

/* ---- KvSend (prefill side) --------------------------------------------------------------- */

struct sender {
    struct kvx *x;
    struct rpc_call *call;
    struct handoff *h; /* SENDING: owned by this sender until it ends */
    char target[300];
    uint32_t *dst_blocks; /* (h->n_blocks) receiver ids */
    double deadline;
};

static int64_t ms_until(double t)
{
    double left = (t - moe_now()) * 1e3;
    return left < 1 ? 1 : (int64_t)left;
}

/* Pushes every chunk; returns RPC_OK or the failure with msg set. */
static enum rpc_code send_all(struct sender *s, struct rpc_client *cl, uint64_t *bytes,
                              uint32_t *chunks, char *msg, size_t cap)
{
    struct kvx *x = s->x;
    struct handoff *h = s->h;
    int n_layer = x->kv->n_layer;
    size_t per_layer = kvx_layers_bytes(x->kv, h->n_blocks, 0, 1);
    int step = per_layer ? (int)(x->chunk_limit / per_layer) : n_layer;
    if (step < 1)
        step = 1;
    void *buf = malloc(per_layer * (size_t)(step < n_layer ? step : n_layer));
    uint32_t *tok = malloc((size_t)h->n_tokens * sizeof *tok);
    if (!buf || !tok) {
        free(buf);
        free(tok);
        snprintf(msg, cap, "out of memory");
        return RPC_RESOURCE_EXHAUSTED;
    }
    for (int i = 0; i < h->n_tokens; i++)
        tok[i] = (uint32_t)h->tokens[i];
    enum rpc_code code = RPC_OK;
    for (int lb = 0; lb < n_layer && code == RPC_OK; lb += step) {
        int le = lb + step < n_layer ? lb + step : n_layer;
        if (x->fault_delay_ms)
            usleep((useconds_t)x->fault_delay_ms * 1000);
        pthread_mutex_lock(&x->mu);
        bool stop = x->stopping || h->release_requested;
        pthread_mutex_unlock(&x->mu);
        if (stop) {
            snprintf(msg, cap, "released or shutting down before layer %d", lb);
            code = RPC_ABORTED;
            break;
        }
        if (moe_now() > s->deadline) {
            snprintf(msg, cap, "send deadline passed before layer %d", lb);
            code = RPC_DEADLINE_EXCEEDED;
            break;
        }
        size_t n = kvx_layers_bytes(x->kv, h->n_blocks, lb, le);
        kvx_copy_layers(x->o.be, x->kv, h->blocks, h->n_blocks, lb, le, buf, true);
        Moe__V1__KvTransferChunk ch = MOE__V1__KV_TRANSFER_CHUNK__INIT;
        ch.handoff_id = h->id;
        ch.layer_begin = (uint32_t)lb;
        ch.layer_end = (uint32_t)le;
        ch.n_block_ids = (size_t)h->n_blocks;
        ch.block_ids = s->dst_blocks;
        ch.data.data = buf;
        ch.data.len = n;
        ch.last = le == n_layer;
        if (ch.last) {
            ch.n_token_ids = (size_t)h->n_tokens;
            ch.token_ids = tok;
            ch.n_prompt = (uint32_t)h->n_prompt;
            ch.n_rng_state = 4;
            ch.rng_state = h->rng.s;
        }
        size_t len;
        void *req = pack_msg(&ch.base, &len);
        if (!req) {
            snprintf(msg, cap, "out of memory");
            code = RPC_RESOURCE_EXHAUSTED;
            break;
        }
        int64_t left = ms_until(s->deadline);
        struct rpc_reply r;
        rpc_client_call(cl, "/moe.v1.Worker/KvTransfer", req, len,
                        left < KVX_CALL_TIMEOUT_MS ? left : KVX_CALL_TIMEOUT_MS, &r);
        free(req);
        if (r.code != RPC_OK) {
            code = r.code == RPC_DEADLINE_EXCEEDED ? RPC_DEADLINE_EXCEEDED
                   : r.code == RPC_UNAVAILABLE     ? RPC_UNAVAILABLE
                                                   : RPC_ABORTED;
            snprintf(msg, cap, "KvTransfer of layers [%d, %d) to %.200s: %s %.200s", lb, le,
                     s->target, rpc_code_name(r.code), r.message);
        } else {
            *bytes += n;
            (*chunks)++;
        }
        rpc_reply_clear(&r);
        if (code == RPC_OK && x->fault_die) {
            fprintf(stderr, "moe-worker: MOE_FAULT_DIE_DURING_TRANSFER: exiting after chunk %u\n",
                    *chunks);
            _exit(3);
        }
    }
    free(buf);
    free(tok);
    return code;
}

static void *sender_thread(void *arg)
{
    struct sender *s = arg;
    struct kvx *x = s->x;
    struct handoff *h = s->h;
    double t0 = moe_now();
    char msg[600] = "";
    uint64_t bytes = 0;
    uint32_t chunks = 0;
    struct moe_error err = {0};
    bool owned = false;
    struct rpc_client *cl = peer_client(x, s->target, &owned, &err);
    enum rpc_code code = RPC_OK;
    if (!cl) {
        code = RPC_UNAVAILABLE;
        snprintf(msg, sizeof msg, "target %.200s: %.300s", s->target, err.msg);
    } else {
        code = send_all(s, cl, &bytes, &chunks, msg, sizeof msg);
    }
    if (code != RPC_OK && cl) {
        /* Tell the receiver at once (best effort); its ttl covers the rest. */
        Moe__V1__KvTransferChunk ab = MOE__V1__KV_TRANSFER_CHUNK__INIT;
        ab.handoff_id = h->id;
        ab.abort = true;
        ab.error = msg;
        size_t len;
        void *req = pack_msg(&ab.base, &len);
        struct rpc_reply r;
        if (req)
            rpc_client_call(cl, "/moe.v1.Worker/KvTransfer", req, len, KVX_ABORT_TIMEOUT_MS, &r);
        else
            memset(&r, 0, sizeof r);
        rpc_reply_clear(&r);
        free(req);
    }
    if (owned)
        rpc_client_destroy(cl);
    double ms = 1e3 * (moe_now() - t0);
    char id[KVX_ID_MAX];
    snprintf(id, sizeof id, "%s", h->id);
    pthread_mutex_lock(&x->mu);
    h->state = code == RPC_OK ? KVX_DONE : KVX_FAILED;
    release_engine(x, h); /* either way the prefill side is done with the blocks */
    if (code == RPC_OK) {
        x->c.transfers_out++;
        x->c.bytes_out += bytes;
    } else {
        x->c.failures++;
    }
    x->c.send_ms += ms;
    remove_locked(x, h);
    pthread_mutex_unlock(&x->mu);
    wake(x);
    if (code == RPC_OK) {
        Moe__V1__KvSendResponse resp = MOE__V1__KV_SEND_RESPONSE__INIT;
        resp.handoff_id = id;
        resp.ok = true;
        resp.bytes = bytes;
        resp.transfer_ms = ms;
        resp.chunks = chunks;
        finish_msg(s->call, &resp.base);
    } else {
        fprintf(stderr, "moe-worker: handoff %s failed after %u chunks: %s\n", id, chunks, msg);
        char full[800];
        snprintf(full, sizeof full, "handoff %.100s: %s", id, msg);
        rpc_call_finish(s->call, code, full, NULL, 0);
    }
    free(s->dst_blocks);
    free(s);
    pthread_mutex_lock(&x->mu);
    x->n_senders--;
    pthread_cond_broadcast(&x->cond);
    pthread_mutex_unlock(&x->mu);
    return NULL;
}

static void handle_send(struct rpc_call *call, const uint8_t *bytes, size_t len, void *user)
{
    struct kvx *x = user;
    char msg[512];
    enum rpc_code code = RPC_OK;
    struct sender *s = NULL;
    Moe__V1__KvSendRequest *rq = moe__v1__kv_send_request__unpack(NULL, len, bytes);
    if (!rq) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "request: not a valid KvSendRequest", NULL, 0);
        return;
    }
    pthread_mutex_lock(&x->mu);
    struct handoff *h = find_locked(x, rq->handoff_id, true);
    if (x->stopping) {
        code = RPC_UNAVAILABLE;
        snprintf(msg, sizeof msg, "worker is shutting down");
    } else if (!h) {
        code = RPC_NOT_FOUND;
        snprintf(msg, sizeof msg, "handoff_id: '%.100s' is not parked here (expired or released)",
                 rq->handoff_id);
    } else if (h->state != KVX_PREFILLED) {
        code = RPC_FAILED_PRECONDITION;
        snprintf(msg, sizeof msg, "handoff_id: '%.100s' is %s, not PREFILLED", h->id,
                 kvx_state_name(h->state));
    } else if (rq->n_block_ids != (size_t)h->n_blocks) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg, "block_ids: %zu receiver blocks for %d parked blocks",
                 rq->n_block_ids, h->n_blocks);
    } else if (!rq->target_address[0] || strlen(rq->target_address) >= 300) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg, "target_address: empty or too long");
    } else if (!(s = calloc(1, sizeof *s)) ||
               !(s->dst_blocks = malloc((size_t)h->n_blocks * sizeof *s->dst_blocks))) {
        code = RPC_RESOURCE_EXHAUSTED;
        snprintf(msg, sizeof msg, "out of memory");
    }
    if (code) {
        pthread_mutex_unlock(&x->mu);
        if (s)
            free(s->dst_blocks);
        free(s);
        moe__v1__kv_send_request__free_unpacked(rq, NULL);
        rpc_call_finish(call, code, msg, NULL, 0);
        return;
    }
    s->x = x;
    s->call = call;
    s->h = h;
    snprintf(s->target, sizeof s->target, "%s", rq->target_address);
    if (h->n_blocks && rq->block_ids)
        memcpy(s->dst_blocks, rq->block_ids, (size_t)h->n_blocks * sizeof *s->dst_blocks);
    int64_t left = rq->deadline_ms ? (int64_t)rq->deadline_ms : KVX_DEFAULT_SEND_MS;
    int64_t call_left = rpc_call_deadline_ms_left(call);
    if (call_left < left)
        left = call_left;
    s->deadline = moe_now() + (double)left / 1e3;
    h->state = KVX_SENDING;
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
        h->state = KVX_PREFILLED; /* nothing sent: it may be asked again or expire */
        x->n_senders--;
        pthread_cond_broadcast(&x->cond);
        pthread_mutex_unlock(&x->mu);
        free(s->dst_blocks);
        free(s);
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "cannot start a sender thread", NULL, 0);
    }
}

/* ---- KvRelease (either side) -------------------------------------------------------------- */

static void handle_release(struct rpc_call *call, const uint8_t *bytes, size_t len, void *user)
{
    struct kvx *x = user;
    Moe__V1__KvReleaseRequest *rq = moe__v1__kv_release_request__unpack(NULL, len, bytes);
    if (!rq) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "request: not a valid KvReleaseRequest", NULL,
                        0);
        return;
    }
    Moe__V1__KvReleaseResponse resp = MOE__V1__KV_RELEASE_RESPONSE__INIT;
    pthread_mutex_lock(&x->mu);
    for (int side = 0; side < 2; side++) {
        struct handoff *h = find_locked(x, rq->handoff_id, side == 0);
        if (!h)
            continue;
        resp.found = true;
        if (h->state == KVX_SENDING || h->state == KVX_RESERVING) {
            h->release_requested = true; /* its sender / on_reserved frees it */
            continue;
        }
        fprintf(stderr, "moe-worker: handoff %s released in state %s (%.200s)\n", h->id,
                kvx_state_name(h->state), rq->reason);
        if (h->state == KVX_RECEIVING)
            x->c.failures++;
        h->state = KVX_FAILED;
        release_engine(x, h);
        remove_locked(x, h);
    }
    pthread_mutex_unlock(&x->mu);
    moe__v1__kv_release_request__free_unpacked(rq, NULL);
    wake(x);
    finish_msg(call, &resp.base);
}

enum moe_status kvx_register(struct kvx *x, struct rpc_server *server, struct moe_error *err)
{
    enum moe_status rc;
    if ((rc = rpc_server_add_unary(server, "/moe.v1.Worker/KvReserve", handle_reserve, x, err)) ||
        (rc = rpc_server_add_unary(server, "/moe.v1.Worker/KvTransfer", handle_transfer, x, err)) ||
        (rc = rpc_server_add_unary(server, "/moe.v1.Worker/KvSend", handle_send, x, err)) ||
        (rc = rpc_server_add_unary(server, "/moe.v1.Worker/KvRelease", handle_release, x, err)))
        return rc;
    return MOE_OK;
}
