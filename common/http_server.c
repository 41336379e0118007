/* The HTTP server over libmicrohttpd (see http_server.h).
 *
 * A request's life inside libmicrohttpd: the access handler (on_access) is
 * called once with the headers, once per piece of body, and once more with
 * no body left, where the route's handler runs. If the answer is not there
 * when it returns, the connection is suspended; the answer (any thread)
 * resumes it and on_access runs again and queues it. A streamed answer is a
 * response whose content reader (stream_read) hands out the queued bytes
 * and suspends the connection when there are none; a write resumes it.
 * on_completed ends libmicrohttpd's part.
 *
 * Each request has two references: libmicrohttpd's (dropped in
 * on_completed) and the application's (dropped by the answer's end). Every
 * field below `mu` is guarded by it; suspend and resume are called under it,
 * so a resume never precedes its suspend, and never after on_completed
 * (conn is NULL from then on). */
#include "http_server.h"
#include "hostport.h"
#include "auth_token.h"
#include "clock.h"
#include "tls_opts.h"

#include <arpa/inet.h>
#include <errno.h>
#include <cjson/cJSON.h>
#include <gnutls/abstract.h>
#include <gnutls/gnutls.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_MAX_BODY ((size_t)4 << 20)
#define MAX_PENDING_STREAM ((size_t)8 << 20)
#define MAX_ROUTES 32

struct route {
    char method[8];
    char *path;
    http_handler_fn fn;
    void *user;
    bool open; /* no token needed */
};

/* One generation of the TLS material in GnuTLS's form (tls_gen_current). */
struct tls_gen {
    uint64_t generation;
    gnutls_pcert_st pcert[16];
    unsigned n_pcert;
    gnutls_privkey_t key;
    struct tls_gen *prev;
};

struct http_server {
    struct http_server_opts opts;
    char listen[300];
    char name[64];
    struct route routes[MAX_ROUTES];
    int n_routes;
    struct MHD_Daemon *d;
    int port;
    bool quiesced;
    int quiesced_fd;         /* the listening socket MHD_quiesce_daemon handed back, or -1 */
    struct tls_gen *tls_cur; /* tls_mu; older ones hang off ->prev until destroy */
    pthread_mutex_t tls_mu;
    struct http_server *tls_next; /* tls_servers_mu: the HTTPS servers of the process */

    pthread_mutex_t mu; /* guards the list and counts below */
    pthread_cond_t cond;
    struct http_request *reqs; /* requests the application holds */
    int n_app;                 /* of those */
    int n_live;                /* requests libmicrohttpd holds */
};

struct http_request {
    struct http_server *srv;
    char method[16];
    char *path;
    char *body; /* (body_len + 1) */
    size_t body_len;
    bool too_large;
    bool dispatched;
    bool in_handler; /* only the polling thread in on_access reads it */

    pthread_mutex_t mu;
    pthread_cond_t cond;
    struct MHD_Connection *conn; /* mu; NULL once libmicrohttpd is done */
    int refs;                    /* mu */
    bool app_done;               /* mu: the application ended the request */
    bool suspended;              /* mu */
    bool queued;                 /* mu: a response was queued */
    bool gone;                   /* mu: the client went away */
    /* mu: the answer */
    enum { ANS_NONE, ANS_FULL, ANS_STREAM } ans;
    int status;
    char content_type[96];
    char allow[32]; /* 405: the Allow header */
    char *resp;     /* a whole answer (resp_len) */
    size_t resp_len;
    char *pend; /* stream bytes not yet handed out: [pend_off, pend_len) */
    size_t pend_len, pend_off, pend_cap;
    bool ended;             /* stream: no more writes */
    http_close_fn on_close; /* mu */
    void *on_close_user;
    bool close_fired, in_close;
    pthread_t close_thread; /* mu: the thread running on_close */
    double last_peek;       /* mu: http_request_client_gone's last look */

    struct http_request *next; /* srv->mu: srv->reqs */
};

/* ---- lifetimes ------------------------------------------------------------------------ */

static void req_free(struct http_request *rq)
{
    free(rq->path);
    free(rq->body);
    free(rq->resp);
    free(rq->pend);
    pthread_mutex_destroy(&rq->mu);
    pthread_cond_destroy(&rq->cond);
    free(rq);
}

