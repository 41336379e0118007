/* The table of operations a compute backend provides.
 *
 * The CPU backend (kernels/cpu) is always built and is the reference; the
 * CUDA backend (kernels/cuda) fills the same table and is checked op by op
 * against it. Model code touches tensor memory only through `buf_*` and the
 * ops, so the same forward pass runs on either device.
 *
 * Conventions (one glossary everywhere):
 *   n_tok rows of activations, row-major, f32 unless said otherwise;
 *   weights are Hugging Face Linear layout W (n_out, n_in), f32 or bf16, or
 *   int8 with one f32 scale per output row, or 4-bit with one f32 scale per
 *   group of columns (both CPU only; common/quant.h);
 *   y = x W^T, accumulated in f32.
 * Plain parameter structs cross the interface (pointers, shapes, strides),
 * so adding a field does not change every call site. */
#ifndef MOE_BACKEND_H
#define MOE_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "moe_error.h"

enum moe_device {
    MOE_DEVICE_CPU = 0,
    MOE_DEVICE_CUDA,
};

/* y (n_tok, n_out) = x (n_tok, n_in) . W^T, W (n_out, n_in) with row stride
 * `ldw` elements (>= n_in; lets a rank use a column slice in place).
 * With `accumulate`, y += x W^T. */
struct moe_matmul_params {
    const float *x;
    int n_tok;
    int n_in;
    const void *w;
    enum moe_dtype w_dtype; /* F32, BF16, I8 or I4 (I8, I4: the CPU backend only) */
    int64_t ldw;
    int n_out;
    float *y;
    bool accumulate;
    /* I8: (n_out) row scales, W[o] = q[o] * w_scale[o]. I4: (n_out, ldw /
     * w_group) group scales, W[o][k] = (u - 8) * w_scale[o * (ldw / w_group)
     * + k / w_group], codes laid out as common/quant.h says (ldw and n_in
     * multiples of w_group). Else NULL. */
    const float *w_scale;
    int w_group; /* I4: columns per scale (32, 64 or 128); else unused */
    /* false (the default): x stays f32 all the way, the exact path the
     * golden tests hold to transformers. true: the backend may round x to
     * bf16 (BF16 weights) or quantize each row of x to int8 with its own
     * scale (I8 weights) to use dot-product instructions, with the error
     * bounds documented in kernels/cpu/matmul_dot.c; a backend or processor
     * without such a path computes exactly. CUDA honours it where
     * MOE_CUDA_FAST_GEMM=1 (one tensor-core GEMM on bf16 x instead of the
     * hi + lo split; opt-in until a GPU has run it). */
    bool fast;
    /* true: every row of y is computed by the same arithmetic in the same
     * order whatever n_tok is, so a token's result does not depend on the
     * batch it shares a call with (the CPU backend then skips its paths
     * chosen by token count: the packed prefill panels, the split
     * accumulators of one-token decode, and the bf16 / int4 dot paths, whose
     * fast mode computes exactly instead; the int8 dot paths sum integers
     * exactly and stay). false (the default): the fastest path for the
     * call's n_tok, whose last bits may differ with it. The CUDA backend
     * does not honour it yet (its bf16 GEMV / cuBLAS choice is by n_tok):
     * moe_launch_start refuses the pair. */
    bool batch_invariant;
};

/* Element types a KV cache may hold (struct moe_kv_cache.dtype): F32, or
 * BF16 (the CPU backend only: K and V rounded to nearest even on write, read
 * back exactly as f32 by attention; half the bytes per token). */
static inline bool moe_kv_dtype_valid(enum moe_dtype t)
{
    return t == MOE_DTYPE_F32 || t == MOE_DTYPE_BF16;
}

/* Causal grouped-query attention over a paged KV cache.
 * Token t belongs to sequence tok_seq[t] and sits at position tok_pos[t]; it
 * attends to positions 0..tok_pos[t] of its sequence, whose K/V live in the
 * cache at slot block_table[seq][p / block_size] * block_size + p % block_size.
 * The K/V of the current tokens must already be written (kv_write).
 * Query head h uses KV head h / (n_head / n_kv_head). */
