/* config.json parser: the published Mixtral-8x7B and Qwen3-30B-A3B configs,
 * defaults, and every refusal with its status and message. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "model_config.h"
#include "testlib.h"

/* mistralai/Mixtral-8x7B-v0.1 config.json */
static const char *MIXTRAL = "{\n"
                             "  \"architectures\": [\"MixtralForCausalLM\"],\n"
                             "  \"attention_dropout\": 0.0,\n"
                             "  \"bos_token_id\": 1,\n"
                             "  \"eos_token_id\": 2,\n"
                             "  \"hidden_act\": \"silu\",\n"
                             "  \"hidden_size\": 4096,\n"
                             "  \"initializer_range\": 0.02,\n"
                             "  \"intermediate_size\": 14336,\n"
                             "  \"max_position_embeddings\": 32768,\n"
                             "  \"model_type\": \"mixtral\",\n"
                             "  \"num_attention_heads\": 32,\n"
                             "  \"num_experts_per_tok\": 2,\n"
                             "  \"num_hidden_layers\": 32,\n"
                             "  \"num_key_value_heads\": 8,\n"
                             "  \"num_local_experts\": 8,\n"
                             "  \"output_router_logits\": false,\n"
                             "  \"rms_norm_eps\": 1e-05,\n"
                             "  \"rope_theta\": 1000000.0,\n"
                             "  \"router_aux_loss_coef\": 0.02,\n"
                             "  \"sliding_window\": null,\n"
                             "  \"tie_word_embeddings\": false,\n"
                             "  \"torch_dtype\": \"bfloat16\",\n"
                             "  \"transformers_version\": \"4.36.0.dev0\",\n"
                             "  \"use_cache\": true,\n"
                             "  \"vocab_size\": 32000\n"
                             "}\n";

/* Qwen/Qwen3-30B-A3B config.json */
static const char *QWEN3 = "{\n"
                           "  \"architectures\": [\"Qwen3MoeForCausalLM\"],\n"
                           "  \"attention_bias\": false,\n"
                           "  \"attention_dropout\": 0.0,\n"
                           "  \"bos_token_id\": 151643,\n"
                           "  \"decoder_sparse_step\": 1,\n"
                           "  \"eos_token_id\": 151645,\n"
                           "  \"head_dim\": 128,\n"
                           "  \"hidden_act\": \"silu\",\n"
                           "  \"hidden_size\": 2048,\n"
                           "  \"initializer_range\": 0.02,\n"
                           "  \"intermediate_size\": 6144,\n"
                           "  \"max_position_embeddings\": 40960,\n"
                           "  \"max_window_layers\": 48,\n"
                           "  \"mlp_only_layers\": [],\n"
                           "  \"model_type\": \"qwen3_moe\",\n"
                           "  \"moe_intermediate_size\": 768,\n"
                           "  \"norm_topk_prob\": true,\n"
                           "  \"num_attention_heads\": 32,\n"
                           "  \"num_experts\": 128,\n"
                           "  \"num_experts_per_tok\": 8,\n"
                           "  \"num_hidden_layers\": 48,\n"
                           "  \"num_key_value_heads\": 4,\n"
                           "  \"output_router_logits\": false,\n"
                           "  \"rms_norm_eps\": 1e-06,\n"
                           "  \"rope_scaling\": null,\n"
                           "  \"rope_theta\": 1000000.0,\n"
                           "  \"router_aux_loss_coef\": 0.001,\n"
                           "  \"sliding_window\": null,\n"
                           "  \"tie_word_embeddings\": false,\n"
                           "  \"torch_dtype\": \"bfloat16\",\n"
                           "  \"transformers_version\": \"4.51.0\",\n"
                           "  \"use_cache\": true,\n"
                           "  \"use_sliding_window\": false,\n"
                           "  \"vocab_size\": 151936\n"
                           "}\n";

/* deepseek-ai/DeepSeek-V3 config.json (the bf16 conversion: without its
 * fp8 quantization_config and auto_map) */
static const char *DSV3 =
    "{\n"
    "  \"architectures\": [\"DeepseekV3ForCausalLM\"],\n"
    "  \"attention_bias\": false,\n"
    "  \"attention_dropout\": 0.0,\n"
    "  \"aux_loss_alpha\": 0.001,\n"
    "  \"bos_token_id\": 0,\n"
    "  \"eos_token_id\": 1,\n"
    "  \"ep_size\": 1,\n"
    "  \"first_k_dense_replace\": 3,\n"
    "  \"hidden_act\": \"silu\",\n"
    "  \"hidden_size\": 7168,\n"
    "  \"initializer_range\": 0.02,\n"
    "  \"intermediate_size\": 18432,\n"
    "  \"kv_lora_rank\": 512,\n"
    "  \"max_position_embeddings\": 163840,\n"
    "  \"model_type\": \"deepseek_v3\",\n"
    "  \"moe_intermediate_size\": 2048,\n"
    "  \"moe_layer_freq\": 1,\n"
    "  \"n_group\": 8,\n"
    "  \"n_routed_experts\": 256,\n"
    "  \"n_shared_experts\": 1,\n"
    "  \"norm_topk_prob\": true,\n"
    "  \"num_attention_heads\": 128,\n"
    "  \"num_experts_per_tok\": 8,\n"
    "  \"num_hidden_layers\": 61,\n"
    "  \"num_key_value_heads\": 128,\n"
    "  \"num_nextn_predict_layers\": 1,\n"
    "  \"q_lora_rank\": 1536,\n"
    "  \"qk_nope_head_dim\": 128,\n"
    "  \"qk_rope_head_dim\": 64,\n"
    "  \"rms_norm_eps\": 1e-06,\n"
    "  \"rope_scaling\": {\"beta_fast\": 32, \"beta_slow\": 1, \"factor\": 40, "
    "\"mscale\": 1.0, \"mscale_all_dim\": 1.0, "
    "\"original_max_position_embeddings\": 4096, \"type\": \"yarn\"},\n"
    "  \"rope_theta\": 10000,\n"
    "  \"routed_scaling_factor\": 2.5,\n"
    "  \"scoring_func\": \"sigmoid\",\n"
    "  \"seq_aux\": true,\n"
    "  \"tie_word_embeddings\": false,\n"
    "  \"topk_group\": 4,\n"
    "  \"topk_method\": \"noaux_tc\",\n"
    "  \"torch_dtype\": \"bfloat16\",\n"
    "  \"transformers_version\": \"4.33.1\",\n"
    "  \"use_cache\": true,\n"
    "  \"v_head_dim\": 128,\n"
    "  \"vocab_size\": 129280\n"
    "}\n";