/* Drops one reference; caller holds rq->mu, which is released. */
static void req_unref_unlock(struct http_request *rq)
{
    int left = --rq->refs;
    pthread_mutex_unlock(&rq->mu);
    if (left == 0)
        req_free(rq);
}

/* Resumes the connection if it waits; caller holds rq->mu. */
static void maybe_resume(struct http_request *rq)
{
    if (rq->suspended && rq->conn) {
        rq->suspended = false;
        MHD_resume_connection(rq->conn);
    }
}

/* The application's end: waits for a running on_close, resumes, unlinks and
 * drops the application's reference. Caller holds rq->mu (released). */
static void app_end_locked(struct http_request *rq)
{
    /* An end from inside on_close itself must not wait for it. */
    while (rq->in_close && !pthread_equal(rq->close_thread, pthread_self()))
        pthread_cond_wait(&rq->cond, &rq->mu);
    rq->app_done = true;
    maybe_resume(rq);
    /* Lock order is srv->mu before rq->mu (destroy scans the list): our
     * reference keeps rq while neither is held. */
    pthread_mutex_unlock(&rq->mu);
    struct http_server *s = rq->srv;
    pthread_mutex_lock(&s->mu);
    for (struct http_request **p = &s->reqs; *p; p = &(*p)->next)
        if (*p == rq) {
            *p = rq->next;
            break;
        }
    s->n_app--;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_lock(&rq->mu);
    req_unref_unlock(rq);
}

/* Fires on_close once if the application still holds rq. Caller holds rq->mu. */
static void fire_close_locked(struct http_request *rq)
{
    if (rq->app_done || rq->close_fired || !rq->on_close)
        return;
    rq->close_fired = true;
    rq->in_close = true;
    rq->close_thread = pthread_self();
    http_close_fn fn = rq->on_close;
    void *user = rq->on_close_user;
    pthread_mutex_unlock(&rq->mu);
    fn(rq, user);
    pthread_mutex_lock(&rq->mu);
    rq->in_close = false;
    pthread_cond_broadcast(&rq->cond);
}

/* ---- the application's side ---------------------------------------------------------- */

const char *http_request_method(const struct http_request *rq)
{
    return rq->method;
}

const char *http_request_path(const struct http_request *rq)
{
    return rq->path;
}

const char *http_request_header(struct http_request *rq, const char *name)
{
    return rq->conn ? MHD_lookup_connection_value(rq->conn, MHD_HEADER_KIND, name) : NULL;
}

const char *http_request_query(struct http_request *rq, const char *name)
{
    return rq->conn ? MHD_lookup_connection_value(rq->conn, MHD_GET_ARGUMENT_KIND, name) : NULL;
}

const char *http_request_body(const struct http_request *rq, size_t *len)
{
    if (len)
        *len = rq->body_len;
    return rq->body ? rq->body : "";
}

static void set_content_type(struct http_request *rq, const char *ct)
{
    snprintf(rq->content_type, sizeof rq->content_type, "%s", ct ? ct : "application/json");
}

void http_respond(struct http_request *rq, int status, const char *content_type, const char *body,
                  size_t len)
{
    char *copy = malloc(len + 1);
    if (copy) {
        if (len)
            memcpy(copy, body, len);
        copy[len] = '\0';
    } else {
        status = 500;
        len = 0;
    }
    pthread_mutex_lock(&rq->mu);
    if (rq->ans != ANS_NONE) { /* a second answer: a bug in the caller; keep the first */
        pthread_mutex_unlock(&rq->mu);
        free(copy);
        return;
    }
    rq->ans = ANS_FULL;
    rq->status = status;
    set_content_type(rq, content_type);
    rq->resp = copy;
    rq->resp_len = copy ? len : 0;
    app_end_locked(rq);
}

char *http_error_json(int status, const char *type, const char *param, const char *message)
{
    cJSON *root = cJSON_CreateObject();
    cJSON *e = cJSON_AddObjectToObject(root, "error");
    char *out = NULL;
    if (e && cJSON_AddStringToObject(e, "message", message) &&
        cJSON_AddStringToObject(e, "type", type) &&
        (param ? cJSON_AddStringToObject(e, "param", param) != NULL
               : cJSON_AddNullToObject(e, "param") != NULL) &&
        cJSON_AddNumberToObject(e, "code", status))
        out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}

