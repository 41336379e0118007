#include "read_file.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/stat.h>

enum moe_status moe_read_file(const char *path, size_t max_bytes, char **out, size_t *len,
                              struct moe_error *err)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f)
        return moe_error_set(err, errno == ENOENT ? MOE_ERR_NOT_FOUND : MOE_ERR_IO, "%s: %s", path,
                             strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) == 0 && S_ISDIR(sb.st_mode)) {
        fclose(f);
        return moe_error_set(err, MOE_ERR_IO, "%s: %s", path, strerror(EISDIR));
    }
    enum moe_status rc;
    /* grown as it is read: a pipe or /proc file has no size up front; one
     * byte past the limit tells a file that is over it */
    const size_t over = max_bytes < SIZE_MAX - 1 ? max_bytes + 1 : SIZE_MAX - 1;
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            if (cap > max_bytes) {
                rc = moe_error_set(err, MOE_ERR_FORMAT, "%s: larger than the %zu-byte limit", path,
                                   max_bytes);
                goto fail;
            }
            size_t want = cap ? (cap < over / 2 ? 2 * cap : over) : 65536;
            if (want > over)
                want = over;
            char *grown = want > cap ? realloc(buf, want + 1) : NULL;
            if (!grown) {
                rc = moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", path);
                goto fail;
            }
            buf = grown;
            cap = want;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    if (ferror(f)) {
        rc = moe_error_set(err, MOE_ERR_IO, "%s: read error", path);
        goto fail;
    }
    if (n > max_bytes) {
        rc = moe_error_set(err, MOE_ERR_FORMAT, "%s: larger than the %zu-byte limit", path,
                           max_bytes);
        goto fail;
    }
    fclose(f);
    buf[n] = '\0';
    if (len)
        *len = n;
    *out = buf;
    return MOE_OK;
fail:
    fclose(f);
    free(buf);
    return rc;
}

enum moe_status moe_read_text(const char *path, size_t max_bytes, char **out, struct moe_error *err)
{
    size_t n;
    enum moe_status rc = moe_read_file(path, max_bytes, out, &n, err);
    if (!rc && memchr(*out, '\0', n)) {
        free(*out);
        *out = NULL;
        rc = moe_error_set(err, MOE_ERR_FORMAT, "%s: contains a NUL byte", path);
    }
    return rc;
}
