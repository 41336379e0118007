// Unpermute + weighted combine (see backend.h): one block per token, threads
// over the row; each element runs over the token's k entries in order j =
// 0, 1, ... with the product and the sum rounded separately (no FMA), as the
// CPU reference. Every output element is written by one thread: no atomics,
// the same result on every run.
#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads)
    combine_kernel(const float *__restrict__ rows, const float *__restrict__ weights,
                   const int32_t *__restrict__ tok_rows, int top_k, int dim, float *__restrict__ y)
{
    const int32_t *tr = tok_rows + (size_t)blockIdx.x * (size_t)top_k;
    float *d = y + (size_t)blockIdx.x * (size_t)dim;
    for (int k = threadIdx.x; k < dim; k += kThreads) {
        float acc = d[k];
        for (int j = 0; j < top_k; j++) {
            const int32_t i = tr[j];
            if (i >= 0)
                acc = __fadd_rn(acc, __fmul_rn(weights[i], rows[(size_t)i * (size_t)dim + k]));
        }
        d[k] = acc;
    }
}

} // namespace

extern "C" cudaError_t moe_cuda_unpermute_combine(const float *rows, const float *weights,
                                                  const int32_t *tok_rows, int n_tok, int top_k,
                                                  int dim, float *y, cudaStream_t stream)
{
    if (n_tok <= 0 || dim <= 0 || top_k <= 0)
        return cudaSuccess;
    combine_kernel<<<(unsigned)n_tok, kThreads, 0, stream>>>(rows, weights, tok_rows, top_k, dim,
                                                             y);
    return cudaGetLastError();
}
