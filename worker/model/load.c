/* Loading a model shard: config.json and the safetensors weights, checked
 * tensor by tensor against the config, the shard's slice copied to the
 * backend in the chosen dtype (int8 quantized here); freeing it. The forward
 * pass is in forward.c, live placement changes in placement_swap.c. */
#include "model/model.h"
#include "model/model_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host_mem.h"
#include "placement.h"
#include "quant.h"
#include "safetensors.h"

/* ---- loading ------------------------------------------------------------------ */

struct loader {
    struct moe_model *m;
    struct st_model *st;
    const char *dir;
};

/* Looks a tensor up and checks its shape against what config.json implies. */
static enum moe_status find_tensor(struct loader *ld, const char *name, int n_dim, int64_t d0,
                                   int64_t d1, const struct st_tensor **out, struct moe_error *err)
{
    const struct st_tensor *t = st_find(ld->st, name);
    if (!t)
        return moe_error_set(err, MOE_ERR_NOT_FOUND, "%s: tensor '%s' not found in the checkpoint",
                             ld->dir, name);
    int64_t want[2] = {d0, d1};
    bool ok = t->n_dim == n_dim;
    for (int i = 0; ok && i < n_dim; i++)
        ok = t->shape[i] == want[i];
    if (!ok) {
        char got[128] = "";
        size_t len = 0;
        for (int i = 0; i < t->n_dim && len < sizeof got - 24; i++)
            len += (size_t)snprintf(got + len, sizeof got - len, "%s%lld", i ? ", " : "",
                                    (long long)t->shape[i]);
        if (n_dim == 1)
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "%s: tensor '%s' has shape [%s], config.json implies [%lld]",
                                 t->file, name, got, (long long)d0);
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s' has shape [%s], config.json implies [%lld, %lld]",
                             t->file, name, got, (long long)d0, (long long)d1);
    }
    *out = t;
    return MOE_OK;
}

/* Bytes of a Linear weight (n_rows, n_cols) as the model stores it. */
size_t moe_model_linear_bytes(const struct moe_model *m, int64_t n_rows, int64_t n_cols)
{
    if (m->lin_dtype == MOE_DTYPE_I8)
        return moe_i8_weight_bytes(n_rows, n_cols);
    if (m->lin_dtype == MOE_DTYPE_I4)
        return moe_q4_weight_bytes(n_rows, n_cols, m->q4_group);
    return (size_t)n_rows * (size_t)n_cols * moe_dtype_size(m->lin_dtype);
}

/* Host memory for a weight's bytes (NULL when out of memory): 64-byte
 * aligned, as the CPU backend's buffers are, so that upload_weight can hand
 * it to that backend as it is; large ones on huge pages (host_mem.h). */
static void *weight_host_alloc(size_t bytes)
{
    return moe_host_alloc(bytes);
}

/* Makes `bytes` of host memory (weight_host_alloc'd, wholly written) a
 * backend buffer (*out), counted in the model's weight bytes. The CPU
 * backend's buffers are 64-byte aligned host memory, freed with free():
 * it takes `host` as it is (no second copy, no zeroing pass); another
 * backend gets a copy, and `host` is freed. */
static enum moe_status upload_weight(struct loader *ld, const char *name, void *host, size_t bytes,
                                     void **out, struct moe_error *err)
{
    struct moe_backend *be = ld->m->be;
    if (be->device == MOE_DEVICE_CPU && ((uintptr_t)host & 63) == 0) {
        ld->m->weight_bytes += bytes;
        *out = host;
        return MOE_OK;
    }
    void *buf = be->ops->buf_alloc(be, bytes);
    if (!buf) {
        free(host);
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: cannot allocate %zu bytes for '%s'", ld->dir,
                             bytes, name);
    }
    be->ops->buf_upload(be, buf, host, bytes);
    free(host);
    ld->m->weight_bytes += bytes;
    *out = buf;
    return MOE_OK;
}

/* Quantizes the f32 values of a Linear weight (n_rows, n_cols) to the int8
 * or int4 image (codes, then scales; opts.dtype says which) and uploads it;
 * under the dequantized test hook, uploads the dequantized f32 weights
 * instead. Frees `f32` in every case. */
static enum moe_status upload_quantized(struct loader *ld, const char *name, float *f32,
                                        int64_t n_rows, int64_t n_cols, void **out,
                                        struct moe_error *err)
{
    const bool q4 = ld->m->opts.dtype == MOE_DTYPE_I4;
    const int group = ld->m->q4_group;
    if (q4 && n_cols % MOE_Q4_BLOCK) {
        free(f32);
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "%s: tensor '%s' has %lld columns, not a multiple of 32 (--dtype "
                             "int4 packs blocks of 32 columns)",
                             ld->dir, name, (long long)n_cols);
    }
    size_t img_bytes =
        q4 ? moe_q4_weight_bytes(n_rows, n_cols, group) : moe_i8_weight_bytes(n_rows, n_cols);
    char *img = weight_host_alloc(img_bytes);
    if (!img) {
        free(f32);
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory quantizing '%s'", ld->dir,
                             name);
    }
    memset(img, 0, img_bytes); /* the padding before the scales */
    float *scale = (float *)(img + (q4 ? moe_q4_scale_offset(n_rows, n_cols)
                                       : moe_i8_scale_offset(n_rows, n_cols)));
    bool ok = q4 ? moe_quant_q4_rows(f32, n_rows, n_cols, group, (uint8_t *)img, scale)
                 : moe_quant_i8_rows(f32, n_rows, n_cols, (int8_t *)img, scale);
    if (!ok) {
        free(img);
        free(f32);
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s' holds a NaN or infinite weight; --dtype %s "
                             "cannot quantize it",
                             ld->dir, name, q4 ? "int4" : "int8");
    }
    if (!ld->m->opts.dequantized) {
        free(f32);
        return upload_weight(ld, name, img, img_bytes, out, err);
    }
    if (q4)
        moe_dequant_q4_rows((const uint8_t *)img, scale, n_rows, n_cols, group, f32);
    else
        moe_dequant_i8_rows((const int8_t *)img, scale, n_rows, n_cols, f32);
    free(img);
    return upload_weight(ld, name, f32, (size_t)n_rows * (size_t)n_cols * sizeof(float), out, err);
}

