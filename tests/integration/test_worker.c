/* moe-worker as a real process, driven over gRPC:
 *  - Generate streams the same greedy tokens as the in-process generator;
 *  - bad fields are INVALID_ARGUMENT naming the field;
 *  - 8 concurrent streams complete;
 *  - a client cancel mid-stream and a passed deadline_ms both free the KV;
 *  - Abort by request id ends the stream with FINISH_REASON_ABORT;
 *  - SIGTERM drains: health NOT_SERVING, new work UNAVAILABLE, the running
 *    request completes, exit 0.
 *
 *   test_worker MOE_WORKER_BINARY MODEL_DIR */
#include <pthread.h>

#include "rpcutil.h"
#include "backend.h"
#include "engine/generate.h"
#include "moe/v1/health.pb-c.h"
#include "moe/v1/worker.pb-c.h"
#include "proc.h"
#include "rpc.h"
#include "testlib.h"

static const char *model_dir;
static char addr[64];

struct gen_result {
    uint32_t tokens[512];
    int n;
    Moe__V1__FinishReason finish;
    enum rpc_code code;
    char message[256];
};

/* Called once, from the reading loop, after act_after tokens arrived. */
typedef void (*gen_act_fn)(void *user, struct rpc_client_stream *st);

/* Runs one Generate; with act_after > 0 calls act(act_user, stream) once that
 * many tokens arrived. */
static void generate_hooked(struct rpc_client *c, const char *id, const uint32_t *prompt,
                            size_t n_prompt, uint32_t max_tokens, uint32_t deadline_ms,
                            float temperature, int act_after, gen_act_fn act, void *act_user,
                            struct gen_result *out)
{
    memset(out, 0, sizeof *out);
    Moe__V1__WorkerGenerateRequest rq = MOE__V1__WORKER_GENERATE_REQUEST__INIT;
    Moe__V1__SamplingParams sp = MOE__V1__SAMPLING_PARAMS__INIT;
    rq.request_id = (char *)id;
    rq.n_prompt_token_ids = n_prompt;
    rq.prompt_token_ids = (uint32_t *)prompt;
    rq.sampling = &sp;
    rq.deadline_ms = deadline_ms;
    sp.max_tokens = max_tokens;
    sp.ignore_eos = true;
    sp.temperature = temperature;
    size_t len;
    uint8_t *b = pack(&rq.base, &len);
    struct moe_error err;
    struct rpc_client_stream *st =
        rpc_client_stream_start(c, "/moe.v1.Worker/Generate", b, len, 60000, &err);
    free(b);
    if (!st) {
        out->code = RPC_INTERNAL;
        return;
    }
    const uint8_t *m;
    size_t ml;
    bool acted = false;
    while (rpc_client_stream_next(st, &m, &ml)) {
        Moe__V1__GenerateResponse *r = moe__v1__generate_response__unpack(NULL, ml, m);
        if (!r)
            continue;
        for (size_t i = 0; i < r->n_token_ids && out->n < 512; i++)
            out->tokens[out->n++] = r->token_ids[i];
        if (r->finish_reason)
            out->finish = r->finish_reason;
        moe__v1__generate_response__free_unpacked(r, NULL);
        if (act_after > 0 && out->n >= act_after && !acted) {
            acted = true;
            act(act_user, st);
        }
    }
    const char *msg = NULL;
    out->code = rpc_client_stream_status(st, &msg);
    snprintf(out->message, sizeof out->message, "%s", msg ? msg : "");
    rpc_client_stream_destroy(st);
}

static void act_cancel(void *user, struct rpc_client_stream *st)
{
    (void)user;
    rpc_client_stream_cancel(st);
}

/* Runs one Generate; with cancel_after > 0 cancels after that many tokens. */
static void generate(struct rpc_client *c, const char *id, const uint32_t *prompt, size_t n_prompt,
                     uint32_t max_tokens, uint32_t deadline_ms, float temperature, int cancel_after,
                     struct gen_result *out)
{
    generate_hooked(c, id, prompt, n_prompt, max_tokens, deadline_ms, temperature, cancel_after,
                    act_cancel, NULL, out);
}

/* Waits until the worker holds no KV block and runs nothing. */
static bool kv_returns_to_zero(struct rpc_client *c, double timeout_s)
{
    double end = moe_now() + timeout_s;
    while (moe_now() < end) {
        Moe__V1__WorkerLoad *l = get_load(c);
        bool idle = l && l->kv_blocks_used == 0 && l->running == 0 && l->waiting == 0;
        if (l)
            moe__v1__worker_load__free_unpacked(l, NULL);
        if (idle)
            return true;
        usleep(20 * 1000);
    }
    return false;
}

