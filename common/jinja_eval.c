/* Runs a parsed template the way jinja2's generated code does:
 *  - scopes: the render variables at the bottom, the template's root scope
 *    above them; each for-loop iteration starts a fresh scope over the
 *    enclosing one (assignments inside a loop do not survive the iteration,
 *    which is why templates use namespace()); `if` opens no scope; a macro
 *    call opens a scope over the one the macro was defined in, where names
 *    resolve at call time;
 *  - attribute access tries the Python attribute (methods) before the item,
 *    subscription the item before the attribute, as jinja2's sandboxed
 *    getattr/getitem do; a missing one is Undefined, and touching an
 *    attribute of an Undefined is an error;
 *  - arithmetic, comparison and truth follow Python. */
#define _GNU_SOURCE /* memmem */
#include <math.h>
#include <string.h>

#include "jinja_internal.h"

/* Recursion of eval/exec in one render: at most ~300 KiB of stack (a frame
 * is 200-300 bytes; checked with a 512 KiB thread stack). */
#define JINJA_MAX_FRAMES 1000

static struct jscope *scope_new(struct jctx *c, struct jscope *parent)
{
    struct jscope *s = jalloc(c, sizeof(*s));
    s->parent = parent;
    return s;
}

void jinja_scope_set(struct jctx *c, struct jscope *s, const char *name, struct jv v)
{
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->names[i], name)) {
            s->vals[i] = v;
            return;
        }
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 8;
        const char **nn = jalloc(c, (size_t)cap * sizeof(*nn));
        struct jv *nv = jalloc(c, (size_t)cap * sizeof(*nv));
        if (s->n) {
            memcpy(nn, s->names, (size_t)s->n * sizeof(*nn));
            memcpy(nv, s->vals, (size_t)s->n * sizeof(*nv));
        }
        s->names = nn;
        s->vals = nv;
        s->cap = cap;
    }
    s->names[s->n] = name;
    s->vals[s->n] = v;
    s->n++;
}

void jinja_frame_start(struct jctx *c, struct jscope *sc, const struct jnode *body)
{
    for (int i = 0; body && i < body->n_locals; i++)
        jinja_scope_set(c, sc, body->locals[i], jv_undef(body->locals[i]));
}

static struct jv *scope_find(struct jscope *s, const char *name)
{
    for (; s; s = s->parent)
        for (int i = s->n - 1; i >= 0; i--)
            if (!strcmp(s->names[i], name))
                return &s->vals[i];
    return NULL;
}

static struct jv lookup(struct jscope *sc, const char *name)
{
    struct jv *v = scope_find(sc, name);
    if (v)
        return *v;
    int f = jinja_func_lookup(name);
    if (f >= 0) {
        struct jv fv = {.t = JV_FUNC};
        fv.u.func = f;
        return fv;
    }
    return jv_undef(name);
}

/* ---- output ---------------------------------------------------------------- */

static void out_write(struct jctx *c, int line, const char *p, size_t n)
{
    struct jbuf *b = &c->bufs[c->n_bufs - 1];
    if (b->n + n > CHAT_TEMPLATE_MAX_OUTPUT)
        jerr(c, line, MOE_ERR_INVALID, "output exceeds %u MiB (the limit)",
             (unsigned)(CHAT_TEMPLATE_MAX_OUTPUT >> 20));
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *np = realloc(b->p, cap);
        if (!np)
            jerr(c, line, MOE_ERR_NOMEM, "out of memory for the output");
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}

static void out_push(struct jctx *c, int line)
{
    if (c->n_bufs == JINJA_MAX_CAPTURE)
        jerr(c, line, MOE_ERR_INVALID, "more than %d nested macro calls and set blocks",
             JINJA_MAX_CAPTURE);
    c->bufs[c->n_bufs].p = NULL;
    c->bufs[c->n_bufs].n = c->bufs[c->n_bufs].cap = 0;
    c->n_bufs++;
}

static const struct jstr *out_pop(struct jctx *c)
{
    struct jbuf *b = &c->bufs[c->n_bufs - 1];
    const struct jstr *s = jstr_new(c, b->p ? b->p : "", b->n);
    free(b->p);
    b->p = NULL;
    c->n_bufs--;
    return s;
}

/* ---- attribute and item access ---------------------------------------------- */

static _Noreturn void undefined_error(struct jctx *c, int line, struct jv u)
{
    if (u.u.uname)
        jerr(c, line, MOE_ERR_INVALID, "'%s' is undefined", u.u.uname);
    jerr(c, line, MOE_ERR_INVALID, "an undefined value was used");
}

