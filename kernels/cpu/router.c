/* Router top-k: softmax over all experts in f32 (max subtracted), the top_k
 * largest probabilities (ties to the lower expert id), optionally divided by
 * their sum. As HF Mixtral / Qwen3-MoE: softmax(logits, dtype=float), topk,
 * then renormalise. And DeepSeek-V3's grouped sigmoid routing
 * (cpu_router_topk_grouped, semantics in backend.h). */
#include <math.h>
#include <stdlib.h>

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

/* The index of the largest of v[0..n) not marked in `taken` (ties to the
 * lower index; NaNs lose to everything), or -1 when all are taken. */
static int best_free(const float *v, const bool *taken, int n)
{
    int best = -1;
    for (int i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best] || (isnan(v[best]) && !isnan(v[i]))))
            best = i;
    return best;
}

void cpu_router_topk_grouped(const struct moe_router_grouped_params *p)
{
    const int E = p->n_expert, G = p->n_group, per = E / G;
    MOE_ASSERT(G >= 1 && E % G == 0 && per >= 2 && p->topk_group >= 1 && p->topk_group <= G);
    MOE_ASSERT(p->top_k >= 1 && p->top_k <= p->topk_group * per);
    float s_buf[256], c_buf[256], g_buf[64];
    bool t_buf[256], gt_buf[64];
    bool heap = E > 256 || G > 64;
    float *s = heap ? malloc((size_t)E * sizeof *s) : s_buf;
    float *c = heap ? malloc((size_t)E * sizeof *c) : c_buf;
    bool *taken = heap ? malloc((size_t)E * sizeof *taken) : t_buf;
    float *gs = heap ? malloc((size_t)G * sizeof *gs) : g_buf;
    bool *gtaken = heap ? malloc((size_t)G * sizeof *gtaken) : gt_buf;
    MOE_ASSERT(s && c && taken && gs && gtaken);
    for (int t = 0; t < p->n_tok; t++) {
        const float *x = p->logits + (size_t)t * E;
        int32_t *id = p->ids + (size_t)t * p->top_k;
        float *wt = p->weights + (size_t)t * p->top_k;
        for (int e = 0; e < E; e++) {
            s[e] = 1.0f / (1.0f + expf(-x[e]));
            c[e] = s[e] + p->bias[e];
        }
        /* a group scores the sum of its two best choice scores */
        for (int g = 0; g < G; g++) {
            const float *cg = c + (size_t)g * per;
            int a = 0, b = 1;
            if (cg[b] > cg[a]) {
                a = 1;
                b = 0;
            }
            for (int i = 2; i < per; i++) {
                if (cg[i] > cg[a]) {
                    b = a;
                    a = i;
                } else if (cg[i] > cg[b]) {
                    b = i;
                }
            }
            gs[g] = cg[a] + cg[b];
            gtaken[g] = false;
        }
        /* experts of the groups not kept are out of the running */
        for (int e = 0; e < E; e++)
            taken[e] = true;
        for (int k = 0; k < p->topk_group; k++) {
            int g = best_free(gs, gtaken, G);
            gtaken[g] = true;
            for (int i = 0; i < per; i++)
                taken[g * per + i] = false;
        }
        float sum = 0.0f;
        for (int k = 0; k < p->top_k; k++) {
            int e = best_free(c, taken, E);
            taken[e] = true;
            id[k] = e;
            wt[k] = s[e];
            sum += s[e];
        }
        if (p->renorm)
            for (int k = 0; k < p->top_k; k++)
                wt[k] /= sum + 1e-20f;
        for (int k = 0; k < p->top_k; k++)
            wt[k] *= p->scale;
    }
    if (heap) {
        free(s);
        free(c);
        free(taken);
        free(gs);
        free(gtaken);
    }
}
