/* The MPI backend of the communicator: host buffers, non-blocking MPI calls
 * polled with MPI_Testsome until they complete or the timeout passes.
 *
 * Collectives use the matching MPI_I* call (Iallreduce, Iallgather, Ibcast,
 * Ibarrier). all_to_all_v is built from Irecv/Isend pairs instead of
 * MPI_Ialltoallv, so that a timeout can name the ranks that never answered
 * ("waiting for rank 3"); Open MPI's own alltoallv is pairwise Isend/Irecv as
 * well, so nothing is lost (tests/mpi/test_comm_time.c measures both).
 *
 * The MPI communicator is a duplicate owned by this backend, with
 * MPI_ERRORS_RETURN, so MPI failures come back as return codes. On a timeout
 * pending receives are cancelled; pending collectives cannot be cancelled in
 * MPI and are left behind (the communicator is broken from then on). */
#include "comm/comm.h"
#include "clock.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { MPI_COMM_TAG_P2P = 1, MPI_COMM_TAG_A2A = 2 };

struct mpi_impl {
    MPI_Comm comm;
    /* Scratch for one all_to_all_v: 2 * size entries each. */
    MPI_Request *reqs;
    int *peers;     /* the rank behind each request */
    size_t *expect; /* bytes expected by a receive, SIZE_MAX for a send */
    int *idx;
    MPI_Status *statuses;
    int n_posted; /* requests of a started all_to_all_v, completed by its finish */
};

static const struct moe_comm_ops mpi_ops;

static struct mpi_impl *impl_of(struct moe_comm *c)
{
    return c->impl;
}

static enum moe_status mpi_error(struct moe_comm *c, const char *op, int rc, struct moe_error *err)
{
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS)
        snprintf(text, sizeof(text), "MPI error %d", rc);
    return moe_error_set(err, MOE_ERR_IO, "rank %d: %s failed: %s", c->rank, op, text);
}

static enum moe_status check_int(struct moe_comm *c, const char *op, size_t n,
                                 struct moe_error *err)
{
    if (n > (size_t)INT_MAX)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "rank %d: %s: %zu elements exceed the MPI count limit %d", c->rank, op,
                             n, INT_MAX);
    return MOE_OK;
}

/* Waits for `n` requests. peers[i] names the rank behind request i (or -1 for
 * a collective); expect[i] (may be NULL) is the byte count a receive must
 * deliver. On a timeout the pending point-to-point receives are cancelled. */
static enum moe_status mpi_wait(struct moe_comm *c, const char *op, MPI_Request *reqs, int n,
                                const int *peers, const size_t *expect, struct moe_error *err)
{
    struct mpi_impl *m = impl_of(c);
    int idx_one;
    MPI_Status status_one;
    int *idx = n == 1 ? &idx_one : m->idx;
    MPI_Status *statuses = n == 1 ? &status_one : m->statuses;
    int64_t start = moe_now_ms();
    long spins = 0;

    for (;;) {
        int n_done = 0;
        int rc = MPI_Testsome(n, reqs, &n_done, idx, statuses);
        if (rc != MPI_SUCCESS) {
            /* MPI_ERR_IN_STATUS: the per-request code tells more. */
            int peer = -1;
            if (rc == MPI_ERR_IN_STATUS) {
                for (int i = 0; i < n_done; i++) {
                    if (statuses[i].MPI_ERROR != MPI_SUCCESS) {
                        rc = statuses[i].MPI_ERROR;
                        peer = peers ? peers[idx[i]] : -1;
                        break;
                    }
                }
            }
            char text[MPI_MAX_ERROR_STRING];
            int len = 0;
            if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS)
                snprintf(text, sizeof(text), "MPI error %d", rc);
            if (peer >= 0)
                return moe_error_set(err, MOE_ERR_IO, "rank %d: %s with rank %d failed: %s",
                                     c->rank, op, peer, text);
            return moe_error_set(err, MOE_ERR_IO, "rank %d: %s failed: %s", c->rank, op, text);
        }
        if (n_done == MPI_UNDEFINED)
            return MOE_OK;
        for (int i = 0; i < n_done; i++) {
            int r = idx[i];
            if (!expect || expect[r] == SIZE_MAX)
                continue;
            int got = 0;
            MPI_Get_count(&statuses[i], MPI_BYTE, &got);
            if ((size_t)got != expect[r])
                return moe_error_set(err, MOE_ERR_IO,
                                     "rank %d: %s: rank %d sent %d bytes, expected %zu", c->rank,
                                     op, peers[r], got, expect[r]);
        }
        if (n_done > 0)
            continue;

        int64_t waited = moe_now_ms() - start;
        if (c->timeout_ms > 0 && waited >= c->timeout_ms)
            break;
        moe_comm_poll_backoff(spins++, waited);
    }

    /* Timed out: name who we were waiting for, then drop what can be dropped. */
    char who[256];
    int n_late = 0;
    int *late = m->idx; /* reuse as scratch: Testsome is done with it */
    int late_one;
    if (n == 1)
        late = &late_one;
    for (int i = 0; i < n; i++)
        if (reqs[i] != MPI_REQUEST_NULL && peers && peers[i] >= 0)
            late[n_late++] = peers[i];
    if (n_late > 0)
        moe_comm_format_peers(who, sizeof(who), late, n_late);
    else
        snprintf(who, sizeof(who), "the other %d rank%s", c->size - 1, c->size == 2 ? "" : "s");
    for (int i = 0; i < n; i++) {
        if (reqs[i] == MPI_REQUEST_NULL || !peers || peers[i] < 0)
            continue; /* collectives cannot be cancelled */
        if (expect && expect[i] != SIZE_MAX)
            MPI_Cancel(&reqs[i]);
        MPI_Request_free(&reqs[i]);
    }
    return moe_error_set(err, MOE_ERR_IO, "rank %d: %s timed out after %d ms waiting for %s",
                         c->rank, op, c->timeout_ms, who);
}

