// Argmax and temperature/top-p sampling on the device, one block per row
// (semantics in backend.h; arithmetic shared with the CPU reference through
// kernels/cpu/sample_math.h).
//
// argmax: each thread scans a strided part of the row, then warp and block
// reductions of (value, id) where the larger value wins and equal values go
// to the lower id (the CPU's sequential rule; NaN never wins).
//
// sample_top_p, without sorting: the candidates' order is by p descending,
// ties to the lower id, i.e. by the 64-bit key (bits(p), -id), and every
// question the sampler asks is "which candidate is the first, in that order,
// whose inclusive running mass S exceeds a threshold" (the end of the nucleus:
// S >= cut, i.e. S > cut - 1; the sampled id: S > r). select_desc answers it
// by radix selection: three passes over the row (digits of 11, 11 and 10 bits
// of bits(p), high to low) each build a histogram of mass per digit among the
// candidates matching the digits chosen so far (shared-memory 64-bit integer
// atomics: exact, so the order of the adds does not matter), and a block scan
// over the buckets from the top picks the digit where the running mass
// crosses the threshold. That leaves p itself; its candidates all have the
// same mass Q, so the answer is the m-th of them in id order,
// m = (threshold - mass above) / Q, found by a tiled block scan of flags.
// Without top-p the order is the id order and one tiled scan of the masses
// finds the id. Each pass recomputes p from the logit (the same float every
// time); a row costs ~10 reads of the logits, mostly from L2. Masses are
// integers (2^-40 units), so the result is the same on every run and equals
// the CPU reference whenever expf agrees.
#include <limits.h>

#include "cpu/sample_math.h"
#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBuckets = 2048; // the widest digit: 11 bits

__device__ __forceinline__ bool beats(float v, int i, float bv, int bi)
{
    return v > bv || (v == bv && i < bi);
}

