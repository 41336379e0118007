/* POST /v1/completions and /v1/chat/completions: OpenAI's request and
 * response shapes (with vLLM's extra sampling fields) translated to and from
 * the cluster's own request, which goes through coord_request_start like a
 * gRPC Generate.
 *
 * One HTTP request becomes prompts x n forwarded requests ("choices"), each
 * with the same sampling parameters (a given seed becomes seed + j for the
 * j-th sample of a prompt, so that n samples differ and stay reproducible).
 * Their messages arrive on their forwarding threads through the sink below;
 * `struct oa_call` gathers them under one mutex: a whole JSON answer once
 * every choice ended, or Server-Sent Events as tokens arrive (the first
 * message starts the stream, so a request refused before any token still
 * gets a real status code). The first failure of one choice cancels the
 * others; a client that goes away mid-stream cancels them all (the workers
 * free the KV blocks).
 *
 * Stop strings: the worker stops at the token that completes a stop string
 * and the relayed text contains it; here the text is cut before it (after
 * it with include_stop_str_in_output), and while streaming the last
 * (longest stop - 1) bytes are held back so that a stop string's beginning
 * is never sent.
 *
 * With min_tokens the worker ignores stop strings completed by the first
 * min_tokens tokens, so the cut is searched for from where the worker
 * started looking: the text of those tokens, less a stop string's length.
 *
 * Fields the engine cannot honour yet are refused with 400 naming them
 * (best_of > n, suffix, beam search, prompt
 * logprobs, guided decoding, tools, ...); fields OpenAI
 * defines as hints (user, metadata, store, service_tier, ...) and unknown
 * fields are ignored. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "http_api.h"
#include "request_check.h"

#define OA_MAX_N 16              /* samples per prompt */
#define OA_MAX_CHOICES 64        /* prompts x n */
#define OA_DEFAULT_MAX_TOKENS 16 /* /v1/completions, as OpenAI's legacy API */

/* ---- parsing ------------------------------------------------------------------------ */

struct perr {
    bool set;
    int status;
    char param[64];
    char msg[1024];
};

static bool fail(struct perr *e, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static bool fail(struct perr *e, int status, const char *param, const char *fmt, ...)
{
    if (e->set)
        return false;
    e->set = true;
    e->status = status;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    coord_http_one_line(e->msg); /* it may quote the client's strings */
    return false;
}

static const cJSON *field(const cJSON *o, const char *name)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

static const char *type_name(const cJSON *v)
{
    if (cJSON_IsString(v))
        return "a string";
    if (cJSON_IsNumber(v))
        return "a number";
    if (cJSON_IsBool(v))
        return "a boolean";
    if (cJSON_IsArray(v))
        return "an array";
    if (cJSON_IsObject(v))
        return "an object";
    return "null";
}

/* A number field in [lo, hi] (integer: a whole number). Returns true if
 * present and valid (*out set), false if absent or invalid (e set). */
static bool get_num(const cJSON *o, const char *name, double lo, double hi, bool integer,
                    double *out, struct perr *e)
{
    const cJSON *v = field(o, name);
    if (!v)
        return false;
    if (!cJSON_IsNumber(v))
        return fail(e, 400, name, "%s: expected %s, got %s", name,
                    integer ? "an integer" : "a number", type_name(v));
    double d = v->valuedouble;
    if (integer && d != floor(d))
        return fail(e, 400, name, "%s: %g is not an integer", name, d);
    if (!(d >= lo && d <= hi))
        return fail(e, 400, name, "%s: %g is not in [%g, %g]", name, d, lo, hi);
    *out = d;
    return true;
}

static bool get_bool(const cJSON *o, const char *name, bool dflt, struct perr *e)
{
    const cJSON *v = field(o, name);
    if (!v)
        return dflt;
    if (!cJSON_IsBool(v)) {
        fail(e, 400, name, "%s: expected true or false, got %s", name, type_name(v));
        return dflt;
    }
    return cJSON_IsTrue(v);
}

/* A field that must be absent, null or `ok(v)`; otherwise 400 "not supported". */
static void unsupported_if(const cJSON *o, const char *name, bool (*ok)(const cJSON *),
                           const char *why, struct perr *e)
{
    const cJSON *v = field(o, name);
    if (v && !(ok && ok(v)))
        fail(e, 400, name, "%s: not supported by this server (%s)", name, why);
}

static bool is_false(const cJSON *v)
{
    return cJSON_IsFalse(v);
}

static bool is_empty(const cJSON *v)
{
    return (cJSON_IsArray(v) || cJSON_IsObject(v)) ? cJSON_GetArraySize(v) == 0
           : cJSON_IsString(v)                     ? v->valuestring[0] == '\0'
                                                   : false;
}

static bool is_zero(const cJSON *v)
{
    return cJSON_IsNumber(v) && v->valuedouble == 0;
}

static bool is_one(const cJSON *v)
{
    return cJSON_IsNumber(v) && v->valuedouble == 1;
}

static bool is_text_format(const cJSON *v)
{
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(v, "type");
    return cJSON_IsObject(v) && cJSON_IsString(t) && !strcmp(t->valuestring, "text");
}

static bool is_tool_choice_none(const cJSON *v)
{
    return cJSON_IsString(v) &&
           (!strcmp(v->valuestring, "none") || !strcmp(v->valuestring, "auto"));
}

struct oa_prompt {
    const char *text; /* borrowed from the body, or NULL */
    uint32_t *ids;    /* owned, (n_ids), or NULL */
    size_t n_ids;
};

/* What one HTTP request asks for, shared by every choice. */
struct oa_params {
    bool chat;
    const char *route;
    Moe__V1__SamplingParams sp;   /* stop / stop_token_ids point into the arrays below */
    char *stop[MOE_REQ_MAX_STOP]; /* borrowed from the body */
    uint32_t stop_ids[MOE_REQ_MAX_STOP_IDS];
    Moe__V1__SamplingParams__LogitBiasEntry bias[MOE_REQ_MAX_LOGIT_BIAS];
    Moe__V1__SamplingParams__LogitBiasEntry *bias_ptrs[MOE_REQ_MAX_LOGIT_BIAS];
    int n;
    bool stream, include_usage, echo, include_stop, want_logprobs;
    int prompt_lp; /* vLLM's prompt_logprobs: -1 none, else top alternatives */
    struct oa_prompt prompts[OA_MAX_CHOICES];
    int n_prompts;
};

static void params_free(struct oa_params *p)
{
    for (int i = 0; i < p->n_prompts; i++)
        free(p->prompts[i].ids);
}

/* Token ids from a JSON array (the prompt as ids). */
static bool parse_ids(const cJSON *arr, int vocab, const char *what, struct oa_prompt *out,
                      struct perr *e)
{
    int n = cJSON_GetArraySize(arr);
    if (n == 0)
        return fail(e, 400, "prompt", "%s: empty", what);
    out->ids = malloc((size_t)n * sizeof *out->ids);
    if (!out->ids)
        return fail(e, 500, NULL, "out of memory");
    int i = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, arr)
    {
        if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble))
            return fail(e, 400, "prompt", "%s[%d]: expected a token id (an integer), got %s", what,
                        i, type_name(t));
        if (t->valuedouble < 0 || t->valuedouble >= vocab)
            return fail(e, 400, "prompt", "%s[%d]: %g is outside the vocabulary [0, %d)", what, i,
                        t->valuedouble, vocab);
        out->ids[i++] = (uint32_t)t->valuedouble;
    }
    out->n_ids = (size_t)n;
    return true;
}

