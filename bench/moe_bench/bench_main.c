/* moe-bench: a serving load generator, one load-generating process per MPI
 * rank (or one process alone), against the native gRPC Inference API or any
 * OpenAI-compatible HTTP server. See bench.h for the parts and README.md
 * ("moe-bench") for examples.
 *
 * Under mpirun the ranks share one global sequence of requests (index i goes
 * to rank i % size, at the global arrival time of i), start together (a
 * barrier, then rank 0 broadcasts a wall-clock start a moment ahead that
 * every rank maps onto its monotonic clock), and rank 0 gathers every
 * per-request record and reports the whole job. */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <curl/curl.h>
#include <mpi.h>

#include "auth_token.h"
#include "bench.h"
#include "cli.h"
#include "client.h"
#include "metrics.h"
#include "plot.h"
#include "report.h"
#include "runner.h"
#include "schedule.h"
#include "tls_opts.h"
#include "tokenizer.h"
#include "workload.h"
#include "clock.h"

#define MAX_SWEEP 32
#define MAX_TARGETS 64

struct args {
    struct moe_tls_opts tls;
    const char *api_key, *token_file;
    enum bench_backend backend;
    const char *base_url, *endpoint, *model, *tokenizer;
    long vocab;
    enum bench_dataset ds;
    const char *dataset_path;
    long num_prompts; /* -1: default */
    double duration;  /* 0: none */
    long random_input_len, random_output_len;
    double random_range_ratio;
    long sharegpt_output_len;
    long prefix_len, suffix_len, num_prefixes, prefix_output_len;
    long trace_block_size;
    bool fixed_schedule;
    double request_rate, burstiness;
    long max_concurrency, warmup;
    double sweep[MAX_SWEEP];
    int n_sweep;
    unsigned long long seed;
    bool ignore_eos, has_temperature;
    float temperature, top_p;
    long top_k;
    bool show[4];
    double pcts[BENCH_MAX_PCT];
    int n_pct;
    struct bench_goodput goodput;
    bool has_goodput;
    const char *save_result, *save_requests, *plot_dir, *label, *rid_prefix;
    bool prompt_tokens;
    double timeout_s;
    bool quiet;
};

static int g_rank = 0, g_size = 1;
static bool g_mpi = false;

/* A bad command line: printed by rank 0 only (every rank sees the same). */
static int arg_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int arg_fail(const char *fmt, ...)
{
    if (g_rank == 0) {
        char msg[1024];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        cli_fail("%s", msg);
    }
    return 2;
}

static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: [mpirun -np N] moe-bench --base-url URL[,URL...] [options]\n"
        "target\n"
        "  --backend grpc|openai        default grpc (moe.v1.Inference/Generate)\n"
        "  --base-url LIST              grpc: HOST:PORT; openai: http://HOST:PORT; a comma\n"
        "                               list spreads the ranks over several targets\n"
        "  --endpoint PATH              openai: /v1/completions (default) | /v1/chat/completions\n"
        "  --model NAME                 model to ask for (default: the server's)\n"
        "  --tokenizer PATH             tokenizer.json or its folder (exact prompt lengths, text)\n"
        "  --vocab-size N               ids below N without a tokenizer (gRPC: asked)\n"
        "  --prompt-format text|tokens  openai completions: prompt as text (default with a\n"
        "                               tokenizer) or token ids\n"
        "  --request-timeout S          per request (default 600)\n"
        "  --api-key KEY | --token-file F  bearer token sent with every request (openai:\n"
        "                               default $OPENAI_API_KEY)\n"
        "  --tls-ca F [--tls-cert F --tls-key F] [--tls-server-name N]  grpc over TLS;\n"
        "                               openai: the CA and client certificate for https://\n"
        "workload\n"
        "  --dataset-name random|sharegpt|prefix_repetition|trace   (default random)\n"
        "  --dataset-path FILE          ShareGPT JSON, or trace JSON Lines\n"
        "  --num-prompts N              (default 100; a trace: its lines)\n"
        "  --duration S                 send for S seconds instead of a count\n"
        "  --random-input-len N (1024) --random-output-len N (128) --random-range-ratio R (0)\n"
        "  --sharegpt-output-len N      (default: the second turn's token count)\n"
        "  --prefix-repetition-prefix-len L (256) --prefix-repetition-suffix-len S (256)\n"
        "  --prefix-repetition-num-prefixes N (10) --prefix-repetition-output-len N (128)\n"
        "  --trace-block-size N         tokens per hash id (default 512, as Mooncake)\n"
        "  --fixed-schedule             send trace requests at their timestamps\n"
        "  --seed S                     every workload and schedule follows it (default 0)\n"
        "arrivals\n"
        "  --request-rate R|inf         requests/s over the whole job (default inf)\n"
        "  --burstiness B               1 = Poisson (default), else gamma gaps of shape B\n"
        "  --max-concurrency N          requests in flight over the whole job\n"
        "  --warmup N                   N unmeasured requests first (alias --num-warmups)\n"
        "  --sweep-rates A,B,C          one run per rate\n"
        "sampling\n"
        "  --ignore-eos --temperature T --top-p P --top-k K\n"
        "output\n"
        "  --percentile-metrics LIST    of ttft,tpot,itl,e2el (default ttft,tpot,itl)\n"
        "  --metric-percentiles LIST    (default 99)\n"
        "  --goodput KEY:MS...          SLOs, keys ttft, tpot, e2el (e.g. ttft:150 tpot:50)\n"
        "  --save-result FILE.json      vLLM-style result (a sweep: FILE-rateR.json each)\n"
        "  --save-requests FILE.jsonl   one line per request\n"
        "  --plot DIR                   PNG charts\n"
        "  --label TEXT --request-id-prefix P --quiet\n");
}

