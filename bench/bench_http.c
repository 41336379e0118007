/* bench-http: the latency the OpenAI HTTP front door adds over gRPC. The
 * same greedy request (8 prompt token ids, text deltas, the chosen token's
 * logprob per token so that every token is one message / one SSE event) is
 * sent through moe.v1.Inference/Generate on one kept gRPC channel and
 * through POST /v1/completions with stream: true on one kept-alive HTTP
 * connection (libcurl), alternated, and the medians of TTFT, the mean gap
 * between streamed tokens and end to end are printed with the differences.
 *
 *   bench-http --grpc HOST:PORT --http HOST:PORT --model NAME [--requests N] [--tokens M]
 */
#include <curl/curl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moe/v1/inference.pb-c.h"
#include "rpc.h"
#include "clock.h"

struct sample {
    double e2e, ttft, itl;
    int n;
};

static int run_grpc(struct rpc_client *c, const uint8_t *req, size_t len, struct sample *out)
{
    struct moe_error err;
    double t0 = moe_now(), t_first = 0, t_last = 0;
    struct rpc_client_stream *st =
        rpc_client_stream_start(c, "/moe.v1.Inference/Generate", req, len, 30000, &err);
    if (!st)
        return -1;
    const uint8_t *m;
    size_t ml;
    int n = 0;
    while (rpc_client_stream_next(st, &m, &ml)) {
        Moe__V1__GenerateResponse *r = moe__v1__generate_response__unpack(NULL, ml, m);
        if (r && r->n_token_ids) {
            double t = moe_now();
            if (!n)
                t_first = t;
            t_last = t;
            n += (int)r->n_token_ids;
        }
        if (r)
            moe__v1__generate_response__free_unpacked(r, NULL);
    }
    const char *msg;
    enum rpc_code code = rpc_client_stream_status(st, &msg);
    rpc_client_stream_destroy(st);
    if (code != RPC_OK || n < 2) {
        fprintf(stderr, "bench-http: gRPC: %s %s\n", rpc_code_name(code), msg ? msg : "");
        return -1;
    }
    *out = (struct sample){moe_now() - t0, t_first - t0, (t_last - t_first) / (n - 1), n};
    return 0;
}

/* SSE events carrying a token (their logprobs object) seen in the body. */
struct sse {
    char tail[32]; /* the end of the previous piece: a marker split across pieces */
    int n;
    double t_first, t_last;
};

static size_t on_sse(char *p, size_t sz, size_t nm, void *u)
{
    struct sse *s = u;
    size_t k = sz * nm;
    static const char marker[] = "\"token_logprobs\"";
    size_t ml = sizeof marker - 1;
    size_t tl = strlen(s->tail);
    char *buf = malloc(tl + k + 1);
    memcpy(buf, s->tail, tl);
    memcpy(buf + tl, p, k);
    buf[tl + k] = '\0';
    double t = moe_now();
    for (char *q = buf; (q = strstr(q, marker)); q += ml) {
        if (!s->n)
            s->t_first = t;
        s->t_last = t;
        s->n++;
    }
    size_t keep = tl + k < ml - 1 ? tl + k : ml - 1;
    memcpy(s->tail, buf + tl + k - keep, keep);
    s->tail[keep] = '\0';
    free(buf);
    return k;
}

