/* The HTTP server helper against libcurl: answers in the handler and later
 * from another thread, streams (chunked, in order), 404 / 405 / 413 in
 * OpenAI's error shape, HEAD, keep-alive and the idle timeout, many
 * suspended requests at once,
 * a client that goes away (seen by a write, by on_close and by
 * http_request_client_gone), and destroy with requests still held. */
#include <arpa/inet.h>
#include <curl/curl.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "http_server.h"
#include "testlib.h"

static int g_port;

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- handlers ------------------------------------------------------------------------- */

static void h_sync(struct http_request *rq, void *user)
{
    (void)user;
    http_respond(rq, 200, "text/plain", "hello", 5);
}

static void h_echo(struct http_request *rq, void *user)
{
    (void)user;
    size_t n;
    const char *b = http_request_body(rq, &n);
    const char *ct = http_request_header(rq, "Content-Type");
    char *out = malloc(n + 64);
    int k = snprintf(out, 64, "%s|", ct ? ct : "-");
    memcpy(out + k, b, n);
    http_respond(rq, 201, "application/octet-stream", out, (size_t)k + n);
    free(out);
}

static void *later(void *p)
{
    sleep_ms(50);
    http_respond(p, 200, "text/plain", "later", 5);
    return NULL;
}

static void h_async(struct http_request *rq, void *user)
{
    (void)user;
    pthread_t t;
    pthread_create(&t, NULL, later, rq);
    pthread_detach(t);
}

static void *streamer(void *p)
{
    struct http_request *rq = p;
    char buf[32];
    http_stream_begin(rq, 200, "text/event-stream");
    for (int i = 0; i < 5; i++) {
        int n = snprintf(buf, sizeof buf, "data: %d\n\n", i);
        http_stream_write(rq, buf, (size_t)n);
        sleep_ms(20);
    }
    http_stream_end(rq);
    return NULL;
}

static void h_stream(struct http_request *rq, void *user)
{
    (void)user;
    pthread_t t;
    pthread_create(&t, NULL, streamer, rq);
    pthread_detach(t);
}

/* /gone: streams until a write fails or the client is seen gone. */
static int g_close_fired, g_gone_seen, g_writes_failed;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static void on_close(struct http_request *rq, void *user)
{
    (void)rq;
    (void)user;
    pthread_mutex_lock(&g_mu);
    g_close_fired++;
    pthread_mutex_unlock(&g_mu);
}

static void *gone_streamer(void *p)
{
    struct http_request *rq = p;
    http_stream_begin(rq, 200, "text/plain");
    double t_end = moe_now() + 10;
    while (moe_now() < t_end) {
        if (http_stream_write(rq, "tick\n", 5) != MOE_OK) {
            pthread_mutex_lock(&g_mu);
            g_writes_failed++;
            pthread_mutex_unlock(&g_mu);
            break;
        }
        sleep_ms(5);
    }
    http_stream_end(rq);
    return NULL;
}

static void h_gone(struct http_request *rq, void *user)
{
    (void)user;
    http_request_set_on_close(rq, on_close, NULL);
    pthread_t t;
    pthread_create(&t, NULL, gone_streamer, rq);
    pthread_detach(t);
}

/* /quiet: writes nothing; a watcher polls http_request_client_gone. */
static void *watcher(void *p)
{
    struct http_request *rq = p;
    double t_end = moe_now() + 10;
    while (moe_now() < t_end && !http_request_client_gone(rq))
        sleep_ms(5);
    pthread_mutex_lock(&g_mu);
    g_gone_seen += moe_now() < t_end;
    pthread_mutex_unlock(&g_mu);
    http_respond(rq, 200, "text/plain", "too late", 8);
    return NULL;
}

static void h_quiet(struct http_request *rq, void *user)
{
    (void)user;
    pthread_t t;
    pthread_create(&t, NULL, watcher, rq);
    pthread_detach(t);
}

/* /hold: ended only by on_close (destroy's cancel). */
static void hold_close(struct http_request *rq, void *user)
{
    (void)user;
    http_respond(rq, 503, "text/plain", "bye", 3);
}

static void h_hold(struct http_request *rq, void *user)
{
    (void)user;
    http_request_set_on_close(rq, hold_close, NULL);
}

/* ---- client ------------------------------------------------------------------------------ */

struct reply {
    long status;
    char body[4096];
    size_t len;
    char headers[2048];
    size_t hlen;
    int chunks;
};

