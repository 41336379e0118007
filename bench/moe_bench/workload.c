/* Workloads (workload.h): generated prompts and prompt files. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "workload.h"

/* Random streams: one per use, so that changing one kind of draw never moves
 * another. */
enum {
    STREAM_RANDOM = 1,
    STREAM_SHUFFLE,
    STREAM_PREFIX,
    STREAM_SUFFIX,
    STREAM_BLOCK,
    STREAM_TRACE,
    STREAM_WARMUP,
    STREAM_ADJUST,
};

#define SHAREGPT_MIN_LEN 4
#define SHAREGPT_MAX_PROMPT 1024
#define SHAREGPT_MAX_TOTAL 2048

struct file_item {
    int32_t *ids; /* (n_ids) */
    int n_ids;
    char *text; /* NULL unless the dataset has text */
    int output_len;
    double timestamp_s;
    int32_t *hash_ids; /* (n_hash) trace blocks */
    int n_hash;
};

struct bench_workload {
    struct bench_workload_opts o;
    int32_t *usable; /* (n_usable) ids random prompts are drawn from; NULL: [0, vocab) */
    int n_usable;
    int vocab;
    struct file_item *items; /* (n_items) file workloads */
    size_t n_items;
    /* prefix_repetition: the shared prefixes, made once. */
    struct bench_item *prefixes; /* (num_prefixes) */
};

bool bench_dataset_parse(const char *s, enum bench_dataset *out)
{
    static const struct {
        const char *name;
        enum bench_dataset kind;
    } names[] = {{"random", BENCH_DS_RANDOM},
                 {"sharegpt", BENCH_DS_SHAREGPT},
                 {"prefix_repetition", BENCH_DS_PREFIX},
                 {"prefix-repetition", BENCH_DS_PREFIX},
                 {"trace", BENCH_DS_TRACE}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i].name)) {
            *out = names[i].kind;
            return true;
        }
    return false;
}

const char *bench_dataset_name(enum bench_dataset kind)
{
    switch (kind) {
    case BENCH_DS_RANDOM: return "random";
    case BENCH_DS_SHAREGPT: return "sharegpt";
    case BENCH_DS_PREFIX: return "prefix_repetition";
    case BENCH_DS_TRACE: return "trace";
    }
    return "?";
}

/* ---- ids and text ------------------------------------------------------------------ */

static int32_t draw_id(const struct bench_workload *w, struct bench_rng *r)
{
    if (w->usable)
        return w->usable[bench_rng_range(r, 0, w->n_usable - 1)];
    return (int32_t)bench_rng_range(r, 0, w->vocab - 1);
}

static enum moe_status draw_ids(const struct bench_workload *w, struct bench_rng *r, int n,
                                int32_t **out)
{
    int32_t *ids = malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    if (!ids)
        return MOE_ERR_NOMEM;
    for (int i = 0; i < n; i++)
        ids[i] = draw_id(w, r);
    *out = ids;
    return MOE_OK;
}

/* Turns item->ids (n_ids = wanted length) into text that re-tokenizes to
 * that many tokens where it can: decode, re-encode, then cut or extend the
 * re-encoded ids and try again (a few rounds). item->ids become the final
 * text's own tokens and input_len their count. */
