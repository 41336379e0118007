/* Data-parallel attention: one step of the leader's engine split into the
 * batch each rank runs.
 *
 * The leader schedules every rank's sequences in one batch whose block ids
 * index a pool of n_rank equal parts (kv/kv_pool.h): part r, blocks
 * [r * part_blocks, (r + 1) * part_blocks), is rank r's own KV cache of
 * part_blocks blocks. A sequence lives on the rank whose part holds its
 * blocks. Rank r's batch is the tokens of its sequences, in batch order,
 * with sequences renumbered, block ids and KV slots made local, and the
 * logit rows of its tokens (in the order of the global logit rows). No MPI
 * here: group.c sends the plan, and the tests split batches in one process. */
#ifndef MOE_DP_BATCH_H
#define MOE_DP_BATCH_H

#include <stdint.h>

#include "model/model.h"
#include "moe_error.h"

struct moe_dp_split {
    struct moe_batch b; /* rank's batch; its arrays are the ones below */
    int32_t *tokens, *pos, *seq, *slots, *tables, *logit_rows;
    int32_t *row_of;  /* (global n_tok) its local row, or -1 */
    int32_t *seq_map; /* (global n_seq) its local number, or -1 */
    int cap_tok, cap_seq, cap_tables;
    /* For the leader's gather: global logit row i belongs to rank
     * logit_rank[i] (n_logits entries of the global batch). */
    int32_t *logit_rank;
    int cap_logits;
};

/* The rank of batch sequence s (its first block's part). */
int moe_dp_seq_rank(const struct moe_batch *global, int s, int part_blocks);

/* Fills out->b with rank `rank`'s share of `global`. n_tok_group of the
 * result is global->n_tok. Fails (MOE_ERR_INVALID, naming the row) on a
 * sequence whose slots or blocks are outside one part. */
enum moe_status moe_dp_split_batch(const struct moe_batch *global, int n_rank, int part_blocks,
                                   int block_size, int rank, struct moe_dp_split *out,
                                   struct moe_error *err);

void moe_dp_split_free(struct moe_dp_split *s);

#endif
