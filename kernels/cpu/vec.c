/* Run-time ISA selection and the small vector primitives (dot, sum of
 * squares, axpy, scale) used by attention and rmsnorm. */
#include <stdatomic.h>

#include "cpu_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define VEC_X86 1
#endif

/* ---------------------------------------------------------------------------
 * ISA selection */

static _Atomic int g_isa_detected = -1;
static _Atomic int g_isa_active = -1;

enum cpu_isa cpu_kernels_detect_isa(void)
{
    int isa = atomic_load_explicit(&g_isa_detected, memory_order_relaxed);
    if (isa >= 0)
        return (enum cpu_isa)isa;
    isa = CPU_ISA_SCALAR;
#ifdef VEC_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        isa = CPU_ISA_AVX2;
    if (isa == CPU_ISA_AVX2 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
        isa = CPU_ISA_AVX512;
#endif
    atomic_store_explicit(&g_isa_detected, isa, memory_order_relaxed);
    return (enum cpu_isa)isa;
}

enum cpu_isa cpu_kernels_isa(void)
{
    int isa = atomic_load_explicit(&g_isa_active, memory_order_relaxed);
    if (isa >= 0)
        return (enum cpu_isa)isa;
    isa = cpu_kernels_detect_isa();
    atomic_store_explicit(&g_isa_active, isa, memory_order_relaxed);
    return (enum cpu_isa)isa;
}

enum cpu_isa cpu_kernels_force_isa(enum cpu_isa isa)
{
    enum cpu_isa best = cpu_kernels_detect_isa();
    if (isa > best)
        isa = best;
    atomic_store_explicit(&g_isa_active, (int)isa, memory_order_relaxed);
    return isa;
}

const char *cpu_isa_name(enum cpu_isa isa)
{
    switch (isa) {
    case CPU_ISA_SCALAR: return "scalar";
    case CPU_ISA_AVX2: return "avx2";
    case CPU_ISA_AVX512: return "avx512";
    }
    return "?";
}

/* ---------------------------------------------------------------------------
 * Portable versions (several partial sums so the compiler can pipeline) */

static float dot_scalar(const float *a, const float *b, int n)
{
    float s[4] = {0, 0, 0, 0};
    int i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++)
            s[j] += a[i + j] * b[i + j];
    for (; i < n; i++)
        s[0] += a[i] * b[i];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

static void axpy_scalar(float *y, float a, const float *x, int n)
{
    for (int i = 0; i < n; i++)
        y[i] += a * x[i];
}

static void scale_scalar(float *y, float a, int n)
{
    for (int i = 0; i < n; i++)
        y[i] *= a;
}

#ifdef VEC_X86

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma,avx2")))
#define AVX2_TARGET __attribute__((target("avx2,fma")))

AVX512_TARGET static float dot_avx512(const float *a, const float *b, int n)
{
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    for (; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

AVX512_TARGET static void axpy_avx512(float *y, float a, const float *x, int n)
{
    __m512 av = _mm512_set1_ps(a);
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m512 yv = _mm512_maskz_loadu_ps(m, y + i);
        _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x + i), yv));
    }
}

AVX512_TARGET static void scale_avx512(float *y, float a, int n)
{
    __m512 av = _mm512_set1_ps(a);
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(av, _mm512_maskz_loadu_ps(m, y + i)));
    }
}

AVX2_TARGET static float dot_avx2(const float *a, const float *b, int n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s0 = _mm256_add_ps(s0, s1);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float r = _mm_cvtss_f32(s);
    for (; i < n; i++)
        r += a[i] * b[i];
    return r;
}

AVX2_TARGET static void axpy_avx2(float *y, float a, const float *x, int n)
{
    __m256 av = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i,
                         _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] += a * x[i];
}

AVX2_TARGET static void scale_avx2(float *y, float a, int n)
{
    __m256 av = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(av, _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] *= a;
}

#endif /* VEC_X86 */

float cpu_vec_dot(const float *a, const float *b, int n)
{
#ifdef VEC_X86
    switch (cpu_kernels_isa()) {
    case CPU_ISA_AVX512: return dot_avx512(a, b, n);
    case CPU_ISA_AVX2: return dot_avx2(a, b, n);
    case CPU_ISA_SCALAR: break;
    }
#endif
    return dot_scalar(a, b, n);
}

float cpu_vec_sumsq(const float *a, int n)
{
    return cpu_vec_dot(a, a, n);
}

void cpu_vec_axpy(float *y, float a, const float *x, int n)
{
#ifdef VEC_X86
    switch (cpu_kernels_isa()) {
    case CPU_ISA_AVX512: axpy_avx512(y, a, x, n); return;
    case CPU_ISA_AVX2: axpy_avx2(y, a, x, n); return;
    case CPU_ISA_SCALAR: break;
    }
#endif
    axpy_scalar(y, a, x, n);
}

void cpu_vec_scale(float *y, float a, int n)
{
#ifdef VEC_X86
    switch (cpu_kernels_isa()) {
    case CPU_ISA_AVX512: scale_avx512(y, a, n); return;
    case CPU_ISA_AVX2: scale_avx2(y, a, n); return;
    case CPU_ISA_SCALAR: break;
    }
#endif
    scale_scalar(y, a, n);
}
