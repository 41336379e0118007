/* Fault tests with real processes on loopback (issue 14): each mode starts
 * its own workers and coordinators, injects one fault and checks that the
 * cluster survives it or reports it truthfully. Every wait is for a
 * condition; time limits only stop a hang (and an alarm bounds the run).
 *
 *   test_faults etcd_restart BIN_DIR   etcd SIGKILLed and restarted on its data dir:
 *                                      requests go on meanwhile, the workers register
 *                                      again (skipped, 77, without etcd)
 *   test_faults stall BIN_DIR          a SIGSTOPped worker: its streams end (after the
 *                                      first token) or move (before it), SIGCONT heals
 *   test_faults decode_loss BIN_DIR    the decode worker dies / stops while requests
 *                                      are in prefill: they finish by recompute
 *   test_faults partition BIN_DIR      prefill and decode workers in network namespaces,
 *                                      the link between them cut (skipped, 77, without
 *                                      root or ip netns)
 *   test_faults coord_failover BIN_DIR two coordinators behind moe-client --addr A,B,
 *                                      one killed
 *   test_faults overload BIN_DIR       5x --max-queue: RESOURCE_EXHAUSTED fast, the
 *                                      admitted requests complete
 *   test_faults input BIN_DIR          hostile input: a 1 MiB prompt refused fast naming
 *                                      the context, messages over the ports' limits,
 *                                      invalid UTF-8 (gRPC and HTTP), a worker called
 *                                      directly as strict as the coordinator
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
#include <unistr.h>

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

/* ---- a SIGSTOPped worker ------------------------------------------------------------- */

static int run_stall(void)
{
    /* Slow steps (10 ms each) keep a 2000-token request running ~20 s. */
    char *slow[] = {"MOE_TEST_FAULTS=1", "MOE_FAULT_STEP_DELAY_MS=10", NULL};
    struct srv w[2], c1, c2;
    if (worker_start(&w[0], "worker-a", NULL, slow) || worker_start(&w[1], "worker-b", NULL, slow))
        return 1;
    char list[300];
    snprintf(list, sizeof list, "%s,%s", w[0].addr, w[1].addr);
    /* c1 polls often (the usual); c2 polls once a minute, so that it still
     * routes to the stopped worker and the watchdog alone must notice. */
    const char *a1[] = {"--workers", list, "--poll-ms", "100", "--stall-timeout-ms", "1500", NULL};
    const char *a2[] = {"--workers",          list,   "--poll-ms", "60000",
                        "--stall-timeout-ms", "1500", NULL};
    if (coord_start(&c1, "coordinator-1", a1) || coord_start(&c2, "coordinator-2", a2))
        return 1;
    const int serving = MOE__V1__WORKER_STATE__WORKER_STATE_SERVING;
    CHECK(wait_worker_state(c1.cl, w[0].addr, serving, 30000) &&
          wait_worker_state(c1.cl, w[1].addr, serving, 30000) &&
          wait_worker_state(c2.cl, w[0].addr, serving, 30000) &&
          wait_worker_state(c2.cl, w[1].addr, serving, 30000));

    /* r1 streams on some worker x (through c1). */
    struct gen *r1 = gen_new(c1.cl, 1, 8, 2000);
    gen_start(r1);
    for (int64_t t0 = moe_now_ms(); atomic_load(&r1->n_seen) < 5 && moe_now_ms() - t0 < 30000;)
        sleep_ms(10);
    int x = busy_of(&w[0]) > 0 ? 0 : 1, y = 1 - x;
    CHECKF(busy_of(&w[x]) == 1, "r1 runs on neither worker");
    /* r3 keeps y busy as c2 sees it (drained x while it is routed), so that
     * c2 sends the next request to x. */
    struct gen *r3 = gen_new(c2.cl, 3, 8, 600);
    CHECK(admin_drain(c2.cl, w[x].addr, true));
    gen_start(r3);
    for (int64_t t0 = moe_now_ms(); atomic_load(&r3->n_seen) < 1 && moe_now_ms() - t0 < 30000;)
        sleep_ms(10);
    CHECK(admin_drain(c2.cl, w[x].addr, false));

    int64_t t_stop = moe_now_ms();
    kill(w[x].pid, SIGSTOP);
    /* r2 goes to x (c2 has not polled since) before its first token: moved to y. */
    struct gen *r2 = gen_new(c2.cl, 2, 8, 8);
    r2->deadline_ms = 30000;
    gen_start(r2);
    pthread_join(r1->th, NULL);
    int64_t t_r1 = moe_now_ms() - t_stop; /* how long the stopped worker held r1 */
    pthread_join(r2->th, NULL);
    printf("stall: r1 ended %s after %zu tokens, %" PRId64 " ms after SIGSTOP: %s\n",
           rpc_code_name(r1->code), r1->n_ids, moe_now_ms() - t_stop, r1->message);
    printf("stall: r2 (routed to the stopped worker) %s in %" PRId64 " ms, %zu tokens\n",
           rpc_code_name(r2->code), r2->wall_ms, r2->n_ids);
    /* 1.5 s of silence, one watchdog period, slack for a loaded machine;
     * gRPC keepalive alone ends it only after 15 s */
    CHECKF(t_r1 < 12000 && r2->wall_ms < 12000, "r1 held %" PRId64 " ms, r2 took %" PRId64 " ms",
           t_r1, r2->wall_ms);
    CHECKF(r1->code == RPC_UNAVAILABLE && strstr(r1->message, "stalled") &&
               strstr(r1->message, w[x].addr) && r1->n_ids >= 5 && r1->n_ids < 2000,
           "the stream on the stopped worker: %s '%s' after %zu tokens", rpc_code_name(r1->code),
           r1->message, r1->n_ids);
    CHECKF(gen_ok(r2, NULL), "the request sent to the stopped worker: %s '%s' (%zu tokens)",
           rpc_code_name(r2->code), r2->message, r2->n_ids);
    CHECK(file_contains(c2.log, "stalled"));
    CHECK(worker_state(c1.cl, w[x].addr) == MOE__V1__WORKER_STATE__WORKER_STATE_DOWN);

    /* SIGCONT: the worker is polled up again, its cancelled streams free
     * their KV, and it serves. */
    kill(w[x].pid, SIGCONT);
    int64_t t_cont = moe_now_ms();
    CHECK(wait_worker_state(c1.cl, w[x].addr, serving, 30000));
    CHECK(wait_idle_pool(&w[x], 30000));
    printf("stall: worker SERVING and idle again %" PRId64 " ms after SIGCONT\n",
           moe_now_ms() - t_cont);
    CHECK(admin_drain(c1.cl, w[y].addr, true));
    struct gen *r4 = gen_new(c1.cl, 4, 8, 8);
    gen_run(r4);
    CHECKF(gen_ok(r4, NULL), "after SIGCONT: %s %s", rpc_code_name(r4->code), r4->message);
    CHECK(admin_drain(c1.cl, w[y].addr, false));
    pthread_join(r3->th, NULL);
    free(r1);
    free(r2);
    free(r3);
    free(r4);
    CHECK(srv_stop(&c1) && srv_stop(&c2));
    CHECK(srv_stop(&w[0]) && srv_stop(&w[1]));
    return 0;
}

