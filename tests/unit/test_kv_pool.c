/* The KV block pool: allocation, references, prefix-cache publish / lookup /
 * eviction, a pool in parts (data-parallel attention), and a seeded random
 * workload, in one part and in four, checked against a shadow model of who
 * holds which block. */
#include <stdlib.h>
#include <string.h>

#include "kv/kv_pool.h"
#include "testlib.h"

#define BS 4

static void test_basics(void)
{
    struct kv_pool *p = NULL;
    struct moe_error err = {0};
    CHECK(kv_pool_create(0, BS, &p, &err) == MOE_ERR_INVALID && p == NULL);
    CHECK(kv_pool_create(3, BS, &p, &err) == MOE_OK);
    CHECK(kv_pool_available(p) == 3);
    int32_t a = kv_pool_alloc(p), b = kv_pool_alloc(p), c = kv_pool_alloc(p);
    CHECK(a >= 0 && b >= 0 && c >= 0 && a != b && b != c && a != c);
    CHECK(kv_pool_alloc(p) == -1);
    CHECK(kv_pool_available(p) == 0);

    int32_t toks[BS] = {5, 6, 7, 8};
    uint64_t h = kv_pool_hash(0, toks, BS);
    CHECK(kv_pool_publish(p, a, h, 0, toks));
    CHECK(!kv_pool_publish(p, b, h, 0, toks)); /* same content already indexed */
    kv_pool_release(p, a);                     /* -> cached, still findable */
    struct kv_pool_stats st;
    kv_pool_stats(p, &st);
    CHECK(st.n_cached == 1 && st.n_free == 0 && st.n_used == 2);
    CHECK(kv_pool_lookup(p, h, 0, toks) == a);
    CHECK(kv_pool_refcount(p, a) == 1);
    int32_t other[BS] = {5, 6, 7, 9};
    CHECK(kv_pool_lookup(p, h, 0, other) == -1); /* same hash, other tokens: no hit */
    CHECK(kv_pool_lookup(p, h, 7, toks) == -1);  /* other parent: no hit */
    kv_pool_ref(p, a);
    CHECK(kv_pool_refcount(p, a) == 2);
    kv_pool_release(p, a);
    kv_pool_release(p, a);
    kv_pool_release(p, b);
    kv_pool_release(p, c);
    kv_pool_stats(p, &st);
    CHECK(st.n_free == 2 && st.n_cached == 1);
    /* Exhaust the free list: the cached block is evicted last and loses its hash. */
    int32_t x = kv_pool_alloc(p), y = kv_pool_alloc(p), z = kv_pool_alloc(p);
    CHECK(z == a && x != a && y != a);
    kv_pool_stats(p, &st);
    CHECK(st.evictions == 1);
    CHECK(kv_pool_lookup(p, h, 0, toks) == -1);
    kv_pool_release(p, x);
    kv_pool_release(p, y);
    kv_pool_release(p, z);
    CHECKF(kv_pool_check(p, NULL, &err) == MOE_OK, "%s", err.msg);
    kv_pool_stats(p, &st);
    CHECK(st.n_free == 3 && st.n_cached == 0);
    kv_pool_destroy(p);
    kv_pool_destroy(NULL);
}

/* A pool of 8 blocks in 2 parts: each part allocates, evicts and finds
 * prefixes only among its own blocks. */
