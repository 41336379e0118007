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

/* Dot-product extensions used by the fast matmul paths (matmul_dot.c), on
 * top of CPU_ISA_AVX512 only. A bit set. AMX runs the packed (prefill-sized)
 * tiles; the streaming (decode-sized) ones stay on AVX512-BF16 / VNNI, which
 * an AMX processor always has. */
enum cpu_feature {
    CPU_FEAT_AVX512_BF16 = 1 << 0, /* vdpbf16ps: bf16 pairs, f32 accumulation */
    CPU_FEAT_AVX512_VNNI = 1 << 1, /* vpdpbusd: u8 x s8 quads, i32 accumulation */
    CPU_FEAT_AMX_BF16 = 1 << 2,    /* tdpbf16ps: 16 x 16 f32 tiles from bf16 pairs */
    CPU_FEAT_AMX_INT8 = 1 << 3,    /* tdpbssd: 16 x 16 i32 tiles from s8 x s8 quads */
    /* Not an extension but a property, set on Intel processors with
     * AVX512-BF16: vdpbf16ps issues at a quarter of the rate of an f32 FMA
     * there (Emerald Rapids: 1.35 vs 5.5 G instructions/s a core, i.e. 86
     * against 175 GFLOP/s), so bf16 weights widened to f32 and FMA'd beat it.
     * Where it is set and AMX-BF16 is not, bf16 fast calls of
     * CPU_SLOW_DP_FMA_MIN_TOK+ tokens take the f32 FMA kernels; smaller ones
     * (a few rows, where the streaming vdpbf16ps tiles still win) keep
     * vdpbf16ps (cpu_matmul_dot_supported). MOE_CPU_ISA=avx512-bf16 /
     * avx512-dot clear it: vdpbf16ps then runs at every size. */
    CPU_FEAT_DPBF16_SLOW = 1 << 4,
    CPU_FEAT_AVX512_FP16 = 1 << 5, /* vfmadd231ph: 32 fp16 lanes at the f32 FMA's rate */
    CPU_FEAT_ALL = 0x3f,
};

/* With CPU_FEAT_DPBF16_SLOW (and no AMX-BF16), bf16 fast calls of this many
 * tokens on take the f32 FMA kernels. 8: the 16-row calls of a 16-sequence
 * decode step (lm_head, attention projections) and its busier experts run
 * faster there than on vdpbf16ps (Emerald Rapids, 2 threads, moe-generate
 * bf16 16 sequences, 5 alternated rounds: TPOT median 61.9 ms at 32, 60.3
 * at 8); 1-7 rows keep vdpbf16ps (4: no gain), or, with AVX512-FP16, 2-7
 * take the fp16 streaming tiles (CPU_PH_STREAM_MIN_TOK). */
#define CPU_SLOW_DP_FMA_MIN_TOK 8

/* ... and where the processor also has AVX512-FP16 (Sapphire / Emerald
 * Rapids with AMX hidden), bf16 fast calls of CPU_PH_MIN_TOK tokens on take
 * fp16 panels (matmul.c): each token's activations scaled by a power of two
 * to |x| <= 1 and the weights x 2^CPU_PH_STREAM_W_SHIFT, both in fp16 (the
 * streaming tiles' arithmetic, below), in column pairs; each vfmadd231ph
 * lane sums CPU_PH_SEG products in fp16 before they are added in f32 (its
 * rms error still under that of rounding the activations to bf16, as the
 * dot-product paths do: test_matmul_fast prints both); a panel with a weight
 * of CPU_PH_PANEL_MAX_W or more takes the f32 panels. 32 tokens: 512-token
 * prefill (experts of ~128 rows) 921 tok/s against 909 at 16 and 869 at 48
 * (with the earlier panels); a 16-sequence decode step (16-row calls) is
 * slower at 16 on the panels.
 * Calls of CPU_PH_STREAM_MIN_TOK .. CPU_PH_MIN_TOK - 1 tokens take fp16
 * streaming tiles there (matmul_dot.c: the same arithmetic, lanes over k,
 * each weight vector widened to fp16 once per 16 tokens; a row with a
 * weight of CPU_PH_MAX_W / 2^shift or more redone on vdpbf16ps): 16 tokens
 * 1.4-1.5x the f32 tiles (bench-kernels --fast, n_in 1024); 16-sequence
 * bf16 decode 244 -> 253 tok/s on 2 threads, 131 -> 139 on 1. */
