/* Filters, tests and global functions, each as jinja2 3.1 defines it
 * (jinja2/filters.py, tests.py, defaults.py), plus what transformers adds
 * to the environment: raise_exception, strftime_now, its tojson and the
 * namespace() that refuses names starting with '_'. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <unicase.h>
#include <unictype.h>

#include "jinja_internal.h"

unsigned jargs_bind(struct jctx *c, int line, const char *what, const struct jargs *a,
                    const char *const *params, int n, struct jv *out)
{
    unsigned given = 0;
    for (int i = 0; i < n; i++)
        out[i] = jv_undef(NULL);
    if (a->n_pos > n)
        jerr(c, line, MOE_ERR_INVALID, "%s takes at most %d argument(s), %d given", what, n,
             a->n_pos);
    for (int i = 0; i < a->n_pos; i++) {
        out[i] = a->pos[i];
        given |= 1u << i;
    }
    for (int k = 0; k < a->n_kw; k++) {
        int i;
        for (i = 0; i < n; i++)
            if (!strcmp(params[i], a->kwn[k]))
                break;
        if (i == n)
            jerr(c, line, MOE_ERR_INVALID, "%s got an unexpected keyword argument '%s'", what,
                 a->kwn[k]);
        if (given & (1u << i))
            jerr(c, line, MOE_ERR_INVALID, "%s got multiple values for argument '%s'", what,
                 a->kwn[k]);
        out[i] = a->kwv[k];
        given |= 1u << i;
    }
    return given;
}

static struct jv list_value(struct jlist *l)
{
    struct jv v = {.t = JV_LIST};
    v.u.l = l;
    return v;
}

static _Noreturn void undefined_error(struct jctx *c, int line, struct jv u)
{
    if (u.u.uname)
        jerr(c, line, MOE_ERR_INVALID, "'%s' is undefined", u.u.uname);
    jerr(c, line, MOE_ERR_INVALID, "an undefined value was used");
}

static const struct jstr *soft_str(struct jctx *c, int line, struct jv v)
{
    return jv_to_str(c, line, v);
}

static bool is_gen(struct jv v)
{
    return v.t == JV_LIST && (v.u.l->kind == JL_GEN || v.u.l->kind == JL_REVITER);
}

static bool truthy_arg(struct jv v)
{
    return v.t != JV_UNDEF && jv_truthy(v);
}

/* len(): jerr where Python raises TypeError. */
static int64_t py_len(struct jctx *c, int line, struct jv v)
{
    switch (v.t) {
    case JV_STR: return (int64_t)ju8_len(v.u.s->s, v.u.s->len);
    case JV_LIST:
        if (!is_gen(v))
            return (int64_t)v.u.l->n;
        break;
    case JV_DICT: return (int64_t)v.u.d->n;
    case JV_UNDEF: return 0;
    case JV_LOOP: return (int64_t)v.u.loop->items->n;
    default: break;
    }
    jerr(c, line, MOE_ERR_INVALID, "object of type '%s' has no len()", jv_type_name(v));
}

/* reversed(): NULL where Python raises TypeError. */
static struct jlist *py_reversed(struct jctx *c, int line, struct jv v)
{
    struct jlist *src;
    if (v.t == JV_UNDEF)
        return jlist_new(c, JL_REVITER, 0);
    if (v.t == JV_STR || v.t == JV_DICT || (v.t == JV_LIST && !is_gen(v)))
        src = jinja_iter(c, line, v);
    else
        return NULL;
    struct jlist *l = jlist_new(c, JL_REVITER, src->n);
    for (size_t i = src->n; i-- > 0;)
        jlist_push(c, l, src->v[i]);
    return l;
}

/* make_attrgetter: "a.b.0" through getitem, `dflt` for an undefined step. */
static struct jv attr_get(struct jctx *c, int line, struct jv item, struct jv attr,
                          const struct jv *dflt)
{
    if (attr.t != JV_STR) {
        item = jinja_getitem(c, line, item, attr);
        if (dflt && item.t == JV_UNDEF)
            item = *dflt;
        return item;
    }
    const char *s = attr.u.s->s;
    size_t n = attr.u.s->len, i = 0;
    for (;;) {
        size_t j = i;
        while (j < n && s[j] != '.')
            j++;
        bool digits = j > i;
        for (size_t k = i; k < j; k++)
            digits = digits && s[k] >= '0' && s[k] <= '9';
        struct jv key;
        if (digits)
            key = jv_int(strtoll(s + i, NULL, 10));
        else
            key = jv_str(c, s + i, j - i);
        item = jinja_getitem(c, line, item, key);
        if (dflt && item.t == JV_UNDEF)
            item = *dflt;
        if (j >= n)
            break;
        i = j + 1;
    }
    return item;
}

/* ---- tests ---------------------------------------------------------------------- */

enum jtest {
    T_DEFINED,
    T_UNDEFINED,
    T_NONE,
    T_BOOLEAN,
    T_FALSE,
    T_TRUE,
    T_INTEGER,
    T_FLOAT,
    T_NUMBER,
    T_STRING,
    T_MAPPING,
    T_ITERABLE,
    T_SEQUENCE,
    T_CALLABLE,
    T_ODD,
    T_EVEN,
    T_DIVISIBLEBY,
    T_EQ,
    T_NE,
    T_LT,
    T_LE,
    T_GT,
    T_GE,
    T_IN,
    T_SAMEAS,
    T_LOWER,
    T_UPPER,
    T_FILTER,
    T_TEST,
    T_N,
};

