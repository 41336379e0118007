/* Every backend op on the CPU backend (the reference) and on the CUDA backend,
 * on the same random inputs, compared by normalised mean squared error
 *   nmse = sum (cuda - cpu)^2 / sum cpu^2
 * against a per-case threshold (0 means bit-exact). Integer outputs (router
 * ids) must match exactly. One table of cases below: adding an op or a shape
 * is adding a line. A second table holds shapes the CUDA kernels do not
 * support: each must record an error in the backend (fail loudly), never
 * compute.
 *
 * Without a usable GPU every case is printed as skipped and the program exits
 * 77, so CTest reports SKIPPED, never passed.
 *
 * Usage: test_ops [--cpu-vs-cpu] [FILTER]
 *   FILTER        runs the cases whose op name contains FILTER
 *   --cpu-vs-cpu  checks the harness itself where there is no GPU: the second
 *                 backend is another CPU backend (1 thread); only the refusals
 *                 every backend makes are run */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "testlib.h"

/* ---- deterministic inputs ---- */

static struct test_rng g_rng; /* seeded per case (test_rng_seed) */

static void fill_floats(float *p, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++)
        p[i] = scale * test_rng_float(&g_rng);
}

/* Random permutation of 0..n-1 into p. */
static void shuffle_ids(int32_t *p, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = i;
    for (int i = n - 1; i > 0; i--) {
        int j = test_rng_int(&g_rng, 0, i);
        int32_t t = p[i];
        p[i] = p[j];
        p[j] = t;
    }
}

/* ---- one run of a case on one backend ---- */

#define MAX_BUFS 16 /* per run of a case */

struct run {
    struct moe_backend *be;
    bool ref; /* the reference (CPU) run of the case: fast cases run it exact */
    void *dev[MAX_BUFS];
    int n_dev;
    /* outputs, downloaded to the host */
    float *out;
    size_t n_out;
    int32_t *ids;
    size_t n_ids;
};

/* Device (or CPU) buffer holding a copy of host[bytes]; freed by run_end. */
static void *run_buf(struct run *r, const void *host, size_t bytes)
{
    MOE_ASSERT(r->n_dev < MAX_BUFS);
    void *d = r->be->ops->buf_alloc(r->be, bytes);
    MOE_ASSERT(d);
    if (host)
        r->be->ops->buf_upload(r->be, d, host, bytes);
    r->dev[r->n_dev++] = d;
    return d;
}

static void run_get_floats(struct run *r, const float *dev, size_t n)
{
    r->out = calloc(1, (n ? n : 1) * sizeof(float));
    r->n_out = n;
    r->be->ops->synchronize(r->be);
    r->be->ops->buf_download(r->be, r->out, dev, n * sizeof(float));
}

/* n bf16 values from the device, widened (exactly) to r->out. */
static void run_get_bf16(struct run *r, const uint16_t *dev, size_t n)
{
    uint16_t *h = calloc(1, (n ? n : 1) * sizeof *h);
    r->out = calloc(1, (n ? n : 1) * sizeof(float));
    r->n_out = n;
    r->be->ops->synchronize(r->be);
    r->be->ops->buf_download(r->be, h, dev, n * sizeof *h);
    for (size_t i = 0; i < n; i++)
        r->out[i] = moe_bf16_to_f32(h[i]);
    free(h);
}

static void run_get_ids(struct run *r, const int32_t *dev, size_t n)
{
    r->ids = calloc(1, (n ? n : 1) * sizeof(int32_t));
    r->n_ids = n;
    r->be->ops->buf_download(r->be, r->ids, dev, n * sizeof(int32_t));
}

static void run_end(struct run *r)
{
    for (int i = 0; i < r->n_dev; i++)
        r->be->ops->buf_free(r->be, r->dev[i]);
    free(r->out);
    free(r->ids);
    memset(r, 0, sizeof(*r));
}

/* ---- the cases ---- */

struct op_case;
typedef void (*op_run_fn)(struct run *r, const struct op_case *c);

struct op_case {
    const char *op;
    op_run_fn run;
    int a[7];   /* shape parameters, meaning per op (see each run_* function) */
    double tol; /* nmse threshold; 0: bit-exact */
};

/* Fast cases (moe_matmul_params.fast): the reference run computes exactly
 * and the other run fast. FAST_ROUNDED: x is rounded to bf16 first, so
 * rounding it again changes nothing and the two differ only by summation
 * order (and, on a CPU with AVX512-FP16, by its fp16 lane sums: hence
 * FAST_TOL); FAST_DRAWN: x as drawn, the fast run's own rounding within the
 * same bound (bf16 rounding of x alone gives an nmse of ~1.3e-6). */
enum { FAST_OFF, FAST_ROUNDED, FAST_DRAWN };
#define FAST_TOL 1e-5

static void round_to_bf16(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = moe_bf16_to_f32(moe_f32_to_bf16(x[i]));
}

/* matmul: a = {n_tok, n_in, n_out, ldw - n_in, bf16, accumulate, fast (FAST_*)} */
static void run_matmul(struct run *r, const struct op_case *c)
{
    int n_tok = c->a[0], n_in = c->a[1], n_out = c->a[2];
    int64_t ldw = n_in + c->a[3];
    bool bf16 = c->a[4], acc = c->a[5];
    size_t nw = (size_t)n_out * (size_t)ldw, nx = (size_t)n_tok * n_in, ny = (size_t)n_tok * n_out;
    float *x = calloc(1, (nx + 1) * sizeof(float)), *wf = calloc(1, (nw + 1) * sizeof(float));
    float *y = calloc(1, (ny + 1) * sizeof(float));
    uint16_t *wb = calloc(1, (nw + 1) * sizeof(uint16_t));
    fill_floats(x, nx, 1.0f);
    if (c->a[6] == FAST_ROUNDED)
        round_to_bf16(x, nx);
    fill_floats(wf, nw, 0.1f);
    fill_floats(y, ny, 1.0f);
    for (size_t i = 0; i < nw; i++)
        wb[i] = moe_f32_to_bf16(wf[i]);
    struct moe_matmul_params p = {
        .x = run_buf(r, x, nx * sizeof(float)),
        .n_tok = n_tok,
        .n_in = n_in,
        .w = bf16 ? run_buf(r, wb, nw * 2) : run_buf(r, wf, nw * 4),
        .w_dtype = bf16 ? MOE_DTYPE_BF16 : MOE_DTYPE_F32,
        .ldw = ldw,
        .n_out = n_out,
        .y = run_buf(r, y, ny * sizeof(float)),
        .accumulate = acc,
        .fast = c->a[6] != FAST_OFF && !r->ref,
    };
    r->be->ops->matmul(r->be, &p);
    run_get_floats(r, p.y, ny);
    free(x);
    free(wf);
    free(wb);
    free(y);
}

/* rmsnorm: a = {n_rows, dim, in_place} */
static void run_rmsnorm(struct run *r, const struct op_case *c)
{
    int n_rows = c->a[0], dim = c->a[1];
    size_t n = (size_t)n_rows * dim;
    float *x = calloc(1, (n + 1) * sizeof(float)),
          *w = calloc(1, ((size_t)dim + 1) * sizeof(float));
    fill_floats(x, n, 3.0f);
    fill_floats(w, (size_t)dim, 1.0f);
    float *dx = run_buf(r, x, n * 4), *dw = run_buf(r, w, (size_t)dim * 4);
    float *dy = c->a[2] ? dx : run_buf(r, NULL, n * 4);
    r->be->ops->rmsnorm(r->be, dx, dw, dy, n_rows, dim, 1e-5f);
    run_get_floats(r, dy, n);
    free(x);
    free(w);
}

/* add_rmsnorm: a = {n_rows, dim}; x and y compared (one buffer, x then y) */
static void run_add_rmsnorm(struct run *r, const struct op_case *c)
{
    int n_rows = c->a[0], dim = c->a[1];
    size_t n = (size_t)n_rows * dim;
    float *x = calloc(1, (2 * n + 1) * 4), *res = calloc(1, (n + 1) * 4);
    float *w = calloc(1, ((size_t)dim + 1) * 4);
    fill_floats(x, n, 3.0f);
    fill_floats(res, n, 1.0f);
    fill_floats(w, (size_t)dim, 1.0f);
    float *dx = run_buf(r, x, (2 * n + 1) * 4);
    r->be->ops->add_rmsnorm(r->be, dx, run_buf(r, res, (n + 1) * 4), run_buf(r, w, (size_t)dim * 4),
                            dx + n, n_rows, dim, 1e-5f);
    run_get_floats(r, dx, 2 * n);
    free(x);
    free(res);
    free(w);
}

/* rope_kv_write: a = {n_tok, n_head, n_kv_head, d_head, biases, norms, bf16
 * cache}; q_out and both whole caches compared (slots scattered over a
 * cache with rows left unwritten, which must stay as they were). */
