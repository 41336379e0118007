/* The serving engine on the tiny golden Qwen3-MoE model (f32, CPU):
 *  - a sequence's greedy tokens and logits are the same alone and inside a
 *    batch of 16 mixed-length sequences with chunked prefill;
 *  - a KV pool small enough to force preemption gives the same tokens;
 *  - a seeded random workload of submit / abort / finish keeps the block
 *    pool whole, with refcounts matching the block tables at every check;
 *  - prefix caching computes only the new tokens and changes no logit;
 *  - seeded sampling is the same whatever the batch; stop strings that
 *    straddle tokens stop the request; bad parameters are refused;
 *  - greedy steps bring back ids instead of logits, with the same tokens;
 *  - on the DeepSeek-V3 fixture (a latent KV cache): batch vs alone,
 *    preemption and prefix caching again;
 *  - data-parallel attention's scheduling (a pool in 2 parts, each part's
 *    share of every step run on its own KV cache, as the group's ranks do):
 *    batch vs alone, preemption, prefix caching and the random workload
 *    again, every sequence's blocks in one part. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "engine/engine.h"
#include "engine/generate.h"
#include "group/dp_batch.h"
#include "model/model_internal.h" /* MOE_ROUTE_DEVICE_MAX_TOK, the layers' kinds */
#include "testlib.h"

#define MAX_REQ 64
#define MAX_OUT 64

struct capture {
    int vocab;
    int32_t tokens[MAX_REQ][MAX_OUT];
    int n[MAX_REQ];
    enum moe_finish finish[MAX_REQ];
    int64_t text_len[MAX_REQ];
    float *logits[MAX_REQ]; /* (MAX_OUT, vocab) when capture_logits */
    bool capture_logits;
    int events;
};

static void on_token(void *user, const struct moe_token_event *ev)
{
    struct capture *c = user;
    int r = (int)ev->req_id;
    MOE_ASSERT(r >= 0 && r < MAX_REQ);
    if (ev->token >= 0 && c->n[r] < MAX_OUT)
        c->tokens[r][c->n[r]++] = ev->token;
    if (ev->finish) {
        c->finish[r] = ev->finish;
        c->text_len[r] = ev->text_len;
    }
    c->events++;
}

static void on_logits(void *user, uint64_t req_id, int index, const float *logits, int vocab)
{
    struct capture *c = user;
    if (!c->capture_logits || index >= MAX_OUT)
        return;
    int r = (int)req_id;
    if (!c->logits[r])
        c->logits[r] = calloc((size_t)MAX_OUT * vocab, sizeof(float));
    memcpy(c->logits[r] + (size_t)index * vocab, logits, (size_t)vocab * sizeof(float));
}

static void capture_free(struct capture *c)
{
    for (int i = 0; i < MAX_REQ; i++)
        free(c->logits[i]);
}

static struct moe_model *model;
static int vocab;

/* Data-parallel attention in one process: with dp_parts > 1 the engines
 * plan over a pool in that many parts, and dp_forward runs each part's share
 * of a step (moe_dp_split_batch) on that part's own KV cache, the engine's
 * for part 0, then puts the logit rows back in the batch's order: what the
 * ranks of a group do, without MPI. */
#define DP_MAX 4
static int dp_parts = 1;
static struct {
    struct moe_kv_cache *kv[DP_MAX]; /* parts 1.. */
    struct moe_dp_split split[DP_MAX];
    float *out[DP_MAX];
    size_t cap[DP_MAX];
    int64_t tokens_of[DP_MAX];
} dp;

static enum moe_status dp_forward(void *ctx, struct moe_model *m, struct moe_kv_cache *kv0,
                                  const struct moe_batch *b, float *logits, struct moe_error *err)
{
    (void)ctx;
    int row[DP_MAX] = {0};
    for (int r = 0; r < dp_parts; r++) {
        struct moe_kv_cache *kv = r ? dp.kv[r] : kv0;
        if (r && (!kv || kv->n_block != kv0->n_block || kv->block_size != kv0->block_size)) {
            moe_kv_cache_free(m, dp.kv[r]);
            dp.kv[r] = NULL;
            enum moe_status rc =
                moe_kv_cache_create(m, kv0->n_block, kv0->block_size, &dp.kv[r], err);
            if (rc)
                return rc;
            kv = dp.kv[r];
        }
        enum moe_status rc =
            moe_dp_split_batch(b, dp_parts, kv0->n_block, kv0->block_size, r, &dp.split[r], err);
        if (rc)
            return rc;
        const struct moe_batch *lb = &dp.split[r].b;
        if (!lb->n_tok)
            continue;
        size_t need = (size_t)(lb->n_logits ? lb->n_logits : 1) * vocab;
        if (need > dp.cap[r]) {
            free(dp.out[r]);
            MOE_ASSERT(dp.out[r] = malloc(need * sizeof(float)));
            dp.cap[r] = need;
        }
        if ((rc = moe_model_forward(m, kv, lb, dp.out[r], err)))
            return rc;
        dp.tokens_of[r] += lb->n_tok;
    }
    for (int i = 0; i < b->n_logits; i++) {
        int r = dp.split[0].logit_rank[i];
        memcpy(logits + (size_t)i * vocab, dp.out[r] + (size_t)row[r]++ * vocab,
               (size_t)vocab * sizeof(float));
    }
    return MOE_OK;
}

static void dp_free(void)
{
    for (int r = 0; r < DP_MAX; r++) {
        moe_kv_cache_free(model, dp.kv[r]);
        moe_dp_split_free(&dp.split[r]);
        free(dp.out[r]);
    }
    memset(&dp, 0, sizeof dp);
}

static struct moe_engine *make_engine(struct moe_engine_opts o, struct capture *c)
{
    struct moe_engine *e = NULL;
    struct moe_error err = {0};
    if (dp_parts > 1) {
        o.kv_parts = dp_parts;
        o.forward = dp_forward;
    }
    o.logits_hook = on_logits;
    o.logits_hook_user = c;
    CHECKF(moe_engine_create(model, NULL, &o, &e, &err) == MOE_OK, "%s", err.msg);
    return e;
}

static void run_to_end(struct moe_engine *e)
{
    struct moe_error err = {0};
    int guard = 0;
    while (moe_engine_busy(e) && guard++ < 100000) {
        if (moe_engine_step(e, NULL, &err) != MOE_OK) {
            fprintf(stderr, "step failed: %s\n", err.msg);
            test_n_fail++;
            return;
        }
    }
    CHECK(!moe_engine_busy(e));
}

/* Deterministic prompt i of length len. */
static void make_prompt(int i, int len, int32_t *out)
{
    unsigned s = 1000u + (unsigned)i * 7919u;
    for (int j = 0; j < len; j++) {
        s = s * 1103515245u + 12345u;
        out[j] = (int32_t)((s >> 8) % (unsigned)vocab);
    }
}

static double max_rel(const float *a, const float *b, int n)
{
    double md = 0, mb = 0;
    for (int i = 0; i < n; i++) {
        md = fmax(md, fabs((double)a[i] - b[i]));
        mb = fmax(mb, fabs((double)b[i]));
    }
    return md / (mb > 0 ? mb : 1);
}

static void test_batch_equals_alone(void)
{
    enum { N = 16, OUT = 12 };
    int lens[N];
    int32_t prompts[N][80];
    for (int i = 0; i < N; i++) {
        lens[i] = 3 + (i * 37) % 70;
        make_prompt(i, lens[i], prompts[i]);
    }
    struct moe_request_params p;
    moe_request_params_init(&p);
    p.max_tokens = OUT;
    p.ignore_eos = true;
    struct moe_error err = {0};

    static struct capture alone, batch;
    memset(&alone, 0, sizeof alone);
    memset(&batch, 0, sizeof batch);
    alone.capture_logits = batch.capture_logits = true;
    for (int i = 0; i < N; i++) { /* one at a time, whole prompt in one step */
        struct moe_engine *e = make_engine((struct moe_engine_opts){.n_block = 64}, &alone);
        CHECKF(moe_engine_submit(e, (uint64_t)i, prompts[i], lens[i], &p, on_token, &alone, &err) ==
                   MOE_OK,
               "%s", err.msg);
        run_to_end(e);
        moe_engine_destroy(e);
    }
    /* all at once, chunked prefill under a 48-token budget mixed with decodes */
    struct moe_engine *e =
        make_engine((struct moe_engine_opts){.n_block = 256, .max_batch_tokens = 48}, &batch);
    for (int i = 0; i < N; i++)
        CHECK(moe_engine_submit(e, (uint64_t)i, prompts[i], lens[i], &p, on_token, &batch, &err) ==
              MOE_OK);
    run_to_end(e);
    struct moe_engine_stats st;
    moe_engine_stats(e, &st);
    CHECKF(st.steps > N, "steps %lld", (long long)st.steps);
    moe_engine_destroy(e);

    double worst = 0;
    int same = 0;
    for (int i = 0; i < N; i++) {
        same += alone.n[i] == OUT && batch.n[i] == OUT &&
                !memcmp(alone.tokens[i], batch.tokens[i], sizeof(int32_t) * OUT);
        for (int j = 0; j < OUT && alone.logits[i] && batch.logits[i]; j++)
            worst = fmax(worst, max_rel(batch.logits[i] + (size_t)j * vocab,
                                        alone.logits[i] + (size_t)j * vocab, vocab));
        CHECK(alone.finish[i] == MOE_FINISH_LENGTH && batch.finish[i] == MOE_FINISH_LENGTH);
    }
    CHECKF(same == N, "%d of %d sequences identical", same, N);
    CHECKF(worst <= 1e-5, "batched logits rel err %.3g", worst);
    printf("batch of %d vs alone: %d identical, max logit rel err %.3g, %lld steps\n", N, same,
           worst, (long long)st.steps);
    capture_free(&alone);
    capture_free(&batch);
}

/* Greedy steps bring back ids, not logits (moe_batch.argmax_out): a batch
 * of greedy sequences gives the same tokens as with host_sampling, every
 * step took the ids path, and a step with one sampled or logprobs-asking
 * sequence in it brings the logits back for all (the sampled one drawn by
 * its seed, the greedy ones unchanged). */
static int g_id_steps, g_logit_steps;
static enum moe_status counting_forward(void *ctx, struct moe_model *m, struct moe_kv_cache *kv,
                                        const struct moe_batch *b, float *logits,
                                        struct moe_error *err)
{
    (void)ctx;
    if (b->n_logits)
        (*(b->argmax_out ? &g_id_steps : &g_logit_steps))++;
    return moe_model_forward(m, kv, b, logits, err);
}

