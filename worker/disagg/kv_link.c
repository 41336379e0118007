/* The KV data plane: see kv_link.h.
 *
 * Wire: every message is a head {magic, type, body length} and a body of
 * little-endian 32/64-bit words and length-prefixed strings; SLICE is
 * followed by its payload. Each request is answered by one STATUS message on
 * the same connection, which then closes (a connection per request: on
 * loopback a connect costs tens of microseconds, far below a slice). A SLICE
 * is answered twice: once its header was checked against the reservation
 * (so a refusal arrives before any payload is sent), and at the end.
 *
 * Locking: l->mu guards the table of expected handoffs. A SLICE pins its
 * handoff (writers++) while it writes, without the lock; FORGET waits for
 * the pins to drop, so once it answered no byte is written into the blocks,
 * which the leader may then give back to its pool. */
#define _GNU_SOURCE /* accept4 */
#include "disagg/kv_link.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include "comm/comm.h"
#include "hostport.h"
#include "engine/generate.h" /* moe_now */
#include "test_fault.h"
#include "tls_opts.h"

#define KV_LINK_MAGIC 0x4b454f4du /* "MOEK" */

enum kv_link_type {
    T_EXPECT = KV_LINK_MSG_EXPECT,
    T_FORGET = KV_LINK_MSG_FORGET,
    T_ORDER = KV_LINK_MSG_ORDER,
    T_SLICE = KV_LINK_MSG_SLICE,
    T_STATUS = KV_LINK_MSG_STATUS
};

struct wire_head {
    uint32_t magic, type, len;
};
_Static_assert(sizeof(struct wire_head) == KV_LINK_HEAD_BYTES, "KV link head size");

/* ---- body encoding ------------------------------------------------------------------ */

struct wbuf {
    uint8_t *p;
    size_t n, cap;
    bool oom;
};

static void put(struct wbuf *b, const void *v, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->n + n)
            cap *= 2;
        uint8_t *q = realloc(b->p, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, v, n);
    b->n += n;
}

static void put_i32(struct wbuf *b, int32_t v)
{
    put(b, &v, sizeof v);
}

static void put_u64(struct wbuf *b, uint64_t v)
{
    put(b, &v, sizeof v);
}

static void put_str(struct wbuf *b, const char *s)
{
    int32_t n = (int32_t)strlen(s);
    put_i32(b, n);
    put(b, s, (size_t)n);
}

static void put_ints(struct wbuf *b, const int32_t *v, int n)
{
    put_i32(b, n);
    put(b, v, (size_t)n * sizeof *v);
}

struct rbuf {
    const uint8_t *p;
    size_t n, at;
    bool bad;
    bool oom;
    char why[160]; /* the first failure, naming the field */
};

/* Records the first failure of r, which names the field. */
__attribute__((format(printf, 2, 3))) static void rbuf_fail(struct rbuf *r, const char *fmt, ...)
{
    if (r->bad)
        return;
    r->bad = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->why, sizeof r->why, fmt, ap);
    va_end(ap);
}

static void get(struct rbuf *r, const char *field, void *v, size_t n)
{
    if (r->bad || r->n - r->at < n) {
        rbuf_fail(r, "'%s' runs past the end of the body (%zu bytes)", field, r->n);
        memset(v, 0, n);
        return;
    }
    memcpy(v, r->p + r->at, n);
    r->at += n;
}

static int32_t get_i32(struct rbuf *r, const char *field)
{
    int32_t v;
    get(r, field, &v, sizeof v);
    return v;
}

static uint64_t get_u64(struct rbuf *r, const char *field)
{
    uint64_t v;
    get(r, field, &v, sizeof v);
    return v;
}

static void get_str(struct rbuf *r, const char *field, char *out, size_t cap)
{
    int32_t n = get_i32(r, field);
    out[0] = '\0';
    if (!r->bad && (n < 0 || (size_t)n >= cap))
        rbuf_fail(r, "'%s': length %d is not in [0, %zu]", field, (int)n, cap - 1);
    if (r->bad)
        return;
    get(r, field, out, (size_t)n);
    out[r->bad ? 0 : n] = '\0';
}

/* A malloc'd array of at most `max` ints (NULL with r->bad on error). */
static int32_t *get_ints(struct rbuf *r, const char *field, int *n, int max)
{
    *n = get_i32(r, field);
    if (!r->bad && (*n < 0 || *n > max))
        rbuf_fail(r, "'%s': %d entries, not in [0, %d]", field, *n, max);
    if (!r->bad && r->n - r->at < (size_t)*n * 4)
        rbuf_fail(r, "'%s' runs past the end of the body (%zu bytes)", field, r->n);
    int32_t *v = r->bad ? NULL : malloc((size_t)(*n ? *n : 1) * sizeof *v);
    if (!r->bad && !v) {
        rbuf_fail(r, "'%s': out of memory for %d entries", field, *n);
        r->oom = true;
    }
    if (r->bad) {
        *n = 0;
        return NULL;
    }
    get(r, field, v, (size_t)*n * sizeof *v);
    return v;
}

static const char *type_name(uint32_t type)
{
    switch (type) {
    case T_EXPECT: return "EXPECT";
    case T_FORGET: return "FORGET";
    case T_ORDER: return "ORDER";
    case T_SLICE: return "SLICE";
    case T_STATUS: return "STATUS";
    default: return "?";
    }
}

void kv_link_msg_clear(struct kv_link_msg *m)
{
    if (!m)
        return;
    free(m->blocks);
    free(m->src_blocks);
    free(m->targets);
    memset(m, 0, sizeof *m);
}

enum moe_status kv_link_head_parse(const uint8_t *head, uint32_t *type, uint32_t *body_len,
                                   struct moe_error *err)
{
    struct wire_head h;
    memcpy(&h, head, sizeof h);
    *type = 0;
    *body_len = 0;
    if (h.magic != KV_LINK_MAGIC || h.len > KV_LINK_MAX_BODY)
        return moe_error_set(err, MOE_ERR_INVALID, "not a KV link message (magic %08x, %u bytes)",
                             h.magic, h.len);
    *type = h.type;
    *body_len = h.len;
    return MOE_OK;
}

