/* etcd v3 over the HTTP/JSON gateway: see etcd.h.
 *
 * Wire facts this file relies on (etcd 3.4): every call is a POST of a JSON
 * body to /v3/...; keys and values are base64; 64-bit numbers are JSON
 * strings; fields at their default value are omitted (no "succeeded" on a
 * failed txn, no "type" on a PUT event, no "TTL" on the keepalive of a lost
 * lease); errors come as {"error":"...","message":"...","code":N} with a
 * gRPC code, and streaming endpoints (watch, keepalive) wrap each answer in
 * {"result":...} or end with an in-band {"error":{...}} line. */
#include "etcd.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <curl/curl.h>

#include "base64.h"
#include "clock.h"

#define ETCD_URL_MAX 1024
#define ETCD_MAX_RESPONSE (256u << 20)  /* unary answers (a large prefix read) */
#define ETCD_MAX_WATCH_LINE (64u << 20) /* one watch answer */
#define ETCD_WATCH_BACKOFF_MIN_MS 50
#define ETCD_WATCH_BACKOFF_MAX_MS 1000
#define ETCD_KEEPER_RETRY_MS 200

/* ---- small helpers ------------------------------------------------------- */

static pthread_once_t etcd_curl_once = PTHREAD_ONCE_INIT;
static CURLcode etcd_curl_init_rc;

static void etcd_curl_init(void)
{
    etcd_curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT);
}

/* curl_global_init once per process (never cleaned up: other threads may
 * still hold handles at exit). */
static enum moe_status etcd_global_init(struct moe_error *err)
{
    pthread_once(&etcd_curl_once, etcd_curl_init);
    if (etcd_curl_init_rc != CURLE_OK)
        return moe_error_set(err, MOE_ERR_INTERNAL, "etcd: curl_global_init failed: %s",
                             curl_easy_strerror(etcd_curl_init_rc));
    return MOE_OK;
}

/* A printable, bounded copy of `s` for error messages. */
static const char *printable(const char *s, size_t n, char *buf, size_t cap)
{
    size_t o = 0;
    for (size_t i = 0; i < n && o + 4 < cap; i++) {
        unsigned char ch = (unsigned char)s[i];
        buf[o++] = ch >= 0x20 && ch < 0x7f ? (char)ch : '?';
    }
    if (o + 4 >= cap && n > o) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
    return buf;
}

/* Growable byte buffer. */
struct etcd_buf {
    char *data;
    size_t len;
    size_t cap;
};

/* Appends n bytes; returns 0 when the buffer would pass `max` bytes or on
 * allocation failure. */
static int buf_append(struct etcd_buf *b, const void *p, size_t n, size_t max)
{
    if (n > max - b->len)
        return 0;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d)
            return 0;
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = '\0';
    return 1;
}

/* ---- TLS ------------------------------------------------------------------- */

/* Set once by a main before any client exists (moe_etcd_set_tls); only read
 * afterwards. "" = not set. */
static char etcd_tls_cacert[4096], etcd_tls_cert[4096], etcd_tls_key[4096];

bool moe_etcd_tls_cli_flag(struct moe_etcd_tls *t, const char *k, const char *v)
{
    if (!strcmp(k, "--etcd-cacert"))
        t->cacert = v;
    else if (!strcmp(k, "--etcd-cert"))
        t->cert = v;
    else if (!strcmp(k, "--etcd-key"))
        t->key = v;
    else if (!strcmp(k, "--etcd-tls-dir"))
        t->dir = v;
    else
        return false;
    return true;
}

/* Copies `path` (readable) into buf, or the file NAME of `dir` when it exists. */
static enum moe_status tls_path(char *buf, size_t cap, const char *flag, const char *path,
                                const char *dir, const char *name, struct moe_error *err)
{
    buf[0] = '\0';
    char p[4096];
    if (!path && dir) {
        snprintf(p, sizeof p, "%s/%s", dir, name);
        if (access(p, F_OK) != 0)
            return MOE_OK;
        path = p;
        flag = "--etcd-tls-dir";
    }
    if (!path)
        return MOE_OK;
    FILE *f = fopen(path, "rb");
    if (!f)
        return moe_error_set(err, MOE_ERR_IO, "%s %s: %s", flag, path, strerror(errno));
    fclose(f);
    if (strlen(path) >= cap)
        return moe_error_set(err, MOE_ERR_INVALID, "%s: path too long", flag);
    snprintf(buf, cap, "%s", path);
    return MOE_OK;
}

enum moe_status moe_etcd_set_tls(const struct moe_etcd_tls *t, struct moe_error *err)
{
    char ca[sizeof etcd_tls_cacert], cert[sizeof etcd_tls_cert], key[sizeof etcd_tls_key];
    enum moe_status st;
    if (t->dir && access(t->dir, F_OK) != 0)
        return moe_error_set(err, MOE_ERR_IO, "--etcd-tls-dir %s: %s", t->dir, strerror(errno));
    if ((st = tls_path(ca, sizeof ca, "--etcd-cacert", t->cacert, t->dir, "ca.crt", err)) ||
        (st = tls_path(cert, sizeof cert, "--etcd-cert", t->cert, t->dir, "tls.crt", err)) ||
        (st = tls_path(key, sizeof key, "--etcd-key", t->key, t->dir, "tls.key", err)))
        return st;
    if (!cert[0] != !key[0])
        return moe_error_set(err, MOE_ERR_INVALID, "%s",
                             cert[0] ? "--etcd-cert needs --etcd-key (its private key)"
                                     : "--etcd-key needs --etcd-cert (its certificate)");
    if (t->dir && !ca[0] && !cert[0])
        return moe_error_set(err, MOE_ERR_INVALID,
                             "--etcd-tls-dir %s: neither ca.crt nor tls.crt and tls.key in it",
                             t->dir);
    memcpy(etcd_tls_cacert, ca, sizeof ca);
    memcpy(etcd_tls_cert, cert, sizeof cert);
    memcpy(etcd_tls_key, key, sizeof key);
    return MOE_OK;
}

static bool etcd_tls_on(void)
{
    return etcd_tls_cacert[0] || etcd_tls_cert[0];
}

/* ---- endpoints ----------------------------------------------------------- */

struct etcd_endpoints {
    char **urls; /* (n) without trailing '/' */
    size_t n;
};

static void endpoints_free(struct etcd_endpoints *e)
{
    for (size_t i = 0; i < e->n; i++)
        free(e->urls[i]);
    free(e->urls);
    e->urls = NULL;
    e->n = 0;
}

