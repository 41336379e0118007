/* moe-worker: loads a model, runs the engine and serves moe.v1.Worker and
 * grpc.health.v1.Health. With --etcd it registers under a lease that it
 * keeps alive (serve/registration.h); on SIGTERM or SIGINT it drains:
 * health NOT_SERVING, registration removed, new work refused with
 * UNAVAILABLE, running requests finish, then it exits 0. With --tls-* every
 * port (gRPC, KV data plane, metrics) speaks TLS, and with --tls-ca the gRPC
 * and KV ports require client certificates from that CA (mutual TLS);
 * SIGHUP re-reads the certificate on every rank.
 *
 *   moe-worker --model DIR [--listen HOST:PORT] [--advertise HOST:PORT]
 *              [--etcd URLS --worker-id ID --lease-ttl S] [--dtype f32|bf16|int8]
 *              [--threads N] [--device auto|cpu|cuda] [--kv-blocks N | --kv-memory MIB]
 *              [--block-size N] [--max-batch-tokens N] [--max-running N]
 *              [--no-prefix-cache] [--role mixed|prefill|decode] [--kv-listen HOST:PORT]
 *              [--drain-timeout S] [--metrics-listen HOST:PORT]
 *              [--tls-cert F --tls-key F [--tls-ca F]] [--etcd-cacert F ...]
 *   mpirun -np W moe-worker ... [--tp T] [--placement F.json]
 *              one model replica over W ranks: rank 0 serves gRPC and runs the
 *              scheduler, every rank runs each step (tensor + expert parallel)
 */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "backend.h"
