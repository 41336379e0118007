/* Exact speculative decoding (engine opts.spec_tokens) on the tiny golden
 * models (f32, CPU), with n-gram drafts and, on Qwen3-MoE, with draft models
 * (engine/draft.h): the model itself (its guesses are nearly all kept: long
 * accepted runs) and the Qwen2-MoE fixture, another random model with the
 * same tokenizer (its guesses are nearly all rejected). Every comparison is
 * against the same engine with speculation off:
 *  - the n-gram proposer finds the most recent longest match and continues
 *    a short period into its own draft;
 *  - greedy: tokens and logprobs identical, alone and in a mixed batch of 8,
 *    and drafts were accepted (else the test proves nothing);
 *  - seeded sampling with temperature, top-k / top-p and penalties: identical;
 *  - max_tokens, a stop id and a stop string that fall inside a run of
 *    accepted drafts stop exactly where plain decoding stops;
 *  - a KV pool small enough to preempt, and a random submit / abort
 *    workload: pool invariants hold at every step, no block leaks, and every
 *    request that finished has the output plain decoding gives;
 *  - prefill_only sequences never speculate; bad spec_tokens are refused;
 *    a draft model needs spec_tokens and the model's vocabulary.
 * Seeded sampling gives the very tokens plain decoding gives (the draft is
 * a point mass and the target's draw decides: see engine.c seq_verify), so
 * the sampled distribution is the target's by construction; the test holds
 * the stronger property, token identity for every seed. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "engine/engine.h"
#include "engine/spec.h"
#include "testlib.h"

#define MAX_OUT 96

struct out {
    int32_t tokens[MAX_OUT];
    float logprob[MAX_OUT];
    float top_lp[MAX_OUT][3];
    int64_t step[MAX_OUT]; /* engine step that emitted the token */
    int n;
    enum moe_finish finish;
    int64_t text_len;
};

struct capture {
    struct out *o; /* (n_req) */
    int n_req;
};

static struct moe_model *model;
static struct moe_model *g_draft; /* set: every speculating engine drafts with it */
/* Drafts are expected to be kept (else a test that sees none proves
 * nothing); false for the draft whose guesses are all but never right. */
static bool g_expect_accept = true;
static struct moe_tokenizer *tok;
static int vocab;
static int64_t cur_step;

static void capture_init(struct capture *c, int n_req)
{
    c->o = calloc((size_t)n_req, sizeof *c->o);
    MOE_ASSERT(c->o);
    c->n_req = n_req;
}

static void capture_free(struct capture *c)
{
    free(c->o);
    c->o = NULL;
}

static void on_token(void *user, const struct moe_token_event *ev)
{
    struct capture *c = user;
    MOE_ASSERT(ev->req_id < (uint64_t)c->n_req);
    struct out *o = &c->o[ev->req_id];
    if (ev->token >= 0 && o->n < MAX_OUT) {
        o->tokens[o->n] = ev->token;
        o->logprob[o->n] = ev->logprob;
        for (int i = 0; i < ev->n_top && i < 3; i++)
            o->top_lp[o->n][i] = ev->top_logprobs[i];
        o->step[o->n] = cur_step;
        o->n++;
    }
    if (ev->finish) {
        o->finish = ev->finish;
        o->text_len = ev->text_len;
    }
}

static struct moe_engine *make_engine(struct moe_engine_opts o)
{
    struct moe_engine *e = NULL;
    struct moe_error err = {0};
    if (o.spec_tokens && g_draft)
        o.draft = g_draft;
    CHECKF(moe_engine_create(model, tok, &o, &e, &err) == MOE_OK, "%s", err.msg);
    return e;
}

/* Steps until idle; with `check`, the pool invariants after every step. */
static void run_to_end(struct moe_engine *e, bool check)
{
    struct moe_error err = {0}, cerr = {0};
    int guard = 0, bad = 0;
    while (moe_engine_busy(e) && guard++ < 100000) {
        cur_step++;
        if (moe_engine_step(e, NULL, &err) != MOE_OK) {
            CHECKF(false, "step failed: %s", err.msg);
            return;
        }
        if (check && moe_engine_check(e, &cerr) != MOE_OK && !bad++)
            fprintf(stderr, "invariant broken at step %lld: %s\n", (long long)cur_step, cerr.msg);
    }
    CHECK(!moe_engine_busy(e));
    CHECKF(bad == 0, "%d steps broke the pool invariants", bad);
}

/* Prompt i: even i repeat a short random pattern (drafts get accepted), odd
 * i are random. */
static int make_prompt(int i, int32_t *out, int cap)
{
    unsigned s = 1000u + (unsigned)i * 7919u;
    int len = 24 + (i * 13) % 24, period = 3 + i % 5;
    if (len > cap)
        len = cap;
    for (int j = 0; j < len; j++) {
        s = s * 1103515245u + 12345u;
        out[j] = i % 2 == 0 && j >= period ? out[j - period] : (int32_t)((s >> 8) % 700u);
    }
    return len;
}

struct run {
    struct capture c;
    struct moe_engine_stats st;
};

/* Submits requests [0, n) (prompt i with params p[i]) to a fresh engine
 * with opts `o` all at once (alone: one engine per request). */
