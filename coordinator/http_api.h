/* Internals of the coordinator's HTTP front door, shared by http_api.c (the
 * server, /health, /version, /v1/models, /tokenize, /detokenize, /metrics)
 * and openai.c (/v1/completions, /v1/chat/completions). The HTTP layer only
 * translates: JSON to a moe.v1.GenerateRequest for coord_request_start (the
 * path gRPC requests take too), and the relayed token messages back to JSON
 * or Server-Sent Events. */
#ifndef MOE_COORD_HTTP_API_H
#define MOE_COORD_HTTP_API_H

#include <cjson/cJSON.h>
#include <stdbool.h>

#include "coord.h"
#include "http_server.h"

struct chat_template;

struct coord_http {
    struct coord *c;
    struct http_server *srv;
    struct chat_template *tmpl; /* NULL: the model has none (chat answers 400) */
    long created;               /* time() at start, for /v1/models */
    uint64_t next_id;           /* atomic: response ids */
};

/* The HTTP status for a gRPC code (INVALID_ARGUMENT 400, NOT_FOUND 404,
 * RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, ...). */
int coord_http_status(enum rpc_code code);

/* OpenAI's error "type" for a status. */
const char *coord_http_error_type(int status);

/* The request field a validation message names ("sampling.top_p: ..." ->
 * "top_p", "prompt.text: ..." -> "prompt"), for the error's "param"; NULL
 * if none. `chat` maps "prompt" to "messages". Written into buf. */
const char *coord_http_param_of(const char *msg, bool chat, char *buf, size_t cap);

/* Turns the control characters of msg (a client's string quoted in it: a
 * model name with a newline) into spaces: error messages are one line. */
void coord_http_one_line(char *msg);

/* Answers with an OpenAI-shaped error (one line) and counts it under `route`. */
void coord_http_error(struct coord_http *h, struct http_request *rq, const char *route, int status,
                      const char *param, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

/* Answers with `body` (printed, then deleted) and counts it under `route`. */
void coord_http_json(struct coord_http *h, struct http_request *rq, const char *route, int status,
                     cJSON *body);

/* Parses the body as a JSON object; on failure answers 400 and returns NULL. */
cJSON *coord_http_parse_body(struct coord_http *h, struct http_request *rq, const char *route);

/* Registers /v1/completions and /v1/chat/completions (openai.c). */
enum moe_status coord_openai_register(struct coord_http *h, struct moe_error *err);

/* Renders `messages` (a JSON array, checked here: roles, string or text-part
 * content) with the chat template and tokenizes the result with special
 * tokens recognised and none added, stopping once more than max_ids ids
 * are known (SIZE_MAX: no limit). On success *ids (malloc'd, n_ids) and
 * MOE_OK; else a message naming the field ("messages[1].role: ...") in err,
 * MOE_ERR_INVALID (the client's fault) or another code (the template's). */
enum moe_status coord_chat_prompt(struct coord_http *h, const cJSON *messages, size_t max_ids,
                                  bool add_generation_prompt, const cJSON *template_kwargs,
                                  int32_t **ids, size_t *n_ids, struct moe_error *err);

#endif
