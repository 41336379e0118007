/* moectl: the operator CLI of a moe-coordinator, over its Admin service.
 *
 *   moectl [--addr HOST:PORT] [--json] [--timeout-ms MS] COMMAND ...
 *     status                         the cluster: model, workers, requests, epoch
 *     workers list                   every worker and its load
 *     workers drain ID | undrain ID  stop / resume routing new requests to it
 *     experts stats [--layer L] [--window S]
 *                                    token load per expert (heat map / table)
 *     experts show                   the current placement and its epoch
 *     experts plan [--redundant N] [--tolerance T] [--dry-run] [-o PLAN.json]
 *                                    a new placement: diff and predicted balance
 *     experts apply PLAN.json | --auto [--redundant N]
 *                                    install a plan (as the next epoch)
 *     experts rollback               reinstall the previous placement
 *     experts scale --redundant N [--dry-run]
 *                                    plan and apply with N redundant replicas
 *
 * --json prints one JSON object per command instead of text. Exit codes:
 * 0 success, 1 the call failed (coordinator unreachable, plan refused),
 * 2 bad command line or plan file. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "auth_token.h"
#include "cli.h"
#include "moe/v1/admin.pb-c.h"
#include "moe/v1/health.pb-c.h"
#include "rpc.h"
#include "tls_opts.h"
#include "read_file.h"

#define MAX_POS 8

struct args {
    const char *addr;
    bool json;
    long timeout_ms;
    const char *pos[MAX_POS];
    int n_pos;
    long layer; /* -1: all */
    long window_s;
    long redundant;   /* -1: unset */
    double tolerance; /* < 0: unset */
    bool dry_run;
    bool auto_plan;
    bool all;
    const char *out;
    const char *token_file;
    struct moe_tls_opts tls;
};

static struct args g;
static struct rpc_client *g_client;

__attribute__((format(printf, 1, 2))) static int usage_err(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "moectl: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (moectl --help for usage)\n");
    va_end(ap);
    return 2;
}

__attribute__((format(printf, 1, 2))) static int fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "moectl: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 1;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: moectl [--addr HOST:PORT] [--json] [--timeout-ms MS] COMMAND ...\n"
               "  status                           model, workers, requests, placement epoch\n"
               "  workers list                     every worker and its load\n"
               "  workers drain ID | undrain ID    stop / resume routing new requests to ID\n"
               "  experts stats [--layer L] [--window S]\n"
               "                                   token load per expert over the window\n"
               "  experts show                     the current placement and its epoch\n"
               "  experts plan [--redundant N] [--tolerance T] [--dry-run] [-o PLAN.json] [--all]\n"
               "                                   plan a placement (changes nothing): diff and\n"
               "                                   predicted balance\n"
               "  experts apply PLAN.json | --auto [--redundant N]\n"
               "                                   install a plan as the next epoch\n"
               "  experts rollback                 reinstall the previous placement\n"
               "  health [SERVICE]                 grpc.health.v1 Check of any moe-serve port\n"
               "                                   (no token; exit 0 only when SERVING): a\n"
               "                                   probe that speaks TLS\n"
               "  experts scale --redundant N [--dry-run]\n"
               "                                   plan and apply with N redundant replicas\n"
               "  --addr HOST:PORT  the coordinator (default 127.0.0.1:50051)\n"
               "  --json            machine-readable output\n"
               "  --token-file F    admin token (first line of F) sent as a bearer token\n"
               "TLS (--tls-ca alone: verify the coordinator; with --tls-cert/--tls-key: mutual "
               "TLS):\n" MOE_TLS_USAGE
               "exit codes: 0 ok, 1 the call failed, 2 bad command line or plan file\n");
}

static int parse_args(int argc, char **argv)
{
    g = (struct args){.addr = "127.0.0.1:50051",
                      .timeout_ms = 10000,
                      .layer = -1,
                      .redundant = -1,
                      .tolerance = -1};
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(k, "-h") || !strcmp(k, "--help")) {
            usage(stdout);
            exit(0);
        } else if (!strcmp(k, "--json")) {
            g.json = true;
        } else if (!strcmp(k, "--dry-run")) {
            g.dry_run = true;
        } else if (!strcmp(k, "--auto")) {
            g.auto_plan = true;
        } else if (!strcmp(k, "--all")) {
            g.all = true;
        } else if (k[0] == '-' && k[1]) {
            if (!v)
                return usage_err("option '%s' needs a value", k);
            i++;
            if (moe_tls_cli_flag(&g.tls, k, v)) {
                continue;
            } else if (!strcmp(k, "--token-file")) {
                g.token_file = v;
            } else if (!strcmp(k, "--addr")) {
                g.addr = v;
            } else if (!strcmp(k, "-o") || !strcmp(k, "--output")) {
                g.out = v;
            } else if (!strcmp(k, "--timeout-ms")) {
                if (!cli_parse_long(v, 1, 3600000, &g.timeout_ms))
                    return usage_err("--timeout-ms: '%s' is not a whole number in [1, 3600000]", v);
            } else if (!strcmp(k, "--layer")) {
                if (!cli_parse_long(v, 0, 65535, &g.layer))
                    return usage_err("--layer: '%s' is not a layer number", v);
            } else if (!strcmp(k, "--window")) {
                if (!cli_parse_long(v, 1, 3600, &g.window_s))
                    return usage_err("--window: '%s' is not a number of seconds in [1, 3600]", v);
            } else if (!strcmp(k, "--redundant")) {
                if (!cli_parse_long(v, 0, 1 << 20, &g.redundant))
                    return usage_err("--redundant: '%s' is not a whole number >= 0", v);
            } else if (!strcmp(k, "--tolerance")) {
                char *end;
                g.tolerance = strtod(v, &end);
                if (*end || end == v || !(g.tolerance >= 0 && g.tolerance <= 10))
                    return usage_err("--tolerance: '%s' is not a number in [0, 10]", v);
            } else {
                return usage_err("unknown option '%s'", k);
            }
        } else {
            if (g.n_pos >= MAX_POS)
                return usage_err("too many arguments");
            g.pos[g.n_pos++] = k;
        }
    }
    return 0;
}

