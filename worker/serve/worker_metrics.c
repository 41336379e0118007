/* A worker's Prometheus series (see worker_metrics.h). */
#include "serve/worker_metrics.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "http_server.h"
#include "disagg/kv_handoff.h"
#include "metrics.h"
#include "serve/service.h"
#include "clock.h"

#define N_PHASE 6

static const char *const PHASES[N_PHASE] = {"attention", "router",  "dispatch",
                                            "experts",   "combine", "other"};

static const double TOKEN_BUCKETS[] = {1,   2,   4,   8,    16,   32,   64,
                                       128, 256, 512, 1024, 2048, 4096, 8192};

struct worker_metrics {
    struct moe_metrics *reg;
    struct moe_model *model;
    const struct moe_config *cfg;
    struct moe_group *group;
    moe_forward_fn inner;
    void *inner_ctx;
    struct moe_engine *engine; /* set by serve */
    struct worker_service *ws; /* set by serve */
    struct http_server *srv;
    struct moe_histogram *step_s, *step_tokens, *phase_s[N_PHASE];
    struct moe_counter *phase_total[N_PHASE], *ep_bytes, *ep_rows;
    struct moe_model_profile last; /* engine thread: the profile after the previous step */
};

static void profile_phases(const struct moe_model_profile *p, double out[N_PHASE])
{
    out[0] = p->attention_s;
    out[1] = p->router_s;
    out[2] = p->dispatch_s;
    out[3] = p->experts_s;
    out[4] = p->combine_s;
    out[5] = p->other_s;
}

enum moe_status worker_metrics_forward(void *ctx, struct moe_model *m, struct moe_kv_cache *kv,
                                       const struct moe_batch *batch, float *logits,
                                       struct moe_error *err)
{
    struct worker_metrics *wm = ctx;
    double t0 = moe_now();
    enum moe_status st = wm->inner ? wm->inner(wm->inner_ctx, m, kv, batch, logits, err)
                                   : moe_model_forward(m, kv, batch, logits, err);
    moe_histogram_observe(wm->step_s, moe_now() - t0);
    moe_histogram_observe(wm->step_tokens, batch->n_tok);
    struct moe_model_profile p;
    moe_model_profile(m, &p);
    double now[N_PHASE], before[N_PHASE];
    profile_phases(&p, now);
    profile_phases(&wm->last, before);
    for (int i = 0; i < N_PHASE; i++)
        moe_histogram_observe(wm->phase_s[i], now[i] - before[i]);
    wm->last = p;
    /* Totals kept by the model, published from the thread that writes them. */
    for (int i = 0; i < N_PHASE; i++)
        moe_counter_set(wm->phase_total[i], now[i]);
    uint64_t ep_bytes = 0, ep_rows = 0;
    moe_model_ep_traffic(m, &ep_bytes, &ep_rows);
    moe_counter_set(wm->ep_bytes, (double)ep_bytes);
    moe_counter_set(wm->ep_rows, (double)ep_rows);
    return st;
}

/* ---- scrape time ------------------------------------------------------------------------ */

static void family_value(struct moe_metrics_out *out, const char *name, const char *type,
                         const char *help, double v)
{
    moe_metrics_out_family(out, name, type, help);
    moe_metrics_out_sample(out, name, NULL, v);
}

