/* Continuous-batching engine: scheduler, KV block bookkeeping, sampling and
 * request life cycle. See engine.h for the contract. */
#include "engine/engine.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "engine/generate.h"
#include "kv/kv_pool.h"
#include "engine/draft.h"
#include "engine/spec.h"

struct seq {
    uint64_t id;
    int32_t *tokens; /* (cap_tokens) prompt, then generated ids */
    int n_tokens;
    int cap_tokens;
    int n_prompt;
    int n_computed;       /* tokens whose K/V are in the cache */
    int32_t *blocks;      /* (cap_blocks) block table */
    uint64_t *block_hash; /* (cap_blocks) chained hash of each full block */
    int n_blocks;
    int n_hashed; /* blocks [0, n_hashed) are full and hashed */
    int part;     /* KV pool part (data-parallel attention rank) of its blocks */
    int cap_blocks;
    struct moe_request_params params;
    struct moe_rng rng;
    moe_token_cb cb;
    void *user;
    uint8_t *seen;      /* (vocab) penalties: token in prompt or output */
    int32_t *out_count; /* (vocab) penalties: occurrences in the output */
    char *text;         /* decoded output, kept when there are stop strings */
    size_t text_len;
    bool prompt_counted;
    double t_admitted;
    int n_cached;
    bool import_pending; /* started from a handoff: take reservation import_key */
    uint64_t import_key;
    int32_t draft[MOE_SPEC_TOKENS_MAX]; /* this step's draft tokens, after tokens[n_tokens - 1] */
    int spec_k;                         /* drafts its next decode row may carry (spec_adapt) */
    int spec_cool;                      /* decode steps left without drafting */
    float spec_acc, spec_tried;         /* decayed guesses kept / compared (spec_alpha) */
    int spec_rest; /* opts.spec_cost: decode steps between probes while guesses do not pay */
    int spec_idle; /* ... and the steps since the last guess */
    struct moe_prompt_logprob *plp; /* (n_prompt) prompt_logprobs, or NULL */
    int plp_done;   /* prompt positions whose logits were read for plp: [0, plp_done) */
    int draft_done; /* draft model: positions its KV cache holds for these tokens */
    int draft_spec; /* ... and beyond them, for this step's guesses but the last */
};

/* A queued reservation request or release (from any thread). */
struct engine_op {
    bool release;
    uint64_t key;
    int n_blocks;
    moe_reserve_cb cb;
    void *user;
};

/* Blocks held for an incoming handoff (engine thread only). */
struct reservation {
    uint64_t key;
    int32_t *blocks; /* (n_blocks) */
    int n_blocks;
};

/* One scheduled piece of work: tokens [start, start + count) of a sequence;
 * the last n_draft of them are s->draft, guesses beyond its real tokens. */
struct sched_entry {
    struct seq *s;
    int start;
    int count;
    int n_draft;
};

struct seq_list {
    struct seq **v;
    int n;
    int cap;
};

struct moe_engine {
    int next_part; /* data-parallel attention: where choose_part's scan starts */
    struct moe_model *model;
    struct moe_tokenizer *tok;
    const struct moe_config *cfg;
    struct moe_engine_opts opts;
    struct moe_kv_cache *kv;
    struct kv_pool *pool;
    struct moe_draft *draft;          /* opts.draft's proposals, or NULL (n-gram) */
    struct moe_draft_seq *draft_reqs; /* (cap_draft_reqs) this step's proposals */
    int cap_draft_reqs;
    struct spec_cost spec_cost; /* opts.spec_cost: the measured decode steps */
    int spec_batch;             /* this step's decode rows (spec_cost_k) */
    double step_draft_s;        /* this step's time in the draft model */
    struct seq_list waiting;    /* FCFS; preempted sequences go to the front */
    struct seq_list running;    /* admission order: the last is the newest */
    struct seq_list parked;     /* prefill_only sequences holding KV for a handoff */
    struct reservation *resv;
    int n_resv, cap_resv;
    struct moe_rng seed_rng;

    /* step scratch */
    struct sched_entry *sched;
    int cap_sched;
    int32_t *b_tokens, *b_pos, *b_seq, *b_slots, *b_rows, *b_tables;
    int cap_tok, cap_tables;
    float *logits;
    int cap_logits;
    int32_t *ids; /* greedy steps: each logit row's argmax (moe_batch.argmax_out) */
    int cap_ids;
    float *s_temp, *s_top_p; /* backend_sampling: moe_batch.sample_temp, sample_top_p, */
    double *s_u;             /* sample_u */
    int cap_s_temp, cap_s_top_p, cap_s_u;
    void *sample_work;

    pthread_mutex_t mu; /* guards everything below */
    struct seq_list inbox;
    uint64_t *aborts;
    int n_aborts, cap_aborts;
    uint64_t *live; /* ids of every request not yet finished */
    int n_live, cap_live;
    struct engine_op *ops; /* reservation requests and releases */
    int n_ops, cap_ops;
    int n_parked;                   /* live ids that are parked (not stepped) */
    struct moe_engine_stats stats;  /* under mu: what moe_engine_stats reads */
    struct moe_engine_stats counts; /* the engine thread's running counters, published to
                                       stats by publish_stats */
};

const char *moe_finish_name(enum moe_finish f)
{
    switch (f) {
    case MOE_FINISH_NONE: return "none";
    case MOE_FINISH_LENGTH: return "length";
    case MOE_FINISH_STOP: return "stop";
    case MOE_FINISH_ABORT: return "abort";
    case MOE_FINISH_ERROR: return "error";
    }
    return "?";
}

void moe_request_params_init(struct moe_request_params *p)
{
    memset(p, 0, sizeof *p);
    p->max_tokens = 16;
    p->logprobs = -1;
    p->prompt_logprobs = -1;
}

/* ---- small containers ------------------------------------------------------------ */

static bool list_reserve(struct seq_list *l, int n)
{
    if (n <= l->cap)
        return true;
    int cap = l->cap ? l->cap * 2 : 16;
    while (cap < n)
        cap *= 2;
    struct seq **v = realloc(l->v, (size_t)cap * sizeof *v);
    if (!v)
        return false;
    l->v = v;
    l->cap = cap;
    return true;
}

static bool list_push(struct seq_list *l, struct seq *s)
{
    if (!list_reserve(l, l->n + 1))
        return false;
    l->v[l->n++] = s;
    return true;
}

static void list_remove_at(struct seq_list *l, int i)
{
    memmove(l->v + i, l->v + i + 1, (size_t)(l->n - i - 1) * sizeof *l->v);
    l->n--;
}

static bool grow(void **p, int *cap, int need, size_t elem)
{
    if (need <= *cap)
        return true;
    int c = *cap ? *cap : 16;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, (size_t)c * elem);
    if (!q)
        return false;
    *p = q;
    *cap = c;
    return true;
}

/* ---- life cycle -------------------------------------------------------------------- */

static void seq_free(struct seq *s)
{
    if (!s)
        return;
    free(s->tokens);
    free(s->blocks);
    free(s->block_hash);
    free(s->seen);
    free(s->out_count);
    free(s->text);
    free(s->plp);
    free(s);
}

enum moe_status moe_engine_create(struct moe_model *model, struct moe_tokenizer *tok,
                                  const struct moe_engine_opts *opts, struct moe_engine **out,
                                  struct moe_error *err)
{
    *out = NULL;
    struct moe_engine_opts o = *opts;
    if (!o.block_size)
        o.block_size = 16;
    if (!o.max_batch_tokens)
        o.max_batch_tokens = 512;
    if (!o.max_running)
        o.max_running = 64;
    if (o.n_block <= 0)
        return moe_error_set(err, MOE_ERR_INVALID, "--kv-blocks: %d is not a positive number",
                             o.n_block);
    if (o.block_size < 1 || o.block_size > 1024)
        return moe_error_set(err, MOE_ERR_INVALID, "--block-size: %d is not in [1, 1024]",
                             o.block_size);
    if (o.spec_tokens < 0 || o.spec_tokens > MOE_SPEC_TOKENS_MAX)
        return moe_error_set(err, MOE_ERR_INVALID, "--spec-tokens: %d is not in [0, %d]",
                             o.spec_tokens, MOE_SPEC_TOKENS_MAX);
    if (o.kv_parts < 1)
        o.kv_parts = 1;
    if (o.kv_parts > MOE_ENGINE_MAX_KV_PARTS || o.n_block % o.kv_parts ||
        (o.kv_parts > 1 && !o.forward))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "KV pool of %d blocks in %d data-parallel parts: needs at most %d "
                             "parts, a multiple of them as blocks, and a group forward",
                             o.n_block, o.kv_parts, MOE_ENGINE_MAX_KV_PARTS);
    if (o.max_batch_tokens < 1 || o.max_running < 1)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "--max-batch-tokens %d and --max-running %d must be positive",
                             o.max_batch_tokens, o.max_running);
    struct moe_engine *e = calloc(1, sizeof *e);
    if (!e)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    e->model = model;
    e->tok = tok;
    e->cfg = moe_model_config(model);
    e->opts = o;
    moe_rng_seed(&e->seed_rng, 0x5eedull);
    pthread_mutex_init(&e->mu, NULL);
    enum moe_status rc = kv_pool_create_parts(o.n_block, o.block_size, o.kv_parts, &e->pool, err);
    if (!rc) /* with parts: the leader's own part; the other ranks hold theirs */
        rc = moe_kv_cache_create(model, o.n_block / o.kv_parts, o.block_size, &e->kv, err);
    if (!rc && o.draft && !o.spec_tokens)
        rc = moe_error_set(err, MOE_ERR_INVALID,
                           "--draft-model needs --spec-tokens K (the guesses per step)");
    if (!rc && o.draft)
        rc = moe_draft_create(o.draft, model, o.n_block, o.block_size, &e->draft, err);
    if (!rc && !(e->sample_work = malloc((size_t)e->cfg->vocab_size * 8)))
        rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    if (rc) {
        moe_engine_destroy(e);
        return rc;
    }
    e->stats.kv_blocks_total = o.n_block;
    e->stats.block_size = o.block_size;
    e->stats.kv_blocks_free = o.n_block;
    e->stats.kv_parts = o.kv_parts;
    *out = e;
    return MOE_OK;
}

