/* A small HTTP/1.1 server over libmicrohttpd for the coordinator's OpenAI API
 * and every process's /metrics: exact-path routes, request bodies up to a
 * limit (413 above it), answers given now or later from any thread, and
 * streamed (chunked) answers for Server-Sent Events.
 *
 * Threads. libmicrohttpd runs a pool of `threads` polling threads (epoll);
 * handlers run on them and must return quickly, as rpc.h handlers do. A
 * request whose answer is not ready when its handler returns is suspended
 * (taken out of the poll set), and so is a stream with nothing to send: no
 * thread waits on an idle request, however many there are. Keep-alive
 * connections idle longer than idle_timeout_s are closed.
 *
 * Ownership in one picture (like rpc_stream in rpc.h):
 *   handler  -> gets a struct http_request * owned by the application until
 *               it calls exactly one of http_respond / http_respond_error
 *               (a whole answer) or http_stream_begin ... http_stream_end
 *               (a streamed one), from any thread, now or later. The handle
 *               is invalid after that call.
 *   body     -> owned by the request, valid until the answer.
 *   answers  -> copied.
 *   on_close -> fires at most once, on a polling thread, when the client
 *               goes away before the answer was complete (writes then fail);
 *               the application must still end the request (also from inside
 *               on_close). It never fires after the answer's end; an end
 *               from another thread waits while it runs.
 *
 * TLS and tokens. With opts.tls the server speaks HTTPS only (libmicrohttpd
 * over GnuTLS); each handshake gets the newest certificate of the shared
 * TLS settings (tls_opts.h), so a moe_tls_reload is seen by the next
 * connection. With opts.tokens every request needs "Authorization: Bearer
 * <token>" with one of them, checked before any handler runs, except on
 * routes added with http_server_route_open (health probes): a request
 * without it, or with another token, gets 401 in OpenAI's error shape
 * (type "invalid_request_error", code 401, WWW-Authenticate: Bearer).
 *
 * Shutdown. http_server_destroy stops accepting, gives running requests
 * grace_ms, then fires on_close on those left and waits until the
 * application ended every one of them. */
#ifndef MOE_HTTP_SERVER_H
#define MOE_HTTP_SERVER_H

#include <stdbool.h>
#include <stddef.h>

#include "moe_error.h"

struct moe_tls;    /* tls_opts.h */
struct moe_tokens; /* auth_token.h */
struct http_server;
struct http_request;

struct http_server_opts {
    const char *listen;        /* "HOST:PORT" ("127.0.0.1:0": a free port) */
    int threads;               /* polling threads; 0 = 2 */
    size_t max_body_bytes;     /* larger request bodies get 413; 0 = 4 MiB */
    int idle_timeout_s;        /* idle connections are closed after this; 0 = 60 */
    unsigned max_connections;  /* 0 = 1024 */
    const char *name;          /* for log lines ("moe-coordinator"); NULL = "http-server" */
    struct moe_tls *tls;       /* HTTPS (borrowed, outlives the server); NULL = plain HTTP */
    struct moe_tokens *tokens; /* bearer tokens (borrowed); NULL = no token needed */
};

/* A handler: rq is owned by the handler from here on (see above). */
typedef void (*http_handler_fn)(struct http_request *rq, void *user);

/* Makes a server for `opts` (copied; nothing is bound yet). NULL and err on
 * a bad option. */
struct http_server *http_server_create(const struct http_server_opts *opts, struct moe_error *err);

/* Routes `method` ("GET", "POST"; GET also answers HEAD) on the exact `path`
 * to fn (before http_server_start). Unknown paths get 404 and known paths
 * with another method 405 (with Allow), both as OpenAI-shaped JSON errors. */
enum moe_status http_server_route(struct http_server *s, const char *method, const char *path,
                                  http_handler_fn fn, void *user, struct moe_error *err);

/* As http_server_route, for a route that needs no token (health probes,
 * /version, /metrics). */
enum moe_status http_server_route_open(struct http_server *s, const char *method, const char *path,
                                       http_handler_fn fn, void *user, struct moe_error *err);

/* Binds and starts the polling threads. MOE_ERR_IO naming the address when
 * it cannot bind. */
enum moe_status http_server_start(struct http_server *s, struct moe_error *err);

/* The bound port (after start). */
int http_server_port(const struct http_server *s);

/* Stops accepting connections (the first step of destroy, for a caller that
 * shuts other servers down meanwhile); requests on open connections are
 * still served. Idempotent. */
void http_server_quiesce(struct http_server *s);

/* Stops (see above) and frees. Not from a handler or on_close. NULL is a
 * no-op. */
void http_server_destroy(struct http_server *s, int grace_ms);

/* ---- one request ------------------------------------------------------------------ */

const char *http_request_method(const struct http_request *rq);
const char *http_request_path(const struct http_request *rq);

/* A request header (case-insensitive name), or NULL. Only inside the
 * handler call. */
const char *http_request_header(struct http_request *rq, const char *name);

/* A query-string argument, or NULL. Only inside the handler call. */
const char *http_request_query(struct http_request *rq, const char *name);

/* The body (NUL-terminated; *len without the NUL; "" when none). */
const char *http_request_body(const struct http_request *rq, size_t *len);

/* Whole answers: status, content type and body (copied). Ends the request. */
void http_respond(struct http_request *rq, int status, const char *content_type, const char *body,
                  size_t len);

/* An error in OpenAI's shape {"error": {"message", "type", "param", "code"}}
 * with code = the status; `param` may be NULL (JSON null). Ends the request. */
void http_respond_error(struct http_request *rq, int status, const char *type, const char *param,
                        const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* The JSON error body above (malloc'd), for callers that send it in a
 * stream. */
char *http_error_json(int status, const char *type, const char *param, const char *message);

/* Streamed answers: the status line and headers go out now (chunked
 * transfer encoding), then every write in order as soon as the client can
 * take it. */
void http_stream_begin(struct http_request *rq, int status, const char *content_type);

/* Queues bytes (copied). MOE_ERR_IO once the client is gone (or more than
 * 8 MiB wait for a client that does not read), else MOE_OK. */
enum moe_status http_stream_write(struct http_request *rq, const char *data, size_t len);

/* Ends the stream after the queued bytes. Ends the request. */
void http_stream_end(struct http_request *rq);

/* True once the client is known to be gone. While a request waits (its
 * connection suspended) libmicrohttpd does not watch the socket, so this
 * also looks: a peer that closed its end (EOF or an error on a peek) counts
 * as gone. It looks at most every 50 ms per request, so producers may call
 * it for every token. on_close does not fire for a client found gone here:
 * the caller stops on its own. Any thread. */
bool http_request_client_gone(struct http_request *rq);

typedef void (*http_close_fn)(struct http_request *rq, void *user);

/* Sets the client-gone callback; if the client is already gone it runs at
 * once in the calling thread. */
void http_request_set_on_close(struct http_request *rq, http_close_fn fn, void *user);

#endif
