/* Run-time ISA selection and the small vector primitives (dot, sum of
 * squares, axpy, scale) used by attention and rmsnorm. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <errno.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd_x86.h"
#define VEC_X86 1
#endif

/* ---------------------------------------------------------------------------
 * ISA selection */

static _Atomic int g_isa_detected = -1;
static _Atomic int g_isa_active = -1;
static _Atomic int g_feat_detected = -1;
static _Atomic int g_feat_active = -1;

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

#ifdef VEC_X86
/* Linux hands out the AMX tile data state (8 KB of XSAVE area) only to a
 * process that asks: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
 * process-wide and for every thread. Refused (ENOSPC) when some thread's
 * sigaltstack is too small for the larger signal frame (sanitizer runtimes
 * install small ones): the kernels then run without AMX, and say so. */
static bool amx_permission(void)
{
    const long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
    if (syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0)
        return true;
    fprintf(stderr,
            "moe: AMX present but the kernel refused its tile state (arch_prctl: %s); "
            "using AVX-512 only\n",
            strerror(errno));
    return false;
}
#endif

unsigned cpu_kernels_detect_features(void)
{
    int f = atomic_load_explicit(&g_feat_detected, memory_order_relaxed);
    if (f >= 0)
        return (unsigned)f;
    f = 0;
#ifdef VEC_X86
    /* libgcc's checks include the OS saving the AVX-512 state (XCR0). */
    if (cpu_kernels_detect_isa() == CPU_ISA_AVX512) {
        unsigned a, b, c, d;
        if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
            if (c & (1u << 11))
                f |= CPU_FEAT_AVX512_VNNI;
            if (d & (1u << 23))
                f |= CPU_FEAT_AVX512_FP16;
            /* AMX: tile + bf16 / int8, the OS enabling the tile state
             * (XCR0 bits 17, 18), and this process allowed to use it
             * (amx_permission). */
            unsigned lo = 0, hi = 0;
            if (c & (1u << 27)) /* OSXSAVE */
                __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
            bool tiles = (d & (1u << 24)) && (lo & (3u << 17)) == (3u << 17);
            if (tiles && (d & (1u << 22 | 1u << 25)) && amx_permission()) {
                if (d & (1u << 22))
                    f |= CPU_FEAT_AMX_BF16;
                if (d & (1u << 25))
                    f |= CPU_FEAT_AMX_INT8;
            }
        }
        if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5))) {
            f |= CPU_FEAT_AVX512_BF16;
            /* vendor "GenuineIntel" (ebx, edx, ecx of leaf 0) */
            if (__get_cpuid(0, &a, &b, &c, &d) && b == 0x756e6547u && d == 0x49656e69u &&
                c == 0x6c65746eu)
                f |= CPU_FEAT_DPBF16_SLOW;
        }
    }
#endif
    atomic_store_explicit(&g_feat_detected, f, memory_order_relaxed);
    return (unsigned)f;
}

/* Applies MOE_CPU_ISA (both the ISA and the feature set); run once, by
 * apply_env_once. */
static void apply_env(void)
{
    int isa = cpu_kernels_detect_isa();
    int feat = (int)cpu_kernels_detect_features();
    const char *e = getenv("MOE_CPU_ISA");
    if (e && *e && strcmp(e, "auto") != 0) {
        static const struct {
            const char *name;
            enum cpu_isa isa;
            unsigned feat;
        } forms[] = {
            {"scalar", CPU_ISA_SCALAR, 0},
            {"avx2", CPU_ISA_AVX2, 0},
            {"avx512", CPU_ISA_AVX512, 0},
            {"avx512-bf16", CPU_ISA_AVX512, CPU_FEAT_AVX512_BF16},
            {"avx512-vnni", CPU_ISA_AVX512, CPU_FEAT_AVX512_VNNI},
            {"avx512-dot", CPU_ISA_AVX512,
             CPU_FEAT_AVX512_BF16 | CPU_FEAT_AVX512_VNNI | CPU_FEAT_AVX512_FP16},
            {"amx", CPU_ISA_AVX512, CPU_FEAT_ALL},
        };
        size_t i = 0;
        while (i < sizeof forms / sizeof forms[0] && strcmp(e, forms[i].name) != 0)
            i++;
        if (i == sizeof forms / sizeof forms[0]) {
            fprintf(stderr,
                    "moe: MOE_CPU_ISA='%s' is not one of auto, scalar, avx2, avx512, avx512-bf16, "
                    "avx512-vnni, avx512-dot, amx; ignored\n",
                    e);
        } else {
            int want_isa = (int)forms[i].isa;
            int want_feat = (int)forms[i].feat;
            if (want_isa > isa || (want_feat & ~feat))
                fprintf(stderr, "moe: MOE_CPU_ISA=%s: this processor lacks it; using what it has\n",
                        e);
            isa = want_isa < isa ? want_isa : isa;
            feat &= want_feat;
        }
    }
    if (isa != CPU_ISA_AVX512)
        feat = 0;
    int unset = -1;
    atomic_compare_exchange_strong(&g_isa_active, &unset, isa);
    unset = -1;
    atomic_compare_exchange_strong(&g_feat_active, &unset, feat);
}

