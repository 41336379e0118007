/* Chat templates (common/chat_template.h) against Python jinja2 rendered the
 * way transformers renders them, and against transformers' token ids:
 *  - expected.json: every corpus template x conversation, byte-identical;
 *  - fuzz.json: random templates of the supported constructs (chat_fuzz.py);
 *  - token_ids.json: the bundled models' templates + tokenizers give the ids
 *    of apply_chat_template;
 *  - parse and render errors name the template line; the limits hold;
 *    loading from checkpoint directories; renders from several threads.
 * The fixtures come from tests/golden/make_chat_fixtures.py. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "chat_template.h"
#include "testlib.h"
#include "tokenizer.h"

#define FIXTURES "tests/golden/fixtures"

static char *read_all(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *d = malloc((size_t)sz + 1);
    if (d && fread(d, 1, (size_t)sz, f) != (size_t)sz) {
        free(d);
        d = NULL;
    }
    fclose(f);
    if (d)
        d[sz] = 0;
    return d;
}

static cJSON *read_json(const char *rel)
{
    char *text = read_all(test_src_path(rel));
    CHECKF(text != NULL, "cannot read %s", rel);
    if (!text)
        return NULL;
    cJSON *j = cJSON_Parse(text);
    free(text);
    CHECKF(j != NULL, "%s: not JSON", rel);
    return j;
}

static const char *opt_str(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static struct chat_template_vars case_vars(const cJSON *c)
{
    struct chat_template_vars v = {
        .messages = cJSON_GetObjectItemCaseSensitive(c, "messages"),
        .add_generation_prompt =
            cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(c, "add_generation_prompt")),
        .bos_token = opt_str(c, "bos_token"),
        .eos_token = opt_str(c, "eos_token"),
        .extra = cJSON_GetObjectItemCaseSensitive(c, "extra"),
    };
    if (v.extra && !cJSON_IsObject(v.extra))
        v.extra = NULL;
    return v;
}

/* Renders `t` for case `c` and checks "out" (or that it fails, for "error"). */
static void check_case(const struct chat_template *t, const cJSON *c, const char *what)
{
    struct chat_template_vars vars = case_vars(c);
    char *out = NULL;
    struct moe_error err = {0};
    enum moe_status st = chat_template_render(t, &vars, &out, &err);
    const char *want = opt_str(c, "out");
    if (want) {
        CHECKF(st == MOE_OK, "%s: %s", what, err.msg);
        if (st == MOE_OK) {
            CHECKF(strcmp(out, want) == 0, "%s: rendered\n%s\n--- jinja2 rendered\n%s", what, out,
                   want);
        }
    } else {
        const char *jerr = opt_str(c, "error");
        CHECKF(st != MOE_OK && out == NULL, "%s: rendered although jinja2 fails (%s)", what,
               jerr ? jerr : "?");
        CHECKF(st == MOE_OK || strlen(err.msg) > 0, "%s: failed without a message", what);
    }
    free(out);
}

static struct chat_template *load_corpus_template(const char *name)
{
    char rel[512];
    struct moe_error err = {0};
    struct chat_template *t;
    if (!strncmp(name, "model:", 6)) {
        snprintf(rel, sizeof(rel), FIXTURES "/%s", name + 6);
        t = chat_template_load(test_src_path(rel), &err);
    } else {
        snprintf(rel, sizeof(rel), FIXTURES "/chat_templates/%s", name);
        t = chat_template_load_file(test_src_path(rel), &err);
    }
    CHECKF(t != NULL, "%s: %s", name, err.msg);
    return t;
}

static void test_corpus(void)
{
    cJSON *j = read_json(FIXTURES "/chat_templates/expected.json");
    if (!j)
        return;
    const cJSON *c;
    int n = 0;
    cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(j, "cases"))
    {
        const char *name = opt_str(c, "template");
        struct chat_template *t = load_corpus_template(name);
        if (!t)
            continue;
        char what[256];
        snprintf(what, sizeof(what), "%s x %s (add_generation_prompt=%d)", name,
                 opt_str(c, "conversation"),
                 cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(c, "add_generation_prompt")));
        check_case(t, c, what);
        chat_template_destroy(t);
        n++;
    }
    printf("corpus: %d template x conversation cases\n", n);
    CHECK(n >= 200);
    cJSON_Delete(j);
}

