/* CPU references of the GPU path's ops: grouped expert
 * GEMM, weighted unpermute-combine, argmax and temperature/top-p sampling,
 * KV block gather/scatter. Plain loops: these are the references the CUDA
 * kernels are checked against (tests/ops), and the CPU backend's ops. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "quant.h"
#include "sample_math.h"

/* ---- grouped matmul ---- */

enum moe_status moe_grouped_matmul_check(const struct moe_grouped_matmul_params *p,
                                         struct moe_error *err)
{
    const bool quant = p->w_dtype == MOE_DTYPE_I8 || p->w_dtype == MOE_DTYPE_I4;
    if (p->w_dtype != MOE_DTYPE_F32 && p->w_dtype != MOE_DTYPE_BF16 && !quant)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "grouped_matmul: w_dtype %s not supported (F32, BF16, I8 or I4)",
                             moe_dtype_name(p->w_dtype));
    if (quant && !p->w_scale)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "grouped_matmul: %s weights need the host w_scale array",
                             moe_dtype_name(p->w_dtype));
    if (p->w_dtype == MOE_DTYPE_I4 &&
        (!moe_q4_group_valid(p->w_group) || p->n_in % MOE_Q4_BLOCK || p->ldw % MOE_Q4_BLOCK))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "grouped_matmul: I4 group %d (32, 64 or 128) with n_in %d and ldw "
                             "%lld (multiples of 32)",
                             p->w_group, p->n_in, (long long)p->ldw);
    if (p->n_rows < 0 || p->n_in < 0 || p->n_out < 0 || p->n_expert < 1)
        return moe_error_set(
            err, MOE_ERR_INVALID,
            "grouped_matmul: bad sizes (n_rows %d, n_in %d, n_out %d, n_expert %d)", p->n_rows,
            p->n_in, p->n_out, p->n_expert);
    if (p->ldw < p->n_in || p->ldw < 1)
        return moe_error_set(err, MOE_ERR_INVALID, "grouped_matmul: ldw %lld smaller than n_in %d",
                             (long long)p->ldw, p->n_in);
    if (!p->w)
        return moe_error_set(err, MOE_ERR_INVALID, "grouped_matmul: the host w array is required");
    if (!p->expert_offsets) { /* device-only offsets: what the host can check */
        if (!p->expert_offsets_dev || !p->w_dev)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "grouped_matmul: without host expert_offsets, expert_offsets_dev "
                                 "and w_dev are required");
        if (p->max_expert_rows < 0)
            return moe_error_set(err, MOE_ERR_INVALID, "grouped_matmul: max_expert_rows %d < 0",
                                 p->max_expert_rows);
        for (int e = 0; e < p->n_expert; e++)
            if (!p->w[e] || (quant && !p->w_scale[e]))
                return moe_error_set(err, MOE_ERR_INVALID,
                                     "grouped_matmul: device-only offsets need every expert's "
                                     "weights%s (expert %d has none)",
                                     quant ? " and scales" : "", e);
        return MOE_OK;
    }
    const int32_t *off = p->expert_offsets;
    if (off[0] != 0 || off[p->n_expert] != p->n_rows)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "grouped_matmul: expert_offsets run %d..%d, expected 0..n_rows %d",
                             off[0], off[p->n_expert], p->n_rows);
    for (int e = 0; e < p->n_expert; e++) {
        if (off[e + 1] < off[e])
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "grouped_matmul: expert_offsets decrease at expert %d (%d > %d)",
                                 e, off[e], off[e + 1]);
        if (off[e + 1] > off[e] && !p->w[e])
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "grouped_matmul: expert %d has %d rows but no weights (NULL)", e,
                                 off[e + 1] - off[e]);
        if (off[e + 1] > off[e] && quant && !p->w_scale[e])
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "grouped_matmul: %s expert %d has %d rows but no scales (NULL)",
                                 moe_dtype_name(p->w_dtype), e, off[e + 1] - off[e]);
    }
    return MOE_OK;
}