#define CPU_PH_MIN_TOK 32
#define CPU_PH_SEG 64
#define CPU_PH_PANEL_MAX_W 32.0f
#define CPU_PH_MAX_W 1024.0f
/* The fp16 streaming tiles take their weights to fp16 by an integer
 * re-bias of the exponent that also scales them by 2^CPU_PH_STREAM_W_SHIFT
 * (4 instructions a vector where widening through f32 took 9): a weight
 * below 2^-(14 + shift) in magnitude is flushed (an error under that per
 * weight), and a row holding one of CPU_PH_MAX_W / 2^shift or more is
 * redone on vdpbf16ps. With tiles of several rows sharing the end-of-row
 * sums (2 x 8, 4 x 2..4), 8-16-token calls 1.1-1.3x the widening tiles
 * (cpu_matmul alone, 2 threads, weights from memory). */
#define CPU_PH_STREAM_W_SHIFT 4
/* The fp16 streaming tiles also take calls of CPU_PH_STREAM_MIN_TOK ..
 * CPU_SLOW_DP_FMA_MIN_TOK - 1 tokens there (the 2-7 rows of a decode step's
 * experts), where vdpbf16ps's quarter rate binds from ~5 rows: cpu_matmul
 * alone, 2 threads, 3-7 tokens 1.0-1.5x vdpbf16ps by shape; moe-generate
 * bf16, 2 threads, 3 alternated rounds: 16 sequences 292.6 -> 323.9 tok/s,
 * 8 sequences 185.6 -> 192.3 (at 3: level with 2). One token keeps
 * vdpbf16ps (its own tile, 1.1x the fp16 one). */
#define CPU_PH_STREAM_MIN_TOK 2

/* Features this processor (and OS) supports (cpuid, cached). */
unsigned cpu_kernels_detect_features(void);

/* Features the kernels use now: the detected ones (AVX512 ISA only) unless
 * forced. The first call also applies the MOE_CPU_ISA environment variable
 * (see cpu_kernels_env): benchmarks force a path with it. */
unsigned cpu_kernels_features(void);

/* Forces the feature set (masked to what the processor has); returns the set
 * in use. Process-wide; for tests and benchmarks. */
unsigned cpu_kernels_force_features(unsigned features);

/* MOE_CPU_ISA=auto|scalar|avx2|avx512|avx512-bf16|avx512-vnni|avx512-dot|amx
 * (avx512 alone: no dot-product extensions nor AVX512-FP16; the -bf16 / -vnni
 * forms: that one only; avx512-dot: both and AVX512-FP16, without AMX; amx:
 * everything), read
 * once by the first cpu_kernels_isa() / cpu_kernels_features() call and
 * clamped to what the processor has (a note on stderr says so). Unknown
 * values are reported on stderr and ignored. */
void cpu_kernels_env(void);

/* "avx512-bf16,avx512-vnni" etc. into buf; "none" for an empty set. */
const char *cpu_features_name(unsigned features, char *buf, size_t len);

/* What a fast-mode matmul of weight type `wt` runs on now: "amx-bf16" or
 * "amx-int8" (calls of at least 8 (bf16) / 16 (int8) tokens on AMX, fewer on
 * AVX-512),
 * "avx512-bf16", "avx512-vnni", "avx2-w8a8" (int8 on AVX2-only processors:
 * every call quantizes the activations and sums bytes exactly, bit for bit
 * avx512-vnni's results), "avx2-w4a8" (int4 on AVX2-only processors, calls
 * of fewer than 32 tokens or batch-invariant ones: the same quantized
 * activations, exact integer sums per 32-column block; larger calls take
 * the exact kernels),
 * or "f32-fma" (the exact kernels, used where the processor has no
 * dot-product path for that type). */
