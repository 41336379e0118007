/* Values of the chat-template interpreter and Python's semantics for them:
 * str(), repr(), ==, ordering, truth, json.dumps and float printing, as
 * CPython 3 does them (jinja2 evaluates templates with Python objects). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unictype.h>

#include "jinja_internal.h"

/* ---- arena ---------------------------------------------------------------- */

struct jchunk {
    struct jchunk *next;
    size_t cap, used;
    _Alignas(16) unsigned char mem[];
};

#define JCHUNK_MIN (64u << 10)

void *jarena_alloc(struct jarena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (n == 0)
        n = 16;
    struct jchunk *h = a->head;
    if (!h || h->cap - h->used < n) {
        size_t cap = n > JCHUNK_MIN ? n : JCHUNK_MIN;
        if (a->limit && a->used + cap + sizeof(*h) > a->limit)
            return NULL;
        h = malloc(sizeof(*h) + cap);
        if (!h)
            return NULL;
        h->cap = cap;
        h->used = 0;
        h->next = a->head;
        a->head = h;
        a->used += cap + sizeof(*h);
    }
    void *p = h->mem + h->used;
    h->used += n;
    memset(p, 0, n);
    return p;
}

void jarena_free(struct jarena *a)
{
    struct jchunk *h = a->head;
    while (h) {
        struct jchunk *next = h->next;
        free(h);
        h = next;
    }
    a->head = NULL;
    a->used = 0;
}

/* ---- errors and limits ----------------------------------------------------- */

void jerr(struct jctx *c, int line, enum moe_status code, const char *fmt, ...)
{
    char msg[MOE_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    moe_error_set(c->err, code, "%s:%d: %s", c->tname, line, msg);
    c->code = code;
    longjmp(c->jmp, 1);
}

void *jalloc(struct jctx *c, size_t n)
{
    void *p = jarena_alloc(&c->arena, n);
    if (!p)
        jerr(c, 0, MOE_ERR_NOMEM, "render used more than %u MiB of memory (the limit)",
             (unsigned)(CHAT_TEMPLATE_MAX_MEMORY >> 20));
    return p;
}

void jstep(struct jctx *c, int line, int64_t n)
{
    c->steps += n;
    if (c->steps > CHAT_TEMPLATE_MAX_STEPS)
        jerr(c, line, MOE_ERR_INVALID,
             "template ran more than %d loop iterations and macro calls (the limit)",
             CHAT_TEMPLATE_MAX_STEPS);
}

/* ---- constructors ---------------------------------------------------------- */

struct jv jv_undef(const char *name)
{
    struct jv v = {.t = JV_UNDEF};
    v.u.uname = name;
    return v;
}

struct jv jv_none(void)
{
    return (struct jv){.t = JV_NONE};
}

struct jv jv_bool(bool b)
{
    struct jv v = {.t = JV_BOOL};
    v.u.b = b;
    return v;
}

struct jv jv_int(int64_t i)
{
    struct jv v = {.t = JV_INT};
    v.u.i = i;
    return v;
}

struct jv jv_float(double f)
{
    struct jv v = {.t = JV_FLOAT};
    v.u.f = f;
    return v;
}

struct jv jv_strv(const struct jstr *s)
{
    struct jv v = {.t = JV_STR};
    v.u.s = s;
    return v;
}

const struct jstr *jstr_new(struct jctx *c, const char *p, size_t n)
{
    if (n > CHAT_TEMPLATE_MAX_OUTPUT)
        jerr(c, 0, MOE_ERR_INVALID, "a string of %zu bytes exceeds the %u MiB output limit", n,
             (unsigned)(CHAT_TEMPLATE_MAX_OUTPUT >> 20));
    struct jstr *s = jalloc(c, sizeof(*s) + n + 1);
    s->len = n;
    if (n)
        memcpy(s->s, p, n);
    s->s[n] = 0;
    return s;
}

const struct jstr *jstr_cat(struct jctx *c, const char *a, size_t na, const char *b, size_t nb)
{
    if (na + nb > CHAT_TEMPLATE_MAX_OUTPUT)
        jerr(c, 0, MOE_ERR_INVALID, "a string of %zu bytes exceeds the %u MiB output limit",
             na + nb, (unsigned)(CHAT_TEMPLATE_MAX_OUTPUT >> 20));
    struct jstr *s = jalloc(c, sizeof(*s) + na + nb + 1);
    s->len = na + nb;
    if (na)
        memcpy(s->s, a, na);
    if (nb)
        memcpy(s->s + na, b, nb);
    s->s[na + nb] = 0;
    return s;
}

struct jv jv_str(struct jctx *c, const char *p, size_t n)
{
    return jv_strv(jstr_new(c, p, n));
}

struct jv jv_cstr(struct jctx *c, const char *p)
{
    return jv_str(c, p, strlen(p));
}

struct jlist *jlist_new(struct jctx *c, int kind, size_t cap)
{
    struct jlist *l = jalloc(c, sizeof(*l));
    l->kind = kind;
    if (cap) {
        l->v = jalloc(c, cap * sizeof(*l->v));
        l->cap = cap;
    }
    return l;
}

void jlist_push(struct jctx *c, struct jlist *l, struct jv v)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 4;
        struct jv *nv = jalloc(c, cap * sizeof(*nv));
        if (l->n)
            memcpy(nv, l->v, l->n * sizeof(*nv));
        l->v = nv;
        l->cap = cap;
    }
    l->v[l->n++] = v;
}