/* ---- calls --------------------------------------------------------------------------- */

/* One Admin call; on failure prints the error and returns false. *reply is
 * filled (the caller clears it). */
static bool admin_call(const char *what, const char *method, const void *req, size_t len,
                       struct rpc_reply *reply)
{
    char path[128];
    snprintf(path, sizeof path, "/moe.v1.Admin/%s", method);
    enum rpc_code code = rpc_client_call(g_client, path, req, len, g.timeout_ms, reply);
    if (code == RPC_OK)
        return true;
    /* UNAVAILABLE from the coordinator itself (its etcd is down) names etcd */
    if ((code == RPC_UNAVAILABLE && strncmp(reply->message, "etcd", 4)) ||
        (code == RPC_DEADLINE_EXCEEDED && !reply->message[0]))
        fail("cannot reach the coordinator at %s: %s: %s", g.addr, rpc_code_name(code),
             reply->message[0] ? reply->message : "no answer");
    else if (code == RPC_UNIMPLEMENTED)
        fail("%s: the coordinator at %s does not serve %s (an older version?)", what, g.addr, path);
    else
        fail("%s: %s: %s", what, rpc_code_name(code), reply->message);
    return false;
}

/* health [SERVICE]: one grpc.health.v1 Check (needs no token). */
static int cmd_health(void)
{
    if (g.n_pos > 2)
        return usage_err("health takes at most one SERVICE");
    Grpc__Health__V1__HealthCheckRequest rq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    rq.service = (char *)(g.n_pos == 2 ? g.pos[1] : "");
    size_t len = 0;
    void *buf = rpc_pack(&rq, &len);
    if (!buf)
        return fail("out of memory");
    struct rpc_reply reply;
    enum rpc_code code =
        rpc_client_call(g_client, "/grpc.health.v1.Health/Check", buf, len, g.timeout_ms, &reply);
    free(buf);
    if (code != RPC_OK) {
        fail("health of '%s' at %s: %s: %s", rq.service, g.addr, rpc_code_name(code),
             reply.message);
        return 1;
    }
    Grpc__Health__V1__HealthCheckResponse *r =
        grpc__health__v1__health_check_response__unpack(NULL, reply.len, reply.data);
    rpc_reply_clear(&reply);
    if (!r)
        return fail("health: a malformed answer from %s", g.addr);
    int st = (int)r->status;
    grpc__health__v1__health_check_response__free_unpacked(r, NULL);
    const char *names[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
    const char *name = st >= 0 && st <= 3 ? names[st] : "?";
    if (g.json)
        printf("{\"service\": \"%s\", \"status\": \"%s\"}\n", rq.service, name);
    else
        printf("%s\n", name);
    return st == 1 ? 0 : 1;
}

static void print_json(cJSON *o)
{
    char *s = cJSON_Print(o);
    if (s)
        printf("%s\n", s);
    free(s);
    cJSON_Delete(o);
}

/* ---- status and workers ------------------------------------------------------------------ */

static const char *role_name(int r)
{
    switch (r) {
    case MOE__V1__WORKER_ROLE__WORKER_ROLE_PREFILL: return "prefill";
    case MOE__V1__WORKER_ROLE__WORKER_ROLE_DECODE: return "decode";
    case MOE__V1__WORKER_ROLE__WORKER_ROLE_MIXED: return "mixed";
    default: return "-";
    }
}

static const char *state_name(int s)
{
    switch (s) {
    case MOE__V1__WORKER_STATE__WORKER_STATE_SERVING: return "serving";
    case MOE__V1__WORKER_STATE__WORKER_STATE_DRAINING: return "draining";
    case MOE__V1__WORKER_STATE__WORKER_STATE_DOWN: return "down";
    default: return "unknown";
    }
}

static cJSON *worker_json(const Moe__V1__WorkerStatus *w)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", w->id);
    cJSON_AddStringToObject(o, "address", w->address);
    cJSON_AddStringToObject(o, "role", role_name(w->role));
    cJSON_AddStringToObject(o, "state", state_name(w->state));
    cJSON_AddNumberToObject(o, "running", w->running);
    cJSON_AddNumberToObject(o, "waiting", w->waiting);
    cJSON_AddNumberToObject(o, "kv_blocks_used", w->kv_blocks_used);
    cJSON_AddNumberToObject(o, "kv_blocks_total", w->kv_blocks_total);
    cJSON_AddNumberToObject(o, "prefix_hit_rate", w->prefix_hit_rate);
    cJSON_AddNumberToObject(o, "world_size", w->world_size);
    cJSON_AddNumberToObject(o, "tp_size", w->tp_size);
    cJSON_AddNumberToObject(o, "ep_size", w->ep_size);
    if (w->dp_size > 1) {
        cJSON_AddNumberToObject(o, "dp_size", w->dp_size);
        cJSON *used = cJSON_AddArrayToObject(o, "dp_kv_blocks_used");
        cJSON *run = cJSON_AddArrayToObject(o, "dp_running");
        for (size_t r = 0; r < w->n_dp_kv_blocks_used && r < w->n_dp_running; r++) {
            cJSON_AddItemToArray(used, cJSON_CreateNumber(w->dp_kv_blocks_used[r]));
            cJSON_AddItemToArray(run, cJSON_CreateNumber(w->dp_running[r]));
        }
    }
    cJSON_AddNumberToObject(o, "kv_transfers_out", (double)w->kv_transfers_out);
    cJSON_AddNumberToObject(o, "kv_transfers_in", (double)w->kv_transfers_in);
    cJSON_AddNumberToObject(o, "kv_transfer_bytes", (double)w->kv_transfer_bytes);
    cJSON_AddNumberToObject(o, "kv_transfer_failures", w->kv_transfer_failures);
    cJSON_AddNumberToObject(o, "spec_draft_tokens", (double)w->spec_draft_tokens);
    cJSON_AddNumberToObject(o, "spec_accepted_tokens", (double)w->spec_accepted_tokens);
    if (w->last_seen_ms_ago != UINT64_MAX)
        cJSON_AddNumberToObject(o, "last_seen_ms_ago", (double)w->last_seen_ms_ago);
    else
        cJSON_AddNullToObject(o, "last_seen_ms_ago");
    return o;
}