/* Allocates a backend buffer and fills it with rows [row0, row0+n_rows) and
 * cols [col0, col0+n_cols) of tensor `name` (full shape rows x cols), in
 * `dtype`; I8 quantizes the block (read as f32) row by row. */
static enum moe_status load_block(struct loader *ld, const char *name, int64_t rows, int64_t cols,
                                  int64_t row0, int64_t n_rows, int64_t col0, int64_t n_cols,
                                  enum moe_dtype dtype, void **out, struct moe_error *err)
{
    const struct st_tensor *t;
    enum moe_status rc = find_tensor(ld, name, cols ? 2 : 1, rows, cols, &t, err);
    if (rc)
        return rc;
    if (!cols) { /* 1-D: one row of `rows` elements */
        n_cols = n_rows;
        col0 = row0;
        n_rows = 1;
        row0 = 0;
    }
    const bool quant = dtype == MOE_DTYPE_I8 || dtype == MOE_DTYPE_I4;
    enum moe_dtype read_dtype = quant ? MOE_DTYPE_F32 : dtype;
    size_t bytes = (size_t)n_rows * (size_t)n_cols * moe_dtype_size(read_dtype);
    void *host = weight_host_alloc(bytes);
    if (!host)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory loading '%s'", ld->dir, name);
    rc = st_read_block(t, row0, n_rows, col0, n_cols, read_dtype, host, err);
    if (rc) {
        free(host);
        return rc;
    }
    if (quant)
        return upload_quantized(ld, name, host, n_rows, n_cols, out, err);
    return upload_weight(ld, name, host, bytes, out, err);
}

/* Layer l's q_proj, k_proj and v_proj, this rank's rows of each (from q0
 * and kv0), stacked into one weight in the model's dtype: the forward pass
 * reads the three in one matmul (a decode step's small matrices cost their
 * calls more than their bytes). Rows are quantized one by one, so each
 * holds what it would alone. */
static enum moe_status load_qkv(struct loader *ld, int l, int64_t q0, int64_t kv0, void **out,
                                struct moe_error *err)
{
    const struct moe_model *m = ld->m;
    const struct moe_config *c = &m->cfg;
    const int64_t d = c->d_model, dh = c->d_head;
    const char *proj[3] = {"q_proj", "k_proj", "v_proj"};
    const int64_t full[3] = {(int64_t)c->n_head * dh, (int64_t)c->n_kv_head * dh,
                             (int64_t)c->n_kv_head * dh};
    const int64_t row0[3] = {q0, kv0, kv0}, rows[3] = {m->q_dim, m->kv_dim, m->kv_dim};
    const bool quant = m->opts.dtype == MOE_DTYPE_I8 || m->opts.dtype == MOE_DTYPE_I4;
    const enum moe_dtype read_dtype = quant ? MOE_DTYPE_F32 : m->opts.dtype;
    const size_t row_bytes = (size_t)d * moe_dtype_size(read_dtype);
    const int64_t n_rows = rows[0] + rows[1] + rows[2];
    char name[256];
    char *host = weight_host_alloc((size_t)n_rows * row_bytes);
    if (!host)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory loading layer %d's q/k/v",
                             ld->dir, l);
    for (int i = 0, at = 0; i < 3; at += (int)rows[i], i++) {
        const struct st_tensor *t;
        snprintf(name, sizeof name, "model.layers.%d.self_attn.%s.weight", l, proj[i]);
        enum moe_status rc = find_tensor(ld, name, 2, full[i], d, &t, err);
        if (!rc)
            rc = st_read_block(t, row0[i], rows[i], 0, d, read_dtype, host + (size_t)at * row_bytes,
                               err);
        if (rc) {
            free(host);
            return rc;
        }
    }
    snprintf(name, sizeof name, "model.layers.%d.self_attn.{q,k,v}_proj.weight", l);
    if (quant)
        return upload_quantized(ld, name, (float *)host, n_rows, d, out, err);
    return upload_weight(ld, name, host, (size_t)n_rows * row_bytes, out, err);
}

/* A whole Linear weight (rows, cols), in the model's weight dtype (I8: quantized). */
static enum moe_status load_matrix(struct loader *ld, const char *name, int64_t rows, int64_t cols,
                                   void **out, struct moe_error *err)
{
    return load_block(ld, name, rows, cols, 0, rows, 0, cols, ld->m->opts.dtype, out, err);
}

/* A vector of `dim` f32 elements (a norm weight, a routing bias) into a new
 * backend buffer; with `as_weight` and bf16 weights rounded to bf16 first.
 * Norm weights are, so "--dtype bf16" means every weight of the model in
 * bf16, as model.to(torch.bfloat16) does (int8 models keep their
 * unquantized weights as bf16 models do); DeepSeek-V3's
 * e_score_correction_bias is not (transformers keeps it in fp32). */