struct jdict *jdict_new(struct jctx *c, size_t cap)
{
    struct jdict *d = jalloc(c, sizeof(*d));
    if (cap) {
        d->e = jalloc(c, cap * sizeof(*d->e));
        d->cap = cap;
    }
    return d;
}

void jdict_set(struct jctx *c, struct jdict *d, struct jv key, struct jv val)
{
    struct jv *old = jdict_get(d, key);
    if (old) {
        *old = val;
        return;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 4;
        struct jdict_ent *ne = jalloc(c, cap * sizeof(*ne));
        if (d->n)
            memcpy(ne, d->e, d->n * sizeof(*ne));
        d->e = ne;
        d->cap = cap;
    }
    d->e[d->n].key = key;
    d->e[d->n].val = val;
    d->n++;
}

struct jv *jdict_get(const struct jdict *d, struct jv key)
{
    for (size_t i = 0; i < d->n; i++)
        if (jv_eq(d->e[i].key, key))
            return &d->e[i].val;
    return NULL;
}

struct jv *jdict_get_str(const struct jdict *d, const char *key)
{
    size_t n = strlen(key);
    for (size_t i = 0; i < d->n; i++) {
        const struct jv *k = &d->e[i].key;
        if (k->t == JV_STR && k->u.s->len == n && memcmp(k->u.s->s, key, n) == 0)
            return &d->e[i].val;
    }
    return NULL;
}

/* ---- predicates ------------------------------------------------------------- */

bool jv_is_str(struct jv v)
{
    return v.t == JV_STR;
}

bool jv_is_num(struct jv v)
{
    return v.t == JV_BOOL || v.t == JV_INT || v.t == JV_FLOAT;
}

bool jv_truthy(struct jv v)
{
    switch (v.t) {
    case JV_UNDEF:
    case JV_NONE: return false;
    case JV_BOOL: return v.u.b;
    case JV_INT: return v.u.i != 0;
    case JV_FLOAT: return v.u.f != 0.0;
    case JV_STR: return v.u.s->len != 0;
    case JV_LIST:
        if (v.u.l->kind == JL_GEN || v.u.l->kind == JL_REVITER)
            return true; /* a generator object is always true */
        return v.u.l->n != 0;
    case JV_DICT: return v.u.d->n != 0;
    default: return true;
    }
}