static void test_fuzz_fixture(void)
{
    cJSON *j = read_json(FIXTURES "/chat_templates/fuzz.json");
    if (!j)
        return;
    const cJSON *c;
    int n = 0;
    cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(j, "cases"))
    {
        char what[64];
        snprintf(what, sizeof(what), "fuzz.json case %d", n);
        struct moe_error err = {0};
        struct chat_template *t = chat_template_parse(opt_str(c, "template"), "fuzz", &err);
        if (!t) {
            CHECKF(opt_str(c, "error") != NULL, "%s: %s", what, err.msg);
        } else {
            check_case(t, c, what);
            chat_template_destroy(t);
        }
        n++;
    }
    printf("fuzz fixture: %d cases\n", n);
    CHECK(n >= 100);
    cJSON_Delete(j);
}

static void test_token_ids(void)
{
    cJSON *j = read_json(FIXTURES "/chat_templates/token_ids.json");
    if (!j)
        return;
    const char *models[] = {"qwen3_moe", "mixtral"};
    int n = 0;
    for (int m = 0; m < 2; m++) {
        char rel[256];
        snprintf(rel, sizeof(rel), FIXTURES "/%s", models[m]);
        char dir[1024];
        snprintf(dir, sizeof(dir), "%s", test_src_path(rel));
        struct moe_error err = {0};
        struct chat_template *t = chat_template_load(dir, &err);
        CHECKF(t != NULL, "%s: %s", dir, err.msg);
        snprintf(rel, sizeof(rel), FIXTURES "/%s/tokenizer.json", models[m]);
        struct moe_tokenizer *tok = NULL;
        CHECKF(moe_tokenizer_load(test_src_path(rel), &tok, &err) == MOE_OK, "%s", err.msg);
        if (!t || !tok) {
            chat_template_destroy(t);
            moe_tokenizer_free(tok);
            continue;
        }
        const cJSON *c;
        cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(j, "cases"))
        {
            if (strcmp(opt_str(c, "model"), models[m]) != 0)
                continue;
            char what[256];
            snprintf(what, sizeof(what), "%s x %s (add_generation_prompt=%d)", models[m],
                     opt_str(c, "conversation"),
                     cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(c, "add_generation_prompt")));
            struct chat_template_vars vars = case_vars(c);
            char *out = NULL;
            if (chat_template_render(t, &vars, &out, &err) != MOE_OK) {
                CHECKF(0, "%s: %s", what, err.msg);
                continue;
            }
            CHECKF(strcmp(out, opt_str(c, "text")) == 0, "%s: text differs", what);
            int32_t *ids = NULL;
            size_t n_ids = 0;
            CHECKF(moe_tokenizer_encode(tok, out, strlen(out), false, &ids, &n_ids, &err) == MOE_OK,
                   "%s: %s", what, err.msg);
            const cJSON *want = cJSON_GetObjectItemCaseSensitive(c, "ids");
            bool same = ids && (size_t)cJSON_GetArraySize(want) == n_ids;
            size_t k = 0;
            const cJSON *e;
            cJSON_ArrayForEach(e, want)
            {
                if (same && ids[k] != (int32_t)e->valuedouble)
                    same = false;
                k++;
            }
            CHECKF(same, "%s: %zu token ids differ from transformers' %d", what, n_ids,
                   cJSON_GetArraySize(want));
            free(ids);
            free(out);
            n++;
        }
        chat_template_destroy(t);
        moe_tokenizer_free(tok);
    }
    printf("token ids: %d cases equal transformers' apply_chat_template\n", n);
    CHECK(n >= 30);
    cJSON_Delete(j);
}

/* ---- errors ------------------------------------------------------------------------- */

struct err_case {
    const char *src;
    const char *want; /* substring of the message */
};

