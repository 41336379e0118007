/* safetensors reader: valid single-file and sharded checkpoints, dtype
 * conversion, block reads, every malformed-header case, truncation at every
 * byte and a seeded mutation fuzz. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "safetensors.h"
#include "st_writer.h"
#include "testlib.h"

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Opens `path`, expects `want`, and that the message holds every non-NULL needle. */
static void expect_open_fails(const char *label, const char *path, enum moe_status want,
                              const char *needle1, const char *needle2)
{
    struct st_model *m = (struct st_model *)1;
    struct moe_error err = {0};
    enum moe_status st = st_open(path, &m, &err);
    CHECKF(st == want, "%s: got %s (%s), want %s", label, moe_status_name(st), err.msg,
           moe_status_name(want));
    if (want != MOE_OK)
        CHECKF(m == NULL, "%s: *out not NULL on error", label);
    CHECKF(err.code == st, "%s: err.code %d != status %d", label, err.code, st);
    CHECKF(!strchr(err.msg, '\n'), "%s: message is not one line", label);
    if (needle1)
        CHECKF(strstr(err.msg, needle1), "%s: message '%s' lacks '%s'", label, err.msg, needle1);
    if (needle2)
        CHECKF(strstr(err.msg, needle2), "%s: message '%s' lacks '%s'", label, err.msg, needle2);
    if (st == MOE_OK)
        st_close(m);
}

/* Writes a single file with this header (and `n_data` zero bytes) and expects failure. */
static void expect_header_fails(const char *label, const char *header, size_t n_data,
                                enum moe_status want, const char *needle)
{
    static unsigned char zeros[4096];
    if (n_data > sizeof zeros)
        abort();
    const char *path = st_write("bad.safetensors", header, zeros, n_data);
    expect_open_fails(label, path, want, "bad.safetensors", needle);
}

/* ---- the valid fixture ------------------------------------------------------ */

static const uint16_t h_vals[8] = {0x3C00, 0x0001, 0x03FF, 0x8001, 0x7BFF, 0xFC00, 0x7E00, 0x3555};
static const uint32_t tie_bits[4] = {0x3F808000u, 0x3F818000u, 0x3F80FFFFu, 0xBF808001u};
static const uint16_t tie_bf16[4] = {0x3F80, 0x3F82, 0x3F81, 0xBF81};
static const uint16_t b_vals[3] = {0x3F80, 0xC040, 0x0001};

static float emb_val(int r, int c)
{
    return (float)(r * 5 + c) * 0.5f - 3.0f;
}

static struct st_builder builder;

/* Builds the valid single file into `builder` and writes it as `name`. */
static const char *write_valid(const char *name, int pad_mod)
{
    float emb[4][5];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 5; c++)
            emb[r][c] = emb_val(r, c);
    float s = 42.0f, t3[4] = {1, 2, 3, 4};
    st_builder_init(&builder, "{\"format\":\"pt\"}");
    st_builder_add(&builder, "model.embed_tokens.weight", "F32", "[4, 5]", emb, sizeof emb);
    st_builder_add(&builder, "tie", "F32", "[4]", tie_bits, sizeof tie_bits);
    st_builder_add(&builder, "b", "BF16", "[3]", b_vals, sizeof b_vals);
    st_builder_add(&builder, "h", "F16", "[2, 4]", h_vals, sizeof h_vals);
    st_builder_add(&builder, "s", "F32", "[]", &s, sizeof s);
    st_builder_add(&builder, "e", "F32", "[0, 4]", NULL, 0);
    st_builder_add(&builder, "t3", "F32", "[2, 1, 2]", t3, sizeof t3);
    return st_builder_write(&builder, name, pad_mod);
}