static void print_workers(Moe__V1__WorkerStatus **ws, size_t n)
{
    printf("%-24s %-22s %-8s %-9s %5s %5s %11s %5s %6s\n", "ID", "ADDRESS", "ROLE", "STATE", "RUN",
           "WAIT", "KV BLOCKS", "RANKS", "SEEN");
    for (size_t i = 0; i < n; i++) {
        const Moe__V1__WorkerStatus *w = ws[i];
        char kv[32], seen[32];
        snprintf(kv, sizeof kv, "%u/%u", w->kv_blocks_used, w->kv_blocks_total);
        if (w->last_seen_ms_ago == UINT64_MAX)
            snprintf(seen, sizeof seen, "never");
        else
            snprintf(seen, sizeof seen, "%.1fs", (double)w->last_seen_ms_ago / 1e3);
        printf("%-24s %-22s %-8s %-9s %5u %5u %11s %5u %6s\n", w->id, w->address,
               role_name(w->role), state_name(w->state), w->running, w->waiting, kv, w->world_size,
               seen);
        if (w->dp_size > 1 && w->n_dp_kv_blocks_used == w->dp_size &&
            w->n_dp_running == w->dp_size) {
            printf("  dp attention over %u groups, each %u KV blocks; used:", w->dp_size,
                   w->kv_blocks_total / w->dp_size);
            for (uint32_t r = 0; r < w->dp_size; r++)
                printf(" %u", w->dp_kv_blocks_used[r]);
            printf("; running:");
            for (uint32_t r = 0; r < w->dp_size; r++)
                printf(" %u", w->dp_running[r]);
            printf("\n");
        }
    }
}

static int cmd_status(void)
{
    Moe__V1__ClusterStatusRequest rq = MOE__V1__CLUSTER_STATUS_REQUEST__INIT;
    size_t len;
    void *buf = rpc_pack(&rq.base, &len);
    struct rpc_reply reply;
    bool ok = admin_call("status", "ClusterStatus", buf, len, &reply);
    free(buf);
    if (!ok) {
        rpc_reply_clear(&reply);
        return 1;
    }
    Moe__V1__ClusterStatusResponse *r =
        moe__v1__cluster_status_response__unpack(NULL, reply.len, reply.data);
    rpc_reply_clear(&reply);
    if (!r)
        return fail("status: the coordinator's answer is not a ClusterStatusResponse");
    if (g.json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "model", r->model);
        cJSON_AddNumberToObject(o, "uptime_s", r->uptime_s);
        cJSON_AddNumberToObject(o, "requests_running", r->requests_running);
        cJSON_AddNumberToObject(o, "requests_total", (double)r->requests_total);
        cJSON_AddNumberToObject(o, "requests_failed", (double)r->requests_failed);
        cJSON_AddNumberToObject(o, "placement_epoch", (double)r->placement_epoch);
        cJSON *a = cJSON_AddArrayToObject(o, "workers");
        for (size_t i = 0; i < r->n_workers; i++)
            cJSON_AddItemToArray(a, worker_json(r->workers[i]));
        print_json(o);
    } else {
        size_t serving = 0;
        for (size_t i = 0; i < r->n_workers; i++)
            serving += r->workers[i]->state == MOE__V1__WORKER_STATE__WORKER_STATE_SERVING;
        printf("coordinator %s: model %s, up %.0f s\n", g.addr, r->model, r->uptime_s);
        printf("workers: %zu serving of %zu\n", serving, r->n_workers);
        printf("requests: %u running, %" PRIu64 " total, %" PRIu64 " failed\n", r->requests_running,
               r->requests_total, r->requests_failed);
        printf("expert placement: epoch %" PRIu64 "%s\n", r->placement_epoch,
               r->placement_epoch ? "" : " (the default split)");
        if (r->n_workers) {
            printf("\n");
            print_workers(r->workers, r->n_workers);
        }
    }
    moe__v1__cluster_status_response__free_unpacked(r, NULL);
    return 0;
}