static struct jv method_value(struct jctx *c, struct jv self, int id, const char *name)
{
    struct jmethod *m = jalloc(c, sizeof(*m));
    m->self = self;
    m->id = id;
    m->name = name;
    struct jv v = {.t = JV_METHOD};
    v.u.m = m;
    return v;
}

static struct jv loop_attr(struct jctx *c, struct jv lv, const char *name)
{
    const struct jloop *L = lv.u.loop;
    int64_t n = (int64_t)L->items->n, i = (int64_t)L->index0;
    if (!strcmp(name, "index"))
        return jv_int(i + 1);
    if (!strcmp(name, "index0"))
        return jv_int(i);
    if (!strcmp(name, "revindex"))
        return jv_int(n - i);
    if (!strcmp(name, "revindex0"))
        return jv_int(n - i - 1);
    if (!strcmp(name, "first"))
        return jv_bool(i == 0);
    if (!strcmp(name, "last"))
        return jv_bool(i == n - 1);
    if (!strcmp(name, "length"))
        return jv_int(n);
    if (!strcmp(name, "depth"))
        return jv_int(1);
    if (!strcmp(name, "depth0"))
        return jv_int(0);
    if (!strcmp(name, "previtem"))
        return i > 0 ? L->items->v[i - 1] : jv_undef("previtem");
    if (!strcmp(name, "nextitem"))
        return i + 1 < n ? L->items->v[i + 1] : jv_undef("nextitem");
    int m = jinja_method_of(lv, name);
    if (m != -1)
        return method_value(c, lv, m, name);
    return jv_undef(name);
}

struct jv jinja_getattr(struct jctx *c, int line, struct jv obj, const char *name)
{
    if (obj.t == JV_UNDEF)
        undefined_error(c, line, obj);
    if (obj.t == JV_LOOP)
        return loop_attr(c, obj, name);
    if (obj.t == JV_NS) {
        struct jv *v = jdict_get_str(obj.u.d, name);
        return v ? *v : jv_undef(name);
    }
    int m = jinja_method_of(obj, name);
    if (m != -1)
        return method_value(c, obj, m, name);
    if (obj.t == JV_DICT) {
        struct jv *v = jdict_get_str(obj.u.d, name);
        if (v)
            return *v;
    }
    return jv_undef(name);
}

static bool hashable(struct jv k)
{
    if (k.t == JV_LIST && k.u.l->kind == JL_TUPLE) {
        for (size_t i = 0; i < k.u.l->n; i++)
            if (!hashable(k.u.l->v[i]))
                return false;
        return true;
    }
    return k.t == JV_NONE || k.t == JV_BOOL || k.t == JV_INT || k.t == JV_FLOAT || k.t == JV_STR;
}

/* Code point i of s as a new string (i in range). */
static struct jv str_char(struct jctx *c, const struct jstr *s, int64_t i)
{
    size_t off = 0;
    for (int64_t k = 0; k < i; k++) {
        size_t adv;
        ju8_dec(s->s + off, s->len - off, &adv);
        off += adv;
    }
    size_t adv;
    ju8_dec(s->s + off, s->len - off, &adv);
    return jv_str(c, s->s + off, adv);
}

struct jv jinja_getitem(struct jctx *c, int line, struct jv obj, struct jv key)
{
    if (obj.t == JV_UNDEF)
        undefined_error(c, line, obj);
    if (obj.t == JV_DICT && hashable(key)) {
        struct jv *v = jdict_get(obj.u.d, key);
        if (v)
            return *v;
    }
    bool int_key = key.t == JV_INT || key.t == JV_BOOL;
    int64_t k = key.t == JV_BOOL ? key.u.b : key.u.i;
    if (int_key && obj.t == JV_LIST && (obj.u.l->kind == JL_LIST || obj.u.l->kind == JL_TUPLE)) {
        int64_t n = (int64_t)obj.u.l->n;
        if (k < 0)
            k += n;
        return k >= 0 && k < n ? obj.u.l->v[k] : jv_undef(NULL);
    }
    if (int_key && obj.t == JV_STR) {
        int64_t n = (int64_t)ju8_len(obj.u.s->s, obj.u.s->len);
        if (k < 0)
            k += n;
        return k >= 0 && k < n ? str_char(c, obj.u.s, k) : jv_undef(NULL);
    }
    if (key.t == JV_STR) {
        if (obj.t == JV_LOOP || obj.t == JV_NS)
            return jinja_getattr(c, line, obj, key.u.s->s);
        int m = jinja_method_of(obj, key.u.s->s);
        if (m != -1)
            return method_value(c, obj, m, key.u.s->s);
        return jv_undef(key.u.s->s);
    }
    return jv_undef(NULL);
}

/* Python's slice.indices() then the selection. jinja2 compiles a slice as a
 * plain Python subscription (not through its getitem), so what Python
 * refuses is an error, not undefined. */