void http_respond_error(struct http_request *rq, int status, const char *type, const char *param,
                        const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char *body = http_error_json(status, type, param, msg);
    static const char fallback[] = "{\"error\":{\"message\":\"out of memory\",\"type\":"
                                   "\"server_error\",\"param\":null,\"code\":500}}";
    if (body)
        http_respond(rq, status, "application/json", body, strlen(body));
    else
        http_respond(rq, 500, "application/json", fallback, sizeof fallback - 1);
    free(body);
}

void http_stream_begin(struct http_request *rq, int status, const char *content_type)
{
    pthread_mutex_lock(&rq->mu);
    if (rq->ans == ANS_NONE) {
        rq->ans = ANS_STREAM;
        rq->status = status;
        set_content_type(rq, content_type);
        maybe_resume(rq);
    }
    pthread_mutex_unlock(&rq->mu);
}

enum moe_status http_stream_write(struct http_request *rq, const char *data, size_t len)
{
    enum moe_status st = MOE_OK;
    pthread_mutex_lock(&rq->mu);
    if (rq->gone || rq->ans != ANS_STREAM || rq->ended) {
        st = MOE_ERR_IO;
    } else if (rq->pend_len - rq->pend_off + len > MAX_PENDING_STREAM) {
        st = MOE_ERR_IO; /* the client does not read */
    } else if (len) {
        if (rq->pend_off && rq->pend_off == rq->pend_len)
            rq->pend_off = rq->pend_len = 0;
        if (rq->pend_len + len > rq->pend_cap) {
            size_t cap = rq->pend_cap ? rq->pend_cap : 4096;
            while (cap < rq->pend_len + len)
                cap *= 2;
            char *p = realloc(rq->pend, cap);
            if (!p) {
                pthread_mutex_unlock(&rq->mu);
                return MOE_ERR_NOMEM;
            }
            rq->pend = p;
            rq->pend_cap = cap;
        }
        memcpy(rq->pend + rq->pend_len, data, len);
        rq->pend_len += len;
        maybe_resume(rq);
    }
    pthread_mutex_unlock(&rq->mu);
    return st;
}

void http_stream_end(struct http_request *rq)
{
    pthread_mutex_lock(&rq->mu);
    if (rq->ans == ANS_NONE) { /* ended before it began: an empty 500 */
        rq->ans = ANS_FULL;
        rq->status = 500;
        set_content_type(rq, "application/json");
    }
    rq->ended = true;
    app_end_locked(rq);
}

void http_request_set_on_close(struct http_request *rq, http_close_fn fn, void *user)
{
    pthread_mutex_lock(&rq->mu);
    rq->on_close = fn;
    rq->on_close_user = user;
    if (rq->gone)
        fire_close_locked(rq);
    pthread_mutex_unlock(&rq->mu);
}

bool http_request_client_gone(struct http_request *rq)
{
    pthread_mutex_lock(&rq->mu);
    if (!rq->gone && rq->conn && rq->suspended) {
        double now = moe_now();
        if (now - rq->last_peek >= 0.05) {
            rq->last_peek = now;
            const union MHD_ConnectionInfo *ci =
                MHD_get_connection_info(rq->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
            char b;
            ssize_t n = ci ? recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) : 1;
            if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
                rq->gone = true;
                rq->close_fired = true; /* the caller learns it from here */
            }
        }
    }
    bool gone = rq->gone;
    pthread_mutex_unlock(&rq->mu);
    return gone;
}

/* ---- libmicrohttpd's side ------------------------------------------------------------- */

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    struct http_request *rq = cls;
    pthread_mutex_lock(&rq->mu);
    if (rq->pend_len > rq->pend_off) {
        size_t n = rq->pend_len - rq->pend_off;
        if (n > max)
            n = max;
        memcpy(buf, rq->pend + rq->pend_off, n);
        rq->pend_off += n;
        pthread_mutex_unlock(&rq->mu);
        return (ssize_t)n;
    }
    if (rq->ended) {
        pthread_mutex_unlock(&rq->mu);
        return MHD_CONTENT_READER_END_OF_STREAM;
    }
    rq->suspended = true;
    MHD_suspend_connection(rq->conn);
    pthread_mutex_unlock(&rq->mu);
    return 0;
}

