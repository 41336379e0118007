/* The quality meter: perplexity of a model over a token stream, and how far
 * its next-token distributions are from a reference run's (KL divergence,
 * top-1 agreement), in the manner of llama.cpp's perplexity tool.
 *
 * Definitions (the README repeats them; tests/golden/make_ppl_fixtures.py
 * computes the same with transformers):
 *   - the stream x is cut into W = floor(n / N) windows of N tokens,
 *     x[wN .. wN + N); a trailing partial window is dropped. Each window is
 *     evaluated alone, from an empty KV cache.
 *   - in each window the logits at positions j = N/2 .. N-2 are scored, each
 *     against the next token x[wN + j + 1]: the first half only gives the
 *     scored tokens context. S = W (N - 1 - N/2) scored tokens.
 *   - NLL_j = -ln softmax(logits_j)[target]; PPL = exp(sum NLL_j / S).
 *   - against a base run of the same stream and N (saved with kl_save by
 *     another model or setting): KL_j = sum_v P_base(v) (ln P_base(v) -
 *     ln P(v)), all in double; reported as mean, median, p99 (the value at
 *     rank ceil(0.99 S) of the ascending KLs) and max; top-1 agreement is the
 *     fraction of positions whose argmax (ties to the lower id) is the same.
 * A base file holds, after a header naming the vocabulary, N, the token
 * count and a hash of the tokens, the base's log-softmax row (f32) of every
 * scored position; a file from another stream or shape is refused by name. */
#ifndef MOE_PERPLEXITY_H
#define MOE_PERPLEXITY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/model.h"
#include "moe_error.h"
#include "tokenizer.h"

struct moe_ppl_opts {
    int ctx;                /* N, the window length (>= 4) */
    const char *kl_save;    /* write this run's scored log-softmax rows here (or NULL) */
    const char *kl_base;    /* compare with the rows saved in this file (or NULL) */
    moe_forward_fn forward; /* NULL: moe_model_forward (a worker group passes its own) */
    void *forward_ctx;
    /* called after each window with the running perplexity (or NULL) */
    void (*progress)(void *ctx, int window, int n_window, double ppl);
    void *progress_ctx;
};

struct moe_ppl_result {
    int n_window;
    int64_t n_scored;
    double nll_mean; /* mean NLL per scored token (nats) */
    double ppl;      /* exp(nll_mean) */
    bool has_base;   /* the fields below were measured (opts.kl_base) */
    double kl_mean, kl_median, kl_p99, kl_max;
    double top1;     /* fraction of scored positions with the base's argmax */
    double base_ppl; /* the base run's perplexity, from its rows */
    double seconds;  /* wall time of the forward passes */
};

/* Runs the windows of ids[0 .. n) through `m`. MOE_ERR_INVALID when the
 * stream holds no full window or N exceeds max_position_embeddings; the
 * base file's problems name the file and the field. */
enum moe_status moe_perplexity(struct moe_model *m, const int32_t *ids, size_t n,
                               const struct moe_ppl_opts *o, struct moe_ppl_result *r,
                               struct moe_error *err);

/* The stream of a text file: its bytes tokenized as one text, no special
 * tokens added. *ids is malloc'd. Errors name the file. */
enum moe_status moe_perplexity_tokenize_file(const struct moe_tokenizer *tok, const char *path,
                                             int32_t **ids, size_t *n, struct moe_error *err);

#endif
