#include "moe_error.h"

#include <stdarg.h>
#include <string.h>

/* A message is one line: control characters that came in with an echoed
 * name or value (a tensor name, a JSON key) become '?', so that bad input
 * cannot split or forge a log line. */
static void one_line(char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || *s == 0x7f)
            *s = '?';
}

enum moe_status moe_error_set(struct moe_error *err, enum moe_status code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        one_line(err->msg);
        err->code = code;
    }
    return code;
}

enum moe_status moe_error_prefix(struct moe_error *err, const char *fmt, ...)
{
    if (!err)
        return MOE_OK;
    char prefix[MOE_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    if (n < 0)
        return err->code;
    /* "prefix: old", truncated to the buffer */
    char joined[MOE_ERROR_MSG_MAX];
    size_t cap = sizeof joined - 1, len = 0;
    const char *parts[3] = {prefix, ": ", err->msg};
    for (int i = 0; i < 3 && len < cap; i++) {
        size_t part = strlen(parts[i]);
        if (part > cap - len)
            part = cap - len;
        memcpy(joined + len, parts[i], part);
        len += part;
    }
    joined[len] = '\0';
    one_line(joined);
    memcpy(err->msg, joined, len + 1);
    return err->code;
}

const char *moe_status_name(enum moe_status code)
{
    switch (code) {
    case MOE_OK: return "OK";
    case MOE_ERR_INVALID: return "INVALID";
    case MOE_ERR_IO: return "IO";
    case MOE_ERR_FORMAT: return "FORMAT";
    case MOE_ERR_UNSUPPORTED: return "UNSUPPORTED";
    case MOE_ERR_NOT_FOUND: return "NOT_FOUND";
    case MOE_ERR_NOMEM: return "NOMEM";
    case MOE_ERR_AGAIN: return "AGAIN";
    case MOE_ERR_INTERNAL: return "INTERNAL";
    }
    return "UNKNOWN";
}