/* `base` with field `key` set to the JSON `value` (NULL: removed). Returns a
 * malloc'ed text. Several edits: call again on the result. */
static char *edit(const char *base, const char *key, const char *value)
{
    cJSON *root = cJSON_Parse(base);
    if (!root)
        abort();
    cJSON_DeleteItemFromObjectCaseSensitive(root, key);
    if (value) {
        cJSON *v = cJSON_Parse(value);
        if (!v)
            abort();
        cJSON_AddItemToObject(root, key, v);
    }
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    return s;
}

/* Parses `json` named "config.json", expects `want` and every non-NULL needle. */
static void expect(const char *label, const char *json, enum moe_status want, const char *needle1,
                   const char *needle2, struct moe_config *out)
{
    struct moe_config cfg;
    struct moe_error err = {0};
    enum moe_status st = moe_config_parse(json, "config.json", &cfg, &err);
    CHECKF(st == want, "%s: got %s (%s), want %s", label, moe_status_name(st), st ? err.msg : "",
           moe_status_name(want));
    if (st != MOE_OK) {
        CHECKF(!strncmp(err.msg, "config.json: ", 13),
               "%s: message '%s' does not start with "
               "the file name",
               label, err.msg);
        CHECKF(!strchr(err.msg, '\n'), "%s: message is not one line", label);
    }
    if (needle1)
        CHECKF(strstr(err.msg, needle1), "%s: message '%s' lacks '%s'", label, err.msg, needle1);
    if (needle2)
        CHECKF(strstr(err.msg, needle2), "%s: message '%s' lacks '%s'", label, err.msg, needle2);
    if (out)
        *out = cfg;
}

/* edit + expect in one step */
static void expect_edit(const char *base, const char *key, const char *value, enum moe_status want,
                        const char *needle1, const char *needle2, struct moe_config *out)
{
    char label[256];
    snprintf(label, sizeof label, "%s %s=%s", strstr(base, "Mixtral") ? "mixtral" : "qwen3", key,
             value ? value : "(absent)");
    char *j = edit(base, key, value);
    expect(label, j, want, needle1, needle2, out);
    free(j);
}