static void run_set(struct moe_engine_opts o, int n, const struct moe_request_params *p, bool alone,
                    bool check, struct run *r)
{
    capture_init(&r->c, n);
    memset(&r->st, 0, sizeof r->st);
    struct moe_error err = {0};
    struct moe_engine *e = NULL;
    for (int i = 0; i < n; i++) {
        if (!e)
            e = make_engine(o);
        int32_t prompt[64];
        int len = make_prompt(i, prompt, 64);
        CHECKF(moe_engine_submit(e, (uint64_t)i, prompt, len, &p[i], on_token, &r->c, &err) ==
                   MOE_OK,
               "%s", err.msg);
        if (alone || i == n - 1) {
            run_to_end(e, check);
            struct moe_engine_stats st;
            moe_engine_stats(e, &st);
            CHECKF(st.kv_blocks_used == 0, "%d blocks still used", st.kv_blocks_used);
            r->st.steps += st.steps;
            r->st.preemptions += st.preemptions;
            r->st.spec_draft_tokens += st.spec_draft_tokens;
            r->st.spec_accepted_tokens += st.spec_accepted_tokens;
            r->st.generated_tokens += st.generated_tokens;
            moe_engine_destroy(e);
            e = NULL;
        }
    }
}

/* |a - b| relative to max(1, |b|): logprobs far below 0 carry the rounding
 * of a larger number. */
static double rel_diff(float a, float b)
{
    return fabs((double)a - b) / fmax(1.0, fabs((double)b));
}

/* Requests that differ in tokens, finish or (with logprobs) logprobs. */
static int count_diffs(const struct run *a, const struct run *b, bool logprobs, double *worst_lp)
{
    int diffs = 0;
    for (int i = 0; i < a->c.n_req; i++) {
        const struct out *x = &a->c.o[i], *y = &b->c.o[i];
        bool same = x->n == y->n && x->finish == y->finish && x->text_len == y->text_len &&
                    !memcmp(x->tokens, y->tokens, (size_t)x->n * sizeof *x->tokens);
        for (int j = 0; logprobs && same && j < x->n; j++) {
            *worst_lp = fmax(*worst_lp, rel_diff(x->logprob[j], y->logprob[j]));
            for (int t = 0; t < 3; t++)
                *worst_lp = fmax(*worst_lp, rel_diff(x->top_lp[j][t], y->top_lp[j][t]));
        }
        if (!same && diffs < 3) {
            fprintf(stderr, "request %d: %d tokens (finish %s) vs %d (finish %s); first:", i, x->n,
                    moe_finish_name(x->finish), y->n, moe_finish_name(y->finish));
            for (int j = 0; j < x->n && j < y->n; j++)
                if (x->tokens[j] != y->tokens[j]) {
                    fprintf(stderr, " differ at %d (%d vs %d)", j, x->tokens[j], y->tokens[j]);
                    break;
                }
            fputc('\n', stderr);
        }
        diffs += !same;
    }
    return diffs;
}

static void test_ngram_draft(void)
{
    int32_t d[8];
    /* longest suffix first: "2 3" last occurred at 1, "3" alone at 5 */
    int32_t a[] = {1, 2, 3, 9, 8, 3, 7, 2, 3};
    CHECK(spec_ngram_draft(a, 9, 3, d) == 3 && d[0] == 9 && d[1] == 8 && d[2] == 3);
    /* the most recent of two occurrences */
    int32_t b[] = {5, 6, 1, 5, 6, 2, 5, 6};
    CHECK(spec_ngram_draft(b, 8, 2, d) == 2 && d[0] == 2 && d[1] == 5);
    /* a period of 2 continues into the draft */
    int32_t c[] = {4, 7, 4, 7};
    CHECK(spec_ngram_draft(c, 4, 5, d) == 5 && d[0] == 4 && d[1] == 7 && d[2] == 4 && d[4] == 4);
    /* no earlier occurrence of the last token: no draft */
    int32_t n[] = {1, 2, 3, 4};
    CHECK(spec_ngram_draft(n, 4, 4, d) == 0);
    CHECK(spec_ngram_draft(n, 1, 4, d) == 0);
}

/* The draft length follows acceptance: up on full acceptance, to one past
 * the kept ones on partial, halved on none, and a rest at zero. */
static void test_adapt(void)
{
    int k = 4, cool = 0;
    spec_adapt(&k, &cool, 4, 4, 4);
    CHECK(k == 4 && cool == 0); /* all kept, at the cap */
    spec_adapt(&k, &cool, 4, 4, 1);
    CHECK(k == 2 && cool == 0); /* one kept: one more than that */
    spec_adapt(&k, &cool, 4, 2, 2);
    CHECK(k == 3);
    spec_adapt(&k, &cool, 4, 3, 0);
    CHECK(k == 1 && cool == 0); /* none kept: half */
    spec_adapt(&k, &cool, 4, 1, 0);
    CHECK(k == 1 && cool == MOE_SPEC_COOLDOWN); /* nothing pays: rest, then probe with one */
    spec_adapt(&k, &cool, 16, 1, 1);
    CHECK(k == 2);
    spec_adapt(&k, &cool, 1, 1, 1);
    CHECK(k == 1); /* never past k_max */
}

