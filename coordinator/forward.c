/* One forwarded Generate: the handler checks what it can at once and starts
 * a thread; the thread tokenizes, checks the lengths, picks a worker, calls
 * /moe.v1.Worker/Generate with a client stream and relays every message to
 * the client (adding the request id, text deltas and coordinator timings).
 *
 * Failures:
 *  - the worker fails before its first message with UNAVAILABLE (connection
 *    refused, process gone, draining): the request is retried on another
 *    worker, at most COORD_MAX_RETRIES times;
 *  - the worker fails mid-stream: the client stream ends with UNAVAILABLE
 *    "worker X at HOST:PORT failed after N tokens: ...";
 *  - the client cancels (or its deadline passes): on_cancel cancels the
 *    worker stream, and the worker frees the KV blocks;
 *  - Abort(request_id): the worker stream is cancelled and the client gets a
 *    last message with FINISH_REASON_ABORT and status OK.
 *
 * Disaggregated serving (when a prefill worker and a decode worker serve):
 *  1. the prefill worker runs the prompt (prefill_only, handoff_id H) and
 *     streams the first token, which is relayed at once; its stream ends OK
 *     with the sequence parked there;
 *  2. a decode worker (least loaded with enough free KV blocks, same block
 *     and TP size) reserves blocks (KvReserve); a refusal tries the next one,
 *     and none left ends the request with RESOURCE_EXHAUSTED;
 *  3. the prefill worker pushes the KV there (KvSend; it frees its blocks
 *     whatever happens);
 *  4. the decode worker continues (Generate with handoff_id) and its tokens
 *     are relayed: the client sees one stream.
 * The sampling seed is fixed here (when the client gave none) so that any
 * recomputation draws the same tokens. A failed or timed-out handoff
 * releases both sides (KvRelease) and recomputes the request on a decode
 * (or mixed) worker; the tokens already relayed are checked against the
 * recomputed ones and not sent twice. Timings.transfer_ms is the reserve +
 * send time; queue_ms and prefill_ms come from the prefill worker. */
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "detok.h"
#include "moe/v1/inference.pb-c.h"
#include "moe/v1/worker.pb-c.h"
#include "request_check.h"
#include "rng.h"
#include "clock.h"

#define WORKER_DEADLINE_SLACK_MS 2000 /* the worker's own deadline_ms fires first */
#define HANDOFF_CALL_MS 5000          /* KvReserve / KvRelease */
#define HANDOFF_SEND_MS 10000         /* KvSend: the whole push */
#define HANDOFF_DECODE_TRIES 3        /* decode workers asked to reserve */

struct fwd {
    struct coord *c;
    const struct coord_sink *sink; /* where the output goes (gRPC stream, HTTP response) */
    void *sink_user;
    Moe__V1__GenerateRequest *rq; /* owned */
    char request_id[MOE_REQ_MAX_ID_LEN + 32];
    double t_recv, t_first, t_last; /* t_last: the last token relayed */
    double deadline;                /* moe_now() seconds; 0: none */
    int32_t *prompt;                /* (n_prompt) */
    size_t n_prompt;
    uint32_t n_tokens;   /* tokens relayed to the client */
    bool prompt_lp_sent; /* sampling.prompt_logprobs relayed (a retry's again are dropped) */
    uint32_t *relayed;   /* (cap_relayed) the ids relayed, in order */
    size_t cap_relayed;
    uint32_t skip;      /* tokens of the next worker stream already relayed */
    uint32_t skip_from; /* index in relayed of the next one to compare */

    /* disaggregated serving */
    Moe__V1__SamplingParams sp;               /* rq->sampling with a fixed seed */
    Moe__V1__SamplingParams *sampling;        /* what workers get */
    bool prefill_only;                        /* this attempt only prefills */
    char handoff_id[MOE_REQ_MAX_ID_LEN + 64]; /* this attempt's handoff, or "" */
    bool disagg;                              /* timings come from both workers */
    char fallback_cause[512];                 /* why a handoff fell back to recompute, or "" */
    double p_queue_ms, p_prefill_ms, transfer_ms;

    pthread_mutex_t mu;             /* guards the fields below */
    struct rpc_client_stream *ws;   /* the worker call now running, or NULL */
    struct coord_worker *ws_worker; /* its worker (a reference is held by the attempt) */
    bool cancelled;                 /* the client went away */
    bool aborted;                   /* Abort(request_id) */
    int64_t stalled_ms;        /* > 0: the watchdog ended ws after this long without a message */
    _Atomic int64_t ws_msg_ms; /* moe_now_ms() of ws's start or its last message */

    struct fwd *next; /* c->mu: c->reqs list */
};

