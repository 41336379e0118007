/* gRPC client helpers: a channel, blocking unary calls and server-streaming
 * reads. Each call owns a NEXT completion queue polled only by the thread
 * that waits on it, so calls on one channel never contend. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>

#include "rpc_internal.h"
#include "tls_opts.h"

struct rpc_client {
    grpc_channel *channel;
    grpc_metadata auth; /* "authorization: Bearer <token>" */
    size_t n_md;        /* 1 with a token, else 0 */
};

struct rpc_client *rpc_client_create(const char *target, const struct rpc_client_options *opts,
                                     struct moe_error *err)
{
    struct rpc_client_options defaults = {0};
    if (!opts) {
        opts = &defaults;
    }
    if (!target || !target[0]) {
        moe_error_set(err, MOE_ERR_INVALID, "rpc_client_create: empty target");
        return NULL;
    }
    struct rpc_client *c = calloc(1, sizeof(*c));
    if (!c) {
        moe_error_set(err, MOE_ERR_NOMEM, "rpc_client_create: out of memory");
        return NULL;
    }
    if (opts->token) {
        size_t tl = strlen(opts->token);
        char *v = malloc(tl + 8);
        if (!v) {
            moe_error_set(err, MOE_ERR_NOMEM, "rpc_client_create: out of memory");
            free(c);
            return NULL;
        }
        memcpy(v, "Bearer ", 7);
        memcpy(v + 7, opts->token, tl + 1);
        c->auth.key = grpc_slice_from_static_string("authorization");
        c->auth.value = grpc_slice_from_copied_string(v);
        free(v);
        c->n_md = 1;
    }
    grpc_init();
    grpc_arg args[RPC_N_ARGS + 1];
    int n_args = 0;
    rpc_channel_args_fill(args, &n_args, opts->max_message_bytes, opts->keepalive_time_ms,
                          opts->keepalive_timeout_ms, 0);
    grpc_channel_credentials *creds;
    if (opts->tls) {
        const struct moe_tls_material *m = moe_tls_current(opts->tls);
        grpc_ssl_pem_key_cert_pair pair = {m->key_pem, m->cert_pem};
        creds = grpc_ssl_credentials_create_ex(m->ca_pem, m->cert_pem ? &pair : NULL, NULL, NULL);
        const char *name = moe_tls_server_name(opts->tls);
        if (name) {
            args[n_args].type = GRPC_ARG_STRING;
            args[n_args].key = (char *)GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
            args[n_args++].value.string = (char *)name;
        }
    } else {
        creds = grpc_insecure_credentials_create();
    }
    grpc_channel_args chargs = {(size_t)n_args, args};
    c->channel = creds ? grpc_channel_create(target, creds, &chargs) : NULL;
    if (creds)
        grpc_channel_credentials_release(creds);
    if (!c->channel) {
        moe_error_set(err, MOE_ERR_INVALID, "rpc_client_create: bad target '%s'%s", target,
                      creds ? "" : " (TLS credentials refused)");
        if (c->n_md)
            grpc_slice_unref(c->auth.value);
        free(c);
        grpc_shutdown();
        return NULL;
    }
    return c;
}

void rpc_client_destroy(struct rpc_client *client)
{
    if (!client) {
        return;
    }
    grpc_channel_destroy(client->channel);
    if (client->n_md)
        grpc_slice_unref(client->auth.value);
    free(client);
    grpc_shutdown();
}

/* Flattens a byte buffer into a malloc'ed copy (NULL + 0 for an empty one;
 * *ok = 0 on allocation failure). */
static uint8_t *bb_to_bytes(grpc_byte_buffer *bb, size_t *len, bool *ok)
{
    grpc_byte_buffer_reader reader;
    *len = 0;
    *ok = true;
    if (!grpc_byte_buffer_reader_init(&reader, bb)) {
        *ok = false;
        return NULL;
    }
    grpc_slice s = grpc_byte_buffer_reader_readall(&reader);
    grpc_byte_buffer_reader_destroy(&reader);
    size_t n = GRPC_SLICE_LENGTH(s);
    uint8_t *out = malloc(n ? n : 1);
    if (!out) {
        *ok = false;
    } else {
        memcpy(out, GRPC_SLICE_START_PTR(s), n);
        *len = n;
    }
    grpc_slice_unref(s);
    return out;
}

static void slice_to_str(grpc_slice s, char *buf, size_t cap)
{
    size_t n = GRPC_SLICE_LENGTH(s);
    if (n >= cap) {
        n = cap - 1;
    }
    memcpy(buf, GRPC_SLICE_START_PTR(s), n);
    buf[n] = '\0';
}

static void cq_drain_destroy(grpc_completion_queue *cq)
{
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
}

