/* A worker group: one model replica over W processes launched by mpirun.
 *
 * Rank 0 is the leader: it runs the scheduler (engine) and, before every
 * forward pass, broadcasts the step plan (the batch: tokens, positions,
 * sequences, KV slots, block tables); every rank then runs the same forward
 * in lock-step. Attention heads are split over tensor-parallel sub-groups of
 * tp_size consecutive ranks; experts over all W ranks. Followers keep a KV
 * cache shaped like the leader's (re-created when the leader's changes) and
 * compute no logits. On the CPU the collectives go over MPI.
 *
 * A rank that dies makes the others fail within the communicator timeout
 * during a step; while the group is idle, followers wait for the next plan
 * without a timeout and rely on mpirun, which ends the job when a rank dies. */
#ifndef MOE_GROUP_H
#define MOE_GROUP_H

#include <stdbool.h>

#include "comm.h"
#include "model.h"
#include "moe_error.h"

struct moe_group {
    int rank;
    int size;
    int tp_size;
    int tp_rank;
    struct moe_comm *world; /* all ranks: plan broadcast and expert parallel */
    struct moe_comm *tp;    /* this rank's tensor-parallel sub-group (NULL when tp_size 1) */
    struct moe_kv_cache *follower_kv;
    struct moe_model *follower_model;
};

/* True when this process was started by mpirun / mpiexec. */
bool moe_group_launched_by_mpi(void);

/* Initialises MPI (thread level SERIALIZED: the leader's engine thread makes
 * the calls) and builds the communicators. W must be a multiple of tp_size.
 * timeout_ms bounds every collective inside a step. */
enum moe_status moe_group_create(int *argc, char ***argv, int tp_size, int timeout_ms,
                                 struct moe_group **out, struct moe_error *err);

/* Frees the communicators and finalises MPI. NULL is a no-op. */
void moe_group_destroy(struct moe_group *g);

/* Leader: broadcasts the plan of `batch`, then runs the forward pass.
 * Matches moe_forward_fn with ctx = the group. */
enum moe_status moe_group_forward(void *group, struct moe_model *m, struct moe_kv_cache *kv,
                                  const struct moe_batch *batch, float *logits,
                                  struct moe_error *err);

/* Follower: runs every plan the leader sends until it sends stop. */
enum moe_status moe_group_follow(struct moe_group *g, struct moe_model *m, struct moe_error *err);

/* Leader: tells the followers to return from moe_group_follow. */
enum moe_status moe_group_stop(struct moe_group *g, struct moe_error *err);

#endif