/* ---- the decode worker lost while requests are in prefill ------------------------------ */

#define N_DL 3 /* requests in prefill when the decode worker goes */

/* Starts N_DL requests and waits until all are on the prefill worker, none
 * with a token yet. */
static bool start_in_prefill(struct gen **g, struct srv *co, struct srv *pf)
{
    for (int i = 0; i < N_DL; i++) {
        g[i]->cl = co->cl;
        gen_start(g[i]);
    }
    for (int64_t t0 = moe_now_ms(); moe_now_ms() - t0 < 30000; sleep_ms(5))
        if (busy_of(pf) == N_DL)
            break;
    bool none = true;
    for (int i = 0; i < N_DL; i++)
        none &= atomic_load(&g[i]->n_seen) == 0;
    CHECKF(none, "a request had its first token before the fault");
    return none;
}

static void join_all(struct gen **g)
{
    for (int i = 0; i < N_DL; i++)
        pthread_join(g[i]->th, NULL);
}

static int run_decode_loss(void)
{
    /* A slow prefill (16-token chunks, 100 ms per step, no prefix cache to
     * skip it) keeps requests in prefill for a second or more. */
    char *slow[] = {"MOE_TEST_FAULTS=1", "MOE_FAULT_STEP_DELAY_MS=100", NULL};
    char dport[32];
    snprintf(dport, sizeof dport, "127.0.0.1:%d", free_port());
    struct srv pf, dw, co;
    const char *pa[] = {"--role", "prefill",           "--kv-blocks", "256", "--max-batch-tokens",
                        "16",     "--no-prefix-cache", NULL};
    const char *da[] = {"--role", "decode",           "--kv-blocks", "256", "--listen",
                        dport,    "--handoff-ttl-ms", "3000",        NULL};
    if (worker_start(&pf, "prefill", pa, slow) || worker_start(&dw, "decode", da, NULL))
        return 1;
    char list[300];
    snprintf(list, sizeof list, "%s,%s", pf.addr, dw.addr);
    const char *ca[] = {"--workers", list, "--poll-ms", "100", NULL};
    if (coord_start(&co, "coordinator", ca))
        return 1;
    const int serving = MOE__V1__WORKER_STATE__WORKER_STATE_SERVING;
    CHECK(wait_worker_state(co.cl, pf.addr, serving, 30000) &&
          wait_worker_state(co.cl, dw.addr, serving, 30000));

    /* References through the healthy disaggregated path. */
    struct gen *want[N_DL], *g[N_DL];
    for (int i = 0; i < N_DL; i++) {
        want[i] = gen_new(co.cl, 10 + i, 40, 12);
        gen_run(want[i]);
        CHECKF(gen_ok(want[i], NULL) && want[i]->transfer_ms > 0, "healthy handoff %d: %s %s", i,
               rpc_code_name(want[i]->code), want[i]->message);
        g[i] = gen_new(co.cl, 10 + i, 40, 12);
        g[i]->deadline_ms = 60000;
    }

    /* 1. SIGKILL. */
    if (start_in_prefill(g, &co, &pf))
        srv_kill(&dw);
    join_all(g);
    for (int i = 0; i < N_DL; i++) {
        printf("decode killed: request %d %s in %" PRId64 " ms, %zu tokens %s\n", i,
               rpc_code_name(g[i]->code), g[i]->wall_ms, g[i]->n_ids, g[i]->message);
        CHECKF(gen_ok(g[i], want[i]), "decode killed, request %d: %s '%s' (%zu tokens)", i,
               rpc_code_name(g[i]->code), g[i]->message, g[i]->n_ids);
    }
    CHECK(wait_idle_pool(&pf, 30000));

    /* 2. SIGSTOP (a hung decode worker), then SIGCONT: it takes handoffs again
     * and no block stays reserved. */
    if (worker_start(&dw, "decode-2", da, NULL))
        return 1;
    CHECK(wait_worker_state(co.cl, dw.addr, serving, 30000));
    if (start_in_prefill(g, &co, &pf))
        kill(dw.pid, SIGSTOP);
    join_all(g);
    for (int i = 0; i < N_DL; i++) {
        printf("decode stopped: request %d %s in %" PRId64 " ms, %zu tokens %s\n", i,
               rpc_code_name(g[i]->code), g[i]->wall_ms, g[i]->n_ids, g[i]->message);
        CHECKF(gen_ok(g[i], want[i]), "decode stopped, request %d: %s '%s' (%zu tokens)", i,
               rpc_code_name(g[i]->code), g[i]->message, g[i]->n_ids);
    }
    kill(dw.pid, SIGCONT);
    CHECK(wait_worker_state(co.cl, dw.addr, serving, 30000));
    CHECK(wait_idle_pool(&dw, 30000));
    CHECK(wait_idle_pool(&pf, 30000));
    struct gen *h = gen_new(co.cl, 10, 40, 12);
    gen_run(h);
    CHECKF(gen_ok(h, want[0]) && h->transfer_ms > 0, "handoff after SIGCONT: %s %s",
           rpc_code_name(h->code), h->message);

    /* 3. Nowhere to recompute (the prefill worker drained meanwhile): an
     * honest UNAVAILABLE that names the decode side. The drain comes first:
     * drained before the kill, the prefill worker can never be picked for
     * the recompute, however late the handoff fails. */
    if (start_in_prefill(g, &co, &pf)) {
        CHECK(admin_drain(co.cl, pf.addr, true));
        srv_kill(&dw);
    }
    join_all(g);
    for (int i = 0; i < N_DL; i++)
        CHECKF(g[i]->code == RPC_UNAVAILABLE && strstr(g[i]->message, "decode worker"),
               "nowhere to recompute, request %d: %s '%s'", i, rpc_code_name(g[i]->code),
               g[i]->message);
    printf("nowhere to recompute: %s '%s'\n", rpc_code_name(g[0]->code), g[0]->message);
    CHECK(admin_drain(co.cl, pf.addr, false));
    CHECK(wait_idle_pool(&pf, 30000));
    for (int i = 0; i < N_DL; i++) {
        free(want[i]);
        free(g[i]);
    }
    free(h);
    CHECK(srv_stop(&co));
    CHECK(srv_stop(&pf));
    return 0;
}

