/* The CUDA backend: device memory through the CUDA runtime, one kernel per op
 * (kernels/cuda/<op>.cu), cuBLAS for matmul (loaded when the first backend is
 * created: cublas_lazy.h).
 *
 * One stream per backend; every op is queued on it. buf_upload and
 * buf_download are synchronous: when they return, the host buffer may be
 * reused (upload) or read (download), and everything queued before them has
 * finished. buf_alloc zeroes on the stream, buf_free waits for the stream.
 *
 * moe_backend_cuda_create refuses with MOE_ERR_UNSUPPORTED while any op of
 * the table is NULL ("ops X, Y missing"), so `--device auto` never computes
 * garbage on a partial backend.
 *
 * Ops return void, so an error inside one — a CUDA or cuBLAS failure, or a
 * shape the kernels do not support ("attention: d_head 96 not supported") —
 * is recorded: the first one is kept with its message and printed once to
 * stderr, nothing is launched for the failing op, and
 * the `status` op (and cuda_backend_take_error() for tests) hands it over and
 * clears it: cudaErrorNotSupported becomes MOE_ERR_UNSUPPORTED,
 * cudaErrorInvalidValue MOE_ERR_INVALID, anything else MOE_ERR_INTERNAL. */
#include <stdarg.h>
#include <limits.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "cpu/cpu_kernels.h" /* moe_grouped_matmul_check, shared with the CPU backend */
#include "cuda_backend.h"
#include "cuda_ops.h"
#include "cublas_lazy.h"

/* A step's graph, by its key: seen once (exec NULL), recorded, or found
 * not recordable (failed: the step runs eagerly each time). */
#define CUDA_GRAPH_SLOTS 32
struct cuda_graph {
    uint64_t key;
    cudaGraphExec_t exec;
    uint64_t mem_gen; /* cuda_backend.mem_gen when recorded */
    uint64_t used;    /* tick of the last use; 0: slot free */
    bool failed;
};

struct cuda_backend {
    struct moe_backend base; /* first */
    int ordinal;
    cudaStream_t stream;
    cublasHandle_t blas;
    void *scratch; /* device scratch for matmul (bf16 x) and attention (split partials) */
    size_t scratch_cap;
    void *meta; /* device copies of host arrays that ops were given (grouped_matmul) */
    size_t meta_cap;
    int *bad; /* device flag: permute met an expert id or rank out of range */
    struct moe_backend_counters cnt; /* the engine thread's calls (plain counters) */
    /* graphs (graph_* ops): MOE_CUDA_GRAPHS=1 turns them on; without it the
     * backend's op table (a copy of cuda_ops) has none */
    struct moe_backend_ops ops;
    bool graphs_on;
    bool device_routing; /* MOE_CUDA_DEVICE_ROUTING=1 (grouped_device_rows) */
    bool fast_gemm;      /* MOE_CUDA_FAST_GEMM=1: the ops honour moe_matmul_params.fast */
    bool fused_ops;      /* MOE_CUDA_FUSED_OPS=1: add_rmsnorm and rope_kv_write offered */
    bool capturing;      /* between a graph_begin that said true and graph_end */
    bool capture_broken; /* an op needed more scratch while capturing */
    struct cuda_graph *capture_slot;
    uint64_t mem_gen; /* bumped when scratch or meta moves: graphs hold their addresses */
    uint64_t tick;
    struct cuda_graph graphs[CUDA_GRAPH_SLOTS];
    _Atomic int first_error; /* 0 while none; else the cudaError_t (or -1 for non-CUDA errors) */
    char first_msg[256];
};

/* The CUDA device current on this thread, as last set here (-1: not yet). */
static _Thread_local int t_bound_ordinal = -1;

/* The backend, with its device made current on the calling thread: the
 * current device is per thread, and the engine, the KV data plane and the
 * loader call ops from threads other than the one that made the backend
 * (on a rank whose GPU is not device 0, a launch or cudaMalloc would go to
 * the wrong GPU otherwise). Every op enters through here. */
static struct cuda_backend *cuda_of(struct moe_backend *be)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    if (t_bound_ordinal != cb->ordinal && cudaSetDevice(cb->ordinal) == cudaSuccess)
        t_bound_ordinal = cb->ordinal;
    return cb;
}

/* Records the first error (printed once); later ones are dropped. */
__attribute__((format(printf, 3, 4))) static void cuda_fail(struct moe_backend *be, int code,
                                                            const char *fmt, ...)
{
    struct cuda_backend *cb = cuda_of(be);
    int expected = 0;
    if (code == 0)
        code = -1;
    if (!atomic_compare_exchange_strong(&cb->first_error, &expected, code))
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cb->first_msg, sizeof cb->first_msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "moe: cuda backend: %s\n", cb->first_msg);
}

static void cuda_check(struct moe_backend *be, cudaError_t e, const char *what)
{
    if (e != cudaSuccess)
        cuda_fail(be, (int)e, "%s: error %d, %s", what, (int)e, cudaGetErrorString(e));
}

int cuda_backend_take_error(struct moe_backend *be, char *msg, size_t cap)
{
    struct cuda_backend *cb = cuda_of(be);
    int e = atomic_load(&cb->first_error);
    if (e && msg && cap)
        snprintf(msg, cap, "%s", cb->first_msg);
    atomic_store(&cb->first_error, 0);
    return e;
}

