/* gRPC server over the C core: one NEXT completion queue per thread, every
 * queue registered with the server and pre-posting one request slot per
 * method. Call state is reference counted: the pending close tag, a send in
 * flight and each producer reference each hold one. See rpc.h. */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/status.h>
#include <grpc/support/time.h>

#include "auth_token.h"
#include "clock.h"
#include "hostport.h"
#include "rpc_internal.h"
#include "tls_opts.h"

_Static_assert(RPC_UNAUTHENTICATED == (int)GRPC_STATUS_UNAUTHENTICATED, "rpc_code mirrors gRPC");
_Static_assert(RPC_DEADLINE_EXCEEDED == (int)GRPC_STATUS_DEADLINE_EXCEEDED, "rpc_code");
_Static_assert(RPC_UNIMPLEMENTED == (int)GRPC_STATUS_UNIMPLEMENTED, "rpc_code");

enum tag_kind { TAG_REQUEST, TAG_CLOSE, TAG_SEND, TAG_UNIMPL, TAG_SHUTDOWN };

struct rpc_tag {
    enum tag_kind kind;
};

#define CONTAINER_OF(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

enum method_kind { METHOD_UNARY, METHOD_STREAM };

struct rpc_method {
    char *path;
    enum method_kind kind;
    rpc_unary_fn unary;
    rpc_stream_fn stream;
    void *user;
    void *handle;      /* from grpc_server_register_method */
    bool drain_exempt; /* health Check/Watch: answered while draining, not waited for */
};

/* One outstanding grpc_server_request_(registered_)call per (thread, method);
 * method == NULL is the slot for unregistered methods. */
struct rpc_slot {
    struct rpc_tag tag;
    struct rpc_server *server;
    int thread;
    struct rpc_method *method;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    grpc_call_details details;
};

/* rpc_server_require_token: calls under `prefix` need one of `tokens`. */
struct rpc_token_rule {
    char *prefix;
    struct moe_tokens *tokens;
};

struct rpc_queue_thread {
    struct rpc_server *server;
    grpc_completion_queue *cq;
    pthread_t thread;
    bool running;
};

struct rpc_server {
    grpc_server *srv;
    int port;
    int n_threads;
    struct rpc_queue_thread *threads; /* n_threads */
    struct rpc_method *methods;
    int n_methods, cap_methods;
    struct rpc_slot *slots; /* n_threads * (n_methods + 1) */
    int n_slots;
    bool started;
    struct rpc_token_rule *rules;
    int n_rules;

    struct moe_tls *tls;    /* NULL: plaintext */
    bool tls_client_auth;   /* mutual TLS */
    pthread_mutex_t tls_mu; /* guards tls_gen */
    uint64_t tls_gen;       /* the generation gRPC was last given */

    pthread_mutex_t mu; /* guards what follows */
    pthread_cond_t cv;
    bool draining; /* rpc_server_destroy began: new work is refused */
    bool shutting_down;
    bool shutdown_done;
    long n_calls; /* live call states */
    long n_busy;  /* of those, not drain_exempt */
    struct rpc_tag shutdown_tag;

    struct rpc_health *health; /* owned (rpc_server_attach_health); NULL: no health service */
};

/* A queued outgoing item: a message, or (bb == NULL) the final status. */
struct out_item {
    struct out_item *next;
    grpc_byte_buffer *bb;
    size_t len;
    enum rpc_code code;
    char *message;
};

/* One call, unary or streaming (struct rpc_stream is this struct). */
struct rpc_call {
    struct rpc_tag close_tag;
    struct rpc_tag send_tag;
    struct rpc_server *server;
    bool busy; /* counted in server->n_busy */
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    int recv_cancelled; /* written by gRPC when close_tag fires */

    pthread_mutex_t mu; /* guards everything below */
    pthread_cond_t cv;
    int refs;
    int producer_refs;
    bool closed;         /* close tag fired */
    bool cancelled;      /* client gone or a send failed */
    bool finish_queued;  /* status queued */
    bool md_sent;        /* initial metadata went out */
    bool send_in_flight; /* a batch is outstanding on send_tag */
    struct out_item *q_head, *q_tail;
    size_t queued_bytes;
    struct out_item *inflight[2];
    grpc_slice inflight_details;
    bool inflight_has_details;
    rpc_cancel_fn on_cancel;
    void *on_cancel_user;
    bool cancel_cb_done;
    bool cb_running;
    pthread_t cb_thread;
};

struct rpc_stream {
    struct rpc_call c;
};

/* A call to an unregistered method, answered UNIMPLEMENTED in one batch. */
struct unimpl_call {
    struct rpc_tag tag;
    grpc_call *call;
    int recv_cancelled;
    grpc_slice details;
};

/* ---- shared helpers -------------------------------------------------------------- */

/* gRPC 1.51 (core 29) as Debian builds it (without NDEBUG) runs a debug-build
 * experiment, posix_event_engine_enable_polling: each default EventEngine
 * gets an epoll poller thread of its own. With that version's EventEngine
 * client and listener experiments off, no socket is ever registered with
 * it, so it only costs a thread and an epoll set per process, and it is the
 * thread that aborted a ThreadSanitizer run of the coordinator at start
 * (its epoll_wait failed with EBADF and gRPC asserts). It is switched off
 * before gRPC reads GRPC_EXPERIMENTS (at its first use, after main starts);
 * a GRPC_EXPERIMENTS that names the experiment itself is left as given.
 * Other gRPC versions are left alone: they may not know the name and
 * would log an error for it. */
void rpc_experiments_default(void)
{
    if (strncmp(grpc_version_string(), RPC_EE_POLLING_CORE, strlen(RPC_EE_POLLING_CORE)) != 0)
        return;
    const char *old = getenv("GRPC_EXPERIMENTS");
    if (old && strstr(old, RPC_EE_POLLING))
        return;
    char v[1024];
    if (snprintf(v, sizeof v, "%s%s-" RPC_EE_POLLING, old ? old : "", old && old[0] ? "," : "") <
        (int)sizeof v)
        setenv("GRPC_EXPERIMENTS", v, 1);
}

