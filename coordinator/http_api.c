/* The coordinator's HTTP server: the OpenAI-compatible API (openai.c), vLLM's
 * /tokenize and /detokenize, /health, /version, /v1/models and Prometheus
 * /metrics. See http_api.h. */
#include "http_api.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistr.h>

#include "chat_template.h"
#include "request_check.h"

#ifndef MOE_VERSION
#define MOE_VERSION "0.0.0"
#endif

int coord_http_status(enum rpc_code code)
{
    switch (code) {
    case RPC_OK: return 200;
    case RPC_INVALID_ARGUMENT:
    case RPC_FAILED_PRECONDITION:
    case RPC_OUT_OF_RANGE: return 400;
    case RPC_UNAUTHENTICATED: return 401;
    case RPC_PERMISSION_DENIED: return 403;
    case RPC_NOT_FOUND: return 404;
    case RPC_ALREADY_EXISTS:
    case RPC_ABORTED: return 409;
    case RPC_RESOURCE_EXHAUSTED: return 429;
    case RPC_CANCELLED: return 499;
    case RPC_UNIMPLEMENTED: return 501;
    case RPC_UNAVAILABLE: return 503;
    case RPC_DEADLINE_EXCEEDED: return 504;
    default: return 500;
    }
}

const char *coord_http_error_type(int status)
{
    switch (status) {
    case 400:
    case 404:
    case 405:
    case 409:
    case 413: return "invalid_request_error";
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 429: return "rate_limit_exceeded";
    case 503: return "service_unavailable";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
    }
}

const char *coord_http_param_of(const char *msg, bool chat, char *buf, size_t cap)
{
    const char *colon = strchr(msg, ':');
    if (!colon || colon == msg || (size_t)(colon - msg) >= cap)
        return NULL;
    const char *p = msg;
    size_t n = (size_t)(colon - msg);
    if (n > 9 && !strncmp(p, "sampling.", 9)) {
        p += 9;
        n -= 9;
    }
    for (size_t i = 0; i < n; i++)
        if (p[i] == ' ')
            return NULL; /* not a field name */
    size_t k = 0;
    while (k < n && p[k] != '.' && p[k] != '[')
        k++;
    snprintf(buf, cap, "%.*s", (int)k, p);
    if (!strcmp(buf, "prompt") && chat)
        snprintf(buf, cap, "messages");
    if (!strcmp(buf, "request"))
        return NULL;
    return buf;
}

/* Routes in the request counter: the fixed set, so that a client cannot
 * create series at will. */
static const char *route_label(const char *route)
{
    return route ? route : "other";
}

void coord_http_json(struct coord_http *h, struct http_request *rq, const char *route, int status,
                     cJSON *body)
{
    char *text = body ? cJSON_PrintUnformatted(body) : NULL;
    cJSON_Delete(body);
    if (!text) {
        coord_http_error(h, rq, route, 500, NULL, "out of memory");
        return;
    }
    coord_metrics_http(h->c->metrics, route_label(route), status);
    http_respond(rq, status, "application/json", text, strlen(text));
    free(text);
}

void coord_http_one_line(char *msg)
{
    for (unsigned char *q = (unsigned char *)msg; *q; q++)
        if (*q < 0x20 || *q == 0x7f)
            *q = ' ';
}

void coord_http_error(struct coord_http *h, struct http_request *rq, const char *route, int status,
                      const char *param, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    coord_http_one_line(msg);
    coord_metrics_http(h->c->metrics, route_label(route), status);
    http_respond_error(rq, status, coord_http_error_type(status), param, "%s", msg);
}

cJSON *coord_http_parse_body(struct coord_http *h, struct http_request *rq, const char *route)
{
    size_t len;
    const char *body = http_request_body(rq, &len);
    if (len == 0) {
        coord_http_error(h, rq, route, 400, NULL, "request body: empty (expected a JSON object)");
        return NULL;
    }
    /* JSON is UTF-8 (RFC 8259): nothing invalid gets in, or is echoed back */
    const uint8_t *bad = u8_check((const uint8_t *)body, len);
    if (bad) {
        coord_http_error(h, rq, route, 400, NULL, "request body: not valid UTF-8 (byte %zu of %zu)",
                         (size_t)(bad - (const uint8_t *)body), len);
        return NULL;
    }
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithLengthOpts(body, len, &end, false);
    if (!j) {
        size_t at = end && end >= body ? (size_t)(end - body) : 0;
        coord_http_error(h, rq, route, 400, NULL,
                         "request body: not valid JSON (error near byte %zu of %zu)", at, len);
        return NULL;
    }
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        coord_http_error(h, rq, route, 400, NULL, "request body: expected a JSON object");
        return NULL;
    }
    return j;
}