static const struct {
    const char *name;
    int id;
} test_names[] = {
    {"defined", T_DEFINED},
    {"undefined", T_UNDEFINED},
    {"none", T_NONE},
    {"boolean", T_BOOLEAN},
    {"false", T_FALSE},
    {"true", T_TRUE},
    {"integer", T_INTEGER},
    {"float", T_FLOAT},
    {"number", T_NUMBER},
    {"string", T_STRING},
    {"mapping", T_MAPPING},
    {"iterable", T_ITERABLE},
    {"sequence", T_SEQUENCE},
    {"callable", T_CALLABLE},
    {"odd", T_ODD},
    {"even", T_EVEN},
    {"divisibleby", T_DIVISIBLEBY},
    {"eq", T_EQ},
    {"equalto", T_EQ},
    {"==", T_EQ},
    {"ne", T_NE},
    {"!=", T_NE},
    {"lt", T_LT},
    {"lessthan", T_LT},
    {"<", T_LT},
    {"le", T_LE},
    {"<=", T_LE},
    {"gt", T_GT},
    {"greaterthan", T_GT},
    {">", T_GT},
    {"ge", T_GE},
    {">=", T_GE},
    {"in", T_IN},
    {"sameas", T_SAMEAS},
    {"lower", T_LOWER},
    {"upper", T_UPPER},
    {"filter", T_FILTER},
    {"test", T_TEST},
};
#define N_TEST_NAMES (int)(sizeof(test_names) / sizeof(test_names[0]))

int jinja_test_lookup(const char *name)
{
    for (int i = 0; i < N_TEST_NAMES; i++)
        if (!strcmp(test_names[i].name, name))
            return test_names[i].id;
    return -1;
}

const char *jinja_test_name(int id)
{
    for (int i = 0; i < N_TEST_NAMES; i++)
        if (test_names[i].id == id)
            return test_names[i].name;
    return "?";
}

static struct jv one_arg(struct jctx *c, int line, const char *what, const struct jargs *a)
{
    struct jv p[1];
    static const char *const params[] = {"other"};
    unsigned given = jargs_bind(c, line, what, a, params, 1, p);
    if (!(given & 1))
        jerr(c, line, MOE_ERR_INVALID, "test '%s' needs an argument", what);
    return p[0];
}

static struct jv py_mod(struct jctx *c, int line, struct jv x, struct jv y)
{
    if (x.t == JV_UNDEF)
        undefined_error(c, line, x);
    if (!jv_is_num(x) || !jv_is_num(y))
        jerr(c, line, MOE_ERR_INVALID, "unsupported operand type(s) for %%: '%s' and '%s'",
             jv_type_name(x), jv_type_name(y));
    if (x.t != JV_FLOAT && y.t != JV_FLOAT) {
        int64_t a = x.t == JV_BOOL ? x.u.b : x.u.i, b = y.t == JV_BOOL ? y.u.b : y.u.i;
        if (b == 0)
            jerr(c, line, MOE_ERR_INVALID, "integer division or modulo by zero");
        if (b == -1)
            return jv_int(0);
        int64_t m = a % b;
        if (m != 0 && ((m < 0) != (b < 0)))
            m += b;
        return jv_int(m);
    }
    double a = x.t == JV_FLOAT ? x.u.f : (double)(x.t == JV_BOOL ? x.u.b : x.u.i);
    double b = y.t == JV_FLOAT ? y.u.f : (double)(y.t == JV_BOOL ? y.u.b : y.u.i);
    if (b == 0)
        jerr(c, line, MOE_ERR_INVALID, "float modulo by zero");
    double m = fmod(a, b);
    if (m != 0 && ((b < 0) != (m < 0)))
        m += b;
    return jv_float(m);
}

/* str.islower() / isupper(): some cased character and no cased one of the other case. */
static bool str_is_case(const struct jstr *s, bool lower)
{
    bool cased = false;
    size_t i = 0;
    while (i < s->len) {
        size_t adv;
        uint32_t cp = ju8_dec(s->s + i, s->len - i, &adv);
        i += adv;
        if (lower) {
            if (uc_is_property_uppercase(cp) || uc_is_general_category(cp, UC_TITLECASE_LETTER))
                return false;
            if (!cased && uc_is_property_lowercase(cp))
                cased = true;
        } else {
            if (uc_is_property_lowercase(cp) || uc_is_general_category(cp, UC_TITLECASE_LETTER))
                return false;
            if (!cased && uc_is_property_uppercase(cp))
                cased = true;
        }
    }
    return cased;
}

int jinja_filter_lookup(const char *name);

