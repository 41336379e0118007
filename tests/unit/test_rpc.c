/* The gRPC layer (common/rpc.h) on loopback: unary, UNIMPLEMENTED, ordered
 * streams carrying real moe.v1 messages, 10 MiB messages, client cancel and
 * deadline seen by the server, health Check/Watch, shutdown during a stream,
 * concurrent streams. Bounded in time: every wait has a limit. */
#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "moe/v1/health.pb-c.h"
#include "moe/v1/inference.pb-c.h"
#include "rpc.h"
#include "rpc_internal.h"
#include "testlib.h"

#define BIG_BYTES ((size_t)10 << 20)
/* sleep_us value: send n messages, then wait for on_cancel (up to 5 s). */
#define WAIT_FOR_CANCEL UINT32_MAX

/* Waits up to limit_s for *flag != 0. */
static int wait_flag(atomic_int *flag, double limit_s)
{
    double t0 = moe_now();
    while (!atomic_load(flag) && moe_now() - t0 < limit_s) {
        usleep(2000);
    }
    return atomic_load(flag);
}

/* ---- server side --------------------------------------------------------------------- */

/* A producer thread standing in for the engine: it owns one stream. */
struct producer {
    struct rpc_stream *stream;
    pthread_t thread;
    uint32_t n, sleep_us, size;
    atomic_int cancel_seen; /* set by on_cancel */
    atomic_int done;
    atomic_int sent;
    atomic_int stopped_early;
};

#define MAX_PRODUCERS 64
static struct producer *g_producers[MAX_PRODUCERS];
static int g_n_producers;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int g_on_cancel;

static void on_cancel(struct rpc_stream *stream, void *user)
{
    struct producer *p = user;
    (void)stream;
    atomic_store(&p->cancel_seen, 1);
    atomic_fetch_add(&g_on_cancel, 1);
}

/* Sends n GenerateResponse messages with token_ids = {i} (and `size` bytes
 * of text when size > 0), sleeping sleep_us between them. */
static void *producer_main(void *arg)
{
    struct producer *p = arg;
    char *text = NULL;
    if (p->size) {
        text = malloc(p->size + 1);
        memset(text, 'x', p->size);
        text[p->size] = '\0';
    }
    uint8_t small[64];
    uint8_t *buf = p->size ? malloc(p->size + 64) : small;
    uint32_t i = 0;
    for (; i < p->n; i++) {
        if (atomic_load(&p->cancel_seen) || rpc_stream_is_cancelled(p->stream)) {
            break;
        }
        Moe__V1__GenerateResponse msg = MOE__V1__GENERATE_RESPONSE__INIT;
        uint32_t id = i;
        msg.n_token_ids = 1;
        msg.token_ids = &id;
        if (text) {
            msg.text = text;
        }
        if (i + 1 == p->n) {
            msg.finish_reason = MOE__V1__FINISH_REASON__FINISH_REASON_LENGTH;
        }
        size_t len = moe__v1__generate_response__pack(&msg, buf);
        if (rpc_stream_send(p->stream, buf, len) != MOE_OK) {
            break;
        }
        atomic_fetch_add(&p->sent, 1);
        if (p->sleep_us && p->sleep_us != WAIT_FOR_CANCEL) {
            usleep(p->sleep_us);
        }
    }
    if (p->sleep_us == WAIT_FOR_CANCEL) {
        /* Sent everything; now only the client's going away ends the call. */
        wait_flag(&p->cancel_seen, 5.0);
        i = 0;
    }
    if (i < p->n) {
        atomic_store(&p->stopped_early, 1);
        rpc_stream_finish(p->stream, RPC_CANCELLED, "producer stopped");
    } else {
        rpc_stream_finish(p->stream, RPC_OK, NULL);
    }
    rpc_stream_release(p->stream);
    if (buf != small) {
        free(buf);
    }
    free(text);
    atomic_store(&p->done, 1);
    return NULL;
}

