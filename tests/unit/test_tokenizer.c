/* Tokenizer against the Hugging Face `tokenizers` library: every case of
 * tests/golden/fixtures/tokenizers/cases.json (made by
 * tests/golden/make_tokenizers.py) must give the same ids and the same decoded
 * text; malformed files must fail cleanly; a speed figure is printed. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "testlib.h"
#include "tokenizer.h"

static const char *const NAMES[] = {"qwen", "llama", "llama_metaspace", "gpt2"};

static char *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *d = malloc((size_t)sz + 1);
    if (d && fread(d, 1, (size_t)sz, f) != (size_t)sz) {
        free(d);
        d = NULL;
    }
    fclose(f);
    if (d)
        d[sz] = 0;
    *n = (size_t)sz;
    return d;
}

static struct moe_tokenizer *load_fixture(const char *name)
{
    char rel[256];
    snprintf(rel, sizeof(rel), "tests/golden/fixtures/tokenizers/%s/tokenizer.json", name);
    struct moe_tokenizer *tok = NULL;
    struct moe_error err = {0};
    enum moe_status st = moe_tokenizer_load(test_src_path(rel), &tok, &err);
    CHECKF(st == MOE_OK && tok, "%s: %s", name, err.msg);
    return tok;
}

/* ids from a JSON array; n = -1 if it is not one. */
static int32_t *json_ids(const cJSON *a, size_t *n)
{
    *n = (size_t)cJSON_GetArraySize(a);
    int32_t *v = malloc((*n + 1) * sizeof(*v));
    size_t i = 0;
    for (const cJSON *e = a ? a->child : NULL; e; e = e->next)
        v[i++] = (int32_t)e->valuedouble;
    return v;
}

static bool ids_equal(const int32_t *a, size_t na, const int32_t *b, size_t nb)
{
    return na == nb && (na == 0 || memcmp(a, b, na * sizeof(*a)) == 0);
}

static void print_ids(const char *what, const int32_t *v, size_t n)
{
    fprintf(stderr, "  %s (%zu):", what, n);
    for (size_t i = 0; i < n && i < 40; i++)
        fprintf(stderr, " %d", v[i]);
    fputc('\n', stderr);
}

static void check_decode(const struct moe_tokenizer *tok, const char *name, const int32_t *ids,
                         size_t n, bool skip, const char *want)
{
    char *text = NULL;
    size_t len = 0;
    struct moe_error err = {0};
    enum moe_status st = moe_tokenizer_decode(tok, ids, n, skip, &text, &len, &err);
    CHECKF(st == MOE_OK && text && len == strlen(want) && memcmp(text, want, len) == 0 &&
               text[len] == 0,
           "%s: decode(skip=%d) of %zu ids: got \"%s\" want \"%s\" (%s)", name, skip, n,
           text ? text : "(null)", want, err.msg);
    free(text);
}

static void check_cases(const struct moe_tokenizer *tok, const char *name, const cJSON *cases)
{
    const cJSON *nv = cJSON_GetObjectItem(cases, "n_vocab");
    CHECKF(moe_tokenizer_n_vocab(tok) == (int)nv->valuedouble, "%s: n_vocab %d want %d", name,
           moe_tokenizer_n_vocab(tok), (int)nv->valuedouble);
    int n_enc = 0, n_dec = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(cases, "encode"))
    {
        const char *text = cJSON_GetObjectItem(c, "text")->valuestring;
        for (int special = 0; special < 2; special++) {
            size_t nw;
            int32_t *want = json_ids(cJSON_GetObjectItem(c, special ? "ids_special" : "ids"), &nw);
            int32_t *got = NULL;
            size_t ng = 0;
            struct moe_error err = {0};
            enum moe_status st =
                moe_tokenizer_encode(tok, text, strlen(text), special, &got, &ng, &err);
            bool ok = st == MOE_OK && got && ids_equal(got, ng, want, nw);
            CHECKF(ok, "%s: encode(\"%.60s\", add_special=%d) differs (%s)", name, text, special,
                   err.msg);
            if (!ok) {
                print_ids("got ", got, ng);
                print_ids("want", want, nw);
            }
            if (special) {
                check_decode(tok, name, want, nw, false,
                             cJSON_GetObjectItem(c, "decode")->valuestring);
                check_decode(tok, name, want, nw, true,
                             cJSON_GetObjectItem(c, "decode_skip")->valuestring);
            }
            free(want);
            free(got);
        }
        n_enc++;
    }
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(cases, "decode"))
    {
        size_t n;
        int32_t *ids = json_ids(cJSON_GetObjectItem(c, "ids"), &n);
        check_decode(tok, name, ids, n, false, cJSON_GetObjectItem(c, "decode")->valuestring);
        check_decode(tok, name, ids, n, true, cJSON_GetObjectItem(c, "decode_skip")->valuestring);
        free(ids);
        n_dec++;
    }
    CHECK(n_enc >= 30 && n_dec >= 10);
    fprintf(stderr, "%s: %d encode cases, %d decode cases\n", name, n_enc, n_dec);
}

