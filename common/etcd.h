/* An etcd v3 client over etcd's HTTP/JSON gateway (libcurl + cJSON): the
 * coordinator learns workers from it (workers register keys under a lease
 * kept alive by a lease keeper; the coordinator watches the prefix) and
 * expert placement is stored in it behind an epoch changed by compare-and-swap.
 *
 * Endpoints are a comma-separated list of base URLs
 * ("http://10.0.0.1:2379,http://10.0.0.2:2379"). A request that cannot
 * connect to one endpoint is retried on the next (it was never sent, so this
 * is safe even for a CAS); any other transport failure is reported and the
 * next request starts from the next endpoint.
 *
 * Keys are NUL-terminated strings; values are byte strings (pointer + length).
 * Revisions and lease ids are int64 (etcd sends them as JSON strings; they are
 * never converted through a double).
 *
 * Errors are one line naming the endpoint, the operation and the key:
 * "etcd http://127.0.0.1:2379 put 'workers/3': cannot connect (...)".
 * Status codes: MOE_ERR_IO for transport failures (refused, timed out, reset)
 * and etcd "unavailable" answers, MOE_ERR_NOT_FOUND for a missing key or
 * lease, MOE_ERR_INVALID for a request etcd rejects as invalid,
 * MOE_ERR_FORMAT for an answer that is not the expected JSON.
 *
 * Threads: a `struct moe_etcd` owns one reused curl handle and is NOT
 * thread-safe: use one client per thread. Watchers and lease keepers run
 * their own thread with their own connection. */
#ifndef MOE_ETCD_H
#define MOE_ETCD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe_error.h"

struct moe_etcd;

/* One key-value pair as stored in etcd. `key` and `value` are heap copies,
 * NUL-terminated for convenience (value_len excludes the NUL). */
struct moe_etcd_kv {
    char *key;
    size_t key_len;
    char *value;
    size_t value_len;
    int64_t create_revision;
    int64_t mod_revision;
    int64_t version;
    int64_t lease; /* 0: no lease */
};

/* The result of a range read. */
struct moe_etcd_kvs {
    struct moe_etcd_kv *kvs; /* (n) sorted by key */
    size_t n;
    int64_t revision; /* store revision the read saw (the header revision) */
};

/* ---- TLS ------------------------------------------------------------------ */

/* TLS to etcd (https:// endpoints), with a client certificate for etcd's
 * --client-cert-auth. File paths (borrowed until moe_etcd_set_tls copies
 * them); NULL: libcurl's default (the system's CAs; no client certificate). */
struct moe_etcd_tls {
    const char *cacert; /* --etcd-cacert: CAs etcd's certificate must chain to */
    const char *cert;   /* --etcd-cert: client certificate (PEM) */
    const char *key;    /* --etcd-key: its private key (PEM) */
    const char *dir;    /* --etcd-tls-dir: DIR/ca.crt, DIR/tls.crt, DIR/tls.key (those present) */
};

/* Help lines of the four flags, for usage() texts. */
#define MOE_ETCD_TLS_USAGE                                                                         \
    "  --etcd-cacert FILE  CA certificates etcd's must chain to (https:// endpoints)\n"            \
    "  --etcd-cert FILE    client certificate for etcd (--client-cert-auth)\n"                     \
    "  --etcd-key FILE     its private key\n"                                                      \
    "  --etcd-tls-dir DIR  DIR/ca.crt, DIR/tls.crt, DIR/tls.key (those present)\n"

/* Takes flag `k` with value `v` into *t when it is one of the four: true if
 * it was. */
bool moe_etcd_tls_cli_flag(struct moe_etcd_tls *t, const char *k, const char *v);

/* Sets the TLS files for every etcd client, watcher and lease keeper the
 * process makes from now on: process-wide (one etcd cluster per process),
 * called once by a main before any of them exists. Checks that each file
 * can be read and that a certificate comes with its key. With TLS set, an
 * http:// endpoint is refused by the creators (moe_etcd_create ...). libcurl
 * reads the files on each new connection, so replaced files are used by the
 * next one. A `t` with no file clears the setting. Not thread-safe against
 * clients being created meanwhile. */