/* ---- a partition between prefill and decode (network namespaces) ---------------------- */

static char g_ns_p[32], g_ns_d[32];
static bool g_ns_made;

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...)
{
    char cmd[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char full[1100];
    snprintf(full, sizeof full, "%s >/dev/null 2>&1", cmd);
    return system(full);
}

static void netns_cleanup(void)
{
    if (!g_ns_made)
        return;
    children_kill_all(); /* the workers inside first */
    sh("ip netns del %s", g_ns_p);
    sh("ip netns del %s", g_ns_d);
    g_ns_made = false;
}

/* Three namespaces' worth of links (this one = root, P, D):
 *   root 10.77.1.1 -- P 10.77.1.2   (coordinator <-> prefill)
 *   root 10.77.2.1 -- D 10.77.2.2   (coordinator <-> decode)
 *   P    10.77.3.1 -- D 10.77.3.2   (prefill -> decode: KV data plane, KvTransfer)
 * P reaches D's 10.77.2.2 over the P-D link (a host route), so cutting that
 * link partitions prefill from decode while the coordinator sees both.
 * Returns 0, or the reason it cannot in `why`. */
static int netns_make(char *why, size_t cap)
{
    if (geteuid() != 0) {
        snprintf(why, cap, "not root (network namespaces need CAP_SYS_ADMIN)");
        return -1;
    }
    if (sh("ip -V")) {
        snprintf(why, cap, "no 'ip' command (iproute2)");
        return -1;
    }
    int id = (int)getpid() % 100000;
    snprintf(g_ns_p, sizeof g_ns_p, "moep%d", id);
    snprintf(g_ns_d, sizeof g_ns_d, "moed%d", id);
    if (sh("ip netns add %s", g_ns_p)) {
        snprintf(why, cap, "'ip netns add' failed (no permission for network namespaces here)");
        return -1;
    }
    g_ns_made = true;
    atexit(netns_cleanup);
    if (sh("ip netns add %s", g_ns_d))
        goto fail;
    /* veth names: rp/rd/pd + id, at most 15 characters */
    int bad = 0;
    bad |= sh("ip link add rp%d type veth peer name rpx%d", id, id);
    bad |= sh("ip link set rpx%d netns %s", id, g_ns_p);
    bad |= sh("ip link add rd%d type veth peer name rdx%d", id, id);
    bad |= sh("ip link set rdx%d netns %s", id, g_ns_d);
    bad |=
        sh("ip link add pd%d netns %s type veth peer name pdx%d netns %s", id, g_ns_p, id, g_ns_d);
    bad |= sh("ip addr add 10.77.1.1/24 dev rp%d", id);
    bad |= sh("ip link set rp%d up", id);
    bad |= sh("ip addr add 10.77.2.1/24 dev rd%d", id);
    bad |= sh("ip link set rd%d up", id);
    bad |= sh("ip -n %s addr add 10.77.1.2/24 dev rpx%d", g_ns_p, id);
    bad |= sh("ip -n %s addr add 10.77.3.1/24 dev pd%d", g_ns_p, id);
    bad |= sh("ip -n %s link set rpx%d up", g_ns_p, id);
    bad |= sh("ip -n %s link set pd%d up", g_ns_p, id);
    bad |= sh("ip -n %s link set lo up", g_ns_p);
    bad |= sh("ip -n %s addr add 10.77.2.2/24 dev rdx%d", g_ns_d, id);
    bad |= sh("ip -n %s addr add 10.77.3.2/24 dev pdx%d", g_ns_d, id);
    bad |= sh("ip -n %s link set rdx%d up", g_ns_d, id);
    bad |= sh("ip -n %s link set pdx%d up", g_ns_d, id);
    bad |= sh("ip -n %s link set lo up", g_ns_d);
    bad |= sh("ip -n %s route add 10.77.2.2/32 via 10.77.3.2", g_ns_p);
    if (bad)
        goto fail;
    return 0;
fail:
    snprintf(why, cap, "setting up namespaces and veth pairs failed");
    netns_cleanup();
    return -1;
}

static int run_partition(void)
{
    char why[200];
    if (netns_make(why, sizeof why)) {
        printf("SKIPPED: %s\n", why);
        return TEST_SKIP_CODE;
    }
    int id = (int)getpid() % 100000;
    struct srv pf, dw, co;
    const char *in_p[] = {"/usr/bin/env", "ip", "netns", "exec", g_ns_p, NULL};
    const char *in_d[] = {"/usr/bin/env", "ip", "netns", "exec", g_ns_d, NULL};
    const char *fixed[] = {"--model", g_model, "--dtype", "f32", "--threads", "1", NULL};
    const char *pa[] = {"--role", "prefill", "--kv-blocks", "256", "--listen", "10.77.1.2:0", NULL};
    const char *da[] = {"--role", "decode", "--kv-blocks", "256", "--listen", "10.77.2.2:0", NULL};
    if (srv_start(&pf, "prefill", in_p, "moe-worker", fixed, pa, NULL) ||
        srv_start(&dw, "decode", in_d, "moe-worker", fixed, da, NULL))
        return 1;
    char list[300];
    snprintf(list, sizeof list, "%s,%s", pf.addr, dw.addr);
    const char *ca[] = {"--workers", list, "--poll-ms", "100", NULL};
    if (coord_start(&co, "coordinator", ca))
        return 1;
    const int serving = MOE__V1__WORKER_STATE__WORKER_STATE_SERVING;
    CHECK(wait_worker_state(co.cl, pf.addr, serving, 30000) &&
          wait_worker_state(co.cl, dw.addr, serving, 30000));
    struct gen *want = gen_new(co.cl, 20, 40, 12), *g = gen_new(co.cl, 20, 40, 12);
    gen_run(want);
    CHECKF(gen_ok(want, NULL) && want->transfer_ms > 0, "handoff across namespaces: %s %s",
           rpc_code_name(want->code), want->message);

    /* Cut the prefill-decode link: the handoff fails, the request is
     * recomputed on the decode worker (which the coordinator still reaches). */
    CHECK(sh("ip -n %s link set pd%d down", g_ns_p, id) == 0);
    g->deadline_ms = 60000;
    gen_run(g);
    printf("partition: %s in %" PRId64 " ms, %zu tokens %s\n", rpc_code_name(g->code), g->wall_ms,
           g->n_ids, g->message);
    CHECKF(gen_ok(g, want), "across the partition: %s '%s' (%zu tokens)", rpc_code_name(g->code),
           g->message, g->n_ids);
    CHECKF(file_contains(co.log, "failed") && file_contains(co.log, "recomputing"),
           "the coordinator did not log a failed handoff and its recompute (%s)", co.log);
    CHECK(wait_idle_pool(&pf, 30000));
    CHECK(wait_idle_pool(&dw, 30000));
    /* Healed: handoffs again. */
    CHECK(sh("ip -n %s link set pd%d up", g_ns_p, id) == 0);
    CHECK(sh("ip -n %s route replace 10.77.2.2/32 via 10.77.3.2", g_ns_p) == 0);
    gen_run(g);
    CHECKF(gen_ok(g, want), "after healing: %s '%s'", rpc_code_name(g->code), g->message);
    CHECK(wait_idle_pool(&pf, 30000));
    CHECK(wait_idle_pool(&dw, 30000));
    free(want);
    free(g);
    CHECK(srv_stop(&co));
    CHECK(srv_stop(&pf) && srv_stop(&dw));
    return 0;
}

/* ---- two coordinators, one killed ------------------------------------------------------ */

/* Runs moe-client with --addr `addrs`; returns its exit code. */
static int client_run(const char *addrs, const char *extra)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "'%s/moe-client' --addr '%s' --tokens 5,17,99 -n 6 --ignore-eos --quiet %s "
             ">>'%s/client.log' 2>&1",
             g_bin, addrs, extra, g_tmp);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int run_coord_failover(void)
{
    struct srv w, a, b;
    if (worker_start(&w, "worker", NULL, NULL))
        return 1;
    const char *ca[] = {"--workers", w.addr, "--poll-ms", "100", NULL};
    if (coord_start(&a, "coordinator-a", ca) || coord_start(&b, "coordinator-b", ca))
        return 1;
    const int serving = MOE__V1__WORKER_STATE__WORKER_STATE_SERVING;
    CHECK(wait_worker_state(a.cl, w.addr, serving, 30000) &&
          wait_worker_state(b.cl, w.addr, serving, 30000));
    char both[300];
    snprintf(both, sizeof both, "%s,%s", a.addr, b.addr);
    int ok = 0;
    for (int i = 0; i < 3; i++)
        ok += client_run(both, "") == 0;
    CHECKF(ok == 3, "%d of 3 requests before the kill", ok);
    srv_kill(&a);
    int64_t t0 = moe_now_ms();
    ok = 0;
    for (int i = 0; i < 3; i++)
        ok += client_run(both, "") == 0;
    int64_t dt = moe_now_ms() - t0;
    printf("failover: %d of 3 requests OK after coordinator a was killed, %" PRId64 " ms\n", ok,
           dt);
    CHECKF(ok == 3, "%d of 3 requests after the kill (log %s/client.log)", ok, g_tmp);
    CHECK(client_run(both, "--repeat 4") == 0);
    char log[700];
    snprintf(log, sizeof log, "%s/client.log", g_tmp);
    CHECKF(file_contains(log, "trying the next address"), "no failover line in %s", log);
    /* Every address down: the client says so and fails. */
    CHECK(srv_stop(&b));
    snprintf(both, sizeof both, "%s,%s", a.addr, b.addr);
    CHECK(client_run(both, "--timeout-ms 5000") != 0);
    CHECK(srv_stop(&w));
    return 0;
}