static double num_f(struct jv v)
{
    if (v.t == JV_FLOAT)
        return v.u.f;
    if (v.t == JV_BOOL)
        return v.u.b;
    return (double)v.u.i;
}

static int64_t num_i(struct jv v)
{
    return v.t == JV_BOOL ? (int64_t)v.u.b : v.u.i;
}

static bool seq_like(struct jv v)
{
    return v.t == JV_LIST && (v.u.l->kind == JL_LIST || v.u.l->kind == JL_TUPLE);
}

bool jv_eq(struct jv a, struct jv b)
{
    if (jv_is_num(a) && jv_is_num(b)) {
        if (a.t == JV_FLOAT || b.t == JV_FLOAT)
            return num_f(a) == num_f(b);
        return num_i(a) == num_i(b);
    }
    if (a.t != b.t)
        return false;
    switch (a.t) {
    case JV_UNDEF:
    case JV_NONE: return true;
    case JV_STR: return a.u.s->len == b.u.s->len && memcmp(a.u.s->s, b.u.s->s, a.u.s->len) == 0;
    case JV_LIST:
        if (a.u.l == b.u.l)
            return true;
        if (!(seq_like(a) && seq_like(b)) && !(a.u.l->kind == JL_KEYS && b.u.l->kind == JL_KEYS) &&
            !(a.u.l->kind == JL_ITEMS && b.u.l->kind == JL_ITEMS))
            return false; /* generators compare by identity; values views never equal */
        if (a.u.l->kind != b.u.l->kind || a.u.l->n != b.u.l->n)
            return false;
        if (a.u.l->kind == JL_KEYS || a.u.l->kind == JL_ITEMS) { /* set-like */
            for (size_t i = 0; i < a.u.l->n; i++) {
                bool found = false;
                for (size_t j = 0; j < b.u.l->n && !found; j++)
                    found = jv_eq(a.u.l->v[i], b.u.l->v[j]);
                if (!found)
                    return false;
            }
            return true;
        }
        for (size_t i = 0; i < a.u.l->n; i++)
            if (!jv_eq(a.u.l->v[i], b.u.l->v[i]))
                return false;
        return true;
    case JV_DICT:
        if (a.u.d->n != b.u.d->n)
            return false;
        for (size_t i = 0; i < a.u.d->n; i++) {
            struct jv *o = jdict_get(b.u.d, a.u.d->e[i].key);
            if (!o || !jv_eq(a.u.d->e[i].val, *o))
                return false;
        }
        return true;
    case JV_NS: return a.u.d == b.u.d;
    case JV_LOOP: return a.u.loop == b.u.loop;
    case JV_MACRO: return a.u.macro == b.u.macro;
    case JV_FUNC: return a.u.func == b.u.func;
    case JV_METHOD: return a.u.m == b.u.m;
    default: return false;
    }
}

const char *jv_type_name(struct jv v)
{
    switch (v.t) {
    case JV_UNDEF: return "Undefined";
    case JV_NONE: return "NoneType";
    case JV_BOOL: return "bool";
    case JV_INT: return "int";
    case JV_FLOAT: return "float";
    case JV_STR: return "str";
    case JV_LIST:
        switch (v.u.l->kind) {
        case JL_TUPLE: return "tuple";
        case JL_GEN: return "generator";
        case JL_REVITER: return "list_reverseiterator";
        case JL_ITEMS: return "dict_items";
        case JL_KEYS: return "dict_keys";
        case JL_VALUES: return "dict_values";
        default: return "list";
        }
    case JV_DICT: return "dict";
    case JV_NS: return "Namespace";
    case JV_LOOP: return "LoopContext";
    case JV_MACRO: return "Macro";
    case JV_FUNC: return "function";
    case JV_METHOD: return "method";
    default: return "object";
    }
}