static void collect(void *user, struct moe_metrics_out *out)
{
    struct worker_metrics *wm = user;
    struct moe_engine_stats st;
    moe_engine_stats(wm->engine, &st);
    char labels[96];
    family_value(out, "vllm:num_requests_running", "gauge", "Sequences running in the engine.",
                 st.running);
    family_value(out, "vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
                 st.waiting);
    family_value(out, "vllm:kv_cache_usage_perc", "gauge",
                 "Fraction of KV-cache blocks held by sequences (0-1).",
                 st.kv_blocks_total ? (double)st.kv_blocks_used / st.kv_blocks_total : 0.0);
    family_value(out, "vllm:num_preemptions_total", "counter",
                 "Sequences preempted (freed and recomputed later).", (double)st.preemptions);
    family_value(out, "vllm:prefix_cache_queries_total", "counter",
                 "Prompt tokens looked up in the prefix cache.", (double)st.prompt_tokens);
    family_value(out, "vllm:prefix_cache_hits_total", "counter",
                 "Prompt tokens found in the prefix cache.", (double)st.prefix_hit_tokens);
    family_value(out, "vllm:spec_decode_num_draft_tokens_total", "counter",
                 "Draft tokens proposed (n-gram speculation).", (double)st.spec_draft_tokens);
    family_value(out, "vllm:spec_decode_num_accepted_tokens_total", "counter",
                 "Draft tokens accepted.", (double)st.spec_accepted_tokens);
    family_value(out, "moe_engine_steps_total", "counter", "Engine steps run.", (double)st.steps);
    family_value(out, "moe_engine_computed_tokens_total", "counter",
                 "Tokens run through the model (prompts, recomputation, drafts).",
                 (double)st.computed_tokens);
    family_value(out, "moe_engine_generated_tokens_total", "counter", "Tokens sampled.",
                 (double)st.generated_tokens);
    family_value(out, "moe_engine_requests_finished_total", "counter", "Requests finished.",
                 (double)st.finished);
    family_value(out, "moe_engine_requests_aborted_total", "counter",
                 "Requests aborted (client gone, deadline, Abort).", (double)st.aborted);
    moe_metrics_out_family(out, "moe_kv_blocks", "gauge",
                           "KV-cache blocks by state (cached: free but kept for prefix hits).");
    moe_metrics_out_sample(out, "moe_kv_blocks", "state=\"used\"", st.kv_blocks_used);
    moe_metrics_out_sample(out, "moe_kv_blocks", "state=\"cached\"", st.kv_blocks_cached);
    moe_metrics_out_sample(out, "moe_kv_blocks", "state=\"free\"", st.kv_blocks_free);

    if (st.kv_parts > 1) { /* data-parallel attention: each rank's part of the pool */
        moe_metrics_out_family(out, "moe_dp_rank_kv_blocks_used", "gauge",
                               "Data-parallel attention: KV blocks held by each DP group's "
                               "sequences (dp_rank: the group, a rank with TP 1).");
        for (int r = 0; r < st.kv_parts; r++) {
            snprintf(labels, sizeof labels, "dp_rank=\"%d\"", r);
            moe_metrics_out_sample(out, "moe_dp_rank_kv_blocks_used", labels,
                                   st.part_blocks_used[r]);
        }
        moe_metrics_out_family(out, "moe_dp_rank_requests_running", "gauge",
                               "Data-parallel attention: sequences running on each DP group.");
        for (int r = 0; r < st.kv_parts; r++) {
            snprintf(labels, sizeof labels, "dp_rank=\"%d\"", r);
            moe_metrics_out_sample(out, "moe_dp_rank_requests_running", labels, st.part_running[r]);
        }
        moe_metrics_out_family(out, "moe_dp_rank_computed_tokens_total", "counter",
                               "Data-parallel attention: tokens each DP group ran attention for.");
        for (int r = 0; r < st.kv_parts; r++) {
            snprintf(labels, sizeof labels, "dp_rank=\"%d\"", r);
            moe_metrics_out_sample(out, "moe_dp_rank_computed_tokens_total", labels,
                                   (double)st.part_tokens[r]);
        }
    }
    /* Tokens routed per (layer, expert): layers without experts are left out. */
    const uint64_t *counts = moe_model_expert_tokens(wm->model);
    int nl = wm->cfg->n_layer, ne = wm->cfg->n_expert;
    moe_metrics_out_family(out, "moe_expert_tokens_total", "counter",
                           "Tokens routed to each expert of each MoE layer (every rank of a group "
                           "counts every token, or with data-parallel attention its own and the "
                           "leader sums them; this is the leader's count).");
    for (int l = 0; l < nl && counts; l++) {
        uint64_t sum = 0;
        for (int e = 0; e < ne; e++)
            sum += __atomic_load_n(&counts[(size_t)l * ne + e], __ATOMIC_RELAXED);
        if (!sum)
            continue;
        for (int e = 0; e < ne; e++) {
            snprintf(labels, sizeof labels, "layer=\"%d\",expert=\"%d\"", l, e);
            moe_metrics_out_sample(
                out, "moe_expert_tokens_total", labels,
                (double)__atomic_load_n(&counts[(size_t)l * ne + e], __ATOMIC_RELAXED));
        }
    }
    if (wm->group && wm->group->size > 1) {
        uint64_t rows[256], steps = 0;
        int n = wm->group->size < 256 ? wm->group->size : 256;
        moe_group_rank_rows(wm->group, rows, &steps);
        moe_metrics_out_family(out, "moe_rank_expert_rows_total", "counter",
                               "Token rows each rank of the group ran through its experts.");
        for (int r = 0; r < n; r++) {
            snprintf(labels, sizeof labels, "rank=\"%d\"", r);
            moe_metrics_out_sample(out, "moe_rank_expert_rows_total", labels, (double)rows[r]);
        }
    }

    struct kv_handoff *handoffs = worker_service_kvx(wm->ws);
    if (handoffs) {
        struct kv_handoff_counters kc;
        kv_handoff_counters(handoffs, &kc);
        moe_metrics_out_family(out, "moe_kv_transfers_total", "counter",
                               "KV handoffs sent (out, acknowledged) and received (in).");
        moe_metrics_out_sample(out, "moe_kv_transfers_total", "direction=\"out\"",
                               (double)kc.transfers_out);
        moe_metrics_out_sample(out, "moe_kv_transfers_total", "direction=\"in\"",
                               (double)kc.transfers_in);
        moe_metrics_out_family(out, "moe_kv_transfer_bytes_total", "counter",
                               "KV bytes handed off.");
        moe_metrics_out_sample(out, "moe_kv_transfer_bytes_total", "direction=\"out\"",
                               (double)kc.bytes_out);
        moe_metrics_out_sample(out, "moe_kv_transfer_bytes_total", "direction=\"in\"",
                               (double)kc.bytes_in);
        family_value(out, "moe_kv_transfer_send_seconds_total", "counter",
                     "Time spent sending KV handoffs.", kc.send_ms / 1e3);
        family_value(out, "moe_kv_transfer_failures_total", "counter",
                     "KV handoffs that failed, were aborted or expired on this worker.",
                     (double)kc.failures);
    }
    /* from the engine's snapshot, like the blocks they hold (engine.h) */
    family_value(out, "moe_kv_handoffs_pending", "gauge",
                 "KV handoffs parked or reserved here now.", (double)(st.parked + st.reservations));
    family_value(out, "moe_placement_epoch", "gauge",
                 "Expert placement epoch the group runs (0: the default placement).",
                 wm->group ? (double)moe_group_placement_epoch(wm->group, NULL) : 0.0);
    family_value(out, "moe_worker_draining", "gauge", "1 once the worker drains (SIGTERM).",
                 worker_service_draining(wm->ws));
}

