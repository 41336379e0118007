/* Hugging Face tokenizer.json: loading and the encode/decode pipelines.
 *
 * Encode follows `tokenizers`: split out added tokens whose `normalized` is
 * false (leftmost-longest) -> normalize each remaining piece -> split out the
 * `normalized` added tokens -> pre-tokenize into words -> BPE each word
 * (common/tokenizer_bpe.c) -> post-processor template when add_special.
 * Decode: ids -> token strings -> the decoder chain -> concatenation. */
#include "tokenizer.h"

#include <stdlib.h>
#include <string.h>

#include <unictype.h>
#include <uninorm.h>
#include <unistr.h>

#include "tokenizer_internal.h"

/* ---- growable byte strings and lists of strings -------------------------- */

bool tok_sbuf_put(struct sbuf *b, const void *d, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p)
            return false;
        b->p = p;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, d, n);
    b->n += n;
    b->p[b->n] = 0;
    return true;
}

/* Pieces of text: piece i is buf.p[start[i] .. start[i+1]). at0[i] tells
 * whether the piece begins at offset 0 of the original input. */
struct slist {
    struct sbuf buf;
    size_t *start; /* (n + 1,) */
    bool *at0;     /* (n,) */
    size_t n, cap;
};

static bool slist_begin(struct slist *l, bool at0)
{
    if (l->n + 2 > l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        size_t *s = realloc(l->start, cap * sizeof(*s));
        if (!s)
            return false;
        l->start = s;
        bool *a = realloc(l->at0, cap * sizeof(*a));
        if (!a)
            return false;
        l->at0 = a;
        l->cap = cap;
    }
    l->start[l->n] = l->buf.n;
    l->at0[l->n] = at0;
    l->n++;
    l->start[l->n] = l->buf.n;
    return true;
}

/* Appends bytes to the last piece. */
static bool slist_put(struct slist *l, const void *d, size_t n)
{
    if (!tok_sbuf_put(&l->buf, d, n))
        return false;
    l->start[l->n] = l->buf.n;
    return true;
}

static bool slist_push(struct slist *l, const void *d, size_t n, bool at0)
{
    return slist_begin(l, at0) && slist_put(l, d, n);
}

static void slist_clear(struct slist *l)
{
    l->n = 0;
    l->buf.n = 0;
}

static void slist_free(struct slist *l)
{
    free(l->buf.p);
    free(l->start);
    free(l->at0);
    memset(l, 0, sizeof(*l));
}

static const char *piece(const struct slist *l, size_t i, size_t *n)
{
    *n = l->start[i + 1] - l->start[i];
    return l->buf.p + l->start[i];
}

/* Drops empty pieces, as `tokenizers` does after every split. */
static void slist_compact(struct slist *l)
{
    size_t k = 0;
    for (size_t i = 0; i < l->n; i++) {
        if (l->start[i + 1] == l->start[i])
            continue;
        /* pieces are contiguous in buf, so keep starts; only remove the empty ones */
        l->start[k] = l->start[i];
        l->at0[k] = l->at0[i];
        k++;
    }
    l->start[k] = l->buf.n;
    l->n = k;
}

/* ---- small Unicode helpers ----------------------------------------------- */

static size_t utf8_encode(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Decodes the (valid) UTF-8 character at s; returns its length. */
static size_t utf8_decode(const char *s, size_t n, uint32_t *cp)
{
    ucs4_t u;
    int k = u8_mbtouc(&u, (const uint8_t *)s, n);
    *cp = u;
    return k > 0 ? (size_t)k : 1;
}

/* Start of the character that ends at s[n). */
static size_t utf8_last_start(const char *s, size_t n)
{
    size_t i = n - 1;
    while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80)
        i--;
    return i;
}

/* Appends s[0..n) to b with invalid UTF-8 replaced by U+FFFD, one per maximal
 * invalid subpart, as Rust's String::from_utf8_lossy does. */