static enum moe_status make_text(const struct bench_workload *w, struct bench_item *item,
                                 struct bench_rng *r, struct moe_error *err)
{
    const struct moe_tokenizer *tok = w->o.tok;
    int want = item->n_ids;
    int32_t *ids = item->ids;
    int n = item->n_ids;
    char *text = NULL;
    size_t tlen = 0;
    for (int round = 0; round < 8; round++) {
        free(text);
        text = NULL;
        if (moe_tokenizer_decode(tok, ids, (size_t)n, true, &text, &tlen, err))
            goto fail;
        int32_t *re = NULL;
        size_t n_re = 0;
        if (moe_tokenizer_encode(tok, text, tlen, false, &re, &n_re, err))
            goto fail;
        free(ids);
        ids = re; /* the text's own tokens */
        n = (int)n_re;
        if (n == want || round == 7)
            break;
        if (n > want) {
            n = want;
            continue;
        }
        int32_t *g = realloc(ids, (size_t)want * sizeof(int32_t));
        if (!g) {
            moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
            goto fail;
        }
        ids = g;
        while (n < want)
            ids[n++] = draw_id(w, r);
    }
    item->ids = ids;
    item->n_ids = n;
    item->text = text;
    item->input_len = n;
    return MOE_OK;
fail:
    free(ids);
    free(text);
    item->ids = NULL;
    item->n_ids = 0;
    return err->code ? err->code : MOE_ERR_INTERNAL;
}

/* Sets input_len, and the text when the target needs text. */
static enum moe_status finish_item(const struct bench_workload *w, struct bench_item *item,
                                   struct bench_rng *r, struct moe_error *err)
{
    item->input_len = item->n_ids;
    if (w->o.want_text && !item->text)
        return make_text(w, item, r, err);
    return MOE_OK;
}

static int scaled_len(struct bench_rng *r, int len, double ratio)
{
    int lo = (int)floor(len * (1.0 - ratio)), hi = (int)floor(len * (1.0 + ratio));
    if (lo < 1)
        lo = 1;
    if (hi < lo)
        hi = lo;
    return (int)bench_rng_range(r, lo, hi);
}

/* ---- file reading --------------------------------------------------------------------- */

