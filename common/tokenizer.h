/* Hugging Face tokenizer.json: BPE models of both families.
 *  - byte-level BPE (GPT-2 / Qwen): Split pre-tokenizer with its regex
 *    (PCRE2, Unicode classes), ByteLevel byte-to-unicode mapping;
 *  - SentencePiece-style BPE (Llama / Mistral): metaspace (U+2581) via
 *    normalizer or pre-tokenizer, byte fallback (<0xAB> tokens).
 * Added / special tokens are matched before the model runs. */
#ifndef MOE_TOKENIZER_H
#define MOE_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe_error.h"

struct moe_tokenizer;

/* Loads tokenizer.json at `path`. Unknown or unsupported components are
 * MOE_ERR_UNSUPPORTED naming the component; malformed JSON is
 * MOE_ERR_FORMAT naming the file. */
enum moe_status moe_tokenizer_load(const char *path, struct moe_tokenizer **out,
                                   struct moe_error *err);

/* The same from the `n` bytes of JSON at `json` (need not be NUL-terminated);
 * `path` stands for the file in messages. The text is not kept. */
enum moe_status moe_tokenizer_parse(const char *json, size_t n, const char *path,
                                    struct moe_tokenizer **out, struct moe_error *err);

void moe_tokenizer_free(struct moe_tokenizer *tok);

/* Encodes `len` bytes of UTF-8 `text`. With `add_special`, the
 * post-processor's template (e.g. a leading BOS) is applied, as
 * `tokenizer.encode(text, add_special_tokens=True)` does. On success *ids is
 * a malloc'd array the caller frees. */
enum moe_status moe_tokenizer_encode(const struct moe_tokenizer *tok, const char *text, size_t len,
                                     bool add_special, int32_t **ids, size_t *n_ids,
                                     struct moe_error *err);

/* moe_tokenizer_encode that gives up once the result is known to hold more
 * than max_ids ids (the post-processor's included): then MOE_ERR_INVALID
 * "more than N tokens", *ids NULL, and the rest of the text is not
 * tokenized (a prompt far beyond the context costs little). SIZE_MAX: no
 * limit. */
enum moe_status moe_tokenizer_encode_max(const struct moe_tokenizer *tok, const char *text,
                                         size_t len, bool add_special, size_t max_ids,
                                         int32_t **ids, size_t *n_ids, struct moe_error *err);

/* Decodes ids to UTF-8 text (malloc'd, NUL-terminated, *len excludes the
 * NUL). With `skip_special`, special added tokens are dropped. Byte
 * sequences that are not valid UTF-8 become U+FFFD, as in `tokenizers`.
 * An id outside the vocabulary is MOE_ERR_INVALID. */
enum moe_status moe_tokenizer_decode(const struct moe_tokenizer *tok, const int32_t *ids, size_t n,
                                     bool skip_special, char **text, size_t *len,
                                     struct moe_error *err);

/* Number of ids (model vocabulary plus added tokens). */
int moe_tokenizer_n_vocab(const struct moe_tokenizer *tok);

/* Id of an exact token string (vocabulary or added token), or -1. */
int32_t moe_tokenizer_token_to_id(const struct moe_tokenizer *tok, const char *token);

#endif
