/* The NCCL backend of the communicator: device buffers, one CUDA stream.
 *
 * The NCCL communicator is non-blocking (ncclConfig_t.blocking = 0): every
 * call may answer ncclInProgress, and ncclCommGetAsyncError tells when the
 * work is enqueued or failed. Each operation is enqueued on the backend's
 * stream and then waited for by polling ncclCommGetAsyncError and
 * cudaStreamQuery, with the communicator's timeout. On a timeout or an error
 * the NCCL communicator is aborted (ncclCommAbort), which also releases the
 * kernels stuck waiting for a dead peer, and the call returns MOE_ERR_IO.
 *
 * all_to_all_v is grouped ncclSend/ncclRecv (ncclGroupStart/End), the copy to
 * this rank a device-to-device cudaMemcpyAsync. The count exchange goes
 * through a small device buffer and a pinned host buffer (a device-to-pageable
 * copy would block the host and escape the timeout).
 *
 * Built only with MOE_HAVE_CUDA and MOE_SERVING (defines MOE_HAVE_NCCL). Compiled and linked on
 * machines without a GPU; it needs a GPU to run. */
#include "comm/comm.h"
#include "clock.h"

#include "dynlib.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- NCCL, loaded on first use ----
 * As cuBLAS (kernels/cuda/cublas_lazy.h): linked, libnccl would load into
 * every process of a CUDA build at start-up, GPU or not; it is dlopened by
 * the first moe_comm_nccl_get_id or moe_comm_create_nccl instead (its
 * soname, then the directory the build found it in), and the NCCL names
 * below are pointers to its functions. */
#define NCCL_SONAME MOE_DYNLIB_SONAME("libnccl", NCCL_MAJOR)

#define NCCL_FUNCTIONS(X)                                                                          \
    X(ncclAllGather)                                                                               \
    X(ncclAllReduce)                                                                               \
    X(ncclBroadcast)                                                                               \
    X(ncclCommAbort)                                                                               \
    X(ncclCommCount)                                                                               \
    X(ncclCommDestroy)                                                                             \
    X(ncclCommFinalize)                                                                            \
    X(ncclCommGetAsyncError)                                                                       \
    X(ncclCommInitRankConfig)                                                                      \
    X(ncclCommSplit)                                                                               \
    X(ncclCommUserRank)                                                                            \
    X(ncclGetErrorString)                                                                          \
    X(ncclGetLastError)                                                                            \
    X(ncclGetUniqueId)                                                                             \
    X(ncclGroupEnd)                                                                                \
    X(ncclGroupStart)                                                                              \
    X(ncclRecv)                                                                                    \
    X(ncclSend)

#define NCCL_POINTER(name) static __typeof__(name) *p_##name;
NCCL_FUNCTIONS(NCCL_POINTER)
#undef NCCL_POINTER

#define NCCL_SYM(name) {#name, (void **)&p_##name},
static const struct moe_dynlib_sym nccl_syms[] = {NCCL_FUNCTIONS(NCCL_SYM)};
#undef NCCL_SYM

static pthread_once_t nccl_once = PTHREAD_ONCE_INIT;
static char nccl_load_error[512]; /* empty when loaded */

static void nccl_load_once(void)
{
#ifdef MOE_NCCL_DIR
    const char *dir = MOE_NCCL_DIR;
#else
    const char *dir = NULL;
#endif
    (void)moe_dynlib_load(NCCL_SONAME, dir, nccl_syms, sizeof nccl_syms / sizeof nccl_syms[0],
                          nccl_load_error, sizeof nccl_load_error);
}

static enum moe_status nccl_load(const char *op, struct moe_error *err)
{
    pthread_once(&nccl_once, nccl_load_once);
    if (nccl_load_error[0])
        return moe_error_set(err, MOE_ERR_UNSUPPORTED, "%s: NCCL: %s", op, nccl_load_error);
    return MOE_OK;
}