bool jinja_test(struct jctx *c, int line, int id, struct jv v, const struct jargs *a)
{
    const char *what = jinja_test_name(id);
    if (id < T_ODD && (a->n_pos || a->n_kw))
        jerr(c, line, MOE_ERR_INVALID, "test '%s' takes no arguments", what);
    switch (id) {
    case T_DEFINED: return v.t != JV_UNDEF;
    case T_UNDEFINED: return v.t == JV_UNDEF;
    case T_NONE: return v.t == JV_NONE;
    case T_BOOLEAN: return v.t == JV_BOOL;
    case T_FALSE: return v.t == JV_BOOL && !v.u.b;
    case T_TRUE: return v.t == JV_BOOL && v.u.b;
    case T_INTEGER: return v.t == JV_INT;
    case T_FLOAT: return v.t == JV_FLOAT;
    case T_NUMBER: return jv_is_num(v);
    case T_STRING: return v.t == JV_STR;
    case T_MAPPING: return v.t == JV_DICT;
    case T_ITERABLE:
        return v.t == JV_STR || v.t == JV_LIST || v.t == JV_DICT || v.t == JV_UNDEF ||
               v.t == JV_LOOP;
    case T_SEQUENCE:
        return v.t == JV_STR || v.t == JV_DICT || v.t == JV_UNDEF ||
               (v.t == JV_LIST && (v.u.l->kind == JL_LIST || v.u.l->kind == JL_TUPLE));
    case T_CALLABLE:
        return v.t == JV_MACRO || v.t == JV_FUNC || v.t == JV_METHOD || v.t == JV_UNDEF ||
               v.t == JV_LOOP;
    case T_ODD:
    case T_EVEN: {
        if (a->n_pos || a->n_kw)
            jerr(c, line, MOE_ERR_INVALID, "test '%s' takes no arguments", what);
        struct jv m = py_mod(c, line, v, jv_int(2));
        return jv_eq(m, jv_int(id == T_ODD ? 1 : 0));
    }
    case T_DIVISIBLEBY: return jv_eq(py_mod(c, line, v, one_arg(c, line, what, a)), jv_int(0));
    case T_EQ: return jv_eq(v, one_arg(c, line, what, a));
    case T_NE: return !jv_eq(v, one_arg(c, line, what, a));
    case T_LT: return jv_cmp(c, line, v, one_arg(c, line, what, a)) == -1;
    case T_LE: return jcmp_le(jv_cmp(c, line, v, one_arg(c, line, what, a)));
    case T_GT: return jv_cmp(c, line, v, one_arg(c, line, what, a)) == 1;
    case T_GE: return jcmp_ge(jv_cmp(c, line, v, one_arg(c, line, what, a)));
    case T_IN: return jinja_in(c, line, v, one_arg(c, line, what, a));
    case T_SAMEAS: {
        struct jv o = one_arg(c, line, what, a);
        if (v.t == JV_NONE || v.t == JV_BOOL || o.t == JV_NONE || o.t == JV_BOOL)
            return v.t == o.t && (v.t == JV_NONE || v.u.b == o.u.b);
        jerr(c, line, MOE_ERR_UNSUPPORTED,
             "'sameas' is supported only against none, true and false");
    }
    case T_LOWER: return str_is_case(soft_str(c, line, v), true);
    case T_UPPER: return str_is_case(soft_str(c, line, v), false);
    case T_FILTER: return v.t == JV_STR && jinja_filter_lookup(v.u.s->s) >= 0;
    case T_TEST: return v.t == JV_STR && jinja_test_lookup(v.u.s->s) >= 0;
    default: break;
    }
    jerr(c, line, MOE_ERR_INTERNAL, "bad test %d", id);
}

/* A test given by name at render time (select('odd')). */
static bool named_test(struct jctx *c, int line, struct jv name, struct jv v, int n_pos,
                       struct jv *pos, const struct jargs *orig)
{
    if (name.t != JV_STR)
        jerr(c, line, MOE_ERR_INVALID, "the test name must be a string");
    int id = jinja_test_lookup(name.u.s->s);
    if (id < 0)
        jerr(c, line, MOE_ERR_UNSUPPORTED, "unknown test '%s'", name.u.s->s);
    struct jargs a = {
        .n_pos = n_pos, .pos = pos, .n_kw = orig->n_kw, .kwn = orig->kwn, .kwv = orig->kwv};
    return jinja_test(c, line, id, v, &a);
}

/* ---- filters ------------------------------------------------------------------------ */

enum jfilter {
    F_ABS,
    F_ATTR,
    F_CAPITALIZE,
    F_COUNT,
    F_DEFAULT,
    F_FIRST,
    F_FLOAT,
    F_INDENT,
    F_INT,
    F_ITEMS,
    F_JOIN,
    F_LAST,
    F_LIST,
    F_LOWER,
    F_MAP,
    F_REJECT,
    F_REJECTATTR,
    F_REPLACE,
    F_REVERSE,
    F_SELECT,
    F_SELECTATTR,
    F_STRING,
    F_TITLE,
    F_TOJSON,
    F_TRIM,
    F_UPPER,
};

