/* Integration test of moe-coordinator with real moe-worker processes on
 * loopback (free ports), driven by a C client over common/rpc.h.
 *
 *   test_cluster static BIN_DIR   two workers + a coordinator with --workers
 *   test_cluster etcd BIN_DIR     a private etcd, workers registering in it,
 *                                 a coordinator with --etcd (skipped, 77,
 *                                 without an etcd binary)
 *
 * Every child is killed at exit (atexit, fatal signals, an alarm bounding the
 * whole run, and PR_SET_PDEATHSIG if this process dies). The workers serve a
 * copy of the tiny qwen3_moe fixture whose context is raised to 16384 tokens
 * (same weights, so greedy tokens match moe-generate) so that long requests
 * are still running when the test cancels, aborts or kills them. */
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
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cluster.h"
#include "proc.h"
#include "rpcutil.h"
#include "etcd.h"
#include "moe/v1/health.pb-c.h"
#include "moe/v1/admin.pb-c.h"
#include "moe/v1/inference.pb-c.h"
#include "moe/v1/worker.pb-c.h"
#include "rpc.h"
#include "testlib.h"
#include "tokenizer.h"

#define LONG_TOKENS 12000 /* several seconds of decoding on the tiny model */

static const char *g_bin;
static char g_model[600]; /* the long-context copy: DIR/qwen3_moe */
static char g_tmp[512];

struct proc {
    pid_t pid;
    char addr[128];
    char id[128];
};

/* Starts a worker (f32 weights, one thread). listen: "127.0.0.1:0" or a
 * fixed address; etcd may be NULL. */
static int worker_start(struct proc *p, const char *id, const char *listen, const char *etcd)
{
    char bin[600];
    snprintf(bin, sizeof bin, "%s/moe-worker", g_bin);
    char *argv[20] = {bin,       "--model",     g_model,     "--listen", (char *)listen,
                      "--dtype", "f32",         "--threads", "1",        "--kv-memory",
                      "64",      "--worker-id", (char *)id};
    int n = 13;
    if (etcd) {
        argv[n++] = "--etcd";
        argv[n++] = (char *)etcd;
        argv[n++] = "--lease-ttl";
        argv[n++] = "2";
    }
    argv[n] = NULL;
    int fd;
    snprintf(p->id, sizeof p->id, "%s", id);
    p->pid = child_spawn(argv, NULL, &fd, NULL);
    if (p->pid < 0 || read_address(fd, p->addr, sizeof p->addr, 20000)) {
        fprintf(stderr, "worker %s did not start\n", id);
        return -1;
    }
    return 0;
}

static int coordinator_start_poll(struct proc *p, const char *flag, const char *value,
                                  const char *poll_ms, const char *max_queue)
{
    char bin[600];
    snprintf(bin, sizeof bin, "%s/moe-coordinator", g_bin);
    char *argv[] = {bin,           "--model",         g_model,     "--listen",      "127.0.0.1:0",
                    (char *)flag,  (char *)value,     "--poll-ms", (char *)poll_ms, "--grace-ms",
                    "120000", /* only bounds a hang: a stream at SIGTERM must finish */
                    "--max-queue", (char *)max_queue, NULL};
    int fd;
    p->pid = child_spawn(argv, NULL, &fd, NULL);
    if (p->pid < 0 || read_address(fd, p->addr, sizeof p->addr, 20000)) {
        fprintf(stderr, "coordinator did not start\n");
        return -1;
    }
    return 0;
}

static int coordinator_start(struct proc *p, const char *flag, const char *value)
{
    return coordinator_start_poll(p, flag, value, "100", "256");
}

/* ---- client helpers -------------------------------------------------------------------- */

/* What one Generate produced. */
struct gen_out {
    enum rpc_code code;
    char message[512];
    uint32_t ids[LONG_TOKENS + 64];
    size_t n_ids;
    char text[65536];
    size_t text_len;
    int n_msgs;
    int finish;                 /* finish_reason of the last message */
    uint32_t completion_tokens; /* usage of the last message */
    bool ids_echoed;            /* every message carried the request id */
    bool logprobs_ok;           /* every token had a logprob entry with the top count asked */
};

/* Called after each message; return false to stop reading (the stream is
 * then cancelled). */
typedef bool (*gen_hook)(void *user, struct gen_out *out, struct rpc_client_stream *s);

static void gen_run(struct rpc_client *cl, const Moe__V1__GenerateRequest *rq, gen_hook hook,
                    void *user, struct gen_out *out)
{
    memset(out, 0, sizeof *out);
    out->ids_echoed = out->logprobs_ok = true;
    size_t len;
    void *b = pack(rq, &len);
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
    bool want_lp = rq->sampling && rq->sampling->logprobs_opt_case ==
                                       MOE__V1__SAMPLING_PARAMS__LOGPROBS_OPT_LOGPROBS;
    while (rpc_client_stream_next(s, &data, &n)) {
        Moe__V1__GenerateResponse *m = moe__v1__generate_response__unpack(NULL, n, data);
        if (!m)
            break;
        out->n_msgs++;
        if (rq->request_id[0] && strcmp(m->request_id, rq->request_id))
            out->ids_echoed = false;
        for (size_t i = 0; i < m->n_token_ids && out->n_ids < LONG_TOKENS + 64; i++)
            out->ids[out->n_ids++] = m->token_ids[i];
        size_t tl = strlen(m->text);
        if (out->text_len + tl < sizeof out->text) {
            memcpy(out->text + out->text_len, m->text, tl + 1);
            out->text_len += tl;
        }
        if (want_lp) {
            if (m->n_logprobs != m->n_token_ids)
                out->logprobs_ok = false;
            for (size_t i = 0; i < m->n_logprobs; i++)
                if (m->logprobs[i]->n_top != rq->sampling->logprobs ||
                    m->logprobs[i]->token_id != m->token_ids[i] || m->logprobs[i]->logprob > 0)
                    out->logprobs_ok = false;
        }
        if (m->finish_reason) {
            out->finish = m->finish_reason;
            if (m->usage)
                out->completion_tokens = m->usage->completion_tokens;
        }
        moe__v1__generate_response__free_unpacked(m, NULL);
        if (hook && !hook(user, out, s)) {
            rpc_client_stream_cancel(s);
            while (rpc_client_stream_next(s, &data, &n)) {
            }
            break;
        }
    }
    const char *msg;
    out->code = rpc_client_stream_status(s, &msg);
    snprintf(out->message, sizeof out->message, "%s", msg ? msg : "");
    rpc_client_stream_destroy(s);
}

