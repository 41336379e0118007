#include "engine/generate.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

void moe_gen_result_free(struct moe_gen_result *res)
{
    if (!res)
        return;
    free(res->tokens);
    memset(res, 0, sizeof *res);
}

static enum moe_status plain_forward(void *ctx, struct moe_model *m, struct moe_kv_cache *kv,
                                     const struct moe_batch *b, float *logits,
                                     struct moe_error *err)
{
    (void)ctx;
    return moe_model_forward(m, kv, b, logits, err);
}

static bool is_eos(const struct moe_config *c, int32_t id)
{
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_ids[i] == id)
            return true;
    return false;
}

enum moe_status moe_generate(struct moe_model *m, const int32_t *prompt, int n_prompt,
                             const struct moe_gen_opts *opts, float *prompt_logits,
                             struct moe_gen_result *res, struct moe_error *err)
{
    memset(res, 0, sizeof *res);
    const struct moe_config *c = moe_model_config(m);
    if (n_prompt < 1)
        return moe_error_set(err, MOE_ERR_INVALID, "the prompt is empty");
    if (opts->n_predict < 0)
        return moe_error_set(err, MOE_ERR_INVALID, "n_predict %d is negative", opts->n_predict);
    int64_t total = (int64_t)n_prompt + opts->n_predict;
    if (total > c->max_pos)
        return moe_error_set(
            err, MOE_ERR_INVALID,
            "prompt (%d tokens) + n_predict (%d) exceeds max_position_embeddings %d", n_prompt,
            opts->n_predict, c->max_pos);
    int block_size = opts->block_size > 0 ? opts->block_size : 16;
    int chunk = opts->prefill_chunk > 0 ? opts->prefill_chunk : 512;
    int n_block = (int)((total + block_size - 1) / block_size);
    int vocab = c->vocab_size;
    moe_forward_fn forward = opts->forward ? opts->forward : plain_forward;

    struct moe_kv_cache *kv = NULL;
    int32_t *table = malloc((size_t)n_block * sizeof *table);
    int32_t *pos = malloc((size_t)chunk * sizeof *pos);
    int32_t *seq = calloc((size_t)chunk, sizeof *seq);
    int32_t *rows = malloc((size_t)chunk * sizeof *rows);
    float *logits = malloc((size_t)chunk * (size_t)vocab * sizeof *logits);
    void *work = malloc((size_t)vocab * 8);
    res->tokens = malloc(((size_t)opts->n_predict + 1) * sizeof *res->tokens);
    enum moe_status rc = MOE_OK;
    if (!table || !pos || !seq || !rows || !logits || !work || !res->tokens) {
        rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        goto done;
    }
    if ((rc = moe_kv_cache_create(m, n_block, block_size, &kv, err)))
        goto done;
    for (int i = 0; i < n_block; i++)
        table[i] = i; /* one sequence: blocks in order */
    res->n_prompt = n_prompt;

    struct moe_rng rng;
    moe_rng_seed(&rng, opts->seed);
    double t0 = moe_now();
    for (int done_tok = 0; done_tok < n_prompt;) {
        int n = n_prompt - done_tok < chunk ? n_prompt - done_tok : chunk;
        bool last = done_tok + n == n_prompt;
        int n_logits = 0;
        for (int i = 0; i < n; i++) {
            pos[i] = done_tok + i;
            if (prompt_logits || (last && i == n - 1))
                rows[n_logits++] = i;
        }
        struct moe_batch b = {
            .n_tok = n,
            .tokens = prompt + done_tok,
            .pos = pos,
            .seq = seq,
            .slots = pos, /* identity block table: slot == position */
            .n_seq = 1,
            .block_tables = table,
            .max_blocks = n_block,
            .n_logits = n_logits,
            .logit_rows = rows,
        };
        if ((rc = forward(opts->forward_ctx, m, kv, &b, logits, err)))
            goto done;
        if (prompt_logits)
            memcpy(prompt_logits + (size_t)done_tok * vocab, logits,
                   (size_t)n * (size_t)vocab * sizeof(float));
        done_tok += n;
    }
    res->prefill_s = moe_now() - t0;
    if (opts->n_predict == 0)
        goto done;

    const float *last_row = logits + (size_t)(prompt_logits ? ((n_prompt - 1) % chunk) : 0) * vocab;
    int32_t next = moe_sample(last_row, vocab, &opts->sp, &rng, work);
    res->tokens[res->n_tokens++] = next;
    double t1 = moe_now();
    while (res->n_tokens < opts->n_predict) {
        if (!opts->ignore_eos && is_eos(c, next)) {
            res->stopped_at_eos = true;
            break;
        }
        int32_t p = n_prompt + res->n_tokens - 1;
        int32_t row = 0, s0 = 0;
        struct moe_batch b = {
            .n_tok = 1,
            .tokens = &next,
            .pos = &p,
            .seq = &s0,
            .slots = &p,
            .n_seq = 1,
            .block_tables = table,
            .max_blocks = n_block,
            .n_logits = 1,
            .logit_rows = &row,
        };
        if ((rc = forward(opts->forward_ctx, m, kv, &b, logits, err)))
            goto done;
        next = moe_sample(logits, vocab, &opts->sp, &rng, work);
        res->tokens[res->n_tokens++] = next;
    }
    if (!opts->ignore_eos && is_eos(c, next))
        res->stopped_at_eos = true;
    res->decode_s = moe_now() - t1;

done:
    moe_kv_cache_free(m, kv);
    free(table);
    free(pos);
    free(seq);
    free(rows);
    free(logits);
    free(work);
    if (rc)
        moe_gen_result_free(res);
    return rc;
}
