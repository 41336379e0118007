#include "request_check.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

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
    return 0;
}
