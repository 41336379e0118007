#include "model/placement.h"

#include "model_config.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static enum moe_status alloc_map(int n_layer, int n_expert, int n_rank, struct moe_placement *p,
                                 struct moe_error *err)
{
    memset(p, 0, sizeof *p);
    if (n_layer < 1 || n_expert < 1 || n_rank < 1 || n_rank > 32767)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "placement of %d experts x %d layers over %d ranks is invalid",
                             n_expert, n_layer, n_rank);
    p->n_layer = n_layer;
    p->n_expert = n_expert;
    p->n_rank = n_rank;
    size_t n = (size_t)n_layer * n_expert;
    p->n_replicas = calloc(n, 1);
    p->ranks = calloc(n * MOE_PLACEMENT_MAX_REPLICAS, sizeof *p->ranks);
    if (!p->n_replicas || !p->ranks) {
        moe_placement_free(p);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    return MOE_OK;
}

enum moe_status moe_placement_default(int n_layer, int n_expert, int n_rank,
                                      struct moe_placement *p, struct moe_error *err)
{
    enum moe_status rc = alloc_map(n_layer, n_expert, n_rank, p, err);
    if (rc)
        return rc;
    for (int l = 0; l < n_layer; l++)
        for (int e = 0; e < n_expert; e++) {
            /* contiguous: ranks get n_expert / n_rank experts each (+1 for the first ones) */
            int r = (int)((int64_t)e * n_rank / n_expert);
            p->n_replicas[l * n_expert + e] = 1;
            p->ranks[((size_t)l * n_expert + e) * MOE_PLACEMENT_MAX_REPLICAS] = (int16_t)r;
        }
    return MOE_OK;
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

void moe_placement_free(struct moe_placement *p)
{
    if (!p)
        return;
    free(p->n_replicas);
    free(p->ranks);
    memset(p, 0, sizeof *p);
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
    FILE *f = fopen(path, "rb");
    if (!f)
        return moe_error_set(err, MOE_ERR_IO, "%s: %s", path, strerror(errno));
    char *text = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 8192;
            char *grown = realloc(text, cap);
            if (!grown) {
                free(text);
                fclose(f);
                return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
            }
            text = grown;
        }
        size_t n = fread(text + len, 1, 4096, f);
        len += n;
        if (n < 4096)
            break;
    }
    fclose(f);
    text[len] = 0;
    enum moe_status rc = moe_placement_parse(text, path, n_layer, n_expert, n_rank, p, err);
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
    if ((rc = alloc_map(n_layer, n_expert, n_rank, p, err)))
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

bool moe_placement_holds(const struct moe_placement *p, int layer, int expert, int rank)
{
    int n = moe_placement_n_replicas(p, layer, expert);
    for (int i = 0; i < n; i++)
        if (moe_placement_rank(p, layer, expert, i) == rank)
            return true;
    return false;
}

int moe_placement_pick(const struct moe_placement *p, int layer, int expert, int token, int my_rank)
{
    (void)my_rank;
    int n = moe_placement_n_replicas(p, layer, expert);
    return moe_placement_rank(p, layer, expert, token % n);
}