/* prompt: a string, a list of strings, token ids, or a list of token-id lists. */
static bool parse_prompt(const cJSON *body, int vocab, struct oa_params *p, struct perr *e)
{
    const cJSON *pr = field(body, "prompt");
    if (!pr)
        return fail(e, 400, "prompt", "prompt: required");
    if (cJSON_IsString(pr)) {
        p->prompts[0].text = pr->valuestring;
        p->n_prompts = 1;
        return true;
    }
    if (!cJSON_IsArray(pr))
        return fail(e, 400, "prompt",
                    "prompt: expected a string, a list of strings, a list of token ids or a list "
                    "of token-id lists, got %s",
                    type_name(pr));
    int n = cJSON_GetArraySize(pr);
    if (n == 0)
        return fail(e, 400, "prompt", "prompt: empty list");
    const cJSON *first = cJSON_GetArrayItem(pr, 0);
    if (cJSON_IsNumber(first)) {
        p->n_prompts = 1;
        return parse_ids(pr, vocab, "prompt", &p->prompts[0], e);
    }
    if (n > OA_MAX_CHOICES)
        return fail(e, 400, "prompt", "prompt: %d prompts, at most %d allowed", n, OA_MAX_CHOICES);
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, pr)
    {
        char what[32];
        snprintf(what, sizeof what, "prompt[%d]", i);
        if (cJSON_IsString(first) && cJSON_IsString(it)) {
            p->prompts[i].text = it->valuestring;
        } else if (cJSON_IsArray(first) && cJSON_IsArray(it)) {
            if (!parse_ids(it, vocab, what, &p->prompts[i], e)) {
                p->n_prompts = i + 1;
                return false;
            }
        } else {
            p->n_prompts = i;
            return fail(e, 400, "prompt", "%s: expected %s like prompt[0], got %s", what,
                        cJSON_IsString(first) ? "a string" : "a list of token ids", type_name(it));
        }
        p->n_prompts = ++i;
    }
    return true;
}

/* The fields both endpoints share. */
static bool parse_common(struct coord_http *h, const cJSON *body, struct oa_params *p,
                         struct perr *e)
{
    struct coord *c = h->c;
    double d;
    moe__v1__sampling_params__init(&p->sp);
    p->prompt_lp = -1;
    const cJSON *model = field(body, "model");
    if (model && !cJSON_IsString(model))
        return fail(e, 400, "model", "model: expected a string, got %s", type_name(model));
    if (model && strcmp(model->valuestring, c->model_name))
        return fail(e, 404, "model", "model: '%.200s' does not exist (this server serves '%s')",
                    model->valuestring, c->model_name);
    p->sp.temperature = 1.0f;
    if (get_num(body, "temperature", 0, 2, false, &d, e))
        p->sp.temperature = (float)d;
    if (get_num(body, "top_p", 0, 1, false, &d, e)) {
        if (d == 0)
            return fail(e, 400, "top_p", "top_p: must be in (0, 1], got 0");
        p->sp.top_p = (float)d;
    }
    if (get_num(body, "top_k", -1, 1 << 20, true, &d, e))
        p->sp.top_k = d > 0 ? (uint32_t)d : 0;
    if (get_num(body, "min_p", 0, 1, false, &d, e))
        p->sp.min_p = (float)d;
    if (get_num(body, "repetition_penalty", 0, 10, false, &d, e)) {
        if (d == 0)
            return fail(e, 400, "repetition_penalty",
                        "repetition_penalty: must be > 0 (1 = none), got 0");
        p->sp.repetition_penalty = (float)d;
    }
    if (get_num(body, "min_tokens", 0, h->c->cfg.max_pos, true, &d, e))
        p->sp.min_tokens = (uint32_t)d; /* <= max_tokens: moe_check_sampling */
    if (get_num(body, "presence_penalty", -2, 2, false, &d, e))
        p->sp.presence_penalty = (float)d;
    if (get_num(body, "frequency_penalty", -2, 2, false, &d, e))
        p->sp.frequency_penalty = (float)d;
    if (get_num(body, "seed", -9223372036854775808.0, 18446744073709551615.0, true, &d, e)) {
        p->sp.seed_opt_case = MOE__V1__SAMPLING_PARAMS__SEED_OPT_SEED;
        p->sp.seed = d < 0 ? (uint64_t)(int64_t)d : (uint64_t)d;
    }
    p->n = 1;
    if (get_num(body, "n", 1, OA_MAX_N, true, &d, e))
        p->n = (int)d;
    const cJSON *stop = field(body, "stop");
    if (stop && cJSON_IsString(stop)) {
        p->stop[0] = stop->valuestring;
        p->sp.n_stop = 1;
    } else if (stop && cJSON_IsArray(stop)) {
        int n = cJSON_GetArraySize(stop);
        if (n > MOE_REQ_MAX_STOP)
            return fail(e, 400, "stop", "stop: %d strings, at most %d allowed", n,
                        MOE_REQ_MAX_STOP);
        int i = 0;
        const cJSON *s;
        cJSON_ArrayForEach(s, stop)
        {
            if (!cJSON_IsString(s))
                return fail(e, 400, "stop", "stop[%d]: expected a string, got %s", i, type_name(s));
            p->stop[i++] = s->valuestring;
        }
        p->sp.n_stop = (size_t)n;
    } else if (stop) {
        return fail(e, 400, "stop", "stop: expected a string or a list of strings, got %s",
                    type_name(stop));
    }
    p->sp.stop = p->stop;
    const cJSON *sti = field(body, "stop_token_ids");
    if (sti) {
        if (!cJSON_IsArray(sti))
            return fail(e, 400, "stop_token_ids", "stop_token_ids: expected a list of token ids");
        int n = cJSON_GetArraySize(sti);
        if (n > MOE_REQ_MAX_STOP_IDS)
            return fail(e, 400, "stop_token_ids", "stop_token_ids: %d ids, at most %d allowed", n,
                        MOE_REQ_MAX_STOP_IDS);
        int i = 0;
        const cJSON *t;
        cJSON_ArrayForEach(t, sti)
        {
            if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) ||
                t->valuedouble < 0 || t->valuedouble >= c->cfg.vocab_size)
                return fail(e, 400, "stop_token_ids",
                            "stop_token_ids[%d]: expected a token id in [0, %d)", i,
                            c->cfg.vocab_size);
            p->stop_ids[i++] = (uint32_t)t->valuedouble;
        }
        p->sp.n_stop_token_ids = (size_t)n;
    }
    p->sp.stop_token_ids = p->stop_ids;
    const cJSON *lb = field(body, "logit_bias");
    if (lb) { /* {"token id": bias, ...}; field() already takes null for absent */
        if (!cJSON_IsObject(lb))
            return fail(e, 400, "logit_bias", "logit_bias: expected an object, got %s",
                        type_name(lb));
        int n = cJSON_GetArraySize(lb);
        if (n > MOE_REQ_MAX_LOGIT_BIAS)
            return fail(e, 400, "logit_bias", "logit_bias: %d tokens, at most %d allowed", n,
                        MOE_REQ_MAX_LOGIT_BIAS);
        int i = 0;
        const cJSON *b;
        cJSON_ArrayForEach(b, lb)
        {
            char *end = NULL;
            long id = strtol(b->string, &end, 10);
            if (!b->string[0] || *end || id < 0 || id >= c->cfg.vocab_size)
                return fail(e, 400, "logit_bias",
                            "logit_bias: key '%.40s' is not a token id in [0, %d)", b->string,
                            c->cfg.vocab_size);
            if (!cJSON_IsNumber(b) || !(fabs(b->valuedouble) <= MOE_REQ_MAX_BIAS))
                return fail(e, 400, "logit_bias",
                            "logit_bias['%ld']: expected a number in [-100, 100]", id);
            moe__v1__sampling_params__logit_bias_entry__init(&p->bias[i]);
            p->bias[i].key = (uint32_t)id;
            p->bias[i].value = (float)b->valuedouble;
            p->bias_ptrs[i] = &p->bias[i];
            i++;
        }
        p->sp.n_logit_bias = (size_t)i;
        p->sp.logit_bias = p->bias_ptrs;
    }
    p->sp.ignore_eos = get_bool(body, "ignore_eos", false, e);
    p->sp.skip_special_tokens = get_bool(body, "skip_special_tokens", true, e);
    p->include_stop = get_bool(body, "include_stop_str_in_output", false, e);
    get_bool(body, "spaces_between_special_tokens", true, e); /* a detokenizer hint */
    p->stream = get_bool(body, "stream", false, e);
    const cJSON *so = field(body, "stream_options");
    if (so) {
        if (!cJSON_IsObject(so))
            return fail(e, 400, "stream_options", "stream_options: expected an object, got %s",
                        type_name(so));
        if (!p->stream)
            return fail(e, 400, "stream_options",
                        "stream_options: only allowed when stream is true");
        p->include_usage = get_bool(so, "include_usage", false, e);
        if (get_bool(so, "continuous_usage_stats", false, e))
            fail(e, 400, "stream_options",
                 "stream_options.continuous_usage_stats: not supported by this server");
    }
    const cJSON *user = field(body, "user");
    if (user && !cJSON_IsString(user))
        fail(e, 400, "user", "user: expected a string, got %s", type_name(user));
    /* Valid requests this engine cannot honour yet: refused, never ignored. */
    unsupported_if(body, "use_beam_search", is_false, "no beam search", e);
    unsupported_if(body, "length_penalty", is_one, "no beam search", e);
    if (get_num(body, "prompt_logprobs", 0, MOE_REQ_MAX_LOGPROBS, true, &d, e)) { /* vLLM's */
        if (p->stream)
            return fail(e, 400, "prompt_logprobs", "prompt_logprobs: not supported with stream");
        p->prompt_lp = (int)d;
        p->sp.prompt_logprobs_opt_case =
            MOE__V1__SAMPLING_PARAMS__PROMPT_LOGPROBS_OPT_PROMPT_LOGPROBS;
        p->sp.prompt_logprobs = (uint32_t)d;
    }
    unsupported_if(body, "truncate_prompt_tokens", NULL, "prompts are never truncated", e);
    unsupported_if(body, "allowed_token_ids", NULL, "no token masks in the sampler", e);
    unsupported_if(body, "bad_words", is_empty, "no token masks in the sampler", e);
    unsupported_if(body, "guided_json", NULL, "no guided decoding", e);
    unsupported_if(body, "guided_regex", NULL, "no guided decoding", e);
    unsupported_if(body, "guided_choice", NULL, "no guided decoding", e);
    unsupported_if(body, "guided_grammar", NULL, "no guided decoding", e);
    unsupported_if(body, "structured_outputs", NULL, "no guided decoding", e);
    unsupported_if(body, "response_format", is_text_format, "no guided decoding: text only", e);
    unsupported_if(body, "priority", is_zero, "no request priorities", e);
    return !e->set;
}

