#include "engine/offline.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/generate.h"

/* ---- parsing ----------------------------------------------------------------------- */

struct line_ctx {
    const char *path;
    int line;
    struct moe_error *err;
};

static enum moe_status bad(struct line_ctx *c, const char *field, const char *what)
{
    return moe_error_set(c->err, MOE_ERR_FORMAT, "%s:%d: field '%s' %s", c->path, c->line, field,
                         what);
}

static enum moe_status get_num(struct line_ctx *c, const cJSON *o, const char *field, double lo,
                               double hi, bool integer, double *out, bool *present)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, field);
    *present = v != NULL;
    if (!v)
        return MOE_OK;
    if (!cJSON_IsNumber(v))
        return bad(c, field, "must be a number");
    double d = v->valuedouble;
    if (!(d >= lo && d <= hi) || (integer && d != floor(d))) {
        char msg[128];
        snprintf(msg, sizeof msg, "is %g, must be %s in [%g, %g]", d,
                 integer ? "a whole number" : "a number", lo, hi);
        return bad(c, field, msg);
    }
    *out = d;
    return MOE_OK;
}

static enum moe_status get_int_array(struct line_ctx *c, const cJSON *v, const char *field,
                                     int64_t lo, int64_t hi, int max_n, int32_t **out, int *n)
{
    if (!cJSON_IsArray(v))
        return bad(c, field, "must be an array of whole numbers");
    int len = cJSON_GetArraySize(v);
    if (len > max_n) {
        char msg[64];
        snprintf(msg, sizeof msg, "has %d entries, at most %d allowed", len, max_n);
        return bad(c, field, msg);
    }
    int32_t *ids = malloc(((size_t)len + 1) * sizeof *ids);
    if (!ids)
        return moe_error_set(c->err, MOE_ERR_NOMEM, "out of memory");
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, v)
    {
        double d = cJSON_IsNumber(it) ? it->valuedouble : NAN;
        if (!(d >= (double)lo && d < (double)hi) || d != floor(d)) {
            free(ids);
            char msg[96];
            snprintf(msg, sizeof msg, "entry %d is not a whole number in [%lld, %lld)", i,
                     (long long)lo, (long long)hi);
            return bad(c, field, msg);
        }
        ids[i++] = (int32_t)d;
    }
    *out = ids;
    *n = len;
    return MOE_OK;
}

static enum moe_status parse_params(struct line_ctx *c, const cJSON *o,
                                    struct moe_request_params *p)
{
    double d = 0;
    bool has = false;
    enum moe_status rc;
#define NUM(field, lo, hi, integer, dst)                                                           \
    do {                                                                                           \
        if ((rc = get_num(c, o, field, lo, hi, integer, &d, &has)))                                \
            return rc;                                                                             \
        if (has)                                                                                   \
            dst = d;                                                                               \
    } while (0)
    NUM("max_tokens", 1, 1 << 24, true, p->max_tokens);
    NUM("min_tokens", 0, 1 << 24, true, p->min_tokens);
    NUM("temperature", 0, 100, false, p->sp.temperature);
    NUM("top_p", 0, 1, false, p->sp.top_p);
    NUM("top_k", 0, 1 << 30, true, p->sp.top_k);
    NUM("min_p", 0, 1, false, p->sp.min_p);
    NUM("repetition_penalty", 0, 10, false, p->sp.repetition_penalty);
    NUM("presence_penalty", -2, 2, false, p->sp.presence_penalty);
    NUM("frequency_penalty", -2, 2, false, p->sp.frequency_penalty);
    NUM("logprobs", -1, MOE_MAX_LOGPROBS, true, p->logprobs);
#undef NUM
    if ((rc = get_num(c, o, "seed", 0, 9007199254740992.0, true, &d, &has)))
        return rc;
    if (has) {
        p->has_seed = true;
        p->seed = (uint64_t)d;
    }
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, "ignore_eos");
    if (v) {
        if (!cJSON_IsBool(v))
            return bad(c, "ignore_eos", "must be true or false");
        p->ignore_eos = cJSON_IsTrue(v);
    }
    v = cJSON_GetObjectItemCaseSensitive(o, "stop");
    if (v) {
        if (cJSON_IsString(v) || !cJSON_IsArray(v))
            return bad(c, "stop", "must be an array of strings");
        int n = cJSON_GetArraySize(v);
        if (n > MOE_MAX_STOP_STRINGS)
            return bad(c, "stop", "has too many strings (at most 8)");
        p->n_stop_strings = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, v)
        {
            size_t len = cJSON_IsString(it) ? strlen(it->valuestring) : 0;
            if (len == 0 || len > MOE_MAX_STOP_LEN)
                return bad(c, "stop", "entries must be strings of 1 to 128 bytes");
            memcpy(p->stop_strings[p->n_stop_strings++], it->valuestring, len + 1);
        }
    }
    v = cJSON_GetObjectItemCaseSensitive(o, "stop_token_ids");
    if (v) {
        int32_t *ids;
        int n;
        if ((rc = get_int_array(c, v, "stop_token_ids", 0, INT32_MAX, MOE_MAX_STOP_IDS, &ids, &n)))
            return rc;
        memcpy(p->stop_ids, ids, (size_t)n * sizeof *ids);
        p->n_stop_ids = n;
        free(ids);
    }
    v = cJSON_GetObjectItemCaseSensitive(o, "logit_bias");
    if (v) { /* {"token id": bias}: ids and values checked by the engine */
        if (!cJSON_IsObject(v) || cJSON_GetArraySize(v) > MOE_MAX_LOGIT_BIAS)
            return bad(c, "logit_bias", "must be an object of at most 300 \"token id\": bias");
        p->n_logit_bias = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, v)
        {
            char *end = NULL;
            long id = strtol(it->string, &end, 10);
            if (!it->string[0] || *end || id < 0 || id > INT32_MAX || !cJSON_IsNumber(it))
                return bad(c, "logit_bias", "keys must be token ids and values numbers");
            p->bias_ids[p->n_logit_bias] = (int32_t)id;
            p->logit_bias[p->n_logit_bias++] = (float)it->valuedouble;
        }
    }
    return MOE_OK;
}

