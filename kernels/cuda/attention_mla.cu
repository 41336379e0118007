// Multi-head latent attention (DeepSeek-V3's absorbed form) over the paged
// latent cache: one KV head whose row [c | k_rope] of d_head floats is the
// key of every query head, and whose first d_v floats (c) are the value
// (v_cache == k_cache). Contract: backend.h, struct moe_attn_params with
// d_v < d_head.
//
// Grid (n_head, n_tok): a block takes one query head of one token. Its query
// row goes to shared memory; then tiles of kThreads positions: thread j
// scores position j of the tile (a dot over d_head, the row found through the
// block table), the block takes the tile's max and sum (online softmax,
//   m' = max(m, tile max), r = exp(m - m'), l' = l r + sum exp(s - m')),
// and thread i accumulates value dims i, i + kThreads, ... (d_v <= kMaxD, at
// most kPer per thread, in registers) over the tile's rows, which the block
// reads coalesced, one row at a time. out = acc / l.
//
// A first, plain version: every query head reads the latent rows itself, so
// the cache is read n_head times per step where a FlashMLA-style kernel
// reads each tile once for all heads. UNVERIFIED on a GPU so far: test_ops
// holds it to the CPU's attention when one is present.
#include <math.h>
#include <stdio.h>

#include "common.cuh"
#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxD = 1024;
constexpr int kPer = kMaxD / kThreads;
constexpr int kMaxGridTok = 65535; // gridDim.y limit

struct mla_args {
    const float *q, *cache;
    float *out;
    const int32_t *tok_seq, *tok_pos, *block_tables;
    int max_blocks, n_head, d, d_v, block_size;
    float scale;
    int t0; // first token of this launch
};

size_t smem_bytes(int d)
{
    return sizeof(float) * ((size_t)d + kThreads + kWarps) + sizeof(int32_t) * kThreads;
}

__global__ void __launch_bounds__(kThreads) mla_kernel(const mla_args a)
{
    extern __shared__ float smem[];
    float *qs = smem;                          // (d)
    float *ps = qs + a.d;                      // (kThreads) this tile's exp(s - m')
    float *red = ps + kThreads;                // (kWarps) reduction scratch
    int32_t *slot = (int32_t *)(red + kWarps); // (kThreads) this tile's cache rows

    const int h = blockIdx.x, t = a.t0 + (int)blockIdx.y;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int n_pos = a.tok_pos[t] + 1;
    const int32_t *table = a.block_tables + (size_t)a.tok_seq[t] * a.max_blocks;
    const float *q = a.q + ((size_t)t * a.n_head + h) * a.d;
    for (int i = tid; i < a.d; i += kThreads)
        qs[i] = q[i];
    float acc[kPer];
#pragma unroll
    for (int k = 0; k < kPer; k++)
        acc[k] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    __syncthreads();

    for (int p0 = 0; p0 < n_pos; p0 += kThreads) {
        const int p = p0 + tid, n_here = min(kThreads, n_pos - p0);
        float s = -INFINITY;
        if (p < n_pos) {
            const int sl = table[p / a.block_size] * a.block_size + p % a.block_size;
            slot[tid] = sl;
            const float *row = a.cache + (size_t)sl * a.d;
            float dot = 0.0f;
            for (int i = 0; i < a.d; i++)
                dot = fmaf(qs[i], row[i], dot);
            s = dot * a.scale;
        }
        float v = warp_max(s);
        if (lane == 0)
            red[warp] = v;
        __syncthreads();
        float tile_max = red[0];
#pragma unroll
        for (int w = 1; w < kWarps; w++)
            tile_max = fmaxf(tile_max, red[w]);
        const float m_new = fmaxf(m, tile_max); // finite: the tile holds a position
        const float e = p < n_pos ? expf(s - m_new) : 0.0f;
        ps[tid] = e;
        __syncthreads(); // every thread has read red[] and written ps[], slot[]
        v = warp_sum(e);
        if (lane == 0)
            red[warp] = v;
        __syncthreads();
        float tile_sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; w++)
            tile_sum += red[w];
        const float r = expf(m - m_new); // 0 on the first tile (m = -inf)
        l = l * r + tile_sum;
#pragma unroll
        for (int k = 0; k < kPer; k++) {
            const int dd = tid + k * kThreads;
            if (dd < a.d_v) {
                float x = acc[k] * r;
                for (int j = 0; j < n_here; j++)
                    x = fmaf(ps[j], a.cache[(size_t)slot[j] * a.d + dd], x);
                acc[k] = x;
            }
        }
        m = m_new;
        __syncthreads(); // ps, red and slot are rewritten by the next tile
    }
    float *out = a.out + ((size_t)t * a.n_head + h) * a.d_v;
#pragma unroll
    for (int k = 0; k < kPer; k++) {
        const int dd = tid + k * kThreads;
        if (dd < a.d_v)
            out[dd] = __fdiv_rn(acc[k], l);
    }
}

} // namespace

extern "C" const char *moe_cuda_attention_mla_unsupported(const moe_attn_params *p, char *why,
                                                          size_t cap)
{
    if (p->kv_dtype != MOE_DTYPE_F32) {
        snprintf(why, cap, "latent attention: KV cache dtype %s not supported (F32 only)",
                 moe_dtype_name(p->kv_dtype));
        return why;
    }
    if (p->d_head < 1 || p->d_head > kMaxD || p->d_v < 1 || p->d_v > p->d_head) {
        snprintf(why, cap,
                 "latent attention: d_head %d, d_v %d not supported (1 <= d_v <= d_head <= %d)",
                 p->d_head, p->d_v, kMaxD);
        return why;
    }
    if (p->n_kv_head != 1 || p->v_cache != p->k_cache) {
        snprintf(
            why, cap,
            "latent attention: %d KV heads, V %s K: one KV head whose rows are also V expected",
            p->n_kv_head, p->v_cache == p->k_cache ? "==" : "!=");
        return why;
    }
    if (p->n_head < 1 || p->block_size < 1 || p->max_blocks < 1 || p->n_tok < 0) {
        snprintf(why, cap,
                 "latent attention: n_head %d, block_size %d, max_blocks %d, n_tok %d out of range",
                 p->n_head, p->block_size, p->max_blocks, p->n_tok);
        return why;
    }
    return NULL;
}

extern "C" cudaError_t moe_cuda_attention_mla(const moe_attn_params *p, cudaStream_t stream)
{
    char why[200];
    if (moe_cuda_attention_mla_unsupported(p, why, sizeof why))
        return cudaErrorNotSupported;
    mla_args a;
    a.q = p->q;
    a.cache = (const float *)p->k_cache;
    a.out = p->out;
    a.tok_seq = p->tok_seq;
    a.tok_pos = p->tok_pos;
    a.block_tables = p->block_tables;
    a.max_blocks = p->max_blocks;
    a.n_head = p->n_head;
    a.d = p->d_head;
    a.d_v = p->d_v;
    a.block_size = p->block_size;
    a.scale = p->scale;
    const size_t smem = smem_bytes(p->d_head);
    for (int t0 = 0; t0 < p->n_tok; t0 += kMaxGridTok) {
        a.t0 = t0;
        const int n = min(kMaxGridTok, p->n_tok - t0);
        mla_kernel<<<dim3((unsigned)p->n_head, (unsigned)n), kThreads, smem, stream>>>(a);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            return e;
    }
    return cudaSuccess;
}