/* ---- small routes --------------------------------------------------------------------- */

static bool any_worker_serving(struct coord *c)
{
    bool any = false;
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n_workers && !any; i++)
        any = c->workers[i]->ever_seen &&
              coord_worker_state_locked(c->workers[i]) == COORD_WORKER_SERVING;
    bool stopping = c->stopping;
    pthread_mutex_unlock(&c->mu);
    return any && !stopping;
}

static void handle_health(struct http_request *rq, void *user)
{
    struct coord_http *h = user;
    if (any_worker_serving(h->c)) {
        coord_metrics_http(h->c->metrics, "/health", 200);
        http_respond(rq, 200, "application/json", "", 0);
    } else {
        coord_http_error(h, rq, "/health", 503, NULL, "no worker is serving model '%s'",
                         h->c->model_name);
    }
}

static void handle_version(struct http_request *rq, void *user)
{
    struct coord_http *h = user;
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "version", MOE_VERSION);
    coord_http_json(h, rq, "/version", 200, j);
}

static void handle_models(struct http_request *rq, void *user)
{
    struct coord_http *h = user;
    struct coord *c = h->c;
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(j, "data");
    cJSON *m = cJSON_CreateObject();
    cJSON_AddItemToArray(data, m);
    cJSON_AddStringToObject(m, "id", c->model_name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)h->created);
    cJSON_AddStringToObject(m, "owned_by", "moe-serve");
    cJSON_AddStringToObject(m, "root", c->model_name);
    cJSON_AddNullToObject(m, "parent");
    cJSON_AddNumberToObject(m, "max_model_len", c->cfg.max_pos);
    cJSON_AddArrayToObject(m, "permission");
    coord_http_json(h, rq, "/v1/models", 200, j);
}

static void handle_metrics(struct http_request *rq, void *user)
{
    struct coord_http *h = user;
    /* Counted before rendering, so a scrape sees itself. */
    coord_metrics_http(h->c->metrics, "/metrics", 200);
    char *text = NULL;
    size_t len = 0;
    struct moe_error err;
    if (moe_metrics_render(coord_metrics_registry(h->c->metrics), &text, &len, &err)) {
        http_respond_error(rq, 500, "server_error", NULL, "%s", err.msg);
        return;
    }
    http_respond(rq, 200, MOE_METRICS_CONTENT_TYPE, text, len);
    free(text);
}

/* The model field, if given, must name the served model: else 404. */
static bool check_model(struct coord_http *h, struct http_request *rq, const char *route,
                        const cJSON *body)
{
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(body, "model");
    if (!m || cJSON_IsNull(m))
        return true;
    if (!cJSON_IsString(m)) {
        coord_http_error(h, rq, route, 400, "model", "model: expected a string");
        return false;
    }
    if (strcmp(m->valuestring, h->c->model_name)) {
        coord_http_error(h, rq, route, 404, "model",
                         "model: '%.200s' does not exist (this server serves '%s')", m->valuestring,
                         h->c->model_name);
        return false;
    }
    return true;
}

/* vLLM's POST /tokenize: {"prompt": TEXT, "add_special_tokens": true} or
 * {"messages": [...], "add_generation_prompt": true}; answers {"count",
 * "max_model_len", "tokens", "token_strs": null}. */