/* The cost model alone (spec.h), on step times chosen here. */
static void test_cost_model(void)
{
    struct spec_cost c = {0};
    CHECK(isnan(spec_cost_threshold(&c, 1, 1, 1, false)));
    CHECK(spec_cost_k(0.5, &c, 1, 1, false, 4) == 4); /* nothing measured: acceptance decides */
    spec_cost_step(&c, true, 1, 1, 1.0, 0);
    CHECK(isnan(spec_cost_threshold(&c, 1, 1, 1, false))); /* one size: no slope yet */
    spec_cost_step(&c, false, 9, 1, 50.0, 0);              /* a prompt chunk: not counted */
    CHECK(isnan(spec_cost_threshold(&c, 1, 1, 1, false)));
    /* T(n) = 0.9 + 0.1 n, one token a second (R = 1): a guess needs 0.1 */
    spec_cost_step(&c, true, 2, 1, 1.1, 0);
    spec_cost_step(&c, true, 3, 1, 1.2 + 0.5, 0.5); /* the draft's 0.5 s is not the step's */
    /* R: the tokens and seconds of the three decode steps, decayed by 0.95 a step */
    const double q = 0.95, r = (q * q + q + 1) / (q * q * 1.0 + q * 1.1 + 1.7);
    double thr = spec_cost_threshold(&c, 1, 1, 1, false);
    CHECKF(fabs(thr - 0.1 * r) < 1e-6, "threshold %g, want %g", thr, 0.1 * r);
    CHECK(spec_cost_k(0.5, &c, 1, 1, false, 4) == 3); /* 0.5, 0.25, 0.125 >= 0.078 > 0.0625 */
    CHECK(spec_cost_k(0.5, &c, 1, 1, false, 2) == 2);
    /* a draft model, its passes unmeasured: no threshold; then 0.3 s a pass */
    CHECK(isnan(spec_cost_threshold(&c, 1, 1, 1, true)) &&
          spec_cost_k(0.5, &c, 1, 1, true, 4) == 4);
    spec_cost_draft_pass(&c, 1, 0.3);
    CHECK(fabs(spec_cost_threshold(&c, 1, 1, 1, true) - 0.4 * r) < 1e-6);
    CHECK(spec_cost_k(0.5, &c, 1, 1, true, 4) == 1); /* 0.5 >= 0.31 > 0.25 */
    /* verify rows that cost whole steps (T(n) = n), then plain steps (R near
     * 1 token a second): nothing below certainty pays */
    struct spec_cost e = {0};
    for (int n = 3; n >= 1; n--)
        spec_cost_step(&e, true, n, 1, n, 0);
    for (int i = 0; i < 40; i++)
        spec_cost_step(&e, true, 1, 1, 1.0, 0);
    CHECK(spec_cost_k(0.9, &e, 1, 1, false, 4) == 0);
    /* free verify rows (T(n) = 1): every guess pays */
    struct spec_cost f = {0};
    for (int n = 1; n <= 3; n++)
        spec_cost_step(&f, true, n, 1, 1.0, 0);
    CHECK(spec_cost_k(0.05, &f, 1, 1, false, 4) == 4);
    /* batch 16: the fixed part is shared (T(16) = 1, T(17) = 1.06, 16 tokens
     * a second): a guess needs 16 x 0.06 = 0.96 */
    struct spec_cost g = {0};
    spec_cost_step(&g, true, 16, 16, 1.0, 0);
    spec_cost_step(&g, true, 17, 16, 1.06, 0);
    CHECK(spec_cost_k(0.9, &g, 16, 16, false, 4) == 0);
    CHECK(spec_cost_k(0.9, &g, 1, 1, false, 4) == 0); /* the nearest sizes stand in for batch 1 */
    /* a negative measured slope counts as free, never as a gain */
    struct spec_cost h = {0};
    spec_cost_step(&h, true, 1, 1, 1.0, 0);
    spec_cost_step(&h, true, 2, 1, 0.8, 0);
    CHECK(spec_cost_threshold(&h, 1, 1, 1, false) == 0);
    /* a first guess dearer than its gain, paid for by cheap later ones:
     * T(1..4) = 1, 2, 2.1, 2.2 at R = 1 token a second; alpha 0.9 gains
     * 0.9 - 1, then 0.81 - 0.1, 0.729 - 0.1: three guesses pay, one does not */
    struct spec_cost v = {0};
    const double tv[] = {1.0, 2.0, 2.1, 2.2};
    for (int i = 0; i < 40; i++)
        spec_cost_step(&v, true, 1 + i % 4, 1, tv[i % 4], 0);
    v.emit_n = v.emit_t = 1; /* R = 1 exactly */
    CHECK(spec_cost_k(0.9, &v, 1, 1, false, 3) == 3 && spec_cost_k(0.9, &v, 1, 1, false, 1) == 0);
    /* the acceptance estimate: (kept + 1/2) / (compared + 1), decayed by 0.95 */
    float acc = 0, tried = 0;
    CHECK(spec_alpha(acc, tried) == 0.5);
    spec_alpha_update(&acc, &tried, 4, 4); /* 4 kept of 4 compared */
    CHECK(acc == 4 && tried == 4 && fabs(spec_alpha(acc, tried) - 0.9) < 1e-6);
    spec_alpha_update(&acc, &tried, 4, 1); /* 1 kept, the second rejected: 2 compared */
    CHECK(fabs(acc - 4.8f) < 1e-5 && fabs(tried - 5.8f) < 1e-5);
}

/* The engine under the cost policy with a fake clock: each forward "takes"
 * a + b n seconds, so the costs, and the policy's choices, are the test's. */
static double g_fake_now, g_cost_a, g_cost_b;

static double fake_clock(void *ctx)
{
    (void)ctx;
    return g_fake_now;
}

static enum moe_status fake_forward(void *ctx, struct moe_model *m, struct moe_kv_cache *kv,
                                    const struct moe_batch *b, float *logits, struct moe_error *err)
{
    (void)ctx;
    g_fake_now += g_cost_a + g_cost_b * b->n_tok;
    return moe_model_forward(m, kv, b, logits, err);
}

static void params_greedy(struct moe_request_params *p, int n, int max_tokens);

