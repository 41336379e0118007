/* C-callable launchers of the CUDA kernels (one .cu per op) and the CUDA
 * backend's private entry points. Pointers are device memory. Launchers
 * return the launch error (cudaSuccess when the kernel was queued, or nothing
 * had to be done because a size is 0). A launcher given a shape it does not
 * support returns cudaErrorNotSupported without launching anything; the
 * backend checks shapes first with the *_unsupported functions, which say why
 * in one line, so the error it records names the op, the field and the value.
 *
 * Semantics are those of kernels/backend.h; only what differs is said here. */
#ifndef MOE_CUDA_OPS_H
#define MOE_CUDA_OPS_H

#include <stddef.h>
#include <stdint.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cudaSuccess when this binary holds kernel code the current device can run
 * (e.g. cudaErrorNoKernelImageForDevice on a GPU older than the build's
 * architectures). */
cudaError_t moe_cuda_probe(void);

/* ---- rmsnorm.cu ---- */

/* y[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)); x, y (n_rows, dim), w (dim).
 * y == x is allowed. One block per row. */
cudaError_t moe_cuda_rmsnorm(const float *x, const float *w, float *y, int n_rows, int dim,
                             float eps, cudaStream_t stream);
/* x += r, then y = rmsnorm(x) (y != x): the two ops in one launch. */
cudaError_t moe_cuda_add_rmsnorm(float *x, const float *r, const float *w, float *y, int n_rows,
                                 int dim, float eps, cudaStream_t stream);

/* ---- matmul.cu ---- */

/* Scratch bytes moe_cuda_matmul needs for `p` (bf16 copy of x for the
 * tensor-core path; 0 otherwise). */
size_t moe_cuda_matmul_scratch_bytes(const struct moe_matmul_params *p);

/* y = x W^T (+ y). f32 weights: cuBLAS SGEMM-class GEMM in f32 (no TF32).
 * bf16 weights with n_tok <= MOE_CUDA_GEMV_MAX_TOK: a GEMV kernel that reads
 * the bf16 weights once and multiplies f32 activations in f32 (the CPU's
 * math). bf16 weights with more tokens: x is split into bf16 hi + lo parts
 * in `scratch` and cuBLAS runs two bf16 GEMMs on tensor cores with f32
 * accumulation and output (x carried to ~2^-17 relative; see matmul.cu);
 * with p->fast (the backend clears it unless MOE_CUDA_FAST_GEMM=1) one GEMM
 * on bf16(x). On a cuBLAS failure returns cudaErrorUnknown and stores the cuBLAS status in
 * *blas_status. */
#define MOE_CUDA_GEMV_MAX_TOK 8
cudaError_t moe_cuda_matmul(cublasHandle_t blas, const struct moe_matmul_params *p, void *scratch,
                            size_t scratch_bytes, cudaStream_t stream, int *blas_status);
/* NULL when supported, else the reason (static string). */
const char *moe_cuda_matmul_unsupported(const struct moe_matmul_params *p);

/* ---- rope.cu ---- */

/* Largest d_head rope accepts. */
#define MOE_CUDA_ROPE_MAX_DHEAD 512
/* inv_freq: host memory, d_head / 2 frequencies; scale multiplies cos and sin. */
cudaError_t moe_cuda_rope(float *x, const int32_t *pos, int n_tok, int n_heads, int d_head,
                          const float *inv_freq, float scale, cudaStream_t stream);

/* ---- rope_kv.cu ---- */

/* Why p cannot run here (d_head odd or above MOE_CUDA_ROPE_MAX_DHEAD, another
 * cache type, biases or norms given for only some of q, k, v), or NULL. */
const char *moe_cuda_rope_kv_unsupported(const struct moe_rope_kv_params *p);
cudaError_t moe_cuda_rope_kv_write(const struct moe_rope_kv_params *p, cudaStream_t stream);

/* ---- kv_write.cu ---- */
/* v and v_cache NULL: K only (a latent cache). */

cudaError_t moe_cuda_kv_write(const float *k, const float *v, const int32_t *slots, int n_tok,
                              int kv_dim, float *k_cache, float *v_cache, cudaStream_t stream);
/* The same into bf16 caches (bits, rounded as common/dtype.h's moe_f32_to_bf16). */
cudaError_t moe_cuda_kv_write_bf16(const float *k, const float *v, const int32_t *slots, int n_tok,
                                   int kv_dim, uint16_t *k_cache, uint16_t *v_cache,
                                   cudaStream_t stream);

/* ---- attention.cu ---- */

/* NULL when supported, else the reason, written to why[cap]. Supported:
 * d_head in {16, 32, 64, 128, 256}, n_head a multiple of n_kv_head with at
 * most 16 query heads per KV head, block_size >= 1, max_blocks >= 1. */
const char *moe_cuda_attention_unsupported(const struct moe_attn_params *p, char *why, size_t cap);
size_t moe_cuda_attention_scratch_bytes(const struct moe_attn_params *p);
cudaError_t moe_cuda_attention(const struct moe_attn_params *p, void *scratch, size_t scratch_bytes,
                               cudaStream_t stream);

/* ---- attention_mla.cu ---- */
/* Latent attention (d_v < d_head): one KV head (n_kv_head 1) whose rows are
 * also V (v_cache == k_cache), d_head <= 1024, any number of query heads, f32
 * cache. NULL when supported, else the reason in why[cap]. */
const char *moe_cuda_attention_mla_unsupported(const struct moe_attn_params *p, char *why,
                                               size_t cap);
cudaError_t moe_cuda_attention_mla(const struct moe_attn_params *p, cudaStream_t stream);

/* ---- router.cu ---- */

