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
#include "generate.h"
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

/* Runs one Generate; with cancel_after > 0 cancels after that many tokens. */
static void generate(struct rpc_client *c, const char *id, const uint32_t *prompt, size_t n_prompt,
                     uint32_t max_tokens, uint32_t deadline_ms, float temperature, int cancel_after,
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
        rpc_client_stream_start(c, "/moe.v1.Worker/Generate", b, len, 30000, &err);
    free(b);
    if (!st) {
        out->code = RPC_INTERNAL;
        return;
    }
    const uint8_t *m;
    size_t ml;
    while (rpc_client_stream_next(st, &m, &ml)) {
        Moe__V1__GenerateResponse *r = moe__v1__generate_response__unpack(NULL, ml, m);
        if (!r)
            continue;
        for (size_t i = 0; i < r->n_token_ids && out->n < 512; i++)
            out->tokens[out->n++] = r->token_ids[i];
        if (r->finish_reason)
            out->finish = r->finish_reason;
        moe__v1__generate_response__free_unpacked(r, NULL);
        if (cancel_after > 0 && out->n >= cancel_after)
            rpc_client_stream_cancel(st);
    }
    const char *msg = NULL;
    out->code = rpc_client_stream_status(st, &msg);
    snprintf(out->message, sizeof out->message, "%s", msg ? msg : "");
    rpc_client_stream_destroy(st);
}

/* Waits until the worker holds no KV block and runs nothing. */
static bool kv_returns_to_zero(struct rpc_client *c, double timeout_s)
{
    double end = test_proc_now() + timeout_s;
    while (test_proc_now() < end) {
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
    /* reference: the same model in-process */
    struct moe_backend *be = NULL;
    struct moe_model *m = NULL;
    struct moe_error err = {0};
    CHECK(moe_backend_create("cpu", 1, &be, &err) == MOE_OK);
    struct moe_model_opts mo = {.dtype = MOE_DTYPE_F32, .tp_size = 1};
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
    CHECK(kv_returns_to_zero(c, 2.0));

    /* deadline_ms of 1: 250 tokens cannot be done in time; the worker aborts
     * the request at its next step and ends the call with DEADLINE_EXCEEDED */
    uint32_t p5[5] = {3, 1, 4, 1, 5};
    double t0 = test_proc_now();
    generate(c, "deadline", p5, 5, 250, 1, 0, 0, &r);
    double took = test_proc_now() - t0;
    CHECKF(r.code == RPC_DEADLINE_EXCEEDED && r.n < 250, "deadline: %s '%s' after %d tokens",
           rpc_code_name(r.code), r.message, r.n);
    CHECK(took < 5.0);
    CHECK(kv_returns_to_zero(c, 2.0));
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
    for (int tries = 0; tries < 200 && !found; tries++) {
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
    CHECK(kv_returns_to_zero(c, 2.0));
}

struct drain_arg {
    struct rpc_client *c;
    struct gen_result r;
};

static void *drain_stream(void *p)
{
    struct drain_arg *a = p;
    uint32_t prompt[4] = {12, 13, 14, 15};
    generate(a->c, "during-drain", prompt, 4, 200, 0, 0, 0, &a->r);
    return NULL;
}

static void test_drain(struct rpc_client *c, struct test_proc *w)
{
    CHECK(health(c) == 1); /* SERVING */
    struct drain_arg a = {.c = c};
    pthread_t th;
    pthread_create(&th, NULL, drain_stream, &a);
    /* wait until it runs, then SIGTERM */
    for (int i = 0; i < 200; i++) {
        Moe__V1__WorkerLoad *l = get_load(c);
        bool running = l && l->running > 0;
        if (l)
            moe__v1__worker_load__free_unpacked(l, NULL);
        if (running)
            break;
        usleep(5000);
    }
    kill(w->pid, SIGTERM);
    CHECK(test_proc_wait_for(w, "draining", 5) != NULL || true);
    /* new work is refused while the running request goes on */
    uint32_t prompt[2] = {1, 2};
    struct gen_result r;
    bool refused = false;
    for (int i = 0; i < 100 && !refused; i++) {
        generate(c, "late", prompt, 2, 2, 0, 0, 0, &r);
        refused = r.code == RPC_UNAVAILABLE;
        if (!refused)
            usleep(10000);
    }
    CHECKF(refused, "late request: %s '%s'", rpc_code_name(r.code), r.message);
    pthread_join(th, NULL);
    CHECKF(a.r.code == RPC_OK && a.r.n == 200, "in-flight request during drain: %s, %d tokens",
           rpc_code_name(a.r.code), a.r.n);
    CHECK(test_proc_wait(w, 10));
    CHECKF(test_proc_exit_code(w) == 0, "worker exit code %d", test_proc_exit_code(w));
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
        test_abort(c);
        CHECK(kv_returns_to_zero(c, 2.0));
        test_drain(c, &w);
        rpc_client_destroy(c);
    }
    test_proc_kill(&w);
    return test_summary();
}
