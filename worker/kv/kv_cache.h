/* The KV cache of one shard: n_block blocks of block_size token slots, for
 * every layer, K and V of the shard's KV heads, f32, in backend memory. Slot
 * s of layer l is k[l] + s * kv_dim; token t of block b is slot
 * b * block_size + t. Which sequence owns which block is the block pool's
 * business (kv_pool.h); this is only the memory. */
#ifndef MOE_KV_CACHE_H
#define MOE_KV_CACHE_H

#include "backend.h"
#include "moe_error.h"

struct moe_kv_cache {
    int n_layer;
    int n_block;
    int block_size;
    int kv_dim; /* n_kv_head_local * d_head */
    float **k;  /* (n_layer) -> (n_block * block_size, kv_dim) on the backend */
    float **v;
};

/* A cache of any shape on backend `be` (memory zeroed). On error *out is
 * NULL and nothing is allocated. */
enum moe_status moe_kv_cache_alloc(struct moe_backend *be, int n_layer, int n_block, int block_size,
                                   int kv_dim, struct moe_kv_cache **out, struct moe_error *err);

/* Frees a cache made by moe_kv_cache_alloc on the same backend. NULL is a
 * no-op. */
void moe_kv_cache_release(struct moe_backend *be, struct moe_kv_cache *kv);

#endif
