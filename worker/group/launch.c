#include "group/launch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "kv/kv_cache.h"

bool moe_launch_parse_dtype(const char *s, enum moe_dtype *out)
{
    if (!strcmp(s, "f32"))
        *out = MOE_DTYPE_F32;
    else if (!strcmp(s, "bf16"))
        *out = MOE_DTYPE_BF16;
    else if (!strcmp(s, "int8"))
        *out = MOE_DTYPE_I8;
    else if (!strcmp(s, "int4"))
        *out = MOE_DTYPE_I4;
    else
        return false;
    return true;
}

const char *moe_launch_dtype_flag(enum moe_dtype dtype)
{
    switch (dtype) {
    case MOE_DTYPE_F32: return "f32";
    case MOE_DTYPE_BF16: return "bf16";
    case MOE_DTYPE_I8: return "int8";
    case MOE_DTYPE_I4: return "int4";
    case MOE_DTYPE_F16: break;
    }
    return "?";
}

void moe_launch_args_init(struct moe_launch_args *a)
{
    *a = (struct moe_launch_args){
        .device = "auto", .dtype = MOE_DTYPE_BF16, .tp = 1, .comm_timeout_ms = 10000};
}

int moe_launch_cli_flag(struct moe_launch_args *a, int argc, char **argv, int *i)
{
    const struct cli_opt opts[] = {
        {"--exact", CLI_SWITCH, &a->exact, 0, 0},
        {"--batch-invariant", CLI_SWITCH, &a->batch_invariant, 0, 0},
        {"--no-cuda-graphs", CLI_SWITCH, &a->no_graphs, 0, 0},
        {"--dp-attention", CLI_SWITCH, &a->dp_attention, 0, 0},
        {"--model", CLI_STR, &a->model, 0, 0},
        {"--device", CLI_STR, &a->device, 0, 0},
        {"--placement", CLI_STR, &a->placement, 0, 0},
        {"--threads", CLI_INT, &a->threads, 0, 1024},
        {"--tp", CLI_INT, &a->tp, 1, 1024},
        {"--comm-timeout-ms", CLI_INT, &a->comm_timeout_ms, 100, 3600000},
        {"--dtype", CLI_OTHER, NULL, 0, 0},
        {"--group-size", CLI_OTHER, NULL, 0, 0},
        {"--kv-dtype", CLI_OTHER, NULL, 0, 0},
    };
    const struct cli_opt *o;
    const char *v;
    int rc = cli_take(opts, sizeof opts / sizeof opts[0], argc, argv, i, &o, &v);
    if (rc || !o)
        return rc;
    if (!strcmp(o->name, "--dtype")) {
        if (!moe_launch_parse_dtype(v, &a->dtype))
            return cli_fail("--dtype: '%s' is not one of f32, bf16, int8, int4", v);
    } else if (!strcmp(o->name, "--group-size")) {
        if (strcmp(v, "32") && strcmp(v, "64") && strcmp(v, "128"))
            return cli_fail("--group-size: '%s' is not one of 32, 64, 128", v);
        a->group_size = atoi(v);
    } else { /* --kv-dtype */
        if (!moe_kv_parse_dtype(v, &a->kv_dtype))
            return cli_fail("--kv-dtype: '%s' is not one of f32, bf16", v);
        a->kv_dtype_set = true;
    }
    return 0;
}

int moe_launch_cli_check(const struct moe_launch_args *a)
{
    if (!a->model)
        return cli_fail("--model DIR is required");
    if (a->group_size && a->dtype != MOE_DTYPE_I4)
        return cli_fail("--group-size goes with --dtype int4");
    return 0;
}

enum moe_status moe_launch_start(int *argc, char ***argv, const struct moe_launch_args *a,
                                 struct moe_launch *l, struct moe_error *err)
{
    memset(l, 0, sizeof *l);
    enum moe_status rc;
    if (moe_group_launched_by_mpi()) {
        if ((rc = moe_group_create(argc, argv, a->tp, a->dp_attention, a->comm_timeout_ms,
                                   &l->group, err)))
            return rc;
    } else if (a->tp > 1 || a->placement || a->dp_attention) {
        return moe_error_set(err, MOE_ERR_INVALID,
                             "--tp, --dp-attention and --placement need a group: run under mpirun");
    }
    struct moe_group *g = l->group;
    if (g && a->placement &&
        (rc = moe_placement_load_for_model(a->placement, a->model, g->size, &l->placement, err)))
        return rc;
    struct moe_error why = {0};
    rc = moe_backend_create_at(a->device, a->threads, g ? g->local_rank : 0, &l->be, &why);
    if (g) /* every rank learns whether all of them have a backend */
        rc = moe_group_attach_device(g, l->be, &why, err);
    else if (rc)
        *err = why;
    if (rc)
        return rc;
    bool invariant = a->batch_invariant;
    const char *env = getenv("MOE_BATCH_INVARIANT");
    if (env && strcmp(env, "0") && strcmp(env, "1"))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "MOE_BATCH_INVARIANT='%s': expected 0 or 1 (1 is --batch-invariant)",
                             env);
    if (l->be->device != MOE_DEVICE_CPU) {
        /* the CUDA backend picks its GEMMs by token count */
        if (invariant)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "--batch-invariant: the CUDA backend cannot promise it yet; "
                                 "use --device cpu");
        if (env && !strcmp(env, "1"))
            fprintf(stderr, "moe: MOE_BATCH_INVARIANT=1 ignored: the CUDA backend cannot "
                            "promise it yet\n");
    } else {
        invariant = invariant || (env && !strcmp(env, "1"));
    }
    l->model_opts = (struct moe_model_opts){
        .dtype = a->dtype,
        .q4_group = a->group_size,
        .fast = !a->exact,
        .batch_invariant = invariant,
        .profile = a->profile,
        .no_graphs = a->no_graphs,
        .kv_dtype = a->kv_dtype_set ? a->kv_dtype
                    : a->exact      ? MOE_DTYPE_F32
                                    : moe_backend_default_kv_dtype(l->be),
        .tp_rank = g ? g->tp_rank : 0,
        .tp_size = g ? g->tp_size : 1,
        .tp_comm = g ? moe_group_model_tp(g) : NULL,
        .ep_comm = g ? moe_group_model_ep(g) : NULL,
        .dp_attention = g && g->dp,
        .placement = g && a->placement ? &l->placement : NULL,
    };
    return MOE_OK;
}

void moe_launch_finish(struct moe_launch *l)
{
    moe_placement_free(&l->placement);
    moe_backend_destroy(l->be);
    moe_group_destroy(l->group);
    memset(l, 0, sizeof *l);
}