static void test_greedy_ids(void)
{
    enum { N = 8, OUT = 10 };
    int32_t prompts[N][40];
    for (int i = 0; i < N; i++)
        make_prompt(50 + i, 5 + 4 * i, prompts[i]);
    struct moe_request_params p;
    moe_request_params_init(&p);
    p.max_tokens = OUT;
    p.ignore_eos = true;
    struct moe_error err = {0};
    static struct capture runs[3];
    int ids_steps[3], logit_steps[3];
    for (int run = 0; run < 3; run++) {
        memset(&runs[run], 0, sizeof runs[run]);
        struct moe_engine_opts o = {.n_block = 128,
                                    .forward = counting_forward,
                                    .forward_ids = true,
                                    .host_sampling = run == 1};
        struct moe_engine *e = NULL;
        CHECKF(moe_engine_create(model, NULL, &o, &e, &err) == MOE_OK, "%s", err.msg);
        g_id_steps = g_logit_steps = 0;
        for (int i = 0; i < N; i++) {
            struct moe_request_params q = p;
            if (run == 2 && i == 3) { /* one sampled request in the batch */
                q.sp.temperature = 0.8f;
                q.has_seed = true;
                q.seed = 7;
            }
            if (run == 2 && i == 5)
                q.logprobs = 2;
            CHECK(moe_engine_submit(e, (uint64_t)i, prompts[i], 5 + 4 * i, &q, on_token, &runs[run],
                                    &err) == MOE_OK);
        }
        run_to_end(e);
        moe_engine_destroy(e);
        ids_steps[run] = g_id_steps;
        logit_steps[run] = g_logit_steps;
    }
    int same = 0, same_mixed = 0;
    for (int i = 0; i < N; i++) {
        same += runs[0].n[i] == OUT &&
                !memcmp(runs[0].tokens[i], runs[1].tokens[i], sizeof(int32_t) * OUT);
        same_mixed +=
            i == 3 || !memcmp(runs[0].tokens[i], runs[2].tokens[i], sizeof(int32_t) * OUT);
    }
    CHECKF(same == N, "ids vs host sampling: %d of %d identical", same, N);
    CHECKF(same_mixed == N, "greedy sequences beside a sampled one: %d of %d identical", same_mixed,
           N);
    CHECKF(ids_steps[0] > 0 && logit_steps[0] == 0, "greedy batch: %d id steps, %d logit steps",
           ids_steps[0], logit_steps[0]);
    CHECKF(ids_steps[1] == 0 && logit_steps[1] > 0, "host_sampling: %d id steps", ids_steps[1]);
    CHECKF(logit_steps[2] > 0, "a sampled sequence in the batch: %d logit steps", logit_steps[2]);
    printf("greedy ids: %d of %d identical to host sampling (%d steps ids only); mixed batch: %d "
           "id steps, %d logit steps\n",
           same, N, ids_steps[0], ids_steps[2], logit_steps[2]);
}

/* backend_sampling: rows sampled with temperature and top_p alone are drawn
 * by the backend's sample_top_p (here the CPU's) from the request's own
 * stream: seeded sequences (several temperatures and top_p values, greedy
 * ones beside them) give the host sampler's tokens, and every step took
 * the ids path; a top_k request in the batch (the host's to sample) brings
 * the logits back for that batch and changes no other sequence's tokens. */
static void test_backend_sampling(void)
{
    enum { N = 8, OUT = 12 };
    static const float temps[N] = {0.8f, 0.0f, 1.2f, 0.7f, 1.0f, 0.0f, 0.9f, 2.0f};
    static const float top_ps[N] = {1.0f, 1.0f, 0.9f, 0.5f, 0.95f, 0.3f, 1.0f, 0.8f};
    int32_t prompts[N][40];
    for (int i = 0; i < N; i++)
        make_prompt(70 + i, 4 + 3 * i, prompts[i]);
    struct moe_error err = {0};
    static struct capture runs[4]; /* host, backend; with a top_k request: host, backend */
    int ids_steps[4], logit_steps[4];
    for (int run = 0; run < 4; run++) {
        memset(&runs[run], 0, sizeof runs[run]);
        struct moe_engine_opts o = {.n_block = 128,
                                    .forward = counting_forward,
                                    .forward_ids = true,
                                    .host_sampling = run % 2 == 0,
                                    .backend_sampling = run % 2 == 1};
        struct moe_engine *e = NULL;
        CHECKF(moe_engine_create(model, NULL, &o, &e, &err) == MOE_OK, "%s", err.msg);
        g_id_steps = g_logit_steps = 0;
        for (int i = 0; i < N; i++) {
            struct moe_request_params q;
            moe_request_params_init(&q);
            q.max_tokens = OUT;
            q.ignore_eos = true;
            q.sp.temperature = temps[i];
            q.sp.top_p = top_ps[i];
            q.has_seed = true;
            q.seed = 1000 + (uint64_t)i;
            if (run >= 2 && i == 4)
                q.sp.top_k = 5;
            CHECK(moe_engine_submit(e, (uint64_t)i, prompts[i], 4 + 3 * i, &q, on_token, &runs[run],
                                    &err) == MOE_OK);
        }
        run_to_end(e);
        moe_engine_destroy(e);
        ids_steps[run] = g_id_steps;
        logit_steps[run] = g_logit_steps;
    }
    for (int pair = 0; pair < 4; pair += 2) {
        int same = 0;
        for (int i = 0; i < N; i++)
            same += runs[pair].n[i] == OUT && runs[pair + 1].n[i] == OUT &&
                    !memcmp(runs[pair].tokens[i], runs[pair + 1].tokens[i], sizeof(int32_t) * OUT);
        CHECKF(same == N, "%s: backend-sampled tokens equal the host's for %d of %d sequences",
               pair ? "with a top_k request" : "temperature and top_p", same, N);
    }
    CHECKF(ids_steps[1] > 0 && logit_steps[1] == 0, "backend sampling: %d id steps, %d logit steps",
           ids_steps[1], logit_steps[1]);
    CHECKF(ids_steps[0] == 0, "host sampling: %d id steps", ids_steps[0]);
    CHECKF(logit_steps[3] > 0, "a top_k request in the batch: %d logit steps", logit_steps[3]);
    printf("backend sampling: %d sequences (6 sampled) equal to host sampling, %d id steps; with a "
           "top_k request %d id / %d logit steps\n",
           N, ids_steps[1], ids_steps[3], logit_steps[3]);
}

static void test_preemption(void)
{
    enum { N = 8, OUT = 24 };
    int32_t prompts[N][40];
    int lens[N];
    for (int i = 0; i < N; i++) {
        lens[i] = 10 + 3 * i;
        make_prompt(100 + i, lens[i], prompts[i]);
    }
    struct moe_request_params p;
    moe_request_params_init(&p);
    p.max_tokens = OUT;
    p.ignore_eos = true;
    struct moe_error err = {0};
    static struct capture big, small;
    memset(&big, 0, sizeof big);
    memset(&small, 0, sizeof small);
    struct moe_engine_stats st_big, st_small;
    struct moe_engine *e =
        make_engine((struct moe_engine_opts){.n_block = 128, .block_size = 4}, &big);
    for (int i = 0; i < N; i++)
        moe_engine_submit(e, (uint64_t)i, prompts[i], lens[i], &p, on_token, &big, &err);
    run_to_end(e);
    moe_engine_stats(e, &st_big);
    moe_engine_destroy(e);
    /* 16 blocks of 4 tokens (in each part): the largest request alone needs 14 */
    e = make_engine((struct moe_engine_opts){.n_block = 16 * dp_parts, .block_size = 4}, &small);
    for (int i = 0; i < N; i++)
        CHECKF(moe_engine_submit(e, (uint64_t)i, prompts[i], lens[i], &p, on_token, &small, &err) ==
                   MOE_OK,
               "%s", err.msg);
    struct moe_error cerr = {0};
    int bad = 0;
    while (moe_engine_busy(e)) {
        CHECK(moe_engine_step(e, NULL, &err) == MOE_OK);
        bad += moe_engine_check(e, &cerr) != MOE_OK;
    }
    CHECKF(bad == 0, "%s", cerr.msg);
    moe_engine_stats(e, &st_small);
    CHECK(moe_engine_check(e, &cerr) == MOE_OK);
    CHECK(st_small.kv_blocks_used == 0);
    moe_engine_destroy(e);
    int same = 0;
    for (int i = 0; i < N; i++)
        same += big.n[i] == OUT && small.n[i] == OUT &&
                !memcmp(big.tokens[i], small.tokens[i], sizeof(int32_t) * OUT);
    CHECKF(same == N, "%d of %d identical under preemption", same, N);
    CHECKF(st_small.preemptions > 0, "preemptions %lld", (long long)st_small.preemptions);
    CHECK(st_big.preemptions == 0);
    printf("preemption: %lld preemptions, %d/%d identical, %lld vs %lld tokens computed\n",
           (long long)st_small.preemptions, same, N, (long long)st_small.computed_tokens,
           (long long)st_big.computed_tokens);
}

static void test_random_workload(void)
{
    static struct capture c;
    memset(&c, 0, sizeof c);
    struct moe_engine *e = make_engine(
        (struct moe_engine_opts){
            .n_block = 40, .block_size = 4, .max_batch_tokens = 32, .max_running = 6},
        &c);
    struct moe_error err = {0}, cerr = {0};
    unsigned seed = 4242;
    bool in_flight[MAX_REQ] = {0};
    int submitted = 0, aborted = 0, bad = 0, steps = 0;
    uint64_t next_id = 0;
    /* under ThreadSanitizer (tests/run.sh; 20x slower) a fifth: the races it
     * looks for are in the thread pool every step uses, the block accounting
     * is the plain pass's */
    const char *san = getenv("MOE_TEST_SANITIZER");
    int n_steps = san && !strcmp(san, "thread") ? 600 : 3000;
    for (steps = 0; steps < n_steps; steps++) {
        int op = rand_r(&seed) % 8;
        if (op < 4) { /* submit, reusing ids that finished */
            int r = (int)(next_id++ % MAX_REQ);
            if (!in_flight[r] || c.finish[r]) {
                int32_t prompt[40];
                int len = 1 + rand_r(&seed) % 40;
                make_prompt(rand_r(&seed) % 5, len, prompt); /* few distinct: prefix hits */
                struct moe_request_params p;
                moe_request_params_init(&p);
                p.max_tokens = 1 + rand_r(&seed) % 30;
                p.ignore_eos = rand_r(&seed) % 2;
                p.sp.temperature = (float)(rand_r(&seed) % 3) * 0.5f;
                c.n[r] = 0;
                c.finish[r] = MOE_FINISH_NONE;
                if (moe_engine_submit(e, (uint64_t)r, prompt, len, &p, on_token, &c, &err) ==
                    MOE_OK) {
                    in_flight[r] = true;
                    submitted++;
                }
            }
        } else if (op == 4) { /* abort a random request still in flight */
            int live[MAX_REQ], n_live = 0;
            for (int r = 0; r < MAX_REQ; r++)
                if (in_flight[r] && !c.finish[r])
                    live[n_live++] = r;
            if (n_live) {
                moe_engine_abort(e, (uint64_t)live[rand_r(&seed) % n_live]);
                aborted++;
            }
        }
        CHECK(moe_engine_step(e, NULL, &err) == MOE_OK);
        if (steps % 7 == 0 && moe_engine_check(e, &cerr) != MOE_OK)
            bad++;
        if (dp_parts > 1 && steps % 7 == 0) { /* the per-part load adds up */
            struct moe_engine_stats ps;
            moe_engine_stats(e, &ps);
            int used = 0;
            for (int p = 0; p < ps.kv_parts; p++)
                used += ps.part_blocks_used[p];
            bad += ps.kv_parts != dp_parts || used != ps.kv_blocks_used;
        }
    }
    run_to_end(e);
    CHECKF(bad == 0, "%s", cerr.msg);
    CHECKF(moe_engine_check(e, &cerr) == MOE_OK, "%s", cerr.msg);
    struct moe_engine_stats st;
    moe_engine_stats(e, &st);
    CHECK(st.kv_blocks_used == 0 && st.kv_blocks_free + st.kv_blocks_cached == 40);
    CHECK(st.running == 0 && st.waiting == 0);
    CHECKF(st.finished + st.aborted == submitted, "finished %lld + aborted %lld != submitted %d",
           (long long)st.finished, (long long)st.aborted, submitted);
    int unfinished = 0;
    for (int r = 0; r < MAX_REQ; r++)
        unfinished += in_flight[r] && !c.finish[r];
    CHECK(unfinished == 0);
    printf("random workload: %d steps, %d submitted, %d abort calls, %lld aborted, %lld "
           "preemptions, prefix hits %lld/%lld tokens\n",
           steps, submitted, aborted, (long long)st.aborted, (long long)st.preemptions,
           (long long)st.prefix_hit_tokens, (long long)st.prompt_tokens);
    CHECK(st.aborted > 0 && st.prefix_hit_tokens > 0 && st.preemptions > 0);
    moe_engine_destroy(e);
}

