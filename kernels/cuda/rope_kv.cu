// rope_kv_write (kernels/backend.h, struct moe_rope_kv_params): the
// attention block's split of the fused QKV row, biases, per-head RMSNorm,
// RoPE and paged KV write in one launch, where they were up to eight.
// One block per token: the block first puts the token's cos and sin (each
// times `scale`) in shared memory, then each warp takes heads in turn (the
// q heads, then the k heads, then the v heads): its lanes stage the head's
// values (+ bias) in the warp's shared row, sum their squares for the norm
// (warp_sum), scale them, rotate the pairs (i, i + d/2) as rope.cu does
// (each product rounded on its own, no FMA) and store q to q_out, k and v to
// the caches at slots[t] (bf16 rounded as kv_write.cu rounds).
#include <math.h>

#include "common.cuh"
#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxD = MOE_CUDA_ROPE_MAX_DHEAD;

struct inv_freq_table {
    float v[kMaxD / 2];
};

__device__ __forceinline__ void put(float *dst, int i, float v)
{
    dst[i] = v;
}

__device__ __forceinline__ void put(uint16_t *dst, int i, float v)
{
    dst[i] = (uint16_t)bf16_bits_rn(v);
}

template <typename C>
__global__ void __launch_bounds__(kThreads)
    rope_kv_kernel(const moe_rope_kv_params p, const inv_freq_table freq, C *__restrict__ k_cache,
                   C *__restrict__ v_cache)
{
    __shared__ float cs[2][kMaxD / 2];
    __shared__ float row[kWarps][kMaxD];
    const int t = (int)blockIdx.x, d = p.d_head, half = d / 2;
    const int qd = p.n_head * d, kvd = p.n_kv_head * d;
    const float pos = (float)p.pos[t];
    for (int i = threadIdx.x; i < half; i += kThreads) {
        const float f = __fmul_rn(pos, freq.v[i]);
        cs[0][i] = __fmul_rn(cosf(f), p.scale);
        cs[1][i] = __fmul_rn(sinf(f), p.scale);
    }
    __syncthreads();
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    const float *src = p.qkv + (size_t)t * (size_t)(qd + 2 * kvd);
    const size_t cache_row = (size_t)p.slots[t] * (size_t)kvd;
    float *x = row[warp];
    for (int h = warp; h < p.n_head + 2 * p.n_kv_head; h += kWarps) {
        // which head: q (0), k (1) or v (2), and its place
        const int kind = h < p.n_head ? 0 : h < p.n_head + p.n_kv_head ? 1 : 2;
        const int hh = kind == 0 ? h : kind == 1 ? h - p.n_head : h - p.n_head - p.n_kv_head;
        const float *bias = kind == 0 ? p.bq : kind == 1 ? p.bk : p.bv;
        const float *norm = kind == 0 ? p.q_norm : kind == 1 ? p.k_norm : nullptr;
        const float *s = src + (kind == 0 ? 0 : kind == 1 ? qd : qd + kvd) + hh * d;
        float ss = 0.0f;
        for (int i = lane; i < d; i += 32) {
            const float v = bias ? __fadd_rn(s[i], bias[hh * d + i]) : s[i];
            x[i] = v;
            ss += v * v;
        }
        __syncwarp();
        if (norm) {
            const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)d + p.eps);
            for (int i = lane; i < d; i += 32)
                x[i] = __fmul_rn(norm[i], __fmul_rn(x[i], inv));
            __syncwarp();
        }
        if (kind == 2) { // V: no rotation
            for (int i = lane; i < d; i += 32)
                put(v_cache + cache_row + hh * d, i, x[i]);
        } else {
            for (int i = lane; i < half; i += 32) {
                const float a = x[i], b = x[i + half], c = cs[0][i], sn = cs[1][i];
                const float lo = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, sn));
                const float hi = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, sn));
                if (kind == 0) {
                    float *q = p.q_out + (size_t)t * qd + hh * d;
                    q[i] = lo;
                    q[i + half] = hi;
                } else {
                    put(k_cache + cache_row + hh * d, i, lo);
                    put(k_cache + cache_row + hh * d, i + half, hi);
                }
            }
        }
        __syncwarp(); // the warp's row is rewritten by its next head
    }
}

} // namespace

extern "C" const char *moe_cuda_rope_kv_unsupported(const moe_rope_kv_params *p)
{
    if (p->d_head <= 0 || p->d_head % 2 || p->d_head > kMaxD)
        return "d_head must be even and at most MOE_CUDA_ROPE_MAX_DHEAD";
    if (p->kv_dtype != MOE_DTYPE_F32 && p->kv_dtype != MOE_DTYPE_BF16)
        return "kv_dtype must be F32 or BF16";
    if (p->n_head < 0 || p->n_kv_head < 0 || !p->v_cache || !p->k_cache)
        return "bad head counts or no caches";
    if ((p->bq != nullptr) != (p->bk != nullptr) || (p->bk != nullptr) != (p->bv != nullptr) ||
        (p->q_norm != nullptr) != (p->k_norm != nullptr))
        return "biases and norms come for q and k (and v) together";
    return nullptr;
}

extern "C" cudaError_t moe_cuda_rope_kv_write(const moe_rope_kv_params *p, cudaStream_t stream)
{
    if (moe_cuda_rope_kv_unsupported(p))
        return cudaErrorNotSupported;
    if (p->n_tok <= 0)
        return cudaSuccess;
    inv_freq_table freq = {};
    for (int i = 0; i < p->d_head / 2; i++)
        freq.v[i] = p->inv_freq[i];
    if (p->kv_dtype == MOE_DTYPE_BF16)
        rope_kv_kernel<uint16_t><<<p->n_tok, kThreads, 0, stream>>>(
            *p, freq, (uint16_t *)p->k_cache, (uint16_t *)p->v_cache);
    else
        rope_kv_kernel<float>
            <<<p->n_tok, kThreads, 0, stream>>>(*p, freq, (float *)p->k_cache, (float *)p->v_cache);
    return cudaGetLastError();
}
