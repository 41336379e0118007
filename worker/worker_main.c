/* moe-worker: loads a model, runs the engine and serves moe.v1.Worker and
 * grpc.health.v1.Health. With --etcd it registers under a lease that it
 * keeps alive (and renews if it is lost); on SIGTERM or SIGINT it drains:
 * health NOT_SERVING, registration removed, new work refused with
 * UNAVAILABLE, running requests finish, then it exits 0.
 *
 *   moe-worker --model DIR [--listen HOST:PORT] [--advertise HOST:PORT]
 *              [--etcd URLS --worker-id ID --lease-ttl S] [--dtype f32|bf16|int8]
 *              [--threads N] [--device auto|cpu|cuda] [--kv-blocks N | --kv-memory MIB]
 *              [--block-size N] [--max-batch-tokens N] [--max-running N]
 *              [--no-prefix-cache] [--role mixed|prefill|decode] [--kv-listen HOST:PORT]
 *              [--drain-timeout S] [--metrics-listen HOST:PORT]
 *   mpirun -np W moe-worker ... [--tp T] [--placement F.json]
 *              one model replica over W ranks: rank 0 serves gRPC and runs the
 *              scheduler, every rank runs each step (tensor + expert parallel)
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "backend.h"
#include "engine/engine.h"
#include "etcd.h"
#include "engine/generate.h"
#include "group/group.h"
#include "disagg/kv_link.h"
#include "group/launch.h"
#include "model/model.h"
#include "moe/v1/worker.pb-c.h"
#include "model/placement.h"
#include "serve/service.h"
#include "engine/spec.h"
#include "tokenizer.h"
#include "serve/worker_metrics.h"

struct args {
    const char *model;
    const char *listen;
    const char *advertise;
    const char *etcd;
    const char *worker_id;
    const char *device;
    const char *role;
    const char *kv_listen;
    const char *metrics_listen;
    bool kv_socket_only;
    enum moe_dtype dtype;
    int threads;
    int lease_ttl;
    int kv_blocks;
    long kv_memory_mib;
    int block_size;
    int max_batch_tokens;
    int max_running;
    bool no_prefix_cache;
    bool exact;
    int spec_tokens;
    int drain_timeout_s;
    int tp;
    const char *placement;
    int comm_timeout_ms;
    int handoff_ttl_ms;
};

static volatile sig_atomic_t g_signal;

static void on_signal(int sig)
{
    g_signal = sig;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: moe-worker --model DIR [options]\n"
               "  --listen HOST:PORT    gRPC address (default 127.0.0.1:0 = a free port)\n"
               "  --advertise HOST:PORT address registered in etcd (default: the bound one)\n"
               "  --etcd URLS           etcd endpoints (http://127.0.0.1:2379,...); none = static\n"
               "  --worker-id ID        name in etcd and Admin (default worker-PORT)\n"
               "  --lease-ttl S         etcd lease TTL in seconds (default 5)\n"
               "  --dtype T             weights in memory: f32, bf16 (default) or int8\n"
               "                        (Linear weights quantized per row at load; CPU only)\n"
               "  --exact               f32 activations in every matmul (default: bf16 / int8\n"
               "                        activations where the CPU has dot-product instructions)\n"
               "  --threads N           CPU threads, 0 = all cores (default 0)\n"
               "  --device D            auto|cpu|cuda (default auto)\n"
               "  --kv-blocks N | --kv-memory MIB   KV cache size (default 512 MiB)\n"
               "  --block-size N        tokens per KV block (default 16)\n"
               "  --max-batch-tokens N  token budget per step (default 512)\n"
               "  --max-running N       running sequences cap (default 64)\n"
               "  --no-prefix-cache     disable prefix caching\n"
               "  --spec-tokens K       n-gram speculative decoding: up to K draft tokens per\n"
               "                        decode step, 0..16, 0 = off (default 0)\n"
               "  --role R              mixed (default), prefill or decode: the pool this worker\n"
               "                        serves in disaggregated serving (KV handed off from\n"
               "                        prefill to decode workers, rank to rank)\n"
               "  --kv-listen HOST:PORT where this rank's KV data plane listens (prefill and\n"
               "                        decode roles; default: the --listen host, a free port;\n"
               "                        under mpirun every rank takes a free port)\n"
               "  --kv-transport T      auto (default: NCCL between GPUs, else the socket) or\n"
               "                        socket (KV payloads always through host memory)\n"
               "  --drain-timeout S     on SIGTERM, wait at most S seconds for running requests "
               "(default 60)\n"
               "  --metrics-listen HOST:PORT  Prometheus /metrics (and /health) over HTTP "
               "(default: off; port 0 = a free one)\n"
               "  --handoff-ttl-ms MS   a parked or reserved KV handoff nobody claims expires and "
               "frees its blocks (default 30000)\n"
               "under mpirun: --tp T (attention tensor parallel), --placement F.json (experts),\n"
               "  --comm-timeout-ms MS (a collective slower than this fails the group, default "
               "10000)\n");
}

static int parse_args(int argc, char **argv, struct args *a)
{
    *a = (struct args){.listen = "127.0.0.1:0",
                       .device = "auto",
                       .dtype = MOE_DTYPE_BF16,
                       .lease_ttl = 5,
                       .role = "mixed",
                       .drain_timeout_s = 60,
                       .tp = 1,
                       .comm_timeout_ms = 10000};
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        if (!strcmp(k, "-h") || !strcmp(k, "--help")) {
            usage(stdout);
            exit(0);
        }
        if (!strcmp(k, "--no-prefix-cache")) {
            a->no_prefix_cache = true;
            continue;
        }
        if (!strcmp(k, "--exact")) {
            a->exact = true;
            continue;
        }
        if (i + 1 >= argc)
            return cli_fail("option '%s' needs a value", k);
        const char *v = argv[++i];
        long n;
#define INT_OPT(name, lo, hi, field)                                                               \
    if (!strcmp(k, name)) {                                                                        \
        if (!cli_parse_long(v, lo, hi, &n))                                                        \
            return cli_fail(name ": '%s' is not a whole number in [%ld, %ld]", v, (long)(lo),      \
                            (long)(hi));                                                           \
        a->field = (int)n;                                                                         \
        continue;                                                                                  \
    }
        INT_OPT("--threads", 0, 1024, threads)
        INT_OPT("--lease-ttl", 2, 3600, lease_ttl)
        INT_OPT("--kv-blocks", 1, 1 << 24, kv_blocks)
        INT_OPT("--block-size", 1, 1024, block_size)
        INT_OPT("--max-batch-tokens", 1, 1 << 20, max_batch_tokens)
        INT_OPT("--max-running", 1, 1 << 16, max_running)
        INT_OPT("--spec-tokens", 0, MOE_SPEC_TOKENS_MAX, spec_tokens)
        INT_OPT("--drain-timeout", 0, 86400, drain_timeout_s)
        INT_OPT("--tp", 1, 1024, tp)
        INT_OPT("--comm-timeout-ms", 100, 3600000, comm_timeout_ms)
        INT_OPT("--handoff-ttl-ms", 50, 3600000, handoff_ttl_ms)
#undef INT_OPT
        if (!strcmp(k, "--kv-memory")) {
            if (!cli_parse_long(v, 1, 1 << 24, &n))
                return cli_fail("--kv-memory: '%s' is not a number of MiB in [1, 16777216]", v);
            a->kv_memory_mib = n;
        } else if (!strcmp(k, "--placement")) {
            a->placement = v;
        } else if (!strcmp(k, "--model")) {
            a->model = v;
        } else if (!strcmp(k, "--listen")) {
            a->listen = v;
        } else if (!strcmp(k, "--advertise")) {
            a->advertise = v;
        } else if (!strcmp(k, "--etcd")) {
            a->etcd = v;
        } else if (!strcmp(k, "--worker-id")) {
            a->worker_id = v;
        } else if (!strcmp(k, "--device")) {
            a->device = v;
        } else if (!strcmp(k, "--role")) {
            if (strcmp(v, "mixed") && strcmp(v, "prefill") && strcmp(v, "decode"))
                return cli_fail("--role: '%s' is not one of mixed, prefill, decode", v);
            a->role = v;
        } else if (!strcmp(k, "--kv-listen")) {
            a->kv_listen = v;
        } else if (!strcmp(k, "--metrics-listen")) {
            a->metrics_listen = v;
        } else if (!strcmp(k, "--kv-transport")) {
            if (strcmp(v, "auto") && strcmp(v, "socket"))
                return cli_fail("--kv-transport: '%s' is not one of auto, socket", v);
            a->kv_socket_only = !strcmp(v, "socket");
        } else if (!strcmp(k, "--dtype")) {
            if (!moe_launch_parse_dtype(v, &a->dtype))
                return cli_fail("--dtype: '%s' is not one of f32, bf16, int8", v);
        } else {
            usage(stderr);
            return cli_fail("unknown option '%s'", k);
        }
    }
    if (!a->model)
        return cli_fail("--model DIR is required");
    if (a->worker_id && strlen(a->worker_id) > 128)
        return cli_fail("--worker-id: longer than 128 characters");
    return 0;
}

/* etcd registration: /moe/workers/<id> -> JSON, under a kept-alive lease. */
struct registration {
    const char *endpoints;
    char key[256];
    char value[1024];
    int ttl;
    struct moe_etcd *etcd;
    struct moe_etcd_keeper *keeper;
    int64_t lease;
};