/* ---- the server ---------------------------------------------------------------------------- */

static void handle_metrics(struct http_request *rq, void *user)
{
    struct worker_metrics *wm = user;
    char *text = NULL;
    size_t len = 0;
    struct moe_error err;
    if (moe_metrics_render(wm->reg, &text, &len, &err)) {
        http_respond_error(rq, 500, "server_error", NULL, "%s", err.msg);
        return;
    }
    http_respond(rq, 200, MOE_METRICS_CONTENT_TYPE, text, len);
    free(text);
}

static void handle_health(struct http_request *rq, void *user)
{
    struct worker_metrics *wm = user;
    if (worker_service_draining(wm->ws))
        http_respond_error(rq, 503, "service_unavailable", NULL, "draining");
    else
        http_respond(rq, 200, "application/json", "", 0);
}

enum moe_status worker_metrics_create(const char *model_name, struct moe_model *model,
                                      struct moe_group *group, moe_forward_fn inner,
                                      void *inner_ctx, struct worker_metrics **out,
                                      struct moe_error *err)
{
    *out = NULL;
    struct worker_metrics *wm = calloc(1, sizeof *wm);
    if (!wm || !(wm->reg = moe_metrics_create())) {
        free(wm);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    wm->model = model;
    wm->cfg = moe_model_config(model);
    wm->group = group;
    wm->inner = inner;
    wm->inner_ctx = inner_ctx;
    moe_model_profile(model, &wm->last);
    enum moe_status st = moe_metrics_set_label(wm->reg, "model_name", model_name, err);
    if (st) {
        worker_metrics_destroy(wm);
        return st;
    }
    wm->step_s = moe_metrics_histogram(wm->reg, "moe_step_duration_seconds",
                                       "Wall time of one engine step's forward pass.",
                                       MOE_BUCKETS_STEP, MOE_N_BUCKETS_STEP, NULL);
    wm->step_tokens = moe_metrics_histogram(
        wm->reg, "vllm:iteration_tokens_total", "Tokens run through the model per engine step.",
        TOKEN_BUCKETS, (int)(sizeof TOKEN_BUCKETS / sizeof TOKEN_BUCKETS[0]), NULL);
    for (int i = 0; i < N_PHASE; i++)
        wm->phase_s[i] =
            moe_metrics_histogram(wm->reg, "moe_step_phase_seconds",
                                  "Wall time of one step's forward pass by phase "
                                  "(all-to-all: dispatch and combine).",
                                  MOE_BUCKETS_STEP, MOE_N_BUCKETS_STEP, "phase", PHASES[i], NULL);
    for (int i = 0; i < N_PHASE; i++)
        wm->phase_total[i] = moe_metrics_counter(wm->reg, "moe_forward_phase_seconds_total",
                                                 "Wall time of the forward passes by phase "
                                                 "(this rank, since start).",
                                                 "phase", PHASES[i], NULL);
    wm->ep_bytes = moe_metrics_counter(wm->reg, "moe_ep_all_to_all_bytes_total",
                                       "Bytes this rank sent in the expert-parallel dispatch and "
                                       "combine all-to-alls.",
                                       NULL);
    wm->ep_rows = moe_metrics_counter(wm->reg, "moe_ep_rows_routed_total",
                                      "Token rows routed by the expert-parallel dispatch.", NULL);
    *out = wm;
    return MOE_OK;
}

enum moe_status worker_metrics_serve(struct worker_metrics *wm, const char *listen,
                                     struct moe_engine *engine, struct worker_service *ws,
                                     struct moe_tls *tls, struct moe_error *err)
{
    wm->engine = engine;
    wm->ws = ws;
    enum moe_status st = moe_metrics_add_collector(wm->reg, collect, wm, err);
    if (st)
        return st;
    /* HTTPS with the worker's certificate when TLS is on; no client
     * certificate is asked for (Prometheus scrapes it) */
    struct http_server_opts o = {.listen = listen, .threads = 1, .name = "moe-worker", .tls = tls};
    wm->srv = http_server_create(&o, err);
    if (!wm->srv)
        return err->code;
    if ((st = http_server_route(wm->srv, "GET", "/metrics", handle_metrics, wm, err)) ||
        (st = http_server_route(wm->srv, "GET", "/health", handle_health, wm, err)) ||
        (st = http_server_start(wm->srv, err)))
        return moe_error_prefix(err, "--metrics-listen");
    return MOE_OK;
}

int worker_metrics_port(const struct worker_metrics *wm)
{
    return wm && wm->srv ? http_server_port(wm->srv) : 0;
}

void worker_metrics_destroy(struct worker_metrics *wm)
{
    if (!wm)
        return;
    http_server_destroy(wm->srv, 0);
    moe_metrics_destroy(wm->reg);
    free(wm);
}