static const struct err_case parse_errors[] = {
    {"{{ messages | wordwrap }}", "t.jinja:1: unknown filter 'wordwrap'"},
    {"a\nb\n{% filter upper %}x{% endfilter %}", "t.jinja:3: unsupported tag 'filter'"},
    {"{% include 'x.jinja' %}", "t.jinja:1: unsupported tag 'include'"},
    {"{% frobnicate %}", "t.jinja:1: unknown tag 'frobnicate'"},
    {"x\n{% if true %}\nno end", "t.jinja:2: unclosed block: expected 'elif' or 'else' or 'endif'"},
    {"{% for m in messages %}\n{{ m }}", "t.jinja:1: unclosed block"},
    {"{% macro f() %}", "t.jinja:1: unclosed block"},
    {"\n\n{% endif %}", "t.jinja:3: unexpected 'endif'"},
    {"{% if x %}{% endfor %}", "t.jinja:1: unexpected 'endfor'"},
    {"{{ x is frobnicated }}", "t.jinja:1: unknown test 'frobnicated'"},
    {"{{ lipsum(3) }}", "t.jinja:1: unknown function 'lipsum'"},
    {"{{ 'x'.zfill(3) }}", "t.jinja:1: unknown method 'zfill'"},
    {"{{ {}.pop('a') }}", "t.jinja:1: unknown method 'pop'"},
    {"{{ messages|map('wordwrap')|list }}", "unknown filter 'wordwrap' (in map)"},
    {"{{ messages|select('prime')|list }}", "unknown test 'prime' (in select)"},
    {"{% for x in y recursive %}{% endfor %}", "recursive for loops are not supported"},
    {"{{ 'a' }", "t.jinja:1: "},
    {"{# never closed", "t.jinja:1: unclosed comment"},
    {"{{ 'abc }}", "t.jinja:1: unterminated string"},
    {"{% break %}", "t.jinja:1: 'break' outside a for loop"},
    {"{% for x in y %}{% macro m() %}{% continue %}{% endmacro %}{% endfor %}",
     "outside a for loop"},
    {"{{ 99999999999999999999 }}", "does not fit in 64 bits"},
    {"ok\n\xff\xfe", "t.jinja:2: the template is not valid UTF-8"},
    {"{{ f(*args) }}", "*args and **kwargs in calls are not supported"},
    {"{{ a $ b }}", "unexpected character '$'"},
    {"{% set 1 = 2 %}", "t.jinja:1: expected a name"},
};

static const struct err_case render_errors[] = {
    {"x\n{{ raise_exception('Roles must alternate') }}",
     "t.jinja:2: raise_exception: Roles must alternate"},
    {"{{ 'a'.upper(1) }}", "t.jinja:1: upper takes at most 0 argument(s)"},
    {"\n{{ x.y }}", "t.jinja:2: 'x' is undefined"},
    {"{{ 1 + 'a' }}", "unsupported operand type(s) for +: 'int' and 'str'"},
    {"{{ [1].startswith('a') }}", "'startswith' is undefined"},
    {"{{ [1, 2]|reverse|length }}", "has no len()"},
    {"{{ none|tojson }}{{ x|tojson }}", "Object of type Undefined is not JSON serializable"},
    {"{{ '%s' % 1 }}", "printf-style string formatting (%) is not supported"},
    {"{% set ns = 3 %}{% set ns.a = 1 %}", "not a namespace object"},
    {"{% set ns = namespace(_x=1) %}", "cannot start with '_'"},
    {"{{ 9223372036854775807 + 1 }}", "does not fit in 64 bits"},
    {"{{ 1 // 0 }}", "integer division or modulo by zero"},
    {"{{ 1 < 'a' }}", "'<' not supported between instances of 'int' and 'str'"},
    {"{% for a, b in [1] %}{% endfor %}", "'int' object is not iterable"},
    {"{{ range(1000000)|length }}", "range too big"},
    {"{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
     "macro calls nest deeper than 64 (the limit)"},
    {"{% for i in range(100000) %}{% for j in range(100) %}{% endfor %}{% endfor %}",
     "more than 1000000 loop iterations and macro calls (the limit)"},
    {"{% for i in range(20000) %}{{ 'x' * 1000 }}{% endfor %}",
     "output exceeds 16 MiB (the limit)"},
    {"{{ 'ab' * 100000000 }}", "exceeds the 16 MiB output limit"},
    {"{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}",
     "16 MiB"},
    {"{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + [i] %}"
     "{% endfor %}",
     "render used more than 256 MiB of memory (the limit)"},
};

