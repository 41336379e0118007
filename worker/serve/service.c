#include "serve/service.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/generate.h"
#include "disagg/kv_handoff.h"
#include "model_info.h"
#include "moe/v1/worker.pb-c.h"
#include "request_check.h"
#include "rpc.h"
#include "test_fault.h"
#include "tls_opts.h"

/* One Generate call in flight. Freed by the engine thread after the final
 * event, under ws->mu, so a handler holding ws->mu can still touch it. */
struct req {
    struct worker_service *ws;
    struct rpc_stream *stream;
    uint64_t id; /* engine id */
    char request_id[MOE_REQ_MAX_ID_LEN + 1];
    double t_recv, t_first, t_last;
    double deadline; /* moe_now() seconds; 0: none */
    bool deadline_hit;
    bool aborted_by_deadline;
    bool want_logprobs;
    int n_out;     /* tokens of the output so far (incl. handed-off ones) */
    int n_emitted; /* tokens this worker sent */
    char handoff_id[KV_HANDOFF_ID_MAX];
    struct req *prev, *next;
};

struct worker_service {
    struct moe_engine *engine;
    struct moe_model *model;
    struct moe_tokenizer *tok;
    const struct moe_config *cfg;
    struct rpc_server *server;
    char model_name[256];
    char dtype_name[16];
    int world_size, tp_size, role;
    struct moe_group *group;
    struct kv_handoff *handoffs; /* KV handoff table (NULL: no backend given) */

    pthread_t thread;
    bool thread_started;
    pthread_mutex_t mu; /* guards the fields below and the req list */
    pthread_cond_t wake;
    bool stop;
    bool draining;
    int pending; /* submissions since the engine thread last looked */
    uint64_t next_id;
    struct req *reqs; /* doubly linked list of calls in flight */
    int n_reqs;
};

/* ---- engine thread --------------------------------------------------------------- */

static void req_unlink(struct worker_service *ws, struct req *r)
{
    if (r->prev)
        r->prev->next = r->next;
    else
        ws->reqs = r->next;
    if (r->next)
        r->next->prev = r->prev;
    ws->n_reqs--;
}

static Moe__V1__FinishReason finish_reason(enum moe_finish f)
{
    switch (f) {
    case MOE_FINISH_LENGTH: return MOE__V1__FINISH_REASON__FINISH_REASON_LENGTH;
    case MOE_FINISH_STOP: return MOE__V1__FINISH_REASON__FINISH_REASON_STOP;
    case MOE_FINISH_ABORT: return MOE__V1__FINISH_REASON__FINISH_REASON_ABORT;
    case MOE_FINISH_ERROR: return MOE__V1__FINISH_REASON__FINISH_REASON_ERROR;
    default: return MOE__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
    }
}

/* The prompt's ids and log-probabilities (sampling.prompt_logprobs) of a
 * first token's message, in heap arrays freed once it is packed. */
struct prompt_lp_msg {
    uint32_t *ids;
    Moe__V1__TokenLogprob *lp, **lpp;
    Moe__V1__TopLogprob *top, **topp;
};

static void prompt_lp_free(struct prompt_lp_msg *m)
{
    free(m->ids);
    free(m->lp);
    free(m->lpp);
    free(m->top);
    free(m->topp);
}

static void prompt_lp_fill(struct prompt_lp_msg *m, const struct moe_token_event *ev,
                           Moe__V1__GenerateResponse *resp)
{
    size_t n = (size_t)ev->n_prompt, n_lp = ev->prompt_logprobs && n > 1 ? n - 1 : 0;
    m->ids = malloc(n * sizeof *m->ids);
    if (n_lp) {
        m->lp = calloc(n_lp, sizeof *m->lp);
        m->lpp = calloc(n_lp, sizeof *m->lpp);
        m->top = calloc(n_lp * MOE_MAX_LOGPROBS, sizeof *m->top);
        m->topp = calloc(n_lp * MOE_MAX_LOGPROBS, sizeof *m->topp);
    }
    if (!m->ids || (n_lp && (!m->lp || !m->lpp || !m->top || !m->topp))) {
        fprintf(stderr, "moe-worker: out of memory for %zu prompt log-probabilities\n", n);
        return;
    }
    for (size_t i = 0; i < n; i++)
        m->ids[i] = (uint32_t)ev->prompt_tokens[i];
    for (size_t i = 0; i < n_lp; i++) {
        const struct moe_prompt_logprob *src = &ev->prompt_logprobs[i + 1];
        Moe__V1__TokenLogprob *d = &m->lp[i];
        moe__v1__token_logprob__init(d);
        d->token_id = m->ids[i + 1];
        d->logprob = src->logprob;
        d->rank = (uint32_t)src->rank;
        d->n_top = (size_t)src->n_top;
        d->top = m->topp + i * MOE_MAX_LOGPROBS;
        for (int k = 0; k < src->n_top; k++) {
            Moe__V1__TopLogprob *t = &m->top[i * MOE_MAX_LOGPROBS + (size_t)k];
            moe__v1__top_logprob__init(t);
            t->token_id = (uint32_t)src->top_ids[k];
            t->logprob = src->top_logprobs[k];
            d->top[k] = t;
        }
        m->lpp[i] = d;
    }
    resp->n_prompt_token_ids = n;
    resp->prompt_token_ids = m->ids;
    resp->n_prompt_logprobs = n_lp;
    resp->prompt_logprobs = m->lpp;
}

