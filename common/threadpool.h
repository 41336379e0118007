/* A fixed pool of worker threads for data-parallel loops in the CPU kernels.
 * The calling thread takes part in the work, so a pool of n threads starts
 * n - 1 helpers. (Not the KV cache's block pool: that is worker/kv/kv_pool.h.) */
#ifndef MOE_THREADPOOL_H
#define MOE_THREADPOOL_H

#include "moe_error.h"

struct moe_threadpool;

/* fn(arg, task, thread) is called once for every task in [0, n_tasks);
 * `thread` is in [0, n_threads) and identifies the calling thread (for
 * per-thread scratch). */
typedef void (*moe_threadpool_fn)(void *arg, int task, int thread);

/* n_threads <= 0 means one per online core. */
enum moe_status moe_threadpool_create(int n_threads, struct moe_threadpool **out,
                                      struct moe_error *err);

/* Joins the helpers. NULL is a no-op. */
void moe_threadpool_destroy(struct moe_threadpool *pool);

int moe_threadpool_size(const struct moe_threadpool *pool);

/* Runs all tasks and returns when every one has finished. Tasks are handed
 * out dynamically (an atomic counter). Not re-entrant: one caller at a time. */
void moe_threadpool_run(struct moe_threadpool *pool, int n_tasks, moe_threadpool_fn fn, void *arg);

#endif