static Moe__V1__SamplingParams greedy(uint32_t max_tokens)
{
    Moe__V1__SamplingParams sp = MOE__V1__SAMPLING_PARAMS__INIT;
    sp.max_tokens = max_tokens;
    sp.ignore_eos = true;
    return sp;
}

static Moe__V1__GenerateRequest text_req(const char *text, Moe__V1__SamplingParams *sp)
{
    Moe__V1__GenerateRequest rq = MOE__V1__GENERATE_REQUEST__INIT;
    rq.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TEXT;
    rq.text = (char *)text;
    rq.sampling = sp;
    return rq;
}

/* A short greedy request by text; true if it completed with n tokens. */
static bool short_ok(struct rpc_client *coord, const char *text, uint32_t n)
{
    Moe__V1__SamplingParams sp = greedy(n);
    Moe__V1__GenerateRequest rq = text_req(text, &sp);
    struct gen_out *o = malloc(sizeof *o);
    gen_run(coord, &rq, NULL, NULL, o);
    bool ok = o->code == RPC_OK && o->n_ids == n &&
              o->finish == MOE__V1__FINISH_REASON__FINISH_REASON_LENGTH;
    if (!ok)
        fprintf(stderr, "short request '%s': %s %s, %zu tokens\n", text, rpc_code_name(o->code),
                o->message, o->n_ids);
    free(o);
    return ok;
}

/* ---- the reference: moe-generate ----------------------------------------------------- */

static size_t reference_tokens(const char *prompt, int n, uint32_t *ids, size_t cap)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "'%s/moe-generate' --model '%s' --prompt '%s' -n %d --dtype f32 --ignore-eos "
             "--threads 1 2>/dev/null",
             g_bin, test_src_path("tests/golden/fixtures/qwen3_moe"), prompt, n);
    FILE *p = popen(cmd, "r");
    if (!p)
        return 0;
    char line[65536];
    size_t k = 0;
    while (fgets(line, sizeof line, p))
        if (!strncmp(line, "tokens:", 7)) {
            char *s = line + 7, *end;
            for (unsigned long v; k < cap && (v = strtoul(s, &end, 10), end != s); s = end)
                ids[k++] = (uint32_t)v;
        }
    pclose(p);
    return k;
}

/* ---- the long-context model copy ------------------------------------------------------- */

static int make_model_copy(void)
{
    return model_copy_make(16384, g_tmp, sizeof g_tmp, g_model, sizeof g_model);
}

static void remove_model_copy(void)
{
    model_copy_remove(g_tmp);
}

/* ---- static cluster tests ---------------------------------------------------------------- */

static struct rpc_client *client_to(const char *addr)
{
    struct moe_error err;
    return rpc_client_create(addr, NULL, &err);
}

static void test_greedy_matches_reference(struct rpc_client *coord, struct moe_tokenizer *tok)
{
    const char *prompt = "The quick brown fox jumps over";
    enum { N = 24 };
    uint32_t ref[N];
    size_t n_ref = reference_tokens(prompt, N, ref, N);
    CHECKF(n_ref == N, "moe-generate gave %zu tokens", n_ref);
    Moe__V1__SamplingParams sp = greedy(N);
    Moe__V1__GenerateRequest rq = text_req(prompt, &sp);
    rq.request_id = "greedy-1";
    rq.stream_text = true;
    struct gen_out *o = malloc(sizeof *o);
    gen_run(coord, &rq, NULL, NULL, o);
    CHECKF(o->code == RPC_OK, "%s %s", rpc_code_name(o->code), o->message);
    CHECKF(o->n_ids == N && !memcmp(o->ids, ref, sizeof ref), "ids differ from moe-generate");
    CHECK(o->finish == MOE__V1__FINISH_REASON__FINISH_REASON_LENGTH);
    CHECK(o->completion_tokens == N);
    CHECK(o->ids_echoed);
    int32_t ids[N];
    for (int i = 0; i < N; i++)
        ids[i] = (int32_t)o->ids[i];
    char *text = NULL;
    size_t tl = 0;
    struct moe_error err;
    CHECK(moe_tokenizer_decode(tok, ids, N, false, &text, &tl, &err) == MOE_OK);
    CHECKF(text && tl == o->text_len && !memcmp(text, o->text, tl),
           "streamed text (%zu bytes) != decode (%zu bytes)", o->text_len, tl);
    free(text);

    /* Token-id prompt and logprobs passed through. */
    Moe__V1__TokenIds tids = MOE__V1__TOKEN_IDS__INIT;
    uint32_t pids[] = {5, 17, 99, 230, 7};
    tids.n_ids = 5;
    tids.ids = pids;
    Moe__V1__GenerateRequest rq2 = MOE__V1__GENERATE_REQUEST__INIT;
    Moe__V1__SamplingParams sp2 = greedy(8);
    sp2.logprobs_opt_case = MOE__V1__SAMPLING_PARAMS__LOGPROBS_OPT_LOGPROBS;
    sp2.logprobs = 3;
    rq2.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS;
    rq2.token_ids = &tids;
    rq2.sampling = &sp2;
    gen_run(coord, &rq2, NULL, NULL, o);
    CHECKF(o->code == RPC_OK && o->n_ids == 8, "%s %s", rpc_code_name(o->code), o->message);
    CHECK(o->logprobs_ok);
    free(o);
}