static void handle_tokenize(struct http_request *rq, void *user)
{
    struct coord_http *h = user;
    struct coord *c = h->c;
    const char *route = "/tokenize";
    cJSON *body = coord_http_parse_body(h, rq, route);
    if (!body)
        return;
    int32_t *ids = NULL;
    size_t n = 0;
    struct moe_error err = {0};
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(body, "prompt");
    const cJSON *messages = cJSON_GetObjectItemCaseSensitive(body, "messages");
    const cJSON *ast = cJSON_GetObjectItemCaseSensitive(body, "add_special_tokens");
    const cJSON *agp = cJSON_GetObjectItemCaseSensitive(body, "add_generation_prompt");
    if (!check_model(h, rq, route, body))
        goto out;
    if (ast && !cJSON_IsNull(ast) && !cJSON_IsBool(ast)) {
        coord_http_error(h, rq, route, 400, "add_special_tokens",
                         "add_special_tokens: expected true or false");
        goto out;
    }
    if (agp && !cJSON_IsNull(agp) && !cJSON_IsBool(agp)) {
        coord_http_error(h, rq, route, 400, "add_generation_prompt",
                         "add_generation_prompt: expected true or false");
        goto out;
    }
    if (!c->tok) {
        coord_http_error(h, rq, route, 400, NULL, "the coordinator has no tokenizer.json");
        goto out;
    }
    if (messages && !cJSON_IsNull(messages)) {
        if (coord_chat_prompt(h, messages, SIZE_MAX, !agp || cJSON_IsNull(agp) || cJSON_IsTrue(agp),
                              NULL, &ids, &n, &err)) {
            char pb[64];
            coord_http_error(h, rq, route,
                             err.code == MOE_ERR_INVALID       ? 400
                             : err.code == MOE_ERR_UNSUPPORTED ? 501
                                                               : 500,
                             coord_http_param_of(err.msg, true, pb, sizeof pb), "%s", err.msg);
            goto out;
        }
    } else if (cJSON_IsString(prompt)) {
        size_t len = strlen(prompt->valuestring);
        if (len > MOE_REQ_MAX_PROMPT_BYTES) {
            coord_http_error(h, rq, route, 400, "prompt", "prompt: %zu bytes, at most %u allowed",
                             len, MOE_REQ_MAX_PROMPT_BYTES);
            goto out;
        }
        bool add = !ast || cJSON_IsNull(ast) || cJSON_IsTrue(ast);
        if (moe_tokenizer_encode(c->tok, prompt->valuestring, len, add, &ids, &n, &err)) {
            coord_http_error(h, rq, route, 400, "prompt", "prompt: %s", err.msg);
            goto out;
        }
    } else {
        coord_http_error(h, rq, route, 400, "prompt",
                         prompt ? "prompt: expected a string"
                                : "prompt: required (or messages, for a chat prompt)");
        goto out;
    }
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "count", (double)n);
    cJSON_AddNumberToObject(j, "max_model_len", c->cfg.max_pos);
    cJSON *arr = cJSON_AddArrayToObject(j, "tokens");
    for (size_t i = 0; i < n; i++)
        cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
    cJSON_AddNullToObject(j, "token_strs");
    coord_http_json(h, rq, route, 200, j);
out:
    free(ids);
    cJSON_Delete(body);
}

/* vLLM's POST /detokenize: {"tokens": [ids]} -> {"prompt": TEXT}. */
static void handle_detokenize(struct http_request *rq, void *user)
{
    struct coord_http *h = user;
    struct coord *c = h->c;
    const char *route = "/detokenize";
    cJSON *body = coord_http_parse_body(h, rq, route);
    if (!body)
        return;
    int32_t *ids = NULL;
    char *text = NULL;
    size_t len = 0;
    const cJSON *toks = cJSON_GetObjectItemCaseSensitive(body, "tokens");
    if (!check_model(h, rq, route, body))
        goto out;
    if (!cJSON_IsArray(toks)) {
        coord_http_error(h, rq, route, 400, "tokens",
                         toks ? "tokens: expected an array of token ids" : "tokens: required");
        goto out;
    }
    if (!c->tok) {
        coord_http_error(h, rq, route, 400, NULL, "the coordinator has no tokenizer.json");
        goto out;
    }
    int n = cJSON_GetArraySize(toks);
    if (n > (int)MOE_REQ_MAX_PROMPT_BYTES) {
        coord_http_error(h, rq, route, 400, "tokens", "tokens: %d ids, too many", n);
        goto out;
    }
    ids = malloc((size_t)(n ? n : 1) * sizeof *ids);
    if (!ids) {
        coord_http_error(h, rq, route, 500, NULL, "out of memory");
        goto out;
    }
    int i = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, toks)
    {
        int vocab = moe_tokenizer_n_vocab(c->tok);
        if (!cJSON_IsNumber(t) || t->valuedouble != (double)(int)t->valuedouble ||
            t->valuedouble < 0 || t->valuedouble >= vocab) {
            coord_http_error(h, rq, route, 400, "tokens",
                             "tokens[%d]: expected a token id in [0, %d)", i, vocab);
            goto out;
        }
        ids[i++] = (int32_t)t->valuedouble;
    }
    struct moe_error err;
    if (moe_tokenizer_decode(c->tok, ids, (size_t)n, false, &text, &len, &err)) {
        coord_http_error(h, rq, route, 400, "tokens", "tokens: %s", err.msg);
        goto out;
    }
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "prompt", text);
    coord_http_json(h, rq, route, 200, j);
