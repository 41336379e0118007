// copy_cols (backend.h): a block of columns from one row-major f32 matrix
// into another; one block per row, the threads over the columns.
#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 128;

__global__ void copy_cols_kernel(float *__restrict__ dst, int ld_dst, const float *__restrict__ src,
                                 int ld_src, int n_cols)
{
    const size_t r = blockIdx.x;
    for (int j = threadIdx.x; j < n_cols; j += kThreads)
        dst[r * (size_t)ld_dst + j] = src[r * (size_t)ld_src + j];
}

} // namespace

extern "C" cudaError_t moe_cuda_copy_cols(float *dst, int ld_dst, const float *src, int ld_src,
                                          int n_rows, int n_cols, cudaStream_t stream)
{
    if (n_rows <= 0 || n_cols <= 0)
        return cudaSuccess;
    copy_cols_kernel<<<(unsigned)n_rows, kThreads, 0, stream>>>(dst, ld_dst, src, ld_src, n_cols);
    return cudaGetLastError();
}
