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
 *              [--threads N] [--device auto|cpu|cuda[:N]] [--kv-blocks N | --kv-memory MIB]
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
#include "stop_signal.h"
#include "tls_opts.h"
#include "engine/draft.h"
#include "engine/engine.h"
#include "engine/engine_args.h"
#include "engine/generate.h"
#include "group/group.h"
#include "disagg/kv_link.h"
#include "group/launch.h"
#include "hostport.h"
#include "kv/kv_cache.h"
#include "model/model.h"
#include "moe/v1/worker.pb-c.h"
#include "placement.h"
#include "serve/registration.h"
#include "serve/service.h"
#include "engine/spec.h"
#include "tokenizer.h"
#include "serve/worker_metrics.h"

struct args {
    struct moe_launch_args launch; /* the group's flags, parsed by group/launch.c */
    const char *listen;
    const char *advertise;
    const char *etcd;
    const char *worker_id;
    const char *role;
    const char *kv_listen;
    const char *metrics_listen;
    bool kv_socket_only;
    int lease_ttl;
    struct moe_engine_args engine; /* the engine's flags, parsed by engine/engine_args.c */
    int drain_timeout_s;
    int handoff_ttl_ms;
    struct moe_tls_opts tls;
    struct moe_etcd_tls etcd_tls;
};

static void usage(FILE *f)
{
    fprintf(f, "usage: moe-worker --model DIR [options]\n"
               "  --listen HOST:PORT    gRPC address (default 127.0.0.1:0 = a free port)\n"
               "  --advertise HOST:PORT address registered in etcd (default: the bound one)\n"
               "  --etcd URLS           etcd endpoints (http://127.0.0.1:2379,...); none = static\n"
               "  --worker-id ID        name in etcd and Admin (default worker-PORT)\n"
               "  --lease-ttl S         etcd lease TTL in seconds (default 5)\n"
               "  --dtype T             weights in memory: f32, bf16 (default), int8 (Linear\n"
               "                        weights quantized per row at load) or int4 (per group\n"
               "                        of --group-size 32 (default), 64 or 128 columns); int8,\n"
               "                        int4: CPU only\n"
               "  --exact               f32 activations in every matmul (default: bf16 / int8\n"
               "                        activations where the CPU has dot-product instructions)\n"
               "  --batch-invariant     every token's results independent of what it is\n"
               "                        batched with: the same tokens alone or under load, in\n"
               "                        one pool or handed between two (CPU: slower prefill)\n"
               "  --no-cuda-graphs      never replay decode steps as CUDA graphs (graphs run\n"
               "                        only where MOE_CUDA_GRAPHS=1 until a GPU has run them)\n"
               "  --threads N           CPU threads, 0 = all cores (default 0)\n"
               "  --device D            auto|cpu|cuda|cuda:N (default auto; cuda: under mpirun\n"
               "                        each rank takes the GPU of its local rank)\n"
               "  --kv-blocks N | --kv-memory MIB   KV cache size (default 512 MiB)\n"
               "  --kv-dtype T          KV cache elements: bf16 (CPU default: twice the tokens\n"
               "                        in the same memory) or f32 (CUDA default, and with\n"
               "                        --exact; bf16 on CUDA: opt-in, not yet measured on\n"
               "                        a GPU); a handoff needs the same on both pools\n"
               "  --block-size N        tokens per KV block (default 16)\n"
               "  --max-batch-tokens N  token budget per step (default 512)\n"
               "  --max-running N       running sequences cap (default 64)\n"
               "  --no-prefix-cache     disable prefix caching\n"
               "  --spec-tokens K       speculative decoding: up to K draft tokens per decode\n"
               "                        step, 0..16, 0 = off (default 0)\n"
               "  --draft-model DIR     draft them with this small model (the model's tokenizer;\n"
               "                        default: n-gram lookup in the sequence)\n"
               "  --spec-max-batch N    no drafts in a step with more than N decode rows\n"
               "                        (0 = no limit; default 8)\n"
               "  --spec-policy P       acceptance (default): draft as many as the sequence's\n"
               "                        recent guesses were kept; cost: only the guesses that\n"
               "                        raise throughput at the measured step and draft costs\n"
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
               "  --dp-attention (TP 1: every rank runs attention for its own sequences over its\n"
               "  own KV cache, --kv-blocks / --kv-memory per rank),\n"
               "  --comm-timeout-ms MS (a collective slower than this fails the group, default "
               "10000)\n");
    fputs("TLS (the gRPC, KV data plane and metrics ports, the channels to other workers;\n"
          "with --tls-ca the gRPC and KV ports require client certificates):\n" MOE_TLS_USAGE
          "etcd over TLS:\n" MOE_ETCD_TLS_USAGE,
          f);
}