static void run_rope_kv(struct run *r, const struct op_case *c)
{
    const int n = c->a[0], H = c->a[1], KV = c->a[2], d = c->a[3];
    const bool bias = c->a[4], norm = c->a[5], bf16 = c->a[6];
    const int qd = H * d, kvd = KV * d, n_slot = 2 * n + 5;
    const size_t nq = (size_t)n * qd, nc = (size_t)n_slot * kvd, es = bf16 ? 2 : 4;
    float *qkv = calloc(1, ((size_t)n * (qd + 2 * kvd) + 1) * 4);
    float *b = calloc(1, ((size_t)qd + 2 * kvd + 1) * 4), *nw = calloc(1, (2 * (size_t)d + 1) * 4);
    float *inv = calloc(1, ((size_t)d / 2 + 1) * 4);
    int32_t *pos = calloc(1, ((size_t)n + 1) * 4), *slots = calloc(1, ((size_t)n + 1) * 4);
    int32_t *perm = calloc(1, ((size_t)n_slot + 1) * 4);
    float *fill = calloc(1, nc * 4 + 4);
    fill_floats(qkv, (size_t)n * (qd + 2 * kvd), 2.0f);
    fill_floats(b, (size_t)qd + 2 * kvd, 0.5f);
    fill_floats(nw, 2 * (size_t)d, 1.0f);
    fill_floats(fill, nc, 9.0f); /* the rows no token writes */
    if (bf16)                    /* the same values as bf16 bits, packed */
        for (size_t i = 0; i < nc; i++)
            ((uint16_t *)fill)[i] = moe_f32_to_bf16(fill[i]);
    shuffle_ids(perm, n_slot);
    for (int i = 0; i < d / 2; i++)
        inv[i] = 1.0f / powf(10000.0f, (float)(2 * i) / (float)d);
    for (int t = 0; t < n; t++) {
        pos[t] = test_rng_int(&g_rng, 0, 8000);
        slots[t] = perm[t];
    }
    float *q = run_buf(r, NULL, nq * 4 + 4);
    void *kc = run_buf(r, fill, nc * es + 1), *vc = run_buf(r, fill, nc * es + 1);
    float *db = run_buf(r, b, ((size_t)qd + 2 * kvd + 1) * 4);
    float *dn = run_buf(r, nw, (2 * (size_t)d + 1) * 4);
    struct moe_rope_kv_params p = {
        .qkv = run_buf(r, qkv, ((size_t)n * (qd + 2 * kvd) + 1) * 4),
        .n_tok = n,
        .n_head = H,
        .n_kv_head = KV,
        .d_head = d,
        .bq = bias ? db : NULL,
        .bk = bias ? db + qd : NULL,
        .bv = bias ? db + qd + kvd : NULL,
        .q_norm = norm ? dn : NULL,
        .k_norm = norm ? dn + d : NULL,
        .eps = 1e-6f,
        .pos = run_buf(r, pos, ((size_t)n + 1) * 4),
        .inv_freq = inv,
        .scale = 1.0f,
        .q_out = q,
        .slots = run_buf(r, slots, ((size_t)n + 1) * 4),
        .k_cache = kc,
        .v_cache = vc,
        .kv_dtype = bf16 ? MOE_DTYPE_BF16 : MOE_DTYPE_F32,
    };
    r->be->ops->rope_kv_write(r->be, &p);
    r->n_out = nq + 2 * nc;
    r->out = calloc(1, (r->n_out + 1) * 4);
    r->be->ops->synchronize(r->be);
    r->be->ops->buf_download(r->be, r->out, q, nq * 4);
    void *h = calloc(1, nc * es + 4);
    for (int i = 0; i < 2; i++) {
        r->be->ops->buf_download(r->be, h, i ? vc : kc, nc * es);
        float *o = r->out + nq + (size_t)i * nc;
        for (size_t e = 0; e < nc; e++)
            o[e] = bf16 ? moe_bf16_to_f32(((uint16_t *)h)[e]) : ((float *)h)[e];
    }
    free(h);
    free(qkv);
    free(b);
    free(nw);
    free(inv);
    free(pos);
    free(slots);
    free(perm);
    free(fill);
}

/* rope: a = {n_tok, n_heads, d_head, max_pos, theta (1e4 or 1e6)} */
static void run_rope(struct run *r, const struct op_case *c)
{
    int n_tok = c->a[0], n_heads = c->a[1], d_head = c->a[2];
    size_t n = (size_t)n_tok * n_heads * d_head;
    float *x = calloc(1, (n + 1) * sizeof(float));
    int32_t *pos = calloc(1, ((size_t)n_tok + 1) * sizeof(int32_t));
    fill_floats(x, n, 1.0f);
    for (int t = 0; t < n_tok; t++)
        pos[t] = test_rng_int(&g_rng, 0, c->a[3]);
    float *dx = run_buf(r, x, n * 4);
    float inv_freq[512];
    for (int i = 0; i < d_head / 2 && i < 512; i++)
        inv_freq[i] = 1.0f / powf((float)c->a[4], (float)(2 * i) / (float)d_head);
    /* a[5] != 0: a YaRN-style attention factor on cos and sin */
    r->be->ops->rope(r->be, dx, run_buf(r, pos, (size_t)n_tok * 4), n_tok, n_heads, d_head,
                     inv_freq, c->a[5] ? 1.0f + 0.1f * (float)c->a[5] : 1.0f);
    run_get_floats(r, dx, n);
    free(x);
    free(pos);
}

/* kv_write: a = {n_tok, kv_dim, n_slot, latent}; both whole caches are
 * compared; latent: K only (v and v_cache NULL), the V half of the cache
 * buffer must stay as it was. kv_write_bf16: the same into bf16 caches
 * (rounded alike: bit for bit). */
static void kv_write_case(struct run *r, const struct op_case *c, enum moe_dtype dt)
{
    int n_tok = c->a[0], kv_dim = c->a[1], n_slot = c->a[2], latent = c->a[3];
    size_t nt = (size_t)n_tok * kv_dim, nc = (size_t)n_slot * kv_dim;
    const size_t esz = dt == MOE_DTYPE_BF16 ? 2 : 4;
    float *k = calloc(1, (nt + 1) * 4), *v = calloc(1, (nt + 1) * 4),
          *cache = calloc(1, (2 * nc + 1) * 4);
    uint16_t *cache16 = calloc(1, (2 * nc + 1) * 2);
    int32_t *perm = calloc(1, ((size_t)n_slot + 1) * sizeof(int32_t));
    fill_floats(k, nt, 1.0f);
    fill_floats(v, nt, 1.0f);
    fill_floats(cache, 2 * nc, 1.0f);
    for (size_t i = 0; i < 2 * nc; i++)
        cache16[i] = moe_f32_to_bf16(cache[i]);
    shuffle_ids(perm, n_slot); /* distinct, scattered slots */
    char *dc = run_buf(r, dt == MOE_DTYPE_BF16 ? (void *)cache16 : (void *)cache, 2 * nc * esz);
    r->be->ops->kv_write(r->be, run_buf(r, k, nt * 4), latent ? NULL : run_buf(r, v, nt * 4),
                         run_buf(r, perm, (size_t)n_tok * 4), n_tok, kv_dim, dc,
                         latent ? NULL : dc + nc * esz, dt);
    if (dt == MOE_DTYPE_BF16)
        run_get_bf16(r, (const uint16_t *)dc, 2 * nc);
    else
        run_get_floats(r, (const float *)dc, 2 * nc);
    free(k);
    free(v);
    free(cache);
    free(cache16);
    free(perm);
}

static void run_kv_write(struct run *r, const struct op_case *c)
{
    kv_write_case(r, c, MOE_DTYPE_F32);
}

static void run_kv_write_bf16(struct run *r, const struct op_case *c)
{
    kv_write_case(r, c, MOE_DTYPE_BF16);
}

/* The sequences of an attention case: n_seq sequences of random lengths in
 * [1, max_len] over a cache with spare blocks, each sequence's block ids a
 * random, non-contiguous draw (unused table entries -1), and the tokens that
 * attend: mode 0 decode (one per sequence, at its last position), 1 prefill
 * (every position), 2 mixed (a random tail of new tokens after a cached
 * prefix). */
struct paged_batch {
    int n_block, max_blocks, n_tok;
    int32_t *table, *seq, *pos;
};

static void paged_batch_make(int n_seq, int max_len, int bs, int mode, struct paged_batch *pb)
{
    pb->max_blocks = (max_len + bs - 1) / bs;
    pb->n_block = n_seq * pb->max_blocks + 3; /* spare blocks: holes in the cache */
    int32_t *perm = calloc(1, (size_t)pb->n_block * sizeof(int32_t));
    pb->table = calloc(1, (size_t)n_seq * pb->max_blocks * sizeof(int32_t));
    int *len = calloc(1, (size_t)n_seq * sizeof(int)),
        *n_new = calloc(1, (size_t)n_seq * sizeof(int));
    shuffle_ids(perm, pb->n_block);
    pb->n_tok = 0;
    for (int s = 0; s < n_seq; s++) {
        len[s] = test_rng_int(&g_rng, 1, max_len);
        int used = (len[s] + bs - 1) / bs;
        for (int b = 0; b < pb->max_blocks; b++)
            pb->table[s * pb->max_blocks + b] = b < used ? perm[s * pb->max_blocks + b] : -1;
        n_new[s] = mode == 0 ? 1 : mode == 1 ? len[s] : test_rng_int(&g_rng, 1, len[s]);
        pb->n_tok += n_new[s];
    }
    pb->seq = calloc(1, (size_t)pb->n_tok * 4 + 4);
    pb->pos = calloc(1, (size_t)pb->n_tok * 4 + 4);
    for (int s = 0, t = 0; s < n_seq; s++)
        for (int i = 0; i < n_new[s]; i++, t++) {
            pb->seq[t] = s;
            pb->pos[t] = len[s] - n_new[s] + i; /* positions before are the cached prefix */
        }
    free(perm);
    free(len);
    free(n_new);
}

static void paged_batch_free(struct paged_batch *pb)
{
    free(pb->table);
    free(pb->seq);
    free(pb->pos);
}

/* attention: a = {n_seq, max_len, n_head, n_kv_head, d_head, block_size, mode}
 * (modes: paged_batch_make); attention_bf16: over bf16 caches (the same
 * random values rounded to bf16 on both backends). */
