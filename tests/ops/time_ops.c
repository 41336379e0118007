/* Times the MoE ops added for the GPU path on one backend (CUDA by default):
 * the grouped expert GEMM against the per-expert matmul loop the model runs
 * now, on the benchmark model's expert shapes (d_model 1024, d_ff 2816, 8
 * experts, top-2, bf16), and argmax / sample_top_p on vocabulary-sized rows.
 * Not a test: it prints microseconds per call (mean of `iters` calls after
 * one warm-up, with synchronize around the timed loop).
 *
 * Usage: time_ops [--cpu]      (exit 77 when no GPU is usable without --cpu) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "backend.h"
#include "testlib.h" /* test_rng only: time_ops does not link testlib.c */

static struct test_rng g_rng = {88172645463325252ull};

static void *upload(struct moe_backend *be, const void *host, size_t bytes)
{
    void *d = be->ops->buf_alloc(be, bytes ? bytes : 1);
    if (!d) {
        fprintf(stderr, "time_ops: cannot allocate %zu bytes\n", bytes);
        exit(1);
    }
    if (host)
        be->ops->buf_upload(be, d, host, bytes);
    return d;
}

#define N_EXPERT 8
#define TOP_K 2
#define D_MODEL 1024
#define D_FF 2816

/* One expert FFN's two matmuls (gate_up: 2*D_FF x D_MODEL, down: D_MODEL x
 * D_FF) for n_tok tokens: grouped with host offsets, the per-expert loop,
 * and grouped with device-only offsets (a device-routed layer's call: the
 * GEMV up to 8 rows an expert, CUDA's tensor-core grouped GEMM past that),
 * exact (x split hi + lo on tensor cores) and fast (bf16 x). */
static void time_experts(struct moe_backend *be, int n_tok, int iters)
{
    int n_rows = n_tok * TOP_K;
    int32_t off[N_EXPERT + 1] = {0}, cnt[N_EXPERT] = {0};
    for (int i = 0; i < n_rows; i++)
        cnt[test_rng_u32(&g_rng) % N_EXPERT]++;
    int touched = 0;
    for (int e = 0; e < N_EXPERT; e++) {
        off[e + 1] = off[e] + cnt[e];
        touched += cnt[e] > 0;
    }
    size_t wgu = (size_t)2 * D_FF * D_MODEL, wdn = (size_t)D_MODEL * D_FF;
    uint16_t *hw = malloc((wgu + wdn) * 2);
    for (size_t i = 0; i < wgu + wdn; i++)
        hw[i] = (uint16_t)(0x3c00u + (test_rng_u32(&g_rng) & 0xffu)); /* small bf16 values */
    const void *gu[N_EXPERT], *dn[N_EXPERT];
    void *dev_w[N_EXPERT];
    for (int e = 0; e < N_EXPERT; e++) {
        dev_w[e] = upload(be, hw, (wgu + wdn) * 2);
        gu[e] = dev_w[e];
        dn[e] = (const char *)dev_w[e] + wgu * 2;
    }
    float *x = upload(be, NULL, (size_t)n_rows * D_MODEL * 4);
    float *h = upload(be, NULL, (size_t)n_rows * 2 * D_FF * 4);
    float *y = upload(be, NULL, (size_t)n_rows * D_MODEL * 4);
    int32_t *d_off = upload(be, off, sizeof off);
    const void **d_gu = upload(be, gu, sizeof gu), **d_dn = upload(be, dn, sizeof dn);
    struct moe_grouped_matmul_params g1 = {
        .x = x,
        .n_rows = n_rows,
        .n_in = D_MODEL,
        .n_out = 2 * D_FF,
        .n_expert = N_EXPERT,
        .expert_offsets = off,
        .expert_offsets_dev = d_off,
        .w = gu,
        .w_dev = d_gu,
        .w_dtype = MOE_DTYPE_BF16,
        .ldw = D_MODEL,
        .y = h,
    };
    struct moe_grouped_matmul_params g2 = g1;
    g2.x = h; /* the first D_FF columns stand in for swiglu's output: same traffic */
    g2.n_in = D_FF;
    g2.n_out = D_MODEL;
    g2.w = dn;
    g2.w_dev = d_dn;
    g2.ldw = D_FF;
    g2.y = y;
    int max_rows = 0;
    for (int e = 0; e < N_EXPERT; e++)
        max_rows = cnt[e] > max_rows ? cnt[e] : max_rows;
    struct moe_grouped_matmul_params d1 = g1, d2 = g2;
    d1.expert_offsets = d2.expert_offsets = NULL;
    d1.max_expert_rows = d2.max_expert_rows = max_rows;
    struct moe_grouped_matmul_params f1 = d1, f2 = d2;
    f1.fast = f2.fast = true;
    double t[4] = {0};
    for (int pass = 0; pass < 2; pass++) {
        for (int variant = 0; variant < 4; variant++) {
            int n_it = pass ? iters : 1;
            be->ops->synchronize(be);
            double t0 = moe_now();
            for (int it = 0; it < n_it; it++) {
                if (variant != 1) {
                    be->ops->grouped_matmul(be, variant == 0 ? &g1 : variant == 2 ? &d1 : &f1);
                    be->ops->grouped_matmul(be, variant == 0 ? &g2 : variant == 2 ? &d2 : &f2);
                    continue;
                }
                for (int e = 0; e < N_EXPERT; e++) {
                    if (!cnt[e])
                        continue;
                    struct moe_matmul_params a = {
                        .x = x + (size_t)off[e] * D_MODEL,
                        .n_tok = cnt[e],
                        .n_in = D_MODEL,
                        .w = gu[e],
                        .w_dtype = MOE_DTYPE_BF16,
                        .ldw = D_MODEL,
                        .n_out = 2 * D_FF,
                        .y = h + (size_t)off[e] * 2 * D_FF,
                    };
                    be->ops->matmul(be, &a);
                    struct moe_matmul_params b = {
                        .x = h + (size_t)off[e] * D_FF,
                        .n_tok = cnt[e],
                        .n_in = D_FF,
                        .w = dn[e],
                        .w_dtype = MOE_DTYPE_BF16,
                        .ldw = D_FF,
                        .n_out = D_MODEL,
                        .y = y + (size_t)off[e] * D_MODEL,
                    };
                    be->ops->matmul(be, &b);
                }
            }
            be->ops->synchronize(be);
            if (pass)
                t[variant] = (moe_now() - t0) / n_it;
        }
    }
    double gb = (double)touched * (double)(wgu + wdn) * 2 / 1e9;
    printf("experts  n_tok %4d (%d rows, %d experts, <= %d an expert): grouped %8.1f us (%6.0f "
           "GB/s of weights), per-expert loop %8.1f us (%6.0f GB/s), device offsets %8.1f us "
           "(%6.0f GB/s), device offsets fast %8.1f us (%6.0f GB/s)\n",
           n_tok, n_rows, touched, max_rows, t[0] * 1e6, gb / t[0], t[1] * 1e6, gb / t[1],
           t[2] * 1e6, gb / t[2], t[3] * 1e6, gb / t[3]);
    struct moe_error err = {0};
    if (be->ops->status(be, &err) != MOE_OK)
        printf("  error: %s\n", err.msg);
    for (int e = 0; e < N_EXPERT; e++)
        be->ops->buf_free(be, dev_w[e]);
    be->ops->buf_free(be, x);
    be->ops->buf_free(be, h);
    be->ops->buf_free(be, y);
    be->ops->buf_free(be, d_off);
    be->ops->buf_free(be, (void *)d_gu);
    be->ops->buf_free(be, (void *)d_dn);
    free(hw);
}

