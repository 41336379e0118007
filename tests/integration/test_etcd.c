/* Integration test of common/etcd.[ch] against a private etcd started on free
 * loopback ports in a temporary data directory (killed at exit, and by
 * PR_SET_PDEATHSIG if this process dies). The transport error tests (refused,
 * timeout, malformed answers from a fake server) run first and need no etcd;
 * without an `etcd` binary on PATH (or $MOE_ETCD_BIN) the rest is skipped
 * (exit 77). */
#define _GNU_SOURCE /* strcasestr */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "base64.h"
#include "etcd.h"
#include "testlib.h"

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* A loopback TCP socket bound to a free port; listening if `backlog` > 0. */
static int loopback_socket(int backlog, int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0 || (backlog && listen(fd, backlog))) {
        close(fd);
        return -1;
    }
    *port = ntohs(a.sin_port);
    return fd;
}

static int free_port(void)
{
    int port = 0;
    int fd = loopback_socket(0, &port);
    if (fd >= 0)
        close(fd);
    return port;
}

/* ---- base64 ---------------------------------------------------------------- */

static void test_base64(void)
{
    char enc[128];
    unsigned char dec[128];
    size_t n;
    moe_base64_encode("foo", 3, enc);
    CHECK(strcmp(enc, "Zm9v") == 0);
    moe_base64_encode("fo", 2, enc);
    CHECK(strcmp(enc, "Zm8=") == 0);
    moe_base64_encode("f", 1, enc);
    CHECK(strcmp(enc, "Zg==") == 0);
    moe_base64_encode("", 0, enc);
    CHECK(strcmp(enc, "") == 0);
    unsigned char src[70];
    for (size_t i = 0; i < sizeof src; i++)
        src[i] = (unsigned char)(i * 37 + 255);
    int ok = 1;
    for (size_t len = 0; len <= sizeof src; len++) {
        moe_base64_encode(src, len, enc);
        ok &= strlen(enc) == moe_base64_encoded_len(len);
        ok &= moe_base64_decode(enc, strlen(enc), dec, &n, NULL) == MOE_OK && n == len &&
              memcmp(dec, src, len) == 0;
    }
    CHECK(ok);
    struct moe_error err = {0};
    const char *bad[] = {"Zm9", "Zm=v", "Z!9v", "Zg==Zg==", "=Zg="};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECKF(moe_base64_decode(bad[i], strlen(bad[i]), dec, &n, &err) == MOE_ERR_FORMAT,
               "'%s' accepted", bad[i]);
}

/* ---- transport errors (no etcd needed) ---------------------------------------- */

static void test_refused(void)
{
    int port = free_port();
    char ep[64];
    snprintf(ep, sizeof ep, "http://127.0.0.1:%d", port);
    struct moe_etcd *c = NULL;
    struct moe_error err = {0};
    CHECK(moe_etcd_create(ep, 1000, &c, &err) == MOE_OK);
    if (!c)
        return;
    int64_t t0 = moe_now_ms();
    enum moe_status st = moe_etcd_put(c, "k", "v", 1, 0, NULL, &err);
    int64_t dt = moe_now_ms() - t0;
    CHECK(st == MOE_ERR_IO);
    CHECKF(strstr(err.msg, ep) && strstr(err.msg, "put 'k'") && strstr(err.msg, "cannot connect"),
           "%s", err.msg);
    printf("refused: %" PRId64 " ms: %s\n", dt, err.msg);
    moe_etcd_destroy(c);

    CHECK(moe_etcd_create("127.0.0.1:2379", 1000, &c, &err) == MOE_ERR_INVALID && !c);
    CHECKF(strstr(err.msg, "127.0.0.1:2379"), "%s", err.msg);
    CHECK(moe_etcd_create(" , ", 1000, &c, &err) == MOE_ERR_INVALID && !c);
    moe_etcd_destroy(NULL);
    moe_etcd_watch_destroy(NULL);
    moe_etcd_keeper_destroy(NULL);
}

/* A peer that accepts connections (kernel backlog) but never answers. */
static void test_timeout(void)
{
    int port;
    int fd = loopback_socket(8, &port);
    CHECK(fd >= 0);
    if (fd < 0)
        return;
    char ep[64];
    snprintf(ep, sizeof ep, "http://127.0.0.1:%d", port);
    struct moe_etcd *c = NULL;
    struct moe_error err = {0};
    CHECK(moe_etcd_create(ep, 300, &c, &err) == MOE_OK);
    struct moe_etcd_kv kv;
    int64_t t0 = moe_now_ms();
    CHECK(moe_etcd_get(c, "k", &kv, NULL, &err) == MOE_ERR_IO);
    int64_t dt = moe_now_ms() - t0;
    CHECKF(strstr(err.msg, "timed out after 300 ms") && strstr(err.msg, ep), "%s", err.msg);
    CHECKF(dt >= 250 && dt < 30000, "timeout took %" PRId64 " ms", dt); /* not early, no hang */
    moe_etcd_destroy(c);
    close(fd);
}

/* A fake HTTP server answering each connection with the next canned answer. */
struct fake_server {
    int fd;
    const char *const *answers;
    int n;
    pthread_t thread;
};

/* Reads one HTTP request (headers, then Content-Length bytes of body) into
 * req (NUL-terminated). Returns 0 if the peer closed first. */