static void attention_case(struct run *r, const struct op_case *c, enum moe_dtype dt)
{
    int n_seq = c->a[0], n_head = c->a[2], n_kv = c->a[3], d = c->a[4], bs = c->a[5];
    struct paged_batch pb;
    paged_batch_make(n_seq, c->a[1], bs, c->a[6], &pb);
    size_t nc = (size_t)pb.n_block * bs * n_kv * d, nq = (size_t)pb.n_tok * n_head * d;
    float *q = calloc(1, (nq + 1) * 4), *kc = calloc(1, (nc + 1) * 4),
          *vc = calloc(1, (nc + 1) * 4);
    fill_floats(q, nq, 1.0f);
    fill_floats(kc, nc, 1.0f);
    fill_floats(vc, nc, 1.0f);
    const void *kh = kc, *vh = vc;
    size_t esz = 4;
    uint16_t *k16 = NULL, *v16 = NULL;
    if (dt == MOE_DTYPE_BF16) {
        k16 = calloc(1, (nc + 1) * 2);
        v16 = calloc(1, (nc + 1) * 2);
        for (size_t i = 0; i < nc; i++) {
            k16[i] = moe_f32_to_bf16(kc[i]);
            v16[i] = moe_f32_to_bf16(vc[i]);
        }
        kh = k16;
        vh = v16;
        esz = 2;
    }
    struct moe_attn_params p = {
        .q = run_buf(r, q, nq * 4),
        .out = run_buf(r, NULL, nq * 4),
        .k_cache = run_buf(r, kh, nc * esz),
        .v_cache = run_buf(r, vh, nc * esz),
        .kv_dtype = dt,
        .tok_seq = run_buf(r, pb.seq, (size_t)pb.n_tok * 4),
        .tok_pos = run_buf(r, pb.pos, (size_t)pb.n_tok * 4),
        .block_tables = run_buf(r, pb.table, (size_t)n_seq * pb.max_blocks * 4),
        .max_blocks = pb.max_blocks,
        .n_tok = pb.n_tok,
        .n_head = n_head,
        .n_kv_head = n_kv,
        .d_head = d,
        .block_size = bs,
        .scale = 1.0f / sqrtf((float)d),
    };
    r->be->ops->attention(r->be, &p);
    run_get_floats(r, p.out, nq);
    paged_batch_free(&pb);
    free(q);
    free(kc);
    free(vc);
    free(k16);
    free(v16);
}

static void run_attention(struct run *r, const struct op_case *c)
{
    attention_case(r, c, MOE_DTYPE_F32);
}

static void run_attention_bf16(struct run *r, const struct op_case *c)
{
    attention_case(r, c, MOE_DTYPE_BF16);
}

/* latent attention: a = {n_seq, max_len, n_head, d_head, d_v, block_size,
 * mode}: one KV head whose cache rows (d_head) are K and, in their first d_v
 * floats, V (DeepSeek-V3's absorbed MLA); modes as for attention. */
static void run_attention_mla(struct run *r, const struct op_case *c)
{
    int n_seq = c->a[0], n_head = c->a[2], d = c->a[3], dv = c->a[4], bs = c->a[5];
    struct paged_batch pb;
    paged_batch_make(n_seq, c->a[1], bs, c->a[6], &pb);
    size_t nc = (size_t)pb.n_block * bs * d, nq = (size_t)pb.n_tok * n_head * d,
           no = (size_t)pb.n_tok * n_head * dv;
    float *q = calloc(1, (nq + 1) * 4), *kc = calloc(1, (nc + 1) * 4);
    fill_floats(q, nq, 1.0f);
    fill_floats(kc, nc, 1.0f);
    void *cache = run_buf(r, kc, nc * 4);
    struct moe_attn_params p = {
        .q = run_buf(r, q, nq * 4),
        .out = run_buf(r, NULL, no * 4 + 4),
        .k_cache = cache,
        .v_cache = cache,
        .tok_seq = run_buf(r, pb.seq, (size_t)pb.n_tok * 4 + 4),
        .tok_pos = run_buf(r, pb.pos, (size_t)pb.n_tok * 4 + 4),
        .block_tables = run_buf(r, pb.table, (size_t)n_seq * pb.max_blocks * 4),
        .max_blocks = pb.max_blocks,
        .n_tok = pb.n_tok,
        .n_head = n_head,
        .n_kv_head = 1,
        .d_head = d,
        .block_size = bs,
        .scale = 1.0f / sqrtf((float)d),
        .d_v = dv,
    };
    r->be->ops->attention(r->be, &p);
    run_get_floats(r, p.out, no);
    paged_batch_free(&pb);
    free(q);
    free(kc);
}

/* grouped sigmoid routing: a = {n_tok, n_expert, n_group, topk_group, top_k,
 * renorm, mode}; mode 0: random logits and bias; 1: logits and bias from 3
 * values each (exact ties between experts and between groups: the lower id
 * must win); scale 2.5 (routed_scaling_factor). */
static void run_router_grouped(struct run *r, const struct op_case *c)
{
    int n_tok = c->a[0], n_e = c->a[1], k = c->a[4], mode = c->a[6];
    size_t n = (size_t)n_tok * n_e, nk = (size_t)n_tok * k;
    float *x = calloc(1, (n + 1) * 4), *bias = calloc(1, (size_t)n_e * 4);
    fill_floats(x, n, 4.0f);
    fill_floats(bias, (size_t)n_e, 0.5f);
    if (mode == 1) {
        for (size_t i = 0; i < n; i++)
            x[i] = (float)(test_rng_u32(&g_rng) % 3u) - 1.0f;
        for (int e = 0; e < n_e; e++)
            bias[e] = (float)(test_rng_u32(&g_rng) % 3u) * 0.25f;
    }
    struct moe_router_grouped_params p = {
        .logits = run_buf(r, x, n * 4 + 4),
        .bias = run_buf(r, bias, (size_t)n_e * 4),
        .n_tok = n_tok,
        .n_expert = n_e,
        .top_k = k,
        .n_group = c->a[2],
        .topk_group = c->a[3],
        .renorm = c->a[5],
        .scale = 2.5f,
        .ids = run_buf(r, NULL, (nk + 1) * 4),
        .weights = run_buf(r, NULL, (nk + 1) * 4),
    };
    r->be->ops->router_topk_grouped(r->be, &p);
    run_get_floats(r, p.weights, nk);
    run_get_ids(r, p.ids, nk);
    free(x);
    free(bias);
}

/* copy_cols: a = {n_rows, ld_dst, dst_col, ld_src, src_col, n_cols}; the
 * whole destination comes back (what lies outside the block must not move) */
static void run_copy_cols(struct run *r, const struct op_case *c)
{
    int rows = c->a[0], ld_dst = c->a[1], dcol = c->a[2], ld_src = c->a[3], scol = c->a[4];
    size_t nd = (size_t)rows * ld_dst, ns = (size_t)rows * ld_src;
    float *dst = calloc(1, (nd + 1) * 4), *src = calloc(1, (ns + 1) * 4);
    fill_floats(dst, nd, 1.0f);
    fill_floats(src, ns, 1.0f);
    float *dd = run_buf(r, dst, nd * 4 + 4);
    r->be->ops->copy_cols(r->be, dd + dcol, ld_dst,
                          (const float *)run_buf(r, src, ns * 4 + 4) + scol, ld_src, rows, c->a[5]);
    run_get_floats(r, dd, nd);
    free(dst);
    free(src);
}

/* router: a = {n_tok, n_expert, top_k, renorm, mode}; mode 0: random logits;
 * 1: logits from 3 values (many exact ties: the lower id must win); 2: one
 * expert far ahead for every token (it takes all tokens). */
static void run_router(struct run *r, const struct op_case *c)
{
    int n_tok = c->a[0], n_e = c->a[1], k = c->a[2], mode = c->a[4];
    size_t n = (size_t)n_tok * n_e, nk = (size_t)n_tok * k;
    float *x = calloc(1, (n + 1) * 4);
    fill_floats(x, n, 4.0f);
    if (mode == 1)
        for (size_t i = 0; i < n; i++)
            x[i] = (float)(test_rng_u32(&g_rng) % 3u) * 0.5f;
    if (mode == 2)
        for (int t = 0; t < n_tok; t++)
            x[(size_t)t * n_e + n_e / 3] = 50.0f;
    int32_t *ids = run_buf(r, NULL, (nk + 1) * 4);
    float *w = run_buf(r, NULL, (nk + 1) * 4);
    r->be->ops->router_topk(r->be, run_buf(r, x, n * 4), n_tok, n_e, k, c->a[3], ids, w);
    run_get_floats(r, w, nk);
    run_get_ids(r, ids, nk);
    free(x);
}

/* swiglu: a = {n_rows, dim} */
static void run_swiglu(struct run *r, const struct op_case *c)
{
    int n_rows = c->a[0], dim = c->a[1];
    size_t n = (size_t)n_rows * dim;
    float *gu = calloc(1, (2 * n + 1) * 4);
    fill_floats(gu, 2 * n, 6.0f);
    float *out = run_buf(r, NULL, (n + 1) * 4);
    r->be->ops->swiglu(r->be, run_buf(r, gu, 2 * n * 4), out, n_rows, dim);
    run_get_floats(r, out, n);
    free(gu);
}

/* gather_rows: a = {n, dim, n_src}; dst is prefilled, so n = 0 must leave it. */
static void run_gather(struct run *r, const struct op_case *c)
{
    int n = c->a[0], dim = c->a[1], n_src = c->a[2];
    size_t ns = (size_t)n_src * dim, nd = ((size_t)n + 1) * dim;
    float *src = calloc(1, (ns + 1) * 4), *dst = calloc(1, (nd + 1) * 4);
    int32_t *idx = calloc(1, ((size_t)n + 1) * 4);
    fill_floats(src, ns, 1.0f);
    fill_floats(dst, nd, 1.0f);
    for (int i = 0; i < n; i++)
        idx[i] = test_rng_int(&g_rng, 0, n_src - 1); /* repeats allowed */
    float *dd = run_buf(r, dst, nd * 4);
    r->be->ops->gather_rows(r->be, run_buf(r, src, ns * 4), run_buf(r, idx, ((size_t)n + 1) * 4), n,
                            dim, dd);
    run_get_floats(r, dd, nd);
    free(src);
    free(dst);
    free(idx);
}

