/* A tiny test harness: CHECK records a failure and goes on; a test program
 * ends with `return test_summary();` which prints "N passed, N failed" and
 * returns non-zero if anything failed. Exit code 77 means "skipped" to CTest. */
#ifndef MOE_TESTLIB_H
#define MOE_TESTLIB_H

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

#endif
