#include "kv/kv_pool.h"

#include <stdlib.h>
#include <string.h>

#define NIL (-1)

enum block_list { LIST_NONE = 0, LIST_FREE, LIST_CACHED };

/* Doubly linked list threaded through the per-block prev/next arrays. */
struct list {
    int32_t head;
    int32_t tail;
    int n;
};

struct kv_pool {
    int n_block;
    int block_size;
    int *refcount;      /* (n_block) */
    uint8_t *list;      /* (n_block) enum block_list */
    int32_t *prev;      /* (n_block) */
    int32_t *next;      /* (n_block) */
    bool *has_hash;     /* (n_block) */
    uint64_t *hash;     /* (n_block) */
    uint64_t *parent;   /* (n_block) */
    int32_t *tokens;    /* (n_block, block_size) contents of published blocks */
    int32_t *index;     /* (index_cap) open addressing: block id or NIL */
    uint32_t index_cap; /* power of two >= 2 * n_block */
    struct list free_list;
    struct list cached; /* LRU: head is the oldest */
    int64_t lookups, hits, evictions;
};

static void list_push_back(struct kv_pool *p, struct list *l, enum block_list id, int32_t b)
{
    p->prev[b] = l->tail;
    p->next[b] = NIL;
    if (l->tail != NIL)
        p->next[l->tail] = b;
    else
        l->head = b;
    l->tail = b;
    l->n++;
    p->list[b] = (uint8_t)id;
}

static void list_remove(struct kv_pool *p, struct list *l, int32_t b)
{
    if (p->prev[b] != NIL)
        p->next[p->prev[b]] = p->next[b];
    else
        l->head = p->next[b];
    if (p->next[b] != NIL)
        p->prev[p->next[b]] = p->prev[b];
    else
        l->tail = p->prev[b];
    p->prev[b] = p->next[b] = NIL;
    l->n--;
    p->list[b] = LIST_NONE;
}

enum moe_status kv_pool_create(int n_block, int block_size, struct kv_pool **out,
                               struct moe_error *err)
{
    *out = NULL;
    if (n_block <= 0 || block_size <= 0 || n_block > (1 << 28) || block_size > 4096)
        return moe_error_set(err, MOE_ERR_INVALID, "KV pool of %d blocks of %d tokens is invalid",
                             n_block, block_size);
    struct kv_pool *p = calloc(1, sizeof *p);
    if (!p)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    p->n_block = n_block;
    p->block_size = block_size;
    p->index_cap = 16;
    while (p->index_cap < 2u * (uint32_t)n_block)
        p->index_cap <<= 1;
    size_t n = (size_t)n_block;
    p->refcount = calloc(n, sizeof *p->refcount);
    p->list = calloc(n, sizeof *p->list);
    p->prev = malloc(n * sizeof *p->prev);
    p->next = malloc(n * sizeof *p->next);
    p->has_hash = calloc(n, sizeof *p->has_hash);
    p->hash = calloc(n, sizeof *p->hash);
    p->parent = calloc(n, sizeof *p->parent);
    p->tokens = malloc(n * (size_t)block_size * sizeof *p->tokens);
    p->index = malloc(p->index_cap * sizeof *p->index);
    if (!p->refcount || !p->list || !p->prev || !p->next || !p->has_hash || !p->hash ||
        !p->parent || !p->tokens || !p->index) {
        kv_pool_destroy(p);
        return moe_error_set(err, MOE_ERR_NOMEM, "cannot allocate a KV pool of %d blocks", n_block);
    }
    for (uint32_t i = 0; i < p->index_cap; i++)
        p->index[i] = NIL;
    p->free_list = (struct list){NIL, NIL, 0};
    p->cached = (struct list){NIL, NIL, 0};
    for (int32_t b = 0; b < n_block; b++)
        list_push_back(p, &p->free_list, LIST_FREE, b);
    *out = p;
    return MOE_OK;
}

void kv_pool_destroy(struct kv_pool *p)
{
    if (!p)
        return;
    free(p->refcount);
    free(p->list);
    free(p->prev);
    free(p->next);
    free(p->has_hash);
    free(p->hash);
    free(p->parent);
    free(p->tokens);
    free(p->index);
    free(p);
}

int kv_pool_block_size(const struct kv_pool *p)
{
    return p->block_size;
}

