/* The communicator of a worker group: collectives and point-to-point transfers
 * between the W ranks that together hold one model replica.
 *
 * Three backends sit behind one table of operations (ggml-backend style):
 *   local  W = 1, no peers: every operation is a copy or a no-op;
 *   mpi    host buffers, for CPU groups and tests under mpirun;
 *   nccl   device buffers on a caller-given CUDA stream (built only with
 *          MOE_HAVE_NCCL; elsewhere moe_comm_create_nccl answers UNSUPPORTED).
 *
 * Every operation is blocking for the caller: it returns when this rank's
 * part is complete, or with MOE_ERR_IO when the communicator's timeout passes
 * first ("rank 1: all_to_all_v timed out after 5000 ms waiting for rank 3") or
 * the transport reports a failed peer. It never hangs past the timeout. After
 * MOE_ERR_IO the communicator is broken: every later operation answers
 * MOE_ERR_IO at once, and the buffers passed to the failed call may still be
 * written by the transport. The only sensible reaction is to abort the group
 * (the executable calls MPI_Abort; the library never does).
 *
 * Every rank of a communicator must call the same collectives in the same
 * order (SPMD), as with MPI.
 *
 * A rank that dies under mpirun (tests/mpi, Open MPI 4.1): by default mpirun
 * itself notices the death (signal or non-zero exit) and kills the whole job
 * within about a second, printing which rank died; the survivors never see an
 * error. With `--mca orte_abort_on_non_zero_status 0` the survivors keep
 * running, the shared-memory transport reports nothing, and the timeout fires:
 * "rank 0: all_to_all_v timed out after 5000 ms waiting for rank 3". Either
 * way the group ends within the timeout instead of hanging.
 *
 * Sums: all_reduce_sum adds in an order fixed by the backend and the group
 * size, never by timing, and every rank receives bit-identical results. The
 * order differs from a plain loop over ranks, so a W = 2 run differs from a
 * W = 1 run by float rounding: compare such runs with a tolerance (1e-5
 * relative), not bitwise. */
#ifndef MOE_COMM_H
#define MOE_COMM_H

#include <stddef.h>
#include <stdint.h>

#ifdef MOE_HAVE_MPI
#include <mpi.h>
#endif

#include "moe_error.h"
#include "clock.h"

/* Colour for moe_comm_split: this rank joins no sub-group. */
#define MOE_COMM_NO_COLOR (-1)

struct moe_comm;

/* One backend's operations. Arguments are validated by the moe_comm_*
 * wrappers below before they reach a backend, and a broken communicator never
 * reaches it. Backends fill `err` with a message starting "rank R: ". */
struct moe_comm_ops {
    const char *name; /* "local", "mpi", "nccl" */
    enum moe_status (*all_reduce_sum_f32)(struct moe_comm *c, float *buf, size_t n,
                                          struct moe_error *err);
    enum moe_status (*all_gather)(struct moe_comm *c, const void *send, void *recv, size_t n_bytes,
                                  struct moe_error *err);
    enum moe_status (*all_to_all_v)(struct moe_comm *c, const void *send, const size_t *send_counts,
                                    const size_t *send_displs, void *recv,
                                    const size_t *recv_counts, const size_t *recv_displs,
                                    struct moe_error *err);
    /* Optional, both or neither (NULL: moe_comm_all_to_all_v_start runs the
     * whole exchange and _finish has nothing left): all_to_all_v in two
     * halves, the messages posted by start and completed by finish. */
    enum moe_status (*all_to_all_v_start)(struct moe_comm *c, const void *send,
                                          const size_t *send_counts, const size_t *send_displs,
                                          void *recv, const size_t *recv_counts,
                                          const size_t *recv_displs, struct moe_error *err);
    enum moe_status (*all_to_all_v_finish)(struct moe_comm *c, struct moe_error *err);
    /* Optional: NULL means "use all_to_all_v on host buffers". */
    enum moe_status (*all_to_all_counts)(struct moe_comm *c, const size_t *send_counts,
                                         size_t *recv_counts, struct moe_error *err);
    enum moe_status (*send)(struct moe_comm *c, const void *buf, size_t n_bytes, int peer,
                            struct moe_error *err);
    enum moe_status (*recv)(struct moe_comm *c, void *buf, size_t n_bytes, int peer,
                            struct moe_error *err);
    enum moe_status (*broadcast)(struct moe_comm *c, void *buf, size_t n_bytes, int root,
                                 struct moe_error *err);
    enum moe_status (*barrier)(struct moe_comm *c, struct moe_error *err);
    /* *out = NULL when color is MOE_COMM_NO_COLOR. */
    enum moe_status (*split)(struct moe_comm *c, int color, int key, struct moe_comm **out,
                             struct moe_error *err);
    void (*destroy)(struct moe_comm *c);
};

