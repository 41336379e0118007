/* common/read_file: whole files for the parsers, their limit and errors. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "read_file.h"
#include "testlib.h"

/* A file of n bytes (byte i = 'a' + i % 26) read with limit max: read
 * whole, NUL after it, exactly when n <= max. */
static void check_size(size_t n, size_t max)
{
    char *data = calloc(n ? n : 1, 1);
    for (size_t i = 0; i < n; i++)
        data[i] = (char)('a' + i % 26);
    const char *p = test_write_temp("sized.txt", data, n);
    char *got;
    size_t len = 12345;
    struct moe_error err = {0};
    enum moe_status rc = moe_read_file(p, max, &got, &len, &err);
    if (n <= max) {
        CHECKF(rc == MOE_OK && len == n && got && !memcmp(got, data, n) && got[n] == '\0',
               "%zu bytes, limit %zu: %s", n, max, err.msg);
    } else {
        CHECKF(rc == MOE_ERR_FORMAT && !got && strstr(err.msg, "sized.txt: larger than the") &&
                   strstr(err.msg, "-byte limit"),
               "%zu bytes, limit %zu: rc %d %s", n, max, rc, err.msg);
    }
    free(got);
    free(data);
}

int main(void)
{
    /* around the first and later growth steps, and at the limit */
    const size_t sizes[] = {0, 1, 65535, 65536, 65537, 131072, 200001};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t n = sizes[i];
        check_size(n, n);
        check_size(n, n + 1);
        check_size(n, SIZE_MAX);
        if (n)
            check_size(n, n - 1);
    }

    struct moe_error err = {0};
    char *got;
    size_t len;
    char missing[600];
    snprintf(missing, sizeof missing, "%s/nope.json", test_temp_dir());
    CHECK(moe_read_file(missing, 1024, &got, &len, &err) == MOE_ERR_NOT_FOUND && !got);
    CHECKF(strstr(err.msg, "nope.json: No such file or directory"), "%s", err.msg);
    CHECK(moe_read_text(test_temp_dir(), 1024, &got, &err) == MOE_ERR_IO && !got);
    CHECKF(strstr(err.msg, test_temp_dir()) && strstr(err.msg, "Is a directory"), "%s", err.msg);

    /* a NUL byte: data to moe_read_file, refused by moe_read_text */
    const char *p = test_write_temp("nul.json", "{\"a\":\0}", 7);
    CHECK(moe_read_file(p, 1024, &got, &len, &err) == MOE_OK && len == 7);
    free(got);
    CHECK(moe_read_text(p, 1024, &got, &err) == MOE_ERR_FORMAT && !got);
    CHECKF(strstr(err.msg, "nul.json: contains a NUL byte"), "%s", err.msg);

    /* no size up front (st_size 0): read to its end all the same */
    CHECK(moe_read_text("/proc/self/status", 1 << 20, &got, &err) == MOE_OK);
    CHECKF(got && strstr(got, "Name:") && strstr(got, "Pid:"), "%.80s", got ? got : "(null)");
    free(got);
    return test_summary();
}
