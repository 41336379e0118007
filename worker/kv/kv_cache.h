/* The KV cache of one shard: n_block blocks of block_size token slots, for
 * every layer, K and V of the shard's KV heads, in backend memory, of element
 * type `dtype` (F32, or BF16 on the CPU backend: half the bytes). Slot
 * s of layer l is k[l] + s * kv_dim; token t of block b is slot
 * b * block_size + t. Which sequence owns which block is the block pool's
 * business (kv_pool.h); this is only the memory. */
#ifndef MOE_KV_CACHE_H
#define MOE_KV_CACHE_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>

#include "backend.h"
#include "moe_error.h"

struct moe_kv_cache {
    /* Two kinds of thread touch the memory: the forward pass and the KV data
     * plane (disagg/kv_link.c: slices written into reserved blocks, parked
     * blocks read out). The protocol keeps them apart (a step uses a block
     * only after its handoff was committed; a parked block is read only
     * before it is released), but that order travels through other
     * processes (sockets, MPI). Each side passes the fence around its
     * accesses (moe_kv_cache_fence), so the order also holds, and is
     * visible, inside this process (the memory model, ThreadSanitizer). */
    pthread_mutex_t fence;
    int n_layer;
    int n_block;
    int block_size;
    int kv_dim;           /* n_kv_head_local * d_head; latent: kv_lora_rank + qk_rope_dim */
    enum moe_dtype dtype; /* of every element (moe_kv_dtype_valid) */
    /* One row per token that serves as both K and V (multi-head latent
     * attention: the compressed row and the rotary key): v[l] == k[l], and
     * the memory is counted, sent and freed once. */
    bool latent;
    void **k; /* (n_layer) -> (n_block * block_size, kv_dim) on the backend */
    void **v;
};

/* Bytes of one block of `block_size` tokens of every layer, for
 * token_elems elements of `dtype` per token and layer (K and V: 2 * kv_dim;
 * a latent cache: kv_dim; moe_config_kv_token_elems). What --kv-memory is
 * divided by. */
size_t moe_kv_block_bytes(int n_layer, int block_size, int token_elems, enum moe_dtype dtype);

/* "f32" or "bf16" (the --kv-dtype spellings) into *out; false for anything
 * else. */
bool moe_kv_parse_dtype(const char *s, enum moe_dtype *out);
const char *moe_kv_dtype_flag(enum moe_dtype dtype); /* "f32", "bf16", or "?" */

/* A cache of any shape on backend `be` (memory zeroed); `latent`: one row
 * per token (see struct moe_kv_cache). A dtype the backend cannot hold (BF16
 * off the CPU) is refused by name. On error *out is NULL and nothing is
 * allocated. */
enum moe_status moe_kv_cache_alloc(struct moe_backend *be, int n_layer, int n_block, int block_size,
                                   int kv_dim, bool latent, enum moe_dtype dtype,
                                   struct moe_kv_cache **out, struct moe_error *err);

/* Passes the fence (see struct moe_kv_cache): everything this thread wrote
 * into the cache before is visible to a thread passing it after, and this
 * thread sees what others wrote before they passed it. Call before and after
 * a batch of accesses. NULL is a no-op. */
void moe_kv_cache_fence(struct moe_kv_cache *kv);

/* Frees a cache made by moe_kv_cache_alloc on the same backend. NULL is a
 * no-op. */
void moe_kv_cache_release(struct moe_backend *be, struct moe_kv_cache *kv);

#endif
