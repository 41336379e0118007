/* Every communicator operation against a reference computed locally, under
 * mpirun with W ranks (W = 1, 2, 4 in CTest). With W = 1 the same suite also
 * runs on the local backend, which must behave like MPI with one rank.
 *
 * Data is a function of (source rank, destination rank, byte index), so every
 * rank can compute what it must receive without asking anyone. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "testlib.h"
#include "clock.h"

#define MIB ((size_t)1 << 20)

static struct moe_error err;

static unsigned char pattern(int src, int dst, size_t i)
{
    return (unsigned char)(src * 131 + dst * 31 + i * 7 + (i >> 9));
}

static void fill(unsigned char *p, size_t n, int src, int dst)
{
    for (size_t i = 0; i < n; i++)
        p[i] = pattern(src, dst, i);
}

/* Index of the first byte that differs from the pattern, or n. */
static size_t first_bad(const unsigned char *p, size_t n, int src, int dst)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != pattern(src, dst, i))
            return i;
    return n;
}

static uint64_t fnv1a(const void *data, size_t n)
{
    const unsigned char *p = data;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static float rank_value(int r, size_t i)
{
    return sinf(0.37f * (float)r + 0.001f * (float)i) * (1.0f + 0.5f * (float)r);
}

static void test_all_reduce(struct moe_comm *c)
{
    static const size_t sizes[] = {0, 1, 3, 1000, 65537, MIB}; /* floats: up to 4 MiB */
    int w = c->size, me = c->rank;
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        size_t n = sizes[s];
        float *buf = malloc((n + 1) * sizeof(float));
        float *ref = malloc((n + 1) * sizeof(float));
        /* Small integers: exact in any summation order. */
        for (size_t i = 0; i < n; i++)
            buf[i] = (float)((me + 1) * (int)(i % 97));
        enum moe_status st = moe_comm_all_reduce_sum(c, buf, n, &err);
        CHECKF(st == MOE_OK, "rank %d: %s", me, err.msg);
        size_t bad = n;
        for (size_t i = 0; i < n && bad == n; i++)
            if (buf[i] != (float)((int)(i % 97) * w * (w + 1) / 2))
                bad = i;
        CHECKF(bad == n, "rank %d: all_reduce n=%zu: exact sum wrong at %zu", me, n, bad);

        /* Real values: reference summed over ranks in rank order. */
        double max_err = 0;
        for (size_t i = 0; i < n; i++) {
            buf[i] = rank_value(me, i);
            float r = 0;
            for (int k = 0; k < w; k++)
                r += rank_value(k, i);
            ref[i] = r;
        }
        st = moe_comm_all_reduce_sum(c, buf, n, &err);
        CHECKF(st == MOE_OK, "rank %d: %s", me, err.msg);
        for (size_t i = 0; i < n; i++) {
            double e = fabs((double)buf[i] - ref[i]) / (1.0 + fabs(ref[i]));
            max_err = e > max_err ? e : max_err;
        }
        CHECKF(max_err < 1e-5, "rank %d: all_reduce n=%zu: relative error %g", me, n, max_err);

        /* Every rank must hold bit-identical sums (TP ranks stay in step). */
        uint64_t h = fnv1a(buf, n * sizeof(float));
        uint64_t *all = malloc((size_t)w * sizeof(*all));
        st = moe_comm_all_gather(c, &h, all, sizeof(h), &err);
        CHECKF(st == MOE_OK, "rank %d: %s", me, err.msg);
        for (int k = 0; k < w; k++)
            CHECKF(all[k] == h, "rank %d: all_reduce n=%zu: rank %d holds different bits", me, n,
                   k);
        free(all);
        free(buf);
        free(ref);
    }
}

static void test_all_gather(struct moe_comm *c)
{
    static const size_t sizes[] = {0, 1, 7, 4096, 65537, 4 * MIB};
    int w = c->size, me = c->rank;
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        size_t n = sizes[s];
        unsigned char *send = malloc(n + 1);
        unsigned char *recv = malloc((size_t)w * n + 1);
        fill(send, n, me, 0);
        memset(recv, 0xee, (size_t)w * n + 1);
        enum moe_status st = moe_comm_all_gather(c, send, recv, n, &err);
        CHECKF(st == MOE_OK, "rank %d: %s", me, err.msg);
        for (int r = 0; r < w; r++) {
            size_t bad = first_bad(recv + (size_t)r * n, n, r, 0);
            CHECKF(bad == n, "rank %d: all_gather n=%zu: block of rank %d wrong at %zu", me, n, r,
                   bad);
        }
        CHECK(recv[(size_t)w * n] == 0xee); /* nothing past the end */

        /* In place: this rank's block already sits in recv. */
        memset(recv, 0, (size_t)w * n);
        fill(recv + (size_t)me * n, n, me, 1);
        st = moe_comm_all_gather(c, recv + (size_t)me * n, recv, n, &err);
        CHECKF(st == MOE_OK, "rank %d: %s", me, err.msg);
        for (int r = 0; r < w; r++) {
            size_t bad = first_bad(recv + (size_t)r * n, n, r, 1);
            CHECKF(bad == n, "rank %d: in-place all_gather n=%zu: rank %d wrong at %zu", me, n, r,
                   bad);
        }
        free(send);
        free(recv);
    }
}

