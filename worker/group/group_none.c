/* Worker groups in a build without MPI (MOE_SERVING=OFF): a process is
 * always a group of one, and asking for more is refused by name. */
#include "group/group.h"

#include <stdlib.h>
#include <string.h>

bool moe_group_launched_by_mpi(void)
{
    return false;
}

enum moe_status moe_group_create(int *argc, char ***argv, int tp_size, bool dp_attention,
                                 int timeout_ms, struct moe_group **out, struct moe_error *err)
{
    *out = NULL;
    return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                         "worker groups need MPI: this build has MOE_SERVING=OFF");
}

void moe_group_destroy(struct moe_group *g)
{
    (void)g;
}

enum moe_status moe_group_attach_device(struct moe_group *g, struct moe_backend *be,
                                        const struct moe_error *why, struct moe_error *err)
{
    return MOE_OK;
}

struct moe_comm *moe_group_model_tp(const struct moe_group *g)
{
    return NULL;
}

struct moe_comm *moe_group_model_ep(const struct moe_group *g)
{
    return NULL;
}

enum moe_status moe_group_forward(void *group, struct moe_model *m, struct moe_kv_cache *kv,
                                  const struct moe_batch *batch, float *logits,
                                  struct moe_error *err)
{
    return moe_model_forward(m, kv, batch, logits, err);
}

enum moe_status moe_group_follow(struct moe_group *g, struct moe_model *m, struct moe_error *err)
{
    return moe_error_set(err, MOE_ERR_UNSUPPORTED, "worker groups need MPI");
}

enum moe_status moe_group_stop(struct moe_group *g, struct moe_error *err)
{
    return MOE_OK;
}

enum moe_status moe_group_propose_placement(struct moe_group *g, const struct moe_placement *p,
                                            int64_t epoch, struct moe_error *err)
{
    return moe_error_set(err, MOE_ERR_UNSUPPORTED, "worker groups need MPI");
}

int64_t moe_group_placement_epoch(struct moe_group *g, double *last_switch_s)
{
    if (last_switch_s)
        *last_switch_s = 0;
    return 0;
}

void moe_group_rank_rows(struct moe_group *g, uint64_t *rows, uint64_t *steps)
{
    *steps = 0;
}