int jv_cmp(struct jctx *c, int line, struct jv a, struct jv b)
{
    if (jv_is_num(a) && jv_is_num(b)) {
        if (a.t == JV_FLOAT || b.t == JV_FLOAT) {
            double x = num_f(a), y = num_f(b);
            return x < y ? -1 : x > y ? 1 : x == y ? 0 : 2; /* NaN: unordered */
        }
        int64_t x = num_i(a), y = num_i(b);
        return x < y ? -1 : x > y ? 1 : 0;
    }
    if (a.t == JV_STR && b.t == JV_STR) {
        size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
        int r = memcmp(a.u.s->s, b.u.s->s, n); /* UTF-8 byte order = code point order */
        if (r)
            return r < 0 ? -1 : 1;
        return a.u.s->len < b.u.s->len ? -1 : a.u.s->len > b.u.s->len ? 1 : 0;
    }
    if (seq_like(a) && seq_like(b) && a.u.l->kind == b.u.l->kind) {
        size_t n = a.u.l->n < b.u.l->n ? a.u.l->n : b.u.l->n;
        for (size_t i = 0; i < n; i++) {
            if (jv_eq(a.u.l->v[i], b.u.l->v[i]))
                continue;
            return jv_cmp(c, line, a.u.l->v[i], b.u.l->v[i]);
        }
        return a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n ? 1 : 0;
    }
    if (a.t == JV_UNDEF || b.t == JV_UNDEF) {
        struct jv u = a.t == JV_UNDEF ? a : b;
        if (u.u.uname)
            jerr(c, line, MOE_ERR_INVALID, "'%s' is undefined", u.u.uname);
        jerr(c, line, MOE_ERR_INVALID, "comparison with an undefined value");
    }
    jerr(c, line, MOE_ERR_INVALID, "'<' not supported between instances of '%s' and '%s'",
         jv_type_name(a), jv_type_name(b));
}

/* ---- UTF-8 ------------------------------------------------------------------- */

uint32_t ju8_dec(const char *s, size_t n, size_t *adv)
{
    const unsigned char *u = (const unsigned char *)s;
    if (u[0] < 0x80 || n < 2) {
        *adv = 1;
        return u[0];
    }
    if ((u[0] & 0xe0) == 0xc0) {
        *adv = 2;
        return ((uint32_t)(u[0] & 0x1f) << 6) | (u[1] & 0x3f);
    }
    if ((u[0] & 0xf0) == 0xe0 && n >= 3) {
        *adv = 3;
        return ((uint32_t)(u[0] & 0x0f) << 12) | ((uint32_t)(u[1] & 0x3f) << 6) | (u[2] & 0x3f);
    }
    if (n >= 4) {
        *adv = 4;
        return ((uint32_t)(u[0] & 0x07) << 18) | ((uint32_t)(u[1] & 0x3f) << 12) |
               ((uint32_t)(u[2] & 0x3f) << 6) | (u[3] & 0x3f);
    }
    *adv = 1;
    return u[0];
}

size_t ju8_enc(uint32_t cp, char out[4])
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

size_t ju8_len(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += ((unsigned char)s[i] & 0xc0) != 0x80;
    return k;
}

