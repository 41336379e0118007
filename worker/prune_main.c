/* moe-prune: structured expert pruning. Keeps the N most used experts of
 * every MoE layer and writes a smaller checkpoint in the Hugging Face layout.
 *
 *   moe-prune --model DIR --stats STATS.json --keep N --out DIR
 *
 * STATS.json is what `moectl --json experts stats` prints from a live
 * cluster, or what `moe-generate --expert-stats F` writes after a
 * calibration run: {"stats_layers": L, "stats_experts": E, "expert_tokens":
 * [L x E token counts, layer-major]}. In each MoE layer the N experts with
 * the most tokens are kept (ties to the lower id) and renumbered in id
 * order; their gate (router) rows are kept with them, so the router scores
 * only kept experts (the softmax, and with it every top-k weight, is over
 * the kept ones). Everything else is copied byte for byte; config.json gets
 * num_local_experts / num_experts = N; the tokenizer and generation files
 * are copied. A layer whose dropped experts were never routed to gives the
 * same top-k choices as before on that traffic (Mixtral, which renormalises
 * over the top k, gives the same outputs). */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "model_config.h"
#include "safetensors.h"
#include "read_file.h"

struct prune {
    const char *model, *stats, *out;
    int keep;
    int n_layer, n_expert;
    uint64_t *tokens; /* (n_layer, n_expert) */
    int *new_id;      /* (n_layer, n_expert): the kept expert's new id, or -1 */
    int *old_id;      /* (n_layer, keep): kept experts in id order */
};

static void usage(FILE *f)
{
    fprintf(f, "usage: moe-prune --model DIR --stats STATS.json --keep N --out DIR\n"
               "  --stats F   per-expert token counts: `moectl --json experts stats` or\n"
               "              `moe-generate --expert-stats F` (a calibration run)\n"
               "  --keep N    experts kept in every MoE layer (>= experts per token)\n"
               "  --out DIR   the pruned checkpoint (created; must not be --model)\n");
}

#define PRUNE_MAX_FILE ((size_t)1 << 30) /* config.json, tokenizer files, the stats */

static int read_stats(struct prune *p)
{
    char *text;
    struct moe_error err = {0};
    if (moe_read_text(p->stats, PRUNE_MAX_FILE, &text, &err))
        return cli_fail("--stats: %s", err.msg);
    cJSON *o = cJSON_Parse(text);
    free(text);
    if (!o)
        return cli_fail("--stats %s: not JSON", p->stats);
    const cJSON *jl = cJSON_GetObjectItemCaseSensitive(o, "stats_layers");
    const cJSON *je = cJSON_GetObjectItemCaseSensitive(o, "stats_experts");
    const cJSON *jt = cJSON_GetObjectItemCaseSensitive(o, "expert_tokens");
    int rc = 0;
    if (!cJSON_IsNumber(jl) || !cJSON_IsNumber(je) || !cJSON_IsArray(jt)) {
        rc = cli_fail("--stats %s: needs stats_layers, stats_experts and expert_tokens (the "
                      "format of moectl --json experts stats)",
                      p->stats);
    } else if (jl->valueint != p->n_layer || je->valueint != p->n_expert) {
        rc = cli_fail("--stats %s: %d layers x %d experts, the model has %d x %d", p->stats,
                      jl->valueint, je->valueint, p->n_layer, p->n_expert);
    } else if (cJSON_GetArraySize(jt) != p->n_layer * p->n_expert) {
        rc = cli_fail("--stats %s: expert_tokens has %d counts, expected %d (all layers: not "
                      "--layer)",
                      p->stats, cJSON_GetArraySize(jt), p->n_layer * p->n_expert);
    } else {
        int i = 0;
        const cJSON *v;
        cJSON_ArrayForEach(v, jt)
        {
            if (!cJSON_IsNumber(v) || v->valuedouble < 0) {
                rc = cli_fail("--stats %s: expert_tokens[%d] is not a count", p->stats, i);
                break;
            }
            p->tokens[i++] = (uint64_t)v->valuedouble;
        }
    }
    cJSON_Delete(o);
    return rc;
}

/* The kept experts of every layer (dense layers keep nothing: they have no
 * expert tensors to rename). */