/* ---- overload ------------------------------------------------------------------------ */

#define OV_CAP 4
#define OV_N (5 * OV_CAP)

static int run_overload(void)
{
    char *slow[] = {"MOE_TEST_FAULTS=1", "MOE_FAULT_STEP_DELAY_MS=20", NULL};
    struct srv w, co;
    if (worker_start(&w, "worker", NULL, slow))
        return 1;
    char cap[16];
    snprintf(cap, sizeof cap, "%d", OV_CAP);
    const char *ca[] = {"--workers", w.addr, "--poll-ms", "100", "--max-queue", cap, NULL};
    if (coord_start(&co, "coordinator", ca))
        return 1;
    CHECK(wait_worker_state(co.cl, w.addr, MOE__V1__WORKER_STATE__WORKER_STATE_SERVING, 30000));
    /* OV_CAP long requests fill the queue... */
    struct gen *g[OV_N];
    for (int i = 0; i < OV_N; i++)
        g[i] = gen_new(co.cl, 30 + i, 8, i < OV_CAP ? 60 : 4);
    for (int i = 0; i < OV_CAP; i++)
        gen_start(g[i]);
    for (int64_t t0 = moe_now_ms(); moe_now_ms() - t0 < 30000; sleep_ms(5)) {
        int seen = 0;
        for (int i = 0; i < OV_CAP; i++)
            seen += atomic_load(&g[i]->n_seen) > 0;
        if (seen == OV_CAP)
            break;
    }
    /* ...then 4x as many more arrive at once: refused, fast. */
    for (int i = OV_CAP; i < OV_N; i++)
        gen_start(g[i]);
    int refused = 0;
    int64_t worst = 0;
    for (int i = OV_CAP; i < OV_N; i++) {
        pthread_join(g[i]->th, NULL);
        refused += g[i]->code == RPC_RESOURCE_EXHAUSTED && strstr(g[i]->message, "--max-queue");
        worst = g[i]->wall_ms > worst ? g[i]->wall_ms : worst;
    }
    int done = 0;
    for (int i = 0; i < OV_CAP; i++) {
        pthread_join(g[i]->th, NULL);
        done += gen_ok(g[i], NULL);
    }
    printf("overload: %d of %d extra requests refused (slowest answer %" PRId64
           " ms), %d of %d admitted completed\n",
           refused, OV_N - OV_CAP, worst, done, OV_CAP);
    CHECKF(refused == OV_N - OV_CAP, "%d of %d refused with RESOURCE_EXHAUSTED", refused,
           OV_N - OV_CAP);
    CHECKF(worst < 2000, "a refusal took %" PRId64 " ms", worst);
    CHECKF(done == OV_CAP, "%d of %d admitted requests completed", done, OV_CAP);
    /* Room again afterwards. */
    CHECK(short_ok(co.cl, 99));
    CHECK(wait_idle_pool(&w, 30000));
    for (int i = 0; i < OV_N; i++)
        free(g[i]);
    CHECK(srv_stop(&co) && srv_stop(&w));
    return 0;
}

