/* Internals of the chat-template interpreter (chat_template.h is the API).
 *
 *   jinja_lex.c      template text -> tokens (whitespace control, trim/lstrip)
 *   jinja_parse.c    tokens -> tree of struct jnode (unsupported = error here)
 *   jinja_value.c    arena, values and Python's semantics for them (str(),
 *                    repr(), ==, <, truth, json.dumps, float printing, UTF-8)
 *   jinja_eval.c     runs the tree: scopes, loops, macros, operators
 *   jinja_builtins.c filters, tests, methods and global functions
 *   chat_template.c  the API: loading files, JSON -> values, render
 *
 * Memory: the parsed tree lives in the template's arena (read-only after
 * parse, so renders may share it). A render allocates every value in its
 * own arena, freed at the end; a runtime error unwinds with longjmp to
 * chat_template_render, which frees the arena and the output buffers, so
 * nothing leaks on any path. */
#ifndef MOE_JINJA_INTERNAL_H
#define MOE_JINJA_INTERNAL_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chat_template.h"

/* ---- arena ---------------------------------------------------------------- */

struct jchunk;
struct jarena {
    struct jchunk *head;
    size_t used;  /* bytes handed out plus chunk overhead */
    size_t limit; /* 0: unlimited */
};

/* Zeroed memory, 16-byte aligned; NULL when the limit is reached or malloc
 * fails. */
void *jarena_alloc(struct jarena *a, size_t n);
void jarena_free(struct jarena *a);

/* ---- values --------------------------------------------------------------- */

enum jv_type {
    JV_UNDEF = 0,
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_LIST,   /* struct jlist: list, tuple, generator, view (see jlist_kind) */
    JV_DICT,   /* struct jdict, insertion ordered */
    JV_NS,     /* namespace(): a struct jdict whose attributes may be set */
    JV_LOOP,   /* the `loop` object of a for loop */
    JV_MACRO,  /* a macro defined by the template */
    JV_FUNC,   /* a global function (enum jfunc) */
    JV_METHOD, /* obj.method, bound, not yet called */
};

/* What Python type a sequence is: decides len(), indexing, truth, printing. */
enum jlist_kind {
    JL_LIST = 0,
    JL_TUPLE,
    JL_GEN,     /* generator (map, select, items filter ...): no len, always true */
    JL_REVITER, /* list_reverseiterator (reverse filter on a list): like a generator */
    JL_ITEMS,   /* dict.items(), .keys(), .values() views: len, no indexing */
    JL_KEYS,
    JL_VALUES,
};

struct jstr {
    size_t len; /* bytes, excluding the NUL */
    char s[];   /* UTF-8, NUL-terminated */
};

struct jlist;
struct jdict;
struct jloop;
struct jmacro;
struct jmethod;

struct jv {
    uint8_t t; /* enum jv_type */
    union {
        bool b;
        int64_t i;
        double f;
        const struct jstr *s;
        struct jlist *l;
        struct jdict *d; /* JV_DICT and JV_NS */
        struct jloop *loop;
        struct jmacro *macro;
        int func;
        struct jmethod *m;
        const char *uname; /* JV_UNDEF: the name that was missing, or NULL */
    } u;
};

struct jlist {
    int kind; /* enum jlist_kind */
    size_t n, cap;
    struct jv *v;
};

struct jdict_ent {
    struct jv key, val;
};
struct jdict {
    size_t n, cap;
    struct jdict_ent *e;
};

struct jnode;
struct jscope;

struct jloop {
    const struct jlist *items;
    size_t index0;
};

struct jmacro {
    const struct jnode *def;
    struct jscope *scope; /* where it was defined: names resolve there, live */
};

struct jmethod {
    struct jv self;
    int id;           /* method table index; -2: a Python method that is not supported */
    const char *name; /* for errors */
};

/* ---- the tree ------------------------------------------------------------- */

