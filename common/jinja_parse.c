/* Tokens -> tree, following jinja2's parser (parser.py) rule for rule, so
 * that precedence and associativity match: filters and tests bind to the
 * unary expression before them (`a + b|f` is `a + (b|f)`, `not x is y` is
 * `not (x is y)`), `**` is left-associative, `~` sits between + and *.
 *
 * Everything the interpreter does not implement is an error here, never at
 * render time: unknown tags, filters, tests, functions and methods. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "jinja_internal.h"

struct parser {
    const struct jtoken *tok;
    size_t n_tok, pos;
    const char *name;
    struct jarena *arena;
    struct moe_error *err;
    jmp_buf jmp;
    int nest;
    int in_loop;  /* for loops open around the current statement (macros reset it) */
    int in_macro; /* macro bodies open */
    /* calls of names that must be macros, checked once all macros are known */
    const char **calls;
    int *call_lines;
    int n_calls, cap_calls;
    const char **macros;
    int n_macros, cap_macros;
};

static _Noreturn void perr(struct parser *P, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static _Noreturn void perr(struct parser *P, int line, const char *fmt, ...)
{
    char msg[MOE_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    moe_error_set(P->err, MOE_ERR_FORMAT, "%s:%d: %s", P->name, line, msg);
    longjmp(P->jmp, 1);
}

static void *palloc(struct parser *P, size_t n)
{
    void *p = jarena_alloc(P->arena, n);
    if (!p) {
        moe_error_set(P->err, MOE_ERR_NOMEM, "%s: out of memory", P->name);
        longjmp(P->jmp, 1);
    }
    return p;
}

static const struct jtoken *cur(struct parser *P)
{
    return &P->tok[P->pos];
}

static const struct jtoken *peek(struct parser *P, size_t k)
{
    size_t i = P->pos + k;
    return &P->tok[i < P->n_tok ? i : P->n_tok - 1];
}

static void next(struct parser *P)
{
    if (P->pos + 1 < P->n_tok)
        P->pos++;
}

static bool is_op(const struct jtoken *t, const char *op)
{
    return t->type == JT_OP && strcmp(t->str, op) == 0;
}

static bool is_name(const struct jtoken *t, const char *name)
{
    return t->type == JT_NAME && strcmp(t->str, name) == 0;
}

static const char *describe(const struct jtoken *t, char *buf, size_t n)
{
    switch (t->type) {
    case JT_EOF: return "end of template";
    case JT_DATA: return "template text";
    case JT_VAR_BEGIN: return "'{{'";
    case JT_VAR_END: return "'}}'";
    case JT_BLOCK_BEGIN: return "'{%'";
    case JT_BLOCK_END: return "'%}'";
    case JT_STRING: return "a string";
    case JT_INT:
    case JT_FLOAT: return "a number";
    default: snprintf(buf, n, "'%s'", t->str); return buf;
    }
}

static _Noreturn void unexpected(struct parser *P, const char *wanted)
{
    char buf[80];
    perr(P, cur(P)->line, "expected %s, got %s", wanted, describe(cur(P), buf, sizeof(buf)));
}

static void expect_op(struct parser *P, const char *op)
{
    if (!is_op(cur(P), op)) {
        char w[16];
        snprintf(w, sizeof(w), "'%s'", op);
        unexpected(P, w);
    }
    next(P);
}

static const char *expect_name(struct parser *P)
{
    if (cur(P)->type != JT_NAME)
        unexpected(P, "a name");
    const char *s = cur(P)->str;
    next(P);
    return s;
}

static void expect_block_end(struct parser *P)
{
    if (cur(P)->type != JT_BLOCK_END)
        unexpected(P, "end of statement '%}'");
    next(P);
}

static struct jnode *node(struct parser *P, int kind, int line)
{
    struct jnode *n = palloc(P, sizeof(*n));
    n->kind = kind;
    n->line = line;
    return n;
}

/* A growable array of node pointers while parsing. */
struct nvec {
    struct jnode **v;
    int n, cap;
};

static void nvec_push(struct parser *P, struct nvec *a, struct jnode *x)
{
    if (a->n == a->cap) {
        int cap = a->cap ? 2 * a->cap : 8;
        struct jnode **nv = palloc(P, (size_t)cap * sizeof(*nv));
        if (a->n)
            memcpy(nv, a->v, (size_t)a->n * sizeof(*nv));
        a->v = nv;
        a->cap = cap;
    }
    a->v[a->n++] = x;
}

static void enter(struct parser *P, int line)
{
    if (++P->nest > CHAT_TEMPLATE_MAX_NEST)
        perr(P, line, "template nests deeper than %d (the limit)", CHAT_TEMPLATE_MAX_NEST);
}

static void leave(struct parser *P)
{
    P->nest--;
}

/* Loops that wrap the node built so far (a + b + c, x|f|g, a.b.c) make the
 * tree one level deeper per turn: each turn counts as a nesting level,
 * released by leave_n() when the loop ends, so no tree is deeper than
 * CHAT_TEMPLATE_MAX_NEST and every walk over it stays shallow. */
static void leave_n(struct parser *P, int n)
{
    P->nest -= n;
}

static void note_call(struct parser *P, const char *name, int line)
{
    if (P->n_calls == P->cap_calls) {
        int cap = P->cap_calls ? 2 * P->cap_calls : 16;
        const char **nc = palloc(P, (size_t)cap * sizeof(*nc));
        int *nl = palloc(P, (size_t)cap * sizeof(*nl));
        if (P->n_calls) {
            memcpy(nc, P->calls, (size_t)P->n_calls * sizeof(*nc));
            memcpy(nl, P->call_lines, (size_t)P->n_calls * sizeof(*nl));
        }
        P->calls = nc;
        P->call_lines = nl;
        P->cap_calls = cap;
    }
    P->calls[P->n_calls] = name;
    P->call_lines[P->n_calls] = line;
    P->n_calls++;
}

static void note_macro(struct parser *P, const char *name)
{
    if (P->n_macros == P->cap_macros) {
        int cap = P->cap_macros ? 2 * P->cap_macros : 8;
        const char **nm = palloc(P, (size_t)cap * sizeof(*nm));
        if (P->n_macros)
            memcpy(nm, P->macros, (size_t)P->n_macros * sizeof(*nm));
        P->macros = nm;
        P->cap_macros = cap;
    }
    P->macros[P->n_macros++] = name;
}

/* ---- expressions ------------------------------------------------------------ */

static struct jnode *parse_expression(struct parser *P, bool with_condexpr);
static struct jnode *parse_unary(struct parser *P, bool with_filter);
static struct jnode *parse_or(struct parser *P);

/* Call arguments after '(' (consumed here): positional then keyword. */
static void parse_call_args(struct parser *P, struct jnode *n)
{
    expect_op(P, "(");
    struct nvec args = {0}, kwv = {0};
    const char **kwn = NULL;
    int cap_kwn = 0;
    while (!is_op(cur(P), ")")) {
        if (args.n || kwv.n) {
            expect_op(P, ",");
            if (is_op(cur(P), ")"))
                break;
        }
        if (is_op(cur(P), "*") || is_op(cur(P), "**"))
            perr(P, cur(P)->line, "*args and **kwargs in calls are not supported");
        if (cur(P)->type == JT_NAME && is_op(peek(P, 1), "=")) {
            const char *key = cur(P)->str;
            next(P);
            next(P);
            struct jnode *v = parse_expression(P, true);
            if (kwv.n == cap_kwn) {
                int cap = cap_kwn ? 2 * cap_kwn : 4;
                const char **nk = palloc(P, (size_t)cap * sizeof(*nk));
                if (kwv.n)
                    memcpy(nk, kwn, (size_t)kwv.n * sizeof(*nk));
                kwn = nk;
                cap_kwn = cap;
            }
            kwn[kwv.n] = key;
            nvec_push(P, &kwv, v);
        } else {
            if (kwv.n)
                perr(P, cur(P)->line, "positional argument after a keyword argument");
            nvec_push(P, &args, parse_expression(P, true));
        }
    }
    expect_op(P, ")");
    n->items = args.v;
    n->n_items = args.n;
    n->kwn = kwn;
    n->kwv = kwv.v;
    n->n_kw = kwv.n;
}

/* map('filter'), select('test'), selectattr('a', 'test'): names checked now. */
static void check_named_callable(struct parser *P, struct jnode *f)
{
    const char *fname = jinja_filter_name(f->op);
    int test_arg = -1;
    bool filter_arg = false;
    if (!strcmp(fname, "select") || !strcmp(fname, "reject"))
        test_arg = 0;
    else if (!strcmp(fname, "selectattr") || !strcmp(fname, "rejectattr"))
        test_arg = 1;
    else if (!strcmp(fname, "map"))
        filter_arg = f->n_kw == 0 || strcmp(f->kwn[0], "attribute") != 0;
    if (filter_arg && f->n_items > 0 && f->items[0]->kind == JE_CONST &&
        f->items[0]->val.t == JV_STR) {
        const char *name = f->items[0]->val.u.s->s;
        if (jinja_filter_lookup(name) < 0)
            perr(P, f->line, "unknown filter '%s' (in map)", name);
    }
    if (test_arg >= 0 && f->n_items > test_arg && f->items[test_arg]->kind == JE_CONST &&
        f->items[test_arg]->val.t == JV_STR) {
        const char *name = f->items[test_arg]->val.u.s->s;
        if (jinja_test_lookup(name) < 0)
            perr(P, f->line, "unknown test '%s' (in %s)", name, fname);
    }
}

/* `| name(args) | name ...`; in == NULL for a block set's filters. */
static struct jnode *parse_filter(struct parser *P, struct jnode *in, bool start_inline)
{
    int depth = 0;
    while (is_op(cur(P), "|") || start_inline) {
        enter(P, cur(P)->line);
        depth++;
        if (!start_inline)
            next(P);
        start_inline = false;
        int line = cur(P)->line;
        const char *name = expect_name(P);
        if (is_op(cur(P), "."))
            perr(P, line, "unknown filter '%s.%s'", name, peek(P, 1)->str ? peek(P, 1)->str : "");
        int id = jinja_filter_lookup(name);
        if (id < 0)
            perr(P, line, "unknown filter '%s'", name);
        struct jnode *f = node(P, JE_FILTER, line);
        f->a = in;
        f->name = name;
        f->op = id;
        if (is_op(cur(P), "("))
            parse_call_args(P, f);
        check_named_callable(P, f);
        in = f;
    }
    leave_n(P, depth);
    return in;
}

static struct jnode *parse_primary(struct parser *P);
static struct jnode *parse_postfix(struct parser *P, struct jnode *n);

static struct jnode *parse_test(struct parser *P, struct jnode *in)
{
    int line = cur(P)->line;
    next(P); /* 'is' */
    bool negated = false;
    if (is_name(cur(P), "not")) {
        next(P);
        negated = true;
    }
    const char *name = expect_name(P);
    if (is_op(cur(P), "."))
        perr(P, line, "unknown test '%s.%s'", name, peek(P, 1)->str ? peek(P, 1)->str : "");
    int id = jinja_test_lookup(name);
    if (id < 0)
        perr(P, line, "unknown test '%s'", name);
    struct jnode *t = node(P, JE_TEST, line);
    t->a = in;
    t->name = name;
    t->op = id;
    const struct jtoken *c = cur(P);
    if (is_op(c, "(")) {
        parse_call_args(P, t);
    } else if ((c->type == JT_NAME || c->type == JT_STRING || c->type == JT_INT ||
                c->type == JT_FLOAT || is_op(c, "[") || is_op(c, "{")) &&
               !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
        if (is_name(c, "is"))
            perr(P, c->line, "cannot chain multiple tests with 'is'");
        struct jnode *arg = parse_postfix(P, parse_primary(P));
        t->items = palloc(P, sizeof(*t->items));
        t->items[0] = arg;
        t->n_items = 1;
    }
    if (negated) {
        struct jnode *n = node(P, JE_NOT, line);
        n->a = t;
        return n;
    }
    return t;
}

static struct jnode *parse_subscribed(struct parser *P)
{
    int line = cur(P)->line;
    struct jnode *parts[3] = {NULL, NULL, NULL};
    if (is_op(cur(P), ":")) {
        next(P);
    } else {
        struct jnode *e = parse_expression(P, true);
        if (!is_op(cur(P), ":"))
            return e;
        next(P);
        parts[0] = e;
    }
    if (is_op(cur(P), ":")) {
        /* stop omitted */
    } else if (!is_op(cur(P), "]") && !is_op(cur(P), ",")) {
        parts[1] = parse_expression(P, true);
    }
    if (is_op(cur(P), ":")) {
        next(P);
        if (!is_op(cur(P), "]") && !is_op(cur(P), ","))
            parts[2] = parse_expression(P, true);
    }
    struct jnode *s = node(P, JE_SLICE, line);
    s->b = parts[0];
    s->c = parts[1];
    s->d = parts[2];
    s->op = 1; /* marks "a slice object" until attached */
    return s;
}

static struct jnode *parse_subscript(struct parser *P, struct jnode *obj)
{
    const struct jtoken *t = cur(P);
    int line = t->line;
    next(P);
    if (is_op(t, ".")) {
        const struct jtoken *a = cur(P);
        if (a->type == JT_NAME) {
            next(P);
            struct jnode *n = node(P, JE_ATTR, line);
            n->a = obj;
            n->name = a->str;
            return n;
        }
        if (a->type != JT_INT)
            unexpected(P, "a name or number after '.'");
        next(P);
        struct jnode *k = node(P, JE_CONST, line);
        k->val = jv_int(a->ival);
        struct jnode *n = node(P, JE_ITEM, line);
        n->a = obj;
        n->b = k;
        return n;
    }
    struct nvec args = {0};
    while (!is_op(cur(P), "]")) {
        if (args.n)
            expect_op(P, ",");
        nvec_push(P, &args, parse_subscribed(P));
    }
    expect_op(P, "]");
    if (args.n == 0)
        perr(P, line, "empty subscript []");
    if (args.n == 1 && args.v[0]->kind == JE_SLICE && args.v[0]->op == 1) {
        struct jnode *s = args.v[0];
        s->op = 0;
        s->a = obj;
        return s;
    }
    struct jnode *key = args.v[0];
    if (args.n > 1) {
        key = node(P, JE_TUPLE, line);
        key->items = args.v;
        key->n_items = args.n;
    }
    for (int i = 0; i < args.n; i++)
        if (args.v[i]->kind == JE_SLICE && args.v[i]->op == 1)
            perr(P, line, "slices inside a tuple subscript are not supported");
    struct jnode *n = node(P, JE_ITEM, line);
    n->a = obj;
    n->b = key;
    return n;
}

static struct jnode *parse_call(struct parser *P, struct jnode *callee)
{
    int line = cur(P)->line;
    struct jnode *n = node(P, JE_CALL, line);
    n->a = callee;
    parse_call_args(P, n);
    if (callee->kind == JE_NAME) {
        if (jinja_func_lookup(callee->name) < 0)
            note_call(P, callee->name, line); /* must be a macro */
    } else if (callee->kind == JE_ATTR) {
        if (jinja_method_lookup(callee->name) < 0)
            perr(P, line, "unknown method '%s'", callee->name);
    } else {
        perr(P, line, "only functions, macros and methods can be called");
    }
    return n;
}

static struct jnode *parse_postfix(struct parser *P, struct jnode *n)
{
    int depth = 0;
    for (;; depth++) {
        enter(P, cur(P)->line);
        if (is_op(cur(P), ".") || is_op(cur(P), "["))
            n = parse_subscript(P, n);
        else if (is_op(cur(P), "("))
            n = parse_call(P, n);
        else
            break;
    }
    leave_n(P, depth + 1);
    return n;
}

static struct jnode *parse_filter_expr(struct parser *P, struct jnode *n)
{
    int depth = 0;
    for (;; depth++) {
        enter(P, cur(P)->line);
        if (is_op(cur(P), "|"))
            n = parse_filter(P, n, false);
        else if (is_name(cur(P), "is"))
            n = parse_test(P, n);
        else if (is_op(cur(P), "("))
            n = parse_call(P, n);
        else
            break;
    }
    leave_n(P, depth + 1);
    return n;
}

/* Comma-separated expressions: one, or a tuple. `simplified`: primaries
 * only; `with_condexpr`: allow `a if b else c`. Ends at %}, }}, ) or the
 * names in `end_names` (NULL-terminated). */
static struct jnode *parse_tuple(struct parser *P, bool with_condexpr, const char *const *end_names,
                                 bool explicit_parens)
{
    int line = cur(P)->line;
    struct nvec args = {0};
    bool is_tuple = false;
    for (;;) {
        if (args.n)
            expect_op(P, ",");
        const struct jtoken *t = cur(P);
        bool end = t->type == JT_VAR_END || t->type == JT_BLOCK_END || is_op(t, ")");
        for (int i = 0; end_names && end_names[i] && !end; i++)
            end = is_name(t, end_names[i]);
        if (end)
            break;
        nvec_push(P, &args, parse_expression(P, with_condexpr));
        if (is_op(cur(P), ","))
            is_tuple = true;
        else
            break;
    }
    if (!is_tuple) {
        if (args.n)
            return args.v[0];
        if (!explicit_parens)
            unexpected(P, "an expression");
    }
    struct jnode *n = node(P, JE_TUPLE, line);
    n->items = args.v;
    n->n_items = args.n;
    return n;
}

static struct jnode *parse_primary(struct parser *P)
{
    const struct jtoken *t = cur(P);
    int line = t->line;
    enter(P, line);
    struct jnode *n;
    if (t->type == JT_NAME) {
        next(P);
        if (!strcmp(t->str, "true") || !strcmp(t->str, "True") || !strcmp(t->str, "false") ||
            !strcmp(t->str, "False")) {
            n = node(P, JE_CONST, line);
            n->val = jv_bool(t->str[0] == 't' || t->str[0] == 'T');
        } else if (!strcmp(t->str, "none") || !strcmp(t->str, "None")) {
            n = node(P, JE_CONST, line);
            n->val = jv_none();
        } else {
            n = node(P, JE_NAME, line);
            n->name = t->str;
        }
    } else if (t->type == JT_STRING) {
        /* adjacent literals concatenate */
        size_t total = 0, k = 0;
        while (peek(P, k)->type == JT_STRING)
            total += peek(P, k++)->len;
        struct jstr *s = palloc(P, sizeof(*s) + total + 1);
        size_t o = 0;
        while (cur(P)->type == JT_STRING) {
            memcpy(s->s + o, cur(P)->str, cur(P)->len);
            o += cur(P)->len;
            next(P);
        }
        s->s[o] = 0;
        s->len = o;
        n = node(P, JE_CONST, line);
        n->val = jv_strv(s);
    } else if (t->type == JT_INT || t->type == JT_FLOAT) {
        next(P);
        n = node(P, JE_CONST, line);
        n->val = t->type == JT_INT ? jv_int(t->ival) : jv_float(t->fval);
    } else if (is_op(t, "(")) {
        next(P);
        n = parse_tuple(P, true, NULL, true);
        expect_op(P, ")");
    } else if (is_op(t, "[")) {
        next(P);
        struct nvec items = {0};
        while (!is_op(cur(P), "]")) {
            if (items.n)
                expect_op(P, ",");
            if (is_op(cur(P), "]"))
                break;
            nvec_push(P, &items, parse_expression(P, true));
        }
        expect_op(P, "]");
        n = node(P, JE_LIST, line);
        n->items = items.v;
        n->n_items = items.n;
    } else if (is_op(t, "{")) {
        next(P);
        struct nvec items = {0};
        while (!is_op(cur(P), "}")) {
            if (items.n)
                expect_op(P, ",");
            if (is_op(cur(P), "}"))
                break;
            nvec_push(P, &items, parse_expression(P, true));
            expect_op(P, ":");
            nvec_push(P, &items, parse_expression(P, true));
        }
        expect_op(P, "}");
        n = node(P, JE_DICT, line);
        n->items = items.v;
        n->n_items = items.n;
    } else {
        unexpected(P, "an expression");
    }
    leave(P);
    return n;
}

static struct jnode *parse_unary(struct parser *P, bool with_filter)
{
    const struct jtoken *t = cur(P);
    int line = t->line;
    enter(P, line);
    struct jnode *n;
    if (is_op(t, "-") || is_op(t, "+")) {
        next(P);
        n = node(P, is_op(t, "-") ? JE_NEG : JE_POS, line);
        n->a = parse_unary(P, false);
    } else {
        n = parse_primary(P);
    }
    n = parse_postfix(P, n);
    if (with_filter)
        n = parse_filter_expr(P, n);
    leave(P);
    return n;
}

static struct jnode *binop(struct parser *P, int op, struct jnode *a, struct jnode *b, int line)
{
    struct jnode *n = node(P, JE_BIN, line);
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static struct jnode *parse_pow(struct parser *P)
{
    struct jnode *left = parse_unary(P, true);
    int depth = 0;
    while (is_op(cur(P), "**")) {
        int line = cur(P)->line;
        enter(P, line);
        depth++;
        next(P);
        left = binop(P, JOP_POW, left, parse_unary(P, true), line);
    }
    leave_n(P, depth);
    return left;
}

static struct jnode *parse_math2(struct parser *P)
{
    struct jnode *left = parse_pow(P);
    for (int depth = 0;; depth++) {
        const struct jtoken *t = cur(P);
        int op = is_op(t, "*")    ? JOP_MUL
                 : is_op(t, "/")  ? JOP_DIV
                 : is_op(t, "//") ? JOP_FLOORDIV
                 : is_op(t, "%")  ? JOP_MOD
                                  : -1;
        if (op < 0) {
            leave_n(P, depth);
            return left;
        }
        enter(P, t->line);
        next(P);
        left = binop(P, op, left, parse_pow(P), t->line);
    }
}

static struct jnode *parse_concat(struct parser *P)
{
    int line = cur(P)->line;
    struct jnode *first = parse_math2(P);
    if (!is_op(cur(P), "~"))
        return first;
    struct nvec items = {0};
    nvec_push(P, &items, first);
    while (is_op(cur(P), "~")) {
        next(P);
        nvec_push(P, &items, parse_math2(P));
    }
    struct jnode *n = node(P, JE_CONCAT, line);
    n->items = items.v;
    n->n_items = items.n;
    return n;
}

static struct jnode *parse_math1(struct parser *P)
{
    struct jnode *left = parse_concat(P);
    for (int depth = 0;; depth++) {
        const struct jtoken *t = cur(P);
        int op = is_op(t, "+") ? JOP_ADD : is_op(t, "-") ? JOP_SUB : -1;
        if (op < 0) {
            leave_n(P, depth);
            return left;
        }
        enter(P, t->line);
        next(P);
        left = binop(P, op, left, parse_concat(P), t->line);
    }
}

static struct jnode *parse_compare(struct parser *P)
{
    int line = cur(P)->line;
    struct jnode *first = parse_math1(P);
    struct nvec rhs = {0};
    int *ops = NULL, cap_ops = 0;
    for (;;) {
        const struct jtoken *t = cur(P);
        int op;
        if (is_op(t, "=="))
            op = JCMP_EQ;
        else if (is_op(t, "!="))
            op = JCMP_NE;
        else if (is_op(t, "<"))
            op = JCMP_LT;
        else if (is_op(t, "<="))
            op = JCMP_LE;
        else if (is_op(t, ">"))
            op = JCMP_GT;
        else if (is_op(t, ">="))
            op = JCMP_GE;
        else if (is_name(t, "in"))
            op = JCMP_IN;
        else if (is_name(t, "not") && is_name(peek(P, 1), "in")) {
            op = JCMP_NOTIN;
            next(P);
        } else
            break;
        next(P);
        if (rhs.n == cap_ops) {
            int cap = cap_ops ? 2 * cap_ops : 4;
            int *no = palloc(P, (size_t)cap * sizeof(*no));
            if (rhs.n)
                memcpy(no, ops, (size_t)rhs.n * sizeof(*no));
            ops = no;
            cap_ops = cap;
        }
        ops[rhs.n] = op;
        nvec_push(P, &rhs, parse_math1(P));
    }
    if (!rhs.n)
        return first;
    struct jnode *n = node(P, JE_CMP, line);
    n->a = first;
    n->items = rhs.v;
    n->n_items = rhs.n;
    n->ops = ops;
    return n;
}

static struct jnode *parse_not(struct parser *P)
{
    if (is_name(cur(P), "not")) {
        int line = cur(P)->line;
        next(P);
        enter(P, line);
        struct jnode *n = node(P, JE_NOT, line);
        n->a = parse_not(P);
        leave(P);
        return n;
    }
    return parse_compare(P);
}

static struct jnode *parse_and(struct parser *P)
{
    struct jnode *left = parse_not(P);
    int depth = 0;
    while (is_name(cur(P), "and")) {
        int line = cur(P)->line;
        enter(P, line);
        depth++;
        next(P);
        struct jnode *n = node(P, JE_AND, line);
        n->a = left;
        n->b = parse_not(P);
        left = n;
    }
    leave_n(P, depth);
    return left;
}

static struct jnode *parse_or(struct parser *P)
{
    struct jnode *left = parse_and(P);
    int depth = 0;
    while (is_name(cur(P), "or")) {
        int line = cur(P)->line;
        enter(P, line);
        depth++;
        next(P);
        struct jnode *n = node(P, JE_OR, line);
        n->a = left;
        n->b = parse_and(P);
        left = n;
    }
    leave_n(P, depth);
    return left;
}

static struct jnode *parse_condexpr(struct parser *P)
{
    int line = cur(P)->line;
    enter(P, line);
    struct jnode *e1 = parse_or(P);
    int depth = 0;
    while (is_name(cur(P), "if")) {
        int l = cur(P)->line;
        enter(P, l);
        depth++;
        next(P);
        struct jnode *n = node(P, JE_COND, l);
        n->a = e1;
        n->b = parse_or(P);
        if (is_name(cur(P), "else")) {
            next(P);
            n->c = parse_condexpr(P);
        }
        e1 = n;
    }
    leave_n(P, depth);
    leave(P);
    return e1;
}

static struct jnode *parse_expression(struct parser *P, bool with_condexpr)
{
    return with_condexpr ? parse_condexpr(P) : parse_or(P);
}

/* ---- statements ---------------------------------------------------------------- */

static struct jnode *parse_body(struct parser *P, const char *const *end_names);

static bool reserved_target(const char *name)
{
    static const char *const kw[] = {"true", "false", "none", "True", "False", "None", "and",
                                     "or",   "not",   "in",   "is",   "if",    "else", NULL};
    for (int i = 0; kw[i]; i++)
        if (!strcmp(kw[i], name))
            return true;
    return false;
}

/* name | name, name, ... (optionally in parentheses) */
static void parse_targets(struct parser *P, struct jnode *n)
{
    const char *names[64];
    int k = 0;
    bool paren = false;
    if (is_op(cur(P), "(")) {
        paren = true;
        next(P);
    }
    for (;;) {
        int line = cur(P)->line;
        const char *name = expect_name(P);
        if (reserved_target(name))
            perr(P, line, "cannot assign to '%s'", name);
        if (k == 64)
            perr(P, line, "more than 64 assignment targets");
        names[k++] = name;
        if (!is_op(cur(P), ","))
            break;
        next(P);
        if (cur(P)->type != JT_NAME)
            break; /* trailing comma */
    }
    if (paren)
        expect_op(P, ")");
    n->names = palloc(P, (size_t)k * sizeof(*n->names));
    memcpy(n->names, names, (size_t)k * sizeof(*names));
    n->n_names = k;
}

static struct jnode *parse_for(struct parser *P, int line)
{
    struct jnode *n = node(P, JN_FOR, line);
    parse_targets(P, n);
    if (!is_name(cur(P), "in"))
        unexpected(P, "'in'");
    next(P);
    static const char *const ends[] = {"recursive", NULL};
    n->a = parse_tuple(P, false, ends, false);
    if (is_name(cur(P), "if")) {
        next(P);
        n->d = parse_expression(P, true);
    }
    if (is_name(cur(P), "recursive"))
        perr(P, cur(P)->line, "recursive for loops are not supported");
    expect_block_end(P);
    static const char *const body_end[] = {"endfor", "else", NULL};
    P->in_loop++;
    n->b = parse_body(P, body_end);
    P->in_loop--;
    if (is_name(cur(P), "else")) {
        next(P);
        expect_block_end(P);
        static const char *const else_end[] = {"endfor", NULL};
        n->c = parse_body(P, else_end);
    }
    next(P); /* endfor */
    expect_block_end(P);
    return n;
}

static struct jnode *parse_if(struct parser *P, int line)
{
    struct jnode *n = node(P, JN_IF, line);
    n->a = parse_tuple(P, false, NULL, false);
    expect_block_end(P);
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    n->b = parse_body(P, ends);
    const struct jtoken *t = cur(P);
    if (is_name(t, "elif")) {
        next(P);
        enter(P, t->line);
        n->c = parse_if(P, t->line); /* consumes through endif */
        leave(P);
        return n;
    }
    if (is_name(t, "else")) {
        next(P);
        expect_block_end(P);
        static const char *const else_end[] = {"endif", NULL};
        n->c = parse_body(P, else_end);
    }
    next(P); /* endif */
    expect_block_end(P);
    return n;
}

static struct jnode *parse_set(struct parser *P, int line)
{
    struct jnode *n;
    if (cur(P)->type == JT_NAME && is_op(peek(P, 1), ".")) {
        n = node(P, JN_SET, line);
        const char *ns = expect_name(P);
        next(P); /* . */
        n->names = palloc(P, sizeof(*n->names));
        n->names[0] = ns;
        n->n_names = 1;
        n->name = expect_name(P);
        n->op = 1;
        expect_op(P, "=");
        n->a = parse_tuple(P, true, NULL, false);
        expect_block_end(P);
        return n;
    }
    n = node(P, JN_SET, line);
    parse_targets(P, n);
    if (is_op(cur(P), "=")) {
        next(P);
        n->a = parse_tuple(P, true, NULL, false);
        expect_block_end(P);
        return n;
    }
    if (n->n_names != 1)
        perr(P, line, "a block set assigns one name");
    n->kind = JN_SETBLOCK;
    struct nvec filters = {0};
    if (is_op(cur(P), "|")) {
        struct jnode *f = parse_filter(P, NULL, false);
        /* the chain is nested through ->a; flatten it, innermost first */
        for (struct jnode *x = f; x; x = x->a)
            nvec_push(P, &filters, x);
        for (int i = 0; i < filters.n / 2; i++) {
            struct jnode *tmp = filters.v[i];
            filters.v[i] = filters.v[filters.n - 1 - i];
            filters.v[filters.n - 1 - i] = tmp;
        }
    }
    n->items = filters.v;
    n->n_items = filters.n;
    expect_block_end(P);
    static const char *const ends[] = {"endset", NULL};
    n->b = parse_body(P, ends);
    next(P); /* endset */
    expect_block_end(P);
    return n;
}

static struct jnode *parse_macro(struct parser *P, int line)
{
    struct jnode *n = node(P, JN_MACRO, line);
    n->name = expect_name(P);
    if (reserved_target(n->name))
        perr(P, line, "cannot name a macro '%s'", n->name);
    expect_op(P, "(");
    struct nvec defaults = {0};
    const char *params[64];
    while (!is_op(cur(P), ")")) {
        if (defaults.n)
            expect_op(P, ",");
        if (is_op(cur(P), ")"))
            break;
        int pl = cur(P)->line;
        const char *pname = expect_name(P);
        if (reserved_target(pname))
            perr(P, pl, "cannot name a parameter '%s'", pname);
        if (defaults.n == 64)
            perr(P, pl, "more than 64 macro parameters");
        struct jnode *def = NULL;
        if (is_op(cur(P), "=")) {
            next(P);
            def = parse_expression(P, true);
        } else if (defaults.n && defaults.v[defaults.n - 1]) {
            perr(P, pl, "parameter '%s' without a default follows one with a default", pname);
        }
        params[defaults.n] = pname;
        nvec_push(P, &defaults, def);
    }
    expect_op(P, ")");
    expect_block_end(P);
    n->kwn = palloc(P, (size_t)(defaults.n ? defaults.n : 1) * sizeof(*n->kwn));
    memcpy(n->kwn, params, (size_t)defaults.n * sizeof(*params));
    n->kwv = defaults.v;
    n->n_kw = defaults.n;
    int saved_loop = P->in_loop;
    P->in_loop = 0;
    P->in_macro++;
    static const char *const ends[] = {"endmacro", NULL};
    n->b = parse_body(P, ends);
    P->in_macro--;
    P->in_loop = saved_loop;
    next(P); /* endmacro */
    if (cur(P)->type == JT_NAME)
        next(P); /* {% endmacro name %} */
    expect_block_end(P);
    note_macro(P, n->name);
    return n;
}

static struct jnode *parse_statement(struct parser *P)
{
    const struct jtoken *t = cur(P);
    int line = t->line;
    if (t->type != JT_NAME)
        unexpected(P, "a tag name");
    const char *tag = t->str;
    next(P);
    enter(P, line);
    struct jnode *n;
    if (!strcmp(tag, "for")) {
        n = parse_for(P, line);
    } else if (!strcmp(tag, "if")) {
        n = parse_if(P, line);
    } else if (!strcmp(tag, "set")) {
        n = parse_set(P, line);
    } else if (!strcmp(tag, "macro")) {
        n = parse_macro(P, line);
    } else if (!strcmp(tag, "break") || !strcmp(tag, "continue")) {
        if (!P->in_loop)
            perr(P, line, "'%s' outside a for loop", tag);
        n = node(P, tag[0] == 'b' ? JN_BREAK : JN_CONTINUE, line);
        expect_block_end(P);
    } else if (!strcmp(tag, "generation")) {
        /* transformers' AssistantTracker: renders its body unchanged */
        expect_block_end(P);
        static const char *const ends[] = {"endgeneration", NULL};
        n = node(P, JN_SCOPE, line); /* a call block: its body is a function */
        int saved_loop = P->in_loop;
        P->in_loop = 0; /* jinja2: 'break' outside loop inside it */
        n->b = parse_body(P, ends);
        P->in_loop = saved_loop;
        next(P);
        expect_block_end(P);
    } else {
        static const char *const jinja_tags[] = {
            "call", "filter",     "with", "block", "extends",   "include", "import", "from",
            "raw",  "autoescape", "do",   "trans", "pluralize", "print",   NULL};
        for (int i = 0; jinja_tags[i]; i++)
            if (!strcmp(tag, jinja_tags[i]))
                perr(P, line, "unsupported tag '%s'", tag);
        if (!strncmp(tag, "end", 3) || !strcmp(tag, "else") || !strcmp(tag, "elif"))
            perr(P, line, "unexpected '%s' (no open block it could close)", tag);
        perr(P, line, "unknown tag '%s'", tag);
    }
    leave(P);
    return n;
}

/* Statements until a {% name %} with name in end_names (left current, just
 * after the {%), or the end of the template when end_names is NULL. */
static struct jnode *parse_body(struct parser *P, const char *const *end_names)
{
    int line = cur(P)->line;
    int open_line = P->pos > 0 ? P->tok[P->pos - 1].line : line;
    struct nvec items = {0};
    for (;;) {
        const struct jtoken *t = cur(P);
        if (t->type == JT_EOF) {
            if (end_names) {
                char want[128] = "";
                for (int i = 0; end_names[i]; i++) {
                    size_t k = strlen(want);
                    snprintf(want + k, sizeof(want) - k, "%s'%s'", i ? " or " : "", end_names[i]);
                }
                perr(P, open_line, "unclosed block: expected %s before the end of the template",
                     want);
            }
            break;
        }
        if (t->type == JT_DATA) {
            struct jnode *n = node(P, JN_TEXT, t->line);
            struct jstr *s = palloc(P, sizeof(*s) + t->len + 1);
            memcpy(s->s, t->str, t->len + 1);
            s->len = t->len;
            n->val = jv_strv(s);
            nvec_push(P, &items, n);
            next(P);
        } else if (t->type == JT_VAR_BEGIN) {
            next(P);
            struct jnode *n = node(P, JN_OUTPUT, t->line);
            n->a = parse_tuple(P, true, NULL, false);
            if (cur(P)->type != JT_VAR_END)
                unexpected(P, "end of print statement '}}'");
            next(P);
            nvec_push(P, &items, n);
        } else if (t->type == JT_BLOCK_BEGIN) {
            next(P);
            const struct jtoken *name = cur(P);
            bool end = false;
            for (int i = 0; end_names && end_names[i] && !end; i++)
                end = is_name(name, end_names[i]);
            if (end)
                break;
            nvec_push(P, &items, parse_statement(P));
        } else {
            unexpected(P, "template text or a tag");
        }
    }
    struct jnode *b = node(P, JN_BODY, line);
    b->items = items.v;
    b->n_items = items.n;
    return b;
}

struct jnode *jinja_parse(const char *src, const char *name, struct jarena *arena,
                          struct moe_error *err)
{
    struct parser P = {.name = name, .arena = arena, .err = err};
    size_t n_tok;
    struct jtoken *tok = jinja_lex(src, name, arena, &n_tok, err);
    if (!tok)
        return NULL;
    P.tok = tok;
    P.n_tok = n_tok;
    if (setjmp(P.jmp))
        return NULL;
    struct jnode *root = parse_body(&P, NULL);
    for (int i = 0; i < P.n_calls; i++) {
        bool found = false;
        for (int j = 0; j < P.n_macros && !found; j++)
            found = !strcmp(P.macros[j], P.calls[i]);
        if (!found)
            perr(&P, P.call_lines[i], "unknown function '%s'", P.calls[i]);
    }
    if (!jinja_resolve_names(root, arena)) {
        moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", name);
        return NULL;
    }
    return root;
}