void moe_engine_destroy(struct moe_engine *e)
{
    if (!e)
        return;
    for (int i = 0; i < e->waiting.n; i++)
        seq_free(e->waiting.v[i]);
    for (int i = 0; i < e->running.n; i++)
        seq_free(e->running.v[i]);
    for (int i = 0; i < e->inbox.n; i++)
        seq_free(e->inbox.v[i]);
    for (int i = 0; i < e->parked.n; i++)
        seq_free(e->parked.v[i]);
    for (int i = 0; i < e->n_resv; i++)
        free(e->resv[i].blocks);
    free(e->resv);
    free(e->ops);
    moe_draft_destroy(e->draft);
    free(e->draft_reqs);
    free(e->parked.v);
    free(e->waiting.v);
    free(e->running.v);
    free(e->inbox.v);
    free(e->aborts);
    free(e->live);
    free(e->sched);
    free(e->b_tokens);
    free(e->b_pos);
    free(e->b_seq);
    free(e->b_slots);
    free(e->b_rows);
    free(e->b_tables);
    free(e->logits);
    free(e->ids);
    free(e->s_temp);
    free(e->s_top_p);
    free(e->s_u);
    free(e->sample_work);
    moe_kv_cache_free(e->model, e->kv);
    kv_pool_destroy(e->pool);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

/* ---- submit / abort (any thread) --------------------------------------------------- */

static enum moe_status check_params(const struct moe_engine *e, const int32_t *prompt, int n_prompt,
                                    const struct moe_request_params *p, struct moe_error *err)
{
    const struct moe_config *c = e->cfg;
    if (n_prompt < 1)
        return moe_error_set(err, MOE_ERR_INVALID, "prompt: empty");
    for (int i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= c->vocab_size)
            return moe_error_set(
                err, MOE_ERR_INVALID,
                "prompt: token id %d at index %d is outside the vocabulary [0, %d)", prompt[i], i,
                c->vocab_size);
    if (p->max_tokens < 1)
        return moe_error_set(err, MOE_ERR_INVALID, "max_tokens: %d, must be >= 1", p->max_tokens);
    if ((int64_t)n_prompt + p->max_tokens > c->max_pos)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "max_tokens: prompt (%d tokens) + max_tokens (%d) exceeds the model "
                             "context of %d",
                             n_prompt, p->max_tokens, c->max_pos);
    int64_t blocks =
        ((int64_t)n_prompt + p->max_tokens + e->opts.block_size - 1) / e->opts.block_size;
    int part_blocks = e->opts.n_block / e->opts.kv_parts; /* a sequence lives in one part */
    if (blocks > part_blocks)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "max_tokens: prompt + max_tokens need %lld KV blocks, the pool has "
                             "%d%s",
                             (long long)blocks, part_blocks,
                             e->opts.kv_parts > 1 ? " on each data-parallel rank" : "");
    const struct moe_sampler_params *sp = &p->sp;
    if (!(sp->temperature >= 0.0f && sp->temperature <= 100.0f))
        return moe_error_set(err, MOE_ERR_INVALID, "temperature: %g is not in [0, 100]",
                             (double)sp->temperature);
    if (!(sp->top_p >= 0.0f && sp->top_p <= 1.0f))
        return moe_error_set(err, MOE_ERR_INVALID, "top_p: %g is not in [0, 1]", (double)sp->top_p);
    if (sp->top_k < 0)
        return moe_error_set(err, MOE_ERR_INVALID, "top_k: %d is negative", sp->top_k);
    if (!(sp->min_p >= 0.0f && sp->min_p <= 1.0f))
        return moe_error_set(err, MOE_ERR_INVALID, "min_p: %g is not in [0, 1]", (double)sp->min_p);
    if (!(sp->repetition_penalty >= 0.0f && sp->repetition_penalty <= 10.0f))
        return moe_error_set(err, MOE_ERR_INVALID, "repetition_penalty: %g is not in (0, 10]",
                             (double)sp->repetition_penalty);
    if (!(fabsf(sp->presence_penalty) <= 2.0f) || !(fabsf(sp->frequency_penalty) <= 2.0f))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "presence_penalty %g / frequency_penalty %g: must be in [-2, 2]",
                             (double)sp->presence_penalty, (double)sp->frequency_penalty);
    if (p->n_logit_bias < 0 || p->n_logit_bias > MOE_MAX_LOGIT_BIAS)
        return moe_error_set(err, MOE_ERR_INVALID, "logit_bias: %d tokens, at most %d allowed",
                             p->n_logit_bias, MOE_MAX_LOGIT_BIAS);
    for (int i = 0; i < p->n_logit_bias; i++) {
        if (p->bias_ids[i] < 0 || p->bias_ids[i] >= e->cfg->vocab_size)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "logit_bias: token %d is outside the vocabulary [0, %d)",
                                 p->bias_ids[i], e->cfg->vocab_size);
        if (!(fabsf(p->logit_bias[i]) <= 100.0f))
            return moe_error_set(err, MOE_ERR_INVALID, "logit_bias[%d]: %g is not in [-100, 100]",
                                 p->bias_ids[i], (double)p->logit_bias[i]);
    }
    if (p->min_tokens < 0 || p->min_tokens > p->max_tokens)
        return moe_error_set(err, MOE_ERR_INVALID, "min_tokens: %d is not in [0, max_tokens %d]",
                             p->min_tokens, p->max_tokens);
    if (p->n_stop_ids < 0 || p->n_stop_ids > MOE_MAX_STOP_IDS)
        return moe_error_set(err, MOE_ERR_INVALID, "stop_token_ids: %d ids, at most %d allowed",
                             p->n_stop_ids, MOE_MAX_STOP_IDS);
    if (p->n_stop_strings < 0 || p->n_stop_strings > MOE_MAX_STOP_STRINGS)
        return moe_error_set(err, MOE_ERR_INVALID, "stop: %d strings, at most %d allowed",
                             p->n_stop_strings, MOE_MAX_STOP_STRINGS);
    for (int i = 0; i < p->n_stop_strings; i++) {
        size_t len = strnlen(p->stop_strings[i], MOE_MAX_STOP_LEN + 1);
        if (len == 0 || len > MOE_MAX_STOP_LEN)
            return moe_error_set(err, MOE_ERR_INVALID, "stop[%d]: length %zu is not in [1, %d]", i,
                                 len, MOE_MAX_STOP_LEN);
    }
    if (p->n_stop_strings && !e->tok)
        return moe_error_set(err, MOE_ERR_INVALID, "stop: stop strings need a tokenizer");
    if (p->prompt_logprobs < -1 || p->prompt_logprobs > MOE_MAX_LOGPROBS)
        return moe_error_set(err, MOE_ERR_INVALID, "prompt_logprobs: %d is not in [-1, %d]",
                             p->prompt_logprobs, MOE_MAX_LOGPROBS);
    if (p->logprobs < -1 || p->logprobs > MOE_MAX_LOGPROBS)
        return moe_error_set(err, MOE_ERR_INVALID, "logprobs: %d is not in [-1, %d]", p->logprobs,
                             MOE_MAX_LOGPROBS);
    return MOE_OK;
}

static int live_find(const struct moe_engine *e, uint64_t id)
{
    for (int i = 0; i < e->n_live; i++)
        if (e->live[i] == id)
            return i;
    return -1;
}

/* Builds a sequence from `n_tokens` tokens of which the first n_prompt are
 * the prompt, and queues it. `rng` (may be NULL) is the sampler state to
 * continue from; `import_key` (with `import`) names a reservation. */