static int cmd_workers(void)
{
    const char *sub = g.n_pos > 1 ? g.pos[1] : "list";
    struct rpc_reply reply;
    size_t len;
    void *buf;
    if (!strcmp(sub, "list")) {
        Moe__V1__ListWorkersRequest rq = MOE__V1__LIST_WORKERS_REQUEST__INIT;
        buf = rpc_pack(&rq.base, &len);
        bool ok = admin_call("workers list", "ListWorkers", buf, len, &reply);
        free(buf);
        if (!ok) {
            rpc_reply_clear(&reply);
            return 1;
        }
        Moe__V1__ListWorkersResponse *r =
            moe__v1__list_workers_response__unpack(NULL, reply.len, reply.data);
        rpc_reply_clear(&reply);
        if (!r)
            return fail("workers list: the answer is not a ListWorkersResponse");
        if (g.json) {
            cJSON *o = cJSON_CreateObject();
            cJSON *a = cJSON_AddArrayToObject(o, "workers");
            for (size_t i = 0; i < r->n_workers; i++)
                cJSON_AddItemToArray(a, worker_json(r->workers[i]));
            print_json(o);
        } else {
            print_workers(r->workers, r->n_workers);
        }
        moe__v1__list_workers_response__free_unpacked(r, NULL);
        return 0;
    }
    bool drain = !strcmp(sub, "drain");
    if (!drain && strcmp(sub, "undrain"))
        return usage_err("workers: unknown subcommand '%s' (list, drain ID, undrain ID)", sub);
    if (g.n_pos != 3)
        return usage_err("workers %s needs one worker ID", sub);
    Moe__V1__DrainWorkerRequest dq = MOE__V1__DRAIN_WORKER_REQUEST__INIT;
    Moe__V1__UndrainWorkerRequest uq = MOE__V1__UNDRAIN_WORKER_REQUEST__INIT;
    dq.id = uq.id = (char *)g.pos[2];
    buf = drain ? rpc_pack(&dq.base, &len) : rpc_pack(&uq.base, &len);
    char what[256];
    snprintf(what, sizeof what, "workers %s %s", sub, g.pos[2]);
    bool ok = admin_call(what, drain ? "DrainWorker" : "UndrainWorker", buf, len, &reply);
    free(buf);
    if (!ok) {
        rpc_reply_clear(&reply);
        return 1;
    }
    /* both answers have `state` as field 1 */
    Moe__V1__DrainWorkerResponse *r =
        moe__v1__drain_worker_response__unpack(NULL, reply.len, reply.data);
    rpc_reply_clear(&reply);
    if (!r)
        return fail("%s: the answer is not a DrainWorkerResponse", what);
    if (g.json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "id", g.pos[2]);
        cJSON_AddStringToObject(o, "state", state_name(r->state));
        print_json(o);
    } else {
        printf("worker %s: %s\n", g.pos[2], state_name(r->state));
    }
    moe__v1__drain_worker_response__free_unpacked(r, NULL);
    return 0;
}

/* ---- experts --------------------------------------------------------------------------- */

static Moe__V1__PlacementInfo *get_placement(const char *what)
{
    Moe__V1__GetPlacementRequest rq = MOE__V1__GET_PLACEMENT_REQUEST__INIT;
    size_t len;
    void *buf = rpc_pack(&rq.base, &len);
    struct rpc_reply reply;
    bool ok = admin_call(what, "GetPlacement", buf, len, &reply);
    free(buf);
    Moe__V1__PlacementInfo *info =
        ok ? moe__v1__placement_info__unpack(NULL, reply.len, reply.data) : NULL;
    if (ok && !info)
        fail("%s: the answer is not a PlacementInfo", what);
    rpc_reply_clear(&reply);
    return info;
}

/* Ranks of (layer, expert) from a placement JSON, as "0,1" into buf. */
static void ranks_of(const cJSON *pl, int layer, int expert, char *buf, size_t cap)
{
    char k[16];
    snprintf(k, sizeof k, "%d", layer);
    const cJSON *arr =
        cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(pl, "layers"), k);
    if (!arr)
        arr = cJSON_GetObjectItemCaseSensitive(pl, "experts");
    const cJSON *ranks = cJSON_GetArrayItem(arr, expert);
    size_t n = 0;
    buf[0] = 0;
    const cJSON *r;
    cJSON_ArrayForEach(r, ranks)
    {
        n += (size_t)snprintf(buf + n, n < cap ? cap - n : 0, "%s%d", n ? "," : "",
                              (int)r->valuedouble);
        if (n >= cap)
            break;
    }
}