/* Before main: no other thread reads the environment yet. */
__attribute__((constructor)) static void rpc_experiments_at_load(void)
{
    rpc_experiments_default();
}

void rpc_channel_args_fill(grpc_arg *args, int *n, size_t max_message_bytes, int keepalive_time_ms,
                           int keepalive_timeout_ms, int server)
{
    int max = max_message_bytes == 0        ? (int)RPC_DEFAULT_MAX_MESSAGE
              : max_message_bytes > INT_MAX ? INT_MAX
                                            : (int)max_message_bytes;
    int i = 0;
    args[i].type = GRPC_ARG_INTEGER;
    args[i].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[i++].value.integer = max;
    args[i].type = GRPC_ARG_INTEGER;
    args[i].key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[i++].value.integer = max;
    args[i].type = GRPC_ARG_INTEGER;
    args[i].key = (char *)GRPC_ARG_KEEPALIVE_TIME_MS;
    args[i++].value.integer = keepalive_time_ms > 0 ? keepalive_time_ms : 20000;
    args[i].type = GRPC_ARG_INTEGER;
    args[i].key = (char *)GRPC_ARG_KEEPALIVE_TIMEOUT_MS;
    args[i++].value.integer = keepalive_timeout_ms > 0 ? keepalive_timeout_ms : 10000;
    args[i].type = GRPC_ARG_INTEGER;
    args[i].key = (char *)GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS;
    args[i++].value.integer = 1;
    args[i].type = GRPC_ARG_INTEGER;
    args[i].key = (char *)GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA;
    args[i++].value.integer = 0; /* keepalive pings even when no data flows */
    if (server) {
        /* Accept client keepalive pings down to every 5 s instead of answering
         * them with GOAWAY "too_many_pings". */
        args[i].type = GRPC_ARG_INTEGER;
        args[i].key = (char *)GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS;
        args[i++].value.integer = 5000;
        args[i].type = GRPC_ARG_INTEGER;
        args[i].key = (char *)GRPC_ARG_HTTP2_MAX_PING_STRIKES;
        args[i++].value.integer = 0; /* never GOAWAY for pings */
    }
    *n = i;
}

gpr_timespec rpc_deadline_from_ms(int64_t timeout_ms)
{
    if (timeout_ms <= 0) {
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    }
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

int64_t rpc_deadline_ms_left(gpr_timespec deadline)
{
    if (gpr_time_cmp(deadline, gpr_inf_future(deadline.clock_type)) == 0) {
        return INT64_MAX;
    }
    gpr_timespec d = gpr_convert_clock_type(deadline, GPR_CLOCK_MONOTONIC);
    gpr_timespec left = gpr_time_sub(d, gpr_now(GPR_CLOCK_MONOTONIC));
    return (int64_t)left.tv_sec * 1000 + left.tv_nsec / 1000000;
}

static void mutex_init(pthread_mutex_t *mu, pthread_cond_t *cv)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_mutex_init(mu, NULL);
    pthread_cond_init(cv, &attr);
    pthread_condattr_destroy(&attr);
}

static grpc_byte_buffer *bytes_to_bb(const void *bytes, size_t len)
{
    grpc_slice slice = grpc_slice_from_copied_buffer(len ? (const char *)bytes : "", len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&slice, 1);
    grpc_slice_unref(slice);
    return bb;
}

/* ---- call state -------------------------------------------------------------------- */

static void out_item_free(struct out_item *it)
{
    if (it) {
        if (it->bb) {
            grpc_byte_buffer_destroy(it->bb);
        }
        free(it->message);
        free(it);
    }
}

static void call_free(struct rpc_call *c)
{
    struct rpc_server *s = c->server;
    for (struct out_item *it = c->q_head; it;) {
        struct out_item *next = it->next;
        out_item_free(it);
        it = next;
    }
    grpc_metadata_array_destroy(&c->md);
    grpc_call_unref(c->call);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    bool busy = c->busy;
    free(c);
    pthread_mutex_lock(&s->mu);
    s->n_calls--;
    if (busy)
        s->n_busy--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* Drops one reference and unlocks c->mu; frees c when it was the last. */
static void call_unref_unlock(struct rpc_call *c)
{
    int refs = --c->refs;
    pthread_mutex_unlock(&c->mu);
    if (refs == 0) {
        call_free(c);
    }
}

static void queue_drop_locked(struct rpc_call *c)
{
    for (struct out_item *it = c->q_head; it;) {
        struct out_item *next = it->next;
        out_item_free(it);
        it = next;
    }
    c->q_head = c->q_tail = NULL;
    c->queued_bytes = 0;
}

static struct out_item *queue_pop_locked(struct rpc_call *c)
{
    struct out_item *it = c->q_head;
    c->q_head = it->next;
    if (!c->q_head) {
        c->q_tail = NULL;
    }
    c->queued_bytes -= it->len;
    it->next = NULL;
    return it;
}

/* Starts the next send batch if none is in flight (c->mu held). A message
 * directly followed by the status goes out in the same batch. */
static void pump_locked(struct rpc_call *c)
{
    if (c->send_in_flight || !c->q_head) {
        return;
    }
    if (c->cancelled || c->closed) {
        queue_drop_locked(c);
        return;
    }
    grpc_op ops[3];
    memset(ops, 0, sizeof(ops));
    size_t n = 0;
    if (!c->md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
    }
    struct out_item *first = queue_pop_locked(c);
    struct out_item *second = NULL;
    if (first->bb && c->q_head && !c->q_head->bb) {
        second = queue_pop_locked(c);
    }
    struct out_item *status = first->bb ? second : first;
    if (first->bb) {
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = first->bb;
        n++;
    }
    if (status) {
        c->inflight_details = grpc_slice_from_copied_string(status->message ? status->message : "");
        c->inflight_has_details = true;
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = (grpc_status_code)status->code;
        ops[n].data.send_status_from_server.status_details =
            status->message ? &c->inflight_details : NULL;
        n++;
    }
    c->inflight[0] = first;
    c->inflight[1] = second;
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, &c->send_tag, NULL);
    if (e != GRPC_CALL_OK) {
        /* Only on a broken invariant; treat the call as dead. */
        out_item_free(first);
        out_item_free(second);
        c->inflight[0] = c->inflight[1] = NULL;
        if (c->inflight_has_details) {
            grpc_slice_unref(c->inflight_details);
            c->inflight_has_details = false;
        }
        c->cancelled = true;
        queue_drop_locked(c);
        grpc_call_cancel(c->call, NULL);
        return;
    }
    c->md_sent = true;
    c->send_in_flight = true;
    c->refs++;
}