#define ncclAllGather p_ncclAllGather
#define ncclAllReduce p_ncclAllReduce
#define ncclBroadcast p_ncclBroadcast
#define ncclCommAbort p_ncclCommAbort
#define ncclCommCount p_ncclCommCount
#define ncclCommDestroy p_ncclCommDestroy
#define ncclCommFinalize p_ncclCommFinalize
#define ncclCommGetAsyncError p_ncclCommGetAsyncError
#define ncclCommInitRankConfig p_ncclCommInitRankConfig
#define ncclCommSplit p_ncclCommSplit
#define ncclCommUserRank p_ncclCommUserRank
#define ncclGetErrorString p_ncclGetErrorString
#define ncclGetLastError p_ncclGetLastError
#define ncclGetUniqueId p_ncclGetUniqueId
#define ncclGroupEnd p_ncclGroupEnd
#define ncclGroupStart p_ncclGroupStart
#define ncclRecv p_ncclRecv
#define ncclSend p_ncclSend

_Static_assert(sizeof(ncclUniqueId) == MOE_COMM_NCCL_ID_BYTES, "ncclUniqueId size changed");

struct nccl_impl {
    ncclComm_t nc;       /* NULL once aborted */
    cudaStream_t stream; /* owned by the caller */
    int device;
    uint64_t *d_counts; /* device: (2, size) scratch for counts and the barrier */
    uint64_t *h_counts; /* pinned host: (2, size) */
};

static const struct moe_comm_ops nccl_ops;

static struct nccl_impl *impl_of(struct moe_comm *c)
{
    return c->impl;
}

static void nccl_abort(struct nccl_impl *m)
{
    if (m->nc) {
        ncclCommAbort(m->nc);
        m->nc = NULL;
    }
}

static enum moe_status nccl_fail(struct moe_comm *c, const char *op, const char *what,
                                 ncclResult_t r, struct moe_error *err)
{
    struct nccl_impl *m = impl_of(c);
    const char *last = m->nc ? ncclGetLastError(m->nc) : NULL;
    moe_error_set(err, MOE_ERR_IO, "rank %d: %s: %s failed: %s%s%s", c->rank, op, what,
                  ncclGetErrorString(r), last && last[0] ? ": " : "", last ? last : "");
    nccl_abort(m);
    return MOE_ERR_IO;
}

static enum moe_status cuda_fail(struct moe_comm *c, const char *op, const char *what,
                                 cudaError_t e, struct moe_error *err)
{
    moe_error_set(err, MOE_ERR_IO, "rank %d: %s: %s failed: %s", c->rank, op, what,
                  cudaGetErrorString(e));
    nccl_abort(impl_of(c));
    return MOE_ERR_IO;
}

/* Waits until the NCCL communicator `nc` has finished its pending
 * non-blocking call and, when `stream_too`, until the stream is idle. `peer`
 * (or -1) names the rank a point-to-point operation waits for. */
static enum moe_status nccl_wait(struct moe_comm *c, ncclComm_t nc, int stream_too, const char *op,
                                 int peer, struct moe_error *err)
{
    struct nccl_impl *m = impl_of(c);
    int64_t start = moe_now_ms();
    long spins = 0;
    for (;;) {
        ncclResult_t async = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(nc, &async);
        if (r != ncclSuccess)
            return nccl_fail(c, op, "ncclCommGetAsyncError", r, err);
        if (async != ncclSuccess && async != ncclInProgress)
            return nccl_fail(c, op, "NCCL", async, err);
        if (async == ncclSuccess) {
            if (!stream_too)
                return MOE_OK;
            cudaError_t e = cudaStreamQuery(m->stream);
            if (e == cudaSuccess)
                return MOE_OK;
            if (e != cudaErrorNotReady)
                return cuda_fail(c, op, "cudaStreamQuery", e, err);
        }
        int64_t waited = moe_now_ms() - start;
        if (c->timeout_ms > 0 && waited >= c->timeout_ms)
            break;
        moe_comm_poll_backoff(spins++, waited);
    }
    char who[64];
    if (peer >= 0)
        snprintf(who, sizeof(who), "rank %d", peer);
    else
        snprintf(who, sizeof(who), "the other %d rank%s", c->size - 1, c->size == 2 ? "" : "s");
    moe_error_set(err, MOE_ERR_IO, "rank %d: %s timed out after %d ms waiting for %s", c->rank, op,
                  c->timeout_ms, who);
    nccl_abort(m);
    return MOE_ERR_IO;
}