static enum moe_status endpoints_parse(const char *spec, struct etcd_endpoints *out,
                                       struct moe_error *err)
{
    memset(out, 0, sizeof *out);
    if (!spec || !*spec)
        return moe_error_set(err, MOE_ERR_INVALID, "etcd: empty endpoint list");
    size_t n_max = 1;
    for (const char *p = spec; *p; p++)
        n_max += *p == ',';
    out->urls = calloc(n_max, sizeof *out->urls);
    if (!out->urls)
        return moe_error_set(err, MOE_ERR_NOMEM, "etcd: out of memory");
    const char *p = spec;
    while (*p) {
        while (*p == ' ' || *p == ',')
            p++;
        const char *start = p;
        while (*p && *p != ',')
            p++;
        size_t len = (size_t)(p - start);
        while (len && (start[len - 1] == ' ' || start[len - 1] == '/'))
            len--;
        if (!len)
            continue;
        char shown[96];
        if (len > ETCD_URL_MAX - 64) {
            endpoints_free(out);
            return moe_error_set(err, MOE_ERR_INVALID, "etcd: endpoint '%s' is too long",
                                 printable(start, len, shown, sizeof shown));
        }
        if (etcd_tls_on() && strncmp(start, "https://", 8) != 0) {
            printable(start, len, shown, sizeof shown);
            endpoints_free(out);
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "etcd: endpoint '%s': TLS to etcd is configured (--etcd-cacert, "
                                 "--etcd-cert or --etcd-tls-dir): use https://",
                                 shown);
        }
        if (strncmp(start, "http://", 7) != 0 && strncmp(start, "https://", 8) != 0) {
            printable(start, len, shown, sizeof shown);
            endpoints_free(out);
            return moe_error_set(err, MOE_ERR_INVALID,
                                 "etcd: endpoint '%s' must start with http:// or https://", shown);
        }
        char *url = strndup(start, len);
        if (!url) {
            endpoints_free(out);
            return moe_error_set(err, MOE_ERR_NOMEM, "etcd: out of memory");
        }
        out->urls[out->n++] = url;
    }
    if (!out->n) {
        endpoints_free(out);
        return moe_error_set(err, MOE_ERR_INVALID, "etcd: no endpoint in '%s'", spec);
    }
    return MOE_OK;
}

/* ---- JSON helpers -------------------------------------------------------- */

/* Reads the int64 field `name` of `obj` into *out. Absent or null is 0 (etcd
 * omits defaults). etcd sends int64 as decimal strings; a JSON number is
 * accepted only when exactly representable (|x| <= 2^53). Returns 0 when the
 * field is something else. */
static int json_int64(const cJSON *obj, const char *name, int64_t *out)
{
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(obj, name);
    *out = 0;
    if (!f || cJSON_IsNull(f))
        return 1;
    if (cJSON_IsString(f)) {
        const char *s = f->valuestring;
        char *end;
        if (!*s)
            return 0;
        errno = 0;
        long long v = strtoll(s, &end, 10);
        if (errno || *end)
            return 0;
        *out = v;
        return 1;
    }
    if (cJSON_IsNumber(f)) {
        double d = f->valuedouble;
        if (!(fabs(d) <= 9007199254740992.0))
            return 0;
        int64_t v = (int64_t)d;
        if ((double)v != d)
            return 0;
        *out = v;
        return 1;
    }
    return 0;
}

static enum moe_status json_need_int64(const cJSON *obj, const char *name, int64_t *out,
                                       struct moe_error *err)
{
    if (!json_int64(obj, name, out))
        return moe_error_set(err, MOE_ERR_FORMAT, "field '%s' is not a 64-bit integer", name);
    return MOE_OK;
}

/* Decodes the base64 field `name` into a fresh NUL-terminated buffer (an
 * absent field is the empty string). */
static enum moe_status json_bytes(const cJSON *obj, const char *name, char **out, size_t *len,
                                  struct moe_error *err)
{
    *out = NULL;
    *len = 0;
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(obj, name);
    const char *s = "";
    if (f && !cJSON_IsNull(f)) {
        if (!cJSON_IsString(f))
            return moe_error_set(err, MOE_ERR_FORMAT, "field '%s' is not a string", name);
        s = f->valuestring;
    }
    size_t n = strlen(s);
    char *d = malloc(moe_base64_decoded_max(n) + 1);
    if (!d)
        return moe_error_set(err, MOE_ERR_NOMEM, "field '%s': out of memory (%zu bytes)", name, n);
    enum moe_status st = moe_base64_decode(s, n, (unsigned char *)d, len, err);
    if (st != MOE_OK) {
        free(d);
        moe_error_prefix(err, "field '%s'", name);
        return st; /* not the prefix's value: that is MOE_OK when err is NULL (the watcher) */
    }
    d[*len] = '\0';
    *out = d;
    return MOE_OK;
}

/* Adds `name`: base64(p[0..n)) to obj. Returns 0 on allocation failure. */
static int json_add_b64(cJSON *obj, const char *name, const void *p, size_t n)
{
    char *enc = malloc(moe_base64_encoded_len(n) + 1);
    if (!enc)
        return 0;
    moe_base64_encode(p, n, enc);
    int ok = cJSON_AddStringToObject(obj, name, enc) != NULL;
    free(enc);
    return ok;
}

/* Adds `name`: "<decimal v>" (etcd's int64 encoding). */
static int json_add_i64(cJSON *obj, const char *name, int64_t v)
{
    char s[32];
    snprintf(s, sizeof s, "%" PRId64, v);
    return cJSON_AddStringToObject(obj, name, s) != NULL;
}

/* range_end covering every key that starts with prefix[0..n): the prefix
 * with its last byte below 0xff incremented and what follows dropped; the
 * single byte "\0" (no upper bound) when there is no such byte. Writes at
 * most max(n, 1) bytes to `end`, returns the length. */
static size_t prefix_range_end(const char *prefix, size_t n, char *end)
{
    memcpy(end, prefix, n);
    for (size_t i = n; i-- > 0;) {
        if ((unsigned char)end[i] != 0xff) {
            end[i] = (char)((unsigned char)end[i] + 1);
            return i + 1;
        }
    }
    end[0] = '\0';
    return 1;
}

/* Adds "key" and, for a prefix, "range_end" to a range/deleterange/watch
 * request. An empty prefix means every key: key "\0", range_end "\0". */
static int json_add_key_range(cJSON *obj, const char *key, int prefix)
{
    size_t n = strlen(key);
    if (!prefix)
        return json_add_b64(obj, "key", key, n);
    if (n == 0)
        return json_add_b64(obj, "key", "", 1) && json_add_b64(obj, "range_end", "", 1);
    char *end = malloc(n);
    if (!end)
        return 0;
    size_t end_len = prefix_range_end(key, n, end);
    int ok = json_add_b64(obj, "key", key, n) && json_add_b64(obj, "range_end", end, end_len);
    free(end);
    return ok;
}

void moe_etcd_kv_clear(struct moe_etcd_kv *kv)
{
    if (!kv)
        return;
    free(kv->key);
    free(kv->value);
    memset(kv, 0, sizeof *kv);
}

void moe_etcd_kvs_clear(struct moe_etcd_kvs *kvs)
{
    if (!kvs)
        return;
    for (size_t i = 0; i < kvs->n; i++)
        moe_etcd_kv_clear(&kvs->kvs[i]);
    free(kvs->kvs);
    memset(kvs, 0, sizeof *kvs);
}

