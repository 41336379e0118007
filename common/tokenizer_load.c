/* Loading tokenizer.json: every component is parsed into the plain tables of
 * struct moe_tokenizer (common/tokenizer_internal.h). A component this code
 * does not implement is MOE_ERR_UNSUPPORTED naming it: never ignored. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistr.h>

#include "tokenizer.h"
#include "tokenizer_internal.h"
#include "read_file.h"

/* GPT-2's pre-tokenizer regex, used by ByteLevel with use_regex = true. */
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

#define MAX_DEPTH 8                          /* nesting of Sequence components */
#define TOKENIZER_MAX_FILE ((size_t)1 << 30) /* tokenizer.json: tens of MiB at most */

struct loader {
    struct moe_tokenizer *tok;
    const char *path;
    struct moe_error *err;
};

static enum moe_status fmt_err(const struct loader *ld, const char *what, const char *why)
{
    return moe_error_set(ld->err, MOE_ERR_FORMAT, "%s: %s %s", ld->path, what, why);
}

static const cJSON *field(const cJSON *obj, const char *name)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(obj, name);
    return j && !cJSON_IsNull(j) ? j : NULL;
}

static enum moe_status get_bool(const struct loader *ld, const cJSON *obj, const char *what,
                                const char *name, bool dflt, bool *out)
{
    const cJSON *j = field(obj, name);
    *out = dflt;
    if (!j) {
        return MOE_OK;
    }
    if (!cJSON_IsBool(j))
        return moe_error_set(ld->err, MOE_ERR_FORMAT, "%s: %s.%s is not a boolean", ld->path, what,
                             name);
    *out = cJSON_IsTrue(j);
    return MOE_OK;
}

static enum moe_status get_str(const struct loader *ld, const cJSON *obj, const char *what,
                               const char *name, const char **out)
{
    const cJSON *j = field(obj, name);
    *out = "";
    if (!cJSON_IsString(j))
        return moe_error_set(ld->err, MOE_ERR_FORMAT, "%s: %s.%s is missing or not a string",
                             ld->path, what, name);
    *out = j->valuestring;
    return MOE_OK;
}

static enum moe_status get_int(const struct loader *ld, const cJSON *obj, const char *what,
                               const char *name, double lo, double hi, int64_t *out)
{
    const cJSON *j = field(obj, name);
    *out = 0;
    if (!cJSON_IsNumber(j) || j->valuedouble < lo || j->valuedouble > hi ||
        j->valuedouble != (double)(int64_t)j->valuedouble)
        return moe_error_set(ld->err, MOE_ERR_FORMAT,
                             "%s: %s.%s is missing or not an integer in [%.0f, %.0f]", ld->path,
                             what, name, lo, hi);
    *out = (int64_t)j->valuedouble;
    return MOE_OK;
}

static char *dup_str(const char *s, size_t *n)
{
    *n = strlen(s);
    char *d = malloc(*n + 1);
    if (d)
        memcpy(d, s, *n + 1);
    return d;
}

static enum moe_status nomem(const struct loader *ld)
{
    return moe_error_set(ld->err, MOE_ERR_NOMEM, "%s: out of memory", ld->path);
}

static enum moe_status unsupported(const struct loader *ld, const char *what, const char *type)
{
    return moe_error_set(ld->err, MOE_ERR_UNSUPPORTED, "%s: %s type '%.60s' is not supported",
                         ld->path, what, type);
}

/* {"String": s} -> s; a {"Regex": ...} pattern is unsupported where only a
 * literal is implemented (`regex_ok` false). */
static enum moe_status get_pattern(const struct loader *ld, const cJSON *obj, const char *what,
                                   bool regex_ok, const char **s, bool *is_regex)
{
    const cJSON *p = field(obj, "pattern");
    *s = "";
    *is_regex = false;
    const cJSON *str = p ? field(p, "String") : NULL;
    const cJSON *re = p ? field(p, "Regex") : NULL;
    if (cJSON_IsString(str)) {
        *s = str->valuestring;
        *is_regex = false;
        return MOE_OK;
    }
    if (cJSON_IsString(re)) {
        if (!regex_ok)
            return moe_error_set(ld->err, MOE_ERR_UNSUPPORTED,
                                 "%s: %s with a Regex pattern is not supported", ld->path, what);
        *s = re->valuestring;
        *is_regex = true;
        return MOE_OK;
    }
    return moe_error_set(ld->err, MOE_ERR_FORMAT,
                         "%s: %s.pattern is missing or neither {\"String\": ..} nor "
                         "{\"Regex\": ..}",
                         ld->path, what);
}

