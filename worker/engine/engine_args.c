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
    const struct cli_opt opts[] = {
        {"--no-prefix-cache", CLI_SWITCH, &a->no_prefix_cache, 0, 0},
        {"--kv-blocks", CLI_INT, &a->kv_blocks, 1, 1 << 24},
        {"--kv-memory", CLI_OTHER, NULL, 0, 0},
        {"--block-size", CLI_INT, &a->block_size, 1, 1024},
        {"--max-batch-tokens", CLI_INT, &a->max_batch_tokens, 1, 1 << 20},
        {"--max-running", CLI_INT, &a->max_running, 1, 1 << 16},
        {"--spec-tokens", CLI_INT, &a->spec_tokens, 0, MOE_SPEC_TOKENS_MAX},
        {"--spec-max-batch", CLI_INT, &a->spec_max_batch, 0, 1 << 16},
        {"--spec-policy", CLI_OTHER, NULL, 0, 0},
        {"--draft-model", CLI_STR, &a->draft_model, 0, 0},
    };
    const char *k = argv[*i];
    const struct cli_opt *o;
    const char *v;
    int rc = cli_take(opts, sizeof opts / sizeof opts[0], argc, argv, i, &o, &v);
    if (rc == 1)
        return rc;
    if (!a->given)
        a->given = k;
    if (rc || !o)
        return rc;
    if (!strcmp(o->name, "--kv-memory")) {
        long n;
        if (!cli_parse_long(v, 1, 1 << 24, &n))
            return cli_fail("--kv-memory: '%s' is not a number of MiB in [1, 16777216]", v);
        a->kv_memory_mib = n;
    } else { /* --spec-policy */
        if (strcmp(v, "cost") && strcmp(v, "acceptance"))
            return cli_fail("--spec-policy: '%s' is not one of cost, acceptance", v);
        a->spec_cost = !strcmp(v, "cost");
    }
    return 0;
}

int moe_engine_cli_flags(struct moe_launch_args *launch, struct moe_engine_args *engine, int argc,
                         char **argv, int *i)
{
    int rc = moe_launch_cli_flag(launch, argc, argv, i);
    return rc == 1 ? moe_engine_cli_flag(engine, argc, argv, i) : rc;
}

size_t moe_engine_block_bytes(const struct moe_model *model, const struct moe_model *draft,
                              int block_size)
{
    const struct moe_config *cfg = moe_model_config(model);
    return moe_kv_block_bytes(cfg->n_layer, block_size, moe_config_kv_token_elems(cfg, 1),
                              moe_model_kv_dtype(model)) +
           (draft ? moe_draft_block_bytes(draft, block_size) : 0);
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
        size_t block_bytes = moe_engine_block_bytes(model, *draft, eo->block_size);
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