/* Parses one mvccpb.KeyValue object. On error *kv is cleared. */
static enum moe_status kv_parse(const cJSON *j, struct moe_etcd_kv *kv, struct moe_error *err)
{
    memset(kv, 0, sizeof *kv);
    enum moe_status st = MOE_OK;
    if (!cJSON_IsObject(j)) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "a kv is not a JSON object");
        goto fail;
    }
    if ((st = json_bytes(j, "key", &kv->key, &kv->key_len, err)) != MOE_OK ||
        (st = json_bytes(j, "value", &kv->value, &kv->value_len, err)) != MOE_OK ||
        (st = json_need_int64(j, "create_revision", &kv->create_revision, err)) != MOE_OK ||
        (st = json_need_int64(j, "mod_revision", &kv->mod_revision, err)) != MOE_OK ||
        (st = json_need_int64(j, "version", &kv->version, err)) != MOE_OK ||
        (st = json_need_int64(j, "lease", &kv->lease, err)) != MOE_OK)
        goto fail;
    return MOE_OK;
fail:
    moe_etcd_kv_clear(kv);
    return st;
}

/* Revision from an answer's "header". */
static enum moe_status header_revision(const cJSON *resp, int64_t *rev, struct moe_error *err)
{
    const cJSON *h = cJSON_GetObjectItemCaseSensitive(resp, "header");
    *rev = 0;
    if (!cJSON_IsObject(h))
        return moe_error_set(err, MOE_ERR_FORMAT, "answer has no 'header' object");
    return json_need_int64(h, "revision", rev, err);
}

/* Maps a gRPC status code from an etcd error body to a moe_status. */
static enum moe_status grpc_code_status(int64_t code, long http)
{
    /* 3 INVALID_ARGUMENT, 9 FAILED_PRECONDITION, 11 OUT_OF_RANGE (compacted),
     * 5 NOT_FOUND, 8 RESOURCE_EXHAUSTED (too large, too many requests),
     * 12 UNIMPLEMENTED; the rest (UNAVAILABLE, DEADLINE_EXCEEDED, ...) is I/O */
    switch (code) {
    case 3:
    case 9:
    case 11: return MOE_ERR_INVALID;
    case 5: return MOE_ERR_NOT_FOUND;
    case 8: return MOE_ERR_AGAIN;
    case 12: return MOE_ERR_UNSUPPORTED;
    case 0: return http >= 400 && http < 500 ? MOE_ERR_INVALID : MOE_ERR_IO;
    default: return MOE_ERR_IO;
    }
}

/* Message and gRPC code of an error answer: {"error":"..","message":"..",
 * "code":N} (unary) or {"error":{"grpc_code":N,"message":".."}} (streams). */
static void error_body(const cJSON *j, const char **msg, int64_t *code)
{
    *msg = NULL;
    *code = 0;
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "error");
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(j, "message");
    if (cJSON_IsObject(e)) {
        m = cJSON_GetObjectItemCaseSensitive(e, "message");
        json_int64(e, "grpc_code", code);
    } else {
        json_int64(j, "code", code);
        if (!cJSON_IsString(m) || !*m->valuestring)
            m = e;
    }
    if (cJSON_IsString(m))
        *msg = m->valuestring;
}

/* ---- client ---------------------------------------------------------------- */

struct moe_etcd {
    struct etcd_endpoints ep;
    size_t cur; /* endpoint the next request goes to first */
    int timeout_ms;
    CURL *curl;
    struct curl_slist *headers;
    struct etcd_buf resp;
    int resp_overflow;
    const atomic_int *abort_flag; /* set by a keeper to abort a transfer */
    char errbuf[CURL_ERROR_SIZE];
};

static size_t client_write(char *p, size_t size, size_t nmemb, void *user)
{
    struct moe_etcd *c = user;
    size_t n = size * nmemb;
    if (!buf_append(&c->resp, p, n, ETCD_MAX_RESPONSE)) {
        c->resp_overflow = 1;
        return 0;
    }
    return n;
}

static int client_progress(void *user, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal,
                           curl_off_t ulnow)
{
    struct moe_etcd *c = user;
    return c->abort_flag && atomic_load(c->abort_flag);
}

/* The common curl options of unary and watch handles. */
static int curl_setup(CURL *h, struct curl_slist *headers, char *errbuf, int timeout_ms)
{
    if ((etcd_tls_cacert[0] && curl_easy_setopt(h, CURLOPT_CAINFO, etcd_tls_cacert) != CURLE_OK) ||
        (etcd_tls_cert[0] && (curl_easy_setopt(h, CURLOPT_SSLCERT, etcd_tls_cert) != CURLE_OK ||
                              curl_easy_setopt(h, CURLOPT_SSLKEY, etcd_tls_key) != CURLE_OK)))
        return 0;
    return curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L) == CURLE_OK &&
           curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers) == CURLE_OK &&
           curl_easy_setopt(h, CURLOPT_ERRORBUFFER, errbuf) == CURLE_OK &&
           curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)timeout_ms) == CURLE_OK &&
           curl_easy_setopt(h, CURLOPT_TCP_NODELAY, 1L) == CURLE_OK &&
           curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L) == CURLE_OK &&
           curl_easy_setopt(h, CURLOPT_TCP_KEEPIDLE, 5L) == CURLE_OK &&
           curl_easy_setopt(h, CURLOPT_TCP_KEEPINTVL, 2L) == CURLE_OK &&
           curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https") == CURLE_OK;
}

static struct curl_slist *json_headers(void)
{
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    struct curl_slist *h2 = h ? curl_slist_append(h, "Expect:") : NULL; /* no 100-continue wait */
    if (!h2)
        curl_slist_free_all(h);
    return h2;
}

enum moe_status moe_etcd_create(const char *endpoints, int timeout_ms, struct moe_etcd **out,
                                struct moe_error *err)
{
    *out = NULL;
    enum moe_status st = etcd_global_init(err);
    if (st != MOE_OK)
        return st;
    if (timeout_ms <= 0)
        return moe_error_set(err, MOE_ERR_INVALID, "etcd: timeout %d ms must be > 0", timeout_ms);
    struct moe_etcd *c = calloc(1, sizeof *c);
    if (!c)
        return moe_error_set(err, MOE_ERR_NOMEM, "etcd: out of memory");
    if ((st = endpoints_parse(endpoints, &c->ep, err)) != MOE_OK)
        goto fail;
    c->timeout_ms = timeout_ms;
    c->curl = curl_easy_init();
    c->headers = json_headers();
    if (!c->curl || !c->headers) {
        st = moe_error_set(err, MOE_ERR_NOMEM, "etcd: cannot create a curl handle");
        goto fail;
    }
    if (!curl_setup(c->curl, c->headers, c->errbuf, timeout_ms) ||
        curl_easy_setopt(c->curl, CURLOPT_TIMEOUT_MS, (long)timeout_ms) != CURLE_OK ||
        curl_easy_setopt(c->curl, CURLOPT_WRITEFUNCTION, client_write) != CURLE_OK ||
        curl_easy_setopt(c->curl, CURLOPT_WRITEDATA, c) != CURLE_OK ||
        curl_easy_setopt(c->curl, CURLOPT_XFERINFOFUNCTION, client_progress) != CURLE_OK ||
        curl_easy_setopt(c->curl, CURLOPT_XFERINFODATA, c) != CURLE_OK) {
        st = moe_error_set(err, MOE_ERR_INTERNAL, "etcd: curl option rejected");
        goto fail;
    }
    *out = c;
    return MOE_OK;
fail:
    moe_etcd_destroy(c);
    return st;
}