static enum moe_status one_char(const struct loader *ld, const char *what, const char *s,
                                char out[8], size_t *n)
{
    size_t len = strlen(s);
    if (len == 0 || len > 4 || tok_utf8_len((unsigned char)s[0]) != len)
        return moe_error_set(ld->err, MOE_ERR_FORMAT, "%s: %s \"%.20s\" is not one character",
                             ld->path, what, s);
    memcpy(out, s, len);
    *n = len;
    return MOE_OK;
}

static enum moe_status compile_regex(const struct loader *ld, const char *what, const char *pat,
                                     bool literal, pcre2_code **out)
{
    int code;
    PCRE2_SIZE off;
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    *out = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, opts, &code, &off, NULL);
    if (!*out) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof(msg));
        return moe_error_set(ld->err, MOE_ERR_UNSUPPORTED,
                             "%s: %s regex \"%.80s\" does not compile at offset %zu: %s", ld->path,
                             what, pat, (size_t)off, (const char *)msg);
    }
    pcre2_jit_compile(*out, PCRE2_JIT_COMPLETE); /* optional: falls back to the interpreter */
    return MOE_OK;
}

static enum moe_status get_scheme(const struct loader *ld, const cJSON *obj, const char *what,
                                  enum prepend_scheme *out)
{
    const cJSON *s = field(obj, "prepend_scheme");
    if (s) {
        if (!cJSON_IsString(s))
            return fmt_err(ld, what, "prepend_scheme is not a string");
        if (!strcmp(s->valuestring, "first"))
            *out = PREPEND_FIRST;
        else if (!strcmp(s->valuestring, "always"))
            *out = PREPEND_ALWAYS;
        else if (!strcmp(s->valuestring, "never"))
            *out = PREPEND_NEVER;
        else
            return moe_error_set(ld->err, MOE_ERR_FORMAT, "%s: %s.prepend_scheme '%.20s' unknown",
                                 ld->path, what, s->valuestring);
        return MOE_OK;
    }
    bool aps; /* legacy form */
    enum moe_status st = get_bool(ld, obj, what, "add_prefix_space", true, &aps);
    *out = aps ? PREPEND_ALWAYS : PREPEND_NEVER;
    return st;
}

/* ---- components ----------------------------------------------------------- */

static enum moe_status parse_normalizer(const struct loader *ld, const cJSON *j, int depth)
{
    struct moe_tokenizer *tok = ld->tok;
    enum moe_status st;
    const char *type;
    if (!j)
        return MOE_OK;
    if ((st = get_str(ld, j, "normalizer", "type", &type)))
        return st;
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = field(j, "normalizers");
        if (!cJSON_IsArray(list) || depth >= MAX_DEPTH)
            return fmt_err(ld, "normalizer Sequence", "has no 'normalizers' array");
        for (const cJSON *e = list->child; e; e = e->next)
            if ((st = parse_normalizer(ld, e, depth + 1)))
                return st;
        return MOE_OK;
    }
    struct norm nm = {0};
    if (!strcmp(type, "NFC") || !strcmp(type, "NFD") || !strcmp(type, "NFKC") ||
        !strcmp(type, "NFKD")) {
        nm.kind = NORM_UNICODE;
        nm.form = !strcmp(type, "NFC")    ? UNINORM_NFC
                  : !strcmp(type, "NFD")  ? UNINORM_NFD
                  : !strcmp(type, "NFKC") ? UNINORM_NFKC
                                          : UNINORM_NFKD;
    } else if (!strcmp(type, "Prepend")) {
        const char *s;
        if ((st = get_str(ld, j, "normalizer Prepend", "prepend", &s)))
            return st;
        nm.kind = NORM_PREPEND;
        if (!(nm.a = dup_str(s, &nm.na)))
            return nomem(ld);
    } else if (!strcmp(type, "Replace")) {
        const char *pat, *content;
        bool is_re;
        if ((st = get_pattern(ld, j, "normalizer Replace", false, &pat, &is_re)) ||
            (st = get_str(ld, j, "normalizer Replace", "content", &content)))
            return st;
        if (!*pat)
            return fmt_err(ld, "normalizer Replace", "has an empty pattern");
        nm.kind = NORM_REPLACE;
        nm.a = dup_str(pat, &nm.na);
        nm.b = dup_str(content, &nm.nb);
        if (!nm.a || !nm.b) {
            free(nm.a);
            free(nm.b);
            return nomem(ld);
        }
    } else {
        return unsupported(ld, "normalizer", type);
    }
    struct norm *v = realloc(tok->norms, (tok->n_norms + 1) * sizeof(*v));
    if (!v) {
        free(nm.a);
        free(nm.b);
        return nomem(ld);
    }
    tok->norms = v;
    tok->norms[tok->n_norms++] = nm;
    return MOE_OK;
}