static void test_cost_policy(void)
{
    enum { N = 8 };
    struct moe_request_params p[N];
    params_greedy(p, N, 48);
    struct moe_engine_opts o = {.n_block = 128,
                                .spec_tokens = 4,
                                .forward = fake_forward,
                                .forward_ids = true,
                                .clock = fake_clock};
    struct run plain, acc, free_rows, dear_rows;
    run_set((struct moe_engine_opts){.n_block = 128}, N, p, false, false, &plain);
    run_set(o, N, p, false, true, &acc);
    o.spec_cost = true;
    g_cost_a = 1.0, g_cost_b = 0; /* verify rows free: every guess acceptance allows */
    run_set(o, N, p, false, true, &free_rows);
    g_cost_a = 0.01, g_cost_b = 1.0; /* a verify token costs a whole step: guesses stop */
    run_set(o, N, p, false, true, &dear_rows);
    double lp = 0;
    CHECKF(count_diffs(&acc, &plain, true, &lp) == 0 &&
               count_diffs(&free_rows, &plain, true, &lp) == 0 &&
               count_diffs(&dear_rows, &plain, true, &lp) == 0 && lp < 1e-4,
           "cost policy: outputs differ from plain decoding (worst logprob %g)", lp);
    CHECKF(free_rows.st.spec_draft_tokens == acc.st.spec_draft_tokens &&
               free_rows.st.steps == acc.st.steps,
           "free verify rows: %lld drafts in %lld steps, acceptance alone %lld in %lld",
           (long long)free_rows.st.spec_draft_tokens, (long long)free_rows.st.steps,
           (long long)acc.st.spec_draft_tokens, (long long)acc.st.steps);
    CHECKF(acc.st.spec_draft_tokens > 0 &&
               dear_rows.st.spec_draft_tokens * 4 < acc.st.spec_draft_tokens,
           "dear verify rows: %lld drafts, acceptance alone %lld",
           (long long)dear_rows.st.spec_draft_tokens, (long long)acc.st.spec_draft_tokens);
    printf("-- cost policy: drafts %lld (acceptance alone), %lld (free verify rows), %lld (a "
           "verify token costs a step)\n",
           (long long)acc.st.spec_draft_tokens, (long long)free_rows.st.spec_draft_tokens,
           (long long)dear_rows.st.spec_draft_tokens);
    capture_free(&plain.c);
    capture_free(&acc.c);
    capture_free(&free_rows.c);
    capture_free(&dear_rows.c);
}

static void params_greedy(struct moe_request_params *p, int n, int max_tokens)
{
    for (int i = 0; i < n; i++) {
        moe_request_params_init(&p[i]);
        p[i].max_tokens = max_tokens;
        p[i].ignore_eos = true;
        p[i].logprobs = 3;
    }
}

static void test_greedy(const char *name)
{
    enum { N = 8 };
    struct moe_request_params p[N];
    params_greedy(p, N, 48);
    struct moe_engine_opts plain = {.n_block = 128}, spec = {.n_block = 128, .spec_tokens = 4};
    struct run ra, rb, sa, sb;
    run_set(plain, N, p, true, false, &ra);
    run_set(spec, N, p, true, true, &sa);
    run_set(plain, N, p, false, false, &rb);
    run_set(spec, N, p, false, true, &sb);
    double lp_alone = 0, lp_batch = 0;
    int d_alone = count_diffs(&ra, &sa, true, &lp_alone);
    int d_batch = count_diffs(&rb, &sb, true, &lp_batch);
    CHECKF(d_alone == 0 && d_batch == 0, "%s greedy: %d alone and %d batched requests differ", name,
           d_alone, d_batch);
    CHECKF(lp_alone <= 1e-5 && lp_batch <= 1e-5, "%s logprobs differ by %.3g / %.3g", name,
           lp_alone, lp_batch);
    CHECKF(!g_expect_accept || (sa.st.spec_accepted_tokens > 0 && sb.st.spec_accepted_tokens > 0),
           "%s: no draft accepted (alone %lld, batch %lld)", name,
           (long long)sa.st.spec_accepted_tokens, (long long)sb.st.spec_accepted_tokens);
    CHECKF(sa.st.steps + sa.st.spec_accepted_tokens == ra.st.steps,
           "%s alone: %lld steps + %lld accepted != %lld plain steps", name, (long long)sa.st.steps,
           (long long)sa.st.spec_accepted_tokens, (long long)ra.st.steps);
    CHECK(ra.st.spec_draft_tokens == 0);
    printf("%s greedy: alone %lld -> %lld steps, batch of %d %lld -> %lld steps; drafts %lld / "
           "%lld accepted; logprob diff %.2g\n",
           name, (long long)ra.st.steps, (long long)sa.st.steps, N, (long long)rb.st.steps,
           (long long)sb.st.steps, (long long)sb.st.spec_accepted_tokens,
           (long long)sb.st.spec_draft_tokens, fmax(lp_alone, lp_batch));
    struct run *all[] = {&ra, &rb, &sa, &sb};
    for (int i = 0; i < 4; i++)
        capture_free(&all[i]->c);
}

