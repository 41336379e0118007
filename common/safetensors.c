/* Safetensors reader: mmap, header validation, sharded checkpoints, lookup by
 * name and block reads with dtype conversion.
 *
 * Policy on dtypes: only F32, F16 and BF16 tensors are accepted. A file that
 * holds any other known safetensors dtype (I64, F64, U8, F8_E4M3 ...) is
 * refused at open with MOE_ERR_UNSUPPORTED naming the tensor and the dtype:
 * the Hugging Face checkpoints of the architectures we run hold only float
 * tensors, so another dtype means a checkpoint (e.g. quantized) that we could
 * not run anyway. An unknown dtype name is MOE_ERR_FORMAT.
 *
 * Status codes: MOE_ERR_IO for open/stat/mmap/read failures, MOE_ERR_FORMAT
 * for malformed contents, MOE_ERR_NOT_FOUND for a directory without a
 * checkpoint, MOE_ERR_NOMEM, and MOE_ERR_INVALID for bad arguments. */
#include "safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Headers larger than this are refused (the reference implementation's
 * limit is 100 MB; a real 1,000-tensor header is ~100 KB). */
#define ST_MAX_HEADER ((uint64_t)100 * 1024 * 1024)
/* Largest integer a double (cJSON's number) holds exactly. */
#define ST_MAX_JSON_INT 9007199254740992.0 /* 2^53 */

struct st_shard {
    char *path; /* as opened (index dir + shard name for shards) */
    void *map;  /* whole file, read-only; NULL when the file is empty */
    size_t map_size;
    bool borrowed;     /* map is the caller's buffer (st_open_buffer): not unmapped */
    size_t data_start; /* 8 + header length */
};

struct st_model {
    struct st_tensor *tensors; /* (n_tensor) */
    size_t n_tensor, cap_tensor;
    struct st_shard *shards; /* (n_shard) */
    size_t n_shard, cap_shard;
    uint32_t *slots; /* (n_slot) open addressing: tensor index + 1, 0 = empty */
    size_t n_slot;
};

/* ---- hash map name -> tensor index ------------------------------------------- */

static uint64_t hash_name(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    return h;
}

static enum moe_status map_grow(struct st_model *m, struct moe_error *err)
{
    size_t n_slot = m->n_slot ? m->n_slot * 2 : 64;
    uint32_t *slots = calloc(n_slot, sizeof *slots);
    if (!slots)
        return moe_error_set(err, MOE_ERR_NOMEM, "safetensors: out of memory for the name map");
    for (size_t i = 0; i < m->n_slot; i++) {
        uint32_t v = m->slots[i];
        if (!v)
            continue;
        size_t j = hash_name(m->tensors[v - 1].name) & (n_slot - 1);
        while (slots[j])
            j = (j + 1) & (n_slot - 1);
        slots[j] = v;
    }
    free(m->slots);
    m->slots = slots;
    m->n_slot = n_slot;
    return MOE_OK;
}

/* Slot holding `name`, or the empty slot where it would go. */
static size_t map_slot(const struct st_model *m, const char *name)
{
    size_t j = hash_name(name) & (m->n_slot - 1);
    while (m->slots[j] && strcmp(m->tensors[m->slots[j] - 1].name, name) != 0)
        j = (j + 1) & (m->n_slot - 1);
    return j;
}

/* Index of the tensor called `name`, or -1. */
static int64_t map_find(const struct st_model *m, const char *name)
{
    if (!m->n_slot)
        return -1;
    size_t j = map_slot(m, name);
    return m->slots[j] ? (int64_t)m->slots[j] - 1 : -1;
}

/* Adds tensor `idx` (already in m->tensors) to the map; it must be new. */
static enum moe_status map_insert(struct st_model *m, size_t idx, struct moe_error *err)
{
    if ((m->n_tensor + 1) * 2 > m->n_slot) {
        enum moe_status st = map_grow(m, err);
        if (st != MOE_OK)
            return st;
    }
    size_t j = map_slot(m, m->tensors[idx].name);
    MOE_ASSERT(!m->slots[j]);
    m->slots[j] = (uint32_t)idx + 1;
    return MOE_OK;
}

/* ---- small helpers ---------------------------------------------------------- */