enum moe_status kv_link_msg_parse(uint32_t type, const uint8_t *body, size_t len,
                                  struct kv_link_msg *m, struct moe_error *err)
{
    memset(m, 0, sizeof *m);
    m->type = type;
    struct rbuf rb = {.p = body, .n = body ? len : 0}, *r = &rb;
    switch (type) {
    case T_EXPECT:
        get_str(r, "id", m->id, sizeof m->id);
        m->n_tokens = get_i32(r, "n_tokens");
        m->ttl_ms = get_i32(r, "ttl_ms");
        m->blocks = get_ints(r, "blocks", &m->n_blocks, KV_LINK_MAX_BLOCKS);
        break;
    case T_FORGET: get_str(r, "id", m->id, sizeof m->id); break;
    case T_ORDER:
        get_str(r, "id", m->id, sizeof m->id);
        m->n_tokens = get_i32(r, "n_tokens");
        m->deadline_ms = get_i32(r, "deadline_ms");
        m->src_blocks = get_ints(r, "src_blocks", &m->n_src_blocks, KV_LINK_MAX_BLOCKS);
        m->dst_block_size = get_i32(r, "dst_block_size");
        m->blocks = get_ints(r, "dst_blocks", &m->n_blocks, KV_LINK_MAX_BLOCKS);
        m->n_targets = get_i32(r, "n_targets");
        if (!r->bad && (m->n_targets < 1 || m->n_targets > KV_LINK_MAX_RANKS)) {
            rbuf_fail(r, "'n_targets': %d is not in [1, %d]", m->n_targets, KV_LINK_MAX_RANKS);
        } else if (!r->bad && !(m->targets = calloc((size_t)m->n_targets, sizeof *m->targets))) {
            rbuf_fail(r, "'targets': out of memory for %d entries", m->n_targets);
            r->oom = true;
        }
        for (int i = 0; i < m->n_targets && !r->bad; i++) {
            get_str(r, "targets.endpoint", m->targets[i].endpoint, sizeof m->targets[i].endpoint);
            m->targets[i].head_begin = get_i32(r, "targets.head_begin");
            m->targets[i].head_end = get_i32(r, "targets.head_end");
        }
        break;
    case T_SLICE:
        get_str(r, "id", m->id, sizeof m->id);
        m->n_layer = get_i32(r, "n_layer");
        m->d_head = get_i32(r, "d_head");
        m->kv_dtype = get_i32(r, "kv_dtype");
        m->head_begin = get_i32(r, "head_begin");
        m->head_end = get_i32(r, "head_end");
        m->n_tokens = get_i32(r, "n_tokens");
        m->dst_block_size = get_i32(r, "dst_block_size");
        m->blocks = get_ints(r, "dst_blocks", &m->n_blocks, KV_LINK_MAX_BLOCKS);
        m->transport = get_i32(r, "transport");
        m->init = get_i32(r, "init");
        get(r, "nccl_id", &m->nccl_id, sizeof m->nccl_id);
        get_str(r, "sender", m->sender, sizeof m->sender);
        break;
    case T_STATUS:
        m->status = get_i32(r, "status");
        m->value = get_u64(r, "value");
        m->flag = get_i32(r, "flag") != 0;
        get_str(r, "msg", m->msg, sizeof m->msg);
        break;
    default:
        m->type = 0;
        return moe_error_set(err, MOE_ERR_INVALID, "unknown KV link message type %u", type);
    }
    if (!r->bad)
        return MOE_OK;
    kv_link_msg_clear(m);
    return moe_error_set(err, r->oom ? MOE_ERR_NOMEM : MOE_ERR_INVALID, "malformed %s: %s",
                         type_name(type), r->why);
}

/* ---- sockets ------------------------------------------------------------------------ */

static int64_t ms_left(double deadline)
{
    double left = (deadline - moe_now()) * 1e3;
    return left < 0 ? 0 : (int64_t)left;
}

/* Waits until fd is readable (in) or writable; false on timeout/error. */
static bool wait_fd(int fd, bool in, double deadline)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = in ? POLLIN : POLLOUT};
        int64_t left = ms_left(deadline);
        int rc = poll(&p, 1, left > 0x7fffffff ? 0x7fffffff : (int)left);
        if (rc > 0)
            return true;
        if (rc == 0 || errno != EINTR)
            return false;
    }
}

/* One connection: the socket and, with TLS, its OpenSSL session. */
struct kv_sock {
    int fd;
    SSL *ssl; /* NULL: plaintext */
};

/* Waits for what OpenSSL asked for (`code`: SSL_ERROR_WANT_READ or _WRITE);
 * false on a real error or the deadline. */
static bool ssl_wait(struct kv_sock *ks, int code, double deadline)
{
    if (code != SSL_ERROR_WANT_READ && code != SSL_ERROR_WANT_WRITE)
        return false;
    return wait_fd(ks->fd, code == SSL_ERROR_WANT_READ, deadline);
}

/* Why an OpenSSL call failed, as text (the error queue cleared). */
static const char *ssl_why(int code, char *buf, size_t cap)
{
    unsigned long e = ERR_get_error();
    if (e)
        ERR_error_string_n(e, buf, cap);
    else if (code == SSL_ERROR_ZERO_RETURN)
        snprintf(buf, cap, "the peer closed the TLS session");
    else if (code == SSL_ERROR_SYSCALL)
        snprintf(buf, cap, "%s", errno ? strerror(errno) : "the peer closed the connection");
    else
        snprintf(buf, cap, "TLS error %d", code);
    ERR_clear_error();
    return buf;
}

static enum moe_status send_bytes(struct kv_sock *ks, const void *buf, size_t n, double deadline,
                                  struct moe_error *err)
{
    const uint8_t *p = buf;
    while (n > 0) {
        if (ks->ssl) {
            size_t k = 0;
            int chunk = n > (1u << 30) ? 1 << 30 : (int)n;
            ERR_clear_error();
            if (SSL_write_ex(ks->ssl, p, (size_t)chunk, &k) == 1) {
                p += k;
                n -= k;
                continue;
            }
            int code = SSL_get_error(ks->ssl, 0);
            if (ssl_wait(ks, code, deadline))
                continue;
            char why[256];
            if (code == SSL_ERROR_WANT_READ || code == SSL_ERROR_WANT_WRITE)
                return moe_error_set(err, MOE_ERR_IO, "sending timed out");
            return moe_error_set(err, MOE_ERR_IO, "TLS send: %s", ssl_why(code, why, sizeof why));
        }
        ssize_t k = send(ks->fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
        } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            if (!wait_fd(ks->fd, false, deadline))
                return moe_error_set(err, MOE_ERR_IO, "sending timed out");
        } else {
            return moe_error_set(err, MOE_ERR_IO, "send: %s", strerror(errno));
        }
    }
    return MOE_OK;
}

static enum moe_status recv_bytes(struct kv_sock *ks, void *buf, size_t n, double deadline,
                                  struct moe_error *err)
{
    uint8_t *p = buf;
    while (n > 0) {
        if (ks->ssl) {
            size_t k = 0;
            ERR_clear_error();
            if (SSL_read_ex(ks->ssl, p, n, &k) == 1) {
                p += k;
                n -= k;
                continue;
            }
            int code = SSL_get_error(ks->ssl, 0);
            if (ssl_wait(ks, code, deadline))
                continue;
            char why[256];
            if (code == SSL_ERROR_WANT_READ || code == SSL_ERROR_WANT_WRITE)
                return moe_error_set(err, MOE_ERR_IO, "receiving timed out");
            if (code == SSL_ERROR_ZERO_RETURN)
                return moe_error_set(err, MOE_ERR_IO, "the peer closed the connection");
            return moe_error_set(err, MOE_ERR_IO, "TLS receive: %s",
                                 ssl_why(code, why, sizeof why));
        }
        ssize_t k = recv(ks->fd, p, n, MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
        } else if (k == 0) {
            return moe_error_set(err, MOE_ERR_IO, "the peer closed the connection");
        } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            if (!wait_fd(ks->fd, true, deadline))
                return moe_error_set(err, MOE_ERR_IO, "receiving timed out");
        } else {
            return moe_error_set(err, MOE_ERR_IO, "recv: %s", strerror(errno));
        }
    }
    return MOE_OK;
}