bool ju8_valid(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        unsigned char b = u[i];
        size_t k;
        uint32_t cp, min;
        if (b < 0x80) {
            i++;
            continue;
        } else if ((b & 0xe0) == 0xc0) {
            k = 2, cp = b & 0x1f, min = 0x80;
        } else if ((b & 0xf0) == 0xe0) {
            k = 3, cp = b & 0x0f, min = 0x800;
        } else if ((b & 0xf8) == 0xf0) {
            k = 4, cp = b & 0x07, min = 0x10000;
        } else {
            return false;
        }
        if (i + k > n)
            return false;
        for (size_t j = 1; j < k; j++) {
            if ((u[i + j] & 0xc0) != 0x80)
                return false;
            cp = (cp << 6) | (u[i + j] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        i += k;
    }
    return true;
}

/* str.isspace(): bidi classes WS, B, S and category Zs. */
bool jpy_isspace(uint32_t cp)
{
    if (cp < 0x80)
        return cp == ' ' || (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x1f);
    switch (cp) {
    case 0x85:
    case 0xa0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202f:
    case 0x205f:
    case 0x3000: return true;
    default: return cp >= 0x2000 && cp <= 0x200a;
    }
}

/* ---- string builder ------------------------------------------------------------ */

void jsb_init(struct jsb *b, struct jctx *c)
{
    b->c = c;
    b->p = NULL;
    b->n = b->cap = 0;
}

void jsb_add(struct jsb *b, const char *p, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1)
            cap *= 2;
        if (cap > CHAT_TEMPLATE_MAX_OUTPUT + 1 && b->n + n > CHAT_TEMPLATE_MAX_OUTPUT)
            jerr(b->c, 0, MOE_ERR_INVALID, "a string of more than %u MiB (the output limit)",
                 (unsigned)(CHAT_TEMPLATE_MAX_OUTPUT >> 20));
        char *np = jalloc(b->c, cap);
        if (b->n)
            memcpy(np, b->p, b->n);
        b->p = np;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, p, n);
    b->n += n;
}

void jsb_adds(struct jsb *b, const char *s)
{
    jsb_add(b, s, strlen(s));
}

void jsb_addc(struct jsb *b, char ch)
{
    jsb_add(b, &ch, 1);
}

const struct jstr *jsb_str(struct jsb *b)
{
    return jstr_new(b->c, b->p ? b->p : "", b->n);
}

/* ---- float printing: Python's repr (shortest round trip) ------------------------ */

void jfloat_repr(double f, char out[40])
{
    if (isnan(f)) {
        strcpy(out, "nan");
        return;
    }
    if (isinf(f)) {
        strcpy(out, f < 0 ? "-inf" : "inf");
        return;
    }
    if (f == 0) {
        strcpy(out, signbit(f) ? "-0.0" : "0.0");
        return;
    }
    char buf[40];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof(buf), "%.*e", prec - 1, f);
        if (strtod(buf, NULL) == f)
            break;
    }
    /* buf: [-]d[.ddd]e[+-]XX */
    char digits[24];
    int nd = 0;
    const char *p = buf;
    bool neg = false;
    if (*p == '-') {
        neg = true;
        p++;
    }
    for (; *p && *p != 'e'; p++)
        if (*p != '.')
            digits[nd++] = *p;
    int e10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = 0;
    char *o = out;
    if (neg)
        *o++ = '-';
    if (e10 >= -5 + 1 && e10 < 16) { /* Python: fixed when -4 <= exponent < 16 */
        if (e10 < 0) {
            *o++ = '0';
            *o++ = '.';
            for (int i = 0; i < -e10 - 1; i++)
                *o++ = '0';
            memcpy(o, digits, nd);
            o += nd;
        } else {
            for (int i = 0; i <= e10; i++)
                *o++ = i < nd ? digits[i] : '0';
            *o++ = '.';
            if (nd > e10 + 1) {
                memcpy(o, digits + e10 + 1, nd - e10 - 1);
                o += nd - e10 - 1;
            } else {
                *o++ = '0';
            }
        }
        *o = 0;
        return;
    }
    *o++ = digits[0];
    if (nd > 1) {
        *o++ = '.';
        memcpy(o, digits + 1, nd - 1);
        o += nd - 1;
    }
    sprintf(o, "e%c%02d", e10 < 0 ? '-' : '+', e10 < 0 ? -e10 : e10);
}

/* ---- str() and repr() ------------------------------------------------------------ */