/* scatter_add_rows: a = {n, dim, n_dst, no_scale}; distinct destination rows. */
static void run_scatter(struct run *r, const struct op_case *c)
{
    int n = c->a[0], dim = c->a[1], n_dst = c->a[2];
    MOE_ASSERT(n <= n_dst);
    size_t ns = ((size_t)n + 1) * dim, nd = (size_t)n_dst * dim;
    float *src = calloc(1, (ns + 1) * 4), *dst = calloc(1, (nd + 1) * 4);
    float *scale = calloc(1, ((size_t)n + 1) * 4);
    int32_t *perm = calloc(1, ((size_t)n_dst + 1) * 4);
    fill_floats(src, ns, 1.0f);
    fill_floats(dst, nd, 1.0f);
    fill_floats(scale, (size_t)n, 1.0f);
    shuffle_ids(perm, n_dst);
    float *dd = run_buf(r, dst, nd * 4);
    r->be->ops->scatter_add_rows(
        r->be, run_buf(r, src, ns * 4), run_buf(r, perm, ((size_t)n_dst + 1) * 4),
        c->a[3] ? NULL : run_buf(r, scale, ((size_t)n + 1) * 4), n, dim, dd);
    run_get_floats(r, dd, nd);
    free(src);
    free(dst);
    free(scale);
    free(perm);
}

/* embed: a = {n_tok, dim, n_vocab, dtype} */
static void run_embed(struct run *r, const struct op_case *c)
{
    int n_tok = c->a[0], dim = c->a[1], n_vocab = c->a[2];
    enum moe_dtype dt = (enum moe_dtype)c->a[3];
    size_t nt = (size_t)n_vocab * dim, es = moe_dtype_size(dt);
    float *tf = calloc(1, (nt + 1) * 4);
    uint16_t *th = calloc(1, (nt + 1) * 2);
    int32_t *ids = calloc(1, ((size_t)n_tok + 1) * 4);
    fill_floats(tf, nt, 2.0f);
    for (size_t i = 0; i < nt; i++) {
        uint32_t u = test_rng_u32(&g_rng);
        /* f16: any finite pattern, subnormals included; bf16: from the floats */
        th[i] = dt == MOE_DTYPE_F16 ? (uint16_t)(u & 0x7bffu) : moe_f32_to_bf16(tf[i]);
    }
    for (int t = 0; t < n_tok; t++)
        ids[t] = test_rng_int(&g_rng, 0, n_vocab - 1);
    const void *table = run_buf(r, dt == MOE_DTYPE_F32 ? (void *)tf : (void *)th, nt * es);
    float *dst = run_buf(r, NULL, ((size_t)n_tok * dim + 1) * 4);
    r->be->ops->embed(r->be, table, dt, run_buf(r, ids, ((size_t)n_tok + 1) * 4), n_tok, dim, dst);
    run_get_floats(r, dst, (size_t)n_tok * dim);
    free(tf);
    free(th);
    free(ids);
}

/* add: a = {n} */
static void run_add(struct run *r, const struct op_case *c)
{
    size_t n = (size_t)c->a[0];
    float *x = calloc(1, (n + 1) * 4), *y = calloc(1, (n + 1) * 4);
    fill_floats(x, n, 1.0f);
    fill_floats(y, n, 1.0f);
    float *dy = run_buf(r, y, (n + 1) * 4);
    r->be->ops->add(r->be, dy, run_buf(r, x, (n + 1) * 4), n);
    run_get_floats(r, dy, n);
    free(x);
    free(y);
}

/* sigmoid: a = {n}, values in [-12, 12] (both tails) */
static void run_sigmoid(struct run *r, const struct op_case *c)
{
    size_t n = (size_t)c->a[0];
    float *x = calloc(1, (n + 1) * 4);
    fill_floats(x, n, 12.0f);
    float *dx = run_buf(r, x, (n + 1) * 4);
    r->be->ops->sigmoid(r->be, dx, n);
    run_get_floats(r, dx, n);
    free(x);
}

/* grouped_matmul: a = {n_rows, n_expert, n_in, n_out, bf16, accumulate, mode}
 * mode 0: random expert sizes; 1: one expert takes every row; 2: every odd
 * expert empty and without weights (NULL), ldw = n_in + 3; 3: random, and
 * the device copies of the offsets and pointers left NULL (the backend
 * copies the host arrays); 4: an expert with rows and NULL weights (refused);
 * 5: random, device-only offsets (expert_offsets NULL, max_expert_rows the
 * largest expert's rows: the launch sized without reading the offsets, as
 * a device-routed MoE layer calls it); 6: as 5 with an expert without
 * weights (refused: device-only offsets need them all); fast (the reference
 * run exact, see FAST_*): 7: as 5, FAST_ROUNDED; 8: as 0, FAST_ROUNDED;
 * 9: as 5, FAST_DRAWN. */
static void run_grouped(struct run *r, const struct op_case *c)
{
    int n_rows = c->a[0], n_e = c->a[1], n_in = c->a[2], n_out = c->a[3], mode = c->a[6];
    bool bf16 = c->a[4], acc = c->a[5];
    int fast = mode == 7 || mode == 8 ? FAST_ROUNDED : mode == 9 ? FAST_DRAWN : FAST_OFF;
    bool device_only = mode == 5 || mode == 6 || mode == 7 || mode == 9;
    int64_t ldw = n_in + (mode == 2 ? 3 : 0);
    size_t nw = (size_t)n_e * n_out * (size_t)ldw, nx = (size_t)n_rows * n_in;
    size_t ny = (size_t)n_rows * n_out;
    float *x = calloc(1, (nx + 1) * 4), *wf = calloc(1, (nw + 1) * 4), *y = calloc(1, (ny + 1) * 4);
    uint16_t *wb = calloc(1, (nw + 1) * 2);
    int32_t *off = calloc((size_t)n_e + 1, sizeof *off), *cnt = calloc((size_t)n_e, sizeof *cnt);
    const void **w = calloc((size_t)n_e, sizeof *w);
    fill_floats(x, nx, 1.0f);
    if (fast == FAST_ROUNDED)
        round_to_bf16(x, nx);
    fill_floats(wf, nw, 0.1f);
    fill_floats(y, ny, 1.0f);
    for (size_t i = 0; i < nw; i++)
        wb[i] = moe_f32_to_bf16(wf[i]);
    int hot = test_rng_int(&g_rng, 0, n_e - 1);
    for (int i = 0; i < n_rows; i++) {
        int e = mode == 1 ? hot : test_rng_int(&g_rng, 0, n_e - 1);
        cnt[mode == 2 ? e & ~1 : e]++;
    }
    for (int e = 0; e < n_e; e++)
        off[e + 1] = off[e] + cnt[e];
    char *dw = run_buf(r, bf16 ? (void *)wb : (void *)wf, nw * (bf16 ? 2 : 4));
    for (int e = 0; e < n_e; e++)
        if (mode != 2 || cnt[e])
            w[e] = dw + (size_t)e * n_out * (size_t)ldw * (bf16 ? 2 : 4);
    for (int e = 0; e < n_e && mode == 4; e++)
        if (cnt[e]) { /* the first expert with rows loses its weights */
            w[e] = NULL;
            break;
        }
    int max_rows = 0;
    for (int e = 0; e < n_e; e++)
        max_rows = cnt[e] > max_rows ? cnt[e] : max_rows;
    if (mode == 6)
        w[n_e - 1] = NULL;
    struct moe_grouped_matmul_params p = {
        .x = run_buf(r, x, nx * 4),
        .n_rows = n_rows,
        .n_in = n_in,
        .n_out = n_out,
        .n_expert = n_e,
        .expert_offsets = off,
        .expert_offsets_dev = mode == 3 ? NULL : run_buf(r, off, ((size_t)n_e + 1) * 4),
        .w = w,
        .w_dev = mode == 3 ? NULL : run_buf(r, w, (size_t)n_e * sizeof *w),
        .w_dtype = bf16 ? MOE_DTYPE_BF16 : MOE_DTYPE_F32,
        .ldw = ldw,
        .y = run_buf(r, y, ny * 4),
        .accumulate = acc,
        .fast = fast != FAST_OFF && !r->ref,
    };
    if (device_only) {
        p.expert_offsets = NULL;
        p.max_expert_rows = max_rows;
    }
    r->be->ops->grouped_matmul(r->be, &p);
    run_get_floats(r, p.y, ny);
    free(x);
    free(wf);
    free(wb);
    free(y);
    free(off);
    free(cnt);
    free(w);
}

/* n_tok rows of top_k distinct expert ids in [0, n_e) into ids. */
static void random_topk_ids(int32_t *ids, int n_tok, int k, int n_e)
{
    for (int t = 0; t < n_tok; t++)
        for (int j = 0; j < k; j++) {
            int e, dup;
            do {
                e = test_rng_int(&g_rng, 0, n_e - 1);
                dup = 0;
                for (int i = 0; i < j; i++)
                    dup |= ids[t * k + i] == e;
            } while (dup);
            ids[t * k + j] = e;
        }
}

/* permute: a = {n_tok, top_k, n_expert, n_dest, replicated, token_base,
 * bad}. Distinct experts per token; with n_dest > 1 a placement table
 * (experts split over the ranks, every third expert also on the next rank
 * when `replicated`); `bad` puts an expert id out of range (a refusal). All
 * outputs are integers but item_w (weights moved, bit-exact). */
