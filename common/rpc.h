/* A small gRPC layer over the gRPC C core: a server with unary and
 * server-streaming methods, the standard health service, and blocking client
 * helpers. Messages cross this API as raw bytes (serialized protobuf-c
 * messages); this layer never looks inside them, except in the health
 * service.
 *
 * Threads. A server runs n_threads completion-queue threads. Handlers run on
 * them and must return quickly: parse, validate, enqueue work, maybe answer.
 * Never run model compute or block on a lock held for long inside a handler.
 * Answers may come later from any thread (rpc_call_finish, rpc_stream_send,
 * rpc_stream_finish are thread-safe and never block on the network).
 *
 * Ownership in one picture:
 *   unary handler  -> gets a struct rpc_call *; exactly one rpc_call_finish
 *                     (from any thread, now or later) answers and gives the
 *                     handle back. The handle is invalid after that call.
 *   stream handler -> gets a struct rpc_stream * holding one reference for
 *                     the caller; any number of rpc_stream_send, then one
 *                     rpc_stream_finish, then rpc_stream_release (every
 *                     rpc_stream_ref needs one more release). After the last
 *                     release the handle is invalid; the layer frees the call
 *                     state once gRPC is done with it too.
 *   request bytes  -> borrowed, valid only during the handler call.
 *   sent bytes     -> copied; the caller keeps its buffer.
 *
 * Shutdown. rpc_server_destroy drains first: new calls are answered
 * UNAVAILABLE (health probes still answered), running calls get up to the
 * grace period to end, and their last bytes reach the clients; then gRPC is
 * shut down and what is left (health Watch streams, calls past the grace) is
 * cancelled (producers see on_cancel / rpc_stream_is_cancelled); then it
 * waits until every producer released its stream. A producer that never
 * releases makes rpc_server_destroy wait forever. */
#ifndef MOE_RPC_H
#define MOE_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe_error.h"

struct moe_tls;    /* tls_opts.h */
struct moe_tokens; /* auth_token.h */

/* gRPC status codes, same values as grpc_status_code. */
enum rpc_code {
    RPC_OK = 0,
    RPC_CANCELLED = 1,
    RPC_UNKNOWN = 2,
    RPC_INVALID_ARGUMENT = 3,
    RPC_DEADLINE_EXCEEDED = 4,
    RPC_NOT_FOUND = 5,
    RPC_ALREADY_EXISTS = 6,
    RPC_PERMISSION_DENIED = 7,
    RPC_RESOURCE_EXHAUSTED = 8,
    RPC_FAILED_PRECONDITION = 9,
    RPC_ABORTED = 10,
    RPC_OUT_OF_RANGE = 11,
    RPC_UNIMPLEMENTED = 12,
    RPC_INTERNAL = 13,
    RPC_UNAVAILABLE = 14,
    RPC_DATA_LOSS = 15,
    RPC_UNAUTHENTICATED = 16,
};

/* Upper-case name of a code ("DEADLINE_EXCEEDED"); "?" for unknown values. */
const char *rpc_code_name(enum rpc_code code);

/* The code a server answers for a failure of status `st`: bad input ->
 * INVALID_ARGUMENT, missing -> NOT_FOUND, I/O -> UNAVAILABLE, out of memory
 * -> RESOURCE_EXHAUSTED, not yet -> FAILED_PRECONDITION, unsupported ->
 * UNIMPLEMENTED, a broken invariant -> INTERNAL. */
enum rpc_code rpc_code_from_status(enum moe_status st);

/* Packs a protobuf-c message (any generated struct, passed as its base)
 * into a malloc'd buffer of *len bytes; NULL when out of memory. */
void *rpc_pack(const void *msg, size_t *len);

struct rpc_call;

/* Answers a unary call OK with protobuf-c message `msg` (packed here;
 * RESOURCE_EXHAUSTED if that runs out of memory). */
void rpc_call_finish_msg(struct rpc_call *call, const void *msg);