static void on_send_done(struct rpc_call *c, int success)
{
    pthread_mutex_lock(&c->mu);
    out_item_free(c->inflight[0]);
    out_item_free(c->inflight[1]);
    c->inflight[0] = c->inflight[1] = NULL;
    if (c->inflight_has_details) {
        grpc_slice_unref(c->inflight_details);
        c->inflight_has_details = false;
    }
    c->send_in_flight = false;
    if (!success) {
        c->cancelled = true;
    }
    pump_locked(c);
    call_unref_unlock(c);
}

static void on_close(struct rpc_call *c)
{
    rpc_cancel_fn fn = NULL;
    void *user = NULL;
    pthread_mutex_lock(&c->mu);
    c->closed = true;
    if (c->recv_cancelled) {
        c->cancelled = true;
        if (c->on_cancel && !c->cancel_cb_done && c->producer_refs > 0) {
            fn = c->on_cancel;
            user = c->on_cancel_user;
            c->cancel_cb_done = true;
            c->cb_running = true;
            c->cb_thread = pthread_self();
        }
    }
    queue_drop_locked(c);
    pthread_mutex_unlock(&c->mu);
    if (fn) {
        fn((struct rpc_stream *)c, user);
        pthread_mutex_lock(&c->mu);
        c->cb_running = false;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
    pthread_mutex_lock(&c->mu);
    call_unref_unlock(c); /* the close tag's reference */
}

/* Queues an item (c->mu held). */
static void queue_push_locked(struct rpc_call *c, struct out_item *it)
{
    if (c->q_tail) {
        c->q_tail->next = it;
    } else {
        c->q_head = it;
    }
    c->q_tail = it;
    c->queued_bytes += it->len;
}

/* Queues the final status (c->mu held). */
static void finish_locked(struct rpc_call *c, enum rpc_code code, const char *message)
{
    if (c->finish_queued) {
        return;
    }
    c->finish_queued = true;
    if (c->cancelled || c->closed) {
        return;
    }
    struct out_item *it = calloc(1, sizeof(*it));
    char *msg = message ? strdup(message) : NULL;
    if (!it || (message && !msg)) {
        free(it);
        free(msg);
        c->cancelled = true;
        grpc_call_cancel_with_status(c->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory",
                                     NULL);
        return;
    }
    it->code = code;
    it->message = msg;
    queue_push_locked(c, it);
    pump_locked(c);
}

static void producer_release(struct rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    while (c->cb_running && !pthread_equal(c->cb_thread, pthread_self())) {
        pthread_cond_wait(&c->cv, &c->mu);
    }
    MOE_ASSERT(c->producer_refs > 0);
    if (--c->producer_refs == 0) {
        c->on_cancel = NULL;
        c->on_cancel_user = NULL;
        finish_locked(c, RPC_INTERNAL, "stream released without a status");
    }
    call_unref_unlock(c);
}

/* ---- public call / stream functions -------------------------------------------------- */

void rpc_call_finish(struct rpc_call *c, enum rpc_code code, const char *message, const void *bytes,
                     size_t len)
{
    pthread_mutex_lock(&c->mu);
    if (code == RPC_OK && !c->finish_queued && !c->cancelled && !c->closed) {
        struct out_item *it = calloc(1, sizeof(*it));
        if (it) {
            it->bb = bytes_to_bb(bytes, len);
            it->len = len;
            queue_push_locked(c, it);
        } else {
            code = RPC_RESOURCE_EXHAUSTED;
            message = "out of memory";
        }
    }
    finish_locked(c, code, message);
    pthread_mutex_unlock(&c->mu);
    producer_release(c);
}

static int call_is_cancelled(struct rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    int r = c->cancelled;
    pthread_mutex_unlock(&c->mu);
    return r;
}

int rpc_call_is_cancelled(struct rpc_call *call)
{
    return call_is_cancelled(call);
}
int rpc_stream_is_cancelled(struct rpc_stream *stream)
{
    return call_is_cancelled(&stream->c);
}
int64_t rpc_call_deadline_ms_left(struct rpc_call *call)
{
    return rpc_deadline_ms_left(call->deadline);
}
int64_t rpc_stream_deadline_ms_left(struct rpc_stream *stream)
{
    return rpc_deadline_ms_left(stream->c.deadline);
}

static int call_metadata(struct rpc_call *c, const char *key, char *buf, size_t cap)
{
    size_t klen = strlen(key);
    for (size_t i = 0; i < c->md.count; i++) {
        const grpc_metadata *m = &c->md.metadata[i];
        if (GRPC_SLICE_LENGTH(m->key) == klen &&
            memcmp(GRPC_SLICE_START_PTR(m->key), key, klen) == 0) {
            size_t vlen = GRPC_SLICE_LENGTH(m->value);
            if (cap > 0) {
                size_t n = vlen < cap - 1 ? vlen : cap - 1;
                memcpy(buf, GRPC_SLICE_START_PTR(m->value), n);
                buf[n] = '\0';
            }
            return vlen > INT_MAX ? INT_MAX : (int)vlen;
        }
    }
    return -1;
}

int rpc_call_metadata(struct rpc_call *call, const char *key, char *buf, size_t cap)
{
    return call_metadata(call, key, buf, cap);
}
int rpc_stream_metadata(struct rpc_stream *stream, const char *key, char *buf, size_t cap)
{
    return call_metadata(&stream->c, key, buf, cap);
}

enum moe_status rpc_stream_send(struct rpc_stream *stream, const void *bytes, size_t len)
{
    struct rpc_call *c = &stream->c;
    struct out_item *it = calloc(1, sizeof(*it));
    if (!it) {
        return MOE_ERR_NOMEM;
    }
    pthread_mutex_lock(&c->mu);
    enum moe_status st = MOE_OK;
    if (c->finish_queued) {
        st = MOE_ERR_INVALID;
    } else if (c->cancelled || c->closed) {
        st = MOE_ERR_IO;
    }
    if (st != MOE_OK) {
        pthread_mutex_unlock(&c->mu);
        free(it);
        return st;
    }
    pthread_mutex_unlock(&c->mu);
    /* Copy outside the lock: a 10 MiB message must not stall the queue thread. */
    it->bb = bytes_to_bb(bytes, len);
    it->len = len;
    pthread_mutex_lock(&c->mu);
    if (c->finish_queued || c->cancelled || c->closed) {
        st = c->finish_queued ? MOE_ERR_INVALID : MOE_ERR_IO;
        pthread_mutex_unlock(&c->mu);
        out_item_free(it);
        return st;
    }
    queue_push_locked(c, it);
    pump_locked(c);
    pthread_mutex_unlock(&c->mu);
    return MOE_OK;
}

void rpc_stream_finish(struct rpc_stream *stream, enum rpc_code code, const char *message)
{
    struct rpc_call *c = &stream->c;
    pthread_mutex_lock(&c->mu);
    finish_locked(c, code, message);
    pthread_mutex_unlock(&c->mu);
}

size_t rpc_stream_queued_bytes(struct rpc_stream *stream)
{
    struct rpc_call *c = &stream->c;
    pthread_mutex_lock(&c->mu);
    size_t n = c->queued_bytes;
    pthread_mutex_unlock(&c->mu);
    return n;
}

void rpc_stream_set_on_cancel(struct rpc_stream *stream, rpc_cancel_fn fn, void *user)
{
    struct rpc_call *c = &stream->c;
    bool fire = false;
    pthread_mutex_lock(&c->mu);
    c->on_cancel = fn;
    c->on_cancel_user = user;
    /* Cancelled already: fire now, unless the close tag already did. */
    if (fn && c->closed && c->recv_cancelled && !c->cancel_cb_done) {
        c->cancel_cb_done = true;
        fire = true;
    }
    pthread_mutex_unlock(&c->mu);
    if (fire) {
        fn(stream, user);
    }
}

void rpc_stream_ref(struct rpc_stream *stream)
{
    struct rpc_call *c = &stream->c;
    pthread_mutex_lock(&c->mu);
    c->producer_refs++;
    c->refs++;
    pthread_mutex_unlock(&c->mu);
}

void rpc_stream_release(struct rpc_stream *stream)
{
    if (stream) {
        producer_release(&stream->c);
    }
}

/* ---- queue threads ---------------------------------------------------------------------- */

static void slot_post(struct rpc_slot *slot)
{
    struct rpc_server *s = slot->server;
    grpc_completion_queue *cq = s->threads[slot->thread].cq;
    grpc_call_error e;
    if (slot->method) {
        e = grpc_server_request_registered_call(s->srv, slot->method->handle, &slot->call,
                                                &slot->deadline, &slot->md, &slot->payload, cq, cq,
                                                &slot->tag);
    } else {
        e = grpc_server_request_call(s->srv, &slot->call, &slot->details, &slot->md, cq, cq,
                                     &slot->tag);
    }
    (void)e; /* fails only while shutting down: the slot then stays idle */
}

/* The rule whose prefix is the longest one `path` (len bytes) starts with;
 * NULL when none. */
static const struct rpc_token_rule *rule_for(const struct rpc_server *s, const char *path,
                                             size_t len)
{
    const struct rpc_token_rule *best = NULL;
    for (int i = 0; i < s->n_rules; i++) {
        size_t pl = strlen(s->rules[i].prefix);
        if (pl <= len && !memcmp(path, s->rules[i].prefix, pl) &&
            (!best || pl > strlen(best->prefix)))
            best = &s->rules[i];
    }
    return best;
}

/* True when the call's metadata `md` carries a bearer token the rule
 * accepts (or no rule applies). */
static bool token_ok(const struct rpc_token_rule *r, const grpc_metadata_array *md)
{
    if (!r)
        return true;
    bool ok = false;
    for (size_t i = 0; i < md->count; i++) {
        const grpc_metadata *m = &md->metadata[i];
        if (GRPC_SLICE_LENGTH(m->key) == 13 &&
            !memcmp(GRPC_SLICE_START_PTR(m->key), "authorization", 13))
            ok = moe_tokens_check_bearer(r->tokens, (const char *)GRPC_SLICE_START_PTR(m->value),
                                         GRPC_SLICE_LENGTH(m->value));
    }
    return ok;
}

/* "... for moe.v1.Admin": the service of a rule's prefix. */
static void unauthenticated_msg(const struct rpc_token_rule *r, char *buf, size_t cap)
{
    const char *p = r->prefix[0] == '/' ? r->prefix + 1 : r->prefix;
    size_t n = strlen(p);
    if (n && p[n - 1] == '/')
        n--;
    snprintf(buf, cap,
             "missing or wrong bearer token for %.*s (send \"authorization: Bearer TOKEN\")",
             (int)(n > 200 ? 200 : n), p);
}

static void answer_unimplemented(struct rpc_slot *slot)
{
    struct unimpl_call *u = calloc(1, sizeof(*u));
    if (!u) {
        grpc_call_cancel_with_status(slot->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory",
                                     NULL);
        grpc_call_unref(slot->call);
        return;
    }
    u->tag.kind = TAG_UNIMPL;
    u->call = slot->call;
    char msg[300];
    const struct rpc_token_rule *r =
        rule_for(slot->server, (const char *)GRPC_SLICE_START_PTR(slot->details.method),
                 GRPC_SLICE_LENGTH(slot->details.method));
    bool authed = token_ok(r, &slot->md);
    if (authed)
        snprintf(msg, sizeof(msg), "method %.*s is not implemented",
                 (int)GRPC_SLICE_LENGTH(slot->details.method),
                 (const char *)GRPC_SLICE_START_PTR(slot->details.method));
    else
        unauthenticated_msg(r, msg, sizeof msg);
    u->details = grpc_slice_from_copied_string(msg);
    grpc_op ops[3];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[1].data.recv_close_on_server.cancelled = &u->recv_cancelled;
    ops[2].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[2].data.send_status_from_server.status =
        authed ? GRPC_STATUS_UNIMPLEMENTED : GRPC_STATUS_UNAUTHENTICATED;
    ops[2].data.send_status_from_server.status_details = &u->details;
    if (grpc_call_start_batch(u->call, ops, 3, &u->tag, NULL) != GRPC_CALL_OK) {
        grpc_call_unref(u->call);
        grpc_slice_unref(u->details);
        free(u);
    }
}

/* A new call arrived in `slot`: build its state and run the handler. */
static void on_new_call(struct rpc_slot *slot)
{
    struct rpc_server *s = slot->server;
    struct rpc_method *m = slot->method;
    if (!m) {
        answer_unimplemented(slot);
        grpc_call_details_destroy(&slot->details);
        grpc_call_details_init(&slot->details);
        grpc_metadata_array_destroy(&slot->md);
        grpc_metadata_array_init(&slot->md);
        slot->call = NULL;
        slot_post(slot);
        return;
    }
    struct rpc_call *c = calloc(1, sizeof(struct rpc_stream));
    grpc_byte_buffer *payload = slot->payload;
    slot->payload = NULL;
    if (!c) {
        grpc_call_cancel_with_status(slot->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory",
                                     NULL);
        grpc_call_unref(slot->call);
        grpc_metadata_array_destroy(&slot->md);
        grpc_metadata_array_init(&slot->md);
        if (payload) {
            grpc_byte_buffer_destroy(payload);
        }
        slot->call = NULL;
        slot_post(slot);
        return;
    }
    c->close_tag.kind = TAG_CLOSE;
    c->send_tag.kind = TAG_SEND;
    c->server = s;
    c->call = slot->call;
    c->deadline = slot->deadline;
    c->md = slot->md; /* moved: the slot gets a fresh array */
    grpc_metadata_array_init(&slot->md);
    slot->call = NULL;
    mutex_init(&c->mu, &c->cv);
    c->busy = !m->drain_exempt;
    pthread_mutex_lock(&s->mu);
    s->n_calls++;
    if (c->busy)
        s->n_busy++;
    bool shutting_down = s->shutting_down;
    bool refuse = s->draining && c->busy;
    pthread_mutex_unlock(&s->mu);
    if (!shutting_down) {
        slot_post(slot);
    }

    c->refs = 1; /* the producer (handler) */
    c->producer_refs = 1;
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->recv_cancelled;
    if (grpc_call_start_batch(c->call, &op, 1, &c->close_tag, NULL) == GRPC_CALL_OK) {
        c->refs++;
    } else {
        c->closed = true;
        c->cancelled = true;
    }

    const struct rpc_token_rule *rule = rule_for(s, m->path, strlen(m->path));
    if (!token_ok(rule, &c->md)) {
        char msg[300];
        unauthenticated_msg(rule, msg, sizeof msg);
        if (payload)
            grpc_byte_buffer_destroy(payload);
        pthread_mutex_lock(&c->mu);
        finish_locked(c, RPC_UNAUTHENTICATED, msg);
        pthread_mutex_unlock(&c->mu);
        producer_release(c);
        return;
    }
    if (!payload) {
        /* The client half-closed without a request message. */
        pthread_mutex_lock(&c->mu);
        finish_locked(c, RPC_INVALID_ARGUMENT, "missing request message");
        pthread_mutex_unlock(&c->mu);
        producer_release(c);
        return;
    }
    if (refuse) {
        grpc_byte_buffer_destroy(payload);
        pthread_mutex_lock(&c->mu);
        finish_locked(c, RPC_UNAVAILABLE, "server is shutting down: send the request elsewhere");
        pthread_mutex_unlock(&c->mu);
        producer_release(c);
        return;
    }
    grpc_byte_buffer_reader reader;
    grpc_slice req = grpc_empty_slice();
    if (grpc_byte_buffer_reader_init(&reader, payload)) {
        req = grpc_byte_buffer_reader_readall(&reader);
        grpc_byte_buffer_reader_destroy(&reader);
    }
    grpc_byte_buffer_destroy(payload);
    if (m->kind == METHOD_UNARY) {
        m->unary(c, GRPC_SLICE_START_PTR(req), GRPC_SLICE_LENGTH(req), m->user);
    } else {
        m->stream((struct rpc_stream *)c, GRPC_SLICE_START_PTR(req), GRPC_SLICE_LENGTH(req),
                  m->user);
    }
    grpc_slice_unref(req);
}

static void *queue_thread_main(void *arg)
{
    struct rpc_queue_thread *t = arg;
    struct rpc_server *s = t->server;
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(t->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) {
            break;
        }
        if (ev.type != GRPC_OP_COMPLETE) {
            continue;
        }
        struct rpc_tag *tag = ev.tag;
        switch (tag->kind) {
        case TAG_REQUEST: {
            struct rpc_slot *slot = CONTAINER_OF(tag, struct rpc_slot, tag);
            if (ev.success) {
                on_new_call(slot);
            }
            break;
        }
        case TAG_CLOSE: on_close(CONTAINER_OF(tag, struct rpc_call, close_tag)); break;
        case TAG_SEND:
            on_send_done(CONTAINER_OF(tag, struct rpc_call, send_tag), ev.success);
            break;
        case TAG_UNIMPL: {
            struct unimpl_call *u = CONTAINER_OF(tag, struct unimpl_call, tag);
            grpc_call_unref(u->call);
            grpc_slice_unref(u->details);
            free(u);
            break;
        }
        case TAG_SHUTDOWN:
            pthread_mutex_lock(&s->mu);
            s->shutdown_done = true;
            pthread_cond_broadcast(&s->cv);
            pthread_mutex_unlock(&s->mu);
            break;
        }
    }
    return NULL;
}

