/* moe-coordinator: the public front of the cluster. Serves moe.v1.Inference,
 * moe.v1.Admin and grpc.health.v1.Health, and forwards each Generate to a
 * worker chosen by load and prefix affinity. Workers come from a static
 * --workers list (the embedded default) or from etcd (--etcd).
 *
 *   moe-coordinator --model DIR [--listen HOST:PORT]
 *                   (--workers HOST:PORT,... | --etcd URLS)
 *                   [--max-queue N] [--poll-ms MS] [--threads N] [--grace-ms MS]
 *                   [--expert-slots N] [--stall-timeout-ms MS]
 *                   [--http-listen HOST:PORT [--chat-template FILE]
 *                   --http-threads N --http-max-body BYTES --http-timeout S]
 *                   [--tls-cert F --tls-key F [--tls-ca F] ...] [--api-token-file F]
 *                   [--admin-token-file F] [--etcd-cacert F --etcd-cert F --etcd-key F]
 *
 * --http-listen adds the OpenAI-compatible HTTP API (/v1/completions,
 * /v1/chat/completions, /v1/models, /tokenize, /detokenize, /health,
 * /version) and Prometheus /metrics on that address (off unless given).
 *
 * Security (README "Security"): --tls-* serve TLS on the gRPC and HTTP ports
 * and open the channels to workers over (mutual) TLS; --api-token-file
 * guards Inference and the HTTP API, --admin-token-file guards Admin; health
 * probes stay open. SIGHUP re-reads the certificates and the token files.
 *
 * On SIGTERM or SIGINT: health NOT_SERVING, no new calls, running streams
 * get --grace-ms to finish (then they are cancelled), exit 0. */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "auth_token.h"
#include "cli.h"
#include "hostport.h"
#include "coord.h"
#include "clock.h"
#include "etcd.h"
#include "sighup.h"
#include "stop_signal.h"
#include "tls_opts.h"
#include "request_check.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: moe-coordinator --model DIR (--workers HOST:PORT,... | --etcd URLS) "
               "[options]\n"
               "  --listen HOST:PORT  gRPC address (default 127.0.0.1:50051; port 0 = a free "
               "one)\n"
               "  --model DIR         model directory: config.json and tokenizer.json (no "
               "weights are loaded)\n"
               "  --workers LIST      static worker list host:port,host:port\n"
               "  --etcd URLS         etcd endpoints; workers are learned from /moe/workers/\n"
               "  --max-queue N       requests in flight before RESOURCE_EXHAUSTED (default "
               "256)\n"
               "  --poll-ms MS        worker load polling interval (default 200)\n"
               "  --threads N         gRPC server threads (default 2)\n"
               "  --grace-ms MS       on SIGTERM, time given to running streams (default "
               "10000)\n"
               "  --expert-slots N    experts a rank may hold per layer, for placement plans "
               "(default 2 x experts / ranks)\n"
               "  --stall-timeout-ms MS  end a worker stream that brought nothing for MS while "
               "its worker\n"
               "                      made no progress (before the first token: retried "
               "elsewhere); 0 = off\n"
               "                      (default 30000)\n"
               "  --http-listen HOST:PORT  OpenAI-compatible HTTP API and /metrics (default: "
               "off; port 0 = a free one)\n"
               "  --chat-template FILE     Jinja chat template (default: the checkpoint's)\n"
               "  --http-threads N    HTTP polling threads (default 2)\n"
               "  --http-max-body B   largest HTTP request body in bytes, else 413 (default: "
               "the largest\n"
               "                      valid request, 2 MiB + 64 KiB for a 1 MiB prompt)\n"
               "  --http-timeout S    close idle HTTP connections after S seconds (default "
               "60)\n");
    fputs(
        "  --api-token-file F  bearer tokens (one per line) for Inference and the HTTP API\n"
        "  --admin-token-file F  bearer tokens for Admin (moectl); health stays open\n"
        "TLS (one setting for the gRPC and HTTP ports and the channels to workers):\n" MOE_TLS_USAGE
        "etcd over TLS:\n" MOE_ETCD_TLS_USAGE,
        f);
}