enum jn_kind {
    /* statements */
    JN_BODY, /* items: statements in order */
    JN_TEXT, /* val: the text */
    JN_OUTPUT,
    JN_IF,       /* a cond, b body, c else (JN_BODY, or JN_IF for elif) */
    JN_FOR,      /* names targets, a iterable, b body, c else, d filter */
    JN_SET,      /* names targets (or names[0].name when op=1), a value */
    JN_SETBLOCK, /* names[0], b body, items filters (JE_FILTER with a=NULL) */
    JN_MACRO,    /* name, names params, kwv defaults (NULL entries), b body */
    JN_SCOPE,    /* b body in a scope of its own ({% generation %}) */
    JN_BREAK,
    JN_CONTINUE,
    /* expressions */
    JE_CONST,  /* val */
    JE_NAME,   /* name */
    JE_ATTR,   /* a.name */
    JE_ITEM,   /* a[b] */
    JE_SLICE,  /* a[b:c:d], NULL parts omitted */
    JE_CALL,   /* a(items..., kwn=kwv...) */
    JE_FILTER, /* a|name(items..., kw...), op = enum jfilter */
    JE_TEST,   /* a is name(items...), op = enum jtest */
    JE_BIN,    /* a op b, op = enum jbinop */
    JE_CONCAT, /* items joined with ~ */
    JE_NEG,
    JE_POS,
    JE_NOT,
    JE_AND,
    JE_OR,
    JE_CMP,   /* a ops[0] items[0] ops[1] items[1] ... (chained) */
    JE_COND,  /* a if b else c (c NULL: undefined) */
    JE_LIST,  /* items */
    JE_TUPLE, /* items */
    JE_DICT,  /* items: key, value, key, value ... */
};

enum jbinop { JOP_ADD, JOP_SUB, JOP_MUL, JOP_DIV, JOP_FLOORDIV, JOP_MOD, JOP_POW };
enum jcmpop { JCMP_EQ, JCMP_NE, JCMP_LT, JCMP_LE, JCMP_GT, JCMP_GE, JCMP_IN, JCMP_NOTIN };

struct jnode {
    int kind;
    int line;
    int op;
    const char *name;
    struct jnode *a, *b, *c, *d;
    struct jnode **items;
    int n_items;
    int *ops; /* JE_CMP */
    const char **names;
    int n_names;
    const char **kwn; /* keyword argument names / macro parameter names */
    struct jnode **kwv;
    int n_kw;
    struct jv val;
    const char **locals; /* frame bodies: names that start undefined (jinja_scope.c) */
    int n_locals;
};

/* ---- builtins: ids resolved at parse time ---------------------------------- */

/* Index into the filter table, or -1. */
int jinja_filter_lookup(const char *name);
/* Index into the test table, or -1 (also accepts "==", "<" ...). */
int jinja_test_lookup(const char *name);
/* Index into the method table, or -1. */
int jinja_method_lookup(const char *name);
/* Index into the global function table, or -1. */
int jinja_func_lookup(const char *name);
const char *jinja_func_name(int id);

/* ---- rendering ------------------------------------------------------------ */

struct jbuf {
    char *p;
    size_t n, cap;
};

#define JINJA_MAX_CAPTURE (CHAT_TEMPLATE_MAX_DEPTH + 8)

struct jctx {
    const char *tname; /* template name for errors */
    struct jarena arena;
    jmp_buf jmp;
    struct moe_error *err;
    enum moe_status code;
    struct jbuf bufs[JINJA_MAX_CAPTURE]; /* output, then captures (macros, set blocks) */
    int n_bufs;
    int64_t steps;
    int depth;           /* macro calls */
    int nest;            /* evaluation recursion */
    int brk;             /* 1 break, 2 continue pending */
    struct jscope *vars; /* render variables (below the root scope) */
};

struct jscope {
    struct jscope *parent;
    int n, cap;
    const char **names;
    struct jv *vals;
};

