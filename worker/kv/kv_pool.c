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
    int n_part; /* partitions: blocks [i * part_blocks, (i + 1) * part_blocks) */
    int part_blocks;
    int *refcount;          /* (n_block) */
    uint8_t *list;          /* (n_block) enum block_list */
    int32_t *prev;          /* (n_block) */
    int32_t *next;          /* (n_block) */
    bool *has_hash;         /* (n_block) */
    uint64_t *hash;         /* (n_block) */
    uint64_t *parent;       /* (n_block) */
    int32_t *tokens;        /* (n_block, block_size) contents of published blocks */
    int32_t *index;         /* (index_cap) open addressing: block id or NIL */
    uint32_t index_cap;     /* power of two >= 2 * n_block */
    struct list *free_list; /* (n_part) */
    struct list *cached;    /* (n_part) LRU: head is the oldest */
    int n_free, n_cached;   /* over every part */
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
    if (id == LIST_FREE)
        p->n_free++;
    else
        p->n_cached++;
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
    if (p->list[b] == LIST_FREE)
        p->n_free--;
    else
        p->n_cached--;
    p->list[b] = LIST_NONE;
}

static int part_of(const struct kv_pool *p, int32_t b)
{
    return b / p->part_blocks;
}

enum moe_status kv_pool_create(int n_block, int block_size, struct kv_pool **out,
                               struct moe_error *err)
{
    return kv_pool_create_parts(n_block, block_size, 1, out, err);
}

enum moe_status kv_pool_create_parts(int n_block, int block_size, int n_part, struct kv_pool **out,
                                     struct moe_error *err)
{
    *out = NULL;
    if (n_block <= 0 || block_size <= 0 || n_block > (1 << 28) || block_size > 4096)
        return moe_error_set(err, MOE_ERR_INVALID, "KV pool of %d blocks of %d tokens is invalid",
                             n_block, block_size);
    if (n_part < 1 || n_block % n_part)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "KV pool of %d blocks cannot be split into %d equal parts", n_block,
                             n_part);
    struct kv_pool *p = calloc(1, sizeof *p);
    if (!p)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    p->n_block = n_block;
    p->block_size = block_size;
    p->n_part = n_part;
    p->part_blocks = n_block / n_part;
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
    p->free_list = calloc((size_t)n_part, sizeof *p->free_list);
    p->cached = calloc((size_t)n_part, sizeof *p->cached);
    if (!p->refcount || !p->list || !p->prev || !p->next || !p->has_hash || !p->hash ||
        !p->parent || !p->tokens || !p->index || !p->free_list || !p->cached) {
        kv_pool_destroy(p);
        return moe_error_set(err, MOE_ERR_NOMEM, "cannot allocate a KV pool of %d blocks", n_block);
    }
    for (uint32_t i = 0; i < p->index_cap; i++)
        p->index[i] = NIL;
    for (int i = 0; i < n_part; i++)
        p->free_list[i] = p->cached[i] = (struct list){NIL, NIL, 0};
    for (int32_t b = 0; b < n_block; b++)
        list_push_back(p, &p->free_list[part_of(p, b)], LIST_FREE, b);
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
    free(p->free_list);
    free(p->cached);
    free(p);
}

int kv_pool_block_size(const struct kv_pool *p)
{
    return p->block_size;
}

int kv_pool_n_part(const struct kv_pool *p)
{
    return p->n_part;
}

int kv_pool_part_of(const struct kv_pool *p, int32_t block)
{
    MOE_ASSERT(block >= 0 && block < p->n_block);
    return part_of(p, block);
}

int kv_pool_available(const struct kv_pool *p)
{
    return p->n_free + p->n_cached;
}

int kv_pool_free_count(const struct kv_pool *p)
{
    return p->n_free;
}

int kv_pool_available_in(const struct kv_pool *p, int part)
{
    MOE_ASSERT(part >= 0 && part < p->n_part);
    return p->free_list[part].n + p->cached[part].n;
}

int kv_pool_free_count_in(const struct kv_pool *p, int part)
{
    MOE_ASSERT(part >= 0 && part < p->n_part);
    return p->free_list[part].n;
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
    /* the part with the most blocks it can give without evicting, then
     * with the most it can give at all */
    int best = 0;
    for (int i = 1; i < p->n_part; i++)
        if (p->free_list[i].n > p->free_list[best].n ||
            (p->free_list[i].n == p->free_list[best].n && p->cached[i].n > p->cached[best].n))
            best = i;
    return kv_pool_alloc_in(p, best);
}

int32_t kv_pool_alloc_in(struct kv_pool *p, int part)
{
    MOE_ASSERT(part >= 0 && part < p->n_part);
    struct list *fl = &p->free_list[part], *cl = &p->cached[part];
    int32_t b;
    if (fl->n) {
        b = fl->head;
        list_remove(p, fl, b);
    } else if (cl->n) {
        b = cl->head; /* least recently used */
        list_remove(p, cl, b);
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
        list_push_back(p, &p->cached[part_of(p, b)], LIST_CACHED, b);
    else
        list_push_back(p, &p->free_list[part_of(p, b)], LIST_FREE, b);
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
        list_remove(p, &p->cached[part_of(p, b)], b);
    p->refcount[b]++;
    p->hits++;
    return b;
}

bool kv_pool_contains(const struct kv_pool *p, uint64_t hash, uint64_t parent,
                      const int32_t *tokens)
{
    return index_find(p, hash, parent, tokens) != NIL;
}

uint64_t kv_pool_part_seed(int part)
{
    return part ? kv_pool_hash(0, &(int32_t){part}, 1) : 0;
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
    out->n_free = p->n_free;
    out->n_cached = p->n_cached;
    out->n_used = p->n_block - p->n_free - p->n_cached;
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
    enum moe_status rc = MOE_OK;
    int n_free = 0, n_cached = 0;
    for (int i = 0; !rc && i < p->n_part; i++) {
        rc = check_list(p, &p->free_list[i], LIST_FREE, "free", seen, err);
        if (!rc)
            rc = check_list(p, &p->cached[i], LIST_CACHED, "cached", seen, err);
        for (int32_t b = p->free_list[i].head; !rc && b != NIL; b = p->next[b])
            if (part_of(p, b) != i)
                rc = moe_error_set(err, MOE_ERR_INTERNAL,
                                   "block %d of part %d is on part %d's free list", b,
                                   part_of(p, b), i);
        for (int32_t b = p->cached[i].head; !rc && b != NIL; b = p->next[b])
            if (part_of(p, b) != i)
                rc = moe_error_set(err, MOE_ERR_INTERNAL,
                                   "block %d of part %d is on part %d's cached list", b,
                                   part_of(p, b), i);
        n_free += p->free_list[i].n;
        n_cached += p->cached[i].n;
    }
    if (!rc && (n_free != p->n_free || n_cached != p->n_cached))
        rc = moe_error_set(err, MOE_ERR_INTERNAL,
                           "the pool counts %d free and %d cached blocks, its lists hold %d and %d",
                           p->n_free, p->n_cached, n_free, n_cached);
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
