/* protobuf-c + common/rpc.h helpers shared by the integration tests.
 * Header-only: each test is one .c file. */
#ifndef MOE_TEST_RPCUTIL_H
#define MOE_TEST_RPCUTIL_H

#include <stdio.h>
#include <stdlib.h>

#include "moe/v1/worker.pb-c.h"
#include "rpc.h"

/* A packed copy of `msg` (a protobuf-c message), malloc'd. */
static inline void *pack(const void *msg, size_t *len)
{
    *len = protobuf_c_message_get_packed_size(msg);
    void *b = malloc(*len ? *len : 1);
    protobuf_c_message_pack(msg, b);
    return b;
}

/* Unary call with a 5 s deadline; returns the unpacked answer (NULL on
 * failure, *code set; the status message in msg when it is not NULL). */
static inline void *call(struct rpc_client *cl, const char *method, const void *req,
                         const ProtobufCMessageDescriptor *desc, enum rpc_code *code, char *msg,
                         size_t cap)
{
    size_t len;
    void *b = pack(req, &len);
    struct rpc_reply r;
    *code = rpc_client_call(cl, method, b, len, 5000, &r);
    free(b);
    if (msg)
        snprintf(msg, cap, "%s", r.message);
    void *out = NULL;
    if (r.code == RPC_OK)
        out = protobuf_c_message_unpack(desc, NULL, r.len, r.data);
    rpc_reply_clear(&r);
    return out;
}

/* Worker/GetLoad; NULL when the worker does not answer. */
static inline Moe__V1__WorkerLoad *get_load(struct rpc_client *cl)
{
    Moe__V1__GetLoadRequest rq = MOE__V1__GET_LOAD_REQUEST__INIT;
    enum rpc_code code;
    return call(cl, "/moe.v1.Worker/GetLoad", &rq, &moe__v1__worker_load__descriptor, &code, NULL,
                0);
}

#endif