/* A number > 0 or "inf" (rates). */
static bool parse_rate(const char *s, double *out)
{
    if (!strcmp(s, "inf") || !strcmp(s, "Inf") || !strcmp(s, "INF")) {
        *out = INFINITY;
        return true;
    }
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || v <= 0)
        return false;
    *out = v;
    return true;
}

static bool parse_pos(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || v <= 0)
        return false;
    *out = v;
    return true;
}

static int parse_goodput(struct args *a, const char *v)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", v);
    for (char *tok = strtok(buf, ", "); tok; tok = strtok(NULL, ", ")) {
        char *colon = strchr(tok, ':');
        double ms;
        if (!colon)
            return arg_fail("--goodput: '%s' is not KEY:MS (keys ttft, tpot, e2el)", tok);
        *colon = 0;
        char *end;
        errno = 0;
        ms = strtod(colon + 1, &end);
        if (errno || end == colon + 1 || *end || !isfinite(ms) || ms < 0)
            return arg_fail("--goodput: '%s' for %s is not a number of ms >= 0", colon + 1, tok);
        if (!strcmp(tok, "ttft")) {
            a->goodput.has_ttft = true;
            a->goodput.ttft_ms = ms;
        } else if (!strcmp(tok, "tpot")) {
            a->goodput.has_tpot = true;
            a->goodput.tpot_ms = ms;
        } else if (!strcmp(tok, "e2el")) {
            a->goodput.has_e2el = true;
            a->goodput.e2el_ms = ms;
        } else {
            return arg_fail("--goodput: unknown metric '%s' (ttft, tpot, e2el)", tok);
        }
        a->has_goodput = true;
    }
    return 0;
}

static int parse_list(const char *flag, const char *v, double *out, int max, bool rates, int *n)
{
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", v);
    *n = 0;
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        if (*n == max)
            return arg_fail("%s: at most %d values", flag, max);
        double x;
        char *end;
        if (rates) {
            if (!parse_rate(tok, &x))
                return arg_fail("%s: '%s' must be a number > 0 or 'inf'", flag, tok);
        } else {
            errno = 0;
            x = strtod(tok, &end);
            if (errno || end == tok || *end || !(x >= 0 && x <= 100))
                return arg_fail("%s: '%s' is not a percentile in [0, 100]", flag, tok);
        }
        out[(*n)++] = x;
    }
    if (*n == 0)
        return arg_fail("%s: empty list", flag);
    return 0;
}