/* The request of a unary call: `bytes` unpacked as `desc` (a generated
 * descriptor, e.g. &moe__v1__abort_request__descriptor) with every string
 * field checked (moe_check_strings). NULL after answering the call
 * INVALID_ARGUMENT with what is wrong ("request: not a valid
 * moe.v1.AbortRequest", or the field path). The caller frees the message
 * (its generated free_unpacked). */
struct ProtobufCMessageDescriptor;
void *rpc_call_unpack(struct rpc_call *call, const struct ProtobufCMessageDescriptor *desc,
                      const uint8_t *bytes, size_t len);

#define RPC_DEFAULT_MAX_MESSAGE ((size_t)64 << 20)

/* ---- server ------------------------------------------------------------------ */

struct rpc_server;
struct rpc_call;   /* one unary call */
struct rpc_stream; /* one server-streaming call */

struct rpc_server_options {
    size_t max_message_bytes; /* send and receive limit; 0 = RPC_DEFAULT_MAX_MESSAGE */
    size_t max_receive_bytes; /* a tighter receive limit (the largest valid request, see
                                 request_check.h); larger messages are refused with
                                 RESOURCE_EXHAUSTED before any handler; 0 = max_message_bytes */
    int keepalive_time_ms;    /* ping an idle connection after this; 0 = 20000 */
    int keepalive_timeout_ms; /* drop it if the ping is not answered; 0 = 10000 */
    /* TLS (tls_opts.h; borrowed, must outlive the server); NULL = plaintext.
     * Every new connection gets the newest certificate: a moe_tls_reload is
     * seen by the next handshake. */
    struct moe_tls *tls;
    /* With tls: require a client certificate that chains to tls's CA
     * (mutual TLS); a client without one fails its handshake. */
    bool tls_client_auth;
};

/* Unary handler: `req` (len bytes) is borrowed for the duration of the call.
 * The handler (or whoever it hands `call` to) must call rpc_call_finish
 * exactly once. */
typedef void (*rpc_unary_fn)(struct rpc_call *call, const uint8_t *req, size_t len, void *user);

/* Server-streaming handler: `req` is borrowed for the duration of the call;
 * `stream` comes with one reference owned by the handler (see above). */
typedef void (*rpc_stream_fn)(struct rpc_stream *stream, const uint8_t *req, size_t len,
                              void *user);

/* Creates a server listening on `addr` ("127.0.0.1:0" picks a free port, see
 * rpc_server_port) with n_threads completion-queue threads (>= 1). `opts` may
 * be NULL for defaults. Calls grpc_init (undone by rpc_server_destroy).
 * Returns NULL and fills `err` on failure (bad address, port in use). */
struct rpc_server *rpc_server_create(const char *addr, int n_threads,
                                     const struct rpc_server_options *opts, struct moe_error *err);

/* Registers a method by its full path ("/moe.v1.Inference/Generate"), before
 * rpc_server_start. `user` is passed to every handler call and must outlive
 * the server. Calls to unregistered paths are answered UNIMPLEMENTED. */
enum moe_status rpc_server_add_unary(struct rpc_server *server, const char *path, rpc_unary_fn fn,
                                     void *user, struct moe_error *err);
enum moe_status rpc_server_add_stream(struct rpc_server *server, const char *path, rpc_stream_fn fn,
                                      void *user, struct moe_error *err);

/* Requires "authorization: Bearer <token>" metadata with one of `tokens`
 * (borrowed, must outlive the server) on every call whose path starts with
 * `prefix` ("/moe.v1.Admin/"), registered or not, before its handler runs:
 * a call without it, or with another token, is answered UNAUTHENTICATED
 * (with the request unread). Paths under no prefix need nothing (health
 * probes). A path under two prefixes needs the longest one's token. Before
 * rpc_server_start. */
enum moe_status rpc_server_require_token(struct rpc_server *server, const char *prefix,
                                         struct moe_tokens *tokens, struct moe_error *err);

/* Starts serving: spawns the queue threads. */
enum moe_status rpc_server_start(struct rpc_server *server, struct moe_error *err);

/* The bound TCP port. */
int rpc_server_port(const struct rpc_server *server);

/* Stops accepting calls, lets running calls end for up to grace_ms, cancels
 * the rest, waits until every stream was released, joins the threads, frees
 * everything and calls grpc_shutdown. Must not be called from a handler or
 * on_cancel callback. NULL is a no-op. */