static int run_http(CURL *c, const char *url, const char *body, struct sample *out)
{
    struct sse s = {{0}, 0, 0, 0};
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_sse);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &s);
    double t0 = moe_now();
    CURLcode rc = curl_easy_perform(c);
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    if (rc != CURLE_OK || status != 200 || s.n < 2) {
        fprintf(stderr, "bench-http: HTTP: %s, status %ld, %d token events\n",
                curl_easy_strerror(rc), status, s.n);
        return -1;
    }
    *out = (struct sample){moe_now() - t0, s.t_first - t0, (s.t_last - s.t_first) / (s.n - 1), s.n};
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv)
{
    const char *grpc = NULL, *http = NULL, *model = "";
    int n_req = 50, n_tok = 64;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--grpc"))
            grpc = argv[i + 1];
        else if (!strcmp(argv[i], "--http"))
            http = argv[i + 1];
        else if (!strcmp(argv[i], "--model"))
            model = argv[i + 1];
        else if (!strcmp(argv[i], "--requests"))
            n_req = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--tokens"))
            n_tok = atoi(argv[i + 1]);
    }
    if (!grpc || !http || n_req < 1 || n_tok < 2) {
        fprintf(stderr, "usage: bench-http --grpc HOST:PORT --http HOST:PORT --model NAME "
                        "[--requests N] [--tokens M >= 2]\n");
        return 2;
    }
    uint32_t prompt[8] = {11, 22, 33, 44, 55, 66, 77, 88};
    Moe__V1__SamplingParams sp = MOE__V1__SAMPLING_PARAMS__INIT;
    sp.max_tokens = (uint32_t)n_tok;
    sp.ignore_eos = true;
    sp.skip_special_tokens = true;
    sp.logprobs_opt_case = MOE__V1__SAMPLING_PARAMS__LOGPROBS_OPT_LOGPROBS;
    sp.logprobs = 0;
    Moe__V1__TokenIds ids = MOE__V1__TOKEN_IDS__INIT;
    ids.n_ids = 8;
    ids.ids = prompt;
    Moe__V1__GenerateRequest gr = MOE__V1__GENERATE_REQUEST__INIT;
    gr.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS;
    gr.token_ids = &ids;
    gr.sampling = &sp;
    gr.stream_text = true;
    size_t gl = moe__v1__generate_request__get_packed_size(&gr);
    uint8_t *gb = malloc(gl + 1);
    moe__v1__generate_request__pack(&gr, gb);
    char body[512], url[300];
    snprintf(body, sizeof body,
             "{\"model\":\"%s\",\"prompt\":[11,22,33,44,55,66,77,88],\"max_tokens\":%d,"
             "\"temperature\":0,\"ignore_eos\":true,\"logprobs\":0,\"stream\":true}",
             model, n_tok);
    snprintf(url, sizeof url, "http://%s/v1/completions", http);

    struct moe_error err;
    struct rpc_client *gc = rpc_client_create(grpc, NULL, &err);
    if (!gc) {
        fprintf(stderr, "bench-http: %s\n", err.msg);
        return 1;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    CURL *hc = curl_easy_init();
    struct curl_slist *hdr = curl_slist_append(NULL, "Content-Type: application/json");
    curl_easy_setopt(hc, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(hc, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(hc, CURLOPT_TCP_NODELAY, 1L);
    double *v[6];
    for (int i = 0; i < 6; i++)
        v[i] = calloc((size_t)n_req, sizeof(double));
    struct sample s;
    int rc = 1;
    /* warm both paths (connections, first allocations) */
    if (run_grpc(gc, gb, gl, &s) || run_http(hc, url, body, &s))
        goto out;
    for (int r = 0; r < n_req; r++) {
        if (run_grpc(gc, gb, gl, &s))
            goto out;
        v[0][r] = s.e2e, v[1][r] = s.ttft, v[2][r] = s.itl;
        if (run_http(hc, url, body, &s))
            goto out;
        v[3][r] = s.e2e, v[4][r] = s.ttft, v[5][r] = s.itl;
    }
    long conns = -1;
    curl_easy_getinfo(hc, CURLINFO_NUM_CONNECTS, &conns);
    double m[6];
    for (int i = 0; i < 6; i++)
        m[i] = median(v[i], n_req);
    printf("%d requests of 8 prompt + %d generated tokens each way (alternated, kept "
           "connections%s), medians:\n",
           n_req, n_tok, conns == 0 ? "" : ": HTTP reconnected!");
    printf("%-24s %10s %10s %14s\n", "front door", "e2e ms", "TTFT ms", "per-token ms");
    printf("%-24s %10.3f %10.3f %14.4f\n", "gRPC Generate", m[0] * 1e3, m[1] * 1e3, m[2] * 1e3);
    printf("%-24s %10.3f %10.3f %14.4f\n", "HTTP /v1/completions", m[3] * 1e3, m[4] * 1e3,
           m[5] * 1e3);
    printf("%-24s %+10.3f %+10.3f %+14.4f\n", "HTTP - gRPC", (m[3] - m[0]) * 1e3,
           (m[4] - m[1]) * 1e3, (m[5] - m[2]) * 1e3);
    rc = 0;
out:
    for (int i = 0; i < 6; i++)
        free(v[i]);
    free(gb);
    curl_slist_free_all(hdr);
    curl_easy_cleanup(hc);
    curl_global_cleanup();
    rpc_client_destroy(gc);
    return rc;
}
