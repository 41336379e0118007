/* KV caches: allocation on a backend (see kv_cache.h). */
#include "kv/kv_cache.h"

#include <stdlib.h>

enum moe_status moe_kv_cache_alloc(struct moe_backend *be, int n_layer, int n_block, int block_size,
                                   int kv_dim, struct moe_kv_cache **out, struct moe_error *err)
{
    *out = NULL;
    if (n_layer <= 0 || n_block <= 0 || block_size <= 0 || kv_dim <= 0)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "KV cache of %d layers x %d blocks of %d tokens x %d floats is "
                             "invalid",
                             n_layer, n_block, block_size, kv_dim);
    struct moe_kv_cache *kv = calloc(1, sizeof *kv);
    if (!kv)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&kv->fence, NULL);
    kv->n_layer = n_layer;
    kv->n_block = n_block;
    kv->block_size = block_size;
    kv->kv_dim = kv_dim;
    kv->k = calloc((size_t)kv->n_layer, sizeof *kv->k);
    kv->v = calloc((size_t)kv->n_layer, sizeof *kv->v);
    if (!kv->k || !kv->v)
        goto nomem;
    size_t bytes = (size_t)n_block * (size_t)block_size * (size_t)kv->kv_dim * sizeof(float);
    for (int l = 0; l < kv->n_layer; l++) {
        kv->k[l] = be->ops->buf_alloc(be, bytes);
        kv->v[l] = be->ops->buf_alloc(be, bytes);
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
        if (kv->v && kv->v[l])
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