void rpc_server_destroy(struct rpc_server *server, int grace_ms);

/* ---- unary calls --------------------------------------------------------------- */

/* Answers the call: with code RPC_OK the response `bytes` (len bytes, copied;
 * NULL/0 = an empty message), otherwise the status `message` (may be NULL;
 * copied) and no response. Callable from any thread, exactly once; `call` is
 * invalid afterwards. If the client has gone, the answer is dropped. */
void rpc_call_finish(struct rpc_call *call, enum rpc_code code, const char *message,
                     const void *bytes, size_t len);

/* 1 once the client cancelled, its deadline passed or the server is shutting
 * down the call. */
int rpc_call_is_cancelled(struct rpc_call *call);

/* Milliseconds until the client's deadline (<= 0: passed); INT64_MAX if none. */
int64_t rpc_call_deadline_ms_left(struct rpc_call *call);

/* Copies the first value of request metadata `key` (lower case) into buf as
 * a NUL-terminated string, truncated to cap. Returns the full value length,
 * or -1 if absent. */
int rpc_call_metadata(struct rpc_call *call, const char *key, char *buf, size_t cap);

/* ---- server streams ------------------------------------------------------------- */

/* Queues one message (len bytes, copied) behind those already queued and
 * returns at once; messages go out in order, one at a time. Any thread.
 * Returns MOE_OK, MOE_ERR_IO if the client is gone (cancelled, deadline, send
 * failed: stop producing), MOE_ERR_INVALID after rpc_stream_finish, or
 * MOE_ERR_NOMEM. */
enum moe_status rpc_stream_send(struct rpc_stream *stream, const void *bytes, size_t len);

/* Queues the trailing status after the queued messages (message may be NULL;
 * copied). Any thread; a second call is ignored, and so is a call after the
 * client has gone. Does not release the stream. */
void rpc_stream_finish(struct rpc_stream *stream, enum rpc_code code, const char *message);

/* 1 once the client cancelled, its deadline passed, a send failed or the
 * server cancelled the call while shutting down. */
int rpc_stream_is_cancelled(struct rpc_stream *stream);

/* Bytes queued and not yet handed to gRPC (for producer back-pressure). */
size_t rpc_stream_queued_bytes(struct rpc_stream *stream);

typedef void (*rpc_cancel_fn)(struct rpc_stream *stream, void *user);

/* Sets a callback fired once, from a queue thread, when the call is
 * cancelled (client gone, deadline, server shutdown) — never after a normal
 * finish. If the stream is already cancelled, fn runs at once in the calling
 * thread. The callback must be quick; it may call any rpc_stream_* function
 * on this stream, including rpc_stream_release. It never fires after the
 * last release; a release from another thread waits while it runs. */
void rpc_stream_set_on_cancel(struct rpc_stream *stream, rpc_cancel_fn fn, void *user);

/* Milliseconds until the client's deadline (<= 0: passed); INT64_MAX if none. */
int64_t rpc_stream_deadline_ms_left(struct rpc_stream *stream);

/* As rpc_call_metadata. */
int rpc_stream_metadata(struct rpc_stream *stream, const char *key, char *buf, size_t cap);

/* Adds a reference (for a second holder). */
void rpc_stream_ref(struct rpc_stream *stream);

/* Drops a reference. Releasing the last one without rpc_stream_finish
 * finishes the stream with RPC_INTERNAL "stream released without a status". */
void rpc_stream_release(struct rpc_stream *stream);

/* ---- health (grpc.health.v1.Health) ---------------------------------------------- */

enum rpc_health_status {
    RPC_HEALTH_UNKNOWN = 0,
    RPC_HEALTH_SERVING = 1,
    RPC_HEALTH_NOT_SERVING = 2,
    RPC_HEALTH_SERVICE_UNKNOWN = 3, /* Watch only */
};

/* Registers /grpc.health.v1.Health/Check and /Watch on the server (before
 * rpc_server_start), with service "" (the whole server) SERVING. Check of an
 * unknown service answers NOT_FOUND; Watch sends the current status, then
 * every change, until the client goes away. */
