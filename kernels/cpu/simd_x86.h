/* Small AVX-512 and AVX2 helpers shared by the CPU kernels (x86-64 only; each
 * user compiles its SIMD functions with a target attribute, never -march). */
#ifndef MOE_SIMD_X86_H
#define MOE_SIMD_X86_H

#if defined(__x86_64__)
#include <immintrin.h>
#include <stdint.h>

#define MOE_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma,avx2")))
#define MOE_AVX2_TARGET __attribute__((target("avx2,fma")))

/* bf16 -> f32 is a 16-bit left shift (bit for bit moe_bf16_to_f32 in
 * dtype.h): one vector, and n elements (any n; no access past them). */
MOE_AVX512_TARGET static inline __attribute__((always_inline)) __m512 bf16x16_to_f32(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

MOE_AVX512_TARGET static inline __attribute__((always_inline)) void
bf16_to_f32_avx512(float *dst, const uint16_t *src, int n)
{
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(dst + i, m, bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, src + i)));
    }
}

/* The same on AVX2: one vector of 8, and n elements (8 at a time, the tail
 * scalar: no access past n). */
MOE_AVX2_TARGET static inline __attribute__((always_inline)) __m256 bf16x8_to_f32(__m128i h)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

MOE_AVX2_TARGET static inline __attribute__((always_inline)) void
bf16_to_f32_avx2(float *dst, const uint16_t *src, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, bf16x8_to_f32(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) {
        uint32_t u = (uint32_t)src[i] << 16;
        __builtin_memcpy(dst + i, &u, sizeof u);
    }
}

/* exp(x) for 16 lanes, ~2 ulp; exactly 0 below -87.3 (and for -inf),
 * exactly 1 at 0. */
MOE_AVX512_TARGET static inline __attribute__((always_inline)) __m512 exp_avx512(__m512 x)
{
    const __m512 lo = _mm512_set1_ps(-87.33654f), hi = _mm512_set1_ps(88.72283f);
    __mmask16 zero = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2, ln2 in two parts so n * ln2_hi is exact */
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 pl = _mm512_set1_ps(1.9875691500e-4f);
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.3981999507e-3f));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(8.3334519073e-3f));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(4.1665795894e-2f));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.6666665459e-1f));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 r2 = _mm512_mul_ps(r, r);
    pl = _mm512_fmadd_ps(pl, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512 e = _mm512_scalef_ps(pl, n);
    return _mm512_mask_mov_ps(e, zero, _mm512_setzero_ps());
}

/* exp_avx512 on 8 lanes, bit for bit: the same reduction and polynomial,
 * and scalef(p, n) as p 2^(n >> 1) 2^(n - (n >> 1)): the first product is
 * exact (both factors' exponents stay normal for n in [-126, 128]), the
 * second is one correctly rounded multiply, which is what scalef computes
 * (subnormal results included). */
MOE_AVX2_TARGET static inline __attribute__((always_inline)) __m256 exp_avx2(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.72283f);
    __m256 zero = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 pl = _mm256_set1_ps(1.9875691500e-4f);
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.3981999507e-3f));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(8.3334519073e-3f));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(4.1665795894e-2f));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.6666665459e-1f));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 r2 = _mm256_mul_ps(r, r);
    pl = _mm256_fmadd_ps(pl, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    __m256 e = _mm256_mul_ps(_mm256_mul_ps(pl, p1), p2);
    return _mm256_andnot_ps(zero, e);
}

/* In-register transpose of a 16 x 16 f32 block: v[i] lane j <-> v[j] lane i.
 * 32-bit, then 64-bit interleaves within 128-bit lanes, then two rounds of
 * 128-bit lane shuffles. */
