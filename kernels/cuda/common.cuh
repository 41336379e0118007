// Device helpers shared by the CUDA ops: warp reductions and the bf16 GEMV
// row loop (matmul.cu's decode GEMV and grouped_matmul.cu's grouped GEMV run
// the same per-row arithmetic, so both call bf16_row_dot). Header-only:
// every function is __forceinline__ in an anonymous namespace, so each .cu
// gets its own copy and no device linking is needed.
#ifndef MOE_CUDA_COMMON_CUH
#define MOE_CUDA_COMMON_CUH

#include <stdint.h>

namespace
{

__device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__device__ __forceinline__ float warp_max(float v)
{
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// f32 to bf16 bits, rounded to nearest even, NaN kept quiet: common/dtype.h's
// moe_f32_to_bf16, which the CPU backend's caches use, bit for bit.
__device__ __forceinline__ uint32_t bf16_bits_rn(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (u >> 16) | 0x40u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}

// The two bf16 halves of a 32-bit word, widened exactly to f32.
__device__ __forceinline__ float bf16_lo(uint32_t u)
{
    return __uint_as_float(u << 16);
}

__device__ __forceinline__ float bf16_hi(uint32_t u)
{
    return __uint_as_float(u & 0xffff0000u);
}

// One warp's dot products of a bf16 weight row wr (n_in) with the first
// `cnt` (<= NMAX) rows of x (each n_in f32, contiguous): on return every lane
// holds acc[t] = sum_k x[t][k] * wr[k] for t < cnt (warp-reduced; acc[t] for
// t >= cnt is 0). kVec: n_in a multiple of 8 and wr, x 16-byte aligned; then
// each lane streams 16-byte pieces (8 weights) of the row, so W is read once
// for all cnt tokens. Every product is an f32 fmaf on exactly widened weights,
// in the same order on both callers. When cnt is a compile-time NMAX after
// inlining, the `t < cnt` tests vanish.
template <int NMAX, bool kVec, int kUnroll>
__device__ __forceinline__ void bf16_row_dot(const float *__restrict__ x, int n_in,
                                             const uint16_t *__restrict__ wr, int lane, int cnt,
                                             float (&acc)[NMAX])
{
#pragma unroll
    for (int t = 0; t < NMAX; t++)
        acc[t] = 0.0f;
    if (kVec) {
#pragma unroll kUnroll
        for (int k = lane * 8; k < n_in; k += 32 * 8) {
            const uint4 raw = __ldg((const uint4 *)(wr + k));
            const float wf[8] = {bf16_lo(raw.x), bf16_hi(raw.x), bf16_lo(raw.y), bf16_hi(raw.y),
                                 bf16_lo(raw.z), bf16_hi(raw.z), bf16_lo(raw.w), bf16_hi(raw.w)};
#pragma unroll
            for (int t = 0; t < NMAX; t++) {
                if (t < cnt) {
                    const float4 a = __ldg((const float4 *)(x + (size_t)t * n_in + k));
                    const float4 b = __ldg((const float4 *)(x + (size_t)t * n_in + k + 4));
                    acc[t] = fmaf(a.x, wf[0], acc[t]);
                    acc[t] = fmaf(a.y, wf[1], acc[t]);
                    acc[t] = fmaf(a.z, wf[2], acc[t]);
                    acc[t] = fmaf(a.w, wf[3], acc[t]);
                    acc[t] = fmaf(b.x, wf[4], acc[t]);
                    acc[t] = fmaf(b.y, wf[5], acc[t]);
                    acc[t] = fmaf(b.z, wf[6], acc[t]);
                    acc[t] = fmaf(b.w, wf[7], acc[t]);
                }
            }
        }
    } else {
        for (int k = lane; k < n_in; k += 32) {
            const float wv = __uint_as_float((uint32_t)wr[k] << 16);
#pragma unroll
            for (int t = 0; t < NMAX; t++)
                if (t < cnt)
                    acc[t] = fmaf(x[(size_t)t * n_in + k], wv, acc[t]);
        }
    }
#pragma unroll
    for (int t = 0; t < NMAX; t++)
        acc[t] = warp_sum(acc[t]);
}

} // namespace

#endif
