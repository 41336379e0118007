// Causal grouped-query attention over the paged KV cache, for decode and
// prefill alike (one kernel; see backend.h for the contract).
//
// Grid (n_split, n_kv_head, n_tok): a block takes one token t, one KV head and
// one split — the positions [split * chunk, min((split + 1) * chunk, n_pos))
// of t's sequence, n_pos = tok_pos[t] + 1 (causal limit). All G = n_head /
// n_kv_head query heads of that KV head are done together, so each K/V row is
// read once per group (GQA). Splitting the positions over blocks is the
// FlashDecoding idea: a decode step of a few tokens still fills the GPU.
// Blocks whose split starts at or past n_pos leave at once.
//
// The cache holds f32 or bf16 (moe_attn_params.kv_dtype: a template
// parameter of the kernel); bf16 rows are widened to f32 as they are
// gathered, so everything after is the same arithmetic.
//
// Inside a block, tiles of kTile = 32 positions: the K and V rows of the tile
// are gathered into shared memory through the block table
//   slot = block_tables[seq][p / block_size] * block_size + p % block_size,
// row offset slot * n_kv_head * d_head + kv_head * d_head
// (rows padded by one float so that lane j reading row j is conflict-free).
// Warp w owns query heads w, w + 4, ...: lane j computes the score of tile
// position j, the warp finds the tile max and the online-softmax update
//   m' = max(m, tile max), r = exp(m - m'), l' = l r + sum exp(s - m'),
//   acc' = acc r + sum_j exp(s_j - m') v_j
// with acc (G, d_head) in shared memory, each lane owning dims lane, lane+32..
//
// With one split the block writes out = acc / l. With several, it writes its
// unnormalised (acc, m, l) to scratch and combine_kernel merges the splits of
// each (token, head): out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s.
//
// The chunk (positions per split) is chosen on the host, which does not know
// the sequence lengths (they live on the device): from the upper bound
// max_blocks * block_size it grows the chunk from 64 until the grid has at
// most ~2048 blocks, and one split is used when the chunk covers the bound.
#include <math.h>

#include "common.cuh"
#include "cuda_ops.h"

