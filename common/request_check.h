/* Bounds on the fields of a generation request, shared by the coordinator
 * (which answers INVALID_ARGUMENT before routing) and the worker (which
 * checks again: it can be called directly). Messages name the field. */
#ifndef MOE_REQUEST_CHECK_H
#define MOE_REQUEST_CHECK_H

#include <stddef.h>

#include "moe/v1/inference.pb-c.h"

#define MOE_REQ_MAX_STOP 8       /* stop strings */
#define MOE_REQ_MAX_STOP_LEN 128 /* bytes per stop string */
#define MOE_REQ_MAX_STOP_IDS 16
#define MOE_REQ_MAX_LOGPROBS 20
#define MOE_REQ_MAX_PROMPT_BYTES (1u << 20)
#define MOE_REQ_MAX_ID_LEN 128 /* request_id */

/* Checks the sampling parameters (NULL means all defaults). Returns 0 when
 * valid, else writes "field: why" into msg and returns -1. */
int moe_check_sampling(const Moe__V1__SamplingParams *sp, char *msg, size_t cap);

/* Checks the prompt length against the context: n_prompt >= 1 and
 * n_prompt + max_tokens <= max_context (max_tokens 0 = up to the context). */
int moe_check_lengths(size_t n_prompt, const Moe__V1__SamplingParams *sp, unsigned max_context,
                      char *msg, size_t cap);

#endif
