// RMSNorm, f32: one block per row. Each thread sums squares over a strided
// slice of the row, warps reduce with shuffles, warp 0 combines the partial
// sums; then every thread scales its slice: y = w * (x * (1 / sqrt(var + eps))),
// the order of operations of the CPU reference and of Hugging Face. x may
// equal y (in place): after the barrier each element is read and then written
// by the same thread. add_rmsnorm adds the residual r to x in the first pass
// (x += r, written back) and norms the sum: one launch for the two ops.
#include "common.cuh"
#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// kAdd: x += r first (add_rmsnorm), each element written back by the thread
// that reads it again below.
template <bool kAdd>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_kernel(float *x, const float *__restrict__ r, const float *__restrict__ w, float *y,
                   int dim, float eps)
{
    __shared__ float partial[kWarps];
    __shared__ float inv_rms;
    const size_t row = blockIdx.x;
    float *xr = x + row * (size_t)dim;
    float *yr = y + row * (size_t)dim;

    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += kThreads) {
        float v = xr[i];
        if (kAdd) {
            v = __fadd_rn(v, r[row * (size_t)dim + i]);
            xr[i] = v;
        }
        ss += v * v;
    }
    ss = warp_sum(ss);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0)
        partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float v = lane < kWarps ? partial[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0)
            inv_rms = 1.0f / sqrtf(v / (float)dim + eps);
    }
    __syncthreads();
    const float inv = inv_rms;
    for (int i = threadIdx.x; i < dim; i += kThreads)
        yr[i] = w[i] * (xr[i] * inv);
}

} // namespace

extern "C" cudaError_t moe_cuda_rmsnorm(const float *x, const float *w, float *y, int n_rows,
                                        int dim, float eps, cudaStream_t stream)
{
    if (n_rows <= 0 || dim <= 0)
        return cudaSuccess;
    // x is only read here (y may equal it)
    rmsnorm_kernel<false><<<n_rows, kThreads, 0, stream>>>((float *)x, nullptr, w, y, dim, eps);
    return cudaGetLastError();
}

extern "C" cudaError_t moe_cuda_add_rmsnorm(float *x, const float *r, const float *w, float *y,
                                            int n_rows, int dim, float eps, cudaStream_t stream)
{
    if (n_rows <= 0 || dim <= 0)
        return cudaSuccess;
    rmsnorm_kernel<true><<<n_rows, kThreads, 0, stream>>>(x, r, w, y, dim, eps);
    return cudaGetLastError();
}
