/* Fuzz target: one .safetensors file (common/safetensors.c) from bytes:
 * the 8-byte header length, the JSON header, every tensor entry's dtype,
 * shape and data_offsets, overlap checks. Every tensor the reader accepts
 * must lie inside the input, be found by its name, and read back through
 * st_read_block in both destination dtypes. */
#include "fuzz.h"
#include "safetensors.h"

#define NAME "fuzz.safetensors"

static void read_corners(const struct st_tensor *t)
{
    if (t->n_dim > 2)
        return;
    int64_t rows = t->n_dim == 2 ? t->shape[0] : 1;
    int64_t cols = t->n_dim == 0 ? 1 : t->shape[t->n_dim - 1];
    int64_t nr = rows < 2 ? rows : 2, nc = cols < 8 ? cols : 8;
    float f32[16];
    uint16_t bf16[16];
    struct moe_error err = {0};
    for (int corner = 0; corner < 2; corner++) {
        int64_t r0 = corner ? rows - nr : 0, c0 = corner ? cols - nc : 0;
        FUZZ_CHECK(st_read_block(t, r0, nr, c0, nc, MOE_DTYPE_F32, f32, &err) == MOE_OK, "%s",
                   err.msg);
        FUZZ_CHECK(st_read_block(t, r0, nr, c0, nc, MOE_DTYPE_BF16, bf16, &err) == MOE_OK, "%s",
                   err.msg);
    }
    /* one past the end is refused, naming the tensor (control characters
     * written as '?': a message is one line) */
    char name[256];
    snprintf(name, sizeof name, "%s", t->name);
    for (char *c = name; *c; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7f)
            *c = '?';
    FUZZ_CHECK(st_read_block(t, 0, rows + 1, 0, 1, MOE_DTYPE_F32, f32, &err) == MOE_ERR_INVALID &&
                   (strlen(t->name) >= sizeof name - 1 || strstr(err.msg, name)),
               "%s", err.msg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct st_model *m = (struct st_model *)1;
    struct moe_error err = {0};
    enum moe_status st = st_open_buffer(data, size, NAME, &m, &err);
    if (st != MOE_OK) {
        FUZZ_CHECK(m == NULL && err.code == st && fuzz_msg_ok(err.msg), "status %d: '%s'", st,
                   err.msg);
        FUZZ_CHECK(st == MOE_ERR_NOMEM || strstr(err.msg, NAME), "%s", err.msg);
        return 0;
    }
    const uint8_t *end = data + size;
    for (size_t i = 0; i < st_count(m); i++) {
        const struct st_tensor *t = st_get(m, i);
        const uint8_t *p = t->data;
        FUZZ_CHECK(p >= data + 8 && p <= end && t->nbytes <= (size_t)(end - p),
                   "tensor '%s' outside the input", t->name);
        uint64_t n = moe_dtype_size(t->dtype);
        for (int d = 0; d < t->n_dim; d++)
            n *= (uint64_t)t->shape[d];
        FUZZ_CHECK(n == t->nbytes, "tensor '%s': %zu bytes for its shape", t->name, t->nbytes);
        FUZZ_CHECK(st_find(m, t->name) == t, "tensor '%s' not found by name", t->name);
        read_corners(t);
    }
    st_close(m);
    return 0;
}
