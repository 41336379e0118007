// Paged KV write: k, v (n_tok, kv_dim) -> caches (n_slot, kv_dim) at slots[t]
// (v and v_cache NULL: K only, a latent cache), f32 or bf16 caches.
// One block per token; 16-byte copies when kv_dim is a multiple of 4 (cache
// rows then stay 16-byte aligned, as buffers from cudaMalloc are).
#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 128;

template <bool kVec>
__global__ void kv_write_kernel(const float *__restrict__ k, const float *__restrict__ v,
                                const int32_t *__restrict__ slots, int kv_dim,
                                float *__restrict__ k_cache, float *__restrict__ v_cache)
{
    const size_t src = (size_t)blockIdx.x * (size_t)kv_dim;
    const size_t dst = (size_t)slots[blockIdx.x] * (size_t)kv_dim;
    if (kVec) {
        const int n4 = kv_dim / 4;
        const float4 *k4 = (const float4 *)(k + src), *v4 = (const float4 *)(v + src);
        float4 *kc = (float4 *)(k_cache + dst), *vc = (float4 *)(v_cache + dst);
        for (int i = threadIdx.x; i < n4; i += kThreads) {
            kc[i] = k4[i];
            if (v_cache)
                vc[i] = v4[i];
        }
    } else {
        for (int i = threadIdx.x; i < kv_dim; i += kThreads) {
            k_cache[dst + i] = k[src + i];
            if (v_cache)
                v_cache[dst + i] = v[src + i];
        }
    }
}

// f32 to bf16 bits, rounded to nearest even, NaN kept quiet: common/dtype.h's
// moe_f32_to_bf16, which the CPU backend's caches use, bit for bit.
__device__ __forceinline__ uint16_t to_bf16(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// A bf16 cache: one thread per element pair where kv_dim is even (4-byte
// stores), else per element.
template <bool kPair>
__global__ void kv_write_bf16_kernel(const float *__restrict__ k, const float *__restrict__ v,
                                     const int32_t *__restrict__ slots, int kv_dim,
                                     uint16_t *__restrict__ k_cache, uint16_t *__restrict__ v_cache)
{
    const size_t src = (size_t)blockIdx.x * (size_t)kv_dim;
    const size_t dst = (size_t)slots[blockIdx.x] * (size_t)kv_dim;
    if (kPair) {
        const int n2 = kv_dim / 2;
        uint32_t *kc = (uint32_t *)(k_cache + dst), *vc = (uint32_t *)(v_cache + dst);
        for (int i = threadIdx.x; i < n2; i += kThreads) {
            kc[i] = (uint32_t)to_bf16(k[src + 2 * i]) | (uint32_t)to_bf16(k[src + 2 * i + 1]) << 16;
            if (v_cache)
                vc[i] = (uint32_t)to_bf16(v[src + 2 * i]) | (uint32_t)to_bf16(v[src + 2 * i + 1])
                                                                << 16;
        }
    } else {
        for (int i = threadIdx.x; i < kv_dim; i += kThreads) {
            k_cache[dst + i] = to_bf16(k[src + i]);
            if (v_cache)
                v_cache[dst + i] = to_bf16(v[src + i]);
        }
    }
}

bool aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

} // namespace

extern "C" cudaError_t moe_cuda_kv_write(const float *k, const float *v, const int32_t *slots,
                                         int n_tok, int kv_dim, float *k_cache, float *v_cache,
                                         cudaStream_t stream)
{
    if (n_tok <= 0 || kv_dim <= 0)
        return cudaSuccess;
    if (kv_dim % 4 == 0 && aligned16(k) && aligned16(v) && aligned16(k_cache) && aligned16(v_cache))
        kv_write_kernel<true>
            <<<n_tok, kThreads, 0, stream>>>(k, v, slots, kv_dim, k_cache, v_cache);
    else
        kv_write_kernel<false>
            <<<n_tok, kThreads, 0, stream>>>(k, v, slots, kv_dim, k_cache, v_cache);
    return cudaGetLastError();
}

extern "C" cudaError_t moe_cuda_kv_write_bf16(const float *k, const float *v, const int32_t *slots,
                                              int n_tok, int kv_dim, uint16_t *k_cache,
                                              uint16_t *v_cache, cudaStream_t stream)
{
    if (n_tok <= 0 || kv_dim <= 0)
        return cudaSuccess;
    if (kv_dim % 2 == 0 && ((uintptr_t)k_cache & 3u) == 0 && ((uintptr_t)v_cache & 3u) == 0)
        kv_write_bf16_kernel<true>
            <<<n_tok, kThreads, 0, stream>>>(k, v, slots, kv_dim, k_cache, v_cache);
    else
        kv_write_bf16_kernel<false>
            <<<n_tok, kThreads, 0, stream>>>(k, v, slots, kv_dim, k_cache, v_cache);
    return cudaGetLastError();
}