static void test_valid_single(void)
{
    char path[512];
    snprintf(path, sizeof path, "%s", write_valid("model.safetensors", 3));
    struct st_model *m = NULL;
    struct moe_error err = {0};
    enum moe_status st = st_open(path, &m, &err);
    CHECKF(st == MOE_OK, "open valid: %s", err.msg);
    if (st != MOE_OK)
        return;
    CHECK(st_count(m) == 7);
    CHECK(st_get(m, 7) == NULL);
    CHECK(st_find(m, "nope") == NULL);
    CHECK(st_find(m, "__metadata__") == NULL);
    CHECK(st_find(NULL, "b") == NULL);
    for (size_t i = 0; i < st_count(m); i++)
        CHECK(st_find(m, st_get(m, i)->name) == st_get(m, i));

    const struct st_tensor *emb = st_find(m, "model.embed_tokens.weight");
    CHECK(emb && emb->dtype == MOE_DTYPE_F32 && emb->n_dim == 2 && emb->shape[0] == 4 &&
          emb->shape[1] == 5 && emb->nbytes == 80 && !strcmp(emb->file, path));
    CHECK(emb && ((uintptr_t)emb->data & 3) != 0); /* the fixture makes data unaligned */

    /* F32 -> F32, whole tensor */
    float full[20];
    st = st_read_block(emb, 0, 4, 0, 5, MOE_DTYPE_F32, full, &err);
    CHECKF(st == MOE_OK, "%s", err.msg);
    int bad = 0;
    for (int i = 0; i < 20; i++)
        bad += full[i] != emb_val(i / 5, i % 5);
    CHECK(bad == 0);

    /* slice rows [1, 3) x cols [2, 5) */
    float blk[6] = {0};
    st = st_read_block(emb, 1, 2, 2, 3, MOE_DTYPE_F32, blk, &err);
    CHECKF(st == MOE_OK, "%s", err.msg);
    bad = 0;
    for (int r = 0; r < 2; r++)
        for (int c = 0; c < 3; c++)
            bad += blk[r * 3 + c] != emb_val(1 + r, 2 + c);
    CHECK(bad == 0);
    /* same slice as BF16: these values are exact in bf16 */
    uint16_t blk16[6] = {0};
    st = st_read_block(emb, 1, 2, 2, 3, MOE_DTYPE_BF16, blk16, &err);
    CHECKF(st == MOE_OK, "%s", err.msg);
    bad = 0;
    for (int r = 0; r < 2; r++)
        for (int c = 0; c < 3; c++)
            bad += (uint32_t)blk16[r * 3 + c] << 16 != f32_bits(emb_val(1 + r, 2 + c));
    CHECK(bad == 0);

    /* F32 -> BF16 rounds to nearest even */
    const struct st_tensor *tie = st_find(m, "tie");
    uint16_t tb[4] = {0};
    CHECK(tie && st_read_block(tie, 0, 1, 0, 4, MOE_DTYPE_BF16, tb, &err) == MOE_OK);
    for (int i = 0; i < 4; i++)
        CHECKF(tb[i] == tie_bf16[i], "tie[%d]: 0x%04x, want 0x%04x", i, tb[i], tie_bf16[i]);

    /* BF16 -> F32 exact, BF16 -> BF16 copy */
    const struct st_tensor *b = st_find(m, "b");
    float bf[3];
    uint16_t bb[3];
    CHECK(b && b->dtype == MOE_DTYPE_BF16 && b->n_dim == 1 && b->nbytes == 6);
    CHECK(st_read_block(b, 0, 1, 0, 3, MOE_DTYPE_F32, bf, &err) == MOE_OK);
    CHECK(bf[0] == 1.0f && bf[1] == -3.0f && f32_bits(bf[2]) == 0x00010000u);
    CHECK(st_read_block(b, 0, 1, 1, 2, MOE_DTYPE_BF16, bb, &err) == MOE_OK);
    CHECK(bb[0] == 0xC040 && bb[1] == 0x0001);

    /* F16 -> F32, subnormals, inf, NaN; F16 -> BF16 through f32 */
    const struct st_tensor *h = st_find(m, "h");
    float hf[8];
    CHECK(h && h->dtype == MOE_DTYPE_F16 &&
          st_read_block(h, 0, 2, 0, 4, MOE_DTYPE_F32, hf, &err) == MOE_OK);
    CHECK(hf[0] == 1.0f);
    CHECK(hf[1] == ldexpf(1.0f, -24));
    CHECK(hf[2] == 1023.0f * ldexpf(1.0f, -24));
    CHECK(hf[3] == -ldexpf(1.0f, -24));
    CHECK(hf[4] == 65504.0f);
    CHECK(isinf(hf[5]) && hf[5] < 0);
    CHECK(isnan(hf[6]));
    CHECK(fabsf(hf[7] - 0.33325195f) < 1e-7f);
    uint16_t hb[4];
    CHECK(h && st_read_block(h, 1, 1, 0, 4, MOE_DTYPE_BF16, hb, &err) == MOE_OK);
    CHECKF(hb[0] == 0x4780, "65504 -> bf16 0x%04x, want 0x4780", hb[0]); /* rounds up to 65536 */
    CHECK(hb[1] == 0xFF80);                                              /* -inf */
    CHECK((hb[2] & 0x7F80) == 0x7F80 && (hb[2] & 0x7F));                 /* NaN */
    uint16_t hs = 0;
    CHECK(h && st_read_block(h, 0, 1, 1, 1, MOE_DTYPE_BF16, &hs, &err) == MOE_OK);
    CHECK(hs == 0x3380); /* 2^-24 exactly */

    /* scalar and empty tensors */
    const struct st_tensor *s = st_find(m, "s");
    float sv = 0;
    CHECK(s && s->n_dim == 0 && s->nbytes == 4);
    CHECK(s && st_read_block(s, 0, 1, 0, 1, MOE_DTYPE_F32, &sv, &err) == MOE_OK && sv == 42.0f);
    const struct st_tensor *e = st_find(m, "e");
    CHECK(e && e->n_dim == 2 && e->shape[0] == 0 && e->shape[1] == 4 && e->nbytes == 0);
    CHECK(e && st_read_block(e, 0, 0, 0, 4, MOE_DTYPE_F32, NULL, &err) == MOE_OK);

    /* block errors name the tensor */
    st = st_read_block(emb, 3, 2, 0, 5, MOE_DTYPE_F32, full, &err);
    CHECK(st == MOE_ERR_INVALID && strstr(err.msg, "model.embed_tokens.weight"));
    st = st_read_block(emb, 0, 1, 4, 2, MOE_DTYPE_F32, full, &err);
    CHECK(st == MOE_ERR_INVALID && strstr(err.msg, "model.embed_tokens.weight"));
    st = st_read_block(emb, -1, 1, 0, 1, MOE_DTYPE_F32, full, &err);
    CHECK(st == MOE_ERR_INVALID);
    st = st_read_block(emb, 0, 1, 0, -1, MOE_DTYPE_F32, full, &err);
    CHECK(st == MOE_ERR_INVALID);
    st = st_read_block(emb, INT64_MAX, INT64_MAX, 0, 1, MOE_DTYPE_F32, full, &err);
    CHECK(st == MOE_ERR_INVALID);
    st = st_read_block(emb, 0, 1, 0, 5, MOE_DTYPE_F16, full, &err);
    CHECK(st == MOE_ERR_INVALID && strstr(err.msg, "F16"));
    st = st_read_block(st_find(m, "t3"), 0, 1, 0, 1, MOE_DTYPE_F32, full, &err);
    CHECK(st == MOE_ERR_INVALID && strstr(err.msg, "'t3'") && strstr(err.msg, "3 dimensions"));
    CHECK(st_read_block(NULL, 0, 1, 0, 1, MOE_DTYPE_F32, full, &err) == MOE_ERR_INVALID);
    st_close(m);

    /* the same file opened through its directory */
    char dir[512];
    snprintf(dir, sizeof dir, "%s/single", test_temp_dir());
    mkdir(dir, 0700);
    write_valid("single/model.safetensors", 0);
    m = NULL;
    st = st_open(dir, &m, &err);
    CHECKF(st == MOE_OK && st_count(m) == 7, "open dir: %s", err.msg);
    st_close(m);

    st_close(NULL); /* no-op */
    CHECK(st_count(NULL) == 0 && st_get(NULL, 0) == NULL);
    CHECK(st_open(NULL, &m, &err) == MOE_ERR_INVALID);
}