static void run_permute(struct run *r, const struct op_case *c)
{
    int n_tok = c->a[0], k = c->a[1], n_e = c->a[2], n_dest = c->a[3];
    size_t n_items = (size_t)n_tok * k, n_keys = (size_t)n_dest * n_e;
    int32_t *ids = calloc(n_items + 1, 4);
    float *w = calloc(n_items + 1, 4);
    random_topk_ids(ids, n_tok, k, n_e);
    if (c->a[6] && n_items)
        ids[n_items / 2] = n_e + 3;
    fill_floats(w, n_items, 1.0f);
    const int stride = 2;
    int32_t *ranks = calloc((size_t)n_e * stride, 4), *n_ranks = calloc((size_t)n_e, 4);
    for (int e = 0; e < n_e; e++) {
        ranks[e * stride] = (int)((long)e * n_dest / n_e);
        n_ranks[e] = 1;
        if (c->a[4] && e % 3 == 0 && n_dest > 1) {
            ranks[e * stride + 1] = (ranks[e * stride] + 1) % n_dest;
            n_ranks[e] = 2;
        }
    }
    size_t n_int = 3 * n_items + n_keys + 1;
    int32_t *out = run_buf(r, NULL, n_int * 4);
    float *dw = run_buf(r, NULL, (n_items + 1) * 4);
    struct moe_permute_params p = {
        .ids = run_buf(r, ids, (n_items + 1) * 4),
        .weights = run_buf(r, w, (n_items + 1) * 4),
        .n_tok = n_tok,
        .top_k = k,
        .n_expert = n_e,
        .n_dest = n_dest,
        .ranks = n_dest > 1 ? run_buf(r, ranks, (size_t)n_e * stride * 4) : NULL,
        .n_ranks = n_dest > 1 ? run_buf(r, n_ranks, (size_t)n_e * 4) : NULL,
        .rank_stride = stride,
        .token_base = c->a[5],
        .item_tok = out,
        .item_exp = out + n_items,
        .tok_rows = out + 2 * n_items,
        .offsets = out + 3 * n_items,
        .item_w = dw,
    };
    r->be->ops->permute(r->be, &p);
    run_get_floats(r, dw, n_items);
    run_get_ids(r, out, n_int);
    free(ids);
    free(w);
    free(ranks);
    free(n_ranks);
}

/* unpermute_combine: a = {n_tok, top_k, n_expert, dim, holes}. Rows grouped
 * by expert as the model groups them; tok_rows sorted by expert; with holes
 * about a third of the entries are -1; y prefilled. */
static void run_combine(struct run *r, const struct op_case *c)
{
    int n_tok = c->a[0], k = c->a[1], n_e = c->a[2], dim = c->a[3];
    size_t n_route = (size_t)n_tok * k;
    int32_t *ids = calloc(n_route + 1, 4), *pos = calloc(n_route + 1, 4);
    int32_t *tok_rows = calloc(n_route + 1, 4), *cur = calloc((size_t)n_e + 1, 4);
    random_topk_ids(ids, n_tok, k, n_e);
    for (size_t i = 0; i < n_route; i++)
        cur[ids[i] + 1]++;
    for (int e = 0; e < n_e; e++)
        cur[e + 1] += cur[e];
    for (size_t i = 0; i < n_route; i++)
        pos[i] = cur[ids[i]]++;
    for (int t = 0; t < n_tok; t++) { /* positions of a token, ascending = by expert */
        int32_t *tr = tok_rows + (size_t)t * k;
        for (int j = 0; j < k; j++) {
            int32_t v = pos[t * k + j];
            int i = j;
            while (i > 0 && tr[i - 1] > v) {
                tr[i] = tr[i - 1];
                i--;
            }
            tr[i] = v;
        }
        for (int j = 0; j < k && c->a[4]; j++)
            if (test_rng_int(&g_rng, 0, 2) == 0)
                tr[j] = -1;
    }
    size_t nr = n_route * dim, ny = (size_t)n_tok * dim;
    float *rows = calloc(nr + 1, 4), *wt = calloc(n_route + 1, 4), *y = calloc(ny + 1, 4);
    fill_floats(rows, nr, 2.0f);
    fill_floats(wt, n_route, 1.0f);
    fill_floats(y, ny, 1.0f);
    float *dy = run_buf(r, y, ny * 4);
    r->be->ops->unpermute_combine(r->be, run_buf(r, rows, nr * 4), run_buf(r, wt, n_route * 4),
                                  run_buf(r, tok_rows, n_route * 4), n_tok, k, dim, dy);
    run_get_floats(r, dy, ny);
    free(ids);
    free(pos);
    free(tok_rows);
    free(cur);
    free(rows);
    free(wt);
    free(y);
}

/* Logits for the sampling cases: scale * [-1, 1), or with `ties` integers
 * 0..4 (many exact ties). */
static float *sample_logits(size_t n, float scale, bool ties)
{
    float *l = calloc(n + 1, 4);
    for (size_t i = 0; i < n; i++)
        l[i] = ties ? (float)test_rng_int(&g_rng, 0, 4) : scale * test_rng_float(&g_rng);
    return l;
}

/* argmax: a = {n, vocab, ties} */
static void run_argmax(struct run *r, const struct op_case *c)
{
    int n = c->a[0], vocab = c->a[1];
    size_t nl = (size_t)n * vocab;
    float *l = sample_logits(nl, 10.0f, c->a[2]);
    int32_t *ids = run_buf(r, NULL, ((size_t)n + 1) * 4);
    r->be->ops->argmax(r->be, run_buf(r, l, nl * 4), n, vocab, ids);
    r->be->ops->synchronize(r->be);
    run_get_ids(r, ids, (size_t)n);
    free(l);
}

/* sample_top_p: a = {n, vocab, temperature x 100, top_p x 100, logit scale,
 * ties}; the uniforms include 0 and the largest double below 1. */
static void run_sample(struct run *r, const struct op_case *c)
{
    int n = c->a[0], vocab = c->a[1];
    size_t nl = (size_t)n * vocab;
    float *l = sample_logits(nl, (float)c->a[4], c->a[5]);
    double *u = calloc((size_t)n + 1, sizeof *u);
    for (int i = 0; i < n; i++)
        u[i] = (double)test_rng_u32(&g_rng) / 4294967296.0;
    if (n > 1) {
        u[0] = 0.0;
        u[1] = 1.0 - 0x1p-53;
    }
    int32_t *ids = run_buf(r, NULL, ((size_t)n + 1) * 4);
    r->be->ops->sample_top_p(r->be, run_buf(r, l, nl * 4), n, vocab, (float)c->a[2] / 100.0f,
                             (float)c->a[3] / 100.0f, run_buf(r, u, ((size_t)n + 1) * 8), ids);
    r->be->ops->synchronize(r->be);
    run_get_ids(r, ids, (size_t)n);
    free(l);
    free(u);
}

/* sample_rows: a = {n, vocab, scale, ties}: as run_sample, each row its own
 * settings (temperature 0, 0.3 .. 1.2; top_p 0 (off), 0.5 .. 1), read from
 * backend arrays */
static void run_sample_rows(struct run *r, const struct op_case *c)
{
    int n = c->a[0], vocab = c->a[1];
    size_t nl = (size_t)n * vocab;
    float *l = sample_logits(nl, (float)c->a[2], c->a[3]);
    double *u = calloc((size_t)n + 1, sizeof *u);
    float *temp = calloc((size_t)n + 1, 4), *top_p = calloc((size_t)n + 1, 4);
    for (int i = 0; i < n; i++) {
        u[i] = (double)test_rng_u32(&g_rng) / 4294967296.0;
        temp[i] = i % 4 == 0 ? 0.0f : 0.3f * (float)(i % 5);
        top_p[i] = i % 3 == 0 ? 0.0f : 0.5f + 0.25f * (float)(i % 3);
    }
    int32_t *ids = run_buf(r, NULL, ((size_t)n + 1) * 4);
    r->be->ops->sample_rows(
        r->be, run_buf(r, l, nl * 4), n, vocab, run_buf(r, temp, ((size_t)n + 1) * 4),
        run_buf(r, top_p, ((size_t)n + 1) * 4), run_buf(r, u, ((size_t)n + 1) * 8), ids);
    r->be->ops->synchronize(r->be);
    run_get_ids(r, ids, (size_t)n);
    free(l);
    free(u);
    free(temp);
    free(top_p);
}

/* kv_gather_blocks / kv_scatter_blocks: a = {n, block_size, kv_dim, n_block,
 * scatter}; distinct random block ids. Gather compares the packed buffer,
 * scatter both whole caches (prefilled, so untouched blocks are checked). */
static void run_kv_blocks(struct run *r, const struct op_case *c)
{
    int n = c->a[0], bs = c->a[1], kv_dim = c->a[2], n_block = c->a[3];
    MOE_ASSERT(n <= n_block);
    size_t blk = (size_t)bs * kv_dim, nc = (size_t)n_block * blk, np = 2 * (size_t)n * blk;
    float *cache = calloc(2 * nc + 1, 4), *packed = calloc(np + 1, 4);
    int32_t *perm = calloc((size_t)n_block + 1, 4);
    fill_floats(cache, 2 * nc, 1.0f);
    fill_floats(packed, np, 1.0f);
    shuffle_ids(perm, n_block);
    float *dc = run_buf(r, cache, 2 * nc * 4), *dp = run_buf(r, packed, (np + 1) * 4);
    int32_t *did = run_buf(r, perm, ((size_t)n_block + 1) * 4);
    if (c->a[4]) {
        r->be->ops->kv_scatter_blocks(r->be, dp, did, n, bs, kv_dim, dc, dc + nc);
        run_get_floats(r, dc, 2 * nc);
    } else {
        r->be->ops->kv_gather_blocks(r->be, dc, dc + nc, did, n, bs, kv_dim, dp);
        run_get_floats(r, dp, np);
    }
    free(cache);
    free(packed);
    free(perm);
}

/* buf_zero: a = {bytes, offset, length}; the whole buffer is compared. */
static void run_buf_zero(struct run *r, const struct op_case *c)
{
    size_t bytes = (size_t)c->a[0];
    MOE_ASSERT(c->a[1] + c->a[2] <= c->a[0] && bytes % 4 == 0);
    float *h = calloc(bytes / 4 + 1, 4);
    fill_floats(h, bytes / 4, 1.0f);
    char *d = run_buf(r, h, bytes);
    r->be->ops->buf_zero(r->be, d + c->a[1], (size_t)c->a[2]);
    run_get_floats(r, (const float *)d, bytes / 4);
    free(h);
}