static int parse_args(int argc, char **argv, struct args *a)
{
    *a = (struct args){
        .backend = BENCH_BACKEND_GRPC,
        .num_prompts = -1,
        .random_input_len = 1024,
        .random_output_len = 128,
        .prefix_len = 256,
        .suffix_len = 256,
        .num_prefixes = 10,
        .prefix_output_len = 128,
        .trace_block_size = 512,
        .request_rate = INFINITY,
        .burstiness = 1,
        .show = {true, true, true, false},
        .pcts = {99},
        .n_pct = 1,
        .rid_prefix = "bench-",
        .timeout_s = 600,
    };
    const char *prompt_format = NULL;
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        if (!strcmp(k, "-h") || !strcmp(k, "--help")) {
            if (g_rank == 0)
                usage(stdout);
            return -1;
        }
        if (!strcmp(k, "--ignore-eos")) {
            a->ignore_eos = true;
            continue;
        }
        if (!strcmp(k, "--fixed-schedule")) {
            a->fixed_schedule = true;
            continue;
        }
        if (!strcmp(k, "--quiet")) {
            a->quiet = true;
            continue;
        }
        if (i + 1 >= argc)
            return arg_fail("option '%s' needs a value", k);
        const char *v = argv[++i];
        long *lp = NULL;
        long lo = 0, hi = 0;
        if (!strcmp(k, "--backend")) {
            if (!strcmp(v, "grpc"))
                a->backend = BENCH_BACKEND_GRPC;
            else if (!strcmp(v, "openai"))
                a->backend = BENCH_BACKEND_OPENAI;
            else
                return arg_fail("--backend: '%s' is not grpc or openai", v);
        } else if (moe_tls_cli_flag(&a->tls, k, v)) {
            continue;
        } else if (!strcmp(k, "--api-key")) {
            a->api_key = v;
        } else if (!strcmp(k, "--token-file")) {
            a->token_file = v;
        } else if (!strcmp(k, "--base-url")) {
            a->base_url = v;
        } else if (!strcmp(k, "--endpoint")) {
            a->endpoint = v;
        } else if (!strcmp(k, "--model")) {
            a->model = v;
        } else if (!strcmp(k, "--tokenizer")) {
            a->tokenizer = v;
        } else if (!strcmp(k, "--prompt-format")) {
            prompt_format = v;
            if (strcmp(v, "text") && strcmp(v, "tokens"))
                return arg_fail("--prompt-format: '%s' is not text or tokens", v);
        } else if (!strcmp(k, "--dataset-name")) {
            if (!bench_dataset_parse(v, &a->ds))
                return arg_fail("--dataset-name: '%s' is not random, sharegpt, prefix_repetition "
                                "or trace",
                                v);
        } else if (!strcmp(k, "--dataset-path")) {
            a->dataset_path = v;
        } else if (!strcmp(k, "--duration")) {
            if (!parse_pos(v, &a->duration))
                return arg_fail("--duration: '%s' must be a number of seconds > 0", v);
        } else if (!strcmp(k, "--random-range-ratio")) {
            char *end;
            errno = 0;
            a->random_range_ratio = strtod(v, &end);
            if (errno || end == v || *end || !(a->random_range_ratio >= 0) ||
                a->random_range_ratio >= 1)
                return arg_fail("--random-range-ratio: '%s' must be in [0, 1)", v);
        } else if (!strcmp(k, "--request-rate")) {
            if (!parse_rate(v, &a->request_rate))
                return arg_fail("--request-rate: '%s' must be a number > 0 or 'inf'", v);
        } else if (!strcmp(k, "--burstiness")) {
            if (!parse_pos(v, &a->burstiness))
                return arg_fail("--burstiness: '%s' must be a number > 0", v);
        } else if (!strcmp(k, "--sweep-rates")) {
            int rc = parse_list(k, v, a->sweep, MAX_SWEEP, true, &a->n_sweep);
            if (rc)
                return rc;
        } else if (!strcmp(k, "--metric-percentiles")) {
            int rc = parse_list(k, v, a->pcts, BENCH_MAX_PCT, false, &a->n_pct);
            if (rc)
                return rc;
        } else if (!strcmp(k, "--percentile-metrics")) {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", v);
            memset(a->show, 0, sizeof a->show);
            static const char *names[4] = {"ttft", "tpot", "itl", "e2el"};
            for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
                int m = -1;
                for (int j = 0; j < 4; j++)
                    if (!strcmp(t, names[j]))
                        m = j;
                if (m < 0)
                    return arg_fail("--percentile-metrics: unknown metric '%s' (ttft, tpot, itl, "
                                    "e2el)",
                                    t);
                a->show[m] = true;
            }
        } else if (!strcmp(k, "--goodput")) {
            int rc = parse_goodput(a, v);
            /* more KEY:MS words may follow, as vLLM takes them */
            while (!rc && i + 1 < argc && strncmp(argv[i + 1], "--", 2) && strchr(argv[i + 1], ':'))
                rc = parse_goodput(a, argv[++i]);
            if (rc)
                return rc;
        } else if (!strcmp(k, "--seed")) {
            char *end;
            errno = 0;
            a->seed = strtoull(v, &end, 10);
            if (errno || end == v || *end || *v == '-')
                return arg_fail("--seed: '%s' is not a whole number >= 0", v);
        } else if (!strcmp(k, "--temperature")) {
            if (!cli_parse_float(v, 0, 100, &a->temperature))
                return arg_fail("--temperature: '%s' is not a number in [0, 100]", v);
            a->has_temperature = true;
        } else if (!strcmp(k, "--top-p")) {
            if (!cli_parse_float(v, 0, 1, &a->top_p))
                return arg_fail("--top-p: '%s' is not a number in [0, 1]", v);
        } else if (!strcmp(k, "--request-timeout")) {
            if (!parse_pos(v, &a->timeout_s))
                return arg_fail("--request-timeout: '%s' must be a number of seconds > 0", v);
        } else if (!strcmp(k, "--save-result")) {
            a->save_result = v;
        } else if (!strcmp(k, "--save-requests")) {
            a->save_requests = v;
        } else if (!strcmp(k, "--plot")) {
            a->plot_dir = v;
        } else if (!strcmp(k, "--label")) {
            a->label = v;
        } else if (!strcmp(k, "--request-id-prefix")) {
            a->rid_prefix = v;
        } else if (!strcmp(k, "--num-prompts")) {
            lp = &a->num_prompts, lo = 1, hi = 100000000;
        } else if (!strcmp(k, "--vocab-size")) {
            lp = &a->vocab, lo = 1, hi = 1 << 30;
        } else if (!strcmp(k, "--random-input-len")) {
            lp = &a->random_input_len, lo = 1, hi = 1 << 24;
        } else if (!strcmp(k, "--random-output-len")) {
            lp = &a->random_output_len, lo = 1, hi = 1 << 24;
        } else if (!strcmp(k, "--sharegpt-output-len")) {
            lp = &a->sharegpt_output_len, lo = 1, hi = 1 << 24;
        } else if (!strcmp(k, "--prefix-repetition-prefix-len")) {
            lp = &a->prefix_len, lo = 0, hi = 1 << 24;
        } else if (!strcmp(k, "--prefix-repetition-suffix-len")) {
            lp = &a->suffix_len, lo = 1, hi = 1 << 24;
        } else if (!strcmp(k, "--prefix-repetition-num-prefixes")) {
            lp = &a->num_prefixes, lo = 1, hi = 1 << 20;
        } else if (!strcmp(k, "--prefix-repetition-output-len")) {
            lp = &a->prefix_output_len, lo = 1, hi = 1 << 24;
        } else if (!strcmp(k, "--trace-block-size")) {
            lp = &a->trace_block_size, lo = 1, hi = 1 << 20;
        } else if (!strcmp(k, "--max-concurrency")) {
            lp = &a->max_concurrency, lo = 1, hi = 1 << 20;
        } else if (!strcmp(k, "--warmup") || !strcmp(k, "--num-warmups")) {
            lp = &a->warmup, lo = 0, hi = 1 << 20;
        } else if (!strcmp(k, "--top-k")) {
            lp = &a->top_k, lo = 0, hi = 1 << 30;
        } else {
            if (g_rank == 0)
                usage(stderr);
            return arg_fail("unknown option '%s'", k);
        }
        if (lp && !cli_parse_long(v, lo, hi, lp))
            return arg_fail("%s: '%s' is not a whole number in [%ld, %ld]", k, v, lo, hi);
    }
    if (!a->base_url)
        return arg_fail("--base-url is required (grpc: HOST:PORT, openai: http://HOST:PORT)");
    if (a->backend == BENCH_BACKEND_GRPC && a->endpoint)
        return arg_fail("--endpoint is for --backend openai");
    if (prompt_format && a->backend != BENCH_BACKEND_OPENAI)
        return arg_fail("--prompt-format is for --backend openai (gRPC sends token ids)");
    a->prompt_tokens = prompt_format && !strcmp(prompt_format, "tokens");
    if (a->fixed_schedule && a->ds != BENCH_DS_TRACE)
        return arg_fail("--fixed-schedule replays a trace's timestamps: use --dataset-name trace");
    if (a->fixed_schedule && (a->n_sweep || !isinf(a->request_rate)))
        return arg_fail("--fixed-schedule takes the arrivals from the trace: drop "
                        "--request-rate / --sweep-rates");
    if (a->n_sweep && !isinf(a->request_rate))
        return arg_fail("give --request-rate or --sweep-rates, not both");
    if (a->duration > 0 && a->num_prompts > 0)
        return arg_fail("give --num-prompts or --duration, not both");
    if (a->duration > 0 && a->fixed_schedule)
        return arg_fail("--duration with --fixed-schedule: the trace decides the length");
    if (a->duration > 0 && isinf(a->request_rate) && !a->n_sweep && !a->max_concurrency)
        return arg_fail("--duration with --request-rate inf needs --max-concurrency (a closed "
                        "loop of that many requests)");
    if (a->max_concurrency && a->max_concurrency < g_size)
        return arg_fail("--max-concurrency %ld is below the number of ranks (%d): every rank "
                        "needs at least one",
                        a->max_concurrency, g_size);
    return 0;
}

