/* The backend-independent part of the communicator (argument checks, the
 * broken state, the counts exchange) and the local backend (W = 1). */
#include "comm/comm.h"
#include "clock.h"

#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void moe_comm_format_peers(char *buf, size_t cap, const int *peers, int n)
{
    size_t len = 0;
    int n_shown = 0;
    if (cap == 0)
        return;
    buf[0] = '\0';
    for (int i = 0; i < n; i++) {
        int dup = 0;
        for (int j = 0; j < i; j++)
            dup |= peers[j] == peers[i];
        if (dup)
            continue;
        n_shown++;
    }
    len = (size_t)snprintf(buf, cap, "%s", n_shown == 1 ? "rank " : "ranks ");
    int first = 1;
    for (int i = 0; i < n && len < cap; i++) {
        int dup = 0;
        for (int j = 0; j < i; j++)
            dup |= peers[j] == peers[i];
        if (dup)
            continue;
        len += (size_t)snprintf(buf + len, cap - len, "%s%d", first ? "" : ", ", peers[i]);
        first = 0;
    }
}

const char *moe_comm_backend_name(const struct moe_comm *c)
{
    return c ? c->ops->name : "none";
}

/* ---- argument checks shared by every backend -------------------------------------- */

static enum moe_status comm_check(struct moe_comm *c, const char *op, struct moe_error *err)
{
    if (!c)
        return moe_error_set(err, MOE_ERR_INVALID, "%s: communicator is NULL", op);
    if (c->broken)
        return moe_error_set(err, MOE_ERR_IO,
                             "rank %d: %s: communicator is broken by an earlier failure", c->rank,
                             op);
    if (c->pending)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "rank %d: %s: an all_to_all_v_start is waiting for its finish",
                             c->rank, op);
    return MOE_OK;
}

static enum moe_status comm_check_peer(struct moe_comm *c, const char *op, const char *what,
                                       int peer, struct moe_error *err)
{
    if (peer < 0 || peer >= c->size)
        return moe_error_set(err, MOE_ERR_INVALID, "rank %d: %s: %s %d out of range [0, %d)",
                             c->rank, op, what, peer, c->size);
    return MOE_OK;
}

static enum moe_status comm_done(struct moe_comm *c, enum moe_status st)
{
    if (st == MOE_ERR_IO)
        c->broken = 1;
    return st;
}

enum moe_status moe_comm_all_reduce_sum(struct moe_comm *c, float *buf, size_t n,
                                        struct moe_error *err)
{
    enum moe_status st = comm_check(c, "all_reduce_sum", err);
    if (st)
        return st;
    if (n > 0 && !buf)
        return moe_error_set(err, MOE_ERR_INVALID, "rank %d: all_reduce_sum: buf is NULL", c->rank);
    return comm_done(c, c->ops->all_reduce_sum_f32(c, buf, n, err));
}

enum moe_status moe_comm_all_gather(struct moe_comm *c, const void *send, void *recv,
                                    size_t n_bytes, struct moe_error *err)
{
    enum moe_status st = comm_check(c, "all_gather", err);
    if (st)
        return st;
    if (n_bytes > 0 && (!send || !recv))
        return moe_error_set(err, MOE_ERR_INVALID, "rank %d: all_gather: %s buffer is NULL",
                             c->rank, send ? "recv" : "send");
    if (n_bytes > 0 && n_bytes > SIZE_MAX / (size_t)c->size)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "rank %d: all_gather: %zu bytes x %d ranks overflows", c->rank,
                             n_bytes, c->size);
    return comm_done(c, c->ops->all_gather(c, send, recv, n_bytes, err));
}

static enum moe_status check_all_to_all_v(struct moe_comm *c, const char *op, const void *send,
                                          const size_t *send_counts, const size_t *send_displs,
                                          const void *recv, const size_t *recv_counts,
                                          const size_t *recv_displs, struct moe_error *err)
{
    enum moe_status st = comm_check(c, op, err);
    if (st)
        return st;
    if (!send_counts || !send_displs || !recv_counts || !recv_displs)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "rank %d: %s: a counts or displacements array is NULL", c->rank, op);
    for (int p = 0; p < c->size; p++) {
        if (send_counts[p] > 0 && !send)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "rank %d: %s: send is NULL with send_counts[%d] = %zu", c->rank,
                                 op, p, send_counts[p]);
        if (recv_counts[p] > 0 && !recv)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "rank %d: %s: recv is NULL with recv_counts[%d] = %zu", c->rank,
                                 op, p, recv_counts[p]);
    }
    return MOE_OK;
}

enum moe_status moe_comm_all_to_all_v(struct moe_comm *c, const void *send,
                                      const size_t *send_counts, const size_t *send_displs,
                                      void *recv, const size_t *recv_counts,
                                      const size_t *recv_displs, struct moe_error *err)
{
    enum moe_status st = check_all_to_all_v(c, "all_to_all_v", send, send_counts, send_displs, recv,
                                            recv_counts, recv_displs, err);
    if (st)
        return st;
    return comm_done(c, c->ops->all_to_all_v(c, send, send_counts, send_displs, recv, recv_counts,
                                             recv_displs, err));
}