static void test_sampling(void)
{
    enum { N = 8 };
    struct moe_request_params p[N];
    params_greedy(p, N, 48);
    for (int i = 0; i < N; i++) {
        p[i].sp.temperature = i % 4 == 0 ? 0.3f : 0.8f;
        p[i].sp.top_k = i % 2 ? 20 : 0;
        p[i].sp.top_p = i % 3 ? 0.9f : 0.0f;
        p[i].sp.min_p = i == 5 ? 0.05f : 0.0f;
        p[i].sp.repetition_penalty = i % 4 == 1 ? 1.2f : 0.0f;
        p[i].sp.presence_penalty = i == 6 ? 0.5f : 0.0f;
        p[i].sp.frequency_penalty = i == 7 ? 0.3f : 0.0f;
        p[i].has_seed = true;
        p[i].seed = 100 + (uint64_t)i;
    }
    struct run plain, spec;
    run_set((struct moe_engine_opts){.n_block = 128, .max_batch_tokens = 64}, N, p, false, false,
            &plain);
    run_set((struct moe_engine_opts){.n_block = 128, .max_batch_tokens = 64, .spec_tokens = 4}, N,
            p, false, true, &spec);
    double lp = 0;
    int d = count_diffs(&plain, &spec, true, &lp);
    CHECKF(d == 0, "seeded sampling: %d of %d requests differ", d, N);
    CHECKF(lp <= 1e-5, "seeded sampling logprobs differ by %.3g", lp);
    CHECKF(!g_expect_accept || spec.st.spec_accepted_tokens > 0,
           "sampling: no draft accepted of %lld", (long long)spec.st.spec_draft_tokens);
    printf("seeded sampling: %d/%d identical, %lld -> %lld steps, drafts %lld / %lld accepted\n",
           N - d, N, (long long)plain.st.steps, (long long)spec.st.steps,
           (long long)spec.st.spec_accepted_tokens, (long long)spec.st.spec_draft_tokens);
    capture_free(&plain.c);
    capture_free(&spec.c);
}

/* Output index c lies inside an accepted run when token c + 1 came out of
 * the same speculative step. */
static bool mid_run(const struct out *o, int c)
{
    return c + 1 < o->n && o->step[c] == o->step[c + 1];
}

/* Runs `prompt` with `p` alone, plainly (into *plain) and speculatively
 * (into *spec, pool invariants checked every step). */
static void run_pair(const int32_t *prompt, int len, const struct moe_request_params *p,
                     struct out *plain, struct out *spec)
{
    struct moe_error err = {0};
    for (int s = 0; s < 2; s++) {
        struct capture c;
        capture_init(&c, 1);
        struct moe_engine *e =
            make_engine((struct moe_engine_opts){.n_block = 64, .spec_tokens = s ? 4 : 0});
        CHECK(moe_engine_submit(e, 0, prompt, len, p, on_token, &c, &err) == MOE_OK);
        run_to_end(e, s == 1);
        moe_engine_destroy(e);
        *(s ? spec : plain) = c.o[0];
        capture_free(&c);
    }
}

/* True when a plain and a speculative run agree and both stop after `n`. */
static bool stops_same(const int32_t *prompt, int len, const struct moe_request_params *p, int n)
{
    struct out x, y;
    run_pair(prompt, len, p, &x, &y);
    return x.n == n && y.n == n && x.finish == y.finish && x.text_len == y.text_len &&
           !memcmp(x.tokens, y.tokens, (size_t)n * sizeof *x.tokens);
}

/* Tries a stop string: the printable ASCII text that token c adds, if it
 * occurs nowhere earlier in the output text. Returns -1 if there is none,
 * else 1 when the plain and speculative runs agree and stop at c. */
static int try_stop_string(const int32_t *prompt, int len, const struct moe_request_params *base,
                           const struct out *o, int c)
{
    char *head = NULL, *full = NULL;
    size_t hl = 0, fl = 0;
    int result = -1;
    moe_tokenizer_decode(tok, o->tokens, (size_t)c, true, &head, &hl, NULL);
    moe_tokenizer_decode(tok, o->tokens, (size_t)c + 1, true, &full, &fl, NULL);
    bool ascii = head && full && fl > hl && fl - hl <= MOE_MAX_STOP_LEN && !memcmp(head, full, hl);
    for (size_t j = hl; ascii && j < fl; j++)
        ascii = full[j] > ' ' && (unsigned char)full[j] < 0x7f;
    if (ascii) {
        struct moe_request_params q = *base;
        q.n_stop_strings = 1;
        memcpy(q.stop_strings[0], full + hl, fl - hl);
        q.stop_strings[0][fl - hl] = 0;
        if (strstr(full, q.stop_strings[0]) == full + hl)
            result = stops_same(prompt, len, &q, c + 1);
    }
    free(head);
    free(full);
    return result;
}

/* max_tokens, a stop id and a stop string that fall inside a run of
 * accepted drafts. The prompts are a random prompt followed by the first h
 * tokens the model generates after it: greedy decoding then continues the
 * same output, and tokens generated first now can be drafted from the
 * prompt, so a stop id can sit inside an accepted run. */