static int read_request(int fd, char *req, size_t cap)
{
    size_t len = 0;
    req[0] = '\0';
    while (len < cap - 1) {
        ssize_t r = read(fd, req + len, cap - 1 - len);
        if (r <= 0)
            return 0;
        len += (size_t)r;
        req[len] = '\0';
        const char *hdr_end = strstr(req, "\r\n\r\n");
        if (hdr_end) {
            const char *cl = strcasestr(req, "Content-Length:");
            size_t body = cl ? strtoul(cl + 15, NULL, 10) : 0;
            if (len >= (size_t)(hdr_end + 4 - req) + body)
                return 1;
        }
    }
    return 1;
}

static void write_all(int fd, const char *s)
{
    size_t n = strlen(s);
    while (n) {
        ssize_t w = write(fd, s, n);
        if (w <= 0)
            return;
        s += w;
        n -= (size_t)w;
    }
}

static void *fake_main(void *arg)
{
    struct fake_server *s = arg;
    for (int i = 0; i < s->n; i++) {
        int c = accept(s->fd, NULL, NULL);
        if (c < 0)
            return NULL;
        char req[8192];
        read_request(c, req, sizeof req);
        write_all(c, s->answers[i]);
        close(c);
    }
    return NULL;
}

static void test_malformed(void)
{
    static const char *const answers[] = {
        "HTTP/1.1 200 OK\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot json!",
        "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbusy",
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        ("HTTP/1.1 200 OK\r\nContent-Length: 50\r\nConnection: close\r\n\r\n" /* one answer */
         "{\"header\":{\"revision\":\"3\"},\"kvs\":[{\"key\":\"@@@@\"}]}"),
    };
    int port;
    struct fake_server s = {.answers = answers, .n = 4};
    s.fd = loopback_socket(8, &port);
    CHECK(s.fd >= 0);
    if (s.fd < 0 || pthread_create(&s.thread, NULL, fake_main, &s) != 0)
        return;
    char ep[64];
    snprintf(ep, sizeof ep, "http://127.0.0.1:%d", port);
    struct moe_etcd *c = NULL;
    struct moe_error err = {0};
    struct moe_etcd_kv kv;
    CHECK(moe_etcd_create(ep, 2000, &c, &err) == MOE_OK);
    if (c) {
        CHECK(moe_etcd_put(c, "k", "v", 1, 0, NULL, &err) == MOE_ERR_FORMAT);
        CHECKF(strstr(err.msg, "malformed JSON") && strstr(err.msg, "not json!"), "%s", err.msg);
        CHECK(moe_etcd_put(c, "k", "v", 1, 0, NULL, &err) == MOE_ERR_IO);
        CHECKF(strstr(err.msg, "HTTP 503") && strstr(err.msg, "busy"), "%s", err.msg);
        CHECK(moe_etcd_put(c, "k", "v", 1, 0, NULL, &err) == MOE_ERR_FORMAT);
        CHECKF(strstr(err.msg, "header"), "%s", err.msg);
        CHECK(moe_etcd_get(c, "k", &kv, NULL, &err) == MOE_ERR_FORMAT);
        CHECKF(strstr(err.msg, "base64") && strstr(err.msg, "'key'"), "%s", err.msg);
        printf("malformed: %s\n", err.msg);
    }
    pthread_join(s.thread, NULL);
    moe_etcd_destroy(c);
    close(s.fd);
}

/* ---- the private etcd ----------------------------------------------------------- */

static pid_t etcd_pid = -1;
static char etcd_bin[512];
static char etcd_data[600];
static char etcd_log[600];
static int etcd_client_port, etcd_peer_port;
static char etcd_ep[64];

static void etcd_kill(void)
{
    if (etcd_pid > 0) {
        kill(etcd_pid, SIGKILL);
        waitpid(etcd_pid, NULL, 0);
        etcd_pid = -1;
    }
}

static void on_fatal_signal(int sig)
{
    if (etcd_pid > 0)
        kill(etcd_pid, SIGKILL);
    signal(sig, SIG_DFL);
    raise(sig);
}

static int find_etcd(void)
{
    const char *env = getenv("MOE_ETCD_BIN");
    if (env && *env) {
        snprintf(etcd_bin, sizeof etcd_bin, "%s", env);
        return access(etcd_bin, X_OK) == 0;
    }
    const char *path = getenv("PATH");
    char *dirs = strdup(path ? path : "/usr/bin:/bin");
    int found = 0;
    for (char *save = NULL, *d = strtok_r(dirs, ":", &save); d && !found;
         d = strtok_r(NULL, ":", &save)) {
        snprintf(etcd_bin, sizeof etcd_bin, "%s/etcd", d);
        found = access(etcd_bin, X_OK) == 0;
    }
    free(dirs);
    return found;
}

/* Waits until etcd serves a read (or exited, or 10 s passed). */
static int etcd_wait_ready(void)
{
    struct moe_etcd *c = NULL;
    struct moe_error err = {0};
    if (moe_etcd_create(etcd_ep, 200, &c, &err) != MOE_OK)
        return 0;
    int ready = 0;
    for (int64_t t0 = moe_now_ms(); moe_now_ms() - t0 < 30000;) {
        struct moe_etcd_kv kv;
        enum moe_status st = moe_etcd_get(c, "probe", &kv, NULL, &err);
        moe_etcd_kv_clear(&kv);
        if (st == MOE_OK || st == MOE_ERR_NOT_FOUND) {
            ready = 1;
            break;
        }
        if (waitpid(etcd_pid, NULL, WNOHANG) == etcd_pid) {
            etcd_pid = -1;
            break;
        }
        sleep_ms(20);
    }
    moe_etcd_destroy(c);
    return ready;
}