static const char SHADES[] = " .:-=+*#%@";

static int cmd_stats(void)
{
    Moe__V1__GetExpertStatsRequest rq = MOE__V1__GET_EXPERT_STATS_REQUEST__INIT;
    rq.window_s = (uint32_t)(g.window_s > 0 ? g.window_s : 0);
    size_t len;
    void *buf = rpc_pack(&rq.base, &len);
    struct rpc_reply reply;
    bool ok = admin_call("experts stats", "GetExpertStats", buf, len, &reply);
    free(buf);
    if (!ok) {
        rpc_reply_clear(&reply);
        return 1;
    }
    Moe__V1__ExpertStats *s = moe__v1__expert_stats__unpack(NULL, reply.len, reply.data);
    rpc_reply_clear(&reply);
    if (!s || s->n_tokens != (size_t)s->n_layer * s->n_expert) {
        if (s)
            moe__v1__expert_stats__free_unpacked(s, NULL);
        return fail("experts stats: malformed ExpertStats answer");
    }
    int L = (int)s->n_layer, E = (int)s->n_expert;
    if (g.layer >= L) {
        moe__v1__expert_stats__free_unpacked(s, NULL);
        return usage_err("--layer %ld: the model has layers 0..%d", g.layer, L - 1);
    }
    int rc = 0;
    if (g.json) {
        /* the trace format of bench/sim_placement.c: one window */
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "stats_layers", L);
        cJSON_AddNumberToObject(o, "stats_experts", E);
        cJSON_AddNumberToObject(o, "stats_steps", (double)s->steps);
        cJSON_AddNumberToObject(o, "window_s", s->window_s);
        cJSON_AddNumberToObject(o, "workers_reporting", s->workers_reporting);
        cJSON_AddNumberToObject(o, "workers_total", s->workers_total);
        cJSON *a = cJSON_AddArrayToObject(o, "expert_tokens");
        for (int l = 0; l < L; l++)
            for (int e = 0; e < E; e++)
                if (g.layer < 0 || g.layer == l)
                    cJSON_AddItemToArray(a, cJSON_CreateNumber((double)s->tokens[l * E + e]));
        if (g.layer >= 0)
            cJSON_AddNumberToObject(o, "layer", (double)g.layer);
        print_json(o);
        moe__v1__expert_stats__free_unpacked(s, NULL);
        return 0;
    }
    uint64_t total = 0;
    for (size_t i = 0; i < s->n_tokens; i++)
        total += s->tokens[i];
    printf("expert load over %.0f s: %" PRIu64 " tokens, %" PRIu64 " steps, %u of %u workers "
           "reporting\n",
           s->window_s, total, s->steps, s->workers_reporting, s->workers_total);
    if (!total)
        printf("(no expert statistics yet: the workers report none, or no traffic in the "
               "window)\n");
    if (g.layer >= 0) {
        Moe__V1__PlacementInfo *info = get_placement("experts stats");
        cJSON *pl = info ? cJSON_Parse(info->placement_json) : NULL;
        int l = (int)g.layer;
        uint64_t lt = 0, mx = 0;
        for (int e = 0; e < E; e++) {
            lt += s->tokens[l * E + e];
            if (s->tokens[l * E + e] > mx)
                mx = s->tokens[l * E + e];
        }
        printf("layer %d (placement epoch %" PRIu64 ")\n%6s %12s %7s %-12s %s\n", l,
               info ? info->epoch : 0, "EXPERT", "TOKENS", "SHARE", "RANKS", "LOAD");
        for (int e = 0; e < E; e++) {
            uint64_t t = s->tokens[l * E + e];
            char ranks[64] = "?";
            if (pl)
                ranks_of(pl, l, e, ranks, sizeof ranks);
            int bar = mx ? (int)(40.0 * (double)t / (double)mx + 0.5) : 0;
            printf("%6d %12" PRIu64 " %6.1f%% %-12s %.*s\n", e, t,
                   lt ? 100.0 * (double)t / (double)lt : 0.0, ranks, bar,
                   "########################################");
        }
        cJSON_Delete(pl);
        if (info)
            moe__v1__placement_info__free_unpacked(info, NULL);
        else
            rc = 1;
    } else {
        printf("one row per layer, one character per expert, shaded by its share of the "
               "layer's hottest expert ('%s')\n",
               SHADES);
        printf("%5s %10s %8s  %s\n", "LAYER", "TOKENS", "HOT/AVG", "EXPERTS 0..");
        for (int l = 0; l < L; l++) {
            uint64_t lt = 0, mx = 0;
            for (int e = 0; e < E; e++) {
                lt += s->tokens[l * E + e];
                if (s->tokens[l * E + e] > mx)
                    mx = s->tokens[l * E + e];
            }
            printf("%5d %10" PRIu64 " %8.2f  ", l, lt, lt ? (double)mx * E / (double)lt : 0.0);
            for (int e = 0; e < E; e++) {
                uint64_t t = s->tokens[l * E + e];
                int k = mx ? (int)((double)t / (double)mx * 9 + 0.5) : 0;
                if (t && !k)
                    k = 1;
                putchar(SHADES[k]);
            }
            putchar('\n');
        }
    }
    moe__v1__expert_stats__free_unpacked(s, NULL);
    return rc;
}