/* Engine callback (engine thread): one message per token; the last one
 * carries the finish reason, usage and timings, then the call ends. */
static void on_token(void *user, const struct moe_token_event *ev)
{
    struct req *r = user;
    struct worker_service *ws = r->ws;
    double now = moe_now();
    Moe__V1__GenerateResponse resp = MOE__V1__GENERATE_RESPONSE__INIT;
    resp.request_id = r->request_id;
    uint32_t token;
    Moe__V1__TokenLogprob lp = MOE__V1__TOKEN_LOGPROB__INIT, *lps[1] = {&lp};
    Moe__V1__TopLogprob tops[MOE_MAX_LOGPROBS], *top_ptrs[MOE_MAX_LOGPROBS];
    if (ev->token >= 0) {
        token = (uint32_t)ev->token;
        resp.n_token_ids = 1;
        resp.token_ids = &token;
        r->n_out++;
        if (r->n_emitted++ == 0)
            r->t_first = now;
        r->t_last = now;
        if (r->want_logprobs) {
            lp.token_id = token;
            lp.logprob = ev->logprob;
            for (int i = 0; i < ev->n_top; i++) {
                moe__v1__top_logprob__init(&tops[i]);
                tops[i].token_id = (uint32_t)ev->top_ids[i];
                tops[i].logprob = ev->top_logprobs[i];
                top_ptrs[i] = &tops[i];
            }
            lp.n_top = (size_t)ev->n_top;
            lp.top = top_ptrs;
            resp.n_logprobs = 1;
            resp.logprobs = lps;
        }
    }
    struct prompt_lp_msg plm = {0};
    if (ev->prompt_tokens)
        prompt_lp_fill(&plm, ev, &resp);
    Moe__V1__Usage usage = MOE__V1__USAGE__INIT;
    Moe__V1__Timings timings = MOE__V1__TIMINGS__INIT;
    char stop_reason[64] = "";
    enum rpc_code code = RPC_OK;
    const char *status_msg = NULL;
    bool parked = ev->parked && ws->handoffs;
    if (ev->parked) {
        /* Prefill done: hand the sequence to the table; the stream ends OK
         * without a finish reason, with this side's timings. */
        if (ws->handoffs)
            kv_handoff_on_parked(ws->handoffs, r->handoff_id, ev->parked);
        else
            moe_engine_abort(ws->engine, r->id);
        double t_adm = ev->t_admitted > 0 ? ev->t_admitted : now;
        timings.queue_ms = 1e3 * (t_adm - r->t_recv);
        timings.prefill_ms = 1e3 * (now - t_adm);
        timings.ttft_ms = 1e3 * (now - r->t_recv);
        timings.e2e_ms = timings.ttft_ms;
        resp.timings = &timings;
        if (!parked) {
            code = RPC_INTERNAL;
            status_msg = "prefill_only: this worker cannot hand off KV";
        } else {
            status_msg = "parked for handoff";
        }
    }
    if (ev->finish) {
        resp.finish_reason = finish_reason(ev->finish);
        usage.prompt_tokens = (uint32_t)ev->n_prompt;
        usage.completion_tokens = (uint32_t)r->n_out;
        usage.cached_prompt_tokens = (uint32_t)ev->n_cached;
        resp.usage = &usage;
        double t_adm = ev->t_admitted > 0 ? ev->t_admitted : now;
        timings.queue_ms = 1e3 * (t_adm - r->t_recv);
        if (r->n_out) {
            timings.prefill_ms = 1e3 * (r->t_first - t_adm);
            timings.ttft_ms = 1e3 * (r->t_first - r->t_recv);
            timings.decode_ms = 1e3 * (r->t_last - r->t_first);
        }
        timings.e2e_ms = 1e3 * (now - r->t_recv);
        resp.timings = &timings;
        if (ev->finish == MOE_FINISH_STOP) {
            if (ev->stop_string >= 0)
                snprintf(stop_reason, sizeof stop_reason, "stop string %d", ev->stop_string);
            else
                snprintf(stop_reason, sizeof stop_reason, "token %d", ev->token);
            resp.stop_reason = stop_reason;
        } else if (ev->finish == MOE_FINISH_ERROR) {
            resp.error = (char *)(ev->error ? ev->error : "engine error");
        } else if (ev->finish == MOE_FINISH_ABORT && r->aborted_by_deadline) {
            code = RPC_DEADLINE_EXCEEDED;
            status_msg = "deadline_ms passed";
        }
    }
    size_t len;
    void *bytes = rpc_pack(&resp.base, &len);
    prompt_lp_free(&plm);
    if (bytes)
        rpc_stream_send(r->stream, bytes, len); /* fails harmlessly if the client left */
    free(bytes);
    if (!ev->finish && !ev->parked)
        return;
    rpc_stream_finish(r->stream, bytes ? code : RPC_INTERNAL, bytes ? status_msg : "out of memory");
    pthread_mutex_lock(&ws->mu);
    req_unlink(ws, r);
    pthread_mutex_unlock(&ws->mu);
    rpc_stream_release(r->stream); /* waits for a running on_cancel */
    free(r);
}