static void test_prefix_cache(void)
{
    enum { BS = 16 };
    int32_t a[3 * BS + 5], b[3 * BS + 9];
    make_prompt(7, 3 * BS + 5, a);
    memcpy(b, a, 3 * BS * sizeof(int32_t)); /* same first 3 blocks */
    make_prompt(8, 9, b + 3 * BS);
    struct moe_request_params p;
    moe_request_params_init(&p);
    p.max_tokens = 4;
    p.ignore_eos = true;
    struct moe_error err = {0};
    static struct capture on, off;
    memset(&on, 0, sizeof on);
    memset(&off, 0, sizeof off);
    on.capture_logits = off.capture_logits = true;
    struct moe_engine_stats s1, s2;

    struct moe_engine *e = make_engine((struct moe_engine_opts){.n_block = 32}, &on);
    moe_engine_submit(e, 0, a, 3 * BS + 5, &p, on_token, &on, &err);
    run_to_end(e);
    moe_engine_stats(e, &s1);
    moe_engine_submit(e, 1, b, 3 * BS + 9, &p, on_token, &on, &err);
    run_to_end(e);
    moe_engine_stats(e, &s2);
    int64_t computed = s2.computed_tokens - s1.computed_tokens;
    /* 9 new prompt tokens, then 3 decode steps of 1 token */
    CHECKF(computed == 9 + 3, "second request computed %lld tokens, expected 12",
           (long long)computed);
    CHECK(s2.prefix_hit_tokens - s1.prefix_hit_tokens == 3 * BS);
    moe_engine_destroy(e);

    e = make_engine((struct moe_engine_opts){.n_block = 32, .no_prefix_cache = true}, &off);
    moe_engine_submit(e, 1, b, 3 * BS + 9, &p, on_token, &off, &err);
    run_to_end(e);
    moe_engine_destroy(e);
    CHECK(on.n[1] == 4 && !memcmp(on.tokens[1], off.tokens[1], 4 * sizeof(int32_t)));
    double worst = 0;
    for (int j = 0; j < 4 && on.logits[1] && off.logits[1]; j++)
        worst = fmax(worst, max_rel(on.logits[1] + (size_t)j * vocab,
                                    off.logits[1] + (size_t)j * vocab, vocab));
    CHECKF(worst <= 1e-5, "prefix-cached logits rel err %.3g", worst);
    printf("prefix cache: second request computed %lld tokens (prompt %d), logits rel err %.3g\n",
           (long long)computed, 3 * BS + 9, worst);
    capture_free(&on);
    capture_free(&off);
}

static void test_seeded_sampling(void)
{
    enum { OUT = 16 };
    int32_t prompt[12];
    make_prompt(3, 12, prompt);
    struct moe_request_params p;
    moe_request_params_init(&p);
    p.max_tokens = OUT;
    p.ignore_eos = true;
    p.sp.temperature = 1.0f;
    p.sp.top_p = 0.9f;
    p.has_seed = true;
    p.seed = 77;
    struct moe_error err = {0};
    static struct capture c1, c2;
    memset(&c1, 0, sizeof c1);
    memset(&c2, 0, sizeof c2);
    struct moe_engine *e = make_engine((struct moe_engine_opts){.n_block = 64}, &c1);
    moe_engine_submit(e, 0, prompt, 12, &p, on_token, &c1, &err);
    run_to_end(e);
    moe_engine_destroy(e);
    /* same request amid others with other seeds and sampling settings */
    e = make_engine((struct moe_engine_opts){.n_block = 64, .max_batch_tokens = 20}, &c2);
    for (int i = 1; i < 6; i++) {
        int32_t other[20];
        make_prompt(50 + i, 20, other);
        struct moe_request_params q = p;
        q.seed = (uint64_t)i;
        q.sp.top_k = 5;
        moe_engine_submit(e, (uint64_t)i, other, 20, &q, on_token, &c2, &err);
    }
    moe_engine_submit(e, 0, prompt, 12, &p, on_token, &c2, &err);
    run_to_end(e);
    moe_engine_destroy(e);
    CHECK(c1.n[0] == OUT && c2.n[0] == OUT &&
          !memcmp(c1.tokens[0], c2.tokens[0], sizeof(int32_t) * OUT));
    /* and a different seed gives a different stream */
    static struct capture c3;
    memset(&c3, 0, sizeof c3);
    p.seed = 78;
    e = make_engine((struct moe_engine_opts){.n_block = 64}, &c3);
    moe_engine_submit(e, 0, prompt, 12, &p, on_token, &c3, &err);
    run_to_end(e);
    moe_engine_destroy(e);
    CHECK(memcmp(c1.tokens[0], c3.tokens[0], sizeof(int32_t) * OUT) != 0);
}

/* A 2-byte stop string across a token boundary of tokens[0, n): the last
 * byte of the text of the first k tokens and the first byte token k adds,
 * both printable ASCII, for the first such k >= 2; with `fresh` also one the
 * first k tokens' text does not hold already. Returns k and fills stop and
 * *full (the text of the first k + 1 tokens; the caller frees it), or -1. */
static int stop_across(struct moe_tokenizer *tok, const int32_t *tokens, int n, bool fresh,
                       char stop[3], char **full)
{
    char *head = NULL;
    size_t head_len = 0, full_len = 0;
    int k = -1;
    *full = NULL;
    for (int j = 2; j < n - 1 && k < 0; j++) {
        free(head);
        free(*full);
        head = *full = NULL;
        moe_tokenizer_decode(tok, tokens, (size_t)j, true, &head, &head_len, NULL);
        moe_tokenizer_decode(tok, tokens, (size_t)j + 1, true, full, &full_len, NULL);
        if (!head || !*full || head_len < 1 || full_len <= head_len ||
            memcmp(*full, head, head_len) || head[head_len - 1] <= ' ' ||
            (unsigned char)head[head_len - 1] >= 0x80 || (*full)[head_len] <= ' ' ||
            (unsigned char)(*full)[head_len] >= 0x80)
            continue;
        stop[0] = head[head_len - 1];
        stop[1] = (*full)[head_len];
        stop[2] = 0;
        if (!fresh || !strstr(head, stop))
            k = j;
    }
    free(head);
    return k;
}

static void test_stop_strings(struct moe_tokenizer *tok)
{
    /* Generate greedily, decode, then ask again with a stop string that spans
     * the boundary between two generated tokens. */
    int32_t prompt[10];
    make_prompt(11, 10, prompt);
    struct moe_request_params p;
    moe_request_params_init(&p);
    p.max_tokens = 24;
    p.ignore_eos = true;
    struct moe_error err = {0};
    static struct capture c1, c2;
    memset(&c1, 0, sizeof c1);
    memset(&c2, 0, sizeof c2);
    struct moe_engine *e = NULL;
    struct moe_engine_opts o = {.n_block = 64};
    CHECK(moe_engine_create(model, tok, &o, &e, &err) == MOE_OK);
    moe_engine_submit(e, 0, prompt, 10, &p, on_token, &c1, &err);
    run_to_end(e);
    /* a stop string across the boundary between tokens k - 1 and k */
    char stop[3], *full = NULL;
    int k = stop_across(tok, c1.tokens[0], c1.n[0], false, stop, &full);
    CHECKF(k > 0, "no token boundary with ASCII text on both sides in %d tokens", c1.n[0]);
    if (k > 0) {
        char *first = strstr(full, stop);
        p.n_stop_strings = 1;
        strcpy(p.stop_strings[0], stop);
        moe_engine_submit(e, 1, prompt, 10, &p, on_token, &c2, &err);
        run_to_end(e);
        CHECK(c2.finish[1] == MOE_FINISH_STOP);
        CHECKF(c2.n[1] <= k + 1, "stopped after %d tokens, boundary at %d", c2.n[1], k);
        CHECK(first && c2.text_len[1] == first - full);
        CHECK(!memcmp(c1.tokens[0], c2.tokens[1], sizeof(int32_t) * (size_t)c2.n[1]));
    }
    free(full);
    moe_engine_destroy(e);
}

/* Greedy tokens of one request (ids path: no logits hook), into c slot r. */
static void run_plain(struct moe_tokenizer *tok, const struct moe_engine_opts *o,
                      const int32_t *prompt, int n, const struct moe_request_params *p,
                      struct capture *c, int r)
{
    struct moe_engine *e = NULL;
    struct moe_error err = {0};
    CHECKF(moe_engine_create(model, tok, o, &e, &err) == MOE_OK, "%s", err.msg);
    CHECKF(moe_engine_submit(e, (uint64_t)r, prompt, n, p, on_token, c, &err) == MOE_OK, "%s",
           err.msg);
    run_to_end(e);
    moe_engine_destroy(e);
}

/* min_tokens (vLLM's): before that many tokens no stop id, EOS or stop
 * string ends a request. The greedy path's first token made a stop id ends
 * the request at once without it; with min_tokens 3 the first three tokens
 * avoid it (the first is the argmax of the rest of the row), on the ids path
 * (greedy steps bring no logits) as with logits, and n-gram speculation
 * gives the same tokens. A stop string that ends the text at token k+1
 * stops there, and with min_tokens k+1 it does not. */
