/* cuBLAS loaded on first use (see cublas_lazy.h). */
#define MOE_CUBLAS_LAZY_IMPL
#include "cublas_lazy.h"

#include <pthread.h>
#include <stdio.h>

#include "dynlib.h"

/* The library the headers belong to: libcublas.so.<major> */
#define CUBLAS_SONAME MOE_DYNLIB_SONAME("libcublas", CUBLAS_VER_MAJOR)

#define MOE_CUBLAS_DEFINE(name)                                                                    \
    moe_##name##_fn moe_p_##name;                                                                  \
    _Static_assert(__builtin_types_compatible_p(__typeof__(&name), moe_##name##_fn),               \
                   "moe_" #name "_fn is not cuBLAS's type of " #name);
MOE_CUBLAS_FUNCTIONS(MOE_CUBLAS_DEFINE)
#undef MOE_CUBLAS_DEFINE

#define MOE_CUBLAS_SYM(name) {#name, (void **)&moe_p_##name},
static const struct moe_dynlib_sym syms[] = {MOE_CUBLAS_FUNCTIONS(MOE_CUBLAS_SYM)};
#undef MOE_CUBLAS_SYM

static pthread_once_t once = PTHREAD_ONCE_INIT;
static char load_error[512]; /* empty when loaded */

static void load(void)
{
#ifdef MOE_CUBLAS_DIR /* the toolkit's directory, for a soname off the loader's path */
    const char *dir = MOE_CUBLAS_DIR;
#else
    const char *dir = NULL;
#endif
    (void)moe_dynlib_load(CUBLAS_SONAME, dir, syms, sizeof syms / sizeof syms[0], load_error,
                          sizeof load_error);
}

enum moe_status moe_cublas_load(struct moe_error *err)
{
    pthread_once(&once, load);
    if (load_error[0])
        return moe_error_set(err, MOE_ERR_UNSUPPORTED, "cuBLAS: %s", load_error);
    return MOE_OK;
}