void moe_etcd_destroy(struct moe_etcd *c)
{
    if (!c)
        return;
    if (c->curl)
        curl_easy_cleanup(c->curl);
    curl_slist_free_all(c->headers);
    endpoints_free(&c->ep);
    free(c->resp.data);
    free(c);
}

/* "op 'key'" or "op" for messages. */
static const char *op_name(char *buf, size_t cap, const char *op, const char *key)
{
    if (!key) {
        snprintf(buf, cap, "%s", op);
    } else {
        char shown[96];
        snprintf(buf, cap, "%s '%s'", op, printable(key, strlen(key), shown, sizeof shown));
    }
    return buf;
}

/* POSTs `req` to `path` and parses the JSON answer into *out (caller frees
 * with cJSON_Delete). Connection failures move on to the next endpoint.
 * `what` names the operation in messages; *ep_out (may be NULL) receives the
 * endpoint that answered, for messages about the answer's contents. */
static enum moe_status etcd_call(struct moe_etcd *c, const char *path, const cJSON *req,
                                 const char *what, cJSON **out, const char **ep_out,
                                 struct moe_error *err)
{
    *out = NULL;
    char *body = cJSON_PrintUnformatted(req);
    if (!body)
        return moe_error_set(err, MOE_ERR_NOMEM, "etcd %s: out of memory building the request",
                             what);
    curl_easy_setopt(c->curl, CURLOPT_NOPROGRESS, c->abort_flag ? 0L : 1L);
    curl_easy_setopt(c->curl, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c->curl, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)strlen(body));
    CURLcode rc = CURLE_OK;
    const char *ep = c->ep.urls[c->cur];
    for (size_t attempt = 0; attempt < c->ep.n; attempt++) {
        ep = c->ep.urls[c->cur];
        char url[ETCD_URL_MAX];
        snprintf(url, sizeof url, "%s%s", ep, path);
        c->resp.len = 0;
        c->resp_overflow = 0;
        c->errbuf[0] = '\0';
        curl_easy_setopt(c->curl, CURLOPT_URL, url);
        rc = curl_easy_perform(c->curl);
        int connect_failed = rc == CURLE_COULDNT_CONNECT || rc == CURLE_COULDNT_RESOLVE_HOST;
        if (!connect_failed || attempt + 1 == c->ep.n ||
            (c->abort_flag && atomic_load(c->abort_flag)))
            break;
        c->cur = (c->cur + 1) % c->ep.n; /* never sent: safe to retry elsewhere */
    }
    free(body);
    curl_easy_setopt(c->curl, CURLOPT_POSTFIELDS, NULL);
    if (ep_out)
        *ep_out = ep;

    if (rc != CURLE_OK) {
        c->cur = (c->cur + 1) % c->ep.n; /* start elsewhere next time */
        const char *detail = c->errbuf[0] ? c->errbuf : curl_easy_strerror(rc);
        if (rc == CURLE_OPERATION_TIMEDOUT)
            return moe_error_set(err, MOE_ERR_IO, "etcd %s %s: timed out after %d ms (%s)", ep,
                                 what, c->timeout_ms, detail);
        if (rc == CURLE_COULDNT_CONNECT || rc == CURLE_COULDNT_RESOLVE_HOST)
            return moe_error_set(err, MOE_ERR_IO, "etcd %s %s: cannot connect (%s)", ep, what,
                                 detail);
        if (rc == CURLE_ABORTED_BY_CALLBACK)
            return moe_error_set(err, MOE_ERR_IO, "etcd %s %s: cancelled", ep, what);
        if (c->resp_overflow)
            return moe_error_set(err, MOE_ERR_IO, "etcd %s %s: answer larger than %u bytes", ep,
                                 what, ETCD_MAX_RESPONSE);
        return moe_error_set(err, MOE_ERR_IO, "etcd %s %s: %s", ep, what, detail);
    }

    long http = 0;
    curl_easy_getinfo(c->curl, CURLINFO_RESPONSE_CODE, &http);
    cJSON *j = c->resp.len ? cJSON_ParseWithLength(c->resp.data, c->resp.len) : NULL;
    char shown[96];
    if (j && !cJSON_IsObject(j)) {
        cJSON_Delete(j);
        j = NULL;
    }
    const cJSON *e = j ? cJSON_GetObjectItemCaseSensitive(j, "error") : NULL;
    int has_error = e && !(cJSON_IsString(e) && !*e->valuestring);
    if (http != 200 || has_error) {
        enum moe_status st;
        if (j && has_error) {
            const char *msg;
            int64_t code;
            error_body(j, &msg, &code);
            st = moe_error_set(err, grpc_code_status(code, http),
                               "etcd %s %s: HTTP %ld: %s (gRPC code %" PRId64 ")", ep, what, http,
                               msg ? msg : "(no message)", code);
        } else {
            st = moe_error_set(err, http >= 400 && http < 500 ? MOE_ERR_INVALID : MOE_ERR_IO,
                               "etcd %s %s: HTTP %ld: '%s'", ep, what, http,
                               printable(c->resp.data ? c->resp.data : "", c->resp.len, shown, 64));
        }
        cJSON_Delete(j);
        return st;
    }
    if (!j)
        return moe_error_set(
            err, MOE_ERR_FORMAT, "etcd %s %s: malformed JSON answer (%zu bytes): '%s'", ep, what,
            c->resp.len, printable(c->resp.data ? c->resp.data : "", c->resp.len, shown, 64));
    *out = j;
    return MOE_OK;
}

enum moe_status moe_etcd_put(struct moe_etcd *c, const char *key, const void *value,
                             size_t value_len, int64_t lease, int64_t *revision,
                             struct moe_error *err)
{
    char what[160];
    op_name(what, sizeof what, "put", key);
    cJSON *req = cJSON_CreateObject(), *resp = NULL;
    const char *ep;
    enum moe_status st;
    if (!req || !json_add_b64(req, "key", key, strlen(key)) ||
        !json_add_b64(req, "value", value, value_len) ||
        (lease && !json_add_i64(req, "lease", lease))) {
        st = moe_error_set(err, MOE_ERR_NOMEM, "etcd %s: out of memory", what);
        goto fail;
    }
    if ((st = etcd_call(c, "/v3/kv/put", req, what, &resp, &ep, err)) != MOE_OK)
        goto fail;
    int64_t rev;
    if ((st = header_revision(resp, &rev, err)) != MOE_OK) {
        moe_error_prefix(err, "etcd %s %s", ep, what);
        goto fail;
    }
    if (revision)
        *revision = rev;
fail:
    cJSON_Delete(req);
    cJSON_Delete(resp);
    return st;
}

