/* The engine's command-line flags, parsed in one place for the programs
 * that run an engine (moe-generate, moe-worker): the KV pool (--kv-blocks,
 * --kv-memory, --block-size), the scheduler (--max-batch-tokens,
 * --max-running, --no-prefix-cache) and speculation (--spec-tokens,
 * --spec-max-batch, --spec-policy, --draft-model). */
#ifndef MOE_ENGINE_ARGS_H
#define MOE_ENGINE_ARGS_H

#include <stdbool.h>

#include "engine/engine.h"
#include "group/launch.h"
#include "model/model.h"
#include "moe_error.h"

struct moe_engine_args {
    int kv_blocks;      /* 0: from kv_memory_mib */
    long kv_memory_mib; /* 0: 512 */
    int block_size;     /* 0: 16 */
    int max_batch_tokens;
    int max_running;
    bool no_prefix_cache;
    int spec_tokens;
    int spec_max_batch;
    bool spec_cost; /* --spec-policy cost */
    const char *draft_model;
    const char *given; /* the first of these flags on the command line, or NULL */
};

/* The defaults (no drafts in steps of more than 8 decode rows). */
void moe_engine_args_init(struct moe_engine_args *a);

/* As moe_launch_cli_flag (group/launch.h): argv[*i] is one of these flags
 * -> 0, past its value; not one -> 1; a missing or bad value -> 2 after
 * one line naming the flag. */
int moe_engine_cli_flag(struct moe_engine_args *a, int argc, char **argv, int *i);

/* What moe-generate and moe-worker take alike: the group's flags
 * (moe_launch_cli_flag), then the engine's; the same returns. */
int moe_engine_cli_flags(struct moe_launch_args *launch, struct moe_engine_args *engine, int argc,
                         char **argv, int *i);

/* Bytes of one KV block of block_size tokens: the model's K/V and, with a
 * draft (or NULL), the draft's. */
size_t moe_engine_block_bytes(const struct moe_model *model, const struct moe_model *draft,
                              int block_size);

/* Loads --draft-model, if given, into *draft (one rank, on `be`, with the
 * weight and KV types and arithmetic of mopts), and fills eo's pool,
 * scheduler and speculation fields: n_block from --kv-blocks or what
 * --kv-memory holds of the model's blocks (with the draft's K/V), times
 * kv_parts (data-parallel attention: every rank's cache that size). The
 * rest of eo (forward, sampling) is the caller's. Errors name the flag. */
enum moe_status moe_engine_args_apply(const struct moe_engine_args *a,
                                      const struct moe_model *model,
                                      const struct moe_model_opts *mopts, struct moe_backend *be,
                                      int kv_parts, struct moe_engine_opts *eo,
                                      struct moe_model **draft, struct moe_error *err);

#endif
