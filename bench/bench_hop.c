/* bench-hop: the latency the coordinator adds. Alternates the same greedy
 * request sent straight to a worker (moe.v1.Worker/Generate) and through the
 * coordinator (moe.v1.Inference/Generate), so both are measured on the same
 * machine state, and prints per-request end-to-end latency, TTFT and the mean
 * gap between streamed tokens, with their differences.
 *
 *   bench-hop --coordinator HOST:PORT --worker HOST:PORT [--requests N] [--tokens M]
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moe/v1/worker.pb-c.h"
#include "rpc.h"
#include "clock.h"

struct sample {
    double e2e, ttft, itl; /* seconds; itl: mean gap after the first token */
    int n;
};

/* Streams one request; returns 0 on success. */
static int run_one(struct rpc_client *c, const char *method, const uint8_t *req, size_t len,
                   struct sample *out)
{
    struct moe_error err;
    double t0 = moe_now(), t_first = 0, t_last = 0;
    struct rpc_client_stream *st = rpc_client_stream_start(c, method, req, len, 30000, &err);
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
        fprintf(stderr, "bench-hop: %s: %s %s\n", method, rpc_code_name(code), msg ? msg : "");
        return -1;
    }
    *out = (struct sample){moe_now() - t0, t_first - t0, (t_last - t_first) / (n - 1), n};
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
    const char *coord = NULL, *worker = NULL;
    int n_req = 50, n_tok = 32;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--coordinator"))
            coord = argv[i + 1];
        else if (!strcmp(argv[i], "--worker"))
            worker = argv[i + 1];
        else if (!strcmp(argv[i], "--requests"))
            n_req = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--tokens"))
            n_tok = atoi(argv[i + 1]);
    }
    if (!coord || !worker || n_req < 1 || n_tok < 2) {
        fprintf(stderr, "usage: bench-hop --coordinator HOST:PORT --worker HOST:PORT "
                        "[--requests N] [--tokens M >= 2]\n");
        return 2;
    }
    uint32_t prompt[8] = {11, 22, 33, 44, 55, 66, 77, 88};
    Moe__V1__SamplingParams sp = MOE__V1__SAMPLING_PARAMS__INIT;
    sp.max_tokens = (uint32_t)n_tok;
    sp.ignore_eos = true;
    Moe__V1__WorkerGenerateRequest wr = MOE__V1__WORKER_GENERATE_REQUEST__INIT;
    wr.n_prompt_token_ids = 8;
    wr.prompt_token_ids = prompt;
    wr.sampling = &sp;
    Moe__V1__TokenIds ids = MOE__V1__TOKEN_IDS__INIT;
    ids.n_ids = 8;
    ids.ids = prompt;
    Moe__V1__GenerateRequest gr = MOE__V1__GENERATE_REQUEST__INIT;
    gr.prompt_case = MOE__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS;
    gr.token_ids = &ids;
    gr.sampling = &sp;
    size_t wl = moe__v1__worker_generate_request__get_packed_size(&wr);
    size_t gl = moe__v1__generate_request__get_packed_size(&gr);
    uint8_t *wb = malloc(wl + 1), *gb = malloc(gl + 1);
    moe__v1__worker_generate_request__pack(&wr, wb);
    moe__v1__generate_request__pack(&gr, gb);

    struct moe_error err;
    struct rpc_client *cw = rpc_client_create(worker, NULL, &err);
    struct rpc_client *cc = rpc_client_create(coord, NULL, &err);
    if (!cw || !cc) {
        fprintf(stderr, "bench-hop: %s\n", err.msg);
        return 1;
    }
    double *v[6];
    for (int i = 0; i < 6; i++)
        v[i] = calloc((size_t)n_req, sizeof(double));
    struct sample s;
    /* warm both paths (connections, first allocation) */
    if (run_one(cw, "/moe.v1.Worker/Generate", wb, wl, &s) ||
        run_one(cc, "/moe.v1.Inference/Generate", gb, gl, &s))
        return 1;
    for (int r = 0; r < n_req; r++) {
        if (run_one(cw, "/moe.v1.Worker/Generate", wb, wl, &s))
            return 1;
        v[0][r] = s.e2e, v[1][r] = s.ttft, v[2][r] = s.itl;
        if (run_one(cc, "/moe.v1.Inference/Generate", gb, gl, &s))
            return 1;
        v[3][r] = s.e2e, v[4][r] = s.ttft, v[5][r] = s.itl;
    }
    double m[6];
    for (int i = 0; i < 6; i++)
        m[i] = median(v[i], n_req);
    printf("%d requests of 8 prompt + %d generated tokens each way, medians:\n", n_req, n_tok);
    printf("%-32s %10s %10s %12s\n", "path", "e2e ms", "TTFT ms", "per-token ms");
    printf("%-32s %10.3f %10.3f %12.4f\n", "client -> worker", m[0] * 1e3, m[1] * 1e3, m[2] * 1e3);
    printf("%-32s %10.3f %10.3f %12.4f\n", "client -> coordinator -> worker", m[3] * 1e3,
           m[4] * 1e3, m[5] * 1e3);
    printf("%-32s %10.3f %10.3f %12.4f\n", "added by the coordinator", (m[3] - m[0]) * 1e3,
           (m[4] - m[1]) * 1e3, (m[5] - m[2]) * 1e3);
    for (int i = 0; i < 6; i++)
        free(v[i]);
    free(wb);
    free(gb);
    rpc_client_destroy(cw);
    rpc_client_destroy(cc);
    return 0;
}
