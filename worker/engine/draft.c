/* Draft-model proposals (see draft.h). */
#include "engine/draft.h"

#include <stdlib.h>
#include <string.h>

#include "engine/generate.h" /* moe_now */
#include "engine/sampler.h"

struct moe_draft {
    struct moe_model *model;
    struct moe_kv_cache *kv;
    int block_size, vocab;
    /* per-pass batch scratch, grown as needed */
    int32_t *tokens, *pos, *seq, *slots; /* (cap_tok) */
    int32_t *rows, *row_seq;             /* (cap_rows) logits rows, the sequence of each */
    int32_t *tables;                     /* (cap_tables) */
    int cap_tok, cap_tables, cap_rows;
    float *logits;
};

enum moe_status moe_draft_create(struct moe_model *draft, const struct moe_model *target,
                                 int n_block, int block_size, struct moe_draft **out,
                                 struct moe_error *err)
{
    *out = NULL;
    const struct moe_config *dc = moe_model_config(draft), *tc = moe_model_config(target);
    if (dc->vocab_size != tc->vocab_size)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "--draft-model: its vocabulary has %d ids, the model's %d: a draft "
                             "must share the model's tokenizer",
                             dc->vocab_size, tc->vocab_size);
    struct moe_draft *d = calloc(1, sizeof *d);
    if (!d)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    d->model = draft;
    d->block_size = block_size;
    d->vocab = dc->vocab_size;
    enum moe_status rc = moe_kv_cache_create(draft, n_block, block_size, &d->kv, err);
    if (rc) {
        free(d);
        return moe_error_prefix(err, "--draft-model");
    }
    *out = d;
    return MOE_OK;
}

void moe_draft_destroy(struct moe_draft *d)
{
    if (!d)
        return;
    moe_kv_cache_free(d->model, d->kv);
    free(d->tokens);
    free(d->pos);
    free(d->seq);
    free(d->slots);
    free(d->rows);
    free(d->row_seq);
    free(d->tables);
    free(d->logits);
    free(d);
}

size_t moe_draft_block_bytes(const struct moe_model *draft, int block_size)
{
    const struct moe_config *c = moe_model_config(draft);
    return moe_kv_block_bytes(c->n_layer, block_size, moe_config_kv_token_elems(c, 1),
                              moe_model_kv_dtype(draft));
}

/* Grows the batch scratch for n_tok tokens, n_rows logits rows and n_tables
 * block-table entries. */
static enum moe_status reserve(struct moe_draft *d, int n_tok, int n_rows, int n_tables,
                               struct moe_error *err)
{
    bool ok = true;
    if (n_tok > d->cap_tok) {
        int c = d->cap_tok ? d->cap_tok : 64;
        while (c < n_tok)
            c *= 2;
        int32_t **arr[] = {&d->tokens, &d->pos, &d->seq, &d->slots};
        for (size_t i = 0; ok && i < sizeof arr / sizeof arr[0]; i++) {
            int32_t *q = realloc(*arr[i], (size_t)c * sizeof *q);
            ok = q != NULL;
            if (q)
                *arr[i] = q;
        }
        if (ok)
            d->cap_tok = c;
    }
    if (ok && n_rows > d->cap_rows) {
        int32_t *r = realloc(d->rows, (size_t)n_rows * sizeof *r);
        int32_t *rs = r ? realloc(d->row_seq, (size_t)n_rows * sizeof *rs) : NULL;
        float *l = rs ? realloc(d->logits, (size_t)n_rows * d->vocab * sizeof *l) : NULL;
        if (r)
            d->rows = r;
        if (rs)
            d->row_seq = rs;
        if (l) {
            d->logits = l;
            d->cap_rows = n_rows;
        }
        ok = l != NULL;
    }
    if (ok && n_tables > d->cap_tables) {
        int32_t *q = realloc(d->tables, (size_t)n_tables * sizeof *q);
        ok = q != NULL;
        if (q) {
            d->tables = q;
            d->cap_tables = n_tables;
        }
    }
    if (!ok)
        return moe_error_set(err, MOE_ERR_NOMEM, "draft: out of memory for a batch of %d tokens",
                             n_tok);
    return MOE_OK;
}

enum moe_status moe_draft_propose(struct moe_draft *d, struct moe_draft_seq *s, int n,
                                  struct moe_draft_pass *passes, struct moe_error *err)
{
    if (n <= 0)
        return MOE_OK;
    const int bs = d->block_size;
    int k_max = 0, max_blocks = 1, n_tok = 0;
    for (int i = 0; i < n; i++) {
        if (s[i].done >= s[i].n_tokens) /* the last token is fed again for its logits */
            s[i].done = s[i].n_tokens - 1;
        if (s[i].done < 0)
            s[i].done = 0;
        k_max = s[i].k > k_max ? s[i].k : k_max;
        max_blocks = s[i].n_blocks > max_blocks ? s[i].n_blocks : max_blocks;
        n_tok += s[i].n_tokens - s[i].done;
    }
    enum moe_status rc = reserve(d, n_tok > n ? n_tok : n, n, n * max_blocks, err);
    if (rc)
        return rc;
    for (int i = 0; i < n; i++) {
        memcpy(d->tables + (size_t)i * max_blocks, s[i].blocks,
               (size_t)s[i].n_blocks * sizeof *d->tables);
        for (int b = s[i].n_blocks; b < max_blocks; b++)
            d->tables[(size_t)i * max_blocks + b] = s[i].blocks[0]; /* never read */
    }
    for (int pass = 0; pass < k_max; pass++) {
        int t = 0, r = 0;
        for (int i = 0; i < n; i++) {
            if (pass >= s[i].k)
                continue;
            int from = pass ? s[i].n_tokens + pass - 1 : s[i].done;
            int to = s[i].n_tokens + pass; /* exclusive */
            for (int p = from; p < to; p++, t++) {
                d->tokens[t] = pass ? s[i].out[pass - 1] : s[i].tokens[p];
                d->pos[t] = p;
                d->seq[t] = i;
                d->slots[t] = s[i].blocks[p / bs] * bs + p % bs;
            }
            d->rows[r] = t - 1;
            d->row_seq[r++] = i;
        }
        struct moe_batch b = {.n_tok = t,
                              .tokens = d->tokens,
                              .pos = d->pos,
                              .seq = d->seq,
                              .slots = d->slots,
                              .n_seq = n,
                              .block_tables = d->tables,
                              .max_blocks = max_blocks,
                              .n_logits = r,
                              .logit_rows = d->rows};
        double t0 = passes ? moe_now() : 0;
        if ((rc = moe_model_forward(d->model, d->kv, &b, d->logits, err)))
            return moe_error_prefix(err, "draft forward");
        for (int j = 0; j < r; j++)
            s[d->row_seq[j]].out[pass] = moe_argmax(d->logits + (size_t)j * d->vocab, d->vocab);
        if (passes)
            passes[pass] = (struct moe_draft_pass){.n_rows = r, .seconds = moe_now() - t0};
    }
    return MOE_OK;
}