static void test_mixtral(void)
{
    struct moe_config c;
    memset(&c, 0xff, sizeof c);
    expect("mixtral", MIXTRAL, MOE_OK, NULL, NULL, &c);
    CHECK(c.arch == MOE_ARCH_MIXTRAL);
    CHECK(c.d_model == 4096 && c.n_layer == 32 && c.n_head == 32 && c.n_kv_head == 8);
    CHECK(c.d_head == 128 && c.vocab_size == 32000 && c.n_expert == 8 && c.top_k == 2);
    CHECK(c.d_ff_expert == 14336 && c.d_ff_dense == 0);
    CHECK(c.norm_topk_prob && !c.qk_norm && !c.tie_word_embeddings);
    CHECK(c.rms_eps == 1e-5f && c.rope_theta == 1e6f && c.max_pos == 32768);
    CHECK(c.bos_id == 1 && c.n_eos == 1 && c.eos_ids[0] == 2);
    int n_moe = 0;
    for (int l = 0; l < MOE_MAX_LAYERS; l++)
        n_moe += c.layer_is_moe[l];
    CHECK(n_moe == 32 && c.layer_is_moe[31] && !c.layer_is_moe[32]);

    /* defaults (transformers MixtralConfig) */
    char *j = edit(MIXTRAL, "num_key_value_heads", NULL);
    char *k = edit(j, "rope_theta", NULL);
    free(j);
    j = edit(k, "rms_norm_eps", NULL);
    free(k);
    k = edit(j, "max_position_embeddings", NULL);
    free(j);
    j = edit(k, "bos_token_id", NULL);
    free(k);
    k = edit(j, "eos_token_id", NULL);
    free(j);
    j = edit(k, "hidden_act", NULL);
    free(k);
    k = edit(j, "tie_word_embeddings", NULL);
    free(j);
    j = edit(k, "sliding_window", NULL);
    free(k);
    expect("mixtral defaults", j, MOE_OK, NULL, NULL, &c);
    free(j);
    CHECK(c.n_kv_head == 32 && c.d_head == 128 && c.rope_theta == 1e6f && c.rms_eps == 1e-5f);
    CHECK(c.max_pos == 131072 && c.bos_id == 1 && c.n_eos == 1 && c.eos_ids[0] == 2);
    CHECK(!c.tie_word_embeddings);

    /* num_experts is an alias; explicit head_dim null is "absent" */
    j = edit(MIXTRAL, "num_local_experts", NULL);
    k = edit(j, "num_experts", "4");
    expect("mixtral num_experts alias", k, MOE_OK, NULL, NULL, &c);
    CHECK(c.n_expert == 4);
    free(j);
    free(k);
    expect_edit(MIXTRAL, "head_dim", "null", MOE_OK, NULL, NULL, &c);
    CHECK(c.d_head == 128);
    expect_edit(MIXTRAL, "head_dim", "64", MOE_OK, NULL, NULL, &c);
    CHECK(c.d_head == 64);
    /* architectures absent: model_type decides */
    expect_edit(MIXTRAL, "architectures", NULL, MOE_OK, NULL, NULL, &c);
    CHECK(c.arch == MOE_ARCH_MIXTRAL);
    /* eos as a list; bos null */
    expect_edit(MIXTRAL, "eos_token_id", "[2, 7, 9]", MOE_OK, NULL, NULL, &c);
    CHECK(c.n_eos == 3 && c.eos_ids[0] == 2 && c.eos_ids[2] == 9);
    expect_edit(MIXTRAL, "bos_token_id", "null", MOE_OK, NULL, NULL, &c);
    CHECK(c.bos_id == -1);
    expect_edit(MIXTRAL, "eos_token_id", "[]", MOE_OK, NULL, NULL, &c);
    CHECK(c.n_eos == 0);
    expect_edit(MIXTRAL, "eos_token_id", "null", MOE_OK, NULL, NULL, &c);
    CHECK(c.n_eos == 0 && c.bos_id == 1);
    /* fine: training-only fields, Mixtral's ignored norm_topk_prob, a window >= max_pos */
    expect_edit(MIXTRAL, "router_jitter_noise", "0.1", MOE_OK, NULL, NULL, NULL);
    expect_edit(MIXTRAL, "output_router_logits", "true", MOE_OK, NULL, NULL, NULL);
    expect_edit(MIXTRAL, "norm_topk_prob", "false", MOE_OK, NULL, NULL, &c);
    CHECK(c.norm_topk_prob);
    expect_edit(MIXTRAL, "sliding_window", "32768", MOE_OK, NULL, NULL, NULL);
    expect_edit(MIXTRAL, "sliding_window", "4096", MOE_ERR_UNSUPPORTED, "'sliding_window'", "4096",
                NULL);
    expect_edit(MIXTRAL, "sliding_window", "\"big\"", MOE_ERR_FORMAT, "'sliding_window'", NULL,
                NULL);
    /* v5-style rope_parameters */
    expect_edit(MIXTRAL, "rope_parameters", "{\"rope_type\": \"default\", \"rope_theta\": 5e5}",
                MOE_OK, NULL, NULL, &c);
    CHECK(c.rope_theta == 5e5f);
    expect_edit(MIXTRAL, "rope_parameters", "{\"rope_type\": \"yarn\", \"factor\": 4.0}",
                MOE_ERR_FORMAT, "'rope_parameters' lacks 'original_max_position_embeddings'", NULL,
                NULL);
    expect_edit(MIXTRAL, "rope_parameters", "{\"rope_type\": \"dynamic\", \"factor\": 4.0}",
                MOE_ERR_UNSUPPORTED, "'rope_parameters'", "dynamic", NULL);
    expect_edit(MIXTRAL, "tie_word_embeddings", "true", MOE_OK, NULL, NULL, &c);
    CHECK(c.tie_word_embeddings);
}