namespace
{

constexpr int kTile = 32;
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxGroup = 16;
constexpr int kMinChunk = 64;
constexpr long long kTargetBlocks = 2048;
constexpr int kMaxGridTok = 65535; // gridDim.y / gridDim.z limit

struct attn_args {
    const float *q;
    const void *k_cache, *v_cache; // float, or bf16 bits (uint16_t): the kernel's KV
    float *out;
    const int32_t *tok_seq, *tok_pos, *block_tables;
    int max_blocks, n_head, n_kv_head, d_head, block_size;
    float scale;
    int chunk, n_split;
    int t0;          // first token of this launch (grids hold at most 65535 tokens)
    float *part_acc; // (n_tok, n_head, n_split, d_head) when n_split > 1
    float *part_ml;  // (n_tok, n_head, n_split, 2): m, l
};

// Four consecutive cache elements as floats: one 16-byte load of f32, or
// one 8-byte load of bf16 widened exactly (common.cuh's bf16_lo / bf16_hi).
__device__ __forceinline__ float4 load4(const float *p)
{
    return __ldg((const float4 *)p);
}

__device__ __forceinline__ float4 load4(const uint16_t *p)
{
    const uint2 u = __ldg((const uint2 *)p);
    return make_float4(bf16_lo(u.x), bf16_hi(u.x), bf16_lo(u.y), bf16_hi(u.y));
}

size_t smem_bytes(int d_head, int group)
{
    const size_t ld = (size_t)d_head + 1;
    return sizeof(float) * (2 * kTile * ld + 2 * (size_t)group * d_head + (size_t)group * kTile +
                            2 * (size_t)group);
}

template <typename KV> __global__ void __launch_bounds__(kThreads) attn_kernel(const attn_args a)
{
    extern __shared__ float smem[];
    const int D = a.d_head, G = a.n_head / a.n_kv_head, ld = D + 1;
    float *ks = smem;            // (kTile, ld)
    float *vs = ks + kTile * ld; // (kTile, ld)
    float *qs = vs + kTile * ld; // (G, D)
    float *acc = qs + G * D;     // (G, D)
    float *ps = acc + G * D;     // (G, kTile)
    float *ms = ps + G * kTile;  // (G)
    float *ls = ms + G;          // (G)

    const int split = blockIdx.x, kvh = blockIdx.y, t = a.t0 + (int)blockIdx.z;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int n_pos = a.tok_pos[t] + 1;
    const int p_begin = split * a.chunk;
    if (p_begin >= n_pos) // block-uniform: nothing to do
        return;
    const int p_end = min(n_pos, p_begin + a.chunk);
    const int h0 = kvh * G;
    const size_t kv_dim = (size_t)a.n_kv_head * D;
    const int32_t *blocks = a.block_tables + (size_t)a.tok_seq[t] * a.max_blocks;

    const float *qg = a.q + ((size_t)t * a.n_head + h0) * D; // heads h0 .. h0+G-1
    for (int i = tid; i < G * D; i += kThreads) {
        qs[i] = qg[i];
        acc[i] = 0.0f;
    }
    for (int g = tid; g < G; g += kThreads) {
        ms[g] = -INFINITY;
        ls[g] = 0.0f;
    }

    const int d4 = D / 4;
    for (int p0 = p_begin; p0 < p_end; p0 += kTile) {
        const int n = min(kTile, p_end - p0);
        __syncthreads(); // init visible; the previous tile is done with ks, vs, ps
        for (int i = tid; i < n * d4; i += kThreads) {
            const int j = i / d4, c = (i - j * d4) * 4;
            const int p = p0 + j;
            const size_t slot = (size_t)blocks[p / a.block_size] * a.block_size + p % a.block_size;
            const size_t off = slot * kv_dim + (size_t)kvh * D + c;
            const float4 k4 = load4((const KV *)a.k_cache + off);
            const float4 v4 = load4((const KV *)a.v_cache + off);
            float *kd = ks + j * ld + c, *vd = vs + j * ld + c;
            kd[0] = k4.x;
            kd[1] = k4.y;
            kd[2] = k4.z;
            kd[3] = k4.w;
            vd[0] = v4.x;
            vd[1] = v4.y;
            vd[2] = v4.z;
            vd[3] = v4.w;
        }
        __syncthreads();
        for (int g = warp; g < G; g += kWarps) {
            float s = -INFINITY;
            if (lane < n) {
                const float *kr = ks + lane * ld, *qr = qs + g * D;
                float dot = 0.0f;
                for (int k = 0; k < D; k++)
                    dot = fmaf(qr[k], kr[k], dot);
                s = dot * a.scale;
            }
            const float m_old = ms[g];
            const float m_new = fmaxf(m_old, warp_max(s)); // finite: n >= 1
            const float e = lane < n ? expf(s - m_new) : 0.0f;
            const float e_sum = warp_sum(e);
            const float r = expf(m_old - m_new); // 0 on the first tile (m_old = -inf)
            ps[g * kTile + lane] = e;
            __syncwarp();
            const float *pg = ps + g * kTile;
            for (int d = lane; d < D; d += 32) {
                float o = acc[g * D + d] * r;
                for (int j = 0; j < n; j++)
                    o = fmaf(pg[j], vs[j * ld + d], o);
                acc[g * D + d] = o;
            }
            __syncwarp(); // every lane has read ms[g] and ps before they change
            if (lane == 0) {
                ms[g] = m_new;
                ls[g] = ls[g] * r + e_sum;
            }
        }
    }
    __syncthreads();
    if (a.n_split == 1) {
        float *og = a.out + ((size_t)t * a.n_head + h0) * D;
        for (int i = tid; i < G * D; i += kThreads)
            og[i] = acc[i] * (1.0f / ls[i / D]);
        return;
    }
    for (int i = tid; i < G * D; i += kThreads) {
        const int g = i / D, d = i - g * D;
        const size_t row = ((size_t)t * a.n_head + h0 + g) * a.n_split + split;
        a.part_acc[row * D + d] = acc[i];
    }
    for (int g = tid; g < G; g += kThreads) {
        const size_t row = ((size_t)t * a.n_head + h0 + g) * a.n_split + split;
        a.part_ml[row * 2] = ms[g];
        a.part_ml[row * 2 + 1] = ls[g];
    }
}

// Grid (n_head, n_tok): merges the non-empty splits of one (token, head).
__global__ void __launch_bounds__(kThreads) combine_kernel(const attn_args a)
{
    const int h = blockIdx.x, t = a.t0 + (int)blockIdx.y, D = a.d_head;
    const int n_pos = a.tok_pos[t] + 1;
    const int ns = (n_pos + a.chunk - 1) / a.chunk; // splits that ran (<= n_split)
    const size_t row0 = ((size_t)t * a.n_head + h) * a.n_split;
    const float *ml = a.part_ml + row0 * 2;
    float m = -INFINITY;
    for (int s = 0; s < ns; s++)
        m = fmaxf(m, ml[2 * s]);
    float l = 0.0f;
    for (int s = 0; s < ns; s++)
        l += ml[2 * s + 1] * expf(ml[2 * s] - m);
    const float inv_l = 1.0f / l;
    float *o = a.out + ((size_t)t * a.n_head + h) * D;
    for (int d = threadIdx.x; d < D; d += kThreads) {
        float v = 0.0f;
        for (int s = 0; s < ns; s++)
            v = fmaf(a.part_acc[(row0 + s) * D + d], expf(ml[2 * s] - m), v);
        o[d] = v * inv_l;
    }
}

void plan(const moe_attn_params *p, int *chunk, int *n_split)
{
    const long long max_pos = (long long)p->max_blocks * p->block_size;
    const long long rows = (long long)p->n_tok * p->n_kv_head;
    long long c = kMinChunk;
    while (c < max_pos && rows * ((max_pos + c - 1) / c) > kTargetBlocks)
        c *= 2;
    if (c >= max_pos)
        c = max_pos;
    *chunk = (int)c;
    *n_split = (int)((max_pos + c - 1) / c);
}

} // namespace