/* Starts etcd on etcd_client_port/etcd_peer_port with data in etcd_data. */
static int etcd_start(void)
{
    char client[64], peer[64], cluster[80];
    snprintf(client, sizeof client, "http://127.0.0.1:%d", etcd_client_port);
    snprintf(peer, sizeof peer, "http://127.0.0.1:%d", etcd_peer_port);
    snprintf(cluster, sizeof cluster, "n=%s", peer);
    snprintf(etcd_ep, sizeof etcd_ep, "%s", client);
    /* clang-format off */
    char *argv[] = {etcd_bin, "--name", "n", "--data-dir", etcd_data,
                    "--listen-client-urls", client, "--advertise-client-urls", client,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", cluster, "--heartbeat-interval", "10",
                    "--election-timeout", "100", NULL};
    /* clang-format on */
    pid_t parent = getpid();
    int64_t t0 = moe_now_ms();
    pid_t pid = fork();
    if (pid < 0)
        return 0;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* dies with this test, even on a crash */
        if (getppid() != parent)
            _exit(1);
        int fd = open(etcd_log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execv(etcd_bin, argv);
        _exit(127);
    }
    etcd_pid = pid;
    int ok = etcd_wait_ready();
    printf("etcd %s: %s in %" PRId64 " ms (log %s)\n", etcd_ep, ok ? "ready" : "NOT ready",
           moe_now_ms() - t0, etcd_log);
    return ok;
}

/* ---- tests against etcd ----------------------------------------------------------- */

static void test_kv(struct moe_etcd *c)
{
    struct moe_error err = {0};
    int64_t r1 = 0, r2 = 0, r3 = 0, n = -1;
    CHECK(moe_etcd_put(c, "kv/a", "one", 3, 0, &r1, &err) == MOE_OK);
    CHECK(moe_etcd_put(c, "kv/b", "\0bin\xff", 5, 0, &r2, &err) == MOE_OK);
    CHECK(moe_etcd_put(c, "kw/c", "", 0, 0, &r3, &err) == MOE_OK);
    CHECK(r1 > 0 && r2 == r1 + 1 && r3 == r2 + 1);

    struct moe_etcd_kv kv;
    int64_t rev = 0;
    CHECKF(moe_etcd_get(c, "kv/a", &kv, &rev, &err) == MOE_OK, "%s", err.msg);
    CHECK(kv.key && strcmp(kv.key, "kv/a") == 0 && kv.value_len == 3 &&
          strcmp(kv.value, "one") == 0);
    CHECK(kv.create_revision == r1 && kv.mod_revision == r1 && kv.version == 1 && kv.lease == 0);
    CHECK(rev == r3);
    moe_etcd_kv_clear(&kv);
    CHECK(moe_etcd_get(c, "kv/b", &kv, NULL, &err) == MOE_OK);
    CHECK(kv.value_len == 5 && memcmp(kv.value, "\0bin\xff", 5) == 0);
    moe_etcd_kv_clear(&kv);
    CHECK(moe_etcd_get(c, "kw/c", &kv, NULL, &err) == MOE_OK);
    CHECK(kv.value_len == 0 && kv.value && kv.value[0] == '\0');
    moe_etcd_kv_clear(&kv);

    CHECK(moe_etcd_get(c, "kv/missing", &kv, NULL, &err) == MOE_ERR_NOT_FOUND);
    CHECKF(strstr(err.msg, "'kv/missing'") && strstr(err.msg, "not found"), "%s", err.msg);
    CHECK(kv.key == NULL);

    /* overwrite: same create revision, new mod revision, version 2 */
    int64_t r4 = 0;
    CHECK(moe_etcd_put(c, "kv/a", "uno", 3, 0, &r4, &err) == MOE_OK);
    CHECK(moe_etcd_get(c, "kv/a", &kv, NULL, &err) == MOE_OK);
    CHECK(kv.create_revision == r1 && kv.mod_revision == r4 && kv.version == 2 &&
          strcmp(kv.value, "uno") == 0);
    moe_etcd_kv_clear(&kv);

    struct moe_etcd_kvs kvs;
    CHECK(moe_etcd_get_prefix(c, "kv/", &kvs, &err) == MOE_OK);
    CHECK(kvs.n == 2 && kvs.revision == r4);
    if (kvs.n == 2)
        CHECK(strcmp(kvs.kvs[0].key, "kv/a") == 0 && strcmp(kvs.kvs[1].key, "kv/b") == 0);
    moe_etcd_kvs_clear(&kvs);
    CHECK(moe_etcd_get_prefix(c, "", &kvs, &err) == MOE_OK);
    CHECK(kvs.n >= 3);
    moe_etcd_kvs_clear(&kvs);
    CHECK(moe_etcd_get_prefix(c, "nothing/", &kvs, &err) == MOE_OK && kvs.n == 0 && !kvs.kvs);

    CHECK(moe_etcd_delete(c, "kv/a", 0, &n, &err) == MOE_OK && n == 1);
    CHECK(moe_etcd_delete(c, "kv/a", 0, &n, &err) == MOE_OK && n == 0);
    CHECK(moe_etcd_delete(c, "k", 1, &n, &err) == MOE_OK && n == 2); /* kv/b, kw/c */
    CHECK(moe_etcd_get_prefix(c, "k", &kvs, &err) == MOE_OK && kvs.n == 0);
    moe_etcd_kvs_clear(&kvs);
}

