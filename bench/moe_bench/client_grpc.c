/* The gRPC backend: moe.v1.Inference/Generate over common/rpc.h. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"
#include "moe/v1/inference.pb-c.h"
#include "clock.h"

enum moe_status bench_grpc_probe(struct bench_target *t, double timeout_s, char *model,
                                 size_t model_cap, int *vocab, struct moe_error *err)
{
    Moe__V1__ModelInfoRequest rq = MOE__V1__MODEL_INFO_REQUEST__INIT;
    uint8_t buf[16];
    size_t len = moe__v1__model_info_request__pack(&rq, buf);
    struct rpc_reply reply;
    enum rpc_code code = rpc_client_call(t->rpc, "/moe.v1.Inference/GetModelInfo", buf, len,
                                         (int64_t)(timeout_s * 1e3), &reply);
    if (code != RPC_OK)
        return moe_error_set(err, MOE_ERR_IO, "cannot reach the gRPC target %s: %s: %s", t->url,
                             rpc_code_name(code), reply.message);
    Moe__V1__ModelInfo *info = moe__v1__model_info__unpack(NULL, reply.len, reply.data);
    rpc_reply_clear(&reply);
    if (!info)
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: the ModelInfo reply does not parse", t->url);
    snprintf(model, model_cap, "%s", info->name);
    *vocab = (int)info->vocab_size;
    moe__v1__model_info__free_unpacked(info, NULL);
    return MOE_OK;
}

static const char *finish_name(Moe__V1__FinishReason f)
{
    switch (f) {
    case MOE__V1__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    case MOE__V1__FINISH_REASON__FINISH_REASON_STOP: return "stop";
    case MOE__V1__FINISH_REASON__FINISH_REASON_ABORT: return "abort";
    case MOE__V1__FINISH_REASON__FINISH_REASON_ERROR: return "error";
    default: return "";
    }
}

void bench_grpc_run(struct bench_conn *c, const struct bench_item *item, const char *request_id,
                    double t_origin, struct bench_record *rec)
{
    struct bench_target *t = c->t;
    Moe__V1__GenerateRequest rq = MOE__V1__GENERATE_REQUEST__INIT;
    Moe__V1__SamplingParams sp = MOE__V1__SAMPLING_PARAMS__INIT;
    Moe__V1__TokenIds ids = MOE__V1__TOKEN_IDS__INIT;
    rq.request_id = (char *)request_id;
    rq.model = t->model;
    rq.sampling = &sp;
    if (item->ids) {
        ids.n_ids = (size_t)item->n_ids;
        ids.ids = (uint32_t *)item->ids; /* ids are >= 0: same bits */
        rq.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS;
        rq.token_ids = &ids;
    } else {
        rq.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TEXT;
        rq.text = item->text;
    }
    sp.max_tokens = (uint32_t)item->output_len;
    sp.ignore_eos = t->o.ignore_eos;
    sp.temperature = t->o.has_temperature ? t->o.temperature : 0;
    sp.top_p = t->o.top_p;
    sp.top_k = (uint32_t)(t->o.top_k > 0 ? t->o.top_k : 0);
    size_t len = moe__v1__generate_request__get_packed_size(&rq);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) {
        bench_fail(rec, "NOMEM", "out of memory");
        return;
    }
    moe__v1__generate_request__pack(&rq, buf);

    struct moe_error err = {0};
    double t0 = moe_now();
    rec->start_s = t0 - t_origin;
    struct rpc_client_stream *st = rpc_client_stream_start(
        t->rpc, "/moe.v1.Inference/Generate", buf, len, (int64_t)(t->o.timeout_s * 1e3), &err);
    free(buf);
    if (!st) {
        bench_fail(rec, "LOCAL", "%s", err.msg);
        return;
    }
    const uint8_t *msg;
    size_t msg_len;
    bool bad_msg = false, finished = false;
    Moe__V1__FinishReason fin = 0;
    char fin_error[200] = "";
    while (rpc_client_stream_next(st, &msg, &msg_len)) {
        double now = moe_now();
        Moe__V1__GenerateResponse *r = moe__v1__generate_response__unpack(NULL, msg_len, msg);
        if (!r) {
            bad_msg = true;
            rpc_client_stream_cancel(st);
            continue;
        }
        if (r->n_token_ids) {
            if (bench_record_add_chunk(rec, now - t0, (int)r->n_token_ids)) {
                bad_msg = true;
                rpc_client_stream_cancel(st);
            }
            rec->counted_tokens += (int)r->n_token_ids;
        }
        if (r->finish_reason) {
            finished = true;
            fin = r->finish_reason;
            snprintf(rec->finish, sizeof rec->finish, "%s", finish_name(fin));
            if (r->error && r->error[0])
                snprintf(fin_error, sizeof fin_error, "%s", r->error);
            if (r->usage) {
                rec->server_prompt_tokens = (int32_t)r->usage->prompt_tokens;
                rec->server_completion_tokens = (int32_t)r->usage->completion_tokens;
                rec->server_cached_tokens = (int32_t)r->usage->cached_prompt_tokens;
            }
            if (r->timings) {
                rec->srv_queue_ms = r->timings->queue_ms;
                rec->srv_prefill_ms = r->timings->prefill_ms;
                rec->srv_ttft_ms = r->timings->ttft_ms;
                rec->srv_decode_ms = r->timings->decode_ms;
                rec->srv_e2e_ms = r->timings->e2e_ms;
                rec->srv_transfer_ms = r->timings->transfer_ms;
            }
        }
        moe__v1__generate_response__free_unpacked(r, NULL);
    }
    const char *smsg = NULL;
    enum rpc_code code = rpc_client_stream_status(st, &smsg);
    char smsg_copy[200];
    snprintf(smsg_copy, sizeof smsg_copy, "%s", smsg ? smsg : "");
    rpc_client_stream_destroy(st);
    if (bad_msg)
        bench_fail(rec, "BAD_MESSAGE", "the server sent a message that does not parse");
    else if (code != RPC_OK)
        bench_fail(rec, rpc_code_name(code), "%s", smsg_copy);
    else if (fin == MOE__V1__FINISH_REASON__FINISH_REASON_ERROR)
        bench_fail(rec, "finish:error", "%s", fin_error);
    else if (fin == MOE__V1__FINISH_REASON__FINISH_REASON_ABORT)
        bench_fail(rec, "finish:abort", "the server aborted the request");
    else if (!finished)
        bench_fail(rec, "NO_FINISH", "the stream ended without a finish reason");
    else if (rec->n_chunks == 0)
        bench_fail(rec, "NO_TOKENS", "the stream carried no token");
    else
        bench_finish_ok(rec);
}