/* Grows the scratch buffer to `bytes`; NULL (error recorded) on failure. */
static void *scratch_reserve(struct moe_backend *be, size_t bytes, const char *what)
{
    struct cuda_backend *cb = cuda_of(be);
    if (bytes <= cb->scratch_cap)
        return cb->scratch;
    if (cb->capturing) { /* a graph cannot free and allocate: the step reruns eagerly */
        cb->capture_broken = true;
        return NULL;
    }
    cb->mem_gen++;
    size_t cap = cb->scratch_cap * 2 > bytes ? cb->scratch_cap * 2 : bytes;
    if (cb->scratch) {
        cb->cnt.syncs++;
        cuda_check(be, cudaStreamSynchronize(cb->stream), "scratch: cudaStreamSynchronize");
        cudaFree(cb->scratch);
        cb->scratch = NULL;
        cb->scratch_cap = 0;
    }
    cudaError_t e = cudaMalloc(&cb->scratch, cap);
    if (e != cudaSuccess) {
        cb->scratch = NULL;
        cuda_fail(be, (int)e, "%s: cannot allocate %zu bytes of scratch: %s", what, cap,
                  cudaGetErrorString(e));
        return NULL;
    }
    cb->scratch_cap = cap;
    return cb->scratch;
}

/* Grows the meta buffer to `bytes` (NULL, error recorded, on failure). */
static void *meta_reserve(struct moe_backend *be, size_t bytes, const char *what)
{
    struct cuda_backend *cb = cuda_of(be);
    if (bytes <= cb->meta_cap)
        return cb->meta;
    if (cb->capturing) {
        cb->capture_broken = true;
        return NULL;
    }
    cb->mem_gen++;
    size_t cap = bytes < 4096 ? 4096 : bytes;
    if (cb->meta) {
        cb->cnt.syncs++;
        cuda_check(be, cudaStreamSynchronize(cb->stream), "meta: cudaStreamSynchronize");
        cudaFree(cb->meta);
        cb->meta = NULL;
        cb->meta_cap = 0;
    }
    cudaError_t e = cudaMalloc(&cb->meta, cap);
    if (e != cudaSuccess) {
        cb->meta = NULL;
        cuda_fail(be, (int)e, "%s: cannot allocate %zu bytes of metadata: %s", what, cap,
                  cudaGetErrorString(e));
        return NULL;
    }
    cb->meta_cap = cap;
    return cb->meta;
}

static void *cuda_buf_alloc(struct moe_backend *be, size_t bytes)
{
    struct cuda_backend *cb = cuda_of(be);
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 64) != cudaSuccess)
        return NULL;
    if (bytes && cudaMemsetAsync(p, 0, bytes, cb->stream) != cudaSuccess) {
        cudaFree(p);
        return NULL;
    }
    return p;
}

static void cuda_buf_free(struct moe_backend *be, void *p)
{
    if (!p)
        return;
    cuda_of(be)->cnt.syncs++;
    cuda_check(be, cudaStreamSynchronize(cuda_of(be)->stream), "buf_free: cudaStreamSynchronize");
    cuda_check(be, cudaFree(p), "cudaFree");
}

/* Page-locked host memory: an upload from it is one DMA, no staging copy in
 * the driver. cudaFreeHost waits for copies that use it. */
static void *cuda_host_alloc(struct moe_backend *be, size_t bytes)
{
    void *p = NULL;
    if (cudaMallocHost(&p, bytes ? bytes : 1) != cudaSuccess) {
        (void)cudaGetLastError(); /* not sticky: the caller reports it */
        return NULL;
    }
    return p;
}

static void cuda_host_free(struct moe_backend *be, void *p)
{
    if (p)
        cuda_check(be, cudaFreeHost(p), "cudaFreeHost");
}

static void cuda_buf_upload(struct moe_backend *be, void *dst, const void *src_host, size_t bytes)
{
    if (!bytes)
        return;
    cudaStream_t s = cuda_of(be)->stream;
    struct moe_backend_counters *k = &cuda_of(be)->cnt;
    k->uploads++;
    k->upload_bytes += bytes;
    k->syncs++;
    cuda_check(be, cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, s),
               "buf_upload: cudaMemcpyAsync");
    cuda_check(be, cudaStreamSynchronize(s), "buf_upload: cudaStreamSynchronize");
}

static void cuda_buf_upload_async(struct moe_backend *be, void *dst, const void *src_host,
                                  size_t bytes)
{
    if (!bytes)
        return;
    struct moe_backend_counters *k = &cuda_of(be)->cnt;
    k->uploads++;
    k->upload_bytes += bytes;
    cuda_check(be,
               cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, cuda_of(be)->stream),
               "buf_upload_async: cudaMemcpyAsync");
}

static void cuda_buf_download(struct moe_backend *be, void *dst_host, const void *src, size_t bytes)
{
    if (!bytes)
        return;
    cudaStream_t s = cuda_of(be)->stream;
    struct moe_backend_counters *k = &cuda_of(be)->cnt;
    k->downloads++;
    k->download_bytes += bytes;
    k->syncs++;
    cuda_check(be, cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, s),
               "buf_download: cudaMemcpyAsync");
    cuda_check(be, cudaStreamSynchronize(s), "buf_download: cudaStreamSynchronize");
}

static void cuda_buf_copy(struct moe_backend *be, void *dst, const void *src, size_t bytes)
{
    if (bytes)
        cuda_check(be,
                   cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda_of(be)->stream),
                   "buf_copy: cudaMemcpyAsync");
}

