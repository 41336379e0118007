/* Fuzz target: the placement JSON the coordinator reads
 * (coordinator/placement_admin.c): the epoch record it keeps in etcd at
 * /moe/placement/<model> ({"epoch", "placement", "previous"}), read back by
 * store_load_locked, and the placement_json of Admin ApplyPlacement, parsed
 * by map_from_json and checked by moe_placement_check before it is stored.
 * A map that parses is also planned from (planner_plan), as PlanPlacement
 * does with the current map.
 *
 * Those functions are static and reached only through etcd or an Admin
 * call, so this file includes placement_admin.c with moe_etcd_get replaced
 * by a fake that answers the fuzz input as the key's value.
 *
 * Input: byte 0 sets the shape: ranks 1..8 (bits 0-2), layers 1..4 (bits
 * 3-4), experts 1, 2, 4 or 8 (bits 5-6); bit 7 picks ApplyPlacement (1) or
 * the etcd record (0). The rest is the JSON text. What must hold: errors
 * are one line; every map that is accepted is well formed (moe_placement_check
 * without a slot limit) and has the model's shape; the planner's result is
 * well formed within its slots. */
#include "etcd.h"

static enum moe_status fuzz_etcd_get(struct moe_etcd *c, const char *key, struct moe_etcd_kv *out,
                                     int64_t *revision, struct moe_error *err);
#define moe_etcd_get fuzz_etcd_get

#include "placement_admin.c"

#include "fuzz.h"

static const char *value;

static enum moe_status fuzz_etcd_get(struct moe_etcd *c, const char *key, struct moe_etcd_kv *out,
                                     int64_t *revision, struct moe_error *err)
{
    memset(out, 0, sizeof *out);
    if (!*value)
        return moe_error_set(err, MOE_ERR_NOT_FOUND, "etcd fuzz get '%s': key not found", key);
    out->key = strdup(key);
    out->key_len = strlen(key);
    out->value = strdup(value);
    out->value_len = strlen(value);
    out->mod_revision = 7;
    if (!out->key || !out->value) {
        moe_etcd_kv_clear(out);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    return MOE_OK;
}

static void check_map(const struct moe_placement *m, int n_layer, int n_expert, const char *what)
{
    struct moe_error err = {0};
    FUZZ_CHECK(m->n_layer == n_layer && m->n_expert == n_expert && m->n_rank >= 1, "%s: shape",
               what);
    FUZZ_CHECK(moe_placement_check(m, 0, &err) == MOE_OK, "%s accepted but not well formed: %s",
               what, err.msg);
}

static void plan_from(const struct moe_placement *cur, int slots)
{
    size_t n = (size_t)cur->n_layer * cur->n_expert;
    double *load = malloc(n * sizeof *load);
    FUZZ_CHECK(load, "out of memory");
    for (size_t i = 0; i < n; i++)
        load[i] = (double)((i * 7919) % 13); /* uneven, some zero */
    struct planner_params pp = {
        .n_redundant = cur->n_rank > 1 ? 1 : 0, .slots_per_rank = slots, .keep_tolerance = 0.05};
    struct planner_result r;
    struct moe_error err = {0};
    if (planner_plan(&pp, cur, load, &r, &err) == MOE_OK) {
        FUZZ_CHECK(moe_placement_check(&r.map, r.slots_per_rank, &err) == MOE_OK,
                   "the planner's map: %s", err.msg);
        planner_result_free(&r);
    } else {
        FUZZ_CHECK(fuzz_msg_ok(err.msg), "planner refusal '%s'", err.msg);
    }
    free(load);
}

/* Admin ApplyPlacement's parsing (handle_apply): the map or {"placement": map}. */
static void fuzz_apply(const char *text, int n_layer, int n_expert, int n_rank)
{
    struct moe_error err = {0};
    struct moe_placement next = {0};
    cJSON *root = cJSON_Parse(text);
    const cJSON *obj = root;
    if (cJSON_IsObject(root) && cJSON_GetObjectItemCaseSensitive(root, "placement"))
        obj = cJSON_GetObjectItemCaseSensitive(root, "placement");
    if (root) {
        if (map_from_json(obj, n_layer, n_expert, n_rank, &next, &err) == MOE_OK) {
            check_map(&next, n_layer, n_expert, "placement_json");
            FUZZ_CHECK(next.n_rank == n_rank, "n_rank %d, groups of %d", next.n_rank, n_rank);
            int slots = 2 * ((n_expert + n_rank - 1) / n_rank); /* slot_capacity's default */
            if (moe_placement_check(&next, slots, &err) == MOE_OK)
                plan_from(&next, slots);
        } else {
            FUZZ_CHECK(fuzz_msg_ok(err.msg), "refusal '%s'", err.msg);
        }
    }
    moe_placement_free(&next);
    cJSON_Delete(root);
}

/* The etcd record, read as store_load_locked reads it. */
static void fuzz_record(const char *text, int n_layer, int n_expert)
{
    struct coord *c = calloc(1, sizeof *c);
    FUZZ_CHECK(c, "out of memory");
    c->cfg.n_layer = n_layer;
    c->cfg.n_expert = n_expert;
    struct coord_placement p = {.c = c, .etcd = (struct moe_etcd *)c};
    snprintf(p.key, sizeof p.key, "/moe/placement/fuzz");
    value = text;
    struct moe_error err = {0};
    enum moe_status st = store_load_locked(&p, &err);
    if (st != MOE_OK) {
        FUZZ_CHECK(fuzz_msg_ok(err.msg) && !p.has_map && !p.has_prev, "refusal '%s'", err.msg);
    } else {
        if (p.has_map) {
            check_map(&p.map, n_layer, n_expert, "placement");
            FUZZ_CHECK(p.epoch >= 1, "epoch %" PRIu64, p.epoch);
            struct moe_placement cur = {0};
            FUZZ_CHECK(current_map_locked(&p, p.map.n_rank, &cur, &err) == MOE_OK, "%s", err.msg);
            moe_placement_free(&cur);
        }
        if (p.has_prev)
            check_map(&p.prev, n_layer, n_expert, "previous");
    }
    store_clear_locked(&p);
    free(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int n_rank = 1 + (data[0] & 7), n_layer = 1 + ((data[0] >> 3) & 3);
    int n_expert = 1 << ((data[0] >> 5) & 3);
    char *text = fuzz_cstr(data + 1, size - 1);
    if (!text)
        return 0;
    if (data[0] & 0x80)
        fuzz_apply(text, n_layer, n_expert, n_rank);
    else
        fuzz_record(text, n_layer, n_expert);
    free(text);
    return 0;
}