struct moe_attn_params {
    const float *q;              /* (n_tok, n_head, d_head) */
    float *out;                  /* (n_tok, n_head, d_head) */
    const void *k_cache;         /* (n_slot, n_kv_head, d_head) of kv_dtype, this layer */
    const void *v_cache;         /* (n_slot, n_kv_head, d_head) of kv_dtype, this layer */
    enum moe_dtype kv_dtype;     /* F32 (0, the default) or BF16 (moe_kv_dtype_valid) */
    const int32_t *tok_seq;      /* (n_tok) */
    const int32_t *tok_pos;      /* (n_tok) */
    const int32_t *block_tables; /* (n_seq, max_blocks): block ids, row per sequence */
    int max_blocks;              /* row stride of block_tables */
    int n_tok;
    int n_head;
    int n_kv_head;
    int d_head;
    int block_size;
    float scale; /* usually 1/sqrt(d_head) */
    /* 0 (the default): V rows are d_head wide like K. Else the output takes
     * only the first d_v (<= d_head) elements of each V row and `out` is
     * (n_tok, n_head, d_v): multi-head latent attention, whose one cache row
     * is K whole and, in its first kv_lora_rank elements, V (v_cache ==
     * k_cache). CPU backend only. */
    int d_v;
    /* The model's fast mode (moe_model_opts.fast): the backend may round q
     * and the softmax probabilities to bf16 for its matrix units (the CPU
     * backend does, on AMX, over a BF16 cache) or sum P V in fp16 a chunk
     * of keys at a time (AVX512-FP16 without AMX, calls that take the
     * generic AVX-512 tiles: prefill); false: f32 arithmetic. */
    bool fast;
    /* As in struct moe_matmul_params: true keeps a token's result
     * independent of the batch it is in, so the CPU backend does not take
     * its fp16 P V (chosen by call shape) and computes in f32. */
    bool batch_invariant;
};

/* Grouped expert GEMM: for every expert e with rows,
 *   y[off[e] .. off[e+1]) = x[off[e] .. off[e+1]) . W_e^T (+ y),
 * x (n_rows, n_in) already permuted so the rows of expert e are contiguous,
 * W_e (n_out, n_in) with row stride ldw, y (n_rows, n_out); f32 accumulation.
 * Experts with no rows are skipped (their weight pointer may be NULL); an
 * expert with rows and a NULL weight pointer is an error: the op records it
 * (see `status`) and computes nothing. The host arrays normally come with
 * the call (the backend checks them and sizes the launch from them); the
 * device copies are optional: NULL makes the backend copy the host arrays
 * itself on every call (which a CUDA graph capture cannot contain).
 * Device-only offsets: expert_offsets NULL, expert_offsets_dev and w_dev
 * given, every expert's weights given, and max_expert_rows bounding every
 * expert's rows (the host never reads the offsets, so routing needs no
 * download and a graph can capture the call); a backend takes bounds up to
 * its grouped_device_rows op and records an error for a larger one. */
struct moe_grouped_matmul_params {
    const float *x; /* (n_rows, n_in), rows grouped by expert */
    int n_rows;
    int n_in;
    int n_out;
    int n_expert;
    const int32_t *expert_offsets;     /* host (n_expert + 1): off[0] = 0, off[n_expert] = n_rows;
                                        * NULL: device-only offsets (above) */
    const int32_t *expert_offsets_dev; /* backend memory copy of expert_offsets, or NULL */
    int max_expert_rows;               /* device-only offsets: rows of any one expert, at most */
    const void *const *w;     /* host (n_expert): backend pointers to W_e, NULL if not held */
    const void *const *w_dev; /* backend memory copy of the pointer array `w`, or NULL */
    enum moe_dtype w_dtype;   /* F32, BF16, I8 or I4 (I8, I4: the CPU backend only) */
    int64_t ldw;              /* >= n_in */
    float *y;                 /* (n_rows, n_out) */
    bool accumulate;
    /* I8 / I4: host (n_expert) pointers to each expert's scales (as in
     * struct moe_matmul_params), NULL where the expert is not held; NULL for
     * F32 and BF16. */
    const float *const *w_scale;
    int w_group;          /* I4: as in struct moe_matmul_params */
    bool fast;            /* as in struct moe_matmul_params */
    bool batch_invariant; /* as in struct moe_matmul_params */
};

