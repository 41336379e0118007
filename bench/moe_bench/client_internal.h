/* What client_grpc.c and client_openai.c share (not for other files). */
#ifndef MOE_BENCH_CLIENT_INTERNAL_H
#define MOE_BENCH_CLIENT_INTERNAL_H

#include <curl/curl.h>

#include "client.h"
#include "rpc.h"
#include "tls_opts.h"

struct bench_target {
    struct bench_target_opts o;
    char url[512];      /* as given */
    char addr[512];     /* grpc: host:port */
    char api_url[1024]; /* openai: base + endpoint */
    char models_url[1024];
    char model[256]; /* sent with each request; empty: none (grpc: the served one) */
    bool chat;
    struct rpc_client *rpc; /* grpc */
};

struct bench_conn {
    struct bench_target *t;
    CURL *curl; /* openai */
};

/* Starts a failed record: status and a printf-style error line. */
void bench_fail(struct bench_record *rec, const char *status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Success when tokens came: ttft / e2el from the chunks. */
void bench_finish_ok(struct bench_record *rec);

void bench_grpc_run(struct bench_conn *c, const struct bench_item *item, const char *request_id,
                    double t_origin, struct bench_record *rec);
enum moe_status bench_grpc_probe(struct bench_target *t, double timeout_s, char *model,
                                 size_t model_cap, int *vocab, struct moe_error *err);
void bench_openai_run(struct bench_conn *c, const struct bench_item *item, const char *request_id,
                      double t_origin, struct bench_record *rec);
enum moe_status bench_openai_probe(struct bench_target *t, double timeout_s, char *model,
                                   size_t model_cap, int *vocab, struct moe_error *err);

#endif
