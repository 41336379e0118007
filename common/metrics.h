/* A Prometheus metrics registry: counters, gauges and histograms with fixed
 * buckets and labels, rendered in the text exposition format 0.0.4.
 *
 * Recording is one relaxed atomic operation (a histogram: three), with no
 * lock and no allocation, so a counter can be bumped where the thing happens:
 *
 *     static struct moe_counter *c;   // registered once, at start-up
 *     c = moe_metrics_counter(reg, "vllm:prompt_tokens_total", "Prompt tokens.", NULL);
 *     ...
 *     moe_counter_add(c, n_prompt);   // any thread
 *
 * A series is registered once per label set (name + label pairs); a second
 * registration with the same name and labels returns the same series, so a
 * label value known only at run time (a finish reason, an HTTP status) is
 * looked up with the same call (that lookup takes the registry lock: do it
 * per request, not per token). Values already counted elsewhere (engine
 * statistics, per-expert arrays) are exported at scrape time by a collector
 * instead, at no cost between scrapes.
 *
 * Ownership: series belong to the registry and live until
 * moe_metrics_destroy; every recording function accepts NULL (a series that
 * failed to register) and does nothing. Registration failures (a bad name, a
 * name registered with another type or other buckets, no memory) return NULL
 * and print nothing: metrics never take a server down. */
#ifndef MOE_METRICS_H
#define MOE_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe_error.h"

struct moe_metrics;
struct moe_counter;
struct moe_gauge;
struct moe_histogram;

/* Bucket sets (upper bounds in seconds, +Inf implied). */
extern const double MOE_BUCKETS_TTFT[]; /* first token: 1 ms .. 640 s */
extern const int MOE_N_BUCKETS_TTFT;
extern const double MOE_BUCKETS_ITL[]; /* between tokens: 0.5 ms .. 80 s */
extern const int MOE_N_BUCKETS_ITL;
extern const double MOE_BUCKETS_E2E[]; /* whole requests: 10 ms .. 7680 s */
extern const int MOE_N_BUCKETS_E2E;
extern const double MOE_BUCKETS_STEP[]; /* engine steps and phases: 50 us .. 10 s */
extern const int MOE_N_BUCKETS_STEP;

/* Creates an empty registry. Every series it renders carries the constant
 * labels given by moe_metrics_set_label (e.g. model_name). NULL on no memory. */
struct moe_metrics *moe_metrics_create(void);

/* Frees the registry and every series. NULL is a no-op. */
void moe_metrics_destroy(struct moe_metrics *m);

/* Adds a constant label put first on every series (copied); call before
 * serving. MOE_ERR_INVALID for a bad label name. */
enum moe_status moe_metrics_set_label(struct moe_metrics *m, const char *name, const char *value,
                                      struct moe_error *err);

/* Registration. `name` must match [a-zA-Z_:][a-zA-Z0-9_:]*; labels follow as
 * NULL-terminated name, value pairs (copied): pass NULL for none. */
struct moe_counter *moe_metrics_counter(struct moe_metrics *m, const char *name, const char *help,
                                        ...) __attribute__((sentinel));
struct moe_gauge *moe_metrics_gauge(struct moe_metrics *m, const char *name, const char *help, ...)
    __attribute__((sentinel));
/* `bounds` (n_bounds, strictly increasing, copied) are the bucket upper
 * bounds; every series of one name must use the same ones. */
struct moe_histogram *moe_metrics_histogram(struct moe_metrics *m, const char *name,
                                            const char *help, const double *bounds, int n_bounds,
                                            ...) __attribute__((sentinel));

/* Recording: any thread, lock-free. */
void moe_counter_add(struct moe_counter *c, uint64_t n);
void moe_counter_add_f(struct moe_counter *c, double v); /* fractional (seconds) */
void moe_counter_inc(struct moe_counter *c);
/* Sets a counter that mirrors a total kept elsewhere (collectors only). */
void moe_counter_set(struct moe_counter *c, double v);
void moe_gauge_set(struct moe_gauge *g, double v);
void moe_gauge_add(struct moe_gauge *g, double v);
void moe_histogram_observe(struct moe_histogram *h, double v);

/* Reading back (tests, derived values). */
double moe_counter_value(const struct moe_counter *c);
double moe_gauge_value(const struct moe_gauge *g);
uint64_t moe_histogram_count(const struct moe_histogram *h);

/* ---- collectors: values exported at scrape time -------------------------------- */

struct moe_metrics_out; /* the text being rendered */

/* Called on every render, in registration order, before the registered
 * series are written (so it may set gauges and counters), with the registry
 * lock held: it must not register series. It may also write whole families
 * of its own with the two functions below (names must not clash with
 * registered ones). */
typedef void (*moe_metrics_collect_fn)(void *user, struct moe_metrics_out *out);

enum moe_status moe_metrics_add_collector(struct moe_metrics *m, moe_metrics_collect_fn fn,
                                          void *user, struct moe_error *err);

/* Writes the # HELP and # TYPE lines of a family ("counter", "gauge"). */
void moe_metrics_out_family(struct moe_metrics_out *out, const char *name, const char *type,
                            const char *help);
/* Writes one sample: `labels` is NULL or preformatted `a="1",b="x"` (values
 * already escaped); the constant labels are put in front. */
void moe_metrics_out_sample(struct moe_metrics_out *out, const char *name, const char *labels,
                            double value);

/* Escapes a label value for `labels` above (backslash, quote, newline) into
 * dst (cap bytes, truncated, always NUL-terminated). */
void moe_metrics_escape(char *dst, size_t cap, const char *value);

/* ---- rendering -------------------------------------------------------------------- */

/* The text exposition format 0.0.4 of everything registered and collected
 * (malloc'd, NUL-terminated, *len excludes the NUL). MOE_ERR_NOMEM on no
 * memory. Thread-safe. */
enum moe_status moe_metrics_render(struct moe_metrics *m, char **text, size_t *len,
                                   struct moe_error *err);

#define MOE_METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

#endif