static enum moe_status load_vector(struct loader *ld, const char *name, int64_t dim, bool as_weight,
                                   float **out, struct moe_error *err)
{
    const struct st_tensor *t;
    enum moe_status rc = find_tensor(ld, name, 1, dim, 0, &t, err);
    if (rc)
        return rc;
    float *host = malloc((size_t)dim * sizeof *host);
    if (!host)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory loading '%s'", ld->dir, name);
    if ((rc = st_read_block(t, 0, 1, 0, dim, MOE_DTYPE_F32, host, err))) {
        free(host);
        return rc;
    }
    if (as_weight && ld->m->base_dtype == MOE_DTYPE_BF16)
        for (int64_t i = 0; i < dim; i++)
            host[i] = moe_bf16_to_f32(moe_f32_to_bf16(host[i]));
    return upload_weight(ld, name, host, (size_t)dim * sizeof *host, (void **)out, err);
}

static enum moe_status load_norm(struct loader *ld, const char *name, int64_t dim, float **out,
                                 struct moe_error *err)
{
    return load_vector(ld, name, dim, true, out, err);
}

/* A bias vector's slice [off, off + n) of its `full` elements, as f32 (bf16
 * models round it to bf16 first, as they do norms). */
static enum moe_status load_bias(struct loader *ld, const char *name, int64_t full, int64_t off,
                                 int64_t n, float **out, struct moe_error *err)
{
    const struct st_tensor *t;
    enum moe_status rc = find_tensor(ld, name, 1, full, 0, &t, err);
    if (rc)
        return rc;
    float *host = malloc((size_t)n * sizeof *host);
    if (!host)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory loading '%s'", ld->dir, name);
    rc = st_read_block(t, 0, 1, off, n, MOE_DTYPE_F32, host, err);
    if (rc) {
        free(host);
        return rc;
    }
    if (ld->m->base_dtype == MOE_DTYPE_BF16)
        for (int64_t i = 0; i < n; i++)
            host[i] = moe_bf16_to_f32(moe_f32_to_bf16(host[i]));
    return upload_weight(ld, name, host, (size_t)n * sizeof *host, (void **)out, err);
}

/* Loads gate and up projections (each (d_ff, d_model)) into one (2*d_ff, d_model)
 * buffer: gate rows first, then up rows, matching the backend's swiglu. With
 * I8 the fused weight is quantized as one (rows are independent). */
static enum moe_status load_gate_up(struct loader *ld, const char *gate_name, const char *up_name,
                                    int64_t d_ff, int64_t d_model, void **out,
                                    struct moe_error *err)
{
    const struct st_tensor *tg, *tu;
    enum moe_status rc = find_tensor(ld, gate_name, 2, d_ff, d_model, &tg, err);
    if (!rc)
        rc = find_tensor(ld, up_name, 2, d_ff, d_model, &tu, err);
    if (rc)
        return rc;
    const bool quant = ld->m->opts.dtype == MOE_DTYPE_I8 || ld->m->opts.dtype == MOE_DTYPE_I4;
    enum moe_dtype dt = quant ? MOE_DTYPE_F32 : ld->m->opts.dtype;
    size_t half = (size_t)d_ff * (size_t)d_model * moe_dtype_size(dt);
    char *host = weight_host_alloc(2 * half);
    if (!host)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory loading '%s'", ld->dir,
                             gate_name);
    rc = st_read_block(tg, 0, d_ff, 0, d_model, dt, host, err);
    if (!rc)
        rc = st_read_block(tu, 0, d_ff, 0, d_model, dt, host + half, err);
    if (rc) {
        free(host);
        return rc;
    }
    if (quant)
        return upload_quantized(ld, gate_name, (float *)host, 2 * d_ff, d_model, out, err);
    return upload_weight(ld, gate_name, host, 2 * half, out, err);
}

/* ---- DeepSeek-V3 latent attention ------------------------------------------- */

/* An (n_rows, n_cols) Linear weight given as host f32, uploaded in the
 * model's weight dtype (int8 / int4: quantized). Frees f32 in every case. */
static enum moe_status upload_linear_f32(struct loader *ld, const char *name, float *f32,
                                         int64_t n_rows, int64_t n_cols, void **out,
                                         struct moe_error *err)
{
    enum moe_dtype dt = ld->m->opts.dtype;
    size_t n = (size_t)n_rows * (size_t)n_cols;
    if (dt == MOE_DTYPE_I8 || dt == MOE_DTYPE_I4)
        return upload_quantized(ld, name, f32, n_rows, n_cols, out, err);
    if (dt == MOE_DTYPE_BF16) {
        uint16_t *b = weight_host_alloc(n * sizeof *b);
        if (!b) {
            free(f32);
            return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory loading '%s'", ld->dir,
                                 name);
        }
        for (size_t i = 0; i < n; i++)
            b[i] = moe_f32_to_bf16(f32[i]);
        free(f32);
        return upload_weight(ld, name, b, n * sizeof *b, out, err);
    }
    return upload_weight(ld, name, f32, n * sizeof *f32, out, err);
}

/* Rows [row0, row0 + n_rows) of the 2-D tensor `name` (rows, cols), as host
 * f32 in *out (the caller frees it). */
static enum moe_status read_rows_f32(struct loader *ld, const char *name, int64_t rows,
                                     int64_t cols, int64_t row0, int64_t n_rows, float **out,
                                     struct moe_error *err)
{
    const struct st_tensor *t;
    enum moe_status rc = find_tensor(ld, name, 2, rows, cols, &t, err);
    if (rc)
        return rc;
    float *host = malloc((size_t)n_rows * (size_t)cols * sizeof *host + 1);
    if (!host)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory loading '%s'", ld->dir, name);
    if ((rc = st_read_block(t, row0, n_rows, 0, cols, MOE_DTYPE_F32, host, err))) {
        free(host);
        return rc;
    }
    *out = host;
    return MOE_OK;
}