static bool parse_completions(struct coord_http *h, const cJSON *body, struct oa_params *p,
                              struct perr *e)
{
    p->chat = false;
    p->route = "/v1/completions";
    if (!parse_common(h, body, p, e))
        return false;
    double d;
    p->sp.max_tokens = OA_DEFAULT_MAX_TOKENS;
    if (get_num(body, "max_tokens", 1, h->c->cfg.max_pos, true, &d, e))
        p->sp.max_tokens = (uint32_t)d;
    if (get_num(body, "logprobs", 0, MOE_REQ_MAX_LOGPROBS, true, &d, e)) {
        p->sp.logprobs_opt_case = MOE__V1__SAMPLING_PARAMS__LOGPROBS_OPT_LOGPROBS;
        p->sp.logprobs = (uint32_t)d;
        p->want_logprobs = true;
    }
    p->echo = get_bool(body, "echo", false, e);
    if (p->echo && p->want_logprobs) { /* the prompt's too (lm-evaluation-harness asks so) */
        p->sp.prompt_logprobs_opt_case =
            MOE__V1__SAMPLING_PARAMS__PROMPT_LOGPROBS_OPT_PROMPT_LOGPROBS;
        if (p->sp.logprobs > p->sp.prompt_logprobs) /* the larger of the two; each sliced */
            p->sp.prompt_logprobs = p->sp.logprobs;
    }
    const cJSON *best_of = field(body, "best_of");
    if (best_of &&
        !(cJSON_IsNumber(best_of) && (best_of->valuedouble == p->n || best_of->valuedouble == 1)))
        fail(e, 400, "best_of", "best_of: only best_of = n is supported (no ranking of samples)");
    unsupported_if(body, "suffix", is_empty, "no insertion", e);
    if (e->set)
        return false;
    if (!parse_prompt(body, h->c->cfg.vocab_size, p, e))
        return false;
    if (p->n_prompts * p->n > OA_MAX_CHOICES)
        return fail(e, 400, "n", "n: %d prompts x n = %d exceed %d choices", p->n_prompts,
                    p->n_prompts * p->n, OA_MAX_CHOICES);
    for (int i = 0; i < p->n_prompts; i++)
        if (p->prompts[i].text && !p->prompts[i].text[0])
            return fail(e, 400, "prompt", "prompt%s: empty string", p->n_prompts > 1 ? "[i]" : "");
    return true;
}