enum moe_status moe_comm_all_to_all_v_start(struct moe_comm *c, const void *send,
                                            const size_t *send_counts, const size_t *send_displs,
                                            void *recv, const size_t *recv_counts,
                                            const size_t *recv_displs, struct moe_error *err)
{
    enum moe_status st = check_all_to_all_v(c, "all_to_all_v_start", send, send_counts, send_displs,
                                            recv, recv_counts, recv_displs, err);
    if (st)
        return st;
    if (!c->ops->all_to_all_v_start)
        st = c->ops->all_to_all_v(c, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                                  err);
    else if ((st = c->ops->all_to_all_v_start(c, send, send_counts, send_displs, recv, recv_counts,
                                              recv_displs, err)) == MOE_OK)
        c->pending = 1;
    return comm_done(c, st);
}

enum moe_status moe_comm_all_to_all_v_finish(struct moe_comm *c, struct moe_error *err)
{
    if (!c)
        return moe_error_set(err, MOE_ERR_INVALID, "all_to_all_v_finish: communicator is NULL");
    if (!c->pending)
        return MOE_OK; /* run whole by start, or nothing started */
    c->pending = 0;
    return comm_done(c, c->ops->all_to_all_v_finish(c, err));
}

enum moe_status moe_comm_all_to_all_counts(struct moe_comm *c, const size_t *send_counts,
                                           size_t *recv_counts, struct moe_error *err)
{
    enum moe_status st = comm_check(c, "all_to_all_counts", err);
    if (st)
        return st;
    if (!send_counts || !recv_counts)
        return moe_error_set(err, MOE_ERR_INVALID, "rank %d: all_to_all_counts: %s is NULL",
                             c->rank, send_counts ? "recv_counts" : "send_counts");
    if (c->ops->all_to_all_counts)
        return comm_done(c, c->ops->all_to_all_counts(c, send_counts, recv_counts, err));

    /* One size_t to and from every rank, over the backend's host all_to_all_v. */
    size_t *one = malloc(2 * (size_t)c->size * sizeof(*one));
    if (!one)
        return moe_error_set(err, MOE_ERR_NOMEM, "rank %d: all_to_all_counts: out of memory",
                             c->rank);
    size_t *displs = one + c->size;
    for (int p = 0; p < c->size; p++) {
        one[p] = sizeof(size_t);
        displs[p] = (size_t)p * sizeof(size_t);
    }
    st = c->ops->all_to_all_v(c, send_counts, one, displs, recv_counts, one, displs, err);
    free(one);
    if (st)
        moe_error_prefix(err, "all_to_all_counts");
    return comm_done(c, st);
}

enum moe_status moe_comm_send(struct moe_comm *c, const void *buf, size_t n_bytes, int peer,
                              struct moe_error *err)
{
    enum moe_status st = comm_check(c, "send", err);
    if (!st)
        st = comm_check_peer(c, "send", "peer", peer, err);
    if (st)
        return st;
    if (peer == c->rank)
        return moe_error_set(err, MOE_ERR_INVALID, "rank %d: send: peer is this rank", c->rank);
    if (n_bytes > 0 && !buf)
        return moe_error_set(err, MOE_ERR_INVALID, "rank %d: send: buf is NULL", c->rank);
    return comm_done(c, c->ops->send(c, buf, n_bytes, peer, err));
}

enum moe_status moe_comm_recv(struct moe_comm *c, void *buf, size_t n_bytes, int peer,
                              struct moe_error *err)
{
    enum moe_status st = comm_check(c, "recv", err);
    if (!st)
        st = comm_check_peer(c, "recv", "peer", peer, err);
    if (st)
        return st;
    if (peer == c->rank)
        return moe_error_set(err, MOE_ERR_INVALID, "rank %d: recv: peer is this rank", c->rank);
    if (n_bytes > 0 && !buf)
        return moe_error_set(err, MOE_ERR_INVALID, "rank %d: recv: buf is NULL", c->rank);
    return comm_done(c, c->ops->recv(c, buf, n_bytes, peer, err));
}

enum moe_status moe_comm_broadcast(struct moe_comm *c, void *buf, size_t n_bytes, int root,
                                   struct moe_error *err)
{
    enum moe_status st = comm_check(c, "broadcast", err);
    if (!st)
        st = comm_check_peer(c, "broadcast", "root", root, err);
    if (st)
        return st;
    if (n_bytes > 0 && !buf)
        return moe_error_set(err, MOE_ERR_INVALID, "rank %d: broadcast: buf is NULL", c->rank);
    return comm_done(c, c->ops->broadcast(c, buf, n_bytes, root, err));
}

enum moe_status moe_comm_barrier(struct moe_comm *c, struct moe_error *err)
{
    enum moe_status st = comm_check(c, "barrier", err);
    if (st)
        return st;
    return comm_done(c, c->ops->barrier(c, err));
}

