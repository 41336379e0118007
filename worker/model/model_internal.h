/* Internals of the model shared by load.c, forward.c, moe_layer.c (the MoE
 * layer) and placement_swap.c. Not a public interface. */
#ifndef MOE_MODEL_INTERNAL_H
#define MOE_MODEL_INTERNAL_H

#include "comm/comm.h"
#include "model/model.h"
#include "placement.h"
#include "clock.h"

#define MOE_MAX_EP_RANKS 64
/* The MoE layer routes on the device (no host copy of the offsets; see
 * moe_layer.c) for steps of up to this many tokens on one rank. */
#define MOE_ROUTE_DEVICE_MAX_TOK 64
/* Block tables are widened to a multiple of this many blocks where steps
 * may be graphs (forward.c), so a graph serves while sequences grow. */
#define MOE_GRAPH_TABLE_QUANTUM 8

struct layer_weights {
    float *attn_norm; /* (d_model) */
    float *ffn_norm;  /* (d_model) */
    void *wqkv;       /* (q_dim + 2 kv_dim, d_model): this rank's q_proj, k_proj and v_proj rows,
                         stacked (one matmul for the three) */
    void *wo;         /* (d_model, n_head_local*d_head): column slice of o_proj */
    float *q_norm;    /* (d_head), Qwen3; (n_head*d_head), OLMoE */
    float *k_norm;    /* (d_head), Qwen3; (n_kv_head*d_head), OLMoE */
    bool is_moe;
    void *router;        /* (n_expert, d_model) */
    void **w_gate_up;    /* (n_expert) -> (2*d_ff_expert, d_model), NULL when not local */
    void **w_down;       /* (n_expert) -> (d_model, d_ff_expert) */
    void *dense_gate_up; /* (2*d_ff_dense, d_model) */
    void *dense_down;    /* (d_model, d_ff_dense) */
    /* Qwen2-MoE */
    float *bq, *bk, *bv;  /* q/k/v biases, this rank's slices (qkv_bias), else NULL */
    void *shared_gate_up; /* (2*d_ff_shared, d_model): the shared expert, on every rank */
    void *shared_down;    /* (d_model, d_ff_shared) */
    void *shared_gate;    /* (1, d_model) in base_dtype: its per-token sigmoid gate; NULL:
                             weight 1 (DeepSeek-V3's shared experts) */
    /* DeepSeek-V3 latent attention (cfg.mla; wq, wk, wv unused, wo is
     * (d_model, n_head_local * v_head_dim)). Rotary rows are stored
     * de-interleaved when the checkpoint interleaves them, so the usual
     * rotate-half rope gives the checkpoint's rotation. */
    void *wq_a;       /* (q_lora_rank, d_model) when q_lora_rank */
    float *q_a_norm;  /* (q_lora_rank) */
    void *wq_nope;    /* (n_head_local * qk_nope, q_in): q_in is q_lora_rank or d_model */
    void *wq_rope;    /* (n_head_local * qk_rope, q_in) */
    void *wkv_a;      /* (kv_lora_rank, d_model): the compressed row */
    void *wk_rope;    /* (qk_rope, d_model): the rotary key all heads share */
    float *kv_a_norm; /* (kv_lora_rank) */
    void **w_uk_t;    /* (n_head_local) -> (kv_lora_rank, qk_nope): a head's key
                         up-projection, transposed, folded into its query */
    void **w_uv;      /* (n_head_local) -> (v_head_dim, kv_lora_rank): its value up-projection */
    const float **w_uk_scale, **w_uv_scale; /* int8 / int4: their scales; else NULL */
    float *router_bias; /* (n_expert) e_score_correction_bias, f32 (router_sigmoid) */
};

/* Scratch of the latent attention (cfg.mla), sized for cap_tok tokens;
 * H = n_head_local, L = kv_lora_rank, R = qk_rope_dim. "hm" rows are head
 * major (row h * n + t), the others token major (row t * H + h). */
