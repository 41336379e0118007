/* What recording metrics costs, against the engine step it is recorded in.
 *
 *   bench-metrics [MODEL_DIR] [THREADS]     (default: the bundled tiny Qwen3-MoE, 1)
 *
 * 1. ns per counter increment and per histogram observation, on one thread
 *    and with two threads hammering the same series;
 * 2. ns per step of the worker's per-step recording (worker_metrics_forward
 *    around a forward pass that does nothing: two clock reads, eight
 *    histogram observations, the profile read and eight counter sets);
 * 3. the mean engine step of a real decode workload on MODEL_DIR (8
 *    sequences x 64 tokens, and 1 sequence), run with the recording forward
 *    and without, alternated 3 times, and the recording cost as a share of
 *    the step (2 / 3). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/engine.h"
#include "group/launch.h"
#include "metrics.h"
#include "model/model.h"
#include "serve/worker_metrics.h"
#include "clock.h"

#define N_OPS 20000000

struct ham {
    struct moe_counter *c;
    struct moe_histogram *h;
    int n;
};

static void *count_loop(void *p)
{
    struct ham *a = p;
    for (int i = 0; i < a->n; i++)
        moe_counter_inc(a->c);
    return NULL;
}

static void *observe_loop(void *p)
{
    struct ham *a = p;
    for (int i = 0; i < a->n; i++)
        moe_histogram_observe(a->h, 1e-5 * (i & 1023));
    return NULL;
}

static double run_threads(void *(*fn)(void *), struct ham *a, int n_threads)
{
    pthread_t th[2];
    double t0 = moe_now();
    for (int i = 0; i < n_threads; i++)
        pthread_create(&th[i], NULL, fn, a);
    for (int i = 0; i < n_threads; i++)
        pthread_join(th[i], NULL);
    return (moe_now() - t0) * 1e9 / ((double)a->n * n_threads);
}

static enum moe_status noop_forward(void *ctx, struct moe_model *m, struct moe_kv_cache *kv,
                                    const struct moe_batch *batch, float *logits,
                                    struct moe_error *err)
{
    (void)ctx, (void)m, (void)kv, (void)batch, (void)logits, (void)err;
    return MOE_OK;
}

static void on_token(void *user, const struct moe_token_event *ev)
{
    (void)user, (void)ev;
}

/* Mean step (seconds) of n_seq sequences x n_tok decoded tokens. */
static double workload(struct moe_model *model, struct worker_metrics *wm, int n_seq, int n_tok,
                       struct moe_error *err)
{
    struct moe_engine_opts eo = {
        .n_block = 4096, .block_size = 16, .max_batch_tokens = 512, .max_running = 64};
    if (wm) {
        eo.forward = worker_metrics_forward;
        eo.forward_ctx = wm;
    }
    struct moe_engine *e = NULL;
    if (moe_engine_create(model, NULL, &eo, &e, err))
        return -1;
    int vocab = moe_model_config(model)->vocab_size;
    for (int s = 0; s < n_seq; s++) {
        int32_t prompt[16];
        for (int i = 0; i < 16; i++)
            prompt[i] = (int32_t)((s * 131 + i * 17) % vocab);
        struct moe_request_params p;
        moe_request_params_init(&p);
        p.max_tokens = n_tok;
        p.ignore_eos = true;
        if (moe_engine_submit(e, (uint64_t)s + 1, prompt, 16, &p, on_token, NULL, err)) {
            moe_engine_destroy(e);
            return -1;
        }
    }
    double t0 = moe_now();
    while (moe_engine_busy(e))
        if (moe_engine_step(e, NULL, err)) {
            moe_engine_destroy(e);
            return -1;
        }
    double dt = moe_now() - t0;
    struct moe_engine_stats st;
    moe_engine_stats(e, &st);
    moe_engine_destroy(e);
    return st.steps ? dt / (double)st.steps : -1;
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : MOE_BENCH_FIXTURE;
    int threads = argc > 2 ? atoi(argv[2]) : 1;
    struct moe_error err = {0};

    struct moe_metrics *reg = moe_metrics_create();
    struct ham a = {
        moe_metrics_counter(reg, "c_total", "c", NULL),
        moe_metrics_histogram(reg, "h_seconds", "h", MOE_BUCKETS_STEP, MOE_N_BUCKETS_STEP, NULL),
        N_OPS};
    printf("counter inc:        %.1f ns (1 thread), %.1f ns (2 threads, one series)\n",
           run_threads(count_loop, &a, 1), run_threads(count_loop, &a, 2));
    printf("histogram observe:  %.1f ns (1 thread), %.1f ns (2 threads, one series)\n",
           run_threads(observe_loop, &a, 1), run_threads(observe_loop, &a, 2));
    char *text;
    size_t len;
    double t0 = moe_now();
    moe_metrics_render(reg, &text, &len, &err);
    printf("render of 2 series: %.1f us\n", (moe_now() - t0) * 1e6);
    free(text);
    moe_metrics_destroy(reg);

    struct moe_launch_args la = {
        .model = dir, .device = "cpu", .threads = threads, .dtype = MOE_DTYPE_F32};
    struct moe_launch launch = {0};
    struct moe_model *model = NULL;
    struct worker_metrics *noop = NULL, *wm = NULL;
    int rc = 1;
    if (moe_launch_start(&argc, &argv, &la, &launch, &err))
        goto out;
    struct moe_model_opts mo = launch.model_opts;
    if (moe_model_load(dir, &mo, launch.be, &model, &err))
        goto out;
    if (worker_metrics_create("bench", model, NULL, noop_forward, NULL, &noop, &err) ||
        worker_metrics_create("bench", model, NULL, NULL, NULL, &wm, &err))
        goto out;
    struct moe_batch batch = {.n_tok = 1};
    int n_calls = 2000000;
    t0 = moe_now();
    for (int i = 0; i < n_calls; i++)
        worker_metrics_forward(noop, model, NULL, &batch, NULL, &err);
    double rec_ns = (moe_now() - t0) * 1e9 / n_calls;
    printf("per-step recording (worker_metrics_forward around a no-op): %.0f ns\n", rec_ns);

    printf("model %s, %d thread(s); mean engine step, plain vs recording (3 alternated "
           "rounds):\n",
           dir, threads);
    const int seqs[2] = {1, 8};
    for (int k = 0; k < 2; k++) {
        double plain = 1e9, rec = 1e9;
        for (int r = 0; r < 3; r++) {
            double p = workload(model, NULL, seqs[k], 64, &err);
            double q = workload(model, wm, seqs[k], 64, &err);
            if (p < 0 || q < 0)
                goto out;
            plain = p < plain ? p : plain;
            rec = q < rec ? q : rec;
        }
        printf("  %d sequence(s): %.1f us plain, %.1f us recording (best of 3); recording = "
               "%.3f%% of the step\n",
               seqs[k], plain * 1e6, rec * 1e6, 100.0 * rec_ns * 1e-9 / plain);
    }
    rc = 0;
out:
    if (rc)
        fprintf(stderr, "bench-metrics: %s\n", err.msg);
    worker_metrics_destroy(noop);
    worker_metrics_destroy(wm);
    moe_model_free(model);
    moe_launch_finish(&launch);
    return rc;
}
