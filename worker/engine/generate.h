/* Single-sequence generation on a model: prefill the prompt (in chunks),
 * then decode token by token. The offline runner and the golden tests use
 * it; the serving engine (scheduler over many sequences) builds on the same
 * forward pass. */
#ifndef MOE_GENERATE_H
#define MOE_GENERATE_H

#include <stdbool.h>
#include <stdint.h>

#include "model/model.h"
#include "engine/sampler.h"
#include "clock.h"

struct moe_gen_opts {
    int n_predict; /* tokens to generate (>= 0) */
    struct moe_sampler_params sp;
    uint64_t seed;
    bool ignore_eos;        /* keep going past an EOS id */
    int prefill_chunk;      /* max prompt tokens per forward (0: 512) */
    int block_size;         /* KV block size in tokens (0: 16) */
    moe_forward_fn forward; /* NULL: moe_model_forward */
    void *forward_ctx;
};

struct moe_gen_result {
    int32_t *tokens; /* (n_tokens) generated ids, malloc'd; EOS included */
    int n_tokens;
    int n_prompt;
    double prefill_s; /* wall time of the prompt's forward passes */
    double decode_s;  /* wall time of the decode steps after the first token */
    bool stopped_at_eos;
};

/* Runs `prompt` (n_prompt >= 1 ids) and generates up to opts->n_predict ids.
 * If prompt_logits is not NULL it receives n_prompt x vocab_size f32 logits,
 * one row per prompt position. The prompt plus the generated tokens must fit
 * in max_position_embeddings. On success the caller frees res->tokens (see
 * moe_gen_result_free). */
enum moe_status moe_generate(struct moe_model *m, const int32_t *prompt, int n_prompt,
                             const struct moe_gen_opts *opts, float *prompt_logits,
                             struct moe_gen_result *res, struct moe_error *err);

void moe_gen_result_free(struct moe_gen_result *res);

#endif