/* A new (n_rows, cols) copy of rows [row0, row0 + n_rows) of src, and with
 * `deinterleave` each run of r rotary rows reordered from pairs (x0, x1),
 * (x2, x3), ... to halves (x0, x2, ..., x1, x3, ...): rope's rotate-half
 * form then computes what transformers' interleaved form does. */
static float *take_rows(const float *src, int64_t cols, int64_t row0, int64_t n_rows, int r,
                        bool deinterleave)
{
    float *dst = malloc((size_t)n_rows * (size_t)cols * sizeof *dst + 1);
    if (!dst)
        return NULL;
    for (int64_t i = 0; i < n_rows; i++) {
        int64_t from = i;
        if (deinterleave) {
            int64_t run = i / r, j = i % r;
            from = run * r + (j < r / 2 ? 2 * j : 2 * (j - r / 2) + 1);
        }
        memcpy(dst + i * cols, src + (row0 + from) * cols, (size_t)cols * sizeof *dst);
    }
    return dst;
}

/* Where an int8 / int4 weight's scales start (NULL for f32 and bf16). */
static const float *lin_scales(const struct moe_model *m, const void *w, int64_t n_out,
                               int64_t n_in)
{
    if (m->lin_dtype == MOE_DTYPE_I8)
        return (const float *)((const char *)w + moe_i8_scale_offset(n_out, n_in));
    if (m->lin_dtype == MOE_DTYPE_I4)
        return (const float *)((const char *)w + moe_q4_scale_offset(n_out, n_in));
    return NULL;
}

/* The latent attention of layer l for this rank's heads: the query (through
 * q_lora_rank or not) split into its no-rope and rotary parts, the
 * compressed KV row and the shared rotary key (replicated on every rank),
 * and kv_b_proj cut per head into the key part (transposed, to absorb into
 * the query) and the value part. */