/* Records "tname:line: message" and unwinds to the render entry. */
_Noreturn void jerr(struct jctx *c, int line, enum moe_status code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

void *jalloc(struct jctx *c, size_t n);          /* arena or jerr (memory limit) */
void jstep(struct jctx *c, int line, int64_t n); /* counts work against the step limit */

/* values (jinja_value.c) */
struct jv jv_undef(const char *name);
struct jv jv_none(void);
struct jv jv_bool(bool b);
struct jv jv_int(int64_t i);
struct jv jv_float(double f);
struct jv jv_strv(const struct jstr *s);
const struct jstr *jstr_new(struct jctx *c, const char *p, size_t n);
const struct jstr *jstr_cat(struct jctx *c, const char *a, size_t na, const char *b, size_t nb);
struct jv jv_str(struct jctx *c, const char *p, size_t n);
struct jv jv_cstr(struct jctx *c, const char *p);
struct jlist *jlist_new(struct jctx *c, int kind, size_t cap);
void jlist_push(struct jctx *c, struct jlist *l, struct jv v);
struct jdict *jdict_new(struct jctx *c, size_t cap);
/* Sets key (replacing the value in place if present). */
void jdict_set(struct jctx *c, struct jdict *d, struct jv key, struct jv val);
/* Finds a key by Python equality (1 == 1.0 == True); NULL if absent. */
struct jv *jdict_get(const struct jdict *d, struct jv key);
struct jv *jdict_get_str(const struct jdict *d, const char *key);

bool jv_truthy(struct jv v);
bool jv_is_str(struct jv v);
bool jv_is_num(struct jv v); /* bool, int or float */
bool jv_eq(struct jv a, struct jv b);
/* Python's ordering of a and b: -1, 0, 1, or 2 when unordered (NaN); jerr
 * when Python raises TypeError (None <= None, dict < dict, 1 < "a"). */
int jv_cmp(struct jctx *c, int line, struct jv a, struct jv b);
static inline bool jcmp_le(int r)
{
    return r == -1 || r == 0;
}
static inline bool jcmp_ge(int r)
{
    return r == 1 || r == 0;
}
const char *jv_type_name(struct jv v); /* Python's type name ("str", "dict" ...) */

/* String builder in the render arena. */
struct jsb {
    struct jctx *c;
    char *p;
    size_t n, cap;
};
void jsb_init(struct jsb *b, struct jctx *c);
void jsb_add(struct jsb *b, const char *p, size_t n);
void jsb_adds(struct jsb *b, const char *s);
void jsb_addc(struct jsb *b, char ch);
const struct jstr *jsb_str(struct jsb *b);

/* str(v) as Python prints it; jerr for values whose text Python would
 * print with a memory address (generators, macros). */
void jv_write_str(struct jsb *b, int line, struct jv v);
const struct jstr *jv_to_str(struct jctx *c, int line, struct jv v);
void jv_write_repr(struct jsb *b, int line, struct jv v);
/* json.dumps(v, ensure_ascii=False, indent, separators, sort_keys). indent
 * < 0: none; item_sep/key_sep NULL: Python's defaults for the indent. */
void jv_write_json(struct jsb *b, int line, struct jv v, int indent, const char *indent_str,
                   const char *item_sep, const char *key_sep, bool sort_keys, int level);
void jfloat_repr(double f, char out[40]);

/* UTF-8 (input is validated at the boundary). */
size_t ju8_len(const char *s, size_t n); /* code points */
/* Decodes one code point at s (n bytes left); *adv = its byte length. */
uint32_t ju8_dec(const char *s, size_t n, size_t *adv);
size_t ju8_enc(uint32_t cp, char out[4]);
bool ju8_valid(const char *s, size_t n);
bool jpy_isspace(uint32_t cp);

/* Evaluation (jinja_eval.c) */
struct jv jinja_eval(struct jctx *c, const struct jnode *e, struct jscope *sc);
void jinja_exec(struct jctx *c, const struct jnode *n, struct jscope *sc);
struct jv jinja_getattr(struct jctx *c, int line, struct jv obj, const char *name);
struct jv jinja_getitem(struct jctx *c, int line, struct jv obj, struct jv key);
/* The items a for loop (or list()) would see; jerr if not iterable. */
struct jlist *jinja_iter(struct jctx *c, int line, struct jv v);
struct jv jinja_call_macro(struct jctx *c, int line, struct jmacro *m, int n_pos,
                           const struct jv *pos, int n_kw, const char **kwn, const struct jv *kwv);
bool jinja_in(struct jctx *c, int line, struct jv item, struct jv container);

/* Evaluated call arguments. */
struct jargs {
    int n_pos;
    struct jv *pos;
    int n_kw;
    const char **kwn;
    struct jv *kwv;
};
/* Maps args onto parameters `params` (n of them, n <= 31): out[i] is the
 * argument, or jv_undef(NULL) when not given; returns the bitmask of the
 * given ones. jerr on an unknown keyword, a repeated one or too many
 * positional arguments, naming `what`. */
unsigned jargs_bind(struct jctx *c, int line, const char *what, const struct jargs *a,
                    const char *const *params, int n, struct jv *out);

struct jv jinja_filter(struct jctx *c, int line, int id, struct jv in, const struct jargs *a);
bool jinja_test(struct jctx *c, int line, int id, struct jv in, const struct jargs *a);
struct jv jinja_method(struct jctx *c, int line, struct jmethod *m, const struct jargs *a);
struct jv jinja_func(struct jctx *c, int line, int id, const struct jargs *a);
/* The method `name` has on v's type: its id, -2 if Python has such an
 * attribute that is not supported (calling it is an error), -1 if none. */
int jinja_method_of(struct jv v, const char *name);
const char *jinja_filter_name(int id);
const char *jinja_test_name(int id);

/* ---- tokens (jinja_lex.c) ---------------------------------------------------- */

enum jtok_type {
    JT_EOF = 0,
    JT_DATA,        /* text between tags (str: the text, after whitespace control) */
    JT_VAR_BEGIN,   /* {{ */
    JT_VAR_END,     /* }} */
    JT_BLOCK_BEGIN, /* {% */
    JT_BLOCK_END,   /* %} */
    JT_NAME,        /* str: the name */
    JT_STRING,      /* str: the decoded literal */
    JT_INT,
    JT_FLOAT,
    JT_OP, /* str: the operator text ("==", "(", ...) */
};

struct jtoken {
    int type;
    int line;
    const char *str; /* NUL-terminated, in the arena */
    size_t len;
    int64_t ival;
    double fval;
};

/* Tokenizes `src` (already valid UTF-8) as transformers' jinja2 environment
 * does (trim_blocks, lstrip_blocks, newlines normalized, one trailing
 * newline dropped). Returns the tokens (ending with JT_EOF) in `arena`, or
 * NULL with err set ("name:line: ..."). */
struct jtoken *jinja_lex(const char *src, const char *name, struct jarena *arena, size_t *n_out,
                         struct moe_error *err);

/* strings (jinja_methods.c) */
const struct jstr *jstr_case(struct jctx *c, const struct jstr *s, int upper0_lower1_title2);
const struct jstr *jstr_capitalize(struct jctx *c, const struct jstr *s);
const struct jstr *jstr_title_filter(struct jctx *c, const struct jstr *s);
/* mode: 1 left, 2 right, 3 both; chars NULL: whitespace. */
const struct jstr *jstr_strip(struct jctx *c, const struct jstr *s, const struct jstr *chars,
                              int mode);
const struct jstr *jstr_replace(struct jctx *c, const struct jstr *s, const struct jstr *old,
                                const struct jstr *new_, int64_t count);
/* dict.items() / keys() / values() views (kind JL_ITEMS, JL_KEYS, JL_VALUES). */
struct jv jinja_dict_items(struct jctx *c, const struct jdict *d, int kind);

/* Marks on each frame body the names that start undefined in it, as
 * jinja2's idtracking decides (jinja_scope.c). False when out of memory. */
bool jinja_resolve_names(struct jnode *root, struct jarena *arena);
/* Sets name to v in scope s itself (not a parent): replaces the value if s
 * has the name, adds it otherwise. `name` must outlive the render. */
void jinja_scope_set(struct jctx *c, struct jscope *s, const char *name, struct jv v);
/* Binds a frame body's `locals` to undefined in sc (at frame start). */
void jinja_frame_start(struct jctx *c, struct jscope *sc, const struct jnode *body);

/* parse (jinja_parse.c): the tree in `arena`, or NULL with err set. */
struct jnode *jinja_parse(const char *src, const char *name, struct jarena *arena,
                          struct moe_error *err);

#endif
