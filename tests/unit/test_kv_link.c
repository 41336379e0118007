/* The KV data plane (worker/disagg/kv_link.c) on synthetic caches, in one process
 * over loopback TCP: slices re-sliced across TP sizes and re-blocked across
 * block sizes arrive bit-exact; refusals name what is wrong and write
 * nothing; FORGET reports completeness; orders push from another rank;
 * expectations expire. The wire: kv_link_msg_parse decodes hand-built messages
 * and names the field of a malformed one, and the server answers raw
 * messages with what kv_link_msg_parse says about them (it decodes through it);
 * block ids from the wire outside the cache are refused. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "backend.h"
#include "disagg/kv_link.h"
#include "testlib.h"

enum { N_LAYER = 3, N_HEAD = 4, D_HEAD = 8, N_TOK = 23, N_BLOCK = 32 };

static struct moe_backend *be; /* the backend under test: CPU, then CUDA where a GPU is */
static enum moe_dtype g_dt = MOE_DTYPE_F32; /* of the caches cache_new makes */
/* Latent caches (multi-head latent attention): one plane per layer, the
 * whole row on every rank: the layout's one head of N_HEAD x D_HEAD, which
 * the helpers below still index as N_HEAD sub-heads of D_HEAD. */
static bool g_latent;

static int planes(void)
{
    return g_latent ? 1 : 2;
}

static size_t layer_elems(const struct moe_kv_cache *kv)
{
    return (size_t)kv->n_block * kv->block_size * kv->kv_dim;
}

/* One layer's K or V between the cache (backend memory) and host memory. */
static void layer_io(struct moe_kv_cache *kv, int l, int kind, void *host, bool down)
{
    void *dev = kind ? kv->v[l] : kv->k[l];
    size_t bytes = layer_elems(kv) * moe_dtype_size(kv->dtype);
    if (down)
        be->ops->buf_download(be, host, dev, bytes);
    else
        be->ops->buf_upload(be, dev, host, bytes);
}

/* A cache of g_dt holding heads [hb, he) of the model, NaN-filled
 * (unwritten = NaN: all bits set, in either dtype). */