static enum moe_status push_pre(const struct loader *ld, struct pre *p)
{
    struct moe_tokenizer *tok = ld->tok;
    struct pre *v = realloc(tok->pres, (tok->n_pres + 1) * sizeof(*v));
    if (!v) {
        pcre2_code_free(p->re);
        return nomem(ld);
    }
    tok->pres = v;
    tok->pres[tok->n_pres++] = *p;
    return MOE_OK;
}

static enum moe_status parse_pre(const struct loader *ld, const cJSON *j, int depth)
{
    enum moe_status st;
    const char *type;
    if (!j)
        return MOE_OK;
    if ((st = get_str(ld, j, "pre_tokenizer", "type", &type)))
        return st;
    struct pre p = {0};
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = field(j, "pretokenizers");
        if (!cJSON_IsArray(list) || depth >= MAX_DEPTH)
            return fmt_err(ld, "pre_tokenizer Sequence", "has no 'pretokenizers' array");
        for (const cJSON *e = list->child; e; e = e->next)
            if ((st = parse_pre(ld, e, depth + 1)))
                return st;
        return MOE_OK;
    }
    if (!strcmp(type, "Split")) {
        const char *pat, *beh;
        bool is_re;
        if ((st = get_pattern(ld, j, "pre_tokenizer Split", true, &pat, &is_re)) ||
            (st = get_str(ld, j, "pre_tokenizer Split", "behavior", &beh)) ||
            (st = get_bool(ld, j, "pre_tokenizer Split", "invert", false, &p.invert)))
            return st;
        p.kind = PRE_SPLIT;
        if (!strcmp(beh, "Isolated"))
            p.behavior = SPLIT_ISOLATED;
        else if (!strcmp(beh, "Removed"))
            p.behavior = SPLIT_REMOVED;
        else if (!strcmp(beh, "MergedWithPrevious"))
            p.behavior = SPLIT_MERGED_PREV;
        else if (!strcmp(beh, "MergedWithNext"))
            p.behavior = SPLIT_MERGED_NEXT;
        else
            return moe_error_set(ld->err, MOE_ERR_UNSUPPORTED,
                                 "%s: pre_tokenizer Split behavior '%.30s' is not supported",
                                 ld->path, beh);
        if (p.invert && (p.behavior == SPLIT_MERGED_PREV || p.behavior == SPLIT_MERGED_NEXT))
            return moe_error_set(ld->err, MOE_ERR_UNSUPPORTED,
                                 "%s: pre_tokenizer Split with invert and behavior '%s' is not "
                                 "supported",
                                 ld->path, beh);
        if (!*pat)
            return fmt_err(ld, "pre_tokenizer Split", "has an empty pattern");
        if ((st = compile_regex(ld, "pre_tokenizer Split", pat, !is_re, &p.re)))
            return st;
        return push_pre(ld, &p);
    }
    if (!strcmp(type, "ByteLevel")) {
        bool use_regex;
        if ((st = get_bool(ld, j, "pre_tokenizer ByteLevel", "add_prefix_space", true,
                           &p.add_prefix_space)) ||
            (st = get_bool(ld, j, "pre_tokenizer ByteLevel", "use_regex", true, &use_regex)))
            return st;
        p.kind = PRE_BYTE_LEVEL;
        if (use_regex &&
            (st = compile_regex(ld, "pre_tokenizer ByteLevel", GPT2_PATTERN, false, &p.re)))
            return st;
        return push_pre(ld, &p);
    }
    if (!strcmp(type, "Metaspace")) {
        const char *r;
        if ((st = get_str(ld, j, "pre_tokenizer Metaspace", "replacement", &r)) ||
            (st = one_char(ld, "pre_tokenizer Metaspace replacement", r, p.repl, &p.n_repl)) ||
            (st = get_scheme(ld, j, "pre_tokenizer Metaspace", &p.scheme)) ||
            (st = get_bool(ld, j, "pre_tokenizer Metaspace", "split", true, &p.split)))
            return st;
        p.kind = PRE_METASPACE;
        return push_pre(ld, &p);
    }
    return unsupported(ld, "pre_tokenizer", type);
}