/* Bytes rank src sends to rank dst: uneven, some pairs zero, and rank 1
 * sends nothing at all. */
static size_t a2a_count(int src, int dst, size_t base)
{
    if (src == 1 || (src + 2 * dst) % 3 == 1)
        return 0;
    return base + (size_t)(13 * src + 7 * dst);
}

enum { A2A_GAP = 5 }; /* bytes between blocks: displacements are not packed */

static void test_all_to_all_v(struct moe_comm *c)
{
    static const size_t bases[] = {0, 1, 1000, 65536, 4 * MIB};
    int w = c->size, me = c->rank;
    size_t *sc = calloc((size_t)w, sizeof(size_t)), *sd = calloc((size_t)w, sizeof(size_t));
    size_t *rc = calloc((size_t)w, sizeof(size_t)), *rd = calloc((size_t)w, sizeof(size_t));
    size_t *rc_got = calloc((size_t)w, sizeof(size_t));
    for (size_t b = 0; b < sizeof(bases) / sizeof(bases[0]); b++) {
        size_t base = bases[b], n_send = 0, n_recv = 0;
        for (int p = 0; p < w; p++) {
            sc[p] = a2a_count(me, p, base);
            sd[p] = n_send;
            n_send += sc[p] + A2A_GAP;
            rc[p] = a2a_count(p, me, base);
            rd[p] = n_recv;
            n_recv += rc[p] + A2A_GAP;
        }
        /* The count exchange must give what every peer computes for us. */
        enum moe_status st = moe_comm_all_to_all_counts(c, sc, rc_got, &err);
        CHECKF(st == MOE_OK, "rank %d: %s", me, err.msg);
        for (int p = 0; p < w; p++)
            CHECKF(rc_got[p] == rc[p], "rank %d: counts from rank %d: got %zu, want %zu", me, p,
                   rc_got[p], rc[p]);

        unsigned char *send = malloc(n_send);
        unsigned char *recv = malloc(n_recv);
        for (int split = 0; split < 2; split++) { /* whole, then started and finished */
            for (int p = 0; p < w; p++)
                fill(send + sd[p], sc[p], me, p);
            memset(recv, 0xee, n_recv);
            if (!split) {
                st = moe_comm_all_to_all_v(c, send, sc, sd, recv, rc, rd, &err);
            } else {
                st = moe_comm_all_to_all_v_start(c, send, sc, sd, recv, rc, rd, &err);
                CHECKF(st == MOE_OK, "rank %d: start: %s", me, err.msg);
                /* the layer's work while the rows travel; another operation
                 * on the communicator meanwhile is refused, not run */
                struct moe_error busy = {0};
                enum moe_status bst = moe_comm_barrier(c, &busy);
                if (c->ops->all_to_all_v_start)
                    CHECKF(bst == MOE_ERR_INVALID && strstr(busy.msg, "waiting for its finish"),
                           "rank %d: barrier during a started all_to_all_v: %d %s", me, bst,
                           busy.msg);
                else
                    CHECKF(bst == MOE_OK, "rank %d: %s", me, busy.msg);
                st = moe_comm_all_to_all_v_finish(c, &err);
            }
            CHECKF(st == MOE_OK, "rank %d: %s", me, err.msg);
            for (int p = 0; p < w; p++) {
                size_t bad = first_bad(recv + rd[p], rc[p], p, me);
                CHECKF(bad == rc[p], "rank %d: all_to_all_v%s base=%zu: from rank %d wrong at %zu",
                       me, split ? " (split)" : "", base, p, bad);
                for (int g = 0; g < A2A_GAP; g++)
                    CHECKF(recv[rd[p] + rc[p] + g] == 0xee, "rank %d: gap after rank %d written",
                           me, p);
            }
        }
        free(send);
        free(recv);
    }
    free(sc);
    free(sd);
    free(rc);
    free(rd);
    free(rc_got);
}