static int health(struct rpc_client *c)
{
    Grpc__Health__V1__HealthCheckRequest rq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    rq.service = "";
    size_t len;
    uint8_t *b = pack(&rq.base, &len);
    struct rpc_reply reply;
    int status = -1;
    if (rpc_client_call(c, "/grpc.health.v1.Health/Check", b, len, 5000, &reply) == RPC_OK) {
        Grpc__Health__V1__HealthCheckResponse *r =
            grpc__health__v1__health_check_response__unpack(NULL, reply.len, reply.data);
        if (r) {
            status = (int)r->status;
            grpc__health__v1__health_check_response__free_unpacked(r, NULL);
        }
    }
    rpc_reply_clear(&reply);
    free(b);
    return status;
}

static void test_tokens_match(struct rpc_client *c)
{
    /* reference: the same model in-process, as the worker loads it (its
     * defaults: fast mode, the backend's KV dtype) */
    struct moe_backend *be = NULL;
    struct moe_model *m = NULL;
    struct moe_error err = {0};
    CHECK(moe_backend_create("cpu", 1, &be, &err) == MOE_OK);
    struct moe_model_opts mo = {.dtype = MOE_DTYPE_F32,
                                .tp_size = 1,
                                .fast = true,
                                .kv_dtype = moe_backend_default_kv_dtype(be)};
    CHECKF(moe_model_load(model_dir, &mo, be, &m, &err) == MOE_OK, "%s", err.msg);
    int32_t prompt[7] = {11, 22, 33, 44, 55, 66, 77};
    uint32_t uprompt[7];
    for (int i = 0; i < 7; i++)
        uprompt[i] = (uint32_t)prompt[i];
    struct moe_gen_opts go = {.n_predict = 24, .ignore_eos = true};
    struct moe_gen_result ref = {0};
    CHECK(m && moe_generate(m, prompt, 7, &go, NULL, &ref, &err) == MOE_OK);
    struct gen_result got;
    generate(c, "match", uprompt, 7, 24, 0, 0, 0, &got);
    CHECKF(got.code == RPC_OK, "%s: %s", rpc_code_name(got.code), got.message);
    CHECK(got.finish == MOE__V1__FINISH_REASON__FINISH_REASON_LENGTH);
    bool same = got.n == ref.n_tokens;
    for (int i = 0; same && i < got.n; i++)
        same = got.tokens[i] == (uint32_t)ref.tokens[i];
    CHECKF(same, "gRPC stream differs from moe_generate (%d vs %d tokens)", got.n, ref.n_tokens);
    moe_gen_result_free(&ref);
    moe_model_free(m);
    moe_backend_destroy(be);
}

static void expect_invalid(struct rpc_client *c, const Moe__V1__WorkerGenerateRequest *rq,
                           const char *field)
{
    size_t len;
    uint8_t *b = pack(&rq->base, &len);
    struct moe_error err;
    struct rpc_client_stream *st =
        rpc_client_stream_start(c, "/moe.v1.Worker/Generate", b, len, 5000, &err);
    free(b);
    const uint8_t *m;
    size_t ml;
    while (st && rpc_client_stream_next(st, &m, &ml))
        ;
    const char *msg = "";
    enum rpc_code code = st ? rpc_client_stream_status(st, &msg) : RPC_INTERNAL;
    CHECKF(code == RPC_INVALID_ARGUMENT && msg && strstr(msg, field), "%s: got %s '%s'", field,
           rpc_code_name(code), msg ? msg : "");
    rpc_client_stream_destroy(st);
}

static void test_bad_fields(struct rpc_client *c)
{
    uint32_t prompt[2] = {1, 2}, bad_id[1] = {999999};
    Moe__V1__WorkerGenerateRequest rq = MOE__V1__WORKER_GENERATE_REQUEST__INIT;
    Moe__V1__SamplingParams sp = MOE__V1__SAMPLING_PARAMS__INIT;
    rq.sampling = &sp;
    sp.max_tokens = 4;
    expect_invalid(c, &rq, "prompt");
    rq.n_prompt_token_ids = 1;
    rq.prompt_token_ids = bad_id;
    expect_invalid(c, &rq, "prompt_token_ids[0]");
    rq.n_prompt_token_ids = 2;
    rq.prompt_token_ids = prompt;
    sp.top_p = 2;
    expect_invalid(c, &rq, "sampling.top_p");
    sp.top_p = 0;
    sp.max_tokens = 100000;
    expect_invalid(c, &rq, "sampling.max_tokens");
    sp.max_tokens = 4;
    char *stops[9] = {"a", "b", "c", "d", "e", "f", "g", "h", "i"};
    sp.n_stop = 9;
    sp.stop = stops;
    expect_invalid(c, &rq, "sampling.stop");
    sp.n_stop = 0;
    sp.logprobs_opt_case = MOE__V1__SAMPLING_PARAMS__LOGPROBS_OPT_LOGPROBS;
    sp.logprobs = 50;
    expect_invalid(c, &rq, "sampling.logprobs");
}

