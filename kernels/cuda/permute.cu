// Routing's permutation (backend.h, struct moe_permute_params) in one block
// of 1024 threads: a histogram of the items' keys, a scan into offsets, then
// a single warp places the items in item order, 32 at a time:
// __match_any_sync groups the lanes with equal keys, each takes the key's
// cursor plus its rank among them, so the order is the stable one of the CPU
// reference; last, a thread per token lists its positions by expert id.
// Integer work only: the arrays equal the CPU's. A decode step has a few
// hundred items (one pass of the warp per 32); a 2048-token prefill with
// top-8 takes 512 passes, a few tens of microseconds.
//
// An expert id or a replica's rank out of range cannot be reported from the
// device without a wait: the item is counted under key 0 and `*bad` is set,
// which the backend's status op reads back (after the caller's synchronize).
#include "cuda_ops.h"

namespace
{

constexpr int kThreads = 1024;

__device__ int item_key(const moe_permute_params &p, int i, int *bad)
{
    const int t = i / p.top_k, e = p.ids[i];
    if (e < 0 || e >= p.n_expert) {
        atomicExch(bad, 1);
        return 0;
    }
    int dest = 0;
    if (p.ranks) {
        const int n_rep = p.n_ranks[e] > 0 ? p.n_ranks[e] : 1;
        dest = p.ranks[(size_t)e * (size_t)p.rank_stride + (size_t)((p.token_base + t) % n_rep)];
        if (dest < 0 || dest >= p.n_dest) {
            atomicExch(bad, 1);
            return 0;
        }
    }
    return dest * p.n_expert + e;
}

__global__ void __launch_bounds__(kThreads)
    permute_kernel(moe_permute_params p, int32_t *__restrict__ keys, int32_t *__restrict__ cursor,
                   int *bad)
{
    __shared__ int32_t partial[kThreads];
    const int tid = threadIdx.x;
    const int n_items = p.n_tok * p.top_k, n_keys = p.n_dest * p.n_expert;
    int32_t *off = p.offsets;
    for (int k = tid; k <= n_keys; k += kThreads)
        off[k] = 0;
    __syncthreads();
    for (int i = tid; i < n_items; i += kThreads) {
        const int key = item_key(p, i, bad);
        keys[i] = key;
        atomicAdd(&off[key + 1], 1);
    }
    __syncthreads();
    // inclusive scan of off[0..n_keys]: a segment per thread, then the
    // segments' sums scanned by thread 0
    const int seg = (n_keys + 1 + kThreads - 1) / kThreads;
    const int lo = tid * seg, hi = min(lo + seg, n_keys + 1);
    int32_t sum = 0;
    for (int k = lo; k < hi; k++)
        sum += off[k];
    partial[tid] = sum;
    __syncthreads();
    if (tid == 0) {
        int32_t run = 0;
        for (int j = 0; j < kThreads; j++) {
            const int32_t v = partial[j];
            partial[j] = run;
            run += v;
        }
    }
    __syncthreads();
    int32_t run = partial[tid];
    for (int k = lo; k < hi; k++) {
        run += off[k];
        off[k] = run;
    }
    __syncthreads();
    for (int k = tid; k < n_keys; k += kThreads)
        cursor[k] = off[k];
    __syncthreads();
    if (tid < 32) {
        const int lane = tid;
        for (int base = 0; base < n_items; base += 32) {
            const int i = base + lane;
            const bool active = i < n_items;
            const int key = active ? keys[i] : -1 - lane; // idle lanes match nobody
            const unsigned peers = __match_any_sync(0xffffffffu, key);
            const int leader = __ffs(peers) - 1;
            const int rank = __popc(peers & ((1u << lane) - 1u));
            int start = 0;
            if (active && lane == leader)
                start = cursor[key];
            start = __shfl_sync(0xffffffffu, start, leader);
            if (active) {
                const int q = start + rank;
                if (p.item_tok)
                    p.item_tok[q] = i / p.top_k;
                if (p.item_exp)
                    p.item_exp[q] = p.ids[i];
                if (p.item_w)
                    p.item_w[q] = p.weights[i];
                p.tok_rows[i] = q;
            }
            __syncwarp();
            if (active && lane == leader)
                cursor[key] = start + __popc(peers);
            __syncwarp();
        }
    }
    __syncthreads();
    // each token's positions by ascending expert id (its experts are
    // distinct; top_k <= 32: selection over a bit mask)
    for (int t = tid; t < p.n_tok; t += kThreads) {
        int32_t *pos = p.tok_rows + (size_t)t * (size_t)p.top_k;
        const int32_t *e = p.ids + (size_t)t * (size_t)p.top_k;
        int32_t sorted[32];
        unsigned taken = 0;
        for (int r = 0; r < p.top_k; r++) {
            int best = -1;
            for (int j = 0; j < p.top_k; j++)
                if (!(taken & (1u << j)) && (best < 0 || e[j] < e[best]))
                    best = j;
            taken |= 1u << best;
            sorted[r] = pos[best];
        }
        for (int r = 0; r < p.top_k; r++)
            pos[r] = sorted[r];
    }
}

} // namespace

extern "C" const char *moe_cuda_permute_unsupported(const struct moe_permute_params *p)
{
    if (p->top_k < 1 || p->top_k > 32)
        return "top_k must be 1..32";
    if (p->n_expert < 1 || p->n_dest < 1 || p->n_tok < 0)
        return "bad sizes (n_expert and n_dest >= 1, n_tok >= 0)";
    if (p->ranks && (!p->n_ranks || p->rank_stride < 1))
        return "ranks without n_ranks or rank_stride";
    if (!p->tok_rows || !p->offsets || !p->ids || (p->item_w && !p->weights))
        return "tok_rows, offsets and ids are required (and weights with item_w)";
    return NULL;
}

extern "C" cudaError_t moe_cuda_permute(const struct moe_permute_params *p, int32_t *keys,
                                        int32_t *cursor, int *bad, cudaStream_t stream)
{
    if (moe_cuda_permute_unsupported(p))
        return cudaErrorNotSupported;
    permute_kernel<<<1, kThreads, 0, stream>>>(*p, keys, cursor, bad);
    return cudaGetLastError();
}