static void test_min_tokens(struct moe_tokenizer *tok)
{
    int32_t prompt[10];
    make_prompt(12, 10, prompt);
    struct moe_request_params p;
    moe_request_params_init(&p);
    p.max_tokens = 20;
    p.ignore_eos = true;
    static struct capture ref, c;
    memset(&ref, 0, sizeof ref);
    memset(&c, 0, sizeof c);
    struct moe_engine_opts o = {.n_block = 64};
    run_plain(tok, &o, prompt, 10, &p, &ref, 0);
    CHECK(ref.n[0] == 20);
    int32_t t0 = ref.tokens[0][0];

    p.n_stop_ids = 1;
    p.stop_ids[0] = t0;
    run_plain(tok, &o, prompt, 10, &p, &c, 1); /* stops at once */
    CHECK(c.n[1] == 1 && c.tokens[1][0] == t0 && c.finish[1] == MOE_FINISH_STOP);
    p.min_tokens = 3;
    run_plain(tok, &o, prompt, 10, &p, &c, 2); /* ids path */
    CHECKF(c.n[2] >= 3, "%d tokens", c.n[2]);
    for (int i = 0; i < 3 && i < c.n[2]; i++)
        CHECKF(c.tokens[2][i] != t0, "token %d is the stop id %d", i, t0);
    CHECK(c.finish[2] == MOE_FINISH_LENGTH ||
          (c.finish[2] == MOE_FINISH_STOP && c.tokens[2][c.n[2] - 1] == t0 && c.n[2] > 3));
    /* with logits (the hook): the first token is the row's best but the stop id */
    c.capture_logits = true;
    struct moe_engine *e = make_engine(o, &c);
    struct moe_error err = {0};
    CHECK(moe_engine_submit(e, 3, prompt, 10, &p, on_token, &c, &err) == MOE_OK);
    run_to_end(e);
    moe_engine_destroy(e);
    CHECK(c.n[3] == c.n[2] && !memcmp(c.tokens[3], c.tokens[2], sizeof(int32_t) * (size_t)c.n[2]));
    int best = -1;
    for (int v = 0; c.logits[3] && v < vocab; v++)
        if (v != t0 && (best < 0 || c.logits[3][v] > c.logits[3][best]))
            best = v;
    CHECKF(c.n[3] >= 1 && c.tokens[3][0] == best, "first token %d, best but the stop id %d",
           c.tokens[3][0], best);
    /* speculation (n-gram drafts, verified row by row) changes nothing */
    struct moe_engine_opts so = {.n_block = 64, .spec_tokens = 3};
    run_plain(tok, &so, prompt, 10, &p, &c, 4);
    CHECK(c.n[4] == c.n[2] && !memcmp(c.tokens[4], c.tokens[2], sizeof(int32_t) * (size_t)c.n[2]));

    /* a stop string across tokens k - 1 and k of the reference output, new there */
    p.n_stop_ids = 0;
    p.min_tokens = 0;
    char stop[3], *full = NULL;
    int k = stop_across(tok, ref.tokens[0], ref.n[0], true, stop, &full);
    CHECKF(k > 0, "no token boundary with ASCII text on both sides in %d tokens", ref.n[0]);
    if (k > 0) {
        p.n_stop_strings = 1;
        strcpy(p.stop_strings[0], stop);
        run_plain(tok, &o, prompt, 10, &p, &c, 5);
        CHECKF(c.finish[5] == MOE_FINISH_STOP && c.n[5] == k + 1, "finish %d after %d tokens, k %d",
               c.finish[5], c.n[5], k);
        p.min_tokens = k + 1;
        run_plain(tok, &o, prompt, 10, &p, &c, 6);
        CHECKF(c.n[6] > k + 1 &&
                   !memcmp(c.tokens[6], ref.tokens[0], sizeof(int32_t) * (size_t)c.n[6]),
               "%d tokens with min_tokens %d", c.n[6], k + 1);
        printf("min_tokens: stop id held off 3 tokens (%d tokens, finish %d); stop string '%s' at "
               "token %d, with min_tokens %d: %d tokens, finish %d\n",
               c.n[2], c.finish[2], stop, k + 1, k + 1, c.n[6], c.finish[6]);
    }
    free(full);
    capture_free(&c);
}

/* prompt_logprobs: every prompt token's log-probability given the tokens
 * before it, read from the prefill's rows (chunks of 16 here), equal within
 * 1e-4 to the sampling row of the prefix as a request (the logits hook,
 * log_softmax in double); top alternatives descending, the first the row's
 * argmax; the same again with a pool small enough to preempt, and for a
 * second identical prompt (which takes no prefix-cache hits). */
#define PLP_N 40
static struct moe_prompt_logprob plp_got[3][PLP_N];
static int plp_seen[3];

static void on_plp_token(void *user, const struct moe_token_event *ev)
{
    (void)user;
    int r = (int)ev->req_id;
    if (ev->index == 0 && ev->prompt_logprobs && r < 3 && ev->n_prompt <= PLP_N) {
        memcpy(plp_got[r], ev->prompt_logprobs, (size_t)ev->n_prompt * sizeof *plp_got[r]);
        plp_seen[r]++;
    }
}

static float plp_row[PLP_N][4096]; /* request i: the sampling row after prompt[0, i) */
static void on_plp_row(void *user, uint64_t req_id, int index, const float *logits, int n)
{
    (void)user;
    if (index == 0 && n <= 4096 && req_id < PLP_N)
        memcpy(plp_row[req_id], logits, (size_t)n * sizeof(float));
}

static void test_prompt_logprobs(void)
{
    int32_t prompt[PLP_N];
    make_prompt(14, PLP_N, prompt);
    struct moe_request_params p;
    moe_request_params_init(&p);
    p.max_tokens = 2;
    p.ignore_eos = true;
    p.prompt_logprobs = 3;
    struct moe_error err = {0};
    memset(plp_seen, 0, sizeof plp_seen);
    struct moe_engine *e = NULL;
    struct moe_engine_opts o = {.n_block = 64, .max_batch_tokens = 16};
    CHECK(moe_engine_create(model, NULL, &o, &e, &err) == MOE_OK);
    CHECK(moe_engine_submit(e, 0, prompt, PLP_N, &p, on_plp_token, NULL, &err) == MOE_OK);
    run_to_end(e);
    CHECK(moe_engine_submit(e, 2, prompt, PLP_N, &p, on_plp_token, NULL, &err) == MOE_OK);
    run_to_end(e); /* the same prompt again: no prefix hits with prompt_logprobs */
    moe_engine_destroy(e);
    /* two 20-token prompts in 8 blocks of 4: the newer (ours) is preempted */
    struct moe_engine_opts small = {.n_block = 8, .block_size = 4, .max_batch_tokens = 8};
    CHECK(moe_engine_create(model, NULL, &small, &e, &err) == MOE_OK);
    p.max_tokens = 4;
    int32_t other[20];
    make_prompt(15, 20, other);
    struct moe_request_params op = p;
    op.prompt_logprobs = -1;
    CHECK(moe_engine_submit(e, 7, other, 20, &op, on_plp_token, NULL, &err) == MOE_OK);
    CHECK(moe_engine_submit(e, 1, prompt, 20, &p, on_plp_token, NULL, &err) == MOE_OK);
    run_to_end(e);
    struct moe_engine_stats st;
    moe_engine_stats(e, &st);
    CHECKF(st.preemptions > 0, "%lld preemptions", (long long)st.preemptions);
    moe_engine_destroy(e);
    CHECKF(plp_seen[0] == 1 && plp_seen[1] == 1 && plp_seen[2] == 1, "events %d %d %d", plp_seen[0],
           plp_seen[1], plp_seen[2]);
    /* the reference: each prefix as a request of its own, its sampling row
     * through the logits hook */
    struct moe_engine_opts ro = {.n_block = 256, .logits_hook = on_plp_row};
    struct moe_request_params rp;
    moe_request_params_init(&rp);
    rp.max_tokens = 1;
    static struct capture rc;
    memset(&rc, 0, sizeof rc);
    CHECK(moe_engine_create(model, NULL, &ro, &e, &err) == MOE_OK);
    for (int i = 1; i < PLP_N; i++)
        CHECK(moe_engine_submit(e, (uint64_t)i, prompt, i, &rp, on_token, &rc, &err) == MOE_OK);
    run_to_end(e);
    moe_engine_destroy(e);
    double worst = 0;
    int order_ok = 1;
    for (int i = 1; i < PLP_N; i++) {
        const float *plp_row_i = plp_row[i];
        double mx = -INFINITY, sum = 0;
        int best = 0;
        for (int v = 0; v < vocab; v++)
            if (plp_row_i[v] > mx) {
                mx = plp_row_i[v];
                best = v;
            }
        for (int v = 0; v < vocab; v++)
            sum += exp((double)plp_row_i[v] - mx);
        double want = (double)plp_row_i[prompt[i]] - mx - log(sum);
        for (int r = 0; r < 3; r++) {
            if (r == 1 && i >= 20)
                continue;
            worst = fmax(worst, fabs(plp_got[r][i].logprob - want));
            const struct moe_prompt_logprob *g = &plp_got[r][i];
            order_ok &= g->n_top == 3 && g->top_ids[0] == best &&
                        g->top_logprobs[0] >= g->top_logprobs[1] &&
                        g->top_logprobs[1] >= g->top_logprobs[2];
        }
    }
    CHECKF(worst <= 1e-4, "prompt logprobs differ from the prefix's own row by %.3g", worst);
    CHECK(order_ok);
    printf("prompt_logprobs: %d tokens in chunks of 16, again (no prefix hits) and under "
           "preemption: max |diff| %.2g against each prefix's own row\n",
           PLP_N, worst);
}

struct lp_capture {
    float logits[4][1024];
    int n_logits;
    struct moe_token_event ev[4];
    int n_ev;
};

static void on_lp_token(void *user, const struct moe_token_event *ev)
{
    struct lp_capture *c = user;
    if (ev->token >= 0 && c->n_ev < 4)
        c->ev[c->n_ev++] = *ev;
}

static void on_lp_logits(void *user, uint64_t req_id, int index, const float *logits, int n)
{
    struct lp_capture *c = user;
    if (index < 4 && n <= 1024) {
        memcpy(c->logits[index], logits, (size_t)n * sizeof(float));
        c->n_logits = index + 1;
    }
}

/* logit_bias (OpenAI's): +100 on a token makes greedy decoding emit it every
 * step, -100 on the greedy first token takes it away; logprobs stay the raw
 * model's (the forced token's is not ~0); bad ids and values are refused by
 * name. */