struct mla_scratch {
    float *qa;      /* (n, q_lora_rank) */
    float *q_nope;  /* (n * H, qk_nope) */
    float *q_rope;  /* (n * H, R) */
    float *c;       /* (n, L) */
    float *k_rope;  /* (n, R) */
    float *q_hm;    /* (H * n, max(qk_nope, L)) */
    float *lat_hm;  /* (H * n, max(L, v_head_dim)) */
    float *lat;     /* (n * H, L): absorbed queries, then attention outputs */
    float *q_full;  /* (n * H, L + R): [absorbed query | rotary query] */
    int32_t *to_hm; /* (n * H) gather indexes token major -> head major */
    int32_t *to_tm; /* (n * H) head major -> token major */
    int32_t *h_idx; /* host (n * H) */
    int32_t *h_off; /* host (H + 1): head h's rows in the head-major buffers */
    int n_built;    /* the n to_hm / to_tm were built for (0: none) */
    /* Steps of up to MOE_ROUTE_DEVICE_MAX_TOK tokens keep their indexes on
     * the backend per n, [to_hm (n H) | to_tm (n H) | offsets (H + 1)],
     * built on the first step of that size and never rewritten, so a step
     * uploads nothing and a graph replays them where they were. */
    int32_t *by_n[MOE_ROUTE_DEVICE_MAX_TOK + 1];
    /* (n_layer, 2, H) backend pointers of each layer's w_uk_t then w_uv
     * heads, for per-head grouped matmuls with device-only offsets; built on
     * the first step. */
    void **head_tab;
};