/* Splits "host:port" (the last colon; [v6] brackets dropped). */
static int connect_to(const char *endpoint, double deadline, struct moe_error *err)
{
    char host[KV_LINK_ENDPOINT_MAX], port_s[16];
    int port;
    if (!moe_hostport_split(endpoint, host, sizeof host, &port) || !host[0] || port == 0) {
        moe_error_set(err, MOE_ERR_INVALID, "KV endpoint '%.120s': not host:port", endpoint);
        return -1;
    }
    snprintf(port_s, sizeof port_s, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int grc = getaddrinfo(host, port_s, &hints, &res);
    if (grc) {
        moe_error_set(err, MOE_ERR_IO, "KV endpoint %.120s: %s", endpoint, gai_strerror(grc));
        return -1;
    }
    int fd = -1;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0)
            continue;
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0)
            break;
        int so = 0;
        socklen_t sl = sizeof so;
        if (errno == EINPROGRESS && wait_fd(fd, false, deadline) &&
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &sl) == 0 && so == 0)
            break;
        if (so)
            errno = so;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) {
        moe_error_set(err, MOE_ERR_IO, "KV endpoint %.120s: cannot connect (%s)", endpoint,
                      strerror(errno ? errno : ETIMEDOUT));
        return -1;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

static enum moe_status send_msg(struct kv_sock *ks, uint32_t type, const struct wbuf *b,
                                double deadline, struct moe_error *err)
{
    if (b->oom)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory for a KV link message");
    struct wire_head h = {KV_LINK_MAGIC, type, (uint32_t)b->n};
    enum moe_status rc = send_bytes(ks, &h, sizeof h, deadline, err);
    return rc ? rc : send_bytes(ks, b->p, b->n, deadline, err);
}

/* Reads one message; *body is malloc'd (the caller frees it). */
static enum moe_status recv_msg(struct kv_sock *ks, uint32_t *type, uint8_t **body, size_t *len,
                                double deadline, struct moe_error *err)
{
    uint8_t head[KV_LINK_HEAD_BYTES];
    uint32_t t, n;
    *body = NULL;
    *type = 0;
    *len = 0;
    enum moe_status rc = recv_bytes(ks, head, sizeof head, deadline, err);
    if (rc || (rc = kv_link_head_parse(head, &t, &n, err)))
        return rc;
    if (!(*body = malloc(n ? n : 1)))
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    if ((rc = recv_bytes(ks, *body, n, deadline, err))) {
        free(*body);
        *body = NULL;
        return rc;
    }
    *type = t;
    *len = n;
    return MOE_OK;
}

/* STATUS: {status, value, flag, message}. */
static void send_status(struct kv_sock *ks, enum moe_status st, uint64_t value, bool flag,
                        const char *msg, double deadline)
{
    struct wbuf b = {0};
    put_i32(&b, (int32_t)st);
    put_u64(&b, value);
    put_i32(&b, flag);
    put_str(&b, msg ? msg : "");
    struct moe_error ignored = {0};
    send_msg(ks, T_STATUS, &b, deadline, &ignored);
    free(b.p);
}

static enum moe_status recv_status(struct kv_sock *ks, const char *endpoint, double deadline,
                                   uint64_t *value, bool *flag, struct moe_error *err)
{
    uint32_t type = 0;
    uint8_t *body;
    size_t len = 0;
    enum moe_status rc = recv_msg(ks, &type, &body, &len, deadline, err);
    if (rc)
        return moe_error_prefix(err, "KV endpoint %.120s", endpoint);
    struct kv_link_msg *m = malloc(sizeof *m);
    rc = !m                 ? moe_error_set(err, MOE_ERR_NOMEM, "out of memory")
         : type != T_STATUS ? moe_error_set(err, MOE_ERR_INVALID, "a %s message instead of STATUS",
                                            type_name(type))
                            : kv_link_msg_parse(type, body, len, m, err);
    free(body);
    if (rc) {
        free(m);
        moe_error_prefix(err, "KV endpoint %.120s: malformed answer", endpoint);
        return rc;
    }
    if (value)
        *value = m->value;
    if (flag)
        *flag = m->flag;
    if (m->status != MOE_OK)
        rc = moe_error_set(err, (enum moe_status)m->status, "KV endpoint %.120s: %s", endpoint,
                           m->msg);
    kv_link_msg_clear(m);
    free(m);
    return rc;
}

static void sock_close(struct kv_sock *ks)
{
    SSL_free(ks->ssl);
    ks->ssl = NULL;
    if (ks->fd >= 0)
        close(ks->fd);
    ks->fd = -1;
}

/* Runs the TLS handshake of ks->ssl (set up for one side) to its end. */
static enum moe_status sock_handshake(struct kv_sock *ks, bool server, const char *peer,
                                      double deadline, struct moe_error *err)
{
    for (;;) {
        ERR_clear_error();
        int r = server ? SSL_accept(ks->ssl) : SSL_connect(ks->ssl);
        if (r == 1)
            return MOE_OK;
        int code = SSL_get_error(ks->ssl, r);
        if (ssl_wait(ks, code, deadline))
            continue;
        char why[256];
        if (code == SSL_ERROR_WANT_READ || code == SSL_ERROR_WANT_WRITE)
            return moe_error_set(err, MOE_ERR_IO, "KV endpoint %.120s: TLS handshake timed out",
                                 peer);
        long v = SSL_get_verify_result(ks->ssl);
        if (v != X509_V_OK)
            snprintf(why, sizeof why, "certificate verify failed: %s",
                     X509_verify_cert_error_string(v));
        else
            ssl_why(code, why, sizeof why);
        ERR_clear_error();
        return moe_error_set(err, MOE_ERR_IO, "KV endpoint %.120s: TLS handshake: %s", peer, why);
    }
}

/* Connects to `endpoint`; with `tls`, over TLS: the peer's certificate must
 * chain to the CA and name the endpoint's host (or the server name). */
static enum moe_status sock_connect(struct moe_tls *tls, const char *endpoint, double deadline,
                                    struct kv_sock *ks, struct moe_error *err)
{
    ks->ssl = NULL;
    ks->fd = connect_to(endpoint, deadline, err);
    if (ks->fd < 0)
        return err->code ? err->code : MOE_ERR_IO;
    if (!tls)
        return MOE_OK;
    SSL_CTX *ctx = moe_tls_ssl_ctx(tls, false, err);
    if (!ctx || !(ks->ssl = SSL_new(ctx))) {
        if (ctx)
            moe_error_set(err, MOE_ERR_NOMEM, "KV endpoint %.120s: SSL_new failed", endpoint);
        sock_close(ks);
        return err->code;
    }
    char host[KV_LINK_ENDPOINT_MAX];
    int port;
    const char *name = moe_tls_server_name(tls);
    if (!name && moe_hostport_split(endpoint, host, sizeof host, &port) && host[0])
        name = host;
    unsigned char ip[16];
    X509_VERIFY_PARAM *vp = SSL_get0_param(ks->ssl);
    if (name && (inet_pton(AF_INET, name, ip) == 1 || inet_pton(AF_INET6, name, ip) == 1)) {
        X509_VERIFY_PARAM_set1_ip_asc(vp, name);
    } else if (name) {
        SSL_set_tlsext_host_name(ks->ssl, name);
        SSL_set1_host(ks->ssl, name);
    }
    SSL_set_fd(ks->ssl, ks->fd);
    enum moe_status rc = sock_handshake(ks, false, endpoint, deadline, err);
    if (rc)
        sock_close(ks);
    return rc;
}

/* One request, one STATUS answer. */
static enum moe_status call(struct moe_tls *tls, const char *endpoint, uint32_t type,
                            const struct wbuf *b, int timeout_ms, uint64_t *value, bool *flag,
                            struct moe_error *err)
{
    double deadline = moe_now() + timeout_ms / 1e3;
    struct kv_sock ks;
    enum moe_status rc = sock_connect(tls, endpoint, deadline, &ks, err);
    if (rc)
        return rc;
    rc = send_msg(&ks, type, b, deadline, err);
    if (rc)
        moe_error_prefix(err, "KV endpoint %.120s", endpoint);
    else
        rc = recv_status(&ks, endpoint, deadline, value, flag, err);
    sock_close(&ks);
    return rc;
}

/* ---- the link ----------------------------------------------------------------------- */

struct expected {
    char id[KV_LINK_ID_MAX];
    int32_t *blocks;
    int n_blocks, n_tokens;
    double deadline;
    int writers;    /* SLICEs writing now */
    uint64_t bytes; /* payload bytes written */
    uint64_t elems; /* K and V elements written, to tell completeness */
    struct expected *next;
};

/* A two-rank NCCL communicator with one peer (the device path): rank 0 is
 * the sending side. Its mutex makes the slices of the pair go one at a time,
 * in the same order on both sides, as NCCL's point-to-point matching needs. */
struct pair {
    char peer[KV_LINK_ENDPOINT_MAX];
    bool sending;
    struct moe_comm *comm; /* NULL until the first slice, or after a failure */
    bool broken;           /* NCCL could not connect: this pair uses the socket */
    pthread_mutex_t mu;
    struct pair *next;
};

#define KV_LINK_STAGES 4

struct kv_link {
    struct kv_link_opts o;
    bool nccl;          /* payloads device to device when the peer agrees */
    struct pair *pairs; /* under mu */
    char endpoint[KV_LINK_ENDPOINT_MAX];
    int head_begin, head_end;
    int listen_fd;
    pthread_t acceptor;
    bool acceptor_live;
    int fault_delay_ms;
    bool fault_die;

    pthread_mutex_t mu;
    pthread_cond_t cond; /* writers or n_conns dropped */
    struct moe_kv_cache *kv;
    struct expected *table;
    int n_conns;
    bool stopping;
    /* device staging buffers for NCCL payloads, kept between slices: on a
     * GPU an allocation per slice would cudaFree, which waits for the whole
     * device (under mu) */
    struct {
        void *p;
        size_t cap;
    } stages[KV_LINK_STAGES];
    int n_stages;
};

/* A staging buffer of at least `bytes` in backend memory: a kept one, or a
 * new one (NULL when that fails). Give it back with stage_put. */
static void *stage_get(struct kv_link *l, size_t bytes, size_t *cap)
{
    pthread_mutex_lock(&l->mu);
    int best = -1;
    for (int i = 0; i < l->n_stages; i++)
        if (l->stages[i].cap >= bytes && (best < 0 || l->stages[i].cap < l->stages[best].cap))
            best = i;
    if (best >= 0) {
        void *p = l->stages[best].p;
        *cap = l->stages[best].cap;
        l->stages[best] = l->stages[--l->n_stages];
        pthread_mutex_unlock(&l->mu);
        return p;
    }
    pthread_mutex_unlock(&l->mu);
    *cap = bytes ? bytes : 1;
    return l->o.be->ops->buf_alloc(l->o.be, *cap);
}

/* Keeps `p` for the next slices (the largest KV_LINK_STAGES of them); the
 * caller has synchronised the backend's stream. */
static void stage_put(struct kv_link *l, void *p, size_t cap)
{
    if (!p)
        return;
    pthread_mutex_lock(&l->mu);
    if (l->n_stages < KV_LINK_STAGES) {
        l->stages[l->n_stages].p = p;
        l->stages[l->n_stages++].cap = cap;
        p = NULL;
    } else {
        int small = 0;
        for (int i = 1; i < l->n_stages; i++)
            if (l->stages[i].cap < l->stages[small].cap)
                small = i;
        if (l->stages[small].cap < cap) {
            void *q = l->stages[small].p;
            l->stages[small].p = p;
            l->stages[small].cap = cap;
            p = q;
        }
    }
    pthread_mutex_unlock(&l->mu);
    if (p)
        l->o.be->ops->buf_free(l->o.be, p);
}

void kv_link_heads(int n_kv_head, int tp_size, int tp_rank, int *begin, int *end)
{
    int per = n_kv_head / (tp_size > 0 ? tp_size : 1);
    *begin = tp_rank * per;
    *end = *begin + per;
}

void kv_link_layout_heads(const struct kv_link_layout *lay, int *begin, int *end)
{
    if (lay->latent) {
        *begin = 0;
        *end = lay->n_kv_head;
        return;
    }
    kv_link_heads(lay->n_kv_head, lay->tp_size, lay->tp_rank, begin, end);
}

/* Planes a slice carries per layer: K and V, or the one latent row. */
static int kv_planes(const struct kv_link *l)
{
    return l->o.layout.latent ? 1 : 2;
}

const char *kv_link_endpoint(const struct kv_link *l)
{
    return l->endpoint;
}

void kv_link_attach_kv(struct kv_link *l, struct moe_kv_cache *kv)
{
    pthread_mutex_lock(&l->mu);
    l->kv = kv;
    pthread_mutex_unlock(&l->mu);
}

static struct expected *find_locked(struct kv_link *l, const char *id)
{
    double now = moe_now();
    for (struct expected **p = &l->table; *p;) {
        struct expected *e = *p;
        if (e->deadline < now && e->writers == 0) { /* a leader that never said FORGET */
            *p = e->next;
            free(e->blocks);
            free(e);
            continue;
        }
        if (!strcmp(e->id, id))
            return e;
        p = &e->next;
    }
    return NULL;
}

/* Checks that `n_tokens` KV positions in `blocks` lie inside cache `kv`: the
 * ids come from the wire, and copy_rows trusts them. */
static enum moe_status check_blocks(const struct moe_kv_cache *kv, const char *what, const char *id,
                                    const int32_t *blocks, int n_blocks, int n_tokens,
                                    struct moe_error *err)
{
    if (n_blocks > kv->n_block || n_tokens < 1 || n_tokens > n_blocks * kv->block_size)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "handoff %.100s: %s: %d tokens in %d blocks of %d (the cache has %d "
                             "blocks)",
                             id, what, n_tokens, n_blocks, kv->block_size, kv->n_block);
    for (int i = 0; i < n_blocks; i++)
        if (blocks[i] < 0 || blocks[i] >= kv->n_block)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "handoff %.100s: %s[%d] = %d is not a block in [0, %d)", id, what,
                                 i, (int)blocks[i], kv->n_block);
    return MOE_OK;
}

