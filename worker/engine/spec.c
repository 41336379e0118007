#include "engine/spec.h"

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