static void check_deadlines(struct worker_service *ws)
{
    double now = moe_now();
    pthread_mutex_lock(&ws->mu);
    for (struct req *r = ws->reqs; r; r = r->next)
        if (r->deadline > 0 && now > r->deadline && !r->deadline_hit) {
            r->deadline_hit = true;
            r->aborted_by_deadline = true;
            moe_engine_abort(ws->engine, r->id);
        }
    pthread_mutex_unlock(&ws->mu);
}

static void *engine_thread(void *arg)
{
    struct worker_service *ws = arg;
    struct moe_error err;
    /* test-only (test_fault.h): every step that ran tokens takes this much
     * longer, so a test can keep a request in flight for as long as it needs */
    int fault_step_ms = moe_fault_int("MOE_FAULT_STEP_DELAY_MS", 0);
    for (;;) {
        /* Idle: sleep until woken or for 50 ms, then run the timers below
         * (request deadlines, handoff expiry) even if nothing arrived. */
        pthread_mutex_lock(&ws->mu);
        if (!ws->stop && !ws->pending && !moe_engine_busy(ws->engine)) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += 50 * 1000 * 1000;
            if (until.tv_nsec >= 1000000000) {
                until.tv_sec++;
                until.tv_nsec -= 1000000000;
            }
            pthread_cond_timedwait(&ws->wake, &ws->mu, &until);
        }
        bool stop = ws->stop;
        ws->pending = 0;
        pthread_mutex_unlock(&ws->mu);
        if (stop)
            break;
        check_deadlines(ws);
        if (ws->handoffs)
            kv_handoff_tick(ws->handoffs);
        int n_tok = 0;
        if (moe_engine_step(ws->engine, &n_tok, &err) != MOE_OK)
            fprintf(stderr, "moe-worker: step failed (requests of that batch ended): %s\n",
                    err.msg);
        if (fault_step_ms > 0 && n_tok > 0)
            usleep((useconds_t)fault_step_ms * 1000);
    }
    return NULL;
}

/* ---- handlers ------------------------------------------------------------------------ */

/* Wakes the engine thread (queued KV reservations and releases). */
static void wake_engine(void *user)
{
    struct worker_service *ws = user;
    pthread_mutex_lock(&ws->mu);
    ws->pending++;
    pthread_cond_signal(&ws->wake);
    pthread_mutex_unlock(&ws->mu);
}

static void on_cancel(struct rpc_stream *stream, void *user)
{
    struct req *r = user;
    moe_engine_abort(r->ws->engine, r->id);
}