static void choose(struct prune *p)
{
    for (int l = 0; l < p->n_layer; l++) {
        const uint64_t *t = p->tokens + (size_t)l * p->n_expert;
        int *nid = p->new_id + (size_t)l * p->n_expert;
        for (int e = 0; e < p->n_expert; e++)
            nid[e] = -1;
        for (int k = 0; k < p->keep; k++) { /* selection: most tokens, ties to the lower id */
            int best = -1;
            for (int e = 0; e < p->n_expert; e++)
                if (nid[e] < 0 && (best < 0 || t[e] > t[best]))
                    best = e;
            nid[best] = 0;
        }
        int next = 0;
        for (int e = 0; e < p->n_expert; e++)
            if (nid[e] >= 0) {
                nid[e] = next;
                p->old_id[(size_t)l * p->keep + next++] = e;
            }
    }
}

/* What tensor `name` becomes: 0 copy as is (*new_name = name), 1 renamed
 * expert tensor, 2 dropped, 3 a router to cut to its kept rows (layer *l). */
static int classify(const struct prune *p, const char *name, char *new_name, size_t cap, int *l)
{
    int layer, e, n = 0;
    char block[32];
    snprintf(new_name, cap, "%s", name);
    if (sscanf(name, "model.layers.%d.%31[a-z_].experts.%d.%n", &layer, block, &e, &n) == 3 &&
        n > 0 && layer >= 0 && layer < p->n_layer && e >= 0 && e < p->n_expert) {
        int ne = p->new_id[(size_t)layer * p->n_expert + e];
        if (ne < 0)
            return 2;
        snprintf(new_name, cap, "model.layers.%d.%s.experts.%d.%s", layer, block, ne, name + n);
        return 1;
    }
    n = 0;
    if (sscanf(name, "model.layers.%d.%31[a-z_].gate.weight%n", &layer, block, &n) == 2 && n > 0 &&
        name[n] == '\0' && layer >= 0 && layer < p->n_layer &&
        (!strcmp(block, "block_sparse_moe") || !strcmp(block, "mlp"))) {
        *l = layer;
        return 3;
    }
    return 0;
}

struct out_tensor {
    char name[256];
    const struct st_tensor *src;
    int router_layer; /* >= 0: keep only the kept experts' rows */
    size_t nbytes;
};

static int write_checkpoint(const struct prune *p, struct st_model *st, const char *path)
{
    size_t n = st_count(st), n_out = 0;
    struct out_tensor *ts = calloc(n, sizeof *ts);
    cJSON *h = cJSON_CreateObject();
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const struct st_tensor *t = st_get(st, i);
        struct out_tensor *o = &ts[n_out];
        int layer = -1, kind = classify(p, t->name, o->name, sizeof o->name, &layer);
        if (kind == 2)
            continue;
        o->src = t;
        o->router_layer = kind == 3 ? layer : -1;
        o->nbytes = t->nbytes;
        cJSON *d = cJSON_CreateObject();
        cJSON_AddStringToObject(d, "dtype", moe_dtype_name(t->dtype));
        cJSON *shape = cJSON_AddArrayToObject(d, "shape");
        for (int k = 0; k < t->n_dim; k++) {
            int64_t dim = t->shape[k];
            if (kind == 3 && k == 0) {
                if (t->n_dim != 2 || dim != p->n_expert) {
                    free(ts);
                    cJSON_Delete(h);
                    cJSON_Delete(d);
                    return cli_fail("%s: router '%s' is not (%d, hidden)", p->model, t->name,
                                    p->n_expert);
                }
                o->nbytes = t->nbytes / (size_t)p->n_expert * (size_t)p->keep;
                dim = p->keep;
            }
            cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)dim));
        }
        cJSON *offs = cJSON_AddArrayToObject(d, "data_offsets");
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)off));
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)(off + o->nbytes)));
        off += o->nbytes;
        cJSON_AddItemToObject(h, o->name, d);
        n_out++;
    }
    cJSON *meta = cJSON_AddObjectToObject(h, "__metadata__");
    cJSON_AddStringToObject(meta, "format", "pt");
    char note[64];
    snprintf(note, sizeof note, "%d of %d experts per layer kept", p->keep, p->n_expert);
    cJSON_AddStringToObject(meta, "moe_prune", note);
    char *json = cJSON_PrintUnformatted(h);
    cJSON_Delete(h);
    size_t hl = strlen(json), padded = (hl + 7) / 8 * 8;
    FILE *f = fopen(path, "wb");
    int rc = f ? 0 : cli_fail("%s: %s", path, strerror(errno));
    uint8_t len8[8];
    for (int i = 0; i < 8 && !rc; i++)
        len8[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    bool ok = !rc && fwrite(len8, 1, 8, f) == 8 && fwrite(json, 1, hl, f) == hl;
    for (size_t i = hl; ok && i < padded; i++)
        ok = fputc(' ', f) != EOF;
    for (size_t i = 0; ok && i < n_out; i++) {
        const struct out_tensor *o = &ts[i];
        if (o->router_layer < 0) {
            ok = fwrite(o->src->data, 1, o->nbytes, f) == o->nbytes;
            continue;
        }
        size_t row = o->src->nbytes / (size_t)p->n_expert;
        for (int k = 0; ok && k < p->keep; k++) {
            int e = p->old_id[(size_t)o->router_layer * p->keep + k];
            ok = fwrite((const char *)o->src->data + (size_t)e * row, 1, row, f) == row;
        }
    }
    if (f && (fclose(f) || !ok) && !rc)
        rc = cli_fail("%s: write failed: %s", path, strerror(errno));
    free(json);
    free(ts);
    return rc;
}