static char *read_file(const char *path, size_t *len, struct moe_error *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        moe_error_set(err, MOE_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (n < cap)
            break;
        char *g = realloc(buf, 2 * cap + 1);
        if (!g) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = g;
        cap *= 2;
    }
    bool bad = ferror(f);
    fclose(f);
    if (!buf) {
        moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", path);
        return NULL;
    }
    if (bad) {
        free(buf);
        moe_error_set(err, MOE_ERR_IO, "%s: read error", path);
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

static enum moe_status push_item(struct bench_workload *w, size_t *cap, struct file_item *it,
                                 struct moe_error *err)
{
    if (w->n_items == *cap) {
        size_t c = *cap ? 2 * *cap : 64;
        struct file_item *g = realloc(w->items, c * sizeof(*g));
        if (!g)
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        w->items = g;
        *cap = c;
    }
    w->items[w->n_items++] = *it;
    return MOE_OK;
}

static enum moe_status encode(const struct bench_workload *w, const char *text, int32_t **ids,
                              int *n, struct moe_error *err)
{
    size_t nn = 0;
    enum moe_status st = moe_tokenizer_encode(w->o.tok, text, strlen(text), false, ids, &nn, err);
    *n = (int)nn;
    return st;
}

/* ShareGPT: [{"id": ..., "conversations": [{"from": "human", "value": "..."}, ...]}] */
static enum moe_status load_sharegpt(struct bench_workload *w, struct moe_error *err)
{
    const char *path = w->o.path;
    size_t len = 0;
    char *buf = read_file(path, &len, err);
    if (!buf)
        return err->code;
    enum moe_status st = MOE_OK;
    cJSON *root = cJSON_ParseWithLength(buf, len);
    size_t cap = 0;
    int n_entries = 0, n_short = 0;
    if (!root) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: not valid JSON (near byte %ld)", path,
                           cJSON_GetErrorPtr() ? (long)(cJSON_GetErrorPtr() - buf) : -1L);
        goto done;
    }
    if (!cJSON_IsArray(root)) {
        st = moe_error_set(err, MOE_ERR_FORMAT,
                           "%s: a ShareGPT file is a JSON array of conversations", path);
        goto done;
    }
    cJSON *e;
    int idx = 0;
    cJSON_ArrayForEach(e, root)
    {
        n_entries++;
        if (!cJSON_IsObject(e)) {
            st = moe_error_set(err, MOE_ERR_FORMAT, "%s: entry %d is not an object", path, idx);
            goto done;
        }
        cJSON *f, *conv = NULL;
        cJSON_ArrayForEach(f, e)
        {
            if (!strcmp(f->string, "conversations")) {
                conv = f;
            } else if (strcmp(f->string, "id")) {
                st = moe_error_set(err, MOE_ERR_FORMAT,
                                   "%s: entry %d: unknown field '%s' (ShareGPT entries have "
                                   "'id' and 'conversations')",
                                   path, idx, f->string);
                goto done;
            }
        }
        if (!conv || !cJSON_IsArray(conv)) {
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: entry %d: 'conversations' is missing or not an array", path,
                               idx);
            goto done;
        }
        const char *turn[2] = {NULL, NULL};
        int t = 0;
        cJSON *c;
        cJSON_ArrayForEach(c, conv)
        {
            if (!cJSON_IsObject(c)) {
                st = moe_error_set(err, MOE_ERR_FORMAT, "%s: entry %d: turn %d is not an object",
                                   path, idx, t);
                goto done;
            }
            cJSON *g;
            const char *value = NULL;
            cJSON_ArrayForEach(g, c)
            {
                if (!strcmp(g->string, "value")) {
                    if (!cJSON_IsString(g)) {
                        st = moe_error_set(err, MOE_ERR_FORMAT,
                                           "%s: entry %d: turn %d: 'value' is not a string", path,
                                           idx, t);
                        goto done;
                    }
                    value = g->valuestring;
                } else if (strcmp(g->string, "from")) {
                    st = moe_error_set(err, MOE_ERR_FORMAT,
                                       "%s: entry %d: turn %d: unknown field '%s' (turns have "
                                       "'from' and 'value')",
                                       path, idx, t, g->string);
                    goto done;
                }
            }
            if (!value) {
                st = moe_error_set(err, MOE_ERR_FORMAT, "%s: entry %d: turn %d has no 'value'",
                                   path, idx, t);
                goto done;
            }
            if (t < 2)
                turn[t] = value;
            t++;
        }
        idx++;
        if (t < 2) {
            n_short++;
            continue;
        }
        struct file_item it = {0};
        int32_t *cids = NULL;
        int n_c = 0;
        if (encode(w, turn[0], &it.ids, &it.n_ids, err) || encode(w, turn[1], &cids, &n_c, err)) {
            free(it.ids);
            st = moe_error_prefix(err, "%s: entry %d", path, idx - 1);
            goto done;
        }
        free(cids);
        it.output_len = w->o.sharegpt_output_len ? w->o.sharegpt_output_len : n_c;
        if (it.n_ids < SHAREGPT_MIN_LEN || it.output_len < SHAREGPT_MIN_LEN ||
            it.n_ids > SHAREGPT_MAX_PROMPT || it.n_ids + it.output_len > SHAREGPT_MAX_TOTAL) {
            free(it.ids);
            n_short++;
            continue;
        }
        it.text = strdup(turn[0]);
        if (!it.text || push_item(w, &cap, &it, err)) {
            free(it.ids);
            free(it.text);
            st = moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", path);
            goto done;
        }
    }
    if (w->n_items == 0) {
        st =
            moe_error_set(err, MOE_ERR_FORMAT,
                          "%s: no usable conversation among %d (each needs >= 2 turns, a prompt "
                          "of %d..%d tokens and an output of >= %d)",
                          path, n_entries, SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MIN_LEN);
        goto done;
    }
    /* Seeded shuffle (Fisher-Yates), as vLLM samples the file. */
    struct bench_rng r;
    bench_rng_seed(&r, w->o.seed, STREAM_SHUFFLE, 0);
    for (size_t i = w->n_items - 1; i > 0; i--) {
        size_t j = (size_t)bench_rng_range(&r, 0, (int64_t)i);
        struct file_item tmp = w->items[i];
        w->items[i] = w->items[j];
        w->items[j] = tmp;
    }
done:
    cJSON_Delete(root);
    free(buf);
    return st;
}