/* Engine parameters from the request; max_tokens 0 means up to the context. */
static void to_engine_params(const Moe__V1__SamplingParams *sp, int n_prompt, int max_context,
                             struct moe_request_params *p)
{
    moe_request_params_init(p);
    p->max_tokens = max_context - n_prompt;
    if (!sp)
        return;
    if (sp->max_tokens)
        p->max_tokens = (int)sp->max_tokens;
    p->min_tokens = (int)sp->min_tokens;
    p->sp.temperature = sp->temperature;
    p->sp.top_p = sp->top_p;
    p->sp.top_k = (int)sp->top_k;
    p->sp.min_p = sp->min_p;
    p->sp.repetition_penalty = sp->repetition_penalty;
    p->sp.presence_penalty = sp->presence_penalty;
    p->sp.frequency_penalty = sp->frequency_penalty;
    if (sp->seed_opt_case == MOE__V1__SAMPLING_PARAMS__SEED_OPT_SEED) {
        p->has_seed = true;
        p->seed = sp->seed;
    }
    p->n_stop_strings = (int)sp->n_stop;
    for (size_t i = 0; i < sp->n_stop; i++)
        snprintf(p->stop_strings[i], sizeof p->stop_strings[i], "%s", sp->stop[i]);
    p->n_stop_ids = (int)sp->n_stop_token_ids;
    for (size_t i = 0; i < sp->n_stop_token_ids; i++)
        p->stop_ids[i] = (int32_t)sp->stop_token_ids[i];
    p->ignore_eos = sp->ignore_eos;
    _Static_assert(MOE_REQ_MAX_LOGIT_BIAS <= MOE_MAX_LOGIT_BIAS, "logit_bias limits differ");
    /* at most MOE_REQ_MAX_LOGIT_BIAS entries: check_generate refused more */
    p->n_logit_bias =
        sp->n_logit_bias < MOE_MAX_LOGIT_BIAS ? (int)sp->n_logit_bias : MOE_MAX_LOGIT_BIAS;
    for (int i = 0; i < p->n_logit_bias; i++) {
        p->bias_ids[i] = (int32_t)sp->logit_bias[i]->key;
        p->logit_bias[i] = sp->logit_bias[i]->value;
    }
    if (sp->logprobs_opt_case == MOE__V1__SAMPLING_PARAMS__LOGPROBS_OPT_LOGPROBS)
        p->logprobs = (int)sp->logprobs;
    if (sp->prompt_logprobs_opt_case ==
        MOE__V1__SAMPLING_PARAMS__PROMPT_LOGPROBS_OPT_PROMPT_LOGPROBS)
        p->prompt_logprobs = (int)sp->prompt_logprobs;
}

/* Refuses what this worker cannot take, before anything is built: the
 * handoff fields, then the coordinator's checks (common/request_check.c; a
 * worker called directly is as strict). Returns RPC_OK or a code with msg
 * set. */
static enum rpc_code check_generate(const struct worker_service *ws,
                                    const Moe__V1__WorkerGenerateRequest *rq, char *msg, size_t cap)
{
    if ((rq->prefill_only || rq->handoff_id[0]) && !ws->handoffs) {
        snprintf(msg, cap,
                 "prefill_only / handoff_id: this worker cannot hand off KV (started "
                 "with --role mixed)");
        return RPC_UNIMPLEMENTED;
    }
    if (rq->prefill_only && !rq->handoff_id[0]) {
        snprintf(msg, cap, "handoff_id: required with prefill_only");
        return RPC_INVALID_ARGUMENT;
    }
    if (strlen(rq->handoff_id) >= KV_HANDOFF_ID_MAX) {
        snprintf(msg, cap, "handoff_id: longer than %d bytes", KV_HANDOFF_ID_MAX - 1);
        return RPC_INVALID_ARGUMENT;
    }
    if (moe_check_strings(&rq->base, msg, cap) ||
        moe_check_generation(rq->request_id, rq->sampling, (unsigned)ws->cfg->vocab_size, msg,
                             cap) ||
        moe_check_token_ids(rq->prompt_token_ids, rq->n_prompt_token_ids,
                            (unsigned)ws->cfg->vocab_size, "prompt_token_ids", msg, cap) ||
        moe_check_lengths(rq->n_prompt_token_ids, rq->sampling, (unsigned)ws->cfg->max_pos, msg,
                          cap))
        return RPC_INVALID_ARGUMENT;
    if (rq->sampling && rq->sampling->n_stop && !ws->tok) {
        snprintf(msg, cap, "sampling.stop: this worker has no tokenizer.json");
        return RPC_INVALID_ARGUMENT;
    }
    return RPC_OK;
}

/* A checked Generate call on its way to the engine. */
struct gen_call {
    struct worker_service *ws;
    const Moe__V1__WorkerGenerateRequest *rq;
    struct req *r;   /* handed to the engine thread once submitted */
    int32_t *prompt; /* (n_prompt) */
    int n_prompt;
    struct moe_request_params p;
    bool import;                   /* continues a KV handoff (not prefill_only) */
    struct kv_handoff_claim claim; /* import: the handed-off sequence */
    char msg[MOE_ERROR_MSG_MAX];   /* why it failed */
};