static struct jv do_slice(struct jctx *c, int line, struct jv obj, struct jv *parts[3])
{
    if (obj.t == JV_UNDEF)
        undefined_error(c, line, obj);
    bool is_seq = obj.t == JV_LIST && (obj.u.l->kind == JL_LIST || obj.u.l->kind == JL_TUPLE);
    if (!is_seq && obj.t != JV_STR)
        jerr(c, line, MOE_ERR_INVALID, "'%s' object is not subscriptable with a slice",
             jv_type_name(obj));
    int64_t v[3];
    bool given[3];
    for (int i = 0; i < 3; i++) {
        struct jv *p = parts[i];
        given[i] = p && p->t != JV_NONE;
        if (!given[i])
            continue;
        if (p->t == JV_UNDEF)
            undefined_error(c, line, *p);
        if (p->t != JV_INT && p->t != JV_BOOL)
            jerr(c, line, MOE_ERR_INVALID, "slice indices must be integers or None, not %s",
                 jv_type_name(*p));
        v[i] = p->t == JV_BOOL ? p->u.b : p->u.i;
    }
    int64_t step = given[2] ? v[2] : 1;
    if (step == 0)
        jerr(c, line, MOE_ERR_INVALID, "slice step cannot be zero");
    /* code point offsets of a string */
    size_t *offs = NULL;
    int64_t n;
    if (obj.t == JV_STR) {
        n = (int64_t)ju8_len(obj.u.s->s, obj.u.s->len);
        offs = jalloc(c, (size_t)(n + 1) * sizeof(*offs));
        size_t off = 0;
        for (int64_t i = 0; i < n; i++) {
            offs[i] = off;
            size_t adv;
            ju8_dec(obj.u.s->s + off, obj.u.s->len - off, &adv);
            off += adv;
        }
        offs[n] = off;
    } else {
        n = (int64_t)obj.u.l->n;
    }
    int64_t start, stop;
    if (step > 0) {
        start = given[0] ? v[0] : 0;
        stop = given[1] ? v[1] : n;
        if (start < 0)
            start = start + n < 0 ? 0 : start + n;
        else if (start > n)
            start = n;
        if (stop < 0)
            stop = stop + n < 0 ? 0 : stop + n;
        else if (stop > n)
            stop = n;
    } else {
        start = given[0] ? v[0] : n - 1;
        stop = given[1] ? v[1] : -1 - n; /* "before the first" */
        if (start < 0)
            start = start + n < 0 ? -1 : start + n;
        else if (start >= n)
            start = n - 1;
        if (given[1]) {
            if (stop < 0)
                stop = stop + n < 0 ? -1 : stop + n;
            else if (stop >= n)
                stop = n - 1;
        } else {
            stop = -1;
        }
    }
    if (obj.t == JV_STR) {
        struct jsb b;
        jsb_init(&b, c);
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
            jsb_add(&b, obj.u.s->s + offs[i], offs[i + 1] - offs[i]);
        return jv_strv(jsb_str(&b));
    }
    struct jlist *l = jlist_new(c, obj.u.l->kind, 0);
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
        jlist_push(c, l, obj.u.l->v[i]);
    struct jv r = {.t = JV_LIST};
    r.u.l = l;
    return r;
}

struct jlist *jinja_iter(struct jctx *c, int line, struct jv v)
{
    switch (v.t) {
    case JV_LIST: return v.u.l;
    case JV_UNDEF: return jlist_new(c, JL_LIST, 0);
    case JV_DICT: {
        struct jlist *l = jlist_new(c, JL_LIST, v.u.d->n);
        for (size_t i = 0; i < v.u.d->n; i++)
            jlist_push(c, l, v.u.d->e[i].key);
        return l;
    }
    case JV_STR: {
        struct jlist *l = jlist_new(c, JL_LIST, v.u.s->len);
        size_t off = 0;
        while (off < v.u.s->len) {
            size_t adv;
            ju8_dec(v.u.s->s + off, v.u.s->len - off, &adv);
            jlist_push(c, l, jv_str(c, v.u.s->s + off, adv));
            off += adv;
        }
        return l;
    }
    default: jerr(c, line, MOE_ERR_INVALID, "'%s' object is not iterable", jv_type_name(v));
    }
}