enum moe_status rpc_health_register(struct rpc_server *server, struct moe_error *err);

/* Sets the status of `service` ("" = the whole server; copied), adding it if
 * new, and notifies watchers. Any thread, also while serving. */
void rpc_health_set(struct rpc_server *server, const char *service, enum rpc_health_status status);

/* ---- client ------------------------------------------------------------------------ */

struct rpc_client;        /* one channel */
struct rpc_client_stream; /* one server-streaming call */

struct rpc_client_options {
    size_t max_message_bytes; /* 0 = RPC_DEFAULT_MAX_MESSAGE */
    int keepalive_time_ms;    /* ping the server after this long idle; 0 = 20000 */
    int keepalive_timeout_ms; /* a dead peer is noticed after this; 0 = 10000 */
    /* TLS (tls_opts.h): the server must present a certificate for the host
     * of `target` (or tls's server name) that chains to tls's CA (the
     * system's roots without one); tls's certificate, when it has one, is
     * the client certificate. The newest material when the channel is made
     * is used for the channel's life. NULL = plaintext. */
    struct moe_tls *tls;
    /* Sent as "authorization: Bearer <token>" on every call (copied); NULL =
     * none. */
    const char *token;
};

/* Creates a channel to `target` ("host:port"), plaintext or TLS (opts->tls).
 * It connects lazily, on the first call. `opts` may be NULL. Calls grpc_init
 * (undone by rpc_client_destroy). Returns NULL and fills err on failure. */
struct rpc_client *rpc_client_create(const char *target, const struct rpc_client_options *opts,
                                     struct moe_error *err);

/* Destroys the channel; every rpc_client_stream on it must be destroyed
 * first. NULL is a no-op. */
void rpc_client_destroy(struct rpc_client *client);

/* The result of a unary call. `data` is malloc'ed (caller frees it with
 * rpc_reply_clear), NULL unless code == RPC_OK. */
struct rpc_reply {
    enum rpc_code code;
    char message[256]; /* status message, possibly truncated */
    uint8_t *data;
    size_t len;
};

/* Blocking unary call of `method` ("/moe.v1.Inference/GetModelInfo") with
 * request bytes `req` (len bytes, borrowed) and a deadline timeout_ms from
 * now (<= 0: none). Fills *reply (always) and returns reply->code.
 * Thread-safe: any number of threads may call concurrently on one client. */
enum rpc_code rpc_client_call(struct rpc_client *client, const char *method, const void *req,
                              size_t len, int64_t timeout_ms, struct rpc_reply *reply);

/* Frees reply->data and resets it. NULL is a no-op. */
void rpc_reply_clear(struct rpc_reply *reply);

/* Starts a server-streaming call with request bytes `req` (borrowed) and a
 * deadline timeout_ms from now (<= 0: none). Returns NULL and fills err only
 * on local failure; server-side failures show up as the final status. */
struct rpc_client_stream *rpc_client_stream_start(struct rpc_client *client, const char *method,
                                                  const void *req, size_t len, int64_t timeout_ms,
                                                  struct moe_error *err);

/* Blocks for the next message. Returns 1 with data and len set (owned by the
 * stream, valid until the next call or destroy), or 0 at the end of the
 * stream (normal or not): then rpc_client_stream_status tells why. Call from
 * one thread at a time. */
int rpc_client_stream_next(struct rpc_client_stream *stream, const uint8_t **data, size_t *len);

/* The final status once rpc_client_stream_next returned 0 (RPC_UNKNOWN
 * before); *message (may be NULL) is owned by the stream. */
enum rpc_code rpc_client_stream_status(const struct rpc_client_stream *stream,
                                       const char **message);

/* Cancels the call; callable from any thread, also while another thread is
 * blocked in rpc_client_stream_next (which then returns 0 with
 * RPC_CANCELLED). */
void rpc_client_stream_cancel(struct rpc_client_stream *stream);

/* Cancels the call if it has not ended, waits for gRPC to let go of it and
 * frees it. NULL is a no-op. */
void rpc_client_stream_destroy(struct rpc_client_stream *stream);

#endif
