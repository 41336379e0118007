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
 * sequence holding the sole reference to a partial block appends to it.
 *
 * A pool may be split into equal parts (data-parallel attention: part i is
 * the KV cache of group rank i, blocks [i * n/parts, (i + 1) * n/parts)):
 * each part has its own free and cached lists, and a sequence takes all its
 * blocks from one part (the _in calls). Prefix hits stay within a part when
 * each part's hash chains start from its own seed (kv_pool_part_seed). */
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
/* The same in n_part equal parts (n_block a multiple of n_part). */
enum moe_status kv_pool_create_parts(int n_block, int block_size, int n_part, struct kv_pool **out,
                                     struct moe_error *err);
void kv_pool_destroy(struct kv_pool *p);

int kv_pool_n_part(const struct kv_pool *p);
int kv_pool_part_of(const struct kv_pool *p, int32_t block);

int kv_pool_block_size(const struct kv_pool *p);

/* Blocks that an allocation can take now (free + cached). */
int kv_pool_available(const struct kv_pool *p);

/* Blocks on the free list alone: what can be taken without evicting a
 * prefix-cache block. */
int kv_pool_free_count(const struct kv_pool *p);

/* The same within one part. */
int kv_pool_available_in(const struct kv_pool *p, int part);
int kv_pool_free_count_in(const struct kv_pool *p, int part);

/* A block with refcount 1, or -1 when none is free or cached. A reclaimed
 * cached block loses its hash. */
int32_t kv_pool_alloc(struct kv_pool *p);

/* The same from part `part` (kv_pool_alloc: from the part with the most free
 * blocks). */
int32_t kv_pool_alloc_in(struct kv_pool *p, int part);

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

/* Whether kv_pool_lookup would hit, without taking a reference or counting. */
bool kv_pool_contains(const struct kv_pool *p, uint64_t hash, uint64_t parent,
                      const int32_t *tokens);

/* The parent hash a sequence's first block chains from in part `part`: 0
 * for part 0 (so a one-part pool hashes as it always has), distinct for the
 * others, so a lookup never finds a block of another part. */
uint64_t kv_pool_part_seed(int part);

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
