/* The serving engine: many requests at once over one model shard.
 *
 * Iteration-level continuous batching in the style of vLLM: every step the
 * scheduler takes the running sequences (one decode token each, or the next
 * chunk of a prompt) and admits waiting ones first come, first served while
 * their KV blocks fit, all under a token budget; when blocks run out it
 * preempts the newest sequence (its blocks are freed and it is recomputed
 * later, producing exactly the tokens it would have). Full KV blocks are
 * shared between sequences with the same prefix (prefix caching).
 *
 * Speculative decoding (opts.spec_tokens > 0, off by default) needs no draft
 * model: each step a decoding sequence looks up the most recent earlier
 * occurrence of its last 1..4 tokens (prompt and output) and appends up to
 * spec_tokens of the tokens that followed it to its decode row (fewer when
 * its recent drafts were rejected: spec_adapt in spec.h). All of them
 * are verified in the same forward pass; the output is exactly what plain
 * decoding gives for every sampling mode (see seq_verify in engine.c), only
 * the number of steps changes. Drafts use what the step leaves over (token
 * budget, free KV blocks) and never preempt or delay another sequence.
 *
 * Threads: submit / abort / stats may be called from any thread; step is
 * called by one engine thread and never blocks on I/O. Token callbacks run on
 * the engine thread inside step: they must be quick and must not call back
 * into the engine except moe_engine_abort. */
#ifndef MOE_ENGINE_H
#define MOE_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "model/model.h"
#include "moe_error.h"
#include "engine/sampler.h"
#include "tokenizer.h"

#define MOE_MAX_STOP_IDS 16
#define MOE_MAX_STOP_STRINGS 8
#define MOE_MAX_STOP_LEN 128
#define MOE_MAX_LOGPROBS 20
#define MOE_MAX_LOGIT_BIAS 300

/* Called with the raw logits row of every sampled position, before
 * penalties and sampling (tests and logit-returning front ends). */
typedef void (*moe_logits_hook)(void *user, uint64_t req_id, int index, const float *logits,
                                int vocab);

struct moe_engine_opts {
    int n_block;          /* KV blocks in the pool */
    int block_size;       /* tokens per block (default 16) */
    int max_batch_tokens; /* token budget per step (default 512) */
    int max_running;      /* cap on running sequences (default 64) */
    bool no_prefix_cache; /* disable prefix caching */
    int spec_tokens;      /* draft tokens per decode step, 0 (off) .. 16 */
    /* With spec_tokens: the draft model that proposes them (engine/draft.h;
     * borrowed, the target's vocabulary, on the leader's backend; its KV
     * cache is made here over the same blocks); NULL: n-gram drafts. */
    struct moe_model *draft;
    /* With spec_tokens: no drafts in a step with more than this many decode
     * rows (0: no limit). */
    int spec_max_batch;
    /* With spec_tokens: each sequence's K also weighs what a draft costs
     * against what it yields, as measured on the recent decode steps
     * (spec_cost in engine/spec.h): a guess is made only where it raises the
     * throughput, down to none. false: acceptance alone (spec_adapt). */
    bool spec_cost;
    /* The clock that cost model reads, in seconds; NULL: moe_now. (Tests
     * give one their forward advances, so the costs are theirs to set.) */
    double (*clock)(void *ctx);
    void *clock_ctx;
    /* Data-parallel attention: the pool is split into kv_parts equal parts
     * (n_block a multiple of it), part r the KV cache of group rank r; the
     * engine's own cache holds one part, and every sequence takes its blocks
     * from one part, chosen at admission (the longest prefix-cache hit, then
     * the most token budget left this step, then the most free blocks).
     * Each part has the whole max_batch_tokens per step: the ranks run their
     * shares side by side, and a step lasts as long as its busiest rank.
     * Needs `forward` (the group's, group.h). 0 or 1: one pool. */
    int kv_parts;
    moe_forward_fn forward; /* NULL: moe_model_forward (one rank) */
    void *forward_ctx;
    /* `forward` fills moe_batch.argmax_out (moe_model_forward does): a step
     * whose every row is greedy, without penalties, logprobs, drafts or a
     * logits hook, then brings back one id per row instead of the logits
     * (on a GPU: n ints instead of n x vocab floats, and no host argmax).
     * host_sampling turns that off. */
    bool forward_ids;
    bool host_sampling;
    /* With the ids path: rows sampled with temperature and top_p alone (no
     * top_k, min_p, penalties, logit_bias, min_tokens, logprobs) are drawn
     * by the backend too (moe_batch.sample_u), each with the next uniform
     * of its request's stream, the one the host sampler would take, so a
     * seed gives the host's tokens (the backend sums the masses in fixed
     * point: a boundary moves by at most ~vocab 2^-40 of the top mass).
     * For a GPU (the mains set it there): the logits stay on the device. */
    bool backend_sampling;
    moe_logits_hook logits_hook; /* optional */
    void *logits_hook_user;
};

