/* Router top-k: softmax over all experts in f32 (max subtracted), the top_k
 * largest probabilities (ties to the lower expert id), optionally divided by
 * their sum. As HF Mixtral / Qwen3-MoE: softmax(logits, dtype=float), topk,
 * then renormalise. */
#include <math.h>

#include "cpu_kernels.h"

void cpu_router_topk(const float *logits, int n_tok, int n_expert, int top_k, bool renorm,
                     int32_t *ids, float *weights)
{
    MOE_ASSERT(top_k >= 1 && top_k <= n_expert);
    for (int t = 0; t < n_tok; t++) {
        const float *x = logits + (size_t)t * n_expert;
        int32_t *id = ids + (size_t)t * top_k;
        float *wt = weights + (size_t)t * top_k;
        float mx = -INFINITY;
        for (int e = 0; e < n_expert; e++)
            mx = x[e] > mx ? x[e] : mx;
        float sum = 0.0f;
        for (int e = 0; e < n_expert; e++)
            sum += expf(x[e] - mx);
        /* Selection by logit: softmax is monotonic, and equal logits give
         * equal probabilities, so the order (and the tie rule) is the same. */
        for (int k = 0; k < top_k; k++) {
            int best = -1;
            for (int e = 0; e < n_expert; e++) {
                bool taken = false;
                for (int j = 0; j < k; j++)
                    taken |= id[j] == e;
                if (!taken && (best < 0 || x[e] > x[best]))
                    best = e;
            }
            id[k] = best;
            wt[k] = expf(x[best] - mx) / sum;
        }
        if (renorm) {
            float s = 0.0f;
            for (int k = 0; k < top_k; k++)
                s += wt[k];
            for (int k = 0; k < top_k; k++)
                wt[k] /= s;
        }
    }
}