/* Queues the answer if there is one, else suspends. Called on the polling
 * thread inside on_access. */
static enum MHD_Result queue_or_suspend(struct MHD_Connection *conn, struct http_request *rq)
{
    pthread_mutex_lock(&rq->mu);
    if (rq->queued) {
        pthread_mutex_unlock(&rq->mu);
        return MHD_YES;
    }
    struct MHD_Response *resp = NULL;
    if (rq->ans == ANS_FULL) {
        resp = MHD_create_response_from_buffer(rq->resp_len, rq->resp ? rq->resp : (void *)"",
                                               MHD_RESPMEM_MUST_COPY);
    } else if (rq->ans == ANS_STREAM) {
        resp =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_read, rq, NULL);
        if (resp) {
            MHD_add_response_header(resp, "Cache-Control", "no-cache");
            MHD_add_response_header(resp, "X-Accel-Buffering", "no");
        }
    } else {
        rq->suspended = true;
        MHD_suspend_connection(conn);
        pthread_mutex_unlock(&rq->mu);
        return MHD_YES;
    }
    rq->queued = true;
    int status = rq->status;
    if (resp) {
        MHD_add_response_header(resp, "Content-Type", rq->content_type);
        if (rq->allow[0])
            MHD_add_response_header(resp, "Allow", rq->allow);
        if (status == 401)
            MHD_add_response_header(resp, "WWW-Authenticate", "Bearer");
    }
    pthread_mutex_unlock(&rq->mu);
    if (!resp)
        return MHD_NO; /* no memory: close the connection */
    enum MHD_Result r = MHD_queue_response(conn, (unsigned)status, resp);
    MHD_destroy_response(resp);
    return r;
}

/* Gives the request to the application (one more reference, listed). */
static void app_take(struct http_server *s, struct http_request *rq)
{
    pthread_mutex_lock(&rq->mu);
    rq->refs++;
    pthread_mutex_unlock(&rq->mu);
    pthread_mutex_lock(&s->mu);
    rq->next = s->reqs;
    s->reqs = rq;
    s->n_app++;
    pthread_mutex_unlock(&s->mu);
}