static bool put_lossy(struct sbuf *b, const unsigned char *s, size_t n)
{
    static const char fffd[] = "\xEF\xBF\xBD";
    size_t i = 0;
    while (i < n) {
        size_t ok = i;
        unsigned char c = s[i];
        size_t w = c < 0x80                   ? 1
                   : (c >= 0xC2 && c <= 0xDF) ? 2
                   : (c >= 0xE0 && c <= 0xEF) ? 3
                   : (c >= 0xF0 && c <= 0xF4) ? 4
                                              : 0;
        size_t j = i + 1;
        bool valid = w == 1;
        if (w >= 2 && j < n) {
            unsigned char d = s[j];
            unsigned char lo = 0x80, hi = 0xBF;
            if (c == 0xE0)
                lo = 0xA0;
            else if (c == 0xED)
                hi = 0x9F;
            else if (c == 0xF0)
                lo = 0x90;
            else if (c == 0xF4)
                hi = 0x8F;
            if (d >= lo && d <= hi) {
                j++;
                while (j < i + w && j < n && (s[j] & 0xC0) == 0x80)
                    j++;
                valid = j == i + w;
            }
        }
        if (valid) {
            if (!tok_sbuf_put(b, s + ok, w))
                return false;
            i += w;
        } else {
            if (!tok_sbuf_put(b, fffd, 3))
                return false;
            i = j;
        }
    }
    return true;
}

/* Rust's char::is_whitespace. */
static bool is_ws(uint32_t cp)
{
    return uc_is_property_white_space(cp);
}

/* Regex \w in Unicode mode (as the `regex` crate defines it). */
static bool is_word_char(uint32_t cp)
{
    return uc_is_property_alphabetic(cp) ||
           uc_is_general_category_withtable(cp, UC_CATEGORY_MASK_M | UC_CATEGORY_MASK_Nd |
                                                    UC_CATEGORY_MASK_Pc) ||
           uc_is_property_join_control(cp);
}

/* ---- normalizers ---------------------------------------------------------- */

static bool replace_all(struct sbuf *out, const char *s, size_t n, const char *a, size_t na,
                        const char *b, size_t nb)
{
    size_t i = 0, last = 0;
    while (i + na <= n) {
        if (memcmp(s + i, a, na) == 0) {
            if (!tok_sbuf_put(out, s + last, i - last) || !tok_sbuf_put(out, b, nb))
                return false;
            i += na;
            last = i;
        } else {
            i++;
        }
    }
    return tok_sbuf_put(out, s + last, n - last);
}

bool tok_normalize(const struct moe_tokenizer *tok, const char *s, size_t n, struct sbuf *out,
                   struct sbuf *tmp)
{
    out->n = 0;
    if (!tok_sbuf_put(out, s, n))
        return false;
    for (size_t k = 0; k < tok->n_norms; k++) {
        const struct norm *nm = &tok->norms[k];
        tmp->n = 0;
        if (out->n == 0)
            return true;
        switch (nm->kind) {
        case NORM_UNICODE: {
            size_t len = 0;
            uint8_t *r = u8_normalize(nm->form, (const uint8_t *)out->p, out->n, NULL, &len);
            if (!r)
                return false;
            bool ok = tok_sbuf_put(tmp, r, len);
            free(r);
            if (!ok)
                return false;
            break;
        }
        case NORM_PREPEND:
            if (!tok_sbuf_put(tmp, nm->a, nm->na) || !tok_sbuf_put(tmp, out->p, out->n))
                return false;
            break;
        case NORM_REPLACE:
            if (!replace_all(tmp, out->p, out->n, nm->a, nm->na, nm->b, nm->nb))
                return false;
            break;
        }
        struct sbuf t = *out;
        *out = *tmp;
        *tmp = t;
    }
    return true;
}

/* ---- pre-tokenizers ------------------------------------------------------- */

struct span {
    size_t start, end;
    int32_t id; /* -1: text */
};

struct spans {
    struct span *v;
    size_t n, cap;
    int rx_error; /* a PCRE2 match error met by split_regex, 0 if none */
};

static bool spans_push(struct spans *a, size_t s, size_t e, int32_t id)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 16;
        struct span *v = realloc(a->v, cap * sizeof(*v));
        if (!v)
            return false;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = (struct span){s, e, id};
    return true;
}

/* Regex split of every piece of `in` into `out` (empty pieces dropped).
 * `invert` (matches are the pieces, the gaps the delimiters) is only accepted
 * with ISOLATED (where it changes nothing) and REMOVED. */