/* ---- malformed single files -------------------------------------------------- */

static const char *T = "model.embed_tokens.weight";

static void test_malformed(void)
{
    char hdr[2048];
    /* shorter than 8 bytes */
    const char *p = test_write_temp("bad.safetensors", "", 0);
    expect_open_fails("empty file", p, MOE_ERR_FORMAT, "bad.safetensors", "0 bytes");
    p = test_write_temp("bad.safetensors", "\x05\0\0\0\0", 5);
    expect_open_fails("5-byte file", p, MOE_ERR_FORMAT, "bad.safetensors", "5 bytes");

    /* header length beyond the file, and absurd */
    size_t n;
    unsigned char *buf = st_build(1000, "{}", NULL, 0, &n);
    p = test_write_temp("bad.safetensors", buf, n);
    free(buf);
    expect_open_fails("header past end", p, MOE_ERR_FORMAT, "bad.safetensors", "1000");
    buf = st_build(UINT64_MAX, "{}", NULL, 0, &n);
    p = test_write_temp("bad.safetensors", buf, n);
    free(buf);
    expect_open_fails("header 2^64-1", p, MOE_ERR_FORMAT, "bad.safetensors", "limit");
    buf = st_build(0, "", NULL, 0, &n);
    p = test_write_temp("bad.safetensors", buf, n);
    free(buf);
    expect_open_fails("header length 0", p, MOE_ERR_FORMAT, "bad.safetensors", "too short");

    /* not JSON / not an object / NUL inside */
    expect_header_fails("not json", "{\"a\": ", 0, MOE_ERR_FORMAT, "not valid JSON");
    expect_header_fails("trailing garbage", "{} x", 0, MOE_ERR_FORMAT, "not valid JSON");
    expect_header_fails("array", "[1, 2]", 0, MOE_ERR_FORMAT, "not a JSON object");
    buf = st_build(4, "{}", NULL, 0, &n);
    buf = realloc(buf, n + 2);
    memcpy(buf + n, "\0}", 2);
    p = test_write_temp("bad.safetensors", buf, n + 2);
    free(buf);
    expect_open_fails("NUL in header", p, MOE_ERR_FORMAT, "bad.safetensors", "NUL");

    /* the empty header and spaces padding are fine */
    p = st_write("ok.safetensors", "{}      ", NULL, 0);
    expect_open_fails("empty header", p, MOE_OK, NULL, NULL);
    p = st_write("ok.safetensors", "{\"__metadata__\":null}", NULL, 0);
    expect_open_fails("null metadata", p, MOE_OK, NULL, NULL);

    /* metadata */
    expect_header_fails("metadata not object", "{\"__metadata__\": [1]}", 0, MOE_ERR_FORMAT,
                        "__metadata__");
    expect_header_fails("metadata value", "{\"__metadata__\": {\"format\": 1}}", 0, MOE_ERR_FORMAT,
                        "'format'");

#define ENTRY(body)                                                                                \
    "{\""                                                                                          \
    "model.embed_tokens.weight"                                                                    \
    "\": " body "}"
    /* entry and dtype */
    expect_header_fails("entry not object", ENTRY("[1]"), 0, MOE_ERR_FORMAT, T);
    expect_header_fails("missing dtype", ENTRY("{\"shape\": [1], \"data_offsets\": [0, 4]}"), 4,
                        MOE_ERR_FORMAT, T);
    expect_header_fails("dtype number",
                        ENTRY("{\"dtype\": 7, \"shape\": [1], \"data_offsets\": [0, 4]}"), 4,
                        MOE_ERR_FORMAT, T);
    expect_header_fails("dtype unknown",
                        ENTRY("{\"dtype\": \"Q9\", \"shape\": [1], \"data_offsets\": [0, 4]}"), 4,
                        MOE_ERR_FORMAT, "Q9");
    const char *others[] = {"I64", "F64", "U8", "BOOL", "F8_E4M3", "I32"};
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
        snprintf(hdr, sizeof hdr,
                 ENTRY("{\"dtype\": \"%s\", \"shape\": [1], \"data_offsets\": [0, 8]}"), others[i]);
        expect_header_fails(others[i], hdr, 8, MOE_ERR_UNSUPPORTED, T);
        p = st_write("bad.safetensors", hdr, "\0\0\0\0\0\0\0\0", 8);
        expect_open_fails(others[i], p, MOE_ERR_UNSUPPORTED, others[i], "not supported");
    }

    /* shape */
    expect_header_fails("shape missing", ENTRY("{\"dtype\": \"F32\", \"data_offsets\": [0, 4]}"), 4,
                        MOE_ERR_FORMAT, "'shape'");
    expect_header_fails("shape string",
                        ENTRY("{\"dtype\": \"F32\", \"shape\": \"4\", \"data_offsets\": [0, 4]}"),
                        4, MOE_ERR_FORMAT, T);
    expect_header_fails("shape negative",
                        ENTRY("{\"dtype\": \"F32\", \"shape\": [2, -1], \"data_offsets\": [0, 4]}"),
                        4, MOE_ERR_FORMAT, "shape[1]");
    expect_header_fails("shape fraction",
                        ENTRY("{\"dtype\": \"F32\", \"shape\": [1.5], \"data_offsets\": [0, 4]}"),
                        4, MOE_ERR_FORMAT, "1.5");
    expect_header_fails("shape > 2^53",
                        ENTRY("{\"dtype\": \"F32\", \"shape\": [1e300], \"data_offsets\": [0, 4]}"),
                        4, MOE_ERR_FORMAT, T);
    expect_header_fails("shape element string",
                        ENTRY("{\"dtype\": \"F32\", \"shape\": [\"1\"], \"data_offsets\": [0, 4]}"),
                        4, MOE_ERR_FORMAT, T);
    expect_header_fails(
        "9 dims",
        ENTRY("{\"dtype\": \"F32\", \"shape\": [1,1,1,1,1,1,1,1,1], \"data_offsets\": [0, 4]}"), 4,
        MOE_ERR_UNSUPPORTED, "9 dimensions");
    p = st_write(
        "ok.safetensors",
        ENTRY("{\"dtype\": \"F32\", \"shape\": [1,1,1,1,1,1,1,1], \"data_offsets\": [0, 4]}"),
        "\0\0\0\0", 4);
    expect_open_fails("8 dims ok", p, MOE_OK, NULL, NULL);
    expect_header_fails("shape overflow",
                        ENTRY("{\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296, 16], "
                              "\"data_offsets\": [0, 4]}"),
                        4, MOE_ERR_FORMAT, "overflow");
    expect_header_fails("bytes overflow",
                        ENTRY("{\"dtype\": \"F32\", \"shape\": [4611686018427387904], "
                              "\"data_offsets\": [0, 4]}"),
                        4, MOE_ERR_FORMAT, T);

    /* offsets */
    p = st_write("bad.safetensors",
                 ENTRY("{\"dtype\": \"F32\", \"shape\": [8, 4], \"data_offsets\": [0, 100]}"),
                 builder.data, 100);
    expect_open_fails("size mismatch", p, MOE_ERR_FORMAT,
                      "bad.safetensors: tensor 'model.embed_tokens.weight': data_offsets [0, 100) "
                      "hold 100 bytes but shape [8, 4] x F32 needs 128",
                      NULL);
    expect_header_fails("offsets missing", ENTRY("{\"dtype\": \"F32\", \"shape\": [1]}"), 4,
                        MOE_ERR_FORMAT, "data_offsets");
    expect_header_fails("offsets 3",
                        ENTRY("{\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4, 8]}"),
                        8, MOE_ERR_FORMAT, T);
    expect_header_fails("offsets 1",
                        ENTRY("{\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4]}"), 8,
                        MOE_ERR_FORMAT, T);
    expect_header_fails("offsets negative",
                        ENTRY("{\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [-4, 0]}"), 8,
                        MOE_ERR_FORMAT, T);
    expect_header_fails("offsets fraction",
                        ENTRY("{\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0.5, 4.5]}"),
                        8, MOE_ERR_FORMAT, T);
    expect_header_fails("begin > end",
                        ENTRY("{\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [8, 4]}"), 8,
                        MOE_ERR_FORMAT, "begin > end");
    expect_header_fails("end past data",
                        ENTRY("{\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}"), 8,
                        MOE_ERR_FORMAT, "beyond the data area");
    expect_header_fails("end at 2^53",
                        ENTRY("{\"dtype\": \"F32\", \"shape\": [2251799813685248], "
                              "\"data_offsets\": [0, 9007199254740992]}"),
                        8, MOE_ERR_FORMAT, T);