static void test_info_and_tokenize(struct rpc_client *coord, struct moe_tokenizer *tok)
{
    Moe__V1__ModelInfoRequest mrq = MOE__V1__MODEL_INFO_REQUEST__INIT;
    enum rpc_code code;
    Moe__V1__ModelInfo *info = call(coord, "/moe.v1.Inference/GetModelInfo", &mrq,
                                    &moe__v1__model_info__descriptor, &code, NULL, 0);
    CHECK(info && !strcmp(info->name, "qwen3_moe") && info->max_context == 16384 &&
          info->vocab_size == 801 && !strcmp(info->architecture, "qwen3_moe"));
    /* the rest of the shape, and the workers' dtype, as config.json and --dtype give them */
    CHECK(info && info->n_layer == 3 && info->d_model == 64 && info->n_head == 4 &&
          info->n_kv_head == 2 && info->n_expert == 8 && info->top_k == 2 &&
          !strcmp(info->dtype, "f32") && info->n_eos_token_ids == 1 &&
          info->eos_token_ids[0] == 800 && info->bos_token_id == 798);
    if (info)
        moe__v1__model_info__free_unpacked(info, NULL);

    Moe__V1__TokenizeRequest trq = MOE__V1__TOKENIZE_REQUEST__INIT;
    trq.text = "hello world";
    trq.add_special_tokens = true;
    Moe__V1__TokenizeResponse *tr = call(coord, "/moe.v1.Inference/Tokenize", &trq,
                                         &moe__v1__tokenize_response__descriptor, &code, NULL, 0);
    int32_t *ids = NULL;
    size_t n = 0;
    struct moe_error err;
    CHECK(moe_tokenizer_encode(tok, "hello world", 11, true, &ids, &n, &err) == MOE_OK);
    bool same = tr && tr->n_token_ids == n;
    for (size_t i = 0; same && i < n; i++)
        same = tr->token_ids[i] == (uint32_t)ids[i];
    CHECK(same);
    free(ids);
    if (tr)
        moe__v1__tokenize_response__free_unpacked(tr, NULL);
    trq.model = "no-such-model";
    tr = call(coord, "/moe.v1.Inference/Tokenize", &trq, &moe__v1__tokenize_response__descriptor,
              &code, NULL, 0);
    CHECK(!tr && code == RPC_NOT_FOUND);
}

/* One bad request: the code and a field name expected in the message. */
static void expect_refused(struct rpc_client *coord, const Moe__V1__GenerateRequest *rq,
                           enum rpc_code want, const char *field)
{
    struct gen_out *o = malloc(sizeof *o);
    gen_run(coord, rq, NULL, NULL, o);
    CHECKF(o->code == want && strstr(o->message, field) && o->n_msgs == 0,
           "want %s naming '%s', got %s '%s'", rpc_code_name(want), field, rpc_code_name(o->code),
           o->message);
    free(o);
}

static void test_validation(struct rpc_client *coord)
{
    Moe__V1__SamplingParams sp;
    Moe__V1__GenerateRequest rq;
#define BAD(setup, want, field)                                                                    \
    do {                                                                                           \
        sp = greedy(4);                                                                            \
        rq = text_req("hello", &sp);                                                               \
        setup;                                                                                     \
        expect_refused(coord, &rq, want, field);                                                   \
    } while (0)
    BAD(sp.temperature = -1, RPC_INVALID_ARGUMENT, "sampling.temperature");
    BAD(sp.top_p = 1.5f, RPC_INVALID_ARGUMENT, "sampling.top_p");
    BAD(sp.min_p = 2, RPC_INVALID_ARGUMENT, "sampling.min_p");
    BAD(sp.top_k = 1u << 30, RPC_INVALID_ARGUMENT, "sampling.top_k");
    BAD(sp.repetition_penalty = 50, RPC_INVALID_ARGUMENT, "sampling.repetition_penalty");
    BAD(sp.presence_penalty = 3, RPC_INVALID_ARGUMENT, "sampling.presence_penalty");
    BAD(sp.frequency_penalty = -3, RPC_INVALID_ARGUMENT, "sampling.frequency_penalty");
    BAD(sp.min_tokens = 5, RPC_INVALID_ARGUMENT, "sampling.min_tokens"); /* max_tokens 4 */
    BAD((sp.max_tokens = 0, sp.min_tokens = 1u << 20), RPC_INVALID_ARGUMENT,
        "sampling.min_tokens"); /* beyond the context */
    Moe__V1__SamplingParams__LogitBiasEntry bias = MOE__V1__SAMPLING_PARAMS__LOGIT_BIAS_ENTRY__INIT,
                                            *bias_p = &bias;
    bias.key = 5;
    bias.value = 200;
    BAD((sp.n_logit_bias = 1, sp.logit_bias = &bias_p), RPC_INVALID_ARGUMENT,
        "sampling.logit_bias[5]");
    bias.key = 5000;
    bias.value = 1;
    BAD((sp.n_logit_bias = 1, sp.logit_bias = &bias_p), RPC_INVALID_ARGUMENT,
        "sampling.logit_bias");
    BAD((sp.logprobs_opt_case = MOE__V1__SAMPLING_PARAMS__LOGPROBS_OPT_LOGPROBS, sp.logprobs = 21),
        RPC_INVALID_ARGUMENT, "sampling.logprobs");
    char *stops[9] = {"a", "b", "c", "d", "e", "f", "g", "h", "i"};
    BAD((sp.n_stop = 9, sp.stop = stops), RPC_INVALID_ARGUMENT, "sampling.stop");
    uint32_t stop_ids[17] = {0};
    BAD((sp.n_stop_token_ids = 17, sp.stop_token_ids = stop_ids), RPC_INVALID_ARGUMENT,
        "sampling.stop_token_ids");
    uint32_t bad_stop_id = 5000;
    BAD((sp.n_stop_token_ids = 1, sp.stop_token_ids = &bad_stop_id), RPC_INVALID_ARGUMENT,
        "sampling.stop_token_ids[0]");
    char long_id[200];
    memset(long_id, 'x', sizeof long_id - 1);
    long_id[sizeof long_id - 1] = '\0';
    BAD(rq.request_id = long_id, RPC_INVALID_ARGUMENT, "request_id");
    BAD(rq.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT__NOT_SET, RPC_INVALID_ARGUMENT,
        "prompt");
    BAD(rq.text = "", RPC_INVALID_ARGUMENT, "prompt.text");
    BAD(rq.model = "llama-70b", RPC_NOT_FOUND, "model");
    BAD(sp.max_tokens = 16384, RPC_INVALID_ARGUMENT, "sampling.max_tokens");
    Moe__V1__TokenIds tids = MOE__V1__TOKEN_IDS__INIT;
    uint32_t *many = calloc(16384, sizeof *many);
    many[3] = 801;
    tids.ids = many;
    tids.n_ids = 10;
    BAD((rq.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS, rq.token_ids = &tids),
        RPC_INVALID_ARGUMENT, "prompt.token_ids[3]");
    many[3] = 0;
    tids.n_ids = 16384;
    BAD((rq.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS, rq.token_ids = &tids),
        RPC_INVALID_ARGUMENT, "prompt");
    free(many);
    /* Over the prompt's byte limit but within the port's message limit
     * (the largest valid request + 64 KiB): refused by name. */
    char *huge = malloc((2u << 20) + 1);
    memset(huge, 'a', (1u << 20) + 1000);
    huge[(1u << 20) + 1000] = '\0';
    BAD(rq.text = huge, RPC_INVALID_ARGUMENT, "prompt.text");
    /* Larger than any valid request: the port refuses it undecoded. */
    memset(huge, 'a', 2u << 20);
    huge[2u << 20] = '\0';
    BAD(rq.text = huge, RPC_RESOURCE_EXHAUSTED, "larger than max");
    free(huge);
#undef BAD
}