static enum moe_status submit_seq(struct moe_engine *e, uint64_t req_id, const int32_t *tokens,
                                  int n_tokens, int n_prompt,
                                  const struct moe_request_params *params, moe_token_cb cb,
                                  void *user, const struct moe_rng *rng, bool import,
                                  uint64_t import_key, struct moe_error *err)
{
    struct seq *s = calloc(1, sizeof *s);
    if (!s)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    s->id = req_id;
    s->n_prompt = n_prompt;
    s->n_tokens = n_tokens;
    s->cap_tokens = n_prompt + params->max_tokens;
    s->cap_blocks = (s->cap_tokens + e->opts.block_size - 1) / e->opts.block_size;
    s->tokens = malloc((size_t)s->cap_tokens * sizeof *s->tokens);
    s->blocks = malloc((size_t)s->cap_blocks * sizeof *s->blocks);
    s->block_hash = malloc((size_t)s->cap_blocks * sizeof *s->block_hash);
    s->params = *params;
    s->spec_k = e->opts.spec_tokens;
    s->cb = cb;
    s->user = user;
    s->import_pending = import;
    s->import_key = import_key;
    if (moe_sampler_has_penalties(&params->sp)) {
        s->seen = calloc((size_t)e->cfg->vocab_size, 1);
        s->out_count = calloc((size_t)e->cfg->vocab_size, sizeof *s->out_count);
    }
    if (params->prompt_logprobs >= 0 && n_prompt > 1)
        s->plp = calloc((size_t)n_prompt, sizeof *s->plp);
    if (!s->tokens || !s->blocks || !s->block_hash ||
        (moe_sampler_has_penalties(&params->sp) && (!s->seen || !s->out_count)) ||
        (params->prompt_logprobs >= 0 && n_prompt > 1 && !s->plp)) {
        seq_free(s);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    memcpy(s->tokens, tokens, (size_t)n_tokens * sizeof *tokens);
    if (s->seen)
        for (int i = 0; i < n_tokens; i++) {
            s->seen[tokens[i]] = 1;
            if (i >= n_prompt)
                s->out_count[tokens[i]]++;
        }

    pthread_mutex_lock(&e->mu);
    if (live_find(e, req_id) >= 0) {
        pthread_mutex_unlock(&e->mu);
        seq_free(s);
        return moe_error_set(err, MOE_ERR_INVALID, "request id %llu is already in flight",
                             (unsigned long long)req_id);
    }
    if (rng) {
        s->rng = *rng;
    } else {
        uint64_t seed =
            params->has_seed ? params->seed : (uint64_t)(moe_rng_uniform(&e->seed_rng) * 0x1p53);
        moe_rng_seed(&s->rng, seed);
    }
    bool ok = grow((void **)&e->live, &e->cap_live, e->n_live + 1, sizeof *e->live) &&
              list_push(&e->inbox, s);
    if (ok)
        e->live[e->n_live++] = req_id;
    pthread_mutex_unlock(&e->mu);
    if (!ok) {
        seq_free(s);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    return MOE_OK;
}

enum moe_status moe_engine_submit(struct moe_engine *e, uint64_t req_id, const int32_t *prompt,
                                  int n_prompt, const struct moe_request_params *params,
                                  moe_token_cb cb, void *user, struct moe_error *err)
{
    enum moe_status rc = check_params(e, prompt, n_prompt, params, err);
    if (rc)
        return rc;
    return submit_seq(e, req_id, prompt, n_prompt, n_prompt, params, cb, user, NULL, false, 0, err);
}

enum moe_status moe_engine_import(struct moe_engine *e, uint64_t req_id,
                                  const struct moe_seq_import *im,
                                  const struct moe_request_params *params, moe_token_cb cb,
                                  void *user, struct moe_error *err)
{
    enum moe_status rc = check_params(e, im->tokens, im->n_prompt, params, err);
    if (rc)
        return rc;
    int n_gen = im->n_tokens - im->n_prompt;
    if (n_gen < 1 || n_gen >= params->max_tokens)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "handoff: %d generated tokens, must be in [1, max_tokens %d)", n_gen,
                             params->max_tokens);
    for (int i = im->n_prompt; i < im->n_tokens; i++)
        if (im->tokens[i] < 0 || im->tokens[i] >= e->cfg->vocab_size)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "handoff: generated token %d at index %d is outside the "
                                 "vocabulary [0, %d)",
                                 im->tokens[i], i, e->cfg->vocab_size);
    struct moe_request_params p = *params;
    p.prefill_only = false;
    p.prompt_logprobs = -1; /* the prefill side reported them */
    return submit_seq(e, req_id, im->tokens, im->n_tokens, im->n_prompt, &p, cb, user, &im->rng,
                      true, im->reservation, err);
}

enum moe_status moe_engine_reserve(struct moe_engine *e, uint64_t key, int n_blocks,
                                   moe_reserve_cb cb, void *user, struct moe_error *err)
{
    if (n_blocks < 1 || n_blocks > e->opts.n_block)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "reservation: %d KV blocks is not in [1, %d] (the pool size)",
                             n_blocks, e->opts.n_block);
    pthread_mutex_lock(&e->mu);
    bool ok = grow((void **)&e->ops, &e->cap_ops, e->n_ops + 1, sizeof *e->ops);
    if (ok)
        e->ops[e->n_ops++] =
            (struct engine_op){.key = key, .n_blocks = n_blocks, .cb = cb, .user = user};
    pthread_mutex_unlock(&e->mu);
    return ok ? MOE_OK : moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
}

void moe_engine_unreserve(struct moe_engine *e, uint64_t key)
{
    pthread_mutex_lock(&e->mu);
    if (grow((void **)&e->ops, &e->cap_ops, e->n_ops + 1, sizeof *e->ops))
        e->ops[e->n_ops++] = (struct engine_op){.release = true, .key = key};
    pthread_mutex_unlock(&e->mu);
}

struct moe_kv_cache *moe_engine_kv_cache(struct moe_engine *e)
{
    return e->kv;
}

int moe_engine_block_size(const struct moe_engine *e)
{
    return e->opts.block_size;
}

int moe_engine_n_block(const struct moe_engine *e)
{
    return e->opts.n_block;
}

void moe_engine_abort(struct moe_engine *e, uint64_t req_id)
{
    pthread_mutex_lock(&e->mu);
    if (grow((void **)&e->aborts, &e->cap_aborts, e->n_aborts + 1, sizeof *e->aborts))
        e->aborts[e->n_aborts++] = req_id;
    pthread_mutex_unlock(&e->mu);
}

bool moe_engine_busy(struct moe_engine *e)
{
    pthread_mutex_lock(&e->mu);
    bool busy = e->n_live - e->n_parked > 0 || e->n_ops > 0 || e->n_aborts > 0;
    pthread_mutex_unlock(&e->mu);
    return busy;
}

void moe_engine_stats(struct moe_engine *e, struct moe_engine_stats *out)
{
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    pthread_mutex_unlock(&e->mu);
}

/* ---- statistics ------------------------------------------------------------------ */

/* Publishes the snapshot that moe_engine_stats returns (engine thread). Called
 * at the end of every step and just before every callback that finishes a
 * request, parks it or serves a reservation, so that whoever hears of such an
 * event and then asks for the statistics sees the event's blocks already
 * freed or held (see moe_engine_stats). */
static void publish_stats(struct moe_engine *e)
{
    struct kv_pool_stats ps;
    kv_pool_stats(e->pool, &ps);
    int64_t stored = 0;
    for (int i = 0; i < e->running.n; i++)
        stored += e->running.v[i]->n_computed;
    pthread_mutex_lock(&e->mu);
    e->stats.running = e->running.n;
    e->stats.waiting = e->waiting.n + e->inbox.n;
    e->stats.kv_blocks_used = ps.n_used;
    e->stats.kv_blocks_cached = ps.n_cached;
    e->stats.kv_blocks_free = ps.n_free;
    e->stats.kv_tokens_stored = stored;
    if (e->opts.kv_parts > 1) {
        int pb = e->opts.n_block / e->opts.kv_parts;
        for (int p = 0; p < e->opts.kv_parts; p++) {
            e->stats.part_blocks_used[p] = pb - kv_pool_available_in(e->pool, p);
            e->stats.part_running[p] = 0;
        }
        for (int i = 0; i < e->running.n; i++)
            e->stats.part_running[e->running.v[i]->part]++;
        memcpy(e->stats.part_tokens, e->counts.part_tokens, sizeof e->stats.part_tokens);
    }
    e->stats.parked = e->parked.n;
    e->stats.reservations = e->n_resv;
    /* the cumulative counters, kept by the engine thread alone */
    e->stats.steps = e->counts.steps;
    e->stats.preemptions = e->counts.preemptions;
    e->stats.prompt_tokens = e->counts.prompt_tokens;
    e->stats.prefix_hit_tokens = e->counts.prefix_hit_tokens;
    e->stats.computed_tokens = e->counts.computed_tokens;
    e->stats.generated_tokens = e->counts.generated_tokens;
    e->stats.spec_draft_tokens = e->counts.spec_draft_tokens;
    e->stats.spec_accepted_tokens = e->counts.spec_accepted_tokens;
    e->stats.finished = e->counts.finished;
    e->stats.aborted = e->counts.aborted;
    e->stats.exported = e->counts.exported;
    e->stats.imported = e->counts.imported;
    pthread_mutex_unlock(&e->mu);
}