#undef ENTRY

    /* overlap and duplicates */
    expect_header_fails("overlap",
                        "{\"w1\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
                        " \"w2\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [6, 10]}}",
                        12, MOE_ERR_FORMAT, "'w2'");
    expect_header_fails("overlap, listed in reverse",
                        "{\"w2\": {\"dtype\": \"F16\", \"shape\": [4], \"data_offsets\": [4, 12]},"
                        " \"w1\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}",
                        12, MOE_ERR_FORMAT, "overlaps tensor 'w1'");
    expect_header_fails("same range",
                        "{\"w1\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
                        " \"w2\": {\"dtype\": \"BF16\", \"shape\": [4], \"data_offsets\": [0, 8]}}",
                        12, MOE_ERR_FORMAT, "overlaps");
    p = st_write("ok.safetensors",
                 "{\"w1\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
                 " \"z\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [4, 4]},"
                 " \"w2\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 12]}}",
                 builder.data, 12);
    expect_open_fails("adjacent + empty inside", p, MOE_OK, NULL, NULL);
    expect_header_fails("duplicate name",
                        "{\"w1\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
                        " \"w1\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
                        8, MOE_ERR_FORMAT, "'w1' is defined twice");

    /* not a file */
    char missing[600];
    snprintf(missing, sizeof missing, "%s/missing.safetensors", test_temp_dir());
    expect_open_fails("missing file", missing, MOE_ERR_IO, "missing.safetensors", "No such file");
    char empty_dir[600];
    snprintf(empty_dir, sizeof empty_dir, "%s/empty_dir", test_temp_dir());
    mkdir(empty_dir, 0700);
    expect_open_fails("empty dir", empty_dir, MOE_ERR_NOT_FOUND, "model.safetensors.index.json",
                      "model.safetensors)");
}