bool jinja_in(struct jctx *c, int line, struct jv item, struct jv container)
{
    switch (container.t) {
    case JV_STR:
        if (item.t != JV_STR)
            jerr(c, line, MOE_ERR_INVALID, "'in <string>' requires string as left operand, not %s",
                 jv_type_name(item));
        if (item.u.s->len == 0)
            return true;
        return memmem(container.u.s->s, container.u.s->len, item.u.s->s, item.u.s->len) != NULL;
    case JV_DICT:
        if (!hashable(item))
            jerr(c, line, MOE_ERR_INVALID, "unhashable type: '%s'", jv_type_name(item));
        return jdict_get(container.u.d, item) != NULL;
    case JV_LIST:
        for (size_t i = 0; i < container.u.l->n; i++)
            if (jv_eq(container.u.l->v[i], item))
                return true;
        return false;
    case JV_UNDEF: return false;
    default:
        jerr(c, line, MOE_ERR_INVALID, "argument of type '%s' is not iterable",
             jv_type_name(container));
    }
}

/* ---- arithmetic ---------------------------------------------------------------- */

static bool is_intlike(struct jv v)
{
    return v.t == JV_INT || v.t == JV_BOOL;
}

static int64_t ival(struct jv v)
{
    return v.t == JV_BOOL ? (int64_t)v.u.b : v.u.i;
}

static double fval(struct jv v)
{
    return v.t == JV_FLOAT ? v.u.f : (double)ival(v);
}

static const char *op_sym(int op)
{
    static const char *const s[] = {"+", "-", "*", "/", "//", "%", "**"};
    return s[op];
}

static _Noreturn void bad_operands(struct jctx *c, int line, int op, struct jv a, struct jv b)
{
    if (a.t == JV_UNDEF)
        undefined_error(c, line, a);
    if (b.t == JV_UNDEF)
        undefined_error(c, line, b);
    jerr(c, line, MOE_ERR_INVALID, "unsupported operand type(s) for %s: '%s' and '%s'", op_sym(op),
         jv_type_name(a), jv_type_name(b));
}

static _Noreturn void overflow(struct jctx *c, int line)
{
    jerr(c, line, MOE_ERR_UNSUPPORTED, "integer result does not fit in 64 bits");
}

static struct jv repeat(struct jctx *c, int line, struct jv seq, int64_t k)
{
    if (k < 0)
        k = 0;
    if (seq.t == JV_STR) {
        if (seq.u.s->len && (uint64_t)k > CHAT_TEMPLATE_MAX_OUTPUT / seq.u.s->len)
            jerr(c, line, MOE_ERR_INVALID, "string repetition exceeds the %u MiB output limit",
                 (unsigned)(CHAT_TEMPLATE_MAX_OUTPUT >> 20));
        struct jsb b;
        jsb_init(&b, c);
        for (int64_t i = 0; i < k; i++)
            jsb_add(&b, seq.u.s->s, seq.u.s->len);
        return jv_strv(jsb_str(&b));
    }
    if (seq.u.l->n && (uint64_t)k > (CHAT_TEMPLATE_MAX_OUTPUT / 16) / seq.u.l->n)
        jerr(c, line, MOE_ERR_INVALID, "list repetition too large");
    struct jlist *l = jlist_new(c, seq.u.l->kind, 0);
    for (int64_t i = 0; i < k; i++)
        for (size_t j = 0; j < seq.u.l->n; j++)
            jlist_push(c, l, seq.u.l->v[j]);
    struct jv r = {.t = JV_LIST};
    r.u.l = l;
    return r;
}

static bool plain_seq(struct jv v)
{
    return v.t == JV_LIST && (v.u.l->kind == JL_LIST || v.u.l->kind == JL_TUPLE);
}