const char *cpu_matmul_fast_path(enum moe_dtype wt);

/* ---- matmul.c ---- */

/* Fast matmul (see struct moe_matmul_params): threads over output-row tiles
 * (and token tiles for large n_tok), SIMD per cpu_kernels_isa(). */
void cpu_matmul(struct moe_threadpool *pool, const struct moe_matmul_params *p);

/* Whether bf16 fast calls the dot-product paths decline (cpu_matmul_dot_supported) of
 * CPU_PH_MIN_TOK+ tokens take the fp16 panels: AVX512-FP16 on AVX-512, gcc builds. */
bool cpu_matmul_fp16_panels(void);

/* cpu_matmul on each of ps[0 .. n), all their tasks in one pool run (a
 * grouped GEMM's experts: no wait between them, and no core idle at the end
 * of each); the dot-product paths through cpu_matmul_dot_many. The calls
 * share p->fast and w_dtype. Each result is exactly what cpu_matmul gives it
 * alone (the same tiles). */
void cpu_matmul_many(struct moe_threadpool *pool, const struct moe_matmul_params *ps, int n);

/* In a pool run of several calls' tasks (call i's are [first[i],
 * first[i + 1]), first[0] = 0, n calls), the call that task belongs to: the
 * last i with first[i] <= task. */
static inline int cpu_task_owner(const int *first, int n, int task)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first[mid] <= task)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Plain one-thread reference: f32 accumulation, one dot product per output. */
void cpu_matmul_ref(const struct moe_matmul_params *p);

/* ---- matmul_dot.c: the fast paths (p->fast) ---- */

/* True when cpu_matmul would run p on a dot-product path (p->fast, AVX-512,
 * the feature for p->w_dtype in use). */
bool cpu_matmul_dot_supported(const struct moe_matmul_params *p);

/* BF16 weights: x rounded to bf16 (nearest even), vdpbf16ps (AMX tiles
 * from a few tokens where present), f32 sums.
 * I8 weights: each token row quantized to int8 with its own scale
 * (max|x| / 127), exact i32 sums of xq x q (vpdpbusd with a +128 offset on
 * one operand taken back exactly, or AMX tdpbssd), then scaled.
 * I4 weights: W4A8 (exact i32 sums per group, scaled per group), or from 8
 * tokens on AMX-BF16 the rows dequantized to bf16 through the BF16 tiles.
 * matmul_dot.c's top comment has the bounds. Caller checks
 * cpu_matmul_dot_supported. */
void cpu_matmul_dot(struct moe_threadpool *pool, const struct moe_matmul_params *p);

/* cpu_matmul_dot on each of ps[0 .. n), all their tasks in one pool run (a
 * grouped GEMM's experts: no wait between them, both cores streaming to the
 * end). Each result is exactly what cpu_matmul_dot gives it alone. */
void cpu_matmul_dot_many(struct moe_threadpool *pool, const struct moe_matmul_params *ps, int n);

/* ---- vec.c: small vector primitives with ISA dispatch ---- */

float cpu_vec_dot(const float *a, const float *b, int n);
/* dst[i] = f32 of src[i], exact; and its inverse, rounded to nearest even. */
void cpu_vec_from_bf16(float *dst, const uint16_t *src, int n);
void cpu_vec_to_bf16(uint16_t *dst, const float *src, int n);
float cpu_vec_sumsq(const float *a, int n);
void cpu_vec_axpy(float *y, float a, const float *x, int n); /* y += a x */
void cpu_vec_scale(float *y, float a, int n);                /* y *= a */
/* moe_host_argmax on a given ISA (clamped by the caller to one the
 * processor has): the tests compare every path with the scalar one. */
int32_t cpu_vec_argmax_isa(const float *x, int n, enum cpu_isa isa);