/* Stream handler: request = 3 little-endian uint32 (n, sleep_us, size). */
static void handle_stream(struct rpc_stream *stream, const uint8_t *req, size_t len, void *user)
{
    (void)user;
    uint32_t v[3];
    if (len != sizeof(v)) {
        rpc_stream_finish(stream, RPC_INVALID_ARGUMENT, "want 12 bytes");
        rpc_stream_release(stream);
        return;
    }
    memcpy(v, req, sizeof(v));
    struct producer *p = calloc(1, sizeof(*p));
    p->stream = stream;
    p->n = v[0];
    p->sleep_us = v[1];
    p->size = v[2];
    pthread_mutex_lock(&g_mu);
    if (g_n_producers == MAX_PRODUCERS) {
        pthread_mutex_unlock(&g_mu);
        free(p);
        rpc_stream_finish(stream, RPC_RESOURCE_EXHAUSTED, "too many producers");
        rpc_stream_release(stream);
        return;
    }
    g_producers[g_n_producers++] = p;
    pthread_mutex_unlock(&g_mu);
    rpc_stream_set_on_cancel(stream, on_cancel, p);
    pthread_create(&p->thread, NULL, producer_main, p);
}

static void handle_echo(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    (void)user;
    rpc_call_finish(call, RPC_OK, NULL, req, len);
}

static void handle_fail(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    (void)req;
    (void)len;
    (void)user;
    rpc_call_finish(call, RPC_FAILED_PRECONDITION, "no such luck", NULL, 0);
}

/* Unary answered later from another thread. */
static atomic_long g_later_ms_left;
struct later {
    struct rpc_call *call;
    char text[64];
};

static void *later_main(void *arg)
{
    struct later *l = arg;
    usleep(20000);
    atomic_store(&g_later_ms_left, (long)rpc_call_deadline_ms_left(l->call));
    rpc_call_finish(l->call, RPC_OK, NULL, l->text, strlen(l->text));
    free(l);
    return NULL;
}

static pthread_t g_later_thread;

static void handle_later(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    (void)user;
    struct later *l = calloc(1, sizeof(*l));
    l->call = call;
    char key[64];
    int n = rpc_call_metadata(call, "user-agent", key, sizeof(key));
    snprintf(l->text, sizeof(l->text), "later:%.*s:%d", (int)len, (const char *)req, n > 0);
    pthread_create(&g_later_thread, NULL, later_main, l);
}

static struct rpc_server *server_start(int n_threads)
{
    struct moe_error err = {0};
    struct rpc_server *s = rpc_server_create("127.0.0.1:0", n_threads, NULL, &err);
    CHECKF(s != NULL, "%s", err.msg);
    if (!s) {
        return NULL;
    }
    CHECK(rpc_server_port(s) > 0);
    CHECK(rpc_server_add_unary(s, "/test.Echo/Unary", handle_echo, NULL, &err) == MOE_OK);
    CHECK(rpc_server_add_unary(s, "/test.Echo/Fail", handle_fail, NULL, &err) == MOE_OK);
    CHECK(rpc_server_add_unary(s, "/test.Echo/Later", handle_later, NULL, &err) == MOE_OK);
    CHECK(rpc_server_add_stream(s, "/test.Echo/Stream", handle_stream, NULL, &err) == MOE_OK);
    CHECK(rpc_server_add_unary(s, "/test.Echo/Unary", handle_echo, NULL, &err) != MOE_OK);
    CHECK(rpc_health_register(s, &err) == MOE_OK);
    CHECKF(rpc_server_start(s, &err) == MOE_OK, "%s", err.msg);
    CHECK(rpc_server_add_unary(s, "/test.Echo/Late", handle_echo, NULL, &err) != MOE_OK);
    return s;
}

/* Joins every producer (they all end: each either finishes or sees cancel). */
static void producers_join(void)
{
    pthread_mutex_lock(&g_mu);
    int n = g_n_producers;
    pthread_mutex_unlock(&g_mu);
    for (int i = 0; i < n; i++) {
        pthread_join(g_producers[i]->thread, NULL);
        free(g_producers[i]);
        g_producers[i] = NULL;
    }
    pthread_mutex_lock(&g_mu);
    g_n_producers = 0;
    pthread_mutex_unlock(&g_mu);
}

static struct producer *producer_last(void)
{
    pthread_mutex_lock(&g_mu);
    struct producer *p = g_n_producers ? g_producers[g_n_producers - 1] : NULL;
    pthread_mutex_unlock(&g_mu);
    return p;
}