enum moe_status moe_etcd_set_tls(const struct moe_etcd_tls *t, struct moe_error *err);

/* Frees the strings of `kv` and zeroes it. NULL is a no-op. */
void moe_etcd_kv_clear(struct moe_etcd_kv *kv);

/* Frees every pair and the array of `kvs` and zeroes it. NULL is a no-op. */
void moe_etcd_kvs_clear(struct moe_etcd_kvs *kvs);

/* Creates a client for `endpoints` (see above). `timeout_ms` (> 0) bounds
 * every request, connection included. On success *out is owned by the
 * caller (moe_etcd_destroy); on error *out is NULL. Connects lazily: an
 * unreachable etcd is reported by the first request, not here. */
enum moe_status moe_etcd_create(const char *endpoints, int timeout_ms, struct moe_etcd **out,
                                struct moe_error *err);

/* Closes the connection and frees the client. NULL is a no-op. */
void moe_etcd_destroy(struct moe_etcd *c);

/* Puts `value` (value_len bytes) at `key`, attached to `lease` (0: none).
 * Stores the new store revision in *revision when it is not NULL.
 * An unknown or expired lease gives MOE_ERR_NOT_FOUND. */
enum moe_status moe_etcd_put(struct moe_etcd *c, const char *key, const void *value,
                             size_t value_len, int64_t lease, int64_t *revision,
                             struct moe_error *err);

/* Reads one key into *out (caller frees with moe_etcd_kv_clear). A missing
 * key gives MOE_ERR_NOT_FOUND and leaves *out zeroed. *revision (may be NULL)
 * receives the store revision of the read. */
enum moe_status moe_etcd_get(struct moe_etcd *c, const char *key, struct moe_etcd_kv *out,
                             int64_t *revision, struct moe_error *err);

/* Reads every key starting with `prefix` ("" = all keys) into *out (caller
 * frees with moe_etcd_kvs_clear; zeroed on error). No match is not an error. */
enum moe_status moe_etcd_get_prefix(struct moe_etcd *c, const char *prefix,
                                    struct moe_etcd_kvs *out, struct moe_error *err);

/* Deletes `key` (prefix == 0) or every key starting with `key` (prefix != 0).
 * *n_deleted (may be NULL) receives the number of keys deleted; deleting
 * nothing is not an error. */
enum moe_status moe_etcd_delete(struct moe_etcd *c, const char *key, int prefix, int64_t *n_deleted,
                                struct moe_error *err);

/* Grants a lease of `ttl_s` seconds (etcd may raise a TTL below its minimum,
 * about 2 s). *lease receives the id, *granted_ttl_s (may be NULL) the TTL. */
enum moe_status moe_etcd_lease_grant(struct moe_etcd *c, int64_t ttl_s, int64_t *lease,
                                     int64_t *granted_ttl_s, struct moe_error *err);

/* Refreshes `lease` once; *ttl_s (may be NULL) receives the renewed TTL.
 * An expired or revoked lease gives MOE_ERR_NOT_FOUND ("lease N expired"). */
enum moe_status moe_etcd_lease_keepalive(struct moe_etcd *c, int64_t lease, int64_t *ttl_s,
                                         struct moe_error *err);

/* Revokes `lease`, deleting the keys attached to it. An unknown lease gives
 * MOE_ERR_NOT_FOUND. */
enum moe_status moe_etcd_lease_revoke(struct moe_etcd *c, int64_t lease, struct moe_error *err);

/* Compare-and-swap in one transaction: puts `value` at `key` (attached to
 * `lease`, 0: none) only if the key's mod_revision equals
 * `expected_mod_revision`, where 0 means "the key must not exist".
 * On MOE_OK, *succeeded tells whether the put happened, and *mod_revision
 * (may be NULL) receives the key's mod_revision after the transaction: the
 * new revision on success, the current one (0 if absent) on failure, ready
 * for the next attempt. A lost race is MOE_OK with *succeeded = 0. */