/* 16 requests at once: all complete, both workers took some. */
struct burst_arg {
    struct rpc_client *coord;
    int i;
    bool ok;
};

static void *burst_thread(void *p)
{
    struct burst_arg *a = p;
    char text[64];
    snprintf(text, sizeof text, "request number %d says hello", a->i);
    a->ok = short_ok(a->coord, text, 32);
    return NULL;
}

static uint64_t lookups(struct rpc_client *w)
{
    Moe__V1__WorkerLoad *l = get_load(w);
    uint64_t v = l ? l->prefix_lookup_tokens : 0;
    if (l)
        moe__v1__worker_load__free_unpacked(l, NULL);
    return v;
}

static void test_burst(struct rpc_client *coord, struct rpc_client *wa, struct rpc_client *wb)
{
    uint64_t a0 = lookups(wa), b0 = lookups(wb);
    enum { N = 16 };
    pthread_t th[N];
    struct burst_arg args[N];
    int64_t t0 = moe_now_ms();
    for (int i = 0; i < N; i++) {
        args[i] = (struct burst_arg){coord, i, false};
        pthread_create(&th[i], NULL, burst_thread, &args[i]);
    }
    int n_ok = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        n_ok += args[i].ok;
    }
    uint64_t a1 = lookups(wa), b1 = lookups(wb);
    printf("burst: %d/%d ok in %" PRId64 " ms; prompt tokens A +%" PRIu64 ", B +%" PRIu64 "\n",
           n_ok, N, moe_now_ms() - t0, a1 - a0, b1 - b0);
    CHECK(n_ok == N);
    CHECKF(a1 > a0 && b1 > b0, "not spread: A +%" PRIu64 " B +%" PRIu64, a1 - a0, b1 - b0);
}

static uint64_t hits(struct rpc_client *w)
{
    Moe__V1__WorkerLoad *l = get_load(w);
    uint64_t v = l ? l->prefix_hit_tokens : 0;
    if (l)
        moe__v1__worker_load__free_unpacked(l, NULL);
    return v;
}

/* Prefix affinity: requests sharing a prompt prefix of >= 1 block (16
 * tokens) go to the worker that served it last while loads are close, and
 * hit its prefix cache. */
static void test_affinity(struct rpc_client *coord, struct rpc_client *wa, struct rpc_client *wb)
{
    const char *shared = "Once upon a time in a land far away there lived a small dragon who "
                         "liked to count tokens and route them to the right expert, ";
    char text[512];
    snprintf(text, sizeof text, "%s%s", shared, "first");
    CHECK(short_ok(coord, text, 4));
    uint64_t a0 = lookups(wa), b0 = lookups(wb), ha0 = hits(wa), hb0 = hits(wb);
    for (int i = 0; i < 3; i++) {
        snprintf(text, sizeof text, "%s variant %d", shared, i);
        CHECK(short_ok(coord, text, 4));
    }
    uint64_t a1 = lookups(wa), b1 = lookups(wb), ha1 = hits(wa), hb1 = hits(wb);
    printf("affinity: prompt tokens A +%" PRIu64 " B +%" PRIu64 ", cache hits A +%" PRIu64
           " B +%" PRIu64 "\n",
           a1 - a0, b1 - b0, ha1 - ha0, hb1 - hb0);
    CHECK((a1 > a0) != (b1 > b0));
    CHECK(ha1 - ha0 + hb1 - hb0 >= 3 * 16);
}

/* Finds the worker (0 = a, 1 = b) with a running sequence; -1 if none. */
static int busy_worker(struct rpc_client *wa, struct rpc_client *wb)
{
    for (int k = 0; k < 2; k++) {
        Moe__V1__WorkerLoad *l = get_load(k ? wb : wa);
        bool busy = l && l->running > 0;
        if (l)
            moe__v1__worker_load__free_unpacked(l, NULL);
        if (busy)
            return k;
    }
    return -1;
}

static uint32_t kv_used(struct rpc_client *w)
{
    Moe__V1__WorkerLoad *l = get_load(w);
    uint32_t v = l ? l->kv_blocks_used : UINT32_MAX;
    if (l)
        moe__v1__worker_load__free_unpacked(l, NULL);
    return v;
}

