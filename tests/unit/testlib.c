#include "testlib.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

_Atomic int test_n_pass; /* CHECK runs on many threads in some tests */
_Atomic int test_n_fail;

static char temp_dir[256];

static void remove_temp_dir(void)
{
    if (!temp_dir[0])
        return;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", temp_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", temp_dir);
}

const char *test_temp_dir(void)
{
    if (!temp_dir[0]) {
        snprintf(temp_dir, sizeof temp_dir, "/tmp/moe-test-XXXXXX");
        if (!mkdtemp(temp_dir)) {
            perror("mkdtemp");
            abort();
        }
        atexit(remove_temp_dir);
    }
    return temp_dir;
}

int test_summary(void)
{
    printf("%d passed, %d failed\n", (int)test_n_pass, (int)test_n_fail);
    return test_n_fail ? 1 : 0;
}

const char *test_src_path(const char *rel)
{
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", MOE_SOURCE_DIR, rel);
    return buf;
}

const char *test_write_temp(const char *name, const void *data, size_t n)
{
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", test_temp_dir(), name);
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n)) {
        perror(path);
        abort();
    }
    fclose(f);
    return path;
}