static void test_qwen3(void)
{
    struct moe_config c;
    expect("qwen3", QWEN3, MOE_OK, NULL, NULL, &c);
    CHECK(c.arch == MOE_ARCH_QWEN3_MOE);
    CHECK(c.d_model == 2048 && c.n_layer == 48 && c.n_head == 32 && c.n_kv_head == 4);
    CHECK(c.d_head == 128 && c.vocab_size == 151936 && c.n_expert == 128 && c.top_k == 8);
    CHECK(c.d_ff_expert == 768 && c.d_ff_dense == 6144);
    CHECK(c.norm_topk_prob && c.qk_norm && !c.tie_word_embeddings);
    CHECK(c.rms_eps == 1e-6f && c.rope_theta == 1e6f && c.max_pos == 40960);
    CHECK(c.bos_id == 151643 && c.n_eos == 1 && c.eos_ids[0] == 151645);
    int n_moe = 0;
    for (int l = 0; l < MOE_MAX_LAYERS; l++)
        n_moe += c.layer_is_moe[l];
    CHECK(n_moe == 48);

    /* defaults (transformers Qwen3MoeConfig) */
    const char *drop[] = {"norm_topk_prob",  "rope_theta",          "rms_norm_eps",
                          "head_dim",        "bos_token_id",        "eos_token_id",
                          "mlp_only_layers", "decoder_sparse_step", "max_position_embeddings"};
    char *j = strdup(QWEN3);
    for (size_t i = 0; i < sizeof drop / sizeof drop[0]; i++) {
        char *k = edit(j, drop[i], NULL);
        free(j);
        j = k;
    }
    expect("qwen3 defaults", j, MOE_OK, NULL, NULL, &c);
    free(j);
    CHECK(!c.norm_topk_prob && c.rope_theta == 1e4f && c.rms_eps == 1e-6f);
    CHECK(c.d_head == 64 && c.bos_id == -1 && c.n_eos == 0 && c.max_pos == 32768);
    CHECK(c.layer_is_moe[0] && c.layer_is_moe[47]);

    /* decoder_sparse_step 2 and mlp_only_layers */
    j = edit(QWEN3, "decoder_sparse_step", "2");
    char *k = edit(j, "mlp_only_layers", "[3, 5]");
    expect("qwen3 sparse step", k, MOE_OK, NULL, NULL, &c);
    free(j);
    free(k);
    CHECK(!c.layer_is_moe[0] && c.layer_is_moe[1] && !c.layer_is_moe[2] && !c.layer_is_moe[3]);
    CHECK(!c.layer_is_moe[4] && c.layer_is_moe[47] && !c.layer_is_moe[46]);
    expect_edit(QWEN3, "mlp_only_layers", "[0, 47]", MOE_OK, NULL, NULL, &c);
    CHECK(!c.layer_is_moe[0] && c.layer_is_moe[1] && !c.layer_is_moe[47]);
    /* num_experts 0: a dense model */
    expect_edit(QWEN3, "num_experts", "0", MOE_OK, NULL, NULL, &c);
    CHECK(c.n_expert == 0 && !c.layer_is_moe[0] && !c.layer_is_moe[47]);
    /* intermediate_size only required when a layer is dense */
    expect_edit(QWEN3, "intermediate_size", NULL, MOE_OK, NULL, NULL, &c);
    CHECK(c.d_ff_dense == 0);
    j = edit(QWEN3, "intermediate_size", NULL);
    k = edit(j, "mlp_only_layers", "[2]");
    expect("qwen3 dense layer without intermediate_size", k, MOE_ERR_FORMAT, "'intermediate_size'",
           "layer 2", NULL);
    free(j);
    free(k);
    /* rope: default, linear, llama3, yarn (the values: golden/mixtral_rope_*) */
    expect_edit(QWEN3, "rope_scaling", "{\"rope_type\": \"default\"}", MOE_OK, NULL, NULL, &c);
    CHECK(c.rope_theta == 1e6f && c.rope.type == MOE_ROPE_DEFAULT && c.rope.attention_factor == 1);
    expect_edit(QWEN3, "rope_scaling",
                "{\"rope_type\": \"yarn\", \"factor\": 4.0, "
                "\"original_max_position_embeddings\": 32768}",
                MOE_OK, NULL, NULL, &c);
    CHECK(c.rope.type == MOE_ROPE_YARN && c.rope.factor == 4.0f && c.rope.beta_fast == 32 &&
          c.rope.beta_slow == 1 && c.rope.truncate && c.rope.original_max_pos == 32768);
    CHECK(fabsf(c.rope.attention_factor - (float)(0.1 * log(4.0) + 1.0)) < 1e-7f);
    expect_edit(QWEN3, "rope_scaling",
                "{\"rope_type\": \"yarn\", \"factor\": 40, \"mscale\": 1.0, \"mscale_all_dim\": "
                "1.0, \"original_max_position_embeddings\": 4096}",
                MOE_OK, NULL, NULL, &c);
    CHECK(c.rope.attention_factor == 1.0f); /* DeepSeek-V3's: mscale / mscale_all_dim */
    expect_edit(QWEN3, "rope_scaling", "{\"type\": \"linear\", \"factor\": 2.0}", MOE_OK, NULL,
                NULL, &c);
    CHECK(c.rope.type == MOE_ROPE_LINEAR && c.rope.factor == 2.0f);
    expect_edit(QWEN3, "rope_scaling", "{\"type\": \"linear\", \"factor\": -2.0}", MOE_ERR_FORMAT,
                "'factor' = -2", NULL, NULL);
    expect_edit(QWEN3, "rope_scaling", "{\"type\": \"longrope\", \"factor\": 2.0}",
                MOE_ERR_UNSUPPORTED, "'rope_scaling'", "longrope", NULL);
    expect_edit(QWEN3, "rope_scaling", "{\"factor\": 2.0}", MOE_ERR_UNSUPPORTED, "'rope_scaling'",
                NULL, NULL);
    expect_edit(QWEN3, "rope_scaling", "4", MOE_ERR_FORMAT, "'rope_scaling'", NULL, NULL);
    expect_edit(QWEN3, "rope_parameters",
                "{\"rope_type\": \"default\", \"partial_rotary_factor\": 0.5}", MOE_ERR_UNSUPPORTED,
                "'rope_parameters'", "partial", NULL);
    /* refusals */
    expect_edit(QWEN3, "use_sliding_window", "true", MOE_ERR_UNSUPPORTED, "'use_sliding_window'",
                NULL, NULL);
    expect_edit(QWEN3, "sliding_window", "4096", MOE_OK, NULL, NULL, NULL); /* unused */
    expect_edit(QWEN3, "attention_bias", "true", MOE_ERR_UNSUPPORTED, "'attention_bias'", NULL,
                NULL);
    expect_edit(QWEN3, "attention_bias", "1", MOE_ERR_FORMAT, "'attention_bias'", NULL, NULL);
    expect_edit(QWEN3, "num_experts_per_tok", "129", MOE_ERR_FORMAT, "'num_experts_per_tok'", "129",
                NULL);
    expect_edit(QWEN3, "num_experts_per_tok", "128", MOE_OK, NULL, NULL, NULL);
    expect_edit(QWEN3, "mlp_only_layers", "[48]", MOE_ERR_FORMAT, "'mlp_only_layers'", "48", NULL);
    expect_edit(QWEN3, "mlp_only_layers", "[-1]", MOE_ERR_FORMAT, "'mlp_only_layers'", NULL, NULL);
    expect_edit(QWEN3, "mlp_only_layers", "3", MOE_ERR_FORMAT, "'mlp_only_layers'", NULL, NULL);
    expect_edit(QWEN3, "decoder_sparse_step", "0", MOE_ERR_FORMAT, "'decoder_sparse_step'", NULL,
                NULL);
    expect_edit(QWEN3, "moe_intermediate_size", NULL, MOE_ERR_FORMAT,
                "missing required field 'moe_intermediate_size'", NULL, NULL);
    expect_edit(QWEN3, "norm_topk_prob", "\"yes\"", MOE_ERR_FORMAT, "'norm_topk_prob'", NULL, NULL);
    expect_edit(QWEN3, "model_type", "\"mixtral\"", MOE_ERR_FORMAT, "'model_type'",
                "Qwen3MoeForCausalLM", NULL);
    expect_edit(QWEN3, "eos_token_id", "151936", MOE_ERR_FORMAT, "'eos_token_id'", "151936", NULL);
    expect_edit(QWEN3, "bos_token_id", "200000", MOE_ERR_FORMAT, "'bos_token_id'", NULL, NULL);
    expect_edit(QWEN3, "quantization_config", "{\"quant_method\": \"fp8\"}", MOE_ERR_UNSUPPORTED,
                "'quantization_config'", "fp8", NULL);
}

