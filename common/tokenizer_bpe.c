/* BPE model of the tokenizer: vocabulary, merges and the merge loop.
 *
 * A word is split into characters (each looked up in the vocabulary, with
 * byte fallback or the unknown token for the rest), then adjacent symbols are
 * merged by increasing merge rank, leftmost first, as `tokenizers` does: a
 * doubly linked list of symbols plus a binary heap of candidate merges keyed by
 * (rank, position), stale candidates skipped when popped. O(n log n) per word. */
#include "tokenizer_internal.h"

#include <stdlib.h>
#include <string.h>

bool tok_ids_push(struct tok_ids *a, int32_t x)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 64;
        int32_t *v = realloc(a->v, cap * sizeof(*v));
        if (!v)
            return false;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = x;
    return true;
}

size_t tok_utf8_len(unsigned char c)
{
    if (c < 0x80)
        return 1;
    if ((c & 0xE0) == 0xC0)
        return 2;
    if ((c & 0xF0) == 0xE0)
        return 3;
    if ((c & 0xF8) == 0xF0)
        return 4;
    return 1;
}

/* ---- string -> id map ---------------------------------------------------- */

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 29);
}

static bool str_map_init(struct tok_str_map *m, size_t n_expect)
{
    size_t cap = 16;
    while (cap < n_expect * 2)
        cap *= 2;
    m->slot = malloc(cap * sizeof(*m->slot));
    if (!m->slot)
        return false;
    memset(m->slot, 0xff, cap * sizeof(*m->slot));
    m->cap = cap;
    m->n = 0;
    return true;
}

int32_t tok_bpe_lookup(const struct tok_bpe *bpe, const char *s, size_t len)
{
    const struct tok_str_map *m = &bpe->map;
    if (!m->cap)
        return -1;
    size_t i = hash_bytes(s, len) & (m->cap - 1);
    for (;;) {
        int32_t id = m->slot[i];
        if (id < 0)
            return -1;
        if (bpe->lens[id] == len && memcmp(bpe->strs[id], s, len) == 0)
            return id;
        i = (i + 1) & (m->cap - 1);
    }
}

/* Inserts id (whose string is already in bpe->strs); false if the string is
 * already present (its id is then in *dup). The map never fills: cap >= 2n. */
static bool str_map_insert(struct tok_bpe *bpe, int32_t id, int32_t *dup)
{
    struct tok_str_map *m = &bpe->map;
    size_t i = hash_bytes(bpe->strs[id], bpe->lens[id]) & (m->cap - 1);
    for (;;) {
        int32_t cur = m->slot[i];
        if (cur < 0)
            break;
        if (bpe->lens[cur] == bpe->lens[id] &&
            memcmp(bpe->strs[cur], bpe->strs[id], bpe->lens[id]) == 0) {
            *dup = cur;
            return false;
        }
        i = (i + 1) & (m->cap - 1);
    }
    m->slot[i] = id;
    m->n++;
    return true;
}

/* ---- pair -> (rank, id) map ---------------------------------------------- */

static bool pair_map_init(struct tok_pair_map *m, size_t n_expect)
{
    size_t cap = 16;
    while (cap < n_expect * 2)
        cap *= 2;
    m->key = calloc(cap, sizeof(*m->key));
    m->rank = malloc(cap * sizeof(*m->rank));
    m->id = malloc(cap * sizeof(*m->id));
    m->cap = cap;
    m->n = 0;
    return m->key && m->rank && m->id;
}

static size_t pair_slot(const struct tok_pair_map *m, uint64_t key)
{
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    size_t i = (size_t)(h ^ (h >> 31)) & (m->cap - 1);
    while (m->key[i] != 0 && m->key[i] != key)
        i = (i + 1) & (m->cap - 1);
    return i;
}