static enum moe_status load_mla(struct loader *ld, int l, struct moe_error *err)
{
    struct moe_model *m = ld->m;
    const struct moe_config *c = &m->cfg;
    struct layer_weights *w = &m->layers[l];
    const int64_t d = c->d_model, H = c->n_head, Hl = m->n_head_local;
    const int64_t h0 = (int64_t)m->opts.tp_rank * Hl;
    const int64_t dn = c->qk_nope_dim, R = c->d_head, L = c->kv_lora_rank, dv = c->v_head_dim;
    const int64_t q_in = c->q_lora_rank ? c->q_lora_rank : d;
    const bool il = c->rope_interleave;
    char name[256];
    enum moe_status rc;
    float *full = NULL, *a = NULL, *b = NULL;
#define NAME(...) snprintf(name, sizeof name, __VA_ARGS__)
#define TAKE(dst, src, cols, row0, n_rows, deint)                                                  \
    do {                                                                                           \
        if (!((dst) = take_rows(src, cols, row0, n_rows, (int)R, deint))) {                        \
            rc = moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory loading '%s'", ld->dir,      \
                               name);                                                              \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)
    if (c->q_lora_rank) {
        NAME("model.layers.%d.self_attn.q_a_proj.weight", l);
        if ((rc = load_matrix(ld, name, c->q_lora_rank, d, &w->wq_a, err)))
            return rc;
        NAME("model.layers.%d.self_attn.q_a_layernorm.weight", l);
        if ((rc = load_norm(ld, name, c->q_lora_rank, &w->q_a_norm, err)))
            return rc;
        NAME("model.layers.%d.self_attn.q_b_proj.weight", l);
    } else {
        NAME("model.layers.%d.self_attn.q_proj.weight", l);
    }
    /* this rank's heads, each dn no-rope rows then R rotary rows */
    if ((rc =
             read_rows_f32(ld, name, H * (dn + R), q_in, h0 * (dn + R), Hl * (dn + R), &full, err)))
        return rc;
    if (!(a = malloc((size_t)(Hl * dn * q_in) * sizeof *a + 1)) ||
        !(b = malloc((size_t)(Hl * R * q_in) * sizeof *b + 1))) {
        rc = moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory loading '%s'", ld->dir, name);
        goto out;
    }
    for (int64_t h = 0; h < Hl; h++) {
        const float *head = full + h * (dn + R) * q_in;
        memcpy(a + h * dn * q_in, head, (size_t)(dn * q_in) * sizeof *a);
        float *rot = NULL;
        TAKE(rot, head, q_in, dn, R, il);
        memcpy(b + h * R * q_in, rot, (size_t)(R * q_in) * sizeof *b);
        free(rot);
    }
    free(full);
    full = NULL;
    rc = upload_linear_f32(ld, name, a, Hl * dn, q_in, &w->wq_nope, err);
    a = NULL;
    if (rc || (rc = upload_linear_f32(ld, name, b, Hl * R, q_in, &w->wq_rope, err))) {
        b = NULL;
        goto out;
    }
    b = NULL;

    NAME("model.layers.%d.self_attn.kv_a_proj_with_mqa.weight", l);
    if ((rc = read_rows_f32(ld, name, L + R, d, 0, L + R, &full, err)))
        goto out;
    TAKE(a, full, d, 0, L, false);
    TAKE(b, full, d, L, R, il);
    rc = upload_linear_f32(ld, name, a, L, d, &w->wkv_a, err);
    a = NULL;
    if (rc || (rc = upload_linear_f32(ld, name, b, R, d, &w->wk_rope, err))) {
        b = NULL;
        goto out;
    }
    b = NULL;
    free(full);
    full = NULL;
    NAME("model.layers.%d.self_attn.kv_a_layernorm.weight", l);
    if ((rc = load_norm(ld, name, L, &w->kv_a_norm, err)))
        goto out;

    NAME("model.layers.%d.self_attn.kv_b_proj.weight", l);
    if ((rc =
             read_rows_f32(ld, name, H * (dn + dv), L, h0 * (dn + dv), Hl * (dn + dv), &full, err)))
        goto out;
    w->w_uk_t = calloc((size_t)Hl, sizeof *w->w_uk_t);
    w->w_uv = calloc((size_t)Hl, sizeof *w->w_uv);
    w->w_uk_scale = calloc((size_t)Hl, sizeof *w->w_uk_scale);
    w->w_uv_scale = calloc((size_t)Hl, sizeof *w->w_uv_scale);
    if (!w->w_uk_t || !w->w_uv || !w->w_uk_scale || !w->w_uv_scale) {
        rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (int64_t h = 0; h < Hl; h++) {
        const float *uk = full + h * (dn + dv) * L; /* (dn, L) */
        if (!(a = malloc((size_t)(L * dn) * sizeof *a))) {
            rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
            goto out;
        }
        for (int64_t i = 0; i < dn; i++)
            for (int64_t j = 0; j < L; j++)
                a[j * dn + i] = uk[i * L + j];
        rc = upload_linear_f32(ld, name, a, L, dn, &w->w_uk_t[h], err);
        a = NULL;
        if (rc)
            goto out;
        TAKE(b, full + (h * (dn + dv) + dn) * L, L, 0, dv, false);
        rc = upload_linear_f32(ld, name, b, dv, L, &w->w_uv[h], err);
        b = NULL;
        if (rc)
            goto out;
        w->w_uk_scale[h] = lin_scales(m, w->w_uk_t[h], L, dn);
        w->w_uv_scale[h] = lin_scales(m, w->w_uv[h], dv, L);
    }
    NAME("model.layers.%d.self_attn.o_proj.weight", l);
    rc = load_block(ld, name, d, H * dv, 0, d, h0 * dv, Hl * dv, m->opts.dtype, &w->wo, err);
out:
    free(full);
    free(a);
    free(b);
#undef TAKE
#undef NAME
    return rc;
}

/* Loads expert e of MoE layer l: gate and up fused, and down. */
static enum moe_status load_expert(struct loader *ld, int l, int e, void **gate_up, void **down,
                                   struct moe_error *err)
{
    const struct moe_config *c = &ld->m->cfg;
    const char *moe = c->arch == MOE_ARCH_MIXTRAL ? "block_sparse_moe" : "mlp";
    const char *g = c->arch == MOE_ARCH_MIXTRAL ? "w1" : "gate_proj";
    const char *u = c->arch == MOE_ARCH_MIXTRAL ? "w3" : "up_proj";
    const char *dn = c->arch == MOE_ARCH_MIXTRAL ? "w2" : "down_proj";
    char name[256], name2[256];
    snprintf(name, sizeof name, "model.layers.%d.%s.experts.%d.%s.weight", l, moe, e, g);
    snprintf(name2, sizeof name2, "model.layers.%d.%s.experts.%d.%s.weight", l, moe, e, u);
    enum moe_status rc = load_gate_up(ld, name, name2, c->d_ff_expert, c->d_model, gate_up, err);
    if (rc)
        return rc;
    snprintf(name, sizeof name, "model.layers.%d.%s.experts.%d.%s.weight", l, moe, e, dn);
    return load_matrix(ld, name, c->d_model, c->d_ff_expert, down, err);
}

static enum moe_status load_layer(struct loader *ld, int l, struct moe_error *err)
{
    struct moe_model *m = ld->m;
    const struct moe_config *c = &m->cfg;
    struct layer_weights *w = &m->layers[l];
    const int64_t d = c->d_model, dh = c->d_head;
    const int64_t q0 = (int64_t)m->opts.tp_rank * m->q_dim;
    const int64_t kv0 = (int64_t)m->opts.tp_rank * m->kv_dim;
    char name[256], name2[256];
    enum moe_status rc;

#define NAME(buf, ...) snprintf(buf, sizeof buf, __VA_ARGS__)
    NAME(name, "model.layers.%d.input_layernorm.weight", l);
    if ((rc = load_norm(ld, name, d, &w->attn_norm, err)))
        return rc;
    NAME(name, "model.layers.%d.post_attention_layernorm.weight", l);
    if ((rc = load_norm(ld, name, d, &w->ffn_norm, err)))
        return rc;
    if (c->mla) {
        if ((rc = load_mla(ld, l, err)))
            return rc;
        goto ffn;
    }
    if ((rc = load_qkv(ld, l, q0, kv0, &w->wqkv, err)))
        return rc;
    NAME(name, "model.layers.%d.self_attn.o_proj.weight", l);
    if ((rc = load_block(ld, name, d, (int64_t)c->n_head * dh, 0, d, q0, m->q_dim, m->opts.dtype,
                         &w->wo, err)))
        return rc;
    if (c->qkv_bias) {
        NAME(name, "model.layers.%d.self_attn.q_proj.bias", l);
        if ((rc = load_bias(ld, name, (int64_t)c->n_head * dh, q0, m->q_dim, &w->bq, err)))
            return rc;
        NAME(name, "model.layers.%d.self_attn.k_proj.bias", l);
        if ((rc = load_bias(ld, name, (int64_t)c->n_kv_head * dh, kv0, m->kv_dim, &w->bk, err)))
            return rc;
        NAME(name, "model.layers.%d.self_attn.v_proj.bias", l);
        if ((rc = load_bias(ld, name, (int64_t)c->n_kv_head * dh, kv0, m->kv_dim, &w->bv, err)))
            return rc;
    }
    if (c->qk_norm_full) { /* OLMoE: one norm over all heads (one rank: see check_opts) */
        NAME(name, "model.layers.%d.self_attn.q_norm.weight", l);
        if ((rc = load_norm(ld, name, (int64_t)c->n_head * dh, &w->q_norm, err)))
            return rc;
        NAME(name, "model.layers.%d.self_attn.k_norm.weight", l);
        if ((rc = load_norm(ld, name, (int64_t)c->n_kv_head * dh, &w->k_norm, err)))
            return rc;
    }
    if (c->qk_norm) {
        NAME(name, "model.layers.%d.self_attn.q_norm.weight", l);
        if ((rc = load_norm(ld, name, dh, &w->q_norm, err)))
            return rc;
        NAME(name, "model.layers.%d.self_attn.k_norm.weight", l);
        if ((rc = load_norm(ld, name, dh, &w->k_norm, err)))
            return rc;
    }

ffn:
    w->is_moe = c->layer_is_moe[l];
    const char *moe = c->arch == MOE_ARCH_MIXTRAL ? "block_sparse_moe" : "mlp";
    if (!w->is_moe) {
        NAME(name, "model.layers.%d.mlp.gate_proj.weight", l);
        NAME(name2, "model.layers.%d.mlp.up_proj.weight", l);
        if ((rc = load_gate_up(ld, name, name2, c->d_ff_dense, d, &w->dense_gate_up, err)))
            return rc;
        NAME(name, "model.layers.%d.mlp.down_proj.weight", l);
        return load_matrix(ld, name, d, c->d_ff_dense, &w->dense_down, err);
    }
    /* The router stays unquantized (base_dtype): int8 noise on its logits
     * could flip an expert choice, which changes a token's output far more
     * than the noise itself; it is also tiny. */
    NAME(name, "model.layers.%d.%s.gate.weight", l, moe);
    if ((rc = load_block(ld, name, c->n_expert, d, 0, c->n_expert, 0, d, m->base_dtype, &w->router,
                         err)))
        return rc;
    if (c->router_sigmoid) {
        NAME(name, "model.layers.%d.mlp.gate.e_score_correction_bias", l);
        if ((rc = load_vector(ld, name, c->n_expert, false, &w->router_bias, err)))
            return rc;
    }
    if (c->d_ff_shared > 0) { /* replicated: every rank computes it for its batch */
        /* Qwen2-MoE: one gated shared_expert; DeepSeek-V3: n_shared_experts
         * fused into one MLP, shared_experts, weight 1 */
        const char *sh = c->arch == MOE_ARCH_DEEPSEEK_V3 ? "shared_experts" : "shared_expert";
        NAME(name, "model.layers.%d.mlp.%s.gate_proj.weight", l, sh);
        NAME(name2, "model.layers.%d.mlp.%s.up_proj.weight", l, sh);
        if ((rc = load_gate_up(ld, name, name2, c->d_ff_shared, d, &w->shared_gate_up, err)))
            return rc;
        NAME(name, "model.layers.%d.mlp.%s.down_proj.weight", l, sh);
        if ((rc = load_matrix(ld, name, d, c->d_ff_shared, &w->shared_down, err)))
            return rc;
        if (c->arch == MOE_ARCH_QWEN2_MOE) {
            NAME(name, "model.layers.%d.mlp.shared_expert_gate.weight", l);
            if ((rc = load_block(ld, name, 1, d, 0, 1, 0, d, m->base_dtype, &w->shared_gate, err)))
                return rc;
        }
    }
    w->w_gate_up = calloc((size_t)c->n_expert, sizeof *w->w_gate_up);
    w->w_down = calloc((size_t)c->n_expert, sizeof *w->w_down);
    if (!w->w_gate_up || !w->w_down)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    for (int e = 0; e < c->n_expert; e++) {
        if (m->ep_comm && !moe_placement_holds(&m->placement, l, e, m->ep_comm->rank))
            continue; /* another rank's expert */
        if ((rc = load_expert(ld, l, e, &w->w_gate_up[e], &w->w_down[e], err)))
            return rc;
    }
#undef NAME
    return MOE_OK;
}

static enum moe_status check_opts(const struct moe_config *c, const struct moe_model_opts *o,
                                  const char *dir, struct moe_error *err)
{
    if (o->dtype != MOE_DTYPE_F32 && o->dtype != MOE_DTYPE_BF16 && o->dtype != MOE_DTYPE_I8 &&
        o->dtype != MOE_DTYPE_I4)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "weight dtype %s is not supported (use f32, bf16, int8 or int4)",
                             moe_dtype_name(o->dtype));
    if (o->dequantized && o->dtype != MOE_DTYPE_I8 && o->dtype != MOE_DTYPE_I4)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "dequantized needs weight dtype I8 or I4, not %s",
                             moe_dtype_name(o->dtype));
    if (o->dtype == MOE_DTYPE_I4 && o->q4_group && !moe_q4_group_valid(o->q4_group))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "--group-size %d: the int4 group size is 32, 64 or 128", o->q4_group);
    if (!moe_kv_dtype_valid(o->kv_dtype))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "KV cache dtype %s is not supported (use f32 or bf16)",
                             moe_dtype_name(o->kv_dtype));
    if (o->tp_size < 1 || o->tp_rank < 0 || o->tp_rank >= o->tp_size)
        return moe_error_set(err, MOE_ERR_INVALID, "tensor-parallel rank %d of %d is invalid",
                             o->tp_rank, o->tp_size);
    if (c->qk_norm_full && o->tp_size > 1)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "%s: OLMoE's q_norm and k_norm span all heads; tensor parallel "
                             "(--tp %d) would need their sums across ranks, not implemented",
                             dir, o->tp_size);
    if (c->n_head % o->tp_size)
        return moe_error_set(
            err, MOE_ERR_INVALID,
            "%s: num_attention_heads %d is not divisible by tensor-parallel size %d", dir,
            c->n_head, o->tp_size);
    if (o->tp_size > 1 &&
        (!o->tp_comm || o->tp_comm->size != o->tp_size || o->tp_comm->rank != o->tp_rank))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "tensor-parallel size %d needs a communicator of that size",
                             o->tp_size);
    if (o->ep_comm && o->ep_comm->size > MOE_MAX_EP_RANKS)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED, "expert parallel over %d ranks (at most %d)",
                             o->ep_comm->size, MOE_MAX_EP_RANKS);
    if (c->n_kv_head % o->tp_size)
        return moe_error_set(
            err, MOE_ERR_UNSUPPORTED,
            "%s: num_key_value_heads %d is not divisible by tensor-parallel size %d "
            "(replicating KV heads is not implemented)",
            dir, c->n_kv_head, o->tp_size);
    return MOE_OK;
}