/* ---- server lifetime ----------------------------------------------------------------------- */

/* gRPC asks before each handshake: a new config when the material changed
 * since it last asked (moe_tls_reload), else "unchanged". */
static grpc_ssl_certificate_config_reload_status tls_fetch(void *user,
                                                           grpc_ssl_server_certificate_config **cfg)
{
    struct rpc_server *s = user;
    const struct moe_tls_material *m = moe_tls_current(s->tls);
    pthread_mutex_lock(&s->tls_mu);
    bool same = m->generation == s->tls_gen;
    pthread_mutex_unlock(&s->tls_mu);
    if (same)
        return GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
    grpc_ssl_pem_key_cert_pair pair = {m->key_pem, m->cert_pem};
    /* gRPC 1.51 asserts that a fetched config has roots even when no client
     * certificate is asked for: without a CA, the server's own chain stands
     * in (never used to verify anything then). */
    *cfg = grpc_ssl_server_certificate_config_create(m->ca_pem ? m->ca_pem : m->cert_pem, &pair, 1);
    if (!*cfg)
        return GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_FAIL;
    pthread_mutex_lock(&s->tls_mu);
    s->tls_gen = m->generation;
    pthread_mutex_unlock(&s->tls_mu);
    return GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW;
}

struct rpc_server *rpc_server_create(const char *addr, int n_threads,
                                     const struct rpc_server_options *opts, struct moe_error *err)
{
    struct rpc_server_options defaults = {0};
    if (!opts) {
        opts = &defaults;
    }
    if (!addr || n_threads < 1 || n_threads > 256) {
        moe_error_set(err, MOE_ERR_INVALID, "rpc_server_create: bad address or n_threads %d",
                      n_threads);
        return NULL;
    }
    /* gRPC itself takes "127.0.0.1:99999" and listens on 99999 mod 65536 */
    char host[256];
    int port;
    if (!moe_hostport_split(addr, host, sizeof host, &port)) {
        moe_error_set(err, MOE_ERR_INVALID,
                      "listen address '%s': expected HOST:PORT with a port in 0..65535", addr);
        return NULL;
    }
    struct rpc_server *s = calloc(1, sizeof(*s));
    if (!s) {
        moe_error_set(err, MOE_ERR_NOMEM, "rpc_server_create: out of memory");
        return NULL;
    }
    grpc_init();
    mutex_init(&s->mu, &s->cv);
    pthread_mutex_init(&s->tls_mu, NULL);
    s->shutdown_tag.kind = TAG_SHUTDOWN;
    s->n_threads = n_threads;
    grpc_arg args[RPC_N_ARGS];
    int n_args = 0;
    rpc_channel_args_fill(args, &n_args, opts->max_message_bytes, opts->keepalive_time_ms,
                          opts->keepalive_timeout_ms, 1);
    for (int i = 0; opts->max_receive_bytes && i < n_args; i++)
        if (!strcmp(args[i].key, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH))
            args[i].value.integer =
                opts->max_receive_bytes > INT_MAX ? INT_MAX : (int)opts->max_receive_bytes;
    grpc_channel_args chargs = {(size_t)n_args, args};
    s->srv = grpc_server_create(&chargs, NULL);
    s->threads = calloc((size_t)n_threads, sizeof(*s->threads));
    if (!s->srv || !s->threads) {
        moe_error_set(err, MOE_ERR_NOMEM, "rpc_server_create: out of memory");
        goto fail;
    }
    for (int i = 0; i < n_threads; i++) {
        s->threads[i].server = s;
        s->threads[i].cq = grpc_completion_queue_create_for_next(NULL);
        grpc_server_register_completion_queue(s->srv, s->threads[i].cq, NULL);
    }
    grpc_server_credentials *creds = NULL;
    if (opts->tls) {
        if (!moe_tls_has_identity(opts->tls)) {
            moe_error_set(err, MOE_ERR_INVALID,
                          "TLS on %s: a server needs a certificate and key (--tls-cert, "
                          "--tls-key)",
                          addr);
            goto fail;
        }
        if (opts->tls_client_auth && !moe_tls_has_ca(opts->tls)) {
            moe_error_set(err, MOE_ERR_INVALID,
                          "mutual TLS on %s: client certificates are checked against --tls-ca, "
                          "which is not given",
                          addr);
            goto fail;
        }
        s->tls = opts->tls;
        s->tls_client_auth = opts->tls_client_auth;
        grpc_ssl_server_credentials_options *so =
            grpc_ssl_server_credentials_create_options_using_config_fetcher(
                opts->tls_client_auth ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                      : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
                tls_fetch, s);
        creds = so ? grpc_ssl_server_credentials_create_with_options(so) : NULL;
    } else {
        creds = grpc_insecure_server_credentials_create();
    }
    s->port = creds ? grpc_server_add_http2_port(s->srv, addr, creds) : 0;
    if (creds)
        grpc_server_credentials_release(creds);
    if (s->port <= 0) {
        moe_error_set(err, MOE_ERR_IO, "rpc_server_create: cannot listen on '%s'%s", addr,
                      opts->tls ? " with TLS" : "");
        goto fail;
    }
    return s;
fail:
    rpc_server_destroy(s, 0);
    return NULL;
}