static int cmd_show(void)
{
    Moe__V1__PlacementInfo *info = get_placement("experts show");
    if (!info)
        return 1;
    cJSON *pl = cJSON_Parse(info->placement_json);
    if (g.json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "epoch", (double)info->epoch);
        cJSON_AddStringToObject(o, "store", info->store);
        cJSON_AddNumberToObject(o, "n_layer", info->n_layer);
        cJSON_AddNumberToObject(o, "n_expert", info->n_expert);
        cJSON_AddNumberToObject(o, "n_rank", info->n_rank);
        cJSON_AddNumberToObject(o, "slots_per_rank", info->slots_per_rank);
        cJSON_AddNumberToObject(o, "redundant", info->n_redundant);
        if (info->has_previous)
            cJSON_AddNumberToObject(o, "previous_epoch", (double)info->previous_epoch);
        else
            cJSON_AddNullToObject(o, "previous_epoch");
        cJSON *wa = cJSON_AddArrayToObject(o, "workers");
        for (size_t i = 0; i < info->n_workers; i++) {
            cJSON *w = cJSON_CreateObject();
            cJSON_AddStringToObject(w, "id", info->workers[i]->id);
            cJSON_AddNumberToObject(w, "epoch", (double)info->workers[i]->epoch);
            cJSON_AddItemToArray(wa, w);
        }
        cJSON_AddItemToObject(o, "placement", pl ? pl : cJSON_CreateNull());
        print_json(o);
    } else {
        printf("placement epoch %" PRIu64 " (%s), %u layers x %u experts on %u ranks, %u slots "
               "per rank, %u redundant\n",
               info->epoch, info->store, info->n_layer, info->n_expert, info->n_rank,
               info->slots_per_rank, info->n_redundant);
        if (info->has_previous)
            printf("rollback restores the map of epoch %" PRIu64 "\n", info->previous_epoch);
        for (size_t i = 0; i < info->n_workers; i++)
            printf("worker %s runs epoch %" PRIu64 "\n", info->workers[i]->id,
                   info->workers[i]->epoch);
        for (unsigned l = 0; pl && l < info->n_layer; l++) {
            printf("layer %u:", l);
            for (unsigned e = 0; e < info->n_expert; e++) {
                char r[64];
                ranks_of(pl, (int)l, (int)e, r, sizeof r);
                printf(" %u@%s", e, r);
            }
            printf("\n");
        }
        cJSON_Delete(pl);
    }
    moe__v1__placement_info__free_unpacked(info, NULL);
    return 0;
}

static Moe__V1__PlacementPlan *plan_call(const char *what, long redundant)
{
    Moe__V1__PlanPlacementRequest rq = MOE__V1__PLAN_PLACEMENT_REQUEST__INIT;
    if (redundant >= 0) {
        rq.set_redundant = true;
        rq.redundant = (uint32_t)redundant;
    }
    if (g.tolerance >= 0) {
        rq.set_keep_tolerance = true;
        rq.keep_tolerance = g.tolerance;
    }
    rq.window_s = (uint32_t)(g.window_s > 0 ? g.window_s : 0);
    size_t len;
    void *buf = rpc_pack(&rq.base, &len);
    struct rpc_reply reply;
    bool ok = admin_call(what, "PlanPlacement", buf, len, &reply);
    free(buf);
    Moe__V1__PlacementPlan *plan =
        ok ? moe__v1__placement_plan__unpack(NULL, reply.len, reply.data) : NULL;
    if (ok && !plan)
        fail("%s: the answer is not a PlacementPlan", what);
    rpc_reply_clear(&reply);
    return plan;
}

/* The plan file: what `experts apply` reads. */
static cJSON *plan_json(const Moe__V1__PlacementPlan *p, bool with_changes)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "base_epoch", (double)p->base_epoch);
    cJSON_AddNumberToObject(o, "imbalance_before", p->imbalance_before);
    cJSON_AddNumberToObject(o, "imbalance_after", p->imbalance_after);
    cJSON_AddNumberToObject(o, "moves", p->moves);
    cJSON_AddNumberToObject(o, "removed", p->removed);
    cJSON_AddNumberToObject(o, "layers_changed", p->layers_changed);
    cJSON_AddNumberToObject(o, "redundant", p->redundant);
    cJSON_AddNumberToObject(o, "slots_per_rank", p->slots_per_rank);
    cJSON_AddNumberToObject(o, "stats_tokens", (double)p->stats_tokens);
    cJSON_AddItemToObject(o, "rank_load_before",
                          cJSON_CreateDoubleArray(p->rank_load_before, (int)p->n_rank_load_before));
    cJSON_AddItemToObject(o, "rank_load_after",
                          cJSON_CreateDoubleArray(p->rank_load_after, (int)p->n_rank_load_after));
    if (with_changes) {
        cJSON *a = cJSON_AddArrayToObject(o, "changes");
        for (size_t i = 0; i < p->n_changes; i++) {
            const Moe__V1__PlacementChange *c = p->changes[i];
            cJSON *x = cJSON_CreateObject();
            cJSON_AddNumberToObject(x, "layer", c->layer);
            cJSON_AddNumberToObject(x, "expert", c->expert);
            cJSON *b = cJSON_AddArrayToObject(x, "ranks_before");
            for (size_t k = 0; k < c->n_ranks_before; k++)
                cJSON_AddItemToArray(b, cJSON_CreateNumber(c->ranks_before[k]));
            cJSON *af = cJSON_AddArrayToObject(x, "ranks_after");
            for (size_t k = 0; k < c->n_ranks_after; k++)
                cJSON_AddItemToArray(af, cJSON_CreateNumber(c->ranks_after[k]));
            cJSON_AddItemToArray(a, x);
        }
    }
    cJSON *pl = cJSON_Parse(p->placement_json);
    cJSON_AddItemToObject(o, "placement", pl ? pl : cJSON_CreateNull());
    return o;
}