enum moe_status moe_etcd_cas(struct moe_etcd *c, const char *key, int64_t expected_mod_revision,
                             const void *value, size_t value_len, int64_t lease, int *succeeded,
                             int64_t *mod_revision, struct moe_error *err);

/* ---- watch --------------------------------------------------------------- */

enum moe_etcd_event_type {
    MOE_ETCD_EVENT_PUT,
    MOE_ETCD_EVENT_DELETE,
    /* History was compacted past the revision the watcher needed: events
     * were lost. mod_revision is the compaction revision; the watch goes on
     * from there. Re-read the prefix (moe_etcd_get_prefix) to resynchronise. */
    MOE_ETCD_EVENT_RESYNC,
};

/* One event, valid only during the callback. For a DELETE, value is empty
 * and create_revision/lease are 0. */
struct moe_etcd_event {
    enum moe_etcd_event_type type;
    const char *key; /* NUL-terminated */
    size_t key_len;
    const char *value; /* NUL-terminated */
    size_t value_len;
    int64_t mod_revision;
    int64_t create_revision;
    int64_t lease;
};

/* Called on the watcher's thread, in revision order. Must not destroy the
 * watcher it belongs to. */
typedef void (*moe_etcd_watch_fn)(void *user, const struct moe_etcd_event *ev);

struct moe_etcd_watch;

/* Starts a thread that watches `key` (prefix == 0) or every key starting
 * with `key` (prefix != 0) from `start_revision` (0: from now; typically the
 * revision of a moe_etcd_get_prefix + 1, so that nothing is missed between
 * the read and the watch) and calls fn(user, event) for every event.
 * When the stream ends or fails (etcd restarted, in-band error, endpoint
 * down) the watcher reconnects, trying the endpoints in turn with a backoff
 * of 50 ms up to 1 s, and resumes from the last delivered revision + 1, so
 * no event is lost or repeated (unless compacted: see RESYNC).
 * `timeout_ms` bounds each connection attempt. On success *out is owned by
 * the caller (moe_etcd_watch_destroy). */
enum moe_status moe_etcd_watch_create(const char *endpoints, int timeout_ms, const char *key,
                                      int prefix, int64_t start_revision, moe_etcd_watch_fn fn,
                                      void *user, struct moe_etcd_watch **out,
                                      struct moe_error *err);

/* Stops the watcher (promptly: the transfer is woken and aborted, no
 * callback runs after this returns) and frees it. NULL is a no-op. */
void moe_etcd_watch_destroy(struct moe_etcd_watch *w);

/* Number of times the stream was (re)established ("created" answer seen);
 * 1 after the first connection. For tests and monitoring. */
int moe_etcd_watch_n_connects(const struct moe_etcd_watch *w);

/* ---- lease keeper ---------------------------------------------------------- */

/* Called once, on the keeper's thread, when the lease is lost: etcd says it
 * expired, or no keepalive succeeded for a whole TTL. `why` is one line. */
typedef void (*moe_etcd_lease_lost_fn)(void *user, int64_t lease, const struct moe_error *why);

struct moe_etcd_keeper;

/* Starts a thread with its own client that refreshes `lease` now and then
 * every TTL/3 (retrying failed refreshes every 200 ms until the TTL is
 * spent). `lost` (may be NULL) is called once if the lease is lost; the
 * thread then stops. On success *out is owned by the caller. */
enum moe_status moe_etcd_keeper_create(const char *endpoints, int timeout_ms, int64_t lease,
                                       moe_etcd_lease_lost_fn lost, void *user,
                                       struct moe_etcd_keeper **out, struct moe_error *err);

/* Nonzero once the lease was reported lost. */
int moe_etcd_keeper_lost(const struct moe_etcd_keeper *k);

/* Stops the keeper (promptly: an in-flight refresh is aborted) and frees
 * it. Does not revoke the lease: revoke it first to drop the keys at once,
 * or let it expire. NULL is a no-op. */
void moe_etcd_keeper_destroy(struct moe_etcd_keeper *k);

#endif
