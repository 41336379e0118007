/* Fuzz target: tokenizer.json (common/tokenizer_load.c +
 * tokenizer_bpe.c, moe_tokenizer_parse). A tokenizer that loads must encode
 * a few fixed texts to ids in its vocabulary, decode every id alone (up to
 * 512 of them), and stream-decode as it decodes. */
#include "tok_check.h"

#define NAME "tokenizer.json"

static const char *const texts[] = {"Hello, world! It's 2024.", "  leading  and trailing  ",
                                    "h\xc3\xa9llo \xe4\xb8\x96\xe7\x95\x8c \xf0\x9f\x8c\x8d",
                                    "<s>[INST] hi [/INST]</s><|im_start|>user\n<|im_end|>",
                                    "\t\n\r 12345 \xef\xac\x81sh"};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct moe_tokenizer *tok = (struct moe_tokenizer *)1;
    struct moe_error err = {0};
    enum moe_status st = moe_tokenizer_parse((const char *)data, size, NAME, &tok, &err);
    if (st != MOE_OK) {
        FUZZ_CHECK(tok == NULL && err.code == st && fuzz_msg_ok(err.msg) &&
                       (st == MOE_ERR_NOMEM || strstr(err.msg, NAME)),
                   "status %d: '%s'", st, err.msg);
        return 0;
    }
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        fuzz_check_encode(tok, texts[i], strlen(texts[i]), i & 1, i & 2);
    int n_vocab = moe_tokenizer_n_vocab(tok);
    FUZZ_CHECK(n_vocab >= 0, "%d ids", n_vocab);
    int32_t ids[512];
    size_t n = 0, want = n_vocab < 512 ? (size_t)n_vocab : 512;
    for (size_t i = 0; i < want; i++) {
        int32_t id = (int32_t)(i * (size_t)n_vocab / want); /* spread over the vocabulary */
        if (fuzz_id_ok(tok, id))
            ids[n++] = id;
    }
    fuzz_check_decode(tok, ids, n, false);
    fuzz_check_decode(tok, ids, n, true);
    FUZZ_CHECK(!fuzz_id_ok(tok, n_vocab) && !fuzz_id_ok(tok, -1), "ids outside [0, %d) decode",
               n_vocab);
    moe_tokenizer_free(tok);
    return 0;
}