/* Activations and per-step metadata on the backend, sized for cap_tok tokens. */
struct scratch {
    int cap_tok;
    int cap_seq_blocks;
    int cap_logits;       /* rows of logits: grown to the most n_logits seen, not cap_tok */
    float *x;             /* (n, d_model) residual stream */
    float *h;             /* (n, d_model) normalised */
    float *q;             /* (n, q_dim) */
    float *k;             /* (n, kv_dim) */
    float *v;             /* (n, kv_dim) */
    float *att;           /* (n, q_dim) */
    float *o;             /* (n, d_model) */
    float *ffn_out;       /* (n + MOE_MAX_EP_RANKS, d_model): + the all-gather's padding */
    float *shared_g;      /* (n) the shared expert's gate: logits, then sigmoids */
    float *h_shared_g;    /* host mirror of shared_g */
    float *router_logits; /* (n, n_expert) */
    int32_t *topk_ids;    /* (n, top_k) */
    float *topk_w;        /* (n, top_k): a view right after the n*top_k ids in topk_ids */
    float *gate_up;       /* (cap_ffn_rows, 2*d_ff_max) */
    float *act;           /* (cap_ffn_rows, d_ff_max) */
    int cap_ffn_rows;     /* n, or top_k rows a token up to MOE_ROUTE_DEVICE_MAX_TOK tokens */
    float *ye;            /* (n, d_model) */
    float *ones;          /* (n) all 1: dense FFN weights */
    int32_t *iota;        /* (n) 0..n-1 */
    /* A step's inputs, slices of one backend buffer (step_in) that one
     * upload fills from its host twin (h_step_in: pinned where the backend
     * has host_alloc): see step_inputs_upload in forward.c. */
    void *step_in;
    char *h_step_in;
    int32_t *tokens;       /* (n) */
    int32_t *pos;          /* (n) */
    int32_t *seq;          /* (n) */
    int32_t *slots;        /* (n) */
    int32_t *logit_rows;   /* (n) */
    int32_t *block_tables; /* (cap_seq_blocks): last, so an upload stops at the used entries */
    float *logits;         /* (cap_logits, vocab) */
    int32_t *logit_ids;    /* (n) argmax of each logit row (moe_batch.argmax_out) */
    float *qkv;            /* (n, q_dim + 2 kv_dim): the stacked q/k/v projection */
    double *logit_u;       /* (n) uniform draws of sampled rows (moe_batch.sample_u), in step_in */
    float *logit_temp;     /* (n) their temperatures (moe_batch.sample_temp), in step_in */
    float *logit_top_p;    /* (n) their top_p (moe_batch.sample_top_p), in step_in */
    /* the MoE layer (moe_layer.c), sized for n * top_k items */
    float *rows_a;      /* (n*k, d_model) rows in send order, then grouped by expert */
    float *rows_b;      /* (n*k, d_model) expert outputs, grouped by expert */
    float *rows_r;      /* expert parallel: (n*k, d_model) rows in receive order */
    int32_t *item_tok;  /* (n*k) permute: token of each sorted item */
    int32_t *item_exp;  /* (n*k) its expert */
    float *item_w;      /* (n*k) its combine weight */
    int32_t *tok_rows;  /* (n*k) each token's sorted positions, by expert id */
    int32_t *offsets;   /* (W * n_expert + 1) by (rank, expert) */
    int32_t *h_offsets; /* host mirror of offsets */
    /* expert parallel: the received items' experts, their sort by expert
     * (sorted -> received) and its inverse, offsets by expert */
    int32_t *r_ids, *r_perm, *r_inv, *r_offsets;
    int32_t *h_r_offsets;
    /* the placement on the backend for permute (moe_layer.c, route_table) */
    int32_t *route_ranks;  /* (n_layer, n_expert, MOE_PLACEMENT_MAX_REPLICAS) */
    int32_t *route_n;      /* (n_layer, n_expert) replicas */
    int64_t route_version; /* the placement_version it was copied at */
    /* host, for the grouped GEMMs: a window's offsets, the experts' weights
     * and scales */
    int32_t *h_win; /* (n_expert + 1) */
    const void **h_w_gu, **h_w_dn;
    const float **h_s_gu, **h_s_dn;
    /* routed on the device (moe_layer.c): each layer's offsets, kept for
     * the expert statistics, which the step's end reads in one copy
     * (moe_model_route_stats); the experts' weight pointers on the backend */
    int32_t *route_off;    /* (n_layer, n_expert + 1), then route_last */
    int32_t *route_last;   /* (n_layer, top_k): the step's last row's experts (graph padding) */
    int32_t *h_route_off;  /* host mirror of both */
    int route_pad;         /* padding rows of the step (forward.c, pad_for_graph) */
    bool *route_pending;   /* host (n_layer): routed on the device since the last read */
    bool route_any;        /* some route_pending set */
    const void **w_tab;    /* (n_layer, 2, n_expert): gate_up then down pointers */
    int64_t w_tab_version; /* placement_version it was copied at */
    uint64_t graph_gen;    /* bumped whenever a buffer above moves (graph keys) */
    float *h_zero;         /* (n, d_model) zeros, to clear device buffers */
    struct mla_scratch mla;
};

struct moe_model {
    struct moe_config cfg;
    struct moe_model_opts opts;
    struct moe_backend *be;
    int n_head_local;
    int n_kv_head_local;
    int q_dim;  /* n_head_local * d_head */
    int kv_dim; /* n_kv_head_local * d_head */
    /* Linear weights (everything through matmul but the router) are stored
     * in lin_dtype; the router and embedding table in base_dtype. Both equal
     * opts.dtype except with I8 / I4: lin I8 / I4 (F32 under
     * opts.dequantized), base BF16. An I8 or I4 weight (n_out, n_in) is one
     * buffer with its scales after the codes (common/quant.h). */
    enum moe_dtype lin_dtype;
    enum moe_dtype base_dtype;
    int q4_group;         /* I4: columns per scale */
    float *rope_inv_freq; /* host (d_head / 2): moe_rope_inv_freq of cfg */
    void *embed;          /* (vocab, d_model) */
    float *final_norm;    /* (d_model) */
    void *lm_head;        /* (vocab, d_model); == embed when tied */
    struct layer_weights *layers;
    size_t weight_bytes;
    struct moe_comm *tp_comm;       /* NULL: no tensor parallel */
    struct moe_comm *ep_comm;       /* NULL: all experts local */
    struct moe_placement placement; /* valid when ep_comm */
    struct moe_model_profile prof;
    char *dir;                 /* checkpoint, for loading experts again */
    uint64_t *expert_tokens;   /* (n_layer, n_expert) routed (token, expert) pairs */
    uint64_t ep_rows_computed; /* rows this rank ran through its experts (EP) */
    /* a placement being prepared: experts this rank gains, loaded ahead */
    bool pending_ready;
    struct moe_placement pending;
    void **pending_gate_up; /* (n_layer, n_expert), NULL where nothing new */
    void **pending_down;
    uint64_t ep_bytes_sent;
    uint64_t ep_rows_routed;
    int64_t placement_version; /* bumped by every committed placement change */
    bool graph_warned;         /* a step's graph failed to record (said once) */
    /* pad_for_graph's host arrays (the padded step's inputs and ids); not in
     * the scratch, which a step may reallocate after padding */
    void *h_pad;
    size_t h_pad_cap; /* bytes */
    struct scratch s;
};