/* The attention block's step between its fused QKV projection and attention
 * (op rope_kv_write), per token t: from the row qkv[t] = [q | k | v] (widths
 * n_head d_head, n_kv_head d_head, n_kv_head d_head), q and k each get
 * their bias (bq, bk, bv; NULL: none), then (q_norm, k_norm; NULL: none)
 * each head's RMSNorm over d_head with weights of d_head, then RoPE (as the
 * rope op: pos, inv_freq, scale); q goes to q_out (n_tok, n_head d_head),
 * k and v to the caches at slots[t] (as kv_write). The same values, bit for
 * bit on the CPU, as copy_cols, the bias matmuls, rmsnorm, rope and kv_write
 * in that order: one op where those were up to eight. */
struct moe_rope_kv_params {
    const float *qkv;
    int n_tok;
    int n_head;
    int n_kv_head;
    int d_head;
    const float *bq, *bk, *bv;    /* (n_head d_head), (n_kv_head d_head) x 2, or NULL */
    const float *q_norm, *k_norm; /* (d_head) each, or NULL */
    float eps;                    /* the norms' */
    const int32_t *pos;           /* (n_tok) */
    const float *inv_freq;        /* host memory, d_head / 2 frequencies */
    float scale;                  /* multiplies cos and sin */
    float *q_out;                 /* (n_tok, n_head d_head) */
    const int32_t *slots;         /* (n_tok) */
    void *k_cache, *v_cache;      /* (n_slot, n_kv_head d_head) of kv_dtype */
    enum moe_dtype kv_dtype;
};

/* DeepSeek-V3 routing, as transformers' DeepseekV3TopkRouter computes it,
 * per token: s = sigmoid(logits) (f32); the choice uses c = s + bias: each of
 * n_group equal groups of experts scores the sum of its two largest c, the
 * topk_group best groups are kept (ties to the lower group), and the top_k
 * largest c among their experts are chosen (ties to the lower id), ids in
 * that order; weights[k] = s[ids[k]], divided by (their sum + 1e-20) with
 * `renorm`, then multiplied by `scale` (routed_scaling_factor). */
struct moe_router_grouped_params {
    const float *logits; /* (n_tok, n_expert) */
    const float *bias;   /* (n_expert): e_score_correction_bias */
    int n_tok;
    int n_expert;
    int top_k;
    int n_group;
    int topk_group;
    bool renorm;
    float scale;
    int32_t *ids;   /* (n_tok, top_k) */
    float *weights; /* (n_tok, top_k) */
};

/* Routing's permutation, the step between the router and the grouped
 * expert GEMM (ARCHITECTURE.md section 3). The n_tok * top_k items of a
 * shard, item i = t * top_k + j (token t, its j-th choice e = ids[i]), each
 * computed on rank dest = 0 when `ranks` is NULL, else
 *   dest = ranks[e * rank_stride + (token_base + t) % n_ranks[e]]
 * (the placement's replicas of e, picked by the token's row in the whole
 * batch, as moe_placement_pick does), are counting-sorted by
 * key = dest * n_expert + e, stably (within a key, by item index, so by
 * token). Sorted position q holds item_tok[q] (its token, 0..n_tok),
 * item_exp[q] (its expert) and item_w[q] = weights[i]; the positions of
 * token t's items, listed by ascending expert id (the order
 * unpermute_combine sums in), are tok_rows[t * top_k .. + top_k); key k's
 * items are the positions offsets[k] .. offsets[k + 1) (n_dest * n_expert
 * + 1 entries). Integer work only: every backend gives the same arrays.
 * With top_k 1 and no weights this sorts rows by expert: item_tok is the
 * permutation (sorted -> original) and tok_rows its inverse. Every output
 * but tok_rows and offsets may be NULL (not written); ids outside
 * [0, n_expert) are recorded as an error (see `status`). */
struct moe_permute_params {
    const int32_t *ids;   /* (n_tok, top_k) */
    const float *weights; /* (n_tok, top_k), or NULL */
    int n_tok;
    int top_k;
    int n_expert;
    int n_dest;             /* ranks the items go to (1 without `ranks`) */
    const int32_t *ranks;   /* (n_expert, rank_stride) replicas' ranks, or NULL */
    const int32_t *n_ranks; /* (n_expert) replicas of each expert (>= 1) */
    int rank_stride;
    int token_base;    /* the shard's first row in the whole batch */
    int32_t *item_tok; /* (n_tok * top_k) */
    int32_t *item_exp; /* (n_tok * top_k) */
    float *item_w;     /* (n_tok * top_k) */
    int32_t *tok_rows; /* (n_tok, top_k) */
    int32_t *offsets;  /* (n_dest * n_expert + 1) */
};