enum moe_status moe_comm_split(struct moe_comm *c, int color, int key, struct moe_comm **out,
                               struct moe_error *err)
{
    if (out)
        *out = NULL;
    enum moe_status st = comm_check(c, "split", err);
    if (st)
        return st;
    if (!out)
        return moe_error_set(err, MOE_ERR_INVALID, "rank %d: split: out is NULL", c->rank);
    if (color < 0 && color != MOE_COMM_NO_COLOR)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "rank %d: split: color %d is negative (use MOE_COMM_NO_COLOR)",
                             c->rank, color);
    return comm_done(c, c->ops->split(c, color, key, out, err));
}

void moe_comm_destroy(struct moe_comm *c)
{
    if (!c)
        return;
    c->ops->destroy(c);
}

/* ---- local backend: one rank, no transport ---------------------------------------- */

static enum moe_status local_all_reduce(struct moe_comm *c, float *buf, size_t n,
                                        struct moe_error *err)
{
    return MOE_OK; /* the sum over one rank */
}

static enum moe_status local_all_gather(struct moe_comm *c, const void *send, void *recv,
                                        size_t n_bytes, struct moe_error *err)
{
    if (n_bytes > 0 && send != recv)
        memcpy(recv, send, n_bytes);
    return MOE_OK;
}

static enum moe_status local_all_to_all_v(struct moe_comm *c, const void *send,
                                          const size_t *send_counts, const size_t *send_displs,
                                          void *recv, const size_t *recv_counts,
                                          const size_t *recv_displs, struct moe_error *err)
{
    if (send_counts[0] != recv_counts[0])
        return moe_error_set(err, MOE_ERR_INVALID,
                             "rank 0: all_to_all_v: send_counts[0] = %zu but recv_counts[0] = %zu",
                             send_counts[0], recv_counts[0]);
    if (send_counts[0] > 0)
        memcpy((char *)recv + recv_displs[0], (const char *)send + send_displs[0], send_counts[0]);
    return MOE_OK;
}

/* Unreachable: the wrappers reject peer == rank, the only rank there is. */
static enum moe_status local_send(struct moe_comm *c, const void *buf, size_t n_bytes, int peer,
                                  struct moe_error *err)
{
    return moe_error_set(err, MOE_ERR_INVALID, "rank 0: send: no peer in a local communicator");
}

static enum moe_status local_recv(struct moe_comm *c, void *buf, size_t n_bytes, int peer,
                                  struct moe_error *err)
{
    return moe_error_set(err, MOE_ERR_INVALID, "rank 0: recv: no peer in a local communicator");
}

static enum moe_status local_broadcast(struct moe_comm *c, void *buf, size_t n_bytes, int root,
                                       struct moe_error *err)
{
    return MOE_OK;
}

static enum moe_status local_barrier(struct moe_comm *c, struct moe_error *err)
{
    return MOE_OK;
}

static enum moe_status local_split(struct moe_comm *c, int color, int key, struct moe_comm **out,
                                   struct moe_error *err)
{
    if (color == MOE_COMM_NO_COLOR)
        return MOE_OK;
    return moe_comm_create_local(out, err);
}

static void local_destroy(struct moe_comm *c)
{
    free(c);
}

static const struct moe_comm_ops local_ops = {
    .name = "local",
    .all_reduce_sum_f32 = local_all_reduce,
    .all_gather = local_all_gather,
    .all_to_all_v = local_all_to_all_v,
    .all_to_all_counts = NULL,
    .send = local_send,
    .recv = local_recv,
    .broadcast = local_broadcast,
    .barrier = local_barrier,
    .split = local_split,
    .destroy = local_destroy,
};

enum moe_status moe_comm_create_local(struct moe_comm **out, struct moe_error *err)
{
    if (!out)
        return moe_error_set(err, MOE_ERR_INVALID, "comm_create_local: out is NULL");
    struct moe_comm *c = calloc(1, sizeof(*c));
    *out = NULL;
    if (!c)
        return moe_error_set(err, MOE_ERR_NOMEM, "comm_create_local: out of memory");
    c->rank = 0;
    c->size = 1;
    c->timeout_ms = 0;
    c->ops = &local_ops;
    *out = c;
    return MOE_OK;
}

/* ---- NCCL entry points in builds without NCCL (no CUDA, or the compute core) ------- */

#ifndef MOE_HAVE_NCCL
enum moe_status moe_comm_nccl_get_id(struct moe_comm_nccl_id *id, struct moe_error *err)
{
    return moe_error_set(err, MOE_ERR_UNSUPPORTED, "comm_nccl_get_id: this build has no NCCL");
}

enum moe_status moe_comm_create_nccl(const struct moe_comm_nccl_id *id, int size, int rank,
                                     int device, void *stream, int timeout_ms,
                                     struct moe_comm **out, struct moe_error *err)
{
    if (out)
        *out = NULL;
    return moe_error_set(err, MOE_ERR_UNSUPPORTED, "comm_create_nccl: this build has no NCCL");
}
#endif

void moe_comm_poll_backoff(long spins, int64_t waited_ms)
{
    if (spins < 200)
        return;
    if (waited_ms < 2) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, 50 * 1000};
    nanosleep(&ts, NULL);
}