/* Range request for `key` (or the prefix) into *out. */
static enum moe_status etcd_range(struct moe_etcd *c, const char *key, int prefix,
                                  struct moe_etcd_kvs *out, struct moe_error *err)
{
    char what[160];
    op_name(what, sizeof what, prefix ? "get prefix" : "get", key);
    memset(out, 0, sizeof *out);
    cJSON *req = cJSON_CreateObject(), *resp = NULL;
    const char *ep = NULL;
    enum moe_status st;
    if (!req || !json_add_key_range(req, key, prefix)) {
        st = moe_error_set(err, MOE_ERR_NOMEM, "etcd %s: out of memory", what);
        goto fail;
    }
    if ((st = etcd_call(c, "/v3/kv/range", req, what, &resp, &ep, err)) != MOE_OK)
        goto fail;
    if ((st = header_revision(resp, &out->revision, err)) != MOE_OK)
        goto fail_answer;
    const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(resp, "kvs");
    if (kvs && !cJSON_IsArray(kvs)) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "'kvs' is not an array");
        goto fail_answer;
    }
    int n = kvs ? cJSON_GetArraySize(kvs) : 0;
    if (n > 0) {
        out->kvs = calloc((size_t)n, sizeof *out->kvs);
        if (!out->kvs) {
            st = moe_error_set(err, MOE_ERR_NOMEM, "out of memory for %d kvs", n);
            goto fail_answer;
        }
        const cJSON *kv;
        cJSON_ArrayForEach(kv, kvs)
        {
            if ((st = kv_parse(kv, &out->kvs[out->n], err)) != MOE_OK) {
                moe_error_prefix(err, "kv %zu", out->n);
                goto fail_answer;
            }
            out->n++;
        }
    }
    cJSON_Delete(req);
    cJSON_Delete(resp);
    return MOE_OK;
fail_answer:
    moe_error_prefix(err, "etcd %s %s: malformed answer", ep, what);
fail:
    moe_etcd_kvs_clear(out);
    cJSON_Delete(req);
    cJSON_Delete(resp);
    return st;
}

enum moe_status moe_etcd_get(struct moe_etcd *c, const char *key, struct moe_etcd_kv *out,
                             int64_t *revision, struct moe_error *err)
{
    memset(out, 0, sizeof *out);
    struct moe_etcd_kvs kvs;
    enum moe_status st = etcd_range(c, key, 0, &kvs, err);
    if (st != MOE_OK)
        return st;
    if (revision)
        *revision = kvs.revision;
    if (kvs.n == 0) {
        char shown[96];
        moe_etcd_kvs_clear(&kvs);
        return moe_error_set(err, MOE_ERR_NOT_FOUND, "etcd %s get '%s': key not found",
                             c->ep.urls[c->cur], printable(key, strlen(key), shown, sizeof shown));
    }
    *out = kvs.kvs[0];
    memset(&kvs.kvs[0], 0, sizeof kvs.kvs[0]);
    moe_etcd_kvs_clear(&kvs);
    return MOE_OK;
}

enum moe_status moe_etcd_get_prefix(struct moe_etcd *c, const char *prefix,
                                    struct moe_etcd_kvs *out, struct moe_error *err)
{
    return etcd_range(c, prefix, 1, out, err);
}

enum moe_status moe_etcd_delete(struct moe_etcd *c, const char *key, int prefix, int64_t *n_deleted,
                                struct moe_error *err)
{
    char what[160];
    op_name(what, sizeof what, prefix ? "delete prefix" : "delete", key);
    cJSON *req = cJSON_CreateObject(), *resp = NULL;
    const char *ep;
    enum moe_status st;
    if (!req || !json_add_key_range(req, key, prefix)) {
        st = moe_error_set(err, MOE_ERR_NOMEM, "etcd %s: out of memory", what);
        goto fail;
    }
    if ((st = etcd_call(c, "/v3/kv/deleterange", req, what, &resp, &ep, err)) != MOE_OK)
        goto fail;
    int64_t n;
    if ((st = json_need_int64(resp, "deleted", &n, err)) != MOE_OK) {
        moe_error_prefix(err, "etcd %s %s: malformed answer", ep, what);
        goto fail;
    }
    if (n_deleted)
        *n_deleted = n;
fail:
    cJSON_Delete(req);
    cJSON_Delete(resp);
    return st;
}

enum moe_status moe_etcd_lease_grant(struct moe_etcd *c, int64_t ttl_s, int64_t *lease,
                                     int64_t *granted_ttl_s, struct moe_error *err)
{
    char what[96];
    snprintf(what, sizeof what, "lease grant (TTL %" PRId64 " s)", ttl_s);
    *lease = 0;
    if (ttl_s <= 0)
        return moe_error_set(err, MOE_ERR_INVALID, "etcd %s: TTL must be > 0", what);
    cJSON *req = cJSON_CreateObject(), *resp = NULL;
    const char *ep;
    enum moe_status st;
    if (!req || !json_add_i64(req, "TTL", ttl_s)) {
        st = moe_error_set(err, MOE_ERR_NOMEM, "etcd %s: out of memory", what);
        goto fail;
    }
    if ((st = etcd_call(c, "/v3/lease/grant", req, what, &resp, &ep, err)) != MOE_OK)
        goto fail;
    int64_t id, ttl;
    if ((st = json_need_int64(resp, "ID", &id, err)) != MOE_OK ||
        (st = json_need_int64(resp, "TTL", &ttl, err)) != MOE_OK) {
        moe_error_prefix(err, "etcd %s %s: malformed answer", ep, what);
        goto fail;
    }
    if (id == 0 || ttl <= 0) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "etcd %s %s: answer without lease ID or TTL", ep,
                           what);
        goto fail;
    }
    *lease = id;
    if (granted_ttl_s)
        *granted_ttl_s = ttl;
fail:
    cJSON_Delete(req);
    cJSON_Delete(resp);
    return st;
}

enum moe_status moe_etcd_lease_keepalive(struct moe_etcd *c, int64_t lease, int64_t *ttl_s,
                                         struct moe_error *err)
{
    char what[96];
    snprintf(what, sizeof what, "lease keepalive %" PRId64, lease);
    cJSON *req = cJSON_CreateObject(), *resp = NULL;
    const char *ep;
    enum moe_status st;
    if (!req || !json_add_i64(req, "ID", lease)) {
        st = moe_error_set(err, MOE_ERR_NOMEM, "etcd %s: out of memory", what);
        goto fail;
    }
    if ((st = etcd_call(c, "/v3/lease/keepalive", req, what, &resp, &ep, err)) != MOE_OK)
        goto fail;
    /* a stream endpoint: the answer is wrapped in "result" */
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(resp, "result");
    int64_t ttl;
    if (!cJSON_IsObject(r)) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "etcd %s %s: answer has no 'result' object", ep,
                           what);
        goto fail;
    }
    if ((st = json_need_int64(r, "TTL", &ttl, err)) != MOE_OK) {
        moe_error_prefix(err, "etcd %s %s: malformed answer", ep, what);
        goto fail;
    }
    if (ttl <= 0) { /* TTL omitted: the lease is gone */
        st = moe_error_set(err, MOE_ERR_NOT_FOUND, "etcd %s %s: lease %" PRId64 " expired", ep,
                           what, lease);
        goto fail;
    }
    if (ttl_s)
        *ttl_s = ttl;
