/* Times a W-rank all_to_all_v of 4 MiB per peer (the EP dispatch of a large
 * prefill step), against MPI_Alltoallv on the same buffers, and checks the
 * data. Prints one line from rank 0:
 *   all_to_all_v W=4, 4 MiB per peer: median 14.2 ms (MPI_Alltoallv 15.0 ms)
 * The time of one iteration is the slowest rank's. */
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "testlib.h"

enum { N_WARM = 3, N_ITER = 15 };
#define PER_PEER ((size_t)4 << 20)

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median_ms(double *t, int n)
{
    qsort(t, (size_t)n, sizeof(*t), cmp_double);
    return 1e3 * t[n / 2];
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    struct moe_error err = {0};
    struct moe_comm *c = NULL;
    enum moe_status st = moe_comm_create_mpi(MPI_COMM_WORLD, 60000, &c, &err);
    CHECKF(st == MOE_OK, "%s", err.msg);
    if (!c) {
        MPI_Finalize();
        return test_summary();
    }
    int w = c->size, me = c->rank;
    size_t *cnt = malloc((size_t)w * sizeof(size_t)), *dsp = malloc((size_t)w * sizeof(size_t));
    int *icnt = malloc((size_t)w * sizeof(int)), *idsp = malloc((size_t)w * sizeof(int));
    for (int p = 0; p < w; p++) {
        cnt[p] = PER_PEER;
        dsp[p] = (size_t)p * PER_PEER;
        icnt[p] = (int)PER_PEER;
        idsp[p] = (int)((size_t)p * PER_PEER);
    }
    unsigned char *send = malloc((size_t)w * PER_PEER), *recv = malloc((size_t)w * PER_PEER);
    for (int p = 0; p < w; p++)
        memset(send + dsp[p], (me * 16 + p) & 0xff, PER_PEER);
    double t_ours[N_ITER], t_mpi[N_ITER];
    for (int it = 0; it < N_WARM + N_ITER; it++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        st = moe_comm_all_to_all_v(c, send, cnt, dsp, recv, cnt, dsp, &err);
        double dt = MPI_Wtime() - t0;
        CHECKF(st == MOE_OK, "%s", err.msg);
        MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (it >= N_WARM)
            t_ours[it - N_WARM] = dt;

        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        MPI_Alltoallv(send, icnt, idsp, MPI_BYTE, recv, icnt, idsp, MPI_BYTE, MPI_COMM_WORLD);
        dt = MPI_Wtime() - t0;
        MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (it >= N_WARM)
            t_mpi[it - N_WARM] = dt;
    }
    /* The last all_to_all_v's data (MPI_Alltoallv wrote the same bytes after it). */
    st = moe_comm_all_to_all_v(c, send, cnt, dsp, recv, cnt, dsp, &err);
    CHECKF(st == MOE_OK, "%s", err.msg);
    for (int p = 0; p < w; p++) {
        unsigned char want = (unsigned char)((p * 16 + me) & 0xff);
        size_t bad = PER_PEER;
        for (size_t i = 0; i < PER_PEER && bad == PER_PEER; i++)
            if (recv[dsp[p] + i] != want)
                bad = i;
        CHECKF(bad == PER_PEER, "rank %d: block from rank %d wrong at %zu", me, p, bad);
    }
    if (me == 0)
        printf("all_to_all_v W=%d, 4 MiB per peer: median %.1f ms (MPI_Alltoallv %.1f ms), "
               "%d iterations\n",
               w, median_ms(t_ours, N_ITER), median_ms(t_mpi, N_ITER), N_ITER);
    moe_comm_destroy(c);
    free(send);
    free(recv);
    free(cnt);
    free(dsp);
    free(icnt);
    free(idsp);
    MPI_Finalize();
    return test_summary();
}