static enum moe_status parse_decoder(const struct loader *ld, const cJSON *j, int depth)
{
    struct moe_tokenizer *tok = ld->tok;
    enum moe_status st;
    const char *type;
    if (!j)
        return MOE_OK;
    tok->has_decoder = true;
    if ((st = get_str(ld, j, "decoder", "type", &type)))
        return st;
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = field(j, "decoders");
        if (!cJSON_IsArray(list) || depth >= MAX_DEPTH)
            return fmt_err(ld, "decoder Sequence", "has no 'decoders' array");
        for (const cJSON *e = list->child; e; e = e->next)
            if ((st = parse_decoder(ld, e, depth + 1)))
                return st;
        return MOE_OK;
    }
    struct dec d = {0};
    if (!strcmp(type, "ByteLevel")) {
        d.kind = DEC_BYTE_LEVEL;
    } else if (!strcmp(type, "ByteFallback")) {
        d.kind = DEC_BYTE_FALLBACK;
    } else if (!strcmp(type, "Fuse")) {
        d.kind = DEC_FUSE;
    } else if (!strcmp(type, "Metaspace")) {
        const char *r;
        if ((st = get_str(ld, j, "decoder Metaspace", "replacement", &r)) ||
            (st = one_char(ld, "decoder Metaspace replacement", r, d.repl, &d.n_repl)) ||
            (st = get_scheme(ld, j, "decoder Metaspace", &d.scheme)))
            return st;
        d.kind = DEC_METASPACE;
    } else if (!strcmp(type, "Replace")) {
        const char *pat, *content;
        bool is_re;
        if ((st = get_pattern(ld, j, "decoder Replace", false, &pat, &is_re)) ||
            (st = get_str(ld, j, "decoder Replace", "content", &content)))
            return st;
        if (!*pat)
            return fmt_err(ld, "decoder Replace", "has an empty pattern");
        d.kind = DEC_REPLACE;
        d.a = dup_str(pat, &d.na);
        d.b = dup_str(content, &d.nb);
    } else if (!strcmp(type, "Strip")) {
        const char *c;
        int64_t start, stop;
        char ch[8];
        size_t nch;
        if ((st = get_str(ld, j, "decoder Strip", "content", &c)) ||
            (st = one_char(ld, "decoder Strip content", c, ch, &nch)) ||
            (st = get_int(ld, j, "decoder Strip", "start", 0, 1 << 20, &start)) ||
            (st = get_int(ld, j, "decoder Strip", "stop", 0, 1 << 20, &stop)))
            return st;
        d.kind = DEC_STRIP;
        d.a = dup_str(c, &d.na);
        d.start = (int)start;
        d.stop = (int)stop;
    } else {
        return unsupported(ld, "decoder", type);
    }
    struct dec *v = (d.kind == DEC_REPLACE && (!d.a || !d.b)) || (d.kind == DEC_STRIP && !d.a)
                        ? NULL
                        : realloc(tok->decs, (tok->n_decs + 1) * sizeof(*v));
    if (!v) {
        free(d.a);
        free(d.b);
        return nomem(ld);
    }
    tok->decs = v;
    tok->decs[tok->n_decs++] = d;
    return MOE_OK;
}