/* ---- hostile input: size, UTF-8, the worker as strict as the coordinator -------------- */

/* One Generate with a raw request; returns the status, its message in msg. */
static enum rpc_code raw_generate(struct rpc_client *cl, const char *method, const void *bytes,
                                  size_t len, char *msg, size_t cap, int64_t *ms)
{
    int64_t t0 = moe_now_ms();
    struct moe_error err = {0};
    struct rpc_client_stream *s = rpc_client_stream_start(cl, method, bytes, len, 30000, &err);
    if (!s) {
        snprintf(msg, cap, "%.200s", err.msg);
        return RPC_INTERNAL;
    }
    const uint8_t *data;
    size_t n;
    while (rpc_client_stream_next(s, &data, &n)) {
    }
    const char *m;
    enum rpc_code code = rpc_client_stream_status(s, &m);
    snprintf(msg, cap, "%s", m ? m : "");
    rpc_client_stream_destroy(s);
    if (ms)
        *ms = moe_now_ms() - t0;
    return code;
}

static enum rpc_code text_generate(struct rpc_client *cl, const char *text, const char *model,
                                   const char *request_id, const char *stop, char *msg, size_t cap,
                                   int64_t *ms)
{
    Moe__V1__GenerateRequest rq = MOE__V1__GENERATE_REQUEST__INIT;
    Moe__V1__SamplingParams sp = MOE__V1__SAMPLING_PARAMS__INIT;
    char *stops[1] = {(char *)stop};
    sp.max_tokens = 4;
    if (stop) {
        sp.n_stop = 1;
        sp.stop = stops;
    }
    rq.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TEXT;
    rq.text = (char *)text;
    rq.model = (char *)(model ? model : "");
    rq.request_id = (char *)(request_id ? request_id : "");
    rq.sampling = &sp;
    size_t len;
    void *b = pack(&rq, &len);
    enum rpc_code code = raw_generate(cl, "/moe.v1.Inference/Generate", b, len, msg, cap, ms);
    free(b);
    return code;
}

