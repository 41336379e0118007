/* moe-bench's parts without a server: the metric formulas on constructed
 * records, the SSE parser fed in every split, the workloads (exact lengths,
 * reproducibility, shared prefixes, trace blocks, the committed samples and
 * bad files), the arrival schedule and the record wire form. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "metrics.h"
#include "schedule.h"
#include "sse.h"
#include "testlib.h"
#include "workload.h"

#define NEAR(a, b, tol) (fabs((a) - (b)) <= (tol))

/* A completed record: first token at ttft, then n_out - 1 more tokens `itl` apart. */
static struct bench_record make_rec(int64_t index, double start, double ttft, double itl, int n_out)
{
    struct bench_record r = {0};
    r.index = index;
    r.success = 1;
    r.start_s = start;
    r.input_len = 10;
    r.output_len = n_out;
    for (int k = 0; k < n_out; k++)
        bench_record_add_chunk(&r, ttft + k * itl, 1);
    r.ttft_s = ttft;
    r.e2el_s = ttft + (n_out - 1) * itl;
    r.srv_e2e_ms = NAN;
    snprintf(r.status, sizeof r.status, "OK");
    return r;
}

static void test_percentile(void)
{
    /* numpy: np.percentile([1,2,3,4], [0,25,50,99,100]) = 1, 1.75, 2.5, 3.97, 4 */
    double v[4] = {1, 2, 3, 4};
    CHECK(NEAR(bench_percentile(v, 4, 0), 1, 1e-12));
    CHECK(NEAR(bench_percentile(v, 4, 25), 1.75, 1e-12));
    CHECK(NEAR(bench_percentile(v, 4, 50), 2.5, 1e-12));
    CHECK(NEAR(bench_percentile(v, 4, 99), 3.97, 1e-12));
    CHECK(NEAR(bench_percentile(v, 4, 100), 4, 1e-12));
    double one = 7;
    CHECK(bench_percentile(&one, 1, 99) == 7);
    double s[5] = {5, 1, 4, 2, 3};
    struct bench_stat st;
    double p[2] = {50, 90};
    bench_stat_compute(s, 5, p, 2, &st);
    CHECK(NEAR(st.mean, 3000, 1e-9));
    CHECK(NEAR(st.median, 3000, 1e-9));
    CHECK(NEAR(st.std, sqrt(2.0) * 1e3, 1e-9)); /* population std, as np.std */
    CHECK(NEAR(st.pct[1], 4600, 1e-9));
}

