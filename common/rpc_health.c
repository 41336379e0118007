/* grpc.health.v1.Health over the rpc layer: a table of (service, status)
 * and a list of Watch streams. Lock order: health->mu, then a stream's. */
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "moe/v1/health.pb-c.h"
#include "rpc_internal.h"

struct health_entry {
    char *service;
    enum rpc_health_status status;
};

struct health_watcher {
    struct health_watcher *next;
    struct rpc_stream *stream;
    char *service;
    enum rpc_health_status last_sent;
};

struct rpc_health {
    pthread_mutex_t mu;
    struct health_entry *entries;
    int n_entries, cap_entries;
    struct health_watcher *watchers;
};

/* Status of `service`, or -1 if unknown (h->mu held). */
static int lookup_locked(struct rpc_health *h, const char *service)
{
    for (int i = 0; i < h->n_entries; i++) {
        if (strcmp(h->entries[i].service, service) == 0) {
            return (int)h->entries[i].status;
        }
    }
    return -1;
}

/* Serializes a HealthCheckResponse into buf (a few bytes). */
static size_t pack_status(enum rpc_health_status status, uint8_t *buf)
{
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)status;
    MOE_ASSERT(grpc__health__v1__health_check_response__get_packed_size(&resp) <= 16);
    return grpc__health__v1__health_check_response__pack(&resp, buf);
}

static void health_check(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    struct rpc_health *h = user;
    Grpc__Health__V1__HealthCheckRequest *msg =
        grpc__health__v1__health_check_request__unpack(NULL, len, req);
    if (!msg) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "malformed HealthCheckRequest", NULL, 0);
        return;
    }
    pthread_mutex_lock(&h->mu);
    int status = lookup_locked(h, msg->service);
    pthread_mutex_unlock(&h->mu);
    if (status < 0) {
        char text[300];
        snprintf(text, sizeof(text), "unknown service '%.256s'", msg->service);
        rpc_call_finish(call, RPC_NOT_FOUND, text, NULL, 0);
    } else {
        uint8_t buf[16];
        size_t n = pack_status((enum rpc_health_status)status, buf);
        rpc_call_finish(call, RPC_OK, NULL, buf, n);
    }
    grpc__health__v1__health_check_request__free_unpacked(msg, NULL);
}

static void watcher_free(struct health_watcher *w)
{
    free(w->service);
    free(w);
}

/* The watch stream went away: unlink its watcher and let the stream go. */
static void watch_cancelled(struct rpc_stream *stream, void *user)
{
    struct rpc_health *h = user;
    struct health_watcher *found = NULL;
    pthread_mutex_lock(&h->mu);
    for (struct health_watcher **p = &h->watchers; *p; p = &(*p)->next) {
        if ((*p)->stream == stream) {
            found = *p;
            *p = found->next;
            break;
        }
    }
    pthread_mutex_unlock(&h->mu);
    if (found) {
        watcher_free(found);
        rpc_stream_release(stream);
    }
}

static void health_watch(struct rpc_stream *stream, const uint8_t *req, size_t len, void *user)
{
    struct rpc_health *h = user;
    Grpc__Health__V1__HealthCheckRequest *msg =
        grpc__health__v1__health_check_request__unpack(NULL, len, req);
    struct health_watcher *w = calloc(1, sizeof(*w));
    if (!msg || !w || !(w->service = strdup(msg->service))) {
        rpc_stream_finish(stream, msg ? RPC_RESOURCE_EXHAUSTED : RPC_INVALID_ARGUMENT,
                          msg ? "out of memory" : "malformed HealthCheckRequest");
        rpc_stream_release(stream);
        free(w);
        if (msg) {
            grpc__health__v1__health_check_request__free_unpacked(msg, NULL);
        }
        return;
    }
    grpc__health__v1__health_check_request__free_unpacked(msg, NULL);
    w->stream = stream;
    pthread_mutex_lock(&h->mu);
    int status = lookup_locked(h, w->service);
    w->last_sent = status < 0 ? RPC_HEALTH_SERVICE_UNKNOWN : (enum rpc_health_status)status;
    uint8_t buf[16];
    size_t n = pack_status(w->last_sent, buf);
    rpc_stream_send(stream, buf, n);
    w->next = h->watchers;
    h->watchers = w;
    pthread_mutex_unlock(&h->mu);
    /* Fires at once if the client is already gone. */
    rpc_stream_set_on_cancel(stream, watch_cancelled, h);
}

enum moe_status rpc_health_register(struct rpc_server *server, struct moe_error *err)
{
    if (rpc_server_health(server)) {
        return moe_error_set(err, MOE_ERR_INVALID, "rpc_health_register: registered twice");
    }
    struct rpc_health *h = calloc(1, sizeof(*h));
    if (!h) {
        return moe_error_set(err, MOE_ERR_NOMEM, "rpc_health_register: out of memory");
    }
    pthread_mutex_init(&h->mu, NULL);
    rpc_server_attach_health(server, h); /* owned by the server from here on */
    enum moe_status st =
        rpc_server_add_unary(server, "/grpc.health.v1.Health/Check", health_check, h, err);
    if (st == MOE_OK) {
        st = rpc_server_add_stream(server, "/grpc.health.v1.Health/Watch", health_watch, h, err);
    }
    if (st == MOE_OK) {
        /* probes are answered while the server drains, and a Watch stream
         * never holds up its shutdown */
        rpc_server_set_drain_exempt(server, "/grpc.health.v1.Health/Check");
        rpc_server_set_drain_exempt(server, "/grpc.health.v1.Health/Watch");
        rpc_health_set(server, "", RPC_HEALTH_SERVING);
    }
    return st;
}

void rpc_health_set(struct rpc_server *server, const char *service, enum rpc_health_status status)
{
    struct rpc_health *h = rpc_server_health(server);
    if (!h) {
        return;
    }
    pthread_mutex_lock(&h->mu);
    int i = 0;
    while (i < h->n_entries && strcmp(h->entries[i].service, service) != 0) {
        i++;
    }
    if (i == h->n_entries) {
        if (h->n_entries == h->cap_entries) {
            int cap = h->cap_entries ? 2 * h->cap_entries : 4;
            struct health_entry *e = realloc(h->entries, (size_t)cap * sizeof(*e));
            if (!e) {
                pthread_mutex_unlock(&h->mu);
                return;
            }
            h->entries = e;
            h->cap_entries = cap;
        }
        h->entries[i].service = strdup(service);
        if (!h->entries[i].service) {
            pthread_mutex_unlock(&h->mu);
            return;
        }
        h->n_entries++;
    }
    h->entries[i].status = status;
    for (struct health_watcher *w = h->watchers; w; w = w->next) {
        if (w->last_sent != status && strcmp(w->service, service) == 0) {
            uint8_t buf[16];
            size_t n = pack_status(status, buf);
            rpc_stream_send(w->stream, buf, n);
            w->last_sent = status;
        }
    }
    pthread_mutex_unlock(&h->mu);
}

void rpc_health_free(struct rpc_health *h)
{
    if (!h) {
        return;
    }
    /* Every call ended before this: watchers were released on cancel. */
    for (struct health_watcher *w = h->watchers; w;) {
        struct health_watcher *next = w->next;
        watcher_free(w);
        w = next;
    }
    for (int i = 0; i < h->n_entries; i++) {
        free(h->entries[i].service);
    }
    free(h->entries);
    pthread_mutex_destroy(&h->mu);
    free(h);
}