static void reply_set(struct rpc_reply *reply, enum rpc_code code, const char *msg)
{
    reply->code = code;
    snprintf(reply->message, sizeof(reply->message), "%s", msg);
}

enum rpc_code rpc_client_call(struct rpc_client *client, const char *method, const void *req,
                              size_t len, int64_t timeout_ms, struct rpc_reply *reply)
{
    memset(reply, 0, sizeof(*reply));
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    grpc_slice method_slice = grpc_slice_from_copied_string(method);
    grpc_call *call =
        grpc_channel_create_call(client->channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq, method_slice,
                                 NULL, rpc_deadline_from_ms(timeout_ms), NULL);
    grpc_slice_unref(method_slice);
    if (!call) {
        cq_drain_destroy(cq);
        reply_set(reply, RPC_INTERNAL, "grpc_channel_create_call failed");
        return reply->code;
    }
    grpc_slice req_slice = grpc_slice_from_copied_buffer(len ? req : "", len);
    grpc_byte_buffer *req_bb = grpc_raw_byte_buffer_create(&req_slice, 1);
    grpc_slice_unref(req_slice);
    grpc_metadata_array md_in, trailing;
    grpc_metadata_array_init(&md_in);
    grpc_metadata_array_init(&trailing);
    grpc_byte_buffer *resp_bb = NULL;
    grpc_status_code status = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();

    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = client->n_md;
    ops[0].data.send_initial_metadata.metadata = client->n_md ? &client->auth : NULL;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = req_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &md_in;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &resp_bb;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trailing;
    ops[5].data.recv_status_on_client.status = &status;
    ops[5].data.recv_status_on_client.status_details = &details;
    int tag = 0;
    if (grpc_call_start_batch(call, ops, 6, &tag, NULL) != GRPC_CALL_OK) {
        reply_set(reply, RPC_INTERNAL, "grpc_call_start_batch failed");
    } else {
        grpc_event ev;
        do {
            ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        } while (ev.type != GRPC_OP_COMPLETE || ev.tag != &tag);
        reply->code = (enum rpc_code)status;
        slice_to_str(details, reply->message, sizeof(reply->message));
        if (status == GRPC_STATUS_OK) {
            bool ok = true;
            if (resp_bb) {
                reply->data = bb_to_bytes(resp_bb, &reply->len, &ok);
            } else {
                ok = false;
            }
            if (!ok) {
                free(reply->data);
                reply->data = NULL;
                reply->len = 0;
                reply_set(reply, RPC_INTERNAL, resp_bb ? "out of memory" : "OK without a message");
            }
        }
    }
    if (resp_bb) {
        grpc_byte_buffer_destroy(resp_bb);
    }
    grpc_byte_buffer_destroy(req_bb);
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&md_in);
    grpc_metadata_array_destroy(&trailing);
    grpc_call_unref(call);
    cq_drain_destroy(cq);
    return reply->code;
}

void rpc_reply_clear(struct rpc_reply *reply)
{
    if (reply) {
        free(reply->data);
        reply->data = NULL;
        reply->len = 0;
    }
}

/* ---- streaming read --------------------------------------------------------------------- */

struct rpc_client_stream {
    grpc_completion_queue *cq;
    grpc_call *call;
    grpc_byte_buffer *req_bb;
    grpc_metadata_array md_in, trailing;
    grpc_status_code status;
    grpc_slice details;
    char message[256];
    grpc_byte_buffer *recv_bb;
    int start_tag, status_tag, recv_tag; /* addresses are the tags */
    bool start_pending, status_pending, recv_pending;
    bool ended;
    uint8_t *data; /* the last message returned */
};

/* Polls the stream's queue until `want` completed; returns its success. */
static int stream_wait(struct rpc_client_stream *s, void *want)
{
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type != GRPC_OP_COMPLETE) {
            continue;
        }
        if (ev.tag == &s->start_tag) {
            s->start_pending = false;
        } else if (ev.tag == &s->status_tag) {
            s->status_pending = false;
        } else if (ev.tag == &s->recv_tag) {
            s->recv_pending = false;
        }
        if (ev.tag == want) {
            return ev.success;
        }
    }
}