static void test_metrics(void)
{
    /* 4 requests: TTFT 100/300 ms alternating, 5 tokens 20 ms apart; one
     * request of 1 token; one failure. */
    struct bench_record r[6];
    for (int i = 0; i < 4; i++)
        r[i] = make_rec(i, 0.1 * i, i % 2 ? 0.3 : 0.1, 0.02, 5);
    r[4] = make_rec(4, 0.5, 0.05, 0, 1);
    memset(&r[5], 0, sizeof r[5]);
    r[5].index = 5;
    r[5].srv_e2e_ms = NAN;
    snprintf(r[5].status, sizeof r[5].status, "UNAVAILABLE");
    double pct[1] = {99};
    struct bench_goodput g = {.has_ttft = true, .ttft_ms = 200};
    struct bench_metrics m;
    CHECK(bench_metrics_compute(r, 6, 2.0, pct, 1, &g, &m) == MOE_OK);
    CHECK(m.completed == 5 && m.failed == 1);
    CHECK(m.n_status == 1 && !strcmp(m.status[0], "UNAVAILABLE") && m.status_count[0] == 1);
    CHECK(m.total_output == 21 && m.total_input == 50);
    CHECK(NEAR(m.request_throughput, 2.5, 1e-12));
    CHECK(NEAR(m.output_throughput, 10.5, 1e-12));
    CHECK(NEAR(m.total_token_throughput, 35.5, 1e-12));
    /* TPOT = (E2EL - TTFT) / (n - 1) = 20 ms; the 1-token request has none */
    CHECKF(m.tpot.n == 4 && NEAR(m.tpot.mean, 20, 1e-9), "tpot n %zu mean %f", m.tpot.n,
           m.tpot.mean);
    CHECK(m.itl.n == 16 && NEAR(m.itl.mean, 20, 1e-9));
    CHECK(NEAR(m.ttft.mean, (0.1 + 0.3 + 0.1 + 0.3 + 0.05) / 5 * 1e3, 1e-9));
    CHECK(NEAR(m.e2el.mean, (0.18 + 0.38 + 0.18 + 0.38 + 0.05) / 5 * 1e3, 1e-9));
    /* goodput TTFT <= 200 ms: requests 0, 2 and 4 */
    CHECK(NEAR(m.request_goodput, 1.5, 1e-12));
    /* TPOT target 20 ms passes (tpot == 20 exactly is good), 19 ms passes only
     * the 1-token request (TPOT 0 for goodput, as vLLM) */
    g = (struct bench_goodput){.has_tpot = true, .tpot_ms = 19};
    CHECK(bench_metrics_compute(r, 6, 2.0, pct, 1, &g, &m) == MOE_OK);
    CHECK(NEAR(m.request_goodput, 0.5, 1e-12));
    g = (struct bench_goodput){.has_e2el = true, .e2el_ms = 200, .has_ttft = true, .ttft_ms = 80};
    CHECK(bench_metrics_compute(r, 6, 2.0, pct, 1, &g, &m) == MOE_OK);
    CHECK(NEAR(m.request_goodput, 0.5, 1e-12)); /* only request 4 */
    CHECK(bench_metrics_compute(r, 6, 2.0, pct, 1, NULL, &m) == MOE_OK);
    CHECK(isnan(m.request_goodput));
    /* peak concurrency: [0,.18) [.1,.48) [.2,.38) [.3,.68) [.5,.55) -> 3 at t=.3 */
    CHECKF(m.max_concurrent_requests == 3, "peak %d", m.max_concurrent_requests);
    /* per-user speed: 4 tokens in 80 ms = 50 tok/s */
    CHECK(NEAR(m.mean_user_tok_s, 50, 1e-6));
    double *tok = NULL, *conc = NULL;
    size_t nb = 0;
    CHECK(bench_timeline(r, 6, 1.0, 0.5, &tok, &conc, &nb) == MOE_OK);
    CHECK(nb == 2 && NEAR((tok[0] + tok[1]) * 0.5, 21, 1e-9));
    free(tok);
    free(conc);
    for (int i = 0; i < 6; i++)
        bench_record_clear(&r[i]);
}

static void test_pack(void)
{
    struct bench_record r[2] = {make_rec(3, 0.5, 0.1, 0.01, 4), make_rec(7, 0.25, 0.2, 0.02, 2)};
    r[1].success = 0;
    snprintf(r[1].status, sizeof r[1].status, "HTTP 503");
    snprintf(r[1].error, sizeof r[1].error, "overload");
    uint8_t *buf = NULL;
    size_t len = 0, n = 0, cap = 0;
    CHECK(bench_records_pack(r, 2, &buf, &len) == MOE_OK);
    struct bench_record *out = NULL;
    struct moe_error err = {0};
    CHECK(bench_records_unpack(buf, len, &out, &n, &cap, &err) == MOE_OK);
    CHECK(n == 2 && out[0].index == 3 && out[0].n_chunks == 4 &&
          out[0].chunk_t[3] == r[0].chunk_t[3]);
    CHECK(!strcmp(out[1].status, "HTTP 503") && !strcmp(out[1].error, "overload"));
    CHECK(bench_records_unpack(buf, len - 3, &out, &n, &cap, &err) == MOE_ERR_FORMAT);
    for (size_t i = 0; i < n; i++)
        bench_record_clear(&out[i]);
    free(out);
    free(buf);
    bench_record_clear(&r[0]);
    bench_record_clear(&r[1]);
}

struct sse_log {
    char got[8][64];
    int n;
};

static int on_ev(void *user, const char *data, size_t len)
{
    struct sse_log *l = user;
    if (l->n < 8)
        snprintf(l->got[l->n++], 64, "%.*s", (int)len, data);
    return 0;
}