enum moe_status moe_model_load(const char *dir, const struct moe_model_opts *opts,
                               struct moe_backend *be, struct moe_model **out,
                               struct moe_error *err)
{
    *out = NULL;
    struct moe_model *m = calloc(1, sizeof *m);
    if (!m)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    m->be = be;
    m->opts = *opts;
    m->lin_dtype = opts->dtype;
    m->base_dtype = opts->dtype;
    if (opts->dtype == MOE_DTYPE_I8 || opts->dtype == MOE_DTYPE_I4) {
        m->lin_dtype = opts->dequantized ? MOE_DTYPE_F32 : opts->dtype;
        m->base_dtype = MOE_DTYPE_BF16;
    }
    m->q4_group = opts->q4_group ? opts->q4_group : 32;
    struct loader ld = {.m = m, .dir = dir};
    enum moe_status rc;
    if (!(m->dir = strdup(dir))) {
        free(m);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }

    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if ((rc = moe_config_load(path, &m->cfg, err)))
        goto fail;
    const struct moe_config *c = &m->cfg;
    if ((rc = check_opts(c, opts, dir, err)))
        goto fail;
    if ((m->lin_dtype == MOE_DTYPE_I8 || m->lin_dtype == MOE_DTYPE_I4) &&
        be->device != MOE_DEVICE_CPU) {
        /* Refused here, before any weight moves: the CUDA matmuls would
         * reject every call and the forward pass would only fail later. */
        rc = moe_error_set(err, MOE_ERR_UNSUPPORTED,
                           "--dtype %s: the %s backend has no %s kernels yet; use --device cpu",
                           m->lin_dtype == MOE_DTYPE_I8 ? "int8" : "int4", be->name,
                           m->lin_dtype == MOE_DTYPE_I8 ? "int8" : "int4");
        goto fail;
    }
    m->tp_comm = opts->tp_size > 1 ? opts->tp_comm : NULL;
    m->ep_comm = opts->ep_comm && opts->ep_comm->size > 1 ? opts->ep_comm : NULL;
    if (m->ep_comm) {
        int w = m->ep_comm->size;
        if (opts->placement) {
            const struct moe_placement *pl = opts->placement;
            if (pl->n_rank != w || pl->n_expert != c->n_expert || pl->n_layer != c->n_layer) {
                rc = moe_error_set(err, MOE_ERR_INVALID,
                                   "placement is for %d experts x %d layers on %d ranks; the model "
                                   "has %d x %d and the group %d ranks",
                                   pl->n_expert, pl->n_layer, pl->n_rank, c->n_expert, c->n_layer,
                                   w);
                goto fail;
            }
            rc = moe_placement_default(c->n_layer, c->n_expert, w, &m->placement, err);
            if (!rc) {
                size_t n = (size_t)c->n_layer * c->n_expert;
                memcpy(m->placement.n_replicas, pl->n_replicas, n);
                memcpy(m->placement.ranks, pl->ranks,
                       n * MOE_PLACEMENT_MAX_REPLICAS * sizeof *pl->ranks);
            }
        } else {
            rc = moe_placement_default(c->n_layer, c->n_expert, w, &m->placement, err);
        }
        if (rc)
            goto fail;
    }
    if (!be->ops->copy_cols) { /* attention splits its stacked q/k/v projection with it */
        rc = moe_error_set(err, MOE_ERR_UNSUPPORTED, "%s: the %s backend has no copy_cols op", dir,
                           be->name);
        goto fail;
    }
    if ((c->mla || c->router_sigmoid) && !be->ops->router_topk_grouped) {
        rc = moe_error_set(err, MOE_ERR_UNSUPPORTED,
                           "%s: DeepSeek-V3 needs the latent-attention and grouped-routing ops, "
                           "which the %s backend does not have yet (use --device cpu)",
                           dir, be->name);
        goto fail;
    }
    m->n_head_local = c->n_head / opts->tp_size;
    m->n_kv_head_local = c->mla ? 1 : c->n_kv_head / opts->tp_size;
    /* MLA: q_dim is what reaches o_proj (the heads' values) */
    m->q_dim = m->n_head_local * (c->mla ? c->v_head_dim : c->d_head);
    if (!(m->rope_inv_freq = malloc((size_t)(c->d_head / 2 + 1) * sizeof *m->rope_inv_freq))) {
        rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        goto fail;
    }
    moe_rope_inv_freq(c, m->rope_inv_freq);
    m->kv_dim = c->mla ? c->kv_lora_rank + c->d_head : m->n_kv_head_local * c->d_head;

