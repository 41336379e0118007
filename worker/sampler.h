/* Token sampling from a row of logits: greedy, temperature, top-k, top-p,
 * with a per-request random stream so a seed reproduces the same tokens
 * whatever else runs in the batch. */
#ifndef MOE_SAMPLER_H
#define MOE_SAMPLER_H

#include <stdint.h>

struct moe_sampler_params {
    float temperature; /* 0: greedy (argmax, ties to the lower id) */
    float top_p;       /* 1: off */
    int top_k;         /* 0: off */
};

/* xoshiro-style generator, seeded by splitmix64 so that nearby seeds give
 * unrelated streams. */
struct moe_rng {
    uint64_t s[4];
};

void moe_rng_seed(struct moe_rng *rng, uint64_t seed);

/* Uniform in [0, 1). */
double moe_rng_uniform(struct moe_rng *rng);

/* Index of the largest logit (lowest index on ties). */
int32_t moe_argmax(const float *logits, int n);

/* Samples one id from `logits` (n entries, not modified). `work` must hold 2*n
 * floats/ints of scratch (n * (sizeof(float) + sizeof(int32_t)) bytes). */
int32_t moe_sample(const float *logits, int n, const struct moe_sampler_params *p,
                   struct moe_rng *rng, void *work);

#endif