static enum moe_status register_worker(struct registration *reg, struct moe_error *err)
{
    int64_t granted;
    enum moe_status rc = moe_etcd_lease_grant(reg->etcd, reg->ttl, &reg->lease, &granted, err);
    if (!rc)
        rc = moe_etcd_put(reg->etcd, reg->key, reg->value, strlen(reg->value), reg->lease, NULL,
                          err);
    if (!rc)
        rc =
            moe_etcd_keeper_create(reg->endpoints, 2000, reg->lease, NULL, NULL, &reg->keeper, err);
    return rc;
}

/* The group leader follows the expert placement the coordinator stores in
 * etcd at /moe/placement/<model> ({"epoch": N, "placement": {...}}): every
 * new epoch is proposed to the group, which loads the experts in the
 * background and switches at a step boundary. */
struct placement_follow {
    struct moe_group *group;
    const struct moe_config *cfg;
    char key[300];
    int64_t last_epoch;
};

static void follow_placement_value(struct placement_follow *pf, const char *value)
{
    cJSON *root = cJSON_Parse(value);
    const cJSON *ep = cJSON_GetObjectItemCaseSensitive(root, "epoch");
    const cJSON *pl = cJSON_GetObjectItemCaseSensitive(root, "placement");
    char *text = pl ? cJSON_PrintUnformatted(pl) : NULL;
    int64_t epoch = cJSON_IsNumber(ep) ? (int64_t)ep->valuedouble : -1;
    struct moe_placement p = {0};
    struct moe_error err = {0};
    if (epoch < 0 || !text) {
        fprintf(stderr, "moe-worker: %s: no 'epoch' and 'placement' in the value; ignored\n",
                pf->key);
    } else if (epoch > pf->last_epoch) { /* a watch may repeat events after a reconnect */
        if (moe_placement_parse(text, pf->key, pf->cfg->n_layer, pf->cfg->n_expert, pf->group->size,
                                &p, &err) ||
            moe_group_propose_placement(pf->group, &p, epoch, &err)) {
            fprintf(stderr, "moe-worker: placement epoch %lld refused: %s\n", (long long)epoch,
                    err.msg);
        } else {
            pf->last_epoch = epoch;
            fprintf(stderr, "moe-worker: placement epoch %lld received; loading experts\n",
                    (long long)epoch);
        }
    }
    moe_placement_free(&p);
    free(text);
    cJSON_Delete(root);
}

