/* Chat templates: the Jinja subset that model checkpoints' chat templates
 * use, rendered exactly as Hugging Face transformers' apply_chat_template
 * renders them with Python jinja2 (the test oracle).
 *
 * Environment, as transformers (5.x, utils/chat_template_utils.py) builds
 * it: ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
 * with the loop-controls extension ({% break %}, {% continue %}) and its
 * {% generation %} tag, a raise_exception(msg) global, a strftime_now(fmt)
 * global, dict() and a namespace() refusing names that start with "_",
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
 * Messages are prepared as apply_chat_template prepares them: keys whose
 * value is null are dropped, and reasoning given under any of
 * "reasoning_content", "thinking" or "reasoning" is visible as "thinking"
 * and "reasoning_content". The template sees messages,
 * add_generation_prompt, bos_token and eos_token (undefined when unknown,
 * as transformers leaves them), tools=none and documents=none unless
 * `extra` gives them, and every key of `extra` (but "messages" and
 * "add_generation_prompt" always come from the fields of that name).
 *
 * Supported (checked against jinja2 by tests/unit/test_chat_template.c and
 * the live tests/golden/test_chat_live.py and chat_fuzz.py):
 *   - text, {{ expr }}, {% tag %}, {# comment #}; whitespace control
 *     {%- -%} {{- -}} {#- -#} and {%+ +%}; trim_blocks/lstrip_blocks; the
 *     source's newlines normalized and one trailing newline dropped;
 *   - tags: if/elif/else, for/else (with `if` filter and unpacking
 *     `for k, v in d.items()`), break/continue, set (`x = e`, `a, b = e`,
 *     `ns.attr = e`), block set `{% set x | filter %}...{% endset %}`,
 *     macro (positional/keyword arguments, defaults) and macro calls,
 *     transformers' {% generation %}...{% endgeneration %};
 *   - scoping exactly as jinja2 compiles it (a loop iteration, loop else,
 *     macro, set block or generation block is a frame; names a frame
 *     assigns later are undefined in it until assigned: jinja_scope.c);
 *   - loop.index, index0, revindex, revindex0, first, last, length, depth,
 *     depth0, previtem, nextitem, cycle();
 *   - values: none, bool, int (64-bit), float (printed as Python's repr),
 *     str (UTF-8; len/index/slice by code point), list, tuple, dict
 *     (insertion ordered), namespace, undefined (jinja2's default Undefined:
 *     prints empty, false, iterates empty, `is defined` false; an attribute
 *     or item of it, or arithmetic on it, is an error); map/select results
 *     and dict views behave as Python's generators and views (a generator
 *     is always true and has no length);
 *   - expressions: literals, [..], {..}, (..), attribute and item access
 *     (methods first for x.y, items first for x[y]), slices [a:b:c] with
 *     negative indices, calls, filters, tests (`is`, `is not`), in, not in,
 *     ==, !=, <, <=, >, >= (chained), and, or, not, + - * / // % **, unary
 *     - and +, ~, `a if c else b`; precedence as jinja2's parser;
 *   - globals: namespace(), range() (at most 100000 items, as the sandbox),
 *     dict(), raise_exception(msg) (a render error with msg),
 *     strftime_now(fmt);
 *   - filters: abs, attr, capitalize, count, default/d, first, float,
 *     indent, int, items, join, last, length, list, lower, map (filter name
 *     or attribute=, default=), reject, rejectattr, replace, reverse,
 *     select, selectattr, string, title, tojson (ensure_ascii, indent,
 *     separators, sort_keys), trim, upper;
 *   - tests: defined, undefined, none, boolean, true, false, integer,
 *     float, number, string, mapping, iterable, sequence, callable, odd,
 *     even, divisibleby, eq/equalto/==, ne/!=, lt/lessthan/<, le/<=,
 *     gt/greaterthan/>, ge/>=, in, lower, upper, filter, test, sameas (only
 *     against none/true/false);
 *   - methods: str.startswith/endswith (str or tuple), strip/lstrip/rstrip
 *     ([chars]), split/rsplit ([sep[, maxsplit]]), replace, upper, lower,
 *     title, capitalize, find, rfind, count, join, removeprefix,
 *     removesuffix; dict.get/items/keys/values (Unicode case mapping and
 *     whitespace as Python's).
 * Not supported, each a clear error: other filters (sort, unique, dictsort,
 * wordwrap, truncate, format, ...), other tags (call, filter, with,
 * include, import, extends, block, raw, ...), recursive loops, *args and
 * **kwargs, other methods (format, zfill, isdigit, ...; list.append and
 * other mutations are refused by jinja2's sandbox too), lipsum/cycler/
 * joiner, printf-style '%' on strings (a render error), printing a
 * generator or iterator (Python prints its address: a render error),
 * integers beyond 64 bits (an error where Python would grow them).
 * Known difference: cJSON does not keep "1.0" apart from "1", so a JSON
 * number with an integral value is an int (a template printing a tool's
 * float default 1.0 shows "1").
 *
 * Anything else (an unknown filter, test, tag or global) is an error at
 * parse time naming the template and line ("chat_template.jinja:12:
 * unknown filter 'wordwrap'"); runtime errors (raise_exception, a method on
 * the wrong type, arithmetic on incompatible types, the output or loop
 * limits below) name the line too.
 *
 * Limits (a hostile template or message cannot hang or exhaust memory):
 * CHAT_TEMPLATE_MAX_OUTPUT bytes of output, CHAT_TEMPLATE_MAX_STEPS loop
 * iterations plus macro calls in one render, CHAT_TEMPLATE_MAX_DEPTH nested
 * macro calls, CHAT_TEMPLATE_MAX_NEST nesting of the parsed template
 * (operator chains such as a + b + c count one level per operator), 1000
 * frames of evaluation: a render needs at most ~512 KiB of stack. */
#ifndef MOE_CHAT_TEMPLATE_H
#define MOE_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <cjson/cJSON.h>

#include "moe_error.h"

#define CHAT_TEMPLATE_MAX_OUTPUT (16u << 20)  /* bytes of rendered prompt */
#define CHAT_TEMPLATE_MAX_STEPS 1000000       /* loop iterations + macro calls */
#define CHAT_TEMPLATE_MAX_DEPTH 64            /* nested macro calls */
#define CHAT_TEMPLATE_MAX_NEST 200            /* nested blocks/expressions */
#define CHAT_TEMPLATE_MAX_MEMORY (256u << 20) /* bytes of values one render may hold */

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