static bool split_regex(const pcre2_code *re, enum split_behavior beh, bool invert,
                        const struct slist *in, struct slist *out, pcre2_match_data *md,
                        struct spans *m)
{
    for (size_t i = 0; i < in->n; i++) {
        size_t n;
        const char *s = piece(in, i, &n);
        bool at0 = in->at0[i];
        m->n = 0;
        for (size_t pos = 0; pos < n;) {
            int rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, md, NULL);
            if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) /* e.g. JIT stack: retry interpreted */
                rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md,
                                 NULL);
            if (rc == PCRE2_ERROR_NOMATCH)
                break;
            if (rc < 0) {
                m->rx_error = rc;
                return false;
            }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            if (ov[1] == ov[0]) { /* empty match: nothing to split, step one character */
                pos = ov[0] + tok_utf8_len((unsigned char)s[ov[0]]);
                continue;
            }
            if (!spans_push(m, ov[0], ov[1], 0))
                return false;
            pos = ov[1];
        }
        size_t last = 0;
        for (size_t k = 0; k < m->n; k++) {
            size_t ms = m->v[k].start, me = m->v[k].end;
            bool ok = true;
            switch (beh) {
            case SPLIT_ISOLATED:
                ok = slist_push(out, s + last, ms - last, at0 && last == 0) &&
                     slist_push(out, s + ms, me - ms, at0 && ms == 0);
                break;
            case SPLIT_REMOVED:
                ok = invert ? slist_push(out, s + ms, me - ms, at0 && ms == 0)
                            : slist_push(out, s + last, ms - last, at0 && last == 0);
                break;
            case SPLIT_MERGED_PREV:
                ok = slist_push(out, s + last, me - last, at0 && last == 0);
                break;
            case SPLIT_MERGED_NEXT:
                ok = slist_push(out, s + last, ms - last, at0 && last == 0);
                me = ms; /* the delimiter opens the next piece */
                break;
            }
            if (!ok)
                return false;
            last = me;
        }
        if (!(beh == SPLIT_REMOVED && invert) &&
            !slist_push(out, s + last, n - last, at0 && last == 0))
            return false;
    }
    slist_compact(out);
    return true;
}

static bool pre_byte_level(const struct moe_tokenizer *tok, const struct pre *p,
                           const struct slist *in, struct slist *out, struct slist *tmp,
                           pcre2_match_data *md, struct spans *m)
{
    const struct slist *src = in;
    if (p->add_prefix_space) {
        slist_clear(tmp);
        for (size_t i = 0; i < in->n; i++) {
            size_t n;
            const char *s = piece(in, i, &n);
            if (!slist_begin(tmp, in->at0[i]) || (n && s[0] != ' ' && !slist_put(tmp, " ", 1)) ||
                (!n && !slist_put(tmp, " ", 1)) || !slist_put(tmp, s, n))
                return false;
        }
        src = tmp;
    }
    struct slist split = {0};
    if (p->re) {
        if (!split_regex(p->re, SPLIT_ISOLATED, false, src, &split, md, m)) {
            slist_free(&split);
            return false;
        }
        src = &split;
    }
    bool ok = true;
    for (size_t i = 0; ok && i < src->n; i++) {
        size_t n;
        const unsigned char *s = (const unsigned char *)piece(src, i, &n);
        ok = slist_begin(out, src->at0[i]);
        for (size_t k = 0; ok && k < n; k++) {
            char u[4];
            size_t nu = utf8_encode(tok->uni_of_byte[s[k]], u);
            ok = slist_put(out, u, nu);
        }
    }
    slist_free(&split);
    return ok;
}

static bool pre_metaspace(const struct pre *p, const struct slist *in, struct slist *out,
                          struct sbuf *tmp)
{
    for (size_t i = 0; i < in->n; i++) {
        size_t n;
        const char *s = piece(in, i, &n);
        tmp->n = 0;
        if (!replace_all(tmp, s, n, " ", 1, p->repl, p->n_repl))
            return false;
        bool starts = tmp->n >= p->n_repl && memcmp(tmp->p, p->repl, p->n_repl) == 0;
        bool prepend =
            !starts && (p->scheme == PREPEND_ALWAYS || (p->scheme == PREPEND_FIRST && in->at0[i]));
        if (!p->split) {
            if (!slist_begin(out, in->at0[i]) || (prepend && !slist_put(out, p->repl, p->n_repl)) ||
                !slist_put(out, tmp->p, tmp->n))
                return false;
            continue;
        }
        /* Split before every replacement character (merged with next). */
        if (!slist_begin(out, in->at0[i]) || (prepend && !slist_put(out, p->repl, p->n_repl)))
            return false;
        size_t last = 0;
        for (size_t k = 0; k + p->n_repl <= tmp->n; k++) {
            if (k > 0 && memcmp(tmp->p + k, p->repl, p->n_repl) == 0) {
                if (!slist_put(out, tmp->p + last, k - last) || !slist_begin(out, false))
                    return false;
                last = k;
                k += p->n_repl - 1;
            }
        }
        if (!slist_put(out, tmp->p + last, tmp->n - last))
            return false;
    }
    slist_compact(out);
    return true;
}

