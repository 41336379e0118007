/* An incremental parser of Server-Sent Events (text/event-stream, the
 * WHATWG "event stream interpretation"): bytes go in as the network gives
 * them, in pieces of any size; every complete event's data (its "data:"
 * lines joined by '\n') comes out through a callback. Lines end with LF,
 * CRLF or CR; comment lines (":ping") and other fields are skipped. */
#ifndef MOE_BENCH_SSE_H
#define MOE_BENCH_SSE_H

#include <stdbool.h>
#include <stddef.h>

#include "moe_error.h"

/* Called once per event with its data (NUL-terminated, len bytes, borrowed
 * for the call). A non-zero return stops the parser (sse_feed returns it). */
typedef int (*sse_event_fn)(void *user, const char *data, size_t len);

struct sse_parser {
    sse_event_fn fn;
    void *user;
    char *line; /* the line being read */
    size_t line_len, line_cap;
    char *data; /* the event's data so far */
    size_t data_len, data_cap;
    bool has_data;
    bool after_cr; /* the last byte was CR: a following LF belongs to it */
    bool nomem;
};

void sse_init(struct sse_parser *p, sse_event_fn fn, void *user);

/* Feeds n bytes. Returns 0, the callback's non-zero value, or -1 when out
 * of memory. */
int sse_feed(struct sse_parser *p, const char *bytes, size_t n);

/* End of stream: an event whose blank line never came is delivered. */
int sse_finish(struct sse_parser *p);

/* Frees the buffers (the parser can be re-initialised). */
void sse_free(struct sse_parser *p);

#endif
