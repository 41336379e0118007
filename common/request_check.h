/* Bounds on the fields of a generation request, shared by the coordinator
 * (which answers INVALID_ARGUMENT before routing) and the worker (which
 * checks again: it can be called directly). Messages name the field. */
#ifndef MOE_REQUEST_CHECK_H
#define MOE_REQUEST_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "moe/v1/inference.pb-c.h"

#define MOE_REQ_MAX_STOP 8       /* stop strings */
#define MOE_REQ_MAX_STOP_LEN 128 /* bytes per stop string */
#define MOE_REQ_MAX_STOP_IDS 16
#define MOE_REQ_MAX_LOGPROBS 20
#define MOE_REQ_MAX_LOGIT_BIAS 300 /* tokens, as OpenAI's limit */
#define MOE_REQ_MAX_BIAS 100.0f    /* |bias| */
#define MOE_REQ_MAX_PROMPT_BYTES (1u << 20)
#define MOE_REQ_MAX_ID_LEN 128    /* request_id */
#define MOE_REQ_MAX_MODEL_LEN 256 /* model */

/* Checks the sampling parameters (NULL means all defaults). Returns 0 when
 * valid, else writes "field: why" into msg and returns -1. */
int moe_check_sampling(const Moe__V1__SamplingParams *sp, char *msg, size_t cap);

/* Checks the prompt length against the context: n_prompt >= 1 and
 * n_prompt + max_tokens <= max_context (max_tokens 0 = up to the context). */
int moe_check_lengths(size_t n_prompt, const Moe__V1__SamplingParams *sp, unsigned max_context,
                      char *msg, size_t cap);

/* Checks what the coordinator and the worker both check in a generation
 * request, so that a worker called directly is as strict as the
 * coordinator: the request id's length, the sampling parameters
 * (moe_check_sampling) and the stop token ids against the vocabulary.
 * Returns 0 or -1 with "field: why" in msg. */
int moe_check_generation(const char *request_id, const Moe__V1__SamplingParams *sp,
                         unsigned vocab_size, char *msg, size_t cap);

/* Every id of ids (n) is below vocab_size; a refusal names field[i]. */
int moe_check_token_ids(const uint32_t *ids, size_t n, unsigned vocab_size, const char *field,
                        char *msg, size_t cap);

/* Every string field of the protobuf-c message m, in nested messages and
 * repeated fields too, is valid UTF-8 (as proto3 requires and protobuf-c
 * does not check), so nothing invalid is echoed back in an answer. A
 * refusal names the field path ("sampling.stop[1]: not valid UTF-8 (byte
 * 3)") and never quotes the bytes. */
int moe_check_strings(const ProtobufCMessage *m, char *msg, size_t cap);

/* The largest valid request on the coordinator's public port, in bytes: a
 * prompt of MOE_REQ_MAX_PROMPT_BYTES of text or of max_context token ids
 * (5 bytes each at most), plus every other field at its limit, with room to
 * spare (64 KiB). The port refuses larger messages (RESOURCE_EXHAUSTED)
 * before decoding them. */
size_t moe_request_max_bytes(unsigned max_context);

/* The same for a worker's port: a WorkerGenerateRequest (max_context ids)
 * or the KV handoff's control messages (a KvTransferChunk with the
 * sequence's token ids and one block id per token at most, a KvSend with
 * world_size endpoints). The KV bytes themselves go over the KV data plane
 * (disagg/kv_link.h), which has its own frame limits. */
size_t moe_worker_request_max_bytes(unsigned max_context, int world_size);

/* The largest valid HTTP body of the OpenAI API: one prompt of
 * MOE_REQ_MAX_PROMPT_BYTES escaped at up to 2 bytes per byte (quotes,
 * backslashes, newlines), or max_context token ids written out (11 bytes
 * each), plus the other fields (64 KiB); at least 1 MiB. A batch of
 * several long prompts must be split, or --http-max-body raised. */
size_t moe_http_body_max_bytes(unsigned max_context);

#endif