static int parse_args(int argc, char **argv, struct args *a)
{
    *a = (struct args){
        .listen = "127.0.0.1:0", .lease_ttl = 5, .role = "mixed", .drain_timeout_s = 60};
    moe_launch_args_init(&a->launch);
    moe_engine_args_init(&a->engine);
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        if (!strcmp(k, "-h") || !strcmp(k, "--help")) {
            usage(stdout);
            exit(0);
        }
        int rc = moe_engine_cli_flags(&a->launch, &a->engine, argc, argv, &i);
        if (rc != 1) {
            if (rc)
                return rc;
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
        INT_OPT("--lease-ttl", 2, 3600, lease_ttl)
        INT_OPT("--drain-timeout", 0, 86400, drain_timeout_s)
        INT_OPT("--handoff-ttl-ms", 50, 3600000, handoff_ttl_ms)
#undef INT_OPT
        if (moe_tls_cli_flag(&a->tls, k, v) || moe_etcd_tls_cli_flag(&a->etcd_tls, k, v))
            continue;
        if (!strcmp(k, "--listen")) {
            a->listen = v;
        } else if (!strcmp(k, "--advertise")) {
            a->advertise = v;
        } else if (!strcmp(k, "--etcd")) {
            a->etcd = v;
        } else if (!strcmp(k, "--worker-id")) {
            a->worker_id = v;
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
        } else {
            usage(stderr);
            return cli_fail("unknown option '%s'", k);
        }
    }
    int rc = moe_launch_cli_check(&a->launch);
    if (rc)
        return rc;
    if (a->worker_id && strlen(a->worker_id) > 128)
        return cli_fail("--worker-id: longer than 128 characters");
    const char *addrs[][2] = {{"--listen", a->listen},
                              {"--advertise", a->advertise},
                              {"--kv-listen", a->kv_listen},
                              {"--metrics-listen", a->metrics_listen}};
    for (size_t j = 0; j < sizeof addrs / sizeof addrs[0]; j++)
        if ((rc = cli_check_hostport(addrs[j][0], addrs[j][1])))
            return rc;
    return 0;
}

/* What main builds, in the order it builds it; worker_run_close frees it in
 * the reverse order. */
struct worker_run {
    struct args a;
    struct moe_error err;
    struct moe_tls *tls;       /* --tls-*: every port of every rank */
    struct moe_sighup *sighup; /* re-reads the certificate on SIGHUP */
    struct moe_launch launch;
    struct moe_group *group; /* = launch.group */
    struct moe_backend *be;  /* = launch.be */
    struct moe_model *model;
    struct moe_model *draft; /* --draft-model, on the leader alone */
    const struct moe_config *cfg;
    struct kv_link *kv_link;          /* disaggregated roles only */
    char *kv_endpoints;               /* every rank's, by rank */
    struct moe_kv_cache *follower_kv; /* a follower's cache, shared with kv_link */
    struct moe_tokenizer *tok;
    const char *name; /* the model's name: the last part of --model */
    struct moe_engine_opts eo;
    struct worker_metrics *metrics;
    struct moe_engine *engine;
    struct worker_service *ws;
    char address[300]; /* where clients reach the gRPC port */
    char id[160];      /* the worker's name in etcd and Admin */
    struct worker_registration *reg;
};

/* TLS for every port and etcd, and the SIGHUP reload of the certificate. */
static enum moe_status start_tls(struct worker_run *r)
{
    enum moe_status rc = moe_etcd_set_tls(&r->a.etcd_tls, &r->err);
    if (!rc)
        rc = moe_tls_create(&r->a.tls, &r->tls, &r->err);
    if (!rc && r->tls)
        rc = moe_sighup_start("moe-worker", r->tls, NULL, 0, &r->sighup, &r->err);
    return rc;
}