enum moe_status cpu_grouped_matmul(struct moe_threadpool *pool,
                                   const struct moe_grouped_matmul_params *p, struct moe_error *err)
{
    enum moe_status st = moe_grouped_matmul_check(p, err);
    if (st != MOE_OK)
        return st;
    struct moe_grouped_matmul_params hp;
    if (!p->expert_offsets) { /* device-only offsets: backend memory is host memory here */
        hp = *p;
        hp.expert_offsets = p->expert_offsets_dev;
        if ((st = moe_grouped_matmul_check(&hp, err)) != MOE_OK)
            return st;
        for (int e = 0; e < p->n_expert; e++)
            if (hp.expert_offsets[e + 1] - hp.expert_offsets[e] > p->max_expert_rows)
                return moe_error_set(err, MOE_ERR_INVALID,
                                     "grouped_matmul: expert %d has %d rows, more than "
                                     "max_expert_rows %d",
                                     e, hp.expert_offsets[e + 1] - hp.expert_offsets[e],
                                     p->max_expert_rows);
        p = &hp;
    }
    struct moe_matmul_params stack_mp[16], *mps = stack_mp;
    if (p->n_expert > 16) {
        mps = malloc((size_t)p->n_expert * sizeof *mps);
        MOE_ASSERT(mps != NULL);
    }
    int n = 0;
    for (int e = 0; e < p->n_expert; e++) {
        int r0 = p->expert_offsets[e], cnt = p->expert_offsets[e + 1] - r0;
        if (!cnt)
            continue;
        mps[n++] = (struct moe_matmul_params){
            .x = p->x + (size_t)r0 * p->n_in,
            .n_tok = cnt,
            .n_in = p->n_in,
            .w = p->w[e],
            .w_dtype = p->w_dtype,
            .ldw = p->ldw,
            .n_out = p->n_out,
            .y = p->y + (size_t)r0 * p->n_out,
            .accumulate = p->accumulate,
            .w_scale = p->w_scale ? p->w_scale[e] : NULL,
            .w_group = p->w_group,
            .fast = p->fast,
            .batch_invariant = p->batch_invariant,
        };
    }
    /* every expert's tasks in one pool run */
    if (n > 0)
        cpu_matmul_many(pool, mps, n);
    if (mps != stack_mp)
        free(mps);
    return MOE_OK;
}

/* ---- routing's permutation ---- */

enum moe_status cpu_permute(const struct moe_permute_params *p, int32_t *cursor,
                            struct moe_error *err)
{
    const int n_items = p->n_tok * p->top_k, n_keys = p->n_dest * p->n_expert;
    int32_t *off = p->offsets;
    memset(off, 0, ((size_t)n_keys + 1) * sizeof *off);
    /* the key of each item, kept in tok_rows until the positions replace it */
    int32_t *key = p->tok_rows;
    for (int i = 0; i < n_items; i++) {
        int e = p->ids[i], t = i / p->top_k, dest = 0;
        if (e < 0 || e >= p->n_expert)
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "permute: item %d (token %d) names expert %d of %d", i, t, e,
                                 p->n_expert);
        if (p->ranks) {
            int n_rep = p->n_ranks[e];
            dest = p->ranks[(size_t)e * p->rank_stride + (p->token_base + t) % n_rep];
            if (dest < 0 || dest >= p->n_dest)
                return moe_error_set(err, MOE_ERR_INVALID,
                                     "permute: expert %d's replica %d is on rank %d of %d", e,
                                     (p->token_base + t) % n_rep, dest, p->n_dest);
        }
        key[i] = dest * p->n_expert + e;
        off[key[i] + 1]++;
    }
    for (int k = 0; k < n_keys; k++)
        off[k + 1] += off[k];
    memcpy(cursor, off, (size_t)n_keys * sizeof *cursor);
    for (int i = 0; i < n_items; i++) {
        int q = cursor[key[i]]++;
        if (p->item_tok)
            p->item_tok[q] = i / p->top_k;
        if (p->item_exp)
            p->item_exp[q] = p->ids[i];
        if (p->item_w)
            p->item_w[q] = p->weights[i];
        key[i] = q; /* now the item's position */
    }
    /* each token's positions by ascending expert id (its experts are
     * distinct; top_k is small: insertion sort) */
    for (int t = 0; t < p->n_tok; t++) {
        int32_t *pos = p->tok_rows + (size_t)t * p->top_k;
        const int32_t *e = p->ids + (size_t)t * p->top_k;
        int32_t ord[64];
        int k = p->top_k < 64 ? p->top_k : 64;
        for (int j = 0; j < k; j++) {
            int at = j;
            while (at > 0 && e[ord[at - 1]] > e[j]) {
                ord[at] = ord[at - 1];
                at--;
            }
            ord[at] = j;
        }
        int32_t sorted[64];
        for (int j = 0; j < k; j++)
            sorted[j] = pos[ord[j]];
        memcpy(pos, sorted, (size_t)k * sizeof *pos);
    }
    return MOE_OK;
}

/* ---- unpermute + weighted combine ---- */

