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
 * With data-parallel attention (--dp-attention) every DP group (a TP
 * sub-group: tp_size consecutive ranks, or each rank with TP 1) owns a part
 * of the leader's KV block pool and the sequences whose blocks are there:
 * the plan is the whole step, each DP group runs its share of it
 * (group/dp_batch.h) with its heads split over its TP ranks, the MoE layers
 * exchange the groups' distinct rows, and each group's logits come back to
 * the leader for sampling.
 *
 * A rank that dies makes the others fail within the communicator timeout
 * during a step; while the group is idle, followers wait for the next plan
 * without a timeout and rely on mpirun, which ends the job when a rank dies. */
#ifndef MOE_GROUP_H
#define MOE_GROUP_H

#include <stdbool.h>

#include <pthread.h>
#include <stdint.h>

#include "comm/comm.h"
#include "group/dp_batch.h"
#include "model/model.h"
#include "moe_error.h"
#include "placement.h"

struct moe_group {
    int rank;
    int size;
    int tp_size;
    int tp_rank;
    int local_rank;         /* index among the group's processes on this node: picks its GPU */
    int local_size;         /* the group's processes on this node */
    int node;               /* world rank of this node's first process */
    struct moe_comm *world; /* all ranks: plan broadcast and expert parallel */
    struct moe_comm *tp;    /* this rank's tensor-parallel sub-group (NULL when tp_size 1) */
    /* On GPUs the model's collectives run on device buffers over NCCL; the
     * step plans stay on MPI (host memory). NULL on the CPU. */
    struct moe_comm *dev_world;
    struct moe_comm *dev_tp;
    bool dp;                   /* data-parallel attention over more than one DP group */
    int dp_size;               /* DP groups (size / tp_size with dp, else 1): the KV pool's parts */
    struct moe_dp_split split; /* dp: this rank's share of the step */
    float *dp_logits;          /* dp: this rank's logit rows, then (leader) everyone's */
    size_t cap_dp_logits;      /* floats */
    float *dp_expert;          /* per (layer, expert) tokens this rank routed this step */
    uint64_t *dp_expert_seen;  /* this rank's counters at the last step */
    struct moe_kv_cache *follower_kv;
    bool kv_shared; /* follower_kv was made by moe_group_share_kv: its shape is fixed */
    struct moe_model *follower_model;

    /* live placement changes (see moe_group_propose_placement) */
    pthread_mutex_t mu; /* guards proposal_* */
    bool has_proposal;
    struct moe_placement proposal;
    int64_t proposal_epoch;
    bool preparing; /* a prepare is running on every rank */
    int64_t preparing_epoch;
    struct moe_placement preparing_placement;
    pthread_t prepare_thread;
    bool prepare_thread_live;
    enum moe_status prepare_status;
    struct moe_model *model; /* for the prepare thread */
    int64_t epoch;           /* committed placement epoch (0: the initial one) */
    double last_switch_s;    /* how long the last commit paused the step */
    int64_t switches;
    /* measured expert load per rank: rows each rank ran through its experts,
     * summed over steps (every rank learns them by one small all-reduce per
     * step) */
    uint64_t *rank_rows; /* (size) */
    uint64_t rows_seen;  /* this rank's moe_model_ep_rows_computed at the last step */
    uint64_t steps;
};

/* True when this process was started by mpirun / mpiexec. */
bool moe_group_launched_by_mpi(void);

/* Initialises MPI (thread level SERIALIZED: the leader's engine thread makes
 * the calls) and builds the communicators. W must be a multiple of tp_size
 * (with dp_attention: W / tp_size DP groups). timeout_ms bounds every
 * collective inside a step. */
enum moe_status moe_group_create(int *argc, char ***argv, int tp_size, bool dp_attention,
                                 int timeout_ms, struct moe_group **out, struct moe_error *err);

/* Called on every rank right after it made its backend (be), or failed to
 * (be NULL, `why` the reason): the ranks exchange what they opened and all
 * fail together, naming the rank, when one failed, when they are on
 * different kinds of device or when two share a GPU (group/devices.h).
 * Prints each rank's device on stderr. For a CUDA backend it then creates
 * the NCCL communicators the model uses, on the rank's own GPU (the unique id
 * travels by MPI broadcast). UNVERIFIED on a GPU: none has run this path
 * yet. */
enum moe_status moe_group_attach_device(struct moe_group *g, struct moe_backend *be,
                                        const struct moe_error *why, struct moe_error *err);

/* The communicators to give the model (struct moe_model_opts). */
struct moe_comm *moe_group_model_tp(const struct moe_group *g);
struct moe_comm *moe_group_model_ep(const struct moe_group *g);

/* Frees the communicators and finalises MPI. NULL is a no-op. */
void moe_group_destroy(struct moe_group *g);

/* Leader: broadcasts the plan of `batch`, then runs the forward pass.
 * Matches moe_forward_fn with ctx = the group. With data-parallel attention
 * the batch's block ids index the whole pool (the group's size times
 * kv->n_block, the leader's own part) and `logits` gets every rank's rows. */
enum moe_status moe_group_forward(void *group, struct moe_model *m, struct moe_kv_cache *kv,
                                  const struct moe_batch *batch, float *logits,
                                  struct moe_error *err);

/* Follower: runs every plan the leader sends until it sends stop. */
enum moe_status moe_group_follow(struct moe_group *g, struct moe_model *m, struct moe_error *err);

/* Leader, any thread: asks the group to move to placement `p` (copied) as
 * `epoch`. Returns at once. With the next step plan every rank starts loading
 * the experts it gains on a background thread; once every rank is ready they
 * all switch at the same step boundary (a pointer swap), so serving pauses
 * for no more than that. A newer proposal replaces one not yet started. */
enum moe_status moe_group_propose_placement(struct moe_group *g, const struct moe_placement *p,
                                            int64_t epoch, struct moe_error *err);

/* The committed placement epoch, and the pause of the last switch. */
int64_t moe_group_placement_epoch(struct moe_group *g, double *last_switch_s);

/* Rows each rank has run through its experts since start (n = group size),
 * and the steps counted. Any thread (a snapshot under the group's lock). */
void moe_group_rank_rows(struct moe_group *g, uint64_t *rows, uint64_t *steps);

/* Every rank, once, before serving (the leader after creating its engine,
 * followers before moe_group_follow): the leader's KV cache shape reaches
 * every rank, which creates its cache now rather than at the first step (the
 * KV data plane of disaggregated serving writes into it before any step),
 * and every rank's KV endpoint (`endpoint`, < 128 chars, may be "") is
 * gathered into `endpoints` ((size) x 128 chars, every rank). Followers get
 * their cache back in *kv_out (NULL on the leader): the caller frees it with
 * moe_kv_cache_free after moe_group_follow returned and its KV link ended. */
enum moe_status moe_group_share_kv(struct moe_group *g, struct moe_model *m, int n_block,
                                   int block_size, const char *endpoint, char *endpoints,
                                   struct moe_kv_cache **kv_out, struct moe_error *err);

/* Leader: tells the followers to return from moe_group_follow. */
enum moe_status moe_group_stop(struct moe_group *g, struct moe_error *err);

#endif
