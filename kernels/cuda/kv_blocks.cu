// KV block gather / scatter for the KV handoff (see backend.h). The slots of
// one block are contiguous in the cache, so each (block, K or V) pair is one
// contiguous copy of block_size * kv_dim floats: grid (n, 2), 16-byte
// accesses when every pointer is 16-byte aligned and the block's float count
// is a multiple of 4, single floats otherwise.
#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 256;

template <typename T, bool kGather>
__global__ void __launch_bounds__(kThreads)
    kv_blocks_kernel(float *k_cache, float *v_cache, const int32_t *__restrict__ block_ids,
                     size_t blk, float *packed) // blk: elements of T per block
{
    const size_t i = blockIdx.x, half = blockIdx.y; // half 0: K, 1: V
    T *cache = (T *)(half ? v_cache : k_cache) + (size_t)block_ids[i] * blk;
    T *buf = (T *)packed + (2 * i + half) * blk;
    for (size_t e = threadIdx.x; e < blk; e += kThreads) {
        if (kGather)
            buf[e] = cache[e];
        else
            cache[e] = buf[e];
    }
}

bool aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

template <bool kGather>
cudaError_t kv_blocks(float *k_cache, float *v_cache, const int32_t *block_ids, int n,
                      int block_size, int kv_dim, float *packed, cudaStream_t stream)
{
    if (n <= 0 || block_size <= 0 || kv_dim <= 0)
        return cudaSuccess;
    const size_t blk = (size_t)block_size * (size_t)kv_dim;
    const dim3 grid((unsigned)n, 2);
    if (blk % 4 == 0 && aligned16(k_cache) && aligned16(v_cache) && aligned16(packed))
        kv_blocks_kernel<float4, kGather>
            <<<grid, kThreads, 0, stream>>>(k_cache, v_cache, block_ids, blk / 4, packed);
    else
        kv_blocks_kernel<float, kGather>
            <<<grid, kThreads, 0, stream>>>(k_cache, v_cache, block_ids, blk, packed);
    return cudaGetLastError();
}

} // namespace

extern "C" cudaError_t moe_cuda_kv_gather_blocks(const float *k_cache, const float *v_cache,
                                                 const int32_t *block_ids, int n, int block_size,
                                                 int kv_dim, float *out, cudaStream_t stream)
{
    return kv_blocks<true>((float *)k_cache, (float *)v_cache, block_ids, n, block_size, kv_dim,
                           out, stream);
}

extern "C" cudaError_t moe_cuda_kv_scatter_blocks(const float *in, const int32_t *block_ids, int n,
                                                  int block_size, int kv_dim, float *k_cache,
                                                  float *v_cache, cudaStream_t stream)
{
    return kv_blocks<false>(k_cache, v_cache, block_ids, n, block_size, kv_dim, (float *)in,
                            stream);
}