static void test_send_recv(struct moe_comm *c)
{
    static const size_t sizes[] = {0, 1, 7, 4096, 65537, 4 * MIB};
    int w = c->size, me = c->rank;
    unsigned char b = 0;
    /* Self and out-of-range peers are refused without breaking anything. */
    CHECK(moe_comm_send(c, &b, 1, me, &err) == MOE_ERR_INVALID);
    CHECK(moe_comm_recv(c, &b, 1, w, &err) == MOE_ERR_INVALID);
    CHECK(moe_comm_send(c, &b, 1, -1, &err) == MOE_ERR_INVALID);
    CHECK(!c->broken);
    if (w < 2 || w % 2)
        return; /* the ring below pairs even and odd ranks */
    int next = (me + 1) % w, prev = (me + w - 1) % w;
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        size_t n = sizes[s];
        unsigned char *out = malloc(n + 1), *in = malloc(n + 1);
        fill(out, n, me, next);
        memset(in, 0xee, n + 1);
        enum moe_status st1, st2;
        if (me % 2 == 0) {
            st1 = moe_comm_send(c, out, n, next, &err);
            st2 = moe_comm_recv(c, in, n, prev, &err);
        } else {
            st2 = moe_comm_recv(c, in, n, prev, &err);
            st1 = moe_comm_send(c, out, n, next, &err);
        }
        CHECKF(st1 == MOE_OK && st2 == MOE_OK, "rank %d: ring n=%zu: %s", me, n, err.msg);
        size_t bad = first_bad(in, n, prev, me);
        CHECKF(bad == n, "rank %d: ring n=%zu: from rank %d wrong at %zu", me, n, prev, bad);
        CHECK(in[n] == 0xee);
        free(out);
        free(in);
    }
}

static void test_broadcast(struct moe_comm *c)
{
    static const size_t sizes[] = {0, 1, 7, 4096, 65537, 4 * MIB};
    int w = c->size, me = c->rank, root = w - 1; /* non-zero whenever W > 1 */
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        size_t n = sizes[s];
        unsigned char *buf = malloc(n + 1);
        if (me == root)
            fill(buf, n, root, 9);
        else
            memset(buf, 0xee, n);
        enum moe_status st = moe_comm_broadcast(c, buf, n, root, &err);
        CHECKF(st == MOE_OK, "rank %d: %s", me, err.msg);
        size_t bad = first_bad(buf, n, root, 9);
        CHECKF(bad == n, "rank %d: broadcast n=%zu from %d wrong at %zu", me, n, root, bad);
        free(buf);
    }
    CHECK(moe_comm_broadcast(c, NULL, 0, w, &err) == MOE_ERR_INVALID);
    CHECK(moe_comm_barrier(c, &err) == MOE_OK);
}

/* TP groups of 2 (the last group smaller when W is odd), ranks reversed by
 * the key, and an all_reduce and all_gather inside each group. */
static void test_split(struct moe_comm *c)
{
    int w = c->size, me = c->rank;
    int group = me / 2, first = group * 2, g_size = w - first < 2 ? w - first : 2;
    struct moe_comm *tp = NULL;
    enum moe_status st = moe_comm_split(c, group, -me, &tp, &err);
    CHECKF(st == MOE_OK && tp, "rank %d: split: %s", me, err.msg);
    if (!tp)
        return;
    CHECK(tp->size == g_size);
    CHECKF(tp->rank == first + g_size - 1 - me, "rank %d: tp rank %d", me, tp->rank);
    CHECK(strcmp(moe_comm_backend_name(tp), moe_comm_backend_name(c)) == 0);
    float v[3] = {(float)(me + 1), 1.0f, (float)(me * 10)};
    st = moe_comm_all_reduce_sum(tp, v, 3, &err);
    CHECKF(st == MOE_OK, "rank %d: %s", me, err.msg);
    float want0 = 0, want2 = 0;
    for (int r = first; r < first + g_size; r++) {
        want0 += (float)(r + 1);
        want2 += (float)(r * 10);
    }
    CHECKF(v[0] == want0 && v[1] == (float)g_size && v[2] == want2,
           "rank %d: tp all_reduce %g %g %g", me, v[0], v[1], v[2]);
    int ranks[2] = {-1, -1};
    st = moe_comm_all_gather(tp, &me, ranks, sizeof(int), &err);
    CHECKF(st == MOE_OK, "rank %d: %s", me, err.msg);
    for (int k = 0; k < g_size; k++)
        CHECKF(ranks[k] == first + g_size - 1 - k, "rank %d: tp rank %d is world %d", me, k,
               ranks[k]);
    moe_comm_destroy(tp);

    /* The last rank stays out of the second split. */
    struct moe_comm *rest = NULL;
    st = moe_comm_split(c, me == w - 1 ? MOE_COMM_NO_COLOR : 0, me, &rest, &err);
    CHECKF(st == MOE_OK, "rank %d: %s", me, err.msg);
    CHECK((rest == NULL) == (me == w - 1));
    if (rest) {
        CHECK(rest->size == w - 1 && rest->rank == me);
        CHECK(moe_comm_barrier(rest, &err) == MOE_OK);
    }
    moe_comm_destroy(rest);
    CHECK(moe_comm_split(c, -7, 0, &rest, &err) == MOE_ERR_INVALID);
}

