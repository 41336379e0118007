#include "request_check.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistr.h>

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        snprintf(msg, cap, __VA_ARGS__);                                                           \
        return -1;                                                                                 \
    } while (0)

int moe_check_sampling(const Moe__V1__SamplingParams *sp, char *msg, size_t cap)
{
    if (!sp)
        return 0;
    if (!(sp->temperature >= 0.0f && sp->temperature <= 100.0f))
        FAIL("sampling.temperature: %g is not in [0, 100]", (double)sp->temperature);
    if (!(sp->top_p >= 0.0f && sp->top_p <= 1.0f))
        FAIL("sampling.top_p: %g is not in [0, 1]", (double)sp->top_p);
    if (sp->top_k > (1u << 20))
        FAIL("sampling.top_k: %u is larger than 1048576", sp->top_k);
    if (!(sp->min_p >= 0.0f && sp->min_p <= 1.0f))
        FAIL("sampling.min_p: %g is not in [0, 1]", (double)sp->min_p);
    if (!(sp->repetition_penalty >= 0.0f && sp->repetition_penalty <= 10.0f))
        FAIL("sampling.repetition_penalty: %g is not in [0, 10]", (double)sp->repetition_penalty);
    if (!(fabsf(sp->presence_penalty) <= 2.0f))
        FAIL("sampling.presence_penalty: %g is not in [-2, 2]", (double)sp->presence_penalty);
    if (!(fabsf(sp->frequency_penalty) <= 2.0f))
        FAIL("sampling.frequency_penalty: %g is not in [-2, 2]", (double)sp->frequency_penalty);
    if (sp->n_stop > MOE_REQ_MAX_STOP)
        FAIL("sampling.stop: %zu strings, at most %d allowed", sp->n_stop, MOE_REQ_MAX_STOP);
    for (size_t i = 0; i < sp->n_stop; i++) {
        size_t len = strlen(sp->stop[i]);
        if (len == 0 || len > MOE_REQ_MAX_STOP_LEN)
            FAIL("sampling.stop[%zu]: length %zu is not in [1, %d]", i, len, MOE_REQ_MAX_STOP_LEN);
    }
    if (sp->prompt_logprobs_opt_case ==
            MOE__V1__SAMPLING_PARAMS__PROMPT_LOGPROBS_OPT_PROMPT_LOGPROBS &&
        sp->prompt_logprobs > MOE_REQ_MAX_LOGPROBS)
        FAIL("sampling.prompt_logprobs: %u is not in [0, %d]", sp->prompt_logprobs,
             MOE_REQ_MAX_LOGPROBS);
    if (sp->n_logit_bias > MOE_REQ_MAX_LOGIT_BIAS)
        FAIL("sampling.logit_bias: %zu tokens, at most %d allowed", sp->n_logit_bias,
             MOE_REQ_MAX_LOGIT_BIAS);
    for (size_t i = 0; i < sp->n_logit_bias; i++)
        if (!(fabsf(sp->logit_bias[i]->value) <= MOE_REQ_MAX_BIAS))
            FAIL("sampling.logit_bias[%u]: %g is not in [-100, 100]", sp->logit_bias[i]->key,
                 (double)sp->logit_bias[i]->value);
    if (sp->max_tokens && sp->min_tokens > sp->max_tokens)
        FAIL("sampling.min_tokens: %u is more than max_tokens %u", sp->min_tokens, sp->max_tokens);
    if (sp->n_stop_token_ids > MOE_REQ_MAX_STOP_IDS)
        FAIL("sampling.stop_token_ids: %zu ids, at most %d allowed", sp->n_stop_token_ids,
             MOE_REQ_MAX_STOP_IDS);
    if (sp->logprobs_opt_case == MOE__V1__SAMPLING_PARAMS__LOGPROBS_OPT_LOGPROBS &&
        sp->logprobs > MOE_REQ_MAX_LOGPROBS)
        FAIL("sampling.logprobs: %u is not in [0, %d]", sp->logprobs, MOE_REQ_MAX_LOGPROBS);
    return 0;
}

int moe_check_lengths(size_t n_prompt, const Moe__V1__SamplingParams *sp, unsigned max_context,
                      char *msg, size_t cap)
{
    if (n_prompt == 0)
        FAIL("prompt: empty");
    if (n_prompt >= max_context)
        FAIL("prompt: %zu tokens, the model's context is %u (room is needed for one new token)",
             n_prompt, max_context);
    unsigned max_tokens = sp ? sp->max_tokens : 0;
    if (max_tokens && n_prompt + max_tokens > max_context)
        FAIL("sampling.max_tokens: prompt (%zu tokens) + max_tokens (%u) exceeds the model's "
             "context of %u",
             n_prompt, max_tokens, max_context);
    unsigned min_tokens = sp ? sp->min_tokens : 0;
    if (min_tokens && n_prompt + min_tokens > max_context)
        FAIL("sampling.min_tokens: prompt (%zu tokens) + min_tokens (%u) exceeds the model's "
             "context of %u",
             n_prompt, min_tokens, max_context);
    return 0;
}