/* ---- sharded ---------------------------------------------------------------- */

static char shard_dir[512];

static const char *in_shard_dir(const char *name)
{
    static char buf[1024];
    snprintf(buf, sizeof buf, "%s/%s", shard_dir, name);
    return buf;
}

static const char *write_index(const char *weight_map)
{
    char text[4096];
    snprintf(text, sizeof text, "{\"metadata\": {\"total_size\": 40}, \"weight_map\": %s}",
             weight_map);
    return test_write_temp("sharded/model.safetensors.index.json", text, strlen(text));
}

static const char *S1 = "model-00001-of-00002.safetensors";
static const char *S2 = "model-00002-of-00002.safetensors";

static void write_shards(void)
{
    snprintf(shard_dir, sizeof shard_dir, "%s/sharded", test_temp_dir());
    mkdir(shard_dir, 0700);
    float a[2][3] = {{1, 2, 3}, {4, 5, 6}}, c[2] = {7, 8};
    uint16_t bb[4] = {0x3F80, 0x4000, 0x4040, 0x4080}; /* 1 2 3 4 */
    st_builder_init(&builder, "{\"format\":\"pt\"}");
    st_builder_add(&builder, "a", "F32", "[2, 3]", a, sizeof a);
    st_builder_add(&builder, "b", "BF16", "[2, 2]", bb, sizeof bb);
    st_builder_write(&builder, "sharded/model-00001-of-00002.safetensors", 5);
    st_builder_init(&builder, NULL);
    st_builder_add(&builder, "c", "F32", "[2]", c, sizeof c);
    st_builder_write(&builder, "sharded/model-00002-of-00002.safetensors", 0);
}