/* ---- blocks ---------------------------------------------------------------------- */

static void seq_release_blocks(struct moe_engine *e, struct seq *s)
{
    for (int i = s->n_blocks - 1; i >= 0; i--)
        kv_pool_release(e->pool, s->blocks[i]);
    s->n_blocks = 0;
    s->n_hashed = 0;
    s->n_computed = 0;
    s->draft_done = 0;
    s->draft_spec = 0;
}

/* Finishes a sequence that is in neither list any more: frees its blocks,
 * tells the caller, forgets its id. */
static void seq_finish(struct moe_engine *e, struct seq *s, struct moe_token_event *ev)
{
    seq_release_blocks(e, s);
    pthread_mutex_lock(&e->mu);
    int i = live_find(e, s->id);
    if (i >= 0)
        e->live[i] = e->live[--e->n_live];
    if (ev->finish == MOE_FINISH_ABORT)
        e->counts.aborted++;
    else
        e->counts.finished++;
    pthread_mutex_unlock(&e->mu);
    publish_stats(e); /* before the caller hears of it */
    if (s->cb)
        s->cb(s->user, ev);
    seq_free(s);
}

static void seq_finish_bare(struct moe_engine *e, struct seq *s, enum moe_finish f,
                            const char *error)
{
    struct moe_token_event ev = {.req_id = s->id,
                                 .token = -1,
                                 .index = s->n_tokens - s->n_prompt,
                                 .finish = f,
                                 .stop_string = -1,
                                 .error = error,
                                 .t_admitted = s->t_admitted,
                                 .n_prompt = s->n_prompt,
                                 .n_cached = s->n_cached};
    seq_finish(e, s, &ev);
}

/* ---- prompt log-probabilities ------------------------------------------------------ */

/* Prompt positions whose logits rows still wait to be read: all read. */
static bool plp_complete(const struct seq *s)
{
    return s->plp_done >= s->n_prompt - 1;
}

/* Logits rows of prompt positions [from, to) a chunk [start, end) of `s`
 * brings for its prompt_logprobs (0 when it brings none); they are the last
 * rows of the chunk before its sampling row. */
static int plp_rows(const struct seq *s, int start, int end, int *from)
{
    if (!s->plp || plp_complete(s))
        return 0;
    int f = start > s->plp_done ? start : s->plp_done;
    int to = end < s->n_prompt - 1 ? end : s->n_prompt - 1;
    *from = f;
    return to > f ? to - f : 0;
}

/* Prompt chunks of a sequence reading its prompt logits run at most this
 * many tokens a step: each brings a logits row of the vocabulary's size, so
 * a chunk's rows stay within 2^22 floats (16 MiB), 16..256 rows. */
static int plp_cap(const struct moe_engine *e, const struct seq *s, int count)
{
    if (!s->plp || plp_complete(s))
        return count;
    int cap = (1 << 22) / e->cfg->vocab_size;
    cap = cap < 16 ? 16 : cap > 256 ? 256 : cap;
    return count > cap ? cap : count;
}

/* Reads n logits rows of positions [from, from + n): prompt token p + 1's
 * log-probability and top alternatives from row p. */
static void plp_read(struct seq *s, const float *rows, int from, int n, int vocab)
{
    for (int i = 0; i < n; i++) {
        int p = from + i;
        struct moe_prompt_logprob *lp = &s->plp[p + 1];
        lp->n_top = s->params.prompt_logprobs;
        const float *row = rows + (size_t)i * vocab;
        lp->logprob =
            moe_logprobs(row, vocab, s->tokens[p + 1], lp->n_top, lp->top_ids, lp->top_logprobs);
        float x = row[s->tokens[p + 1]];
        lp->rank = 1;
        for (int v = 0; v < vocab; v++)
            lp->rank += row[v] > x;
    }
    if (n > 0)
        s->plp_done = from + n;
}

/* Takes prefix-cache hits for the full blocks of a sequence about to be
 * admitted, leaving at least its last token to compute. */
static void seq_take_prefix(struct moe_engine *e, struct seq *s)
{
    int bs = e->opts.block_size;
    /* prompt_logprobs need the logits of every prompt position not yet read */
    int limit = s->plp && !plp_complete(s) ? s->plp_done : s->n_tokens - 1;
    while (!e->opts.no_prefix_cache && (s->n_blocks + 1) * bs <= limit) {
        int i = s->n_blocks;
        uint64_t parent = i ? s->block_hash[i - 1] : kv_pool_part_seed(s->part);
        const int32_t *t = s->tokens + (size_t)i * bs;
        uint64_t h = kv_pool_hash(parent, t, bs);
        int32_t b = kv_pool_lookup(e->pool, h, parent, t);
        if (b < 0)
            break;
        s->blocks[i] = b;
        s->block_hash[i] = h;
        s->n_blocks = s->n_hashed = i + 1;
        s->n_computed = (i + 1) * bs;
    }
}

/* Registers the sequence's newly full blocks in the prefix cache. */
static void seq_publish_blocks(struct moe_engine *e, struct seq *s)
{
    int bs = e->opts.block_size;
    while ((s->n_hashed + 1) * bs <= s->n_computed) {
        int i = s->n_hashed;
        uint64_t parent = i ? s->block_hash[i - 1] : kv_pool_part_seed(s->part);
        const int32_t *t = s->tokens + (size_t)i * bs;
        s->block_hash[i] = kv_pool_hash(parent, t, bs);
        if (!e->opts.no_prefix_cache)
            kv_pool_publish(e->pool, s->blocks[i], s->block_hash[i], parent, t);
        s->n_hashed = i + 1;
    }
}

static int blocks_for(const struct moe_engine *e, int n_tok)
{
    return (n_tok + e->opts.block_size - 1) / e->opts.block_size;
}

/* The newest running sequence of KV pool part `part`, or -1. */
static int newest_in_part(const struct moe_engine *e, int part)
{
    for (int i = e->running.n - 1; i >= 0; i--)
        if (e->running.v[i]->part == part)
            return i;
    return -1;
}

/* Preempts running sequence i: frees its blocks (full ones stay in the
 * prefix cache) and puts it at the front of the waiting queue. */
static void preempt(struct moe_engine *e, int i)
{
    struct seq *s = e->running.v[i];
    list_remove_at(&e->running, i);
    seq_release_blocks(e, s);
    MOE_ASSERT(list_reserve(&e->waiting, e->waiting.n + 1));
    memmove(e->waiting.v + 1, e->waiting.v, (size_t)e->waiting.n * sizeof *e->waiting.v);
    e->waiting.v[0] = s;
    e->waiting.n++;
    e->counts.preemptions++;
}

/* ---- scheduling ------------------------------------------------------------------------ */

static bool sched_add(struct moe_engine *e, int *n, struct seq *s, int count)
{
    if (!grow((void **)&e->sched, &e->cap_sched, *n + 1, sizeof *e->sched))
        return false;
    e->sched[(*n)++] = (struct sched_entry){s, s->n_computed, count, 0};
    return true;
}

static double engine_clock(const struct moe_engine *e)
{
    return e->opts.clock ? e->opts.clock(e->opts.clock_ctx) : moe_now();
}

/* How many draft tokens entry `en` may carry this step: 0 unless it is a
 * plain decode row (one token, the sequence's last, after its prompt: a
 * prefill or a prefill_only sequence never speculates). Drafts get only what
 * the step leaves over: the token budget and blocks on the free list (a
 * guess never evicts a prefix-cache block nor preempts anyone). The draft
 * plus the token sampled after it must fit max_tokens. */
static int draft_limit(const struct moe_engine *e, const struct sched_entry *en, int budget)
{
    const struct seq *s = en->s;
    if (en->count != 1 || en->start != s->n_tokens - 1 || s->n_tokens <= s->n_prompt ||
        s->params.prefill_only)
        return 0;
    int k = s->spec_cool > 0 ? 0 : s->spec_k;
    if (k > budget)
        k = budget;
    if (k > s->cap_tokens - s->n_tokens - 1)
        k = s->cap_tokens - s->n_tokens - 1;
    int bs = e->opts.block_size;
    int slots = (s->n_blocks + kv_pool_free_count_in(e->pool, s->part)) * bs - s->n_tokens;
    return k < slots ? k : slots;
}

/* Appends drafts to this step's decode rows (after everything else was
 * scheduled) and takes the blocks their positions need: n-gram guesses (a
 * sequence with no match stays an ordinary one-token decode row), or the
 * draft model's, proposed for all drafting rows at once. */