void cpu_unpermute_combine(const float *rows, const float *weights, const int32_t *tok_rows,
                           int n_tok, int top_k, int dim, float *y)
{
    for (int t = 0; t < n_tok; t++) {
        float *d = y + (size_t)t * dim;
        for (int j = 0; j < top_k; j++) {
            int32_t i = tok_rows[(size_t)t * top_k + j];
            if (i < 0)
                continue;
            const float a = weights[i], *s = rows + (size_t)i * dim;
            for (int k = 0; k < dim; k++)
                d[k] += a * s[k]; /* no FMA: kernels/ builds with -ffp-contract=off */
        }
    }
}

/* ---- sampling ---- */

int32_t cpu_argmax_row(const float *logits, int vocab)
{
    return moe_host_argmax(logits, vocab);
}

void cpu_argmax(const float *logits, int n, int vocab, int32_t *out_ids)
{
    for (int r = 0; r < n; r++)
        out_ids[r] = vocab > 0 ? cpu_argmax_row(logits + (size_t)r * vocab, vocab) : 0;
}

struct sample_cand {
    float p;
    int32_t id;
};

static int sample_cand_cmp(const void *a, const void *b)
{
    const struct sample_cand *x = a, *y = b;
    if (x->p != y->p)
        return x->p > y->p ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* One row; `c` holds vocab candidates of scratch. */
static int32_t sample_row(const float *l, int vocab, float temperature, float top_p, double u,
                          struct sample_cand *c)
{
    int32_t best = cpu_argmax_row(l, vocab);
    if (temperature <= 0.0f)
        return best;
    const float max = l[best];
    uint64_t total = 0;
    for (int i = 0; i < vocab; i++) {
        c[i].id = i;
        c[i].p = moe_sample_p(l[i], max, temperature);
        total += moe_sample_mass(c[i].p);
    }
    int keep = vocab;
    uint64_t sum = total;
    if (top_p > 0.0f && top_p < 1.0f) {
        qsort(c, (size_t)vocab, sizeof *c, sample_cand_cmp);
        uint64_t cut = moe_sample_cut(top_p, total), acc = 0;
        for (int i = 0; i < vocab; i++) {
            acc += moe_sample_mass(c[i].p);
            if (acc >= cut) {
                keep = i + 1;
                sum = acc;
                break;
            }
        }
    }
    uint64_t r = moe_sample_point(u, sum), acc = 0;
    for (int i = 0; i < keep; i++) {
        acc += moe_sample_mass(c[i].p);
        if (r < acc)
            return c[i].id;
    }
    return c[keep - 1].id;
}

enum moe_status cpu_sample_top_p(const float *logits, int n, int vocab, float temperature,
                                 float top_p, const double *uniform, int32_t *out_ids,
                                 struct moe_error *err)
{
    if (n <= 0)
        return MOE_OK;
    if (vocab < 1)
        return moe_error_set(err, MOE_ERR_INVALID, "sample_top_p: vocab %d", vocab);
    struct sample_cand *c = temperature > 0.0f ? malloc((size_t)vocab * sizeof *c) : NULL;
    if (temperature > 0.0f && !c)
        return moe_error_set(err, MOE_ERR_NOMEM, "sample_top_p: no memory for %d candidates",
                             vocab);
    for (int r = 0; r < n; r++)
        out_ids[r] =
            sample_row(logits + (size_t)r * vocab, vocab, temperature, top_p, uniform[r], c);
    free(c);
    return MOE_OK;
}

/* ---- KV blocks ---- */

void cpu_kv_gather_blocks(const float *k_cache, const float *v_cache, const int32_t *block_ids,
                          int n, int block_size, int kv_dim, float *out)
{
    size_t blk = (size_t)block_size * kv_dim;
    for (int i = 0; i < n; i++) {
        size_t src = (size_t)block_ids[i] * blk;
        memcpy(out + (2 * (size_t)i) * blk, k_cache + src, blk * sizeof(float));
        memcpy(out + (2 * (size_t)i + 1) * blk, v_cache + src, blk * sizeof(float));
    }
}

void cpu_kv_scatter_blocks(const float *in, const int32_t *block_ids, int n, int block_size,
                           int kv_dim, float *k_cache, float *v_cache)
{
    size_t blk = (size_t)block_size * kv_dim;
    for (int i = 0; i < n; i++) {
        size_t dst = (size_t)block_ids[i] * blk;
        memcpy(k_cache + dst, in + (2 * (size_t)i) * blk, blk * sizeof(float));
        memcpy(v_cache + dst, in + (2 * (size_t)i + 1) * blk, blk * sizeof(float));
    }
}
