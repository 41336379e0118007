/* Data-parallel attention's batch split (group/dp_batch.h): a step of three
 * sequences over a pool of 2 parts x 4 blocks of 4 tokens, cut into each
 * rank's batch (tokens in batch order, sequences renumbered, blocks and KV
 * slots local, logit rows local and their ranks listed in the global
 * order); a rank with no sequence gets an empty batch that still knows the
 * step's size; a sequence whose slot or block lies outside every part is
 * refused naming the row. */
#include <string.h>

#include "group/dp_batch.h"
#include "testlib.h"

enum { P = 4, BS = 4, MAXB = 2 };

static bool same(const int32_t *a, const int32_t *b, int n)
{
    return !memcmp(a, b, (size_t)n * sizeof *a);
}

int main(void)
{
    /* seq 0 on rank 1 (blocks 5, 6), seq 1 on rank 0 (block 2), seq 2 on
     * rank 1 (block 4); 0 pads the tables */
    const int32_t tables[] = {5, 6, 2, 0, 4, 0};
    /* rows: seq 0 positions 3..5, seq 1 position 0, seq 2 positions 1, 2 */
    const int32_t seq[] = {0, 0, 0, 1, 2, 2};
    const int32_t pos[] = {3, 4, 5, 0, 1, 2};
    const int32_t tokens[] = {10, 11, 12, 20, 30, 31};
    int32_t slots[6];
    for (int t = 0; t < 6; t++)
        slots[t] = tables[seq[t] * MAXB + pos[t] / BS] * BS + pos[t] % BS;
    const int32_t logit_rows[] = {2, 3, 5}; /* the last row of every sequence */
    struct moe_batch g = {.n_tok = 6,
                          .tokens = tokens,
                          .pos = pos,
                          .seq = seq,
                          .slots = slots,
                          .n_seq = 3,
                          .block_tables = tables,
                          .max_blocks = MAXB,
                          .n_logits = 3,
                          .logit_rows = logit_rows};
    struct moe_error err = {0};
    struct moe_dp_split s0 = {0}, s1 = {0}, s3 = {0};
    CHECK(moe_dp_seq_rank(&g, 0, P) == 1 && moe_dp_seq_rank(&g, 1, P) == 0 &&
          moe_dp_seq_rank(&g, 2, P) == 1);

    CHECKF(moe_dp_split_batch(&g, 2, P, BS, 0, &s0, &err) == MOE_OK, "%s", err.msg);
    const struct moe_batch *b = &s0.b;
    CHECK(b->n_tok == 1 && b->n_seq == 1 && b->n_tok_group == 6 && b->max_blocks == MAXB);
    CHECK(b->tokens[0] == 20 && b->pos[0] == 0 && b->seq[0] == 0 && b->slots[0] == 2 * BS);
    CHECK(b->block_tables[0] == 2 && b->block_tables[1] == 0);
    CHECK(b->n_logits == 1 && b->logit_rows[0] == 0);
    CHECK(same(s0.logit_rank, (const int32_t[]){1, 0, 1}, 3));

    CHECKF(moe_dp_split_batch(&g, 2, P, BS, 1, &s1, &err) == MOE_OK, "%s", err.msg);
    b = &s1.b;
    CHECK(b->n_tok == 5 && b->n_seq == 2);
    CHECK(same(b->tokens, (const int32_t[]){10, 11, 12, 30, 31}, 5));
    CHECK(same(b->seq, (const int32_t[]){0, 0, 0, 1, 1}, 5));
    /* blocks 5, 6 -> 1, 2; 4 -> 0: slot 5*4+3 -> 1*4+3, 6*4+0 -> 8, ... */
    CHECK(same(b->slots, (const int32_t[]){7, 8, 9, 1, 2}, 5));
    CHECK(same(b->block_tables, (const int32_t[]){1, 2, 0, 0}, 4));
    CHECK(b->n_logits == 2 && b->logit_rows[0] == 2 && b->logit_rows[1] == 4);

    /* a rank with nothing this step (a pool of 4 parts: ranks 2, 3 idle) */
    CHECKF(moe_dp_split_batch(&g, 4, P, BS, 3, &s3, &err) == MOE_OK, "%s", err.msg);
    CHECK(s3.b.n_tok == 0 && s3.b.n_seq == 0 && s3.b.n_logits == 0 && s3.b.n_tok_group == 6);

    /* refused: a block in no part, a slot outside its sequence's part */
    const int32_t bad_tables[] = {5, 6, 9, 0, 4, 0};
    struct moe_batch bad = g;
    bad.block_tables = bad_tables;
    CHECK(moe_dp_split_batch(&bad, 2, P, BS, 0, &s0, &err) == MOE_ERR_INVALID);
    CHECKF(strstr(err.msg, "batch sequence 1: block 9 is in no rank's part (2 x 4)") != NULL, "%s",
           err.msg);
    int32_t bad_slots[6];
    memcpy(bad_slots, slots, sizeof bad_slots);
    bad_slots[4] = 3 * BS; /* seq 2 lives on rank 1; slot 12 is rank 0's block 3 */
    bad = g;
    bad.slots = bad_slots;
    CHECK(moe_dp_split_batch(&bad, 2, P, BS, 1, &s1, &err) == MOE_ERR_INVALID);
    CHECKF(strstr(err.msg, "batch row 4: KV slot 12 is outside rank 1's blocks") != NULL, "%s",
           err.msg);

    moe_dp_split_free(&s0);
    moe_dp_split_free(&s1);
    moe_dp_split_free(&s3);
    return test_summary();
}
