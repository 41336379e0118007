/* Python methods templates call on values: str (startswith, strip, split,
 * replace, upper, title, ...), dict (get, items, keys, values) and the
 * loop object's cycle(). Unicode case mapping and whitespace follow
 * CPython (full case mappings via libunistring, str.isspace()). */
#define _GNU_SOURCE /* memmem */
#include <stdlib.h>
#include <string.h>

#include <unicase.h>
#include <unictype.h>

#include "jinja_internal.h"

enum jmeth {
    M_STARTSWITH,
    M_ENDSWITH,
    M_STRIP,
    M_LSTRIP,
    M_RSTRIP,
    M_SPLIT,
    M_RSPLIT,
    M_REPLACE,
    M_UPPER,
    M_LOWER,
    M_TITLE,
    M_CAPITALIZE,
    M_FIND,
    M_RFIND,
    M_COUNT,
    M_JOIN,
    M_REMOVEPREFIX,
    M_REMOVESUFFIX,
    M_STR_END, /* above: str methods */
    M_GET = M_STR_END,
    M_ITEMS,
    M_KEYS,
    M_VALUES,
    M_DICT_END,
    M_CYCLE = M_DICT_END,
    M_N,
};

static const char *const meth_names[M_N] = {
    "startswith",   "endswith",     "strip", "lstrip",     "rstrip", "split",  "rsplit", "replace",
    "upper",        "lower",        "title", "capitalize", "find",   "rfind",  "count",  "join",
    "removeprefix", "removesuffix", "get",   "items",      "keys",   "values", "cycle",
};

/* Attributes Python has that are not supported: calling one is an error
 * (and jinja2's ImmutableSandboxedEnvironment refuses the mutating ones). */
static const char *const py_str_attrs[] = {
    "casefold",     "center",     "encode",    "expandtabs",  "format",    "format_map",
    "index",        "isalnum",    "isalpha",   "isascii",     "isdecimal", "isdigit",
    "isidentifier", "islower",    "isnumeric", "isprintable", "isspace",   "istitle",
    "isupper",      "ljust",      "maketrans", "partition",   "rindex",    "rjust",
    "rpartition",   "splitlines", "swapcase",  "translate",   "zfill",     NULL};
static const char *const py_dict_attrs[] = {"clear",   "copy",       "fromkeys", "pop",
                                            "popitem", "setdefault", "update",   NULL};
static const char *const py_list_attrs[] = {"append", "clear",   "copy",   "count",
                                            "extend", "index",   "insert", "pop",
                                            "remove", "reverse", "sort",   NULL};
static const char *const py_tuple_attrs[] = {"count", "index", NULL};

static bool in_list(const char *const *l, const char *name)
{
    for (int i = 0; l[i]; i++)
        if (!strcmp(l[i], name))
            return true;
    return false;
}

int jinja_method_lookup(const char *name)
{
    for (int i = 0; i < M_N; i++)
        if (!strcmp(meth_names[i], name))
            return i;
    return -1;
}

int jinja_method_of(struct jv v, const char *name)
{
    int id = jinja_method_lookup(name);
    switch (v.t) {
    case JV_STR:
        if (id >= 0 && id < M_STR_END)
            return id;
        return in_list(py_str_attrs, name) ? -2 : -1;
    case JV_DICT:
        if (id >= M_STR_END && id < M_DICT_END)
            return id;
        return in_list(py_dict_attrs, name) ? -2 : -1;
    case JV_LIST:
        if (v.u.l->kind == JL_LIST)
            return in_list(py_list_attrs, name) ? -2 : -1;
        if (v.u.l->kind == JL_TUPLE)
            return in_list(py_tuple_attrs, name) ? -2 : -1;
        return -1;
    case JV_LOOP:
        if (id == M_CYCLE)
            return id;
        return !strcmp(name, "changed") ? -2 : -1;
    default: return -1;
    }
}

/* ---- case mapping ---------------------------------------------------------------- */

static bool ascii_only(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80)
            return false;
    return true;
}

enum jcase { CASE_UPPER, CASE_LOWER, CASE_TITLE };