static void check_misc(const struct moe_tokenizer *qwen, const struct moe_tokenizer *llama)
{
    struct moe_error err = {0};
    int32_t *ids = NULL;
    size_t n = 0;
    char *text = NULL;
    size_t len = 0;
    /* invalid UTF-8 input */
    CHECK(moe_tokenizer_encode(qwen,
                               "a\xff"
                               "b",
                               3, false, &ids, &n, &err) == MOE_ERR_INVALID);
    CHECK(ids == NULL && err.msg[0]);
    /* ids outside the vocabulary */
    int32_t bad[] = {5, moe_tokenizer_n_vocab(qwen)};
    CHECK(moe_tokenizer_decode(qwen, bad, 2, false, &text, &len, &err) == MOE_ERR_INVALID);
    CHECK(text == NULL && strstr(err.msg, "ids[1]"));
    int32_t neg[] = {-1};
    CHECK(moe_tokenizer_decode(llama, neg, 1, false, &text, &len, &err) == MOE_ERR_INVALID);
    /* token lookups */
    CHECK(moe_tokenizer_token_to_id(qwen, "<|im_end|>") == moe_tokenizer_n_vocab(qwen) - 1);
    CHECK(moe_tokenizer_token_to_id(llama, "<s>") == 1);
    CHECK(moe_tokenizer_token_to_id(llama, "<0x41>") >= 3);
    CHECK(moe_tokenizer_token_to_id(llama, "no such token") == -1);
    /* NULL is a no-op */
    moe_tokenizer_free(NULL);
}

/* Decodes what it encoded: text that is already NFC comes back unchanged. */
static void check_round_trip(const struct moe_tokenizer *tok, const char *name, const char *text,
                             size_t n)
{
    int32_t *ids = NULL;
    size_t n_ids = 0;
    char *back = NULL;
    size_t len = 0;
    struct moe_error err = {0};
    CHECKF(moe_tokenizer_encode(tok, text, n, false, &ids, &n_ids, &err) == MOE_OK, "%s: %s", name,
           err.msg);
    CHECKF(moe_tokenizer_decode(tok, ids, n_ids, false, &back, &len, &err) == MOE_OK, "%s: %s",
           name, err.msg);
    CHECKF(back && len == n && memcmp(back, text, n) == 0, "%s: round trip of %zu bytes gave %zu",
           name, n, len);
    free(ids);
    free(back);
}