static enum moe_status expect_local(struct kv_link *l, const char *id, const int32_t *blocks,
                                    int n_blocks, int n_tokens, int ttl_ms, struct moe_error *err)
{
    struct expected *e = calloc(1, sizeof *e);
    if (!e || !(e->blocks = malloc((size_t)(n_blocks ? n_blocks : 1) * sizeof *e->blocks))) {
        free(e);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    snprintf(e->id, sizeof e->id, "%s", id);
    memcpy(e->blocks, blocks, (size_t)n_blocks * sizeof *blocks);
    e->n_blocks = n_blocks;
    e->n_tokens = n_tokens;
    e->deadline = moe_now() + ttl_ms / 1e3;
    pthread_mutex_lock(&l->mu);
    enum moe_status rc = l->kv ? check_blocks(l->kv, "blocks", id, blocks, n_blocks, n_tokens, err)
                               : moe_error_set(err, MOE_ERR_IO, "this rank has no KV cache yet");
    if (!rc && find_locked(l, id))
        rc = moe_error_set(err, MOE_ERR_INVALID, "handoff %.100s is already expected here", id);
    if (!rc) {
        e->next = l->table;
        l->table = e;
        e = NULL;
    }
    pthread_mutex_unlock(&l->mu);
    if (e) {
        free(e->blocks);
        free(e);
    }
    return rc;
}

static void forget_local(struct kv_link *l, const char *id, uint64_t *bytes, bool *complete)
{
    *bytes = 0;
    *complete = false;
    pthread_mutex_lock(&l->mu);
    struct expected *e = find_locked(l, id);
    while (e && e->writers > 0) {
        pthread_cond_wait(&l->cond, &l->mu);
        e = find_locked(l, id);
    }
    if (e) {
        for (struct expected **p = &l->table; *p; p = &(*p)->next)
            if (*p == e) {
                *p = e->next;
                break;
            }
        *bytes = e->bytes;
        uint64_t want = (uint64_t)l->o.layout.n_layer * (uint64_t)kv_planes(l) *
                        (uint64_t)e->n_tokens * (uint64_t)(l->head_end - l->head_begin) *
                        (uint64_t)l->o.layout.d_head;
        *complete = e->elems == want;
        free(e->blocks);
        free(e);
    }
    pthread_mutex_unlock(&l->mu);
}

enum moe_status kv_link_expect(struct kv_link *l, const char *endpoint, const char *id,
                               const int32_t *blocks, int n_blocks, int n_tokens, int ttl_ms,
                               struct moe_error *err)
{
    if (!endpoint)
        return expect_local(l, id, blocks, n_blocks, n_tokens, ttl_ms, err);
    struct wbuf b = {0};
    put_str(&b, id);
    put_i32(&b, n_tokens);
    put_i32(&b, ttl_ms);
    put_ints(&b, blocks, n_blocks);
    enum moe_status rc =
        call(l->o.tls, endpoint, T_EXPECT, &b, l->o.io_timeout_ms, NULL, NULL, err);
    free(b.p);
    return rc;
}

enum moe_status kv_link_forget(struct kv_link *l, const char *endpoint, const char *id,
                               uint64_t *bytes, bool *complete, struct moe_error *err)
{
    if (!endpoint) {
        forget_local(l, id, bytes, complete);
        return MOE_OK;
    }
    struct wbuf b = {0};
    put_str(&b, id);
    *bytes = 0;
    *complete = false;
    enum moe_status rc =
        call(l->o.tls, endpoint, T_FORGET, &b, l->o.io_timeout_ms, bytes, complete, err);
    free(b.p);
    return rc;
}

/* ---- slices ------------------------------------------------------------------------- */

enum copy_dir { TO_HOST, FROM_HOST, TO_STAGE, FROM_STAGE };

/* Copies rows [0, n) of heads [hb, he) of cache array `base` (one layer's K
 * or V) between the cache and the token-major buffer `buf` (n x (he - hb) x
 * d_head): host memory, or a staging buffer in backend memory. Runs of whole
 * rows inside a block move in one copy; a part of a row moves row by row. */
static void copy_rows(struct kv_link *l, struct moe_kv_cache *kv, void *base, const int32_t *blocks,
                      int n, int hb, int he, void *buf, enum copy_dir dir)
{
    const size_t esz = moe_dtype_size(kv->dtype);
    moe_kv_cache_fence(kv); /* the forward passes' writes (a push reads them) */
    struct moe_backend *be = l->o.be;
    int dh = l->o.layout.d_head, bs = kv->block_size;
    size_t row = (size_t)(he - hb) * dh;
    bool whole = he - hb == l->head_end - l->head_begin;
    size_t off = (size_t)(hb - l->head_begin) * dh;
    for (int t = 0; t < n;) {
        int run = whole ? bs - t % bs : 1;
        if (run > n - t)
            run = n - t;
        char *slot = (char *)base +
                     (((size_t)blocks[t / bs] * bs + (size_t)(t % bs)) * kv->kv_dim + off) * esz;
        char *b = (char *)buf + (size_t)t * row * esz;
        size_t bytes = (size_t)run * row * esz;
        switch (dir) {
        case TO_HOST: be->ops->buf_download(be, b, slot, bytes); break;
        case FROM_HOST: be->ops->buf_upload(be, slot, b, bytes); break;
        case TO_STAGE: be->ops->buf_copy(be, b, slot, bytes); break;
        case FROM_STAGE: be->ops->buf_copy(be, slot, b, bytes); break;
        }
        t += run;
    }
    moe_kv_cache_fence(kv); /* this copy's writes, for the next step */
}

/* The pair with `peer` on this side (made on first use). */
static struct pair *pair_get(struct kv_link *l, const char *peer, bool sending)
{
    pthread_mutex_lock(&l->mu);
    struct pair *p = l->pairs;
    while (p && (p->sending != sending || strcmp(p->peer, peer)))
        p = p->next;
    if (!p && (p = calloc(1, sizeof *p))) {
        snprintf(p->peer, sizeof p->peer, "%s", peer);
        p->sending = sending;
        pthread_mutex_init(&p->mu, NULL);
        p->next = l->pairs;
        l->pairs = p;
    }
    pthread_mutex_unlock(&l->mu);
    return p;
}

/* Moves one layer's K or V payload (`bytes`) of a slice: over the socket
 * through the host buffer `host`, or over the pair's NCCL communicator
 * through the staging buffer `stage`. */
static enum moe_status move_payload(struct kv_link *l, struct kv_sock *ks, struct pair *pr,
                                    bool sending, void *host, void *stage, size_t bytes,
                                    double deadline, struct moe_error *err)
{
    if (!pr)
        return sending ? send_bytes(ks, host, bytes, deadline, err)
                       : recv_bytes(ks, host, bytes, deadline, err);
    l->o.be->ops->synchronize(l->o.be); /* the staging copies are on the backend's stream */
    return sending ? moe_comm_send(pr->comm, stage, bytes, 1, err)
                   : moe_comm_recv(pr->comm, stage, bytes, 0, err);
}

/* Both sides of a pair's first slice: the communicator, from the id the
 * sender made. */
static enum moe_status pair_connect(struct kv_link *l, struct pair *pr,
                                    const struct moe_comm_nccl_id *id, struct moe_error *err)
{
    moe_comm_destroy(pr->comm);
    pr->comm = NULL;
    enum moe_status rc = moe_comm_create_nccl(id, 2, pr->sending ? 0 : 1, l->o.device, NULL,
                                              l->o.io_timeout_ms, &pr->comm, err);
    return rc ? moe_error_prefix(err, "NCCL communicator with %.120s", pr->peer) : MOE_OK;
}

/* The device path's handshake, once both sides know whether they try it:
 * after connecting (first slice of a pair), each side tells whether its
 * communicator is up and NCCL carries the payload only if both are. A pair
 * that could not connect (e.g. both ranks on one GPU) falls back to the
 * socket for good. Returns whether NCCL carries this slice. */
static bool pair_agree(struct kv_link *l, struct kv_sock *ks, struct pair *pr, bool init,
                       const struct moe_comm_nccl_id *id, double deadline)
{
    bool up = true;
    struct moe_error err = {0};
    if (init && pair_connect(l, pr, id, &err)) {
        fprintf(stderr, "moe-worker: KV link: %s; using the socket with %s\n", err.msg, pr->peer);
        up = false;
    }
    /* receiver speaks first, then the sender answers the verdict */
    bool theirs = false, ok = true;
    struct moe_error ignored = {0};
    if (pr->sending) {
        ok = recv_status(ks, pr->peer, deadline, NULL, &theirs, &ignored) == MOE_OK;
        send_status(ks, MOE_OK, 0, up && theirs && ok, "", deadline);
    } else {
        send_status(ks, MOE_OK, 0, up, "", deadline);
        ok = recv_status(ks, pr->peer, deadline, NULL, &theirs, &ignored) == MOE_OK;
    }
    bool use = up && theirs && ok;
    if (!use) {
        moe_comm_destroy(pr->comm);
        pr->comm = NULL;
        pr->broken = true;
    }
    return use;
}

static void unpin(struct kv_link *l, struct expected *e, uint64_t bytes, size_t esz)
{
    pthread_mutex_lock(&l->mu);
    e->writers--;
    e->bytes += bytes;
    e->elems += bytes / esz;
    pthread_cond_broadcast(&l->cond);
    pthread_mutex_unlock(&l->mu);
}

/* The receiving side of one SLICE whose header is `m` (decoded by kv_link_msg_parse). */
static void serve_slice(struct kv_link *l, struct kv_sock *ks, const struct kv_link_msg *m)
{
    double deadline = moe_now() + l->o.io_timeout_ms / 1e3; /* for refusals */
    char msg[512] = "";
    const char *id = m->id, *sender = m->sender;
    int n_layer = m->n_layer, d_head = m->d_head, hb = m->head_begin, he = m->head_end;
    int n_tokens = m->n_tokens, dst_bs = m->dst_block_size, n_dst = m->n_blocks;
    const int32_t *dst = m->blocks;
    int transport = m->transport, init = m->init;
    const struct moe_comm_nccl_id *nid = &m->nccl_id;
    enum moe_status st = MOE_ERR_INVALID;
    struct expected *e = NULL;
    struct moe_kv_cache *kv = NULL;
    pthread_mutex_lock(&l->mu);
    if (!l->kv || l->stopping) {
        st = MOE_ERR_IO;
        snprintf(msg, sizeof msg, "this rank has no KV cache yet or is stopping");
    } else if (!(e = find_locked(l, id))) {
        st = MOE_ERR_NOT_FOUND;
        snprintf(msg, sizeof msg, "handoff %.100s is not expected here (released or expired)", id);
    } else if (n_layer != l->o.layout.n_layer || d_head != l->o.layout.d_head) {
        snprintf(msg, sizeof msg, "KV layout: %d layers x head dim %d sent, %d x %d here", n_layer,
                 d_head, l->o.layout.n_layer, l->o.layout.d_head);
    } else if (m->kv_dtype != (int)l->kv->dtype) {
        snprintf(msg, sizeof msg,
                 "KV dtype: %s sent, %s here (give both pools the same --kv-dtype)",
                 moe_kv_dtype_valid((enum moe_dtype)m->kv_dtype)
                     ? moe_dtype_name((enum moe_dtype)m->kv_dtype)
                     : "unknown",
                 moe_dtype_name(l->kv->dtype));
    } else if (hb < l->head_begin || he > l->head_end || hb >= he) {
        snprintf(msg, sizeof msg, "heads [%d, %d) sent, this rank holds [%d, %d)", hb, he,
                 l->head_begin, l->head_end);
    } else if (dst_bs != l->kv->block_size || n_tokens != e->n_tokens || n_dst != e->n_blocks ||
               memcmp(dst, e->blocks, (size_t)n_dst * sizeof *dst)) {
        snprintf(msg, sizeof msg,
                 "blocks: %d blocks of %d tokens for %d tokens sent; %d blocks of %d for %d "
                 "tokens were reserved",
                 n_dst, dst_bs, n_tokens, e->n_blocks, l->kv->block_size, e->n_tokens);
    } else {
        st = MOE_OK;
        e->writers++;
        kv = l->kv;
    }
    pthread_mutex_unlock(&l->mu);
    struct pair *pr = st == MOE_OK && transport == 1 && l->nccl ? pair_get(l, sender, false) : NULL;
    if (pr) {
        pthread_mutex_lock(&pr->mu);
        if (pr->broken || (!init && !pr->comm)) { /* the sender re-initialises next time */
            pthread_mutex_unlock(&pr->mu);
            pr = NULL;
        }
    }
    send_status(ks, st, 0, pr != NULL, msg, deadline); /* go ahead (and how), or why not */
    if (st != MOE_OK)
        return;
    struct moe_error err = {0};
    if (pr && !pair_agree(l, ks, pr, init, nid, deadline)) {
        pthread_mutex_unlock(&pr->mu);
        pr = NULL;
    }
    const size_t esz = moe_dtype_size(kv->dtype);
    size_t per = (size_t)n_tokens * (size_t)(he - hb) * (size_t)d_head * esz; /* bytes */
    void *host = pr ? NULL : malloc(per ? per : 1);
    size_t stage_cap = 0;
    void *stage = pr ? stage_get(l, per, &stage_cap) : NULL;
    uint64_t bytes = 0;
    if (!host && !stage)
        st = moe_error_set(&err, MOE_ERR_NOMEM, "out of memory for a slice");
    for (int layer = 0; layer < n_layer && !st; layer++)
        for (int kind = 0; kind < kv_planes(l) && !st; kind++) {
            /* a sender that stops making progress fails the slice */
            double step = moe_now() + l->o.io_timeout_ms / 1e3;
            if ((st = move_payload(l, ks, pr, false, host, stage, per, step, &err)))
                break;
            void *base = kind ? kv->v[layer] : kv->k[layer];
            copy_rows(l, kv, base, dst, n_tokens, hb, he, pr ? stage : host,
                      pr ? FROM_STAGE : FROM_HOST);
            bytes += per;
        }
    l->o.be->ops->synchronize(l->o.be);
    stage_put(l, stage, stage_cap);
    if (pr) {
        if (st) { /* a failed NCCL exchange leaves the communicator unusable */
            moe_comm_destroy(pr->comm);
            pr->comm = NULL;
        }
        pthread_mutex_unlock(&pr->mu);
    }
    free(host);
    unpin(l, e, st ? 0 : bytes, esz);
    send_status(ks, st, bytes, false, st ? err.msg : "", moe_now() + l->o.io_timeout_ms / 1e3);
}

/* Sends heads [hb, he) of `p` to one target. */
static enum moe_status push_one(struct kv_link *l, struct moe_kv_cache *kv,
                                const struct kv_link_push *p, const struct kv_link_target *t,
                                int hb, int he, double deadline, uint64_t *bytes,
                                struct moe_error *err)
{
    struct pair *pr = l->nccl ? pair_get(l, t->endpoint, true) : NULL;
    if (pr) {
        pthread_mutex_lock(&pr->mu); /* held to the end: slices of a pair go in order */
        if (pr->broken) {
            pthread_mutex_unlock(&pr->mu);
            pr = NULL;
        }
    }
    bool init = pr && !pr->comm;
    struct moe_comm_nccl_id nid = {{0}};
    if (init && moe_comm_nccl_get_id(&nid, err)) {
        pr->broken = true;
        pthread_mutex_unlock(&pr->mu);
        pr = NULL;
        init = false;
    }
    struct kv_sock sock, *ks = &sock;
    if (sock_connect(l->o.tls, t->endpoint, deadline, ks, err)) {
        if (pr)
            pthread_mutex_unlock(&pr->mu);
        return MOE_ERR_IO;
    }
    int dh = l->o.layout.d_head;
    struct wbuf b = {0};
    put_str(&b, p->id);
    put_i32(&b, l->o.layout.n_layer);
    put_i32(&b, dh);
    put_i32(&b, (int32_t)kv->dtype);
    put_i32(&b, hb);
    put_i32(&b, he);
    put_i32(&b, p->n_tokens);
    put_i32(&b, p->dst_block_size);
    put_ints(&b, p->dst_blocks, p->n_dst_blocks);
    put_i32(&b, pr ? 1 : 0);
    put_i32(&b, init);
    put(&b, &nid, sizeof nid);
    put_str(&b, l->endpoint);
    enum moe_status rc = send_msg(ks, T_SLICE, &b, deadline, err);
    free(b.p);
    bool nccl = false;
    if (!rc) /* the receiver checks the header against its reservation first */
        rc = recv_status(ks, t->endpoint, deadline, NULL, &nccl, err);
    if (pr && !rc && !nccl) {
        if (init) { /* the peer has no device path: the socket for good */
            pr->broken = true;
        } else { /* the peer lost its side (restarted?): connect again next time */
            moe_comm_destroy(pr->comm);
            pr->comm = NULL;
        }
    }
    if (pr && !rc && nccl && !pair_agree(l, ks, pr, init, &nid, deadline))
        nccl = false;
    if (pr && !nccl) {
        pthread_mutex_unlock(&pr->mu);
        pr = NULL;
    }
    size_t per = (size_t)p->n_tokens * (size_t)(he - hb) * (size_t)dh * moe_dtype_size(kv->dtype);
    void *host = NULL, *stage = NULL;
    size_t stage_cap = 0;
    if (!rc) {
        if (pr)
            stage = stage_get(l, per, &stage_cap);
        else
            host = malloc(per ? per : 1);
        if (!host && !stage)
            rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory for a slice");
    }
    for (int layer = 0; layer < l->o.layout.n_layer && !rc; layer++) {
        if (l->fault_delay_ms)
            usleep((useconds_t)l->fault_delay_ms * 1000);
        for (int kind = 0; kind < kv_planes(l) && !rc; kind++) {
            void *base = kind ? kv->v[layer] : kv->k[layer];
            copy_rows(l, kv, base, p->src_blocks, p->n_tokens, hb, he, pr ? stage : host,
                      pr ? TO_STAGE : TO_HOST);
            rc = move_payload(l, ks, pr, true, host, stage, per, deadline, err);
        }
        if (!rc && l->fault_die) {
            fprintf(stderr,
                    "moe-worker: MOE_FAULT_DIE_DURING_TRANSFER: exiting after layer %d "
                    "of handoff %s\n",
                    layer, p->id);
            _exit(3);
        }
    }
    free(host);
    if (stage) {
        l->o.be->ops->synchronize(l->o.be); /* the last copies out of it are done */
        stage_put(l, stage, stage_cap);
    }
    uint64_t got = 0;
    if (!rc)
        rc = recv_status(ks, t->endpoint, deadline, &got, NULL, err);
    else if (!strstr(err->msg, "KV endpoint"))
        moe_error_prefix(err, "KV endpoint %.120s", t->endpoint);
    if (pr) {
        if (rc) {
            moe_comm_destroy(pr->comm);
            pr->comm = NULL;
        }
        pthread_mutex_unlock(&pr->mu);
    }
    sock_close(ks);
    if (!rc)
        *bytes += got;
    return rc;
}

enum moe_status kv_link_push(struct kv_link *l, const struct kv_link_push *p, uint64_t *bytes,
                             struct moe_error *err)
{
    *bytes = 0;
    double deadline = moe_now() + p->deadline_ms / 1e3;
    pthread_mutex_lock(&l->mu);
    struct moe_kv_cache *kv = l->kv;
    pthread_mutex_unlock(&l->mu);
    if (!kv)
        return moe_error_set(err, MOE_ERR_IO, "this rank has no KV cache yet");
    if (p->n_tokens < 1 || p->n_tokens > (int64_t)p->n_src_blocks * kv->block_size ||
        p->dst_block_size < 1 || p->n_tokens > (int64_t)p->n_dst_blocks * p->dst_block_size)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "handoff %.100s: %d tokens do not fit %d blocks here / %d blocks "
                             "of %d there",
                             p->id, p->n_tokens, p->n_src_blocks, p->n_dst_blocks,
                             p->dst_block_size);
    enum moe_status st =
        check_blocks(kv, "src_blocks", p->id, p->src_blocks, p->n_src_blocks, p->n_tokens, err);
    if (st)
        return st;
    for (int i = 0; i < p->n_targets; i++) {
        const struct kv_link_target *t = &p->targets[i];
        if (l->o.layout.latent && i % l->o.layout.tp_size != l->o.layout.tp_rank)
            continue; /* another TP rank sends this target its (identical) rows */
        int hb = t->head_begin > l->head_begin ? t->head_begin : l->head_begin;
        int he = t->head_end < l->head_end ? t->head_end : l->head_end;
        if (hb >= he)
            continue;
        enum moe_status rc = push_one(l, kv, p, t, hb, he, deadline, bytes, err);
        if (rc)
            return moe_error_prefix(err, "handoff %.100s, heads [%d, %d)", p->id, hb, he);
    }
    return MOE_OK;
}