/* Runs the pre-tokenizers over `a` (one piece in, words out); the result is
 * left in *a (the lists are swapped as needed). */
static bool pre_tokenize(const struct moe_tokenizer *tok, struct slist *a, struct slist *b,
                         struct slist *c, struct sbuf *tmp, pcre2_match_data *md, struct spans *m)
{
    for (size_t k = 0; k < tok->n_pres; k++) {
        const struct pre *p = &tok->pres[k];
        slist_clear(b);
        bool ok = false;
        switch (p->kind) {
        case PRE_SPLIT: ok = split_regex(p->re, p->behavior, p->invert, a, b, md, m); break;
        case PRE_BYTE_LEVEL: ok = pre_byte_level(tok, p, a, b, c, md, m); break;
        case PRE_METASPACE: ok = pre_metaspace(p, a, b, tmp); break;
        }
        if (!ok)
            return false;
        struct slist t = *a;
        *a = *b;
        *b = t;
    }
    return true;
}

/* ---- added tokens --------------------------------------------------------- */

/* Finds the next added token (of the given `normalized` class) in s[from..n):
 * leftmost, then longest. Returns the index in tok->added or -1. */
static int added_find(const struct moe_tokenizer *tok, const char *s, size_t n, size_t from,
                      bool normalized, size_t *at)
{
    const bool *first = tok->added_first[normalized];
    for (size_t i = from; i < n; i++) {
        if (!first[(unsigned char)s[i]])
            continue;
        int best = -1;
        size_t best_len = 0;
        for (size_t k = 0; k < tok->n_added; k++) {
            const struct added *t = &tok->added[k];
            if (t->normalized != normalized || t->n_match == 0 || t->n_match > n - i ||
                t->n_match <= best_len)
                continue;
            if (memcmp(s + i, t->match, t->n_match) == 0) {
                best = (int)k;
                best_len = t->n_match;
            }
        }
        if (best >= 0) {
            *at = i;
            return best;
        }
    }
    return -1;
}

/* Splits s[0..n) into text spans and added-token spans, as
 * AddedVocabulary::find_matches does (single_word, lstrip, rstrip). */
static bool added_split(const struct moe_tokenizer *tok, const char *s, size_t n, bool normalized,
                        struct spans *out)
{
    out->n = 0;
    size_t from = 0, done = 0, at = 0;
    int k;
    while ((k = added_find(tok, s, n, from, normalized, &at)) >= 0) {
        const struct added *t = &tok->added[k];
        size_t start = at, stop = at + t->n_match;
        from = stop;
        if (t->single_word) {
            uint32_t cp;
            bool start_ok = start == 0 || (utf8_decode(s + utf8_last_start(s, start), start, &cp),
                                           !is_word_char(cp));
            bool stop_ok = stop == n || (utf8_decode(s + stop, n - stop, &cp), !is_word_char(cp));
            if (!start_ok || !stop_ok)
                continue;
        }
        if (t->lstrip) {
            size_t ns = start;
            while (ns > 0) {
                size_t p = utf8_last_start(s, ns);
                uint32_t cp;
                utf8_decode(s + p, ns - p, &cp);
                if (!is_ws(cp))
                    break;
                ns = p;
            }
            start = ns > done ? ns : done;
        }
        if (t->rstrip) {
            while (stop < n) {
                uint32_t cp;
                size_t l = utf8_decode(s + stop, n - stop, &cp);
                if (!is_ws(cp))
                    break;
                stop += l;
            }
            from = stop;
        }
        if (done < start && !spans_push(out, done, start, -1))
            return false;
        if (!spans_push(out, start, stop, t->id))
            return false;
        done = stop;
    }
    if (done < n && !spans_push(out, done, n, -1))
        return false;
    return true;
}