static void check_speed(const struct moe_tokenizer *tok, const char *name, const char *text,
                        size_t n)
{
    struct timespec t0, t1;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    struct moe_error err = {0};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    enum moe_status st = moe_tokenizer_encode(tok, text, n, false, &ids, &n_ids, &err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    CHECKF(st == MOE_OK && n_ids > n / 20, "%s: %s", name, err.msg);
    fprintf(stderr, "speed %s: %zu bytes -> %zu tokens in %.1f ms = %.2f MB/s\n", name, n, n_ids,
            s * 1e3, (double)n / s / 1e6);
    free(ids);
}

struct bad_case {
    const char *what;
    const char *json;
    enum moe_status want;
    const char *msg_part;
};

static void check_bad_files(void)
{
    static const char vocab[] = "\"vocab\":{\"a\":0,\"b\":1,\"ab\":2}";
    char buf[8][512];
    snprintf(buf[0], sizeof(buf[0]), "{\"model\":{\"type\":\"BPE\",%s,\"merges\":[\"a c\"]}}",
             vocab);
    snprintf(buf[1], sizeof(buf[1]),
             "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":0},\"merges\":[]}}");
    snprintf(buf[2], sizeof(buf[2]),
             "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":99999999},\"merges\":[]}}");
    snprintf(buf[3], sizeof(buf[3]),
             "{\"model\":{\"type\":\"BPE\",%s,\"merges\":[[\"a\",\"b\"]]},\"normalizer\":{\"type\":"
             "\"Lowercase\"}}",
             vocab);
    snprintf(buf[4], sizeof(buf[4]),
             "{\"model\":{\"type\":\"BPE\",%s,\"merges\":[\"a "
             "b\"]},\"added_tokens\":[{\"id\":-3,\"content\":\"x\",\"special\":true}]}",
             vocab);
    snprintf(buf[5], sizeof(buf[5]),
             "{\"model\":{\"type\":\"BPE\",%s,\"merges\":[\"a "
             "b\"]},\"decoder\":{\"type\":\"WordPiece\"}}",
             vocab);
    snprintf(buf[6], sizeof(buf[6]),
             "{\"model\":{\"type\":\"BPE\",%s,\"merges\":[\"a "
             "b\"],\"continuing_subword_prefix\":\"##\"}}",
             vocab);
    snprintf(buf[7], sizeof(buf[7]),
             "{\"model\":{\"type\":\"BPE\",%s,\"merges\":[\"a "
             "b\"]},\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(unclosed\"},"
             "\"behavior\":\"Isolated\"}}",
             vocab);
    const struct bad_case cases[] = {
        {"not json", "{\"model\": {", MOE_ERR_FORMAT, "JSON"},
        {"array", "[1,2]", MOE_ERR_FORMAT, "object"},
        {"empty file", "", MOE_ERR_FORMAT, "JSON"},
        {"no model", "{\"normalizer\":null}", MOE_ERR_FORMAT, "'model'"},
        {"WordPiece", "{\"model\":{\"type\":\"WordPiece\",\"vocab\":{}}}", MOE_ERR_UNSUPPORTED,
         "WordPiece"},
        {"Unigram", "{\"model\":{\"type\":\"Unigram\",\"vocab\":[]}}", MOE_ERR_UNSUPPORTED,
         "Unigram"},
        {"merge of unknown token", buf[0], MOE_ERR_FORMAT, "merges[0]"},
        {"duplicate id", buf[1], MOE_ERR_FORMAT, "id 0"},
        {"id out of range", buf[2], MOE_ERR_FORMAT, "99999999"},
        {"unknown normalizer", buf[3], MOE_ERR_UNSUPPORTED, "Lowercase"},
        {"negative added id", buf[4], MOE_ERR_FORMAT, "added_tokens[0]"},
        {"unknown decoder", buf[5], MOE_ERR_UNSUPPORTED, "WordPiece"},
        {"subword prefix", buf[6], MOE_ERR_UNSUPPORTED, "continuing_subword_prefix"},
        {"bad regex", buf[7], MOE_ERR_UNSUPPORTED, "(unclosed"},
        {"vocab not object", "{\"model\":{\"type\":\"BPE\",\"vocab\":[1],\"merges\":[]}}",
         MOE_ERR_FORMAT, "model.vocab"},
        {"bad merge string",
         "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"a\"]}}", MOE_ERR_FORMAT,
         "merges[0]"},
        {"fractional id", "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0.5},\"merges\":[]}}",
         MOE_ERR_FORMAT, "model.vocab"},
        {"truncation",
         "{\"truncation\":{\"max_length\":3},\"model\":{\"type\":\"BPE\",\"vocab\":{},\"merges\":[]"
         "}}",
         MOE_ERR_UNSUPPORTED, "truncation"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const char *path =
            test_write_temp("bad_tokenizer.json", cases[i].json, strlen(cases[i].json));
        struct moe_tokenizer *tok = (struct moe_tokenizer *)1;
        struct moe_error err = {0};
        enum moe_status st = moe_tokenizer_load(path, &tok, &err);
        CHECKF(st == cases[i].want && tok == NULL && strstr(err.msg, cases[i].msg_part) &&
                   strstr(err.msg, "bad_tokenizer.json"),
               "%s: got %s \"%s\"", cases[i].what, moe_status_name(st), err.msg);
        moe_tokenizer_free(st == MOE_OK ? tok : NULL);
    }
    struct moe_tokenizer *tok = NULL;
    struct moe_error err = {0};
    CHECK(moe_tokenizer_load("/nonexistent/tokenizer.json", &tok, &err) == MOE_ERR_NOT_FOUND);
    CHECKF(strstr(err.msg, "/nonexistent/tokenizer.json: No such file"), "%s", err.msg);
    CHECK(strstr(err.msg, "/nonexistent/tokenizer.json") != NULL);
}