struct hook_ctx {
    struct rpc_client *coord, *wa, *wb;
    int after;          /* act after this many messages */
    int busy;           /* which worker ran it (found by the hook) */
    uint32_t kv_before; /* KV blocks used on it while running */
    pid_t victim[2];    /* pids of worker a and b */
    int action;         /* 0 cancel, 1 abort, 2 kill -9, 3 SIGTERM */
    bool acted;
};

static bool hook_act(void *user, struct gen_out *out, struct rpc_client_stream *s)
{
    struct hook_ctx *h = user;
    if (h->acted || out->n_msgs < h->after)
        return true;
    h->acted = true;
    h->busy = busy_worker(h->wa, h->wb);
    if (h->busy >= 0)
        h->kv_before = kv_used(h->busy ? h->wb : h->wa);
    switch (h->action) {
    case 0: return false; /* cancel */
    case 1: {
        Moe__V1__AbortRequest rq = MOE__V1__ABORT_REQUEST__INIT;
        rq.request_id = "abort-me";
        enum rpc_code code;
        Moe__V1__AbortResponse *r = call(h->coord, "/moe.v1.Inference/Abort", &rq,
                                         &moe__v1__abort_response__descriptor, &code, NULL, 0);
        CHECK(r && r->found);
        if (r)
            moe__v1__abort_response__free_unpacked(r, NULL);
        return true;
    }
    case 2:
        if (h->busy >= 0)
            child_kill9(h->victim[h->busy]);
        return true;
    default:
        if (h->busy >= 0)
            kill(h->victim[h->busy], SIGTERM);
        return true;
    }
}

static bool wait_kv_free(struct rpc_client *w, int timeout_ms)
{
    for (int64_t t0 = moe_now_ms(); moe_now_ms() - t0 < timeout_ms; sleep_ms(20))
        if (kv_used(w) == 0)
            return true;
    return false;
}

static void test_cancel_abort_deadline(struct rpc_client *coord, struct rpc_client *wa,
                                       struct rpc_client *wb)
{
    struct gen_out *o = malloc(sizeof *o);
    Moe__V1__SamplingParams sp = greedy(LONG_TOKENS);
    Moe__V1__GenerateRequest rq = text_req("a long story about cancellation", &sp);

    /* Client cancel mid-stream: the worker frees the KV (printed: how fast). */
    struct hook_ctx h = {.coord = coord, .wa = wa, .wb = wb, .after = 3, .action = 0};
    gen_run(coord, &rq, hook_act, &h, o);
    CHECKF(h.busy >= 0 && h.kv_before > 0, "no worker was running it (busy %d, kv %u)", h.busy,
           h.kv_before);
    CHECK(o->code == RPC_CANCELLED && o->n_ids < LONG_TOKENS);
    if (h.busy >= 0) {
        int64_t t0 = moe_now_ms();
        bool freed = wait_kv_free(h.busy ? wb : wa, 30000);
        printf("cancel: KV blocks %u -> 0 in %" PRId64 " ms\n", h.kv_before, moe_now_ms() - t0);
        CHECKF(freed, "KV not freed within 30 s after the cancel");
    }

    /* Abort by request id: FINISH_REASON_ABORT, status OK. */
    rq.request_id = "abort-me";
    h = (struct hook_ctx){.coord = coord, .wa = wa, .wb = wb, .after = 2, .action = 1};
    gen_run(coord, &rq, hook_act, &h, o);
    CHECKF(o->code == RPC_OK && o->finish == MOE__V1__FINISH_REASON__FINISH_REASON_ABORT &&
               o->n_ids < LONG_TOKENS,
           "abort: %s %s, finish %d, %zu tokens", rpc_code_name(o->code), o->message, o->finish,
           o->n_ids);
    if (h.busy >= 0)
        CHECK(wait_kv_free(h.busy ? wb : wa, 30000));

    /* deadline_ms: the stream ends DEADLINE_EXCEEDED before its last token. */
    rq.request_id = "";
    rq.deadline_ms = 300;
    int64_t t0 = moe_now_ms();
    gen_run(coord, &rq, NULL, NULL, o);
    int64_t dt = moe_now_ms() - t0;
    CHECKF(o->code == RPC_DEADLINE_EXCEEDED && o->n_ids < LONG_TOKENS,
           "deadline: %s %s after %" PRId64 " ms", rpc_code_name(o->code), o->message, dt);
    free(o);
}

static void test_admin(struct rpc_client *coord, struct proc *a, struct proc *b,
                       struct rpc_client *wa, struct rpc_client *wb)
{
    Moe__V1__ClusterStatusRequest crq = MOE__V1__CLUSTER_STATUS_REQUEST__INIT;
    enum rpc_code code;
    Moe__V1__ClusterStatusResponse *cs =
        call(coord, "/moe.v1.Admin/ClusterStatus", &crq,
             &moe__v1__cluster_status_response__descriptor, &code, NULL, 0);
    CHECK(cs && cs->n_workers == 2 && !strcmp(cs->model, "qwen3_moe") && cs->requests_total > 16);
    for (size_t i = 0; cs && i < cs->n_workers; i++) {
        Moe__V1__WorkerStatus *w = cs->workers[i];
        printf("worker %s %s state %d running %u kv %u/%u hit %.2f seen %" PRIu64 " ms ago\n",
               w->id, w->address, w->state, w->running, w->kv_blocks_used, w->kv_blocks_total,
               w->prefix_hit_rate, w->last_seen_ms_ago);
        CHECK(w->state == MOE__V1__WORKER_STATE__WORKER_STATE_SERVING && w->kv_blocks_total > 0 &&
              w->role == MOE__V1__WORKER_ROLE__WORKER_ROLE_MIXED && w->last_seen_ms_ago < 30000);
    }
    if (cs)
        moe__v1__cluster_status_response__free_unpacked(cs, NULL);