static enum moe_status add_method(struct rpc_server *s, const char *path, enum method_kind kind,
                                  rpc_unary_fn unary, rpc_stream_fn stream, void *user,
                                  struct moe_error *err)
{
    if (s->started) {
        return moe_error_set(err, MOE_ERR_INVALID, "rpc: method '%s' added after start", path);
    }
    if (!path || path[0] != '/') {
        return moe_error_set(err, MOE_ERR_INVALID, "rpc: method path '%s' must start with '/'",
                             path ? path : "(null)");
    }
    for (int i = 0; i < s->n_methods; i++) {
        if (strcmp(s->methods[i].path, path) == 0) {
            return moe_error_set(err, MOE_ERR_INVALID, "rpc: method '%s' registered twice", path);
        }
    }
    if (s->n_methods == s->cap_methods) {
        int cap = s->cap_methods ? 2 * s->cap_methods : 8;
        struct rpc_method *m = realloc(s->methods, (size_t)cap * sizeof(*m));
        if (!m) {
            return moe_error_set(err, MOE_ERR_NOMEM, "rpc: out of memory");
        }
        s->methods = m;
        s->cap_methods = cap;
    }
    struct rpc_method *m = &s->methods[s->n_methods];
    memset(m, 0, sizeof(*m));
    m->path = strdup(path);
    if (!m->path) {
        return moe_error_set(err, MOE_ERR_NOMEM, "rpc: out of memory");
    }
    m->handle = grpc_server_register_method(s->srv, path, NULL,
                                            GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!m->handle) {
        free(m->path);
        return moe_error_set(err, MOE_ERR_INVALID, "rpc: gRPC refused method '%s'", path);
    }
    m->kind = kind;
    m->unary = unary;
    m->stream = stream;
    m->user = user;
    s->n_methods++;
    return MOE_OK;
}

