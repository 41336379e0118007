/* config.json parser for MixtralForCausalLM, Qwen3MoeForCausalLM,
 * Qwen2MoeForCausalLM, OlmoeForCausalLM and DeepseekV3ForCausalLM.
 *
 * DeepSeek-V3 (parse_deepseek): multi-head latent attention, grouped sigmoid
 * routing with e_score_correction_bias, n_shared_experts shared experts and
 * first_k_dense_replace dense layers; its variants that change the math
 * (another topk_method or scoring_func, moe_layer_freq > 1) are refused by
 * name, and multi-token-prediction layers (num_nextn_predict_layers) are
 * counted but not used.
 *
 * Defaults follow transformers' MixtralConfig / Qwen3MoeConfig /
 * Qwen2MoeConfig (v5). Qwen2-MoE is Qwen3-MoE's layout without q/k norms,
 * with q/k/v biases (qkv_bias, default true) and a shared expert of
 * shared_expert_intermediate_size (default 5632) beside the routed ones,
 * gated per token by sigmoid(shared_expert_gate . x). The
 * fields that fix the weight shapes are required even where transformers has
 * a default (a saved config.json always holds them, and guessing a shape is
 * worse than naming the missing field): hidden_size, num_hidden_layers,
 * num_attention_heads, vocab_size, num_experts_per_tok, the expert count
 * (num_local_experts or num_experts, accepted under either name as
 * transformers' attribute_map does), intermediate_size (Mixtral) and
 * moe_intermediate_size (Qwen3; intermediate_size too when a layer is dense).
 *
 * Status codes: MOE_ERR_IO (file), MOE_ERR_FORMAT (not JSON, missing field,
 * wrong type, inconsistent values), MOE_ERR_UNSUPPORTED (valid but not
 * implemented: another architecture, rope scaling, sliding window, another
 * activation, attention bias, quantization, sizes over our limits). A JSON
 * null counts as absent, as it does for transformers.
 *
 * Fields read by transformers but ignored here because they do not change
 * the math for these architectures: Mixtral's attention_bias and
 * norm_topk_prob (Mixtral has no bias and always renormalises), Qwen3's
 * sliding_window and max_window_layers while use_sliding_window is false, and
 * training-only fields (router_jitter_noise, output_router_logits, dropout). */
#include "model_config.h"
#include "read_file.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define CFG_MAX_SIZE (1 << 24)          /* largest accepted dimension or vocabulary */
#define CFG_MAX_FILE ((size_t)16 << 20) /* largest accepted config.json */

struct cfg_ctx {
    const char *name; /* file name for messages */
    const cJSON *root;
    struct moe_error *err;
};

/* The item `key`, or NULL if absent or JSON null. */
static const cJSON *field(const struct cfg_ctx *c, const char *key)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(c->root, key);
    return cJSON_IsNull(j) ? NULL : j;
}

/* Short text of a JSON value for messages. */
static void snippet(const cJSON *j, char *buf, size_t cap)
{
    char *s = cJSON_PrintUnformatted(j);
    if (!s) {
        snprintf(buf, cap, "?");
        return;
    }
    if (strlen(s) >= cap && cap > 4)
        snprintf(buf, cap, "%.*s...", (int)(cap - 4), s);
    else
        snprintf(buf, cap, "%s", s);
    free(s);
}

static bool json_is_int(const cJSON *j)
{
    return cJSON_IsNumber(j) && isfinite(j->valuedouble) && floor(j->valuedouble) == j->valuedouble;
}

/* Integer field in [min, max] (min is 0 or 1). Absent: error if `required`,
 * else `def`. Above max: UNSUPPORTED. */
static enum moe_status get_int(const struct cfg_ctx *c, const char *key, bool required, int def,
                               int min, int max, int *out)
{
    const cJSON *j = field(c, key);
    if (!j) {
        if (required)
            return moe_error_set(c->err, MOE_ERR_FORMAT, "%s: missing required field '%s'", c->name,
                                 key);
        *out = def;
        return MOE_OK;
    }
    char sn[80];
    if (!json_is_int(j) || j->valuedouble < min) {
        snippet(j, sn, sizeof sn);
        return moe_error_set(c->err, MOE_ERR_FORMAT, "%s: field '%s' must be a %s integer, got %s",
                             c->name, key, min > 0 ? "positive" : "non-negative", sn);
    }
    if (j->valuedouble > max) {
        snippet(j, sn, sizeof sn);
        return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                             "%s: field '%s' = %s is larger than the supported %d", c->name, key,
                             sn, max);
    }
    *out = (int)j->valuedouble;
    return MOE_OK;
}

/* Positive finite number; absent: `def`. */
static enum moe_status get_pos_float(const struct cfg_ctx *c, const cJSON *j, const char *key,
                                     double def, float *out)
{
    if (!j) {
        *out = (float)def;
        return MOE_OK;
    }
    if (!cJSON_IsNumber(j) || !isfinite(j->valuedouble) || j->valuedouble <= 0 ||
        !isfinite((float)j->valuedouble) || (float)j->valuedouble <= 0) {
        char sn[80];
        snippet(j, sn, sizeof sn);
        return moe_error_set(c->err, MOE_ERR_FORMAT,
                             "%s: field '%s' must be a positive number, got %s", c->name, key, sn);
    }
    *out = (float)j->valuedouble;
    return MOE_OK;
}