static void cuda_synchronize(struct moe_backend *be)
{
    cuda_of(be)->cnt.syncs++;
    cuda_check(be, cudaStreamSynchronize(cuda_of(be)->stream), "synchronize");
}

static void cuda_op_matmul(struct moe_backend *be, const struct moe_matmul_params *p)
{
    cuda_of(be)->cnt.ops++;
    const char *why = moe_cuda_matmul_unsupported(p);
    if (why) {
        cuda_fail(be, (int)cudaErrorNotSupported,
                  "matmul: %s (n_tok %d, n_in %d, n_out %d, ldw %lld, dtype %s)", why, p->n_tok,
                  p->n_in, p->n_out, (long long)p->ldw, moe_dtype_name(p->w_dtype));
        return;
    }
    struct cuda_backend *cb = cuda_of(be);
    struct moe_matmul_params q = *p;
    q.fast = p->fast && cb->fast_gemm;
    size_t need = moe_cuda_matmul_scratch_bytes(&q);
    void *scratch = need ? scratch_reserve(be, need, "matmul") : NULL;
    if (need && !scratch)
        return;
    int blas_status = 0;
    cudaError_t e =
        moe_cuda_matmul(cb->blas, &q, scratch, cb->scratch_cap, cb->stream, &blas_status);
    if (blas_status)
        cuda_fail(be, (int)e, "matmul: cuBLAS status %d (n_tok %d, n_in %d, n_out %d, dtype %s)",
                  blas_status, p->n_tok, p->n_in, p->n_out, moe_dtype_name(p->w_dtype));
    else
        cuda_check(be, e, "matmul");
}

static void cuda_op_rmsnorm(struct moe_backend *be, const float *x, const float *w, float *y,
                            int n_rows, int dim, float eps)
{
    cuda_of(be)->cnt.ops++;
    cuda_check(be, moe_cuda_rmsnorm(x, w, y, n_rows, dim, eps, cuda_of(be)->stream), "rmsnorm");
}

static void cuda_op_add_rmsnorm(struct moe_backend *be, float *x, const float *r, const float *w,
                                float *y, int n_rows, int dim, float eps)
{
    cuda_of(be)->cnt.ops++;
    cuda_check(be, moe_cuda_add_rmsnorm(x, r, w, y, n_rows, dim, eps, cuda_of(be)->stream),
               "add_rmsnorm");
}

static void cuda_op_rope_kv_write(struct moe_backend *be, const struct moe_rope_kv_params *p)
{
    cuda_of(be)->cnt.ops++;
    const char *why = moe_cuda_rope_kv_unsupported(p);
    if (why) {
        cuda_fail(be, (int)cudaErrorNotSupported,
                  "rope_kv_write: %s (d_head %d, n_head %d, n_kv_head %d, kv dtype %s)", why,
                  p->d_head, p->n_head, p->n_kv_head, moe_dtype_name(p->kv_dtype));
        return;
    }
    cuda_check(be, moe_cuda_rope_kv_write(p, cuda_of(be)->stream), "rope_kv_write");
}

static void cuda_op_rope(struct moe_backend *be, float *x, const int32_t *pos, int n_tok,
                         int n_heads, int d_head, const float *inv_freq, float scale)
{
    cuda_of(be)->cnt.ops++;
    if (d_head <= 0 || d_head % 2 || d_head > MOE_CUDA_ROPE_MAX_DHEAD) {
        cuda_fail(be, (int)cudaErrorNotSupported,
                  "rope: d_head %d not supported (even, at most %d)", d_head,
                  MOE_CUDA_ROPE_MAX_DHEAD);
        return;
    }
    cuda_check(be,
               moe_cuda_rope(x, pos, n_tok, n_heads, d_head, inv_freq, scale, cuda_of(be)->stream),
               "rope");
}

static void cuda_op_kv_write(struct moe_backend *be, const float *k, const float *v,
                             const int32_t *slots, int n_tok, int kv_dim, void *k_cache,
                             void *v_cache, enum moe_dtype kv_dtype)
{
    cuda_of(be)->cnt.ops++;
    if (kv_dtype == MOE_DTYPE_BF16) {
        cuda_check(be,
                   moe_cuda_kv_write_bf16(k, v, slots, n_tok, kv_dim, k_cache, v_cache,
                                          cuda_of(be)->stream),
                   "kv_write");
        return;
    }
    if (kv_dtype != MOE_DTYPE_F32) {
        cuda_fail(be, (int)cudaErrorNotSupported,
                  "kv_write: KV cache dtype %s not supported (F32 or BF16)",
                  moe_dtype_name(kv_dtype));
        return;
    }
    cuda_check(be,
               moe_cuda_kv_write(k, v, slots, n_tok, kv_dim, k_cache, v_cache, cuda_of(be)->stream),
               "kv_write");
}

static void cuda_op_attention(struct moe_backend *be, const struct moe_attn_params *p)
{
    cuda_of(be)->cnt.ops++;
    char why[200];
    if (p->d_v && p->d_v != p->d_head) { /* latent attention */
        if (moe_cuda_attention_mla_unsupported(p, why, sizeof why)) {
            cuda_fail(be, (int)cudaErrorNotSupported, "attention: %s", why);
            return;
        }
        cuda_check(be, moe_cuda_attention_mla(p, cuda_of(be)->stream), "attention (latent)");
        return;
    }
    if (moe_cuda_attention_unsupported(p, why, sizeof why)) {
        cuda_fail(be, (int)cudaErrorNotSupported, "attention: %s", why);
        return;
    }
    struct cuda_backend *cb = cuda_of(be);
    size_t need = moe_cuda_attention_scratch_bytes(p);
    void *scratch = need ? scratch_reserve(be, need, "attention") : NULL;
    if (need && !scratch)
        return;
    cuda_check(be, moe_cuda_attention(p, scratch, cb->scratch_cap, cb->stream), "attention");
}