static void test_errors_and_failover(struct moe_etcd *c)
{
    struct moe_error err = {0};
    CHECK(moe_etcd_put(c, "err/k", "v", 1, 12345, NULL, &err) == MOE_ERR_NOT_FOUND);
    CHECKF(strstr(err.msg, etcd_ep) && strstr(err.msg, "put 'err/k'") &&
               strstr(err.msg, "lease not found"),
           "%s", err.msg);
    printf("etcd error body: %s\n", err.msg);
    CHECK(moe_etcd_lease_revoke(c, 12345, &err) == MOE_ERR_NOT_FOUND);
    CHECK(moe_etcd_lease_keepalive(c, 12345, NULL, &err) == MOE_ERR_NOT_FOUND);
    CHECKF(strstr(err.msg, "lease 12345 expired"), "%s", err.msg);
    int64_t lease = 0;
    CHECK(moe_etcd_lease_grant(c, 0, &lease, NULL, &err) == MOE_ERR_INVALID);

    /* the first endpoint is down: the request goes to the second */
    char eps[160];
    snprintf(eps, sizeof eps, "http://127.0.0.1:%d, %s/", free_port(), etcd_ep);
    struct moe_etcd *f = NULL;
    CHECK(moe_etcd_create(eps, 10000, &f, &err) == MOE_OK);
    int64_t t0 = moe_now_ms();
    CHECKF(f && moe_etcd_put(f, "err/failover", "x", 1, 0, NULL, &err) == MOE_OK, "%s", err.msg);
    CHECK(moe_now_ms() - t0 < 10000); /* the refused endpoint was not waited out */
    int64_t n = 0;
    CHECK(f && moe_etcd_delete(f, "err/failover", 0, &n, &err) == MOE_OK && n == 1);
    moe_etcd_destroy(f);
}

static void test_lease_revoke(struct moe_etcd *c)
{
    struct moe_error err = {0};
    int64_t lease = 0, ttl = 0;
    CHECKF(moe_etcd_lease_grant(c, 10, &lease, &ttl, &err) == MOE_OK, "%s", err.msg);
    CHECK(lease > 0 && ttl == 10);
    CHECK(moe_etcd_put(c, "lease/k", "v", 1, lease, NULL, &err) == MOE_OK);
    struct moe_etcd_kv kv;
    CHECK(moe_etcd_get(c, "lease/k", &kv, NULL, &err) == MOE_OK && kv.lease == lease);
    moe_etcd_kv_clear(&kv);
    CHECK(moe_etcd_lease_keepalive(c, lease, &ttl, &err) == MOE_OK && ttl == 10);
    CHECK(moe_etcd_lease_revoke(c, lease, &err) == MOE_OK);
    CHECK(moe_etcd_get(c, "lease/k", &kv, NULL, &err) == MOE_ERR_NOT_FOUND);
    CHECK(moe_etcd_lease_keepalive(c, lease, &ttl, &err) == MOE_ERR_NOT_FOUND);
}

static void test_cas(struct moe_etcd *c)
{
    struct moe_error err = {0};
    int ok = -1;
    int64_t r1 = 0, r2 = 0, cur = 0;
    CHECKF(moe_etcd_cas(c, "cas/epoch", 0, "1", 1, 0, &ok, &r1, &err) == MOE_OK, "%s", err.msg);
    CHECK(ok == 1 && r1 > 0);
    CHECK(moe_etcd_cas(c, "cas/epoch", 0, "x", 1, 0, &ok, &cur, &err) == MOE_OK);
    CHECK(ok == 0 && cur == r1); /* must-not-exist fails on an existing key */
    CHECK(moe_etcd_cas(c, "cas/epoch", r1, "2", 1, 0, &ok, &r2, &err) == MOE_OK);
    CHECK(ok == 1 && r2 > r1);
    CHECK(moe_etcd_cas(c, "cas/epoch", r1, "3", 1, 0, &ok, &cur, &err) == MOE_OK);
    CHECK(ok == 0 && cur == r2); /* stale revision */
    struct moe_etcd_kv kv;
    CHECK(moe_etcd_get(c, "cas/epoch", &kv, NULL, &err) == MOE_OK && strcmp(kv.value, "2") == 0 &&
          kv.mod_revision == r2);
    moe_etcd_kv_clear(&kv);
    CHECK(moe_etcd_cas(c, "cas/none", 5, "x", 1, 0, &ok, &cur, &err) == MOE_OK && ok == 0 &&
          cur == 0);
    CHECK(moe_etcd_delete(c, "cas/", 1, NULL, &err) == MOE_OK);
}

struct lost_state {
    atomic_int n;
    char msg[MOE_ERROR_MSG_MAX];
    enum moe_status code;
};

static void on_lost(void *user, int64_t lease, const struct moe_error *why)
{
    struct lost_state *s = user;
    snprintf(s->msg, sizeof s->msg, "%s", why->msg);
    s->code = why->code;
    atomic_fetch_add(&s->n, 1);
}