static void test_parts(void)
{
    struct kv_pool *p = NULL;
    struct moe_error err = {0};
    CHECK(kv_pool_create_parts(8, BS, 3, &p, &err) == MOE_ERR_INVALID && p == NULL);
    CHECK(strstr(err.msg, "8 blocks cannot be split into 3 equal parts") != NULL);
    CHECK(kv_pool_create_parts(8, BS, 2, &p, &err) == MOE_OK);
    CHECK(kv_pool_n_part(p) == 2 && kv_pool_part_of(p, 3) == 0 && kv_pool_part_of(p, 4) == 1);
    int32_t a[4];
    for (int i = 0; i < 4; i++) {
        a[i] = kv_pool_alloc_in(p, 0);
        CHECK(a[i] >= 0 && a[i] < 4);
    }
    CHECK(kv_pool_alloc_in(p, 0) == -1); /* part 0 is full, part 1 is not */
    CHECK(kv_pool_available_in(p, 0) == 0 && kv_pool_available_in(p, 1) == 4);
    CHECK(kv_pool_available(p) == 4 && kv_pool_free_count_in(p, 1) == 4);
    int32_t b = kv_pool_alloc(p); /* the part with the most free blocks */
    CHECK(b >= 4 && b < 8);
    /* a prefix published in part 0 (seed 0) is not found from part 1 */
    int32_t toks[BS] = {5, 6, 7, 8};
    uint64_t s0 = kv_pool_part_seed(0), s1 = kv_pool_part_seed(1);
    CHECK(s0 == 0 && s1 != 0 && s1 != kv_pool_part_seed(2));
    uint64_t h0 = kv_pool_hash(s0, toks, BS), h1 = kv_pool_hash(s1, toks, BS);
    CHECK(kv_pool_publish(p, a[0], h0, s0, toks));
    CHECK(kv_pool_publish(p, b, h1, s1, toks)); /* the same tokens in part 1: its own block */
    CHECK(kv_pool_contains(p, h0, s0, toks) && kv_pool_contains(p, h1, s1, toks));
    kv_pool_release(p, a[0]);
    kv_pool_release(p, b);
    CHECK(kv_pool_lookup(p, h1, s1, toks) == b);
    kv_pool_release(p, b);
    /* part 1 runs dry: its cached block is evicted, part 0's is kept */
    int32_t c[4];
    for (int i = 0; i < 4; i++)
        CHECK((c[i] = kv_pool_alloc_in(p, 1)) >= 4);
    CHECK(kv_pool_alloc_in(p, 1) == -1);
    CHECK(kv_pool_lookup(p, h1, s1, toks) == -1);
    CHECK(kv_pool_lookup(p, h0, s0, toks) == a[0]);
    CHECKF(kv_pool_check(p, NULL, &err) == MOE_OK, "%s", err.msg);
    for (int i = 0; i < 4; i++) {
        kv_pool_release(p, a[i]);
        kv_pool_release(p, c[i]);
    }
    struct kv_pool_stats st;
    kv_pool_stats(p, &st);
    CHECK(st.n_used == 0 && st.n_free + st.n_cached == 8 && st.n_cached == 1);
    CHECKF(kv_pool_check(p, NULL, &err) == MOE_OK, "%s", err.msg);
    kv_pool_destroy(p);
}

/* Random workload: holders take blocks by alloc or lookup, publish some, drop
 * them in random order; the pool's refcounts must match the shadow counts at
 * every check and the pool must be whole at the end. With parts, every
 * holder works in a random part, chaining from its seed, and must only ever
 * get blocks of that part. */
static void test_random(int n_part)
{
    enum { N_BLOCK = 64, N_HOLD = 4096, STEPS = 20000 };
    struct kv_pool *p = NULL;
    struct moe_error err = {0};
    CHECK(kv_pool_create_parts(N_BLOCK, BS, n_part, &p, &err) == MOE_OK);
    int refs[N_BLOCK] = {0};
    static int32_t held[N_HOLD];
    int n_held = 0, failures = 0, wrong_part = 0;
    unsigned seed = 12345;
    for (int step = 0; step < STEPS; step++) {
        int op = rand_r(&seed) % 10, part = rand_r(&seed) % n_part;
        uint64_t ps = kv_pool_part_seed(part);
        if (op < 4 && n_held < N_HOLD) { /* allocate */
            int32_t b = kv_pool_alloc_in(p, part);
            if (b >= 0) {
                wrong_part += kv_pool_part_of(p, b) != part;
                refs[b]++;
                held[n_held++] = b;
                if (rand_r(&seed) % 2) { /* publish one of 8 possible contents */
                    int32_t t[BS] = {rand_r(&seed) % 8, 1, 2, 3};
                    kv_pool_publish(p, b, kv_pool_hash(ps, t, BS), ps, t);
                }
            }
        } else if (op < 6 && n_held < N_HOLD) { /* prefix hit */
            int32_t t[BS] = {rand_r(&seed) % 8, 1, 2, 3};
            int32_t b = kv_pool_lookup(p, kv_pool_hash(ps, t, BS), ps, t);
            if (b >= 0) {
                wrong_part += kv_pool_part_of(p, b) != part;
                refs[b]++;
                held[n_held++] = b;
            }
        } else if (n_held > 0) { /* release a random holder */
            int i = rand_r(&seed) % n_held;
            int32_t b = held[i];
            held[i] = held[--n_held];
            refs[b]--;
            kv_pool_release(p, b);
        }
        if (step % 997 == 0 && kv_pool_check(p, refs, &err) != MOE_OK) {
            failures++;
            fprintf(stderr, "step %d: %s\n", step, err.msg);
        }
    }
    while (n_held > 0) {
        int32_t b = held[--n_held];
        refs[b]--;
        kv_pool_release(p, b);
    }
    CHECK(failures == 0);
    CHECK(wrong_part == 0);
    CHECKF(kv_pool_check(p, refs, &err) == MOE_OK, "%s", err.msg);
    struct kv_pool_stats st;
    kv_pool_stats(p, &st);
    CHECK(st.n_used == 0 && st.n_free + st.n_cached == N_BLOCK);
    CHECK(st.hits > 0 && st.evictions > 0);
    printf("random, %d part(s): %lld lookups, %lld hits, %lld evictions\n", n_part,
           (long long)st.lookups, (long long)st.hits, (long long)st.evictions);
    kv_pool_destroy(p);
}

int main(void)
{
    test_basics();
    test_parts();
    test_random(1);
    test_random(4);
    return test_summary();
}