static struct jv binop(struct jctx *c, int line, int op, struct jv a, struct jv b)
{
    bool num = jv_is_num(a) && jv_is_num(b);
    bool ints = is_intlike(a) && is_intlike(b);
    int64_t r;
    switch (op) {
    case JOP_ADD:
        if (ints) {
            if (__builtin_add_overflow(ival(a), ival(b), &r))
                overflow(c, line);
            return jv_int(r);
        }
        if (num)
            return jv_float(fval(a) + fval(b));
        if (a.t == JV_STR && b.t == JV_STR)
            return jv_strv(jstr_cat(c, a.u.s->s, a.u.s->len, b.u.s->s, b.u.s->len));
        if (plain_seq(a) && plain_seq(b) && a.u.l->kind == b.u.l->kind) {
            struct jlist *l = jlist_new(c, a.u.l->kind, a.u.l->n + b.u.l->n);
            for (size_t i = 0; i < a.u.l->n; i++)
                jlist_push(c, l, a.u.l->v[i]);
            for (size_t i = 0; i < b.u.l->n; i++)
                jlist_push(c, l, b.u.l->v[i]);
            struct jv v = {.t = JV_LIST};
            v.u.l = l;
            return v;
        }
        break;
    case JOP_SUB:
        if (ints) {
            if (__builtin_sub_overflow(ival(a), ival(b), &r))
                overflow(c, line);
            return jv_int(r);
        }
        if (num)
            return jv_float(fval(a) - fval(b));
        break;
    case JOP_MUL:
        if (ints) {
            if (__builtin_mul_overflow(ival(a), ival(b), &r))
                overflow(c, line);
            return jv_int(r);
        }
        if (num)
            return jv_float(fval(a) * fval(b));
        if ((a.t == JV_STR || plain_seq(a)) && is_intlike(b))
            return repeat(c, line, a, ival(b));
        if ((b.t == JV_STR || plain_seq(b)) && is_intlike(a))
            return repeat(c, line, b, ival(a));
        break;
    case JOP_DIV:
        if (num) {
            if (fval(b) == 0)
                jerr(c, line, MOE_ERR_INVALID, "division by zero");
            if (ints)
                return jv_float((double)ival(a) / (double)ival(b));
            return jv_float(fval(a) / fval(b));
        }
        break;
    case JOP_FLOORDIV:
    case JOP_MOD:
        if (ints) {
            int64_t x = ival(a), y = ival(b);
            if (y == 0)
                jerr(c, line, MOE_ERR_INVALID, "integer division or modulo by zero");
            if (x == INT64_MIN && y == -1)
                overflow(c, line);
            int64_t q = x / y, m = x % y;
            if (m != 0 && ((m < 0) != (y < 0))) {
                q--;
                m += y;
            }
            return jv_int(op == JOP_MOD ? m : q);
        }
        if (num) {
            double x = fval(a), y = fval(b);
            if (y == 0)
                jerr(c, line, MOE_ERR_INVALID, "float division or modulo by zero");
            double m = fmod(x, y), div = (x - m) / y;
            if (m != 0) {
                if ((y < 0) != (m < 0)) {
                    m += y;
                    div -= 1.0;
                }
            } else {
                m = copysign(0.0, y);
            }
            if (op == JOP_MOD)
                return jv_float(m);
            double fd;
            if (div != 0) {
                fd = floor(div);
                if (div - fd > 0.5)
                    fd += 1.0;
            } else {
                fd = copysign(0.0, x / y);
            }
            return jv_float(fd);
        }
        if (op == JOP_MOD && a.t == JV_STR)
            jerr(c, line, MOE_ERR_UNSUPPORTED,
                 "printf-style string formatting (%%) is not supported");
        break;
    case JOP_POW:
        if (ints && ival(b) >= 0) {
            int64_t base = ival(a), e = ival(b), acc = 1;
            while (e > 0) {
                if (e & 1)
                    if (__builtin_mul_overflow(acc, base, &acc))
                        overflow(c, line);
                e >>= 1;
                if (e && __builtin_mul_overflow(base, base, &base))
                    overflow(c, line);
            }
            return jv_int(acc);
        }
        if (num) {
            double x = fval(a), y = fval(b);
            if (x == 0 && y < 0)
                jerr(c, line, MOE_ERR_INVALID, "0.0 cannot be raised to a negative power");
            if (x < 0 && y != floor(y))
                jerr(c, line, MOE_ERR_UNSUPPORTED, "a complex result is not supported");
            return jv_float(pow(x, y));
        }
        break;
    }
    bad_operands(c, line, op, a, b);
}

/* ---- calls ------------------------------------------------------------------------ */

static void eval_args(struct jctx *c, const struct jnode *e, struct jscope *sc, struct jargs *a)
{
    a->n_pos = e->n_items;
    a->pos = e->n_items ? jalloc(c, (size_t)e->n_items * sizeof(*a->pos)) : NULL;
    for (int i = 0; i < e->n_items; i++)
        a->pos[i] = jinja_eval(c, e->items[i], sc);
    a->n_kw = e->n_kw;
    a->kwn = e->kwn;
    a->kwv = e->n_kw ? jalloc(c, (size_t)e->n_kw * sizeof(*a->kwv)) : NULL;
    for (int i = 0; i < e->n_kw; i++)
        a->kwv[i] = jinja_eval(c, e->kwv[i], sc);
}