static int key_exists(struct moe_etcd *c, const char *key)
{
    struct moe_etcd_kv kv;
    struct moe_error err = {0};
    enum moe_status st = moe_etcd_get(c, key, &kv, NULL, &err);
    moe_etcd_kv_clear(&kv);
    if (st != MOE_OK && st != MOE_ERR_NOT_FOUND)
        fprintf(stderr, "get %s: %s\n", key, err.msg);
    return st == MOE_OK;
}

/* Two leases of TTL 2 s: one left alone (its key must vanish in ~2-4 s), one
 * kept alive by a keeper (its key must outlive 2 TTLs); then the kept lease
 * is revoked from outside and the keeper must report the loss. */
static void test_lease_expiry_and_keeper(struct moe_etcd *c)
{
    struct moe_error err = {0};
    int64_t l1 = 0, l2 = 0, ttl = 0;
    CHECK(moe_etcd_lease_grant(c, 2, &l1, &ttl, &err) == MOE_OK && ttl == 2);
    CHECK(moe_etcd_lease_grant(c, 2, &l2, &ttl, &err) == MOE_OK && ttl == 2);
    int64_t t0 = moe_now_ms();
    CHECK(moe_etcd_put(c, "exp/alone", "v", 1, l1, NULL, &err) == MOE_OK);
    CHECK(moe_etcd_put(c, "exp/kept", "v", 1, l2, NULL, &err) == MOE_OK);
    struct lost_state lost = {0};
    struct moe_etcd_keeper *k = NULL;
    CHECKF(moe_etcd_keeper_create(etcd_ep, 1000, l2, on_lost, &lost, &k, &err) == MOE_OK, "%s",
           err.msg);
    int64_t gone_at = -1;
    /* until the unkept key is gone (etcd expires it: ~2 s, later on a loaded
     * machine) and the kept one has lived 2 TTLs and more */
    while (moe_now_ms() - t0 < 30000) {
        if (gone_at < 0 && !key_exists(c, "exp/alone"))
            gone_at = moe_now_ms() - t0;
        if (gone_at >= 0 && moe_now_ms() - t0 >= 4500)
            break;
        sleep_ms(100);
    }
    CHECKF(gone_at >= 1500, "unkept key gone after %" PRId64 " ms", gone_at);
    printf("lease TTL 2 s without keepalive: key gone after %" PRId64 " ms\n", gone_at);
    CHECKF(key_exists(c, "exp/kept"), "kept key gone after %" PRId64 " ms", moe_now_ms() - t0);
    CHECK(k && !moe_etcd_keeper_lost(k) && atomic_load(&lost.n) == 0);

    /* revoked behind the keeper's back: reported within ~TTL/3 */
    CHECK(moe_etcd_lease_revoke(c, l2, &err) == MOE_OK);
    int64_t t1 = moe_now_ms();
    while (atomic_load(&lost.n) == 0 && moe_now_ms() - t1 < 30000)
        sleep_ms(20);
    CHECKF(atomic_load(&lost.n) == 1 && k && moe_etcd_keeper_lost(k),
           "loss not reported after %" PRId64 " ms", moe_now_ms() - t1);
    CHECKF(lost.code == MOE_ERR_NOT_FOUND && strstr(lost.msg, "expired"), "%s", lost.msg);
    printf("keeper reported loss after %" PRId64 " ms: %s\n", moe_now_ms() - t1, lost.msg);
    int64_t t2 = moe_now_ms();
    moe_etcd_keeper_destroy(k);
    CHECK(moe_now_ms() - t2 < 5000);
    CHECK(!key_exists(c, "exp/kept"));

    /* a keeper on a dead lease fails at once */
    k = NULL;
    CHECK(moe_etcd_keeper_create(etcd_ep, 1000, l2, on_lost, &lost, &k, &err) ==
              MOE_ERR_NOT_FOUND &&
          !k);
}

/* Events collected by a watcher callback. */
struct seen_event {
    enum moe_etcd_event_type type;
    char key[64];
    char *value;
    size_t value_len;
    int64_t rev;
};

struct collector {
    pthread_mutex_t mu;
    struct seen_event *ev;
    size_t n, cap;
};

static void on_event(void *user, const struct moe_etcd_event *e)
{
    struct collector *col = user;
    pthread_mutex_lock(&col->mu);
    if (col->n == col->cap) {
        col->cap = col->cap ? 2 * col->cap : 256;
        col->ev = realloc(col->ev, col->cap * sizeof *col->ev);
        MOE_ASSERT(col->ev);
    }
    struct seen_event *s = &col->ev[col->n];
    s->type = e->type;
    snprintf(s->key, sizeof s->key, "%s", e->key);
    s->value = malloc(e->value_len + 1);
    MOE_ASSERT(s->value);
    memcpy(s->value, e->value, e->value_len + 1);
    s->value_len = e->value_len;
    s->rev = e->mod_revision;
    col->n++;
    pthread_mutex_unlock(&col->mu);
}

static size_t collector_count(struct collector *col)
{
    pthread_mutex_lock(&col->mu);
    size_t n = col->n;
    pthread_mutex_unlock(&col->mu);
    return n;
}

static int collector_wait(struct collector *col, size_t n, int timeout_ms)
{
    for (int64_t t0 = moe_now_ms(); moe_now_ms() - t0 < timeout_ms; sleep_ms(10))
        if (collector_count(col) >= n)
            return 1;
    return collector_count(col) >= n;
}

static void collector_free(struct collector *col)
{
    for (size_t i = 0; i < col->n; i++)
        free(col->ev[i].value);
    free(col->ev);
    pthread_mutex_destroy(&col->mu);
}

