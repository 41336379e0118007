/* Incremental detokenization for streaming: turns each new token id into the
 * text it adds, never splitting a UTF-8 character and never emitting text
 * that a later token would change.
 *
 * It decodes a short window of recent ids twice (up to the last emitted id
 * and up to the newest) and emits the difference, the way vLLM does: a
 * decoder that strips a leading space or fuses byte tokens treats both
 * decodes alike, so the difference is exactly the new text. Concatenated,
 * the deltas equal the decode of all ids (checked by the tests). */
#ifndef MOE_DETOK_H
#define MOE_DETOK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe_error.h"
#include "tokenizer.h"

struct moe_detok {
    const struct moe_tokenizer *tok;
    bool skip_special;
    int32_t *ids; /* every id so far */
    size_t n_ids, cap_ids;
    size_t prefix; /* start of the decode window */
    size_t read;   /* ids up to here have been emitted as text */
};

void moe_detok_init(struct moe_detok *d, const struct moe_tokenizer *tok, bool skip_special);
void moe_detok_free(struct moe_detok *d);

/* Adds `id` and appends the text it completes to *delta (malloc'd,
 * NUL-terminated, possibly empty; the caller frees it). An id outside the
 * vocabulary is MOE_ERR_INVALID. */
enum moe_status moe_detok_push(struct moe_detok *d, int32_t id, char **delta, size_t *len,
                               struct moe_error *err);

/* Text still held back at the end of the stream (an incomplete UTF-8
 * sequence decodes to U+FFFD, as a full decode would). */
enum moe_status moe_detok_flush(struct moe_detok *d, char **delta, size_t *len,
                                struct moe_error *err);

#endif