static const struct {
    const char *name;
    int id;
} filter_names[] = {
    {"abs", F_ABS},
    {"attr", F_ATTR},
    {"capitalize", F_CAPITALIZE},
    {"count", F_COUNT},
    {"length", F_COUNT},
    {"default", F_DEFAULT},
    {"d", F_DEFAULT},
    {"first", F_FIRST},
    {"float", F_FLOAT},
    {"indent", F_INDENT},
    {"int", F_INT},
    {"items", F_ITEMS},
    {"join", F_JOIN},
    {"last", F_LAST},
    {"list", F_LIST},
    {"lower", F_LOWER},
    {"map", F_MAP},
    {"reject", F_REJECT},
    {"rejectattr", F_REJECTATTR},
    {"replace", F_REPLACE},
    {"reverse", F_REVERSE},
    {"select", F_SELECT},
    {"selectattr", F_SELECTATTR},
    {"string", F_STRING},
    {"title", F_TITLE},
    {"tojson", F_TOJSON},
    {"trim", F_TRIM},
    {"upper", F_UPPER},
};
#define N_FILTER_NAMES (int)(sizeof(filter_names) / sizeof(filter_names[0]))

int jinja_filter_lookup(const char *name)
{
    for (int i = 0; i < N_FILTER_NAMES; i++)
        if (!strcmp(filter_names[i].name, name))
            return filter_names[i].id;
    return -1;
}

const char *jinja_filter_name(int id)
{
    for (int i = 0; i < N_FILTER_NAMES; i++)
        if (filter_names[i].id == id)
            return filter_names[i].name;
    return "?";
}

/* Python int(str, 10) / float(str): NULL-free parse or false. */
static bool parse_py_int(const struct jstr *s, int64_t *out)
{
    const char *p = s->s, *end = s->s + s->len;
    while (p < end && (*p == ' ' || (*p >= '\t' && *p <= '\r')))
        p++;
    while (end > p && (end[-1] == ' ' || (end[-1] >= '\t' && end[-1] <= '\r')))
        end--;
    bool neg = false;
    if (p < end && (*p == '+' || *p == '-'))
        neg = *p++ == '-';
    if (p >= end)
        return false;
    uint64_t v = 0;
    bool last_digit = false;
    for (; p < end; p++) {
        if (*p == '_' && last_digit && p + 1 < end && p[1] >= '0' && p[1] <= '9') {
            last_digit = false;
            continue;
        }
        if (*p < '0' || *p > '9')
            return false;
        if (v > (UINT64_MAX - 9) / 10)
            return false;
        v = v * 10 + (uint64_t)(*p - '0');
        last_digit = true;
    }
    if (v > (uint64_t)INT64_MAX + neg)
        return false;
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return true;
}

static bool parse_py_float(struct jctx *c, const struct jstr *s, double *out)
{
    const char *p = s->s, *end = s->s + s->len;
    while (p < end && jpy_isspace((unsigned char)*p))
        p++;
    while (end > p && jpy_isspace((unsigned char)end[-1]))
        end--;
    if (p >= end)
        return false;
    char *buf = jalloc(c, (size_t)(end - p) + 1);
    size_t o = 0;
    for (const char *q = p; q < end; q++) {
        char ch = *q;
        if (ch == '_') {
            if (q == p || q + 1 >= end || q[-1] < '0' || q[-1] > '9' || q[1] < '0' || q[1] > '9')
                return false;
            continue;
        }
        if (ch == 'x' || ch == 'X' || ch == 'p' || ch == 'P' || ch == '(')
            return false; /* strtod's hex and nan(...) forms are not Python's */
        buf[o++] = ch;
    }
    buf[o] = 0;
    char *e;
    double v = strtod(buf, &e);
    if (e != buf + o)
        return false;
    *out = v;
    return true;
}

static struct jv to_int(struct jctx *c, int line, struct jv v, struct jv dflt)
{
    switch (v.t) {
    case JV_UNDEF: undefined_error(c, line, v);
    case JV_BOOL: return jv_int(v.u.b);
    case JV_INT: return v;
    case JV_FLOAT:
        if (isnan(v.u.f))
            return dflt;
        if (isinf(v.u.f))
            jerr(c, line, MOE_ERR_INVALID, "cannot convert float infinity to integer");
        if (fabs(v.u.f) >= 9.2233720368547758e18)
            jerr(c, line, MOE_ERR_UNSUPPORTED, "integer result does not fit in 64 bits");
        return jv_int((int64_t)v.u.f);
    case JV_STR: {
        int64_t i;
        if (parse_py_int(v.u.s, &i))
            return jv_int(i);
        double f;
        if (parse_py_float(c, v.u.s, &f))
            return to_int(c, line, jv_float(f), dflt);
        return dflt;
    }
    default: return dflt;
    }
}

