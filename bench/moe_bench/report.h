/* What moe-bench writes: the summary table (the layout of `vllm bench
 * serve`), the result JSON (vLLM's key names where the meaning is the same,
 * so scripts that read vLLM results read these; moe-bench's own additions
 * beside them), and one JSON line per request. */
#ifndef MOE_BENCH_REPORT_H
#define MOE_BENCH_REPORT_H

#include <stdbool.h>
#include <stdio.h>

#include "metrics.h"

struct bench_report_info {
    const char *backend, *endpoint, *label, *model_id, *tokenizer_id, *dataset_name;
    const char *targets; /* the --base-url list */
    const char *rid_prefix;
    long num_prompts;     /* -1 with --duration */
    double duration_goal; /* --duration, 0 if none */
    double request_rate;  /* INFINITY for inf */
    double burstiness;
    int max_concurrency; /* 0: none */
    int n_ranks;
    unsigned long long seed;
    bool fixed_schedule;
    const struct bench_goodput *goodput; /* NULL: none */
    bool show[4];                        /* ttft, tpot, itl, e2el in the table */
};

void bench_report_print(FILE *f, const struct bench_report_info *info,
                        const struct bench_metrics *m);

/* The result JSON (records sorted by index by the caller). */
enum moe_status bench_report_save(const char *path, const struct bench_report_info *info,
                                  const struct bench_metrics *m, const struct bench_record *recs,
                                  size_t n, struct moe_error *err);

/* One JSON object per line per request. */
enum moe_status bench_report_requests(const char *path, const struct bench_report_info *info,
                                      const struct bench_record *recs, size_t n,
                                      struct moe_error *err);

/* "p99", "p99.9": vLLM's name for a percentile. */
void bench_pct_name(double p, char *buf, size_t cap);

#endif
