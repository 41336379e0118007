// Grouped expert GEMM on the tensor cores with the offsets on the device:
//   y[off[e] .. off[e+1]) = x[off[e] .. off[e+1]) . W_e^T (+ y),  W_e bf16.
//
// The grouped GEMV (grouped_matmul.cu) serves device-only offsets up to
// MOE_CUDA_GEMV_MAX_TOK rows an expert; past that a decode step of 16-64
// sequences had to bring its offsets to the host and run cuBLAS once per
// expert and matmul (twice with the hi + lo split), which also kept it out of
// CUDA graphs. This kernel is one launch per matmul for all experts at any
// row count, sized from host-known totals only:
//   grid.x = row-tile slots, ceil(n_rows / BM) + min(n_expert, n_rows): an
//            upper bound on sum_e ceil(rows_e / BM) (each expert wastes less
//            than one tile); thread 0 of a block walks the device offsets to
//            find its (expert, row tile), and the slots past the last tile
//            find none and exit (grouped_tiles.h, shared with unit/test_kernels,
//            which holds the map to every row exactly once);
//   grid.y = ceil(n_out / BN) output tiles.
// A block computes a BM x BN tile of y with 4 warps of 32 x 32 (2 x 2 WMMA
// 16x16x16 bf16 fragments, f32 accumulation). x is f32 in memory and is
// rounded to bf16 while it is staged in shared memory:
//   split (exact mode): x = hi + lo, hi = bf16(x), lo = bf16(x - hi), both
//     multiplied into the same accumulators: matmul.cu's two-GEMM numerics
//     (x carried to ~2^-17 relative), in one pass over W;
//   fast (moe_matmul_params.fast, where the backend enables it): hi only,
//     bf16 activations with f32 accumulation, as GPU engines compute.
// W is read once per (expert, row tile): once per step for a decode batch of
// up to BM rows an expert. No scratch, no host array, no synchronisation:
// graph-safe when the caller passes the device arrays.
#include <cuda_bf16.h>
#include <mma.h>

#include "cuda_ops.h"
#include "grouped_tiles.h"

