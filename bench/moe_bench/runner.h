/* One rank's share of a run: a dispatcher (the calling thread) sends each of
 * the rank's requests at its arrival time to a pool of request threads, one
 * request per thread at a time. With --max-concurrency C the pool has C
 * threads and a request that arrives while all are busy waits in the
 * client's queue (its E2EL starts when it is sent; the wait is kept as
 * start - arrival), as vLLM's semaphore does. Without it threads are added
 * as needed, up to BENCH_MAX_INFLIGHT per rank (more ranks give more). */
#ifndef MOE_BENCH_RUNNER_H
#define MOE_BENCH_RUNNER_H

#include <stdbool.h>
#include <stddef.h>

#include "bench.h"
#include "client.h"
#include "workload.h"

#define BENCH_MAX_INFLIGHT 1024

struct bench_run_opts {
    const struct bench_workload *w;
    struct bench_target *target;
    int target_index;
    int rank, size;
    /* Requests: global indices rank, rank + size, ... below n_total, sent at
     * arrivals[index] (seconds after the start). closed_loop instead keeps
     * every thread busy until duration_s has passed (rate inf + --duration). */
    size_t n_total;
    const double *arrivals;
    bool closed_loop;
    double duration_s;
    int max_concurrency; /* this rank's threads; 0: as needed */
    int64_t item_base;   /* request i sends workload item item_base + i (fresh prompts per run) */
    bool warmup;         /* warm-up prompts (bench_workload_warmup_item), ids "warmup-" */
    const char *rid_prefix;
    bool progress; /* a progress line on stderr every second */
    const char *label;
};

struct bench_run_result {
    struct bench_record *recs; /* (n) in completion order; caller frees (bench_run_result_free) */
    size_t n, cap;
    double end_s; /* last completion, seconds after the start */
};

/* Runs the rank's share with t_origin (monotonic seconds) as t = 0.
 * Errors are local failures (out of memory, a bad workload item, no
 * thread); failed requests are records, not errors. */
enum moe_status bench_run(const struct bench_run_opts *o, double t_origin,
                          struct bench_run_result *res, struct moe_error *err);

void bench_run_result_free(struct bench_run_result *res);

#endif
