#include "serve/registration.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "etcd.h"
#include "placement.h"

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
    enum moe_status rc = moe_etcd_create(o->endpoints, 2000, &r->etcd, err);
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

void worker_registration_tick(struct worker_registration *r)
{
    if (!r || !r->keeper || !moe_etcd_keeper_lost(r->keeper))
        return;
    fprintf(stderr, "moe-worker: etcd lease lost; registering again\n");
    moe_etcd_keeper_destroy(r->keeper);
    r->keeper = NULL;
    struct moe_error err;
    if (register_worker(r, &err))
        fprintf(stderr, "moe-worker: %s (will retry)\n", err.msg);
}

void worker_registration_leave(struct worker_registration *r)
{
    if (!r)
        return;
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