/* ---- orders ------------------------------------------------------------------------- */

static void put_push(struct wbuf *b, const struct kv_link_push *p)
{
    put_str(b, p->id);
    put_i32(b, p->n_tokens);
    put_i32(b, p->deadline_ms);
    put_ints(b, p->src_blocks, p->n_src_blocks);
    put_i32(b, p->dst_block_size);
    put_ints(b, p->dst_blocks, p->n_dst_blocks);
    put_i32(b, p->n_targets);
    for (int i = 0; i < p->n_targets; i++) {
        put_str(b, p->targets[i].endpoint);
        put_i32(b, p->targets[i].head_begin);
        put_i32(b, p->targets[i].head_end);
    }
}

struct kv_link_order {
    struct kv_link *l;
    char endpoint[KV_LINK_ENDPOINT_MAX];
    struct wbuf msg;
    int timeout_ms;
    pthread_t th;
    enum moe_status rc;
    struct moe_error err;
    uint64_t bytes;
};

static void *order_main(void *arg)
{
    struct kv_link_order *o = arg;
    o->rc =
        call(o->l->o.tls, o->endpoint, T_ORDER, &o->msg, o->timeout_ms, &o->bytes, NULL, &o->err);
    return NULL;
}

enum moe_status kv_link_order_start(struct kv_link *l, const char *endpoint,
                                    const struct kv_link_push *p, struct kv_link_order **out,
                                    struct moe_error *err)
{
    *out = NULL;
    struct kv_link_order *o = calloc(1, sizeof *o);
    if (!o)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    o->l = l;
    snprintf(o->endpoint, sizeof o->endpoint, "%s", endpoint);
    put_push(&o->msg, p);
    /* the ordered rank's own deadline fires first; this one only catches a
     * rank that stopped answering */
    o->timeout_ms = p->deadline_ms + l->o.io_timeout_ms;
    if (o->msg.oom || pthread_create(&o->th, NULL, order_main, o)) {
        free(o->msg.p);
        free(o);
        return moe_error_set(err, MOE_ERR_NOMEM, "cannot start a KV order to %.120s", endpoint);
    }
    *out = o;
    return MOE_OK;
}