#define MOE_CUDA_ROUTER_MAX_EXPERT 256
#define MOE_CUDA_ROUTER_MAX_TOPK 32
cudaError_t moe_cuda_router_topk(const float *logits, int n_tok, int n_expert, int top_k,
                                 bool renorm, int32_t *ids, float *weights, cudaStream_t stream);
/* Grouped sigmoid routing; p's arrays are device memory. */
#define MOE_CUDA_ROUTER_MAX_GROUPS 64
const char *moe_cuda_router_grouped_unsupported(const struct moe_router_grouped_params *p,
                                                char *why, size_t cap);
cudaError_t moe_cuda_router_topk_grouped(const struct moe_router_grouped_params *p,
                                         cudaStream_t stream);

/* ---- copy_cols.cu ---- */
cudaError_t moe_cuda_copy_cols(float *dst, int ld_dst, const float *src, int ld_src, int n_rows,
                               int n_cols, cudaStream_t stream);

/* ---- swiglu.cu ---- */

cudaError_t moe_cuda_swiglu(const float *gate_up, float *out, int n_rows, int dim,
                            cudaStream_t stream);

/* ---- gather_scatter.cu ---- */

cudaError_t moe_cuda_gather_rows(const float *src, const int32_t *idx, int n, int dim, float *dst,
                                 cudaStream_t stream);
/* scale may be NULL (all ones). */
cudaError_t moe_cuda_scatter_add_rows(const float *src, const int32_t *idx, const float *scale,
                                      int n, int dim, float *dst, cudaStream_t stream);

/* ---- embed.cu ---- */

cudaError_t moe_cuda_embed(const void *table, enum moe_dtype dtype, const int32_t *ids, int n_tok,
                           int dim, float *dst, cudaStream_t stream);

/* ---- add.cu ---- */

cudaError_t moe_cuda_add(float *y, const float *x, size_t n, cudaStream_t stream);

/* x[i] = 1 / (1 + expf(-x[i])) in place. */
cudaError_t moe_cuda_sigmoid(float *x, size_t n, cudaStream_t stream);

/* ---- grouped_matmul.cu ---- */

/* True when p takes the grouped GEMV (bf16 W, n_in > 0, at most
 * MOE_CUDA_GEMV_MAX_TOK rows per expert); other calls the backend runs as a
 * loop of moe_cuda_matmul over the experts with rows. */
bool moe_cuda_grouped_gemv_fits(const struct moe_grouped_matmul_params *p);
/* One launch for every expert with rows; the host arrays of p size the
 * launch, off_dev and w_dev (device copies of p->expert_offsets and p->w)
 * map the blocks. The caller has checked p (moe_grouped_matmul_check). */
cudaError_t moe_cuda_grouped_gemv(const struct moe_grouped_matmul_params *p, const int32_t *off_dev,
                                  const void *const *w_dev, cudaStream_t stream);

/* ---- grouped_mma.cu ---- */

/* Why p cannot take the tensor-core grouped GEMM (not bf16, no host pointer
 * array, a grid too large), or NULL. */
const char *moe_cuda_grouped_mma_unsupported(const struct moe_grouped_matmul_params *p);
/* One launch for every expert at any row count, on the tensor cores (WMMA
 * bf16, f32 accumulation); off_dev and w_dev map the blocks, and the launch
 * is sized from p's host offsets when it has them, else from n_rows and
 * n_expert alone (device-only offsets). split: x as bf16 hi + lo (the
 * two-GEMM numerics of moe_cuda_matmul); false: x rounded to bf16 (fast).
 * The caller has checked p (moe_grouped_matmul_check). */
cudaError_t moe_cuda_grouped_mma(const struct moe_grouped_matmul_params *p, const int32_t *off_dev,
                                 const void *const *w_dev, bool split, cudaStream_t stream);

/* ---- permute.cu ---- */

/* Why p cannot run here (top_k above 32, bad sizes, missing arrays), or NULL. */
const char *moe_cuda_permute_unsupported(const struct moe_permute_params *p);
/* keys (n_tok * top_k) and cursor (n_dest * n_expert) are device scratch;
 * *bad (device) is set to 1 if an id or a replica's rank is out of range. */
cudaError_t moe_cuda_permute(const struct moe_permute_params *p, int32_t *keys, int32_t *cursor,
                             int *bad, cudaStream_t stream);

/* ---- combine.cu ---- */

cudaError_t moe_cuda_unpermute_combine(const float *rows, const float *weights,
                                       const int32_t *tok_rows, int n_tok, int top_k, int dim,
                                       float *y, cudaStream_t stream);

/* ---- sample.cu ---- */

/* Largest vocabulary sample_top_p accepts (masses of 2^40 each sum below
 * 2^63). */
#define MOE_CUDA_SAMPLE_MAX_VOCAB (1 << 23)
cudaError_t moe_cuda_argmax(const float *logits, int n, int vocab, int32_t *out_ids,
                            cudaStream_t stream);
/* sample_top_p with every row's `temperature` and `top_p`, or, with temps
 * and top_ps (device arrays of n) given, sample_rows with each row's own.
 * uniform: device doubles (n). */
cudaError_t moe_cuda_sample(const float *logits, int n, int vocab, float temperature, float top_p,
                            const float *temps, const float *top_ps, const double *uniform,
                            int32_t *out_ids, cudaStream_t stream);

/* ---- kv_blocks.cu ---- */

cudaError_t moe_cuda_kv_gather_blocks(const float *k_cache, const float *v_cache,
                                      const int32_t *block_ids, int n, int block_size, int kv_dim,
                                      float *out, cudaStream_t stream);
cudaError_t moe_cuda_kv_scatter_blocks(const float *in, const int32_t *block_ids, int n,
                                       int block_size, int kv_dim, float *k_cache, float *v_cache,
                                       cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