static void time_sampling(struct moe_backend *be, int n, int vocab, int iters)
{
    size_t nl = (size_t)n * vocab;
    float *hl = malloc(nl * 4);
    double *hu = malloc((size_t)n * 8);
    for (size_t i = 0; i < nl; i++)
        hl[i] = (float)(test_rng_u32(&g_rng) % 20000) / 1000.0f;
    for (int i = 0; i < n; i++)
        hu[i] = (double)test_rng_u32(&g_rng) / 4294967296.0;
    float *l = upload(be, hl, nl * 4);
    double *u = upload(be, hu, (size_t)n * 8);
    int32_t *ids = upload(be, NULL, (size_t)n * 4);
    double t[3];
    for (int v = 0; v < 3; v++) {
        for (int pass = 0; pass < 2; pass++) {
            int n_it = pass ? iters : 1;
            be->ops->synchronize(be);
            double t0 = moe_now();
            for (int it = 0; it < n_it; it++) {
                if (v == 0)
                    be->ops->argmax(be, l, n, vocab, ids);
                else
                    be->ops->sample_top_p(be, l, n, vocab, 0.8f, v == 1 ? 0.0f : 0.9f, u, ids);
            }
            be->ops->synchronize(be);
            t[v] = (moe_now() - t0) / n_it;
        }
    }
    printf("sampling n %3d vocab %6d: argmax %8.1f us, temperature only %8.1f us, top-p 0.9 "
           "%8.1f us\n",
           n, vocab, t[0] * 1e6, t[1] * 1e6, t[2] * 1e6);
    be->ops->buf_free(be, l);
    be->ops->buf_free(be, u);
    be->ops->buf_free(be, ids);
    free(hl);
    free(hu);
}

int main(int argc, char **argv)
{
    bool cpu = argc > 1 && strcmp(argv[1], "--cpu") == 0;
    setenv("MOE_CUDA_FAST_GEMM", "1", 1); /* the fast variant's calls ask for it */
    struct moe_backend *be = NULL;
    struct moe_error err = {0};
    enum moe_status st =
        cpu ? moe_backend_cpu_create(0, &be, &err) : moe_backend_cuda_create(0, &be, &err);
    if (st != MOE_OK) {
        printf("time_ops: skipped: %s\n", err.msg);
        return 77;
    }
    int iters = cpu ? 2 : 50;
    static const int toks[] = {1, 8, 64, 512, 2048};
    for (int i = 0; i < (cpu ? 3 : 5); i++)
        time_experts(be, toks[i], iters);
    time_sampling(be, 1, 32000, iters);
    time_sampling(be, 64, 32000, iters);
    time_sampling(be, 64, 151936, cpu ? 1 : iters);
    moe_backend_destroy(be);
    return 0;
}