struct conc_arg {
    struct rpc_client *c;
    int i;
    struct gen_result r;
};

static void *conc_main(void *p)
{
    struct conc_arg *a = p;
    uint32_t prompt[5] = {(uint32_t)(3 + a->i), 9, 27, 81, (uint32_t)(100 + a->i)};
    char id[32];
    snprintf(id, sizeof id, "conc-%d", a->i);
    generate(a->c, id, prompt, 5, 16, 0, 0.7f, 0, &a->r);
    return NULL;
}

static void test_concurrent(struct rpc_client *c)
{
    struct conc_arg args[8];
    pthread_t th[8];
    for (int i = 0; i < 8; i++) {
        args[i] = (struct conc_arg){.c = c, .i = i};
        pthread_create(&th[i], NULL, conc_main, &args[i]);
    }
    int ok = 0;
    for (int i = 0; i < 8; i++) {
        pthread_join(th[i], NULL);
        ok += args[i].r.code == RPC_OK && args[i].r.n == 16;
    }
    CHECKF(ok == 8, "%d of 8 concurrent streams complete", ok);
}

static void test_cancel_and_deadline(struct rpc_client *c)
{
    uint32_t prompt[3] = {5, 6, 7};
    struct gen_result r;
    generate(c, "cancel", prompt, 3, 240, 0, 0, 3, &r);
    CHECK(r.code == RPC_CANCELLED && r.n >= 3);
    CHECK(kv_returns_to_zero(c, 30.0));

    /* deadline_ms of 1: 250 tokens cannot be done in time; the worker aborts
     * the request at its next step and ends the call with DEADLINE_EXCEEDED */
    uint32_t p5[5] = {3, 1, 4, 1, 5};
    double t0 = moe_now();
    generate(c, "deadline", p5, 5, 250, 1, 0, 0, &r);
    double took = moe_now() - t0;
    CHECKF(r.code == RPC_DEADLINE_EXCEEDED && r.n < 250, "deadline: %s '%s' after %d tokens",
           rpc_code_name(r.code), r.message, r.n);
    printf("deadline: ended after %d tokens, %.0f ms\n", r.n, took * 1e3);
    CHECK(kv_returns_to_zero(c, 30.0));
}

struct abort_arg {
    struct rpc_client *c;
    struct gen_result r;
};

static void *abort_stream(void *p)
{
    struct abort_arg *a = p;
    uint32_t prompt[3] = {8, 9, 10};
    generate(a->c, "to-abort", prompt, 3, 240, 0, 0, 0, &a->r);
    return NULL;
}

static void test_abort(struct rpc_client *c)
{
    struct abort_arg a = {.c = c};
    pthread_t th;
    pthread_create(&th, NULL, abort_stream, &a);
    Moe__V1__AbortRequest rq = MOE__V1__ABORT_REQUEST__INIT;
    rq.request_id = "to-abort";
    size_t len;
    uint8_t *b = pack(&rq.base, &len);
    bool found = false;
    for (double end = moe_now() + 30; !found && moe_now() < end;) {
        struct rpc_reply reply;
        if (rpc_client_call(c, "/moe.v1.Worker/Abort", b, len, 5000, &reply) == RPC_OK) {
            Moe__V1__AbortResponse *r =
                moe__v1__abort_response__unpack(NULL, reply.len, reply.data);
            found = r && r->found;
            if (r)
                moe__v1__abort_response__free_unpacked(r, NULL);
        }
        rpc_reply_clear(&reply);
        if (!found)
            usleep(5000);
    }
    free(b);
    pthread_join(th, NULL);
    CHECK(found);
    CHECKF(a.r.finish == MOE__V1__FINISH_REASON__FINISH_REASON_ABORT && a.r.n < 240,
           "abort: finish %d after %d tokens", a.r.finish, a.r.n);
    CHECK(kv_returns_to_zero(c, 30.0));
}

static bool worker_draining(struct rpc_client *c)
{
    Moe__V1__WorkerLoad *l = get_load(c);
    bool d = l && l->draining;
    if (l)
        moe__v1__worker_load__free_unpacked(l, NULL);
    return d;
}