/* What a backend was asked to do since it was made (the `counters` op):
 * ops queued (each one kernel launch or more, or a cuBLAS call), host waits
 * (stream synchronisations: synchronize, and the copies and frees that
 * wait), and copies between host and backend memory. */
struct moe_backend_counters {
    uint64_t ops;
    uint64_t syncs;
    uint64_t uploads, upload_bytes;
    uint64_t downloads, download_bytes;
};

struct moe_backend;

struct moe_backend_ops {
    /* Memory. CPU: host memory; CUDA: device memory. alloc returns NULL on
     * failure; memory from alloc is zeroed. */
    void *(*buf_alloc)(struct moe_backend *be, size_t bytes);
    void (*buf_free)(struct moe_backend *be, void *p);
    void (*buf_upload)(struct moe_backend *be, void *dst, const void *src_host, size_t bytes);
    void (*buf_download)(struct moe_backend *be, void *dst_host, const void *src, size_t bytes);
    /* Backend memory to backend memory, queued like an op (CUDA: async on
     * the backend's stream; synchronize before another stream reads it). */
    void (*buf_copy)(struct moe_backend *be, void *dst, const void *src, size_t bytes);
    void (*synchronize)(struct moe_backend *be);

    void (*matmul)(struct moe_backend *be, const struct moe_matmul_params *p);

    /* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for n_rows rows of dim.
     * In place is allowed (y == x). */
    void (*rmsnorm)(struct moe_backend *be, const float *x, const float *w, float *y, int n_rows,
                    int dim, float eps);

    /* Rotary embedding in place, "rotate half" (GPT-NeoX) layout as in HF
     * Mixtral / Qwen3: x (n_tok, n_heads, d_head); pairs (i, i + d_head/2)
     * rotated by f = pos * inv_freq[i] (inv_freq: host memory, d_head/2
     * frequencies, moe_rope_inv_freq; scaled or not), with cos f and sin f
     * each multiplied by `scale` (YaRN's attention factor; 1 otherwise). */
    void (*rope)(struct moe_backend *be, float *x, const int32_t *pos, int n_tok, int n_heads,
                 int d_head, const float *inv_freq, float scale);

    /* k, v (n_tok, kv_dim) f32 written to caches (n_slot, kv_dim) of element
     * type kv_dtype (moe_kv_dtype_valid) at slots[t]; BF16 rounds to nearest
     * even. A backend without that cache type records an error (status).
     * v and v_cache NULL: K only (a latent cache whose rows serve as both). */
    void (*kv_write)(struct moe_backend *be, const float *k, const float *v, const int32_t *slots,
                     int n_tok, int kv_dim, void *k_cache, void *v_cache, enum moe_dtype kv_dtype);

    void (*attention)(struct moe_backend *be, const struct moe_attn_params *p);

    /* Router: logits (n_tok, n_expert) -> the top_k experts of each token
     * (ids descending by probability, ties to the lower id) and their weights.
     * Weights are softmax over all experts, then, with `renorm`, divided by
     * their sum over the top k (Mixtral always renormalises, which equals a
     * softmax over the top-k logits). */
    void (*router_topk)(struct moe_backend *be, const float *logits, int n_tok, int n_expert,
                        int top_k, bool renorm, int32_t *ids, float *weights);

    /* out[i] = silu(gate[i]) * up[i] for i < n_rows*dim, where gate and up
     * are the two halves of each row of `gate_up` (n_rows, 2*dim):
     * gate = gate_up[r][0:dim], up = gate_up[r][dim:2*dim]; out (n_rows, dim). */
    void (*swiglu)(struct moe_backend *be, const float *gate_up, float *out, int n_rows, int dim);

    /* dst[i] = src[idx[i]] for n rows of dim (src rows f32). */
    void (*gather_rows)(struct moe_backend *be, const float *src, const int32_t *idx, int n,
                        int dim, float *dst);