/* Runs the route's handler, or answers 404 / 405 / 413 itself. */
static void dispatch(struct http_server *s, struct http_request *rq)
{
    app_take(s, rq);
    if (rq->too_large) {
        http_respond_error(rq, 413, "invalid_request_error", NULL,
                           "request body: larger than the limit of %zu bytes",
                           s->opts.max_body_bytes);
        return;
    }
    const struct route *hit = NULL;
    char allow[32] = "";
    for (int i = 0; i < s->n_routes; i++) {
        const struct route *r = &s->routes[i];
        if (strcmp(r->path, rq->path))
            continue;
        if (!strcmp(r->method, rq->method) ||
            (!strcmp(r->method, "GET") && !strcmp(rq->method, "HEAD"))) {
            hit = r;
            break;
        }
        size_t al = strlen(allow);
        snprintf(allow + al, sizeof allow - al, "%s%s", al ? ", " : "", r->method);
    }
    if (s->opts.tokens && !(hit && hit->open)) {
        const char *auth = http_request_header(rq, "Authorization");
        if (!auth || !moe_tokens_check_bearer(s->opts.tokens, auth, strlen(auth))) {
            http_respond_error(rq, 401, "invalid_request_error", NULL,
                               "%s: send \"Authorization: Bearer TOKEN\" with a valid API token",
                               auth ? "wrong API token" : "missing API token");
            return;
        }
    }
    if (hit) {
        rq->in_handler = true;
        hit->fn(rq, hit->user);
        rq->in_handler = false;
    } else if (allow[0]) {
        pthread_mutex_lock(&rq->mu);
        snprintf(rq->allow, sizeof rq->allow, "%s", allow);
        pthread_mutex_unlock(&rq->mu);
        http_respond_error(rq, 405, "invalid_request_error", NULL,
                           "method %s is not allowed on %s (allowed: %s)", rq->method, rq->path,
                           allow);
    } else {
        http_respond_error(rq, 404, "invalid_request_error", NULL, "no such path: %s %s",
                           rq->method, rq->path);
    }
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *conn, const char *url,
                                 const char *method, const char *version, const char *upload_data,
                                 size_t *upload_data_size, void **con_cls)
{
    (void)version;
    struct http_server *s = cls;
    struct http_request *rq = *con_cls;
    if (!rq) {
        rq = calloc(1, sizeof *rq);
        if (!rq || !(rq->path = strdup(url))) {
            free(rq);
            return MHD_NO;
        }
        pthread_mutex_init(&rq->mu, NULL);
        pthread_cond_init(&rq->cond, NULL);
        rq->srv = s;
        rq->conn = conn;
        rq->refs = 1;
        snprintf(rq->method, sizeof rq->method, "%s", method);
        *con_cls = rq;
        pthread_mutex_lock(&s->mu);
        s->n_live++;
        pthread_mutex_unlock(&s->mu);
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
        if (cl && strtoull(cl, NULL, 10) / 16 > s->opts.max_body_bytes) {
            /* Far too large: answered before the body is read, and
             * libmicrohttpd closes the connection (a client still sending
             * may see the reset rather than the 413). Bodies up to 16 times
             * the limit are read and dropped instead, so that the 413
             * reaches the client on an intact connection. */
            rq->too_large = true;
            rq->dispatched = true;
            dispatch(s, rq);
            return queue_or_suspend(conn, rq);
        }
        return MHD_YES;
    }
    if (*upload_data_size) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        if (rq->too_large || rq->dispatched)
            return MHD_YES;
        if (rq->body_len + n > s->opts.max_body_bytes) {
            rq->too_large = true;
            free(rq->body);
            rq->body = NULL;
            rq->body_len = 0;
            return MHD_YES;
        }
        char *p = realloc(rq->body, rq->body_len + n + 1);
        if (!p)
            return MHD_NO;
        memcpy(p + rq->body_len, upload_data, n);
        rq->body = p;
        rq->body_len += n;
        rq->body[rq->body_len] = '\0';
        return MHD_YES;
    }
    if (!rq->dispatched) {
        rq->dispatched = true;
        dispatch(s, rq);
    }
    return queue_or_suspend(conn, rq);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)conn;
    struct http_server *s = cls;
    struct http_request *rq = *con_cls;
    if (!rq)
        return;
    *con_cls = NULL;
    pthread_mutex_lock(&rq->mu);
    rq->conn = NULL;
    rq->suspended = false;
    if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK) {
        rq->gone = true;
        fire_close_locked(rq);
    }
    req_unref_unlock(rq);
    pthread_mutex_lock(&s->mu);
    s->n_live--;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->mu);
}

/* ---- the server ------------------------------------------------------------------------ */

struct http_server *http_server_create(const struct http_server_opts *opts, struct moe_error *err)
{
    if (!opts || !opts->listen || !strrchr(opts->listen, ':')) {
        moe_error_set(err, MOE_ERR_INVALID, "http listen address '%s': expected HOST:PORT",
                      opts && opts->listen ? opts->listen : "(null)");
        return NULL;
    }
    struct http_server *s = calloc(1, sizeof *s);
    if (!s) {
        moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        return NULL;
    }
    s->opts = *opts;
    s->quiesced_fd = -1;
    snprintf(s->listen, sizeof s->listen, "%s", opts->listen);
    snprintf(s->name, sizeof s->name, "%s", opts->name ? opts->name : "http-server");
    s->opts.listen = s->listen;
    s->opts.name = s->name;
    if (!s->opts.threads)
        s->opts.threads = 2;
    if (!s->opts.max_body_bytes)
        s->opts.max_body_bytes = DEFAULT_MAX_BODY;
    if (!s->opts.idle_timeout_s)
        s->opts.idle_timeout_s = 60;
    if (!s->opts.max_connections)
        s->opts.max_connections = 1024;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cond, NULL);
    pthread_mutex_init(&s->tls_mu, NULL);
    return s;
}