static enum moe_status parse_line(struct line_ctx *c, const char *text, struct moe_tokenizer *tok,
                                  int vocab, struct moe_offline_request *r)
{
    cJSON *o = cJSON_Parse(text);
    if (!o || !cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return moe_error_set(c->err, MOE_ERR_FORMAT, "%s:%d: not a JSON object", c->path, c->line);
    }
    enum moe_status rc = parse_params(c, o, &r->params);
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(o, "prompt");
    const cJSON *tokens = cJSON_GetObjectItemCaseSensitive(o, "tokens");
    if (!rc && !prompt == !tokens)
        rc = moe_error_set(c->err, MOE_ERR_FORMAT,
                           "%s:%d: give exactly one of 'prompt' or 'tokens'", c->path, c->line);
    if (!rc && tokens)
        rc = get_int_array(c, tokens, "tokens", 0, vocab, 1 << 24, &r->prompt, &r->n_prompt);
    if (!rc && prompt) {
        if (!cJSON_IsString(prompt))
            rc = bad(c, "prompt", "must be a string");
        else if (!tok)
            rc = bad(c, "prompt", "needs the model's tokenizer.json (use 'tokens' instead)");
        else {
            size_t n = 0;
            rc = moe_tokenizer_encode(tok, prompt->valuestring, strlen(prompt->valuestring), true,
                                      &r->prompt, &n, c->err);
            if (rc)
                moe_error_prefix(c->err, "%s:%d: field 'prompt'", c->path, c->line);
            r->n_prompt = (int)n;
        }
    }
    if (!rc && r->n_prompt == 0)
        rc = bad(c, prompt ? "prompt" : "tokens", "is empty");
    cJSON_Delete(o);
    return rc;
}

enum moe_status moe_offline_load(const char *path, struct moe_tokenizer *tok,
                                 const struct moe_request_params *defaults, int vocab,
                                 struct moe_offline_set *out, struct moe_error *err)
{
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "rb");
    if (!f)
        return moe_error_set(err, MOE_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int cap_req = 0;
    struct line_ctx c = {.path = path, .err = err};
    enum moe_status rc = MOE_OK;
    while (!rc && (len = getline(&line, &cap, f)) >= 0) {
        c.line++;
        bool blank = true;
        for (ssize_t i = 0; i < len && blank; i++)
            blank = line[i] == ' ' || line[i] == '\t' || line[i] == '\n' || line[i] == '\r';
        if (blank)
            continue;
        if (out->n == cap_req) {
            cap_req = cap_req ? cap_req * 2 : 64;
            struct moe_offline_request *grown = realloc(out->req, (size_t)cap_req * sizeof *grown);
            if (!grown) {
                rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
                break;
            }
            out->req = grown;
        }
        struct moe_offline_request *r = &out->req[out->n];
        memset(r, 0, sizeof *r);
        r->params = *defaults;
        r->line = c.line;
        r->text_len = -1;
        rc = parse_line(&c, line, tok, vocab, r);
        if (rc)
            free(r->prompt);
        else
            out->n++;
    }
    free(line);
    fclose(f);
    if (!rc && out->n == 0)
        rc = moe_error_set(err, MOE_ERR_FORMAT, "%s: no prompts", path);
    if (rc)
        moe_offline_free(out);
    return rc;
}

void moe_offline_free(struct moe_offline_set *set)
{
    for (int i = 0; i < set->n; i++) {
        free(set->req[i].prompt);
        free(set->req[i].out);
    }
    free(set->req);
    memset(set, 0, sizeof *set);
}

