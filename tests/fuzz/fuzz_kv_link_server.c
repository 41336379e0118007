/* Fuzz target: a live KV link endpoint (worker/disagg/kv_link.c) over loopback
 * TCP: what a decode or prefill rank does with the messages any process
 * that reaches its --kv-listen port can send. fuzz_kv_link fuzzes the
 * decoding alone; this one the checks and writes behind it.
 *
 * One endpoint with a small CPU cache (2 layers, 8 blocks of 4 tokens, 2
 * KV heads of 4) expects handoff "h" in blocks {1, 3, 5} (10 tokens) before
 * every input. Input: byte 0 picks the message type (EXPECT, FORGET, ORDER,
 * SLICE, STATUS or an unknown one), bytes 1-2 the body length (little
 * endian; cut to what is there), then the body and what follows it (a
 * SLICE's payload), written after a valid head; the connection is then
 * half-closed so that the server never waits for more. An EXPECT the
 * endpoint accepts is followed by a SLICE for it, with its payload, as a
 * prefill rank would send it. An ORDER is decoded
 * and sent again with every target's endpoint replaced by this endpoint's
 * (the server connects to them: never to another process here).
 * What must hold: every answer is a STATUS, a refusal with a message; no byte
 * of the cache changes outside the blocks "h" or the input's own EXPECT
 * reserved; the endpoint stays up. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include "backend.h"
#include "fuzz.h"
#include "disagg/kv_link.h"

enum { N_LAYER = 2, N_BLOCK = 8, BS = 4, N_HEAD = 2, D_HEAD = 4, N_TOK = 10 };
static const int32_t h_blocks[3] = {1, 3, 5};

static struct moe_backend *be;
static struct moe_kv_cache *kv;
static struct kv_link *link_;
static struct sockaddr_in addr;
static float *shadow; /* (N_LAYER, 2, N_BLOCK * BS * kv_dim): the cache as it must stay */

static size_t layer_floats(void)
{
    return (size_t)N_BLOCK * BS * kv->kv_dim;
}

static void cache_io(float *host, bool down)
{
    size_t n = layer_floats();
    for (int l = 0; l < N_LAYER; l++)
        for (int k = 0; k < 2; k++) {
            float *dev = k ? kv->v[l] : kv->k[l], *h = host + (size_t)(l * 2 + k) * n;
            if (down)
                be->ops->buf_download(be, h, dev, n * sizeof *h);
            else
                be->ops->buf_upload(be, dev, h, n * sizeof *h);
        }
}

static void teardown(void)
{
    kv_link_destroy(link_);
    moe_kv_cache_release(be, kv);
    moe_backend_destroy(be);
    free(shadow);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    struct moe_error err = {0};
    if (moe_backend_create("cpu", 1, &be, &err) ||
        moe_kv_cache_alloc(be, N_LAYER, N_BLOCK, BS, N_HEAD * D_HEAD, false, MOE_DTYPE_F32, &kv,
                           &err)) {
        fprintf(stderr, "%s\n", err.msg);
        abort();
    }
    struct kv_link_opts o = {
        .be = be,
        .listen = "127.0.0.1:0",
        .layout = {.n_layer = N_LAYER, .n_kv_head = N_HEAD, .d_head = D_HEAD, .tp_size = 1},
        .io_timeout_ms = 500};
    if (kv_link_create(&o, &link_, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        abort();
    }
    kv_link_attach_kv(link_, kv);
    /* libFuzzer's -timeout timer (SIGALRM) would interrupt this thread's
     * connect and read (EINTR); the endpoint's threads, started above, take
     * the signal instead. */
    sigset_t alrm;
    sigemptyset(&alrm);
    sigaddset(&alrm, SIGALRM);
    pthread_sigmask(SIG_BLOCK, &alrm, NULL);
    shadow = malloc((size_t)N_LAYER * 2 * layer_floats() * sizeof *shadow);
    FUZZ_CHECK(shadow, "out of memory");
    for (size_t i = 0; i < (size_t)N_LAYER * 2 * layer_floats(); i++)
        shadow[i] = (float)i;
    cache_io(shadow, false);
    const char *colon = strrchr(kv_link_endpoint(link_), ':');
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)atoi(colon + 1));
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    atexit(teardown);
    return 0;
}

