/* STREAM-style triad probe: a[i] = b[i] + s * c[i] over three arrays of
 * doubles far larger than the last-level cache, on 1 .. N threads of the
 * project's thread pool (each thread touches its own slice first, so pages
 * sit where they are used). Bytes are counted as STREAM counts them (two
 * reads and one write per element, 24 bytes); prints the best and the
 * median of the repetitions per thread count:
 *
 *   triad threads 2: best 25.31 GB/s, median 24.80 GB/s (10 reps, 3 x 256 MiB)
 *
 * It is the memory roofline bench/bench_cpu.sh compares decode against.
 *
 * usage: bench-triad [--threads N] [--mib MIB] [--reps R]
 *        (defaults: 2 threads, so 1 and 2 are measured; 256 MiB per array; 10) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "threadpool.h"

struct triad_job {
    double *a, *b, *c;
    size_t n;
    int n_part;
    int init;
};

static void triad_task(void *arg, int task, int thread)
{
    (void)thread;
    const struct triad_job *j = arg;
    size_t lo = j->n * (size_t)task / (size_t)j->n_part;
    size_t hi = j->n * (size_t)(task + 1) / (size_t)j->n_part;
    double *restrict a = j->a;
    const double *restrict b = j->b, *restrict c = j->c;
    if (j->init) {
        for (size_t i = lo; i < hi; i++) {
            j->a[i] = 0.0;
            j->b[i] = 1.0;
            j->c[i] = 2.0;
        }
        return;
    }
    const double s = 3.0;
    for (size_t i = lo; i < hi; i++)
        a[i] = b[i] + s * c[i];
}

static int cmp_double(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

int main(int argc, char **argv)
{
    int max_threads = 2, reps = 10;
    long mib = 256;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads"))
            max_threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--mib"))
            mib = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps"))
            reps = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: bench-triad [--threads N] [--mib MIB] [--reps R]\n");
            return 2;
        }
    }
    if (max_threads < 1 || max_threads > 256 || mib < 1 || reps < 1 || reps > 1000) {
        fprintf(stderr, "bench-triad: --threads 1..256, --mib >= 1, --reps 1..1000\n");
        return 2;
    }
    size_t n = (size_t)mib * 1024 * 1024 / sizeof(double);
    double *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b), *c = malloc(n * sizeof *c);
    double *gbs = malloc((size_t)reps * sizeof *gbs);
    if (!a || !b || !c || !gbs) {
        fprintf(stderr, "bench-triad: cannot allocate 3 x %ld MiB\n", mib);
        return 1;
    }
    for (int th = 1; th <= max_threads; th++) {
        struct moe_threadpool *pool = NULL;
        struct moe_error err = {0};
        if (moe_threadpool_create(th, &pool, &err) != MOE_OK) {
            fprintf(stderr, "bench-triad: %s\n", err.msg);
            return 1;
        }
        struct triad_job j = {.a = a, .b = b, .c = c, .n = n, .n_part = th, .init = 1};
        moe_threadpool_run(pool, th, triad_task, &j);
        j.init = 0;
        moe_threadpool_run(pool, th, triad_task, &j); /* warm-up */
        for (int r = 0; r < reps; r++) {
            double t0 = moe_now();
            moe_threadpool_run(pool, th, triad_task, &j);
            gbs[r] = 3.0 * (double)n * sizeof(double) / (moe_now() - t0) * 1e-9;
        }
        qsort(gbs, (size_t)reps, sizeof *gbs, cmp_double);
        printf("triad threads %d: best %.2f GB/s, median %.2f GB/s (%d reps, 3 x %ld MiB)\n", th,
               gbs[reps - 1], gbs[reps / 2], reps, mib);
        fflush(stdout);
        moe_threadpool_destroy(pool);
    }
    free(a);
    free(b);
    free(c);
    free(gbs);
    return 0;
}