static enum moe_status parse_template(const struct loader *ld, const cJSON *j)
{
    struct moe_tokenizer *tok = ld->tok;
    const char *what = "post_processor TemplateProcessing";
    const cJSON *single = field(j, "single");
    const cJSON *specials = field(j, "special_tokens");
    if (!cJSON_IsArray(single))
        return fmt_err(ld, what, "has no 'single' array");
    if (tok->has_tmpl)
        return moe_error_set(ld->err, MOE_ERR_UNSUPPORTED,
                             "%s: more than one post_processor TemplateProcessing", ld->path);
    struct tok_ids t = {0};
    for (const cJSON *e = single->child; e; e = e->next) {
        const cJSON *seq = field(e, "Sequence"), *sp = field(e, "SpecialToken");
        const char *id;
        enum moe_status st;
        if (seq) {
            if ((st = get_str(ld, seq, what, "id", &id)))
                goto fail_st;
            if (strcmp(id, "A")) {
                st = moe_error_set(ld->err, MOE_ERR_FORMAT,
                                   "%s: %s.single refers to sequence '%.10s'", ld->path, what, id);
                goto fail_st;
            }
            if (!tok_ids_push(&t, -1))
                goto fail_mem;
            continue;
        }
        if (!sp) {
            st = fmt_err(ld, what, "single item is neither Sequence nor SpecialToken");
            goto fail_st;
        }
        if ((st = get_str(ld, sp, what, "id", &id)))
            goto fail_st;
        const cJSON *def = specials ? cJSON_GetObjectItemCaseSensitive(specials, id) : NULL;
        const cJSON *ids = def ? field(def, "ids") : NULL;
        if (!cJSON_IsArray(ids)) {
            st = moe_error_set(ld->err, MOE_ERR_FORMAT,
                               "%s: %s special token '%.60s' has no ids in special_tokens",
                               ld->path, what, id);
            goto fail_st;
        }
        for (const cJSON *x = ids->child; x; x = x->next) {
            if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble >= tok->n_vocab ||
                x->valuedouble != (double)(int32_t)x->valuedouble ||
                !tok->id_str[(int32_t)x->valuedouble]) { /* a hole of a sparse vocabulary */
                st = moe_error_set(ld->err, MOE_ERR_FORMAT,
                                   "%s: %s special token '%.60s': id %g is not in the vocabulary "
                                   "(n_vocab %d)",
                                   ld->path, what, id, cJSON_IsNumber(x) ? x->valuedouble : -1.0,
                                   tok->n_vocab);
                goto fail_st;
            }
            if (!tok_ids_push(&t, (int32_t)x->valuedouble))
                goto fail_mem;
        }
        continue;
    fail_st:
        free(t.v);
        return st;
    }
    tok->tmpl = t.v;
    tok->n_tmpl = t.n;
    tok->has_tmpl = true;
    return MOE_OK;
fail_mem:
    free(t.v);
    return nomem(ld);
}

static enum moe_status parse_post(const struct loader *ld, const cJSON *j, int depth)
{
    enum moe_status st;
    const char *type;
    if (!j)
        return MOE_OK;
    if ((st = get_str(ld, j, "post_processor", "type", &type)))
        return st;
    if (!strcmp(type, "ByteLevel"))
        return MOE_OK; /* only offsets: the ids are unchanged */
    if (!strcmp(type, "TemplateProcessing"))
        return parse_template(ld, j);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = field(j, "processors");
        if (!cJSON_IsArray(list) || depth >= MAX_DEPTH)
            return fmt_err(ld, "post_processor Sequence", "has no 'processors' array");
        for (const cJSON *e = list->child; e; e = e->next)
            if ((st = parse_post(ld, e, depth + 1)))
                return st;
        return MOE_OK;
    }
    return unsupported(ld, "post_processor", type);
}

