#include "group/devices.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint32_t hash_str(const char *s)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 16777619u;
    return h ? h : 1;
}

void moe_rank_device_fill(struct moe_rank_device *d, const struct moe_backend *be,
                          const struct moe_error *why, int node)
{
    memset(d, 0, sizeof *d);
    d->node = node;
    const char *host = getenv("NCCL_HOSTID");
    d->host_id = host && *host ? hash_str(host) : 0;
    if (!be) {
        d->failed = 1;
        d->ordinal = -1;
        snprintf(d->msg, sizeof d->msg, "%.195s", why && why->msg[0] ? why->msg : "no backend");
        return;
    }
    d->device = (int32_t)be->device;
    d->ordinal = be->device == MOE_DEVICE_CUDA ? be->ordinal : -1;
    snprintf(d->msg, sizeof d->msg, "%.127s", be->label[0] ? be->label : be->name);
}

static const char *device_name(const struct moe_rank_device *d, char *buf, size_t cap)
{
    if (d->device == MOE_DEVICE_CUDA)
        snprintf(buf, cap, "cuda:%d", (int)d->ordinal);
    else
        snprintf(buf, cap, "cpu");
    return buf;
}

enum moe_status moe_rank_devices_check(const struct moe_rank_device *d, int n,
                                       struct moe_error *err)
{
    for (int r = 0; r < n; r++)
        if (d[r].failed)
            return moe_error_set(err, MOE_ERR_INVALID, "rank %d: %.*s", r, (int)sizeof d[r].msg,
                                 d[r].msg);
    char a[24], b[24];
    for (int r = 1; r < n; r++)
        if (d[r].device != d[0].device)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "rank 0 runs on %s, rank %d on %s: every rank of a group needs "
                                 "the same kind of device (give them all one --device)",
                                 device_name(&d[0], a, sizeof a), r,
                                 device_name(&d[r], b, sizeof b));
    if (d[0].device != MOE_DEVICE_CUDA)
        return MOE_OK;
    for (int r = 1; r < n; r++)
        for (int q = 0; q < r; q++)
            if (d[q].node == d[r].node && d[q].host_id == d[r].host_id &&
                d[q].ordinal == d[r].ordinal)
                return moe_error_set(err, MOE_ERR_INVALID,
                                     "ranks %d and %d both opened %s on one node: NCCL refuses "
                                     "two ranks of a communicator on one GPU (drop --device "
                                     "cuda:N so each rank takes its local rank's GPU)",
                                     q, r, device_name(&d[r], a, sizeof a));
    return MOE_OK;
}