static enum moe_status get_bool(const struct cfg_ctx *c, const char *key, bool def, bool *out)
{
    const cJSON *j = field(c, key);
    if (!j) {
        *out = def;
        return MOE_OK;
    }
    if (!cJSON_IsBool(j)) {
        char sn[80];
        snippet(j, sn, sizeof sn);
        return moe_error_set(c->err, MOE_ERR_FORMAT, "%s: field '%s' must be true or false, got %s",
                             c->name, key, sn);
    }
    *out = cJSON_IsTrue(j);
    return MOE_OK;
}

/* String field or NULL if absent; non-string is an error. */
static enum moe_status get_str(const struct cfg_ctx *c, const char *key, const char **out)
{
    const cJSON *j = field(c, key);
    *out = NULL;
    if (!j)
        return MOE_OK;
    if (!cJSON_IsString(j)) {
        char sn[80];
        snippet(j, sn, sizeof sn);
        return moe_error_set(c->err, MOE_ERR_FORMAT, "%s: field '%s' must be a string, got %s",
                             c->name, key, sn);
    }
    *out = j->valuestring;
    return MOE_OK;
}

/* ---- architecture ----------------------------------------------------------- */

static enum moe_status parse_arch(const struct cfg_ctx *c, enum moe_arch *arch)
{
    const char *model_type;
    enum moe_status st = get_str(c, "model_type", &model_type);
    if (st != MOE_OK)
        return st;
    const cJSON *archs = field(c, "architectures");
    if (archs) {
        const cJSON *first = cJSON_IsArray(archs) ? archs->child : NULL;
        if (!first || !cJSON_IsString(first)) {
            char sn[80];
            snippet(archs, sn, sizeof sn);
            return moe_error_set(c->err, MOE_ERR_FORMAT,
                                 "%s: field 'architectures' must be a non-empty list of strings, "
                                 "got %s",
                                 c->name, sn);
        }
        const char *a = first->valuestring;
        const char *want_type;
        if (!strcmp(a, "MixtralForCausalLM")) {
            *arch = MOE_ARCH_MIXTRAL;
            want_type = "mixtral";
        } else if (!strcmp(a, "Qwen3MoeForCausalLM")) {
            *arch = MOE_ARCH_QWEN3_MOE;
            want_type = "qwen3_moe";
        } else if (!strcmp(a, "Qwen2MoeForCausalLM")) {
            *arch = MOE_ARCH_QWEN2_MOE;
            want_type = "qwen2_moe";
        } else if (!strcmp(a, "OlmoeForCausalLM")) {
            *arch = MOE_ARCH_OLMOE;
            want_type = "olmoe";
        } else if (!strcmp(a, "DeepseekV3ForCausalLM")) {
            *arch = MOE_ARCH_DEEPSEEK_V3;
            want_type = "deepseek_v3";
        } else {
            return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                                 "%s: architecture '%s' is not supported (supported: "
                                 "MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, "
                                 "OlmoeForCausalLM, DeepseekV3ForCausalLM)",
                                 c->name, a);
        }
        if (model_type && strcmp(model_type, want_type) != 0)
            return moe_error_set(c->err, MOE_ERR_FORMAT,
                                 "%s: field 'model_type' = '%s' contradicts architecture '%s'",
                                 c->name, model_type, a);
        return MOE_OK;
    }
    if (!model_type)
        return moe_error_set(c->err, MOE_ERR_FORMAT,
                             "%s: missing required field 'architectures' (or 'model_type')",
                             c->name);
    if (!strcmp(model_type, "mixtral"))
        *arch = MOE_ARCH_MIXTRAL;
    else if (!strcmp(model_type, "qwen3_moe"))
        *arch = MOE_ARCH_QWEN3_MOE;
    else if (!strcmp(model_type, "qwen2_moe"))
        *arch = MOE_ARCH_QWEN2_MOE;
    else if (!strcmp(model_type, "olmoe"))
        *arch = MOE_ARCH_OLMOE;
    else if (!strcmp(model_type, "deepseek_v3"))
        *arch = MOE_ARCH_DEEPSEEK_V3;
    else
        return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                             "%s: model_type '%s' is not supported (supported: mixtral, qwen3_moe, "
                             "qwen2_moe, olmoe, deepseek_v3)",
                             c->name, model_type);
    return MOE_OK;
}

/* ---- RoPE ------------------------------------------------------------------- */

/* A number inside a rope dict: its value, or `def` when absent or null and
 * def is not NAN (NAN: required). Errors name the dict and the key. */
static enum moe_status rope_num(const struct cfg_ctx *c, const char *dict, const cJSON *rp,
                                const char *key, double def, double *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(rp, key);
    if (!v || cJSON_IsNull(v)) {
        if (isnan(def))
            return moe_error_set(c->err, MOE_ERR_FORMAT, "%s: field '%s' lacks '%s'", c->name, dict,
                                 key);
        *out = def;
        return MOE_OK;
    }
    if (!cJSON_IsNumber(v) || !(v->valuedouble > 0) || !isfinite(v->valuedouble)) {
        char sn[60];
        snippet(v, sn, sizeof sn);
        return moe_error_set(c->err, MOE_ERR_FORMAT,
                             "%s: field '%s': '%s' = %s is not a positive "
                             "number",
                             c->name, dict, key, sn);
    }
    *out = v->valuedouble;
    return MOE_OK;
}

/* original_max_position_embeddings: a positive whole number that fits an
 * int (it becomes one), like max_position_embeddings itself. */