// Index of the largest value of row (ties to the lower id), its value in
// *maxv; every thread gets both. 0 for an empty or all-NaN row.
__device__ int block_argmax(const float *__restrict__ row, int vocab, float *maxv)
{
    __shared__ float sv[kWarps];
    __shared__ int si[kWarps];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
        const float v = row[i];
        if (beats(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (beats(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
    __syncthreads(); // sv/si of an earlier call read by everyone
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    bv = sv[0];
    bi = si[0];
    for (int w = 1; w < kWarps; w++)
        if (beats(sv[w], si[w], bv, bi)) {
            bv = sv[w];
            bi = si[w];
        }
    if (bi == INT_MAX)
        bi = 0;
    *maxv = vocab > 0 ? row[bi] : 0.0f;
    return bi;
}

// Exclusive prefix sum of v over the threads in index order; *total gets the
// sum over all threads. Called by every thread of the block.
__device__ uint64_t block_excl_scan(uint64_t v, uint64_t *total)
{
    __shared__ uint64_t wsum[kWarps];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    uint64_t incl = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const uint64_t o = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off)
            incl += o;
    }
    __syncthreads(); // wsum of an earlier call read by everyone
    if (lane == 31)
        wsum[warp] = incl;
    __syncthreads();
    uint64_t before = 0, all = 0;
    for (int w = 0; w < kWarps; w++) {
        const uint64_t s = wsum[w];
        before += w < warp ? s : 0;
        all += s;
    }
    *total = all;
    return before + incl - v;
}

struct row_ctx {
    const float *row;
    int vocab;
    float max, temperature;
};

__device__ __forceinline__ float cand_p(const row_ctx &c, int i)
{
    return moe_sample_p(c.row[i], c.max, c.temperature);
}

// The m-th (0-based) id, in ascending order, whose p has bits `bits`.
__device__ int nth_with_bits(const row_ctx &c, uint32_t bits, uint64_t m)
{
    __shared__ int s_found;
    __syncthreads();
    if (threadIdx.x == 0)
        s_found = -1;
    __syncthreads();
    uint64_t carry = 0;
    for (int base = 0; base < c.vocab; base += kThreads) {
        const int i = base + (int)threadIdx.x;
        const uint64_t flag = i < c.vocab && __float_as_uint(cand_p(c, i)) == bits;
        uint64_t tot;
        const uint64_t excl = block_excl_scan(flag, &tot);
        if (flag && carry + excl == m)
            s_found = i;
        carry += tot;
        if (carry > m) // block-uniform
            break;
    }
    __syncthreads();
    return s_found;
}

// The first candidate in (p descending, id ascending) order whose inclusive
// running mass S exceeds thresh; S in *mass_incl. -1 when the total mass does
// not exceed thresh.
__device__ int select_desc(const row_ctx &c, uint64_t thresh, uint64_t *mass_incl)
{
    __shared__ unsigned long long hist[kBuckets];
    __shared__ int s_digit;
    __shared__ uint64_t s_above;
    uint32_t prefix = 0, mask = 0;
    uint64_t above = 0;
    const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
    for (int pass = 0; pass < 3; pass++) {
        const int shift = shifts[pass], nb = 1 << widths[pass], per = nb / kThreads;
        __syncthreads(); // hist and s_* of the previous pass read by everyone
        for (int b = threadIdx.x; b < nb; b += kThreads)
            hist[b] = 0;
        if (threadIdx.x == 0)
            s_digit = -1;
        __syncthreads();
        for (int i = threadIdx.x; i < c.vocab; i += kThreads) {
            const float p = cand_p(c, i);
            const uint64_t q = moe_sample_mass(p);
            const uint32_t bits = __float_as_uint(p);
            if (q && (bits & mask) == prefix)
                atomicAdd(&hist[(bits >> shift) & (uint32_t)(nb - 1)], (unsigned long long)q);
        }
        __syncthreads();
        // thread t owns the buckets of group g = kThreads - 1 - t, so the scan
        // in thread order runs from the highest buckets down
        const int g = kThreads - 1 - (int)threadIdx.x;
        uint64_t local = 0;
        for (int b = g * per; b < g * per + per; b++)
            local += hist[b];
        uint64_t tot;
        const uint64_t excl = above + block_excl_scan(local, &tot);
        if (excl <= thresh && thresh < excl + local) { // exactly one thread
            uint64_t run = excl;
            for (int b = g * per + per - 1; b >= g * per; b--) {
                if (thresh < run + hist[b]) {
                    s_digit = b;
                    s_above = run;
                    break;
                }
                run += hist[b];
            }
        }
        __syncthreads();
        if (s_digit < 0) // block-uniform: total mass <= thresh
            return -1;
        prefix |= (uint32_t)s_digit << shift;
        mask |= (uint32_t)(nb - 1) << shift;
        above = s_above;
    }
    // every candidate with bits(p) == prefix has the same mass q > 0
    const uint64_t q = moe_sample_mass(__uint_as_float(prefix));
    const uint64_t m = (thresh - above) / q; // < (mass of the bucket) / q
    *mass_incl = above + (m + 1) * q;
    return nth_with_bits(c, prefix, m);
}

// The first id whose inclusive running mass in id order exceeds r.
__device__ int first_over_in_id_order(const row_ctx &c, uint64_t r)
{
    __shared__ int s_found;
    __syncthreads();
    if (threadIdx.x == 0)
        s_found = c.vocab - 1;
    __syncthreads();
    uint64_t carry = 0;
    for (int base = 0; base < c.vocab; base += kThreads) {
        const int i = base + (int)threadIdx.x;
        const uint64_t q = i < c.vocab ? moe_sample_mass(cand_p(c, i)) : 0;
        uint64_t tot;
        const uint64_t excl = carry + block_excl_scan(q, &tot);
        if (q && excl <= r && r < excl + q)
            s_found = i;
        carry += tot;
        if (carry > r) // block-uniform
            break;
    }
    __syncthreads();
    return s_found;
}

__global__ void __launch_bounds__(kThreads)
    argmax_kernel(const float *__restrict__ logits, int vocab, int32_t *__restrict__ out_ids)
{
    float mx;
    const int best = block_argmax(logits + (size_t)blockIdx.x * (size_t)vocab, vocab, &mx);
    if (threadIdx.x == 0)
        out_ids[blockIdx.x] = best;
}

__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float *__restrict__ logits, int vocab, float temperature, float top_p,
                  const float *__restrict__ temps, const float *__restrict__ top_ps,
                  const double *__restrict__ uniform, int32_t *__restrict__ out_ids)
{
    if (temps) { // sample_rows: the row's own settings
        temperature = temps[blockIdx.x];
        top_p = top_ps[blockIdx.x];
    }
    row_ctx c;
    c.row = logits + (size_t)blockIdx.x * (size_t)vocab;
    c.vocab = vocab;
    c.temperature = temperature;
    const int best = block_argmax(c.row, vocab, &c.max);
    int id = best;
    if (temperature > 0.0f) {
        uint64_t local = 0;
        for (int i = threadIdx.x; i < vocab; i += kThreads)
            local += moe_sample_mass(cand_p(c, i));
        uint64_t total;
        block_excl_scan(local, &total);
        const double u = uniform[blockIdx.x];
        if (top_p > 0.0f && top_p < 1.0f) {
            uint64_t kept = 0, unused = 0;
            const int last = select_desc(c, moe_sample_cut(top_p, total) - 1, &kept);
            const uint64_t r = moe_sample_point(u, kept);
            id = last;
            if (last >= 0 && r < kept)
                id = select_desc(c, r, &unused);
            if (id < 0) // not reachable with a finite max (its mass is 2^40)
                id = best;
        } else {
            const uint64_t r = moe_sample_point(u, total);
            id = r < total ? first_over_in_id_order(c, r) : vocab - 1;
        }
    }
    if (threadIdx.x == 0)
        out_ids[blockIdx.x] = id;
}

} // namespace

extern "C" cudaError_t moe_cuda_argmax(const float *logits, int n, int vocab, int32_t *out_ids,
                                       cudaStream_t stream)
{
    if (n <= 0)
        return cudaSuccess;
    argmax_kernel<<<(unsigned)n, kThreads, 0, stream>>>(logits, vocab, out_ids);
    return cudaGetLastError();
}

extern "C" cudaError_t moe_cuda_sample(const float *logits, int n, int vocab, float temperature,
                                       float top_p, const float *temps, const float *top_ps,
                                       const double *uniform, int32_t *out_ids, cudaStream_t stream)
{
    if (vocab < 1 || vocab > MOE_CUDA_SAMPLE_MAX_VOCAB)
        return cudaErrorNotSupported;
    if (n <= 0)
        return cudaSuccess;
    sample_kernel<<<(unsigned)n, kThreads, 0, stream>>>(logits, vocab, temperature, top_p, temps,
                                                        top_ps, uniform, out_ids);
    return cudaGetLastError();
}
