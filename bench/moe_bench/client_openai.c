/* The OpenAI backend: streaming completions / chat completions over
 * libcurl, the SSE stream parsed as bytes arrive (sse.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "client_internal.h"
#include "tls_opts.h"
#include "sse.h"
#include "clock.h"

/* The state of one streaming request, seen by the curl callbacks. */
struct stream_state {
    struct bench_record *rec;
    CURL *curl;
    bool chat;
    double t0;
    long http; /* status, read at the first body byte */
    struct sse_parser sse;
    char body[256]; /* start of a non-200 body, for the error line */
    size_t body_len;
    bool done, bad_json, nomem;
    char stream_error[200];
};

static const char *curl_status(CURLcode rc)
{
    switch (rc) {
    case CURLE_COULDNT_CONNECT: return "CONNECT";
    case CURLE_COULDNT_RESOLVE_HOST: return "RESOLVE";
    case CURLE_OPERATION_TIMEDOUT: return "TIMEOUT";
    case CURLE_RECV_ERROR: return "RECV";
    case CURLE_SEND_ERROR: return "SEND";
    case CURLE_GOT_NOTHING: return "EMPTY_REPLY";
    case CURLE_PARTIAL_FILE: return "PARTIAL";
    default: return "CURL";
    }
}

static int on_event(void *user, const char *data, size_t len)
{
    struct stream_state *s = user;
    double now = moe_now();
    if (len == 6 && !memcmp(data, "[DONE]", 6)) {
        s->done = true;
        return 0;
    }
    cJSON *j = cJSON_ParseWithLength(data, len);
    if (!j) {
        s->bad_json = true;
        return 1;
    }
    struct bench_record *rec = s->rec;
    cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "error");
    if (e) {
        cJSON *m = cJSON_IsObject(e) ? cJSON_GetObjectItemCaseSensitive(e, "message") : e;
        snprintf(s->stream_error, sizeof s->stream_error, "%s",
                 cJSON_IsString(m) ? m->valuestring : "error object in the stream");
    }
    cJSON *choices = cJSON_GetObjectItemCaseSensitive(j, "choices");
    cJSON *c0 = cJSON_IsArray(choices) ? cJSON_GetArrayItem(choices, 0) : NULL;
    if (c0) {
        const cJSON *txt;
        if (s->chat) {
            cJSON *delta = cJSON_GetObjectItemCaseSensitive(c0, "delta");
            txt = delta ? cJSON_GetObjectItemCaseSensitive(delta, "content") : NULL;
        } else {
            txt = cJSON_GetObjectItemCaseSensitive(c0, "text");
        }
        if (cJSON_IsString(txt) && txt->valuestring[0]) {
            if (bench_record_add_chunk(rec, now - s->t0, 1))
                s->nomem = true;
            rec->counted_tokens++;
        }
        cJSON *fr = cJSON_GetObjectItemCaseSensitive(c0, "finish_reason");
        if (cJSON_IsString(fr))
            snprintf(rec->finish, sizeof rec->finish, "%s", fr->valuestring);
    }
    cJSON *usage = cJSON_GetObjectItemCaseSensitive(j, "usage");
    if (cJSON_IsObject(usage)) {
        cJSON *pt = cJSON_GetObjectItemCaseSensitive(usage, "prompt_tokens");
        cJSON *ct = cJSON_GetObjectItemCaseSensitive(usage, "completion_tokens");
        if (cJSON_IsNumber(pt))
            rec->server_prompt_tokens = (int32_t)pt->valuedouble;
        if (cJSON_IsNumber(ct))
            rec->server_completion_tokens = (int32_t)ct->valuedouble;
        cJSON *det = cJSON_GetObjectItemCaseSensitive(usage, "prompt_tokens_details");
        cJSON *cached = det ? cJSON_GetObjectItemCaseSensitive(det, "cached_tokens") : NULL;
        if (cJSON_IsNumber(cached))
            rec->server_cached_tokens = (int32_t)cached->valuedouble;
    }
    cJSON_Delete(j);
    return s->nomem ? 1 : 0;
}

