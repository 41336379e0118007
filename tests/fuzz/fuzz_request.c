/* Fuzz target: request validation from raw protobuf bytes, as the servers
 * do it: protobuf-c unpack of a moe.v1 message, then for GenerateRequest
 * (coordinator/forward.c) and WorkerGenerateRequest (worker/serve/service.c) the
 * shared bounds of common/request_check.c: moe_check_strings (UTF-8 in every
 * string field, any message), moe_check_generation and moe_check_token_ids
 * (what both servers check), moe_check_sampling, moe_check_lengths.
 *
 * Input: byte 0 picks the message type (every message of proto/moe/v1 and
 * grpc.health.v1; 0 = GenerateRequest, 1 = WorkerGenerateRequest), the rest
 * is its wire encoding. What must hold: an unpacked message is well formed
 * (protobuf_c_message_check) and packs to bytes that unpack and pack to the
 * same bytes; a request the checks accept fits the engine's fixed arrays
 * (worker/engine.h: stop strings, stop ids) and the context; a refusal
 * names the field. */
#include <math.h>
#include <stdbool.h>

#include "engine/engine.h"
#include "fuzz.h"
#include "moe/v1/admin.pb-c.h"
#include "moe/v1/health.pb-c.h"
#include "moe/v1/inference.pb-c.h"
#include "moe/v1/worker.pb-c.h"
#include "request_check.h"

#include <unistr.h>

static const ProtobufCMessageDescriptor *const descs[] = {
    &moe__v1__generate_request__descriptor,
    &moe__v1__worker_generate_request__descriptor,
    &moe__v1__worker_status__descriptor,
    &moe__v1__cluster_status_request__descriptor,
    &moe__v1__cluster_status_response__descriptor,
    &moe__v1__list_workers_request__descriptor,
    &moe__v1__list_workers_response__descriptor,
    &moe__v1__drain_worker_request__descriptor,
    &moe__v1__drain_worker_response__descriptor,
    &moe__v1__undrain_worker_request__descriptor,
    &moe__v1__undrain_worker_response__descriptor,
    &moe__v1__get_expert_stats_request__descriptor,
    &moe__v1__expert_stats__descriptor,
    &moe__v1__get_placement_request__descriptor,
    &moe__v1__worker_epoch__descriptor,
    &moe__v1__placement_info__descriptor,
    &moe__v1__plan_placement_request__descriptor,
    &moe__v1__placement_change__descriptor,
    &moe__v1__placement_plan__descriptor,
    &moe__v1__apply_placement_request__descriptor,
    &moe__v1__rollback_placement_request__descriptor,
    &grpc__health__v1__health_check_request__descriptor,
    &grpc__health__v1__health_check_response__descriptor,
    &moe__v1__token_ids__descriptor,
    &moe__v1__sampling_params__descriptor,
    &moe__v1__generate_request__descriptor,
    &moe__v1__top_logprob__descriptor,
    &moe__v1__token_logprob__descriptor,
    &moe__v1__usage__descriptor,
    &moe__v1__timings__descriptor,
    &moe__v1__generate_response__descriptor,
    &moe__v1__abort_request__descriptor,
    &moe__v1__abort_response__descriptor,
    &moe__v1__model_info_request__descriptor,
    &moe__v1__model_info__descriptor,
    &moe__v1__tokenize_request__descriptor,
    &moe__v1__tokenize_response__descriptor,
    &moe__v1__worker_generate_request__descriptor,
    &moe__v1__get_load_request__descriptor,
    &moe__v1__worker_load__descriptor,
    &moe__v1__kv_reserve_request__descriptor,
    &moe__v1__kv_reserve_response__descriptor,
    &moe__v1__kv_transfer_chunk__descriptor,
    &moe__v1__kv_transfer_response__descriptor,
    &moe__v1__kv_send_request__descriptor,
    &moe__v1__kv_send_response__descriptor,
    &moe__v1__kv_release_request__descriptor,
    &moe__v1__kv_release_response__descriptor,
};

/* Whether m or a message inside it kept unknown fields. */
static bool has_unknown(const ProtobufCMessage *m)
{
    if (m->n_unknown_fields)
        return true;
    const ProtobufCMessageDescriptor *d = m->descriptor;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        const char *base = (const char *)m;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)(base + f->quantifier_offset);
            ProtobufCMessage *const *v = *(ProtobufCMessage *const *const *)(base + f->offset);
            for (size_t k = 0; k < n; k++)
                if (has_unknown(v[k]))
                    return true;
            continue;
        }
        if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
            *(const uint32_t *)(base + f->quantifier_offset) != f->id)
            continue;
        const ProtobufCMessage *sub = *(ProtobufCMessage *const *)(base + f->offset);
        if (sub && has_unknown(sub))
            return true;
    }
    return false;
}