enum moe_status rpc_server_add_unary(struct rpc_server *server, const char *path, rpc_unary_fn fn,
                                     void *user, struct moe_error *err)
{
    return add_method(server, path, METHOD_UNARY, fn, NULL, user, err);
}

enum moe_status rpc_server_add_stream(struct rpc_server *server, const char *path, rpc_stream_fn fn,
                                      void *user, struct moe_error *err)
{
    return add_method(server, path, METHOD_STREAM, NULL, fn, user, err);
}

enum moe_status rpc_server_require_token(struct rpc_server *s, const char *prefix,
                                         struct moe_tokens *tokens, struct moe_error *err)
{
    if (s->started)
        return moe_error_set(err, MOE_ERR_INVALID, "rpc: token rule '%s' added after start",
                             prefix ? prefix : "(null)");
    if (!prefix || prefix[0] != '/' || !tokens)
        return moe_error_set(err, MOE_ERR_INVALID, "rpc: token rule '%s': bad prefix or no tokens",
                             prefix ? prefix : "(null)");
    struct rpc_token_rule *r = realloc(s->rules, (size_t)(s->n_rules + 1) * sizeof *r);
    if (!r)
        return moe_error_set(err, MOE_ERR_NOMEM, "rpc: out of memory");
    s->rules = r;
    if (!(r[s->n_rules].prefix = strdup(prefix)))
        return moe_error_set(err, MOE_ERR_NOMEM, "rpc: out of memory");
    r[s->n_rules++].tokens = tokens;
    return MOE_OK;
}