    /* Drain a: every request goes to b; undrain: a serves again. */
    Moe__V1__DrainWorkerRequest drq = MOE__V1__DRAIN_WORKER_REQUEST__INIT;
    drq.id = a->id;
    Moe__V1__DrainWorkerResponse *dr =
        call(coord, "/moe.v1.Admin/DrainWorker", &drq, &moe__v1__drain_worker_response__descriptor,
             &code, NULL, 0);
    CHECK(dr && dr->state == MOE__V1__WORKER_STATE__WORKER_STATE_DRAINING);
    if (dr)
        moe__v1__drain_worker_response__free_unpacked(dr, NULL);
    uint64_t a0 = lookups(wa), b0 = lookups(wb);
    bool all = true;
    for (int i = 0; i < 4; i++)
        all &= short_ok(coord, "drained worker test", 4);
    CHECK(all && lookups(wa) == a0 && lookups(wb) > b0);
    Moe__V1__UndrainWorkerRequest urq = MOE__V1__UNDRAIN_WORKER_REQUEST__INIT;
    urq.id = a->id;
    Moe__V1__UndrainWorkerResponse *ur =
        call(coord, "/moe.v1.Admin/UndrainWorker", &urq,
             &moe__v1__undrain_worker_response__descriptor, &code, NULL, 0);
    CHECK(ur && ur->state == MOE__V1__WORKER_STATE__WORKER_STATE_SERVING);
    if (ur)
        moe__v1__undrain_worker_response__free_unpacked(ur, NULL);
    drq.id = "no-such-worker";
    char msg[256];
    dr = call(coord, "/moe.v1.Admin/DrainWorker", &drq, &moe__v1__drain_worker_response__descriptor,
              &code, msg, sizeof msg);
    CHECKF(!dr && code == RPC_NOT_FOUND && strstr(msg, "id"), "%s %s", rpc_code_name(code), msg);
    (void)b;
}

/* SIGTERM to the worker running a request: it completes, later requests go
 * to the other worker, the worker exits 0. Then it is started again on the
 * same address and the coordinator sees it SERVING again. */
static void test_sigterm_drain(struct rpc_client *coord, struct proc *w, struct rpc_client **wc)
{
    struct gen_out *o = malloc(sizeof *o);
    Moe__V1__SamplingParams sp = greedy(3000);
    Moe__V1__GenerateRequest rq = text_req("drain me gently", &sp);
    pid_t pids[2] = {w[0].pid, w[1].pid};
    struct hook_ctx h = {.coord = coord, .wa = wc[0], .wb = wc[1], .after = 2, .action = 3};
    memcpy(h.victim, pids, sizeof pids);
    gen_run(coord, &rq, hook_act, &h, o);
    CHECKF(h.busy >= 0, "no busy worker found");
    CHECKF(o->code == RPC_OK && o->n_ids == 3000 &&
               o->finish == MOE__V1__FINISH_REASON__FINISH_REASON_LENGTH,
           "draining worker's request: %s %s, %zu tokens", rpc_code_name(o->code), o->message,
           o->n_ids);
    free(o);
    if (h.busy < 0)
        return;
    struct proc *v = &w[h.busy];
    bool all = true;
    for (int i = 0; i < 4; i++)
        all &= short_ok(coord, "after the drain", 4);
    CHECK(all);
    int st = child_wait(v->pid, 60000);
    CHECKF(st == 0, "drained worker exit status %d", st);
    /* Back on the same address: the coordinator marks it SERVING again. */
    char listen[128];
    snprintf(listen, sizeof listen, "%s", v->addr);
    char id[128];
    snprintf(id, sizeof id, "%s", v->id);
    rpc_client_destroy(wc[h.busy]);
    wc[h.busy] = NULL;
    if (worker_start(v, id, listen, NULL) == 0) {
        wc[h.busy] = client_to(v->addr);
        int64_t t0 = moe_now_ms();
        bool up =
            wait_worker_state(coord, v->addr, MOE__V1__WORKER_STATE__WORKER_STATE_SERVING, 60000);
        printf("restarted worker SERVING again after %" PRId64 " ms\n", moe_now_ms() - t0);
        CHECK(up);
    } else {
        CHECK(!"worker restart");
    }
}

/* kill -9 of the worker streaming a request: UNAVAILABLE naming it; new
 * requests still succeed on the other one. */
static void test_kill9(struct rpc_client *coord, struct proc *w, struct rpc_client **wc)
{
    struct gen_out *o = malloc(sizeof *o);
    Moe__V1__SamplingParams sp = greedy(LONG_TOKENS);
    Moe__V1__GenerateRequest rq = text_req("this worker will die", &sp);
    struct hook_ctx h = {.coord = coord, .wa = wc[0], .wb = wc[1], .after = 3, .action = 2};
    h.victim[0] = w[0].pid;
    h.victim[1] = w[1].pid;
    gen_run(coord, &rq, hook_act, &h, o);
    if (h.busy >= 0)
        w[h.busy].pid = 0; /* killed and reaped by the hook */
    CHECKF(h.busy >= 0, "no busy worker found");
    CHECKF(o->code == RPC_UNAVAILABLE && strstr(o->message, "failed after") &&
               o->n_ids < LONG_TOKENS,
           "killed worker's request: %s '%s'", rpc_code_name(o->code), o->message);
    printf("kill -9: '%s'\n", o->message);
    free(o);
    bool all = true;
    for (int i = 0; i < 6; i++)
        all &= short_ok(coord, "after the crash", 4);
    CHECK(all);
    if (h.busy >= 0)
        CHECK(wait_worker_state(coord, w[h.busy].addr, MOE__V1__WORKER_STATE__WORKER_STATE_DOWN,
                                30000));
}

struct queue_ctx {
    struct rpc_client *coord;
    bool refused;
};