static void cuda_op_router_topk(struct moe_backend *be, const float *logits, int n_tok,
                                int n_expert, int top_k, bool renorm, int32_t *ids, float *weights)
{
    cuda_of(be)->cnt.ops++;
    if (n_expert < 1 || n_expert > MOE_CUDA_ROUTER_MAX_EXPERT || top_k < 1 || top_k > n_expert ||
        top_k > MOE_CUDA_ROUTER_MAX_TOPK) {
        cuda_fail(be, (int)cudaErrorNotSupported,
                  "router_topk: n_expert %d, top_k %d not supported (1 <= top_k <= n_expert, "
                  "n_expert <= %d, top_k <= %d)",
                  n_expert, top_k, MOE_CUDA_ROUTER_MAX_EXPERT, MOE_CUDA_ROUTER_MAX_TOPK);
        return;
    }
    cuda_check(be,
               moe_cuda_router_topk(logits, n_tok, n_expert, top_k, renorm, ids, weights,
                                    cuda_of(be)->stream),
               "router_topk");
}

static void cuda_op_router_topk_grouped(struct moe_backend *be,
                                        const struct moe_router_grouped_params *p)
{
    cuda_of(be)->cnt.ops++;
    char why[300];
    if (moe_cuda_router_grouped_unsupported(p, why, sizeof why)) {
        cuda_fail(be, (int)cudaErrorNotSupported, "%s", why);
        return;
    }
    cuda_check(be, moe_cuda_router_topk_grouped(p, cuda_of(be)->stream), "router_topk_grouped");
}

static void cuda_op_copy_cols(struct moe_backend *be, float *dst, int ld_dst, const float *src,
                              int ld_src, int n_rows, int n_cols)
{
    cuda_of(be)->cnt.ops++;
    cuda_check(be,
               moe_cuda_copy_cols(dst, ld_dst, src, ld_src, n_rows, n_cols, cuda_of(be)->stream),
               "copy_cols");
}

static void cuda_op_swiglu(struct moe_backend *be, const float *gate_up, float *out, int n_rows,
                           int dim)
{
    cuda_of(be)->cnt.ops++;
    cuda_check(be, moe_cuda_swiglu(gate_up, out, n_rows, dim, cuda_of(be)->stream), "swiglu");
}

static void cuda_op_gather_rows(struct moe_backend *be, const float *src, const int32_t *idx, int n,
                                int dim, float *dst)
{
    cuda_of(be)->cnt.ops++;
    cuda_check(be, moe_cuda_gather_rows(src, idx, n, dim, dst, cuda_of(be)->stream), "gather_rows");
}

static void cuda_op_scatter_add_rows(struct moe_backend *be, const float *src, const int32_t *idx,
                                     const float *scale, int n, int dim, float *dst)
{
    cuda_of(be)->cnt.ops++;
    cuda_check(be, moe_cuda_scatter_add_rows(src, idx, scale, n, dim, dst, cuda_of(be)->stream),
               "scatter_add_rows");
}

static void cuda_op_embed(struct moe_backend *be, const void *table, enum moe_dtype dtype,
                          const int32_t *ids, int n_tok, int dim, float *dst)
{
    cuda_of(be)->cnt.ops++;
    if (dtype != MOE_DTYPE_F32 && dtype != MOE_DTYPE_BF16 && dtype != MOE_DTYPE_F16) {
        cuda_fail(be, (int)cudaErrorNotSupported, "embed: dtype %d not supported", (int)dtype);
        return;
    }
    cuda_check(be, moe_cuda_embed(table, dtype, ids, n_tok, dim, dst, cuda_of(be)->stream),
               "embed");
}

static void cuda_op_add(struct moe_backend *be, float *y, const float *x, size_t n)
{
    cuda_of(be)->cnt.ops++;
    cuda_check(be, moe_cuda_add(y, x, n, cuda_of(be)->stream), "add");
}

static void cuda_op_sigmoid(struct moe_backend *be, float *x, size_t n)
{
    cuda_of(be)->cnt.ops++;
    cuda_check(be, moe_cuda_sigmoid(x, n, cuda_of(be)->stream), "sigmoid");
}

static enum moe_status status_of(int code)
{
    if (code == (int)cudaErrorNotSupported)
        return MOE_ERR_UNSUPPORTED;
    if (code == (int)cudaErrorInvalidValue)
        return MOE_ERR_INVALID;
    return MOE_ERR_INTERNAL;
}

static enum moe_status cuda_status(struct moe_backend *be, struct moe_error *err)
{
    struct cuda_backend *cb = cuda_of(be);
    int bad = 0;
    if (cb->bad && cudaMemcpy(&bad, cb->bad, sizeof bad, cudaMemcpyDeviceToHost) == cudaSuccess &&
        bad) {
        cudaMemset(cb->bad, 0, sizeof bad);
        cuda_fail(be, (int)cudaErrorInvalidValue,
                  "permute: an item named an expert or a replica's rank out of range");
    }
    char msg[256];
    int code = cuda_backend_take_error(be, msg, sizeof msg);
    if (!code)
        return MOE_OK;
    return moe_error_set(err, status_of(code), "cuda backend: %s", msg);
}