/* Runs curl with a body file; returns the HTTP status (0: no answer). */
static int http_post(const char *url, const char *body_file, char *answer, size_t cap)
{
    char out[700], cmd[2400];
    snprintf(out, sizeof out, "%s/http-answer", g_tmp);
    snprintf(cmd, sizeof cmd,
             "curl -s -o '%s' -w '%%{http_code}' -H 'Content-Type: application/json' "
             "--data-binary @'%s' '%s' 2>/dev/null",
             out, body_file, url);
    FILE *p = popen(cmd, "r");
    int status = 0;
    if (p) {
        if (fscanf(p, "%d", &status) != 1)
            status = 0;
        pclose(p);
    }
    answer[0] = '\0';
    FILE *f = fopen(out, "r");
    if (f) {
        size_t n = fread(answer, 1, cap - 1, f);
        answer[n] = '\0';
        fclose(f);
    }
    return status;
}

static int run_input(void)
{
    struct srv w, co;
    if (worker_start(&w, "worker", NULL, NULL))
        return 1;
    char http[64];
    snprintf(http, sizeof http, "127.0.0.1:%d", free_port());
    const char *ca[] = {"--workers", w.addr, "--poll-ms", "100", "--http-listen", http, NULL};
    if (coord_start(&co, "coordinator", ca))
        return 1;
    CHECK(wait_worker_state(co.cl, w.addr, MOE__V1__WORKER_STATE__WORKER_STATE_SERVING, 30000));
    char msg[1024];
    int64_t ms = 0;

    /* A 1 MiB prompt (random letters: the costliest to tokenize) is refused
     * once it is known to exceed the context, naming the limit. */
    size_t big = ((size_t)1 << 20) - 64;
    char *text = malloc(big + 1);
    struct test_rng rng = {88172645463325252ull};
    for (size_t i = 0; i < big; i++)
        text[i] = (char)('a' + test_rng_u64(&rng) % 26);
    text[big] = '\0';
    enum rpc_code code = text_generate(co.cl, text, NULL, NULL, NULL, msg, sizeof msg, &ms);
    printf("input: 1 MiB prompt: %s in %" PRId64 " ms: %s\n", rpc_code_name(code), ms, msg);
    CHECKF(code == RPC_INVALID_ARGUMENT && strstr(msg, "more than") &&
               strstr(msg, "context is 4096"),
           "1 MiB prompt: %s '%s'", rpc_code_name(code), msg);
    free(text);

    /* Larger than any valid request: refused by the port before decoding. */
    size_t huge = (size_t)3 << 20;
    uint8_t *junk = malloc(huge);
    memset(junk, 'a', huge);
    junk[0] = 0x12; /* field 2 (request_id), length-delimited: a well-formed 3 MiB message */
    size_t body = huge - 5, k = 1;
    for (int i = 0; i < 4; i++, body >>= 7)
        junk[k++] = (uint8_t)((body & 0x7f) | (i < 3 ? 0x80 : 0));
    code = raw_generate(co.cl, "/moe.v1.Inference/Generate", junk, huge, msg, sizeof msg, &ms);
    printf("input: 3 MiB message to the public port: %s: %s\n", rpc_code_name(code), msg);
    CHECKF(code == RPC_RESOURCE_EXHAUSTED, "3 MiB message: %s '%s'", rpc_code_name(code), msg);
    code = raw_generate(w.cl, "/moe.v1.Worker/Generate", junk, huge, msg, sizeof msg, &ms);
    CHECKF(code == RPC_RESOURCE_EXHAUSTED, "3 MiB message to the worker: %s '%s'",
           rpc_code_name(code), msg);
    free(junk);

    /* Invalid UTF-8 in any string field: refused by name, never echoed. */
    const char *bad = "ab\xc3\x28"
                      "cd"; /* 0xc3 then not a continuation byte */
    struct {
        const char *text, *model, *request_id, *stop, *field;
    } cases[] = {{bad, NULL, NULL, NULL, "text"},
                 {"hello", bad, NULL, NULL, "model"},
                 {"hello", NULL, bad, NULL, "request_id"},
                 {"hello", NULL, NULL, bad, "sampling.stop[0]"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        code = text_generate(co.cl, cases[i].text, cases[i].model, cases[i].request_id,
                             cases[i].stop, msg, sizeof msg, NULL);
        CHECKF(code == RPC_INVALID_ARGUMENT &&
                   !strncmp(msg, cases[i].field, strlen(cases[i].field)) &&
                   strstr(msg, "not valid UTF-8") && !u8_check((const uint8_t *)msg, strlen(msg)),
               "invalid UTF-8 in %s: %s '%s'", cases[i].field, rpc_code_name(code), msg);
    }

    /* The worker called directly is as strict as the coordinator. */
    Moe__V1__WorkerGenerateRequest wr = MOE__V1__WORKER_GENERATE_REQUEST__INIT;
    Moe__V1__SamplingParams sp = MOE__V1__SAMPLING_PARAMS__INIT;
    uint32_t ids[3] = {5, 17, 99}, stop_ids[1] = {100000};
    wr.n_prompt_token_ids = 3;
    wr.prompt_token_ids = ids;
    sp.max_tokens = 4;
    sp.n_stop_token_ids = 1;
    sp.stop_token_ids = stop_ids;
    wr.sampling = &sp;
    size_t len;
    void *b = pack(&wr, &len);
    code = raw_generate(w.cl, "/moe.v1.Worker/Generate", b, len, msg, sizeof msg, NULL);
    free(b);
    CHECKF(code == RPC_INVALID_ARGUMENT && strstr(msg, "sampling.stop_token_ids[0]"),
           "worker, stop id outside the vocabulary: %s '%s'", rpc_code_name(code), msg);
    sp.n_stop_token_ids = 0;
    char *stops[1] = {(char *)bad};
    sp.n_stop = 1;
    sp.stop = stops;
    b = pack(&wr, &len);
    code = raw_generate(w.cl, "/moe.v1.Worker/Generate", b, len, msg, sizeof msg, NULL);
    free(b);
    CHECKF(code == RPC_INVALID_ARGUMENT && strstr(msg, "sampling.stop[0]: not valid UTF-8"),
           "worker, invalid UTF-8 stop string: %s '%s'", rpc_code_name(code), msg);

    /* The Admin service checks its strings too (every unary handler unpacks
     * through rpc_call_unpack): a placement with invalid UTF-8. */
    Moe__V1__ApplyPlacementRequest ap = MOE__V1__APPLY_PLACEMENT_REQUEST__INIT;
    ap.placement_json = (char *)bad;
    b = pack(&ap, &len);
    struct rpc_reply rep;
    code = rpc_client_call(co.cl, "/moe.v1.Admin/ApplyPlacement", b, len, 30000, &rep);
    free(b);
    CHECKF(code == RPC_INVALID_ARGUMENT && strstr(rep.message, "placement_json: not valid UTF-8"),
           "Admin ApplyPlacement, invalid UTF-8: %s '%s'", rpc_code_name(code), rep.message);
    rpc_reply_clear(&rep);

    /* HTTP: invalid UTF-8 in the body, a body over the derived limit. */
    char url[128], file[700], answer[4096];
    snprintf(url, sizeof url, "http://%s/v1/completions", http);
    snprintf(file, sizeof file, "%s/body.json", g_tmp);
    FILE *f = fopen(file, "w");
    fprintf(f, "{\"model\": \"qwen3\xff"
               "_moe\", \"prompt\": \"hi\", \"max_tokens\": 2}");
    fclose(f);
    int st = http_post(url, file, answer, sizeof answer);
    CHECKF(st == 400 && strstr(answer, "not valid UTF-8") &&
               !u8_check((const uint8_t *)answer, strlen(answer)),
           "HTTP invalid UTF-8: %d %s", st, answer);
    f = fopen(file, "w");
    fputs("{\"model\": \"qwen3_moe\", \"max_tokens\": 2, \"prompt\": \"", f);
    for (int i = 0; i < 3 << 20; i++)
        fputc('a', f);
    fputs("\"}", f);
    fclose(f);
    st = http_post(url, file, answer, sizeof answer);
    printf("input: HTTP body of 3 MiB: %d\n", st);
    CHECKF(st == 413, "HTTP body of 3 MiB: %d %.200s", st, answer);

    /* Still serving. */
    CHECK(short_ok(co.cl, 7));
    CHECK(srv_stop(&co) && srv_stop(&w));
    return 0;
}

int main(int argc, char **argv)
{
    static const struct {
        const char *name;
        int (*fn)(void);
    } modes[] = {{"etcd_restart", run_etcd_restart},
                 {"stall", run_stall},
                 {"decode_loss", run_decode_loss},
                 {"partition", run_partition},
                 {"coord_failover", run_coord_failover},
                 {"overload", run_overload},
                 {"input", run_input}};
    int (*fn)(void) = NULL;
    for (size_t i = 0; argc == 3 && i < sizeof modes / sizeof modes[0]; i++)
        if (!strcmp(argv[1], modes[i].name))
            fn = modes[i].fn;
    if (!fn) {
        fprintf(stderr,
                "usage: test_faults "
                "etcd_restart|stall|decode_loss|partition|coord_failover|overload|input BIN_DIR\n");
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
    netns_cleanup();
    bool keep = rc || test_n_fail || getenv("MOE_TEST_KEEP_LOGS");
    if (keep)
        fprintf(stderr, "logs kept in %s\n", g_tmp);
    else
        model_copy_remove(g_tmp);
    if (rc)
        return rc == TEST_SKIP_CODE ? rc : (test_summary(), 1);
    return test_summary();
}