static bool parse_chat(struct coord_http *h, const cJSON *body, struct oa_params *p, struct perr *e)
{
    p->chat = true;
    p->route = "/v1/chat/completions";
    if (!parse_common(h, body, p, e))
        return false;
    double d;
    int ctx = h->c->cfg.max_pos;
    if (get_num(body, "max_completion_tokens", 1, ctx, true, &d, e))
        p->sp.max_tokens = (uint32_t)d;
    else if (!e->set && get_num(body, "max_tokens", 1, ctx, true, &d, e))
        p->sp.max_tokens = (uint32_t)d;
    p->want_logprobs = get_bool(body, "logprobs", false, e);
    double top = 0;
    bool has_top = get_num(body, "top_logprobs", 0, MOE_REQ_MAX_LOGPROBS, true, &top, e);
    if (has_top && top > 0 && !p->want_logprobs)
        fail(e, 400, "top_logprobs", "top_logprobs: needs logprobs to be true");
    if (p->want_logprobs) {
        p->sp.logprobs_opt_case = MOE__V1__SAMPLING_PARAMS__LOGPROBS_OPT_LOGPROBS;
        p->sp.logprobs = (uint32_t)top;
    }
    unsupported_if(body, "tools", is_empty, "no tool calling", e);
    unsupported_if(body, "functions", is_empty, "no tool calling", e);
    unsupported_if(body, "tool_choice", is_tool_choice_none, "no tool calling", e);
    unsupported_if(body, "continue_final_message", is_false, "the reply always starts anew", e);
    unsupported_if(body, "documents", NULL, "no document templates", e);
    unsupported_if(body, "add_special_tokens", is_false,
                   "the chat template decides the special tokens", e);
    unsupported_if(body, "echo", is_false, "no echo of chat prompts", e);
    const cJSON *best_of = field(body, "best_of");
    if (best_of)
        fail(e, 400, "best_of", "best_of: not a chat completion field");
    const cJSON *kw = field(body, "chat_template_kwargs");
    if (kw && !cJSON_IsObject(kw))
        fail(e, 400, "chat_template_kwargs", "chat_template_kwargs: expected an object, got %s",
             type_name(kw));
    bool agp = get_bool(body, "add_generation_prompt", true, e);
    const cJSON *messages = cJSON_GetObjectItemCaseSensitive(body, "messages");
    if (e->set)
        return false;
    if (!messages)
        return fail(e, 400, "messages", "messages: required");
    if (!h->c->tok)
        return fail(e, 400, "messages", "messages: the coordinator has no tokenizer.json");
    struct moe_error err = {0};
    int32_t *ids = NULL;
    size_t n = 0;
    /* the context less one new token: longer prompts are refused anyway */
    size_t max_ids = h->c->cfg.max_pos > 1 ? (size_t)h->c->cfg.max_pos - 1 : 0;
    if (coord_chat_prompt(h, messages, max_ids, agp, kw, &ids, &n, &err)) {
        char pb[64];
        const char *param = coord_http_param_of(err.msg, true, pb, sizeof pb);
        int st = err.code == MOE_ERR_INVALID ? 400 : err.code == MOE_ERR_UNSUPPORTED ? 501 : 500;
        return fail(e, st, param ? param : "messages", "%s", err.msg);
    }
    p->prompts[0].ids = malloc((n ? n : 1) * sizeof *p->prompts[0].ids);
    if (!p->prompts[0].ids) {
        free(ids);
        return fail(e, 500, NULL, "out of memory");
    }
    for (size_t i = 0; i < n; i++)
        p->prompts[0].ids[i] = (uint32_t)ids[i];
    p->prompts[0].n_ids = n;
    p->n_prompts = 1;
    free(ids);
    return true;
}

/* ---- one HTTP request in flight -------------------------------------------------------- */

struct sbuf {
    char *s;
    size_t len, cap;
};

static bool sb_add(struct sbuf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->s, cap);
        if (!p)
            return false;
        b->s = p;
        b->cap = cap;
    }
    if (n)
        memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
    return true;
}

struct oa_call;

struct oa_choice {
    struct oa_call *call;
    int index, prompt_index, sample;
    struct fwd *f; /* call->mu: the running request, NULL once it ended */
    bool done;     /* call->mu: finish arrived (or never started) */
    bool finished; /* a message with finish_reason arrived */
    struct sbuf text;
    size_t sent; /* bytes of text streamed */
    bool head_sent;
    int finish_reason;
    cJSON *stop_reason; /* string, number or NULL (JSON null) */
    uint32_t prompt_tokens, completion_tokens, cached_tokens;
    cJSON *lp; /* logprobs gathered (non-streaming) */
    size_t lp_offset;
    cJSON *plp;          /* vLLM's prompt_logprobs list, from the first message */
    uint32_t n_out;      /* tokens received */
    size_t min_text_len; /* text.len once n_out reached call->min_tokens */
};

struct oa_call {
    struct coord_http *h;
    struct http_request *rq; /* NULL once answered */
    pthread_mutex_t mu;
    int refs; /* mu */
    bool chat, stream, include_usage, echo, include_stop, want_logprobs;
    int n; /* samples per prompt */
    uint32_t min_tokens;
    int prompt_lp;     /* vLLM's prompt_logprobs: -1 none, else top alternatives */
    uint32_t n_lp_top; /* logprobs' top alternatives (echo slices the prompt's to it) */
    char **stops;
    int n_stops;
    size_t max_stop;
    uint32_t *stop_ids;
    int n_stop_ids;
    char **echo_text; /* (n_prompts) */
    int n_prompts;
    int n_choices, n_done;
    struct oa_choice *ch;
    char id[64];
    long created;
    const char *route;
    bool started, gone, failed; /* mu */
    int err_status;
    char err_param[64];
    char err_msg[1024];
};

static void call_free(struct oa_call *call)
{
    for (int i = 0; i < call->n_choices; i++) {
        free(call->ch[i].text.s);
        cJSON_Delete(call->ch[i].stop_reason);
        cJSON_Delete(call->ch[i].lp);
        cJSON_Delete(call->ch[i].plp);
    }
    for (int i = 0; i < call->n_stops; i++)
        free(call->stops[i]);
    for (int i = 0; i < call->n_prompts; i++)
        free(call->echo_text ? call->echo_text[i] : NULL);
    free(call->echo_text);
    free(call->stops);
    free(call->stop_ids);
    free(call->ch);
    pthread_mutex_destroy(&call->mu);
    free(call);
}

/* Drops a reference; caller holds call->mu (released). */
static void call_unref_unlock(struct oa_call *call)
{
    int left = --call->refs;
    pthread_mutex_unlock(&call->mu);
    if (left == 0)
        call_free(call);
}

static const char *finish_name(int fr)
{
    switch (fr) {
    case MOE__V1__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    case MOE__V1__FINISH_REASON__FINISH_REASON_STOP: return "stop";
    case MOE__V1__FINISH_REASON__FINISH_REASON_ABORT: return "abort";
    default: return "error";
    }
}

/* The text of one token, as logprobs show it. */
static char *token_text(struct coord *c, uint32_t id)
{
    int32_t i = (int32_t)id;
    char *t = NULL;
    size_t n;
    if (!c->tok || moe_tokenizer_decode(c->tok, &i, 1, false, &t, &n, NULL) != MOE_OK) {
        t = malloc(24);
        if (t)
            snprintf(t, 24, "[%u]", id);
    }
    return t;
}

static cJSON *bytes_array(const char *s)
{
    cJSON *a = cJSON_CreateArray();
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(*p));
    return a;
}

