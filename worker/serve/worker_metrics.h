/* Prometheus /metrics of a moe-worker (--metrics-listen HOST:PORT), on the
 * same HTTP helper as the coordinator (common/http_server.h).
 *
 * Engine-level series, vLLM's names where the meaning is the same, read at
 * scrape time from what the engine, model and KV handoff table already
 * count (no cost between scrapes):
 *   vllm:num_requests_running, vllm:num_requests_waiting,
 *   vllm:kv_cache_usage_perc (0-1), vllm:num_preemptions_total,
 *   vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total (tokens),
 *   vllm:spec_decode_num_draft_tokens_total / _num_accepted_tokens_total,
 *   moe_engine_steps_total, moe_engine_{computed,generated}_tokens_total,
 *   moe_engine_requests_{finished,aborted}_total, moe_kv_blocks{state},
 *   moe_expert_tokens_total{layer,expert} (tokens routed), moe_rank_expert_rows_total{rank},
 *   moe_forward_phase_seconds_total{phase}, moe_ep_all_to_all_bytes_total,
 *   moe_ep_rows_routed_total, moe_kv_transfers_total{direction},
 *   moe_kv_transfer_bytes_total{direction}, moe_kv_transfer_send_seconds_total,
 *   moe_kv_transfer_failures_total, moe_kv_handoffs_pending, moe_placement_epoch,
 *   moe_worker_draining.
 * Recorded per engine step, by wrapping the engine's forward function (a
 * handful of atomic adds per step; bench/bench_metrics.c measures it):
 *   moe_step_duration_seconds, vllm:iteration_tokens_total (tokens per step),
 *   moe_step_phase_seconds{phase} (attention, router, dispatch, experts,
 *   combine, other: the forward pass's own phase timers, per step).
 * The request-level series (TTFT, ITL, end-to-end, finish reasons) are the
 * coordinator's: it sees every request of the cluster. */
#ifndef MOE_WORKER_METRICS_H
#define MOE_WORKER_METRICS_H

#include "engine/engine.h"
#include "group/group.h"
#include "model/model.h"
#include "moe_error.h"

struct moe_tls;
struct worker_service;
struct worker_metrics;

/* Creates the registry (constant label model_name) for `model`; the forward
 * function the engine should call is worker_metrics_forward with ctx = the
 * returned object, which then calls `inner` (NULL: moe_model_forward). */
enum moe_status worker_metrics_create(const char *model_name, struct moe_model *model,
                                      struct moe_group *group, moe_forward_fn inner,
                                      void *inner_ctx, struct worker_metrics **out,
                                      struct moe_error *err);

/* The engine's forward function (moe_forward_fn) with per-step timing. */
enum moe_status worker_metrics_forward(void *ctx, struct moe_model *m, struct moe_kv_cache *kv,
                                       const struct moe_batch *batch, float *logits,
                                       struct moe_error *err);

/* Serves /metrics (and /health) on `listen` for `engine` and `ws` (both
 * borrowed; they must outlive worker_metrics_destroy). */
enum moe_status worker_metrics_serve(struct worker_metrics *wm, const char *listen,
                                     struct moe_engine *engine, struct worker_service *ws,
                                     struct moe_tls *tls, struct moe_error *err);

int worker_metrics_port(const struct worker_metrics *wm);

/* Stops the server and frees everything. NULL is a no-op. */
void worker_metrics_destroy(struct worker_metrics *wm);

#endif