static bool dtype_parse(const char *s, enum moe_dtype *out)
{
    if (!strcmp(s, "F32"))
        *out = MOE_DTYPE_F32;
    else if (!strcmp(s, "F16"))
        *out = MOE_DTYPE_F16;
    else if (!strcmp(s, "BF16"))
        *out = MOE_DTYPE_BF16;
    else
        return false;
    return true;
}

/* Dtypes that safetensors defines but we do not load. */
static bool dtype_is_known_other(const char *s)
{
    static const char *const names[] = {
        "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4",   "I64", "I32",
        "I16", "I8",      "U64",     "U32",     "U16",     "U8",      "BOOL", "C64"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i]))
            return true;
    return false;
}

/* A JSON number that is an exact non-negative integer <= 2^53. */
static bool json_uint(const cJSON *j, uint64_t *out)
{
    if (!cJSON_IsNumber(j))
        return false;
    double d = j->valuedouble;
    if (!isfinite(d) || d < 0 || d > ST_MAX_JSON_INT || floor(d) != d)
        return false;
    *out = (uint64_t)d;
    return true;
}

/* Short text of a JSON value for messages ("\"abc\"", "-1", "[1, 2]"). */
static void json_snippet(const cJSON *j, char *buf, size_t cap)
{
    char *s = j ? cJSON_PrintUnformatted(j) : NULL;
    if (!s) {
        snprintf(buf, cap, "%s", j ? "?" : "nothing");
        return;
    }
    if (strlen(s) >= cap && cap > 4)
        snprintf(buf, cap, "%.*s...", (int)(cap - 4), s);
    else
        snprintf(buf, cap, "%s", s);
    free(s);
}

