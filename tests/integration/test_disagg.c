/* Disaggregated prefill / decode with KV block handoff.
 *
 *   test_disagg engine                in process: park a prefilled sequence
 *                                     in one engine, copy its blocks into a
 *                                     second engine's reservation, continue
 *                                     there; tokens equal one engine alone
 *                                     (greedy and seeded), pools whole
 *                                     (moe_engine_check), refusals clean
 *   test_disagg cluster BIN_DIR       real moe-worker / moe-coordinator
 *                                     processes on free loopback ports: mixed
 *                                     vs prefill + decode outputs, 32
 *                                     concurrent requests, a prefill worker
 *                                     dying or killed mid-transfer, a decode
 *                                     worker refusing the reservation
 *
 * Every child is killed at exit (atexit, fatal signals, an alarm, and
 * PR_SET_PDEATHSIG). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "proc.h"
#include "rpcutil.h"
#include "backend.h"
#include "engine/engine.h"
#include "disagg/kv_link.h"
#include "disagg/kv_handoff.h"
#include "model/model.h"
#include "moe/v1/admin.pb-c.h"
#include "moe/v1/inference.pb-c.h"
#include "moe/v1/worker.pb-c.h"
#include "rpc.h"
#include "testlib.h"

static const char *g_bin;
static const char *g_model;

/* ---- in-process engine handoff ------------------------------------------------------ */

struct cap {
    int32_t ids[256];
    int n;
    int finish;
    struct moe_seq_export ex; /* copy of the parked event (tokens/blocks copied) */
    int32_t ex_tokens[512], ex_blocks[64];
    bool parked;
};

static void cap_cb(void *user, const struct moe_token_event *ev)
{
    struct cap *c = user;
    if (ev->token >= 0 && c->n < 256)
        c->ids[c->n++] = ev->token;
    if (ev->finish)
        c->finish = ev->finish;
    if (ev->parked) {
        c->parked = true;
        c->ex = *ev->parked;
        memcpy(c->ex_tokens, ev->parked->tokens, (size_t)ev->parked->n_tokens * sizeof(int32_t));
        memcpy(c->ex_blocks, ev->parked->blocks, (size_t)ev->parked->n_blocks * sizeof(int32_t));
    }
}

struct resv_cap {
    int32_t blocks[64];
    int n;
    char error[256];
    bool done;
};

static void resv_cb(void *user, uint64_t key, const int32_t *blocks, int n, const char *error)
{
    struct resv_cap *r = user;
    (void)key;
    r->done = true;
    r->n = n;
    if (blocks)
        memcpy(r->blocks, blocks, (size_t)n * sizeof *blocks);
    snprintf(r->error, sizeof r->error, "%s", error ? error : "");
}

static void run_until_idle(struct moe_engine *e)
{
    struct moe_error err;
    for (int guard = 0; moe_engine_busy(e) && guard < 10000; guard++)
        CHECKF(moe_engine_step(e, NULL, &err) == MOE_OK, "%s", err.msg);
}

static void check_engine(struct moe_engine *e, const char *when)
{
    struct moe_error err = {0};
    CHECKF(moe_engine_check(e, &err) == MOE_OK, "%s: %s", when, err.msg);
}

static int kv_used(struct moe_engine *e)
{
    struct moe_engine_stats st;
    moe_engine_stats(e, &st);
    return st.kv_blocks_used;
}

/* One handoff of `prompt` from engine a to b over a pair of KV links (the
 * data plane; b may use another block size); the tokens continue in *out. */
