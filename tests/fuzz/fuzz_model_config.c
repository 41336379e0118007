/* Fuzz target: config.json (common/model_config.c, moe_config_parse). An
 * accepted config must hold what the model loader relies on without
 * checking again: sizes in range, heads divisible, token ids inside the
 * vocabulary, finite positive norms and RoPE base. */
#include <math.h>

#include "fuzz.h"
#include "model_config.h"

#define NAME "config.json"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = fuzz_cstr(data, size);
    if (!text)
        return 0;
    struct moe_config cfg;
    struct moe_error err = {0};
    enum moe_status st = moe_config_parse(text, NAME, &cfg, &err);
    free(text);
    if (st != MOE_OK) {
        FUZZ_CHECK(err.code == st && fuzz_msg_ok(err.msg) && strstr(err.msg, NAME),
                   "status %d: '%s'", st, err.msg);
        return 0;
    }
    FUZZ_CHECK(cfg.d_model >= 1 && cfg.n_layer >= 1 && cfg.n_layer <= MOE_MAX_LAYERS &&
                   cfg.n_head >= 1 && cfg.n_kv_head >= 1 && cfg.n_head % cfg.n_kv_head == 0 &&
                   cfg.d_head >= 1 && cfg.vocab_size >= 1 && cfg.max_pos >= 1,
               "sizes: d_model %d, %d layers, %d/%d heads of %d, vocab %d, context %d", cfg.d_model,
               cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.d_head, cfg.vocab_size, cfg.max_pos);
    FUZZ_CHECK(cfg.top_k >= 1 && cfg.n_expert >= 0 && (!cfg.n_expert || cfg.top_k <= cfg.n_expert),
               "top_k %d of %d experts", cfg.top_k, cfg.n_expert);
    bool any_moe = false, any_dense = false;
    for (int l = 0; l < cfg.n_layer; l++) {
        any_moe |= cfg.layer_is_moe[l];
        any_dense |= !cfg.layer_is_moe[l];
    }
    FUZZ_CHECK(!any_moe || (cfg.n_expert >= 1 && cfg.d_ff_expert >= 1),
               "MoE layers without experts");
    FUZZ_CHECK(!any_dense || cfg.d_ff_dense >= 1, "dense layers without intermediate_size");
    FUZZ_CHECK(cfg.bos_id >= -1 && cfg.bos_id < cfg.vocab_size, "bos %d", cfg.bos_id);
    FUZZ_CHECK(cfg.n_eos >= 0 && cfg.n_eos <= MOE_MAX_EOS, "%d eos ids", cfg.n_eos);
    for (int i = 0; i < cfg.n_eos; i++)
        FUZZ_CHECK(cfg.eos_ids[i] >= 0 && cfg.eos_ids[i] < cfg.vocab_size, "eos %d",
                   cfg.eos_ids[i]);
    FUZZ_CHECK(isfinite(cfg.rms_eps) && cfg.rms_eps > 0 && isfinite(cfg.rope_theta) &&
                   cfg.rope_theta > 0,
               "eps %g, theta %g", (double)cfg.rms_eps, (double)cfg.rope_theta);
    return 0;
}
