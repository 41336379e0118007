/* Draft tokens for exact n-gram ("prompt lookup") speculative decoding.
 *
 * No draft model: the continuation of a sequence is guessed from its own
 * history. The engine puts the guesses into a decode step as extra input
 * tokens and keeps only those the model itself would have produced (see the
 * verification in engine.c), so a bad guess costs compute, never output. */
#ifndef MOE_SPEC_H
#define MOE_SPEC_H

#include <stdbool.h>
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

/* ---- what a draft costs ----------------------------------------------------------
 *
 * Acceptance alone does not say whether a guess pays: a verify row of K + 1
 * tokens can cost almost nothing more than a plain row (a step bound by
 * reading the weights) or nearly K + 1 rows (bound by compute, or by per-op
 * overhead on a small model), and a draft model's passes cost time too. The
 * engine measures its decode steps: T(n), the time of a decode-only step of
 * n tokens (one average per n, so what was learned at one size is kept
 * while steps run at another), whose slope around the current batch is b,
 * the cost of one more token in a step; R, tokens emitted per second; and
 * the draft model's passes after the first (each feeds one token for each
 * of m drafting sequences, P(m)), so a sequence's guess costs d = P(m) / m
 * (n-gram guesses: d = 0). The first pass, which also catches the draft up
 * on tokens it has not seen, is not charged to the guesses: those tokens
 * are fed once whenever drafting goes on. One more draft of a sequence whose
 * guesses are kept with probability alpha each (the j-th draft is used with
 * probability alpha^j) adds alpha^j tokens for b + d seconds, so it raises
 * the throughput exactly when alpha^j >= R (b + d): that product is the
 * threshold, and a sequence drafts the K of the largest sum of alpha^j -
 * threshold_j (its acceptance-adapted K bounds it too). At batch 1 R (b + d)
 * compares a guess with a whole plain step; at batch 16 the fixed part of a
 * step is shared by 16 rows, R ~ 1 / b, and guesses stop unless verify rows
 * are nearly free. Until T is known at two sizes near the batch (and P, with a
 * draft model) there is no threshold and drafting follows acceptance alone,
 * which measures the sizes it lacks. */
#define MOE_SPEC_COST_N 64 /* step and pass sizes tracked, 1 .. this */
struct spec_cost {
    float step_t[MOE_SPEC_COST_N + 1]; /* T(n), seconds (drafting excluded); 0: not seen */
    float pass_t[MOE_SPEC_COST_N + 1]; /* P(m), seconds; 0: not seen */
    double emit_n, emit_t; /* decayed tokens emitted and step seconds (drafting included) */
};

/* One finished step: `n_tok` tokens in the forward, `n_emitted` tokens
 * emitted, `step_s` seconds in all, of which `draft_s` in the draft model.
 * Only decode-only steps (every row a sequence's next token, with or without
 * drafts) count: a prompt chunk's time says nothing about a verify row's. */
void spec_cost_step(struct spec_cost *c, bool decode_only, int n_tok, int n_emitted, double step_s,
                    double draft_s);
/* One draft-model pass after the first: one token fed for each of `n_rows`
 * sequences in `seconds`. */
void spec_cost_draft_pass(struct spec_cost *c, int n_rows, double seconds);

/* R (b_j + d) for a sequence's j-th guess in a step that holds `at` tokens
 * before its guesses (the decode rows and the guesses already given out)
 * and `rows` decode rows: the acceptance probability that guess must reach
 * to pay, b_j the slope of T between at + j - 1 and at + j (a verify row's
 * cost need not be linear in its length), d from P at `rows`; NAN while the
 * costs it needs are unmeasured (`draft_model`: guesses come from a draft
 * model, whose passes must be measured too). */
double spec_cost_threshold(const struct spec_cost *c, int at, int rows, int j, bool draft_model);

/* The K <= k_max of the largest expected gain, the sum over j <= K of
 * alpha^j - spec_cost_threshold(j) (0: no guess pays); k_max while a
 * threshold is NAN (nothing measured yet: drafting measures it). */
int spec_cost_k(double alpha, const struct spec_cost *c, int at, int rows, bool draft_model,
                int k_max);

/* A sequence's per-guess acceptance, decayed: after a verified row of
 * `drafted` guesses of which `accepted` were kept, `*acc` and `*tried`
 * (guesses compared: the kept ones and the first rejected) are updated;
 * spec_alpha is the estimate, (acc + 1/2) / (tried + 1). */
void spec_alpha_update(float *acc, float *tried, int drafted, int accepted);
double spec_alpha(float acc, float tried);

/* Decode steps between probes (one guess, to refresh the acceptance
 * estimate) while a sequence's guesses do not pay by cost; doubled after
 * every probe that still does not pay, up to the second number. */
#define MOE_SPEC_COST_COOLDOWN 16
#define MOE_SPEC_COST_REST_MAX 512

#endif