static void handoff_once(struct moe_backend *be, const struct moe_config *cfg, struct moe_engine *a,
                         struct moe_engine *b, const int32_t *prompt, int n_prompt,
                         const struct moe_request_params *p, uint64_t id, struct cap *out)
{
    struct moe_error err = {0};
    struct moe_request_params pp = *p;
    pp.prefill_only = true;
    memset(out, 0, sizeof *out);
    CHECKF(moe_engine_submit(a, id, prompt, n_prompt, &pp, cap_cb, out, &err) == MOE_OK, "%s",
           err.msg);
    run_until_idle(a); /* parked: not busy any more */
    CHECK(out->parked && out->n == 1 && !out->finish);
    CHECK(out->ex.n_kv_tokens == n_prompt && out->ex.n_tokens == n_prompt + 1);
    check_engine(a, "after parking");
    CHECK(kv_used(a) == out->ex.n_blocks);

    int bs = moe_engine_block_size(b), n_dst = (n_prompt + bs - 1) / bs;
    struct resv_cap rc = {0};
    CHECK(moe_engine_reserve(b, 1000 + id, n_dst, resv_cb, &rc, &err) == MOE_OK);
    run_until_idle(b);
    CHECKF(rc.done && rc.n == n_dst, "reservation: %s", rc.error);
    check_engine(b, "after reserving");

    struct kv_link_opts lo = {.be = be,
                              .listen = "127.0.0.1:0",
                              .layout = {.n_layer = cfg->n_layer,
                                         .n_kv_head = cfg->n_kv_head,
                                         .d_head = cfg->d_head,
                                         .tp_size = 1}};
    struct kv_link *la = NULL, *lb = NULL;
    CHECK(kv_link_create(&lo, &la, &err) == MOE_OK && kv_link_create(&lo, &lb, &err) == MOE_OK);
    kv_link_attach_kv(la, moe_engine_kv_cache(a));
    kv_link_attach_kv(lb, moe_engine_kv_cache(b));
    CHECK(kv_link_expect(lb, NULL, "h", rc.blocks, rc.n, n_prompt, 30000, &err) == MOE_OK);
    struct kv_link_target t = {.head_begin = 0, .head_end = cfg->n_kv_head};
    snprintf(t.endpoint, sizeof t.endpoint, "%s", kv_link_endpoint(lb));
    struct kv_link_push push = {.id = "h",
                                .src_blocks = out->ex_blocks,
                                .n_src_blocks = out->ex.n_blocks,
                                .n_tokens = n_prompt,
                                .dst_blocks = rc.blocks,
                                .n_dst_blocks = rc.n,
                                .dst_block_size = bs,
                                .targets = &t,
                                .n_targets = 1,
                                .deadline_ms = 30000};
    uint64_t sent = 0, got = 0;
    bool complete = false;
    CHECKF(kv_link_push(la, &push, &sent, &err) == MOE_OK, "%s", err.msg);
    CHECK(kv_link_forget(lb, NULL, "h", &got, &complete, &err) == MOE_OK);
    CHECKF(complete && got == sent &&
               sent == (uint64_t)n_prompt * cfg->n_layer * 2 * cfg->n_kv_head * cfg->d_head * 4,
           "sent %" PRIu64 " bytes, %" PRIu64 " arrived (complete %d)", sent, got, complete);
    kv_link_destroy(la);
    kv_link_destroy(lb);
    moe_engine_abort(a, id); /* the prefill side lets go */
    run_until_idle(a);
    CHECK(kv_used(a) == 0);
    check_engine(a, "after release");

    struct moe_seq_import im = {.n_prompt = out->ex.n_prompt,
                                .n_tokens = out->ex.n_tokens,
                                .tokens = out->ex_tokens,
                                .rng = out->ex.rng,
                                .reservation = 1000 + id};
    CHECKF(moe_engine_import(b, id, &im, p, cap_cb, out, &err) == MOE_OK, "%s", err.msg);
    run_until_idle(b);
    check_engine(b, "after decoding");
    struct moe_engine_stats st;
    moe_engine_stats(b, &st);
    CHECK(st.kv_blocks_used == 0 && st.reservations == 0);
}