static size_t on_body(char *ptr, size_t size, size_t nmemb, void *user)
{
    struct stream_state *s = user;
    size_t n = size * nmemb;
    if (!s->http)
        curl_easy_getinfo(s->curl, CURLINFO_RESPONSE_CODE, &s->http);
    if (s->http != 200) {
        size_t room = sizeof s->body - 1 - s->body_len;
        size_t k = n < room ? n : room;
        memcpy(s->body + s->body_len, ptr, k);
        s->body_len += k;
        s->body[s->body_len] = 0;
        return n;
    }
    if (sse_feed(&s->sse, ptr, n))
        return 0; /* abort the transfer: bad JSON or no memory */
    return n;
}

/* TLS from --tls-*: the CA and the client certificate as PEM blobs. */
static void set_tls(CURL *h, const struct bench_target *t)
{
    if (!t->o.tls)
        return;
    const struct moe_tls_material *m = moe_tls_current(t->o.tls);
    if (m->ca_pem) {
        struct curl_blob ca = {(void *)m->ca_pem, strlen(m->ca_pem), CURL_BLOB_COPY};
        curl_easy_setopt(h, CURLOPT_CAINFO_BLOB, &ca);
    }
    if (m->cert_pem) {
        struct curl_blob c = {(void *)m->cert_pem, strlen(m->cert_pem), CURL_BLOB_COPY};
        struct curl_blob k = {(void *)m->key_pem, strlen(m->key_pem), CURL_BLOB_COPY};
        curl_easy_setopt(h, CURLOPT_SSLCERT_BLOB, &c);
        curl_easy_setopt(h, CURLOPT_SSLCERTTYPE, "PEM");
        curl_easy_setopt(h, CURLOPT_SSLKEY_BLOB, &k);
        curl_easy_setopt(h, CURLOPT_SSLKEYTYPE, "PEM");
    }
}

static struct curl_slist *make_headers(const struct bench_target *t, const char *request_id)
{
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    h = curl_slist_append(h, "Accept: text/event-stream");
    const char *key = t->o.api_key ? t->o.api_key : getenv("OPENAI_API_KEY");
    if (key && key[0]) {
        char line[1024];
        snprintf(line, sizeof line, "Authorization: Bearer %s", key);
        h = curl_slist_append(h, line);
    }
    if (request_id) {
        char line[300];
        snprintf(line, sizeof line, "X-Request-Id: %s", request_id);
        h = curl_slist_append(h, line);
    }
    return h;
}

static char *make_body(const struct bench_target *t, const struct bench_item *item)
{
    cJSON *b = cJSON_CreateObject();
    if (!b)
        return NULL;
    if (t->model[0])
        cJSON_AddStringToObject(b, "model", t->model);
    if (t->chat) {
        cJSON *msgs = cJSON_AddArrayToObject(b, "messages");
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "user");
        cJSON_AddStringToObject(m, "content", item->text ? item->text : "");
        cJSON_AddItemToArray(msgs, m);
    } else if (t->o.prompt_tokens || !item->text) {
        cJSON *p = cJSON_AddArrayToObject(b, "prompt");
        for (int i = 0; i < item->n_ids; i++)
            cJSON_AddItemToArray(p, cJSON_CreateNumber(item->ids[i]));
    } else {
        cJSON_AddStringToObject(b, "prompt", item->text);
    }
    cJSON_AddNumberToObject(b, "max_tokens", item->output_len);
    cJSON_AddBoolToObject(b, "stream", 1);
    cJSON *so = cJSON_AddObjectToObject(b, "stream_options");
    cJSON_AddBoolToObject(so, "include_usage", 1);
    if (t->o.ignore_eos)
        cJSON_AddBoolToObject(b, "ignore_eos", 1);
    if (t->o.has_temperature)
        cJSON_AddNumberToObject(b, "temperature", t->o.temperature);
    if (t->o.top_p > 0)
        cJSON_AddNumberToObject(b, "top_p", t->o.top_p);
    if (t->o.top_k > 0)
        cJSON_AddNumberToObject(b, "top_k", t->o.top_k);
    char *s = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    return s;
}

