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
 * Decode only reads its weights, so read probes follow: the three arrays
 * summed, each thread's slice read as 1 sequential stream and as 4
 * interleaved ones (one 64-byte line from each of 4 parts in turn, the
 * pattern of the CPU matmul's streaming tiles):
 *
 *   read threads 2 streams 4: best 31.02 GB/s, median 30.51 GB/s (10 reps, 3 x 256 MiB)
 *
 * usage: bench-triad [--threads N] [--mib MIB] [--reps R]
 *        (defaults: 2 threads, so 1 and 2 are measured; 256 MiB per array; 10) */
#include <stdint.h>
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
    int streams; /* read probe: interleaved streams per thread; 0: triad */
    uint64_t sums[256];
};

/* The plain sum of the bit patterns of x[lo, hi): the probes' leftovers. */
static uint64_t bit_sum(const double *x, size_t lo, size_t hi)
{
    uint64_t sum = 0;
    for (size_t i = lo; i < hi; i++) {
        uint64_t v;
        memcpy(&v, x + i, sizeof v);
        sum += v;
    }
    return sum;
}

/* The sum of the bit patterns of x[lo, hi) (integer adds: no latency chain
 * slows the read), read as S parts a line at a time in turn; S is a
 * constant, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) uint64_t read_parts(const double *x, size_t lo,
                                                                 size_t hi, const int S)
{
    uint64_t acc[4][8] = {{0}};
    size_t part = (hi - lo) / (size_t)S / 8 * 8;
    for (size_t i = 0; i < part; i += 8)
        for (int s = 0; s < S; s++)
            for (int k = 0; k < 8; k++) {
                uint64_t v;
                memcpy(&v, x + lo + (size_t)s * part + i + k, sizeof v);
                acc[s][k] += v;
            }
    uint64_t sum = bit_sum(x, lo + (size_t)S * part, hi);
    for (int s = 0; s < S; s++)
        for (int k = 0; k < 8; k++)
            sum += acc[s][k];
    return sum;
}

#if defined(__x86_64__)
#include <immintrin.h>
/* The same with one 64-byte load a line, as the matmul tiles read (16-byte
 * loads would probe the load ports, not memory). */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) uint64_t
read_parts_avx512(const double *x, size_t lo, size_t hi, const int S)
{
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    size_t part = (hi - lo) / (size_t)S / 8 * 8;
    for (size_t i = 0; i < part; i += 8)
        for (int s = 0; s < S; s++)
            acc[s] = _mm512_add_epi64(acc[s], _mm512_loadu_si512(x + lo + (size_t)s * part + i));
    uint64_t sum = bit_sum(x, lo + (size_t)S * part, hi);
    for (int s = 0; s < S; s++)
        sum += (uint64_t)_mm512_reduce_add_epi64(acc[s]);
    return sum;
}

__attribute__((target("avx512f"))) static uint64_t read_slice_avx512(const double *x, size_t lo,
                                                                     size_t hi, int streams)
{
    return streams == 4 ? read_parts_avx512(x, lo, hi, 4) : read_parts_avx512(x, lo, hi, 1);
}
#endif

static uint64_t read_slice(const double *x, size_t lo, size_t hi, int streams)
{
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f"))
        return read_slice_avx512(x, lo, hi, streams);
#endif
    return streams == 4 ? read_parts(x, lo, hi, 4) : read_parts(x, lo, hi, 1);
}

static uint64_t bits(double v)
{
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

static void triad_task(void *arg, int task, int thread)
{
    (void)thread;
    const struct triad_job *j = arg;
    size_t lo = j->n * (size_t)task / (size_t)j->n_part;
    size_t hi = j->n * (size_t)(task + 1) / (size_t)j->n_part;
    double *restrict a = j->a;
    const double *restrict b = j->b, *restrict c = j->c;
    if (j->streams) {
        ((struct triad_job *)arg)->sums[task] = read_slice(j->a, lo, hi, j->streams) +
                                                read_slice(j->b, lo, hi, j->streams) +
                                                read_slice(j->c, lo, hi, j->streams);
        return;
    }
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
        for (int streams = 1; streams <= 4; streams *= 4) {
            j.streams = streams;
            uint64_t check = 0;
            moe_threadpool_run(pool, th, triad_task, &j); /* warm-up */
            for (int r = 0; r < reps; r++) {
                double t0 = moe_now();
                moe_threadpool_run(pool, th, triad_task, &j);
                gbs[r] = 3.0 * (double)n * sizeof(double) / (moe_now() - t0) * 1e-9;
                for (int t = 0; t < th; t++)
                    check += j.sums[t];
            }
            /* a = b + 3c = 7 everywhere after the triad runs (mod 2^64) */
            uint64_t want = (uint64_t)n * (uint64_t)reps * (bits(7.0) + bits(1.0) + bits(2.0));
            if (check != want) {
                fprintf(stderr, "bench-triad: the read probe's checksum is wrong\n");
                return 1;
            }
            qsort(gbs, (size_t)reps, sizeof *gbs, cmp_double);
            printf("read threads %d streams %d: best %.2f GB/s, median %.2f GB/s (%d reps, 3 x %ld "
                   "MiB)\n",
                   th, streams, gbs[reps - 1], gbs[reps / 2], reps, mib);
            fflush(stdout);
        }
        j.streams = 0;
        moe_threadpool_destroy(pool);
    }
    free(a);
    free(b);
    free(c);
    free(gbs);
    return 0;
}