MOE_AVX512_TARGET static inline __attribute__((always_inline)) void transpose16_avx512(__m512 v[16])
{
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_castpd_ps(
            _mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        u[i + 1] = _mm512_castpd_ps(
            _mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        u[i + 2] = _mm512_castpd_ps(
            _mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        u[i + 3] = _mm512_castpd_ps(
            _mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    /* u[4q + c] holds, in 128-bit lane L, column 4L + c of rows 4q..4q+3. */
    for (int c = 0; c < 4; c++) {
        t[c] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);     /* lanes 0, 2 of each */
        t[4 + c] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xdd); /* lanes 1, 3 */
        t[8 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        t[12 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xdd);
    }
    for (int c = 0; c < 4; c++) {
        v[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);           /* columns c */
        v[4 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88);  /* columns 4 + c */
        v[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xdd);       /* columns 8 + c */
        v[12 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xdd); /* columns 12 + c */
    }
}

/* ---- fp16 (the AVX512-FP16 paths of attention_tiled.c, matmul.c and
 * matmul_dot.c) ----
 * x rounded to fp16 (nearest even), each value twice in a dword: the form a
 * dword broadcast (a load) turns into 32 equal fp16 lanes. AVX512F only. */
MOE_AVX512_TARGET static inline __attribute__((always_inline)) __m512i fp16_pairs16(__m512 x)
{
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return _mm512_or_si512(w, _mm512_slli_epi32(w, 16));
}

/* The floats of x that m selects, times inv (a power of two, so exact),
 * rounded to fp16 (nearest even), the rest zero: a token row's conversion in
 * the fp16 matmul paths (matmul.c's panels, matmul_dot.c's streaming tiles),
 * which therefore share their activations' arithmetic. AVX512F only. */
MOE_AVX512_TARGET static inline __attribute__((always_inline)) __m256i
fp16_scaled16(const float *x, __mmask16 m, __m512 inv)
{
    return _mm512_cvtps_ph(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x), inv),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* e with max |x| < 2^e over n floats (0 for a zero or non-finite maximum):
 * the fp16 matmul paths scale a token's row by 2^-e (exact) so |x| <= 1. */
MOE_AVX512_TARGET static inline int fp16_row_exp(const float *x, int n)
{
    __m512 mx = _mm512_setzero_ps();
    for (int k = 0; k < n; k += 16) {
        const int rem = n - k;
        const __mmask16 m = rem >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << rem) - 1u);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + k)));
    }
    const float a = _mm512_reduce_max_ps(mx);
    int e = 0;
    if (a > 0.0f && a <= 3.4028235e38f)
        (void)__builtin_frexpf(a, &e); /* a = f 2^e, f in [0.5, 1) */
    return e;
}

/* AVX512-FP16 arithmetic intrinsics under a target attribute: gcc 12 and
 * later; clang 14 (the fuzz build's) lacks them, so there the fp16 paths are
 * compiled out and their users report them absent. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define MOE_HAVE_FP16 1
#define MOE_FP16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512fp16,fma,avx2")))

/* 32 bf16 weights wv (mag = wv & 0x7fff) times 2^shift as fp16, by a
 * re-bias of their exponent in 16-bit lanes (4 instructions a vector where
 * widening through f32 takes 9): exact from 2^-(14 + shift) up to fp16's
 * range; below, zero (or, an exponent exactly at the bias, a value under
 * 2^-(14 + shift) in the scaled units' subnormals: an error below that
 * threshold); past the range, garbage, which the users' guards keep out.
 * The fp16 streaming tiles (matmul_dot.c) and panels (matmul.c) take their
 * weights so; mirrored in tests/unit/test_matmul_fast.c (stream_w_emu). */
MOE_FP16_TARGET static inline __attribute__((always_inline)) __m512h
fp16_from_bf16_scaled(__m512i wv, __m512i mag, const int shift)
{
    /* fp16 exponent = bf16 exponent - 127 + 15 + shift */
    const __m512i bias = _mm512_set1_epi16((short)((127 - 15 - shift) << 7));
    const __m512i h = _mm512_slli_epi16(_mm512_subs_epu16(mag, bias), 3);
    /* h | (wv & 0x8000): the sign back */
    return _mm512_castsi512_ph(
        _mm512_ternarylogic_epi32(h, wv, _mm512_set1_epi16((short)0x8000), 0xf8));
}

/* 32 fp16 lanes as two vectors of 16 f32 (exact): lanes 0..15, 16..31. */
MOE_FP16_TARGET static inline __attribute__((always_inline)) void
fp16_to_f32x2(__m512h x, __m512 *lo, __m512 *hi)
{
    const __m512i b = _mm512_castph_si512(x);
    *lo = _mm512_cvtxph_ps(_mm256_castsi256_ph(_mm512_castsi512_si256(b)));
    *hi = _mm512_cvtxph_ps(_mm256_castsi256_ph(_mm512_extracti64x4_epi64(b, 1)));
}
#else
#define MOE_HAVE_FP16 0
#endif

#endif /* __x86_64__ */
#ifndef MOE_HAVE_FP16
#define MOE_HAVE_FP16 0 /* not x86-64 */
#endif
#endif
