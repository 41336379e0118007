/* moe-client: streams a completion from moe.v1.Inference to the terminal and
 * prints TTFT and TPOT as the client saw them, next to the server's timings.
 *
 *   moe-client [--addr HOST:PORT[,HOST:PORT...]] (--prompt TEXT | --tokens 1,2,3)
 *              [-n N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
 *              [--stop STR]... [--ignore-eos] [--logprobs N] [--timeout-ms MS]
 *              [--request-id ID] [--model NAME] [--repeat N] [--quiet]
 *              [--token-file F] [--tls-ca F [--tls-cert F --tls-key F]]
 *   moe-client [--addr HOST:PORT[,...]] --info      model information
 *
 * With several addresses (coordinators of one cluster) a request that one
 * of them cannot take -- UNAVAILABLE before any token: the process is gone,
 * shutting down, or has no worker -- is sent to the next, in turn; the one
 * that answered is tried first for the next request (--repeat). A request
 * that failed after tokens arrived is not sent again (it would repeat them).
 */
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "auth_token.h"
#include "cli.h"
#include "moe/v1/inference.pb-c.h"
#include "rpc.h"
#include "clock.h"
#include "tls_opts.h"

#define MAX_STOP 8
#define MAX_ADDRS 16

struct args {
    const char *addr;
    const char *prompt;
    const char *tokens;
    const char *request_id;
    const char *model;
    const char *stop[MAX_STOP];
    int n_stop;
    long max_tokens;
    float temperature;
    float top_p;
    long top_k;
    bool has_seed;
    unsigned long long seed;
    bool ignore_eos;
    long logprobs; /* -1: none */
    long timeout_ms;
    long repeat;
    bool info;
    bool quiet;
    const char *token_file;
    struct moe_tls_opts tls;
    char *addrs[MAX_ADDRS]; /* --addr split at commas, pointers into addr_copy */
    int n_addrs;
    char *addr_copy; /* owned: freed by main */
};

static void usage(FILE *f)
{
    fprintf(f, "usage: moe-client [--addr HOST:PORT[,HOST:PORT...]] (--prompt TEXT | --tokens "
               "1,2,3) [options]\n"
               "       moe-client [--addr HOST:PORT[,...]] --info\n"
               "  --addr LIST       coordinators, tried in turn when one cannot take a request\n"
               "                    (UNAVAILABLE before the first token); default "
               "127.0.0.1:50051\n"
               "  -n N              max tokens (default 64)\n"
               "  --temperature T   0 = greedy (default 0)\n"
               "  --top-p P, --top-k K, --seed S, --stop STR (repeatable, up to 8)\n"
               "  --ignore-eos      keep going past EOS\n"
               "  --logprobs N      print the chosen token's log-probability and N alternatives\n"
               "  --timeout-ms MS   call deadline (default none)\n"
               "  --request-id ID   client request id (for Abort)\n"
               "  --model NAME      model name to ask for (default: the served one)\n"
               "  --repeat N        send the request N times, one after another (default 1)\n"
               "  --quiet           print only the summary\n"
               "  --token-file F    API token (first line of F) sent as a bearer token\n"
               "TLS (--tls-ca alone: verify the server; with --tls-cert/--tls-key: mutual "
               "TLS):\n" MOE_TLS_USAGE);
}