static void test_sse(void)
{
    const char *stream = ": ping\r\n\r\ndata: {\"a\":1}\n\nevent: x\ndata:two\ndata: lines\r\n\r\n"
                         "id: 5\ndata: [DONE]\n\ndata: tail";
    size_t n = strlen(stream);
    /* every split point into two feeds, and byte by byte */
    for (size_t cut = 0; cut <= n; cut++) {
        struct sse_log l = {0};
        struct sse_parser p;
        sse_init(&p, on_ev, &l);
        CHECK(sse_feed(&p, stream, cut) == 0);
        CHECK(sse_feed(&p, stream + cut, n - cut) == 0);
        CHECK(sse_finish(&p) == 0);
        sse_free(&p);
        CHECKF(l.n == 4 && !strcmp(l.got[0], "{\"a\":1}") && !strcmp(l.got[1], "two\nlines") &&
                   !strcmp(l.got[2], "[DONE]") && !strcmp(l.got[3], "tail"),
               "cut %zu: %d events", cut, l.n);
    }
    struct sse_log l = {0};
    struct sse_parser p;
    sse_init(&p, on_ev, &l);
    for (size_t i = 0; i < n; i++)
        sse_feed(&p, stream + i, 1);
    sse_finish(&p);
    sse_free(&p);
    CHECK(l.n == 4);
}

static struct moe_tokenizer *load_tok(void)
{
    struct moe_tokenizer *tok = NULL;
    struct moe_error err = {0};
    if (moe_tokenizer_load(test_src_path("tests/golden/fixtures/qwen3_moe/tokenizer.json"), &tok,
                           &err))
        fprintf(stderr, "tokenizer: %s\n", err.msg);
    return tok;
}

static size_t n_tokens(const struct moe_tokenizer *tok, const char *text)
{
    int32_t *ids = NULL;
    size_t n = 0;
    struct moe_error err = {0};
    if (moe_tokenizer_encode(tok, text, strlen(text), false, &ids, &n, &err))
        return (size_t)-1;
    free(ids);
    return n;
}

static void test_random(const struct moe_tokenizer *tok)
{
    struct bench_workload_opts o = {.kind = BENCH_DS_RANDOM,
                                    .seed = 5,
                                    .tok = tok,
                                    .random_input_len = 40,
                                    .random_output_len = 8,
                                    .random_range_ratio = 0.5};
    struct bench_workload *w = NULL, *w2 = NULL;
    struct moe_error err = {0};
    CHECK(bench_workload_create(&o, &w, &err) == MOE_OK);
    o.want_text = true;
    CHECK(bench_workload_create(&o, &w2, &err) == MOE_OK);
    int exact = 0;
    for (int i = 0; i < 20; i++) {
        struct bench_item a, b, t;
        CHECK(bench_workload_item(w, i, &a, &err) == MOE_OK);
        CHECK(bench_workload_item(w, i, &b, &err) == MOE_OK);
        CHECK(a.n_ids == b.n_ids && !memcmp(a.ids, b.ids, (size_t)a.n_ids * 4));
        CHECK(a.n_ids >= 20 && a.n_ids <= 60 && a.output_len >= 4 && a.output_len <= 12);
        /* text mode: the same lengths, and the text re-tokenizes to input_len */
        CHECK(bench_workload_item(w2, i, &t, &err) == MOE_OK);
        CHECK(t.text && n_tokens(tok, t.text) == (size_t)t.input_len);
        exact += t.input_len == a.n_ids;
        bench_item_clear(&a);
        bench_item_clear(&b);
        bench_item_clear(&t);
    }
    CHECKF(exact >= 18, "%d of 20 text prompts have the exact length", exact);
    /* another seed: other prompts */
    struct bench_workload *w3 = NULL;
    o.seed = 6;
    o.want_text = false;
    CHECK(bench_workload_create(&o, &w3, &err) == MOE_OK);
    struct bench_item a, c;
    bench_workload_item(w, 0, &a, &err);
    bench_workload_item(w3, 0, &c, &err);
    CHECK(a.n_ids != c.n_ids || memcmp(a.ids, c.ids, (size_t)a.n_ids * 4));
    bench_item_clear(&a);
    bench_item_clear(&c);
    bench_workload_destroy(w);
    bench_workload_destroy(w2);
    bench_workload_destroy(w3);
    /* no tokenizer: ids below the vocabulary */
    o = (struct bench_workload_opts){
        .kind = BENCH_DS_RANDOM, .vocab = 50, .random_input_len = 100, .random_output_len = 4};
    CHECK(bench_workload_create(&o, &w, &err) == MOE_OK);
    bench_workload_item(w, 3, &a, &err);
    int below = 1;
    for (int i = 0; i < a.n_ids; i++)
        below &= a.ids[i] >= 0 && a.ids[i] < 50;
    CHECK(a.n_ids == 100 && below);
    bench_item_clear(&a);
    bench_workload_destroy(w);
    o.vocab = 0;
    CHECK(bench_workload_create(&o, &w, &err) == MOE_ERR_INVALID &&
          strstr(err.msg, "--vocab-size"));
}