static void test_logit_bias(void)
{
    int32_t prompt[8];
    make_prompt(13, 8, prompt);
    struct moe_request_params p;
    moe_request_params_init(&p);
    p.max_tokens = 6;
    p.ignore_eos = true;
    static struct capture c;
    memset(&c, 0, sizeof c);
    struct moe_engine_opts o = {.n_block = 32};
    run_plain(NULL, &o, prompt, 8, &p, &c, 0);
    int32_t t0 = c.tokens[0][0], forced = (t0 + 7) % vocab;
    p.n_logit_bias = 1;
    p.bias_ids[0] = t0;
    p.logit_bias[0] = -100;
    run_plain(NULL, &o, prompt, 8, &p, &c, 1);
    CHECKF(c.n[1] == 6 && c.tokens[1][0] != t0, "first token %d with %d biased away",
           c.tokens[1][0], t0);
    p.bias_ids[0] = forced;
    p.logit_bias[0] = 100;
    run_plain(NULL, &o, prompt, 8, &p, &c, 2);
    int all = 0;
    for (int i = 0; i < c.n[2]; i++)
        all += c.tokens[2][i] == forced;
    CHECKF(c.n[2] == 6 && all == 6, "%d of %d tokens are the biased %d", all, c.n[2], forced);
    /* logprobs: the raw distribution's */
    static struct lp_capture lc;
    memset(&lc, 0, sizeof lc);
    struct moe_engine *e = NULL;
    struct moe_error err = {0};
    CHECK(moe_engine_create(model, NULL, &o, &e, &err) == MOE_OK);
    p.logprobs = 0;
    CHECK(moe_engine_submit(e, 3, prompt, 8, &p, on_lp_token, &lc, &err) == MOE_OK);
    run_to_end(e);
    CHECKF(lc.n_ev >= 1 && lc.ev[0].token == forced && lc.ev[0].logprob < logf(0.5f),
           "forced token %d logprob %g", lc.ev[0].token, (double)lc.ev[0].logprob);
    p.logprobs = -1;
    p.logit_bias[0] = 101;
    CHECK(moe_engine_submit(e, 4, prompt, 8, &p, on_token, &c, &err) == MOE_ERR_INVALID);
    CHECKF(strstr(err.msg, "logit_bias"), "%s", err.msg);
    p.logit_bias[0] = 1;
    p.bias_ids[0] = vocab;
    CHECK(moe_engine_submit(e, 4, prompt, 8, &p, on_token, &c, &err) == MOE_ERR_INVALID);
    CHECKF(strstr(err.msg, "logit_bias: token"), "%s", err.msg);
    moe_engine_destroy(e);
    printf("logit_bias: -100 on the greedy %d -> %d first; +100 on %d -> %d of 6 tokens\n", t0,
           c.tokens[1][0], forced, all);
}

/* Logprobs are log_softmax of the raw logits; the top-n list is sorted and
 * holds the greedy token first. Penalties change what is sampled. */
static void test_logprobs_and_penalties(void)
{
    static struct lp_capture c;
    memset(&c, 0, sizeof c);
    struct moe_engine *e = NULL;
    struct moe_error err = {0};
    struct moe_engine_opts o = {.n_block = 16, .logits_hook = on_lp_logits, .logits_hook_user = &c};
    CHECK(moe_engine_create(model, NULL, &o, &e, &err) == MOE_OK);
    int32_t prompt[6];
    make_prompt(21, 6, prompt);
    struct moe_request_params p;
    moe_request_params_init(&p);
    p.max_tokens = 4;
    p.ignore_eos = true;
    p.logprobs = 5;
    CHECK(moe_engine_submit(e, 0, prompt, 6, &p, on_lp_token, &c, &err) == MOE_OK);
    run_to_end(e);
    CHECK(c.n_ev == 4 && c.n_logits == 4);
    for (int i = 0; i < c.n_ev && i < c.n_logits; i++) {
        const float *l = c.logits[i];
        double max = l[0], sum = 0;
        for (int j = 1; j < vocab; j++)
            max = fmax(max, l[j]);
        for (int j = 0; j < vocab; j++)
            sum += exp(l[j] - max);
        double want = l[c.ev[i].token] - max - log(sum);
        CHECKF(fabs(c.ev[i].logprob - want) < 1e-4, "logprob %g, want %g", c.ev[i].logprob, want);
        CHECK(c.ev[i].n_top == 5 && c.ev[i].top_ids[0] == c.ev[i].token);
        for (int k = 1; k < c.ev[i].n_top; k++)
            CHECK(c.ev[i].top_logprobs[k] <= c.ev[i].top_logprobs[k - 1]);
    }
    /* a strong repetition penalty never repeats a prompt or output token greedily */
    static struct capture rc;
    memset(&rc, 0, sizeof rc);
    moe_request_params_init(&p);
    p.max_tokens = 24;
    p.ignore_eos = true;
    p.sp.repetition_penalty = 10.0f;
    p.sp.presence_penalty = 2.0f;
    CHECK(moe_engine_submit(e, 1, prompt, 6, &p, on_token, &rc, &err) == MOE_OK);
    run_to_end(e);
    int repeats = 0;
    for (int i = 0; i < rc.n[1]; i++)
        for (int j = 0; j < i; j++)
            repeats += rc.tokens[1][i] == rc.tokens[1][j];
    CHECKF(rc.n[1] == 24 && repeats == 0, "%d repeats with penalties", repeats);
    moe_engine_destroy(e);
}

static void test_bad_params(void)
{
    static struct capture c;
    memset(&c, 0, sizeof c);
    struct moe_engine *e = make_engine((struct moe_engine_opts){.n_block = 8, .block_size = 4}, &c);
    struct moe_error err = {0};
    int32_t prompt[4] = {1, 2, 3, 4};
    struct moe_request_params p;
    moe_request_params_init(&p);
    CHECK(moe_engine_submit(e, 0, prompt, 0, &p, on_token, &c, &err) == MOE_ERR_INVALID);
    CHECK(strstr(err.msg, "prompt"));
    int32_t bad_tok[1] = {vocab};
    CHECK(moe_engine_submit(e, 0, bad_tok, 1, &p, on_token, &c, &err) == MOE_ERR_INVALID);
    p.max_tokens = 0;
    CHECK(moe_engine_submit(e, 0, prompt, 4, &p, on_token, &c, &err) == MOE_ERR_INVALID);
    CHECK(strstr(err.msg, "max_tokens"));
    p.max_tokens = 100; /* needs 26 blocks of 4, the pool has 8 */
    CHECK(moe_engine_submit(e, 0, prompt, 4, &p, on_token, &c, &err) == MOE_ERR_INVALID);
    CHECK(strstr(err.msg, "KV blocks"));
    p.max_tokens = 4;
    p.sp.temperature = -1;
    CHECK(moe_engine_submit(e, 0, prompt, 4, &p, on_token, &c, &err) == MOE_ERR_INVALID);
    CHECK(strstr(err.msg, "temperature"));
    p.sp.temperature = 0;
    p.sp.top_p = 1.5f;
    CHECK(moe_engine_submit(e, 0, prompt, 4, &p, on_token, &c, &err) == MOE_ERR_INVALID);
    p.sp.top_p = 0;
    p.min_tokens = 5;
    CHECK(moe_engine_submit(e, 0, prompt, 4, &p, on_token, &c, &err) == MOE_ERR_INVALID);
    CHECKF(strstr(err.msg, "min_tokens: 5 is not in [0, max_tokens 4]"), "%s", err.msg);
    p.min_tokens = 0;
    p.n_stop_strings = 1;
    strcpy(p.stop_strings[0], "x");
    CHECK(moe_engine_submit(e, 0, prompt, 4, &p, on_token, &c, &err) == MOE_ERR_INVALID);
    CHECK(strstr(err.msg, "tokenizer"));
    p.n_stop_strings = 0;
    CHECK(moe_engine_submit(e, 0, prompt, 4, &p, on_token, &c, &err) == MOE_OK);
    CHECK(moe_engine_submit(e, 0, prompt, 4, &p, on_token, &c, &err) == MOE_ERR_INVALID);
    CHECK(strstr(err.msg, "already"));
    moe_engine_abort(e, 0);
    run_to_end(e);
    CHECK(c.finish[0] == MOE_FINISH_ABORT && c.n[0] == 0);
    moe_engine_destroy(e);
}

/* A step's inputs go up in one copy (forward.c, step_inputs_upload), into
 * host staging from the backend's host_alloc where it has one: the CPU
 * backend's ops wrapped to count uploads and to provide host_alloc, a
 * greedy and a seeded sampled request (whose draws travel in the same copy)
 * run twice; the second run, its scratch already grown, makes exactly one
 * upload per forward, and both runs give the same tokens. The wrapped ops
 * also offer buf_upload_async (as CUDA does), which the step inputs take
 * from pinned staging: that one upload is a no-wait one. */
static const struct moe_backend_ops *g_real_ops;
static int g_uploads, g_forwards, g_host_live;

static void upload_counted(struct moe_backend *be, void *dst, const void *src, size_t bytes)
{
    g_uploads++;
    g_real_ops->buf_upload(be, dst, src, bytes);
}

/* the no-wait upload a backend with pinned staging offers (CUDA) */
static int g_uploads_async;

static void upload_async_counted(struct moe_backend *be, void *dst, const void *src, size_t bytes)
{
    g_uploads_async++;
    g_real_ops->buf_upload(be, dst, src, bytes);
}

static void *host_alloc_counted(struct moe_backend *be, size_t bytes)
{
    (void)be;
    g_host_live++;
    return malloc(bytes);
}

static void host_free_counted(struct moe_backend *be, void *p)
{
    (void)be;
    g_host_live -= p != NULL;
    free(p);
}

static enum moe_status forward_counted(void *ctx, struct moe_model *m, struct moe_kv_cache *kv,
                                       const struct moe_batch *b, float *logits,
                                       struct moe_error *err)
{
    (void)ctx;
    g_forwards++;
    return moe_model_forward(m, kv, b, logits, err);
}

static void test_step_uploads(struct moe_backend *be)
{
    enum { N = 3, OUT = 6 };
    struct moe_backend_ops wrapped = *be->ops;
    g_real_ops = be->ops;
    wrapped.buf_upload = upload_counted;
    wrapped.buf_upload_async = upload_async_counted;
    wrapped.host_alloc = host_alloc_counted;
    wrapped.host_free = host_free_counted;
    /* a fresh model, so its scratch (and staging) comes from the wrapped ops */
    struct moe_model *m = NULL;
    struct moe_error err = {0};
    struct moe_model_opts mo = {.dtype = MOE_DTYPE_F32, .tp_size = 1};
    be->ops = &wrapped;
    CHECKF(moe_model_load(test_src_path("tests/golden/fixtures/qwen3_moe"), &mo, be, &m, &err) ==
               MOE_OK,
           "%s", err.msg);
    int32_t prompts[N][40];
    static struct capture runs[2];
    int uploads[2] = {0, 0}, forwards[2] = {0, 0}, async[2] = {0, 0};
    for (int run = 0; m && run < 2; run++) {
        memset(&runs[run], 0, sizeof runs[run]);
        struct moe_engine_opts o = {.n_block = 64, .forward = forward_counted, .forward_ids = true};
        struct moe_engine *e = NULL;
        CHECKF(moe_engine_create(m, NULL, &o, &e, &err) == MOE_OK, "%s", err.msg);
        if (!e)
            break;
        g_uploads = g_uploads_async = g_forwards = 0;
        for (int i = 0; i < N; i++) {
            make_prompt(70 + i, 6 + 5 * i, prompts[i]);
            struct moe_request_params q;
            moe_request_params_init(&q);
            q.max_tokens = OUT;
            q.ignore_eos = true;
            if (i == 1) {
                q.sp.temperature = 0.7f;
                q.has_seed = true;
                q.seed = 11;
            }
            CHECK(moe_engine_submit(e, (uint64_t)i, prompts[i], 6 + 5 * i, &q, on_token, &runs[run],
                                    &err) == MOE_OK);
        }
        run_to_end(e);
        moe_engine_destroy(e);
        uploads[run] = g_uploads + g_uploads_async;
        async[run] = g_uploads_async;
        forwards[run] = g_forwards;
    }
    CHECKF(forwards[1] > 0 && uploads[1] == forwards[1] && async[1] == forwards[1],
           "step inputs: %d uploads (%d without a wait) in %d forwards (want one each, without)",
           uploads[1], async[1], forwards[1]);
    int same = 0;
    for (int i = 0; i < N; i++)
        same += runs[0].n[i] == OUT && runs[1].n[i] == OUT &&
                !memcmp(runs[0].tokens[i], runs[1].tokens[i], sizeof(int32_t) * OUT);
    CHECKF(same == N, "step inputs: %d of %d requests the same tokens in both runs", same, N);
    moe_model_free(m);
    CHECKF(g_host_live == 0, "step inputs: %d host staging buffers not freed", g_host_live);
    be->ops = g_real_ops;
    printf("step inputs: %d forwards, %d uploads (the first run %d in %d, scratch growing); "
           "staging from host_alloc, all freed\n",
           forwards[1], uploads[1], uploads[0], forwards[0]);
}