static uint64_t pair_key(int32_t a, int32_t b)
{
    return (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
}

/* A later merge of the same pair replaces the earlier one, as in `tokenizers`. */
static void pair_map_put(struct tok_pair_map *m, int32_t a, int32_t b, int32_t rank, int32_t id)
{
    uint64_t key = pair_key(a, b);
    size_t i = pair_slot(m, key);
    if (m->key[i] == 0)
        m->n++;
    m->key[i] = key;
    m->rank[i] = rank;
    m->id[i] = id;
}

static bool pair_map_get(const struct tok_pair_map *m, int32_t a, int32_t b, int32_t *rank,
                         int32_t *id)
{
    size_t i = pair_slot(m, pair_key(a, b));
    if (m->key[i] == 0)
        return false;
    *rank = m->rank[i];
    *id = m->id[i];
    return true;
}

/* ---- loading ------------------------------------------------------------- */

void tok_bpe_release(struct tok_bpe *bpe)
{
    if (!bpe)
        return;
    if (bpe->strs)
        for (int32_t i = 0; i < bpe->n_ids; i++)
            free(bpe->strs[i]);
    free(bpe->strs);
    free(bpe->lens);
    free(bpe->map.slot);
    free(bpe->merges.key);
    free(bpe->merges.rank);
    free(bpe->merges.id);
    memset(bpe, 0, sizeof(*bpe));
}

static bool json_is_int(const cJSON *j, double lo, double hi)
{
    return cJSON_IsNumber(j) && j->valuedouble >= lo && j->valuedouble <= hi &&
           j->valuedouble == (double)(int64_t)j->valuedouble;
}

/* Reads an optional boolean field; absent or null is `dflt`. */
static enum moe_status opt_bool(const cJSON *obj, const char *name, bool dflt, bool *out,
                                const char *path, struct moe_error *err)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (!j || cJSON_IsNull(j)) {
        *out = dflt;
        return MOE_OK;
    }
    if (!cJSON_IsBool(j))
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: model.%s is not a boolean", path, name);
    *out = cJSON_IsTrue(j);
    return MOE_OK;
}

/* Splits one merge entry into its two token strings. */
static enum moe_status merge_parts(const cJSON *m, size_t rank, const char **a, size_t *na,
                                   const char **b, size_t *nb, const char *path,
                                   struct moe_error *err)
{
    if (cJSON_IsString(m)) {
        const char *s = m->valuestring;
        const char *sp = strchr(s, ' ');
        if (!sp || strchr(sp + 1, ' ') || sp == s || !sp[1])
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "%s: model.merges[%zu] \"%.60s\" is not two tokens separated "
                                 "by one space",
                                 path, rank, s);
        *a = s;
        *na = (size_t)(sp - s);
        *b = sp + 1;
        *nb = strlen(sp + 1);
        return MOE_OK;
    }
    if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 && cJSON_IsString(m->child) &&
        cJSON_IsString(m->child->next)) {
        *a = m->child->valuestring;
        *na = strlen(*a);
        *b = m->child->next->valuestring;
        *nb = strlen(*b);
        return MOE_OK;
    }
    return moe_error_set(err, MOE_ERR_FORMAT,
                         "%s: model.merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", path, rank);
}

enum moe_status tok_bpe_load(struct tok_bpe *bpe, const cJSON *model, const char *path,
                             struct moe_error *err)
{
    enum moe_status st;
    char *joined = NULL;
    memset(bpe, 0, sizeof(*bpe));
    bpe->unk_id = -1;
    for (int i = 0; i < 256; i++)
        bpe->byte_ids[i] = -1;

