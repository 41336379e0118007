/* Status codes and error messages shared by every library in the project.
 *
 * Library code never exits: it returns an `enum moe_status` and, where the
 * caller passed a `struct moe_error`, a one-line message that names the file,
 * field or value at fault ("model.safetensors: tensor 'lm_head.weight':
 * offsets [0, 96) do not match shape [8, 4] x F32 = 128 bytes"). */
#ifndef MOE_ERROR_H
#define MOE_ERROR_H

#include <stdio.h>
#include <stdlib.h>

enum moe_status {
    MOE_OK = 0,
    MOE_ERR_INVALID,     /* bad argument or bad input value */
    MOE_ERR_IO,          /* open/read/mmap failed */
    MOE_ERR_FORMAT,      /* malformed file contents */
    MOE_ERR_UNSUPPORTED, /* valid, but not implemented: never silently ignored */
    MOE_ERR_NOT_FOUND,   /* missing tensor, key, token ... */
    MOE_ERR_NOMEM,       /* allocation failed */
    MOE_ERR_AGAIN,       /* non-blocking path: try again later */
    MOE_ERR_INTERNAL,    /* broken invariant reported without aborting */
};

#define MOE_ERROR_MSG_MAX 1024

struct moe_error {
    enum moe_status code;
    char msg[MOE_ERROR_MSG_MAX];
};

/* Records `code` and a printf-style message in `err` (which may be NULL) and
 * returns `code`, so that callers can write `return moe_error_set(err, ...)`.
 * A message already recorded is overwritten. A message is one line: control
 * characters in it (from an echoed name or value) are written as '?'. */
enum moe_status moe_error_set(struct moe_error *err, enum moe_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prefixes the message already in `err` with "prefix: ", e.g. a file name
 * that the inner function did not know. Returns err->code (MOE_OK if err is
 * NULL). */
enum moe_status moe_error_prefix(struct moe_error *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Short upper-case name of a status ("FORMAT", "IO", ...). */
const char *moe_status_name(enum moe_status code);

/* Always-on assertion for invariants (never for bad input): prints file, line
 * and expression, then aborts. */
#define MOE_ASSERT(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: assertion failed: %s\n", __FILE__, __LINE__, #cond);           \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

#endif