static bool json_whole(const cJSON *v, double lo, double hi, long *out)
{
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) ||
        v->valuedouble != floor(v->valuedouble) || v->valuedouble < lo || v->valuedouble > hi)
        return false;
    *out = (long)v->valuedouble;
    return true;
}

/* Trace JSON Lines: {"timestamp": ms, "input_length": n, "output_length": n,
 * "hash_ids": [...]} */
static enum moe_status load_trace(struct bench_workload *w, struct moe_error *err)
{
    const char *path = w->o.path;
    size_t len = 0;
    char *buf = read_file(path, &len, err);
    if (!buf)
        return err->code;
    enum moe_status st = MOE_OK;
    size_t cap = 0;
    int line_no = 0;
    double t0 = 0, t_prev = -INFINITY;
    for (char *line = buf; line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl)
            *nl = 0;
        line_no++;
        char *p = line;
        while (*p == ' ' || *p == '\t' || *p == '\r')
            p++;
        if (!*p) {
            line = nl ? nl + 1 : NULL;
            continue;
        }
        cJSON *o = cJSON_Parse(p);
        struct file_item it = {0};
        bool has_ts = false, has_in = false, has_out = false;
        long in_len = 0, out_len = 0;
        if (!o || !cJSON_IsObject(o)) {
            cJSON_Delete(o);
            st = moe_error_set(err, MOE_ERR_FORMAT, "%s:%d: not a JSON object", path, line_no);
            goto done;
        }
        cJSON *f;
        cJSON_ArrayForEach(f, o)
        {
            const char *k = f->string;
            if (!strcmp(k, "timestamp")) {
                if (!cJSON_IsNumber(f) || !isfinite(f->valuedouble) || f->valuedouble < 0) {
                    st = moe_error_set(err, MOE_ERR_FORMAT,
                                       "%s:%d: 'timestamp' must be a number of ms >= 0", path,
                                       line_no);
                    break;
                }
                it.timestamp_s = f->valuedouble / 1000.0;
                has_ts = true;
            } else if (!strcmp(k, "input_length")) {
                if (!json_whole(f, 1, 1 << 24, &in_len)) {
                    st = moe_error_set(err, MOE_ERR_FORMAT,
                                       "%s:%d: 'input_length' must be a whole number >= 1", path,
                                       line_no);
                    break;
                }
                has_in = true;
            } else if (!strcmp(k, "output_length")) {
                if (!json_whole(f, 1, 1 << 24, &out_len)) {
                    st = moe_error_set(err, MOE_ERR_FORMAT,
                                       "%s:%d: 'output_length' must be a whole number >= 1", path,
                                       line_no);
                    break;
                }
                has_out = true;
            } else if (!strcmp(k, "hash_ids")) {
                int n = cJSON_GetArraySize(f);
                if (!cJSON_IsArray(f)) {
                    st = moe_error_set(err, MOE_ERR_FORMAT, "%s:%d: 'hash_ids' is not an array",
                                       path, line_no);
                    break;
                }
                free(it.hash_ids);
                it.hash_ids = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
                if (!it.hash_ids) {
                    st = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
                    break;
                }
                cJSON *h;
                it.n_hash = 0;
                cJSON_ArrayForEach(h, f)
                {
                    long v;
                    if (!json_whole(h, 0, 2147483647.0, &v)) {
                        st = moe_error_set(err, MOE_ERR_FORMAT,
                                           "%s:%d: 'hash_ids' entry %d is not a whole number >= 0",
                                           path, line_no, it.n_hash);
                        break;
                    }
                    it.hash_ids[it.n_hash++] = (int32_t)v;
                }
                if (st)
                    break;
            } else {
                st = moe_error_set(err, MOE_ERR_FORMAT,
                                   "%s:%d: unknown field '%s' (trace lines have 'timestamp', "
                                   "'input_length', 'output_length', 'hash_ids')",
                                   path, line_no, k);
                break;
            }
        }
        cJSON_Delete(o);
        if (!st && !(has_ts && has_in && has_out))
            st = moe_error_set(err, MOE_ERR_FORMAT, "%s:%d: missing '%s'", path, line_no,
                               !has_ts   ? "timestamp"
                               : !has_in ? "input_length"
                                         : "output_length");
        if (!st && it.timestamp_s < t_prev)
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s:%d: timestamp %.0f ms is before the previous line's", path,
                               line_no, it.timestamp_s * 1e3);
        if (st) {
            free(it.hash_ids);
            goto done;
        }
        if (w->n_items == 0)
            t0 = it.timestamp_s;
        t_prev = it.timestamp_s;
        it.timestamp_s -= t0;
        it.n_ids = (int)in_len; /* made on demand from hash_ids */
        it.output_len = (int)out_len;
        if (push_item(w, &cap, &it, err)) {
            free(it.hash_ids);
            st = err->code;
            goto done;
        }
        line = nl ? nl + 1 : NULL;
    }
    if (w->n_items == 0)
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: no trace lines", path);
done:
    free(buf);
    return st;
}