static void schedule_drafts(struct moe_engine *e, int n, int budget)
{
    int n_req = 0, given = 0; /* given: draft tokens put into this step so far */
    for (int i = 0; i < n && budget > 0; i++) {
        struct sched_entry *en = &e->sched[i];
        struct seq *s = en->s;
        if (s->spec_cool > 0 && en->count == 1 && en->start == s->n_tokens - 1) {
            s->spec_cool--; /* a decode step without drafts */
            continue;
        }
        int k = draft_limit(e, en, budget);
        if (k <= 0)
            continue;
        if (e->opts.spec_cost) {
            int kc = spec_cost_k(spec_alpha(s->spec_acc, s->spec_tried), &e->spec_cost,
                                 e->spec_batch + given, e->spec_batch, e->draft != NULL,
                                 e->opts.spec_tokens);
            if (kc <= 0) {
                /* guesses cost more than they yield: none, but a probe of
                 * one now and then keeps the acceptance estimate fresh (the
                 * gap doubles while the probes do not pay) */
                if (!s->spec_rest) {
                    s->spec_rest = MOE_SPEC_COST_COOLDOWN;
                    s->spec_idle = 0;
                }
                if (++s->spec_idle < s->spec_rest)
                    continue;
                s->spec_idle = 0;
                s->spec_rest *= 2;
                if (s->spec_rest > MOE_SPEC_COST_REST_MAX)
                    s->spec_rest = MOE_SPEC_COST_REST_MAX;
                kc = 1;
            } else {
                s->spec_rest = 0;
            }
            k = kc < k ? kc : k;
        }
        if (!e->draft && !(k = spec_ngram_draft(s->tokens, s->n_tokens, k, s->draft)))
            continue;
        if (e->draft &&
            !grow((void **)&e->draft_reqs, &e->cap_draft_reqs, n_req + 1, sizeof *e->draft_reqs))
            break;
        for (int need = blocks_for(e, s->n_tokens + k) - s->n_blocks; need > 0; need--)
            s->blocks[s->n_blocks++] = kv_pool_alloc_in(e->pool, s->part);
        en->count += k;
        en->n_draft = k;
        budget -= k;
        given += k;
        if (e->draft)
            e->draft_reqs[n_req++] = (struct moe_draft_seq){.tokens = s->tokens,
                                                            .n_tokens = s->n_tokens,
                                                            .done = s->draft_done,
                                                            .blocks = s->blocks,
                                                            .n_blocks = s->n_blocks,
                                                            .k = k,
                                                            .out = s->draft};
        else
            e->counts.spec_draft_tokens += k;
    }
    if (!n_req)
        return;
    struct moe_error err = {0};
    double t0 = engine_clock(e);
    struct moe_draft_pass passes[MOE_SPEC_TOKENS_MAX];
    enum moe_status rc = moe_draft_propose(e->draft, e->draft_reqs, n_req, passes, &err);
    e->step_draft_s += engine_clock(e) - t0;
    int n_pass = 0;
    for (int i = 0; !rc && i < n_req; i++)
        n_pass = e->draft_reqs[i].k > n_pass ? e->draft_reqs[i].k : n_pass;
    for (int p = 1; e->opts.spec_cost && p < n_pass; p++) /* the first also catches up */
        spec_cost_draft_pass(&e->spec_cost, passes[p].n_rows, passes[p].seconds);
    for (int i = 0, r = 0; i < n && r < n_req; i++) {
        struct sched_entry *en = &e->sched[i];
        struct seq *s = en->s;
        if (!en->n_draft)
            continue;
        r++;
        if (rc) { /* no guesses this step: plain decode rows (output unaffected) */
            en->count -= en->n_draft;
            en->n_draft = 0;
            for (int keep = blocks_for(e, s->n_tokens); s->n_blocks > keep;)
                kv_pool_release(e->pool, s->blocks[--s->n_blocks]);
            continue;
        }
        s->draft_done = s->n_tokens;
        s->draft_spec = en->n_draft - 1;
        e->counts.spec_draft_tokens += en->n_draft;
    }
    if (rc)
        fprintf(stderr, "moe engine: draft model: %s (this step decodes without drafts)\n",
                err.msg);
}

/* Data-parallel attention: the part a waiting sequence goes to (see
 * moe_engine_opts.kv_parts), among those with token budget left; -1 when
 * none has. One part: 0. Full ties go round: the scan starts after the
 * part chosen last, so requests that come one at a time (an idle pool's
 * parts all tie) spread over the DP ranks instead of all landing on 0. */
static int choose_part(struct moe_engine *e, const struct seq *s, const int *budget)
{
    int n_part = e->opts.kv_parts, best = -1, best_hits = -1, bs = e->opts.block_size;
    for (int i = 0; i < n_part; i++) {
        int p = (e->next_part + i) % n_part;
        if (budget[p] <= 0)
            continue;
        int hits = 0; /* full blocks of the prompt already cached in part p */
        uint64_t parent = kv_pool_part_seed(p);
        while (!e->opts.no_prefix_cache && (hits + 1) * bs <= s->n_tokens - 1) {
            const int32_t *t = s->tokens + (size_t)hits * bs;
            uint64_t h = kv_pool_hash(parent, t, bs);
            if (!kv_pool_contains(e->pool, h, parent, t))
                break;
            parent = h;
            hits++;
        }
        if (best < 0 || hits > best_hits ||
            (hits == best_hits &&
             (budget[p] > budget[best] ||
              (budget[p] == budget[best] &&
               kv_pool_available_in(e->pool, p) > kv_pool_available_in(e->pool, best))))) {
            best = p;
            best_hits = hits;
        }
    }
    if (best >= 0)
        e->next_part = (best + 1) % n_part;
    return best;
}

/* Picks this step's work; returns the number of entries. Each KV pool part
 * (one with a single pool) has the whole token budget. */
static int schedule(struct moe_engine *e)
{
    int budget[MOE_ENGINE_MAX_KV_PARTS], n = 0, n_part = e->opts.kv_parts, left = n_part;
    for (int p = 0; p < n_part; p++)
        budget[p] = e->opts.max_batch_tokens;
    /* Running sequences, oldest first: decodes and continuing prompt chunks.
     * Blocks short in a part preempt that part's newest sequences. */
    for (int i = 0; i < e->running.n && left > 0; i++) {
        struct seq *s = e->running.v[i];
        int *b = &budget[s->part];
        if (*b <= 0)
            continue;
        int count = plp_cap(e, s, s->n_tokens - s->n_computed);
        if (count > *b)
            count = *b;
        int need = blocks_for(e, s->n_computed + count) - s->n_blocks;
        bool self_preempted = false;
        while (need > kv_pool_available_in(e->pool, s->part)) {
            int victim = newest_in_part(e, s->part);
            preempt(e, victim);
            if (victim == i) {
                self_preempted = true;
                break;
            }
        }
        if (self_preempted) {
            if (n_part == 1)
                break;
            i--; /* the next sequence moved into slot i */
            continue;
        }
        for (; need > 0; need--)
            s->blocks[s->n_blocks++] = kv_pool_alloc_in(e->pool, s->part);
        if (!sched_add(e, &n, s, count))
            break;
        *b -= count;
        left -= *b <= 0;
    }
    /* Waiting sequences, first come first served, while their blocks fit. */
    while (e->waiting.n && left > 0 && e->running.n < e->opts.max_running) {
        struct seq *s = e->waiting.v[0];
        s->part = choose_part(e, s, budget);
        seq_take_prefix(e, s);
        int *b = &budget[s->part];
        int count = plp_cap(e, s, s->n_tokens - s->n_computed);
        if (count > *b)
            count = *b;
        int need = blocks_for(e, s->n_computed + count) - s->n_blocks;
        if (need > kv_pool_available_in(e->pool, s->part)) {
            seq_release_blocks(e, s); /* give the prefix hits back; try again later */
            break;
        }
        for (; need > 0; need--)
            s->blocks[s->n_blocks++] = kv_pool_alloc_in(e->pool, s->part);
        if (!s->prompt_counted) {
            s->prompt_counted = true;
            s->t_admitted = moe_now();
            s->n_cached = s->n_computed;
            e->counts.prompt_tokens += s->n_prompt;
            e->counts.prefix_hit_tokens += s->n_computed;
        }
        list_remove_at(&e->waiting, 0);
        MOE_ASSERT(list_push(&e->running, s));
        if (!sched_add(e, &n, s, count))
            break;
        *b -= count;
        left -= *b <= 0;
    }
    /* Drafts pay while a step is bound by reading the weights: with many
     * decode rows it is bound by computing them, and a K+1-token verify row
     * costs about K+1 rows (on an MoE more, it routes to more experts). */
    int decoding = 0;
    for (int i = 0; i < n; i++)
        decoding += e->sched[i].count == 1;
    int spare = 0; /* drafts: what the parts' budgets leave over */
    for (int p = 0; p < n_part; p++)
        spare += budget[p] > 0 ? budget[p] : 0;
    if (e->opts.spec_tokens > 0 &&
        (!e->opts.spec_max_batch || decoding <= e->opts.spec_max_batch)) {
        e->spec_batch = decoding;
        schedule_drafts(e, n, spare);
    }
    return n;
}

