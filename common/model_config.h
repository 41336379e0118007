/* The hyper-parameters of a Hugging Face MoE checkpoint (config.json) that
 * change the math. Anything that would change the math and is not
 * implemented (rope_scaling, a sliding window in use, another activation,
 * attention bias ...) is refused with MOE_ERR_UNSUPPORTED naming the field. */
#ifndef MOE_MODEL_CONFIG_H
#define MOE_MODEL_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "moe_error.h"

#define MOE_MAX_LAYERS 256
#define MOE_MAX_EOS 8

enum moe_arch {
    MOE_ARCH_MIXTRAL = 0, /* MixtralForCausalLM */
    MOE_ARCH_QWEN3_MOE,   /* Qwen3MoeForCausalLM */
    MOE_ARCH_QWEN2_MOE,   /* Qwen2MoeForCausalLM: q/k/v bias, a gated shared expert */
    MOE_ARCH_OLMOE,       /* OlmoeForCausalLM: q/k RMSNorm over all heads at once */
    MOE_ARCH_DEEPSEEK_V3, /* DeepseekV3ForCausalLM: latent attention, grouped sigmoid routing */
};

/* RoPE frequency scaling (rope_parameters / rope_scaling), as transformers'
 * modeling_rope_utils computes it: default, linear, llama3, yarn. */
enum moe_rope_type {
    MOE_ROPE_DEFAULT = 0,
    MOE_ROPE_LINEAR,
    MOE_ROPE_LLAMA3,
    MOE_ROPE_YARN,
};

struct moe_rope {
    enum moe_rope_type type;
    float factor;                            /* linear, llama3, yarn */
    float low_freq_factor, high_freq_factor; /* llama3 */
    int original_max_pos;                    /* llama3, yarn: original_max_position_embeddings */
    float beta_fast, beta_slow;              /* yarn (32, 1) */
    bool truncate;                           /* yarn (true) */
    /* cos and sin are multiplied by it (yarn: given, or from factor, mscale
     * and mscale_all_dim); 1 otherwise */
    float attention_factor;
    float mscale_all_dim; /* the dict's mscale_all_dim, 0 when absent (DeepSeek's softmax scale) */
};

struct moe_config {
    enum moe_arch arch;
    int d_model;   /* hidden_size */
    int n_layer;   /* num_hidden_layers */
    int n_head;    /* num_attention_heads */
    int n_kv_head; /* num_key_value_heads (defaults to n_head) */
    int d_head;    /* head_dim (defaults to d_model / n_head) */
    int vocab_size;
    int n_expert;        /* num_local_experts (Mixtral) / num_experts (Qwen3) */
    int top_k;           /* num_experts_per_tok */
    int d_ff_expert;     /* Mixtral: intermediate_size; Qwen3: moe_intermediate_size */
    int d_ff_dense;      /* Qwen3 dense-MLP layers: intermediate_size; 0 if none */
    int d_ff_shared;     /* Qwen2-MoE shared expert: shared_expert_intermediate_size; 0 if none */
    bool qkv_bias;       /* q/k/v projections have biases (Qwen2-MoE qkv_bias) */
    bool norm_topk_prob; /* renormalise the top-k weights (always true for Mixtral) */
    bool qk_norm;        /* per-head RMSNorm on q and k before RoPE (Qwen3) */
    bool qk_norm_full;   /* one RMSNorm over all of q, one over all of k (OLMoE) */
    bool tie_word_embeddings;
    float rms_eps; /* rms_norm_eps */
    float rope_theta;
    struct moe_rope rope;
    int max_pos; /* max_position_embeddings */
    int bos_id;  /* -1 if absent */
    int n_eos;   /* eos_token_id: int or list */
    int eos_ids[MOE_MAX_EOS];
    bool layer_is_moe[MOE_MAX_LAYERS]; /* from decoder_sparse_step + mlp_only_layers */

    /* DeepSeek-V3 multi-head latent attention (mla). Per head, a query of
     * qk_nope_dim + qk_rope_dim (d_head is qk_rope_dim, as config.json's
     * head_dim says); keys and values come from one compressed row per token
     * (kv_lora_rank, RMS-normalised) plus one rotary key (qk_rope_dim) shared
     * by all heads: that row is all the KV cache holds. */
    bool mla;
    int q_lora_rank; /* 0: q_proj straight from the hidden state */
    int kv_lora_rank;
    int qk_nope_dim;
    int v_head_dim;
    bool rope_interleave; /* rotary pairs (x0, x1), (x2, x3) ... in the checkpoint's rows */
    float attn_scale;     /* (qk_nope + qk_rope)^-1/2, times YaRN's mscale(factor, all_dim)^2 */
    /* DeepSeek-V3 routing (router_sigmoid): sigmoid scores; the choice adds
     * e_score_correction_bias and keeps the best topk_group of n_group groups
     * (a group's score: its two best); the weights are the plain scores
     * (renormalised with norm_topk_prob) times routed_scaling. */
    bool router_sigmoid;
    int n_group, topk_group;
    float routed_scaling;
    int first_k_dense; /* first_k_dense_replace: that many dense layers first */
    int n_mtp;         /* num_nextn_predict_layers: multi-token-prediction layers, not used */
};

/* Elements per token and layer in one rank's KV cache, for a model split
 * over tp ranks: K and V of its KV heads (2 * n_kv_head / tp * d_head), or
 * with MLA the one latent row (kv_lora_rank + qk_rope_dim, the same on every
 * rank). */
int moe_config_kv_token_elems(const struct moe_config *cfg, int tp);

/* The KV cache's heads as the KV data plane sees them: n_kv_head of d_head,
 * or with MLA one latent "head" of kv_lora_rank + qk_rope_dim that every
 * rank holds whole. */
static inline int moe_config_kv_heads(const struct moe_config *cfg)
{
    return cfg->mla ? 1 : cfg->n_kv_head;
}
static inline int moe_config_kv_head_dim(const struct moe_config *cfg)
{
    return cfg->mla ? cfg->kv_lora_rank + cfg->d_head : cfg->d_head;
}

/* inv_freq[i] for i < d_head / 2: rope_theta^(-2i/d_head), scaled as
 * cfg->rope says, in f32 in transformers' order of operations. */
void moe_rope_inv_freq(const struct moe_config *cfg, float *inv_freq);

/* The model_type spelling of an architecture: "mixtral", "qwen3_moe",
 * "qwen2_moe", "olmoe", "deepseek_v3". */
const char *moe_arch_model_type(enum moe_arch a);

/* Parses `path` (a config.json). On error returns non-OK with a one-line
 * message naming the file and the field. */
enum moe_status moe_config_load(const char *path, struct moe_config *cfg, struct moe_error *err);

/* Same, from a JSON text; `name` is used in messages. */
enum moe_status moe_config_parse(const char *json, const char *name, struct moe_config *cfg,
                                 struct moe_error *err);

#endif