/* Every caller returns only after apply_env has finished: the first use is
 * often inside a pool run, where a thread that saw "already started" and
 * went on with the ISA still unset would compute that task with the scalar
 * kernels (another summation order: results then differed run to run in the
 * last bits). */
static void apply_env_once(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, apply_env);
}

void cpu_kernels_env(void)
{
    apply_env_once();
}

enum cpu_isa cpu_kernels_isa(void)
{
    int isa = atomic_load_explicit(&g_isa_active, memory_order_relaxed);
    if (isa >= 0)
        return (enum cpu_isa)isa;
    apply_env_once();
    return (enum cpu_isa)atomic_load_explicit(&g_isa_active, memory_order_relaxed);
}

unsigned cpu_kernels_features(void)
{
    int f = atomic_load_explicit(&g_feat_active, memory_order_relaxed);
    if (f >= 0)
        return (unsigned)f;
    apply_env_once();
    return (unsigned)atomic_load_explicit(&g_feat_active, memory_order_relaxed);
}

enum cpu_isa cpu_kernels_force_isa(enum cpu_isa isa)
{
    apply_env_once(); /* a later first use must not undo this */
    enum cpu_isa best = cpu_kernels_detect_isa();
    if (isa > best)
        isa = best;
    atomic_store_explicit(&g_isa_active, (int)isa, memory_order_relaxed);
    return isa;
}

unsigned cpu_kernels_force_features(unsigned features)
{
    apply_env_once();
    features &= cpu_kernels_detect_features();
    atomic_store_explicit(&g_feat_active, (int)features, memory_order_relaxed);
    return features;
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

const char *cpu_features_name(unsigned features, char *buf, size_t len)
{
    static const struct {
        unsigned bit;
        const char *name;
    } names[] = {{CPU_FEAT_AVX512_BF16, "avx512-bf16"},    {CPU_FEAT_AVX512_VNNI, "avx512-vnni"},
                 {CPU_FEAT_AMX_BF16, "amx-bf16"},          {CPU_FEAT_AMX_INT8, "amx-int8"},
                 {CPU_FEAT_DPBF16_SLOW, "slow-vdpbf16ps"}, {CPU_FEAT_AVX512_FP16, "avx512-fp16"}};
    size_t at = 0;
    if (len)
        buf[0] = '\0';
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (!(features & names[i].bit))
            continue;
        int n = snprintf(buf + at, len > at ? len - at : 0, "%s%s", at ? "," : "", names[i].name);
        at += n > 0 ? (size_t)n : 0;
    }
    if (!at && len)
        snprintf(buf, len, "none");
    return buf;
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

#define AVX512_TARGET MOE_AVX512_TARGET
#define AVX2_TARGET MOE_AVX2_TARGET

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

/* bf16 <-> f32, bit for bit the scalar moe_bf16_to_f32 / moe_f32_to_bf16
 * (dtype.h): widening is a shift; narrowing rounds to nearest even and
 * keeps a NaN a (quiet) NaN. */
AVX512_TARGET static void from_bf16_avx512(float *dst, const uint16_t *src, int n)
{
    bf16_to_f32_avx512(dst, src, n);
}

AVX512_TARGET static void to_bf16_avx512(uint16_t *dst, const float *src, int n)
{
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(m, src + i));
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, odd)), 16);
        __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        r = _mm512_mask_mov_epi32(r, nan, q);
        _mm256_mask_storeu_epi16(dst + i, m, _mm512_cvtepi32_epi16(r));
    }
}