/* Checks shared by both architectures. */
static void test_common_errors(void)
{
    const char *bases[2] = {MIXTRAL, QWEN3};
    for (int b = 0; b < 2; b++) {
        const char *base = bases[b];
        /* architecture */
        expect_edit(base, "architectures", "[\"LlamaForCausalLM\"]", MOE_ERR_UNSUPPORTED,
                    "config.json: architecture 'LlamaForCausalLM' is not supported (supported: "
                    "MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, "
                    "OlmoeForCausalLM, DeepseekV3ForCausalLM)",
                    NULL, NULL);
        expect_edit(base, "architectures", "[]", MOE_ERR_FORMAT, "'architectures'", NULL, NULL);
        expect_edit(base, "architectures", "\"MixtralForCausalLM\"", MOE_ERR_FORMAT,
                    "'architectures'", NULL, NULL);
        char *j = edit(base, "architectures", NULL);
        char *k = edit(j, "model_type", "\"llama\"");
        expect("model_type llama", k, MOE_ERR_UNSUPPORTED, "model_type 'llama'", NULL, NULL);
        free(k);
        k = edit(j, "model_type", NULL);
        expect("no arch", k, MOE_ERR_FORMAT, "'architectures'", "'model_type'", NULL);
        free(k);
        free(j);

        /* required fields */
        const char *required[] = {"hidden_size", "num_hidden_layers", "num_attention_heads",
                                  "vocab_size", "num_experts_per_tok"};
        for (size_t i = 0; i < sizeof required / sizeof required[0]; i++) {
            char want[128];
            snprintf(want, sizeof want, "config.json: missing required field '%s'", required[i]);
            expect_edit(base, required[i], NULL, MOE_ERR_FORMAT, want, NULL, NULL);
            expect_edit(base, required[i], "null", MOE_ERR_FORMAT, want, NULL, NULL);
        }
        /* types and ranges */
        expect_edit(base, "hidden_size", "\"64\"", MOE_ERR_FORMAT,
                    "config.json: field 'hidden_size' must be a positive integer, got \"64\"", NULL,
                    NULL);
        expect_edit(base, "hidden_size", "0", MOE_ERR_FORMAT, "'hidden_size'", "got 0", NULL);
        expect_edit(base, "hidden_size", "-4096", MOE_ERR_FORMAT, "'hidden_size'", "-4096", NULL);
        expect_edit(base, "hidden_size", "4096.5", MOE_ERR_FORMAT, "'hidden_size'", "4096.5", NULL);
        expect_edit(base, "hidden_size", "1e12", MOE_ERR_UNSUPPORTED, "'hidden_size'", NULL, NULL);
        expect_edit(base, "vocab_size", "true", MOE_ERR_FORMAT, "'vocab_size'", "true", NULL);
        expect_edit(base, "num_key_value_heads", "0", MOE_ERR_FORMAT, "'num_key_value_heads'", NULL,
                    NULL);
        expect_edit(base, "num_key_value_heads", "5", MOE_ERR_FORMAT, "num_key_value_heads = 5",
                    "num_attention_heads = 32", NULL);
        expect_edit(base, "num_hidden_layers", "257", MOE_ERR_UNSUPPORTED, "'num_hidden_layers'",
                    "256", NULL);
        expect_edit(base, "num_hidden_layers", "256", MOE_OK, NULL, NULL, NULL);
        expect_edit(base, "num_experts_per_tok", "0", MOE_ERR_FORMAT, "'num_experts_per_tok'", NULL,
                    NULL);
        expect_edit(base, "head_dim", "-1", MOE_ERR_FORMAT, "'head_dim'", NULL, NULL);
        expect_edit(base, "rms_norm_eps", "0", MOE_ERR_FORMAT, "'rms_norm_eps'", NULL, NULL);
        expect_edit(base, "rms_norm_eps", "\"1e-5\"", MOE_ERR_FORMAT, "'rms_norm_eps'", NULL, NULL);
        expect_edit(base, "rope_theta", "-1", MOE_ERR_FORMAT, "'rope_theta'", NULL, NULL);
        expect_edit(base, "rope_theta", "1e300", MOE_ERR_FORMAT, "'rope_theta'", NULL, NULL);
        expect_edit(base, "max_position_embeddings", "0", MOE_ERR_FORMAT,
                    "'max_position_embeddings'", NULL, NULL);
        expect_edit(base, "tie_word_embeddings", "0", MOE_ERR_FORMAT, "'tie_word_embeddings'", NULL,
                    NULL);
        expect_edit(base, "eos_token_id", "[1, 2, 3, 4, 5, 6, 7, 8, 9]", MOE_ERR_UNSUPPORTED,
                    "'eos_token_id'", "8", NULL);
        expect_edit(base, "eos_token_id", "[1, \"2\"]", MOE_ERR_FORMAT, "'eos_token_id'", NULL,
                    NULL);
        expect_edit(base, "eos_token_id", "-2", MOE_ERR_FORMAT, "'eos_token_id'", NULL, NULL);
        expect_edit(base, "bos_token_id", "1.5", MOE_ERR_FORMAT, "'bos_token_id'", NULL, NULL);
        /* refused features */
        expect_edit(base, "hidden_act", "\"gelu\"", MOE_ERR_UNSUPPORTED, "'hidden_act'", "gelu",
                    NULL);
        expect_edit(base, "hidden_act", "3", MOE_ERR_FORMAT, "'hidden_act'", NULL, NULL);
        expect_edit(base, "rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 8.0}",
                    MOE_ERR_FORMAT, "'rope_scaling' lacks 'low_freq_factor'", NULL, NULL);
        expect_edit(base, "rope_scaling",
                    "{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 4, "
                    "\"high_freq_factor\": 1, \"original_max_position_embeddings\": 8192}",
                    MOE_ERR_FORMAT, "high_freq_factor 1 must exceed", NULL, NULL);
        /* a float past INT_MAX once became an int (UB; found by fuzz_model_config) */
        expect_edit(base, "rope_scaling",
                    "{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1, "
                    "\"high_freq_factor\": 4, \"original_max_position_embeddings\": 3.2e93}",
                    MOE_ERR_FORMAT, "'original_max_position_embeddings' = 3.2e+93", NULL, NULL);
        expect_edit(base, "rope_scaling",
                    "{\"rope_type\": \"yarn\", \"factor\": 4.0, "
                    "\"original_max_position_embeddings\": 64.5}",
                    MOE_ERR_FORMAT,
                    "'original_max_position_embeddings' = 64.5 is not a whole number", NULL, NULL);
        expect_edit(base, "rope_scaling", "{\"rope_type\": \"su\", \"factor\": 8.0}",
                    MOE_ERR_UNSUPPORTED, "'rope_scaling'", "su", NULL);
        expect_edit(base, "rope_scaling", "null", MOE_OK, NULL, NULL, NULL);
    }
    /* top_k > n_expert on Mixtral */
    expect_edit(MIXTRAL, "num_experts_per_tok", "9", MOE_ERR_FORMAT, "'num_experts_per_tok'",
                "num_local_experts = 8", NULL);
    expect_edit(MIXTRAL, "num_local_experts", "0", MOE_ERR_FORMAT, "'num_local_experts'", NULL,
                NULL);
    expect_edit(MIXTRAL, "num_local_experts", NULL, MOE_ERR_FORMAT,
                "missing required field 'num_local_experts'", NULL, NULL);
    expect_edit(MIXTRAL, "intermediate_size", NULL, MOE_ERR_FORMAT,
                "missing required field 'intermediate_size'", NULL, NULL);
    /* head_dim absent and hidden not divisible */
    char *j = edit(MIXTRAL, "hidden_size", "4000");
    char *k = edit(j, "num_attention_heads", "48");
    char *l = edit(k, "num_key_value_heads", "8");
    expect("head_dim indivisible", l, MOE_ERR_FORMAT, "'head_dim'", "4000", NULL);
    free(j);
    free(k);
    free(l);

    /* not JSON, not an object */
    expect("not json", "{\"hidden_size\": ", MOE_ERR_FORMAT, "not valid JSON", NULL, NULL);
    expect("trailing", "{} {}", MOE_ERR_FORMAT, "not valid JSON", NULL, NULL);
    expect("array", "[1]", MOE_ERR_FORMAT, "not a JSON object", NULL, NULL);
    expect("empty", "", MOE_ERR_FORMAT, "config.json", NULL, NULL);
    struct moe_config c;
    struct moe_error err;
    CHECK(moe_config_parse(NULL, "x", &c, &err) == MOE_ERR_INVALID);
}

