/* The CUDA backend: device memory through the CUDA runtime and one kernel per
 * op (kernels/cuda/<op>.cu).
 *
 * The backend is being filled op by op. An op without a CUDA kernel yet is
 * NULL in the table, and moe_backend_cuda_create refuses with
 * MOE_ERR_UNSUPPORTED "CUDA backend incomplete in this build: ops X, Y
 * missing" while any op is NULL, so `--device auto` stays on the CPU and
 * nothing ever computes garbage. Op tests set the environment variable
 * MOE_CUDA_PARTIAL=1 to get the partial table and check the ops it has.
 *
 * Ops return void, so a CUDA error inside one is recorded (the first one is
 * kept in the backend and printed once to stderr). */
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "cuda_backend.h"
#include "cuda_ops.h"

struct cuda_backend {
    struct moe_backend base; /* first */
    int ordinal;
    _Atomic int first_error; /* cudaError_t of the first failed call, 0 if none */
};

static void cuda_check(struct moe_backend *be, cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return;
    struct cuda_backend *cb = (struct cuda_backend *)be;
    int expected = 0;
    if (atomic_compare_exchange_strong(&cb->first_error, &expected, (int)e))
        fprintf(stderr, "moe: cuda backend: %s: error %d, %s\n", what, (int)e,
                cudaGetErrorString(e));
}

static void *cuda_buf_alloc(struct moe_backend *be, size_t bytes)
{
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 64);
    if (e != cudaSuccess)
        return NULL;
    e = cudaMemset(p, 0, bytes);
    if (e != cudaSuccess) {
        cudaFree(p);
        return NULL;
    }
    return p;
}

static void cuda_buf_free(struct moe_backend *be, void *p)
{
    if (p)
        cuda_check(be, cudaFree(p), "cudaFree");
}

static void cuda_buf_upload(struct moe_backend *be, void *dst, const void *src_host, size_t bytes)
{
    if (bytes)
        cuda_check(be, cudaMemcpy(dst, src_host, bytes, cudaMemcpyHostToDevice),
                   "cudaMemcpy to device");
}

static void cuda_buf_download(struct moe_backend *be, void *dst_host, const void *src,
                              size_t bytes)
{
    if (bytes)
        cuda_check(be, cudaMemcpy(dst_host, src, bytes, cudaMemcpyDeviceToHost),
                   "cudaMemcpy to host");
}

static void cuda_synchronize(struct moe_backend *be)
{
    cuda_check(be, cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

static void cuda_op_rmsnorm(struct moe_backend *be, const float *x, const float *w, float *y,
                            int n_rows, int dim, float eps)
{
    cuda_check(be, moe_cuda_rmsnorm(x, w, y, n_rows, dim, eps, 0), "rmsnorm");
}

static const struct moe_backend_ops cuda_ops = {
    .buf_alloc = cuda_buf_alloc,
    .buf_free = cuda_buf_free,
    .buf_upload = cuda_buf_upload,
    .buf_download = cuda_buf_download,
    .synchronize = cuda_synchronize,
    .matmul = NULL,
    .rmsnorm = cuda_op_rmsnorm,
    .rope = NULL,
    .kv_write = NULL,
    .attention = NULL,
    .router_topk = NULL,
    .swiglu = NULL,
    .gather_rows = NULL,
    .scatter_add_rows = NULL,
    .embed = NULL,
    .add = NULL,
};

/* Writes the names of the NULL ops of `ops` into buf ("matmul, rope");
 * returns how many there are. */
static int missing_ops(const struct moe_backend_ops *ops, char *buf, size_t cap)
{
    struct {
        const char *name;
        int present;
    } table[] = {
#define OP(f) {#f, ops->f != NULL}
        OP(buf_alloc), OP(buf_free), OP(buf_upload), OP(buf_download), OP(synchronize),
        OP(matmul), OP(rmsnorm), OP(rope), OP(kv_write), OP(attention), OP(router_topk),
        OP(swiglu), OP(gather_rows), OP(scatter_add_rows), OP(embed), OP(add),
#undef OP
    };
    int n = 0;
    size_t len = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        if (table[i].present)
            continue;
        int w = snprintf(buf + len, cap - len, "%s%s", n ? ", " : "", table[i].name);
        if (w > 0 && (size_t)w < cap - len)
            len += (size_t)w;
        n++;
    }
    return n;
}

static int partial_allowed(void)
{
    const char *s = getenv("MOE_CUDA_PARTIAL");
    return s && strcmp(s, "1") == 0;
}

enum moe_status moe_backend_cuda_create(int ordinal, struct moe_backend **out,
                                        struct moe_error *err)
{
    *out = NULL;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "no usable CUDA device (cudaGetDeviceCount: error %d, %s)", (int)e,
                             cudaGetErrorString(e));
    if (count <= 0)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "no usable CUDA device (cudaGetDeviceCount: 0 devices)");
    if (ordinal < 0 || ordinal >= count)
        return moe_error_set(err, MOE_ERR_INVALID, "CUDA device %d does not exist (%d present)",
                             ordinal, count);
    char missing[512];
    int n_missing = missing_ops(&cuda_ops, missing, sizeof(missing));
    if (n_missing > 0 && !partial_allowed())
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "CUDA backend incomplete in this build: ops %s missing", missing);
    e = cudaSetDevice(ordinal);
    if (e != cudaSuccess)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED, "cudaSetDevice(%d): error %d, %s",
                             ordinal, (int)e, cudaGetErrorString(e));
    struct cuda_backend *cb = calloc(1, sizeof(*cb));
    if (!cb)
        return moe_error_set(err, MOE_ERR_NOMEM, "cuda backend: out of memory");
    cb->ordinal = ordinal;
    atomic_init(&cb->first_error, 0);
    cb->base.name = "cuda";
    cb->base.device = MOE_DEVICE_CUDA;
    cb->base.ops = &cuda_ops;
    cb->base.ctx = cb;
    *out = &cb->base;
    return MOE_OK;
}

void cuda_backend_destroy(struct moe_backend *be)
{
    if (!be)
        return;
    cudaDeviceSynchronize();
    free(be);
}
