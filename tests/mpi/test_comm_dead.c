/* A rank dies in the middle of a run of collectives. Run under mpirun by
 * tests/mpi/run_dead.sh: the survivors must report the failure (or be ended by
 * mpirun) within the timeout, never hang.
 *
 * usage: test_comm_dead kill|exit [timeout_ms]
 *   kill  the last rank raises SIGKILL on itself at step 20;
 *   exit  the last rank calls _exit(3) at step 20 (no MPI_Finalize).
 * A survivor that sees the error prints it and calls MPI_Abort (the reaction
 * the executables use); exit code 3 means no failure was ever noticed. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm.h"

enum { N_STEP = 2000, DIE_AT = 20, A2A_BYTES = 65536 };

int main(int argc, char **argv)
{
    if (argc < 2 || (strcmp(argv[1], "kill") && strcmp(argv[1], "exit"))) {
        fprintf(stderr, "usage: %s kill|exit [timeout_ms]\n", argv[0]);
        return 2;
    }
    int timeout_ms = argc > 2 ? atoi(argv[2]) : 5000;
    MPI_Init(&argc, &argv);
    struct moe_error err = {0};
    struct moe_comm *c = NULL;
    if (moe_comm_create_mpi(MPI_COMM_WORLD, timeout_ms, &c, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    int w = c->size, me = c->rank;
    size_t *counts = malloc((size_t)w * sizeof(*counts));
    size_t *displs = malloc((size_t)w * sizeof(*displs));
    char *send = malloc((size_t)w * A2A_BYTES);
    char *recv = malloc((size_t)w * A2A_BYTES);
    for (int p = 0; p < w; p++) {
        counts[p] = A2A_BYTES;
        displs[p] = (size_t)p * A2A_BYTES;
    }
    memset(send, me, (size_t)w * A2A_BYTES);
    for (int step = 0; step < N_STEP; step++) {
        if (step == DIE_AT && me == w - 1) {
            fprintf(stderr, "rank %d: dying at step %d (%s)\n", me, step,
                    argv[1][0] == 'k' ? "SIGKILL" : "_exit(3)");
            fflush(stderr);
            if (argv[1][0] == 'k')
                raise(SIGKILL);
            _exit(3);
        }
        float x[16];
        for (int i = 0; i < 16; i++)
            x[i] = (float)(me + i);
        enum moe_status st =
            moe_comm_all_to_all_v(c, send, counts, displs, recv, counts, displs, &err);
        if (!st)
            st = moe_comm_all_reduce_sum(c, x, 16, &err);
        if (st) {
            fprintf(stderr, "rank %d: step %d: %s: %s\n", me, step, moe_status_name(st), err.msg);
            fflush(stderr);
            MPI_Abort(MPI_COMM_WORLD, 4);
        }
    }
    fprintf(stderr, "rank %d: no failure noticed in %d steps\n", me, N_STEP);
    return 3;
}
