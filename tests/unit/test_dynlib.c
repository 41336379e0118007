/* common/dynlib.h, the on-first-use loader behind CUDA builds' cuBLAS and
 * NCCL: a library found by its soname fills every slot with callable
 * functions; one off the loader's path is found in the directory given; a
 * missing library or function fails naming it. Exercised on libm, which
 * every machine has. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dynlib.h"
#include "testlib.h"

typedef double (*unary_fn)(double);

int main(void)
{
    unary_fn p_cos = NULL, p_sqrt = NULL;
    const struct moe_dynlib_sym syms[] = {{"cos", (void **)&p_cos}, {"sqrt", (void **)&p_sqrt}};
    char why[256] = "";
    CHECKF(moe_dynlib_load("libm.so.6", NULL, syms, 2, why, sizeof why), "%s", why);
    CHECK(p_cos && p_sqrt && p_cos(0.0) == 1.0 && p_sqrt(16.0) == 4.0);

    /* a function the library lacks */
    unary_fn p_none = NULL;
    const struct moe_dynlib_sym missing[] = {{"cos", (void **)&p_cos},
                                             {"moe_no_such_function", (void **)&p_none}};
    CHECK(!moe_dynlib_load("libm.so.6", NULL, missing, 2, why, sizeof why));
    CHECKF(!strcmp(why, "libm.so.6 has no moe_no_such_function"), "%s", why);

    /* a library nowhere */
    CHECK(!moe_dynlib_load("libmoe-no-such-lib.so.9", "/nonexistent", syms, 2, why, sizeof why));
    CHECKF(!strncmp(why, "cannot load libmoe-no-such-lib.so.9: ", 37), "%s", why);

    /* off the loader's path, in the directory given: libm under another name */
    Dl_info info;
    char dir[] = "/tmp/moe-dynlib-XXXXXX", link[512];
    CHECK(dladdr((void *)p_cos, &info) && info.dli_fname && mkdtemp(dir));
    snprintf(link, sizeof link, "%s/libmoe-dynlib-test.so.1", dir);
    CHECK(symlink(info.dli_fname, link) == 0);
    p_cos = NULL;
    CHECK(!moe_dynlib_load("libmoe-dynlib-test.so.1", NULL, syms, 2, why, sizeof why));
    CHECKF(moe_dynlib_load("libmoe-dynlib-test.so.1", dir, syms, 2, why, sizeof why), "%s", why);
    CHECK(p_cos && p_cos(0.0) == 1.0);
    unlink(link);
    rmdir(dir);
    return test_summary();
}