    /* dst[idx[i]] += scale[i] * src[i] for n rows of dim. idx may repeat
     * only across separate calls (rows within one call are distinct). */
    void (*scatter_add_rows)(struct moe_backend *be, const float *src, const int32_t *idx,
                             const float *scale, int n, int dim, float *dst);

    /* Embedding lookup: dst[t] = table[ids[t]] converted to f32; table
     * (n_vocab, dim) in `dtype`. */
    void (*embed)(struct moe_backend *be, const void *table, enum moe_dtype dtype,
                  const int32_t *ids, int n_tok, int dim, float *dst);

    /* y[i] += x[i] for n elements. */
    void (*add)(struct moe_backend *be, float *y, const float *x, size_t n);

    /* ---- The GPU path's ops; every pointer is backend memory
     * unless said otherwise. ---- */

    /* Returns and clears the first error an op recorded since the last call
     * (a launch or library failure, an unsupported shape, an invalid
     * argument), its one-line message in err; MOE_OK when none. Ops queue
     * work asynchronously: call it after `synchronize` to cover everything
     * queued before. */
    enum moe_status (*status)(struct moe_backend *be, struct moe_error *err);

    /* Sets `bytes` bytes at p to zero (queued like an op). */
    void (*buf_zero)(struct moe_backend *be, void *p, size_t bytes);

    void (*grouped_matmul)(struct moe_backend *be, const struct moe_grouped_matmul_params *p);

    /* struct moe_permute_params. */
    void (*permute)(struct moe_backend *be, const struct moe_permute_params *p);

    /* Weighted combine of expert outputs back into token order, the inverse
     * of gather_rows over the permuted rows: for each token t and j = 0, 1,
     * ..., top_k - 1 in that order,
     *   i = tok_rows[t * top_k + j]; if (i >= 0) y[t] += weights[i] * rows[i]
     * (the product and the sum rounded separately, no FMA). tok_rows lists a
     * token's row positions sorted by expert id, so with y zeroed first the
     * result equals the per-expert scatter_add_rows loop bit for bit; -1
     * skips an entry (an expert not computed here). Deterministic, no atomics.
     * rows (n_rows, dim), weights (n_rows), tok_rows (n_tok, top_k),
     * y (n_tok, dim). */
    void (*unpermute_combine)(struct moe_backend *be, const float *rows, const float *weights,
                              const int32_t *tok_rows, int n_tok, int top_k, int dim, float *y);

    /* out_ids[r] = index of the largest of logits[r] (n rows of vocab), ties
     * to the lower id (NaN logits: unspecified). out_ids (n). */
    void (*argmax)(struct moe_backend *be, const float *logits, int n, int vocab, int32_t *out_ids);

    /* Temperature + top-p sampling of one id per row, the semantics of
     * worker/engine/sampler.c's moe_sample with top_k and min_p off:
     * temperature <= 0 is argmax; else p_i = expf((l_i - max) / temperature);
     * with 0 < top_p < 1 the candidates are sorted by p descending (ties to
     * the lower id) and the shortest prefix whose mass reaches top_p of the
     * total is kept; the id is the first candidate (in that order, or in id
     * order without top_p) whose running mass exceeds u * kept mass, with
     * u = uniform[r] in [0, 1) from the caller. One difference, for
     * determinism on a GPU: masses are summed in 2^-40 fixed point (integer
     * sums are exact in any order) instead of doubles, which moves the
     * boundaries by at most ~vocab * 2^-40 of the maximum p. logits
     * (n, vocab), uniform (n) doubles, out_ids (n). */
    void (*sample_top_p)(struct moe_backend *be, const float *logits, int n, int vocab,
                         float temperature, float top_p, const double *uniform, int32_t *out_ids);

    /* sample_top_p with each row's own temperature[r] and top_p[r] (backend
     * arrays of n; temperature <= 0: the argmax), so one launch serves rows
     * of any mix of settings and its shape does not depend on them. */
    void (*sample_rows)(struct moe_backend *be, const float *logits, int n, int vocab,
                        const float *temperature, const float *top_p, const double *uniform,
                        int32_t *out_ids);

