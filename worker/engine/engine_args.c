#include "engine/engine_args.h"

#include <string.h>

#include "cli.h"
#include "engine/draft.h"
#include "engine/spec.h"
#include "kv/kv_cache.h"

void moe_engine_args_init(struct moe_engine_args *a)
{
    *a = (struct moe_engine_args){.spec_max_batch = 8};
}

int moe_engine_cli_flag(struct moe_engine_args *a, int argc, char **argv, int *i)
{
    enum kind { SWITCH, INT, MIB, POLICY, STR };
    const struct {
        const char *name;
        enum kind kind;
        void *field;
        long lo, hi; /* INT */
    } flags[] = {
        {"--no-prefix-cache", SWITCH, &a->no_prefix_cache, 0, 0},
        {"--kv-blocks", INT, &a->kv_blocks, 1, 1 << 24},
        {"--kv-memory", MIB, &a->kv_memory_mib, 1, 1 << 24},
        {"--block-size", INT, &a->block_size, 1, 1024},
        {"--max-batch-tokens", INT, &a->max_batch_tokens, 1, 1 << 20},
        {"--max-running", INT, &a->max_running, 1, 1 << 16},
        {"--spec-tokens", INT, &a->spec_tokens, 0, MOE_SPEC_TOKENS_MAX},
        {"--spec-max-batch", INT, &a->spec_max_batch, 0, 1 << 16},
        {"--spec-policy", POLICY, &a->spec_cost, 0, 0},
        {"--draft-model", STR, &a->draft_model, 0, 0},
    };
    const char *k = argv[*i];
    size_t f = 0;
    while (f < sizeof flags / sizeof flags[0] && strcmp(k, flags[f].name))
        f++;
    if (f == sizeof flags / sizeof flags[0])
        return 1;
    if (!a->given)
        a->given = flags[f].name;
    if (flags[f].kind == SWITCH) {
        *(bool *)flags[f].field = true;
        return 0;
    }
    if (*i + 1 >= argc)
        return cli_fail("option '%s' needs a value", k);
    const char *v = argv[++*i];
    long n;
    switch (flags[f].kind) {
    case SWITCH: break;
    case INT:
        if (!cli_parse_long(v, flags[f].lo, flags[f].hi, &n))
            return cli_fail("%s: '%s' is not a whole number in [%ld, %ld]", k, v, flags[f].lo,
                            flags[f].hi);
        *(int *)flags[f].field = (int)n;
        break;
    case MIB:
        if (!cli_parse_long(v, flags[f].lo, flags[f].hi, &n))
            return cli_fail("%s: '%s' is not a number of MiB in [%ld, %ld]", k, v, flags[f].lo,
                            flags[f].hi);
        a->kv_memory_mib = n;
        break;
    case POLICY:
        if (strcmp(v, "cost") && strcmp(v, "acceptance"))
            return cli_fail("--spec-policy: '%s' is not one of cost, acceptance", v);
        a->spec_cost = !strcmp(v, "cost");
        break;
    case STR: *(const char **)flags[f].field = v; break;
    }
    return 0;
}

enum moe_status moe_engine_args_apply(const struct moe_engine_args *a,
                                      const struct moe_model *model,
                                      const struct moe_model_opts *mopts, struct moe_backend *be,
                                      int kv_parts, struct moe_engine_opts *eo,
                                      struct moe_model **draft, struct moe_error *err)
{
    *draft = NULL;
    if (a->draft_model) {
        struct moe_model_opts dopts = {.dtype = mopts->dtype,
                                       .q4_group = mopts->q4_group,
                                       .fast = mopts->fast,
                                       .batch_invariant = mopts->batch_invariant,
                                       .kv_dtype = mopts->kv_dtype,
                                       .tp_size = 1};
        enum moe_status rc = moe_model_load(a->draft_model, &dopts, be, draft, err);
        if (rc)
            return moe_error_prefix(err, "--draft-model");
    }
    eo->block_size = a->block_size ? a->block_size : 16;
    eo->max_batch_tokens = a->max_batch_tokens;
    eo->max_running = a->max_running;
    eo->no_prefix_cache = a->no_prefix_cache;
    eo->spec_tokens = a->spec_tokens;
    eo->spec_max_batch = a->spec_max_batch;
    eo->spec_cost = a->spec_cost;
    eo->draft = *draft;
    eo->kv_parts = kv_parts;
    eo->n_block = a->kv_blocks;
    if (!eo->n_block) {
        /* a block holds the model's K/V and, with a draft, the draft's */
        const struct moe_config *cfg = moe_model_config(model);
        size_t block_bytes =
            moe_kv_block_bytes(cfg->n_layer, eo->block_size, moe_config_kv_token_elems(cfg, 1),
                               moe_model_kv_dtype(model)) +
            (*draft ? moe_draft_block_bytes(*draft, eo->block_size) : 0);
        long mib = a->kv_memory_mib ? a->kv_memory_mib : 512;
        eo->n_block = (int)(((size_t)mib << 20) / block_bytes);
        if (eo->n_block < 1) {
            moe_model_free(*draft);
            *draft = eo->draft = NULL;
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "--kv-memory: %ld MiB holds no KV block of %zu bytes", mib,
                                 block_bytes);
        }
    }
    eo->n_block *= kv_parts > 1 ? kv_parts : 1;
    return MOE_OK;
}