static void test_prefix(const struct moe_tokenizer *tok)
{
    struct bench_workload_opts o = {.kind = BENCH_DS_PREFIX,
                                    .seed = 1,
                                    .tok = tok,
                                    .prefix_len = 32,
                                    .suffix_len = 8,
                                    .num_prefixes = 3,
                                    .prefix_output_len = 5};
    struct bench_workload *w = NULL;
    struct moe_error err = {0};
    CHECK(bench_workload_create(&o, &w, &err) == MOE_OK);
    struct bench_item a, b, c;
    bench_workload_item(w, 1, &a, &err);
    bench_workload_item(w, 4, &b, &err); /* same prefix (4 % 3 == 1) */
    bench_workload_item(w, 2, &c, &err);
    CHECK(a.n_ids == 40 && b.n_ids == 40 && a.output_len == 5);
    CHECK(!memcmp(a.ids, b.ids, 32 * 4) && memcmp(a.ids + 32, b.ids + 32, 8 * 4));
    CHECK(memcmp(a.ids, c.ids, 32 * 4));
    bench_item_clear(&a);
    bench_item_clear(&b);
    bench_item_clear(&c);
    bench_workload_destroy(w);
}

static const char *write_tmp(const char *name, const char *text)
{
    static char path[256];
    snprintf(path, sizeof path, "/tmp/moe-bench-unit-%d-%s", (int)getpid(), name);
    FILE *f = fopen(path, "w");
    fputs(text, f);
    fclose(f);
    return path;
}

static void expect_bad(const struct moe_tokenizer *tok, enum bench_dataset kind, const char *text,
                       const char *needle)
{
    struct bench_workload_opts o = {.kind = kind, .tok = tok, .trace_block_size = 4};
    o.path = write_tmp("bad", text);
    struct bench_workload *w = NULL;
    struct moe_error err = {0};
    enum moe_status st = bench_workload_create(&o, &w, &err);
    CHECKF(st != MOE_OK && strstr(err.msg, needle) && strstr(err.msg, o.path), "'%s': got '%s'",
           needle, err.msg);
    bench_workload_destroy(w);
    unlink(o.path);
}