fail:
    cJSON_Delete(req);
    cJSON_Delete(resp);
    return st;
}

enum moe_status moe_etcd_lease_revoke(struct moe_etcd *c, int64_t lease, struct moe_error *err)
{
    char what[96];
    snprintf(what, sizeof what, "lease revoke %" PRId64, lease);
    cJSON *req = cJSON_CreateObject(), *resp = NULL;
    enum moe_status st;
    if (!req || !json_add_i64(req, "ID", lease)) {
        st = moe_error_set(err, MOE_ERR_NOMEM, "etcd %s: out of memory", what);
        goto fail;
    }
    st = etcd_call(c, "/v3/lease/revoke", req, what, &resp, NULL, err);
fail:
    cJSON_Delete(req);
    cJSON_Delete(resp);
    return st;
}

enum moe_status moe_etcd_cas(struct moe_etcd *c, const char *key, int64_t expected_mod_revision,
                             const void *value, size_t value_len, int64_t lease, int *succeeded,
                             int64_t *mod_revision, struct moe_error *err)
{
    char what[160];
    op_name(what, sizeof what, "cas", key);
    *succeeded = 0;
    if (expected_mod_revision < 0)
        return moe_error_set(err, MOE_ERR_INVALID, "etcd %s: expected revision %" PRId64 " < 0",
                             what, expected_mod_revision);
    /* {"compare":[{"key","target":"MOD","result":"EQUAL","mod_revision"}],
     *  "success":[{"request_put":{...}}],
     *  "failure":[{"request_range":{"key"}}]}  (the current state, to retry) */
    cJSON *req = cJSON_CreateObject(), *resp = NULL;
    const char *ep;
    enum moe_status st;
    cJSON *cmp_arr = req ? cJSON_AddArrayToObject(req, "compare") : NULL;
    cJSON *ok_arr = req ? cJSON_AddArrayToObject(req, "success") : NULL;
    cJSON *fail_arr = req ? cJSON_AddArrayToObject(req, "failure") : NULL;
    cJSON *cmp = cJSON_CreateObject(), *op_put = cJSON_CreateObject();
    cJSON *op_range = cJSON_CreateObject();
    int ok = cmp_arr && ok_arr && fail_arr && cmp && op_put && op_range;
    if (ok) {
        cJSON_AddItemToArray(cmp_arr, cmp);
        cJSON_AddItemToArray(ok_arr, op_put);
        cJSON_AddItemToArray(fail_arr, op_range);
    } else {
        cJSON_Delete(cmp);
        cJSON_Delete(op_put);
        cJSON_Delete(op_range);
    }
    cJSON *put = ok ? cJSON_AddObjectToObject(op_put, "request_put") : NULL;
    cJSON *range = ok ? cJSON_AddObjectToObject(op_range, "request_range") : NULL;
    ok = ok && put && range && json_add_b64(cmp, "key", key, strlen(key)) &&
         cJSON_AddStringToObject(cmp, "target", "MOD") &&
         cJSON_AddStringToObject(cmp, "result", "EQUAL") &&
         json_add_i64(cmp, "mod_revision", expected_mod_revision) &&
         json_add_b64(put, "key", key, strlen(key)) &&
         json_add_b64(put, "value", value, value_len) &&
         (!lease || json_add_i64(put, "lease", lease)) &&
         json_add_b64(range, "key", key, strlen(key));
    if (!ok) {
        st = moe_error_set(err, MOE_ERR_NOMEM, "etcd %s: out of memory", what);
        goto done;
    }
    if ((st = etcd_call(c, "/v3/kv/txn", req, what, &resp, &ep, err)) != MOE_OK)
        goto done;
    int64_t rev;
    if ((st = header_revision(resp, &rev, err)) != MOE_OK)
        goto fail_answer;
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(resp, "succeeded");
    if (cJSON_IsTrue(s)) {
        *succeeded = 1;
        if (mod_revision)
            *mod_revision = rev; /* a txn with one put: the put's revision */
        goto done;
    }
    /* failed: responses[0].response_range.kvs[0].mod_revision (absent: 0) */
    const cJSON *resps = cJSON_GetObjectItemCaseSensitive(resp, "responses");
    const cJSON *r0 = cJSON_IsArray(resps) ? cJSON_GetArrayItem(resps, 0) : NULL;
    const cJSON *rr = r0 ? cJSON_GetObjectItemCaseSensitive(r0, "response_range") : NULL;
    if (!cJSON_IsObject(rr)) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "failed txn without 'response_range'");
        goto fail_answer;
    }
    const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(rr, "kvs");
    const cJSON *kv0 = cJSON_IsArray(kvs) ? cJSON_GetArrayItem(kvs, 0) : NULL;
    int64_t cur = 0;
    if (kv0 && (st = json_need_int64(kv0, "mod_revision", &cur, err)) != MOE_OK)
        goto fail_answer;
    if (mod_revision)
        *mod_revision = cur;
    goto done;
fail_answer:
    moe_error_prefix(err, "etcd %s %s: malformed answer", ep, what);
done:
    cJSON_Delete(req);
    cJSON_Delete(resp);
    return st;
}

/* ---- watch ----------------------------------------------------------------- */

struct moe_etcd_watch {
    struct etcd_endpoints ep;
    size_t cur;
    int timeout_ms;
    char *key;
    int prefix;
    moe_etcd_watch_fn fn;
    void *user;

    CURLM *multi;
    CURL *easy;
    struct curl_slist *headers;
    char errbuf[CURL_ERROR_SIZE];
    pthread_t thread;
    int thread_started;
    atomic_int stop;
    atomic_int n_connects;

    /* watcher thread only */
    int64_t next_rev;     /* revision to resume from; 0: from now */
    int at_last_rev;      /* INT64_MAX was seen: no revision can follow it */
    struct etcd_buf line; /* partial line of the stream */
    int end_stream;       /* the line handler asks to reconnect */
    int created_seen;     /* this stream was established */
};

/* Everything up to rev has been seen: resume after it. INT64_MAX is the
 * last revision there can be; after it nothing is new (next_rev cannot step
 * past it, so a flag says so). */
static void watch_seen_rev(struct moe_etcd_watch *w, int64_t rev)
{
    w->at_last_rev = rev == INT64_MAX;
    w->next_rev = rev == INT64_MAX ? rev : rev + 1;
}