/* ---- sampling and stopping ------------------------------------------------------------ */

static bool is_stop_id(const struct moe_engine *e, const struct seq *s, int32_t t)
{
    for (int i = 0; i < s->params.n_stop_ids; i++)
        if (s->params.stop_ids[i] == t)
            return true;
    if (!s->params.ignore_eos)
        for (int i = 0; i < e->cfg->n_eos; i++)
            if (e->cfg->eos_ids[i] == t)
                return true;
    return false;
}

/* Re-decodes the output and looks for a stop string in the part that could
 * contain new text. Returns the index of the string, or -1. */
static int match_stop_string(struct moe_engine *e, struct seq *s, int64_t *text_len)
{
    size_t old_len = s->text_len;
    char *text = NULL;
    size_t len = 0;
    if (moe_tokenizer_decode(e->tok, s->tokens + s->n_prompt, (size_t)(s->n_tokens - s->n_prompt),
                             true, &text, &len, NULL) != MOE_OK)
        return -1;
    free(s->text);
    s->text = text;
    s->text_len = len;
    int best = -1;
    size_t best_at = len;
    for (int i = 0; i < s->params.n_stop_strings; i++) {
        const char *stop = s->params.stop_strings[i];
        size_t sl = strlen(stop);
        size_t from = old_len >= sl ? old_len - sl + 1 : 0;
        if (from > len)
            from = 0; /* the text changed shape (a completed UTF-8 char): search all */
        for (size_t at = from; at + sl <= len && at < best_at; at++)
            if (!memcmp(text + at, stop, sl)) {
                best = i;
                best_at = at;
                break;
            }
    }
    *text_len = best >= 0 ? (int64_t)best_at : (int64_t)len;
    return best;
}

/* True while `s` is below its min_tokens: its next token may not be one
 * that would stop it (EOS unless ignore_eos, a stop id), nor may a stop
 * string end it (vLLM's min_tokens). */
static bool seq_below_min(const struct seq *s)
{
    return s->n_tokens - s->n_prompt < s->params.min_tokens;
}

/* Masks the ids that would stop `s` (is_stop_id's) in its logits row. */
static void mask_stop_ids(const struct moe_engine *e, const struct seq *s, float *row)
{
    for (int i = 0; i < s->params.n_stop_ids; i++)
        row[s->params.stop_ids[i]] = -INFINITY;
    if (!s->params.ignore_eos)
        for (int i = 0; i < e->cfg->n_eos; i++)
            row[e->cfg->eos_ids[i]] = -INFINITY;
}

/* True when nothing of `s`'s logits row is needed but its next token: no
 * penalties or logit_bias to apply, no ids to mask for min_tokens, no
 * logprobs, no logits hook, no prompt logprobs left to read. */
static bool seq_token_only(const struct moe_engine *e, const struct seq *s)
{
    const struct moe_request_params *p = &s->params;
    return !moe_sampler_has_penalties(&p->sp) && p->logprobs < 0 && !e->opts.logits_hook &&
           !seq_below_min(s) && !p->n_logit_bias && (!s->plp || plp_complete(s));
}

/* The next token is the logits' argmax and nothing else of the row is needed. */
static bool seq_greedy_only(const struct moe_engine *e, const struct seq *s)
{
    return s->params.sp.temperature <= 0.0f && seq_token_only(e, s);
}

/* Drawn by the backend under backend_sampling (moe_engine_opts): temperature
 * and top_p are all its sampling asks for. */
static bool seq_backend_sampled(const struct moe_engine *e, const struct seq *s)
{
    const struct moe_sampler_params *sp = &s->params.sp;
    return e->opts.backend_sampling && sp->top_k <= 0 && sp->min_p <= 0.0f && seq_token_only(e, s);
}

/* Samples the next token of `s` from its logits row (or takes `id`, the
 * row's argmax computed by the backend, when row is NULL) and reports it.
 * Returns true when the sequence finished (it is then freed). */
static bool seq_emit(struct moe_engine *e, struct seq *s, float *row, int32_t id)
{
    int vocab = e->cfg->vocab_size;
    const struct moe_request_params *p = &s->params;
    struct moe_token_event ev = {.req_id = s->id,
                                 .stop_string = -1,
                                 .text_len = -1,
                                 .t_admitted = s->t_admitted,
                                 .n_prompt = s->n_prompt,
                                 .n_cached = s->n_cached};
    if (p->logprobs >= 0) {
        /* raw model distribution; the token is filled in after sampling */
        ev.n_top = p->logprobs;
    }
    int32_t t = id;
    if (row) {
        if (e->opts.logits_hook)
            e->opts.logits_hook(e->opts.logits_hook_user, s->id, s->n_tokens - s->n_prompt, row,
                                vocab);
        bool raw_lp_needed = p->logprobs >= 0;
        bool below_min = seq_below_min(s);
        float *raw = NULL;
        if (raw_lp_needed && (moe_sampler_has_penalties(&p->sp) || below_min || p->n_logit_bias)) {
            raw = malloc((size_t)vocab * sizeof *raw);
            if (raw)
                memcpy(raw, row, (size_t)vocab * sizeof *raw);
        }
        for (int i = 0; i < p->n_logit_bias; i++) /* OpenAI's: on the model's logits */
            row[p->bias_ids[i]] += p->logit_bias[i];
        if (s->seen)
            moe_apply_penalties(row, vocab, &p->sp, s->seen, s->out_count);
        if (below_min) /* after the penalties, which could lift a -inf no further */
            mask_stop_ids(e, s, row);
        t = moe_sample(row, vocab, &p->sp, &s->rng, e->sample_work);
        if (raw_lp_needed)
            ev.logprob =
                moe_logprobs(raw ? raw : row, vocab, t, ev.n_top, ev.top_ids, ev.top_logprobs);
        free(raw);
    }
    MOE_ASSERT(s->n_tokens < s->cap_tokens);
    s->tokens[s->n_tokens++] = t;
    if (s->seen) {
        s->seen[t] = 1;
        s->out_count[t]++;
    }
    e->counts.generated_tokens++;
    ev.token = t;
    ev.index = s->n_tokens - s->n_prompt - 1;
    if (ev.index == 0 && s->params.prompt_logprobs >= 0) {
        ev.prompt_logprobs = s->plp; /* NULL for a one-token prompt */
        ev.prompt_tokens = s->tokens;
    }
    if (is_stop_id(e, s, t))
        ev.finish = MOE_FINISH_STOP;
    /* stop strings count from the token after the first min_tokens (vLLM's
     * order); before it the text is still decoded, so the search resumes
     * where it would have */
    if (!ev.finish && p->n_stop_strings) {
        ev.stop_string = match_stop_string(e, s, &ev.text_len);
        if (ev.stop_string >= 0 && s->n_tokens - s->n_prompt <= p->min_tokens) {
            ev.stop_string = -1;
            ev.text_len = -1;
        }
        if (ev.stop_string >= 0)
            ev.finish = MOE_FINISH_STOP;
    }
    if (!ev.finish && s->n_tokens - s->n_prompt >= p->max_tokens)
        ev.finish = MOE_FINISH_LENGTH;
    if (!ev.finish && p->prefill_only) {
        /* Park it: it keeps its blocks until released (moe_engine_abort). */
        for (int i = 0; i < e->running.n; i++)
            if (e->running.v[i] == s) {
                list_remove_at(&e->running, i);
                break;
            }
        MOE_ASSERT(list_push(&e->parked, s));
        struct moe_seq_export ex = {.req_id = s->id,
                                    .n_prompt = s->n_prompt,
                                    .n_tokens = s->n_tokens,
                                    .tokens = s->tokens,
                                    .n_kv_tokens = s->n_computed,
                                    .n_blocks = s->n_blocks,
                                    .blocks = s->blocks,
                                    .block_size = e->opts.block_size,
                                    .rng = s->rng};
        ev.parked = &ex;
        pthread_mutex_lock(&e->mu);
        e->n_parked++;
        e->counts.exported++;
        pthread_mutex_unlock(&e->mu);
        publish_stats(e); /* the parked blocks, before the caller hears of them */
        if (s->cb)
            s->cb(s->user, &ev);
        s->cb = NULL;
        return false;
    }
    if (!ev.finish) {
        if (s->cb)
            s->cb(s->user, &ev);
        return false;
    }
    for (int i = 0; i < e->running.n; i++)
        if (e->running.v[i] == s) {
            list_remove_at(&e->running, i);
            break;
        }
    seq_finish(e, s, &ev);
    return true;
}

/* Releases blocks past the ones the committed tokens use: those taken for
 * rejected drafts. They were never published (only committed full blocks
 * are), so they go back to the free list; the sequence is left holding what
 * plain decoding would hold. */
