#include "launch.h"

#include <string.h>

enum moe_status moe_launch_start(int *argc, char ***argv, const struct moe_launch_args *a,
                                 struct moe_launch *l, struct moe_error *err)
{
    memset(l, 0, sizeof *l);
    enum moe_status rc;
    if (moe_group_launched_by_mpi()) {
        if ((rc = moe_group_create(argc, argv, a->tp, a->comm_timeout_ms, &l->group, err)))
            return rc;
    } else if (a->tp > 1 || a->placement) {
        return moe_error_set(err, MOE_ERR_INVALID,
                             "--tp and --placement need a group: run under mpirun");
    }
    struct moe_group *g = l->group;
    if (g && a->placement &&
        (rc = moe_placement_load_for_model(a->placement, a->model, g->size, &l->placement, err)))
        return rc;
    if ((rc = moe_backend_create(a->device, a->threads, &l->be, err)))
        return rc;
    if (g && (rc = moe_group_attach_device(g, l->be, err)))
        return rc;
    l->model_opts = (struct moe_model_opts){
        .dtype = a->dtype,
        .tp_rank = g ? g->tp_rank : 0,
        .tp_size = g ? g->tp_size : 1,
        .tp_comm = g ? moe_group_model_tp(g) : NULL,
        .ep_comm = g ? moe_group_model_ep(g) : NULL,
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