extern "C" const char *moe_cuda_attention_unsupported(const moe_attn_params *p, char *why,
                                                      size_t cap)
{
    const int d = p->d_head;
    if (p->d_v && p->d_v != d) {
        snprintf(why, cap, "d_v %d != d_head %d not supported (latent attention)", p->d_v, d);
        return why;
    }
    if (p->kv_dtype != MOE_DTYPE_F32 && p->kv_dtype != MOE_DTYPE_BF16) {
        snprintf(why, cap, "KV cache dtype %s not supported (F32 or BF16)",
                 moe_dtype_name(p->kv_dtype));
        return why;
    }
    if (d != 16 && d != 32 && d != 64 && d != 128 && d != 256) {
        snprintf(why, cap, "d_head %d not supported (16, 32, 64, 128, 256)", d);
        return why;
    }
    if (p->n_kv_head < 1 || p->n_head < 1 || p->n_head % p->n_kv_head != 0) {
        snprintf(why, cap, "n_head %d is not a multiple of n_kv_head %d", p->n_head, p->n_kv_head);
        return why;
    }
    if (p->n_head / p->n_kv_head > kMaxGroup) {
        snprintf(why, cap, "%d query heads per KV head not supported (at most %d)",
                 p->n_head / p->n_kv_head, kMaxGroup);
        return why;
    }
    if (p->block_size < 1 || p->max_blocks < 1 || p->n_tok < 0) {
        snprintf(why, cap, "block_size %d, max_blocks %d, n_tok %d out of range", p->block_size,
                 p->max_blocks, p->n_tok);
        return why;
    }
    if ((((uintptr_t)p->k_cache | (uintptr_t)p->v_cache) & 15u) != 0) {
        snprintf(why, cap, "k_cache/v_cache not 16-byte aligned (use buf_alloc pointers)");
        return why;
    }
    if ((long long)p->max_blocks * p->block_size > 0x7fffffffLL) {
        snprintf(why, cap, "max_blocks %d x block_size %d positions exceed INT_MAX", p->max_blocks,
                 p->block_size);
        return why;
    }
    return NULL;
}

extern "C" size_t moe_cuda_attention_scratch_bytes(const moe_attn_params *p)
{
    char why[160];
    if (p->n_tok <= 0 || moe_cuda_attention_unsupported(p, why, sizeof why))
        return 0;
    int chunk, n_split;
    plan(p, &chunk, &n_split);
    if (n_split == 1)
        return 0;
    return sizeof(float) * (size_t)p->n_tok * p->n_head * n_split * ((size_t)p->d_head + 2);
}

extern "C" cudaError_t moe_cuda_attention(const moe_attn_params *p, void *scratch,
                                          size_t scratch_bytes, cudaStream_t stream)
{
    char why[160];
    if (moe_cuda_attention_unsupported(p, why, sizeof why))
        return cudaErrorNotSupported;
    if (p->n_tok == 0)
        return cudaSuccess;
    attn_args a;
    a.q = p->q;
    a.k_cache = p->k_cache;
    a.v_cache = p->v_cache;
    a.out = p->out;
    a.tok_seq = p->tok_seq;
    a.tok_pos = p->tok_pos;
    a.block_tables = p->block_tables;
    a.max_blocks = p->max_blocks;
    a.n_head = p->n_head;
    a.n_kv_head = p->n_kv_head;
    a.d_head = p->d_head;
    a.block_size = p->block_size;
    a.scale = p->scale;
    plan(p, &a.chunk, &a.n_split);
    a.part_acc = NULL;
    a.part_ml = NULL;
    if (a.n_split > 1) {
        const size_t need = moe_cuda_attention_scratch_bytes(p);
        if (!scratch || scratch_bytes < need)
            return cudaErrorInvalidValue;
        a.part_acc = (float *)scratch;
        a.part_ml = a.part_acc + (size_t)p->n_tok * p->n_head * a.n_split * p->d_head;
    }
    const bool bf16 = p->kv_dtype == MOE_DTYPE_BF16;
    const size_t smem = smem_bytes(p->d_head, p->n_head / p->n_kv_head);
    if (smem > 48 * 1024) {
        cudaError_t e =
            bf16 ? cudaFuncSetAttribute(attn_kernel<uint16_t>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)
                 : cudaFuncSetAttribute(attn_kernel<float>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess)
            return e;
    }
    for (int t0 = 0; t0 < p->n_tok; t0 += kMaxGridTok) {
        const int nt = min(kMaxGridTok, p->n_tok - t0);
        a.t0 = t0;
        const dim3 grid((unsigned)a.n_split, (unsigned)p->n_kv_head, (unsigned)nt);
        if (bf16)
            attn_kernel<uint16_t><<<grid, kThreads, smem, stream>>>(a);
        else
            attn_kernel<float><<<grid, kThreads, smem, stream>>>(a);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            return e;
        if (a.n_split == 1)
            continue;
        combine_kernel<<<dim3((unsigned)p->n_head, (unsigned)nt), kThreads, 0, stream>>>(a);
        e = cudaGetLastError();
        if (e != cudaSuccess)
            return e;
    }
    return cudaSuccess;
}