int moe_check_token_ids(const uint32_t *ids, size_t n, unsigned vocab_size, const char *field,
                        char *msg, size_t cap)
{
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= vocab_size)
            FAIL("%s[%zu]: %u is outside the vocabulary [0, %u)", field, i, ids[i], vocab_size);
    return 0;
}

int moe_check_generation(const char *request_id, const Moe__V1__SamplingParams *sp,
                         unsigned vocab_size, char *msg, size_t cap)
{
    size_t n = request_id ? strlen(request_id) : 0;
    if (n > MOE_REQ_MAX_ID_LEN)
        FAIL("request_id: %zu bytes, at most %d allowed", n, MOE_REQ_MAX_ID_LEN);
    if (moe_check_sampling(sp, msg, cap))
        return -1;
    if (sp && moe_check_token_ids(sp->stop_token_ids, sp->n_stop_token_ids, vocab_size,
                                  "sampling.stop_token_ids", msg, cap))
        return -1;
    for (size_t i = 0; sp && i < sp->n_logit_bias; i++)
        if (sp->logit_bias[i]->key >= vocab_size)
            FAIL("sampling.logit_bias: token %u is outside the vocabulary [0, %u)",
                 sp->logit_bias[i]->key, vocab_size);
    return 0;
}

/* One string; path is the field's name so far. */
static int check_utf8(const char *s, const char *path, char *msg, size_t cap)
{
    size_t n = s ? strlen(s) : 0;
    const uint8_t *bad = n ? u8_check((const uint8_t *)s, n) : NULL;
    if (bad)
        FAIL("%s: not valid UTF-8 (byte %zu of %zu)", path, (size_t)(bad - (const uint8_t *)s), n);
    return 0;
}

static int check_strings(const ProtobufCMessage *m, const char *prefix, int depth, char *msg,
                         size_t cap)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    if (depth > 32)
        FAIL("%s: nested too deeply", prefix[0] ? prefix : d->short_name);
    const char *base = (const char *)m;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type != PROTOBUF_C_TYPE_STRING && f->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
            *(const uint32_t *)(base + f->quantifier_offset) != f->id)
            continue;
        char path[160];
        snprintf(path, sizeof path, "%s%s%s", prefix, prefix[0] ? "." : "", f->name);
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)(base + f->quantifier_offset);
            void *const *v = *(void *const *const *)(base + f->offset);
            for (size_t k = 0; k < n; k++) {
                char item[192];
                snprintf(item, sizeof item, "%s[%zu]", path, k);
                if (f->type == PROTOBUF_C_TYPE_STRING
                        ? check_utf8(v[k], item, msg, cap)
                        : check_strings(v[k], item, depth + 1, msg, cap))
                    return -1;
            }
            continue;
        }
        const void *v = *(const void *const *)(base + f->offset);
        if (!v)
            continue;
        if (f->type == PROTOBUF_C_TYPE_STRING ? check_utf8(v, path, msg, cap)
                                              : check_strings(v, path, depth + 1, msg, cap))
            return -1;
    }
    return 0;
}

int moe_check_strings(const ProtobufCMessage *m, char *msg, size_t cap)
{
    return m ? check_strings(m, "", 0, msg, cap) : 0;
}

#define FIELDS_SLACK ((size_t)64 << 10)

size_t moe_request_max_bytes(unsigned max_context)
{
    size_t text = MOE_REQ_MAX_PROMPT_BYTES, ids = (size_t)max_context * 5;
    return (text > ids ? text : ids) + FIELDS_SLACK;
}

size_t moe_worker_request_max_bytes(unsigned max_context, int world_size)
{
    /* token ids and as many block ids, 5 bytes each; endpoints of <= 300 bytes */
    return (size_t)max_context * 10 + (size_t)(world_size > 0 ? world_size : 1) * 600 +
           FIELDS_SLACK;
}

size_t moe_http_body_max_bytes(unsigned max_context)
{
    size_t text = 2 * (size_t)MOE_REQ_MAX_PROMPT_BYTES, ids = (size_t)max_context * 11;
    size_t n = (text > ids ? text : ids) + FIELDS_SLACK;
    return n < ((size_t)1 << 20) ? (size_t)1 << 20 : n;
}