static enum moe_status rope_orig_pos(const struct cfg_ctx *c, const char *dict, const cJSON *rp,
                                     double *out)
{
    const char *key = "original_max_position_embeddings";
    enum moe_status st = rope_num(c, dict, rp, key, NAN, out);
    if (st)
        return st;
    if (*out != floor(*out) || *out > INT_MAX)
        return moe_error_set(c->err, MOE_ERR_FORMAT,
                             "%s: field '%s': '%s' = %g is not a whole number in 1..%d", c->name,
                             dict, key, *out, INT_MAX);
    return MOE_OK;
}

#define MOE_TWO_PI 6.283185307179586

static double yarn_mscale(double scale, double m)
{
    return scale <= 1 ? 1.0 : 0.1 * m * log(scale) + 1.0;
}

/* The scaling of one rope dict whose type is `type` (not "default"). */
static enum moe_status parse_rope_scaling(const struct cfg_ctx *c, const char *dict,
                                          const cJSON *rp, const char *type, int max_pos,
                                          struct moe_rope *r)
{
    enum moe_status st;
    double factor, lo, hi, orig, bf, bs, af, ms, msa;
    if (!strcmp(type, "linear")) {
        r->type = MOE_ROPE_LINEAR;
        if ((st = rope_num(c, dict, rp, "factor", NAN, &factor)))
            return st;
        r->factor = (float)factor;
        return MOE_OK;
    }
    if (!strcmp(type, "llama3")) {
        r->type = MOE_ROPE_LLAMA3;
        if ((st = rope_num(c, dict, rp, "factor", NAN, &factor)) ||
            (st = rope_num(c, dict, rp, "low_freq_factor", NAN, &lo)) ||
            (st = rope_num(c, dict, rp, "high_freq_factor", NAN, &hi)) ||
            (st = rope_orig_pos(c, dict, rp, &orig)))
            return st;
        if (hi <= lo)
            return moe_error_set(c->err, MOE_ERR_FORMAT,
                                 "%s: field '%s': high_freq_factor %g must exceed low_freq_factor "
                                 "%g",
                                 c->name, dict, hi, lo);
        r->factor = (float)factor;
        r->low_freq_factor = (float)lo;
        r->high_freq_factor = (float)hi;
        r->original_max_pos = (int)orig;
        return MOE_OK;
    }
    if (!strcmp(type, "yarn")) {
        r->type = MOE_ROPE_YARN;
        if ((st = rope_orig_pos(c, dict, rp, &orig)) ||
            (st = rope_num(c, dict, rp, "factor", (double)max_pos / orig, &factor)) ||
            (st = rope_num(c, dict, rp, "beta_fast", 32, &bf)) ||
            (st = rope_num(c, dict, rp, "beta_slow", 1, &bs)) ||
            (st = rope_num(c, dict, rp, "mscale", -1, &ms)) ||
            (st = rope_num(c, dict, rp, "mscale_all_dim", -1, &msa)))
            return st;
        const cJSON *afj = cJSON_GetObjectItemCaseSensitive(rp, "attention_factor");
        if (afj && !cJSON_IsNull(afj)) {
            if ((st = rope_num(c, dict, rp, "attention_factor", NAN, &af)))
                return st;
        } else if (ms > 0 && msa > 0) {
            af = yarn_mscale(factor, ms) / yarn_mscale(factor, msa);
        } else {
            af = yarn_mscale(factor, 1);
        }
        const cJSON *tr = cJSON_GetObjectItemCaseSensitive(rp, "truncate");
        r->truncate = !tr || cJSON_IsNull(tr) || cJSON_IsTrue(tr);
        r->factor = (float)factor;
        r->original_max_pos = (int)orig;
        r->beta_fast = (float)bf;
        r->beta_slow = (float)bs;
        r->attention_factor = (float)af;
        r->mscale_all_dim = msa > 0 ? (float)msa : 0.0f;
        return MOE_OK;
    }
    char sn[120];
    snippet(rp, sn, sizeof sn);
    return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                         "%s: field '%s' = %s is not supported (RoPE types: default, linear, "
                         "llama3, yarn)",
                         c->name, dict, sn);
}

/* rope_parameters (transformers v5) or rope_scaling (older). A dict's
 * rope_theta wins over the top-level one, as in transformers; its type
 * (rope_type, or type) is default, linear, llama3 or yarn. */
static enum moe_status parse_rope(const struct cfg_ctx *c, double def_theta, int max_pos,
                                  float *theta, struct moe_rope *r)
{
    const cJSON *top = field(c, "rope_theta");
    const char *keys[2] = {"rope_scaling", "rope_parameters"};
    memset(r, 0, sizeof *r);
    r->attention_factor = 1.0f;
    for (int k = 0; k < 2; k++) {
        const cJSON *rp = field(c, keys[k]);
        if (!rp)
            continue;
        char sn[120];
        snippet(rp, sn, sizeof sn);
        if (!cJSON_IsObject(rp))
            return moe_error_set(c->err, MOE_ERR_FORMAT, "%s: field '%s' must be an object, got %s",
                                 c->name, keys[k], sn);
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(rp, "rope_type");
        if (!type)
            type = cJSON_GetObjectItemCaseSensitive(rp, "type");
        if (type && !cJSON_IsString(type))
            return moe_error_set(c->err, MOE_ERR_FORMAT,
                                 "%s: field '%s': the type must be a "
                                 "string, got %s",
                                 c->name, keys[k], sn);
        if (type && strcmp(type->valuestring, "default")) {
            enum moe_status st = parse_rope_scaling(c, keys[k], rp, type->valuestring, max_pos, r);
            if (st)
                return st;
        }
        const cJSON *prf = cJSON_GetObjectItemCaseSensitive(rp, "partial_rotary_factor");
        if (prf && !(cJSON_IsNumber(prf) && prf->valuedouble == 1.0))
            return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                                 "%s: field '%s' = %s is not supported (partial rotary)", c->name,
                                 keys[k], sn);
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(rp, "rope_theta");
        if (t && !cJSON_IsNull(t)) {
            top = t;
        } else if (!type) {
            /* neither a type nor a theta: some scaling we do not know */
            return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                                 "%s: field '%s' = %s is not supported (no rope_type)", c->name,
                                 keys[k], sn);
        }
    }
    return get_pos_float(c, top, "rope_theta", def_theta, theta);
}