/* Appends the logprobs of message m to `lp` (created on first use): chat's
 * {"content": [...]} or completions' {"tokens", "token_logprobs",
 * "top_logprobs", "text_offset"}. */
/* One token of a completion's logprobs object (token s): its logprob and
 * up to max_top alternatives, both null without t (a prompt's first). */
static void add_completion_lp(struct coord *c, struct oa_choice *ch, cJSON *lp, const char *s,
                              const Moe__V1__TokenLogprob *t, size_t max_top)
{
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "tokens"), cJSON_CreateString(s));
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "token_logprobs"),
                         t ? cJSON_CreateNumber(t->logprob) : cJSON_CreateNull());
    cJSON *tops = t ? cJSON_CreateObject() : cJSON_CreateNull();
    for (size_t k = 0; t && k < t->n_top && k < max_top; k++) {
        char *ts = token_text(c, t->top[k]->token_id);
        if (ts && !cJSON_GetObjectItemCaseSensitive(tops, ts))
            cJSON_AddNumberToObject(tops, ts, t->top[k]->logprob);
        free(ts);
    }
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "top_logprobs"), tops);
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "text_offset"),
                         cJSON_CreateNumber((double)ch->lp_offset));
    ch->lp_offset += strlen(s);
}

static void add_logprobs(struct oa_call *call, struct oa_choice *ch, cJSON **lp,
                         const Moe__V1__GenerateResponse *m)
{
    struct coord *c = call->h->c;
    if (!m->n_logprobs && !m->n_prompt_token_ids)
        return;
    if (!*lp) {
        *lp = cJSON_CreateObject();
        if (call->chat) {
            cJSON_AddArrayToObject(*lp, "content");
        } else {
            cJSON_AddArrayToObject(*lp, "tokens");
            cJSON_AddArrayToObject(*lp, "token_logprobs");
            cJSON_AddArrayToObject(*lp, "top_logprobs");
            cJSON_AddArrayToObject(*lp, "text_offset");
        }
    }
    /* echo with logprobs: the prompt's tokens first (the first has none) */
    for (size_t i = 0; !call->chat && call->echo && i < m->n_prompt_token_ids; i++) {
        char *s = token_text(c, m->prompt_token_ids[i]);
        if (!s)
            continue;
        const Moe__V1__TokenLogprob *t =
            i && i - 1 < m->n_prompt_logprobs ? m->prompt_logprobs[i - 1] : NULL;
        add_completion_lp(c, ch, *lp, s, t, call->n_lp_top);
        free(s);
    }
    for (size_t i = 0; i < m->n_logprobs; i++) {
        const Moe__V1__TokenLogprob *t = m->logprobs[i];
        char *s = token_text(c, t->token_id);
        if (!s)
            continue;
        if (call->chat) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "token", s);
            cJSON_AddNumberToObject(e, "logprob", t->logprob);
            cJSON_AddItemToObject(e, "bytes", bytes_array(s));
            cJSON *tops = cJSON_AddArrayToObject(e, "top_logprobs");
            for (size_t k = 0; k < t->n_top; k++) {
                char *ts = token_text(c, t->top[k]->token_id);
                if (!ts)
                    continue;
                cJSON *o = cJSON_CreateObject();
                cJSON_AddStringToObject(o, "token", ts);
                cJSON_AddNumberToObject(o, "logprob", t->top[k]->logprob);
                cJSON_AddItemToObject(o, "bytes", bytes_array(ts));
                cJSON_AddItemToArray(tops, o);
                free(ts);
            }
            cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(*lp, "content"), e);
        } else {
            add_completion_lp(c, ch, *lp, s, t, t->n_top);
        }
        free(s);
    }
}

/* One vLLM Logprob: {"logprob", "rank", "decoded_token"}. */
static cJSON *vllm_logprob(struct coord *c, uint32_t id, float logprob, uint32_t rank)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "logprob", logprob);
    cJSON_AddNumberToObject(o, "rank", rank);
    char *s = token_text(c, id);
    if (s)
        cJSON_AddStringToObject(o, "decoded_token", s);
    else
        cJSON_AddNullToObject(o, "decoded_token");
    free(s);
    return o;
}

/* vLLM's prompt_logprobs of a first message: one entry per prompt token,
 * null for the first, else {"<id>": Logprob} for the token and its top
 * call->prompt_lp alternatives (ranked 1, 2, ...). */
static cJSON *prompt_lp_json(struct oa_call *call, const Moe__V1__GenerateResponse *m)
{
    struct coord *c = call->h->c;
    cJSON *list = cJSON_CreateArray();
    for (size_t i = 0; i < m->n_prompt_token_ids; i++) {
        const Moe__V1__TokenLogprob *t =
            i && i - 1 < m->n_prompt_logprobs ? m->prompt_logprobs[i - 1] : NULL;
        if (!t) {
            cJSON_AddItemToArray(list, cJSON_CreateNull());
            continue;
        }
        cJSON *d = cJSON_CreateObject();
        char key[16];
        snprintf(key, sizeof key, "%u", t->token_id);
        cJSON_AddItemToObject(d, key, vllm_logprob(c, t->token_id, t->logprob, t->rank));
        for (size_t k = 0; k < t->n_top && (int)k < call->prompt_lp; k++) {
            snprintf(key, sizeof key, "%u", t->top[k]->token_id);
            if (!cJSON_GetObjectItemCaseSensitive(d, key))
                cJSON_AddItemToObject(
                    d, key,
                    vllm_logprob(c, t->top[k]->token_id, t->top[k]->logprob, (uint32_t)k + 1));
        }
        cJSON_AddItemToArray(list, d);
    }
    return list;
}

/* Cuts the text at the stop string that ended the choice. */
static void apply_stop(struct oa_call *call, struct oa_choice *ch, const char *stop_reason)
{
    int idx;
    if (sscanf(stop_reason, "stop string %d", &idx) == 1 && idx >= 0 && idx < call->n_stops) {
        const char *s = call->stops[idx];
        size_t sl = strlen(s);
        /* before min_tokens the worker skipped stop strings: look where it did */
        size_t from = ch->min_text_len >= sl ? ch->min_text_len - sl + 1 : 0;
        for (int pass = 0; pass < 2; pass++, from = 0) {
            size_t at = from;
            while (at + sl <= ch->text.len && memcmp(ch->text.s + at, s, sl))
                at++;
            if (at + sl <= ch->text.len) {
                ch->text.len = call->include_stop ? at + sl : at;
                ch->text.s[ch->text.len] = '\0';
                break;
            }
        }
        ch->stop_reason = cJSON_CreateString(s);
        return;
    }
    long tok;
    if (sscanf(stop_reason, "token %ld", &tok) == 1)
        for (int i = 0; i < call->n_stop_ids; i++)
            if ((long)call->stop_ids[i] == tok) {
                ch->stop_reason = cJSON_CreateNumber((double)tok);
                return;
            }
}

/* Bytes of the text that may be streamed now: all of it once finished,
 * else all but what could be the beginning of a stop string. */