int kv_pool_available(const struct kv_pool *p)
{
    return p->free_list.n + p->cached.n;
}

int kv_pool_free_count(const struct kv_pool *p)
{
    return p->free_list.n;
}

/* ---- hash index (linear probing, backward-shift deletion) -------------------------- */

static uint32_t index_slot(const struct kv_pool *p, uint64_t hash)
{
    return (uint32_t)(hash ^ (hash >> 32)) & (p->index_cap - 1);
}

static void index_insert(struct kv_pool *p, int32_t b)
{
    uint32_t i = index_slot(p, p->hash[b]);
    while (p->index[i] != NIL)
        i = (i + 1) & (p->index_cap - 1);
    p->index[i] = b;
}

static void index_erase(struct kv_pool *p, int32_t b)
{
    uint32_t mask = p->index_cap - 1;
    uint32_t i = index_slot(p, p->hash[b]);
    while (p->index[i] != b) {
        MOE_ASSERT(p->index[i] != NIL);
        i = (i + 1) & mask;
    }
    /* Backward shift: move later entries of the probe run into the hole. */
    uint32_t hole = i;
    for (uint32_t j = (i + 1) & mask; p->index[j] != NIL; j = (j + 1) & mask) {
        uint32_t home = index_slot(p, p->hash[p->index[j]]);
        bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
        if (movable) {
            p->index[hole] = p->index[j];
            hole = j;
        }
    }
    p->index[hole] = NIL;
}

static bool same_content(const struct kv_pool *p, int32_t b, uint64_t hash, uint64_t parent,
                         const int32_t *tokens)
{
    return p->hash[b] == hash && p->parent[b] == parent &&
           !memcmp(p->tokens + (size_t)b * p->block_size, tokens,
                   (size_t)p->block_size * sizeof *tokens);
}

static int32_t index_find(const struct kv_pool *p, uint64_t hash, uint64_t parent,
                          const int32_t *tokens)
{
    for (uint32_t i = index_slot(p, hash); p->index[i] != NIL; i = (i + 1) & (p->index_cap - 1))
        if (same_content(p, p->index[i], hash, parent, tokens))
            return p->index[i];
    return NIL;
}

/* ---- public operations ------------------------------------------------------------- */

int32_t kv_pool_alloc(struct kv_pool *p)
{
    int32_t b;
    if (p->free_list.n) {
        b = p->free_list.head;
        list_remove(p, &p->free_list, b);
    } else if (p->cached.n) {
        b = p->cached.head; /* least recently used */
        list_remove(p, &p->cached, b);
        index_erase(p, b);
        p->has_hash[b] = false;
        p->evictions++;
    } else {
        return NIL;
    }
    MOE_ASSERT(p->refcount[b] == 0);
    p->refcount[b] = 1;
    return b;
}

void kv_pool_ref(struct kv_pool *p, int32_t b)
{
    MOE_ASSERT(b >= 0 && b < p->n_block && p->refcount[b] > 0);
    p->refcount[b]++;
}

void kv_pool_release(struct kv_pool *p, int32_t b)
{
    MOE_ASSERT(b >= 0 && b < p->n_block && p->refcount[b] > 0);
    if (--p->refcount[b])
        return;
    if (p->has_hash[b])
        list_push_back(p, &p->cached, LIST_CACHED, b);
    else
        list_push_back(p, &p->free_list, LIST_FREE, b);
}

int kv_pool_refcount(const struct kv_pool *p, int32_t b)
{
    MOE_ASSERT(b >= 0 && b < p->n_block);
    return p->refcount[b];
}

uint64_t kv_pool_hash(uint64_t parent, const int32_t *tokens, int block_size)
{
    /* FNV-1a over the parent hash and the token ids, then a 64-bit finaliser. */
    uint64_t h = 0xcbf29ce484222325ull ^ parent;
    for (int i = 0; i < block_size; i++) {
        uint32_t t = (uint32_t)tokens[i];
        for (int k = 0; k < 4; k++) {
            h ^= (t >> (8 * k)) & 0xffu;
            h *= 0x100000001b3ull;
        }
    }
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h ? h : 1; /* 0 is "no parent" */
}