static int parse_args(int argc, char **argv, struct args *a)
{
    *a = (struct args){.addr = "127.0.0.1:50051", .max_tokens = 64, .logprobs = -1, .repeat = 1};
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        if (!strcmp(k, "-h") || !strcmp(k, "--help")) {
            usage(stdout);
            exit(0);
        }
        if (!strcmp(k, "--info")) {
            a->info = true;
            continue;
        }
        if (!strcmp(k, "--ignore-eos")) {
            a->ignore_eos = true;
            continue;
        }
        if (!strcmp(k, "--quiet")) {
            a->quiet = true;
            continue;
        }
        if (i + 1 >= argc)
            return cli_fail("option '%s' needs a value", k);
        const char *v = argv[++i];
        if (moe_tls_cli_flag(&a->tls, k, v)) {
            continue;
        } else if (!strcmp(k, "--token-file")) {
            a->token_file = v;
        } else if (!strcmp(k, "--addr")) {
            a->addr = v;
        } else if (!strcmp(k, "--prompt")) {
            a->prompt = v;
        } else if (!strcmp(k, "--tokens")) {
            a->tokens = v;
        } else if (!strcmp(k, "--request-id")) {
            a->request_id = v;
        } else if (!strcmp(k, "--model")) {
            a->model = v;
        } else if (!strcmp(k, "--stop")) {
            if (a->n_stop == MAX_STOP)
                return cli_fail("--stop: at most %d stop strings", MAX_STOP);
            a->stop[a->n_stop++] = v;
        } else if (!strcmp(k, "-n") || !strcmp(k, "--max-tokens")) {
            if (!cli_parse_long(v, 0, 1 << 24, &a->max_tokens))
                return cli_fail("-n: '%s' is not a whole number >= 0", v);
        } else if (!strcmp(k, "--temperature")) {
            if (!cli_parse_float(v, -3.4e38f, 3.4e38f, &a->temperature))
                return cli_fail("--temperature: '%s' is not a number", v);
        } else if (!strcmp(k, "--top-p")) {
            if (!cli_parse_float(v, -3.4e38f, 3.4e38f, &a->top_p))
                return cli_fail("--top-p: '%s' is not a number", v);
        } else if (!strcmp(k, "--top-k")) {
            if (!cli_parse_long(v, 0, 1L << 30, &a->top_k))
                return cli_fail("--top-k: '%s' is not a whole number >= 0", v);
        } else if (!strcmp(k, "--seed")) {
            char *end;
            errno = 0;
            a->seed = strtoull(v, &end, 10);
            if (errno || end == v || *end || *v == '-')
                return cli_fail("--seed: '%s' is not a whole number >= 0", v);
            a->has_seed = true;
        } else if (!strcmp(k, "--logprobs")) {
            if (!cli_parse_long(v, 0, 1000, &a->logprobs))
                return cli_fail("--logprobs: '%s' is not a whole number >= 0", v);
        } else if (!strcmp(k, "--repeat")) {
            if (!cli_parse_long(v, 1, 1L << 20, &a->repeat))
                return cli_fail("--repeat: '%s' is not a whole number in [1, 1048576]", v);
        } else if (!strcmp(k, "--timeout-ms")) {
            if (!cli_parse_long(v, 1, 1L << 31, &a->timeout_ms))
                return cli_fail("--timeout-ms: '%s' is not a positive whole number", v);
        } else {
            usage(stderr);
            return cli_fail("unknown option '%s'", k);
        }
    }
    if (!a->info && !a->prompt == !a->tokens)
        return cli_fail("give exactly one of --prompt TEXT, --tokens IDS or --info");
    /* --addr A,B,...: split (the copy lives as long as the process) */
    char *list = a->addr_copy = strdup(a->addr), *save = NULL;
    if (!list)
        return cli_fail("out of memory");
    for (char *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        while (*t == ' ')
            t++;
        if (!*t)
            continue;
        if (a->n_addrs == MAX_ADDRS)
            return cli_fail("--addr: at most %d addresses", MAX_ADDRS);
        a->addrs[a->n_addrs++] = t;
    }
    if (!a->n_addrs)
        return cli_fail("--addr: '%s' names no HOST:PORT", a->addr);
    return 0;
}

/* 0: done; 1: failed; 2: UNAVAILABLE, the next address may answer. */
static int run_info(struct rpc_client *client, const char *addr, const struct args *a)
{
    Moe__V1__ModelInfoRequest rq = MOE__V1__MODEL_INFO_REQUEST__INIT;
    uint8_t buf[16];
    size_t len = moe__v1__model_info_request__pack(&rq, buf);
    struct rpc_reply reply;
    if (rpc_client_call(client, "/moe.v1.Inference/GetModelInfo", buf, len,
                        a->timeout_ms ? a->timeout_ms : 5000, &reply) != RPC_OK) {
        cli_fail("%s: %s: %s", addr, rpc_code_name(reply.code), reply.message);
        int again = reply.code == RPC_UNAVAILABLE;
        rpc_reply_clear(&reply);
        return again ? 2 : 1;
    }
    Moe__V1__ModelInfo *info = moe__v1__model_info__unpack(NULL, reply.len, reply.data);
    rpc_reply_clear(&reply);
    if (!info)
        return cli_fail("%s: the ModelInfo reply does not parse", addr), 1;
    printf("model %s (%s, %s): vocab %u, context %u, %u layers, d_model %u, %u heads / %u KV "
           "heads, %u experts top-%u\n",
           info->name, info->architecture, info->dtype, info->vocab_size, info->max_context,
           info->n_layer, info->d_model, info->n_head, info->n_kv_head, info->n_expert,
           info->top_k);
    moe__v1__model_info__free_unpacked(info, NULL);
    return 0;
}

