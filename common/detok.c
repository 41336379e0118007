#include "detok.h"

#include <stdlib.h>
#include <string.h>

/* Ids kept before the emitted point so decoders that look back (leading-space
 * stripping, byte fusing) see the same context in both decodes. */
#define DETOK_CONTEXT 6

void moe_detok_init(struct moe_detok *d, const struct moe_tokenizer *tok, bool skip_special)
{
    memset(d, 0, sizeof *d);
    d->tok = tok;
    d->skip_special = skip_special;
}

void moe_detok_free(struct moe_detok *d)
{
    free(d->ids);
    memset(d, 0, sizeof *d);
}

static bool ends_incomplete(const char *s, size_t n)
{
    /* U+FFFD at the end means a byte sequence still waiting for its tail. */
    return n >= 3 && (unsigned char)s[n - 3] == 0xef && (unsigned char)s[n - 2] == 0xbf &&
           (unsigned char)s[n - 1] == 0xbd;
}

static enum moe_status emit(struct moe_detok *d, bool final, char **delta, size_t *len,
                            struct moe_error *err)
{
    *delta = NULL;
    *len = 0;
    if (!d->n_ids) { /* nothing pushed: d->ids is NULL */
        *delta = calloc(1, 1);
        return *delta ? MOE_OK : moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    char *before = NULL, *after = NULL;
    size_t n_before = 0, n_after = 0;
    enum moe_status rc;
    /* The window must decode to some text before the new ids: a decoder that
     * strips the leading space of its output would otherwise strip the new
     * text's instead (e.g. a window of only skipped special tokens). */
    for (;;) {
        rc = moe_tokenizer_decode(d->tok, d->ids + d->prefix, d->read - d->prefix, d->skip_special,
                                  &before, &n_before, err);
        if (rc || n_before > 0 || d->prefix == 0)
            break;
        free(before);
        before = NULL;
        d->prefix--;
    }
    if (!rc)
        rc = moe_tokenizer_decode(d->tok, d->ids + d->prefix, d->n_ids - d->prefix, d->skip_special,
                                  &after, &n_after, err);
    if (rc)
        goto out;
    if ((final || !ends_incomplete(after, n_after)) && n_after > n_before) {
        /* Normally `before` is a prefix of `after`. Byte-fallback decoders can
         * rewrite text already sent (a byte that is valid alone turns into
         * U+FFFD once an invalid byte follows it); what was sent cannot be
         * taken back, so continue from the first character boundary at or
         * after the length already sent, as vLLM does. */
        size_t start = n_before;
        if (memcmp(after, before, n_before))
            while (start < n_after && ((unsigned char)after[start] & 0xc0) == 0x80)
                start++;
        size_t n = n_after - start;
        *delta = malloc(n + 1);
        if (!*delta) {
            rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
            goto out;
        }
        memcpy(*delta, after + start, n);
        (*delta)[n] = 0;
        *len = n;
        d->read = d->n_ids;
        if (d->read > DETOK_CONTEXT)
            d->prefix = d->read - DETOK_CONTEXT;
    } else if (!(*delta = calloc(1, 1))) {
        rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
out:
    free(before);
    free(after);
    return rc;
}

enum moe_status moe_detok_push(struct moe_detok *d, int32_t id, char **delta, size_t *len,
                               struct moe_error *err)
{
    if (d->n_ids == d->cap_ids) {
        size_t cap = d->cap_ids ? d->cap_ids * 2 : 64;
        int32_t *ids = realloc(d->ids, cap * sizeof *ids);
        if (!ids)
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        d->ids = ids;
        d->cap_ids = cap;
    }
    d->ids[d->n_ids++] = id;
    enum moe_status rc = emit(d, false, delta, len, err);
    if (rc)
        d->n_ids--; /* a bad id is not kept */
    return rc;
}

enum moe_status moe_detok_flush(struct moe_detok *d, char **delta, size_t *len,
                                struct moe_error *err)
{
    return emit(d, true, delta, len, err);
}
