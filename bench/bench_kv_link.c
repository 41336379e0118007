/* The KV data plane's bandwidth on this machine: one handoff of a prompt's KV
 * (the benchmark shape: 8 layers, 4 KV heads x 64, f32) pushed over loopback
 * between KV links in one process, for several TP / block-size pairings,
 * against a plain memcpy of the same bytes measured in the same run.
 *
 *   bench-kv-link [TOKENS] [ROUNDS]      (defaults 2048, 5; medians printed)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "engine/generate.h" /* moe_now */
#include "disagg/kv_link.h"

enum { N_LAYER = 8, N_HEAD = 4, D_HEAD = 64 };

static struct moe_backend *be;

static struct moe_kv_cache *cache_new(int n_block, int block_size, int heads)
{
    struct moe_kv_cache *kv = NULL;
    struct moe_error err = {0};
    if (moe_kv_cache_alloc(be, N_LAYER, n_block, block_size, heads * D_HEAD, false, MOE_DTYPE_F32,
                           &kv, &err)) {
        fprintf(stderr, "bench-kv-link: %s\n", err.msg);
        exit(1);
    }
    size_t n = (size_t)n_block * block_size * kv->kv_dim;
    for (int l = 0; l < N_LAYER; l++)
        for (size_t i = 0; i < n; i += 97)
            ((float *)kv->k[l])[i] = ((float *)kv->v[l])[i] = (float)i;
    return kv;
}

struct side {
    int tp;
    struct kv_link *link[4];
    struct moe_kv_cache *kv[4];
    struct kv_link_target t[4];
    int32_t *blocks;
    int n_blocks, bs;
};

static int side_open(struct side *s, int tp, int bs, int n_tok)
{
    struct moe_error err = {0};
    s->tp = tp;
    s->bs = bs;
    s->n_blocks = (n_tok + bs - 1) / bs;
    s->blocks = malloc((size_t)s->n_blocks * sizeof *s->blocks);
    for (int i = 0; i < s->n_blocks; i++) /* scattered, as a busy pool hands them out */
        s->blocks[i] = (int32_t)((i * 7) % s->n_blocks);
    for (int r = 0; r < tp; r++) {
        struct kv_link_opts o = {.be = be,
                                 .listen = "127.0.0.1:0",
                                 .layout = {.n_layer = N_LAYER,
                                            .n_kv_head = N_HEAD,
                                            .d_head = D_HEAD,
                                            .tp_size = tp,
                                            .tp_rank = r},
                                 .io_timeout_ms = 10000};
        if (kv_link_create(&o, &s->link[r], &err)) {
            fprintf(stderr, "bench-kv-link: %s\n", err.msg);
            return 1;
        }
        s->kv[r] = cache_new(s->n_blocks, bs, N_HEAD / tp);
        kv_link_attach_kv(s->link[r], s->kv[r]);
        snprintf(s->t[r].endpoint, KV_LINK_ENDPOINT_MAX, "%s", kv_link_endpoint(s->link[r]));
        kv_link_heads(N_HEAD, tp, r, &s->t[r].head_begin, &s->t[r].head_end);
    }
    return 0;
}

