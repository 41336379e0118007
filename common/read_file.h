/* Whole files for the parsers (config.json, tokenizer.json, placements,
 * chat templates, PEM and token files, prompts): read at once, with a size
 * limit, every failure a moe_error that names the path. */
#ifndef MOE_READ_FILE_H
#define MOE_READ_FILE_H

#include <stddef.h>

#include "moe_error.h"

/* *out: the bytes of the file at path (malloc'd, with a NUL after the
 * last), *len (may be NULL) their number. On failure *out is NULL and err
 * says "PATH: why": absent (MOE_ERR_NOT_FOUND), a directory or unreadable
 * (MOE_ERR_IO), more than max_bytes (MOE_ERR_FORMAT), out of memory. */
enum moe_status moe_read_file(const char *path, size_t max_bytes, char **out, size_t *len,
                              struct moe_error *err);

/* As moe_read_file for a text, which a NUL byte would cut short: one in
 * the file is refused (MOE_ERR_FORMAT, "PATH: contains a NUL byte"). */
enum moe_status moe_read_text(const char *path, size_t max_bytes, char **out,
                              struct moe_error *err);

#endif