/* ---- the workload ------------------------------------------------------------------------- */

static enum moe_status prefix_make(struct bench_workload *w, int k, struct bench_item *out,
                                   struct moe_error *err)
{
    struct bench_rng r;
    bench_rng_seed(&r, w->o.seed, STREAM_PREFIX, (uint64_t)k);
    memset(out, 0, sizeof(*out));
    out->n_ids = w->o.prefix_len;
    if (draw_ids(w, &r, out->n_ids, &out->ids))
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    return finish_item(w, out, &r, err);
}

enum moe_status bench_workload_create(const struct bench_workload_opts *opts,
                                      struct bench_workload **out, struct moe_error *err)
{
    struct bench_workload *w = calloc(1, sizeof(*w));
    if (!w)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    w->o = *opts;
    enum moe_status st = MOE_OK;
    const char *ds = bench_dataset_name(opts->kind);
    if (opts->want_text && !opts->tok) {
        st = moe_error_set(err, MOE_ERR_INVALID,
                           "the %s workload sends text prompts here: give --tokenizer DIR (the "
                           "model's tokenizer.json)",
                           ds);
        goto fail;
    }
    if (opts->kind == BENCH_DS_SHAREGPT && !opts->tok) {
        st = moe_error_set(err, MOE_ERR_INVALID,
                           "the sharegpt workload counts tokens: give --tokenizer DIR");
        goto fail;
    }
    if ((opts->kind == BENCH_DS_SHAREGPT || opts->kind == BENCH_DS_TRACE) && !opts->path) {
        st = moe_error_set(err, MOE_ERR_INVALID, "the %s workload needs --dataset-path FILE", ds);
        goto fail;
    }
    if ((opts->kind == BENCH_DS_RANDOM || opts->kind == BENCH_DS_PREFIX) && opts->path) {
        st = moe_error_set(err, MOE_ERR_INVALID,
                           "the %s workload reads no file: drop --dataset-path or pick "
                           "--dataset-name sharegpt|trace",
                           ds);
        goto fail;
    }
    w->vocab = opts->vocab;
    if (opts->tok) {
        int nv = moe_tokenizer_n_vocab(opts->tok);
        if (w->vocab <= 0 || w->vocab > nv)
            w->vocab = nv;
        w->usable = malloc((size_t)w->vocab * sizeof(int32_t));
        if (!w->usable) {
            st = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
            goto fail;
        }
        /* Ids that decode to printable text on their own (no special tokens). */
        for (int32_t id = 0; id < w->vocab; id++) {
            char *text = NULL;
            size_t tl = 0;
            struct moe_error e2 = {0};
            bool ok = moe_tokenizer_decode(opts->tok, &id, 1, true, &text, &tl, &e2) == MOE_OK &&
                      tl && !strstr(text, "\xef\xbf\xbd");
            for (size_t k = 0; ok && k < tl; k++) /* no NUL or control bytes */
                ok = (unsigned char)text[k] >= 0x20 && text[k] != 0x7f;
            if (ok)
                w->usable[w->n_usable++] = id;
            free(text);
        }
        if (w->n_usable == 0) {
            st = moe_error_set(err, MOE_ERR_INVALID, "the tokenizer has no ordinary tokens");
            goto fail;
        }
    } else if (w->vocab <= 0) {
        st = moe_error_set(err, MOE_ERR_INVALID,
                           "random token ids need a vocabulary size: give --tokenizer DIR or "
                           "--vocab-size N");
        goto fail;
    }
    switch (opts->kind) {
    case BENCH_DS_RANDOM: break;
    case BENCH_DS_SHAREGPT: st = load_sharegpt(w, err); break;
    case BENCH_DS_TRACE: st = load_trace(w, err); break;
    case BENCH_DS_PREFIX:
        if (opts->num_prefixes < 1 || opts->prefix_len < 0 || opts->suffix_len < 1) {
            st = moe_error_set(err, MOE_ERR_INVALID,
                               "prefix_repetition needs >= 1 prefix and suffixes of >= 1 token");
            break;
        }
        w->prefixes = calloc((size_t)opts->num_prefixes, sizeof(*w->prefixes));
        if (!w->prefixes) {
            st = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
            break;
        }
        for (int k = 0; k < opts->num_prefixes && !st; k++)
            st = prefix_make(w, k, &w->prefixes[k], err);
        break;
    }
    if (st)
        goto fail;
    *out = w;
    return MOE_OK;
fail:
    bench_workload_destroy(w);
    return st;
}