/* Revisions strictly increasing: in order, nothing delivered twice. */
static int collector_ordered(struct collector *col)
{
    for (size_t i = 1; i < col->n; i++)
        if (col->ev[i].rev <= col->ev[i - 1].rev)
            return 0;
    return 1;
}

/* A fake watch stream, deterministic where real etcd is not: lines split
 * across writes, an in-band error line, a compaction cancel. Connection 1:
 * created + a PUT at rev 7 split in three writes + {"error":...}; connection
 * 2 must resume at rev 8: a DELETE at 8, then canceled with compact_revision
 * 20; connection 3 must resume at 20 and stays open until destroy. */
struct fake_watch {
    int fd;
    char bodies[3][512];
    int n_conn;
    pthread_t thread;
};

static void *fake_watch_main(void *arg)
{
    struct fake_watch *s = arg;
    static const char *const head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                    "Connection: close\r\n\r\n";
    static const char *const created =
        "{\"result\":{\"header\":{\"revision\":\"6\"},\"created\":true}}\n";
    for (int i = 0; i < 3; i++) {
        int c = accept(s->fd, NULL, NULL);
        if (c < 0)
            return NULL;
        char req[8192];
        read_request(c, req, sizeof req);
        const char *body = strstr(req, "\r\n\r\n");
        snprintf(s->bodies[i], sizeof s->bodies[i], "%s", body ? body + 4 : "");
        s->n_conn = i + 1;
        write_all(c, head);
        write_all(c, created);
        if (i == 0) {
            /* {"key":"ZC9r","value":"aGVsbG8="} is d/k = hello */
            write_all(c, "{\"result\":{\"header\":{\"revision\":\"7\"},\"events\":[{\"kv\":{\"ke");
            sleep_ms(30);
            write_all(c,
                      "y\":\"ZC9r\",\"create_revision\":\"7\",\"mod_revision\":\"7\",\"version\":");
            sleep_ms(30);
            write_all(c, "\"1\",\"value\":\"aGVsbG8=\"}}]}}\n{\"error\":{\"grpc_code\":14,"
                         "\"http_code\":503,\"message\":\"boom\"}}\n");
        } else if (i == 1) {
            write_all(c, "{\"result\":{\"header\":{\"revision\":\"8\"},\"events\":[{\"type\":"
                         "\"DELETE\",\"kv\":{\"key\":\"ZC9r\",\"mod_revision\":\"8\"}}]}}\n"
                         "{\"result\":{\"header\":{},\"canceled\":true,"
                         "\"compact_revision\":\"20\"}}\n");
        }
        char drain[256]; /* until the client closes (3rd: at destroy) */
        while (read(c, drain, sizeof drain) > 0) {
        }
        close(c);
    }
    return NULL;
}

static void test_watch_stream_quirks(void)
{
    int port;
    struct fake_watch s = {0};
    s.fd = loopback_socket(8, &port);
    CHECK(s.fd >= 0);
    if (s.fd < 0 || pthread_create(&s.thread, NULL, fake_watch_main, &s) != 0)
        return;
    char ep[64];
    snprintf(ep, sizeof ep, "http://127.0.0.1:%d", port);
    struct collector col = {.mu = PTHREAD_MUTEX_INITIALIZER};
    struct moe_etcd_watch *w = NULL;
    struct moe_error err = {0};
    CHECKF(moe_etcd_watch_create(ep, 1000, "d/", 1, 5, on_event, &col, &w, &err) == MOE_OK, "%s",
           err.msg);
    CHECK(collector_wait(&col, 3, 30000));
    for (int64_t t0 = moe_now_ms();
         w && moe_etcd_watch_n_connects(w) < 3 && moe_now_ms() - t0 < 30000;)
        sleep_ms(5);
    CHECK(w && moe_etcd_watch_n_connects(w) == 3);
    moe_etcd_watch_destroy(w);
    pthread_join(s.thread, NULL);
    close(s.fd);
    CHECK(s.n_conn == 3);
    /* d/ = ZC8=, range_end d0 = ZDA= */
    CHECKF(strstr(s.bodies[0], "\"key\":\"ZC8=\"") &&
               strstr(s.bodies[0], "\"range_end\":\"ZDA=\"") &&
               strstr(s.bodies[0], "\"start_revision\":\"5\""),
           "%s", s.bodies[0]);
    CHECKF(strstr(s.bodies[1], "\"start_revision\":\"8\""), "%s", s.bodies[1]);
    CHECKF(strstr(s.bodies[2], "\"start_revision\":\"20\""), "%s", s.bodies[2]);
    CHECK(col.n == 3);
    if (col.n == 3) {
        CHECK(col.ev[0].type == MOE_ETCD_EVENT_PUT && strcmp(col.ev[0].key, "d/k") == 0 &&
              strcmp(col.ev[0].value, "hello") == 0 && col.ev[0].rev == 7);
        CHECK(col.ev[1].type == MOE_ETCD_EVENT_DELETE && strcmp(col.ev[1].key, "d/k") == 0 &&
              col.ev[1].rev == 8);
        CHECK(col.ev[2].type == MOE_ETCD_EVENT_RESYNC && col.ev[2].rev == 20);
    }
    collector_free(&col);
}

#define N_BURST 200
#define BIG_LEN (100 * 1024)