/* buf_copy: a = {bytes, src offset, dst offset, length}; the whole
 * destination buffer is compared (untouched bytes included). */
static void run_buf_copy(struct run *r, const struct op_case *c)
{
    size_t bytes = (size_t)c->a[0];
    MOE_ASSERT(c->a[1] + c->a[3] <= c->a[0] && c->a[2] + c->a[3] <= c->a[0] && bytes % 4 == 0);
    float *h = calloc(bytes / 4 + 1, 4);
    fill_floats(h, bytes / 4, 1.0f);
    char *src = run_buf(r, h, bytes);
    fill_floats(h, bytes / 4, 1.0f);
    char *dst = run_buf(r, h, bytes);
    r->be->ops->buf_copy(r->be, dst + c->a[2], src + c->a[1], (size_t)c->a[3]);
    run_get_floats(r, (const float *)dst, bytes / 4);
    free(h);
}

#define BF16 1
#define F32 0

/* One line per case. Thresholds: 0 where both backends do the same rounded
 * operations (copies, add, scatter without FMA); 1e-10 where only summation
 * order or libm ulps differ; 1e-9 for bf16 matmuls of more than
 * MOE_CUDA_GEMV_MAX_TOK (8) tokens, whose activations CUDA splits into two
 * bf16 parts (expected nmse ~1e-11, see kernels/cuda/matmul.cu; a single
 * bf16 rounding would give ~1e-6 and fail). */