#include "etcd.h"
#include "sighup.h"
#include "tls_opts.h"
#include "engine/engine.h"
#include "engine/generate.h"
#include "group/group.h"
#include "disagg/kv_link.h"
#include "group/launch.h"
#include "hostport.h"
#include "model/model.h"
#include "moe/v1/worker.pb-c.h"
#include "placement.h"
#include "serve/registration.h"
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
    struct moe_tls_opts tls;
    struct moe_etcd_tls etcd_tls;
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
    fputs("TLS (the gRPC, KV data plane and metrics ports, the channels to other workers;\n"
          "with --tls-ca the gRPC and KV ports require client certificates):\n" MOE_TLS_USAGE
          "etcd over TLS:\n" MOE_ETCD_TLS_USAGE,
          f);
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
        if (moe_tls_cli_flag(&a->tls, k, v) || moe_etcd_tls_cli_flag(&a->etcd_tls, k, v))
            continue;
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
    struct worker_registration *reg = NULL;
    struct moe_launch launch = {0};
    struct moe_group *group = NULL;          /* = launch.group */
    struct moe_backend *be = NULL;           /* = launch.be */
    struct kv_link *kv_link = NULL;          /* disaggregated roles only */
    char *kv_endpoints = NULL;               /* every rank's, by rank */
    struct moe_kv_cache *follower_kv = NULL; /* a follower's cache, shared with kv_link */
    struct moe_tls *tls = NULL;              /* --tls-*: every port of every rank */
    struct moe_sighup *sighup = NULL;
    rc = 1;
    if (moe_etcd_set_tls(&a.etcd_tls, &err) || moe_tls_create(&a.tls, &tls, &err) ||
        (tls && moe_sighup_start("moe-worker", tls, NULL, 0, &sighup, &err))) {
        fprintf(stderr, "moe-worker: %s\n", err.msg);
        moe_tls_destroy(tls);
        return 2;
    }

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
            snprintf(listen, sizeof listen, "%.*s:0", moe_hostport_host_len(src), src);
        }
        char adv_host[KV_LINK_ENDPOINT_MAX] = "";
        if (a.advertise) {
            snprintf(adv_host, sizeof adv_host, "%.*s", moe_hostport_host_len(a.advertise),
                     a.advertise);
        }
        struct kv_link_opts ko = {.be = be,
                                  .listen = listen,
                                  .advertise_host = adv_host[0] ? adv_host : NULL,
                                  .layout = {.n_layer = cfg->n_layer,
                                             .n_kv_head = cfg->n_kv_head,
                                             .d_head = cfg->d_head,
                                             .tp_size = group ? group->tp_size : 1,
                                             .tp_rank = group ? group->tp_rank : 0},
                                  .nccl = !a.kv_socket_only,
                                  .tls = tls};
        if (!(kv_endpoints = calloc((size_t)world, KV_LINK_ENDPOINT_MAX))) {
            moe_error_set(&err, MOE_ERR_NOMEM, "out of memory");
            goto fail;
        }
        if (kv_link_create(&ko, &kv_link, &err))
            goto fail;
        snprintf(kv_endpoints, KV_LINK_ENDPOINT_MAX, "%s", kv_link_endpoint(kv_link));
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
            if (moe_group_share_kv(group, model, 0, 0, kv_link_endpoint(kv_link), kv_endpoints,
                                   &follower_kv, &err))
                goto fail;
            kv_link_attach_kv(kv_link, follower_kv);
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
                                        kv_link_endpoint(kv_link), kv_endpoints, &none, &err))
            goto fail;
        kv_link_attach_kv(kv_link, moe_engine_kv_cache(engine));
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
        .tls = tls,
    };
    if (worker_service_create(engine, model, tok, &so, &ws, &err))
        goto fail;
    if (metrics && worker_metrics_serve(metrics, a.metrics_listen, engine, ws, tls, &err))
        goto fail;
    int port = worker_service_port(ws);

    char address[300];
    if (a.advertise) {
        snprintf(address, sizeof address, "%s", a.advertise);
    } else {
        snprintf(address, sizeof address, "%.*s:%d", moe_hostport_host_len(a.listen), a.listen,
                 port);
    }
    char id[160];
    snprintf(id, sizeof id, "%s", a.worker_id ? a.worker_id : "");
    if (!id[0])
        snprintf(id, sizeof id, "worker-%d", port);
    if (a.etcd) {
        struct worker_registration_opts ro = {.endpoints = a.etcd,
                                              .lease_ttl_s = a.lease_ttl,
                                              .id = id,
                                              .address = address,
                                              .role = a.role,
                                              .device = be->name,
                                              .model_name = name,
                                              .kv_blocks_total = eo.n_block,
                                              .block_size = eo.block_size,
                                              .group = group,
                                              .cfg = cfg};
        if (worker_registration_create(&ro, &reg, &err))
            goto fail;
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    printf("moe-worker: %s serving %s on %s (%s, %s, %d KV blocks x %d tokens, %d rank%s, "
           "tp %d, pid %d)%s%s\n",
           id, name, address, a.role, be->name, eo.n_block, eo.block_size, group ? group->size : 1,
           group && group->size > 1 ? "s" : "", group ? group->tp_size : 1, (int)getpid(),
           a.etcd ? ", registered in etcd" : "",
           tls ? (moe_tls_has_ca(tls) ? ", mutual TLS" : ", TLS") : "");
    if (metrics) {
        printf("moe-worker: /metrics on %.*s:%d\n", moe_hostport_host_len(a.metrics_listen),
               a.metrics_listen, worker_metrics_port(metrics));
    }
    fflush(stdout);

    while (!g_signal) {
        usleep(100 * 1000);
        worker_registration_tick(reg);
    }
    /* Drain: stop taking work, let running requests finish, then leave. */
    fprintf(stderr, "moe-worker: %s: draining (%d requests in flight)\n",
            g_signal == SIGTERM ? "SIGTERM" : "SIGINT", worker_service_in_flight(ws));
    worker_service_drain(ws);
    worker_registration_leave(reg);
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
    worker_registration_destroy(reg); /* stops following the placement, leaves etcd */
    worker_metrics_destroy(metrics);  /* reads the service and the engine */
    worker_service_destroy(ws, 1000); /* joins the engine thread: MPI is ours again */
    if (group && group->rank == 0) {
        struct moe_error stop_err;
        if (moe_group_stop(group, &stop_err))
            fprintf(stderr, "moe-worker: stopping the group: %s\n", stop_err.msg);
    }
    kv_link_destroy(kv_link); /* before the cache it writes into goes */
    free(kv_endpoints);
    moe_kv_cache_free(model, follower_kv);
    moe_engine_destroy(engine);
    moe_tokenizer_free(tok);
    moe_model_free(model);
    moe_launch_finish(&launch);
    moe_sighup_stop(sighup);
    moe_tls_destroy(tls);
    return rc;
}
