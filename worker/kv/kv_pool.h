/* The block allocator of the paged KV cache, with prefix caching.
 *
 * Blocks are referred to by index. A block is in one of three states:
 *   free       refcount 0, no contents worth keeping: on the free list;
 *   in use     refcount > 0: held by one or more sequences' block tables;
 *   cached     refcount 0 but full and registered under its prefix hash: on an
 *              LRU list, found again by kv_pool_lookup, and reclaimed (oldest
 *              first) only when the free list is empty.
 * Allocation, reference and release are O(1); lookup is one hash probe.
 *
 * A full block is identified by the chained hash of its tokens and its
 * parent's hash, and the tokens themselves are kept so a hash collision can
 * never share the wrong block. Shared blocks are never written: only the
 * sequence holding the sole reference to a partial block appends to it. */
#ifndef MOE_KV_POOL_H
#define MOE_KV_POOL_H

#include <stdbool.h>
#include <stdint.h>

#include "moe_error.h"

struct kv_pool;

struct kv_pool_stats {
    int n_block;
    int n_free;        /* on the free list */
    int n_cached;      /* refcount 0, kept for prefix hits */
    int n_used;        /* refcount > 0 */
    int64_t lookups;   /* prefix-cache lookups */
    int64_t hits;      /* ... that found a block */
    int64_t evictions; /* cached blocks reclaimed for new allocations */
};

enum moe_status kv_pool_create(int n_block, int block_size, struct kv_pool **out,
                               struct moe_error *err);
void kv_pool_destroy(struct kv_pool *p);

int kv_pool_block_size(const struct kv_pool *p);

/* Blocks that an allocation can take now (free + cached). */
int kv_pool_available(const struct kv_pool *p);

/* Blocks on the free list alone: what can be taken without evicting a
 * prefix-cache block. */
int kv_pool_free_count(const struct kv_pool *p);

/* A block with refcount 1, or -1 when none is free or cached. A reclaimed
 * cached block loses its hash. */
int32_t kv_pool_alloc(struct kv_pool *p);

/* One more reference to an in-use block. */
void kv_pool_ref(struct kv_pool *p, int32_t block);

/* Drops one reference. At zero the block goes to the cached LRU if it carries
 * a hash, else to the free list. Releasing a block with refcount 0 is an
 * invariant violation (assert). */
void kv_pool_release(struct kv_pool *p, int32_t block);

int kv_pool_refcount(const struct kv_pool *p, int32_t block);

/* Hash of a full block of `block_size` tokens after a parent hash (0 for the
 * first block of a sequence). */
uint64_t kv_pool_hash(uint64_t parent, const int32_t *tokens, int block_size);

/* Finds the cached or in-use block holding exactly `tokens` after `parent`
 * with hash `hash`; on a hit takes a reference and returns it, else -1. */
int32_t kv_pool_lookup(struct kv_pool *p, uint64_t hash, uint64_t parent, const int32_t *tokens);

/* Registers a full, in-use block under `hash` so later sequences can share it.
 * If another block already holds that content, nothing changes (returns false). */
bool kv_pool_publish(struct kv_pool *p, int32_t block, uint64_t hash, uint64_t parent,
                     const int32_t *tokens);

void kv_pool_stats(const struct kv_pool *p, struct kv_pool_stats *out);

/* Checks every invariant (lists partition the blocks, refcounts match the
 * lists, hash index consistent). `expected_refs[b]`, if not NULL, is the
 * number of references the caller believes block b has. Returns MOE_OK or
 * MOE_ERR_INTERNAL with a message naming the first broken invariant. */
enum moe_status kv_pool_check(const struct kv_pool *p, const int *expected_refs,
                              struct moe_error *err);

#endif