/* In flight: one more long request (in its own stream), then a third one. */
static bool hook_queue(void *user, struct gen_out *out, struct rpc_client_stream *s)
{
    struct queue_ctx *q = user;
    Moe__V1__SamplingParams sp = greedy(LONG_TOKENS);
    Moe__V1__GenerateRequest rq = text_req("second in the queue", &sp);
    size_t len;
    void *b = pack(&rq, &len);
    struct moe_error err;
    struct rpc_client_stream *second =
        rpc_client_stream_start(q->coord, "/moe.v1.Inference/Generate", b, len, 10000, &err);
    free(b);
    const uint8_t *data;
    size_t n;
    if (second && rpc_client_stream_next(second, &data, &n)) {
        sp = greedy(4);
        rq = text_req("third is too many", &sp);
        struct gen_out *o = malloc(sizeof *o);
        gen_run(q->coord, &rq, NULL, NULL, o);
        q->refused = o->code == RPC_RESOURCE_EXHAUSTED && strstr(o->message, "--max-queue");
        if (!q->refused)
            fprintf(stderr, "third request: %s %s\n", rpc_code_name(o->code), o->message);
        free(o);
    }
    rpc_client_stream_destroy(second);
    return false;
}

/* A worker that died since the last poll: requests routed to it are retried
 * on the other one (no poll runs: --poll-ms 60000), and the dead one is
 * marked DOWN by the failed call itself. */
static void test_retry(const struct proc *alive)
{
    struct proc x, co;
    if (worker_start(&x, "wx", "127.0.0.1:0", NULL)) {
        CHECK(!"third worker");
        return;
    }
    char list[300];
    snprintf(list, sizeof list, "%s,%s", x.addr, alive->addr);
    if (coordinator_start_poll(&co, "--workers", list, "60000", "2")) {
        CHECK(!"second coordinator");
        return;
    }
    struct rpc_client *coord = client_to(co.addr);
    CHECK(worker_state(coord, x.addr) == MOE__V1__WORKER_STATE__WORKER_STATE_SERVING);
    child_kill9(x.pid);
    bool all = true;
    for (int i = 0; i < 4; i++)
        all &= short_ok(coord, "retry me", 4);
    CHECK(all);
    CHECK(worker_state(coord, x.addr) == MOE__V1__WORKER_STATE__WORKER_STATE_DOWN);
    CHECK(worker_state(coord, alive->addr) == MOE__V1__WORKER_STATE__WORKER_STATE_SERVING);

    /* --max-queue 2: a third request in flight is RESOURCE_EXHAUSTED. */
    struct queue_ctx q = {coord, false};
    struct gen_out *o = malloc(sizeof *o);
    Moe__V1__SamplingParams sp = greedy(LONG_TOKENS);
    Moe__V1__GenerateRequest rq = text_req("fill the queue", &sp);
    gen_run(coord, &rq, hook_queue, &q, o);
    CHECK(q.refused && o->code == RPC_CANCELLED);
    free(o);
    rpc_client_destroy(coord);
    kill(co.pid, SIGTERM);
    CHECK(child_wait(co.pid, 60000) == 0);
}

static int health_status(struct rpc_client *cl, const char *service)
{
    Grpc__Health__V1__HealthCheckRequest rq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    rq.service = (char *)service;
    enum rpc_code code;
    Grpc__Health__V1__HealthCheckResponse *r =
        call(cl, "/grpc.health.v1.Health/Check", &rq,
             &grpc__health__v1__health_check_response__descriptor, &code, NULL, 0);
    int st = r ? (int)r->status : -1;
    if (r)
        grpc__health__v1__health_check_response__free_unpacked(r, NULL);
    return st;
}

struct shutdown_ctx {
    pid_t pid;
    bool sent;
};

static bool hook_sigterm(void *user, struct gen_out *out, struct rpc_client_stream *s)
{
    struct shutdown_ctx *c = user;
    if (!c->sent && out->n_msgs >= 2) {
        kill(c->pid, SIGTERM);
        c->sent = true;
    }
    return true;
}

static int run_static(void)
{
    struct moe_tokenizer *tok = NULL;
    struct moe_error err;
    if (moe_tokenizer_load(test_src_path("tests/golden/fixtures/qwen3_moe/tokenizer.json"), &tok,
                           &err))
        return fprintf(stderr, "%s\n", err.msg), 1;
    struct proc w[2], co;
    if (worker_start(&w[0], "wa", "127.0.0.1:0", NULL) ||
        worker_start(&w[1], "wb", "127.0.0.1:0", NULL))
        return 1;
    /* Static ids are the --workers entries: the addresses. */
    snprintf(w[0].id, sizeof w[0].id, "%s", w[0].addr);
    snprintf(w[1].id, sizeof w[1].id, "%s", w[1].addr);
    char list[300];
    snprintf(list, sizeof list, "%s,%s", w[0].addr, w[1].addr);
    if (coordinator_start(&co, "--workers", list))
        return 1;
    printf("workers %s %s, coordinator %s\n", w[0].addr, w[1].addr, co.addr);
    struct rpc_client *coord = client_to(co.addr);
    struct rpc_client *wc[2] = {client_to(w[0].addr), client_to(w[1].addr)};

    int64_t t0 = moe_now_ms();
    CHECK(health_status(coord, "") == 1 && health_status(coord, "moe.v1.Inference") == 1);
    test_greedy_matches_reference(coord, tok);
    test_info_and_tokenize(coord, tok);
    test_validation(coord);
    printf("basic + validation: %" PRId64 " ms\n", moe_now_ms() - t0);
    test_burst(coord, wc[0], wc[1]);
    test_affinity(coord, wc[0], wc[1]);
    test_cancel_abort_deadline(coord, wc[0], wc[1]);
    test_admin(coord, &w[0], &w[1], wc[0], wc[1]);
    printf("through admin: %" PRId64 " ms\n", moe_now_ms() - t0);
    test_sigterm_drain(coord, w, wc);
    printf("through drain: %" PRId64 " ms\n", moe_now_ms() - t0);
    if (wc[0] && wc[1])
        test_kill9(coord, w, wc);
    printf("through kill -9: %" PRId64 " ms\n", moe_now_ms() - t0);
    for (int k = 0; k < 2; k++)
        if (wc[k] && w[k].pid > 0) {
            test_retry(&w[k]);
            break;
        }
    printf("through retry: %" PRId64 " ms\n", moe_now_ms() - t0);

    /* Coordinator SIGTERM with a stream running: the stream finishes (the
     * grace period is long: a sanitized build on two loaded cores may need
     * seconds for 500 tokens), then the coordinator exits 0. */
    struct gen_out *o = malloc(sizeof *o);
    Moe__V1__SamplingParams sp = greedy(500);
    Moe__V1__GenerateRequest rq = text_req("shutting down", &sp);
    struct shutdown_ctx sc = {co.pid, false};
    gen_run(coord, &rq, hook_sigterm, &sc, o);
    if (getenv("MOE_DBG"))
        fprintf(stderr, "DBG %.6f test: stream ended %d\n", moe_now(), (int)o->n_ids);
    CHECKF(o->code == RPC_OK && o->n_ids == 500, "stream during shutdown: %s %s, %zu tokens",
           rpc_code_name(o->code), o->message, o->n_ids);
    free(o);
    rpc_client_destroy(coord);
    int st = child_wait(co.pid, 60000);
    CHECKF(st == 0, "coordinator exit status %d after SIGTERM", st);
    rpc_client_destroy(wc[0]);
    rpc_client_destroy(wc[1]);
    moe_tokenizer_free(tok);
    return 0;
}

