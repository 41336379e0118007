#include "engine/spec.h"

#include <math.h>
#include <string.h>

/* Start of the most recent occurrence of tokens[n_tokens - n, n_tokens) that
 * begins before it, or -1. */
static int find_suffix(const int32_t *tokens, int n_tokens, int n)
{
    const int32_t *suffix = tokens + n_tokens - n;
    for (int i = n_tokens - n - 1; i >= 0; i--)
        if (tokens[i] == suffix[0] && !memcmp(tokens + i, suffix, (size_t)n * sizeof *tokens))
            return i;
    return -1;
}

int spec_ngram_draft(const int32_t *tokens, int n_tokens, int k, int32_t *draft)
{
    for (int n = MOE_SPEC_NGRAM_MAX; n >= 1 && k > 0; n--) {
        if (n >= n_tokens)
            continue;
        int at = find_suffix(tokens, n_tokens, n);
        if (at < 0)
            continue;
        /* The copy reads tokens[at + n ..]; past the end it reads the draft
         * written so far: the sequence as it would read if the guess held. */
        for (int j = 0; j < k; j++) {
            int src = at + n + j;
            draft[j] = src < n_tokens ? tokens[src] : draft[src - n_tokens];
        }
        return k;
    }
    return 0;
}

void spec_adapt(int *k, int *cool, int k_max, int drafted, int accepted)
{
    if (accepted >= drafted)
        *k = drafted + 1;
    else if (accepted > 0)
        *k = accepted + 1;
    else
        *k = drafted / 2;
    if (*k > k_max)
        *k = k_max;
    if (*k <= 0) { /* drafts stopped paying: rest, then probe with one */
        *k = 1;
        *cool = MOE_SPEC_COOLDOWN;
    }
}

/* Weight of a new measurement in an average. */
#define SPEC_COST_NEW 0.2f
/* Per decode step: the emitted-per-second average follows about 20 steps. */
#define SPEC_COST_DECAY 0.95

static void avg_add(float *avg, double t)
{
    *avg = *avg > 0 ? (1 - SPEC_COST_NEW) * *avg + SPEC_COST_NEW * (float)t : (float)t;
}

void spec_cost_step(struct spec_cost *c, bool decode_only, int n_tok, int n_emitted, double step_s,
                    double draft_s)
{
    if (!decode_only || n_tok <= 0 || !(step_s > 0))
        return;
    if (n_tok <= MOE_SPEC_COST_N)
        avg_add(&c->step_t[n_tok], step_s - draft_s > 1e-9 ? step_s - draft_s : 1e-9);
    c->emit_n = SPEC_COST_DECAY * c->emit_n + n_emitted;
    c->emit_t = SPEC_COST_DECAY * c->emit_t + step_s;
}

void spec_cost_draft_pass(struct spec_cost *c, int n_rows, double seconds)
{
    if (n_rows >= 1 && n_rows <= MOE_SPEC_COST_N && seconds >= 0)
        avg_add(&c->pass_t[n_rows], seconds > 1e-9 ? seconds : 1e-9);
}

/* The measured size nearest to n in [1, MOE_SPEC_COST_N] other than `skip`,
 * or 0. */
static int nearest(const float *t, int n, int skip)
{
    for (int dist = 0; dist < MOE_SPEC_COST_N; dist++)
        for (int side = 0; side < 2; side++) {
            int m = side ? n + dist : n - dist;
            if (m >= 1 && m <= MOE_SPEC_COST_N && m != skip && t[m] > 0)
                return m;
        }
    return 0;
}

double spec_cost_threshold(const struct spec_cost *c, int at, int rows, int j, bool draft_model)
{
    if (!(c->emit_t > 0) || at < 1 || rows < 1 || j < 1)
        return NAN;
    int n = at + j - 1 < MOE_SPEC_COST_N ? at + j - 1 : MOE_SPEC_COST_N - 1;
    /* b_j: the slope between the measured sizes nearest n and n + 1, in
     * [0, T(hi) / hi] (a step has no negative fixed part) */
    int lo = nearest(c->step_t, n, 0), hi = lo ? nearest(c->step_t, n + 1, lo) : 0;
    if (!hi)
        return NAN;
    if (lo > hi) {
        int t = lo;
        lo = hi;
        hi = t;
    }
    double b = (c->step_t[hi] - c->step_t[lo]) / (hi - lo), upper = c->step_t[hi] / hi;
    b = b < 0 ? 0 : b > upper ? upper : b;
    double d = 0;
    if (draft_model) {
        int m = nearest(c->pass_t, rows < MOE_SPEC_COST_N ? rows : MOE_SPEC_COST_N, 0);
        if (!m)
            return NAN;
        d = c->pass_t[m] / m;
    }
    return c->emit_n / c->emit_t * (b + d);
}

int spec_cost_k(double alpha, const struct spec_cost *c, int at, int rows, bool draft_model,
                int k_max)
{
    /* the K of the largest expected gain, sum over j <= K of alpha^j -
     * threshold_j: a costly first guess can still pay through cheap later
     * ones (the measured T need not be convex) */
    double p = 1, gain = 0, best = 0;
    int best_k = 0;
    for (int k = 1; k <= k_max; k++) {
        double thr = spec_cost_threshold(c, at, rows, k, draft_model);
        if (isnan(thr))
            return k_max;
        gain += (p *= alpha) - thr;
        if (gain > best) {
            best = gain;
            best_k = k;
        }
    }
    return best_k;
}

/* Per verified row: the estimate follows about the last 20 rows. */
#define SPEC_ALPHA_DECAY 0.95f

void spec_alpha_update(float *acc, float *tried, int drafted, int accepted)
{
    *acc = SPEC_ALPHA_DECAY * *acc + (float)accepted;
    *tried = SPEC_ALPHA_DECAY * *tried + (float)(accepted + (accepted < drafted));
}

double spec_alpha(float acc, float tried)
{
    return (acc + 0.5) / (tried + 1.0);
}
