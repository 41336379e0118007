/* Static name resolution, as jinja2's compiler does it (idtracking.py).
 *
 * jinja2 compiles each frame (the template, a for-loop body, its else
 * block, a macro, a set block, a call block) into Python code whose locals
 * are the names the frame assigns. A local is initialized when the frame
 * starts, from the first time the frame's own code (not its child frames)
 * meets the name:
 *   - a load first: the value from the render variables (RESOLVE);
 *   - a store first, and an enclosing frame knows the name: that frame's
 *     current value (ALIAS);
 *   - a store first otherwise: undefined (UNDEFINED), even when the render
 *     variables have the name;
 *   - a name first stored inside an if branch: RESOLVE or ALIAS.
 * The interpreter resolves names dynamically through its scope chain, which
 * gives the same values in every case but UNDEFINED: there the frame must
 * hide the outer value from the start. This pass finds those names and
 * records them on each frame's body (jnode.locals), and the interpreter
 * binds them to undefined when the frame starts. */
#include <string.h>

#include "jinja_internal.h"

enum { K_PARAM, K_RESOLVE, K_UNDEF, K_ALIAS };

struct sym {
    const char *name;
    int kind;
};

struct symtab {
    const struct symtab *parent;
    struct sym *refs;
    int n_refs, cap_refs;
    const char **stores;
    int n_stores, cap_stores;
};

struct frame_job {
    const struct jnode *params_from; /* JN_FOR (targets) or JN_MACRO (parameters) */
    struct jnode *body;              /* gets ->locals */
    const struct jnode *defaults;    /* JN_MACRO: its default expressions */
};

struct analyzer {
    struct jarena *arena;
    bool nomem;
};

static void *aalloc(struct analyzer *A, size_t n)
{
    void *p = jarena_alloc(A->arena, n);
    if (!p)
        A->nomem = true;
    return p;
}

static struct sym *own_ref(const struct symtab *s, const char *name)
{
    for (int i = 0; i < s->n_refs; i++)
        if (!strcmp(s->refs[i].name, name))
            return &s->refs[i];
    return NULL;
}

static bool find_ref(const struct symtab *s, const char *name)
{
    for (; s; s = s->parent)
        if (own_ref(s, name))
            return true;
    return false;
}

static bool stored(const struct symtab *s, const char *name)
{
    for (int i = 0; i < s->n_stores; i++)
        if (!strcmp(s->stores[i], name))
            return true;
    return false;
}

static void define_ref(struct analyzer *A, struct symtab *s, const char *name, int kind)
{
    struct sym *r = own_ref(s, name);
    if (r) {
        r->kind = kind;
        return;
    }
    if (s->n_refs == s->cap_refs) {
        int cap = s->cap_refs ? 2 * s->cap_refs : 8;
        struct sym *nr = aalloc(A, (size_t)cap * sizeof(*nr));
        if (!nr)
            return;
        if (s->n_refs)
            memcpy(nr, s->refs, (size_t)s->n_refs * sizeof(*nr));
        s->refs = nr;
        s->cap_refs = cap;
    }
    s->refs[s->n_refs].name = name;
    s->refs[s->n_refs].kind = kind;
    s->n_refs++;
}

static void add_store(struct analyzer *A, struct symtab *s, const char *name)
{
    if (stored(s, name))
        return;
    if (s->n_stores == s->cap_stores) {
        int cap = s->cap_stores ? 2 * s->cap_stores : 8;
        const char **ns = aalloc(A, (size_t)cap * sizeof(*ns));
        if (!ns)
            return;
        if (s->n_stores)
            memcpy(ns, s->stores, (size_t)s->n_stores * sizeof(*ns));
        s->stores = ns;
        s->cap_stores = cap;
    }
    s->stores[s->n_stores++] = name;
}

static void sym_load(struct analyzer *A, struct symtab *s, const char *name)
{
    if (!find_ref(s, name))
        define_ref(A, s, name, K_RESOLVE);
}