/* ---- client side -------------------------------------------------------------------------- */

static struct rpc_client_stream *stream_open(struct rpc_client *c, uint32_t n, uint32_t sleep_us,
                                             uint32_t size, int64_t timeout_ms)
{
    uint32_t v[3] = {n, sleep_us, size};
    struct moe_error err = {0};
    struct rpc_client_stream *s =
        rpc_client_stream_start(c, "/test.Echo/Stream", v, sizeof(v), timeout_ms, &err);
    CHECKF(s != NULL, "%s", err.msg);
    return s;
}

/* Reads a whole stream; returns how many messages arrived in order (token
 * id i at position i), or -1 on a malformed message. */
static int stream_read_all(struct rpc_client_stream *s, uint32_t want_text, enum rpc_code *code)
{
    const uint8_t *data;
    size_t len;
    int n = 0, in_order = 1;
    while (rpc_client_stream_next(s, &data, &len)) {
        Moe__V1__GenerateResponse *msg = moe__v1__generate_response__unpack(NULL, len, data);
        if (!msg) {
            return -1;
        }
        if (msg->n_token_ids != 1 || msg->token_ids[0] != (uint32_t)n ||
            strlen(msg->text) != want_text) {
            in_order = 0;
        }
        moe__v1__generate_response__free_unpacked(msg, NULL);
        n++;
    }
    *code = rpc_client_stream_status(s, NULL);
    return in_order ? n : -1;
}

static void test_unary(struct rpc_client *c)
{
    struct rpc_reply r;
    CHECK(rpc_client_call(c, "/test.Echo/Unary", "hello", 5, 5000, &r) == RPC_OK);
    CHECK(r.len == 5 && r.data && memcmp(r.data, "hello", 5) == 0);
    rpc_reply_clear(&r);

    CHECK(rpc_client_call(c, "/test.Echo/Unary", NULL, 0, 5000, &r) == RPC_OK);
    CHECK(r.len == 0);
    rpc_reply_clear(&r);

    CHECK(rpc_client_call(c, "/test.Echo/Fail", "x", 1, 5000, &r) == RPC_FAILED_PRECONDITION);
    CHECKF(strcmp(r.message, "no such luck") == 0, "'%s'", r.message);
    CHECK(r.data == NULL);
    rpc_reply_clear(&r);

    CHECK(rpc_client_call(c, "/test.Echo/Later", "abc", 3, 5000, &r) == RPC_OK);
    CHECKF(r.len == 11 && memcmp(r.data, "later:abc:1", 11) == 0, "%.*s", (int)r.len,
           (const char *)r.data);
    rpc_reply_clear(&r);
    pthread_join(g_later_thread, NULL);
    long left = atomic_load(&g_later_ms_left);
    CHECKF(left > 4000 && left < 5000, "deadline left %ld ms", left);

    CHECK(rpc_client_call(c, "/test.Nope/Nothing", "x", 1, 5000, &r) == RPC_UNIMPLEMENTED);
    CHECKF(strstr(r.message, "/test.Nope/Nothing") != NULL, "'%s'", r.message);
    rpc_reply_clear(&r);

    CHECK(strcmp(rpc_code_name(RPC_DEADLINE_EXCEEDED), "DEADLINE_EXCEEDED") == 0);
    CHECK(strcmp(rpc_code_name((enum rpc_code)99), "?") == 0);

    /* 60 sequential calls: a rough per-call latency. */
    double t0 = moe_now();
    for (int i = 0; i < 60; i++) {
        rpc_client_call(c, "/test.Echo/Unary", "ping", 4, 5000, &r);
        rpc_reply_clear(&r);
    }
    fprintf(stderr, "unary round trip: %.0f us\n", (moe_now() - t0) / 60 * 1e6);
}