static void seq_trim_blocks(struct moe_engine *e, struct seq *s)
{
    int keep = blocks_for(e, s->n_computed);
    while (s->n_blocks > keep)
        kv_pool_release(e->pool, s->blocks[--s->n_blocks]);
}

/* Verifies a decode row that carried k drafts: rows[i] (i = 0..k) are the
 * logits after [last token, d_0 .. d_{i-1}].
 *
 * Exact by construction: at row i the token x_i is drawn exactly as plain
 * decoding draws it (seq_emit: same sampler, the sequence's own RNG stream,
 * penalties that have seen x_0 .. x_{i-1}, logprobs, stop ids / strings,
 * max_tokens), and row i + 1 is used only when x_i == d_i, i.e. when its
 * inputs are the tokens plain decoding would have fed. For a point-mass draft
 * this is speculative sampling (d is kept with probability p(d), otherwise a
 * token is drawn from p without d), and the RNG is consumed once per emitted
 * token as in plain decoding, so for every sampling mode the output is the
 * one plain decoding gives from the same logits. The K/V of the kept drafts
 * are committed; the slots of rejected ones are overwritten by later steps. */
static void seq_verify(struct moe_engine *e, struct seq *s, int k, float *rows)
{
    size_t vocab = (size_t)e->cfg->vocab_size;
    int accepted = 0;
    for (int i = 0;; i++) {
        if (seq_emit(e, s, rows + (size_t)i * vocab, -1))
            return; /* finished: s is freed with all its blocks */
        if (i == k || s->draft[i] != s->tokens[s->n_tokens - 1])
            break;
        s->n_computed++; /* d_i's K/V were computed from the token now emitted */
        e->counts.spec_accepted_tokens++;
        accepted++;
    }
    /* the draft's K/V of the kept guesses are those of the committed tokens */
    s->draft_done += accepted < s->draft_spec ? accepted : s->draft_spec;
    s->draft_spec = 0;
    spec_adapt(&s->spec_k, &s->spec_cool, e->opts.spec_tokens, k, accepted);
    spec_alpha_update(&s->spec_acc, &s->spec_tried, k, accepted);
    seq_publish_blocks(e, s);
    seq_trim_blocks(e, s);
}

/* ---- step ---------------------------------------------------------------------------- */

/* Logits rows an entry needs: one per draft plus the row after the last
 * real token; none for a prompt chunk that does not reach the end; before
 * them, with prompt_logprobs, one per prompt position not yet read. */
static int entry_rows(const struct sched_entry *en)
{
    int end = en->start + en->count - en->n_draft, from;
    int plp = plp_rows(en->s, en->start, end, &from);
    return plp + (end == en->s->n_tokens ? 1 + en->n_draft : 0);
}

static int resv_find(const struct moe_engine *e, uint64_t key)
{
    for (int i = 0; i < e->n_resv; i++)
        if (e->resv[i].key == key)
            return i;
    return -1;
}

static void resv_drop(struct moe_engine *e, int i)
{
    struct reservation *r = &e->resv[i];
    for (int j = r->n_blocks - 1; j >= 0; j--)
        kv_pool_release(e->pool, r->blocks[j]);
    free(r->blocks);
    e->resv[i] = e->resv[--e->n_resv];
}

/* Serves queued reservations and releases (engine thread, no lock held). */
static void run_ops(struct moe_engine *e, const struct engine_op *ops, int n)
{
    char msg[MOE_ERROR_MSG_MAX];
    for (int k = 0; k < n; k++) {
        const struct engine_op *op = &ops[k];
        int i = resv_find(e, op->key);
        if (op->release) {
            if (i >= 0)
                resv_drop(e, i);
            continue;
        }
        int part = 0; /* a handed-off sequence's blocks come from one part */
        for (int p = 1; p < e->opts.kv_parts; p++)
            if (kv_pool_available_in(e->pool, p) > kv_pool_available_in(e->pool, part))
                part = p;
        int avail = kv_pool_available_in(e->pool, part);
        int32_t *blocks = NULL;
        if (i >= 0) {
            snprintf(msg, sizeof msg, "reservation %llu: already held",
                     (unsigned long long)op->key);
        } else if (op->n_blocks > avail) {
            snprintf(msg, sizeof msg, "no free KV blocks: the handoff needs %d, %d of %d are free",
                     op->n_blocks, avail, e->opts.n_block);
        } else if (!grow((void **)&e->resv, &e->cap_resv, e->n_resv + 1, sizeof *e->resv) ||
                   !(blocks = malloc((size_t)op->n_blocks * sizeof *blocks))) {
            snprintf(msg, sizeof msg, "out of memory");
        } else {
            for (int j = 0; j < op->n_blocks; j++)
                blocks[j] = kv_pool_alloc_in(e->pool, part);
            e->resv[e->n_resv++] = (struct reservation){op->key, blocks, op->n_blocks};
            publish_stats(e); /* the reserved blocks, before the caller hears of them */
            if (op->cb)
                op->cb(op->user, op->key, blocks, op->n_blocks, NULL);
            continue;
        }
        if (op->cb)
            op->cb(op->user, op->key, NULL, 0, msg);
    }
}

/* An imported sequence takes its reservation and runs from its first
 * generated token; without a fitting reservation it is recomputed. */
static void admit_import(struct moe_engine *e, struct seq *s)
{
    s->import_pending = false;
    int i = resv_find(e, s->import_key);
    int n_kv = s->n_tokens - 1;
    if (i >= 0 && e->resv[i].n_blocks == blocks_for(e, n_kv) && n_kv > 0) {
        struct reservation *r = &e->resv[i];
        memcpy(s->blocks, r->blocks, (size_t)r->n_blocks * sizeof *s->blocks);
        s->n_blocks = r->n_blocks;
        s->part = kv_pool_part_of(e->pool, r->blocks[0]);
        s->n_computed = n_kv;
        s->prompt_counted = true;
        s->t_admitted = moe_now();
        s->n_cached = s->n_prompt;
        free(r->blocks);
        e->resv[i] = e->resv[--e->n_resv];
        MOE_ASSERT(list_push(&e->running, s));
        e->counts.imported++;
        return;
    }
    if (i >= 0)
        resv_drop(e, i);
    MOE_ASSERT(list_push(&e->waiting, s));
}

static void take_inbox_and_aborts(struct moe_engine *e)
{
    pthread_mutex_lock(&e->mu);
    int n_ops = e->n_ops;
    struct engine_op *ops = NULL;
    if (n_ops) {
        ops = e->ops;
        e->ops = NULL;
        e->n_ops = e->cap_ops = 0;
    }
    pthread_mutex_unlock(&e->mu);
    run_ops(e, ops, n_ops);
    free(ops);

    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < e->inbox.n; i++) {
        struct seq *s = e->inbox.v[i];
        if (s->import_pending)
            admit_import(e, s);
        else
            MOE_ASSERT(list_push(&e->waiting, s));
    }
    e->inbox.n = 0;
    int n_aborts = e->n_aborts;
    uint64_t small[64], *ids = n_aborts <= 64 ? small : malloc((size_t)n_aborts * sizeof *ids);
    MOE_ASSERT(ids);
    if (n_aborts)
        memcpy(ids, e->aborts, (size_t)n_aborts * sizeof *ids);
    e->n_aborts = 0;
    pthread_mutex_unlock(&e->mu);

    for (int a = 0; a < n_aborts; a++) {
        struct seq_list *lists[3] = {&e->waiting, &e->running, &e->parked};
        for (int l = 0; l < 3; l++)
            for (int i = 0; i < lists[l]->n; i++)
                if (lists[l]->v[i]->id == ids[a]) {
                    struct seq *s = lists[l]->v[i];
                    list_remove_at(lists[l], i);
                    if (l == 2) {
                        /* a parked sequence handed off (or given up): no callback */
                        pthread_mutex_lock(&e->mu);
                        e->n_parked--;
                        pthread_mutex_unlock(&e->mu);
                        seq_finish_bare(e, s, MOE_FINISH_LENGTH, NULL);
                    } else {
                        seq_finish_bare(e, s, MOE_FINISH_ABORT, NULL);
                    }
                    l = 3;
                    break;
                }
    }
    if (ids != small)
        free(ids);
}

static bool reserve_batch(struct moe_engine *e, int n_tok, int n_tables)
{
    int cap = e->cap_tok;
    bool ok = true;
    if (n_tok > cap) {
        int c = cap;
        ok = grow((void **)&e->b_tokens, &c, n_tok, sizeof(int32_t));
        c = cap;
        ok = ok && grow((void **)&e->b_pos, &c, n_tok, sizeof(int32_t));
        c = cap;
        ok = ok && grow((void **)&e->b_seq, &c, n_tok, sizeof(int32_t));
        c = cap;
        ok = ok && grow((void **)&e->b_slots, &c, n_tok, sizeof(int32_t));
        c = cap;
        ok = ok && grow((void **)&e->b_rows, &c, n_tok, sizeof(int32_t));
        if (ok)
            e->cap_tok = c;
    }
    ok = ok && grow((void **)&e->b_tables, &e->cap_tables, n_tables, sizeof(int32_t));
    return ok;
}

