/* Fault tests with real processes on loopback (issue 14): each mode starts
 * its own workers and coordinators, injects one fault and checks that the
 * cluster survives it or reports it truthfully. Every wait is for a
 * condition; time limits only stop a hang (and an alarm bounds the run).
 *
 *   test_faults etcd_restart BIN_DIR   etcd SIGKILLed and restarted on its data dir:
 *                                      requests go on meanwhile, the workers register
 *                                      again (skipped, 77, without etcd)
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cluster.h"
#include "moe/v1/admin.pb-c.h"
#include "moe/v1/inference.pb-c.h"
#include "moe/v1/worker.pb-c.h"
#include "proc.h"
#include "rpc.h"
#include "rpcutil.h"
#include "testlib.h"

static const char *g_bin;
static char g_tmp[512];
static char g_model[600]; /* the fixture with a 4096-token context */

/* ---- processes ---------------------------------------------------------------------- */

struct srv {
    pid_t pid;
    char name[64];
    char addr[128];
    char log[700]; /* its stderr */
    struct rpc_client *cl;
};

/* Starts argv (NULL-ended; argv[0] the binary) with its stderr in
 * g_tmp/NAME.log; waits for the " on HOST:PORT" line. */
static inline int srv_spawn(struct srv *s, const char *name, char *const argv[], char *const env[])
{
    memset(s, 0, sizeof *s);
    snprintf(s->name, sizeof s->name, "%s", name);
    snprintf(s->log, sizeof s->log, "%s/%s.log", g_tmp, name);
    int fd;
    struct moe_error err;
    s->pid = child_spawn_logged(argv, env, &fd, s->log);
    if (s->pid < 0 || read_address(fd, s->addr, sizeof s->addr, 30000) ||
        !(s->cl = rpc_client_create(s->addr, NULL, &err))) {
        fprintf(stderr, "%s did not start (log %s)\n", name, s->log);
        return -1;
    }
    return 0;
}

#define MAX_ARGS 48

/* argv = prefix (NULL-ended, may be NULL) + binary + fixed + extra (NULL-ended). */
static inline int srv_start(struct srv *s, const char *name, const char *const prefix[],
                            const char *bin, const char *const fixed[], const char *const extra[],
                            char *const env[])
{
    char path[700];
    snprintf(path, sizeof path, "%s/%s", g_bin, bin);
    char *argv[MAX_ARGS];
    int n = 0;
    for (int i = 0; prefix && prefix[i]; i++)
        argv[n++] = (char *)prefix[i];
    argv[n++] = path;
    for (int i = 0; fixed && fixed[i]; i++)
        argv[n++] = (char *)fixed[i];
    for (int i = 0; extra && extra[i] && n < MAX_ARGS - 1; i++)
        argv[n++] = (char *)extra[i];
    argv[n] = NULL;
    return srv_spawn(s, name, argv, env);
}