static void fwd_free(struct fwd *f)
{
    if (!f)
        return;
    if (f->rq)
        moe__v1__generate_request__free_unpacked(f->rq, NULL);
    free(f->prompt);
    free(f->relayed);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

void coord_request_cancel(struct fwd *f)
{
    pthread_mutex_lock(&f->mu);
    f->cancelled = true;
    if (f->ws)
        rpc_client_stream_cancel(f->ws);
    pthread_mutex_unlock(&f->mu);
}

int coord_abort(struct coord *c, const char *request_id)
{
    int found = 0;
    if (!request_id[0])
        return 0;
    pthread_mutex_lock(&c->mu);
    for (struct fwd *f = c->reqs; f; f = f->next)
        if (!strcmp(f->request_id, request_id)) {
            pthread_mutex_lock(&f->mu);
            f->aborted = true;
            if (f->ws)
                rpc_client_stream_cancel(f->ws);
            pthread_mutex_unlock(&f->mu);
            found = 1;
        }
    pthread_mutex_unlock(&c->mu);
    return found;
}

void coord_wait_threads(struct coord *c)
{
    pthread_mutex_lock(&c->mu);
    while (c->n_threads > 0)
        pthread_cond_wait(&c->cond, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

/* ---- the stall watchdog ------------------------------------------------------------ */

/* One pass over the running requests; caller holds c->mu. */
static void watchdog_scan_locked(struct coord *c, int64_t now)
{
    int64_t limit = c->opts.stall_timeout_ms;
    for (struct fwd *f = c->reqs; f; f = f->next) {
        pthread_mutex_lock(&f->mu);
        struct coord_worker *w = f->ws_worker;
        int64_t idle = now - atomic_load(&f->ws_msg_ms);
        if (f->ws && w && !f->stalled_ms && !f->cancelled && !f->aborted && idle > limit &&
            now - atomic_load(&w->progress_ms) > limit) {
            f->stalled_ms = idle;
            rpc_client_stream_cancel(f->ws);
            if (!w->down)
                fprintf(stderr,
                        "moe-coordinator: worker %s at %s stalled: request %s had no message "
                        "for %lld ms (--stall-timeout-ms %lld); taken out of routing\n",
                        w->id, w->address, f->request_id, (long long)idle, (long long)limit);
            w->down = true; /* until a poll answers again */
            snprintf(w->last_error, sizeof w->last_error,
                     "stalled: no message for %lld ms (--stall-timeout-ms)", (long long)idle);
        }
        pthread_mutex_unlock(&f->mu);
    }
}

static void *watchdog_thread(void *arg)
{
    struct coord *c = arg;
    int64_t period = c->opts.stall_timeout_ms / 4;
    period = period < 20 ? 20 : period > 1000 ? 1000 : period;
    pthread_mutex_lock(&c->mu);
    int64_t next = moe_now_ms() + period;
    while (!c->stopping) {
        /* c->cond is also signalled whenever a request ends: wait for the period */
        int64_t now = moe_now_ms();
        if (now < next) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            long ns = until.tv_nsec + (long)(next - now) * 1000000L;
            until.tv_sec += ns / 1000000000L;
            until.tv_nsec = ns % 1000000000L;
            pthread_cond_timedwait(&c->cond, &c->mu, &until);
            continue;
        }
        watchdog_scan_locked(c, now);
        next = now + period;
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

enum moe_status coord_watchdog_start(struct coord *c, struct moe_error *err)
{
    if (c->opts.stall_timeout_ms <= 0)
        return MOE_OK;
    if (pthread_create(&c->watchdog_thread, NULL, watchdog_thread, c))
        return moe_error_set(err, MOE_ERR_INTERNAL, "cannot start the stall watchdog thread");
    c->watchdog_started = true;
    return MOE_OK;
}

void coord_watchdog_stop(struct coord *c)
{
    if (!c->watchdog_started)
        return;
    pthread_mutex_lock(&c->mu);
    c->stopping = true;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->watchdog_thread, NULL);
    c->watchdog_started = false;
}

/* ---- the forwarding thread --------------------------------------------------------- */

/* Milliseconds left before the request's deadline; INT64_MAX if none. */
static int64_t ms_left(const struct fwd *f)
{
    if (f->deadline <= 0)
        return INT64_MAX;
    return (int64_t)((f->deadline - moe_now()) * 1e3);
}

/* Sends one message to the client; false once the client is gone. */
static bool client_send(struct fwd *f, const Moe__V1__GenerateResponse *m)
{
    return f->sink->send(f->sink_user, m);
}

/* Appends `s` (n bytes) to the growing string *buf. */
static bool str_append(char **buf, size_t *len, const char *s, size_t n)
{
    if (!n)
        return true;
    char *p = realloc(*buf, *len + n + 1);
    if (!p)
        return false;
    if (n)
        memcpy(p + *len, s, n);
    *len += n;
    p[*len] = '\0';
    *buf = p;
    return true;
}

/* The outcome of one attempt on one worker. */
struct attempt {
    enum rpc_code code; /* the worker call's status */
    char message[512];
    int n_msgs;     /* messages received from the worker */
    bool saw_final; /* a message with finish_reason arrived */
    bool client_gone;
    bool failed_local;  /* out of memory, bad message from the worker */
    int64_t stalled_ms; /* > 0: ended by the stall watchdog after this long without a message */
};

/* Relays one worker message to the client. */
static bool relay(struct fwd *f, Moe__V1__GenerateResponse *m, struct moe_detok *dt,
                  struct attempt *at)
{
    const Moe__V1__GenerateRequest *rq = f->rq;
    char *text = NULL;
    size_t text_len = 0;
    bool ok = true;
    if (m->n_token_ids) {
        double now = moe_now();
        if (f->n_tokens == 0)
            f->t_first = now;
        coord_metrics_token(f->c->metrics, f->n_tokens == 0,
                            now - (f->n_tokens ? f->t_last : f->t_recv));
        f->t_last = now;
    }
    if (f->n_tokens + m->n_token_ids > f->cap_relayed) {
        size_t cap = f->cap_relayed ? 2 * f->cap_relayed : 64;
        while (cap < f->n_tokens + m->n_token_ids)
            cap *= 2;
        uint32_t *p = realloc(f->relayed, cap * sizeof *p);
        if (!p) {
            snprintf(at->message, sizeof at->message, "out of memory");
            at->failed_local = true;
            return false;
        }
        f->relayed = p;
        f->cap_relayed = cap;
    }
    if (m->n_token_ids) /* a message without tokens has token_ids == NULL */
        memcpy(f->relayed + f->n_tokens, m->token_ids, m->n_token_ids * sizeof *m->token_ids);
    f->n_tokens += (uint32_t)m->n_token_ids;
    if (rq->stream_text) {
        struct moe_error err = {0};
        for (size_t i = 0; i < m->n_token_ids && ok; i++) {
            char *delta = NULL;
            size_t dl = 0;
            ok = moe_detok_push(dt, (int32_t)m->token_ids[i], &delta, &dl, &err) == MOE_OK &&
                 str_append(&text, &text_len, delta, dl);
            free(delta);
        }
        if (ok && m->finish_reason) {
            char *delta = NULL;
            size_t dl = 0;
            ok = moe_detok_flush(dt, &delta, &dl, &err) == MOE_OK &&
                 str_append(&text, &text_len, delta, dl);
            free(delta);
        }
        if (!ok) {
            snprintf(at->message, sizeof at->message, "detokenizing the worker's tokens: %.400s",
                     err.msg[0] ? err.msg : "out of memory");
            at->failed_local = true;
            free(text);
            return false;
        }
    }
    /* Swap in our fields, pack, and restore the unpacked ones before freeing. */
    size_t saved_n_pids = m->n_prompt_token_ids, saved_n_plp = m->n_prompt_logprobs;
    if (f->prompt_lp_sent) /* a retry's first message repeats them */
        m->n_prompt_token_ids = m->n_prompt_logprobs = 0;
    else if (m->n_prompt_token_ids)
        f->prompt_lp_sent = true;
    char *saved_id = m->request_id, *saved_text = m->text;
    Moe__V1__Timings *saved_timings = m->timings;
    Moe__V1__Timings timings = MOE__V1__TIMINGS__INIT;
    m->request_id = f->request_id;
    if (text)
        m->text = text;
    if (m->finish_reason) {
        if (saved_timings)
            timings = *saved_timings;
        /* Coordinator-side: receipt here to first / last token relayed. */
        double now = moe_now();
        timings.ttft_ms = f->n_tokens ? 1e3 * (f->t_first - f->t_recv) : 0.0;
        timings.e2e_ms = 1e3 * (now - f->t_recv);
        if (f->disagg) {
            timings.queue_ms = f->p_queue_ms;
            timings.prefill_ms = f->p_prefill_ms;
            timings.transfer_ms = f->transfer_ms;
        }
        m->timings = &timings;
        at->saw_final = true;
        coord_metrics_final(f->c->metrics, m);
    }
    bool sent = client_send(f, m);
    m->n_prompt_token_ids = saved_n_pids;
    m->n_prompt_logprobs = saved_n_plp;
    m->request_id = saved_id;
    m->text = saved_text;
    m->timings = saved_timings;
    free(text);
    if (!sent)
        at->client_gone = true;
    return sent;
}

/* Builds the worker request for this attempt. */
static void *worker_request(struct fwd *f, int64_t left, size_t *len)
{
    Moe__V1__WorkerGenerateRequest wr = MOE__V1__WORKER_GENERATE_REQUEST__INIT;
    wr.request_id = f->request_id;
    uint32_t *ids = malloc((f->n_prompt ? f->n_prompt : 1) * sizeof *ids);
    if (!ids)
        return NULL;
    for (size_t i = 0; i < f->n_prompt; i++)
        ids[i] = (uint32_t)f->prompt[i];
    wr.n_prompt_token_ids = f->n_prompt;
    wr.prompt_token_ids = ids;
    wr.sampling = f->sampling;
    wr.prefill_only = f->prefill_only;
    wr.handoff_id = f->handoff_id;
    if (left != INT64_MAX)
        wr.deadline_ms = left < 1 ? 1 : (left > UINT32_MAX ? UINT32_MAX : (uint32_t)left);
    void *bytes = rpc_pack(&wr, len);
    free(ids);
    return bytes;
}

/* Runs one attempt on worker w. */
static void attempt_run(struct fwd *f, struct coord_worker *w, struct moe_detok *dt,
                        struct attempt *at)
{
    memset(at, 0, sizeof *at);
    at->code = RPC_UNKNOWN;
    int64_t left = ms_left(f);
    size_t len;
    void *req = worker_request(f, left, &len);
    if (!req) {
        at->failed_local = true;
        snprintf(at->message, sizeof at->message, "out of memory");
        return;
    }
    struct moe_error err = {0};
    int64_t timeout = left == INT64_MAX ? 0 : left + WORKER_DEADLINE_SLACK_MS;
    struct rpc_client_stream *ws =
        rpc_client_stream_start(w->client, "/moe.v1.Worker/Generate", req, len, timeout, &err);
    free(req);
    if (!ws) {
        at->code = RPC_UNAVAILABLE;
        snprintf(at->message, sizeof at->message, "%.500s", err.msg);
        return;
    }
    pthread_mutex_lock(&f->mu);
    f->ws = ws;
    f->ws_worker = w;
    f->stalled_ms = 0;
    atomic_store(&f->ws_msg_ms, moe_now_ms());
    if (f->cancelled || f->aborted)
        rpc_client_stream_cancel(ws);
    pthread_mutex_unlock(&f->mu);

    const uint8_t *data;
    size_t n;
    while (rpc_client_stream_next(ws, &data, &n)) {
        int64_t t_msg = moe_now_ms();
        atomic_store(&f->ws_msg_ms, t_msg);
        atomic_store(&w->progress_ms, t_msg);
        Moe__V1__GenerateResponse *m = moe__v1__generate_response__unpack(NULL, n, data);
        if (!m) {
            at->failed_local = true;
            snprintf(at->message, sizeof at->message, "worker sent a malformed message");
            rpc_client_stream_cancel(ws);
            continue;
        }
        at->n_msgs++;
        if (f->prefill_only && m->timings && !m->finish_reason) {
            f->p_queue_ms = m->timings->queue_ms;
            f->p_prefill_ms = m->timings->prefill_ms;
        }
        /* Tokens the client already has (a recomputation): compare, drop. */
        uint32_t *saved_ids = m->token_ids;
        Moe__V1__TokenLogprob **saved_lps = m->logprobs;
        size_t saved_n = m->n_token_ids, saved_nlp = m->n_logprobs;
        size_t k = f->skip < m->n_token_ids ? f->skip : m->n_token_ids;
        for (size_t i = 0; i < k && !at->failed_local; i++)
            if (m->token_ids[i] != f->relayed[f->skip_from + i]) {
                at->failed_local = true;
                snprintf(at->message, sizeof at->message,
                         "recomputing after a failed KV handoff gave token %u at index %u where "
                         "%u was sent",
                         m->token_ids[i], f->skip_from + (unsigned)i, f->relayed[f->skip_from + i]);
                rpc_client_stream_cancel(ws);
            }
        if (k) {
            f->skip -= (uint32_t)k;
            f->skip_from += (uint32_t)k;
            m->token_ids += k;
            m->n_token_ids -= k;
            if (m->n_logprobs >= k) {
                m->logprobs += k;
                m->n_logprobs -= k;
            }
        }
        if (!at->failed_local && !at->client_gone && (m->n_token_ids || m->finish_reason || !k) &&
            !relay(f, m, dt, at))
            rpc_client_stream_cancel(ws);
        m->token_ids = saved_ids;
        m->n_token_ids = saved_n;
        m->logprobs = saved_lps;
        m->n_logprobs = saved_nlp;
        moe__v1__generate_response__free_unpacked(m, NULL);
    }
    const char *msg = NULL;
    at->code = rpc_client_stream_status(ws, &msg);
    if (!at->failed_local)
        snprintf(at->message, sizeof at->message, "%s", msg ? msg : "");
    pthread_mutex_lock(&f->mu);
    f->ws = NULL;
    f->ws_worker = NULL;
    at->stalled_ms = f->stalled_ms;
    f->stalled_ms = 0;
    pthread_mutex_unlock(&f->mu);
    if (at->stalled_ms && !at->failed_local && !at->client_gone && !at->saw_final) {
        /* Ended by the watchdog: the worker stopped producing. */
        at->code = RPC_UNAVAILABLE;
        snprintf(at->message, sizeof at->message,
                 "stalled: no message for %lld ms and no progress on the worker "
                 "(--stall-timeout-ms %d)",
                 (long long)at->stalled_ms, f->c->opts.stall_timeout_ms);
    }
    rpc_client_stream_destroy(ws);
}

/* Sends the last message of an aborted request. */
static void send_abort_final(struct fwd *f)
{
    Moe__V1__GenerateResponse m = MOE__V1__GENERATE_RESPONSE__INIT;
    Moe__V1__Usage usage = MOE__V1__USAGE__INIT;
    Moe__V1__Timings timings = MOE__V1__TIMINGS__INIT;
    m.request_id = f->request_id;
    m.finish_reason = MOE__V1__FINISH_REASON__FINISH_REASON_ABORT;
    usage.prompt_tokens = (uint32_t)f->n_prompt;
    usage.completion_tokens = f->n_tokens;
    m.usage = &usage;
    timings.ttft_ms = f->n_tokens ? 1e3 * (f->t_first - f->t_recv) : 0.0;
    timings.e2e_ms = 1e3 * (moe_now() - f->t_recv);
    m.timings = &timings;
    client_send(f, &m);
}

/* Retry only failures that cannot have started work on the worker. */
static bool retryable(const struct attempt *at)
{
    return at->n_msgs == 0 && !at->client_gone && !at->failed_local &&
           (at->code == RPC_UNAVAILABLE || at->code == RPC_UNKNOWN);
}

/* Tokenizes and checks the prompt. Returns RPC_OK or a code with msg set. */
static enum rpc_code prepare_prompt(struct fwd *f, char *msg, size_t cap)
{
    struct coord *c = f->c;
    const Moe__V1__GenerateRequest *rq = f->rq;
    if (rq->prompt_case == MOE__V1__GENERATE_REQUEST__PROMPT_TEXT) {
        if (!c->tok) {
            snprintf(msg, cap,
                     "prompt.text: the coordinator has no tokenizer.json; send "
                     "token_ids");
            return RPC_INVALID_ARGUMENT;
        }
        /* Tokenizing stops once the prompt is known not to fit the context
         * (moe_check_lengths below words the refusal of one that fits but
         * leaves no room for max_tokens): a prompt far beyond the context
         * costs little. */
        unsigned ctx = (unsigned)c->cfg.max_pos;
        size_t max_ids = ctx > 1 ? ctx - 1 : 0;
        struct moe_error err = {0};
        if (moe_tokenizer_encode_max(c->tok, rq->text, strlen(rq->text), true, max_ids, &f->prompt,
                                     &f->n_prompt, &err)) {
            if (!f->prompt && strstr(err.msg, "more than"))
                snprintf(msg, cap,
                         "prompt.text: %.100s, the model's context is %u tokens (room is needed "
                         "for one new token)",
                         err.msg, ctx);
            else
                snprintf(msg, cap, "prompt.text: %.900s", err.msg);
            return RPC_INVALID_ARGUMENT;
        }
    } else {
        size_t n = rq->token_ids ? rq->token_ids->n_ids : 0;
        f->prompt = malloc((n ? n : 1) * sizeof *f->prompt);
        if (!f->prompt) {
            snprintf(msg, cap, "out of memory");
            return RPC_RESOURCE_EXHAUSTED;
        }
        for (size_t i = 0; i < n; i++)
            f->prompt[i] = (int32_t)rq->token_ids->ids[i];
        f->n_prompt = n;
    }
    if (moe_check_lengths(f->n_prompt, rq->sampling, (unsigned)c->cfg.max_pos, msg, cap))
        return RPC_INVALID_ARGUMENT;
    return RPC_OK;
}

/* ---- disaggregated prefill / decode ------------------------------------------------ */

enum disagg_result {
    DISAGG_NO,      /* not a disaggregated cluster, or the prefill failed: plain path */
    DISAGG_SETTLED, /* the request ended (code and msg set) */
    DISAGG_DECODE,  /* *d holds the decode worker, f->handoff_id is armed */
    DISAGG_NEXT,    /* inside disagg_prepare only: this step went well, the next one runs */
};

static bool has_role_serving(struct coord *c, int role)
{
    bool any = false;
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n_workers && !any; i++)
        any = c->workers[i]->role == role &&
              coord_worker_state_locked(c->workers[i]) == COORD_WORKER_SERVING;
    pthread_mutex_unlock(&c->mu);
    return any;
}

static void mark_down(struct coord *c, struct coord_worker *w, const char *what, const char *msg)
{
    pthread_mutex_lock(&c->mu);
    w->down = true;
    snprintf(w->last_error, sizeof w->last_error, "%s: %.200s", what, msg);
    pthread_mutex_unlock(&c->mu);
}

/* A unary call to a worker; *out (if not NULL) is the unpacked answer. */
static enum rpc_code worker_call(struct coord_worker *w, const char *method, const void *req,
                                 const ProtobufCMessageDescriptor *desc, void **out,
                                 int64_t timeout_ms, char *msg, size_t cap)
{
    size_t len;
    void *bytes = rpc_pack(req, &len);
    if (out)
        *out = NULL;
    if (!bytes) {
        snprintf(msg, cap, "out of memory");
        return RPC_RESOURCE_EXHAUSTED;
    }
    struct rpc_reply r;
    enum rpc_code code = rpc_client_call(w->client, method, bytes, len, timeout_ms, &r);
    free(bytes);
    snprintf(msg, cap, "%s", r.message);
    if (code == RPC_OK && out && desc) {
        *out = protobuf_c_message_unpack(desc, NULL, r.len, r.data);
        if (!*out) {
            code = RPC_INTERNAL;
            snprintf(msg, cap, "%s: malformed answer", method);
        }
    }
    rpc_reply_clear(&r);
    return code;
}

/* Best effort: frees the handoff's blocks on w. */
static void handoff_release(struct coord_worker *w, const char *id, const char *reason)
{
    Moe__V1__KvReleaseRequest rq = MOE__V1__KV_RELEASE_REQUEST__INIT;
    rq.handoff_id = (char *)id;
    rq.reason = (char *)reason;
    char msg[256];
    worker_call(w, "/moe.v1.Worker/KvRelease", &rq, NULL, NULL, 1000, msg, sizeof msg);
}

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* Fixes a sampling seed so that a recomputation draws the same tokens. */
static void fix_seed(struct fwd *f)
{
    static uint64_t counter;
    if (f->rq->sampling)
        f->sp = *f->rq->sampling;
    else
        moe__v1__sampling_params__init(&f->sp);
    if (f->sp.seed_opt_case != MOE__V1__SAMPLING_PARAMS__SEED_OPT_SEED) {
        /* the clock, apart for requests of the same nanosecond, mixed */
        uint64_t x = (uint64_t)(moe_now() * 1e9) +
                     0x9e3779b97f4a7c15ull * __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
        f->sp.seed_opt_case = MOE__V1__SAMPLING_PARAMS__SEED_OPT_SEED;
        f->sp.seed = moe_splitmix64(&x) >> 11;
    }
    f->sampling = &f->sp;
}

/* One request's try at disaggregated serving, across its steps: the
 * prefill worker (one reference held until the try ends), the handoff id,
 * and where a request that ends here gets its status. */
struct disagg {
    struct fwd *f;
    struct coord *c;
    struct coord_worker *p;            /* the prefill worker */
    char hid[MOE_REQ_MAX_ID_LEN + 64]; /* = the fwd's handoff_id while it is armed */
    double t_reserve;                  /* when the reservation began: transfer_ms counts from it */
    enum rpc_code *code;               /* DISAGG_SETTLED: the request's status */
    char *msg;
    size_t cap;
};

/* 1. Prefill on p and relay the first token. DISAGG_NEXT when the sequence
 * is parked on p with a token sent; otherwise p is released and the result
 * says how the request goes on. */
static enum disagg_result disagg_prefill(struct disagg *g, struct moe_detok *dt)
{
    struct fwd *f = g->f;
    struct coord *c = g->c;
    struct coord_worker *p = g->p;
    struct attempt at;
    f->prefill_only = true;
    attempt_run(f, p, dt, &at);
    f->prefill_only = false;
    f->handoff_id[0] = '\0';
    pthread_mutex_lock(&f->mu);
    bool gone = f->cancelled || f->aborted;
    pthread_mutex_unlock(&f->mu);
    if (at.saw_final || gone || at.client_gone || at.failed_local) {
        /* Finished at its first token, or ended here. */
        if (!at.saw_final)
            handoff_release(p, g->hid, "request ended during prefill");
        coord_router_done(c, p);
        if (at.saw_final || at.failed_local) {
            *g->code = at.saw_final ? at.code : RPC_INTERNAL;
            snprintf(g->msg, g->cap, "%s%s", at.saw_final ? "" : "prefill: ", at.message);
            return DISAGG_SETTLED;
        }
        pthread_mutex_lock(&f->mu);
        f->cancelled = true; /* the client is gone (or aborted): the loop answers */
        pthread_mutex_unlock(&f->mu);
        return DISAGG_NO;
    }
    if (at.code != RPC_OK || at.n_msgs == 0 || f->n_tokens == 0) {
        if (at.code == RPC_UNAVAILABLE)
            mark_down(c, p, "Generate (prefill)", at.message);
        if (at.n_msgs == 0 && at.code != RPC_OK && at.code != RPC_UNAVAILABLE &&
            at.code != RPC_UNKNOWN) {
            *g->code = at.code; /* refused (bad request): pass it on */
            snprintf(g->msg, g->cap, "%s", at.message);
            coord_router_done(c, p);
            return DISAGG_SETTLED;
        }
        fprintf(stderr,
                "moe-coordinator: request %s: prefill on %s failed (%s: %s); recomputing "
                "on a decode worker\n",
                f->request_id, p->id, rpc_code_name(at.code), at.message);
        handoff_release(p, g->hid, "prefill failed");
        coord_metrics_handoff(c->metrics, "prefill_failed", 0);
        coord_router_done(c, p);
        f->skip = f->n_tokens;
        f->skip_from = 0;
        return DISAGG_NO;
    }
    return DISAGG_NEXT;
}

/* The decode workers asked to reserve, and how the last refusal read. */
struct reserve_tries {
    struct coord_worker *tried[HANDOFF_DECODE_TRIES]; /* pointers only, compared */
    size_t n_tried;
    char last[512]; /* the last refusal, or "" */
    bool full;      /* a decode worker answered that it has no room */
};

/* Asks decode workers (the router's order, each at most once, at most
 * HANDOFF_DECODE_TRIES) to reserve blocks for the prompt. Returns the first
 * whose answer is usable (*rr, one reference and in_flight held), or NULL
 * with t saying who refused and why. */
static struct coord_worker *reserve_decode(struct disagg *g, Moe__V1__KvReserveResponse **rr,
                                           struct reserve_tries *t)
{
    struct fwd *f = g->f;
    struct coord *c = g->c;
    pthread_mutex_lock(&c->mu);
    uint32_t bs = g->p->block_size ? g->p->block_size : COORD_DEFAULT_BLOCK;
    uint32_t tp = g->p->tp_size ? g->p->tp_size : 1;
    pthread_mutex_unlock(&c->mu);
    *rr = NULL;
    while (t->n_tried < HANDOFF_DECODE_TRIES) {
        struct coord_worker *w =
            coord_router_pick_role(c, MOE__V1__WORKER_ROLE__WORKER_ROLE_DECODE, f->prompt,
                                   f->n_prompt, t->tried, t->n_tried, (uint32_t)f->n_prompt);
        if (!w)
            break;
        Moe__V1__KvReserveRequest rq = MOE__V1__KV_RESERVE_REQUEST__INIT;
        rq.handoff_id = g->hid;
        rq.request_id = f->request_id;
        rq.n_tokens = (uint32_t)f->n_prompt; /* the receiver counts blocks in its own size */
        rq.block_size = bs;
        rq.tp_size = tp;
        char m[512];
        enum rpc_code rc = worker_call(w, "/moe.v1.Worker/KvReserve", &rq,
                                       &moe__v1__kv_reserve_response__descriptor, (void **)rr,
                                       min64(HANDOFF_CALL_MS, ms_left(f)), m, sizeof m);
        uint32_t dbs = *rr && (*rr)->block_size ? (*rr)->block_size : 0;
        if (rc == RPC_OK && *rr && dbs && (*rr)->tp_size && (*rr)->n_rank_endpoints &&
            (*rr)->n_block_ids == (f->n_prompt + dbs - 1) / dbs)
            return w;
        if (*rr)
            moe__v1__kv_reserve_response__free_unpacked(*rr, NULL);
        *rr = NULL;
        snprintf(t->last, sizeof t->last, "%.120s at %.120s: KvReserve %s %.200s", w->id,
                 w->address, rpc_code_name(rc), m);
        t->full |= rc == RPC_RESOURCE_EXHAUSTED;
        if (rc == RPC_UNAVAILABLE || (rc == RPC_DEADLINE_EXCEEDED && ms_left(f) > 0))
            mark_down(c, w, "KvReserve", m); /* gone, or stopped answering */
        else
            handoff_release(w, g->hid, "reservation not usable");
        t->tried[t->n_tried++] = w;
        coord_router_done(c, w);
    }
    return NULL;
}

/* 2. A decode worker reserves the blocks. DISAGG_NEXT with *d and *rr set;
 * otherwise p is released, and a decode pool without room settles the
 * request (RESOURCE_EXHAUSTED) while an unreachable one recomputes it. */
static enum disagg_result disagg_reserve(struct disagg *g, struct coord_worker **d,
                                         Moe__V1__KvReserveResponse **rr)
{
    struct fwd *f = g->f;
    struct coord *c = g->c;
    g->t_reserve = moe_now();
    struct reserve_tries t = {.n_tried = 0};
    *d = reserve_decode(g, rr, &t);
    if (*d)
        return DISAGG_NEXT;
    /* Decode workers serve, but none had free blocks for it (the router
     * skipped them all): the pool is full, not gone. */
    bool none_fits = !t.n_tried && has_role_serving(c, MOE__V1__WORKER_ROLE__WORKER_ROLE_DECODE);
    if (t.full || none_fits) {
        /* The decode pool is alive but has no room: the client should back off. */
        handoff_release(g->p, g->hid, "no decode worker could reserve");
        coord_metrics_handoff(c->metrics, "no_decode_worker", 0);
        coord_router_done(c, g->p);
        *g->code = RPC_RESOURCE_EXHAUSTED;
        if (t.full)
            snprintf(g->msg, g->cap,
                     "no decode worker could take the KV of this request (%zu tokens): last "
                     "refusal from %s",
                     f->n_prompt, t.last);
        else
            snprintf(g->msg, g->cap,
                     "no decode worker has free KV blocks for the %zu tokens of this request",
                     f->n_prompt);
        return DISAGG_SETTLED;
    }
    /* No decode worker is reachable (died, stalled, partitioned): the
     * request is recomputed on another worker -- a mixed or decode one,
     * else the prefill worker itself, whose prefix cache likely still
     * holds the prompt -- and the token already sent is not sent again. */
    if (t.n_tried)
        snprintf(f->fallback_cause, sizeof f->fallback_cause,
                 "no decode worker could take the KV handoff (last: %.400s)", t.last);
    else
        snprintf(f->fallback_cause, sizeof f->fallback_cause,
                 "no decode worker is serving to take the KV handoff");
    fprintf(stderr, "moe-coordinator: request %s: %s; recomputing on another worker\n",
            f->request_id, f->fallback_cause);
    handoff_release(g->p, g->hid, "no decode worker reachable");
    coord_metrics_handoff(c->metrics, "no_decode_worker", 0);
    coord_router_done(c, g->p);
    f->skip = f->n_tokens;
    f->skip_from = 0;
    return DISAGG_NO;
}

/* 3. The prefill worker pushes the KV to *d (rr: its reservation, freed
 * here). DISAGG_DECODE with f->handoff_id armed; a failed push releases
 * both sides and *d, and the request is recomputed. Releases p. */
static enum disagg_result disagg_send(struct disagg *g, struct coord_worker **d,
                                      Moe__V1__KvReserveResponse *rr)
{
    struct fwd *f = g->f;
    struct coord *c = g->c;
    struct coord_worker *p = g->p;
    enum disagg_result res;
    Moe__V1__KvSendRequest sq = MOE__V1__KV_SEND_REQUEST__INIT;
    sq.handoff_id = g->hid;
    sq.target_address = (*d)->address;
    sq.n_block_ids = rr->n_block_ids;
    sq.block_ids = rr->block_ids;
    sq.n_target_endpoints = rr->n_rank_endpoints;
    sq.target_endpoints = rr->rank_endpoints;
    sq.target_tp_size = rr->tp_size;
    sq.target_block_size = rr->block_size;
    int64_t send_ms = min64(HANDOFF_SEND_MS, ms_left(f));
    sq.deadline_ms = send_ms < 1 ? 1 : (uint32_t)send_ms;
    Moe__V1__KvSendResponse *sr = NULL;
    char m[512];
    enum rpc_code rc =
        worker_call(p, "/moe.v1.Worker/KvSend", &sq, &moe__v1__kv_send_response__descriptor,
                    (void **)&sr, send_ms + WORKER_DEADLINE_SLACK_MS, m, sizeof m);
    moe__v1__kv_reserve_response__free_unpacked(rr, NULL);
    f->transfer_ms = 1e3 * (moe_now() - g->t_reserve);
    f->disagg = true;
    if (rc == RPC_OK && sr && sr->ok) {
        coord_metrics_handoff(c->metrics, NULL, f->transfer_ms / 1e3);
        snprintf(f->handoff_id, sizeof f->handoff_id, "%s", g->hid);
        res = DISAGG_DECODE;
    } else {
        /* Both sides give the blocks up; the decode side recomputes. */
        fprintf(stderr,
                "moe-coordinator: request %s: KV handoff %s from %s to %s failed (%s: %s); "
                "recomputing\n",
                f->request_id, g->hid, p->id, (*d)->id, rpc_code_name(rc), m);
        /* The prefill worker's own failure (it answered nothing) takes it out
         * of routing; a failure it reports about the decode side does not. */
        if (rc == RPC_UNAVAILABLE && !strstr(m, "KvTransfer") && strncmp(m, "handoff ", 8))
            mark_down(c, p, "KvSend", m);
        coord_metrics_handoff(c->metrics, "send_failed", 0);
        handoff_release(*d, g->hid, "handoff failed");
        handoff_release(p, g->hid, "handoff failed");
        coord_router_done(c, *d);
        *d = NULL;
        f->skip = f->n_tokens;
        f->skip_from = 0;
        res = DISAGG_NO;
    }
    if (sr)
        moe__v1__kv_send_response__free_unpacked(sr, NULL);
    coord_router_done(c, p);
    return res;
}

/* Prefill on a prefill worker, reserve on a decode worker, move the KV.
 * On DISAGG_DECODE the caller runs the decode attempt on *d (one reference
 * and in_flight held, as from coord_router_pick). */
static enum disagg_result disagg_prepare(struct fwd *f, struct moe_detok *dt,
                                         struct coord_worker **d, enum rpc_code *code, char *msg,
                                         size_t cap)
{
    struct coord *c = f->c;
    *d = NULL;
    if (!has_role_serving(c, MOE__V1__WORKER_ROLE__WORKER_ROLE_DECODE))
        return DISAGG_NO;
    struct coord_worker *p = coord_router_pick_role(c, MOE__V1__WORKER_ROLE__WORKER_ROLE_PREFILL,
                                                    f->prompt, f->n_prompt, NULL, 0, 0);
    if (!p)
        return DISAGG_NO;
    struct disagg g = {.f = f, .c = c, .p = p, .code = code, .msg = msg, .cap = cap};
    static uint64_t seq;
    fix_seed(f);
    snprintf(f->handoff_id, sizeof f->handoff_id, "%s#%llu", f->request_id,
             (unsigned long long)__atomic_add_fetch(&seq, 1, __ATOMIC_RELAXED));
    snprintf(g.hid, sizeof g.hid, "%s", f->handoff_id);

    enum disagg_result res = disagg_prefill(&g, dt);
    if (res != DISAGG_NEXT)
        return res;
    Moe__V1__KvReserveResponse *rr = NULL;
    if ((res = disagg_reserve(&g, d, &rr)) != DISAGG_NEXT)
        return res;
    return disagg_send(&g, d, rr);
}

/* The client's cancel and Abort flags, read under f->mu. */
static void client_flags(struct fwd *f, bool *aborted, bool *cancelled)
{
    pthread_mutex_lock(&f->mu);
    *aborted = f->aborted;
    *cancelled = f->cancelled;
    pthread_mutex_unlock(&f->mu);
}

/* Before each attempt: an Abort, a cancel or a passed deadline ends the
 * request (code and msg set, an abort's last message sent). */
static bool ended_before_attempt(struct fwd *f, enum rpc_code *code, char *msg, size_t cap)
{
    bool aborted, cancelled;
    client_flags(f, &aborted, &cancelled);
    if (aborted) {
        send_abort_final(f);
        *code = RPC_OK;
        return true;
    }
    if (cancelled) {
        *code = RPC_CANCELLED;
        snprintf(msg, cap, "cancelled by the client");
        return true;
    }
    if (ms_left(f) <= 0) {
        *code = RPC_DEADLINE_EXCEEDED;
        snprintf(msg, cap, "deadline_ms passed before a worker was found");
        return true;
    }
    return false;
}

/* No worker left to try: words why. Returns RPC_UNAVAILABLE. */
static enum rpc_code no_worker(const struct fwd *f, size_t n_tried, const struct attempt *last,
                               char *msg, size_t cap)
{
    if (n_tried)
        snprintf(msg, cap, "no other worker is serving after a failure: %s", last->message);
    else if (f->fallback_cause[0])
        snprintf(msg, cap, "no worker can recompute the request: %s", f->fallback_cause);
    else
        snprintf(msg, cap, "no worker is serving model '%s'", f->c->model_name);
    return RPC_UNAVAILABLE;
}

/* Runs one attempt on w. When it continued a KV handoff the worker no
 * longer holds (expired, released), it is recomputed there at once (the
 * tokens sent so far are skipped). Reads the client's flags after it. */
static void attempt_on(struct fwd *f, struct coord_worker *w, struct moe_detok *dt,
                       struct attempt *at, bool *aborted, bool *cancelled)
{
    bool handoff = f->handoff_id[0] != '\0';
    attempt_run(f, w, dt, at);
    f->handoff_id[0] = '\0';
    client_flags(f, aborted, cancelled);
    if (handoff && at->n_msgs == 0 && !at->saw_final && !*aborted && !*cancelled &&
        !at->client_gone && !at->failed_local && at->code != RPC_UNAVAILABLE &&
        at->code != RPC_INVALID_ARGUMENT) {
        fprintf(stderr,
                "moe-coordinator: request %s: decode from handoff on %s refused (%s: "
                "%s); recomputing there\n",
                f->request_id, w->id, rpc_code_name(at->code), at->message);
        coord_metrics_handoff(f->c->metrics, "decode_refused", 0);
        f->skip = f->n_tokens;
        f->skip_from = 0;
        attempt_run(f, w, dt, at);
        client_flags(f, aborted, cancelled);
    } else if (handoff && at->n_msgs == 0 && !at->saw_final) {
        f->skip = f->n_tokens; /* a retry elsewhere recomputes */
        f->skip_from = 0;
    }
}

/* Takes a worker that answered UNAVAILABLE out of routing until a poll
 * answers (or says draining). */
static void mark_unavailable(struct coord *c, struct coord_worker *w, const char *message)
{
    pthread_mutex_lock(&c->mu);
    if (strstr(message, "draining"))
        w->reported_draining = true;
    else
        w->down = true;
    snprintf(w->last_error, sizeof w->last_error, "Generate: %.200s", message);
    pthread_mutex_unlock(&c->mu);
}

/* What the forwarding loop does after an attempt, in the order the cases
 * are told apart. Every value but AFTER_RETRY ends the request. */
enum after_attempt {
    AFTER_FINAL,     /* the worker sent its final message: its status is the request's */
    AFTER_ABORTED,   /* Abort(request_id): a last ABORT message, status OK */
    AFTER_CANCELLED, /* the client went away */
    AFTER_LOCAL,     /* failed here: out of memory, a malformed message, a recomputed token
                        that differs from the one sent */
    AFTER_RETRY,     /* failed before the worker did any work, retries left: another worker */
    AFTER_REFUSED,   /* the worker refused the request: its answer is passed on */
    AFTER_DEADLINE,  /* the deadline passed mid-stream */
    AFTER_STALLED,   /* the stall watchdog ended a stream that made no progress */
    AFTER_BROKEN,    /* the worker failed mid-stream */
};

/* The retry decision: how attempt `at` ended, after n_tried attempts. */
static enum after_attempt after_attempt(const struct attempt *at, bool aborted, bool cancelled,
                                        size_t n_tried)
{
    if (at->saw_final)
        return AFTER_FINAL;
    if (aborted)
        return AFTER_ABORTED;
    if (cancelled || at->client_gone)
        return AFTER_CANCELLED;
    if (at->failed_local)
        return AFTER_LOCAL;
    if (retryable(at) && n_tried <= COORD_MAX_RETRIES)
        return AFTER_RETRY;
    if (at->n_msgs == 0 && at->code != RPC_OK && !retryable(at))
        return AFTER_REFUSED;
    if (at->code == RPC_DEADLINE_EXCEEDED)
        return AFTER_DEADLINE;
    if (at->stalled_ms)
        return AFTER_STALLED;
    return AFTER_BROKEN;
}

/* Ends the request after its last attempt on worker `wid` (sends the last
 * message of an abort): returns its status, msg set. */
static enum rpc_code settle(struct fwd *f, enum after_attempt how, const struct attempt *at,
                            const char *wid, char *msg, size_t cap)
{
    switch (how) {
    case AFTER_FINAL:
        snprintf(msg, cap, "%s", at->message);
        return at->code; /* OK, or DEADLINE_EXCEEDED after the worker's deadline */
    case AFTER_ABORTED: send_abort_final(f); return RPC_OK;
    case AFTER_CANCELLED: snprintf(msg, cap, "cancelled by the client"); return RPC_CANCELLED;
    case AFTER_LOCAL: snprintf(msg, cap, "worker %s: %s", wid, at->message); return RPC_INTERNAL;
    case AFTER_REFUSED: snprintf(msg, cap, "%s", at->message); return at->code;
    case AFTER_DEADLINE:
        snprintf(msg, cap, "deadline passed after %u tokens", f->n_tokens);
        return RPC_DEADLINE_EXCEEDED;
    case AFTER_STALLED:
        snprintf(msg, cap,
                 "worker %s stalled after %u tokens: no message for %lld ms and no progress "
                 "on the worker (--stall-timeout-ms %d)",
                 wid, f->n_tokens, (long long)at->stalled_ms, f->c->opts.stall_timeout_ms);
        return RPC_UNAVAILABLE;
    case AFTER_RETRY: /* not an end: the caller retries */
    case AFTER_BROKEN: break;
    }
    snprintf(msg, cap, "worker %s failed after %u tokens: %s%s%.400s", wid, f->n_tokens,
             at->code == RPC_OK ? "stream ended without a final message" : rpc_code_name(at->code),
             at->message[0] ? ": " : "", at->message);
    return RPC_UNAVAILABLE;
}

/* The request is over: unlinks it, counts it, gives the sink its status
 * (no cancel after this) and frees it. */
static void fwd_finish(struct fwd *f, enum rpc_code code, const char *msg)
{
    struct coord *c = f->c;
    pthread_mutex_lock(&c->mu);
    for (struct fwd **p = &c->reqs; *p; p = &(*p)->next)
        if (*p == f) {
            *p = f->next;
            break;
        }
    c->n_running--;
    if (code != RPC_OK)
        c->n_failed++;
    pthread_mutex_unlock(&c->mu);

    if (code != RPC_OK)
        coord_metrics_failed(c->metrics, code);
    f->sink->finish(f->sink_user, code, code == RPC_OK ? NULL : msg); /* no cancel after this */
    fwd_free(f);

    pthread_mutex_lock(&c->mu);
    c->n_threads--;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->mu);
}

/* The forwarding thread: the prompt, then attempts (a disaggregated one
 * first when the cluster has prefill and decode workers) until one ends
 * the request. */
static void *fwd_thread(void *arg)
{
    struct fwd *f = arg;
    struct coord *c = f->c;
    char msg[1024] = "";
    enum rpc_code code = prepare_prompt(f, msg, sizeof msg);
    struct moe_detok dt;
    moe_detok_init(&dt, c->tok, f->rq->sampling ? f->rq->sampling->skip_special_tokens : false);
    struct coord_worker *tried[COORD_MAX_RETRIES + 1];
    size_t n_tried = 0;
    struct attempt at = {0};
    bool done = code != RPC_OK;
    bool disagg_tried = false;
    f->sampling = f->rq->sampling;
    while (!done) {
        if (ended_before_attempt(f, &code, msg, sizeof msg))
            break;
        struct coord_worker *w = NULL;
        if (!disagg_tried) {
            disagg_tried = true;
            enum disagg_result dr = disagg_prepare(f, &dt, &w, &code, msg, sizeof msg);
            if (dr == DISAGG_SETTLED)
                break;
            if (dr == DISAGG_NO)
                continue; /* re-checks cancel / abort / deadline, then a plain pick */
        }
        if (!w)
            w = coord_router_pick(c, f->prompt, f->n_prompt, tried, n_tried);
        if (!w) {
            code = no_worker(f, n_tried, &at, msg, sizeof msg);
            break;
        }
        bool aborted, cancelled;
        attempt_on(f, w, &dt, &at, &aborted, &cancelled);
        if (at.code == RPC_UNAVAILABLE && !aborted && !cancelled)
            mark_unavailable(c, w, at.message);
        tried[n_tried++] = w; /* pointer only: compared, never used after done() */
        char wid[400];
        snprintf(wid, sizeof wid, "%.150s at %.200s", w->id, w->address);
        coord_router_done(c, w);

        enum after_attempt how = after_attempt(&at, aborted, cancelled, n_tried);
        if (how == AFTER_RETRY) {
            fprintf(stderr,
                    "moe-coordinator: request %s: worker %s failed before the first "
                    "token (%s: %s); retrying elsewhere\n",
                    f->request_id, wid, rpc_code_name(at.code), at.message);
            continue;
        }
        code = settle(f, how, &at, wid, msg, sizeof msg);
        done = true;
    }
    moe_detok_free(&dt);
    fwd_finish(f, code, msg);
    return NULL;
}

/* ---- the handler part --------------------------------------------------------------- */

/* Checks that need no tokenizer. Returns RPC_OK or a code with msg set. */
static enum rpc_code check_request(struct coord *c, const Moe__V1__GenerateRequest *rq, char *msg,
                                   size_t cap)
{
    /* every string valid UTF-8 first: nothing below may echo invalid bytes */
    if (moe_check_strings(&rq->base, msg, cap))
        return RPC_INVALID_ARGUMENT;
    if (strlen(rq->model) > MOE_REQ_MAX_MODEL_LEN) {
        snprintf(msg, cap, "model: %zu bytes, at most %d allowed", strlen(rq->model),
                 MOE_REQ_MAX_MODEL_LEN);
        return RPC_INVALID_ARGUMENT;
    }
    if (rq->model[0] && strcmp(rq->model, c->model_name)) {
        snprintf(msg, cap, "model: '%s' is not served here (this cluster serves '%s')", rq->model,
                 c->model_name);
        return RPC_NOT_FOUND;
    }
    switch (rq->prompt_case) {
    case MOE__V1__GENERATE_REQUEST__PROMPT_TEXT: {
        size_t n = strlen(rq->text);
        if (n == 0) {
            snprintf(msg, cap, "prompt.text: empty");
            return RPC_INVALID_ARGUMENT;
        }
        if (n > MOE_REQ_MAX_PROMPT_BYTES) {
            snprintf(msg, cap, "prompt.text: %zu bytes, at most %u allowed", n,
                     MOE_REQ_MAX_PROMPT_BYTES);
            return RPC_INVALID_ARGUMENT;
        }
        break;
    }
    case MOE__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS:
        if (rq->token_ids &&
            moe_check_token_ids(rq->token_ids->ids, rq->token_ids->n_ids,
                                (unsigned)c->cfg.vocab_size, "prompt.token_ids", msg, cap))
            return RPC_INVALID_ARGUMENT;
        break;
    default:
        snprintf(msg, cap, "prompt: neither text nor token_ids is set");
        return RPC_INVALID_ARGUMENT;
    }
    /* the same checks as the worker's (common/request_check.c) */
    if (moe_check_generation(rq->request_id, rq->sampling, (unsigned)c->cfg.vocab_size, msg, cap))
        return RPC_INVALID_ARGUMENT;
    if (rq->stream_text && !c->tok) {
        snprintf(msg, cap, "stream_text: the coordinator has no tokenizer.json");
        return RPC_INVALID_ARGUMENT;
    }
    return RPC_OK;
}

enum rpc_code coord_request_start(struct coord *c, Moe__V1__GenerateRequest *rq,
                                  int64_t deadline_ms_left, const struct coord_sink *sink,
                                  void *sink_user, char *msg, size_t cap)
{
    enum rpc_code code = RPC_OK;
    struct fwd *f = NULL;
    if ((code = check_request(c, rq, msg, cap)))
        goto fail;
    f = calloc(1, sizeof *f);
    if (!f) {
        code = RPC_RESOURCE_EXHAUSTED;
        snprintf(msg, cap, "out of memory");
        goto fail;
    }
    pthread_mutex_init(&f->mu, NULL);
    f->c = c;
    f->sink = sink;
    f->sink_user = sink_user;
    f->rq = rq;
    f->t_recv = moe_now();
    int64_t left = deadline_ms_left;
    if (rq->deadline_ms && (int64_t)rq->deadline_ms < left)
        left = rq->deadline_ms;
    if (left != INT64_MAX)
        f->deadline = f->t_recv + (double)left / 1e3;

    pthread_mutex_lock(&c->mu);
    if (c->n_running >= c->opts.max_queue) {
        pthread_mutex_unlock(&c->mu);
        code = RPC_RESOURCE_EXHAUSTED;
        snprintf(msg, cap, "%d requests in flight (--max-queue %d): try again later",
                 c->opts.max_queue, c->opts.max_queue);
        goto fail;
    }
    if (rq->request_id[0]) {
        for (struct fwd *o = c->reqs; o; o = o->next)
            if (!strcmp(o->request_id, rq->request_id)) {
                pthread_mutex_unlock(&c->mu);
                code = RPC_ALREADY_EXISTS;
                snprintf(msg, cap, "request_id: '%s' is already running", rq->request_id);
                goto fail;
            }
        snprintf(f->request_id, sizeof f->request_id, "%s", rq->request_id);
    } else {
        snprintf(f->request_id, sizeof f->request_id, "coord-%llu",
                 (unsigned long long)++c->next_auto_id);
    }
    f->next = c->reqs;
    c->reqs = f;
    c->n_running++;
    c->n_threads++;
    c->n_total++;
    pthread_mutex_unlock(&c->mu);

    sink->attach(sink_user, f);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t th;
    int rc = pthread_create(&th, &attr, fwd_thread, f);
    pthread_attr_destroy(&attr);
    if (rc == 0)
        return RPC_OK;
    /* No thread: undo the registration and end it here (attached: the sink
     * hears the end). */
    pthread_mutex_lock(&c->mu);
    for (struct fwd **p = &c->reqs; *p; p = &(*p)->next)
        if (*p == f) {
            *p = f->next;
            break;
        }
    c->n_running--;
    c->n_threads--;
    c->n_failed++;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->mu);
    coord_metrics_failed(c->metrics, RPC_RESOURCE_EXHAUSTED);
    sink->finish(sink_user, RPC_RESOURCE_EXHAUSTED, "cannot start a forwarding thread");
    fwd_free(f);
    return RPC_OK;

fail:
    pthread_mutex_lock(&c->mu);
    c->n_total++;
    c->n_failed++;
    pthread_mutex_unlock(&c->mu);
    coord_metrics_failed(c->metrics, code);
    if (f)
        f->rq = NULL; /* freed below */
    fwd_free(f);
    moe__v1__generate_request__free_unpacked(rq, NULL);
    return code;
}