/* Whether block b is one of the n in `blocks`. */
static bool in_list(const int32_t *blocks, int n, int b)
{
    for (int i = 0; i < n; i++)
        if (blocks[i] == b)
            return true;
    return false;
}

struct wbuf {
    uint8_t *p;
    size_t n;
};

static void put(struct wbuf *w, const void *v, size_t n)
{
    memcpy(w->p + w->n, v, n);
    w->n += n;
}

static void put_i32(struct wbuf *w, int32_t v)
{
    put(w, &v, 4);
}

static void put_str(struct wbuf *w, const char *s)
{
    put_i32(w, (int32_t)strlen(s));
    put(w, s, strlen(s));
}

static void put_ints(struct wbuf *w, const int32_t *v, int n)
{
    put_i32(w, n);
    put(w, v, (size_t)n * 4);
}

/* The ORDER `m` as kv_link.c writes it, every target this endpoint (malloc'd). */
static uint8_t *order_to_self(const struct kv_link_msg *m, size_t *len)
{
    size_t cap = 64 + KV_LINK_ID_MAX + 8 * ((size_t)m->n_src_blocks + m->n_blocks) +
                 (size_t)m->n_targets * (16 + KV_LINK_ENDPOINT_MAX);
    struct wbuf w = {malloc(cap), 0};
    FUZZ_CHECK(w.p, "out of memory");
    put_str(&w, m->id);
    put_i32(&w, m->n_tokens);
    put_i32(&w, m->deadline_ms);
    put_ints(&w, m->src_blocks, m->n_src_blocks);
    put_i32(&w, m->dst_block_size);
    put_ints(&w, m->blocks, m->n_blocks);
    put_i32(&w, m->n_targets);
    for (int i = 0; i < m->n_targets; i++) {
        put_str(&w, kv_link_endpoint(link_));
        put_i32(&w, m->targets[i].head_begin);
        put_i32(&w, m->targets[i].head_end);
    }
    *len = w.n;
    return w.p;
}

/* A SLICE for the handoff of EXPECT `m` (both heads, every token), payload
 * included (malloc'd); NULL when the reservation is too large to bother. */
static uint8_t *slice_for(const struct kv_link_msg *m, size_t *body_len, size_t *len)
{
    if (m->n_tokens < 1 || m->n_tokens > 64 || m->n_blocks > 64)
        return NULL;
    size_t payload = (size_t)N_LAYER * 2 * m->n_tokens * N_HEAD * D_HEAD * sizeof(float);
    size_t cap =
        64 + KV_LINK_ID_MAX + 4 * (size_t)m->n_blocks + MOE_COMM_NCCL_ID_BYTES + 32 + payload;
    struct wbuf w = {malloc(cap), 0};
    FUZZ_CHECK(w.p, "out of memory");
    static const uint8_t nccl_id[MOE_COMM_NCCL_ID_BYTES];
    put_str(&w, m->id);
    /* n_layer, d_head, kv_dtype, head_begin, head_end, n_tokens, dst_block_size */
    int32_t head[7] = {N_LAYER, D_HEAD, MOE_DTYPE_F32, 0, N_HEAD, m->n_tokens, BS};
    for (int i = 0; i < 7; i++)
        put_i32(&w, head[i]);
    put_ints(&w, m->blocks, m->n_blocks);
    put_i32(&w, 0); /* transport: the socket */
    put_i32(&w, 0);
    put(&w, nccl_id, sizeof nccl_id);
    put_str(&w, "127.0.0.1:1");
    *body_len = w.n;
    for (size_t i = 0; i < payload; i++)
        w.p[w.n++] = (uint8_t)(i * 7);
    *len = w.n;
    return w.p;
}

/* Sends a head for `body_len` bytes, then all n bytes (body and payload),
 * half-closes, and checks every answer until EOF. */