/* "[8, 4]" */
static void shape_text(const int64_t *shape, int n_dim, char *buf, size_t cap)
{
    size_t len = 0;
    len += (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < n_dim && len < cap; d++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (len < cap)
        snprintf(buf + len, cap - len, "]");
}

static struct st_tensor *tensor_push(struct st_model *m, struct moe_error *err)
{
    if (m->n_tensor == m->cap_tensor) {
        size_t cap = m->cap_tensor ? m->cap_tensor * 2 : 64;
        if (cap > UINT32_MAX - 1) {
            moe_error_set(err, MOE_ERR_FORMAT, "safetensors: too many tensors");
            return NULL;
        }
        struct st_tensor *t = realloc(m->tensors, cap * sizeof *t);
        if (!t) {
            moe_error_set(err, MOE_ERR_NOMEM, "safetensors: out of memory for the tensor list");
            return NULL;
        }
        m->tensors = t;
        m->cap_tensor = cap;
    }
    struct st_tensor *t = &m->tensors[m->n_tensor];
    memset(t, 0, sizeof *t);
    return t;
}

static struct st_shard *shard_push(struct st_model *m, const char *path, struct moe_error *err)
{
    if (m->n_shard == m->cap_shard) {
        size_t cap = m->cap_shard ? m->cap_shard * 2 : 4;
        struct st_shard *s = realloc(m->shards, cap * sizeof *s);
        if (!s) {
            moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", path);
            return NULL;
        }
        m->shards = s;
        m->cap_shard = cap;
    }
    struct st_shard *s = &m->shards[m->n_shard];
    memset(s, 0, sizeof *s);
    s->path = strdup(path);
    if (!s->path) {
        moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", path);
        return NULL;
    }
    m->n_shard++;
    return s;
}

/* ---- one .safetensors file ---------------------------------------------------- */

/* Parses one tensor entry of shard `sh` into a new m->tensors element. */
static enum moe_status parse_tensor(struct st_model *m, const struct st_shard *sh,
                                    const cJSON *entry, size_t data_size, struct moe_error *err)
{
    const char *file = sh->path;
    const char *name = entry->string;
    char snip[96];

    if (!cJSON_IsObject(entry)) {
        json_snippet(entry, snip, sizeof snip);
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s': entry must be an object, got %s", file, name, snip);
    }
    const cJSON *jdtype = cJSON_GetObjectItemCaseSensitive(entry, "dtype");
    const cJSON *jshape = cJSON_GetObjectItemCaseSensitive(entry, "shape");
    const cJSON *joff = cJSON_GetObjectItemCaseSensitive(entry, "data_offsets");

    enum moe_dtype dtype;
    if (!cJSON_IsString(jdtype)) {
        json_snippet(jdtype, snip, sizeof snip);
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s': 'dtype' must be a string, got %s", file, name, snip);
    }
    if (!dtype_parse(jdtype->valuestring, &dtype)) {
        if (dtype_is_known_other(jdtype->valuestring))
            return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                                 "%s: tensor '%s': dtype %s is not supported (only F32, F16, BF16)",
                                 file, name, jdtype->valuestring);
        json_snippet(jdtype, snip, sizeof snip);
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: tensor '%s': unknown dtype %s", file, name,
                             snip);
    }

    if (!cJSON_IsArray(jshape)) {
        json_snippet(jshape, snip, sizeof snip);
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s': 'shape' must be an array, got %s", file, name, snip);
    }
    int n_dim = cJSON_GetArraySize(jshape);
    if (n_dim > ST_MAX_DIMS)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "%s: tensor '%s': %d dimensions, at most %d are supported", file, name,
                             n_dim, ST_MAX_DIMS);
    int64_t shape[ST_MAX_DIMS] = {0};
    uint64_t n_elem = 1;
    bool overflow = false;
    int d = 0;
    for (const cJSON *jd = jshape->child; jd; jd = jd->next, d++) {
        uint64_t v;
        if (!json_uint(jd, &v)) {
            json_snippet(jd, snip, sizeof snip);
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "%s: tensor '%s': shape[%d] must be a non-negative integer "
                                 "<= 2^53, got %s",
                                 file, name, d, snip);
        }
        shape[d] = (int64_t)v;
        if (v && n_elem > UINT64_MAX / v)
            overflow = true;
        n_elem *= v;
    }
    char shp[160];
    shape_text(shape, n_dim, shp, sizeof shp);
    size_t esize = moe_dtype_size(dtype);
    if (overflow || n_elem > SIZE_MAX / esize)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s': shape %s x %s overflows the byte count", file, name,
                             shp, moe_dtype_name(dtype));
    uint64_t need = n_elem * esize;

    uint64_t off[2];
    if (!cJSON_IsArray(joff) || cJSON_GetArraySize(joff) != 2 || !json_uint(joff->child, &off[0]) ||
        !json_uint(joff->child->next, &off[1])) {
        json_snippet(joff, snip, sizeof snip);
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s': 'data_offsets' must be [begin, end] of "
                             "non-negative integers, got %s",
                             file, name, snip);
    }
    if (off[0] > off[1])
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s': data_offsets [%llu, %llu): begin > end", file, name,
                             (unsigned long long)off[0], (unsigned long long)off[1]);
    if (off[1] - off[0] != need)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s': data_offsets [%llu, %llu) hold %llu bytes but shape "
                             "%s x %s needs %llu",
                             file, name, (unsigned long long)off[0], (unsigned long long)off[1],
                             (unsigned long long)(off[1] - off[0]), shp, moe_dtype_name(dtype),
                             (unsigned long long)need);
    if (off[1] > data_size)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s': data_offsets [%llu, %llu) end beyond the data area "
                             "(%zu bytes)",
                             file, name, (unsigned long long)off[0], (unsigned long long)off[1],
                             data_size);

    int64_t dup = map_find(m, name);
    if (dup >= 0) {
        if (m->tensors[dup].file == sh->path)
            return moe_error_set(err, MOE_ERR_FORMAT, "%s: tensor '%s' is defined twice", file,
                                 name);
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: tensor '%s' is also in %s", file, name,
                             m->tensors[dup].file);
    }

    struct st_tensor *t = tensor_push(m, err);
    if (!t)
        return err ? err->code : MOE_ERR_NOMEM;
    t->name = strdup(name);
    if (!t->name)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", file);
    t->dtype = dtype;
    t->n_dim = n_dim;
    memcpy(t->shape, shape, sizeof shape);
    t->data = (const char *)sh->map + sh->data_start + off[0];
    t->nbytes = (size_t)need;
    t->file = sh->path;
    m->n_tensor++; /* owned by m from here: st_close frees the name */
    return map_insert(m, m->n_tensor - 1, err);
}

struct span {
    size_t begin, end, idx;
};