static void test_errors(void)
{
    for (size_t i = 0; i < sizeof(parse_errors) / sizeof(parse_errors[0]); i++) {
        struct moe_error err = {0};
        struct chat_template *t = chat_template_parse(parse_errors[i].src, "t.jinja", &err);
        CHECKF(t == NULL && strstr(err.msg, parse_errors[i].want),
               "parse of %s: got '%s', want '%s'", parse_errors[i].src, err.msg,
               parse_errors[i].want);
        chat_template_destroy(t);
    }
    cJSON *msgs = cJSON_Parse("[{\"role\": \"user\", \"content\": \"hi\"}]");
    for (size_t i = 0; i < sizeof(render_errors) / sizeof(render_errors[0]); i++) {
        struct moe_error err = {0};
        struct chat_template *t = chat_template_parse(render_errors[i].src, "t.jinja", &err);
        CHECKF(t != NULL, "%s: %s", render_errors[i].src, err.msg);
        if (!t)
            continue;
        struct chat_template_vars vars = {.messages = msgs};
        char *out = (char *)1;
        enum moe_status st = chat_template_render(t, &vars, &out, &err);
        CHECKF(st != MOE_OK && out == NULL && strstr(err.msg, render_errors[i].want),
               "render of %s: got '%s', want '%s'", render_errors[i].src,
               st == MOE_OK ? "(no error)" : err.msg, render_errors[i].want);
        chat_template_destroy(t);
    }
    /* bad variables */
    struct moe_error err = {0};
    struct chat_template *t = chat_template_parse("{{ messages }}", "t.jinja", &err);
    cJSON *not_list = cJSON_Parse("{\"role\": \"user\"}");
    struct chat_template_vars vars = {.messages = not_list};
    char *out = NULL;
    CHECK(chat_template_render(t, &vars, &out, &err) == MOE_ERR_INVALID && !out);
    CHECK(strstr(err.msg, "messages must be a JSON array") != NULL);
    cJSON *bad_msg = cJSON_Parse("[\"just a string\"]");
    vars.messages = bad_msg;
    CHECK(chat_template_render(t, &vars, &out, &err) == MOE_ERR_INVALID && !out);
    CHECK(strstr(err.msg, "messages[0]: a message must be an object") != NULL);
    cJSON_Delete(not_list);
    cJSON_Delete(bad_msg);
    chat_template_destroy(t);
    /* deep nesting is a parse error, not a stack overflow */
    char deep[1300];
    memset(deep, 0, sizeof(deep));
    strcpy(deep, "{{ ");
    for (int i = 0; i < 600; i++)
        strcat(deep, "(");
    strcat(deep, "1");
    for (int i = 0; i < 600; i++)
        strcat(deep, ")");
    strcat(deep, " }}");
    t = chat_template_parse(deep, "t.jinja", &err);
    CHECKF(!t && strstr(err.msg, "template nests deeper than 200 (the limit)"), "%s", err.msg);
    /* so does a long operator chain (a left-deep tree) */
    memset(deep, 0, sizeof(deep));
    strcpy(deep, "{{ 1");
    for (int i = 0; i < 250; i++)
        strcat(deep, " + 1");
    strcat(deep, " }}");
    t = chat_template_parse(deep, "t.jinja", &err);
    CHECKF(!t && strstr(err.msg, "template nests deeper than 200 (the limit)"), "%s", err.msg);
    /* recursion through macros stops at the frame limit: test_small_stack */
    cJSON_Delete(msgs);
}

/* ---- semantics that are easy to get wrong ------------------------------------------ */

struct sem_case {
    const char *src;
    const char *want;
};

