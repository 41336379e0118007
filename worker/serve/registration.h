/* A worker group leader's membership in etcd:
 *  - its registration: /moe/workers/<id> -> a JSON description (address,
 *    role, device, model, KV capacity) under a lease that a keeper thread
 *    keeps alive; the coordinator watches the prefix and drops the worker
 *    when the lease expires (the process died) or the key is deleted (it
 *    drains);
 *  - the expert placement it follows: /moe/placement/<model> holds
 *    {"epoch": N, "placement": {...}} (written by the coordinator, see
 *    coordinator/placement_admin.c); every new epoch is proposed to the
 *    group, which loads the experts in the background and switches at a
 *    step boundary.
 * Without etcd (the embedded default) nothing of this runs. */
#ifndef MOE_SERVE_REGISTRATION_H
#define MOE_SERVE_REGISTRATION_H

#include "group/group.h"
#include "model_config.h"
#include "moe_error.h"

struct worker_registration_opts {
    const char *endpoints; /* etcd client URLs, comma separated */
    int lease_ttl_s;
    const char *id;         /* the key's last part */
    const char *address;    /* where the coordinator reaches the gRPC service */
    const char *role;       /* mixed | prefill | decode */
    const char *device;     /* the backend's name */
    const char *model_name; /* also names the placement key */
    int kv_blocks_total;
    int block_size;
    /* Follow the expert placement of this group (NULL or one rank: no). */
    struct moe_group *group;
    const struct moe_config *cfg;
};

struct worker_registration;

/* Registers (lease, key, keeper) and, for a multi-rank group, applies the
 * stored placement and starts watching it. Strings are copied. On error
 * *out is NULL, nothing stays registered, and err names etcd's answer. */
enum moe_status worker_registration_create(const struct worker_registration_opts *o,
                                           struct worker_registration **out, struct moe_error *err);

/* Call now and then (the main loop, every 100 ms): when the lease was lost
 * (etcd restarted and the lease expired, etcd down or cut off for longer
 * than the TTL) it registers again -- a new lease, the key, a keeper --
 * and, while etcd does not answer, tries again with a backoff doubling
 * from 100 ms to 2 s (+-25% jitter), until it succeeds or the worker
 * leaves. One attempt blocks for at most about a second. */
void worker_registration_tick(struct worker_registration *r);

/* Leaves now: the keeper stops and the lease is revoked, so the key is gone
 * at once (drain). Idempotent. */
void worker_registration_leave(struct worker_registration *r);

/* Stops watching and leaves; frees everything. NULL is a no-op. */
void worker_registration_destroy(struct worker_registration *r);

#endif
