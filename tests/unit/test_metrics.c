/* The metrics registry: values, the exposition text (exact lines), labels
 * and escaping, re-registration, bad names, NULL handles, collectors, and
 * exact totals under concurrent recording. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"
#include "testlib.h"

static char *render(struct moe_metrics *m)
{
    char *t = NULL;
    size_t n = 0;
    struct moe_error err;
    CHECK(moe_metrics_render(m, &t, &n, &err) == MOE_OK);
    CHECK(t && strlen(t) == n);
    return t;
}

static bool has_line(const char *text, const char *line)
{
    size_t n = strlen(line);
    for (const char *p = text; (p = strstr(p, line)); p++)
        if ((p == text || p[-1] == '\n') && (p[n] == '\n' || p[n] == '\0'))
            return true;
    return false;
}

#define HAS(text, line) CHECKF(has_line(text, line), "missing line '%s' in:\n%s", line, text)

static void test_values_and_text(void)
{
    struct moe_metrics *m = moe_metrics_create();
    struct moe_error err;
    CHECK(moe_metrics_set_label(m, "model_name", "tiny \"q\"\\\n", &err) == MOE_OK);
    CHECK(moe_metrics_set_label(m, "bad-name", "x", &err) == MOE_ERR_INVALID);
    struct moe_counter *c =
        moe_metrics_counter(m, "vllm:prompt_tokens_total", "Prompt tokens.", NULL);
    moe_counter_add(c, 5);
    moe_counter_inc(c);
    CHECK(moe_counter_value(c) == 6);
    struct moe_counter *stop = moe_metrics_counter(m, "vllm:request_success_total", "Finished.",
                                                   "finished_reason", "stop", NULL);
    struct moe_counter *len = moe_metrics_counter(m, "vllm:request_success_total", "Finished.",
                                                  "finished_reason", "length", NULL);
    CHECK(stop && len && stop != len);
    CHECK(moe_metrics_counter(m, "vllm:request_success_total", "Finished.", "finished_reason",
                              "stop", NULL) == stop);
    moe_counter_inc(stop);
    moe_counter_add_f(len, 0.25);
    struct moe_gauge *g = moe_metrics_gauge(m, "moe_g", "A gauge\nwith a newline.", NULL);
    moe_gauge_set(g, 2.5);
    moe_gauge_add(g, -1);
    CHECK(moe_gauge_value(g) == 1.5);
    const double b[] = {0.1, 1, 10};
    struct moe_histogram *h =
        moe_metrics_histogram(m, "moe_h_seconds", "Times.", b, 3, "phase", "a", NULL);
    moe_histogram_observe(h, 0.05);
    moe_histogram_observe(h, 0.1); /* le is inclusive */
    moe_histogram_observe(h, 5);
    moe_histogram_observe(h, 100);
    CHECK(moe_histogram_count(h) == 4);
    /* Wrong kind, other buckets, bad names: NULL, and NULL records nothing. */
    CHECK(moe_metrics_gauge(m, "vllm:prompt_tokens_total", "x", NULL) == NULL);
    const double b2[] = {1, 2};
    CHECK(moe_metrics_histogram(m, "moe_h_seconds", "x", b2, 2, NULL) == NULL);
    const double bad_b[] = {2, 1};
    CHECK(moe_metrics_histogram(m, "moe_h2", "x", bad_b, 2, NULL) == NULL);
    CHECK(moe_metrics_counter(m, "1abc", "x", NULL) == NULL);
    CHECK(moe_metrics_counter(m, "a b", "x", NULL) == NULL);
    CHECK(moe_metrics_counter(m, "ok_name", "x", "le", "1", NULL) == NULL);
    CHECK(moe_metrics_counter(m, "ok_name", "x", "bad-label", "1", NULL) == NULL);
    moe_counter_inc(NULL);
    moe_gauge_set(NULL, 1);
    moe_histogram_observe(NULL, 1);

    char *t = render(m);
    const char *L = "model_name=\"tiny \\\"q\\\"\\\\\\n\"";
    char line[512];
    HAS(t, "# HELP vllm:prompt_tokens_total Prompt tokens.");
    HAS(t, "# TYPE vllm:prompt_tokens_total counter");
    snprintf(line, sizeof line, "vllm:prompt_tokens_total{%s} 6", L);
    HAS(t, line);
    snprintf(line, sizeof line, "vllm:request_success_total{%s,finished_reason=\"stop\"} 1", L);
    HAS(t, line);
    snprintf(line, sizeof line, "vllm:request_success_total{%s,finished_reason=\"length\"} 0.25",
             L);
    HAS(t, line);
    HAS(t, "# HELP moe_g A gauge\\nwith a newline.");
    HAS(t, "# TYPE moe_g gauge");
    snprintf(line, sizeof line, "moe_g{%s} 1.5", L);
    HAS(t, line);
    HAS(t, "# TYPE moe_h_seconds histogram");
    const char *want[] = {"le=\"0.1\"} 2", "le=\"1\"} 2", "le=\"10\"} 3", "le=\"+Inf\"} 4"};
    for (int i = 0; i < 4; i++) {
        snprintf(line, sizeof line, "moe_h_seconds_bucket{%s,phase=\"a\",%s", L, want[i]);
        HAS(t, line);
    }
    CHECKF(strstr(t, "moe_h_seconds_sum{") != NULL, "no _sum in %s", t);
    snprintf(line, sizeof line, "moe_h_seconds_count{%s,phase=\"a\"} 4", L);
    HAS(t, line);
    CHECK(t[strlen(t) - 1] == '\n');
    free(t);
    moe_metrics_destroy(m);
    moe_metrics_destroy(NULL);
}

