/* The coordinator's Prometheus series. Every request of either front door
 * (gRPC Inference, OpenAI HTTP) passes through forward.c, which records it
 * here with one call per event; the names are vLLM's where the meaning is
 * the same (the coordinator is the API server of the cluster: the
 * request-level series live here, the engine-level ones on the workers).
 *
 *   vllm:request_success_total{finished_reason}   stop | length | abort | error
 *   vllm:prompt_tokens_total, vllm:generation_tokens_total
 *   vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
 *   vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds,
 *   vllm:request_prefill_time_seconds, vllm:request_decode_time_seconds,
 *   vllm:request_prompt_tokens, vllm:request_generation_tokens   (histograms)
 *   moe_request_failures_total{code}               ended with a gRPC status
 *   moe_kv_handoff_total, moe_kv_handoff_failures_total{reason},
 *   moe_kv_handoff_seconds
 *   moe_http_requests_total{path,status}
 * and, collected at scrape time from the cluster view:
 *   moe_coordinator_requests_running, moe_coordinator_workers{state},
 *   moe_worker_up / moe_worker_requests_running / _waiting /
 *   moe_worker_kv_cache_usage_perc {worker}, moe_placement_epoch */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"

static const double TOKEN_BUCKETS[] = {1,   2,    5,    10,   20,    50,    100,   200,
                                       500, 1000, 2000, 5000, 10000, 20000, 50000, 100000};

struct coord_metrics {
    struct coord *c;
    struct moe_metrics *reg;
    struct moe_counter *success[5]; /* by Moe__V1__FinishReason */
    struct moe_counter *prompt_tokens, *generation_tokens;
    struct moe_histogram *ttft, *itl, *e2e, *queue, *prefill, *decode, *prompt_len, *gen_len;
    struct moe_counter *handoffs;
    struct moe_histogram *handoff_s;
};

struct moe_metrics *coord_metrics_registry(struct coord_metrics *m)
{
    return m ? m->reg : NULL;
}

static void collect(void *user, struct moe_metrics_out *out)
{
    struct coord_metrics *m = user;
    struct coord *c = m->c;
    char labels[COORD_ID_MAX * 2 + 32], id[COORD_ID_MAX * 2];
    pthread_mutex_lock(&c->mu);
    int running = c->n_running;
    int n_state[4] = {0};
    for (size_t i = 0; i < c->n_workers; i++)
        n_state[coord_worker_state_locked(c->workers[i])]++;
    moe_metrics_out_family(out, "moe_coordinator_requests_running", "gauge",
                           "Requests the coordinator is forwarding now.");
    moe_metrics_out_sample(out, "moe_coordinator_requests_running", NULL, running);
    moe_metrics_out_family(out, "moe_coordinator_workers", "gauge",
                           "Workers known to the coordinator, by state.");
    static const char *const names[4] = {"", "serving", "draining", "down"};
    for (int s = 1; s <= 3; s++) {
        snprintf(labels, sizeof labels, "state=\"%s\"", names[s]);
        moe_metrics_out_sample(out, "moe_coordinator_workers", labels, n_state[s]);
    }
    static const struct {
        const char *name, *help;
    } per_worker[] = {
        {"moe_worker_up", "1 while the worker is serving (its last load poll answered)."},
        {"moe_worker_requests_running", "Sequences running on the worker (last load poll)."},
        {"moe_worker_requests_waiting", "Requests waiting on the worker (last load poll)."},
        {"moe_worker_kv_cache_usage_perc", "Fraction of the worker's KV blocks in use (0-1)."},
    };
    for (size_t k = 0; k < sizeof per_worker / sizeof per_worker[0]; k++) {
        moe_metrics_out_family(out, per_worker[k].name, "gauge", per_worker[k].help);
        for (size_t i = 0; i < c->n_workers; i++) {
            const struct coord_worker *w = c->workers[i];
            moe_metrics_escape(id, sizeof id, w->id);
            snprintf(labels, sizeof labels, "worker=\"%s\"", id);
            double v = k == 0   ? coord_worker_state_locked(w) == COORD_WORKER_SERVING
                       : k == 1 ? w->running
                       : k == 2 ? w->waiting
                                : (w->kv_total ? (double)w->kv_used / w->kv_total : 0.0);
            moe_metrics_out_sample(out, per_worker[k].name, labels, v);
        }
    }
    pthread_mutex_unlock(&c->mu);
    moe_metrics_out_family(out, "moe_placement_epoch", "gauge",
                           "Expert placement epoch last read by the coordinator (0: default).");
    moe_metrics_out_sample(out, "moe_placement_epoch", NULL, (double)coord_placement_epoch(c));
}