/* config.json with num_local_experts / num_experts set to N. Edited as text,
 * not re-printed from a parse: 0.0 must stay 0.0 (transformers' config
 * classes refuse an int where a float belongs) and the rest byte for byte. */
static int write_config(const struct prune *p, const char *src, const char *dst)
{
    char *text;
    struct moe_error err = {0};
    if (moe_read_text(src, PRUNE_MAX_FILE, &text, &err))
        return cli_fail("%s", err.msg);
    cJSON *c = cJSON_Parse(text);
    if (!c) {
        free(text);
        return cli_fail("%s: cannot read it as JSON", src);
    }
    cJSON_Delete(c);
    size_t cap = strlen(text) + 64;
    char *out = malloc(cap);
    if (!out) {
        free(text);
        return cli_fail("out of memory");
    }
    out[0] = '\0';
    const char *keys[] = {"\"num_local_experts\"", "\"num_experts\""};
    const char *rest = text;
    size_t used = 0;
    for (;;) { /* the earliest remaining key, its number replaced */
        const char *hit = NULL;
        size_t klen = 0;
        for (int i = 0; i < 2; i++) {
            const char *h = strstr(rest, keys[i]);
            if (h && (!hit || h < hit)) {
                hit = h;
                klen = strlen(keys[i]);
            }
        }
        const char *v = hit ? hit + klen : NULL;
        while (v && (*v == ' ' || *v == ':' || *v == '\t' || *v == '\n' || *v == '\r'))
            v++;
        if (!v || *v < '0' || *v > '9') {
            used += (size_t)snprintf(out + used, cap - used, "%s", rest);
            break;
        }
        const char *e = v;
        while (*e >= '0' && *e <= '9')
            e++;
        used += (size_t)snprintf(out + used, cap - used, "%.*s%d", (int)(v - rest), rest, p->keep);
        rest = e;
    }
    free(text);
    FILE *f = fopen(dst, "wb");
    bool ok = f && fputs(out, f) >= 0;
    if (f && fclose(f))
        ok = false;
    free(out);
    return ok ? 0 : cli_fail("%s: write failed: %s", dst, strerror(errno));
}

/* Copies dir/name to out/name when it exists. */
static int copy_file(const char *dir, const char *out, const char *name)
{
    char src[4096], dst[4096];
    snprintf(src, sizeof src, "%s/%s", dir, name);
    snprintf(dst, sizeof dst, "%s/%s", out, name);
    size_t len;
    char *data;
    struct moe_error err = {0};
    enum moe_status rc = moe_read_file(src, PRUNE_MAX_FILE, &data, &len, &err);
    if (rc)
        return rc == MOE_ERR_NOT_FOUND ? 0 : cli_fail("%s", err.msg);
    FILE *f = fopen(dst, "wb");
    bool ok = f && fwrite(data, 1, len, f) == len;
    if (f && fclose(f))
        ok = false;
    free(data);
    return ok ? 0 : cli_fail("%s: write failed: %s", dst, strerror(errno));
}