/* Reads the added_tokens array (ids checked against the model's). */
static enum moe_status parse_added(const struct loader *ld, const cJSON *j)
{
    struct moe_tokenizer *tok = ld->tok;
    enum moe_status st;
    if (!j)
        return MOE_OK;
    if (!cJSON_IsArray(j))
        return fmt_err(ld, "added_tokens", "is not an array");
    int n = cJSON_GetArraySize(j);
    tok->added = calloc((size_t)n + 1, sizeof(*tok->added));
    if (!tok->added)
        return nomem(ld);
    for (const cJSON *e = j->child; e; e = e->next) {
        struct added *a = &tok->added[tok->n_added];
        const char *content;
        int64_t id;
        char what[48];
        snprintf(what, sizeof(what), "added_tokens[%zu]", tok->n_added);
        if ((st = get_str(ld, e, what, "content", &content)) ||
            (st = get_int(ld, e, what, "id", 0, (double)tok->bpe.n_ids + 1e6, &id)) ||
            (st = get_bool(ld, e, what, "special", false, &a->special)) ||
            (st = get_bool(ld, e, what, "lstrip", false, &a->lstrip)) ||
            (st = get_bool(ld, e, what, "rstrip", false, &a->rstrip)) ||
            (st = get_bool(ld, e, what, "single_word", false, &a->single_word)) ||
            (st = get_bool(ld, e, what, "normalized", !a->special, &a->normalized)))
            return st;
        if (!*content)
            return fmt_err(ld, what, "has empty content");
        for (size_t k = 0; k < tok->n_added; k++)
            if (tok->added[k].id == id)
                return moe_error_set(ld->err, MOE_ERR_FORMAT,
                                     "%s: %s: id %lld is already used by added token \"%.60s\"",
                                     ld->path, what, (long long)id, tok->added[k].content);
        a->id = (int32_t)id;
        if (!(a->content = dup_str(content, &a->len)))
            return nomem(ld);
        tok->n_added++;
    }
    return MOE_OK;
}

/* Id tables, the normalized forms of normalized added tokens, first bytes. */
static enum moe_status build_tables(const struct loader *ld)
{
    struct moe_tokenizer *tok = ld->tok;
    int32_t n = tok->bpe.n_ids;
    for (size_t k = 0; k < tok->n_added; k++)
        if (tok->added[k].id + 1 > n)
            n = tok->added[k].id + 1;
    tok->n_vocab = n;
    tok->id_str = calloc((size_t)n + 1, sizeof(*tok->id_str));
    tok->id_len = calloc((size_t)n + 1, sizeof(*tok->id_len));
    tok->id_special = calloc((size_t)n + 1, sizeof(*tok->id_special));
    if (!tok->id_str || !tok->id_len || !tok->id_special)
        return nomem(ld);
    for (int32_t i = 0; i < tok->bpe.n_ids; i++) {
        tok->id_str[i] = tok->bpe.strs[i];
        tok->id_len[i] = tok->bpe.lens[i];
    }
    struct sbuf out = {0}, tmp = {0};
    for (size_t k = 0; k < tok->n_added; k++) {
        struct added *a = &tok->added[k];
        tok->id_str[a->id] = a->content;
        tok->id_len[a->id] = (uint32_t)a->len;
        tok->id_special[a->id] = a->special;
        if (a->normalized) {
            if (!tok_normalize(tok, a->content, a->len, &out, &tmp)) {
                free(out.p);
                free(tmp.p);
                return nomem(ld);
            }
            a->match = malloc(out.n + 1);
            if (!a->match) {
                free(out.p);
                free(tmp.p);
                return nomem(ld);
            }
            memcpy(a->match, out.p, out.n);
            a->match[out.n] = 0;
            a->n_match = out.n;
        } else {
            a->match = a->content;
            a->n_match = a->len;
        }
        /* `tokenizers` gives a normalized token's normalized form back on decode. */
        tok->id_str[a->id] = a->match;
        tok->id_len[a->id] = (uint32_t)a->n_match;
        if (a->n_match)
            tok->added_first[a->normalized][(unsigned char)a->match[0]] = true;
    }
    free(out.p);
    free(tmp.p);
    return MOE_OK;
}

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the
 * others to 256, 257, ... in byte order. */
static void build_byte_table(struct moe_tokenizer *tok)
{
    int next = 256;
    for (int i = 0; i < 512; i++)
        tok->byte_of_uni[i] = -1;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        int u = printable ? b : next++;
        tok->uni_of_byte[b] = (uint16_t)u;
        tok->byte_of_uni[u] = (int16_t)b;
    }
}

/* ---- public --------------------------------------------------------------- */