static void test_watch_and_restart(struct moe_etcd *c)
{
    struct moe_error err = {0};
    struct moe_etcd_kvs snap;
    CHECK(moe_etcd_get_prefix(c, "w/", &snap, &err) == MOE_OK && snap.n == 0);
    struct collector col = {.mu = PTHREAD_MUTEX_INITIALIZER};
    struct collector one = {.mu = PTHREAD_MUTEX_INITIALIZER};
    struct moe_etcd_watch *w = NULL, *w1 = NULL;
    CHECKF(moe_etcd_watch_create(etcd_ep, 1000, "w/", 1, snap.revision + 1, on_event, &col, &w,
                                 &err) == MOE_OK,
           "%s", err.msg);
    /* a second watcher on one key, from "now": wait until it is established */
    CHECKF(moe_etcd_watch_create(etcd_ep, 1000, "w/a", 0, 0, on_event, &one, &w1, &err) == MOE_OK,
           "%s", err.msg);
    for (int64_t t0 = moe_now_ms();
         w1 && moe_etcd_watch_n_connects(w1) < 1 && moe_now_ms() - t0 < 30000;)
        sleep_ms(5);
    CHECK(w1 && moe_etcd_watch_n_connects(w1) == 1);

    char *big = malloc(BIG_LEN);
    MOE_ASSERT(big);
    for (size_t i = 0; i < BIG_LEN; i++)
        big[i] = (char)(i * 131 + (i >> 9));
    int64_t t0 = moe_now_ms();
    CHECK(moe_etcd_put(c, "w/a", "1", 1, 0, NULL, &err) == MOE_OK);
    CHECK(moe_etcd_put(c, "w/big", big, BIG_LEN, 0, NULL, &err) == MOE_OK);
    CHECK(moe_etcd_delete(c, "w/a", 0, NULL, &err) == MOE_OK);
    for (int i = 0; i < N_BURST; i++) {
        char key[32], val[32];
        snprintf(key, sizeof key, "w/burst/%03d", i);
        int n = snprintf(val, sizeof val, "v%d", i);
        CHECK(moe_etcd_put(c, key, val, (size_t)n, 0, NULL, &err) == MOE_OK);
    }
    CHECK(moe_etcd_put(c, "w/big", big, BIG_LEN, 0, NULL, &err) == MOE_OK); /* again, after */
    int64_t t_put = moe_now_ms() - t0;
    size_t want = 3 + N_BURST + 1;
    CHECKF(collector_wait(&col, want, 30000), "saw %zu of %zu events", collector_count(&col), want);
    printf("watch: %zu puts in %" PRId64 " ms, all %zu events after %" PRId64 " ms\n", want, t_put,
           collector_count(&col), moe_now_ms() - t0);
    pthread_mutex_lock(&col.mu);
    if (col.n == want) {
        CHECK(collector_ordered(&col));
        CHECK(col.ev[0].type == MOE_ETCD_EVENT_PUT && strcmp(col.ev[0].key, "w/a") == 0 &&
              strcmp(col.ev[0].value, "1") == 0);
        CHECK(col.ev[0].rev == snap.revision + 1);
        CHECK(col.ev[1].type == MOE_ETCD_EVENT_PUT && strcmp(col.ev[1].key, "w/big") == 0 &&
              col.ev[1].value_len == BIG_LEN && memcmp(col.ev[1].value, big, BIG_LEN) == 0);
        CHECK(col.ev[2].type == MOE_ETCD_EVENT_DELETE && strcmp(col.ev[2].key, "w/a") == 0 &&
              col.ev[2].value_len == 0);
        int burst_ok = 1;
        for (int i = 0; i < N_BURST; i++) {
            char key[32], val[32];
            snprintf(key, sizeof key, "w/burst/%03d", i);
            snprintf(val, sizeof val, "v%d", i);
            const struct seen_event *e = &col.ev[3 + i];
            burst_ok &= e->type == MOE_ETCD_EVENT_PUT && strcmp(e->key, key) == 0 &&
                        strcmp(e->value, val) == 0;
        }
        CHECK(burst_ok);
        const struct seen_event *last = &col.ev[want - 1];
        CHECK(strcmp(last->key, "w/big") == 0 && last->value_len == BIG_LEN &&
              memcmp(last->value, big, BIG_LEN) == 0);
    }
    pthread_mutex_unlock(&col.mu);
    free(big);
    CHECK(collector_wait(&one, 2, 30000) && collector_count(&one) == 2);
    if (collector_count(&one) == 2)
        CHECK(one.ev[0].type == MOE_ETCD_EVENT_PUT && one.ev[1].type == MOE_ETCD_EVENT_DELETE);

    /* kill etcd under the watcher, write while it is down (refused), restart
     * it on the same data dir and ports: the watcher resumes after the last
     * revision it saw and gets the later events once, in order */
    CHECK(moe_etcd_put(c, "w/pre", "p", 1, 0, NULL, &err) == MOE_OK);
    CHECK(collector_wait(&col, want + 1, 30000));
    int connects = w ? moe_etcd_watch_n_connects(w) : 0;
    etcd_kill();
    int64_t t_kill = moe_now_ms();
    CHECK(moe_etcd_put(c, "w/down", "d", 1, 0, NULL, &err) == MOE_ERR_IO);
    CHECKF(strstr(err.msg, "cannot connect"), "%s", err.msg);
    sleep_ms(300); /* the watcher retries against a dead endpoint meanwhile */
    CHECK(etcd_start());
    int put_ok = 0;
    for (int64_t t1 = moe_now_ms(); !put_ok && moe_now_ms() - t1 < 30000; sleep_ms(50))
        put_ok = moe_etcd_put(c, "w/post1", "a", 1, 0, NULL, &err) == MOE_OK;
    CHECKF(put_ok, "put after restart: %s", err.msg);
    CHECK(moe_etcd_put(c, "w/post2", "b", 1, 0, NULL, &err) == MOE_OK);
    CHECKF(collector_wait(&col, want + 3, 30000), "after restart saw %zu of %zu events",
           collector_count(&col), want + 3);
    printf("watch resumed %" PRId64 " ms after the kill (connects %d -> %d)\n",
           moe_now_ms() - t_kill, connects, w ? moe_etcd_watch_n_connects(w) : 0);
    sleep_ms(100); /* nothing more may arrive */
    pthread_mutex_lock(&col.mu);
    CHECK(col.n == want + 3);
    CHECK(collector_ordered(&col));
    if (col.n == want + 3)
        CHECK(strcmp(col.ev[want].key, "w/pre") == 0 &&
              strcmp(col.ev[want + 1].key, "w/post1") == 0 &&
              strcmp(col.ev[want + 2].key, "w/post2") == 0);
    pthread_mutex_unlock(&col.mu);
    CHECK(w && moe_etcd_watch_n_connects(w) > connects);

    int64_t t2 = moe_now_ms();
    moe_etcd_watch_destroy(w);
    moe_etcd_watch_destroy(w1);
    int64_t dt = moe_now_ms() - t2;
    CHECKF(dt < 30000, "watch destroy took %" PRId64 " ms", dt); /* an idle watch never ends */
    printf("watch destroy: %" PRId64 " ms\n", dt);
    collector_free(&col);
    collector_free(&one);
    CHECK(moe_etcd_delete(c, "w/", 1, NULL, &err) == MOE_OK);
}