static void on_placement_event(void *user, const struct moe_etcd_event *ev)
{
    if (ev->type == MOE_ETCD_EVENT_PUT)
        follow_placement_value(user, ev->value);
}

static void unregister_worker(struct registration *reg)
{
    moe_etcd_keeper_destroy(reg->keeper);
    reg->keeper = NULL;
    if (reg->lease) {
        struct moe_error err;
        if (moe_etcd_lease_revoke(reg->etcd, reg->lease, &err))
            fprintf(stderr, "moe-worker: revoking lease: %s\n", err.msg);
        reg->lease = 0;
    }
}

int main(int argc, char **argv)
{
    cli_init("moe-worker");
    struct args a;
    int rc = parse_args(argc, argv, &a);
    if (rc)
        return rc;
    signal(SIGPIPE, SIG_IGN);

    struct moe_error err = {0};
    struct moe_model *model = NULL;
    struct moe_tokenizer *tok = NULL;
    struct moe_engine *engine = NULL;
    struct worker_service *ws = NULL;
    struct worker_metrics *metrics = NULL;
    struct registration reg = {.endpoints = a.etcd, .ttl = a.lease_ttl};
    struct moe_launch launch = {0};
    struct moe_group *group = NULL; /* = launch.group */
    struct moe_backend *be = NULL;  /* = launch.be */
    struct moe_etcd_watch *placement_watch = NULL;
    struct kvl *kv_link = NULL;              /* disaggregated roles only */
    char *kv_endpoints = NULL;               /* every rank's, by rank */
    struct moe_kv_cache *follower_kv = NULL; /* a follower's cache, shared with kv_link */
    rc = 1;

    struct moe_launch_args la = {.model = a.model,
                                 .device = a.device,
                                 .threads = a.threads,
                                 .dtype = a.dtype,
                                 .tp = a.tp,
                                 .comm_timeout_ms = a.comm_timeout_ms,
                                 .placement = a.placement,
                                 .exact = a.exact};
    if (moe_launch_start(&argc, &argv, &la, &launch, &err))
        goto fail;
    group = launch.group;
    be = launch.be;
    struct moe_model_opts mo = launch.model_opts;
    if (moe_model_load(a.model, &mo, be, &model, &err))
        goto fail;
    const struct moe_config *cfg = moe_model_config(model);
    int world = group ? group->size : 1;
    if (strcmp(a.role, "mixed")) {
        /* the KV data plane: every rank moves its own heads */
        char listen[300];
        if (a.kv_listen && (!group || group->size == 1)) {
            snprintf(listen, sizeof listen, "%s", a.kv_listen);
        } else {
            const char *src = a.kv_listen ? a.kv_listen : a.listen;
            const char *colon = strrchr(src, ':');
            int host_len = colon ? (int)(colon - src) : (int)strlen(src);
            snprintf(listen, sizeof listen, "%.*s:0", host_len, src);
        }
        char adv_host[KVL_ENDPOINT_MAX] = "";
        if (a.advertise) {
            const char *colon = strrchr(a.advertise, ':');
            snprintf(adv_host, sizeof adv_host, "%.*s",
                     colon ? (int)(colon - a.advertise) : (int)strlen(a.advertise), a.advertise);
        }
        struct kvl_opts ko = {.be = be,
                              .listen = listen,
                              .advertise_host = adv_host[0] ? adv_host : NULL,
                              .layout = {.n_layer = cfg->n_layer,
                                         .n_kv_head = cfg->n_kv_head,
                                         .d_head = cfg->d_head,
                                         .tp_size = group ? group->tp_size : 1,
                                         .tp_rank = group ? group->tp_rank : 0},
                              .nccl = !a.kv_socket_only};
        if (!(kv_endpoints = calloc((size_t)world, KVL_ENDPOINT_MAX))) {
            moe_error_set(&err, MOE_ERR_NOMEM, "out of memory");
            goto fail;
        }
        if (kvl_create(&ko, &kv_link, &err))
            goto fail;
        snprintf(kv_endpoints, KVL_ENDPOINT_MAX, "%s", kvl_endpoint(kv_link));
    }
    if (group && group->rank != 0) {
        /* Followers run the leader's step plans until it stops the group. */
        fprintf(stderr, "moe-worker: rank %d of %d (tp %d/%d) following, %.1f MiB of weights\n",
                group->rank, group->size, group->tp_rank, group->tp_size,
                (double)moe_model_weight_bytes(model) / (1024.0 * 1024.0));
        /* A follower's life is the leader's: it drains on SIGTERM and then
         * stops the group, so a SIGTERM that mpirun forwards here is ignored. */
        signal(SIGTERM, SIG_IGN);
        signal(SIGINT, SIG_IGN);
        if (kv_link) {
            if (moe_group_share_kv(group, model, 0, 0, kvl_endpoint(kv_link), kv_endpoints,
                                   &follower_kv, &err))
                goto fail;
            kvl_attach_kv(kv_link, follower_kv);
        }
        if (moe_group_follow(group, model, &err))
            goto fail;
        rc = 0;
        goto out;
    }
    char tok_path[4096];
    snprintf(tok_path, sizeof tok_path, "%s/tokenizer.json", a.model);
    if (access(tok_path, F_OK) == 0 && moe_tokenizer_load(tok_path, &tok, &err))
        goto fail;

    struct moe_engine_opts eo = {
        .n_block = a.kv_blocks,
        .block_size = a.block_size ? a.block_size : 16,
        .max_batch_tokens = a.max_batch_tokens,
        .max_running = a.max_running,
        .no_prefix_cache = a.no_prefix_cache,
        .spec_tokens = a.spec_tokens,
        .forward = group ? moe_group_forward : NULL,
        .forward_ctx = group,
    };
    const char *name = strrchr(a.model, '/');
    name = name && name[1] ? name + 1 : a.model;
    if (a.metrics_listen) { /* times every step: the engine calls through it */
        if (worker_metrics_create(name, model, group, eo.forward, eo.forward_ctx, &metrics, &err))
            goto fail;
        eo.forward = worker_metrics_forward;
        eo.forward_ctx = metrics;
    }
    if (!eo.n_block) {
        size_t block_bytes = (size_t)eo.block_size * cfg->n_layer * 2 * (size_t)cfg->n_kv_head *
                             cfg->d_head * sizeof(float);
        long mib = a.kv_memory_mib ? a.kv_memory_mib : 512;
        eo.n_block = (int)(((size_t)mib << 20) / block_bytes);
        if (eo.n_block < 1) {
            moe_error_set(&err, MOE_ERR_INVALID, "--kv-memory: %ld MiB holds no KV block", mib);
            goto fail;
        }
    }
    if (moe_engine_create(model, tok, &eo, &engine, &err))
        goto fail;
    if (kv_link) {
        struct moe_kv_cache *none;
        if (group && moe_group_share_kv(group, model, eo.n_block, eo.block_size,
                                        kvl_endpoint(kv_link), kv_endpoints, &none, &err))
            goto fail;
        kvl_attach_kv(kv_link, moe_engine_kv_cache(engine));
    }
    struct worker_service_opts so = {
        .listen = a.listen,
        .model_name = name,
        .dtype_name = moe_launch_dtype_flag(a.dtype),
        .world_size = group ? group->size : 1,
        .group = group,
        .tp_size = group ? group->tp_size : 1,
        .role = !strcmp(a.role, "prefill")  ? MOE__V1__WORKER_ROLE__WORKER_ROLE_PREFILL
                : !strcmp(a.role, "decode") ? MOE__V1__WORKER_ROLE__WORKER_ROLE_DECODE
                                            : MOE__V1__WORKER_ROLE__WORKER_ROLE_MIXED,
        .be = be,
        .kv_link = kv_link,
        .kv_endpoints = kv_endpoints,
        .handoff_ttl_ms = a.handoff_ttl_ms,
    };
    if (worker_service_create(engine, model, tok, &so, &ws, &err))
        goto fail;
    if (metrics && worker_metrics_serve(metrics, a.metrics_listen, engine, ws, &err))
        goto fail;
    int port = worker_service_port(ws);

    char address[300];
    if (a.advertise) {
        snprintf(address, sizeof address, "%s", a.advertise);
    } else {
        const char *colon = strrchr(a.listen, ':');
        int host_len = colon ? (int)(colon - a.listen) : (int)strlen(a.listen);
        snprintf(address, sizeof address, "%.*s:%d", host_len, a.listen, port);
    }
    char id[160];
    snprintf(id, sizeof id, "%s", a.worker_id ? a.worker_id : "");
    if (!id[0])
        snprintf(id, sizeof id, "worker-%d", port);
    if (a.etcd) {
        snprintf(reg.key, sizeof reg.key, "/moe/workers/%s", id);
        snprintf(reg.value, sizeof reg.value,
                 "{\"id\":\"%s\",\"address\":\"%s\",\"role\":\"%s\",\"device\":\"%s\","
                 "\"model\":\"%s\",\"kv_blocks_total\":%d,\"block_size\":%d}",
                 id, address, a.role, be->name, name, eo.n_block, eo.block_size);
        if (moe_etcd_create(a.etcd, 2000, &reg.etcd, &err) || register_worker(&reg, &err)) {
            moe_error_prefix(&err, "registering in etcd");
            goto fail;
        }
    }
    struct placement_follow pf = {.group = group, .cfg = cfg};
    if (a.etcd && group && group->size > 1) {
        snprintf(pf.key, sizeof pf.key, "/moe/placement/%s", name);
        struct moe_etcd_kv kv = {0};
        int64_t rev = 0;
        enum moe_status grc = moe_etcd_get(reg.etcd, pf.key, &kv, &rev, &err);
        if (grc == MOE_OK && kv.value)
            follow_placement_value(&pf, kv.value);
        moe_etcd_kv_clear(&kv);
        if ((grc && grc != MOE_ERR_NOT_FOUND) ||
            moe_etcd_watch_create(a.etcd, 2000, pf.key, 0, rev + 1, on_placement_event, &pf,
                                  &placement_watch, &err)) {
            moe_error_prefix(&err, "watching %s", pf.key);
            goto fail;
        }
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    printf("moe-worker: %s serving %s on %s (%s, %s, %d KV blocks x %d tokens, %d rank%s, "
           "tp %d, pid %d)%s\n",
           id, name, address, a.role, be->name, eo.n_block, eo.block_size, group ? group->size : 1,
           group && group->size > 1 ? "s" : "", group ? group->tp_size : 1, (int)getpid(),
           a.etcd ? ", registered in etcd" : "");
    if (metrics) {
        const char *mc = strrchr(a.metrics_listen, ':');
        printf("moe-worker: /metrics on %.*s:%d\n", mc ? (int)(mc - a.metrics_listen) : 0,
               a.metrics_listen, worker_metrics_port(metrics));
    }
    fflush(stdout);

    while (!g_signal) {
        usleep(100 * 1000);
        if (reg.keeper && moe_etcd_keeper_lost(reg.keeper)) {
            fprintf(stderr, "moe-worker: etcd lease lost; registering again\n");
            moe_etcd_keeper_destroy(reg.keeper);
            reg.keeper = NULL;
            if (register_worker(&reg, &err))
                fprintf(stderr, "moe-worker: %s (will retry)\n", err.msg);
        }
    }
    /* Drain: stop taking work, let running requests finish, then leave. */
    fprintf(stderr, "moe-worker: %s: draining (%d requests in flight)\n",
            g_signal == SIGTERM ? "SIGTERM" : "SIGINT", worker_service_in_flight(ws));
    worker_service_drain(ws);
    unregister_worker(&reg);
    double t0 = moe_now();
    while (worker_service_in_flight(ws) > 0 && moe_now() - t0 < a.drain_timeout_s)
        usleep(20 * 1000);
    int left = worker_service_in_flight(ws);
    if (left)
        fprintf(stderr, "moe-worker: drain timeout: cancelling %d requests\n", left);
    rc = 0;
    goto out;

fail:
    fprintf(stderr, "moe-worker: %s\n", err.msg);
out:
    moe_etcd_watch_destroy(placement_watch);
    worker_metrics_destroy(metrics);  /* reads the service and the engine */
    worker_service_destroy(ws, 1000); /* joins the engine thread: MPI is ours again */
    if (group && group->rank == 0) {
        struct moe_error stop_err;
        if (moe_group_stop(group, &stop_err))
            fprintf(stderr, "moe-worker: stopping the group: %s\n", stop_err.msg);
    }
    unregister_worker(&reg);
    moe_etcd_destroy(reg.etcd);
    kvl_destroy(kv_link); /* before the cache it writes into goes */
    free(kv_endpoints);
    moe_kv_cache_free(model, follower_kv);
    moe_engine_destroy(engine);
    moe_tokenizer_free(tok);
    moe_model_free(model);
    moe_launch_finish(&launch);
    return rc;
}