/* n requests (prompts make_prompt(seed + i, lens[i] <= 48), at most
 * max_tokens[i] tokens each, EOS ignored; greedy, or with `sampled` every
 * odd one drawn with its own seed, temperature and top_p) run to the end
 * on e into cap; stats gets what they added to the expert statistics. */
static void run_requests(struct moe_engine *e, struct moe_model *m, int n, const int *lens,
                         const int *max_tokens, int seed, bool sampled, struct capture *cap,
                         uint64_t *stats)
{
    const struct moe_config *c = moe_model_config(m);
    const size_t n_stats = (size_t)c->n_layer * c->n_expert;
    uint64_t *before = malloc(n_stats * sizeof *before);
    MOE_ASSERT(before != NULL && n <= 8);
    memcpy(before, moe_model_expert_tokens(m), n_stats * sizeof *before);
    int32_t prompts[8][48];
    struct moe_error err = {0};
    for (int i = 0; i < n; i++) {
        make_prompt(seed + i, lens[i], prompts[i]);
        struct moe_request_params q;
        moe_request_params_init(&q);
        q.max_tokens = max_tokens[i];
        q.ignore_eos = true;
        if (sampled && i % 2) {
            q.sp.temperature = 0.6f + 0.2f * (float)(i % 3);
            q.sp.top_p = i % 3 ? 0.9f : 1.0f;
            q.has_seed = true;
            q.seed = (uint64_t)(seed + 7 * i);
        }
        CHECK(moe_engine_submit(e, (uint64_t)i, prompts[i], lens[i], &q, on_token, cap, &err) ==
              MOE_OK);
    }
    run_to_end(e);
    for (size_t i = 0; i < n_stats; i++)
        stats[i] = moe_model_expert_tokens(m)[i] - before[i];
    free(before);
}

/* The MoE layer routed on the device (moe_layer.c): on one rank, for steps
 * of at most MOE_ROUTE_DEVICE_MAX_TOK tokens, the offsets stay on the
 * backend and the step's only downloads are its ids and one copy of every
 * layer's offsets for the expert statistics; longer steps take the host
 * path (a download per MoE layer). The CPU backend's ops wrapped to count
 * downloads; the same requests run routed on the device (twice, the first
 * growing the scratch), then without the backend's grouped_device_rows op
 * (host path only): the same tokens, the same expert statistics, and the
 * downloads of each forward those of its path. */
static bool be_ops_device_rows; /* the wrapped ops have grouped_device_rows */
static int g_downloads, g_dl_wrong, g_dl_device_steps, g_dl_host_steps, g_moe_layers;

static void download_counted(struct moe_backend *be, void *dst, const void *src, size_t bytes)
{
    g_downloads++;
    g_real_ops->buf_download(be, dst, src, bytes);
}

static enum moe_status forward_downloads(void *ctx, struct moe_model *m, struct moe_kv_cache *kv,
                                         const struct moe_batch *b, float *logits,
                                         struct moe_error *err)
{
    int before = g_downloads;
    enum moe_status rc = moe_model_forward(m, kv, b, logits, err);
    (void)ctx;
    bool device = be_ops_device_rows && b->n_tok <= MOE_ROUTE_DEVICE_MAX_TOK;
    int want = device ? 2 : 1 + g_moe_layers; /* ids + statistics, or ids + one per layer */
    if (!rc && g_downloads - before != want && g_dl_wrong++ < 3)
        printf("  forward of %d tokens (%s path): %d downloads, want %d\n", b->n_tok,
               device ? "device" : "host", g_downloads - before, want);
    *(device ? &g_dl_device_steps : &g_dl_host_steps) += 1;
    return rc;
}

static void test_device_routing(struct moe_backend *be)
{
    enum { N = 3, OUT = 8 };
    struct moe_backend_ops wrapped = *be->ops;
    g_real_ops = be->ops;
    wrapped.buf_download = download_counted;
    struct moe_model *m = NULL;
    struct moe_error err = {0};
    struct moe_model_opts mo = {.dtype = MOE_DTYPE_BF16, .fast = true, .tp_size = 1};
    be->ops = &wrapped;
    CHECKF(moe_model_load(test_src_path("tests/golden/fixtures/qwen3_moe"), &mo, be, &m, &err) ==
               MOE_OK,
           "%s", err.msg);
    const struct moe_config *c = m ? moe_model_config(m) : NULL;
    g_moe_layers = 0;
    for (int l = 0; c && l < c->n_layer; l++)
        g_moe_layers += m->layers[l].is_moe;
    const int lens[N] = {6, 31, 40}; /* 77 tokens: the first step takes the host path */
    const int outs[N] = {OUT, OUT, OUT};
    static struct capture runs[3];
    uint64_t stats[3][64] = {{0}};
    int n_stats = c ? c->n_layer * c->n_expert : 0;
    CHECK(n_stats <= 64);
    g_dl_wrong = 0;
    for (int run = 0; m && run < 3; run++) {
        wrapped.grouped_device_rows = run < 2 ? g_real_ops->grouped_device_rows : NULL;
        be_ops_device_rows = wrapped.grouped_device_rows != NULL;
        memset(&runs[run], 0, sizeof runs[run]);
        struct moe_engine_opts o = {
            .n_block = 64, .forward = forward_downloads, .forward_ctx = be, .forward_ids = true};
        struct moe_engine *e = NULL;
        CHECKF(moe_engine_create(m, NULL, &o, &e, &err) == MOE_OK, "%s", err.msg);
        if (!e)
            break;
        g_dl_device_steps = g_dl_host_steps = 0;
        run_requests(e, m, N, lens, outs, 90, false, &runs[run], stats[run]);
        moe_engine_destroy(e);
        printf("device routing: run %d (%s): %d forwards routed on the device, %d on the host\n",
               run, run < 2 ? "grouped_device_rows" : "host offsets only", g_dl_device_steps,
               g_dl_host_steps);
        CHECKF(run < 2 ? g_dl_device_steps >= OUT - 1 && g_dl_host_steps >= 1
                       : g_dl_device_steps == 0 && g_dl_host_steps >= OUT,
               "run %d: %d device, %d host forwards", run, g_dl_device_steps, g_dl_host_steps);
    }
    CHECKF(g_dl_wrong == 0, "device routing: %d forwards with unexpected downloads", g_dl_wrong);
    for (int run = 1; run < 3; run++) {
        int same = 0;
        for (int i = 0; i < N; i++)
            same += runs[0].n[i] == OUT && runs[run].n[i] == OUT &&
                    !memcmp(runs[0].tokens[i], runs[run].tokens[i], sizeof(int32_t) * OUT);
        CHECKF(same == N, "device routing: run %d, %d of %d requests the same tokens as run 0", run,
               same, N);
        CHECKF(!memcmp(stats[0], stats[run], (size_t)n_stats * sizeof stats[0][0]),
               "device routing: run %d's expert statistics differ from run 0's", run);
    }
    uint64_t total = 0;
    for (int i = 0; i < n_stats; i++)
        total += stats[0][i];
    CHECKF(c && total == (uint64_t)(6 + 31 + 40 + N * (OUT - 1)) * g_moe_layers * c->top_k,
           "device routing: %llu routed pairs counted", (unsigned long long)total);
    be->ops = g_real_ops;
    moe_model_free(m);
}

/* Decode steps as graphs (forward.c, step_graphable; kernels/backend.h graph
 * ops), checked on the CPU with a recording stand-in for CUDA graphs: the
 * CPU backend's ops wrapped so that between graph_begin and graph_end each
 * op is recorded (its arguments by value, as a capture freezes them) instead
 * of run, and graph_launch replays the record; a host copy, wait,
 * allocation or free while recording fails it, as it would a capture. The
 * same greedy requests run with and without graphs: the same tokens and
 * the same expert statistics, with steps recorded and replayed (decode
 * steps padded to a power-of-two batch, so one graph serves 6, 5 and 4
 * sequences: the padding rows' ids dropped and their experts taken out of
 * the statistics). A step that read anything a graph cannot see (a host
 * value that changes between steps, a buffer that moved) would decode
 * differently on replay. */
enum rec_op {
    R_EMBED,
    R_RMSNORM,
    R_MATMUL,
    R_ROPE,
    R_KV_WRITE,
    R_ATTENTION,
    R_ADD,
    R_ROUTER,
    R_PERMUTE,
    R_GATHER,
    R_GROUPED,
    R_SWIGLU,
    R_ZERO,
    R_COMBINE,
    R_ARGMAX,
    R_COPY_COLS,
    R_SCATTER_ADD,
    R_SIGMOID,
    R_COPY,
    R_SAMPLE_ROWS,
    R_ROUTER_GROUPED,
    R_ADD_RMSNORM,
    R_ROPE_KV
};

struct rec {
    enum rec_op op;
    const void *p[6];
    void *out[2];
    int i[6];
    float f[2];
    size_t bytes;
    union {
        struct moe_matmul_params mm;
        struct moe_attn_params at;
        struct moe_grouped_matmul_params gm;
        struct moe_permute_params pm;
        struct moe_router_grouped_params rg;
        struct moe_rope_kv_params rk;
    } u;
};

#define GRAPH_SLOTS 64
static struct {
    const struct moe_backend_ops *real;
    bool recording, broken;
    struct rec *buf; /* the record being made */
    int n, cap;
    struct {
        uint64_t key;
        struct rec *recs;
        int n;
        bool failed;
    } g[GRAPH_SLOTS];
    int n_graphs, cur;
    int launches, records, failures;
} G;

static bool rec_push(struct rec r)
{
    if (!G.recording)
        return false;
    if (G.n == G.cap) {
        G.cap = G.cap ? 2 * G.cap : 256;
        G.buf = realloc(G.buf, (size_t)G.cap * sizeof *G.buf);
        MOE_ASSERT(G.buf != NULL);
    }
    G.buf[G.n++] = r;
    return true;
}

