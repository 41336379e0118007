/* Draft tokens for exact n-gram ("prompt lookup") speculative decoding.
 *
 * No draft model: the continuation of a sequence is guessed from its own
 * history. The engine puts the guesses into a decode step as extra input
 * tokens and keeps only those the model itself would have produced (see the
 * verification in engine.c), so a bad guess costs compute, never output. */
#ifndef MOE_SPEC_H
#define MOE_SPEC_H

#include <stdint.h>

/* Longest suffix looked up; shorter ones are tried down to one token. */
#define MOE_SPEC_NGRAM_MAX 4
/* Most draft tokens per sequence and step (--spec-tokens). */
#define MOE_SPEC_TOKENS_MAX 16

/* Finds the most recent earlier occurrence of the last n tokens of
 * tokens[0, n_tokens) for n = MOE_SPEC_NGRAM_MAX down to 1 (the first n with
 * a match wins) and writes up to k of the tokens that followed it into
 * `draft` (k entries). A match close to the end continues into the draft
 * itself, so a repeating pattern shorter than k still yields k tokens.
 * Returns the number of draft tokens, 0 when nothing matched. */
int spec_ngram_draft(const int32_t *tokens, int n_tokens, int k, int32_t *draft);

/* Steps a sequence drafts nothing after its drafts stop paying (see below). */
#define MOE_SPEC_COOLDOWN 8

/* A sequence's draft length, adapted to its measured acceptance: after a
 * verified row of `drafted` (> 0) drafts of which `accepted` were kept, the
 * next row may carry `*k` drafts (at most k_max): all kept -> one more; some
 * kept -> one more than were kept; none kept -> half, and at 0 the sequence
 * drafts nothing for MOE_SPEC_COOLDOWN steps (*cool) and then probes with
 * one draft. An MoE verify row routes to more experts the longer it is, so a
 * guess that is rejected costs real compute; this keeps rejected guesses
 * short. Output is unaffected: only how many guesses are verified. */
void spec_adapt(int *k, int *cool, int k_max, int drafted, int accepted);

#endif