static bool py_printable(uint32_t cp)
{
    if (cp < 0x80)
        return cp >= 0x20 && cp < 0x7f;
    if (cp == ' ')
        return true;
    return !uc_is_general_category_withtable(cp, UC_CATEGORY_MASK_Cc | UC_CATEGORY_MASK_Cf |
                                                     UC_CATEGORY_MASK_Cs | UC_CATEGORY_MASK_Co |
                                                     UC_CATEGORY_MASK_Cn | UC_CATEGORY_MASK_Zl |
                                                     UC_CATEGORY_MASK_Zp | UC_CATEGORY_MASK_Zs);
}

static void write_str_repr(struct jsb *b, const struct jstr *s)
{
    bool has_sq = memchr(s->s, '\'', s->len) != NULL;
    bool has_dq = memchr(s->s, '"', s->len) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    jsb_addc(b, q);
    size_t i = 0;
    while (i < s->len) {
        size_t adv;
        uint32_t cp = ju8_dec(s->s + i, s->len - i, &adv);
        char tmp[16];
        if (cp == (uint32_t)q || cp == '\\') {
            jsb_addc(b, '\\');
            jsb_addc(b, (char)cp);
        } else if (cp == '\n') {
            jsb_adds(b, "\\n");
        } else if (cp == '\r') {
            jsb_adds(b, "\\r");
        } else if (cp == '\t') {
            jsb_adds(b, "\\t");
        } else if (py_printable(cp)) {
            jsb_add(b, s->s + i, adv);
        } else {
            if (cp <= 0xff)
                snprintf(tmp, sizeof(tmp), "\\x%02x", cp);
            else if (cp <= 0xffff)
                snprintf(tmp, sizeof(tmp), "\\u%04x", cp);
            else
                snprintf(tmp, sizeof(tmp), "\\U%08x", cp);
            jsb_adds(b, tmp);
        }
        i += adv;
    }
    jsb_addc(b, q);
}

static _Noreturn void no_text(struct jsb *b, int line, struct jv v)
{
    jerr(b->c, line, MOE_ERR_UNSUPPORTED,
         "cannot print a %s object (Python would print its memory address)", jv_type_name(v));
}

void jv_write_repr(struct jsb *b, int line, struct jv v)
{
    char tmp[48];
    switch (v.t) {
    case JV_UNDEF: jsb_adds(b, "Undefined"); return;
    case JV_STR: write_str_repr(b, v.u.s); return;
    case JV_LIST: {
        const struct jlist *l = v.u.l;
        const char *open = "[", *close = "]";
        switch (l->kind) {
        case JL_TUPLE: open = "(", close = l->n == 1 ? ",)" : ")"; break;
        case JL_ITEMS: open = "dict_items([", close = "])"; break;
        case JL_KEYS: open = "dict_keys([", close = "])"; break;
        case JL_VALUES: open = "dict_values([", close = "])"; break;
        case JL_GEN:
        case JL_REVITER: no_text(b, line, v);
        default: break;
        }
        jsb_adds(b, open);
        for (size_t i = 0; i < l->n; i++) {
            if (i)
                jsb_adds(b, ", ");
            jv_write_repr(b, line, l->v[i]);
        }
        jsb_adds(b, close);
        return;
    }
    case JV_DICT:
    case JV_NS: {
        const struct jdict *d = v.u.d;
        if (v.t == JV_NS)
            jsb_adds(b, "<Namespace ");
        jsb_addc(b, '{');
        for (size_t i = 0; i < d->n; i++) {
            if (i)
                jsb_adds(b, ", ");
            jv_write_repr(b, line, d->e[i].key);
            jsb_adds(b, ": ");
            jv_write_repr(b, line, d->e[i].val);
        }
        jsb_addc(b, '}');
        if (v.t == JV_NS)
            jsb_addc(b, '>');
        return;
    }
    default: break;
    }
    switch (v.t) {
    case JV_NONE: jsb_adds(b, "None"); return;
    case JV_BOOL: jsb_adds(b, v.u.b ? "True" : "False"); return;
    case JV_INT:
        snprintf(tmp, sizeof(tmp), "%lld", (long long)v.u.i);
        jsb_adds(b, tmp);
        return;
    case JV_FLOAT:
        jfloat_repr(v.u.f, tmp);
        jsb_adds(b, tmp);
        return;
    default: no_text(b, line, v);
    }
}