/* Full Unicode case mapping of s[0..n) into b. */
static void add_case(struct jsb *b, const char *s, size_t n, enum jcase which)
{
    if (n == 0)
        return;
    if (ascii_only(s, n)) {
        for (size_t i = 0; i < n; i++) {
            char ch = s[i];
            if (which == CASE_LOWER && ch >= 'A' && ch <= 'Z')
                ch = (char)(ch - 'A' + 'a');
            else if (which != CASE_LOWER && ch >= 'a' && ch <= 'z')
                ch = (char)(ch - 'a' + 'A');
            jsb_addc(b, ch);
        }
        return;
    }
    size_t len = 0;
    uint8_t *r;
    if (which == CASE_UPPER)
        r = u8_toupper((const uint8_t *)s, n, NULL, NULL, NULL, &len);
    else if (which == CASE_LOWER)
        r = u8_tolower((const uint8_t *)s, n, NULL, NULL, NULL, &len);
    else
        r = u8_totitle((const uint8_t *)s, n, NULL, NULL, NULL, &len);
    if (!r)
        jerr(b->c, 0, MOE_ERR_NOMEM, "out of memory in case mapping");
    /* copy before jsb_add can unwind, so r is never leaked */
    char stackbuf[256];
    char *tmp = len <= sizeof(stackbuf) ? stackbuf : NULL;
    if (!tmp) {
        tmp = jarena_alloc(&b->c->arena, len);
        if (!tmp) {
            free(r);
            jerr(b->c, 0, MOE_ERR_NOMEM, "render used more than its memory limit");
        }
    }
    memcpy(tmp, r, len);
    free(r);
    jsb_add(b, tmp, len);
}

const struct jstr *jstr_case(struct jctx *c, const struct jstr *s, int which)
{
    struct jsb b;
    jsb_init(&b, c);
    add_case(&b, s->s, s->len, (enum jcase)which);
    return jsb_str(&b);
}

/* str.title(): titlecase after an uncased character, lowercase after a cased one. */
static const struct jstr *py_title(struct jctx *c, const struct jstr *s)
{
    struct jsb b;
    jsb_init(&b, c);
    bool prev_cased = false;
    size_t i = 0;
    while (i < s->len) {
        size_t adv;
        uint32_t cp = ju8_dec(s->s + i, s->len - i, &adv);
        add_case(&b, s->s + i, adv, prev_cased ? CASE_LOWER : CASE_TITLE);
        prev_cased = uc_is_property_cased(cp);
        i += adv;
    }
    return jsb_str(&b);
}

/* str.capitalize(): first character titlecased, the rest lowercased. */
const struct jstr *jstr_capitalize(struct jctx *c, const struct jstr *s)
{
    struct jsb b;
    jsb_init(&b, c);
    if (s->len) {
        size_t adv;
        ju8_dec(s->s, s->len, &adv);
        add_case(&b, s->s, adv, CASE_TITLE);
        add_case(&b, s->s + adv, s->len - adv, CASE_LOWER);
    }
    return jsb_str(&b);
}

/* jinja2's title filter: words split at runs of whitespace, '-', '(', '{',
 * '[', '<'; each word's first character upper-cased, the rest lower-cased. */
