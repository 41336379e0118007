/* Continuous-batching engine: scheduler, KV block bookkeeping, sampling and
 * request life cycle. See engine.h for the contract. */
#include "engine.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "generate.h"
#include "kv_pool.h"

struct seq {
    uint64_t id;
    int32_t *tokens;      /* (cap_tokens) prompt, then generated ids */
    int n_tokens;
    int cap_tokens;
    int n_prompt;
    int n_computed;       /* tokens whose K/V are in the cache */
    int32_t *blocks;      /* (cap_blocks) block table */
    uint64_t *block_hash; /* (cap_blocks) chained hash of each full block */
    int n_blocks;
    int n_hashed;         /* blocks [0, n_hashed) are full and hashed */
    int cap_blocks;
    struct moe_request_params params;
    struct moe_rng rng;
    moe_token_cb cb;
    void *user;
    uint8_t *seen;        /* (vocab) penalties: token in prompt or output */
    int32_t *out_count;   /* (vocab) penalties: occurrences in the output */
    char *text;           /* decoded output, kept when there are stop strings */
    size_t text_len;
    bool prompt_counted;
    double t_admitted;
    int n_cached;
};

/* One scheduled piece of work: tokens [start, start + count) of a sequence. */
struct sched_entry {
    struct seq *s;
    int start;
    int count;
};

struct seq_list {
    struct seq **v;
    int n;
    int cap;
};

struct moe_engine {
    struct moe_model *model;
    struct moe_tokenizer *tok;
    const struct moe_config *cfg;
    struct moe_engine_opts opts;
    struct moe_kv_cache *kv;
    struct kv_pool *pool;
    struct seq_list waiting; /* FCFS; preempted sequences go to the front */
    struct seq_list running; /* admission order: the last is the newest */
    struct moe_rng seed_rng;

    /* step scratch */
    struct sched_entry *sched;
    int cap_sched;
    int32_t *b_tokens, *b_pos, *b_seq, *b_slots, *b_rows, *b_tables;
    int cap_tok, cap_tables;
    float *logits;
    int cap_logits;
    void *sample_work;

    pthread_mutex_t mu;      /* guards everything below */
    struct seq_list inbox;
    uint64_t *aborts;
    int n_aborts, cap_aborts;
    uint64_t *live;          /* ids of every request not yet finished */
    int n_live, cap_live;
    struct moe_engine_stats stats;
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
    enum moe_status rc = kv_pool_create(o.n_block, o.block_size, &e->pool, err);
    if (!rc)
        rc = moe_kv_cache_create(model, o.n_block, o.block_size, &e->kv, err);
    if (!rc && !(e->sample_work = malloc((size_t)e->cfg->vocab_size * 8)))
        rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    if (rc) {
        moe_engine_destroy(e);
        return rc;
    }
    e->stats.kv_blocks_total = o.n_block;
    e->stats.block_size = o.block_size;
    e->stats.kv_blocks_free = o.n_block;
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
    free(e->sample_work);
    moe_kv_cache_free(e->model, e->kv);
    kv_pool_destroy(e->pool);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

/* ---- submit / abort (any thread) --------------------------------------------------- */

static enum moe_status check_params(const struct moe_engine *e, const int32_t *prompt,
                                    int n_prompt, const struct moe_request_params *p,
                                    struct moe_error *err)
{
    const struct moe_config *c = e->cfg;
    if (n_prompt < 1)
        return moe_error_set(err, MOE_ERR_INVALID, "prompt: empty");
    for (int i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= c->vocab_size)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "prompt: token id %d at index %d is outside the vocabulary [0, %d)",
                                 prompt[i], i, c->vocab_size);
    if (p->max_tokens < 1)
        return moe_error_set(err, MOE_ERR_INVALID, "max_tokens: %d, must be >= 1", p->max_tokens);
    if ((int64_t)n_prompt + p->max_tokens > c->max_pos)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "max_tokens: prompt (%d tokens) + max_tokens (%d) exceeds the model "
                             "context of %d",
                             n_prompt, p->max_tokens, c->max_pos);
    int64_t blocks = ((int64_t)n_prompt + p->max_tokens + e->opts.block_size - 1) /
                     e->opts.block_size;
    if (blocks > e->opts.n_block)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "max_tokens: prompt + max_tokens need %lld KV blocks, the pool has %d",
                             (long long)blocks, e->opts.n_block);
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

