/* Fuzz target: model.safetensors.index.json (common/safetensors.c,
 * index_load): the input is the index, written next to two small valid
 * shards (a.safetensors: a.x, a.y; b.safetensors: b.z) in a temporary
 * directory and opened with st_open. Shard names that leave the directory,
 * tensors missing from or listed twice in their shard, an empty or absent
 * weight_map must all be refused by name; an accepted index must expose
 * exactly the listed tensors. */
#include <unistd.h>

#include "fuzz.h"
#include "safetensors.h"

static char dir[256];
static char index_path[300];

static void write_file(const char *name, const char *header, size_t n_data)
{
    char path[400];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        abort();
    }
    uint64_t hl = strlen(header);
    for (int i = 0; i < 8; i++)
        fputc((int)(hl >> (8 * i)) & 0xff, f);
    fputs(header, f);
    for (size_t i = 0; i < n_data; i++)
        fputc((int)i, f);
    fclose(f);
}

static void cleanup(void)
{
    static const char *const files[] = {"a.safetensors", "b.safetensors",
                                        "model.safetensors.index.json"};
    char path[400];
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        unlink(path);
    }
    rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/moe-fuzz-index-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) {
        perror(dir);
        abort();
    }
    atexit(cleanup);
    write_file("a.safetensors",
               "{\"a.x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"a.y\":{\"dtype\":\"BF16\",\"shape\":[1,2],\"data_offsets\":[8,12]}}",
               12);
    write_file("b.safetensors",
               "{\"__metadata__\":{\"format\":\"pt\"},"
               "\"b.z\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[0,6]}}",
               6);
    snprintf(index_path, sizeof index_path, "%s/model.safetensors.index.json", dir);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    FILE *f = fopen(index_path, "wb");
    FUZZ_CHECK(f && fwrite(data, 1, size, f) == size && fclose(f) == 0, "cannot write %s",
               index_path);
    struct st_model *m = (struct st_model *)1;
    struct moe_error err = {0};
    enum moe_status st = st_open(dir, &m, &err);
    if (st != MOE_OK) {
        FUZZ_CHECK(m == NULL && err.code == st && fuzz_msg_ok(err.msg), "status %d: '%s'", st,
                   err.msg);
        return 0;
    }
    /* every tensor is one of the shards' and lies in its mapping */
    for (size_t i = 0; i < st_count(m); i++) {
        const struct st_tensor *t = st_get(m, i);
        FUZZ_CHECK(!strcmp(t->name, "a.x") || !strcmp(t->name, "a.y") || !strcmp(t->name, "b.z"),
                   "unexpected tensor '%s'", t->name);
        FUZZ_CHECK(st_find(m, t->name) == t, "'%s' not found by name", t->name);
        FUZZ_CHECK(strncmp(t->file, dir, strlen(dir)) == 0, "'%s' from %s, outside %s", t->name,
                   t->file, dir);
        float out[4];
        FUZZ_CHECK(t->n_dim > 2 || st_read_block(t, 0, t->n_dim == 2 ? t->shape[0] : 1, 0,
                                                 t->n_dim ? t->shape[t->n_dim - 1] : 1,
                                                 MOE_DTYPE_F32, out, &err) == MOE_OK,
                   "%s", err.msg);
    }
    st_close(m);
    return 0;
}