static void sym_store(struct analyzer *A, struct symtab *s, const char *name)
{
    add_store(A, s, name);
    if (own_ref(s, name))
        return;
    define_ref(A, s, name, s->parent && find_ref(s->parent, name) ? K_ALIAS : K_UNDEF);
}

static void sym_param(struct analyzer *A, struct symtab *s, const char *name)
{
    add_store(A, s, name);
    define_ref(A, s, name, K_PARAM);
}

static struct symtab *sym_copy(struct analyzer *A, const struct symtab *s)
{
    struct symtab *c = aalloc(A, sizeof(*c));
    if (!c)
        return NULL;
    c->parent = s->parent;
    for (int i = 0; i < s->n_refs; i++)
        define_ref(A, c, s->refs[i].name, s->refs[i].kind);
    for (int i = 0; i < s->n_stores; i++)
        add_store(A, c, s->stores[i]);
    return c;
}

/* Symbols.branch_update: merge the branches; a name newly stored in any of
 * them loads by RESOLVE or ALIAS. */
static void branch_update(struct analyzer *A, struct symtab *s, struct symtab **br, int n)
{
    const char *fresh[256];
    int n_fresh = 0;
    for (int b = 0; b < n; b++)
        for (int i = 0; i < br[b]->n_stores; i++) {
            const char *name = br[b]->stores[i];
            bool dup = stored(s, name);
            for (int k = 0; k < n_fresh && !dup; k++)
                dup = !strcmp(fresh[k], name);
            if (!dup && n_fresh < 256)
                fresh[n_fresh++] = name;
        }
    for (int b = 0; b < n; b++) {
        for (int i = 0; i < br[b]->n_refs; i++)
            define_ref(A, s, br[b]->refs[i].name, br[b]->refs[i].kind);
        for (int i = 0; i < br[b]->n_stores; i++)
            add_store(A, s, br[b]->stores[i]);
    }
    for (int k = 0; k < n_fresh; k++)
        define_ref(A, s, fresh[k],
                   s->parent && find_ref(s->parent, fresh[k]) ? K_ALIAS : K_RESOLVE);
}

/* ---- the frame visitor: the frame's own code, child frames queued ----------- */

struct jobs {
    struct frame_job *v;
    int n, cap;
};

static void queue(struct analyzer *A, struct jobs *q, const struct jnode *params_from,
                  struct jnode *body, const struct jnode *defaults)
{
    if (!body)
        return;
    if (q->n == q->cap) {
        int cap = q->cap ? 2 * q->cap : 8;
        struct frame_job *nv = aalloc(A, (size_t)cap * sizeof(*nv));
        if (!nv)
            return;
        if (q->n)
            memcpy(nv, q->v, (size_t)q->n * sizeof(*nv));
        q->v = nv;
        q->cap = cap;
    }
    q->v[q->n].params_from = params_from;
    q->v[q->n].body = body;
    q->v[q->n].defaults = defaults;
    q->n++;
}

static void vis_expr(struct analyzer *A, struct symtab *s, const struct jnode *e)
{
    if (!e)
        return;
    if (e->kind == JE_NAME) {
        sym_load(A, s, e->name);
        return;
    }
    vis_expr(A, s, e->a);
    vis_expr(A, s, e->b);
    vis_expr(A, s, e->c);
    vis_expr(A, s, e->d);
    for (int i = 0; i < e->n_items; i++)
        vis_expr(A, s, e->items[i]);
    for (int i = 0; i < e->n_kw; i++)
        vis_expr(A, s, e->kwv[i]);
}

static void vis_stmt(struct analyzer *A, struct symtab *s, struct jnode *n, struct jobs *q);

static void vis_body(struct analyzer *A, struct symtab *s, struct jnode *body, struct jobs *q)
{
    if (!body)
        return;
    for (int i = 0; i < body->n_items; i++)
        vis_stmt(A, s, body->items[i], q);
}

