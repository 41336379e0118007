/* The expert placement map (placement.h): construction, checks, the file
 * format, and the one rule the MoE layer routes by. */
#include "placement.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model_config.h"
#include "read_file.h"

#define PLACEMENT_MAX_FILE ((size_t)64 << 20) /* 64 MiB of JSON: far past any placement */

enum moe_status moe_placement_alloc(int n_layer, int n_expert, int n_rank, struct moe_placement *m,
                                    struct moe_error *err)
{
    memset(m, 0, sizeof *m);
    if (n_layer < 1 || n_expert < 1 || n_rank < 1 || n_rank > 32767 || n_layer > (1 << 16) ||
        n_expert > (1 << 16))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "placement of %d experts x %d layers over %d ranks is invalid",
                             n_expert, n_layer, n_rank);
    size_t n = (size_t)n_layer * (size_t)n_expert;
    m->n_replicas = calloc(n, 1);
    m->ranks = calloc(n * MOE_PLACEMENT_MAX_REPLICAS, sizeof *m->ranks);
    if (!m->n_replicas || !m->ranks) {
        moe_placement_free(m);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    m->n_layer = n_layer;
    m->n_expert = n_expert;
    m->n_rank = n_rank;
    return MOE_OK;
}

enum moe_status moe_placement_default(int n_layer, int n_expert, int n_rank,
                                      struct moe_placement *m, struct moe_error *err)
{
    enum moe_status rc = moe_placement_alloc(n_layer, n_expert, n_rank, m, err);
    if (rc)
        return rc;
    for (int l = 0; l < n_layer; l++)
        for (int e = 0; e < n_expert; e++) {
            size_t i = (size_t)l * n_expert + e;
            m->n_replicas[i] = 1;
            m->ranks[i * MOE_PLACEMENT_MAX_REPLICAS] = (int16_t)((int64_t)e * n_rank / n_expert);
        }
    return MOE_OK;
}

enum moe_status moe_placement_copy(const struct moe_placement *src, struct moe_placement *dst,
                                   struct moe_error *err)
{
    enum moe_status rc = moe_placement_alloc(src->n_layer, src->n_expert, src->n_rank, dst, err);
    if (rc)
        return rc;
    size_t n = (size_t)src->n_layer * src->n_expert;
    memcpy(dst->n_replicas, src->n_replicas, n);
    memcpy(dst->ranks, src->ranks, n * MOE_PLACEMENT_MAX_REPLICAS * sizeof *dst->ranks);
    return MOE_OK;
}

void moe_placement_free(struct moe_placement *m)
{
    if (!m)
        return;
    free(m->n_replicas);
    free(m->ranks);
    memset(m, 0, sizeof *m);
}

bool moe_placement_holds(const struct moe_placement *m, int layer, int expert, int rank)
{
    int n = moe_placement_n_replicas(m, layer, expert);
    for (int i = 0; i < n; i++)
        if (moe_placement_rank(m, layer, expert, i) == rank)
            return true;
    return false;
}

enum moe_status moe_placement_add(struct moe_placement *m, int layer, int expert, int rank,
                                  struct moe_error *err)
{
    if (layer < 0 || layer >= m->n_layer || expert < 0 || expert >= m->n_expert)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "layer %d expert %d: not in the model (%d layers, %d experts)", layer,
                             expert, m->n_layer, m->n_expert);
    if (rank < 0 || rank >= m->n_rank)
        return moe_error_set(err, MOE_ERR_INVALID, "layer %d expert %d: rank %d is not in [0, %d)",
                             layer, expert, rank, m->n_rank);
    size_t i = (size_t)layer * m->n_expert + expert;
    int n = m->n_replicas[i];
    if (moe_placement_holds(m, layer, expert, rank))
        return moe_error_set(err, MOE_ERR_INVALID, "layer %d expert %d: rank %d listed twice",
                             layer, expert, rank);
    if (n >= MOE_PLACEMENT_MAX_REPLICAS)
        return moe_error_set(err, MOE_ERR_INVALID, "layer %d expert %d: more than %d replicas",
                             layer, expert, MOE_PLACEMENT_MAX_REPLICAS);
    int16_t *r = m->ranks + i * MOE_PLACEMENT_MAX_REPLICAS;
    int j = n;
    while (j > 0 && r[j - 1] > rank) {
        r[j] = r[j - 1];
        j--;
    }
    r[j] = (int16_t)rank;
    m->n_replicas[i] = (uint8_t)(n + 1);
    return MOE_OK;
}

