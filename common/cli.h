/* Helpers shared by the command-line programs (moe-generate, moe-worker,
 * moe-coordinator, moe-client, moectl): one place for how a bad flag is
 * reported and how numbers are parsed. */
#ifndef MOE_CLI_H
#define MOE_CLI_H

#include <stdbool.h>
#include <stddef.h>

/* Names the program in messages ("moe-worker"); call first in main. */
void cli_init(const char *program);

/* Prints "<program>: <message>" on stderr and returns 2, the exit code for
 * a bad command line. */
int cli_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* A whole decimal number in [lo, hi], nothing else in the string. */
bool cli_parse_long(const char *s, long lo, long hi, long *out);

/* A number in [lo, hi] (NaN refused), nothing else in the string. */
bool cli_parse_float(const char *s, float lo, float hi, float *out);

/* A table of command-line flags. */
enum cli_kind {
    CLI_SWITCH, /* no value: *(bool *)field = true */
    CLI_STR,    /* *(const char **)field = the value as given */
    CLI_INT,    /* *(int *)field = a whole number in [lo, hi] */
    CLI_OTHER,  /* a value the caller checks and stores itself (cli_take hands it back) */
};

struct cli_opt {
    const char *name;
    enum cli_kind kind;
    void *field;
    long lo, hi; /* CLI_INT */
};

/* argv[*i] against the n opts: none of them -> 1, *i unchanged; one ->
 * 0 with *i past its value, stored unless CLI_OTHER, which sets *other
 * and *value for the caller (both NULL otherwise); a missing value or a
 * number out of range -> cli_fail's 2, naming the flag. */
int cli_take(const struct cli_opt *opts, size_t n, int argc, char **argv, int *i,
             const struct cli_opt **other, const char **value);

/* The value v of `flag` is HOST:PORT (hostport.h; NULL: not given) -> 0;
 * else cli_fail's 2, naming the flag and the value. */
int cli_check_hostport(const char *flag, const char *v);

#endif