/* The prompt, the engine parameters and the call's state. */
static enum rpc_code gen_call_prepare(struct gen_call *g)
{
    const Moe__V1__WorkerGenerateRequest *rq = g->rq;
    g->n_prompt = (int)rq->n_prompt_token_ids;
    g->prompt = malloc((size_t)g->n_prompt * sizeof *g->prompt);
    g->r = calloc(1, sizeof *g->r);
    if (!g->prompt || !g->r) {
        snprintf(g->msg, sizeof g->msg, "out of memory");
        return RPC_RESOURCE_EXHAUSTED;
    }
    for (int i = 0; i < g->n_prompt; i++)
        g->prompt[i] = (int32_t)rq->prompt_token_ids[i];
    to_engine_params(rq->sampling, g->n_prompt, g->ws->cfg->max_pos, &g->p);
    g->p.prefill_only = rq->prefill_only;
    snprintf(g->r->handoff_id, sizeof g->r->handoff_id, "%s", rq->handoff_id);
    g->import = rq->handoff_id[0] && !rq->prefill_only;
    return RPC_OK;
}

/* The KV arrived by handoff: claims it and checks that the prompt is the
 * one prefilled; the output continues after its generated tokens. On an
 * error nothing is held (the reservation is given back). */
static enum rpc_code claim_handoff(struct gen_call *g)
{
    struct worker_service *ws = g->ws;
    struct kv_handoff_claim *claim = &g->claim;
    enum rpc_code code =
        kv_handoff_claim(ws->handoffs, g->rq->handoff_id, claim, g->msg, sizeof g->msg);
    if (code == RPC_OK &&
        (claim->n_prompt != g->n_prompt ||
         memcmp(claim->tokens, g->prompt, (size_t)g->n_prompt * sizeof *g->prompt))) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(g->msg, sizeof g->msg,
                 "prompt_token_ids: differ from the prompt of handoff %.100s", g->rq->handoff_id);
    }
    if (code) {
        if (claim->tokens)
            moe_engine_unreserve(ws->engine, claim->reservation);
        free(claim->tokens);
        return code;
    }
    g->r->n_out = claim->n_tokens - claim->n_prompt;
    return RPC_OK;
}

/* Under ws->mu: hands the request to the engine (imported from the claim,
 * or submitted with its prompt) and links r into the calls in flight;
 * refused while the worker drains. Frees the prompt and the claim's tokens;
 * a reservation not taken by the engine is given back. */
static enum rpc_code submit_to_engine(struct gen_call *g, struct rpc_stream *stream)
{
    struct worker_service *ws = g->ws;
    struct req *r = g->r;
    struct kv_handoff_claim *claim = &g->claim;
    struct moe_error err = {0};
    pthread_mutex_lock(&ws->mu);
    if (ws->draining || ws->stop) {
        pthread_mutex_unlock(&ws->mu);
        free(g->prompt);
        g->prompt = NULL;
        if (g->import)
            moe_engine_unreserve(ws->engine, claim->reservation);
        free(claim->tokens);
        snprintf(g->msg, sizeof g->msg, "worker is draining: send the request elsewhere");
        return RPC_UNAVAILABLE;
    }
    r->id = ws->next_id++;
    enum moe_status rc;
    if (g->import) {
        struct moe_seq_import im = {.n_prompt = claim->n_prompt,
                                    .n_tokens = claim->n_tokens,
                                    .tokens = claim->tokens,
                                    .rng = claim->rng,
                                    .reservation = claim->reservation};
        rc = moe_engine_import(ws->engine, r->id, &im, &g->p, on_token, r, &err);
        if (rc)
            moe_engine_unreserve(ws->engine, claim->reservation);
        free(claim->tokens);
    } else {
        rc = moe_engine_submit(ws->engine, r->id, g->prompt, g->n_prompt, &g->p, on_token, r, &err);
    }
    free(g->prompt);
    g->prompt = NULL;
    if (rc) {
        pthread_mutex_unlock(&ws->mu);
        snprintf(g->msg, sizeof g->msg, "%s", err.msg);
        return rpc_code_from_status(rc);
    }
    /* The engine thread frees r only after taking ws->mu, so r stays valid here. */
    r->next = ws->reqs;
    if (ws->reqs)
        ws->reqs->prev = r;
    ws->reqs = r;
    ws->n_reqs++;
    ws->pending++;
    rpc_stream_set_on_cancel(stream, on_cancel, r);
    pthread_cond_signal(&ws->wake);
    pthread_mutex_unlock(&ws->mu);
    return RPC_OK;
}