void moe_rope_inv_freq(const struct moe_config *cfg, float *inv)
{
    const struct moe_rope *r = &cfg->rope;
    const int d = cfg->d_head, half = d / 2;
    const float base = cfg->rope_theta;
    for (int i = 0; i < half; i++)
        inv[i] = 1.0f / powf(base, (float)(2 * i) / (float)d);
    switch (r->type) {
    case MOE_ROPE_DEFAULT: return;
    case MOE_ROPE_LINEAR:
        for (int i = 0; i < half; i++)
            inv[i] /= r->factor;
        return;
    case MOE_ROPE_LLAMA3: {
        const float old = (float)r->original_max_pos;
        const float low_wl = (float)((double)r->original_max_pos / r->low_freq_factor);
        const float high_wl = (float)((double)r->original_max_pos / r->high_freq_factor);
        const float two_pi = (float)MOE_TWO_PI;
        for (int i = 0; i < half; i++) {
            float wl = two_pi / inv[i];
            float scaled = wl > low_wl ? inv[i] / r->factor : inv[i];
            float smooth = (old / wl - r->low_freq_factor) /
                           (float)((double)r->high_freq_factor - r->low_freq_factor);
            float smoothed = (1.0f - smooth) * scaled / r->factor + smooth * scaled;
            bool medium = !(wl < high_wl) && !(wl > low_wl);
            inv[i] = medium ? smoothed : scaled;
        }
        return;
    }
    case MOE_ROPE_YARN: {
        /* the correction range, in double as transformers' Python floats */
        double ld = log((double)r->original_max_pos / (r->beta_fast * MOE_TWO_PI));
        double hd = log((double)r->original_max_pos / (r->beta_slow * MOE_TWO_PI));
        double lo = d * ld / (2 * log((double)base)), hi = d * hd / (2 * log((double)base));
        if (r->truncate) {
            lo = floor(lo);
            hi = ceil(hi);
        }
        lo = lo > 0 ? lo : 0;
        hi = hi < d - 1 ? hi : d - 1;
        if (lo == hi)
            hi += 0.001;
        for (int i = 0; i < half; i++) {
            float pos_freq = powf(base, (float)(2 * i) / (float)d);
            float extrap = 1.0f / pos_freq, interp = 1.0f / (r->factor * pos_freq);
            float ramp = ((float)i - (float)lo) / (float)(hi - lo);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            float ef = 1.0f - ramp; /* the extrapolation factor */
            inv[i] = interp * (1.0f - ef) + extrap * ef;
        }
        return;
    }
    }
}

/* ---- features we refuse ----------------------------------------------------- */

static enum moe_status check_unsupported(const struct cfg_ctx *c, const struct moe_config *cfg)
{
    enum moe_status st;
    const char *act;
    if ((st = get_str(c, "hidden_act", &act)) != MOE_OK)
        return st;
    if (act && strcmp(act, "silu") != 0)
        return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                             "%s: field 'hidden_act' = '%s' is not supported (only 'silu')",
                             c->name, act);
    const cJSON *q = field(c, "quantization_config");
    if (q) {
        char sn[120];
        snippet(q, sn, sizeof sn);
        return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                             "%s: field 'quantization_config' = %s is not supported (quantized "
                             "checkpoint)",
                             c->name, sn);
    }
    if (cfg->arch == MOE_ARCH_MIXTRAL) {
        const cJSON *sw = field(c, "sliding_window");
        if (sw) {
            char sn[80];
            snippet(sw, sn, sizeof sn);
            if (!json_is_int(sw) || sw->valuedouble < 1)
                return moe_error_set(c->err, MOE_ERR_FORMAT,
                                     "%s: field 'sliding_window' must be a positive integer or "
                                     "null, got %s",
                                     c->name, sn);
            if (sw->valuedouble < cfg->max_pos)
                return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                                     "%s: field 'sliding_window' = %s is not supported (sliding-"
                                     "window attention; max_position_embeddings is %d)",
                                     c->name, sn, cfg->max_pos);
        }
    } else {
        bool b = false;
        if ((st = get_bool(c, "use_sliding_window", false, &b)) != MOE_OK)
            return st;
        if (b)
            return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                                 "%s: field 'use_sliding_window' = true is not supported "
                                 "(sliding-window attention)",
                                 c->name);
        if ((st = get_bool(c, "attention_bias", false, &b)) != MOE_OK)
            return st;
        if (b)
            return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                                 "%s: field 'attention_bias' = true is not supported", c->name);
        const cJSON *clip = field(c, "clip_qkv");
        if (clip) {
            char sn[80];
            snippet(clip, sn, sizeof sn);
            return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                                 "%s: field 'clip_qkv' = %s is not supported (only null)", c->name,
                                 sn);
        }
    }
    return MOE_OK;
}

/* ---- token ids -------------------------------------------------------------- */