/* After an enqueueing call: fails on a real error, else waits for the work. */
static enum moe_status nccl_finish(struct moe_comm *c, ncclResult_t r, const char *op,
                                   const char *what, int peer, struct moe_error *err)
{
    if (r != ncclSuccess && r != ncclInProgress)
        return nccl_fail(c, op, what, r, err);
    return nccl_wait(c, impl_of(c)->nc, 1, op, peer, err);
}

static enum moe_status nccl_enter(struct moe_comm *c, const char *op, struct moe_error *err)
{
    struct nccl_impl *m = impl_of(c);
    if (!m->nc)
        return moe_error_set(err, MOE_ERR_IO, "rank %d: %s: NCCL communicator was aborted", c->rank,
                             op);
    cudaError_t e = cudaSetDevice(m->device);
    if (e != cudaSuccess)
        return cuda_fail(c, op, "cudaSetDevice", e, err);
    return MOE_OK;
}

/* ---- operations ---------------------------------------------------------------------- */

static enum moe_status nccl_all_reduce(struct moe_comm *c, float *buf, size_t n,
                                       struct moe_error *err)
{
    const char *op = "all_reduce_sum";
    struct nccl_impl *m = impl_of(c);
    enum moe_status st = nccl_enter(c, op, err);
    if (st)
        return st;
    ncclResult_t r = ncclAllReduce(buf, buf, n, ncclFloat32, ncclSum, m->nc, m->stream);
    return nccl_finish(c, r, op, "ncclAllReduce", -1, err);
}

static enum moe_status nccl_all_gather(struct moe_comm *c, const void *send, void *recv,
                                       size_t n_bytes, struct moe_error *err)
{
    const char *op = "all_gather";
    struct nccl_impl *m = impl_of(c);
    enum moe_status st = nccl_enter(c, op, err);
    if (st)
        return st;
    ncclResult_t r = ncclAllGather(send, recv, n_bytes, ncclUint8, m->nc, m->stream);
    return nccl_finish(c, r, op, "ncclAllGather", -1, err);
}

/* Enqueues the grouped sends and receives of an all_to_all_v. */
static ncclResult_t nccl_enqueue_a2a(struct moe_comm *c, const void *send,
                                     const size_t *send_counts, const size_t *send_displs,
                                     void *recv, const size_t *recv_counts,
                                     const size_t *recv_displs)
{
    struct nccl_impl *m = impl_of(c);
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess)
        return r;
    for (int k = 1; k < c->size && (r == ncclSuccess || r == ncclInProgress); k++) {
        int to = (c->rank + k) % c->size;
        int from = (c->rank - k + c->size) % c->size;
        r = ncclSend((const char *)send + send_displs[to], send_counts[to], ncclUint8, to, m->nc,
                     m->stream);
        if (r == ncclSuccess || r == ncclInProgress)
            r = ncclRecv((char *)recv + recv_displs[from], recv_counts[from], ncclUint8, from,
                         m->nc, m->stream);
    }
    ncclResult_t r_end = ncclGroupEnd();
    return r == ncclSuccess || r == ncclInProgress ? r_end : r;
}

static enum moe_status nccl_all_to_all_v(struct moe_comm *c, const void *send,
                                         const size_t *send_counts, const size_t *send_displs,
                                         void *recv, const size_t *recv_counts,
                                         const size_t *recv_displs, struct moe_error *err)
{
    const char *op = "all_to_all_v";
    struct nccl_impl *m = impl_of(c);
    int me = c->rank;
    enum moe_status st = nccl_enter(c, op, err);
    if (st)
        return st;
    if (send_counts[me] != recv_counts[me])
        return moe_error_set(err, MOE_ERR_INVALID,
                             "rank %d: all_to_all_v: send_counts[%d] = %zu but recv_counts[%d] = "
                             "%zu",
                             me, me, send_counts[me], me, recv_counts[me]);
    if (send_counts[me] > 0) {
        cudaError_t e =
            cudaMemcpyAsync((char *)recv + recv_displs[me], (const char *)send + send_displs[me],
                            send_counts[me], cudaMemcpyDeviceToDevice, m->stream);
        if (e != cudaSuccess)
            return cuda_fail(c, op, "cudaMemcpyAsync", e, err);
    }
    ncclResult_t r =
        nccl_enqueue_a2a(c, send, send_counts, send_displs, recv, recv_counts, recv_displs);
    return nccl_finish(c, r, op, "grouped ncclSend/ncclRecv", -1, err);
}