static void print_plan(const Moe__V1__PlacementPlan *p)
{
    printf("plan on epoch %" PRIu64 ": %u layers x %u experts on %u ranks, %u redundant, %u "
           "slots per rank\n",
           p->base_epoch, p->n_layer, p->n_expert, p->n_rank, p->redundant, p->slots_per_rank);
    if (!p->stats_tokens)
        printf("(no expert statistics yet: balance is predicted for zero load)\n");
    printf("predicted imbalance (max/mean rank load): %.3f -> %.3f  (balancedness %.3f -> "
           "%.3f)\n",
           p->imbalance_before, p->imbalance_after,
           p->imbalance_before > 0 ? 1 / p->imbalance_before : 0,
           p->imbalance_after > 0 ? 1 / p->imbalance_after : 0);
    printf("moves: %u replicas to load, %u to drop, %u layers changed\n", p->moves, p->removed,
           p->layers_changed);
    double mx = 0;
    for (size_t r = 0; r < p->n_rank_load_before; r++)
        mx = fmax(mx, fmax(p->rank_load_before[r], p->rank_load_after[r]));
    if (mx > 0) {
        printf("%5s %12s %-25s %12s %s\n", "RANK", "BEFORE", "", "AFTER", "");
        for (size_t r = 0; r < p->n_rank_load_before; r++) {
            int a = (int)(25 * p->rank_load_before[r] / mx + 0.5);
            int b = (int)(25 * p->rank_load_after[r] / mx + 0.5);
            printf("%5zu %12.0f %-25.*s %12.0f %.*s\n", r, p->rank_load_before[r], a,
                   "#########################", p->rank_load_after[r], b,
                   "#########################");
        }
    }
    size_t shown = g.all ? p->n_changes : (p->n_changes < 40 ? p->n_changes : 40);
    for (size_t i = 0; i < shown; i++) {
        const Moe__V1__PlacementChange *c = p->changes[i];
        printf("  layer %u expert %u: [", c->layer, c->expert);
        for (size_t k = 0; k < c->n_ranks_before; k++)
            printf("%s%u", k ? "," : "", c->ranks_before[k]);
        printf("] -> [");
        for (size_t k = 0; k < c->n_ranks_after; k++)
            printf("%s%u", k ? "," : "", c->ranks_after[k]);
        printf("]\n");
    }
    if (shown < p->n_changes)
        printf("  ... %zu more changes (--all shows them)\n", p->n_changes - shown);
}

/* Installs a placement (JSON text) built on base_epoch. */
static int apply_call(const char *what, uint64_t base_epoch, const char *placement_json)
{
    Moe__V1__ApplyPlacementRequest rq = MOE__V1__APPLY_PLACEMENT_REQUEST__INIT;
    rq.base_epoch = base_epoch;
    rq.placement_json = (char *)placement_json;
    size_t len;
    void *buf = rpc_pack(&rq.base, &len);
    struct rpc_reply reply;
    bool ok = admin_call(what, "ApplyPlacement", buf, len, &reply);
    free(buf);
    Moe__V1__PlacementInfo *info =
        ok ? moe__v1__placement_info__unpack(NULL, reply.len, reply.data) : NULL;
    rpc_reply_clear(&reply);
    if (!info)
        return ok ? fail("%s: the answer is not a PlacementInfo", what) : 1;
    if (g.json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "epoch", (double)info->epoch);
        cJSON_AddNumberToObject(o, "previous_epoch", (double)info->previous_epoch);
        cJSON_AddStringToObject(o, "store", info->store);
        print_json(o);
    } else {
        printf("placement epoch %" PRIu64 " installed (was %" PRIu64 ", %s); workers switch at "
               "a step boundary once they have loaded the new experts\n",
               info->epoch, info->previous_epoch, info->store);
    }
    moe__v1__placement_info__free_unpacked(info, NULL);
    return 0;
}

/* experts plan / scale / apply --auto: plan, show, maybe write, maybe apply. */
static int plan_and_maybe_apply(const char *what, bool apply)
{
    Moe__V1__PlacementPlan *p = plan_call(what, g.redundant);
    if (!p)
        return 1;
    int rc = 0;
    if (g.out) {
        cJSON *o = plan_json(p, false);
        char *s = cJSON_Print(o);
        cJSON_Delete(o);
        FILE *f = s ? fopen(g.out, "w") : NULL;
        if (!f || fprintf(f, "%s\n", s) < 0 || fclose(f)) {
            rc = fail("%s: cannot write %s: %s", what, g.out, strerror(errno));
            free(s);
            goto out;
        }
        free(s);
    }
    if (g.json && !apply) {
        print_json(plan_json(p, true));
    } else if (!g.json) {
        print_plan(p);
        if (g.out)
            printf("plan written to %s (moectl experts apply %s)\n", g.out, g.out);
    }
    if (apply && !g.dry_run)
        rc = apply_call(what, p->base_epoch, p->placement_json);
    else if (apply && !g.json)
        printf("--dry-run: nothing applied\n");
out:
    moe__v1__placement_plan__free_unpacked(p, NULL);
    return rc;
}