/* Paths of the security flags (loaded in main). */
struct sec_args {
    struct moe_tls_opts tls;
    struct moe_etcd_tls etcd_tls;
    const char *api_token_file, *admin_token_file;
};

static int parse_args(int argc, char **argv, struct coord_opts *o, struct sec_args *sec)
{
    *o = (struct coord_opts){.listen = "127.0.0.1:50051",
                             .max_queue = 256,
                             .poll_ms = 200,
                             .rpc_threads = 2,
                             .grace_ms = 10000,
                             .stall_timeout_ms = 30000,
                             .http_threads = 2,
                             .http_max_body = 0, /* derived from the model */
                             .http_timeout_s = 60};
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        if (!strcmp(k, "-h") || !strcmp(k, "--help")) {
            usage(stdout);
            exit(0);
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
        o->field = (int)n;                                                                         \
        continue;                                                                                  \
    }
        INT_OPT("--max-queue", 1, 1 << 20, max_queue)
        INT_OPT("--poll-ms", 10, 60000, poll_ms)
        INT_OPT("--threads", 1, 64, rpc_threads)
        INT_OPT("--grace-ms", 0, 3600000, grace_ms)
        INT_OPT("--expert-slots", 0, 32767, expert_slots)
        INT_OPT("--stall-timeout-ms", 0, 3600000, stall_timeout_ms)
        INT_OPT("--http-threads", 1, 64, http_threads)
        INT_OPT("--http-timeout", 1, 86400, http_timeout_s)
        if (!strcmp(k, "--http-max-body")) {
            if (!cli_parse_long(v, 1024, 1L << 30, &n))
                return cli_fail("--http-max-body: '%s' is not a whole number in [1024, %ld]", v,
                                1L << 30);
            o->http_max_body = (size_t)n;
            continue;
        }
#undef INT_OPT
        if (moe_tls_cli_flag(&sec->tls, k, v) || moe_etcd_tls_cli_flag(&sec->etcd_tls, k, v))
            continue;
        if (!strcmp(k, "--api-token-file"))
            sec->api_token_file = v;
        else if (!strcmp(k, "--admin-token-file"))
            sec->admin_token_file = v;
        else if (!strcmp(k, "--listen"))
            o->listen = v;
        else if (!strcmp(k, "--model"))
            o->model_dir = v;
        else if (!strcmp(k, "--workers"))
            o->workers = v;
        else if (!strcmp(k, "--etcd"))
            o->etcd = v;
        else if (!strcmp(k, "--http-listen"))
            o->http_listen = v;
        else if (!strcmp(k, "--chat-template"))
            o->chat_template = v;
        else {
            usage(stderr);
            return cli_fail("unknown option '%s'", k);
        }
    }
    if (!o->model_dir)
        return cli_fail("--model DIR is required (for config.json and tokenizer.json)");
    if (!o->workers == !o->etcd)
        return cli_fail("give exactly one of --workers HOST:PORT,... and --etcd URLS");
    if (o->chat_template && !o->http_listen)
        return cli_fail("--chat-template: only used by the HTTP API (give --http-listen)");
    int rc = cli_check_hostport("--listen", o->listen);
    return rc ? rc : cli_check_hostport("--http-listen", o->http_listen);
}

/* TLS for the ports and etcd, and the bearer tokens. */
static enum moe_status start_security(struct coord *c, struct sec_args *sec, struct moe_error *err)
{
    enum moe_status rc;
    if ((rc = moe_etcd_set_tls(&sec->etcd_tls, err)) ||
        (rc = moe_tls_create(&sec->tls, &c->opts.tls, err)))
        return rc;
    if (sec->api_token_file &&
        (rc = moe_tokens_load("--api-token-file", sec->api_token_file, &c->opts.api_tokens, err)))
        return rc;
    if (sec->admin_token_file && (rc = moe_tokens_load("--admin-token-file", sec->admin_token_file,
                                                       &c->opts.admin_tokens, err)))
        return rc;
    return MOE_OK;
}

/* The model's config.json, its tokenizer.json when there is one, and the
 * served model's name: the model directory's last component, as the workers
 * report it. */
