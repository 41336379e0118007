/* A fixed pool of worker threads for the CPU kernels.
 *
 * One run publishes (fn, arg) and a 64-bit control word
 *     ctl = gen (24 bits) | n_tasks (20 bits) | next task (20 bits)
 * and every participant claims tasks by compare-and-swap on ctl. A claim
 * succeeds only while ctl still names the run's generation and a task is
 * left, so a helper that wakes up late (after the run ended) can never run a
 * task of the wrong run, and the caller never waits for helpers that did not
 * join: it waits only until every task it handed out has finished. Helpers
 * spin a little after each run (decode does ~100 runs per token), then sleep
 * on a condition variable. Runs with more than 2^20 - 1 tasks are split. */
#include "threadpool.h"
#include "clock.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define POOL_IDX_BITS 20
#define POOL_IDX_MASK ((UINT64_C(1) << POOL_IDX_BITS) - 1)
#define POOL_MAX_TASKS ((int)POOL_IDX_MASK)
#define POOL_GEN_SHIFT (2 * POOL_IDX_BITS)
#define POOL_SPIN_NS 200000 /* how long an idle helper spins before sleeping */

struct pool_helper {
    struct moe_threadpool *pool;
    pthread_t thread;
    int id;
};

struct moe_threadpool {
    int n_threads;
    struct pool_helper *helpers; /* (n_threads - 1) */
    int n_started;

    _Atomic uint64_t ctl;
    _Atomic(moe_threadpool_fn) fn;
    _Atomic(void *) arg;
    _Atomic int n_done; /* tasks finished in the current run */
    _Atomic int n_sleeping;
    _Atomic bool stop;