static int cmd_experts(void)
{
    if (g.n_pos < 2)
        return usage_err("experts needs a subcommand (stats, show, plan, apply, rollback, scale)");
    const char *sub = g.pos[1];
    if (!strcmp(sub, "stats"))
        return cmd_stats();
    if (!strcmp(sub, "show"))
        return cmd_show();
    if (!strcmp(sub, "plan"))
        return plan_and_maybe_apply("experts plan", false);
    if (!strcmp(sub, "scale")) {
        if (g.redundant < 0)
            return usage_err("experts scale needs --redundant N");
        return plan_and_maybe_apply("experts scale", true);
    }
    if (!strcmp(sub, "apply")) {
        if (g.auto_plan) {
            if (g.n_pos != 2)
                return usage_err("experts apply: give a plan file or --auto, not both");
            return plan_and_maybe_apply("experts apply --auto", true);
        }
        if (g.n_pos != 3)
            return usage_err("experts apply needs a plan file (from experts plan -o) or --auto");
        char *text;
        struct moe_error err = {0};
        if (moe_read_text(g.pos[2], (size_t)64 << 20, &text, &err))
            return usage_err("%s", err.msg);
        cJSON *o = cJSON_Parse(text);
        free(text);
        const cJSON *be = cJSON_GetObjectItemCaseSensitive(o, "base_epoch");
        const cJSON *pl = cJSON_GetObjectItemCaseSensitive(o, "placement");
        if (!cJSON_IsObject(o) || !cJSON_IsNumber(be) || be->valuedouble < 0 ||
            !cJSON_IsObject(pl)) {
            cJSON_Delete(o);
            return usage_err("%s: not a plan file (needs \"base_epoch\" and a \"placement\" "
                             "object, as experts plan -o writes)",
                             g.pos[2]);
        }
        char *pj = cJSON_PrintUnformatted(pl);
        char what[600];
        snprintf(what, sizeof what, "experts apply %s", g.pos[2]);
        int rc = pj ? apply_call(what, (uint64_t)be->valuedouble, pj) : fail("out of memory");
        free(pj);
        cJSON_Delete(o);
        return rc;
    }
    if (!strcmp(sub, "rollback")) {
        Moe__V1__RollbackPlacementRequest rq = MOE__V1__ROLLBACK_PLACEMENT_REQUEST__INIT;
        size_t len;
        void *buf = rpc_pack(&rq.base, &len);
        struct rpc_reply reply;
        bool ok = admin_call("experts rollback", "RollbackPlacement", buf, len, &reply);
        free(buf);
        Moe__V1__PlacementInfo *info =
            ok ? moe__v1__placement_info__unpack(NULL, reply.len, reply.data) : NULL;
        rpc_reply_clear(&reply);
        if (!info)
            return ok ? fail("experts rollback: the answer is not a PlacementInfo") : 1;
        if (g.json) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "epoch", (double)info->epoch);
            cJSON_AddNumberToObject(o, "previous_epoch", (double)info->previous_epoch);
            print_json(o);
        } else {
            printf("rolled back: epoch %" PRIu64 " installs the map that epoch %" PRIu64
                   " replaced\n",
                   info->epoch, info->previous_epoch);
        }
        moe__v1__placement_info__free_unpacked(info, NULL);
        return 0;
    }
    return usage_err("experts: unknown subcommand '%s'", sub);
}

int main(int argc, char **argv)
{
    cli_init("moectl");
    int rc = parse_args(argc, argv);
    if (rc)
        return rc;
    if (!g.n_pos) {
        usage(stderr);
        return 2;
    }
    const char *cmd = g.pos[0];
    if (strcmp(cmd, "status") && strcmp(cmd, "workers") && strcmp(cmd, "experts") &&
        strcmp(cmd, "health"))
        return usage_err("unknown command '%s' (status, workers, experts, health)", cmd);
    struct moe_error err = {0};
    static struct rpc_client_options co; /* static: its TLS material lives until exit */
    char *token = NULL;
    if (moe_tls_create(&g.tls, &co.tls, &err) ||
        (g.token_file && moe_token_read("--token-file", g.token_file, &token, &err)))
        return usage_err("%s", err.msg);
    co.token = token;
    g_client = rpc_client_create(g.addr, &co, &err);
    free(token);
    if (!g_client)
        return fail("cannot reach the coordinator at %s: %s", g.addr, err.msg);
    if (!strcmp(cmd, "status"))
        rc = cmd_status();
    else if (!strcmp(cmd, "workers"))
        rc = cmd_workers();
    else if (!strcmp(cmd, "health"))
        rc = cmd_health();
    else
        rc = cmd_experts();
    rpc_client_destroy(g_client);
    return rc;
}