/* MPI (when under mpirun), the backend, and this rank's part of the model. */
static enum moe_status start_model(struct worker_run *r, int *argc, char ***argv)
{
    const struct args *a = &r->a;
    enum moe_status rc = moe_launch_start(argc, argv, &a->launch, &r->launch, &r->err);
    if (rc)
        return rc;
    r->group = r->launch.group;
    r->be = r->launch.be;
    struct moe_model_opts mo = r->launch.model_opts;
    if ((rc = moe_model_load(a->launch.model, &mo, r->be, &r->model, &r->err)))
        return rc;
    r->cfg = moe_model_config(r->model);
    if (r->cfg->n_mtp && (!r->group || r->group->rank == 0))
        fprintf(stderr,
                "moe-worker: %s: num_nextn_predict_layers %d: the multi-token-prediction "
                "layers are not used (ignored at load)\n",
                a->launch.model, r->cfg->n_mtp);
    return MOE_OK;
}

/* The KV data plane of a prefill or decode worker (nothing for mixed): every
 * rank moves its own heads. */
static enum moe_status start_kv_link(struct worker_run *r)
{
    const struct args *a = &r->a;
    if (!strcmp(a->role, "mixed"))
        return MOE_OK;
    struct moe_group *group = r->group;
    int world = group ? group->size : 1;
    char listen[300];
    if (a->kv_listen && (!group || group->size == 1)) {
        snprintf(listen, sizeof listen, "%s", a->kv_listen);
    } else {
        const char *src = a->kv_listen ? a->kv_listen : a->listen;
        snprintf(listen, sizeof listen, "%.*s:0", moe_hostport_host_len(src), src);
    }
    char adv_host[KV_LINK_ENDPOINT_MAX] = "";
    if (a->advertise) {
        snprintf(adv_host, sizeof adv_host, "%.*s", moe_hostport_host_len(a->advertise),
                 a->advertise);
    }
    struct kv_link_opts ko = {.be = r->be,
                              .listen = listen,
                              .advertise_host = adv_host[0] ? adv_host : NULL,
                              .layout = {.n_layer = r->cfg->n_layer,
                                         .n_kv_head = moe_config_kv_heads(r->cfg),
                                         .d_head = moe_config_kv_head_dim(r->cfg),
                                         .tp_size = group ? group->tp_size : 1,
                                         .tp_rank = group ? group->tp_rank : 0,
                                         .latent = r->cfg->mla},
                              .nccl = !a->kv_socket_only,
                              .tls = r->tls};
    if (!(r->kv_endpoints = calloc((size_t)world, KV_LINK_ENDPOINT_MAX)))
        return moe_error_set(&r->err, MOE_ERR_NOMEM, "out of memory");
    enum moe_status rc = kv_link_create(&ko, &r->kv_link, &r->err);
    if (rc)
        return rc;
    snprintf(r->kv_endpoints, KV_LINK_ENDPOINT_MAX, "%s", kv_link_endpoint(r->kv_link));
    return MOE_OK;
}

/* A follower rank: runs the leader's step plans until it stops the group. */
static enum moe_status follow_leader(struct worker_run *r)
{
    struct moe_group *group = r->group;
    fprintf(stderr, "moe-worker: rank %d of %d (tp %d/%d) following, %.1f MiB of weights\n",
            group->rank, group->size, group->tp_rank, group->tp_size,
            (double)moe_model_weight_bytes(r->model) / (1024.0 * 1024.0));
    /* A follower's life is the leader's: it drains on SIGTERM and then
     * stops the group, so a SIGTERM that mpirun forwards here is ignored. */
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    enum moe_status rc;
    if (r->kv_link) {
        if ((rc = moe_group_share_kv(group, r->model, 0, 0, kv_link_endpoint(r->kv_link),
                                     r->kv_endpoints, &r->follower_kv, &r->err)))
            return rc;
        kv_link_attach_kv(r->kv_link, r->follower_kv);
    }
    return moe_group_follow(group, r->model, &r->err);
}

/* The engine on the leader: the tokenizer (if the model has one), the KV
 * cache size, the metrics' step timer, and the KV cache shared with the
 * data plane. */
static enum moe_status start_engine(struct worker_run *r)
{
    const struct args *a = &r->a;
    struct moe_group *group = r->group;
    enum moe_status rc;
    char tok_path[4096];
    snprintf(tok_path, sizeof tok_path, "%s/tokenizer.json", a->launch.model);
    if (access(tok_path, F_OK) == 0 && (rc = moe_tokenizer_load(tok_path, &r->tok, &r->err)))
        return rc;