static int span_cmp(const void *a, const void *b)
{
    const struct span *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

/* Tensors [first, m->n_tensor) all come from shard `sh`: no two may share a byte. */
static enum moe_status check_overlap(const struct st_model *m, const struct st_shard *sh,
                                     size_t first, struct moe_error *err)
{
    size_t n = m->n_tensor - first;
    if (n < 2)
        return MOE_OK;
    struct span *sp = malloc(n * sizeof *sp);
    if (!sp)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", sh->path);
    const char *base = (const char *)sh->map + sh->data_start;
    size_t k = 0;
    for (size_t i = first; i < m->n_tensor; i++) {
        const struct st_tensor *t = &m->tensors[i];
        if (!t->nbytes)
            continue; /* an empty range overlaps nothing */
        sp[k].begin = (size_t)((const char *)t->data - base);
        sp[k].end = sp[k].begin + t->nbytes;
        sp[k].idx = i;
        k++;
    }
    qsort(sp, k, sizeof *sp, span_cmp);
    enum moe_status st = MOE_OK;
    for (size_t i = 1; i < k; i++) {
        if (sp[i].begin < sp[i - 1].end) {
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: tensor '%s' at [%zu, %zu) overlaps tensor '%s' at [%zu, %zu)",
                               sh->path, m->tensors[sp[i].idx].name, sp[i].begin, sp[i].end,
                               m->tensors[sp[i - 1].idx].name, sp[i - 1].begin, sp[i - 1].end);
            break;
        }
    }
    free(sp);
    return st;
}

/* Maps `path` read-only into shard `sh` (fd closed afterwards). */
static enum moe_status shard_map(struct st_shard *sh, struct moe_error *err)
{
    int fd = open(sh->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return moe_error_set(err, MOE_ERR_IO, "%s: %s", sh->path, strerror(errno));
    struct stat sb;
    enum moe_status st = MOE_OK;
    if (fstat(fd, &sb) != 0) {
        st = moe_error_set(err, MOE_ERR_IO, "%s: %s", sh->path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(sb.st_mode)) {
        st = moe_error_set(err, MOE_ERR_IO, "%s: not a regular file", sh->path);
        goto fail;
    }
    sh->map_size = (size_t)sb.st_size;
    if (sh->map_size > 0) {
        void *p = mmap(NULL, sh->map_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            st = moe_error_set(err, MOE_ERR_IO, "%s: mmap: %s", sh->path, strerror(errno));
            goto fail;
        }
        sh->map = p;
    }
fail:
    close(fd);
    return st;
}

/* Validates the bytes of shard `sh` (sh->map, sh->map_size) and adds its tensors to `m`. */
static enum moe_status shard_parse(struct st_model *m, struct st_shard *sh, struct moe_error *err)
{
    enum moe_status st = MOE_OK;
    const char *file = sh->path;
    if (sh->map_size < 8)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: file is %zu bytes, too short for the 8-byte header length", file,
                             sh->map_size);
    const unsigned char *b = sh->map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | b[i];
    if (hlen > ST_MAX_HEADER)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: header length %llu is larger than the %llu-byte limit", file,
                             (unsigned long long)hlen, (unsigned long long)ST_MAX_HEADER);
    if (hlen > sh->map_size - 8)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: header length %llu runs past the end of the file (%zu bytes)",
                             file, (unsigned long long)hlen, sh->map_size);
    if (hlen < 2)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: header length %llu is too short for a JSON object", file,
                             (unsigned long long)hlen);
    if (memchr(b + 8, '\0', (size_t)hlen))
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: header contains a NUL byte", file);
    sh->data_start = 8 + (size_t)hlen;
    size_t data_size = sh->map_size - sh->data_start;

    char *text = malloc((size_t)hlen + 1);
    if (!text)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory for the header", file);
    memcpy(text, b + 8, (size_t)hlen);
    text[hlen] = '\0';
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(text, &end, 1);
    size_t first = m->n_tensor;
    if (!root) {
        size_t at = end && end >= text ? (size_t)(end - text) : 0;
        st =
            moe_error_set(err, MOE_ERR_FORMAT, "%s: header is not valid JSON (at byte %zu of %llu)",
                          file, at, (unsigned long long)hlen);
        goto fail;
    }
    if (!cJSON_IsObject(root)) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: header is not a JSON object", file);
        goto fail;
    }
    for (const cJSON *e = root->child; e; e = e->next) {
        if (!e->string) {
            st = moe_error_set(err, MOE_ERR_FORMAT, "%s: header entry without a name", file);
            goto fail;
        }
        if (!strcmp(e->string, "__metadata__")) {
            if (!cJSON_IsObject(e) && !cJSON_IsNull(e)) {
                st = moe_error_set(err, MOE_ERR_FORMAT, "%s: '__metadata__' must be an object",
                                   file);
                goto fail;
            }
            for (const cJSON *kv = e->child; kv; kv = kv->next) {
                if (!cJSON_IsString(kv)) {
                    st = moe_error_set(err, MOE_ERR_FORMAT,
                                       "%s: '__metadata__' value '%s' must be a string", file,
                                       kv->string ? kv->string : "?");
                    goto fail;
                }
            }
            continue;
        }
        st = parse_tensor(m, sh, e, data_size, err);
        if (st != MOE_OK)
            goto fail;
    }
    st = check_overlap(m, sh, first, err);