static void rec_run(struct moe_backend *be, const struct rec *r)
{
    const struct moe_backend_ops *o = G.real;
    switch (r->op) {
    case R_EMBED:
        o->embed(be, r->p[0], (enum moe_dtype)r->i[0], r->p[1], r->i[1], r->i[2], r->out[0]);
        break;
    case R_RMSNORM: o->rmsnorm(be, r->p[0], r->p[1], r->out[0], r->i[0], r->i[1], r->f[0]); break;
    case R_MATMUL: o->matmul(be, &r->u.mm); break;
    case R_ROPE:
        o->rope(be, r->out[0], r->p[0], r->i[0], r->i[1], r->i[2], r->p[1], r->f[0]);
        break;
    case R_KV_WRITE:
        o->kv_write(be, r->p[0], r->p[1], r->p[2], r->i[0], r->i[1], r->out[0], r->out[1],
                    (enum moe_dtype)r->i[2]);
        break;
    case R_ATTENTION: o->attention(be, &r->u.at); break;
    case R_ADD: o->add(be, r->out[0], r->p[0], r->bytes); break;
    case R_ROUTER:
        o->router_topk(be, r->p[0], r->i[0], r->i[1], r->i[2], r->i[3], r->out[0], r->out[1]);
        break;
    case R_PERMUTE: o->permute(be, &r->u.pm); break;
    case R_GATHER: o->gather_rows(be, r->p[0], r->p[1], r->i[0], r->i[1], r->out[0]); break;
    case R_GROUPED: o->grouped_matmul(be, &r->u.gm); break;
    case R_SWIGLU: o->swiglu(be, r->p[0], r->out[0], r->i[0], r->i[1]); break;
    case R_ZERO: o->buf_zero(be, r->out[0], r->bytes); break;
    case R_COMBINE:
        o->unpermute_combine(be, r->p[0], r->p[1], r->p[2], r->i[0], r->i[1], r->i[2], r->out[0]);
        break;
    case R_ARGMAX: o->argmax(be, r->p[0], r->i[0], r->i[1], r->out[0]); break;
    case R_COPY_COLS:
        o->copy_cols(be, r->out[0], r->i[0], r->p[0], r->i[1], r->i[2], r->i[3]);
        break;
    case R_SCATTER_ADD:
        o->scatter_add_rows(be, r->p[0], r->p[1], r->p[2], r->i[0], r->i[1], r->out[0]);
        break;
    case R_SIGMOID: o->sigmoid(be, r->out[0], r->bytes); break;
    case R_COPY: o->buf_copy(be, r->out[0], r->p[0], r->bytes); break;
    case R_SAMPLE_ROWS:
        o->sample_rows(be, r->p[0], r->i[0], r->i[1], r->p[1], r->p[2], r->p[3], r->out[0]);
        break;
    case R_ROUTER_GROUPED: o->router_topk_grouped(be, &r->u.rg); break;
    case R_ADD_RMSNORM:
        o->add_rmsnorm(be, r->out[0], r->p[0], r->p[1], r->out[1], r->i[0], r->i[1], r->f[0]);
        break;
    case R_ROPE_KV: o->rope_kv_write(be, &r->u.rk); break;
    }
}

/* Each op: recorded while recording, else run. */
#define REC_OR_RUN(...)                                                                            \
    do {                                                                                           \
        struct rec r_ = {__VA_ARGS__};                                                             \
        if (!rec_push(r_))                                                                         \
            rec_run(be, &r_);                                                                      \
    } while (0)

static void g_embed(struct moe_backend *be, const void *table, enum moe_dtype dt,
                    const int32_t *ids, int n, int dim, float *dst)
{
    REC_OR_RUN(.op = R_EMBED, .p = {table, ids}, .i = {dt, n, dim}, .out = {dst});
}
static void g_rmsnorm(struct moe_backend *be, const float *x, const float *w, float *y, int n,
                      int dim, float eps)
{
    REC_OR_RUN(.op = R_RMSNORM, .p = {x, w}, .out = {y}, .i = {n, dim}, .f = {eps});
}
static void g_matmul(struct moe_backend *be, const struct moe_matmul_params *p)
{
    REC_OR_RUN(.op = R_MATMUL, .u.mm = *p);
}
static void g_rope(struct moe_backend *be, float *x, const int32_t *pos, int n, int h, int d,
                   const float *inv_freq, float scale)
{
    REC_OR_RUN(.op = R_ROPE, .out = {x}, .p = {pos, inv_freq}, .i = {n, h, d}, .f = {scale});
}
static void g_kv_write(struct moe_backend *be, const float *k, const float *v, const int32_t *slots,
                       int n, int kv_dim, void *kc, void *vc, enum moe_dtype dt)
{
    REC_OR_RUN(.op = R_KV_WRITE, .p = {k, v, slots}, .i = {n, kv_dim, dt}, .out = {kc, vc});
}
static void g_attention(struct moe_backend *be, const struct moe_attn_params *p)
{
    REC_OR_RUN(.op = R_ATTENTION, .u.at = *p);
}
static void g_add(struct moe_backend *be, float *y, const float *x, size_t n)
{
    REC_OR_RUN(.op = R_ADD, .out = {y}, .p = {x}, .bytes = n);
}
static void g_router(struct moe_backend *be, const float *logits, int n, int n_e, int k,
                     bool renorm, int32_t *ids, float *w)
{
    REC_OR_RUN(.op = R_ROUTER, .p = {logits}, .i = {n, n_e, k, renorm}, .out = {ids, w});
}
static void g_permute(struct moe_backend *be, const struct moe_permute_params *p)
{
    REC_OR_RUN(.op = R_PERMUTE, .u.pm = *p);
}
static void g_gather(struct moe_backend *be, const float *src, const int32_t *idx, int n, int dim,
                     float *dst)
{
    REC_OR_RUN(.op = R_GATHER, .p = {src, idx}, .i = {n, dim}, .out = {dst});
}
static void g_grouped(struct moe_backend *be, const struct moe_grouped_matmul_params *p)
{
    /* host offsets without their device copies: CUDA would copy the host
     * arrays, which a capture cannot hold */
    if (G.recording && p->expert_offsets && (!p->expert_offsets_dev || !p->w_dev)) {
        G.broken = true;
        return;
    }
    REC_OR_RUN(.op = R_GROUPED, .u.gm = *p);
}
static void g_router_grouped(struct moe_backend *be, const struct moe_router_grouped_params *p)
{
    REC_OR_RUN(.op = R_ROUTER_GROUPED, .u.rg = *p);
}
static void g_add_rmsnorm(struct moe_backend *be, float *x, const float *r, const float *w,
                          float *y, int n, int dim, float eps)
{
    REC_OR_RUN(.op = R_ADD_RMSNORM, .out = {x, y}, .p = {r, w}, .i = {n, dim}, .f = {eps});
}
static void g_rope_kv(struct moe_backend *be, const struct moe_rope_kv_params *p)
{
    REC_OR_RUN(.op = R_ROPE_KV, .u.rk = *p);
}
static void g_swiglu(struct moe_backend *be, const float *gu, float *out, int n, int dim)
{
    REC_OR_RUN(.op = R_SWIGLU, .p = {gu}, .out = {out}, .i = {n, dim});
}
static void g_zero(struct moe_backend *be, void *p, size_t bytes)
{
    REC_OR_RUN(.op = R_ZERO, .out = {p}, .bytes = bytes);
}
static void g_combine(struct moe_backend *be, const float *rows, const float *w,
                      const int32_t *tok_rows, int n, int k, int dim, float *y)
{
    REC_OR_RUN(.op = R_COMBINE, .p = {rows, w, tok_rows}, .i = {n, k, dim}, .out = {y});
}
static void g_argmax(struct moe_backend *be, const float *logits, int n, int n_vocab, int32_t *ids)
{
    REC_OR_RUN(.op = R_ARGMAX, .p = {logits}, .i = {n, n_vocab}, .out = {ids});
}
static void g_copy_cols(struct moe_backend *be, float *dst, int ld_dst, const float *src,
                        int ld_src, int rows, int cols)
{
    REC_OR_RUN(.op = R_COPY_COLS, .out = {dst}, .p = {src}, .i = {ld_dst, ld_src, rows, cols});
}
static void g_scatter_add(struct moe_backend *be, const float *src, const int32_t *idx,
                          const float *scale, int n, int dim, float *dst)
{
    REC_OR_RUN(.op = R_SCATTER_ADD, .p = {src, idx, scale}, .i = {n, dim}, .out = {dst});
}
static void g_sigmoid(struct moe_backend *be, float *x, size_t n)
{
    REC_OR_RUN(.op = R_SIGMOID, .out = {x}, .bytes = n);
}
static void g_copy(struct moe_backend *be, void *dst, const void *src, size_t bytes)
{
    REC_OR_RUN(.op = R_COPY, .out = {dst}, .p = {src}, .bytes = bytes);
}
static void g_sample_rows(struct moe_backend *be, const float *logits, int n, int n_vocab,
                          const float *temp, const float *top_p, const double *u, int32_t *ids)
{
    REC_OR_RUN(.op = R_SAMPLE_ROWS, .p = {logits, temp, top_p, u}, .i = {n, n_vocab}, .out = {ids});
}
#undef REC_OR_RUN

/* What a capture cannot contain: recording fails, the op does nothing. */
static void g_upload(struct moe_backend *be, void *dst, const void *src, size_t bytes)
{
    if (G.recording)
        G.broken = true;
    else
        G.real->buf_upload(be, dst, src, bytes);
}
static void g_download(struct moe_backend *be, void *dst, const void *src, size_t bytes)
{
    if (G.recording)
        G.broken = true;
    else
        G.real->buf_download(be, dst, src, bytes);
}
static void g_sync(struct moe_backend *be)
{
    if (G.recording)
        G.broken = true;
    else
        G.real->synchronize(be);
}
static void *g_alloc(struct moe_backend *be, size_t bytes)
{
    if (G.recording) {
        G.broken = true;
        return NULL;
    }
    return G.real->buf_alloc(be, bytes);
}
static void g_free(struct moe_backend *be, void *p)
{
    if (G.recording)
        G.broken = true;
    else
        G.real->buf_free(be, p);
}

static int graph_find(uint64_t key)
{
    for (int i = 0; i < G.n_graphs; i++)
        if (G.g[i].key == key)
            return i;
    return -1;
}

static bool g_graph_launch(struct moe_backend *be, uint64_t key)
{
    int i = graph_find(key);
    if (i < 0 || !G.g[i].recs)
        return false;
    for (int j = 0; j < G.g[i].n; j++)
        rec_run(be, &G.g[i].recs[j]);
    G.launches++;
    return true;
}

static bool g_graph_begin(struct moe_backend *be, uint64_t key)
{
    (void)be;
    int i = graph_find(key);
    if (i < 0) { /* first sight */
        CHECK(G.n_graphs < GRAPH_SLOTS);
        if (G.n_graphs < GRAPH_SLOTS)
            G.g[G.n_graphs++].key = key;
        return false;
    }
    if (G.g[i].recs || G.g[i].failed)
        return false;
    G.recording = true;
    G.broken = false;
    G.n = 0;
    G.cur = i;
    return true;
}

