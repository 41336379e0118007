// Router top-k: one warp per token. Lane l holds the logits of experts
// l, l + 32, l + 64, ... (PER of them, PER = ceil(n_expert / 32) rounded up
// to 1, 2, 4 or 8). Softmax over all experts in f32 with the max subtracted;
// then top_k rounds of a warp arg-max over the experts not yet taken, where
// the larger logit wins and equal logits go to the lower expert id (the CPU
// reference's tie rule; softmax is monotonic, so choosing by logit is
// choosing by probability). weight = exp(x - max) / sum, then with `renorm`
// divided by the sum of the top_k weights taken in order k = 0, 1, ...
#include <math.h>
#include <stdio.h>

#include "common.cuh"
#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 128; // 4 tokens per block
constexpr int kNone = 0x7fffffff;

template <int PER>
__global__ void __launch_bounds__(kThreads)
    router_kernel(const float *__restrict__ logits, int n_tok, int n_expert, int top_k, bool renorm,
                  int32_t *__restrict__ ids, float *__restrict__ weights)
{
    const int t = (int)((blockIdx.x * (unsigned)kThreads + threadIdx.x) / 32u);
    const int lane = threadIdx.x % 32;
    if (t >= n_tok) // the whole warp leaves together
        return;
    const float *x = logits + (size_t)t * n_expert;
    float v[PER];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int e = lane + 32 * i;
        v[i] = e < n_expert ? x[e] : -INFINITY;
        mx = fmaxf(mx, v[i]);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; i++)
        if (lane + 32 * i < n_expert)
            sum += expf(v[i] - mx);
    sum = warp_sum(sum);

    unsigned taken = 0; // bit i: expert lane + 32 i already chosen
    float wsum = 0.0f;
    int32_t *id = ids + (size_t)t * top_k;
    float *wt = weights + (size_t)t * top_k;
    for (int k = 0; k < top_k; k++) {
        float best_v = -INFINITY;
        int best_e = kNone;
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int e = lane + 32 * i;
            // ids grow with i: strict '>' keeps the lower id on a tie
            if (e < n_expert && !((taken >> i) & 1u) && (best_e == kNone || v[i] > best_v)) {
                best_v = v[i];
                best_e = e;
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best_v, off);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, off);
            if (oe != kNone && (best_e == kNone || ov > best_v || (ov == best_v && oe < best_e))) {
                best_v = ov;
                best_e = oe;
            }
        }
        // every lane now holds the same (best_v, best_e); top_k <= n_expert
        // guarantees best_e is a real expert
        if (lane == best_e % 32)
            taken |= 1u << (best_e / 32);
        if (lane == 0) {
            const float w = __fdiv_rn(expf(best_v - mx), sum);
            id[k] = best_e;
            wt[k] = w;
            wsum += w;
        }
    }
    if (renorm && lane == 0)
        for (int k = 0; k < top_k; k++)
            wt[k] = __fdiv_rn(wt[k], wsum);
}

} // namespace

extern "C" cudaError_t moe_cuda_router_topk(const float *logits, int n_tok, int n_expert, int top_k,
                                            bool renorm, int32_t *ids, float *weights,
                                            cudaStream_t stream)
{
    if (n_expert < 1 || n_expert > MOE_CUDA_ROUTER_MAX_EXPERT || top_k < 1 || top_k > n_expert ||
        top_k > MOE_CUDA_ROUTER_MAX_TOPK)
        return cudaErrorNotSupported;
    if (n_tok <= 0)
        return cudaSuccess;
    const unsigned blocks = (unsigned)((n_tok + kThreads / 32 - 1) / (kThreads / 32));
    if (n_expert <= 32)
        router_kernel<1>
            <<<blocks, kThreads, 0, stream>>>(logits, n_tok, n_expert, top_k, renorm, ids, weights);
    else if (n_expert <= 64)
        router_kernel<2>
            <<<blocks, kThreads, 0, stream>>>(logits, n_tok, n_expert, top_k, renorm, ids, weights);
    else if (n_expert <= 128)
        router_kernel<4>
            <<<blocks, kThreads, 0, stream>>>(logits, n_tok, n_expert, top_k, renorm, ids, weights);
    else
        router_kernel<8>
            <<<blocks, kThreads, 0, stream>>>(logits, n_tok, n_expert, top_k, renorm, ids, weights);
    return cudaGetLastError();
}