/* moe_layer.c: the MoE layer of layer l on n rows (every W: one rank, or
 * expert parallel over ep_comm, see there), routed and shared experts.
 * Reads s->h, s->topk_ids, s->topk_w; writes s->ffn_out (n rows). */
enum moe_status moe_moe_layer(struct moe_model *m, int l, int n, struct moe_error *err);

/* Counts the experts of the layers routed on the device since the last
 * call into expert_tokens (one copy of their offsets; the backend must be
 * synchronised first). */
void moe_model_route_stats(struct moe_model *m);

/* True when every MoE layer of a step of n tokens routes on the device
 * (and the experts' weight table on the backend is current). */
bool moe_model_routes_on_device(const struct moe_model *m, int n);

/* ---- forward.c ---- */

/* Zeroes `bytes` of a backend buffer (at most the h_zero scratch size). */
void moe_model_zero(struct moe_model *m, void *p, size_t bytes);

/* The shared experts of layer w on n rows of s->h: compute into s->ye (and
 * s->shared_g), then add into s->ffn_out (after the routed experts' sum). */
void moe_model_shared_compute(struct moe_model *m, const struct layer_weights *w, int n);
void moe_model_shared_add(struct moe_model *m, const struct layer_weights *w, int n);

/* One grouped matmul of the model's Linear weights (lin_dtype, the fast
 * path unless exact): rows offsets[g] .. offsets[g + 1] of x (n_rows, n_in)
 * against w[g] (n_out, n_in), scales w_scale[g] for int8 / int4, into y. */
void moe_model_grouped_matmul(struct moe_model *m, const float *x, int n_rows, int n_in, int n_out,
                              int n_groups, const int32_t *offsets, const void **w,
                              const float **w_scale, float *y);

/* The same with device-only offsets (struct moe_grouped_matmul_params):
 * off_dev and w_dev on the backend, no group over max_rows rows; w and
 * w_scale are host arrays with every group's weights. */
void moe_model_grouped_matmul_dev(struct moe_model *m, const float *x, int n_rows, int n_in,
                                  int n_out, int n_groups, const int32_t *off_dev, int max_rows,
                                  const void *const *w, const void *const *w_dev,
                                  const float **w_scale, float *y);

/* SwiGLU FFN on n rows. */
void moe_model_ffn(struct moe_model *m, const float *xe, int n, const void *w_gate_up, int d_ff,
                   const void *w_down, float *ye);

/* Frees the forward pass's scratch buffers (moe_model_free). */
void moe_model_scratch_free(struct moe_model *m);

/* ---- load.c ---- */

struct st_model;

/* Bytes of an (n_rows, n_cols) Linear weight in the model's dtype (int8:
 * with its row scales). */
size_t moe_model_linear_bytes(const struct moe_model *m, int64_t n_rows, int64_t n_cols);

/* Loads expert e of layer l from the open checkpoint `st` into new backend
 * buffers *gate_up and *down (placement_swap.c: experts a new placement
 * brings to this rank). */
enum moe_status moe_model_load_expert(struct moe_model *m, struct st_model *st, int l, int e,
                                      void **gate_up, void **down, struct moe_error *err);

#endif