static size_t on_body(char *p, size_t sz, size_t n, void *u)
{
    struct reply *r = u;
    size_t k = sz * n;
    if (r->len + k < sizeof r->body) {
        memcpy(r->body + r->len, p, k);
        r->len += k;
        r->body[r->len] = '\0';
    }
    r->chunks++;
    return k;
}

static size_t on_header(char *p, size_t sz, size_t n, void *u)
{
    struct reply *r = u;
    size_t k = sz * n;
    if (r->hlen + k < sizeof r->headers) {
        memcpy(r->headers + r->hlen, p, k);
        r->hlen += k;
        r->headers[r->hlen] = '\0';
    }
    return k;
}

static CURLcode fetch(CURL *c, const char *method, const char *path, const char *body,
                      size_t body_len, long timeout_ms, struct reply *r)
{
    char url[256];
    snprintf(url, sizeof url, "http://127.0.0.1:%d%s", g_port, path);
    memset(r, 0, sizeof *r);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(c, CURLOPT_NOBODY, !strcmp(method, "HEAD") ? 1L : 0L);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, !strcmp(method, "HEAD") ? NULL : method);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)body_len);
    if (!body)
        curl_easy_setopt(c, CURLOPT_HTTPGET, !strcmp(method, "HEAD") ? 0L : 1L);
    if (!body && strcmp(method, "GET") && strcmp(method, "HEAD"))
        curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    CURLcode rc = curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r->status);
    return rc;
}

struct par {
    int i;
    long status;
};

static void *par_get(void *p)
{
    struct par *a = p;
    CURL *c = curl_easy_init();
    struct reply r;
    fetch(c, "GET", "/async", NULL, 0, 10000, &r);
    a->status = r.status == 200 && !strcmp(r.body, "later") ? 200 : -1;
    curl_easy_cleanup(c);
    return NULL;
}

static int wait_count(int *v, int want, double timeout)
{
    double t_end = moe_now() + timeout;
    int got;
    do {
        pthread_mutex_lock(&g_mu);
        got = *v;
        pthread_mutex_unlock(&g_mu);
        if (got >= want)
            break;
        sleep_ms(5);
    } while (moe_now() < t_end);
    return got;
}