    pthread_mutex_t mutex;
    pthread_cond_t wake;
    uint32_t gen; /* caller's copy of the generation */
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline uint32_t ctl_gen(uint64_t v)
{
    return (uint32_t)(v >> POOL_GEN_SHIFT);
}

/* Claims and runs tasks of generation `gen` until none is left. */
static void pool_work(struct moe_threadpool *pool, uint32_t gen, int thread)
{
    moe_threadpool_fn fn = atomic_load_explicit(&pool->fn, memory_order_relaxed);
    void *arg = atomic_load_explicit(&pool->arg, memory_order_relaxed);
    uint64_t v = atomic_load_explicit(&pool->ctl, memory_order_acquire);
    for (;;) {
        if (ctl_gen(v) != gen)
            return;
        uint64_t n = (v >> POOL_IDX_BITS) & POOL_IDX_MASK;
        uint64_t idx = v & POOL_IDX_MASK;
        if (idx >= n)
            return;
        /* On success the run was still open, so fn/arg read above are this
         * run's (the caller rewrites them only after every task finished). */
        if (!atomic_compare_exchange_weak_explicit(&pool->ctl, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        fn(arg, (int)idx, thread);
        atomic_fetch_add_explicit(&pool->n_done, 1, memory_order_release);
        v = atomic_load_explicit(&pool->ctl, memory_order_acquire);
    }
}

static void *pool_helper_main(void *p)
{
    struct pool_helper *h = p;
    struct moe_threadpool *pool = h->pool;
    uint32_t seen = ctl_gen(atomic_load(&pool->ctl));
    for (;;) {
        uint32_t gen = seen;
        uint64_t t0 = 0;
        for (int i = 0;; i++) {
            gen = ctl_gen(atomic_load_explicit(&pool->ctl, memory_order_acquire));
            if (gen != seen || atomic_load_explicit(&pool->stop, memory_order_relaxed))
                break;
            cpu_relax();
            if ((i & 63) == 63) {
                uint64_t t = moe_now_ns();
                if (t0 == 0)
                    t0 = t;
                else if (t - t0 > POOL_SPIN_NS)
                    break;
            }
        }
        if (gen == seen) { /* sleep until the next run */
            pthread_mutex_lock(&pool->mutex);
            atomic_fetch_add(&pool->n_sleeping, 1);
            while (!atomic_load(&pool->stop) && (gen = ctl_gen(atomic_load(&pool->ctl))) == seen)
                pthread_cond_wait(&pool->wake, &pool->mutex);
            atomic_fetch_sub(&pool->n_sleeping, 1);
            pthread_mutex_unlock(&pool->mutex);
        }
        if (atomic_load(&pool->stop))
            return NULL;
        seen = gen;
        pool_work(pool, gen, h->id);
    }
}

static int online_cores(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (int)n;
}

enum moe_status moe_threadpool_create(int n_threads, struct moe_threadpool **out,
                                      struct moe_error *err)
{
    *out = NULL;
    if (n_threads <= 0)
        n_threads = online_cores();
    if (n_threads > 1024)
        return moe_error_set(err, MOE_ERR_INVALID, "threadpool: n_threads %d is more than 1024",
                             n_threads);
    struct moe_threadpool *pool = calloc(1, sizeof(*pool));
    if (!pool)
        return moe_error_set(err, MOE_ERR_NOMEM, "threadpool: out of memory");
    pool->n_threads = n_threads;
    atomic_init(&pool->ctl, 0);
    atomic_init(&pool->fn, NULL);
    atomic_init(&pool->arg, NULL);
    atomic_init(&pool->n_done, 0);
    atomic_init(&pool->n_sleeping, 0);
    atomic_init(&pool->stop, false);
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_cond_init(&pool->wake, NULL);
    if (n_threads > 1) {
        pool->helpers = calloc((size_t)(n_threads - 1), sizeof(*pool->helpers));
        if (!pool->helpers) {
            moe_error_set(err, MOE_ERR_NOMEM, "threadpool: out of memory");
            goto fail;
        }
    }
    for (int i = 0; i < n_threads - 1; i++) {
        struct pool_helper *h = &pool->helpers[i];
        h->pool = pool;
        h->id = i + 1;
        int rc = pthread_create(&h->thread, NULL, pool_helper_main, h);
        if (rc != 0) {
            moe_error_set(err, MOE_ERR_INTERNAL, "threadpool: pthread_create for helper %d: %s",
                          i + 1, strerror(rc));
            goto fail;
        }
        pool->n_started++;
    }
    *out = pool;
    return MOE_OK;
fail:
    moe_threadpool_destroy(pool);
    return err ? err->code : MOE_ERR_INTERNAL;
}

void moe_threadpool_destroy(struct moe_threadpool *pool)
{
    if (!pool)
        return;
    pthread_mutex_lock(&pool->mutex);
    atomic_store(&pool->stop, true);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);
    for (int i = 0; i < pool->n_started; i++)
        pthread_join(pool->helpers[i].thread, NULL);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->mutex);
    free(pool->helpers);
    free(pool);
}

int moe_threadpool_size(const struct moe_threadpool *pool)
{
    return pool ? pool->n_threads : 1;
}

/* One run of at most POOL_MAX_TASKS tasks. */
static void pool_run_chunk(struct moe_threadpool *pool, int n_tasks, moe_threadpool_fn fn,
                           void *arg)
{
    pool->gen = (pool->gen + 1) & ((1u << (64 - POOL_GEN_SHIFT)) - 1);
    atomic_store_explicit(&pool->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool->arg, arg, memory_order_relaxed);
    atomic_store_explicit(&pool->n_done, 0, memory_order_relaxed);
    uint64_t v = ((uint64_t)pool->gen << POOL_GEN_SHIFT) | ((uint64_t)n_tasks << POOL_IDX_BITS);
    atomic_store(&pool->ctl, v); /* seq_cst: ordered before the n_sleeping load */
    if (atomic_load(&pool->n_sleeping) > 0) {
        pthread_mutex_lock(&pool->mutex);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->mutex);
    }
    pool_work(pool, pool->gen, 0);
    for (int i = 0; atomic_load_explicit(&pool->n_done, memory_order_acquire) < n_tasks; i++) {
        if (i < 4096)
            cpu_relax();
        else
            sched_yield();
    }
}

struct pool_offset_arg {
    moe_threadpool_fn fn;
    void *arg;
    int offset;
};

static void pool_offset_fn(void *p, int task, int thread)
{
    struct pool_offset_arg *a = p;
    a->fn(a->arg, a->offset + task, thread);
}

void moe_threadpool_run(struct moe_threadpool *pool, int n_tasks, moe_threadpool_fn fn, void *arg)
{
    if (n_tasks <= 0)
        return;
    if (!pool || pool->n_threads == 1 || n_tasks == 1) {
        for (int i = 0; i < n_tasks; i++)
            fn(arg, i, 0);
        return;
    }
    if (n_tasks <= POOL_MAX_TASKS) {
        pool_run_chunk(pool, n_tasks, fn, arg);
        return;
    }
    for (int off = 0; off < n_tasks; off += POOL_MAX_TASKS) {
        struct pool_offset_arg a = {fn, arg, off};
        int n = n_tasks - off < POOL_MAX_TASKS ? n_tasks - off : POOL_MAX_TASKS;
        pool_run_chunk(pool, n, pool_offset_fn, &a);
    }
}