static struct jv f_tojson(struct jctx *c, int line, struct jv in, const struct jargs *a)
{
    static const char *const params[] = {"ensure_ascii", "indent", "separators", "sort_keys"};
    struct jv p[4];
    jargs_bind(c, line, "tojson", a, params, 4, p);
    bool ascii = truthy_arg(p[0]);
    int indent = -1;
    const char *indent_str = NULL;
    if (p[1].t == JV_INT || p[1].t == JV_BOOL) {
        int64_t k = p[1].t == JV_BOOL ? p[1].u.b : p[1].u.i;
        indent = k < 0 ? 0 : k > 64 ? 64 : (int)k;
    } else if (p[1].t == JV_STR) {
        indent_str = p[1].u.s->s;
    } else if (p[1].t != JV_UNDEF && p[1].t != JV_NONE) {
        jerr(c, line, MOE_ERR_INVALID, "tojson: indent must be an integer or a string");
    }
    const char *item_sep = NULL, *key_sep = NULL;
    if (p[2].t == JV_LIST && (p[2].u.l->kind == JL_LIST || p[2].u.l->kind == JL_TUPLE) &&
        p[2].u.l->n == 2 && p[2].u.l->v[0].t == JV_STR && p[2].u.l->v[1].t == JV_STR) {
        item_sep = p[2].u.l->v[0].u.s->s;
        key_sep = p[2].u.l->v[1].u.s->s;
    } else if (p[2].t != JV_UNDEF && p[2].t != JV_NONE) {
        jerr(c, line, MOE_ERR_INVALID, "tojson: separators must be a pair of strings");
    }
    struct jsb b;
    jsb_init(&b, c);
    jv_write_json(&b, line, in, indent, indent_str, item_sep, key_sep, truthy_arg(p[3]),
                  ascii ? -1 : 0);
    return jv_strv(jsb_str(&b));
}

/* jinja2's do_indent, on str.splitlines() boundaries. */
static bool line_break(uint32_t cp)
{
    return cp == '\n' || cp == '\r' || cp == 0x0b || cp == 0x0c || cp == 0x1c || cp == 0x1d ||
           cp == 0x1e || cp == 0x85 || cp == 0x2028 || cp == 0x2029;
}

static struct jv f_indent(struct jctx *c, int line, struct jv in, const struct jargs *a)
{
    static const char *const params[] = {"width", "first", "blank"};
    struct jv p[3];
    jargs_bind(c, line, "indent", a, params, 3, p);
    if (in.t == JV_UNDEF)
        undefined_error(c, line, in);
    if (in.t != JV_STR) /* jinja2 does s += "\n" */
        jerr(c, line, MOE_ERR_INVALID, "indent: expected a string, got %s", jv_type_name(in));
    const struct jstr *s = in.u.s;
    const char *ind = "    ";
    size_t ind_n = 4;
    char spaces[256];
    if (p[0].t == JV_STR) {
        ind = p[0].u.s->s;
        ind_n = p[0].u.s->len;
    } else if (p[0].t == JV_INT) {
        int64_t k = p[0].u.i < 0 ? 0 : p[0].u.i > 255 ? 255 : p[0].u.i;
        memset(spaces, ' ', (size_t)k);
        ind = spaces;
        ind_n = (size_t)k;
    } else if (p[0].t != JV_UNDEF) {
        jerr(c, line, MOE_ERR_INVALID, "indent: width must be an integer or a string");
    }
    bool first = truthy_arg(p[1]), blank = truthy_arg(p[2]);
    /* lines of s + "\n" */
    struct jsb b;
    jsb_init(&b, c);
    if (first)
        jsb_add(&b, ind, ind_n);
    /* the lines of s + "\n" per str.splitlines(): every segment, the last one too */
    size_t i = 0, n = s->len;
    bool first_line = true;
    for (;;) {
        size_t j = i, adv = 0;
        uint32_t cp = 0;
        while (j < n) {
            cp = ju8_dec(s->s + j, n - j, &adv);
            if (line_break(cp))
                break;
            j += adv;
        }
        if (!first_line) {
            jsb_addc(&b, '\n');
            if (blank || j > i)
                jsb_add(&b, ind, ind_n);
        }
        jsb_add(&b, s->s + i, j - i);
        first_line = false;
        if (j >= n)
            break;
        i = j + (cp == '\r' && j + 1 < n && s->s[j + 1] == '\n' ? 2 : adv);
    }
    return jv_strv(jsb_str(&b));
}

static struct jv f_map(struct jctx *c, int line, struct jv in, const struct jargs *a)
{
    struct jlist *out = jlist_new(c, JL_GEN, 0);
    struct jlist *items = jinja_iter(c, line, in);
    if (a->n_pos == 0 && a->n_kw > 0) {
        struct jv attr = jv_undef(NULL), dflt = jv_none();
        bool has_attr = false, has_dflt = false;
        for (int k = 0; k < a->n_kw; k++) {
            if (!strcmp(a->kwn[k], "attribute")) {
                attr = a->kwv[k];
                has_attr = true;
            } else if (!strcmp(a->kwn[k], "default")) {
                dflt = a->kwv[k];
                has_dflt = dflt.t != JV_NONE;
            } else {
                jerr(c, line, MOE_ERR_INVALID, "map: unexpected keyword argument '%s'", a->kwn[k]);
            }
        }
        if (!has_attr)
            jerr(c, line, MOE_ERR_UNSUPPORTED, "map: keyword arguments need attribute=");
        for (size_t i = 0; i < items->n; i++)
            jlist_push(c, out, attr_get(c, line, items->v[i], attr, has_dflt ? &dflt : NULL));
        return list_value(out);
    }
    if (a->n_pos == 0)
        jerr(c, line, MOE_ERR_INVALID, "map requires a filter argument");
    if (a->pos[0].t != JV_STR)
        jerr(c, line, MOE_ERR_INVALID, "map: the filter name must be a string");
    int id = jinja_filter_lookup(a->pos[0].u.s->s);
    if (id < 0)
        jerr(c, line, MOE_ERR_UNSUPPORTED, "unknown filter '%s'", a->pos[0].u.s->s);
    struct jargs rest = {
        .n_pos = a->n_pos - 1, .pos = a->pos + 1, .n_kw = a->n_kw, .kwn = a->kwn, .kwv = a->kwv};
    for (size_t i = 0; i < items->n; i++)
        jlist_push(c, out, jinja_filter(c, line, id, items->v[i], &rest));
    return list_value(out);
}

