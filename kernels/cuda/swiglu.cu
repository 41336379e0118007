// SwiGLU: out[r][i] = silu(g) * u with g = gate_up[r][i], u = gate_up[r][dim + i],
// silu(g) = g / (1 + exp(-g)), in the CPU reference's order of operations
// (IEEE division and expf, no fast math). One thread per output element.
#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 256;

__global__ void swiglu_kernel(const float *__restrict__ gate_up, float *__restrict__ out, int dim,
                              size_t n)
{
    const size_t stride = (size_t)gridDim.x * kThreads;
    for (size_t i = (size_t)blockIdx.x * kThreads + threadIdx.x; i < n; i += stride) {
        const size_t r = i / (size_t)dim, c = i - r * (size_t)dim;
        const float *row = gate_up + r * 2 * (size_t)dim;
        const float g = row[c], u = row[dim + c];
        out[i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
    }
}

} // namespace

extern "C" cudaError_t moe_cuda_swiglu(const float *gate_up, float *out, int n_rows, int dim,
                                       cudaStream_t stream)
{
    if (n_rows <= 0 || dim <= 0)
        return cudaSuccess;
    const size_t n = (size_t)n_rows * (size_t)dim;
    size_t blocks = (n + kThreads - 1) / kThreads;
    if (blocks > 65535u * 8u)
        blocks = 65535u * 8u;
    swiglu_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(gate_up, out, dim, n);
    return cudaGetLastError();
}