fail:
    cJSON_Delete(root);
    free(text);
    return st;
}

/* Opens one .safetensors file and adds its tensors to `m`. */
static enum moe_status shard_load(struct st_model *m, const char *path, struct moe_error *err)
{
    struct st_shard *sh = shard_push(m, path, err);
    if (!sh)
        return err ? err->code : MOE_ERR_NOMEM;
    enum moe_status st = shard_map(sh, err);
    return st != MOE_OK ? st : shard_parse(m, sh, err);
}

/* ---- index (sharded) -------------------------------------------------------- */

/* Reads a whole (small) file into a NUL-terminated buffer. */
static enum moe_status file_read_all(const char *path, char **out, struct moe_error *err)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f)
        return moe_error_set(err, MOE_ERR_IO, "%s: %s", path, strerror(errno));
    enum moe_status st = MOE_OK;
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (cap - len < 4096) {
            cap = cap ? cap * 2 : 65536;
            if (cap > ST_MAX_HEADER) {
                st = moe_error_set(err, MOE_ERR_FORMAT, "%s: file larger than %llu bytes", path,
                                   (unsigned long long)ST_MAX_HEADER);
                goto fail;
            }
            char *nb = realloc(buf, cap + 1);
            if (!nb) {
                st = moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", path);
                goto fail;
            }
            buf = nb;
        }
        size_t n = fread(buf + len, 1, cap - len, f);
        len += n;
        if (n == 0)
            break;
    }
    if (ferror(f)) {
        st = moe_error_set(err, MOE_ERR_IO, "%s: read error", path);
        goto fail;
    }
    if (memchr(buf, '\0', len)) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: contains a NUL byte", path);
        goto fail;
    }
    buf[len] = '\0';
    fclose(f);
    *out = buf;
    return MOE_OK;
fail:
    free(buf);
    fclose(f);
    return st;
}

/* Opens every shard that `index_path` names and checks its weight_map. */
static enum moe_status index_load(struct st_model *m, const char *index_path, struct moe_error *err)
{
    char *text = NULL, *shard_path = NULL;
    bool *listed = NULL; /* (n_tensor) */
    cJSON *root = NULL;
    enum moe_status st = file_read_all(index_path, &text, err);
    if (st != MOE_OK)
        return st;

    /* shard paths are relative to the index's directory */
    const char *slash = strrchr(index_path, '/');
    size_t dir_len = slash ? (size_t)(slash - index_path) + 1 : 0;

