/* Checks shared by the tokenizer fuzz targets: what holds for any loaded
 * tokenizer and any input. */
#ifndef MOE_FUZZ_TOK_CHECK_H
#define MOE_FUZZ_TOK_CHECK_H

#include <unistr.h>

#include "detok.h"
#include "fuzz.h"
#include "tokenizer.h"

/* Whether ids[0..n) holds a byte-fallback token ("<0x41>"). */
static inline bool fuzz_has_byte_token(const struct moe_tokenizer *tok, const int32_t *ids,
                                       size_t n)
{
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        int32_t id = moe_tokenizer_token_to_id(tok, name);
        for (size_t i = 0; id >= 0 && i < n; i++)
            if (ids[i] == id)
                return true;
    }
    return false;
}

/* Decodes ids[0..n) in one call and through the streaming detokenizer; both
 * must succeed (every id is in the vocabulary) and give valid UTF-8. The
 * deltas concatenated must equal the decode (detok.h), except where a
 * byte-fallback token makes the decode rewrite text already streamed (a
 * valid byte turns into U+FFFD once an invalid one joins its run: the
 * limitation detok.c documents, as vLLM has it). */
static inline void fuzz_check_decode(const struct moe_tokenizer *tok, const int32_t *ids, size_t n,
                                     bool skip_special)
{
    bool exact = !fuzz_has_byte_token(tok, ids, n);
    struct moe_error err = {0};
    char *text = NULL;
    size_t len = 0;
    FUZZ_CHECK(moe_tokenizer_decode(tok, ids, n, skip_special, &text, &len, &err) == MOE_OK, "%s",
               err.msg);
    FUZZ_CHECK(strlen(text) <= len && !u8_check((const uint8_t *)text, len),
               "decode is not valid UTF-8");
    struct moe_detok d;
    moe_detok_init(&d, tok, skip_special);
    size_t at = 0;
    for (size_t i = 0; i <= n; i++) {
        char *delta = NULL;
        size_t dn = 0;
        enum moe_status st = i < n ? moe_detok_push(&d, ids[i], &delta, &dn, &err)
                                   : moe_detok_flush(&d, &delta, &dn, &err);
        FUZZ_CHECK(st == MOE_OK, "detok at id %zu: %s", i, err.msg);
        FUZZ_CHECK(!u8_check((const uint8_t *)delta, dn), "delta %zu is not valid UTF-8", i);
        FUZZ_CHECK(!exact || (at + dn <= len && !memcmp(text + at, delta, dn)),
                   "detok deltas differ from the decode at byte %zu (id %zu of %zu)", at, i, n);
        at += dn;
        free(delta);
    }
    FUZZ_CHECK(!exact || at == len, "detok gave %zu bytes, decode %zu", at, len);
    moe_detok_free(&d);
    free(text);
}

/* Whether `id` decodes alone: in [0, n_vocab) and not a hole of a sparse
 * vocabulary (either is refused with MOE_ERR_INVALID naming the id). */
static inline bool fuzz_id_ok(const struct moe_tokenizer *tok, int32_t id)
{
    struct moe_error err = {0};
    char *text = (char *)1;
    size_t len = 0;
    enum moe_status st = moe_tokenizer_decode(tok, &id, 1, false, &text, &len, &err);
    if (st != MOE_OK) {
        FUZZ_CHECK(st == MOE_ERR_INVALID && !text && fuzz_msg_ok(err.msg), "id %d: status %d '%s'",
                   (int)id, st, err.msg);
        return false;
    }
    free(text);
    return true;
}

/* Encodes `len` bytes: valid UTF-8 must encode, to ids inside the
 * vocabulary that decode again; anything else is refused with a message. */
static inline void fuzz_check_encode(const struct moe_tokenizer *tok, const char *s, size_t len,
                                     bool add_special, bool skip_special)
{
    int32_t *ids = NULL;
    size_t n = 0;
    struct moe_error err = {0};
    enum moe_status st = moe_tokenizer_encode(tok, s, len, add_special, &ids, &n, &err);
    if (u8_check((const uint8_t *)s, len)) {
        FUZZ_CHECK(st == MOE_ERR_INVALID && fuzz_msg_ok(err.msg), "invalid UTF-8: status %d '%s'",
                   st, err.msg);
        return;
    }
    FUZZ_CHECK(st == MOE_OK, "valid UTF-8 refused: %s", err.msg);
    int n_vocab = moe_tokenizer_n_vocab(tok);
    for (size_t i = 0; i < n; i++)
        FUZZ_CHECK(ids[i] >= 0 && ids[i] < n_vocab, "id %d outside [0, %d)", (int)ids[i], n_vocab);
    fuzz_check_decode(tok, ids, n, skip_special);
    free(ids);
}

#endif