struct moe_request_params {
    int max_tokens;               /* >= 1 */
    int min_tokens;               /* 0..max_tokens: no EOS / stop id / stop string before this
                                   * many tokens (those ids' logits are masked to -inf) */
    struct moe_sampler_params sp; /* temperature, top_p, top_k, min_p, penalties */
    bool has_seed;                /* else a seed is drawn from the engine's stream */
    uint64_t seed;
    int n_stop_ids;
    int32_t stop_ids[MOE_MAX_STOP_IDS]; /* finish when one is generated (kept in output) */
    int n_stop_strings;
    char stop_strings[MOE_MAX_STOP_STRINGS][MOE_MAX_STOP_LEN + 1]; /* needs a tokenizer */
    bool ignore_eos;  /* do not finish at the model's EOS ids */
    int n_logit_bias; /* logit_bias[i] is added to token bias_ids[i]'s logit (before penalties) */
    int32_t bias_ids[MOE_MAX_LOGIT_BIAS];
    float logit_bias[MOE_MAX_LOGIT_BIAS];
    int logprobs;        /* -1: none; 0: chosen token; n: plus the top n */
    int prompt_logprobs; /* -1: none; else each prompt token's from the second on, plus the top n
                          * (the first token event carries them; no prefix-cache hits) */
    bool prefill_only;   /* disaggregated prefill: park after the first token */
};

enum moe_finish {
    MOE_FINISH_NONE = 0, /* more tokens follow */
    MOE_FINISH_LENGTH,   /* max_tokens reached */
    MOE_FINISH_STOP,     /* EOS, a stop id or a stop string */
    MOE_FINISH_ABORT,    /* aborted by the caller */
    MOE_FINISH_ERROR,    /* the request could not run (message in `error`) */
};

const char *moe_finish_name(enum moe_finish f);

/* Prompt token i's log-probability given tokens [0, i) (prompt_logprobs),
 * under the raw logits, with the top n_top alternatives. */
struct moe_prompt_logprob {
    float logprob;
    int rank; /* 1 + the ids with a larger logit */
    int n_top;
    int32_t top_ids[MOE_MAX_LOGPROBS];
    float top_logprobs[MOE_MAX_LOGPROBS];
};

struct moe_token_event {
    uint64_t req_id;
    int32_t token; /* -1 when the event carries no token (abort, error) */
    int index;     /* 0-based index of the token in the output */
    float logprob; /* of `token` under the model (raw logits), if asked */
    int n_top;
    int32_t top_ids[MOE_MAX_LOGPROBS];
    float top_logprobs[MOE_MAX_LOGPROBS];
    enum moe_finish finish;
    int stop_string;   /* index of the matched stop string, or -1 */
    int64_t text_len;  /* with stop strings: bytes of output text before the stop string */
    const char *error; /* for MOE_FINISH_ERROR */
    double t_admitted; /* moe_now() when the request was first scheduled (0: never) */
    int n_prompt;
    int n_cached; /* prompt tokens served from the prefix cache at admission */
    /* With prompt_logprobs, on the first token only: (n_prompt) entries,
     * [i] for prompt token i (entry 0 unused: the first token has none).
     * Valid during the callback. */
    const struct moe_prompt_logprob *prompt_logprobs;
    const int32_t *prompt_tokens; /* (n_prompt), with prompt_logprobs */
    /* Non-NULL on the first token of a prefill_only request that did not
     * finish: the sequence is parked for a KV handoff (see below). Valid only
     * during the callback; the callback is never called again for it. */
    const struct moe_seq_export *parked;
};