void moe_tokenizer_free(struct moe_tokenizer *tok)
{
    if (!tok)
        return;
    tok_bpe_release(&tok->bpe);
    for (size_t i = 0; i < tok->n_norms; i++) {
        free(tok->norms[i].a);
        free(tok->norms[i].b);
    }
    free(tok->norms);
    for (size_t i = 0; i < tok->n_pres; i++)
        pcre2_code_free(tok->pres[i].re);
    free(tok->pres);
    for (size_t i = 0; i < tok->n_decs; i++) {
        free(tok->decs[i].a);
        free(tok->decs[i].b);
    }
    free(tok->decs);
    for (size_t i = 0; i < tok->n_added; i++) {
        if (tok->added[i].match != tok->added[i].content)
            free(tok->added[i].match);
        free(tok->added[i].content);
    }
    free(tok->added);
    free(tok->tmpl);
    free(tok->id_str);
    free(tok->id_len);
    free(tok->id_special);
    free(tok);
}

enum moe_status moe_tokenizer_load(const char *path, struct moe_tokenizer **out,
                                   struct moe_error *err)
{
    enum moe_status st;
    char *data = NULL;
    size_t n = 0;
    if (!path || !out)
        return moe_error_set(err, MOE_ERR_INVALID, "tokenizer load: NULL argument");
    *out = NULL;
    if ((st = moe_read_file(path, TOKENIZER_MAX_FILE, &data, &n, err)))
        return st;
    st = moe_tokenizer_parse(data, n, path, out, err);
    free(data);
    return st;
}

enum moe_status moe_tokenizer_parse(const char *json, size_t n, const char *path,
                                    struct moe_tokenizer **out, struct moe_error *err)
{
    enum moe_status st;
    cJSON *root = NULL;
    struct moe_tokenizer *tok = NULL;
    if ((!json && n) || !path || !out)
        return moe_error_set(err, MOE_ERR_INVALID, "tokenizer parse: NULL argument");
    *out = NULL;
    /* JSON is UTF-8 (cJSON does not check): a token must never decode to
     * bytes that are not, as the tokenizers library refuses such a file. */
    const uint8_t *bad = n ? u8_check((const uint8_t *)json, n) : NULL;
    if (bad)
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: not valid UTF-8 (at byte %zu)", path,
                             (size_t)((const char *)bad - json));
    root = cJSON_ParseWithLength(json ? json : "", n);
    if (!cJSON_IsObject(root)) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: not a JSON object%s", path,
                           root ? "" : " (JSON syntax error)");
        goto fail;
    }
    tok = calloc(1, sizeof(*tok));
    if (!tok) {
        st = moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", path);
        goto fail;
    }
    struct loader ld = {tok, path, err};
    static const char *const refused[] = {"truncation", "padding"};
    for (size_t i = 0; i < 2; i++)
        if (field(root, refused[i])) {
            st = moe_error_set(err, MOE_ERR_UNSUPPORTED, "%s: '%s' is not supported (must be null)",
                               path, refused[i]);
            goto fail;
        }
    const cJSON *model = field(root, "model");
    if (!cJSON_IsObject(model)) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: 'model' is missing or not an object", path);
        goto fail;
    }
    const cJSON *mtype = field(model, "type");
    if (mtype && !cJSON_IsString(mtype)) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: model.type is not a string", path);
        goto fail;
    }
    if (mtype ? strcmp(mtype->valuestring, "BPE") != 0 : !field(model, "merges")) {
        st = unsupported(&ld, "model", mtype ? mtype->valuestring : "(none, no merges)");
        goto fail;
    }
    if ((st = tok_bpe_load(&tok->bpe, model, path, err)))
        goto fail;
    build_byte_table(tok);
    if ((st = parse_normalizer(&ld, field(root, "normalizer"), 0)) ||
        (st = parse_pre(&ld, field(root, "pre_tokenizer"), 0)) ||
        (st = parse_decoder(&ld, field(root, "decoder"), 0)) ||
        (st = parse_added(&ld, field(root, "added_tokens"))) || (st = build_tables(&ld)) ||
        (st = parse_post(&ld, field(root, "post_processor"), 0)))
        goto fail;
    cJSON_Delete(root);
    *out = tok;
    return MOE_OK;
fail:
    moe_tokenizer_free(tok);
    cJSON_Delete(root);
    return st;
}