    if ((rc = st_open(dir, &ld.st, err)))
        goto fail;
    if ((rc = load_block(&ld, "model.embed_tokens.weight", c->vocab_size, c->d_model, 0,
                         c->vocab_size, 0, c->d_model, m->base_dtype, &m->embed, err)))
        goto fail;
    if ((rc = load_norm(&ld, "model.norm.weight", c->d_model, &m->final_norm, err)))
        goto fail;
    if (c->tie_word_embeddings && m->lin_dtype == m->base_dtype) {
        m->lm_head = m->embed;
    } else if (c->tie_word_embeddings) { /* int8 lm_head: a quantized copy of the table */
        if ((rc = load_matrix(&ld, "model.embed_tokens.weight", c->vocab_size, c->d_model,
                              &m->lm_head, err)))
            goto fail;
    } else if ((rc = load_matrix(&ld, "lm_head.weight", c->vocab_size, c->d_model, &m->lm_head,
                                 err))) {
        goto fail;
    }
    m->layers = calloc((size_t)c->n_layer, sizeof *m->layers);
    m->expert_tokens =
        calloc((size_t)c->n_layer * (c->n_expert > 0 ? c->n_expert : 1), sizeof *m->expert_tokens);
    if (!m->layers || !m->expert_tokens) {
        rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        goto fail;
    }
    for (int l = 0; l < c->n_layer; l++)
        if ((rc = load_layer(&ld, l, err)))
            goto fail;
    st_close(ld.st);
    *out = m;
    return MOE_OK;

fail:
    st_close(ld.st);
    moe_model_free(m);
    return rc;
}