enum moe_status http_server_route(struct http_server *s, const char *method, const char *path,
                                  http_handler_fn fn, void *user, struct moe_error *err)
{
    if (s->n_routes == MAX_ROUTES)
        return moe_error_set(err, MOE_ERR_INVALID, "http: more than %d routes", MAX_ROUTES);
    struct route *r = &s->routes[s->n_routes];
    snprintf(r->method, sizeof r->method, "%s", method);
    r->path = strdup(path);
    if (!r->path)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    r->fn = fn;
    r->user = user;
    r->open = false;
    s->n_routes++;
    return MOE_OK;
}

enum moe_status http_server_route_open(struct http_server *s, const char *method, const char *path,
                                       http_handler_fn fn, void *user, struct moe_error *err)
{
    enum moe_status st = http_server_route(s, method, path, fn, user, err);
    if (!st)
        s->routes[s->n_routes - 1].open = true;
    return st;
}

/* HOST:PORT (or [V6]:PORT) to a socket address. */
static enum moe_status parse_listen(const char *listen, struct sockaddr_storage *ss,
                                    socklen_t *ss_len, bool *v6, struct moe_error *err)
{
    char host[256], port[16];
    int pn;
    if (!moe_hostport_split(listen, host, sizeof host, &pn))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "http listen address '%s': expected HOST:PORT with a port in "
                             "0..65535",
                             listen);
    snprintf(port, sizeof port, "%d", pn);
    const char *h = host;
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(h[0] ? h : NULL, port, &hints, &res);
    if (rc || !res)
        return moe_error_set(err, MOE_ERR_INVALID, "http listen address '%s': %s", listen,
                             gai_strerror(rc));
    struct addrinfo *pick = res;
    for (struct addrinfo *a = res; a; a = a->ai_next)
        if (a->ai_family == AF_INET) {
            pick = a;
            break;
        }
    memcpy(ss, pick->ai_addr, pick->ai_addrlen);
    *ss_len = pick->ai_addrlen;
    *v6 = pick->ai_family == AF_INET6;
    freeaddrinfo(res);
    return MOE_OK;
}

/* libmicrohttpd's own messages, named; a client that went away mid-answer
 * is normal for a server and not logged. */
static void on_log(void *cls, const char *fmt, va_list ap)
{
    struct http_server *s = cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    if (strstr(msg, "closed by remote peer") || strstr(msg, "no longer available") ||
        strstr(msg, "Connection reset"))
        return;
    size_t n = strlen(msg);
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == ' '))
        msg[--n] = '\0';
    fprintf(stderr, "%s: http: %s\n", s->name, msg);
}

/* ---- HTTPS ----------------------------------------------------------------------------- */

/* GnuTLS's certificate callback carries no user pointer: the started HTTPS
 * servers of the process are listed, and a handshake finds its own by the
 * local port of its socket. */
static pthread_mutex_t tls_servers_mu = PTHREAD_MUTEX_INITIALIZER;
static struct http_server *tls_servers;

static void tls_gen_free(struct tls_gen *g)
{
    for (unsigned i = 0; i < g->n_pcert; i++)
        gnutls_pcert_deinit(&g->pcert[i]);
    if (g->key)
        gnutls_privkey_deinit(g->key);
    free(g);
}

/* The material in GnuTLS's form. */
static struct tls_gen *tls_gen_make(const struct moe_tls_material *m, struct moe_error *err)
{
    struct tls_gen *g = calloc(1, sizeof *g);
    if (!g) {
        moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        return NULL;
    }
    g->generation = m->generation;
    gnutls_datum_t cd = {(unsigned char *)m->cert_pem, (unsigned)strlen(m->cert_pem)};
    gnutls_datum_t kd = {(unsigned char *)m->key_pem, (unsigned)strlen(m->key_pem)};
    unsigned n = sizeof g->pcert / sizeof g->pcert[0];
    int rc = gnutls_pcert_list_import_x509_raw(g->pcert, &n, &cd, GNUTLS_X509_FMT_PEM, 0);
    if (rc < 0) {
        moe_error_set(err, MOE_ERR_FORMAT, "HTTPS: the certificate chain: %s", gnutls_strerror(rc));
        free(g);
        return NULL;
    }
    g->n_pcert = n;
    if ((rc = gnutls_privkey_init(&g->key)) < 0 ||
        (rc = gnutls_privkey_import_x509_raw(g->key, &kd, GNUTLS_X509_FMT_PEM, NULL, 0)) < 0) {
        moe_error_set(err, MOE_ERR_FORMAT, "HTTPS: the private key: %s", gnutls_strerror(rc));
        tls_gen_free(g);
        return NULL;
    }
    return g;
}