/* /moe.v1.Worker/Generate: checks the request, claims a handoff's KV when it
 * continues one, and submits it; the engine thread streams the tokens
 * (on_token). */
static void handle_generate(struct rpc_stream *stream, const uint8_t *bytes, size_t len, void *user)
{
    struct worker_service *ws = user;
    struct gen_call g = {.ws = ws};
    Moe__V1__WorkerGenerateRequest *rq = moe__v1__worker_generate_request__unpack(NULL, len, bytes);
    g.rq = rq;
    enum rpc_code code;
    if (!rq) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(g.msg, sizeof g.msg, "request: not a valid WorkerGenerateRequest message");
        goto fail;
    }
    if ((code = check_generate(ws, rq, g.msg, sizeof g.msg)) || (code = gen_call_prepare(&g)) ||
        (g.import && (code = claim_handoff(&g))))
        goto fail;
    struct req *r = g.r;
    r->ws = ws;
    r->stream = stream;
    r->t_recv = moe_now();
    r->want_logprobs = g.p.logprobs >= 0;
    snprintf(r->request_id, sizeof r->request_id, "%s", rq->request_id);
    if (rq->deadline_ms)
        r->deadline = r->t_recv + rq->deadline_ms / 1e3;
    if ((code = submit_to_engine(&g, stream)))
        goto fail;
    moe__v1__worker_generate_request__free_unpacked(rq, NULL);
    return;

fail:
    free(g.prompt);
    free(g.r);
    if (rq)
        moe__v1__worker_generate_request__free_unpacked(rq, NULL);
    rpc_stream_finish(stream, code, g.msg);
    rpc_stream_release(stream);
}

static void handle_abort(struct rpc_call *call, const uint8_t *bytes, size_t len, void *user)
{
    struct worker_service *ws = user;
    Moe__V1__AbortRequest *rq =
        rpc_call_unpack(call, &moe__v1__abort_request__descriptor, bytes, len);
    if (!rq)
        return;
    Moe__V1__AbortResponse resp = MOE__V1__ABORT_RESPONSE__INIT;
    pthread_mutex_lock(&ws->mu);
    for (struct req *r = ws->reqs; r; r = r->next)
        if (rq->request_id[0] && !strcmp(r->request_id, rq->request_id)) {
            moe_engine_abort(ws->engine, r->id);
            resp.found = true;
        }
    pthread_mutex_unlock(&ws->mu);
    moe__v1__abort_request__free_unpacked(rq, NULL);
    rpc_call_finish_msg(call, &resp.base);
}

