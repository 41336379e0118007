/* The KV block pool: allocation, references, prefix-cache publish / lookup /
 * eviction, and a seeded random workload checked against a shadow model of
 * who holds which block. */
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

/* Random workload: holders take blocks by alloc or lookup, publish some, drop
 * them in random order; the pool's refcounts must match the shadow counts at
 * every check and the pool must be whole at the end. */
static void test_random(void)
{
    enum { N_BLOCK = 64, N_HOLD = 4096, STEPS = 20000 };
    struct kv_pool *p = NULL;
    struct moe_error err = {0};
    CHECK(kv_pool_create(N_BLOCK, BS, &p, &err) == MOE_OK);
    int refs[N_BLOCK] = {0};
    static int32_t held[N_HOLD];
    int n_held = 0, failures = 0;
    unsigned seed = 12345;
    for (int step = 0; step < STEPS; step++) {
        int op = rand_r(&seed) % 10;
        if (op < 4 && n_held < N_HOLD) { /* allocate */
            int32_t b = kv_pool_alloc(p);
            if (b >= 0) {
                refs[b]++;
                held[n_held++] = b;
                if (rand_r(&seed) % 2) { /* publish one of 8 possible contents */
                    int32_t t[BS] = {rand_r(&seed) % 8, 1, 2, 3};
                    kv_pool_publish(p, b, kv_pool_hash(0, t, BS), 0, t);
                }
            }
        } else if (op < 6 && n_held < N_HOLD) { /* prefix hit */
            int32_t t[BS] = {rand_r(&seed) % 8, 1, 2, 3};
            int32_t b = kv_pool_lookup(p, kv_pool_hash(0, t, BS), 0, t);
            if (b >= 0) {
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
    CHECKF(kv_pool_check(p, refs, &err) == MOE_OK, "%s", err.msg);
    struct kv_pool_stats st;
    kv_pool_stats(p, &st);
    CHECK(st.n_used == 0 && st.n_free + st.n_cached == N_BLOCK);
    CHECK(st.hits > 0 && st.evictions > 0);
    printf("random: %lld lookups, %lld hits, %lld evictions\n", (long long)st.lookups,
           (long long)st.hits, (long long)st.evictions);
    kv_pool_destroy(p);
}

int main(void)
{
    test_basics();
    test_random();
    return test_summary();
}