/* What the engine and the sampler rely on once moe_check_sampling passed. */
static void check_accepted_sampling(const Moe__V1__SamplingParams *sp)
{
    if (!sp)
        return;
    FUZZ_CHECK(sp->n_stop <= MOE_MAX_STOP_STRINGS && sp->n_stop_token_ids <= MOE_MAX_STOP_IDS,
               "%zu stop strings, %zu stop ids", sp->n_stop, sp->n_stop_token_ids);
    for (size_t i = 0; i < sp->n_stop; i++)
        FUZZ_CHECK(strlen(sp->stop[i]) >= 1 && strlen(sp->stop[i]) <= MOE_MAX_STOP_LEN,
                   "stop[%zu] of %zu bytes", i, strlen(sp->stop[i]));
    FUZZ_CHECK(isfinite(sp->temperature) && sp->temperature >= 0 && isfinite(sp->top_p) &&
                   isfinite(sp->min_p) && isfinite(sp->repetition_penalty) &&
                   isfinite(sp->presence_penalty) && isfinite(sp->frequency_penalty),
               "a non-finite sampling value accepted");
    FUZZ_CHECK(sp->top_k <= (uint32_t)INT32_MAX, "top_k %u does not fit an int", sp->top_k);
    FUZZ_CHECK(sp->logprobs_opt_case != MOE__V1__SAMPLING_PARAMS__LOGPROBS_OPT_LOGPROBS ||
                   sp->logprobs <= MOE_REQ_MAX_LOGPROBS,
               "logprobs %u", sp->logprobs);
    FUZZ_CHECK(sp->n_logit_bias <= MOE_MAX_LOGIT_BIAS, "%zu logit_bias tokens", sp->n_logit_bias);
    for (size_t i = 0; i < sp->n_logit_bias; i++)
        FUZZ_CHECK(isfinite(sp->logit_bias[i]->value) && fabsf(sp->logit_bias[i]->value) <= 100.0f,
                   "logit_bias[%u] %g accepted", sp->logit_bias[i]->key,
                   (double)sp->logit_bias[i]->value);
    FUZZ_CHECK(sp->max_tokens == 0 || sp->min_tokens <= sp->max_tokens, "min_tokens %u > %u",
               sp->min_tokens, sp->max_tokens);
    FUZZ_CHECK(sp->prompt_logprobs_opt_case !=
                       MOE__V1__SAMPLING_PARAMS__PROMPT_LOGPROBS_OPT_PROMPT_LOGPROBS ||
                   sp->prompt_logprobs <= MOE_REQ_MAX_LOGPROBS,
               "prompt_logprobs %u", sp->prompt_logprobs);
}

/* Both checks, on the sampling parameters and on n_prompt against a few
 * context sizes (the model's max_position_embeddings is in [1, INT_MAX]). */
static void check_request(const Moe__V1__SamplingParams *sp, size_t n_prompt)
{
    char msg[1024] = "";
    if (moe_check_sampling(sp, msg, sizeof msg)) {
        FUZZ_CHECK(fuzz_msg_ok(msg) && !strncmp(msg, "sampling.", 9), "refusal '%s'", msg);
        return;
    }
    check_accepted_sampling(sp);
    static const unsigned contexts[] = {1, 40, 32768, 2147483647u};
    for (size_t i = 0; i < sizeof contexts / sizeof contexts[0]; i++) {
        unsigned ctx = contexts[i];
        msg[0] = '\0';
        if (moe_check_lengths(n_prompt, sp, ctx, msg, sizeof msg)) {
            FUZZ_CHECK(fuzz_msg_ok(msg) && (!strncmp(msg, "prompt", 6) ||
                                            !strncmp(msg, "sampling.max_tokens", 19) ||
                                            !strncmp(msg, "sampling.min_tokens", 19)),
                       "refusal '%s'", msg);
            continue;
        }
        unsigned max_tokens = sp ? sp->max_tokens : 0, min_tokens = sp ? sp->min_tokens : 0;
        FUZZ_CHECK(n_prompt >= 1 && n_prompt < ctx &&
                       (uint64_t)n_prompt + (max_tokens ? max_tokens : 1) <= ctx &&
                       (uint64_t)n_prompt + min_tokens <= ctx,
                   "%zu prompt tokens + max_tokens %u / min_tokens %u accepted for a context of %u",
                   n_prompt, max_tokens, min_tokens, ctx);
    }
}

/* Every string field of m (nested, repeated) is valid UTF-8: an oracle for
 * moe_check_strings written apart from it. */
static bool all_utf8(const ProtobufCMessage *m)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    const char *base = (const char *)m;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type != PROTOBUF_C_TYPE_STRING && f->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
            *(const uint32_t *)(base + f->quantifier_offset) != f->id)
            continue;
        size_t n = 1;
        void *const *v = (void *const *)(base + f->offset);
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            n = *(const size_t *)(base + f->quantifier_offset);
            v = *(void *const *const *)(base + f->offset);
        }
        for (size_t k = 0; k < n; k++) {
            if (!v[k])
                continue;
            if (f->type == PROTOBUF_C_TYPE_STRING
                    ? u8_check((const uint8_t *)v[k], strlen(v[k])) != NULL
                    : !all_utf8(v[k]))
                return false;
        }
    }
    return true;
}