/* ---- norm.c ---- */

void cpu_rmsnorm(struct moe_threadpool *pool, const float *x, const float *w, float *y, int n_rows,
                 int dim, float eps);
void cpu_rope(struct moe_threadpool *pool, float *x, const int32_t *pos, int n_tok, int n_heads,
              int d_head, const float *inv_freq, float scale);
/* The backend's add_rmsnorm and rope_kv_write ops (kernels/backend.h). */
void cpu_add_rmsnorm(struct moe_threadpool *pool, float *x, const float *r, const float *w,
                     float *y, int n_rows, int dim, float eps);
void cpu_rope_kv_write(struct moe_threadpool *pool, const struct moe_rope_kv_params *p);

/* ---- attention.c ---- */

/* kv_dtype F32 or BF16 (rounded to nearest even); anything else asserts. */
void cpu_kv_write(const float *k, const float *v, const int32_t *slots, int n_tok, int kv_dim,
                  void *k_cache, void *v_cache, enum moe_dtype kv_dtype);
/* Tiled (FlashAttention-style) on AVX-512 with d_head <= 128, the
 * reference below otherwise. */
void cpu_attention(struct moe_threadpool *pool, const struct moe_attn_params *p);
/* One task per (token, head), scores one at a time: the plain twin. */
void cpu_attention_ref(struct moe_threadpool *pool, const struct moe_attn_params *p);

/* ---- attention_tiled.c ---- */

/* True when cpu_attention takes the tiled kernel for p (AVX-512 in use,
 * d_head <= 128, at most 64 query heads per KV head). */
bool cpu_attention_tiled_supported(const struct moe_attn_params *p);
void cpu_attention_tiled(struct moe_threadpool *pool, const struct moe_attn_params *p);
/* How many floats of widened BF16 K and V rows one call may hold (the
 * prefill chunks' copies, attention_tiled.c); returns the previous limit.
 * 0 turns the copies off (tests compare both ways). */
size_t cpu_attention_tiled_wide_limit(size_t floats);

/* ---- router.c ---- */

void cpu_router_topk(const float *logits, int n_tok, int n_expert, int top_k, bool renorm,
                     int32_t *ids, float *weights);
void cpu_router_topk_grouped(const struct moe_router_grouped_params *p);

/* ---- elementwise.c ---- */

void cpu_swiglu(struct moe_threadpool *pool, const float *gate_up, float *out, int n_rows, int dim);
void cpu_gather_rows(const float *src, const int32_t *idx, int n, int dim, float *dst);
/* scale may be NULL (all ones). */
void cpu_scatter_add_rows(const float *src, const int32_t *idx, const float *scale, int n, int dim,
                          float *dst);
void cpu_embed(const void *table, enum moe_dtype dtype, const int32_t *ids, int n_tok, int dim,
               float *dst);
void cpu_add(struct moe_threadpool *pool, float *y, const float *x, size_t n);
void cpu_copy_cols(float *dst, int ld_dst, const float *src, int ld_src, int n_rows, int n_cols);

/* ---- moe_ops.c: ops added for the GPU path (semantics in backend.h) ---- */

/* Checks grouped-matmul parameters against the host arrays (offsets
 * monotone from 0 to n_rows, weights for every expert with rows); shared by
 * the CPU and CUDA backends so both refuse the same calls. */
enum moe_status moe_grouped_matmul_check(const struct moe_grouped_matmul_params *p,
                                         struct moe_error *err);
/* Loops over the experts with rows calling cpu_matmul; computes nothing and
 * returns the error when moe_grouped_matmul_check fails. */
enum moe_status cpu_grouped_matmul(struct moe_threadpool *pool,
                                   const struct moe_grouped_matmul_params *p,
                                   struct moe_error *err);
/* struct moe_permute_params; `cursor` holds n_dest * n_expert entries of
 * scratch. top_k is at most 64. */
enum moe_status cpu_permute(const struct moe_permute_params *p, int32_t *cursor,
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