out:
    free(ids);
    free(text);
    cJSON_Delete(body);
}

/* ---- chat prompts ------------------------------------------------------------------------ */

/* The messages as the template sees them: role and content (a string: text
 * parts joined with newlines, as vLLM does). */
static cJSON *normalize_messages(const cJSON *messages, struct moe_error *err)
{
    if (!cJSON_IsArray(messages)) {
        moe_error_set(err, MOE_ERR_INVALID, "messages: expected an array of message objects");
        return NULL;
    }
    if (cJSON_GetArraySize(messages) == 0) {
        moe_error_set(err, MOE_ERR_INVALID, "messages: empty");
        return NULL;
    }
    cJSON *out = cJSON_CreateArray();
    int i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, messages)
    {
        if (!cJSON_IsObject(m)) {
            moe_error_set(err, MOE_ERR_INVALID, "messages[%d]: expected an object", i);
            goto fail;
        }
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (!cJSON_IsString(role)) {
            moe_error_set(err, MOE_ERR_INVALID, "messages[%d].role: %s", i,
                          role ? "expected a string" : "required");
            goto fail;
        }
        const char *r = role->valuestring;
        if (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant") &&
            strcmp(r, "developer")) {
            moe_error_set(err, MOE_ERR_INVALID,
                          "messages[%d].role: '%.40s' is not one of system, developer, user, "
                          "assistant (tool messages are not supported)",
                          i, r);
            goto fail;
        }
        const cJSON *tc = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
        if (tc && !cJSON_IsNull(tc) && !(cJSON_IsArray(tc) && cJSON_GetArraySize(tc) == 0)) {
            moe_error_set(err, MOE_ERR_INVALID, "messages[%d].tool_calls: tools are not supported",
                          i);
            goto fail;
        }
        char *text = NULL;
        if (cJSON_IsString(content)) {
            text = strdup(content->valuestring);
        } else if (cJSON_IsArray(content)) {
            size_t len = 0;
            int k = 0;
            const cJSON *part;
            text = strdup("");
            cJSON_ArrayForEach(part, content)
            {
                const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
                const cJSON *pt = cJSON_GetObjectItemCaseSensitive(part, "text");
                if (!cJSON_IsObject(part) || !cJSON_IsString(type)) {
                    free(text);
                    moe_error_set(err, MOE_ERR_INVALID,
                                  "messages[%d].content[%d]: expected {\"type\": \"text\", "
                                  "\"text\": ...}",
                                  i, k);
                    goto fail;
                }
                if (strcmp(type->valuestring, "text")) {
                    free(text);
                    moe_error_set(err, MOE_ERR_INVALID,
                                  "messages[%d].content[%d].type: '%.40s' is not supported (text "
                                  "only)",
                                  i, k, type->valuestring);
                    goto fail;
                }
                if (!cJSON_IsString(pt)) {
                    free(text);
                    moe_error_set(err, MOE_ERR_INVALID,
                                  "messages[%d].content[%d].text: expected a string", i, k);
                    goto fail;
                }
                size_t pl = strlen(pt->valuestring);
                char *p = text ? realloc(text, len + pl + 2) : NULL;
                if (!p) {
                    free(text);
                    text = NULL;
                    break;
                }
                text = p;
                if (k > 0)
                    text[len++] = '\n';
                memcpy(text + len, pt->valuestring, pl + 1);
                len += pl;
                k++;
            }
        } else if ((!content || cJSON_IsNull(content)) && !strcmp(r, "assistant")) {
            text = strdup("");
        } else {
            moe_error_set(err, MOE_ERR_INVALID, "messages[%d].content: %s", i,
                          content ? "expected a string or an array of text parts" : "required");
            goto fail;
        }
        if (!text) {
            moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
            goto fail;
        }
        cJSON *o = cJSON_CreateObject();
        cJSON_AddItemToArray(out, o);
        cJSON_AddStringToObject(o, "role", !strcmp(r, "developer") ? "system" : r);
        cJSON_AddStringToObject(o, "content", text);
        free(text);
        i++;
    }
    return out;
fail:
    cJSON_Delete(out);
    return NULL;
}