struct rpc_client_stream *rpc_client_stream_start(struct rpc_client *client, const char *method,
                                                  const void *req, size_t len, int64_t timeout_ms,
                                                  struct moe_error *err)
{
    struct rpc_client_stream *s = calloc(1, sizeof(*s));
    if (!s) {
        moe_error_set(err, MOE_ERR_NOMEM, "rpc_client_stream_start: out of memory");
        return NULL;
    }
    s->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_metadata_array_init(&s->md_in);
    grpc_metadata_array_init(&s->trailing);
    s->details = grpc_empty_slice();
    s->status = GRPC_STATUS_UNKNOWN;
    grpc_slice method_slice = grpc_slice_from_copied_string(method);
    s->call = grpc_channel_create_call(client->channel, NULL, GRPC_PROPAGATE_DEFAULTS, s->cq,
                                       method_slice, NULL, rpc_deadline_from_ms(timeout_ms), NULL);
    grpc_slice_unref(method_slice);
    if (!s->call) {
        moe_error_set(err, MOE_ERR_INTERNAL, "rpc_client_stream_start: cannot create call '%s'",
                      method);
        goto fail;
    }
    grpc_slice req_slice = grpc_slice_from_copied_buffer(len ? req : "", len);
    s->req_bb = grpc_raw_byte_buffer_create(&req_slice, 1);
    grpc_slice_unref(req_slice);

    grpc_op ops[4];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = client->n_md;
    ops[0].data.send_initial_metadata.metadata = client->n_md ? &client->auth : NULL;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = s->req_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &s->md_in;
    if (grpc_call_start_batch(s->call, ops, 4, &s->start_tag, NULL) != GRPC_CALL_OK) {
        moe_error_set(err, MOE_ERR_INTERNAL, "rpc_client_stream_start: start batch failed");
        goto fail;
    }
    s->start_pending = true;
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &s->trailing;
    ops[0].data.recv_status_on_client.status = &s->status;
    ops[0].data.recv_status_on_client.status_details = &s->details;
    if (grpc_call_start_batch(s->call, ops, 1, &s->status_tag, NULL) != GRPC_CALL_OK) {
        moe_error_set(err, MOE_ERR_INTERNAL, "rpc_client_stream_start: status batch failed");
        goto fail;
    }
    s->status_pending = true;
    return s;
fail:
    rpc_client_stream_destroy(s);
    return NULL;
}

/* The stream ended: wait for the status. */
static void stream_end(struct rpc_client_stream *s)
{
    if (s->ended) {
        return;
    }
    if (s->status_pending) {
        stream_wait(s, &s->status_tag);
    }
    s->ended = true;
    slice_to_str(s->details, s->message, sizeof(s->message));
}

int rpc_client_stream_next(struct rpc_client_stream *s, const uint8_t **data, size_t *len)
{
    free(s->data);
    s->data = NULL;
    *data = NULL;
    *len = 0;
    if (s->ended) {
        return 0;
    }
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &s->recv_bb;
    if (grpc_call_start_batch(s->call, &op, 1, &s->recv_tag, NULL) != GRPC_CALL_OK) {
        grpc_call_cancel(s->call, NULL);
        stream_end(s);
        return 0;
    }
    s->recv_pending = true;
    stream_wait(s, &s->recv_tag);
    if (!s->recv_bb) {
        stream_end(s);
        return 0;
    }
    bool ok = true;
    s->data = bb_to_bytes(s->recv_bb, len, &ok);
    grpc_byte_buffer_destroy(s->recv_bb);
    s->recv_bb = NULL;
    if (!ok) {
        grpc_call_cancel_with_status(s->call, GRPC_STATUS_RESOURCE_EXHAUSTED,
                                     "client out of memory", NULL);
        stream_end(s);
        return 0;
    }
    *data = s->data;
    return 1;
}

enum rpc_code rpc_client_stream_status(const struct rpc_client_stream *s, const char **message)
{
    if (message) {
        *message = s->ended ? s->message : "stream not ended";
    }
    return s->ended ? (enum rpc_code)s->status : RPC_UNKNOWN;
}

void rpc_client_stream_cancel(struct rpc_client_stream *s)
{
    if (s && s->call) {
        grpc_call_cancel(s->call, NULL);
    }
}

void rpc_client_stream_destroy(struct rpc_client_stream *s)
{
    if (!s) {
        return;
    }
    if (s->call) {
        if (!s->ended) {
            grpc_call_cancel(s->call, NULL);
        }
        while (s->start_pending) {
            stream_wait(s, &s->start_tag);
        }
        while (s->status_pending) {
            stream_wait(s, &s->status_tag);
        }
        while (s->recv_pending) {
            stream_wait(s, &s->recv_tag);
        }
        grpc_call_unref(s->call);
    }
    if (s->recv_bb) {
        grpc_byte_buffer_destroy(s->recv_bb);
    }
    if (s->req_bb) {
        grpc_byte_buffer_destroy(s->req_bb);
    }
    grpc_slice_unref(s->details);
    grpc_metadata_array_destroy(&s->md_in);
    grpc_metadata_array_destroy(&s->trailing);
    cq_drain_destroy(s->cq);
    free(s->data);
    free(s);
}
