/* Fuzz target: etcd's answers (common/etcd.c): the unary answer check of
 * etcd_call (HTTP status, JSON, error bodies with gRPC codes) and the
 * answer parsing of every operation (put, range, deleterange, lease grant /
 * keepalive / revoke, the compare-and-swap txn), and the watch stream's
 * line splitting and event delivery (watch_write / watch_line).
 *
 * etcd.c has no network-free entry point and gets none: this file includes
 * it, with curl_easy_perform and curl_easy_getinfo replaced by fakes that
 * hand the fuzz input to the client's write callback as the answer body and
 * a fuzz-chosen HTTP status. Everything else is the production code.
 *
 * Input: byte 0 picks the operation (0..7 unary, 8.. watch) and its flags;
 * byte 1 the HTTP status (bits 0-2) and curl's result (bits 3-5: mostly
 * CURLE_OK; a failed connect or a timeout otherwise), and for the watch the
 * chunk size the stream arrives in; the rest is the body. What must hold: a
 * refusal is one line starting "etcd "; results are NUL-terminated; watch
 * events arrive in increasing revision order, never twice. */
#include <curl/curl.h>

static CURLcode fuzz_curl_perform(CURL *h);
static CURLcode fuzz_curl_getinfo(CURL *h, CURLINFO info, long *out);
#undef curl_easy_getinfo
#define curl_easy_perform(h) fuzz_curl_perform(h)
#define curl_easy_getinfo(h, info, out) fuzz_curl_getinfo(h, info, out)

#include "etcd.c"

#include "fuzz.h"

static struct moe_etcd *client;
static const uint8_t *answer;
static size_t answer_len;
static long answer_http;
static CURLcode answer_rc;

static CURLcode fuzz_curl_perform(CURL *h)
{
    if (answer_rc != CURLE_OK)
        return answer_rc;
    /* in two pieces, as curl delivers an answer in chunks */
    size_t half = answer_len / 2;
    if (client_write((char *)answer, 1, half, client) != half ||
        client_write((char *)answer + half, 1, answer_len - half, client) != answer_len - half)
        return CURLE_WRITE_ERROR;
    return CURLE_OK;
}

static CURLcode fuzz_curl_getinfo(CURL *h, CURLINFO info, long *out)
{
    *out = info == CURLINFO_RESPONSE_CODE ? answer_http : 0;
    return CURLE_OK;
}