static void test_load(void)
{
    struct moe_config c;
    struct moe_error err = {0};
    const char *p = test_write_temp("config.json", QWEN3, strlen(QWEN3));
    char path[600];
    snprintf(path, sizeof path, "%s", p);
    CHECKF(moe_config_load(path, &c, &err) == MOE_OK, "%s", err.msg);
    CHECK(c.arch == MOE_ARCH_QWEN3_MOE && c.n_layer == 48);

    /* messages carry the path */
    const char *llama = "{\"architectures\": [\"LlamaForCausalLM\"]}";
    p = test_write_temp("config.json", llama, strlen(llama));
    CHECK(moe_config_load(p, &c, &err) == MOE_ERR_UNSUPPORTED);
    CHECKF(strstr(err.msg, "config.json: architecture 'LlamaForCausalLM'"), "%s", err.msg);

    char missing[600];
    snprintf(missing, sizeof missing, "%s/nope/config.json", test_temp_dir());
    CHECK(moe_config_load(missing, &c, &err) == MOE_ERR_NOT_FOUND);
    CHECKF(strstr(err.msg, "config.json: No such file or directory"), "%s", err.msg);

    CHECK(moe_config_load(test_temp_dir(), &c, &err) == MOE_ERR_IO);
    CHECKF(strstr(err.msg, test_temp_dir()), "%s", err.msg);

    p = test_write_temp("config.json", "{\"a\":\0}", 7);
    CHECK(moe_config_load(p, &c, &err) == MOE_ERR_FORMAT);
    CHECK(moe_config_load(NULL, &c, &err) == MOE_ERR_INVALID);

    /* the benchmark model's config, if the shared folder is there */
    const char *bench = "/work/shared/models/bench-moe-640M.config.json";
    struct stat sb;
    if (stat(bench, &sb) == 0) {
        CHECKF(moe_config_load(bench, &c, &err) == MOE_OK, "%s", err.msg);
        CHECK(c.d_model == 1024 && c.n_layer == 8 && c.n_expert == 8 && c.d_ff_expert == 2816);
    }
}