/* ---- the gRPC face: Generate ---------------------------------------------------------- */

static void grpc_on_cancel(struct rpc_stream *stream, void *user)
{
    (void)stream;
    coord_request_cancel(user);
}

static void grpc_attach(void *user, struct fwd *f)
{
    rpc_stream_set_on_cancel(user, grpc_on_cancel, f);
}

static bool grpc_send(void *user, const Moe__V1__GenerateResponse *m)
{
    size_t len;
    void *bytes = rpc_pack(m, &len);
    if (!bytes)
        return false;
    enum moe_status st = rpc_stream_send(user, bytes, len);
    free(bytes);
    return st == MOE_OK;
}

static void grpc_finish(void *user, enum rpc_code code, const char *msg)
{
    rpc_stream_finish(user, code, msg);
    rpc_stream_release(user); /* waits for a running on_cancel; none fires after */
}

static const struct coord_sink grpc_sink = {grpc_attach, grpc_send, grpc_finish};

void coord_generate_start(struct coord *c, struct rpc_stream *stream, const uint8_t *req,
                          size_t len)
{
    char msg[1024];
    Moe__V1__GenerateRequest *rq = moe__v1__generate_request__unpack(NULL, len, req);
    enum rpc_code code;
    if (!rq) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg, "request: not a valid moe.v1.GenerateRequest message");
        pthread_mutex_lock(&c->mu);
        c->n_total++;
        c->n_failed++;
        pthread_mutex_unlock(&c->mu);
        coord_metrics_failed(c->metrics, code);
    } else {
        code = coord_request_start(c, rq, rpc_stream_deadline_ms_left(stream), &grpc_sink, stream,
                                   msg, sizeof msg);
    }
    if (code == RPC_OK)
        return;
    rpc_stream_finish(stream, code, msg);
    rpc_stream_release(stream);
}