struct moe_comm {
    int rank;       /* 0 .. size-1 */
    int size;       /* W */
    int timeout_ms; /* per operation; <= 0 waits forever (tests only) */
    int broken;     /* set by the first MOE_ERR_IO; never cleared */
    int pending;    /* an all_to_all_v_start is waiting for its finish */
    const struct moe_comm_ops *ops;
    void *impl; /* backend state */
};

/* ---- creation ------------------------------------------------------------------ */

/* A communicator of one rank (rank 0, size 1). The caller owns *out and frees
 * it with moe_comm_destroy. On error *out is NULL. */
enum moe_status moe_comm_create_local(struct moe_comm **out, struct moe_error *err);

#ifdef MOE_HAVE_MPI
/* A communicator over the processes of `mpi_comm` (host buffers). MPI must be
 * initialised by the caller (MPI_Init or MPI_Init_thread; every call is made
 * from one thread at a time) and finalised after the last destroy. The
 * communicator is duplicated (MPI_Comm_idup, collective over mpi_comm, bounded
 * by timeout_ms) so the caller's handle and its error handler are untouched;
 * the duplicate uses MPI_ERRORS_RETURN. The caller owns *out. */
enum moe_status moe_comm_create_mpi(MPI_Comm mpi_comm, int timeout_ms, struct moe_comm **out,
                                    struct moe_error *err);
#endif

/* The NCCL unique id that rank 0 creates and ships to the others (by
 * MPI_Bcast, or etcd for groups not started by mpirun). */
#define MOE_COMM_NCCL_ID_BYTES 128
struct moe_comm_nccl_id {
    unsigned char bytes[MOE_COMM_NCCL_ID_BYTES];
};

/* Fills `id` with a fresh NCCL unique id (works without a GPU). UNSUPPORTED
 * in builds without CUDA. */
enum moe_status moe_comm_nccl_get_id(struct moe_comm_nccl_id *id, struct moe_error *err);

/* A communicator of `size` ranks over device buffers on CUDA device `device`.
 * Every rank passes the same `id`. `stream` is a cudaStream_t (as void * so
 * this header needs no CUDA): every operation is issued on it and waited for
 * (cudaStreamQuery polled together with ncclCommGetAsyncError) before the call
 * returns; the caller keeps owning the stream and must keep it alive until the
 * destroy. Initialisation is non-blocking (ncclCommInitRankConfig with
 * blocking = 0) and bounded by timeout_ms; on a timeout the NCCL communicator
 * is aborted (ncclCommAbort). The caller owns *out. UNSUPPORTED in builds
 * without CUDA. */
enum moe_status moe_comm_create_nccl(const struct moe_comm_nccl_id *id, int size, int rank,
                                     int device, void *stream, int timeout_ms,
                                     struct moe_comm **out, struct moe_error *err);

/* Splits `c` into sub-groups (e.g. the TP groups of a TP x DP group): ranks
 * passing the same `color` form one communicator, ordered by `key` (ties by
 * rank in `c`). Collective over `c`. A rank passing MOE_COMM_NO_COLOR gets
 * *out = NULL and MOE_OK. The new communicator inherits the backend, the
 * timeout (and for NCCL the device and stream); the caller owns it, and it may
 * outlive `c`. */
enum moe_status moe_comm_split(struct moe_comm *c, int color, int key, struct moe_comm **out,
                               struct moe_error *err);

/* Frees the communicator and its transport state (MPI_Comm_free; for NCCL
 * ncclCommFinalize + ncclCommDestroy, or ncclCommAbort when broken). Does not
 * finalise MPI. NULL is a no-op. */