    root = cJSON_ParseWithOpts(text, NULL, 1);
    if (!root || !cJSON_IsObject(root)) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: not a JSON object", index_path);
        goto fail;
    }
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: 'weight_map' is missing or not an object",
                           index_path);
        goto fail;
    }
    if (!wm->child) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: 'weight_map' is empty", index_path);
        goto fail;
    }

    /* pass 1: validate entries and open each distinct shard once, in order of appearance */
    for (const cJSON *e = wm->child; e; e = e->next) {
        if (!cJSON_IsString(e) || !e->valuestring[0]) {
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: weight_map: tensor '%s': shard must be a file name", index_path,
                               e->string ? e->string : "?");
            goto fail;
        }
        const char *name = e->valuestring;
        if (name[0] == '/' || !strcmp(name, "..") || !strncmp(name, "../", 3) ||
            strstr(name, "/../") ||
            (strlen(name) >= 3 && !strcmp(name + strlen(name) - 3, "/.."))) {
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: weight_map: tensor '%s': shard '%s' is outside the "
                               "checkpoint directory",
                               index_path, e->string, name);
            goto fail;
        }
        free(shard_path);
        size_t n = dir_len + strlen(name) + 1;
        shard_path = malloc(n);
        if (!shard_path) {
            st = moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", index_path);
            goto fail;
        }
        memcpy(shard_path, index_path, dir_len);
        memcpy(shard_path + dir_len, name, strlen(name) + 1);
        bool seen = false;
        for (size_t s = 0; s < m->n_shard && !seen; s++)
            seen = !strcmp(m->shards[s].path, shard_path);
        if (seen)
            continue;
        st = shard_load(m, shard_path, err);
        if (st != MOE_OK)
            goto fail;
    }

    /* pass 2: every listed tensor is in the shard the index names, and listed once
     * (cJSON keeps both copies of a duplicated key) */
    listed = calloc(m->n_tensor ? m->n_tensor : 1, sizeof *listed);
    if (!listed) {
        st = moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", index_path);
        goto fail;
    }
    for (const cJSON *e = wm->child; e; e = e->next) {
        int64_t idx = map_find(m, e->string);
        const char *want = e->valuestring;
        if (idx < 0) {
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: weight_map: tensor '%s' is not in shard '%s'", index_path,
                               e->string, want);
            goto fail;
        }
        const char *have = m->tensors[idx].file;
        if (strcmp(have + dir_len, want) != 0) {
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: weight_map: tensor '%s' is not in shard '%s' (found in '%s')",
                               index_path, e->string, want, have + dir_len);
            goto fail;
        }
        if (listed[idx]) {
            st = moe_error_set(err, MOE_ERR_FORMAT, "%s: weight_map: tensor '%s' is listed twice",
                               index_path, e->string);
            goto fail;
        }
        listed[idx] = true;
    }
fail:
    free(listed);
    free(shard_path);
    cJSON_Delete(root);
    free(text);
    return st;
}

/* ---- public API ------------------------------------------------------------- */

