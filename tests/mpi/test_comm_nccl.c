/* The NCCL backend's entry points, run without mpirun (one process).
 *
 * Without CUDA in the build: both entry points answer UNSUPPORTED.
 * With CUDA but no usable GPU (these CI machines): a unique id can still be
 * made (the first call is what loads libnccl: it is not mapped before), and
 * creating a communicator fails fast with MOE_ERR_IO, never hangs.
 * With a GPU: a one-rank NCCL communicator runs the operations on device
 * buffers (all_reduce, all_gather, all_to_all_v with its counts, broadcast,
 * barrier, split). */
#include <string.h>

#include "comm/comm.h"
#include "testlib.h"
#include "clock.h"

#ifdef MOE_HAVE_NCCL
#include <cuda_runtime.h>
#include <stdbool.h>
#include <stdio.h>

/* Whether libnccl is mapped into this process. */
static bool nccl_mapped(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[4096];
    bool found = false;
    while (f && !found && fgets(line, sizeof line, f))
        found = strstr(line, "/libnccl.so") != NULL;
    if (f)
        fclose(f);
    return found;
}

static void run_on_gpu(struct moe_comm *c)
{
    struct moe_error err = {0};
    enum { N = 1000 };
    float host[N], back[N];
    float *d_a = NULL, *d_b = NULL;
    CHECK(cudaMalloc((void **)&d_a, sizeof(host)) == cudaSuccess);
    CHECK(cudaMalloc((void **)&d_b, sizeof(host)) == cudaSuccess);
    for (int i = 0; i < N; i++)
        host[i] = (float)i * 0.5f;
    cudaMemcpy(d_a, host, sizeof(host), cudaMemcpyHostToDevice);

    CHECKF(moe_comm_all_reduce_sum(c, d_a, N, &err) == MOE_OK, "%s", err.msg);
    CHECKF(moe_comm_all_gather(c, d_a, d_b, sizeof(host), &err) == MOE_OK, "%s", err.msg);
    size_t send_counts[1] = {sizeof(host)}, recv_counts[1] = {0}, displs[1] = {0};
    CHECKF(moe_comm_all_to_all_counts(c, send_counts, recv_counts, &err) == MOE_OK, "%s", err.msg);
    CHECK(recv_counts[0] == sizeof(host));
    cudaMemset(d_b, 0, sizeof(host));
    CHECKF(moe_comm_all_to_all_v(c, d_a, send_counts, displs, d_b, recv_counts, displs, &err) ==
               MOE_OK,
           "%s", err.msg);
    cudaMemcpy(back, d_b, sizeof(back), cudaMemcpyDeviceToHost);
    CHECK(memcmp(back, host, sizeof(host)) == 0);
    CHECKF(moe_comm_broadcast(c, d_b, sizeof(host), 0, &err) == MOE_OK, "%s", err.msg);
    CHECKF(moe_comm_barrier(c, &err) == MOE_OK, "%s", err.msg);
    struct moe_comm *sub = NULL;
    CHECKF(moe_comm_split(c, 0, 0, &sub, &err) == MOE_OK && sub, "%s", err.msg);
    if (sub) {
        CHECK(sub->size == 1 && sub->rank == 0);
        CHECKF(moe_comm_all_reduce_sum(sub, d_a, N, &err) == MOE_OK, "%s", err.msg);
    }
    moe_comm_destroy(sub);
    cudaFree(d_a);
    cudaFree(d_b);
}
#endif

int main(void)
{
    struct moe_error err = {0};
    struct moe_comm_nccl_id id;
    memset(&id, 0, sizeof(id));
    static struct moe_comm dummy;
    struct moe_comm *c = &dummy; /* must be reset to NULL */
#ifndef MOE_HAVE_NCCL
    CHECK(moe_comm_nccl_get_id(&id, &err) == MOE_ERR_UNSUPPORTED);
    CHECK(moe_comm_create_nccl(&id, 1, 0, 0, NULL, 1000, &c, &err) == MOE_ERR_UNSUPPORTED);
    CHECK(c == NULL);
#else
    /* libnccl is dlopened by the first entry point, not at start-up */
    CHECK(!nccl_mapped());
    enum moe_status st = moe_comm_nccl_get_id(&id, &err);
    CHECKF(st == MOE_OK, "%s", err.msg);
    CHECK(st != MOE_OK || nccl_mapped());
    unsigned char zero[MOE_COMM_NCCL_ID_BYTES] = {0};
    CHECK(st != MOE_OK || memcmp(id.bytes, zero, sizeof(zero)) != 0);
    CHECK(moe_comm_create_nccl(&id, 1, 1, 0, NULL, 1000, &c, &err) == MOE_ERR_INVALID);
    CHECK(c == NULL);

    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess || n_dev == 0) {
        /* No GPU: creation must fail at once with a clear error. */
        int64_t t0 = moe_now_ms();
        st = moe_comm_create_nccl(&id, 1, 0, 0, NULL, 5000, &c, &err);
        CHECKF(st == MOE_ERR_IO, "status %s", moe_status_name(st));
        CHECKF(strstr(err.msg, "cudaSetDevice") != NULL, "message: %s", err.msg);
        CHECK(c == NULL);
        CHECK(moe_now_ms() - t0 < 5000);
        fprintf(stderr, "no GPU (%s): checked the failure path only\n", err.msg);
    } else {
        cudaStream_t stream;
        CHECK(cudaStreamCreate(&stream) == cudaSuccess);
        st = moe_comm_create_nccl(&id, 1, 0, 0, stream, 20000, &c, &err);
        CHECKF(st == MOE_OK && c, "%s", err.msg);
        if (c) {
            CHECK(strcmp(moe_comm_backend_name(c), "nccl") == 0);
            run_on_gpu(c);
            CHECK(!c->broken);
        }
        moe_comm_destroy(c);
        cudaStreamDestroy(stream);
    }
#endif
    return test_summary();
}