/* The checks both servers run on a generation request (vocab of the fixtures). */
static void check_generation(const char *request_id, const Moe__V1__SamplingParams *sp,
                             const uint32_t *ids, size_t n_ids)
{
    static const unsigned vocabs[] = {1, 801, 151936};
    for (size_t v = 0; v < sizeof vocabs / sizeof vocabs[0]; v++) {
        char msg[1024] = "";
        if (moe_check_generation(request_id, sp, vocabs[v], msg, sizeof msg)) {
            FUZZ_CHECK(fuzz_msg_ok(msg) &&
                           (!strncmp(msg, "sampling.", 9) || !strncmp(msg, "request_id", 10)),
                       "refusal '%s'", msg);
        } else {
            FUZZ_CHECK(strlen(request_id) <= MOE_REQ_MAX_ID_LEN, "request_id of %zu bytes",
                       strlen(request_id));
            for (size_t i = 0; sp && i < sp->n_stop_token_ids; i++)
                FUZZ_CHECK(sp->stop_token_ids[i] < vocabs[v], "stop id %u, vocab %u",
                           sp->stop_token_ids[i], vocabs[v]);
        }
        msg[0] = '\0';
        if (moe_check_token_ids(ids, n_ids, vocabs[v], "prompt", msg, sizeof msg)) {
            FUZZ_CHECK(fuzz_msg_ok(msg) && !strncmp(msg, "prompt[", 7), "refusal '%s'", msg);
        } else {
            for (size_t i = 0; i < n_ids; i++)
                FUZZ_CHECK(ids[i] < vocabs[v], "id %u accepted, vocab %u", ids[i], vocabs[v]);
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const ProtobufCMessageDescriptor *desc = descs[data[0] % (sizeof descs / sizeof descs[0])];
    ProtobufCMessage *m = protobuf_c_message_unpack(desc, NULL, size - 1, data + 1);
    if (!m)
        return 0; /* answered INVALID_ARGUMENT "not a valid ... message" */
    FUZZ_CHECK(protobuf_c_message_check(m), "%s unpacked but is not well formed", desc->name);
    size_t n1 = protobuf_c_message_get_packed_size(m);
    uint8_t *b1 = malloc(n1 ? n1 : 1);
    FUZZ_CHECK(b1 && protobuf_c_message_pack(m, b1) == n1, "%s: pack", desc->name);
    /* Unknown fields are kept and packed again as they came; protobuf-c 1.4
     * accepts a field number 0 there that it refuses when it reads its own
     * packing back. Only a message without unknown fields must round-trip. */
    if (!has_unknown(m)) {
        ProtobufCMessage *m2 = protobuf_c_message_unpack(desc, NULL, n1, b1);
        FUZZ_CHECK(m2, "%s: its own packing does not unpack", desc->name);
        size_t n2 = protobuf_c_message_get_packed_size(m2);
        uint8_t *b2 = malloc(n2 ? n2 : 1);
        FUZZ_CHECK(b2 && protobuf_c_message_pack(m2, b2) == n2 && n2 == n1 && !memcmp(b1, b2, n1),
                   "%s: pack(unpack(pack(m))) != pack(m)", desc->name);
        free(b2);
        protobuf_c_message_free_unpacked(m2, NULL);
    }

    /* UTF-8 in every string field, whatever the message */
    char smsg[512] = "";
    bool utf8_ok = moe_check_strings(m, smsg, sizeof smsg) == 0;
    FUZZ_CHECK(utf8_ok == all_utf8(m), "%s: moe_check_strings says %s ('%s')", desc->name,
               utf8_ok ? "valid" : "invalid", smsg);
    FUZZ_CHECK(utf8_ok || (fuzz_msg_ok(smsg) && strstr(smsg, "not valid UTF-8") &&
                           !u8_check((const uint8_t *)smsg, strlen(smsg))),
               "refusal '%s'", smsg);

    if (desc == &moe__v1__generate_request__descriptor) {
        const Moe__V1__GenerateRequest *rq = (const Moe__V1__GenerateRequest *)m;
        const Moe__V1__TokenIds *t =
            rq->prompt_case == MOE__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS ? rq->token_ids : NULL;
        check_generation(rq->request_id, rq->sampling, t ? t->ids : NULL, t ? t->n_ids : 0);
        size_t n_prompt = 0;
        if (rq->prompt_case == MOE__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS)
            n_prompt = rq->token_ids ? rq->token_ids->n_ids : 0;
        else if (rq->prompt_case == MOE__V1__GENERATE_REQUEST__PROMPT_TEXT)
            n_prompt = strlen(rq->text); /* at most one token per byte, plus BOS */
        check_request(rq->sampling, n_prompt);
    } else if (desc == &moe__v1__worker_generate_request__descriptor) {
        const Moe__V1__WorkerGenerateRequest *rq = (const Moe__V1__WorkerGenerateRequest *)m;
        check_generation(rq->request_id, rq->sampling, rq->prompt_token_ids,
                         rq->n_prompt_token_ids);
        check_request(rq->sampling, rq->n_prompt_token_ids);
    }
    free(b1);
    protobuf_c_message_free_unpacked(m, NULL);
    return 0;
}