static const struct sem_case semantics[] = {
    {"{{ 1.0 }} {{ 1e20 }} {{ 0.1 + 0.2 }} {{ 10 / 4 }} {{ 1e-5 }} {{ -7 // 2 }} {{ -7 % 3 }}",
     "1.0 1e+20 0.30000000000000004 2.5 1e-05 -4 2"},
    {"{{ '<a href=\"x\">&\\'' | tojson }}", "\"<a href=\\\"x\\\">&'\""}, /* no HTML escaping */
    {"{{ 'é🙂\\n' | tojson }}|{{ 'é' | tojson(ensure_ascii=true) }}",
     "\"é🙂\\n\"|\"\\u00e9\""},
    {"{{ {'b': 1, 'a': [1, 2.5, none, true]} | tojson }}",
     "{\"b\": 1, \"a\": [1, 2.5, null, true]}"},
    {"{{ {'a': [1]} | tojson(indent=2) }}", "{\n  \"a\": [\n    1\n  ]\n}"},
    {"{{ undefined_thing }}|{{ undefined_thing is defined }}|{{ undefined_thing|default('d') }}",
     "|False|d"},
    {"{{ none }} {{ true }} {{ [1, 'a', none] }} {{ {'k': 'v'} }} {{ (1,) }}",
     "None True [1, 'a', None] {'k': 'v'} (1,)"},
    {"  {% if true %}\n  x\n  {% endif %}\nend\n", "  x\nend"}, /* trim/lstrip, no final \n */
    {"a  {%- if true -%}  b  {%- endif -%}  c", "abc"},
    {"{% for i in [1, 2, 3] %}{{ loop.index }}{{ loop.revindex0 }}{{ loop.first }}{% endfor %}",
     "12True21False30False"},
    {"{{ messages[-1].content }}{{ messages[::-1][0].role }}{{ messages[5] }}", "hiuser"},
    {"{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{% endfor %}{{ x }}", "1"},
    {"{{ 'straße'|upper }} {{ 'ǅ'|lower }} {{ 'hello wORLD'.title() }} {{ 'a-b c'|title }}",
     "STRASSE ǆ Hello World A-B C"},
    {"{{ '  a  b '.split() }}{{ 'a,,b'.split(',') }}{{ ' x '|trim }}", "['a', 'b']['a', '', 'b']x"},
    {"{{ '日本語'|length }}{{ '日本語'[1] }}{{ '日本語'[::-1] }}", "3本語本日"},
};

static void test_semantics(void)
{
    cJSON *msgs = cJSON_Parse("[{\"role\": \"user\", \"content\": \"hi\"}]");
    for (size_t i = 0; i < sizeof(semantics) / sizeof(semantics[0]); i++) {
        struct moe_error err = {0};
        struct chat_template *t = chat_template_parse(semantics[i].src, "t.jinja", &err);
        CHECKF(t != NULL, "%s: %s", semantics[i].src, err.msg);
        if (!t)
            continue;
        struct chat_template_vars vars = {.messages = msgs};
        char *out = NULL;
        CHECKF(chat_template_render(t, &vars, &out, &err) == MOE_OK, "%s: %s", semantics[i].src,
               err.msg);
        CHECKF(out && !strcmp(out, semantics[i].want), "%s: got '%s', want '%s'", semantics[i].src,
               out ? out : "", semantics[i].want);
        free(out);
        chat_template_destroy(t);
    }
    cJSON_Delete(msgs);
}

/* ---- loading ---------------------------------------------------------------------- */

static const char *write_dir_file(const char *dir, const char *name, const char *text)
{
    static char path[1024];
    mkdir(dir, 0755);
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) {
        fputs(text, f);
        fclose(f);
    }
    return path;
}

static char *render_simple(const struct chat_template *t)
{
    cJSON *msgs = cJSON_Parse("[{\"role\": \"user\", \"content\": \"hi\"}]");
    struct chat_template_vars vars = {.messages = msgs, .add_generation_prompt = true};
    char *out = NULL;
    struct moe_error err = {0};
    if (chat_template_render(t, &vars, &out, &err) != MOE_OK)
        fprintf(stderr, "render: %s\n", err.msg);
    cJSON_Delete(msgs);
    return out;
}

