/* Internals shared by rpc_server.c, rpc_client.c and rpc_health.c. */
#ifndef MOE_RPC_INTERNAL_H
#define MOE_RPC_INTERNAL_H

#include <grpc/grpc.h>
#include <grpc/support/time.h>

#include "rpc.h"

struct rpc_health;

/* Frees the health state of a server (after every call ended). NULL: no-op. */
void rpc_health_free(struct rpc_health *health);

/* The server's health state slot (NULL until rpc_health_register). */
struct rpc_health **rpc_server_health_slot(struct rpc_server *server);

/* Marks the registered method `path` as answered while the server drains
 * (rpc_server_destroy) and not waited for: the health probes. */
void rpc_server_set_drain_exempt(struct rpc_server *server, const char *path);

/* Channel args shared by server and client: max message sizes and keepalive.
 * `args` must hold at least RPC_N_ARGS entries. */
#define RPC_N_ARGS 8
void rpc_channel_args_fill(grpc_arg *args, int *n, size_t max_message_bytes, int keepalive_time_ms,
                           int keepalive_timeout_ms, int server);

/* A monotonic gRPC deadline timeout_ms from now (<= 0: infinite). */
gpr_timespec rpc_deadline_from_ms(int64_t timeout_ms);

/* Milliseconds left until `deadline`; INT64_MAX if infinite. */
int64_t rpc_deadline_ms_left(gpr_timespec deadline);

#endif