/* Delivers the events of one watch answer. */
static void watch_deliver(struct moe_etcd_watch *w, const cJSON *events)
{
    const cJSON *e;
    cJSON_ArrayForEach(e, events)
    {
        const cJSON *kvj = cJSON_GetObjectItemCaseSensitive(e, "kv");
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(e, "type");
        struct moe_etcd_kv kv;
        if (kv_parse(kvj, &kv, NULL) != MOE_OK)
            continue; /* cannot happen with a sane etcd; never loop on it */
        struct moe_etcd_event ev = {
            .type = cJSON_IsString(type) && strcmp(type->valuestring, "DELETE") == 0
                        ? MOE_ETCD_EVENT_DELETE
                        : MOE_ETCD_EVENT_PUT,
            .key = kv.key,
            .key_len = kv.key_len,
            .value = kv.value,
            .value_len = kv.value_len,
            .mod_revision = kv.mod_revision,
            .create_revision = kv.create_revision,
            .lease = kv.lease,
        };
        if (!w->at_last_rev && kv.mod_revision >= w->next_rev) { /* never deliver twice */
            w->fn(w->user, &ev);
            watch_seen_rev(w, kv.mod_revision);
        }
        moe_etcd_kv_clear(&kv);
    }
}

/* Handles one line of the watch stream. */
static void watch_line(struct moe_etcd_watch *w, const char *s, size_t n)
{
    cJSON *j = cJSON_ParseWithLength(s, n);
    const cJSON *r = j ? cJSON_GetObjectItemCaseSensitive(j, "result") : NULL;
    if (!cJSON_IsObject(r)) { /* in-band {"error":...}, HTTP error body or garbage */
        w->end_stream = 1;
        cJSON_Delete(j);
        return;
    }
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(r, "created"))) {
        w->created_seen = 1;
        atomic_fetch_add(&w->n_connects, 1);
        if (w->next_rev == 0) {
            const cJSON *h = cJSON_GetObjectItemCaseSensitive(r, "header");
            int64_t rev;
            if (cJSON_IsObject(h) && json_int64(h, "revision", &rev) && rev > 0)
                watch_seen_rev(w, rev);
        }
    }
    const cJSON *events = cJSON_GetObjectItemCaseSensitive(r, "events");
    if (cJSON_IsArray(events))
        watch_deliver(w, events);
    int64_t compact = 0;
    json_int64(r, "compact_revision", &compact);
    if (!w->at_last_rev && compact > 0 && compact > w->next_rev) {
        struct moe_etcd_event ev = {
            .type = MOE_ETCD_EVENT_RESYNC, .key = "", .value = "", .mod_revision = compact};
        w->fn(w->user, &ev);
        w->next_rev = compact;
    }
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(r, "canceled")))
        w->end_stream = 1;
    cJSON_Delete(j);
}

static size_t watch_write(char *p, size_t size, size_t nmemb, void *user)
{
    struct moe_etcd_watch *w = user;
    size_t n = size * nmemb;
    if (atomic_load(&w->stop))
        return 0;
    const char *s = p, *end = p + n;
    while (s < end) {
        const char *nl = memchr(s, '\n', (size_t)(end - s));
        const char *stop = nl ? nl : end;
        if (!buf_append(&w->line, s, (size_t)(stop - s), ETCD_MAX_WATCH_LINE))
            return 0; /* line too long or no memory: reconnect */
        if (!nl)
            break;
        if (w->line.len)
            watch_line(w, w->line.data, w->line.len);
        w->line.len = 0;
        if (w->end_stream || atomic_load(&w->stop))
            return 0;
        s = nl + 1;
    }
    return n;
}

/* The body of a watch create request resuming at w->next_rev. */
static char *watch_body(const struct moe_etcd_watch *w)
{
    cJSON *req = cJSON_CreateObject();
    cJSON *cr = req ? cJSON_AddObjectToObject(req, "create_request") : NULL;
    char *body = NULL;
    if (cr && json_add_key_range(cr, w->key, w->prefix) &&
        (w->next_rev == 0 || json_add_i64(cr, "start_revision", w->next_rev)))
        body = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    return body;
}

static void *watch_main(void *arg)
{
    struct moe_etcd_watch *w = arg;
    int backoff_ms = ETCD_WATCH_BACKOFF_MIN_MS;
    while (!atomic_load(&w->stop)) {
        char *body = watch_body(w);
        if (body) {
            char url[ETCD_URL_MAX];
            snprintf(url, sizeof url, "%s/v3/watch", w->ep.urls[w->cur]);
            w->line.len = 0;
            w->end_stream = 0;
            w->created_seen = 0;
            curl_easy_setopt(w->easy, CURLOPT_URL, url);
            curl_easy_setopt(w->easy, CURLOPT_POSTFIELDS, body);
            curl_easy_setopt(w->easy, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)strlen(body));
            if (curl_multi_add_handle(w->multi, w->easy) == CURLM_OK) {
                int running = 1;
                while (!atomic_load(&w->stop)) {
                    if (curl_multi_perform(w->multi, &running) != CURLM_OK || !running)
                        break;
                    curl_multi_poll(w->multi, NULL, 0, 1000, NULL);
                }
                curl_multi_remove_handle(w->multi, w->easy);
            }
            curl_easy_setopt(w->easy, CURLOPT_POSTFIELDS, NULL);
            free(body);
        }
        if (atomic_load(&w->stop))
            break;
        if (w->created_seen) {
            backoff_ms = ETCD_WATCH_BACKOFF_MIN_MS;
        } else {
            w->cur = (w->cur + 1) % w->ep.n;
        }
        /* sleep, woken at once by moe_etcd_watch_destroy */
        int64_t until = moe_now_ms() + backoff_ms;
        for (int64_t left; !atomic_load(&w->stop) && (left = until - moe_now_ms()) > 0;)
            curl_multi_poll(w->multi, NULL, 0, (int)left, NULL);
        if (!w->created_seen && backoff_ms < ETCD_WATCH_BACKOFF_MAX_MS)
            backoff_ms = backoff_ms * 2 > ETCD_WATCH_BACKOFF_MAX_MS ? ETCD_WATCH_BACKOFF_MAX_MS
                                                                    : backoff_ms * 2;
    }
    return NULL;
}

enum moe_status moe_etcd_watch_create(const char *endpoints, int timeout_ms, const char *key,
                                      int prefix, int64_t start_revision, moe_etcd_watch_fn fn,
                                      void *user, struct moe_etcd_watch **out,
                                      struct moe_error *err)
{
    *out = NULL;
    enum moe_status st = etcd_global_init(err);
    if (st != MOE_OK)
        return st;
    if (timeout_ms <= 0 || !fn || !key || start_revision < 0 || (!prefix && !*key))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "etcd watch: bad argument (timeout %d ms, start revision %" PRId64
                             ", empty key without prefix or no callback)",
                             timeout_ms, start_revision);
    struct moe_etcd_watch *w = calloc(1, sizeof *w);
    if (!w)
        return moe_error_set(err, MOE_ERR_NOMEM, "etcd watch: out of memory");
    if ((st = endpoints_parse(endpoints, &w->ep, err)) != MOE_OK)
        goto fail;
    w->timeout_ms = timeout_ms;
    w->prefix = prefix;
    w->fn = fn;
    w->user = user;
    w->next_rev = start_revision;
    w->key = strdup(key);
    w->multi = curl_multi_init();
    w->easy = curl_easy_init();
    w->headers = json_headers();
    if (!w->key || !w->multi || !w->easy || !w->headers) {
        st = moe_error_set(err, MOE_ERR_NOMEM, "etcd watch: out of memory");
        goto fail;
    }
    if (!curl_setup(w->easy, w->headers, w->errbuf, timeout_ms) ||
        curl_easy_setopt(w->easy, CURLOPT_WRITEFUNCTION, watch_write) != CURLE_OK ||
        curl_easy_setopt(w->easy, CURLOPT_WRITEDATA, w) != CURLE_OK) {
        st = moe_error_set(err, MOE_ERR_INTERNAL, "etcd watch: curl option rejected");
        goto fail;
    }
    int rc = pthread_create(&w->thread, NULL, watch_main, w);
    if (rc != 0) {
        st = moe_error_set(err, MOE_ERR_INTERNAL, "etcd watch: pthread_create: %s", strerror(rc));
        goto fail;
    }
    w->thread_started = 1;
    *out = w;
    return MOE_OK;