static void run_suite(struct moe_comm *c)
{
    test_all_reduce(c);
    test_all_gather(c);
    test_all_to_all_v(c);
    test_send_recv(c);
    test_broadcast(c);
    test_split(c);
    CHECKF(!c->broken, "rank %d: %s communicator broken by the suite", c->rank,
           moe_comm_backend_name(c));
}

/* Timeouts and protocol errors, on communicators of their own (they end
 * broken). Needs W >= 2. */
static void test_failures(int me, int w)
{
    struct moe_comm *c = NULL;
    enum moe_status st = moe_comm_create_mpi(MPI_COMM_WORLD, 60000, &c, &err);
    CHECKF(st == MOE_OK, "rank %d: %s", me, err.msg);
    if (!c)
        return;
    c->timeout_ms = 300; /* short only for the operation meant to time out */
    if (me == 0) {
        /* Rank 1 never sends on this communicator. */
        char buf[8];
        int64_t t0 = moe_now_ms();
        st = moe_comm_recv(c, buf, sizeof(buf), 1, &err);
        int64_t dt = moe_now_ms() - t0;
        CHECK(st == MOE_ERR_IO);
        CHECKF(strstr(err.msg, "rank 0: recv timed out after 300 ms waiting for rank 1") != NULL,
               "message: %s", err.msg);
        CHECKF(dt >= 300 && dt < 10000, "timeout after %lld ms", (long long)dt);
        CHECK(c->broken);
        st = moe_comm_barrier(c, &err);
        CHECK(st == MOE_ERR_IO && strstr(err.msg, "broken") != NULL);
    }
    moe_comm_destroy(c);

    /* A message of the wrong size. */
    c = NULL;
    st = moe_comm_create_mpi(MPI_COMM_WORLD, 5000, &c, &err);
    CHECKF(st == MOE_OK, "rank %d: %s", me, err.msg);
    if (!c)
        return;
    char msg[16] = {0};
    if (me == 0) {
        CHECK(moe_comm_send(c, msg, 10, 1, &err) == MOE_OK);
    } else if (me == 1) {
        st = moe_comm_recv(c, msg, 12, 0, &err);
        CHECK(st == MOE_ERR_IO);
        CHECKF(strstr(err.msg, "rank 0 sent 10 bytes, expected 12") != NULL, "message: %s",
               err.msg);
    }
    moe_comm_destroy(c);
    MPI_Barrier(MPI_COMM_WORLD);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int me = 0, w = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &w);

    struct moe_comm *c = NULL;
    enum moe_status st = moe_comm_create_mpi(MPI_COMM_WORLD, 60000, &c, &err);
    CHECKF(st == MOE_OK, "rank %d: %s", me, err.msg);
    if (c) {
        CHECK(c->rank == me && c->size == w);
        CHECK(strcmp(moe_comm_backend_name(c), "mpi") == 0);
        run_suite(c);
        moe_comm_destroy(c);
    }
    if (w == 1) {
        struct moe_comm *local = NULL;
        st = moe_comm_create_local(&local, &err);
        CHECK(st == MOE_OK && local && local->rank == 0 && local->size == 1);
        if (local)
            run_suite(local);
        moe_comm_destroy(local);
    } else {
        test_failures(me, w);
    }
    moe_comm_destroy(NULL);
    CHECK(moe_comm_barrier(NULL, &err) == MOE_ERR_INVALID);

    MPI_Finalize();
    if (test_n_fail)
        fprintf(stderr, "rank %d: FAILED\n", me);
    return test_summary();
}