static enum moe_status load_model_files(struct coord *c, struct moe_error *err)
{
    enum moe_status rc;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", c->opts.model_dir);
    if ((rc = moe_config_load(path, &c->cfg, err)))
        return rc;
    snprintf(path, sizeof path, "%s/tokenizer.json", c->opts.model_dir);
    if (access(path, F_OK) == 0) {
        if ((rc = moe_tokenizer_load(path, &c->tok, err)))
            return rc;
    } else {
        fprintf(stderr, "moe-coordinator: no %s: only token_ids prompts are accepted\n", path);
    }
    const char *dir = c->opts.model_dir;
    size_t dl = strlen(dir);
    while (dl > 1 && dir[dl - 1] == '/')
        dl--;
    const char *base = dir + dl;
    while (base > dir && base[-1] != '/')
        base--;
    snprintf(c->model_name, sizeof c->model_name, "%.*s", (int)(dir + dl - base), base);
    return MOE_OK;
}

/* The workers (a static list or etcd), their poller and the stall
 * watchdog. */
static enum moe_status start_workers(struct coord *c, struct moe_error *err)
{
    c->affinity = calloc(COORD_AFFINITY_SLOTS, sizeof *c->affinity);
    c->metrics = coord_metrics_create(c);
    if (!c->affinity || !c->metrics)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    enum moe_status rc = c->opts.workers ? coord_registry_add_static(c, c->opts.workers, err)
                                         : coord_registry_start_etcd(c, err);
    if (!rc)
        rc = coord_registry_start_poller(c, err);
    if (!rc)
        rc = coord_watchdog_start(c, err);
    return rc;
}

/* The gRPC server (Inference, Admin, the placement service, health) with
 * its receive limit and tokens, and the HTTP front door; both SERVING. */
static enum moe_status start_servers(struct coord *c, struct moe_error *err)
{
    /* No valid request is larger than a prompt at its limit (or a placement
     * map of this model): bigger messages are refused before decoding. */
    size_t max_rq = moe_request_max_bytes((unsigned)c->cfg.max_pos);
    size_t max_pl = ((size_t)64 << 10) + (size_t)256 * (c->cfg.n_layer + 1) * c->cfg.n_expert;
    struct rpc_server_options so = {.tls = c->opts.tls,
                                    .max_receive_bytes = max_rq > max_pl ? max_rq : max_pl};
    if (!c->opts.http_max_body)
        c->opts.http_max_body = moe_http_body_max_bytes((unsigned)c->cfg.max_pos);
    c->server = rpc_server_create(c->opts.listen, c->opts.rpc_threads, &so, err);
    if (!c->server) /* err filled, and never MOE_OK here */
        return err->code != MOE_OK ? err->code : MOE_ERR_INTERNAL;
    enum moe_status rc;
    if ((c->opts.api_tokens && (rc = rpc_server_require_token(c->server, "/moe.v1.Inference/",
                                                              c->opts.api_tokens, err))) ||
        (c->opts.admin_tokens &&
         (rc = rpc_server_require_token(c->server, "/moe.v1.Admin/", c->opts.admin_tokens, err))) ||
        (rc = coord_frontend_register(c, err)) || (rc = coord_admin_register(c, err)) ||
        (rc = coord_placement_start(c, err)) || (rc = rpc_server_start(c->server, err)))
        return rc;
    if (c->opts.http_listen && (rc = coord_http_start(c, err)))
        return rc;
    rpc_health_set(c->server, "moe.v1.Inference", RPC_HEALTH_SERVING);
    rpc_health_set(c->server, "moe.v1.Admin", RPC_HEALTH_SERVING);
    return MOE_OK;
}

/* The line that says the coordinator serves (tests and scripts wait for
 * it). */