static enum moe_status nccl_all_to_all_counts(struct moe_comm *c, const size_t *send_counts,
                                              size_t *recv_counts, struct moe_error *err)
{
    const char *op = "all_to_all_counts";
    struct nccl_impl *m = impl_of(c);
    int size = c->size;
    enum moe_status st = nccl_enter(c, op, err);
    if (st)
        return st;
    for (int p = 0; p < size; p++)
        m->h_counts[p] = send_counts[p];
    size_t bytes = (size_t)size * sizeof(uint64_t);
    cudaError_t e =
        cudaMemcpyAsync(m->d_counts, m->h_counts, bytes, cudaMemcpyHostToDevice, m->stream);
    if (e != cudaSuccess)
        return cuda_fail(c, op, "cudaMemcpyAsync", e, err);

    size_t *one = malloc(2 * (size_t)size * sizeof(*one));
    if (!one)
        return moe_error_set(err, MOE_ERR_NOMEM, "rank %d: %s: out of memory", c->rank, op);
    size_t *displs = one + size;
    for (int p = 0; p < size; p++) {
        one[p] = sizeof(uint64_t);
        displs[p] = (size_t)p * sizeof(uint64_t);
    }
    /* Own slot: device copy inside the same stream order. */
    e = cudaMemcpyAsync(m->d_counts + size + c->rank, m->d_counts + c->rank, sizeof(uint64_t),
                        cudaMemcpyDeviceToDevice, m->stream);
    ncclResult_t r = ncclSuccess;
    if (e == cudaSuccess)
        r = nccl_enqueue_a2a(c, m->d_counts, one, displs, m->d_counts + size, one, displs);
    free(one);
    if (e != cudaSuccess)
        return cuda_fail(c, op, "cudaMemcpyAsync", e, err);
    if (r != ncclSuccess && r != ncclInProgress)
        return nccl_fail(c, op, "grouped ncclSend/ncclRecv", r, err);
    /* The enqueue must be complete before the copy back is ordered after it. */
    st = nccl_wait(c, m->nc, 0, op, -1, err);
    if (st)
        return st;
    e = cudaMemcpyAsync(m->h_counts + size, m->d_counts + size, bytes, cudaMemcpyDeviceToHost,
                        m->stream);
    if (e != cudaSuccess)
        return cuda_fail(c, op, "cudaMemcpyAsync", e, err);
    st = nccl_wait(c, m->nc, 1, op, -1, err);
    if (st)
        return st;
    for (int p = 0; p < size; p++)
        recv_counts[p] = (size_t)m->h_counts[size + p];
    return MOE_OK;
}

static enum moe_status nccl_send(struct moe_comm *c, const void *buf, size_t n_bytes, int peer,
                                 struct moe_error *err)
{
    struct nccl_impl *m = impl_of(c);
    enum moe_status st = nccl_enter(c, "send", err);
    if (st)
        return st;
    ncclResult_t r = ncclSend(buf, n_bytes, ncclUint8, peer, m->nc, m->stream);
    return nccl_finish(c, r, "send", "ncclSend", peer, err);
}

static enum moe_status nccl_recv(struct moe_comm *c, void *buf, size_t n_bytes, int peer,
                                 struct moe_error *err)
{
    struct nccl_impl *m = impl_of(c);
    enum moe_status st = nccl_enter(c, "recv", err);
    if (st)
        return st;
    ncclResult_t r = ncclRecv(buf, n_bytes, ncclUint8, peer, m->nc, m->stream);
    return nccl_finish(c, r, "recv", "ncclRecv", peer, err);
}

static enum moe_status nccl_broadcast(struct moe_comm *c, void *buf, size_t n_bytes, int root,
                                      struct moe_error *err)
{
    struct nccl_impl *m = impl_of(c);
    enum moe_status st = nccl_enter(c, "broadcast", err);
    if (st)
        return st;
    ncclResult_t r = ncclBroadcast(buf, buf, n_bytes, ncclUint8, root, m->nc, m->stream);
    return nccl_finish(c, r, "broadcast", "ncclBroadcast", -1, err);
}