static enum moe_status wait_one(struct moe_comm *c, const char *op, MPI_Request *req,
                                struct moe_error *err)
{
    return mpi_wait(c, op, req, 1, NULL, NULL, err);
}

/* ---- operations ---------------------------------------------------------------------- */

static enum moe_status mpi_all_reduce(struct moe_comm *c, float *buf, size_t n,
                                      struct moe_error *err)
{
    const char *op = "all_reduce_sum";
    MPI_Request req;
    enum moe_status st = check_int(c, op, n, err);
    if (st)
        return st;
    int rc = MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, impl_of(c)->comm, &req);
    if (rc != MPI_SUCCESS)
        return mpi_error(c, op, rc, err);
    return wait_one(c, op, &req, err);
}

static enum moe_status mpi_all_gather(struct moe_comm *c, const void *send, void *recv,
                                      size_t n_bytes, struct moe_error *err)
{
    const char *op = "all_gather";
    MPI_Request req;
    enum moe_status st = check_int(c, op, n_bytes, err);
    if (st)
        return st;
    const void *sendbuf = send;
    if (n_bytes > 0 && send == (const char *)recv + (size_t)c->rank * n_bytes)
        sendbuf = MPI_IN_PLACE;
    int rc = MPI_Iallgather(sendbuf, (int)n_bytes, MPI_BYTE, recv, (int)n_bytes, MPI_BYTE,
                            impl_of(c)->comm, &req);
    if (rc != MPI_SUCCESS)
        return mpi_error(c, op, rc, err);
    return wait_one(c, op, &req, err);
}

/* Posts an all_to_all_v's receives and sends (m->reqs, m->n_posted). */
static enum moe_status mpi_all_to_all_v_start(struct moe_comm *c, const void *send,
                                              const size_t *send_counts, const size_t *send_displs,
                                              void *recv, const size_t *recv_counts,
                                              const size_t *recv_displs, struct moe_error *err)
{
    const char *op = "all_to_all_v";
    struct mpi_impl *m = impl_of(c);
    int me = c->rank;
    for (int p = 0; p < c->size; p++) {
        enum moe_status st = check_int(c, op, send_counts[p], err);
        if (!st)
            st = check_int(c, op, recv_counts[p], err);
        if (st)
            return st;
    }
    if (send_counts[me] != recv_counts[me])
        return moe_error_set(err, MOE_ERR_INVALID,
                             "rank %d: all_to_all_v: send_counts[%d] = %zu but recv_counts[%d] = "
                             "%zu",
                             me, me, send_counts[me], me, recv_counts[me]);

    /* Receives first, then sends in ring order starting after this rank, so the
     * ranks do not all send to rank 0 first. Zero-byte messages are sent too:
     * they keep every pair in step and detect a dead peer. */
    int n = 0;
    for (int k = 1; k < c->size; k++) {
        int p = (me - k + c->size) % c->size;
        m->peers[n] = p;
        m->expect[n] = recv_counts[p];
        int rc =
            MPI_Irecv(recv_counts[p] ? (char *)recv + recv_displs[p] : NULL, (int)recv_counts[p],
                      MPI_BYTE, p, MPI_COMM_TAG_A2A, m->comm, &m->reqs[n]);
        if (rc != MPI_SUCCESS)
            goto fail_posted;
        n++;
    }
    for (int k = 1; k < c->size; k++) {
        int p = (me + k) % c->size;
        m->peers[n] = p;
        m->expect[n] = SIZE_MAX;
        int rc =
            MPI_Isend(send_counts[p] ? (const char *)send + send_displs[p] : NULL,
                      (int)send_counts[p], MPI_BYTE, p, MPI_COMM_TAG_A2A, m->comm, &m->reqs[n]);
        if (rc != MPI_SUCCESS)
            goto fail_posted;
        n++;
    }
    if (send_counts[me] > 0)
        memmove((char *)recv + recv_displs[me], (const char *)send + send_displs[me],
                send_counts[me]);
    m->n_posted = n;
    return MOE_OK;

fail_posted:
    /* Could not post everything: cancel what was posted. */
    for (int i = 0; i < n; i++) {
        if (m->expect[i] != SIZE_MAX)
            MPI_Cancel(&m->reqs[i]);
        MPI_Request_free(&m->reqs[i]);
    }
    return moe_error_set(err, MOE_ERR_IO,
                         "rank %d: all_to_all_v: posting message %d to/from rank "
                         "%d failed",
                         me, n, m->peers[n]);
}