int main(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
    struct moe_error err = {0};
    struct http_server_opts o = {.listen = "127.0.0.1:0", .threads = 2, .max_body_bytes = 1024};
    struct http_server *s = http_server_create(&o, &err);
    CHECK(s != NULL);
    CHECK(http_server_route(s, "GET", "/sync", h_sync, NULL, &err) == MOE_OK);
    CHECK(http_server_route(s, "POST", "/echo", h_echo, NULL, &err) == MOE_OK);
    CHECK(http_server_route(s, "GET", "/async", h_async, NULL, &err) == MOE_OK);
    CHECK(http_server_route(s, "GET", "/stream", h_stream, NULL, &err) == MOE_OK);
    CHECK(http_server_route(s, "GET", "/gone", h_gone, NULL, &err) == MOE_OK);
    CHECK(http_server_route(s, "GET", "/quiet", h_quiet, NULL, &err) == MOE_OK);
    CHECK(http_server_route(s, "GET", "/hold", h_hold, NULL, &err) == MOE_OK);
    CHECKF(http_server_start(s, &err) == MOE_OK, "%s", err.msg);
    g_port = http_server_port(s);
    CHECK(g_port > 0);

    /* Bad listen addresses are refused, naming them. */
    struct http_server_opts bad = {.listen = "nonsense"};
    CHECK(http_server_create(&bad, &err) == NULL && strstr(err.msg, "nonsense"));
    struct http_server_opts busy = {.listen = "127.0.0.1:0"};
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", g_port);
    busy.listen = addr;
    struct http_server *s2 = http_server_create(&busy, &err);
    CHECK(s2 && http_server_start(s2, &err) == MOE_ERR_IO && strstr(err.msg, addr));
    http_server_destroy(s2, 0);

    CURL *c = curl_easy_init();
    struct reply r;
    CHECK(fetch(c, "GET", "/sync", NULL, 0, 5000, &r) == CURLE_OK && r.status == 200 &&
          !strcmp(r.body, "hello"));
    /* Keep-alive: the second request reuses the connection. */
    long conns = -1;
    CHECK(fetch(c, "GET", "/sync", NULL, 0, 5000, &r) == CURLE_OK && r.status == 200);
    curl_easy_getinfo(c, CURLINFO_NUM_CONNECTS, &conns);
    CHECKF(conns == 0, "a new connection for the second request (%ld)", conns);
    CHECK(fetch(c, "HEAD", "/sync", NULL, 0, 5000, &r) == CURLE_OK && r.status == 200 &&
          r.len == 0);
    CHECK(fetch(c, "POST", "/echo", "abc", 3, 5000, &r) == CURLE_OK && r.status == 201 &&
          strstr(r.body, "|abc"));
    char *big = malloc(4000);
    memset(big, 'x', 4000);
    CHECK(fetch(c, "POST", "/echo", big, 4000, 5000, &r) == CURLE_OK && r.status == 413 &&
          strstr(r.body, "\"code\":413") && strstr(r.body, "1024 bytes"));
    CHECK(fetch(c, "POST", "/echo", "ok", 2, 5000, &r) == CURLE_OK && r.status == 201);
    free(big);
    /* Far beyond the limit: refused before the body is read. */
    size_t huge_n = 64 << 10;
    char *huge = malloc(huge_n);
    memset(huge, 'y', huge_n);
    CURLcode hrc = fetch(c, "POST", "/echo", huge, huge_n, 5000, &r);
    CHECKF(hrc != CURLE_OK || r.status == 413, "a 64 KiB body: %d %ld", hrc, r.status);
    free(huge);
    CHECK(fetch(c, "GET", "/nope", NULL, 0, 5000, &r) == CURLE_OK && r.status == 404 &&
          strstr(r.body, "\"error\"") && strstr(r.body, "\"param\":null"));
    CHECK(fetch(c, "POST", "/sync", "x", 1, 5000, &r) == CURLE_OK && r.status == 405 &&
          strstr(r.headers, "Allow: GET"));
    double t0 = moe_now();
    CHECK(fetch(c, "GET", "/async", NULL, 0, 5000, &r) == CURLE_OK && r.status == 200 &&
          !strcmp(r.body, "later") && moe_now() - t0 >= 0.045);
    CHECK(fetch(c, "GET", "/stream", NULL, 0, 5000, &r) == CURLE_OK && r.status == 200 &&
          !strcmp(r.body, "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n") &&
          strstr(r.headers, "chunked") && strstr(r.headers, "text/event-stream"));
    CHECKF(r.chunks >= 3, "the stream arrived in %d pieces", r.chunks);

    /* 64 requests waiting at once on 2 polling threads. */
    enum { N_PAR = 64 };
    pthread_t th[N_PAR];
    struct par pa[N_PAR];
    for (int i = 0; i < N_PAR; i++) {
        pa[i] = (struct par){i, 0};
        pthread_create(&th[i], NULL, par_get, &pa[i]);
    }
    int good = 0;
    for (int i = 0; i < N_PAR; i++) {
        pthread_join(th[i], NULL);
        good += pa[i].status == 200;
    }
    CHECKF(good == N_PAR, "%d of %d concurrent waiting requests answered", good, N_PAR);

    /* A streaming client that goes away: writes fail and on_close fires. */
    fetch(c, "GET", "/gone", NULL, 0, 100, &r);
    curl_easy_cleanup(c); /* closes the connection */
    c = curl_easy_init();
    CHECKF(wait_count(&g_writes_failed, 1, 5) == 1, "writes after the client left succeeded");
    CHECKF(wait_count(&g_close_fired, 1, 5) == 1, "on_close did not fire");
    /* A client of a request that writes nothing goes away: seen by a peek. */
    fetch(c, "GET", "/quiet", NULL, 0, 100, &r);
    curl_easy_cleanup(c);
    c = curl_easy_init();
    CHECKF(wait_count(&g_gone_seen, 1, 5) == 1, "http_request_client_gone never said so");
    CHECK(fetch(c, "GET", "/sync", NULL, 0, 5000, &r) == CURLE_OK && r.status == 200);
    curl_easy_cleanup(c);

    /* An idle keep-alive connection is closed after idle_timeout_s. */
    {
        struct http_server_opts io = {.listen = "127.0.0.1:0", .idle_timeout_s = 1};
        struct http_server *is = http_server_create(&io, &err);
        CHECK(is && http_server_route(is, "GET", "/sync", h_sync, NULL, &err) == MOE_OK &&
              http_server_start(is, &err) == MOE_OK);
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in sa = {.sin_family = AF_INET,
                                 .sin_port = htons((uint16_t)http_server_port(is)),
                                 .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        CHECK(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
        static const char get[] = "GET /sync HTTP/1.1\r\nHost: x\r\n\r\n";
        CHECK(write(fd, get, sizeof get - 1) == (ssize_t)(sizeof get - 1));
        double t_idle = 0, t_end = moe_now() + 10;
        char buf[512];
        size_t got = 0;
        for (;;) { /* the answer, then EOF once the idle timeout passes */
            struct pollfd pfd = {.fd = fd, .events = POLLIN};
            if (poll(&pfd, 1, 100) <= 0) {
                if (moe_now() > t_end)
                    break;
                continue;
            }
            ssize_t n = read(fd, buf, sizeof buf);
            if (n <= 0)
                break;
            got += (size_t)n;
            t_idle = moe_now();
        }
        double closed_after = moe_now() - t_idle;
        CHECKF(got > 0 && closed_after > 0.5 && closed_after < 5,
               "idle connection closed %.2f s after the answer (timeout 1 s, %zu bytes)",
               closed_after, got);
        close(fd);
        http_server_destroy(is, 0);
    }

    /* Quiesce (a drain): new connections are refused at once, a keep-alive
     * connection opened before still gets its answers. */
    {
        struct http_server_opts qo = {.listen = "127.0.0.1:0"};
        struct http_server *qs = http_server_create(&qo, &err);
        CHECK(qs && http_server_route(qs, "GET", "/sync", h_sync, NULL, &err) == MOE_OK &&
              http_server_start(qs, &err) == MOE_OK);
        struct sockaddr_in sa = {.sin_family = AF_INET,
                                 .sin_port = htons((uint16_t)http_server_port(qs)),
                                 .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        CHECK(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
        static const char get[] = "GET /sync HTTP/1.1\r\nHost: x\r\n\r\n";
        char buf[512];
        CHECK(write(fd, get, sizeof get - 1) == (ssize_t)(sizeof get - 1));
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        CHECK(poll(&pfd, 1, 10000) == 1 && read(fd, buf, sizeof buf) > 0);
        http_server_quiesce(qs);
        int fd2 = socket(AF_INET, SOCK_STREAM, 0);
        int rc = connect(fd2, (struct sockaddr *)&sa, sizeof sa);
        CHECKF(rc == -1 && errno == ECONNREFUSED,
               "a connection after quiesce: connect returned %d (%s), expected ECONNREFUSED", rc,
               rc ? strerror(errno) : "connected");
        close(fd2);
        CHECK(write(fd, get, sizeof get - 1) == (ssize_t)(sizeof get - 1));
        ssize_t n = poll(&pfd, 1, 10000) == 1 ? read(fd, buf, sizeof buf - 1) : -1;
        buf[n > 0 ? n : 0] = 0;
        CHECKF(n > 0 && strstr(buf, "200"), "the open connection after quiesce got '%s'", buf);
        close(fd);
        http_server_destroy(qs, 0);
    }

    /* Destroy with a request held: on_close ends it after the grace. */
    CURL *hc = curl_easy_init();
    CURLM *multi = curl_multi_init();
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/hold", g_port);
    curl_easy_setopt(hc, CURLOPT_URL, url);
    curl_easy_setopt(hc, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(hc, CURLOPT_WRITEFUNCTION, on_body);
    struct reply held;
    memset(&held, 0, sizeof held);
    curl_easy_setopt(hc, CURLOPT_WRITEDATA, &held);
    curl_multi_add_handle(multi, hc);
    int running = 1;
    for (int i = 0; i < 20 && running; i++) { /* send the request */
        curl_multi_perform(multi, &running);
        curl_multi_poll(multi, NULL, 0, 10, NULL);
    }
    t0 = moe_now();
    http_server_destroy(s, 100);
    double dt = moe_now() - t0;
    CHECKF(dt >= 0.09 && dt < 5, "destroy took %.3f s with a held request (grace 0.1 s)", dt);
    for (int i = 0; i < 200 && running; i++) {
        curl_multi_perform(multi, &running);
        curl_multi_poll(multi, NULL, 0, 10, NULL);
    }
    long st = 0;
    curl_easy_getinfo(hc, CURLINFO_RESPONSE_CODE, &st);
    CHECKF(st == 503 && !strcmp(held.body, "bye"), "the held request got %ld '%s'", st, held.body);
    curl_multi_remove_handle(multi, hc);
    curl_easy_cleanup(hc);
    curl_multi_cleanup(multi);
    curl_global_cleanup();
    return test_summary();
}
