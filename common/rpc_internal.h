/* Internals shared by rpc_server.c, rpc_client.c and rpc_health.c. */
#ifndef MOE_RPC_INTERNAL_H
#define MOE_RPC_INTERNAL_H

#include <grpc/grpc.h>
#include <grpc/support/time.h>

#include "rpc.h"

/* ---- the server's health state (rpc_health.c) ----
 * A server holds at most one health state (the table behind
 * grpc.health.v1.Health). rpc_health_register creates it and attaches it;
 * from then on the server owns it: rpc_server_destroy frees it with
 * rpc_health_free once every call has ended, so no Check or Watch handler
 * outlives it. rpc_health.c reaches it only through rpc_server_health. */
struct rpc_health;

/* Gives `health` to the server, which owns it from here on. The server must
 * have none yet (asserted): check rpc_server_health first. */
void rpc_server_attach_health(struct rpc_server *server, struct rpc_health *health);

/* The server's health state, or NULL without rpc_health_register (which runs
 * before rpc_server_start, so any thread may read it once serving). */
struct rpc_health *rpc_server_health(const struct rpc_server *server);

/* Frees a health state (rpc_server_destroy, after every call ended). NULL:
 * no-op. */
void rpc_health_free(struct rpc_health *health);

/* Marks the registered method `path` as answered while the server drains
 * (rpc_server_destroy) and not waited for: the health probes. */
void rpc_server_set_drain_exempt(struct rpc_server *server, const char *path);

/* Channel args shared by server and client: max message sizes and keepalive.
 * `args` must hold at least RPC_N_ARGS entries. */
#define RPC_N_ARGS 8
void rpc_channel_args_fill(grpc_arg *args, int *n, size_t max_message_bytes, int keepalive_time_ms,
                           int keepalive_timeout_ms, int server);

/* Adds "-" RPC_EE_POLLING to GRPC_EXPERIMENTS for gRPC core RPC_EE_POLLING_CORE
 * (1.51) unless the variable names that experiment already; run before main
 * by a constructor (see rpc_server.c), exposed for the tests. */
#define RPC_EE_POLLING "posix_event_engine_enable_polling"
#define RPC_EE_POLLING_CORE "29." /* grpc_version_string()'s prefix */
void rpc_experiments_default(void);

/* A monotonic gRPC deadline timeout_ms from now (<= 0: infinite). */
gpr_timespec rpc_deadline_from_ms(int64_t timeout_ms);

/* Milliseconds left until `deadline`; INT64_MAX if infinite. */
int64_t rpc_deadline_ms_left(gpr_timespec deadline);

#endif