enum moe_status coord_chat_prompt(struct coord_http *h, const cJSON *messages, size_t max_ids,
                                  bool add_generation_prompt, const cJSON *template_kwargs,
                                  int32_t **ids, size_t *n_ids, struct moe_error *err)
{
    cJSON *norm = normalize_messages(messages, err);
    if (!norm)
        return err->code;
    enum moe_status st;
    if (!h->tmpl) {
        cJSON_Delete(norm);
        return moe_error_set(err, MOE_ERR_INVALID,
                             "messages: model '%s' has no chat template (start the coordinator "
                             "with --chat-template FILE)",
                             h->c->model_name);
    }
    struct chat_template_vars vars = {
        .messages = norm, .add_generation_prompt = add_generation_prompt, .extra = template_kwargs};
    char *text = NULL;
    st = chat_template_render(h->tmpl, &vars, &text, err);
    cJSON_Delete(norm);
    if (st) {
        moe_error_prefix(err, "messages: rendering the chat template");
        /* A raise_exception in the template is about the conversation. */
        if (st != MOE_ERR_NOMEM)
            err->code = MOE_ERR_INVALID;
        return err->code;
    }
    size_t len = strlen(text);
    if (len > MOE_REQ_MAX_PROMPT_BYTES) {
        free(text);
        return moe_error_set(err, MOE_ERR_INVALID,
                             "messages: the rendered prompt has %zu bytes, "
                             "at most %u allowed",
                             len, MOE_REQ_MAX_PROMPT_BYTES);
    }
    st = moe_tokenizer_encode_max(h->c->tok, text, len, false, max_ids, ids, n_ids, err);
    free(text);
    if (st) {
        if (max_ids != SIZE_MAX && strstr(err->msg, "more than"))
            moe_error_prefix(err, "messages: the rendered prompt has");
        else
            moe_error_prefix(err, "messages");
        err->code = MOE_ERR_INVALID;
        return MOE_ERR_INVALID;
    }
    return MOE_OK;
}

/* ---- the server ---------------------------------------------------------------------------- */

enum moe_status coord_http_start(struct coord *c, struct moe_error *err)
{
    struct coord_http *h = calloc(1, sizeof *h);
    if (!h)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    h->c = c;
    h->created = (long)time(NULL);
    c->http = h;
    if (c->opts.chat_template) {
        h->tmpl = chat_template_load_file(c->opts.chat_template, err);
        if (!h->tmpl)
            return moe_error_prefix(err, "--chat-template");
    } else {
        struct moe_error terr = {0};
        h->tmpl = chat_template_load(c->opts.model_dir, &terr);
        if (!h->tmpl && terr.code != MOE_ERR_NOT_FOUND)
            fprintf(stderr,
                    "moe-coordinator: the checkpoint's chat template cannot be used (chat "
                    "requests will be refused): %s\n",
                    terr.msg);
        else if (!h->tmpl)
            fprintf(stderr,
                    "moe-coordinator: %s has no chat template: /v1/chat/completions refuses "
                    "requests (give one with --chat-template FILE)\n",
                    c->opts.model_dir);
    }
    struct http_server_opts o = {.listen = c->opts.http_listen,
                                 .threads = c->opts.http_threads,
                                 .max_body_bytes = c->opts.http_max_body,
                                 .idle_timeout_s = c->opts.http_timeout_s,
                                 .name = "moe-coordinator",
                                 .tls = c->opts.tls,
                                 .tokens = c->opts.api_tokens};
    h->srv = http_server_create(&o, err);
    if (!h->srv)
        return err->code;
    enum moe_status st;
    /* probes, the version and Prometheus' scrape need no token */
    if ((st = http_server_route_open(h->srv, "GET", "/health", handle_health, h, err)) ||
        (st = http_server_route_open(h->srv, "GET", "/version", handle_version, h, err)) ||
        (st = http_server_route(h->srv, "GET", "/v1/models", handle_models, h, err)) ||
        (st = http_server_route_open(h->srv, "GET", "/metrics", handle_metrics, h, err)) ||
        (st = http_server_route(h->srv, "POST", "/tokenize", handle_tokenize, h, err)) ||
        (st = http_server_route(h->srv, "POST", "/detokenize", handle_detokenize, h, err)) ||
        (st = coord_openai_register(h, err)) || (st = http_server_start(h->srv, err)))
        return st;
    return MOE_OK;
}

int coord_http_port(struct coord *c)
{
    return c->http && c->http->srv ? http_server_port(c->http->srv) : 0;
}

void coord_http_quiesce(struct coord *c)
{
    if (c->http)
        http_server_quiesce(c->http->srv);
}

void coord_http_stop(struct coord *c, int grace_ms)
{
    struct coord_http *h = c->http;
    if (!h)
        return;
    http_server_destroy(h->srv, grace_ms);
    chat_template_destroy(h->tmpl);
    free(h);
    c->http = NULL;
}