static void handle_get_load(struct rpc_call *call, const uint8_t *bytes, size_t len, void *user)
{
    struct worker_service *ws = user;
    struct moe_engine_stats st;
    moe_engine_stats(ws->engine, &st);
    Moe__V1__WorkerLoad load = MOE__V1__WORKER_LOAD__INIT;
    load.running = (uint32_t)st.running;
    load.waiting = (uint32_t)st.waiting;
    load.kv_blocks_used = (uint32_t)st.kv_blocks_used;
    load.kv_blocks_free = (uint32_t)(st.kv_blocks_free + st.kv_blocks_cached);
    load.kv_blocks_total = (uint32_t)st.kv_blocks_total;
    load.block_size = (uint32_t)st.block_size;
    load.prefix_lookup_tokens = (uint64_t)st.prompt_tokens;
    load.prefix_hit_tokens = (uint64_t)st.prefix_hit_tokens;
    load.prefix_cached_blocks = (uint32_t)st.kv_blocks_cached;
    load.role = ws->role ? (Moe__V1__WorkerRole)ws->role : MOE__V1__WORKER_ROLE__WORKER_ROLE_MIXED;
    load.spec_draft_tokens = (uint64_t)st.spec_draft_tokens;
    load.spec_accepted_tokens = (uint64_t)st.spec_accepted_tokens;
    if (ws->handoffs) {
        struct kv_handoff_counters kc;
        kv_handoff_counters(ws->handoffs, &kc);
        load.kv_transfers_out = kc.transfers_out;
        load.kv_transfers_in = kc.transfers_in;
        load.kv_transfer_bytes_out = kc.bytes_out;
        load.kv_transfer_bytes_in = kc.bytes_in;
        load.kv_transfer_ms = kc.send_ms;
        load.kv_transfer_failures = kc.failures;
    }
    /* from the same snapshot as the blocks they hold (see moe_engine_stats) */
    load.handoffs_pending = (uint32_t)(st.parked + st.reservations);
    pthread_mutex_lock(&ws->mu);
    load.draining = ws->draining;
    pthread_mutex_unlock(&ws->mu);
    uint32_t dp_used[MOE_ENGINE_MAX_KV_PARTS], dp_running[MOE_ENGINE_MAX_KV_PARTS];
    if (st.kv_parts > 1) {
        for (int p = 0; p < st.kv_parts; p++) {
            dp_used[p] = (uint32_t)st.part_blocks_used[p];
            dp_running[p] = (uint32_t)st.part_running[p];
        }
        load.dp_size = (uint32_t)st.kv_parts;
        load.n_dp_kv_blocks_used = load.n_dp_running = (size_t)st.kv_parts;
        load.dp_kv_blocks_used = dp_used;
        load.dp_running = dp_running;
    }
    load.world_size = (uint32_t)ws->world_size;
    load.tp_size = (uint32_t)ws->tp_size;
    load.ep_size = (uint32_t)ws->world_size;
    /* expert statistics: cumulative, the coordinator windows them */
    const struct moe_config *c = ws->cfg;
    size_t n_stats = (size_t)c->n_layer * c->n_expert;
    uint64_t *tokens = n_stats ? malloc(n_stats * sizeof *tokens) : NULL;
    uint64_t *rank_rows = ws->group ? malloc((size_t)ws->group->size * sizeof *rank_rows) : NULL;
    if (tokens) {
        const uint64_t *counts = moe_model_expert_tokens(ws->model);
        for (size_t i = 0; i < n_stats; i++)
            tokens[i] = __atomic_load_n(&counts[i], __ATOMIC_RELAXED);
        load.n_expert_tokens = n_stats;
        load.expert_tokens = tokens;
        load.stats_layers = (uint32_t)c->n_layer;
        load.stats_experts = (uint32_t)c->n_expert;
        load.stats_steps = (uint64_t)st.steps;
    }
    if (ws->group) {
        load.placement_epoch = (uint64_t)moe_group_placement_epoch(ws->group, NULL);
        if (rank_rows) {
            moe_group_rank_rows(ws->group, rank_rows, &load.rank_steps);
            load.n_rank_rows = (size_t)ws->group->size;
            load.rank_rows = rank_rows;
        }
    }
    size_t n;
    void *out = rpc_pack(&load.base, &n);
    free(tokens);
    free(rank_rows);
    rpc_call_finish(call, out ? RPC_OK : RPC_RESOURCE_EXHAUSTED, out ? NULL : "out of memory", out,
                    n);
    free(out);
}

static void handle_model_info(struct rpc_call *call, const uint8_t *bytes, size_t len, void *user)
{
    struct worker_service *ws = user;
    Moe__V1__ModelInfo info = MOE__V1__MODEL_INFO__INIT;
    uint32_t eos[MOE_MAX_EOS];
    moe_model_info_fill(&info, ws->cfg, ws->model_name, ws->dtype_name, eos);
    rpc_call_finish_msg(call, &info.base);
}

/* ---- life cycle ------------------------------------------------------------------------ */