static struct http_server *tls_server_of(gnutls_session_t session)
{
    pthread_mutex_lock(&tls_servers_mu);
    struct http_server *s = tls_servers;
    if (s && s->tls_next) {
        int port = -1;
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        if (getsockname(gnutls_transport_get_int(session), (struct sockaddr *)&ss, &sl) == 0)
            port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                  : ((struct sockaddr_in *)&ss)->sin_port);
        while (s && s->port != port)
            s = s->tls_next;
    }
    pthread_mutex_unlock(&tls_servers_mu);
    return s;
}

/* The newest generation of s's material (made when it changed). */
static struct tls_gen *tls_gen_current(struct http_server *s)
{
    const struct moe_tls_material *m = moe_tls_current(s->opts.tls);
    pthread_mutex_lock(&s->tls_mu);
    struct tls_gen *g = s->tls_cur;
    if (!g || g->generation != m->generation) {
        struct moe_error err = {0};
        struct tls_gen *made = tls_gen_make(m, &err);
        if (made) {
            made->prev = g;
            s->tls_cur = g = made;
        } else {
            fprintf(stderr, "%s: %s%s\n", s->name, err.msg,
                    g ? " (the previous certificate stays in use)" : "");
        }
    }
    pthread_mutex_unlock(&s->tls_mu);
    return g;
}

static int tls_cert_cb(gnutls_session_t session, const gnutls_datum_t *req_ca_rdn, int nreqs,
                       const gnutls_pk_algorithm_t *pk_algos, int pk_algos_length,
                       gnutls_pcert_st **pcert, unsigned int *pcert_length,
                       gnutls_privkey_t *privkey)
{
    (void)req_ca_rdn, (void)nreqs, (void)pk_algos, (void)pk_algos_length;
    struct http_server *s = tls_server_of(session);
    struct tls_gen *g = s ? tls_gen_current(s) : NULL;
    if (!g)
        return -1;
    *pcert = g->pcert;
    *pcert_length = g->n_pcert;
    *privkey = g->key;
    return 0;
}

static void tls_servers_remove(struct http_server *s)
{
    pthread_mutex_lock(&tls_servers_mu);
    for (struct http_server **p = &tls_servers; *p; p = &(*p)->tls_next)
        if (*p == s) {
            *p = s->tls_next;
            break;
        }
    pthread_mutex_unlock(&tls_servers_mu);
}

enum moe_status http_server_start(struct http_server *s, struct moe_error *err)
{
    struct sockaddr_storage ss;
    socklen_t ss_len;
    bool v6 = false;
    enum moe_status st = parse_listen(s->listen, &ss, &ss_len, &v6, err);
    if (st)
        return st;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME |
                     MHD_USE_ERROR_LOG | (v6 ? MHD_USE_IPv6 : 0);
    struct MHD_OptionItem pool[4];
    int n_opt = 0;
    /* One polling thread is the daemon's own; more are a thread pool. */
    if (s->opts.threads > 1)
        pool[n_opt++] =
            (struct MHD_OptionItem){MHD_OPTION_THREAD_POOL_SIZE, (intptr_t)s->opts.threads, NULL};
    if (s->opts.tls) {
        if (!moe_tls_has_identity(s->opts.tls))
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "%s: HTTPS on %s needs a certificate and key (--tls-cert, "
                                 "--tls-key)",
                                 s->name, s->listen);
        if (!tls_gen_current(s)) /* the first generation, checked now */
            return moe_error_set(err, MOE_ERR_INVALID, "%s: HTTPS on %s: unusable certificate",
                                 s->name, s->listen);
        flags |= MHD_USE_TLS;
        pool[n_opt++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_CERT_CALLBACK, 0,
                                                (void *)(uintptr_t)tls_cert_cb};
        pool[n_opt++] = (struct MHD_OptionItem){
            MHD_OPTION_HTTPS_PRIORITIES, 0, (void *)"NORMAL:-VERS-ALL:+VERS-TLS1.3:+VERS-TLS1.2"};
        /* listed before the first handshake can come */
        pthread_mutex_lock(&tls_servers_mu);
        s->tls_next = tls_servers;
        tls_servers = s;
        s->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                 : ((struct sockaddr_in *)&ss)->sin_port);
        pthread_mutex_unlock(&tls_servers_mu);
    }
    pool[n_opt] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
    s->d = MHD_start_daemon(flags, 0, NULL, NULL, on_access, s, MHD_OPTION_EXTERNAL_LOGGER, on_log,
                            s, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss, MHD_OPTION_ARRAY, pool,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)s->opts.idle_timeout_s,
                            MHD_OPTION_CONNECTION_LIMIT, s->opts.max_connections,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_END);
    if (!s->d) {
        tls_servers_remove(s);
        return moe_error_set(err, MOE_ERR_IO,
                             "%s: cannot listen for HTTP%s on %s (address in use or not local?)",
                             s->name, s->opts.tls ? "S" : "", s->listen);
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    pthread_mutex_lock(&tls_servers_mu);
    s->port = info ? info->port : 0;
    pthread_mutex_unlock(&tls_servers_mu);
    return MOE_OK;
}

