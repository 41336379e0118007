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
void cpu_scatter_add_rows(const float *src, const int32_t *idx, const float *scale, int n, int dim,
                          float *dst);
void cpu_embed(const void *table, enum moe_dtype dtype, const int32_t *ids, int n_tok, int dim,
               float *dst);
void cpu_add(struct moe_pool *pool, float *y, const float *x, size_t n);

/* ---- moe_ops.c: ops added for the GPU path (semantics in backend.h) ---- */

/* Checks grouped-matmul parameters against the host arrays (offsets
 * monotone from 0 to n_rows, weights for every expert with rows); shared by
 * the CPU and CUDA backends so both refuse the same calls. */
enum moe_status moe_grouped_matmul_check(const struct moe_grouped_matmul_params *p,
                                         struct moe_error *err);
/* Loops over the experts with rows calling cpu_matmul; computes nothing and
 * returns the error when moe_grouped_matmul_check fails. */
enum moe_status cpu_grouped_matmul(struct moe_pool *pool, const struct moe_grouped_matmul_params *p,
                                   struct moe_error *err);
void cpu_unpermute_combine(const float *rows, const float *weights, const int32_t *tok_rows,
                           int n_tok, int top_k, int dim, float *y);
int32_t cpu_argmax_row(const float *logits, int vocab);
void cpu_argmax(const float *logits, int n, int vocab, int32_t *out_ids);
/* Allocates vocab candidates of scratch per call (MOE_ERR_NOMEM on failure). */
enum moe_status cpu_sample_top_p(const float *logits, int n, int vocab, float temperature,
                                 float top_p, const double *uniform, int32_t *out_ids,
                                 struct moe_error *err);
void cpu_kv_gather_blocks(const float *k_cache, const float *v_cache, const int32_t *block_ids,
                          int n, int block_size, int kv_dim, float *out);
void cpu_kv_scatter_blocks(const float *in, const int32_t *block_ids, int n, int block_size,
                           int kv_dim, float *k_cache, float *v_cache);

/* ---- backend_cpu.c ---- */

void cpu_backend_destroy(struct moe_backend *be);

#endif
