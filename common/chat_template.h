/* Chat templates: the Jinja subset that model checkpoints' chat templates
 * use, rendered exactly as Hugging Face transformers' apply_chat_template
 * renders them with Python jinja2 (the test oracle).
 *
 * Environment (as transformers builds it): trim_blocks=True,
 * lstrip_blocks=True, the loop-controls extension ({% break %},
 * {% continue %}), a raise_exception(msg) global, a strftime_now(fmt) global,
 * and a `tojson` filter that is json.dumps(x, ensure_ascii=False,
 * indent=None, separators=None, sort_keys=False) -- NOT jinja2's own
 * HTML-escaping tojson: "<", ">", "&" and "'" are written as they are,
 * non-ASCII characters raw, separators ", " and ": ". `tojson(indent=N)`
 * indents as Python does.
 *
 * Ownership in one picture:
 *   chat_template_parse/_load/_load_file -> struct chat_template * (caller
 *   owns; chat_template_destroy frees). The parsed template is immutable:
 *   any number of threads may call chat_template_render on it at once.
 *   chat_template_render borrows vars (and the cJSON trees in it) for the
 *   call only, and returns a malloc'd string the caller frees.
 *
 * Supported subset: the constructs of the Qwen3, Mistral/Mixtral, Llama 3
 * and DeepSeek-V3 templates (for/if/set/macro, namespace(), loop.*,
 * slicing, tests, filters, string and dict methods); the exact list is in
 * the implementation commit's version of this comment.
 * Anything else (an unknown filter, test, tag or global) is an error at
 * parse time naming the template and line ("chat_template.jinja:12:
 * unknown filter 'wordwrap'"); runtime errors (raise_exception, a method on
 * the wrong type, arithmetic on incompatible types, the output or loop
 * limits below) name the line too.
 *
 * Limits (a hostile template or message cannot hang or exhaust memory):
 * CHAT_TEMPLATE_MAX_OUTPUT bytes of output, CHAT_TEMPLATE_MAX_STEPS loop
 * iterations plus macro calls in one render, CHAT_TEMPLATE_MAX_DEPTH nested
 * macro calls, CHAT_TEMPLATE_MAX_NEST nesting of the parsed template. */
#ifndef MOE_CHAT_TEMPLATE_H
#define MOE_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <cjson/cJSON.h>

#include "moe_error.h"

#define CHAT_TEMPLATE_MAX_OUTPUT (16u << 20) /* bytes of rendered prompt */
#define CHAT_TEMPLATE_MAX_STEPS 1000000      /* loop iterations + macro calls */
#define CHAT_TEMPLATE_MAX_DEPTH 64           /* nested macro calls */
#define CHAT_TEMPLATE_MAX_NEST 200           /* nested blocks/expressions */

struct chat_template;

/* Parses template source `src` (NUL-terminated UTF-8); `name` (e.g. a file
 * path) prefixes every error. Returns NULL and fills err on a syntax error
 * or unsupported construct, naming name:line. The caller owns the result. */
struct chat_template *chat_template_parse(const char *src, const char *name, struct moe_error *err);

/* Loads a checkpoint's template: DIR/chat_template.jinja if present, else
 * DIR/tokenizer_config.json "chat_template" (a string, or a list of
 * {"name","template"} where "default" is chosen). Also reads
 * "bos_token"/"eos_token" from tokenizer_config.json (string or
 * {"content": ...}) into the template. Returns NULL with err->code
 * MOE_ERR_NOT_FOUND if the checkpoint has no template; other errors name
 * the file. The caller owns the result. */
struct chat_template *chat_template_load(const char *model_dir, struct moe_error *err);

/* Like parse, from a file (--chat-template FILE); errors name the path.
 * bos/eos are "" (give them in chat_template_vars). */
struct chat_template *chat_template_load_file(const char *path, struct moe_error *err);

/* Frees the template; NULL is a no-op. */
void chat_template_destroy(struct chat_template *t);

/* The template's bos/eos token strings (from tokenizer_config.json), "" if
 * unknown. Owned by the template. */
const char *chat_template_bos(const struct chat_template *t);
const char *chat_template_eos(const struct chat_template *t);

struct chat_template_vars {
    const cJSON *messages; /* array of message objects, borrowed */
    bool add_generation_prompt;
    const char *bos_token; /* NULL: the template's own (from tokenizer_config.json) */
    const char *eos_token;
    const cJSON
        *extra; /* object of more top-level variables (tools, enable_thinking...), or NULL */
};

/* Renders into *out (malloc'd, NUL-terminated, caller frees). On error *out
 * is NULL and err names template:line and the problem. Thread-safe: a
 * parsed template may be rendered from many threads at once. */
enum moe_status chat_template_render(const struct chat_template *t,
                                     const struct chat_template_vars *vars, char **out,
                                     struct moe_error *err);

#endif