static void side_close(struct side *s)
{
    for (int r = 0; r < s->tp; r++) {
        kv_link_destroy(s->link[r]);
        moe_kv_cache_release(be, s->kv[r]);
    }
    free(s->blocks);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median seconds of one whole handoff (expect on every receiver, every
 * sender pushes in parallel by order, forget on every receiver). */
static double handoff_s(int src_tp, int src_bs, int dst_tp, int dst_bs, int n_tok, int rounds,
                        uint64_t *bytes_out)
{
    struct side src = {0}, dst = {0};
    if (side_open(&src, src_tp, src_bs, n_tok) || side_open(&dst, dst_tp, dst_bs, n_tok))
        exit(1);
    double t[64];
    for (int k = 0; k < rounds && k < 64; k++) {
        struct moe_error err = {0};
        char id[32];
        snprintf(id, sizeof id, "h%d", k);
        double t0 = moe_now();
        for (int r = 0; r < dst_tp; r++)
            kv_link_expect(dst.link[0], r ? dst.t[r].endpoint : NULL, id, dst.blocks, dst.n_blocks,
                           n_tok, 10000, &err);
        struct kv_link_push p = {.id = id,
                                 .src_blocks = src.blocks,
                                 .n_src_blocks = src.n_blocks,
                                 .n_tokens = n_tok,
                                 .dst_blocks = dst.blocks,
                                 .n_dst_blocks = dst.n_blocks,
                                 .dst_block_size = dst_bs,
                                 .targets = dst.t,
                                 .n_targets = dst_tp,
                                 .deadline_ms = 10000};
        struct kv_link_order *orders[4] = {0};
        for (int r = 1; r < src_tp; r++)
            kv_link_order_start(src.link[0], src.t[r].endpoint, &p, &orders[r], &err);
        uint64_t sent = 0, mine = 0;
        if (kv_link_push(src.link[0], &p, &mine, &err)) {
            fprintf(stderr, "bench-kv-link: %s\n", err.msg);
            exit(1);
        }
        sent += mine;
        for (int r = 1; r < src_tp; r++) {
            uint64_t theirs = 0;
            if (kv_link_order_wait(orders[r], &theirs, &err)) {
                fprintf(stderr, "bench-kv-link: %s\n", err.msg);
                exit(1);
            }
            sent += theirs;
        }
        bool all = true;
        for (int r = 0; r < dst_tp; r++) {
            uint64_t b;
            bool complete = false;
            kv_link_forget(dst.link[0], r ? dst.t[r].endpoint : NULL, id, &b, &complete, &err);
            all = all && complete;
        }
        t[k] = moe_now() - t0;
        if (!all) {
            fprintf(stderr, "bench-kv-link: handoff %s incomplete\n", id);
            exit(1);
        }
        *bytes_out = sent;
    }
    side_close(&src);
    side_close(&dst);
    qsort(t, (size_t)rounds, sizeof *t, cmp_double);
    return t[rounds / 2];
}

int main(int argc, char **argv)
{
    int n_tok = argc > 1 ? atoi(argv[1]) : 2048;
    int rounds = argc > 2 ? atoi(argv[2]) : 5;
    if (n_tok < 1 || rounds < 1 || rounds > 64) {
        fprintf(stderr, "usage: bench-kv-link [TOKENS >= 1] [ROUNDS 1..64]\n");
        return 2;
    }
    struct moe_error err = {0};
    if (moe_backend_create("cpu", 1, &be, &err)) {
        fprintf(stderr, "bench-kv-link: %s\n", err.msg);
        return 1;
    }
    size_t bytes = (size_t)N_LAYER * 2 * n_tok * N_HEAD * D_HEAD * sizeof(float);
    /* baseline: one memcpy of the same bytes (the copy a handoff cannot avoid) */
    char *a = malloc(bytes), *b = malloc(bytes);
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    double mt[64];
    for (int k = 0; k < rounds; k++) {
        double t0 = moe_now();
        memcpy(b, a, bytes);
        mt[k] = moe_now() - t0;
        a[k] = b[bytes - 1 - k]; /* keep the copies alive */
    }
    qsort(mt, (size_t)rounds, sizeof *mt, cmp_double);
    double base = (double)bytes / mt[rounds / 2] / (1 << 20);
    free(a);
    free(b);
    printf("KV of %d tokens (%d layers x %d KV heads x %d, f32): %.1f MiB per handoff\n", n_tok,
           N_LAYER, N_HEAD, D_HEAD, (double)bytes / (1 << 20));
    printf("memcpy of the same bytes: %.0f MiB/s (baseline)\n", base);
    const int cases[][4] = {{1, 16, 1, 16}, {1, 16, 1, 8}, {2, 16, 1, 16},
                            {1, 16, 2, 16}, {2, 16, 2, 4}, {4, 16, 2, 16}};
    printf("%-28s %10s %10s %8s\n", "sender -> receiver", "ms", "MiB/s", "x memcpy");
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        uint64_t sent = 0;
        double s =
            handoff_s(cases[i][0], cases[i][1], cases[i][2], cases[i][3], n_tok, rounds, &sent);
        char name[64];
        snprintf(name, sizeof name, "tp %d bs %d -> tp %d bs %d", cases[i][0], cases[i][1],
                 cases[i][2], cases[i][3]);
        double mibs = (double)sent / s / (1 << 20);
        printf("%-28s %10.2f %10.0f %8.2f\n", name, s * 1e3, mibs, mibs / base);
    }
    moe_backend_destroy(be);
    return 0;
}