int http_server_port(const struct http_server *s)
{
    return s->port;
}

/* Waits on s->cond until pred(s) or `until` (0: forever). Caller holds s->mu. */
static void wait_until(struct http_server *s, bool (*pred)(struct http_server *), double until)
{
    while (!pred(s)) {
        if (until > 0 && moe_now() >= until)
            return;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&s->cond, &s->mu, &ts);
    }
}

static bool no_app(struct http_server *s)
{
    return s->n_app == 0;
}

static bool no_live(struct http_server *s)
{
    return s->n_live == 0;
}

void http_server_quiesce(struct http_server *s)
{
    if (!s || !s->d || s->quiesced)
        return;
    s->quiesced = true;
    MHD_socket lfd = MHD_quiesce_daemon(s->d);
    if (lfd == MHD_INVALID_SOCKET)
        return;
    /* Stop listening now (new connections are refused, not queued), but
     * close the descriptor only after MHD_stop_daemon: MHD's threads may
     * still hold it in their epoll set, and a number closed early can be
     * reused by another socket under them. */
    shutdown(lfd, SHUT_RDWR);
    s->quiesced_fd = lfd;
}

void http_server_destroy(struct http_server *s, int grace_ms)
{
    if (!s)
        return;
    if (s->d) {
        http_server_quiesce(s);
        pthread_mutex_lock(&s->mu);
        wait_until(s, no_app, moe_now() + grace_ms / 1e3);
        /* Cancel the rest: each one's on_close, then wait for its end. */
        while (s->n_app > 0) {
            struct http_request *pick = NULL;
            for (struct http_request *rq = s->reqs; rq && !pick; rq = rq->next) {
                pthread_mutex_lock(&rq->mu);
                if (!rq->close_fired && !rq->app_done) {
                    pick = rq;
                    rq->refs++; /* kept while we call on_close without s->mu */
                }
                pthread_mutex_unlock(&rq->mu);
            }
            if (!pick) {
                wait_until(s, no_app, 0);
                break;
            }
            pthread_mutex_unlock(&s->mu);
            pthread_mutex_lock(&pick->mu);
            pick->gone = true;
            if (!pick->on_close)
                pick->close_fired = true; /* nothing to call: the end comes on its own */
            fire_close_locked(pick);
            req_unref_unlock(pick);
            pthread_mutex_lock(&s->mu);
        }
        /* Answers resumed just now go out (bounded: a client that does not
         * read is cut off by the stop). */
        wait_until(s, no_live, moe_now() + 2.0);
        pthread_mutex_unlock(&s->mu);
        MHD_stop_daemon(s->d);
        if (s->quiesced_fd >= 0)
            close(s->quiesced_fd);
    }
    tls_servers_remove(s);
    for (struct tls_gen *g = s->tls_cur; g;) {
        struct tls_gen *prev = g->prev;
        tls_gen_free(g);
        g = prev;
    }
    pthread_mutex_destroy(&s->tls_mu);
    for (int i = 0; i < s->n_routes; i++)
        free(s->routes[i].path);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cond);
    free(s);
}