static void test_sharded(void)
{
    write_shards();
    const char *good =
        "{\"a\": \"model-00001-of-00002.safetensors\", \"b\": \"model-00001-of-00002.safetensors\","
        " \"c\": \"model-00002-of-00002.safetensors\"}";
    write_index(good);
    /* a model.safetensors beside the index must lose to it */
    float x = 9;
    st_builder_init(&builder, NULL);
    st_builder_add(&builder, "x", "F32", "[1]", &x, 4);
    st_builder_write(&builder, "sharded/model.safetensors", 0);

    const char *opens[2] = {shard_dir, NULL};
    char index_path[1024];
    snprintf(index_path, sizeof index_path, "%s", in_shard_dir("model.safetensors.index.json"));
    opens[1] = index_path;
    for (int k = 0; k < 2; k++) {
        struct st_model *m = NULL;
        struct moe_error err = {0};
        enum moe_status st = st_open(opens[k], &m, &err);
        CHECKF(st == MOE_OK, "open sharded %s: %s", opens[k], err.msg);
        if (st != MOE_OK)
            continue;
        CHECK(st_count(m) == 3 && st_find(m, "x") == NULL);
        const struct st_tensor *a = st_find(m, "a"), *b = st_find(m, "b"), *c = st_find(m, "c");
        CHECK(a && strstr(a->file, S1) && b && strstr(b->file, S1) && c && strstr(c->file, S2));
        float v[4] = {0};
        CHECK(a && st_read_block(a, 1, 1, 0, 3, MOE_DTYPE_F32, v, &err) == MOE_OK && v[0] == 4 &&
              v[2] == 6);
        CHECK(b && st_read_block(b, 0, 2, 1, 1, MOE_DTYPE_F32, v, &err) == MOE_OK && v[0] == 2 &&
              v[1] == 4);
        CHECK(c && st_read_block(c, 0, 1, 0, 2, MOE_DTYPE_F32, v, &err) == MOE_OK && v[0] == 7 &&
              v[1] == 8);
        st_close(m);
    }

    /* a tensor in the shards but not in weight_map is still readable */
    write_index("{\"a\": \"model-00001-of-00002.safetensors\","
                " \"c\": \"model-00002-of-00002.safetensors\"}");
    expect_open_fails("unlisted tensor", shard_dir, MOE_OK, NULL, NULL);

    /* errors */
    write_index("{\"a\": \"model-00001-of-00002.safetensors\", \"zz\": "
                "\"model-00002-of-00002.safetensors\"}");
    expect_open_fails("listed but absent", shard_dir, MOE_ERR_FORMAT, "'zz'", S2);
    write_index(
        "{\"a\": \"model-00001-of-00002.safetensors\", \"c\": "
        "\"model-00001-of-00002.safetensors\", \"b\": \"model-00002-of-00002.safetensors\"}");
    expect_open_fails("in the other shard", shard_dir, MOE_ERR_FORMAT, "'c'", "found in");
    write_index("{\"a\": \"model-00001-of-00002.safetensors\", \"c\": "
                "\"model-00003-of-00003.safetensors\"}");
    expect_open_fails("missing shard", shard_dir, MOE_ERR_IO, "model-00003-of-00003.safetensors",
                      "No such file");
    write_index("{\"a\": \"model-00001-of-00002.safetensors\", \"a\": "
                "\"model-00001-of-00002.safetensors\"}");
    expect_open_fails("listed twice", shard_dir, MOE_ERR_FORMAT, "'a'", "twice");
    write_index("{\"a\": 1}");
    expect_open_fails("shard not a string", shard_dir, MOE_ERR_FORMAT, "'a'", "index.json");
    write_index("{\"a\": \"../model-00001-of-00002.safetensors\"}");
    expect_open_fails("shard outside", shard_dir, MOE_ERR_FORMAT, "outside", "'a'");
    write_index("{\"a\": \"/etc/passwd\"}");
    expect_open_fails("absolute shard", shard_dir, MOE_ERR_FORMAT, "outside", NULL);
    write_index("{}");
    expect_open_fails("empty weight_map", shard_dir, MOE_ERR_FORMAT, "empty", NULL);
    write_index("[1]");
    expect_open_fails("weight_map array", shard_dir, MOE_ERR_FORMAT, "weight_map", NULL);
    const char *p =
        test_write_temp("sharded/model.safetensors.index.json", "{\"weight_map\": ", 15);
    expect_open_fails("index not json", p, MOE_ERR_FORMAT, "model.safetensors.index.json", "JSON");

    /* the same tensor in two shards */
    float c2 = 1;
    st_builder_init(&builder, NULL);
    st_builder_add(&builder, "a", "F32", "[1]", &c2, 4);
    st_builder_write(&builder, "sharded/model-00002-of-00002.safetensors", 0);
    write_index("{\"b\": \"model-00001-of-00002.safetensors\", \"a\": "
                "\"model-00002-of-00002.safetensors\"}");
    expect_open_fails("tensor in two shards", shard_dir, MOE_ERR_FORMAT, "'a' is also in", S1);

    /* a bad shard is reported with the shard's name */
    st_write("sharded/model-00002-of-00002.safetensors",
             "{\"q\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 4]}}", &c2, 4);
    write_index("{\"a\": \"model-00001-of-00002.safetensors\", \"q\": "
                "\"model-00002-of-00002.safetensors\"}");
    expect_open_fails("bad shard", shard_dir, MOE_ERR_FORMAT, S2, "'q'");
}