static void cuda_buf_zero(struct moe_backend *be, void *p, size_t bytes)
{
    if (bytes)
        cuda_check(be, cudaMemsetAsync(p, 0, bytes, cuda_of(be)->stream), "buf_zero");
}

static void cuda_op_grouped_matmul(struct moe_backend *be,
                                   const struct moe_grouped_matmul_params *p)
{
    cuda_of(be)->cnt.ops++;
    struct moe_error e = {0};
    enum moe_status st = moe_grouped_matmul_check(p, &e);
    if (st != MOE_OK) {
        cuda_fail(
            be, st == MOE_ERR_UNSUPPORTED ? (int)cudaErrorNotSupported : (int)cudaErrorInvalidValue,
            "%s", e.msg);
        return;
    }
    if (p->w_dtype == MOE_DTYPE_I8 || p->w_dtype == MOE_DTYPE_I4) {
        cuda_fail(be, (int)cudaErrorNotSupported,
                  "grouped_matmul: %s weights (the CUDA backend has no int8 or int4 kernels yet)",
                  moe_dtype_name(p->w_dtype));
        return;
    }
    const bool gemv = moe_cuda_grouped_gemv_fits(p);
    const char *why = !p->expert_offsets && !gemv ? moe_cuda_grouped_mma_unsupported(p) : NULL;
    if (why) {
        cuda_fail(be, (int)cudaErrorNotSupported,
                  "grouped_matmul: device-only offsets: %s (%s, n_rows %d, n_out %d, "
                  "max_expert_rows %d)",
                  why, moe_dtype_name(p->w_dtype), p->n_rows, p->n_out, p->max_expert_rows);
        return;
    }
    if (!gemv && p->expert_offsets) { /* prefill or f32: cuBLAS per expert */
        for (int ex = 0; ex < p->n_expert; ex++) {
            int r0 = p->expert_offsets[ex], cnt = p->expert_offsets[ex + 1] - r0;
            if (!cnt)
                continue;
            struct moe_matmul_params mp = {
                .x = p->x + (size_t)r0 * (size_t)p->n_in,
                .n_tok = cnt,
                .n_in = p->n_in,
                .w = p->w[ex],
                .w_dtype = p->w_dtype,
                .ldw = p->ldw,
                .n_out = p->n_out,
                .y = p->y + (size_t)r0 * (size_t)p->n_out,
                .accumulate = p->accumulate,
                .fast = p->fast,
            };
            cuda_op_matmul(be, &mp);
        }
        return;
    }
    struct cuda_backend *cb = cuda_of(be);
    const void *const *w_dev = p->w_dev;
    const int32_t *off_dev = p->expert_offsets_dev;
    if (!w_dev || !off_dev) { /* copy the host arrays: pointers first (8-byte aligned) */
        size_t wb = (size_t)p->n_expert * sizeof(void *);
        size_t ob = ((size_t)p->n_expert + 1) * sizeof(int32_t);
        char *meta = meta_reserve(be, wb + ob, "grouped_matmul");
        if (!meta)
            return;
        cudaError_t ce = cudaSuccess;
        if (!w_dev) {
            ce = cudaMemcpyAsync(meta, p->w, wb, cudaMemcpyHostToDevice, cb->stream);
            w_dev = (const void *const *)meta;
        }
        if (!off_dev && ce == cudaSuccess) {
            ce = cudaMemcpyAsync(meta + wb, p->expert_offsets, ob, cudaMemcpyHostToDevice,
                                 cb->stream);
            off_dev = (const int32_t *)(meta + wb);
        }
        if (ce != cudaSuccess) {
            cuda_check(be, ce, "grouped_matmul: cudaMemcpyAsync of the host arrays");
            return;
        }
    }
    if (!gemv) { /* device-only offsets past the GEMV's rows: the tensor-core kernel */
        cuda_check(be,
                   moe_cuda_grouped_mma(p, off_dev, w_dev, !(p->fast && cb->fast_gemm), cb->stream),
                   "grouped_matmul (tensor cores)");
        return;
    }
    cudaError_t ce = moe_cuda_grouped_gemv(p, off_dev, w_dev, cb->stream);
    if (ce == cudaErrorNotSupported)
        cuda_fail(be, (int)ce, "grouped_matmul: n_out %d too large for the grouped GEMV grid",
                  p->n_out);
    else
        cuda_check(be, ce, "grouped_matmul");
}

/* ---- graphs (kernels/backend.h: graph_launch, graph_begin, graph_end) ---- */

static struct cuda_graph *graph_find(struct cuda_backend *cb, uint64_t key)
{
    for (int i = 0; i < CUDA_GRAPH_SLOTS; i++) {
        struct cuda_graph *g = &cb->graphs[i];
        if (g->used && g->key == key)
            return g;
    }
    return NULL;
}

static void graph_drop(struct cuda_graph *g)
{
    if (g->exec)
        cudaGraphExecDestroy(g->exec);
    memset(g, 0, sizeof *g);
}