/* ---- MPI glue -------------------------------------------------------------------- */

static bool under_mpirun(void)
{
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
}

/* True on every rank when some rank says bad. */
static bool any_rank(bool bad)
{
    if (!g_mpi)
        return bad;
    int in = bad, out = 0;
    MPI_Allreduce(&in, &out, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return out != 0;
}

/* A common t = 0 on every rank's monotonic clock. */
static double common_start(void)
{
    double t_real = 0;
    if (g_mpi)
        MPI_Barrier(MPI_COMM_WORLD);
    if (g_rank == 0)
        t_real = bench_now_realtime() + (g_mpi ? 0.25 : 0.02);
    if (g_mpi)
        MPI_Bcast(&t_real, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    return moe_now() + (t_real - bench_now_realtime());
}

/* Gathers every rank's records on rank 0 (appended to *all). */
static enum moe_status gather(const struct bench_run_result *mine, struct bench_record **all,
                              size_t *n_all, struct moe_error *err)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    size_t cap = 0;
    *all = NULL;
    *n_all = 0;
    if (bench_records_pack(mine->recs, mine->n, &buf, &len))
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory packing records");
    if (!g_mpi) {
        enum moe_status st = bench_records_unpack(buf, len, all, n_all, &cap, err);
        free(buf);
        return st;
    }
    if (len > (size_t)INT32_MAX) {
        free(buf);
        return moe_error_set(err, MOE_ERR_UNSUPPORTED, "rank %d: %zu bytes of records", g_rank,
                             len);
    }
    int my_len = (int)len;
    int *lens = NULL, *displs = NULL;
    uint8_t *rbuf = NULL;
    long long total = 0;
    if (g_rank == 0) {
        lens = calloc((size_t)g_size, sizeof(int));
        displs = calloc((size_t)g_size, sizeof(int));
    }
    MPI_Gather(&my_len, 1, MPI_INT, lens, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (g_rank == 0) {
        for (int r = 0; r < g_size; r++) {
            displs[r] = (int)total;
            total += lens[r];
        }
        rbuf = malloc((size_t)total);
    }
    MPI_Gatherv(buf, my_len, MPI_BYTE, rbuf, lens, displs, MPI_BYTE, 0, MPI_COMM_WORLD);
    free(buf);
    enum moe_status st = MOE_OK;
    if (g_rank == 0)
        for (int r = 0; r < g_size && !st; r++)
            st = bench_records_unpack(rbuf + displs[r], (size_t)lens[r], all, n_all, &cap, err);
    free(rbuf);
    free(lens);
    free(displs);
    return st;
}

static int cmp_index(const void *a, const void *b)
{
    const struct bench_record *x = a, *y = b;
    return (x->index > y->index) - (x->index < y->index);
}

/* "out.json" + rate 4 -> "out-rate4.json" */
static void sweep_path(char *buf, size_t cap, const char *path, double rate, bool sweep)
{
    if (!sweep) {
        snprintf(buf, cap, "%s", path);
        return;
    }
    char r[32];
    if (isinf(rate))
        snprintf(r, sizeof r, "inf");
    else
        snprintf(r, sizeof r, "%g", rate);
    const char *slash = strrchr(path, '/'), *dot = strrchr(path, '.');
    if (dot && (!slash || dot > slash))
        snprintf(buf, cap, "%.*s-rate%s%s", (int)(dot - path), path, r, dot);
    else
        snprintf(buf, cap, "%s-rate%s", path, r);
}

struct run_out {
    struct bench_record *recs;
    size_t n;
    struct bench_metrics m;
    char name[48];
};

int main(int argc, char **argv)
{
    cli_init("moe-bench");
    signal(SIGPIPE, SIG_IGN);
    if (under_mpirun()) {
        int provided = 0;
        if (MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
            return cli_fail("MPI_Init_thread failed"), 1;
        g_mpi = true;
        MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
        MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    }
    struct args a;
    int rc = parse_args(argc, argv, &a);
    struct moe_tokenizer *tok = NULL;
    struct bench_target *target = NULL;
    struct moe_tls *tls = NULL; /* --tls-* */
    char *token = NULL;         /* --token-file */
    struct bench_workload *w = NULL;
    struct run_out runs[MAX_SWEEP];
    int n_runs = 0;
    double *arrivals = NULL;
    struct moe_error err = {0};
    bool curl_up = false;
    if (rc) {
        rc = rc < 0 ? 0 : rc;
        goto out;
    }
    rc = 1;
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        cli_fail("curl_global_init failed");
        goto out;
    }
    curl_up = true;

    /* ---- targets: rank r drives target r % n ---- */
    char urls[MAX_TARGETS][512];
    int n_targets = 0;
    {
        char buf[8192];
        snprintf(buf, sizeof buf, "%s", a.base_url);
        for (char *t = strtok(buf, ","); t && n_targets < MAX_TARGETS; t = strtok(NULL, ","))
            snprintf(urls[n_targets++], sizeof urls[0], "%s", t);
        if (n_targets == 0) {
            arg_fail("--base-url: empty list");
            rc = 2;
            goto out;
        }
    }
    int my_target = g_rank % n_targets;
    if (a.api_key && a.token_file) {
        arg_fail("give one of --api-key and --token-file");
        rc = 2;
        goto out;
    }
    if ((a.token_file && moe_token_read("--token-file", a.token_file, &token, &err)) ||
        moe_tls_create(&a.tls, &tls, &err)) {
        arg_fail("%s", err.msg);
        rc = 2;
        goto out;
    }
    struct bench_target_opts to = {
        .api_key = token ? token : a.api_key,
        .tls = tls,
        .backend = a.backend,
        .url = urls[my_target],
        .endpoint = a.endpoint,
        .model = a.model,
        .prompt_tokens = a.prompt_tokens,
        .ignore_eos = a.ignore_eos,
        .has_temperature = a.has_temperature,
        .temperature = a.temperature,
        .top_p = a.top_p,
        .top_k = (int)a.top_k,
        .timeout_s = a.timeout_s,
    };
    bool chat = a.endpoint && !strcmp(a.endpoint, "/v1/chat/completions");
    bool bad = false;
    if (bench_target_create(&to, &target, &err)) {
        bad = true;
    }
    if (any_rank(bad)) {
        if (bad)
            cli_fail("%s", err.msg);
        rc = bad && err.code == MOE_ERR_INVALID ? 2 : 1;
        goto out;
    }
    char model[256] = "";
    int vocab = 0;
    if (bench_target_probe(target, 10.0, model, sizeof model, &vocab, &err))
        bad = true;
    if (any_rank(bad)) {
        if (bad)
            cli_fail("rank %d: %s", g_rank, err.msg);
        goto out;
    }
    if (a.vocab > 0)
        vocab = (int)a.vocab;
    if (g_mpi) { /* the same prompts on every rank: the smallest vocabulary */
        int in = vocab > 0 ? vocab : INT32_MAX, outv = 0;
        MPI_Allreduce(&in, &outv, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        vocab = outv == INT32_MAX ? 0 : outv;
        MPI_Bcast(model, sizeof model, MPI_CHAR, 0, MPI_COMM_WORLD);
    }

    /* ---- tokenizer and workload ---- */
    if (a.tokenizer) {
        char path[4096];
        struct stat sb;
        if (stat(a.tokenizer, &sb) == 0 && S_ISDIR(sb.st_mode))
            snprintf(path, sizeof path, "%s/tokenizer.json", a.tokenizer);
        else
            snprintf(path, sizeof path, "%s", a.tokenizer);
        if (moe_tokenizer_load(path, &tok, &err)) {
            if (g_rank == 0)
                cli_fail("--tokenizer: %s", err.msg);
            goto out;
        }
    }
    bool openai_text = a.backend == BENCH_BACKEND_OPENAI && !a.prompt_tokens && (tok || chat);
    if (a.backend == BENCH_BACKEND_OPENAI && !tok && !chat && !a.prompt_tokens &&
        a.ds != BENCH_DS_SHAREGPT && g_rank == 0)
        fprintf(stderr, "moe-bench: no --tokenizer: prompts go to %s as token ids\n",
                a.endpoint ? a.endpoint : "/v1/completions");
    struct bench_workload_opts wo = {
        .kind = a.ds,
        .path = a.dataset_path,
        .seed = a.seed,
        .tok = tok,
        .vocab = vocab,
        .want_text = openai_text,
        .random_input_len = (int)a.random_input_len,
        .random_output_len = (int)a.random_output_len,
        .random_range_ratio = a.random_range_ratio,
        .sharegpt_output_len = (int)a.sharegpt_output_len,
        .prefix_len = (int)a.prefix_len,
        .suffix_len = (int)a.suffix_len,
        .num_prefixes = (int)a.num_prefixes,
        .prefix_output_len = (int)a.prefix_output_len,
        .trace_block_size = (int)a.trace_block_size,
    };
    if (bench_workload_create(&wo, &w, &err)) {
        if (g_rank == 0)
            cli_fail("%s", err.msg);
        rc = err.code == MOE_ERR_INVALID ? 2 : 1;
        goto out;
    }
    long num_prompts = a.num_prompts;
    if (num_prompts < 0 && a.duration <= 0)
        num_prompts = a.ds == BENCH_DS_TRACE ? (long)bench_workload_size(w) : 100;

    double rates[MAX_SWEEP];
    int n_rates = a.n_sweep ? a.n_sweep : 1;
    if (a.n_sweep)
        memcpy(rates, a.sweep, sizeof(double) * (size_t)a.n_sweep);
    else
        rates[0] = a.request_rate;
    for (int i = 0; i < n_rates; i++)
        if (a.duration > 0 && isinf(rates[i]) && !a.max_concurrency) {
            arg_fail("--duration with rate inf needs --max-concurrency");
            rc = 2;
            goto out;
        }
    int my_conc = 0;
    if (a.max_concurrency)
        my_conc = (int)(a.max_concurrency / g_size + (g_rank < a.max_concurrency % g_size));
    if (my_conc > BENCH_MAX_INFLIGHT) {
        if (g_rank == 0)
            cli_fail("--max-concurrency %ld: at most %d per rank; use more ranks",
                     a.max_concurrency, BENCH_MAX_INFLIGHT);
        rc = 2;
        goto out;
    }
    if (g_rank == 0 && !a.quiet) {
        fprintf(stderr, "moe-bench: %d rank%s, %s backend, target%s %s, model '%s'\n", g_size,
                g_size > 1 ? "s" : "", a.backend == BENCH_BACKEND_GRPC ? "grpc" : "openai",
                n_targets > 1 ? "s" : "", a.base_url, model);
        fprintf(stderr, "moe-bench: workload %s, ", bench_dataset_name(a.ds));
        if (num_prompts > 0)
            fprintf(stderr, "%ld prompts", num_prompts);
        else
            fprintf(stderr, "%.1f s", a.duration);
        fprintf(stderr, ", seed %llu, max concurrency %ld\n", a.seed, a.max_concurrency);
    }

    /* ---- warm-up (not measured) ---- */
    if (a.warmup > 0) {
        struct bench_run_opts ro = {
            .w = w,
            .target = target,
            .target_index = my_target,
            .rank = g_rank,
            .size = g_size,
            .n_total = (size_t)a.warmup,
            .max_concurrency = my_conc,
            .warmup = true,
            .rid_prefix = a.rid_prefix,
        };
        struct bench_run_result res;
        double t0 = common_start();
        bad = bench_run(&ro, t0, &res, &err) != MOE_OK;
        size_t failed = 0;
        for (size_t i = 0; i < res.n; i++)
            failed += !res.recs[i].success;
        bench_run_result_free(&res);
        if (any_rank(bad)) {
            if (bad)
                cli_fail("warm-up: %s", err.msg);
            goto out;
        }
        if (g_rank == 0 && !a.quiet)
            fprintf(stderr, "moe-bench: warm-up done (%ld requests%s)\n", a.warmup,
                    failed ? ", some failed" : "");
    }

    /* ---- one run per rate ---- */
    bool all_failed = true;
    for (int ri = 0; ri < n_rates; ri++) {
        double rate = rates[ri];
        size_t n_total = 0;
        bool closed = false;
        free(arrivals);
        arrivals = NULL;
        enum moe_status st = MOE_OK;
        if (a.fixed_schedule) {
            n_total = (size_t)num_prompts;
            arrivals = malloc(n_total * sizeof(double));
            if (!arrivals)
                st = MOE_ERR_NOMEM;
            for (size_t i = 0; arrivals && i < n_total; i++)
                arrivals[i] = bench_workload_timestamp(w, (int64_t)i);
        } else if (a.duration > 0 && isinf(rate)) {
            closed = true;
        } else if (a.duration > 0) {
            st = bench_schedule_duration(a.duration, rate, a.burstiness, a.seed, &arrivals,
                                         &n_total);
        } else {
            n_total = (size_t)num_prompts;
            st = bench_schedule_count(n_total, rate, a.burstiness, a.seed, &arrivals);
        }
        if (st) {
            cli_fail("out of memory for the schedule");
            goto out;
        }
        struct run_out *ro_out = &runs[n_runs];
        memset(ro_out, 0, sizeof(*ro_out));
        if (a.fixed_schedule)
            snprintf(ro_out->name, sizeof ro_out->name, "trace schedule");
        else if (isinf(rate))
            snprintf(ro_out->name, sizeof ro_out->name, "rate inf");
        else
            snprintf(ro_out->name, sizeof ro_out->name, "rate %g/s", rate);
        if (g_rank == 0 && !a.quiet)
            fprintf(stderr, "moe-bench: run %d/%d: %s, %s%zu requests\n", ri + 1, n_rates,
                    ro_out->name, closed ? "closed loop, " : "", n_total);
        struct bench_run_opts ro = {
            .w = w,
            .target = target,
            .target_index = my_target,
            .rank = g_rank,
            .size = g_size,
            .n_total = n_total,
            .arrivals = arrivals,
            .closed_loop = closed,
            .duration_s = a.duration,
            .max_concurrency = my_conc,
            /* every run of a sweep sends other prompts: a prefix cache must not
             * remember the previous run's */
            .item_base = (int64_t)ri << 32,
            .rid_prefix = a.rid_prefix,
            .progress = g_rank == 0 && !a.quiet,
            .label = ro_out->name,
        };
        struct bench_run_result res;
        double t0 = common_start();
        bad = bench_run(&ro, t0, &res, &err) != MOE_OK;
        if (any_rank(bad)) {
            if (bad)
                cli_fail("rank %d: %s", g_rank, err.msg);
            bench_run_result_free(&res);
            goto out;
        }
        double end_s = res.end_s;
        if (g_mpi) {
            double e = end_s;
            MPI_Reduce(&e, &end_s, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        }
        st = gather(&res, &ro_out->recs, &ro_out->n, &err);
        bench_run_result_free(&res);
        if (any_rank(st != MOE_OK)) {
            if (st)
                cli_fail("gathering the records: %s", err.msg);
            goto out;
        }
        n_runs++;
        if (g_rank != 0)
            continue;
        qsort(ro_out->recs, ro_out->n, sizeof(struct bench_record), cmp_index);
        if (bench_metrics_compute(ro_out->recs, ro_out->n, end_s, a.pcts, a.n_pct,
                                  a.has_goodput ? &a.goodput : NULL, &ro_out->m)) {
            cli_fail("out of memory computing the metrics");
            goto out;
        }
        if (ro_out->m.completed)
            all_failed = false;
        struct bench_report_info info = {
            .backend = a.backend == BENCH_BACKEND_GRPC ? "grpc" : "openai",
            .endpoint = a.endpoint,
            .label = a.label,
            .model_id = model,
            .tokenizer_id = a.tokenizer,
            .dataset_name = bench_dataset_name(a.ds),
            .targets = a.base_url,
            .rid_prefix = a.rid_prefix,
            .num_prompts = closed || a.duration > 0 ? -1 : num_prompts,
            .duration_goal = a.duration,
            .request_rate = a.fixed_schedule ? INFINITY : rate,
            .burstiness = a.burstiness,
            .max_concurrency = (int)a.max_concurrency,
            .n_ranks = g_size,
            .seed = a.seed,
            .fixed_schedule = a.fixed_schedule,
            .goodput = a.has_goodput ? &a.goodput : NULL,
        };
        memcpy(info.show, a.show, sizeof info.show);
        bench_report_print(stdout, &info, &ro_out->m);
        for (size_t i = 0, shown = 0; i < ro_out->n && shown < 5; i++)
            if (!ro_out->recs[i].success) {
                fprintf(stderr, "moe-bench: request %lld failed: %s: %s\n",
                        (long long)ro_out->recs[i].index, ro_out->recs[i].status,
                        ro_out->recs[i].error);
                shown++;
            }
        char path[4096];
        if (a.save_result) {
            sweep_path(path, sizeof path, a.save_result, rate, a.n_sweep > 0);
            if (bench_report_save(path, &info, &ro_out->m, ro_out->recs, ro_out->n, &err)) {
                cli_fail("--save-result: %s", err.msg);
                goto out;
            }
        }
        if (a.save_requests) {
            sweep_path(path, sizeof path, a.save_requests, rate, a.n_sweep > 0);
            if (bench_report_requests(path, &info, ro_out->recs, ro_out->n, &err)) {
                cli_fail("--save-requests: %s", err.msg);
                goto out;
            }
        }
    }
    if (g_rank == 0 && a.n_sweep > 1) {
        printf("%-12s %10s %10s %12s %12s %12s %12s\n", "rate", "req/s", "out tok/s", "user tok/s",
               "med TTFT ms", "med TPOT ms", "goodput");
        for (int r = 0; r < n_runs; r++) {
            const struct bench_metrics *m = &runs[r].m;
            printf("%-12s %10.2f %10.2f %12.2f %12.2f %12.2f %12.2f\n", runs[r].name + 5,
                   m->request_throughput, m->output_throughput, m->mean_user_tok_s, m->ttft.median,
                   m->tpot.median, isnan(m->request_goodput) ? 0 : m->request_goodput);
        }
    }
    if (g_rank == 0 && a.plot_dir) {
        struct plot_run pr[MAX_SWEEP];
        for (int r = 0; r < n_runs; r++)
            pr[r] = (struct plot_run){
                .name = runs[r].name, .recs = runs[r].recs, .n = runs[r].n, .m = &runs[r].m};
        enum moe_status pst = plot_runs(a.plot_dir, pr, n_runs, &err);
        plot_shutdown();
        if (pst) {
            cli_fail("%s", err.msg);
            goto out;
        }
        if (!a.quiet)
            fprintf(stderr, "moe-bench: charts in %s\n", a.plot_dir);
    }
    rc = 0;
    if (g_rank == 0 && all_failed) {
        cli_fail("every request failed (see the errors above)");
        rc = 1;
    }
out:
    for (int r = 0; r < n_runs; r++) {
        for (size_t i = 0; i < runs[r].n; i++)
            bench_record_clear(&runs[r].recs[i]);
        free(runs[r].recs);
    }
    free(arrivals);
    bench_workload_destroy(w);
    bench_target_destroy(target);
    moe_tls_destroy(tls);
    free(token);
    moe_tokenizer_free(tok);
    if (curl_up)
        curl_global_cleanup();
    if (g_mpi) {
        /* every rank leaves with rank 0's verdict */
        int v = rc;
        MPI_Bcast(&v, 1, MPI_INT, 0, MPI_COMM_WORLD);
        if (v > rc)
            rc = v;
        MPI_Finalize();
    }
    return rc;
}