enum moe_status rpc_server_start(struct rpc_server *s, struct moe_error *err)
{
    if (s->started) {
        return moe_error_set(err, MOE_ERR_INVALID, "rpc_server_start: already started");
    }
    int per_thread = s->n_methods + 1;
    s->slots = calloc((size_t)(s->n_threads * per_thread), sizeof(*s->slots));
    if (!s->slots) {
        return moe_error_set(err, MOE_ERR_NOMEM, "rpc_server_start: out of memory");
    }
    s->n_slots = s->n_threads * per_thread;
    grpc_server_start(s->srv);
    s->started = true;
    for (int t = 0; t < s->n_threads; t++) {
        for (int j = 0; j < per_thread; j++) {
            struct rpc_slot *slot = &s->slots[t * per_thread + j];
            slot->tag.kind = TAG_REQUEST;
            slot->server = s;
            slot->thread = t;
            slot->method = j < s->n_methods ? &s->methods[j] : NULL;
            grpc_metadata_array_init(&slot->md);
            grpc_call_details_init(&slot->details);
            slot_post(slot);
        }
    }
    for (int t = 0; t < s->n_threads; t++) {
        if (pthread_create(&s->threads[t].thread, NULL, queue_thread_main, &s->threads[t]) != 0) {
            /* rpc_server_destroy still drains: thread 0 at least must exist. */
            if (t == 0) {
                return moe_error_set(err, MOE_ERR_NOMEM, "rpc_server_start: no threads");
            }
            break;
        }
        s->threads[t].running = true;
    }
    return MOE_OK;
}

int rpc_server_port(const struct rpc_server *server)
{
    return server->port;
}

void rpc_server_attach_health(struct rpc_server *server, struct rpc_health *health)
{
    MOE_ASSERT(!server->health);
    server->health = health;
}

struct rpc_health *rpc_server_health(const struct rpc_server *server)
{
    return server->health;
}

/* Marks a registered method as answered while the server drains and not
 * waited for (health probes, long-lived Watch streams). */
void rpc_server_set_drain_exempt(struct rpc_server *server, const char *path)
{
    for (int i = 0; i < server->n_methods; i++)
        if (!strcmp(server->methods[i].path, path))
            server->methods[i].drain_exempt = true;
}

/* Waits on s->cv until no busy call is left or the monotonic deadline.
 * Returns true when none is left. */
static bool wait_calls_idle(struct rpc_server *s, const struct timespec *until)
{
    pthread_mutex_lock(&s->mu);
    while (s->n_busy > 0)
        if (pthread_cond_timedwait(&s->cv, &s->mu, until) == ETIMEDOUT)
            break;
    bool idle = s->n_busy == 0;
    pthread_mutex_unlock(&s->mu);
    return idle;
}