static int run_engine(void)
{
    struct moe_error err = {0};
    struct moe_backend *be = NULL;
    struct moe_model *model = NULL;
    struct moe_model_opts mo = {.dtype = MOE_DTYPE_F32, .tp_size = 1};
    if (moe_backend_create("cpu", 1, &be, &err) ||
        moe_model_load(test_src_path("tests/golden/fixtures/qwen3_moe"), &mo, be, &model, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    struct moe_engine *ref = NULL, *a = NULL, *b = NULL;
    struct moe_engine_opts o = {.n_block = 64, .block_size = 4};
    CHECK(moe_engine_create(model, NULL, &o, &ref, &err) == MOE_OK);
    CHECK(moe_engine_create(model, NULL, &o, &a, &err) == MOE_OK);
    o.block_size = 8; /* the receiver re-blocks the tokens */
    CHECK(moe_engine_create(model, NULL, &o, &b, &err) == MOE_OK);
    int32_t prompt[40];
    for (int i = 0; i < 40; i++)
        prompt[i] = (i * 37 + 11) % 700;
    const int lens[] = {1, 3, 4, 5, 17, 40};
    for (int mode = 0; mode < 2; mode++)
        for (size_t k = 0; k < sizeof lens / sizeof *lens; k++) {
            struct moe_request_params p;
            moe_request_params_init(&p);
            p.max_tokens = 12;
            p.ignore_eos = true;
            if (mode == 1) {
                p.sp.temperature = 0.9f;
                p.sp.top_k = 40;
                p.sp.repetition_penalty = 1.2f;
                p.has_seed = true;
                p.seed = 1234 + k;
            }
            struct cap want = {0}, got;
            uint64_t id = 10 * k + (uint64_t)mode;
            CHECK(moe_engine_submit(ref, id, prompt, lens[k], &p, cap_cb, &want, &err) == MOE_OK);
            run_until_idle(ref);
            handoff_once(be, moe_model_config(model), a, b, prompt, lens[k], &p, id, &got);
            CHECKF(want.n == 12 && got.n == 12 && !memcmp(want.ids, got.ids, sizeof want.ids),
                   "%s prompt of %d: handed-off tokens differ", mode ? "seeded" : "greedy",
                   lens[k]);
            CHECK(got.finish == MOE_FINISH_LENGTH);
        }

    /* A prefill_only request that finishes at its first token is not parked. */
    struct moe_request_params p1;
    moe_request_params_init(&p1);
    p1.max_tokens = 1;
    p1.prefill_only = true;
    struct cap one = {0};
    CHECK(moe_engine_submit(a, 99, prompt, 5, &p1, cap_cb, &one, &err) == MOE_OK);
    run_until_idle(a);
    CHECK(!one.parked && one.finish == MOE_FINISH_LENGTH && kv_used(a) == 0);

    /* Refusals: too many blocks now (pool busy), out of range at once. */
    struct resv_cap big = {0}, r2 = {0};
    CHECK(moe_engine_reserve(b, 7, 65, resv_cb, &big, &err) == MOE_ERR_INVALID);
    CHECK(moe_engine_reserve(b, 7, 60, resv_cb, &big, &err) == MOE_OK);
    CHECK(moe_engine_reserve(b, 8, 10, resv_cb, &r2, &err) == MOE_OK);
    run_until_idle(b);
    CHECK(big.done && big.n == 60 && r2.done && r2.n == 0 && strstr(r2.error, "no free KV blocks"));
    CHECK(kv_used(b) == 60);
    check_engine(b, "holding a reservation");
    /* Import without a fitting reservation recomputes: same tokens. */
    struct moe_request_params pg;
    moe_request_params_init(&pg);
    pg.max_tokens = 6;
    pg.ignore_eos = true;
    struct cap want = {0}, got = {0};
    CHECK(moe_engine_submit(ref, 500, prompt, 9, &pg, cap_cb, &want, &err) == MOE_OK);
    run_until_idle(ref);
    int32_t toks[10];
    memcpy(toks, prompt, 9 * sizeof *toks);
    toks[9] = want.ids[0];
    struct moe_rng rng;
    moe_rng_seed(&rng, 0);
    struct moe_seq_import im = {
        .n_prompt = 9, .n_tokens = 10, .tokens = toks, .rng = rng, .reservation = 12345};
    moe_engine_unreserve(b, 7);
    CHECK(moe_engine_import(b, 500, &im, &pg, cap_cb, &got, &err) == MOE_OK);
    run_until_idle(b);
    CHECKF(got.n == 5 && !memcmp(got.ids, want.ids + 1, 5 * sizeof *got.ids),
           "recomputed import: %d tokens", got.n);
    CHECK(kv_used(b) == 0);
    check_engine(b, "after unreserve");
    /* Generated tokens past max_tokens are refused. */
    pg.max_tokens = 1;
    CHECK(moe_engine_import(b, 501, &im, &pg, cap_cb, &got, &err) == MOE_ERR_INVALID);

    moe_engine_destroy(ref);
    moe_engine_destroy(a);
    moe_engine_destroy(b);
    moe_model_free(model);
    moe_backend_destroy(be);
    return 0;
}

struct proc {
    pid_t pid;
    char addr[128];
    struct rpc_client *cl;
};

static int worker_start(struct proc *p, const char *role, const char *kv_blocks, char *const env[])
{
    char bin[600];
    snprintf(bin, sizeof bin, "%s/moe-worker", g_bin);
    char *argv[20] = {bin,           "--model", (char *)g_model, "--listen",
                      "127.0.0.1:0", "--dtype", "f32",           "--threads",
                      "1",           "--role",  (char *)role};
    int n = 11;
    argv[n++] = "--kv-blocks";
    argv[n++] = (char *)kv_blocks;
    argv[n] = NULL;
    int fd;
    p->pid = child_spawn(argv, env, &fd, NULL);
    struct moe_error err;
    if (p->pid < 0 || read_address(fd, p->addr, sizeof p->addr, 20000) ||
        !(p->cl = rpc_client_create(p->addr, NULL, &err))) {
        fprintf(stderr, "worker (%s) did not start\n", role);
        return -1;
    }
    return 0;
}

static int coordinator_start(struct proc *p, const char *workers)
{
    char bin[600];
    snprintf(bin, sizeof bin, "%s/moe-coordinator", g_bin);
    char *argv[] = {bin,           "--model",    (char *)g_model, "--listen",
                    "127.0.0.1:0", "--workers",  (char *)workers, "--poll-ms",
                    "100",         "--grace-ms", "120000",        NULL};
    int fd;
    p->pid = child_spawn(argv, NULL, &fd, NULL);
    struct moe_error err;
    if (p->pid < 0 || read_address(fd, p->addr, sizeof p->addr, 20000) ||
        !(p->cl = rpc_client_create(p->addr, NULL, &err))) {
        fprintf(stderr, "coordinator did not start\n");
        return -1;
    }
    return 0;
}

static void proc_kill(struct proc *p)
{
    if (p->pid > 0) {
        kill(p->pid, SIGKILL);
        waitpid(p->pid, NULL, 0);
        child_forget(p->pid);
        p->pid = 0;
    }
}

/* ---- client helpers -------------------------------------------------------------------- */

/* Waits until the worker holds no KV blocks and no handoff. */
static bool wait_pool_whole(struct rpc_client *cl, int timeout_ms, uint32_t *used, uint32_t *pend)
{
    for (int64_t t0 = moe_now_ms();; sleep_ms(50)) {
        Moe__V1__WorkerLoad *l = get_load(cl);
        *used = l ? l->kv_blocks_used : 9999;
        *pend = l ? l->handoffs_pending : 9999;
        if (l)
            moe__v1__worker_load__free_unpacked(l, NULL);
        if (*used == 0 && *pend == 0)
            return true;
        if (moe_now_ms() - t0 > timeout_ms)
            return false;
    }
}

struct gen_out {
    enum rpc_code code;
    char message[512];
    uint32_t ids[256];
    size_t n_ids;
    int finish;
    double transfer_ms, ttft_ms;
    int64_t wall_ms;
};

static void gen_run(struct rpc_client *cl, const uint32_t *prompt, size_t n_prompt,
                    const Moe__V1__SamplingParams *sp, uint32_t deadline_ms, struct gen_out *out)
{
    memset(out, 0, sizeof *out);
    int64_t t0 = moe_now_ms();
    Moe__V1__GenerateRequest rq = MOE__V1__GENERATE_REQUEST__INIT;
    Moe__V1__TokenIds tids = MOE__V1__TOKEN_IDS__INIT;
    tids.n_ids = n_prompt;
    tids.ids = (uint32_t *)prompt;
    rq.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS;
    rq.token_ids = &tids;
    rq.sampling = (Moe__V1__SamplingParams *)sp;
    rq.deadline_ms = deadline_ms;
    size_t len;
    void *b = pack(&rq, &len);
    struct moe_error err = {0};
    struct rpc_client_stream *s =
        rpc_client_stream_start(cl, "/moe.v1.Inference/Generate", b, len, 60000, &err);
    free(b);
    if (!s) {
        out->code = RPC_INTERNAL;
        return;
    }
    const uint8_t *data;
    size_t n;
    while (rpc_client_stream_next(s, &data, &n)) {
        Moe__V1__GenerateResponse *m = moe__v1__generate_response__unpack(NULL, n, data);
        if (!m)
            break;
        for (size_t i = 0; i < m->n_token_ids && out->n_ids < 256; i++)
            out->ids[out->n_ids++] = m->token_ids[i];
        if (m->finish_reason) {
            out->finish = m->finish_reason;
            if (m->timings) {
                out->transfer_ms = m->timings->transfer_ms;
                out->ttft_ms = m->timings->ttft_ms;
            }
        }
        moe__v1__generate_response__free_unpacked(m, NULL);
    }
    const char *msg;
    out->code = rpc_client_stream_status(s, &msg);
    snprintf(out->message, sizeof out->message, "%s", msg ? msg : "");
    rpc_client_stream_destroy(s);
    out->wall_ms = moe_now_ms() - t0;
}

static Moe__V1__SamplingParams sampling(uint32_t max_tokens, bool seeded)
{
    Moe__V1__SamplingParams sp = MOE__V1__SAMPLING_PARAMS__INIT;
    sp.max_tokens = max_tokens;
    sp.ignore_eos = true;
    if (seeded) {
        sp.temperature = 0.8f;
        sp.top_p = 0.95f;
        sp.seed_opt_case = MOE__V1__SAMPLING_PARAMS__SEED_OPT_SEED;
        sp.seed = 4242;
    }
    return sp;
}

static size_t make_prompt(int k, uint32_t *p, size_t len)
{
    for (size_t i = 0; i < len; i++)
        p[i] = (uint32_t)((i * 31 + (size_t)k * 97 + 5) % 790);
    return len;
}

/* Waits until the coordinator has learned the workers' roles (n of them). */
static bool wait_roles(struct rpc_client *coord, int n_prefill, int n_decode)
{
    for (int64_t t0 = moe_now_ms(); moe_now_ms() - t0 < 30000; sleep_ms(50)) {
        Moe__V1__ClusterStatusRequest rq = MOE__V1__CLUSTER_STATUS_REQUEST__INIT;
        enum rpc_code code;
        Moe__V1__ClusterStatusResponse *cs =
            call(coord, "/moe.v1.Admin/ClusterStatus", &rq,
                 &moe__v1__cluster_status_response__descriptor, &code, NULL, 0);
        if (!cs)
            continue;
        int p = 0, d = 0;
        for (size_t i = 0; i < cs->n_workers; i++) {
            p += cs->workers[i]->role == MOE__V1__WORKER_ROLE__WORKER_ROLE_PREFILL &&
                 cs->workers[i]->state == MOE__V1__WORKER_STATE__WORKER_STATE_SERVING;
            d += cs->workers[i]->role == MOE__V1__WORKER_ROLE__WORKER_ROLE_DECODE &&
                 cs->workers[i]->state == MOE__V1__WORKER_STATE__WORKER_STATE_SERVING;
        }
        moe__v1__cluster_status_response__free_unpacked(cs, NULL);
        if (p == n_prefill && d == n_decode)
            return true;
    }
    return false;
}

/* ---- cluster tests ---------------------------------------------------------------------- */

#define N_TOK 20

/* Mixed vs disaggregated on the same prompts, greedy and seeded. */
static void test_equal(struct proc *cm, struct proc *cd, struct proc *pw, struct proc *dw)
{
    const size_t lens[] = {1, 5, 16, 17, 40, 120};
    struct gen_out *a = malloc(sizeof *a), *b = malloc(sizeof *b);
    uint32_t prompt[200];
    double t_sum = 0;
    int n_handoffs = 0;
    for (int seeded = 0; seeded < 2; seeded++)
        for (size_t k = 0; k < sizeof lens / sizeof *lens; k++) {
            size_t n = make_prompt((int)k, prompt, lens[k]);
            Moe__V1__SamplingParams sp = sampling(N_TOK, seeded);
            gen_run(cm->cl, prompt, n, &sp, 0, a);
            gen_run(cd->cl, prompt, n, &sp, 0, b);
            CHECKF(a->code == RPC_OK && b->code == RPC_OK, "mixed %s %s / disagg %s %s",
                   rpc_code_name(a->code), a->message, rpc_code_name(b->code), b->message);
            CHECKF(a->n_ids == N_TOK && b->n_ids == N_TOK &&
                       !memcmp(a->ids, b->ids, N_TOK * sizeof *a->ids),
                   "%s prompt of %zu: disaggregated tokens differ from mixed",
                   seeded ? "seeded" : "greedy", lens[k]);
            CHECK(b->finish == MOE__V1__FINISH_REASON__FINISH_REASON_LENGTH);
            CHECKF(b->transfer_ms > 0, "transfer_ms %.3f", b->transfer_ms);
            t_sum += b->transfer_ms;
            n_handoffs++;
        }
    printf("equal: %d prompts identical, mean transfer %.2f ms\n", n_handoffs, t_sum / n_handoffs);
    /* max_tokens 1: finishes on the prefill worker, no handoff. */
    Moe__V1__SamplingParams sp1 = sampling(1, false);
    gen_run(cd->cl, prompt, 10, &sp1, 0, b);
    CHECKF(b->code == RPC_OK && b->n_ids == 1, "max_tokens 1: %s %s", rpc_code_name(b->code),
           b->message);
    free(a);
    free(b);
    uint32_t used, pend;
    CHECKF(wait_pool_whole(pw->cl, 30000, &used, &pend), "prefill pool: %u used, %u pending", used,
           pend);
    CHECKF(wait_pool_whole(dw->cl, 30000, &used, &pend), "decode pool: %u used, %u pending", used,
           pend);
    Moe__V1__WorkerLoad *lp = get_load(pw->cl), *ld = get_load(dw->cl);
    CHECK(lp && ld);
    if (lp && ld) {
        CHECKF(lp->kv_transfers_out >= (uint64_t)n_handoffs &&
                   ld->kv_transfers_in >= (uint64_t)n_handoffs,
               "transfers out %" PRIu64 " in %" PRIu64, lp->kv_transfers_out, ld->kv_transfers_in);
        CHECK(lp->kv_transfer_bytes_out == ld->kv_transfer_bytes_in &&
              lp->kv_transfer_bytes_out > 0);
        CHECK(lp->role == MOE__V1__WORKER_ROLE__WORKER_ROLE_PREFILL &&
              ld->role == MOE__V1__WORKER_ROLE__WORKER_ROLE_DECODE);
        CHECK(lp->kv_transfer_failures == 0 && ld->kv_transfer_failures == 0);
        printf("counters: out %" PRIu64 ", %" PRIu64 " bytes in %.1f ms sending\n",
               lp->kv_transfers_out, lp->kv_transfer_bytes_out, lp->kv_transfer_ms);
    }
    if (lp)
        moe__v1__worker_load__free_unpacked(lp, NULL);
    if (ld)
        moe__v1__worker_load__free_unpacked(ld, NULL);
    /* Admin shows them (after a poll). */
    sleep_ms(300);
    Moe__V1__ClusterStatusRequest rq = MOE__V1__CLUSTER_STATUS_REQUEST__INIT;
    enum rpc_code code;
    Moe__V1__ClusterStatusResponse *cs =
        call(cd->cl, "/moe.v1.Admin/ClusterStatus", &rq,
             &moe__v1__cluster_status_response__descriptor, &code, NULL, 0);
    CHECK(cs != NULL);
    uint64_t out = 0, in = 0, bytes = 0;
    for (size_t i = 0; cs && i < cs->n_workers; i++) {
        out += cs->workers[i]->kv_transfers_out;
        in += cs->workers[i]->kv_transfers_in;
        bytes += cs->workers[i]->kv_transfer_bytes;
    }
    CHECKF(out >= (uint64_t)n_handoffs && in >= (uint64_t)n_handoffs && bytes > 0,
           "Admin ClusterStatus: out %" PRIu64 " in %" PRIu64, out, in);
    if (cs)
        moe__v1__cluster_status_response__free_unpacked(cs, NULL);
}

struct conc_arg {
    struct rpc_client *cl;
    int k;
    struct gen_out out;
};

static void *conc_thread(void *p)
{
    struct conc_arg *a = p;
    uint32_t prompt[80];
    size_t n = make_prompt(100 + a->k, prompt, 8 + (size_t)(a->k * 7) % 70);
    Moe__V1__SamplingParams sp = sampling(16, a->k % 2);
    gen_run(a->cl, prompt, n, &sp, 0, &a->out);
    return NULL;
}

static void test_concurrent(struct proc *cm, struct proc *cd, struct proc *pw, struct proc *dw)
{
    enum { N = 32 };
    struct conc_arg *ref = calloc(N, sizeof *ref), *got = calloc(N, sizeof *got);
    pthread_t th[N];
    for (int i = 0; i < N; i++) {
        ref[i].cl = cm->cl;
        ref[i].k = i;
        conc_thread(&ref[i]);
    }
    int64_t t0 = moe_now_ms();
    for (int i = 0; i < N; i++) {
        got[i].cl = cd->cl;
        got[i].k = i;
        pthread_create(&th[i], NULL, conc_thread, &got[i]);
    }
    int ok = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        bool same = got[i].out.code == RPC_OK && got[i].out.n_ids == 16 && ref[i].out.n_ids == 16 &&
                    !memcmp(got[i].out.ids, ref[i].out.ids, 16 * sizeof(uint32_t));
        if (!same)
            fprintf(stderr, "concurrent %d: %s %s, %zu tokens\n", i, rpc_code_name(got[i].out.code),
                    got[i].out.message, got[i].out.n_ids);
        ok += same;
    }
    printf("concurrent: %d/%d identical to mixed in %" PRId64 " ms\n", ok, N, moe_now_ms() - t0);
    CHECK(ok == N);
    uint32_t used, pend;
    CHECKF(wait_pool_whole(pw->cl, 30000, &used, &pend), "prefill pool: %u used, %u pending", used,
           pend);
    CHECKF(wait_pool_whole(dw->cl, 30000, &used, &pend), "decode pool: %u used, %u pending", used,
           pend);
    free(ref);
    free(got);
}

/* The prefill worker dies mid-transfer (env: how); the request completes by
 * recompute on the decode worker or fails UNAVAILABLE quickly; pools whole. */
static void test_prefill_dies(struct proc *cm, struct proc *dw, char *const env[], bool kill_it,
                              const char *what)
{
    struct proc pf = {0}, co = {0};
    if (worker_start(&pf, "prefill", "256", env)) {
        CHECK(0);
        return;
    }
    char list[300];
    snprintf(list, sizeof list, "%s,%s", pf.addr, dw->addr);
    if (coordinator_start(&co, list) || !wait_roles(co.cl, 1, 1)) {
        CHECK(0);
        return;
    }
    uint32_t prompt[64];
    size_t n = make_prompt(7, prompt, 50);
    Moe__V1__SamplingParams sp = sampling(N_TOK, true);
    struct gen_out *want = malloc(sizeof *want), *got = malloc(sizeof *got);
    gen_run(cm->cl, prompt, n, &sp, 0, want);
    if (kill_it) {
        /* Kill the prefill worker once the decode side holds the reservation
         * (the sender sleeps before each chunk). */
        struct conc_arg a = {.cl = co.cl};
        pthread_t th;
        pthread_create(&th, NULL, conc_thread, &a); /* a different prompt: only timing */
        bool seen = false;
        for (int64_t t0 = moe_now_ms(); moe_now_ms() - t0 < 30000 && !seen; sleep_ms(10)) {
            Moe__V1__WorkerLoad *l = get_load(dw->cl);
            seen = l && l->handoffs_pending > 0;
            if (l)
                moe__v1__worker_load__free_unpacked(l, NULL);
        }
        CHECKF(seen, "%s: the decode worker never held the reservation", what);
        proc_kill(&pf);
        pthread_join(th, NULL);
        /* Reference for that prompt. */
        struct conc_arg r = {.cl = cm->cl, .k = 0};
        conc_thread(&r);
        CHECKF(a.out.code == RPC_OK ? a.out.n_ids == 16 && !memcmp(a.out.ids, r.out.ids, 16 * 4)
                                    : a.out.code == RPC_UNAVAILABLE && a.out.wall_ms < 60000,
               "%s: %s %s after %" PRId64 " ms, %zu tokens", what, rpc_code_name(a.out.code),
               a.out.message, a.out.wall_ms, a.out.n_ids);
        printf("%s: %s in %" PRId64 " ms (%zu tokens)\n", what, rpc_code_name(a.out.code),
               a.out.wall_ms, a.out.n_ids);
    } else {
        gen_run(co.cl, prompt, n, &sp, 30000, got);
        CHECKF(got->code == RPC_OK
                   ? got->n_ids == N_TOK && !memcmp(got->ids, want->ids, N_TOK * sizeof *got->ids)
                   : got->code == RPC_UNAVAILABLE && got->wall_ms < 60000,
               "%s: %s %s after %" PRId64 " ms, %zu tokens", what, rpc_code_name(got->code),
               got->message, got->wall_ms, got->n_ids);
        printf("%s: %s in %" PRId64 " ms (%zu tokens)\n", what, rpc_code_name(got->code),
               got->wall_ms, got->n_ids);
        int st = 0;
        for (int64_t t0 = moe_now_ms(); moe_now_ms() - t0 < 30000; sleep_ms(20))
            if (waitpid(pf.pid, &st, WNOHANG) == pf.pid) {
                child_forget(pf.pid);
                pf.pid = 0;
                break;
            }
        CHECKF(pf.pid == 0 && WIFEXITED(st) && WEXITSTATUS(st) == 3,
               "%s: the prefill worker did not exit by fault injection", what);
    }
    uint32_t used, pend;
    CHECKF(wait_pool_whole(dw->cl, 30000, &used, &pend), "%s: decode pool: %u used, %u pending",
           what, used, pend);
    /* The cluster still serves (recompute on the decode worker). */
    gen_run(co.cl, prompt, n, &sp, 30000, got);
    CHECKF(got->code == RPC_OK && got->n_ids == N_TOK &&
               !memcmp(got->ids, want->ids, N_TOK * sizeof *got->ids),
           "%s: after the prefill worker died: %s %s", what, rpc_code_name(got->code),
           got->message);
    free(want);
    free(got);
    proc_kill(&co);
    proc_kill(&pf);
    rpc_client_destroy(co.cl);
    rpc_client_destroy(pf.cl);
}

/* A decode worker without room refuses; the coordinator chooses another
 * or answers RESOURCE_EXHAUSTED. */
static void test_refuse(struct proc *cm, struct proc *pw, struct proc *dw)
{
    struct proc tiny = {0}, co1 = {0}, co2 = {0};
    if (worker_start(&tiny, "decode", "3", NULL)) {
        CHECK(0);
        return;
    }
    /* Direct: reservation refusals are immediate and clear. */
    Moe__V1__KvReserveRequest rq = MOE__V1__KV_RESERVE_REQUEST__INIT;
    rq.handoff_id = "direct-1";
    rq.n_tokens = 60;
    rq.n_blocks = 4;
    rq.block_size = 16;
    enum rpc_code code;
    char msg[512];
    void *r = call(tiny.cl, "/moe.v1.Worker/KvReserve", &rq,
                   &moe__v1__kv_reserve_response__descriptor, &code, msg, sizeof msg);
    CHECKF(!r && code == RPC_RESOURCE_EXHAUSTED && strstr(msg, "no free KV blocks"),
           "tiny KvReserve: %s %s", rpc_code_name(code), msg);
    /* Fits the pool but not what is free now. */
    rq.n_tokens = 40;
    rq.n_blocks = 3;
    r = call(tiny.cl, "/moe.v1.Worker/KvReserve", &rq, &moe__v1__kv_reserve_response__descriptor,
             &code, msg, sizeof msg);
    CHECKF(r && code == RPC_OK, "tiny KvReserve of 3: %s %s", rpc_code_name(code), msg);
    if (r)
        moe__v1__kv_reserve_response__free_unpacked(r, NULL);
    rq.handoff_id = "direct-2";
    rq.n_tokens = 10;
    rq.n_blocks = 1;
    r = call(tiny.cl, "/moe.v1.Worker/KvReserve", &rq, &moe__v1__kv_reserve_response__descriptor,
             &code, msg, sizeof msg);
    CHECKF(!r && code == RPC_RESOURCE_EXHAUSTED && strstr(msg, "no free KV blocks"),
           "tiny KvReserve when full: %s %s", rpc_code_name(code), msg);
    Moe__V1__KvReleaseRequest rel = MOE__V1__KV_RELEASE_REQUEST__INIT;
    rel.handoff_id = "direct-1";
    rel.reason = "test";
    Moe__V1__KvReleaseResponse *rr =
        call(tiny.cl, "/moe.v1.Worker/KvRelease", &rel, &moe__v1__kv_release_response__descriptor,
             &code, msg, sizeof msg);
    CHECK(rr && rr->found);
    if (rr)
        moe__v1__kv_release_response__free_unpacked(rr, NULL);
    uint32_t used0, pend0;
    CHECKF(wait_pool_whole(tiny.cl, 30000, &used0, &pend0),
           "tiny after release: %u used, %u "
           "pending",
           used0, pend0);
    /* Another model's KV layout is refused by name; another block size is not
     * (the receiver counts blocks in its own size). */
    rq.handoff_id = "direct-3";
    rq.block_size = 8;
    rq.n_tokens = 60;
    rq.n_blocks = 0;
    rq.n_kv_heads = 3;
    r = call(dw->cl, "/moe.v1.Worker/KvReserve", &rq, &moe__v1__kv_reserve_response__descriptor,
             &code, msg, sizeof msg);
    CHECKF(!r && code == RPC_FAILED_PRECONDITION && strstr(msg, "KV layout"),
           "KV layout mismatch: %s %s", rpc_code_name(code), msg);
    rq.n_kv_heads = 0;
    r = call(dw->cl, "/moe.v1.Worker/KvReserve", &rq, &moe__v1__kv_reserve_response__descriptor,
             &code, msg, sizeof msg);
    Moe__V1__KvReserveResponse *ok = r;
    CHECKF(ok && ok->n_block_ids == (60 + ok->block_size - 1) / ok->block_size &&
               ok->n_rank_endpoints == 1 && ok->tp_size == 1,
           "another block size: %s %s", rpc_code_name(code), msg);
    if (ok)
        moe__v1__kv_reserve_response__free_unpacked(ok, NULL);
    rel.handoff_id = "direct-3";
    rr = call(dw->cl, "/moe.v1.Worker/KvRelease", &rel, &moe__v1__kv_release_response__descriptor,
              &code, msg, sizeof msg);
    CHECK(rr && rr->found);
    if (rr)
        moe__v1__kv_release_response__free_unpacked(rr, NULL);
    CHECKF(wait_pool_whole(dw->cl, 30000, &used0, &pend0),
           "decode after release: %u used, %u pending", used0, pend0);

    char list[400];
    snprintf(list, sizeof list, "%s,%s", pw->addr, tiny.addr);
    if (coordinator_start(&co1, list) || !wait_roles(co1.cl, 1, 1)) {
        CHECK(0);
        return;
    }
    uint32_t prompt[64];
    size_t n = make_prompt(3, prompt, 60);
    Moe__V1__SamplingParams sp = sampling(8, false);
    struct gen_out *o = malloc(sizeof *o), *want = malloc(sizeof *want);
    gen_run(co1.cl, prompt, n, &sp, 20000, o);
    CHECKF(o->code == RPC_RESOURCE_EXHAUSTED && o->wall_ms < 60000,
           "no room anywhere: %s %s after %" PRId64 " ms", rpc_code_name(o->code), o->message,
           o->wall_ms);
    printf("refuse: %s '%s' in %" PRId64 " ms\n", rpc_code_name(o->code), o->message, o->wall_ms);
    uint32_t used, pend;
    CHECKF(wait_pool_whole(pw->cl, 30000, &used, &pend), "prefill pool: %u used, %u pending", used,
           pend);
    CHECKF(wait_pool_whole(tiny.cl, 30000, &used, &pend), "tiny pool: %u used, %u pending", used,
           pend);
    /* A short prompt fits the tiny worker. */
    gen_run(co1.cl, prompt, 20, &sp, 20000, o);
    gen_run(cm->cl, prompt, 20, &sp, 20000, want);
    CHECKF(o->code == RPC_OK && o->n_ids == 8 && !memcmp(o->ids, want->ids, 8 * 4),
           "short prompt via tiny: %s %s", rpc_code_name(o->code), o->message);

    /* With a roomy decode worker too, the long prompt goes there. */
    snprintf(list, sizeof list, "%s,%s,%s", pw->addr, tiny.addr, dw->addr);
    if (coordinator_start(&co2, list) || !wait_roles(co2.cl, 1, 2)) {
        CHECK(0);
        return;
    }
    gen_run(co2.cl, prompt, n, &sp, 20000, o);
    gen_run(cm->cl, prompt, n, &sp, 20000, want);
    CHECKF(o->code == RPC_OK && o->n_ids == 8 && !memcmp(o->ids, want->ids, 8 * 4),
           "another choice: %s %s", rpc_code_name(o->code), o->message);
    free(o);
    free(want);
    proc_kill(&co1);
    proc_kill(&co2);
    proc_kill(&tiny);
    rpc_client_destroy(co1.cl);
    rpc_client_destroy(co2.cl);
    rpc_client_destroy(tiny.cl);
}

static int run_cluster(void)
{
    struct proc mw = {0}, pw = {0}, dw = {0}, cm = {0}, cd = {0};
    if (worker_start(&mw, "mixed", "256", NULL) || worker_start(&pw, "prefill", "256", NULL) ||
        worker_start(&dw, "decode", "256", NULL) || coordinator_start(&cm, mw.addr))
        return 1;
    char list[300];
    snprintf(list, sizeof list, "%s,%s", pw.addr, dw.addr);
    if (coordinator_start(&cd, list))
        return 1;
    CHECK(wait_roles(cd.cl, 1, 1));
    int64_t t0 = moe_now_ms();
    test_equal(&cm, &cd, &pw, &dw);
    printf("equal: %" PRId64 " ms\n", moe_now_ms() - t0);
    test_concurrent(&cm, &cd, &pw, &dw);
    printf("through concurrent: %" PRId64 " ms\n", moe_now_ms() - t0);
    char *die_env[] = {"MOE_TEST_FAULTS=1", "MOE_FAULT_DIE_DURING_TRANSFER=1", NULL};
    test_prefill_dies(&cm, &dw, die_env, false, "prefill exits after its first chunk");
    char *delay_env[] = {"MOE_TEST_FAULTS=1", "MOE_FAULT_TRANSFER_DELAY_MS=400", NULL};
    test_prefill_dies(&cm, &dw, delay_env, true, "prefill killed mid-transfer");
    printf("through faults: %" PRId64 " ms\n", moe_now_ms() - t0);
    test_refuse(&cm, &pw, &dw);
    printf("through refuse: %" PRId64 " ms\n", moe_now_ms() - t0);
    struct proc *all[] = {&cd, &cm, &dw, &pw, &mw};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) {
        rpc_client_destroy(all[i]->cl);
        kill(all[i]->pid, SIGTERM);
    }
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) {
        int st = -1;
        for (int64_t t1 = moe_now_ms(); moe_now_ms() - t1 < 60000; sleep_ms(20))
            if (waitpid(all[i]->pid, &st, WNOHANG) == all[i]->pid) {
                child_forget(all[i]->pid);
                break;
            }
        CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "process %zu exit status %d after SIGTERM", i,
               st);
    }
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 2 && !strcmp(argv[1], "engine"))
        return run_engine() ? 1 : test_summary();
    if (argc != 3 || strcmp(argv[1], "cluster")) {
        fprintf(stderr, "usage: test_disagg engine | cluster BIN_DIR\n");
        return 2;
    }
    g_bin = argv[2];
    g_model = test_src_path("tests/golden/fixtures/qwen3_moe");
    static char model[1024];
    snprintf(model, sizeof model, "%s", g_model);
    g_model = model;
    children_guard();
    signal(SIGPIPE, SIG_IGN);
    alarm(900); /* bounds a hang; a sanitized run on two loaded cores is slow */
    int rc = run_cluster();
    children_kill_all();
    if (rc)
        return test_summary(), 1;
    return test_summary();
}