enum moe_status moe_engine_submit(struct moe_engine *e, uint64_t req_id, const int32_t *prompt,
                                  int n_prompt, const struct moe_request_params *params,
                                  moe_token_cb cb, void *user, struct moe_error *err)
{
    enum moe_status rc = check_params(e, prompt, n_prompt, params, err);
    if (rc)
        return rc;
    struct seq *s = calloc(1, sizeof *s);
    if (!s)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    s->id = req_id;
    s->n_prompt = s->n_tokens = n_prompt;
    s->cap_tokens = n_prompt + params->max_tokens;
    s->cap_blocks = (s->cap_tokens + e->opts.block_size - 1) / e->opts.block_size;
    s->tokens = malloc((size_t)s->cap_tokens * sizeof *s->tokens);
    s->blocks = malloc((size_t)s->cap_blocks * sizeof *s->blocks);
    s->block_hash = malloc((size_t)s->cap_blocks * sizeof *s->block_hash);
    s->params = *params;
    s->cb = cb;
    s->user = user;
    if (moe_sampler_has_penalties(&params->sp)) {
        s->seen = calloc((size_t)e->cfg->vocab_size, 1);
        s->out_count = calloc((size_t)e->cfg->vocab_size, sizeof *s->out_count);
    }
    if (!s->tokens || !s->blocks || !s->block_hash ||
        (moe_sampler_has_penalties(&params->sp) && (!s->seen || !s->out_count))) {
        seq_free(s);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    memcpy(s->tokens, prompt, (size_t)n_prompt * sizeof *prompt);
    if (s->seen)
        for (int i = 0; i < n_prompt; i++)
            s->seen[prompt[i]] = 1;

    pthread_mutex_lock(&e->mu);
    if (live_find(e, req_id) >= 0) {
        pthread_mutex_unlock(&e->mu);
        seq_free(s);
        return moe_error_set(err, MOE_ERR_INVALID, "request id %llu is already in flight",
                             (unsigned long long)req_id);
    }
    uint64_t seed = params->has_seed ? params->seed : (uint64_t)(moe_rng_uniform(&e->seed_rng) * 0x1p53);
    moe_rng_seed(&s->rng, seed);
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
    bool busy = e->n_live > 0;
    pthread_mutex_unlock(&e->mu);
    return busy;
}

void moe_engine_stats(struct moe_engine *e, struct moe_engine_stats *out)
{
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
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
}

/* Finishes a sequence that is in neither list any more: frees its blocks,
 * tells the caller, forgets its id. */
static void seq_finish(struct moe_engine *e, struct seq *s, struct moe_token_event *ev)
{
    seq_release_blocks(e, s);
    if (s->cb)
        s->cb(s->user, ev);
    pthread_mutex_lock(&e->mu);
    int i = live_find(e, s->id);
    if (i >= 0)
        e->live[i] = e->live[--e->n_live];
    if (ev->finish == MOE_FINISH_ABORT)
        e->stats.aborted++;
    else
        e->stats.finished++;
    pthread_mutex_unlock(&e->mu);
    seq_free(s);
}

static void seq_finish_bare(struct moe_engine *e, struct seq *s, enum moe_finish f,
                            const char *error)
{
    struct moe_token_event ev = {
        .req_id = s->id, .token = -1, .index = s->n_tokens - s->n_prompt, .finish = f,
        .stop_string = -1, .error = error, .t_admitted = s->t_admitted, .n_prompt = s->n_prompt,
        .n_cached = s->n_cached};
    seq_finish(e, s, &ev);
}

/* Takes prefix-cache hits for the full blocks of a sequence about to be
 * admitted, leaving at least its last token to compute. */
static void seq_take_prefix(struct moe_engine *e, struct seq *s)
{
    int bs = e->opts.block_size;
    while (!e->opts.no_prefix_cache && (s->n_blocks + 1) * bs <= s->n_tokens - 1) {
        int i = s->n_blocks;
        uint64_t parent = i ? s->block_hash[i - 1] : 0;
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
        uint64_t parent = i ? s->block_hash[i - 1] : 0;
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

/* Preempts the newest running sequence: frees its blocks (full ones stay in
 * the prefix cache) and puts it at the front of the waiting queue. */
static void preempt_newest(struct moe_engine *e)
{
    struct seq *s = e->running.v[e->running.n - 1];
    e->running.n--;
    seq_release_blocks(e, s);
    MOE_ASSERT(list_reserve(&e->waiting, e->waiting.n + 1));
    memmove(e->waiting.v + 1, e->waiting.v, (size_t)e->waiting.n * sizeof *e->waiting.v);
    e->waiting.v[0] = s;
    e->waiting.n++;
    e->stats.preemptions++;
}

/* ---- scheduling ------------------------------------------------------------------------ */

static bool sched_add(struct moe_engine *e, int *n, struct seq *s, int count)
{
    if (!grow((void **)&e->sched, &e->cap_sched, *n + 1, sizeof *e->sched))
        return false;
    e->sched[(*n)++] = (struct sched_entry){s, s->n_computed, count};
    return true;
}

/* Picks this step's work; returns the number of entries. */
static int schedule(struct moe_engine *e)
{
    int budget = e->opts.max_batch_tokens, n = 0;
    /* Running sequences, oldest first: decodes and continuing prompt chunks. */
    for (int i = 0; i < e->running.n && budget > 0; i++) {
        struct seq *s = e->running.v[i];
        int count = s->n_tokens - s->n_computed;
        if (count > budget)
            count = budget;
        int need = blocks_for(e, s->n_computed + count) - s->n_blocks;
        bool self_preempted = false;
        while (need > kv_pool_available(e->pool)) {
            if (e->running.v[e->running.n - 1] == s) {
                preempt_newest(e);
                self_preempted = true;
                break;
            }
            preempt_newest(e);
        }
        if (self_preempted)
            break;
        for (; need > 0; need--)
            s->blocks[s->n_blocks++] = kv_pool_alloc(e->pool);
        if (!sched_add(e, &n, s, count))
            break;
        budget -= count;
    }
    /* Waiting sequences, first come first served, while their blocks fit. */
    while (e->waiting.n && budget > 0 && e->running.n < e->opts.max_running) {
        struct seq *s = e->waiting.v[0];
        seq_take_prefix(e, s);
        int count = s->n_tokens - s->n_computed;
        if (count > budget)
            count = budget;
        int need = blocks_for(e, s->n_computed + count) - s->n_blocks;
        if (need > kv_pool_available(e->pool)) {
            seq_release_blocks(e, s); /* give the prefix hits back; try again later */
            break;
        }
        for (; need > 0; need--)
            s->blocks[s->n_blocks++] = kv_pool_alloc(e->pool);
        if (!s->prompt_counted) {
            s->prompt_counted = true;
            s->t_admitted = moe_now();
            s->n_cached = s->n_computed;
            e->stats.prompt_tokens += s->n_prompt;
            e->stats.prefix_hit_tokens += s->n_computed;
        }
        list_remove_at(&e->waiting, 0);
        MOE_ASSERT(list_push(&e->running, s));
        if (!sched_add(e, &n, s, count))
            break;
        budget -= count;
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

/* Samples the next token of `s` from its logits row and reports it. Returns
 * true when the sequence finished (it is then freed). */
static bool seq_emit(struct moe_engine *e, struct seq *s, float *row)
{
    int vocab = e->cfg->vocab_size;
    const struct moe_request_params *p = &s->params;
    struct moe_token_event ev = {.req_id = s->id, .stop_string = -1, .text_len = -1,
                                 .t_admitted = s->t_admitted, .n_prompt = s->n_prompt,
                                 .n_cached = s->n_cached};
    if (p->logprobs >= 0) {
        /* raw model distribution; the token is filled in after sampling */
        ev.n_top = p->logprobs;
    }
    if (e->opts.logits_hook)
        e->opts.logits_hook(e->opts.logits_hook_user, s->id, s->n_tokens - s->n_prompt, row, vocab);
    bool raw_lp_needed = p->logprobs >= 0;
    float *raw = NULL;
    if (raw_lp_needed && moe_sampler_has_penalties(&p->sp)) {
        raw = malloc((size_t)vocab * sizeof *raw);
        if (raw)
            memcpy(raw, row, (size_t)vocab * sizeof *raw);
    }
    if (s->seen)
        moe_apply_penalties(row, vocab, &p->sp, s->seen, s->out_count);
    int32_t t = moe_sample(row, vocab, &p->sp, &s->rng, e->sample_work);
    if (raw_lp_needed)
        ev.logprob = moe_logprobs(raw ? raw : row, vocab, t, ev.n_top, ev.top_ids, ev.top_logprobs);
    free(raw);
    MOE_ASSERT(s->n_tokens < s->cap_tokens);
    s->tokens[s->n_tokens++] = t;
    if (s->seen) {
        s->seen[t] = 1;
        s->out_count[t]++;
    }
    e->stats.generated_tokens++;
    ev.token = t;
    ev.index = s->n_tokens - s->n_prompt - 1;
    if (is_stop_id(e, s, t))
        ev.finish = MOE_FINISH_STOP;
    if (!ev.finish && p->n_stop_strings) {
        ev.stop_string = match_stop_string(e, s, &ev.text_len);
        if (ev.stop_string >= 0)
            ev.finish = MOE_FINISH_STOP;
    }
    if (!ev.finish && s->n_tokens - s->n_prompt >= p->max_tokens)
        ev.finish = MOE_FINISH_LENGTH;
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

/* ---- step ---------------------------------------------------------------------------- */

static void take_inbox_and_aborts(struct moe_engine *e)
{
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < e->inbox.n; i++)
        MOE_ASSERT(list_push(&e->waiting, e->inbox.v[i]));
    e->inbox.n = 0;
    int n_aborts = e->n_aborts;
    uint64_t small[64], *ids = n_aborts <= 64 ? small : malloc((size_t)n_aborts * sizeof *ids);
    MOE_ASSERT(ids);
    if (n_aborts)
        memcpy(ids, e->aborts, (size_t)n_aborts * sizeof *ids);
    e->n_aborts = 0;
    pthread_mutex_unlock(&e->mu);

    for (int a = 0; a < n_aborts; a++) {
        struct seq_list *lists[2] = {&e->waiting, &e->running};
        for (int l = 0; l < 2; l++)
            for (int i = 0; i < lists[l]->n; i++)
                if (lists[l]->v[i]->id == ids[a]) {
                    struct seq *s = lists[l]->v[i];
                    list_remove_at(lists[l], i);
                    seq_finish_bare(e, s, MOE_FINISH_ABORT, NULL);
                    l = 2;
                    break;
                }
    }
    if (ids != small)
        free(ids);
}

static void update_stats(struct moe_engine *e)
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
    pthread_mutex_unlock(&e->mu);
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
    take_inbox_and_aborts(e);
    int n_sched = schedule(e);
    if (!n_sched) {
        update_stats(e);
        return MOE_OK;
    }
    int bs = e->opts.block_size, n_tok = 0, max_blocks = 1, n_logits = 0;
    for (int i = 0; i < n_sched; i++) {
        n_tok += e->sched[i].count;
        if (e->sched[i].s->n_blocks > max_blocks)
            max_blocks = e->sched[i].s->n_blocks;
    }
    int vocab = e->cfg->vocab_size;
    if (!reserve_batch(e, n_tok, n_sched * max_blocks) ||
        !grow((void **)&e->logits, &e->cap_logits, n_sched * vocab, sizeof(float)))
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory for a batch of %d tokens", n_tok);
    int t = 0;
    for (int i = 0; i < n_sched; i++) {
        const struct sched_entry *en = &e->sched[i];
        const struct seq *s = en->s;
        memcpy(e->b_tables + (size_t)i * max_blocks, s->blocks, (size_t)s->n_blocks * sizeof(int32_t));
        for (int j = s->n_blocks; j < max_blocks; j++)
            e->b_tables[(size_t)i * max_blocks + j] = 0;
        for (int j = 0; j < en->count; j++, t++) {
            int p = en->start + j;
            e->b_tokens[t] = s->tokens[p];
            e->b_pos[t] = p;
            e->b_seq[t] = i;
            e->b_slots[t] = s->blocks[p / bs] * bs + p % bs;
        }
        if (en->start + en->count == s->n_tokens)
            e->b_rows[n_logits++] = t - 1;
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
    };
    enum moe_status rc = e->opts.forward
                             ? e->opts.forward(e->opts.forward_ctx, e->model, e->kv, &b, e->logits, err)
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
        update_stats(e);
        return rc;
    }
    e->stats.steps++;
    e->stats.computed_tokens += n_tok;
    int row = 0;
    for (int i = 0; i < n_sched; i++) {
        struct seq *s = e->sched[i].s;
        bool has_logits = e->sched[i].start + e->sched[i].count == s->n_tokens;
        s->n_computed += e->sched[i].count;
        seq_publish_blocks(e, s);
        if (has_logits)
            seq_emit(e, s, e->logits + (size_t)row++ * vocab);
    }
    update_stats(e);
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
    struct seq_list *lists[2] = {&e->waiting, &e->running};
    enum moe_status rc = MOE_OK;
    for (int l = 0; l < 2 && !rc; l++)
        for (int i = 0; i < lists[l]->n && !rc; i++) {
            const struct seq *s = lists[l]->v[i];
            if (l == 0 && s->n_blocks)
                rc = moe_error_set(err, MOE_ERR_INTERNAL, "waiting request %llu holds %d blocks",
                                   (unsigned long long)s->id, s->n_blocks);
            if (s->n_computed > s->n_blocks * e->opts.block_size)
                rc = moe_error_set(err, MOE_ERR_INTERNAL,
                                   "request %llu: %d tokens computed in %d blocks",
                                   (unsigned long long)s->id, s->n_computed, s->n_blocks);
            for (int j = 0; j < s->n_blocks; j++)
                refs[s->blocks[j]]++;
        }
    if (!rc)
        rc = kv_pool_check(e->pool, refs, err);
    free(refs);
    return rc;
}