static bool cuda_graph_launch(struct moe_backend *be, uint64_t key)
{
    struct cuda_backend *cb = cuda_of(be);
    struct cuda_graph *g = cb->graphs_on && !cb->capturing ? graph_find(cb, key) : NULL;
    if (!g || !g->exec)
        return false;
    if (g->mem_gen != cb->mem_gen) { /* recorded over scratch that has moved since */
        graph_drop(g);
        return false;
    }
    cudaError_t e = cudaGraphLaunch(g->exec, cb->stream);
    if (e != cudaSuccess) { /* nothing queued: the caller runs the ops */
        (void)cudaGetLastError();
        fprintf(stderr, "moe: cuda backend: cudaGraphLaunch: %s; running the step's ops\n",
                cudaGetErrorString(e));
        g->failed = true;
        cudaGraphExecDestroy(g->exec);
        g->exec = NULL;
        return false;
    }
    cb->cnt.ops++;
    g->used = ++cb->tick;
    return true;
}

static bool cuda_graph_begin(struct moe_backend *be, uint64_t key)
{
    struct cuda_backend *cb = cuda_of(be);
    if (!cb->graphs_on || cb->capturing || atomic_load(&cb->first_error))
        return false;
    struct cuda_graph *g = graph_find(cb, key);
    if (!g) { /* first sight: remember the key, run eagerly (sizing the scratch) */
        g = &cb->graphs[0];
        for (int i = 1; i < CUDA_GRAPH_SLOTS; i++)
            if (cb->graphs[i].used < g->used)
                g = &cb->graphs[i];
        graph_drop(g);
        g->key = key;
        g->used = ++cb->tick;
        return false;
    }
    if (g->exec || g->failed)
        return false;
    cudaError_t e = cudaStreamBeginCapture(cb->stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        g->failed = true;
        return false;
    }
    cb->capturing = true;
    cb->capture_broken = false;
    cb->capture_slot = g;
    return true;
}

static enum moe_status cuda_graph_end(struct moe_backend *be, struct moe_error *err)
{
    struct cuda_backend *cb = cuda_of(be);
    if (!cb->capturing)
        return moe_error_set(err, MOE_ERR_INVALID, "graph_end without graph_begin");
    struct cuda_graph *g = cb->capture_slot;
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(cb->stream, &graph);
    cb->capturing = false;
    cb->capture_slot = NULL;
    const char *why = e != cudaSuccess                ? cudaGetErrorString(e)
                      : cb->capture_broken            ? "an op needed more scratch"
                      : atomic_load(&cb->first_error) ? cb->first_msg
                                                      : NULL;
    cudaGraphExec_t exec = NULL;
    if (!why && (e = cudaGraphInstantiate(&exec, graph, 0)) != cudaSuccess)
        why = cudaGetErrorString(e);
    if (graph)
        cudaGraphDestroy(graph);
    if (!why && (e = cudaGraphLaunch(exec, cb->stream)) != cudaSuccess)
        why = cudaGetErrorString(e);
    if (why) {
        /* the recording's own failures (an op that waited or copied inside
         * it) are not the step's: nothing ran, the caller reruns it */
        moe_error_set(err, MOE_ERR_UNSUPPORTED, "cuda graph of step %016llx not recorded: %s",
                      (unsigned long long)g->key, why);
        (void)cudaGetLastError();
        atomic_store(&cb->first_error, 0);
        if (exec)
            cudaGraphExecDestroy(exec);
        g->failed = true;
        return MOE_ERR_UNSUPPORTED;
    }
    cb->cnt.ops++;
    g->exec = exec;
    g->mem_gen = cb->mem_gen;
    g->used = ++cb->tick;
    return MOE_OK;
}

static void cuda_graph_reset(struct moe_backend *be)
{
    struct cuda_backend *cb = cuda_of(be);
    for (int i = 0; i < CUDA_GRAPH_SLOTS; i++)
        graph_drop(&cb->graphs[i]);
}

/* Device-only offsets go to the grouped GEMV up to MOE_CUDA_GEMV_MAX_TOK rows
 * an expert and to the tensor-core grouped GEMM past that (grouped_mma.cu):
 * bf16 weights, any row count. Device-routed MoE layers have not run on a GPU
 * yet, so they are opt-in (MOE_CUDA_DEVICE_ROUTING=1) until
 * bench/gpu_check.sh's `device routing` row passes; the op itself takes the
 * calls either way (tests/ops). */
static int cuda_grouped_device_rows(struct moe_backend *be, enum moe_dtype w_dtype)
{
    return cuda_of(be)->device_routing && w_dtype == MOE_DTYPE_BF16 ? INT_MAX : 0;
}

static void cuda_op_permute(struct moe_backend *be, const struct moe_permute_params *p)
{
    cuda_of(be)->cnt.ops++;
    const char *why = moe_cuda_permute_unsupported(p);
    if (why) {
        cuda_fail(be, (int)cudaErrorNotSupported, "permute: %s", why);
        return;
    }
    struct cuda_backend *cb = cuda_of(be);
    size_t n_items = (size_t)p->n_tok * (size_t)p->top_k;
    size_t n_keys = (size_t)p->n_dest * (size_t)p->n_expert;
    int32_t *keys = scratch_reserve(be, (n_items + n_keys) * sizeof(int32_t), "permute");
    if (!keys)
        return;
    cuda_check(be, moe_cuda_permute(p, keys, keys + n_items, cb->bad, cb->stream), "permute");
}

static void cuda_op_unpermute_combine(struct moe_backend *be, const float *rows,
                                      const float *weights, const int32_t *tok_rows, int n_tok,
                                      int top_k, int dim, float *y)
{
    cuda_of(be)->cnt.ops++;
    cuda_check(be,
               moe_cuda_unpermute_combine(rows, weights, tok_rows, n_tok, top_k, dim, y,
                                          cuda_of(be)->stream),
               "unpermute_combine");
}