struct drain_ctx {
    struct rpc_client *c;
    pid_t pid;
    bool draining, refused;
    struct gen_result late;
};

/* With the request in flight: SIGTERM, wait until the worker reports that
 * it drains, then new work must be refused by the draining worker itself. */
static void act_drain(void *user, struct rpc_client_stream *st)
{
    (void)st;
    struct drain_ctx *d = user;
    kill(d->pid, SIGTERM);
    for (double end = moe_now() + 30; !d->draining && moe_now() < end;)
        if (!(d->draining = worker_draining(d->c)))
            usleep(5000);
    uint32_t prompt[2] = {1, 2};
    generate(d->c, "late", prompt, 2, 2, 0, 0, 0, &d->late);
    d->refused = d->late.code == RPC_UNAVAILABLE && strstr(d->late.message, "draining");
}

/* Abort, then SIGTERM with a request in flight: the worker says it drains,
 * refuses new work naming the reason, lets the running request finish,
 * exits 0. Its own worker runs every step 10 ms slower (a test-only fault
 * hook), so a request stays in flight for seconds while the test looks. */
static void test_drain(char *const wargv[])
{
    setenv("MOE_TEST_FAULTS", "1", 1);
    setenv("MOE_FAULT_STEP_DELAY_MS", "10", 1);
    struct test_proc w;
    int started = test_proc_start(&w, wargv);
    unsetenv("MOE_FAULT_STEP_DELAY_MS");
    unsetenv("MOE_TEST_FAULTS");
    const char *line = started ? NULL : test_proc_wait_for(&w, " on 127.0.0.1:", 30);
    CHECKF(line != NULL, "drain worker did not start");
    if (!line)
        return;
    char a2[64];
    snprintf(a2, sizeof a2, "127.0.0.1:%d", atoi(line + strlen(" on 127.0.0.1:")));
    struct moe_error err;
    struct rpc_client *c = rpc_client_create(a2, NULL, &err);
    CHECK(c && health(c) == 1); /* SERVING */
    if (!c) {
        test_proc_kill(&w);
        return;
    }
    test_abort(c); /* here, where 240 tokens take seconds: Abort cannot come too late */
    /* the request in flight: SIGTERM goes out once its second token arrived */
    uint32_t prompt[4] = {12, 13, 14, 15};
    struct gen_result in_flight;
    double t0 = moe_now();
    struct drain_ctx d = {.c = c, .pid = w.pid};
    generate_hooked(c, "during-drain", prompt, 4, 200, 0, 0, 2, act_drain, &d, &in_flight);
    printf("drain: the in-flight request took %.0f ms\n", (moe_now() - t0) * 1e3);
    CHECKF(in_flight.code == RPC_OK && in_flight.n == 200,
           "in-flight request during drain: %s, %d tokens", rpc_code_name(in_flight.code),
           in_flight.n);
    CHECKF(d.draining, "the worker never reported draining after SIGTERM");
    CHECKF(d.refused, "late request during drain: %s '%s'", rpc_code_name(d.late.code),
           d.late.message);
    CHECK(test_proc_wait(&w, 60));
    CHECKF(test_proc_exit_code(&w) == 0, "worker exit code %d", test_proc_exit_code(&w));
    rpc_client_destroy(c);
    test_proc_kill(&w);
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: test_worker MOE_WORKER MODEL_DIR\n");
        return 2;
    }
    model_dir = argv[2];
    struct test_proc w;
    char *wargv[] = {argv[1], "--model",  argv[2],       "--dtype",     "f32", "--threads",
                     "1",     "--listen", "127.0.0.1:0", "--kv-blocks", "512", NULL};
    CHECK(test_proc_start(&w, wargv) == 0);
    const char *line = test_proc_wait_for(&w, " on 127.0.0.1:", 30);
    CHECKF(line != NULL, "worker did not start: %s", w.buf);
    if (!line) {
        test_proc_kill(&w);
        return test_summary();
    }
    int port = atoi(line + strlen(" on 127.0.0.1:"));
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    struct moe_error err;
    struct rpc_client *c = rpc_client_create(addr, NULL, &err);
    CHECK(c != NULL);
    if (c) {
        test_tokens_match(c);
        test_bad_fields(c);
        test_concurrent(c);
        test_cancel_and_deadline(c);
        CHECK(kv_returns_to_zero(c, 30.0));
        rpc_client_destroy(c);
    }
    test_proc_kill(&w);
    test_drain(wargv);
    return test_summary();
}