void moe_comm_destroy(struct moe_comm *c);

/* ---- operations (all blocking, all bounded by the timeout) ------------------------ */

/* Sums `n` floats over all ranks, in place: buf: (n). */
enum moe_status moe_comm_all_reduce_sum(struct moe_comm *c, float *buf, size_t n,
                                        struct moe_error *err);

/* Every rank contributes `n_bytes` from `send`; `recv` (size * n_bytes) gets
 * rank r's bytes at offset r * n_bytes. `send` may be recv + rank * n_bytes
 * (in place); otherwise the buffers must not overlap. */
enum moe_status moe_comm_all_gather(struct moe_comm *c, const void *send, void *recv,
                                    size_t n_bytes, struct moe_error *err);

/* Personalised exchange: this rank sends send_counts[p] bytes starting at
 * send + send_displs[p] to rank p, and receives recv_counts[p] bytes from rank
 * p at recv + recv_displs[p]. All four arrays have `size` entries; counts may
 * be 0 (the message still synchronises the pair). recv_counts[p] must equal
 * what rank p sends here (exchange them first with moe_comm_all_to_all_counts).
 * The buffers must not overlap. */
enum moe_status moe_comm_all_to_all_v(struct moe_comm *c, const void *send,
                                      const size_t *send_counts, const size_t *send_displs,
                                      void *recv, const size_t *recv_counts,
                                      const size_t *recv_displs, struct moe_error *err);

/* moe_comm_all_to_all_v in two halves, so that work can run while the
 * messages travel and while the slowest peer catches up (the MoE layer
 * computes its shared experts there): start posts the exchange, finish
 * waits for it (the timeout counts from finish). Until finish returns, the
 * buffers belong to the exchange and no other operation may run on `c`
 * (refused by name). A backend without the split runs the whole exchange in
 * start. */
enum moe_status moe_comm_all_to_all_v_start(struct moe_comm *c, const void *send,
                                            const size_t *send_counts, const size_t *send_displs,
                                            void *recv, const size_t *recv_counts,
                                            const size_t *recv_displs, struct moe_error *err);
enum moe_status moe_comm_all_to_all_v_finish(struct moe_comm *c, struct moe_error *err);

/* Exchanges the counts of an all_to_all_v: recv_counts[p] becomes rank p's
 * send_counts[this rank]. Both arrays are host memory of `size` entries, for
 * every backend. */
enum moe_status moe_comm_all_to_all_counts(struct moe_comm *c, const size_t *send_counts,
                                           size_t *recv_counts, struct moe_error *err);

/* Sends `n_bytes` to rank `peer` (not this rank); returns when the buffer may
 * be reused. Messages between two ranks arrive in the order sent. */
enum moe_status moe_comm_send(struct moe_comm *c, const void *buf, size_t n_bytes, int peer,
                              struct moe_error *err);

/* Receives exactly `n_bytes` from rank `peer` (not this rank); a message of
 * another size is MOE_ERR_IO. */
enum moe_status moe_comm_recv(struct moe_comm *c, void *buf, size_t n_bytes, int peer,
                              struct moe_error *err);

/* Copies root's `n_bytes` at `buf` into every rank's `buf`. */
enum moe_status moe_comm_broadcast(struct moe_comm *c, void *buf, size_t n_bytes, int root,
                                   struct moe_error *err);

/* Returns when every rank has entered the barrier (or the timeout passed). */
enum moe_status moe_comm_barrier(struct moe_comm *c, struct moe_error *err);

/* "local", "mpi" or "nccl". */
const char *moe_comm_backend_name(const struct moe_comm *c);

/* ---- for backends ------------------------------------------------------------------ */

/* Writes the ranks in `peers` (n entries, duplicates skipped) as "rank 3" or
 * "ranks 2, 3" into buf. */
void moe_comm_format_peers(char *buf, size_t cap, const int *peers, int n);

/* For the backends' wait loops (poll `spins` times so far, for `waited_ms`):
 * gives the CPU away a little more the longer a wait lasts -- a few hundred
 * busy polls (the latency of small steps), then sched_yield, then 50 us
 * sleeps (ranks share cores when oversubscribed). */
void moe_comm_poll_backoff(long spins, int64_t waited_ms);

#endif
