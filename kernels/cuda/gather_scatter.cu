// Row moves for the MoE dispatch: gather (dst[i] = src[idx[i]]) and weighted
// scatter-add (dst[idx[i]] += scale[i] * src[i]). One block per row; rows of
// one scatter call are distinct (backend.h), so no atomics are needed. The
// product and the sum are rounded separately (no FMA), as the CPU reference.
#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 128;

__global__ void gather_kernel(const float *__restrict__ src, const int32_t *__restrict__ idx,
                              int dim, float *__restrict__ dst)
{
    const float *s = src + (size_t)idx[blockIdx.x] * (size_t)dim;
    float *d = dst + (size_t)blockIdx.x * (size_t)dim;
    for (int k = threadIdx.x; k < dim; k += kThreads)
        d[k] = s[k];
}

__global__ void scatter_add_kernel(const float *__restrict__ src, const int32_t *__restrict__ idx,
                                   const float *__restrict__ scale, int dim, float *dst)
{
    const float a = scale ? scale[blockIdx.x] : 1.0f;
    const float *s = src + (size_t)blockIdx.x * (size_t)dim;
    float *d = dst + (size_t)idx[blockIdx.x] * (size_t)dim;
    for (int k = threadIdx.x; k < dim; k += kThreads)
        d[k] = __fadd_rn(d[k], __fmul_rn(a, s[k]));
}

} // namespace

extern "C" cudaError_t moe_cuda_gather_rows(const float *src, const int32_t *idx, int n, int dim,
                                            float *dst, cudaStream_t stream)
{
    if (n <= 0 || dim <= 0)
        return cudaSuccess;
    gather_kernel<<<n, kThreads, 0, stream>>>(src, idx, dim, dst);
    return cudaGetLastError();
}

extern "C" cudaError_t moe_cuda_scatter_add_rows(const float *src, const int32_t *idx,
                                                 const float *scale, int n, int dim, float *dst,
                                                 cudaStream_t stream)
{
    if (n <= 0 || dim <= 0)
        return cudaSuccess;
    scatter_add_kernel<<<n, kThreads, 0, stream>>>(src, idx, scale, dim, dst);
    return cudaGetLastError();
}
