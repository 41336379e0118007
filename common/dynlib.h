/* Shared libraries loaded on first use (dlopen) instead of at start-up.
 *
 * CUDA builds take cuBLAS and NCCL this way (kernels/cuda/cublas_lazy.h,
 * worker/comm/comm_nccl.c): linked, they would cost every process ~0.1 s
 * and ~200 MB of resident memory before main, GPU or not. A caller keeps one
 * pointer per function it calls and names them in a table; moe_dynlib_load
 * fills them all or says what is missing. */
#ifndef MOE_DYNLIB_H
#define MOE_DYNLIB_H

#include <stdbool.h>
#include <stddef.h>

/* "libX.so.<major>" from a header's major version macro:
 * MOE_DYNLIB_SONAME("libnccl", NCCL_MAJOR) is "libnccl.so.2". */
#define MOE_DYNLIB_STR_(x) #x
#define MOE_DYNLIB_SONAME(base, major) base ".so." MOE_DYNLIB_STR_(major)

/* One function wanted: its name and the address of the caller's pointer to
 * it (cast to void **, the dlsym idiom POSIX blesses). */
struct moe_dynlib_sym {
    const char *name;
    void **slot;
};

/* Opens `soname` where the dynamic loader finds it, else dir/soname (dir may
 * be NULL), and resolves every one of the n symbols into its slot. On
 * failure writes why ("cannot load libX.so.N: <dlerror>" or "libX.so.N has
 * no f") into why (why_size bytes) and returns false; slots already filled
 * stay filled, the library stays open. Not thread-safe: call it under the
 * caller's pthread_once. */
bool moe_dynlib_load(const char *soname, const char *dir, const struct moe_dynlib_sym *syms,
                     size_t n, char *why, size_t why_size);

#endif
