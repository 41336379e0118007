/* Perplexity and KL divergence against a base run (see perplexity.h). */
#include "engine/perplexity.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "clock.h"
#include "engine/generate.h"
#include "read_file.h"

#define BASE_MAGIC "MOEKLB1" /* 8 bytes with its NUL */

/* The base file's header, little-endian on disk as in memory (x86, arm64). */
struct base_header {
    char magic[8];
    uint32_t vocab;
    uint32_t ctx;
    uint64_t n_tokens;
    uint64_t ids_hash;
    uint64_t n_rows;
};

/* FNV-1a over the ids: a base from another text is refused. */
static uint64_t ids_hash(const int32_t *ids, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)ids[i];
        for (int b = 0; b < 4; b++) {
            h ^= (v >> (8 * b)) & 0xffu;
            h *= 1099511628211ull;
        }
    }
    return h;
}

/* row[v] = ln softmax(logits)[v] in place (f32 out, double sums); returns
 * the argmax (ties to the lower id). */
static int32_t log_softmax(const float *logits, int vocab, float *row)
{
    int32_t best = 0;
    for (int v = 1; v < vocab; v++)
        if (logits[v] > logits[best])
            best = v;
    double mx = logits[best], sum = 0;
    for (int v = 0; v < vocab; v++)
        sum += exp((double)logits[v] - mx);
    double lse = mx + log(sum);
    for (int v = 0; v < vocab; v++)
        row[v] = (float)((double)logits[v] - lse);
    return best;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

struct ppl_run {
    const struct moe_ppl_opts *o;
    int vocab, ctx, first, per_window;
    FILE *save, *base;
    float *logits; /* (ctx, vocab) */
    float *row;    /* (vocab) this run's log-softmax */
    float *brow;   /* (vocab) the base's */
    double *kl;    /* (n_scored) */
    double nll, base_nll;
    int64_t n_scored, top1;
};

static enum moe_status open_base(struct ppl_run *p, const int32_t *ids, size_t n, int64_t n_rows,
                                 struct moe_error *err)
{
    const char *path = p->o->kl_base;
    if (!(p->base = fopen(path, "rb")))
        return moe_error_set(err, MOE_ERR_IO, "--kl-base %s: %s", path, strerror(errno));
    struct base_header h;
    if (fread(&h, sizeof h, 1, p->base) != 1 || memcmp(h.magic, BASE_MAGIC, sizeof h.magic))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "--kl-base %s: not a file written by --kl-save (magic)", path);
    if (h.vocab != (uint32_t)p->vocab)
        return moe_error_set(err, MOE_ERR_INVALID, "--kl-base %s: vocab %u, this model has %d",
                             path, h.vocab, p->vocab);
    if (h.ctx != (uint32_t)p->ctx)
        return moe_error_set(err, MOE_ERR_INVALID, "--kl-base %s: ctx %u, this run uses %d", path,
                             h.ctx, p->ctx);
    if (h.n_tokens != n || h.ids_hash != ids_hash(ids, n))
        return moe_error_set(err, MOE_ERR_INVALID,
                             "--kl-base %s: tokens: %llu tokens of another text (this run has %zu; "
                             "same file and tokenizer?)",
                             path, (unsigned long long)h.n_tokens, n);
    if (h.n_rows != (uint64_t)n_rows)
        return moe_error_set(err, MOE_ERR_INVALID, "--kl-base %s: n_rows %llu, expected %lld", path,
                             (unsigned long long)h.n_rows, (long long)n_rows);
    return MOE_OK;
}

static enum moe_status open_save(struct ppl_run *p, const int32_t *ids, size_t n, int64_t n_rows,
                                 struct moe_error *err)
{
    const char *path = p->o->kl_save;
    if (!(p->save = fopen(path, "wb")))
        return moe_error_set(err, MOE_ERR_IO, "--kl-save %s: %s", path, strerror(errno));
    struct base_header h = {.vocab = (uint32_t)p->vocab,
                            .ctx = (uint32_t)p->ctx,
                            .n_tokens = n,
                            .ids_hash = ids_hash(ids, n),
                            .n_rows = (uint64_t)n_rows};
    memcpy(h.magic, BASE_MAGIC, sizeof h.magic);
    if (fwrite(&h, sizeof h, 1, p->save) != 1)
        return moe_error_set(err, MOE_ERR_IO, "--kl-save %s: write failed: %s", path,
                             strerror(errno));
    return MOE_OK;
}

/* Scores the positions of one window whose logits are in p->logits. */
static enum moe_status score_window(struct ppl_run *p, const int32_t *win, struct moe_error *err)
{
    for (int j = p->first; j < p->ctx - 1; j++) {
        const float *lg = p->logits + (size_t)j * p->vocab;
        int32_t best = log_softmax(lg, p->vocab, p->row);
        p->nll -= p->row[win[j + 1]];
        if (p->save &&
            fwrite(p->row, sizeof *p->row, (size_t)p->vocab, p->save) != (size_t)p->vocab)
            return moe_error_set(err, MOE_ERR_IO, "--kl-save %s: write failed: %s", p->o->kl_save,
                                 strerror(errno));
        if (p->base) {
            if (fread(p->brow, sizeof *p->brow, (size_t)p->vocab, p->base) != (size_t)p->vocab)
                return moe_error_set(err, MOE_ERR_INVALID,
                                     "--kl-base %s: rows: the file ends at row %lld", p->o->kl_base,
                                     (long long)p->n_scored);
            double kl = 0;
            for (int v = 0; v < p->vocab; v++) {
                double lb = p->brow[v];
                kl += exp(lb) * (lb - (double)p->row[v]);
            }
            p->kl[p->n_scored] = kl;
            p->top1 += moe_host_argmax(p->brow, p->vocab) == best;
            p->base_nll -= p->brow[win[j + 1]];
        }
        p->n_scored++;
    }
    return MOE_OK;
}

