/* The arithmetic of sample_top_p shared by the CPU reference (moe_ops.c) and
 * the CUDA kernel (kernels/cuda/sample.cu), so both compute the same numbers
 * from the same inputs: p from the logit in f32, the mass of a candidate as p
 * in 2^-40 fixed point (uint64 sums are exact in any order, hence
 * deterministic on a GPU), the top-p cut and the sampling point from doubles.
 * Only expf may differ between the C library and CUDA (by an ulp or two). */
#ifndef MOE_SAMPLE_MATH_H
#define MOE_SAMPLE_MATH_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define MOE_SAMPLE_FN static __host__ __device__ __forceinline__
#else
#define MOE_SAMPLE_FN static inline
#endif

/* exp((l - max) / temperature), in (0, 1] for finite logits (1 at the max). */
MOE_SAMPLE_FN float moe_sample_p(float l, float max, float temperature)
{
    return expf((l - max) / temperature);
}

/* p in units of 2^-40: at most 2^40 per candidate, so a vocabulary of up to
 * 2^23 ids sums below 2^63. NaN or non-positive p has no mass. */
MOE_SAMPLE_FN uint64_t moe_sample_mass(float p)
{
    if (!(p > 0.0f))
        return 0;
    if (p >= 1.0f)
        return (uint64_t)1 << 40;
    return (uint64_t)(p * 0x1p40f); /* exact scaling, then truncation */
}

/* Smallest integer mass >= top_p * total: the nucleus is the shortest sorted
 * prefix whose mass reaches it. */
MOE_SAMPLE_FN uint64_t moe_sample_cut(float top_p, uint64_t total)
{
    return (uint64_t)ceil((double)top_p * (double)total);
}

/* The sampling point u * sum (u in [0, 1)) truncated; may equal sum after
 * rounding, in which case the last kept candidate is taken. */
MOE_SAMPLE_FN uint64_t moe_sample_point(double u, uint64_t sum)
{
    double r = u * (double)sum;
    return r > 0.0 ? (uint64_t)r : 0;
}

#undef MOE_SAMPLE_FN
#endif