const struct jstr *jstr_title_filter(struct jctx *c, const struct jstr *s)
{
    struct jsb b;
    jsb_init(&b, c);
    size_t i = 0;
    while (i < s->len) {
        size_t j = i;
        bool sep = false;
        for (;;) { /* the run at i: separators or a word */
            if (j >= s->len)
                break;
            size_t adv;
            uint32_t cp = ju8_dec(s->s + j, s->len - j, &adv);
            bool is_sep =
                jpy_isspace(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<';
            if (j == i)
                sep = is_sep;
            else if (is_sep != sep)
                break;
            j += adv;
        }
        if (sep) {
            jsb_add(&b, s->s + i, j - i);
        } else {
            size_t adv;
            ju8_dec(s->s + i, j - i, &adv);
            add_case(&b, s->s + i, adv, CASE_UPPER);
            add_case(&b, s->s + i + adv, j - i - adv, CASE_LOWER);
        }
        i = j;
    }
    return jsb_str(&b);
}

/* ---- strip / split / replace / find ------------------------------------------------ */

static bool cp_in(uint32_t cp, const struct jstr *chars)
{
    size_t i = 0;
    while (i < chars->len) {
        size_t adv;
        if (ju8_dec(chars->s + i, chars->len - i, &adv) == cp)
            return true;
        i += adv;
    }
    return false;
}

/* mode: 1 left, 2 right, 3 both; chars NULL: whitespace. */
const struct jstr *jstr_strip(struct jctx *c, const struct jstr *s, const struct jstr *chars,
                              int mode)
{
    size_t start = 0, end = s->len;
    if (mode & 1) {
        while (start < end) {
            size_t adv;
            uint32_t cp = ju8_dec(s->s + start, end - start, &adv);
            if (chars ? !cp_in(cp, chars) : !jpy_isspace(cp))
                break;
            start += adv;
        }
    }
    if (mode & 2) {
        while (end > start) {
            size_t p = end - 1;
            while (p > start && ((unsigned char)s->s[p] & 0xc0) == 0x80)
                p--;
            size_t adv;
            uint32_t cp = ju8_dec(s->s + p, end - p, &adv);
            if (chars ? !cp_in(cp, chars) : !jpy_isspace(cp))
                break;
            end = p;
        }
    }
    if (start == 0 && end == s->len)
        return s;
    return jstr_new(c, s->s + start, end - start);
}

static struct jv list_value(struct jlist *l)
{
    struct jv v = {.t = JV_LIST};
    v.u.l = l;
    return v;
}

static void reverse_list(struct jlist *l)
{
    for (size_t i = 0; i < l->n / 2; i++) {
        struct jv t = l->v[i];
        l->v[i] = l->v[l->n - 1 - i];
        l->v[l->n - 1 - i] = t;
    }
}

static const char *rmemmem(const char *h, size_t hn, const char *n, size_t nn)
{
    if (nn > hn)
        return NULL;
    for (size_t i = hn - nn + 1; i-- > 0;)
        if (memcmp(h + i, n, nn) == 0)
            return h + i;
    return NULL;
}

static struct jv do_split(struct jctx *c, int line, const struct jstr *s, const struct jstr *sep,
                          int64_t maxsplit, bool right)
{
    struct jlist *l = jlist_new(c, JL_LIST, 0);
    if (sep && sep->len == 0)
        jerr(c, line, MOE_ERR_INVALID, "split: empty separator");
    if (sep) {
        if (!right) {
            size_t pos = 0;
            while (maxsplit != 0) {
                const char *f = memmem(s->s + pos, s->len - pos, sep->s, sep->len);
                if (!f)
                    break;
                jlist_push(c, l, jv_str(c, s->s + pos, (size_t)(f - s->s) - pos));
                pos = (size_t)(f - s->s) + sep->len;
                if (maxsplit > 0)
                    maxsplit--;
            }
            jlist_push(c, l, jv_str(c, s->s + pos, s->len - pos));
        } else {
            size_t end = s->len;
            while (maxsplit != 0) {
                const char *f = rmemmem(s->s, end, sep->s, sep->len);
                if (!f)
                    break;
                size_t at = (size_t)(f - s->s);
                jlist_push(c, l, jv_str(c, f + sep->len, end - at - sep->len));
                end = at;
                if (maxsplit > 0)
                    maxsplit--;
            }
            jlist_push(c, l, jv_str(c, s->s, end));
            reverse_list(l);
        }
        return list_value(l);
    }
    /* whitespace split: runs of whitespace, no empty strings */
    size_t n = s->len;
    if (!right) {
        size_t i = 0;
        while (i < n) {
            size_t adv;
            while (i < n && jpy_isspace(ju8_dec(s->s + i, n - i, &adv)))
                i += adv;
            if (i >= n)
                break;
            if (maxsplit == 0) {
                jlist_push(c, l, jv_str(c, s->s + i, n - i)); /* trailing space kept */
                break;
            }
            size_t j = i;
            while (j < n && !jpy_isspace(ju8_dec(s->s + j, n - j, &adv)))
                j += adv;
            jlist_push(c, l, jv_str(c, s->s + i, j - i));
            if (maxsplit > 0)
                maxsplit--;
            i = j;
        }
        return list_value(l);
    }
    /* rsplit(): from the right, over code points */
    size_t end = n;
    for (;;) {
        while (end > 0) {
            size_t p = end - 1, adv;
            while (p > 0 && ((unsigned char)s->s[p] & 0xc0) == 0x80)
                p--;
            if (!jpy_isspace(ju8_dec(s->s + p, end - p, &adv)))
                break;
            end = p;
        }
        if (end == 0)
            break;
        if (maxsplit == 0) {
            jlist_push(c, l, jv_str(c, s->s, end)); /* leading space kept */
            break;
        }
        size_t start = end;
        while (start > 0) {
            size_t p = start - 1, adv;
            while (p > 0 && ((unsigned char)s->s[p] & 0xc0) == 0x80)
                p--;
            if (jpy_isspace(ju8_dec(s->s + p, start - p, &adv)))
                break;
            start = p;
        }
        jlist_push(c, l, jv_str(c, s->s + start, end - start));
        if (maxsplit > 0)
            maxsplit--;
        end = start;
    }
    reverse_list(l);
    return list_value(l);
}

const struct jstr *jstr_replace(struct jctx *c, const struct jstr *s, const struct jstr *old,
                                const struct jstr *new_, int64_t count)
{
    struct jsb b;
    jsb_init(&b, c);
    if (old->len == 0) { /* inserts between every character, and at both ends */
        size_t i = 0;
        int64_t done = 0;
        for (;;) {
            if (count < 0 || done < count) {
                jsb_add(&b, new_->s, new_->len);
                done++;
            }
            if (i >= s->len)
                break;
            size_t adv;
            ju8_dec(s->s + i, s->len - i, &adv);
            jsb_add(&b, s->s + i, adv);
            i += adv;
        }
        return jsb_str(&b);
    }
    size_t pos = 0;
    int64_t done = 0;
    while (count < 0 || done < count) {
        const char *f = memmem(s->s + pos, s->len - pos, old->s, old->len);
        if (!f)
            break;
        jsb_add(&b, s->s + pos, (size_t)(f - s->s) - pos);
        jsb_add(&b, new_->s, new_->len);
        pos = (size_t)(f - s->s) + old->len;
        done++;
    }
    jsb_add(&b, s->s + pos, s->len - pos);
    return jsb_str(&b);
}

/* ---- dispatch ----------------------------------------------------------------------- */

static const struct jstr *want_str(struct jctx *c, int line, const char *what, struct jv v)
{
    if (v.t != JV_STR)
        jerr(c, line, MOE_ERR_INVALID, "%s: expected a string argument, got %s", what,
             jv_type_name(v));
    return v.u.s;
}

static bool affix_match(const struct jstr *s, const struct jstr *a, bool end)
{
    if (a->len > s->len)
        return false;
    return memcmp(end ? s->s + s->len - a->len : s->s, a->s, a->len) == 0;
}

static int64_t int_arg(struct jctx *c, int line, const char *what, struct jv v, int64_t dflt)
{
    if (v.t == JV_UNDEF || v.t == JV_NONE)
        return dflt;
    if (v.t == JV_INT)
        return v.u.i;
    if (v.t == JV_BOOL)
        return v.u.b;
    jerr(c, line, MOE_ERR_INVALID, "%s: expected an integer argument, got %s", what,
         jv_type_name(v));
}

static struct jv str_method(struct jctx *c, int line, int id, const struct jstr *s,
                            const struct jargs *a)
{
    const char *name = meth_names[id];
    struct jv p[3];
    switch (id) {
    case M_STARTSWITH:
    case M_ENDSWITH: {
        static const char *const params[] = {"prefix"};
        if (a->n_pos > 1)
            jerr(c, line, MOE_ERR_UNSUPPORTED, "%s: start/end arguments are not supported", name);
        jargs_bind(c, line, name, a, params, 1, p);
        bool end = id == M_ENDSWITH;
        if (p[0].t == JV_LIST && p[0].u.l->kind == JL_TUPLE) {
            for (size_t i = 0; i < p[0].u.l->n; i++)
                if (affix_match(s, want_str(c, line, name, p[0].u.l->v[i]), end))
                    return jv_bool(true);
            return jv_bool(false);
        }
        return jv_bool(affix_match(s, want_str(c, line, name, p[0]), end));
    }
    case M_STRIP:
    case M_LSTRIP:
    case M_RSTRIP: {
        static const char *const params[] = {"chars"};
        jargs_bind(c, line, name, a, params, 1, p);
        const struct jstr *chars = NULL;
        if (p[0].t != JV_UNDEF && p[0].t != JV_NONE)
            chars = want_str(c, line, name, p[0]);
        int mode = id == M_STRIP ? 3 : id == M_LSTRIP ? 1 : 2;
        return jv_strv(jstr_strip(c, s, chars, mode));
    }
    case M_SPLIT:
    case M_RSPLIT: {
        static const char *const params[] = {"sep", "maxsplit"};
        jargs_bind(c, line, name, a, params, 2, p);
        const struct jstr *sep = NULL;
        if (p[0].t != JV_UNDEF && p[0].t != JV_NONE)
            sep = want_str(c, line, name, p[0]);
        return do_split(c, line, s, sep, int_arg(c, line, name, p[1], -1), id == M_RSPLIT);
    }
    case M_REPLACE: {
        static const char *const params[] = {"old", "new", "count"};
        jargs_bind(c, line, name, a, params, 3, p);
        return jv_strv(jstr_replace(c, s, want_str(c, line, name, p[0]),
                                    want_str(c, line, name, p[1]),
                                    int_arg(c, line, name, p[2], -1)));
    }
    case M_UPPER:
    case M_LOWER:
    case M_TITLE:
    case M_CAPITALIZE:
        jargs_bind(c, line, name, a, NULL, 0, p);
        if (id == M_TITLE)
            return jv_strv(py_title(c, s));
        if (id == M_CAPITALIZE)
            return jv_strv(jstr_capitalize(c, s));
        return jv_strv(jstr_case(c, s, id == M_UPPER ? CASE_UPPER : CASE_LOWER));
    case M_FIND:
    case M_RFIND: {
        static const char *const params[] = {"sub"};
        if (a->n_pos > 1)
            jerr(c, line, MOE_ERR_UNSUPPORTED, "%s: start/end arguments are not supported", name);
        jargs_bind(c, line, name, a, params, 1, p);
        const struct jstr *sub = want_str(c, line, name, p[0]);
        const char *f = id == M_FIND ? memmem(s->s, s->len, sub->s, sub->len)
                                     : rmemmem(s->s, s->len, sub->s, sub->len);
        if (sub->len == 0)
            f = id == M_FIND ? s->s : s->s + s->len;
        return jv_int(f ? (int64_t)ju8_len(s->s, (size_t)(f - s->s)) : -1);
    }
    case M_COUNT: {
        static const char *const params[] = {"sub"};
        if (a->n_pos > 1)
            jerr(c, line, MOE_ERR_UNSUPPORTED, "count: start/end arguments are not supported");
        jargs_bind(c, line, name, a, params, 1, p);
        const struct jstr *sub = want_str(c, line, name, p[0]);
        if (sub->len == 0)
            return jv_int((int64_t)ju8_len(s->s, s->len) + 1);
        int64_t k = 0;
        size_t pos = 0;
        const char *f;
        while ((f = memmem(s->s + pos, s->len - pos, sub->s, sub->len))) {
            k++;
            pos = (size_t)(f - s->s) + sub->len;
        }
        return jv_int(k);
    }
    case M_JOIN: {
        static const char *const params[] = {"iterable"};
        jargs_bind(c, line, name, a, params, 1, p);
        struct jlist *items = jinja_iter(c, line, p[0]);
        struct jsb b;
        jsb_init(&b, c);
        for (size_t i = 0; i < items->n; i++) {
            if (items->v[i].t != JV_STR)
                jerr(c, line, MOE_ERR_INVALID,
                     "join: sequence item %zu: expected str instance, %s found", i,
                     jv_type_name(items->v[i]));
            if (i)
                jsb_add(&b, s->s, s->len);
            jsb_add(&b, items->v[i].u.s->s, items->v[i].u.s->len);
        }
        return jv_strv(jsb_str(&b));
    }
    case M_REMOVEPREFIX:
    case M_REMOVESUFFIX: {
        static const char *const params[] = {"affix"};
        jargs_bind(c, line, name, a, params, 1, p);
        const struct jstr *x = want_str(c, line, name, p[0]);
        bool end = id == M_REMOVESUFFIX;
        if (!x->len || !affix_match(s, x, end))
            return jv_strv(s);
        return jv_str(c, end ? s->s : s->s + x->len, s->len - x->len);
    }
    default: break;
    }
    jerr(c, line, MOE_ERR_INTERNAL, "bad str method %d", id);
}

static struct jv view(struct jctx *c, const struct jdict *d, int kind)
{
    struct jlist *l = jlist_new(c, kind, d->n);
    for (size_t i = 0; i < d->n; i++) {
        if (kind == JL_KEYS) {
            jlist_push(c, l, d->e[i].key);
        } else if (kind == JL_VALUES) {
            jlist_push(c, l, d->e[i].val);
        } else {
            struct jlist *pair = jlist_new(c, JL_TUPLE, 2);
            jlist_push(c, pair, d->e[i].key);
            jlist_push(c, pair, d->e[i].val);
            jlist_push(c, l, list_value(pair));
        }
    }
    return list_value(l);
}

struct jv jinja_dict_items(struct jctx *c, const struct jdict *d, int kind)
{
    return view(c, d, kind);
}

struct jv jinja_method(struct jctx *c, int line, struct jmethod *m, const struct jargs *a)
{
    if (m->id == -2)
        jerr(c, line, MOE_ERR_UNSUPPORTED, "method '%s' of %s is not supported", m->name,
             jv_type_name(m->self));
    if (m->id < M_STR_END)
        return str_method(c, line, m->id, m->self.u.s, a);
    struct jv p[2];
    switch (m->id) {
    case M_GET: {
        static const char *const params[] = {"key", "default"};
        if (a->n_kw)
            jerr(c, line, MOE_ERR_INVALID, "get() takes no keyword arguments");
        unsigned given = jargs_bind(c, line, "get", a, params, 2, p);
        if (!(given & 1))
            jerr(c, line, MOE_ERR_INVALID, "get expected at least 1 argument, got 0");
        struct jv *v = NULL;
        if (p[0].t == JV_STR || p[0].t == JV_INT || p[0].t == JV_BOOL || p[0].t == JV_NONE ||
            p[0].t == JV_FLOAT || (p[0].t == JV_LIST && p[0].u.l->kind == JL_TUPLE))
            v = jdict_get(m->self.u.d, p[0]);
        else
            jerr(c, line, MOE_ERR_INVALID, "unhashable type: '%s'", jv_type_name(p[0]));
        if (v)
            return *v;
        return (given & 2) ? p[1] : jv_none();
    }
    case M_ITEMS:
    case M_KEYS:
    case M_VALUES:
        jargs_bind(c, line, meth_names[m->id], a, NULL, 0, p);
        return view(c, m->self.u.d,
                    m->id == M_ITEMS  ? JL_ITEMS
                    : m->id == M_KEYS ? JL_KEYS
                                      : JL_VALUES);
    case M_CYCLE:
        if (a->n_kw)
            jerr(c, line, MOE_ERR_INVALID, "loop.cycle takes no keyword arguments");
        if (a->n_pos == 0)
            jerr(c, line, MOE_ERR_INVALID, "no items for cycling given");
        return a->pos[m->self.u.loop->index0 % (size_t)a->n_pos];
    default: break;
    }
    jerr(c, line, MOE_ERR_INTERNAL, "bad method %d", m->id);
}