/* ---- truncation and fuzz ------------------------------------------------------ */

static void test_truncated(void)
{
    write_valid("full.safetensors", 3);
    size_t n;
    unsigned char *full = st_build(builder.hlen, builder.header, builder.data, builder.n_data, &n);
    int n_ok = 0, n_err = 0;
    for (size_t cut = 0; cut <= n; cut++) {
        const char *p = test_write_temp("cut.safetensors", full, cut);
        struct st_model *m = NULL;
        struct moe_error err = {0};
        enum moe_status st = st_open(p, &m, &err);
        if (st == MOE_OK) {
            n_ok++;
            CHECKF(cut == n, "cut at %zu of %zu opened", cut, n);
        } else {
            n_err++;
            CHECKF(m == NULL && strstr(err.msg, "cut.safetensors"), "cut %zu: %s", cut, err.msg);
        }
        st_close(m);
    }
    CHECK(n_ok == 1 && n_err == (int)n);
    free(full);
}

static struct test_rng g_rng = {0x9E3779B97F4A7C15ull};

static void test_fuzz(void)
{
    write_valid("fuzz-base.safetensors", 0);
    char base[sizeof builder.header];
    memcpy(base, builder.header, builder.hlen + 1);
    size_t base_len = builder.hlen;
    static const char alphabet[] = "{}[]\",:0123456789-.eE \\ntfu";
    static const char *tokens[] = {
        "-1", "1e300",  "4294967296",       "null",        "\"BF16\"", "\"I64\"", "[]",
        "{}", "[0, 0]", "9007199254740993", "\"\\u0000\"", "0.5"};
    char hdr[sizeof builder.header + 64];
    int n_ok = 0, n_err = 0;
    for (int iter = 0; iter < 3000; iter++) {
        memcpy(hdr, base, base_len + 1);
        size_t len = base_len;
        int n_mut = 1 + (int)(test_rng_u32(&g_rng) % 3);
        for (int k = 0; k < n_mut; k++) {
            size_t at = test_rng_u32(&g_rng) % len;
            switch (test_rng_u32(&g_rng) % 6) {
            case 0: /* overwrite a byte */
                hdr[at] = alphabet[test_rng_u32(&g_rng) % (sizeof alphabet - 1)];
                break;
            case 1: /* delete a byte */
                memmove(hdr + at, hdr + at + 1, len - at);
                len--;
                break;
            case 2: { /* insert a token */
                const char *t = tokens[test_rng_u32(&g_rng) % (sizeof tokens / sizeof tokens[0])];
                size_t tl = strlen(t);
                if (len + tl + 1 >= sizeof hdr)
                    break;
                memmove(hdr + at + tl, hdr + at, len - at + 1);
                memcpy(hdr + at, t, tl);
                len += tl;
                break;
            }
            default: /* change a digit */
                for (size_t i = at; i < len; i++)
                    if (hdr[i] >= '0' && hdr[i] <= '9') {
                        hdr[i] = (char)('0' + test_rng_u32(&g_rng) % 10);
                        break;
                    }
                break;
            }
        }
        hdr[len] = '\0';
        size_t n_data = builder.n_data;
        if (test_rng_u32(&g_rng) % 8 == 0)
            n_data = test_rng_u32(&g_rng) % (n_data + 1); /* sometimes a short data area */
        size_t n;
        uint64_t hl_field = test_rng_u32(&g_rng) % 16 == 0
                                ? (uint64_t)test_rng_u32(&g_rng) % (len + 64)
                                : strlen(hdr);
        unsigned char *file = st_build(hl_field, hdr, builder.data, n_data, &n);
        const char *p = test_write_temp("fuzz.safetensors", file, n);
        free(file);
        struct st_model *m = NULL;
        struct moe_error err = {0};
        enum moe_status st = st_open(p, &m, &err);
        if (st != MOE_OK) {
            n_err++;
            if (m != NULL || !err.msg[0]) {
                CHECKF(0, "fuzz %d: error without a message or with a model", iter);
            }
            continue;
        }
        n_ok++;
        /* every tensor is readable in full */
        for (size_t i = 0; i < st_count(m); i++) {
            const struct st_tensor *t = st_get(m, i);
            const unsigned char *d = t->data;
            unsigned sum = 0;
            for (size_t b = 0; b < t->nbytes; b++)
                sum += d[b];
            (void)sum;
            if (t->n_dim <= 2 && t->nbytes <= 4096) {
                float out[1024];
                int64_t rows = t->n_dim == 2 ? t->shape[0] : 1;
                int64_t cols = t->n_dim == 0 ? 1 : t->shape[t->n_dim - 1];
                enum moe_status rs = st_read_block(t, 0, rows, 0, cols, MOE_DTYPE_F32, out, &err);
                if (rs != MOE_OK)
                    CHECKF(0, "fuzz %d: read '%s': %s", iter, t->name, err.msg);
            }
            if (st_find(m, t->name) != t)
                CHECKF(0, "fuzz %d: find '%s'", iter, t->name);
        }
        st_close(m);
    }
    printf("fuzz: %d opened, %d refused\n", n_ok, n_err);
    CHECK(n_ok > 0 && n_err > 0);
}

