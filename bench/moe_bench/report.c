/* Summary table, result JSON and per-request JSONL (report.h). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "report.h"

void bench_pct_name(double p, char *buf, size_t cap)
{
    if (p == floor(p))
        snprintf(buf, cap, "p%d", (int)p);
    else
        snprintf(buf, cap, "p%g", p);
}

static void row_i(FILE *f, const char *name, long long v)
{
    fprintf(f, "%-40s %-10lld\n", name, v);
}

static void row_f(FILE *f, const char *name, double v)
{
    fprintf(f, "%-40s %-10.2f\n", name, v);
}

static void header(FILE *f, const char *title, char fill)
{
    int n = (int)strlen(title), left = (50 - n) / 2, right = 50 - n - left;
    for (int i = 0; i < left; i++)
        fputc(fill, f);
    fputs(title, f);
    for (int i = 0; i < right; i++)
        fputc(fill, f);
    fputc('\n', f);
}

static void stat_rows(FILE *f, const struct bench_metrics *m, const char *title, const char *name,
                      const struct bench_stat *s)
{
    char buf[96], pn[32];
    header(f, title, '-');
    snprintf(buf, sizeof buf, "Mean %s (ms):", name);
    row_f(f, buf, s->mean);
    snprintf(buf, sizeof buf, "Median %s (ms):", name);
    row_f(f, buf, s->median);
    for (int i = 0; i < m->n_pct; i++) {
        bench_pct_name(m->pcts[i], pn, sizeof pn);
        pn[0] = 'P';
        snprintf(buf, sizeof buf, "%s %s (ms):", pn, name);
        row_f(f, buf, s->pct[i]);
    }
}

void bench_report_print(FILE *f, const struct bench_report_info *info,
                        const struct bench_metrics *m)
{
    header(f, " Serving Benchmark Result ", '=');
    fprintf(f, "%-40s %s\n", "Backend:", info->backend);
    fprintf(f, "%-40s %d / %s\n", "Ranks / targets:", info->n_ranks, info->targets);
    row_i(f, "Successful requests:", m->completed);
    row_i(f, "Failed requests:", m->failed);
    for (int i = 0; i < m->n_status; i++) {
        char buf[96];
        snprintf(buf, sizeof buf, "  failed with %s:", m->status[i]);
        row_i(f, buf, m->status_count[i]);
    }
    if (info->max_concurrency)
        row_i(f, "Maximum request concurrency:", info->max_concurrency);
    if (!isinf(info->request_rate))
        row_f(f, "Request rate configured (RPS):", info->request_rate);
    row_f(f, "Benchmark duration (s):", m->duration_s);
    row_i(f, "Total input tokens:", m->total_input);
    row_i(f, "Total generated tokens:", m->total_output);
    row_f(f, "Request throughput (req/s):", m->request_throughput);
    if (!isnan(m->request_goodput))
        row_f(f, "Request goodput (req/s):", m->request_goodput);
    row_f(f, "Output token throughput (tok/s):", m->output_throughput);
    row_f(f, "Peak output token throughput (tok/s):", m->max_output_tokens_per_s);
    row_i(f, "Peak concurrent requests:", m->max_concurrent_requests);
    row_f(f, "Total token throughput (tok/s):", m->total_token_throughput);
    row_f(f, "Mean per-user speed (tok/s):", m->mean_user_tok_s);
    if (info->show[0])
        stat_rows(f, m, "Time to First Token", "TTFT", &m->ttft);
    if (info->show[1])
        stat_rows(f, m, "Time per Output Token (excl. 1st token)", "TPOT", &m->tpot);
    if (info->show[2])
        stat_rows(f, m, "Inter-token Latency", "ITL", &m->itl);
    if (info->show[3])
        stat_rows(f, m, "End-to-end Latency", "E2EL", &m->e2el);
    if (m->has_server) {
        header(f, "Server Timings (gRPC Timings)", '-');
        row_f(f, "Mean server queue (ms):", m->srv_queue.mean);
        row_f(f, "Mean server prefill (ms):", m->srv_prefill.mean);
        row_f(f, "Mean server TTFT (ms):", m->srv_ttft.mean);
        row_f(f, "Median server TTFT (ms):", m->srv_ttft.median);
        row_f(f, "Mean server decode (ms):", m->srv_decode.mean);
        row_f(f, "Mean server E2E (ms):", m->srv_e2e.mean);
        row_f(f, "Mean KV transfer (ms):", m->srv_transfer.mean);
    }
    header(f, "", '=');
    fflush(f);
}

static void add_stat(cJSON *o, const struct bench_metrics *m, const char *name,
                     const struct bench_stat *s)
{
    char key[80], pn[32];
    snprintf(key, sizeof key, "mean_%s_ms", name);
    cJSON_AddNumberToObject(o, key, s->mean);
    snprintf(key, sizeof key, "median_%s_ms", name);
    cJSON_AddNumberToObject(o, key, s->median);
    snprintf(key, sizeof key, "std_%s_ms", name);
    cJSON_AddNumberToObject(o, key, s->std);
    for (int i = 0; i < m->n_pct; i++) {
        bench_pct_name(m->pcts[i], pn, sizeof pn);
        snprintf(key, sizeof key, "%s_%s_ms", pn, name);
        cJSON_AddNumberToObject(o, key, s->pct[i]);
    }
}

static enum moe_status write_text(const char *path, const char *text, struct moe_error *err)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return moe_error_set(err, MOE_ERR_IO, "%s: cannot write: %s", path, strerror(errno));
    bool ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    ok = (fclose(f) == 0) && ok;
    if (!ok)
        return moe_error_set(err, MOE_ERR_IO, "%s: write failed", path);
    return MOE_OK;
}

static void add_num_or_null(cJSON *o, const char *key, double v)
{
    if (isnan(v) || isinf(v))
        cJSON_AddNullToObject(o, key);
    else
        cJSON_AddNumberToObject(o, key, v);
}

enum moe_status bench_report_save(const char *path, const struct bench_report_info *info,
                                  const struct bench_metrics *m, const struct bench_record *recs,
                                  size_t n, struct moe_error *err)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    char date[32];
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    strftime(date, sizeof date, "%Y%m%d-%H%M%S", &tm);
    cJSON_AddStringToObject(o, "date", date);
    cJSON_AddStringToObject(o, "endpoint_type", info->backend);
    cJSON_AddStringToObject(o, "backend", info->backend);
    if (info->label)
        cJSON_AddStringToObject(o, "label", info->label);
    else
        cJSON_AddNullToObject(o, "label");
    cJSON_AddStringToObject(o, "model_id", info->model_id ? info->model_id : "");
    if (info->tokenizer_id)
        cJSON_AddStringToObject(o, "tokenizer_id", info->tokenizer_id);
    else
        cJSON_AddNullToObject(o, "tokenizer_id");
    if (info->num_prompts >= 0)
        cJSON_AddNumberToObject(o, "num_prompts", (double)info->num_prompts);
    else
        cJSON_AddNullToObject(o, "num_prompts");
    if (isinf(info->request_rate))
        cJSON_AddStringToObject(o, "request_rate", "inf");
    else
        cJSON_AddNumberToObject(o, "request_rate", info->request_rate);
    cJSON_AddNumberToObject(o, "burstiness", info->burstiness);
    if (info->max_concurrency)
        cJSON_AddNumberToObject(o, "max_concurrency", info->max_concurrency);
    else
        cJSON_AddNullToObject(o, "max_concurrency");
    cJSON_AddNumberToObject(o, "duration", m->duration_s);
    cJSON_AddNumberToObject(o, "completed", m->completed);
    cJSON_AddNumberToObject(o, "failed", m->failed);
    cJSON_AddNumberToObject(o, "total_input_tokens", (double)m->total_input);
    cJSON_AddNumberToObject(o, "total_output_tokens", (double)m->total_output);
    cJSON_AddNumberToObject(o, "request_throughput", m->request_throughput);
    add_num_or_null(o, "request_goodput", m->request_goodput);
    cJSON_AddNumberToObject(o, "output_throughput", m->output_throughput);
    cJSON_AddNumberToObject(o, "total_token_throughput", m->total_token_throughput);
    cJSON *in = cJSON_AddArrayToObject(o, "input_lens");
    cJSON *out = cJSON_AddArrayToObject(o, "output_lens");
    cJSON *ttfts = cJSON_AddArrayToObject(o, "ttfts");
    cJSON *itls = cJSON_AddArrayToObject(o, "itls");
    cJSON *lat = cJSON_AddArrayToObject(o, "latencies");
    cJSON *starts = cJSON_AddArrayToObject(o, "start_times");
    cJSON *queue = cJSON_AddArrayToObject(o, "queue_times");
    cJSON *errs = cJSON_AddArrayToObject(o, "errors");
    cJSON *ids = cJSON_AddArrayToObject(o, "request_ids");
    cJSON *ranks = cJSON_AddArrayToObject(o, "ranks");
    for (size_t i = 0; i < n; i++) {
        const struct bench_record *r = &recs[i];
        cJSON_AddItemToArray(in, cJSON_CreateNumber(r->input_len));
        cJSON_AddItemToArray(out, cJSON_CreateNumber(r->output_len));
        cJSON_AddItemToArray(ttfts, cJSON_CreateNumber(r->success ? r->ttft_s : 0));
        cJSON *il = cJSON_CreateArray();
        for (int c = 1; r->success && c < r->n_chunks; c++)
            cJSON_AddItemToArray(il, cJSON_CreateNumber(r->chunk_t[c] - r->chunk_t[c - 1]));
        cJSON_AddItemToArray(itls, il);
        cJSON_AddItemToArray(lat, cJSON_CreateNumber(r->success ? r->e2el_s : 0));
        cJSON_AddItemToArray(starts, cJSON_CreateNumber(r->start_s));
        cJSON_AddItemToArray(queue, cJSON_CreateNumber(r->start_s - r->arrival_s));
        char e[BENCH_STATUS_MAX + BENCH_ERROR_MAX + 4] = "";
        if (!r->success)
            snprintf(e, sizeof e, "%s: %s", r->status, r->error);
        cJSON_AddItemToArray(errs, cJSON_CreateString(e));
        char rid[128];
        snprintf(rid, sizeof rid, "%s%lld", info->rid_prefix, (long long)r->index);
        cJSON_AddItemToArray(ids, cJSON_CreateString(rid));
        cJSON_AddItemToArray(ranks, cJSON_CreateNumber(r->rank));
    }
    cJSON_AddNumberToObject(o, "max_output_tokens_per_s", m->max_output_tokens_per_s);
    cJSON_AddNumberToObject(o, "max_concurrent_requests", m->max_concurrent_requests);
    add_stat(o, m, "ttft", &m->ttft);
    add_stat(o, m, "tpot", &m->tpot);
    add_stat(o, m, "itl", &m->itl);
    add_stat(o, m, "e2el", &m->e2el);
    /* moe-bench's own */
    cJSON_AddStringToObject(o, "dataset_name", info->dataset_name);
    cJSON_AddStringToObject(o, "endpoint", info->endpoint ? info->endpoint : "");
    cJSON_AddStringToObject(o, "targets", info->targets);
    cJSON_AddNumberToObject(o, "num_ranks", info->n_ranks);
    cJSON_AddNumberToObject(o, "seed", (double)info->seed);
    cJSON_AddBoolToObject(o, "fixed_schedule", info->fixed_schedule);
    if (info->duration_goal > 0)
        cJSON_AddNumberToObject(o, "duration_goal", info->duration_goal);
    cJSON_AddNumberToObject(o, "mean_user_tok_s", m->mean_user_tok_s);
    if (info->goodput) {
        cJSON *g = cJSON_AddObjectToObject(o, "goodput_config");
        if (info->goodput->has_ttft)
            cJSON_AddNumberToObject(g, "ttft", info->goodput->ttft_ms);
        if (info->goodput->has_tpot)
            cJSON_AddNumberToObject(g, "tpot", info->goodput->tpot_ms);
        if (info->goodput->has_e2el)
            cJSON_AddNumberToObject(g, "e2el", info->goodput->e2el_ms);
    }
    cJSON *fs = cJSON_AddObjectToObject(o, "failures_by_status");
    for (int i = 0; i < m->n_status; i++)
        cJSON_AddNumberToObject(fs, m->status[i], m->status_count[i]);
    if (m->has_server) {
        cJSON *s = cJSON_AddObjectToObject(o, "server_timings");
        add_stat(s, m, "server_queue", &m->srv_queue);
        add_stat(s, m, "server_prefill", &m->srv_prefill);
        add_stat(s, m, "server_ttft", &m->srv_ttft);
        add_stat(s, m, "server_decode", &m->srv_decode);
        add_stat(s, m, "server_e2e", &m->srv_e2e);
        add_stat(s, m, "server_transfer", &m->srv_transfer);
    }
    char *text = cJSON_Print(o);
    cJSON_Delete(o);
    if (!text)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", path);
    enum moe_status st = write_text(path, text, err);
    free(text);
    return st;
}