/* ---- encode --------------------------------------------------------------- */

enum moe_status moe_tokenizer_encode(const struct moe_tokenizer *tok, const char *text, size_t len,
                                     bool add_special, int32_t **ids, size_t *n_ids,
                                     struct moe_error *err)
{
    return moe_tokenizer_encode_max(tok, text, len, add_special, SIZE_MAX, ids, n_ids, err);
}

enum moe_status moe_tokenizer_encode_max(const struct moe_tokenizer *tok, const char *text,
                                         size_t len, bool add_special, size_t max_ids,
                                         int32_t **ids, size_t *n_ids, struct moe_error *err)
{
    if (!tok || (!text && len) || !ids || !n_ids)
        return moe_error_set(err, MOE_ERR_INVALID, "tokenizer encode: NULL argument");
    /* The post-processor's own ids count against the limit too. */
    size_t n_fixed = 0;
    for (size_t k = 0; add_special && tok->has_tmpl && k < tok->n_tmpl; k++)
        n_fixed += tok->tmpl[k] >= 0;
    size_t limit = max_ids == SIZE_MAX ? SIZE_MAX : max_ids > n_fixed ? max_ids - n_fixed : 0;
    *ids = NULL;
    *n_ids = 0;
    if (len && u8_check((const uint8_t *)text, len))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "tokenizer encode: input is not valid UTF-8 (at byte %zu)",
                             (size_t)((const char *)u8_check((const uint8_t *)text, len) - text));
    enum moe_status st = MOE_OK;
    struct tok_ids out = {0};
    struct spans sp1 = {0}, sp2 = {0}, sp3 = {0};
    struct sbuf norm = {0}, tmp = {0};
    struct slist a = {0}, b = {0}, c = {0};
    struct tok_bpe_scratch scratch = {0};
    pcre2_match_data *md = pcre2_match_data_create(4, NULL);
    if (!md)
        goto nomem;
    if (!added_split(tok, text, len, false, &sp1))
        goto nomem;
    for (size_t i = 0; i < sp1.n; i++) {
        const struct span *s1 = &sp1.v[i];
        if (out.n > limit)
            goto too_long;
        if (s1->id >= 0) {
            if (!tok_ids_push(&out, s1->id))
                goto nomem;
            continue;
        }
        if (!tok_normalize(tok, text + s1->start, s1->end - s1->start, &norm, &tmp))
            goto nomem;
        if (!added_split(tok, norm.p, norm.n, true, &sp2))
            goto nomem;
        for (size_t j = 0; j < sp2.n; j++) {
            const struct span *s2 = &sp2.v[j];
            if (out.n > limit)
                goto too_long;
            if (s2->id >= 0) {
                if (!tok_ids_push(&out, s2->id))
                    goto nomem;
                continue;
            }
            slist_clear(&a);
            if (!slist_push(&a, norm.p + s2->start, s2->end - s2->start,
                            s1->start == 0 && s2->start == 0))
                goto nomem;
            if (!pre_tokenize(tok, &a, &b, &c, &tmp, md, &sp3)) {
                if (!sp3.rx_error)
                    goto nomem;
                PCRE2_UCHAR msg[160];
                pcre2_get_error_message(sp3.rx_error, msg, sizeof(msg));
                st = moe_error_set(err, MOE_ERR_INTERNAL,
                                   "tokenizer encode: pre-tokenizer regex failed on a piece of "
                                   "%zu bytes: %s",
                                   s2->end - s2->start, (const char *)msg);
                goto done;
            }
            for (size_t w = 0; w < a.n; w++) {
                size_t nw;
                const char *word = piece(&a, w, &nw);
                /* a word alone may be known too long: no BPE over it */
                if (limit != SIZE_MAX && tok->bpe.max_len && !tok->bpe.fuse_unk &&
                    nw / tok->bpe.max_len > limit - out.n)
                    goto too_long;
                if (!tok_bpe_encode_word(&tok->bpe, word, nw, &scratch, &out))
                    goto nomem;
                if (out.n > limit) /* known to be too long: the rest is not needed */
                    goto too_long;
            }
        }
    }
    if (out.n > limit)
        goto too_long;
    if (add_special && tok->has_tmpl) {
        struct tok_ids res = {0};
        for (size_t k = 0; k < tok->n_tmpl; k++) {
            if (tok->tmpl[k] >= 0) {
                if (!tok_ids_push(&res, tok->tmpl[k])) {
                    free(res.v);
                    goto nomem;
                }
                continue;
            }
            for (size_t q = 0; q < out.n; q++)
                if (!tok_ids_push(&res, out.v[q])) {
                    free(res.v);
                    goto nomem;
                }
        }
        free(out.v);
        out = res;
    }
    if (!out.v) { /* empty result: still a valid malloc'd array */
        out.v = malloc(sizeof(int32_t));
        if (!out.v)
            goto nomem;
    }
    *ids = out.v;
    *n_ids = out.n;
    out.v = NULL;
    goto done;