static struct moe_kv_cache *cache_new(int block_size, int hb, int he)
{
    struct moe_kv_cache *kv = NULL;
    struct moe_error err = {0};
    if (moe_kv_cache_alloc(be, N_LAYER, N_BLOCK, block_size, (he - hb) * D_HEAD, g_latent, g_dt,
                           &kv, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        exit(1);
    }
    size_t bytes = layer_elems(kv) * moe_dtype_size(kv->dtype);
    void *host = malloc(bytes);
    memset(host, 0xff, bytes);
    for (int l = 0; l < N_LAYER; l++)
        for (int kind = 0; kind < planes(); kind++)
            layer_io(kv, l, kind, host, false);
    free(host);
    return kv;
}

/* The bits of (layer, K or V, token, head, dim) in a cache of `dt`:
 * distinct everywhere (BF16: consecutive finite bf16 patterns from 2^-7). */
static uint32_t value_bits(enum moe_dtype dt, int l, int kind, int t, int h, int d)
{
    if (dt == MOE_DTYPE_BF16)
        return 0x3c00u + (uint32_t)((((l * 2 + kind) * N_TOK + t) * N_HEAD + h) * D_HEAD + d);
    float f = (float)(((l * 2 + kind) * 1000 + t) * 100 + h * 10 + d) + 0.25f;
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Index of element d of (token t, head h) in a host copy of one layer. */
static size_t at(const struct moe_kv_cache *kv, const int32_t *blocks, int t, int h, int hb, int d)
{
    size_t slot = (size_t)blocks[t / kv->block_size] * kv->block_size + t % kv->block_size;
    return slot * kv->kv_dim + (size_t)(h - hb) * D_HEAD + (size_t)d;
}

static uint32_t elem_get(const struct moe_kv_cache *kv, const void *layer, size_t i)
{
    if (kv->dtype == MOE_DTYPE_BF16)
        return ((const uint16_t *)layer)[i];
    return ((const uint32_t *)layer)[i];
}

static void elem_set(const struct moe_kv_cache *kv, void *layer, size_t i, uint32_t bits)
{
    if (kv->dtype == MOE_DTYPE_BF16)
        ((uint16_t *)layer)[i] = (uint16_t)bits;
    else
        ((uint32_t *)layer)[i] = bits;
}

static void fill(struct moe_kv_cache *kv, const int32_t *blocks, int hb, int he)
{
    void *host = malloc(layer_elems(kv) * moe_dtype_size(kv->dtype));
    for (int l = 0; l < N_LAYER; l++)
        for (int kind = 0; kind < planes(); kind++) {
            layer_io(kv, l, kind, host, true);
            for (int t = 0; t < N_TOK; t++)
                for (int h = hb; h < he; h++)
                    for (int d = 0; d < D_HEAD; d++)
                        elem_set(kv, host, at(kv, blocks, t, h, hb, d),
                                 value_bits(kv->dtype, l, kind, t, h, d));
            layer_io(kv, l, kind, host, false);
        }
    free(host);
}

/* Number of (layer, kind, token, head, dim) values that differ. */
static long mismatches(struct moe_kv_cache *kv, const int32_t *blocks, int hb, int he)
{
    long bad = 0;
    void *host = malloc(layer_elems(kv) * moe_dtype_size(kv->dtype));
    for (int l = 0; l < N_LAYER; l++)
        for (int kind = 0; kind < planes(); kind++) {
            layer_io(kv, l, kind, host, true);
            for (int t = 0; t < N_TOK; t++)
                for (int h = hb; h < he; h++)
                    for (int d = 0; d < D_HEAD; d++)
                        bad += elem_get(kv, host, at(kv, blocks, t, h, hb, d)) !=
                               value_bits(kv->dtype, l, kind, t, h, d);
        }
    free(host);
    return bad;
}

struct side {
    int tp, bs;
    struct kv_link *link[4];
    struct moe_kv_cache *kv[4];
    struct kv_link_target targets[4];
    int hb[4], he[4]; /* the (sub-)heads rank r's cache holds */
};

static void side_open(struct side *s, int tp, int bs)
{
    struct moe_error err = {0};
    s->tp = tp;
    s->bs = bs;
    for (int r = 0; r < tp; r++) {
        struct kv_link_opts o = {.be = be,
                                 .listen = "127.0.0.1:0",
                                 .layout = {.n_layer = N_LAYER,
                                            .n_kv_head = N_HEAD,
                                            .d_head = D_HEAD,
                                            .tp_size = tp,
                                            .tp_rank = r},
                                 .io_timeout_ms = 2000};
        if (g_latent)
            o.layout = (struct kv_link_layout){N_LAYER, 1, N_HEAD * D_HEAD, tp, r, true};
        CHECKF(kv_link_create(&o, &s->link[r], &err) == MOE_OK, "%s", err.msg);
        int hb, he;
        kv_link_layout_heads(&o.layout, &hb, &he);
        s->targets[r].head_begin = hb;
        s->targets[r].head_end = he;
        if (g_latent) { /* the data: every sub-head */
            hb = 0;
            he = N_HEAD;
        }
        s->hb[r] = hb;
        s->he[r] = he;
        s->kv[r] = cache_new(bs, hb, he);
        kv_link_attach_kv(s->link[r], s->kv[r]);
        snprintf(s->targets[r].endpoint, KV_LINK_ENDPOINT_MAX, "%s", kv_link_endpoint(s->link[r]));
    }
}

static void side_close(struct side *s)
{
    for (int r = 0; r < s->tp; r++) {
        kv_link_destroy(s->link[r]);
        moe_kv_cache_release(be, s->kv[r]);
    }
}

/* Blocks in a scrambled order, as a real pool hands them out. */
static void scrambled(int32_t *blocks, int n, int seed)
{
    for (int i = 0; i < n; i++)
        blocks[i] = (int32_t)((i * 7 + seed) % N_BLOCK);
}

static void test_reslice(int src_tp, int src_bs, int dst_tp, int dst_bs)
{
    struct moe_error err = {0};
    struct side src = {0}, dst = {0};
    side_open(&src, src_tp, src_bs);
    side_open(&dst, dst_tp, dst_bs);
    int32_t sb[N_BLOCK], db[N_BLOCK];
    int n_sb = (N_TOK + src_bs - 1) / src_bs, n_db = (N_TOK + dst_bs - 1) / dst_bs;
    scrambled(sb, n_sb, 3);
    scrambled(db, n_db, 11);
    for (int r = 0; r < src_tp; r++)
        fill(src.kv[r], sb, src.hb[r], src.he[r]);
    /* the decode leader (rank 0 here) tells every rank, remote ones by TCP */
    for (int r = 0; r < dst_tp; r++)
        CHECKF(kv_link_expect(dst.link[0], r ? dst.targets[r].endpoint : NULL, "h1", db, n_db,
                              N_TOK, 5000, &err) == MOE_OK,
               "expect on rank %d: %s", r, err.msg);
    struct kv_link_push p = {.id = "h1",
                             .src_blocks = sb,
                             .n_src_blocks = n_sb,
                             .n_tokens = N_TOK,
                             .dst_blocks = db,
                             .n_dst_blocks = n_db,
                             .dst_block_size = dst_bs,
                             .targets = dst.targets,
                             .n_targets = dst_tp,
                             .deadline_ms = 5000};
    /* sender rank 0 pushes itself and orders the others (as the prefill leader) */
    struct kv_link_order *orders[4] = {0};
    for (int r = 1; r < src_tp; r++)
        CHECK(kv_link_order_start(src.link[0], src.targets[r].endpoint, &p, &orders[r], &err) ==
              MOE_OK);
    uint64_t sent = 0, mine = 0;
    CHECKF(kv_link_push(src.link[0], &p, &mine, &err) == MOE_OK, "push: %s", err.msg);
    sent += mine;
    for (int r = 1; r < src_tp; r++) {
        uint64_t theirs = 0;
        CHECKF(kv_link_order_wait(orders[r], &theirs, &err) == MOE_OK, "order to rank %d: %s", r,
               err.msg);
        sent += theirs;
    }
    /* every value once; latent: the one plane once to every receiver */
    uint64_t want = (uint64_t)N_LAYER * planes() * N_TOK * N_HEAD * D_HEAD * moe_dtype_size(g_dt) *
                    (g_latent ? (uint64_t)dst_tp : 1);
    CHECKF(sent == want, "tp %d -> %d: %llu bytes sent, %llu expected", src_tp, dst_tp,
           (unsigned long long)sent, (unsigned long long)want);
    uint64_t got = 0;
    for (int r = 0; r < dst_tp; r++) {
        uint64_t b = 0;
        bool complete = false;
        CHECK(kv_link_forget(dst.link[0], r ? dst.targets[r].endpoint : NULL, "h1", &b, &complete,
                             &err) == MOE_OK);
        CHECKF(complete, "tp %d -> %d: rank %d incomplete", src_tp, dst_tp, r);
        got += b;
        long bad = mismatches(dst.kv[r], db, dst.hb[r], dst.he[r]);
        CHECKF(bad == 0, "tp %d bs %d -> tp %d bs %d: rank %d has %ld wrong values", src_tp, src_bs,
               dst_tp, dst_bs, r, bad);
    }
    CHECK(got == sent);
    /* forgotten: a second push is refused before any byte is written */
    mine = 0;
    CHECK(kv_link_push(src.link[0], &p, &mine, &err) != MOE_OK && strstr(err.msg, "not expected"));
    side_close(&src);
    side_close(&dst);
}

/* A push of handoff `id`: the 6 blocks sb (N_TOK tokens) into blocks db of
 * 4 tokens on `targets` (one rank). */
static struct kv_link_push push_six(const char *id, const int32_t *sb, const int32_t *db,
                                    const struct kv_link_target *targets)
{
    return (struct kv_link_push){.id = id,
                                 .src_blocks = sb,
                                 .n_src_blocks = 6,
                                 .n_tokens = N_TOK,
                                 .dst_blocks = db,
                                 .n_dst_blocks = 6,
                                 .dst_block_size = 4,
                                 .targets = targets,
                                 .n_targets = 1,
                                 .deadline_ms = 3000};
}

static void test_refusals(void)
{
    struct moe_error err = {0};
    struct side src = {0}, dst = {0}, other = {0};
    side_open(&src, 1, 4);
    side_open(&dst, 1, 4);
    int32_t sb[8], db[8];
    scrambled(sb, 6, 1);
    scrambled(db, 6, 5);
    fill(src.kv[0], sb, 0, N_HEAD);
    struct kv_link_push p = push_six("x", sb, db, dst.targets);
    uint64_t bytes = 0;
    CHECKF(kv_link_push(src.link[0], &p, &bytes, &err) != MOE_OK && strstr(err.msg, "not expected"),
           "unknown handoff: %s", err.msg);
    CHECK(kv_link_expect(dst.link[0], NULL, "x", db, 6, N_TOK, 3000, &err) == MOE_OK);
    CHECK(kv_link_expect(dst.link[0], NULL, "x", db, 6, N_TOK, 3000, &err) != MOE_OK &&
          strstr(err.msg, "already expected"));
    int32_t wrong[8];
    memcpy(wrong, db, sizeof wrong);
    wrong[2] = 31;
    p.dst_blocks = wrong;
    CHECKF(kv_link_push(src.link[0], &p, &bytes, &err) != MOE_OK && strstr(err.msg, "reserved"),
           "wrong blocks: %s", err.msg);
    p.dst_blocks = db;
    struct kv_link_target t = dst.targets[0];
    t.head_end = N_HEAD + 2; /* a receiver that claims heads it does not hold */
    p.targets = &t;
    CHECKF(kv_link_push(src.link[0], &p, &bytes, &err) == MOE_OK, "overlap is clipped: %s",
           err.msg);
    uint64_t clipped = bytes;
    p.targets = dst.targets;
    /* a model with another layout on the other side */
    other.tp = 1;
    struct kv_link_opts o = {
        .be = be,
        .listen = "127.0.0.1:0",
        .layout = {.n_layer = N_LAYER + 1, .n_kv_head = N_HEAD, .d_head = D_HEAD, .tp_size = 1}};
    CHECK(kv_link_create(&o, &other.link[0], &err) == MOE_OK);
    other.kv[0] = cache_new(4, 0, N_HEAD);
    kv_link_attach_kv(other.link[0], other.kv[0]);
    CHECK(kv_link_expect(other.link[0], NULL, "x", db, 6, N_TOK, 3000, &err) == MOE_OK);
    snprintf(t.endpoint, sizeof t.endpoint, "%s", kv_link_endpoint(other.link[0]));
    t.head_end = N_HEAD;
    p.targets = &t;
    CHECKF(kv_link_push(src.link[0], &p, &bytes, &err) != MOE_OK && strstr(err.msg, "KV layout"),
           "layout: %s", err.msg);
    CHECK(mismatches(other.kv[0], db, 0, N_HEAD) ==
          (long)N_LAYER * 2 * N_TOK * N_HEAD * D_HEAD); /* nothing written */
    p.targets = dst.targets;
    /* a bad endpoint fails fast with its name */
    struct kv_link_target nowhere = {
        .endpoint = "127.0.0.1:1", .head_begin = 0, .head_end = N_HEAD};
    p.targets = &nowhere;
    CHECKF(kv_link_push(src.link[0], &p, &bytes, &err) != MOE_OK && strstr(err.msg, "127.0.0.1:1"),
           "unreachable: %s", err.msg);
    p.targets = dst.targets;
    /* the clipped push above delivered everything */
    uint64_t b = 0;
    bool complete = false;
    CHECK(kv_link_forget(dst.link[0], NULL, "x", &b, &complete, &err) == MOE_OK);
    CHECKF(complete && b == clipped, "forget: %llu bytes, complete %d", (unsigned long long)b,
           complete);
    CHECK(mismatches(dst.kv[0], db, 0, N_HEAD) == 0);
    /* FORGET of a partial handoff: not complete */
    CHECK(kv_link_expect(dst.link[0], NULL, "half", db, 6, N_TOK, 3000, &err) == MOE_OK);
    p.id = "half";
    struct kv_link_target halfway = dst.targets[0];
    halfway.head_end = N_HEAD / 2; /* only half of the heads are sent */
    p.targets = &halfway;
    CHECK(kv_link_push(src.link[0], &p, &bytes, &err) == MOE_OK);
    CHECK(kv_link_forget(dst.link[0], NULL, "half", &b, &complete, &err) == MOE_OK);
    CHECKF(!complete && b == bytes, "half the heads: %llu bytes, complete %d",
           (unsigned long long)b, complete);
    CHECK(kv_link_forget(dst.link[0], NULL, "never", &b, &complete, &err) == MOE_OK && !complete &&
          b == 0);
    /* an expectation expires */
    p.id = "short";
    p.targets = dst.targets;
    CHECK(kv_link_expect(dst.link[0], dst.targets[0].endpoint, "short", db, 6, N_TOK, 50, &err) ==
          MOE_OK);
    usleep(120 * 1000);
    CHECKF(kv_link_push(src.link[0], &p, &bytes, &err) != MOE_OK && strstr(err.msg, "not expected"),
           "expired: %s", err.msg);
    side_close(&src);
    side_close(&dst);
    side_close(&other);
}

/* ---- the wire ------------------------------------------------------------------------ */

struct wb { /* a message body, written as kv_link.c writes it */
    uint8_t b[4096];
    size_t n;
};

static void wb_raw(struct wb *w, const void *p, size_t n)
{
    memcpy(w->b + w->n, p, n);
    w->n += n;
}

static void wb_i32(struct wb *w, int32_t v)
{
    wb_raw(w, &v, 4);
}

static void wb_str(struct wb *w, const char *s)
{
    wb_i32(w, (int32_t)strlen(s));
    wb_raw(w, s, strlen(s));
}

static void wb_ints(struct wb *w, const int32_t *v, int n)
{
    wb_i32(w, n);
    wb_raw(w, v, (size_t)n * 4);
}

static void slice_body(struct wb *w, const int32_t *blocks, int n_blocks)
{
    static const uint8_t nccl_id[MOE_COMM_NCCL_ID_BYTES] = {1, 2, 3};
    w->n = 0;
    wb_str(w, "h9");
    /* n_layer, d_head, kv_dtype, head_begin, head_end, n_tokens, dst_block_size */
    int32_t v[7] = {N_LAYER, D_HEAD, MOE_DTYPE_BF16, 0, 2, N_TOK, 4};
    for (int i = 0; i < 7; i++)
        wb_i32(w, v[i]);
    wb_ints(w, blocks, n_blocks);
    wb_i32(w, 1); /* transport */
    wb_i32(w, 0); /* init */
    wb_raw(w, nccl_id, sizeof nccl_id);
    wb_str(w, "127.0.0.1:9");
}

static void test_wire(void)
{
    struct moe_error err = {0};
    struct kv_link_msg m;
    int32_t blocks[6] = {4, 9, 2, 7, 11, 30};
    struct wb w = {.n = 0};
    wb_str(&w, "h1");
    wb_i32(&w, N_TOK);
    wb_i32(&w, 3000);
    wb_ints(&w, blocks, 6);
    CHECKF(kv_link_msg_parse(KV_LINK_MSG_EXPECT, w.b, w.n, &m, &err) == MOE_OK, "%s", err.msg);
    CHECK(!strcmp(m.id, "h1") && m.n_tokens == N_TOK && m.ttl_ms == 3000 && m.n_blocks == 6 &&
          !memcmp(m.blocks, blocks, sizeof blocks));
    kv_link_msg_clear(&m);
    CHECK(!m.blocks && !m.n_blocks);

    slice_body(&w, blocks, 6);
    CHECKF(kv_link_msg_parse(KV_LINK_MSG_SLICE, w.b, w.n, &m, &err) == MOE_OK, "%s", err.msg);
    CHECK(m.n_layer == N_LAYER && m.d_head == D_HEAD && m.kv_dtype == MOE_DTYPE_BF16 &&
          m.head_end == 2 && m.n_tokens == N_TOK && m.dst_block_size == 4 && m.n_blocks == 6 &&
          m.transport == 1 && m.init == 0 && m.nccl_id.bytes[2] == 3 &&
          !strcmp(m.sender, "127.0.0.1:9"));
    kv_link_msg_clear(&m);
    /* every truncation is refused and names a field */
    int named = 0;
    for (size_t n = 0; n < w.n; n++) {
        enum moe_status st = kv_link_msg_parse(KV_LINK_MSG_SLICE, w.b, n, &m, &err);
        named += st == MOE_ERR_INVALID && strstr(err.msg, "malformed SLICE: '") &&
                 strstr(err.msg, "runs past the end") && !m.blocks;
    }
    CHECKF(named == (int)w.n, "%d of %zu truncations refused by field", named, w.n);
    /* a count out of range names it */
    memcpy(w.b + 4 + 2 + 7 * 4, &(int32_t){-3}, 4);
    CHECKF(kv_link_msg_parse(KV_LINK_MSG_SLICE, w.b, w.n, &m, &err) == MOE_ERR_INVALID &&
               strstr(err.msg, "'dst_blocks': -3 entries"),
           "%s", err.msg);
    CHECK(kv_link_msg_parse(9, w.b, w.n, &m, &err) == MOE_ERR_INVALID &&
          strstr(err.msg, "unknown KV link message type 9"));
    /* the head */
    uint32_t head[3] = {0x4b454f4du, KV_LINK_MSG_FORGET, 7}, type, len;
    CHECK(kv_link_head_parse((const uint8_t *)head, &type, &len, &err) == MOE_OK &&
          type == KV_LINK_MSG_FORGET && len == 7);
    head[2] = KV_LINK_MAX_BODY + 1;
    CHECK(kv_link_head_parse((const uint8_t *)head, &type, &len, &err) == MOE_ERR_INVALID &&
          strstr(err.msg, "not a KV link message"));
}

/* Sends one raw message to `endpoint` and decodes the STATUS answer. */
static bool raw_call(const char *endpoint, uint32_t type, const struct wb *w,
                     struct kv_link_msg *ans)
{
    const char *colon = strrchr(endpoint, ':');
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) {
        if (fd >= 0)
            close(fd);
        return false;
    }
    uint32_t head[3] = {0x4b454f4du, type, (uint32_t)w->n};
    bool ok = write(fd, head, sizeof head) == sizeof head && write(fd, w->b, w->n) == (ssize_t)w->n;
    uint8_t buf[2048];
    size_t got = 0;
    ssize_t k;
    while (ok && got < sizeof buf && (k = read(fd, buf + got, sizeof buf - got)) > 0)
        got += (size_t)k; /* the server closes after its answer */
    close(fd);
    struct moe_error err = {0};
    return ok && got >= KV_LINK_HEAD_BYTES &&
           kv_link_head_parse(buf, &type, &head[2], &err) == MOE_OK && type == KV_LINK_MSG_STATUS &&
           kv_link_msg_parse(type, buf + KV_LINK_HEAD_BYTES, got - KV_LINK_HEAD_BYTES, ans, &err) ==
               MOE_OK;
}

static void test_wire_server(void)
{
    struct side dst = {0}, src = {0};
    side_open(&dst, 1, 4);
    side_open(&src, 1, 4);
    const char *ep = dst.targets[0].endpoint;
    struct moe_error err = {0};
    struct kv_link_msg ans, m;
    int32_t blocks[6] = {4, 9, 2, 7, 11, 30};
    /* a malformed EXPECT: the server answers what kv_link_msg_parse says */
    struct wb w = {.n = 0};
    wb_str(&w, "h1");
    wb_i32(&w, N_TOK);
    wb_i32(&w, 3000);
    wb_i32(&w, 6); /* six blocks announced, five sent */
    wb_raw(&w, blocks, 5 * 4);
    CHECK(kv_link_msg_parse(KV_LINK_MSG_EXPECT, w.b, w.n, &m, &err) == MOE_ERR_INVALID);
    CHECKF(raw_call(ep, KV_LINK_MSG_EXPECT, &w, &ans) && ans.status == MOE_ERR_INVALID &&
               !strcmp(ans.msg, err.msg),
           "answer '%s', parser '%s'", ans.msg, err.msg);
    /* a well-formed one is decoded and registered: a second is a duplicate */
    w.n = 0;
    wb_str(&w, "h1");
    wb_i32(&w, N_TOK);
    wb_i32(&w, 3000);
    wb_ints(&w, blocks, 6);
    CHECKF(raw_call(ep, KV_LINK_MSG_EXPECT, &w, &ans) && ans.status == MOE_OK, "%s", ans.msg);
    CHECKF(raw_call(ep, KV_LINK_MSG_EXPECT, &w, &ans) && ans.status == MOE_ERR_INVALID &&
               strstr(ans.msg, "h1 is already expected"),
           "%s", ans.msg);
    /* block ids and token counts outside the cache are refused before anything is written */
    int32_t bad[6] = {4, 9, 2, 7, 11, N_BLOCK};
    w.n = 0;
    wb_str(&w, "h2");
    wb_i32(&w, N_TOK);
    wb_i32(&w, 3000);
    wb_ints(&w, bad, 6);
    CHECKF(raw_call(ep, KV_LINK_MSG_EXPECT, &w, &ans) && ans.status == MOE_ERR_INVALID &&
               strstr(ans.msg, "blocks[5] = 32 is not a block in [0, 32)"),
           "%s", ans.msg);
    w.n = 0;
    wb_str(&w, "h3");
    wb_i32(&w, 6 * 4 + 1); /* one token more than six blocks of four hold */
    wb_i32(&w, 3000);
    wb_ints(&w, blocks, 6);
    CHECKF(raw_call(ep, KV_LINK_MSG_EXPECT, &w, &ans) && ans.status == MOE_ERR_INVALID &&
               strstr(ans.msg, "25 tokens in 6 blocks of 4"),
           "%s", ans.msg);
    /* an ORDER whose source blocks are outside the sender's cache */
    w.n = 0;
    wb_str(&w, "h1");
    wb_i32(&w, N_TOK);
    wb_i32(&w, 2000); /* deadline_ms */
    wb_ints(&w, bad, 6);
    wb_i32(&w, 4);
    wb_ints(&w, blocks, 6);
    wb_i32(&w, 1);
    wb_str(&w, ep);
    wb_i32(&w, 0);
    wb_i32(&w, N_HEAD);
    CHECKF(raw_call(src.targets[0].endpoint, KV_LINK_MSG_ORDER, &w, &ans) &&
               ans.status == MOE_ERR_INVALID && strstr(ans.msg, "src_blocks[5] = 32"),
           "%s", ans.msg);
    side_close(&src);
    side_close(&dst);
}

/* Caches of another dtype on the receiving side: refused by name, nothing
 * written. */
static void test_dtype_mismatch(void)
{
    struct moe_error err = {0};
    struct side src = {0}, dst = {0};
    side_open(&src, 1, 4);
    g_dt = MOE_DTYPE_BF16;
    side_open(&dst, 1, 4);
    g_dt = MOE_DTYPE_F32;
    int32_t sb[8], db[8];
    scrambled(sb, 6, 1);
    scrambled(db, 6, 5);
    fill(src.kv[0], sb, 0, N_HEAD);
    CHECK(kv_link_expect(dst.link[0], NULL, "m", db, 6, N_TOK, 3000, &err) == MOE_OK);
    struct kv_link_push p = push_six("m", sb, db, dst.targets);
    uint64_t bytes = 0;
    CHECKF(kv_link_push(src.link[0], &p, &bytes, &err) != MOE_OK &&
               strstr(err.msg, "KV dtype: F32 sent, BF16 here"),
           "dtype mismatch: %s", err.msg);
    bool complete = true;
    CHECK(kv_link_forget(dst.link[0], NULL, "m", &bytes, &complete, &err) == MOE_OK);
    CHECKF(bytes == 0 && !complete, "a refused slice wrote %llu bytes", (unsigned long long)bytes);
    side_close(&src);
    side_close(&dst);
}

/* Which caches a GPU backend takes (moe_kv_cache_alloc's rule, checked here
 * through a CPU backend that says it is CUDA): bf16 for standard attention,
 * f32 only for latent (MLA) attention, refused by name. */
static void test_gpu_kv_dtypes(void)
{
    struct moe_backend gpu = *be;
    gpu.name = "cuda";
    gpu.device = MOE_DEVICE_CUDA;
    struct moe_kv_cache *kv = NULL;
    struct moe_error err = {0};
    CHECK(moe_kv_cache_alloc(&gpu, 1, 2, 4, 64, false, MOE_DTYPE_BF16, &kv, &err) == MOE_OK);
    CHECK(kv && kv->dtype == MOE_DTYPE_BF16);
    moe_kv_cache_release(&gpu, kv);
    kv = NULL;
    CHECK(moe_kv_cache_alloc(&gpu, 1, 2, 4, 64, true, MOE_DTYPE_BF16, &kv, &err) ==
          MOE_ERR_UNSUPPORTED);
    CHECKF(kv == NULL && strstr(err.msg, "latent") && strstr(err.msg, "--kv-dtype f32"),
           "latent bf16 on a GPU backend: %s", err.msg);
    CHECK(moe_kv_cache_alloc(&gpu, 1, 2, 4, 64, true, MOE_DTYPE_F32, &kv, &err) == MOE_OK);
    moe_kv_cache_release(&gpu, kv);
}

static void run_all(void)
{
    test_reslice(1, 4, 1, 4);
    test_reslice(2, 4, 1, 8); /* two senders fill one receiver's halves */
    test_reslice(1, 16, 2, 3);
    test_reslice(2, 5, 4, 2); /* each sender feeds two receivers */
    test_reslice(4, 1, 2, 7);
    /* latent caches: the whole row to every receiver, from one sender each */
    g_latent = true;
    test_reslice(1, 4, 1, 4);
    test_reslice(1, 16, 2, 3); /* one sender, both receivers */
    test_reslice(2, 5, 4, 2);  /* receiver i from sender i % 2 */
    test_reslice(4, 1, 2, 7);  /* senders 2 and 3 send nothing */
    g_latent = false;
    test_refusals();
    /* BF16 caches (standard attention; CUDA too since its kernels read them) */
    g_dt = MOE_DTYPE_BF16;
    test_reslice(1, 4, 1, 4);
    test_reslice(2, 5, 4, 2);
    g_dt = MOE_DTYPE_F32;
    test_dtype_mismatch();
    if (be->device == MOE_DEVICE_CPU)
        test_gpu_kv_dtypes();
}

int main(void)
{
    struct moe_error err = {0};
    if (moe_backend_create("cpu", 1, &be, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    test_wire();
    test_wire_server();
    run_all();
    moe_backend_destroy(be);
    /* The same on device memory (slices staged through host buffers). */
    if (moe_backend_create("cuda", 1, &be, &err) == MOE_OK) {
        printf("cuda: the same cases on device caches\n");
        run_all();
        moe_backend_destroy(be);
    } else {
        printf("cuda: skipped (%s)\n", err.msg);
    }
    return test_summary();
}