/* An all-reduce of one value: returns only once every rank has joined. */
static enum moe_status nccl_barrier(struct moe_comm *c, struct moe_error *err)
{
    struct nccl_impl *m = impl_of(c);
    enum moe_status st = nccl_enter(c, "barrier", err);
    if (st)
        return st;
    ncclResult_t r =
        ncclAllReduce(m->d_counts, m->d_counts, 1, ncclFloat32, ncclSum, m->nc, m->stream);
    return nccl_finish(c, r, "barrier", "ncclAllReduce", -1, err);
}

/* Wraps an NCCL communicator that is initialised (or initialising: the caller
 * waited). Takes ownership of `nc` (aborted on failure). */
static enum moe_status nccl_wrap(ncclComm_t nc, int rank, int size, int device, cudaStream_t stream,
                                 int timeout_ms, struct moe_comm **out, struct moe_error *err)
{
    struct moe_comm *c = calloc(1, sizeof(*c));
    struct nccl_impl *m = calloc(1, sizeof(*m));
    size_t bytes = 2 * (size_t)size * sizeof(uint64_t);
    if (!c || !m) {
        free(c);
        free(m);
        ncclCommAbort(nc);
        return moe_error_set(err, MOE_ERR_NOMEM, "comm_create_nccl: out of memory");
    }
    m->nc = nc;
    m->stream = stream;
    m->device = device;
    c->rank = rank;
    c->size = size;
    c->timeout_ms = timeout_ms;
    c->ops = &nccl_ops;
    c->impl = m;
    cudaError_t e = cudaMalloc((void **)&m->d_counts, bytes);
    if (e == cudaSuccess)
        e = cudaMemset(m->d_counts, 0, bytes); /* the barrier sums these */
    if (e == cudaSuccess)
        e = cudaMallocHost((void **)&m->h_counts, bytes);
    if (e != cudaSuccess) {
        moe_error_set(err, MOE_ERR_NOMEM, "rank %d: comm_create_nccl: %zu bytes of scratch: %s",
                      rank, bytes, cudaGetErrorString(e));
        c->broken = 1; /* abort rather than finalise */
        moe_comm_destroy(c);
        return MOE_ERR_NOMEM;
    }
    *out = c;
    return MOE_OK;
}

static enum moe_status nccl_split(struct moe_comm *c, int color, int key, struct moe_comm **out,
                                  struct moe_error *err)
{
    struct nccl_impl *m = impl_of(c);
    enum moe_status st = nccl_enter(c, "split", err);
    if (st)
        return st;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t sub = NULL;
    ncclResult_t r = ncclCommSplit(m->nc, color == MOE_COMM_NO_COLOR ? NCCL_SPLIT_NOCOLOR : color,
                                   key, &sub, &cfg);
    if (r != ncclSuccess && r != ncclInProgress)
        return nccl_fail(c, "split", "ncclCommSplit", r, err);
    st = nccl_wait(c, m->nc, 0, "split", -1, err);
    if (st) {
        if (sub)
            ncclCommAbort(sub);
        return st;
    }
    if (!sub)
        return MOE_OK;
    /* The child finishes its own initialisation: wait on it with a stand-in
     * communicator so a failure aborts the child, not the parent. */
    struct nccl_impl child_impl = {sub, m->stream, m->device, NULL, NULL};
    struct moe_comm child = *c;
    child.impl = &child_impl;
    st = nccl_wait(&child, sub, 0, "split", -1, err);
    if (st)
        return st; /* nccl_wait aborted the child */
    int sub_rank = 0, sub_size = 0;
    r = ncclCommUserRank(sub, &sub_rank);
    if (r == ncclSuccess)
        r = ncclCommCount(sub, &sub_size);
    if (r != ncclSuccess)
        return nccl_fail(&child, "split", "ncclCommUserRank/Count", r, err);
    return nccl_wrap(sub, sub_rank, sub_size, m->device, m->stream, c->timeout_ms, out, err);
}

