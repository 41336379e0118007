/* The chat-template API (chat_template.h): loading a checkpoint's template,
 * turning the request's JSON into template values the way transformers'
 * apply_chat_template prepares them, and rendering. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "jinja_internal.h"
#include "read_file.h"

struct chat_template {
    struct jarena arena; /* the tree and the strings below */
    const struct jnode *root;
    const char *name;
    const char *bos, *eos; /* NULL: unknown (then undefined in the template) */
};

/* ---- parse and load ---------------------------------------------------------------- */

static char *arena_strdup(struct jarena *a, const char *s)
{
    size_t n = strlen(s);
    char *d = jarena_alloc(a, n + 1);
    if (d)
        memcpy(d, s, n + 1);
    return d;
}

struct chat_template *chat_template_parse(const char *src, const char *name, struct moe_error *err)
{
    if (!name)
        name = "chat template";
    if (!src) {
        moe_error_set(err, MOE_ERR_INVALID, "%s: no template source", name);
        return NULL;
    }
    size_t n = strlen(src);
    if (!ju8_valid(src, n)) {
        int line = 1;
        const char *p = src;
        for (;;) { /* the first line that is not valid */
            const char *nl = strchr(p, '\n');
            size_t k = nl ? (size_t)(nl - p) : strlen(p);
            if (!ju8_valid(p, k) || !nl)
                break;
            p = nl + 1;
            line++;
        }
        moe_error_set(err, MOE_ERR_FORMAT, "%s:%d: the template is not valid UTF-8", name, line);
        return NULL;
    }
    struct chat_template *t = calloc(1, sizeof(*t));
    if (!t) {
        moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", name);
        return NULL;
    }
    t->name = arena_strdup(&t->arena, name);
    if (!t->name) {
        moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", name);
        goto fail;
    }
    t->root = jinja_parse(src, t->name, &t->arena, err);
    if (!t->root)
        goto fail;
    return t;
fail:
    chat_template_destroy(t);
    return NULL;
}

void chat_template_destroy(struct chat_template *t)
{
    if (!t)
        return;
    jarena_free(&t->arena);
    free(t);
}

const char *chat_template_bos(const struct chat_template *t)
{
    return t && t->bos ? t->bos : "";
}

const char *chat_template_eos(const struct chat_template *t)
{
    return t && t->eos ? t->eos : "";
}

#define CHAT_TEMPLATE_MAX_FILE (64u << 20)

/* Whole file, NUL-terminated (malloc'd); NULL with err naming the path. */
static char *read_file(const char *path, struct moe_error *err)
{
    char *text;
    moe_read_text(path, CHAT_TEMPLATE_MAX_FILE, &text, err);
    return text;
}

struct chat_template *chat_template_load_file(const char *path, struct moe_error *err)
{
    char *src = read_file(path, err);
    if (!src)
        return NULL;
    struct chat_template *t = chat_template_parse(src, path, err);
    free(src);
    return t;
}

/* "bos_token": "<s>" or {"content": "<s>", ...}; NULL if absent or null. */
static const char *special_token(const cJSON *cfg, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (cJSON_IsString(v))
        return v->valuestring;
    if (cJSON_IsObject(v)) {
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(v, "content");
        if (cJSON_IsString(c))
            return c->valuestring;
    }
    return NULL;
}

struct chat_template *chat_template_load(const char *model_dir, struct moe_error *err)
{
    char jinja_path[4096], cfg_path[4096], name[4200];
    struct chat_template *t = NULL;
    char *cfg_text = NULL;
    cJSON *cfg = NULL;
    snprintf(jinja_path, sizeof(jinja_path), "%s/chat_template.jinja", model_dir);
    snprintf(cfg_path, sizeof(cfg_path), "%s/tokenizer_config.json", model_dir);