static inline int worker_start(struct srv *s, const char *name, const char *const extra[],
                               char *const env[])
{
    const char *fixed[] = {"--model", g_model, "--dtype", "f32", "--threads", "1", NULL};
    const char *listen[] = {"--listen", "127.0.0.1:0", NULL};
    const char *args[MAX_ARGS];
    int n = 0;
    bool has_listen = false;
    for (int i = 0; extra && extra[i]; i++)
        has_listen |= !strcmp(extra[i], "--listen");
    for (int i = 0; !has_listen && listen[i]; i++)
        args[n++] = listen[i];
    for (int i = 0; extra && extra[i] && n < MAX_ARGS - 1; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    return srv_start(s, name, NULL, "moe-worker", fixed, args, env);
}

static inline int coord_start(struct srv *s, const char *name, const char *const extra[])
{
    const char *fixed[] = {"--model",    g_model, "--listen", "127.0.0.1:0",
                           "--grace-ms", "5000",  NULL};
    return srv_start(s, name, NULL, "moe-coordinator", fixed, extra, NULL);
}

static inline void srv_kill(struct srv *s)
{
    if (s->pid > 0)
        child_kill9(s->pid);
    s->pid = 0;
    rpc_client_destroy(s->cl);
    s->cl = NULL;
}

/* SIGTERM and wait: true if it exited 0. */
static inline bool srv_stop(struct srv *s)
{
    if (s->pid <= 0)
        return true;
    kill(s->pid, SIGTERM);
    int st = child_wait(s->pid, 60000);
    s->pid = 0;
    rpc_client_destroy(s->cl);
    s->cl = NULL;
    return st == 0;
}

/* ---- requests ---------------------------------------------------------------------- */

#define GEN_MAX_IDS 4096

struct gen {
    /* in */
    struct rpc_client *cl;
    uint32_t prompt[512];
    size_t n_prompt;
    uint32_t max_tokens;
    uint32_t deadline_ms;
    /* out */
    enum rpc_code code;
    char message[512];
    uint32_t ids[GEN_MAX_IDS];
    size_t n_ids;
    int finish;
    double transfer_ms;
    int64_t wall_ms;
    atomic_int n_seen; /* tokens so far, readable while it runs */
    pthread_t th;
};

static inline void gen_prompt(struct gen *g, int k, size_t len)
{
    for (size_t i = 0; i < len; i++)
        g->prompt[i] = (uint32_t)((i * 31 + (size_t)k * 97 + 5) % 790);
    g->n_prompt = len;
}

/* One greedy Generate by token ids (ignore_eos): fills the out fields. */
static inline void gen_run(struct gen *g)
{
    int64_t t0 = moe_now_ms();
    g->code = RPC_UNKNOWN;
    g->n_ids = 0;
    g->finish = 0;
    g->message[0] = '\0';
    atomic_store(&g->n_seen, 0);
    Moe__V1__GenerateRequest rq = MOE__V1__GENERATE_REQUEST__INIT;
    Moe__V1__TokenIds tids = MOE__V1__TOKEN_IDS__INIT;
    Moe__V1__SamplingParams sp = MOE__V1__SAMPLING_PARAMS__INIT;
    sp.max_tokens = g->max_tokens;
    sp.ignore_eos = true;
    tids.n_ids = g->n_prompt;
    tids.ids = g->prompt;
    rq.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS;
    rq.token_ids = &tids;
    rq.sampling = &sp;
    rq.deadline_ms = g->deadline_ms;
    size_t len;
    void *b = pack(&rq, &len);
    struct moe_error err = {0};
    struct rpc_client_stream *s =
        rpc_client_stream_start(g->cl, "/moe.v1.Inference/Generate", b, len, 120000, &err);
    free(b);
    if (!s) {
        g->code = RPC_INTERNAL;
        snprintf(g->message, sizeof g->message, "%.500s", err.msg);
        return;
    }
    const uint8_t *data;
    size_t n;
    while (rpc_client_stream_next(s, &data, &n)) {
        Moe__V1__GenerateResponse *m = moe__v1__generate_response__unpack(NULL, n, data);
        if (!m)
            break;
        for (size_t i = 0; i < m->n_token_ids && g->n_ids < GEN_MAX_IDS; i++)
            g->ids[g->n_ids++] = m->token_ids[i];
        atomic_store(&g->n_seen, (int)g->n_ids);
        if (m->finish_reason) {
            g->finish = m->finish_reason;
            if (m->timings)
                g->transfer_ms = m->timings->transfer_ms;
        }
        moe__v1__generate_response__free_unpacked(m, NULL);
    }
    const char *msg;
    g->code = rpc_client_stream_status(s, &msg);
    snprintf(g->message, sizeof g->message, "%s", msg ? msg : "");
    rpc_client_stream_destroy(s);
    g->wall_ms = moe_now_ms() - t0;
}

static inline void *gen_thread(void *p)
{
    gen_run(p);
    return NULL;
}

static inline void gen_start(struct gen *g)
{
    atomic_store(&g->n_seen, 0);
    g->code = RPC_UNKNOWN;
    pthread_create(&g->th, NULL, gen_thread, g);
}

static inline struct gen *gen_new(struct rpc_client *cl, int k, size_t len, uint32_t max_tokens)
{
    struct gen *g = calloc(1, sizeof *g);
    g->cl = cl;
    gen_prompt(g, k, len);
    g->max_tokens = max_tokens;
    return g;
}

/* Completed with max_tokens tokens (and, when want is given, those ids). */
static inline bool gen_ok(const struct gen *g, const struct gen *want)
{
    return g->code == RPC_OK && g->n_ids == g->max_tokens &&
           g->finish == MOE__V1__FINISH_REASON__FINISH_REASON_LENGTH &&
           (!want || (want->n_ids == g->n_ids && !memcmp(want->ids, g->ids, g->n_ids * 4)));
}

static inline bool short_ok(struct rpc_client *cl, int k)
{
    struct gen *g = gen_new(cl, k, 6, 4);
    g->deadline_ms = 20000;
    gen_run(g);
    bool ok = gen_ok(g, NULL);
    if (!ok)
        fprintf(stderr, "short request: %s %s (%zu tokens)\n", rpc_code_name(g->code), g->message,
                g->n_ids);
    free(g);
    return ok;
}

static inline Moe__V1__WorkerLoad *load_of(struct srv *w)
{
    return get_load(w->cl);
}

/* Waits until worker w holds no KV block, no handoff and no request. */
static inline bool wait_idle_pool(struct srv *w, int timeout_ms)
{
    uint32_t used = 0, pend = 0, run = 0;
    for (int64_t t0 = moe_now_ms(); moe_now_ms() - t0 < timeout_ms; sleep_ms(50)) {
        Moe__V1__WorkerLoad *l = load_of(w);
        if (!l)
            continue;
        used = l->kv_blocks_used;
        pend = l->handoffs_pending;
        run = l->running + l->waiting;
        moe__v1__worker_load__free_unpacked(l, NULL);
        if (!used && !pend && !run)
            return true;
    }
    fprintf(stderr, "%s: %u KV blocks used, %u handoffs pending, %u requests\n", w->name, used,
            pend, run);
    return false;
}

/* Requests running or waiting on worker w (-1: no answer). */
static inline int busy_of(struct srv *w)
{
    Moe__V1__WorkerLoad *l = load_of(w);
    if (!l)
        return -1;
    int n = (int)(l->running + l->waiting);
    moe__v1__worker_load__free_unpacked(l, NULL);
    return n;
}

/* ---- etcd killed and restarted ------------------------------------------------------- */

/* Both workers' keys are in etcd under leases none of which is in old[]. */
static bool registered_anew(const char *url, const char *a, const char *b, const int64_t *old,
                            size_t n_old)
{
    struct moe_etcd *ec = NULL;
    struct moe_error err;
    struct moe_etcd_kvs kvs = {0};
    bool fa = false, fb = false;
    if (moe_etcd_create(url, 500, &ec, &err) == MOE_OK &&
        moe_etcd_get_prefix(ec, "/moe/workers/", &kvs, &err) == MOE_OK) {
        for (size_t i = 0; i < kvs.n; i++) {
            bool fresh = kvs.kvs[i].lease != 0;
            for (size_t k = 0; k < n_old; k++)
                fresh &= kvs.kvs[i].lease != old[k];
            const char *id = kvs.kvs[i].key + strlen("/moe/workers/");
            fa |= fresh && !strcmp(id, a);
            fb |= fresh && !strcmp(id, b);
        }
    }
    moe_etcd_kvs_clear(&kvs);
    moe_etcd_destroy(ec);
    return fa && fb;
}

static int run_etcd_restart(void)
{
    static struct test_etcd etcd;
    if (!find_etcd(etcd.bin, sizeof etcd.bin)) {
        printf("SKIPPED: no etcd binary (set MOE_ETCD_BIN or install etcd-server)\n");
        return TEST_SKIP_CODE;
    }
    if (test_etcd_start(&etcd, g_tmp)) {
        CHECKF(0, "etcd did not start (log %s)", etcd.log);
        return 1;
    }
    struct srv w[2], co;
    const char *wa[] = {"--etcd", etcd.client, "--lease-ttl", "2", "--worker-id", "fa", NULL};
    const char *wb[] = {"--etcd", etcd.client, "--lease-ttl", "2", "--worker-id", "fb", NULL};
    const char *ca[] = {"--etcd", etcd.client, "--poll-ms", "100", NULL};
    if (worker_start(&w[0], "worker-fa", wa, NULL) || worker_start(&w[1], "worker-fb", wb, NULL) ||
        coord_start(&co, "coordinator", ca))
        return 1;
    const int serving = MOE__V1__WORKER_STATE__WORKER_STATE_SERVING;
    CHECK(wait_worker_state(co.cl, "fa", serving, 30000) &&
          wait_worker_state(co.cl, "fb", serving, 30000));
    CHECK(short_ok(co.cl, 1));

    /* The leases now: after the restart they are revoked, so that a worker
     * that never registers again surely disappears. */
    int64_t old[8];
    size_t n_old = 0;
    {
        struct moe_etcd *ec = NULL;
        struct moe_error err;
        struct moe_etcd_kvs kvs = {0};
        if (moe_etcd_create(etcd.client, 1000, &ec, &err) == MOE_OK &&
            moe_etcd_get_prefix(ec, "/moe/workers/", &kvs, &err) == MOE_OK)
            for (size_t i = 0; i < kvs.n && n_old < 8; i++)
                old[n_old++] = kvs.kvs[i].lease;
        moe_etcd_kvs_clear(&kvs);
        moe_etcd_destroy(ec);
    }
    CHECKF(n_old == 2, "%zu registrations in etcd", n_old);

    /* etcd down until both workers have given their leases up (TTL 2 s
     * without a keepalive); requests go on meanwhile on the cached view. */
    int64_t t_kill = moe_now_ms();
    test_etcd_kill(&etcd);
    int n_ok = 0, n_bad = 0;
    bool lost = false, listed = true;
    while (!lost && moe_now_ms() - t_kill < 30000) {
        if (short_ok(co.cl, 2 + n_ok))
            n_ok++;
        else
            n_bad++;
        sleep_ms(20);
        listed &= worker_state(co.cl, "fa") == serving && worker_state(co.cl, "fb") == serving;
        lost = file_contains(w[0].log, "lost; registering again") &&
               file_contains(w[1].log, "lost; registering again");
    }
    printf("etcd down: both leases lost after %" PRId64 " ms; %d requests OK, %d failed\n",
           moe_now_ms() - t_kill, n_ok, n_bad);
    CHECKF(lost, "the workers never reported the lost lease (logs %s, %s)", w[0].log, w[1].log);
    CHECKF(n_ok >= 1 && n_bad == 0, "while etcd was down: %d requests OK, %d failed", n_ok, n_bad);
    CHECKF(listed, "the coordinator stopped listing a worker as SERVING while etcd was down");

    /* Back on the same data directory; the old leases are revoked. */
    int64_t t_up = moe_now_ms();
    if (test_etcd_start(&etcd, g_tmp)) {
        CHECKF(0, "etcd did not start again (log %s)", etcd.log);
        return 1;
    }
    {
        struct moe_etcd *ec = NULL;
        struct moe_error err;
        if (moe_etcd_create(etcd.client, 1000, &ec, &err) == MOE_OK)
            for (size_t i = 0; i < n_old; i++)
                moe_etcd_lease_revoke(ec, old[i], &err); /* NOT_FOUND: already replaced */
        moe_etcd_destroy(ec);
    }
    bool back = false;
    while (!back && moe_now_ms() - t_up < 20000) {
        back = registered_anew(etcd.client, "fa", "fb", old, n_old) &&
               worker_state(co.cl, "fa") == serving && worker_state(co.cl, "fb") == serving;
        if (!back)
            sleep_ms(50);
    }
    printf("etcd back: both workers %s after %" PRId64 " ms\n",
           back ? "registered again and SERVING" : "NOT registered again", moe_now_ms() - t_up);
    CHECKF(back, "the workers did not register again within 20 s of etcd's restart (logs %s, %s)",
           w[0].log, w[1].log);
    CHECK(short_ok(co.cl, 40));
    CHECK(short_ok(co.cl, 41));
    CHECK(srv_stop(&co));
    CHECK(srv_stop(&w[0]) && srv_stop(&w[1]));
    test_etcd_kill(&etcd);
    return 0;
}

int main(int argc, char **argv)
{
    static const struct {
        const char *name;
        int (*fn)(void);
    } modes[] = {{"etcd_restart", run_etcd_restart}};
    int (*fn)(void) = NULL;
    for (size_t i = 0; argc == 3 && i < sizeof modes / sizeof modes[0]; i++)
        if (!strcmp(argv[1], modes[i].name))
            fn = modes[i].fn;
    if (!fn) {
        fprintf(stderr, "usage: test_faults etcd_restart BIN_DIR\n");
        return 2;
    }
    g_bin = argv[2];
    setvbuf(stdout, NULL, _IOLBF, 0);
    children_guard();
    signal(SIGPIPE, SIG_IGN);
    alarm(300); /* bounds a hang; a sanitized run on two loaded cores is slow */
    if (model_copy_make(4096, g_tmp, sizeof g_tmp, g_model, sizeof g_model)) {
        fprintf(stderr, "cannot make the model copy in %s\n", g_tmp);
        model_copy_remove(g_tmp);
        return 1;
    }
    int64_t t0 = moe_now_ms();
    int rc = fn();
    printf("%s: %" PRId64 " ms\n", argv[1], moe_now_ms() - t0);
    children_kill_all();
    bool keep = rc || test_n_fail || getenv("MOE_TEST_KEEP_LOGS");
    if (keep)
        fprintf(stderr, "logs kept in %s\n", g_tmp);
    else
        model_copy_remove(g_tmp);
    if (rc)
        return rc == TEST_SKIP_CODE ? rc : (test_summary(), 1);
    return test_summary();
}