static enum moe_status mpi_all_to_all_v_finish(struct moe_comm *c, struct moe_error *err)
{
    struct mpi_impl *m = impl_of(c);
    int n = m->n_posted;
    m->n_posted = 0;
    return mpi_wait(c, "all_to_all_v", m->reqs, n, m->peers, m->expect, err);
}

static enum moe_status mpi_all_to_all_v(struct moe_comm *c, const void *send,
                                        const size_t *send_counts, const size_t *send_displs,
                                        void *recv, const size_t *recv_counts,
                                        const size_t *recv_displs, struct moe_error *err)
{
    enum moe_status st = mpi_all_to_all_v_start(c, send, send_counts, send_displs, recv,
                                                recv_counts, recv_displs, err);
    return st ? st : mpi_all_to_all_v_finish(c, err);
}

static enum moe_status mpi_send(struct moe_comm *c, const void *buf, size_t n_bytes, int peer,
                                struct moe_error *err)
{
    MPI_Request req;
    enum moe_status st = check_int(c, "send", n_bytes, err);
    if (st)
        return st;
    int rc = MPI_Isend(buf, (int)n_bytes, MPI_BYTE, peer, MPI_COMM_TAG_P2P, impl_of(c)->comm, &req);
    if (rc != MPI_SUCCESS)
        return mpi_error(c, "send", rc, err);
    return mpi_wait(c, "send", &req, 1, &peer, NULL, err);
}

static enum moe_status mpi_recv(struct moe_comm *c, void *buf, size_t n_bytes, int peer,
                                struct moe_error *err)
{
    MPI_Request req;
    enum moe_status st = check_int(c, "recv", n_bytes, err);
    if (st)
        return st;
    int rc = MPI_Irecv(buf, (int)n_bytes, MPI_BYTE, peer, MPI_COMM_TAG_P2P, impl_of(c)->comm, &req);
    if (rc != MPI_SUCCESS)
        return mpi_error(c, "recv", rc, err);
    return mpi_wait(c, "recv", &req, 1, &peer, &n_bytes, err);
}

static enum moe_status mpi_broadcast(struct moe_comm *c, void *buf, size_t n_bytes, int root,
                                     struct moe_error *err)
{
    MPI_Request req;
    enum moe_status st = check_int(c, "broadcast", n_bytes, err);
    if (st)
        return st;
    int rc = MPI_Ibcast(buf, (int)n_bytes, MPI_BYTE, root, impl_of(c)->comm, &req);
    if (rc != MPI_SUCCESS)
        return mpi_error(c, "broadcast", rc, err);
    return wait_one(c, "broadcast", &req, err);
}

static enum moe_status mpi_barrier(struct moe_comm *c, struct moe_error *err)
{
    MPI_Request req;
    int rc = MPI_Ibarrier(impl_of(c)->comm, &req);
    if (rc != MPI_SUCCESS)
        return mpi_error(c, "barrier", rc, err);
    return wait_one(c, "barrier", &req, err);
}

