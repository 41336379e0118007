/* The start-up moe-generate and moe-worker share: a worker group when the
 * process was started by mpirun (refusing --tp, --dp-attention and
 * --placement otherwise),
 * the placement file, the compute backend (with NCCL communicators for the
 * model on a GPU), and the model options for this rank's shard. */
#ifndef MOE_LAUNCH_H
#define MOE_LAUNCH_H

#include "backend.h"
#include "group/group.h"
#include "model/model.h"
#include "placement.h"

struct moe_launch_args {
    const char *model;  /* checkpoint directory */
    const char *device; /* auto | cpu | cuda | cuda:N (moe_device_flag_parse) */
    int threads;
    enum moe_dtype dtype;
    int group_size;    /* --group-size: int4 columns per scale (0: 32) */
    int tp;            /* tensor-parallel size (under mpirun) */
    bool dp_attention; /* --dp-attention: every rank its own attention (under mpirun, TP 1) */
    int comm_timeout_ms;
    const char *placement; /* placement file, or NULL */
    bool exact;            /* --exact: f32 activations in every matmul (moe_model_opts.fast off) */
    /* --batch-invariant (moe_model_opts.batch_invariant); the environment's
     * MOE_BATCH_INVARIANT=1 asks for it too, where the backend can (CPU). */
    bool batch_invariant;
    /* --kv-dtype when given (kv_dtype_set); else the backend's default
     * (moe_backend_default_kv_dtype), F32 under --exact. */
    enum moe_dtype kv_dtype;
    bool kv_dtype_set;
    bool profile;   /* --profile (moe_model_opts.profile) */
    bool no_graphs; /* --no-cuda-graphs (moe_model_opts.no_graphs) */
};

struct moe_launch {
    struct moe_group *group;        /* NULL: one process */
    struct moe_placement placement; /* read from args.placement */
    struct moe_backend *be;
    struct moe_model_opts model_opts; /* this rank's shard; points into `placement` */
};

/* The --dtype spellings: "f32", "bf16", "int8", "int4" (weights quantized
 * at load, see moe_model_opts). parse returns false for anything else. */
bool moe_launch_parse_dtype(const char *s, enum moe_dtype *out);
const char *moe_launch_dtype_flag(enum moe_dtype dtype);

/* The command-line flags of every program that starts a worker group
 * (moe-generate, moe-worker), parsed in one place so that they mean and
 * refuse the same everywhere: --model, --device, --threads, --dtype,
 * --group-size, --kv-dtype, --exact, --batch-invariant, --no-cuda-graphs,
 * and under mpirun --tp, --dp-attention, --placement, --comm-timeout-ms.
 * (--profile is moe-generate's alone: it sets args.profile itself.)
 *
 * init: the defaults (bf16 weights, device auto, TP 1, 10 s comm timeout).
 * cli_flag: argv[*i] is one of these flags -> 0, *i moved past its value;
 * not one -> 1, *i unchanged; a missing or bad value -> 2, the exit code
 * for a bad command line, after cli_fail's one line naming the flag.
 * cli_check: after the last flag; what is wrong across flags (no --model,
 * --group-size without --dtype int4) -> 2 likewise, else 0. */
void moe_launch_args_init(struct moe_launch_args *a);
int moe_launch_cli_flag(struct moe_launch_args *a, int argc, char **argv, int *i);
int moe_launch_cli_check(const struct moe_launch_args *a);

/* Fills *l. On error what was made is kept for moe_launch_finish. */
enum moe_status moe_launch_start(int *argc, char ***argv, const struct moe_launch_args *args,
                                 struct moe_launch *l, struct moe_error *err);

/* Frees the placement, the backend and the group (MPI_Finalize), in that
 * order: call it after the model and everything on the backend are freed. */
void moe_launch_finish(struct moe_launch *l);

#endif
