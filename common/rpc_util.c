/* Small helpers shared by every user of the rpc layer: status code names
 * and mappings, packing and unpacking protobuf-c messages. */
#include <protobuf-c/protobuf-c.h>
#include <stdio.h>
#include <stdlib.h>

#include "request_check.h"
#include "rpc.h"

const char *rpc_code_name(enum rpc_code code)
{
    static const char *const names[] = {
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    };
    if ((int)code < 0 || (size_t)code >= sizeof(names) / sizeof(names[0])) {
        return "?";
    }
    return names[code];
}

enum rpc_code rpc_code_from_status(enum moe_status st)
{
    switch (st) {
    case MOE_OK: return RPC_OK;
    case MOE_ERR_INVALID:
    case MOE_ERR_FORMAT: return RPC_INVALID_ARGUMENT;
    case MOE_ERR_NOT_FOUND: return RPC_NOT_FOUND;
    case MOE_ERR_IO: return RPC_UNAVAILABLE;
    case MOE_ERR_NOMEM: return RPC_RESOURCE_EXHAUSTED;
    case MOE_ERR_AGAIN: return RPC_FAILED_PRECONDITION;
    case MOE_ERR_UNSUPPORTED: return RPC_UNIMPLEMENTED;
    case MOE_ERR_INTERNAL: return RPC_INTERNAL;
    }
    return RPC_INTERNAL;
}

void *rpc_pack(const void *msg, size_t *len)
{
    const ProtobufCMessage *m = msg;
    *len = protobuf_c_message_get_packed_size(m);
    uint8_t *buf = malloc(*len ? *len : 1);
    if (buf)
        protobuf_c_message_pack(m, buf);
    return buf;
}

void rpc_call_finish_msg(struct rpc_call *call, const void *msg)
{
    size_t len;
    void *out = rpc_pack(msg, &len);
    rpc_call_finish(call, out ? RPC_OK : RPC_RESOURCE_EXHAUSTED, out ? NULL : "out of memory", out,
                    len);
    free(out);
}

void *rpc_call_unpack(struct rpc_call *call, const struct ProtobufCMessageDescriptor *desc,
                      const uint8_t *bytes, size_t len)
{
    char msg[256];
    ProtobufCMessage *m = protobuf_c_message_unpack(desc, NULL, len, bytes);
    if (!m) {
        snprintf(msg, sizeof msg, "request: not a valid %s", desc->name);
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, msg, NULL, 0);
        return NULL;
    }
    if (moe_check_strings(m, msg, sizeof msg)) {
        protobuf_c_message_free_unpacked(m, NULL);
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, msg, NULL, 0);
        return NULL;
    }
    return m;
}