static const struct op_case g_cases[] = {
    /* matmul {n_tok, n_in, n_out, ldw - n_in, bf16, accumulate} */
    {"matmul", run_matmul, {1, 1, 1, 0, F32, 0}, 1e-10},
    {"matmul", run_matmul, {3, 100, 7, 3, F32, 1}, 1e-10},
    {"matmul", run_matmul, {37, 129, 13, 0, F32, 0}, 1e-10},
    {"matmul", run_matmul, {64, 1024, 300, 0, F32, 1}, 1e-10},
    {"matmul", run_matmul, {0, 64, 32, 0, F32, 0}, 0},
    {"matmul", run_matmul, {1, 1024, 2816, 0, BF16, 0}, 1e-10},
    {"matmul", run_matmul, {2, 2816, 1024, 0, BF16, 1}, 1e-10},
    {"matmul", run_matmul, {5, 257, 9, 0, BF16, 0}, 1e-10},   /* ragged: scalar GEMV path */
    {"matmul", run_matmul, {8, 64, 65, 8, BF16, 1}, 1e-10},   /* ldw > n_in, vector path */
    {"matmul", run_matmul, {7, 96, 33, 1, BF16, 0}, 1e-10},   /* odd ldw: scalar path */
    {"matmul", run_matmul, {9, 1024, 512, 0, BF16, 0}, 1e-9}, /* tensor-core path */
    {"matmul", run_matmul, {130, 200, 37, 5, BF16, 1}, 1e-9},
    {"matmul", run_matmul, {512, 1024, 256, 0, BF16, 0}, 1e-9},
    /* fast (see FAST_*): cuBLAS's one GEMM on bf16 x; below 9 tokens the GEMV (exact) */
    {"matmul", run_matmul, {300, 256, 200, 0, BF16, 0, FAST_ROUNDED}, FAST_TOL},
    {"matmul", run_matmul, {37, 129, 67, 3, BF16, 1, FAST_ROUNDED}, FAST_TOL},
    {"matmul", run_matmul, {64, 1024, 96, 0, BF16, 0, FAST_DRAWN}, FAST_TOL},
    {"matmul", run_matmul, {4, 256, 64, 0, BF16, 0, FAST_DRAWN}, FAST_TOL},
    /* rmsnorm {n_rows, dim, in_place} */
    {"rmsnorm", run_rmsnorm, {1, 1, 0}, 1e-10},
    {"rmsnorm", run_rmsnorm, {70, 4097, 1}, 1e-10},
    {"rmsnorm", run_rmsnorm, {33, 64, 0}, 1e-10},
    /* rope {n_tok, n_heads, d_head, max_pos, theta, attention factor (1 + a/10, 0: 1)} */
    /* add_rmsnorm {n_rows, dim}: x += r and its norm */
    {"add_rmsnorm", run_add_rmsnorm, {1, 1}, 1e-10},
    {"add_rmsnorm", run_add_rmsnorm, {70, 4097}, 1e-10},
    {"add_rmsnorm", run_add_rmsnorm, {33, 1024}, 1e-10},
    /* rope_kv_write {n_tok, n_head, n_kv_head, d_head, biases, norms, bf16 cache}: Mixtral,
     * Qwen2-MoE (biases), Qwen3-MoE (per-head norms), d_head 16 (fewer than a warp's lanes),
     * 256; bf16 caches: a last-bit difference in a rotated value may round one element
     * the other way (~1e-9), hence 1e-8 there */
    {"rope_kv_write", run_rope_kv, {5, 8, 2, 128, 0, 0, 0}, 1e-10},
    {"rope_kv_write", run_rope_kv, {33, 16, 4, 64, 1, 0, 0}, 1e-10},
    {"rope_kv_write", run_rope_kv, {17, 4, 4, 128, 0, 1, 1}, 1e-8},
    {"rope_kv_write", run_rope_kv, {3, 3, 1, 16, 1, 1, 0}, 1e-10},
    {"rope_kv_write", run_rope_kv, {2, 2, 2, 256, 0, 1, 1}, 1e-8},
    {"rope_kv_write", run_rope_kv, {0, 8, 2, 64, 0, 0, 0}, 0},
    {"rope", run_rope, {1, 1, 2, 5, 10000}, 1e-10},
    {"rope", run_rope, {17, 4, 16, 100, 1000000}, 1e-10},
    {"rope", run_rope, {40, 16, 64, 8000, 1000000}, 1e-10},
    {"rope", run_rope, {9, 3, 128, 32000, 10000}, 1e-10},
    {"rope", run_rope, {5, 2, 256, 1000, 10000}, 1e-10},
    {"rope", run_rope, {7, 3, 64, 4000, 10000, 4}, 1e-10}, /* x 1.4 on cos and sin (YaRN) */
    /* kv_write {n_tok, kv_dim, n_slot} */
    {"kv_write", run_kv_write, {1, 4, 3}, 0},
    {"kv_write", run_kv_write, {37, 256, 100}, 0},
    {"kv_write", run_kv_write, {5, 30, 9}, 0}, /* kv_dim not a multiple of 4 */
    {"kv_write", run_kv_write, {0, 64, 4}, 0},
    {"kv_write", run_kv_write, {9, 48, 20, 1}, 0},  /* latent: K only */
    {"kv_write", run_kv_write, {7, 576, 12, 1}, 0}, /* DeepSeek-V3's latent row */
    /* kv_write into bf16 caches {n_tok, kv_dim, n_slot, latent} */
    {"kv_write_bf16", run_kv_write_bf16, {37, 256, 100}, 0},
    {"kv_write_bf16", run_kv_write_bf16, {5, 31, 9}, 0}, /* odd kv_dim: element stores */
    {"kv_write_bf16", run_kv_write_bf16, {0, 64, 4}, 0},
    {"kv_write_bf16", run_kv_write_bf16, {9, 48, 20, 1}, 0}, /* K only */
    /* attention {n_seq, max_len, n_head, n_kv_head, d_head, block_size, mode} */
    {"attention", run_attention, {1, 1, 1, 1, 16, 1, 0}, 1e-10},
    {"attention", run_attention, {3, 40, 4, 2, 16, 4, 1}, 1e-10},     /* mixtral fixture shape */
    {"attention", run_attention, {4, 70, 4, 2, 32, 16, 2}, 1e-10},    /* qwen3 fixture shape */
    {"attention", run_attention, {8, 300, 16, 4, 64, 16, 0}, 1e-10},  /* bench shape, decode */
    {"attention", run_attention, {2, 200, 16, 4, 64, 16, 1}, 1e-10},  /* bench shape, prefill */
    {"attention", run_attention, {1, 3000, 8, 1, 128, 16, 0}, 1e-10}, /* many splits, G 8 */
    {"attention", run_attention, {3, 500, 32, 2, 128, 32, 2}, 1e-10}, /* G 16 */
    {"attention", run_attention, {2, 90, 6, 6, 256, 7, 2}, 1e-10},    /* MHA, odd block size */
    {"attention", run_attention, {64, 33, 32, 8, 128, 16, 0}, 1e-10}, /* batch-64 decode */
    /* attention over bf16 caches {as attention} */
    {"attention_bf16", run_attention_bf16, {3, 40, 4, 2, 16, 4, 1}, 1e-10},
    {"attention_bf16", run_attention_bf16, {8, 300, 16, 4, 64, 16, 0}, 1e-10},  /* decode */
    {"attention_bf16", run_attention_bf16, {2, 200, 16, 4, 64, 16, 1}, 1e-10},  /* prefill */
    {"attention_bf16", run_attention_bf16, {1, 3000, 8, 1, 128, 16, 0}, 1e-10}, /* splits */
    {"attention_bf16", run_attention_bf16, {2, 90, 6, 6, 256, 7, 2}, 1e-10},    /* odd blocks */
    /* latent attention {n_seq, max_len, n_head, d_head, d_v, block_size, mode} */
    {"attention_mla", run_attention_mla, {1, 1, 1, 48, 32, 1, 0}, 1e-10},
    {"attention_mla", run_attention_mla, {3, 40, 4, 48, 32, 4, 1}, 1e-10},      /* fixture shape */
    {"attention_mla", run_attention_mla, {4, 300, 16, 320, 256, 16, 2}, 1e-10}, /* bench shape */
    {"attention_mla", run_attention_mla, {8, 700, 16, 576, 512, 64, 0}, 1e-10}, /* DSV3 /TP 8 */
    {"attention_mla", run_attention_mla, {2, 150, 3, 1000, 999, 5, 2}, 1e-10},  /* ragged */
    /* grouped routing {n_tok, n_expert, n_group, topk_group, top_k, renorm, mode} */
    {"router_grouped", run_router_grouped, {1, 8, 1, 1, 2, 1, 0}, 1e-10},
    {"router_grouped", run_router_grouped, {40, 8, 4, 2, 2, 1, 0}, 1e-10},   /* fixture shape */
    {"router_grouped", run_router_grouped, {40, 8, 4, 2, 3, 0, 1}, 1e-10},   /* ties */
    {"router_grouped", run_router_grouped, {33, 64, 8, 4, 6, 1, 0}, 1e-10},  /* bench shape */
    {"router_grouped", run_router_grouped, {20, 256, 8, 4, 8, 1, 0}, 1e-10}, /* DeepSeek-V3 */
    {"router_grouped", run_router_grouped, {20, 256, 8, 4, 8, 1, 1}, 1e-10},
    {"router_grouped", run_router_grouped, {0, 64, 8, 4, 6, 1, 0}, 0},
    /* copy_cols {n_rows, ld_dst, dst_col, ld_src, src_col, n_cols} */
    {"copy_cols", run_copy_cols, {4, 9, 5, 7, 2, 3}, 0},
    {"copy_cols", run_copy_cols, {100, 576, 512, 64, 0, 64}, 0},
    {"copy_cols", run_copy_cols, {0, 8, 0, 8, 0, 8}, 0},
    /* router {n_tok, n_expert, top_k, renorm, mode} */
    {"router", run_router, {1, 1, 1, 1, 0}, 1e-10},
    {"router", run_router, {50, 8, 2, 1, 0}, 1e-10},
    {"router", run_router, {50, 8, 2, 0, 1}, 1e-10},   /* ties: lower id wins */
    {"router", run_router, {33, 60, 8, 0, 1}, 1e-10},  /* ties, two lanes' worth */
    {"router", run_router, {20, 128, 8, 1, 0}, 1e-10}, /* qwen3-30b shape */
    {"router", run_router, {7, 256, 32, 1, 1}, 1e-10},
    {"router", run_router, {64, 8, 2, 1, 2}, 1e-10}, /* one expert takes every token */
    {"router", run_router, {0, 8, 2, 1, 0}, 0},
    /* swiglu {n_rows, dim} */
    {"swiglu", run_swiglu, {1, 1}, 1e-10},
    {"swiglu", run_swiglu, {37, 2816}, 1e-10},
    {"swiglu", run_swiglu, {0, 48}, 0},
    /* gather_rows {n, dim, n_src} */
    {"gather_rows", run_gather, {1, 1, 1}, 0},
    {"gather_rows", run_gather, {64, 1024, 64}, 0}, /* one expert takes all tokens */
    {"gather_rows", run_gather, {13, 63, 40}, 0},
    {"gather_rows", run_gather, {0, 64, 8}, 0}, /* expert with no tokens */
    /* scatter_add_rows {n, dim, n_dst, no_scale} */
    {"scatter_add_rows", run_scatter, {1, 1, 1, 0}, 0},
    {"scatter_add_rows", run_scatter, {64, 1024, 64, 0}, 0},
    {"scatter_add_rows", run_scatter, {13, 63, 40, 1}, 0},
    {"scatter_add_rows", run_scatter, {0, 64, 8, 0}, 0},
    /* embed {n_tok, dim, n_vocab, dtype} */
    {"embed", run_embed, {1, 1, 1, MOE_DTYPE_F32}, 0},
    {"embed", run_embed, {19, 64, 300, MOE_DTYPE_F32}, 0},
    {"embed", run_embed, {19, 1024, 77, MOE_DTYPE_BF16}, 0},
    {"embed", run_embed, {7, 33, 50, MOE_DTYPE_F16}, 0},
    /* add {n} */
    {"add", run_add, {1}, 0},
    {"add", run_add, {1000003}, 0},
    {"add", run_add, {0}, 0},
    /* sigmoid {n}: expf may differ in the last bit between libm and CUDA */
    {"sigmoid", run_sigmoid, {1}, 1e-12},
    {"sigmoid", run_sigmoid, {100003}, 1e-12},
    {"sigmoid", run_sigmoid, {0}, 0},
    /* grouped_matmul {n_rows, n_expert, n_in, n_out, bf16, accumulate, mode}; thresholds as
     * matmul: 1e-9 where CUDA may take cuBLAS's bf16 split (> 8 rows on an expert) */
    {"grouped_matmul", run_grouped, {1, 1, 1, 1, F32, 0, 0}, 1e-10},
    {"grouped_matmul", run_grouped, {37, 8, 129, 67, BF16, 0, 0}, 1e-9},   /* ragged */
    {"grouped_matmul", run_grouped, {300, 8, 256, 200, BF16, 1, 0}, 1e-9}, /* prefill */
    {"grouped_matmul", run_grouped, {64, 8, 100, 70, F32, 0, 1}, 1e-10},   /* one takes all */
    {"grouped_matmul", run_grouped, {50, 16, 64, 33, BF16, 1, 2}, 1e-9},   /* empty, NULL */
    {"grouped_matmul",
     run_grouped,
     {16, 128, 1024, 96, BF16, 0, 3},
     1e-10},                                                       /* decode, host arrays */
    {"grouped_matmul", run_grouped, {0, 8, 64, 64, F32, 0, 0}, 0}, /* no rows */
    /* CUDA's grouped GEMV (bf16, <= 8 rows per expert): vector, scalar (n_in 129, ldw 67)
     * and exactly 8 rows on one expert; 9 rows on one expert leaves it for cuBLAS */
    {"grouped_matmul", run_grouped, {1, 8, 1024, 5632, BF16, 0, 0}, 1e-10},
    {"grouped_matmul", run_grouped, {20, 8, 129, 67, BF16, 1, 0}, 1e-10},
    {"grouped_matmul", run_grouped, {12, 4, 64, 40, BF16, 0, 2}, 1e-10},
    {"grouped_matmul", run_grouped, {8, 8, 256, 520, BF16, 1, 1}, 1e-10},
    {"grouped_matmul", run_grouped, {9, 8, 64, 64, BF16, 0, 1}, 1e-9}, /* tensor-core split */
    /* device-only offsets (the GEMV, <= 8 rows an expert): more experts than rows, vector and
     * scalar, exactly 8 rows on one expert */
    {"grouped_matmul", run_grouped, {8, 8, 1024, 520, BF16, 0, 5}, 1e-10},
    {"grouped_matmul", run_grouped, {5, 16, 129, 67, BF16, 1, 5}, 1e-10},
    {"grouped_matmul", run_grouped, {16, 64, 256, 96, BF16, 0, 5}, 1e-10},
    /* device-only offsets past 8 rows an expert: CUDA's tensor-core grouped GEMM (64 x 64
     * tiles, x split into bf16 hi + lo: matmul's split numerics). Ragged n_in, n_out and
     * ldw (scalar staging), a batch-64 decode step's two expert matmuls (fewer columns),
     * experts of two and more row tiles */
    {"grouped_matmul", run_grouped, {100, 8, 129, 67, BF16, 1, 5}, 1e-9},
    {"grouped_matmul", run_grouped, {128, 8, 1024, 1408, BF16, 0, 5}, 1e-9},
    {"grouped_matmul", run_grouped, {128, 8, 2816, 256, BF16, 1, 5}, 1e-9},
    {"grouped_matmul", run_grouped, {1000, 8, 256, 200, BF16, 0, 5}, 1e-9},
    {"grouped_matmul", run_grouped, {300, 3, 64, 64, BF16, 0, 5}, 1e-9},
    /* fast (bf16 activations, f32 sums; CUDA: MOE_CUDA_FAST_GEMM=1, which main sets):
     * the tensor-core kernel without the lo half, cuBLAS's single GEMM, the GEMV */
    {"grouped_matmul", run_grouped, {128, 8, 1024, 520, BF16, 0, 7}, FAST_TOL},
    {"grouped_matmul", run_grouped, {100, 8, 129, 67, BF16, 1, 7}, FAST_TOL},
    {"grouped_matmul", run_grouped, {300, 8, 256, 200, BF16, 1, 8}, FAST_TOL},
    {"grouped_matmul", run_grouped, {16, 8, 256, 200, BF16, 0, 7}, FAST_TOL},
    {"grouped_matmul", run_grouped, {128, 8, 256, 96, BF16, 0, 9}, FAST_TOL},
    /* permute {n_tok, top_k, n_expert, n_dest, replicated, token_base}: integers, exact */
    {"permute", run_permute, {1, 1, 1, 1, 0, 0}, 0},
    {"permute", run_permute, {0, 2, 8, 1, 0, 0}, 0},
    {"permute", run_permute, {37, 2, 8, 1, 0, 0}, 0},
    {"permute", run_permute, {64, 8, 256, 1, 0, 0}, 0},
    {"permute", run_permute, {2048, 8, 256, 1, 0, 0}, 0},
    {"permute", run_permute, {300, 6, 64, 4, 1, 17}, 0},
    {"permute", run_permute, {33, 1, 16, 1, 0, 0}, 0},
    {"permute", run_permute, {1000, 2, 8, 8, 1, 5}, 0},
    /* unpermute_combine {n_tok, top_k, n_expert, dim, holes}: same roundings, bit-exact */
    {"unpermute_combine", run_combine, {1, 1, 1, 1, 0}, 0},
    {"unpermute_combine", run_combine, {37, 2, 8, 1024, 0}, 0},
    {"unpermute_combine", run_combine, {64, 8, 128, 129, 1}, 0},
    {"unpermute_combine", run_combine, {0, 2, 8, 64, 0}, 0},
    /* argmax {n, vocab, ties}: ids exact */
    {"argmax", run_argmax, {1, 1, 0}, 0},
    {"argmax", run_argmax, {7, 32000, 0}, 0},
    {"argmax", run_argmax, {33, 1000, 1}, 0}, /* ties: lower id */
    {"argmax", run_argmax, {3, 151936, 1}, 0},
    /* sample_top_p {n, vocab, temp x 100, top_p x 100, scale, ties}: ids exact (may differ
     * only where expf differs by an ulp right at a boundary: see backend.h) */
    {"sample_top_p", run_sample, {4, 1, 100, 90, 1, 0}, 0},
    {"sample_top_p", run_sample, {16, 32000, 0, 90, 5, 0}, 0},  /* temperature 0: argmax */
    {"sample_top_p", run_sample, {16, 32000, 100, 0, 5, 0}, 0}, /* no top-p: id order */
    {"sample_top_p", run_sample, {16, 32000, 70, 90, 8, 0}, 0},
    {"sample_top_p", run_sample, {16, 1000, 100, 50, 3, 1}, 0},   /* tied p */
    {"sample_top_p", run_sample, {4, 151936, 120, 95, 10, 0}, 0}, /* qwen3 vocab */
    {"sample_top_p", run_sample, {9, 777, 30, 99, 20, 0}, 0},
    /* sample_rows {n, vocab, scale, ties}: each row its own settings; ids exact */
    {"sample_rows", run_sample_rows, {24, 32000, 5, 0}, 0},
    {"sample_rows", run_sample_rows, {13, 1000, 3, 1}, 0},
    {"sample_rows", run_sample_rows, {0, 1000, 3, 0}, 0},
    /* kv_gather_blocks / kv_scatter_blocks {n, block_size, kv_dim, n_block, scatter} */
    {"kv_gather_blocks", run_kv_blocks, {1, 1, 1, 1, 0}, 0},
    {"kv_gather_blocks", run_kv_blocks, {13, 16, 256, 40, 0}, 0},
    {"kv_gather_blocks", run_kv_blocks, {5, 7, 30, 9, 0}, 0}, /* not a multiple of 4 */
    {"kv_scatter_blocks", run_kv_blocks, {13, 16, 256, 40, 1}, 0},
    {"kv_scatter_blocks", run_kv_blocks, {5, 7, 30, 9, 1}, 0},
    {"kv_scatter_blocks", run_kv_blocks, {0, 16, 64, 4, 1}, 0},
    /* buf_zero {bytes, offset, length} */
    {"buf_zero", run_buf_zero, {4096, 0, 4096}, 0},
    {"buf_zero", run_buf_zero, {1000, 3, 990}, 0},
    {"buf_zero", run_buf_zero, {64, 8, 0}, 0},
    /* buf_copy {bytes, src offset, dst offset, length} */
    {"buf_copy", run_buf_copy, {4096, 0, 0, 4096}, 0},
    {"buf_copy", run_buf_copy, {1000, 12, 400, 520}, 0},
    {"buf_copy", run_buf_copy, {64, 8, 4, 0}, 0},
};