static void test_big(struct rpc_client *c)
{
    uint8_t *big = malloc(BIG_BYTES);
    for (size_t i = 0; i < BIG_BYTES; i++) {
        big[i] = (uint8_t)(i * 131 + 7);
    }
    struct rpc_reply r;
    CHECKF(rpc_client_call(c, "/test.Echo/Unary", big, BIG_BYTES, 10000, &r) == RPC_OK, "%s %s",
           rpc_code_name(r.code), r.message);
    CHECK(r.len == BIG_BYTES && r.data && memcmp(r.data, big, BIG_BYTES) == 0);
    rpc_reply_clear(&r);
    free(big);

    /* Two 10 MiB stream messages. */
    struct rpc_client_stream *s = stream_open(c, 2, 0, (uint32_t)BIG_BYTES, 10000);
    enum rpc_code code = RPC_UNKNOWN;
    CHECK(stream_read_all(s, (uint32_t)BIG_BYTES, &code) == 2);
    CHECK(code == RPC_OK);
    rpc_client_stream_destroy(s);
    producers_join();
}

static void test_stream(struct rpc_client *c)
{
    struct rpc_client_stream *s = stream_open(c, 100, 500, 0, 10000);
    enum rpc_code code = RPC_UNKNOWN;
    CHECK(stream_read_all(s, 0, &code) == 100);
    CHECK(code == RPC_OK);
    const uint8_t *data;
    size_t len;
    CHECK(rpc_client_stream_next(s, &data, &len) == 0); /* stays ended */
    rpc_client_stream_destroy(s);
    producers_join();

    /* A handler that rejects the request at once. */
    struct moe_error err = {0};
    s = rpc_client_stream_start(c, "/test.Echo/Stream", "bad", 3, 5000, &err);
    CHECK(s && rpc_client_stream_next(s, &data, &len) == 0);
    const char *msg = NULL;
    CHECK(s && rpc_client_stream_status(s, &msg) == RPC_INVALID_ARGUMENT);
    CHECK(msg && strcmp(msg, "want 12 bytes") == 0);
    rpc_client_stream_destroy(s);
}

static void test_cancel(struct rpc_client *c)
{
    /* A producer that keeps sending: it must notice and stop. */
    struct rpc_client_stream *s = stream_open(c, 100000, 2000, 0, 10000);
    const uint8_t *data;
    size_t len;
    int got = 0;
    while (got < 5 && rpc_client_stream_next(s, &data, &len)) {
        got++;
    }
    CHECK(got == 5);
    rpc_client_stream_cancel(s);
    while (rpc_client_stream_next(s, &data, &len)) {
    }
    CHECK(rpc_client_stream_status(s, NULL) == RPC_CANCELLED);
    rpc_client_stream_destroy(s);
    struct producer *p = producer_last();
    CHECK(p && wait_flag(&p->done, 3.0));
    CHECK(p && atomic_load(&p->stopped_early));
    producers_join();

    /* A producer that holds the stream silently: only on_cancel tells it. */
    int before = atomic_load(&g_on_cancel);
    s = stream_open(c, 3, WAIT_FOR_CANCEL, 0, 10000);
    got = 0;
    while (got < 3 && rpc_client_stream_next(s, &data, &len)) {
        got++;
    }
    CHECK(got == 3);
    double t0 = moe_now();
    rpc_client_stream_cancel(s);
    CHECK(rpc_client_stream_next(s, &data, &len) == 0);
    CHECK(rpc_client_stream_status(s, NULL) == RPC_CANCELLED);
    rpc_client_stream_destroy(s);
    p = producer_last();
    CHECK(p && wait_flag(&p->done, 3.0));
    CHECKF(moe_now() - t0 < 1.0, "on_cancel after %.3f s", moe_now() - t0);
    CHECK(p && atomic_load(&p->cancel_seen) && atomic_load(&p->stopped_early));
    CHECK(atomic_load(&g_on_cancel) == before + 1);
    producers_join();
}

