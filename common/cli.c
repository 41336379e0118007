#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hostport.h"

static const char *program = "moe";

void cli_init(const char *name)
{
    program = name;
}

int cli_fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", program);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 2;
}

bool cli_parse_long(const char *s, long lo, long hi, long *out)
{
    if (isspace((unsigned char)*s)) /* strtol would skip it */
        return false;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

bool cli_parse_float(const char *s, float lo, float hi, float *out)
{
    if (isspace((unsigned char)*s)) /* strtof would skip it */
        return false;
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi))
        return false;
    *out = v;
    return true;
}

int cli_check_hostport(const char *flag, const char *v)
{
    char host[256];
    int port;
    if (v && !moe_hostport_split(v, host, sizeof host, &port))
        return cli_fail("%s: '%s' is not HOST:PORT with a port in 0..65535", flag, v);
    return 0;
}

int cli_take(const struct cli_opt *opts, size_t n, int argc, char **argv, int *i,
             const struct cli_opt **other, const char **value)
{
    *other = NULL;
    *value = NULL;
    const char *k = argv[*i];
    size_t f = 0;
    while (f < n && strcmp(k, opts[f].name))
        f++;
    if (f == n)
        return 1;
    const struct cli_opt *o = &opts[f];
    if (o->kind == CLI_SWITCH) {
        *(bool *)o->field = true;
        return 0;
    }
    if (*i + 1 >= argc)
        return cli_fail("option '%s' needs a value", k);
    const char *v = argv[++*i];
    long num;
    switch (o->kind) {
    case CLI_SWITCH: break;
    case CLI_STR: *(const char **)o->field = v; break;
    case CLI_INT:
        if (!cli_parse_long(v, o->lo, o->hi, &num))
            return cli_fail("%s: '%s' is not a whole number in [%ld, %ld]", k, v, o->lo, o->hi);
        *(int *)o->field = (int)num;
        break;
    case CLI_OTHER:
        *other = o;
        *value = v;
        break;
    }
    return 0;
}