    /* KV handoff, one layer per call: out[i][0] = the block_size rows of
     * k_cache starting at slot block_ids[i] * block_size, out[i][1] = those
     * of v_cache. k_cache, v_cache (n_slot, kv_dim); block_ids (n);
     * out (n, 2, block_size, kv_dim). kv_scatter_blocks is the inverse
     * (in -> caches); its block ids must be distinct. */
    void (*kv_gather_blocks)(struct moe_backend *be, const float *k_cache, const float *v_cache,
                             const int32_t *block_ids, int n, int block_size, int kv_dim,
                             float *out);
    void (*kv_scatter_blocks)(struct moe_backend *be, const float *in, const int32_t *block_ids,
                              int n, int block_size, int kv_dim, float *k_cache, float *v_cache);

    /* ---- Ops that only some backends have (NULL elsewhere); a model that
     * needs a missing one is refused by name at load. ---- */

    /* dst[r * ld_dst + j] = src[r * ld_src + j] for r < n_rows, j < n_cols
     * (f32): a block of columns from one row-major matrix into another (the
     * pointers may point at a column inside a row). No overlap. */
    void (*copy_cols)(struct moe_backend *be, float *dst, int ld_dst, const float *src, int ld_src,
                      int n_rows, int n_cols);

    /* struct moe_router_grouped_params. */
    void (*router_topk_grouped)(struct moe_backend *be, const struct moe_router_grouped_params *p);

    /* x[i] = 1 / (1 + exp(-x[i])) for n floats, in place (Qwen2-MoE's shared
     * expert gate; without it the model takes the sigmoid on the host). */
    void (*sigmoid)(struct moe_backend *be, float *x, size_t n);

    /* struct moe_backend_counters (CUDA; NULL on the CPU, where a copy is a
     * memcpy and nothing waits). Read from the thread that calls the ops. */
    void (*counters)(struct moe_backend *be, struct moe_backend_counters *out);

    /* Host memory that buf_upload / buf_download move fastest (CUDA:
     * page-locked, cudaMallocHost, so a copy is one DMA with no bounce
     * through a driver buffer); NULL on the CPU, where callers use malloc
     * and free. host_alloc returns NULL on failure. */
    void *(*host_alloc)(struct moe_backend *be, size_t bytes);
    void (*host_free)(struct moe_backend *be, void *p);

    /* buf_upload without the wait (CUDA: queued on the stream, one DMA):
     * src_host must come from host_alloc and stay unchanged until the next
     * wait (synchronize, a download). NULL: callers use buf_upload. */
    void (*buf_upload_async)(struct moe_backend *be, void *dst, const void *src_host, size_t bytes);

    /* The largest max_expert_rows grouped_matmul takes with device-only
     * offsets (struct moe_grouped_matmul_params) for weights of w_dtype;
     * 0 (or the op NULL): host offsets only. */
    int (*grouped_device_rows)(struct moe_backend *be, enum moe_dtype w_dtype);

    /* Graphs: a step's ops recorded once and replayed with one launch
     * (CUDA graphs; the CUDA backend's stay off unless MOE_CUDA_GRAPHS=1,
     * as they have not run on a GPU yet). For a step whose ops have fixed
     * shapes and addresses under `key`, read every input from backend memory
     * and neither copy to or from the host nor wait: graph_launch(key) true
     * means the graph recorded for key was launched in place of the ops;
     * else graph_begin(key) true means the ops that follow are recorded, not
     * run (a key is recorded the second time it is seen, so its first run
     * has grown every scratch buffer), until graph_end, which launches them
     * (MOE_OK) or says why the recording failed (an op waited, copied or
     * needed more scratch): then nothing ran, and the caller issues the ops
     * again. graph_reset forgets every graph (the caller's buffers moved). */
    bool (*graph_launch)(struct moe_backend *be, uint64_t key);
    bool (*graph_begin)(struct moe_backend *be, uint64_t key);
    enum moe_status (*graph_end)(struct moe_backend *be, struct moe_error *err);
    void (*graph_reset)(struct moe_backend *be);