static void test_stops(void)
{
    enum { OUT = 40 };
    struct moe_request_params p;
    moe_request_params_init(&p);
    p.max_tokens = OUT;
    p.ignore_eos = true;
    int n_len = 0, n_id = 0, n_str = 0, bad = 0;
    /* under ThreadSanitizer (20x slower) 3 prompts of the 8: the same code */
    const char *san = getenv("MOE_TEST_SANITIZER");
    int n_prompts = san && !strcmp(san, "thread") ? 3 : 8;
    for (int i = 0; i < n_prompts; i++) {
        int32_t prompt[64 + OUT];
        int len0 = make_prompt(i, prompt, 64);
        struct out first, spec;
        run_pair(prompt, len0, &p, &first, &spec);
        for (int h = 8; h <= 24; h += 8) {
            int len = len0 + h;
            memcpy(prompt + len0, first.tokens, (size_t)h * sizeof *prompt);
            struct out o, unused;
            run_pair(prompt, len, &p, &unused, &o);
            for (int c = 0; c < o.n; c++) {
                if (!mid_run(&o, c))
                    continue;
                struct moe_request_params q = p;
                q.max_tokens = c + 1;
                if (n_len < 12) {
                    bad += !stops_same(prompt, len, &q, c + 1);
                    n_len++;
                }
                bool first_time = true;
                for (int j = 0; j < c; j++)
                    first_time = first_time && o.tokens[j] != o.tokens[c];
                if (first_time && n_id < 24) {
                    q = p;
                    q.n_stop_ids = 1;
                    q.stop_ids[0] = o.tokens[c];
                    bad += !stops_same(prompt, len, &q, c + 1);
                    n_id++;
                }
                int r = n_str < 24 ? try_stop_string(prompt, len, &p, &o, c) : -1;
                if (r >= 0) {
                    bad += !r;
                    n_str++;
                }
            }
        }
    }
    CHECKF(bad == 0, "%d stops inside accepted runs changed the output", bad);
    CHECKF(!g_expect_accept || (n_len > 0 && n_id > 0 && n_str > 0),
           "stops inside accepted runs tried: max_tokens %d, stop id %d, stop string %d", n_len,
           n_id, n_str);
    printf("stops inside accepted runs: max_tokens %d, stop ids %d, stop strings %d, all exact\n",
           n_len, n_id, n_str);
}

static void test_preemption(void)
{
    enum { N = 8 };
    struct moe_request_params p[N];
    params_greedy(p, N, 40);
    struct run big, small;
    run_set((struct moe_engine_opts){.n_block = 256, .block_size = 4}, N, p, false, false, &big);
    /* 24 blocks of 4 tokens: the largest request alone needs 22 */
    run_set((struct moe_engine_opts){.n_block = 24, .block_size = 4, .spec_tokens = 4}, N, p, false,
            true, &small);
    double lp = 0;
    int d = count_diffs(&big, &small, true, &lp);
    CHECKF(d == 0 && lp <= 1e-5, "under preemption: %d requests differ, logprobs by %.3g", d, lp);
    CHECKF(small.st.preemptions > 0, "preemptions %lld", (long long)small.st.preemptions);
    CHECKF(!g_expect_accept || small.st.spec_accepted_tokens > 0, "no draft accepted of %lld",
           (long long)small.st.spec_draft_tokens);
    printf("preemption with speculation: %lld preemptions, %d/%d identical, drafts %lld / %lld "
           "accepted\n",
           (long long)small.st.preemptions, N - d, N, (long long)small.st.spec_accepted_tokens,
           (long long)small.st.spec_draft_tokens);
    capture_free(&big.c);
    capture_free(&small.c);
}

/* Random submits and aborts into a small pool with speculation on; every
 * request that finished is then run again plainly in one batch and must
 * give the same output. */
/* by_cost: under --spec-policy cost, with the fake clock of test_cost_policy
 * (each forward 0.3 + 0.1 n seconds: guesses pay for some sequences at some
 * batch sizes, not for others), so the policy's every branch runs under
 * preemption, aborts and prefix hits. */