static int parse_args(int argc, char **argv, struct prune *p)
{
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        if (!strcmp(k, "-h") || !strcmp(k, "--help")) {
            usage(stdout);
            exit(0);
        }
        if (i + 1 >= argc)
            return cli_fail("option '%s' needs a value", k);
        const char *v = argv[++i];
        long n;
        if (!strcmp(k, "--model")) {
            p->model = v;
        } else if (!strcmp(k, "--stats")) {
            p->stats = v;
        } else if (!strcmp(k, "--out")) {
            p->out = v;
        } else if (!strcmp(k, "--keep")) {
            if (!cli_parse_long(v, 1, 1 << 16, &n))
                return cli_fail("--keep: '%s' is not a whole number >= 1", v);
            p->keep = (int)n;
        } else {
            usage(stderr);
            return cli_fail("unknown option '%s'", k);
        }
    }
    if (!p->model || !p->stats || !p->out || !p->keep) {
        usage(stderr);
        return cli_fail("--model, --stats, --keep and --out are required");
    }
    return 0;
}

int main(int argc, char **argv)
{
    cli_init("moe-prune");
    struct prune p = {0};
    int rc = parse_args(argc, argv, &p);
    if (rc)
        return rc;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", p.model);
    struct moe_config cfg;
    struct moe_error err = {0};
    if (moe_config_load(path, &cfg, &err))
        return cli_fail("%s", err.msg);
    p.n_layer = cfg.n_layer;
    p.n_expert = cfg.n_expert;
    if (p.n_expert < 2)
        return cli_fail("%s: a model with %d experts has none to prune", p.model, p.n_expert);
    if (p.keep < cfg.top_k || p.keep > p.n_expert)
        return cli_fail("--keep %d: must be in [%d (experts per token), %d (experts)]", p.keep,
                        cfg.top_k, p.n_expert);
    struct stat sb;
    if (stat(p.out, &sb) == 0) {
        char a[4096], b[4096];
        if (realpath(p.out, a) && realpath(p.model, b) && !strcmp(a, b))
            return cli_fail("--out %s is the model directory itself", p.out);
    } else if (mkdir(p.out, 0755)) {
        return cli_fail("--out %s: %s", p.out, strerror(errno));
    }
    size_t cells = (size_t)p.n_layer * p.n_expert;
    p.tokens = calloc(cells, sizeof *p.tokens);
    p.new_id = calloc(cells, sizeof *p.new_id);
    p.old_id = calloc((size_t)p.n_layer * p.keep, sizeof *p.old_id);
    struct st_model *st = NULL;
    if (!p.tokens || !p.new_id || !p.old_id)
        rc = cli_fail("out of memory");
    if (!rc)
        rc = read_stats(&p);
    if (!rc && st_open(p.model, &st, &err))
        rc = cli_fail("%s", err.msg);
    uint64_t kept_tok = 0, all_tok = 0;
    if (!rc) {
        choose(&p);
        for (size_t i = 0; i < cells; i++) {
            all_tok += p.tokens[i];
            kept_tok += p.new_id[i] >= 0 ? p.tokens[i] : 0;
        }
        snprintf(path, sizeof path, "%s/model.safetensors", p.out);
        rc = write_checkpoint(&p, st, path);
    }
    char src[4096], dst[4096];
    snprintf(src, sizeof src, "%s/config.json", p.model);
    snprintf(dst, sizeof dst, "%s/config.json", p.out);
    if (!rc)
        rc = write_config(&p, src, dst);
    const char *extra[] = {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                           "chat_template.jinja", "special_tokens_map.json"};
    for (size_t i = 0; i < sizeof extra / sizeof extra[0] && !rc; i++)
        rc = copy_file(p.model, p.out, extra[i]);
    if (!rc) {
        printf("moe-prune: %s -> %s: %d of %d experts kept per MoE layer; the kept experts had "
               "%.2f%% of the %llu routed tokens in %s\n",
               p.model, p.out, p.keep, p.n_expert,
               all_tok ? 100.0 * (double)kept_tok / (double)all_tok : 0.0,
               (unsigned long long)all_tok, p.stats);
        for (int l = 0; l < p.n_layer; l++) {
            if (!cfg.layer_is_moe[l])
                continue;
            printf("  layer %d keeps:", l);
            for (int k = 0; k < p.keep; k++)
                printf(" %d", p.old_id[(size_t)l * p.keep + k]);
            printf("\n");
        }
    }
    st_close(st);
    free(p.tokens);
    free(p.new_id);
    free(p.old_id);
    return rc;
}