enum moe_status moe_placement_check(const struct moe_placement *m, int slots_per_rank,
                                    struct moe_error *err)
{
    int *count = calloc((size_t)m->n_rank, sizeof *count);
    if (!count)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    enum moe_status rc = MOE_OK;
    for (int l = 0; l < m->n_layer && !rc; l++) {
        memset(count, 0, (size_t)m->n_rank * sizeof *count);
        for (int e = 0; e < m->n_expert && !rc; e++) {
            int n = moe_placement_n_replicas(m, l, e);
            if (n < 1 || n > MOE_PLACEMENT_MAX_REPLICAS) {
                rc = moe_error_set(err, MOE_ERR_INVALID,
                                   "layer %d expert %d: has %d replicas, needs 1 to %d", l, e, n,
                                   MOE_PLACEMENT_MAX_REPLICAS);
                break;
            }
            for (int i = 0; i < n; i++) {
                int r = moe_placement_rank(m, l, e, i);
                if (r < 0 || r >= m->n_rank) {
                    rc = moe_error_set(err, MOE_ERR_INVALID,
                                       "layer %d expert %d: rank %d is not in [0, %d)", l, e, r,
                                       m->n_rank);
                    break;
                }
                for (int j = 0; j < i; j++)
                    if (moe_placement_rank(m, l, e, j) == r) {
                        rc = moe_error_set(err, MOE_ERR_INVALID,
                                           "layer %d expert %d: rank %d listed twice", l, e, r);
                        break;
                    }
                if (rc)
                    break;
                count[r]++;
            }
        }
        for (int r = 0; r < m->n_rank && !rc && slots_per_rank > 0; r++)
            if (count[r] > slots_per_rank)
                rc = moe_error_set(err, MOE_ERR_INVALID,
                                   "layer %d rank %d: holds %d experts, more than its %d slots", l,
                                   r, count[r], slots_per_rank);
    }
    free(count);
    return rc;
}

enum moe_status moe_placement_load_for_model(const char *path, const char *model_dir, int n_rank,
                                             struct moe_placement *out, struct moe_error *err)
{
    struct moe_config c;
    char cpath[4096];
    snprintf(cpath, sizeof cpath, "%s/config.json", model_dir);
    enum moe_status rc = moe_config_load(cpath, &c, err);
    return rc ? rc : moe_placement_load(path, c.n_layer, c.n_expert, n_rank, out, err);
}

/* Fills layer `l` from a JSON array of rank arrays. */
static enum moe_status fill_layer(struct moe_placement *p, int l, const cJSON *arr,
                                  const char *path, const char *where, struct moe_error *err)
{
    if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) != p->n_expert)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: %s must be an array of %d rank lists (one per expert)", path,
                             where, p->n_expert);
    for (int e = 0; e < p->n_expert; e++) {
        const cJSON *ranks = cJSON_GetArrayItem(arr, e);
        int n = cJSON_IsArray(ranks) ? cJSON_GetArraySize(ranks) : -1;
        if (n < 1 || n > MOE_PLACEMENT_MAX_REPLICAS)
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "%s: %s expert %d: needs a list of 1 to %d ranks", path, where, e,
                                 MOE_PLACEMENT_MAX_REPLICAS);
        for (int i = 0; i < n; i++) {
            const cJSON *r = cJSON_GetArrayItem(ranks, i);
            double v = cJSON_IsNumber(r) ? r->valuedouble : -1;
            if (v < 0 || v >= p->n_rank || v != (int)v)
                return moe_error_set(err, MOE_ERR_FORMAT,
                                     "%s: %s expert %d: rank %g is not in [0, %d)", path, where, e,
                                     cJSON_IsNumber(r) ? v : -1.0, p->n_rank);
            for (int j = 0; j < i; j++)
                if (moe_placement_rank(p, l, e, j) == (int)v)
                    return moe_error_set(err, MOE_ERR_FORMAT,
                                         "%s: %s expert %d: rank %d listed twice", path, where, e,
                                         (int)v);
            p->ranks[((size_t)l * p->n_expert + e) * MOE_PLACEMENT_MAX_REPLICAS + i] = (int16_t)v;
        }
        p->n_replicas[l * p->n_expert + e] = (uint8_t)n;
    }
    return MOE_OK;
}

