/* The backend registry: selection by name (cpu, cuda, auto), and the destroy
 * entry point for every backend. Kept apart from backend.h, the interface
 * every backend includes, so that the interface does not depend on them. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
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

enum moe_status moe_device_flag_parse(const char *s, struct moe_device_flag *out,
                                      struct moe_error *err)
{
    *out = (struct moe_device_flag){.kind = MOE_DEVICE_FLAG_AUTO, .ordinal = -1};
    if (!s)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "--device: none given (expected cpu, cuda, cuda:N or auto)");
    if (!strcmp(s, "auto"))
        return MOE_OK;
    if (!strcmp(s, "cpu")) {
        out->kind = MOE_DEVICE_FLAG_CPU;
        return MOE_OK;
    }
    if (!strncmp(s, "cuda", 4) && (s[4] == '\0' || s[4] == ':')) {
        out->kind = MOE_DEVICE_FLAG_CUDA;
        if (s[4] == '\0')
            return MOE_OK;
        const char *n = s + 5;
        char *end = NULL;
        errno = 0;
        long v = strtol(n, &end, 10);
        if (*n >= '0' && *n <= '9' && end && *end == '\0' && errno == 0 && v <= 1024) {
            out->ordinal = (int)v;
            return MOE_OK;
        }
        return moe_error_set(err, MOE_ERR_INVALID,
                             "--device %s: the GPU number after 'cuda:' must be 0..1024", s);
    }
    return moe_error_set(err, MOE_ERR_INVALID,
                         "--device %s: unknown device (expected cpu, cuda, cuda:N or auto)", s);
}

enum moe_status moe_device_pick_ordinal(const struct moe_device_flag *f, int local_rank, int n_gpus,
                                        int *ordinal, struct moe_error *err)
{
    *ordinal = -1;
    if (f->ordinal >= 0) {
        if (f->ordinal >= n_gpus)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "--device cuda:%d: this process sees %d GPU%s (0..%d)", f->ordinal,
                                 n_gpus, n_gpus == 1 ? "" : "s", n_gpus - 1);
        *ordinal = f->ordinal;
        return MOE_OK;
    }
    if (local_rank < 0)
        return moe_error_set(err, MOE_ERR_INVALID, "local rank %d: must be >= 0", local_rank);
    if (local_rank >= n_gpus)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "local rank %d has no GPU of its own: this node shows %d GPU%s; run "
                             "at most %d rank%s per node, or pick one with --device cuda:N",
                             local_rank, n_gpus, n_gpus == 1 ? "" : "s", n_gpus,
                             n_gpus == 1 ? "" : "s");
    *ordinal = local_rank;
    return MOE_OK;
}

#ifndef MOE_HAVE_CUDA
int moe_backend_cuda_device_count(void)
{
    return 0;
}
#endif

enum moe_status moe_backend_create_at(const char *device, int n_threads, int local_rank,
                                      struct moe_backend **out, struct moe_error *err)
{
    *out = NULL;
    struct moe_device_flag f;
    enum moe_status rc = moe_device_flag_parse(device, &f, err);
    if (rc)
        return rc;
    if (f.kind == MOE_DEVICE_FLAG_CPU)
        return moe_backend_cpu_create(n_threads, out, err);
    int n_gpus = moe_backend_cuda_device_count();
    if (f.kind == MOE_DEVICE_FLAG_AUTO && n_gpus == 0) {
        struct moe_error why = {0};
        moe_backend_cuda_create(0, out, &why); /* says why there is no GPU */
        fprintf(stderr, "moe: %s; using the CPU backend\n", why.msg);
        return moe_backend_cpu_create(n_threads, out, err);
    }
    if (n_gpus == 0) /* --device cuda: the backend's own reason */
        return moe_backend_cuda_create(0, out, err);
    int ordinal;
    if ((rc = moe_device_pick_ordinal(&f, local_rank, n_gpus, &ordinal, err)))
        return rc;
    if (f.kind == MOE_DEVICE_FLAG_CUDA)
        return moe_backend_cuda_create(ordinal, out, err);
    struct moe_error cuda_err = {0};
    if (moe_backend_cuda_create(ordinal, out, &cuda_err) == MOE_OK)
        return MOE_OK;
    fprintf(stderr, "moe: %s; using the CPU backend\n", cuda_err.msg);
    return moe_backend_cpu_create(n_threads, out, err);
}

enum moe_status moe_backend_create(const char *device, int n_threads, struct moe_backend **out,
                                   struct moe_error *err)
{
    return moe_backend_create_at(device, n_threads, 0, out, err);
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