static enum moe_status parse_token_ids(const struct cfg_ctx *c, struct moe_config *cfg)
{
    /* absent: transformers' default (Mixtral bos 1, eos 2; DeepSeek-V3 bos 0,
     * eos 1; Qwen3 none); null: none */
    bool mixtral = cfg->arch == MOE_ARCH_MIXTRAL;
    bool dsv3 = cfg->arch == MOE_ARCH_DEEPSEEK_V3;
    int def_bos = mixtral ? 1 : dsv3 ? 0 : -1, def_eos = mixtral ? 2 : dsv3 ? 1 : -1;
    bool bos_null = cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(c->root, "bos_token_id"));
    bool eos_null = cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(c->root, "eos_token_id"));
    enum moe_status st =
        get_int(c, "bos_token_id", false, bos_null ? -1 : def_bos, 0, INT_MAX, &cfg->bos_id);
    if (st != MOE_OK)
        return st;
    if (cfg->bos_id >= cfg->vocab_size)
        return moe_error_set(c->err, MOE_ERR_FORMAT,
                             "%s: field 'bos_token_id' = %d is outside the vocabulary (%d)",
                             c->name, cfg->bos_id, cfg->vocab_size);

    const cJSON *eos = field(c, "eos_token_id");
    cfg->n_eos = 0;
    if (!eos) {
        if (def_eos >= 0 && !eos_null) {
            if (cfg->vocab_size <= def_eos) /* the default is checked as a given id would be */
                return moe_error_set(c->err, MOE_ERR_FORMAT,
                                     "%s: field 'eos_token_id' is absent and its default %d is "
                                     "outside the vocabulary (%d)",
                                     c->name, def_eos, cfg->vocab_size);
            cfg->n_eos = 1;
            cfg->eos_ids[0] = def_eos;
        }
        return MOE_OK;
    }
    char sn[120];
    snippet(eos, sn, sizeof sn);
    const cJSON *one = eos;
    if (cJSON_IsArray(eos)) {
        if (cJSON_GetArraySize(eos) > MOE_MAX_EOS)
            return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                                 "%s: field 'eos_token_id' = %s has more than %d ids", c->name, sn,
                                 MOE_MAX_EOS);
        one = eos->child;
    }
    for (; one; one = cJSON_IsArray(eos) ? one->next : NULL) {
        if (!json_is_int(one) || one->valuedouble < 0)
            return moe_error_set(c->err, MOE_ERR_FORMAT,
                                 "%s: field 'eos_token_id' must be a non-negative integer or a "
                                 "list of them, got %s",
                                 c->name, sn);
        if (one->valuedouble >= cfg->vocab_size)
            return moe_error_set(c->err, MOE_ERR_FORMAT,
                                 "%s: field 'eos_token_id' = %s is outside the vocabulary (%d)",
                                 c->name, sn, cfg->vocab_size);
        cfg->eos_ids[cfg->n_eos++] = (int)one->valuedouble;
    }
    return MOE_OK;
}

/* ---- layers (Qwen3: decoder_sparse_step, mlp_only_layers) ----------------------- */

static enum moe_status parse_layers(const struct cfg_ctx *c, struct moe_config *cfg)
{
    if (cfg->arch == MOE_ARCH_MIXTRAL || cfg->arch == MOE_ARCH_OLMOE) {
        for (int l = 0; l < cfg->n_layer; l++)
            cfg->layer_is_moe[l] = true;
        return MOE_OK;
    }
    if (cfg->arch == MOE_ARCH_DEEPSEEK_V3) { /* parse_deepseek read intermediate_size */
        for (int l = 0; l < cfg->n_layer; l++)
            cfg->layer_is_moe[l] = cfg->n_expert > 0 && l >= cfg->first_k_dense;
        return MOE_OK;
    }
    int step;
    enum moe_status st = get_int(c, "decoder_sparse_step", false, 1, 1, INT_MAX, &step);
    if (st != MOE_OK)
        return st;
    bool dense_only[MOE_MAX_LAYERS] = {false};
    const cJSON *mlp = field(c, "mlp_only_layers");
    if (mlp) {
        char sn[120];
        snippet(mlp, sn, sizeof sn);
        if (!cJSON_IsArray(mlp))
            return moe_error_set(
                c->err, MOE_ERR_FORMAT,
                "%s: field 'mlp_only_layers' must be a list of layer indices, got %s", c->name, sn);
        for (const cJSON *j = mlp->child; j; j = j->next) {
            if (!json_is_int(j) || j->valuedouble < 0 || j->valuedouble >= cfg->n_layer) {
                char v[40];
                snippet(j, v, sizeof v);
                return moe_error_set(c->err, MOE_ERR_FORMAT,
                                     "%s: field 'mlp_only_layers' = %s: entry %s is not a layer "
                                     "index in [0, %d)",
                                     c->name, sn, v, cfg->n_layer);
            }
            dense_only[(int)j->valuedouble] = true;
        }
    }
    int first_dense = -1;
    for (int l = 0; l < cfg->n_layer; l++) {
        cfg->layer_is_moe[l] = !dense_only[l] && cfg->n_expert > 0 && (l + 1) % step == 0;
        if (!cfg->layer_is_moe[l] && first_dense < 0)
            first_dense = l;
    }
    st = get_int(c, "intermediate_size", first_dense >= 0, 0, 1, CFG_MAX_SIZE, &cfg->d_ff_dense);
    if (st != MOE_OK && first_dense >= 0 && !field(c, "intermediate_size"))
        return moe_error_set(c->err, MOE_ERR_FORMAT,
                             "%s: missing required field 'intermediate_size' (layer %d has a "
                             "dense MLP)",
                             c->name, first_dense);
    return st;
}

