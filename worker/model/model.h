/* A Mixtral / Qwen3-MoE model: weights on a backend and the forward pass for
 * a batch of tokens from one or more sequences over a paged KV cache.
 *
 * A model is loaded for a shard: a tensor-parallel rank of attention heads
 * and an expert-parallel set of experts; the loader reads only the slice of
 * every weight that the shard owns. load.c loads and frees, forward.c runs
 * the forward pass, moe_layer.c the MoE layer (one rank or expert
 * parallel), placement_swap.c changes the expert placement while serving. */
#ifndef MOE_MODEL_H
#define MOE_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "dtype.h"
#include "kv/kv_cache.h"
#include "model_config.h"
#include "moe_error.h"

struct moe_comm;
struct moe_placement;

/* Sharding: attention heads are split over the tp_size ranks of `tp_comm`
 * (row-parallel o_proj partial sums all-reduced there); experts are split
 * over every rank of `ep_comm` by `placement` (NULL: an even contiguous split),
 * each rank loading only its own experts. All ranks of ep_comm run every
 * forward on the same batch (lock-step, see group.h). NULL comms: one rank. */
struct moe_model_opts {
    /* Weights: F32, BF16, I8 or I4 (norms stay F32). I8 quantizes every
     * Linear weight that goes through matmul (q/k/v/o projections, expert and
     * dense FFNs, lm_head) to int8 with per-output-row scales at load (W8A16),
     * I4 to 4 bits with one scale per q4_group columns (W4A16); CPU backend
     * only. The router, norms and the embedding table are kept as with BF16. */
    enum moe_dtype dtype;
    int q4_group; /* I4: columns per scale, 32 (0 means 32), 64 or 128 */
    /* Test hook, with dtype I8 or I4 only: store each quantized weight as
     * its f32 dequantization and run the f32 kernels, so a test can hold the
     * int8 / int4 kernels to an f32 model with exactly the same weights. */
    bool dequantized;
    /* false (the default): f32 activations through every matmul, the
     * reference the golden tests hold to transformers. true: the Linear
     * layers (not the router) may round activations to bf16 (BF16 weights)
     * or quantize them per token to int8 (I8 weights) where the backend has
     * dot-product instructions for that (CPU: AVX512-BF16, AVX512-VNNI;
     * struct moe_matmul_params.fast); elsewhere it computes as exact. The
     * binaries default to fast and take --exact. */
    bool fast;
    /* true: every matmul batch-invariant (struct moe_matmul_params), so a
     * sequence's tokens do not depend on what else is batched with it:
     * alone or among others, prefilled or decoded in any chunks, on one
     * worker or handed from a prefill pool to a decode pool, verified in
     * speculative steps or decoded one token at a time (the attention,
     * norms and routing are row by row already). Costs the packed prefill
     * panels (CPU). The binaries take --batch-invariant. */
    bool batch_invariant;
    /* true: synchronise the backend at the MoE layer's phase boundaries, so
     * the profile's split (moe_model_profile) is true on a GPU, whose ops
     * are queued; otherwise a one-rank step waits only at its end. The
     * binaries' --profile sets it. */
    bool profile;
    /* true: no step is recorded or replayed as a graph (--no-cuda-graphs),
     * whatever the backend offers (its graph_* ops; CUDA: where
     * MOE_CUDA_GRAPHS=1 turns them on, until a GPU has run them). */
    bool no_graphs;
    /* Element type of this model's KV caches (moe_kv_cache_create): F32 (0,
     * the default here) or BF16 (CPU backend only). The binaries take
     * --kv-dtype and default to the backend's moe_backend_default_kv_dtype,
     * F32 under --exact. */
    enum moe_dtype kv_dtype;
    int tp_rank;
    int tp_size;
    struct moe_comm *tp_comm; /* borrowed; NULL when tp_size == 1 */
    struct moe_comm *ep_comm; /* borrowed; NULL or size 1: all experts local */
    /* Data-parallel attention: every tensor-parallel sub-group (tp_comm; a
     * rank alone with tp_size 1) runs its own batch (its own sequences,
     * tokens and KV cache, possibly none) and the MoE layers exchange the
     * sub-groups' distinct rows over ep_comm; see moe_batch's n_tok_group.
     * false: every rank runs the same batch (lock-step). */
    bool dp_attention;
    const struct moe_placement *placement; /* copied at load */
};

struct moe_model;

/* Loads config.json and the safetensors weights in `dir`, checks every tensor
 * against the config (names, shapes), and copies the shard's slice to the
 * backend in opts->dtype. On error *out is NULL and the message names the
 * file and tensor. */
enum moe_status moe_model_load(const char *dir, const struct moe_model_opts *opts,
                               struct moe_backend *be, struct moe_model **out,
                               struct moe_error *err);

void moe_model_free(struct moe_model *m);

const struct moe_config *moe_model_config(const struct moe_model *m);

/* Bytes of weights held by this shard. */
size_t moe_model_weight_bytes(const struct moe_model *m);

/* Bytes sent by this rank in the expert-parallel dispatch and combine
 * all-to-alls since load (0 with one rank), and the routed token rows. */
void moe_model_ep_traffic(const struct moe_model *m, uint64_t *bytes_sent, uint64_t *rows_routed);

/* Wall time spent in each phase of the forward passes since load (this rank;
 * the backend is synchronised at phase ends only on multi-rank groups, so on
 * an asynchronous device the split is approximate). */