static void collect(void *user, struct moe_metrics_out *out)
{
    int *calls = user;
    (*calls)++;
    moe_metrics_out_family(out, "moe_collected", "gauge", "From a collector.");
    char esc[64], labels[96];
    moe_metrics_escape(esc, sizeof esc, "w\"1");
    snprintf(labels, sizeof labels, "worker=\"%s\"", esc);
    moe_metrics_out_sample(out, "moe_collected", labels, 7);
    moe_metrics_out_sample(out, "moe_collected", NULL, 1.0 / 0.0);
}

static void test_collector(void)
{
    struct moe_metrics *m = moe_metrics_create();
    int calls = 0;
    struct moe_error err;
    CHECK(moe_metrics_add_collector(m, collect, &calls, &err) == MOE_OK);
    char *t = render(m);
    CHECK(calls == 1);
    HAS(t, "# TYPE moe_collected gauge");
    HAS(t, "moe_collected{worker=\"w\\\"1\"} 7");
    HAS(t, "moe_collected +Inf");
    free(t);
    moe_metrics_destroy(m);
}

struct worker_arg {
    struct moe_counter *c;
    struct moe_histogram *h;
    struct moe_gauge *g;
};

#define N_THREADS 4
#define N_ITER 100000

static void *hammer(void *p)
{
    struct worker_arg *a = p;
    for (int i = 0; i < N_ITER; i++) {
        moe_counter_inc(a->c);
        moe_histogram_observe(a->h, (i % 3) * 0.5);
        moe_gauge_add(a->g, 1);
    }
    return NULL;
}

static void test_concurrent(void)
{
    struct moe_metrics *m = moe_metrics_create();
    const double b[] = {0.25, 0.75};
    struct worker_arg a = {moe_metrics_counter(m, "moe_c_total", "c", NULL),
                           moe_metrics_histogram(m, "moe_h", "h", b, 2, NULL),
                           moe_metrics_gauge(m, "moe_g", "g", NULL)};
    pthread_t th[N_THREADS];
    for (int i = 0; i < N_THREADS; i++)
        pthread_create(&th[i], NULL, hammer, &a);
    for (int i = 0; i < N_THREADS; i++)
        pthread_join(th[i], NULL);
    CHECK(moe_counter_value(a.c) == (double)N_THREADS * N_ITER);
    CHECK(moe_histogram_count(a.h) == (uint64_t)N_THREADS * N_ITER);
    CHECK(moe_gauge_value(a.g) == (double)N_THREADS * N_ITER);
    char *t = render(m);
    char line[128];
    /* i % 3 in {0, 1, 2} -> 0, 0.5, 1.0: a third per bucket. */
    int third = N_THREADS * (N_ITER / 3 + 1); /* 100000 = 3 * 33333 + 1: one more 0 */
    snprintf(line, sizeof line, "moe_h_bucket{le=\"0.25\"} %d", third);
    HAS(t, line);
    free(t);
    moe_metrics_destroy(m);
}

int main(void)
{
    test_values_and_text();
    test_collector();
    test_concurrent();
    return test_summary();
}