static void test_deadline(struct rpc_client *c)
{
    /* A sending producer: the client sees DEADLINE_EXCEEDED after ~300 ms. */
    double t0 = moe_now();
    struct rpc_client_stream *s = stream_open(c, 100000, 2000, 0, 300);
    enum rpc_code code = RPC_UNKNOWN;
    int n = stream_read_all(s, 0, &code);
    double dt = moe_now() - t0;
    CHECKF(code == RPC_DEADLINE_EXCEEDED, "%s", rpc_code_name(code));
    /* not before the deadline; the stream alone would run for 200 s */
    CHECKF(n > 10 && dt > 0.25 && dt < 30.0, "n %d dt %.3f", n, dt);
    rpc_client_stream_destroy(s);
    struct producer *p = producer_last();
    CHECK(p && wait_flag(&p->done, 3.0));
    CHECK(p && atomic_load(&p->stopped_early));
    producers_join();

    /* A silent producer: the server-side deadline fires on_cancel. */
    int before = atomic_load(&g_on_cancel);
    t0 = moe_now();
    s = stream_open(c, 2, WAIT_FOR_CANCEL, 0, 300);
    n = stream_read_all(s, 0, &code);
    CHECKF(n == 2 && code == RPC_DEADLINE_EXCEEDED, "%d %s", n, rpc_code_name(code));
    rpc_client_stream_destroy(s);
    p = producer_last();
    CHECK(p && wait_flag(&p->done, 3.0));
    CHECKF(moe_now() - t0 < 1.5, "on_cancel after %.3f s", moe_now() - t0);
    CHECK(p && atomic_load(&p->cancel_seen));
    CHECK(atomic_load(&g_on_cancel) == before + 1);
    producers_join();

    /* A unary call's deadline, with the server slower than it. */
    struct rpc_reply r;
    CHECK(rpc_client_call(c, "/test.Echo/Later", "x", 1, 5, &r) == RPC_DEADLINE_EXCEEDED);
    rpc_reply_clear(&r);
    pthread_join(g_later_thread, NULL);
    CHECK(atomic_load(&g_later_ms_left) <= 0);
}

static int health_check(struct rpc_client *c, const char *service, enum rpc_code *code)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)service;
    uint8_t buf[256];
    size_t len = grpc__health__v1__health_check_request__pack(&req, buf);
    struct rpc_reply r;
    *code = rpc_client_call(c, "/grpc.health.v1.Health/Check", buf, len, 5000, &r);
    int status = -1;
    if (*code == RPC_OK) {
        Grpc__Health__V1__HealthCheckResponse *resp =
            grpc__health__v1__health_check_response__unpack(NULL, r.len, r.data);
        if (resp) {
            status = (int)resp->status;
            grpc__health__v1__health_check_response__free_unpacked(resp, NULL);
        }
    }
    rpc_reply_clear(&r);
    return status;
}

static int watch_next(struct rpc_client_stream *s)
{
    const uint8_t *data;
    size_t len;
    if (!rpc_client_stream_next(s, &data, &len)) {
        return -1;
    }
    Grpc__Health__V1__HealthCheckResponse *resp =
        grpc__health__v1__health_check_response__unpack(NULL, len, data);
    int status = resp ? (int)resp->status : -2;
    if (resp) {
        grpc__health__v1__health_check_response__free_unpacked(resp, NULL);
    }
    return status;
}

static void test_health(struct rpc_server *srv, struct rpc_client *c)
{
    enum rpc_code code;
    CHECK(health_check(c, "", &code) == RPC_HEALTH_SERVING && code == RPC_OK);
    CHECK(health_check(c, "moe.v1.Worker", &code) == -1 && code == RPC_NOT_FOUND);

    uint8_t buf[64];
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    size_t len = grpc__health__v1__health_check_request__pack(&req, buf);
    struct moe_error err = {0};
    struct rpc_client_stream *w =
        rpc_client_stream_start(c, "/grpc.health.v1.Health/Watch", buf, len, 10000, &err);
    CHECK(w && watch_next(w) == RPC_HEALTH_SERVING);

    rpc_health_set(srv, "", RPC_HEALTH_NOT_SERVING);
    CHECK(health_check(c, "", &code) == RPC_HEALTH_NOT_SERVING && code == RPC_OK);
    CHECK(w && watch_next(w) == RPC_HEALTH_NOT_SERVING);
    rpc_health_set(srv, "moe.v1.Worker", RPC_HEALTH_SERVING);
    CHECK(health_check(c, "moe.v1.Worker", &code) == RPC_HEALTH_SERVING && code == RPC_OK);
    rpc_health_set(srv, "", RPC_HEALTH_SERVING);
    CHECK(w && watch_next(w) == RPC_HEALTH_SERVING);
    rpc_client_stream_destroy(w); /* cancels: the watcher must go away */

    /* A second watch stays open: shutdown must end it. */
    w = rpc_client_stream_start(c, "/grpc.health.v1.Health/Watch", buf, len, 10000, &err);
    CHECK(w && watch_next(w) == RPC_HEALTH_SERVING);
    rpc_client_stream_destroy(w);
}