static void test_load(void)
{
    char dir[1024];
    struct moe_error err = {0};
    /* the bundled models */
    snprintf(dir, sizeof(dir), "%s", test_src_path(FIXTURES "/qwen3_moe"));
    struct chat_template *t = chat_template_load(dir, &err);
    CHECKF(t != NULL, "%s", err.msg);
    CHECK(t && !strcmp(chat_template_bos(t), "") && !strcmp(chat_template_eos(t), "<|im_end|>"));
    chat_template_destroy(t);
    snprintf(dir, sizeof(dir), "%s", test_src_path(FIXTURES "/mixtral"));
    t = chat_template_load(dir, &err);
    CHECKF(t != NULL, "%s", err.msg);
    CHECK(t && !strcmp(chat_template_bos(t), "<s>") && !strcmp(chat_template_eos(t), "</s>"));
    char *out = t ? render_simple(t) : NULL;
    CHECKF(out && !strcmp(out, "<s>[INST] hi [/INST]"), "mixtral: %s", out ? out : "(null)");
    free(out);
    chat_template_destroy(t);

    /* no template at all */
    snprintf(dir, sizeof(dir), "%s/none", test_temp_dir());
    write_dir_file(dir, "tokenizer_config.json", "{\"bos_token\": \"<s>\"}");
    t = chat_template_load(dir, &err);
    CHECK(!t && err.code == MOE_ERR_NOT_FOUND);
    snprintf(dir, sizeof(dir), "%s/empty", test_temp_dir());
    mkdir(dir, 0755);
    t = chat_template_load(dir, &err);
    CHECK(!t && err.code == MOE_ERR_NOT_FOUND);

    /* a list of named templates; bos/eos as AddedToken objects */
    snprintf(dir, sizeof(dir), "%s/list", test_temp_dir());
    write_dir_file(dir, "tokenizer_config.json",
                   "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"TOOLS\"},"
                   " {\"name\": \"default\", \"template\": \"{{ bos_token }}D{{ eos_token }}\"}],"
                   " \"bos_token\": {\"__type\": \"AddedToken\", \"content\": \"<B>\"},"
                   " \"eos_token\": \"<E>\"}");
    t = chat_template_load(dir, &err);
    CHECKF(t != NULL, "%s", err.msg);
    out = t ? render_simple(t) : NULL;
    CHECKF(out && !strcmp(out, "<B>D<E>"), "list form: %s", out ? out : "(null)");
    free(out);
    chat_template_destroy(t);
    /* bos/eos given by the caller win */
    t = chat_template_parse("{{ bos_token }}|{{ eos_token }}|{{ bos_token is defined }}", "x",
                            &err);
    cJSON *msgs = cJSON_Parse("[]");
    struct chat_template_vars vars = {.messages = msgs, .bos_token = "<b>", .eos_token = "<e>"};
    CHECK(chat_template_render(t, &vars, &out, &err) == MOE_OK && !strcmp(out, "<b>|<e>|True"));
    free(out);
    vars.bos_token = vars.eos_token = NULL; /* unknown: undefined, as transformers leaves it */
    CHECK(chat_template_render(t, &vars, &out, &err) == MOE_OK && !strcmp(out, "||False"));
    free(out);
    cJSON_Delete(msgs);
    chat_template_destroy(t);

    /* no "default" among named templates */
    snprintf(dir, sizeof(dir), "%s/nodefault", test_temp_dir());
    write_dir_file(dir, "tokenizer_config.json",
                   "{\"chat_template\": [{\"name\": \"rag\", \"template\": \"R\"}]}");
    t = chat_template_load(dir, &err);
    CHECK(!t && err.code == MOE_ERR_FORMAT && strstr(err.msg, "none is named \"default\""));

    /* chat_template.jinja wins over tokenizer_config.json; errors name the file and line */
    snprintf(dir, sizeof(dir), "%s/jinja", test_temp_dir());
    write_dir_file(dir, "tokenizer_config.json", "{\"chat_template\": \"CONFIG\"}");
    write_dir_file(dir, "chat_template.jinja", "FILE\n");
    t = chat_template_load(dir, &err);
    out = t ? render_simple(t) : NULL;
    CHECKF(out && !strcmp(out, "FILE"), "jinja file: %s", out ? out : "(null)");
    free(out);
    chat_template_destroy(t);
    const char *bad = write_dir_file(dir, "chat_template.jinja", "line one\n{{ x | wordwrap }}\n");
    t = chat_template_load(dir, &err);
    char want[1200];
    snprintf(want, sizeof(want), "%s:2: unknown filter 'wordwrap'", bad);
    CHECKF(!t && strstr(err.msg, want), "got '%s', want '%s'", err.msg, want);
    remove(bad);
    write_dir_file(dir, "tokenizer_config.json", "{\"chat_template\": \"a\\n{% if %}\"}");
    t = chat_template_load(dir, &err);
    CHECKF(!t && strstr(err.msg, "tokenizer_config.json:chat_template:2: "), "%s", err.msg);
    write_dir_file(dir, "tokenizer_config.json", "{not json");
    t = chat_template_load(dir, &err);
    CHECKF(!t && err.code == MOE_ERR_FORMAT && strstr(err.msg, "tokenizer_config.json"), "%s",
           err.msg);
    t = chat_template_load_file("/nonexistent/chat.jinja", &err);
    CHECK(!t && err.code == MOE_ERR_NOT_FOUND && strstr(err.msg, "/nonexistent/chat.jinja"));
    chat_template_destroy(NULL);
    CHECK(!strcmp(chat_template_bos(NULL), ""));
}

