/* A fixed pool of worker threads for data-parallel loops in the CPU kernels.
 * The calling thread takes part in the work, so a pool of n threads starts
 * n - 1 helpers. */
#ifndef MOE_THREADPOOL_H
#define MOE_THREADPOOL_H

#include "moe_error.h"

struct moe_pool;

/* fn(arg, task, thread) is called once for every task in [0, n_tasks);
 * `thread` is in [0, n_threads) and identifies the calling thread (for
 * per-thread scratch). */
typedef void (*moe_pool_fn)(void *arg, int task, int thread);

/* n_threads <= 0 means one per online core. */
enum moe_status moe_pool_create(int n_threads, struct moe_pool **out, struct moe_error *err);

/* Joins the helpers. NULL is a no-op. */
void moe_pool_destroy(struct moe_pool *pool);

int moe_pool_size(const struct moe_pool *pool);

/* Runs all tasks and returns when every one has finished. Tasks are handed
 * out dynamically (an atomic counter). Not re-entrant: one caller at a time. */
void moe_pool_run(struct moe_pool *pool, int n_tasks, moe_pool_fn fn, void *arg);

#endif