static void cuda_op_argmax(struct moe_backend *be, const float *logits, int n, int vocab,
                           int32_t *out_ids)
{
    cuda_of(be)->cnt.ops++;
    cuda_check(be, moe_cuda_argmax(logits, n, vocab, out_ids, cuda_of(be)->stream), "argmax");
}

/* sample_top_p (temps NULL: every row `temperature`, `top_p`) and
 * sample_rows (each row its own temps[r], top_ps[r]). */
static void cuda_sample(struct moe_backend *be, const char *op, const float *logits, int n,
                        int vocab, float temperature, float top_p, const float *temps,
                        const float *top_ps, const double *uniform, int32_t *out_ids)
{
    cuda_of(be)->cnt.ops++;
    if (vocab < 1 || vocab > MOE_CUDA_SAMPLE_MAX_VOCAB) {
        cuda_fail(be, (int)cudaErrorNotSupported, "%s: vocab %d not supported (1 .. %d)", op, vocab,
                  MOE_CUDA_SAMPLE_MAX_VOCAB);
        return;
    }
    cuda_check(be,
               moe_cuda_sample(logits, n, vocab, temperature, top_p, temps, top_ps, uniform,
                               out_ids, cuda_of(be)->stream),
               op);
}

static void cuda_op_sample_top_p(struct moe_backend *be, const float *logits, int n, int vocab,
                                 float temperature, float top_p, const double *uniform,
                                 int32_t *out_ids)
{
    cuda_sample(be, "sample_top_p", logits, n, vocab, temperature, top_p, NULL, NULL, uniform,
                out_ids);
}

static void cuda_op_sample_rows(struct moe_backend *be, const float *logits, int n, int vocab,
                                const float *temperature, const float *top_p, const double *uniform,
                                int32_t *out_ids)
{
    cuda_sample(be, "sample_rows", logits, n, vocab, 0.0f, 1.0f, temperature, top_p, uniform,
                out_ids);
}

static void cuda_op_kv_gather_blocks(struct moe_backend *be, const float *k_cache,
                                     const float *v_cache, const int32_t *block_ids, int n,
                                     int block_size, int kv_dim, float *out)
{
    cuda_of(be)->cnt.ops++;
    cuda_check(be,
               moe_cuda_kv_gather_blocks(k_cache, v_cache, block_ids, n, block_size, kv_dim, out,
                                         cuda_of(be)->stream),
               "kv_gather_blocks");
}

static void cuda_op_kv_scatter_blocks(struct moe_backend *be, const float *in,
                                      const int32_t *block_ids, int n, int block_size, int kv_dim,
                                      float *k_cache, float *v_cache)
{
    cuda_of(be)->cnt.ops++;
    cuda_check(be,
               moe_cuda_kv_scatter_blocks(in, block_ids, n, block_size, kv_dim, k_cache, v_cache,
                                          cuda_of(be)->stream),
               "kv_scatter_blocks");
}

static void cuda_counters(struct moe_backend *be, struct moe_backend_counters *out)
{
    *out = cuda_of(be)->cnt;
}

