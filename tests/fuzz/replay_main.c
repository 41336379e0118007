/* The main of a fuzz target built without libFuzzer (gcc, or any build
 * without -DMOE_FUZZ=ON): runs LLVMFuzzerTestOneInput once on every file
 * named on the command line (a directory: on every file in it), so the
 * committed corpus and regression inputs are an ordinary test. Exit 0 when
 * every input ran; a crash or a failed FUZZ_CHECK aborts. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz.h"

__attribute__((weak)) int LLVMFuzzerInitialize(int *argc, char ***argv);

static int run_file(const char *path)
{
    fprintf(stderr, "replay %s\n", path); /* unbuffered: the last line names a crashing input */
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "%s: %s\n", path, strerror(errno));
        return 1;
    }
    uint8_t *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? cap * 2 : 4096;
            uint8_t *p = realloc(buf, cap);
            if (!p) {
                fprintf(stderr, "%s: out of memory\n", path);
                free(buf);
                fclose(f);
                return 1;
            }
            buf = p;
        }
        size_t k = fread(buf + n, 1, cap - n, f);
        n += k;
        if (k == 0)
            break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        fprintf(stderr, "%s: read error\n", path);
        free(buf);
        return 1;
    }
    /* an exact-size copy, so that ASan sees a read past the input */
    uint8_t *exact = malloc(n ? n : 1);
    if (!exact) {
        free(buf);
        return 1;
    }
    memcpy(exact, buf, n);
    free(buf);
    LLVMFuzzerTestOneInput(exact, n);
    free(exact);
    return 0;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int run_path(const char *path, int *n_run)
{
    struct stat sb;
    if (stat(path, &sb) != 0) {
        fprintf(stderr, "%s: %s\n", path, strerror(errno));
        return 1;
    }
    if (!S_ISDIR(sb.st_mode)) {
        (*n_run)++;
        return run_file(path);
    }
    DIR *d = opendir(path);
    if (!d) {
        fprintf(stderr, "%s: %s\n", path, strerror(errno));
        return 1;
    }
    char **names = NULL;
    size_t n = 0;
    int rc = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char **p = realloc(names, (n + 1) * sizeof *names);
        size_t len = strlen(path) + strlen(e->d_name) + 2;
        char *full = p ? malloc(len) : NULL;
        if (!full) {
            names = p ? p : names;
            rc = 1;
            break;
        }
        names = p;
        snprintf(full, len, "%s/%s", path, e->d_name);
        names[n++] = full;
    }
    closedir(d);
    qsort(names, n, sizeof *names, cmp_str); /* a stable order to name in reports */
    for (size_t i = 0; i < n; i++) {
        if (!rc)
            rc = run_path(names[i], n_run);
        free(names[i]);
    }
    free(names);
    return rc;
}

int main(int argc, char **argv)
{
    if (LLVMFuzzerInitialize)
        LLVMFuzzerInitialize(&argc, &argv);
    int n_run = 0;
    for (int i = 1; i < argc; i++) {
        if (argv[i][0] == '-') /* libFuzzer flags: meaningless here */
            continue;
        if (run_path(argv[i], &n_run))
            return 1;
    }
    printf("%s: %d inputs replayed\n", argv[0], n_run);
    return 0;
}