enum moe_status kv_link_order_wait(struct kv_link_order *o, uint64_t *bytes, struct moe_error *err)
{
    pthread_join(o->th, NULL);
    enum moe_status rc = o->rc;
    *bytes = o->bytes;
    if (rc)
        *err = o->err;
    free(o->msg.p);
    free(o);
    return rc;
}

static void serve_order(struct kv_link *l, struct kv_sock *ks, const struct kv_link_msg *m,
                        double io_deadline)
{
    struct kv_link_push p = {.id = m->id,
                             .src_blocks = m->src_blocks,
                             .n_src_blocks = m->n_src_blocks,
                             .n_tokens = m->n_tokens,
                             .dst_blocks = m->blocks,
                             .n_dst_blocks = m->n_blocks,
                             .dst_block_size = m->dst_block_size,
                             .targets = m->targets,
                             .n_targets = m->n_targets,
                             .deadline_ms = m->deadline_ms};
    struct moe_error err = {0};
    uint64_t bytes = 0;
    enum moe_status st;
    if (p.deadline_ms < 1)
        st = moe_error_set(&err, MOE_ERR_INVALID, "malformed ORDER: 'deadline_ms' %d is not >= 1",
                           p.deadline_ms);
    else
        st = kv_link_push(l, &p, &bytes, &err);
    double deadline = moe_now() + l->o.io_timeout_ms / 1e3;
    send_status(ks, st, bytes, false, st ? err.msg : "",
                deadline > io_deadline ? deadline : io_deadline);
}