    static const char *const refused[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
        const cJSON *j = cJSON_GetObjectItemCaseSensitive(model, refused[i]);
        if (j && !cJSON_IsNull(j) && !(cJSON_IsString(j) && !j->valuestring[0])) {
            st = moe_error_set(err, MOE_ERR_UNSUPPORTED, "%s: BPE model.%s is not supported", path,
                               refused[i]);
            goto fail;
        }
    }
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (dropout && !cJSON_IsNull(dropout) &&
        !(cJSON_IsNumber(dropout) && dropout->valuedouble == 0.0)) {
        st =
            moe_error_set(err, MOE_ERR_UNSUPPORTED, "%s: BPE model.dropout is not supported", path);
        goto fail;
    }
    if ((st = opt_bool(model, "byte_fallback", false, &bpe->byte_fallback, path, err)) ||
        (st = opt_bool(model, "fuse_unk", false, &bpe->fuse_unk, path, err)) ||
        (st = opt_bool(model, "ignore_merges", false, &bpe->ignore_merges, path, err)))
        goto fail;

    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    if (!cJSON_IsObject(vocab)) {
        st =
            moe_error_set(err, MOE_ERR_FORMAT, "%s: model.vocab is missing or not an object", path);
        goto fail;
    }
    int n_vocab = cJSON_GetArraySize(vocab);
    /* Ids must be dense-ish: anything beyond a few times the vocabulary is
     * taken for a corrupt file rather than allocated. */
    double max_id = (double)n_vocab * 4 + 1024;
    int32_t n_ids = 0;
    for (const cJSON *e = vocab->child; e; e = e->next) {
        if (!json_is_int(e, 0, max_id)) {
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: model.vocab[\"%.60s\"]: id %.1f is not an integer in [0, %.0f]",
                               path, e->string, cJSON_IsNumber(e) ? e->valuedouble : -1.0, max_id);
            goto fail;
        }
        if ((int32_t)e->valuedouble + 1 > n_ids)
            n_ids = (int32_t)e->valuedouble + 1;
    }
    bpe->strs = calloc((size_t)n_ids + 1, sizeof(*bpe->strs));
    bpe->lens = calloc((size_t)n_ids + 1, sizeof(*bpe->lens));
    bpe->n_ids = n_ids;
    if (!bpe->strs || !bpe->lens || !str_map_init(&bpe->map, (size_t)n_vocab))
        goto nomem;
    for (const cJSON *e = vocab->child; e; e = e->next) {
        int32_t id = (int32_t)e->valuedouble;
        if (bpe->strs[id]) {
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: model.vocab: id %d is used by both \"%.60s\" and \"%.60s\"",
                               path, id, bpe->strs[id], e->string);
            goto fail;
        }
        size_t len = strlen(e->string);
        bpe->strs[id] = malloc(len + 1);
        if (!bpe->strs[id])
            goto nomem;
        memcpy(bpe->strs[id], e->string, len + 1);
        bpe->lens[id] = (uint32_t)len;
        if ((uint32_t)len > bpe->max_len)
            bpe->max_len = (uint32_t)len;
        int32_t dup;
        if (!str_map_insert(bpe, id, &dup)) {
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: model.vocab: token \"%.60s\" appears twice", path, e->string);
            goto fail;
        }
    }

    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
    if (unk && !cJSON_IsNull(unk)) {
        if (!cJSON_IsString(unk)) {
            st = moe_error_set(err, MOE_ERR_FORMAT, "%s: model.unk_token is not a string", path);
            goto fail;
        }
        bpe->unk_id = tok_bpe_lookup(bpe, unk->valuestring, strlen(unk->valuestring));
        if (bpe->unk_id < 0) {
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: model.unk_token \"%.60s\" is not in the vocabulary", path,
                               unk->valuestring);
            goto fail;
        }
    }
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof(name), "<0x%02X>", b);
        bpe->byte_ids[b] = tok_bpe_lookup(bpe, name, 6);
    }

    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (!merges || cJSON_IsNull(merges)) {
        if (!pair_map_init(&bpe->merges, 0))
            goto nomem;
        return MOE_OK;
    }
    if (!cJSON_IsArray(merges)) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: model.merges is not an array", path);
        goto fail;
    }
    if (!pair_map_init(&bpe->merges, (size_t)cJSON_GetArraySize(merges)))
        goto nomem;
    size_t rank = 0;
    for (const cJSON *m = merges->child; m; m = m->next, rank++) {
        const char *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        if ((st = merge_parts(m, rank, &a, &na, &b, &nb, path, err)))
            goto fail;
        int32_t ia = tok_bpe_lookup(bpe, a, na), ib = tok_bpe_lookup(bpe, b, nb);
        joined = malloc(na + nb + 1);
        if (!joined)
            goto nomem;
        memcpy(joined, a, na);
        memcpy(joined + na, b, nb);
        int32_t ij = tok_bpe_lookup(bpe, joined, na + nb);
        if (ia < 0 || ib < 0 || ij < 0) {
            const char *what = ia < 0 ? a : ib < 0 ? b : joined;
            int nw = (int)(ia < 0 ? na : ib < 0 ? nb : na + nb);
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: model.merges[%zu] refers to \"%.*s\", not in the vocabulary",
                               path, rank, nw > 60 ? 60 : nw, what);
            goto fail;
        }
        free(joined);
        joined = NULL;
        pair_map_put(&bpe->merges, ia, ib, (int32_t)rank, ij);
    }
    return MOE_OK;

nomem:
    st = moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory loading the BPE model", path);
fail:
    free(joined);
    tok_bpe_release(bpe);
    return st;
}

/* ---- the merge loop ------------------------------------------------------ */

struct sym {
    int32_t id;
    int32_t prev, next; /* -1 at the ends */
    uint32_t len;       /* bytes; 0 once merged into its left neighbour */
};

struct cand {
    int32_t rank, pos, new_id;
};

static bool cand_less(const struct cand *x, const struct cand *y)
{
    return x->rank != y->rank ? x->rank < y->rank : x->pos < y->pos;
}

static void heap_push(struct cand *h, size_t *n, struct cand c)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&c, &h[p]))
            break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static struct cand heap_pop(struct cand *h, size_t *n)
{
    struct cand top = h[0];
    struct cand last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const struct cand *best = &last;
        if (l < *n && cand_less(&h[l], best)) {
            m = l;
            best = &h[l];
        }
        if (r < *n && cand_less(&h[r], best))
            m = r;
        if (m == i)
            break;
        h[i] = h[m];
        i = m;
    }
    if (*n)
        h[i] = last;
    return top;
}

void tok_bpe_scratch_release(struct tok_bpe_scratch *s)
{
    free(s->sym);
    free(s->heap);
    memset(s, 0, sizeof(*s));
}

