/* Renders a batch of chat-template cases with common/chat_template.c, for
 * the Python tests that compare it with jinja2 (test_chat_live.py,
 * chat_fuzz.py):
 *
 *   chat_render CASES.json > RESULTS.json
 *
 * CASES.json: [{"template", "messages", "add_generation_prompt",
 * "bos_token", "eos_token", "extra"}, ...]; RESULTS.json: one object per
 * case, {"out": text} or {"error": message, "parse": true|false}. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "chat_template.h"

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    if (buf)
        buf[n] = 0;
    fclose(f);
    return buf;
}

static const char *opt_str(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: chat_render CASES.json\n");
        return 2;
    }
    char *text = slurp(argv[1]);
    if (!text) {
        fprintf(stderr, "chat_render: cannot read %s\n", argv[1]);
        return 2;
    }
    cJSON *cases = cJSON_Parse(text);
    free(text);
    if (!cJSON_IsArray(cases)) {
        fprintf(stderr, "chat_render: %s: not a JSON array\n", argv[1]);
        return 2;
    }
    cJSON *results = cJSON_CreateArray();
    const cJSON *c;
    cJSON_ArrayForEach(c, cases)
    {
        cJSON *r = cJSON_CreateObject();
        struct moe_error err = {0};
        const char *src = opt_str(c, "template");
        struct chat_template *t = chat_template_parse(src ? src : "", "tmpl", &err);
        if (!t) {
            cJSON_AddStringToObject(r, "error", err.msg);
            cJSON_AddBoolToObject(r, "parse", 1);
        } else {
            struct chat_template_vars vars = {
                .messages = cJSON_GetObjectItemCaseSensitive(c, "messages"),
                .add_generation_prompt =
                    cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(c, "add_generation_prompt")),
                .bos_token = opt_str(c, "bos_token"),
                .eos_token = opt_str(c, "eos_token"),
                .extra = cJSON_GetObjectItemCaseSensitive(c, "extra"),
            };
            if (cJSON_IsNull(vars.extra))
                vars.extra = NULL;
            char *out = NULL;
            if (chat_template_render(t, &vars, &out, &err) == MOE_OK) {
                cJSON_AddStringToObject(r, "out", out);
            } else {
                cJSON_AddStringToObject(r, "error", err.msg);
                cJSON_AddBoolToObject(r, "parse", 0);
            }
            free(out);
            chat_template_destroy(t);
        }
        cJSON_AddItemToArray(results, r);
    }
    char *s = cJSON_PrintUnformatted(results);
    fputs(s, stdout);
    fputc('\n', stdout);
    free(s);
    cJSON_Delete(results);
    cJSON_Delete(cases);
    return 0;
}
