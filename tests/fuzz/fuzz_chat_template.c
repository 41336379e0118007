/* Fuzz target: chat templates (common/chat_template.c and jinja_*.c):
 * parse a template, then render it twice with a message list.
 *
 * Input: the template source, optionally followed by a NUL byte and the
 * variables. The variables are a JSON object {"messages": [...],
 * "add_generation_prompt": b, "bos_token": s, "eos_token": s, "extra": {...}}
 * (the shape of tests/golden/fixtures/chat_templates/fuzz.json cases) when
 * they parse as one; otherwise their bytes are split at 0x01 into messages
 * (first byte: role and flags, the rest: content, any bytes); with no
 * variables at all a fixed four-turn conversation is used.
 *
 * What must hold: parse and render never crash, hang or leak (the renderer
 * has output, step, depth and memory limits, so a slow input is a bug);
 * errors are one line naming the template; the rendered text is within the
 * output limit; a second render of the same parsed template gives the same
 * text (rendering does not change the template). */
#include <cjson/cJSON.h>

#include "chat_template.h"
#include "fuzz.h"

#define NAME "fuzz.jinja"

static const char *const roles[4] = {"system", "user", "assistant", "tool"};

static const char default_extra[] =
    "{\"s\": \"\\n\\nlead\", \"n\": 5, \"f\": 2.5e-05, \"lst\": [\"b\"], \"words\": [\"x-y z\", "
    "\"\"], \"d\": {\"k\": \"\\u00c9COLE stra\\u00dfe\", \"n\": 1, \"nested\": {\"x\": [1, 2]}}, "
    "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get\", \"description\": \"Get "
    "<it> & 'more'\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": "
    "{\"type\": \"string\"}}}}}]}";

static cJSON *message(const char *role, const char *content, size_t len, int flags)
{
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", role);
    char *c = fuzz_cstr((const uint8_t *)content, len);
    cJSON_AddStringToObject(m, "content", c ? c : "");
    if (flags & 1)
        cJSON_AddStringToObject(m, "reasoning_content", c ? c : "");
    if (flags & 2) {
        cJSON *calls = cJSON_AddArrayToObject(m, "tool_calls");
        cJSON *call = cJSON_CreateObject();
        cJSON *fn = cJSON_AddObjectToObject(call, "function");
        cJSON_AddStringToObject(call, "type", "function");
        cJSON_AddStringToObject(call, "id", "call_1");
        cJSON_AddStringToObject(fn, "name", "get");
        cJSON *args = cJSON_AddObjectToObject(fn, "arguments");
        cJSON_AddStringToObject(args, "city", c ? c : "");
        cJSON_AddItemToArray(calls, call);
    }
    if (flags & 4)
        cJSON_AddNullToObject(m, "name");
    free(c);
    return m;
}

/* The variables from the bytes after the template (see above). */
static cJSON *variables(const uint8_t *v, size_t n, bool have)
{
    if (have) {
        cJSON *j = cJSON_ParseWithLength((const char *)v, n);
        if (cJSON_IsObject(j) && cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(j, "messages")))
            return j;
        cJSON_Delete(j);
    }
    cJSON *j = cJSON_CreateObject();
    cJSON *msgs = cJSON_AddArrayToObject(j, "messages");
    if (!have) {
        static const char *const turns[4] = {"You are terse.", "What is an expert?",
                                             "A feed-forward block.", "How many per token?"};
        for (int i = 0; i < 4; i++)
            cJSON_AddItemToArray(msgs,
                                 message(roles[i ? 2 - i % 2 : 0], turns[i], strlen(turns[i]), 0));
        cJSON_AddBoolToObject(j, "add_generation_prompt", 1);
    } else {
        int k = 0;
        for (size_t at = 0; at < n && k < 64; k++) {
            const uint8_t *end = memchr(v + at, 1, n - at);
            size_t len = (end ? (size_t)(end - v) : n) - at;
            int flags = len ? v[at] : 0;
            cJSON_AddItemToArray(msgs, message(roles[flags & 3], (const char *)v + at + !!len,
                                               len ? len - 1 : 0, flags >> 2));
            at += len + 1;
            if (k == 0)
                cJSON_AddBoolToObject(j, "add_generation_prompt", flags & 0x80);
        }
    }
    cJSON_AddItemToObject(j, "extra", cJSON_Parse(default_extra));
    return j;
}

static const char *str_or_null(const cJSON *j)
{
    return cJSON_IsString(j) ? j->valuestring : NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    size_t tlen = nul ? (size_t)(nul - data) : size;
    char *src = fuzz_cstr(data, tlen);
    if (!src)
        return 0;
    struct moe_error err = {0};
    struct chat_template *t = chat_template_parse(src, NAME, &err);
    if (!t) {
        FUZZ_CHECK(err.code != MOE_OK && fuzz_msg_ok(err.msg) &&
                       (err.code == MOE_ERR_NOMEM || strstr(err.msg, NAME)),
                   "parse error %d: '%s'", err.code, err.msg);
        free(src);
        return 0;
    }
    cJSON *vars = nul ? variables(nul + 1, size - tlen - 1, true) : variables(NULL, 0, false);
    const cJSON *extra = cJSON_GetObjectItemCaseSensitive(vars, "extra");
    struct chat_template_vars v = {
        .messages = cJSON_GetObjectItemCaseSensitive(vars, "messages"),
        .add_generation_prompt =
            cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(vars, "add_generation_prompt")),
        .bos_token = str_or_null(cJSON_GetObjectItemCaseSensitive(vars, "bos_token")),
        .eos_token = str_or_null(cJSON_GetObjectItemCaseSensitive(vars, "eos_token")),
        .extra = cJSON_IsObject(extra) ? extra : NULL};
    char *out = (char *)1;
    enum moe_status st = chat_template_render(t, &v, &out, &err);
    if (st != MOE_OK) {
        FUZZ_CHECK(out == NULL && err.code == st && fuzz_msg_ok(err.msg) &&
                       (st == MOE_ERR_NOMEM || strstr(err.msg, NAME)),
                   "render error %d: '%s'", st, err.msg);
    } else {
        FUZZ_CHECK(out && strlen(out) <= CHAT_TEMPLATE_MAX_OUTPUT, "output of %zu bytes",
                   out ? strlen(out) : 0);
        if (!strstr(src, "strftime_now")) { /* the clock may tick between two renders */
            char *again = NULL;
            struct moe_error err2 = {0};
            FUZZ_CHECK(chat_template_render(t, &v, &again, &err2) == MOE_OK && !strcmp(out, again),
                       "a second render differs: %s", err2.msg);
            free(again);
        }
        free(out);
    }
    cJSON_Delete(vars);
    chat_template_destroy(t);
    free(src);
    return 0;
}