// DeepSeek-V3's grouped sigmoid routing (struct moe_router_grouped_params in
// backend.h): one thread per token running the CPU reference's steps in the
// same order (kernels/cpu/router.c), so ties and NaNs fall the same way:
// sigmoid scores s, choice scores c = s + bias; each group scores the sum of
// its two best c; the topk_group best groups (ties to the lower group) keep
// their experts in the running; top_k rounds take the best c among them (ties
// to the lower id); weights s, renormalised over the chosen with `renorm`,
// times `scale`. The router is a sliver of a step's work, so one thread per
// token with its scores in local memory is enough.
namespace
{

constexpr int kGroupedThreads = 64;

// The index of the largest of v[0..n) not marked in `taken` (ties to the
// lower index; NaNs lose to everything), or -1 when all are taken.
__device__ int best_free(const float *v, const bool *taken, int n)
{
    int best = -1;
    for (int i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best] || (isnan(v[best]) && !isnan(v[i]))))
            best = i;
    return best;
}

__global__ void __launch_bounds__(kGroupedThreads)
    router_grouped_kernel(const moe_router_grouped_params p)
{
    const int t = (int)(blockIdx.x * (unsigned)kGroupedThreads + threadIdx.x);
    if (t >= p.n_tok)
        return;
    const int E = p.n_expert, G = p.n_group, per = E / G;
    float s[MOE_CUDA_ROUTER_MAX_EXPERT], c[MOE_CUDA_ROUTER_MAX_EXPERT];
    bool taken[MOE_CUDA_ROUTER_MAX_EXPERT];
    float gs[MOE_CUDA_ROUTER_MAX_GROUPS];
    bool gtaken[MOE_CUDA_ROUTER_MAX_GROUPS];
    const float *x = p.logits + (size_t)t * E;
    int32_t *id = p.ids + (size_t)t * p.top_k;
    float *wt = p.weights + (size_t)t * p.top_k;
    for (int e = 0; e < E; e++) {
        s[e] = __fdiv_rn(1.0f, 1.0f + expf(-x[e]));
        c[e] = s[e] + p.bias[e];
    }
    for (int g = 0; g < G; g++) {
        const float *cg = c + g * per;
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
    for (int e = 0; e < E; e++)
        taken[e] = true;
    for (int k = 0; k < p.topk_group; k++) {
        const int g = best_free(gs, gtaken, G);
        gtaken[g] = true;
        for (int i = 0; i < per; i++)
            taken[g * per + i] = false;
    }
    float sum = 0.0f;
    for (int k = 0; k < p.top_k; k++) {
        const int e = best_free(c, taken, E);
        taken[e] = true;
        id[k] = e;
        wt[k] = s[e];
        sum += s[e];
    }
    if (p.renorm)
        for (int k = 0; k < p.top_k; k++)
            wt[k] = __fdiv_rn(wt[k], sum + 1e-20f);
    for (int k = 0; k < p.top_k; k++)
        wt[k] *= p.scale;
}

} // namespace

extern "C" const char *moe_cuda_router_grouped_unsupported(const moe_router_grouped_params *p,
                                                           char *why, size_t cap)
{
    const int E = p->n_expert, G = p->n_group;
    if (E < 2 || E > MOE_CUDA_ROUTER_MAX_EXPERT || G < 1 || G > MOE_CUDA_ROUTER_MAX_GROUPS ||
        E % G || E / G < 2 || p->topk_group < 1 || p->topk_group > G || p->top_k < 1 ||
        p->top_k > p->topk_group * (E / G) || p->top_k > MOE_CUDA_ROUTER_MAX_TOPK || p->n_tok < 0) {
        snprintf(why, cap,
                 "router_topk_grouped: n_expert %d in %d groups (keep %d), top_k %d not supported "
                 "(n_expert <= %d a multiple of n_group <= %d with >= 2 experts each, 1 <= "
                 "topk_group <= n_group, 1 <= top_k <= min(%d, topk_group x group size))",
                 E, G, p->topk_group, p->top_k, MOE_CUDA_ROUTER_MAX_EXPERT,
                 MOE_CUDA_ROUTER_MAX_GROUPS, MOE_CUDA_ROUTER_MAX_TOPK);
        return why;
    }
    return NULL;
}

extern "C" cudaError_t moe_cuda_router_topk_grouped(const moe_router_grouped_params *p,
                                                    cudaStream_t stream)
{
    char why[300];
    if (moe_cuda_router_grouped_unsupported(p, why, sizeof why))
        return cudaErrorNotSupported;
    if (p->n_tok == 0)
        return cudaSuccess;
    const unsigned blocks = (unsigned)((p->n_tok + kGroupedThreads - 1) / kGroupedThreads);
    router_grouped_kernel<<<blocks, kGroupedThreads, 0, stream>>>(*p);
    return cudaGetLastError();
}