void jv_write_str(struct jsb *b, int line, struct jv v)
{
    if (v.t == JV_STR)
        jsb_add(b, v.u.s->s, v.u.s->len);
    else if (v.t == JV_UNDEF)
        return;
    else
        jv_write_repr(b, line, v);
}

const struct jstr *jv_to_str(struct jctx *c, int line, struct jv v)
{
    if (v.t == JV_STR)
        return v.u.s;
    struct jsb b;
    jsb_init(&b, c);
    jv_write_str(&b, line, v);
    return jsb_str(&b);
}

/* ---- json.dumps ------------------------------------------------------------------- */

static void json_str(struct jsb *b, const char *s, size_t n, bool ascii)
{
    jsb_addc(b, '"');
    size_t i = 0;
    while (i < n) {
        unsigned char ch = (unsigned char)s[i];
        char tmp[16];
        switch (ch) {
        case '"': jsb_adds(b, "\\\""); break;
        case '\\': jsb_adds(b, "\\\\"); break;
        case '\n': jsb_adds(b, "\\n"); break;
        case '\r': jsb_adds(b, "\\r"); break;
        case '\t': jsb_adds(b, "\\t"); break;
        case '\b': jsb_adds(b, "\\b"); break;
        case '\f': jsb_adds(b, "\\f"); break;
        default:
            if (ch < 0x20 || (ascii && ch == 0x7f)) {
                snprintf(tmp, sizeof(tmp), "\\u%04x", ch);
                jsb_adds(b, tmp);
            } else if (ascii && ch >= 0x80) {
                size_t adv;
                uint32_t cp = ju8_dec(s + i, n - i, &adv);
                if (cp >= 0x10000) {
                    cp -= 0x10000;
                    snprintf(tmp, sizeof(tmp), "\\u%04x\\u%04x", 0xd800 + (cp >> 10),
                             0xdc00 + (cp & 0x3ff));
                } else {
                    snprintf(tmp, sizeof(tmp), "\\u%04x", cp);
                }
                jsb_adds(b, tmp);
                i += adv;
                continue;
            } else {
                jsb_add(b, s + i, 1);
            }
        }
        i++;
    }
    jsb_addc(b, '"');
}

static void json_newline(struct jsb *b, const char *indent_str, int level)
{
    jsb_addc(b, '\n');
    for (int i = 0; i < level; i++)
        jsb_adds(b, indent_str);
}

static void json_key(struct jsb *b, int line, struct jv k, bool ascii)
{
    char tmp[48];
    switch (k.t) {
    case JV_STR: json_str(b, k.u.s->s, k.u.s->len, ascii); return;
    case JV_BOOL: jsb_adds(b, k.u.b ? "\"true\"" : "\"false\""); return;
    case JV_NONE: jsb_adds(b, "\"null\""); return;
    case JV_INT: snprintf(tmp, sizeof(tmp), "\"%lld\"", (long long)k.u.i); break;
    case JV_FLOAT: {
        char f[40];
        jfloat_repr(k.u.f, f);
        snprintf(tmp, sizeof(tmp), "\"%s\"", f);
        break;
    }
    default:
        jerr(b->c, line, MOE_ERR_INVALID, "keys must be str, int, float, bool or None, not %s",
             jv_type_name(k));
    }
    jsb_adds(b, tmp);
}

/* indent < 0: no indent. indent_str: the indent unit when indent >= 0. The
 * ensure_ascii flag travels in the sign of `level` bits: kept simple with a
 * static helper below. */