namespace
{

using namespace nvcuda;

constexpr int BM = 64, BN = 64, BK = 32;
constexpr int kThreads = 128; // 4 warps in 2 x 2, each a 32 x 32 quarter of the tile
// Shared-memory row strides, padded against bank conflicts. WMMA wants
// ldm a multiple of 8 (16-bit) / 4 (f32) elements and 32-byte aligned
// fragment pointers: fragments start at rows that are multiples of 16 and
// columns that are multiples of 16, and 16 * 40 * 2, 16 * 2, 16 * 68 * 4,
// 16 * 4 bytes are all multiples of 32.
constexpr int LDS = BK + 8; // bf16 tiles of x and W
constexpr int LDC = BN + 4; // f32 output tile
static_assert(BM * BK % (4 * kThreads) == 0 && BN * BK % (8 * kThreads) == 0, "staging split");

struct alignas(32) Smem {
    __nv_bfloat16 a[2][BM][LDS]; // x tile: hi, lo
    __nv_bfloat16 b[BN][LDS];    // W tile, row n = output column n0 + n
    float c[BM][LDC];            // accumulators, for the masked store
};

// x[r][k0 + c .. +4) as f32 (zero past cnt rows or n_in columns).
template <bool kVec>
__device__ __forceinline__ float4 load_x4(const float *__restrict__ x, int n_in, int cnt, int r,
                                          int k)
{
    if (r >= cnt)
        return make_float4(0.f, 0.f, 0.f, 0.f);
    const float *p = x + (size_t)r * (size_t)n_in + k;
    if constexpr (kVec) { // n_in % 8 == 0: the four are all in range or all out
        return k < n_in ? __ldg((const float4 *)p) : make_float4(0.f, 0.f, 0.f, 0.f);
    } else {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            v[i] = k + i < n_in ? __ldg(p + i) : 0.f;
        return make_float4(v[0], v[1], v[2], v[3]);
    }
}

template <bool kSplit> __device__ __forceinline__ void stage_x(Smem &s, int r, int c, float4 v)
{
    const float f[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const __nv_bfloat16 h = __float2bfloat16_rn(f[i]);
        s.a[0][r][c + i] = h;
        if (kSplit)
            s.a[1][r][c + i] = __float2bfloat16_rn(__fsub_rn(f[i], __bfloat162float(h)));
    }
}

// kVec: n_in and ldw multiples of 8, x and every W_e 16-byte aligned.
template <bool kSplit, bool kVec>
__global__ void __launch_bounds__(kThreads)
    grouped_mma_kernel(const float *__restrict__ x, int n_in, int n_out, int n_expert,
                       const int32_t *__restrict__ off, const void *const *__restrict__ w,
                       int64_t ldw, float *__restrict__ y, bool accumulate)
{
    __shared__ Smem s;
    __shared__ int s_row0, s_cnt;
    __shared__ const uint16_t *s_w;
    if (threadIdx.x == 0) {
        int row0 = 0, cnt = 0;
        const int e = moe_grouped_tile_of(off, n_expert, (int)blockIdx.x, BM, &row0, &cnt);
        const void *we = e >= 0 ? w[e] : nullptr;
        s_row0 = row0;
        s_cnt = we ? cnt : 0;
        s_w = (const uint16_t *)we;
    }
    __syncthreads();
    const int cnt = s_cnt, n0 = (int)blockIdx.y * BN;
    if (cnt <= 0) // block-uniform
        return;
    const float *xe = x + (size_t)s_row0 * (size_t)n_in;
    const uint16_t *we = s_w;
    const int warp = (int)threadIdx.x / 32, wm = warp / 2, wn = warp % 2;

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::fill_fragment(acc[i][j], 0.0f);

    for (int k0 = 0; k0 < n_in; k0 += BK) {
        // x: BM x BK f32 as float4s, 4 a thread; consecutive threads read
        // consecutive columns of a row.
#pragma unroll
        for (int i = 0; i < BM * BK / 4 / kThreads; i++) {
            const int idx = (int)threadIdx.x + i * kThreads;
            const int r = idx / (BK / 4), c = idx % (BK / 4) * 4;
            stage_x<kSplit>(s, r, c, load_x4<kVec>(xe, n_in, cnt, r, k0 + c));
        }
        // W: BN rows x BK bf16 as 16-byte pieces, 2 a thread.
#pragma unroll
        for (int i = 0; i < BN * BK / 8 / kThreads; i++) {
            const int idx = (int)threadIdx.x + i * kThreads;
            const int n = idx / (BK / 8), c = idx % (BK / 8) * 8;
            const int k = k0 + c;
            const uint16_t *p = we + (size_t)(n0 + n) * (size_t)ldw + k;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (n0 + n < n_out) {
                if constexpr (kVec) {
                    if (k < n_in)
                        v = __ldg((const uint4 *)p);
                } else {
                    uint16_t h[8];
#pragma unroll
                    for (int t = 0; t < 8; t++)
                        h[t] = k + t < n_in ? __ldg(p + t) : (uint16_t)0;
                    v = make_uint4(h[0] | (uint32_t)h[1] << 16, h[2] | (uint32_t)h[3] << 16,
                                   h[4] | (uint32_t)h[5] << 16, h[6] | (uint32_t)h[7] << 16);
                }
            }
            *(uint4 *)&s.b[n][c] = v;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[2][2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b[2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                wmma::load_matrix_sync(a[0][i], &s.a[0][wm * 32 + i * 16][kk], LDS);
                if (kSplit)
                    wmma::load_matrix_sync(a[1][i], &s.a[1][wm * 32 + i * 16][kk], LDS);
            }
            // W^T as a K x N column-major matrix: element (k, n) at b[n][k]
#pragma unroll
            for (int j = 0; j < 2; j++)
                wmma::load_matrix_sync(b[j], &s.b[wn * 32 + j * 16][kk], LDS);
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    wmma::mma_sync(acc[i][j], a[0][i], b[j], acc[i][j]);
                    if (kSplit)
                        wmma::mma_sync(acc[i][j], a[1][i], b[j], acc[i][j]);
                }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::store_matrix_sync(&s.c[wm * 32 + i * 16][wn * 32 + j * 16], acc[i][j], LDC,
                                    wmma::mem_row_major);
    __syncthreads();
    for (int idx = (int)threadIdx.x; idx < BM * BN; idx += kThreads) {
        const int r = idx / BN, c = idx % BN;
        if (r < cnt && n0 + c < n_out) {
            float *out = y + (size_t)(s_row0 + r) * (size_t)n_out + n0 + c;
            *out = accumulate ? *out + s.c[r][c] : s.c[r][c];
        }
    }
}

bool aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

} // namespace

extern "C" const char *moe_cuda_grouped_mma_unsupported(const moe_grouped_matmul_params *p)
{
    if (p->w_dtype != MOE_DTYPE_BF16)
        return "the tensor-core grouped GEMM takes bf16 weights";
    if (!p->w)
        return "the tensor-core grouped GEMM needs the host array of weight pointers";
    const long long slots = moe_grouped_tile_slots(p->n_rows, p->n_expert, BM);
    if (slots > 0x7fffffffLL || ((long long)p->n_out + BN - 1) / BN > 65535)
        return "n_rows or n_out too large for the tensor-core grouped GEMM's grid";
    return NULL;
}

extern "C" cudaError_t moe_cuda_grouped_mma(const moe_grouped_matmul_params *p,
                                            const int32_t *off_dev, const void *const *w_dev,
                                            bool split, cudaStream_t stream)
{
    if (moe_cuda_grouped_mma_unsupported(p))
        return cudaErrorNotSupported;
    if (p->n_rows == 0 || p->n_out == 0)
        return cudaSuccess;
    if (p->n_in == 0) { // empty sums: y = 0 (or unchanged); rows are contiguous
        if (p->accumulate)
            return cudaSuccess;
        return cudaMemsetAsync(p->y, 0, (size_t)p->n_rows * (size_t)p->n_out * sizeof(float),
                               stream);
    }
    bool vec = p->n_in % 8 == 0 && p->ldw % 8 == 0 && aligned16(p->x);
    int slots = 0;
    if (p->expert_offsets) { // host offsets: the exact tile count
        for (int e = 0; e < p->n_expert; e++) {
            const int c = p->expert_offsets[e + 1] - p->expert_offsets[e];
            slots += (c + BM - 1) / BM;
            vec = vec && (c == 0 || aligned16(p->w[e]));
        }
    } else {
        slots = (int)moe_grouped_tile_slots(p->n_rows, p->n_expert, BM);
        for (int e = 0; e < p->n_expert; e++)
            vec = vec && aligned16(p->w[e]);
    }
    if (slots == 0)
        return cudaSuccess;
    const dim3 grid((unsigned)slots, (unsigned)((p->n_out + BN - 1) / BN));
#define MOE_MMA_LAUNCH(S, V)                                                                       \
    grouped_mma_kernel<S, V><<<grid, kThreads, 0, stream>>>(                                       \
        p->x, p->n_in, p->n_out, p->n_expert, off_dev, w_dev, p->ldw, p->y, p->accumulate)
    if (split && vec)
        MOE_MMA_LAUNCH(true, true);
    else if (split)
        MOE_MMA_LAUNCH(true, false);
    else if (vec)
        MOE_MMA_LAUNCH(false, true);
    else
        MOE_MMA_LAUNCH(false, false);
#undef MOE_MMA_LAUNCH
    return cudaGetLastError();
}
