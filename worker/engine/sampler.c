#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <stdbool.h>
#include <string.h>

#include "backend.h"
#include "rng.h"

void moe_rng_seed(struct moe_rng *rng, uint64_t seed)
{
    for (int i = 0; i < 4; i++)
        rng->s[i] = moe_splitmix64(&seed);
}

double moe_rng_uniform(struct moe_rng *rng)
{
    return moe_u64_to_unit(moe_xoshiro256ss(rng->s));
}

int32_t moe_argmax(const float *logits, int n)
{
    return moe_host_argmax(logits, n);
}

struct cand {
    float p;
    int32_t id;
};

static int cand_cmp(const void *a, const void *b)
{
    const struct cand *x = a, *y = b;
    if (x->p != y->p)
        return x->p > y->p ? -1 : 1;
    return x->id - y->id;
}

int32_t moe_sample(const float *logits, int n, const struct moe_sampler_params *p,
                   struct moe_rng *rng, void *work)
{
    if (p->temperature <= 0.0f)
        return moe_argmax(logits, n);
    struct cand *c = work;
    float max = logits[moe_argmax(logits, n)];
    for (int i = 0; i < n; i++) {
        c[i].id = i;
        c[i].p = expf((logits[i] - max) / p->temperature); /* the max has p = 1 */
    }
    int keep = n;
    bool top_p = p->top_p > 0.0f && p->top_p < 1.0f;
    if (p->min_p > 0.0f) { /* p_max is 1 before normalisation */
        int k = 0;
        for (int i = 0; i < n; i++)
            if (c[i].p >= p->min_p)
                c[k++] = c[i];
        keep = k;
    }
    if ((p->top_k > 0 && p->top_k < keep) || top_p) {
        qsort(c, (size_t)keep, sizeof *c, cand_cmp);
        if (p->top_k > 0 && p->top_k < keep)
            keep = p->top_k;
    }
    double sum = 0;
    for (int i = 0; i < keep; i++)
        sum += c[i].p;
    if (top_p) {
        double acc = 0;
        for (int i = 0; i < keep; i++) {
            acc += c[i].p;
            if (acc >= p->top_p * sum) {
                keep = i + 1;
                sum = acc;
                break;
            }
        }
    }
    double r = moe_rng_uniform(rng) * sum, acc = 0;
    for (int i = 0; i < keep; i++) {
        acc += c[i].p;
        if (r < acc)
            return c[i].id;
    }
    return c[keep - 1].id;
}

bool moe_sampler_has_penalties(const struct moe_sampler_params *p)
{
    return (p->repetition_penalty > 0.0f && p->repetition_penalty != 1.0f) ||
           p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f;
}

void moe_apply_penalties(float *logits, int n, const struct moe_sampler_params *p,
                         const uint8_t *seen, const int32_t *out_count)
{
    bool rep = p->repetition_penalty > 0.0f && p->repetition_penalty != 1.0f;
    for (int i = 0; i < n; i++) {
        if (rep && seen[i])
            logits[i] = logits[i] > 0 ? logits[i] / p->repetition_penalty
                                      : logits[i] * p->repetition_penalty;
        if (out_count[i] > 0)
            logits[i] -= p->presence_penalty + p->frequency_penalty * (float)out_count[i];
    }
}

float moe_logprobs(const float *logits, int n, int32_t token, int n_top, int32_t *top_ids,
                   float *top_logprobs)
{
    float max = logits[moe_argmax(logits, n)];
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += exp((double)logits[i] - max);
    float lse = max + (float)log(sum);
    /* top n by insertion into a small sorted array */
    int have = 0;
    for (int i = 0; i < n && n_top > 0; i++) {
        if (have == n_top && logits[i] <= logits[top_ids[have - 1]])
            continue;
        int j = have < n_top ? have++ : have - 1;
        while (j > 0 && logits[top_ids[j - 1]] < logits[i]) {
            top_ids[j] = top_ids[j - 1];
            j--;
        }
        top_ids[j] = i;
    }
    for (int i = 0; i < have; i++)
        top_logprobs[i] = logits[top_ids[i]] - lse;
    return logits[token] - lse;
}