    struct stat st;
    bool have_jinja = stat(jinja_path, &st) == 0;
    struct moe_error cerr = {0};
    cfg_text = read_file(cfg_path, &cerr);
    if (!cfg_text && cerr.code != MOE_ERR_NOT_FOUND) {
        if (err)
            *err = cerr;
        return NULL;
    }
    if (cfg_text) {
        cfg = cJSON_Parse(cfg_text);
        if (!cJSON_IsObject(cfg)) {
            moe_error_set(err, MOE_ERR_FORMAT, "%s: not a JSON object", cfg_path);
            goto fail;
        }
    }
    if (have_jinja) {
        t = chat_template_load_file(jinja_path, err);
        if (!t)
            goto fail;
    } else {
        const cJSON *ct = cfg ? cJSON_GetObjectItemCaseSensitive(cfg, "chat_template") : NULL;
        if (!ct || cJSON_IsNull(ct)) {
            moe_error_set(err, MOE_ERR_NOT_FOUND,
                          "%s: no chat template (neither chat_template.jinja nor a "
                          "\"chat_template\" in tokenizer_config.json)",
                          model_dir);
            goto fail;
        }
        const char *src = NULL;
        if (cJSON_IsString(ct)) {
            src = ct->valuestring;
            snprintf(name, sizeof(name), "%s:chat_template", cfg_path);
        } else if (cJSON_IsArray(ct)) {
            const cJSON *e;
            cJSON_ArrayForEach(e, ct)
            {
                const cJSON *n = cJSON_GetObjectItemCaseSensitive(e, "name");
                const cJSON *s = cJSON_GetObjectItemCaseSensitive(e, "template");
                if (cJSON_IsString(n) && !strcmp(n->valuestring, "default")) {
                    if (!cJSON_IsString(s)) {
                        moe_error_set(err, MOE_ERR_FORMAT,
                                      "%s: chat_template \"default\": \"template\" is not a string",
                                      cfg_path);
                        goto fail;
                    }
                    src = s->valuestring;
                }
            }
            if (!src) {
                moe_error_set(err, MOE_ERR_FORMAT,
                              "%s: chat_template lists templates but none is named \"default\"",
                              cfg_path);
                goto fail;
            }
            snprintf(name, sizeof(name), "%s:chat_template[default]", cfg_path);
        } else {
            moe_error_set(err, MOE_ERR_FORMAT,
                          "%s: chat_template must be a string or a list of {name, template}",
                          cfg_path);
            goto fail;
        }
        t = chat_template_parse(src, name, err);
        if (!t)
            goto fail;
    }
    if (cfg) {
        const char *bos = special_token(cfg, "bos_token");
        const char *eos = special_token(cfg, "eos_token");
        if (bos && !(t->bos = arena_strdup(&t->arena, bos)))
            goto nomem;
        if (eos && !(t->eos = arena_strdup(&t->arena, eos)))
            goto nomem;
    }
    cJSON_Delete(cfg);
    free(cfg_text);
    return t;
nomem:
    moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", cfg_path);
fail:
    chat_template_destroy(t);
    cJSON_Delete(cfg);
    free(cfg_text);
    return NULL;
}

/* ---- JSON -> values ---------------------------------------------------------------- */

static struct jv from_json(struct jctx *c, const cJSON *j, const char *what, int depth)
{
    if (depth > 1000)
        jerr(c, 0, MOE_ERR_INVALID, "%s: JSON nested deeper than 1000", what);
    if (cJSON_IsNull(j))
        return jv_none();
    if (cJSON_IsBool(j))
        return jv_bool(cJSON_IsTrue(j));
    if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        /* cJSON keeps no int/float distinction: integral values are ints */
        if (d == floor(d) && fabs(d) < 9007199254740992.0)
            return jv_int((int64_t)d);
        return jv_float(d);
    }
    if (cJSON_IsString(j)) {
        size_t n = strlen(j->valuestring);
        if (!ju8_valid(j->valuestring, n))
            jerr(c, 0, MOE_ERR_INVALID, "%s: a string is not valid UTF-8", what);
        return jv_str(c, j->valuestring, n);
    }
    if (cJSON_IsArray(j)) {
        struct jlist *l = jlist_new(c, JL_LIST, (size_t)cJSON_GetArraySize(j));
        const cJSON *e;
        cJSON_ArrayForEach(e, j) jlist_push(c, l, from_json(c, e, what, depth + 1));
        struct jv v = {.t = JV_LIST};
        v.u.l = l;
        return v;
    }
    if (cJSON_IsObject(j)) {
        struct jdict *d = jdict_new(c, (size_t)cJSON_GetArraySize(j));
        const cJSON *e;
        cJSON_ArrayForEach(e, j)
        {
            size_t n = strlen(e->string);
            if (!ju8_valid(e->string, n))
                jerr(c, 0, MOE_ERR_INVALID, "%s: a key is not valid UTF-8", what);
            jdict_set(c, d, jv_str(c, e->string, n), from_json(c, e, what, depth + 1));
        }
        struct jv v = {.t = JV_DICT};
        v.u.d = d;
        return v;
    }
    jerr(c, 0, MOE_ERR_INVALID, "%s: unsupported JSON value", what);
}

/* As transformers' apply_chat_template: keys whose value is null are dropped
 * (_normalize_chat_messages), and a message with reasoning under any of
 * reasoning_content / thinking / reasoning gets it as "thinking" (first) and
 * "reasoning_content" too (_alias_reasoning_fields). */