struct reader {
    struct rpc_client *c;
    pthread_t thread;
    int n;
    enum rpc_code code;
    int got;
};

static void *reader_main(void *arg)
{
    struct reader *r = arg;
    struct rpc_client_stream *s = stream_open(r->c, (uint32_t)r->n, 1000, 0, 20000);
    r->got = s ? stream_read_all(s, 0, &r->code) : -1;
    rpc_client_stream_destroy(s);
    return NULL;
}

static void test_concurrent(struct rpc_client *c)
{
    struct reader readers[8];
    double t0 = moe_now();
    for (int i = 0; i < 8; i++) {
        readers[i] = (struct reader){.c = c, .n = 50, .code = RPC_UNKNOWN};
        pthread_create(&readers[i].thread, NULL, reader_main, &readers[i]);
    }
    for (int i = 0; i < 8; i++) {
        pthread_join(readers[i].thread, NULL);
        CHECKF(readers[i].got == 50 && readers[i].code == RPC_OK, "reader %d: %d %s", i,
               readers[i].got, rpc_code_name(readers[i].code));
    }
    fprintf(stderr, "8 concurrent streams of 50: %.3f s\n", moe_now() - t0);
    producers_join();
}

/* The server goes away while a client reads an endless stream. */
static void test_shutdown_during_stream(void)
{
    struct rpc_server *srv = server_start(2);
    if (!srv) {
        return;
    }
    char target[64];
    snprintf(target, sizeof(target), "127.0.0.1:%d", rpc_server_port(srv));
    struct moe_error err = {0};
    struct rpc_client *c = rpc_client_create(target, NULL, &err);
    struct reader r = {.c = c, .n = 1000000, .code = RPC_UNKNOWN};
    pthread_create(&r.thread, NULL, reader_main, &r);
    /* Also an open health watch. */
    uint8_t buf[8];
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    size_t len = grpc__health__v1__health_check_request__pack(&req, buf);
    struct rpc_client_stream *w =
        rpc_client_stream_start(c, "/grpc.health.v1.Health/Watch", buf, len, 10000, &err);
    CHECK(w && watch_next(w) == RPC_HEALTH_SERVING);
    struct producer *p = NULL;
    double t0 = moe_now();
    while (!(p = producer_last()) && moe_now() - t0 < 3.0) {
        usleep(2000);
    }
    CHECK(p && wait_flag(&p->sent, 3.0));
    t0 = moe_now();
    rpc_server_destroy(srv, 100);
    double dt = moe_now() - t0;
    CHECKF(dt < 30.0, "shutdown took %.3f s", dt); /* forever if it waited for the producer */
    pthread_join(r.thread, NULL);
    CHECKF(r.code != RPC_OK && r.code != RPC_UNKNOWN, "reader status %s", rpc_code_name(r.code));
    CHECK(p && wait_flag(&p->done, 3.0) && atomic_load(&p->stopped_early));
    CHECK(w && watch_next(w) == -1);
    CHECK(w && rpc_client_stream_status(w, NULL) != RPC_OK);
    rpc_client_stream_destroy(w);
    producers_join();

    /* No server at all: UNAVAILABLE, not a hang. */
    struct rpc_reply rep;
    CHECK(rpc_client_call(c, "/test.Echo/Unary", "x", 1, 2000, &rep) == RPC_UNAVAILABLE);
    rpc_reply_clear(&rep);
    rpc_client_destroy(c);
}

/* Epoll sets this process holds (anon_inode:[eventpoll] descriptors). */
static int count_epoll_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        char path[300], target[64];
        snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        ssize_t k = readlink(path, target, sizeof target - 1);
        if (k > 0) {
            target[k] = 0;
            n += strcmp(target, "anon_inode:[eventpoll]") == 0;
        }
    }
    closedir(d);
    return n;
}

