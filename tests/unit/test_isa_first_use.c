/* The kernels' ISA is chosen on first use, and the first use is usually
 * inside a pool run: every thread that asks must get the chosen ISA, never
 * "not chosen yet" (which once sent a task to the scalar kernels, so a
 * forward pass differed from the next one in the last bits). Each round is
 * a fresh process whose threads all make their first call at once.
 *
 * Also: MOE_CPU_ISA, read by that first use, narrows the choice to each of
 * its forms (clamped to what this processor has), and an unknown value is
 * ignored. */
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

/* A fresh process with MOE_CPU_ISA=form: 0 when it chose isa / feat. */
static int env_child(const char *self, const char *form, int isa, unsigned feat)
{
    pid_t pid = fork();
    if (pid == 0) {
        char a[16], f[16];
        snprintf(a, sizeof a, "%d", isa);
        snprintf(f, sizeof f, "%u", feat);
        setenv("MOE_CPU_ISA", form, 1);
        execl("/proc/self/exe", self, "--expect", a, f, (char *)NULL);
        _exit(127);
    }
    int st = 0;
    if (pid <= 0 || waitpid(pid, &st, 0) != pid)
        return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void test_env_forms(const char *self)
{
    const int det = (int)cpu_kernels_detect_isa();
    const unsigned have = cpu_kernels_detect_features();
    static const struct {
        const char *form;
        int isa;
        unsigned feat; /* before the clamp */
    } forms[] = {
        {"auto", CPU_ISA_AVX512, CPU_FEAT_ALL},
        {"scalar", CPU_ISA_SCALAR, 0},
        {"avx2", CPU_ISA_AVX2, 0},
        {"avx512", CPU_ISA_AVX512, 0},
        {"avx512-bf16", CPU_ISA_AVX512, CPU_FEAT_AVX512_BF16},
        {"avx512-vnni", CPU_ISA_AVX512, CPU_FEAT_AVX512_VNNI},
        {"avx512-dot", CPU_ISA_AVX512,
         CPU_FEAT_AVX512_BF16 | CPU_FEAT_AVX512_VNNI | CPU_FEAT_AVX512_FP16},
        {"amx", CPU_ISA_AVX512, CPU_FEAT_ALL},
        {"no-such-isa", CPU_ISA_AVX512, CPU_FEAT_ALL}, /* ignored: as auto */
    };
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
        int isa = forms[i].isa < det ? forms[i].isa : det;
        unsigned feat = isa == CPU_ISA_AVX512 ? forms[i].feat & have : 0;
        int rc = env_child(self, forms[i].form, isa, feat);
        CHECKF(rc == 0, "MOE_CPU_ISA=%s: the process did not choose isa %d features %#x (rc %d)",
               forms[i].form, isa, feat, rc);
    }
    char names[128];
    printf("MOE_CPU_ISA: %zu forms, each clamped to this processor (%s, %s)\n",
           sizeof forms / sizeof forms[0], cpu_isa_name((enum cpu_isa)det),
           cpu_features_name(have, names, sizeof names));
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--child"))
        return child();
    if (argc > 3 && !strcmp(argv[1], "--expect")) {
        int isa = (int)cpu_kernels_isa();
        unsigned feat = cpu_kernels_features();
        if (isa == atoi(argv[2]) && feat == (unsigned)strtoul(argv[3], NULL, 10))
            return 0;
        fprintf(stderr, "chose isa %d features %#x, expected %s / %s\n", isa, feat, argv[2],
                argv[3]);
        return 1;
    }
    test_env_forms(argv[0]);
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