void bench_workload_destroy(struct bench_workload *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n_items; i++) {
        free(w->items[i].ids);
        free(w->items[i].text);
        free(w->items[i].hash_ids);
    }
    free(w->items);
    if (w->prefixes)
        for (int k = 0; k < w->o.num_prefixes; k++)
            bench_item_clear(&w->prefixes[k]);
    free(w->prefixes);
    free(w->usable);
    free(w);
}

size_t bench_workload_size(const struct bench_workload *w)
{
    return w->n_items;
}

static enum moe_status trace_item(const struct bench_workload *w, const struct file_item *fi,
                                  int64_t index, struct bench_item *item, struct moe_error *err)
{
    int want = fi->n_ids, bs = w->o.trace_block_size > 0 ? w->o.trace_block_size : 512;
    item->ids = malloc((size_t)want * sizeof(int32_t));
    if (!item->ids)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    int n = 0;
    struct bench_rng r;
    for (int b = 0; b < fi->n_hash && n < want; b++) {
        bench_rng_seed(&r, w->o.seed, STREAM_BLOCK, (uint64_t)fi->hash_ids[b]);
        for (int j = 0; j < bs && n < want; j++)
            item->ids[n++] = draw_id(w, &r);
    }
    bench_rng_seed(&r, w->o.seed, STREAM_TRACE, (uint64_t)index);
    while (n < want)
        item->ids[n++] = draw_id(w, &r);
    item->n_ids = n;
    item->output_len = fi->output_len;
    item->timestamp_s = fi->timestamp_s;
    return finish_item(w, item, &r, err);
}