static void json_value(struct jsb *b, int line, struct jv v, const char *indent_str,
                       const char *item_sep, const char *key_sep, bool sort_keys, bool ascii,
                       int level)
{
    char tmp[48];
    if (level > 1000)
        jerr(b->c, line, MOE_ERR_INVALID, "tojson: nesting deeper than 1000");
    switch (v.t) {
    case JV_NONE: jsb_adds(b, "null"); return;
    case JV_BOOL: jsb_adds(b, v.u.b ? "true" : "false"); return;
    case JV_INT:
        snprintf(tmp, sizeof(tmp), "%lld", (long long)v.u.i);
        jsb_adds(b, tmp);
        return;
    case JV_FLOAT:
        if (isnan(v.u.f))
            jsb_adds(b, "NaN");
        else if (isinf(v.u.f))
            jsb_adds(b, v.u.f < 0 ? "-Infinity" : "Infinity");
        else {
            jfloat_repr(v.u.f, tmp);
            jsb_adds(b, tmp);
        }
        return;
    case JV_STR: json_str(b, v.u.s->s, v.u.s->len, ascii); return;
    case JV_LIST:
        if (v.u.l->kind == JL_LIST || v.u.l->kind == JL_TUPLE) {
            const struct jlist *l = v.u.l;
            if (l->n == 0) {
                jsb_adds(b, "[]");
                return;
            }
            jsb_addc(b, '[');
            for (size_t i = 0; i < l->n; i++) {
                if (i)
                    jsb_adds(b, item_sep);
                if (indent_str)
                    json_newline(b, indent_str, level + 1);
                json_value(b, line, l->v[i], indent_str, item_sep, key_sep, sort_keys, ascii,
                           level + 1);
            }
            if (indent_str)
                json_newline(b, indent_str, level);
            jsb_addc(b, ']');
            return;
        }
        break;
    case JV_DICT: {
        const struct jdict *d = v.u.d;
        if (d->n == 0) {
            jsb_adds(b, "{}");
            return;
        }
        size_t *order = jalloc(b->c, d->n * sizeof(*order));
        for (size_t i = 0; i < d->n; i++)
            order[i] = i;
        if (sort_keys) { /* insertion sort: stable, as Python's sorted() */
            for (size_t i = 1; i < d->n; i++) {
                size_t x = order[i], j = i;
                while (j > 0 && jv_cmp(b->c, line, d->e[x].key, d->e[order[j - 1]].key) < 0) {
                    order[j] = order[j - 1];
                    j--;
                }
                order[j] = x;
            }
        }
        jsb_addc(b, '{');
        for (size_t k = 0; k < d->n; k++) {
            const struct jdict_ent *e = &d->e[order[k]];
            if (k)
                jsb_adds(b, item_sep);
            if (indent_str)
                json_newline(b, indent_str, level + 1);
            json_key(b, line, e->key, ascii);
            jsb_adds(b, key_sep);
            json_value(b, line, e->val, indent_str, item_sep, key_sep, sort_keys, ascii, level + 1);
        }
        if (indent_str)
            json_newline(b, indent_str, level);
        jsb_addc(b, '}');
        return;
    }
    default: break;
    }
    jerr(b->c, line, MOE_ERR_INVALID, "Object of type %s is not JSON serializable",
         jv_type_name(v));
}

void jv_write_json(struct jsb *b, int line, struct jv v, int indent, const char *indent_str,
                   const char *item_sep, const char *key_sep, bool sort_keys, int level)
{
    /* `level` < 0 carries ensure_ascii=True (the caller passes -1). */
    bool ascii = level < 0;
    const char *unit = NULL;
    char spaces[64];
    if (indent_str) {
        unit = indent_str;
    } else if (indent >= 0) {
        int k = indent < 63 ? indent : 63;
        memset(spaces, ' ', (size_t)k);
        spaces[k] = 0;
        unit = spaces;
    }
    if (!item_sep)
        item_sep = unit ? "," : ", ";
    if (!key_sep)
        key_sep = ": ";
    json_value(b, line, v, unit, item_sep, key_sep, sort_keys, ascii, 0);
}