    /* Fusions (NULL: the model issues the ops they stand for). x += r, then
     * y = rmsnorm(x) with w (add then rmsnorm: a block's residual add and
     * the next norm; y != x). struct moe_rope_kv_params. The CPU backend's
     * results equal those ops' bit for bit; the CUDA backend offers them
     * where MOE_CUDA_FUSED_OPS=1, until a GPU has run them. */
    void (*add_rmsnorm)(struct moe_backend *be, float *x, const float *r, const float *w, float *y,
                        int n_rows, int dim, float eps);
    void (*rope_kv_write)(struct moe_backend *be, const struct moe_rope_kv_params *p);
};

struct moe_backend {
    const char *name; /* "cpu", "cuda" */
    enum moe_device device;
    const struct moe_backend_ops *ops;
    void *ctx;       /* backend private state */
    int ordinal;     /* CUDA: the device number; CPU: -1 */
    char label[128]; /* one line for start-up logs: "cuda:1 (NVIDIA H200, 139.8 GiB, sm_90)",
                      * "cpu (2 threads, avx512 + avx512-bf16,avx512-vnni)" */
};

/* The KV element type a cache on `be` gets unless told otherwise: BF16 on
 * the CPU (half the bytes, so twice the tokens in the same memory), F32 on
 * CUDA (its attention kernel reads bf16 caches too, but that has not run on
 * a GPU yet: opt-in with --kv-dtype bf16 until bench/gpu_check.sh passes). */
static inline enum moe_dtype moe_backend_default_kv_dtype(const struct moe_backend *be)
{
    return be->device == MOE_DEVICE_CPU ? MOE_DTYPE_BF16 : MOE_DTYPE_F32;
}

/* CPU backend with `n_threads` worker threads (0: one per online core). */
enum moe_status moe_backend_cpu_create(int n_threads, struct moe_backend **out,
                                       struct moe_error *err);

/* CUDA backend on device `ordinal`. Returns MOE_ERR_UNSUPPORTED when the
 * build has no CUDA or no usable GPU is present (message says which). */
enum moe_status moe_backend_cuda_create(int ordinal, struct moe_backend **out,
                                        struct moe_error *err);

/* The --device flag: "cpu", "cuda" (the GPU of this process's local rank),
 * "cuda:N" (GPU N, whatever the local rank) or "auto" (CUDA when a GPU is
 * usable, otherwise CPU). */
struct moe_device_flag {
    enum { MOE_DEVICE_FLAG_AUTO, MOE_DEVICE_FLAG_CPU, MOE_DEVICE_FLAG_CUDA } kind;
    int ordinal; /* cuda:N: N; else -1 (by local rank) */
};

/* Parses `s`; refuses anything else naming the value. */
enum moe_status moe_device_flag_parse(const char *s, struct moe_device_flag *out,
                                      struct moe_error *err);

/* The GPU a process opens, out of n_gpus visible ones: the flag's N, else
 * its local rank (its index among the group's processes on this node), so
 * `mpirun -np 8` on an 8-GPU node puts each rank on its own GPU. A local
 * rank (or N) without a GPU of its own is refused, naming both numbers. */
enum moe_status moe_device_pick_ordinal(const struct moe_device_flag *f, int local_rank, int n_gpus,
                                        int *ordinal, struct moe_error *err);

/* GPUs this process can see (0 without CUDA, a driver or a GPU). */
int moe_backend_cuda_device_count(void);

/* Picks a backend by the --device flag (moe_device_flag_parse) for a process
 * of local rank `local_rank` (0 outside a group); "auto" without a usable GPU
 * falls back to the CPU, saying why on stderr. */
enum moe_status moe_backend_create_at(const char *device, int n_threads, int local_rank,
                                      struct moe_backend **out, struct moe_error *err);

/* moe_backend_create_at for local rank 0. */
enum moe_status moe_backend_create(const char *device, int n_threads, struct moe_backend **out,
                                   struct moe_error *err);

void moe_backend_destroy(struct moe_backend *be);

/* A host helper, not an op: the index of the largest of x[0..n) (host
 * memory), ties to the lower index; a NaN is never chosen unless x[0] is
 * one (then 0), the answer of the plain loop `if (x[i] > x[best]) best = i`.
 * Two passes (max, then the first index holding it) vectorised for the
 * CPU's ISA: the engine's greedy sampling over a 32k vocabulary is ~4x
 * faster than that loop. */
int32_t moe_host_argmax(const float *x, int n);

/* True when this binary was built with CUDA support. */
bool moe_backend_cuda_compiled(void);

#endif
