/* One benchmark target and the requests sent to it.
 *
 *   grpc    moe.v1.Inference/Generate (a server stream): prompts as token ids
 *           when known, the server's Usage and Timings from the last message
 *   openai  POST {base-url}{endpoint} (/v1/completions or /v1/chat/completions)
 *           with "stream": true and stream_options.include_usage, the SSE
 *           stream parsed as it arrives (libcurl, one easy handle per
 *           request thread, kept for connection reuse)
 *
 * A token event is a gRPC message with token ids, or an SSE chunk whose
 * choices[0].text (completions) / choices[0].delta.content (chat) is a
 * non-empty string: a chat stream's leading role-only chunk is not a token
 * (vLLM counts it as the first token; that makes TTFT look early).
 *
 * Ownership: a target is shared by the request threads of one rank and must
 * outlive every conn made from it; a conn belongs to one thread. */
#ifndef MOE_BENCH_CLIENT_H
#define MOE_BENCH_CLIENT_H

#include <stdbool.h>
#include <stddef.h>

#include "bench.h"
#include "clock.h"

enum bench_backend { BENCH_BACKEND_GRPC, BENCH_BACKEND_OPENAI };

struct bench_target_opts {
    enum bench_backend backend;
    const char *url;      /* grpc: host:port (grpc:// allowed); openai: http(s)://host:port */
    const char *endpoint; /* openai */
    const char *model;    /* model name to ask for; NULL: the server's (probe) */
    bool prompt_tokens;   /* openai completions: send the prompt as token ids */
    bool ignore_eos;
    bool has_temperature;
    float temperature;
    float top_p;
    int top_k;
    double timeout_s; /* per request */
    /* security: the bearer token sent with every request (grpc metadata,
     * openai Authorization header; NULL: openai takes $OPENAI_API_KEY), and
     * TLS (tls_opts.h, borrowed): grpc channels over TLS; openai https://
     * URLs verified against its CA, with its client certificate */
    const char *api_key;
    struct moe_tls *tls;
};

struct bench_target;
struct bench_conn;

/* Validates opts (scheme, endpoint) and prepares the target. */
enum moe_status bench_target_create(const struct bench_target_opts *opts, struct bench_target **out,
                                    struct moe_error *err);

void bench_target_destroy(struct bench_target *t);

/* Asks the target who it is (GetModelInfo / GET /v1/models) within
 * timeout_s. An unreachable target is MOE_ERR_IO naming it. On success the
 * served model name (may be empty) and vocabulary size (0 if unknown) are
 * filled, and the model name is used by later requests unless opts.model
 * was given. */
enum moe_status bench_target_probe(struct bench_target *t, double timeout_s, char *model,
                                   size_t model_cap, int *vocab, struct moe_error *err);

/* The URL as given, for messages. */
const char *bench_target_url(const struct bench_target *t);

struct bench_conn *bench_conn_create(struct bench_target *t);
void bench_conn_destroy(struct bench_conn *c);

/* Sends one request and waits for its end, filling rec's outcome fields
 * (success, status, error, lengths, ttft/e2el, chunks, server numbers);
 * rec->start_s is set from moe_now() - t_origin when the request leaves.
 * Never fails as a function: a failed request is a record with success 0. */
void bench_conn_run(struct bench_conn *c, const struct bench_item *item, const char *request_id,
                    double t_origin, struct bench_record *rec);

#endif
