/* Offline batch: many prompts from a JSON Lines file through the engine,
 * with throughput and KV-cache statistics. Used by `moe-generate
 * --prompts-file` and the offline benchmark.
 *
 * One JSON object per line:
 *   {"prompt": "text"} or {"tokens": [1, 2, 3]}
 * and optionally "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
 * "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
 * "stop": ["..."], "stop_token_ids": [..], "ignore_eos", "logprobs",
 * "logit_bias": {"token id": bias}.
 * Blank lines are skipped. */
#ifndef MOE_OFFLINE_H
#define MOE_OFFLINE_H

#include <stdio.h>

#include "engine/engine.h"
#include "tokenizer.h"

struct moe_offline_request {
    int32_t *prompt;
    int n_prompt;
    struct moe_request_params params;
    int line; /* 1-based line in the file */
    /* results */
    int32_t *out; /* generated ids */
    int n_out;
    enum moe_finish finish;
    int64_t text_len; /* bytes of text before a stop string, or -1 */
    double t_submit, t_first, t_done;
};

struct moe_offline_set {
    struct moe_offline_request *req;
    int n;
};

/* Parses `path`. Defaults for fields a line leaves out come from `defaults`.
 * Text prompts need `tok` (they are encoded with special tokens). On error
 * nothing is returned and the message names the file, line and field. */
enum moe_status moe_offline_load(const char *path, struct moe_tokenizer *tok,
                                 const struct moe_request_params *defaults, int vocab,
                                 struct moe_offline_set *out, struct moe_error *err);

void moe_offline_free(struct moe_offline_set *set);

struct moe_offline_report {
    double wall_s;
    int64_t prompt_tokens;
    int64_t output_tokens;
    int64_t steps;
    int64_t preemptions;
    int64_t prefix_hit_tokens;
    int64_t spec_draft_tokens;    /* speculative decoding: drafts proposed */
    int64_t spec_accepted_tokens; /* ... and kept */
    int peak_running;
    double kv_util_mean; /* tokens stored / slots of the blocks held, averaged over steps */
    double kv_util_min;
    double ttft_mean_s, ttft_p50_s, ttft_p99_s;
    double tpot_mean_s; /* per output token after the first */
    /* Steady-state decode: the steps in which every request was running and
     * each ran one token (no prefill, no drafts), the first two left out as
     * warm-up: how many, and their durations' median, 10th and 90th
     * percentiles (0 when none). The step time at batch = n requests. */
    int64_t decode_steps;
    double decode_step_p50_s, decode_step_p10_s, decode_step_p90_s;
};

/* Submits every request at once and steps the engine until all finish. */
enum moe_status moe_offline_run(struct moe_engine *e, struct moe_offline_set *set, int block_size,
                                struct moe_offline_report *rep, struct moe_error *err);

#endif