    r->eo = (struct moe_engine_opts){
        .forward = group ? moe_group_forward : NULL,
        .forward_ctx = group,
        .forward_ids = group && !group->dp, /* dp_forward gathers logits */
        .backend_sampling = r->be->device != MOE_DEVICE_CPU,
    };
    struct moe_engine_opts *eo = &r->eo;
    if ((rc = moe_engine_args_apply(&a->engine, r->model, &r->launch.model_opts, r->be,
                                    group ? group->dp_size : 1, eo, &r->draft, &r->err)))
        return rc;
    const char *name = strrchr(a->launch.model, '/');
    r->name = name && name[1] ? name + 1 : a->launch.model;
    if (a->metrics_listen) { /* times every step: the engine calls through it */
        if ((rc = worker_metrics_create(r->name, r->model, group, eo->forward, eo->forward_ctx,
                                        &r->metrics, &r->err)))
            return rc;
        eo->forward = worker_metrics_forward;
        eo->forward_ctx = r->metrics;
    }
    if ((rc = moe_engine_create(r->model, r->tok, eo, &r->engine, &r->err)))
        return rc;
    if (r->kv_link) {
        struct moe_kv_cache *none;
        /* every rank's cache: the whole pool, or with DP attention one part */
        int rank_blocks = group && group->dp ? eo->n_block / group->dp_size : eo->n_block;
        if (group && (rc = moe_group_share_kv(group, r->model, rank_blocks, eo->block_size,
                                              kv_link_endpoint(r->kv_link), r->kv_endpoints, &none,
                                              &r->err)))
            return rc;
        kv_link_attach_kv(r->kv_link, moe_engine_kv_cache(r->engine));
    }
    return MOE_OK;
}

/* The gRPC service and /metrics; fills in the address and the id the worker
 * goes by. */
static enum moe_status start_service(struct worker_run *r)
{
    const struct args *a = &r->a;
    struct moe_group *group = r->group;
    struct worker_service_opts so = {
        .listen = a->listen,
        .model_name = r->name,
        .dtype_name = moe_launch_dtype_flag(a->launch.dtype),
        .world_size = group ? group->size : 1,
        .group = group,
        .tp_size = group ? group->tp_size : 1,
        .role = !strcmp(a->role, "prefill")  ? MOE__V1__WORKER_ROLE__WORKER_ROLE_PREFILL
                : !strcmp(a->role, "decode") ? MOE__V1__WORKER_ROLE__WORKER_ROLE_DECODE
                                             : MOE__V1__WORKER_ROLE__WORKER_ROLE_MIXED,
        .be = r->be,
        .kv_link = r->kv_link,
        .kv_endpoints = r->kv_endpoints,
        .handoff_ttl_ms = a->handoff_ttl_ms,
        .tls = r->tls,
    };
    enum moe_status rc = worker_service_create(r->engine, r->model, r->tok, &so, &r->ws, &r->err);
    if (rc)
        return rc;
    if (r->metrics && (rc = worker_metrics_serve(r->metrics, a->metrics_listen, r->engine, r->ws,
                                                 r->tls, &r->err)))
        return rc;
    int port = worker_service_port(r->ws);

    if (a->advertise) {
        snprintf(r->address, sizeof r->address, "%s", a->advertise);
    } else {
        snprintf(r->address, sizeof r->address, "%.*s:%d", moe_hostport_host_len(a->listen),
                 a->listen, port);
    }
    snprintf(r->id, sizeof r->id, "%s", a->worker_id ? a->worker_id : "");
    if (!r->id[0])
        snprintf(r->id, sizeof r->id, "worker-%d", port);
    return MOE_OK;
}

/* With --etcd: registers the worker under a lease kept alive by ticks. */
static enum moe_status start_registration(struct worker_run *r)
{
    const struct args *a = &r->a;
    if (!a->etcd)
        return MOE_OK;
    struct worker_registration_opts ro = {.endpoints = a->etcd,
                                          .lease_ttl_s = a->lease_ttl,
                                          .id = r->id,
                                          .address = r->address,
                                          .role = a->role,
                                          .device = r->be->name,
                                          .model_name = r->name,
                                          .kv_blocks_total = r->eo.n_block,
                                          .block_size = r->eo.block_size,
                                          .group = r->group,
                                          .cfg = r->cfg};
    return worker_registration_create(&ro, &r->reg, &r->err);
}