/* Waits, at most timeout_ms, until every byte this process queued on a
 * connection to `port` has been acknowledged by the client (SIOCOUTQ == 0):
 * it is then in the client's kernel, where a later reset of the connection
 * cannot take it away. Call while the queue threads still poll (gRPC moves
 * bytes only then). */
static void wait_output_acked(int port, int timeout_ms)
{
    double t0 = moe_now();
    for (;;) {
        bool pending = false;
        DIR *d = opendir("/proc/self/fd");
        if (!d)
            return;
        struct dirent *de;
        while (!pending && (de = readdir(d))) {
            char *end;
            long fd = strtol(de->d_name, &end, 10);
            if (*end || fd < 0 || fd == dirfd(d))
                continue;
            struct sockaddr_storage a;
            socklen_t alen = sizeof a;
            int type = 0, queued = 0;
            socklen_t len = sizeof type;
            if (getsockopt((int)fd, SOL_SOCKET, SO_TYPE, &type, &len) || type != SOCK_STREAM ||
                getsockname((int)fd, (struct sockaddr *)&a, &alen))
                continue;
            int local = a.ss_family == AF_INET    ? ntohs(((struct sockaddr_in *)&a)->sin_port)
                        : a.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&a)->sin6_port)
                                                  : -1;
            pending = local == port && ioctl((int)fd, SIOCOUTQ, &queued) == 0 && queued > 0;
        }
        closedir(d);
        if (!pending || 1e3 * (moe_now() - t0) >= timeout_ms)
            return;
        struct timespec nap = {0, 2 * 1000 * 1000};
        nanosleep(&nap, NULL);
    }
}

/* Waits on s->cv until `done` or the monotonic deadline (NULL = none).
 * Returns true when done. */
static bool wait_server_done(struct rpc_server *s, const struct timespec *until)
{
    pthread_mutex_lock(&s->mu);
    while (!(s->shutdown_done && s->n_calls == 0)) {
        if (until) {
            if (pthread_cond_timedwait(&s->cv, &s->mu, until) == ETIMEDOUT) {
                break;
            }
        } else {
            pthread_cond_wait(&s->cv, &s->mu);
        }
    }
    bool done = s->shutdown_done && s->n_calls == 0;
    pthread_mutex_unlock(&s->mu);
    return done;
}

void rpc_server_destroy(struct rpc_server *s, int grace_ms)
{
    if (!s) {
        return;
    }
    bool any_thread = s->started && s->threads && s->threads[0].running;
    if (s->srv && s->threads) {
        if (any_thread) {
            /* Drain first, with gRPC's server still fully up: new work is
             * refused (UNAVAILABLE), health probes answered, running calls
             * finish, and their last bytes reach the clients. Only then is
             * gRPC shut down: it closes a connection the moment its last
             * stream ends after GOAWAY, and a close that races the client's
             * window updates resets the connection and loses the stream's
             * tail. */
            struct timespec until;
            clock_gettime(CLOCK_MONOTONIC, &until);
            long long ns = until.tv_nsec + (long long)(grace_ms > 0 ? grace_ms : 0) * 1000000LL;
            until.tv_sec += (time_t)(ns / 1000000000LL);
            until.tv_nsec = (long)(ns % 1000000000LL);
            pthread_mutex_lock(&s->mu);
            s->draining = true;
            pthread_mutex_unlock(&s->mu);
            if (wait_calls_idle(s, &until))
                wait_output_acked(s->port, 2000);
        }
        pthread_mutex_lock(&s->mu);
        s->shutting_down = true;
        pthread_mutex_unlock(&s->mu);
        grpc_server_shutdown_and_notify(s->srv, s->threads[0].cq, &s->shutdown_tag);
        if (any_thread) {
            /* What is left: health Watch streams, and calls that outlived
             * the grace period. */
            grpc_server_cancel_all_calls(s->srv);
            wait_server_done(s, NULL);
        } else {
            /* Never started (or no thread): nothing but the shutdown tag can come. */
            grpc_server_cancel_all_calls(s->srv);
            for (;;) {
                grpc_event ev = grpc_completion_queue_next(
                    s->threads[0].cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
                if (ev.type == GRPC_OP_COMPLETE && ev.tag == &s->shutdown_tag) {
                    break;
                }
                if (ev.type == GRPC_QUEUE_SHUTDOWN) {
                    break;
                }
            }
        }
    }
    for (int t = 0; s->threads && t < s->n_threads; t++) {
        if (s->threads[t].cq) {
            grpc_completion_queue_shutdown(s->threads[t].cq);
            if (!s->threads[t].running) {
                while (grpc_completion_queue_next(s->threads[t].cq,
                                                  gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL)
                           .type != GRPC_QUEUE_SHUTDOWN) {
                }
            }
        }
    }
    for (int t = 0; s->threads && t < s->n_threads; t++) {
        if (s->threads[t].running) {
            pthread_join(s->threads[t].thread, NULL);
        }
    }
    if (s->srv) {
        grpc_server_destroy(s->srv);
    }
    for (int t = 0; s->threads && t < s->n_threads; t++) {
        if (s->threads[t].cq) {
            grpc_completion_queue_destroy(s->threads[t].cq);
        }
    }
    for (int i = 0; i < s->n_slots; i++) {
        struct rpc_slot *slot = &s->slots[i];
        grpc_metadata_array_destroy(&slot->md);
        grpc_call_details_destroy(&slot->details);
        if (slot->payload) {
            grpc_byte_buffer_destroy(slot->payload);
        }
    }
    free(s->slots);
    for (int i = 0; i < s->n_methods; i++) {
        free(s->methods[i].path);
    }
    free(s->methods);
    for (int i = 0; i < s->n_rules; i++)
        free(s->rules[i].prefix);
    free(s->rules);
    free(s->threads);
    rpc_health_free(s->health);
    pthread_mutex_destroy(&s->tls_mu);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
    grpc_shutdown();
}