enum moe_status bench_workload_item(const struct bench_workload *w, int64_t index,
                                    struct bench_item *item, struct moe_error *err)
{
    memset(item, 0, sizeof(*item));
    struct bench_rng r;
    enum moe_status st = MOE_OK;
    switch (w->o.kind) {
    case BENCH_DS_RANDOM:
        bench_rng_seed(&r, w->o.seed, STREAM_RANDOM, (uint64_t)index);
        item->n_ids = scaled_len(&r, w->o.random_input_len, w->o.random_range_ratio);
        item->output_len = scaled_len(&r, w->o.random_output_len, w->o.random_range_ratio);
        if (draw_ids(w, &r, item->n_ids, &item->ids))
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        st = finish_item(w, item, &r, err);
        break;
    case BENCH_DS_PREFIX: {
        const struct bench_item *pre = &w->prefixes[index % w->o.num_prefixes];
        struct bench_item suf = {0};
        bench_rng_seed(&r, w->o.seed, STREAM_SUFFIX, (uint64_t)index);
        suf.n_ids = w->o.suffix_len;
        if (draw_ids(w, &r, suf.n_ids, &suf.ids))
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        st = finish_item(w, &suf, &r, err);
        if (st) {
            bench_item_clear(&suf);
            break;
        }
        item->n_ids = pre->n_ids + suf.n_ids;
        item->ids = malloc((size_t)item->n_ids * sizeof(int32_t));
        if (!item->ids) {
            bench_item_clear(&suf);
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        }
        memcpy(item->ids, pre->ids, (size_t)pre->n_ids * sizeof(int32_t));
        memcpy(item->ids + pre->n_ids, suf.ids, (size_t)suf.n_ids * sizeof(int32_t));
        item->input_len = item->n_ids;
        if (pre->text && suf.text) {
            size_t a = strlen(pre->text), b = strlen(suf.text);
            item->text = malloc(a + b + 1);
            if (!item->text) {
                bench_item_clear(&suf);
                return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
            }
            memcpy(item->text, pre->text, a);
            memcpy(item->text + a, suf.text, b + 1);
            /* The joined text may tokenize differently at the seam. */
            int32_t *re = NULL;
            size_t n_re = 0;
            if (moe_tokenizer_encode(w->o.tok, item->text, a + b, false, &re, &n_re, err) == 0) {
                free(item->ids);
                item->ids = re;
                item->n_ids = item->input_len = (int)n_re;
            }
        }
        item->output_len = w->o.prefix_output_len;
        bench_item_clear(&suf);
        break;
    }
    case BENCH_DS_SHAREGPT: {
        const struct file_item *fi = &w->items[(size_t)index % w->n_items];
        item->ids = malloc((size_t)fi->n_ids * sizeof(int32_t));
        item->text = strdup(fi->text);
        if (!item->ids || !item->text) {
            bench_item_clear(item);
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        }
        memcpy(item->ids, fi->ids, (size_t)fi->n_ids * sizeof(int32_t));
        item->n_ids = item->input_len = fi->n_ids;
        item->output_len = fi->output_len;
        break;
    }
    case BENCH_DS_TRACE:
        st = trace_item(w, &w->items[(size_t)index % w->n_items], index, item, err);
        break;
    }
    if (st)
        bench_item_clear(item);
    return st;
}

enum moe_status bench_workload_warmup_item(const struct bench_workload *w, int64_t index,
                                           struct bench_item *item, struct moe_error *err)
{
    struct bench_item model;
    enum moe_status st = bench_workload_item(w, index, &model, err);
    if (st)
        return st;
    memset(item, 0, sizeof(*item));
    struct bench_rng r;
    bench_rng_seed(&r, w->o.seed, STREAM_WARMUP, (uint64_t)index);
    item->n_ids = model.input_len > 0 ? model.input_len : 1;
    item->output_len = model.output_len;
    bench_item_clear(&model);
    if (draw_ids(w, &r, item->n_ids, &item->ids))
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    st = finish_item(w, item, &r, err);
    if (st)
        bench_item_clear(item);
    return st;
}

double bench_workload_timestamp(const struct bench_workload *w, int64_t index)
{
    if (w->o.kind != BENCH_DS_TRACE || w->n_items == 0)
        return 0;
    size_t n = w->n_items;
    double span = w->items[n - 1].timestamp_s;
    /* one mean gap between the end of one pass and the start of the next */
    double gap = n > 1 ? span / (double)(n - 1) : 1.0;
    int64_t pass = index / (int64_t)n;
    return w->items[(size_t)(index % (int64_t)n)].timestamp_s + (double)pass * (span + gap);
}
