// Rotary embedding in place, "rotate half" layout: pairs (i, i + d_head/2)
// rotated by pos * inv_freq[i]. inv_freq comes from the host (the model
// computes it once, moe_rope_inv_freq), so both backends use the same
// frequencies; cos/sin (each times `scale`) and the products follow the
// reference's order, each product rounded on its own (no FMA):
//   y[i] = x[i] c - x[i+h] s;  y[i+h] = x[i+h] c + x[i] s.
// One thread per (token, head, pair); the block copies inv_freq to shared
// memory first.
#include <math.h>

#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 256;
constexpr int kMaxHalf = MOE_CUDA_ROPE_MAX_DHEAD / 2;

struct inv_freq_table {
    float v[kMaxHalf];
};

__global__ void rope_kernel(float *x, const int32_t *__restrict__ pos, int n_heads, int half,
                            size_t n, const inv_freq_table freq, float scale)
{
    __shared__ float inv_freq[kMaxHalf];
    for (int i = threadIdx.x; i < half; i += kThreads)
        inv_freq[i] = freq.v[i];
    __syncthreads();
    const size_t stride = (size_t)gridDim.x * kThreads;
    for (size_t e = (size_t)blockIdx.x * kThreads + threadIdx.x; e < n; e += stride) {
        const size_t th = e / (size_t)half; // token * n_heads + head
        const int i = (int)(e - th * (size_t)half);
        const size_t t = th / (size_t)n_heads;
        const float f = __fmul_rn((float)pos[t], inv_freq[i]);
        const float c = __fmul_rn(cosf(f), scale), s = __fmul_rn(sinf(f), scale);
        float *row = x + th * 2 * (size_t)half;
        const float a = row[i], b = row[i + half];
        row[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        row[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
}

} // namespace

extern "C" cudaError_t moe_cuda_rope(float *x, const int32_t *pos, int n_tok, int n_heads,
                                     int d_head, const float *inv_freq, float scale,
                                     cudaStream_t stream)
{
    if (d_head <= 0 || d_head % 2 != 0 || d_head > MOE_CUDA_ROPE_MAX_DHEAD)
        return cudaErrorNotSupported;
    if (n_tok <= 0 || n_heads <= 0)
        return cudaSuccess;
    const int half = d_head / 2;
    inv_freq_table freq = {};
    for (int i = 0; i < half; i++)
        freq.v[i] = inv_freq[i];
    const size_t n = (size_t)n_tok * (size_t)n_heads * (size_t)half;
    size_t blocks = (n + kThreads - 1) / kThreads;
    if (blocks > 65535u * 4u)
        blocks = 65535u * 4u;
    rope_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(x, pos, n_heads, half, n, freq, scale);
    return cudaGetLastError();
}