static size_t emit_upto(const struct oa_call *call, const struct oa_choice *ch)
{
    size_t len = ch->text.len;
    if (ch->finished || call->include_stop || call->max_stop < 2)
        return len;
    size_t hold = call->max_stop - 1;
    size_t upto = len > hold ? len - hold : 0;
    if (upto < ch->sent)
        return ch->sent;
    while (upto > ch->sent && ((unsigned char)ch->text.s[upto] & 0xC0) == 0x80)
        upto--;
    return upto;
}

static cJSON *chunk_base(struct oa_call *call)
{
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "id", call->id);
    cJSON_AddStringToObject(j, "object", call->chat ? "chat.completion.chunk" : "text_completion");
    cJSON_AddNumberToObject(j, "created", (double)call->created);
    cJSON_AddStringToObject(j, "model", call->h->c->model_name);
    return j;
}

static cJSON *usage_json(struct oa_call *call)
{
    uint32_t prompt = 0, completion = 0, cached = 0;
    for (int i = 0; i < call->n_choices; i++) {
        const struct oa_choice *ch = &call->ch[i];
        if (ch->sample == 0) {
            prompt += ch->prompt_tokens;
            cached += ch->cached_tokens;
        }
        completion += ch->completion_tokens;
    }
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", completion);
    cJSON_AddNumberToObject(u, "total_tokens", prompt + completion);
    if (cached) {
        cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
        cJSON_AddNumberToObject(d, "cached_tokens", cached);
    }
    return u;
}

/* Writes one SSE event `data: JSON\n\n` (j deleted). */
static bool sse_write(struct http_request *rq, cJSON *j)
{
    char *text = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!text || !rq) {
        free(text);
        return false;
    }
    size_t n = strlen(text);
    char *ev = malloc(n + 9);
    bool ok = false;
    if (ev) {
        memcpy(ev, "data: ", 6);
        memcpy(ev + 6, text, n);
        memcpy(ev + 6 + n, "\n\n", 3);
        ok = http_stream_write(rq, ev, n + 8) == MOE_OK;
    }
    free(ev);
    free(text);
    return ok;
}

/* One streamed chunk for choice ch: text delta (may be ""), logprobs,
 * finish reason. role: chat's first chunk. */
static bool stream_chunk(struct oa_call *call, struct oa_choice *ch, const char *delta, size_t n,
                         cJSON *lp, bool role, bool with_finish)
{
    cJSON *j = chunk_base(call);
    cJSON *choices = cJSON_AddArrayToObject(j, "choices");
    cJSON *c = cJSON_CreateObject();
    cJSON_AddItemToArray(choices, c);
    cJSON_AddNumberToObject(c, "index", ch->index);
    char *s = strndup(delta ? delta : "", n);
    if (call->chat) {
        cJSON *d = cJSON_AddObjectToObject(c, "delta");
        if (role)
            cJSON_AddStringToObject(d, "role", "assistant");
        if (role || n || !with_finish)
            cJSON_AddStringToObject(d, "content", s ? s : "");
    } else {
        cJSON_AddStringToObject(c, "text", s ? s : "");
    }
    free(s);
    if (lp)
        cJSON_AddItemToObject(c, "logprobs", lp);
    else
        cJSON_AddNullToObject(c, "logprobs");
    if (with_finish) {
        cJSON_AddStringToObject(c, "finish_reason", finish_name(ch->finish_reason));
        cJSON_AddItemToObject(c, "stop_reason",
                              ch->stop_reason ? cJSON_Duplicate(ch->stop_reason, 1)
                                              : cJSON_CreateNull());
    } else {
        cJSON_AddNullToObject(c, "finish_reason");
    }
    if (call->include_usage)
        cJSON_AddNullToObject(j, "usage");
    return sse_write(call->rq, j);
}

/* Streams what choice ch has for the client now. Caller holds call->mu. */
static bool stream_progress(struct oa_call *call, struct oa_choice *ch, cJSON *lp)
{
    bool ok = true;
    if (!call->started) {
        http_stream_begin(call->rq, 200, "text/event-stream");
        call->started = true;
    }
    if (!ch->head_sent) {
        ch->head_sent = true;
        const char *echo = call->echo ? call->echo_text[ch->prompt_index] : NULL;
        if (call->chat || (echo && echo[0]))
            ok = stream_chunk(call, ch, echo, echo ? strlen(echo) : 0, NULL, call->chat, false);
    }
    size_t upto = emit_upto(call, ch);
    if (ok && (upto > ch->sent || lp)) {
        ok = stream_chunk(call, ch, ch->text.s + ch->sent, upto - ch->sent, lp, false, false);
        lp = NULL;
        ch->sent = upto;
    }
    cJSON_Delete(lp);
    if (ok && ch->finished)
        ok = stream_chunk(call, ch, NULL, 0, NULL, false, true);
    return ok;
}

/* Records the first failure and cancels the other running choices. Caller
 * holds call->mu. */
static void call_fail_locked(struct oa_call *call, int status, const char *msg)
{
    if (call->failed)
        return;
    call->failed = true;
    call->err_status = status;
    snprintf(call->err_msg, sizeof call->err_msg, "%s", msg);
    const char *param =
        coord_http_param_of(msg, call->chat, call->err_param, sizeof call->err_param);
    if (!param)
        call->err_param[0] = '\0';
    for (int i = 0; i < call->n_choices; i++)
        if (call->ch[i].f)
            coord_request_cancel(call->ch[i].f);
}

/* Every choice ended: the answer to rq (taken from call->rq under the lock).
 * Called without call->mu: ending rq waits for a running on_close, which
 * takes call->mu. Only on_close may still touch the call (it sets `gone`),
 * so the flags are read once under the lock. */