enum moe_status bench_report_requests(const char *path, const struct bench_report_info *info,
                                      const struct bench_record *recs, size_t n,
                                      struct moe_error *err)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return moe_error_set(err, MOE_ERR_IO, "%s: cannot write: %s", path, strerror(errno));
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) {
        const struct bench_record *r = &recs[i];
        cJSON *o = cJSON_CreateObject();
        if (!o) {
            ok = false;
            break;
        }
        char rid[128];
        snprintf(rid, sizeof rid, "%s%lld", info->rid_prefix, (long long)r->index);
        cJSON_AddStringToObject(o, "request_id", rid);
        cJSON_AddNumberToObject(o, "index", (double)r->index);
        cJSON_AddNumberToObject(o, "rank", r->rank);
        cJSON_AddNumberToObject(o, "target", r->target);
        cJSON_AddBoolToObject(o, "success", r->success);
        cJSON_AddStringToObject(o, "status", r->status);
        cJSON_AddStringToObject(o, "error", r->error);
        cJSON_AddStringToObject(o, "finish_reason", r->finish);
        cJSON_AddNumberToObject(o, "arrival_s", r->arrival_s);
        cJSON_AddNumberToObject(o, "start_s", r->start_s);
        cJSON_AddNumberToObject(o, "input_len", r->input_len);
        cJSON_AddNumberToObject(o, "output_len", r->output_len);
        cJSON_AddNumberToObject(o, "expected_output_len", r->expected_output_len);
        cJSON_AddNumberToObject(o, "counted_tokens", r->counted_tokens);
        if (r->server_prompt_tokens >= 0)
            cJSON_AddNumberToObject(o, "server_prompt_tokens", r->server_prompt_tokens);
        if (r->server_completion_tokens >= 0)
            cJSON_AddNumberToObject(o, "server_completion_tokens", r->server_completion_tokens);
        if (r->server_cached_tokens >= 0)
            cJSON_AddNumberToObject(o, "server_cached_tokens", r->server_cached_tokens);
        if (r->success) {
            cJSON_AddNumberToObject(o, "ttft_ms", r->ttft_s * 1e3);
            cJSON_AddNumberToObject(o, "tpot_ms", bench_record_tpot(r) * 1e3);
            cJSON_AddNumberToObject(o, "e2el_ms", r->e2el_s * 1e3);
        }
        cJSON *il = cJSON_AddArrayToObject(o, "itl_ms");
        for (int c = 1; c < r->n_chunks; c++)
            cJSON_AddItemToArray(il, cJSON_CreateNumber((r->chunk_t[c] - r->chunk_t[c - 1]) * 1e3));
        bool multi = false;
        for (int c = 0; c < r->n_chunks; c++)
            multi = multi || r->chunk_n[c] != 1;
        if (multi) {
            cJSON *cn = cJSON_AddArrayToObject(o, "chunk_tokens");
            for (int c = 0; c < r->n_chunks; c++)
                cJSON_AddItemToArray(cn, cJSON_CreateNumber(r->chunk_n[c]));
        }
        if (!isnan(r->srv_e2e_ms)) {
            cJSON *s = cJSON_AddObjectToObject(o, "server_timings");
            cJSON_AddNumberToObject(s, "queue_ms", r->srv_queue_ms);
            cJSON_AddNumberToObject(s, "prefill_ms", r->srv_prefill_ms);
            cJSON_AddNumberToObject(s, "ttft_ms", r->srv_ttft_ms);
            cJSON_AddNumberToObject(s, "decode_ms", r->srv_decode_ms);
            cJSON_AddNumberToObject(s, "e2e_ms", r->srv_e2e_ms);
            cJSON_AddNumberToObject(s, "transfer_ms", r->srv_transfer_ms);
        }
        char *line = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        ok = line && fputs(line, f) >= 0 && fputc('\n', f) != EOF;
        free(line);
    }
    ok = (fclose(f) == 0) && ok;
    if (!ok)
        return moe_error_set(err, MOE_ERR_IO, "%s: write failed", path);
    return MOE_OK;
}