/* Many tensors: the hash map grows and finds all of them. */
static void test_many(void)
{
    static char header[300000];
    size_t len = (size_t)snprintf(header, sizeof header, "{");
    int n = 3000;
    for (int i = 0; i < n; i++)
        len +=
            (size_t)snprintf(header + len, sizeof header - len,
                             "%s\"model.layers.%d.mlp.experts.%d.w1.weight\":{\"dtype\":\"BF16\","
                             "\"shape\":[1],\"data_offsets\":[%d,%d]}",
                             i ? "," : "", i / 8, i % 8, 2 * i, 2 * i + 2);
    snprintf(header + len, sizeof header - len, "}");
    unsigned char *data = calloc((size_t)n, 2);
    for (int i = 0; i < n; i++)
        data[2 * i] = (unsigned char)i;
    const char *p = st_write("many.safetensors", header, data, (size_t)n * 2);
    free(data);
    struct st_model *m = NULL;
    struct moe_error err = {0};
    CHECKF(st_open(p, &m, &err) == MOE_OK, "%s", err.msg);
    CHECK(st_count(m) == (size_t)n);
    int bad = 0;
    for (int i = 0; i < n; i++) {
        char name[96];
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.w1.weight", i / 8, i % 8);
        const struct st_tensor *t = st_find(m, name);
        bad += !t || ((const unsigned char *)t->data)[0] != (unsigned char)i;
    }
    CHECK(bad == 0);
    st_close(m);
}

int main(void)
{
    test_valid_single();
    test_malformed();
    test_sharded();
    test_truncated();
    test_many();
    test_fuzz();
    return test_summary();
}