enum moe_status worker_service_create(struct moe_engine *engine, struct moe_model *model,
                                      struct moe_tokenizer *tok,
                                      const struct worker_service_opts *opts,
                                      struct worker_service **out, struct moe_error *err)
{
    *out = NULL;
    struct worker_service *ws = calloc(1, sizeof *ws);
    if (!ws)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    ws->engine = engine;
    ws->model = model;
    ws->tok = tok;
    ws->cfg = moe_model_config(model);
    snprintf(ws->model_name, sizeof ws->model_name, "%s", opts->model_name ? opts->model_name : "");
    snprintf(ws->dtype_name, sizeof ws->dtype_name, "%s", opts->dtype_name ? opts->dtype_name : "");
    ws->world_size = opts->world_size > 0 ? opts->world_size : 1;
    ws->group = opts->group;
    ws->tp_size = opts->tp_size > 0 ? opts->tp_size : 1;
    ws->role = opts->role;
    pthread_mutex_init(&ws->mu, NULL);
    pthread_cond_init(&ws->wake, NULL);
    enum moe_status rc = MOE_OK;
    /* No valid request is larger (the KV bytes go over the KV data plane). */
    struct rpc_server_options so = {.tls = opts->tls,
                                    .tls_client_auth = moe_tls_has_ca(opts->tls),
                                    .max_receive_bytes = moe_worker_request_max_bytes(
                                        (unsigned)ws->cfg->max_pos, ws->world_size)};
    ws->server = rpc_server_create(opts->listen ? opts->listen : "127.0.0.1:0",
                                   opts->rpc_threads > 0 ? opts->rpc_threads : 2, &so, err);
    if (!ws->server) {
        rc = err ? err->code : MOE_ERR_IO;
        goto fail;
    }
    if ((rc = rpc_server_add_stream(ws->server, "/moe.v1.Worker/Generate", handle_generate, ws,
                                    err)) ||
        (rc = rpc_server_add_unary(ws->server, "/moe.v1.Worker/Abort", handle_abort, ws, err)) ||
        (rc = rpc_server_add_unary(ws->server, "/moe.v1.Worker/GetLoad", handle_get_load, ws,
                                   err)) ||
        (rc = rpc_server_add_unary(ws->server, "/moe.v1.Worker/GetModelInfo", handle_model_info, ws,
                                   err)) ||
        (rc = rpc_health_register(ws->server, err)))
        goto fail;
    if (opts->be && opts->kv_link) {
        struct kv_handoff_opts ko = {.engine = engine,
                                     .link = opts->kv_link,
                                     .endpoints = opts->kv_endpoints,
                                     .world_size = ws->world_size,
                                     .tp_size = ws->tp_size,
                                     .dp_size =
                                         opts->group && opts->group->dp ? opts->group->dp_size : 1,
                                     .n_kv_head = moe_config_kv_heads(ws->cfg),
                                     .d_head = moe_config_kv_head_dim(ws->cfg),
                                     .latent = ws->cfg->mla,
                                     .ttl_ms = opts->handoff_ttl_ms,
                                     .wake = wake_engine,
                                     .wake_user = ws,
                                     .tls = opts->tls};
        if ((rc = kv_handoff_create(&ko, &ws->handoffs, err)) ||
            (rc = kv_handoff_register(ws->handoffs, ws->server, err)))
            goto fail;
    }
    if (pthread_create(&ws->thread, NULL, engine_thread, ws)) {
        rc = moe_error_set(err, MOE_ERR_INTERNAL, "cannot start the engine thread");
        goto fail;
    }
    ws->thread_started = true;
    if ((rc = rpc_server_start(ws->server, err)))
        goto fail;
    rpc_health_set(ws->server, "moe.v1.Worker", RPC_HEALTH_SERVING);
    *out = ws;
    return MOE_OK;
fail:
    worker_service_destroy(ws, 0);
    return rc;
}

int worker_service_port(const struct worker_service *ws)
{
    return rpc_server_port(ws->server);
}

void worker_service_drain(struct worker_service *ws)
{
    pthread_mutex_lock(&ws->mu);
    ws->draining = true;
    pthread_mutex_unlock(&ws->mu);
    rpc_health_set(ws->server, "", RPC_HEALTH_NOT_SERVING);
    rpc_health_set(ws->server, "moe.v1.Worker", RPC_HEALTH_NOT_SERVING);
}

int worker_service_in_flight(struct worker_service *ws)
{
    pthread_mutex_lock(&ws->mu);
    int n = ws->n_reqs;
    pthread_mutex_unlock(&ws->mu);
    return n;
}

struct kv_handoff *worker_service_kvx(struct worker_service *ws)
{
    return ws->handoffs;
}

bool worker_service_draining(struct worker_service *ws)
{
    pthread_mutex_lock(&ws->mu);
    bool d = ws->draining;
    pthread_mutex_unlock(&ws->mu);
    return d;
}

void worker_service_destroy(struct worker_service *ws, int grace_ms)
{
    if (!ws)
        return;
    /* Cancel the calls first: their on_cancel aborts reach the engine, whose
     * thread must still run to finish them and release the streams. */
    if (ws->server && ws->thread_started) {
        pthread_mutex_lock(&ws->mu);
        for (struct req *r = ws->reqs; r; r = r->next)
            moe_engine_abort(ws->engine, r->id);
        pthread_mutex_unlock(&ws->mu);
    }
    kv_handoff_shutdown(ws->handoffs);
    if (ws->server)
        rpc_server_destroy(ws->server, grace_ms);
    if (ws->thread_started) {
        pthread_mutex_lock(&ws->mu);
        ws->stop = true;
        pthread_cond_signal(&ws->wake);
        pthread_mutex_unlock(&ws->mu);
        pthread_join(ws->thread, NULL);
    }
    kv_handoff_destroy(ws->handoffs);
    pthread_mutex_destroy(&ws->mu);
    pthread_cond_destroy(&ws->wake);
    free(ws);
}