enum moe_status moe_placement_load(const char *path, int n_layer, int n_expert, int n_rank,
                                   struct moe_placement *p, struct moe_error *err)
{
    char *text;
    enum moe_status rc = moe_read_text(path, PLACEMENT_MAX_FILE, &text, err);
    if (rc)
        return rc;
    rc = moe_placement_parse(text, path, n_layer, n_expert, n_rank, p, err);
    free(text);
    return rc;
}

enum moe_status moe_placement_parse(const char *text, const char *path, int n_layer, int n_expert,
                                    int n_rank, struct moe_placement *p, struct moe_error *err)
{
    cJSON *root = cJSON_Parse(text);
    enum moe_status rc;
    if (!cJSON_IsObject(root)) {
        rc = moe_error_set(err, MOE_ERR_FORMAT, "%s: not a JSON object", path);
        goto out;
    }
    const cJSON *nr = cJSON_GetObjectItemCaseSensitive(root, "n_rank");
    if (!cJSON_IsNumber(nr) || nr->valuedouble != n_rank) {
        rc = moe_error_set(err, MOE_ERR_FORMAT, "%s: field 'n_rank' must be %d (the group size)",
                           path, n_rank);
        goto out;
    }
    if ((rc = moe_placement_alloc(n_layer, n_expert, n_rank, p, err)))
        goto out;
    const cJSON *all = cJSON_GetObjectItemCaseSensitive(root, "experts");
    for (int l = 0; l < n_layer && !rc; l++)
        rc = fill_layer(p, l, all, path, "field 'experts'", err);
    const cJSON *layers = cJSON_GetObjectItemCaseSensitive(root, "layers");
    if (!rc && layers) {
        if (!cJSON_IsObject(layers)) {
            rc = moe_error_set(err, MOE_ERR_FORMAT, "%s: field 'layers' must be an object", path);
        }
        const cJSON *it;
        cJSON_ArrayForEach(it, layers)
        {
            if (rc)
                break;
            char *end;
            long l = strtol(it->string, &end, 10);
            if (*end || end == it->string || l < 0 || l >= n_layer) {
                rc =
                    moe_error_set(err, MOE_ERR_FORMAT, "%s: layers: '%s' is not a layer in [0, %d)",
                                  path, it->string, n_layer);
                break;
            }
            char where[64];
            snprintf(where, sizeof where, "layers.%ld", l);
            rc = fill_layer(p, (int)l, it, path, where, err);
        }
    }
    if (rc)
        moe_placement_free(p);
out:
    cJSON_Delete(root);
    return rc;
}

int moe_placement_pick(const struct moe_placement *p, int layer, int expert, int token, int my_rank)
{
    (void)my_rank;
    int n = moe_placement_n_replicas(p, layer, expert);
    return moe_placement_rank(p, layer, expert, token % n);
}

static cJSON *layer_to_json(const struct moe_placement *m, int l)
{
    cJSON *arr = cJSON_CreateArray();
    for (int e = 0; arr && e < m->n_expert; e++) {
        cJSON *ranks = cJSON_CreateArray();
        if (!ranks) {
            cJSON_Delete(arr);
            return NULL;
        }
        for (int i = 0; i < moe_placement_n_replicas(m, l, e); i++)
            cJSON_AddItemToArray(ranks, cJSON_CreateNumber(moe_placement_rank(m, l, e, i)));
        cJSON_AddItemToArray(arr, ranks);
    }
    return arr;
}

cJSON *moe_placement_to_json(const struct moe_placement *m)
{
    cJSON *o = cJSON_CreateObject();
    cJSON *layers = cJSON_CreateObject();
    if (!o || !layers)
        goto fail;
    cJSON_AddNumberToObject(o, "n_rank", m->n_rank);
    cJSON *l0 = layer_to_json(m, 0);
    if (!l0)
        goto fail;
    cJSON_AddItemToObject(o, "experts", l0);
    for (int l = 0; l < m->n_layer; l++) {
        char k[16];
        snprintf(k, sizeof k, "%d", l);
        cJSON *a = layer_to_json(m, l);
        if (!a)
            goto fail;
        cJSON_AddItemToObject(layers, k, a);
    }
    cJSON_AddItemToObject(o, "layers", layers);
    return o;
fail:
    cJSON_Delete(o);
    cJSON_Delete(layers);
    return NULL;
}

char *moe_placement_to_string(const struct moe_placement *m)
{
    cJSON *o = moe_placement_to_json(m);
    char *s = o ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    return s;
}