struct jv jinja_call_macro(struct jctx *c, int line, struct jmacro *m, int n_pos,
                           const struct jv *pos, int n_kw, const char **kwn, const struct jv *kwv)
{
    const struct jnode *def = m->def;
    if (c->depth >= CHAT_TEMPLATE_MAX_DEPTH)
        jerr(c, line, MOE_ERR_INVALID, "macro calls nest deeper than %d (the limit)",
             CHAT_TEMPLATE_MAX_DEPTH);
    jstep(c, line, 1);
    if (n_pos > def->n_kw)
        jerr(c, line, MOE_ERR_INVALID, "macro '%s' takes not more than %d argument(s)", def->name,
             def->n_kw);
    struct jscope *sc = scope_new(c, m->scope);
    for (int k = 0; k < n_kw; k++) {
        int i;
        for (i = 0; i < def->n_kw; i++)
            if (!strcmp(def->kwn[i], kwn[k]))
                break;
        if (i == def->n_kw)
            jerr(c, line, MOE_ERR_INVALID, "macro '%s' takes no keyword argument '%s'", def->name,
                 kwn[k]);
        if (i < n_pos)
            jerr(c, line, MOE_ERR_INVALID, "macro '%s' got multiple values for argument '%s'",
                 def->name, kwn[k]);
    }
    for (int i = 0; i < def->n_kw; i++) {
        struct jv v;
        bool got = false;
        if (i < n_pos) {
            v = pos[i];
            got = true;
        }
        for (int k = 0; k < n_kw && !got; k++)
            if (!strcmp(def->kwn[i], kwn[k])) {
                v = kwv[k];
                got = true;
            }
        if (!got)
            v = def->kwv[i] ? jinja_eval(c, def->kwv[i], sc) : jv_undef(def->kwn[i]);
        jinja_scope_set(c, sc, def->kwn[i], v);
    }
    jinja_frame_start(c, sc, def->b);
    c->depth++;
    out_push(c, line);
    jinja_exec(c, def->b, sc);
    c->depth--;
    return jv_strv(out_pop(c));
}

static struct jv eval_call(struct jctx *c, const struct jnode *e, struct jscope *sc)
{
    struct jv f = e->a->kind == JE_NAME ? lookup(sc, e->a->name) : jinja_eval(c, e->a, sc);
    struct jargs a;
    eval_args(c, e, sc, &a);
    switch (f.t) {
    case JV_FUNC: return jinja_func(c, e->line, f.u.func, &a);
    case JV_MACRO:
        return jinja_call_macro(c, e->line, f.u.macro, a.n_pos, a.pos, a.n_kw, a.kwn, a.kwv);
    case JV_METHOD: return jinja_method(c, e->line, f.u.m, &a);
    case JV_UNDEF: undefined_error(c, e->line, f);
    default: jerr(c, e->line, MOE_ERR_INVALID, "'%s' object is not callable", jv_type_name(f));
    }
}

/* ---- expressions ------------------------------------------------------------------- */

static void frame_enter(struct jctx *c, int line)
{
    if (++c->nest > JINJA_MAX_FRAMES)
        jerr(c, line, MOE_ERR_INVALID, "evaluation nests deeper than %d frames (the limit)",
             JINJA_MAX_FRAMES);
}

