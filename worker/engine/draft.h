/* Draft-model proposals for speculative decoding.
 *
 * A small model with the target's tokenizer guesses the next k tokens of
 * each decoding sequence (greedily: its argmax); the engine verifies them
 * with the target in one step (engine.c seq_verify). A greedy draft is a
 * point mass, for which speculative sampling keeps a draft d with
 * probability p(d) and otherwise draws from p without d: exactly what
 * drawing from the target and comparing does, so outputs follow the
 * target's distribution (greedy: they are plain decoding's tokens).
 *
 * The draft's KV cache has the target's blocks: block b of the target's pool
 * is block b of the draft's cache too, so a sequence's draft K/V live in the
 * blocks it already holds and are freed, preempted and shared with them;
 * each block costs the target's bytes plus the draft's. The draft's K/V are
 * a cache of the draft's own, never read by the target: the engine says how
 * many of a sequence's positions they hold (`done`), and what is missing
 * (a prefix-cache hit, a preemption, a KV handoff from a prefill pool) is
 * recomputed by the next proposal. */
#ifndef MOE_DRAFT_H
#define MOE_DRAFT_H

#include <stdint.h>

#include "model/model.h"
#include "moe_error.h"

struct moe_draft;

/* A draft over `draft` (loaded by the caller, borrowed) for the target's
 * block pool of n_block blocks of block_size. The vocabularies must match. */
enum moe_status moe_draft_create(struct moe_model *draft, const struct moe_model *target,
                                 int n_block, int block_size, struct moe_draft **out,
                                 struct moe_error *err);
void moe_draft_destroy(struct moe_draft *d);

/* Bytes the draft adds to a block of block_size tokens. */
size_t moe_draft_block_bytes(const struct moe_model *draft, int block_size);

/* One sequence to propose for. Its block table must cover n_tokens + k - 1
 * positions (the draft writes the K/V of its own guesses but the last). */
struct moe_draft_seq {
    const int32_t *tokens; /* (n_tokens) the committed tokens */
    int n_tokens;
    int done; /* positions whose draft K/V are already in the cache */
    const int32_t *blocks;
    int n_blocks;
    int k;        /* guesses wanted, >= 1 */
    int32_t *out; /* (k) the guesses */
};

/* One forward pass of a proposal: the sequences in it, seconds. */
struct moe_draft_pass {
    int n_rows;
    double seconds;
};

/* Proposes s[i].k tokens for each of the n sequences in k_max forward passes
 * of the draft over all of them: the first feeds every position from done to
 * n_tokens - 1 (catching the draft's cache up) and reads the first guess;
 * each next pass feeds the previous guess. `passes` (NULL, or room for
 * k_max) gets each pass's size and time. */
enum moe_status moe_draft_propose(struct moe_draft *d, struct moe_draft_seq *s, int n,
                                  struct moe_draft_pass *passes, struct moe_error *err);

#endif