/* Shapes CUDA must refuse loudly: the op records an error and computes nothing. */
static const struct op_case g_refused[] = {
    {"grouped_matmul", run_grouped, {20, 4, 32, 16, F32, 0, 5}, 0},      /* device-only, f32 W */
    {"rope_kv_write", run_rope_kv, {2, 2, 1, 1024, 0, 0, 0}, 0},         /* d_head 1024 */
    {"attention", run_attention, {1, 8, 4, 4, 96, 4, 0}, 0},             /* d_head 96 */
    {"attention", run_attention, {1, 8, 34, 1, 64, 4, 0}, 0},            /* 34 heads per KV head */
    {"router", run_router, {3, 300, 2, 1, 0}, 0},                        /* 300 experts */
    {"attention_mla", run_attention_mla, {1, 8, 4, 1088, 512, 4, 0}, 0}, /* d_head 1088 */
    {"router_grouped", run_router_grouped, {3, 512, 8, 4, 8, 1, 0}, 0},  /* 512 experts */
    {"rope", run_rope, {2, 2, 1024, 10, 10000}, 0},                      /* d_head 1024 */
/* first index of the refusals every backend makes (the CPU too: run in --cpu-vs-cpu) */
#define REFUSED_ALL_FROM 8
    {"grouped_matmul", run_grouped, {20, 4, 32, 16, F32, 0, 4}, 0}, /* rows, NULL weights */
    {"grouped_matmul", run_grouped, {6, 4, 32, 16, BF16, 0, 6}, 0}, /* device-only, NULL w */
    {"permute", run_permute, {40, 2, 8, 2, 0, 0, 1}, 0},            /* expert id 11 of 8 */
    {"sample_top_p", run_sample, {2, 0, 100, 90, 1, 0}, 0},         /* vocab 0 */
};

/* ---- comparison ---- */

static void case_name(const struct op_case *c, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s {%d, %d, %d, %d, %d, %d, %d}", c->op, c->a[0], c->a[1], c->a[2], c->a[3],
             c->a[4], c->a[5], c->a[6]);
}

static double nmse(const float *a, const float *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double e = (double)a[i] - (double)ref[i];
        num += e * e;
        den += (double)ref[i] * ref[i];
    }
    if (num == 0.0)
        return 0.0;
    if (!(num == num))
        return NAN;
    return num / (den > 1e-30 ? den : 1e-30);
}

static void check_case(size_t i, const struct op_case *c, struct moe_backend *cpu,
                       struct moe_backend *cuda, double *worst)
{
    char name[128];
    case_name(c, name, sizeof name);
    struct run rc = {.be = cpu, .ref = true}, rg = {.be = cuda};
    test_rng_seed(&g_rng, 1000 + i);
    c->run(&rc, c);
    test_rng_seed(&g_rng, 1000 + i);
    c->run(&rg, c);
    struct moe_error err = {0};
    enum moe_status st = cpu->ops->status(cpu, &err);
    CHECKF(st == MOE_OK, "%s: %s backend: %s", name, cpu->name, err.msg);
    st = cuda->ops->status(cuda, &err);
    CHECKF(st == MOE_OK, "%s: %s backend: %s", name, cuda->name, err.msg);
    CHECK(rc.n_out == rg.n_out && rc.n_ids == rg.n_ids);
    double e = rc.n_out == rg.n_out ? nmse(rg.out, rc.out, rc.n_out) : INFINITY;
    size_t id_mismatch = 0;
    for (size_t k = 0; k < rc.n_ids && k < rg.n_ids; k++)
        id_mismatch += rc.ids[k] != rg.ids[k];
    bool ok = e <= c->tol && id_mismatch == 0;
    CHECKF(ok, "%s: nmse %.3g (threshold %.3g), %zu ids differ", name, e, c->tol, id_mismatch);
    printf("%-4s %-48s nmse %.3g (<= %.3g)%s\n", ok ? "ok" : "FAIL", name, e, c->tol,
           rc.n_ids ? (id_mismatch ? ", ids differ" : ", ids equal") : "");
    if (e > *worst)
        *worst = e;
    run_end(&rc);
    run_end(&rg);
}

/* Runs a refusal case on `be`: the op must record an error (`status`). */
static void check_refused(const struct op_case *c, struct moe_backend *be)
{
    char name[128];
    case_name(c, name, sizeof name);
    struct run rg = {.be = be};
    test_rng_seed(&g_rng, 7);
    c->run(&rg, c);
    struct moe_error err = {0};
    enum moe_status st = be->ops->status(be, &err);
    CHECKF(st != MOE_OK, "%s: unsupported shape accepted without an error on %s", name, be->name);
    printf("%-4s %-48s refused: %s\n", st != MOE_OK ? "ok" : "FAIL", name, err.msg);
    run_end(&rg);
}

int main(int argc, char **argv)
{
    bool cpu_vs_cpu = argc > 1 && strcmp(argv[1], "--cpu-vs-cpu") == 0;
    const char *filter = argc > 1 + cpu_vs_cpu ? argv[1 + cpu_vs_cpu] : NULL;
    const size_t n_cases = sizeof(g_cases) / sizeof(g_cases[0]);
    const size_t n_refused = sizeof(g_refused) / sizeof(g_refused[0]);
    struct moe_error err = {0};
    struct moe_backend *cuda = NULL, *cpu = NULL;
    if (cpu_vs_cpu && moe_backend_cpu_create(1, &cuda, &err) != MOE_OK) {
        fprintf(stderr, "second cpu backend: %s\n", err.msg);
        return 1;
    }
    /* The fast cases hold CUDA's fast GEMMs (opt-in in serving until a GPU
     * has passed them) to the exact reference: on for this process. */
    setenv("MOE_CUDA_FAST_GEMM", "1", 1);
    setenv("MOE_CUDA_FUSED_OPS", "1", 1); /* add_rmsnorm, rope_kv_write: likewise */
    if (!cpu_vs_cpu && moe_backend_cuda_create(0, &cuda, &err) != MOE_OK) {
        char name[128];
        for (size_t i = 0; i < n_cases; i++) {
            case_name(&g_cases[i], name, sizeof name);
            printf("skip %s\n", name);
        }
        printf("ops: all %zu cases (+%zu refusal cases) skipped: %s\n", n_cases, n_refused,
               err.msg);
        return TEST_SKIP_CODE;
    }
    if (moe_backend_cpu_create(2, &cpu, &err) != MOE_OK) {
        fprintf(stderr, "cpu backend: %s\n", err.msg);
        moe_backend_destroy(cuda);
        return 1;
    }
    double worst = 0.0;
    for (size_t i = 0; i < n_cases; i++)
        if (!filter || strstr(g_cases[i].op, filter))
            check_case(i, &g_cases[i], cpu, cuda, &worst);
    for (size_t i = 0; i < n_refused; i++)
        if ((!cpu_vs_cpu || i >= REFUSED_ALL_FROM) && (!filter || strstr(g_refused[i].op, filter)))
            check_refused(&g_refused[i], cuda);
    printf("ops: worst nmse %.3g\n", worst);
    moe_backend_destroy(cpu);
    moe_backend_destroy(cuda);
    return test_summary();
}
