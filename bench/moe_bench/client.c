/* Targets and request dispatch (client.h); the backends are in
 * client_grpc.c and client_openai.c. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"

enum moe_status bench_target_create(const struct bench_target_opts *opts, struct bench_target **out,
                                    struct moe_error *err)
{
    struct bench_target *t = calloc(1, sizeof(*t));
    if (!t)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    t->o = *opts;
    snprintf(t->url, sizeof t->url, "%s", opts->url);
    if (opts->model)
        snprintf(t->model, sizeof t->model, "%s", opts->model);
    if (opts->backend == BENCH_BACKEND_GRPC) {
        const char *a = opts->url;
        if (!strncmp(a, "grpc://", 7))
            a += 7;
        if (strstr(a, "://") || !strchr(a, ':')) {
            moe_error_set(err, MOE_ERR_INVALID,
                          "--base-url '%s': a gRPC target is HOST:PORT (or grpc://HOST:PORT)",
                          opts->url);
            goto fail;
        }
        snprintf(t->addr, sizeof t->addr, "%s", a);
        size_t n = strlen(t->addr);
        while (n && t->addr[n - 1] == '/')
            t->addr[--n] = 0;
        struct rpc_client_options ro = {.tls = opts->tls, .token = opts->api_key};
        t->rpc = rpc_client_create(t->addr, &ro, err);
        if (!t->rpc) {
            moe_error_prefix(err, "--base-url '%s'", opts->url);
            goto fail;
        }
    } else {
        if (strncmp(opts->url, "http://", 7) && strncmp(opts->url, "https://", 8)) {
            moe_error_set(err, MOE_ERR_INVALID,
                          "--base-url '%s': an OpenAI server's URL starts with http:// or "
                          "https://",
                          opts->url);
            goto fail;
        }
        const char *ep = opts->endpoint ? opts->endpoint : "/v1/completions";
        if (strcmp(ep, "/v1/completions") && strcmp(ep, "/v1/chat/completions")) {
            moe_error_set(err, MOE_ERR_INVALID,
                          "--endpoint '%s': must be /v1/completions or /v1/chat/completions", ep);
            goto fail;
        }
        t->chat = !strcmp(ep, "/v1/chat/completions");
        char base[512];
        snprintf(base, sizeof base, "%s", opts->url);
        size_t n = strlen(base);
        while (n && base[n - 1] == '/')
            base[--n] = 0;
        /* A base URL given with /v1 (as OpenAI SDKs take it) is accepted too. */
        if (n >= 3 && !strcmp(base + n - 3, "/v1")) {
            base[n - 3] = 0;
        }
        snprintf(t->api_url, sizeof t->api_url, "%s%s", base, ep);
        snprintf(t->models_url, sizeof t->models_url, "%s/v1/models", base);
        if (t->chat && opts->prompt_tokens) {
            moe_error_set(err, MOE_ERR_INVALID,
                          "--prompt-format tokens: the chat endpoint takes text messages only");
            goto fail;
        }
    }
    *out = t;
    return MOE_OK;
fail:
    bench_target_destroy(t);
    return err->code;
}

void bench_target_destroy(struct bench_target *t)
{
    if (!t)
        return;
    rpc_client_destroy(t->rpc);
    free(t);
}

const char *bench_target_url(const struct bench_target *t)
{
    return t->url;
}

enum moe_status bench_target_probe(struct bench_target *t, double timeout_s, char *model,
                                   size_t model_cap, int *vocab, struct moe_error *err)
{
    *vocab = 0;
    if (model_cap)
        model[0] = 0;
    enum moe_status st = t->o.backend == BENCH_BACKEND_GRPC
                             ? bench_grpc_probe(t, timeout_s, model, model_cap, vocab, err)
                             : bench_openai_probe(t, timeout_s, model, model_cap, vocab, err);
    if (st == MOE_OK && !t->o.model && model_cap && t->o.backend == BENCH_BACKEND_OPENAI)
        snprintf(t->model, sizeof t->model, "%s", model);
    return st;
}

struct bench_conn *bench_conn_create(struct bench_target *t)
{
    struct bench_conn *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->t = t;
    if (t->o.backend == BENCH_BACKEND_OPENAI) {
        c->curl = curl_easy_init();
        if (!c->curl) {
            free(c);
            return NULL;
        }
    }
    return c;
}

void bench_conn_destroy(struct bench_conn *c)
{
    if (!c)
        return;
    if (c->curl)
        curl_easy_cleanup(c->curl);
    free(c);
}

void bench_fail(struct bench_record *rec, const char *status, const char *fmt, ...)
{
    rec->success = 0;
    snprintf(rec->status, sizeof rec->status, "%s", status);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rec->error, sizeof rec->error, fmt, ap);
    va_end(ap);
    for (char *p = rec->error; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';
}

void bench_finish_ok(struct bench_record *rec)
{
    rec->success = 1;
    snprintf(rec->status, sizeof rec->status, "OK");
    rec->error[0] = 0;
    rec->ttft_s = rec->chunk_t[0];
    rec->e2el_s = rec->chunk_t[rec->n_chunks - 1];
}

void bench_conn_run(struct bench_conn *c, const struct bench_item *item, const char *request_id,
                    double t_origin, struct bench_record *rec)
{
    rec->success = 0;
    rec->server_prompt_tokens = rec->server_completion_tokens = rec->server_cached_tokens = -1;
    rec->srv_queue_ms = rec->srv_prefill_ms = rec->srv_ttft_ms = NAN;
    rec->srv_decode_ms = rec->srv_e2e_ms = rec->srv_transfer_ms = NAN;
    rec->expected_output_len = item->output_len;
    rec->input_len = item->input_len;
    if (c->t->o.backend == BENCH_BACKEND_GRPC)
        bench_grpc_run(c, item, request_id, t_origin, rec);
    else
        bench_openai_run(c, item, request_id, t_origin, rec);
    if (rec->success) {
        if (rec->server_prompt_tokens > 0)
            rec->input_len = rec->server_prompt_tokens;
        rec->output_len = rec->server_completion_tokens >= 0 ? rec->server_completion_tokens
                                                             : rec->counted_tokens;
    } else {
        rec->output_len = 0;
    }
}