int32_t kv_pool_lookup(struct kv_pool *p, uint64_t hash, uint64_t parent, const int32_t *tokens)
{
    p->lookups++;
    int32_t b = index_find(p, hash, parent, tokens);
    if (b == NIL)
        return NIL;
    if (p->refcount[b] == 0)
        list_remove(p, &p->cached, b);
    p->refcount[b]++;
    p->hits++;
    return b;
}

bool kv_pool_publish(struct kv_pool *p, int32_t b, uint64_t hash, uint64_t parent,
                     const int32_t *tokens)
{
    MOE_ASSERT(b >= 0 && b < p->n_block && p->refcount[b] > 0);
    if (p->has_hash[b])
        return false;
    if (index_find(p, hash, parent, tokens) != NIL)
        return false;
    p->has_hash[b] = true;
    p->hash[b] = hash;
    p->parent[b] = parent;
    memcpy(p->tokens + (size_t)b * p->block_size, tokens, (size_t)p->block_size * sizeof *tokens);
    index_insert(p, b);
    return true;
}

void kv_pool_stats(const struct kv_pool *p, struct kv_pool_stats *out)
{
    out->n_block = p->n_block;
    out->n_free = p->free_list.n;
    out->n_cached = p->cached.n;
    out->n_used = p->n_block - p->free_list.n - p->cached.n;
    out->lookups = p->lookups;
    out->hits = p->hits;
    out->evictions = p->evictions;
}

static enum moe_status check_list(const struct kv_pool *p, const struct list *l, enum block_list id,
                                  const char *name, int *seen, struct moe_error *err)
{
    int n = 0;
    int32_t prev = NIL;
    for (int32_t b = l->head; b != NIL; b = p->next[b]) {
        if (b < 0 || b >= p->n_block || n > p->n_block)
            return moe_error_set(err, MOE_ERR_INTERNAL, "%s list is corrupt at block %d", name, b);
        if (seen[b]++)
            return moe_error_set(err, MOE_ERR_INTERNAL, "block %d is on two lists", b);
        if (p->list[b] != id || p->refcount[b] != 0 || p->prev[b] != prev)
            return moe_error_set(err, MOE_ERR_INTERNAL,
                                 "block %d on the %s list has refcount %d or a bad link", b, name,
                                 p->refcount[b]);
        if ((id == LIST_CACHED) != p->has_hash[b])
            return moe_error_set(err, MOE_ERR_INTERNAL, "block %d on the %s list: hash flag %d", b,
                                 name, p->has_hash[b]);
        prev = b;
        n++;
    }
    if (n != l->n || prev != l->tail)
        return moe_error_set(err, MOE_ERR_INTERNAL, "%s list counts %d blocks, holds %d", name,
                             l->n, n);
    return MOE_OK;
}

enum moe_status kv_pool_check(const struct kv_pool *p, const int *expected_refs,
                              struct moe_error *err)
{
    int *seen = calloc((size_t)p->n_block, sizeof *seen);
    if (!seen)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    enum moe_status rc = check_list(p, &p->free_list, LIST_FREE, "free", seen, err);
    if (!rc)
        rc = check_list(p, &p->cached, LIST_CACHED, "cached", seen, err);
    int n_indexed = 0;
    for (int32_t b = 0; !rc && b < p->n_block; b++) {
        if (!seen[b] && (p->refcount[b] <= 0 || p->list[b] != LIST_NONE))
            rc = moe_error_set(err, MOE_ERR_INTERNAL,
                               "block %d is on no list but has refcount %d (leaked)", b,
                               p->refcount[b]);
        else if (expected_refs && expected_refs[b] != p->refcount[b])
            rc = moe_error_set(err, MOE_ERR_INTERNAL, "block %d has refcount %d, holders count %d",
                               b, p->refcount[b], expected_refs[b]);
        else if (p->has_hash[b]) {
            n_indexed++;
            if (index_find(p, p->hash[b], p->parent[b], p->tokens + (size_t)b * p->block_size) != b)
                rc = moe_error_set(err, MOE_ERR_INTERNAL, "block %d is missing from the hash index",
                                   b);
        }
    }
    int n_entries = 0;
    for (uint32_t i = 0; !rc && i < p->index_cap; i++)
        n_entries += p->index[i] != NIL;
    if (!rc && n_entries != n_indexed)
        rc =
            moe_error_set(err, MOE_ERR_INTERNAL, "hash index holds %d entries for %d hashed blocks",
                          n_entries, n_indexed);
    free(seen);
    return rc;
}