enum moe_status moe_engine_step(struct moe_engine *e, int *n_tokens, struct moe_error *err)
{
    if (n_tokens)
        *n_tokens = 0;
    double t_step = e->opts.spec_cost ? engine_clock(e) : 0;
    int64_t emitted = e->counts.generated_tokens;
    e->step_draft_s = 0;
    take_inbox_and_aborts(e);
    int n_sched = schedule(e);
    if (!n_sched) {
        publish_stats(e);
        return MOE_OK;
    }
    int bs = e->opts.block_size, n_tok = 0, max_blocks = 1, n_logits = 0, n_rows = 0;
    for (int i = 0; i < n_sched; i++) {
        n_tok += e->sched[i].count;
        n_rows += entry_rows(&e->sched[i]);
        if (e->sched[i].s->n_blocks > max_blocks)
            max_blocks = e->sched[i].s->n_blocks;
    }
    bool decode_only = true; /* every row a sequence's next token (drafts or not) */
    for (int i = 0; i < n_sched; i++)
        decode_only &= e->sched[i].count - e->sched[i].n_draft == 1 &&
                       e->sched[i].start == e->sched[i].s->n_tokens - 1;
    int vocab = e->cfg->vocab_size;
    /* ids only: every row greedy (or drawn by the backend) and nothing else
     * of the logits needed */
    bool ids = (!e->opts.forward || e->opts.forward_ids) && !e->opts.host_sampling;
    bool drawn = false; /* some row sampled by the backend */
    for (int i = 0; ids && i < n_sched; i++) {
        const struct seq *s = e->sched[i].s;
        bool greedy = seq_greedy_only(e, s);
        ids = !e->sched[i].n_draft && (greedy || seq_backend_sampled(e, s));
        drawn |= !greedy && entry_rows(&e->sched[i]);
    }
    drawn &= ids;
    if (!reserve_batch(e, n_tok, n_sched * max_blocks) ||
        !grow((void **)&e->logits, &e->cap_logits, ids ? 0 : n_rows * vocab, sizeof(float)) ||
        !grow((void **)&e->ids, &e->cap_ids, n_rows, sizeof(int32_t)) ||
        (drawn && (!grow((void **)&e->s_temp, &e->cap_s_temp, n_rows, sizeof(float)) ||
                   !grow((void **)&e->s_top_p, &e->cap_s_top_p, n_rows, sizeof(float)) ||
                   !grow((void **)&e->s_u, &e->cap_s_u, n_rows, sizeof(double)))))
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory for a batch of %d tokens", n_tok);
    int t = 0;
    for (int i = 0; i < n_sched; i++) {
        const struct sched_entry *en = &e->sched[i];
        const struct seq *s = en->s;
        memcpy(e->b_tables + (size_t)i * max_blocks, s->blocks,
               (size_t)s->n_blocks * sizeof(int32_t));
        for (int j = s->n_blocks; j < max_blocks; j++)
            e->b_tables[(size_t)i * max_blocks + j] = 0;
        for (int j = 0; j < en->count; j++, t++) {
            int p = en->start + j;
            e->b_tokens[t] = p < s->n_tokens ? s->tokens[p] : s->draft[p - s->n_tokens];
            e->b_pos[t] = p;
            e->b_seq[t] = i;
            e->b_slots[t] = s->blocks[p / bs] * bs + p % bs;
        }
        for (int r = entry_rows(en); r > 0; r--) {
            if (drawn) { /* one row: the sequence's next token */
                const struct moe_sampler_params *sp = &s->params.sp;
                bool greedy = sp->temperature <= 0.0f;
                e->s_temp[n_logits] = greedy ? 0.0f : sp->temperature;
                e->s_top_p[n_logits] = sp->top_p;
                /* the draw moe_sample would take from the stream */
                e->s_u[n_logits] = greedy ? 0.0 : moe_rng_uniform(&en->s->rng);
            }
            e->b_rows[n_logits++] = t - r;
        }
    }
    struct moe_batch b = {
        .n_tok = n_tok,
        .tokens = e->b_tokens,
        .pos = e->b_pos,
        .seq = e->b_seq,
        .slots = e->b_slots,
        .n_seq = n_sched,
        .block_tables = e->b_tables,
        .max_blocks = max_blocks,
        .n_logits = n_logits,
        .logit_rows = e->b_rows,
        .argmax_out = ids ? e->ids : NULL,
        .sample_temp = drawn ? e->s_temp : NULL,
        .sample_top_p = drawn ? e->s_top_p : NULL,
        .sample_u = drawn ? e->s_u : NULL,
    };
    enum moe_status rc =
        e->opts.forward ? e->opts.forward(e->opts.forward_ctx, e->model, e->kv, &b, e->logits, err)
                        : moe_model_forward(e->model, e->kv, &b, e->logits, err);
    if (rc) {
        /* The batch is lost: finish its requests with the error; the engine
         * keeps serving the others. */
        for (int i = 0; i < n_sched; i++) {
            struct seq *s = e->sched[i].s;
            for (int j = 0; j < e->running.n; j++)
                if (e->running.v[j] == s) {
                    list_remove_at(&e->running, j);
                    break;
                }
            seq_finish_bare(e, s, MOE_FINISH_ERROR, err ? err->msg : "model forward failed");
        }
        publish_stats(e);
        return rc;
    }
    e->counts.steps++;
    e->counts.computed_tokens += n_tok;
    for (int i = 0; e->opts.kv_parts > 1 && i < n_sched; i++)
        e->counts.part_tokens[e->sched[i].s->part] += e->sched[i].count;
    int row = 0;
    for (int i = 0; i < n_sched; i++) {
        const struct sched_entry *en = &e->sched[i];
        struct seq *s = en->s;
        int rows = entry_rows(en), from = 0;
        int plp = plp_rows(s, en->start, en->start + en->count - en->n_draft, &from);
        plp_read(s, e->logits + (size_t)row * vocab, from, plp, vocab);
        row += plp;
        rows -= plp;
        s->n_computed += en->count - en->n_draft;
        seq_publish_blocks(e, s);
        if (en->n_draft)
            seq_verify(e, s, en->n_draft, e->logits + (size_t)row * vocab);
        else if (rows)
            seq_emit(e, s, ids ? NULL : e->logits + (size_t)row * vocab, ids ? e->ids[row] : -1);
        row += rows;
    }
    if (e->opts.spec_cost && e->opts.spec_tokens > 0)
        spec_cost_step(&e->spec_cost, decode_only, n_tok,
                       (int)(e->counts.generated_tokens - emitted), engine_clock(e) - t_step,
                       e->step_draft_s);
    publish_stats(e);
    if (n_tokens)
        *n_tokens = n_tok;
    return MOE_OK;
}

enum moe_status moe_engine_check(struct moe_engine *e, struct moe_error *err)
{
    int n_block = e->opts.n_block;
    int *refs = calloc((size_t)n_block, sizeof *refs);
    if (!refs)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    struct seq_list *lists[3] = {&e->waiting, &e->running, &e->parked};
    enum moe_status rc = MOE_OK;
    for (int r = 0; r < e->n_resv; r++)
        for (int j = 0; j < e->resv[r].n_blocks; j++)
            refs[e->resv[r].blocks[j]]++;
    for (int l = 0; l < 3 && !rc; l++)
        for (int i = 0; i < lists[l]->n && !rc; i++) {
            const struct seq *s = lists[l]->v[i];
            if (l == 0 && s->n_blocks)
                rc = moe_error_set(err, MOE_ERR_INTERNAL, "waiting request %llu holds %d blocks",
                                   (unsigned long long)s->id, s->n_blocks);
            if (s->n_computed > s->n_blocks * e->opts.block_size)
                rc = moe_error_set(err, MOE_ERR_INTERNAL,
                                   "request %llu: %d tokens computed in %d blocks",
                                   (unsigned long long)s->id, s->n_computed, s->n_blocks);
            /* between steps nothing is held ahead of the K/V: no block
             * taken for a step's drafts outlives it */
            if (!rc && l > 0 && s->n_blocks != blocks_for(e, s->n_computed))
                rc = moe_error_set(err, MOE_ERR_INTERNAL,
                                   "request %llu holds %d blocks for %d computed tokens",
                                   (unsigned long long)s->id, s->n_blocks, s->n_computed);
            for (int j = 0; j < s->n_blocks; j++) {
                refs[s->blocks[j]]++;
                if (!rc && kv_pool_part_of(e->pool, s->blocks[j]) != s->part)
                    rc = moe_error_set(err, MOE_ERR_INTERNAL,
                                       "request %llu of KV part %d holds block %d of part %d",
                                       (unsigned long long)s->id, s->part, s->blocks[j],
                                       kv_pool_part_of(e->pool, s->blocks[j]));
            }
        }
    if (!rc)
        rc = kv_pool_check(e->pool, refs, err);
    free(refs);
    return rc;
}