static void exchange(uint32_t type, const uint8_t *body, size_t body_len, size_t n)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    FUZZ_CHECK(fd >= 0 && connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0,
               "the endpoint is down: %s", strerror(errno));
    uint32_t head[3] = {0x4b454f4du, type, (uint32_t)body_len};
    bool sent = write(fd, head, sizeof head) == sizeof head;
    for (size_t at = 0; sent && at < n;) { /* the server may close early: a refusal */
        ssize_t k = send(fd, body + at, n - at, MSG_NOSIGNAL);
        if (k <= 0)
            break;
        at += (size_t)k;
    }
    shutdown(fd, SHUT_WR);
    static uint8_t buf[1 << 16];
    size_t got = 0;
    ssize_t k;
    while (got < sizeof buf && (k = read(fd, buf + got, sizeof buf - got)) > 0)
        got += (size_t)k;
    close(fd);
    for (size_t at = 0; at + KV_LINK_HEAD_BYTES <= got;) {
        uint32_t t, len;
        struct moe_error err = {0};
        FUZZ_CHECK(kv_link_head_parse(buf + at, &t, &len, &err) == MOE_OK &&
                       t == KV_LINK_MSG_STATUS && at + KV_LINK_HEAD_BYTES + len <= got,
                   "answer: %s", err.msg);
        struct kv_link_msg *m = malloc(sizeof *m);
        FUZZ_CHECK(m && kv_link_msg_parse(t, buf + at + KV_LINK_HEAD_BYTES, len, m, &err) == MOE_OK,
                   "answer: %s", err.msg);
        /* a refusal says why (raw: the client's moe_error_set makes it one line) */
        FUZZ_CHECK(m->status == MOE_OK || m->msg[0], "a refusal without a message");
        kv_link_msg_clear(m);
        free(m);
        at += KV_LINK_HEAD_BYTES + len;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3)
        return 0;
    static const uint32_t types[8] = {
        KV_LINK_MSG_EXPECT, KV_LINK_MSG_FORGET, KV_LINK_MSG_ORDER,  KV_LINK_MSG_SLICE,
        KV_LINK_MSG_SLICE,  KV_LINK_MSG_SLICE,  KV_LINK_MSG_STATUS, 77};
    uint32_t type = types[data[0] & 7];
    const uint8_t *body = data + 3;
    size_t n = size - 3, body_len = (size_t)(data[1] | data[2] << 8);
    if (body_len > n)
        body_len = n;
    struct moe_error err = {0};
    FUZZ_CHECK(kv_link_expect(link_, NULL, "h", h_blocks, 3, N_TOK, 10000, &err) == MOE_OK, "%s",
               err.msg);
    /* what the input itself may reserve, and where an ORDER would connect */
    struct kv_link_msg *m = malloc(sizeof *m);
    FUZZ_CHECK(m, "out of memory");
    bool parsed = kv_link_msg_parse(type, body, body_len, m, &err) == MOE_OK;
    if (type != KV_LINK_MSG_ORDER) {
        exchange(type, body, body_len, n);
        size_t slice_body, len;
        uint8_t *slice =
            parsed && type == KV_LINK_MSG_EXPECT ? slice_for(m, &slice_body, &len) : NULL;
        if (slice)
            exchange(KV_LINK_MSG_SLICE, slice, slice_body, len);
        free(slice);
    } else if (parsed) {
        m->deadline_ms = m->deadline_ms > 0 ? m->deadline_ms % 2000 + 1 : m->deadline_ms;
        size_t len;
        uint8_t *order = order_to_self(m, &len);
        exchange(type, order, len, len);
        free(order);
    }
    uint64_t bytes;
    bool complete;
    FUZZ_CHECK(kv_link_forget(link_, NULL, "h", &bytes, &complete, &err) == MOE_OK, "%s", err.msg);
    if (parsed && type == KV_LINK_MSG_EXPECT && strcmp(m->id, "h"))
        FUZZ_CHECK(kv_link_forget(link_, NULL, m->id, &bytes, &complete, &err) == MOE_OK, "%s",
                   err.msg);
    /* only reserved blocks may have changed; put back the pattern */
    static float *now;
    if (!now)
        now = malloc((size_t)N_LAYER * 2 * layer_floats() * sizeof *now);
    FUZZ_CHECK(now, "out of memory");
    cache_io(now, true);
    size_t per_block = (size_t)BS * kv->kv_dim;
    for (size_t i = 0; i < (size_t)N_LAYER * 2 * layer_floats(); i++) {
        int b = (int)(i % layer_floats() / per_block);
        bool reserved = in_list(h_blocks, 3, b) || (parsed && type == KV_LINK_MSG_EXPECT &&
                                                    in_list(m->blocks, m->n_blocks, b));
        FUZZ_CHECK(reserved || memcmp(&now[i], &shadow[i], sizeof *now) == 0,
                   "block %d changed without a reservation", b);
    }
    cache_io(shadow, false);
    kv_link_msg_clear(m);
    free(m);
    return 0;
}
