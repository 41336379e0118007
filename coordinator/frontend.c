/* The public moe.v1.Inference service (Generate is in forward.c) and the
 * standard health service. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "model_info.h"
#include "moe/v1/inference.pb-c.h"
#include "request_check.h"

static void handle_generate(struct rpc_stream *stream, const uint8_t *req, size_t len, void *user)
{
    coord_generate_start(user, stream, req, len);
}

static void handle_abort(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    Moe__V1__AbortRequest *rq =
        rpc_call_unpack(call, &moe__v1__abort_request__descriptor, req, len);
    if (!rq)
        return;
    Moe__V1__AbortResponse resp = MOE__V1__ABORT_RESPONSE__INIT;
    if (strlen(rq->request_id) > MOE_REQ_MAX_ID_LEN) {
        moe__v1__abort_request__free_unpacked(rq, NULL);
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "request_id: longer than 128 bytes", NULL, 0);
        return;
    }
    resp.found = coord_abort(user, rq->request_id);
    moe__v1__abort_request__free_unpacked(rq, NULL);
    rpc_call_finish_msg(call, &resp);
}

static void handle_model_info(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    struct coord *c = user;
    Moe__V1__ModelInfo info = MOE__V1__MODEL_INFO__INIT;
    uint32_t eos[MOE_MAX_EOS];
    char dtype[sizeof c->model_dtype];
    pthread_mutex_lock(&c->mu);
    snprintf(dtype, sizeof dtype, "%s", c->model_dtype);
    pthread_mutex_unlock(&c->mu);
    moe_model_info_fill(&info, &c->cfg, c->model_name, dtype, eos);
    rpc_call_finish_msg(call, &info);
}

static void handle_tokenize(struct rpc_call *call, const uint8_t *req, size_t len, void *user)
{
    struct coord *c = user;
    char msg[1024];
    Moe__V1__TokenizeRequest *rq =
        rpc_call_unpack(call, &moe__v1__tokenize_request__descriptor, req, len);
    if (!rq)
        return;
    enum rpc_code code = RPC_OK;
    int32_t *ids = NULL;
    uint32_t *out = NULL;
    size_t n = 0;
    struct moe_error err = {0};
    size_t text_len = strlen(rq->text);
    if (rq->model[0] && strcmp(rq->model, c->model_name)) {
        code = RPC_NOT_FOUND;
        snprintf(msg, sizeof msg, "model: '%.200s' is not served here (this cluster serves '%s')",
                 rq->model, c->model_name);
    } else if (!c->tok) {
        code = RPC_FAILED_PRECONDITION;
        snprintf(msg, sizeof msg, "text: the coordinator has no tokenizer.json");
    } else if (text_len > MOE_REQ_MAX_PROMPT_BYTES) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg, "text: %zu bytes, at most %u allowed", text_len,
                 MOE_REQ_MAX_PROMPT_BYTES);
    } else if (moe_tokenizer_encode(c->tok, rq->text, text_len, rq->add_special_tokens, &ids, &n,
                                    &err)) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg, "text: %.900s", err.msg);
    } else if (!(out = malloc((n ? n : 1) * sizeof *out))) {
        code = RPC_RESOURCE_EXHAUSTED;
        snprintf(msg, sizeof msg, "out of memory");
    }
    moe__v1__tokenize_request__free_unpacked(rq, NULL);
    if (code) {
        free(ids);
        rpc_call_finish(call, code, msg, NULL, 0);
        return;
    }
    for (size_t i = 0; i < n; i++)
        out[i] = (uint32_t)ids[i];
    Moe__V1__TokenizeResponse resp = MOE__V1__TOKENIZE_RESPONSE__INIT;
    resp.n_token_ids = n;
    resp.token_ids = out;
    rpc_call_finish_msg(call, &resp);
    free(ids);
    free(out);
}

enum moe_status coord_frontend_register(struct coord *c, struct moe_error *err)
{
    enum moe_status rc;
    if ((rc = rpc_server_add_stream(c->server, "/moe.v1.Inference/Generate", handle_generate, c,
                                    err)) ||
        (rc = rpc_server_add_unary(c->server, "/moe.v1.Inference/Abort", handle_abort, c, err)) ||
        (rc = rpc_server_add_unary(c->server, "/moe.v1.Inference/GetModelInfo", handle_model_info,
                                   c, err)) ||
        (rc = rpc_server_add_unary(c->server, "/moe.v1.Inference/Tokenize", handle_tokenize, c,
                                   err)) ||
        (rc = rpc_health_register(c->server, err)))
        return rc;
    return MOE_OK;
}