static void test_random_workload(int n_steps, bool by_cost)
{
    /* under ThreadSanitizer (tests/run.sh; 20x slower) a fifth: the races it
     * looks for are in the thread pool every step uses */
    const char *san = getenv("MOE_TEST_SANITIZER");
    if (san && !strcmp(san, "thread"))
        n_steps /= 5;
    enum { SLOTS = 48, MAX_SUB = 2048 };
    struct moe_engine_opts o = {
        .n_block = 40, .block_size = 4, .max_batch_tokens = 32, .max_running = 6, .spec_tokens = 4};
    if (by_cost) {
        o.spec_cost = true;
        o.forward = fake_forward;
        o.forward_ids = true;
        o.clock = fake_clock;
        g_cost_a = 0.3;
        g_cost_b = 0.1;
    }
    struct moe_engine *e = make_engine(o);
    struct capture c;
    capture_init(&c, MAX_SUB);
    struct moe_request_params *params = calloc(MAX_SUB, sizeof *params);
    int *prompt_of = calloc(MAX_SUB, sizeof *prompt_of);
    bool *aborted = calloc(MAX_SUB, sizeof *aborted);
    MOE_ASSERT(params && prompt_of && aborted);
    struct moe_error err = {0}, cerr = {0};
    unsigned seed = 99;
    int submitted = 0, bad = 0;
    int slot[SLOTS];
    for (int s = 0; s < SLOTS; s++)
        slot[s] = -1;
    for (int steps = 0; steps < n_steps; steps++) {
        int op = rand_r(&seed) % 8, s = rand_r(&seed) % SLOTS;
        bool free_slot = slot[s] < 0 || c.o[slot[s]].finish;
        if (op < 3 && free_slot && submitted < MAX_SUB) {
            int r = submitted;
            struct moe_request_params *p = &params[r];
            moe_request_params_init(p);
            p->max_tokens = 1 + rand_r(&seed) % 40;
            p->ignore_eos = rand_r(&seed) % 2;
            p->sp.temperature = (float)(rand_r(&seed) % 3) * 0.4f;
            p->sp.repetition_penalty = rand_r(&seed) % 4 == 0 ? 1.3f : 0.0f;
            p->has_seed = true;
            p->seed = (uint64_t)rand_r(&seed);
            prompt_of[r] = rand_r(&seed) % 6; /* few distinct prompts: prefix hits */
            int32_t prompt[64];
            int len = make_prompt(prompt_of[r], prompt, 64);
            if (moe_engine_submit(e, (uint64_t)r, prompt, len, p, on_token, &c, &err) == MOE_OK) {
                slot[s] = r;
                submitted++;
            }
        } else if (op == 3 && !free_slot) {
            moe_engine_abort(e, (uint64_t)slot[s]);
            aborted[slot[s]] = true;
        }
        cur_step++;
        CHECK(moe_engine_step(e, NULL, &err) == MOE_OK);
        if (moe_engine_check(e, &cerr) != MOE_OK && !bad++)
            fprintf(stderr, "invariant broken: %s\n", cerr.msg);
    }
    run_to_end(e, true);
    CHECKF(bad == 0, "%d steps broke the pool invariants", bad);
    struct moe_engine_stats st;
    moe_engine_stats(e, &st);
    CHECKF(st.kv_blocks_used == 0 && st.kv_blocks_free + st.kv_blocks_cached == 40,
           "blocks used %d free %d cached %d", st.kv_blocks_used, st.kv_blocks_free,
           st.kv_blocks_cached);
    CHECKF(st.finished + st.aborted == submitted, "finished %lld + aborted %lld != submitted %d",
           (long long)st.finished, (long long)st.aborted, submitted);
    CHECK(st.aborted > 0 && st.preemptions > 0 &&
          (!g_expect_accept || st.spec_accepted_tokens > 0));
    CHECK(st.spec_draft_tokens > 0);
    moe_engine_destroy(e);

    /* the finished ones again, plainly, in one big engine */
    struct capture ref;
    capture_init(&ref, MAX_SUB);
    e = make_engine((struct moe_engine_opts){.n_block = 4096, .block_size = 4});
    int n_ref = 0;
    for (int r = 0; r < submitted; r++) {
        if (c.o[r].finish == MOE_FINISH_ABORT)
            continue;
        int32_t prompt[64];
        int len = make_prompt(prompt_of[r], prompt, 64);
        CHECK(moe_engine_submit(e, (uint64_t)r, prompt, len, &params[r], on_token, &ref, &err) ==
              MOE_OK);
        n_ref++;
    }
    run_to_end(e, false);
    moe_engine_destroy(e);
    int differ = 0;
    for (int r = 0; r < submitted; r++) {
        const struct out *x = &c.o[r], *y = &ref.o[r];
        if (x->finish == MOE_FINISH_ABORT)
            continue;
        differ += x->n != y->n || x->finish != y->finish ||
                  memcmp(x->tokens, y->tokens, (size_t)x->n * sizeof *x->tokens);
    }
    CHECKF(differ == 0, "%d of %d finished requests differ from plain decoding", differ, n_ref);
    printf("random workload with speculation%s: %d submitted, %lld aborted, %lld preemptions, %d "
           "finished identical to plain, drafts %lld / %lld accepted, prefix hits %lld\n",
           by_cost ? " (cost policy)" : "", submitted, (long long)st.aborted,
           (long long)st.preemptions, n_ref - differ, (long long)st.spec_accepted_tokens,
           (long long)st.spec_draft_tokens, (long long)st.prefix_hit_tokens);
    capture_free(&c);
    capture_free(&ref);
    free(params);
    free(prompt_of);
    free(aborted);
}

static int64_t parked_kv, parked_tokens, parked_blocks;

static void on_parked(void *user, const struct moe_token_event *ev)
{
    (void)user;
    if (ev->parked) {
        parked_kv = ev->parked->n_kv_tokens;
        parked_tokens = ev->parked->n_tokens;
        parked_blocks = ev->parked->n_blocks;
    }
}

static void test_prefill_only_and_options(void)
{
    struct moe_engine *e = make_engine((struct moe_engine_opts){.n_block = 64, .spec_tokens = 8});
    struct moe_request_params p;
    moe_request_params_init(&p);
    p.max_tokens = 32;
    p.ignore_eos = true;
    p.prefill_only = true;
    int32_t prompt[64];
    int len = make_prompt(0, prompt, 64); /* repetitive: a draft would be found */
    struct moe_error err = {0};
    CHECK(moe_engine_submit(e, 7, prompt, len, &p, on_parked, NULL, &err) == MOE_OK);
    for (int i = 0; i < 4; i++)
        CHECK(moe_engine_step(e, NULL, &err) == MOE_OK);
    struct moe_engine_stats st;
    moe_engine_stats(e, &st);
    CHECKF(st.parked == 1 && st.spec_draft_tokens == 0, "parked %d, drafts %lld", st.parked,
           (long long)st.spec_draft_tokens);
    CHECK(parked_tokens == len + 1 && parked_kv == len && parked_blocks == (len + 15) / 16);
    moe_engine_abort(e, 7);
    run_to_end(e, true);
    moe_engine_destroy(e);

    struct moe_engine_opts o = {.n_block = 8, .spec_tokens = MOE_SPEC_TOKENS_MAX + 1};
    e = NULL;
    CHECK(moe_engine_create(model, NULL, &o, &e, &err) == MOE_ERR_INVALID && !e);
    CHECKF(strstr(err.msg, "--spec-tokens") != NULL, "%s", err.msg);
    o.spec_tokens = -1;
    CHECK(moe_engine_create(model, NULL, &o, &e, &err) == MOE_ERR_INVALID && !e);
}