void bench_openai_run(struct bench_conn *c, const struct bench_item *item, const char *request_id,
                      double t_origin, struct bench_record *rec)
{
    struct bench_target *t = c->t;
    char *body = make_body(t, item);
    struct curl_slist *hdr = make_headers(t, request_id);
    if (!body || !hdr) {
        free(body);
        curl_slist_free_all(hdr);
        bench_fail(rec, "NOMEM", "out of memory");
        return;
    }
    struct stream_state s = {.rec = rec, .curl = c->curl, .chat = t->chat};
    sse_init(&s.sse, on_event, &s);
    char errbuf[CURL_ERROR_SIZE] = "";
    CURL *h = c->curl;
    curl_easy_reset(h);
    curl_easy_setopt(h, CURLOPT_URL, t->api_url);
    set_tls(h, t);
    curl_easy_setopt(h, CURLOPT_POST, 1L);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &s);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, errbuf);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 10000L);
    if (t->o.timeout_s > 0)
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(t->o.timeout_s * 1e3));
    s.t0 = moe_now();
    rec->start_s = s.t0 - t_origin;
    CURLcode rc = curl_easy_perform(h);
    if (rc == CURLE_OK && s.http == 200)
        sse_finish(&s.sse);
    long http = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &http);
    if (s.bad_json)
        bench_fail(rec, "BAD_JSON", "an SSE event's data is not JSON");
    else if (s.nomem || s.sse.nomem)
        bench_fail(rec, "NOMEM", "out of memory");
    else if (rc != CURLE_OK)
        bench_fail(rec, curl_status(rc), "%s: %s", t->api_url,
                   errbuf[0] ? errbuf : curl_easy_strerror(rc));
    else if (http != 200) {
        char st[32];
        snprintf(st, sizeof st, "HTTP %ld", http);
        bench_fail(rec, st, "%s: %s", t->api_url, s.body);
    } else if (s.stream_error[0])
        bench_fail(rec, "STREAM_ERROR", "%s", s.stream_error);
    else if (rec->n_chunks == 0)
        bench_fail(rec, "NO_TOKENS", "the stream carried no token");
    else {
        bench_finish_ok(rec);
        /* Chunks count one token each unless the usage says more came. */
        int extra = rec->server_completion_tokens - rec->counted_tokens;
        if (extra > 0)
            rec->chunk_n[rec->n_chunks - 1] += extra;
    }
    sse_free(&s.sse);
    curl_slist_free_all(hdr);
    free(body);
}

static size_t on_models(char *ptr, size_t size, size_t nmemb, void *user)
{
    char *buf = user; /* 8 KiB, NUL-terminated */
    size_t have = strlen(buf), n = size * nmemb, room = 8191 - have;
    memcpy(buf + have, ptr, n < room ? n : room);
    buf[have + (n < room ? n : room)] = 0;
    return n;
}

enum moe_status bench_openai_probe(struct bench_target *t, double timeout_s, char *model,
                                   size_t model_cap, int *vocab, struct moe_error *err)
{
    CURL *h = curl_easy_init();
    if (!h)
        return moe_error_set(err, MOE_ERR_NOMEM, "curl_easy_init failed");
    char *buf = calloc(1, 8192);
    char errbuf[CURL_ERROR_SIZE] = "";
    if (!buf) {
        curl_easy_cleanup(h);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    struct curl_slist *hdr = make_headers(t, NULL);
    curl_easy_setopt(h, CURLOPT_URL, t->models_url);
    set_tls(h, t);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_models);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, buf);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, errbuf);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1e3));
    CURLcode rc = curl_easy_perform(h);
    long http = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &http);
    curl_slist_free_all(hdr);
    curl_easy_cleanup(h);
    enum moe_status st = MOE_OK;
    if (rc != CURLE_OK) {
        st = moe_error_set(err, MOE_ERR_IO, "cannot reach the OpenAI server at %s: %s", t->url,
                           errbuf[0] ? errbuf : curl_easy_strerror(rc));
    } else if (http == 200) {
        /* {"data": [{"id": "name", ...}]}: the first model, if any. */
        cJSON *j = cJSON_Parse(buf);
        cJSON *data = j ? cJSON_GetObjectItemCaseSensitive(j, "data") : NULL;
        cJSON *m0 = cJSON_IsArray(data) ? cJSON_GetArrayItem(data, 0) : NULL;
        cJSON *id = m0 ? cJSON_GetObjectItemCaseSensitive(m0, "id") : NULL;
        if (cJSON_IsString(id))
            snprintf(model, model_cap, "%s", id->valuestring);
        cJSON_Delete(j);
    } /* another status: the server has no /v1/models; requests will tell */
    free(buf);
    *vocab = 0;
    return st;
}