static void test_files(const struct moe_tokenizer *tok)
{
    struct moe_error err = {0};
    struct bench_workload *w = NULL;
    /* the committed samples */
    struct bench_workload_opts o = {.kind = BENCH_DS_SHAREGPT,
                                    .tok = tok,
                                    .seed = 3,
                                    .path = test_src_path("bench/workloads/sharegpt_sample.json")};
    CHECKF(bench_workload_create(&o, &w, &err) == MOE_OK, "%s", err.msg);
    if (w) {
        CHECK(bench_workload_size(w) >= 8);
        struct bench_item it;
        CHECK(bench_workload_item(w, 0, &it, &err) == MOE_OK);
        CHECK(it.text && n_tokens(tok, it.text) == (size_t)it.input_len && it.output_len >= 4);
        bench_item_clear(&it);
        bench_workload_destroy(w);
    }
    o = (struct bench_workload_opts){.kind = BENCH_DS_TRACE,
                                     .vocab = 800,
                                     .seed = 3,
                                     .trace_block_size = 16,
                                     .path = test_src_path("bench/workloads/trace_sample.jsonl")};
    CHECKF(bench_workload_create(&o, &w, &err) == MOE_OK, "%s", err.msg);
    if (w) {
        CHECK(bench_workload_size(w) >= 10);
        CHECK(bench_workload_timestamp(w, 0) == 0 && bench_workload_timestamp(w, 1) > 0);
        struct bench_item a, b;
        CHECK(bench_workload_item(w, 0, &a, &err) == MOE_OK);
        CHECK(bench_workload_item(w, 1, &b, &err) == MOE_OK);
        /* lines 0 and 1 of the sample share their first two hash ids */
        CHECK(a.n_ids >= 32 && b.n_ids >= 32 && !memcmp(a.ids, b.ids, 32 * 4));
        bench_item_clear(&a);
        bench_item_clear(&b);
        bench_workload_destroy(w);
    }
    /* bad files, each named with the problem */
    o = (struct bench_workload_opts){
        .kind = BENCH_DS_SHAREGPT, .tok = tok, .path = "/nonexistent/sharegpt.json"};
    CHECK(bench_workload_create(&o, &w, &err) == MOE_ERR_IO &&
          strstr(err.msg, "/nonexistent/sharegpt.json: cannot open"));
    expect_bad(tok, BENCH_DS_SHAREGPT, "{\"a\": 1}", "JSON array");
    expect_bad(tok, BENCH_DS_SHAREGPT, "[{\"id\": \"x\", \"conversation\": []}]",
               "unknown field 'conversation'");
    expect_bad(tok, BENCH_DS_SHAREGPT,
               "[{\"id\": \"x\", \"conversations\": [{\"from\": \"human\", \"text\": \"hi\"}]}]",
               "unknown field 'text'");
    expect_bad(tok, BENCH_DS_SHAREGPT,
               "[{\"id\": 1, \"conversations\": [{\"from\": \"human\", "
               "\"value\": \"a b c d e\"}]}]",
               "no usable conversation");
    expect_bad(tok, BENCH_DS_SHAREGPT, "[1, 2", "not valid JSON");
    expect_bad(tok, BENCH_DS_TRACE,
               "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 2, \"user\": 1}\n",
               ":1: unknown field 'user'");
    expect_bad(tok, BENCH_DS_TRACE,
               "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 2}\n"
               "{\"timestamp\": 10, \"input_length\": 5}\n",
               ":2: missing 'output_length'");
    expect_bad(tok, BENCH_DS_TRACE,
               "{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 2}\n",
               "'input_length' must be a whole number >= 1");
    expect_bad(tok, BENCH_DS_TRACE,
               "{\"timestamp\": 9, \"input_length\": 5, \"output_length\": 2}\n"
               "{\"timestamp\": 3, \"input_length\": 5, \"output_length\": 2}\n",
               ":2: timestamp 3 ms is before");
    expect_bad(
        tok, BENCH_DS_TRACE,
        "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 2, \"hash_ids\": [1, -2]}\n",
        "'hash_ids' entry 1");
    expect_bad(tok, BENCH_DS_TRACE, "not json\n", ":1: not a JSON object");
    expect_bad(tok, BENCH_DS_TRACE, "\n\n", "no trace lines");
}

static void test_schedule(void)
{
    double *t = NULL;
    CHECK(bench_schedule_count(1000, 10, 1, 4, &t) == MOE_OK);
    int sorted = 1;
    for (int i = 1; i < 1000; i++)
        sorted &= t[i] >= t[i - 1];
    CHECK(sorted && NEAR(t[999], 100, 1e-9)); /* scaled to n / rate */
    double *u = NULL;
    CHECK(bench_schedule_count(1000, 10, 1, 4, &u) == MOE_OK);
    CHECK(!memcmp(t, u, 1000 * sizeof(double)));
    free(u);
    /* gamma with burstiness 4 is more even than Poisson: smaller gap spread */
    CHECK(bench_schedule_count(1000, 10, 4, 4, &u) == MOE_OK);
    double v1 = 0, v4 = 0;
    for (int i = 1; i < 1000; i++) {
        v1 += pow(t[i] - t[i - 1] - 0.1, 2);
        v4 += pow(u[i] - u[i - 1] - 0.1, 2);
    }
    CHECKF(v4 < v1 / 2, "gap variance %g (b=4) vs %g (b=1)", v4, v1);
    free(t);
    free(u);
    size_t n = 0;
    CHECK(bench_schedule_duration(50, 20, 1, 1, &t, &n) == MOE_OK);
    CHECKF(n > 850 && n < 1150 && t[n - 1] < 50, "%zu arrivals in 50 s at 20/s", n);
    free(t);
    CHECK(bench_schedule_count(3, INFINITY, 1, 0, &t) == MOE_OK);
    CHECK(t[0] == 0 && t[2] == 0);
    free(t);
}

int main(void)
{
    test_percentile();
    test_metrics();
    test_pack();
    test_sse();
    test_schedule();
    struct moe_tokenizer *tok = load_tok();
    CHECK(tok != NULL);
    if (tok) {
        test_random(tok);
        test_prefix(tok);
        test_files(tok);
        moe_tokenizer_free(tok);
    }
    return test_summary();
}