static void summarise(const struct ppl_run *p, struct moe_ppl_result *r)
{
    r->n_scored = p->n_scored;
    r->nll_mean = p->n_scored ? p->nll / (double)p->n_scored : 0;
    r->ppl = exp(r->nll_mean);
    if (!p->base || !p->n_scored)
        return;
    r->has_base = true;
    double sum = 0;
    for (int64_t i = 0; i < p->n_scored; i++)
        sum += p->kl[i];
    qsort(p->kl, (size_t)p->n_scored, sizeof *p->kl, cmp_double);
    int64_t k99 = (int64_t)ceil(0.99 * (double)p->n_scored) - 1;
    r->kl_mean = sum / (double)p->n_scored;
    r->kl_median = p->kl[p->n_scored / 2];
    r->kl_p99 = p->kl[k99 < 0 ? 0 : k99];
    r->kl_max = p->kl[p->n_scored - 1];
    r->top1 = (double)p->top1 / (double)p->n_scored;
    r->base_ppl = exp(p->base_nll / (double)p->n_scored);
}

enum moe_status moe_perplexity(struct moe_model *m, const int32_t *ids, size_t n,
                               const struct moe_ppl_opts *o, struct moe_ppl_result *r,
                               struct moe_error *err)
{
    memset(r, 0, sizeof *r);
    const struct moe_config *c = moe_model_config(m);
    if (o->ctx < 4 || o->ctx > c->max_pos)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "--ctx %d: a window must hold 4 .. max_position_embeddings (%d) "
                             "tokens",
                             o->ctx, c->max_pos);
    size_t n_window = n / (size_t)o->ctx;
    if (n_window < 1)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "the text is %zu tokens: not one window of --ctx %d", n, o->ctx);
    struct ppl_run p = {.o = o, .vocab = c->vocab_size, .ctx = o->ctx, .first = o->ctx / 2};
    p.per_window = p.ctx - 1 - p.first;
    int64_t n_rows = (int64_t)n_window * p.per_window;
    enum moe_status rc = MOE_OK;
    p.logits = malloc((size_t)p.ctx * p.vocab * sizeof *p.logits);
    p.row = malloc((size_t)p.vocab * sizeof *p.row);
    p.brow = malloc((size_t)p.vocab * sizeof *p.brow);
    p.kl = o->kl_base ? malloc((size_t)n_rows * sizeof *p.kl) : NULL;
    if (!p.logits || !p.row || !p.brow || (o->kl_base && !p.kl)) {
        rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory for %d x %d logits", p.ctx, p.vocab);
        goto done;
    }
    if (o->kl_base && (rc = open_base(&p, ids, n, n_rows, err)))
        goto done;
    if (o->kl_save && (rc = open_save(&p, ids, n, n_rows, err)))
        goto done;
    struct moe_gen_opts go = {.n_predict = 0,
                              .prefill_chunk = p.ctx,
                              .forward = o->forward,
                              .forward_ctx = o->forward_ctx};
    double t0 = moe_now();
    for (size_t w = 0; w < n_window; w++) {
        const int32_t *win = ids + w * (size_t)p.ctx;
        struct moe_gen_result res = {0};
        rc = moe_generate(m, win, p.ctx, &go, p.logits, &res, err);
        moe_gen_result_free(&res);
        if (rc || (rc = score_window(&p, win, err)))
            goto done;
        r->n_window = (int)w + 1;
        if (o->progress)
            o->progress(o->progress_ctx, (int)w + 1, (int)n_window,
                        exp(p.nll / (double)p.n_scored));
    }
    r->seconds = moe_now() - t0;
    summarise(&p, r);
done:
    if (p.save && fclose(p.save) && !rc)
        rc = moe_error_set(err, MOE_ERR_IO, "--kl-save %s: %s", o->kl_save, strerror(errno));
    if (p.base)
        fclose(p.base);
    free(p.logits);
    free(p.row);
    free(p.brow);
    free(p.kl);
    return rc;
}

enum moe_status moe_perplexity_tokenize_file(const struct moe_tokenizer *tok, const char *path,
                                             int32_t **ids, size_t *n, struct moe_error *err)
{
    *ids = NULL;
    *n = 0;
    char *text;
    size_t len;
    enum moe_status rc = moe_read_file(path, (size_t)4 << 30, &text, &len, err);
    if (rc)
        return moe_error_prefix(err, "--perplexity");
    if (len == 0)
        rc = moe_error_set(err, MOE_ERR_INVALID, "--perplexity %s: the file is empty", path);
    if (!rc && (rc = moe_tokenizer_encode(tok, text, len, false, ids, n, err)))
        moe_error_prefix(err, "--perplexity %s", path);
    free(text);
    return rc;
}