static void destroy_client(void)
{
    moe_etcd_destroy(client);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    struct moe_error err = {0};
    if (moe_etcd_create("http://127.0.0.1:1,http://127.0.0.1:2", 1000, &client, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        abort();
    }
    atexit(destroy_client);
    return 0;
}

static void check_err(enum moe_status st, const struct moe_error *err)
{
    FUZZ_CHECK(st != MOE_OK && err->code == st && fuzz_msg_ok(err->msg) &&
                   !strncmp(err->msg, "etcd ", 5),
               "status %d: '%s'", st, err->msg);
}

static void check_kv(const struct moe_etcd_kv *kv)
{
    FUZZ_CHECK(kv->key && kv->value && kv->key[kv->key_len] == '\0' &&
                   kv->value[kv->value_len] == '\0',
               "kv strings");
}

/* ---- the watch stream ----------------------------------------------------------------- */

struct watch_seen {
    int64_t last_rev; /* of the last PUT/DELETE delivered */
    int64_t floor;    /* events from a RESYNC on come at or after its revision */
    int n;
};

static void on_event(void *user, const struct moe_etcd_event *ev)
{
    struct watch_seen *s = user;
    FUZZ_CHECK(ev->key && ev->value && ev->key[ev->key_len] == '\0' &&
                   ev->value[ev->value_len] == '\0',
               "event strings");
    if (ev->type == MOE_ETCD_EVENT_RESYNC) {
        s->floor = ev->mod_revision;
        return;
    }
    FUZZ_CHECK(s->n == 0 || ev->mod_revision > s->last_rev,
               "event at revision %" PRId64 " after %" PRId64, ev->mod_revision, s->last_rev);
    FUZZ_CHECK(ev->mod_revision >= s->floor,
               "event at revision %" PRId64 " before the resync at %" PRId64, ev->mod_revision,
               s->floor);
    s->last_rev = ev->mod_revision;
    s->n++;
}

static void fuzz_watch(const uint8_t *body, size_t n, size_t chunk, int64_t start)
{
    struct watch_seen seen = {0};
    struct moe_etcd_watch w = {.fn = on_event, .user = &seen, .next_rev = start};
    atomic_init(&w.stop, 0);
    atomic_init(&w.n_connects, 0);
    for (size_t at = 0; at < n;) {
        size_t k = n - at < chunk ? n - at : chunk;
        if (watch_write((char *)body + at, 1, k, &w) != k)
            break; /* the stream ends: the watcher reconnects */
        at += k;
    }
    free(w.line.data);
}

/* ---- unary operations ----------------------------------------------------------------- */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    static const long https[8] = {200, 200, 200, 200, 400, 404, 500, 503};
    static const CURLcode rcs[8] = {CURLE_OK,
                                    CURLE_OK,
                                    CURLE_OK,
                                    CURLE_OK,
                                    CURLE_OK,
                                    CURLE_OK,
                                    CURLE_COULDNT_CONNECT,
                                    CURLE_OPERATION_TIMEDOUT};
    int op = data[0] & 15, flag = data[0] >> 4;
    answer = data + 2;
    answer_len = size - 2;
    answer_http = https[data[1] & 7];
    answer_rc = rcs[(data[1] >> 3) & 7];
    struct moe_error err = {0};
    enum moe_status st;
    switch (op) {
    case 0: {
        int64_t rev = -1;
        if ((st = moe_etcd_put(client, "/moe/k", "v", 1, flag, &rev, &err)))
            check_err(st, &err);
        break;
    }
    case 1: {
        struct moe_etcd_kv kv;
        int64_t rev;
        if ((st = moe_etcd_get(client, "/moe/k", &kv, &rev, &err)))
            check_err(st, &err);
        else
            check_kv(&kv);
        moe_etcd_kv_clear(&kv);
        break;
    }
    case 2: {
        struct moe_etcd_kvs kvs;
        if ((st = moe_etcd_get_prefix(client, flag & 1 ? "" : "/moe/", &kvs, &err)))
            check_err(st, &err);
        for (size_t i = 0; i < kvs.n; i++)
            check_kv(&kvs.kvs[i]);
        FUZZ_CHECK(st == MOE_OK || (!kvs.n && !kvs.kvs), "kvs kept after an error");
        moe_etcd_kvs_clear(&kvs);
        break;
    }
    case 3: {
        int64_t n = -1;
        if ((st = moe_etcd_delete(client, "/moe/k", flag & 1, &n, &err)))
            check_err(st, &err);
        break;
    }
    case 4: {
        int64_t lease = -1, ttl = -1;
        if ((st = moe_etcd_lease_grant(client, 5, &lease, &ttl, &err)))
            check_err(st, &err);
        else
            FUZZ_CHECK(lease != 0 && ttl > 0, "lease %" PRId64 " TTL %" PRId64, lease, ttl);
        break;
    }
    case 5: {
        int64_t ttl = -1;
        if ((st = moe_etcd_lease_keepalive(client, 7, &ttl, &err)))
            check_err(st, &err);
        else
            FUZZ_CHECK(ttl > 0, "TTL %" PRId64, ttl);
        break;
    }
    case 6:
        if ((st = moe_etcd_lease_revoke(client, 7, &err)))
            check_err(st, &err);
        break;
    case 7: {
        int ok = -1;
        int64_t rev = -1;
        if ((st = moe_etcd_cas(client, "/moe/placement/m", flag, "{}", 2, 0, &ok, &rev, &err)))
            check_err(st, &err);
        else
            FUZZ_CHECK(ok == 0 || ok == 1, "succeeded = %d", ok);
        break;
    }
    default: fuzz_watch(answer, answer_len, 1 + data[1] % 97u, flag & 1 ? 0 : 5); break;
    }
    return 0;
}