struct jv jinja_eval(struct jctx *c, const struct jnode *e, struct jscope *sc)
{
    frame_enter(c, e->line);
    struct jv r;
    switch (e->kind) {
    case JE_CONST: r = e->val; break;
    case JE_NAME: r = lookup(sc, e->name); break;
    case JE_ATTR: r = jinja_getattr(c, e->line, jinja_eval(c, e->a, sc), e->name); break;
    case JE_ITEM:
        r = jinja_getitem(c, e->line, jinja_eval(c, e->a, sc), jinja_eval(c, e->b, sc));
        break;
    case JE_SLICE: {
        struct jv obj = jinja_eval(c, e->a, sc);
        struct jv v[3], *p[3] = {NULL, NULL, NULL};
        const struct jnode *parts[3] = {e->b, e->c, e->d};
        for (int i = 0; i < 3; i++)
            if (parts[i]) {
                v[i] = jinja_eval(c, parts[i], sc);
                p[i] = &v[i];
            }
        r = do_slice(c, e->line, obj, p);
        break;
    }
    case JE_CALL: r = eval_call(c, e, sc); break;
    case JE_FILTER: {
        struct jv in = jinja_eval(c, e->a, sc);
        struct jargs a;
        eval_args(c, e, sc, &a);
        r = jinja_filter(c, e->line, e->op, in, &a);
        break;
    }
    case JE_TEST: {
        struct jv in = jinja_eval(c, e->a, sc);
        struct jargs a;
        eval_args(c, e, sc, &a);
        r = jv_bool(jinja_test(c, e->line, e->op, in, &a));
        break;
    }
    case JE_BIN:
        r = binop(c, e->line, e->op, jinja_eval(c, e->a, sc), jinja_eval(c, e->b, sc));
        break;
    case JE_CONCAT: {
        struct jsb b;
        jsb_init(&b, c);
        for (int i = 0; i < e->n_items; i++)
            jv_write_str(&b, e->line, jinja_eval(c, e->items[i], sc));
        r = jv_strv(jsb_str(&b));
        break;
    }
    case JE_NEG:
    case JE_POS: {
        struct jv v = jinja_eval(c, e->a, sc);
        if (v.t == JV_FLOAT)
            r = jv_float(e->kind == JE_NEG ? -v.u.f : v.u.f);
        else if (is_intlike(v)) {
            int64_t x = ival(v);
            if (e->kind == JE_NEG && x == INT64_MIN)
                overflow(c, e->line);
            r = jv_int(e->kind == JE_NEG ? -x : x);
        } else if (v.t == JV_UNDEF) {
            undefined_error(c, e->line, v);
        } else {
            jerr(c, e->line, MOE_ERR_INVALID, "bad operand type for unary %s: '%s'",
                 e->kind == JE_NEG ? "-" : "+", jv_type_name(v));
        }
        break;
    }
    case JE_NOT: r = jv_bool(!jv_truthy(jinja_eval(c, e->a, sc))); break;
    case JE_AND: {
        struct jv a = jinja_eval(c, e->a, sc);
        r = jv_truthy(a) ? jinja_eval(c, e->b, sc) : a;
        break;
    }
    case JE_OR: {
        struct jv a = jinja_eval(c, e->a, sc);
        r = jv_truthy(a) ? a : jinja_eval(c, e->b, sc);
        break;
    }
    case JE_CMP: {
        struct jv left = jinja_eval(c, e->a, sc);
        r = jv_bool(true);
        for (int i = 0; i < e->n_items; i++) {
            struct jv right = jinja_eval(c, e->items[i], sc);
            bool ok;
            switch (e->ops[i]) {
            case JCMP_EQ: ok = jv_eq(left, right); break;
            case JCMP_NE: ok = !jv_eq(left, right); break;
            case JCMP_LT: ok = jv_cmp(c, e->line, left, right) == -1; break;
            case JCMP_LE: ok = jcmp_le(jv_cmp(c, e->line, left, right)); break;
            case JCMP_GT: ok = jv_cmp(c, e->line, left, right) == 1; break;
            case JCMP_GE: ok = jcmp_ge(jv_cmp(c, e->line, left, right)); break;
            case JCMP_IN: ok = jinja_in(c, e->line, left, right); break;
            default: ok = !jinja_in(c, e->line, left, right); break;
            }
            if (!ok) {
                r = jv_bool(false);
                break;
            }
            left = right;
        }
        break;
    }
    case JE_COND:
        if (jv_truthy(jinja_eval(c, e->b, sc)))
            r = jinja_eval(c, e->a, sc);
        else
            r = e->c ? jinja_eval(c, e->c, sc) : jv_undef(NULL);
        break;
    case JE_LIST:
    case JE_TUPLE: {
        struct jlist *l = jlist_new(c, e->kind == JE_LIST ? JL_LIST : JL_TUPLE, (size_t)e->n_items);
        for (int i = 0; i < e->n_items; i++)
            jlist_push(c, l, jinja_eval(c, e->items[i], sc));
        r.t = JV_LIST;
        r.u.l = l;
        break;
    }
    case JE_DICT: {
        struct jdict *d = jdict_new(c, (size_t)e->n_items / 2);
        for (int i = 0; i + 1 < e->n_items; i += 2) {
            struct jv k = jinja_eval(c, e->items[i], sc);
            if (!hashable(k))
                jerr(c, e->line, MOE_ERR_INVALID, "unhashable type: '%s'", jv_type_name(k));
            jdict_set(c, d, k, jinja_eval(c, e->items[i + 1], sc));
        }
        r.t = JV_DICT;
        r.u.d = d;
        break;
    }
    default: jerr(c, e->line, MOE_ERR_INTERNAL, "bad expression node %d", e->kind);
    }
    c->nest--;
    return r;
}

/* ---- statements ------------------------------------------------------------------------ */

static void assign_targets(struct jctx *c, int line, struct jscope *sc, const char **names, int n,
                           struct jv v)
{
    if (n == 1) {
        jinja_scope_set(c, sc, names[0], v);
        return;
    }
    struct jlist *items = jinja_iter(c, line, v);
    if (items->kind == JL_GEN || items->kind == JL_REVITER || (int)items->n != n) {
        if ((int)items->n < n)
            jerr(c, line, MOE_ERR_INVALID, "not enough values to unpack (expected %d, got %zu)", n,
                 items->n);
        if ((int)items->n > n)
            jerr(c, line, MOE_ERR_INVALID, "too many values to unpack (expected %d)", n);
    }
    for (int i = 0; i < n; i++)
        jinja_scope_set(c, sc, names[i], items->v[i]);
}

