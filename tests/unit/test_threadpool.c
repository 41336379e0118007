/* Thread pool: every task runs exactly once, thread ids are in range, many
 * runs in a row (including runs after helpers went to sleep), pools of 1. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testlib.h"
#include "threadpool.h"

struct count_arg {
    _Atomic int *hits;      /* (n_tasks) */
    _Atomic int bad_thread; /* thread id out of range */
    int n_threads;
};

static void count_task(void *p, int task, int thread)
{
    struct count_arg *a = p;
    atomic_fetch_add(&a->hits[task], 1);
    if (thread < 0 || thread >= a->n_threads)
        atomic_fetch_add(&a->bad_thread, 1);
}

/* Runs n_tasks once; returns the number of tasks not run exactly once. */
static int run_once(struct moe_threadpool *pool, int n_tasks)
{
    _Atomic int *hits = calloc((size_t)n_tasks + 1, sizeof(*hits));
    struct count_arg a = {.hits = hits, .n_threads = moe_threadpool_size(pool)};
    atomic_init(&a.bad_thread, 0);
    moe_threadpool_run(pool, n_tasks, count_task, &a);
    int wrong = 0;
    for (int i = 0; i < n_tasks; i++)
        wrong += atomic_load(&hits[i]) != 1;
    wrong += atomic_load(&a.bad_thread);
    free(hits);
    return wrong;
}

/* Each task writes its own slot; the per-thread scratch must not be shared. */
struct scratch_arg {
    int scratch[8][64];
    int *out;
};

static void scratch_task(void *p, int task, int thread)
{
    struct scratch_arg *a = p;
    int *s = a->scratch[thread];
    for (int i = 0; i < 64; i++)
        s[i] = task + i;
    int sum = 0;
    for (int i = 0; i < 64; i++)
        sum += s[i] - i;
    a->out[task] = sum / 64;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {0, ms * 1000000L};
    nanosleep(&ts, NULL);
}

static void test_pool(int n_threads)
{
    struct moe_threadpool *pool = NULL;
    struct moe_error err = {0};
    CHECKF(moe_threadpool_create(n_threads, &pool, &err) == MOE_OK, "%s", err.msg);
    if (!pool)
        return;
    CHECK(moe_threadpool_size(pool) == (n_threads <= 0 ? moe_threadpool_size(pool) : n_threads));
    CHECK(moe_threadpool_size(pool) >= 1);

    int sizes[] = {0, 1, 2, 3, 7, 64, 1000, 4099};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
        CHECKF(run_once(pool, sizes[i]) == 0, "threads %d, %d tasks", n_threads, sizes[i]);

    /* Many runs in a row: helpers stay warm, generations advance. */
    int wrong = 0;
    for (int r = 0; r < 20000; r++)
        wrong += run_once(pool, 1 + r % 9);
    CHECKF(wrong == 0, "threads %d: %d tasks wrong over 20000 runs", n_threads, wrong);

    /* Runs after the helpers fell asleep. */
    for (int r = 0; r < 3; r++) {
        sleep_ms(5);
        CHECKF(run_once(pool, 37) == 0, "threads %d: run after sleep", n_threads);
    }

    struct scratch_arg sa;
    int out[500];
    sa.out = out;
    moe_threadpool_run(pool, 500, scratch_task, &sa);
    int bad = 0;
    for (int i = 0; i < 500; i++)
        bad += out[i] != i;
    CHECKF(bad == 0, "threads %d: per-thread scratch clobbered in %d tasks", n_threads, bad);

    moe_threadpool_destroy(pool);
}

/* With slow tasks, helpers must take part (the caller alone would do all). */
struct busy_arg {
    _Atomic int by_helper;
};

static void busy_task(void *p, int task, int thread)
{
    struct busy_arg *a = p;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do
        clock_gettime(CLOCK_MONOTONIC, &t);
    while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < 200000L);
    if (thread != 0)
        atomic_fetch_add(&a->by_helper, 1);
}

static void test_helpers_participate(void)
{
    struct moe_threadpool *pool = NULL;
    struct moe_error err = {0};
    if (moe_threadpool_create(2, &pool, &err) != MOE_OK) {
        CHECKF(0, "%s", err.msg);
        return;
    }
    /* Up to 5 tries of 100 x 0.2 ms: a loaded machine may deschedule the helper once. */
    int helped = 0;
    for (int tries = 0; tries < 5 && !helped; tries++) {
        struct busy_arg a;
        atomic_init(&a.by_helper, 0);
        moe_threadpool_run(pool, 100, busy_task, &a);
        helped = atomic_load(&a.by_helper) > 0;
        sleep_ms(1); /* next try starts with the helper asleep */
    }
    CHECKF(helped, "the helper thread never ran a task");
    moe_threadpool_destroy(pool);
}

int main(void)
{
    test_pool(1);
    test_pool(2);
    test_pool(3);
    test_pool(8);
    test_pool(0);
    moe_threadpool_destroy(NULL);
    test_helpers_participate();

    /* A NULL pool runs tasks inline. */
    CHECK(run_once(NULL, 5) == 0);

    struct moe_threadpool *pool = NULL;
    struct moe_error err = {0};
    CHECK(moe_threadpool_create(100000, &pool, &err) == MOE_ERR_INVALID && pool == NULL);
    CHECK(strstr(err.msg, "100000") != NULL);

    /* Timing of an empty run on 2 threads (informational). */
    if (moe_threadpool_create(2, &pool, &err) == MOE_OK) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        int n = 20000;
        for (int r = 0; r < n; r++)
            run_once(pool, 2);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double us = ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / 1e3 / n;
        printf("threadpool: %.2f us per run of 2 tasks on 2 threads (incl. calloc/check)\n", us);
        moe_threadpool_destroy(pool);
    }
    return test_summary();
}