static struct jv f_select(struct jctx *c, int line, struct jv in, const struct jargs *a,
                          bool reject, bool attr)
{
    struct jlist *out = jlist_new(c, JL_GEN, 0);
    if (!jv_truthy(in))
        return list_value(out);
    int off = attr ? 1 : 0;
    if (attr && a->n_pos == 0)
        jerr(c, line, MOE_ERR_INVALID, "missing parameter for attribute name");
    struct jlist *items = jinja_iter(c, line, in);
    for (size_t i = 0; i < items->n; i++) {
        struct jv item = items->v[i];
        struct jv x = attr ? attr_get(c, line, item, a->pos[0], NULL) : item;
        bool ok;
        if (a->n_pos > off)
            ok = named_test(c, line, a->pos[off], x, a->n_pos - off - 1, a->pos + off + 1, a);
        else
            ok = jv_truthy(x);
        if (ok != reject)
            jlist_push(c, out, item);
    }
    return list_value(out);
}

struct jv jinja_filter(struct jctx *c, int line, int id, struct jv in, const struct jargs *a)
{
    const char *what = jinja_filter_name(id);
    struct jv p[3];
    switch (id) {
    case F_ABS:
        jargs_bind(c, line, what, a, NULL, 0, p);
        if (in.t == JV_INT) {
            if (in.u.i == INT64_MIN)
                jerr(c, line, MOE_ERR_UNSUPPORTED, "integer result does not fit in 64 bits");
            return jv_int(in.u.i < 0 ? -in.u.i : in.u.i);
        }
        if (in.t == JV_BOOL)
            return jv_int(in.u.b);
        if (in.t == JV_FLOAT)
            return jv_float(fabs(in.u.f));
        if (in.t == JV_UNDEF)
            undefined_error(c, line, in);
        jerr(c, line, MOE_ERR_INVALID, "bad operand type for abs(): '%s'", jv_type_name(in));
    case F_ATTR: {
        static const char *const params[] = {"name"};
        jargs_bind(c, line, what, a, params, 1, p);
        if (p[0].t != JV_STR)
            jerr(c, line, MOE_ERR_INVALID, "attr: the name must be a string");
        return jinja_getattr(c, line, in, p[0].u.s->s);
    }
    case F_CAPITALIZE:
        jargs_bind(c, line, what, a, NULL, 0, p);
        return jv_strv(jstr_capitalize(c, soft_str(c, line, in)));
    case F_COUNT: jargs_bind(c, line, what, a, NULL, 0, p); return jv_int(py_len(c, line, in));
    case F_DEFAULT: {
        static const char *const params[] = {"default_value", "boolean"};
        unsigned given = jargs_bind(c, line, what, a, params, 2, p);
        struct jv dflt = (given & 1) ? p[0] : jv_str(c, "", 0);
        if (in.t == JV_UNDEF || (truthy_arg(p[1]) && !jv_truthy(in)))
            return dflt;
        return in;
    }
    case F_FIRST: {
        jargs_bind(c, line, what, a, NULL, 0, p);
        struct jlist *l = jinja_iter(c, line, in);
        return l->n ? l->v[0] : jv_undef(NULL);
    }
    case F_LAST: {
        jargs_bind(c, line, what, a, NULL, 0, p);
        struct jlist *l = py_reversed(c, line, in);
        if (!l)
            jerr(c, line, MOE_ERR_INVALID, "'%s' object is not reversible", jv_type_name(in));
        return l->n ? l->v[0] : jv_undef(NULL);
    }
    case F_FLOAT: {
        static const char *const params[] = {"default"};
        unsigned given = jargs_bind(c, line, what, a, params, 1, p);
        struct jv dflt = (given & 1) ? p[0] : jv_float(0.0);
        switch (in.t) {
        case JV_UNDEF: undefined_error(c, line, in);
        case JV_BOOL: return jv_float(in.u.b);
        case JV_INT: return jv_float((double)in.u.i);
        case JV_FLOAT: return in;
        case JV_STR: {
            double f;
            return parse_py_float(c, in.u.s, &f) ? jv_float(f) : dflt;
        }
        default: return dflt;
        }
    }
    case F_INDENT: return f_indent(c, line, in, a);
    case F_INT: {
        static const char *const params[] = {"default", "base"};
        unsigned given = jargs_bind(c, line, what, a, params, 2, p);
        if ((given & 2) && !(p[1].t == JV_INT && p[1].u.i == 10))
            jerr(c, line, MOE_ERR_UNSUPPORTED, "int: only base 10 is supported");
        return to_int(c, line, in, (given & 1) ? p[0] : jv_int(0));
    }
    case F_ITEMS: {
        jargs_bind(c, line, what, a, NULL, 0, p);
        if (in.t == JV_UNDEF)
            return list_value(jlist_new(c, JL_GEN, 0));
        if (in.t != JV_DICT)
            jerr(c, line, MOE_ERR_INVALID, "can only get item pairs from a mapping, not %s",
                 jv_type_name(in));
        struct jv v = jinja_dict_items(c, in.u.d, JL_ITEMS);
        v.u.l->kind = JL_GEN;
        return v;
    }
    case F_JOIN: {
        static const char *const params[] = {"d", "attribute"};
        jargs_bind(c, line, what, a, params, 2, p);
        const struct jstr *sep = p[0].t == JV_UNDEF ? jstr_new(c, "", 0) : soft_str(c, line, p[0]);
        struct jlist *l = jinja_iter(c, line, in);
        struct jsb b;
        jsb_init(&b, c);
        for (size_t i = 0; i < l->n; i++) {
            if (i)
                jsb_add(&b, sep->s, sep->len);
            struct jv x = l->v[i];
            if (p[1].t != JV_UNDEF && p[1].t != JV_NONE)
                x = attr_get(c, line, x, p[1], NULL);
            jv_write_str(&b, line, x);
        }
        return jv_strv(jsb_str(&b));
    }
    case F_LIST: {
        jargs_bind(c, line, what, a, NULL, 0, p);
        struct jlist *src = jinja_iter(c, line, in);
        struct jlist *l = jlist_new(c, JL_LIST, src->n);
        for (size_t i = 0; i < src->n; i++)
            jlist_push(c, l, src->v[i]);
        return list_value(l);
    }
    case F_LOWER:
    case F_UPPER:
        jargs_bind(c, line, what, a, NULL, 0, p);
        return jv_strv(jstr_case(c, soft_str(c, line, in), id == F_UPPER ? 0 : 1));
    case F_TITLE:
        jargs_bind(c, line, what, a, NULL, 0, p);
        return jv_strv(jstr_title_filter(c, soft_str(c, line, in)));
    case F_MAP: return f_map(c, line, in, a);
    case F_SELECT: return f_select(c, line, in, a, false, false);
    case F_REJECT: return f_select(c, line, in, a, true, false);
    case F_SELECTATTR: return f_select(c, line, in, a, false, true);
    case F_REJECTATTR: return f_select(c, line, in, a, true, true);
    case F_REPLACE: {
        static const char *const params[] = {"old", "new", "count"};
        jargs_bind(c, line, what, a, params, 3, p);
        int64_t count = -1;
        if (p[2].t == JV_INT)
            count = p[2].u.i;
        else if (p[2].t != JV_UNDEF && p[2].t != JV_NONE)
            jerr(c, line, MOE_ERR_INVALID, "replace: count must be an integer");
        return jv_strv(jstr_replace(c, soft_str(c, line, in), soft_str(c, line, p[0]),
                                    soft_str(c, line, p[1]), count));
    }
    case F_REVERSE: {
        jargs_bind(c, line, what, a, NULL, 0, p);
        if (in.t == JV_STR) {
            struct jlist *r = py_reversed(c, line, in);
            struct jsb b;
            jsb_init(&b, c);
            for (size_t i = 0; i < r->n; i++)
                jsb_add(&b, r->v[i].u.s->s, r->v[i].u.s->len);
            return jv_strv(jsb_str(&b));
        }
        struct jlist *r = py_reversed(c, line, in);
        if (r)
            return list_value(r);
        if (is_gen(in)) {
            struct jlist *l = jlist_new(c, JL_LIST, in.u.l->n);
            for (size_t i = in.u.l->n; i-- > 0;)
                jlist_push(c, l, in.u.l->v[i]);
            return list_value(l);
        }
        jerr(c, line, MOE_ERR_INVALID, "reverse: argument must be iterable");
    }
    case F_STRING: jargs_bind(c, line, what, a, NULL, 0, p); return jv_strv(soft_str(c, line, in));
    case F_TOJSON: return f_tojson(c, line, in, a);
    case F_TRIM: {
        static const char *const params[] = {"chars"};
        jargs_bind(c, line, what, a, params, 1, p);
        const struct jstr *chars = NULL;
        if (p[0].t != JV_UNDEF && p[0].t != JV_NONE)
            chars = soft_str(c, line, p[0]);
        return jv_strv(jstr_strip(c, soft_str(c, line, in), chars, 3));
    }
    default: break;
    }
    jerr(c, line, MOE_ERR_INTERNAL, "bad filter %d", id);
}

