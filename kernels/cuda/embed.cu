// Embedding lookup: dst[t] = f32(table[ids[t]]) for f32, bf16 or f16 tables.
// One block per token. bf16 widens exactly (16-bit shift); f16 through
// __half2float (exact, subnormals included).
#include <cuda_fp16.h>

#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 128;

__global__ void embed_kernel(const void *__restrict__ table, int dtype,
                             const int32_t *__restrict__ ids, int dim, float *__restrict__ dst)
{
    const size_t row = (size_t)ids[blockIdx.x] * (size_t)dim;
    float *d = dst + (size_t)blockIdx.x * (size_t)dim;
    if (dtype == MOE_DTYPE_F32) {
        const float *s = (const float *)table + row;
        for (int k = threadIdx.x; k < dim; k += kThreads)
            d[k] = s[k];
    } else if (dtype == MOE_DTYPE_BF16) {
        const uint16_t *s = (const uint16_t *)table + row;
        for (int k = threadIdx.x; k < dim; k += kThreads)
            d[k] = __uint_as_float((uint32_t)s[k] << 16);
    } else {
        const __half *s = (const __half *)table + row;
        for (int k = threadIdx.x; k < dim; k += kThreads)
            d[k] = __half2float(s[k]);
    }
}

} // namespace

extern "C" cudaError_t moe_cuda_embed(const void *table, enum moe_dtype dtype, const int32_t *ids,
                                      int n_tok, int dim, float *dst, cudaStream_t stream)
{
    if (dtype != MOE_DTYPE_F32 && dtype != MOE_DTYPE_BF16 && dtype != MOE_DTYPE_F16)
        return cudaErrorNotSupported;
    if (n_tok <= 0 || dim <= 0)
        return cudaSuccess;
    embed_kernel<<<n_tok, kThreads, 0, stream>>>(table, (int)dtype, ids, dim, dst);
    return cudaGetLastError();
}