static void call_complete(struct oa_call *call, struct http_request *rq)
{
    struct coord_http *h = call->h;
    if (!rq)
        return;
    pthread_mutex_lock(&call->mu);
    bool gone = call->gone, failed = call->failed, started = call->started;
    pthread_mutex_unlock(&call->mu);
    if (failed && !started) {
        coord_http_error(h, rq, call->route, call->err_status,
                         call->err_param[0] ? call->err_param : NULL, "%s", call->err_msg);
        return;
    }
    coord_metrics_http(h->c->metrics, call->route, gone ? 499 : failed ? call->err_status : 200);
    if (call->stream) {
        if (failed) {
            char *e = http_error_json(call->err_status, coord_http_error_type(call->err_status),
                                      call->err_param[0] ? call->err_param : NULL, call->err_msg);
            if (e) {
                http_stream_write(rq, "data: ", 6);
                http_stream_write(rq, e, strlen(e));
                http_stream_write(rq, "\n\n", 2);
            }
            free(e);
        } else if (call->include_usage) {
            cJSON *j = chunk_base(call);
            cJSON_AddArrayToObject(j, "choices");
            cJSON_AddItemToObject(j, "usage", usage_json(call));
            sse_write(rq, j);
        }
        static const char done[] = "data: [DONE]\n\n";
        http_stream_write(rq, done, sizeof done - 1);
        http_stream_end(rq);
        return;
    }
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "id", call->id);
    cJSON_AddStringToObject(j, "object", call->chat ? "chat.completion" : "text_completion");
    cJSON_AddNumberToObject(j, "created", (double)call->created);
    cJSON_AddStringToObject(j, "model", h->c->model_name);
    cJSON *choices = cJSON_AddArrayToObject(j, "choices");
    for (int i = 0; i < call->n_choices; i++) {
        struct oa_choice *ch = &call->ch[i];
        cJSON *c = cJSON_CreateObject();
        cJSON_AddItemToArray(choices, c);
        cJSON_AddNumberToObject(c, "index", ch->index);
        if (call->chat) {
            cJSON *m = cJSON_AddObjectToObject(c, "message");
            cJSON_AddStringToObject(m, "role", "assistant");
            cJSON_AddStringToObject(m, "content", ch->text.s ? ch->text.s : "");
        } else {
            const char *echo = call->echo ? call->echo_text[ch->prompt_index] : "";
            struct sbuf t = {0};
            sb_add(&t, echo, strlen(echo));
            sb_add(&t, ch->text.s ? ch->text.s : "", ch->text.len);
            cJSON_AddStringToObject(c, "text", t.s ? t.s : "");
            free(t.s);
        }
        if (ch->lp) {
            cJSON_AddItemToObject(c, "logprobs", ch->lp);
            ch->lp = NULL;
        } else if (call->want_logprobs) {
            cJSON_AddItemToObject(c, "logprobs",
                                  call->chat ? cJSON_CreateObject() : cJSON_CreateNull());
        } else {
            cJSON_AddNullToObject(c, "logprobs");
        }
        cJSON_AddStringToObject(c, "finish_reason", finish_name(ch->finish_reason));
        cJSON_AddItemToObject(c, "stop_reason",
                              ch->stop_reason ? cJSON_Duplicate(ch->stop_reason, 1)
                                              : cJSON_CreateNull());
        if (call->prompt_lp >= 0 && !call->chat) /* vLLM: per choice on completions */
            cJSON_AddItemToObject(c, "prompt_logprobs",
                                  ch->plp ? cJSON_Duplicate(ch->plp, 1) : cJSON_CreateNull());
    }
    if (call->prompt_lp >= 0 && call->chat) /* ... and once, beside the choices, on chat */
        cJSON_AddItemToObject(j, "prompt_logprobs",
                              call->ch[0].plp ? cJSON_Duplicate(call->ch[0].plp, 1)
                                              : cJSON_CreateNull());
    cJSON_AddItemToObject(j, "usage", usage_json(call));
    char *text = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (text)
        http_respond(rq, 200, "application/json", text, strlen(text));
    else
        http_respond_error(rq, 500, "server_error", NULL, "out of memory");
    free(text);
}

/* ---- the sink: the forwarded requests' side ----------------------------------------------- */

static void oa_attach(void *user, struct fwd *f)
{
    struct oa_choice *ch = user;
    pthread_mutex_lock(&ch->call->mu);
    ch->f = f;
    pthread_mutex_unlock(&ch->call->mu);
}

static bool oa_send(void *user, const Moe__V1__GenerateResponse *m)
{
    struct oa_choice *ch = user;
    struct oa_call *call = ch->call;
    pthread_mutex_lock(&call->mu);
    bool ok = !call->gone && !call->failed && call->rq;
    if (ok && http_request_client_gone(call->rq)) {
        /* Seen gone while waiting (no write failed yet): cancel them all. */
        call->gone = true;
        for (int i = 0; i < call->n_choices; i++)
            if (call->ch[i].f && &call->ch[i] != ch)
                coord_request_cancel(call->ch[i].f);
        ok = false;
    }
    if (ok && m->finish_reason == MOE__V1__FINISH_REASON__FINISH_REASON_ERROR) {
        char msg[1024];
        snprintf(msg, sizeof msg, "the engine failed: %.900s", m->error[0] ? m->error : "error");
        call_fail_locked(call, 500, msg);
        ok = false;
    }
    if (ok) {
        if (m->text[0] && !sb_add(&ch->text, m->text, strlen(m->text))) {
            call_fail_locked(call, 500, "out of memory");
            ok = false;
        }
        ch->n_out += (uint32_t)m->n_token_ids;
        if (call->min_tokens && ch->n_out <= call->min_tokens)
            ch->min_text_len = ch->text.len;
    }
    if (ok) {
        cJSON *lp = NULL;
        if (call->want_logprobs)
            add_logprobs(call, ch, call->stream ? &lp : &ch->lp, m);
        if (call->prompt_lp >= 0 && m->n_prompt_token_ids && !ch->plp)
            ch->plp = prompt_lp_json(call, m);
        if (m->finish_reason) {
            ch->finished = true;
            ch->finish_reason = (int)m->finish_reason;
            if (m->usage) {
                ch->prompt_tokens = m->usage->prompt_tokens;
                ch->completion_tokens = m->usage->completion_tokens;
                ch->cached_tokens = m->usage->cached_prompt_tokens;
            }
            if (m->finish_reason == MOE__V1__FINISH_REASON__FINISH_REASON_STOP && m->stop_reason)
                apply_stop(call, ch, m->stop_reason);
        }
        if (call->stream)
            ok = stream_progress(call, ch, lp);
        else
            cJSON_Delete(lp);
    }
    pthread_mutex_unlock(&call->mu);
    return ok;
}

static void oa_finish(void *user, enum rpc_code code, const char *msg)
{
    struct oa_choice *ch = user;
    struct oa_call *call = ch->call;
    pthread_mutex_lock(&call->mu);
    ch->f = NULL;
    ch->done = true;
    call->n_done++;
    if (code != RPC_OK && !call->gone)
        call_fail_locked(call, coord_http_status(code), msg ? msg : rpc_code_name(code));
    else if (code == RPC_OK && !ch->finished && !call->gone)
        call_fail_locked(call, 500, "the request ended without a finish reason");
    struct http_request *rq = NULL;
    if (call->n_done == call->n_choices) {
        rq = call->rq;
        call->rq = NULL;
    }
    pthread_mutex_unlock(&call->mu);
    if (rq)
        call_complete(call, rq); /* our reference keeps the call */
    pthread_mutex_lock(&call->mu);
    call_unref_unlock(call);
}

static const struct coord_sink oa_sink = {oa_attach, oa_send, oa_finish};

static void oa_on_close(struct http_request *rq, void *user)
{
    (void)rq;
    struct oa_call *call = user;
    pthread_mutex_lock(&call->mu);
    call->gone = true;
    for (int i = 0; i < call->n_choices; i++)
        if (call->ch[i].f)
            coord_request_cancel(call->ch[i].f);
    pthread_mutex_unlock(&call->mu);
}

/* ---- the handler ----------------------------------------------------------------------------- */

/* The owned GenerateRequest of one choice (packed and unpacked again, so
 * that protobuf-c owns every field). */
