// Paged KV write: k, v (n_tok, kv_dim) -> caches (n_slot, kv_dim) at slots[t]
// (v and v_cache NULL: K only, a latent cache), f32 or bf16 caches.
// One block per token; each thread stores kW consecutive elements at a time:
// f32 16-byte copies when kv_dim is a multiple of 4 (cache rows then stay
// 16-byte aligned, as buffers from cudaMalloc are), bf16 4-byte pairs when it
// is even, else single elements.
#include "common.cuh"
#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 128;

// kW cache elements at d from the f32 values at s.
template <int kW> __device__ __forceinline__ void store(float *d, const float *s)
{
    static_assert(kW == 1 || kW == 4, "f32 caches: single floats or float4");
    if constexpr (kW == 4)
        *(float4 *)d = *(const float4 *)s;
    else
        *d = *s;
}

template <int kW> __device__ __forceinline__ void store(uint16_t *d, const float *s)
{
    static_assert(kW == 1 || kW == 2, "bf16 caches: single values or pairs");
    if constexpr (kW == 2)
        *(uint32_t *)d = bf16_bits_rn(s[0]) | bf16_bits_rn(s[1]) << 16;
    else
        *d = (uint16_t)bf16_bits_rn(*s);
}

template <typename C, int kW>
__global__ void kv_write_kernel(const float *__restrict__ k, const float *__restrict__ v,
                                const int32_t *__restrict__ slots, int kv_dim,
                                C *__restrict__ k_cache, C *__restrict__ v_cache)
{
    const size_t src = (size_t)blockIdx.x * (size_t)kv_dim;
    const size_t dst = (size_t)slots[blockIdx.x] * (size_t)kv_dim;
    for (int i = threadIdx.x * kW; i < kv_dim; i += kThreads * kW) {
        store<kW>(k_cache + dst + i, k + src + i);
        if (v_cache)
            store<kW>(v_cache + dst + i, v + src + i);
    }
}

bool aligned(const void *p, uintptr_t bytes)
{
    return ((uintptr_t)p & (bytes - 1)) == 0;
}

} // namespace

extern "C" cudaError_t moe_cuda_kv_write(const float *k, const float *v, const int32_t *slots,
                                         int n_tok, int kv_dim, float *k_cache, float *v_cache,
                                         cudaStream_t stream)
{
    if (n_tok <= 0 || kv_dim <= 0)
        return cudaSuccess;
    if (kv_dim % 4 == 0 && aligned(k, 16) && aligned(v, 16) && aligned(k_cache, 16) &&
        aligned(v_cache, 16))
        kv_write_kernel<float, 4>
            <<<n_tok, kThreads, 0, stream>>>(k, v, slots, kv_dim, k_cache, v_cache);
    else
        kv_write_kernel<float, 1>
            <<<n_tok, kThreads, 0, stream>>>(k, v, slots, kv_dim, k_cache, v_cache);
    return cudaGetLastError();
}

extern "C" cudaError_t moe_cuda_kv_write_bf16(const float *k, const float *v, const int32_t *slots,
                                              int n_tok, int kv_dim, uint16_t *k_cache,
                                              uint16_t *v_cache, cudaStream_t stream)
{
    if (n_tok <= 0 || kv_dim <= 0)
        return cudaSuccess;
    if (kv_dim % 2 == 0 && aligned(k_cache, 4) && aligned(v_cache, 4))
        kv_write_kernel<uint16_t, 2>
            <<<n_tok, kThreads, 0, stream>>>(k, v, slots, kv_dim, k_cache, v_cache);
    else
        kv_write_kernel<uint16_t, 1>
            <<<n_tok, kThreads, 0, stream>>>(k, v, slots, kv_dim, k_cache, v_cache);
    return cudaGetLastError();
}
