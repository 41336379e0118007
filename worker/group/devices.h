/* Which device each rank of a group opened, and whether the group can run on
 * them: every rank on one kind of device, and no GPU opened by two ranks of
 * one node (NCCL refuses that with "Duplicate GPU detected"). group.c gathers
 * one record per rank right after the backends are made; the check is plain
 * C so the unit tests can feed it groups this machine cannot launch. */
#ifndef MOE_DEVICES_H
#define MOE_DEVICES_H

#include <stdint.h>

#include "backend.h"
#include "moe_error.h"

struct moe_rank_device {
    int32_t failed;   /* the rank could not make its backend: msg says why */
    int32_t device;   /* enum moe_device */
    int32_t ordinal;  /* CUDA device number, -1 on the CPU */
    int32_t node;     /* world rank of the node's first process (MPI shared-memory split) */
    uint32_t host_id; /* hash of NCCL_HOSTID (0 if unset): NCCL's own idea of a host */
    char msg[196];    /* the failure, or the backend's label */
};

/* This rank's record: its backend (NULL after a failure, described by
 * `why`), its node and NCCL_HOSTID from the environment. */
void moe_rank_device_fill(struct moe_rank_device *d, const struct moe_backend *be,
                          const struct moe_error *why, int node);

/* Checks the n records of a group (record r from rank r): the first failed
 * rank's reason, ranks on different kinds of device, or two ranks on one
 * GPU of one node, each named; MOE_OK when the group can run. */
enum moe_status moe_rank_devices_check(const struct moe_rank_device *d, int n,
                                       struct moe_error *err);

#endif