/* The line that says the worker serves (tests and scripts wait for it). */
static void announce(const struct worker_run *r)
{
    const struct args *a = &r->a;
    const struct moe_group *group = r->group;
    char dev[24]; /* "cpu", "cuda:1": the GPU is named in full on stderr under mpirun */
    if (r->be->device == MOE_DEVICE_CUDA)
        snprintf(dev, sizeof dev, "cuda:%d", r->be->ordinal);
    else
        snprintf(dev, sizeof dev, "%s", r->be->name);
    printf("moe-worker: %s serving %s on %s (%s, %s, %d KV blocks x %d tokens of %s, %d rank%s, "
           "tp %d%s%s, pid %d)%s%s\n",
           r->id, r->name, r->address, a->role, dev, r->eo.n_block, r->eo.block_size,
           moe_kv_dtype_flag(moe_model_kv_dtype(r->model)), group ? group->size : 1,
           group && group->size > 1 ? "s" : "", group ? group->tp_size : 1,
           group && group->dp ? ", dp attention" : "",
           r->launch.model_opts.batch_invariant ? ", batch-invariant" : "", (int)getpid(),
           a->etcd ? ", registered in etcd" : "",
           r->tls ? (moe_tls_has_ca(r->tls) ? ", mutual TLS" : ", TLS") : "");
    if (r->metrics) {
        printf("moe-worker: /metrics on %.*s:%d\n", moe_hostport_host_len(a->metrics_listen),
               a->metrics_listen, worker_metrics_port(r->metrics));
    }
    fflush(stdout);
}

/* Serves, keeping the registration alive, until SIGTERM or SIGINT. */
static void serve_until_signal(struct worker_run *r)
{
    while (!moe_stop_signal()) {
        usleep(100 * 1000);
        worker_registration_tick(r->reg);
    }
}

/* Drain: stop taking work, let running requests finish (for at most
 * --drain-timeout), then leave. */
static void drain(struct worker_run *r)
{
    fprintf(stderr, "moe-worker: %s: draining (%d requests in flight)\n", moe_stop_signal_name(),
            worker_service_in_flight(r->ws));
    worker_service_drain(r->ws);
    worker_registration_leave(r->reg);
    double t0 = moe_now();
    while (worker_service_in_flight(r->ws) > 0 && moe_now() - t0 < r->a.drain_timeout_s)
        usleep(20 * 1000);
    int left = worker_service_in_flight(r->ws);
    if (left)
        fprintf(stderr, "moe-worker: drain timeout: cancelling %d requests\n", left);
}

/* Stops and frees whatever start_* built, in the reverse order. */
static void worker_run_close(struct worker_run *r)
{
    worker_registration_destroy(r->reg); /* stops following the placement, leaves etcd */
    worker_metrics_destroy(r->metrics);  /* reads the service and the engine */
    worker_service_destroy(r->ws, 1000); /* joins the engine thread: MPI is ours again */
    if (r->group && r->group->rank == 0) {
        struct moe_error stop_err;
        if (moe_group_stop(r->group, &stop_err))
            fprintf(stderr, "moe-worker: stopping the group: %s\n", stop_err.msg);
    }
    kv_link_destroy(r->kv_link); /* before the cache it writes into goes */
    free(r->kv_endpoints);
    moe_kv_cache_free(r->model, r->follower_kv);
    moe_engine_destroy(r->engine);
    moe_model_free(r->draft);
    moe_tokenizer_free(r->tok);
    moe_model_free(r->model);
    moe_launch_finish(&r->launch);
    moe_sighup_stop(r->sighup);
    moe_tls_destroy(r->tls);
}

int main(int argc, char **argv)
{
    cli_init("moe-worker");
    struct worker_run run = {0}, *r = &run;
    int rc = parse_args(argc, argv, &r->a);
    if (rc)
        return rc;
    signal(SIGPIPE, SIG_IGN);
    if (start_tls(r)) {
        fprintf(stderr, "moe-worker: %s\n", r->err.msg);
        moe_tls_destroy(r->tls);
        return 2;
    }

    rc = 1;
    if (start_model(r, &argc, &argv) || start_kv_link(r))
        goto fail;
    if (r->group && r->group->rank != 0) {
        if (follow_leader(r))
            goto fail;
        rc = 0;
        goto out;
    }
    if (start_engine(r) || start_service(r) || start_registration(r))
        goto fail;
    moe_stop_signal_install();
    announce(r);
    serve_until_signal(r);
    drain(r);
    rc = 0;
    goto out;

fail:
    fprintf(stderr, "moe-worker: %s\n", r->err.msg);
out:
    worker_run_close(r);
    return rc;
}
