/* The kernels' ISA is chosen on first use, and the first use is usually
 * inside a pool run: every thread that asks must get the chosen ISA, never
 * "not chosen yet" (which once sent a task to the scalar kernels, so a
 * forward pass differed from the next one in the last bits). Each round is
 * a fresh process whose threads all make their first call at once. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cpu/cpu_kernels.h"
#include "testlib.h"

#define N_THREADS 8
#define N_ROUNDS 40

static pthread_barrier_t g_start;
static int g_isa[N_THREADS];
static unsigned g_feat[N_THREADS];

static void *first_use(void *arg)
{
    int i = (int)(intptr_t)arg;
    pthread_barrier_wait(&g_start);
    g_isa[i] = (int)cpu_kernels_isa();
    g_feat[i] = cpu_kernels_features();
    return NULL;
}

/* One fresh process: 0 when every thread saw the same, valid choice. */
static int child(void)
{
    pthread_t t[N_THREADS];
    pthread_barrier_init(&g_start, NULL, N_THREADS);
    for (int i = 0; i < N_THREADS; i++)
        pthread_create(&t[i], NULL, first_use, (void *)(intptr_t)i);
    for (int i = 0; i < N_THREADS; i++)
        pthread_join(t[i], NULL);
    int want = (int)cpu_kernels_isa();
    unsigned want_feat = cpu_kernels_features();
    for (int i = 0; i < N_THREADS; i++)
        if (g_isa[i] != want || g_feat[i] != want_feat || want < 0) {
            fprintf(stderr, "thread %d saw ISA %d features %#x, the choice is %d / %#x\n", i,
                    g_isa[i], g_feat[i], want, want_feat);
            return 1;
        }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--child"))
        return child();
    int bad = 0;
    for (int r = 0; r < N_ROUNDS; r++) {
        pid_t pid = fork();
        if (pid == 0) {
            execl("/proc/self/exe", argv[0], "--child", (char *)NULL);
            _exit(127);
        }
        int st = 0;
        CHECK(pid > 0 && waitpid(pid, &st, 0) == pid);
        bad += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    CHECKF(bad == 0, "%d of %d fresh processes saw threads disagree on the ISA", bad, N_ROUNDS);
    printf("ISA first use: %d of %d fresh processes x %d threads agreed\n", N_ROUNDS - bad,
           N_ROUNDS, N_THREADS);
    return test_summary();
}