/* ---- global functions ------------------------------------------------------------------- */

enum jfunc { G_RANGE, G_DICT, G_NAMESPACE, G_RAISE, G_STRFTIME, G_N };
static const char *const func_names[G_N] = {"range", "dict", "namespace", "raise_exception",
                                            "strftime_now"};

int jinja_func_lookup(const char *name)
{
    for (int i = 0; i < G_N; i++)
        if (!strcmp(func_names[i], name))
            return i;
    return -1;
}

const char *jinja_func_name(int id)
{
    return id >= 0 && id < G_N ? func_names[id] : "?";
}

#define JINJA_MAX_RANGE 100000 /* jinja2.sandbox.MAX_RANGE */

static int64_t range_arg(struct jctx *c, int line, struct jv v)
{
    if (v.t == JV_INT)
        return v.u.i;
    if (v.t == JV_BOOL)
        return v.u.b;
    if (v.t == JV_UNDEF)
        undefined_error(c, line, v);
    jerr(c, line, MOE_ERR_INVALID, "'%s' object cannot be interpreted as an integer",
         jv_type_name(v));
}

/* dict(mapping or pairs, **kw) into d. */
static void fill_dict(struct jctx *c, int line, const char *what, struct jdict *d,
                      const struct jargs *a)
{
    if (a->n_pos > 1)
        jerr(c, line, MOE_ERR_INVALID, "%s expected at most 1 positional argument", what);
    if (a->n_pos == 1) {
        struct jv src = a->pos[0];
        if (src.t == JV_DICT || src.t == JV_NS) {
            for (size_t i = 0; i < src.u.d->n; i++)
                jdict_set(c, d, src.u.d->e[i].key, src.u.d->e[i].val);
        } else {
            struct jlist *l = jinja_iter(c, line, src);
            for (size_t i = 0; i < l->n; i++) {
                struct jlist *pair = jinja_iter(c, line, l->v[i]);
                if (pair->n != 2)
                    jerr(c, line, MOE_ERR_INVALID,
                         "%s: sequence element #%zu has length %zu; 2 is required", what, i,
                         pair->n);
                jdict_set(c, d, pair->v[0], pair->v[1]);
            }
        }
    }
    for (int k = 0; k < a->n_kw; k++)
        jdict_set(c, d, jv_cstr(c, a->kwn[k]), a->kwv[k]);
}