fail:
    moe_etcd_watch_destroy(w);
    return st;
}

void moe_etcd_watch_destroy(struct moe_etcd_watch *w)
{
    if (!w)
        return;
    if (w->thread_started) {
        atomic_store(&w->stop, 1);
        curl_multi_wakeup(w->multi);
        pthread_join(w->thread, NULL);
    }
    if (w->multi)
        curl_multi_cleanup(w->multi);
    if (w->easy)
        curl_easy_cleanup(w->easy);
    curl_slist_free_all(w->headers);
    endpoints_free(&w->ep);
    free(w->key);
    free(w->line.data);
    free(w);
}

int moe_etcd_watch_n_connects(const struct moe_etcd_watch *w)
{
    return atomic_load(&w->n_connects);
}

/* ---- lease keeper ---------------------------------------------------------- */

struct moe_etcd_keeper {
    struct moe_etcd *client;
    int64_t lease;
    int64_t ttl_ms;
    moe_etcd_lease_lost_fn lost_fn;
    void *user;
    pthread_t thread;
    int thread_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int sync_ready; /* mu and cv initialised */
    atomic_int stop;
    atomic_int lost;
};

/* Sleeps until `until` (monotonic ms) or until the keeper is stopped. */
static void keeper_sleep(struct moe_etcd_keeper *k, int64_t until)
{
    pthread_mutex_lock(&k->mu);
    while (!atomic_load(&k->stop)) {
        int64_t t = moe_now_ms();
        if (t >= until)
            break;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int64_t ns = ts.tv_nsec + (until - t) * 1000000;
        ts.tv_sec += ns / 1000000000;
        ts.tv_nsec = ns % 1000000000;
        pthread_cond_timedwait(&k->cv, &k->mu, &ts);
    }
    pthread_mutex_unlock(&k->mu);
}

static void *keeper_main(void *arg)
{
    struct moe_etcd_keeper *k = arg;
    int64_t t = moe_now_ms();
    int64_t deadline = t + k->ttl_ms; /* the lease was refreshed by create */
    int64_t next = t + k->ttl_ms / 3;
    while (!atomic_load(&k->stop)) {
        keeper_sleep(k, next);
        if (atomic_load(&k->stop))
            break;
        struct moe_error err = {0};
        int64_t ttl = 0;
        enum moe_status st = moe_etcd_lease_keepalive(k->client, k->lease, &ttl, &err);
        if (atomic_load(&k->stop))
            break;
        t = moe_now_ms();
        if (st == MOE_OK) {
            k->ttl_ms = ttl * 1000;
            deadline = t + k->ttl_ms;
            next = t + k->ttl_ms / 3;
            continue;
        }
        if (st != MOE_ERR_NOT_FOUND && t < deadline) {
            next = t + ETCD_KEEPER_RETRY_MS; /* transient: retry until the TTL is spent */
            continue;
        }
        if (st != MOE_ERR_NOT_FOUND)
            moe_error_prefix(&err,
                             "lease %" PRId64 " lost: no keepalive succeeded for %" PRId64
                             " ms (TTL), last error",
                             k->lease, k->ttl_ms);
        atomic_store(&k->lost, 1);
        if (k->lost_fn)
            k->lost_fn(k->user, k->lease, &err);
        break;
    }
    return NULL;
}

enum moe_status moe_etcd_keeper_create(const char *endpoints, int timeout_ms, int64_t lease,
                                       moe_etcd_lease_lost_fn lost, void *user,
                                       struct moe_etcd_keeper **out, struct moe_error *err)
{
    *out = NULL;
    struct moe_etcd_keeper *k = calloc(1, sizeof *k);
    if (!k)
        return moe_error_set(err, MOE_ERR_NOMEM, "etcd keeper: out of memory");
    enum moe_status st = moe_etcd_create(endpoints, timeout_ms, &k->client, err);
    if (st != MOE_OK)
        goto fail;
    k->lease = lease;
    k->lost_fn = lost;
    k->user = user;
    /* First refresh here: a lease that is already gone fails the create. */
    int64_t ttl;
    if ((st = moe_etcd_lease_keepalive(k->client, lease, &ttl, err)) != MOE_OK)
        goto fail;
    k->ttl_ms = ttl * 1000;
    k->client->abort_flag = &k->stop;
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0) {
        st = moe_error_set(err, MOE_ERR_INTERNAL, "etcd keeper: pthread_condattr_init failed");
        goto fail;
    }
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int rc_cv = pthread_cond_init(&k->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (rc_cv != 0) {
        st = moe_error_set(err, MOE_ERR_INTERNAL, "etcd keeper: pthread_cond_init failed");
        goto fail;
    }
    if (pthread_mutex_init(&k->mu, NULL) != 0) {
        pthread_cond_destroy(&k->cv);
        st = moe_error_set(err, MOE_ERR_INTERNAL, "etcd keeper: pthread_mutex_init failed");
        goto fail;
    }
    k->sync_ready = 1;
    int rc = pthread_create(&k->thread, NULL, keeper_main, k);
    if (rc != 0) {
        st = moe_error_set(err, MOE_ERR_INTERNAL, "etcd keeper: pthread_create: %s", strerror(rc));
        goto fail;
    }
    k->thread_started = 1;
    *out = k;
    return MOE_OK;
fail:
    moe_etcd_keeper_destroy(k);
    return st;
}

int moe_etcd_keeper_lost(const struct moe_etcd_keeper *k)
{
    return atomic_load(&k->lost);
}

void moe_etcd_keeper_destroy(struct moe_etcd_keeper *k)
{
    if (!k)
        return;
    if (k->thread_started) {
        pthread_mutex_lock(&k->mu);
        atomic_store(&k->stop, 1);
        pthread_cond_signal(&k->cv);
        pthread_mutex_unlock(&k->mu);
        pthread_join(k->thread, NULL);
    }
    if (k->sync_ready) {
        pthread_mutex_destroy(&k->mu);
        pthread_cond_destroy(&k->cv);
    }
    moe_etcd_destroy(k->client);
    free(k);
}