static enum moe_status g_graph_end(struct moe_backend *be, struct moe_error *err)
{
    G.recording = false;
    if (G.broken) {
        G.g[G.cur].failed = true;
        G.failures++;
        return moe_error_set(err, MOE_ERR_UNSUPPORTED, "recording failed");
    }
    G.g[G.cur].recs = malloc((size_t)(G.n ? G.n : 1) * sizeof *G.buf);
    MOE_ASSERT(G.g[G.cur].recs != NULL);
    memcpy(G.g[G.cur].recs, G.buf, (size_t)G.n * sizeof *G.buf);
    G.g[G.cur].n = G.n;
    G.records++;
    return g_graph_launch(be, G.g[G.cur].key) ? MOE_OK : MOE_ERR_INTERNAL;
}

static void g_graph_reset(struct moe_backend *be)
{
    (void)be;
    for (int i = 0; i < G.n_graphs; i++)
        free(G.g[i].recs);
    memset(G.g, 0, sizeof G.g);
    G.n_graphs = 0;
}

/* off: the model loaded with no_graphs (--no-cuda-graphs): nothing is
 * recorded or launched though the backend offers graphs. */
static void test_graphs(struct moe_backend *be, const char *fixture, bool sampled, bool off)
{
    enum { N = 6, OUT = 24 };
    struct moe_backend_ops wrapped = *be->ops;
    memset(&G, 0, sizeof G);
    G.real = be->ops;
    wrapped.embed = g_embed;
    wrapped.rmsnorm = g_rmsnorm;
    wrapped.matmul = g_matmul;
    wrapped.rope = g_rope;
    wrapped.kv_write = g_kv_write;
    wrapped.attention = g_attention;
    wrapped.add = g_add;
    wrapped.router_topk = g_router;
    wrapped.router_topk_grouped = g_router_grouped;
    wrapped.add_rmsnorm = g_add_rmsnorm;
    wrapped.rope_kv_write = g_rope_kv;
    wrapped.permute = g_permute;
    wrapped.gather_rows = g_gather;
    wrapped.grouped_matmul = g_grouped;
    wrapped.swiglu = g_swiglu;
    wrapped.buf_zero = g_zero;
    wrapped.unpermute_combine = g_combine;
    wrapped.argmax = g_argmax;
    wrapped.copy_cols = g_copy_cols;
    wrapped.scatter_add_rows = g_scatter_add;
    wrapped.sigmoid = g_sigmoid;
    wrapped.buf_copy = g_copy;
    wrapped.sample_rows = g_sample_rows;
    wrapped.buf_upload = g_upload;
    wrapped.buf_download = g_download;
    wrapped.synchronize = g_sync;
    wrapped.buf_alloc = g_alloc;
    wrapped.buf_free = g_free;
    wrapped.graph_launch = g_graph_launch;
    wrapped.graph_begin = g_graph_begin;
    wrapped.graph_end = g_graph_end;
    wrapped.graph_reset = g_graph_reset;
    struct moe_model *m = NULL;
    struct moe_error err = {0};
    /* batch-invariant: a padding row must not move a real row's bits (as on
     * CUDA, whose decode GEMVs compute each row alone); the CPU's fast tiles
     * are otherwise chosen by row count */
    struct moe_model_opts mo = {.dtype = MOE_DTYPE_BF16,
                                .fast = true,
                                .batch_invariant = true,
                                .no_graphs = off,
                                .tp_size = 1};
    CHECKF(moe_model_load(test_src_path(fixture), &mo, be, &m, &err) == MOE_OK, "%s", err.msg);
    if (!m)
        return;
    const struct moe_config *c = moe_model_config(m);
    int n_stats = c->n_layer * c->n_expert;
    static struct capture runs[2];
    uint64_t *stats[2] = {calloc((size_t)n_stats, 8), calloc((size_t)n_stats, 8)};
    const int lens[N] = {5, 9, 3, 17, 7, 12};
    const int outs[N] = {OUT, OUT - 2, OUT - 4, OUT, OUT - 2, OUT - 4}; /* finishing apart */
    struct moe_model_profile prof[2];
    for (int run = 0; run < 2; run++) {
        be->ops = run ? &wrapped : G.real;
        memset(&runs[run], 0, sizeof runs[run]);
        /* a budget of 24 tokens a step: prompts in chunks, then decode at
         * batch 1..6 as requests join and finish */
        struct moe_engine_opts o = {.n_block = 64,
                                    .max_batch_tokens = 24,
                                    .forward_ids = true,
                                    .backend_sampling = sampled};
        struct moe_engine *e = NULL;
        CHECKF(moe_engine_create(m, NULL, &o, &e, &err) == MOE_OK, "%s", err.msg);
        if (!e)
            break;
        struct moe_model_profile p0;
        moe_model_profile(m, &p0);
        run_requests(e, m, N, lens, outs, 120, sampled, &runs[run], stats[run]);
        moe_engine_destroy(e);
        moe_model_profile(m, &prof[run]);
        prof[run].graphs_recorded -= p0.graphs_recorded;
        prof[run].graphs_replayed -= p0.graphs_replayed;
        prof[run].forwards -= p0.forwards;
    }
    be->ops = G.real;
    int same = 0;
    for (int i = 0; i < N; i++)
        same += runs[0].n[i] == outs[i] && runs[1].n[i] == runs[0].n[i] &&
                !memcmp(runs[0].tokens[i], runs[1].tokens[i], sizeof(int32_t) * runs[0].n[i]);
    CHECKF(same == N, "graphs (%s): %d of %d requests the same tokens with graphs", fixture, same,
           N);
    CHECKF(!memcmp(stats[0], stats[1], (size_t)n_stats * 8),
           "graphs (%s): the expert statistics differ with graphs", fixture);
    CHECKF(prof[0].graphs_recorded == 0 && prof[0].graphs_replayed == 0,
           "graphs (%s): the plain backend recorded %llu", fixture,
           (unsigned long long)prof[0].graphs_recorded);
    if (off)
        CHECKF(prof[1].graphs_recorded == 0 && prof[1].graphs_replayed == 0 && G.records == 0 &&
                   G.launches == 0,
               "graphs (%s): --no-cuda-graphs, yet %llu recorded, %d launches", fixture,
               (unsigned long long)prof[1].graphs_recorded, G.launches);
    else
        CHECKF(
            prof[1].graphs_recorded >= 1 && prof[1].graphs_replayed >= 12 &&
                G.records == (int)prof[1].graphs_recorded && G.launches >= G.records &&
                G.failures == 0,
            "graphs (%s): %llu recorded, %llu replayed (fake: %d recorded, %d launches, %d failed)",
            fixture, (unsigned long long)prof[1].graphs_recorded,
            (unsigned long long)prof[1].graphs_replayed, G.records, G.launches, G.failures);
    printf("graphs (%s%s): %llu forwards, %llu recorded, %llu replayed, %d keys; tokens and "
           "expert statistics as without graphs\n",
           fixture,
           sampled ? ", half the requests sampled"
           : off   ? ", --no-cuda-graphs"
                   : "",
           (unsigned long long)prof[1].forwards, (unsigned long long)prof[1].graphs_recorded,
           (unsigned long long)prof[1].graphs_replayed, G.n_graphs);
    g_graph_reset(be);
    free(G.buf);
    free(stats[0]);
    free(stats[1]);
    moe_model_free(m);
}

int main(void)
{
    struct moe_error err = {0};
    struct moe_backend *be = NULL;
    struct moe_tokenizer *tok = NULL;
    CHECKF(moe_backend_create("cpu", 0, &be, &err) == MOE_OK, "%s", err.msg);
    struct moe_model_opts mo = {.dtype = MOE_DTYPE_F32, .tp_size = 1};
    const char *dir = test_src_path("tests/golden/fixtures/qwen3_moe");
    CHECKF(moe_model_load(dir, &mo, be, &model, &err) == MOE_OK, "%s", err.msg);
    if (!model)
        return test_summary();
    vocab = moe_model_config(model)->vocab_size;
    CHECKF(moe_tokenizer_load(test_src_path("tests/golden/fixtures/qwen3_moe/tokenizer.json"), &tok,
                              &err) == MOE_OK,
           "%s", err.msg);
    test_bad_params();
    test_logprobs_and_penalties();
    test_batch_equals_alone();
    test_greedy_ids();
    test_backend_sampling();
    test_preemption();
    test_prefix_cache();
    test_seeded_sampling();
    if (tok) {
        test_stop_strings(tok);
        test_min_tokens(tok);
    }
    test_logit_bias();
    test_prompt_logprobs();
    test_random_workload();
    test_step_uploads(be);
    test_device_routing(be);
    test_graphs(be, "tests/golden/fixtures/mixtral", false, true); /* --no-cuda-graphs */
    test_graphs(be, "tests/golden/fixtures/qwen3_moe", false, false);
    test_graphs(be, "tests/golden/fixtures/mixtral", false, false);
    test_graphs(be, "tests/golden/fixtures/qwen2_moe", false,
                false); /* the shared gate's sigmoid */
    /* latent attention: its indexes and per-head offsets kept per step size on the backend */
    test_graphs(be, "tests/golden/fixtures/deepseek_v3", false, false);
    test_graphs(be, "tests/golden/fixtures/mixtral", true, false); /* sampled rows (sample_rows) */
    moe_model_free(model);
    /* DeepSeek-V3's latent cache (one row per token, K = V) through the same
     * scheduling: batches, preemption, prefix sharing */
    model = NULL;
    CHECKF(moe_model_load(test_src_path("tests/golden/fixtures/deepseek_v3"), &mo, be, &model,
                          &err) == MOE_OK,
           "%s", err.msg);
    if (model) {
        vocab = moe_model_config(model)->vocab_size;
        test_batch_equals_alone();
        test_preemption();
        test_prefix_cache();
        moe_model_free(model);
    }
    /* data-parallel attention's scheduling, on the Qwen3-MoE model */
    model = NULL;
    CHECKF(moe_model_load(dir, &mo, be, &model, &err) == MOE_OK, "%s", err.msg);
    if (model) {
        vocab = moe_model_config(model)->vocab_size;
        dp_parts = 2;
        printf("-- data-parallel attention, %d parts --\n", dp_parts);
        test_batch_equals_alone();
        CHECKF(dp.tokens_of[0] > 0 && dp.tokens_of[1] > 0, "tokens per part: %lld, %lld",
               (long long)dp.tokens_of[0], (long long)dp.tokens_of[1]);
        printf("batch: tokens run per part %lld, %lld\n", (long long)dp.tokens_of[0],
               (long long)dp.tokens_of[1]);
        test_preemption();
        test_prefix_cache();
        test_random_workload();
        dp_free();
        dp_parts = 1;
        moe_model_free(model);
    }
    moe_tokenizer_free(tok);
    moe_backend_destroy(be);
    return test_summary();
}
