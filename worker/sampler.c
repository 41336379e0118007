#include "sampler.h"

#include <math.h>
#include <stdlib.h>
#include <stdbool.h>
#include <string.h>

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void moe_rng_seed(struct moe_rng *rng, uint64_t seed)
{
    for (int i = 0; i < 4; i++)
        rng->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static uint64_t rng_next(struct moe_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double moe_rng_uniform(struct moe_rng *rng)
{
    return (double)(rng_next(rng) >> 11) * 0x1.0p-53;
}

int32_t moe_argmax(const float *logits, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best])
            best = i;
    return best;
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
    double sum = 0;
    for (int i = 0; i < n; i++) {
        c[i].id = i;
        c[i].p = expf((logits[i] - max) / p->temperature);
        sum += c[i].p;
    }
    int keep = n;
    if ((p->top_k > 0 && p->top_k < n) || (p->top_p > 0.0f && p->top_p < 1.0f)) {
        qsort(c, (size_t)n, sizeof *c, cand_cmp);
        if (p->top_k > 0 && p->top_k < keep)
            keep = p->top_k;
        double kept = 0;
        for (int i = 0; i < keep; i++)
            kept += c[i].p;
        sum = kept;
        if (p->top_p > 0.0f && p->top_p < 1.0f) {
            double acc = 0;
            for (int i = 0; i < keep; i++) {
                acc += c[i].p;
                if (acc >= p->top_p * kept) {
                    keep = i + 1;
                    sum = acc;
                    break;
                }
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
