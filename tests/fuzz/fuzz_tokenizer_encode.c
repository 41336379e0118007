/* Fuzz target: encode and decode with the fixture tokenizers
 * (tests/golden/fixtures/tokenizers: GPT-2 and Qwen byte-level BPE, Llama
 * SentencePiece-style with and without a Metaspace pre-tokenizer).
 *
 * Input: byte 0 picks the tokenizer (bits 0-1), add_special (bit 2),
 * skip_special (bit 3) and the mode (bit 4): text -> the rest is UTF-8 (or
 * not) to encode, decode and stream-decode; ids -> the rest is little-endian
 * uint16 ids (some past the vocabulary) to decode. */
#include "tok_check.h"

static const char *const names[4] = {"gpt2", "qwen", "llama", "llama_metaspace"};
static struct moe_tokenizer *toks[4];
static bool *id_ok[4]; /* (n_vocab + 2): which ids decode */

static void free_all(void)
{
    for (int i = 0; i < 4; i++) {
        moe_tokenizer_free(toks[i]);
        free(id_ok[i]);
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    for (int i = 0; i < 4; i++) {
        char rel[128];
        snprintf(rel, sizeof rel, "tests/golden/fixtures/tokenizers/%s/tokenizer.json", names[i]);
        struct moe_error err = {0};
        if (moe_tokenizer_load(fuzz_src_path(rel), &toks[i], &err)) {
            fprintf(stderr, "%s\n", err.msg);
            abort();
        }
        int n_vocab = moe_tokenizer_n_vocab(toks[i]);
        id_ok[i] = calloc((size_t)n_vocab + 2, sizeof *id_ok[i]);
        for (int id = 0; id_ok[i] && id < n_vocab + 2; id++)
            id_ok[i][id] = fuzz_id_ok(toks[i], id);
    }
    atexit(free_all);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const struct moe_tokenizer *tok = toks[data[0] & 3];
    const bool *ok = id_ok[data[0] & 3];
    bool add_special = data[0] & 4, skip_special = data[0] & 8;
    data++;
    size--;
    if (!(data[-1] & 16)) {
        fuzz_check_encode(tok, (const char *)data, size, add_special, skip_special);
        return 0;
    }
    int n_vocab = moe_tokenizer_n_vocab(tok);
    size_t n = size / 2;
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    FUZZ_CHECK(ids, "out of memory");
    bool in_range = true;
    for (size_t i = 0; i < n; i++) {
        ids[i] = (int32_t)((data[2 * i] | data[2 * i + 1] << 8) % (n_vocab + 2));
        in_range &= ok[ids[i]];
    }
    if (in_range) {
        fuzz_check_decode(tok, ids, n, skip_special);
    } else {
        char *text = NULL;
        size_t len = 0;
        struct moe_error err = {0};
        FUZZ_CHECK(moe_tokenizer_decode(tok, ids, n, skip_special, &text, &len, &err) ==
                           MOE_ERR_INVALID &&
                       !text && fuzz_msg_ok(err.msg),
                   "an id outside the vocabulary: '%s'", err.msg);
    }
    free(ids);
    return 0;
}