/* argmax in two passes: the maximum over the non-NaN elements (several
 * accumulators, no dependency on an index), then the first index holding
 * it. The same answer as the scalar loop `if (x[i] > x[best]) best = i`,
 * NaNs and signed zeros included (callers check x[0] for NaN first). */
AVX512_TARGET static int32_t argmax_avx512(const float *x, int n)
{
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    int i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        __m512 c = _mm512_loadu_ps(x + i + 32), d = _mm512_loadu_ps(x + i + 48);
        m0 = _mm512_mask_max_ps(m0, _mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), m0, a);
        m1 = _mm512_mask_max_ps(m1, _mm512_cmp_ps_mask(b, b, _CMP_ORD_Q), m1, b);
        m2 = _mm512_mask_max_ps(m2, _mm512_cmp_ps_mask(c, c, _CMP_ORD_Q), m2, c);
        m3 = _mm512_mask_max_ps(m3, _mm512_cmp_ps_mask(d, d, _CMP_ORD_Q), m3, d);
    }
    for (; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m512 a = _mm512_maskz_loadu_ps(m, x + i);
        m0 = _mm512_mask_max_ps(m0, m & _mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), m0, a);
    }
    float best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
    __m512 bv = _mm512_set1_ps(best);
    for (i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __mmask16 eq = m & _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(m, x + i), bv, _CMP_EQ_OQ);
        if (eq)
            return i + __builtin_ctz(eq);
    }
    return 0; /* every element NaN but x[0] handled by the caller: unreachable */
}

AVX2_TARGET static int32_t argmax_avx2(const float *x, int n)
{
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 m0 = ninf, m1 = ninf;
    int i = 0;
    /* max_ps(v, acc) returns acc when v is NaN: NaNs are skipped */
    for (; i + 16 <= n; i += 16) {
        m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
        m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
    }
    m0 = _mm256_max_ps(m0, m1);
    float lanes[8];
    _mm256_storeu_ps(lanes, m0);
    float best = lanes[0];
    for (int j = 1; j < 8; j++)
        best = lanes[j] > best ? lanes[j] : best;
    for (; i < n; i++)
        best = x[i] > best ? x[i] : best;
    __m256 bv = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n; i += 8) {
        int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), bv, _CMP_EQ_OQ));
        if (eq)
            return i + __builtin_ctz((unsigned)eq);
    }
    for (; i < n; i++)
        if (x[i] == best)
            return i;
    return 0;
}

#endif /* VEC_X86 */

void cpu_vec_from_bf16(float *dst, const uint16_t *src, int n)
{
#ifdef VEC_X86
    if (cpu_kernels_isa() == CPU_ISA_AVX512) {
        from_bf16_avx512(dst, src, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++)
        dst[i] = moe_bf16_to_f32(src[i]);
}

void cpu_vec_to_bf16(uint16_t *dst, const float *src, int n)
{
#ifdef VEC_X86
    if (cpu_kernels_isa() == CPU_ISA_AVX512) {
        to_bf16_avx512(dst, src, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++)
        dst[i] = moe_f32_to_bf16(src[i]);
}

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

static int32_t argmax_scalar(const float *x, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

int32_t cpu_vec_argmax_isa(const float *x, int n, enum cpu_isa isa)
{
    if (n <= 1 || isnan(x[0]))
        return 0; /* the scalar loop never moves off a NaN at 0 */
#ifdef VEC_X86
    switch (isa) {
    case CPU_ISA_AVX512: return argmax_avx512(x, n);
    case CPU_ISA_AVX2: return argmax_avx2(x, n);
    case CPU_ISA_SCALAR: break;
    }
#else
    (void)isa;
#endif
    return argmax_scalar(x, n);
}

int32_t moe_host_argmax(const float *x, int n)
{
    return cpu_vec_argmax_isa(x, n, cpu_kernels_isa());
}