/* ---- DeepSeek-V3 ------------------------------------------------------------ */

/* A string field that must be absent or `want` (a DeepSeek variant we do not
 * implement is refused by name). */
static enum moe_status want_str(const struct cfg_ctx *c, const char *key, const char *want,
                                const char *what)
{
    const char *v;
    enum moe_status st = get_str(c, key, &v);
    if (st == MOE_OK && v && strcmp(v, want))
        st = moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                           "%s: field '%s' = '%s' is not supported (only '%s': %s)", c->name, key,
                           v, want, what);
    return st;
}

/* The latent attention's sizes (required: they fix the weight shapes),
 * grouped sigmoid routing, shared experts and the dense first layers, with
 * transformers' DeepseekV3Config defaults for the rest. */
static enum moe_status parse_deepseek(const struct cfg_ctx *c, struct moe_config *cfg)
{
    enum moe_status st;
#define INT_FIELD(key, req, def, min, max, dst)                                                    \
    do {                                                                                           \
        if ((st = get_int(c, key, req, def, min, max, dst)) != MOE_OK)                             \
            return st;                                                                             \
    } while (0)
    cfg->mla = true;
    cfg->router_sigmoid = true;
    INT_FIELD("kv_lora_rank", true, 0, 1, CFG_MAX_SIZE, &cfg->kv_lora_rank);
    INT_FIELD("qk_rope_head_dim", true, 0, 2, CFG_MAX_SIZE, &cfg->d_head);
    INT_FIELD("qk_nope_head_dim", true, 0, 1, CFG_MAX_SIZE, &cfg->qk_nope_dim);
    INT_FIELD("v_head_dim", true, 0, 1, CFG_MAX_SIZE, &cfg->v_head_dim);
    if (cfg->d_head % 2)
        return moe_error_set(c->err, MOE_ERR_FORMAT,
                             "%s: field 'qk_rope_head_dim' = %d must be even (rotary pairs)",
                             c->name, cfg->d_head);
    /* q_lora_rank: null means q_proj, absent is not a default worth guessing */
    const cJSON *ql = cJSON_GetObjectItemCaseSensitive(c->root, "q_lora_rank");
    if (!ql)
        return moe_error_set(c->err, MOE_ERR_FORMAT,
                             "%s: missing required field 'q_lora_rank' (null for a plain q_proj)",
                             c->name);
    if (!cJSON_IsNull(ql))
        INT_FIELD("q_lora_rank", true, 0, 1, CFG_MAX_SIZE, &cfg->q_lora_rank);
    const cJSON *hd = field(c, "head_dim");
    if (hd && !(cJSON_IsNumber(hd) && hd->valuedouble == cfg->d_head)) {
        char sn[40];
        snippet(hd, sn, sizeof sn);
        return moe_error_set(c->err, MOE_ERR_FORMAT,
                             "%s: field 'head_dim' = %s contradicts qk_rope_head_dim = %d", c->name,
                             sn, cfg->d_head);
    }
    if (cfg->n_kv_head != cfg->n_head)
        return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                             "%s: field 'num_key_value_heads' = %d: latent attention expands its "
                             "keys to every one of the %d heads (transformers too)",
                             c->name, cfg->n_kv_head, cfg->n_head);
    INT_FIELD("moe_intermediate_size", cfg->n_expert > 0, 0, 1, CFG_MAX_SIZE, &cfg->d_ff_expert);
    int n_shared;
    INT_FIELD("n_shared_experts", false, 1, 0, 1024, &n_shared);
    if (cfg->n_expert > 0 && (int64_t)n_shared * cfg->d_ff_expert > CFG_MAX_SIZE)
        return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                             "%s: n_shared_experts %d x moe_intermediate_size %d is larger than "
                             "the supported %d",
                             c->name, n_shared, cfg->d_ff_expert, CFG_MAX_SIZE);
    cfg->d_ff_shared = cfg->n_expert > 0 ? n_shared * cfg->d_ff_expert : 0;
    INT_FIELD("first_k_dense_replace", false, 3, 0, INT_MAX, &cfg->first_k_dense);
    bool any_dense = cfg->n_expert == 0 || cfg->first_k_dense > 0;
    st = get_int(c, "intermediate_size", any_dense, 0, 1, CFG_MAX_SIZE, &cfg->d_ff_dense);
    if (st != MOE_OK && any_dense && !field(c, "intermediate_size"))
        return moe_error_set(c->err, MOE_ERR_FORMAT,
                             "%s: missing required field 'intermediate_size' (layer 0 has a "
                             "dense MLP: first_k_dense_replace = %d)",
                             c->name, cfg->first_k_dense);
    if (st != MOE_OK)
        return st;
    INT_FIELD("n_group", false, 8, 1, CFG_MAX_SIZE, &cfg->n_group);
    INT_FIELD("topk_group", false, 4, 1, CFG_MAX_SIZE, &cfg->topk_group);
    if (cfg->n_expert > 0) {
        if (cfg->n_expert % cfg->n_group || cfg->n_expert / cfg->n_group < 2)
            return moe_error_set(c->err, MOE_ERR_FORMAT,
                                 "%s: field 'n_group' = %d must split n_routed_experts = %d into "
                                 "groups of at least 2 (a group scores by its two best)",
                                 c->name, cfg->n_group, cfg->n_expert);
        if (cfg->topk_group > cfg->n_group)
            return moe_error_set(c->err, MOE_ERR_FORMAT,
                                 "%s: field 'topk_group' = %d is more than n_group = %d", c->name,
                                 cfg->topk_group, cfg->n_group);
        if (cfg->top_k > cfg->topk_group * (cfg->n_expert / cfg->n_group))
            return moe_error_set(c->err, MOE_ERR_FORMAT,
                                 "%s: field 'num_experts_per_tok' = %d is more than the %d experts "
                                 "of topk_group = %d groups",
                                 c->name, cfg->top_k,
                                 cfg->topk_group * (cfg->n_expert / cfg->n_group), cfg->topk_group);
    }
    if ((st = get_bool(c, "norm_topk_prob", true, &cfg->norm_topk_prob)) != MOE_OK ||
        (st = get_bool(c, "rope_interleave", true, &cfg->rope_interleave)) != MOE_OK ||
        (st = get_pos_float(c, field(c, "routed_scaling_factor"), "routed_scaling_factor", 2.5,
                            &cfg->routed_scaling)) != MOE_OK)
        return st;
    const char *mtp_key =
        field(c, "num_mtp_layers") ? "num_mtp_layers" : "num_nextn_predict_layers";
    INT_FIELD(mtp_key, false, 0, 0, INT_MAX, &cfg->n_mtp);
    int freq;
    INT_FIELD("moe_layer_freq", false, 1, 1, INT_MAX, &freq);
    if (freq != 1)
        return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                             "%s: field 'moe_layer_freq' = %d is not supported (only 1: every "
                             "layer after first_k_dense_replace is MoE)",
                             c->name, freq);
    if ((st = want_str(c, "topk_method", "noaux_tc", "group-limited top-k with bias correction")) ||
        (st = want_str(c, "scoring_func", "sigmoid", "DeepSeek-V3 routing")))
        return st;
