#include "serve/registration.h"

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "etcd.h"
#include "placement.h"

/* Re-registration after a lost lease: the first attempt at once, then a
 * backoff doubling from RETRY_MIN_MS to RETRY_MAX_MS (with +-25% jitter, so
 * the workers of a cluster do not hit a restarted etcd together). */
#define RETRY_MIN_MS 100
#define RETRY_MAX_MS 2000
#define ETCD_CALL_MS 1000 /* one attempt's calls: the main loop waits for them */

struct worker_registration {
    char *endpoints;
    char key[256];
    char value[1024];
    int ttl;
    struct moe_etcd *etcd;
    struct moe_etcd_keeper *keeper;
    int64_t lease;
    /* the placement it follows */
    struct moe_group *group;
    const struct moe_config *cfg;
    char placement_key[300];
    int64_t last_epoch;
    struct moe_etcd_watch *placement_watch;
    /* re-registration (worker_registration_tick) */
    bool left;        /* worker_registration_leave ran: never register again */
    int64_t retry_at; /* moe_now_ms() of the next attempt; 0: registered */
    int retry_ms;     /* the backoff before the attempt after that */
    int n_attempts;   /* failed attempts since the lease was lost */
    uint64_t jitter;  /* xorshift state */
};

static enum moe_status register_worker(struct worker_registration *r, struct moe_error *err)
{
    int64_t granted;
    enum moe_status rc = moe_etcd_lease_grant(r->etcd, r->ttl, &r->lease, &granted, err);
    if (!rc)
        rc = moe_etcd_put(r->etcd, r->key, r->value, strlen(r->value), r->lease, NULL, err);
    if (!rc)
        rc = moe_etcd_keeper_create(r->endpoints, 2000, r->lease, NULL, NULL, &r->keeper, err);
    return rc;
}

static void follow_placement_value(struct worker_registration *r, const char *value)
{
    cJSON *root = cJSON_Parse(value);
    const cJSON *ep = cJSON_GetObjectItemCaseSensitive(root, "epoch");
    const cJSON *pl = cJSON_GetObjectItemCaseSensitive(root, "placement");
    char *text = pl ? cJSON_PrintUnformatted(pl) : NULL;
    int64_t epoch =
        cJSON_IsNumber(ep) && ep->valuedouble >= 0 && ep->valuedouble <= 9007199254740992.0
            ? (int64_t)ep->valuedouble /* in range: the cast is defined */
            : -1;
    struct moe_placement p = {0};
    struct moe_error err = {0};
    if (epoch < 0 || !text) {
        fprintf(stderr, "moe-worker: %s: no 'epoch' and 'placement' in the value; ignored\n",
                r->placement_key);
    } else if (epoch > r->last_epoch) { /* a watch may repeat events after a reconnect */
        if (moe_placement_parse(text, r->placement_key, r->cfg->n_layer, r->cfg->n_expert,
                                r->group->size, &p, &err) ||
            moe_group_propose_placement(r->group, &p, epoch, &err)) {
            fprintf(stderr, "moe-worker: placement epoch %lld refused: %s\n", (long long)epoch,
                    err.msg);
        } else {
            r->last_epoch = epoch;
            fprintf(stderr, "moe-worker: placement epoch %lld received; loading experts\n",
                    (long long)epoch);
        }
    }
    moe_placement_free(&p);
    free(text);
    cJSON_Delete(root);
}

static void on_placement_event(void *user, const struct moe_etcd_event *ev)
{
    if (ev->type == MOE_ETCD_EVENT_PUT)
        follow_placement_value(user, ev->value);
}

static enum moe_status follow_placement(struct worker_registration *r, struct moe_error *err)
{
    struct moe_etcd_kv kv = {0};
    int64_t rev = 0;
    enum moe_status rc = moe_etcd_get(r->etcd, r->placement_key, &kv, &rev, err);
    if (rc == MOE_OK && kv.value)
        follow_placement_value(r, kv.value);
    moe_etcd_kv_clear(&kv);
    if ((rc && rc != MOE_ERR_NOT_FOUND) ||
        moe_etcd_watch_create(r->endpoints, 2000, r->placement_key, 0, rev + 1, on_placement_event,
                              r, &r->placement_watch, err))
        return moe_error_prefix(err, "watching %s", r->placement_key);
    return MOE_OK;
}