/* Wraps an MPI communicator this backend now owns (freed on failure). */
static enum moe_status mpi_wrap(MPI_Comm comm, int timeout_ms, struct moe_comm **out,
                                struct moe_error *err)
{
    struct moe_comm *c = calloc(1, sizeof(*c));
    struct mpi_impl *m = calloc(1, sizeof(*m));
    int rank = 0, size = 0;
    if (!c || !m)
        goto fail_nomem;
    m->comm = comm;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    c->rank = rank;
    c->size = size;
    c->timeout_ms = timeout_ms;
    c->ops = &mpi_ops;
    c->impl = m;
    size_t n = 2 * (size_t)size;
    m->reqs = malloc(n * sizeof(*m->reqs));
    m->peers = malloc(n * sizeof(*m->peers));
    m->expect = malloc(n * sizeof(*m->expect));
    m->idx = malloc(n * sizeof(*m->idx));
    m->statuses = malloc(n * sizeof(*m->statuses));
    if (!m->reqs || !m->peers || !m->expect || !m->idx || !m->statuses)
        goto fail_nomem;
    int rc = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    if (rc != MPI_SUCCESS) {
        mpi_error(c, "comm_create_mpi: MPI_Comm_set_errhandler", rc, err);
        moe_comm_destroy(c);
        return MOE_ERR_IO;
    }
    *out = c;
    return MOE_OK;

fail_nomem:
    if (c && m) {
        c->impl = m;
        c->ops = &mpi_ops;
        moe_comm_destroy(c);
    } else {
        free(c);
        free(m);
        MPI_Comm_free(&comm);
    }
    return moe_error_set(err, MOE_ERR_NOMEM, "comm_create_mpi: out of memory");
}

static enum moe_status mpi_split(struct moe_comm *c, int color, int key, struct moe_comm **out,
                                 struct moe_error *err)
{
    /* MPI has no non-blocking split: a timed barrier first makes sure every
     * rank is alive and has arrived, so the blocking split cannot hang on a
     * dead peer (only on one that dies in between). */
    enum moe_status st = mpi_barrier(c, err);
    if (st) {
        moe_error_prefix(err, "split");
        return st;
    }
    MPI_Comm sub = MPI_COMM_NULL;
    int rc = MPI_Comm_split(impl_of(c)->comm, color == MOE_COMM_NO_COLOR ? MPI_UNDEFINED : color,
                            key, &sub);
    if (rc != MPI_SUCCESS)
        return mpi_error(c, "split", rc, err);
    if (sub == MPI_COMM_NULL)
        return MOE_OK;
    return mpi_wrap(sub, c->timeout_ms, out, err);
}

static void mpi_destroy(struct moe_comm *c)
{
    struct mpi_impl *m = impl_of(c);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (m) {
        if (!finalized && m->comm != MPI_COMM_NULL)
            MPI_Comm_free(&m->comm);
        free(m->reqs);
        free(m->peers);
        free(m->expect);
        free(m->idx);
        free(m->statuses);
        free(m);
    }
    free(c);
}

static const struct moe_comm_ops mpi_ops = {
    .name = "mpi",
    .all_reduce_sum_f32 = mpi_all_reduce,
    .all_gather = mpi_all_gather,
    .all_to_all_v = mpi_all_to_all_v,
    .all_to_all_v_start = mpi_all_to_all_v_start,
    .all_to_all_v_finish = mpi_all_to_all_v_finish,
    .all_to_all_counts = NULL,
    .send = mpi_send,
    .recv = mpi_recv,
    .broadcast = mpi_broadcast,
    .barrier = mpi_barrier,
    .split = mpi_split,
    .destroy = mpi_destroy,
};

enum moe_status moe_comm_create_mpi(MPI_Comm mpi_comm, int timeout_ms, struct moe_comm **out,
                                    struct moe_error *err)
{
    int initialized = 0, finalized = 0;
    if (!out)
        return moe_error_set(err, MOE_ERR_INVALID, "comm_create_mpi: out is NULL");
    *out = NULL;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (!initialized || finalized)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "comm_create_mpi: MPI is %s (call MPI_Init first)",
                             finalized ? "already finalised" : "not initialised");
    if (mpi_comm == MPI_COMM_NULL)
        return moe_error_set(err, MOE_ERR_INVALID, "comm_create_mpi: mpi_comm is MPI_COMM_NULL");

    /* The duplicate is collective: bound it by the timeout like any operation. */
    MPI_Comm dup = MPI_COMM_NULL;
    MPI_Request req;
    int rc = MPI_Comm_idup(mpi_comm, &dup, &req);
    if (rc != MPI_SUCCESS)
        return moe_error_set(err, MOE_ERR_IO, "comm_create_mpi: MPI_Comm_idup failed (code %d)",
                             rc);
    struct moe_comm probe = {0};
    struct mpi_impl probe_impl = {0};
    MPI_Comm_rank(mpi_comm, &probe.rank);
    MPI_Comm_size(mpi_comm, &probe.size);
    probe.timeout_ms = timeout_ms;
    probe.impl = &probe_impl;
    enum moe_status st = wait_one(&probe, "comm_create_mpi (MPI_Comm_idup)", &req, err);
    if (st)
        return st; /* the half-made duplicate is left to MPI */
    return mpi_wrap(dup, timeout_ms, out, err);
}
