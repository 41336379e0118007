/* A tiny test harness: CHECK records a failure and goes on; a test program
 * ends with `return test_summary();` which prints "N passed, N failed" and
 * returns non-zero if anything failed. Exit code 77 means "skipped" to CTest. */
#ifndef MOE_TESTLIB_H
#define MOE_TESTLIB_H

#include <stdint.h>
#include <stdio.h>

extern _Atomic int test_n_pass; /* atomic: CHECK may run on any thread */
extern _Atomic int test_n_fail;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (cond) {                                                                                \
            test_n_pass++;                                                                         \
        } else {                                                                                   \
            test_n_fail++;                                                                         \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
        }                                                                                          \
    } while (0)

#define CHECKF(cond, ...)                                                                          \
    do {                                                                                           \
        if (cond) {                                                                                \
            test_n_pass++;                                                                         \
        } else {                                                                                   \
            test_n_fail++;                                                                         \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
        }                                                                                          \
    } while (0)

#define TEST_SKIP_CODE 77

/* Prints the summary line and returns the process exit code. */
int test_summary(void);

/* Path of a file under the source tree: MOE_SOURCE_DIR "/" rel (static buffer). */
const char *test_src_path(const char *rel);

/* Writes `n` bytes to a fresh temporary file and returns its path (static
 * buffer, overwritten by the next call). Files live in one temp directory
 * removed at exit. */
const char *test_write_temp(const char *name, const void *data, size_t n);

/* Temporary directory for this test process (created on first use). */
const char *test_temp_dir(void);

/* ---- deterministic random inputs ---------------------------------------------------- */

/* One stream of pseudo-random numbers (xorshift64): a seed gives the same
 * numbers on every machine, so a failure can be replayed. `state` is the
 * seed and must not be 0: static struct test_rng g_rng = {SEED}; */
struct test_rng {
    uint64_t state;
};

/* Seeds from a small number (a case index): seeds next to each other give
 * unrelated streams. */
static inline void test_rng_seed(struct test_rng *r, uint64_t seed)
{
    r->state = seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
    if (!r->state)
        r->state = 1;
}

/* The next 64-bit state. */
static inline uint64_t test_rng_u64(struct test_rng *r)
{
    r->state ^= r->state << 13;
    r->state ^= r->state >> 7;
    r->state ^= r->state << 17;
    return r->state;
}

/* 32 bits from the middle of the next state. */
static inline uint32_t test_rng_u32(struct test_rng *r)
{
    return (uint32_t)(test_rng_u64(r) >> 16);
}

/* A whole number in [lo, hi]. */
static inline int test_rng_int(struct test_rng *r, int lo, int hi)
{
    return lo + (int)(test_rng_u32(r) % (uint32_t)(hi - lo + 1));
}

/* A float in [-1, 1). */
static inline float test_rng_float(struct test_rng *r)
{
    return (float)((double)test_rng_u32(r) / 2147483648.0 - 1.0);
}

#endif
