// Router top-k: one warp per token. Lane l holds the logits of experts
// l, l + 32, l + 64, ... (PER of them, PER = ceil(n_expert / 32) rounded up
// to 1, 2, 4 or 8). Softmax over all experts in f32 with the max subtracted;
// then top_k rounds of a warp arg-max over the experts not yet taken, where
// the larger logit wins and equal logits go to the lower expert id (the CPU
// reference's tie rule; softmax is monotonic, so choosing by logit is
// choosing by probability). weight = exp(x - max) / sum, then with `renorm`
// divided by the sum of the top_k weights taken in order k = 0, 1, ...
#include <math.h>

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