struct jv jinja_func(struct jctx *c, int line, int id, const struct jargs *a)
{
    switch (id) {
    case G_RANGE: {
        if (a->n_kw)
            jerr(c, line, MOE_ERR_INVALID, "range() takes no keyword arguments");
        if (a->n_pos < 1 || a->n_pos > 3)
            jerr(c, line, MOE_ERR_INVALID, "range expected 1 to 3 arguments, got %d", a->n_pos);
        int64_t start = 0, stop, step = 1;
        if (a->n_pos == 1) {
            stop = range_arg(c, line, a->pos[0]);
        } else {
            start = range_arg(c, line, a->pos[0]);
            stop = range_arg(c, line, a->pos[1]);
            if (a->n_pos == 3)
                step = range_arg(c, line, a->pos[2]);
        }
        if (step == 0)
            jerr(c, line, MOE_ERR_INVALID, "range() arg 3 must not be zero");
        double n = step > 0 ? ceil(((double)stop - (double)start) / (double)step)
                            : ceil(((double)start - (double)stop) / (double)-step);
        if (n < 0)
            n = 0;
        if (n > JINJA_MAX_RANGE)
            jerr(c, line, MOE_ERR_INVALID, "range too big, the sandbox allows %d items",
                 JINJA_MAX_RANGE);
        struct jlist *l = jlist_new(c, JL_LIST, (size_t)n);
        for (int64_t i = 0; i < (int64_t)n; i++)
            jlist_push(c, l, jv_int(start + i * step));
        return list_value(l);
    }
    case G_DICT: {
        struct jdict *d = jdict_new(c, 0);
        fill_dict(c, line, "dict", d, a);
        struct jv v = {.t = JV_DICT};
        v.u.d = d;
        return v;
    }
    case G_NAMESPACE: {
        struct jdict *d = jdict_new(c, 0);
        fill_dict(c, line, "namespace", d, a);
        for (size_t i = 0; i < d->n; i++)
            if (d->e[i].key.t == JV_STR && d->e[i].key.u.s->s[0] == '_')
                jerr(c, line, MOE_ERR_INVALID, "namespace attributes cannot start with '_' ('%s')",
                     d->e[i].key.u.s->s);
        struct jv v = {.t = JV_NS};
        v.u.d = d;
        return v;
    }
    case G_RAISE: {
        if (a->n_pos != 1 || a->n_kw)
            jerr(c, line, MOE_ERR_INVALID, "raise_exception takes one argument");
        const struct jstr *msg = jv_to_str(c, line, a->pos[0]);
        jerr(c, line, MOE_ERR_INVALID, "raise_exception: %s", msg->s);
    }
    case G_STRFTIME: {
        if (a->n_pos != 1 || a->n_kw || a->pos[0].t != JV_STR)
            jerr(c, line, MOE_ERR_INVALID, "strftime_now takes one string argument");
        time_t now = time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        char buf[512];
        size_t n = strftime(buf, sizeof(buf), a->pos[0].u.s->s, &tm);
        if (n == 0 && a->pos[0].u.s->len)
            jerr(c, line, MOE_ERR_INVALID, "strftime_now: the formatted date is too long");
        return jv_str(c, buf, n);
    }
    default: break;
    }
    jerr(c, line, MOE_ERR_INTERNAL, "bad function %d", id);
}