static void exec_for(struct jctx *c, const struct jnode *n, struct jscope *sc)
{
    struct jlist *items = jinja_iter(c, n->line, jinja_eval(c, n->a, sc));
    if (n->d) {
        struct jlist *kept = jlist_new(c, JL_LIST, items->n);
        struct jscope *fs = scope_new(c, sc);
        for (size_t i = 0; i < items->n; i++) {
            jstep(c, n->line, 1);
            fs->n = 0;
            assign_targets(c, n->line, fs, n->names, n->n_names, items->v[i]);
            if (jv_truthy(jinja_eval(c, n->d, fs)))
                jlist_push(c, kept, items->v[i]);
        }
        items = kept;
    }
    /* jinja2 runs the else block unless an iteration reached the end of the
     * body: an empty loop, or one whose every iteration broke or continued */
    bool completed = false;
    if (items->n) {
        struct jloop *L = jalloc(c, sizeof(*L));
        L->items = items;
        struct jv lv = {.t = JV_LOOP};
        lv.u.loop = L;
        struct jscope *it = scope_new(c, sc);
        for (size_t i = 0; i < items->n; i++) {
            jstep(c, n->line, 1);
            L->index0 = i;
            it->n = 0;
            assign_targets(c, n->line, it, n->names, n->n_names, items->v[i]);
            jinja_scope_set(c, it, "loop", lv);
            jinja_frame_start(c, it, n->b);
            jinja_exec(c, n->b, it);
            if (!c->brk) {
                completed = true;
                continue;
            }
            bool stop = c->brk == 1;
            c->brk = 0;
            if (stop)
                break;
        }
    }
    if (!completed && n->c) { /* the else block has its own scope too */
        struct jscope *es = scope_new(c, sc);
        jinja_frame_start(c, es, n->c);
        jinja_exec(c, n->c, es);
    }
}

void jinja_exec(struct jctx *c, const struct jnode *n, struct jscope *sc)
{
    frame_enter(c, n->line);
    switch (n->kind) {
    case JN_BODY:
        for (int i = 0; i < n->n_items && !c->brk; i++)
            jinja_exec(c, n->items[i], sc);
        break;
    case JN_TEXT: out_write(c, n->line, n->val.u.s->s, n->val.u.s->len); break;
    case JN_OUTPUT: {
        struct jv v = jinja_eval(c, n->a, sc);
        if (v.t == JV_STR) {
            out_write(c, n->line, v.u.s->s, v.u.s->len);
        } else {
            const struct jstr *s = jv_to_str(c, n->line, v);
            out_write(c, n->line, s->s, s->len);
        }
        break;
    }
    case JN_IF:
        if (jv_truthy(jinja_eval(c, n->a, sc)))
            jinja_exec(c, n->b, sc);
        else if (n->c)
            jinja_exec(c, n->c, sc);
        break;
    case JN_FOR: exec_for(c, n, sc); break;
    case JN_SET: {
        struct jv v = jinja_eval(c, n->a, sc);
        if (n->op == 1) {
            struct jv *ns = scope_find(sc, n->names[0]);
            if (!ns || ns->t != JV_NS)
                jerr(c, n->line, MOE_ERR_INVALID,
                     "cannot assign attribute '%s' on '%s': not a namespace object", n->name,
                     n->names[0]);
            if (n->name[0] == '_')
                jerr(c, n->line, MOE_ERR_INVALID,
                     "namespace attributes cannot start with '_' ('%s')", n->name);
            jdict_set(c, ns->u.d, jv_cstr(c, n->name), v);
        } else {
            assign_targets(c, n->line, sc, n->names, n->n_names, v);
        }
        break;
    }
    case JN_SETBLOCK: {
        out_push(c, n->line);
        struct jscope *bs = scope_new(c, sc); /* the body has its own scope */
        jinja_frame_start(c, bs, n->b);
        jinja_exec(c, n->b, bs);
        struct jv v = jv_strv(out_pop(c));
        for (int i = 0; i < n->n_items; i++) {
            const struct jnode *f = n->items[i];
            struct jargs a;
            eval_args(c, f, sc, &a);
            v = jinja_filter(c, f->line, f->op, v, &a);
        }
        jinja_scope_set(c, sc, n->names[0], v);
        break;
    }
    case JN_MACRO: {
        struct jmacro *m = jalloc(c, sizeof(*m));
        m->def = n;
        m->scope = sc;
        struct jv v = {.t = JV_MACRO};
        v.u.macro = m;
        jinja_scope_set(c, sc, n->name, v);
        break;
    }
    case JN_SCOPE: {
        struct jscope *bs = scope_new(c, sc);
        jinja_frame_start(c, bs, n->b);
        jinja_exec(c, n->b, bs);
        break;
    }
    case JN_BREAK: c->brk = 1; break;
    case JN_CONTINUE: c->brk = 2; break;
    default: jerr(c, n->line, MOE_ERR_INTERNAL, "bad statement node %d", n->kind);
    }
    c->nest--;
}