static const char *finish_name(Moe__V1__FinishReason f)
{
    switch (f) {
    case MOE__V1__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    case MOE__V1__FINISH_REASON__FINISH_REASON_STOP: return "stop";
    case MOE__V1__FINISH_REASON__FINISH_REASON_ABORT: return "abort";
    case MOE__V1__FINISH_REASON__FINISH_REASON_ERROR: return "error";
    default: return "none";
    }
}

/* One Generate on `client`: streams it to stdout, prints the summary.
 * 0: done; 1: failed; 2: UNAVAILABLE before any token (another address
 * may take it). */
static int run_generate(struct rpc_client *client, const char *addr, const uint8_t *buf, size_t len,
                        const struct args *a)
{
    struct moe_error err = {0};
    int rc;
    double t0 = moe_now(), t_first = 0, t_last = 0;
    struct rpc_client_stream *st = rpc_client_stream_start(client, "/moe.v1.Inference/Generate",
                                                           buf, len, a->timeout_ms, &err);
    if (!st)
        return cli_fail("%s: %s", addr, err.msg), 2;
    const uint8_t *msg;
    size_t msg_len;
    int n_tokens = 0;
    Moe__V1__GenerateResponse *last = NULL;
    while (rpc_client_stream_next(st, &msg, &msg_len)) {
        Moe__V1__GenerateResponse *r = moe__v1__generate_response__unpack(NULL, msg_len, msg);
        if (!r) {
            cli_fail("the server sent a message that does not parse");
            rpc_client_stream_cancel(st);
            continue;
        }
        double t = moe_now();
        if (r->n_token_ids) {
            if (!n_tokens)
                t_first = t;
            t_last = t;
            n_tokens += (int)r->n_token_ids;
        }
        if (!a->quiet) {
            fputs(r->text, stdout);
            for (size_t i = 0; i < r->n_logprobs; i++) {
                const Moe__V1__TokenLogprob *lp = r->logprobs[i];
                fprintf(stderr, "[token %u logprob %.4f", lp->token_id, (double)lp->logprob);
                for (size_t j = 0; j < lp->n_top; j++)
                    fprintf(stderr, "%s%u:%.4f", j ? " " : " | top ", lp->top[j]->token_id,
                            (double)lp->top[j]->logprob);
                fprintf(stderr, "]\n");
            }
            fflush(stdout);
        }
        if (r->finish_reason) {
            if (last)
                moe__v1__generate_response__free_unpacked(last, NULL);
            last = r;
        } else {
            moe__v1__generate_response__free_unpacked(r, NULL);
        }
    }
    const char *status_msg = NULL;
    enum rpc_code code = rpc_client_stream_status(st, &status_msg);
    if (!a->quiet)
        printf("\n");
    rc = 0;
    if (code != RPC_OK) {
        cli_fail("%s: %s: %s", addr, rpc_code_name(code), status_msg ? status_msg : "");
        rc = code == RPC_UNAVAILABLE && n_tokens == 0 ? 2 : 1;
        if (rc == 2) {
            if (last)
                moe__v1__generate_response__free_unpacked(last, NULL);
            rpc_client_stream_destroy(st);
            return rc;
        }
    }
    double ttft = n_tokens ? t_first - t0 : 0;
    double tpot = n_tokens > 1 ? (t_last - t_first) / (n_tokens - 1) : 0;
    printf("finish: %s, %d tokens", last ? finish_name(last->finish_reason) : "none", n_tokens);
    if (last && last->error && last->error[0])
        printf(" (error: %s)", last->error);
    printf("\nclient: TTFT %.1f ms, TPOT %.2f ms, end to end %.1f ms\n", ttft * 1e3, tpot * 1e3,
           (moe_now() - t0) * 1e3);
    if (last && last->timings && last->usage)
        printf(
            "server: prompt %u tokens (%u cached), queue %.1f ms, prefill %.1f ms, TTFT %.1f ms, "
            "decode %.1f ms, e2e %.1f ms\n",
            last->usage->prompt_tokens, last->usage->cached_prompt_tokens, last->timings->queue_ms,
            last->timings->prefill_ms, last->timings->ttft_ms, last->timings->decode_ms,
            last->timings->e2e_ms);
    if (last)
        moe__v1__generate_response__free_unpacked(last, NULL);
    rpc_client_stream_destroy(st);
    return rc;
}