void moe_model_free(struct moe_model *m)
{
    if (!m)
        return;
    struct moe_backend *be = m->be;
#define FREE_BUF(p)                                                                                \
    do {                                                                                           \
        if (p)                                                                                     \
            be->ops->buf_free(be, p);                                                              \
    } while (0)
    if (m->layers) {
        for (int l = 0; l < m->cfg.n_layer; l++) {
            struct layer_weights *w = &m->layers[l];
            FREE_BUF(w->attn_norm);
            FREE_BUF(w->ffn_norm);
            FREE_BUF(w->wqkv);
            FREE_BUF(w->wo);
            FREE_BUF(w->q_norm);
            FREE_BUF(w->k_norm);
            FREE_BUF(w->router);
            FREE_BUF(w->dense_gate_up);
            FREE_BUF(w->dense_down);
            FREE_BUF(w->bq);
            FREE_BUF(w->bk);
            FREE_BUF(w->bv);
            FREE_BUF(w->shared_gate_up);
            FREE_BUF(w->shared_down);
            FREE_BUF(w->shared_gate);
            FREE_BUF(w->wq_a);
            FREE_BUF(w->q_a_norm);
            FREE_BUF(w->wq_nope);
            FREE_BUF(w->wq_rope);
            FREE_BUF(w->wkv_a);
            FREE_BUF(w->wk_rope);
            FREE_BUF(w->kv_a_norm);
            FREE_BUF(w->router_bias);
            for (int h = 0; w->w_uk_t && h < m->n_head_local; h++)
                FREE_BUF(w->w_uk_t[h]);
            for (int h = 0; w->w_uv && h < m->n_head_local; h++)
                FREE_BUF(w->w_uv[h]);
            free(w->w_uk_t);
            free(w->w_uv);
            free(w->w_uk_scale);
            free(w->w_uv_scale);
            for (int e = 0; w->w_gate_up && e < m->cfg.n_expert; e++)
                FREE_BUF(w->w_gate_up[e]);
            for (int e = 0; w->w_down && e < m->cfg.n_expert; e++)
                FREE_BUF(w->w_down[e]);
            free(w->w_gate_up);
            free(w->w_down);
        }
        free(m->layers);
    }
    if (m->lm_head != m->embed)
        FREE_BUF(m->lm_head);
    FREE_BUF(m->embed);
    FREE_BUF(m->final_norm);
#undef FREE_BUF
    moe_model_scratch_free(m);
    free(m->h_pad);
    moe_model_drop_placement(m); /* a prepared, uncommitted placement */
    moe_placement_free(&m->placement);
    free(m->expert_tokens);
    free(m->dir);
    free(m->rope_inv_freq);
    free(m);
}

const struct moe_config *moe_model_config(const struct moe_model *m)
{
    return &m->cfg;
}

size_t moe_model_weight_bytes(const struct moe_model *m)
{
    return m->weight_bytes;
}

enum moe_status moe_model_load_expert(struct moe_model *m, struct st_model *st, int l, int e,
                                      void **gate_up, void **down, struct moe_error *err)
{
    struct loader ld = {.m = m, .st = st, .dir = m->dir};
    return load_expert(&ld, l, e, gate_up, down, err);
}

/* ---- KV caches of this model's shape -------------------------------------------- */

enum moe_dtype moe_model_kv_dtype(const struct moe_model *m)
{
    return m->opts.kv_dtype;
}

enum moe_status moe_kv_cache_create(const struct moe_model *m, int n_block, int block_size,
                                    struct moe_kv_cache **out, struct moe_error *err)
{
    return moe_kv_cache_alloc(m->be, m->cfg.n_layer, n_block, block_size, m->kv_dim, m->cfg.mla,
                              m->opts.kv_dtype, out, err);
}

void moe_kv_cache_free(const struct moe_model *m, struct moe_kv_cache *kv)
{
    if (kv) /* as free(NULL): a start-up that failed before the model calls it with neither */
        moe_kv_cache_release(m->be, kv);
}
