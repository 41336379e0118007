/* The benchmark's numbers from its per-request records, by the definitions
 * of vLLM's `vllm bench serve` (benchmarks/serve.py, calculate_metrics):
 *
 *   TTFT  first token - request sent
 *   E2EL  last token - request sent ("latency")
 *   TPOT  (E2EL - TTFT) / (output tokens - 1), for requests with > 1 output
 *         token (counted as 0 against a goodput TPOT target otherwise)
 *   ITL   every gap between consecutive token-carrying chunks, all requests
 *   goodput  completed requests meeting every --goodput target, per second
 *   mean / median / std (population) / percentiles (linear interpolation,
 *   numpy's default) over the completed requests; 0 when there are none.
 *
 * Statistics are reported in milliseconds. */
#ifndef MOE_BENCH_METRICS_H
#define MOE_BENCH_METRICS_H

#include <stdbool.h>
#include <stddef.h>

#include "bench.h"

#define BENCH_MAX_PCT 16
#define BENCH_MAX_STATUS 16

struct bench_stat {
    size_t n;
    double mean, median, std;  /* ms */
    double pct[BENCH_MAX_PCT]; /* ms, one per requested percentile */
};

struct bench_goodput {
    bool has_ttft, has_tpot, has_e2el;
    double ttft_ms, tpot_ms, e2el_ms;
};

struct bench_metrics {
    int completed, failed;
    long long total_input, total_output;
    double duration_s;
    double request_throughput, request_goodput;       /* req/s; goodput NAN without targets */
    double output_throughput, total_token_throughput; /* tok/s */
    int n_pct;
    double pcts[BENCH_MAX_PCT];
    struct bench_stat ttft, tpot, itl, e2el;
    /* The server's own Timings, over the completed requests that carried them. */
    bool has_server;
    struct bench_stat srv_queue, srv_prefill, srv_ttft, srv_decode, srv_e2e, srv_transfer;
    double max_output_tokens_per_s; /* busiest one-second bucket */
    int max_concurrent_requests;    /* peak of overlapping [start, start + e2el) */
    double mean_user_tok_s;         /* per request: (output - 1) / (E2EL - TTFT), mean */
    /* Failures by status, most frequent first; extra kinds counted in "other". */
    int n_status;
    char status[BENCH_MAX_STATUS][BENCH_STATUS_MAX];
    int status_count[BENCH_MAX_STATUS];
};

/* Percentile p (0..100) of sorted values v (n > 0), linear interpolation. */
double bench_percentile(const double *sorted, size_t n, double p);

/* Fills *out from v (n values in seconds; sorted in place), in ms. */
void bench_stat_compute(double *v, size_t n, const double *pcts, int n_pct, struct bench_stat *out);

/* TPOT of one completed record in seconds (0 with <= 1 output token). */
double bench_record_tpot(const struct bench_record *r);

/* True when the completed record meets every target in g. */
bool bench_record_good(const struct bench_record *r, const struct bench_goodput *g);

/* Computes the metrics of n records over duration_s seconds. `g` may be NULL
 * (no goodput). Returns MOE_ERR_NOMEM on allocation failure. */
enum moe_status bench_metrics_compute(const struct bench_record *recs, size_t n, double duration_s,
                                      const double *pcts, int n_pct, const struct bench_goodput *g,
                                      struct bench_metrics *out);

/* Output tokens and in-flight requests per time bucket of bin_s seconds from
 * t = 0 to duration: malloc'd arrays of *n_bins values (tokens/s, mean
 * concurrency over the bucket). */
enum moe_status bench_timeline(const struct bench_record *recs, size_t n, double duration_s,
                               double bin_s, double **tok_per_s, double **concurrency,
                               size_t *n_bins);

#endif