/* Qwen2-MoE: Qwen3's layout without q/k norms, with q/k/v biases and a
 * shared expert; defaults as transformers' Qwen2MoeConfig. */
static void test_qwen2(void)
{
    char *q2 = edit(QWEN3, "architectures", "[\"Qwen2MoeForCausalLM\"]");
    char *j = edit(q2, "model_type", "\"qwen2_moe\"");
    free(q2);
    char *k = edit(j, "shared_expert_intermediate_size", "1408");
    struct moe_config c;
    expect("qwen2", k, MOE_OK, NULL, NULL, &c);
    CHECK(c.arch == MOE_ARCH_QWEN2_MOE && !c.qk_norm && c.qkv_bias && c.d_ff_shared == 1408);
    CHECK(!strcmp(moe_arch_model_type(c.arch), "qwen2_moe"));
    expect("qwen2 defaults", j, MOE_OK, NULL, NULL, &c);
    CHECK(c.d_ff_shared == 5632 && c.qkv_bias); /* transformers' defaults */
    expect_edit(k, "qkv_bias", "false", MOE_OK, NULL, NULL, &c);
    CHECK(!c.qkv_bias);
    expect_edit(k, "qkv_bias", "1", MOE_ERR_FORMAT, "'qkv_bias'", NULL, NULL);
    expect_edit(k, "shared_expert_intermediate_size", "-4", MOE_ERR_FORMAT,
                "'shared_expert_intermediate_size'", NULL, NULL);
    expect_edit(k, "model_type", "\"qwen3_moe\"", MOE_ERR_FORMAT, "contradicts", NULL, NULL);
    expect_edit(k, "use_sliding_window", "true", MOE_ERR_UNSUPPORTED, "'use_sliding_window'", NULL,
                NULL);
    free(k);
    free(j);
}

/* OLMoE: experts of intermediate_size, q/k norms over all heads. */
static void test_olmoe(void)
{
    char *a = edit(MIXTRAL, "architectures", "[\"OlmoeForCausalLM\"]");
    char *j = edit(a, "model_type", "\"olmoe\"");
    free(a);
    struct moe_config c;
    expect("olmoe", j, MOE_OK, NULL, NULL, &c);
    CHECK(c.arch == MOE_ARCH_OLMOE && c.qk_norm_full && !c.qk_norm && !c.qkv_bias);
    CHECK(c.d_ff_expert == 14336 && c.layer_is_moe[0] && !c.norm_topk_prob);
    CHECK(!strcmp(moe_arch_model_type(c.arch), "olmoe"));
    expect_edit(j, "clip_qkv", "8.0", MOE_ERR_UNSUPPORTED, "'clip_qkv'", "8", NULL);
    expect_edit(j, "clip_qkv", "null", MOE_OK, NULL, NULL, NULL);
    expect_edit(j, "head_dim", "64", MOE_ERR_UNSUPPORTED, "q_norm spans hidden_size", NULL, NULL);
    free(j);
}

/* DeepSeek-V3: latent attention sizes, grouped sigmoid routing, shared
 * experts, dense first layers, YaRN's softmax scale, and every refusal. */
