#include "group/dp_batch.h"

#include <stdlib.h>
#include <string.h>

int moe_dp_seq_rank(const struct moe_batch *g, int s, int part_blocks)
{
    return g->block_tables[(size_t)s * g->max_blocks] / part_blocks;
}

static bool grow(int32_t **p, int *cap, size_t need)
{
    if (need <= (size_t)*cap)
        return true;
    size_t n = need > 2 * (size_t)*cap ? need : 2 * (size_t)*cap;
    int32_t *q = realloc(*p, n * sizeof *q);
    if (!q)
        return false;
    *p = q;
    *cap = (int)n;
    return true;
}

enum moe_status moe_dp_split_batch(const struct moe_batch *g, int n_rank, int part_blocks,
                                   int block_size, int rank, struct moe_dp_split *o,
                                   struct moe_error *err)
{
    const int P = part_blocks, slot0 = rank * part_blocks * block_size,
              n_slot = part_blocks * block_size;
    size_t nt = (size_t)g->n_tok + 1, n_tab = (size_t)g->n_seq * g->max_blocks + 1;
    int cap_tok = o->cap_tok;
    bool ok = true;
    int32_t **tok_arrays[] = {&o->tokens, &o->pos, &o->seq, &o->slots, &o->logit_rows, &o->row_of};
    for (size_t i = 0; i < sizeof tok_arrays / sizeof *tok_arrays; i++) {
        int cap = o->cap_tok; /* every one of them has this capacity */
        ok = ok && grow(tok_arrays[i], &cap, nt);
        cap_tok = cap;
    }
    if (ok)
        o->cap_tok = cap_tok;
    if (!ok || !grow(&o->tables, &o->cap_tables, n_tab) ||
        !grow(&o->seq_map, &o->cap_seq, (size_t)g->n_seq + 1) ||
        !grow(&o->logit_rank, &o->cap_logits, (size_t)g->n_logits + 1))
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory splitting a batch of %d tokens",
                             g->n_tok);
    int n_seq = 0;
    for (int s = 0; s < g->n_seq; s++) {
        int r = moe_dp_seq_rank(g, s, P);
        if (r < 0 || r >= n_rank)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "batch sequence %d: block %d is in no rank's part (%d x %d)", s,
                                 g->block_tables[(size_t)s * g->max_blocks], n_rank, P);
        o->seq_map[s] = r == rank ? n_seq : -1;
        if (r != rank)
            continue;
        const int32_t *src = g->block_tables + (size_t)s * g->max_blocks;
        int32_t *dst = o->tables + (size_t)n_seq * g->max_blocks;
        for (int j = 0; j < g->max_blocks; j++) /* the padding (0) stays 0 */
            dst[j] = src[j] >= r * P && src[j] < (r + 1) * P ? src[j] - r * P : 0;
        n_seq++;
    }
    int n = 0;
    for (int t = 0; t < g->n_tok; t++) {
        int ls = o->seq_map[g->seq[t]];
        o->row_of[t] = ls < 0 ? -1 : n;
        if (ls < 0)
            continue;
        if (g->slots[t] < slot0 || g->slots[t] >= slot0 + n_slot)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "batch row %d: KV slot %d is outside rank %d's blocks", t,
                                 g->slots[t], rank);
        o->tokens[n] = g->tokens[t];
        o->pos[n] = g->pos[t];
        o->seq[n] = ls;
        o->slots[n] = g->slots[t] - slot0;
        n++;
    }
    int n_logits = 0;
    for (int i = 0; i < g->n_logits; i++) {
        int t = g->logit_rows[i];
        o->logit_rank[i] = moe_dp_seq_rank(g, g->seq[t], P);
        if (o->row_of[t] >= 0)
            o->logit_rows[n_logits++] = o->row_of[t];
    }
    o->b = (struct moe_batch){
        .n_tok = n,
        .tokens = o->tokens,
        .pos = o->pos,
        .seq = o->seq,
        .slots = o->slots,
        .n_seq = n_seq,
        .block_tables = o->tables,
        .max_blocks = g->max_blocks,
        .n_logits = n_logits,
        .logit_rows = o->logit_rows,
        .n_tok_group = g->n_tok,
    };
    return MOE_OK;
}

void moe_dp_split_free(struct moe_dp_split *s)
{
    free(s->tokens);
    free(s->pos);
    free(s->seq);
    free(s->slots);
    free(s->tables);
    free(s->logit_rows);
    free(s->row_of);
    free(s->seq_map);
    free(s->logit_rank);
    memset(s, 0, sizeof *s);
}
