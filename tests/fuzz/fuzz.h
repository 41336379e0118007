/* Shared by the fuzz targets of tests/fuzz: the libFuzzer entry points and
 * a few helpers. Each target is one file fuzz_<name>.c defining
 * LLVMFuzzerTestOneInput (and LLVMFuzzerInitialize when it loads fixtures
 * once). With -DMOE_FUZZ=ON (clang) it links libFuzzer; otherwise
 * replay_main.c runs the inputs named on the command line once each, so the
 * committed corpus and regressions replay in every build (ctest -L fuzz).
 *
 * A target returns 0 for every input it survives; a broken invariant of the
 * code under test is FUZZ_CHECK, which prints the expression and aborts (a
 * crash to libFuzzer, a failure to ctest). */
#ifndef MOE_FUZZ_H
#define MOE_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

#define FUZZ_CHECK(cond, ...)                                                                      \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: fuzz check failed: %s: ", __FILE__, __LINE__, #cond);          \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* A malloc'd NUL-terminated copy of the input (NULL only without memory). */
static inline char *fuzz_cstr(const uint8_t *data, size_t size)
{
    char *s = malloc(size + 1);
    if (s) {
        if (size)
            memcpy(s, data, size);
        s[size] = '\0';
    }
    return s;
}

/* An error message as the project writes them: set, one line. */
static inline int fuzz_msg_ok(const char *msg)
{
    return msg[0] && !strchr(msg, '\n');
}

/* MOE_SOURCE_DIR "/" rel, in a static buffer. */
static inline const char *fuzz_src_path(const char *rel)
{
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", MOE_SOURCE_DIR, rel);
    return buf;
}

#endif