#undef INT_FIELD
    return MOE_OK;
}

/* ---- public API ------------------------------------------------------------- */

static enum moe_status parse_root(const struct cfg_ctx *c, struct moe_config *cfg)
{
    enum moe_status st;
    if ((st = parse_arch(c, &cfg->arch)) != MOE_OK)
        return st;
    bool mixtral = cfg->arch == MOE_ARCH_MIXTRAL;

#define INT_FIELD(key, req, def, min, max, dst)                                                    \
    do {                                                                                           \
        if ((st = get_int(c, key, req, def, min, max, dst)) != MOE_OK)                             \
            return st;                                                                             \
    } while (0)

    INT_FIELD("hidden_size", true, 0, 1, CFG_MAX_SIZE, &cfg->d_model);
    INT_FIELD("num_hidden_layers", true, 0, 1, MOE_MAX_LAYERS, &cfg->n_layer);
    INT_FIELD("num_attention_heads", true, 0, 1, CFG_MAX_SIZE, &cfg->n_head);
    INT_FIELD("num_key_value_heads", false, cfg->n_head, 1, CFG_MAX_SIZE, &cfg->n_kv_head);
    INT_FIELD("vocab_size", true, 0, 1, CFG_MAX_SIZE, &cfg->vocab_size);
    const bool olmoe = cfg->arch == MOE_ARCH_OLMOE;
    INT_FIELD("max_position_embeddings", false,
              mixtral                                      ? 131072
              : olmoe || cfg->arch == MOE_ARCH_DEEPSEEK_V3 ? 4096
                                                           : 32768,
              1, INT_MAX, &cfg->max_pos);
    if (cfg->n_head % cfg->n_kv_head != 0)
        return moe_error_set(c->err, MOE_ERR_FORMAT,
                             "%s: num_attention_heads = %d is not a multiple of "
                             "num_key_value_heads = %d",
                             c->name, cfg->n_head, cfg->n_kv_head);
    if (cfg->arch == MOE_ARCH_DEEPSEEK_V3) {
        /* parse_deepseek: head_dim is the rotary part of a head */
    } else if (field(c, "head_dim")) {
        INT_FIELD("head_dim", true, 0, 1, CFG_MAX_SIZE, &cfg->d_head);
    } else {
        if (cfg->d_model % cfg->n_head != 0)
            return moe_error_set(c->err, MOE_ERR_FORMAT,
                                 "%s: field 'head_dim' is absent and hidden_size = %d is not a "
                                 "multiple of num_attention_heads = %d",
                                 c->name, cfg->d_model, cfg->n_head);
        cfg->d_head = cfg->d_model / cfg->n_head;
    }

    /* experts: transformers maps num_experts <-> num_local_experts for both */
    const bool dsv3 = cfg->arch == MOE_ARCH_DEEPSEEK_V3;
    const char *ek = mixtral ? "num_local_experts" : dsv3 ? "n_routed_experts" : "num_experts";
    const char *ek_alt = mixtral ? "num_experts" : "num_local_experts";
    if (!field(c, ek) && field(c, ek_alt))
        ek = ek_alt;
    INT_FIELD(ek, true, 0, mixtral ? 1 : 0, CFG_MAX_SIZE, &cfg->n_expert);
    INT_FIELD("num_experts_per_tok", true, 0, 1, CFG_MAX_SIZE, &cfg->top_k);
    if (cfg->n_expert > 0 && cfg->top_k > cfg->n_expert)
        return moe_error_set(c->err, MOE_ERR_FORMAT,
                             "%s: field 'num_experts_per_tok' = %d is more than %s = %d", c->name,
                             cfg->top_k, ek, cfg->n_expert);

