/* C-callable launchers of the CUDA kernels (one .cu per op) and the CUDA
 * backend's private entry points. Pointers are device memory. Launchers
 * return the launch error (cudaSuccess when the kernel was queued). */
#ifndef MOE_CUDA_OPS_H
#define MOE_CUDA_OPS_H

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* y[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)); x, y (n_rows, dim), w (dim).
 * y == x is allowed. One block per row. */
cudaError_t moe_cuda_rmsnorm(const float *x, const float *w, float *y, int n_rows, int dim,
                             float eps, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