/* ---- running ------------------------------------------------------------------------- */

static void on_token(void *user, const struct moe_token_event *ev)
{
    struct moe_offline_request *r = user;
    double now = moe_now();
    if (ev->token >= 0) {
        if (r->n_out == 0)
            r->t_first = now;
        r->out[r->n_out++] = ev->token;
    }
    if (ev->finish) {
        r->finish = ev->finish;
        r->text_len = ev->text_len;
        r->t_done = now;
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

enum moe_status moe_offline_run(struct moe_engine *e, struct moe_offline_set *set, int block_size,
                                struct moe_offline_report *rep, struct moe_error *err)
{
    memset(rep, 0, sizeof *rep);
    rep->kv_util_min = 1.0;
    double t0 = moe_now();
    for (int i = 0; i < set->n; i++) {
        struct moe_offline_request *r = &set->req[i];
        r->out = malloc(((size_t)r->params.max_tokens + 1) * sizeof *r->out);
        if (!r->out)
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        r->t_submit = moe_now();
        enum moe_status rc =
            moe_engine_submit(e, (uint64_t)i, r->prompt, r->n_prompt, &r->params, on_token, r, err);
        if (rc)
            return moe_error_prefix(err, "prompt on line %d", r->line);
        rep->prompt_tokens += r->n_prompt;
    }
    double util_sum = 0;
    int util_n = 0;
    double *dstep = NULL; /* steady-state decode step durations */
    int64_t n_dstep = 0, cap_dstep = 0, n_full = 0;
    while (moe_engine_busy(e)) {
        int n_tok = 0;
        double ts = moe_now();
        enum moe_status rc = moe_engine_step(e, &n_tok, err);
        double dt = moe_now() - ts;
        if (rc) {
            free(dstep);
            return rc;
        }
        struct moe_engine_stats st;
        moe_engine_stats(e, &st);
        /* every request running, one token each (its finish may end the
         * step's sequence: running counts it until the step is over) */
        if (n_tok > 0 && n_tok == set->n && st.waiting == 0 && n_full++ >= 2) {
            if (n_dstep == cap_dstep) {
                cap_dstep = cap_dstep ? 2 * cap_dstep : 64;
                double *g = realloc(dstep, (size_t)cap_dstep * sizeof *g);
                if (!g) {
                    free(dstep);
                    return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
                }
                dstep = g;
            }
            dstep[n_dstep++] = dt;
        }
        if (st.running > rep->peak_running)
            rep->peak_running = st.running;
        if (st.kv_blocks_used > 0) {
            double u = (double)st.kv_tokens_stored / ((double)st.kv_blocks_used * block_size);
            util_sum += u;
            util_n++;
            if (u < rep->kv_util_min)
                rep->kv_util_min = u;
        }
    }
    rep->wall_s = moe_now() - t0;
    if (n_dstep) {
        qsort(dstep, (size_t)n_dstep, sizeof *dstep, cmp_double);
        rep->decode_steps = n_dstep;
        rep->decode_step_p50_s = dstep[n_dstep / 2];
        rep->decode_step_p10_s = dstep[n_dstep / 10];
        rep->decode_step_p90_s = dstep[(n_dstep * 9) / 10];
    }
    free(dstep);
    struct moe_engine_stats st;
    moe_engine_stats(e, &st);
    rep->steps = st.steps;
    rep->preemptions = st.preemptions;
    rep->prefix_hit_tokens = st.prefix_hit_tokens;
    rep->spec_draft_tokens = st.spec_draft_tokens;
    rep->spec_accepted_tokens = st.spec_accepted_tokens;
    rep->kv_util_mean = util_n ? util_sum / util_n : 0;
    double *ttft = malloc((size_t)set->n * sizeof *ttft);
    double tpot_sum = 0;
    int64_t tpot_n = 0;
    for (int i = 0; i < set->n; i++) {
        const struct moe_offline_request *r = &set->req[i];
        rep->output_tokens += r->n_out;
        ttft[i] = r->n_out ? r->t_first - r->t_submit : 0;
        if (r->n_out > 1) {
            tpot_sum += r->t_done - r->t_first;
            tpot_n += r->n_out - 1;
        }
    }
    if (ttft) {
        qsort(ttft, (size_t)set->n, sizeof *ttft, cmp_double);
        double s = 0;
        for (int i = 0; i < set->n; i++)
            s += ttft[i];
        rep->ttft_mean_s = s / set->n;
        rep->ttft_p50_s = ttft[set->n / 2];
        rep->ttft_p99_s = ttft[(int)((set->n - 1) * 0.99)];
        free(ttft);
    }
    rep->tpot_mean_s = tpot_n ? tpot_sum / (double)tpot_n : 0;
    return MOE_OK;
}