static bool has_suffix(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

static bool file_exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

enum moe_status st_open(const char *path, struct st_model **out, struct moe_error *err)
{
    if (out)
        *out = NULL;
    if (!path || !out)
        return moe_error_set(err, MOE_ERR_INVALID, "st_open: NULL argument");

    char *joined = NULL;
    enum moe_status st;
    struct st_model *m = calloc(1, sizeof *m);
    if (!m)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", path);

    struct stat sb;
    if (stat(path, &sb) != 0) {
        st = moe_error_set(err, MOE_ERR_IO, "%s: %s", path, strerror(errno));
        goto fail;
    }
    if (S_ISDIR(sb.st_mode)) {
        size_t n = strlen(path) + 64;
        joined = malloc(n);
        if (!joined) {
            st = moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", path);
            goto fail;
        }
        const char *sep = has_suffix(path, "/") ? "" : "/";
        snprintf(joined, n, "%s%smodel.safetensors.index.json", path, sep);
        if (file_exists(joined)) {
            st = index_load(m, joined, err);
        } else {
            snprintf(joined, n, "%s%smodel.safetensors", path, sep);
            if (file_exists(joined)) {
                st = shard_load(m, joined, err);
            } else {
                st = moe_error_set(err, MOE_ERR_NOT_FOUND,
                                   "%s: no checkpoint found (looked for "
                                   "model.safetensors.index.json and model.safetensors)",
                                   path);
            }
        }
    } else if (has_suffix(path, ".json")) {
        st = index_load(m, path, err);
    } else {
        st = shard_load(m, path, err);
    }
    if (st != MOE_OK)
        goto fail;
    free(joined);
    *out = m;
    return MOE_OK;
fail:
    free(joined);
    st_close(m);
    return st;
}

enum moe_status st_open_buffer(const void *data, size_t len, const char *name,
                               struct st_model **out, struct moe_error *err)
{
    if (out)
        *out = NULL;
    if ((!data && len) || !name || !out)
        return moe_error_set(err, MOE_ERR_INVALID, "st_open_buffer: NULL argument");
    struct st_model *m = calloc(1, sizeof *m);
    if (!m)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", name);
    struct st_shard *sh = shard_push(m, name, err);
    enum moe_status st = sh ? MOE_OK : (err ? err->code : MOE_ERR_NOMEM);
    if (sh) {
        sh->map = (void *)data; /* never written: the tensors' data is const */
        sh->map_size = len;
        sh->borrowed = true;
        st = shard_parse(m, sh, err);
    }
    if (st != MOE_OK) {
        st_close(m);
        return st;
    }
    *out = m;
    return MOE_OK;
}

void st_close(struct st_model *m)
{
    if (!m)
        return;
    for (size_t i = 0; i < m->n_tensor; i++)
        free((char *)m->tensors[i].name);
    for (size_t s = 0; s < m->n_shard; s++) {
        if (m->shards[s].map && !m->shards[s].borrowed)
            munmap(m->shards[s].map, m->shards[s].map_size);
        free(m->shards[s].path);
    }
    free(m->tensors);
    free(m->shards);
    free(m->slots);
    free(m);
}

const struct st_tensor *st_find(const struct st_model *m, const char *name)
{
    if (!m || !name)
        return NULL;
    int64_t i = map_find(m, name);
    return i < 0 ? NULL : &m->tensors[i];
}

size_t st_count(const struct st_model *m)
{
    return m ? m->n_tensor : 0;
}

const struct st_tensor *st_get(const struct st_model *m, size_t i)
{
    return m && i < m->n_tensor ? &m->tensors[i] : NULL;
}

/* One element of `src_dtype` at `p` as float. */
static inline float load_f32(const unsigned char *p, enum moe_dtype src_dtype)
{
    if (src_dtype == MOE_DTYPE_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    return src_dtype == MOE_DTYPE_BF16 ? moe_bf16_to_f32(h) : moe_f16_to_f32(h);
}

enum moe_status st_read_block(const struct st_tensor *t, int64_t row0, int64_t n_rows, int64_t col0,
                              int64_t n_cols, enum moe_dtype dst_dtype, void *dst,
                              struct moe_error *err)
{
    if (!t)
        return moe_error_set(err, MOE_ERR_INVALID, "st_read_block: NULL tensor");
    if (t->n_dim > 2)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "%s: tensor '%s': st_read_block needs a 1-D or 2-D tensor, it has %d "
                             "dimensions",
                             t->file, t->name, t->n_dim);
    if (dst_dtype != MOE_DTYPE_F32 && dst_dtype != MOE_DTYPE_BF16)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "%s: tensor '%s': st_read_block converts to F32 or BF16, not %s",
                             t->file, t->name, moe_dtype_name(dst_dtype));
    int64_t rows = t->n_dim == 2 ? t->shape[0] : 1;
    int64_t cols = t->n_dim == 0 ? 1 : t->shape[t->n_dim - 1];
    if (row0 < 0 || n_rows < 0 || row0 > rows || n_rows > rows - row0 || col0 < 0 || n_cols < 0 ||
        col0 > cols || n_cols > cols - col0)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "%s: tensor '%s': block rows [%lld, +%lld) x cols [%lld, +%lld) is "
                             "outside its %lld x %lld",
                             t->file, t->name, (long long)row0, (long long)n_rows, (long long)col0,
                             (long long)n_cols, (long long)rows, (long long)cols);
    if (!n_rows || !n_cols)
        return MOE_OK;
    if (!dst)
        return moe_error_set(err, MOE_ERR_INVALID, "%s: tensor '%s': st_read_block: NULL dst",
                             t->file, t->name);

    size_t esize = moe_dtype_size(t->dtype), dsize = moe_dtype_size(dst_dtype);
    const unsigned char *src = t->data;
    unsigned char *out = dst;
    size_t nc = (size_t)n_cols;
    for (int64_t r = 0; r < n_rows; r++) {
        const unsigned char *s = src + ((size_t)(row0 + r) * (size_t)cols + (size_t)col0) * esize;
        unsigned char *o = out + (size_t)r * nc * dsize;
        if (t->dtype == dst_dtype) {
            memcpy(o, s, nc * esize);
        } else if (dst_dtype == MOE_DTYPE_F32) {
            for (size_t c = 0; c < nc; c++) {
                float f = load_f32(s + c * esize, t->dtype);
                memcpy(o + c * 4, &f, 4);
            }
        } else {
            for (size_t c = 0; c < nc; c++) {
                uint16_t h = moe_f32_to_bf16(load_f32(s + c * esize, t->dtype));
                memcpy(o + c * 2, &h, 2);
            }
        }
    }
    return MOE_OK;
}