/* ---- threads ---------------------------------------------------------------------- */

struct thread_arg {
    const struct chat_template *t;
    const cJSON *c;
    const char *want;
    int fails;
};

static void *render_thread(void *p)
{
    struct thread_arg *a = p;
    struct chat_template_vars vars = case_vars(a->c);
    for (int i = 0; i < 50; i++) {
        char *out = NULL;
        struct moe_error err = {0};
        if (chat_template_render(a->t, &vars, &out, &err) != MOE_OK || strcmp(out, a->want))
            a->fails++;
        free(out);
    }
    return NULL;
}

static void test_threads(void)
{
    cJSON *j = read_json(FIXTURES "/chat_templates/expected.json");
    if (!j)
        return;
    const cJSON *c, *pick = NULL;
    cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(j, "cases"))
    {
        if (!strcmp(opt_str(c, "template"), "qwen3_style.jinja") &&
            !strcmp(opt_str(c, "conversation"), "tools") && opt_str(c, "out"))
            pick = c;
    }
    CHECK(pick != NULL);
    struct chat_template *t = pick ? load_corpus_template("qwen3_style.jinja") : NULL;
    if (t) {
        struct thread_arg args[4];
        pthread_t th[4];
        for (int i = 0; i < 4; i++) {
            args[i] = (struct thread_arg){.t = t, .c = pick, .want = opt_str(pick, "out")};
            pthread_create(&th[i], NULL, render_thread, &args[i]);
        }
        for (int i = 0; i < 4; i++) {
            pthread_join(th[i], NULL);
            CHECKF(args[i].fails == 0, "thread %d: %d renders differ", i, args[i].fails);
        }
        /* speed: renders of a real-size template */
        struct chat_template_vars vars = case_vars(pick);
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        int n = 500;
        for (int i = 0; i < n; i++) {
            char *out = NULL;
            struct moe_error err = {0};
            chat_template_render(t, &vars, &out, &err);
            free(out);
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double us =
            ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / 1e3 / n;
        printf("render: %.1f us per render of qwen3_style x tools (%zu bytes)\n", us,
               strlen(opt_str(pick, "out")));
    }
    chat_template_destroy(t);
    cJSON_Delete(j);
}

/* The worst case the limits allow (macros recursing inside a deep
 * expression until the frame limit) fits a 512 KiB thread stack, as the
 * header promises. Sanitizers need bigger frames. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SMALL_STACK (4u << 20)
#else
#define SMALL_STACK (512u << 10)
#endif

static void *deep_render(void *p)
{
    char expr[1024] = "";
    for (int i = 0; i < 60; i++)
        strcat(expr, "(");
    strcat(expr, "(f(n + 1) if n < 100 else '')");
    for (int i = 0; i < 60; i++)
        strcat(expr, " ~ '')");
    char src[2048];
    snprintf(src, sizeof(src), "{%% macro f(n) %%}{{ %s }}{%% endmacro %%}{{ f(0) }}", expr);
    struct moe_error err = {0};
    struct chat_template *t = chat_template_parse(src, "deep", &err);
    cJSON *msgs = cJSON_Parse("[]");
    struct chat_template_vars vars = {.messages = msgs};
    char *out = NULL;
    enum moe_status st = t ? chat_template_render(t, &vars, &out, &err) : MOE_ERR_INTERNAL;
    *(bool *)p = st == MOE_ERR_INVALID && strstr(err.msg, "evaluation nests deeper than 1000");
    if (!*(bool *)p)
        fprintf(stderr, "deep render: %s\n", err.msg);
    free(out);
    cJSON_Delete(msgs);
    chat_template_destroy(t);
    return NULL;
}

static void test_small_stack(void)
{
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, SMALL_STACK);
    pthread_t th;
    bool ok = false;
    CHECK(pthread_create(&th, &attr, deep_render, &ok) == 0);
    pthread_join(th, NULL);
    pthread_attr_destroy(&attr);
    CHECKF(ok, "the frame limit did not stop the render in a %u KiB stack", SMALL_STACK >> 10);
}

int main(void)
{
    test_corpus();
    test_fuzz_fixture();
    test_token_ids();
    test_errors();
    test_semantics();
    test_load();
    test_threads();
    test_small_stack();
    return test_summary();
}