/* Sequential latency over loopback with the reused connection (printed, not
 * checked: the machine is shared). */
static void test_latency(struct moe_etcd *c)
{
    struct moe_error err = {0};
    enum { N = 100 };
    int ok = 1;
    int64_t t0 = moe_now_ms();
    for (int i = 0; i < N; i++)
        ok &= moe_etcd_put(c, "lat/k", "value", 5, 0, NULL, &err) == MOE_OK;
    int64_t t1 = moe_now_ms();
    for (int i = 0; i < N; i++) {
        struct moe_etcd_kv kv;
        ok &= moe_etcd_get(c, "lat/k", &kv, NULL, &err) == MOE_OK && kv.value_len == 5;
        moe_etcd_kv_clear(&kv);
    }
    int64_t t2 = moe_now_ms();
    CHECKF(ok, "%s", err.msg);
    CHECK(moe_etcd_delete(c, "lat/k", 0, NULL, &err) == MOE_OK);
    printf("latency: put %.0f us, get %.0f us (mean of %d)\n", (double)(t1 - t0) * 1000.0 / N,
           (double)(t2 - t1) * 1000.0 / N, N);
}

int main(void)
{
    test_base64();
    test_refused();
    test_timeout();
    test_malformed();
    test_watch_stream_quirks();

    if (!find_etcd()) {
        fprintf(stderr, "test_etcd: no etcd binary on PATH (apt-get install etcd-server, or set "
                        "MOE_ETCD_BIN): etcd tests skipped\n");
        test_summary();
        return test_n_fail ? 1 : TEST_SKIP_CODE;
    }
    snprintf(etcd_data, sizeof etcd_data, "%s/etcd-data", test_temp_dir());
    snprintf(etcd_log, sizeof etcd_log, "%s/etcd.log", test_temp_dir());
    atexit(etcd_kill); /* registered after the temp dir: runs before its removal */
    signal(SIGINT, on_fatal_signal);
    signal(SIGTERM, on_fatal_signal);
    signal(SIGSEGV, on_fatal_signal);
    signal(SIGABRT, on_fatal_signal);

    int started = 0;
    for (int attempt = 0; attempt < 3 && !started; attempt++) { /* ports may be taken meanwhile */
        etcd_client_port = free_port();
        etcd_peer_port = free_port();
        started = etcd_client_port > 0 && etcd_peer_port > 0 &&
                  etcd_client_port != etcd_peer_port && etcd_start();
        if (!started)
            etcd_kill();
    }
    CHECK(started);
    if (!started) {
        fprintf(stderr, "test_etcd: etcd did not start, see %s\n", etcd_log);
        char cmd[700];
        snprintf(cmd, sizeof cmd, "tail -20 '%s' >&2", etcd_log);
        if (system(cmd) != 0) {
        }
        return test_summary();
    }

    struct moe_etcd *c = NULL;
    struct moe_error err = {0};
    CHECK(moe_etcd_create(etcd_ep, 2000, &c, &err) == MOE_OK);
    if (c) {
        int64_t t0 = moe_now_ms();
        test_kv(c);
        test_errors_and_failover(c);
        test_lease_revoke(c);
        test_cas(c);
        printf("kv/lease/cas tests: %" PRId64 " ms\n", moe_now_ms() - t0);
        test_latency(c);
        test_watch_and_restart(c);
        test_lease_expiry_and_keeper(c);
    }
    moe_etcd_destroy(c);
    etcd_kill();
    return test_summary();
}