static struct jv message_value(struct jctx *c, const cJSON *m, int index)
{
    char what[64];
    snprintf(what, sizeof(what), "messages[%d]", index);
    if (!cJSON_IsObject(m))
        jerr(c, 0, MOE_ERR_INVALID, "%s: a message must be an object", what);
    struct jdict *d = jdict_new(c, (size_t)cJSON_GetArraySize(m) + 2);
    static const char *const reasoning_keys[] = {"reasoning_content", "thinking", "reasoning"};
    const cJSON *reasoning = NULL;
    for (int k = 0; k < 3 && !reasoning; k++) {
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(m, reasoning_keys[k]);
        if (r && !cJSON_IsNull(r))
            reasoning = r;
    }
    if (reasoning)
        jdict_set(c, d, jv_cstr(c, "thinking"), from_json(c, reasoning, what, 1));
    const cJSON *e;
    cJSON_ArrayForEach(e, m)
    {
        if (cJSON_IsNull(e))
            continue;
        size_t n = strlen(e->string);
        if (!ju8_valid(e->string, n))
            jerr(c, 0, MOE_ERR_INVALID, "%s: a key is not valid UTF-8", what);
        jdict_set(c, d, jv_str(c, e->string, n), from_json(c, e, what, 1));
    }
    if (reasoning)
        jdict_set(c, d, jv_cstr(c, "reasoning_content"), from_json(c, reasoning, what, 1));
    struct jv v = {.t = JV_DICT};
    v.u.d = d;
    return v;
}

/* ---- render -------------------------------------------------------------------------- */

static void render_body(struct jctx *c, const struct chat_template *t,
                        const struct chat_template_vars *vars)
{
    struct jscope *vs = jalloc(c, sizeof(*vs));
    const char *bos = vars->bos_token ? vars->bos_token : t->bos;
    const char *eos = vars->eos_token ? vars->eos_token : t->eos;
    if (bos)
        jinja_scope_set(c, vs, "bos_token", jv_cstr(c, bos));
    if (eos)
        jinja_scope_set(c, vs, "eos_token", jv_cstr(c, eos));
    jinja_scope_set(c, vs, "tools", jv_none());
    jinja_scope_set(c, vs, "documents", jv_none());
    if (vars->extra) {
        if (!cJSON_IsObject(vars->extra))
            jerr(c, 0, MOE_ERR_INVALID, "extra template variables must be a JSON object");
        const cJSON *e;
        cJSON_ArrayForEach(e, vars->extra)
        {
            size_t n = strlen(e->string);
            char *name = jalloc(c, n + 1);
            memcpy(name, e->string, n + 1);
            jinja_scope_set(c, vs, name, from_json(c, e, name, 1));
        }
    }
    if (!cJSON_IsArray(vars->messages))
        jerr(c, 0, MOE_ERR_INVALID, "messages must be a JSON array");
    struct jlist *msgs = jlist_new(c, JL_LIST, (size_t)cJSON_GetArraySize(vars->messages));
    const cJSON *m;
    int i = 0;
    cJSON_ArrayForEach(m, vars->messages) jlist_push(c, msgs, message_value(c, m, i++));
    struct jv mv = {.t = JV_LIST};
    mv.u.l = msgs;
    jinja_scope_set(c, vs, "messages", mv);
    jinja_scope_set(c, vs, "add_generation_prompt", jv_bool(vars->add_generation_prompt));
    c->vars = vs;

    struct jscope *root = jalloc(c, sizeof(*root));
    root->parent = vs;
    jinja_frame_start(c, root, t->root);
    jinja_exec(c, t->root, root);
}

enum moe_status chat_template_render(const struct chat_template *t,
                                     const struct chat_template_vars *vars, char **out,
                                     struct moe_error *err)
{
    *out = NULL;
    if (!t || !vars)
        return moe_error_set(err, MOE_ERR_INVALID, "chat_template_render: no template or vars");
    struct jctx *c = calloc(1, sizeof(*c));
    if (!c)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", t->name);
    c->tname = t->name;
    c->err = err;
    c->arena.limit = CHAT_TEMPLATE_MAX_MEMORY;
    c->n_bufs = 1;
    enum moe_status st = MOE_OK;
    if (setjmp(c->jmp)) {
        st = c->code;
        for (int i = 0; i < c->n_bufs; i++)
            free(c->bufs[i].p);
        goto done;
    }
    render_body(c, t, vars);
    struct jbuf *b = &c->bufs[0];
    char *res = realloc(b->p, b->n + 1);
    if (!res) {
        free(b->p);
        st = moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", t->name);
        goto done;
    }
    res[b->n] = 0;
    *out = res;
done:
    jarena_free(&c->arena);
    free(c);
    return st;
}
