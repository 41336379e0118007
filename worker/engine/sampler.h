/* Token sampling from a row of logits: greedy, temperature, top-k, top-p,
 * with a per-request random stream so a seed reproduces the same tokens
 * whatever else runs in the batch. */
#ifndef MOE_SAMPLER_H
#define MOE_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

/* Zero-initialised parameters mean greedy decoding with every filter off. */
struct moe_sampler_params {
    float temperature;        /* 0: greedy (argmax, ties to the lower id) */
    float top_p;              /* 0 or 1: off */
    int top_k;                /* 0: off */
    float min_p;              /* 0: off; keep p >= min_p * p_max */
    float repetition_penalty; /* 0 or 1: off; > 1 discourages prompt and output tokens */
    float presence_penalty;   /* 0: off; subtracted once from every output token's logit */
    float frequency_penalty;  /* 0: off; subtracted per occurrence in the output */
};

/* xoshiro256** seeded by splitmix64 (common/rng.h), so that nearby seeds
 * give unrelated streams. */
struct moe_rng {
    uint64_t s[4];
};

void moe_rng_seed(struct moe_rng *rng, uint64_t seed);

/* Uniform in [0, 1). */
double moe_rng_uniform(struct moe_rng *rng);

/* Index of the largest logit (lowest index on ties). */
int32_t moe_argmax(const float *logits, int n);

/* Applies the penalties of `p` in place: repetition (as in transformers:
 * positive logits divided, negative multiplied) to every token with
 * seen[id] != 0, presence and frequency (as in the OpenAI API) to every token
 * with out_count[id] > 0. seen / out_count are per-vocabulary arrays. */
void moe_apply_penalties(float *logits, int n, const struct moe_sampler_params *p,
                         const uint8_t *seen, const int32_t *out_count);

/* True when `p` has any penalty switched on. */
bool moe_sampler_has_penalties(const struct moe_sampler_params *p);

/* log_softmax(logits)[token]; with n_top > 0 also the n_top most likely ids
 * (descending, ties to the lower id) and their log-probabilities. */
float moe_logprobs(const float *logits, int n, int32_t token, int n_top, int32_t *top_ids,
                   float *top_logprobs);

/* Samples one id from `logits` (n entries, not modified). `work` must hold 2*n
 * floats/ints of scratch (n * (sizeof(float) + sizeof(int32_t)) bytes). */
int32_t moe_sample(const float *logits, int n, const struct moe_sampler_params *p,
                   struct moe_rng *rng, void *work);

#endif
