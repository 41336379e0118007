/* The backend registry: selection by name (cpu, cuda, auto), and the destroy
 * entry point for every backend. Kept apart from backend.h, the interface
 * every backend includes, so that the interface does not depend on them. */
#include <string.h>

#include "backend.h"
#include "cpu/cpu_kernels.h"
#ifdef MOE_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif

bool moe_backend_cuda_compiled(void)
{
#ifdef MOE_HAVE_CUDA
    return true;
#else
    return false;
#endif
}

#ifndef MOE_HAVE_CUDA
enum moe_status moe_backend_cuda_create(int ordinal, struct moe_backend **out,
                                        struct moe_error *err)
{
    *out = NULL;
    return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                         "this binary was built without CUDA (configure with -DMOE_CUDA=ON)");
}
#endif

enum moe_status moe_backend_create(const char *device, int n_threads, struct moe_backend **out,
                                   struct moe_error *err)
{
    *out = NULL;
    if (!device)
        return moe_error_set(err, MOE_ERR_INVALID, "device: NULL (expected cpu, cuda or auto)");
    if (strcmp(device, "cpu") == 0)
        return moe_backend_cpu_create(n_threads, out, err);
    if (strcmp(device, "cuda") == 0)
        return moe_backend_cuda_create(0, out, err);
    if (strcmp(device, "auto") != 0)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "device: unknown device '%s' (expected cpu, cuda or auto)", device);
    struct moe_error cuda_err = {0};
    if (moe_backend_cuda_create(0, out, &cuda_err) == MOE_OK)
        return MOE_OK;
    fprintf(stderr, "moe: %s; using the CPU backend\n", cuda_err.msg);
    return moe_backend_cpu_create(n_threads, out, err);
}

void moe_backend_destroy(struct moe_backend *be)
{
    if (!be)
        return;
    switch (be->device) {
    case MOE_DEVICE_CPU: cpu_backend_destroy(be); return;
    case MOE_DEVICE_CUDA:
#ifdef MOE_HAVE_CUDA
        cuda_backend_destroy(be);
#endif
        return;
    }
}
