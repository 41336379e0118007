/* Read-only access to Hugging Face safetensors checkpoints, single file or
 * sharded (model.safetensors.index.json), memory-mapped.
 *
 * Every header is validated when it is opened: header length against the
 * file size, JSON syntax, dtype names, shape x dtype size == end - begin,
 * offsets inside the data area and no two tensors overlapping. After a
 * successful open, every tensor's `data` points at `nbytes` readable bytes. */
#ifndef MOE_SAFETENSORS_H
#define MOE_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "moe_error.h"

#define ST_MAX_DIMS 8

struct st_tensor {
    const char *name; /* owned by the st_model */
    enum moe_dtype dtype;
    int n_dim; /* 0 for a scalar */
    int64_t shape[ST_MAX_DIMS];
    const void *data; /* inside the mmapped file; may be unaligned */
    size_t nbytes;
    const char *file; /* path of the shard that holds it */
};

struct st_model;

/* Opens `path`, which is either a .safetensors file, a
 * model.safetensors.index.json, or a directory holding one of
 * model.safetensors.index.json / model.safetensors (the index wins).
 * On error returns non-OK with a message naming the file, *out is NULL and
 * nothing stays open. */
enum moe_status st_open(const char *path, struct st_model **out, struct moe_error *err);

/* The same checks on one .safetensors file already in memory (`len` bytes at
 * `data`); `name` stands for the file in messages. The model borrows `data`:
 * the tensors point into it, so it must outlive st_close. */
enum moe_status st_open_buffer(const void *data, size_t len, const char *name,
                               struct st_model **out, struct moe_error *err);

/* Unmaps everything. NULL is a no-op. */
void st_close(struct st_model *m);

/* Tensor by name, or NULL. */
const struct st_tensor *st_find(const struct st_model *m, const char *name);

size_t st_count(const struct st_model *m);
const struct st_tensor *st_get(const struct st_model *m, size_t i);

/* Copies the 2-D block rows [row0, row0+n_rows) x cols [col0, col0+n_cols)
 * of a 1-D or 2-D tensor (a 1-D tensor is one row) into `dst`, converting to
 * `dst_dtype` (F32 or BF16; F16 and BF16 sources convert exactly to F32,
 * F32 -> BF16 rounds to nearest even). `dst` is n_rows x n_cols, dense.
 * The block must lie inside the tensor: out-of-range is MOE_ERR_INVALID with
 * the tensor's name. This is how tensor-parallel ranks load their slice. */
enum moe_status st_read_block(const struct st_tensor *t, int64_t row0, int64_t n_rows, int64_t col0,
                              int64_t n_cols, enum moe_dtype dst_dtype, void *dst,
                              struct moe_error *err);

#endif
