/* Element-wise and row-moving ops: swiglu, gather/scatter of rows, embedding
 * lookup, add. */
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(__x86_64__)
#include "simd_x86.h"
#define EW_X86 1
#endif

#define PAR_MIN_ELEMS 32768

/* ---- swiglu: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)) as torch ---- */

struct swiglu_job {
    const float *gate_up;
    float *out;
    int n_rows, dim;
};

#ifdef EW_X86
/* The same formula, 16 lanes at a time, exp within ~2 ulp of expf (a large
 * -g gives exp = FLT_MAX-ish, so g / (1 + e) -> -0 as in torch; a large g gives
 * exp 0 and g; NaN stays NaN). */
MOE_AVX512_TARGET static void swiglu_row_avx512(const float *g, const float *u, float *o, int dim)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int i = 0; i < dim; i += 16) {
        __mmask16 m = dim - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (dim - i)) - 1u);
        __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
        __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, u + i)));
    }
}

/* The same on 8 lanes (exp_avx2 is exp_avx512 bit for bit, so the two ISAs
 * agree); the tail under a lane mask. */
MOE_AVX2_TARGET static void swiglu_row_avx2(const float *g, const float *u, float *o, int dim)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int i = 0; i < dim; i += 8) {
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(dim - i), lane);
        __m256 gv = _mm256_maskload_ps(g + i, m);
        __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_maskstore_ps(o + i, m, _mm256_mul_ps(silu, _mm256_maskload_ps(u + i, m)));
    }
    _mm256_zeroupper(); /* the caller is SSE code (see tile_avx2_packed, matmul.c) */
}
#endif

static void swiglu_row(const struct swiglu_job *j, int r)
{
    const float *g = j->gate_up + (size_t)r * 2 * j->dim;
    const float *u = g + j->dim;
    float *o = j->out + (size_t)r * j->dim;
#ifdef EW_X86
    if (cpu_kernels_isa() == CPU_ISA_AVX512) {
        swiglu_row_avx512(g, u, o, j->dim);
        return;
    }
    if (cpu_kernels_isa() == CPU_ISA_AVX2) {
        swiglu_row_avx2(g, u, o, j->dim);
        return;
    }
#endif
    for (int i = 0; i < j->dim; i++)
        o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void swiglu_task(void *arg, int task, int thread)
{
    swiglu_row(arg, task);
}

void cpu_swiglu(struct moe_threadpool *pool, const float *gate_up, float *out, int n_rows, int dim)
{
    struct swiglu_job j = {gate_up, out, n_rows, dim};
    if ((size_t)n_rows * dim < PAR_MIN_ELEMS / 4 || moe_threadpool_size(pool) == 1) {
        for (int r = 0; r < n_rows; r++)
            swiglu_row(&j, r);
        return;
    }
    moe_threadpool_run(pool, n_rows, swiglu_task, &j);
}

/* ---- rows ---- */

void cpu_gather_rows(const float *src, const int32_t *idx, int n, int dim, float *dst)
{
    for (int i = 0; i < n; i++)
        memcpy(dst + (size_t)i * dim, src + (size_t)idx[i] * dim, (size_t)dim * sizeof(float));
}

void cpu_scatter_add_rows(const float *src, const int32_t *idx, const float *scale, int n, int dim,
                          float *dst)
{
    for (int i = 0; i < n; i++) {
        float a = scale ? scale[i] : 1.0f;
        float *d = dst + (size_t)idx[i] * dim;
        const float *s = src + (size_t)i * dim;
        for (int k = 0; k < dim; k++)
            d[k] += a * s[k];
    }
}

void cpu_embed(const void *table, enum moe_dtype dtype, const int32_t *ids, int n_tok, int dim,
               float *dst)
{
    for (int t = 0; t < n_tok; t++) {
        float *d = dst + (size_t)t * dim;
        size_t row = (size_t)ids[t] * dim;
        switch (dtype) {
        case MOE_DTYPE_F32:
            memcpy(d, (const float *)table + row, (size_t)dim * sizeof(float));
            break;
        case MOE_DTYPE_BF16: {
            const uint16_t *s = (const uint16_t *)table + row;
            for (int i = 0; i < dim; i++)
                d[i] = moe_bf16_to_f32(s[i]);
            break;
        }
        case MOE_DTYPE_F16: {
            const uint16_t *s = (const uint16_t *)table + row;
            for (int i = 0; i < dim; i++)
                d[i] = moe_f16_to_f32(s[i]);
            break;
        }
        case MOE_DTYPE_I8: /* the model keeps embedding tables in f32/bf16, never quantized */
        case MOE_DTYPE_I4: MOE_ASSERT(0 && "cpu_embed: quantized embedding table"); break;
        }
    }
}

/* ---- add ---- */

struct add_job {
    float *y;
    const float *x;
    size_t n, per_task;
};

static void add_task(void *arg, int task, int thread)
{
    const struct add_job *j = arg;
    size_t i0 = (size_t)task * j->per_task;
    size_t i1 = i0 + j->per_task < j->n ? i0 + j->per_task : j->n;
    for (size_t i = i0; i < i1; i++)
        j->y[i] += j->x[i];
}

void cpu_add(struct moe_threadpool *pool, float *y, const float *x, size_t n)
{
    struct add_job j = {y, x, n, n};
    if (n < 4 * PAR_MIN_ELEMS || moe_threadpool_size(pool) == 1) {
        add_task(&j, 0, 0);
        return;
    }
    j.per_task = PAR_MIN_ELEMS;
    moe_threadpool_run(pool, (int)((n + j.per_task - 1) / j.per_task), add_task, &j);
}

void cpu_copy_cols(float *dst, int ld_dst, const float *src, int ld_src, int n_rows, int n_cols)
{
    for (int r = 0; r < n_rows; r++)
        memcpy(dst + (size_t)r * ld_dst, src + (size_t)r * ld_src, (size_t)n_cols * sizeof *dst);
}
