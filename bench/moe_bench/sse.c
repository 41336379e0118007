/* Incremental Server-Sent Events parser (sse.h). */
#include <stdlib.h>
#include <string.h>

#include "sse.h"

void sse_init(struct sse_parser *p, sse_event_fn fn, void *user)
{
    memset(p, 0, sizeof(*p));
    p->fn = fn;
    p->user = user;
}

static bool grow(char **buf, size_t *cap, size_t need)
{
    if (need <= *cap)
        return true;
    size_t c = *cap ? *cap : 256;
    while (c < need)
        c *= 2;
    char *g = realloc(*buf, c);
    if (!g)
        return false;
    *buf = g;
    *cap = c;
    return true;
}

static int dispatch(struct sse_parser *p)
{
    if (!p->has_data)
        return 0;
    p->has_data = false;
    size_t n = p->data_len;
    p->data_len = 0;
    p->data[n] = 0;
    return p->fn(p->user, p->data, n);
}

/* One complete line (without its end). */
static int line_done(struct sse_parser *p)
{
    const char *l = p->line;
    size_t n = p->line_len;
    p->line_len = 0;
    if (n == 0)
        return dispatch(p);
    if (l[0] == ':')
        return 0;
    const char *colon = memchr(l, ':', n);
    size_t name_len = colon ? (size_t)(colon - l) : n;
    if (name_len != 4 || memcmp(l, "data", 4))
        return 0; /* event:, id:, retry: and unknown fields */
    const char *v = colon ? colon + 1 : l + n;
    if (v < l + n && *v == ' ')
        v++;
    size_t vn = (size_t)(l + n - v);
    /* +2: a joining '\n' and the final NUL */
    if (!grow(&p->data, &p->data_cap, p->data_len + vn + 2)) {
        p->nomem = true;
        return -1;
    }
    if (p->has_data)
        p->data[p->data_len++] = '\n';
    memcpy(p->data + p->data_len, v, vn);
    p->data_len += vn;
    p->has_data = true;
    return 0;
}

int sse_feed(struct sse_parser *p, const char *bytes, size_t n)
{
    if (p->nomem)
        return -1;
    for (size_t i = 0; i < n; i++) {
        char c = bytes[i];
        if (c == '\n' && p->after_cr) {
            p->after_cr = false;
            continue;
        }
        p->after_cr = false;
        if (c == '\n' || c == '\r') {
            p->after_cr = c == '\r';
            int rc = line_done(p);
            if (rc)
                return rc;
            continue;
        }
        if (!grow(&p->line, &p->line_cap, p->line_len + 1)) {
            p->nomem = true;
            return -1;
        }
        p->line[p->line_len++] = c;
    }
    return 0;
}

int sse_finish(struct sse_parser *p)
{
    if (p->nomem)
        return -1;
    if (p->line_len) {
        int rc = line_done(p);
        if (rc)
            return rc;
    }
    return dispatch(p);
}

void sse_free(struct sse_parser *p)
{
    free(p->line);
    free(p->data);
    p->line = p->data = NULL;
    p->line_cap = p->data_cap = p->line_len = p->data_len = 0;
}
