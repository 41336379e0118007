/* The KV data plane (worker/disagg/kv_link.c) on synthetic caches, in one process
 * over loopback TCP: slices re-sliced across TP sizes and re-blocked across
 * block sizes arrive bit-exact; refusals name what is wrong and write
 * nothing; FORGET reports completeness; orders push from another rank;
 * expectations expire. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "disagg/kv_link.h"
#include "testlib.h"

enum { N_LAYER = 3, N_HEAD = 4, D_HEAD = 8, N_TOK = 23, N_BLOCK = 32 };

static struct moe_backend *be; /* the backend under test: CPU, then CUDA where a GPU is */

static size_t layer_floats(const struct moe_kv_cache *kv)
{
    return (size_t)kv->n_block * kv->block_size * kv->kv_dim;
}

/* One layer's K or V between the cache (backend memory) and host memory. */
static void layer_io(struct moe_kv_cache *kv, int l, int kind, float *host, bool down)
{
    float *dev = kind ? kv->v[l] : kv->k[l];
    size_t bytes = layer_floats(kv) * sizeof(float);
    if (down)
        be->ops->buf_download(be, host, dev, bytes);
    else
        be->ops->buf_upload(be, dev, host, bytes);
}

/* A cache holding heads [hb, he) of the model, NaN-filled (unwritten = NaN). */
static struct moe_kv_cache *cache_new(int block_size, int hb, int he)
{
    struct moe_kv_cache *kv = NULL;
    struct moe_error err = {0};
    if (moe_kv_cache_alloc(be, N_LAYER, N_BLOCK, block_size, (he - hb) * D_HEAD, &kv, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        exit(1);
    }
    float *host = malloc(layer_floats(kv) * sizeof *host);
    for (size_t i = 0; i < layer_floats(kv); i++)
        host[i] = 0.0f / 0.0f;
    for (int l = 0; l < N_LAYER; l++)
        for (int kind = 0; kind < 2; kind++)
            layer_io(kv, l, kind, host, false);
    free(host);
    return kv;
}

/* The value of (layer, K or V, token, head, dim): distinct everywhere. */
static float value(int l, int kind, int t, int h, int d)
{
    return (float)(((l * 2 + kind) * 1000 + t) * 100 + h * 10 + d) + 0.25f;
}

/* Where (token t, head h) lives in a host copy of one layer. */
static float *at(const struct moe_kv_cache *kv, float *layer, const int32_t *blocks, int t, int h,
                 int hb)
{
    size_t slot = (size_t)blocks[t / kv->block_size] * kv->block_size + t % kv->block_size;
    return layer + slot * kv->kv_dim + (size_t)(h - hb) * D_HEAD;
}

static void fill(struct moe_kv_cache *kv, const int32_t *blocks, int hb, int he)
{
    float *host = malloc(layer_floats(kv) * sizeof *host);
    for (int l = 0; l < N_LAYER; l++)
        for (int kind = 0; kind < 2; kind++) {
            layer_io(kv, l, kind, host, true);
            for (int t = 0; t < N_TOK; t++)
                for (int h = hb; h < he; h++)
                    for (int d = 0; d < D_HEAD; d++)
                        at(kv, host, blocks, t, h, hb)[d] = value(l, kind, t, h, d);
            layer_io(kv, l, kind, host, false);
        }
    free(host);
}

/* Number of (layer, kind, token, head, dim) values that differ. */
static long mismatches(struct moe_kv_cache *kv, const int32_t *blocks, int hb, int he)
{
    long bad = 0;
    float *host = malloc(layer_floats(kv) * sizeof *host);
    for (int l = 0; l < N_LAYER; l++)
        for (int kind = 0; kind < 2; kind++) {
            layer_io(kv, l, kind, host, true);
            for (int t = 0; t < N_TOK; t++)
                for (int h = hb; h < he; h++)
                    for (int d = 0; d < D_HEAD; d++)
                        bad += at(kv, host, blocks, t, h, hb)[d] != value(l, kind, t, h, d);
        }
    free(host);
    return bad;
}

struct side {
    int tp, bs;
    struct kvl *link[4];
    struct moe_kv_cache *kv[4];
    struct kvl_target targets[4];
};

static void side_open(struct side *s, int tp, int bs)
{
    struct moe_error err = {0};
    s->tp = tp;
    s->bs = bs;
    for (int r = 0; r < tp; r++) {
        struct kvl_opts o = {.be = be,
                             .listen = "127.0.0.1:0",
                             .layout = {N_LAYER, N_HEAD, D_HEAD, tp, r},
                             .io_timeout_ms = 2000};
        CHECKF(kvl_create(&o, &s->link[r], &err) == MOE_OK, "%s", err.msg);
        int hb, he;
        kvl_heads(N_HEAD, tp, r, &hb, &he);
        s->kv[r] = cache_new(bs, hb, he);
        kvl_attach_kv(s->link[r], s->kv[r]);
        snprintf(s->targets[r].endpoint, KVL_ENDPOINT_MAX, "%s", kvl_endpoint(s->link[r]));
        s->targets[r].head_begin = hb;
        s->targets[r].head_end = he;
    }
}

static void side_close(struct side *s)
{
    for (int r = 0; r < s->tp; r++) {
        kvl_destroy(s->link[r]);
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
        fill(src.kv[r], sb, src.targets[r].head_begin, src.targets[r].head_end);
    /* the decode leader (rank 0 here) tells every rank, remote ones by TCP */
    for (int r = 0; r < dst_tp; r++)
        CHECKF(kvl_expect(dst.link[0], r ? dst.targets[r].endpoint : NULL, "h1", db, n_db, N_TOK,
                          5000, &err) == MOE_OK,
               "expect on rank %d: %s", r, err.msg);
    struct kvl_push p = {.id = "h1",
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
    struct kvl_order *orders[4] = {0};
    for (int r = 1; r < src_tp; r++)
        CHECK(kvl_order_start(src.link[0], src.targets[r].endpoint, &p, &orders[r], &err) ==
              MOE_OK);
    uint64_t sent = 0, mine = 0;
    CHECKF(kvl_push(src.link[0], &p, &mine, &err) == MOE_OK, "push: %s", err.msg);
    sent += mine;
    for (int r = 1; r < src_tp; r++) {
        uint64_t theirs = 0;
        CHECKF(kvl_order_wait(orders[r], &theirs, &err) == MOE_OK, "order to rank %d: %s", r,
               err.msg);
        sent += theirs;
    }
    uint64_t want = (uint64_t)N_LAYER * 2 * N_TOK * N_HEAD * D_HEAD * sizeof(float);
    CHECKF(sent == want, "tp %d -> %d: %llu bytes sent, %llu expected", src_tp, dst_tp,
           (unsigned long long)sent, (unsigned long long)want);
    uint64_t got = 0;
    for (int r = 0; r < dst_tp; r++) {
        uint64_t b = 0;
        bool complete = false;
        CHECK(kvl_forget(dst.link[0], r ? dst.targets[r].endpoint : NULL, "h1", &b, &complete,
                         &err) == MOE_OK);
        CHECKF(complete, "tp %d -> %d: rank %d incomplete", src_tp, dst_tp, r);
        got += b;
        long bad = mismatches(dst.kv[r], db, dst.targets[r].head_begin, dst.targets[r].head_end);
        CHECKF(bad == 0, "tp %d bs %d -> tp %d bs %d: rank %d has %ld wrong values", src_tp, src_bs,
               dst_tp, dst_bs, r, bad);
    }
    CHECK(got == sent);
    /* forgotten: a second push is refused before any byte is written */
    mine = 0;
    CHECK(kvl_push(src.link[0], &p, &mine, &err) != MOE_OK && strstr(err.msg, "not expected"));
    side_close(&src);
    side_close(&dst);
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
    struct kvl_push p = {.id = "x",
                         .src_blocks = sb,
                         .n_src_blocks = 6,
                         .n_tokens = N_TOK,
                         .dst_blocks = db,
                         .n_dst_blocks = 6,
                         .dst_block_size = 4,
                         .targets = dst.targets,
                         .n_targets = 1,
                         .deadline_ms = 3000};
    uint64_t bytes = 0;
    CHECKF(kvl_push(src.link[0], &p, &bytes, &err) != MOE_OK && strstr(err.msg, "not expected"),
           "unknown handoff: %s", err.msg);
    CHECK(kvl_expect(dst.link[0], NULL, "x", db, 6, N_TOK, 3000, &err) == MOE_OK);
    CHECK(kvl_expect(dst.link[0], NULL, "x", db, 6, N_TOK, 3000, &err) != MOE_OK &&
          strstr(err.msg, "already expected"));
    int32_t wrong[8];
    memcpy(wrong, db, sizeof wrong);
    wrong[2] = 31;
    p.dst_blocks = wrong;
    CHECKF(kvl_push(src.link[0], &p, &bytes, &err) != MOE_OK && strstr(err.msg, "reserved"),
           "wrong blocks: %s", err.msg);
    p.dst_blocks = db;
    struct kvl_target t = dst.targets[0];
    t.head_end = N_HEAD + 2; /* a receiver that claims heads it does not hold */
    p.targets = &t;
    CHECKF(kvl_push(src.link[0], &p, &bytes, &err) == MOE_OK, "overlap is clipped: %s", err.msg);
    uint64_t clipped = bytes;
    p.targets = dst.targets;
    /* a model with another layout on the other side */
    other.tp = 1;
    struct kvl_opts o = {
        .be = be, .listen = "127.0.0.1:0", .layout = {N_LAYER + 1, N_HEAD, D_HEAD, 1, 0}};
    CHECK(kvl_create(&o, &other.link[0], &err) == MOE_OK);
    other.kv[0] = cache_new(4, 0, N_HEAD);
    kvl_attach_kv(other.link[0], other.kv[0]);
    CHECK(kvl_expect(other.link[0], NULL, "x", db, 6, N_TOK, 3000, &err) == MOE_OK);
    snprintf(t.endpoint, sizeof t.endpoint, "%s", kvl_endpoint(other.link[0]));
    t.head_end = N_HEAD;
    p.targets = &t;
    CHECKF(kvl_push(src.link[0], &p, &bytes, &err) != MOE_OK && strstr(err.msg, "KV layout"),
           "layout: %s", err.msg);
    CHECK(mismatches(other.kv[0], db, 0, N_HEAD) ==
          (long)N_LAYER * 2 * N_TOK * N_HEAD * D_HEAD); /* nothing written */
    p.targets = dst.targets;
    /* a bad endpoint fails fast with its name */
    struct kvl_target nowhere = {.endpoint = "127.0.0.1:1", .head_begin = 0, .head_end = N_HEAD};
    p.targets = &nowhere;
    CHECKF(kvl_push(src.link[0], &p, &bytes, &err) != MOE_OK && strstr(err.msg, "127.0.0.1:1"),
           "unreachable: %s", err.msg);
    p.targets = dst.targets;
    /* the clipped push above delivered everything */
    uint64_t b = 0;
    bool complete = false;
    CHECK(kvl_forget(dst.link[0], NULL, "x", &b, &complete, &err) == MOE_OK);
    CHECKF(complete && b == clipped, "forget: %llu bytes, complete %d", (unsigned long long)b,
           complete);
    CHECK(mismatches(dst.kv[0], db, 0, N_HEAD) == 0);
    /* FORGET of a partial handoff: not complete */
    CHECK(kvl_expect(dst.link[0], NULL, "half", db, 6, N_TOK, 3000, &err) == MOE_OK);
    p.id = "half";
    struct kvl_target halfway = dst.targets[0];
    halfway.head_end = N_HEAD / 2; /* only half of the heads are sent */
    p.targets = &halfway;
    CHECK(kvl_push(src.link[0], &p, &bytes, &err) == MOE_OK);
    CHECK(kvl_forget(dst.link[0], NULL, "half", &b, &complete, &err) == MOE_OK);
    CHECKF(!complete && b == bytes, "half the heads: %llu bytes, complete %d",
           (unsigned long long)b, complete);
    CHECK(kvl_forget(dst.link[0], NULL, "never", &b, &complete, &err) == MOE_OK && !complete &&
          b == 0);
    /* an expectation expires */
    p.id = "short";
    p.targets = dst.targets;
    CHECK(kvl_expect(dst.link[0], dst.targets[0].endpoint, "short", db, 6, N_TOK, 50, &err) ==
          MOE_OK);
    usleep(120 * 1000);
    CHECKF(kvl_push(src.link[0], &p, &bytes, &err) != MOE_OK && strstr(err.msg, "not expected"),
           "expired: %s", err.msg);
    side_close(&src);
    side_close(&dst);
    side_close(&other);
}

static void run_all(void)
{
    test_reslice(1, 4, 1, 4);
    test_reslice(2, 4, 1, 8); /* two senders fill one receiver's halves */
    test_reslice(1, 16, 2, 3);
    test_reslice(2, 5, 4, 2); /* each sender feeds two receivers */
    test_reslice(4, 1, 2, 7);
    test_refusals();
}

int main(void)
{
    struct moe_error err = {0};
    if (moe_backend_create("cpu", 1, &be, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
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