static bool scratch_reserve(struct tok_bpe_scratch *s, size_t n_sym)
{
    if (n_sym > s->cap_sym) {
        size_t cap = n_sym < 64 ? 64 : n_sym * 2;
        void *p = realloc(s->sym, cap * sizeof(struct sym));
        if (!p)
            return false;
        s->sym = p;
        s->cap_sym = cap;
    }
    /* Each merge pushes at most 2 candidates, plus the initial n - 1. */
    if (3 * n_sym + 1 > s->cap_heap) {
        size_t cap = 6 * n_sym + 64;
        void *p = realloc(s->heap, cap * sizeof(struct cand));
        if (!p)
            return false;
        s->heap = p;
        s->cap_heap = cap;
    }
    return true;
}

static void sym_add(struct sym *sy, size_t *n, int32_t id, uint32_t len)
{
    sy[*n] = (struct sym){.id = id, .prev = (int32_t)*n - 1, .next = (int32_t)*n + 1, .len = len};
    (*n)++;
}

bool tok_bpe_encode_word(const struct tok_bpe *bpe, const char *w, size_t len,
                         struct tok_bpe_scratch *scratch, struct tok_ids *out)
{
    if (len == 0)
        return true;
    if (bpe->ignore_merges) {
        int32_t id = tok_bpe_lookup(bpe, w, len);
        if (id >= 0)
            return tok_ids_push(out, id);
    }
    /* Byte fallback can produce up to 4 symbols per character: bound by bytes. */
    if (!scratch_reserve(scratch, len))
        return false;
    struct sym *sy = scratch->sym;
    struct cand *heap = scratch->heap;
    size_t n = 0, n_heap = 0;
    int32_t unk = -1;
    uint32_t unk_len = 0;
    for (size_t i = 0; i < len;) {
        size_t cl = tok_utf8_len((unsigned char)w[i]);
        if (cl > len - i)
            cl = len - i;
        int32_t id = tok_bpe_lookup(bpe, w + i, cl);
        if (id >= 0) {
            if (unk >= 0) {
                sym_add(sy, &n, unk, unk_len);
                unk = -1;
            }
            sym_add(sy, &n, id, (uint32_t)cl);
        } else {
            bool done = false;
            if (bpe->byte_fallback) {
                done = true;
                for (size_t k = 0; k < cl; k++)
                    done = done && bpe->byte_ids[(unsigned char)w[i + k]] >= 0;
                /* As in `tokenizers`, a pending unknown is not flushed here. */
                for (size_t k = 0; done && k < cl; k++)
                    sym_add(sy, &n, bpe->byte_ids[(unsigned char)w[i + k]], 1);
            }
            if (!done && bpe->unk_id >= 0) {
                if (unk >= 0 && bpe->fuse_unk) {
                    unk_len += (uint32_t)cl;
                } else {
                    if (unk >= 0)
                        sym_add(sy, &n, unk, unk_len);
                    unk = bpe->unk_id;
                    unk_len = (uint32_t)cl;
                }
            }
            /* Neither byte fallback nor an unknown token: the character is
             * dropped, as `tokenizers` does. */
        }
        i += cl;
    }
    if (unk >= 0)
        sym_add(sy, &n, unk, unk_len);
    if (n == 0)
        return true;
    sy[n - 1].next = -1;

    int32_t rank, new_id;
    for (size_t i = 0; i + 1 < n; i++)
        if (pair_map_get(&bpe->merges, sy[i].id, sy[i + 1].id, &rank, &new_id))
            heap_push(heap, &n_heap, (struct cand){rank, (int32_t)i, new_id});
    while (n_heap) {
        struct cand c = heap_pop(heap, &n_heap);
        struct sym *s = &sy[c.pos];
        if (s->len == 0 || s->next < 0)
            continue;
        struct sym *r = &sy[s->next];
        int32_t r_rank, r_id;
        if (!pair_map_get(&bpe->merges, s->id, r->id, &r_rank, &r_id) || r_id != c.new_id)
            continue;
        s->id = c.new_id;
        s->len += r->len;
        r->len = 0;
        s->next = r->next;
        if (s->next >= 0)
            sy[s->next].prev = c.pos;
        if (s->prev >= 0 && pair_map_get(&bpe->merges, sy[s->prev].id, s->id, &rank, &new_id))
            heap_push(heap, &n_heap, (struct cand){rank, s->prev, new_id});
        if (s->next >= 0 && pair_map_get(&bpe->merges, s->id, sy[s->next].id, &rank, &new_id))
            heap_push(heap, &n_heap, (struct cand){rank, c.pos, new_id});
    }
    for (int32_t i = 0; i >= 0; i = sy[i].next)
        if (!tok_ids_push(out, sy[i].id))
            return false;
    return true;
}