too_long:
    st = moe_error_set(err, MOE_ERR_INVALID, "more than %zu tokens", max_ids);
    goto done;
nomem:
    st = moe_error_set(err, MOE_ERR_NOMEM, "tokenizer encode: out of memory (%zu bytes of input)",
                       len);
done:
    free(out.v);
    free(sp1.v);
    free(sp2.v);
    free(sp3.v);
    free(norm.p);
    free(tmp.p);
    slist_free(&a);
    slist_free(&b);
    slist_free(&c);
    tok_bpe_scratch_release(&scratch);
    pcre2_match_data_free(md);
    return st;
}

/* ---- decode --------------------------------------------------------------- */

static bool dec_byte_level(const struct moe_tokenizer *tok, const struct slist *in,
                           struct slist *out, struct sbuf *raw)
{
    raw->n = 0;
    for (size_t i = 0; i < in->n; i++) {
        size_t n;
        const char *s = piece(in, i, &n);
        size_t mark = raw->n;
        bool all = true;
        for (size_t k = 0; k < n;) {
            uint32_t cp;
            k += utf8_decode(s + k, n - k, &cp);
            int b = cp < 512 ? tok->byte_of_uni[cp] : -1;
            if (b < 0) {
                all = false;
                break;
            }
            unsigned char ub = (unsigned char)b;
            if (!tok_sbuf_put(raw, &ub, 1))
                return false;
        }
        if (!all) { /* a token outside the byte alphabet passes as it is */
            raw->n = mark;
            if (!tok_sbuf_put(raw, s, n))
                return false;
        }
    }
    if (!slist_begin(out, false))
        return false;
    struct sbuf tmp = {0};
    bool ok =
        put_lossy(&tmp, (const unsigned char *)raw->p, raw->n) && slist_put(out, tmp.p, tmp.n);
    free(tmp.p);
    return ok;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static bool flush_bytes(struct slist *out, struct sbuf *bytes)
{
    if (!bytes->n)
        return true;
    bool ok = true;
    if (!u8_check((const uint8_t *)bytes->p, bytes->n)) {
        ok = slist_push(out, bytes->p, bytes->n, false);
    } else {
        for (size_t k = 0; ok && k < bytes->n; k++)
            ok = slist_push(out, "\xEF\xBF\xBD", 3, false);
    }
    bytes->n = 0;
    return ok;
}

static bool dec_step(const struct moe_tokenizer *tok, const struct dec *d, const struct slist *in,
                     struct slist *out, struct sbuf *tmp)
{
    switch (d->kind) {
    case DEC_BYTE_LEVEL: return dec_byte_level(tok, in, out, tmp);
    case DEC_FUSE: return slist_push(out, in->buf.p, in->buf.n, false);
    case DEC_REPLACE:
    case DEC_METASPACE:
        for (size_t i = 0; i < in->n; i++) {
            size_t n;
            const char *s = piece(in, i, &n);
            tmp->n = 0;
            bool ok;
            if (d->kind == DEC_REPLACE)
                ok = replace_all(tmp, s, n, d->a, d->na, d->b, d->nb);
            else if (i == 0 && d->scheme != PREPEND_NEVER)
                ok = replace_all(tmp, s, n, d->repl, d->n_repl, "", 0);
            else
                ok = replace_all(tmp, s, n, d->repl, d->n_repl, " ", 1);
            if (!ok || !slist_push(out, tmp->p, tmp->n, false))
                return false;
        }
        return true;
    case DEC_BYTE_FALLBACK:
        tmp->n = 0;
        for (size_t i = 0; i < in->n; i++) {
            size_t n;
            const char *s = piece(in, i, &n);
            if (n == 6 && memcmp(s, "<0x", 3) == 0 && s[5] == '>' && hexval(s[3]) >= 0 &&
                hexval(s[4]) >= 0) {
                unsigned char byte = (unsigned char)(hexval(s[3]) * 16 + hexval(s[4]));
                if (!tok_sbuf_put(tmp, &byte, 1))
                    return false;
                continue;
            }
            if (!flush_bytes(out, tmp) || !slist_push(out, s, n, false))
                return false;
        }
        return flush_bytes(out, tmp);
    case DEC_STRIP:
        for (size_t i = 0; i < in->n; i++) {
            size_t n;
            const char *s = piece(in, i, &n);
            size_t b = 0, e = n;
            for (int k = 0; k < d->start && e - b >= d->na && memcmp(s + b, d->a, d->na) == 0; k++)
                b += d->na;
            for (int k = 0;
                 k < d->stop && e - b >= d->na && memcmp(s + e - d->na, d->a, d->na) == 0; k++)
                e -= d->na;
            if (!slist_push(out, s + b, e - b, false))
                return false;
        }
        return true;
    }
    return false;
}

enum moe_status moe_tokenizer_decode(const struct moe_tokenizer *tok, const int32_t *ids, size_t n,
                                     bool skip_special, char **text, size_t *len,
                                     struct moe_error *err)
{
    if (!tok || (!ids && n) || !text || !len)
        return moe_error_set(err, MOE_ERR_INVALID, "tokenizer decode: NULL argument");
    *text = NULL;
    *len = 0;
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= tok->n_vocab || !tok->id_str[ids[i]])
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "tokenizer decode: ids[%zu] = %d is not in the vocabulary "
                                 "(n_vocab %d)",
                                 i, ids[i], tok->n_vocab);
    struct slist a = {0}, b = {0};
    struct sbuf tmp = {0}, res = {0};
    for (size_t i = 0; i < n; i++) {
        if (skip_special && tok->id_special[ids[i]])
            continue;
        if (!slist_push(&a, tok->id_str[ids[i]], tok->id_len[ids[i]], false))
            goto nomem;
    }
    if (!tok->has_decoder) {
        for (size_t i = 0; i < a.n; i++) {
            size_t m;
            const char *s = piece(&a, i, &m);
            if ((i && !tok_sbuf_put(&res, " ", 1)) || !tok_sbuf_put(&res, s, m))
                goto nomem;
        }
    } else {
        for (size_t k = 0; k < tok->n_decs; k++) {
            slist_clear(&b);
            if (!dec_step(tok, &tok->decs[k], &a, &b, &tmp))
                goto nomem;
            struct slist t = a;
            a = b;
            b = t;
        }
        if (!tok_sbuf_put(&res, a.buf.p ? a.buf.p : "", a.buf.n))
            goto nomem;
    }
    if (!res.p && !tok_sbuf_put(&res, "", 0))
        goto nomem;
    slist_free(&a);
    slist_free(&b);
    free(tmp.p);
    *text = res.p;
    *len = res.n;
    return MOE_OK;
nomem:
    slist_free(&a);
    slist_free(&b);
    free(tmp.p);
    free(res.p);
    return moe_error_set(err, MOE_ERR_NOMEM, "tokenizer decode: out of memory");
}

/* ---- small queries -------------------------------------------------------- */

int moe_tokenizer_n_vocab(const struct moe_tokenizer *tok)
{
    return tok ? tok->n_vocab : 0;
}

int32_t moe_tokenizer_token_to_id(const struct moe_tokenizer *tok, const char *token)
{
    if (!tok || !token)
        return -1;
    size_t n = strlen(token);
    for (size_t k = 0; k < tok->n_added; k++)
        if ((tok->added[k].len == n && memcmp(tok->added[k].content, token, n) == 0) ||
            (tok->added[k].n_match == n && memcmp(tok->added[k].match, token, n) == 0))
            return tok->added[k].id;
    return tok_bpe_lookup(&tok->bpe, token, n);
}