struct coord_metrics *coord_metrics_create(struct coord *c)
{
    struct coord_metrics *m = calloc(1, sizeof *m);
    if (!m || !(m->reg = moe_metrics_create()))
        goto fail;
    m->c = c;
    struct moe_error err;
    if (moe_metrics_set_label(m->reg, "model_name", c->model_name, &err) ||
        moe_metrics_add_collector(m->reg, collect, m, &err))
        goto fail;
    struct moe_metrics *r = m->reg;
    static const char *const reasons[5] = {NULL, "length", "stop", "abort", "error"};
    for (int i = 1; i < 5; i++)
        m->success[i] = moe_metrics_counter(r, "vllm:request_success_total",
                                            "Finished requests, by finish reason.",
                                            "finished_reason", reasons[i], NULL);
    m->prompt_tokens = moe_metrics_counter(r, "vllm:prompt_tokens_total",
                                           "Prompt tokens of finished requests.", NULL);
    m->generation_tokens = moe_metrics_counter(r, "vllm:generation_tokens_total",
                                               "Tokens generated for finished requests.", NULL);
    m->ttft = moe_metrics_histogram(r, "vllm:time_to_first_token_seconds",
                                    "Receipt at the coordinator to the first token relayed.",
                                    MOE_BUCKETS_TTFT, MOE_N_BUCKETS_TTFT, NULL);
    m->itl = moe_metrics_histogram(r, "vllm:inter_token_latency_seconds",
                                   "Time between two relayed chunks of tokens.", MOE_BUCKETS_ITL,
                                   MOE_N_BUCKETS_ITL, NULL);
    m->e2e = moe_metrics_histogram(r, "vllm:e2e_request_latency_seconds",
                                   "Receipt at the coordinator to the last token.", MOE_BUCKETS_E2E,
                                   MOE_N_BUCKETS_E2E, NULL);
    m->queue = moe_metrics_histogram(r, "vllm:request_queue_time_seconds",
                                     "Time a request waited on its worker before its first step.",
                                     MOE_BUCKETS_E2E, MOE_N_BUCKETS_E2E, NULL);
    m->prefill = moe_metrics_histogram(r, "vllm:request_prefill_time_seconds",
                                       "First step to first token on the worker.", MOE_BUCKETS_E2E,
                                       MOE_N_BUCKETS_E2E, NULL);
    m->decode = moe_metrics_histogram(r, "vllm:request_decode_time_seconds",
                                      "First token to last token on the worker.", MOE_BUCKETS_E2E,
                                      MOE_N_BUCKETS_E2E, NULL);
    int n_tb = (int)(sizeof TOKEN_BUCKETS / sizeof TOKEN_BUCKETS[0]);
    m->prompt_len =
        moe_metrics_histogram(r, "vllm:request_prompt_tokens",
                              "Prompt tokens per finished request.", TOKEN_BUCKETS, n_tb, NULL);
    m->gen_len =
        moe_metrics_histogram(r, "vllm:request_generation_tokens",
                              "Generated tokens per finished request.", TOKEN_BUCKETS, n_tb, NULL);
    m->handoffs = moe_metrics_counter(r, "moe_kv_handoff_total",
                                      "KV handoffs from a prefill to a decode worker that "
                                      "completed.",
                                      NULL);
    m->handoff_s = moe_metrics_histogram(r, "moe_kv_handoff_seconds",
                                         "Reserve + transfer time of completed KV handoffs.",
                                         MOE_BUCKETS_STEP, MOE_N_BUCKETS_STEP, NULL);
    return m;
fail:
    coord_metrics_destroy(m);
    return NULL;
}

void coord_metrics_destroy(struct coord_metrics *m)
{
    if (!m)
        return;
    moe_metrics_destroy(m->reg);
    free(m);
}

void coord_metrics_token(struct coord_metrics *m, bool first, double seconds)
{
    if (m)
        moe_histogram_observe(first ? m->ttft : m->itl, seconds);
}

void coord_metrics_final(struct coord_metrics *m, const Moe__V1__GenerateResponse *last)
{
    if (!m)
        return;
    int fr = (int)last->finish_reason;
    if (fr >= 1 && fr <= 4)
        moe_counter_inc(m->success[fr]);
    if (last->usage) {
        moe_counter_add(m->prompt_tokens, last->usage->prompt_tokens);
        moe_counter_add(m->generation_tokens, last->usage->completion_tokens);
        moe_histogram_observe(m->prompt_len, last->usage->prompt_tokens);
        moe_histogram_observe(m->gen_len, last->usage->completion_tokens);
    }
    if (last->timings) {
        const Moe__V1__Timings *t = last->timings;
        moe_histogram_observe(m->e2e, t->e2e_ms / 1e3);
        moe_histogram_observe(m->queue, t->queue_ms / 1e3);
        moe_histogram_observe(m->prefill, t->prefill_ms / 1e3);
        moe_histogram_observe(m->decode, t->decode_ms / 1e3);
    }
}

void coord_metrics_failed(struct coord_metrics *m, enum rpc_code code)
{
    if (!m)
        return;
    if (code == RPC_CANCELLED)
        moe_counter_inc(m->success[MOE__V1__FINISH_REASON__FINISH_REASON_ABORT]);
    moe_counter_inc(moe_metrics_counter(m->reg, "moe_request_failures_total",
                                        "Requests that ended with a status other than OK, by "
                                        "gRPC code.",
                                        "code", rpc_code_name(code), NULL));
}

void coord_metrics_handoff(struct coord_metrics *m, const char *reason, double seconds)
{
    if (!m)
        return;
    if (!reason) {
        moe_counter_inc(m->handoffs);
        moe_histogram_observe(m->handoff_s, seconds);
        return;
    }
    moe_counter_inc(moe_metrics_counter(m->reg, "moe_kv_handoff_failures_total",
                                        "KV handoffs that failed (the request was recomputed or "
                                        "refused), by reason.",
                                        "reason", reason, NULL));
}

void coord_metrics_http(struct coord_metrics *m, const char *path, int status)
{
    if (!m)
        return;
    char st[16];
    snprintf(st, sizeof st, "%d", status);
    moe_counter_inc(moe_metrics_counter(m->reg, "moe_http_requests_total",
                                        "HTTP requests answered, by route and status.", "path",
                                        path, "status", st, NULL));
}