static const struct moe_backend_ops cuda_ops = {
    .buf_alloc = cuda_buf_alloc,
    .buf_free = cuda_buf_free,
    .buf_upload = cuda_buf_upload,
    .buf_download = cuda_buf_download,
    .buf_copy = cuda_buf_copy,
    .synchronize = cuda_synchronize,
    .matmul = cuda_op_matmul,
    .rmsnorm = cuda_op_rmsnorm,
    .rope = cuda_op_rope,
    .kv_write = cuda_op_kv_write,
    .attention = cuda_op_attention,
    .router_topk = cuda_op_router_topk,
    .swiglu = cuda_op_swiglu,
    .gather_rows = cuda_op_gather_rows,
    .scatter_add_rows = cuda_op_scatter_add_rows,
    .embed = cuda_op_embed,
    .add = cuda_op_add,
    .status = cuda_status,
    .buf_zero = cuda_buf_zero,
    .grouped_matmul = cuda_op_grouped_matmul,
    .permute = cuda_op_permute,
    .counters = cuda_counters,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .buf_upload_async = cuda_buf_upload_async,
    .unpermute_combine = cuda_op_unpermute_combine,
    .argmax = cuda_op_argmax,
    .sample_top_p = cuda_op_sample_top_p,
    .sample_rows = cuda_op_sample_rows,
    .kv_gather_blocks = cuda_op_kv_gather_blocks,
    .kv_scatter_blocks = cuda_op_kv_scatter_blocks,
    .copy_cols = cuda_op_copy_cols,
    .router_topk_grouped = cuda_op_router_topk_grouped,
    .sigmoid = cuda_op_sigmoid,
    .grouped_device_rows = cuda_grouped_device_rows,
    .add_rmsnorm = cuda_op_add_rmsnorm,
    .rope_kv_write = cuda_op_rope_kv_write,
    .graph_launch = cuda_graph_launch,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .graph_reset = cuda_graph_reset,
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
        OP(buf_alloc),
        OP(buf_free),
        OP(buf_upload),
        OP(buf_download),
        OP(buf_copy),
        OP(synchronize),
        OP(matmul),
        OP(rmsnorm),
        OP(rope),
        OP(kv_write),
        OP(attention),
        OP(router_topk),
        OP(swiglu),
        OP(gather_rows),
        OP(scatter_add_rows),
        OP(embed),
        OP(add),
        OP(status),
        OP(buf_zero),
        OP(grouped_matmul),
        OP(permute),
        OP(unpermute_combine),
        OP(argmax),
        OP(sample_top_p),
        OP(sample_rows),
        OP(kv_gather_blocks),
        OP(kv_scatter_blocks),
        OP(add_rmsnorm),
        OP(rope_kv_write),
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

int moe_backend_cuda_device_count(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError(); /* not sticky: clear it for the next call */
        return 0;
    }
    return count > 0 ? count : 0;
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
    if (n_missing > 0)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "CUDA backend incomplete in this build: ops %s missing", missing);
    e = cudaSetDevice(ordinal);
    if (e != cudaSuccess)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED, "cudaSetDevice(%d): error %d, %s", ordinal,
                             (int)e, cudaGetErrorString(e));
    t_bound_ordinal = ordinal;
    e = moe_cuda_probe();
    if (e != cudaSuccess) {
        struct cudaDeviceProp prop;
        int major = 0, minor = 0;
        if (cudaGetDeviceProperties(&prop, ordinal) == cudaSuccess) {
            major = prop.major;
            minor = prop.minor;
        }
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "CUDA device %d (compute capability %d.%d) cannot run this build's "
                             "kernels (error %d, %s): rebuild with its CMAKE_CUDA_ARCHITECTURES",
                             ordinal, major, minor, (int)e, cudaGetErrorString(e));
    }
    struct cuda_backend *cb = calloc(1, sizeof(*cb));
    if (!cb)
        return moe_error_set(err, MOE_ERR_NOMEM, "cuda backend: out of memory");
    cb->ordinal = ordinal;
    enum moe_status st = MOE_OK;
    e = cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        cb->stream = NULL;
        st = moe_error_set(err, MOE_ERR_UNSUPPORTED, "cudaStreamCreate: error %d, %s", (int)e,
                           cudaGetErrorString(e));
        goto fail;
    }
    if ((st = moe_cublas_load(err)))
        goto fail;
    cublasStatus_t bs = cublasCreate(&cb->blas);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        cb->blas = NULL;
        st = moe_error_set(err, MOE_ERR_UNSUPPORTED, "cublasCreate: status %d", (int)bs);
        goto fail;
    }
    bs = cublasSetStream(cb->blas, cb->stream);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        st = moe_error_set(err, MOE_ERR_UNSUPPORTED, "cublasSetStream: status %d", (int)bs);
        goto fail;
    }
    if (cudaMalloc((void **)&cb->bad, sizeof *cb->bad) != cudaSuccess ||
        cudaMemset(cb->bad, 0, sizeof *cb->bad) != cudaSuccess) {
        cb->bad = NULL;
        st = moe_error_set(err, MOE_ERR_NOMEM, "cuda backend: cannot allocate a 4-byte flag");
        goto fail;
    }
    cb->ordinal = ordinal;
    atomic_init(&cb->first_error, 0);
    const char *graphs = getenv("MOE_CUDA_GRAPHS");
    cb->graphs_on = graphs && !strcmp(graphs, "1");
    const char *routing = getenv("MOE_CUDA_DEVICE_ROUTING");
    cb->device_routing = routing && !strcmp(routing, "1");
    const char *fast = getenv("MOE_CUDA_FAST_GEMM");
    cb->fast_gemm = fast && !strcmp(fast, "1");
    const char *fused = getenv("MOE_CUDA_FUSED_OPS");
    cb->fused_ops = fused && !strcmp(fused, "1");
    cb->base.name = "cuda";
    cb->base.device = MOE_DEVICE_CUDA;
    cb->ops = cuda_ops;
    if (!cb->graphs_on) {
        cb->ops.graph_launch = NULL;
        cb->ops.graph_begin = NULL;
        cb->ops.graph_end = NULL;
        cb->ops.graph_reset = NULL;
    }
    if (!cb->fused_ops) { /* not yet run on a GPU: the model issues the separate ops */
        cb->ops.add_rmsnorm = NULL;
        cb->ops.rope_kv_write = NULL;
    }
    cb->base.ops = &cb->ops;
    cb->base.ctx = cb;
    cb->base.ordinal = ordinal;
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, ordinal) == cudaSuccess)
        snprintf(cb->base.label, sizeof cb->base.label, "cuda:%d (%.64s, %.1f GiB, sm_%d%d)",
                 ordinal, prop.name, (double)prop.totalGlobalMem / (1 << 30), prop.major,
                 prop.minor);
    else
        snprintf(cb->base.label, sizeof cb->base.label, "cuda:%d", ordinal);
    *out = &cb->base;
    return MOE_OK;
fail:
    if (cb->bad)
        cudaFree(cb->bad);
    if (cb->blas)
        cublasDestroy(cb->blas);
    if (cb->stream)
        cudaStreamDestroy(cb->stream);
    free(cb);
    return st;
}

void cuda_backend_destroy(struct moe_backend *be)
{
    if (!be)
        return;
    struct cuda_backend *cb = cuda_of(be);
    cudaStreamSynchronize(cb->stream);
    cuda_graph_reset(be);
    cublasDestroy(cb->blas);
    cudaFree(cb->scratch);
    cudaFree(cb->meta);
    cudaFree(cb->bad);
    cudaStreamDestroy(cb->stream);
    free(cb);
}