/* An if with its elif chain (n->c of kind JN_IF) and else, as jinja2's
 * If(test, body, elif_=[...], else_) node; `head` false for an elif, whose
 * own elif_/else_ are empty. */
static void vis_if(struct analyzer *A, struct symtab *s, struct jnode *n, bool head, struct jobs *q)
{
    vis_expr(A, s, n->a);
    struct symtab *br[3];
    br[0] = sym_copy(A, s);
    br[1] = sym_copy(A, s);
    br[2] = sym_copy(A, s);
    if (!br[0] || !br[1] || !br[2])
        return;
    vis_body(A, br[0], n->b, q);
    if (head) {
        struct jnode *e = n->c;
        while (e && e->kind == JN_IF) {
            vis_if(A, br[1], e, false, q);
            e = e->c;
        }
        vis_body(A, br[2], e, q);
    }
    branch_update(A, s, br, 3);
}

static void vis_stmt(struct analyzer *A, struct symtab *s, struct jnode *n, struct jobs *q)
{
    switch (n->kind) {
    case JN_OUTPUT: vis_expr(A, s, n->a); break;
    case JN_IF: vis_if(A, s, n, true, q); break;
    case JN_FOR:
        vis_expr(A, s, n->a);
        queue(A, q, n, n->b, NULL);
        queue(A, q, NULL, n->c, NULL);
        break;
    case JN_SET:
        vis_expr(A, s, n->a);
        if (n->op == 1) {
            sym_load(A, s, n->names[0]);
        } else {
            for (int i = 0; i < n->n_names; i++)
                sym_store(A, s, n->names[i]);
        }
        break;
    case JN_SETBLOCK:
        sym_store(A, s, n->names[0]);
        queue(A, q, NULL, n->b, NULL);
        break;
    case JN_MACRO:
        sym_store(A, s, n->name);
        queue(A, q, n, n->b, n);
        break;
    case JN_SCOPE: queue(A, q, NULL, n->b, NULL); break;
    case JN_BODY: vis_body(A, s, n, q); break;
    default: break;
    }
}

/* Analyzes the frame whose code is `body` (with parameters from a for or a
 * macro), records its UNDEFINED locals, then its child frames. */
static void analyze_frame(struct analyzer *A, const struct symtab *parent,
                          const struct frame_job *job)
{
    struct symtab s = {.parent = parent};
    struct jobs q = {0};
    const struct jnode *pf = job->params_from;
    if (pf && pf->kind == JN_FOR) {
        for (int i = 0; i < pf->n_names; i++)
            sym_param(A, &s, pf->names[i]);
        sym_param(A, &s, "loop");
    } else if (pf && pf->kind == JN_MACRO) {
        for (int i = 0; i < pf->n_kw; i++)
            sym_param(A, &s, pf->kwn[i]);
        for (int i = 0; i < pf->n_kw; i++)
            vis_expr(A, &s, pf->kwv[i]);
    }
    vis_body(A, &s, job->body, &q);
    if (A->nomem)
        return;
    int k = 0;
    for (int i = 0; i < s.n_refs; i++)
        k += s.refs[i].kind == K_UNDEF;
    if (k) {
        job->body->locals = aalloc(A, (size_t)k * sizeof(*job->body->locals));
        if (!job->body->locals)
            return;
        for (int i = 0; i < s.n_refs; i++)
            if (s.refs[i].kind == K_UNDEF)
                job->body->locals[job->body->n_locals++] = s.refs[i].name;
    }
    for (int i = 0; i < q.n; i++)
        analyze_frame(A, &s, &q.v[i]);
}

bool jinja_resolve_names(struct jnode *root, struct jarena *arena)
{
    struct analyzer A = {.arena = arena};
    struct frame_job job = {.body = root};
    analyze_frame(&A, NULL, &job);
    return !A.nomem;
}