typedef void (*moe_token_cb)(void *user, const struct moe_token_event *ev);

#define MOE_ENGINE_MAX_KV_PARTS 64

struct moe_engine_stats {
    int running;
    int waiting;
    /* data-parallel attention (kv_parts > 1): per part, its blocks held by
     * sequences and its running sequences */
    int kv_parts;
    int part_blocks_used[MOE_ENGINE_MAX_KV_PARTS];
    int part_running[MOE_ENGINE_MAX_KV_PARTS];
    int64_t part_tokens[MOE_ENGINE_MAX_KV_PARTS]; /* tokens run, ever */
    int kv_blocks_total;
    int block_size;       /* tokens per KV block */
    int kv_blocks_used;   /* held by sequences */
    int kv_blocks_cached; /* free but kept for prefix hits */
    int kv_blocks_free;
    int64_t kv_tokens_stored; /* tokens whose K/V the running sequences hold */
    int64_t steps;
    int64_t preemptions;
    int64_t prompt_tokens;     /* prompt tokens admitted */
    int64_t prefix_hit_tokens; /* of those, served from the prefix cache */
    int64_t computed_tokens;   /* tokens run through the model (incl. recompute, drafts) */
    int64_t generated_tokens;
    int64_t spec_draft_tokens;    /* draft tokens put into decode steps */
    int64_t spec_accepted_tokens; /* of those, confirmed by the model and kept */
    int64_t finished;
    int64_t aborted;
    int parked;       /* prefill_only sequences holding KV for a handoff */
    int reservations; /* block reservations held for incoming handoffs */
    int64_t exported; /* sequences parked for handoff, ever */
    int64_t imported; /* sequences started from a handoff, ever */
};

struct moe_engine;

/* The engine borrows `model` and `tok` (tok may be NULL: then stop strings
 * are refused). */
enum moe_status moe_engine_create(struct moe_model *model, struct moe_tokenizer *tok,
                                  const struct moe_engine_opts *opts, struct moe_engine **out,
                                  struct moe_error *err);

/* Frees everything; requests still in flight get no further callbacks. */
void moe_engine_destroy(struct moe_engine *e);

/* Queues a request (thread-safe). The prompt is copied. Invalid parameters
 * (empty prompt, ids outside the vocabulary, prompt + max_tokens beyond the
 * model's context, a request that can never fit the KV pool, bad sampling
 * values, a duplicate req_id) are refused here with MOE_ERR_INVALID and a
 * message naming the field; nothing is queued then. */
enum moe_status moe_engine_submit(struct moe_engine *e, uint64_t req_id, const int32_t *prompt,
                                  int n_prompt, const struct moe_request_params *params,
                                  moe_token_cb cb, void *user, struct moe_error *err);

/* Asks to abort a request (thread-safe). It takes effect at the start of the
 * next step: its blocks are freed and its callback gets MOE_FINISH_ABORT.
 * Unknown or finished ids are ignored. */
void moe_engine_abort(struct moe_engine *e, uint64_t req_id);

/* Runs one iteration. *n_tokens (if not NULL) receives the number of tokens
 * run through the model (0 when idle). A model failure finishes every
 * request of the batch with MOE_FINISH_ERROR and is returned. */
enum moe_status moe_engine_step(struct moe_engine *e, int *n_tokens, struct moe_error *err);

/* True while requests are queued, waiting or running, or reservations /
 * releases wait for a step (parked sequences alone do not count). Thread-safe. */
bool moe_engine_busy(struct moe_engine *e);

/* The engine's load snapshot (thread-safe). What it promises:
 *  - every field describes one moment of the engine thread: the snapshot is
 *    published whole, under one lock, at the end of every step (idle steps
 *    too) and just before every callback that finishes a request, parks it
 *    (prefill_only) or serves a reservation;
 *  - so a caller that heard of such an event (a stream ended, a handoff was
 *    parked, a reservation was answered) and then asks sees that event's
 *    blocks already freed or held, and `parked` / `reservations` counting it;
 *  - what other threads asked for (submit, abort, unreserve) shows only once
 *    a step took it in: the snapshot never runs ahead of the engine.
 * Cumulative counters never go backwards between snapshots. */