/* ---- server ------------------------------------------------------------------------- */

struct conn {
    struct kv_link *l;
    struct kv_sock ks;
};

static void *conn_main(void *arg)
{
    struct conn *c = arg;
    struct kv_link *l = c->l;
    double deadline = moe_now() + l->o.io_timeout_ms / 1e3;
    uint32_t type = 0;
    uint8_t *body = NULL;
    size_t len = 0;
    struct moe_error err = {0};
    struct kv_link_msg *m = NULL;
    struct kv_sock *ks = &c->ks;
    bool up = true;
    if (l->o.tls) { /* the handshake: with a CA, the peer must show a certificate from it */
        SSL_CTX *ctx = moe_tls_ssl_ctx(l->o.tls, true, &err);
        up = ctx && (ks->ssl = SSL_new(ctx)) && SSL_set_fd(ks->ssl, ks->fd) == 1 &&
             sock_handshake(ks, true, "(client)", deadline, &err) == MOE_OK;
        if (!up)
            fprintf(stderr, "moe-worker: KV link: a connection refused: %s\n",
                    err.msg[0] ? err.msg : "cannot start TLS");
    }
    if (up && recv_msg(ks, &type, &body, &len, deadline, &err) == MOE_OK) {
        enum moe_status st = (m = malloc(sizeof *m))
                                 ? kv_link_msg_parse(type, body, len, m, &err)
                                 : moe_error_set(&err, MOE_ERR_NOMEM, "out of memory");
        switch (st ? 0 : type) {
        case T_EXPECT:
            st = expect_local(l, m->id, m->blocks, m->n_blocks, m->n_tokens, m->ttl_ms, &err);
            send_status(ks, st, 0, false, st ? err.msg : "", deadline);
            break;
        case T_FORGET: {
            uint64_t bytes = 0;
            bool complete = false;
            forget_local(l, m->id, &bytes, &complete);
            send_status(ks, MOE_OK, bytes, complete, "", moe_now() + l->o.io_timeout_ms / 1e3);
            break;
        }
        case T_ORDER: serve_order(l, ks, m, deadline); break;
        case T_SLICE: serve_slice(l, ks, m); break;
        case T_STATUS:
            send_status(ks, MOE_ERR_INVALID, 0, false, "a STATUS is an answer, not a request",
                        deadline);
            break;
        default: send_status(ks, st, 0, false, err.msg, deadline);
        }
    }
    kv_link_msg_clear(m);
    free(m);
    free(body);
    sock_close(ks);
    free(c);
    pthread_mutex_lock(&l->mu);
    l->n_conns--;
    pthread_cond_broadcast(&l->cond);
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

static void *accept_main(void *arg)
{
    struct kv_link *l = arg;
    for (;;) {
        struct pollfd p = {.fd = l->listen_fd, .events = POLLIN};
        int prc = poll(&p, 1, 100);
        pthread_mutex_lock(&l->mu);
        bool stop = l->stopping;
        pthread_mutex_unlock(&l->mu);
        if (stop)
            break;
        if (prc <= 0)
            continue;
        int fd = accept4(l->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0)
            continue;
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct conn *c = malloc(sizeof *c);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_t th;
        if (c) {
            c->l = l;
            c->ks.fd = fd;
            c->ks.ssl = NULL;
            pthread_mutex_lock(&l->mu);
            l->n_conns++;
            pthread_mutex_unlock(&l->mu);
        }
        if (!c || pthread_create(&th, &attr, conn_main, c)) {
            close(fd);
            if (c) {
                free(c);
                pthread_mutex_lock(&l->mu);
                l->n_conns--;
                pthread_mutex_unlock(&l->mu);
            }
        }
        pthread_attr_destroy(&attr);
    }
    return NULL;
}

enum moe_status kv_link_create(const struct kv_link_opts *o, struct kv_link **out,
                               struct moe_error *err)
{
    *out = NULL;
    const struct kv_link_layout *lay = &o->layout;
    if (lay->tp_size < 1 || (!lay->latent && lay->n_kv_head % lay->tp_size) || lay->tp_rank < 0 ||
        lay->tp_rank >= lay->tp_size)
        return moe_error_set(err, MOE_ERR_INVALID, "KV link: %d KV heads over tp %d (rank %d)",
                             lay->n_kv_head, lay->tp_size, lay->tp_rank);
    char host[KV_LINK_ENDPOINT_MAX];
    int port;
    if (!moe_hostport_split(o->listen, host, sizeof host, &port) || !host[0])
        return moe_error_set(err, MOE_ERR_INVALID, "--kv-listen '%s': not host:port", o->listen);
    struct kv_link *l = calloc(1, sizeof *l);
    if (!l)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    l->o = *o;
    if (l->o.io_timeout_ms <= 0)
        l->o.io_timeout_ms = 5000;
    kv_link_layout_heads(lay, &l->head_begin, &l->head_end);
    l->nccl = o->nccl && o->be->device == MOE_DEVICE_CUDA;
    /* test-only hooks, armed by MOE_TEST_FAULTS=1 alone (test_fault.h) */
    l->fault_delay_ms = moe_fault_int("MOE_FAULT_TRANSFER_DELAY_MS", 0);
    if (l->fault_delay_ms < 0)
        l->fault_delay_ms = 0;
    l->fault_die = moe_fault_int("MOE_FAULT_DIE_DURING_TRANSFER", 0) > 0;
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cond, NULL);
    l->listen_fd = -1;

    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE},
                    *res = NULL;
    int grc = getaddrinfo(host[0] ? host : NULL, port_s, &hints, &res);
    if (grc) {
        moe_error_set(err, MOE_ERR_IO, "--kv-listen %s: %s", o->listen, gai_strerror(grc));
        goto fail;
    }
    for (struct addrinfo *a = res; a && l->listen_fd < 0; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        int one = 1;
        if (fd < 0)
            continue;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 64) == 0)
            l->listen_fd = fd;
        else
            close(fd);
    }
    freeaddrinfo(res);
    if (l->listen_fd < 0) {
        moe_error_set(err, MOE_ERR_IO, "--kv-listen %s: cannot listen (%s)", o->listen,
                      strerror(errno));
        goto fail;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(l->listen_fd, (struct sockaddr *)&ss, &sl);
    int bound = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                               : ((struct sockaddr_in *)&ss)->sin_port);
    const char *adv = o->advertise_host ? o->advertise_host : host;
    char name[KV_LINK_ENDPOINT_MAX];
    if (!adv[0] || !strcmp(adv, "0.0.0.0") || !strcmp(adv, "::") || !strcmp(adv, "[::]")) {
        if (gethostname(name, sizeof name))
            snprintf(name, sizeof name, "localhost");
        name[sizeof name - 1] = '\0';
        adv = name;
    }
    bool v6 = strchr(adv, ':') != NULL;
    snprintf(l->endpoint, sizeof l->endpoint, "%s%.100s%s:%d", v6 ? "[" : "", adv, v6 ? "]" : "",
             bound);
    if (pthread_create(&l->acceptor, NULL, accept_main, l)) {
        moe_error_set(err, MOE_ERR_INTERNAL, "cannot start the KV link thread");
        goto fail;
    }
    l->acceptor_live = true;
    *out = l;
    return MOE_OK;
fail:
    kv_link_destroy(l);
    return err->code;
}

void kv_link_destroy(struct kv_link *l)
{
    if (!l)
        return;
    pthread_mutex_lock(&l->mu);
    l->stopping = true;
    pthread_mutex_unlock(&l->mu);
    if (l->acceptor_live)
        pthread_join(l->acceptor, NULL);
    if (l->listen_fd >= 0)
        close(l->listen_fd);
    pthread_mutex_lock(&l->mu);
    while (l->n_conns > 0) /* each ends within its socket timeouts */
        pthread_cond_wait(&l->cond, &l->mu);
    while (l->table) {
        struct expected *e = l->table;
        l->table = e->next;
        free(e->blocks);
        free(e);
    }
    while (l->pairs) {
        struct pair *p = l->pairs;
        l->pairs = p->next;
        moe_comm_destroy(p->comm);
        pthread_mutex_destroy(&p->mu);
        free(p);
    }
    for (int i = 0; i < l->n_stages; i++)
        l->o.be->ops->buf_free(l->o.be, l->stages[i].p);
    l->n_stages = 0;
    pthread_mutex_unlock(&l->mu);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cond);
    free(l);
}