/* gRPC core 29's debug-build EventEngine poller is off (rpc_experiments_default,
 * run before main), and a GRPC_EXPERIMENTS of the user's is kept. Runs
 * before any thread starts (setenv). */
static void test_experiments_default(void)
{
    const char *v = getenv("GRPC_EXPERIMENTS");
    char start[1024];
    snprintf(start, sizeof start, "%s", v ? v : "");
    bool core29 =
        strncmp(grpc_version_string(), RPC_EE_POLLING_CORE, strlen(RPC_EE_POLLING_CORE)) == 0;
    if (!core29) {
        fprintf(stderr, "test_rpc: gRPC core %s: GRPC_EXPERIMENTS left alone\n",
                grpc_version_string());
        return;
    }
    CHECKF(strstr(start, RPC_EE_POLLING) != NULL, "GRPC_EXPERIMENTS at main: '%s'", start);
    setenv("GRPC_EXPERIMENTS", "tcp_rcv_lowat", 1);
    rpc_experiments_default();
    CHECKF(!strcmp(getenv("GRPC_EXPERIMENTS"), "tcp_rcv_lowat,-" RPC_EE_POLLING), "appended: '%s'",
           getenv("GRPC_EXPERIMENTS"));
    setenv("GRPC_EXPERIMENTS", RPC_EE_POLLING, 1);
    rpc_experiments_default();
    CHECKF(!strcmp(getenv("GRPC_EXPERIMENTS"), RPC_EE_POLLING), "the user's choice kept: '%s'",
           getenv("GRPC_EXPERIMENTS"));
    setenv("GRPC_EXPERIMENTS", start, 1);
    /* gRPC reads the variable once, at its first use: with the server up,
     * only iomgr's own epoll set exists (two with the poller running). */
    struct moe_error err = {0};
    struct rpc_server *s = rpc_server_create("127.0.0.1:0", 1, NULL, &err);
    CHECKF(s != NULL, "%s", err.msg);
    int n = count_epoll_fds();
    CHECKF(n >= 0 && n <= 1, "%d epoll sets with a gRPC server created", n);
    rpc_server_destroy(s, 0);
}

static void test_bad_inputs(void)
{
    struct moe_error err = {0};
    CHECK(rpc_server_create("127.0.0.1:0", 0, NULL, &err) == NULL);
    CHECK(rpc_server_create("not an address", 1, NULL, &err) == NULL);
    CHECKF(strstr(err.msg, "not an address") != NULL, "%s", err.msg);
    /* gRPC alone would listen on 99999 mod 65536 */
    CHECK(rpc_server_create("127.0.0.1:99999", 1, NULL, &err) == NULL);
    CHECKF(strstr(err.msg, "'127.0.0.1:99999'") && strstr(err.msg, "0..65535"), "%s", err.msg);
    /* Created, never started. */
    struct rpc_server *s = rpc_server_create("127.0.0.1:0", 1, NULL, &err);
    CHECK(s != NULL);
    CHECK(s && rpc_server_add_unary(s, "no-slash", handle_echo, NULL, &err) == MOE_ERR_INVALID);
    rpc_server_destroy(s, 0);
    rpc_server_destroy(NULL, 0);
    rpc_client_destroy(NULL);
    rpc_client_stream_destroy(NULL);
    CHECK(rpc_client_create("", NULL, &err) == NULL);
}

int main(void)
{
    double t0 = moe_now();
    test_experiments_default();
    test_bad_inputs();
    struct rpc_server *srv = server_start(2);
    if (!srv) {
        return test_summary();
    }
    char target[64];
    snprintf(target, sizeof(target), "127.0.0.1:%d", rpc_server_port(srv));
    struct moe_error err = {0};
    struct rpc_client *c = rpc_client_create(target, NULL, &err);
    CHECKF(c != NULL, "%s", err.msg);
    if (c) {
        test_unary(c);
        test_stream(c);
        test_big(c);
        test_cancel(c);
        test_deadline(c);
        test_health(srv, c);
        test_concurrent(c);
        rpc_client_destroy(c);
    }
    rpc_server_destroy(srv, 500);
    producers_join();
    test_shutdown_during_stream();
    fprintf(stderr, "test_rpc: %.2f s\n", moe_now() - t0);
    return test_summary();
}