/* ---- etcd membership --------------------------------------------------------------------- */

static bool ids_listed(struct rpc_client *coord, const char *a, const char *b)
{
    Moe__V1__ListWorkersResponse *lw = list_workers(coord);
    if (!lw)
        return false;
    bool fa = !a, fb = !b;
    for (size_t i = 0; i < lw->n_workers; i++) {
        if (a && !strcmp(lw->workers[i]->id, a))
            fa = true;
        if (b && !strcmp(lw->workers[i]->id, b))
            fb = true;
    }
    size_t n = lw->n_workers;
    moe__v1__list_workers_response__free_unpacked(lw, NULL);
    return fa && fb && n == (size_t)(!!a + !!b);
}

static int run_etcd(void)
{
    static struct test_etcd etcd;
    if (!find_etcd(etcd.bin, sizeof etcd.bin)) {
        printf("no etcd binary: skipped\n");
        return TEST_SKIP_CODE;
    }
    bool ready = test_etcd_start(&etcd, g_tmp) == 0;
    CHECKF(ready, "etcd did not start");
    if (!ready)
        return 1;
    const char *client = etcd.client;
    struct proc w[2], co;
    if (worker_start(&w[0], "ea", "127.0.0.1:0", client) ||
        coordinator_start(&co, "--etcd", client))
        return 1;
    struct rpc_client *coord = client_to(co.addr);
    CHECK(ids_listed(coord, "ea", NULL));
    /* A worker joining later appears through the watch. */
    if (worker_start(&w[1], "eb", "127.0.0.1:0", client))
        return 1;
    bool both = false;
    int64_t t0 = moe_now_ms();
    while (!both && moe_now_ms() - t0 < 30000) {
        both = ids_listed(coord, "ea", "eb");
        sleep_ms(50);
    }
    printf("etcd: second worker listed after %" PRId64 " ms\n", moe_now_ms() - t0);
    CHECK(both);
    CHECK(wait_worker_state(coord, "eb", MOE__V1__WORKER_STATE__WORKER_STATE_SERVING, 30000));
    bool all = true;
    for (int i = 0; i < 4; i++)
        all &= short_ok(coord, "hello etcd", 4);
    CHECK(all);
    /* kill -9: the key goes with the lease (TTL 2 s), and so does the worker. */
    child_kill9(w[0].pid);
    t0 = moe_now_ms();
    bool gone = false;
    while (!gone && moe_now_ms() - t0 < 30000) {
        gone = ids_listed(coord, NULL, "eb");
        sleep_ms(100);
    }
    printf("etcd: killed worker dropped after %" PRId64 " ms\n", moe_now_ms() - t0);
    CHECK(gone);
    all = true;
    for (int i = 0; i < 4; i++)
        all &= short_ok(coord, "still serving", 4);
    CHECK(all);
    /* SIGTERM: the worker deletes its key at once. */
    kill(w[1].pid, SIGTERM);
    CHECK(child_wait(w[1].pid, 60000) == 0);
    gone = false;
    for (t0 = moe_now_ms(); !gone && moe_now_ms() - t0 < 30000; sleep_ms(50))
        gone = ids_listed(coord, NULL, NULL);
    CHECK(gone);
    Moe__V1__SamplingParams sp = greedy(4);
    Moe__V1__GenerateRequest rq = text_req("nobody home", &sp);
    expect_refused(coord, &rq, RPC_UNAVAILABLE, "no worker");
    rpc_client_destroy(coord);
    kill(co.pid, SIGTERM);
    CHECK(child_wait(co.pid, 60000) == 0);
    test_etcd_kill(&etcd);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 3 || (strcmp(argv[1], "static") && strcmp(argv[1], "etcd"))) {
        fprintf(stderr, "usage: test_cluster static|etcd BIN_DIR\n");
        return 2;
    }
    g_bin = argv[2];
    setvbuf(stdout, NULL, _IOLBF, 0);
    children_guard();
    signal(SIGPIPE, SIG_IGN);
    alarm(900); /* bounds a hang; a sanitized run on two loaded cores is slow */
    if (make_model_copy()) {
        fprintf(stderr, "cannot make the model copy in %s\n", g_tmp);
        remove_model_copy();
        return 1;
    }
    int rc = !strcmp(argv[1], "static") ? run_static() : run_etcd();
    children_kill_all();
    remove_model_copy();
    if (rc)
        return rc == TEST_SKIP_CODE ? rc : (test_summary(), 1);
    return test_summary();
}