int main(int argc, char **argv)
{
    cli_init("moe-client");
    struct args a;
    int rc = parse_args(argc, argv, &a);
    if (rc) {
        free(a.addr_copy);
        return rc;
    }
    struct moe_error err = {0};
    static struct rpc_client_options co; /* static: its TLS material lives until exit */
    char *token = NULL;
    if (moe_tls_create(&a.tls, &co.tls, &err) ||
        (a.token_file && moe_token_read("--token-file", a.token_file, &token, &err))) {
        moe_tls_destroy(co.tls);
        free(a.addr_copy);
        return cli_fail("%s", err.msg);
    }
    co.token = token;
    struct rpc_client *clients[MAX_ADDRS] = {0};
    for (int i = 0; i < a.n_addrs; i++)
        if (!(clients[i] = rpc_client_create(a.addrs[i], &co, &err))) {
            cli_fail("%s: %s", a.addrs[i], err.msg);
            for (int k = 0; k < i; k++)
                rpc_client_destroy(clients[k]);
            free(token);
            moe_tls_destroy(co.tls);
            free(a.addr_copy);
            return 1;
        }
    free(token);

    int cur = 0; /* the address that answered last */
    uint8_t *buf = NULL;
    if (a.info) {
        for (int k = 0; k < a.n_addrs; k++) {
            int i = (cur + k) % a.n_addrs;
            rc = run_info(clients[i], a.addrs[i], &a);
            if (rc != 2)
                break;
            if (k + 1 < a.n_addrs)
                fprintf(stderr, "moe-client: trying the next address\n");
        }
        rc = rc ? 1 : 0;
        goto out;
    }
    Moe__V1__GenerateRequest rq = MOE__V1__GENERATE_REQUEST__INIT;
    Moe__V1__SamplingParams sp = MOE__V1__SAMPLING_PARAMS__INIT;
    Moe__V1__TokenIds ids = MOE__V1__TOKEN_IDS__INIT;
    uint32_t tok_buf[4096];
    rq.request_id = (char *)(a.request_id ? a.request_id : "");
    rq.model = (char *)(a.model ? a.model : "");
    rq.stream_text = true;
    rq.sampling = &sp;
    if (a.prompt) {
        rq.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TEXT;
        rq.text = (char *)a.prompt;
    } else {
        size_t n = 0;
        for (const char *p = a.tokens; *p;) {
            char *end;
            errno = 0;
            unsigned long v = strtoul(p, &end, 10);
            if (errno || end == p || v > UINT32_MAX || n == 4096) {
                cli_fail("--tokens: bad id list '%s'", a.tokens);
                rc = 1;
                goto out;
            }
            tok_buf[n++] = (uint32_t)v;
            p = end;
            while (*p == ',' || *p == ' ')
                p++;
        }
        ids.n_ids = n;
        ids.ids = tok_buf;
        rq.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS;
        rq.token_ids = &ids;
    }
    sp.max_tokens = (uint32_t)a.max_tokens;
    sp.temperature = a.temperature;
    sp.top_p = a.top_p;
    sp.top_k = (uint32_t)a.top_k;
    sp.ignore_eos = a.ignore_eos;
    sp.skip_special_tokens = true;
    sp.n_stop = (size_t)a.n_stop;
    sp.stop = (char **)a.stop;
    if (a.has_seed) {
        sp.seed_opt_case = MOE__V1__SAMPLING_PARAMS__SEED_OPT_SEED;
        sp.seed = a.seed;
    }
    if (a.logprobs >= 0) {
        sp.logprobs_opt_case = MOE__V1__SAMPLING_PARAMS__LOGPROBS_OPT_LOGPROBS;
        sp.logprobs = (uint32_t)a.logprobs;
    }
    size_t len = moe__v1__generate_request__get_packed_size(&rq);
    buf = malloc(len ? len : 1);
    if (!buf) {
        cli_fail("out of memory");
        rc = 1;
        goto out;
    }
    moe__v1__generate_request__pack(&rq, buf);

    for (long r = 0; r < a.repeat; r++) {
        for (int k = 0; k < a.n_addrs; k++) {
            int i = (cur + k) % a.n_addrs;
            rc = run_generate(clients[i], a.addrs[i], buf, len, &a);
            if (rc != 2) {
                cur = i;
                break;
            }
            if (k + 1 < a.n_addrs)
                fprintf(stderr, "moe-client: trying the next address (%s)\n",
                        a.addrs[(i + 1) % a.n_addrs]);
        }
        if (rc)
            break;
    }
    rc = rc ? 1 : 0;
out:
    free(buf);
    for (int i = 0; i < a.n_addrs; i++)
        rpc_client_destroy(clients[i]);
    moe_tls_destroy(co.tls);
    free(a.addr_copy);
    return rc;
}