void moe_engine_stats(struct moe_engine *e, struct moe_engine_stats *out);

/* Checks the KV pool against the sequences' block tables, and that every
 * sequence holds exactly the blocks its computed tokens fill (for tests).
 * Returns MOE_OK or MOE_ERR_INTERNAL with the broken invariant. Call only
 * from the engine thread. */
enum moe_status moe_engine_check(struct moe_engine *e, struct moe_error *err);

/* ---- disaggregated prefill / decode (KV handoff) ----------------------------
 *
 * Prefill side: a request submitted with params.prefill_only runs its prompt
 * and samples the first token; unless that token finishes it, the sequence
 * is then "parked": its callback gets one event with the token and `parked`
 * set (block table, tokens, sampler state), then never again. Its KV blocks
 * stay held (they count as used) until moe_engine_abort(req_id) releases
 * them, e.g. once the blocks were copied to the decode side.
 *
 * Decode side: moe_engine_reserve takes blocks for an incoming sequence; the
 * caller writes the KV into them (moe_engine_kv_cache + the backend's
 * buf_upload: the engine never touches reserved blocks) and then starts the
 * sequence with moe_engine_import, which consumes the reservation. If the
 * reservation is gone by then (released, or the ids do not fit), the
 * imported sequence is recomputed from its tokens instead, producing the same
 * tokens. Data of blocks held by a parked sequence or a reservation may be
 * read / written from any thread: the engine never writes them. */

struct moe_seq_export {
    uint64_t req_id;
    int n_prompt;
    int n_tokens;          /* prompt + generated (1 after prefill) */
    const int32_t *tokens; /* (n_tokens) */
    int n_kv_tokens;       /* tokens whose K/V are in the blocks (n_tokens - 1) */
    int n_blocks;
    const int32_t *blocks; /* (n_blocks) block ids of this engine's KV cache */
    int block_size;
    struct moe_rng rng; /* sampler state after the last token */
};

/* Called on the engine thread when a reservation was served: `blocks`
 * (n_blocks ids, valid during the call) on success, else `error` (one line). */
typedef void (*moe_reserve_cb)(void *user, uint64_t key, const int32_t *blocks, int n_blocks,
                               const char *error);

/* Asks for n_blocks free KV blocks under `key` (any thread; served at the
 * start of the next step, without preempting anything: if they are not
 * available now the callback gets an error). `key` must be unique among
 * reservations. Refuses n_blocks outside [1, pool size] at once. */
enum moe_status moe_engine_reserve(struct moe_engine *e, uint64_t key, int n_blocks,
                                   moe_reserve_cb cb, void *user, struct moe_error *err);

/* Frees the blocks of reservation `key` at the next step (any thread;
 * unknown keys are ignored, also a reservation still being served). */
void moe_engine_unreserve(struct moe_engine *e, uint64_t key);

struct moe_seq_import {
    int n_prompt;
    int n_tokens;          /* > n_prompt: the generated tokens so far follow the prompt */
    const int32_t *tokens; /* (n_tokens), copied */
    struct moe_rng rng;    /* sampler state to continue from */
    uint64_t reservation;  /* key whose blocks hold the K/V of tokens [0, n_tokens - 1) */
};

/* Starts a sequence whose first tokens were generated elsewhere (any
 * thread). Validated like moe_engine_submit (against params.max_tokens,
 * which counts the generated tokens already in `im`); callbacks then report
 * tokens from index n_tokens - n_prompt on. */
enum moe_status moe_engine_import(struct moe_engine *e, uint64_t req_id,
                                  const struct moe_seq_import *im,
                                  const struct moe_request_params *params, moe_token_cb cb,
                                  void *user, struct moe_error *err);

/* The engine's KV cache (borrowed; for copying handed-off blocks). */
struct moe_kv_cache *moe_engine_kv_cache(struct moe_engine *e);

/* Tokens per KV block and blocks in the pool. */
int moe_engine_block_size(const struct moe_engine *e);
int moe_engine_n_block(const struct moe_engine *e);

/* Parameters with the defaults: greedy, max_tokens 16, no stops, logprobs -1. */
void moe_request_params_init(struct moe_request_params *p);

#endif
