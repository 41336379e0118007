/* The CPU kernels behind the CPU backend's ops table, and their plain
 * reference twins.
 *
 * Every op takes the thread pool explicitly (NULL: run on the calling thread).
 * SIMD code is chosen at run time from what the processor supports
 * (`cpu_kernels_isa`); tests force each path in turn with
 * `cpu_kernels_force_isa` so the AVX-512, AVX2 and portable paths are all
 * checked on one machine. Internal to kernels/ and its tests. */
#ifndef MOE_CPU_KERNELS_H
#define MOE_CPU_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "threadpool.h"

enum cpu_isa {
    CPU_ISA_SCALAR = 0, /* portable C */
    CPU_ISA_AVX2,       /* AVX2 + FMA */
    CPU_ISA_AVX512,     /* AVX-512 F + BW */
};

/* Best ISA this processor supports (cpuid, cached). */
enum cpu_isa cpu_kernels_detect_isa(void);

/* ISA the kernels use now: the detected one unless forced. */
enum cpu_isa cpu_kernels_isa(void);

/* Forces the kernels onto `isa` (clamped to what the processor supports) and
 * returns the ISA actually in use. Process-wide; for tests and benchmarks. */
enum cpu_isa cpu_kernels_force_isa(enum cpu_isa isa);

const char *cpu_isa_name(enum cpu_isa isa);

/* ---- matmul.c ---- */

/* Fast matmul (see struct moe_matmul_params): threads over output-row tiles
 * (and token tiles for large n_tok), SIMD per cpu_kernels_isa(). */
void cpu_matmul(struct moe_pool *pool, const struct moe_matmul_params *p);

/* Plain one-thread reference: f32 accumulation, one dot product per output. */
void cpu_matmul_ref(const struct moe_matmul_params *p);

/* ---- vec.c: small vector primitives with ISA dispatch ---- */

float cpu_vec_dot(const float *a, const float *b, int n);
float cpu_vec_sumsq(const float *a, int n);
void cpu_vec_axpy(float *y, float a, const float *x, int n); /* y += a x */
void cpu_vec_scale(float *y, float a, int n);                /* y *= a */

/* ---- norm.c ---- */

void cpu_rmsnorm(struct moe_pool *pool, const float *x, const float *w, float *y, int n_rows,
                 int dim, float eps);
void cpu_rope(struct moe_pool *pool, float *x, const int32_t *pos, int n_tok, int n_heads,
              int d_head, float theta);

/* ---- attention.c ---- */

void cpu_kv_write(const float *k, const float *v, const int32_t *slots, int n_tok, int kv_dim,
                  float *k_cache, float *v_cache);
void cpu_attention(struct moe_pool *pool, const struct moe_attn_params *p);

/* ---- router.c ---- */

void cpu_router_topk(const float *logits, int n_tok, int n_expert, int top_k, bool renorm,
                     int32_t *ids, float *weights);

/* ---- elementwise.c ---- */

void cpu_swiglu(struct moe_pool *pool, const float *gate_up, float *out, int n_rows, int dim);
void cpu_gather_rows(const float *src, const int32_t *idx, int n, int dim, float *dst);
/* scale may be NULL (all ones). */
void cpu_scatter_add_rows(const float *src, const int32_t *idx, const float *scale, int n,
                          int dim, float *dst);
void cpu_embed(const void *table, enum moe_dtype dtype, const int32_t *ids, int n_tok, int dim,
               float *dst);
void cpu_add(struct moe_pool *pool, float *y, const float *x, size_t n);

/* ---- backend_cpu.c ---- */

void cpu_backend_destroy(struct moe_backend *be);

#endif