static void nccl_destroy(struct moe_comm *c)
{
    struct nccl_impl *m = impl_of(c);
    if (m) {
        if (m->nc && !c->broken && cudaSetDevice(m->device) == cudaSuccess) {
            /* Flush and release; a finalise that does not finish in time is
             * aborted like any other stuck operation. */
            struct moe_error ignored;
            ncclResult_t r = ncclCommFinalize(m->nc);
            if (r == ncclSuccess || r == ncclInProgress) {
                if (nccl_wait(c, m->nc, 0, "destroy", -1, &ignored) == MOE_OK) {
                    ncclCommDestroy(m->nc);
                    m->nc = NULL;
                }
            }
        }
        nccl_abort(m);
        cudaFree(m->d_counts);
        cudaFreeHost(m->h_counts);
        free(m);
    }
    free(c);
}

static const struct moe_comm_ops nccl_ops = {
    .name = "nccl",
    .all_reduce_sum_f32 = nccl_all_reduce,
    .all_gather = nccl_all_gather,
    .all_to_all_v = nccl_all_to_all_v,
    .all_to_all_counts = nccl_all_to_all_counts,
    .send = nccl_send,
    .recv = nccl_recv,
    .broadcast = nccl_broadcast,
    .barrier = nccl_barrier,
    .split = nccl_split,
    .destroy = nccl_destroy,
};

enum moe_status moe_comm_nccl_get_id(struct moe_comm_nccl_id *id, struct moe_error *err)
{
    if (!id)
        return moe_error_set(err, MOE_ERR_INVALID, "comm_nccl_get_id: id is NULL");
    enum moe_status st = nccl_load("comm_nccl_get_id", err);
    if (st)
        return st;
    ncclUniqueId uid;
    ncclResult_t r = ncclGetUniqueId(&uid);
    if (r != ncclSuccess)
        return moe_error_set(err, MOE_ERR_IO, "comm_nccl_get_id: ncclGetUniqueId failed: %s",
                             ncclGetErrorString(r));
    memcpy(id->bytes, &uid, sizeof(uid));
    return MOE_OK;
}

enum moe_status moe_comm_create_nccl(const struct moe_comm_nccl_id *id, int size, int rank,
                                     int device, void *stream, int timeout_ms,
                                     struct moe_comm **out, struct moe_error *err)
{
    if (!out)
        return moe_error_set(err, MOE_ERR_INVALID, "comm_create_nccl: out is NULL");
    *out = NULL;
    if (!id)
        return moe_error_set(err, MOE_ERR_INVALID, "comm_create_nccl: id is NULL");
    if (size < 1 || rank < 0 || rank >= size)
        return moe_error_set(err, MOE_ERR_INVALID, "comm_create_nccl: rank %d of size %d", rank,
                             size);
    enum moe_status st = nccl_load("comm_create_nccl", err);
    if (st)
        return st;
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess)
        return moe_error_set(err, MOE_ERR_IO, "rank %d: comm_create_nccl: cudaSetDevice(%d): %s",
                             rank, device, cudaGetErrorString(e));
    ncclUniqueId uid;
    memcpy(&uid, id->bytes, sizeof(uid));
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t nc = NULL;
    ncclResult_t r = ncclCommInitRankConfig(&nc, size, uid, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        if (nc)
            ncclCommAbort(nc);
        return moe_error_set(err, MOE_ERR_IO,
                             "rank %d: comm_create_nccl: ncclCommInitRankConfig failed: %s", rank,
                             ncclGetErrorString(r));
    }
    /* Wait for the initialisation with a stand-in that owns nothing else. */
    struct nccl_impl probe_impl = {nc, (cudaStream_t)stream, device, NULL, NULL};
    struct moe_comm probe = {.rank = rank,
                             .size = size,
                             .timeout_ms = timeout_ms,
                             .ops = &nccl_ops,
                             .impl = &probe_impl};
    st = nccl_wait(&probe, nc, 0, "comm_create_nccl", -1, err);
    if (st)
        return st; /* aborted by nccl_wait */
    return nccl_wrap(nc, rank, size, device, (cudaStream_t)stream, timeout_ms, out, err);
}