struct moe_model_profile {
    double attention_s; /* norms, QKV, RoPE, attention, o_proj (+ TP all-reduce) */
    double router_s;    /* router matmul and top-k */
    double dispatch_s;  /* grouping by expert; EP: routing + all-to-all out */
    double experts_s;   /* expert FFNs (one rank: with gather/scatter) */
    double combine_s;   /* EP: all-to-all back, weighted combine, all-gather */
    double other_s;     /* embedding, dense layers, final norm, lm_head */
    uint64_t forwards;
    uint64_t tokens;
    uint64_t graphs_recorded;  /* steps recorded as a graph (kernels/backend.h graph ops) */
    uint64_t graphs_replayed;  /* steps run by replaying one */
    uint64_t moe_layer_tokens; /* tokens x MoE layers */
};

void moe_model_profile(const struct moe_model *m, struct moe_model_profile *out);

/* Zeroes what the forward passes counted since load: the profile, the
 * routed tokens per expert (moe_model_expert_tokens), the expert-parallel
 * traffic. For a warm-up run that should not count (moe-generate --warmup). */
void moe_model_reset_counters(struct moe_model *m);

/* Routed (token, expert) pairs per layer and expert since load:
 * counts[l * n_expert + e]; layers without experts stay 0. On a group every
 * rank counts every token of the batch (data-parallel attention: its own
 * tokens, and the leader all of them, see group.c). Also the rows this rank ran through
 * its own experts (expert parallel; 0 on one rank). */
const uint64_t *moe_model_expert_tokens(const struct moe_model *m);
/* Adds counts[l * n_expert + e] to them (data-parallel attention: the leader
 * adds the other ranks' tokens, which it did not route itself). */
void moe_model_add_expert_tokens(struct moe_model *m, const float *counts);
uint64_t moe_model_ep_rows_computed(const struct moe_model *m);

/* Changing the expert placement while serving, in two steps:
 * prepare loads (from the checkpoint) the experts that `p` puts on this rank
 * and it does not hold yet; it may run on another thread while forward passes
 * go on, and does not change what they compute. commit then switches to `p`
 * between two forward passes: pointer swaps, and the experts this rank no
 * longer holds are freed. Every rank of a group must commit at the same step
 * boundary (group.c arranges it). Outputs do not change: experts move, their
 * weights do not. prepare with a placement for another group size or model
 * is MOE_ERR_INVALID; commit without a prepared placement does nothing. */
enum moe_status moe_model_prepare_placement(struct moe_model *m, const struct moe_placement *p,
                                            struct moe_error *err);
bool moe_model_placement_ready(const struct moe_model *m);
void moe_model_drop_placement(struct moe_model *m); /* forget a prepared placement */
void moe_model_commit_placement(struct moe_model *m);

/* A KV cache of this shard's shape and opts.kv_dtype (kv/kv_cache.h) on the
 * model's backend; free with kv NULL does nothing (m may be NULL then). */
enum moe_status moe_kv_cache_create(const struct moe_model *m, int n_block, int block_size,
                                    struct moe_kv_cache **out, struct moe_error *err);
void moe_kv_cache_free(const struct moe_model *m, struct moe_kv_cache *kv);

/* opts.kv_dtype: the element type of this model's KV caches. */
enum moe_dtype moe_model_kv_dtype(const struct moe_model *m);

/* One forward step. Host arrays; n_tok tokens from n_seq sequences.
 * Token t is tokens[t] of sequence seq[t] at position pos[t]; its K/V go to
 * cache slot slots[t]; sequence s's blocks are block_tables[s * max_blocks ..].
 * Logits (f32, vocab_size each) are produced for the n_logits tokens listed in
 * logit_rows, in that order, into the host array `logits`. */
struct moe_batch {
    int n_tok;
    const int32_t *tokens;
    const int32_t *pos;
    const int32_t *seq;
    const int32_t *slots;
    int n_seq;
    const int32_t *block_tables;
    int max_blocks;
    int n_logits;
    const int32_t *logit_rows;
    /* Data-parallel attention: the tokens of this step over every rank of
     * the group (sizes the rows the expert exchange may bring); n_tok may
     * then be 0, a rank with no sequence this step that still serves its
     * experts. 0: n_tok. */
    int n_tok_group;
    /* Greedy steps: when not NULL (host, n_logits entries), the argmax of
     * each logit row is taken on the backend (its argmax op, ties to the
     * lower id) and only these ids come back; the logits are not written
     * (the forward's `logits` may be NULL). */
    int32_t *argmax_out;
    /* With argmax_out, rows drawn instead of argmaxed, when not NULL (host,
     * n_logits entries each): row r's id is the backend's sample_top_p of
     * it with temperature sample_temp[r], top_p sample_top_p[r] and the
     * caller's uniform draw sample_u[r] in [0, 1) (kernels/backend.h);
     * rows with temperature <= 0 take the argmax. */
    const float *sample_temp, *sample_top_p;
    const double *sample_u;
};

enum moe_status moe_model_forward(struct moe_model *m, struct moe_kv_cache *kv,
                                  const struct moe_batch *batch, float *logits,
                                  struct moe_error *err);

/* A forward pass as the engine and the generator call it: moe_model_forward
 * on one rank, or the group leader's broadcast-then-forward (group.h). */
typedef enum moe_status (*moe_forward_fn)(void *ctx, struct moe_model *m, struct moe_kv_cache *kv,
                                          const struct moe_batch *batch, float *logits,
                                          struct moe_error *err);

#endif