int main(void)
{
    size_t n_json;
    char *json = read_all(test_src_path("tests/golden/fixtures/tokenizers/cases.json"), &n_json);
    CHECK(json != NULL);
    if (!json)
        return test_summary();
    cJSON *root = cJSON_Parse(json);
    CHECK(root != NULL);
    struct moe_tokenizer *toks[4] = {0};
    for (int i = 0; i < 4; i++) {
        toks[i] = load_fixture(NAMES[i]);
        if (toks[i] && root)
            check_cases(toks[i], NAMES[i], cJSON_GetObjectItem(root, NAMES[i]));
    }
    if (toks[0] && toks[1])
        check_misc(toks[0], toks[1]);
    check_bad_files();

    /* ~200 KB of every test text (already NFC), for round trips and speed. */
    const cJSON *c;
    size_t cap = 256 * 1024, n = 0;
    char *big = malloc(cap);
    while (big && root && n < 200 * 1024) {
        cJSON_ArrayForEach(c, cJSON_GetObjectItem(cJSON_GetObjectItem(root, "qwen"), "encode"))
        {
            const char *t = cJSON_GetObjectItem(c, "text")->valuestring;
            size_t k = strlen(t);
            if (strstr(t, "\xcc") || n + k + 1 > cap) /* skip decomposed (combining) text */
                continue;
            memcpy(big + n, t, k);
            n += k;
            big[n++] = ' ';
        }
    }
    if (big && toks[0] && toks[1] && toks[2]) {
        check_round_trip(toks[0], "qwen", big, n);
        check_speed(toks[0], "qwen", big, n);
        check_speed(toks[1], "llama", big, n);
        check_speed(toks[2], "llama_metaspace", big, n);
    }
    /* Worst cases: one 300 KB word of a character the vocabularies lack
     * (byte-level / byte fallback all the way), and 100 KB of spaces. */
    size_t n_cat = 100000;
    char *cat = malloc(3 * n_cat + 1);
    for (size_t i = 0; cat && i < n_cat; i++)
        memcpy(cat + 3 * i, "\xe7\x8c\xab", 3); /* U+732B */
    for (int i = 0; cat && i < 4; i++) {
        if (!toks[i])
            continue;
        char what[64];
        snprintf(what, sizeof(what), "%s, 100k x U+732B", NAMES[i]);
        check_speed(toks[i], what, cat, 3 * n_cat);
        memset(cat, ' ', n_cat);
        snprintf(what, sizeof(what), "%s, 100k spaces", NAMES[i]);
        check_speed(toks[i], what, cat, n_cat);
        for (size_t k = 0; k < n_cat; k++)
            memcpy(cat + 3 * k, "\xe7\x8c\xab", 3);
    }
    if (cat && toks[0])
        check_round_trip(toks[0], "qwen, 100k x U+732B", cat, 3 * n_cat);
    free(cat);
    free(big);
    for (int i = 0; i < 4; i++)
        moe_tokenizer_free(toks[i]);
    cJSON_Delete(root);
    free(json);
    return test_summary();
}