/* spec_max_batch: no drafts while more rows decode; outputs unchanged. */
static void test_max_batch(void)
{
    enum { N = 8 };
    struct moe_request_params p[N];
    params_greedy(p, N, 24);
    for (int i = 0; i < N; i++)
        p[i].max_tokens = 8 + 4 * i; /* they finish one by one */
    struct run plain, all, few;
    run_set((struct moe_engine_opts){.n_block = 128}, N, p, false, false, &plain);
    run_set((struct moe_engine_opts){.n_block = 128, .spec_tokens = 4}, N, p, false, true, &all);
    run_set((struct moe_engine_opts){.n_block = 128, .spec_tokens = 4, .spec_max_batch = 2}, N, p,
            false, true, &few);
    double lp = 0;
    int d = count_diffs(&plain, &few, true, &lp) + count_diffs(&plain, &all, true, &lp);
    CHECKF(d == 0, "spec_max_batch: %d requests differ", d);
    CHECKF(few.st.spec_draft_tokens > 0 && few.st.spec_draft_tokens < all.st.spec_draft_tokens,
           "spec_max_batch 2: %lld drafts, unlimited %lld", (long long)few.st.spec_draft_tokens,
           (long long)all.st.spec_draft_tokens);
    printf("spec_max_batch 2: %lld drafts (unlimited: %lld), outputs identical\n",
           (long long)few.st.spec_draft_tokens, (long long)all.st.spec_draft_tokens);
    capture_free(&plain.c);
    capture_free(&all.c);
    capture_free(&few.c);
}

/* A draft model without spec_tokens, or with another vocabulary, is
 * refused by name. */
static void test_draft_refusals(struct moe_backend *be)
{
    struct moe_error err = {0};
    struct moe_model *other = NULL;
    struct moe_model_opts mo = {.dtype = MOE_DTYPE_F32, .tp_size = 1};
    CHECKF(moe_model_load(test_src_path("tests/golden/fixtures/mixtral"), &mo, be, &other, &err) ==
               MOE_OK,
           "%s", err.msg);
    struct moe_engine_opts o = {.n_block = 8, .draft = model};
    struct moe_engine *e = NULL;
    CHECK(moe_engine_create(model, NULL, &o, &e, &err) == MOE_ERR_INVALID && !e);
    CHECKF(strstr(err.msg, "--spec-tokens") != NULL, "%s", err.msg);
    o.spec_tokens = 4;
    o.draft = other;
    CHECK(moe_engine_create(model, NULL, &o, &e, &err) == MOE_ERR_INVALID && !e);
    CHECKF(strstr(err.msg, "vocabulary") != NULL, "%s", err.msg);
    moe_model_free(other);
}

/* The battery again with a draft model proposing. */
static void draft_battery(struct moe_backend *be, const char *fixture, const char *what,
                          bool expect_accept)
{
    g_expect_accept = expect_accept;
    struct moe_error err = {0};
    struct moe_model_opts mo = {.dtype = MOE_DTYPE_F32, .tp_size = 1};
    char rel[128];
    snprintf(rel, sizeof rel, "tests/golden/fixtures/%s", fixture);
    CHECKF(moe_model_load(test_src_path(rel), &mo, be, &g_draft, &err) == MOE_OK, "%s", err.msg);
    if (!g_draft)
        return;
    printf("-- draft model: %s (%s)\n", fixture, what);
    char name[96];
    snprintf(name, sizeof name, "qwen3_moe, %s draft", fixture);
    test_greedy(name);
    if (expect_accept) { /* the kept runs: sampling, stops inside them, preemption */
        test_sampling();
        test_stops();
        test_preemption();
    }
    test_random_workload(600, false); /* shorter: sanitizer passes run this too */
    moe_model_free(g_draft);
    g_draft = NULL;
    g_expect_accept = true;
}

int main(void)
{
    struct moe_error err = {0};
    struct moe_backend *be = NULL;
    CHECKF(moe_backend_create("cpu", 0, &be, &err) == MOE_OK, "%s", err.msg);
    struct moe_model_opts mo = {.dtype = MOE_DTYPE_F32, .tp_size = 1};
    test_ngram_draft();
    test_adapt();
    test_cost_model();
    const char *fixtures[] = {"qwen3_moe", "mixtral"};
    for (int f = 0; f < 2 && be; f++) {
        char rel[128];
        snprintf(rel, sizeof rel, "tests/golden/fixtures/%s", fixtures[f]);
        CHECKF(moe_model_load(test_src_path(rel), &mo, be, &model, &err) == MOE_OK, "%s", err.msg);
        if (!model)
            break;
        vocab = moe_model_config(model)->vocab_size;
        snprintf(rel, sizeof rel, "tests/golden/fixtures/%s/tokenizer.json", fixtures[f]);
        CHECKF(moe_tokenizer_load(test_src_path(rel), &tok, &err) == MOE_OK, "%s", err.msg);
        test_greedy(fixtures[f]);
        if (f == 0 && tok) {
            test_sampling();
            test_stops();
            test_preemption();
            test_random_workload(2500, false);
            test_random_workload(1500, true);
            test_prefill_only_and_options();
            test_max_batch();
            test_cost_policy();
            test_draft_refusals(be);
            draft_battery(be, "qwen3_moe", "the model itself: guesses kept", true);
            /* the ThreadSanitizer pass (tests/run.sh) skips the second: the
             * same code with every guess rejected, and TSan is 20x slower */
            const char *san = getenv("MOE_TEST_SANITIZER");
            if (!san || strcmp(san, "thread"))
                draft_battery(be, "qwen2_moe", "another model: guesses rejected", false);
            else
                printf("-- draft model: qwen2_moe battery skipped under ThreadSanitizer\n");
        }
        moe_tokenizer_free(tok);
        tok = NULL;
        moe_model_free(model);
        model = NULL;
    }
    moe_backend_destroy(be);
    return test_summary();
}