static Moe__V1__GenerateRequest *build_request(const struct oa_params *p, int prompt, int sample)
{
    Moe__V1__GenerateRequest g = MOE__V1__GENERATE_REQUEST__INIT;
    Moe__V1__TokenIds tids = MOE__V1__TOKEN_IDS__INIT;
    Moe__V1__SamplingParams sp = p->sp;
    const struct oa_prompt *pr = &p->prompts[prompt];
    if (pr->ids) {
        g.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS;
        tids.n_ids = pr->n_ids;
        tids.ids = pr->ids;
        g.token_ids = &tids;
    } else {
        g.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TEXT;
        g.text = (char *)pr->text;
    }
    if (sp.seed_opt_case == MOE__V1__SAMPLING_PARAMS__SEED_OPT_SEED)
        sp.seed += (uint64_t)sample;
    g.sampling = &sp;
    g.stream_text = true;
    size_t len;
    void *bytes = rpc_pack(&g, &len);
    if (!bytes)
        return NULL;
    Moe__V1__GenerateRequest *rq = moe__v1__generate_request__unpack(NULL, len, bytes);
    free(bytes);
    return rq;
}

static char *echo_of(struct coord *c, const struct oa_prompt *pr)
{
    if (pr->text)
        return strdup(pr->text);
    char *t = NULL;
    size_t n;
    int32_t *ids = malloc((pr->n_ids ? pr->n_ids : 1) * sizeof *ids);
    if (ids && c->tok) {
        for (size_t i = 0; i < pr->n_ids; i++)
            ids[i] = (int32_t)pr->ids[i];
        if (moe_tokenizer_decode(c->tok, ids, pr->n_ids, false, &t, &n, NULL) != MOE_OK)
            t = NULL;
    }
    free(ids);
    return t ? t : strdup("");
}

static struct oa_call *call_create(struct coord_http *h, struct http_request *rq,
                                   const struct oa_params *p)
{
    struct oa_call *call = calloc(1, sizeof *call);
    if (!call)
        return NULL;
    pthread_mutex_init(&call->mu, NULL);
    call->h = h;
    call->rq = rq;
    call->refs = 1;
    call->chat = p->chat;
    call->route = p->route;
    call->stream = p->stream;
    call->include_usage = p->include_usage;
    call->echo = p->echo;
    call->include_stop = p->include_stop;
    call->min_tokens = p->sp.min_tokens;
    call->prompt_lp = p->prompt_lp;
    call->n_lp_top = p->sp.logprobs;
    call->want_logprobs = p->want_logprobs;
    call->n = p->n;
    call->n_prompts = p->n_prompts;
    call->n_choices = p->n_prompts * p->n;
    call->created = (long)time(NULL);
    snprintf(call->id, sizeof call->id, "%s-%llx%06llx", p->chat ? "chatcmpl" : "cmpl",
             (unsigned long long)call->created,
             (unsigned long long)__atomic_add_fetch(&h->next_id, 1, __ATOMIC_RELAXED));
    call->ch = calloc((size_t)call->n_choices, sizeof *call->ch);
    call->stops = calloc(MOE_REQ_MAX_STOP, sizeof *call->stops);
    call->stop_ids = calloc(MOE_REQ_MAX_STOP_IDS, sizeof *call->stop_ids);
    call->echo_text = calloc((size_t)p->n_prompts, sizeof *call->echo_text);
    if (!call->ch || !call->stops || !call->stop_ids || !call->echo_text)
        goto fail;
    for (size_t i = 0; i < p->sp.n_stop; i++) {
        if (!(call->stops[i] = strdup(p->stop[i])))
            goto fail;
        call->n_stops++;
        size_t l = strlen(p->stop[i]);
        if (l > call->max_stop)
            call->max_stop = l;
    }
    call->n_stop_ids = (int)p->sp.n_stop_token_ids;
    memcpy(call->stop_ids, p->stop_ids, p->sp.n_stop_token_ids * sizeof *p->stop_ids);
    if (p->echo)
        for (int i = 0; i < p->n_prompts; i++)
            if (!(call->echo_text[i] = echo_of(h->c, &p->prompts[i])))
                goto fail;
    for (int i = 0; i < call->n_choices; i++) {
        call->ch[i].call = call;
        call->ch[i].index = i;
        call->ch[i].prompt_index = i / p->n;
        call->ch[i].sample = i % p->n;
    }
    return call;
fail:
    call_free(call);
    return NULL;
}

static void handle(struct coord_http *h, struct http_request *rq, bool chat)
{
    const char *route = chat ? "/v1/chat/completions" : "/v1/completions";
    cJSON *body = coord_http_parse_body(h, rq, route);
    if (!body)
        return;
    struct oa_params *p = calloc(1, sizeof *p);
    struct perr e = {0};
    if (!p) {
        cJSON_Delete(body);
        coord_http_error(h, rq, route, 500, NULL, "out of memory");
        return;
    }
    bool ok = chat ? parse_chat(h, body, p, &e) : parse_completions(h, body, p, &e);
    struct oa_call *call = ok ? call_create(h, rq, p) : NULL;
    if (!call) {
        if (!e.set)
            fail(&e, 500, NULL, "out of memory");
        coord_http_error(h, rq, route, e.status, e.param[0] ? e.param : NULL, "%s", e.msg);
        goto out;
    }
    http_request_set_on_close(rq, oa_on_close, call);
    for (int i = 0; i < call->n_choices; i++) {
        struct oa_choice *ch = &call->ch[i];
        pthread_mutex_lock(&call->mu);
        bool stop = call->failed || call->gone;
        if (!stop)
            call->refs++; /* the choice's, dropped by oa_finish */
        pthread_mutex_unlock(&call->mu);
        char msg[1024];
        enum rpc_code code = RPC_OK;
        Moe__V1__GenerateRequest *g = NULL;
        if (!stop) {
            g = build_request(p, ch->prompt_index, ch->sample);
            if (!g) {
                code = RPC_RESOURCE_EXHAUSTED;
                snprintf(msg, sizeof msg, "out of memory");
            } else {
                code = coord_request_start(h->c, g, INT64_MAX, &oa_sink, ch, msg, sizeof msg);
            }
        }
        if (code == RPC_OK && !stop)
            continue;
        /* Refused (or not started after a failure): this and every later
         * choice are done. */
        pthread_mutex_lock(&call->mu);
        if (!stop) {
            call->refs--;
            call_fail_locked(call, coord_http_status(code), msg);
        }
        for (int k = i; k < call->n_choices; k++) {
            call->ch[k].done = true;
            call->n_done++;
        }
        pthread_mutex_unlock(&call->mu);
        break;
    }
    pthread_mutex_lock(&call->mu);
    struct http_request *last = NULL;
    if (call->n_done == call->n_choices) {
        last = call->rq;
        call->rq = NULL;
    }
    pthread_mutex_unlock(&call->mu);
    if (last)
        call_complete(call, last);
    pthread_mutex_lock(&call->mu);
    call_unref_unlock(call);
out:
    params_free(p);
    free(p);
    cJSON_Delete(body);
}

static void handle_completions(struct http_request *rq, void *user)
{
    handle(user, rq, false);
}

static void handle_chat(struct http_request *rq, void *user)
{
    handle(user, rq, true);
}

enum moe_status coord_openai_register(struct coord_http *h, struct moe_error *err)
{
    enum moe_status st;
    if ((st = http_server_route(h->srv, "POST", "/v1/completions", handle_completions, h, err)) ||
        (st = http_server_route(h->srv, "POST", "/v1/chat/completions", handle_chat, h, err)))
        return st;
    return MOE_OK;
}