static void announce(struct coord *c)
{
    int host_len = moe_hostport_host_len(c->opts.listen);
    pthread_mutex_lock(&c->mu);
    size_t n_workers = c->n_workers;
    pthread_mutex_unlock(&c->mu);
    printf("moe-coordinator: serving on %.*s:%d (model %s, %zu workers %s%s%s%s)\n", host_len,
           c->opts.listen, rpc_server_port(c->server), c->model_name, n_workers,
           c->opts.etcd ? "from etcd" : "listed", c->opts.tls ? ", TLS" : "",
           c->opts.api_tokens ? ", API tokens" : "", c->opts.admin_tokens ? ", admin tokens" : "");
    if (c->http) {
        printf("moe-coordinator: OpenAI HTTP API and /metrics on %.*s:%d\n",
               moe_hostport_host_len(c->opts.http_listen), c->opts.http_listen, coord_http_port(c));
    }
    fflush(stdout);
}

/* After SIGTERM or SIGINT: no new HTTP connections, every health status
 * NOT_SERVING; running requests get the grace period (coord_close). */
static void begin_shutdown(struct coord *c)
{
    pthread_mutex_lock(&c->mu);
    int running = c->n_running;
    pthread_mutex_unlock(&c->mu);
    fprintf(stderr, "moe-coordinator: %s: shutting down (%d requests in flight, grace %d ms)\n",
            moe_stop_signal_name(), running, c->opts.grace_ms);
    coord_http_quiesce(c);
    rpc_health_set(c->server, "", RPC_HEALTH_NOT_SERVING);
    rpc_health_set(c->server, "moe.v1.Inference", RPC_HEALTH_NOT_SERVING);
    rpc_health_set(c->server, "moe.v1.Admin", RPC_HEALTH_NOT_SERVING);
}

/* Stops and frees everything, whatever step main reached. */
static void coord_close(struct coord *c, struct moe_sighup *sighup)
{
    /* Waits for every stream (cancelled after the grace period); the
     * forwarding threads then end on their own. */
    double t_stop = moe_now();
    rpc_server_destroy(c->server, c->opts.grace_ms);
    /* HTTP requests had the same grace, running alongside the gRPC ones. */
    int left_ms = c->opts.grace_ms - (int)(1e3 * (moe_now() - t_stop));
    coord_http_stop(c, left_ms > 0 ? left_ms : 0);
    coord_wait_threads(c);
    coord_watchdog_stop(c);
    coord_placement_stop(c);
    coord_registry_stop(c);
    free(c->workers);
    free(c->affinity);
    coord_metrics_destroy(c->metrics);
    moe_tokenizer_free(c->tok);
    moe_sighup_stop(sighup);
    moe_tokens_destroy(c->opts.api_tokens);
    moe_tokens_destroy(c->opts.admin_tokens);
    moe_tls_destroy(c->opts.tls);
    pthread_cond_destroy(&c->cond);
    pthread_mutex_destroy(&c->mu);
}

int main(int argc, char **argv)
{
    cli_init("moe-coordinator");
    struct coord c;
    memset(&c, 0, sizeof c);
    struct sec_args sec = {0};
    int rc = parse_args(argc, argv, &c.opts, &sec);
    if (rc)
        return rc;
    signal(SIGPIPE, SIG_IGN);
    struct moe_error err = {0};
    struct moe_sighup *sighup = NULL;
    if (start_security(&c, &sec, &err)) {
        fprintf(stderr, "moe-coordinator: %s\n", err.msg);
        moe_tls_destroy(c.opts.tls);
        moe_tokens_destroy(c.opts.api_tokens);
        return 2;
    }
    c.t_start = moe_now();
    pthread_mutex_init(&c.mu, NULL);
    pthread_cond_init(&c.cond, NULL);
    rc = 1;
    if (load_model_files(&c, &err) || start_workers(&c, &err) || start_servers(&c, &err))
        goto fail;

    moe_stop_signal_install();
    struct moe_tokens *reloadable[] = {c.opts.api_tokens, c.opts.admin_tokens};
    if ((c.opts.tls || c.opts.api_tokens || c.opts.admin_tokens) &&
        moe_sighup_start("moe-coordinator", c.opts.tls, reloadable, 2, &sighup, &err))
        goto fail;
    announce(&c);
    while (!moe_stop_signal())
        usleep(100 * 1000);
    begin_shutdown(&c);
    rc = 0;
    goto out;

fail:
    fprintf(stderr, "moe-coordinator: %s\n", err.msg);
out:
    coord_close(&c, sighup);
    return rc;
}