    if (mixtral) {
        INT_FIELD("intermediate_size", true, 0, 1, CFG_MAX_SIZE, &cfg->d_ff_expert);
        cfg->d_ff_dense = 0;
        cfg->norm_topk_prob = true;
        cfg->qk_norm = false;
    } else if (cfg->arch == MOE_ARCH_OLMOE) {
        /* the experts' width is intermediate_size; q_norm spans hidden_size */
        INT_FIELD("intermediate_size", true, 0, 1, CFG_MAX_SIZE, &cfg->d_ff_expert);
        if ((st = get_bool(c, "norm_topk_prob", false, &cfg->norm_topk_prob)) != MOE_OK)
            return st;
        cfg->qk_norm_full = true;
        if (cfg->n_head * cfg->d_head != cfg->d_model)
            return moe_error_set(c->err, MOE_ERR_UNSUPPORTED,
                                 "%s: field 'head_dim' = %d: OLMoE's q_norm spans hidden_size %d, "
                                 "so num_attention_heads x head_dim must equal it",
                                 c->name, cfg->d_head, cfg->d_model);
    } else if (dsv3) {
        if ((st = parse_deepseek(c, cfg)) != MOE_OK)
            return st;
    } else {
        INT_FIELD("moe_intermediate_size", cfg->n_expert > 0, 0, 1, CFG_MAX_SIZE,
                  &cfg->d_ff_expert);
        if ((st = get_bool(c, "norm_topk_prob", false, &cfg->norm_topk_prob)) != MOE_OK)
            return st;
        cfg->qk_norm = cfg->arch == MOE_ARCH_QWEN3_MOE;
        if (cfg->arch == MOE_ARCH_QWEN2_MOE) {
            if ((st = get_bool(c, "qkv_bias", true, &cfg->qkv_bias)) != MOE_OK)
                return st;
            INT_FIELD("shared_expert_intermediate_size", false, 5632, 0, CFG_MAX_SIZE,
                      &cfg->d_ff_shared);
            if (cfg->n_expert == 0)
                cfg->d_ff_shared = 0;
        }
    }
#undef INT_FIELD

    if ((st = get_bool(c, "tie_word_embeddings", false, &cfg->tie_word_embeddings)) != MOE_OK)
        return st;
    if ((st = get_pos_float(c, field(c, "rms_norm_eps"), "rms_norm_eps",
                            mixtral || olmoe ? 1e-5 : 1e-6, &cfg->rms_eps)) != MOE_OK)
        return st;
    if ((st = parse_rope(c, mixtral ? 1e6 : 1e4, cfg->max_pos, &cfg->rope_theta, &cfg->rope)) !=
        MOE_OK)
        return st;
    if ((st = parse_token_ids(c, cfg)) != MOE_OK)
        return st;
    if ((st = parse_layers(c, cfg)) != MOE_OK)
        return st;
    if (dsv3) {
        /* the softmax scale; YaRN's mscale_all_dim enters squared (DeepSeek) */
        double scale = 1.0 / sqrt((double)(cfg->qk_nope_dim + cfg->d_head));
        if (cfg->rope.type != MOE_ROPE_DEFAULT && cfg->rope.mscale_all_dim > 0) {
            double ms = yarn_mscale(cfg->rope.factor, cfg->rope.mscale_all_dim);
            scale *= ms * ms;
        }
        cfg->attn_scale = (float)scale;
    }
    return check_unsupported(c, cfg);
}

int moe_config_kv_token_elems(const struct moe_config *cfg, int tp)
{
    if (cfg->mla)
        return cfg->kv_lora_rank + cfg->d_head;
    return 2 * (cfg->n_kv_head / (tp > 0 ? tp : 1)) * cfg->d_head;
}

const char *moe_arch_model_type(enum moe_arch a)
{
    switch (a) {
    case MOE_ARCH_MIXTRAL: return "mixtral";
    case MOE_ARCH_QWEN3_MOE: return "qwen3_moe";
    case MOE_ARCH_QWEN2_MOE: return "qwen2_moe";
    case MOE_ARCH_OLMOE: return "olmoe";
    case MOE_ARCH_DEEPSEEK_V3: return "deepseek_v3";
    }
    return "?";
}

enum moe_status moe_config_parse(const char *json, const char *name, struct moe_config *cfg,
                                 struct moe_error *err)
{
    if (!name)
        name = "config.json";
    if (!json || !cfg)
        return moe_error_set(err, MOE_ERR_INVALID, "%s: moe_config_parse: NULL argument", name);
    memset(cfg, 0, sizeof *cfg);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(json, &end, 1);
    if (!root) {
        size_t at = end && end >= json ? (size_t)(end - json) : 0;
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: not valid JSON (error at byte %zu)", name,
                             at);
    }
    enum moe_status st;
    struct moe_config tmp;
    memset(&tmp, 0, sizeof tmp);
    struct cfg_ctx c = {.name = name, .root = root, .err = err};
    if (!cJSON_IsObject(root))
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: not a JSON object", name);
    else
        st = parse_root(&c, &tmp);
    if (st == MOE_OK)
        *cfg = tmp;
    cJSON_Delete(root);
    return st;
}

enum moe_status moe_config_load(const char *path, struct moe_config *cfg, struct moe_error *err)
{
    if (!path || !cfg)
        return moe_error_set(err, MOE_ERR_INVALID, "moe_config_load: NULL argument");
    memset(cfg, 0, sizeof *cfg);
    char *buf;
    enum moe_status st = moe_read_text(path, CFG_MAX_FILE, &buf, err);
    if (st)
        return st;
    st = moe_config_parse(buf, path, cfg, err);
    free(buf);
    return st;
}