static void test_deepseek_v3(void)
{
    struct moe_config c;
    expect("deepseek_v3", DSV3, MOE_OK, NULL, NULL, &c);
    CHECK(c.arch == MOE_ARCH_DEEPSEEK_V3 && c.mla && c.router_sigmoid);
    CHECK(!strcmp(moe_arch_model_type(c.arch), "deepseek_v3"));
    CHECK(c.d_head == 64 && c.qk_nope_dim == 128 && c.v_head_dim == 128);
    CHECK(c.kv_lora_rank == 512 && c.q_lora_rank == 1536 && c.n_kv_head == 128);
    CHECK(c.n_expert == 256 && c.top_k == 8 && c.n_group == 8 && c.topk_group == 4);
    CHECK(c.d_ff_expert == 2048 && c.d_ff_shared == 2048 && c.d_ff_dense == 18432);
    CHECK(c.first_k_dense == 3 && !c.layer_is_moe[2] && c.layer_is_moe[3] && c.layer_is_moe[60]);
    CHECK(c.norm_topk_prob && c.rope_interleave && fabsf(c.routed_scaling - 2.5f) < 1e-7f);
    CHECK(c.n_mtp == 1 && c.bos_id == 0 && c.n_eos == 1 && c.eos_ids[0] == 1);
    CHECK(c.rope.type == MOE_ROPE_YARN && c.rope.factor == 40.0f &&
          c.rope.original_max_pos == 4096);
    CHECK(fabsf(c.rope.attention_factor - 1.0f) < 1e-7f); /* mscale == mscale_all_dim */
    double ms = 0.1 * log(40.0) + 1.0;
    CHECKF(fabs(c.attn_scale - ms * ms / sqrt(192.0)) < 1e-7, "attn_scale %g", c.attn_scale);
    CHECK(moe_config_kv_token_elems(&c, 1) == 576 && moe_config_kv_token_elems(&c, 8) == 576);

    char *j = edit(DSV3, "q_lora_rank", "null"); /* DeepSeek-V2-Lite style: q_proj */
    expect("dsv3 q_lora_rank=null", j, MOE_OK, NULL, NULL, &c);
    CHECK(c.q_lora_rank == 0);
    free(j);
    j = edit(DSV3, "rope_scaling", NULL);
    expect("dsv3 no rope scaling", j, MOE_OK, NULL, NULL, &c);
    CHECKF(fabs(c.attn_scale - 1.0 / sqrt(192.0)) < 1e-8, "attn_scale %g", c.attn_scale);
    free(j);
    j = edit(DSV3, "first_k_dense_replace", "0");
    char *k = edit(j, "intermediate_size", NULL);
    expect("dsv3 all moe", k, MOE_OK, NULL, NULL, &c);
    CHECK(c.layer_is_moe[0] && c.d_ff_dense == 0);
    free(j);
    free(k);
    expect_edit(DSV3, "q_lora_rank", NULL, MOE_ERR_FORMAT, "'q_lora_rank'", "null", NULL);
    expect_edit(DSV3, "kv_lora_rank", NULL, MOE_ERR_FORMAT, "'kv_lora_rank'", NULL, NULL);
    expect_edit(DSV3, "qk_rope_head_dim", "63", MOE_ERR_FORMAT, "'qk_rope_head_dim'", NULL, NULL);
    expect_edit(DSV3, "head_dim", "128", MOE_ERR_FORMAT, "contradicts", NULL, NULL);
    expect_edit(DSV3, "head_dim", "64", MOE_OK, NULL, NULL, NULL);
    expect_edit(DSV3, "intermediate_size", NULL, MOE_ERR_FORMAT, "'intermediate_size'",
                "first_k_dense_replace", NULL);
    expect_edit(DSV3, "num_key_value_heads", "16", MOE_ERR_UNSUPPORTED, "'num_key_value_heads'",
                NULL, NULL);
    expect_edit(DSV3, "topk_method", "\"greedy\"", MOE_ERR_UNSUPPORTED, "'topk_method'", "greedy",
                NULL);
    expect_edit(DSV3, "scoring_func", "\"softmax\"", MOE_ERR_UNSUPPORTED, "'scoring_func'", NULL,
                NULL);
    expect_edit(DSV3, "moe_layer_freq", "2", MOE_ERR_UNSUPPORTED, "'moe_layer_freq'", NULL, NULL);
    expect_edit(DSV3, "n_group", "7", MOE_ERR_FORMAT, "'n_group'", NULL, NULL);
    expect_edit(DSV3, "n_group", "256", MOE_ERR_FORMAT, "at least 2", NULL, NULL);
    expect_edit(DSV3, "topk_group", "9", MOE_ERR_FORMAT, "'topk_group'", NULL, NULL);
    j = edit(DSV3, "topk_group", "1");
    k = edit(j, "num_experts_per_tok", "40"); /* one group of 32 */
    expect("dsv3 top_k over the kept groups", k, MOE_ERR_FORMAT, "'num_experts_per_tok'",
           "topk_group", NULL);
    free(j);
    free(k);
    expect_edit(DSV3, "attention_bias", "true", MOE_ERR_UNSUPPORTED, "'attention_bias'", NULL,
                NULL);
    expect_edit(DSV3, "quantization_config", "{\"quant_method\": \"fp8\"}", MOE_ERR_UNSUPPORTED,
                "'quantization_config'", NULL, NULL);
    expect_edit(DSV3, "rope_scaling", "{\"type\": \"dynamic\", \"factor\": 2}", MOE_ERR_UNSUPPORTED,
                "'rope_scaling'", NULL, NULL);
    expect_edit(DSV3, "model_type", "\"mixtral\"", MOE_ERR_FORMAT, "contradicts", NULL, NULL);
}

int main(void)
{
    test_deepseek_v3();
    test_mixtral();
    test_qwen3();
    test_qwen2();
    test_olmoe();
    test_common_errors();
    test_load();
    return test_summary();
}
