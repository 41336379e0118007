/* KV caches: allocation on a backend (see kv_cache.h). */
#include "kv/kv_cache.h"

#include <stdlib.h>
#include <string.h>

size_t moe_kv_block_bytes(int n_layer, int block_size, int token_elems, enum moe_dtype dtype)
{
    return (size_t)block_size * (size_t)n_layer * (size_t)token_elems * moe_dtype_size(dtype);
}

bool moe_kv_parse_dtype(const char *s, enum moe_dtype *out)
{
    if (!strcmp(s, "f32"))
        *out = MOE_DTYPE_F32;
    else if (!strcmp(s, "bf16"))
        *out = MOE_DTYPE_BF16;
    else
        return false;
    return true;
}

const char *moe_kv_dtype_flag(enum moe_dtype dtype)
{
    return dtype == MOE_DTYPE_F32 ? "f32" : dtype == MOE_DTYPE_BF16 ? "bf16" : "?";
}

enum moe_status moe_kv_cache_alloc(struct moe_backend *be, int n_layer, int n_block, int block_size,
                                   int kv_dim, bool latent, enum moe_dtype dtype,
                                   struct moe_kv_cache **out, struct moe_error *err)
{
    *out = NULL;
    if (n_layer <= 0 || n_block <= 0 || block_size <= 0 || kv_dim <= 0)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "KV cache of %d layers x %d blocks of %d tokens x %d elements is "
                             "invalid",
                             n_layer, n_block, block_size, kv_dim);
    if (!moe_kv_dtype_valid(dtype))
        return moe_error_set(err, MOE_ERR_INVALID, "KV cache dtype %s: only F32 and BF16",
                             moe_dtype_name(dtype));
    /* CUDA reads bf16 caches in its standard attention kernel (opt-in there:
     * F32 stays its default, moe_backend_default_kv_dtype); its latent
     * (MLA) kernel reads f32 only. */
    if (dtype != MOE_DTYPE_F32 && be->device != MOE_DEVICE_CPU && latent)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "--kv-dtype bf16: latent attention (MLA) on the %s backend reads "
                             "f32 KV caches only (use --kv-dtype f32)",
                             be->name);
    struct moe_kv_cache *kv = calloc(1, sizeof *kv);
    if (!kv)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&kv->fence, NULL);
    kv->n_layer = n_layer;
    kv->n_block = n_block;
    kv->block_size = block_size;
    kv->kv_dim = kv_dim;
    kv->dtype = dtype;
    kv->latent = latent;
    kv->k = calloc((size_t)kv->n_layer, sizeof *kv->k);
    kv->v = calloc((size_t)kv->n_layer, sizeof *kv->v);
    if (!kv->k || !kv->v)
        goto nomem;
    size_t bytes =
        (size_t)n_block * (size_t)block_size * (size_t)kv->kv_dim * moe_dtype_size(dtype);
    for (int l = 0; l < kv->n_layer; l++) {
        kv->k[l] = be->ops->buf_alloc(be, bytes);
        kv->v[l] = latent ? kv->k[l] : be->ops->buf_alloc(be, bytes);
        if (!kv->k[l] || !kv->v[l])
            goto nomem;
    }
    *out = kv;
    return MOE_OK;
nomem:
    moe_kv_cache_release(be, kv);
    return moe_error_set(err, MOE_ERR_NOMEM, "cannot allocate a KV cache of %d blocks x %d tokens",
                         n_block, block_size);
}

void moe_kv_cache_release(struct moe_backend *be, struct moe_kv_cache *kv)
{
    if (!kv)
        return;
    for (int l = 0; l < kv->n_layer; l++) {
        if (kv->k && kv->k[l])
            be->ops->buf_free(be, kv->k[l]);
        if (kv->v && kv->v[l] && !kv->latent)
            be->ops->buf_free(be, kv->v[l]);
    }
    free(kv->k);
    free(kv->v);
    pthread_mutex_destroy(&kv->fence);
    free(kv);
}

void moe_kv_cache_fence(struct moe_kv_cache *kv)
{
    if (!kv)
        return;
    pthread_mutex_lock(&kv->fence);
    pthread_mutex_unlock(&kv->fence);
}
