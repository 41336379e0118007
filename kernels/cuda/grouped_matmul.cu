// Grouped expert GEMM (see backend.h):
//   y[off[e] .. off[e+1]) = x[off[e] .. off[e+1]) . W_e^T (+ y).
//
// Two paths, chosen by the backend (backend_cuda.c) from the host offsets:
//  - decode (bf16 W, at most MOE_CUDA_GEMV_MAX_TOK rows per expert): this
//    file's grouped GEMV, ONE launch for all experts. It is matmul.cu's GEMV
//    (one warp per output row, 16-byte pieces of the bf16 row widened exactly
//    to f32, f32 fmaf, W read once for all the expert's rows) with the block
//    mapped to (active expert, output-row block): grid.x = active experts x
//    ceil(n_out / 8); thread 0 finds the a-th expert with rows by walking the
//    device offsets (n_expert <= a few hundred), so the launch shape needs
//    only host-known totals and the device arrays can stay put (graph-safe
//    when the caller passes them).
//  - device-only offsets past those rows: grouped_mma.cu's tensor-core
//    kernel, one launch for all experts.
//  - everything else (prefill, f32 W): the backend loops over the experts
//    with rows and runs the existing matmul per expert (cuBLAS, bf16 x split
//    into hi + lo for tensor cores; matmul.cu). Launch overhead is small next
//    to those GEMMs.
// Why not one tiled kernel for all: a first version (plain SIMT tiles of 16
// or 64 rows x 64 outputs, f32 FMA) measured on an H200 at 339 us for the
// benchmark model's two expert matmuls at 1 token (2 experts), against 19 us
// for the per-expert GEMV loop, and 3.9 ms against 0.48 ms at 2048 tokens:
// without tensor cores and with 2-byte loads it lost everywhere. And not
// cublasGemmGroupedBatchedEx: it wants A and B of one type (bf16 x would lose
// the f32 activations the CPU reference keeps) and host arrays per call.
#include <cuda_bf16.h>

#include "common.cuh"
#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 256; // 8 warps = 8 output rows per block
constexpr int kRowsPerBlock = kThreads / 32;

constexpr int kMaxRows = MOE_CUDA_GEMV_MAX_TOK;

// kVec: n_in and ldw multiples of 8, every W_e and x 16-byte aligned.
template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    grouped_gemv_kernel(const float *__restrict__ x, int n_in, int n_out, int n_expert,
                        const int32_t *__restrict__ off, const void *const *__restrict__ w,
                        int64_t ldw, float *__restrict__ y, bool accumulate, int blocks_per_expert)
{
    __shared__ int s_row0, s_cnt;
    __shared__ const uint16_t *s_w;
    if (threadIdx.x == 0) {
        const int active = (int)blockIdx.x / blocks_per_expert;
        int seen = 0, row0 = 0, cnt = 0;
        const void *we = nullptr;
        for (int e = 0; e < n_expert; e++) {
            const int c = off[e + 1] - off[e];
            if (c <= 0)
                continue;
            if (seen++ == active) {
                row0 = off[e];
                cnt = c < kMaxRows ? c : kMaxRows; // the host checked c <= kMaxRows
                we = w[e];
                break;
            }
        }
        s_row0 = row0;
        s_cnt = we ? cnt : 0;
        s_w = (const uint16_t *)we;
    }
    __syncthreads();
    const int cnt = s_cnt;
    const int row = ((int)blockIdx.x % blocks_per_expert) * kRowsPerBlock + (int)threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (cnt <= 0 || row >= n_out) // whole warp (cnt block-uniform)
        return;
    const float *xe = x + (size_t)s_row0 * (size_t)n_in;
    const uint16_t *wr = s_w + (size_t)row * (size_t)ldw;
    float acc[kMaxRows];
    bf16_row_dot<kMaxRows, kVec, 2>(xe, n_in, wr, lane, cnt, acc);
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < kMaxRows; t++) {
            if (t < cnt) {
                float *out = y + (size_t)(s_row0 + t) * (size_t)n_out + row;
                *out = accumulate ? __fadd_rn(*out, acc[t]) : acc[t];
            }
        }
    }
}

bool aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

} // namespace

extern "C" bool moe_cuda_grouped_gemv_fits(const moe_grouped_matmul_params *p)
{
    if (p->w_dtype != MOE_DTYPE_BF16 || p->n_in == 0)
        return false;
    if (!p->expert_offsets) // device-only offsets: the caller's bound
        return p->max_expert_rows <= kMaxRows;
    for (int e = 0; e < p->n_expert; e++)
        if (p->expert_offsets[e + 1] - p->expert_offsets[e] > kMaxRows)
            return false;
    return true;
}

extern "C" cudaError_t moe_cuda_grouped_gemv(const moe_grouped_matmul_params *p,
                                             const int32_t *off_dev, const void *const *w_dev,
                                             cudaStream_t stream)
{
    if (!moe_cuda_grouped_gemv_fits(p))
        return cudaErrorNotSupported;
    if (p->n_rows == 0 || p->n_out == 0)
        return cudaSuccess;
    int active = 0;
    bool vec = p->n_in % 8 == 0 && p->ldw % 8 == 0 && aligned16(p->x);
    for (int e = 0; e < p->n_expert; e++) {
        if (p->expert_offsets && p->expert_offsets[e + 1] == p->expert_offsets[e])
            continue;
        active++;
        vec = vec && aligned16(p->w[e]);
    }
    // Device-only offsets: a block per possible active expert (each has a
    // row, so at most n_rows of them); the blocks past the last active one
    // find no expert and exit.
    if (!p->expert_offsets && active > p->n_rows)
        active = p->n_rows;
    const int bpe = (p->n_out + kRowsPerBlock - 1) / kRowsPerBlock;
    const size_t blocks = (size_t)active * (size_t)bpe;
    if (blocks > 0x7fffffffu)
        return cudaErrorNotSupported;
    if (vec)
        grouped_gemv_kernel<true><<<(unsigned)blocks, kThreads, 0, stream>>>(
            p->x, p->n_in, p->n_out, p->n_expert, off_dev, w_dev, p->ldw, p->y, p->accumulate, bpe);
    else
        grouped_gemv_kernel<false><<<(unsigned)blocks, kThreads, 0, stream>>>(
            p->x, p->n_in, p->n_out, p->n_expert, off_dev, w_dev, p->ldw, p->y, p->accumulate, bpe);
    return cudaGetLastError();
}