enum moe_status worker_registration_create(const struct worker_registration_opts *o,
                                           struct worker_registration **out, struct moe_error *err)
{
    *out = NULL;
    struct worker_registration *r = calloc(1, sizeof *r);
    if (!r || !(r->endpoints = strdup(o->endpoints))) {
        free(r);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    r->ttl = o->lease_ttl_s;
    r->group = o->group;
    r->cfg = o->cfg;
    snprintf(r->key, sizeof r->key, "/moe/workers/%s", o->id);
    snprintf(r->value, sizeof r->value,
             "{\"id\":\"%s\",\"address\":\"%s\",\"role\":\"%s\",\"device\":\"%s\","
             "\"model\":\"%s\",\"kv_blocks_total\":%d,\"block_size\":%d}",
             o->id, o->address, o->role, o->device, o->model_name, o->kv_blocks_total,
             o->block_size);
    r->jitter = (uint64_t)moe_now_ns() ^ ((uint64_t)(uintptr_t)r << 17) ^ 0x9e3779b97f4a7c15ull;
    enum moe_status rc = moe_etcd_create(o->endpoints, ETCD_CALL_MS, &r->etcd, err);
    if (!rc)
        rc = register_worker(r, err);
    if (rc)
        moe_error_prefix(err, "registering in etcd");
    if (!rc && o->group && o->group->size > 1) {
        snprintf(r->placement_key, sizeof r->placement_key, "/moe/placement/%s", o->model_name);
        rc = follow_placement(r, err);
    }
    if (rc) {
        worker_registration_destroy(r);
        return rc;
    }
    *out = r;
    return MOE_OK;
}

/* The backoff after a failed attempt, with +-25% jitter. */
static int next_backoff(struct worker_registration *r)
{
    int base = r->retry_ms;
    r->retry_ms = r->retry_ms * 2 > RETRY_MAX_MS ? RETRY_MAX_MS : r->retry_ms * 2;
    r->jitter ^= r->jitter << 13;
    r->jitter ^= r->jitter >> 7;
    r->jitter ^= r->jitter << 17;
    return base * 3 / 4 + (int)(r->jitter % (uint64_t)(base / 2 + 1));
}

void worker_registration_tick(struct worker_registration *r)
{
    if (!r || r->left)
        return;
    int64_t now = moe_now_ms();
    if (r->keeper) {
        if (!moe_etcd_keeper_lost(r->keeper))
            return;
        /* etcd restarted and the lease expired, or no keepalive got through
         * for a whole TTL (etcd down, a partition): a new lease and key. */
        fprintf(stderr,
                "moe-worker: etcd lease %lld lost; registering again (retrying with "
                "backoff until etcd answers)\n",
                (long long)r->lease);
        moe_etcd_keeper_destroy(r->keeper);
        r->keeper = NULL;
        r->retry_at = now;
        r->retry_ms = RETRY_MIN_MS;
        r->n_attempts = 0;
    }
    if (now < r->retry_at)
        return;
    struct moe_error err = {0};
    if (register_worker(r, &err) == MOE_OK) {
        fprintf(stderr,
                "moe-worker: registered again in etcd as %s (lease %lld, after %d failed "
                "attempt%s)\n",
                r->key, (long long)r->lease, r->n_attempts, r->n_attempts == 1 ? "" : "s");
        r->retry_at = 0;
        return;
    }
    moe_etcd_keeper_destroy(r->keeper); /* a keeper that started is not kept half-registered */
    r->keeper = NULL;
    int wait = next_backoff(r);
    r->retry_at = moe_now_ms() + wait;
    /* one line for the first failures, then one every 30 attempts (about a minute) */
    if (r->n_attempts++ < 3 || r->n_attempts % 30 == 0)
        fprintf(stderr,
                "moe-worker: registering in etcd (attempt %d) failed: %s; next try in %d "
                "ms\n",
                r->n_attempts, err.msg, wait);
}

void worker_registration_leave(struct worker_registration *r)
{
    if (!r)
        return;
    r->left = true;
    moe_etcd_keeper_destroy(r->keeper);
    r->keeper = NULL;
    if (r->lease) {
        struct moe_error err;
        if (moe_etcd_lease_revoke(r->etcd, r->lease, &err))
            fprintf(stderr, "moe-worker: revoking lease: %s\n", err.msg);
        r->lease = 0;
    }
}

void worker_registration_destroy(struct worker_registration *r)
{
    if (!r)
        return;
    moe_etcd_watch_destroy(r->placement_watch);
    worker_registration_leave(r);
    moe_etcd_destroy(r->etcd);
    free(r->endpoints);
    free(r);
}
