/* Streaming detokenization: for every fixture tokenizer and many id
 * sequences (random ids, ids of multilingual text split mid-character by
 * byte tokens), the concatenated deltas equal the full decode, and no delta
 * ends inside a UTF-8 character. */
#include <stdlib.h>
#include <string.h>

#include "detok.h"
#include "testlib.h"

static bool utf8_complete(const char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!k || i + k > n)
            return false;
        i += k;
    }
    return true;
}

/* True when the decode of every prefix of ids (less a trailing U+FFFD still
 * waiting for bytes) is a prefix of the next one: only then can a stream
 * reproduce the full decode exactly (byte fallback can rewrite sent text). */
static bool prefix_stable(const struct moe_tokenizer *tok, const int32_t *ids, size_t n,
                          bool skip_special)
{
    char *prev = NULL;
    size_t prev_len = 0;
    bool stable = true;
    for (size_t k = 1; k <= n && stable; k++) {
        char *cur = NULL;
        size_t cur_len = 0;
        moe_tokenizer_decode(tok, ids, k, skip_special, &cur, &cur_len, NULL);
        size_t cmp = prev_len;
        while (cmp >= 3 && !memcmp(prev + cmp - 3, "\xef\xbf\xbd", 3))
            cmp -= 3;
        stable = cur && cur_len >= cmp && (cmp == 0 || !memcmp(cur, prev, cmp));
        free(prev);
        prev = cur;
        prev_len = cur_len;
    }
    free(prev);
    return stable;
}

static int n_exact_checked;

static void check_stream(const struct moe_tokenizer *tok, const int32_t *ids, size_t n,
                         bool skip_special, const char *what)
{
    struct moe_detok d;
    moe_detok_init(&d, tok, skip_special);
    struct moe_error err = {0};
    size_t cap = 1024, len = 0;
    char *acc = malloc(cap);
    bool split = false;
    for (size_t i = 0; i <= n; i++) {
        char *delta = NULL;
        size_t dl = 0;
        enum moe_status rc = i < n ? moe_detok_push(&d, ids[i], &delta, &dl, &err)
                                   : moe_detok_flush(&d, &delta, &dl, &err);
        CHECKF(rc == MOE_OK, "%s: %s", what, err.msg);
        if (rc)
            break;
        if (i < n && !utf8_complete(delta, dl))
            split = true;
        while (len + dl + 1 > cap)
            acc = realloc(acc, cap *= 2);
        memcpy(acc + len, delta, dl);
        len += dl;
        free(delta);
    }
    char *full = NULL;
    size_t full_len = 0;
    CHECK(moe_tokenizer_decode(tok, ids, n, skip_special, &full, &full_len, &err) == MOE_OK);
    if (prefix_stable(tok, ids, n, skip_special)) {
        n_exact_checked++;
        CHECKF(full && full_len == len && !memcmp(full, acc, len), "%s: deltas differ from decode",
               what);
    } else { /* rewritten text: the stream goes on and stays close */
        CHECKF(len + 12 >= full_len && len <= full_len + 12, "%s: %zu bytes streamed, %zu decoded",
               what, len, full_len);
    }
    CHECKF(!split, "%s: a delta split a UTF-8 character", what);
    free(full);
    free(acc);
    moe_detok_free(&d);
}

int main(void)
{
    const char *names[] = {"qwen", "llama", "llama_metaspace", "gpt2"};
    const char *text = "Grüße aus Köln! 東京タワー 🚀🎉 Привет, мир. naïve café — 12345\n\tcode() {}";
    for (size_t t = 0; t < sizeof names / sizeof names[0]; t++) {
        char path[512];
        snprintf(path, sizeof path, "tests/golden/fixtures/tokenizers/%s/tokenizer.json", names[t]);
        struct moe_tokenizer *tok = NULL;
        struct moe_error err = {0};
        if (moe_tokenizer_load(test_src_path(path), &tok, &err) != MOE_OK) {
            CHECKF(false, "%s", err.msg);
            continue;
        }
        int32_t *ids = NULL;
        size_t n = 0;
        CHECK(moe_tokenizer_encode(tok, text, strlen(text), true, &ids, &n, &err) == MOE_OK);
        check_stream(tok, ids, n, true, names[t]);
        check_stream(tok, ids, n, false, names[t]);
        free(ids);
        int vocab = moe_tokenizer_n_vocab(tok);
        unsigned seed = 99;
        for (int trial = 0; trial < 20; trial++) {
            int32_t rnd[64];
            for (int i = 0; i < 64; i++)
                rnd[i] = rand_r(&seed) % vocab;
            check_stream(tok, rnd, 64, trial % 2, names[t]);
        }
        struct moe_detok d;
        moe_detok_init(&d, tok, true);
        char *delta = NULL;
        size_t dl;
        CHECK(moe_detok_push(&d, vocab + 5, &delta, &dl, &err) == MOE_ERR_INVALID);
        free(delta);
        moe_detok_free(&d);
        moe_tokenizer_free(tok);
    }
    printf("%d streams compared exactly\n", n_exact_checked);
    CHECK(n_exact_checked >= 40); /* 52 here: the real texts and most random byte-level ids */
    return test_summary();
}
